/* A launched job: one job that spans nodes, run as `traind rank` processes (one per node) that
 * a launcher starts: srun under Slurm, or mpirun with a host file (DESIGN.md, "Past one box";
 * the rank's interface is proto/PROTOCOL.md, "Rank stream"). A launch prepares the job's
 * directory on the shared file system (its spec, where its checkpoints go, owned by the job's
 * user) on libuv's threadpool, spawns the launcher as the job's user in a session (and
 * process group) of its own, reads rank 0's frames from the launcher's stdout on a thread of
 * its own (the metric rows go into the metric queue there, so a full queue holds the ranks
 * up, never the loop), reads the launcher's stderr on the loop into the job's log and for the
 * report of a rank that died, and turns it all into what a local run gives the daemon:
 * started, progress, the nodes, log lines, and one outcome.
 *
 * Stopping: td_launch_cancel and td_launch_interrupt signal the launcher (SIGUSR1, SIGUSR2),
 * which forwards the signal to every rank; the ranks agree to stop at their next step and
 * checkpoint first. Ranks that have not stopped after stop_timeout_s are ended by the launcher
 * (scancel of the Slurm job and SIGTERM to srun, or SIGTERM to mpirun), and after
 * kill_timeout_s more every process of the launcher's session gets SIGKILL. So a launch always
 * ends, whatever the ranks do.
 *
 * Threads: every function here runs on the loop thread, and so does every callback. The
 * reader thread reaches the loop only through the launch's uv_async_t. Public because the
 * daemon's callbacks get a td_launch; its body is launch.c's. */
#ifndef TD_LAUNCH_H
#define TD_LAUNCH_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/jobspec.h"
#include "daemon/metricq.h"
#include "store/store.h"

#define TD_LAUNCH_MAX_NODE_NAME 64   /* bytes of a node's name, NUL included */
#define TD_LAUNCH_MAX_FAILED    1024 /* failed devices one done frame may list */
#define TD_LAUNCH_MAX_ARGS      96   /* arguments of the launcher's command line */
#define TD_LAUNCH_ARGV_BYTES    8192 /* bytes of those arguments together */
#define TD_LAUNCH_LOG_LINES     200  /* lines of the launcher's stderr one launch logs */
#define TD_LAUNCH_LINE_MAX      1024 /* bytes of one such line (or log frame) kept */
#define TD_LAUNCH_LOG_PENDING   1000 /* log lines waiting for the loop; more are counted */
#define TD_LAUNCH_DRAIN_MS                                         \
    5000 /* ms the stdout and stderr pipes may stay open after the \
          * launcher has exited (a straggler holding them) */

typedef struct td_launch td_launch;

/* The world the ranks joined (the "rank" frame). names: world->nodes entries. */
typedef struct td_launch_world {
    int nodes, devices_per_node, world;
    char device_kind[8]; /* "cpu", "cuda" */
    char (*names)[TD_LAUNCH_MAX_NODE_NAME];
} td_launch_world;

/* One failed device of a done frame. */
typedef struct td_launch_failed {
    int node; /* the node's process rank */
    char node_name[TD_LAUNCH_MAX_NODE_NAME];
    int device; /* on that node */
    int code;
    char message[512];
} td_launch_failed;

/* How a launch ended. Borrowed for the done callback. */
typedef struct td_launch_outcome {
    char state[TD_STORE_MAX_STATE]; /* succeeded, failed, cancelled; queued: interrupted, the
                                     * job goes back to the queue */
    int64_t step;                   /* the last step rank 0 finished */
    td_error_t err;                 /* code 0: none */
    int rank_died;                  /* failed without an outcome from rank 0: a rank (or the
                                     * launcher) died; a restart may help */
    char dead_node[TD_LAUNCH_MAX_NODE_NAME]; /* the node it died on, "" when not known */
    const td_launch_failed *failed;          /* a failed done frame's devices */
    size_t nfailed;
} td_launch_outcome;

/* What the daemon hears of its launch. ud is the args' ud; l is the launch. */
typedef struct td_launch_cbs {
    void *ud;
    void (*world)(void *ud, td_launch *l, const td_launch_world *w);
    void (*started)(void *ud, td_launch *l, int64_t step, int64_t total_steps);
    void (*progress)(void *ud, td_launch *l, int64_t step);
    void (*log)(void *ud, td_launch *l, int level, const char *line);
    /* Some of the job's metric rows could not be stored (metricq.h): it must not succeed. */
    void (*store_failed)(void *ud, td_launch *l, const td_error_t *err);
    /* Last, once: the launcher has exited, its pipes are drained and every metric row the
     * ranks sent is durable (or failed). The daemon then calls td_launch_close. */
    void (*done)(void *ud, td_launch *l, const td_launch_outcome *o);
} td_launch_cbs;

/* One launch of a job. Borrowed for td_launch_start only; everything is copied. */
typedef struct td_launch_args {
    int64_t job;
    const td_jobspec *spec; /* uid and gid say whom the ranks run as */
    const void *spec_bytes; /* the stored spec (msgpack), written for the ranks to read */
    size_t spec_len;
    const td_cluster_config *cluster;
    int nodes, min_nodes; /* this launch's size: srun -N min-max; mpirun -np nodes */
    const char *exclude;  /* comma-separated nodes srun leaves out (a restart's); or NULL */
    td_mq *mq;
    td_launch_cbs cbs;
} td_launch_args;

/* The launcher's command line, built by td_launch_argv. argv[argc] is NULL; the strings live
 * in buf. */
typedef struct td_launch_cmd {
    char *argv[TD_LAUNCH_MAX_ARGS + 1];
    int argc;
    char buf[TD_LAUNCH_ARGV_BYTES];
    size_t used;
} td_launch_cmd;

/* What td_launch_argv needs beyond the cluster's configuration. */
typedef struct td_launch_plan {
    int64_t job;
    const td_cluster_config *cluster;
    const char *host;     /* the daemon's host, short: the Slurm job's name is traind-HOST-JOB */
    const char *traind;   /* the traind executable the ranks run */
    const char *spec;     /* the spec file */
    const char *ckpt_dir; /* <shared_dir>/<host>-job-<job> */
    int nodes, min_nodes;
    const char *exclude; /* NULL or "" for none */
} td_launch_plan;

/* Builds the launcher's command line:
 *   srun --mpi=pmix --nodes=N[-MIN..] --ntasks-per-node=1 --job-name=traind-HOST-JOB
 *        --kill-on-bad-exit=0 --wait=W --input=none [--exclude=LIST] [launcher_args]
 *        TRAIND rank --spec SPEC --job JOB --checkpoint-dir DIR
 *   mpirun --hostfile FILE -np N --map-by node --bind-to none
 *        [--mca btl_tcp_if_include IF --mca oob_tcp_if_include IF] [-x NCCL_SOCKET_IFNAME]
 *        [launcher_args] TRAIND rank --spec SPEC --job JOB --checkpoint-dir DIR
 * (srun's -N is MIN-N when min_nodes < nodes.) TD_E2BIG when it does not fit cmd; TD_EINVAL
 * for no launcher. Pure. */
int td_launch_argv(const td_launch_plan *p, td_launch_cmd *cmd, td_error_t *err);

/* Where a job's checkpoints and spec live: <shared_dir>/<host>-job-<job>. TD_E2BIG. */
int td_launch_job_dir(const td_cluster_config *c, int64_t job, char *out, size_t size,
                      td_error_t *err);

/* The part of every job's directory before its id: <shared_dir>/<host>-job-. TD_E2BIG. */
int td_launch_dir_prefix(const td_cluster_config *c, char *out, size_t size, td_error_t *err);

/* The launcher's report of a rank that died, from one line of its stderr. srun's
 *   "srun: error: n2: task 1: Killed"
 * gives node "n2", task 1, why "Killed"; mpirun's
 *   "mpirun noticed that process rank 1 with PID 0 on node box exited on signal 9 (Killed)."
 * gives node "box", task 1, why "exited on signal 9 (Killed)". Returns 1 when line is one.
 * Pure. */
typedef struct td_launch_death {
    char node[TD_LAUNCH_MAX_NODE_NAME];
    int task; /* the rank */
    char why[128];
} td_launch_death;
int td_launch_parse_death(const char *line, td_launch_death *out);

/* Starts a launch: the job's directory and spec are written on the threadpool, then the
 * launcher is spawned. A failure after this returns 0 (the launcher cannot be found, the
 * directory cannot be made) comes as a failed outcome through done. On error (out of memory,
 * a libuv handle) nothing was started and no callback comes. */
int td_launch_start(td_launch **out, uv_loop_t *loop, const td_launch_args *a, td_error_t *err);

/* Asks the ranks to stop at their next step: cancel (the job ends cancelled, a checkpoint
 * written) or interrupt (a shutdown: the job goes back to the queue); then the escalation
 * above. Each may be called more than once; an interrupt after a cancel stays a cancel. */
void td_launch_cancel(td_launch *l);
void td_launch_interrupt(td_launch *l);

/* Ends a launch that went wrong on the daemon's side (why, e.g. its metrics cannot be
 * stored): the ranks are cancelled as above, and the outcome is failed with why, whatever
 * they report. */
void td_launch_fail(td_launch *l, const td_error_t *why);

/* The launcher's pid, 0 before it is spawned or after it has exited. */
int td_launch_pid(const td_launch *l);

/* Frees the launch after its done callback (or within it): its handles close, and its
 * memory goes once the loop has run their close callbacks. Accepts NULL. */
void td_launch_close(td_launch *l);

#endif
