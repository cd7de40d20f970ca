/* The SQLite store: schema and migrations (PRAGMA user_version), jobs, interned metric keys,
 * metric rows keyed (job, key, step) WITHOUT ROWID with a per-(job, key) summary, and job
 * log lines. WAL mode, BEGIN IMMEDIATE for writes, and a choice of how long a connection
 * waits on a lock another connection holds (td_store_set_lock_wait).
 *
 * A td_store is one sqlite3 connection and belongs to one thread: the daemon opens one for
 * its loop thread (jobs, reads for status/list/watch) and one for its store thread (metric
 * batches). Reads never keep a transaction open between calls, so the WAL can checkpoint
 * while a watcher streams. Knows nothing of training or of the wire.
 *
 * Locks. SQLite lets one connection write at a time; in WAL mode readers never wait. A
 * connection in the default mode (TD_STORE_WAIT) waits up to TD_STORE_BUSY_MS for the write
 * lock, as SQLite's busy timeout does. One in TD_STORE_NOWAIT mode waits only while another
 * connection of this same process is inside a write transaction (the daemon's own, short by
 * construction); a lock held by another process (an sqlite3 shell inside BEGIN IMMEDIATE, a
 * backup tool) fails its write after TD_STORE_NOWAIT_MS with TD_EBUSY, so that the caller can
 * keep the write and try again later instead of blocking its thread. Any call that meets a lock
 * it does not wait out (SQLITE_BUSY or SQLITE_LOCKED) fails with TD_EBUSY: the same call can
 * succeed later.
 *
 * Files. The database, its -wal and its -shm are created with the process's umask (SQLite
 * gives the -wal and -shm the database's own mode). A checkpoint copies the WAL back into the
 * database; it cannot pass a page that a reader's open transaction still needs, so a reader
 * that keeps a transaction open stops the WAL from being reused and it grows for as long as
 * that transaction lasts (td_store_wal_checkpoint reports it). Once a checkpoint completes,
 * the next write truncates the WAL file back to TD_STORE_WAL_KEEP_BYTES. */
#ifndef TD_STORE_H
#define TD_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_STORE_SCHEMA_VERSION 4
#define TD_STORE_MAX_KEY        64         /* bytes of a metric name, NUL included */
#define TD_STORE_MAX_NAME       128        /* bytes of a job name, NUL included */
#define TD_STORE_MAX_STATE      16         /* bytes of a state word, NUL included */
#define TD_STORE_BUSY_MS        10000      /* milliseconds a statement waits for a lock */
#define TD_STORE_NOWAIT_MS      20         /* ms a TD_STORE_NOWAIT write waits on another process */
#define TD_STORE_WAL_KEEP_BYTES (16 << 20) /* bytes the WAL file is truncated to once reset */

typedef struct td_store td_store;

/* Opens (creating or migrating) the database at path. A database whose user_version is newer
 * than TD_STORE_SCHEMA_VERSION is refused with TD_EVERSION. A file that cannot be opened for
 * writing is refused with TD_ESTORE and a message naming the reason: the directory is missing,
 * is not a directory or is not writable, or the file is a directory or not writable. The
 * connection starts in TD_STORE_WAIT mode. Caller closes with td_store_close(). */
int td_store_open(td_store **out, const char *path, td_error_t *err);
void td_store_close(td_store *s);

/* How a connection waits for a lock another connection holds (see "Locks" above). */
typedef enum td_store_lock_wait {
    TD_STORE_WAIT,   /* up to TD_STORE_BUSY_MS, whoever holds it: the default */
    TD_STORE_NOWAIT, /* only while this process's own other connection writes (at most
                      * TD_STORE_BUSY_MS); another process's lock fails the call after
                      * TD_STORE_NOWAIT_MS with TD_EBUSY ("database is locked") */
} td_store_lock_wait;
void td_store_set_lock_wait(td_store *s, td_store_lock_wait how);

/* ---- the WAL ---- */

/* What a checkpoint found (td_store_wal_checkpoint). */
typedef struct td_store_wal {
    int64_t file_bytes;   /* the -wal file's size now; 0 when there is none */
    int64_t frames;       /* pages written to the WAL since it was last reset */
    int64_t checkpointed; /* of them, copied back into the database */
    int64_t page_bytes;   /* the database's page size */
} td_store_wal;

/* Runs a passive checkpoint (it never waits for a lock, and never makes anyone wait) and
 * fills *out. frames > checkpointed after it means a reader's open transaction holds the rest
 * back, or a writer was busy. 0, or a td_ error (TD_EIO for a failed copy). */
int td_store_wal_checkpoint(td_store *s, td_store_wal *out, td_error_t *err);

/* How many WAL pages a commit on s may leave before it checkpoints them itself, on its own
 * thread (SQLite's wal_autocheckpoint; 1000 by default); 0: never (another connection must
 * then checkpoint, or the WAL grows). */
void td_store_set_autocheckpoint(td_store *s, int pages);

/* The size in bytes of the database's -wal file, 0 when there is none. */
int64_t td_store_wal_bytes(const td_store *s);

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
    void *nodes; /* malloc'd msgpack array of the node names a job that spans nodes last ran
                  * on; NULL if none */
    size_t nodes_len;
    int restarts; /* relaunches after a rank's death so far */
    /* malloc'd: the job's labels (its spec's labels object) as "name\x1fvalue\x1ename..."
     * (unit and record separators, which text never holds); NULL for none */
    char *labels;
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

/* Which jobs td_store_job_page() reads, and from where. Zero it, then set the filters wanted;
 * every filter set must hold. */
#define TD_STORE_MAX_STATES 5 /* state words one query may name: there are five */
/* A label a job must have, with this value (spec.labels.key == value). */
#define TD_STORE_MAX_LABELS 16
typedef struct td_label {
    const char *key, *value;
} td_label;

typedef struct td_job_query {
    const char *const *states; /* nstates TD_JOB_* words: the job is in one of them */
    size_t nstates;            /* 0: any state */
    int by_uid;                /* set: only jobs of uid */
    int64_t uid;
    const char *name_glob;  /* NULL: any name; else SQLite's GLOB, case-sensitive: * ? [a-z] [^x] */
    double since;           /* > 0: only jobs created at or after this unix time */
    int64_t after;          /* > 0: only jobs past this id in the listing's order (the cursor) */
    int newest_first;       /* descending id order (newest first) instead of ascending */
    const td_label *labels; /* nlabels (at most TD_STORE_MAX_LABELS): the job has them all */
    size_t nlabels;
} td_job_query;

/* Reads up to limit jobs that match q, past its cursor, in its order, without their specs,
 * into a malloc'd array (caller clears each row and frees the array); *more is set when more
 * jobs match past the last one read. Pass the last row's id as the next query's after to
 * read the next page. Each call is one statement: a listing of many pages holds no
 * transaction between them, and a job inserted meanwhile appears in a later page when it
 * falls past the cursor. TD_EINVAL for an unknown state word or limit 0. */
int td_store_job_page(td_store *s, const td_job_query *q, size_t limit, td_job_row **rows,
                      size_t *n, int *more, td_error_t *err);

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

/* Records the nodes a job that spans nodes runs on (msgpack bytes, copied; NULL clears) and
 * the restarts it has had. TD_ENOTFOUND for no such job. */
int td_store_job_set_nodes(td_store *s, int64_t id, const void *blob, size_t len, int restarts,
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

/* ---- deleting ended jobs (purge.c) ----
 *
 * A deletion has two halves. Marking lists jobs in jobs_deleting, in one short transaction:
 * from then on no read of the store sees them (td_store_job_get says TD_ENOTFOUND, pages and
 * lists leave them out), and a stop or a crash cannot bring them back. Purging then deletes
 * the marked jobs' rows in bounded steps (td_store_purge_step), each its own short
 * transaction, a job's row last. Only ended jobs are marked: succeeded, failed
 * or cancelled. Job ids are never given twice: a new job's id is above every id ever given,
 * deleted ones included.
 *
 * Space. A database with auto_vacuum=INCREMENTAL (every one created by this version) gives the
 * pages that deleted rows leave free back to the file system, a bounded number at a time
 * (td_store_vacuum_step). One created before keeps them on its freelist, where later writes
 * reuse them, until it is converted (td_store_vacuum_convert, a VACUUM). */

/* A job as a deletion lists it. */
typedef struct td_job_brief {
    int64_t id;
    char name[TD_STORE_MAX_NAME];
    char state[TD_STORE_MAX_STATE];
    int64_t uid;
    double ended;        /* unix seconds */
    int64_t metric_rows; /* rows of its metrics (the summary's counts) */
} td_job_brief;

/* Called for each job a deletion lists, in id order; job is valid for the call only. A
 * non-zero return stops the listing (not the marking: every job selected is marked). */
typedef int (*td_job_brief_cb)(void *ud, const td_job_brief *job);

/* What a deletion selected: jobs, and their metric rows. */
typedef struct td_purge_totals {
    int64_t jobs;
    int64_t metric_rows;
} td_purge_totals;

/* Which ended jobs td_store_prune() selects. Zero it, then set what is wanted. */
typedef struct td_prune_query {
    const char *const *states; /* nstates of succeeded, failed, cancelled; 0: all three */
    size_t nstates;
    double ended_before; /* only jobs that ended at or before this unix time */
    int by_uid;          /* set: only jobs of uid */
    int64_t uid;
    const td_label *labels; /* nlabels (at most TD_STORE_MAX_LABELS): the job has them all */
    size_t nlabels;
} td_prune_query;

/* Selects the ended jobs q names that are not being deleted already, calls cb for each (id
 * order) and fills *tot; with mark set, marks them all for deletion in the same transaction,
 * so that exactly the jobs listed are marked. TD_EINVAL for a state that is not an ended one. */
int td_store_prune(td_store *s, const td_prune_query *q, int mark, td_job_brief_cb cb, void *ud,
                   td_purge_totals *tot, td_error_t *err);

/* Marks jobs ids[0..n) for deletion in one transaction, calling cb for each and filling *tot;
 * all or none: TD_ENOTFOUND ("no job 12") for a job that does not exist or is being deleted
 * already, TD_ESTATE ("job 12 is running") for one that has not ended, TD_EINVAL for an id
 * named twice. */
int td_store_jobs_mark(td_store *s, const int64_t *ids, size_t n, td_job_brief_cb cb, void *ud,
                       td_purge_totals *tot, td_error_t *err);

/* The lowest id among the jobs being deleted into *job (0 when none), and how many there are
 * into *pending (may be NULL). */
int td_store_purge_next(td_store *s, int64_t *job, int64_t *pending, td_error_t *err);

/* Called for each job a purge step is about to finish, inside its transaction: the caller's
 * own cleanup of the job (the daemon removes its checkpoints) before its row goes. */
typedef void (*td_purge_gone_cb)(void *ud, int64_t job);

/* One step of deleting the marked jobs, in one transaction: takes them lowest id first,
 * deletes up to limit rows in all (metric rows, then log lines), and finishes each job that
 * has none left: gone(ud, job) (may be NULL), then its metric summary, its row and its mark go,
 * and its id stays given. Sets *jobs to the jobs finished and *rows to the rows deleted; both
 * 0 when nothing is marked. TD_EINVAL for limit 0. */
int td_store_purge_step(td_store *s, size_t limit, td_purge_gone_cb gone, void *ud, int64_t *jobs,
                        size_t *rows, td_error_t *err);

/* Sets *exists to whether job has a row and is not being deleted. */
int td_store_job_exists(td_store *s, int64_t job, int *exists, td_error_t *err);

/* Jobs per state, those being deleted left out: counts[i] for TD_JOB_QUEUED, RUNNING,
 * SUCCEEDED, FAILED, CANCELLED in that order. One read; it never waits for a lock. */
#define TD_STORE_NSTATES 5
int td_store_job_counts(td_store *s, int64_t counts[TD_STORE_NSTATES], td_error_t *err);

/* The database's size and how it gives space back. */
typedef struct td_store_space {
    int64_t page_bytes;
    int64_t pages;      /* the database's size is pages * page_bytes */
    int64_t free_pages; /* of them, unused (the freelist) */
    int auto_vacuum;    /* 0 none (free pages stay in the file), 1 full, 2 incremental */
} td_store_space;
int td_store_space_get(td_store *s, td_store_space *out, td_error_t *err);

/* Gives up to pages of the free pages back to the file system (PRAGMA incremental_vacuum) in
 * one transaction, and sets *left to the free pages still in the database. With auto_vacuum
 * other than incremental it gives nothing back (*left says what stays). In WAL mode the file
 * itself shrinks at the next checkpoint. */
int td_store_vacuum_step(td_store *s, int64_t pages, int64_t *left, td_error_t *err);

/* A database created before auto_vacuum=INCREMENTAL gets it through a VACUUM, which rewrites
 * the whole file (it needs as much room again, for a while, and holds the write lock). Sets
 * *done to 1 when it converted now, 0 when there was nothing to do, -1 when the database is
 * larger than max_bytes and was left as it is. The caller must hold no statement open. */
int td_store_vacuum_convert(td_store *s, int64_t max_bytes, int *done, td_error_t *err);

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
