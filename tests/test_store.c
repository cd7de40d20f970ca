/* Unit tests of the SQLite store (store/): schema versioning, jobs, metric batches and their
 * summary, cursor pagination, two connections on one file, write errors and rollback, job
 * logs. Each test gets a fresh database in its own mkdtemp directory. Single-threaded; the
 * two-connection test drives both handles from this one thread, which WAL permits. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "store/store.h"
#include "store/store_int.h"

#define MAX_ROWS 4096 /* rows a collector keeps */

typedef struct fixture {
    char dir[256];
    char path[300];
    td_store *s;
} fixture;

/* Creates a temp directory and opens a store in it. */
static int setup(void **state)
{
    const char *tmp = getenv("TMPDIR");
    fixture *f = calloc(1, sizeof(*f));
    td_error_t err = {0};

    if (f == NULL)
        return -1;
    snprintf(f->dir, sizeof(f->dir), "%s/td_store_XXXXXX", tmp != NULL ? tmp : "/tmp");
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

/* Closes the store and removes the database, its WAL and the directory. */
static int teardown(void **state)
{
    fixture *f = *state;
    char p[320];

    td_store_close(f->s);
    unlink(f->path);
    snprintf(p, sizeof(p), "%s-wal", f->path);
    unlink(p);
    snprintf(p, sizeof(p), "%s-shm", f->path);
    unlink(p);
    rmdir(f->dir);
    free(f);
    return 0;
}

/* Reads an integer pragma through a plain sqlite3 connection of the test's own. */
static int raw_pragma_int(const char *path, const char *sql)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    int v = -1;

    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, sql, -1, &st, NULL), SQLITE_OK);
    if (sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
}

static int64_t new_job(td_store *s, const char *name)
{
    td_error_t err = {0};
    int64_t id = 0;

    assert_int_equal(td_store_job_insert(s, name, 1, 0, 1000, NULL, 0, NULL, &id, &err), 0);
    assert_true(id > 0);
    return id;
}

static td_metric sample(int64_t job, const char *key, int64_t step, double value)
{
    td_metric m;

    memset(&m, 0, sizeof(m));
    m.job = job;
    snprintf(m.key, sizeof(m.key), "%s", key);
    m.step = step;
    m.value = value;
    m.time = 1.7e9 + (double)step;
    return m;
}

/* ---- collecting pages and summaries ---- */

typedef struct got_row {
    char key[TD_STORE_MAX_KEY];
    int key_id;
    int64_t step;
    double value;
} got_row;

typedef struct collector {
    got_row rows[MAX_ROWS];
    size_t n;
    size_t stop_after; /* 0: never stop early */
    td_store *writer;  /* when set, writes write_batch from inside the first callback */
    const td_metric *write_batch;
    size_t write_n;
} collector;

static int collect(void *ud, const td_metric_row *row)
{
    collector *c = ud;
    got_row *r;
    td_error_t err = {0};

    assert_true(c->n < MAX_ROWS);
    r = &c->rows[c->n++];
    snprintf(r->key, sizeof(r->key), "%s", row->key);
    r->key_id = row->key_id;
    r->step = row->step;
    r->value = row->value;
    if (c->writer != NULL) {
        /* Another connection commits while this page's read transaction is open. */
        assert_int_equal(td_store_metrics_write(c->writer, c->write_batch, c->write_n, &err), 0);
        c->writer = NULL;
    }
    return c->stop_after > 0 && c->n >= c->stop_after;
}

/* Pages through every row of job from since with pages of limit rows, appending to c. Returns
 * the number of pages read. */
static int page_all(td_store *s, int64_t job, int64_t since, const char *const *keys, size_t nkeys,
                    size_t limit, collector *c)
{
    td_metric_cursor cur;
    td_error_t err = {0};
    size_t ndone;
    int pages = 0;

    td_metric_cursor_init(&cur, since);
    do {
        ndone = 0;
        assert_int_equal(
            td_store_metrics_page(s, job, &cur, keys, nkeys, limit, collect, c, &ndone, &err), 0);
        assert_true(ndone <= limit);
        pages++;
        assert_true(pages < 100000);
    } while (ndone == limit);
    return pages;
}

typedef struct summary_row {
    char key[TD_STORE_MAX_KEY];
    td_metric_summary v;
} summary_row;

typedef struct summaries {
    summary_row rows[16];
    size_t n;
} summaries;

static int collect_summary(void *ud, const td_metric_summary *row)
{
    summaries *s = ud;

    assert_true(s->n < 16);
    snprintf(s->rows[s->n].key, sizeof(s->rows[s->n].key), "%s", row->key);
    s->rows[s->n].v = *row;
    s->rows[s->n].v.key = s->rows[s->n].key;
    s->n++;
    return 0;
}

static const td_metric_summary *find_summary(td_store *st, int64_t job, const char *key,
                                             summaries *out)
{
    td_error_t err = {0};
    size_t i;

    out->n = 0;
    assert_int_equal(td_store_metrics_summary(st, job, collect_summary, out, &err), 0);
    for (i = 0; i < out->n; i++)
        if (strcmp(out->rows[i].key, key) == 0)
            return &out->rows[i].v;
    return NULL;
}

/* ---- open, reopen, versions ---- */

static void test_reopen_keeps_data_and_version(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_job_row row = {0};
    int64_t id = new_job(f->s, "keep me");

    td_store_close(f->s);
    f->s = NULL;
    assert_int_equal(raw_pragma_int(f->path, "PRAGMA user_version"), TD_STORE_SCHEMA_VERSION);
    assert_int_equal(td_store_open(&f->s, f->path, &err), 0);
    assert_int_equal(td_store_job_get(f->s, id, &row, &err), 0);
    assert_string_equal(row.name, "keep me");
    td_job_row_clear(&row);
    assert_int_equal(raw_pragma_int(f->path, "PRAGMA user_version"), TD_STORE_SCHEMA_VERSION);
}

static void test_wal_mode(void **state)
{
    fixture *f = *state;
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;

    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA journal_mode", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    assert_string_equal((const char *)sqlite3_column_text(st, 0), "wal");
    sqlite3_finalize(st);
    sqlite3_close(db);
}

static void test_newer_version_refused(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_store *s = (td_store *)1;
    sqlite3 *db = NULL;
    char sql[64];
    char want[64];

    td_store_close(f->s);
    f->s = NULL;
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", TD_STORE_SCHEMA_VERSION + 1);
    assert_int_equal(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);

    assert_int_equal(td_store_open(&s, f->path, &err), TD_EVERSION);
    assert_int_equal(err.code, TD_EVERSION);
    assert_null(s);
    /* The message names both versions. */
    snprintf(want, sizeof(want), "schema version %d", TD_STORE_SCHEMA_VERSION + 1);
    assert_non_null(strstr(err.msg, want));
    snprintf(want, sizeof(want), "the %d this traind", TD_STORE_SCHEMA_VERSION);
    assert_non_null(strstr(err.msg, want));
    /* Refusing changed nothing. */
    assert_int_equal(raw_pragma_int(f->path, "PRAGMA user_version"), TD_STORE_SCHEMA_VERSION + 1);
}

static void test_open_bad_path(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_store *s = NULL;
    char path[400];

    snprintf(path, sizeof(path), "%s/no/such/dir/x.db", f->dir);
    assert_int_equal(td_store_open(&s, path, &err), TD_ESTORE);
    assert_null(s);
    assert_non_null(strstr(err.msg, path));
}

/* Clearing a row read back with every malloc'd member set frees them and zeroes them, so a
 * second clear (and a clear of NULL) does nothing: ASan would see a double free. */
static void test_job_row_clear(void **state)
{
    fixture *f = *state;
    const unsigned char spec[] = {0x81, 0xa1, 'a', 0x01}; /* msgpack {"a": 1} */
    const unsigned char devs[] = {0x91, 0x80};            /* msgpack [{}] */
    td_error_t err = {0};
    td_job_row row = {0};
    int64_t id = 0;

    assert_int_equal(
        td_store_job_insert(f->s, "mlp", 1, 0, 1000, spec, sizeof(spec), "{\"a\":1}", &id, &err),
        0);
    assert_int_equal(
        td_store_job_set_state(f->s, id, TD_JOB_FAILED, "cpu:0", TD_EIO, "read failed", &err), 0);
    assert_int_equal(td_store_job_set_error_devices(f->s, id, devs, sizeof(devs), &err), 0);
    assert_int_equal(td_store_job_get(f->s, id, &row, &err), 0);
    assert_non_null(row.err_msg);
    assert_non_null(row.spec);
    assert_non_null(row.spec_json);
    assert_non_null(row.err_devices);
    td_job_row_clear(&row);
    assert_null(row.err_msg);
    assert_null(row.spec);
    assert_int_equal(row.spec_len, 0);
    assert_null(row.spec_json);
    assert_null(row.err_devices);
    assert_int_equal(row.err_devices_len, 0);
    td_job_row_clear(&row);
    td_job_row_clear(NULL);
    td_store_close(NULL);
}

/* ---- jobs ---- */

static void test_job_lifecycle(void **state)
{
    fixture *f = *state;
    const unsigned char spec[] = {0x81, 0xa1, 'a', 0x01}; /* msgpack {"a": 1} */
    td_error_t err = {0};
    td_job_row row = {0};
    td_job_row *rows = NULL;
    size_t n = 0;
    int64_t a = 0, b = 0;
    int requeued = -1;

    assert_int_equal(
        td_store_job_insert(f->s, "mlp", 2, 5, 1000, spec, sizeof(spec), "{\"a\":1}", &a, &err), 0);
    assert_int_equal(td_store_job_insert(f->s, "gpt", 1, 0, -1, NULL, 0, NULL, &b, &err), 0);
    assert_true(b > a);

    assert_int_equal(td_store_job_get(f->s, a, &row, &err), 0);
    assert_int_equal(row.id, a);
    assert_string_equal(row.name, "mlp");
    assert_string_equal(row.state, TD_JOB_QUEUED);
    assert_int_equal(row.devices, 2);
    assert_int_equal(row.priority, 5);
    assert_int_equal(row.uid, 1000);
    assert_int_equal(row.step, 0);
    assert_string_equal(row.device_list, "");
    assert_true(row.created > 1.6e9); /* unix seconds, after 2020 */
    assert_true(row.started == 0 && row.ended == 0);
    assert_null(row.err_msg);
    assert_int_equal(row.spec_len, sizeof(spec));
    assert_memory_equal(row.spec, spec, sizeof(spec));
    assert_string_equal(row.spec_json, "{\"a\":1}");
    td_job_row_clear(&row);
    assert_null(row.spec);

    /* Listing: oldest first; without specs unless asked. */
    assert_int_equal(td_store_job_list(f->s, 0, &rows, &n, &err), 0);
    assert_int_equal(n, 2);
    assert_int_equal(rows[0].id, a);
    assert_int_equal(rows[1].id, b);
    assert_null(rows[0].spec);
    assert_null(rows[0].spec_json);
    assert_int_equal(rows[1].uid, -1);
    td_job_row_clear(&rows[0]);
    td_job_row_clear(&rows[1]);
    free(rows);
    assert_int_equal(td_store_job_list(f->s, 1, &rows, &n, &err), 0);
    assert_int_equal(n, 2);
    assert_memory_equal(rows[0].spec, spec, sizeof(spec));
    td_job_row_clear(&rows[0]);
    td_job_row_clear(&rows[1]);
    free(rows);

    /* Running: started and devices. */
    assert_int_equal(td_store_job_set_state(f->s, a, TD_JOB_RUNNING, "cpu:0,cpu:1", 0, NULL, &err),
                     0);
    assert_int_equal(td_store_job_set_progress(f->s, a, 17, 100, &err), 0);
    assert_int_equal(td_store_job_get(f->s, a, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_RUNNING);
    assert_string_equal(row.device_list, "cpu:0,cpu:1");
    assert_true(row.started >= row.created);
    assert_int_equal(row.step, 17);
    assert_int_equal(row.total_steps, 100);
    td_job_row_clear(&row);

    /* Failed: ended and the error. */
    assert_int_equal(
        td_store_job_set_state(f->s, a, TD_JOB_FAILED, NULL, TD_ENAN, "loss is NaN at 17", &err),
        0);
    assert_int_equal(td_store_job_get(f->s, a, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_FAILED);
    assert_int_equal(row.err_code, TD_ENAN);
    assert_string_equal(row.err_msg, "loss is NaN at 17");
    assert_true(row.ended >= row.started);
    td_job_row_clear(&row);

    /* A daemon that died with b running: requeued, devices cleared; a failed job stays. */
    assert_int_equal(td_store_job_set_state(f->s, b, TD_JOB_RUNNING, "cuda:0", 0, NULL, &err), 0);
    assert_int_equal(td_store_jobs_requeue_running(f->s, &requeued, &err), 0);
    assert_int_equal(requeued, 1);
    assert_int_equal(td_store_job_get(f->s, b, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_QUEUED);
    assert_string_equal(row.device_list, "");
    td_job_row_clear(&row);
    assert_int_equal(td_store_job_get(f->s, a, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_FAILED);
    td_job_row_clear(&row);
    assert_int_equal(td_store_jobs_requeue_running(f->s, &requeued, &err), 0);
    assert_int_equal(requeued, 0);

    /* Succeeded without an error. */
    assert_int_equal(td_store_job_set_state(f->s, b, TD_JOB_SUCCEEDED, NULL, 0, NULL, &err), 0);
    assert_int_equal(td_store_job_get(f->s, b, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_SUCCEEDED);
    assert_int_equal(row.err_code, 0);
    assert_null(row.err_msg);
    td_job_row_clear(&row);
}

/* A job's spec replaced (the batch an "auto" job was given): spec and spec_json change
 * together, nothing else of the job does, and a job that does not exist is named. */
static void test_job_set_spec(void **state)
{
    fixture *f = *state;
    const unsigned char spec[] = {
        0x81, 0xaa, 'b', 'a',  't', 'c', 'h', '_', 's',
        'i',  'z',  'e', 0xa4, 'a', 'u', 't', 'o'}; /* {"batch_size": "auto"} */
    const unsigned char spec2[] = {
        0x81, 0xaa, 'b', 'a', 't',  'c',  'h', '_',
        's',  'i',  'z', 'e', 0xcd, 0x01, 0x00}; /* {"batch_size": 256} */
    td_error_t err = {0};
    td_job_row row = {0};
    int64_t id = 0;

    assert_int_equal(td_store_job_insert(f->s, "auto", 1, 3, 1000, spec, sizeof(spec),
                                         "{\"batch_size\":\"auto\"}", &id, &err),
                     0);
    assert_int_equal(
        td_store_job_set_spec_json(f->s, id, spec2, sizeof(spec2), "{\"batch_size\":256}", &err),
        0);
    assert_int_equal(td_store_job_get(f->s, id, &row, &err), 0);
    assert_int_equal(row.spec_len, sizeof(spec2));
    assert_memory_equal(row.spec, spec2, sizeof(spec2));
    assert_string_equal(row.spec_json, "{\"batch_size\":256}");
    assert_string_equal(row.name, "auto");
    assert_string_equal(row.state, TD_JOB_QUEUED);
    assert_int_equal(row.priority, 3);
    assert_int_equal(row.uid, 1000);
    td_job_row_clear(&row);

    /* Without a rendering the old one goes rather than describe the old spec. */
    assert_int_equal(td_store_job_set_spec_json(f->s, id, spec, sizeof(spec), NULL, &err), 0);
    assert_int_equal(td_store_job_get(f->s, id, &row, &err), 0);
    assert_memory_equal(row.spec, spec, sizeof(spec));
    assert_null(row.spec_json);
    td_job_row_clear(&row);

    assert_int_equal(td_store_job_set_spec_json(f->s, id + 100, spec, sizeof(spec), NULL, &err),
                     TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "no job"));
    assert_int_equal(td_store_job_set_spec_json(f->s, id, NULL, 4, NULL, &err), TD_EINVAL);
}

static void test_job_errors(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_job_row row = {0};
    char name[TD_STORE_MAX_NAME + 8];
    int64_t id = 0;
    int64_t a = new_job(f->s, "a");

    assert_int_equal(td_store_job_get(f->s, 999, &row, &err), TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "999"));
    assert_int_equal(td_store_job_set_state(f->s, 999, TD_JOB_RUNNING, "cpu:0", 0, NULL, &err),
                     TD_ENOTFOUND);
    assert_int_equal(td_store_job_set_progress(f->s, 999, 1, 2, &err), TD_ENOTFOUND);
    assert_int_equal(td_store_job_set_state(f->s, a, "sleeping", NULL, 0, NULL, &err), TD_EINVAL);
    memset(name, 'x', sizeof(name) - 1);
    name[sizeof(name) - 1] = '\0';
    assert_int_equal(td_store_job_insert(f->s, name, 1, 0, 0, NULL, 0, NULL, &id, &err), TD_EINVAL);
    /* err may be NULL. */
    assert_int_equal(td_store_job_get(f->s, 998, &row, NULL), TD_ENOTFOUND);
    /* Nothing above changed job a. */
    assert_int_equal(td_store_job_get(f->s, a, &row, &err), 0);
    assert_string_equal(row.state, TD_JOB_QUEUED);
    td_job_row_clear(&row);
}

/* ---- metrics ---- */

static const char *const keys3[] = {"loss", "acc", "lr"};

/* Writes 3 keys x nsteps steps, value = step * 10 + key index, in batches of batch rows, with
 * the keys of a step interleaved in an order that is not the key id order. */
static void write_grid(td_store *s, int64_t job, int nsteps, size_t batch)
{
    td_metric *m = calloc((size_t)nsteps * 3, sizeof(*m));
    td_error_t err = {0};
    size_t n = 0;
    size_t i;
    int step, k;

    assert_non_null(m);
    for (step = 0; step < nsteps; step++)
        for (k = 0; k < 3; k++) {
            int kk = (step % 2 == 0) ? k : 2 - k;
            m[n++] = sample(job, keys3[kk], step, step * 10 + kk);
        }
    for (i = 0; i < n; i += batch)
        assert_int_equal(td_store_metrics_write(s, m + i, n - i < batch ? n - i : batch, &err), 0);
    free(m);
}

/* Checks that c holds rows in strictly increasing (step, key_id) order, each value matching
 * its (step, key) as write_grid wrote it. */
static void check_order(const collector *c)
{
    size_t i;
    int k;

    for (i = 0; i < c->n; i++) {
        const got_row *r = &c->rows[i];
        for (k = 0; k < 3 && strcmp(keys3[k], r->key) != 0; k++)
            ;
        assert_true(k < 3);
        assert_true(r->value == (double)(r->step * 10 + k));
        if (i > 0) {
            const got_row *p = &c->rows[i - 1];
            assert_true(p->step < r->step || (p->step == r->step && p->key_id < r->key_id));
        }
    }
}

static void test_metrics_page_order(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "grid");
    int64_t other = new_job(f->s, "other");
    collector *c = calloc(1, sizeof(*c));
    size_t limits[] = {1, 2, 7, 150, 1000};
    size_t i;
    int pages;

    assert_non_null(c);
    write_grid(f->s, job, 50, 13);
    write_grid(f->s, other, 5, 100); /* must not show up in job's pages */
    for (i = 0; i < sizeof(limits) / sizeof(limits[0]); i++) {
        c->n = 0;
        pages = page_all(f->s, job, 0, NULL, 0, limits[i], c);
        /* Every row exactly once (strict order rules out repeats), in order. */
        assert_int_equal(c->n, 150);
        check_order(c);
        assert_int_equal(c->rows[0].step, 0);
        assert_int_equal(c->rows[149].step, 49);
        /* Full pages, then one short (possibly empty) page that says "caught up". */
        assert_int_equal(pages, (int)(150 / limits[i]) + 1);
    }
    free(c);
}

static void test_metrics_cursor_resume_and_stop(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "resume");
    collector *c = calloc(1, sizeof(*c));
    td_metric_cursor cur;
    td_error_t err = {0};
    size_t ndone = 0;

    assert_non_null(c);
    write_grid(f->s, job, 10, 1000);
    td_metric_cursor_init(&cur, 0);
    /* cb stops after 4 rows: those 4 count as delivered and the cursor is past the 4th. */
    c->stop_after = 4;
    assert_int_equal(td_store_metrics_page(f->s, job, &cur, NULL, 0, 100, collect, c, &ndone, &err),
                     0);
    assert_int_equal(ndone, 4);
    assert_int_equal(cur.step, c->rows[3].step);
    assert_int_equal(cur.key_id, c->rows[3].key_id);
    c->stop_after = 0;
    assert_int_equal(td_store_metrics_page(f->s, job, &cur, NULL, 0, 100, collect, c, &ndone, &err),
                     0);
    assert_int_equal(ndone, 26);
    assert_int_equal(c->n, 30);
    check_order(c);
    /* limit 0 delivers nothing and leaves the cursor alone. */
    assert_int_equal(td_store_metrics_page(f->s, job, &cur, NULL, 0, 0, collect, c, &ndone, &err),
                     0);
    assert_int_equal(ndone, 0);
    free(c);
}

static void test_metrics_keys_filter(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "filter");
    collector *c = calloc(1, sizeof(*c));
    const char *const some[] = {"lr", "nope", "loss"};
    const char *const none[] = {"nope"};
    size_t i;

    assert_non_null(c);
    write_grid(f->s, job, 20, 1000);
    page_all(f->s, job, 0, some, 3, 3, c);
    assert_int_equal(c->n, 40);
    check_order(c);
    for (i = 0; i < c->n; i++)
        assert_true(strcmp(c->rows[i].key, "lr") == 0 || strcmp(c->rows[i].key, "loss") == 0);

    c->n = 0;
    page_all(f->s, job, 0, none, 1, 5, c);
    assert_int_equal(c->n, 0);
    free(c);
}

static void test_metrics_since(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "since");
    collector *c = calloc(1, sizeof(*c));
    const char *const loss[] = {"loss"};

    assert_non_null(c);
    write_grid(f->s, job, 50, 1000);
    page_all(f->s, job, 20, NULL, 0, 4, c);
    assert_int_equal(c->n, 30 * 3);
    assert_int_equal(c->rows[0].step, 20);
    check_order(c);

    c->n = 0;
    page_all(f->s, job, 45, loss, 1, 2, c);
    assert_int_equal(c->n, 5);
    assert_int_equal(c->rows[0].step, 45);

    c->n = 0;
    page_all(f->s, job, 50, NULL, 0, 10, c);
    assert_int_equal(c->n, 0);
    free(c);
}

static void test_metrics_replay_replaces(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "replay");
    collector *c = calloc(1, sizeof(*c));
    const td_metric_summary *sum;
    summaries *out = calloc(1, sizeof(*out));
    td_metric m[10];
    td_error_t err = {0};
    int i;

    assert_non_null(c);
    assert_non_null(out);
    for (i = 0; i < 10; i++)
        m[i] = sample(job, "loss", i, 10.0 - i); /* 10, 9, ..., 1 */
    assert_int_equal(td_store_metrics_write(f->s, m, 10, &err), 0);

    /* The daemon died after step 9 and the job resumed from a checkpoint at step 5. */
    for (i = 0; i < 5; i++)
        m[i] = sample(job, "loss", 5 + i, 100.0 + i); /* steps 5..9: 100..104 */
    assert_int_equal(td_store_metrics_write(f->s, m, 5, &err), 0);

    page_all(f->s, job, 0, NULL, 0, 100, c);
    assert_int_equal(c->n, 10); /* replaced, not duplicated */
    for (i = 0; i < 10; i++) {
        assert_int_equal(c->rows[i].step, i);
        assert_true(c->rows[i].value == (i < 5 ? 10.0 - i : 100.0 + (i - 5)));
    }
    sum = find_summary(f->s, job, "loss", out);
    assert_non_null(sum);
    assert_int_equal(sum->count, 10);
    assert_int_equal(sum->last_step, 9);
    assert_true(sum->last == 104.0);
    assert_true(sum->max == 104.0);
    assert_true(sum->min == 1.0); /* historical: step 9's replaced value */

    /* Replacing an older step leaves last alone; the same step twice in one batch counts
     * once and the later sample wins. */
    m[0] = sample(job, "loss", 3, 7.5);
    m[1] = sample(job, "loss", 3, 7.25);
    assert_int_equal(td_store_metrics_write(f->s, m, 2, &err), 0);
    sum = find_summary(f->s, job, "loss", out);
    assert_int_equal(sum->count, 10);
    assert_true(sum->last == 104.0);
    c->n = 0;
    page_all(f->s, job, 3, NULL, 0, 1, c);
    assert_true(c->rows[0].value == 7.25);

    /* Replacing the last step updates last. */
    m[0] = sample(job, "loss", 9, 0.5);
    assert_int_equal(td_store_metrics_write(f->s, m, 1, &err), 0);
    sum = find_summary(f->s, job, "loss", out);
    assert_int_equal(sum->count, 10);
    assert_true(sum->last == 0.5);
    assert_true(sum->min == 0.5);
    free(c);
    free(out);
}

static void test_metrics_summary(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "summary");
    summaries *out = calloc(1, sizeof(*out));
    const td_metric_summary *sum;
    td_metric m[6];
    td_error_t err = {0};
    collector *c = calloc(1, sizeof(*c));

    assert_non_null(out);
    assert_non_null(c);
    /* Out of step order within a batch: last is the value at the highest step. */
    m[0] = sample(job, "zeta", 10, 3.0);
    m[1] = sample(job, "zeta", 5, -2.0);
    m[2] = sample(job, "alpha", 1, 0.25);
    m[3] = sample(job, "zeta", 7, 8.0);
    m[4] = sample(job, "alpha", 2, NAN); /* stored, read back NaN, moves neither min nor max */
    m[5] = sample(job, "beta", 0, NAN);
    assert_int_equal(td_store_metrics_write(f->s, m, 6, &err), 0);

    sum = find_summary(f->s, job, "zeta", out);
    /* In key name order. */
    assert_int_equal(out->n, 3);
    assert_string_equal(out->rows[0].key, "alpha");
    assert_string_equal(out->rows[1].key, "beta");
    assert_string_equal(out->rows[2].key, "zeta");
    assert_int_equal(sum->count, 3);
    assert_int_equal(sum->last_step, 10);
    assert_true(sum->last == 3.0);
    assert_true(sum->min == -2.0);
    assert_true(sum->max == 8.0);

    sum = find_summary(f->s, job, "alpha", out);
    assert_int_equal(sum->count, 2);
    assert_int_equal(sum->last_step, 2);
    assert_true(isnan(sum->last));
    assert_true(sum->min == 0.25 && sum->max == 0.25);

    sum = find_summary(f->s, job, "beta", out);
    assert_int_equal(sum->count, 1);
    assert_true(isnan(sum->min) && isnan(sum->max) && isnan(sum->last));

    /* A later batch folds into the stored summary. */
    m[0] = sample(job, "zeta", 11, 100.0);
    m[1] = sample(job, "zeta", 4, -50.0);
    m[2] = sample(job, "beta", 1, 2.0);
    assert_int_equal(td_store_metrics_write(f->s, m, 3, &err), 0);
    sum = find_summary(f->s, job, "zeta", out);
    assert_int_equal(sum->count, 5);
    assert_int_equal(sum->last_step, 11);
    assert_true(sum->last == 100.0 && sum->min == -50.0 && sum->max == 100.0);
    sum = find_summary(f->s, job, "beta", out);
    assert_int_equal(sum->count, 2);
    assert_true(sum->min == 2.0 && sum->max == 2.0 && sum->last == 2.0);

    page_all(f->s, job, 2, (const char *const[]){"alpha"}, 1, 10, c);
    assert_int_equal(c->n, 1);
    assert_true(isnan(c->rows[0].value));

    /* A job with no metrics has no summary rows. */
    sum = find_summary(f->s, new_job(f->s, "empty"), "zeta", out);
    assert_null(sum);
    assert_int_equal(out->n, 0);
    free(out);
    free(c);
}

/* Two connections on one file: one writes batches while the other pages, as the daemon's
 * store thread and loop thread do. */
static void test_two_connections(void **state)
{
    fixture *f = *state;
    collector *c = calloc(1, sizeof(*c));
    td_store *reader = NULL;
    td_metric_cursor cur;
    td_metric batch[30];
    td_metric late[3];
    td_error_t err = {0};
    size_t ndone;
    int64_t job = new_job(f->s, "shared");
    int b, i;

    assert_non_null(c);
    assert_int_equal(td_store_open(&reader, f->path, &err), 0);
    td_metric_cursor_init(&cur, 0);
    for (b = 0; b < 5; b++) {
        for (i = 0; i < 30; i++)
            batch[i] = sample(job, keys3[i % 3], b * 10 + i / 3, (b * 10 + i / 3) * 10 + i % 3);
        assert_int_equal(td_store_metrics_write(f->s, batch, 30, &err), 0);
        /* The reader sees each committed batch, continuing from its cursor. */
        do {
            assert_int_equal(
                td_store_metrics_page(reader, job, &cur, NULL, 0, 8, collect, c, &ndone, &err), 0);
        } while (ndone == 8);
        assert_int_equal(c->n, (size_t)(b + 1) * 30);
        assert_int_equal(cur.step, b * 10 + 9);
    }
    check_order(c);

    /* A writer commits while the reader's page is mid-way: the page reads its own snapshot
     * and the writer is not blocked; the next page brings the new rows. */
    for (i = 0; i < 3; i++)
        late[i] = sample(job, keys3[i], 100, 1000 + i);
    c->writer = f->s;
    c->write_batch = late;
    c->write_n = 3;
    td_metric_cursor_init(&cur, 40);
    c->n = 0;
    assert_int_equal(
        td_store_metrics_page(reader, job, &cur, NULL, 0, 1000, collect, c, &ndone, &err), 0);
    assert_null(c->writer); /* the write happened, and succeeded */
    assert_int_equal(ndone, 30);
    assert_int_equal(
        td_store_metrics_page(reader, job, &cur, NULL, 0, 1000, collect, c, &ndone, &err), 0);
    assert_int_equal(ndone, 3);
    assert_int_equal(c->rows[32].step, 100);
    /* A key the writer interned is found by the reader's filter, though not in its cache. */
    c->n = 0;
    page_all(reader, job, 0, (const char *const[]){"lr"}, 1, 7, c);
    assert_int_equal(c->n, 51);
    td_store_close(reader);
    free(c);
}

static int count_one(void *ud, const td_metric_row *row)
{
    (void)row;
    (*(size_t *)ud)++;
    return 0;
}

/* Counts a job's rows, all of them, in pages of 1000. */
static int count_rows(td_store *s, int64_t job)
{
    td_metric_cursor cur;
    td_error_t err = {0};
    size_t total = 0;
    size_t ndone;

    td_metric_cursor_init(&cur, INT64_MIN);
    do {
        assert_int_equal(
            td_store_metrics_page(s, job, &cur, NULL, 0, 1000, count_one, &total, &ndone, &err), 0);
    } while (ndone == 1000);
    return (int)total;
}

/* A sample for a job that does not exist fails the batch at that row; everything before it
 * in the batch, including a key it interned, is rolled back, and the store goes on. */
static void test_write_error_rolls_back(void **state)
{
    fixture *f = *state;
    td_metric m[100];
    td_error_t err = {0};
    summaries *out = calloc(1, sizeof(*out));
    int64_t job = new_job(f->s, "rollback");
    int i;

    assert_non_null(out);
    m[0] = sample(job, "loss", 0, 1.0);
    assert_int_equal(td_store_metrics_write(f->s, m, 1, &err), 0);
    for (i = 0; i < 100; i++)
        m[i] = sample(job, i % 2 ? "loss" : "fresh", i + 1, i);
    m[50].job = 999;
    assert_int_equal(td_store_metrics_write(f->s, m, 100, &err), TD_ENOTFOUND);
    assert_int_equal(err.code, TD_ENOTFOUND);
    /* The message says which statement, which sample, and SQLite's own words. */
    assert_non_null(strstr(err.msg, "INSERT INTO metrics"));
    assert_non_null(strstr(err.msg, "metrics[50] of 100"));
    assert_non_null(strstr(err.msg, "job 999"));
    assert_non_null(strstr(err.msg, "FOREIGN KEY constraint failed"));
    assert_int_equal(count_rows(f->s, job), 1);
    assert_non_null(find_summary(f->s, job, "loss", out));
    assert_int_equal(out->n, 1); /* no summary for "fresh" */
    assert_int_equal(out->rows[0].v.count, 1);

    /* "fresh" was interned inside the rolled-back batch; the cache must not keep its id. */
    m[50].job = job;
    assert_int_equal(td_store_metrics_write(f->s, m, 100, &err), 0);
    assert_int_equal(count_rows(f->s, job), 101);
    assert_non_null(find_summary(f->s, job, "fresh", out));
    assert_int_equal(out->n, 2);

    /* A bad key is refused before anything is written. */
    m[0] = sample(job, "ok", 500, 1.0);
    m[1] = sample(job, "", 501, 1.0);
    assert_int_equal(td_store_metrics_write(f->s, m, 2, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "empty"));
    assert_int_equal(count_rows(f->s, job), 101);
    /* err may be NULL, and an empty batch is no work. */
    assert_int_equal(td_store_metrics_write(f->s, m, 2, NULL), TD_EINVAL);
    assert_int_equal(td_store_metrics_write(f->s, NULL, 0, &err), 0);
    free(out);
}

/* SQLITE_FULL, provoked with max_page_count on the store's own connection, is TD_EDISKFULL;
 * the batch is rolled back whole, and writing works again once there is room. */
static void test_write_disk_full(void **state)
{
    fixture *f = *state;
    const size_t n = 20000;
    td_metric *m = calloc(n, sizeof(*m));
    summaries *out = calloc(1, sizeof(*out));
    td_error_t err = {0};
    int64_t job = new_job(f->s, "full");
    size_t i;

    assert_non_null(m);
    assert_non_null(out);
    m[0] = sample(job, "loss", 0, 1.0);
    assert_int_equal(td_store_metrics_write(f->s, m, 1, &err), 0);
    /* SQLite will not go below the current size, so 1 means "no bigger than now". */
    assert_int_equal(td__store_exec(f->s, "PRAGMA max_page_count = 1", &err), 0);
    for (i = 0; i < n; i++)
        m[i] = sample(job, i % 2 ? "loss" : "grad_norm", (int64_t)i + 1, (double)i);
    assert_int_equal(td_store_metrics_write(f->s, m, n, &err), TD_EDISKFULL);
    assert_non_null(strstr(err.msg, "full"));
    assert_int_equal(count_rows(f->s, job), 1);
    assert_non_null(find_summary(f->s, job, "loss", out));
    assert_int_equal(out->n, 1);
    assert_int_equal(out->rows[0].v.count, 1);

    assert_int_equal(td__store_exec(f->s, "PRAGMA max_page_count = 1000000", &err), 0);
    assert_int_equal(td_store_metrics_write(f->s, m, n, &err), 0);
    assert_int_equal(count_rows(f->s, job), (int)n + 1);
    free(m);
    free(out);
}

/* A connection that may not write (query_only): every write fails with TD_ESTORE and SQLite's
 * message, and reads go on. */
static void test_write_readonly(void **state)
{
    fixture *f = *state;
    td_metric m[2];
    td_error_t err = {0};
    int64_t job = new_job(f->s, "ro");
    int64_t id = 0;

    m[0] = sample(job, "loss", 0, 1.0);
    m[1] = sample(job, "loss", 1, 2.0);
    assert_int_equal(td__store_exec(f->s, "PRAGMA query_only = 1", &err), 0);
    assert_int_equal(td_store_metrics_write(f->s, m, 2, &err), TD_ESTORE);
    assert_non_null(strstr(err.msg, "readonly"));
    assert_int_equal(td_store_job_insert(f->s, "x", 1, 0, 0, NULL, 0, NULL, &id, &err), TD_ESTORE);
    assert_int_equal(td_store_log(f->s, job, 6, "hello", &err), TD_ESTORE);
    assert_int_equal(count_rows(f->s, job), 0);
    assert_int_equal(td__store_exec(f->s, "PRAGMA query_only = 0", &err), 0);
    assert_int_equal(td_store_metrics_write(f->s, m, 2, &err), 0);
    assert_int_equal(count_rows(f->s, job), 2);
}

/* Another connection holding the write lock past the busy timeout: TD_EBUSY, "locked". */
static void test_write_busy(void **state)
{
    fixture *f = *state;
    td_metric m = sample(new_job(f->s, "busy"), "loss", 0, 1.0);
    td_error_t err = {0};
    sqlite3 *db = NULL;

    assert_int_equal(td__store_exec(f->s, "PRAGMA busy_timeout = 50", &err), 0);
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    assert_int_equal(td_store_metrics_write(f->s, &m, 1, &err), TD_EBUSY);
    assert_non_null(strstr(err.msg, "locked"));
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(td_store_metrics_write(f->s, &m, 1, &err), 0);
    assert_int_equal(count_rows(f->s, m.job), 1);
}

/* ---- logs ---- */

typedef struct log_lines {
    int64_t id[8];
    int level[8];
    char msg[8][64];
    size_t n;
} log_lines;

static int collect_log(void *ud, const td_job_log_row *row)
{
    log_lines *l = ud;

    assert_true(l->n < 8);
    l->id[l->n] = row->id;
    l->level[l->n] = row->level;
    snprintf(l->msg[l->n], sizeof(l->msg[0]), "%s", row->msg);
    assert_true(row->time > 1.6e9);
    l->n++;
    return 0;
}

static void test_logs(void **state)
{
    fixture *f = *state;
    int64_t a = new_job(f->s, "a");
    int64_t b = new_job(f->s, "b");
    log_lines l = {0};
    td_error_t err = {0};
    size_t ndone = 0;

    assert_int_equal(td_store_log(f->s, a, 6, "queued", &err), 0);
    assert_int_equal(td_store_log(f->s, b, 6, "other job", &err), 0);
    assert_int_equal(td_store_log(f->s, a, 6, "started on cpu:0", &err), 0);
    assert_int_equal(td_store_log(f->s, a, 4, "batch reduced to 16 to fit", &err), 0);
    assert_int_equal(td_store_log(f->s, 999, 6, "nobody", &err), TD_ENOTFOUND);

    assert_int_equal(td_store_log_read(f->s, a, 0, 2, collect_log, &l, &ndone, &err), 0);
    assert_int_equal(ndone, 2);
    assert_string_equal(l.msg[0], "queued");
    assert_string_equal(l.msg[1], "started on cpu:0");
    assert_true(l.id[0] < l.id[1]);
    assert_int_equal(td_store_log_read(f->s, a, l.id[1], 2, collect_log, &l, &ndone, &err), 0);
    assert_int_equal(ndone, 1);
    assert_int_equal(l.level[2], 4);
    assert_string_equal(l.msg[2], "batch reduced to 16 to fit");
    assert_int_equal(td_store_log_read(f->s, a, l.id[2], 2, collect_log, &l, &ndone, &err), 0);
    assert_int_equal(ndone, 0);
    assert_int_equal(td_store_log_read(f->s, 999, 0, 10, collect_log, &l, &ndone, &err), 0);
    assert_int_equal(ndone, 0);
}

/* ---- migrations from every released schema ---- */

/* The version-1 schema exactly as the first traind created it (schema.c's step 0, frozen
 * here: the test must not follow later edits of the migration list). */
static const char v1_schema[] =
    "CREATE TABLE jobs (id INTEGER PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL"
    "  CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),"
    "  step INTEGER NOT NULL DEFAULT 0, total_steps INTEGER NOT NULL DEFAULT 0,"
    "  devices INTEGER NOT NULL, device_list TEXT NOT NULL DEFAULT '',"
    "  priority INTEGER NOT NULL DEFAULT 0, uid INTEGER NOT NULL DEFAULT -1,"
    "  err_code INTEGER NOT NULL DEFAULT 0, err_msg TEXT, created REAL NOT NULL,"
    "  started REAL NOT NULL DEFAULT 0, ended REAL NOT NULL DEFAULT 0, spec BLOB,"
    "  spec_json TEXT);"
    "CREATE INDEX jobs_state ON jobs(state);"
    "CREATE TABLE metric_keys (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);"
    "CREATE TABLE metrics (job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  key INTEGER NOT NULL REFERENCES metric_keys(id), step INTEGER NOT NULL, value REAL,"
    "  time REAL, PRIMARY KEY (job, key, step)) WITHOUT ROWID;"
    "CREATE INDEX metrics_by_step ON metrics(job, step, key, value, time);"
    "CREATE TABLE metric_summary (job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
    "  key INTEGER NOT NULL REFERENCES metric_keys(id), count INTEGER NOT NULL,"
    "  last_step INTEGER NOT NULL, last REAL, \"min\" REAL, \"max\" REAL,"
    "  PRIMARY KEY (job, key)) WITHOUT ROWID;"
    "CREATE TABLE job_logs (id INTEGER PRIMARY KEY,"
    "  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE, time REAL NOT NULL,"
    "  level INTEGER NOT NULL, message TEXT NOT NULL);"
    "CREATE INDEX job_logs_by_job ON job_logs(job, id);";

#define NEXT_ID   4   /* the id a new job gets in a migrated old file: one above its job 3 */
#define OLD_STEPS 700 /* steps of each of two keys, per job with metrics */

/* Fills an old file as an older traind left it (no auto_vacuum, WAL): three jobs in three
 * states, each with OLD_STEPS steps of two keys and their summaries, log lines, and on a
 * version-2 file the failed job's per-device errors. Job 3 is the highest id left. */
static void write_old_file(const char *path, int version)
{
    sqlite3 *db = NULL;
    sqlite3_stmt *st = NULL;
    char sql[64];

    unlink(path);
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "PRAGMA journal_mode=WAL", NULL, NULL, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, v1_schema, NULL, NULL, NULL), SQLITE_OK);
    if (version >= 2)
        assert_int_equal(
            sqlite3_exec(db, "ALTER TABLE jobs ADD COLUMN err_devices BLOB", NULL, NULL, NULL),
            SQLITE_OK);
    if (version >= 3)
        assert_int_equal(sqlite3_exec(db,
                                      "CREATE TABLE jobs_deleting (id INTEGER PRIMARY KEY);"
                                      "CREATE TABLE store_meta (key TEXT PRIMARY KEY,"
                                      "  value INTEGER NOT NULL) WITHOUT ROWID;",
                                      NULL, NULL, NULL),
                         SQLITE_OK);
    assert_int_equal(
        sqlite3_exec(db,
                     "BEGIN;"
                     "INSERT INTO jobs (id, name, state, step, total_steps, devices, device_list,"
                     "  uid, created, started, ended, spec_json) VALUES"
                     " (1, 'done', 'succeeded', 700, 700, 1, 'cpu:0', 1000, 1.7e9, 1.7e9 + 1,"
                     "  1.7e9 + 60, '{\"model\":\"mlp\"}'),"
                     " (2, 'broke', 'failed', 350, 700, 2, 'cpu:0,cpu:1', 1001, 1.7e9 + 100,"
                     "  1.7e9 + 101, 1.7e9 + 130, NULL),"
                     " (3, 'waits', 'queued', 0, 0, 1, '', 1000, 1.7e9 + 200, 0, 0, NULL);"
                     "UPDATE jobs SET err_code = -4000, err_msg = 'worker on cpu:1 failed'"
                     "  WHERE id = 2;"
                     "INSERT INTO metric_keys (id, name) VALUES (1, 'train_loss'), (2, 'lr');"
                     "WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s"
                     "  WHERE n < 700)"
                     " INSERT INTO metrics SELECT j.id, k.id, s.n, j.id * 1000.0 + k.id + s.n,"
                     "  1.7e9 + s.n FROM s, (SELECT 1 AS id UNION SELECT 2) j, metric_keys k;"
                     "INSERT INTO metric_summary SELECT job, key, count(*), max(step),"
                     "  job * 1000.0 + key + 700, min(value), max(value) FROM metrics"
                     "  GROUP BY job, key;"
                     "INSERT INTO job_logs (job, time, level, message) VALUES"
                     " (1, 1.7e9, 6, 'started on cpu:0'), (1, 1.7e9 + 60, 6, 'succeeded'),"
                     " (2, 1.7e9 + 130, 3, 'failed: worker on cpu:1 failed');"
                     "COMMIT;",
                     NULL, NULL, NULL),
        SQLITE_OK);
    if (version >= 2) {
        assert_int_equal(
            sqlite3_prepare_v2(db, "UPDATE jobs SET err_devices = ?1 WHERE id = 2", -1, &st, NULL),
            SQLITE_OK);
        sqlite3_bind_blob(st, 1, "\x91\x80", 2, SQLITE_STATIC);
        assert_int_equal(sqlite3_step(st), SQLITE_DONE);
        sqlite3_finalize(st);
    }
    snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", version);
    assert_int_equal(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_close(db), SQLITE_OK);
}

/* Checks every job, metric row, summary and log line write_old_file put in, through s. */
static void check_old_data(td_store *s, int version)
{
    static const char *const names[] = {"done", "broke", "waits"};
    static const char *const states[] = {TD_JOB_SUCCEEDED, TD_JOB_FAILED, TD_JOB_QUEUED};
    collector *c = calloc(1, sizeof(*c));
    td_error_t err = {0};
    td_job_row row = {0};
    summaries sum;
    const td_metric_summary *ms;
    log_lines l = {0};
    size_t ndone = 0;
    int64_t job;

    assert_non_null(c);
    for (job = 1; job <= 3; job++) {
        assert_int_equal(td_store_job_get(s, job, &row, &err), 0);
        assert_string_equal(row.name, names[job - 1]);
        assert_string_equal(row.state, states[job - 1]);
        assert_true(row.created >= 1.7e9);
        if (job == 2) {
            assert_int_equal(row.err_code, -4000);
            assert_string_equal(row.err_msg, "worker on cpu:1 failed");
            assert_string_equal(row.device_list, "cpu:0,cpu:1");
            assert_int_equal(row.step, 350);
            if (version >= 2) {
                assert_int_equal(row.err_devices_len, 2);
                assert_memory_equal(row.err_devices, "\x91\x80", 2);
            } else {
                assert_null(row.err_devices);
            }
        }
        td_job_row_clear(&row);
        c->n = 0;
        page_all(s, job, 0, NULL, 0, 500, c);
        assert_int_equal(c->n, job <= 2 ? 2 * OLD_STEPS : 0);
        for (size_t i = 0; i < c->n; i++)
            assert_true(c->rows[i].value ==
                        (double)job * 1000.0 + c->rows[i].key_id + (double)c->rows[i].step);
    }
    ms = find_summary(s, 2, "train_loss", &sum);
    assert_non_null(ms);
    assert_int_equal(ms->count, OLD_STEPS);
    assert_int_equal(ms->last_step, OLD_STEPS);
    assert_int_equal(td_store_log_read(s, 1, 0, 8, collect_log, &l, &ndone, &err), 0);
    assert_int_equal(ndone, 2);
    assert_string_equal(l.msg[1], "succeeded");
    free(c);
}

/* A database from each earlier schema version (1: the first; 2: before rm and prune; 3: before
 * the nodes of jobs that span nodes) is
 * migrated on open with every job, metric row, summary and log line kept; the new tables
 * work (a job is deleted, its id not given again), err_devices round-trips, and the
 * conversion to incremental auto-vacuum keeps everything too. */
static void test_migrates_old_versions_keeps_everything(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_purge_totals tot;
    td_store_space sp;
    td_store *s = NULL;
    td_job_row row = {0};
    char path[320];
    int64_t one = 1, id = 0, jobs = 0;
    size_t rows = 0;
    int done = 0;

    snprintf(path, sizeof(path), "%s/old.db", f->dir);
    for (int version = 1; version < TD_STORE_SCHEMA_VERSION; version++) {
        write_old_file(path, version);
        assert_int_equal(raw_pragma_int(path, "PRAGMA user_version"), version);
        assert_int_equal(td_store_open(&s, path, &err), 0);
        assert_int_equal(raw_pragma_int(path, "PRAGMA user_version"), TD_STORE_SCHEMA_VERSION);
        check_old_data(s, version);

        /* An old file keeps its free pages until converted; converting keeps the data. */
        assert_int_equal(td_store_space_get(s, &sp, &err), 0);
        assert_int_equal(sp.auto_vacuum, 0);
        assert_int_equal(td_store_vacuum_convert(s, (int64_t)1 << 30, &done, &err), 0);
        assert_int_equal(done, 1);
        check_old_data(s, version);

        /* The new column and the deletion tables work on the migrated file. */
        assert_int_equal(td_store_job_set_error_devices(s, 1, "\x90", 1, &err), 0);
        assert_int_equal(td_store_job_get(s, 1, &row, &err), 0);
        assert_int_equal(row.err_devices_len, 1);
        assert_null(row.nodes);
        assert_int_equal(row.restarts, 0);
        td_job_row_clear(&row);
        assert_int_equal(td_store_job_set_nodes(s, 2, "\x81\xa1n\x90", 4, 3, &err), 0);
        assert_int_equal(td_store_job_get(s, 2, &row, &err), 0);
        assert_int_equal(row.nodes_len, 4);
        assert_memory_equal(row.nodes, "\x81\xa1n\x90", 4);
        assert_int_equal(row.restarts, 3);
        td_job_row_clear(&row);
        assert_int_equal(td_store_jobs_mark(s, &one, 1, NULL, NULL, &tot, &err), 0);
        assert_int_equal(tot.metric_rows, 2 * OLD_STEPS);
        do
            assert_int_equal(td_store_purge_step(s, 500, NULL, NULL, &jobs, &rows, &err), 0);
        while (rows > 0);
        assert_int_equal(td_store_job_get(s, 1, &row, &err), TD_ENOTFOUND);
        assert_int_equal(td_store_job_insert(s, "new", 1, 0, 1000, NULL, 0, NULL, &id, &err), 0);
        assert_int_equal(id, NEXT_ID);
        td_store_close(s);
        s = NULL;

        /* Reopening a migrated file changes nothing. */
        assert_int_equal(td_store_open(&s, path, &err), 0);
        assert_int_equal(td_store_job_get(s, 2, &row, &err), 0);
        assert_string_equal(row.name, "broke");
        td_job_row_clear(&row);
        td_store_close(s);
        s = NULL;
    }
    unlink(path);
    snprintf(path, sizeof(path), "%s/old.db-wal", f->dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/old.db-shm", f->dir);
    unlink(path);
}

/* Ids of a page into ids; returns how many, with *more. */
static size_t page_ids(td_store *s, const td_job_query *q, size_t limit, int64_t *ids, int *more)
{
    td_job_row *rows = NULL;
    td_error_t err = {0};
    size_t n = 0;

    assert_int_equal(td_store_job_page(s, q, limit, &rows, &n, more, &err), 0);
    for (size_t i = 0; i < n; i++) {
        ids[i] = rows[i].id;
        assert_null(rows[i].spec); /* a page never reads the specs */
        td_job_row_clear(&rows[i]);
    }
    free(rows);
    return n;
}

/* A filtered, keyset-paginated listing: each filter, the order both ways, the cursor, and
 * more only when a further job matches. */
static void test_job_page(void **state)
{
    fixture *f = *state;
    static const char *const failed[] = {TD_JOB_FAILED};
    static const char *const two[] = {TD_JOB_QUEUED, TD_JOB_CANCELLED};
    static const char *const bogus[] = {"done"};
    td_error_t err = {0};
    td_job_row *rows;
    int64_t ids[16];
    size_t n;
    int more;

    /* Jobs 1..10: "a-1".."a-5" then "b-6".."b-10"; uid 0 for even ids, 1000 for odd; ids 3 and
     * 4 failed, 5 cancelled; created 100 s apart. */
    for (int i = 1; i <= 10; i++) {
        char name[16];
        int64_t id;
        snprintf(name, sizeof(name), "%s-%d", i <= 5 ? "a" : "b", i);
        assert_int_equal(
            td_store_job_insert(f->s, name, 1, 0, i % 2 ? 1000 : 0, NULL, 0, NULL, &id, &err), 0);
        assert_int_equal(id, i);
    }
    assert_int_equal(td_store_job_set_state(f->s, 3, TD_JOB_FAILED, NULL, -4209, "nan", &err), 0);
    assert_int_equal(td_store_job_set_state(f->s, 4, TD_JOB_FAILED, NULL, -4209, "nan", &err), 0);
    assert_int_equal(td_store_job_set_state(f->s, 5, TD_JOB_CANCELLED, NULL, 0, NULL, &err), 0);
    assert_int_equal(td__store_exec(f->s, "UPDATE jobs SET created = id * 100", &err), 0);

    n = page_ids(f->s, &(td_job_query){0}, 4, ids, &more);
    assert_int_equal(n, 4);
    assert_true(more);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[3], 4);
    n = page_ids(f->s, &(td_job_query){.after = 4}, 6, ids, &more);
    assert_int_equal(n, 6);
    assert_false(more); /* exactly the rest: no further page */
    assert_int_equal(ids[5], 10);
    n = page_ids(f->s, &(td_job_query){.newest_first = 1, .after = 8}, 3, ids, &more);
    assert_int_equal(n, 3);
    assert_true(more);
    assert_int_equal(ids[0], 7);
    assert_int_equal(ids[2], 5);
    n = page_ids(f->s, &(td_job_query){.states = failed, .nstates = 1}, 10, ids, &more);
    assert_int_equal(n, 2);
    assert_int_equal(ids[1], 4);
    n = page_ids(f->s, &(td_job_query){.states = two, .nstates = 2}, 10, ids, &more);
    assert_int_equal(n, 8); /* 5 cancelled, and the seven still queued */
    n = page_ids(f->s, &(td_job_query){.by_uid = 1, .uid = 0}, 10, ids, &more);
    assert_int_equal(n, 5);
    assert_int_equal(ids[0], 2);
    n = page_ids(f->s, &(td_job_query){.name_glob = "b-1?"}, 10, ids, &more);
    assert_int_equal(n, 1);
    assert_int_equal(ids[0], 10);
    n = page_ids(f->s, &(td_job_query){.name_glob = "[ab]-[2-4]"}, 10, ids, &more);
    assert_int_equal(n, 3);
    n = page_ids(f->s, &(td_job_query){.since = 750}, 10, ids, &more);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 8);
    n = page_ids(f->s,
                 &(td_job_query){
                     .by_uid = 1, .uid = 1000, .name_glob = "a-*", .since = 200, .newest_first = 1},
                 10, ids, &more);
    assert_int_equal(n, 2); /* 5 and 3 */
    assert_int_equal(ids[0], 5);
    assert_int_equal(ids[1], 3);

    assert_int_equal(td_store_job_page(f->s, &(td_job_query){.states = bogus, .nstates = 1}, 10,
                                       &rows, &n, &more, &err),
                     TD_EINVAL);
    assert_int_equal(td_store_job_page(f->s, &(td_job_query){0}, 0, &rows, &n, &more, &err),
                     TD_EINVAL);
}

/* ---- locks, open errors, the WAL ---- */

static long long now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Another process's write lock (a plain sqlite3 handle here, as an sqlite3 shell's would be):
 * a TD_STORE_NOWAIT connection's writes fail at once, well before TD_STORE_BUSY_MS, with
 * TD_EBUSY; its reads go on; once the lock is gone the writes go through. */
static void test_nowait_fails_fast_on_another_lock(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "locked"), id = 0;
    td_metric m = sample(job, "loss", 0, 1.0);
    td_job_row row = {0};
    td_error_t err = {0};
    sqlite3 *db = NULL;
    long long t0;

    td_store_set_lock_wait(f->s, TD_STORE_NOWAIT);
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    t0 = now_ms();
    assert_int_equal(td_store_job_insert(f->s, "x", 1, 0, 0, NULL, 0, NULL, &id, &err), TD_EBUSY);
    assert_non_null(strstr(err.msg, "locked"));
    assert_int_equal(td_store_metrics_write(f->s, &m, 1, &err), TD_EBUSY);
    assert_int_equal(td_store_log(f->s, job, 6, "a line", &err), TD_EBUSY);
    assert_true(now_ms() - t0 < TD_STORE_BUSY_MS); /* none sat out the busy timeout */
    /* Reads do not wait on a writer. */
    assert_int_equal(td_store_job_get(f->s, job, &row, &err), 0);
    td_job_row_clear(&row);
    /* Under the lock even a write that would fail for another reason fails on the lock... */
    assert_int_equal(td_store_job_set_state(f->s, 999, TD_JOB_FAILED, NULL, 0, NULL, &err),
                     TD_EBUSY);
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    /* ...and without it, the other reason is no lock. */
    assert_int_equal(td_store_job_set_state(f->s, 999, TD_JOB_FAILED, NULL, 0, NULL, &err),
                     TD_ENOTFOUND);
    assert_int_equal(td_store_metrics_write(f->s, &m, 1, &err), 0);
    assert_int_equal(td_store_job_insert(f->s, "x", 1, 0, 0, NULL, 0, NULL, &id, &err), 0);
    /* Back to waiting: the same lock is waited out (here for 50 ms, then it fails). */
    td_store_set_lock_wait(f->s, TD_STORE_WAIT);
    assert_int_equal(count_rows(f->s, job), 1);
}

typedef struct holder {
    const char *path;
    int ms;          /* how long the write transaction stays open */
    int began;       /* set once it is open */
    long long ended; /* now_ms() at its commit */
} holder;

/* Another connection of this process holds a write transaction for h->ms, then commits. */
static void *hold_write(void *arg)
{
    holder *h = arg;
    td_store *s = NULL;
    td_error_t err = {0};

    assert_int_equal(td_store_open(&s, h->path, &err), 0);
    assert_int_equal(td__store_begin(s, &err), 0);
    __atomic_store_n(&h->began, 1, __ATOMIC_SEQ_CST);
    usleep((useconds_t)h->ms * 1000);
    h->ended = now_ms();
    assert_int_equal(td__store_commit(s, &err), 0);
    td_store_close(s);
    return NULL;
}

/* This process's own writer (the daemon's store thread, say) is waited out by a
 * TD_STORE_NOWAIT connection: its transactions are short, and the write must not fail. */
static void test_nowait_waits_for_own_writer(void **state)
{
    fixture *f = *state;
    holder h = {.path = f->path, .ms = 300};
    td_error_t err = {0};
    pthread_t t;
    int64_t id = 0;

    td_store_set_lock_wait(f->s, TD_STORE_NOWAIT);
    assert_int_equal(pthread_create(&t, NULL, hold_write, &h), 0);
    while (!__atomic_load_n(&h.began, __ATOMIC_SEQ_CST))
        usleep(1000);
    assert_int_equal(td_store_job_insert(f->s, "after", 1, 0, 0, NULL, 0, NULL, &id, &err), 0);
    assert_true(now_ms() >= h.ended && h.ended > 0);
    pthread_join(t, NULL);
}

/* A file that cannot be opened names its directory and the reason, not SQLite's bare "unable
 * to open database file". */
static void test_open_names_the_cause(void **state)
{
    fixture *f = *state;
    td_error_t err = {0};
    td_store *s = NULL;
    char plain[400], path[500];

    snprintf(plain, sizeof(plain), "%s/plain", f->dir);
    fclose(fopen(plain, "w"));
    snprintf(path, sizeof(path), "%s/traind.db", plain);
    assert_int_equal(td_store_open(&s, path, &err), TD_ESTORE);
    assert_null(s);
    assert_non_null(strstr(err.msg, path));
    if (strstr(err.msg, "is not a directory") == NULL)
        fail_msg("%s", err.msg);
    unlink(plain);

    snprintf(path, sizeof(path), "%s/dir.db", f->dir);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(td_store_open(&s, path, &err), TD_ESTORE);
    if (strstr(err.msg, "is a directory") == NULL)
        fail_msg("%s", err.msg);
    rmdir(path);

    snprintf(path, sizeof(path), "%s/missing/traind.db", f->dir);
    assert_int_equal(td_store_open(&s, path, &err), TD_ESTORE);
    if (strstr(err.msg, "No such file or directory") == NULL)
        fail_msg("%s", err.msg);
}

/* Writes n batches of 500 rows for job from step first on. */
static void write_rows(td_store *s, int64_t job, int64_t first, int n)
{
    td_metric m[500];
    td_error_t err = {0};

    for (int b = 0; b < n; b++) {
        for (int i = 0; i < 500; i++)
            m[i] = sample(job, keys3[i % 3], first + b * 500 + i, i);
        assert_int_equal(td_store_metrics_write(s, m, 500, &err), 0);
    }
}

/* A reader's open transaction holds a checkpoint back, and td_store_wal_checkpoint says so;
 * once it ends, a checkpoint copies everything back. */
static void test_wal_checkpoint_held_by_reader(void **state)
{
    fixture *f = *state;
    int64_t job = new_job(f->s, "wal");
    td_store_wal w;
    td_error_t err = {0};
    sqlite3 *db = NULL;

    write_rows(f->s, job, 0, 2);
    assert_int_equal(td_store_wal_checkpoint(f->s, &w, &err), 0);
    assert_int_equal(w.checkpointed, w.frames);
    assert_int_equal(sqlite3_open(f->path, &db), SQLITE_OK);
    assert_int_equal(sqlite3_exec(db, "BEGIN; SELECT count(*) FROM jobs;", NULL, NULL, NULL),
                     SQLITE_OK);
    write_rows(f->s, job, 1000, 20);
    assert_int_equal(td_store_wal_checkpoint(f->s, &w, &err), 0);
    assert_true(w.frames > 0);
    assert_true(w.checkpointed < w.frames);
    assert_true(w.page_bytes >= 512);
    assert_true(w.file_bytes >= w.frames * w.page_bytes);
    assert_int_equal(td_store_wal_bytes(f->s), w.file_bytes);
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    assert_int_equal(td_store_wal_checkpoint(f->s, &w, &err), 0);
    assert_int_equal(w.checkpointed, w.frames);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_reopen_keeps_data_and_version),
        T(test_migrates_old_versions_keeps_everything),
        T(test_wal_mode),
        T(test_newer_version_refused),
        T(test_open_bad_path),
        T(test_job_row_clear),
        T(test_job_lifecycle),
        T(test_job_set_spec),
        T(test_job_errors),
        T(test_job_page),
        T(test_metrics_page_order),
        T(test_metrics_cursor_resume_and_stop),
        T(test_metrics_keys_filter),
        T(test_metrics_since),
        T(test_metrics_replay_replaces),
        T(test_metrics_summary),
        T(test_two_connections),
        T(test_write_error_rolls_back),
        T(test_write_disk_full),
        T(test_write_readonly),
        T(test_write_busy),
        T(test_logs),
        T(test_nowait_fails_fast_on_another_lock),
        T(test_nowait_waits_for_own_writer),
        T(test_open_names_the_cause),
        T(test_wal_checkpoint_held_by_reader),
    };

    return cmocka_run_group_tests_name("store", tests, NULL, NULL);
}
