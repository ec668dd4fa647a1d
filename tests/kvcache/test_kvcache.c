/* test_kvcache: the block pool (alloc/free/refcounts/exhaustion), prefix
 * caching (chained hashes, shared prefixes, LRU eviction) and block tables,
 * and a random workload checked against a shadow model of reference counts
 * that must end with every block free. */
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"
#include "tests/common/testlib.h"

static uint64_t rng = 12345;
static uint32_t urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

static void test_alloc_free(void) {
    pd_err err;
    kv_block_pool *p;
    CHECK(kv_pool_create(0, 16, &p, &err) == -1);
    CHECK(kv_pool_create(4, 16, &p, &err) == 0);
    CHECK(kv_pool_num_free(p) == 4 && kv_pool_all_free(p));
    int32_t ids[5];
    for (int i = 0; i < 4; i++)
        CHECK(kv_block_alloc(p, &ids[i], &err) == 0);
    bool seen[4] = {0};
    for (int i = 0; i < 4; i++) {
        CHECK(ids[i] >= 0 && ids[i] < 4 && !seen[ids[i]]);
        if (ids[i] >= 0 && ids[i] < 4) seen[ids[i]] = true;
        CHECK(kv_block_refcount(p, ids[i]) == 1);
    }
    CHECK(kv_pool_num_free(p) == 0 && !kv_pool_all_free(p));
    CHECK(kv_block_alloc(p, &ids[4], &err) == -1 && strstr(err.msg, "in use") && ids[4] == -1);
    kv_block_ref(p, ids[2]);
    CHECK(kv_block_refcount(p, ids[2]) == 2);
    kv_block_unref(p, ids[2]);
    CHECK(kv_block_refcount(p, ids[2]) == 1 && kv_pool_num_free(p) == 0);
    kv_block_unref(p, ids[2]);
    CHECK(kv_block_refcount(p, ids[2]) == 0 && kv_pool_num_free(p) == 1);
    kv_block_unref(p, ids[2]); /* a stray unref of a free block is ignored */
    CHECK(kv_pool_num_free(p) == 1);
    int32_t again;
    CHECK(kv_block_alloc(p, &again, &err) == 0 && again == ids[2]);
    for (int i = 0; i < 4; i++)
        kv_block_unref(p, ids[i]);
    CHECK(kv_pool_all_free(p));
    CHECK(kv_blocks_for_budget(1000, 300) == 3 && kv_blocks_for_budget(299, 300) == 0);
    CHECK(kv_blocks_for_budget(1000, 0) == 0);
    kv_pool_destroy(p);
}

static void test_hash(void) {
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
    uint64_t ha = kv_hash_block(KV_HASH_ROOT, a, 4);
    CHECK(ha == kv_hash_block(KV_HASH_ROOT, a, 4));
    CHECK(ha != kv_hash_block(KV_HASH_ROOT, b, 4));
    CHECK(ha != kv_hash_block(ha, a, 4)); /* same tokens, other parent */
    CHECK(kv_hash_block(ha, b, 4) != kv_hash_block(kv_hash_block(KV_HASH_ROOT, b, 4), b, 4));
}

/* Two prompts sharing 2.5 blocks: the second reuses the 2 full ones. */
static void test_prefix_sharing(void) {
    pd_err err;
    const int bs = 4;
    kv_block_pool *p;
    CHECK(kv_pool_create(8, bs, &p, &err) == 0);
    int32_t p1[11] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int32_t p2[13] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 99, 98, 97, 96};
    kv_block_table t1, t2;
    kv_table_init(&t1);
    kv_table_init(&t2);
    CHECK(kv_table_match_prefix(p, &t1, p1, 10) == 0); /* nothing cached yet */
    CHECK(kv_table_blocks_needed(p, &t1, 11) == 3);
    CHECK(kv_table_reserve(p, &t1, 11, &err) == 0 && t1.n_blocks == 3);
    kv_table_publish_full(p, &t1, p1, 11); /* the forward pass ran */
    CHECK(kv_pool_num_cached(p) == 2 && t1.n_hashed == 2);
    CHECK(kv_table_match_prefix(p, &t2, p2, 12) == 8);
    CHECK(t2.n_blocks == 2 && t2.ids[0] == t1.ids[0] && t2.ids[1] == t1.ids[1]);
    CHECK(kv_block_refcount(p, t1.ids[0]) == 2 && kv_block_refcount(p, t1.ids[2]) == 1);
    CHECK(kv_table_reserve(p, &t2, 13, &err) == 0 && t2.n_blocks == 4);
    CHECK(t2.ids[2] != t1.ids[2]);
    kv_table_publish_full(p, &t2, p2, 13);
    CHECK(kv_pool_num_cached(p) == 3); /* blocks 0,1 shared; block 2 of p2 new; 3 not full */
    /* A prompt that differs in its first token shares nothing. */
    int32_t p3[8] = {4, 6, 7, 8, 9, 10, 11, 12};
    kv_block_table t3;
    kv_table_init(&t3);
    CHECK(kv_table_match_prefix(p, &t3, p3, 8) == 0 && t3.n_blocks == 0);
    /* Same second block content under another first block: no match either. */
    uint64_t h = kv_hash_block(KV_HASH_ROOT, p3, bs);
    CHECK(kv_pool_lookup(p, kv_hash_block(h, p1 + 4, bs), p1 + 4) == -1);
    /* Freed cached blocks stay findable. */
    kv_table_release(p, &t1);
    kv_table_release(p, &t2);
    CHECK(kv_pool_all_free(p) && kv_pool_num_cached(p) == 3);
    CHECK(kv_table_match_prefix(p, &t3, p2, 13) == 12 && t3.n_blocks == 3);
    CHECK(kv_pool_num_free(p) == 5);
    kv_table_release(p, &t3);
    kv_table_free(&t1);
    kv_table_free(&t2);
    kv_table_free(&t3);
    kv_pool_destroy(p);
}

/* Allocation reuses uncached blocks first, then evicts the least recently
 * freed cached block. */
static void test_eviction(void) {
    pd_err err;
    const int bs = 2;
    kv_block_pool *p;
    CHECK(kv_pool_create(4, bs, &p, &err) == 0);
    int32_t toks[3][2] = {{1, 2}, {3, 4}, {5, 6}};
    kv_block_table t[3];
    for (int i = 0; i < 3; i++) {
        kv_table_init(&t[i]);
        CHECK(kv_table_reserve(p, &t[i], 2, &err) == 0);
        kv_table_publish_full(p, &t[i], toks[i], 2);
    }
    CHECK(kv_pool_num_cached(p) == 3 && kv_pool_num_free(p) == 1);
    const int32_t b0 = t[0].ids[0], b1 = t[1].ids[0], b2 = t[2].ids[0];
    kv_table_release(p, &t[1]); /* freed first: evicted first */
    kv_table_release(p, &t[0]);
    kv_table_release(p, &t[2]);
    int32_t x, y, z;
    CHECK(kv_block_alloc(p, &x, &err) == 0);
    CHECK(x != b0 && x != b1 && x != b2 && kv_pool_num_cached(p) == 3); /* the clean one */
    CHECK(kv_block_alloc(p, &y, &err) == 0 && y == b1 && kv_pool_num_cached(p) == 2);
    CHECK(kv_pool_lookup(p, kv_hash_block(KV_HASH_ROOT, toks[1], 2), toks[1]) == -1);
    CHECK(kv_pool_lookup(p, kv_hash_block(KV_HASH_ROOT, toks[0], 2), toks[0]) == b0);
    /* Touching a cached block (a prefix hit) takes it off the eviction list. */
    kv_block_table hit;
    kv_table_init(&hit);
    CHECK(kv_table_match_prefix(p, &hit, toks[0], 2) == 2 && hit.ids[0] == b0);
    CHECK(kv_block_alloc(p, &z, &err) == 0 && z == b2);
    int32_t none;
    CHECK(kv_block_alloc(p, &none, &err) == -1);
    CHECK(kv_table_reserve(p, &t[0], 5, &err) == -1 && strstr(err.msg, "free"));
    CHECK(t[0].n_blocks == 0); /* all or nothing */
    kv_block_unref(p, x);
    kv_block_unref(p, y);
    kv_block_unref(p, z);
    kv_table_release(p, &hit);
    CHECK(kv_pool_all_free(p));
    for (int i = 0; i < 3; i++)
        kv_table_free(&t[i]);
    kv_table_free(&hit);
    kv_pool_destroy(p);
}

/* Random sequences from a few shared prefixes come and go; reference counts
 * always equal the number of tables holding each block, shared prefixes are
 * found, and everything is free at the end. */
static void test_random_workload(void) {
    pd_err err;
    enum { NB = 64, BS = 4, NSEQ = 12, MAXTOK = 40 };
    kv_block_pool *p;
    CHECK(kv_pool_create(NB, BS, &p, &err) == 0);
    kv_block_table tab[NSEQ];
    int32_t toks[NSEQ][MAXTOK];
    int len[NSEQ] = {0}, hits = 0, bad_refs = 0, bad_share = 0;
    bool live[NSEQ] = {0};
    for (int i = 0; i < NSEQ; i++)
        kv_table_init(&tab[i]);
    for (int step = 0; step < 3000; step++) {
        const int s = (int)(urand() % NSEQ);
        if (!live[s]) { /* admit: a prompt from one of 3 families */
            const int fam = (int)(urand() % 3), n = 2 + (int)(urand() % 20);
            for (int i = 0; i < n; i++)
                toks[s][i] = i < 12 ? fam * 100 + i : (int32_t)urand() % 50;
            const int cached = kv_table_match_prefix(p, &tab[s], toks[s], n - 1);
            hits += cached > 0;
            for (int o = 0; o < NSEQ && cached > 0; o++) /* cached blocks hold the same tokens */
                if (o != s && live[o])
                    for (int b = 0; b < cached / BS && b < tab[o].n_hashed; b++)
                        if (tab[o].ids[b] == tab[s].ids[b] &&
                            memcmp(toks[o] + b * BS, toks[s] + b * BS, BS * sizeof(int32_t)))
                            bad_share++;
            if (kv_table_reserve(p, &tab[s], n, &err) != 0) {
                kv_table_release(p, &tab[s]);
                continue;
            }
            kv_table_publish_full(p, &tab[s], toks[s], n);
            len[s] = n;
            live[s] = true;
        } else if (urand() % 4 == 0 || len[s] == MAXTOK) { /* finish */
            kv_table_release(p, &tab[s]);
            live[s] = false;
        } else { /* decode one token */
            toks[s][len[s]] = (int32_t)(urand() % 50);
            if (kv_table_reserve(p, &tab[s], len[s] + 1, &err) == 0) {
                len[s]++;
                kv_table_publish_full(p, &tab[s], toks[s], len[s]);
            }
        }
        if (step % 50 == 0) {
            int expect[NB] = {0}, n_free = 0;
            for (int o = 0; o < NSEQ; o++)
                if (live[o])
                    for (int b = 0; b < tab[o].n_blocks; b++)
                        expect[tab[o].ids[b]]++;
            for (int b = 0; b < NB; b++) {
                bad_refs += kv_block_refcount(p, b) != expect[b];
                n_free += expect[b] == 0;
            }
            bad_refs += n_free != kv_pool_num_free(p);
        }
    }
    CHECKF(bad_refs == 0, "%d reference count mismatches", bad_refs);
    CHECKF(bad_share == 0, "%d shared blocks with different tokens", bad_share);
    CHECKF(hits > 100, "only %d prefix hits", hits);
    for (int s = 0; s < NSEQ; s++) {
        if (live[s]) kv_table_release(p, &tab[s]);
        kv_table_free(&tab[s]);
    }
    CHECK(kv_pool_all_free(p));
    kv_pool_destroy(p);
}

int main(void) {
    test_alloc_free();
    test_hash();
    test_prefix_sharing();
    test_eviction();
    test_random_workload();
    return test_finish();
}
