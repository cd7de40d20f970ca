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
 * uv_async_send. */
#ifndef TD_METRICQ_H
#define TD_METRICQ_H

#include <stddef.h>
#include <stdint.h>

#include "store.h"
#include "td_errno.h"

#define TD_MQ_CAPACITY 65536 /* samples the queue holds before producers block */
#define TD_MQ_BATCH    4096  /* samples written in one transaction at most */

typedef struct td_mq td_mq;
typedef struct td_mq_sink td_mq_sink;

typedef void (*td_mq_durable_cb)(void *ud, int64_t job, int64_t step);

/* Opens its own store connection on db_path and starts the store thread. capacity 0 means
 * TD_MQ_CAPACITY. Caller stops it with td_mq_stop(). */
int td_mq_start(td_mq **out, const char *db_path, size_t capacity, td_mq_durable_cb cb, void *ud,
                td_error_t *err);

/* Writes everything queued, stops the store thread and frees the queue. Every sink must have
 * been closed. Accepts NULL. */
void td_mq_stop(td_mq *q);

/* A producer's handle for one job. Caller closes it with td_mq_sink_close(). */
int td_mq_sink_open(td_mq *q, int64_t job, td_mq_sink **out);
void td_mq_sink_close(td_mq_sink *s);

/* Queues one sample (copies key), blocking while the queue is full. Returns 0, or an error
 * left by an earlier batch of this sink (reported once), or the store thread's cause of
 * death. The sample is queued even when an earlier error is returned. */
int td_mq_push(td_mq_sink *s, const char *key, int64_t step, double value, td_error_t *err);

/* Waits until every sample pushed on s is durable (or failed). Returns 0, or every error
 * since the last report merged into err in order. */
int td_mq_flush(td_mq_sink *s, td_error_t *err);

/* Milliseconds this sink has spent blocked on a full queue. */
double td_mq_sink_blocked_ms(const td_mq_sink *s);

/* For tests: makes the store thread exit as though it had failed with code and message. */
void td_mq_kill(td_mq *q, int code, const char *msg);

#endif
