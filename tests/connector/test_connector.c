/* test_connector: kv_connector_save on one connector and the load on another,
 * in this process (tiny generated model, CPU backend, tcp on 127.0.0.1). After
 * the load the consumer's paged cache must hold exactly the producer's K and
 * V rows of the prompt's first n - 1 tokens, in its own blocks, and nothing
 * else may change. Each send type runs twice: with the consumer's blocks
 * given to load_poll (each layer is written as it arrives: the cache is
 * complete and the transfer engine holds nothing once the poll reports
 * everything in, before load_apply), and without (nothing is written until
 * load_apply). All of it runs twice more with recv_into_pinned and the CPU
 * backend given emulated page-locked memory and queued copies, as a GPU
 * backend has them: every layer written must then go through a queued copy.
 * The ASan build checks that received tensors are all freed. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "connector/connector.h"
#include "model/make_model.h"
#include "tests/common/testlib.h"

#define NUM_BLOCKS 16
#define BLOCK_SIZE 8

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

/* Page-locked memory and queued copies, as a GPU backend has them, emulated
 * on the CPU backend for the recv_into_pinned pass; queued copies are
 * counted so the test knows that path ran. */
static int queued_copies;
/* A backend's host_alloc may not run beside its other calls, so only the
 * thread that drives the connector (here main) may call it, never the
 * transfer engine's. */
static pthread_t main_thread;
static atomic_int foreign_host_allocs;
static void *emu_host_alloc(pd_backend *be, size_t bytes, pd_err *err) {
    (void)be;
    if (!pthread_equal(pthread_self(), main_thread)) atomic_fetch_add(&foreign_host_allocs, 1);
    void *p = malloc(bytes);
    if (!p) pd_fail(err, "out of memory");
    return p;
}
static void emu_host_free(pd_backend *be, void *p) {
    (void)be;
    free(p);
}
static int emu_copy_h2d_async(pd_backend *be, void *dst, const void *src, size_t bytes,
                              pd_err *err) {
    (void)be, (void)err;
    memcpy(dst, src, bytes);
    queued_copies++;
    return 0;
}

/* mem_pool_size_gb of the connectors the next transfers make (0: the
 * default, 1 GiB); one pass sets room for a single 64 KiB buffer. */
static double pool_gb;

static kv_connector *connector(kv_role role, kv_send_type send, bool pinned, opt_model *m,
                               opt_kv_storage *kv, pd_backend *be) {
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
    cfg.recv_into_pinned = pinned;
    cfg.mem_pool_size_gb = pool_gb;
    kv_connector *c = NULL;
    pd_err err = {{0}};
    CHECKF(kv_connector_create(&cfg, m, kv, be, 8000, NULL, NULL, &c, &err) == 0, "%s", err.msg);
    return c;
}

static const int32_t prod_table[] = {5, 2, 9, 14};
static const int32_t cons_table[] = {3, 11, 0, 7};

/* Cache values of the consumer that differ from what they should be: the
 * producer's row of token t at each slot of cons_table holding a token
 * t < n_written, -1 everywhere else. */
static size_t wrong_values(const opt_kv_storage *kv_p, const opt_kv_storage *kv_c, int layers,
                           int dim, int n_written) {
    size_t wrong = 0;
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
                const bool written = t >= 0 && t < n_written;
                const size_t from = written ? (size_t)prod_table[t / BLOCK_SIZE] * BLOCK_SIZE +
                                                  (size_t)(t % BLOCK_SIZE)
                                            : 0;
                for (int d = 0; d < dim; d++) {
                    float want = written ? src[from * (size_t)dim + (size_t)d] : -1.0f;
                    wrong += dst[slot * (size_t)dim + (size_t)d] != want;
                }
            }
        }
    }
    return wrong;
}

/* Save n tokens from prod_blocks on prod, begin their load on cons and poll
 * it (with poll_table, which may be NULL) until everything arrived. Returns
 * load_poll's last answer (1: all in); *load is for the caller to end. */
static int send_and_receive(kv_connector *prod, kv_connector *cons, const int32_t *prod_blocks,
                            int n, const int32_t *poll_table, kv_load **load) {
    pd_err err = {{0}};
    kv_request_params sp;
    memset(&sp, 0, sizeof sp);
    sp.present = sp.do_remote_decode = true;
    snprintf(sp.remote_kv_addr, sizeof sp.remote_kv_addr, "%s", kv_connector_address(cons));
    kv_save_result saved;
    CHECKF(kv_connector_save(prod, &sp, prod_blocks, n, "test", &saved, &err) == 0, "%s", err.msg);
    CHECK(saved.num_tokens == n);

    kv_request_params lp;
    memset(&lp, 0, sizeof lp);
    lp.present = lp.do_remote_prefill = true;
    snprintf(lp.remote_kv_addr, sizeof lp.remote_kv_addr, "%s", saved.kv_addr);
    snprintf(lp.remote_request_id, sizeof lp.remote_request_id, "%s", saved.transfer_id);
    *load = NULL;
    CHECKF(kv_connector_load_begin(cons, &lp, n, "test", load, &err) == 0, "%s", err.msg);
    int got = 0, status = 0;
    for (double end = pd_now() + 10; *load && got == 0 && pd_now() < end;) {
        got = kv_connector_load_poll(cons, *load, poll_table, &status, &err);
        if (got == 0) usleep(500);
    }
    CHECKF(got == 1, "load_poll %d: %s", got, err.msg);
    return got;
}

/* One prompt of n tokens from the producer's blocks into the consumer's;
 * early: the consumer's blocks go to load_poll; pinned: the consumer
 * receives into (emulated) page-locked memory and queues its copies;
 * apply=false abandons the load once everything arrived instead of applying
 * it. */
static void transfer(kv_send_type send, bool early, bool pinned, opt_model *m, pd_backend *be,
                     int n, bool apply) {
    const opt_config *mc = opt_model_config(m);
    const int layers = mc->num_hidden_layers, dim = mc->hidden_size;
    const size_t floats = (size_t)NUM_BLOCKS * BLOCK_SIZE * (size_t)dim;
    opt_kv_storage *kv_p = NULL, *kv_c = NULL;
    pd_err err = {{0}};
    CHECKF(opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_p, &err) == 0, "%s", err.msg);
    CHECKF(opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_c, &err) == 0, "%s", err.msg);
    if (!kv_p || !kv_c) return;
    fill_cache(kv_p, layers, floats, true);

    kv_connector *prod = connector(KV_ROLE_PRODUCER, send, pinned, m, kv_p, be);
    kv_connector *cons = connector(KV_ROLE_CONSUMER, send, pinned, m, kv_c, be);
    if (!prod || !cons) goto out;

    /* With recv_into_pinned a second round on the same connectors finds the
     * page-locked buffers the first one set out. */
    for (int round = 0; round < (pinned ? 2 : 1); round++) {
        fill_cache(kv_c, layers, floats, false);
        kv_connector_stats st0;
        kv_connector_stats_get(cons, &st0);
        queued_copies = 0;
        kv_load *load = NULL;
        const int got =
            send_and_receive(prod, cons, prod_table, n, early ? cons_table : NULL, &load);

        /* Written as they arrived: the cache is complete and the received tensors
         * are freed before load_apply. Otherwise neither, until then. */
        kv_connector_stats st;
        kv_connector_stats_get(cons, &st);
        CHECKF(early ? st.buffered_bytes == 0 : st.buffered_bytes > 0,
               "buffered %zu bytes (early %d)", st.buffered_bytes, early);
        size_t wrong = wrong_values(kv_p, kv_c, layers, dim, early ? n - 1 : 0);
        CHECKF(wrong == 0, "%zu cache values wrong before load_apply (send %s, early %d, n %d)",
               wrong, kv_send_type_name(send), early, n);

        if (got == 1 && apply)
            CHECKF(kv_connector_load_apply(cons, load, cons_table, n - 1, &err) == 0, "%s",
                   err.msg);
        kv_connector_load_end(cons, load);
        kv_connector_stats_get(cons, &st);
        CHECKF(st.buffered_bytes == 0, "%zu bytes still buffered after load_end",
               st.buffered_bytes);
        CHECK(st.loads_ok - st0.loads_ok == (apply ? 1u : 0u));
        const uint64_t all = (uint64_t)layers, none = 0,
                       written = st.layers_written - st0.layers_written;
        CHECKF(written == (apply || early ? all : none) &&
                   st.layers_written_on_arrival - st0.layers_written_on_arrival ==
                       (early ? all : none),
               "layers written %llu, on arrival %llu (early %d, apply %d)",
               (unsigned long long)written,
               (unsigned long long)(st.layers_written_on_arrival - st0.layers_written_on_arrival),
               early, apply);
        /* With recv_into_pinned, layers that found page-locked memory go through
         * a queued copy, and all do once it was set out before they arrived: in
         * the second round, or with GET (pulled after load_begin). None do
         * without the option. */
        const bool all_pinned = pinned && (round > 0 || send == KV_SEND_GET);
        /* With room for one buffer (mem_pool_size_gb of 64 KiB, and every
         * layer here fits the 64 KiB class), a layer gets page-locked memory
         * only while that one buffer is idle: at least one does, and more
         * only when an earlier one was written and gave it back first (a
         * matter of timing); the pool never grows past the limit. */
        const bool one_buffer = pool_gb > 0;
        CHECKF((all_pinned && one_buffer
                    ? queued_copies >= ((int)written > 0) && queued_copies <= (int)written &&
                          st.host_pool_pinned_bytes <= 65536
                : all_pinned ? queued_copies == (int)written
                : pinned     ? queued_copies <= (int)written
                             : queued_copies == 0) &&
                   st.layers_written_from_pinned - st0.layers_written_from_pinned ==
                       (uint64_t)queued_copies,
               "%d queued copies, %llu counted, for %llu layers (pinned %d, round %d)",
               queued_copies,
               (unsigned long long)(st.layers_written_from_pinned - st0.layers_written_from_pinned),
               (unsigned long long)written, pinned, round);
        /* The consumer's pool only receives. A layer that finds no page-locked
         * buffer stays in ZMQ's frame: copying it into ordinary memory would
         * cost the receive path a memcpy for nothing. */
        CHECKF(st.host_pool_pageable_bytes == 0 &&
                   (pinned ? st.host_pool_pinned_bytes > 0 : st.host_pool_pinned_bytes == 0),
               "consumer pool: %zu bytes ordinary, %zu page-locked (pinned %d, round %d, send %s)",
               st.host_pool_pageable_bytes, st.host_pool_pinned_bytes, pinned, round,
               kv_send_type_name(send));
        wrong = wrong_values(kv_p, kv_c, layers, dim, apply || early ? n - 1 : 0);
        CHECKF(wrong == 0, "%zu cache values wrong (send %s, early %d, n %d, apply %d)", wrong,
               kv_send_type_name(send), early, n, apply);
    }
out:
    kv_connector_destroy(cons);
    kv_connector_destroy(prod);
    opt_kv_storage_free(kv_c);
    opt_kv_storage_free(kv_p);
}

/* A 1-token prompt: the decode side computes that token itself and takes no
 * KV, so the producer sends none (each send type), and the consumer's load,
 * begun and ended at once as the engine does, leaves nothing behind. */
static void one_token_prompt(opt_model *m, pd_backend *be) {
    const kv_send_type sends[] = {KV_SEND_PUT, KV_SEND_PUT_ASYNC, KV_SEND_GET};
    for (int s = 0; s < 3; s++) {
        opt_kv_storage *kv_p = NULL, *kv_c = NULL;
        pd_err err = {{0}};
        CHECKF(opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_p, &err) == 0 &&
                   opt_kv_storage_create(m, NUM_BLOCKS, BLOCK_SIZE, &kv_c, &err) == 0,
               "%s", err.msg);
        kv_connector *prod =
            kv_p ? connector(KV_ROLE_PRODUCER, sends[s], false, m, kv_p, be) : NULL;
        kv_connector *cons =
            kv_c ? connector(KV_ROLE_CONSUMER, sends[s], false, m, kv_c, be) : NULL;
        if (prod && cons) {
            kv_request_params sp;
            memset(&sp, 0, sizeof sp);
            sp.present = sp.do_remote_decode = true;
            snprintf(sp.remote_kv_addr, sizeof sp.remote_kv_addr, "%s", kv_connector_address(cons));
            kv_save_result saved;
            CHECKF(kv_connector_save(prod, &sp, prod_table, 1, "one", &saved, &err) == 0, "%s",
                   err.msg);
            CHECK(saved.num_tokens == 1 && saved.transfer_id[0]);
            kv_request_params lp;
            memset(&lp, 0, sizeof lp);
            lp.present = lp.do_remote_prefill = true;
            snprintf(lp.remote_kv_addr, sizeof lp.remote_kv_addr, "%s", saved.kv_addr);
            snprintf(lp.remote_request_id, sizeof lp.remote_request_id, "%s", saved.transfer_id);
            kv_load *load = NULL;
            CHECKF(kv_connector_load_begin(cons, &lp, 1, "one", &load, &err) == 0, "%s", err.msg);
            kv_connector_load_end(cons, load);
            usleep(50 * 1000); /* anything sent would have arrived by now */
            kv_connector_stats sp_st, sc_st;
            kv_connector_stats_get(prod, &sp_st);
            kv_connector_stats_get(cons, &sc_st);
            CHECKF(sp_st.saves_ok == 1 && sp_st.bytes_sent == 0 && sp_st.sends_ok == 0 &&
                       sc_st.bytes_received == 0 && sc_st.buffered_bytes == 0,
                   "1-token prompt (%s): %llu saves, %llu bytes sent, %llu received, %zu buffered",
                   kv_send_type_name(sends[s]), (unsigned long long)sp_st.saves_ok,
                   (unsigned long long)sp_st.bytes_sent, (unsigned long long)sc_st.bytes_received,
                   sc_st.buffered_bytes);
        }
        kv_connector_destroy(cons);
        kv_connector_destroy(prod);
        opt_kv_storage_free(kv_c);
        opt_kv_storage_free(kv_p);
    }
}

/* recv_into_pinned with room for 256 KiB of page-locked memory
 * (mem_pool_size_gb): a load of 64 KiB layers sets out two buffers of that
 * size; then a load of 128 KiB layers must get page-locked buffers too (the
 * idle smaller ones are freed for room), not ordinary memory. GET, so the
 * buffers are set out before the layers come. */
static void pinned_size_classes(opt_model *m, pd_backend *be) {
    enum { BLOCKS = 32 };
    const int layers = opt_model_config(m)->num_hidden_layers;
    opt_kv_storage *kv_p = NULL, *kv_c = NULL;
    pd_err err = {{0}};
    CHECKF(opt_kv_storage_create(m, BLOCKS, BLOCK_SIZE, &kv_p, &err) == 0, "%s", err.msg);
    CHECKF(opt_kv_storage_create(m, BLOCKS, BLOCK_SIZE, &kv_c, &err) == 0, "%s", err.msg);
    pool_gb = 262144.0 / (1u << 30);
    kv_connector *prod = kv_p ? connector(KV_ROLE_PRODUCER, KV_SEND_GET, true, m, kv_p, be) : NULL;
    kv_connector *cons = kv_c ? connector(KV_ROLE_CONSUMER, KV_SEND_GET, true, m, kv_c, be) : NULL;
    pool_gb = 0;
    int32_t table[BLOCKS];
    for (int i = 0; i < BLOCKS; i++)
        table[i] = i;
    /* tiny, fp32: 512 bytes a token a layer: 21 tokens in the 64 KiB class, 200 in the 128 KiB */
    const int lengths[2] = {21, 200};
    for (int k = 0; prod && cons && k < 2; k++) {
        const int n = lengths[k];
        kv_connector_stats st0, st;
        kv_connector_stats_get(cons, &st0);
        kv_load *load = NULL;
        if (send_and_receive(prod, cons, table, n, NULL, &load) == 1)
            CHECKF(kv_connector_load_apply(cons, load, table, n - 1, &err) == 0, "%s", err.msg);
        kv_connector_load_end(cons, load);
        kv_connector_stats_get(cons, &st);
        CHECKF(st.layers_written_from_pinned - st0.layers_written_from_pinned == (uint64_t)layers,
               "%d-token load: %llu of %d layers from page-locked memory", n,
               (unsigned long long)(st.layers_written_from_pinned - st0.layers_written_from_pinned),
               layers);
    }
    kv_connector_destroy(cons);
    kv_connector_destroy(prod);
    opt_kv_storage_free(kv_c);
    opt_kv_storage_free(kv_p);
}

int main(void) {
    main_thread = pthread_self();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny", test_tmpdir());
    pd_err err = {{0}};
    CHECKF(opt_make_model(dir, "tiny", 5, PD_F32, &err) == 0, "%s", err.msg);
    pd_backend *be = NULL;
    opt_model *m = NULL;
    CHECKF(pd_backend_create("cpu", 1, &be, &err) == 0, "%s", err.msg);
    if (be) CHECKF(opt_model_load(dir, be, &m, &err) == 0, "%s", err.msg);
    const kv_send_type sends[] = {KV_SEND_PUT, KV_SEND_PUT_ASYNC, KV_SEND_GET};
    for (int pinned = 0; m && pinned < 2; pinned++) {
        if (pinned) { /* as a GPU backend: page-locked host memory, queued copies */
            be->host_alloc = emu_host_alloc;
            be->host_free = emu_host_free;
            be->copy_h2d_async = emu_copy_h2d_async;
        }
        for (int early = 0; early < 2; early++)
            for (int s = 0; s < 3; s++) {
                transfer(sends[s], early, pinned, m, be, 21,
                         true); /* three blocks, the last partly */
                transfer(sends[s], early, pinned, m, be, 17,
                         true); /* n - 1 tokens fill two blocks */
                transfer(sends[s], early, pinned, m, be, 2, true); /* one token written */
                transfer(sends[s], early, pinned, m, be, 21,
                         false); /* all arrived, then abandoned */
            }
    }
    /* mem_pool_size_gb bounds the page-locked memory: room for one buffer. */
    pool_gb = 65536.0 / (1u << 30);
    if (m) transfer(KV_SEND_GET, true, true, m, be, 21, true);
    pool_gb = 0;
    if (m) pinned_size_classes(m, be);
    if (m) one_token_prompt(m, be);
    CHECKF(atomic_load(&foreign_host_allocs) == 0,
           "host_alloc called %d times off the connector's thread",
           atomic_load(&foreign_host_allocs));
    opt_model_free(m);
    pd_backend_destroy(be);
    return test_finish();
}
