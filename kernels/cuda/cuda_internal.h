/* Inside the CUDA backend (context.c, ops.cu, heads.cu, nccl.c): the context's body, the macros
 * that check every CUDA and cuBLAS call, and (for nvcc only) the grid-stride loop and the block
 * reduction both .cu files use. Compiled as C (context.c, nccl.c) and as C++ (nvcc), so outside
 * the __CUDACC__ parts it uses only what both accept. */
#ifndef TD_CUDA_INTERNAL_H
#define TD_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/td_cuda.h"

#ifdef __cplusplus
#define TD_NORETURN [[noreturn]]
extern "C" {
#else
#define TD_NORETURN _Noreturn
#endif

struct td_cuda_ctx {
    int device;
    int sm_count; /* multiprocessors: sizes the grids of the grid-stride kernels */
    int tf32;
    int bf16; /* matmuls in bf16 mixed precision (ops.cu's bf16 path) */
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;         /* TD_CUDA_CUBLAS_WORKSPACE bytes, cuBLAS's */
    float *scratch;        /* scratch_bytes */
    size_t scratch_bytes;  /* bytes */
    double *partial;       /* TD_CUDA_REDUCE_BLOCKS doubles */
    unsigned *ticket;      /* 0 between ops: a one-launch reduction's blocks count themselves in
                            * on it, the last one finishes and puts it back (layernorm backward) */
    float *ones;           /* TD_CUDA_ONES floats of 1 */
    td_cuda_counts counts; /* what this context has issued: td_cuda_counts_get() */
};

/* Blocks for a grid-stride loop over n elements, threads a block: enough to fill the device (32
 * a multiprocessor), no more, at least one. ops.cu's and heads.cu's launches use it. */
static inline unsigned td__cuda_grid(const td_cuda_ctx *c, size_t n, int threads)
{
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    size_t cap = (size_t)c->sm_count * 32;
    return (unsigned)(b < cap ? (b > 0 ? b : 1) : cap);
}

#ifdef __CUDACC__
/* A grid-stride loop: i over [0, n) however many blocks the grid has. */
#define GRID_STRIDE(i, n)                                                   \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (size_t)gridDim.x * blockDim.x)
#endif

/* The calling thread's context; panics (TD_ESTATE) when there is none. */
td_cuda_ctx *td__cuda_ctx(void);

/* Panics with TD_ECUDA and "file:line: cudaErrorX: message (expr)"; marks the process
 * poisoned first when the error is sticky. */
TD_NORETURN void td__cuda_fail(cudaError_t e, const char *file, int line, const char *expr);

/* The same for a cuBLAS status ("file:line: CUBLAS_STATUS_X: message (expr)"), with the CUDA
 * runtime's pending error appended when there is one (a sticky error under a failed gemm). */
TD_NORETURN void td__cublas_fail(cublasStatus_t s, const char *file, int line, const char *expr);

/* For functions that return errors: sets err to TD_ECUDA and "file:line: cudaErrorX: message
 * (what)"; marks the process poisoned when sticky. Returns TD_ECUDA. */
int td__cuda_error_set(td_error_t *err, cudaError_t e, const char *file, int line,
                       const char *what);
int td__cublas_error_set(td_error_t *err, cublasStatus_t s, const char *file, int line,
                         const char *what);

/* Records a sticky error seen outside the macros (nccl.c's cudaEventQuery). */
void td__cuda_note(cudaError_t e);

/* The error stream s has met, if any (cudaStreamQuery, then the thread's pending error),
 * recorded (a sticky one poisons the process) and cleared from the thread's last-error slot;
 * cudaSuccess when none. For failures another library reports first (cuBLAS's
 * EXECUTION_FAILED, NCCL's ncclUnhandledCudaError) whose cause is a CUDA error on the
 * stream. s NULL: only the pending error. */
cudaError_t td__cuda_stream_error(cudaStream_t s);

/* file without its leading "../" (meson compiles from the build folder). */
const char *td__cuda_file(const char *file);

/* ops.cu: p[0..n) = v on stream, for the context's ones. Returns the launch's error. */
cudaError_t td__cuda_fill(float *p, float v, size_t n, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

/* Checks one CUDA runtime call; panics on failure (under a worker's boundary). */
#define TD_CUDA_CHECK(call)                                  \
    do {                                                     \
        cudaError_t td_e_ = (call);                          \
        if (td_e_ != cudaSuccess)                            \
            td__cuda_fail(td_e_, __FILE__, __LINE__, #call); \
    } while (0)

/* Checks one cuBLAS call; panics on failure. */
#define TD_CUBLAS_CHECK(call)                                  \
    do {                                                       \
        cublasStatus_t td_s_ = (call);                         \
        if (td_s_ != CUBLAS_STATUS_SUCCESS)                    \
            td__cublas_fail(td_s_, __FILE__, __LINE__, #call); \
    } while (0)

/* After a kernel launch on context x: counts it (td_cuda_counts), and checks it: a bad
 * configuration shows up here at once, a fault in the kernel at the next synchronizing call. */
#define TD_CUDA_CHECK_LAUNCH(x, name)                  \
    do {                                               \
        (x)->counts.launches++;                        \
        TD_CUDA_CHECK_NAMED(cudaGetLastError(), name); \
    } while (0)

/* One cuBLAS call of an op on context x: counted and checked. */
#define TD_CUBLAS_OP(x, call)     \
    do {                          \
        (x)->counts.blas_calls++; \
        TD_CUBLAS_CHECK(call);    \
    } while (0)

#define TD_CUDA_CHECK_NAMED(call, name)                     \
    do {                                                    \
        cudaError_t td_e_ = (call);                         \
        if (td_e_ != cudaSuccess)                           \
            td__cuda_fail(td_e_, __FILE__, __LINE__, name); \
    } while (0)

#ifdef __CUDACC__
/* The sum over a warp, every lane getting it, in a fixed butterfly order. */
static __device__ __forceinline__ double warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The sum over the block (a multiple of 32 threads), every thread getting it, in a fixed order;
 * sm holds one value per warp. The two __syncthreads let the caller reuse sm at once. ops.cu's
 * and heads.cu's reductions use it. */
static __device__ __forceinline__ double block_sum_d(double v, double *sm)
{
    int nw = (int)(blockDim.x >> 5);

    v = warp_sum_d(v);
    if ((threadIdx.x & 31) == 0)
        sm[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sm[0];
    for (int k = 1; k < nw; k++)
        v += sm[k];
    __syncthreads();
    return v;
}
#endif

#endif
