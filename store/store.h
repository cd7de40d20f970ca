/* The SQLite store: schema and migrations (PRAGMA user_version), jobs, interned metric keys,
 * metric rows keyed (job, key, step) WITHOUT ROWID with a per-(job, key) summary, and job
 * log lines. WAL mode, a busy timeout, BEGIN IMMEDIATE for writes.
 *
 * A td_store is one sqlite3 connection and belongs to one thread: the daemon opens one for
 * its loop thread (jobs, reads for status/list/watch) and one for its store thread (metric
 * batches). Reads never keep a transaction open between calls, so the WAL can checkpoint
 * while a watcher streams. Knows nothing of training or of the wire. */
#ifndef TD_STORE_H
#define TD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "td_errno.h"

#define TD_STORE_SCHEMA_VERSION 2
#define TD_STORE_MAX_KEY        64    /* bytes of a metric name, NUL included */
#define TD_STORE_MAX_NAME       128   /* bytes of a job name, NUL included */
#define TD_STORE_MAX_STATE      16    /* bytes of a state word, NUL included */
#define TD_STORE_BUSY_MS        10000 /* milliseconds a statement waits for a lock */

typedef struct td_store td_store;

/* Opens (creating or migrating) the database at path. A database whose user_version is newer
 * than TD_STORE_SCHEMA_VERSION is refused with TD_EVERSION. Caller closes with
 * td_store_close(). */
int td_store_open(td_store **out, const char *path, td_error_t *err);
void td_store_close(td_store *s);

/* ---- jobs ---- */

/* Job states, as stored and as shown to users. */
#define TD_JOB_QUEUED    "queued"
#define TD_JOB_RUNNING   "running"
#define TD_JOB_SUCCEEDED "succeeded"
#define TD_JOB_FAILED    "failed"
#define TD_JOB_CANCELLED "cancelled"

typedef struct td_job_row {
    int64_t id;
    char name[TD_STORE_MAX_NAME];
    char state[TD_STORE_MAX_STATE];
    int64_t step;         /* last step reported by the worker */
    int64_t total_steps;  /* 0 until the job has started and knows it */
    int devices;          /* devices requested */
    char device_list[64]; /* devices it ran on, "cpu:0,cpu:1"; empty while queued */
    int priority;
    int64_t uid;                    /* submitting user, -1 when unknown */
    int err_code;                   /* 0 when no error */
    char *err_msg;                  /* malloc'd; NULL when no error */
    double created, started, ended; /* unix seconds; 0 when not yet */
    void *spec;                     /* malloc'd msgpack map of the job as submitted */
    size_t spec_len;
    char *spec_json;   /* malloc'd JSON rendering of spec */
    void *err_devices; /* malloc'd msgpack array of {device, code, message}; NULL if none */
    size_t err_devices_len;
} td_job_row;

/* Frees the malloc'd members of row (not row itself) and zeroes them. Accepts NULL. */
void td_job_row_clear(td_job_row *row);

/* Inserts a queued job. Copies every argument. Sets *id_out. spec may be NULL (spec_len 0),
 * and so may spec_json. TD_EINVAL for a name that does not fit TD_STORE_MAX_NAME. */
int td_store_job_insert(td_store *s, const char *name, int devices, int priority, int64_t uid,
                        const void *spec, size_t spec_len, const char *spec_json, int64_t *id_out,
                        td_error_t *err);

/* Reads one job into *row (caller clears it). TD_ENOTFOUND when there is no such job. */
int td_store_job_get(td_store *s, int64_t id, td_job_row *row, td_error_t *err);

/* Reads every job, oldest first, into a malloc'd array (caller clears each row and frees the
 * array). with_spec = 0 leaves spec and spec_json NULL. */
int td_store_job_list(td_store *s, int with_spec, td_job_row **rows, size_t *n, td_error_t *err);

/* Moves a job to state. For running, sets started and device_list; for a final state
 * (succeeded/failed/cancelled) sets ended and the error (code 0 and msg NULL for none); for
 * queued, clears device_list, ended and the error (started keeps the first start). Only
 * running reads device_list (NULL reads as ""; it must fit td_job_row.device_list) and
 * only final states read err_code and err_msg. The store does not judge which moves are
 * allowed; that is the scheduler's. TD_EINVAL for an unknown state, TD_ENOTFOUND for no
 * such job. */
int td_store_job_set_state(td_store *s, int64_t id, const char *state, const char *device_list,
                           int err_code, const char *err_msg, td_error_t *err);

/* Replaces job id's stored spec (the msgpack job map) with blob (len bytes, copied) and its
 * spec_json with json (copied), which the caller renders from the same map (td_pv_to_json):
 * the store knows nothing of msgpack, so it cannot render it itself. json NULL clears
 * spec_json rather than leave it describing the old spec. For the daemon to record the batch
 * an "auto" job was given. TD_ENOTFOUND for no such job, TD_EINVAL for a bad argument. */
int td_store_job_set_spec_json(td_store *s, int64_t id, const void *blob, size_t len,
                               const char *json, td_error_t *err);

/* Records the per-device errors of a failed job (msgpack bytes, copied; NULL clears).
 * TD_ENOTFOUND for no such job. */
int td_store_job_set_error_devices(td_store *s, int64_t id, const void *blob, size_t len,
                                   td_error_t *err);

/* Records progress. TD_ENOTFOUND for no such job. */
int td_store_job_set_progress(td_store *s, int64_t id, int64_t step, int64_t total_steps,
                              td_error_t *err);

/* At daemon start: every job left running by a daemon that died goes back to queued (its
 * device_list cleared). Sets *n to how many. */
int td_store_jobs_requeue_running(td_store *s, int *n, td_error_t *err);

/* ---- metrics ---- */

/* One metric sample, as a worker emits it. */
typedef struct td_metric {
    int64_t job;
    char key[TD_STORE_MAX_KEY];
    int64_t step;
    double value;
    double time; /* unix seconds */
} td_metric;

/* Writes n samples in one transaction (BEGIN IMMEDIATE ... COMMIT). Interns keys on first
 * sight; a sample for an existing (job, key, step) replaces it. Keeps the per-(job, key)
 * summary (last, min, max, count, last_step) current, in the same transaction; see
 * td_metric_summary for what each field means after a replay. A NaN value or time is
 * stored (as SQL NULL) and reads back NaN. On failure nothing of the batch is written
 * (rolled back) and err names the cause, the statement and the sample: TD_EINVAL for an
 * empty or unterminated key (checked before anything is written), TD_ENOTFOUND for a job
 * that does not exist, TD_EDISKFULL for SQLITE_FULL, TD_EIO for SQLITE_IOERR, else
 * TD_ESTORE with SQLite's message. n = 0 writes nothing and succeeds. */
int td_store_metrics_write(td_store *s, const td_metric *m, size_t n, td_error_t *err);

/* A row read back. key points into storage owned by the store, valid until the next call on
 * the same td_store. key_id is the key's interned id: ids start at 1 and are given in the
 * order keys were first written (by any job), and never change. */
typedef struct td_metric_row {
    const char *key;
    int key_id;
    int64_t step;
    double value;
    double time;
} td_metric_row;

/* A read position in a job's metrics. Rows come in (step, key_id) order; a cursor says the
 * last row already delivered. Start with td_metric_cursor_init(&c, since_step): the first
 * page then begins at step since_step (it sets key_id 0, before every key). A cursor is a
 * plain value: copy it to resume later, or to rewind. */
typedef struct td_metric_cursor {
    int64_t step;
    int key_id;
} td_metric_cursor;

void td_metric_cursor_init(td_metric_cursor *c, int64_t since_step);

/* Calls cb for up to limit rows after cursor c, in (step, key_id) order, restricted to keys
 * (an array of nkeys names; nkeys 0 means every key; a name never written matches nothing),
 * and advances c past each row delivered. Sets *ndone to the number delivered (fewer than
 * limit means "caught up"). cb returning non-zero stops early (that row counts as
 * delivered). Holds a read transaction only for the duration of the call: rows committed by
 * another connection meanwhile show up on the next call. cb must not call into the same
 * td_store. */
typedef int (*td_metric_cb)(void *ud, const td_metric_row *row);
int td_store_metrics_page(td_store *s, int64_t job, td_metric_cursor *c, const char *const *keys,
                          size_t nkeys, size_t limit, td_metric_cb cb, void *ud, size_t *ndone,
                          td_error_t *err);

/* Per-key summary of a job, in key name order. key is valid until the next call on the same
 * td_store.
 *   count      rows stored; a replayed step replaces its row and adds nothing.
 *   last_step  the highest step stored; last is the value at that step (replacing that step
 *              updates it, replacing an older one does not).
 *   min, max   over every number ever written for the key, values since replaced by a
 *              replayed step included (recomputing would scan the key's rows on each
 *              replay). NaN samples do not count; NaN while the key has had no number. */
typedef struct td_metric_summary {
    const char *key;
    int64_t count;
    int64_t last_step;
    double last, min, max;
} td_metric_summary;

/* Calls cb for each key of job that has rows; cb returning non-zero stops early. A job with
 * no metrics, or no such job, calls cb never. cb must not call into the same td_store. */
typedef int (*td_summary_cb)(void *ud, const td_metric_summary *row);
int td_store_metrics_summary(td_store *s, int64_t job, td_summary_cb cb, void *ud, td_error_t *err);

/* ---- logs ---- */

/* Appends a line to the job's log (lifecycle events, warnings). level is a td_log level.
 * Copies msg. TD_ENOTFOUND when there is no such job. */
int td_store_log(td_store *s, int64_t job, int level, const char *msg, td_error_t *err);

/* One log line read back. msg borrows storage owned by the store, valid only until cb
 * returns. */
typedef struct td_job_log_row {
    int64_t id;  /* increases with every line written; pass the last one as after_id */
    double time; /* unix seconds */
    int level;
    const char *msg;
} td_job_log_row;

/* Calls cb for up to limit lines of job's log whose id is greater than after_id (0 for the
 * first), oldest first. Sets *ndone to the number delivered; cb returning non-zero stops
 * early (that line counts as delivered). A job with no lines, or no such job, delivers 0. */
typedef int (*td_job_log_cb)(void *ud, const td_job_log_row *row);
int td_store_log_read(td_store *s, int64_t job, int64_t after_id, size_t limit, td_job_log_cb cb,
                      void *ud, size_t *ndone, td_error_t *err);

#endif
