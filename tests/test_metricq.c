/* Unit tests of the metric pipeline (daemon/metricq.c): the rules of metricq.h, each as a
 * test, against a real store in a temporary directory. A full disk is a small tmpfs mounted
 * in it (root and mount(2)); those tests are skipped, saying so, where mounting is refused. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "daemon/metricq.h"
#include "store/store.h"
#include "store/store_int.h" /* td__store_exec, to hold the write lock */

typedef struct fixture {
    char dir[64];
    char db[128];
    td_store *s; /* the test's own connection, for jobs and reads */
    int64_t job;
    pthread_mutex_t mu;
    int64_t durable_step;
    int durable_calls;
} fixture;

static void on_durable(void *ud, int64_t job, int64_t step)
{
    fixture *f = ud;
    pthread_mutex_lock(&f->mu);
    if (step > f->durable_step)
        f->durable_step = step;
    f->durable_calls++;
    pthread_mutex_unlock(&f->mu);
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    td_error_t err;

    snprintf(f->dir, sizeof(f->dir), "/tmp/traind-mq.XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->db, sizeof(f->db), "%s/traind.db", f->dir);
    assert_int_equal(td_store_open(&f->s, f->db, &err), 0);
    assert_int_equal(td_store_job_insert(f->s, "j", 1, 0, 0, "\x80", 1, "{}", &f->job, &err), 0);
    pthread_mutex_init(&f->mu, NULL);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    char cmd[128];
    char mnt[128];

    td_store_close(f->s);
    /* A failed disk-full test leaves its tmpfs mounted. */
    snprintf(mnt, sizeof(mnt), "%s/full", f->dir);
    umount(mnt);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
    assert_int_equal(system(cmd), 0);
    pthread_mutex_destroy(&f->mu);
    free(f);
    return 0;
}

static int count_cb(void *ud, const td_metric_row *row)
{
    (*(int64_t *)ud)++;
    return 0;
}

static int64_t stored(fixture *f, int64_t job)
{
    td_metric_cursor c;
    td_error_t err;
    int64_t n = 0;
    size_t got;

    td_metric_cursor_init(&c, 0);
    do {
        assert_int_equal(
            td_store_metrics_page(f->s, job, &c, NULL, 0, 4096, count_cb, &n, &got, &err), 0);
    } while (got == 4096);
    return n;
}

/* A flush returns only once every sample pushed before it is in SQLite. */
static void test_flush_waits_for_queued_events(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;

    assert_int_equal(td_mq_start(&q, f->db, 0, on_durable, f, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    for (int i = 1; i <= 20000; i++)
        assert_int_equal(td_mq_push(s, i % 2 ? "a" : "b", i, i * 0.5, &err), 0);
    assert_int_equal(td_mq_flush(s, &err), 0);
    assert_int_equal(stored(f, f->job), 20000);
    pthread_mutex_lock(&f->mu);
    assert_int_equal(f->durable_step, 20000);
    assert_true(f->durable_calls >= 1);
    pthread_mutex_unlock(&f->mu);
    td_mq_sink_close(s);
    td_mq_stop(q);
}

/* Samples for a job the store refuses (no such job: a foreign key) fail their batch; each
 * error reaches the producer once, the producer keeps going, and later samples land. */
static void test_errors_reported_once_in_order(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *bad, *good;
    td_error_t err;
    int rc;

    assert_int_equal(td_mq_start(&q, f->db, 0, NULL, NULL, &err), 0);
    assert_int_equal(td_mq_sink_open(q, 999, NULL, &bad), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &good), 0);
    assert_int_equal(td_mq_push(bad, "x", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(bad, &err), TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "job 999"));
    /* Reported once: a second flush is clean. */
    assert_int_equal(td_mq_flush(bad, &err), 0);

    /* Two failing batches, then a flush: both errors, merged in order, and only once. */
    assert_int_equal(td_mq_push(bad, "first", 2, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(bad, NULL) != 0, 1);
    assert_int_equal(td_mq_push(bad, "second", 3, 1.0, &err), 0);
    /* The queue is FIFO: once good's later sample is durable, bad's batch has been tried. */
    assert_int_equal(td_mq_push(good, "marker", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(good, &err), 0);
    rc = td_mq_push(bad, "third", 4, 1.0, &err);
    assert_int_equal(rc, TD_ENOTFOUND); /* the error of "second", reported by the next push */
    assert_non_null(strstr(err.msg, "second"));
    rc = td_mq_flush(bad, &err);
    assert_int_equal(rc, TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "third"));
    assert_null(strstr(err.msg, "second"));

    /* The good sink is unaffected. */
    assert_int_equal(td_mq_push(good, "ok", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(good, &err), 0);
    assert_int_equal(stored(f, f->job), 2);
    td_mq_sink_close(bad);
    td_mq_sink_close(good);
    td_mq_stop(q);
}

typedef struct pusher {
    td_mq_sink *s;
    int n;
    int done;
} pusher;

static void *push_many(void *arg)
{
    pusher *p = arg;
    td_error_t err;
    for (int i = 1; i <= p->n; i++)
        td_mq_push(p->s, "k", i, i, &err);
    __atomic_store_n(&p->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static long long now_ms(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#define HOLD_MS 200 /* how long the full queue is kept full, once it is */

/* A full queue blocks the producer (nothing is dropped) and unblocks as the store drains;
 * the time blocked is counted. The store is held busy by an open write transaction: once the
 * queue is full (the store thread holds a batch it cannot commit, and the ring is full
 * behind it), the producer of 1000 samples is blocked until the commit, HOLD_MS later. */
static void test_full_queue_blocks_and_unblocks(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;
    td_mq_stats_t st = {0};
    pusher p;
    pthread_t t;

    assert_int_equal(td_mq_start(&q, f->db, 64, NULL, NULL, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    /* Hold the write lock from the test's connection so the store thread cannot commit. */
    assert_int_equal(td__store_exec(f->s, "BEGIN IMMEDIATE", &err), 0);
    p = (pusher){.s = s, .n = 1000};
    pthread_create(&t, NULL, push_many, &p);
    for (long long until = now_ms() + 20000; now_ms() < until; usleep(1000)) {
        td_mq_stats(q, &st);
        if (st.queued == st.capacity)
            break;
    }
    assert_int_equal(st.queued, 64);
    assert_int_equal(__atomic_load_n(&p.done, __ATOMIC_SEQ_CST), 0);
    usleep(HOLD_MS * 1000);
    assert_int_equal(__atomic_load_n(&p.done, __ATOMIC_SEQ_CST), 0);
    assert_int_equal(td__store_exec(f->s, "COMMIT", &err), 0);
    pthread_join(t, NULL);
    assert_int_equal(td_mq_flush(s, &err), 0);
    assert_true(td_mq_sink_blocked_ms(s) >= HOLD_MS);
    assert_int_equal(stored(f, f->job), 1000);
    td_mq_sink_close(s);
    td_mq_stop(q);
}

/* A store thread that dies is reported with its cause to pushers and flushers, never as a
 * hang. */
static void test_dying_store_thread_is_reported(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;

    assert_int_equal(td_mq_start(&q, f->db, 16, NULL, NULL, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    assert_int_equal(td_mq_push(s, "k", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(s, &err), 0);
    td_mq_kill(q, TD_EIO, "disk vanished");
    assert_int_equal(td_mq_flush(s, &err), 0); /* nothing was pending: nothing to report */
    assert_int_equal(td_mq_push(s, "k", 2, 1.0, &err), TD_EIO);
    assert_non_null(strstr(err.msg, "disk vanished"));
    td_mq_sink_close(s);
    td_mq_stop(q);
}

typedef struct flusher {
    td_mq_sink *s;
    int rc;
    td_error_t err;
    int done;
} flusher;

static void *flush_thread(void *arg)
{
    flusher *fl = arg;

    fl->rc = td_mq_flush(fl->s, &fl->err);
    __atomic_store_n(&fl->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* Another process holds the write lock (a plain sqlite3 handle, as an sqlite3 shell's would
 * be): the store thread reports that it waits, loses nothing, and writes everything once the
 * lock goes. */
static void test_outside_lock_is_waited_out(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;
    sqlite3 *db = NULL;
    char why[700] = "";
    flusher fl = {0};
    pthread_t t;

    assert_int_equal(td_mq_start(&q, f->db, 0, on_durable, f, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    assert_int_equal(sqlite3_open(f->db, &db), SQLITE_OK);
    /* The store thread's writes hold the lock now and then, briefly. */
    sqlite3_busy_timeout(db, 10000);
    assert_int_equal(sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL), SQLITE_OK);
    for (int i = 1; i <= 5000; i++)
        assert_int_equal(td_mq_push(s, "k", i, i, &err), 0);
    fl.s = s;
    pthread_create(&t, NULL, flush_thread, &fl);
    for (long long until = now_ms() + 20000;
         now_ms() < until && !td_mq_stalled(q, why, sizeof(why));)
        usleep(10 * 1000);
    assert_non_null(strstr(why, "locked by another process"));
    usleep(1500 * 1000);
    assert_int_equal(__atomic_load_n(&fl.done, __ATOMIC_SEQ_CST), 0);
    assert_int_equal(sqlite3_exec(db, "COMMIT", NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
    pthread_join(t, NULL);
    assert_int_equal(fl.rc, 0);
    assert_false(td_mq_stalled(q, why, sizeof(why)));
    assert_int_equal(stored(f, f->job), 5000);
    td_mq_sink_close(s);
    td_mq_stop(q);
}

/* A fixture's database moved onto a small tmpfs (root): 0, or -1 after saying why not. */
static int full_fixture(fixture *f, char *mnt, size_t size)
{
    td_error_t err;

    snprintf(mnt, size, "%s/full", f->dir);
    assert_int_equal(mkdir(mnt, 0700), 0);
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=2m") != 0) {
        fprintf(stderr, "skipped: cannot mount a tmpfs to fill (%s); needs root and mount(2)\n",
                strerror(errno));
        rmdir(mnt);
        return -1;
    }
    td_store_close(f->s);
    snprintf(f->db, sizeof(f->db), "%s/traind.db", mnt);
    assert_int_equal(td_store_open(&f->s, f->db, &err), 0);
    assert_int_equal(td_store_job_insert(f->s, "j", 1, 0, 0, "\x80", 1, "{}", &f->job, &err), 0);
    return 0;
}

/* Fills mnt with mnt/filler; returns a reader (a plain sqlite3 handle) that holds checkpoints
 * back, so that every write needs new room (SQLite would otherwise reuse the WAL's). */
static sqlite3 *fill(const fixture *f, const char *mnt)
{
    static char block[16384];
    char path[256];
    sqlite3 *db = NULL;
    int fd;

    assert_int_equal(sqlite3_open(f->db, &db), SQLITE_OK);
    /* The store thread's writes hold the lock now and then, briefly. */
    sqlite3_busy_timeout(db, 10000);
    assert_int_equal(sqlite3_exec(db, "BEGIN; SELECT count(*) FROM jobs;", NULL, NULL, NULL),
                     SQLITE_OK);
    snprintf(path, sizeof(path), "%s/filler", mnt);
    fd = open(path, O_WRONLY | O_CREAT, 0600);
    assert_true(fd >= 0);
    while (write(fd, block, sizeof(block)) > 0)
        ;
    while (write(fd, block, 1) == 1)
        ;
    close(fd);
    return db;
}

static void unfill(const char *mnt, sqlite3 *db)
{
    char path[256];

    snprintf(path, sizeof(path), "%s/filler", mnt);
    assert_int_equal(unlink(path), 0);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close(db);
}

static void full_teardown(fixture *f, const char *mnt)
{
    td_store_close(f->s);
    f->s = NULL;
    assert_int_equal(umount(mnt), 0);
    rmdir(mnt);
}

typedef struct failures {
    pthread_mutex_t mu;
    int calls;
    int64_t job;
    void *sink_ud; /* the last call's */
    td_error_t err;
} failures;

static void on_failed(void *ud, void *sink_ud, int64_t job, const td_error_t *err)
{
    failures *fs = ud;

    pthread_mutex_lock(&fs->mu);
    fs->calls++;
    fs->job = job;
    fs->sink_ud = sink_ud;
    fs->err = *err;
    pthread_mutex_unlock(&fs->mu);
}

/* Samples the store refuses for another reason (here: no such job) fail their sink's job:
 * the failure callback names it and hands back the sink's own ud (a run's reserved event
 * rides on it), once however many batches fail; the samples are still queued
 * (test_errors_reported_once_in_order). */
static void test_failure_callback_names_job_once(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *bad;
    td_error_t err;
    failures fs = {.mu = PTHREAD_MUTEX_INITIALIZER};

    assert_int_equal(td_mq_start(&q, f->db, 0, NULL, NULL, &err), 0);
    td_mq_on_failure(q, on_failed, &fs);
    assert_int_equal(td_mq_sink_open(q, 999, &bad, &bad), 0);
    assert_int_equal(td_mq_push(bad, "x", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(bad, &err), TD_ENOTFOUND);
    assert_int_equal(td_mq_push(bad, "x", 2, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(bad, &err), TD_ENOTFOUND);
    pthread_mutex_lock(&fs.mu);
    assert_int_equal(fs.calls, 1);
    assert_int_equal(fs.job, 999);
    assert_ptr_equal(fs.sink_ud, &bad);
    assert_int_equal(fs.err.code, TD_ENOTFOUND);
    pthread_mutex_unlock(&fs.mu);
    td_mq_sink_close(bad);
    td_mq_stop(q);
}

/* A full disk: the store thread waits for room (the flush waits, nothing is reported); room
 * comes back, and every sample is written. */
static void test_disk_full_waits_for_room(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;
    char mnt[160], why[700] = "";
    flusher fl = {0};
    pthread_t t;
    sqlite3 *reader;

    if (full_fixture(f, mnt, sizeof(mnt)) != 0)
        skip();
    assert_int_equal(td_mq_start(&q, f->db, 0, on_durable, f, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    reader = fill(f, mnt);
    for (int i = 1; i <= 20000; i++)
        assert_int_equal(td_mq_push(s, i % 2 ? "a" : "b", i, i, &err), 0);
    fl.s = s;
    pthread_create(&t, NULL, flush_thread, &fl);
    for (long long until = now_ms() + 20000;
         now_ms() < until && !td_mq_stalled(q, why, sizeof(why));)
        usleep(10 * 1000);
    assert_non_null(strstr(why, "the disk is full"));
    usleep(1000 * 1000);
    assert_int_equal(__atomic_load_n(&fl.done, __ATOMIC_SEQ_CST), 0);
    unfill(mnt, reader);
    pthread_join(t, NULL);
    assert_int_equal(fl.rc, 0);
    assert_int_equal(stored(f, f->job), 20000);
    td_mq_sink_close(s);
    td_mq_stop(q);
    full_teardown(f, mnt);
}

/* A disk that stays full past the wait: the samples waiting fail with a disk-full error, once;
 * the failure callback names the job, once; later samples of the sink are refused at once,
 * never queued; a new sink writes again once there is room. */
static void test_disk_full_gives_up_after_wait(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;
    char mnt[160];
    failures fs = {.mu = PTHREAD_MUTEX_INITIALIZER};
    long long t0;
    sqlite3 *reader;
    int rc;

    if (full_fixture(f, mnt, sizeof(mnt)) != 0)
        skip();
    assert_int_equal(td_mq_start(&q, f->db, 0, on_durable, f, &err), 0);
    td_mq_on_failure(q, on_failed, &fs);
    td_mq_set_full_wait(q, 500);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    reader = fill(f, mnt);
    t0 = now_ms();
    for (int i = 1; i <= 20000; i++)
        td_mq_push(s, "a", i, i, &err);
    rc = td_mq_flush(s, &err);
    assert_int_equal(rc, TD_EDISKFULL);
    assert_true(now_ms() - t0 >= 500);
    assert_non_null(strstr(err.msg, "disk full"));
    pthread_mutex_lock(&fs.mu);
    assert_int_equal(fs.calls, 1);
    assert_int_equal(fs.job, f->job);
    assert_int_equal(fs.err.code, TD_EDISKFULL);
    pthread_mutex_unlock(&fs.mu);
    /* Refused at once, every time; nothing is queued, so a flush has nothing to wait for. */
    assert_int_equal(td_mq_push(s, "a", 20001, 1, &err), TD_EDISKFULL);
    assert_int_equal(td_mq_push(s, "a", 20002, 1, &err), TD_EDISKFULL);
    assert_int_equal(td_mq_flush(s, &err), 0);
    td_mq_sink_close(s);
    unfill(mnt, reader);
    assert_int_equal(td_mq_sink_open(q, f->job, NULL, &s), 0);
    assert_int_equal(td_mq_push(s, "b", 1, 1, &err), 0);
    assert_int_equal(td_mq_flush(s, &err), 0);
    pthread_mutex_lock(&fs.mu);
    assert_int_equal(fs.calls, 1);
    pthread_mutex_unlock(&fs.mu);
    td_mq_sink_close(s);
    td_mq_stop(q);
    full_teardown(f, mnt);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_flush_waits_for_queued_events, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors_reported_once_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_queue_blocks_and_unblocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dying_store_thread_is_reported, setup, teardown),
        cmocka_unit_test_setup_teardown(test_outside_lock_is_waited_out, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failure_callback_names_job_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_disk_full_waits_for_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_disk_full_gives_up_after_wait, setup, teardown),
    };
    return cmocka_run_group_tests_name("metricq", tests, NULL, NULL);
}
