/* NCCL for data-parallel jobs (td_cuda.h): one non-blocking communicator per job, one rank per
 * worker thread (so one per GPU), an in-place averaging all-reduce on the worker's stream, and
 * the watchdog that turns a collective that never completes into a failure (DESIGN.md,
 * "Failures"). Non-blocking (config.blocking = 0) means no NCCL call waits on a peer: the
 * init and the collective return at once, possibly with ncclInProgress, and the watchdog
 * polls ncclCommGetAsyncError and an event recorded after the collective until both say done,
 * or aborts the communicator (ncclCommAbort also stops its kernels) when the timeout passes.
 * A td_nccl is used by the thread that owns its rank.
 *
 * A job's replica that fails outside the collective (a panic in its step, a trainer that
 * could not be built) must not leave its peers waiting in the init or an all-reduce until the
 * timeout. ncclCommAbort from another thread would free the communicator under the owner's
 * poll, so the owner aborts it itself: td_nccl_init_stoppable takes a flag the job's other
 * threads set (the daemon's run), which the watchdog reads on every poll; once it is set the
 * rank aborts its communicator and fails with TD_EABORTED. */
/* nccl.h declares a few functions as f() rather than f(void) */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_internal.h"
#include "common/td_clock.h"
#include "common/td_panic.h"

#define POLL_NS 100000 /* nanoseconds between two polls of the watchdog: 0.1 ms */

_Static_assert(sizeof(ncclUniqueId) == TD_NCCL_ID_BYTES, "td_nccl_id must hold an ncclUniqueId");

struct td_nccl {
    ncclComm_t comm;
    td_cuda_ctx *ctx;
    cudaEvent_t before; /* recorded before each collective: the step's work it waits for */
    cudaEvent_t done;   /* recorded after each collective */
    double timeout_s;
    int rank, nranks;
    int aborted;
    const int *stop;      /* borrowed: nonzero (read atomically) stops every wait; NULL: none */
    long long *heartbeat; /* borrowed: set (atomically) to td_mono_ms() on every poll; NULL */
};

/* NCCL has ncclGetErrorString but no names; these are nccl.h's. */
static const char *nccl_name(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "ncclSuccess";
    case ncclUnhandledCudaError:
        return "ncclUnhandledCudaError";
    case ncclSystemError:
        return "ncclSystemError";
    case ncclInternalError:
        return "ncclInternalError";
    case ncclInvalidArgument:
        return "ncclInvalidArgument";
    case ncclInvalidUsage:
        return "ncclInvalidUsage";
    case ncclRemoteError:
        return "ncclRemoteError";
    case ncclInProgress:
        return "ncclInProgress";
    default:
        return "ncclError";
    }
}

/* "file:line: ncclX: NCCL's string (what): NCCL's last error" into err. A CUDA error under
 * the NCCL one (ncclUnhandledCudaError, or an async error after a kernel faulted) is looked
 * for on the rank's stream, named, and classified as the CUDA macros classify it, so that a
 * sticky error marks the process poisoned whichever library reported it first. */
static int nccl_error(td_error_t *err, ncclResult_t r, const td_nccl *c, const char *file, int line,
                      const char *what)
{
    const char *last = ncclGetLastError(c != NULL ? c->comm : NULL);
    cudaError_t e = c != NULL ? td__cuda_stream_error(c->ctx->stream) : cudaSuccess;

    return td_error_set(err, TD_ECUDA, "%s:%d: %s: %s (%s)%s%s%s%s%s%s", td__cuda_file(file), line,
                        nccl_name(r), ncclGetErrorString(r), what,
                        last != NULL && last[0] != '\0' ? ": " : "", last != NULL ? last : "",
                        e != cudaSuccess ? "; CUDA: " : "",
                        e != cudaSuccess ? cudaGetErrorName(e) : "", e != cudaSuccess ? ": " : "",
                        e != cudaSuccess ? cudaGetErrorString(e) : "");
}

#define NCCL_ERR(r, c, what) nccl_error(err, (r), (c), __FILE__, __LINE__, (what))

/* One poll's pause. The rank is alive and waiting, not hung: its heartbeat goes on, so the
 * daemon's watchdog (systemd's WatchdogSec) leaves a collective to this file's own timeout. */
static void nap(td_nccl *c)
{
    struct timespec ts = {0, POLL_NS};

    if (c->heartbeat != NULL)
        __atomic_store_n(c->heartbeat, (long long)td_mono_ms(), __ATOMIC_RELAXED);
    nanosleep(&ts, NULL);
}

/* Seconds from now until deadline (CLOCK_MONOTONIC seconds); <= 0 once it has passed. */
static double left(double deadline)
{
    return deadline - td_mono_ms() / 1e3;
}

static void abort_comm(td_nccl *c)
{
    if (!c->aborted) {
        (void)ncclCommAbort(c->comm);
        c->aborted = 1;
    }
}

int td_nccl_unique_id(td_nccl_id *id, td_error_t *err)
{
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);

    if (r != ncclSuccess)
        return NCCL_ERR(r, NULL, "ncclGetUniqueId");
    memcpy(id->bytes, u.internal, sizeof(id->bytes));
    return 0;
}

/* Whether another thread asked this rank to stop: then it aborts its communicator. */
static int stopped(td_nccl *c, td_error_t *err)
{
    if (c->stop == NULL || __atomic_load_n(c->stop, __ATOMIC_ACQUIRE) == 0)
        return 0;
    abort_comm(c);
    td_error_set(err, TD_EABORTED, "stopped: another device of the job failed");
    return 1;
}

/* Polls the communicator's state until it is no longer ncclInProgress, at most until deadline
 * (CLOCK_MONOTONIC seconds). what names the operation in the messages. */
static int wait_state(td_nccl *c, const char *what, double deadline, td_error_t *err)
{
    ncclResult_t state;

    for (;;) {
        if (stopped(c, err))
            return TD_EABORTED;
        ncclResult_t r = ncclCommGetAsyncError(c->comm, &state);
        if (r != ncclSuccess) {
            NCCL_ERR(r, c, "ncclCommGetAsyncError");
            abort_comm(c);
            return TD_ECUDA;
        }
        if (state == ncclSuccess)
            return 0;
        if (state != ncclInProgress) {
            NCCL_ERR(state, c, what);
            abort_comm(c);
            return TD_ECUDA;
        }
        if (left(deadline) <= 0) {
            abort_comm(c);
            return td_error_set(err, TD_ECUDA,
                                "NCCL %s did not complete within %g s (rank %d of %d)", what,
                                c->timeout_s, c->rank, c->nranks);
        }
        nap(c);
    }
}

int td_nccl_init(td_nccl **out, const td_nccl_id *id, int nranks, int rank, td_cuda_ctx *ctx,
                 double timeout_s, td_error_t *err)
{
    return td_nccl_init_stoppable(out, id, nranks, rank, ctx, timeout_s, NULL, NULL, err);
}

/* An event for the rank's stream, created without timing (the cheapest kind). */
static int new_event(cudaEvent_t *ev, td_error_t *err)
{
    cudaError_t e = cudaEventCreateWithFlags(ev, cudaEventDisableTiming);

    return e == cudaSuccess
               ? 0
               : td__cuda_error_set(err, e, __FILE__, __LINE__, "cudaEventCreateWithFlags");
}

int td_nccl_init_stoppable(td_nccl **out, const td_nccl_id *id, int nranks, int rank,
                           td_cuda_ctx *ctx, double timeout_s, const int *stop,
                           long long *heartbeat, td_error_t *err)
{
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    ncclUniqueId u;
    td_nccl *c;
    ncclResult_t r;
    int rc;

    *out = NULL;
    if (nranks < 1 || rank < 0 || rank >= nranks || !(timeout_s > 0.0))
        return td_error_set(err, TD_EINVAL, "NCCL: rank %d of %d, timeout %g s", rank, nranks,
                            timeout_s);
    c = calloc(1, sizeof(*c));
    if (c == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for an NCCL communicator");
    c->ctx = ctx;
    c->rank = rank;
    c->nranks = nranks;
    c->timeout_s = timeout_s;
    c->stop = stop;
    c->heartbeat = heartbeat;
    rc = new_event(&c->done, err);
    if (rc != 0) {
        free(c);
        return rc;
    }
    rc = new_event(&c->before, err);
    if (rc != 0) {
        (void)cudaEventDestroy(c->done);
        free(c);
        return rc;
    }
    config.blocking = 0;
    memcpy(u.internal, id->bytes, sizeof(u.internal));
    r = ncclCommInitRankConfig(&c->comm, nranks, u, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        rc = NCCL_ERR(r, NULL, "ncclCommInitRankConfig");
        if (c->comm != NULL)
            abort_comm(c);
        goto fail;
    }
    rc = wait_state(c, "communicator init", td_mono_ms() / 1e3 + c->timeout_s, err);
    if (rc != 0)
        goto fail;
    *out = c;
    return 0;

fail:
    (void)cudaEventDestroy(c->before);
    (void)cudaEventDestroy(c->done);
    free(c);
    return rc;
}

int td_nccl_aborted(const td_nccl *c)
{
    return c->aborted;
}

/* Polls ev until it has completed, at most until deadline, with NCCL's state checked on each
 * poll when check_nccl is set. what names the wait in the messages. */
static int wait_event(td_nccl *c, cudaEvent_t ev, int check_nccl, double deadline, const char *what,
                      td_error_t *err)
{
    for (;;) {
        ncclResult_t state = ncclSuccess, r = ncclSuccess;
        cudaError_t e = cudaEventQuery(ev);
        int rc;
        if (e == cudaErrorNotReady) {
            /* Not an error, but the runtime records it as the thread's last error all the
             * same: left there, the next kernel launch's check (cudaGetLastError) would read
             * it and fail the step with "cudaErrorNotReady". */
            (void)cudaGetLastError();
        } else if (e != cudaSuccess) {
            rc = td__cuda_error_set(err, e, __FILE__, __LINE__, what);
            abort_comm(c);
            return rc;
        }
        if (check_nccl)
            r = ncclCommGetAsyncError(c->comm, &state);
        if (e == cudaSuccess && r == ncclSuccess && state == ncclSuccess)
            return 0; /* done, and NCCL saw nothing wrong on the way */
        if (stopped(c, err))
            return TD_EABORTED;
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
            rc = NCCL_ERR(r != ncclSuccess ? r : state, c, what);
            abort_comm(c);
            return rc;
        }
        if (left(deadline) <= 0) {
            abort_comm(c);
            return td_error_set(err, TD_ECUDA, "%s did not complete within %g s (rank %d of %d)",
                                what, c->timeout_s, c->rank, c->nranks);
        }
        nap(c);
    }
}

/* The collective just enqueued (ncclInProgress, perhaps) and then everything up to it on the
 * stream, all within the one deadline. */
static int wait_collective(td_nccl *c, double deadline, td_error_t *err)
{
    cudaError_t e;
    int rc = wait_state(c, "all-reduce", deadline, err);

    if (rc != 0)
        return rc;
    e = cudaEventRecord(c->done, c->ctx->stream);
    if (e != cudaSuccess)
        return td__cuda_error_set(err, e, __FILE__, __LINE__, "cudaEventRecord");
    return wait_event(c, c->done, 1, deadline, "NCCL all-reduce", err);
}

int td_nccl_wait(td_nccl *c, td_error_t *err)
{
    if (c->aborted)
        return td_error_set(err, TD_ECUDA, "NCCL communicator of rank %d was aborted", c->rank);
    if (stopped(c, err))
        return TD_EABORTED;
    return wait_collective(c, td_mono_ms() / 1e3 + c->timeout_s, err);
}

/* The step's work queued before the all-reduce (the backward pass that made the gradients)
 * is waited for first, so that its compute time does not count against the collective. It
 * gets a timeout of its own: a kernel that never ends is a failure too. */
static int wait_before(td_nccl *c, td_error_t *err)
{
    cudaError_t e = cudaEventRecord(c->before, c->ctx->stream);

    if (e != cudaSuccess)
        return td__cuda_error_set(err, e, __FILE__, __LINE__, "cudaEventRecord");
    return wait_event(c, c->before, 0, td_mono_ms() / 1e3 + c->timeout_s,
                      "the step's work before the all-reduce", err);
}

void td_nccl_allreduce_avg(td_nccl *c, float *buf, size_t n)
{
    td_error_t e = {0}, *err = &e;
    ncclResult_t r;
    double deadline;

    if (c->aborted && c->stop != NULL && __atomic_load_n(c->stop, __ATOMIC_ACQUIRE))
        td_panic(TD_EABORTED, "stopped: another device of the job failed");
    if (c->aborted)
        td_panic(TD_ECUDA, "NCCL communicator of rank %d was aborted", c->rank);
    if (wait_before(c, err) != 0)
        td_panic(e.code, "%s", e.msg);
    /* One deadline for the whole collective, from the moment it is enqueued. */
    deadline = td_mono_ms() / 1e3 + c->timeout_s;
    r = ncclAllReduce(buf, buf, n, ncclFloat32, ncclAvg, c->comm, c->ctx->stream);
    if (r != ncclSuccess && r != ncclInProgress) {
        NCCL_ERR(r, c, "ncclAllReduce");
        abort_comm(c);
        td_panic(e.code, "%s", e.msg);
    }
    if (wait_collective(c, deadline, err) != 0)
        td_panic(e.code, "%s", e.msg);
}

/* Finalize flushes what the communicator still has queued; non-blocking, so it is waited for
 * like the init, and aborted when it does not finish in time. */
void td_nccl_free(td_nccl *c)
{
    td_error_t err = {0};

    if (c == NULL)
        return;
    if (!c->aborted) {
        ncclResult_t r = ncclCommFinalize(c->comm);
        if ((r == ncclSuccess || r == ncclInProgress) &&
            wait_state(c, "finalize", td_mono_ms() / 1e3 + c->timeout_s, &err) == 0)
            (void)ncclCommDestroy(c->comm);
        else
            abort_comm(c);
    }
    (void)cudaEventDestroy(c->before);
    (void)cudaEventDestroy(c->done);
    free(c);
}
