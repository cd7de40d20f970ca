/* The CUDA backend of kernels.h, and what a device worker needs around it: a per-worker
 * context (device, stream, cuBLAS handle and workspace, scratch), device memory, the
 * classification of CUDA errors, and NCCL communicators for data-parallel jobs (nccl.c).
 * Only in builds with TD_HAVE_CUDA (meson's cuda_enabled).
 *
 * The table (td_kernels_cuda()) has no room for a context argument, so each op uses the
 * calling thread's current context, set with td_cuda_ctx_bind(): one worker thread per GPU,
 * one context per worker. Every pointer an op takes is device memory (cudaMalloc), scalars
 * included: softmax_xent_forward's loss, sumsq's result and argmax_correct's count are
 * written on the device, and the backward's dloss is read there; copy them with
 * td_cuda_download(). Ops are asynchronous on the context's stream and allocate nothing.
 *
 * Errors: every CUDA, cuBLAS and NCCL call is checked. Below a worker's panic boundary (the
 * ops, the copies, td_cuda_sync, the all-reduce) a failure is td_panic(TD_ECUDA,
 * "file:line: cudaErrorX: the runtime's message (the call)"); functions that acquire
 * (context, memory, communicator) return the same message in a td_error_t instead. A sticky
 * error (cudaErrorIllegalAddress and its kin, td_cuda_error_is_sticky) poisons the process's
 * CUDA state: td_cuda_poisoned() says so from then on, and the daemon must re-execute itself
 * (DESIGN.md, "Failures").
 *
 * Threads: a context is used by one thread at a time (the one it is bound to); the table and
 * the error functions by any thread. */
#ifndef TD_CUDA_H
#define TD_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "common/td_errno.h" /* C declarations without a linkage block of their own */

/* cuBLAS's workspace, set by the context so that cuBLAS never allocates on its own in the
 * step loop. NVIDIA's recommendation for Hopper (sm_90); more than enough for Ampere. */
#define TD_CUDA_CUBLAS_WORKSPACE (32u << 20) /* bytes */

/* The context's scratch by default: the bf16 copies of a matmul's operands (in chunks that
 * fit, ops.cu's "bf16 mixed precision") and the partial sums of layernorm's backward column
 * sums. The fused attention does not use it: its block of scores lives in the scratch the
 * caller passes (td_attn_scratch() floats, kernels.h), whose size the chunk of query rows
 * bounds. */
#define TD_CUDA_SCRATCH_DEFAULT (64u << 20) /* bytes */

/* Fixed device buffers every context holds besides the two above: the partial sums of the
 * deterministic reductions (sumsq, the softmax loss) and a row of ones for bias gradients. */
#define TD_CUDA_REDUCE_BLOCKS 1024  /* doubles of partial sums */
#define TD_CUDA_ONES          65536 /* floats of 1: rows summed per gemv of a bias gradient */
#define TD_CUDA_CTX_FIXED     (TD_CUDA_REDUCE_BLOCKS * 8 + TD_CUDA_ONES * 4) /* bytes */

typedef struct td_cuda_ctx td_cuda_ctx;

/* What a context has issued since it was made, for a profile of a step (bench_gpu --profile
 * reads them before and after): kernel launches, cuBLAS calls, memsets, copies between host
 * and device, and host waits for the stream (td_cuda_sync, and each upload and download). */
typedef struct td_cuda_counts {
    uint64_t launches, blas_calls, memsets, copies, syncs;
} td_cuda_counts;
struct CUstream_st; /* cudaStream_t is a struct CUstream_st pointer */

typedef struct td_cuda_options {
    int tf32;             /* 1: fp32 matmuls may use TF32 tensor cores (10-bit mantissa
                           * products, fp32 sums); 0: full fp32. Default 0 */
    int bf16;             /* 1: bf16 mixed precision for the matmuls (td_cuda_ctx_set_bf16).
                           * Default 0 */
    size_t scratch_bytes; /* device scratch; default TD_CUDA_SCRATCH_DEFAULT. With bf16 the
                           * matmuls' bf16 operand copies live here too, chunked to fit */
} td_cuda_options;

/* Fills o with the defaults above. */
void td_cuda_options_defaults(td_cuda_options *o);

/* Creates a context on device: makes device the calling thread's current device, creates a
 * non-blocking stream, a cuBLAS handle on it with its own workspace (TF32 as opt says, NULL
 * for the defaults) and the scratch, all with cudaMalloc. Then binds it to the calling
 * thread. TD_ECUDA with the runtime's message (an out-of-memory device among them: "cudaMalloc
 * of 67108864 bytes on device 1: cudaErrorMemoryAllocation: out of memory"), TD_ENOMEM.
 * Caller frees with td_cuda_ctx_free(). */
int td_cuda_ctx_new(td_cuda_ctx **out, int device, const td_cuda_options *opt, td_error_t *err);

/* The calling thread's context's counts; all zero when no context is bound. */
void td_cuda_counts_get(td_cuda_counts *out);

/* Waits for the stream, releases everything; unbinds it from the calling thread if bound.
 * Accepts NULL. Never panics: errors at this point (a poisoned process) are ignored. */
void td_cuda_ctx_free(td_cuda_ctx *c);

/* Makes c the calling thread's current context (and its device the thread's current device);
 * NULL unbinds. TD_ECUDA when the device cannot be made current. */
int td_cuda_ctx_bind(td_cuda_ctx *c, td_error_t *err);

/* The calling thread's context, or NULL. */
td_cuda_ctx *td_cuda_ctx_current(void);

int td_cuda_ctx_device(const td_cuda_ctx *c);
struct CUstream_st *td_cuda_ctx_stream(const td_cuda_ctx *c);

/* Allows (1) or forbids (0) TF32 for the context's matmuls from the next op on (a job option).
 * Panics on a cuBLAS error. */
void td_cuda_ctx_set_tf32(td_cuda_ctx *c, int on);

/* Turns bf16 mixed precision on (1) or off (0) for the context's matmuls from the next op on
 * (the job's precision, train.h td_precision): operands rounded to bf16, products summed and
 * stored in fp32; every other op and every buffer stays fp32. Default off.
 * How: matmul_forward and matmul_backward round their operands (round to nearest even) into
 * bf16 copies in the context's scratch and multiply them with cublasGemmEx (CUDA_R_16BF
 * inputs, CUBLAS_COMPUTE_32F, fp32 outputs, the same alpha/beta as the fp32 path), in chunks
 * of rows (and of output columns when a weight's copy does not fit: GPT-2's tied lm head),
 * so no memory is allocated. The bias and its gradient stay fp32. Attention's four products
 * (q k^T, att v, and the backward's) do the same per sequence, with q, k, v, dout, att and
 * dpreatt rounded into the scratch, as many heads at a time as fit; where not even one head
 * fits they stay fp32 operands on TF32 tensor cores. The softmaxes stay fp32. Panics on a
 * cuBLAS error. */
void td_cuda_ctx_set_bf16(td_cuda_ctx *c, int on);

/* 1 when bf16 mixed precision is on for c. */
int td_cuda_ctx_bf16(const td_cuda_ctx *c);

/* The device's peak dense FLOP/s for matmuls at a precision (bf16 1: bf16 tensor cores; else
 * tf32 1: TF32 tensor cores; else plain fp32), the denominator of mfu, from the device's
 * properties (NVIDIA's datasheet figures for the models it knows: H100/H200 SXM and PCIe, A100,
 * ...). The figure is scaled by the device's SM count over the datasheet part's (a MIG slice
 * gets its share) and by its peak clock over the datasheet's boost clock when that is lower.
 * context.c lists the table and its sources. Needs no context. TD_ENOTFOUND for a device it
 * does not know (then no mfu is recorded), TD_ECUDA. */
int td_cuda_peak_flops(int device, int bf16, int tf32, double *flops, td_error_t *err);

/* The CUDA table: kernels (.cu) for every op of kernels.h and cuBLAS for every matmul,
 * computing on the calling thread's context; an op called without one panics (TD_ESTATE).
 * Differences from the CPU twin, all within the tolerances tests/test_gpu.c states: sums
 * (layernorm, softmax, bias and weight gradients, matmuls) run in another order; the
 * elementwise ops, encoder_backward and the optimizers compute exactly what cpu.c computes,
 * in the same order. set_threads does nothing. Static, never NULL. */
const td_kernels *td_kernels_cuda(void);

/* ---- device memory (the calling thread's current device) ---------------------------------- */

/* cudaMalloc of bytes into *p. TD_ECUDA naming the size, the device and the runtime's
 * message; *p NULL then. Caller frees with td_cuda_free(). */
int td_cuda_alloc(void **p, size_t bytes, td_error_t *err);
void td_cuda_free(void *p); /* accepts NULL; errors ignored */

/* cudaHostAlloc (portable: any device's stream may copy from it) of bytes into *p: page-locked
 * host memory, so an asynchronous upload from it is a DMA that leaves the host free. TD_ECUDA
 * naming the size and the runtime's message; *p NULL then. Free with td_cuda_free_host(). */
int td_cuda_alloc_host(void **p, size_t bytes, td_error_t *err);
void td_cuda_free_host(void *p); /* accepts NULL; errors ignored */

/* Host to device and device to host, on the current context's stream, waiting until done.
 * Panics (TD_ECUDA) on a CUDA error. */
void td_cuda_upload(void *dst, const void *src, size_t bytes);
void td_cuda_download(void *dst, const void *src, size_t bytes);
/* Host to device queued on the current context's stream, returning at once (not a host sync):
 * src must stay unchanged until the next download or td_cuda_sync; from cudaHostAlloc'd memory
 * the copy is a true DMA. Panics (TD_ECUDA) on a CUDA error. */
void td_cuda_upload_async(void *dst, const void *src, size_t bytes);

/* Waits for everything queued on the current context's stream. Panics with the first error
 * an op met (an illegal address shows up here). */
void td_cuda_sync(void);

/* Free and total bytes of device (cudaMemGetInfo, the memory guard's numbers): what other
 * processes and this one's contexts already hold is not free. TD_ECUDA. */
int td_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, td_error_t *err);

/* ---- errors -------------------------------------------------------------------------------- */

/* How many CUDA devices this process sees, into *n. No device, or no NVIDIA driver at all,
 * is a CPU box: *n = 0 and 0 returned. A driver older than the CUDA runtime needs is
 * TD_ECUDA naming both versions ("the NVIDIA driver supports CUDA 12.2, older than this
 * traind's CUDA runtime 13.0: update the driver"); any other runtime error TD_ECUDA with its
 * name and message. (probe.cu; kernels.h's td_cuda_device_count is this without the
 * message.) */
int td_cuda_devices(int *n, td_error_t *err);

/* 1 when cuda_error (a cudaError_t) leaves the process's CUDA state unusable, so that CUDA's
 * own guidance is to terminate and relaunch: cudaErrorIllegalAddress, LaunchTimeout, Assert,
 * HardwareStackError, IllegalInstruction, MisalignedAddress, InvalidAddressSpace, InvalidPc,
 * LaunchFailure, TensorMemoryLeak, Contained, ECCUncorrectable, MpsClientTerminated,
 * ExternalDevice. 0 for every other code (out of memory, invalid value, ...). */
int td_cuda_error_is_sticky(int cuda_error);

/* 1 once any checked call in this process met a sticky error. */
int td_cuda_poisoned(void);

/* For tests of the sticky path: queues a kernel on the current context's stream that stores
 * to an unmapped device address. The next synchronizing call fails with
 * cudaErrorIllegalAddress and the process's CUDA state is gone: call it only in a process
 * that exits afterwards. */
void td_cuda_fault_illegal_address(void);

/* ---- NCCL (nccl.c) ------------------------------------------------------------------------ */

#define TD_NCCL_ID_BYTES 128 /* NCCL_UNIQUE_ID_BYTES */

/* What every rank of one communicator must be given: rank 0 makes it, the others copy it. */
typedef struct td_nccl_id {
    char bytes[TD_NCCL_ID_BYTES];
} td_nccl_id;

/* One rank of a job's communicator: a non-blocking NCCL communicator (config.blocking = 0)
 * on its context's device and stream, and the timeout its watchdog enforces. */
typedef struct td_nccl td_nccl;

/* A new unique id (ncclGetUniqueId). TD_ECUDA with NCCL's message. */
int td_nccl_unique_id(td_nccl_id *id, td_error_t *err);

/* Joins rank (of nranks) of the communicator id on ctx's device and stream; ctx must be bound
 * to the calling thread. Every rank must call this at about the same time (the init is
 * collective): with one worker thread per GPU, each worker calls it for its own rank. Waits
 * until the communicator is ready, at most timeout_s seconds (then aborts it: TD_ECUDA
 * "NCCL communicator init did not complete within N s"). TD_ECUDA with NCCL's message.
 * Caller frees with td_nccl_free(). */
int td_nccl_init(td_nccl **out, const td_nccl_id *id, int nranks, int rank, td_cuda_ctx *ctx,
                 double timeout_s, td_error_t *err);

/* td_nccl_init whose watchdog also polls *stop (read atomically) and, once it is set, aborts
 * the communicator and fails with TD_EABORTED, "stopped: another device of the job failed":
 * in the init, in each collective and in the finalize. So a job's ranks stop at once when one
 * of them fails outside a collective, rather than at the timeout. The owning thread aborts
 * its own communicator (never another thread's, which may be polling it). stop is borrowed
 * until td_nccl_free. heartbeat (when not NULL, borrowed likewise) is set to td_mono_ms() on
 * every poll of every wait, atomically: a rank waiting on its peers is alive, and the daemon's
 * watchdog leaves the wait to this timeout. */
int td_nccl_init_stoppable(td_nccl **out, const td_nccl_id *id, int nranks, int rank,
                           td_cuda_ctx *ctx, double timeout_s, const int *stop,
                           long long *heartbeat, td_error_t *err);

/* buf (n floats, device memory of this rank's context) := the mean of every rank's buf,
 * in place (ncclAllReduce with ncclAvg). The work queued on the stream before it (the
 * backward that made buf) is waited for first, within a timeout of its own, so that compute
 * does not count against the collective; then the collective has one deadline, timeout_s from
 * when it is enqueued, for NCCL's state and the stream both. Panics (TD_ECUDA) with NCCL's
 * message or the watchdog's. */
void td_nccl_allreduce_avg(td_nccl *c, float *buf, size_t n);

/* The watchdog: polls until everything queued on the rank's stream so far has completed,
 * checking ncclCommGetAsyncError on each poll. On an asynchronous NCCL error, or when
 * timeout_s seconds (one deadline for the whole wait) pass first, aborts the communicator
 * (ncclCommAbort, which also stops its kernels) and returns TD_ECUDA: "NCCL all-reduce did
 * not complete within 30 s" or NCCL's message. An aborted communicator stays aborted: every
 * later call fails. */
int td_nccl_wait(td_nccl *c, td_error_t *err);

/* 1 once the communicator was aborted. */
int td_nccl_aborted(const td_nccl *c);

/* Finalizes (waiting at most the timeout) and destroys the communicator, or just frees an
 * aborted one. Accepts NULL. */
void td_nccl_free(td_nccl *c);

#ifdef __cplusplus
}
#endif

#endif
