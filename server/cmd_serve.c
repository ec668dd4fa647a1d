/* cmd_serve: `pdserve serve [MODEL] [flags]` — parse the vllm-serve-style
 * flags, load the model into an engine, serve the OpenAI API until SIGINT or
 * SIGTERM, then drain: stop accepting, give in-flight requests
 * --shutdown-timeout seconds, abort the rest, and tear everything down.
 * Signals are taken synchronously with sigwait() in this thread (blocked in
 * every other thread), so nothing runs inside a signal handler. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "connector/announce.h"
#include "model/config.h"
#include "server/commands.h"
#include "server/http.h"
#include "server/serve_options.h"

#define MAX_BODY_BYTES (4u << 20)

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Wait until no request is in flight or the deadline passes. */
static bool wait_idle(http_server *s, double seconds) {
    double end = pd_now() + seconds;
    while (http_server_active(s) > 0) {
        if (pd_now() >= end) return false;
        sleep_ms(20);
    }
    return true;
}

typedef struct serve_state {
    char *model_dir;
    engine *eng;
    metrics *met;
    http_server *http;
    announcer *ann; /* discovery announcements to a proxy, when configured */
} serve_state;

static int serve_run(serve_options *o, serve_state *st, pd_err *err) {
    if (resolve_model_arg(o->model_arg, &st->model_dir, err) != 0) return -1;
    opt_config mc;
    if (opt_config_load(st->model_dir, &mc, err) != 0) return -1;
    /* --dtype auto needs the checkpoint's dtype: the backend is chosen now. */
    if (serve_options_select_backend(o, mc.torch_dtype, err) != 0) return -1;
    if (o->max_model_len_value > mc.max_position_embeddings)
        return pd_fail(err,
                       "--max-model-len %d is greater than the model's max_position_embeddings %d",
                       o->max_model_len_value, mc.max_position_embeddings);
    engine_config ec;
    engine_config_default(&ec);
    serve_options_to_engine(o, st->model_dir, &ec);

    /* Block the signals before any thread starts, so all threads inherit the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN); /* a vanished client must not kill the server */

    double t0 = pd_now();
    if (engine_create(&ec, &st->eng, err) != 0) return -1;
    const char *name = o->n_names ? o->names[0] : o->model_arg ? o->model_arg : "pdserve-default";
    const char *names_default[1] = {name};
    st->met = metrics_create(name, engine_max_model_len(st->eng));
    if (!st->met) return pd_fail(err, "out of memory");
    http_config hc = {
        .host = o->host,
        .port = o->port,
        .api_key = o->api_key,
        .names = o->n_names ? o->names : names_default,
        .n_names = o->n_names ? o->n_names : 1,
        .model_root = st->model_dir,
        .max_logprobs = o->max_logprobs,
        .max_body_bytes = MAX_BODY_BYTES,
    };
    if (http_server_start(&hc, st->eng, st->met, &st->http, err) != 0) return -1;
    pd_log(PD_LOG_INFO,
           "serving %s as '%s' on http://%s:%d (max_model_len %d, %d KV blocks of %d tokens, "
           "ready in %.2f s)",
           st->model_dir, name, o->host ? o->host : "0.0.0.0", http_server_port(st->http),
           engine_max_model_len(st->eng), engine_num_blocks(st->eng), engine_block_size(st->eng),
           pd_now() - t0);
    kv_connector *conn = engine_connector(st->eng);
    if (conn && announcer_start_for_instance(kv_connector_config(conn), kv_connector_address(conn), o->host,
                                             http_server_port(st->http), &st->ann, err) != 0)
        return -1;

    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    pd_log(PD_LOG_INFO, "%s: draining (%d requests in flight, up to %.0f s)",
           sig == SIGINT ? "SIGINT" : "SIGTERM", http_server_active(st->http),
           (double)o->shutdown_timeout);
    announcer_stop(st->ann); /* leave the proxy's registry first, so no new requests come */
    st->ann = NULL;
    http_server_quiesce(st->http);
    if (!wait_idle(st->http, o->shutdown_timeout)) {
        pd_log(PD_LOG_WARN, "aborting %d requests still running", http_server_active(st->http));
        http_server_abort_all(st->http);
        wait_idle(st->http, 5.0);
    }
    return 0;
}

int cmd_serve(int argc, char **argv) {
    serve_options o;
    pd_err err = {{0}};
    if (serve_options_parse(argc, argv, &o, &err) != 0) {
        fprintf(stderr, "pdserve serve: %s\n", err.msg);
        return 2;
    }
    if (o.help) {
        serve_options_help();
        return 0;
    }
    pd_log_set_level(o.log_level_value);
    serve_options_log_ignored(&o);
    serve_state st = {0};
    int rc = serve_run(&o, &st, &err);
    if (rc != 0) fprintf(stderr, "pdserve serve: %s\n", err.msg);
    announcer_stop(st.ann);
    /* Order matters: the HTTP threads use the engine and the metrics. */
    http_server_stop(st.http);
    if (st.eng) engine_destroy(st.eng);
    metrics_free(st.met);
    free(st.model_dir);
    if (rc == 0) pd_log(PD_LOG_INFO, "stopped");
    return rc == 0 ? 0 : (strstr(err.msg, "--max-model-len") ? 2 : 1);
}
