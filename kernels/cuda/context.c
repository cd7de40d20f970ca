/* The CUDA backend's context and errors (td_cuda.h): creating and binding a worker's context
 * (device, stream, cuBLAS handle with its own workspace, scratch), device memory and copies,
 * the memory guard's numbers, and the one place where a CUDA or cuBLAS failure becomes a
 * td_ error or a panic, with the process marked poisoned when the error is sticky. The
 * context is used by the thread it is bound to; the error functions by any thread. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "td_panic.h"

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
    cudaError_t e = cudaPeekAtLastError();
    int n = snprintf(buf, size, "%s:%d: %s: %s (%s)", td__cuda_file(file), line,
                     cublasGetStatusName(s), cublasGetStatusString(s), what);

    if (e != cudaSuccess && n > 0 && (size_t)n < size) {
        snprintf(buf + n, size - (size_t)n, "; CUDA: %s: %s", cudaGetErrorName(e),
                 cudaGetErrorString(e));
        td__cuda_note(e);
    }
}

void td__cuda_fail(cudaError_t e, const char *file, int line, const char *expr)
{
    char msg[512];

    td__cuda_note(e);
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
    o->scratch_bytes = TD_CUDA_SCRATCH_DEFAULT;
}

static cublasMath_t math_mode(int tf32)
{
    return tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
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
    c->scratch_bytes = opt->scratch_bytes;

    TRY_CUDA(cudaSetDevice(device), fail);
    TRY_CUDA(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, device), fail);
    TRY_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), fail);
    TRY_CUBLAS(cublasCreate(&c->blas), fail);
    TRY_CUBLAS(cublasSetStream(c->blas, c->stream), fail);
    if ((rc = alloc_on(&c->blas_ws, TD_CUDA_CUBLAS_WORKSPACE, device, err)) != 0)
        goto fail;
    TRY_CUBLAS(cublasSetWorkspace(c->blas, c->blas_ws, TD_CUDA_CUBLAS_WORKSPACE), fail);
    TRY_CUBLAS(cublasSetMathMode(c->blas, math_mode(c->tf32)), fail);
    if ((rc = alloc_on((void **)&c->scratch, c->scratch_bytes, device, err)) != 0 ||
        (rc = alloc_on((void **)&c->partial, TD_CUDA_REDUCE_BLOCKS * sizeof(double), device,
                       err)) != 0 ||
        (rc = alloc_on((void **)&c->ones, TD_CUDA_ONES * sizeof(float), device, err)) != 0)
        goto fail;
    TRY_CUDA(td__cuda_fill(c->ones, 1.0f, TD_CUDA_ONES, c->stream), fail);
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
    if (c == NULL)
        return;
    if (c->stream != NULL)
        (void)cudaStreamSynchronize(c->stream);
    if (c->blas != NULL)
        (void)cublasDestroy(c->blas);
    cudaFree(c->ones);
    cudaFree(c->partial);
    cudaFree(c->scratch);
    cudaFree(c->blas_ws);
    if (c->stream != NULL)
        (void)cudaStreamDestroy(c->stream);
    (void)cudaGetLastError(); /* nothing to report to: a poisoned process fails here too */
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
    TD_CUBLAS_CHECK(cublasSetMathMode(c->blas, math_mode(c->tf32)));
}

/* ---- memory -------------------------------------------------------------------------------- */

int td_cuda_alloc(void **p, size_t bytes, td_error_t *err)
{
    int device = -1;

    (void)cudaGetDevice(&device);
    return alloc_on(p, bytes, device, err);
}

void td_cuda_free(void *p)
{
    if (p != NULL)
        (void)cudaFree(p);
}

void td_cuda_upload(void *dst, const void *src, size_t bytes)
{
    td_cuda_ctx *c = td__cuda_ctx();

    TD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream));
    TD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

void td_cuda_download(void *dst, const void *src, size_t bytes)
{
    td_cuda_ctx *c = td__cuda_ctx();

    TD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    TD_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

void td_cuda_sync(void)
{
    TD_CUDA_CHECK(cudaStreamSynchronize(td__cuda_ctx()->stream));
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
