/* Deleting ended jobs from the store (store.h, "deleting ended jobs"): marking them in
 * jobs_deleting, deleting a marked job's rows in bounded batches and then its row, counting
 * jobs by state, and giving the freed pages back to the file system (incremental vacuum, and
 * the one VACUUM that converts a database created before it). Called on the thread that owns
 * the td_store (in the daemon, the loop thread); every write is one short transaction, so
 * the caller decides how much work one call does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_int.h"

/* The states a job may be deleted in: it has ended. */
static int state_ended(const char *state)
{
    return strcmp(state, TD_JOB_SUCCEEDED) == 0 || strcmp(state, TD_JOB_FAILED) == 0 ||
           strcmp(state, TD_JOB_CANCELLED) == 0;
}

/* The columns of a td_job_brief, in the order brief_read expects them, for a query on jobs AS
 * j. The metric rows come from the summary: one index range per job. */
#define BRIEF_COLUMNS                                                                \
    "j.id, j.name, j.state, j.uid, j.ended, (SELECT coalesce(sum(m.count), 0) FROM " \
    "metric_summary "                                                                \
    "AS m WHERE m.job = j.id)"

static void brief_read(sqlite3_stmt *st, td_job_brief *b)
{
    const unsigned char *t;

    memset(b, 0, sizeof(*b));
    b->id = sqlite3_column_int64(st, 0);
    t = sqlite3_column_text(st, 1);
    snprintf(b->name, sizeof(b->name), "%s", t != NULL ? (const char *)t : "");
    t = sqlite3_column_text(st, 2);
    snprintf(b->state, sizeof(b->state), "%s", t != NULL ? (const char *)t : "");
    b->uid = sqlite3_column_int64(st, 3);
    b->ended = sqlite3_column_double(st, 4);
    b->metric_rows = sqlite3_column_int64(st, 5);
}

/* Lists job id in jobs_deleting, inside the caller's transaction. */
static int mark_one(td_store *s, int64_t id, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    ret = td__store_stmt(s, TD__ST_PURGE_MARK, "INSERT INTO jobs_deleting (id) VALUES (?1)", &st,
                         err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc == SQLITE_DONE ? 0 : td__store_fail(s, rc, "marking a job for deletion", err);
}

/* The WHERE of a prune, its parameters numbered as bound by td_store_prune: states ?1..?3,
 * ended ?4, uid ?5, labels from ?6 (two each). */
static void prune_sql(const td_prune_query *q, char *sql, size_t size)
{
    size_t n =
        (size_t)snprintf(sql, size, "SELECT " BRIEF_COLUMNS " FROM jobs AS j WHERE j.state IN (");

    for (size_t i = 0; i < (q->nstates > 0 ? q->nstates : 3); i++)
        n += (size_t)snprintf(sql + n, size - n, "%s?%zu", i ? ", " : "", i + 1);
    n += (size_t)snprintf(sql + n, size - n,
                          ") AND j.ended <= ?4 AND j.id NOT IN (SELECT id FROM jobs_deleting)");
    if (q->by_uid)
        n += (size_t)snprintf(sql + n, size - n, " AND j.uid = ?5");
    td__store_labels_sql(sql, size, &n, "j", q->nlabels, 6);
    if (n < size)
        snprintf(sql + n, size - n, " ORDER BY j.id");
}

/* Grows *ids (capacity *cap) to hold one more. */
static int ids_grow(int64_t **ids, size_t n, size_t *cap)
{
    size_t ncap = *cap == 0 ? 256 : *cap * 2;
    int64_t *p;

    if (n < *cap)
        return 0;
    p = realloc(*ids, ncap * sizeof(*p));
    if (p == NULL)
        return TD_ENOMEM;
    *ids = p;
    *cap = ncap;
    return 0;
}

/* Steps the prune's select, listing each job (until cb says stop) and collecting every id. */
static int prune_select(td_store *s, sqlite3_stmt *st, td_job_brief_cb cb, void *ud,
                        td_purge_totals *tot, int64_t **ids, size_t *n, td_error_t *err)
{
    td_job_brief b;
    size_t cap = 0;
    int listing = cb != NULL, rc;

    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        brief_read(st, &b);
        if (ids_grow(ids, *n, &cap) != 0)
            return td_error_set(err, TD_ENOMEM, "store: out of memory selecting %zu jobs", *n);
        (*ids)[(*n)++] = b.id;
        tot->jobs++;
        tot->metric_rows += b.metric_rows;
        if (listing && cb(ud, &b) != 0)
            listing = 0;
    }
    return rc == SQLITE_DONE ? 0 : td__store_fail(s, rc, "selecting jobs to prune", err);
}

int td_store_prune(td_store *s, const td_prune_query *q, int mark, td_job_brief_cb cb, void *ud,
                   td_purge_totals *tot, td_error_t *err)
{
    static const char *const ended[] = {TD_JOB_SUCCEEDED, TD_JOB_FAILED, TD_JOB_CANCELLED};
    const char *const *states = q->nstates > 0 ? q->states : ended;
    size_t nstates = q->nstates > 0 ? q->nstates : 3, n = 0;
    sqlite3_stmt *st = NULL;
    int64_t *ids = NULL;
    char sql[4096];
    int ret = 0, in_tx = 0, rc;

    memset(tot, 0, sizeof(*tot));
    if (nstates > 3 || states == NULL)
        return td_error_set(err, TD_EINVAL, "store: prune: at most the three ended states");
    for (size_t i = 0; i < nstates; i++)
        if (states[i] == NULL || !state_ended(states[i]))
            return td_error_set(err, TD_EINVAL,
                                "store: prune: \"%s\" is not an ended state (succeeded, failed, "
                                "cancelled)",
                                states[i] != NULL ? states[i] : "(null)");
    prune_sql(q, sql, sizeof(sql));
    /* Marking: the select and the marks in one transaction, so the jobs listed are exactly
     * the jobs marked. */
    if (mark) {
        ret = td__store_begin(s, err);
        if (ret < 0)
            return ret;
        in_tx = 1;
    }
    rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc != SQLITE_OK) {
        ret = td__store_fail(s, rc, "preparing a prune", err);
        goto out;
    }
    for (size_t i = 0; i < nstates; i++)
        sqlite3_bind_text(st, (int)i + 1, states[i], -1, SQLITE_STATIC);
    sqlite3_bind_double(st, 4, q->ended_before);
    if (q->by_uid)
        sqlite3_bind_int64(st, 5, q->uid);
    ret =
        q->nlabels > TD_STORE_MAX_LABELS
            ? td_error_set(err, TD_EINVAL, "store: prune: more than %d labels", TD_STORE_MAX_LABELS)
            : td__store_labels_bind(st, q->labels, q->nlabels, 6, err);
    if (ret == 0)
        ret = prune_select(s, st, cb, ud, tot, &ids, &n, err);
    sqlite3_finalize(st);
    for (size_t i = 0; mark && ret == 0 && i < n; i++)
        ret = mark_one(s, ids[i], err);
    if (ret == 0 && in_tx)
        ret = td__store_commit(s, err);
out:
    if (ret < 0 && in_tx)
        td__store_rollback(s);
    if (ret < 0)
        memset(tot, 0, sizeof(*tot));
    free(ids);
    return ret;
}

/* Reads job id's brief, inside the caller's transaction: TD_ENOTFOUND for no job (or one
 * being deleted), TD_ESTATE for one that has not ended. */
static int brief_of(td_store *s, int64_t id, td_job_brief *b, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    ret = td__store_stmt(s, TD__ST_PURGE_BRIEF,
                         "SELECT " BRIEF_COLUMNS
                         " FROM jobs AS j WHERE j.id = ?1 AND j." TD__NOT_DELETING,
                         &st, err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, id);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        brief_read(st, b);
    sqlite3_reset(st);
    if (rc == SQLITE_DONE)
        return td_error_set(err, TD_ENOTFOUND, "no job %lld", (long long)id);
    if (rc != SQLITE_ROW)
        return td__store_fail(s, rc, "reading a job to delete", err);
    if (!state_ended(b->state))
        return td_error_set(err, TD_ESTATE, "job %lld is %s", (long long)id, b->state);
    return 0;
}

int td_store_jobs_mark(td_store *s, const int64_t *ids, size_t n, td_job_brief_cb cb, void *ud,
                       td_purge_totals *tot, td_error_t *err)
{
    td_job_brief b;
    int listing = cb != NULL, ret;

    memset(tot, 0, sizeof(*tot));
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < i; k++)
            if (ids[k] == ids[i])
                return td_error_set(err, TD_EINVAL, "job %lld is named twice", (long long)ids[i]);
    ret = td__store_begin(s, err);
    if (ret < 0)
        return ret;
    for (size_t i = 0; i < n && ret == 0; i++) {
        ret = brief_of(s, ids[i], &b, err);
        if (ret == 0)
            ret = mark_one(s, ids[i], err);
        if (ret == 0) {
            tot->jobs++;
            tot->metric_rows += b.metric_rows;
            if (listing && cb(ud, &b) != 0)
                listing = 0;
        }
    }
    if (ret == 0)
        ret = td__store_commit(s, err);
    if (ret < 0) {
        td__store_rollback(s);
        memset(tot, 0, sizeof(*tot));
    }
    return ret;
}

int td_store_purge_next(td_store *s, int64_t *job, int64_t *pending, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    *job = 0;
    ret = td__store_stmt(s, TD__ST_PURGE_NEXT, "SELECT min(id), count(*) FROM jobs_deleting", &st,
                         err);
    if (ret < 0)
        return ret;
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        *job = sqlite3_column_int64(st, 0); /* NULL, none, reads 0 */
        if (pending != NULL)
            *pending = sqlite3_column_int64(st, 1);
    }
    sqlite3_reset(st);
    return rc == SQLITE_ROW ? 0 : td__store_fail(s, rc, "reading the jobs being deleted", err);
}

/* Runs a cached DELETE of up to limit rows of job, inside the caller's transaction; adds the
 * rows it deleted to *deleted. */
static int delete_some(td_store *s, int id, const char *sql, int64_t job, size_t limit,
                       size_t *deleted, const char *what, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    ret = td__store_stmt(s, id, sql, &st, err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, job);
    sqlite3_bind_int64(st, 2, (int64_t)limit);
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    if (rc != SQLITE_DONE)
        return td__store_fail(s, rc, what, err);
    *deleted += (size_t)sqlite3_changes(s->db);
    return 0;
}

/* Deletes up to limit of job's metric rows, then of its log lines, inside the caller's
 * transaction; adds how many went to *deleted. */
static int delete_rows(td_store *s, int64_t job, size_t limit, size_t *deleted, td_error_t *err)
{
    size_t before = *deleted;
    int ret;

    /* The subquery walks the primary key from the job's first row: LIMIT bounds the work. */
    ret = delete_some(s, TD__ST_PURGE_METRICS,
                      "DELETE FROM metrics WHERE job = ?1 AND (key, step) IN "
                      "(SELECT key, step FROM metrics WHERE job = ?1 LIMIT ?2)",
                      job, limit, deleted, "deleting a job's metric rows", err);
    if (ret == 0 && *deleted - before < limit)
        ret = delete_some(s, TD__ST_PURGE_LOGS,
                          "DELETE FROM job_logs WHERE id IN "
                          "(SELECT id FROM job_logs WHERE job = ?1 ORDER BY id LIMIT ?2)",
                          job, limit - (*deleted - before), deleted, "deleting a job's log lines",
                          err);
    return ret;
}

/* Runs one cached statement bound to job, inside the caller's transaction. */
static int exec_job(td_store *s, int id, const char *sql, int64_t job, const char *what,
                    td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    ret = td__store_stmt(s, id, sql, &st, err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, job);
    rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc == SQLITE_DONE ? 0 : td__store_fail(s, rc, what, err);
}

/* Deletes a marked job whose rows are gone: its summary, its row (rows a late write left go
 * with it: ON DELETE CASCADE) and its mark, inside the caller's transaction; its id stays
 * given for ever (store_meta's max_job_id keeps the highest). */
static int finish_job(td_store *s, int64_t job, td_error_t *err)
{
    int ret = exec_job(s, TD__ST_PURGE_MAX_ID,
                       "INSERT INTO store_meta (key, value) SELECT 'max_job_id', ?1 WHERE true "
                       "ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)",
                       job, "keeping a deleted job's id", err);

    if (ret == 0)
        ret = exec_job(s, TD__ST_PURGE_SUMMARY, "DELETE FROM metric_summary WHERE job = ?1", job,
                       "deleting a job's metric summary", err);
    if (ret == 0)
        ret = exec_job(s, TD__ST_PURGE_JOB, "DELETE FROM jobs WHERE id = ?1", job, "deleting a job",
                       err);
    if (ret == 0)
        ret = exec_job(s, TD__ST_PURGE_UNMARK, "DELETE FROM jobs_deleting WHERE id = ?1", job,
                       "unmarking a deleted job", err);
    return ret;
}

/* The lowest marked job above after, or 0, inside the caller's transaction. */
static int next_marked(td_store *s, int64_t after, int64_t *job, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    *job = 0;
    ret = td__store_stmt(s, TD__ST_PURGE_NEXT_AFTER,
                         "SELECT min(id) FROM jobs_deleting WHERE id > ?1", &st, err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, after);
    rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        *job = sqlite3_column_int64(st, 0);
    sqlite3_reset(st);
    return rc == SQLITE_ROW ? 0 : td__store_fail(s, rc, "reading the jobs being deleted", err);
}

int td_store_purge_step(td_store *s, size_t limit, td_purge_gone_cb gone, void *ud, int64_t *jobs,
                        size_t *rows, td_error_t *err)
{
    int64_t job = 0;
    size_t before;
    int ret;

    *jobs = 0;
    *rows = 0;
    if (limit == 0 || limit > INT32_MAX)
        return td_error_set(err, TD_EINVAL, "store: purge: bad limit");
    ret = td__store_begin(s, err);
    if (ret < 0)
        return ret;
    /* Job after job while the budget lasts: a job's rows may take several steps, and one step
     * may finish many small jobs. */
    while (ret == 0 && *rows < limit && (ret = next_marked(s, job, &job, err)) == 0 && job != 0) {
        before = *rows;
        ret = delete_rows(s, job, limit - *rows, rows, err);
        if (ret != 0 || *rows - before == limit - before)
            break; /* the budget is spent: the job may have rows left */
        if (gone != NULL)
            gone(ud, job);
        ret = finish_job(s, job, err);
        if (ret == 0)
            (*jobs)++;
    }
    if (ret == 0)
        ret = td__store_commit(s, err);
    if (ret < 0) {
        td__store_rollback(s);
        *jobs = 0;
        *rows = 0;
    }
    return ret;
}

int td_store_job_exists(td_store *s, int64_t job, int *exists, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc, ret;

    *exists = 0;
    ret = td__store_stmt(s, TD__ST_JOB_EXISTS,
                         "SELECT 1 FROM jobs WHERE id = ?1 AND " TD__NOT_DELETING, &st, err);
    if (ret < 0)
        return ret;
    sqlite3_bind_int64(st, 1, job);
    rc = sqlite3_step(st);
    *exists = rc == SQLITE_ROW;
    sqlite3_reset(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? 0
                                                 : td__store_fail(s, rc, "looking up a job", err);
}

int td_store_job_counts(td_store *s, int64_t counts[TD_STORE_NSTATES], td_error_t *err)
{
    static const char *const states[TD_STORE_NSTATES] = {
        TD_JOB_QUEUED, TD_JOB_RUNNING, TD_JOB_SUCCEEDED, TD_JOB_FAILED, TD_JOB_CANCELLED};
    sqlite3_stmt *st = NULL;
    const unsigned char *t;
    int rc, ret;

    memset(counts, 0, TD_STORE_NSTATES * sizeof(*counts));
    ret = td__store_stmt(
        s, TD__ST_JOB_COUNTS,
        "SELECT state, count(*) FROM jobs WHERE " TD__NOT_DELETING " GROUP BY state", &st, err);
    if (ret < 0)
        return ret;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        t = sqlite3_column_text(st, 0);
        for (int i = 0; t != NULL && i < TD_STORE_NSTATES; i++)
            if (strcmp((const char *)t, states[i]) == 0)
                counts[i] = sqlite3_column_int64(st, 1);
    }
    sqlite3_reset(st);
    return rc == SQLITE_DONE ? 0 : td__store_fail(s, rc, "counting jobs", err);
}

/* Reads an integer pragma. Not cached: pragmas are few and rare. */
static int pragma_int(td_store *s, const char *sql, int64_t *out, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);

    if (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW)
        *out = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return rc == SQLITE_ROW ? 0 : td__store_fail(s, rc, sql, err);
}

int td_store_space_get(td_store *s, td_store_space *out, td_error_t *err)
{
    int64_t av = 0;
    int ret;

    memset(out, 0, sizeof(*out));
    if ((ret = pragma_int(s, "PRAGMA page_size", &out->page_bytes, err)) < 0 ||
        (ret = pragma_int(s, "PRAGMA page_count", &out->pages, err)) < 0 ||
        (ret = pragma_int(s, "PRAGMA freelist_count", &out->free_pages, err)) < 0 ||
        (ret = pragma_int(s, "PRAGMA auto_vacuum", &av, err)) < 0)
        return ret;
    out->auto_vacuum = (int)av;
    return 0;
}

int td_store_vacuum_step(td_store *s, int64_t pages, int64_t *left, td_error_t *err)
{
    sqlite3_stmt *st = NULL;
    char sql[64];
    int rc, ret;

    *left = 0;
    snprintf(sql, sizeof(sql), "PRAGMA incremental_vacuum(%lld)",
             (long long)(pages > 0 ? pages : 1));
    ret = td__store_begin(s, err);
    if (ret < 0)
        return ret;
    rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    /* Each step gives one page back; SQLITE_DONE once pages are given or none is free. */
    while (rc == SQLITE_OK || rc == SQLITE_ROW)
        rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE)
        ret = td__store_fail(s, rc, "giving free pages back (incremental_vacuum)", err);
    if (ret == 0)
        ret = pragma_int(s, "PRAGMA freelist_count", left, err);
    if (ret == 0)
        ret = td__store_commit(s, err);
    if (ret < 0)
        td__store_rollback(s);
    return ret;
}

int td_store_vacuum_convert(td_store *s, int64_t max_bytes, int *done, td_error_t *err)
{
    td_store_space sp;
    int ret = td_store_space_get(s, &sp, err);

    *done = 0;
    if (ret < 0 || sp.auto_vacuum == 2)
        return ret;
    if (sp.pages * sp.page_bytes > max_bytes) {
        *done = -1;
        return 0;
    }
    /* The pragma names the mode the VACUUM builds the new file in. */
    ret = td__store_exec(s, "PRAGMA auto_vacuum=INCREMENTAL", err);
    if (ret == 0)
        ret = td__store_exec(s, "VACUUM", err);
    if (ret == 0)
        *done = 1;
    return ret;
}
