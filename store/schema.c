/* The store's schema and its migrations. PRAGMA user_version holds the schema version; the
 * migrations are an ordered list of SQL steps, step i taking version i to i + 1, applied
 * from the file's version up to TD_STORE_SCHEMA_VERSION in one transaction, so a migration
 * either happens whole or not at all. Called from td_store_open, on the opening thread.
 *
 * To change the schema: append a step (never edit a released one) and raise
 * TD_STORE_SCHEMA_VERSION in store.h. */
#include <stdio.h>

#include "store/store_int.h"
#include "common/td_log.h"

/* Version 0 -> 1: the first schema.
 *
 * jobs: one row per submitted job; times are unix seconds, 0 for "not yet".
 * metric_keys: metric names interned as small integers, so a metric row stores 8-byte keys
 *   instead of names, and rows sort by key id.
 * metrics: one row per (job, key, step), WITHOUT ROWID so the primary key is the table's
 *   b-tree and a replayed step finds and replaces its row instead of adding one. value and
 *   time are NULL where the sample had NaN (SQLite stores NaN as NULL); they read back NaN.
 * metrics_by_step: the watch/page order, (step, key) within a job. It carries value and
 *   time too, so a page is read from the index alone without a lookup per row.
 * metric_summary: per (job, key), kept current by td_store_metrics_write.
 * job_logs: lifecycle lines and warnings, in insertion (id) order. */
static const char *const migrations[] = {
    "CREATE TABLE jobs ("
    "  id INTEGER PRIMARY KEY,"
    "  name TEXT NOT NULL,"
    "  state TEXT NOT NULL"
    "    CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),"
    "  step INTEGER NOT NULL DEFAULT 0,"
    "  total_steps INTEGER NOT NULL DEFAULT 0,"
    "  devices INTEGER NOT NULL,"
    "  device_list TEXT NOT NULL DEFAULT '',"
    "  priority INTEGER NOT NULL DEFAULT 0,"
    "  uid INTEGER NOT NULL DEFAULT -1,"
    "  err_code INTEGER NOT NULL DEFAULT 0,"
    "  err_msg TEXT,"
    "  created REAL NOT NULL,"
    "  started REAL NOT NULL DEFAULT 0,"
    "  ended REAL NOT NULL DEFAULT 0,"
    "  spec BLOB,"
    "  spec_json TEXT"
    ");"
    "CREATE INDEX jobs_state ON jobs(state);"
    "CREATE TABLE metric_keys ("
    "  id INTEGER PRIMARY KEY,"
    "  name TEXT NOT NULL UNIQUE"
    ");"
    "CREATE TABLE metrics ("
    "  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  key INTEGER NOT NULL REFERENCES metric_keys(id),"
    "  step INTEGER NOT NULL,"
    "  value REAL,"
    "  time REAL,"
    "  PRIMARY KEY (job, key, step)"
    ") WITHOUT ROWID;"
    "CREATE INDEX metrics_by_step ON metrics(job, step, key, value, time);"
    "CREATE TABLE metric_summary ("
    "  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  key INTEGER NOT NULL REFERENCES metric_keys(id),"
    "  count INTEGER NOT NULL,"
    "  last_step INTEGER NOT NULL,"
    "  last REAL,"
    "  \"min\" REAL,"
    "  \"max\" REAL,"
    "  PRIMARY KEY (job, key)"
    ") WITHOUT ROWID;"
    "CREATE TABLE job_logs ("
    "  id INTEGER PRIMARY KEY,"
    "  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  time REAL NOT NULL,"
    "  level INTEGER NOT NULL,"
    "  message TEXT NOT NULL"
    ");"
    "CREATE INDEX job_logs_by_job ON job_logs(job, id);",
    /* 2: a failed data-parallel job names each failed device: a msgpack array of
     * {device, code, message} maps, as the protocol sends it. */
    "ALTER TABLE jobs ADD COLUMN err_devices BLOB;",
    /* 3: deleting ended jobs (purge.c). jobs_deleting lists the jobs whose deletion is under
     * way: every read of jobs leaves them out from the moment they are listed, and their rows
     * go in bounded batches, the jobs row last, together with its entry here, so a deletion
     * that a stop or a crash interrupts resumes. store_meta holds 'max_job_id', the highest
     * job id ever given, so that a deleted job's id is never given again (the jobs table has
     * no AUTOINCREMENT, and a column cannot gain it). The switch to auto_vacuum=INCREMENTAL
     * is not a step here: a database created before it needs a VACUUM, which cannot run
     * inside a transaction (td_store_vacuum_convert). */
    "CREATE TABLE jobs_deleting ("
    "  id INTEGER PRIMARY KEY"
    ");"
    "CREATE TABLE store_meta ("
    "  key TEXT PRIMARY KEY,"
    "  value INTEGER NOT NULL"
    ") WITHOUT ROWID;",
    /* 4: a job that spans nodes (daemon/launch.h): the names of the nodes its last launch ran
     * on, a msgpack array of strings as the protocol's status sends it (NULL: none yet, or a
     * job of one box), and the restarts after a rank's death it has had, which count against
     * its max_restarts across a restart of the daemon too. */
    "ALTER TABLE jobs ADD COLUMN nodes BLOB;"
    "ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0;",
};

_Static_assert(sizeof(migrations) / sizeof(migrations[0]) == TD_STORE_SCHEMA_VERSION,
               "one migration step per schema version");

/* Reads PRAGMA user_version into *version. */
static int read_version(td_store *s, int *version, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc;
    int ret = 0;

    rc = sqlite3_prepare_v2(s->db, "PRAGMA user_version", -1, &st, NULL);
    if (rc == SQLITE_OK)
        rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        ret = td__store_fail(s, rc, "reading the schema version", err);
        goto out;
    }
    *version = sqlite3_column_int(st, 0);
out:
    sqlite3_finalize(st);
    return ret;
}

/* Refuses a database written by a newer traind: its schema may mean things this one does
 * not know, and writing to it could break the newer one. */
static int check_not_newer(const char *path, int version, td_error_t *err)
{
    int ret = 0;

    if (version > TD_STORE_SCHEMA_VERSION)
        ret = td_error_set(err, TD_EVERSION,
                           "store: %s has schema version %d, newer than the %d this traind "
                           "knows; use the traind that wrote it, or another database",
                           path, version, TD_STORE_SCHEMA_VERSION);
    return ret;
}

/* Applies the steps from version up, and sets user_version, inside the open transaction. */
static int apply_steps(td_store *s, int version, td_error_t *err)
{
    char sql[64];
    char what[64];
    int ret = 0;
    int v;

    for (v = version; v < TD_STORE_SCHEMA_VERSION && ret == 0; v++) {
        snprintf(what, sizeof(what), "schema migration %d -> %d", v, v + 1);
        if (sqlite3_exec(s->db, migrations[v], NULL, NULL, NULL) != SQLITE_OK)
            ret = td__store_fail(s, sqlite3_extended_errcode(s->db), what, err);
    }
    if (ret == 0) {
        snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", TD_STORE_SCHEMA_VERSION);
        ret = td__store_exec(s, sql, err);
    }
    return ret;
}

int td__store_migrate(td_store *s, const char *path, td_error_t *err)
{
    int version = 0;
    int ret;

    ret = read_version(s, &version, err);
    if (ret < 0 || (ret = check_not_newer(path, version, err)) < 0)
        goto out;
    if (version == TD_STORE_SCHEMA_VERSION)
        goto out;
    ret = td__store_begin(s, err);
    if (ret < 0)
        goto out;
    /* Read again under the write lock: another process may have migrated meanwhile. */
    ret = read_version(s, &version, err);
    if (ret == 0)
        ret = check_not_newer(path, version, err);
    if (ret == 0)
        ret = apply_steps(s, version, err);
    if (ret == 0)
        ret = td__store_commit(s, err);
    if (ret < 0) {
        td__store_rollback(s);
        goto out;
    }
    /* A fresh file is no news; migrating a file that has data in it is. */
    if (version > 0 && version < TD_STORE_SCHEMA_VERSION)
        td_log_notice("store: %s: migrated schema version %d -> %d", path, version,
                      TD_STORE_SCHEMA_VERSION);
out:
    return ret;
}
