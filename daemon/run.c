/* A job running on its devices (see run.h), and the device worker threads. Everything here
 * runs on worker threads, except td_run_new/start/free, which the loop thread calls. The
 * replicas meet in a td_hostreduce (the step barriers; on cpu: devices the all-reduce too);
 * on cuda: devices the gradients are averaged by NCCL, one communicator per run with one
 * rank per worker. The run's mutex guards the outcomes. No lock is held across a call that
 * may panic, and the all-reduce panics only after dropping its lock, so a jump leaks
 * nothing.
 *
 * A replica that fails releases its peers at once: it breaks the host barriers
 * (td_hostreduce_abort) and raises the run's nccl_stop, which every rank's NCCL watchdog
 * polls, so a peer waiting in a collective aborts its communicator and stops with
 * TD_EABORTED instead of waiting for the timeout. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hostreduce.h"
#include "run.h"
#include "td_clock.h"
#include "td_log.h"
#include "td_panic.h"
#ifdef TD_HAVE_CUDA
#include "td_cuda.h"
#endif

enum { GO = 0, STOP_CANCEL = 1, STOP_INTERRUPT = 2 };

struct td_run {
    td_daemon *d;
    td_djob *job; /* the loop's; workers read only its spec and atomic flags */
    int world;
    td_worker *workers[TD_MAX_DEVICES];
    td_hostreduce hr;   /* the barriers and the all-reduce */
    pthread_mutex_t mu; /* guards the outcomes below */
    int decision;       /* what the last step barrier agreed: GO or STOP_*; under hr's lock */
    /* outcomes, by rank */
    td_error_t errs[TD_MAX_DEVICES];
    int failed[TD_MAX_DEVICES];
    int finished;
    int stopped; /* the decision that ended a run without failure */
    int succeeded;
    int64_t steps;
    td_error_t store_err; /* rank 0's metric write errors */
    td_error_t note;      /* e.g. a checkpoint that could not be written */
    int nccl_stop;        /* set (atomically) when a replica fails: the NCCL watchdogs abort */
#ifdef TD_HAVE_CUDA
    td_nccl_id nccl_id;  /* a data-parallel cuda run's communicator, made by td_run_new */
    td_error_t nccl_err; /* why no id could be made; rank 0 fails with it */
#endif
};

int td_run_new(td_run **out, td_daemon *d, td_djob *job, td_worker **workers, int n)
{
    td_run *r = calloc(1, sizeof(*r));

    if (r == NULL)
        return TD_ENOMEM;
    r->d = d;
    r->job = job;
    r->world = n;
    memcpy(r->workers, workers, (size_t)n * sizeof(*workers));
    pthread_mutex_init(&r->mu, NULL);
    td_hostreduce_init(&r->hr, n);
#ifdef TD_HAVE_CUDA
    /* One communicator per run: its id is made once, here, and every rank joins with it. */
    if (n > 1 && workers[0]->kind == TD_DEV_CUDA)
        td_nccl_unique_id(&r->nccl_id, &r->nccl_err);
#endif
    *out = r;
    return 0;
}

void td_run_start(td_run *r)
{
    for (int i = 0; i < r->world; i++) {
        td_worker *w = r->workers[i];
        pthread_mutex_lock(&w->mu);
        w->assigned = r;
        w->rank = i;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

void td_run_free(td_run *r)
{
    if (r == NULL)
        return;
    td_hostreduce_destroy(&r->hr);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

/* Called by the last replica at a step boundary: one decision for all. */
static void decide_stop(void *ud)
{
    td_run *r = ud;

    if (atomic_load(&r->job->cancel))
        r->decision = STOP_CANCEL;
    else if (atomic_load(&r->job->interrupt))
        r->decision = STOP_INTERRUPT;
    else
        r->decision = GO;
}

/* Records rank's failure and releases every replica waiting on the run. */
static void run_fail(td_run *r, int rank, const td_error_t *e)
{
    pthread_mutex_lock(&r->mu);
    r->errs[rank] = *e;
    r->failed[rank] = 1;
    pthread_mutex_unlock(&r->mu);
    __atomic_store_n(&r->nccl_stop, 1, __ATOMIC_RELEASE);
    td_hostreduce_abort(&r->hr);
}

typedef struct replica {
    td_run *r;
    td_worker *w;
    int rank;
    td_mq_sink *sink; /* rank 0 only */
#ifdef TD_HAVE_CUDA
    td_nccl *nccl; /* cuda, world > 1: this rank of the run's communicator */
#endif
} replica;

/* The all-reduce hook: the host average of hostreduce.c, under the step's panic boundary. */
static void hook_allreduce(void *ud, float *buf, size_t n)
{
    replica *p = ud;

    if (td_hostreduce_average(&p->r->hr, p->rank, buf, n) != 0)
        td_panic(TD_EABORTED, "stopped: another device of the job failed");
}

#ifdef TD_HAVE_CUDA
/* The all-reduce hook of cuda devices: buf is device memory; NCCL averages it in place. A
 * peer's failure surfaces here as TD_EABORTED (the watchdog saw nccl_stop). */
static void hook_nccl(void *ud, float *buf, size_t n)
{
    replica *p = ud;

    td_nccl_allreduce_avg(p->nccl, buf, n);
}
#endif

/* Metric samples: only rank 0 records (the trainer emits only there). A store error is kept
 * for the end, so the job cannot end "succeeded" with rows missing. */
static void hook_metric(void *ud, const char *key, int64_t step, double value)
{
    replica *p = ud;
    td_error_t e;

    if (p->sink != NULL && td_mq_push(p->sink, key, step, value, &e) != 0 &&
        p->r->store_err.code == 0)
        p->r->store_err = e;
}

/* Publishes the job's step; posts an event only when the loop has taken the last one, so
 * a fast job costs the loop one wake-up per turn, not one per step. */
static void post_progress(td_daemon *d, td_djob *job, int64_t step)
{
    atomic_store(&job->live_step, step);
    if (atomic_exchange(&job->progress_pending, 1) == 0)
        td_daemon_post(d, td_event_new(TD_EV_PROGRESS, job->id));
}

/* The configuration of this replica: its slice, its threads, its injected fault. */
static void replica_config(const replica *p, td_train_config *cfg)
{
    const td_jobspec *spec = &p->r->job->spec;

    *cfg = spec->train;
    cfg->rank = p->rank;
    cfg->world = p->r->world;
    cfg->threads = p->w->threads;
    if (spec->fail_kind != TD_FAIL_NONE && p->w->device < 64 &&
        (spec->fail_devices >> p->w->device) & 1) {
        cfg->debug_fail_kind = spec->fail_kind;
        cfg->debug_fail_step = spec->fail_step;
    }
    /* The job's precision, resolved: bf16 for a gpt on a GPU, fp32 otherwise. */
    if (cfg->precision == TD_PRECISION_DEFAULT)
        cfg->precision = cfg->model == TD_MODEL_GPT && p->w->kind == TD_DEV_CUDA
                             ? TD_PRECISION_BF16
                             : TD_PRECISION_FP32;
}

#ifdef TD_HAVE_CUDA
/* The context switches a job sets, under a panic boundary of their own (they panic on a
 * cuBLAS error). A function of its own so that no caller's local lives across the setjmp. */
static int set_precision(td_cuda_ctx *ctx, int bf16, int tf32, td_error_t *err)
{
    td_boundary b;

    if (TD_TRY(&b)) {
        td_cuda_ctx_set_bf16(ctx, bf16);
        td_cuda_ctx_set_tf32(ctx, tf32);
        td_boundary_leave(&b);
        return 0;
    }
    *err = b.err;
    return err->code;
}

/* Readies this replica's GPU for the job: the cuda table, the precision, mfu's peak, and for
 * a data-parallel job its rank of the run's communicator (the init is collective: every rank
 * joins at about the same time, before anything else can fail). TD_EABORTED when a peer
 * failed first. */
static int cuda_prepare(replica *p, td_train_config *cfg, td_train_hooks *hooks, td_error_t *e)
{
    td_run *r = p->r;
    td_worker *w = p->w;
    int bf16 = cfg->precision == TD_PRECISION_BF16, rc;
    double timeout =
        r->job->spec.nccl_timeout_s > 0 ? r->job->spec.nccl_timeout_s : r->d->cfg.nccl_timeout_s;
    td_error_t why;

    cfg->kernels = td_daemon_kernels(w);
    rc = set_precision(w->ctx, bf16, cfg->tf32, e);
    if (rc != 0)
        return rc;
    cfg->peak_flops = 0;
    if (td_cuda_peak_flops(w->device, bf16, cfg->tf32, &cfg->peak_flops, &why) != 0) {
        cfg->peak_flops = 0; /* unknown: the trainer records no mfu */
        if (p->rank == 0)
            td_log_debug("job %lld: %s: no mfu: %s", (long long)r->job->id, w->name, why.msg);
    }
    if (r->world == 1)
        return 0;
    if (r->nccl_err.code != 0) {
        if (p->rank != 0)
            return td_error_set(e, TD_EABORTED, "stopped: another device of the job failed");
        *e = r->nccl_err;
        return e->code;
    }
    rc = td_nccl_init_stoppable(&p->nccl, &r->nccl_id, r->world, p->rank, w->ctx, timeout,
                                &r->nccl_stop, e);
    if (rc != 0)
        return rc;
    hooks->allreduce = hook_nccl;
    return 0;
}

/* gpu_mem_used_mb: the most memory used (total - free) on any of the job's GPUs, in MiB.
 * Rank 0 records it after each step, as it does metrics_blocked_ms. -1 when CUDA cannot
 * tell (the step's own errors are reported by the step). */
static double gpu_mem_used_mb(const td_run *r)
{
    double most = -1;

    for (int i = 0; i < r->world; i++) {
        size_t f, t;
        td_error_t e;
        if (td_cuda_mem_info(r->workers[i]->device, &f, &t, &e) != 0)
            return -1;
        if ((double)(t - f) / (1024.0 * 1024.0) > most)
            most = (double)(t - f) / (1024.0 * 1024.0);
    }
    return most;
}
#endif

/* Writes a checkpoint on rank 0 before a cancelled or interrupted run stops. */
static void stop_checkpoint(replica *p, td_trainer *t)
{
    td_error_t e = {0};

    if (p->rank != 0 || p->r->job->spec.train.checkpoint_dir[0] == '\0')
        return;
    if (td_trainer_checkpoint(t, &e) != 0)
        td_error_set(&p->r->note, e.code, "the checkpoint could not be written: %s", e.msg);
}

/* Trains this replica until the run succeeds, stops or fails. */
static void replica_train(replica *p)
{
    td_run *r = p->r;
    td_worker *w = p->w;
    td_train_config cfg;
    td_train_hooks hooks = {.ud = p, .metric = hook_metric};
    td_trainer *t = NULL;
    td_error_t e = {0};
    double blocked = 0;
    int finished = 0;

    /* Loading a dataset is work too: the watchdog must not take it for a hang. */
    atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
    replica_config(p, &cfg);
    if (r->world > 1)
        hooks.allreduce = hook_allreduce;
#ifdef TD_HAVE_CUDA
    if (w->kind == TD_DEV_CUDA && cuda_prepare(p, &cfg, &hooks, &e) != 0) {
        if (e.code != TD_EABORTED)
            run_fail(r, p->rank, &e);
        return;
    }
#endif
    if (td_trainer_new(&t, &cfg, &hooks, &e) != 0) {
        run_fail(r, p->rank, &e);
        return;
    }
    atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
    if (p->rank == 0) {
        td_event *ev = td_event_new(TD_EV_STARTED, r->job->id);
        ev->total_steps = td_trainer_total_steps(t);
        ev->step = td_trainer_steps_done(t);
        td_daemon_post(r->d, ev);
    }
    while (!finished) {
        if (td_hostreduce_barrier(&r->hr, decide_stop, r) != 0)
            break;
        if (r->decision != GO) {
            stop_checkpoint(p, t);
            if (p->rank == 0)
                r->stopped = r->decision;
            break;
        }
        atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
        finished = td_trainer_step_caught(t, &e);
        atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
        if (finished < 0) {
            if (e.code != TD_EABORTED)
                run_fail(r, p->rank, &e);
            break;
        }
        if (p->rank != 0)
            continue;
        if (td_mq_sink_blocked_ms(p->sink) != blocked) {
            blocked = td_mq_sink_blocked_ms(p->sink);
            hook_metric(p, "metrics_blocked_ms", td_trainer_steps_done(t), blocked);
        }
#ifdef TD_HAVE_CUDA
        if (w->kind == TD_DEV_CUDA) {
            double used = gpu_mem_used_mb(r);
            if (used >= 0)
                hook_metric(p, "gpu_mem_used_mb", td_trainer_steps_done(t), used);
        }
#endif
        post_progress(r->d, r->job, td_trainer_steps_done(t));
    }
    if (p->rank == 0) {
        r->steps = td_trainer_steps_done(t);
        r->succeeded = finished == 1;
    }
    td_trainer_free(t);
}

/* The one-line form of a failure: dataset errors are their own kind (DESIGN.md). */
static void failure_line(char *out, size_t size, const td_worker *w, const td_error_t *e)
{
    if (e->code == TD_EDATA)
        snprintf(out, size, "dataset error during training step: %s", e->msg);
    else
        snprintf(out, size, "training worker on device %d failed: %s", w->device, e->msg);
}

/* Builds the job's error from every failed replica, in device order, and the msgpack list
 * {device, code, message} the store keeps for `status --json`. */
static void collect_failures(td_run *r, td_event *done)
{
    int nfail = 0, first = -1;
    size_t len = 0;
    char line[1200];
    td_pw w;

    for (int i = 0; i < r->world; i++)
        if (r->failed[i]) {
            nfail++;
            first = first < 0 ? i : first;
        }
    if (nfail == 1) {
        failure_line(line, sizeof(line), r->workers[first], &r->errs[first]);
        td_error_set(&done->err, r->errs[first].code, "%s", line);
    } else {
        len = (size_t)snprintf(done->err.msg, sizeof(done->err.msg),
                               "%d training workers failed:", nfail);
        done->err.code = TD_EWORKERS;
        for (int i = 0; i < r->world && len < sizeof(done->err.msg); i++)
            if (r->failed[i]) {
                failure_line(line, sizeof(line), r->workers[i], &r->errs[i]);
                len += (size_t)snprintf(done->err.msg + len, sizeof(done->err.msg) - len, "\n  %s",
                                        line);
            }
    }
    td_pw_init(&w);
    td_pw_array(&w, (uint32_t)nfail);
    for (int i = 0; i < r->world; i++)
        if (r->failed[i]) {
            td_pw_map(&w, 3);
            td_pw_str(&w, "device");
            td_pw_int(&w, r->workers[i]->device);
            td_pw_str(&w, "code");
            td_pw_int(&w, r->errs[i].code);
            td_pw_str(&w, "message");
            td_pw_str(&w, r->errs[i].msg);
        }
    const void *body = td_pw_body(&w, &len);
    if (body != NULL && (done->devices = malloc(len)) != NULL) {
        memcpy(done->devices, body, len);
        done->devices_len = len;
    }
    td_pw_free(&w);
}

/* Whether rank's failure leaves the process's CUDA state lost (DESIGN.md, "Failures"): a
 * CUDA error once the process is poisoned, or the sticky fault debug.fail injected there. */
static int failed_sticky(const td_run *r, int rank)
{
    const td_jobspec *spec = &r->job->spec;
    int dev = r->workers[rank]->device;

    if (r->errs[rank].code != TD_ECUDA)
        return 0;
    if (spec->fail_kind == TD_FAIL_STICKY && dev < 64 && (spec->fail_devices >> dev) & 1)
        return 1;
#ifdef TD_HAVE_CUDA
    if (td_cuda_poisoned())
        return 1;
#endif
    return 0;
}

/* The run's single DONE event, built by the last replica to finish. */
static td_event *run_outcome(td_run *r)
{
    td_event *done = td_event_new(TD_EV_DONE, r->job->id);
    int any_failed = 0;

    done->step = r->steps;
    for (int i = 0; i < r->world; i++) {
        any_failed |= r->failed[i];
        done->sticky |= r->failed[i] && failed_sticky(r, i);
    }
    if (any_failed) {
        snprintf(done->state, sizeof(done->state), TD_JOB_FAILED);
        collect_failures(r, done);
    } else if (r->stopped == STOP_CANCEL) {
        snprintf(done->state, sizeof(done->state), TD_JOB_CANCELLED);
        td_error_set(&done->err, TD_ECANCELLED, "cancelled at step %lld%s%s", (long long)r->steps,
                     r->note.code ? "; " : "", r->note.msg);
    } else if (r->stopped == STOP_INTERRUPT) {
        snprintf(done->state, sizeof(done->state), TD_JOB_QUEUED);
    } else if (r->store_err.code != 0) {
        snprintf(done->state, sizeof(done->state), TD_JOB_FAILED);
        td_error_set(&done->err, r->store_err.code, "metrics could not be stored: %s",
                     r->store_err.msg);
    } else {
        snprintf(done->state, sizeof(done->state), r->succeeded ? TD_JOB_SUCCEEDED : TD_JOB_FAILED);
        if (!r->succeeded)
            td_error_set(&done->err, TD_EPANIC, "the job stopped without an error");
    }
    return done;
}

/* Runs this worker's replica of r, then counts it finished; the last one posts DONE. */
static void replica_run(td_worker *w, td_run *r, int rank)
{
    replica p = {.r = r, .w = w, .rank = rank};
    td_error_t e;
    int last;

    if (rank == 0 && td_mq_sink_open(r->d->mq, r->job->id, &p.sink) != 0) {
        td_error_set(&e, TD_ENOMEM, "out of memory opening the metric sink");
        run_fail(r, rank, &e);
    } else {
        replica_train(&p);
    }
#ifdef TD_HAVE_CUDA
    /* ncclCommFinalize completes only once every rank finalizes: meet first, so that a rank
     * done early does not wait out the timeout while rank 0 evaluates and writes the last
     * checkpoint (after a failure the barrier is aborted and returns at once). */
    if (p.nccl != NULL)
        (void)td_hostreduce_barrier(&r->hr, NULL, NULL);
    td_nccl_free(p.nccl);
#endif
    if (p.sink != NULL) {
        /* The job ends only once every row it produced is durable. */
        if (td_mq_flush(p.sink, &e) != 0 && r->store_err.code == 0)
            r->store_err = e;
        td_mq_sink_close(p.sink);
    }
    pthread_mutex_lock(&r->mu);
    last = ++r->finished == r->world;
    pthread_mutex_unlock(&r->mu);
    if (last)
        td_daemon_post(r->d, run_outcome(r));
}

/* A cuda worker's context, made on its GPU by the worker's own thread and bound to it for
 * the thread's life; the thread that starts the workers waits for the answer (init_done). */
static int worker_init(td_worker *w)
{
    td_error_t e = {0};

#ifdef TD_HAVE_CUDA
    if (w->kind == TD_DEV_CUDA)
        td_cuda_ctx_new(&w->ctx, w->device, NULL, &e);
#endif
    pthread_mutex_lock(&w->mu);
    w->init_err = e;
    w->init_done = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return e.code;
}

static void worker_fini(td_worker *w)
{
#ifdef TD_HAVE_CUDA
    td_cuda_ctx_free(w->ctx);
#endif
    w->ctx = NULL;
}

void *td_worker_main(void *arg)
{
    td_worker *w = arg;

    if (worker_init(w) != 0)
        return NULL;
    for (;;) {
        td_run *r;
        int rank;
        pthread_mutex_lock(&w->mu);
        while (w->assigned == NULL && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        r = w->assigned;
        rank = w->rank;
        w->assigned = NULL;
        pthread_mutex_unlock(&w->mu);
        if (r == NULL)
            break;
        replica_run(w, r, rank);
    }
    worker_fini(w);
    return NULL;
}
