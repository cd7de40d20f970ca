/* The loop thread's writes to the store: a job's state, progress, log lines, its rewritten spec,
 * its per-device errors and the nodes it runs on. The loop never waits on a lock another process
 * holds on the database (the store is in TD_STORE_NOWAIT mode), so a write can fail for a while:
 * the database is locked (an sqlite3 shell inside BEGIN IMMEDIATE), the disk is full, or an I/O
 * error that may pass. Such a write is kept here, in memory and in order, and tried again
 * from a timer with a backoff (TD_WRITES_RETRY_MIN_MS doubling to TD_WRITES_RETRY_MAX_MS)
 * until it goes through; while anything is kept, later writes queue behind it, so the store
 * sees every job's writes in the order they were made. Progress is kept as the latest value
 * per job; log lines past TD_WRITES_MAX_LOGS kept at once are dropped and counted; states are
 * never dropped. A write the store refuses for good (no such job, a bad argument) is logged
 * and dropped, as it would have been at once.
 *
 * Threads: the loop thread only. Public because it embeds a libuv handle (STYLE.md habit 2). */
#ifndef TD_WRITES_H
#define TD_WRITES_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "store/store.h"
#include "common/td_errno.h"

#define TD_WRITES_RETRY_MIN_MS 100   /* first wait before kept writes are tried again */
#define TD_WRITES_RETRY_MAX_MS 2000  /* the longest such wait */
#define TD_WRITES_MAX_LOGS     10000 /* log lines kept at once; more are dropped and counted */

/* A kept state write left the queue: written, or (logged) refused for good. Loop thread. */
typedef void (*td_writes_state_cb)(void *ud, int64_t job, const char *state);

struct td_write; /* one kept write (writes.c) */

typedef struct td_writes {
    uv_timer_t timer;
    td_store *store; /* borrowed */
    struct td_write *head, *tail;
    size_t n, nlogs;
    size_t dropped_logs; /* log lines dropped since the queue was last empty */
    double retry_ms;     /* the next wait */
    double since;        /* monotonic ms the oldest kept write was first tried */
    td_error_t why;      /* the last failure */
    td_writes_state_cb state_cb;
    void *ud;
    int open;
} td_writes;

/* Starts w on loop for store s (borrowed until td_writes_close). A libuv code on failure
 * (nothing to close then). */
int td_writes_init(td_writes *w, uv_loop_t *loop, td_store *s, td_writes_state_cb cb, void *ud);

/* At shutdown: tries every kept write once more, waiting for locks as TD_STORE_WAIT does (the
 * loop serves nobody any more), logs each state that still could not be written (the next
 * start requeues a job the store still says is running), frees the rest and closes the timer
 * (w's memory must live until the loop has run the close). Accepts a w never opened. */
void td_writes_close(td_writes *w);

/* Each write: 0 when it is in the store, 1 when it is kept and will be tried again (the store
 * is locked or full; logged), or a negative td_ code when the store refuses it for good (err
 * says why; nothing is kept). Every argument is copied. */
int td_writes_state(td_writes *w, int64_t job, const char *state, const char *device_list,
                    int err_code, const char *err_msg, td_error_t *err);
int td_writes_progress(td_writes *w, int64_t job, int64_t step, int64_t total_steps,
                       td_error_t *err);
int td_writes_log(td_writes *w, int64_t job, int level, const char *line, td_error_t *err);
int td_writes_spec(td_writes *w, int64_t job, const void *blob, size_t len, const char *json,
                   td_error_t *err);
int td_writes_err_devices(td_writes *w, int64_t job, const void *blob, size_t len, td_error_t *err);
int td_writes_nodes(td_writes *w, int64_t job, const void *blob, size_t len, int restarts,
                    td_error_t *err);

/* How many writes are kept, and (when any are) why the last try failed, into why. */
size_t td_writes_pending(const td_writes *w, td_error_t *why);

#endif
