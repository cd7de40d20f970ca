/* The daemon's core (daemon.h): the job table, the scheduler, the memory guard at dispatch,
 * the device workers' start and stop, and the events workers and the store thread post.
 * Everything here runs on the loop thread; the workers' side is in run.c and reaches the loop
 * only through the mailbox. */
#include <errno.h>
#include <glob.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "daemon/daemon_int.h"
#include "daemon/mailbox.h"
#include "daemon/metricq.h"
#include "daemon/run.h"
#include "common/td_clock.h"
#include "common/td_log.h"
#include "daemon/writes.h"

#define MIB (1024.0 * 1024.0) /* bytes */
#define TD_VACUUM_AT_START_MAX                                                               \
    ((int64_t)256 << 20) /* bytes of an old database converted at start (a VACUUM: about 3 s \
                          * per 100 MiB here); a larger one is left to the operator */

static void schedule(td_daemon *d);
static void begin_reexec(td_daemon *d, const char *why);

/* ---- the job table ---- */

static td_djob *find_job(const td_daemon *d, int64_t id)
{
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->id == id)
            return j;
    return NULL;
}

/* An ended job whose final state the store has not taken yet (d->unrecorded), or NULL. */
static const td_djob *find_unrecorded(const td_daemon *d, int64_t id)
{
    for (const td_djob *j = d->unrecorded; j != NULL; j = j->next)
        if (j->id == id)
            return j;
    return NULL;
}

/* Adds job at the end of the table, which keeps submission order. */
static void job_append(td_daemon *d, td_djob *job)
{
    td_djob **p = &d->jobs;

    job->next = NULL;
    while (*p != NULL)
        p = &(*p)->next;
    *p = job;
}

void td__daemon_job_unlink(td_daemon *d, td_djob *job)
{
    for (td_djob **p = &d->jobs; *p != NULL; p = &(*p)->next)
        if (*p == job) {
            *p = job->next;
            return;
        }
}

void td__daemon_job_free(td_djob *job)
{
    if (job == NULL)
        return;
    td__launch_free(job);
    free(job);
}

static void free_jobs(td_daemon *d)
{
    while (d->jobs != NULL) {
        td_djob *next = d->jobs->next;
        td__daemon_job_free(d->jobs);
        d->jobs = next;
    }
    while (d->unrecorded != NULL) {
        td_djob *next = d->unrecorded->next;
        td__daemon_job_free(d->unrecorded);
        d->unrecorded = next;
    }
}

/* Whether job runs: on this box's devices, or launched on nodes. */
static int active(const td_djob *job)
{
    return job->run != NULL || job->launch != NULL;
}

int td__daemon_running_jobs(const td_daemon *d)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        n += active(j);
    return n;
}

void td__daemon_job_changed(td_daemon *d, int64_t job, const char *state)
{
    if (d->hooks.job_changed != NULL)
        d->hooks.job_changed(d->hooks.ud, job, state);
}

/* Appends a line to a job's log in the store (lifecycle events, warnings); kept for later
 * while the store cannot take it (writes.h). */
void td__daemon_job_log(td_daemon *d, int64_t job, int level, const char *line)
{
    td_error_t err;

    if (td_writes_log(&d->writes, job, level, line, &err) < 0)
        td_log_warn("job %lld: cannot write its log: %s", (long long)job, err.msg);
}

/* Records a job's new state, and a line in its log saying so. Returns 1 when the state is
 * kept in memory until the store can take it (writes.h), else 0 (written, or refused for
 * good, which is logged). */
int td__daemon_store_state(td_daemon *d, td_djob *job, const char *state, const char *devs,
                           const td_error_t *e)
{
    td_error_t err;
    char line[1200];
    int code = e != NULL ? e->code : 0;
    int rc =
        td_writes_state(&d->writes, job->id, state, devs, code, code != 0 ? e->msg : NULL, &err);

    if (rc < 0)
        td_log_err("job %lld: cannot record state %s: %s", (long long)job->id, state, err.msg);
    if (code != 0)
        td__daemon_outcome_line(line, sizeof(line), state, job->step, e->msg);
    else if (devs != NULL && devs[0] != '\0')
        snprintf(line, sizeof(line), "%s on %s", state, devs);
    else
        snprintf(line, sizeof(line), "%s at step %lld", state, (long long)job->step);
    td__daemon_job_log(d, job->id, code != 0 && code != TD_ECANCELLED ? TD_LOG_ERR : TD_LOG_NOTICE,
                       line);
    return rc == 1;
}

void td__daemon_outcome_line(char *out, size_t size, const char *state, int64_t step,
                             const char *msg)
{
    if (strncmp(msg, state, strlen(state)) == 0) /* "cancelled at step 515" says it all */
        snprintf(out, size, "%s", msg);
    else if (strstr(msg, "at step ") != NULL || strstr(msg, "steps trained") != NULL)
        snprintf(out, size, "%s: %s", state, msg); /* the message names its step */
    else
        snprintf(out, size, "%s at step %lld: %s", state, (long long)step, msg);
}

void td__daemon_write_progress(td_daemon *d, td_djob *job)
{
    td_error_t err;

    job->progress_written = td_mono_ms();
    if (td_writes_progress(&d->writes, job->id, job->step, job->total_steps, &err) < 0)
        td_log_warn("job %lld: cannot record progress: %s", (long long)job->id, err.msg);
}

/* Forgets an ended job, already unlinked from the table; kept (later 1), it waits in
 * d->unrecorded, showing its final state, until the store has taken that state. */
void td__daemon_job_forget(td_daemon *d, td_djob *job, const char *state, const td_error_t *e,
                           int later)
{
    if (!later) {
        td__daemon_job_free(job);
        return;
    }
    snprintf(job->state, sizeof(job->state), "%s", state);
    if (e != NULL)
        job->final_err = *e;
    job->run = NULL;
    job->next = d->unrecorded;
    d->unrecorded = job;
}

/* A state write that was kept left the queue (writes.h): an ended job waiting for it is
 * forgotten now, and its watchers get its stored row. */
static void on_state_written(void *ud, int64_t id, const char *state)
{
    td_daemon *d = ud;

    for (td_djob **p = &d->unrecorded; *p != NULL; p = &(*p)->next)
        if ((*p)->id == id && strcmp((*p)->state, state) == 0) {
            td_djob *job = *p;
            *p = job->next;
            td__daemon_job_free(job);
            if (d->stopping < 2)
                td__daemon_job_changed(d, id, state);
            return;
        }
}

/* Ends a job that never ran, or ran and is over, here on the loop thread: records state
 * with err, and forgets it. */
static void job_end(td_daemon *d, td_djob *job, const char *state, const td_error_t *e)
{
    int64_t id = job->id;
    int later = td__daemon_store_state(d, job, state, NULL, e);

    td__daemon_job_unlink(d, job);
    td__daemon_job_forget(d, job, state, e, later);
    td__daemon_job_changed(d, id, state);
}

/* Where job's checkpoints live: STATE_DIR/checkpoints/JOB (a job that spans nodes keeps its
 * own in [cluster] shared_dir, td__launch_job_dir). TD_E2BIG when it does not fit. */
static int checkpoint_dir(const td_daemon *d, int64_t job, char *out, size_t size)
{
    if (snprintf(out, size, "%s/checkpoints/%lld", d->cfg.state_dir, (long long)job) >= (int)size)
        return TD_E2BIG;
    return 0;
}

/* ---- devices ---- */

/* The devices of --devices: fills the workers' kind, number and name; returns how many there
 * will be. cuda:all takes every GPU the process sees; a GPU named that it does not see stops
 * the start. */
static int workers_plan(td_daemon *d, td_error_t *err)
{
    const td_config *cfg = &d->cfg;
    int n = 0, seen = 0, devs[TD_MAX_DEVICES], rc;

    if (cfg->dev_kind == TD_DEVICE_CPU) {
        n = cfg->ncpu_devices;
        for (int i = 0; i < n; i++)
            devs[i] = i;
    } else {
        rc = td_device_count(cfg->dev_kind, &seen, err);
        if (rc != 0) {
            td_error_t why = *err;
            return td_error_set(err, rc, "--devices %s: %s", td_device_kind_name(cfg->dev_kind),
                                why.msg);
        }
        if (seen == 0)
            return td_error_set(err, TD_ECUDA,
                                "--devices %s: no CUDA device is visible to this process (no "
                                "GPU, no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them all)",
                                cfg->cuda_all ? "cuda:all" : "cuda:N");
        n = cfg->cuda_all ? (seen < TD_MAX_DEVICES ? seen : TD_MAX_DEVICES) : cfg->ncuda_devices;
        for (int i = 0; i < n; i++) {
            devs[i] = cfg->cuda_all ? i : cfg->cuda_devices[i];
            if (devs[i] >= seen)
                return td_error_set(err, TD_ECUDA,
                                    "--devices: there is no cuda:%d; this process sees %d "
                                    "GPU(s), cuda:0 to cuda:%d",
                                    devs[i], seen, seen - 1);
        }
    }
    for (int i = 0; i < n; i++) {
        td_worker *w = &d->workers[i];
        w->index = i;
        w->kind = cfg->dev_kind;
        w->device = devs[i];
        snprintf(w->name, sizeof(w->name), "%s:%d", td_device_kind_name(w->kind), w->device);
    }
    return n;
}

/* The least memory a job would have on workers ws[0..n), that device's total and name. */
static int least_memory(td_worker *const *ws, int n, size_t *free_bytes, size_t *total_bytes,
                        const char **name, td_error_t *err)
{
    int ordinals[TD_MAX_DEVICES], which = 0, rc;

    for (int i = 0; i < n; i++)
        ordinals[i] = ws[i]->device;
    rc = td_device_job_memory(ws[0]->kind, ordinals, n, free_bytes, total_bytes, &which, err);
    *name = ws[which]->name;
    return rc;
}

int td_daemon_ndevices(const td_daemon *d)
{
    return d->nworkers;
}

void td_daemon_device(const td_daemon *d, int i, td_device_view *out)
{
    const td_worker *w = &d->workers[i];
    const td_djob *job = w->running != 0 ? find_job(d, w->running) : NULL;

    out->name = w->name;
    out->kind = w->kind;
    out->job = job != NULL ? job->id : 0;
    out->job_name = job != NULL ? job->spec.name : NULL;
}

int td_daemon_device_memory(const td_daemon *d, int i, size_t *free_bytes, size_t *total_bytes,
                            td_error_t *err)
{
    if (i < 0 || i >= d->nworkers)
        return td_error_set(err, TD_EINVAL, "no device %d", i);
    return td_device_memory(d->workers[i].kind, d->workers[i].device, free_bytes, total_bytes, err);
}

int td_daemon_workers_fresh(const td_daemon *d, int64_t stale_ms, char *why, size_t size)
{
    char stall[700];

    if (td_workers_fresh(d->workers, d->nworkers, stale_ms, why, size))
        return 1;
    /* A worker blocked on a full metric queue while the store thread waits out a lock or a
     * full disk (metricq.h) is paused, not hung: the store thread logs the wait. */
    return d->mq != NULL && td_mq_stalled(d->mq, stall, sizeof(stall));
}

/* ---- the scheduler ---- */

/* Devices held by uid's running jobs. */
static int devices_held(const td_daemon *d, int64_t uid)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->uid == uid && j->run != NULL)
            n += j->spec.devices; /* a launched job holds none of this box's */
    return n;
}

/* The next queued job to run on this box's devices: highest priority first, then oldest,
 * skipping jobs whose user already holds max_devices_per_user devices, and jobs that span
 * nodes (td__launch_schedule). */
static td_djob *next_queued(const td_daemon *d)
{
    int limit = d->cfg.max_devices_per_user;
    td_djob *best = NULL;

    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (!active(j) && j->spec.nodes == 1 && strcmp(j->state, TD_JOB_QUEUED) == 0 &&
            (limit == 0 || devices_held(d, j->uid) + j->spec.devices <= limit) &&
            (best == NULL || j->spec.priority > best->spec.priority))
            best = j;
    return best;
}

/* Replaces job id's stored spec with blob, and its JSON rendering (status --json, the SQLite
 * file's jobs.spec_json) with blob's. */
static int store_spec(td_daemon *d, int64_t id, const void *blob, size_t len, td_error_t *err)
{
    td_proto_frame *f = NULL;
    char *json = NULL;
    int rc = td_proto_decode(blob, len, &f, err);

    if (rc == 0 && (json = td_pv_to_json(td_proto_frame_root(f))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for the job's JSON");
    /* 1, kept until the store can take it (writes.h), is as good as written here. */
    if (rc == 0 && (rc = td_writes_spec(&d->writes, id, blob, len, json, err)) > 0)
        rc = 0;
    free(json);
    td_proto_frame_free(f);
    return rc;
}

/* Stores the batch the memory guard chose for a batch_size "auto" job in its spec, so that a
 * restart (or a re-exec) resumes it with the same batch. */
static void store_batch(td_daemon *d, td_djob *job, const td_memguard *g)
{
    td_job_row row = {0};
    td_error_t err;
    void *blob = NULL;
    size_t len = 0;
    char line[300];
    int rc;

    rc = td_store_job_get(d->store, job->id, &row, &err);
    if (rc == 0)
        rc = td_jobspec_set_batch(row.spec, row.spec_len, job->spec.train.batch_size, &blob, &len,
                                  &err);
    if (rc == 0)
        rc = store_spec(d, job->id, blob, len, &err);
    if (rc != 0)
        td_log_warn("job %lld: cannot store its batch_size %d: %s; a restart chooses again",
                    (long long)job->id, job->spec.train.batch_size, err.msg);
    free(blob);
    td_job_row_clear(&row);
    snprintf(line, sizeof(line),
             "batch_size auto: %d (needs %.0f MiB per device, %.0f MiB free on %s)",
             job->spec.train.batch_size, (double)g->est.total / MIB, (double)g->free_bytes / MIB,
             g->device);
    td__daemon_job_log(d, job->id, TD_LOG_NOTICE, line);
    td_log_notice("job %lld (%s): %s", (long long)job->id, job->spec.name, line);
}

/* The memory guard (memguard.h) for spec on workers ws[0..n): the job's estimate on one
 * device against the least free memory among them. */
static int guard(td_jobspec *spec, td_worker *const *ws, int n, td_memguard *g, td_error_t *err)
{
    size_t least = 0, total = 0;
    const char *where = ws[0]->name;
    int rc = least_memory(ws, n, &least, &total, &where, err);

    if (rc != 0)
        return rc;
    spec->train.kernels = td_device_kernels(ws[0]->kind); /* the CUDA workspace counts on a GPU */
    spec->train.world = n;
    return td_memguard_check(spec, least, total, where, g, err);
}

/* The memory guard at dispatch (DESIGN.md: "Before a job starts on a device"). A batch_size
 * "auto" job takes the largest batch that fits, and keeps it. Returns 0 to dispatch;
 * otherwise the job has ended failed here with the guard's numbers. */
static int guard_memory(td_daemon *d, td_djob *job, td_worker **ws, int n)
{
    td_jobspec spec = job->spec;
    td_memguard g;
    td_error_t err = {0};
    int rc = guard(&spec, ws, n, &g, &err);

    if (rc != 0 && td_device_poisoned()) {
        /* Reading the GPUs' memory met the lost CUDA state first: not this job's fault. It
         * stays queued and runs after the re-exec. */
        char why[512];
        snprintf(why, sizeof(why), "the memory guard of job %lld (%.100s): %.300s",
                 (long long)job->id, job->spec.name, err.msg);
        begin_reexec(d, why);
        return rc;
    }
    if (rc != 0) {
        td_log_warn("job %lld (%s, uid %lld): refused at dispatch: %s", (long long)job->id,
                    job->spec.name, (long long)job->uid, err.msg);
        job_end(d, job, TD_JOB_FAILED, &err);
        return rc;
    }
    if (job->spec.batch_auto) {
        job->spec.train.batch_size = spec.train.batch_size;
        job->spec.batch_auto = 0;
        store_batch(d, job, &g);
    }
    return 0;
}

/* Starts job on n free workers, lowest device numbers first. */
static int dispatch(td_daemon *d, td_djob *job, td_worker **free_w, int n)
{
    const td_jobspec *spec = &job->spec;
    td_run_args a = {.job = job->id,
                     .spec = spec,
                     .workers = free_w,
                     .world = n,
                     .mailbox = &d->mailbox,
                     .mq = d->mq,
                     .nccl_timeout_s =
                         spec->nccl_timeout_s > 0 ? spec->nccl_timeout_s : d->cfg.nccl_timeout_s,
                     .disk_full_wait_s = d->cfg.disk_full_wait_s};
    td_error_t err;
    size_t len = 0;

    /* Every run keeps its checkpoints where a restart will look for them. */
    checkpoint_dir(d, job->id, job->spec.train.checkpoint_dir,
                   sizeof(job->spec.train.checkpoint_dir));
    if (td_run_new(&job->run, &a, &err) != 0) {
        td_log_err("job %lld: %s; it stays queued", (long long)job->id, err.msg);
        return -1;
    }
    job->device_list[0] = '\0';
    for (int i = 0; i < n; i++) {
        free_w[i]->running = job->id;
        len += (size_t)snprintf(job->device_list + len, sizeof(job->device_list) - len, "%s%s",
                                i ? "," : "", free_w[i]->name);
        if (len >= sizeof(job->device_list))
            len = sizeof(job->device_list) - 1;
    }
    snprintf(job->state, sizeof(job->state), TD_JOB_RUNNING);
    td__daemon_store_state(d, job, TD_JOB_RUNNING, job->device_list, NULL);
    td_log_notice("job %lld (%s, uid %lld): running on %s", (long long)job->id, job->spec.name,
                  (long long)job->uid, job->device_list);
    td_run_start(job->run);
    td__daemon_job_changed(d, job->id, TD_JOB_RUNNING);
    return 0;
}

/* Gives free devices to queued jobs, in scheduling order; a job waits until enough of its
 * devices are free at once (no job jumps ahead of a waiting wider one, so none starves). A
 * job the memory guard refuses ends there, and the next one is looked at. */
static void schedule(td_daemon *d)
{
    td_djob *job;

    td__launch_schedule(d);
    /* A refusal can start a stop (a re-exec): then nothing more is dispatched. */
    while (!d->stopping && (job = next_queued(d)) != NULL) {
        td_worker *free_w[TD_MAX_DEVICES];
        int n = 0;
        for (int i = 0; i < d->nworkers && n < job->spec.devices; i++)
            if (d->workers[i].running == 0)
                free_w[n++] = &d->workers[i];
        if (n < job->spec.devices)
            return;
        if (guard_memory(d, job, free_w, n) != 0)
            continue;
        if (dispatch(d, job, free_w, n) != 0)
            return;
    }
}

/* ---- stopping ---- */

/* Interrupts every running job: each checkpoints at its next step boundary and is requeued.
 * Nothing is dispatched from now on. */
static void stop_jobs(td_daemon *d)
{
    d->stopping = 1;
    atomic_store(&d->work_stop, 1);
    for (td_djob *j = d->jobs; j != NULL; j = j->next) {
        if (j->run != NULL)
            td_run_interrupt(j->run);
        if (j->launch != NULL)
            td_launch_interrupt(j->launch);
    }
    td_mailbox_wake(&d->mailbox);
}

/* Once nothing runs: the server goes first (hooks.stopped), then what the jobs used. */
static void finish_shutdown(td_daemon *d)
{
    d->stopping = 2;
    if (d->hooks.stopped != NULL)
        d->hooks.stopped(d->hooks.ud);
    td_workers_stop(d->workers, d->nworkers);
    d->nworkers = 0;
    td_mq_stop(d->mq);
    d->mq = NULL;
    /* Durable notices the store thread posted last have nobody left to tell. */
    td_mailbox_close(&d->mailbox);
    td_purge_close(&d->purge);
    td_writes_close(&d->writes);
    free_jobs(d);
    td_store_close(d->store);
    d->store = NULL;
    if (!d->discarded)
        td_log_notice(d->reexec ? "stopped for the re-exec" : "stopped");
}

void td_daemon_shutdown(td_daemon *d)
{
    if (d->stopping) {
        if (d->reexec && d->stopping == 1) {
            td_log_notice("stopping instead of re-executing");
            d->reexec = 0;
        }
        return;
    }
    td_log_notice("stopping: %d running job(s) will be requeued", td__daemon_running_jobs(d));
    stop_jobs(d);
}

const char *td_daemon_reexec_why(const td_daemon *d)
{
    return d->reexec ? d->reexec_why : NULL;
}

const atomic_int *td_daemon_stop_flag(const td_daemon *d)
{
    return &d->work_stop;
}

td_store *td_daemon_store(const td_daemon *d)
{
    return d->store;
}

/* A sticky CUDA error (DESIGN.md, "Failures"): the process's CUDA state is lost and no job
 * may be served from it again. The job that met it has failed with its own message (or, when
 * the memory guard met it, stays queued); every running job is interrupted (it checkpoints
 * and goes back to the queue), nothing new is dispatched, and once nothing runs the loop ends
 * and main() re-executes traind, whose start resumes the queue. why says where it was met. */
static void begin_reexec(td_daemon *d, const char *why)
{
    if (d->stopping)
        return;
    d->reexec = 1;
    snprintf(d->reexec_why, sizeof(d->reexec_why), "%s", why);
    td_log_err("sticky CUDA error in %s", d->reexec_why);
    td_log_err("the process's CUDA state is lost: no more jobs start here; %d running job(s) "
               "will checkpoint and be requeued, then traind re-executes itself",
               td__daemon_running_jobs(d));
    stop_jobs(d);
}

/* ---- events ---- */

void td__daemon_store_err_devices(td_daemon *d, int64_t job, td_pw *w)
{
    const void *body;
    size_t len = 0;
    td_error_t err;

    body = td_pw_body(w, &len);
    if (body == NULL)
        td_log_warn("job %lld: no memory to record its device errors", (long long)job);
    else if (td_writes_err_devices(&d->writes, job, body, len, &err) < 0)
        td_log_warn("job %lld: cannot record its device errors: %s", (long long)job, err.msg);
    td_pw_free(w);
}

/* The failed devices of run as the msgpack list {device, code, message} the store keeps for
 * `status --json`, into the store. */
static void store_failed_devices(td_daemon *d, int64_t job, const td_run *r)
{
    uint32_t nfail = 0;
    td_pw w;

    for (int i = 0; i < td_run_world(r); i++)
        nfail += td_run_failure(r, i) != NULL;
    if (nfail == 0)
        return;
    td_pw_init(&w);
    td_pw_array(&w, nfail);
    for (int i = 0; i < td_run_world(r); i++) {
        const td_error_t *e = td_run_failure(r, i);
        if (e == NULL)
            continue;
        td_pw_map_open(&w);
        td_pw_str(&w, "device");
        td_pw_int(&w, td_run_worker(r, i)->device);
        td_pw_str(&w, "code");
        td_pw_int(&w, e->code);
        td_pw_str(&w, "message");
        td_pw_str(&w, e->msg);
        td_pw_map_close(&w);
    }
    td__daemon_store_err_devices(d, job, &w);
}

/* A run is over: its workers are free again, and the job ends, or goes back to the queue. */
static void handle_done(td_daemon *d, td_event *ev)
{
    td_djob *job = find_job(d, ev->job);
    char devs[sizeof(job->device_list)];
    int requeue, later = 0;

    if (job == NULL)
        return;
    memcpy(devs, job->device_list, sizeof(devs));
    job->step = ev->step > job->step ? ev->step : job->step;
    td__daemon_write_progress(d, job);
    for (int i = 0; i < d->nworkers; i++)
        if (d->workers[i].running == job->id)
            d->workers[i].running = 0;
    if (ev->sticky && d->reexec) {
        /* Another job already met the sticky error: this one's CUDA error is the lost state
         * showing through, not its own fault. It resumes from its last checkpoint after the
         * re-exec, like the jobs the stop interrupted. */
        td_log_warn("job %lld (%s): %s; the process's CUDA state was already lost: requeued",
                    (long long)job->id, job->spec.name, ev->err.msg);
        snprintf(ev->state, sizeof(ev->state), TD_JOB_QUEUED);
    }
    if (job->metrics_err.code != 0 && strcmp(ev->state, TD_JOB_FAILED) != 0) {
        /* Some of its metric rows could not be stored (metricq.h) and the daemon cancelled
         * it: it fails with that cause, whatever the stop that the cancel caused says. */
        snprintf(ev->state, sizeof(ev->state), TD_JOB_FAILED);
        td_error_set(&ev->err, job->metrics_err.code, "metrics could not be stored: %s",
                     job->metrics_err.msg);
    }
    requeue = strcmp(ev->state, TD_JOB_QUEUED) == 0;
    if (!requeue)
        later = td__daemon_store_state(d, job, ev->state, NULL, &ev->err);
    if (!requeue && strcmp(ev->state, TD_JOB_FAILED) == 0)
        store_failed_devices(d, job->id, job->run);
    td_run_free(job->run);
    job->run = NULL;
    job->device_list[0] = '\0';
    if (requeue) {
        /* Interrupted by shutdown: back to the queue, resumed at the next start. */
        snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
        td__daemon_store_state(d, job, TD_JOB_QUEUED, "", NULL);
        td_log_notice("job %lld (%s): interrupted at step %lld, requeued", (long long)job->id,
                      job->spec.name, (long long)job->step);
        return;
    }
    if (ev->err.code != 0 && strcmp(ev->state, TD_JOB_CANCELLED) != 0) {
        char line[1200];
        td__daemon_outcome_line(line, sizeof(line), ev->state, job->step, ev->err.msg);
        td_log_warn("job %lld (%s, uid %lld): %s", (long long)job->id, job->spec.name,
                    (long long)job->uid, line);
    } else
        td_log_notice("job %lld (%s, uid %lld): %s at step %lld", (long long)job->id,
                      job->spec.name, (long long)job->uid, ev->state, (long long)job->step);
    if (ev->sticky) {
        char why[512];
        snprintf(why, sizeof(why), "job %lld (%.100s) on %.64s: %.300s", (long long)job->id,
                 job->spec.name, devs, ev->err.msg);
        begin_reexec(d, why);
    }
    td__daemon_job_unlink(d, job);
    td__daemon_job_forget(d, job, ev->state, &ev->err, later);
    td__daemon_job_changed(d, ev->job, ev->state);
}

/* The store thread could not store some of job's metric rows (a full disk that stayed full,
 * an I/O error; metricq.h): the job cannot end with rows missing, so it stops at its next step
 * and fails (handle_done), rather than train on without them. */
void td__daemon_store_failed(td_daemon *d, td_djob *job, const td_error_t *e)
{
    if (job == NULL || !active(job) || job->metrics_err.code != 0)
        return;
    job->metrics_err = *e;
    td_log_err("job %lld (%s, uid %lld): its metrics cannot be stored: %s; it stops and fails",
               (long long)job->id, job->spec.name, (long long)job->uid, e->msg);
    if (job->run != NULL) {
        td_run_cancel(job->run);
    } else {
        td_error_t why;
        td_error_set(&why, e->code, "metrics could not be stored: %s", e->msg);
        td_launch_fail(job->launch, &why);
    }
}

static void handle_event(td_daemon *d, td_event *ev)
{
    td_djob *job = find_job(d, ev->job);

    switch (ev->kind) {
    case TD_EV_STARTED:
        if (job != NULL) {
            job->total_steps = ev->total_steps;
            job->step = ev->step;
            td__daemon_write_progress(d, job);
            td__daemon_job_changed(d, job->id, job->state);
        }
        break;
    case TD_EV_PROGRESS:
        if (job != NULL && job->run != NULL) {
            job->step = td_run_progress(job->run);
            if (td_mono_ms() - job->progress_written >= TD_PROGRESS_WRITE_MS)
                td__daemon_write_progress(d, job);
        }
        break;
    case TD_EV_DURABLE:
        if (job != NULL && ev->step > job->durable_step)
            job->durable_step = ev->step;
        td__daemon_job_changed(d, ev->job, NULL);
        break;
    case TD_EV_DONE:
        handle_done(d, ev);
        break;
    case TD_EV_STORE_FAILED:
        td__daemon_store_failed(d, job, &ev->err);
        break;
    }
}

/* The mailbox's callback: every event, then the next dispatch (or the end of a stop). */
static void on_mail(void *ud)
{
    td_daemon *d = ud;
    td_event *ev = td_mailbox_take(&d->mailbox);
    uint64_t dropped = td_mailbox_take_dropped(&d->mailbox);

    if (dropped > 0)
        td_log_warn("out of memory: %llu progress or durable notices from the workers and the "
                    "store thread were dropped (later ones replace them)",
                    (unsigned long long)dropped);
    while (ev != NULL) {
        td_event *next = ev->next;
        handle_event(d, ev);
        td_event_free(ev);
        ev = next;
    }
    if (d->stopping) {
        if (d->stopping == 1 && td__daemon_running_jobs(d) == 0)
            finish_shutdown(d);
        return;
    }
    schedule(d);
}

/* The store thread's durable callback (the store thread). */
static void on_durable(void *ud, int64_t job, int64_t step)
{
    td_event *ev = td_event_new(TD_EV_DURABLE, job);

    /* NULL: dropped and counted (mailbox.h); the job's next batch says it again. */
    if (ev != NULL)
        ev->step = step;
    td_mailbox_post(ud, ev);
}

/* ---- start ---- */

/* Parses a job's stored spec (row->spec, msgpack) again, with the checks of submit; files 0
 * leaves out the checks that its files are readable (export and sample need only the
 * configuration, and an ended job's dataset may be gone), 1 keeps them (a queued job about to
 * run). */
static int stored_spec(const td_job_row *row, int files, td_jobspec *spec, td_error_t *err)
{
    td_proto_frame *f = NULL;
    int rc;

    if (row->spec == NULL)
        return td_error_set(err, TD_EJOB, "the store holds no spec for job %lld",
                            (long long)row->id);
    rc = td_proto_decode(row->spec, row->spec_len, &f, err);
    if (rc == 0)
        rc = files ? td_jobspec_parse(td_proto_frame_root(f), spec, err)
                   : td_jobspec_parse_stored(td_proto_frame_root(f), spec, err);
    td_proto_frame_free(f);
    return rc;
}

static int load_job(td_daemon *d, const td_job_row *row)
{
    td_error_t err;
    td_djob *job = calloc(1, sizeof(*job));
    int rc;

    if (job == NULL)
        return TD_ENOMEM;
    rc = stored_spec(row, 1, &job->spec, &err);
    if (rc != 0) {
        /* The spec was valid when submitted; a dataset may have gone since. */
        td_log_warn("job %lld: cannot be resumed: %s", (long long)row->id, err.msg);
        td_store_job_set_state(d->store, row->id, TD_JOB_FAILED, NULL, rc, err.msg, NULL);
        td__daemon_job_free(job);
        return 0;
    }
    job->id = row->id;
    job->uid = row->uid;
    job->spec.uid = row->uid; /* its files are opened as its user, here too */
    job->step = row->step;
    if (td__launch_load(job, row) != 0) {
        td__daemon_job_free(job);
        return TD_ENOMEM;
    }
    snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
    job_append(d, job);
    return 0;
}

static int load_queue(td_daemon *d, td_error_t *err)
{
    td_job_row *rows = NULL;
    size_t n = 0;
    int requeued = 0, rc;

    rc = td_store_jobs_requeue_running(d->store, &requeued, err);
    if (rc != 0)
        return rc;
    if (requeued > 0)
        td_log_notice("%d job(s) were running when the daemon stopped: requeued", requeued);
    rc = td_store_job_list(d->store, 1, &rows, &n, err);
    for (size_t i = 0; i < n; i++) {
        if (rc == 0 && strcmp(rows[i].state, TD_JOB_QUEUED) == 0)
            rc = load_job(d, &rows[i]);
        td_job_row_clear(&rows[i]);
    }
    free(rows);
    if (rc == TD_ENOMEM)
        td_error_set(err, rc, "out of memory loading the queue");
    return rc;
}

/* Removes exports a daemon that died left half-written or unsent (work.c names them
 * STATE_DIR/export-JOB-N.bin and unlinks them once open, so any found here are orphans). */
static void sweep_exports(const td_daemon *d)
{
    char pattern[600];
    glob_t g;

    snprintf(pattern, sizeof(pattern), "%s/export-*.bin*", d->cfg.state_dir);
    if (glob(pattern, 0, NULL, &g) == 0)
        for (size_t i = 0; i < g.gl_pathc; i++)
            if (unlink(g.gl_pathv[i]) == 0)
                td_log_info("removed %s, an export left by an earlier daemon", g.gl_pathv[i]);
    globfree(&g);
}

/* A database created before incremental auto-vacuum keeps the pages deleted jobs free (store.h,
 * "Space"). A small one is converted at start, by a VACUUM; a larger one would hold the start
 * up too long (and needs as much room again, for a while), so it is left as it is and the log
 * says how to convert it by hand. */
static void convert_vacuum(td_daemon *d)
{
    td_store_space sp;
    td_error_t err;
    double t0 = td_mono_ms();
    int done = 0;

    if (td_store_vacuum_convert(d->store, TD_VACUUM_AT_START_MAX, &done, &err) != 0) {
        td_log_warn("store: cannot convert %s to incremental auto-vacuum: %s; deleted jobs' "
                    "pages stay in the file",
                    d->cfg.db_path, err.msg);
        return;
    }
    if (done == 1)
        td_log_notice("store: %s converted to incremental auto-vacuum in %.1f s: deleted jobs' "
                      "space goes back to the file system",
                      d->cfg.db_path, (td_mono_ms() - t0) / 1000.0);
    if (done == -1 && td_store_space_get(d->store, &sp, &err) == 0)
        td_log_notice("store: %s (%.0f MiB) predates incremental auto-vacuum: the space of deleted "
                      "jobs stays in the file for later writes. To give it back, stop traind and "
                      "run: sqlite3 %s 'PRAGMA auto_vacuum=INCREMENTAL; VACUUM' (it needs as much "
                      "free disk again, for a while)",
                      d->cfg.db_path, (double)(sp.pages * sp.page_bytes) / (1024.0 * 1024.0),
                      d->cfg.db_path);
}

/* The purge's checkpoints go to the store thread, whose transactions are short and whose
 * waits hold up no client (daemon_purge.h). */
static void purge_checkpoint(void *ud)
{
    td_daemon *d = ud;

    if (d->mq != NULL)
        td_mq_checkpoint(d->mq);
}

/* At start: deletions a stop interrupted go on, and checkpoint directories of jobs that no
 * longer exist are swept (daemon_purge.h). */
static void resume_purge(td_daemon *d)
{
    int64_t job = 0, pending = 0;
    td_error_t err;

    if (td_store_purge_next(d->store, &job, &pending, &err) == 0 && pending > 0)
        td_log_notice("deleting %lld job(s) whose deletion was under way when traind stopped",
                      (long long)pending);
    td_purge_kick(&d->purge, 1);
}

/* Acquires step by step and, like uv_loop_init, unwinds every step in reverse on failure.
 * The mailbox comes last: it is the only libuv handle, so a failed start leaves nothing for
 * the loop to close. */
int td_daemon_new(td_daemon **out, uv_loop_t *loop, const td_config *cfg, td_error_t *err)
{
    td_daemon *d = calloc(1, sizeof(*d));
    int n, rc;

    *out = NULL;
    if (d == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    d->cfg = *cfg;
    d->loop = loop;
    rc = td_store_open(&d->store, cfg->db_path, err);
    if (rc != 0)
        goto fail_store;
    convert_vacuum(d);
    sweep_exports(d);
    rc = load_queue(d, err);
    if (rc != 0)
        goto fail_queue;
    /* From here on the loop thread never waits on another process's lock: what it cannot
     * write at once is kept and written later (writes.h). */
    td_store_set_lock_wait(d->store, TD_STORE_NOWAIT);
    rc = td_mq_start(&d->mq, cfg->db_path, 0, on_durable, &d->mailbox, err);
    if (rc != 0)
        goto fail_queue;
    td_mq_on_failure(d->mq, td_run_on_store_failed, NULL);
    td_mq_set_full_wait(d->mq, cfg->disk_full_wait_s * 1e3);
    n = workers_plan(d, err);
    rc = n < 0 ? n : td_workers_start(d->workers, n, err);
    if (rc != 0)
        goto fail_workers;
    d->nworkers = n;
    rc = td_mailbox_init(&d->mailbox, loop, on_mail, d);
    if (rc != 0) {
        td_error_set(err, rc, "uv_async_init: %s", uv_strerror(rc));
        goto fail_mailbox;
    }
    rc = td_writes_init(&d->writes, loop, d->store, on_state_written, d);
    if (rc != 0) {
        td_error_set(err, rc, "uv_timer_init: %s", uv_strerror(rc));
        goto fail_writes;
    }
    rc = td_purge_init(&d->purge, loop, d->store, cfg->state_dir, purge_checkpoint, d);
    if (rc != 0) {
        td_error_set(err, rc, "uv_idle_init: %s", uv_strerror(rc));
        goto fail_purge;
    }
    if (cfg->cluster.launcher != TD_LAUNCHER_NONE) {
        char prefix[600];
        if (td_launch_dir_prefix(&cfg->cluster, prefix, sizeof(prefix), NULL) == 0)
            td_purge_set_shared(&d->purge, prefix);
    }
    resume_purge(d);
    /* Jobs loaded from the store run as soon as the loop turns. */
    td_mailbox_wake(&d->mailbox);
    *out = d;
    return 0;

fail_purge:
    td_writes_close(&d->writes);
fail_writes:
    /* The async handle's memory is d's: let the loop run its close before d goes. */
    td_mailbox_close(&d->mailbox);
    uv_run(loop, UV_RUN_NOWAIT);
fail_mailbox:
    td_workers_stop(d->workers, d->nworkers);
fail_workers:
    td_mq_stop(d->mq);
fail_queue:
    free_jobs(d);
    td_store_close(d->store);
fail_store:
    free(d);
    return rc;
}

void td_daemon_discard(td_daemon *d)
{
    d->discarded = 1;
    d->stopping = 1;
    atomic_store(&d->work_stop, 1);
    finish_shutdown(d);
}

void td_daemon_set_hooks(td_daemon *d, const td_daemon_hooks *hooks)
{
    d->hooks = *hooks;
}

void td_daemon_free(td_daemon *d)
{
    free(d);
}

/* ---- requests ---- */

/* Jobs of uid waiting in the queue; uid -2 counts everyone's. */
static int queued_by(const td_daemon *d, int64_t uid)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        n += (uid == -2 || j->uid == uid) && !active(j);
    return n;
}

/* ---- submit and its dry run ----
 *
 * A job's files are untrusted content (a safetensors header of 16 MiB, a shard's), so they are
 * never read on the loop thread. A submit goes in three steps: the job parsed on the loop (cheap,
 * bounded by the frame), its files checked as the submitter on libuv's threadpool (check_work,
 * which touches only its td_submit), and, back on the loop, the checks against this daemon's
 * devices and limits and the insert (td_daemon_submit_end). A dry run's memory guard reads the
 * dataset's headers too: it runs on the pool after the files' check, against device memory
 * read on the loop before (the devices are the loop's). */

struct td_submit {
    uv_work_t req; /* req.data is the td_submit */
    td_daemon *d;
    int dry_run;
    int64_t uid, gid;
    td_jobspec spec; /* the pool's copy while the work runs; ~70 KiB */
    void *body;      /* submit: the job as msgpack, for the store */
    size_t len;
    char *json;
    td_submit_cb cb;
    void *ud;
    /* the pool's results */
    int rc; /* the files' check */
    td_error_t err;
    /* dry run: the guard, when the job is one whose memory this daemon checks (guarded) */
    int guarded, guard_rc;
    td_error_t guard_err;
    td_memguard g;
    int asked_auto;
    size_t free_bytes, total_bytes;
    td_device_kind kind;
    char device[16]; /* the worker's name (run.h), "cuda:1" */
};

/* A checked job's devices against this daemon's and the per-user limit (a job of nodes, its
 * launcher's). TD_EJOB / TD_EPERM with err naming the field. */
static int check_devices(td_daemon *d, td_jobspec *spec, td_error_t *err)
{
    if (spec->nodes > 1)
        return td__launch_validate(d, spec, err);
    if (spec->devices > d->nworkers)
        return td_error_set(err, TD_EJOB,
                            "devices: the job asks for %d devices but this daemon has %d",
                            spec->devices, d->nworkers);
    if (d->cfg.max_devices_per_user > 0 && spec->devices > d->cfg.max_devices_per_user)
        return td_error_set(err, TD_EPERM,
                            "devices: the job asks for %d devices but each user may hold %d",
                            spec->devices, d->cfg.max_devices_per_user);
    return 0;
}

/* The threadpool: the job's files as its user (td_jobspec_check_access), then a dry run's
 * memory guard. Touches nothing but sub. */
static void check_work(uv_work_t *req)
{
    td_submit *sub = req->data;
    td_jobspec *spec = &sub->spec;

    sub->rc = td_jobspec_check_paths(spec, &sub->err);
    if (sub->rc == 0)
        sub->rc = td_jobspec_check_access(spec, sub->uid, sub->gid, &sub->err);
    if (sub->rc != 0 || !sub->guarded || sub->guard_rc != 0)
        return;
    spec->train.kernels = td_device_kernels(sub->kind); /* the CUDA workspace counts on a GPU */
    spec->train.world = spec->devices;
    sub->guard_rc = td_memguard_check(spec, sub->free_bytes, sub->total_bytes, sub->device, &sub->g,
                                      &sub->guard_err);
}

/* Back on the loop: the caller's callback, which answers (or drops) the request. */
static void check_done(uv_work_t *req, int status)
{
    td_submit *sub = req->data;

    (void)status; /* a check is never cancelled: the loop waits for it (td_submit_begin) */
    sub->cb(sub, sub->ud);
}

/* A dry run's devices, read now on the loop: the memory of the first spec->devices, which an
 * idle daemon would give the job. Only for a job whose memory this daemon checks; a job past
 * the devices is refused by check_devices later, in submit's order. */
static void read_guard_devices(td_daemon *d, td_submit *sub)
{
    td_worker *ws[TD_MAX_DEVICES];
    const char *where = NULL;
    int n = sub->spec.devices;

    if (sub->spec.nodes > 1 || n < 1 || n > d->nworkers)
        return;
    for (int i = 0; i < n; i++)
        ws[i] = &d->workers[i];
    sub->guarded = 1;
    sub->kind = ws[0]->kind;
    sub->guard_rc =
        least_memory(ws, n, &sub->free_bytes, &sub->total_bytes, &where, &sub->guard_err);
    snprintf(sub->device, sizeof(sub->device), "%s", where != NULL ? where : ws[0]->name);
}

void td_submit_free(td_submit *sub)
{
    if (sub == NULL)
        return;
    free(sub->json);
    free(sub->body);
    free(sub);
}

/* The job's msgpack and JSON for the store, made now: job is borrowed only until the request's
 * handler returns. */
static int keep_body(td_submit *sub, const td_pval *job, td_error_t *err)
{
    td_pw w;
    const void *body;
    int rc = 0;

    td_pw_init(&w);
    td_pw_val(&w, job);
    body = td_pw_body(&w, &sub->len);
    if (!w.failed && (sub->body = malloc(sub->len > 0 ? sub->len : 1)) != NULL)
        memcpy(sub->body, body, sub->len);
    sub->json = td_pv_to_json(job);
    if (w.failed || sub->body == NULL || sub->json == NULL)
        rc = td_error_set(err, TD_ENOMEM, "out of memory");
    td_pw_free(&w);
    return rc;
}

int td_submit_begin(td_daemon *d, const td_pval *job, int64_t uid, int64_t gid, int dry_run,
                    td_submit_cb cb, void *ud, td_submit **out, td_error_t *err)
{
    td_submit *sub = calloc(1, sizeof(*sub));
    int rc;

    *out = NULL;
    if (sub == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    sub->d = d;
    sub->dry_run = dry_run;
    sub->uid = uid;
    sub->gid = gid;
    sub->cb = cb;
    sub->ud = ud;
    sub->req.data = sub;
    if ((rc = td_jobspec_check_text(job, err)) != 0 ||
        (rc = td_jobspec_parse_submit(job, &sub->spec, err)) != 0)
        goto fail;
    sub->spec.uid = uid; /* every later open of its files is made as this user */
    sub->spec.gid = gid;
    if (!dry_run && (rc = keep_body(sub, job, err)) != 0)
        goto fail;
    if (dry_run) {
        sub->asked_auto = sub->spec.batch_auto;
        read_guard_devices(d, sub);
    }
    rc = uv_queue_work(d->loop, &sub->req, check_work, check_done);
    if (rc != 0) {
        td_error_set(err, TD_EBUSY, "cannot check the job's files now: %s", uv_strerror(rc));
        rc = TD_EBUSY;
        goto fail;
    }
    *out = sub;
    return 0;
fail:
    td_submit_free(sub);
    return rc;
}

/* A job the store could not take: a lock another process holds (the loop does not wait for
 * it; writes.h) is TD_EBUSY, a full disk TD_EDISKFULL: both the user's to retry, and the
 * message says so. Returns the code the submit fails with. */
static int submit_refused(td_daemon *d, int rc, td_error_t *err)
{
    td_error_t why = *err;

    if (rc == TD_EBUSY)
        return td_error_set(err, TD_EBUSY, "the store is locked by another process; try again (%s)",
                            why.msg);
    if (rc == TD_EDISKFULL)
        return td_error_set(err, rc,
                            "the disk holding the store is full; try again once there is room "
                            "(%s)",
                            why.msg);
    return rc;
}

/* The files' check's result, then what holds against the daemon as it is now. */
static int checked(td_submit *sub, td_error_t *err)
{
    td_daemon *d = sub->d;

    if (d->stopping == 2)
        return td_error_set(err, TD_ECLOSED, "traind is stopping; submit again once it is back");
    if (sub->rc != 0) {
        *err = sub->err;
        return sub->rc;
    }
    return check_devices(d, &sub->spec, err);
}

/* Queues the checked job of sub: the queue limits, the store's row, the table. */
static int queue_job(td_submit *sub, int64_t *id, td_error_t *err)
{
    td_daemon *d = sub->d;
    td_djob *job;
    int64_t uid = sub->uid;
    int rc;

    if (d->cfg.max_queued > 0 && queued_by(d, -2) >= d->cfg.max_queued)
        return td_error_set(err, TD_EPERM, "the queue is full: %d jobs wait, the limit",
                            d->cfg.max_queued);
    if (d->cfg.max_queued_per_user > 0 && queued_by(d, uid) >= d->cfg.max_queued_per_user)
        return td_error_set(err, TD_EPERM,
                            "permission denied: uid %lld already has %d queued jobs, the limit",
                            (long long)uid, d->cfg.max_queued_per_user);
    if ((job = calloc(1, sizeof(*job))) == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    job->spec = sub->spec;
    /* A job that spans nodes asks for all of its nodes' devices. */
    rc = td_store_job_insert(
        d->store, job->spec.name,
        job->spec.nodes > 1 ? job->spec.nodes * job->spec.devices_per_node : job->spec.devices,
        job->spec.priority, uid, sub->body, sub->len, sub->json, &job->id, err);
    if (rc != 0) {
        td__daemon_job_free(job);
        return submit_refused(d, rc, err);
    }
    job->uid = uid;
    snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
    job_append(d, job);
    *id = job->id;
    if (job->spec.nodes > 1)
        td_log_notice("job %lld (%s, uid %lld): queued, %d node(s) x %d device(s)",
                      (long long)job->id, job->spec.name, (long long)uid, job->spec.nodes,
                      job->spec.devices_per_node);
    else
        td_log_notice("job %lld (%s, uid %lld): queued, %d device(s)", (long long)job->id,
                      job->spec.name, (long long)uid, job->spec.devices);
    td__daemon_job_log(d, job->id, TD_LOG_NOTICE, "queued");
    schedule(d);
    return 0;
}

int td_submit_end(td_submit *sub, int64_t *id, td_error_t *err)
{
    int rc = checked(sub, err);

    return rc != 0 ? rc : queue_job(sub, id, err);
}

int td_submit_dry_run_end(td_submit *sub, const td_jobspec **spec, td_memguard *g, int *asked_auto,
                          int *estimated, td_error_t *err)
{
    int rc = checked(sub, err);

    *spec = &sub->spec;
    *asked_auto = sub->asked_auto;
    *estimated = 0;
    memset(g, 0, sizeof(*g));
    if (rc != 0)
        return rc;
    if (sub->spec.nodes > 1)
        return td_error_set(err, TD_EINVAL,
                            "dry_run: a job of %d nodes has its memory checked by its ranks, on "
                            "their nodes' devices, when it starts",
                            sub->spec.nodes);
    *g = sub->g;
    rc = sub->guard_rc;
    if (rc != 0)
        *err = sub->guard_err;
    *estimated = rc == 0 || (rc == TD_ENOMEM && !g->fits && g->est.total > 0);
    return rc;
}

int td_daemon_check_owner(int64_t job, int64_t owner, int64_t uid, td_error_t *err)
{
    struct passwd pw, *found = NULL;
    char buf[1024], name[64];

    if (uid == 0 || uid == owner)
        return 0;
    if (getpwuid_r((uid_t)owner, &pw, buf, sizeof(buf), &found) == 0 && found != NULL)
        snprintf(name, sizeof(name), "%s", pw.pw_name);
    else
        snprintf(name, sizeof(name), "uid %lld", (long long)owner);
    return td_error_set(err, TD_EPERM, "permission denied: job %lld belongs to %s", (long long)job,
                        name);
}

int td_daemon_cancel(td_daemon *d, int64_t id, int64_t uid, char *state_out, td_error_t *err)
{
    td_djob *job = find_job(d, id);
    td_error_t why;
    td_job_row row = {0};
    int rc;

    if (job != NULL && (rc = td_daemon_check_owner(id, job->uid, uid, err)) != 0)
        return rc;
    if (job == NULL) {
        rc = td_store_job_get(d->store, id, &row, err);
        if (rc == TD_ENOTFOUND)
            td_error_set(err, rc, "no job %lld", (long long)id);
        if (rc == 0)
            rc = td_daemon_check_owner(id, row.uid, uid, err);
        if (rc == 0) {
            const td_djob *ended = find_unrecorded(d, id);
            rc = td_error_set(err, TD_ESTATE, "job %lld has already ended (%s)", (long long)id,
                              ended != NULL ? ended->state : row.state);
        }
        td_job_row_clear(&row);
        return rc;
    }
    if (active(job)) {
        if (job->run != NULL)
            td_run_cancel(job->run);
        else
            td_launch_cancel(job->launch);
        snprintf(state_out, TD_STORE_MAX_STATE, "%s", TD_JOB_RUNNING);
        td_log_notice("job %lld (%s): cancel requested by uid %lld", (long long)id, job->spec.name,
                      (long long)uid);
        td__daemon_job_log(d, id, TD_LOG_NOTICE, "cancel requested");
        return 0;
    }
    td_error_set(&why, TD_ECANCELLED, "cancelled while queued");
    td_log_notice("job %lld (%s): cancelled while queued", (long long)id, job->spec.name);
    job_end(d, job, TD_JOB_CANCELLED, &why);
    snprintf(state_out, TD_STORE_MAX_STATE, "%s", TD_JOB_CANCELLED);
    return 0;
}

/* Why queued job waits (td_job_live's reason): the scheduler's own tests, in its order. */
static void queue_reason(const td_daemon *d, const td_djob *job, char *out, size_t size)
{
    int limit = d->cfg.max_devices_per_user, free_devices = 0;
    const td_djob *next;

    if (job->spec.nodes > 1) {
        td__launch_reason(d, job, out, size);
        return;
    }
    if (d->stopping) {
        snprintf(out, size, "the daemon is stopping");
        return;
    }
    if (limit > 0 && devices_held(d, job->uid) + job->spec.devices > limit) {
        snprintf(out, size, "user's limit (max_devices_per_user %d)", limit);
        return;
    }
    next = next_queued(d);
    if (next != NULL && next != job) {
        snprintf(out, size, "priority (behind job %lld)", (long long)next->id);
        return;
    }
    for (int i = 0; i < d->nworkers; i++)
        free_devices += d->workers[i].running == 0;
    snprintf(out, size, "%s", free_devices < job->spec.devices ? "devices busy" : "starting");
}

int td_daemon_job_live(const td_daemon *d, int64_t id, td_job_live *out)
{
    const td_djob *job = find_job(d, id);

    /* An ended job is shown with the state its row will get: the row may still say
     * "running" while the store cannot take the change (writes.h). */
    if (job == NULL)
        job = find_unrecorded(d, id);
    if (job == NULL)
        return 0;
    snprintf(out->state, sizeof(out->state), "%s", job->state);
    out->step = job->step;
    out->total_steps = job->total_steps;
    out->durable_step = job->durable_step;
    out->running = active(job);
    snprintf(out->device_list, sizeof(out->device_list), "%s", job->device_list);
    out->err = job->final_err;
    out->nodes = td__launch_nodes_blob(job, &out->nodes_len);
    out->reason[0] = '\0';
    if (!active(job) && strcmp(job->state, TD_JOB_QUEUED) == 0)
        queue_reason(d, job, out->reason, sizeof(out->reason));
    return 1;
}

typedef struct queued_job {
    int64_t id;
    int priority;
} queued_job;

/* Scheduler order: higher priority first, then the older (smaller) id. */
static int by_schedule(const void *a, const void *b)
{
    const queued_job *x = a, *y = b;

    if (x->priority != y->priority)
        return x->priority > y->priority ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

size_t td_daemon_queued(const td_daemon *d, int64_t *ids, size_t max)
{
    size_t n = (size_t)queued_by(d, -2), k = 0;
    queued_job *q;

    if (n == 0 || max == 0)
        return n;
    q = malloc(n * sizeof(*q));
    if (q == NULL) {
        /* Submission order, unsorted, rather than nothing. */
        for (td_djob *j = d->jobs; j != NULL && k < max; j = j->next)
            if (!active(j))
                ids[k++] = j->id;
        return n;
    }
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (!active(j))
            q[k++] = (queued_job){j->id, j->spec.priority};
    qsort(q, n, sizeof(*q), by_schedule);
    for (k = 0; k < n && k < max; k++)
        ids[k] = q[k].id;
    free(q);
    return n;
}

int td_daemon_checkpoint_dir(const td_daemon *d, int64_t job, int spans_nodes, char *out,
                             size_t size)
{
    const td_djob *live = find_job(d, job);

    if (spans_nodes || (live != NULL && live->spec.nodes > 1))
        return -1;
    return checkpoint_dir(d, job, out, size) == 0 ? 0 : -1;
}

int td_daemon_job_config(td_daemon *d, int64_t job, int64_t uid, td_train_config *cfg,
                         td_error_t *err)
{
    td_djob *live = find_job(d, job);
    td_job_row row = {0};
    td_jobspec *spec = NULL;
    int rc;

    if (live != NULL) {
        rc = td_daemon_check_owner(job, live->uid, uid, err);
        if (rc == 0)
            *cfg = live->spec.train;
        if (rc == 0 && live->spec.nodes > 1) {
            if (td__launch_job_dir(d, live, cfg->checkpoint_dir, sizeof(cfg->checkpoint_dir)) != 0)
                rc = td_error_set(err, TD_EINVAL, "[cluster] shared_dir's path is too long");
            return rc;
        }
        goto dir;
    }
    rc = td_store_job_get(d->store, job, &row, err);
    if (rc == TD_ENOTFOUND)
        rc = td_error_set(err, rc, "no job %lld", (long long)job);
    if (rc == 0)
        rc = td_daemon_check_owner(job, row.uid, uid, err);
    if (rc == 0 && (spec = malloc(sizeof(*spec))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "out of memory");
    if (rc == 0 && (rc = stored_spec(&row, 0, spec, err)) != 0) {
        /* The spec was valid at submit, and its files are not checked again: only a change of
         * traind's own rules since can refuse it now. */
        td_error_t why = *err;
        rc = td_error_set(err, TD_EJOB, "job %lld's spec no longer validates: %s", (long long)job,
                          why.msg);
    }
    if (rc == 0)
        *cfg = spec->train;
    if (rc == 0 && spec->nodes > 1) {
        td_djob tmp = {.id = job, .spec = *spec};
        if (td__launch_job_dir(d, &tmp, cfg->checkpoint_dir, sizeof(cfg->checkpoint_dir)) != 0)
            rc = td_error_set(err, TD_EINVAL, "[cluster] shared_dir's path is too long");
        free(spec);
        td_job_row_clear(&row);
        return rc;
    }
    free(spec);
    td_job_row_clear(&row);
dir:
    if (rc == 0 && checkpoint_dir(d, job, cfg->checkpoint_dir, sizeof(cfg->checkpoint_dir)) != 0)
        rc = td_error_set(err, TD_EINVAL, "the state directory's path is too long");
    return rc;
}

/* ---- deleting ended jobs ---- */

void td_purge_listing_free(td_purge_listing *l)
{
    if (l == NULL)
        return;
    free(l->jobs);
    l->jobs = NULL;
    l->n = 0;
}

/* Keeps the first TD_PURGE_LIST_MAX jobs a deletion lists (td_job_brief_cb). */
static int list_brief(void *ud, const td_job_brief *job)
{
    td_purge_listing *l = ud;

    if (l->n == TD_PURGE_LIST_MAX)
        return 1;
    l->jobs[l->n++] = *job;
    return 0;
}

/* Appends a refusal of one job to err: the first one's code stays, the messages join. */
static void add_refusal(td_error_t *err, int *code, const td_error_t *why)
{
    size_t len = strlen(err->msg);

    if (*code == 0) {
        *code = why->code;
        *err = *why;
        return;
    }
    snprintf(err->msg + len, sizeof(err->msg) - len, "; %s", why->msg);
}

/* Why job id may not be deleted by uid, into why; 0 when it may. */
static int rm_refused(td_daemon *d, int64_t id, int64_t uid, td_error_t *why)
{
    td_job_row row = {0};
    td_job_live live;
    int rc = td_store_job_get(d->store, id, &row, why);

    if (rc == TD_ENOTFOUND)
        rc = td_error_set(why, rc, "no job %lld", (long long)id);
    if (rc == 0)
        rc = td_daemon_check_owner(id, row.uid, uid, why);
    if (rc == 0 && td_daemon_job_live(d, id, &live))
        rc = live.running || strcmp(live.state, TD_JOB_QUEUED) == 0
                 ? td_error_set(why, TD_ESTATE, "job %lld is %s; cancel it first", (long long)id,
                                live.state)
                 : td_error_set(why, TD_ESTATE,
                                "job %lld has ended (%s) but the store has not taken its state "
                                "yet; try again",
                                (long long)id, live.state);
    td_job_row_clear(&row);
    return rc;
}

/* What a deletion the store could not start becomes: another process's lock is the user's to
 * retry (TD_EBUSY), as for submit. */
static int purge_refused(td_daemon *d, int rc, td_error_t *err)
{
    td_error_t why = *err;

    if (rc == TD_EBUSY)
        return td_error_set(err, TD_EBUSY, "the store is locked by another process; try again (%s)",
                            why.msg);
    return rc;
}

/* Starts the listing: room for the jobs, and the database's size before. */
static int listing_begin(td_daemon *d, td_purge_listing *out, td_error_t *err)
{
    td_store_space sp;

    memset(out, 0, sizeof(*out));
    out->jobs = malloc(TD_PURGE_LIST_MAX * sizeof(*out->jobs));
    if (out->jobs == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    if (td_store_space_get(d->store, &sp, err) == 0)
        out->bytes_before = sp.pages * sp.page_bytes;
    return 0;
}

/* The marked jobs' deletion begins, and the caller waits for it. A wait that cannot be had
 * (out of memory) leaves the deletion going on unwaited: the reply then comes at once. */
static void purge_start(td_daemon *d, td_purge_listing *out, const char *what, int64_t uid,
                        double marked_ms, td_purge_done_cb done, td_purge_progress_cb progress,
                        void *ud)
{
    out->waiting = td_purge_wait(&d->purge, done, progress, ud) == 0;
    td_log_notice("uid %lld: %s: deleting %lld job(s), %lld metric row(s) (marked in %.0f ms)",
                  (long long)uid, what, (long long)out->tot.jobs, (long long)out->tot.metric_rows,
                  marked_ms);
    td_purge_kick(&d->purge, what[0] == 'p'); /* a prune sweeps the checkpoints too */
}

int td_daemon_rm(td_daemon *d, const int64_t *ids, size_t n, int64_t uid, td_purge_listing *out,
                 td_purge_done_cb done, td_purge_progress_cb progress, void *ud, td_error_t *err)
{
    td_error_t why;
    double t0;
    int code = 0, rc;

    if ((rc = listing_begin(d, out, err)) != 0)
        return rc;
    td_error_clear(err);
    for (size_t i = 0; i < n; i++)
        if (rm_refused(d, ids[i], uid, &why) != 0)
            add_refusal(err, &code, &why);
    if (code != 0) {
        td_purge_listing_free(out);
        return code;
    }
    t0 = td_mono_ms();
    rc = td_store_jobs_mark(d->store, ids, n, list_brief, out, &out->tot, err);
    if (rc != 0) {
        td_purge_listing_free(out);
        return purge_refused(d, rc, err);
    }
    purge_start(d, out, "rm", uid, td_mono_ms() - t0, done, progress, ud);
    return 0;
}

int td_daemon_prune(td_daemon *d, const td_prune_args *a, int64_t uid, td_purge_listing *out,
                    td_purge_done_cb done, td_purge_progress_cb progress, void *ud, td_error_t *err)
{
    td_prune_query q = {.states = a->states,
                        .nstates = a->nstates,
                        .ended_before = td_wall_s() - a->older_than_s,
                        .by_uid = uid != 0,
                        .uid = uid,
                        .labels = a->labels,
                        .nlabels = a->nlabels};
    double t0;
    int rc;

    if ((rc = listing_begin(d, out, err)) != 0)
        return rc;
    t0 = td_mono_ms();
    rc = td_store_prune(d->store, &q, !a->dry_run, list_brief, out, &out->tot, err);
    if (rc != 0) {
        td_purge_listing_free(out);
        return purge_refused(d, rc, err);
    }
    if (!a->dry_run && out->tot.jobs > 0)
        purge_start(d, out, "prune", uid, td_mono_ms() - t0, done, progress, ud);
    else if (!a->dry_run)
        td_purge_kick(&d->purge, 1); /* nothing to delete, but the checkpoints are swept */
    return 0;
}

/* ---- for operators ---- */

size_t td_daemon_running(const td_daemon *d, td_running_view *out, size_t max)
{
    size_t n = 0;

    for (const td_djob *j = d->jobs; j != NULL; j = j->next) {
        if (!active(j))
            continue;
        if (n < max)
            out[n] = (td_running_view){.id = j->id,
                                       .uid = j->uid,
                                       .step = j->step,
                                       .total_steps = j->total_steps,
                                       .name = j->spec.name};
        n++;
    }
    return n;
}

int td_daemon_job_counts(td_daemon *d, int64_t counts[TD_STORE_NSTATES], td_error_t *err)
{
    int64_t stored[TD_STORE_NSTATES];
    int rc = d->store != NULL ? td_store_job_counts(d->store, stored, err)
                              : td_error_set(err, TD_ECLOSED, "the store is closed");

    /* Index 0 and 1 (queued, running) are the daemon's; the rest the store's. */
    counts[0] = counts[1] = 0;
    for (const td_djob *j = d->jobs; j != NULL; j = j->next)
        counts[active(j) ? 1 : 0]++;
    if (rc == 0)
        for (int i = 2; i < TD_STORE_NSTATES; i++)
            counts[i] = stored[i];
    return rc;
}

void td_daemon_metric_stats(const td_daemon *d, td_mq_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    if (d->mq != NULL)
        td_mq_stats(d->mq, out);
}
