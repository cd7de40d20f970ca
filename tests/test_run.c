/* Unit tests of a run's events (daemon/run.c, daemon/mailbox.c) when memory runs out: a run
 * reserves the events that must not be lost (STARTED, DONE, STORE_FAILED) when it is created,
 * so once every later event allocation fails (td__event_calloc) a job still ends, its end and
 * its store failure still arrive, and the PROGRESS notices that could not be allocated are
 * counted as dropped; a run that cannot reserve them is refused with TD_ENOMEM. Each test
 * trains a small MLP on one cpu worker for real, on synthetic IDX files, with a metric queue
 * on a temporary SQLite file and a libuv loop of its own; the loop waits for the DONE event
 * with a deadline. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/engine.h"
#include "daemon/jobspec.h"
#include "daemon/mailbox.h"
#include "daemon/metricq.h"
#include "proto/proto.h"
#include "daemon/run.h"
#include "store/store.h"
#include "tests/train_support.h"

#define N_IMAGES 256
#define STEPS    20
#define DONE_MS  60000 /* the deadline for a 20-step 784-16-10 job on a loaded 2-core box */

static char images[TD_PATH_MAX], labels[TD_PATH_MAX], db[TD_PATH_MAX];

/* What the loop took from the mailbox. */
typedef struct seen {
    int started, done, store_failed;
    uint64_t dropped;
    char state[TD_STORE_MAX_STATE];
    td_error_t done_err, store_err;
} seen;

typedef struct fixture {
    uv_loop_t loop;
    td_mailbox mb;
    td_store *s;
    td_mq *q;
    td_worker w[1];
    int64_t job;
    seen got;
} fixture;

static void *fail_calloc(size_t n, size_t size)
{
    (void)n;
    (void)size;
    return NULL;
}

static void on_mail(void *ud)
{
    fixture *f = ud;
    td_event *ev = td_mailbox_take(&f->mb);

    f->got.dropped += td_mailbox_take_dropped(&f->mb);
    while (ev != NULL) {
        td_event *next = ev->next;
        if (ev->kind == TD_EV_STARTED)
            f->got.started++;
        if (ev->kind == TD_EV_DONE) {
            f->got.done++;
            snprintf(f->got.state, sizeof(f->got.state), "%s", ev->state);
            f->got.done_err = ev->err;
        }
        if (ev->kind == TD_EV_STORE_FAILED) {
            f->got.store_failed++;
            f->got.store_err = ev->err;
        }
        td_event_free(ev);
        ev = next;
    }
}

static void on_durable(void *ud, int64_t job, int64_t step)
{
    (void)ud;
    (void)job;
    (void)step;
}

/* An MLP 784-16-10 job on the synthetic files, as a client sends it, parsed as submit does. */
static void mlp_spec(td_jobspec *spec)
{
    td_proto_frame *fr = NULL;
    td_error_t err = {0};
    const void *body;
    size_t len;
    td_pw w;

    td_pw_init(&w);
    td_pw_map(&w, 7);
    td_pw_str(&w, "name");
    td_pw_str(&w, "oom");
    td_pw_str(&w, "model");
    td_pw_map(&w, 2);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "mlp");
    td_pw_str(&w, "layers");
    td_pw_array(&w, 3);
    td_pw_int(&w, 784);
    td_pw_int(&w, 16);
    td_pw_int(&w, 10);
    td_pw_str(&w, "data");
    td_pw_map(&w, 2);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "idx");
    td_pw_str(&w, "train");
    td_pw_map(&w, 2);
    td_pw_str(&w, "images");
    td_pw_str(&w, images);
    td_pw_str(&w, "labels");
    td_pw_str(&w, labels);
    td_pw_str(&w, "optim");
    td_pw_map(&w, 2);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "adamw");
    td_pw_str(&w, "lr");
    td_pw_double(&w, 1e-3);
    td_pw_str(&w, "batch_size");
    td_pw_int(&w, 32);
    td_pw_str(&w, "max_steps");
    td_pw_int(&w, STEPS);
    td_pw_str(&w, "seed");
    td_pw_int(&w, 7);
    body = td_pw_body(&w, &len);
    assert_non_null(body);
    assert_int_equal(td_proto_decode(body, len, &fr, &err), 0);
    assert_int_equal(td_jobspec_parse(td_proto_frame_root(fr), spec, &err), 0);
    td_proto_frame_free(fr);
    td_pw_free(&w);
    spec->uid = getuid();
    spec->gid = getgid();
}

static int group_setup(void **state)
{
    static uint8_t img[N_IMAGES * 784], lab[N_IMAGES];
    uint32_t idims[3] = {N_IMAGES, 28, 28}, ldims[1] = {N_IMAGES};

    (void)state;
    if (tt_tmpdir_make("/tmp/td_test_run_XXXXXX") != 0)
        return -1;
    for (int i = 0; i < N_IMAGES; i++) {
        lab[i] = (uint8_t)(i % 10);
        memset(img + (size_t)i * 784, 20 * (i % 10), 784);
    }
    tt_path_of(images, "images");
    tt_path_of(labels, "labels");
    tt_path_of(db, "traind.db");
    tt_write_idx(images, 0, TD_IDX_MAGIC_IMAGES, idims, 3, img, sizeof(img));
    tt_write_idx(labels, 0, TD_IDX_MAGIC_LABELS, ldims, 1, lab, sizeof(lab));
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    return tt_tmpdir_remove();
}

/* A store with one job in it, its metric queue (whose failures go to the runs, as in the
 * daemon), a loop with the mailbox, and one cpu worker. */
static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    td_error_t err = {0};

    assert_non_null(f);
    unlink(db);
    assert_int_equal(td_store_open(&f->s, db, &err), 0);
    assert_int_equal(td_store_job_insert(f->s, "oom", 1, 0, 0, NULL, 0, NULL, &f->job, &err), 0);
    assert_int_equal(td_mq_start(&f->q, db, 0, on_durable, NULL, &err), 0);
    td_mq_on_failure(f->q, td_run_on_store_failed, NULL);
    assert_int_equal(uv_loop_init(&f->loop), 0);
    assert_int_equal(td_mailbox_init(&f->mb, &f->loop, on_mail, f), 0);
    f->w[0] = (td_worker){.index = 0, .kind = TD_DEVICE_CPU, .device = 0, .threads = 1};
    snprintf(f->w[0].name, sizeof(f->w[0].name), "cpu:0");
    assert_int_equal(td_workers_start(f->w, 1, &err), 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;

    td__event_calloc = calloc;
    td_workers_stop(f->w, 1);
    td_mq_stop(f->q);
    td_mailbox_close(&f->mb);
    uv_run(&f->loop, UV_RUN_DEFAULT);
    uv_loop_close(&f->loop);
    td_store_close(f->s);
    free(f);
    return 0;
}

static void on_deadline(uv_timer_t *t)
{
    *(int *)t->data = 1;
}

/* Runs the loop until the run's DONE event has been taken, or DONE_MS have passed. */
static void wait_done(fixture *f)
{
    uv_timer_t timer;
    int late = 0;

    assert_int_equal(uv_timer_init(&f->loop, &timer), 0);
    timer.data = &late;
    assert_int_equal(uv_timer_start(&timer, on_deadline, DONE_MS, 0), 0);
    while (f->got.done == 0 && !late)
        uv_run(&f->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&timer, NULL);
    uv_run(&f->loop, UV_RUN_NOWAIT);
    assert_int_equal(f->got.done, 1);
}

/* The arguments of a run of job on the fixture's first worker, with spec as its spec. */
static td_run_args run_args(fixture *f, int64_t job, td_worker **ws, td_jobspec *spec)
{
    ws[0] = &f->w[0];
    mlp_spec(spec);
    return (td_run_args){.job = job,
                         .spec = spec,
                         .workers = ws,
                         .world = 1,
                         .mailbox = &f->mb,
                         .mq = f->q,
                         .nccl_timeout_s = 60};
}

/* Runs job on the worker with every event allocation after td_run_new failing. */
static void run_starved(fixture *f, int64_t job)
{
    td_worker *ws[1];
    td_jobspec spec;
    td_run_args a = run_args(f, job, ws, &spec);
    td_error_t err = {0};
    td_run *r = NULL;

    assert_int_equal(td_run_new(&r, &a, &err), 0);
    td__event_calloc = fail_calloc; /* no worker allocates before td_run_start wakes it */
    td_run_start(r);
    wait_done(f);
    td__event_calloc = calloc;
    td_run_free(r);
}

/* Out of memory for every event after the start: the job trains to its end, STARTED and DONE
 * arrive (succeeded), and each step's PROGRESS notice that could not be allocated is counted
 * dropped, not fatal. */
static void test_end_arrives_when_events_cannot_be_allocated(void **state)
{
    fixture *f = *state;

    run_starved(f, f->job);
    assert_string_equal(f->got.state, TD_JOB_SUCCEEDED);
    assert_int_equal(f->got.done_err.code, 0);
    assert_int_equal(f->got.started, 1);
    assert_int_equal(f->got.store_failed, 0);
    assert_true(f->got.dropped >= 1);
    assert_true(f->got.dropped <= STEPS);
}

/* The store refuses the job's rows (no such job in it) while no event can be allocated: the
 * store thread's failure still arrives with the store's code, from the run's reserve, and the
 * job ends failed with the cause. */
static void test_store_failure_arrives_when_events_cannot_be_allocated(void **state)
{
    fixture *f = *state;

    run_starved(f, f->job + 1000);
    assert_int_equal(f->got.store_failed, 1);
    assert_int_equal(f->got.store_err.code, TD_ENOTFOUND);
    assert_string_equal(f->got.state, TD_JOB_FAILED);
    assert_non_null(strstr(f->got.done_err.msg, "metrics could not be stored"));
}

/* A run that cannot reserve its events is not made: TD_ENOMEM, nothing to free, and the
 * worker stays free for the next one. */
static void test_run_refused_when_reserve_fails(void **state)
{
    fixture *f = *state;
    td_worker *ws[1];
    td_jobspec spec;
    td_run_args a = run_args(f, f->job, ws, &spec);
    td_error_t err = {0};
    td_run *r = NULL;

    td__event_calloc = fail_calloc;
    assert_int_equal(td_run_new(&r, &a, &err), TD_ENOMEM);
    td__event_calloc = calloc;
    assert_null(r);
    assert_non_null(strstr(err.msg, "out of memory starting job"));
    run_starved(f, f->job);
    assert_string_equal(f->got.state, TD_JOB_SUCCEEDED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_end_arrives_when_events_cannot_be_allocated, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_store_failure_arrives_when_events_cannot_be_allocated,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_run_refused_when_reserve_fails, setup, teardown),
    };

    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
