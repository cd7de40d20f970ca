/* The daemon's job table, scheduler and device workers. Everything here runs on the loop
 * thread; the workers' side is in run.c and reaches the loop only through td_daemon_post(). */
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <pwd.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon.h"
#include "run.h"
#include "td_log.h"
#include "td_panic.h"

static double mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- events: any thread to the loop ---- */

void td_daemon_post(td_daemon *d, td_event *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&d->ev_mu);
    if (d->ev_tail != NULL)
        d->ev_tail->next = ev;
    else
        d->ev_head = ev;
    d->ev_tail = ev;
    pthread_mutex_unlock(&d->ev_mu);
    uv_async_send(&d->async);
}

td_event *td_event_new(td_event_kind kind, int64_t job)
{
    td_event *ev = calloc(1, sizeof(*ev));
    if (ev == NULL) {
        /* Losing an event would leave a job or a watcher hanging: nothing sane remains. */
        td_log_err("out of memory posting an event for job %lld", (long long)job);
        abort();
    }
    ev->kind = kind;
    ev->job = job;
    return ev;
}

static void event_free(td_event *ev)
{
    free(ev->devices);
    free(ev);
}

/* The store thread's durable callback. */
static void on_durable(void *ud, int64_t job, int64_t step)
{
    td_event *ev = td_event_new(TD_EV_DURABLE, job);
    ev->step = step;
    td_daemon_post(ud, ev);
}

/* Pins worker i to its own share of the cores, [i*per, (i+1)*per), when the devices divide
 * the cores (so that two cpu: devices never fight over one core). The BLAS calls a worker
 * makes with one thread run on the worker's own thread, so they stay on its cores; a share of
 * several cores is used by OpenBLAS's own pool, which the worker cannot pin. Best effort: a
 * refusal (a cpuset, a container) is logged and training goes on unpinned. */
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

static int workers_start(td_daemon *d, td_error_t *err)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = (int)(cores > 0 ? cores : 1) / d->cfg.ncpu_devices;

    for (int i = 0; i < d->cfg.ncpu_devices; i++) {
        td_worker *w = &d->workers[i];
        int rc;
        w->d = d;
        w->index = i;
        snprintf(w->name, sizeof(w->name), "cpu:%d", i);
        w->threads = per > 0 ? per : 1;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        rc = pthread_create(&w->thread, NULL, td_worker_main, w);
        if (rc != 0)
            return td_error_set(err, -rc, "cannot start worker %s: %s", w->name, strerror(rc));
        if (per > 0)
            pin_worker(w, per, cores);
        d->nworkers++;
    }
    return 0;
}

static void workers_stop(td_daemon *d)
{
    for (int i = 0; i < d->nworkers; i++) {
        td_worker *w = &d->workers[i];
        pthread_mutex_lock(&w->mu);
        w->stop = 1;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->thread, NULL);
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
    }
    d->nworkers = 0;
}

/* ---- the job table and the scheduler (loop thread) ---- */

td_djob *td_daemon_find(td_daemon *d, int64_t id)
{
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
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

static void job_unlink(td_daemon *d, td_djob *job)
{
    for (td_djob **p = &d->jobs; *p != NULL; p = &(*p)->next)
        if (*p == job) {
            *p = job->next;
            return;
        }
}

/* Records a job's new state, and a line in its log saying so. */
static void store_state(td_daemon *d, td_djob *job, const char *state, const char *devs,
                        const td_error_t *e)
{
    td_error_t err;
    char line[1200];
    int code = e != NULL ? e->code : 0;

    if (td_store_job_set_state(d->store, job->id, state, devs, code, code != 0 ? e->msg : NULL,
                               &err) != 0)
        td_log_err("job %lld: cannot record state %s: %s", (long long)job->id, state, err.msg);
    if (code != 0)
        snprintf(line, sizeof(line), "%s at step %lld: %s", state, (long long)job->step, e->msg);
    else if (devs != NULL && devs[0] != '\0')
        snprintf(line, sizeof(line), "%s on %s", state, devs);
    else
        snprintf(line, sizeof(line), "%s at step %lld", state, (long long)job->step);
    td_daemon_log(d, job->id, code != 0 && code != TD_ECANCELLED ? TD_LOG_ERR : TD_LOG_NOTICE,
                  line);
}

void td_daemon_log(td_daemon *d, int64_t job, int level, const char *line)
{
    td_error_t err;

    if (td_store_log(d->store, job, level, line, &err) != 0)
        td_log_warn("job %lld: cannot write its log: %s", (long long)job, err.msg);
}

/* Devices held by uid's running jobs. */
static int devices_held(td_daemon *d, int64_t uid)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->uid == uid && j->run != NULL)
            n += j->spec.devices;
    return n;
}

static int devices_held(td_daemon *d, int64_t uid);

/* The next queued job to run: highest priority first, then oldest, skipping jobs whose user
 * already holds max_devices_per_user devices. */
static td_djob *next_queued(td_daemon *d)
{
    int limit = d->cfg.max_devices_per_user;
    td_djob *best = NULL;

    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->run == NULL && strcmp(j->state, TD_JOB_QUEUED) == 0 &&
            (limit == 0 || devices_held(d, j->uid) + j->spec.devices <= limit) &&
            (best == NULL || j->spec.priority > best->spec.priority))
            best = j;
    return best;
}

/* Starts job on n free workers, lowest device numbers first. */
static void dispatch(td_daemon *d, td_djob *job, td_worker **free_w, int n)
{
    size_t len = 0;

    job->device_list[0] = '\0';
    for (int i = 0; i < n; i++) {
        free_w[i]->running = job;
        len += (size_t)snprintf(job->device_list + len, sizeof(job->device_list) - len, "%s%s",
                                i ? "," : "", free_w[i]->name);
        if (len >= sizeof(job->device_list))
            len = sizeof(job->device_list) - 1;
    }
    /* Every run keeps its checkpoints where a restart will look for them. */
    td_daemon_checkpoint_dir(d, job->id, job->spec.train.checkpoint_dir,
                             sizeof(job->spec.train.checkpoint_dir));
    atomic_store(&job->cancel, 0);
    atomic_store(&job->interrupt, 0);
    snprintf(job->state, sizeof(job->state), TD_JOB_RUNNING);
    store_state(d, job, TD_JOB_RUNNING, job->device_list, NULL);
    td_log_notice("job %lld (%s, uid %lld): running on %s", (long long)job->id, job->spec.name,
                  (long long)job->uid, job->device_list);
    td_run_start(job->run);
    td_server_job_changed(d, job->id, TD_JOB_RUNNING);
}

/* Gives free devices to queued jobs, in scheduling order; a job waits until enough of its
 * devices are free at once (no job jumps ahead of a waiting wider one, so none starves). */
static void schedule(td_daemon *d)
{
    td_djob *job;

    if (d->stopping)
        return;
    while ((job = next_queued(d)) != NULL) {
        td_worker *free_w[TD_MAX_DEVICES];
        int n = 0;
        for (int i = 0; i < d->nworkers && n < job->spec.devices; i++)
            if (d->workers[i].running == NULL)
                free_w[n++] = &d->workers[i];
        if (n < job->spec.devices)
            return;
        if (td_run_new(&job->run, d, job, free_w, n) != 0) {
            td_log_err("job %lld: out of memory starting it; it stays queued", (long long)job->id);
            return;
        }
        dispatch(d, job, free_w, n);
    }
}

static void write_progress(td_daemon *d, td_djob *job)
{
    td_error_t err;

    job->progress_written = mono_ms();
    if (td_store_job_set_progress(d->store, job->id, job->step, job->total_steps, &err) != 0)
        td_log_warn("job %lld: cannot record progress: %s", (long long)job->id, err.msg);
}

static void handle_done(td_daemon *d, td_event *ev)
{
    td_djob *job = td_daemon_find(d, ev->job);

    if (job == NULL)
        return;
    job->step = ev->step > job->step ? ev->step : job->step;
    write_progress(d, job);
    for (int i = 0; i < d->nworkers; i++)
        if (d->workers[i].running == job)
            d->workers[i].running = NULL;
    td_run_free(job->run);
    job->run = NULL;
    job->device_list[0] = '\0';
    if (strcmp(ev->state, TD_JOB_QUEUED) == 0) {
        /* Interrupted by shutdown: back to the queue, resumed at the next start. */
        snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
        store_state(d, job, TD_JOB_QUEUED, "", NULL);
        td_log_notice("job %lld (%s): interrupted at step %lld, requeued", (long long)job->id,
                      job->spec.name, (long long)job->step);
        return;
    }
    store_state(d, job, ev->state, NULL, &ev->err);
    if (ev->devices != NULL) {
        td_error_t err;
        if (td_store_job_set_error_devices(d->store, job->id, ev->devices, ev->devices_len, &err) !=
            0)
            td_log_warn("job %lld: cannot record its device errors: %s", (long long)job->id,
                        err.msg);
    }
    if (ev->err.code != 0 && strcmp(ev->state, TD_JOB_CANCELLED) != 0)
        td_log_warn("job %lld (%s, uid %lld): %s at step %lld: %s", (long long)job->id,
                    job->spec.name, (long long)job->uid, ev->state, (long long)job->step,
                    ev->err.msg);
    else
        td_log_notice("job %lld (%s, uid %lld): %s at step %lld", (long long)job->id,
                      job->spec.name, (long long)job->uid, ev->state, (long long)job->step);
    job_unlink(d, job);
    free(job);
    td_server_job_changed(d, ev->job, ev->state);
}

static void handle_event(td_daemon *d, td_event *ev)
{
    td_djob *job = td_daemon_find(d, ev->job);

    switch (ev->kind) {
    case TD_EV_STARTED:
        if (job != NULL) {
            job->total_steps = ev->total_steps;
            job->step = ev->step;
            write_progress(d, job);
            td_server_job_changed(d, job->id, job->state);
        }
        break;
    case TD_EV_PROGRESS:
        if (job != NULL) {
            atomic_store(&job->progress_pending, 0);
            job->step = atomic_load(&job->live_step);
            if (mono_ms() - job->progress_written >= TD_PROGRESS_WRITE_MS)
                write_progress(d, job);
        }
        break;
    case TD_EV_DURABLE:
        if (job != NULL && ev->step > job->durable_step)
            job->durable_step = ev->step;
        td_server_job_changed(d, ev->job, NULL);
        break;
    case TD_EV_DONE:
        handle_done(d, ev);
        break;
    }
}

static int running_jobs(td_daemon *d)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        n += j->run != NULL;
    return n;
}

static void finish_shutdown(td_daemon *d);

/* Takes every posted event, oldest first; the caller frees them. */
static td_event *take_events(td_daemon *d)
{
    td_event *ev;

    pthread_mutex_lock(&d->ev_mu);
    ev = d->ev_head;
    d->ev_head = d->ev_tail = NULL;
    pthread_mutex_unlock(&d->ev_mu);
    return ev;
}

static void on_async(uv_async_t *h)
{
    td_daemon *d = h->data;
    td_event *ev = take_events(d);

    while (ev != NULL) {
        td_event *next = ev->next;
        handle_event(d, ev);
        event_free(ev);
        ev = next;
    }
    if (d->stopping) {
        if (d->stopping == 1 && running_jobs(d) == 0)
            finish_shutdown(d);
        return;
    }
    schedule(d);
}

/* Brings a queued job from the store back into memory at start. */
int td_daemon_stored_spec(const td_job_row *row, td_jobspec *spec, td_error_t *err)
{
    td_proto_frame *f = NULL;
    int rc;

    if (row->spec == NULL)
        return td_error_set(err, TD_EJOB, "the store holds no spec for job %lld",
                            (long long)row->id);
    rc = td_proto_decode(row->spec, row->spec_len, &f, err);
    if (rc == 0)
        rc = td_jobspec_parse(td_proto_frame_root(f), spec, err);
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
    rc = td_daemon_stored_spec(row, &job->spec, &err);
    if (rc != 0) {
        /* The spec was valid when submitted; a dataset may have gone since. */
        td_log_warn("job %lld: cannot be resumed: %s", (long long)row->id, err.msg);
        td_store_job_set_state(d->store, row->id, TD_JOB_FAILED, NULL, rc, err.msg, NULL);
        free(job);
        return 0;
    }
    job->id = row->id;
    job->uid = row->uid;
    job->step = row->step;
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

int td_daemon_init(td_daemon *d, uv_loop_t *loop, const td_config *cfg, td_error_t *err)
{
    int rc;

    memset(d, 0, sizeof(*d));
    d->cfg = *cfg;
    d->loop = loop;
    pthread_mutex_init(&d->ev_mu, NULL);
    rc = td_store_open(&d->store, cfg->db_path, err);
    if (rc != 0)
        return rc;
    sweep_exports(d);
    rc = load_queue(d, err);
    if (rc != 0)
        goto fail_queue;
    rc = td_mq_start(&d->mq, cfg->db_path, 0, on_durable, d, err);
    if (rc != 0)
        goto fail_queue;
    rc = uv_async_init(loop, &d->async, on_async);
    if (rc != 0) {
        td_error_set(err, rc, "uv_async_init: %s", uv_strerror(rc));
        goto fail_async;
    }
    d->async.data = d;
    rc = workers_start(d, err);
    if (rc != 0)
        goto fail_workers;
    /* Jobs loaded from the store run as soon as the loop turns. */
    uv_async_send(&d->async);
    return 0;

fail_workers:
    workers_stop(d);
    uv_close((uv_handle_t *)&d->async, NULL);
fail_async:
    td_mq_stop(d->mq);
fail_queue:
    td_store_close(d->store);
    return rc;
}

/* Jobs of uid waiting in the queue; uid -2 counts everyone's. */
static int queued_by(td_daemon *d, int64_t uid)
{
    int n = 0;
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        n += (uid == -2 || j->uid == uid) && j->run == NULL;
    return n;
}

int td_daemon_submit(td_daemon *d, const td_pval *jobval, int64_t uid, int64_t gid, int64_t *id,
                     td_error_t *err)
{
    td_djob *job = calloc(1, sizeof(*job));
    const void *body;
    size_t len;
    char *json = NULL;
    td_pw w;
    int rc;

    if (job == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    td_pw_init(&w);
    rc = td_jobspec_parse(jobval, &job->spec, err);
    if (rc == 0)
        rc = td_jobspec_check_access(&job->spec, uid, gid, err);
    if (rc != 0)
        goto out;
    if (job->spec.devices > d->nworkers) {
        rc = td_error_set(err, TD_EJOB,
                          "devices: the job asks for %d devices but this daemon has %d",
                          job->spec.devices, d->nworkers);
        goto out;
    }
    if (d->cfg.max_devices_per_user > 0 && job->spec.devices > d->cfg.max_devices_per_user) {
        rc = td_error_set(err, TD_EPERM,
                          "devices: the job asks for %d devices but each user may hold %d",
                          job->spec.devices, d->cfg.max_devices_per_user);
        goto out;
    }
    if (d->cfg.max_queued > 0 && queued_by(d, -2) >= d->cfg.max_queued) {
        rc = td_error_set(err, TD_EPERM, "the queue is full: %d jobs wait, the limit",
                          d->cfg.max_queued);
        goto out;
    }
    if (d->cfg.max_queued_per_user > 0 && queued_by(d, uid) >= d->cfg.max_queued_per_user) {
        rc = td_error_set(err, TD_EPERM,
                          "permission denied: uid %lld already has %d queued jobs, the limit",
                          (long long)uid, d->cfg.max_queued_per_user);
        goto out;
    }
    td_pw_val(&w, jobval);
    body = td_pw_body(&w, &len);
    json = td_pv_to_json(jobval);
    if (w.failed || json == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "out of memory");
        goto out;
    }
    rc = td_store_job_insert(d->store, job->spec.name, job->spec.devices, job->spec.priority, uid,
                             body, len, json, &job->id, err);
    if (rc != 0)
        goto out;
    job->uid = uid;
    snprintf(job->state, sizeof(job->state), TD_JOB_QUEUED);
    job_append(d, job);
    *id = job->id;
    td_log_notice("job %lld (%s, uid %lld): queued, %d device(s)", (long long)job->id,
                  job->spec.name, (long long)uid, job->spec.devices);
    td_daemon_log(d, job->id, TD_LOG_NOTICE, "queued");
    job = NULL;
    schedule(d);
out:
    free(json);
    td_pw_free(&w);
    free(job);
    return rc;
}

int td_daemon_checkpoint_dir(const td_daemon *d, int64_t job, char *out, size_t size)
{
    if (snprintf(out, size, "%s/checkpoints/%lld", d->cfg.state_dir, (long long)job) >= (int)size)
        return TD_E2BIG;
    return 0;
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
    td_djob *job = td_daemon_find(d, id);
    td_error_t why;
    td_job_row row = {0};
    int rc;

    if (job != NULL && (rc = td_daemon_check_owner(id, job->uid, uid, err)) != 0)
        return rc;
    if (job == NULL) {
        rc = td_store_job_get(d->store, id, &row, err);
        if (rc == 0)
            rc = td_daemon_check_owner(id, row.uid, uid, err);
        if (rc == 0)
            rc = td_error_set(err, TD_ESTATE, "job %lld has already ended (%s)", (long long)id,
                              row.state);
        td_job_row_clear(&row);
        return rc;
    }
    if (job->run != NULL) {
        atomic_store(&job->cancel, 1);
        snprintf(state_out, TD_STORE_MAX_STATE, "%s", TD_JOB_RUNNING);
        td_log_notice("job %lld (%s): cancel requested by uid %lld", (long long)id, job->spec.name,
                      (long long)uid);
        td_daemon_log(d, id, TD_LOG_NOTICE, "cancel requested");
        return 0;
    }
    td_error_set(&why, TD_ECANCELLED, "cancelled while queued");
    store_state(d, job, TD_JOB_CANCELLED, NULL, &why);
    td_log_notice("job %lld (%s): cancelled while queued", (long long)id, job->spec.name);
    job_unlink(d, job);
    free(job);
    snprintf(state_out, TD_STORE_MAX_STATE, "%s", TD_JOB_CANCELLED);
    td_server_job_changed(d, id, TD_JOB_CANCELLED);
    return 0;
}

static void free_jobs(td_daemon *d)
{
    while (d->jobs != NULL) {
        td_djob *next = d->jobs->next;
        free(d->jobs);
        d->jobs = next;
    }
}

static void finish_shutdown(td_daemon *d)
{
    td_event *ev;

    d->stopping = 2;
    td_server_close(d);
    workers_stop(d);
    td_mq_stop(d->mq);
    d->mq = NULL;
    /* Durable notices the store thread posted last have nobody left to tell. */
    ev = take_events(d);
    while (ev != NULL) {
        td_event *next = ev->next;
        event_free(ev);
        ev = next;
    }
    free_jobs(d);
    td_store_close(d->store);
    d->store = NULL;
    uv_close((uv_handle_t *)&d->async, NULL);
    td_log_notice("stopped");
}

/* Stops taking requests, interrupts running jobs (they go back to the queue) and closes
 * everything once the workers have answered. */
void td_daemon_shutdown(td_daemon *d)
{
    if (d->stopping)
        return;
    d->stopping = 1;
    td_log_notice("stopping: %d running job(s) will be requeued", running_jobs(d));
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->run != NULL)
            atomic_store(&j->interrupt, 1);
    uv_async_send(&d->async);
}
