/* The metric pipeline: a bounded multi-producer queue of metric samples and the store thread
 * that drains it into SQLite, one transaction per batch.
 *
 * Producers are device workers, each through a td_mq_sink (one per job run). A push blocks
 * while the queue is full: nothing is ever dropped, and the time spent blocked is counted on
 * the sink. A write error is attached to the sinks whose samples were in the failed batch and
 * reported by the next push or flush on that sink, exactly once; a flush waits until every
 * sample pushed before it is durable and returns every error since the last report, merged
 * in order. If the store thread dies, every waiting and later call returns its cause.
 *
 * After each batch the store thread calls the durable callback (on the store thread) once
 * per job in the batch with the highest step written; the daemon turns that into a
 * uv_async_send.
 *
 * What the store thread waits out, and what it gives up on (nothing is ever dropped
 * silently):
 *   - A lock held by another process (TD_EBUSY: an sqlite3 shell inside BEGIN
 *     IMMEDIATE, a backup): the batch is tried again with a backoff from TD_MQ_BACKOFF_MIN_MS
 *     doubling to TD_MQ_BACKOFF_MAX_MS, for as long as the lock lasts. Meanwhile the queue
 *     fills and then blocks the producers, so a job pauses instead of losing rows. A warning
 *     is logged after TD_MQ_WARN_AFTER_MS and then every TD_MQ_WARN_EVERY_MS.
 *   - A full disk (TD_EDISKFULL): tried again the same way for up to the room wait
 *     (TD_MQ_FULL_WAIT_MS), the jobs paused likewise. If room comes back, nothing is lost. If
 *     not, the store gives up on the sinks whose samples are in the batch: each gets the
 *     disk-full error (reported by its next push or flush), its later pushes are refused with
 *     that error instead of being queued, its samples still queued are discarded as they come
 *     up, and the failure callback names its job so that the daemon fails it. Until a write
 *     succeeds again every batch that finds the disk full fails at once in the same way.
 *   - Any other error (TD_EIO, a missing job): the batch's sinks get the error at once, as
 *     described above, and the failure callback names their jobs; a batch of several sinks is
 *     then tried one sink at a time. Later samples are still queued and written.
 * td_mq_stop writes everything queued, waiting out a lock however long it lasts. */
#ifndef TD_METRICQ_H
#define TD_METRICQ_H

#include <stddef.h>
#include <stdint.h>

#include "store/store.h"
#include "common/td_errno.h"

#define TD_MQ_CAPACITY       65536 /* samples the queue holds before producers block */
#define TD_MQ_BATCH          4096  /* samples written in one transaction at most */
#define TD_MQ_BACKOFF_MIN_MS 10    /* first wait before a locked or full write is tried again */
#define TD_MQ_BACKOFF_MAX_MS 1000  /* the longest such wait */
#define TD_MQ_FULL_WAIT_MS                                                                \
    60000                         /* ms a full disk is waited out before jobs fail; below \
                                   * the service's WatchdogSec, see td_mq_stalled */
#define TD_MQ_WARN_AFTER_MS 5000  /* a lock waited this long is logged... */
#define TD_MQ_WARN_EVERY_MS 60000 /* ...and again this often while it lasts */
#define TD_MQ_WAL_CHECK_MS  5000  /* ms between the store thread's checks of the WAL */
#define TD_MQ_WAL_WARN_BYTES                                         \
    (16 << 20) /* a WAL this large that a checkpoint cannot empty is \
                * logged: 4x what SQLite's automatic checkpoint lets \
                * gather (1000 pages of 4 KiB) */

typedef struct td_mq td_mq;
typedef struct td_mq_sink td_mq_sink;

typedef void (*td_mq_durable_cb)(void *ud, int64_t job, int64_t step);
/* Some of job's samples could not be stored (err says why: a full disk waited out, an I/O
 * error, a missing job): the job cannot end with every row. Called once per sink, on the
 * store thread, with the queue's lock held: it must not call into the queue. ud is
 * td_mq_on_failure's, sink_ud the one the sink was opened with. */
typedef void (*td_mq_failed_cb)(void *ud, void *sink_ud, int64_t job, const td_error_t *err);

/* Opens its own store connection on db_path and starts the store thread. capacity 0 means
 * TD_MQ_CAPACITY. Caller stops it with td_mq_stop(). */
int td_mq_start(td_mq **out, const char *db_path, size_t capacity, td_mq_durable_cb cb, void *ud,
                td_error_t *err);

/* Writes everything queued, stops the store thread and frees the queue. Every sink must have
 * been closed. Accepts NULL. */
void td_mq_stop(td_mq *q);

/* Sets the failure callback (see above). Call before the first sink opens. */
void td_mq_on_failure(td_mq *q, td_mq_failed_cb cb, void *ud);

/* Sets how long a full disk is waited out (ms; TD_MQ_FULL_WAIT_MS by default; traind.conf's
 * [metrics] disk_full_wait_s). Call before the first sink opens. */
void td_mq_set_full_wait(td_mq *q, double ms);

/* Whether the store thread is waiting right now for a lock or for room, and if so why, into
 * why (size bytes): "the database is locked by another process (for 12 s)". Any thread. A
 * worker blocked on a full queue meanwhile is waiting for the store, not hung. */
int td_mq_stalled(td_mq *q, char *why, size_t size);

/* A producer's handle for one job; ud goes to the failure callback for this sink (borrowed
 * until td_mq_sink_close). Caller closes it with td_mq_sink_close(). */
int td_mq_sink_open(td_mq *q, int64_t job, void *ud, td_mq_sink **out);
/* td_mq_sink_open with a failure callback of the sink's own, called (cb(cb_ud, ud, job, err),
 * as the queue's would be, on the store thread with the queue's lock held) instead of the
 * queue's: a producer that is not a run (a launched job's stream, launch.h) hears of its own
 * failures. */
int td_mq_sink_open_cb(td_mq *q, int64_t job, td_mq_failed_cb cb, void *cb_ud, void *ud,
                       td_mq_sink **out);
void td_mq_sink_close(td_mq_sink *s);

/* Queues one sample (copies key), blocking while the queue is full. Returns 0, or an error
 * left by an earlier batch of this sink (reported once), or the store thread's cause of
 * death. The sample is queued even when an earlier error is returned, except on a sink the
 * store has given up on (a full disk, see above): that refuses every sample with its error. */
int td_mq_push(td_mq_sink *s, const char *key, int64_t step, double value, td_error_t *err);

/* Waits until every sample pushed on s is durable (or failed). Returns 0, or every error
 * since the last report merged into err in order. */
int td_mq_flush(td_mq_sink *s, td_error_t *err);

/* Milliseconds this sink has spent blocked on a full queue. */
double td_mq_sink_blocked_ms(const td_mq_sink *s);

/* The queue's counters since td_mq_start, for operators (the Prometheus file): samples
 * written to the store, milliseconds producers spent blocked on a full queue (every sink's,
 * closed ones included), and samples queued now out of capacity. Any thread. */
typedef struct td_mq_stats_t {
    uint64_t rows_written;
    double blocked_ms;
    size_t queued, capacity;
} td_mq_stats_t;
void td_mq_stats(td_mq *q, td_mq_stats_t *out);

/* Asks the store thread for a passive checkpoint of the WAL (td_store_wal_checkpoint) as soon
 * as it is between batches, so that a connection that writes a lot (the loop deleting jobs,
 * with its own automatic checkpoints turned off) does not copy the WAL back and sync the
 * database on its own thread. Any thread; requests made before it runs count once. */
void td_mq_checkpoint(td_mq *q);

/* For tests: makes the store thread exit as though it had failed with code and message. */
void td_mq_kill(td_mq *q, int code, const char *msg);

#endif
