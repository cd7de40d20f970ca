/* The daemon's job table, scheduler and device workers. Everything here runs on the loop
 * thread; the workers' side is in run.c and reaches the loop only through td_daemon_post(). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
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
#include "memguard.h"
#include "run.h"
#include "td_clock.h"
#include "td_log.h"
#include "td_panic.h"
#ifdef TD_HAVE_CUDA
#include "td_cuda.h"
#endif

#define MIB (1024.0 * 1024.0) /* bytes */

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

/* The devices of --devices: fills the workers' kind, number and name; sets d->nworkers to
 * how many there will be. cuda:all asks CUDA how many GPUs the process sees; a GPU named
 * that it does not see stops the start. */
static int workers_plan(td_daemon *d, td_error_t *err)
{
    const td_config *cfg = &d->cfg;
    int n = 0, devs[TD_MAX_DEVICES];

    d->dev_kind = cfg->dev_kind;
    if (cfg->dev_kind == TD_DEV_CPU) {
        n = cfg->ncpu_devices;
        for (int i = 0; i < n; i++)
            devs[i] = i;
    } else {
#ifdef TD_HAVE_CUDA
        int seen = 0, rc = td_cuda_device_count(&seen);
        if (rc != 0)
            return td_error_set(err, rc,
                                "--devices cuda: cannot count the GPUs: the CUDA runtime "
                                "failed (is the NVIDIA driver loaded?)");
        if (seen == 0)
            return td_error_set(err, TD_ECUDA,
                                "--devices %s: no CUDA device is visible to this process (no "
                                "GPU, no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them all)",
                                cfg->cuda_all ? "cuda:all" : "cuda:N");
        if (cfg->cuda_all) {
            n = seen < TD_MAX_DEVICES ? seen : TD_MAX_DEVICES;
            for (int i = 0; i < n; i++)
                devs[i] = i;
        } else {
            n = cfg->ncuda_devices;
            for (int i = 0; i < n; i++) {
                devs[i] = cfg->cuda_devices[i];
                if (devs[i] >= seen)
                    return td_error_set(err, TD_ECUDA,
                                        "--devices: there is no cuda:%d; this process sees %d "
                                        "GPU(s), cuda:0 to cuda:%d",
                                        devs[i], seen, seen - 1);
            }
        }
#else
        return td_error_set(err, TD_EINVAL, "this traind was built without CUDA");
#endif
    }
    for (int i = 0; i < n; i++) {
        td_worker *w = &d->workers[i];
        w->d = d;
        w->index = i;
        w->kind = d->dev_kind;
        w->device = devs[i];
        snprintf(w->name, sizeof(w->name), "%s:%d", w->kind == TD_DEV_CUDA ? "cuda" : "cpu",
                 w->device);
    }
    return n;
}

/* Waits until worker w's thread has made its CUDA context, or failed to. */
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

static int workers_start(td_daemon *d, td_error_t *err)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n = workers_plan(d, err), per;

    if (n < 0)
        return n;
    per = d->dev_kind == TD_DEV_CPU ? (int)(cores > 0 ? cores : 1) / n : 0;
    for (int i = 0; i < n; i++) {
        td_worker *w = &d->workers[i];
        int rc;
        w->threads = per > 0 ? per : 1;
        pthread_mutex_init(&w->mu, NULL);
        pthread_cond_init(&w->cv, NULL);
        rc = pthread_create(&w->thread, NULL, td_worker_main, w);
        if (rc != 0) {
            pthread_cond_destroy(&w->cv);
            pthread_mutex_destroy(&w->mu);
            return td_error_set(err, -rc, "cannot start worker %s: %s", w->name, strerror(rc));
        }
        d->nworkers++;
        /* A GPU that cannot be initialised stops the start, naming it: a daemon that
         * silently drives fewer GPUs than configured would queue jobs that never fit. */
        rc = worker_wait_init(w, err);
        if (rc != 0)
            return rc;
        if (per > 0)
            pin_worker(w, per, cores);
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

/* MemAvailable and MemTotal of /proc/meminfo, in bytes. */
static int meminfo(size_t *avail, size_t *total, td_error_t *err)
{
    FILE *f = fopen("/proc/meminfo", "re");
    char line[256];
    unsigned long long kb;
    int got = 0;

    if (f == NULL)
        return td_error_set(err, TD_EIO, "cannot open /proc/meminfo: %s", strerror(errno));
    while (got != 3 && fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
            *avail = (size_t)kb * 1024;
            got |= 1;
        } else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) {
            *total = (size_t)kb * 1024;
            got |= 2;
        }
    }
    fclose(f);
    if (got != 3)
        return td_error_set(err, TD_EIO, "/proc/meminfo has no MemAvailable or MemTotal");
    return 0;
}

int td_daemon_device_memory(td_daemon *d, int index, size_t *free_bytes, size_t *total_bytes,
                            td_error_t *err)
{
    *free_bytes = *total_bytes = 0;
    if (index < 0 || index >= d->nworkers)
        return td_error_set(err, TD_EINVAL, "no device %d", index);
    if (d->workers[index].kind == TD_DEV_CPU)
        return meminfo(free_bytes, total_bytes, err);
#ifdef TD_HAVE_CUDA
    return td_cuda_mem_info(d->workers[index].device, free_bytes, total_bytes, err);
#else
    return td_error_set(err, TD_EINVAL, "this traind was built without CUDA");
#endif
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

/* Ends a job that never ran, or ran and is over, here on the loop thread: records state
 * with err, and forgets it. */
static void job_end(td_daemon *d, td_djob *job, const char *state, const td_error_t *e)
{
    int64_t id = job->id;

    store_state(d, job, state, NULL, e);
    job_unlink(d, job);
    free(job);
    td_server_job_changed(d, id, state);
}

/* Stores the batch the memory guard chose for a batch_size "auto" job in its spec, so that a
 * restart (or a re-exec) resumes it with the same batch. */
/* Replaces job id's stored spec with blob, and its JSON rendering (status --json, the SQLite
 * file's jobs.spec_json) with blob's. */
static int store_spec(td_daemon *d, int64_t id, const void *blob, size_t len, td_error_t *err)
{
    td_proto_frame *f = NULL;
    char *json = NULL;
    int rc = td_proto_decode(blob, len, &f, err);

    if (rc == 0 && (json = td_pv_to_json(td_proto_frame_root(f))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for the job's JSON");
    if (rc == 0)
        rc = td_store_job_set_spec_json(d->store, id, blob, len, json, err);
    free(json);
    td_proto_frame_free(f);
    return rc;
}

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
    td_daemon_log(d, job->id, TD_LOG_NOTICE, line);
    td_log_notice("job %lld (%s): %s", (long long)job->id, job->spec.name, line);
}

const td_kernels *td_daemon_kernels(const td_worker *w)
{
#ifdef TD_HAVE_CUDA
    if (w->kind == TD_DEV_CUDA)
        return td_kernels_cuda();
#endif
    (void)w;
    return td_kernels_cpu();
}

/* What a job can have of a GPU whose cudaMemGetInfo says free: plus the worker's own context
 * (already allocated, and counted again in the estimate's workspace), less a reserve for what
 * is allocated outside the estimate once the job runs: NCCL's buffers (hundreds of MiB per
 * rank), kernels cuBLAS and the runtime load lazily on first use. */
#define GPU_RESERVE ((size_t)1 << 30) /* bytes */
static size_t gpu_usable(size_t free_bytes)
{
#ifdef TD_HAVE_CUDA
    free_bytes += (size_t)TD_CUDA_CUBLAS_WORKSPACE + TD_CUDA_SCRATCH_DEFAULT + TD_CUDA_CTX_FIXED;
#endif
    return free_bytes > GPU_RESERVE ? free_bytes - GPU_RESERVE : 0;
}

int td_daemon_least_memory(td_daemon *d, td_worker *const *ws, int n, size_t *free_bytes,
                           size_t *total_bytes, const char **name, td_error_t *err)
{
    for (int i = 0; i < n; i++) {
        size_t f = 0, t = 0;
        int rc = td_daemon_device_memory(d, ws[i]->index, &f, &t, err);
        if (rc != 0)
            return rc;
        if (ws[i]->kind == TD_DEV_CPU)
            f /= (size_t)n;
        else
            f = gpu_usable(f);
        if (i == 0 || f < *free_bytes) {
            *free_bytes = f;
            *total_bytes = t;
            *name = ws[i]->name;
        }
        /* cpu: devices share the machine's memory: one reading answers for all of them */
        if (ws[i]->kind == TD_DEV_CPU)
            break;
    }
    return 0;
}

/* The memory guard at dispatch (DESIGN.md: "Before a job starts on a device"): the job's
 * estimate on one device against the least free memory among the n workers it would get
 * (a cpu: device's share is MemAvailable over the job's devices, since they share the
 * machine's memory). A batch_size "auto" job takes the largest batch that fits, and keeps it.
 * Returns 0 to dispatch; otherwise the job has ended failed here with the guard's numbers. */
static int guard_memory(td_daemon *d, td_djob *job, td_worker **ws, int n)
{
    size_t least = 0, total = 0;
    const char *where = ws[0]->name;
    td_jobspec spec = job->spec;
    td_memguard g;
    td_error_t err = {0};
    int rc;

    rc = td_daemon_least_memory(d, ws, n, &least, &total, &where, &err);
    if (rc != 0)
        goto refuse;
    spec.train.kernels = td_daemon_kernels(ws[0]); /* the CUDA workspace counts on a GPU */
    spec.train.world = n;
    rc = td_memguard_check(&spec, least, total, where, &g, &err);
    if (rc != 0)
        goto refuse;
    if (job->spec.batch_auto) {
        job->spec.train.batch_size = spec.train.batch_size;
        job->spec.batch_auto = 0;
        store_batch(d, job, &g);
    }
    return 0;

refuse:
    td_log_warn("job %lld (%s, uid %lld): refused at dispatch: %s", (long long)job->id,
                job->spec.name, (long long)job->uid, err.msg);
    job_end(d, job, TD_JOB_FAILED, &err);
    return rc;
}

/* Gives free devices to queued jobs, in scheduling order; a job waits until enough of its
 * devices are free at once (no job jumps ahead of a waiting wider one, so none starves). A
 * job the memory guard refuses ends there, and the next one is looked at. */
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
        if (guard_memory(d, job, free_w, n) != 0)
            continue;
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

    job->progress_written = td_mono_ms();
    if (td_store_job_set_progress(d->store, job->id, job->step, job->total_steps, &err) != 0)
        td_log_warn("job %lld: cannot record progress: %s", (long long)job->id, err.msg);
}

static int running_jobs(td_daemon *d);
static void stop_jobs(td_daemon *d);

/* A job met a sticky CUDA error (DESIGN.md, "Failures"): the process's CUDA state is lost
 * and no job may be served from it again. The job has failed with its own message; every
 * other running job is interrupted (it checkpoints and goes back to the queue), nothing new
 * is dispatched, and once nothing runs the loop ends and main() re-executes traind, whose
 * start resumes the queue. */
static void begin_reexec(td_daemon *d, const td_djob *job, const char *devs, const td_error_t *e)
{
    if (d->stopping)
        return;
    d->reexec = 1;
    snprintf(d->reexec_why, sizeof(d->reexec_why), "job %lld (%.100s) on %.64s: %.300s",
             (long long)job->id, job->spec.name, devs, e->msg);
    td_log_err("sticky CUDA error in %s", d->reexec_why);
    td_log_err("the process's CUDA state is lost: no more jobs start here; %d running job(s) "
               "will checkpoint and be requeued, then traind re-executes itself",
               running_jobs(d));
    stop_jobs(d);
}

static void handle_done(td_daemon *d, td_event *ev)
{
    td_djob *job = td_daemon_find(d, ev->job);
    char devs[sizeof(job->device_list)];

    if (job == NULL)
        return;
    memcpy(devs, job->device_list, sizeof(devs));
    job->step = ev->step > job->step ? ev->step : job->step;
    write_progress(d, job);
    for (int i = 0; i < d->nworkers; i++)
        if (d->workers[i].running == job)
            d->workers[i].running = NULL;
    td_run_free(job->run);
    job->run = NULL;
    job->device_list[0] = '\0';
    if (ev->sticky && d->reexec) {
        /* Another job already met the sticky error: this one's CUDA error is the lost state
         * showing through, not its own fault. It resumes from its last checkpoint after the
         * re-exec, like the jobs the stop interrupted. */
        td_log_warn("job %lld (%s): %s; the process's CUDA state was already lost: requeued",
                    (long long)job->id, job->spec.name, ev->err.msg);
        snprintf(ev->state, sizeof(ev->state), TD_JOB_QUEUED);
    }
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
    if (ev->sticky)
        begin_reexec(d, job, devs, &ev->err);
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
            if (td_mono_ms() - job->progress_written >= TD_PROGRESS_WRITE_MS)
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

int td_daemon_stored_spec(const td_job_row *row, int files, td_jobspec *spec, td_error_t *err)
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
    rc = td_daemon_stored_spec(row, 1, &job->spec, &err);
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
    d->reexec_fd = -1;
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

int td_daemon_validate(td_daemon *d, const td_pval *jobval, int64_t uid, int64_t gid,
                       td_jobspec *spec, td_error_t *err)
{
    int rc;

    if ((rc = td_jobspec_parse(jobval, spec, err)) != 0 ||
        (rc = td_jobspec_check_access(spec, uid, gid, err)) != 0)
        return rc;
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
    rc = td_daemon_validate(d, jobval, uid, gid, &job->spec, err);
    if (rc != 0)
        goto out;
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

/* Keeps a copy of the listening socket systemd passed, for the process a re-exec starts:
 * the server's close closes descriptor 3 itself. */
static void keep_inherited_socket(td_daemon *d)
{
    uv_os_fd_t fd = -1;

    d->reexec_fd = -1;
    if (!d->reexec || !d->socket_inherited || !d->server_open)
        return;
    if (uv_fileno((uv_handle_t *)&d->server, &fd) == 0)
        d->reexec_fd = fcntl(fd, F_DUPFD_CLOEXEC, 10);
    if (d->reexec_fd < 0)
        td_log_err("cannot keep the socket systemd passed for the re-exec: %s; systemd's "
                   "socket unit still holds it",
                   strerror(errno));
}

static void finish_shutdown(td_daemon *d)
{
    td_event *ev;

    d->stopping = 2;
    keep_inherited_socket(d);
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
    /* A re-exec ends the loop without a signal: the signal handles must go too. */
    if (d->signals_open) {
        uv_close((uv_handle_t *)&d->sigint, NULL);
        uv_close((uv_handle_t *)&d->sigterm, NULL);
        d->signals_open = 0;
    }
    td_log_notice(d->reexec ? "stopped for the re-exec" : "stopped");
}

/* Interrupts every running job: each checkpoints at its next step boundary and is requeued.
 * Nothing is dispatched from now on. */
static void stop_jobs(td_daemon *d)
{
    d->stopping = 1;
    atomic_store(&d->work_stop, 1);
    for (td_djob *j = d->jobs; j != NULL; j = j->next)
        if (j->run != NULL)
            atomic_store(&j->interrupt, 1);
    uv_async_send(&d->async);
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
    td_log_notice("stopping: %d running job(s) will be requeued", running_jobs(d));
    stop_jobs(d);
}

/* Marks every descriptor from 3 up close-on-exec but keep (-1: none). */
static void cloexec_all_but(int keep)
{
    DIR *dir = opendir("/proc/self/fd");
    struct dirent *e;

    if (dir == NULL) {
        /* No /proc: the descriptors traind opens itself are close-on-exec already. */
        td_log_warn("cannot list /proc/self/fd: %s", strerror(errno));
        return;
    }
    while ((e = readdir(dir)) != NULL) {
        int fd = atoi(e->d_name);
        if (fd > 2 && fd != keep && fd != dirfd(dir))
            (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    closedir(dir);
}

int td_daemon_reexec(td_daemon *d, char *const argv[])
{
    int keep = -1;

    if (d->reexec_fd >= 0) {
        /* sd_listen_fds(3): the passed socket is descriptor 3; LISTEN_PID (this pid, which
         * exec keeps) and LISTEN_FDS are still set, so the new process takes it again. */
        if (dup2(d->reexec_fd, 3) == 3) {
            keep = 3;
            if (d->reexec_fd != 3)
                close(d->reexec_fd);
        } else {
            td_log_err("cannot put the socket systemd passed back on descriptor 3: %s",
                       strerror(errno));
        }
        d->reexec_fd = -1;
    }
    /* CUDA, NCCL and the libraries below them may hold descriptors opened without
     * close-on-exec (/dev/nvidia*, sockets): none may leak into the new process. */
    cloexec_all_but(keep);
    td_log_notice("re-executing traind (same pid %ld) after a sticky CUDA error in %s",
                  (long)getpid(), d->reexec_why);
    execv("/proc/self/exe", argv);
    keep = errno;
    td_log_err("cannot re-execute /proc/self/exe: %s", strerror(keep));
    return -keep;
}
