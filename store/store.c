/* The store's connection: opening (pragmas, then the schema migrations of schema.c), closing,
 * the prepared-statement cache, transactions and the mapping of SQLite's result codes onto
 * td_ errors. A td_store is one sqlite3 connection opened in SQLite's multi-thread mode: it
 * belongs to the one thread that opened it (the daemon's loop thread or its store thread),
 * and two td_stores on the same file in two threads are two independent connections. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store_int.h"
#include "td_clock.h"
#include "td_log.h"

/* KiB of page cache per connection (SQLite's default is 2000). A job's metric tables
 * outgrow the default within a million rows, after which every batch rereads b-tree pages
 * from the WAL or the file; at 32 MiB a batch of 1000 rows writes about 1.4x faster. */
#define CACHE_KIB 32768

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
    return exec_cached(s, TD__ST_BEGIN, "BEGIN IMMEDIATE", err);
}

int td__store_commit(td_store *s, td_error_t *err)
{
    return exec_cached(s, TD__ST_COMMIT, "COMMIT", err);
}

void td__store_rollback(td_store *s)
{
    /* After SQLITE_FULL, SQLITE_IOERR or SQLITE_NOMEM SQLite may have rolled back already;
     * a ROLLBACK then would only fail with "no transaction is active". */
    if (!sqlite3_get_autocommit(s->db))
        exec_cached(s, TD__ST_ROLLBACK, "ROLLBACK", NULL);
    td__store_keys_clear(s);
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
    snprintf(sql, sizeof(sql),
             "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON; PRAGMA cache_size=-%d;",
             CACHE_KIB);
    ret = td__store_exec(s, sql, err);
out:
    return ret;
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
        ret = td__store_fail(s, rc, path, err);
        goto out;
    }
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
    /* The last connection to close checkpoints the WAL into the database and removes it. */
    rc = sqlite3_close(s->db);
    if (rc != SQLITE_OK)
        td_log_err("store: closing the database: %s (sqlite %d)", sqlite3_errstr(rc), rc);
    free(s->keys);
    free(s->acc);
    free(s);
}
