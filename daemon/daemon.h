/* The daemon's core: the job table (queued and running jobs), the scheduler that gives jobs
 * free devices after the memory guard has let them in, the device workers (run.h), the
 * metric store thread (metricq.h) and the mailbox through which both report to the loop
 * (mailbox.h). It answers the requests the server (server.h) turns into calls, and tells
 * whoever runs it, through td_daemon_hooks, that a job changed or that everything has
 * stopped; it never calls the server itself.
 *
 * Threads: every function here runs on the loop thread. Workers and the store thread reach
 * the loop only through the mailbox; a submit's check of its files runs on libuv's threadpool
 * (td_submit_begin) on a copy of its own. */
#ifndef TD_DAEMON_H
#define TD_DAEMON_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/jobspec.h"
#include "daemon/memguard.h"
#include "daemon/metricq.h"
#include "proto/proto.h"
#include "daemon/daemon_purge.h"
#include "store/store.h"

#define TD_PROGRESS_WRITE_MS 1000 /* how often a running job's step is written to the store */

typedef struct td_daemon td_daemon;

/* What the daemon tells the one who runs it (main(), which passes it on to the server). Loop
 * thread; a hook left NULL is not called. */
typedef struct td_daemon_hooks {
    void *ud;
    /* job's state changed (state is the new one) or, with state NULL, rows of its metrics
     * became durable: feed its streams. */
    void (*job_changed)(void *ud, int64_t job, const char *state);
    /* Every job has stopped (after td_daemon_shutdown, or before a re-exec): close the server
     * now; the workers, the store thread and the store close right after. */
    void (*stopped)(void *ud);
} td_daemon_hooks;

/* Opens the store in cfg's state directory, requeues the jobs a dead daemon left running,
 * loads the queue, starts the metric store thread and the device workers (a GPU that cannot
 * be initialised stops the start, naming it), and arranges for the queue to be scheduled
 * once the loop turns. cfg is copied. Every step acquired is released again on failure.
 * Caller frees with td_daemon_free() once the loop has ended. */
int td_daemon_new(td_daemon **out, uv_loop_t *loop, const td_config *cfg, td_error_t *err);
void td_daemon_set_hooks(td_daemon *d, const td_daemon_hooks *hooks); /* copies */

/* Closes a daemon whose start is abandoned (the server could not listen, say) before the loop
 * has run: no job has been dispatched, nothing is logged ("stopping", "stopped"), and the
 * workers, the store thread, the store and the handles close as after a stop. The caller runs
 * the loop once more for the handles' closes, then frees d with td_daemon_free(). */
void td_daemon_discard(td_daemon *d);
void td_daemon_free(td_daemon *d); /* after td_daemon_shutdown's stop and the loop's end */

/* Stops taking jobs and dispatching, interrupts running jobs (they checkpoint and go back to
 * the queue) and closes everything once they have: hooks.stopped, then the workers, the
 * store thread, the store and the mailbox. A shutdown during a re-exec's stop (below) turns
 * it into a plain stop. */
void td_daemon_shutdown(td_daemon *d);

/* After the loop has ended: why the daemon stopped to re-execute itself ("job 3 (x) on cuda:1:
 * ...", a sticky CUDA error; every other job was checkpointed and requeued), or NULL when it
 * stopped for good. */
const char *td_daemon_reexec_why(const td_daemon *d);

/* Set once the daemon is stopping: long work on the threadpool (a sample) reads it and ends
 * early. */
const atomic_int *td_daemon_stop_flag(const td_daemon *d);

/* The store the loop thread reads and writes (the server's replies read it). Borrowed. */
td_store *td_daemon_store(const td_daemon *d);

/* ---- jobs ---- */

/* A submit (or its dry run) under way. Its job is parsed on the loop by td_submit_begin; the
 * job's files are read and checked as its user (uid, gid), and a dry run's memory guard run,
 * on libuv's threadpool, never on the loop (a safetensors header may take a thread tens of
 * milliseconds); then cb(sub, ud) runs on the loop, where td_submit_end (or
 * td_submit_dry_run_end) checks the job against the daemon as it is then and answers it. */
typedef struct td_submit td_submit;
typedef void (*td_submit_cb)(td_submit *sub, void *ud);

/* Parses job (borrowed until it returns; what the store needs of it is copied) and starts the
 * check of its files on the threadpool. 0 with *out set: cb will be called once, on the loop,
 * even while the daemon stops (the loop runs until it has); the callback ends with
 * td_submit_end or td_submit_dry_run_end if it still wants an answer, and frees sub with
 * td_submit_free(). Else the job's error (TD_EJOB naming the field, TD_ENOMEM, TD_EBUSY when
 * the pool refuses work), and cb is never called. */
int td_submit_begin(td_daemon *d, const td_pval *job, int64_t uid, int64_t gid, int dry_run,
                    td_submit_cb cb, void *ud, td_submit **out, td_error_t *err);

/* In cb, for a submit: the files' check's error (TD_EJOB / TD_EPERM naming the field), or the
 * devices against this daemon's and the per-user limit, the queue limits, then the job queued:
 * *id. TD_ECLOSED once the daemon has stopped. */
int td_submit_end(td_submit *sub, int64_t *id, td_error_t *err);

/* In cb, for a dry run: the submit's checks but the queue's, then the memory guard's result,
 * against the devices it would get (their memory read at td_submit_begin). Nothing is stored
 * or queued. *spec (borrowed until td_submit_free) is the job, its batch the guard's choice
 * for "auto"; fills *g and *asked_auto (the job asked for batch_size "auto"). Returns 0 when it
 * fits; TD_ENOMEM with *estimated 1 and *g holding the estimate when it does not (an answer,
 * not an error); any other error with *estimated 0. */
int td_submit_dry_run_end(td_submit *sub, const td_jobspec **spec, td_memguard *g, int *asked_auto,
                          int *estimated, td_error_t *err);

void td_submit_free(td_submit *sub); /* accepts NULL */

/* Cancels job id on behalf of uid (its owner or root; else TD_EPERM): a queued job ends at
 * once, a running one at its next step boundary. The state it is in now goes to state_out
 * (TD_STORE_MAX_STATE bytes). TD_ENOTFOUND, TD_ESTATE for an ended job. */
int td_daemon_cancel(td_daemon *d, int64_t id, int64_t uid, char *state_out, td_error_t *err);

/* Refuses a change to (or a look inside) job by anyone but its owner or root:
 * TD_EPERM, "permission denied: job 12 belongs to alice". */
int td_daemon_check_owner(int64_t job, int64_t owner, int64_t uid, td_error_t *err);

/* What the daemon knows of a job it holds in memory (queued or running) beyond its row. */
typedef struct td_job_live {
    char state[TD_STORE_MAX_STATE];
    int64_t step, total_steps;
    int64_t durable_step; /* the highest step whose rows the store holds */
    int running;
    char device_list[64]; /* "cpu:0,cpu:1" while running */
    td_error_t err;       /* an ended job whose final state the store has not taken yet: the
                           * error that state carries (code 0: none); else zero */
    const void *nodes;    /* a job that spans nodes: {names: [str], restarts: [{time, cause,
                           * nodes}]} in msgpack, as status sends them; NULL for none. Borrowed
                           * until the loop turns */
    size_t nodes_len;
    /* a queued job: why it waits, as squeue's REASON ("devices busy", "priority (behind job
     * 12)", "user's limit (max_devices_per_user 4)", "cluster limit ([cluster] max_running
     * 2)"); empty for any other */
    char reason[64];
} td_job_live;

/* Fills *out for job id and returns 1 when the daemon holds it (queued or running); 0 for an
 * ended or unknown job, whose row in the store says everything. */
int td_daemon_job_live(const td_daemon *d, int64_t id, td_job_live *out);

/* Ids of the queued jobs in the order the scheduler takes them (priority, then submission),
 * the first max of them into ids. Returns how many are queued. */
size_t td_daemon_queued(const td_daemon *d, int64_t *ids, size_t max);

/* Where job's checkpoints live on this box (STATE_DIR/checkpoints/ID), into out: 0; -1 for a
 * job that spans nodes (its checkpoints are on [cluster] shared_dir, not read from the loop)
 * or a path that does not fit. */
int td_daemon_checkpoint_dir(const td_daemon *d, int64_t job, int spans_nodes, char *out,
                             size_t size);

/* The training config of job for uid (its owner or root), for its checkpoints: a queued or
 * running job's own, else its stored spec parsed again without the file checks (an ended
 * job's dataset may be gone), with checkpoint_dir where every run keeps them
 * (STATE_DIR/checkpoints/ID). TD_ENOTFOUND "no job 3"; TD_EPERM; TD_EJOB for a stored spec
 * that no longer validates; TD_EINVAL for a state directory too long. */
int td_daemon_job_config(td_daemon *d, int64_t job, int64_t uid, td_train_config *cfg,
                         td_error_t *err);

/* ---- deleting ended jobs (rm, prune; daemon_purge.h) ---- */

#define TD_PURGE_LIST_MAX 1000 /* jobs an rm or prune reply lists; the totals count them all */

/* What an rm or a prune deletes (or, dry run, would): the first TD_PURGE_LIST_MAX jobs in id
 * order, the totals, and the database's size before. waiting: the done callback will come
 * (the jobs were marked); 0 for a dry run or when nothing matched. Caller frees jobs with
 * td_purge_listing_free(). */
typedef struct td_purge_listing {
    td_job_brief *jobs;
    size_t n;
    td_purge_totals tot;
    int64_t bytes_before;
    int waiting;
} td_purge_listing;
void td_purge_listing_free(td_purge_listing *l);

/* Deletes ended jobs ids[0..n) on behalf of uid (each its owner's or root's), with their
 * metrics, logs and checkpoints: all or none. Refused, naming every job at fault: TD_ENOTFOUND
 * "no job 12", TD_EPERM "permission denied: job 12 belongs to alice", TD_ESTATE "job 12 is
 * running; cancel it first" (or queued; or ended but its state not yet stored); TD_EBUSY when
 * another process locks the store. On success the jobs are gone for every reader at once,
 * *out lists them, and done(ud) comes once their rows are deleted and the space given back
 * (daemon_purge.h), progress(ud) meanwhile. */
int td_daemon_rm(td_daemon *d, const int64_t *ids, size_t n, int64_t uid, td_purge_listing *out,
                 td_purge_done_cb done, td_purge_progress_cb progress, void *ud, td_error_t *err);

/* What a prune deletes: jobs that ended more than older_than_s seconds ago, in one of states
 * (nstates of succeeded, failed, cancelled; 0: all three). */
typedef struct td_prune_args {
    double older_than_s;
    const char *const *states;
    size_t nstates;
    int dry_run;            /* list what would go, delete nothing */
    const td_label *labels; /* nlabels: only jobs with all of them */
    size_t nlabels;
} td_prune_args;

/* prune on behalf of uid: root's touches every user's jobs, anyone else's only their own.
 * As td_daemon_rm once the jobs are selected; with dry_run, or when none matched, nothing is
 * marked and done is never called (out->waiting 0). */
int td_daemon_prune(td_daemon *d, const td_prune_args *a, int64_t uid, td_purge_listing *out,
                    td_purge_done_cb done, td_purge_progress_cb progress, void *ud,
                    td_error_t *err);

/* ---- for operators: the Prometheus file (prom.h) ---- */

/* A running job as the operators' metrics show it. name is borrowed until the next loop turn. */
typedef struct td_running_view {
    int64_t id, uid, step, total_steps;
    const char *name;
} td_running_view;

/* The running jobs, the first max of them into out (id order); returns how many run. */
size_t td_daemon_running(const td_daemon *d, td_running_view *out, size_t max);

/* Jobs per state (store.h's order): queued and running as the daemon holds them, the ended
 * states as the store counts them (jobs being deleted left out). A read that never waits; on
 * failure the store's counts are left as they were and its error returned. */
int td_daemon_job_counts(td_daemon *d, int64_t counts[TD_STORE_NSTATES], td_error_t *err);

/* The metric queue's counters (metricq.h td_mq_stats); zeros once it has stopped. */
void td_daemon_metric_stats(const td_daemon *d, td_mq_stats_t *out);

/* ---- devices ---- */

int td_daemon_ndevices(const td_daemon *d);

/* Device i as info shows it. name and job_name are borrowed until the next loop turn. */
typedef struct td_device_view {
    const char *name; /* "cpu:0" */
    td_device_kind kind;
    int64_t job;          /* the job it trains, 0 when idle */
    const char *job_name; /* that job's name, NULL when idle */
} td_device_view;
void td_daemon_device(const td_daemon *d, int i, td_device_view *out);

/* Free and total bytes of device i (train/device.h td_device_memory). */
int td_daemon_device_memory(const td_daemon *d, int i, size_t *free_bytes, size_t *total_bytes,
                            td_error_t *err);

/* The watchdog's health check (run.h td_workers_fresh). */
int td_daemon_workers_fresh(const td_daemon *d, int64_t stale_ms, char *why, size_t size);

#endif
