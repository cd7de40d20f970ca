/* Deleting ended jobs (rm, prune) on the loop thread without holding it up. What the store has
 * marked for deletion (store.h, "deleting ended jobs") is deleted here a slice at a time: each
 * turn of the loop runs store work for about TD_PURGE_SLICE_MS, every write a transaction of
 * at most TD_PURGE_BATCH rows (or TD_PURGE_VACUUM_PAGES pages), and then the loop serves its
 * clients again. A job goes in order: its metric rows and log lines (a large job's over
 * several transactions, a small one's with other jobs' in one), then its checkpoint directory
 * (STATE_DIR/checkpoints/JOB), then its row. Once no job is left, the pages the rows took go
 * back to the file system (incremental vacuum), and a sweep removes the checkpoint directories
 * of jobs that no longer exist. The marks live in the store, so a deletion that a stop
 * interrupts goes on at the next start.
 *
 * Whoever asked for a deletion waits for it with td_purge_wait(): its callback comes once the
 * work under way is all done (every marked job, the vacuum, the sweep), with the database's
 * size then, and its progress callback about once a second meanwhile. Another process's lock
 * on the database or a full disk pauses the work, tried again with a backoff; any other store
 * error ends the waits with it (the marked jobs stay marked, hidden, and are tried again at
 * the next request or start).
 *
 * Threads: loop thread only. Public because it embeds libuv handles (STYLE.md habit 2). */
#ifndef TD_PURGE_H
#define TD_PURGE_H

#include <dirent.h>
#include <stdint.h>
#include <uv.h>

#include "store/store.h"
#include "common/td_errno.h"

#define TD_PURGE_SLICE_MS     5    /* ms of store work one loop turn gives the deletions */
#define TD_PURGE_BATCH        500  /* rows one transaction deletes (of one job or many) */
#define TD_PURGE_VACUUM_PAGES 256  /* free pages one transaction gives back */
#define TD_PURGE_SWEEP_BATCH  64   /* checkpoint directories one sweep step looks at */
#define TD_PURGE_RETRY_MIN_MS 100  /* first wait after the store was locked or full... */
#define TD_PURGE_RETRY_MAX_MS 2000 /* ...doubling up to this */
#define TD_PURGE_WARN_MS      5000 /* a pause this long is logged */
#define TD_PURGE_PROGRESS_MS  1000 /* between progress callbacks */
#define TD_PURGE_CKPT_MS      250  /* between checkpoints asked of another thread meanwhile */
#define TD_PURGE_AUTOCKPT                                            \
    1000 /* WAL pages the loop's connection checkpoints at otherwise \
          * (SQLite's default) */

/* How a wait ended. err.code 0: the work is done; bytes_after is the database's size then
 * (pages in use; in WAL mode the file itself shrinks at the next checkpoint), free_bytes what
 * stays free inside it (a database without incremental auto-vacuum keeps its free pages for
 * later writes), reclaimed whether the database gives pages back at all. */
typedef struct td_purge_result {
    td_error_t err;
    int64_t bytes_after;
    int64_t free_bytes;
    int reclaimed;
} td_purge_result;

typedef void (*td_purge_done_cb)(void *ud, const td_purge_result *r);
/* About once a second while the work goes on: jobs still to delete. */
typedef void (*td_purge_progress_cb)(void *ud, int64_t jobs_left);

struct td_purge_waiter; /* one waiter (daemon_purge.c) */

typedef struct td_purge {
    uv_idle_t idle;   /* runs a slice each loop turn while there is work */
    uv_timer_t retry; /* waits out a lock or a full disk */
    td_store *store;  /* the loop's; borrowed */
    char ckpt_root[600];
    char shared_prefix[600];      /* jobs that span nodes: <shared_dir>/<host>-job-; "" for none */
    int phase;                    /* what the next step does (daemon_purge.c) */
    int64_t job;                  /* the lowest marked job, as last read */
    int64_t left;                 /* marked jobs still to delete; -1: to be read */
    int64_t deleted;              /* jobs deleted since the work began */
    int64_t steps;                /* steps since then (transactions, sweep batches) */
    double longest_ms;            /* the longest of them */
    int sweep_wanted;             /* a sweep of the checkpoints is due once the jobs are gone */
    DIR *sweep_dir;               /* the sweep under way, or NULL */
    int running;                  /* idle or retry is started */
    double began;                 /* monotonic ms the work began */
    double paused_since;          /* monotonic ms of the first failure in a row, 0 when none */
    double retry_ms;              /* the next wait */
    int pause_logged;             /* the pause has been logged */
    double progress_at;           /* monotonic ms of the last progress callback */
    double ckpt_at;               /* monotonic ms of the last checkpoint asked for */
    void (*checkpoint)(void *ud); /* asks another thread for a checkpoint of the WAL */
    void *checkpoint_ud;
    struct td_purge_waiter *waiters;
    int open;
} td_purge;

/* Starts p on loop for store s (borrowed until td_purge_close); checkpoints live under
 * state_dir/checkpoints. While the work goes on, the loop's connection makes no WAL
 * checkpoint of its own (one copies megabytes back into the database and syncs it: a pause of
 * the loop), and checkpoint(ud) is called every TD_PURGE_CKPT_MS instead, to have one made on
 * another thread (the daemon's store thread: td_mq_checkpoint); NULL leaves them to the loop.
 * A libuv code on failure (nothing to close then). Does no work until td_purge_kick. */
int td_purge_init(td_purge *p, uv_loop_t *loop, td_store *s, const char *state_dir,
                  void (*checkpoint)(void *ud), void *ud);

/* Jobs that span nodes keep their checkpoints and spec in PREFIX<job> (launch.h, on the shared
 * file system): a deleted job's is removed there too. Copies prefix. */
void td_purge_set_shared(td_purge *p, const char *prefix);

/* Starts the work, or goes on with it: the marked jobs, the vacuum, and (sweep set) a sweep of
 * the checkpoint directories. */
void td_purge_kick(td_purge *p, int sweep);

/* Calls done(ud) once the work under way is done, and progress(ud) about once a second
 * meanwhile (may be NULL). Call td_purge_kick after. TD_ENOMEM; else done is called exactly
 * once, at the latest by td_purge_close (with TD_ECLOSED). */
int td_purge_wait(td_purge *p, td_purge_done_cb done, td_purge_progress_cb progress, void *ud);

/* Ends every wait with TD_ECLOSED (the work goes on at the next start), stops the work and
 * closes the handles; p's memory must live until the loop has run the closes. Accepts a p
 * never opened. */
void td_purge_close(td_purge *p);

#endif
