/* Integration tests: each starts a real traind (TRAIND_BIN) on a temporary socket and state
 * directory and talks to it over the wire protocol, as any client would; trainctl (TRAINCTL_BIN)
 * is driven as a user would drive it. They check what a user sees: states, errors, every
 * metric row once and in order, the rows in SQLite, and that the daemon keeps serving after
 * bad input. */
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "proto.h"
#include "store.h"
#include "support.h"

#define FMNIST "/usr/share/datasets/fashion-mnist"

/* A job as the client would send it, in msgpack. The test set is a slice of t10k so that
 * evaluation stays quick. */
/* Extra keys of a test job: devices, and an injected fault. */
typedef struct job_extra {
    int devices;              /* 0: leave the key out */
    int64_t fail_step;        /* with fail_kind */
    const char *fail_kind;    /* NULL: no debug.fail */
    int fail_devices[4];      /* device numbers, ended by -1 */
    int batch;                /* 0: 64 */
    int64_t checkpoint_every; /* 0: leave the key out */
    int hidden2;              /* a second hidden layer of this width; 0: none */
    int batch_auto;           /* batch_size "auto" (batch is then ignored) */
} job_extra;

static void write_mlp_job_ex(td_pw *w, const char *name, int layers1, int64_t max_steps,
                             int with_test, const job_extra *x)
{
    uint32_t n = 7;
    int nfail = 0;

    if (x != NULL) {
        n += (x->devices > 0) + (x->fail_kind != NULL) + (x->checkpoint_every > 0);
        while (x->fail_kind != NULL && nfail < 4 && x->fail_devices[nfail] >= 0)
            nfail++;
    }
    td_pw_map(w, n);
    if (x != NULL && x->devices > 0) {
        td_pw_str(w, "devices");
        td_pw_int(w, x->devices);
    }
    if (x != NULL && x->checkpoint_every > 0) {
        td_pw_str(w, "checkpoint_every");
        td_pw_int(w, x->checkpoint_every);
    }
    if (x != NULL && x->fail_kind != NULL) {
        td_pw_str(w, "debug");
        td_pw_map(w, 1);
        td_pw_str(w, "fail");
        td_pw_map(w, 3);
        td_pw_str(w, "step");
        td_pw_int(w, x->fail_step);
        td_pw_str(w, "kind");
        td_pw_str(w, x->fail_kind);
        td_pw_str(w, "device");
        td_pw_array(w, (uint32_t)nfail);
        for (int i = 0; i < nfail; i++)
            td_pw_int(w, x->fail_devices[i]);
    }
    td_pw_str(w, "name");
    td_pw_str(w, name);
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, x != NULL && x->hidden2 > 0 ? 4 : 3);
    td_pw_int(w, 784);
    td_pw_int(w, layers1);
    if (x != NULL && x->hidden2 > 0)
        td_pw_int(w, x->hidden2);
    td_pw_int(w, 10);
    td_pw_str(w, "data");
    td_pw_map(w, with_test ? 3 : 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, FMNIST "/train-images-idx3-ubyte.gz");
    td_pw_str(w, "labels");
    td_pw_str(w, FMNIST "/train-labels-idx1-ubyte.gz");
    if (with_test) {
        td_pw_str(w, "test");
        td_pw_map(w, 2);
        td_pw_str(w, "images");
        td_pw_str(w, FMNIST "/t10k-images-idx3-ubyte.gz");
        td_pw_str(w, "labels");
        td_pw_str(w, FMNIST "/t10k-labels-idx1-ubyte.gz");
    }
    td_pw_str(w, "optim");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "adamw");
    td_pw_str(w, "lr");
    td_pw_double(w, 1e-3);
    td_pw_str(w, "batch_size");
    if (x != NULL && x->batch_auto)
        td_pw_str(w, "auto");
    else
        td_pw_int(w, x != NULL && x->batch > 0 ? x->batch : 64);
    td_pw_str(w, "max_steps");
    td_pw_int(w, max_steps);
    td_pw_str(w, "seed");
    td_pw_int(w, 7);
}

static int64_t submit_ex(ts_client *c, const char *name, int layers1, int64_t max_steps,
                         const job_extra *x, char *msg, size_t msgsize);

/* Submits and returns the job id, or the (negative) error code with msg filled. */
static int64_t submit(ts_client *c, const char *name, int layers1, int64_t max_steps, char *msg,
                      size_t msgsize)
{
    return submit_ex(c, name, layers1, max_steps, NULL, msg, msgsize);
}

static int64_t submit_ex(ts_client *c, const char *name, int layers1, int64_t max_steps,
                         const job_extra *x, char *msg, size_t msgsize)
{
    td_proto_frame *f;
    const td_pval *root;
    int64_t r;

    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    write_mlp_job_ex(&c->w, name, layers1, max_steps, 1, x);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    if (ts_str_is(td_pv_get(root, "type"), "submitted")) {
        r = ts_get_i(root, "job_id");
    } else {
        assert_true(ts_str_is(td_pv_get(root, "type"), "error"));
        r = ts_get_i(root, "code");
        if (msg != NULL)
            ts_get_s(root, "message", msg, msgsize);
    }
    td_proto_frame_free(f);
    return r;
}

static int count_rows(void *ud, const td_metric_row *row)
{
    (*(int64_t *)ud)++;
    return 0;
}

/* Rows of key stored in SQLite for job, read straight from the database file. */
static int64_t stored_rows(const ts_daemon *d, int64_t job, const char *key)
{
    td_store *s;
    td_metric_cursor cur;
    td_error_t err;
    const char *keys[1] = {key};
    int64_t n = 0;
    size_t got;

    assert_int_equal(td_store_open(&s, d->db, &err), 0);
    td_metric_cursor_init(&cur, 0);
    do {
        assert_int_equal(
            td_store_metrics_page(s, job, &cur, keys, 1, 1000, count_rows, &n, &got, &err), 0);
    } while (got == 1000);
    td_store_close(s);
    return n;
}

/* ---- the tests ---- */

/* A short real job trains to its end through the daemon; the watcher sees every step once,
 * in order; the rows are in SQLite; status reports the last metric values. */
static void test_job_trains_end_to_end(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    const td_pval *job, *metrics;
    td_proto_frame *f;
    int64_t id;
    double acc;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    id = submit(&c, "e2e", 128, 300, NULL, 0);
    assert_true(id >= 1);
    ts_watch_to_end(&c, id, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 300);
    assert_int_equal(w.dup_or_disorder, 0);
    assert_true(w.last_loss < w.first_loss * 0.5);
    /* 300 steps of 64 on Fashion-MNIST: PyTorch's MLP is near 0.80 here; 0.70 leaves room for
     * seed luck while still failing a model that does not learn (0.10 is chance). */
    assert_true(w.test_accuracy > 0.70);

    f = ts_status(&c, id, &job);
    assert_true(ts_str_is(td_pv_get(job, "state"), "succeeded"));
    assert_int_equal(ts_get_i(job, "step"), 300);
    assert_int_equal(ts_get_i(job, "total_steps"), 300);
    assert_int_equal(td_pv_type_of(td_pv_get(job, "error")), TD_PV_NIL);
    metrics = td_pv_get(job, "metrics");
    assert_int_equal(td_pv_double(td_pv_get(metrics, "test_accuracy"), &acc), 0);
    assert_true(fabs(acc - w.test_accuracy) < 1e-12);
    assert_non_null(td_pv_get(metrics, "train_loss"));
    assert_non_null(td_pv_get(td_pv_get(job, "spec"), "model"));
    td_proto_frame_free(f);
    ts_client_close(&c);

    assert_int_equal(stored_rows(&d, id, "train_loss"), 300);
    assert_int_equal(stored_rows(&d, id, "test_accuracy"), 1);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* An invalid job is refused naming the field; a malformed frame gets an error frame and its
 * connection closes; the daemon goes on answering others. */
static void test_bad_input_is_refused_and_daemon_goes_on(void **state)
{
    ts_daemon d;
    ts_client c, bad;
    char msg[1024];
    td_proto_frame *f;
    const td_pval *root;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);

    assert_int_equal(submit(&c, "bad", 0, 10, msg, sizeof(msg)), TD_EJOB);
    assert_string_equal(msg, "model.layers[1]: must be a positive integer");

    /* Unknown key, missing dataset: both named. */
    ts_begin(&c, "submit", 1);
    td_pw_str(&c.w, "job");
    td_pw_map(&c.w, 1);
    td_pw_str(&c.w, "modle");
    td_pw_nil(&c.w);
    ts_client_send(&c);
    f = ts_client_recv(&c);
    root = td_proto_frame_root(f);
    assert_true(ts_str_is(td_pv_get(root, "type"), "error"));
    ts_get_s(root, "message", msg, sizeof(msg));
    assert_string_equal(msg, "modle: unknown key");
    td_proto_frame_free(f);

    /* A request before hello is refused. */
    assert_int_equal(ts_client_connect(&bad, d.sock), 0);
    ts_begin(&bad, "list", 0);
    ts_client_send(&bad);
    f = ts_client_recv(&bad);
    assert_non_null(f);
    ts_get_s(td_proto_frame_root(f), "message", msg, sizeof(msg));
    assert_string_equal(msg, "the first request must be hello");
    td_proto_frame_free(f);
    assert_null(ts_client_recv(&bad));
    ts_client_close(&bad);

    /* A frame whose body is not valid msgpack (0xc1 is never used). */
    assert_int_equal(ts_client_connect(&bad, d.sock), 0);
    ts_send_raw(&bad, "\x00\x00\x00\x02\xc1\xc1", 6);
    f = ts_client_recv(&bad);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    assert_true(ts_str_is(td_pv_get(root, "type"), "error"));
    assert_int_equal(ts_get_i(root, "id"), -1);
    assert_int_equal(ts_get_i(root, "code"), TD_EPROTO);
    td_proto_frame_free(f);
    assert_null(ts_client_recv(&bad));
    ts_client_close(&bad);

    /* A length prefix far over the limit is refused before any body is read. */
    assert_int_equal(ts_client_connect(&bad, d.sock), 0);
    ts_send_raw(&bad, "\x7f\xff\xff\xff", 4);
    f = ts_client_recv(&bad);
    assert_non_null(f);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "code"), TD_E2BIG);
    td_proto_frame_free(f);
    assert_null(ts_client_recv(&bad));
    ts_client_close(&bad);

    /* A hostile array header inside a well-sized frame. */
    assert_int_equal(ts_client_connect(&bad, d.sock), 0);
    ts_send_raw(&bad, "\x00\x00\x00\x05\xdd\xff\xff\xff\xff", 9);
    f = ts_client_recv(&bad);
    assert_non_null(f);
    assert_true(ts_get_i(td_proto_frame_root(f), "code") < 0);
    td_proto_frame_free(f);
    ts_client_close(&bad);

    /* The first connection is still served, and so is a new one. */
    ts_begin(&c, "list", 0);
    ts_client_send(&c);
    f = ts_client_recv(&c);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "jobs"));
    assert_int_equal(td_pv_len(td_pv_get(td_proto_frame_root(f), "jobs")), 0);
    td_proto_frame_free(f);
    ts_client_close(&c);
    ts_connect_hello(&c, d.sock);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Cancel a running and a queued job on one device; the queued job leaves at once, the
 * running one stops at a step boundary; the next job then gets the device. */
static void test_cancel_queued_and_running(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    td_proto_frame *f;
    const td_pval *job;
    int64_t a, b, e;
    char st[16];

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    a = submit(&c, "long", 64, 1000000, NULL, 0);
    b = submit(&c, "queued", 64, 10, NULL, 0);
    ts_wait_state(&c, a, "running", 30);
    f = ts_status(&c, b, &job);
    assert_true(ts_str_is(td_pv_get(job, "state"), "queued"));
    td_proto_frame_free(f);

    ts_send_job_request(&c, "cancel", b);
    f = ts_client_recv(&c);
    ts_get_s(td_proto_frame_root(f), "state", st, sizeof(st));
    assert_string_equal(st, "cancelled");
    td_proto_frame_free(f);

    ts_send_job_request(&c, "cancel", a);
    f = ts_client_recv(&c);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "cancelled"));
    td_proto_frame_free(f);
    ts_watch_to_end(&c, a, &w);
    assert_string_equal(w.final_state, "cancelled");
    assert_int_equal(w.dup_or_disorder, 0);

    /* Cancelling an ended job is an error; the device runs the next job. */
    ts_send_job_request(&c, "cancel", a);
    f = ts_client_recv(&c);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "code"), TD_ESTATE);
    td_proto_frame_free(f);
    e = submit(&c, "after", 64, 20, NULL, 0);
    ts_watch_to_end(&c, e, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 20);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A daemon killed with SIGKILL mid-job loses nothing committed: restarted on the same state
 * directory, it requeues the job and runs it to the end; replayed steps do not duplicate. */
static void test_restart_requeues_running_job(void **state)
{
    char orphan[400];
    FILE *orphan_file;
    ts_daemon d;
    ts_client c;
    ts_watched w;
    int64_t id;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    id = submit(&c, "survivor", 64, 400, NULL, 0);
    ts_wait_state(&c, id, "running", 30);
    for (int i = 0; i < 100 && ts_job_status(&c, id, NULL, 0) < 50; i++)
        usleep(100 * 1000);
    ts_client_close(&c);
    ts_daemon_kill9(&d);
    assert_true(stored_rows(&d, id, "train_loss") > 0);
    /* An export the dead daemon was writing: the new one removes it. */
    snprintf(orphan, sizeof(orphan), "%s/export-%lld-1.bin.tmp", d.dir, (long long)id);
    orphan_file = fopen(orphan, "w");
    assert_non_null(orphan_file);
    fclose(orphan_file);

    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    assert_int_equal(access(orphan, F_OK), -1);
    ts_watch_to_end(&c, id, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 400);
    assert_int_equal(w.dup_or_disorder, 0);
    ts_client_close(&c);
    assert_int_equal(stored_rows(&d, id, "train_loss"), 400);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A job on 2 devices (each half of every batch, gradients averaged) gives the same losses as
 * on 1 device with the same global batch. The halves' mean gradients average to the whole
 * batch's, so only float summation order differs: 1e-4 relative over the first 30 steps
 * (measured differences are around 1e-6; the steps after compound them chaotically). */
static void test_two_devices_match_one(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched one, two;
    job_extra x1 = {.devices = 1, .fail_devices = {-1}};
    job_extra x2 = {.devices = 2, .fail_devices = {-1}};
    int64_t a, b;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    a = submit_ex(&c, "one", 64, 30, &x1, NULL, 0);
    ts_watch_to_end(&c, a, &one);
    b = submit_ex(&c, "two", 64, 30, &x2, NULL, 0);
    ts_watch_to_end(&c, b, &two);
    assert_string_equal(one.final_state, "succeeded");
    assert_string_equal(two.final_state, "succeeded");
    assert_int_equal(two.train_loss_rows, 30);
    for (int i = 0; i < 30; i++)
        assert_true(fabs(one.losses[i] - two.losses[i]) <= 1e-4 * fabs(one.losses[i]));
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

static void expect_failure(ts_client *c, int64_t id, const char *message, const char *stage)
{
    ts_watched w;

    ts_watch_to_end(c, id, &w);
    assert_string_equal(w.final_state, "failed");
    if (strcmp(w.error, message) != 0)
        fail_msg("%s: expected error \"%s\", got \"%s\"", stage, message, w.error);
}

/* Injected failures on one and on two of three devices give exactly DESIGN.md's messages;
 * the devices then run the next job. */
static void test_injected_failures_name_each_device(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    job_extra one = {
        .devices = 3, .fail_step = 5, .fail_kind = "panic", .fail_devices = {1, -1}, .batch = 96};
    job_extra two = {
        .devices = 3, .fail_step = 3, .fail_kind = "oom", .fail_devices = {0, 2, -1}, .batch = 96};
    job_extra nan = {
        .devices = 3, .fail_step = 4, .fail_kind = "nan", .fail_devices = {1, -1}, .batch = 96};
    job_extra ok = {.devices = 3, .fail_devices = {-1}, .batch = 96};
    const td_pval *job, *devs;
    td_proto_frame *f;
    int64_t id;

    ts_daemon_start(&d, "cpu:3");
    ts_connect_hello(&c, d.sock);
    id = submit_ex(&c, "one-fails", 32, 50, &one, NULL, 0);
    expect_failure(&c, id, "training worker on device 1 failed: injected panic at step 5",
                   "one device");
    f = ts_status(&c, id, &job);
    devs = td_pv_get(td_pv_get(job, "error"), "devices");
    assert_int_equal(td_pv_len(devs), 1);
    assert_int_equal(ts_get_i(td_pv_at(devs, 0), "device"), 1);
    assert_int_equal(ts_get_i(td_pv_at(devs, 0), "code"), TD_EPANIC);
    td_proto_frame_free(f);

    id = submit_ex(&c, "two-fail", 32, 50, &two, NULL, 0);
    expect_failure(&c, id,
                   "2 training workers failed:\n"
                   "  training worker on device 0 failed: out of memory\n"
                   "  training worker on device 2 failed: out of memory",
                   "two devices");
    f = ts_status(&c, id, &job);
    devs = td_pv_get(td_pv_get(job, "error"), "devices");
    assert_int_equal(td_pv_len(devs), 2);
    assert_int_equal(ts_get_i(td_pv_at(devs, 1), "device"), 2);
    td_proto_frame_free(f);

    id = submit_ex(&c, "nan", 32, 50, &nan, NULL, 0);
    expect_failure(&c, id, "training worker on device 1 failed: loss is NaN at step 4", "nan");

    id = submit_ex(&c, "after", 32, 20, &ok, NULL, 0);
    ts_watch_to_end(&c, id, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 20);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Two jobs on two devices at once, one failing at step 5: the other finishes with every
 * metric stored. */
static void test_failure_spares_the_other_job(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    job_extra bad = {.devices = 1, .fail_step = 5, .fail_kind = "data", .fail_devices = {0, 1, -1}};
    int64_t good, failing;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    good = submit(&c, "good", 64, 300, NULL, 0);
    failing = submit_ex(&c, "bad", 64, 300, &bad, NULL, 0);
    expect_failure(&c, failing, "dataset error during training step: injected read error at step 5",
                   "data");
    ts_watch_to_end(&c, good, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 300);
    assert_int_equal(w.dup_or_disorder, 0);
    ts_client_close(&c);
    assert_int_equal(stored_rows(&d, good, "train_loss"), 300);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A cancelled running job leaves a checkpoint behind. */
static void test_cancel_leaves_checkpoint(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    td_proto_frame *f;
    char dir[400], cmd[500];
    int64_t id;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    id = submit(&c, "to-cancel", 64, 1000000, NULL, 0);
    ts_wait_state(&c, id, "running", 30);
    usleep(300 * 1000);
    ts_send_job_request(&c, "cancel", id);
    f = ts_client_recv(&c);
    td_proto_frame_free(f);
    ts_watch_to_end(&c, id, &w);
    assert_string_equal(w.final_state, "cancelled");
    snprintf(dir, sizeof(dir), "%s/checkpoints/%lld", d.dir, (long long)id);
    snprintf(cmd, sizeof(cmd), "ls %s | grep -q '^ckpt-'", dir);
    assert_int_equal(system(cmd), 0);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

#define STALL_STEPS   20000
#define TD_HIGH_WATER (256 << 10) /* daemon.h's TD_CONN_HIGH_WATER, bytes */
#define TD_PAGE_FRAME (64 << 10)  /* bytes: a rows frame of 512 rows, with room to spare */

/* The most bytes the daemon has queued to any one client, from info. */
static int64_t max_pending(ts_client *c)
{
    td_proto_frame *f;
    const td_pval *clients;
    int64_t most = 0;

    ts_begin(c, "info", 0);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    clients = td_pv_get(td_proto_frame_root(f), "clients");
    assert_true(td_pv_len(clients) >= 1);
    for (size_t i = 0; i < td_pv_len(clients); i++) {
        int64_t p = ts_get_i(td_pv_at(clients, i), "pending_bytes");
        most = p > most ? p : most;
    }
    td_proto_frame_free(f);
    return most;
}

/* A watcher that reads nothing does not stall the job or the other watchers, and what the
 * daemon holds for it stays bounded (the bytes queued to it, from info: the process's RSS
 * would mostly measure SQLite's page cache growing with the database); watchers that connect
 * mid-job get every row once, in order; a stalled watcher that finally reads catches up from the
 * store. */
static void test_stalled_and_late_watchers(void **state)
{
    ts_daemon d;
    ts_client run, stalled, early, late;
    ts_watched we, wl, ws;
    job_extra x = {.batch = 16, .fail_devices = {-1}};
    int64_t id;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&run, d.sock);
    ts_connect_hello(&stalled, d.sock);
    ts_connect_hello(&early, d.sock);
    /* Small batches: many steps, so many rows (4 per step: 20000 steps, 80000+ rows and
     * about 4 MB of frames, 16 times the daemon's per-client high-water mark). */
    id = submit_ex(&run, "chatty", 16, STALL_STEPS, &x, NULL, 0);
    ts_send_job_request(&stalled, "watch", id); /* and never read until the job has ended */

    ts_wait_state(&run, id, "running", 30);
    for (int i = 0; i < 300 && ts_job_status(&run, id, NULL, 0) < 500; i++)
        usleep(20 * 1000);
    assert_true(max_pending(&run) <= TD_HIGH_WATER + TD_PAGE_FRAME);
    ts_connect_hello(&late, d.sock);
    ts_watch_to_end(&late, id, &wl);
    ts_watch_to_end(&early, id, &we);
    /* The stalled client was sent no more than the high-water mark and one page, although
     * the job produced 16 times that. */
    assert_true(max_pending(&run) > 0);
    assert_true(max_pending(&run) <= TD_HIGH_WATER + TD_PAGE_FRAME);
    assert_string_equal(wl.final_state, "succeeded");
    assert_int_equal(wl.train_loss_rows, STALL_STEPS);
    assert_int_equal(wl.dup_or_disorder, 0);
    assert_int_equal(we.train_loss_rows, STALL_STEPS);
    assert_int_equal(we.rows, wl.rows);
    assert_int_equal(we.dup_or_disorder, 0);
    /* Reading at last, the stalled watcher gets every row once, caught up from the store. */
    ws.rows = 0;
    {
        td_proto_frame *f;
        int64_t steps = 0, last = 0, disorder = 0, rows = 0;
        while ((f = ts_client_recv(&stalled)) != NULL) {
            const td_pval *root = td_proto_frame_root(f);
            if (ts_str_is(td_pv_get(root, "type"), "rows")) {
                const td_pval *r = td_pv_get(root, "rows");
                for (size_t i = 0; i < td_pv_len(r); i++) {
                    int64_t step;
                    assert_int_equal(td_pv_int(td_pv_at(td_pv_at(r, i), 1), &step), 0);
                    disorder += step < last;
                    last = step;
                    rows++;
                    steps += ts_str_is(td_pv_at(td_pv_at(r, i), 0), "train_loss");
                }
            }
            if (ts_str_is(td_pv_get(root, "type"), "end")) {
                td_proto_frame_free(f);
                break;
            }
            td_proto_frame_free(f);
        }
        assert_int_equal(steps, STALL_STEPS);
        assert_int_equal(rows, wl.rows);
        assert_int_equal(disorder, 0);
    }
    (void)ws;
    ts_client_close(&stalled);
    ts_client_close(&early);
    ts_client_close(&late);
    ts_client_close(&run);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- language models ---- */

/* A small English corpus in dir/corpus.txt: a few sentences recombined, about 40 KB. */
static void write_corpus(const char *dir, char *path, size_t size)
{
    static const char *const words[] = {
        "the daemon ",  "trains a ",      "small model ", "on every ", "device ",    "and writes ",
        "its metrics ", "to the store. ", "a watcher ",   "follows ",  "each step ", "live. "};
    FILE *f;
    uint64_t x = 42;

    snprintf(path, size, "%s/corpus.txt", dir);
    f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 5000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        fputs(words[(x >> 33) % 12], f);
    }
    fclose(f);
}

/* A tiny GPT on the corpus: 2 layers, 2 heads, C 32, T 32, byte vocabulary. */
static void write_gpt_job(td_pw *w, const char *name, const char *corpus, int64_t max_steps,
                          int64_t checkpoint_every)
{
    td_pw_map(w, 9);
    td_pw_str(w, "name");
    td_pw_str(w, name);
    td_pw_str(w, "model");
    td_pw_map(w, 6);
    td_pw_str(w, "kind");
    td_pw_str(w, "gpt");
    td_pw_str(w, "n_layer");
    td_pw_int(w, 2);
    td_pw_str(w, "n_head");
    td_pw_int(w, 2);
    td_pw_str(w, "n_embd");
    td_pw_int(w, 32);
    td_pw_str(w, "seq_len");
    td_pw_int(w, 32);
    td_pw_str(w, "vocab_size");
    td_pw_int(w, 256);
    td_pw_str(w, "data");
    td_pw_map(w, 4);
    td_pw_str(w, "kind");
    td_pw_str(w, "text");
    td_pw_str(w, "train");
    td_pw_str(w, corpus);
    td_pw_str(w, "valid_fraction");
    td_pw_double(w, 0.1);
    td_pw_str(w, "shuffle");
    td_pw_bool(w, 1);
    td_pw_str(w, "optim");
    td_pw_map(w, 3);
    td_pw_str(w, "kind");
    td_pw_str(w, "adamw");
    td_pw_str(w, "lr");
    td_pw_double(w, 3e-3);
    td_pw_str(w, "grad_clip");
    td_pw_double(w, 1.0);
    td_pw_str(w, "batch_size");
    td_pw_int(w, 8);
    td_pw_str(w, "max_steps");
    td_pw_int(w, max_steps);
    td_pw_str(w, "eval_every");
    td_pw_int(w, 50);
    td_pw_str(w, "checkpoint_every");
    td_pw_int(w, checkpoint_every);
    td_pw_str(w, "seed");
    td_pw_int(w, 3);
}

static int64_t submit_gpt(ts_client *c, const char *name, const char *corpus, int64_t max_steps,
                          int64_t checkpoint_every)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    write_gpt_job(&c->w, name, corpus, max_steps, checkpoint_every);
    ts_client_send(c);
    return ts_submitted(c);
}

typedef struct values {
    double v[1024];
    int64_t steps[1024];
    size_t n;
} values;

static int collect_value(void *ud, const td_metric_row *row)
{
    values *vs = ud;
    if (vs->n < 1024) {
        vs->steps[vs->n] = row->step;
        vs->v[vs->n++] = row->value;
    }
    return 0;
}

/* Every stored value of key for job, in step order, read straight from SQLite. */
static void stored_values(const ts_daemon *d, int64_t job, const char *key, values *out)
{
    td_store *s;
    td_metric_cursor cur;
    td_error_t err;
    const char *keys[1] = {key};
    size_t got;

    out->n = 0;
    assert_int_equal(td_store_open(&s, d->db, &err), 0);
    td_metric_cursor_init(&cur, 0);
    assert_int_equal(
        td_store_metrics_page(s, job, &cur, keys, 1, 1024, collect_value, out, &got, &err), 0);
    td_store_close(s);
}

/* A small GPT trains on text through the daemon until its valid loss is well below where it
 * started (ln 256 = 5.5 for an untrained byte model). */
static void test_gpt_learns_text(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    values vl;
    char corpus[400];
    int64_t id;

    ts_daemon_start(&d, "cpu:1");
    write_corpus(d.dir, corpus, sizeof(corpus));
    ts_connect_hello(&c, d.sock);
    id = submit_gpt(&c, "tiny-gpt", corpus, 300, 0);
    ts_watch_to_end(&c, id, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 300);
    stored_values(&d, id, "valid_loss", &vl);
    assert_true(vl.n >= 6); /* every 50 steps and the last */
    assert_int_equal(vl.steps[vl.n - 1], 300);
    /* The corpus is 12 phrases in random order: a model that learned them is far below the
     * first evaluation's loss. Half of it is a bar any learning model clears here, and an
     * untrained or broken one does not. */
    assert_true(vl.v[vl.n - 1] < 0.5 * vl.v[0]);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A GPT job killed with SIGKILL after a checkpoint and resumed by a restarted daemon records
 * the same losses, bit for bit, as the same job run straight through. */
static void test_gpt_resume_is_exact(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    values straight, resumed;
    char corpus[400];
    int64_t a, b;

    ts_daemon_start(&d, "cpu:1");
    write_corpus(d.dir, corpus, sizeof(corpus));
    ts_connect_hello(&c, d.sock);
    a = submit_gpt(&c, "straight", corpus, 80, 20);
    ts_watch_to_end(&c, a, &w);
    assert_string_equal(w.final_state, "succeeded");
    b = submit_gpt(&c, "killed", corpus, 80, 20);
    ts_wait_state(&c, b, "running", 30);
    for (int i = 0; i < 600 && ts_job_status(&c, b, NULL, 0) < 45; i++)
        usleep(50 * 1000);
    ts_client_close(&c);
    ts_daemon_kill9(&d);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    {
        /* Killed mid-run: the restarted daemon has it queued or running again. */
        const td_pval *job;
        td_proto_frame *f = ts_status(&c, b, &job);
        assert_false(ts_str_is(td_pv_get(job, "state"), "succeeded"));
        td_proto_frame_free(f);
    }
    ts_watch_to_end(&c, b, &w);
    assert_string_equal(w.final_state, "succeeded");
    stored_values(&d, a, "train_loss", &straight);
    stored_values(&d, b, "train_loss", &resumed);
    assert_int_equal(straight.n, 80);
    assert_int_equal(resumed.n, 80);
    for (size_t i = 0; i < 80; i++)
        if (memcmp(&straight.v[i], &resumed.v[i], sizeof(double)) != 0)
            fail_msg("step %lld: %.9g straight, %.9g resumed", (long long)straight.steps[i],
                     straight.v[i], resumed.v[i]);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A sticky CUDA error (injected on the CPU: debug.fail kind "sticky" fails the step with
 * TD_ECUDA as a real illegal address would) fails its job with the message naming its
 * device; the daemon then checkpoints and requeues the other running job, re-executes itself
 * (the same pid, listening again on the same socket), and the new process resumes that job
 * to its end with every metric row once. */
/* The memory guard at dispatch refuses a job that cannot fit its device with the numbers
 * (an MLP with two hidden layers of 2^20: over 4 TB of parameters alone), and the scheduler
 * goes on with the next job. */
static void test_memory_guard_refuses_at_dispatch(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    job_extra huge = {.devices = 1, .fail_devices = {-1}, .hidden2 = 1 << 20};
    int64_t big, small;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    big = submit_ex(&c, "huge", 1 << 20, 10, &huge, NULL, 0);
    assert_true(big >= 1);
    small = submit(&c, "small", 32, 20, NULL, 0);
    ts_watch_to_end(&c, big, &w);
    assert_string_equal(w.final_state, "failed");
    if (strstr(w.error, "does not fit on cpu:0: needs ") == NULL)
        fail_msg("expected the memory guard's refusal, got \"%s\"", w.error);
    ts_watch_to_end(&c, small, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 20);
    ts_client_close(&c);
    assert_int_equal(ts_log_count(&d, "refused at dispatch: does not fit on cpu:0"), 1);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* The spec's batch_size as the store keeps it now. */
static int64_t stored_batch(ts_client *c, int64_t id)
{
    const td_pval *job;
    td_proto_frame *f = ts_status(c, id, &job);
    int64_t b = ts_get_i(td_pv_get(job, "spec"), "batch_size");

    td_proto_frame_free(f);
    return b;
}

/* batch_size "auto" on cpu:2: the guard takes the largest batch that fits, at most 1024 rows
 * per device (a small mlp fits far more), writes it into the stored job and its log, and a
 * daemon killed mid-job resumes the job with that batch (a different one would not match the
 * checkpoint's configuration, and the job would fail). */
static void test_auto_batch_is_kept_across_restart(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    job_extra x = {.devices = 2, .fail_devices = {-1}, .batch_auto = 1, .checkpoint_every = 20};
    int64_t id;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    id = submit_ex(&c, "auto", 32, 120, &x, NULL, 0);
    assert_true(id >= 1);
    ts_wait_state(&c, id, "running", 30);
    assert_int_equal(stored_batch(&c, id), 2048);
    assert_int_equal(ts_log_count(&d, "batch_size auto: 2048 (needs "), 1);
    for (int i = 0; i < 300 && ts_job_status(&c, id, NULL, 0) < 30; i++)
        usleep(50 * 1000);
    ts_client_close(&c);
    ts_daemon_kill9(&d);

    ts_daemon_start_in(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    ts_watch_to_end(&c, id, &w);
    if (strcmp(w.final_state, "succeeded") != 0)
        fail_msg("the resumed auto job ended %s: %s", w.final_state, w.error);
    assert_int_equal(w.train_loss_rows, 120);
    assert_int_equal(w.dup_or_disorder, 0);
    assert_int_equal(stored_batch(&c, id), 2048);
    ts_client_close(&c);
    /* the log (both processes append to it): the batch was chosen once, not again on resume */
    assert_int_equal(ts_log_count(&d, "batch_size auto: "), 1);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

#define SURVIVOR_STEPS 6000
static void test_sticky_error_reexecs_and_resumes(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    job_extra survivor = {.devices = 1, .fail_devices = {-1}, .checkpoint_every = 50};
    job_extra sticky = {
        .devices = 1, .fail_step = 3, .fail_kind = "sticky", .fail_devices = {1, -1}};
    const td_pval *job;
    td_proto_frame *f;
    int64_t b, a;
    int status;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    /* Long enough to outlast the sticky job's dataset load and first steps by far. */
    b = submit_ex(&c, "survivor", 256, SURVIVOR_STEPS, &survivor, NULL, 0);
    ts_wait_state(&c, b, "running", 30);
    for (int i = 0; i < 300 && ts_job_status(&c, b, NULL, 0) < 20; i++)
        usleep(50 * 1000);
    /* The survivor runs on cpu:0, so the sticky job gets cpu:1, the device its fault names. */
    a = submit_ex(&c, "sticky", 64, 50, &sticky, NULL, 0);
    expect_failure(&c, a,
                   "training worker on device 1 failed: injected sticky CUDA error at step 3: "
                   "cudaErrorIllegalAddress: an illegal memory access was encountered",
                   "sticky");
    ts_client_close(&c);

    /* The same process, started again: a second "listening on" line in its log. */
    ts_wait_log(&d, "re-executing traind", 1, 60);
    ts_wait_log(&d, "listening on", 2, 60);
    assert_int_equal(waitpid(d.pid, &status, WNOHANG), 0);
    ts_connect_hello(&c, d.sock);
    f = ts_status(&c, a, &job);
    assert_true(ts_str_is(td_pv_get(job, "state"), "failed"));
    td_proto_frame_free(f);
    ts_watch_to_end(&c, b, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, SURVIVOR_STEPS);
    assert_int_equal(w.dup_or_disorder, 0);
    ts_client_close(&c);
    assert_int_equal(stored_rows(&d, b, "train_loss"), SURVIVOR_STEPS);
    /* It was interrupted by the re-exec, and resumed. */
    assert_int_equal(ts_log_count(&d, "job 1 (survivor): interrupted at step"), 1);
    assert_int_equal(ts_log_count(&d, "job 1 (survivor, uid 0): running on"), 2);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_job_trains_end_to_end, ts_kill_leftover),
        cmocka_unit_test_teardown(test_bad_input_is_refused_and_daemon_goes_on, ts_kill_leftover),
        cmocka_unit_test_teardown(test_cancel_queued_and_running, ts_kill_leftover),
        cmocka_unit_test_teardown(test_restart_requeues_running_job, ts_kill_leftover),
        cmocka_unit_test_teardown(test_two_devices_match_one, ts_kill_leftover),
        cmocka_unit_test_teardown(test_injected_failures_name_each_device, ts_kill_leftover),
        cmocka_unit_test_teardown(test_failure_spares_the_other_job, ts_kill_leftover),
        cmocka_unit_test_teardown(test_cancel_leaves_checkpoint, ts_kill_leftover),
        cmocka_unit_test_teardown(test_stalled_and_late_watchers, ts_kill_leftover),
        cmocka_unit_test_teardown(test_gpt_learns_text, ts_kill_leftover),
        cmocka_unit_test_teardown(test_gpt_resume_is_exact, ts_kill_leftover),
        cmocka_unit_test_teardown(test_sticky_error_reexecs_and_resumes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_memory_guard_refuses_at_dispatch, ts_kill_leftover),
        cmocka_unit_test_teardown(test_auto_batch_is_kept_across_restart, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_sticky* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests_name("integration", tests, NULL, NULL);
}
