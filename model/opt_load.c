/* opt_load: opt_model_load, the one place that ties a model directory
 * (config + checkpoint + weight binding) to opt_model_create. Kept apart
 * from opt.c so code that builds weights in memory links without the
 * checkpoint readers. */
#include "model/checkpoint.h"
#include "model/opt.h"
#include "model/weights.h"

int opt_model_load(const char *model_dir, pd_backend *be, opt_model **out, pd_err *err) {
    *out = NULL;
    opt_config cfg;
    if (opt_config_load(model_dir, &cfg, err) != 0) return -1;
    checkpoint *ckpt = NULL;
    if (checkpoint_open(model_dir, &ckpt, err) != 0) return -1;
    opt_weights w = {0};
    int rc = opt_weights_bind(&cfg, ckpt, &w, err);
    const bool bound = rc == 0;
    if (rc == 0) rc = opt_model_create(&cfg, &w, be, out, err);
    /* The backend holds converted copies now (or failed): the bound views go. */
    if (bound) opt_weights_release(&w);
    checkpoint_close(ckpt);
    return rc == 0 ? 0 : pd_wrap(err, "%s", model_dir);
}
