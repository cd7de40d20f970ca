/* Internals shared by the store's files (store.c, schema.c, jobs.c, metrics.c): the td_store
 * struct, its cache of prepared statements, its cache of interned metric keys, and the
 * helpers that turn SQLite results into td_ errors. Like the td_store it describes, everything
 * here is used by the one thread that owns the handle. Tests may include this header to reach
 * the test hooks at the end; nothing else should. */
#ifndef TD_STORE_INT_H
#define TD_STORE_INT_H

#include <sqlite3.h>

#include "store/store.h"

/* Every cached statement has a slot. The SQL text lives at the call site
 * (td__store_stmt), so a reader sees the query where it is used. */
enum td__store_stmt_id {
    TD__ST_BEGIN,
    TD__ST_COMMIT,
    TD__ST_ROLLBACK,
    TD__ST_JOB_INSERT,
    TD__ST_JOB_GET,
    TD__ST_JOB_LIST,
    TD__ST_JOB_LIST_SPEC,
    TD__ST_JOB_RUNNING,
    TD__ST_JOB_FINAL,
    TD__ST_JOB_QUEUED,
    TD__ST_JOB_PROGRESS,
    TD__ST_JOB_ERR_DEVICES,
    TD__ST_JOB_NODES,
    TD__ST_JOB_SPEC,
    TD__ST_JOB_REQUEUE,
    TD__ST_LOG_INSERT,
    TD__ST_LOG_READ,
    TD__ST_KEY_GET,
    TD__ST_KEY_INSERT,
    TD__ST_METRIC_INSERT,
    TD__ST_METRIC_REPLACE,
    TD__ST_SUMMARY_UPSERT,
    TD__ST_PAGE_ALL,
    TD__ST_PAGE_KEYS,
    TD__ST_SUMMARY_READ,
    TD__ST_JOB_EXISTS,
    TD__ST_JOB_COUNTS,
    TD__ST_PURGE_MARK,
    TD__ST_PURGE_BRIEF,
    TD__ST_PURGE_NEXT,
    TD__ST_PURGE_NEXT_AFTER,
    TD__ST_PURGE_METRICS,
    TD__ST_PURGE_LOGS,
    TD__ST_PURGE_SUMMARY,
    TD__ST_PURGE_JOB,
    TD__ST_PURGE_UNMARK,
    TD__ST_PURGE_MAX_ID,
    TD__ST_COUNT
};

/* SQL shared by the files that read and write jobs (jobs.c, purge.c). A job listed in
 * jobs_deleting is gone for every reader from the moment it is listed (schema.c, version 3):
 * TD__NOT_DELETING is the condition that leaves it out. A new job's id is one above both the
 * highest id in jobs and the highest ever given (store_meta's max_job_id, kept by purge.c), so
 * that a deleted job's id is never given again. */
#define TD__NOT_DELETING "id NOT IN (SELECT id FROM jobs_deleting)"
#define TD__NEXT_JOB_ID                                                  \
    "max(coalesce((SELECT max(id) FROM jobs), 0), "                      \
    "coalesce((SELECT value FROM store_meta WHERE key = 'max_job_id'), " \
    "0)) + 1"

/* One interned metric key in the open-addressing cache; id 0 marks an empty slot (SQLite
 * gives INTEGER PRIMARY KEYs from 1). */
struct td__key_slot {
    uint32_t hash;
    int id;
    char name[TD_STORE_MAX_KEY];
};

/* Per-(job, key) summary accumulated in C over one batch, written as one UPSERT per pair at
 * the end of the batch instead of one per row. used 0 marks an empty slot. */
struct td__summary_acc {
    int used;
    int key_id;
    int64_t job;
    int64_t added; /* rows new to the table (a replaced step adds none) */
    int64_t last_step;
    double last;
    double min, max; /* NaN while the batch brought no number (NaN samples are skipped) */
};

struct td_store {
    sqlite3 *db;
    sqlite3_stmt *stmt[TD__ST_COUNT];
    /* Interned keys: name -> id. Keys are never deleted or renamed, so an entry stays true
     * for ever once its row is committed; the cache is cleared on every rollback, because a
     * key inserted by a rolled-back batch no longer exists. */
    struct td__key_slot *keys;
    size_t keys_cap; /* slots, a power of two */
    size_t keys_used;
    /* Reused by td_store_metrics_write. */
    struct td__summary_acc *acc;
    size_t acc_cap; /* slots, a power of two */
    size_t acc_used;
    /* Backs td_metric_row.key and td_metric_summary.key until the next call. */
    char row_key[TD_STORE_MAX_KEY];
    /* Locks (store.c). */
    td_store_lock_wait lock_wait;
    double busy_since; /* monotonic ms when the current wait for a lock began */
    int in_write;      /* a write transaction of this connection is open (counted) */
};

/* Sets *out to the cached statement id, preparing sql on first use (it must be the same
 * text every time for that id). The statement comes back reset, its old bindings cleared. */
int td__store_stmt(td_store *s, int id, const char *sql, sqlite3_stmt **out, td_error_t *err);

/* Turns a failed SQLite call into a td_ error in err, naming what was being done and
 * SQLite's own message: SQLITE_FULL -> TD_EDISKFULL, SQLITE_IOERR -> TD_EIO, SQLITE_NOMEM
 * -> TD_ENOMEM, SQLITE_BUSY and SQLITE_LOCKED -> TD_EBUSY, anything else -> TD_ESTORE. Returns the
 * td_ code. Call it before anything else runs on the connection, since that replaces SQLite's
 * message. */
int td__store_fail(td_store *s, int rc, const char *what, td_error_t *err);

/* BEGIN IMMEDIATE / COMMIT / ROLLBACK. Rollback is safe to call when SQLite already rolled
 * back by itself (after SQLITE_FULL, say), never fails, and clears the key cache. Between a
 * BEGIN that succeeded and its COMMIT or ROLLBACK the connection counts as one of this
 * process's writers, which TD_STORE_NOWAIT connections wait out. */
int td__store_begin(td_store *s, td_error_t *err);
int td__store_commit(td_store *s, td_error_t *err);
void td__store_rollback(td_store *s);

/* Brings the schema at s->db to TD_STORE_SCHEMA_VERSION (schema.c). */
int td__store_migrate(td_store *s, const char *path, td_error_t *err);

/* Empties the key cache (metrics.c). */
void td__store_keys_clear(td_store *s);

/* ---- test hooks ---- */

/* Runs sql (one or more statements, no results) on the store's own connection, so a test can
 * set connection-local pragmas (max_page_count, query_only, busy_timeout). */
int td__store_exec(td_store *s, const char *sql, td_error_t *err);

/* Label selection (td_label), shared by a page of jobs and a prune: appends to sql (size
 * bytes, *n used) one condition per label, " AND json_extract(spec_json, ?P) = ?P+1" with P
 * from first (two parameters a label), on the jobs table as alias (NULL: unqualified). */
void td__store_labels_sql(char *sql, size_t size, size_t *n, const char *alias, size_t nlabels,
                          int first);
/* Binds labels[0..n) to the parameters td__store_labels_sql numbered from first. TD_EINVAL for a
 * label name that could not be a job's (labels' names are checked at submit, so none matches). */
int td__store_labels_bind(sqlite3_stmt *st, const td_label *labels, size_t n, int first,
                          td_error_t *err);
/* The SQL of a job's labels as td_job_row.labels holds them, over spec_json. */
#define TD__LABELS_COLUMN                                                                 \
    "(SELECT group_concat(key || char(31) || value, char(30)) FROM json_each(spec_json, " \
    "'$.labels') WHERE type = 'text')"

#endif
