/* Device workers and the runs they train. A worker is a device and the thread that trains on
 * it: the thread opens the device (train/device.h), then waits for runs. A run is one
 * dispatch of a job, shared by its devices' workers (one replica each, rank = position in
 * device order): the all-reduce group through which the replicas agree, every step, whether
 * to go on, stop for a cancel, or stop for a shutdown, and each replica's outcome, so that
 * the last worker to finish posts one DONE event.
 *
 * A run knows nothing of the daemon: it is given the job's spec, its workers, the mailbox it
 * posts to, the metric queue rank 0 records into, and its collectives' timeout.
 *
 * Threads: the loop thread starts and stops the workers, creates a run (td_run_new), hands it
 * to the workers (td_run_start), raises its flags (td_run_cancel, td_run_interrupt), reads its
 * progress and, once the DONE event has arrived, its failures, and frees it (td_run_free).
 * The workers touch a run from td_run_start until each has counted itself finished. */
#ifndef TD_RUN_H
#define TD_RUN_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "train/device.h"
#include "daemon/jobspec.h"
#include "daemon/mailbox.h"
#include "daemon/metricq.h"

typedef struct td_run td_run;

/* A device and the thread that trains on it. The caller fills index, kind, device and name
 * before td_workers_start(); the rest is the workers' own. */
typedef struct td_worker {
    int index;           /* in the daemon's array of workers */
    td_device_kind kind; /* every worker of a daemon is of one kind */
    int device;          /* the device's number: cpu:N's N (= index), cuda:N's CUDA ordinal */
    char name[16];       /* "cpu:0", "cuda:1" */
    int threads;         /* BLAS threads for jobs on this device */
    td_device *dev;      /* opened by the worker thread when it starts, closed when it ends */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int init_done;             /* guarded by mu: the thread has opened its device (or failed) */
    td_error_t init_err;       /* guarded by mu: why it failed */
    td_run *assigned;          /* guarded by mu; set by the loop, taken by the worker */
    int rank;                  /* guarded by mu: the worker's replica in assigned */
    int stop;                  /* guarded by mu */
    int64_t running;           /* loop thread's view: the job it trains, 0 when idle */
    atomic_llong heartbeat_ms; /* CLOCK_MONOTONIC ms at the last step start or end */
} td_worker;

/* Starts a thread for each of the n workers and waits until it has opened its device. cpu
 * workers get an equal share of the cores, each pinned to its own when the devices divide
 * them (so two cpu devices never fight over a core); a refusal to pin is logged and ignored.
 * A device that cannot be opened stops the start, naming it ("cannot initialise cuda:1:
 * ..."): a daemon that silently drives fewer GPUs than configured would queue jobs that never
 * fit. Then the workers already started are stopped again. */
int td_workers_start(td_worker *ws, int n, td_error_t *err);

/* Stops and joins the n workers' threads (each finishes its replica first: runs must have
 * been stopped). Accepts n = 0. */
void td_workers_stop(td_worker *ws, int n);

/* The watchdog's health check: 1 when every busy worker started or ended a step within
 * stale_ms; otherwise 0 and why says which device and job did not. */
int td_workers_fresh(const td_worker *ws, int n, int64_t stale_ms, char *why, size_t size);

/* Where rank 0's metric samples go when a run has no metric queue (`traind rank` writing them
 * on its stream). Called on rank 0's worker thread; an error fails the job as a store error
 * does. */
typedef int (*td_run_metric_fn)(void *ud, const char *key, int64_t step, double value,
                                td_error_t *err);

/* What a run is made of. Borrowed until td_run_free: spec and mq; workers is copied. */
typedef struct td_run_args {
    int64_t job;               /* for the events and the logs */
    const td_jobspec *spec;    /* the job's validated spec, checkpoint_dir set */
    td_worker *const *workers; /* in device order: rank i trains on workers[i] */
    int world;                 /* how many */
    td_mailbox *mailbox;       /* where STARTED, PROGRESS, DONE and STORE_FAILED go */
    td_mq *mq;                 /* the metric queue rank 0 records into, or NULL: metric */
    td_run_metric_fn metric;   /* when mq is NULL */
    /* when mq is NULL: before each checkpoint, on rank 0's worker, writes out every sample
     * metric has taken (td_train_hooks.flush); NULL when metric does not hold samples back */
    void (*flush)(void *metric_ud);
    void *metric_ud;
    double nccl_timeout_s; /* the job's collectives' timeout, resolved */
    /* seconds a checkpoint that meets a full disk waits for room before the job fails
     * ([metrics] disk_full_wait_s); 0: it fails at once */
    double disk_full_wait_s;
    /* A run over the processes of an MPI world (`traind rank`): every process makes its run
     * with its own workers (the same number everywhere), the group spans them, and global rank
     * 0 (process 0's rank 0) records, checkpoints and reports. td_run_new is then collective. */
    int spanning;
} td_run_args;

/* A run of a job on its workers, not yet started, with its STARTED, DONE and STORE_FAILED
 * events reserved, so that no later allocation can lose them (mailbox.h). TD_ENOMEM. Caller
 * frees with td_run_free() after the DONE event (or at once, if never started). */
int td_run_new(td_run **out, const td_run_args *a, td_error_t *err);

/* Wakes the run's workers. */
void td_run_start(td_run *r);

/* Asks the run to stop at its next step boundary: cancel (the job ends cancelled) or
 * interrupt (a shutdown or a re-exec: the job goes back to the queue). Rank 0 checkpoints
 * first. */
void td_run_cancel(td_run *r);
void td_run_interrupt(td_run *r);

/* The last step rank 0 finished; re-arms the PROGRESS event, which a run posts only when the
 * loop has taken the last one (a fast job costs the loop one wake-up per turn, not one per
 * step). */
int64_t td_run_progress(td_run *r);

/* After DONE of a spanning run, on process 0: every failed device of the job, in (node,
 * device) order, each with its node's process rank and device number; how many into *n. */
typedef struct td_run_failed {
    int node;   /* the process rank */
    int device; /* the device's number on its node */
    td_error_t err;
} td_run_failed;
const td_run_failed *td_run_failures(const td_run *r, int *n);

/* After DONE: whether rank failed, and with what (NULL when it did not), and its worker. */
const td_error_t *td_run_failure(const td_run *r, int rank);
const td_worker *td_run_worker(const td_run *r, int rank);
int td_run_world(const td_run *r);

void td_run_free(td_run *r); /* accepts NULL */

/* The metric queue's failure callback (td_mq_failed_cb; td_mq_on_failure's ud unused): rank
 * 0's sink is opened with its run as sink_ud, and the run posts its reserved STORE_FAILED
 * event with err. Store thread. */
void td_run_on_store_failed(void *ud, void *run, int64_t job, const td_error_t *err);

#endif
