/* cuda-floor: what a kernel boundary and a grid barrier cost on this GPU,
 * the floor under a batch-1 decode step made of ~64 small kernels.
 *
 *   nvcc -O3 -arch=sm_90 -o cuda-floor scripts/cuda-floor.cu && ./cuda-floor
 *
 * Every figure is the mean over 64 back-to-back operations replayed in a
 * CUDA graph (10 replays after a warm-up), as a decode step runs:
 *   empty      1-block kernels, plain stream order
 *   empty-pdl  the same launched with programmatic stream serialisation
 *              (the kernel triggers its dependent, then waits)
 *   wide-pdl   288 blocks x 256 threads, PDL
 *   stream-N   kernels that each read N MiB of a rotating set of buffers
 *              (> L2), 16-byte loads, all issued before griddepcontrol.wait
 *   barrier    one persistent kernel (one block per SM) crossing 64 grid
 *              barriers (a counter in global memory)
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdint.h>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define CALLS 64

__device__ __forceinline__ void trig(void) { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void wait_prev(void) { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__global__ void empty_kernel(int *out) {
    trig();
    wait_prev();
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0]++;
}

/* Each thread loads `per` 16-byte words before waiting, then sums them. */
template <int PER> __global__ void stream_kernel(const uint4 *src, size_t words, int *out) {
    trig();
    uint4 v[PER];
    const size_t base = (size_t)blockIdx.x * blockDim.x * PER + threadIdx.x;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const size_t at = base + (size_t)i * blockDim.x;
        v[i] = at < words ? __ldg(src + at) : make_uint4(0, 0, 0, 0);
    }
    wait_prev();
    unsigned s = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) s += v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    if (s == 0x12345678u) out[1] = s; /* keeps the loads */
}

__global__ void barrier_kernel(unsigned *count, int n) {
    for (int i = 1; i <= n; i++) {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(count, 1u);
            const unsigned target = (unsigned)i * gridDim.x;
            while (atomicAdd(count, 0u) < target) {
            }
            __threadfence();
        }
        __syncthreads();
    }
}

static cudaError_t launch(cudaStream_t s, const void *fn, dim3 grid, dim3 block, void **args, int pdl) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.stream = s;
    cfg.attrs = &attr, cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelExC(&cfg, fn, args);
}

typedef cudaError_t (*queue_fn)(cudaStream_t, void *);

static int timed(cudaStream_t s, queue_fn q, void *ctx, const char *name, double mib) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(q(s, ctx));
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaStreamSynchronize(s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    const int reps = 10;
    CHECK(cudaEventRecord(a, s));
    for (int r = 0; r < reps; r++) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    const double us = ms * 1e3 / (reps * CALLS);
    if (mib > 0)
        printf("%-12s %7.2f us each  %7.0f GB/s\n", name, us, mib * 1048576.0 / (us * 1e3));
    else
        printf("%-12s %7.2f us each\n", name, us);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return 0;
}

struct ctx {
    int *out;
    unsigned *count;
    uint4 *buf;
    size_t buf_words, words; /* whole set; one call's share */
    int blocks, pdl, sms;
};

static cudaError_t q_empty(cudaStream_t s, void *p) {
    struct ctx *c = (struct ctx *)p;
    for (int i = 0; i < CALLS; i++) {
        void *args[] = {&c->out};
        cudaError_t e = launch(s, (const void *)empty_kernel, dim3(c->blocks), dim3(256), args, c->pdl);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

#define PER 4
static cudaError_t q_stream(cudaStream_t s, void *p) {
    struct ctx *c = (struct ctx *)p;
    const size_t per_block = (size_t)256 * PER;
    const unsigned blocks = (unsigned)((c->words + per_block - 1) / per_block);
    const size_t copies = c->buf_words / c->words;
    for (int i = 0; i < CALLS; i++) {
        const uint4 *src = c->buf + (size_t)(i % copies) * c->words;
        void *args[] = {&src, &c->words, &c->out};
        cudaError_t e = launch(s, (const void *)stream_kernel<PER>, dim3(blocks), dim3(256), args, 1);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

static cudaError_t q_barrier(cudaStream_t s, void *p) {
    struct ctx *c = (struct ctx *)p;
    cudaError_t e = cudaMemsetAsync(c->count, 0, sizeof(unsigned), s);
    if (e != cudaSuccess) return e;
    barrier_kernel<<<c->sms, 256, 0, s>>>(c->count, CALLS);
    return cudaGetLastError();
}

int main(void) {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    struct ctx c = {};
    CHECK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaMalloc(&c.out, 64));
    CHECK(cudaMalloc(&c.count, 64));
    c.buf_words = ((size_t)512 << 20) / 16;
    CHECK(cudaMalloc(&c.buf, c.buf_words * 16));
    CHECK(cudaMemset(c.buf, 1, c.buf_words * 16));
    printf("SMs %d\n", c.sms);
    c.blocks = 1, c.pdl = 0;
    if (timed(s, q_empty, &c, "empty", 0)) return 1;
    c.pdl = 1;
    if (timed(s, q_empty, &c, "empty-pdl", 0)) return 1;
    c.blocks = 288;
    if (timed(s, q_empty, &c, "wide-pdl", 0)) return 1;
    const double sizes[] = {1.125, 3.375, 4.5, 73.6};
    for (int i = 0; i < 4; i++) {
        char name[32];
        c.words = (size_t)(sizes[i] * 1048576.0) / 16;
        snprintf(name, sizeof name, "stream-%.2f", sizes[i]);
        if (timed(s, q_stream, &c, name, sizes[i])) return 1;
    }
    if (timed(s, q_barrier, &c, "barrier", 0)) return 1;
    return 0;
}
