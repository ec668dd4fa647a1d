/* test_connector: kv_connector_save on one connector and the load on another,
 * in this process (tiny generated model, CPU backend, tcp on 127.0.0.1). After
 * load_apply the consumer's paged cache must hold exactly the producer's K and
 * V rows of the prompt's first n - 1 tokens, in its own blocks, and nothing
 * else may change. Each send type runs twice: on the plain CPU backend, and on
 * one that offers page-locked host memory and asynchronous host-to-device
 * copies (emulated with malloc and memcpy), which is what makes the consumer
 * stage each tcp layer on arrival, as it does on a GPU. The ASan build checks
 * that staged buffers, received tensors and the pool are all given back. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "connector/connector.h"
#include "model/make_model.h"
#include "tests/common/testlib.h"

#define NUM_BLOCKS 16
#define BLOCK_SIZE 8

/* What the emulated GPU-like backend was asked to do. */
static int host_allocs, async_copies;

static void *fake_host_alloc(pd_backend *be, size_t bytes, pd_err *err) {
    (void)be, (void)err;
    host_allocs++;
    return malloc(bytes);
}

static void fake_host_free(pd_backend *be, void *p) {
    (void)be;
    free(p);
}

/* The CPU backend's "device" memory is host memory, so a copy is a memcpy. */
static int fake_copy_h2d_async(pd_backend *be, void *dst, const void *src, size_t bytes,
                               pd_err *err) {
    (void)be, (void)err;
    async_copies++;
    memcpy(dst, src, bytes);
    return 0;
}

static float pattern(int layer, int kv, size_t i) {
    return (float)((layer * 7919 + kv * 104729 + (long)i) % 100003) * 0.001f;
}

/* Every element of every layer's K and V: the pattern (producer) or -1. */
static void fill_cache(const opt_kv_storage *kv, int layers, size_t floats_per_layer,
                       bool with_pattern) {
    for (int l = 0; l < layers; l++) {
        void *k, *v;
        opt_kv_layer(kv, l, &k, &v);
        for (size_t i = 0; i < floats_per_layer; i++) {
            ((float *)k)[i] = with_pattern ? pattern(l, 0, i) : -1.0f;
            ((float *)v)[i] = with_pattern ? pattern(l, 1, i) : -1.0f;
        }
    }
}

static kv_connector *connector(kv_role role, kv_send_type send, opt_model *m, opt_kv_storage *kv,
                               pd_backend *be) {
    kv_transfer_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.role = role;
    snprintf(cfg.kv_ip, sizeof cfg.kv_ip, "127.0.0.1");
    cfg.kv_port = 0; /* any free port */
    cfg.kv_buffer_size = 1e8;
    cfg.send_type = send;
    cfg.transport = KV_TRANSPORT_TCP;
    cfg.timeout_s = 10;
    cfg.announce_interval_s = 3;
    kv_connector *c = NULL;
    pd_err err = {{0}};
    CHECKF(kv_connector_create(&cfg, m, kv, be, 8000, NULL, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

/* One prompt of n tokens from the producer's blocks prod_table into the
 * consumer's blocks cons_table; apply=false abandons the load instead. */
static void transfer(kv_send_type send, bool staged, opt_model *m, pd_backend *be, int n,
                     bool apply) {
    const opt_config *mc = opt_model_config(m);
    const int layers = mc->num_hidden_layers, dim = mc->hidden_size;
    const size_t floats = (size_t)NUM_BLOCKS * BLOCK_SIZE * (size_t)dim;
    opt_kv_storage *kv_p = NULL, *kv_c = NULL;
    pd_err err = {{0}};
    CHECKF(opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_p, &err) == 0, "%s", err.msg);
    CHECKF(opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_c, &err) == 0, "%s", err.msg);
    if (!kv_p || !kv_c) return;
    fill_cache(kv_p, layers, floats, true);
    fill_cache(kv_c, layers, floats, false);
    const int32_t prod_table[] = {5, 2, 9, 14};
    const int32_t cons_table[] = {3, 11, 0, 7};
    host_allocs = async_copies = 0;

    kv_connector *prod = connector(KV_ROLE_PRODUCER, send, m, kv_p, be);
    kv_connector *cons = connector(KV_ROLE_CONSUMER, send, m, kv_c, be);
    if (!prod || !cons) goto out;

    kv_request_params sp;
    memset(&sp, 0, sizeof sp);
    sp.present = sp.do_remote_decode = true;
    snprintf(sp.remote_kv_addr, sizeof sp.remote_kv_addr, "%s", kv_connector_address(cons));
    kv_save_result saved;
    CHECKF(kv_connector_save(prod, &sp, prod_table, n, "test", &saved, &err) == 0, "%s", err.msg);
    CHECK(saved.num_tokens == n);

    kv_request_params lp;
    memset(&lp, 0, sizeof lp);
    lp.present = lp.do_remote_prefill = true;
    snprintf(lp.remote_kv_addr, sizeof lp.remote_kv_addr, "%s", saved.kv_addr);
    snprintf(lp.remote_request_id, sizeof lp.remote_request_id, "%s", saved.transfer_id);
    kv_load *load = NULL;
    CHECKF(kv_connector_load_begin(cons, &lp, n, "test", &load, &err) == 0, "%s", err.msg);
    int got = 0, status = 0;
    for (double end = pd_now() + 10; load && got == 0 && pd_now() < end;) {
        got = kv_connector_load_poll(cons, load, &status, &err);
        if (got == 0) usleep(500);
    }
    CHECKF(got == 1, "load_poll %d: %s", got, err.msg);

    /* Staged layers left the transfer engine's buffers when they were taken;
     * unstaged ones stay there until load_end. */
    kv_connector_stats st;
    kv_connector_stats_get(cons, &st);
    CHECKF(staged ? st.buffered_bytes == 0 : st.buffered_bytes > 0,
           "buffered %zu bytes (staged %d)", st.buffered_bytes, staged);
    CHECKF(staged ? host_allocs > 0 : host_allocs == 0, "host_alloc called %d times", host_allocs);

    if (got == 1 && apply) {
        CHECKF(kv_connector_load_apply(cons, load, cons_table, n - 1, &err) == 0, "%s", err.msg);
        CHECKF(async_copies == (staged ? layers : 0), "%d async copies for %d layers", async_copies,
               layers);
    }
    kv_connector_load_end(cons, load);
    kv_connector_stats_get(cons, &st);
    CHECKF(st.buffered_bytes == 0, "%zu bytes still buffered after load_end", st.buffered_bytes);
    CHECK(st.loads_ok == (apply ? 1u : 0u));

    /* Token t's row lives at slot table[t / B] * B + t % B of each array. */
    size_t wrong = 0, touched = 0;
    for (int l = 0; l < layers; l++) {
        void *k[2], *v[2];
        opt_kv_layer(kv_p, l, &k[0], &v[0]);
        opt_kv_layer(kv_c, l, &k[1], &v[1]);
        for (int kind = 0; kind < 2; kind++) {
            const float *src = kind ? v[0] : k[0], *dst = kind ? v[1] : k[1];
            for (size_t slot = 0; slot < (size_t)NUM_BLOCKS * BLOCK_SIZE; slot++) {
                int t = -1; /* the prompt token the consumer keeps at this slot, if any */
                for (int b = 0; b < 4; b++)
                    if ((size_t)cons_table[b] == slot / BLOCK_SIZE)
                        t = b * BLOCK_SIZE + (int)(slot % BLOCK_SIZE);
                const bool written = apply && t >= 0 && t < n - 1;
                const size_t from = written ? ((size_t)prod_table[t / BLOCK_SIZE] * BLOCK_SIZE +
                                               (size_t)(t % BLOCK_SIZE))
                                            : 0;
                for (int d = 0; d < dim; d++) {
                    float want = written ? src[from * (size_t)dim + (size_t)d] : -1.0f;
                    float have = dst[slot * (size_t)dim + (size_t)d];
                    wrong += have != want;
                    touched += have != -1.0f;
                }
            }
        }
    }
    CHECKF(wrong == 0, "%zu cache values wrong (send %s, staged %d, n %d, apply %d)", wrong,
           kv_send_type_name(send), staged, n, apply);
    CHECK(touched == (apply ? (size_t)(n - 1) * (size_t)dim * 2 * (size_t)layers : 0));
out:
    kv_connector_destroy(cons);
    kv_connector_destroy(prod);
    opt_kv_storage_free(kv_c);
    opt_kv_storage_free(kv_p);
}

int main(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny", test_tmpdir());
    pd_err err = {{0}};
    CHECKF(opt_make_model(dir, "tiny", 5, PD_F32, &err) == 0, "%s", err.msg);
    for (int staged = 0; staged < 2; staged++) {
        pd_backend *be = NULL;
        opt_model *m = NULL;
        CHECKF(pd_backend_create("cpu", 1, &be, &err) == 0, "%s", err.msg);
        if (!be) break;
        if (staged) { /* a backend with page-locked memory, as CUDA's */
            be->host_alloc = fake_host_alloc;
            be->host_free = fake_host_free;
            be->copy_h2d_async = fake_copy_h2d_async;
        }
        CHECKF(opt_model_load(dir, be, &m, &err) == 0, "%s", err.msg);
        const kv_send_type sends[] = {KV_SEND_PUT, KV_SEND_PUT_ASYNC, KV_SEND_GET};
        for (int s = 0; m && s < 3; s++) {
            transfer(sends[s], staged, m, be, 21, true); /* three blocks, the last one partly */
            transfer(sends[s], staged, m, be, 17,
                     true); /* the n - 1 written tokens fill two blocks */
            transfer(sends[s], staged, m, be, 2, true);   /* one token written */
            transfer(sends[s], staged, m, be, 21, false); /* taken, then abandoned */
        }
        opt_model_free(m);
        pd_backend_destroy(be);
    }
    return test_finish();
}
