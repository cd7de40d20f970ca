/* traind's configuration file: an INI file (read with inih) whose keys fill a td_config. The
 * keys, their sections and their defaults are listed in etc/traind.conf and traind(8).
 * Called from main() before anything starts; not thread-safe (getgrnam_r aside, nothing
 * here needs to be). */
#ifndef TD_CONFIG_H
#define TD_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "train/device.h"
#include "common/td_errno.h"

#define TD_MAX_CONNS 1024 /* connections open at once by default; more are closed at accept */
#define TD_MAX_CONNS_PER_USER                                                                   \
    64 /* connections one uid (root aside) may hold by default, so that nobody locks the others \
        * out by filling max_connections */
#define TD_MAX_STREAMS_PER_CONN 16    /* watch/metrics streams open at once on one connection */
#define TD_MAX_EXPORTS_PER_USER 2     /* exports one uid may have in flight by default */
#define TD_MAX_WORK_PER_USER    4     /* work requests one uid may have under way by default */
#define TD_WORK_TIMEOUT_S       3600  /* seconds a work request may run by default */
#define TD_MAX_QUEUED_PER_USER  1000  /* queued jobs one uid may have by default */
#define TD_HELLO_TIMEOUT_S      5.0   /* seconds a new connection has to complete its hello */
#define TD_IDLE_TIMEOUT_S       300.0 /* seconds a connection may sit idle after its hello */
#define TD_PROM_INTERVAL_S      5.0   /* seconds between writes of the Prometheus file */
#define TD_PROM_MODE            0644  /* the Prometheus file's mode: the node exporter reads it */

/* [cluster]: how the daemon launches a job that spans nodes (daemon/launch.h). */
typedef enum td_launcher_kind {
    TD_LAUNCHER_NONE,   /* no launcher: a job of nodes > 1 is refused at submit */
    TD_LAUNCHER_SRUN,   /* Slurm: srun --mpi=pmix -N N --ntasks-per-node=1 ... */
    TD_LAUNCHER_MPIRUN, /* Open MPI without Slurm: mpirun --hostfile FILE -np N ... */
} td_launcher_kind;

#define TD_CLUSTER_MAX_RUNNING 16 /* jobs that span nodes running at once, by default */
#define TD_CLUSTER_STOP_S                                                               \
    120.0                      /* seconds from a cancel's or a shutdown's signal to the \
                                * ranks until the launcher is ended (scancel, SIGTERM): \
                                * the ranks finish a step and write a checkpoint first */
#define TD_CLUSTER_KILL_S 30.0 /* seconds from then until SIGKILL of what is left */
#define TD_CLUSTER_EXIT_WAIT_S                              \
    30 /* seconds srun lets the other ranks run on once one \
        * has ended (srun --wait) */

typedef struct td_cluster_config {
    td_launcher_kind launcher;
    char launcher_path[256]; /* the srun or mpirun executable; "" = found on PATH */
    char scancel_path[256];  /* "" = scancel found on PATH */
    char hostfile[512];      /* mpirun's --hostfile; required with mpirun */
    char shared_dir[512];    /* every node mounts it: specs and checkpoints; required */
    char traind_path[512];   /* the traind the ranks run; "" = this daemon's own executable */
    char launcher_args[512]; /* more arguments for the launcher, split at spaces */
    char nccl_ifname[128];   /* NCCL_SOCKET_IFNAME for the ranks; "" = NCCL's choice */
    char mpi_ifname[128];    /* Open MPI's btl_tcp_if_include and oob_tcp_if_include */
    int max_running;         /* jobs that span nodes running at once; 0 = no limit */
    double stop_timeout_s;   /* TD_CLUSTER_STOP_S */
    double kill_timeout_s;   /* TD_CLUSTER_KILL_S */
    int exit_wait_s;         /* TD_CLUSTER_EXIT_WAIT_S */
} td_cluster_config;

/* What the file and the command line say, after checking. */
typedef struct td_config {
    char socket_path[108];
    char state_dir[512];
    char db_path[600];
    td_device_kind dev_kind;          /* --devices: cpu:N or cuda:... (all of one kind) */
    int ncpu_devices;                 /* cpu:N's N */
    int cuda_all;                     /* cuda:all: every GPU the process sees, found at start */
    int cuda_devices[TD_MAX_DEVICES]; /* cuda:0,1: the CUDA ordinals, ascending */
    int ncuda_devices;
    double nccl_timeout_s;     /* [cuda] nccl_timeout_s: a job's collectives, unless the job says */
    int max_queued_per_user;   /* queued jobs one uid may have; 0 = unlimited */
    int max_devices_per_user;  /* devices one uid's running jobs may hold; 0 = unlimited */
    int max_conns;             /* connections open at once, at most; default TD_MAX_CONNS */
    int max_queued;            /* queued jobs of all users together; 0 = unlimited */
    int max_conns_per_user;    /* connections one uid other than root may hold; 0 = unlimited */
    int max_streams_per_conn;  /* streams (watch, metrics) open at once on one connection */
    int max_exports_per_user;  /* exports one uid may have in flight; 0 = unlimited */
    int max_work_per_user;     /* export, sample, classify, retrieve, probe one uid may have
                                * under way (queued or running); 0 = unlimited; root is exempt */
    double work_timeout_s;     /* seconds one may run before it is stopped; 0 = no limit */
    double hello_timeout_s;    /* [server] seconds from accept to a completed hello */
    double idle_timeout_s;     /* [server] seconds without a request on a connection that has no
                                * stream, export or sample under way; 0 = never closed for it */
    int log_level;             /* TD_LOG_ERR .. TD_LOG_DEBUG (td_log.h) */
    char socket_group[64];     /* the group given the socket it binds; "" = the daemon's own */
    int64_t socket_gid;        /* socket_group's gid, or -1 */
    char prom_path[512];       /* [metrics] prometheus_textfile: absolute, *.prom; "" = none */
    double prom_interval_s;    /* [metrics] prometheus_interval_s */
    int prom_mode;             /* [metrics] prometheus_textfile_mode */
    double disk_full_wait_s;   /* [metrics] how long the metric store waits for room on a full
                                * disk before the jobs whose rows wait fail */
    td_cluster_config cluster; /* [cluster] */
} td_config;

/* Fills cfg with the defaults: the socket in /run/traind, the state in /var/lib/traind, one
 * CPU device, TD_MAX_CONNS connections (TD_MAX_CONNS_PER_USER per uid), TD_MAX_QUEUED_PER_USER
 * queued jobs per uid and none for the queue as a whole, no per-user device limit, the
 * TD_HELLO_TIMEOUT_S and TD_IDLE_TIMEOUT_S timeouts, TD_MAX_STREAMS_PER_CONN streams per
 * connection, TD_MAX_EXPORTS_PER_USER exports in flight per uid, log level info, the socket
 * left with the daemon's own group, no Prometheus file (written every TD_PROM_INTERVAL_S with
 * mode TD_PROM_MODE once one is named), a full disk waited out for TD_MQ_FULL_WAIT_MS, no
 * launcher for jobs that span nodes (with TD_CLUSTER_* once one is named). */
void td_config_defaults(td_config *cfg);

/* Reads the INI file at path into cfg, over what cfg holds. A missing file is an error only
 * when must_exist is set (traind --config names it); otherwise it leaves cfg as it was and
 * sets *loaded to 0. On error returns TD_EINVAL with err->msg naming the file, the line and
 * the key, e.g. `/etc/traind/traind.conf:7: unknown key "sokcet" in [daemon]`; cfg may then
 * hold some of the file's values. A [cluster] launcher needs shared_dir, and mpirun a hostfile
 * too: `/etc/traind/traind.conf: [cluster] launcher = mpirun needs hostfile`. */
int td_config_load(td_config *cfg, const char *path, int must_exist, int *loaded, td_error_t *err);

/* The value parsers the file and the command line share. Each returns 0, or -1 and a
 * sentence in why saying what was expected. */
int td_config_set_socket(td_config *cfg, const char *path, char *why, size_t size);
int td_config_set_state_dir(td_config *cfg, const char *dir, char *why, size_t size);
int td_config_set_devices(td_config *cfg, const char *spec, char *why, size_t size);
int td_config_set_log_level(td_config *cfg, const char *name, char *why, size_t size);
int td_config_set_group(td_config *cfg, const char *group, char *why, size_t size);
int td_config_set_prom_path(td_config *cfg, const char *path, char *why, size_t size);

#endif
