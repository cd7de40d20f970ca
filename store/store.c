/* The store's connection: opening (pragmas, then the schema migrations of schema.c), closing,
 * the prepared-statement cache, transactions and the mapping of SQLite's result codes onto
 * td_ errors. A td_store is one sqlite3 connection opened in SQLite's multi-thread mode: it
 * belongs to the one thread that opened it (the daemon's loop thread or its store thread),
 * and two td_stores on the same file in two threads are two independent connections. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/store_int.h"
#include "common/td_clock.h"
#include "common/td_log.h"

/* KiB of page cache per connection (SQLite's default is 2000). A job's metric tables
 * outgrow the default within a million rows, after which every batch rereads b-tree pages
 * from the WAL or the file; at 32 MiB a batch of 1000 rows writes about 1.4x faster. */
#define CACHE_KIB 32768

/* Write transactions open right now on any td_store of this process. A TD_STORE_NOWAIT
 * connection that finds the write lock taken waits while this is above zero: the holder is
 * then one of ours, whose transactions are short (a metric batch, a job row); at zero the
 * holder is another process, and it does not wait. */
static atomic_int writers_open;

/* Maps an SQLite result code onto a td_ code. A foreign key can only fail on a job id: every
 * foreign key in the schema points at jobs(id) or at metric_keys(id), and keys are interned
 * before the rows that use them. */
static int code_from_sqlite(int rc)
{
    int code;

    if (rc == SQLITE_CONSTRAINT_FOREIGNKEY)
        code = TD_ENOTFOUND;
    else if ((rc & 0xff) == SQLITE_FULL)
        code = TD_EDISKFULL;
    else if ((rc & 0xff) == SQLITE_IOERR)
        code = TD_EIO;
    else if ((rc & 0xff) == SQLITE_NOMEM)
        code = TD_ENOMEM;
    else if ((rc & 0xff) == SQLITE_BUSY || (rc & 0xff) == SQLITE_LOCKED)
        code = TD_EBUSY; /* another connection's lock, not waited out: the call may succeed later */
    else
        code = TD_ESTORE;
    return code;
}

int td__store_fail(td_store *s, int rc, const char *what, td_error_t *err)
{
    const char *msg = s != NULL && s->db != NULL ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc);

    return td_error_set(err, code_from_sqlite(rc), "store: %s: %s (sqlite %d)", what, msg, rc);
}

int td__store_stmt(td_store *s, int id, const char *sql, sqlite3_stmt **out, td_error_t *err)
{
    int rc = SQLITE_OK;
    int ret = 0;

    if (s->stmt[id] == NULL) {
        /* PERSISTENT: these live as long as the connection, so SQLite should not take
         * their memory from its lookaside pool meant for short-lived objects. */
        rc = sqlite3_prepare_v3(s->db, sql, -1, SQLITE_PREPARE_PERSISTENT, &s->stmt[id], NULL);
        if (rc != SQLITE_OK) {
            ret = td__store_fail(s, rc, sql, err);
            goto out;
        }
    } else {
        sqlite3_reset(s->stmt[id]);
        sqlite3_clear_bindings(s->stmt[id]);
    }
out:
    *out = s->stmt[id]; /* NULL when preparing failed */
    return ret;
}

/* Runs one cached statement that returns no rows (BEGIN, COMMIT, ROLLBACK). */
static int exec_cached(td_store *s, int id, const char *sql, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc;
    int ret;

    ret = td__store_stmt(s, id, sql, &st, err);
    if (ret < 0)
        goto out;
    rc = sqlite3_step(st);
    if (rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, sql, err);
    sqlite3_reset(st);
out:
    return ret;
}

/* IMMEDIATE takes the write lock at BEGIN, where the busy timeout applies. A deferred
 * transaction that reads first and then writes can instead fail with SQLITE_BUSY at its
 * first write without waiting, when another connection committed in between. */
int td__store_begin(td_store *s, td_error_t *err)
{
    int ret = exec_cached(s, TD__ST_BEGIN, "BEGIN IMMEDIATE", err);

    if (ret == 0 && !s->in_write) {
        s->in_write = 1;
        atomic_fetch_add(&writers_open, 1);
    }
    return ret;
}

/* The connection's write transaction is over (committed or rolled back). */
static void write_ended(td_store *s)
{
    if (s->in_write) {
        s->in_write = 0;
        atomic_fetch_sub(&writers_open, 1);
    }
}

int td__store_commit(td_store *s, td_error_t *err)
{
    int ret = exec_cached(s, TD__ST_COMMIT, "COMMIT", err);

    /* A failed COMMIT may leave the transaction open; the caller's rollback ends it. */
    if (ret == 0)
        write_ended(s);
    return ret;
}

void td__store_rollback(td_store *s)
{
    /* After SQLITE_FULL, SQLITE_IOERR or SQLITE_NOMEM SQLite may have rolled back already;
     * a ROLLBACK then would only fail with "no transaction is active". */
    if (!sqlite3_get_autocommit(s->db))
        exec_cached(s, TD__ST_ROLLBACK, "ROLLBACK", NULL);
    write_ended(s);
    td__store_keys_clear(s);
}

/* SQLite's busy handler for TD_STORE_NOWAIT connections: n is how many times it has been
 * called for this wait. Returns 1 to try again (after a millisecond), 0 to give up. */
static int busy_nowait(void *ud, int n)
{
    td_store *s = ud;
    double now = td_mono_ms(), waited;

    if (n == 0)
        s->busy_since = now;
    waited = now - s->busy_since;
    if (waited >= TD_STORE_BUSY_MS)
        return 0;
    /* The grace covers the instant between another connection's BEGIN and its count. */
    if (waited >= TD_STORE_NOWAIT_MS && atomic_load(&writers_open) == 0)
        return 0;
    sqlite3_sleep(1);
    return 1;
}

void td_store_set_lock_wait(td_store *s, td_store_lock_wait how)
{
    s->lock_wait = how;
    if (how == TD_STORE_NOWAIT)
        sqlite3_busy_handler(s->db, busy_nowait, s);
    else
        sqlite3_busy_timeout(s->db, TD_STORE_BUSY_MS);
}

int td__store_exec(td_store *s, const char *sql, td_error_t *err)
{
    int rc = sqlite3_exec(s->db, sql, NULL, NULL, NULL);

    return rc == SQLITE_OK ? 0 : td__store_fail(s, rc, sql, err);
}

/* Reads a pragma that answers with one text row, e.g. journal_mode, into buf. */
static int pragma_text(td_store *s, const char *sql, char *buf, size_t len, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc;
    int ret = 0;

    rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        ret = td__store_fail(s, rc, sql, err);
        goto out;
    }
    snprintf(buf, len, "%s", (const char *)sqlite3_column_text(st, 0));
out:
    sqlite3_finalize(st);
    return ret;
}

/* The connection's settings. They are per connection (journal_mode=WAL also persists in the
 * file), so every open sets them. */
static int configure(td_store *s, const char *path, td_error_t *err)
{
    char mode[16];
    char sql[128];
    int ret;

    sqlite3_extended_result_codes(s->db, 1);
    /* Lock waits (another connection writing, a checkpoint) retry for up to this long before
     * a statement fails with SQLITE_BUSY. */
    sqlite3_busy_timeout(s->db, TD_STORE_BUSY_MS);
    /* Incremental auto-vacuum (store.h, "Space"): deleted jobs' pages can go back to the file
     * system. It takes effect only on a database that has no tables yet, so it comes before
     * the WAL switch, which writes the file's first page; an older database needs a VACUUM
     * (td_store_vacuum_convert), and this is a no-op on it. */
    ret = td__store_exec(s, "PRAGMA auto_vacuum=INCREMENTAL", err);
    if (ret < 0)
        goto out;
    /* WAL: readers (watchers, trainctl, anyone with sqlite3) never block the writer and see
     * only committed transactions. */
    ret = pragma_text(s, "PRAGMA journal_mode=WAL", mode, sizeof(mode), err);
    if (ret < 0)
        goto out;
    if (strcmp(mode, "wal") != 0) {
        ret = td_error_set(err, TD_ESTORE, "store: %s: cannot use WAL mode (journal_mode is %s)",
                           path, mode);
        goto out;
    }
    /* synchronous=NORMAL in WAL mode: a commit appends to the WAL without an fsync; the WAL
     * is synced at checkpoints. A crash of the process (kill -9, abort, the daemon's failure
     * model) loses no committed transaction, because the data is already in the OS's page
     * cache. A power loss or kernel crash can lose the last transactions committed since the
     * last sync, but never corrupts the database. FULL would fsync every metric batch. */
    /* journal_size_limit: a WAL that grew while a reader held checkpoints back is cut back to
     * this size the next time it is reset, instead of keeping its largest size for ever. */
    snprintf(sql, sizeof(sql),
             "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON; PRAGMA cache_size=-%d; "
             "PRAGMA journal_size_limit=%d;",
             CACHE_KIB, TD_STORE_WAL_KEEP_BYTES);
    ret = td__store_exec(s, sql, err);
out:
    return ret;
}

/* Why path cannot be opened for writing, in words, into why (empty when nothing is found
 * wrong): SQLite's own "unable to open database file" names neither the file nor the reason. */
static void open_problem(const char *path, char *why, size_t size)
{
    char dir[1024];
    const char *slash = strrchr(path, '/');
    struct stat st;
    int file_exists;

    why[0] = '\0';
    if (slash == NULL)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (stat(dir, &st) != 0) {
        snprintf(why, size, "directory %s: %s", dir, strerror(errno));
        return;
    }
    if (!S_ISDIR(st.st_mode)) {
        snprintf(why, size, "%s is not a directory", dir);
        return;
    }
    file_exists = stat(path, &st) == 0;
    if (file_exists && S_ISDIR(st.st_mode))
        snprintf(why, size, "%s is a directory", path);
    else if (file_exists && access(path, R_OK | W_OK) != 0)
        snprintf(why, size, "%s is not writable: %s", path, strerror(errno));
    else if (access(dir, W_OK | X_OK) != 0)
        /* SQLite creates the file, and its -wal and -shm beside it, in the directory. */
        snprintf(why, size, "directory %s is not writable: %s", dir, strerror(errno));
}

/* A failure to open path: TD_ESTORE naming the file and, where it can be found, the reason. */
static int open_failed(td_store *s, int rc, const char *path, td_error_t *err)
{
    char why[1200];

    open_problem(path, why, sizeof(why));
    if (why[0] == '\0')
        return td__store_fail(s, rc, path, err);
    return td_error_set(err, TD_ESTORE, "store: cannot open %s: %s", path, why);
}

int td_store_open(td_store **out, const char *path, td_error_t *err)
{
    td_store *s;
    int rc;
    int ret = 0;

    s = calloc(1, sizeof(*s));
    if (s == NULL) {
        ret = td_error_set(err, TD_ENOMEM, "store: out of memory opening %s", path);
        goto out;
    }
    /* NOMUTEX: a connection is used by one thread only, so SQLite's per-connection mutex
     * would be pure cost. */
    rc = sqlite3_open_v2(path, &s->db,
                         SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, NULL);
    if (rc != SQLITE_OK) {
        ret = open_failed(s, rc, path, err);
        goto out;
    }
    /* SQLite opens a file it may not write read-only, without a word; every write would then
     * fail later, far from the cause. */
    if (sqlite3_db_readonly(s->db, "main") == 1) {
        char why[1200];
        open_problem(path, why, sizeof(why));
        ret = td_error_set(err, TD_ESTORE, "store: cannot open %s for writing%s%s", path,
                           why[0] != '\0' ? ": " : "", why);
        goto out;
    }
    s->lock_wait = TD_STORE_WAIT;
    ret = configure(s, path, err);
    if (ret < 0)
        goto out;
    ret = td__store_migrate(s, path, err);
out:
    if (ret < 0) {
        td_store_close(s);
        s = NULL;
    }
    *out = s;
    return ret;
}

void td_store_close(td_store *s)
{
    int rc;
    int i;

    if (s == NULL)
        return;
    for (i = 0; i < TD__ST_COUNT; i++)
        sqlite3_finalize(s->stmt[i]);
    write_ended(s);
    /* The last connection to close checkpoints the WAL into the database and removes it. */
    rc = sqlite3_close(s->db);
    if (rc != SQLITE_OK)
        td_log_err("store: closing the database: %s (sqlite %d)", sqlite3_errstr(rc), rc);
    free(s->keys);
    free(s->acc);
    free(s);
}

void td_store_set_autocheckpoint(td_store *s, int pages)
{
    sqlite3_wal_autocheckpoint(s->db, pages > 0 ? pages : 0);
}

int64_t td_store_wal_bytes(const td_store *s)
{
    const char *db = sqlite3_db_filename(s->db, "main");
    char path[1100];
    struct stat st;

    if (db == NULL || db[0] == '\0' ||
        snprintf(path, sizeof(path), "%s-wal", db) >= (int)sizeof(path) || stat(path, &st) != 0)
        return 0;
    return (int64_t)st.st_size;
}

int td_store_wal_checkpoint(td_store *s, td_store_wal *out, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int frames = 0, done = 0, rc;

    memset(out, 0, sizeof(*out));
    rc = sqlite3_wal_checkpoint_v2(s->db, NULL, SQLITE_CHECKPOINT_PASSIVE, &frames, &done);
    /* BUSY: another connection was checkpointing; what it copies is copied all the same. */
    if (rc != SQLITE_OK && (rc & 0xff) != SQLITE_BUSY)
        return td__store_fail(s, rc, "checkpointing the WAL", err);
    out->frames = frames > 0 ? frames : 0;
    out->checkpointed = done > 0 ? done : 0;
    out->file_bytes = td_store_wal_bytes(s);
    if (sqlite3_prepare_v2(s->db, "PRAGMA page_size", -1, &st, NULL) == SQLITE_OK &&
        sqlite3_step(st) == SQLITE_ROW)
        out->page_bytes = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return 0;
}
