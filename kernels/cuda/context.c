/* The CUDA backend's context and errors (td_cuda.h): creating and binding a worker's context
 * (device, stream, cuBLAS handle with its own workspace, scratch), device memory and copies,
 * the memory guard's numbers, and the one place where a CUDA or cuBLAS failure becomes a
 * td_ error or a panic, with the process marked poisoned when the error is sticky. The
 * context is used by the thread it is bound to; the error functions by any thread. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.h"
#include "common/td_panic.h"

/* Set once, never cleared: a sticky error ends the process's CUDA life. */
static atomic_int poisoned;

static _Thread_local td_cuda_ctx *current;

/* ---- errors -------------------------------------------------------------------------------- */

int td_cuda_error_is_sticky(int e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorContained:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    /* The header does not say "relaunch" for this one, but an uncorrectable ECC error
     * corrupts the context (Xid 48): NVIDIA's guidance is to restart the application. */
    case cudaErrorECCUncorrectable:
        return 1;
    default:
        return 0;
    }
}

int td_cuda_poisoned(void)
{
    return atomic_load(&poisoned);
}

void td__cuda_note(cudaError_t e)
{
    if (td_cuda_error_is_sticky(e))
        atomic_store(&poisoned, 1);
}

/* A failed runtime call also leaves its error in the calling thread's last-error slot, where
 * the next kernel launch's check (cudaGetLastError) would find it: the worker's next job would
 * fail at its first kernel with this job's error. The error has been reported once; clear it.
 * (A sticky error cannot be cleared, and the process is poisoned then anyway.) */
static void clear_last_error(void)
{
    (void)cudaGetLastError();
}

cudaError_t td__cuda_stream_error(cudaStream_t s)
{
    cudaError_t e = s != NULL ? cudaStreamQuery(s) : cudaSuccess;

    if (e == cudaErrorNotReady) {
        (void)cudaGetLastError(); /* still running is not an error, but sets the slot */
        e = cudaSuccess;
    }
    if (e == cudaSuccess)
        e = cudaPeekAtLastError();
    if (e != cudaSuccess) {
        td__cuda_note(e);
        clear_last_error();
    }
    return e;
}

const char *td__cuda_file(const char *file)
{
    while (strncmp(file, "../", 3) == 0)
        file += 3;
    return file;
}

/* "file:line: cudaErrorX: message (what)" into buf. */
static void cuda_message(char *buf, size_t size, cudaError_t e, const char *file, int line,
                         const char *what)
{
    snprintf(buf, size, "%s:%d: %s: %s (%s)", td__cuda_file(file), line, cudaGetErrorName(e),
             cudaGetErrorString(e), what);
}

/* The same for a cuBLAS status, with the CUDA runtime's pending error when there is one: a
 * gemm that fails with EXECUTION_FAILED after a kernel faulted carries the fault's name. */
static void cublas_message(char *buf, size_t size, cublasStatus_t s, const char *file, int line,
                           const char *what)
{
    /* The pending error can be empty while the fault is still only on the stream: ask it. */
    cudaError_t e = td__cuda_stream_error(current != NULL ? current->stream : NULL);
    int n = snprintf(buf, size, "%s:%d: %s: %s (%s)", td__cuda_file(file), line,
                     cublasGetStatusName(s), cublasGetStatusString(s), what);

    if (e != cudaSuccess && n > 0 && (size_t)n < size)
        snprintf(buf + n, size - (size_t)n, "; CUDA: %s: %s", cudaGetErrorName(e),
                 cudaGetErrorString(e));
}

void td__cuda_fail(cudaError_t e, const char *file, int line, const char *expr)
{
    char msg[512];

    td__cuda_note(e);
    clear_last_error();
    cuda_message(msg, sizeof(msg), e, file, line, expr);
    td_panic(TD_ECUDA, "%s", msg);
}

void td__cublas_fail(cublasStatus_t s, const char *file, int line, const char *expr)
{
    char msg[512];

    cublas_message(msg, sizeof(msg), s, file, line, expr);
    td_panic(TD_ECUDA, "%s", msg);
}

int td__cuda_error_set(td_error_t *err, cudaError_t e, const char *file, int line, const char *what)
{
    char msg[512];

    td__cuda_note(e);
    clear_last_error();
    cuda_message(msg, sizeof(msg), e, file, line, what);
    return td_error_set(err, TD_ECUDA, "%s", msg);
}

int td__cublas_error_set(td_error_t *err, cublasStatus_t s, const char *file, int line,
                         const char *what)
{
    char msg[512];

    cublas_message(msg, sizeof(msg), s, file, line, what);
    return td_error_set(err, TD_ECUDA, "%s", msg);
}

/* For the acquiring functions below: on failure, set err and go to the label. */
#define TRY_CUDA(call, label)                                            \
    do {                                                                 \
        cudaError_t e_ = (call);                                         \
        if (e_ != cudaSuccess) {                                         \
            rc = td__cuda_error_set(err, e_, __FILE__, __LINE__, #call); \
            goto label;                                                  \
        }                                                                \
    } while (0)

#define TRY_CUBLAS(call, label)                                            \
    do {                                                                   \
        cublasStatus_t s_ = (call);                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                 \
            rc = td__cublas_error_set(err, s_, __FILE__, __LINE__, #call); \
            goto label;                                                    \
        }                                                                  \
    } while (0)

/* ---- the context --------------------------------------------------------------------------- */

void td_cuda_options_defaults(td_cuda_options *o)
{
    o->tf32 = 0;
    o->bf16 = 0;
    o->scratch_bytes = TD_CUDA_SCRATCH_DEFAULT;
}

/* The math mode of the context's fp32 products: TF32 when the job allows it, and also while
 * bf16 is on, where the only fp32 gemms left are attention's when its bf16 copies do not fit
 * the scratch (ops.cu falls back to them): TF32 keeps 10 mantissa bits of their operands, more
 * than bf16's 7, so the job's precision is not lowered, and the step is not left at plain
 * fp32's speed. */
static cublasMath_t math_mode(const td_cuda_ctx *c)
{
    return c->tf32 || c->bf16 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
}

/* cudaMalloc with the size and device in the message, for the acquiring functions. */
static int alloc_on(void **p, size_t bytes, int device, td_error_t *err)
{
    cudaError_t e = cudaMalloc(p, bytes > 0 ? bytes : 1);
    char what[96];

    if (e == cudaSuccess)
        return 0;
    *p = NULL;
    (void)cudaGetLastError(); /* out of memory is not sticky: clear it */
    snprintf(what, sizeof(what), "cudaMalloc of %zu bytes on device %d", bytes, device);
    return td__cuda_error_set(err, e, __FILE__, __LINE__, what);
}

/* Acquires in order, unwinding through td_cuda_ctx_free (which takes a half-built context):
 * the stream first, since cublasSetStream resets the workspace, which is set after it. */
int td_cuda_ctx_new(td_cuda_ctx **out, int device, const td_cuda_options *opt, td_error_t *err)
{
    td_cuda_options dflt;
    td_cuda_ctx *c;
    int rc = 0;

    *out = NULL;
    if (opt == NULL) {
        td_cuda_options_defaults(&dflt);
        opt = &dflt;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a CUDA context");
    c->device = device;
    c->tf32 = opt->tf32 != 0;
    c->bf16 = opt->bf16 != 0;
    c->scratch_bytes = opt->scratch_bytes;

    TRY_CUDA(cudaSetDevice(device), fail);
    TRY_CUDA(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device), fail);
    TRY_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), fail);
    TRY_CUBLAS(cublasCreate(&c->blas), fail);
    TRY_CUBLAS(cublasSetStream(c->blas, c->stream), fail);
    if ((rc = alloc_on(&c->blas_ws, TD_CUDA_CUBLAS_WORKSPACE, device, err)) != 0)
        goto fail;
    TRY_CUBLAS(cublasSetWorkspace(c->blas, c->blas_ws, TD_CUDA_CUBLAS_WORKSPACE), fail);
    TRY_CUBLAS(cublasSetMathMode(c->blas, math_mode(c)), fail);
    if ((rc = alloc_on((void **)&c->scratch, c->scratch_bytes, device, err)) != 0 ||
        (rc = alloc_on((void **)&c->partial, TD_CUDA_REDUCE_BLOCKS * sizeof(double), device,
                       err)) != 0 ||
        (rc = alloc_on((void **)&c->ones, TD_CUDA_ONES * sizeof(float), device, err)) != 0 ||
        (rc = alloc_on((void **)&c->ticket, sizeof(*c->ticket), device, err)) != 0)
        goto fail;
    TRY_CUDA(td__cuda_fill(c->ones, 1.0f, TD_CUDA_ONES, c->stream), fail);
    TRY_CUDA(cudaMemsetAsync(c->ticket, 0, sizeof(*c->ticket), c->stream), fail);
    TRY_CUDA(cudaStreamSynchronize(c->stream), fail);
    current = c;
    *out = c;
    return 0;

fail:
    td_cuda_ctx_free(c);
    return rc;
}

void td_cuda_ctx_free(td_cuda_ctx *c)
{
    int prev = -1;

    if (c == NULL)
        return;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(c->device); /* its buffers and stream are that device's */
    if (c->stream != NULL)
        (void)cudaStreamSynchronize(c->stream);
    if (c->blas != NULL)
        (void)cublasDestroy(c->blas);
    cudaFree(c->ticket);
    cudaFree(c->ones);
    cudaFree(c->partial);
    cudaFree(c->scratch);
    cudaFree(c->blas_ws);
    if (c->stream != NULL)
        (void)cudaStreamDestroy(c->stream);
    (void)cudaGetLastError(); /* nothing to report to: a poisoned process fails here too */
    /* The thread goes back to the device it was on, not to the freed context's. */
    if (prev >= 0 && prev != c->device)
        (void)cudaSetDevice(prev);
    (void)cudaGetLastError();
    if (current == c)
        current = NULL;
    free(c);
}

int td_cuda_ctx_bind(td_cuda_ctx *c, td_error_t *err)
{
    int rc = 0;

    if (c != NULL)
        TRY_CUDA(cudaSetDevice(c->device), out);
    current = c;
out:
    return rc;
}

td_cuda_ctx *td_cuda_ctx_current(void)
{
    return current;
}

td_cuda_ctx *td__cuda_ctx(void)
{
    if (current == NULL)
        td_panic(TD_ESTATE, "a CUDA op on a thread without a CUDA context (td_cuda_ctx_bind)");
    return current;
}

int td_cuda_ctx_device(const td_cuda_ctx *c)
{
    return c->device;
}

struct CUstream_st *td_cuda_ctx_stream(const td_cuda_ctx *c)
{
    return c->stream;
}

void td_cuda_ctx_set_tf32(td_cuda_ctx *c, int on)
{
    c->tf32 = on != 0;
    TD_CUBLAS_CHECK(cublasSetMathMode(c->blas, math_mode(c)));
}

/* Only a flag and the math mode: ops.cu's matmuls read c->bf16 at each call, and ops queue on
 * one stream, so a switch between two ops takes effect exactly between them. */
void td_cuda_ctx_set_bf16(td_cuda_ctx *c, int on)
{
    c->bf16 = on != 0;
    TD_CUBLAS_CHECK(cublasSetMathMode(c->blas, math_mode(c)));
}

int td_cuda_ctx_bf16(const td_cuda_ctx *c)
{
    return c->bf16;
}

/* ---- peak FLOP/s --------------------------------------------------------------------------- */

/* Dense (no structured sparsity) tensor-core and CUDA-core peaks per GPU, TFLOP/s, as NVIDIA's
 * datasheets state them, and the SM count and boost clock (MHz) those figures assume. Where a
 * datasheet gives only "with sparsity" figures (marked *), the dense figure is half of it.
 *  - H100 SXM5 and H200 SXM (132 SMs, 1980 MHz): "NVIDIA H100 Tensor Core GPU" datasheet and
 *    the H200 datasheet: FP32 66.9, TF32 494.7 (989.4*), BF16 989.4 (1978.9*); the same for
 *    GH200's GPU (GH200 datasheet: FP32 67, TF32 494, BF16 990).
 *  - H100 PCIe (114 SMs, 1755 MHz): FP32 51.2, TF32 378 (756*), BF16 756 (1513*).
 *  - H100 NVL and H200 NVL (132 SMs, per GPU, at their lower power limit): FP32 60, TF32
 *    835* -> 417.5, BF16 1671* -> 835.5.
 *  - A100 SXM4 and PCIe (108 SMs, 1410 MHz): "NVIDIA A100 Tensor Core GPU" datasheet:
 *    FP32 19.5, TF32 156, BF16 312.
 *  - L40S (142 SMs, 2520 MHz): FP32 91.6, TF32 183 (366*), BF16 362.05 (733*).
 *  - L40 (142 SMs, 2490 MHz): FP32 90.5, TF32 90.5 (181*), BF16 181.05 (362.1*).
 *  - L4 (58 SMs, 2040 MHz): FP32 30.3, TF32 60 (120*), BF16 121 (242*).
 *  - A10 (72 SMs, 1695 MHz): FP32 31.2, TF32 62.5 (125*), BF16 125 (250*).
 * The list is matched in order, so the more specific names come first. */
typedef struct peak_entry {
    const char *name;        /* a substring of cudaDeviceProp.name */
    const char *also;        /* a second substring it must hold, or NULL */
    const char *never;       /* a substring it must not hold, or NULL */
    int major;               /* compute capability major, 0: any */
    int sm;                  /* SMs the figures assume */
    int mhz;                 /* boost clock the figures assume */
    double fp32, tf32, bf16; /* TFLOP/s */
} peak_entry;

static const peak_entry peaks[] = {
    {"H200", "NVL", NULL, 9, 132, 1785, 60.0, 417.5, 835.5},
    {"H100", "NVL", NULL, 9, 132, 1785, 60.0, 417.5, 835.5},
    {"H100", "PCIe", NULL, 9, 114, 1755, 51.2, 378.0, 756.0},
    {"GH200", NULL, NULL, 9, 132, 1980, 66.9, 494.7, 989.4},
    {"H200", NULL, NULL, 9, 132, 1980, 66.9, 494.7, 989.4},
    {"H100", NULL, NULL, 9, 132, 1980, 66.9, 494.7, 989.4},
    {"A100", NULL, NULL, 8, 108, 1410, 19.5, 156.0, 312.0},
    {"L40S", NULL, NULL, 8, 142, 2520, 91.6, 183.0, 362.05},
    {"L40", NULL, "L40S", 8, 142, 2490, 90.5, 90.5, 181.05},
    {"L4", NULL, "L40", 8, 58, 2040, 30.3, 60.0, 121.0},
    {"A10", NULL, "A100", 8, 72, 1695, 31.2, 62.5, 125.0},
};

/* The entry for a device's name and compute capability, or NULL. "L4" and "A10" are matched
 * as whole words, so that "L40" is not an L4 and "A100" not an A10. */
static const peak_entry *peak_lookup(const char *name, int major)
{
    for (size_t i = 0; i < sizeof(peaks) / sizeof(peaks[0]); i++) {
        const peak_entry *p = &peaks[i];
        const char *at = strstr(name, p->name);
        size_t len = strlen(p->name);
        if (at == NULL || (p->also != NULL && strstr(name, p->also) == NULL) ||
            (p->never != NULL && strstr(name, p->never) != NULL) ||
            (p->major != 0 && p->major != major))
            continue;
        if (at[len] >= '0' && at[len] <= '9')
            continue; /* "L4" in "L40", "A10" in "A100", "H100" in "H1000" */
        return p;
    }
    return NULL;
}

/* The datasheet figure for the precision, times the device's share of the datasheet part: its
 * SM count over the part's (a MIG slice reports its own SMs), and its peak clock over the
 * part's boost clock when it is lower (a part clocked down by its maker). A clock reported
 * higher than the datasheet's is not believed: the figure is never raised. */
int td_cuda_peak_flops(int device, int bf16, int tf32, double *flops, td_error_t *err)
{
    struct cudaDeviceProp prop;
    const peak_entry *p;
    int clock_khz = 0, rc = 0;
    double tflops, scale;

    *flops = 0.0;
    TRY_CUDA(cudaGetDeviceProperties(&prop, device), out);
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device) != cudaSuccess) {
        (void)cudaGetLastError();
        clock_khz = 0;
    }
    prop.name[sizeof(prop.name) - 1] = '\0';
    p = peak_lookup(prop.name, prop.major);
    if (p == NULL)
        return td_error_set(err, TD_ENOTFOUND,
                            "device %d (%s, sm_%d%d): no datasheet peak known for it", device,
                            prop.name, prop.major, prop.minor);
    tflops = bf16 ? p->bf16 : tf32 ? p->tf32 : p->fp32;
    scale = prop.multiProcessorCount > 0 && prop.multiProcessorCount < p->sm
                ? (double)prop.multiProcessorCount / p->sm
                : 1.0;
    if (clock_khz > 0 && clock_khz < p->mhz * 1000)
        scale *= (double)clock_khz / (p->mhz * 1000.0);
    *flops = tflops * 1e12 * scale;
out:
    return rc;
}

/* ---- memory -------------------------------------------------------------------------------- */

int td_cuda_alloc(void **p, size_t bytes, td_error_t *err)
{
    int device = -1;

    (void)cudaGetDevice(&device);
    return alloc_on(p, bytes, device, err);
}

int td_cuda_alloc_host(void **p, size_t bytes, td_error_t *err)
{
    cudaError_t e = cudaHostAlloc(p, bytes > 0 ? bytes : 1, cudaHostAllocPortable);
    char what[96];

    if (e == cudaSuccess)
        return 0;
    *p = NULL;
    snprintf(what, sizeof(what), "cudaHostAlloc of %zu bytes of page-locked host memory", bytes);
    return td__cuda_error_set(err, e, __FILE__, __LINE__, what);
}

/* A free's error is not returned, so it must not linger either: left in the thread's
 * last-error slot, it would be blamed on the next kernel launched. A sticky one is recorded. */
static void freed(cudaError_t e)
{
    if (e != cudaSuccess) {
        td__cuda_note(e);
        clear_last_error();
    }
}

void td_cuda_free_host(void *p)
{
    if (p != NULL)
        freed(cudaFreeHost(p));
}

void td_cuda_free(void *p)
{
    if (p != NULL)
        freed(cudaFree(p));
}

void td_cuda_upload(void *dst, const void *src, size_t bytes)
{
    td_cuda_ctx *c = td__cuda_ctx();

    c->counts.copies++, c->counts.syncs++;
    TD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    TD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

void td_cuda_upload_async(void *dst, const void *src, size_t bytes)
{
    td_cuda_ctx *c = td__cuda_ctx();

    c->counts.copies++;
    TD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
}

void td_cuda_download(void *dst, const void *src, size_t bytes)
{
    td_cuda_ctx *c = td__cuda_ctx();

    c->counts.copies++, c->counts.syncs++;
    TD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    TD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

void td_cuda_sync(void)
{
    td_cuda_ctx *c = td__cuda_ctx();

    c->counts.syncs++;
    TD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

void td_cuda_counts_get(td_cuda_counts *out)
{
    static const td_cuda_counts none;

    *out = current != NULL ? current->counts : none;
}

/* cudaMemGetInfo answers for the calling thread's current device, so that device is made
 * current for the question and the previous one restored. */
int td_cuda_mem_info(int device, size_t *free_bytes, size_t *total_bytes, td_error_t *err)
{
    int prev = -1, rc = 0;

    *free_bytes = *total_bytes = 0;
    TRY_CUDA(cudaGetDevice(&prev), out);
    TRY_CUDA(cudaSetDevice(device), out);
    TRY_CUDA(cudaMemGetInfo(free_bytes, total_bytes), restore);
restore:
    if (prev != device)
        (void)cudaSetDevice(prev);
out:
    return rc;
}
