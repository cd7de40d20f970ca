/* Unit tests of deleting ended jobs from the store (store/purge.c): marking by id and by prune
 * query (all or none, ended jobs only, by owner), marked jobs hidden from every read, rows
 * deleted in bounded batches and then the row, ids never given twice, marks that survive a
 * reopen, counts by state, and the space given back (incremental vacuum, and the conversion of
 * a database created without it). Each test gets a fresh database in its own mkdtemp
 * directory; single-threaded. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "store/store.h"
#include "store/store_int.h"

typedef struct fixture {
    char dir[256];
    char path[300];
    td_store *s;
} fixture;

static int setup(void **state)
{
    const char *tmp = getenv("TMPDIR");
    fixture *f = calloc(1, sizeof(*f));
    td_error_t err = {0};

    if (f == NULL)
        return -1;
    snprintf(f->dir, sizeof(f->dir), "%s/td_purge_XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(f->dir) == NULL)
        return -1;
    snprintf(f->path, sizeof(f->path), "%s/traind.db", f->dir);
    if (td_store_open(&f->s, f->path, &err) != 0) {
        fprintf(stderr, "open: %s\n", err.msg);
        return -1;
    }
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    char cmd[400];

    td_store_close(f->s);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
    if (system(cmd) != 0)
        return -1;
    free(f);
    return 0;
}

/* A job of uid with rows metric rows (train_loss at steps 1..rows) and two log lines, moved to
 * state (a final state sets ended to now). */
static int64_t job_with(td_store *s, const char *name, int64_t uid, const char *state, int rows)
{
    td_error_t err = {0};
    td_metric m[64];
    int64_t id = 0;
    int done = 0;

    assert_int_equal(td_store_job_insert(s, name, 1, 0, uid, NULL, 0, NULL, &id, &err), 0);
    while (done < rows) {
        int n = rows - done < 64 ? rows - done : 64;
        for (int i = 0; i < n; i++) {
            memset(&m[i], 0, sizeof(m[i]));
            m[i].job = id;
            snprintf(m[i].key, sizeof(m[i].key), "train_loss");
            m[i].step = done + i + 1;
            m[i].value = 1.0 / (double)(done + i + 1);
            m[i].time = 1.7e9;
        }
        assert_int_equal(td_store_metrics_write(s, m, (size_t)n, &err), 0);
        done += n;
    }
    assert_int_equal(td_store_log(s, id, 5, "queued", &err), 0);
    assert_int_equal(td_store_log(s, id, 5, "ended", &err), 0);
    if (strcmp(state, TD_JOB_QUEUED) != 0)
        assert_int_equal(td_store_job_set_state(s, id, state, "cpu:0", 0, NULL, &err), 0);
    return id;
}

/* Sets job's ended time, for the prune's age. */
static void set_ended(td_store *s, int64_t job, double ended)
{
    char sql[128];
    td_error_t err = {0};

    snprintf(sql, sizeof(sql), "UPDATE jobs SET ended = %f WHERE id = %lld", ended, (long long)job);
    assert_int_equal(td__store_exec(s, sql, &err), 0);
}

/* One integer from a query on the test's own connection (so marked jobs are seen too). */
static int64_t raw_int(const char *path, const char *sql)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int64_t v = -1;

    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
}

typedef struct listed {
    int64_t ids[16];
    int64_t rows[16];
    size_t n;
    size_t stop_after; /* 0: never */
} listed;

static int take(void *ud, const td_job_brief *b)
{
    listed *l = ud;

    assert_true(l->n < 16);
    l->ids[l->n] = b->id;
    l->rows[l->n++] = b->metric_rows;
    return l->stop_after > 0 && l->n == l->stop_after;
}

/* Steps until nothing is marked (batch rows per step); returns the steps that deleted
 * something. */
static int purge_all(td_store *s, size_t batch)
{
    td_error_t err = {0};
    int64_t jobs = 0;
    size_t rows = 0;
    int steps = 0;

    for (;;) {
        assert_int_equal(td_store_purge_step(s, batch, NULL, NULL, &jobs, &rows, &err), 0);
        if (jobs == 0 && rows == 0)
            return steps;
        steps++;
    }
}

typedef struct gone_list {
    int64_t ids[16];
    size_t n;
} gone_list;

static void note_gone(void *ud, int64_t job)
{
    gone_list *g = ud;

    assert_true(g->n < 16);
    g->ids[g->n++] = job;
}

/* ---- marking ---- */

static void test_rm_marks_and_hides(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    td_job_row row;
    td_job_row *rows = NULL;
    listed l = {0};
    int64_t a = job_with(f->s, "a", 1000, TD_JOB_SUCCEEDED, 10);
    int64_t b = job_with(f->s, "b", 1000, TD_JOB_FAILED, 20);
    int64_t ids[] = {a, b}, job = 0, pending = 0;
    size_t n = 0;
    int exists = 1, more = 0;
    td_job_query q = {0};

    assert_int_equal(td_store_jobs_mark(f->s, ids, 2, take, &l, &tot, &err), 0);
    assert_int_equal(tot.jobs, 2);
    assert_int_equal(tot.metric_rows, 30);
    assert_int_equal(l.n, 2);
    assert_int_equal(l.ids[0], a);
    assert_int_equal(l.rows[1], 20);
    /* Gone for every reader at once, though their rows are still there. */
    assert_int_equal(td_store_job_get(f->s, a, &row, &err), TD_ENOTFOUND);
    assert_int_equal(td_store_job_exists(f->s, b, &exists, &err), 0);
    assert_false(exists);
    assert_int_equal(td_store_job_page(f->s, &q, 10, &rows, &n, &more, &err), 0);
    assert_int_equal(n, 0);
    free(rows);
    assert_int_equal(td_store_job_list(f->s, 0, &rows, &n, &err), 0);
    assert_int_equal(n, 0);
    free(rows);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM metrics"), 30);
    assert_int_equal(td_store_purge_next(f->s, &job, &pending, &err), 0);
    assert_int_equal(job, a);
    assert_int_equal(pending, 2);
}

static void test_rm_all_or_none(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    int64_t done = job_with(f->s, "done", 1000, TD_JOB_SUCCEEDED, 3);
    int64_t run = job_with(f->s, "run", 1000, TD_JOB_RUNNING, 3);
    int64_t q = job_with(f->s, "q", 1000, TD_JOB_QUEUED, 0);
    int64_t ids[3] = {done, run, 0}, job = 0;
    char want[64];

    assert_int_equal(td_store_jobs_mark(f->s, ids, 2, NULL, NULL, &tot, &err), TD_ESTATE);
    snprintf(want, sizeof(want), "job %lld is running", (long long)run);
    assert_string_equal(err.msg, want);
    ids[1] = q;
    assert_int_equal(td_store_jobs_mark(f->s, ids, 2, NULL, NULL, &tot, &err), TD_ESTATE);
    ids[1] = 999;
    assert_int_equal(td_store_jobs_mark(f->s, ids, 2, NULL, NULL, &tot, &err), TD_ENOTFOUND);
    assert_string_equal(err.msg, "no job 999");
    ids[1] = done;
    assert_int_equal(td_store_jobs_mark(f->s, ids, 2, NULL, NULL, &tot, &err), TD_EINVAL);
    assert_int_equal(tot.jobs, 0);
    /* Nothing was marked by any of them. */
    assert_int_equal(td_store_purge_next(f->s, &job, NULL, &err), 0);
    assert_int_equal(job, 0);
    /* A job being deleted cannot be marked again. */
    assert_int_equal(td_store_jobs_mark(f->s, ids, 1, NULL, NULL, &tot, &err), 0);
    assert_int_equal(td_store_jobs_mark(f->s, ids, 1, NULL, NULL, &tot, &err), TD_ENOTFOUND);
}

static void test_prune_selects(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    const char *failed[] = {TD_JOB_FAILED}, *bad[] = {TD_JOB_RUNNING};
    int64_t old_ok = job_with(f->s, "old ok", 1000, TD_JOB_SUCCEEDED, 5);
    int64_t old_fail = job_with(f->s, "old fail", 1000, TD_JOB_FAILED, 7);
    int64_t other = job_with(f->s, "other's", 2000, TD_JOB_CANCELLED, 1);
    int64_t young = job_with(f->s, "young", 1000, TD_JOB_FAILED, 1);
    int64_t running = job_with(f->s, "running", 1000, TD_JOB_RUNNING, 1);
    td_prune_query q = {.ended_before = 1.5e9};
    listed l = {0};
    int exists = 0;

    set_ended(f->s, old_ok, 1.0e9);
    set_ended(f->s, old_fail, 1.0e9);
    set_ended(f->s, other, 1.0e9);
    set_ended(f->s, running, 0); /* running jobs have not ended: never selected */
    (void)young;                 /* ended now: too young */
    /* A dry run marks nothing. */
    assert_int_equal(td_store_prune(f->s, &q, 0, take, &l, &tot, &err), 0);
    assert_int_equal(tot.jobs, 3);
    assert_int_equal(tot.metric_rows, 13);
    assert_int_equal(td_store_job_exists(f->s, old_ok, &exists, &err), 0);
    assert_true(exists);
    /* By state and owner; listing stops where the callback says, marking does not. */
    q.states = failed;
    q.nstates = 1;
    q.by_uid = 1;
    q.uid = 1000;
    assert_int_equal(td_store_prune(f->s, &q, 1, NULL, NULL, &tot, &err), 0);
    assert_int_equal(tot.jobs, 1);
    assert_int_equal(td_store_job_exists(f->s, old_fail, &exists, &err), 0);
    assert_false(exists);
    memset(&l, 0, sizeof(l));
    l.stop_after = 1;
    q.nstates = 0;
    q.by_uid = 0;
    assert_int_equal(td_store_prune(f->s, &q, 1, take, &l, &tot, &err), 0);
    assert_int_equal(tot.jobs, 2);
    assert_int_equal(l.n, 1);
    assert_int_equal(td_store_job_exists(f->s, other, &exists, &err), 0);
    assert_false(exists);
    assert_int_equal(td_store_job_exists(f->s, running, &exists, &err), 0);
    assert_true(exists);
    q.states = bad;
    q.nstates = 1;
    assert_int_equal(td_store_prune(f->s, &q, 1, NULL, NULL, &tot, &err), TD_EINVAL);
}

/* ---- purging ---- */

static void test_purge_in_batches(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    int64_t a = job_with(f->s, "a", 1000, TD_JOB_SUCCEEDED, 250);
    int64_t keep = job_with(f->s, "keep", 1000, TD_JOB_SUCCEEDED, 30);
    int64_t counts[TD_STORE_NSTATES], jobs = 0;
    size_t n = 0;

    assert_true(keep > a);
    assert_int_equal(td_store_jobs_mark(f->s, &a, 1, NULL, NULL, &tot, &err), 0);
    /* 250 rows and 2 log lines in steps of 100: 100, 100, 50 + 2 and the row. */
    assert_int_equal(td_store_purge_step(f->s, 100, NULL, NULL, &jobs, &n, &err), 0);
    assert_int_equal(n, 100);
    assert_int_equal(jobs, 0);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM metrics"), 150 + 30);
    assert_int_equal(purge_all(f->s, 100), 2);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM metrics"), 30);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM metric_summary"), 1);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM job_logs"), 2);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM jobs"), 1);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM jobs_deleting"), 0);
    assert_int_equal(td_store_purge_step(f->s, 0, NULL, NULL, &jobs, &n, &err), TD_EINVAL);
    assert_int_equal(td_store_job_counts(f->s, counts, &err), 0);
    assert_int_equal(counts[2], 1);
    assert_int_equal(counts[0] + counts[1] + counts[3] + counts[4], 0);
}

/* Small jobs share a step: each is finished, in id order, after its callback. */
static void test_purge_many_in_one_step(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    gone_list g = {0};
    int64_t ids[5], jobs = 0;
    size_t rows = 0;

    for (int i = 0; i < 5; i++)
        ids[i] = job_with(f->s, "small", 1000, TD_JOB_FAILED, 10);
    assert_int_equal(td_store_jobs_mark(f->s, ids, 5, NULL, NULL, &tot, &err), 0);
    assert_int_equal(td_store_purge_step(f->s, 100, note_gone, &g, &jobs, &rows, &err), 0);
    assert_int_equal(jobs, 5);
    assert_int_equal(rows, 5 * 12);
    assert_int_equal(g.n, 5);
    for (int i = 0; i < 5; i++)
        assert_int_equal(g.ids[i], ids[i]);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM jobs"), 0);
    /* A budget of 25 rows: two jobs and a bit of the third. */
    for (int i = 0; i < 3; i++)
        ids[i] = job_with(f->s, "small", 1000, TD_JOB_FAILED, 10);
    assert_int_equal(td_store_jobs_mark(f->s, ids, 3, NULL, NULL, &tot, &err), 0);
    assert_int_equal(td_store_purge_step(f->s, 25, NULL, NULL, &jobs, &rows, &err), 0);
    assert_int_equal(jobs, 2);
    assert_int_equal(rows, 25);
    assert_int_equal(purge_all(f->s, 25), 1);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM jobs"), 0);
}

static void test_ids_never_reused(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    int64_t a = job_with(f->s, "a", 1000, TD_JOB_SUCCEEDED, 1);
    int64_t b = job_with(f->s, "b", 1000, TD_JOB_SUCCEEDED, 1), c = 0;

    assert_int_equal(td_store_jobs_mark(f->s, &b, 1, NULL, NULL, &tot, &err), 0);
    purge_all(f->s, 100);
    assert_int_equal(td_store_job_insert(f->s, "c", 1, 0, 1, NULL, 0, NULL, &c, &err), 0);
    assert_int_equal(c, b + 1);
    assert_int_equal(td_store_jobs_mark(f->s, &a, 1, NULL, NULL, &tot, &err), 0);
    assert_int_equal(td_store_jobs_mark(f->s, &c, 1, NULL, NULL, &tot, &err), TD_ESTATE);
    purge_all(f->s, 100);
    assert_int_equal(td_store_job_insert(f->s, "d", 1, 0, 1, NULL, 0, NULL, &a, &err), 0);
    assert_int_equal(a, c + 1);
}

static void test_marks_survive_reopen(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    int64_t a = job_with(f->s, "a", 1000, TD_JOB_CANCELLED, 40), job = 0;

    assert_int_equal(td_store_jobs_mark(f->s, &a, 1, NULL, NULL, &tot, &err), 0);
    td_store_close(f->s);
    assert_int_equal(td_store_open(&f->s, f->path, &err), 0);
    assert_int_equal(td_store_purge_next(f->s, &job, NULL, &err), 0);
    assert_int_equal(job, a);
    purge_all(f->s, 16);
    assert_int_equal(raw_int(f->path, "SELECT count(*) FROM metrics"), 0);
}

/* ---- space ---- */

static void test_vacuum_gives_space_back(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    td_store_space before, full, after;
    int64_t ids[4], left = -1;
    int steps = 0;

    assert_int_equal(td_store_space_get(f->s, &before, &err), 0);
    assert_int_equal(before.auto_vacuum, 2); /* a new database has it */
    for (int i = 0; i < 4; i++)
        ids[i] = job_with(f->s, "big", 1000, TD_JOB_SUCCEEDED, 5000);
    assert_int_equal(td_store_space_get(f->s, &full, &err), 0);
    assert_true(full.pages > before.pages + 100);
    assert_int_equal(td_store_jobs_mark(f->s, ids, 4, NULL, NULL, &tot, &err), 0);
    assert_int_equal(tot.metric_rows, 20000);
    purge_all(f->s, 1000);
    assert_int_equal(td_store_space_get(f->s, &after, &err), 0);
    assert_true(after.free_pages > 100);
    do {
        assert_int_equal(td_store_vacuum_step(f->s, 32, &left, &err), 0);
        steps++;
    } while (left > 0 && steps < 10000);
    assert_int_equal(left, 0);
    assert_true(steps > 1); /* bounded: 32 pages a step */
    assert_int_equal(td_store_space_get(f->s, &after, &err), 0);
    assert_int_equal(after.free_pages, 0);
    assert_true(after.pages < full.pages - 100);
}

static void test_convert_old_database(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_store_space sp;
    char path[320];
    sqlite3 *db = NULL;
    td_store *s = NULL;
    int done = 0;

    /* A file made before incremental auto-vacuum: tables first, in WAL mode. */
    snprintf(path, sizeof(path), "%s/old.db", f->dir);
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(
        sqlite3_exec(db, "PRAGMA journal_mode=WAL; CREATE TABLE other (x);", NULL, NULL, NULL),
        SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(td_store_open(&s, path, &err), 0);
    assert_int_equal(td_store_space_get(s, &sp, &err), 0);
    assert_int_equal(sp.auto_vacuum, 0);
    job_with(s, "kept", 1000, TD_JOB_SUCCEEDED, 100);
    /* Too large for the limit: left as it is. */
    assert_int_equal(td_store_vacuum_convert(s, 4096, &done, &err), 0);
    assert_int_equal(done, -1);
    assert_int_equal(td_store_vacuum_convert(s, (int64_t)1 << 30, &done, &err), 0);
    assert_int_equal(done, 1);
    assert_int_equal(td_store_space_get(s, &sp, &err), 0);
    assert_int_equal(sp.auto_vacuum, 2);
    assert_int_equal(raw_int(path, "SELECT count(*) FROM metrics"), 100);
    assert_int_equal(td_store_vacuum_convert(s, 4096, &done, &err), 0);
    assert_int_equal(done, 0);
    td_store_close(s);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_rm_marks_and_hides),   T(test_rm_all_or_none),          T(test_prune_selects),
        T(test_purge_in_batches),     T(test_purge_many_in_one_step),  T(test_ids_never_reused),
        T(test_marks_survive_reopen), T(test_vacuum_gives_space_back), T(test_convert_old_database),
    };

    return cmocka_run_group_tests_name("store_purge", tests, NULL, NULL);
}
