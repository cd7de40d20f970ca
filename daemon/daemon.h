/* traind's inside: the shared state of the loop thread, the device workers and the store
 * thread, and the functions the daemon's files call across each other. Not a public API.
 *
 * Threads (DESIGN.md): the loop thread owns every libuv handle, the job table and the loop's
 * store connection; a worker thread per device trains one job at a time; the store thread
 * (metricq.c) writes metric batches. Workers and the store thread reach the loop only through
 * td_daemon_post(), a mutex-protected list drained by one uv_async_t. */
#ifndef TD_DAEMON_H
#define TD_DAEMON_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "jobspec.h"
#include "kernels.h"
#include "metricq.h"
#include "proto.h"
#include "store.h"

#define TD_MAX_DEVICES       64          /* devices one daemon drives */
#define TD_MAX_CONNS         1024        /* connections open at once; more are closed at accept */
#define TD_CONN_HIGH_WATER   (256 << 10) /* bytes queued to a client before its streams pause */
#define TD_CONN_LOW_WATER    (64 << 10)  /* bytes queued below which paused streams resume */
#define TD_STREAM_PAGE       512         /* metric rows per rows frame */
#define TD_PROGRESS_WRITE_MS 1000 /* how often a running job's step is written to the store */

typedef struct td_daemon td_daemon;
typedef struct td_worker td_worker;
struct td_cuda_ctx; /* kernels/cuda/td_cuda.h, in builds with CUDA */

/* The kind of a daemon's devices (all of one kind: --devices cpu:N or cuda:...). */
typedef enum { TD_DEV_CPU = 0, TD_DEV_CUDA = 1 } td_dev_kind;
typedef struct td_run td_run;
typedef struct td_conn td_conn;

/* A job the daemon holds in memory: queued or running. Ended jobs live only in the store. */
typedef struct td_djob {
    int64_t id;
    td_jobspec spec;
    int64_t uid;
    char state[TD_STORE_MAX_STATE];
    int64_t step, total_steps;
    int64_t durable_step;        /* highest step the store thread has written */
    double progress_written;     /* monotonic ms when step was last written to the store */
    atomic_int cancel;           /* set by the loop: stop at the next step boundary */
    atomic_int interrupt;        /* set by the loop at shutdown: stop and go back to the queue */
    atomic_llong live_step;      /* set by rank 0's worker after each step */
    atomic_int progress_pending; /* a PROGRESS event is posted and not yet handled */
    td_run *run;                 /* while running */
    char device_list[64];        /* "cpu:0,cpu:1" while running; td_job_row.device_list's size */
    struct td_djob *next;
} td_djob;

/* A device and the thread that trains on it. */
struct td_worker {
    td_daemon *d;
    int index;               /* in d->workers */
    td_dev_kind kind;        /* the daemon's */
    int device;              /* the device's number: cpu:N's N (= index), cuda:N's CUDA ordinal */
    char name[16];           /* "cpu:0", "cuda:1" */
    int threads;             /* BLAS threads for jobs on this device */
    struct td_cuda_ctx *ctx; /* cuda: the worker thread's context, made and bound by the thread
                              * when it starts, kept bound, freed when it ends */
    int init_done;           /* guarded by mu: the thread has made its context (or failed) */
    td_error_t init_err;     /* guarded by mu: why it failed */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    td_run *assigned;          /* guarded by mu; set by the loop, taken by the worker */
    int rank;                  /* guarded by mu: the worker's replica in assigned */
    int stop;                  /* guarded by mu */
    td_djob *running;          /* loop thread's view */
    atomic_llong heartbeat_ms; /* CLOCK_MONOTONIC ms at the last step start or end */
};

/* What workers and the store thread tell the loop. */
typedef enum {
    TD_EV_STARTED,  /* job began training: total_steps known */
    TD_EV_PROGRESS, /* job finished a step: read job->live_step */
    TD_EV_DURABLE,  /* the store holds job's rows up to step */
    TD_EV_DONE,     /* job ended (state, error); its metrics are flushed */
} td_event_kind;

typedef struct td_event {
    td_event_kind kind;
    int64_t job;
    int64_t step, total_steps;
    char state[TD_STORE_MAX_STATE];
    td_error_t err;
    int sticky;    /* DONE of a failed job: a replica met a sticky CUDA error (or had one
                    * injected): the process's CUDA state is lost, the daemon re-executes */
    void *devices; /* DONE of a failed job: malloc'd msgpack list of failed devices */
    size_t devices_len;
    struct td_event *next;
} td_event;

typedef struct td_config {
    char socket_path[108];
    char state_dir[512];
    char db_path[600];
    td_dev_kind dev_kind;             /* --devices: cpu:N or cuda:... */
    int ncpu_devices;                 /* cpu:N's N */
    int cuda_all;                     /* cuda:all: every GPU the process sees, found at start */
    int cuda_devices[TD_MAX_DEVICES]; /* cuda:0,1: the CUDA ordinals, ascending */
    int ncuda_devices;
    double nccl_timeout_s;    /* [cuda] nccl_timeout_s: a job's collectives, unless the job says */
    int max_queued_per_user;  /* queued jobs one uid may have; 0 = unlimited */
    int max_devices_per_user; /* devices one uid's running jobs may hold; 0 = unlimited */
    int max_conns;            /* connections open at once, at most; default TD_MAX_CONNS */
    int max_queued;           /* queued jobs of all users together; 0 = unlimited */
    int log_level;            /* TD_LOG_ERR .. TD_LOG_DEBUG (td_log.h) */
    char socket_group[64];    /* the group given the socket it binds; "" = the daemon's own */
    int64_t socket_gid;       /* socket_group's gid, or -1 */
} td_config;

struct td_daemon {
    td_config cfg;
    uv_loop_t *loop;
    uv_pipe_t server;
    uv_async_t async;
    uv_signal_t sigint, sigterm;
    td_store *store;
    td_mq *mq;
    td_worker workers[TD_MAX_DEVICES];
    int nworkers;
    td_djob *jobs; /* queued and running, submission order */
    td_conn *conns;
    int nconns;
    pthread_mutex_t ev_mu;
    td_event *ev_head, *ev_tail;
    int stopping;
    atomic_int work_stop; /* set when stopping: a sample running on the threadpool stops early */
    int exit_code;
    int server_open;      /* server is initialised and not yet closed */
    int socket_inherited; /* server came from systemd (LISTEN_FDS): its path is not ours */
    td_dev_kind dev_kind; /* the kind of every worker */
    int signals_open;     /* sigint and sigterm are started (main.c) and not yet closed */
    int reexec;           /* a sticky CUDA error: stop, then re-execute (td_daemon_reexec) */
    char reexec_why[512]; /* which job, which device, what error */
    int reexec_fd;        /* a copy of the inherited listening socket kept for the new
                           * process while the server closes its own; -1 when none */
};

/* daemon.c: jobs, scheduler, workers, events. */
int td_daemon_init(td_daemon *d, uv_loop_t *loop, const td_config *cfg, td_error_t *err);
void td_daemon_post(td_daemon *d, td_event *ev);         /* any thread; takes ev */
td_event *td_event_new(td_event_kind kind, int64_t job); /* any thread; aborts on ENOMEM */
/* Checks a submitted job as submit does before queueing it: the job file (jobspec), the
 * files' access as the user (uid, gid), its device count against this daemon's and the
 * per-user limit. Fills *spec. TD_EJOB / TD_EPERM with err naming the field. */
int td_daemon_validate(td_daemon *d, const td_pval *job, int64_t uid, int64_t gid, td_jobspec *spec,
                       td_error_t *err);
/* Validates and queues a job for the user (uid, gid) who sent it. */
int td_daemon_submit(td_daemon *d, const td_pval *job, int64_t uid, int64_t gid, int64_t *id,
                     td_error_t *err);
/* Cancels job id on behalf of uid (its owner or root; else TD_EPERM). */
int td_daemon_cancel(td_daemon *d, int64_t id, int64_t uid, char *state_out, td_error_t *err);
/* Refuses a change to (or a look inside) job by anyone but its owner or root:
 * TD_EPERM, "permission denied: job 12 belongs to alice". */
int td_daemon_check_owner(int64_t job, int64_t owner, int64_t uid, td_error_t *err);
/* Where job's checkpoints live: STATE_DIR/checkpoints/JOB. TD_E2BIG when it does not fit. */
int td_daemon_checkpoint_dir(const td_daemon *d, int64_t job, char *out, size_t size);
/* Parses a job's stored spec (row->spec, msgpack) again, with the checks of submit; files 0
 * leaves out the checks that its files are readable (export and sample need only the
 * configuration, and an ended job's dataset may be gone), 1 keeps them (a queued job about to
 * run). */
int td_daemon_stored_spec(const td_job_row *row, int files, td_jobspec *spec, td_error_t *err);
/* Appends a line to a job's log in the store (lifecycle events, warnings). */
void td_daemon_log(td_daemon *d, int64_t job, int level, const char *line);
td_djob *td_daemon_find(td_daemon *d, int64_t id);
/* Stops taking requests and dispatching, interrupts running jobs (they checkpoint and go back
 * to the queue) and closes everything once they have. A shutdown during a re-exec's stop
 * (below) turns it into a plain stop. */
void td_daemon_shutdown(td_daemon *d);
/* After the loop has ended with d->reexec set (a job met a sticky CUDA error, and every other
 * job was checkpointed and requeued): replaces the process with a fresh traind, the same pid,
 * executing /proc/self/exe with argv (main's original). Every descriptor but 0-2 is closed
 * on exec, except the listening socket systemd passed (LISTEN_FDS), which is put back on
 * descriptor 3 for the new process to take again. Returns only on failure: -errno, logged. */
int td_daemon_reexec(td_daemon *d, char *const argv[]);

/* daemon.c: the memory a job would have on worker index's device, for the memory guard and
 * submit --dry-run: cuda, cudaMemGetInfo's free and total bytes of the GPU; cpu,
 * MemAvailable and MemTotal of /proc/meminfo (shared by every cpu device). Loop thread.
 * TD_ECUDA / TD_EIO with err saying why. */
int td_daemon_device_memory(td_daemon *d, int index, size_t *free_bytes, size_t *total_bytes,
                            td_error_t *err);
/* The backend table jobs on w compute with: the CUDA one on a cuda device, else the CPU's. */
const td_kernels *td_daemon_kernels(const td_worker *w);
/* The least free memory among workers ws[0..n) as a job on all of them would have it (a cpu:
 * device's share is MemAvailable over n, since they share the machine's memory; a GPU's is
 * cudaMemGetInfo's free, plus the worker's context that the estimate counts again, less 1 GiB
 * kept for NCCL's buffers and lazily loaded kernels), that
 * device's total, and its name (borrowed from the worker). Errors as td_daemon_device_memory. */
int td_daemon_least_memory(td_daemon *d, td_worker *const *ws, int n, size_t *free_bytes,
                           size_t *total_bytes, const char **name, td_error_t *err);

/* server.c: the control socket, connections, requests, streams. */
int td_server_listen(td_daemon *d, td_error_t *err);
void td_server_close(td_daemon *d);
/* Feeds every stream of job with newly durable rows, or its end when the job has ended. */
void td_server_job_changed(td_daemon *d, int64_t job, const char *state);

#endif
