/* cuda_flash: causal attention of a prefill (many new tokens per sequence)
 * over the paged KV cache on the tensor cores, FlashAttention style.
 *
 * Work split: one thread block of FLASH_WARPS warps per (query tile, head,
 * sequence). A query tile is FLASH_Q_TILE consecutive new tokens of ONE
 * sequence (tokens seq_q_start[s] + tile * FLASH_Q_TILE ...); warp w owns
 * 16 of its rows. The block walks the sequence's keys in tiles of
 * FLASH_K_TILE positions, from position 0 up to the largest position among
 * its rows (keys past it are masked for every row, so those tiles are never
 * loaded). For each key tile:
 *   1. K and V rows are copied from the cache into shared memory through the
 *      sequence's block table (position p is slot table[p / bs] * bs + p % bs,
 *      so any block size works), with cp.async into the second of two
 *      buffers while the first is being used; rows past the tile's last
 *      visible key are zero-filled, never read from the cache;
 *   2. each warp computes S = Q K^T for its 16 rows with wmma 16x16x16
 *      (fp16/bf16 inputs, fp32 accumulation); Q stays in registers as
 *      matrix_a fragments for the whole walk;
 *   3. S goes through shared memory (the accumulator layout is opaque, and
 *      a row's softmax needs the whole row): two lanes per row apply the
 *      scale and the causal mask, update the row's running max and sum in
 *      fp32, and write P = exp(S - max) in the storage dtype over S's
 *      place (P is half the size);
 *   4. the O accumulators (fp32 wmma fragments in registers) are scaled by
 *      exp(old max - new max) of their row, then O += P V with wmma.
 * At the end O / sum is written to out. Warps whose rows see no key of a
 * tile skip it (they still take part in the block's barriers), and 16-key
 * blocks of S past a warp's last visible key are skipped too.
 *
 * Rescaling an accumulator fragment row by row needs the row of each of a
 * lane's fragment elements, which wmma does not document. It is read off the
 * hardware instead: a matrix whose every element holds its row index is
 * loaded into an accumulator fragment once, and element e of any
 * accumulator fragment of that type belongs to row rowid.x[e].
 *
 * Masked scores are -inf; a row that has seen no visible key yet (max still
 * -inf) subtracts 0 instead of its max so exp gives 0, never NaN. Rows of a
 * partial query tile get position -1, see nothing and are not written.
 *
 * Everything the kernel reads comes from launch arguments and the step's
 * device metadata, so it can be captured in a CUDA graph. */
#include <math.h>
#include <mma.h>

#include "model/cuda/cuda_internal.cuh"

using namespace nvcuda;

#define FLASH_Q_TILE 64
#define FLASH_K_TILE 64
#define FLASH_WARPS (FLASH_Q_TILE / 16)
#define FLASH_THREADS (32 * FLASH_WARPS)

/* Shared memory of one block, in bytes from the start of the dynamic area:
 *   K[2], V[2]  double-buffered key tiles, FLASH_K_TILE rows of kv_ld elements
 *               (head_dim + 8: rows 16 bytes apart from a bank-aligned stride);
 *   S[warps]    per warp 16 rows of s_ld floats of scores, overwritten in place
 *               by P (p_ld storage elements a row, the same byte offsets);
 *               before the walk it also stages the warp's Q rows.
 * After the walk the K buffers stage the fp32 output (o_ld floats a row). */
template <int HD> struct flash_layout {
    static constexpr int kv_ld = HD + 8;
    static constexpr int s_ld = FLASH_K_TILE + 4;
    static constexpr int p_ld = 2 * s_ld;
    static constexpr int o_ld = HD + 4;
    static constexpr size_t kv_tile_bytes = (size_t)FLASH_K_TILE * kv_ld * 2;
    static constexpr size_t k_off = 0;
    static constexpr size_t v_off = 2 * kv_tile_bytes;
    static constexpr size_t s_off = 4 * kv_tile_bytes;
    static constexpr size_t s_warp_bytes = (size_t)16 * s_ld * sizeof(float);
    static constexpr size_t bytes = s_off + FLASH_WARPS * s_warp_bytes;

    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 128, "head_dim: a multiple of 16 up to 128");
    /* wmma pointers must be 32-byte aligned: every region and row block is. */
    static_assert(kv_tile_bytes % 128 == 0 && s_warp_bytes % 128 == 0, "region alignment");
    /* Q staging (16 rows of kv_ld elements) fits a warp's S region. */
    static_assert((size_t)16 * kv_ld * 2 <= s_warp_bytes, "Q staging");
    /* Output staging (all rows, o_ld floats) fits the two K buffers. */
    static_assert((size_t)FLASH_Q_TILE * o_ld * sizeof(float) <= 2 * kv_tile_bytes, "O staging");
};

/* ---- cp.async (sm_80+): 16-byte global -> shared copies that skip registers ---- */

__device__ __forceinline__ void cp_async16(void *smem_dst, const void *gmem_src) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
/* Wait until at most n of this thread's committed groups are still in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Queue the copy of key tile kt (positions kt * FLASH_K_TILE ...) of head h
 * into the buffers kd / vd, as one cp.async group per thread. Positions past
 * `last` (the block's largest query position) are zero rows: they may lie
 * past the sequence, where the block table holds -1. */
template <typename T, int HD>
__device__ __forceinline__ void flash_load_kv(T *kd, T *vd, const T *k_cache, const T *v_cache,
                                              const int32_t *table, int block_size, size_t row,
                                              int h, int kt, int last) {
    constexpr int CH = HD / 8; /* 16-byte chunks per row */
    typedef flash_layout<HD> L;
    for (int c = threadIdx.x; c < FLASH_K_TILE * CH; c += FLASH_THREADS) {
        const int r = c / CH, ch = c % CH;
        const int key = kt * FLASH_K_TILE + r;
        T *ks = kd + r * L::kv_ld + ch * 8, *vs = vd + r * L::kv_ld + ch * 8;
        if (key <= last) {
            const size_t slot =
                (size_t)table[key / block_size] * block_size + (size_t)(key % block_size);
            const size_t at = slot * row + (size_t)h * HD + (size_t)ch * 8;
            cp_async16(ks, k_cache + at);
            cp_async16(vs, v_cache + at);
        } else {
            *(uint4 *)ks = make_uint4(0, 0, 0, 0);
            *(uint4 *)vs = make_uint4(0, 0, 0, 0);
        }
    }
    cp_async_commit();
}

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> flash_acc;

template <typename T, int HD>
__global__ void __launch_bounds__(FLASH_THREADS)
    flash_prefill_kernel(T *out, const T *q, int q_stride, const T *k_cache, const T *v_cache,
                         const int32_t *positions, const int32_t *seq_q_start,
                         const int32_t *block_tables, int max_blocks, int heads, int block_size,
                         float scale_log2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    typedef flash_layout<HD> L;
    constexpr int CH = HD / 8;             /* 16-byte chunks per row */
    constexpr int DK = HD / 16;            /* wmma steps along head_dim */
    constexpr int KB = FLASH_K_TILE / 16;  /* 16-key blocks per key tile */
    constexpr int COLS = FLASH_K_TILE / 2; /* score columns per lane (two lanes a row) */
    constexpr int NE = flash_acc::num_elements;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int row_pos[FLASH_Q_TILE];        /* -1 for rows past the sequence's tokens */
    __shared__ int warp_last[FLASH_WARPS];       /* largest position among a warp's rows */
    __shared__ float row_alpha[FLASH_WARPS][16]; /* this tile's rescale factor per row */
    __shared__ float row_sum[FLASH_WARPS][16];   /* final softmax denominator per row */

    /* Tiles are handed out last first: the last tile of a sequence walks the
     * most keys, so it should not start in the final wave. */
    const int seq = blockIdx.z, h = blockIdx.y;
    const int tile = (int)(gridDim.x - 1 - blockIdx.x);
    const int q_begin = seq_q_start[seq], n_seq_q = seq_q_start[seq + 1] - q_begin;
    const int first = tile * FLASH_Q_TILE;
    if (first >= n_seq_q) return; /* the whole block: this sequence has fewer tiles */
    const int n_q = min(FLASH_Q_TILE, n_seq_q - first);
    const int t0 = q_begin + first;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t row = (size_t)heads * HD; /* one cache slot / output row: all heads */
    const int32_t *table = block_tables + (size_t)seq * max_blocks;

    /* Key tile buffer b (0 or 1); arithmetic, not an array, so it stays in registers. */
    T *const kbuf = (T *)(smem + L::k_off), *const vbuf = (T *)(smem + L::v_off);
    constexpr int KV_TILE = FLASH_K_TILE * L::kv_ld;                 /* elements per buffer */
    float *sw = (float *)(smem + L::s_off + warp * L::s_warp_bytes); /* this warp's S */
    T *pw = (T *)sw;                                                 /* its P, in place */

    if (threadIdx.x < FLASH_Q_TILE)
        row_pos[threadIdx.x] = (int)threadIdx.x < n_q ? positions[t0 + threadIdx.x] : -1;
    __syncthreads();
    int wl = row_pos[warp * 16 + (lane & 15)];
    for (int o = 8; o > 0; o >>= 1)
        wl = max(wl, __shfl_xor_sync(0xffffffffu, wl, o));
    if (lane == 0) warp_last[warp] = wl;
    __syncthreads();
    int block_last = warp_last[0];
    for (int w = 1; w < FLASH_WARPS; w++)
        block_last = max(block_last, warp_last[w]);
    const int n_tiles = block_last / FLASH_K_TILE + 1; /* block_last >= 0: row 0 is real */

    /* The first key tile's copy runs while Q is staged. */
    flash_load_kv<T, HD>(kbuf, vbuf, k_cache, v_cache, table, block_size, row, h, 0, block_last);

    /* Q: the warp's 16 rows through its S region into registers. */
    {
        T *qs = (T *)sw;
        for (int c = lane; c < 16 * CH; c += 32) {
            const int r = c / CH, ch = c % CH, qr = warp * 16 + r;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (qr < n_q)
                v = *(const uint4 *)(q + (size_t)(t0 + qr) * q_stride + (size_t)h * HD +
                                     (size_t)ch * 8);
            *(uint4 *)(qs + r * L::kv_ld + ch * 8) = v;
        }
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa[DK];
#pragma unroll
    for (int kk = 0; kk < DK; kk++)
        wmma::load_matrix_sync(qa[kk], (const T *)sw + kk * 16, L::kv_ld);
    __syncwarp();
    /* The row of each accumulator element (see the file comment). */
    for (int i = lane; i < 256; i += 32)
        sw[(i / 16) * L::s_ld + i % 16] = (float)(i / 16);
    __syncwarp();
    int elem_row[NE];
    {
        flash_acc rowid;
        wmma::load_matrix_sync(rowid, sw, L::s_ld, wmma::mem_row_major);
#pragma unroll
        for (int e = 0; e < NE; e++)
            elem_row[e] = (int)rowid.x[e];
    }
    __syncwarp();

    flash_acc acc_o[DK];
#pragma unroll
    for (int j = 0; j < DK; j++)
        wmma::fill_fragment(acc_o[j], 0.0f);
    /* Lanes 2r and 2r+1 share row r of the warp: columns 2i and 2i+1. */
    const int my_row = lane >> 1, my_half = lane & 1;
    const int my_pos = row_pos[warp * 16 + my_row];
    const int w_last = warp_last[warp];
    float m_run = -INFINITY, l_run = 0.0f; /* running max (log2 units) and sum of the row */

    for (int kt = 0; kt < n_tiles; kt++) {
        const int b = kt & 1;
        /* Buffer b^1 was last read in iteration kt-1, which ended in a barrier. */
        if (kt + 1 < n_tiles)
            flash_load_kv<T, HD>(kbuf + (b ^ 1) * KV_TILE, vbuf + (b ^ 1) * KV_TILE, k_cache,
                                 v_cache, table, block_size, row, h, kt + 1, block_last);
        else
            cp_async_commit(); /* an empty group keeps the count below right */
        cp_async_wait<1>();    /* tile kt's group is done (kt+1's may still run) */
        __syncthreads();       /* ... and so is every other thread's, and its zero rows */

        const int key0 = kt * FLASH_K_TILE;
        if (key0 <= w_last) {
            const int kb_live = min(KB, (w_last - key0) / 16 + 1); /* blocks with a visible key */
            const T *ks = kbuf + b * KV_TILE, *vs = vbuf + b * KV_TILE;

            /* 2. S = Q K^T for the live key blocks. */
            for (int j = 0; j < kb_live; j++) {
                flash_acc s_acc;
                wmma::fill_fragment(s_acc, 0.0f);
#pragma unroll
                for (int kk = 0; kk < DK; kk++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
                    wmma::load_matrix_sync(kf, ks + j * 16 * L::kv_ld + kk * 16, L::kv_ld);
                    wmma::mma_sync(s_acc, qa[kk], kf, s_acc);
                }
                wmma::store_matrix_sync(sw + j * 16, s_acc, L::s_ld, wmma::mem_row_major);
            }
            __syncwarp();

            /* 3. Online softmax of row my_row. A column past kb_live * 16 is
             * past w_last >= my_pos, so it is masked without being read. */
            float sv[COLS];
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < COLS; i++) {
                const int col = 2 * i + my_half;
                sv[i] = key0 + col <= my_pos ? sw[my_row * L::s_ld + col] * scale_log2 : -INFINITY;
                mx = fmaxf(mx, sv[i]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            const float m_new = fmaxf(m_run, mx);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = exp2f(m_run - m_use); /* 0 while the row had seen nothing */
            __syncwarp(); /* every lane has read its scores before P overwrites them */
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < COLS; i++) {
                const T pv = from_f32<T>(exp2f(sv[i] - m_use));
                pw[my_row * L::p_ld + 2 * i + my_half] = pv;
                sum += to_f32(pv); /* the rounded weights, so they sum to the divisor */
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            l_run = l_run * alpha + sum;
            m_run = m_new;
            if (my_half == 0) row_alpha[warp][my_row] = alpha;
            __syncwarp();

            /* 4. O = alpha O + P V. */
            float a[NE];
#pragma unroll
            for (int e = 0; e < NE; e++)
                a[e] = row_alpha[warp][elem_row[e]];
#pragma unroll
            for (int j = 0; j < DK; j++)
#pragma unroll
                for (int e = 0; e < NE; e++)
                    acc_o[j].x[e] *= a[e];
            for (int kk = 0; kk < kb_live; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
                wmma::load_matrix_sync(pf, pw + kk * 16, L::p_ld);
#pragma unroll
                for (int j = 0; j < DK; j++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
                    wmma::load_matrix_sync(vf, vs + kk * 16 * L::kv_ld + j * 16, L::kv_ld);
                    wmma::mma_sync(acc_o[j], pf, vf, acc_o[j]);
                }
            }
        }
        /* Every warp is done with buffer b (refilled two tiles on) and with
         * its S/P region before the next tile's scores land there. */
        __syncthreads();
    }
    cp_async_wait<0>(); /* nothing is in flight (the last group was empty); be explicit */

    /* O / sum: through fp32 staging in the K buffers (free after the last barrier). */
    if (my_half == 0) row_sum[warp][my_row] = l_run;
    float *os = (float *)(smem + L::k_off) + (size_t)warp * 16 * L::o_ld;
#pragma unroll
    for (int j = 0; j < DK; j++)
        wmma::store_matrix_sync(os + j * 16, acc_o[j], L::o_ld, wmma::mem_row_major);
    __syncwarp();
    for (int r = 0; r < 16; r++) {
        const int qr = warp * 16 + r;
        if (qr >= n_q) break;
        const float l = row_sum[warp][r], inv = l > 0.0f ? 1.0f / l : 0.0f;
        T *o = out + (size_t)(t0 + qr) * row + (size_t)h * HD;
        for (int d = lane; d < HD; d += 32)
            o[d] = from_f32<T>(os[r * L::o_ld + d] * inv);
    }
#endif
}

template <typename T, int HD>
static void flash_launch(cudaStream_t s, void *out, const void *q, int q_stride,
                         const void *k_cache, const void *v_cache, const pd_step_meta *m, int heads,
                         int block_size, float scale) {
    typedef flash_layout<HD> L;
    const int smem = (int)L::bytes;
    /* Over 48 KiB of dynamic shared memory must be asked for. A launch error
     * (here or below) is caught by the caller's cudaGetLastError. */
    if (L::bytes > 48 * 1024)
        cudaFuncSetAttribute(flash_prefill_kernel<T, HD>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const dim3 grid((unsigned)((m->max_q_len + FLASH_Q_TILE - 1) / FLASH_Q_TILE), (unsigned)heads,
                    (unsigned)m->n_seqs);
    flash_prefill_kernel<T, HD><<<grid, FLASH_THREADS, (size_t)smem, s>>>(
        (T *)out, (const T *)q, q_stride, (const T *)k_cache, (const T *)v_cache, m->positions,
        m->seq_q_start, m->block_tables, m->max_blocks, heads, block_size,
        scale * 1.4426950408889634f /* log2(e): exp(x) = exp2(x log2 e) */);
}

template <typename T>
static void flash_pick(cudaStream_t s, void *out, const void *q, int q_stride, const void *k_cache,
                       const void *v_cache, const pd_step_meta *m, int heads, int head_dim,
                       int block_size, float scale) {
#define FLASH_CASE(D)                                                                              \
    case D:                                                                                        \
        flash_launch<T, D>(s, out, q, q_stride, k_cache, v_cache, m, heads, block_size, scale);    \
        break;
    switch (head_dim) {
        FLASH_CASE(16)
        FLASH_CASE(32)
        FLASH_CASE(48)
        FLASH_CASE(64)
        FLASH_CASE(80)
        FLASH_CASE(96)
        FLASH_CASE(112)
        FLASH_CASE(128)
    }
#undef FLASH_CASE
}

static bool aligned16(const void *p) {
    return ((uintptr_t)p & 15) == 0;
}

bool cuda_flash_attention_fits(pd_dtype dt, const void *out, const void *q, int q_stride,
                               const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                               int heads, int head_dim) {
    if (dt != PD_F16 && dt != PD_BF16) return false;
    if (head_dim % 16 != 0 || head_dim > 128 || meta->max_q_len < 16 || !meta->seq_q_start)
        return false;
    if (meta->n_seqs <= 0 || meta->n_seqs > 65535 || heads > 65535) return false;
    /* Rows are moved in 16-byte pieces. */
    if (!aligned16(out) || !aligned16(q) || !aligned16(k_cache) || !aligned16(v_cache) ||
        ((size_t)q_stride * 2) % 16 != 0)
        return false;
    /* wmma on bf16 and cp.async need sm_80 (the kernel body is empty below it). */
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return major >= 8;
}

void cuda_flash_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                          const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                          int heads, int head_dim, int block_size, float scale) {
    if (dt == PD_F16)
        flash_pick<__half>(s, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim, block_size,
                           scale);
    else if (dt == PD_BF16)
        flash_pick<__nv_bfloat16>(s, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim,
                                  block_size, scale);
}
