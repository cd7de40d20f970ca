/* Unit tests of the metric pipeline (daemon/metricq.c): the rules of metricq.h, each as a
 * test, against a real store in a temporary directory. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "metricq.h"
#include "store.h"
#include "store_int.h" /* td__store_exec, to hold the write lock */

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
    td_store_close(f->s);
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
    assert_int_equal(td_mq_sink_open(q, f->job, &s), 0);
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
    assert_int_equal(td_mq_sink_open(q, 999, &bad), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, &good), 0);
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

/* A full queue blocks the producer (nothing is dropped) and unblocks as the store drains;
 * the time blocked is counted. The store is held busy by an open write transaction. */
static void test_full_queue_blocks_and_unblocks(void **state)
{
    fixture *f = *state;
    td_mq *q;
    td_mq_sink *s;
    td_error_t err;
    pusher p;
    pthread_t t;

    assert_int_equal(td_mq_start(&q, f->db, 64, NULL, NULL, &err), 0);
    assert_int_equal(td_mq_sink_open(q, f->job, &s), 0);
    /* Hold the write lock from the test's connection so the store thread cannot commit. */
    assert_int_equal(td__store_exec(f->s, "BEGIN IMMEDIATE", &err), 0);
    p = (pusher){.s = s, .n = 1000};
    pthread_create(&t, NULL, push_many, &p);
    usleep(300 * 1000);
    assert_int_equal(__atomic_load_n(&p.done, __ATOMIC_SEQ_CST), 0);
    assert_int_equal(td__store_exec(f->s, "COMMIT", &err), 0);
    pthread_join(t, NULL);
    assert_int_equal(td_mq_flush(s, &err), 0);
    assert_true(td_mq_sink_blocked_ms(s) >= 100.0);
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
    assert_int_equal(td_mq_sink_open(q, f->job, &s), 0);
    assert_int_equal(td_mq_push(s, "k", 1, 1.0, &err), 0);
    assert_int_equal(td_mq_flush(s, &err), 0);
    td_mq_kill(q, TD_EIO, "disk vanished");
    assert_int_equal(td_mq_flush(s, &err), 0); /* nothing was pending: nothing to report */
    assert_int_equal(td_mq_push(s, "k", 2, 1.0, &err), TD_EIO);
    assert_non_null(strstr(err.msg, "disk vanished"));
    td_mq_sink_close(s);
    td_mq_stop(q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_flush_waits_for_queued_events, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors_reported_once_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_full_queue_blocks_and_unblocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dying_store_thread_is_reported, setup, teardown),
    };
    return cmocka_run_group_tests_name("metricq", tests, NULL, NULL);
}
