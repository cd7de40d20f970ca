/* What daemon.c shares with daemon_launch.c, the launched jobs' side of the daemon (jobs that
 * span nodes, launch.h): the job table's entry, the daemon itself, and the job table's
 * helpers. Nothing else includes it. Loop thread only. */
#ifndef TD_DAEMON_INT_H
#define TD_DAEMON_INT_H

#include "daemon/daemon.h"
#include "daemon/launch.h"
#include "daemon/mailbox.h"
#include "daemon/run.h"
#include "daemon/writes.h"

struct td_djob_cluster; /* daemon_launch.c */

/* A job the daemon holds in memory: queued or running. Ended jobs live only in the store. */
typedef struct td_djob {
    int64_t id;
    td_jobspec spec;
    int64_t uid;
    char state[TD_STORE_MAX_STATE];
    int64_t step, total_steps;
    int64_t durable_step;       /* highest step the store thread has written */
    double progress_written;    /* monotonic ms when step was last written to the store */
    td_run *run;                /* while running on this box's devices */
    td_launch *launch;          /* while launched: a job that spans nodes */
    struct td_djob_cluster *cl; /* a job that spans nodes: its nodes and restarts */
    char device_list[64];       /* "cpu:0,cpu:1" while running; td_job_row.device_list's size */
    td_error_t metrics_err;     /* some of its metric rows could not be stored: it fails */
    td_error_t final_err;       /* ended, unrecorded: the error its kept state write carries */
    struct td_djob *next;
} td_djob;

struct td_daemon {
    td_config cfg;
    uv_loop_t *loop;
    td_daemon_hooks hooks;
    td_store *store;
    td_mq *mq;
    td_mailbox mailbox;
    td_worker workers[TD_MAX_DEVICES];
    int nworkers;
    td_djob *jobs;        /* queued and running, submission order */
    td_djob *unrecorded;  /* ended, their final state kept in writes until the store takes it */
    td_writes writes;     /* the loop's store writes, kept while the store cannot take them */
    td_purge purge;       /* deleting ended jobs (rm, prune), a slice per loop turn */
    int stopping;         /* 1: jobs are being interrupted; 2: everything is closed */
    atomic_int work_stop; /* set when stopping: a sample running on the threadpool stops early */
    int reexec;           /* a sticky CUDA error: stop, then re-execute (main.c) */
    int discarded;        /* td_daemon_discard: a start abandoned, closed without a word */
    char reexec_why[512]; /* which job, which device, what error */
};

/* daemon.c: the job table */
int td__daemon_running_jobs(const td_daemon *d); /* runs and launches */
void td__daemon_job_changed(td_daemon *d, int64_t job, const char *state);
void td__daemon_job_log(td_daemon *d, int64_t job, int level, const char *line);
int td__daemon_store_state(td_daemon *d, td_djob *job, const char *state, const char *devs,
                           const td_error_t *e);
void td__daemon_write_progress(td_daemon *d, td_djob *job);
void td__daemon_job_unlink(td_daemon *d, td_djob *job);
void td__daemon_job_forget(td_daemon *d, td_djob *job, const char *state, const td_error_t *e,
                           int later);
void td__daemon_job_free(td_djob *job);
/* Some of job's metric rows could not be stored (metricq.h): it stops and fails. */
void td__daemon_store_failed(td_daemon *d, td_djob *job, const td_error_t *e);
/* Stores w's list of failed devices (msgpack, status's error.devices) as job's, and frees w;
 * a failure to is logged, never the job's. */
void td__daemon_store_err_devices(td_daemon *d, int64_t job, td_pw *w);

/* daemon_launch.c: jobs that span nodes */
int td__launch_validate(td_daemon *d, td_jobspec *spec, td_error_t *err);
void td__launch_schedule(td_daemon *d);
/* A job's outcome as its log and the daemon's say it: "failed at step 19: MSG", or
 * "failed: MSG" when MSG names its own step ("loss is NaN at step 20"), so that a line gives
 * one step number; MSG alone when it says the state ("cancelled at step 515"). */
void td__daemon_outcome_line(char *out, size_t size, const char *state, int64_t step,
                             const char *msg);
/* Why queued job, which spans nodes, waits (td_job_live's reason) into out. */
void td__launch_reason(const td_daemon *d, const td_djob *job, char *out, size_t size);
int td__launch_load(td_djob *job, const td_job_row *row);
void td__launch_free(td_djob *job);
int td__launch_job_dir(const td_daemon *d, const td_djob *job, char *out, size_t size);
/* The job's nodes and restarts as status shows them (launch.h's msgpack map); NULL for none.
 * Borrowed until the job changes. */
const void *td__launch_nodes_blob(const td_djob *job, size_t *len);

#endif
