/* The operators' metrics: traind's state in the Prometheus text exposition format (version
 * 0.0.4), written to a file for the node exporter's textfile collector ([metrics]
 * prometheus_textfile in traind.conf). No port and no privilege of its own: the node exporter
 * serves the file. Written every prometheus_interval_s (TD_PROM_INTERVAL_S by default), at the
 * next loop turn after any job changes state (a burst of changes writes once), and a last
 * time when traind stops (traind_up 0). The directory is opened once, at the start, and held
 * (td_prom_open): a directory swapped for a link or replaced later is not followed, and the
 * writes go on into the held one. Each write goes to PATH.tmp in the same directory,
 * created afresh (a file or link found there is removed, never written through), given
 * prometheus_textfile_mode (0644 by default) and renamed over PATH, so the collector never
 * reads half a file. A write that fails is logged (once until one succeeds again) and tried
 * again at the next; traind goes on.
 *
 * The series, and where each comes from, are listed in prom.c and README.md ("Metrics for
 * operators"). Everything comes through daemon.h; the store is read with one query per
 * write, which never waits for a lock (a store that cannot answer leaves the last counts).
 *
 * Threads: loop thread only. Public because it embeds libuv handles (STYLE.md habit 2). */
#ifndef TD_PROM_H
#define TD_PROM_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/daemon.h"

#define TD_PROM_MAX_JOBS 1024 /* running jobs one write lists (there are at most 64 devices) */

typedef struct td_prom {
    uv_timer_t tick; /* every interval */
    uv_timer_t soon; /* a write at the next loop turn after a job's state changed */
    td_daemon *d;    /* borrowed until td_prom_close */
    char path[512];
    char tmp[520];      /* path.tmp, for messages */
    char dir[512];      /* path's directory, held open as dirfd */
    char name[512];     /* path's last component, written relative to dirfd */
    char tmp_name[520]; /* name.tmp */
    int dirfd;          /* the directory, opened at td_prom_open; -1: none */
    dev_t dir_dev;      /* its identity, to notice the path leading elsewhere */
    ino_t dir_ino;
    int moved;    /* the path no longer leads to it (and that was logged) */
    char db[600]; /* traind.db, for its size */
    int mode;
    uint64_t interval_ms;
    double started;                   /* unix seconds traind first started (a re-exec keeps it) */
    int64_t restarts;                 /* re-executions since then */
    int64_t counts[TD_STORE_NSTATES]; /* the last job counts the store gave */
    int failing;                      /* the last write failed (and was logged) */
    int open;
} td_prom;

/* Opens cfg's prom_path's directory, once, for every write of traind's life: from / one
 * component at a time with O_NOFOLLOW, each refused when it is a symbolic link or when a user
 * other than root and traind's own (geteuid) can change it (owned by another uid; writable by
 * a group other than root's and traind's, or by every user, and not sticky). The file and its
 * PATH.tmp are then created, renamed and removed only relative to that directory, never
 * through a path looked up again. -1 with err naming the directory ("[metrics]
 * prometheus_textfile: insecure directory D: ...", "... D does not exist"); traind refuses to
 * start. Call it before td_prom_start; td_prom_close closes it. */
int td_prom_open(td_prom *p, const td_config *cfg, td_error_t *err);

/* Starts writing cfg's prom_path (opened by td_prom_open) for d (borrowed until td_prom_close): a
 * first write at the next loop turn, then every interval. started and restarts are what
 * traind_start_time_seconds and traind_worker_restarts_total say. A libuv code on failure (nothing
 * to close then). */
int td_prom_start(td_prom *p, uv_loop_t *loop, td_daemon *d, const td_config *cfg, double started,
                  int64_t restarts);

/* A job changed state: the file is written at the next loop turn. */
void td_prom_job_changed(td_prom *p);

/* Writes the file a last time with traind_up 0 (the daemon is stopping; call it while the
 * daemon can still be asked) and closes the timers; p's memory must live until the loop has
 * run the closes. Accepts a p never started. */
void td_prom_close(td_prom *p);

#endif
