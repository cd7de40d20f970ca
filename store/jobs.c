/* Jobs and their log lines in the store: insert, read, list, state changes, progress, the
 * requeue at daemon start, and the job log. Called on the thread that owns the td_store (in
 * the daemon, the loop thread). The store records states; which moves are allowed is the
 * scheduler's business, not checked here. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_int.h"
#include "common/td_clock.h"

/* The columns of td_job_row, in the order row_read expects them. */
#define JOB_COLUMNS                                                                       \
    "id, name, state, step, total_steps, devices, device_list, priority, uid, err_code, " \
    "err_msg, created, started, ended, err_devices, nodes, restarts, " TD__LABELS_COLUMN

void td_job_row_clear(td_job_row *row)
{
    if (row == NULL)
        return;
    free(row->err_msg);
    free(row->spec);
    free(row->spec_json);
    free(row->err_devices);
    free(row->nodes);
    free(row->labels);
    row->labels = NULL;
    row->nodes = NULL;
    row->nodes_len = 0;
    row->err_devices = NULL;
    row->err_devices_len = 0;
    row->err_msg = NULL;
    row->spec = NULL;
    row->spec_len = 0;
    row->spec_json = NULL;
}

/* Copies a text column into a fixed buffer; NULL reads as "". The store refuses values that
 * would not fit on the way in, so nothing is cut here. */
static void text_copy(char *dst, size_t len, sqlite3_stmt *st, int col)
{
    const unsigned char *t = sqlite3_column_text(st, col);

    snprintf(dst, len, "%s", t != NULL ? (const char *)t : "");
}

/* Sets *out to a malloc'd copy of column col's bytes (NUL added), or NULL for SQL NULL. */
static int bytes_dup(sqlite3_stmt *st, int col, int as_text, void **out, size_t *len)
{
    const void *p =
        as_text ? (const void *)sqlite3_column_text(st, col) : sqlite3_column_blob(st, col);
    size_t n = (size_t)sqlite3_column_bytes(st, col);
    int ret = 0;

    *out = NULL;
    *len = 0;
    if (sqlite3_column_type(st, col) == SQLITE_NULL)
        goto out;
    *out = malloc(n + 1);
    if (*out == NULL) {
        ret = TD_ENOMEM;
        goto out;
    }
    if (n > 0)
        memcpy(*out, p, n);
    ((char *)*out)[n] = '\0';
    *len = n;
out:
    return ret;
}

/* Fills row from the current result row of st (JOB_COLUMNS, then spec, spec_json). */
static int row_read(sqlite3_stmt *st, td_job_row *row, td_error_t *err)
{
    size_t len;
    int ret;

    memset(row, 0, sizeof(*row));
    row->id = sqlite3_column_int64(st, 0);
    text_copy(row->name, sizeof(row->name), st, 1);
    text_copy(row->state, sizeof(row->state), st, 2);
    row->step = sqlite3_column_int64(st, 3);
    row->total_steps = sqlite3_column_int64(st, 4);
    row->devices = sqlite3_column_int(st, 5);
    text_copy(row->device_list, sizeof(row->device_list), st, 6);
    row->priority = sqlite3_column_int(st, 7);
    row->uid = sqlite3_column_int64(st, 8);
    row->err_code = sqlite3_column_int(st, 9);
    row->created = sqlite3_column_double(st, 11);
    row->started = sqlite3_column_double(st, 12);
    row->ended = sqlite3_column_double(st, 13);
    ret = bytes_dup(st, 10, 1, (void **)&row->err_msg, &len);
    if (ret == 0)
        ret = bytes_dup(st, 14, 0, &row->err_devices, &row->err_devices_len);
    if (ret == 0)
        ret = bytes_dup(st, 15, 0, &row->nodes, &row->nodes_len);
    row->restarts = sqlite3_column_int(st, 16);
    if (ret == 0)
        ret = bytes_dup(st, 17, 1, (void **)&row->labels, &len);
    if (ret == 0)
        ret = bytes_dup(st, 18, 0, &row->spec, &row->spec_len);
    if (ret == 0)
        ret = bytes_dup(st, 19, 1, (void **)&row->spec_json, &len);
    if (ret < 0) {
        td_job_row_clear(row);
        td_error_set(err, ret, "store: out of memory reading job %lld", (long long)row->id);
    }
    return ret;
}

/* Runs one bound write statement in its own BEGIN IMMEDIATE transaction. Sets *changes to
 * the rows it changed, when changes is not NULL. */
static int write_one(td_store *s, sqlite3_stmt *st, const char *what, int *changes, td_error_t *err)
{
    int rc;
    int ret;

    ret = td__store_begin(s, err);
    if (ret < 0)
        goto out;
    rc = sqlite3_step(st);
    if (rc != SQLITE_DONE) {
        ret = td__store_fail(s, rc, what, err);
        sqlite3_reset(st);
        td__store_rollback(s);
        goto out;
    }
    sqlite3_reset(st);
    if (changes != NULL)
        *changes = sqlite3_changes(s->db);
    ret = td__store_commit(s, err);
    if (ret < 0)
        td__store_rollback(s);
out:
    return ret;
}

/* write_one for a statement that updates job id's row: TD_ENOTFOUND when there is no such
 * job. Clears the statement's bindings after, since SQLITE_STATIC binds borrow the caller's
 * memory only for the call. */
static int write_job(td_store *s, sqlite3_stmt *st, int64_t id, const char *what, td_error_t *err)
{
    int changes = 0;
    int ret = write_one(s, st, what, &changes, err);

    if (ret == 0 && changes == 0)
        ret = td_error_set(err, TD_ENOTFOUND, "store: no job %lld", (long long)id);
    sqlite3_clear_bindings(st);
    return ret;
}

/* Binds len bytes of blob to parameter i, or NULL when blob is NULL. */
static void bind_blob_or_null(sqlite3_stmt *st, int i, const void *blob, size_t len)
{
    if (blob != NULL)
        sqlite3_bind_blob(st, i, blob, (int)len, SQLITE_STATIC);
    else
        sqlite3_bind_null(st, i);
}

/* Checks that a string fits a fixed field of len bytes (NUL included). */
static int check_fits(const char *field, const char *v, size_t len, td_error_t *err)
{
    size_t n = strnlen(v, len);
    int ret = 0;

    if (n >= len)
        ret = td_error_set(err, TD_EINVAL, "store: %s is too long (at most %zu bytes)", field,
                           len - 1);
    return ret;
}

int td_store_job_insert(td_store *s, const char *name, int devices, int priority, int64_t uid,
                        const void *spec, size_t spec_len, const char *spec_json, int64_t *id_out,
                        td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    if (name == NULL || devices < 0 || (spec == NULL && spec_len > 0)) {
        ret = td_error_set(err, TD_EINVAL, "store: job insert: bad argument");
        goto out;
    }
    ret = check_fits("job name", name, TD_STORE_MAX_NAME, err);
    if (ret < 0)
        goto out;
    ret = td__store_stmt(s, TD__ST_JOB_INSERT,
                         "INSERT INTO jobs (id, name, state, devices, priority, uid, created, "
                         "spec, spec_json) VALUES (" TD__NEXT_JOB_ID
                         ", ?1, 'queued', ?2, ?3, ?4, ?5, ?6, ?7)",
                         &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, devices);
    sqlite3_bind_int(st, 3, priority);
    sqlite3_bind_int64(st, 4, uid);
    sqlite3_bind_double(st, 5, td_wall_s());
    if (spec != NULL)
        sqlite3_bind_blob64(st, 6, spec, spec_len, SQLITE_STATIC);
    if (spec_json != NULL)
        sqlite3_bind_text(st, 7, spec_json, -1, SQLITE_STATIC);
    ret = write_one(s, st, "inserting a job", NULL, err);
    if (ret == 0)
        *id_out = sqlite3_last_insert_rowid(s->db);
    /* Drop the borrowed pointers now: SQLITE_STATIC binds must not outlive the call. */
    sqlite3_clear_bindings(st);
out:
    return ret;
}

int td_store_job_get(td_store *s, int64_t id, td_job_row *row, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc;
    int ret;

    ret = td__store_stmt(s, TD__ST_JOB_GET,
                         "SELECT " JOB_COLUMNS ", spec, spec_json FROM jobs WHERE id = ?1 "
                         "AND " TD__NOT_DELETING,
                         &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        ret = row_read(st, row, err);
    else if (rc == SQLITE_DONE)
        ret = td_error_set(err, TD_ENOTFOUND, "store: no job %lld", (long long)id);
    else
        ret = td__store_fail(s, rc, "reading a job", err);
    sqlite3_reset(st);
out:
    return ret;
}

/* Frees n rows and the array. */
static void rows_free(td_job_row *rows, size_t n)
{
    size_t i;

    for (i = 0; i < n; i++)
        td_job_row_clear(&rows[i]);
    free(rows);
}

/* Makes room for one more row in *rows (capacity *cap). */
static int rows_grow(td_job_row **rows, size_t n, size_t *cap, td_error_t *err)
{
    size_t ncap = *cap == 0 ? 16 : *cap * 2;
    td_job_row *p;
    int ret = 0;

    if (n < *cap)
        goto out;
    p = ncap < SIZE_MAX / sizeof(*p) ? realloc(*rows, ncap * sizeof(*p)) : NULL;
    if (p == NULL) {
        ret = td_error_set(err, TD_ENOMEM, "store: out of memory listing %zu jobs", n);
        goto out;
    }
    *rows = p;
    *cap = ncap;
out:
    return ret;
}

int td_store_job_list(td_store *s, int with_spec, td_job_row **rows, size_t *n, td_error_t *err)
{
    td_job_row *r = NULL;
    size_t cap = 0;
    size_t k = 0;
    sqlite3_stmt *st = NULL;
    int rc = SQLITE_ROW;
    int ret;

    /* Two statements, so that a list without specs never reads the spec blobs' pages. */
    if (with_spec)
        ret = td__store_stmt(s, TD__ST_JOB_LIST_SPEC,
                             "SELECT " JOB_COLUMNS
                             ", spec, spec_json FROM jobs WHERE " TD__NOT_DELETING " ORDER BY id",
                             &st, err);
    else
        ret = td__store_stmt(s, TD__ST_JOB_LIST,
                             "SELECT " JOB_COLUMNS ", NULL, NULL FROM jobs WHERE " TD__NOT_DELETING
                             " ORDER BY id",
                             &st, err);
    while (ret == 0 && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        ret = rows_grow(&r, k, &cap, err);
        if (ret == 0)
            ret = row_read(st, &r[k], err);
        if (ret == 0)
            k++;
    }
    if (ret == 0 && rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "listing jobs", err);
    if (ret == 0) {
        sqlite3_reset(st);
    } else {
        if (st != NULL)
            sqlite3_reset(st);
        rows_free(r, k);
        r = NULL;
        k = 0;
    }
    *rows = r;
    *n = k;
    return ret;
}

/* Whether state is one of the five words of store.h, and whether it is final. */
static int state_known(const char *state, int *final)
{
    *final = strcmp(state, TD_JOB_SUCCEEDED) == 0 || strcmp(state, TD_JOB_FAILED) == 0 ||
             strcmp(state, TD_JOB_CANCELLED) == 0;
    return *final || strcmp(state, TD_JOB_QUEUED) == 0 || strcmp(state, TD_JOB_RUNNING) == 0;
}

/* Prepares and binds the statement for a move to state (one per kind of move). */
static int state_stmt(td_store *s, int64_t id, const char *state, const char *device_list,
                      int err_code, const char *err_msg, sqlite3_stmt **out, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int final;
    int ret;

    if (!state_known(state, &final)) {
        ret = td_error_set(err, TD_EINVAL, "store: job %lld: unknown state \"%.*s\"", (long long)id,
                           TD_STORE_MAX_STATE, state);
    } else if (strcmp(state, TD_JOB_RUNNING) == 0) {
        ret = check_fits("device list", device_list != NULL ? device_list : "",
                         sizeof(((td_job_row *)0)->device_list), err);
        if (ret == 0)
            ret = td__store_stmt(s, TD__ST_JOB_RUNNING,
                                 "UPDATE jobs SET state = ?2, started = ?3, device_list = ?4 "
                                 "WHERE id = ?1",
                                 &st, err);
        if (ret == 0) {
            sqlite3_bind_double(st, 3, td_wall_s());
            sqlite3_bind_text(st, 4, device_list != NULL ? device_list : "", -1, SQLITE_STATIC);
        }
    } else if (final) {
        ret = td__store_stmt(s, TD__ST_JOB_FINAL,
                             "UPDATE jobs SET state = ?2, ended = ?3, err_code = ?4, "
                             "err_msg = ?5 WHERE id = ?1",
                             &st, err);
        if (ret == 0) {
            sqlite3_bind_double(st, 3, td_wall_s());
            sqlite3_bind_int(st, 4, err_code);
            if (err_msg != NULL)
                sqlite3_bind_text(st, 5, err_msg, -1, SQLITE_STATIC);
        }
    } else {
        /* Back to queued: it holds no devices, and has neither ended nor failed. started
         * keeps the first start, as history. */
        ret = td__store_stmt(s, TD__ST_JOB_QUEUED,
                             "UPDATE jobs SET state = ?2, device_list = '', ended = 0, "
                             "err_code = 0, err_msg = NULL, err_devices = NULL WHERE id = ?1",
                             &st, err);
    }
    if (ret == 0) {
        sqlite3_bind_int64(st, 1, id);
        sqlite3_bind_text(st, 2, state, -1, SQLITE_STATIC);
    }
    *out = st;
    return ret;
}

int td_store_job_set_state(td_store *s, int64_t id, const char *state, const char *device_list,
                           int err_code, const char *err_msg, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    if (state == NULL) {
        ret = td_error_set(err, TD_EINVAL, "store: job %lld: no state", (long long)id);
        goto out;
    }
    ret = state_stmt(s, id, state, device_list, err_code, err_msg, &st, err);
    if (ret == 0)
        ret = write_job(s, st, id, "setting a job's state", err);
out:
    return ret;
}

int td_store_job_set_spec_json(td_store *s, int64_t id, const void *blob, size_t len,
                               const char *json, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    if ((blob == NULL && len > 0) || len > (size_t)INT_MAX) {
        ret = td_error_set(err, TD_EINVAL, "store: job %lld: bad spec argument", (long long)id);
        goto out;
    }
    ret = td__store_stmt(s, TD__ST_JOB_SPEC,
                         "UPDATE jobs SET spec = ?2, spec_json = ?3 WHERE id = ?1", &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, id);
    bind_blob_or_null(st, 2, blob, len);
    if (json != NULL)
        sqlite3_bind_text(st, 3, json, -1, SQLITE_STATIC);
    else
        sqlite3_bind_null(st, 3);
    ret = write_job(s, st, id, "replacing a job's spec", err);
out:
    return ret;
}

int td_store_job_set_error_devices(td_store *s, int64_t id, const void *blob, size_t len,
                                   td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    ret = td__store_stmt(s, TD__ST_JOB_ERR_DEVICES,
                         "UPDATE jobs SET err_devices = ?2 WHERE id = ?1", &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, id);
    bind_blob_or_null(st, 2, blob, len);
    ret = write_job(s, st, id, "recording a job's device errors", err);
out:
    return ret;
}

int td_store_job_set_nodes(td_store *s, int64_t id, const void *blob, size_t len, int restarts,
                           td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    ret = td__store_stmt(s, TD__ST_JOB_NODES,
                         "UPDATE jobs SET nodes = ?2, restarts = ?3 WHERE id = ?1", &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, id);
    bind_blob_or_null(st, 2, blob, len);
    sqlite3_bind_int(st, 3, restarts);
    ret = write_job(s, st, id, "recording a job's nodes", err);
out:
    return ret;
}

int td_store_job_set_progress(td_store *s, int64_t id, int64_t step, int64_t total_steps,
                              td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int ret;

    ret = td__store_stmt(s, TD__ST_JOB_PROGRESS,
                         "UPDATE jobs SET step = ?2, total_steps = ?3 WHERE id = ?1", &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, step);
    sqlite3_bind_int64(st, 3, total_steps);
    ret = write_job(s, st, id, "setting a job's progress", err);
out:
    return ret;
}

int td_store_jobs_requeue_running(td_store *s, int *n, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int changes = 0;
    int ret;

    ret = td__store_stmt(s, TD__ST_JOB_REQUEUE,
                         "UPDATE jobs SET state = 'queued', device_list = '' "
                         "WHERE state = 'running'",
                         &st, err);
    if (ret == 0)
        ret = write_one(s, st, "requeueing running jobs", &changes, err);
    *n = ret == 0 ? changes : 0;
    return ret;
}

int td_store_log(td_store *s, int64_t job, int level, const char *msg, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    char what[64];
    int ret;

    if (msg == NULL) {
        ret =
            td_error_set(err, TD_EINVAL, "store: job %lld: log line without text", (long long)job);
        goto out;
    }
    ret = td__store_stmt(s, TD__ST_LOG_INSERT,
                         "INSERT INTO job_logs (job, time, level, message) VALUES (?1, ?2, ?3, ?4)",
                         &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_double(st, 2, td_wall_s());
    sqlite3_bind_int(st, 3, level);
    sqlite3_bind_text(st, 4, msg, -1, SQLITE_STATIC);
    snprintf(what, sizeof(what), "logging for job %lld", (long long)job);
    ret = write_one(s, st, what, NULL, err);
    sqlite3_clear_bindings(st);
out:
    return ret;
}

int td_store_log_read(td_store *s, int64_t job, int64_t after_id, size_t limit, td_job_log_cb cb,
                      void *ud, size_t *ndone, td_error_t *err)
{
    td_job_log_row row;
    sqlite3_stmt *st = NULL;
    size_t k = 0;
    int rc = SQLITE_DONE;
    int ret;

    ret = td__store_stmt(s, TD__ST_LOG_READ,
                         "SELECT id, time, level, message FROM job_logs "
                         "WHERE job = ?1 AND id > ?2 ORDER BY id LIMIT ?3",
                         &st, err);
    if (ret < 0)
        goto out;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, after_id);
    sqlite3_bind_int64(st, 3, limit > INT64_MAX ? INT64_MAX : (int64_t)limit);
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        row.id = sqlite3_column_int64(st, 0);
        row.time = sqlite3_column_double(st, 1);
        row.level = sqlite3_column_int(st, 2);
        row.msg = (const char *)sqlite3_column_text(st, 3);
        k++;
        if (cb(ud, &row) != 0) {
            rc = SQLITE_DONE;
            break;
        }
    }
    if (rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "reading a job's log", err);
    sqlite3_reset(st);
out:
    *ndone = k;
    return ret;
}

/* ---- labels ---- */

void td__store_labels_sql(char *sql, size_t size, size_t *n, const char *alias, size_t nlabels,
                          int first)
{
    for (size_t i = 0; i < nlabels && *n < size; i++)
        *n += (size_t)snprintf(sql + *n, size - *n, " AND json_extract(%s%sspec_json, ?%zu) = ?%zu",
                               alias != NULL ? alias : "", alias != NULL ? "." : "",
                               (size_t)first + 2 * i, (size_t)first + 2 * i + 1);
}

int td__store_labels_bind(sqlite3_stmt *st, const td_label *labels, size_t n, int first,
                          td_error_t *err)
{
    char path[96];

    for (size_t i = 0; i < n; i++) {
        const char *k = labels[i].key;
        /* a name of letters, digits, . _ - / (jobspec.c): quoted in the path, it is one key */
        if (k == NULL || strpbrk(k, "\"\\") != NULL ||
            snprintf(path, sizeof(path), "$.labels.\"%s\"", k) >= (int)sizeof(path))
            return td_error_set(err, TD_EINVAL, "store: label name \"%s\" cannot be selected",
                                k != NULL ? k : "(null)");
        sqlite3_bind_text(st, first + 2 * (int)i, path, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, first + 2 * (int)i + 1, labels[i].value, -1, SQLITE_STATIC);
    }
    return 0;
}

/* ---- a page of a filtered listing ---- */

#define PAGE_SQL_MAX 4096 /* bytes of the page statement's text, every filter included */

/* The page statement for q: its WHERE holds only the filters q sets, its parameters are
 * numbered in a fixed order (states ?1..?5, uid ?6, name ?7, since ?8, cursor ?9, limit ?10,
 * labels from ?11, two each) so that binding does not depend on which are present. */
static int page_sql(const td_job_query *q, char *sql, size_t size)
{
    size_t n = (size_t)snprintf(
        sql, size, "SELECT " JOB_COLUMNS ", NULL, NULL FROM jobs WHERE " TD__NOT_DELETING);

    if (q->nstates > 0) {
        n += (size_t)snprintf(sql + n, size - n, " AND state IN (");
        for (size_t i = 0; i < q->nstates; i++)
            n += (size_t)snprintf(sql + n, size - n, "%s?%zu", i ? ", " : "", i + 1);
        n += (size_t)snprintf(sql + n, size - n, ")");
    }
    if (q->by_uid)
        n += (size_t)snprintf(sql + n, size - n, " AND uid = ?6");
    if (q->name_glob != NULL)
        n += (size_t)snprintf(sql + n, size - n, " AND name GLOB ?7");
    if (q->since > 0)
        n += (size_t)snprintf(sql + n, size - n, " AND created >= ?8");
    if (q->after > 0)
        n += (size_t)snprintf(sql + n, size - n, " AND id %s ?9", q->newest_first ? "<" : ">");
    td__store_labels_sql(sql, size, &n, NULL, q->nlabels, 11);
    n += (size_t)snprintf(sql + n, size - n, " ORDER BY id%s LIMIT ?10",
                          q->newest_first ? " DESC" : "");
    return n < size ? 0 : -1;
}

int td_store_job_page(td_store *s, const td_job_query *q, size_t limit, td_job_row **rows,
                      size_t *n, int *more, td_error_t *err)
{
    char sql[PAGE_SQL_MAX];
    td_job_row *r = NULL;
    sqlite3_stmt *st = NULL;
    size_t cap = 0, k = 0;
    int rc = SQLITE_DONE, final;
    int ret = 0;

    *rows = NULL;
    *n = 0;
    *more = 0;
    if (limit == 0 || limit > INT32_MAX || q->nstates > TD_STORE_MAX_STATES ||
        (q->nstates > 0 && q->states == NULL) || q->nlabels > TD_STORE_MAX_LABELS)
        return td_error_set(err, TD_EINVAL, "store: job page: bad argument");
    for (size_t i = 0; i < q->nstates; i++)
        if (q->states[i] == NULL || !state_known(q->states[i], &final))
            return td_error_set(err, TD_EINVAL, "store: job page: unknown state \"%s\"",
                                q->states[i] != NULL ? q->states[i] : "(null)");
    if (page_sql(q, sql, sizeof(sql)) != 0)
        return td_error_set(err, TD_EINVAL, "store: job page: statement too long");
    /* Not cached: the text depends on the filters, and one prepare is small next to a page. */
    rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return td__store_fail(s, rc, "preparing a page of jobs", err);
    for (size_t i = 0; i < q->nstates; i++)
        sqlite3_bind_text(st, (int)i + 1, q->states[i], -1, SQLITE_STATIC);
    if (q->by_uid)
        sqlite3_bind_int64(st, 6, q->uid);
    if (q->name_glob != NULL)
        sqlite3_bind_text(st, 7, q->name_glob, -1, SQLITE_STATIC);
    if (q->since > 0)
        sqlite3_bind_double(st, 8, q->since);
    if (q->after > 0)
        sqlite3_bind_int64(st, 9, q->after);
    /* One row more than asked for says whether another page follows. */
    sqlite3_bind_int64(st, 10, (int64_t)limit + 1);
    if ((ret = td__store_labels_bind(st, q->labels, q->nlabels, 11, err)) != 0) {
        sqlite3_finalize(st);
        return ret;
    }
    while (ret == 0 && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (k == limit) {
            *more = 1;
            rc = SQLITE_DONE;
            break;
        }
        ret = rows_grow(&r, k, &cap, err);
        if (ret == 0)
            ret = row_read(st, &r[k], err);
        if (ret == 0)
            k++;
    }
    if (ret == 0 && rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "reading a page of jobs", err);
    sqlite3_finalize(st);
    if (ret != 0) {
        rows_free(r, k);
        *more = 0;
        return ret;
    }
    *rows = r;
    *n = k;
    return 0;
}
