/* kvcache: the block manager above the model's paged KV storage.
 *
 * The KV storage (model/opt.h) is num_blocks blocks of block_size token
 * slots. This module decides which sequence owns which block:
 *  - kv_block_pool: reference-counted blocks. A block with no references is
 *    free; allocation takes the free block that has gone unused longest.
 *  - prefix caching: a full block is identified by a chained hash,
 *    hash(parent block's hash, this block's tokens), so equal hashes mean
 *    equal prefixes. Published full blocks stay findable by hash after they
 *    are freed, until allocation needs the space and evicts them (least
 *    recently freed first; blocks holding no cached prefix are reused first).
 *  - kv_block_table: one sequence's list of blocks, grown to cover N tokens.
 * Nothing here touches KV data; the pool is single-threaded (the engine
 * loop owns it). */
#ifndef PD_KVCACHE_H
#define PD_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/opt.h"

typedef struct kv_block_pool kv_block_pool;

int kv_pool_create(int num_blocks, int block_size, kv_block_pool **out, pd_err *err);
void kv_pool_destroy(kv_block_pool *p);
int kv_pool_num_blocks(const kv_block_pool *p);
int kv_pool_block_size(const kv_block_pool *p);
/* Blocks with no references (including cached ones): what allocation can use. */
int kv_pool_num_free(const kv_block_pool *p);
/* Blocks findable by prefix hash (referenced or not). */
int kv_pool_num_cached(const kv_block_pool *p);
/* True when no block is referenced (for leak checks). */
bool kv_pool_all_free(const kv_block_pool *p);

/* A fresh block with one reference. Evicts a cached free block if no other
 * free block is left; an error when every block is referenced. */
int kv_block_alloc(kv_block_pool *p, int32_t *id, pd_err *err);
void kv_block_ref(kv_block_pool *p, int32_t id);
/* Drop one reference; at zero the block is free (and stays cached if it was). */
void kv_block_unref(kv_block_pool *p, int32_t id);
int kv_block_refcount(const kv_block_pool *p, int32_t id);

/* ---- prefix hashes ---- */

#define KV_HASH_ROOT 0x6b76636163686531ull /* parent hash of a sequence's first block */
uint64_t kv_hash_block(uint64_t parent, const int32_t *tokens, int n);
/* The cached block with this hash and these block_size tokens, or -1. */
int32_t kv_pool_lookup(const kv_block_pool *p, uint64_t hash, const int32_t *tokens);
/* Make a full, computed, referenced block findable. Ignored when it is already
 * cached or another block already caches the same content. */
void kv_pool_publish(kv_block_pool *p, int32_t id, uint64_t hash, const int32_t *tokens);

/* ---- one sequence's block table ---- */

typedef struct kv_block_table {
    int32_t *ids;       /* physical block ids, in token order */
    int n_blocks;       /* blocks held */
    int cap;            /* allocated length of ids */
    int n_hashed;       /* leading blocks whose chained hash is known */
    uint64_t last_hash; /* hash of block n_hashed - 1 (KV_HASH_ROOT when none) */
} kv_block_table;

void kv_table_init(kv_block_table *t);
/* On an empty table: take the longest run of cached full blocks that
 * matches tokens[0..n_tokens) and return how many tokens they cover. Pass
 * prompt_len - 1 to always leave a token to compute. */
int kv_table_match_prefix(kv_block_pool *p, kv_block_table *t, const int32_t *tokens, int n_tokens);
/* Blocks still to allocate for the table to cover n_tokens. */
int kv_table_blocks_needed(const kv_block_pool *p, const kv_block_table *t, int n_tokens);
/* Grow the table to cover n_tokens; all or nothing. */
int kv_table_reserve(kv_block_pool *p, kv_block_table *t, int n_tokens, pd_err *err);
/* After the forward pass computed tokens[0..n_computed): publish the blocks
 * that became full. */
void kv_table_publish_full(kv_block_pool *p, kv_block_table *t, const int32_t *tokens,
                           int n_computed);
/* Drop every block (last block first, so a prefix's head stays cached
 * longest) and empty the table. */
void kv_table_release(kv_block_pool *p, kv_block_table *t);
void kv_table_free(kv_block_table *t); /* releases the ids array only */

/* How many blocks of block_bytes (opt_kv_block_bytes) fit in budget_bytes. */
int kv_blocks_for_budget(size_t budget_bytes, size_t block_bytes);

#endif
