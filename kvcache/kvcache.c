/* kvcache: reference-counted KV blocks with prefix caching (see kvcache.h).
 *
 * Free blocks sit on one doubly linked list in reuse order: allocation takes
 * the head. A freed block without a cached prefix goes to the head (nothing
 * is lost by reusing it); a freed cached block goes to the tail, so cached
 * blocks are evicted least recently freed first. Cached blocks are found
 * through a chained hash table keyed by the block hash; each block keeps a
 * copy of its tokens so a lookup also compares them. */
#include "kvcache/kvcache.h"

#include <stdlib.h>
#include <string.h>

struct kv_block_pool {
    int num_blocks, block_size;
    int n_free, n_cached;
    int32_t *ref;         /* reference count per block */
    int32_t *prev, *next; /* free list links (-1 = none) */
    int32_t free_head, free_tail;
    bool *cached;         /* block is in the hash table */
    uint64_t *hash;       /* its hash when cached */
    int32_t *tokens;      /* [num_blocks, block_size] its tokens when cached */
    int32_t *bucket;      /* hash table heads (-1 = empty) */
    int32_t *bucket_next; /* chain per block */
    uint32_t bucket_mask;
};

static bool valid_id(const kv_block_pool *p, int32_t id) {
    return id >= 0 && id < p->num_blocks;
}

/* ---- free list ---- */

static void free_list_remove(kv_block_pool *p, int32_t id) {
    if (p->prev[id] >= 0)
        p->next[p->prev[id]] = p->next[id];
    else
        p->free_head = p->next[id];
    if (p->next[id] >= 0)
        p->prev[p->next[id]] = p->prev[id];
    else
        p->free_tail = p->prev[id];
    p->prev[id] = p->next[id] = -1;
    p->n_free--;
}

static void free_list_push(kv_block_pool *p, int32_t id, bool at_tail) {
    if (at_tail) {
        p->prev[id] = p->free_tail;
        p->next[id] = -1;
        if (p->free_tail >= 0)
            p->next[p->free_tail] = id;
        else
            p->free_head = id;
        p->free_tail = id;
    } else {
        p->next[id] = p->free_head;
        p->prev[id] = -1;
        if (p->free_head >= 0)
            p->prev[p->free_head] = id;
        else
            p->free_tail = id;
        p->free_head = id;
    }
    p->n_free++;
}

/* ---- hash table ---- */

static uint32_t bucket_of(const kv_block_pool *p, uint64_t h) {
    return (uint32_t)(h ^ (h >> 32)) & p->bucket_mask;
}

static void cache_remove(kv_block_pool *p, int32_t id) {
    if (!p->cached[id]) return;
    int32_t *link = &p->bucket[bucket_of(p, p->hash[id])];
    while (*link != id)
        link = &p->bucket_next[*link];
    *link = p->bucket_next[id];
    p->bucket_next[id] = -1;
    p->cached[id] = false;
    p->n_cached--;
}

int32_t kv_pool_lookup(const kv_block_pool *p, uint64_t hash, const int32_t *tokens) {
    const size_t row = (size_t)p->block_size * sizeof(int32_t);
    for (int32_t id = p->bucket[bucket_of(p, hash)]; id >= 0; id = p->bucket_next[id])
        if (p->hash[id] == hash && memcmp(p->tokens + (size_t)id * p->block_size, tokens, row) == 0)
            return id;
    return -1;
}

void kv_pool_publish(kv_block_pool *p, int32_t id, uint64_t hash, const int32_t *tokens) {
    if (!valid_id(p, id) || p->ref[id] <= 0 || p->cached[id] ||
        kv_pool_lookup(p, hash, tokens) >= 0)
        return;
    p->cached[id] = true;
    p->hash[id] = hash;
    memcpy(p->tokens + (size_t)id * p->block_size, tokens, (size_t)p->block_size * sizeof(int32_t));
    uint32_t b = bucket_of(p, hash);
    p->bucket_next[id] = p->bucket[b];
    p->bucket[b] = id;
    p->n_cached++;
}

/* splitmix64's finaliser: every input bit affects every output bit. */
static uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens, int n) {
    uint64_t h = mix64(parent + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < n; i++)
        h = mix64(h ^ (uint32_t)tokens[i]) + 0x9e3779b97f4a7c15ull;
    return mix64(h ^ (uint64_t)n);
}

/* ---- pool ---- */

int kv_pool_create(int num_blocks, int block_size, kv_block_pool **out, pd_err *err) {
    *out = NULL;
    if (num_blocks <= 0 || block_size <= 0 || num_blocks > (1 << 28))
        return pd_fail(err, "kv pool: bad num_blocks %d / block_size %d", num_blocks, block_size);
    kv_block_pool *p = calloc(1, sizeof *p);
    if (!p) return pd_fail(err, "kv pool: out of memory");
    const size_t n = (size_t)num_blocks;
    uint32_t nb = 1;
    while (nb < 2 * n)
        nb <<= 1;
    p->num_blocks = num_blocks;
    p->block_size = block_size;
    p->ref = calloc(n, sizeof *p->ref);
    p->prev = malloc(n * sizeof *p->prev);
    p->next = malloc(n * sizeof *p->next);
    p->cached = calloc(n, sizeof *p->cached);
    p->hash = calloc(n, sizeof *p->hash);
    p->tokens = calloc(n * (size_t)block_size, sizeof *p->tokens);
    p->bucket = malloc(nb * sizeof *p->bucket);
    p->bucket_next = malloc(n * sizeof *p->bucket_next);
    p->bucket_mask = nb - 1;
    if (!p->ref || !p->prev || !p->next || !p->cached || !p->hash || !p->tokens || !p->bucket ||
        !p->bucket_next) {
        kv_pool_destroy(p);
        return pd_fail(err, "kv pool: out of memory for %d blocks", num_blocks);
    }
    for (uint32_t b = 0; b < nb; b++)
        p->bucket[b] = -1;
    p->free_head = p->free_tail = -1;
    for (int32_t id = 0; id < num_blocks; id++) {
        p->bucket_next[id] = -1;
        free_list_push(p, id, true);
    }
    *out = p;
    return 0;
}

void kv_pool_destroy(kv_block_pool *p) {
    if (!p) return;
    free(p->ref);
    free(p->prev);
    free(p->next);
    free(p->cached);
    free(p->hash);
    free(p->tokens);
    free(p->bucket);
    free(p->bucket_next);
    free(p);
}

int kv_pool_num_blocks(const kv_block_pool *p) {
    return p->num_blocks;
}
int kv_pool_block_size(const kv_block_pool *p) {
    return p->block_size;
}
int kv_pool_num_free(const kv_block_pool *p) {
    return p->n_free;
}
int kv_pool_num_cached(const kv_block_pool *p) {
    return p->n_cached;
}
bool kv_pool_all_free(const kv_block_pool *p) {
    return p->n_free == p->num_blocks;
}

int kv_block_alloc(kv_block_pool *p, int32_t *id, pd_err *err) {
    *id = -1;
    const int32_t b = p->free_head;
    if (b < 0) return pd_fail(err, "kv pool: all %d blocks are in use", p->num_blocks);
    free_list_remove(p, b);
    cache_remove(p, b); /* evict: its old content is about to be overwritten */
    p->ref[b] = 1;
    *id = b;
    return 0;
}

void kv_block_ref(kv_block_pool *p, int32_t id) {
    if (!valid_id(p, id)) return;
    if (p->ref[id]++ == 0) free_list_remove(p, id); /* a cached free block comes back */
}

void kv_block_unref(kv_block_pool *p, int32_t id) {
    if (!valid_id(p, id) || p->ref[id] <= 0) return;
    if (--p->ref[id] == 0) free_list_push(p, id, p->cached[id]);
}

int kv_block_refcount(const kv_block_pool *p, int32_t id) {
    return valid_id(p, id) ? p->ref[id] : 0;
}

/* ---- block tables ---- */

void kv_table_init(kv_block_table *t) {
    memset(t, 0, sizeof *t);
    t->last_hash = KV_HASH_ROOT;
}

static int table_grow_array(kv_block_table *t, int n, pd_err *err) {
    if (n <= t->cap) return 0;
    int cap = t->cap ? t->cap : 8;
    while (cap < n)
        cap *= 2;
    int32_t *ids = realloc(t->ids, (size_t)cap * sizeof *ids);
    if (!ids) return pd_fail(err, "kv table: out of memory for %d blocks", cap);
    t->ids = ids;
    t->cap = cap;
    return 0;
}

int kv_table_match_prefix(kv_block_pool *p, kv_block_table *t, const int32_t *tokens,
                          int n_tokens) {
    if (t->n_blocks != 0) return 0;
    const int bs = p->block_size;
    uint64_t h = KV_HASH_ROOT;
    int n = 0;
    while ((n + 1) * bs <= n_tokens) {
        const int32_t *blk = tokens + (size_t)n * bs;
        const uint64_t bh = kv_hash_block(h, blk, bs);
        const int32_t id = kv_pool_lookup(p, bh, blk);
        if (id < 0 || table_grow_array(t, n + 1, NULL) != 0) break;
        kv_block_ref(p, id);
        t->ids[n++] = id;
        h = bh;
    }
    t->n_blocks = t->n_hashed = n;
    t->last_hash = h;
    return n * bs;
}

int kv_table_blocks_needed(const kv_block_pool *p, const kv_block_table *t, int n_tokens) {
    const int need = (n_tokens + p->block_size - 1) / p->block_size;
    return need > t->n_blocks ? need - t->n_blocks : 0;
}

int kv_table_reserve(kv_block_pool *p, kv_block_table *t, int n_tokens, pd_err *err) {
    const int add = kv_table_blocks_needed(p, t, n_tokens);
    if (add == 0) return 0;
    if (add > p->n_free)
        return pd_fail(err, "kv pool: %d more blocks needed for %d tokens, %d free", add, n_tokens,
                       p->n_free);
    if (table_grow_array(t, t->n_blocks + add, err) != 0) return -1;
    for (int i = 0; i < add; i++)
        if (kv_block_alloc(p, &t->ids[t->n_blocks++], err) != 0) return -1; /* cannot happen */
    return 0;
}

void kv_table_publish_full(kv_block_pool *p, kv_block_table *t, const int32_t *tokens,
                           int n_computed) {
    const int bs = p->block_size;
    int full = n_computed / bs;
    if (full > t->n_blocks) full = t->n_blocks;
    for (; t->n_hashed < full; t->n_hashed++) {
        const int32_t *blk = tokens + (size_t)t->n_hashed * bs;
        t->last_hash = kv_hash_block(t->last_hash, blk, bs);
        kv_pool_publish(p, t->ids[t->n_hashed], t->last_hash, blk);
    }
}

void kv_table_release(kv_block_pool *p, kv_block_table *t) {
    for (int i = t->n_blocks - 1; i >= 0; i--)
        kv_block_unref(p, t->ids[i]);
    t->n_blocks = t->n_hashed = 0;
    t->last_hash = KV_HASH_ROOT;
}

void kv_table_free(kv_block_table *t) {
    free(t->ids);
    kv_table_init(t);
}

int kv_blocks_for_budget(size_t budget_bytes, size_t block_bytes) {
    if (block_bytes == 0) return 0;
    const size_t n = budget_bytes / block_bytes;
    return n > (size_t)(1 << 28) ? (1 << 28) : (int)n;
}
