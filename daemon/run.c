/* Device workers and runs (run.h). Everything here runs on worker threads, except
 * td_workers_start/stop/fresh and td_run_new/start/cancel/interrupt/progress/free, which the
 * loop thread calls. The replicas meet in the run's all-reduce group (train/device.h): its
 * barriers carry the step decisions, its all-reduce averages the gradients (the host reduce
 * on cpu devices, NCCL on cuda devices). The run's mutex guards the outcomes. No lock is held
 * across a call that may panic, and the all-reduce panics only after dropping its lock, so a
 * jump leaks nothing.
 *
 * A replica that fails releases its peers at once: it aborts the group, which breaks the
 * barriers and stops every rank's NCCL watchdog, so a peer waiting in a collective stops with
 * TD_EABORTED instead of waiting for the timeout. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "train/data.h"
#include "daemon/run.h"
#include "common/td_clock.h"
#include "common/td_log.h"
#include "common/td_panic.h"

/* debug.fail names devices in a 64-bit mask (jobspec.h's fail_devices). */
_Static_assert(TD_MAX_DEVICES <= 64, "a job's debug.fail mask must cover every device");

enum { GO = 0, STOP_CANCEL = 1, STOP_INTERRUPT = 2 };

/* A step's vote, a set of bits so that the processes of a spanning run combine theirs by OR:
 * cancel wins over interrupt, as within one process. */
enum { VOTE_CANCEL = 1, VOTE_INTERRUPT = 2 };

/* seconds process 0 waits for the others' outcomes at the end of a spanning run; a process
 * that never comes (killed) is then reported by its failure notice, or as missing */
#define TD_RUN_OUTCOME_WAIT_S 10.0

/* ms a cancelled job's data load may go on before it is abandoned (see load_stop) */
#define TD_RUN_CANCEL_LOAD_MS 10000

struct td_run {
    td_run_args a; /* a.workers points at workers below */
    td_worker *workers[TD_MAX_DEVICES];
    td_group *group;
    atomic_int cancel;           /* set by the loop: stop at the next step boundary */
    atomic_int interrupt;        /* set by the loop at shutdown: stop and go back to the queue */
    atomic_llong live_step;      /* set by rank 0's worker after each step */
    atomic_llong at_step;        /* set by local rank 0 before each step barrier */
    atomic_int progress_pending; /* a PROGRESS event is posted and not yet taken */
    pthread_mutex_t mu;          /* guards the outcomes below */
    /* outcomes, by rank */
    td_error_t errs[TD_MAX_DEVICES];
    int failed[TD_MAX_DEVICES];
    int finished;
    int stopped;         /* the decision that ended a run without failure */
    int stopped_loading; /* ...taken while a replica was still loading its data */
    int succeeded;
    int64_t steps;
    td_error_t store_err; /* rank 0's metric write errors */
    td_error_t note;      /* e.g. a checkpoint that could not be written */
    /* The events that must not be lost, reserved by td_run_new (mailbox.h): each is posted at
     * most once, by one thread, which clears the pointer; td_run_free frees those never
     * posted. */
    td_event *ev_started;      /* rank 0's worker, once its data is loaded */
    td_event *ev_done;         /* the last replica to finish (run_outcome) */
    td_event *ev_store_failed; /* the store thread (td_run_on_store_failed) */
    /* a spanning run's failures over every process, gathered on process 0 (run_gather) */
    td_run_failed *all_failed;
    int n_all_failed;
};

/* ---- workers (loop thread) ---- */

static void *worker_main(void *arg);

/* Pins worker w to its own share of the cores, [index*per, (index+1)*per), when the devices
 * divide the cores. The BLAS calls a worker makes with one thread run on the worker's own
 * thread, so they stay on its cores; a share of several cores is used by OpenBLAS's own pool,
 * which the worker cannot pin. Best effort: a refusal (a cpuset, a container) is logged and
 * training goes on unpinned. */
static void pin_worker(const td_worker *w, int per, long cores)
{
    cpu_set_t set;
    int rc;

    if ((long)(w->index + 1) * per > cores)
        return;
    CPU_ZERO(&set);
    for (int c = w->index * per; c < (w->index + 1) * per; c++)
        CPU_SET(c, &set);
    rc = pthread_setaffinity_np(w->thread, sizeof(set), &set);
    if (rc != 0)
        td_log_info("%s: not pinned to cores %d-%d: %s", w->name, w->index * per,
                    (w->index + 1) * per - 1, strerror(rc));
}

/* Waits until worker w's thread has opened its device, or failed to. */
static int worker_wait_init(td_worker *w, td_error_t *err)
{
    int rc;

    pthread_mutex_lock(&w->mu);
    while (!w->init_done)
        pthread_cond_wait(&w->cv, &w->mu);
    rc = w->init_err.code;
    if (rc != 0)
        td_error_set(err, rc, "cannot initialise %s: %s", w->name, w->init_err.msg);
    pthread_mutex_unlock(&w->mu);
    return rc;
}

int td_workers_start(td_worker *ws, int n, td_error_t *err)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = n > 0 && ws[0].kind == TD_DEVICE_CPU ? (int)(cores > 0 ? cores : 1) / n : 0;

    for (int i = 0; i < n; i++) {
        td_worker *w = &ws[i];
        int rc;
        w->threads = per > 0 ? per : 1;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        rc = pthread_create(&w->thread, NULL, worker_main, w);
        if (rc != 0) {
            pthread_cond_destroy(&w->cv);
            pthread_mutex_destroy(&w->mu);
            td_workers_stop(ws, i);
            return td_error_set(err, -rc, "cannot start worker %s: %s", w->name, strerror(rc));
        }
        rc = worker_wait_init(w, err);
        if (rc != 0) {
            td_workers_stop(ws, i + 1);
            return rc;
        }
        if (per > 0)
            pin_worker(w, per, cores);
    }
    return 0;
}

void td_workers_stop(td_worker *ws, int n)
{
    for (int i = 0; i < n; i++) {
        td_worker *w = &ws[i];
        pthread_mutex_lock(&w->mu);
        w->stop = 1;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
    }
}

int td_workers_fresh(const td_worker *ws, int n, int64_t stale_ms, char *why, size_t size)
{
    long long now = (long long)td_mono_ms();

    for (int i = 0; i < n; i++) {
        const td_worker *w = &ws[i];
        long long age;
        if (w->running == 0)
            continue;
        age = now - atomic_load(&w->heartbeat_ms);
        if (age > stale_ms) {
            snprintf(why, size, "device %s (job %lld) has not started or ended a step for %lld ms",
                     w->name, (long long)w->running, age);
            return 0;
        }
    }
    return 1;
}

/* ---- runs (loop thread) ---- */

/* Reserves the run's once-only events. 0 or TD_ENOMEM; what was reserved, td_run_free frees. */
static int reserve_events(td_run *r, int64_t job)
{
    r->ev_started = td_event_new(TD_EV_STARTED, job);
    r->ev_done = td_event_new(TD_EV_DONE, job);
    r->ev_store_failed = td_event_new(TD_EV_STORE_FAILED, job);
    return r->ev_started && r->ev_done && r->ev_store_failed ? 0 : TD_ENOMEM;
}

int td_run_new(td_run **out, const td_run_args *a, td_error_t *err)
{
    td_run *r = calloc(1, sizeof(*r));
    int rc;

    *out = NULL;
    if (r == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "out of memory starting job %lld", (long long)a->job);
        goto out;
    }
    r->a = *a;
    memcpy(r->workers, a->workers, (size_t)a->world * sizeof(*a->workers));
    r->a.workers = r->workers;
    pthread_mutex_init(&r->mu, NULL);
    if (reserve_events(r, a->job) != 0)
        rc = td_error_set(err, TD_ENOMEM, "out of memory starting job %lld", (long long)a->job);
    else if (a->spanning)
        rc =
            td_group_new_spanning(&r->group, a->workers[0]->kind, a->world, a->nccl_timeout_s, err);
    else
        rc = td_group_new(&r->group, a->workers[0]->kind, a->world, a->nccl_timeout_s, err);
    if (rc != 0)
        td_run_free(r);
    else
        *out = r;
out:
    return rc;
}

void td_run_start(td_run *r)
{
    for (int i = 0; i < r->a.world; i++) {
        td_worker *w = r->workers[i];
        pthread_mutex_lock(&w->mu);
        w->assigned = r;
        w->rank = i;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
    }
}

void td_run_cancel(td_run *r)
{
    atomic_store(&r->cancel, 1);
}

void td_run_interrupt(td_run *r)
{
    atomic_store(&r->interrupt, 1);
}

int64_t td_run_progress(td_run *r)
{
    atomic_store(&r->progress_pending, 0);
    return atomic_load(&r->live_step);
}

const td_error_t *td_run_failure(const td_run *r, int rank)
{
    return r->failed[rank] ? &r->errs[rank] : NULL;
}

const td_worker *td_run_worker(const td_run *r, int rank)
{
    return r->workers[rank];
}

int td_run_world(const td_run *r)
{
    return r->a.world;
}

const td_run_failed *td_run_failures(const td_run *r, int *n)
{
    *n = r->n_all_failed;
    return r->all_failed;
}

void td_run_free(td_run *r)
{
    if (r == NULL)
        return;
    td_event_free(r->ev_started);
    td_event_free(r->ev_done);
    td_event_free(r->ev_store_failed);
    td_group_free(r->group);
    pthread_mutex_destroy(&r->mu);
    free(r->all_failed);
    free(r);
}

void td_run_on_store_failed(void *ud, void *run, int64_t job, const td_error_t *err)
{
    td_run *r = run;
    td_event *ev = r->ev_store_failed;

    (void)ud;
    /* The queue names a sink once, and a run opens one: the reserve is there. */
    r->ev_store_failed = NULL;
    if (ev == NULL)
        ev = td_event_new(TD_EV_STORE_FAILED, job);
    if (ev != NULL)
        ev->err = *err;
    td_mailbox_post(r->a.mailbox, ev);
}

/* ---- replicas (worker threads) ---- */

/* Called by one replica of each process at a step boundary: the process's vote. */
static int decide_stop(void *ud)
{
    td_run *r = ud;

    /* debug.hold: wait here, at the step barrier, for a cancel or an interrupt */
    if (r->a.spec->hold_step >= 0 && atomic_load(&r->at_step) == r->a.spec->hold_step)
        while (!atomic_load(&r->cancel) && !atomic_load(&r->interrupt)) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            for (int i = 0; i < r->a.world; i++)
                atomic_store(&r->workers[i]->heartbeat_ms, (long long)td_mono_ms());
            nanosleep(&ts, NULL);
        }

    return (atomic_load(&r->cancel) ? VOTE_CANCEL : 0) |
           (atomic_load(&r->interrupt) ? VOTE_INTERRUPT : 0);
}

/* The votes of every process, combined, as one decision for all. */
static int decision_of(int votes)
{
    return votes & VOTE_CANCEL ? STOP_CANCEL : votes & VOTE_INTERRUPT ? STOP_INTERRUPT : GO;
}

/* Records rank's failure and releases every replica waiting on the run, of every process. */
static void run_fail(td_run *r, int rank, const td_error_t *e)
{
    pthread_mutex_lock(&r->mu);
    r->errs[rank] = *e;
    r->failed[rank] = 1;
    pthread_mutex_unlock(&r->mu);
    td_group_fail(r->group, rank, e);
}

typedef struct replica {
    td_run *r;
    td_worker *w;
    int rank;                /* in this process */
    int global;              /* in the run: td_group_base + rank */
    td_mq_sink *sink;        /* rank 0 only */
    int joined;              /* a member of the run's group */
    long long load_start_ms; /* CLOCK_MONOTONIC ms when it began to load the job's data */
    double allreduce_ms;     /* this step's time in the all-reduce, waits for peers included */
} replica;

/* The all-reduce hook, under the step's panic boundary. */
static void hook_allreduce(void *ud, float *buf, size_t n)
{
    replica *p = ud;
    double t0 = td_mono_ms();

    td_group_allreduce(p->r->group, p->rank, buf, n);
    p->allreduce_ms += td_mono_ms() - t0;
}

/* Metric samples: only rank 0 records (the trainer emits only there). A store error is kept
 * for the end, so the job cannot end "succeeded" with rows missing. */
static void hook_metric(void *ud, const char *key, int64_t step, double value)
{
    replica *p = ud;
    td_error_t e;

    if (p->sink != NULL && td_mq_push(p->sink, key, step, value, &e) != 0 &&
        p->r->store_err.code == 0)
        p->r->store_err = e;
    else if (p->sink == NULL && p->global == 0 && p->r->a.metric != NULL &&
             p->r->a.metric(p->r->a.metric_ud, key, step, value, &e) != 0 &&
             p->r->store_err.code == 0)
        p->r->store_err = e;
}

/* Before a checkpoint: the rows given so far are made durable (the metric queue) or written out
 * (a.flush), so that the checkpoint is never ahead of the job's metrics. A store error is kept
 * as hook_metric keeps it. */
static void hook_flush(void *ud)
{
    replica *p = ud;
    td_error_t e;

    if (p->sink != NULL && td_mq_flush(p->sink, &e) != 0 && p->r->store_err.code == 0)
        p->r->store_err = e;
    else if (p->sink == NULL && p->global == 0 && p->r->a.flush != NULL)
        p->r->a.flush(p->r->a.metric_ud);
}

/* Publishes the job's step; posts an event only when the loop has taken the last one. */
static void post_progress(td_run *r, int64_t step)
{
    atomic_store(&r->live_step, step);
    if (atomic_exchange(&r->progress_pending, 1) == 0) {
        td_event *ev = td_event_new(TD_EV_PROGRESS, r->a.job);
        /* Dropped (counted by the mailbox): the next step tries again. */
        if (ev == NULL)
            atomic_store(&r->progress_pending, 0);
        td_mailbox_post(r->a.mailbox, ev);
    }
}

/* Whether debug.fail names device of this process's node (the process's rank in its world:
 * 0 for the daemon's own runs). */
static int fails_here(const td_jobspec *spec, int device)
{
    int node = td_world_rank();

    return spec->fail_kind != TD_FAIL_NONE && device >= 0 && device < TD_MAX_DEVICES &&
           (spec->fail_devices >> device) & 1 && node < 64 && (spec->fail_nodes >> node) & 1;
}

/* The configuration of this replica: its slice, its threads, its injected fault. */
static void replica_config(const replica *p, td_train_config *cfg)
{
    const td_jobspec *spec = p->r->a.spec;

    *cfg = spec->train;
    cfg->rank = p->global;
    cfg->world = td_group_world(p->r->group);
    cfg->threads = p->w->threads;
    cfg->kernels = td_device_kernels(p->w->kind);
    if (fails_here(spec, p->w->device)) {
        cfg->debug_fail_kind = spec->fail_kind;
        cfg->debug_fail_step = spec->fail_step;
    }
    /* The job's precision, resolved: bf16 for a gpt on a GPU, fp32 otherwise. */
    if (cfg->precision == TD_PRECISION_DEFAULT)
        cfg->precision = cfg->model == TD_MODEL_GPT && p->w->kind == TD_DEVICE_CUDA
                             ? TD_PRECISION_BF16
                             : TD_PRECISION_FP32;
}

/* Readies this replica's device for the job (precision, mfu's peak) and joins the run's
 * group (for a data-parallel job on GPUs, its rank of the communicator: collective, so every
 * rank joins at about the same time, before anything else can fail). TD_EABORTED when a peer
 * failed first. */
static int replica_prepare(replica *p, td_train_config *cfg, td_train_hooks *hooks, td_error_t *e)
{
    int rc = td_device_prepare(p->w->dev, cfg->precision == TD_PRECISION_BF16, cfg->tf32,
                               &cfg->peak_flops, e);

    if (rc != 0)
        return rc;
    if (td_group_world(p->r->group) == 1)
        return 0;
    /* A rank waiting on its peers is alive: NCCL's polls keep the heartbeat fresh (the
     * worker's atomic long long, stored to with the same atomic builtins). */
    rc = td_group_join(p->r->group, p->rank, p->w->dev, (long long *)&p->w->heartbeat_ms, e);
    if (rc != 0)
        return rc;
    p->joined = 1;
    hooks->allreduce = hook_allreduce;
    return 0;
}

/* gpu_mem_used_mb: the most memory used (total - free) on any of the job's GPUs, in MiB.
 * Rank 0 records it after each step, as it does metrics_blocked_ms. -1 when the device
 * cannot tell (the step's own errors are reported by the step). */
static double gpu_mem_used_mb(const td_run *r)
{
    double most = -1;

    for (int i = 0; i < r->a.world; i++) {
        size_t f, t;
        td_error_t e;
        if (td_device_memory(r->workers[i]->kind, r->workers[i]->device, &f, &t, &e) != 0)
            return -1;
        if ((double)(t - f) / (1024.0 * 1024.0) > most)
            most = (double)(t - f) / (1024.0 * 1024.0);
    }
    return most;
}

/* Writes a checkpoint on rank 0 before a cancelled or interrupted run stops. */
static void stop_checkpoint(replica *p, td_trainer *t)
{
    td_error_t e = {0};

    if (p->global != 0 || p->r->a.spec->train.checkpoint_dir[0] == '\0')
        return;
    if (td_trainer_checkpoint(t, &e) != 0)
        td_error_set(&p->r->note, e.code, "the checkpoint could not be written: %s", e.msg);
}

/* ms between a full disk's checkpoint attempts, doubling; the wait is sliced into polls */
#define CKPT_RETRY_MIN_MS 100.0
#define CKPT_RETRY_MAX_MS 2000.0
#define CKPT_POLL_MS      50

/* A due checkpoint that met a full disk, on global rank 0 (the step itself completed): waits
 * for room as the metric store does, for up to a.disk_full_wait_s, writing it again with
 * backoff, the heartbeat kept (a wait for room is not a hang) and a cancel or a shutdown ending
 * the wait. 0 once written; 1 when the run was asked to stop meanwhile (the step barrier takes
 * the decision, and the stop's checkpoint tries once more); -1 when the disk stayed full, e
 * then saying which checkpoint could not be written and that every step before it trained. */
static int checkpoint_wait(replica *p, td_trainer *t, td_error_t *e)
{
    td_run *r = p->r;
    int64_t step = td_trainer_checkpoint_failed(t), total = td_trainer_total_steps(t);
    double wait_ms = r->a.disk_full_wait_s * 1e3, t0 = td_mono_ms(), backoff = CKPT_RETRY_MIN_MS;
    double next = t0 + backoff;
    td_error_t why = *e;
    struct timespec ts = {0, CKPT_POLL_MS * 1000000L};

    td_log_warn("job %lld: checkpoint at step %lld: the disk is full; waiting up to %g s for "
                "room (%s)",
                (long long)r->a.job, (long long)step, r->a.disk_full_wait_s, why.msg);
    while (td_mono_ms() - t0 < wait_ms) {
        atomic_store(&p->w->heartbeat_ms, (long long)td_mono_ms());
        if (atomic_load(&r->cancel) || atomic_load(&r->interrupt))
            return 1;
        if (td_mono_ms() < next) {
            nanosleep(&ts, NULL);
            continue;
        }
        if (td_trainer_checkpoint(t, &why) == 0) {
            td_log_notice("job %lld: checkpoint at step %lld written after %.1f s (there is room)",
                          (long long)r->a.job, (long long)step, (td_mono_ms() - t0) / 1e3);
            return 0;
        }
        if (why.code != TD_EDISKFULL)
            break;
        backoff = backoff * 2 < CKPT_RETRY_MAX_MS ? backoff * 2 : CKPT_RETRY_MAX_MS;
        next = td_mono_ms() + backoff;
    }
    if (step == total)
        td_error_set(e, why.code,
                     "all %lld steps trained, but the final checkpoint (step %lld) could not be "
                     "written in %g s of waiting for room: %s",
                     (long long)total, (long long)step, r->a.disk_full_wait_s, why.msg);
    else
        td_error_set(e, why.code,
                     "%lld of %lld steps trained, but the checkpoint at step %lld could not be "
                     "written in %g s of waiting for room: %s",
                     (long long)step, (long long)total, (long long)step, r->a.disk_full_wait_s,
                     why.msg);
    return -1;
}

/* Rank 0's records after a step: the time the metric queue blocked it, GPU memory. */
static void record_step(replica *p, td_trainer *t, double *blocked)
{
    int64_t step = td_trainer_steps_done(t);

    if (p->sink != NULL && td_mq_sink_blocked_ms(p->sink) != *blocked) {
        *blocked = td_mq_sink_blocked_ms(p->sink);
        hook_metric(p, "metrics_blocked_ms", step, *blocked);
    }
    if (td_group_world(p->r->group) > 1) {
        hook_metric(p, "allreduce_ms", step, p->allreduce_ms);
        p->allreduce_ms = 0;
    }
    if (p->w->kind == TD_DEVICE_CUDA) {
        double used = gpu_mem_used_mb(p->r);
        if (used >= 0)
            hook_metric(p, "gpu_mem_used_mb", step, used);
    }
    post_progress(p->r, step);
}

/* Polled between chunks while a replica loads its data (data.h's stop callback): refreshes
 * the heartbeat, since a long load is work and not a hang, and says whether the run was asked
 * to stop, so that a shutdown or a cancel does not wait for gigabytes to be read. A shutdown
 * stops the load at once (the job goes back to the queue and loses nothing: no step was
 * taken). A cancel lets a load finish that has taken less than TD_RUN_CANCEL_LOAD_MS, so that
 * the job ends as a cancelled job does, at a step boundary with a checkpoint of where it is;
 * a longer load is abandoned, without one. */
static int load_stop(void *ud)
{
    replica *p = ud;
    long long now = (long long)td_mono_ms();

    atomic_store(&p->w->heartbeat_ms, now);
    if (atomic_load(&p->r->interrupt))
        return 1;
    return atomic_load(&p->r->cancel) && now - p->load_start_ms >= TD_RUN_CANCEL_LOAD_MS;
}

/* Builds this replica's trainer, which reads the job's files: each is opened with the rights
 * of the job's user (data.h, td_data_access), at every start, so a resume after a restart as
 * well; a path swapped for a symlink to a file the user may not read fails here. The daemon
 * names the user in the spec; a spec without one is refused rather than read as root. */
static int replica_load(replica *p, const td_train_config *cfg, const td_train_hooks *hooks,
                        td_trainer **t, td_error_t *e)
{
    const td_jobspec *spec = p->r->a.spec;
    td_data_access as_user = {.uid = spec->uid, .gid = spec->gid, .stop = load_stop, .ud = p};
    int rc;

    if (spec->uid < 0)
        return td_error_set(e, TD_EPERM, "job %lld has no known user: its files are not opened",
                            (long long)p->r->a.job);
    rc = td_data_access_begin(&as_user, e);
    if (rc != 0)
        return rc;
    p->load_start_ms = (long long)td_mono_ms();
    rc = td_trainer_new(t, cfg, hooks, e);
    td_data_access_end();
    return rc;
}

/* A replica stopped loading for a cancel or a shutdown: the run stops as it would at a step
 * boundary (with nothing to checkpoint, no step having been taken), and the peers waiting for
 * it at the first barrier are released. */
static void run_stop_loading(td_run *r)
{
    pthread_mutex_lock(&r->mu);
    r->stopped = atomic_load(&r->cancel) ? STOP_CANCEL : STOP_INTERRUPT;
    r->stopped_loading = 1;
    pthread_mutex_unlock(&r->mu);
    td_group_abort(r->group);
}

/* Trains this replica until the run succeeds, stops or fails. */
static void replica_train(replica *p)
{
    td_run *r = p->r;
    td_worker *w = p->w;
    td_train_config cfg;
    td_train_hooks hooks = {.ud = p, .metric = hook_metric, .flush = hook_flush};
    td_trainer *t = NULL;
    td_error_t e = {0};
    double blocked = 0;
    int finished = 0, votes = 0, rc;

    /* Loading a dataset is work too: the watchdog must not take it for a hang. */
    atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
    replica_config(p, &cfg);
    if (replica_prepare(p, &cfg, &hooks, &e) != 0 || replica_load(p, &cfg, &hooks, &t, &e) != 0) {
        if (e.code == TD_ECANCELLED && (atomic_load(&r->cancel) || atomic_load(&r->interrupt)))
            run_stop_loading(r);
        else if (e.code != TD_EABORTED)
            run_fail(r, p->rank, &e);
        return;
    }
    atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
    if (p->rank == 0) {
        td_event *ev = r->ev_started;
        r->ev_started = NULL;
        ev->total_steps = td_trainer_total_steps(t);
        ev->step = td_trainer_steps_done(t);
        td_mailbox_post(r->a.mailbox, ev);
    }
    while (!finished) {
        if (p->rank == 0)
            atomic_store(&r->at_step, td_trainer_steps_done(t));
        rc = td_group_barrier(r->group, p->rank, decide_stop, r, &votes, &e);
        if (rc == -2)
            run_fail(r, p->rank, &e);
        if (rc != 0)
            break;
        if (decision_of(votes) != GO) {
            stop_checkpoint(p, t);
            if (p->rank == 0)
                r->stopped = decision_of(votes);
            break;
        }
        atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
        finished = td_trainer_step_caught(t, &e);
        atomic_store(&w->heartbeat_ms, (long long)td_mono_ms());
        if (finished < 0 && e.code == TD_EDISKFULL && td_trainer_checkpoint_failed(t) > 0) {
            int waited = checkpoint_wait(p, t, &e);
            if (waited >= 0)
                finished = waited == 0 && td_trainer_steps_done(t) == td_trainer_total_steps(t);
        }
        if (finished < 0) {
            if (e.code != TD_EABORTED)
                run_fail(r, p->rank, &e);
            break;
        }
        if (p->global == 0)
            record_step(p, t, &blocked);
        else if (p->rank == 0)
            post_progress(r, td_trainer_steps_done(t));
    }
    if (p->rank == 0) {
        r->steps = td_trainer_steps_done(t);
        r->succeeded = finished == 1;
    }
    td_trainer_free(t);
}

/* The one-line form of a failure: dataset errors are their own kind (DESIGN.md); in a job of
 * several devices each line names its device, as every other kind's does, and in a run over
 * processes (nodes set) its node too. */
static void failure_line(char *out, size_t size, const td_run_failed *f, int world, int nodes)
{
    char where[96] = ""; /* a node's name is at most 63 bytes */

    if (nodes)
        snprintf(where, sizeof(where), " of node %s", td_world_node_name(f->node));
    if (f->err.code == TD_EDATA && (world > 1 || nodes))
        snprintf(out, size, "dataset error on device %d%s during training step: %s", f->device,
                 where, f->err.msg);
    else if (f->err.code == TD_EDATA)
        snprintf(out, size, "dataset error during training step: %s", f->err.msg);
    else
        snprintf(out, size, "training worker on device %d%s failed: %s", f->device, where,
                 f->err.msg);
}

/* The job's error from its n failed devices f, in (node, device) order. */
static void failure_message(const td_run_failed *f, int n, int world, int nodes, td_error_t *out)
{
    char line[1200];
    size_t len;

    if (n == 1) {
        failure_line(line, sizeof(line), &f[0], world, nodes);
        td_error_set(out, f[0].err.code, "%s", line);
        return;
    }
    len = (size_t)snprintf(out->msg, sizeof(out->msg), "%d training workers failed:", n);
    out->code = TD_EWORKERS;
    for (int i = 0; i < n && len < sizeof(out->msg); i++) {
        failure_line(line, sizeof(line), &f[i], world, nodes);
        len += (size_t)snprintf(out->msg + len, sizeof(out->msg) - len, "\n  %s", line);
    }
}

/* The job's error from every failed replica of this process, in device order. */
static void local_failure_message(const td_run *r, td_error_t *out)
{
    td_run_failed f[TD_MAX_DEVICES];
    int n = 0;

    for (int i = 0; i < r->a.world; i++)
        if (r->failed[i])
            f[n++] = (td_run_failed){.device = r->workers[i]->device, .err = r->errs[i]};
    failure_message(f, n, r->a.world, 0, out);
}

/* Whether rank's failure leaves the process's CUDA state lost (DESIGN.md, "Failures"): a
 * CUDA error once the process is poisoned, or the sticky fault debug.fail injected there. */
static int failed_sticky(const td_run *r, int rank)
{
    const td_jobspec *spec = r->a.spec;

    if (r->errs[rank].code != TD_ECUDA)
        return 0;
    if (spec->fail_kind == TD_FAIL_STICKY && fails_here(spec, r->workers[rank]->device))
        return 1;
    return td_device_poisoned();
}

/* What each process of a spanning run tells process 0 when its replicas have finished: its
 * head, then one proc_dev per local device. */
typedef struct proc_head {
    int32_t local; /* its devices; 0: it never reported (a part left zeroed) */
    int32_t stopped, stopped_loading, succeeded;
    int64_t steps;
} proc_head;

typedef struct proc_dev {
    int32_t failed, device;
    td_error_t err;
} proc_dev;

/* Adds a failure to the run's list over processes. */
static void add_failed(td_run *r, int node, int device, const td_error_t *e)
{
    td_run_failed *f = realloc(r->all_failed, (size_t)(r->n_all_failed + 1) * sizeof(*f));

    if (f == NULL)
        return;
    r->all_failed = f;
    f[r->n_all_failed++] = (td_run_failed){.node = node, .device = device, .err = *e};
}

/* Process 0's merge of the gathered outcomes into r: the failures in (node, device) order, a
 * process that never reported named by the notice it sent or as gone, and the stop decision
 * any process took (cancel before interrupt). */
static void merge_outcomes(td_run *r, const unsigned char *all, size_t len, int procs)
{
    int local = r->a.world, any_stop = 0;

    r->succeeded = 1;
    for (int q = 0; q < procs; q++) {
        const proc_head *h = (const proc_head *)(all + (size_t)q * len);
        const proc_dev *d = (const proc_dev *)(h + 1);
        if (h->local == 0) {
            td_error_t why;
            int who = -1;
            if (td_group_notice(r->group, &who, &why) && who / local == q)
                add_failed(r, q, who % local, &why);
            else {
                td_error_set(&why, TD_EMPI, "its process did not report (it is gone)");
                add_failed(r, q, 0, &why);
            }
            r->succeeded = 0;
            continue;
        }
        for (int l = 0; l < h->local; l++)
            if (d[l].failed)
                add_failed(r, q, d[l].device, &d[l].err);
        if (h->stopped == STOP_CANCEL || (h->stopped == STOP_INTERRUPT && any_stop == 0))
            any_stop = h->stopped;
        r->stopped_loading |= h->stopped_loading;
        r->succeeded &= h->succeeded != 0;
    }
    if (r->stopped == GO || any_stop == STOP_CANCEL)
        r->stopped = any_stop;
}

/* A spanning run's end, on one thread of each process (the last replica to finish): every
 * process's outcome to process 0. */
static void run_gather(td_run *r)
{
    int local = r->a.world, procs = td_group_world(r->group) / local, missing = 0;
    /* each process's part starts on a proc_head's alignment in the gathered array */
    size_t len = (sizeof(proc_head) + (size_t)local * sizeof(proc_dev) + _Alignof(proc_head) - 1) /
                 _Alignof(proc_head) * _Alignof(proc_head);
    unsigned char *mine = calloc(1, len);
    unsigned char *all = td_group_base(r->group) == 0 ? calloc((size_t)procs, len) : NULL;
    proc_head *h = (proc_head *)mine;
    td_error_t e;

    if (mine == NULL || (td_group_base(r->group) == 0 && all == NULL)) {
        free(mine);
        free(all);
        return;
    }
    *h = (proc_head){.local = local,
                     .stopped = r->stopped,
                     .stopped_loading = r->stopped_loading,
                     .succeeded = r->succeeded,
                     .steps = r->steps};
    for (int l = 0; l < local; l++) {
        proc_dev *d = (proc_dev *)(h + 1) + l;
        d->failed = r->failed[l];
        d->device = r->workers[l]->device;
        if (r->failed[l])
            d->err = r->errs[l];
    }
    if (td_group_outcomes(r->group, mine, len, all, TD_RUN_OUTCOME_WAIT_S, &missing, &e) != 0)
        td_log_err("job %lld: the outcomes of its processes could not be gathered: %s",
                   (long long)r->a.job, e.msg);
    if (all != NULL)
        merge_outcomes(r, all, len, procs);
    free(mine);
    free(all);
}

/* The run's single DONE event, filled in by the last replica to finish. */
static td_event *run_outcome(td_run *r)
{
    td_event *done = r->ev_done;
    int any_failed = 0, merged = td_group_spanning(r->group) && td_group_base(r->group) == 0;

    r->ev_done = NULL;
    done->step = r->steps;
    for (int i = 0; i < r->a.world; i++) {
        any_failed |= r->failed[i];
        done->sticky |= r->failed[i] && failed_sticky(r, i);
    }
    /* process 0 of a spanning run reports the outcome merged over every process */
    if (merged)
        any_failed = r->n_all_failed > 0;
    if (any_failed) {
        snprintf(done->state, sizeof(done->state), TD_JOB_FAILED);
        if (merged)
            failure_message(r->all_failed, r->n_all_failed, td_group_world(r->group), 1,
                            &done->err);
        else
            local_failure_message(r, &done->err);
    } else if (r->stopped == STOP_CANCEL) {
        snprintf(done->state, sizeof(done->state), TD_JOB_CANCELLED);
        if (r->stopped_loading)
            td_error_set(&done->err, TD_ECANCELLED, "cancelled while loading its data");
        else
            td_error_set(&done->err, TD_ECANCELLED, "cancelled at step %lld%s%s",
                         (long long)r->steps, r->note.code ? "; " : "", r->note.msg);
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
    replica p = {.r = r, .w = w, .rank = rank, .global = td_group_base(r->group) + rank};
    td_error_t e;
    int last;

    if (p.global == 0 && r->a.mq != NULL && td_mq_sink_open(r->a.mq, r->a.job, r, &p.sink) != 0) {
        td_error_set(&e, TD_ENOMEM, "out of memory opening the metric sink");
        run_fail(r, rank, &e);
    } else {
        replica_train(&p);
    }
    if (p.joined)
        td_group_leave(r->group, rank);
    if (p.sink != NULL) {
        /* The job ends only once every row it produced is durable. */
        if (td_mq_flush(p.sink, &e) != 0 && r->store_err.code == 0)
            r->store_err = e;
        td_mq_sink_close(p.sink);
    }
    pthread_mutex_lock(&r->mu);
    last = ++r->finished == r->a.world;
    pthread_mutex_unlock(&r->mu);
    if (last && td_group_spanning(r->group))
        run_gather(r);
    if (last)
        td_mailbox_post(r->a.mailbox, run_outcome(r));
}

/* Opens the worker's device on its own thread, which keeps it for its life; the thread that
 * starts the workers waits for the answer (init_done). */
static int worker_init(td_worker *w)
{
    td_error_t e = {0};

    td_device_open(&w->dev, w->kind, w->device, &e);
    pthread_mutex_lock(&w->mu);
    w->init_err = e;
    w->init_done = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return e.code;
}

static void *worker_main(void *arg)
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
    td_device_close(w->dev);
    w->dev = NULL;
    return NULL;
}
