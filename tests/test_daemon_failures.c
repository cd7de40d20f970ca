/* Integration tests of failing jobs in traind: injected failures name each failed device, one
 * job's failure spares the other, the memory guard refuses a job too large at dispatch, and an
 * "auto" batch is kept across a restart.
 * Like every test_daemon_* program, each test starts a real traind (TRAIND_BIN) on a
 * temporary socket and state directory and talks to it over the wire protocol, as any client
 * would (tests/support.c; the MLP jobs come from tests/jobs_support.c), and checks what a user
 * sees: states, errors, every metric row once and in order, the rows in SQLite. The suite was
 * one program, test_daemon.c, until it ran for minutes under ThreadSanitizer; each program now
 * holds one theme. */
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

#include "proto/proto.h"
#include "tests/support.h"
#include "tests/jobs_support.h"

/* Injected failures on one and on two of three devices give exactly DESIGN.md's messages;
 * the devices then run the next job. */
static void test_injected_failures_name_each_device(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    tj_extra one = {
        .devices = 3, .fail_step = 5, .fail_kind = "panic", .fail_devices = {1, -1}, .batch = 96};
    tj_extra two = {
        .devices = 3, .fail_step = 3, .fail_kind = "oom", .fail_devices = {0, 2, -1}, .batch = 96};
    tj_extra nan = {
        .devices = 3, .fail_step = 4, .fail_kind = "nan", .fail_devices = {1, -1}, .batch = 96};
    tj_extra ok = {.devices = 3, .fail_devices = {-1}, .batch = 96};
    const td_pval *job, *devs;
    td_proto_frame *f;
    int64_t id;

    ts_daemon_start(&d, "cpu:3");
    ts_connect_hello(&c, d.sock);
    id = tj_submit_ex(&c, "one-fails", 32, 50, &one, NULL, 0);
    tj_expect_failure(&c, id, "training worker on device 1 failed: injected panic at step 5",
                      "one device");
    f = ts_status(&c, id, &job);
    devs = td_pv_get(td_pv_get(job, "error"), "devices");
    assert_int_equal(td_pv_len(devs), 1);
    assert_int_equal(ts_get_i(td_pv_at(devs, 0), "device"), 1);
    assert_int_equal(ts_get_i(td_pv_at(devs, 0), "code"), TD_EPANIC);
    td_proto_frame_free(f);

    id = tj_submit_ex(&c, "two-fail", 32, 50, &two, NULL, 0);
    tj_expect_failure(&c, id,
                      "2 training workers failed:\n"
                      "  training worker on device 0 failed: out of memory\n"
                      "  training worker on device 2 failed: out of memory",
                      "two devices");
    f = ts_status(&c, id, &job);
    devs = td_pv_get(td_pv_get(job, "error"), "devices");
    assert_int_equal(td_pv_len(devs), 2);
    assert_int_equal(ts_get_i(td_pv_at(devs, 1), "device"), 2);
    td_proto_frame_free(f);

    id = tj_submit_ex(&c, "nan", 32, 50, &nan, NULL, 0);
    tj_expect_failure(&c, id, "training worker on device 1 failed: loss is NaN at step 4", "nan");

    id = tj_submit_ex(&c, "after", 32, 20, &ok, NULL, 0);
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
    tj_extra bad = {.devices = 1, .fail_step = 5, .fail_kind = "data", .fail_devices = {0, 1, -1}};
    int64_t good, failing;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    good = tj_submit(&c, "good", 64, 300, NULL, 0);
    failing = tj_submit_ex(&c, "bad", 64, 300, &bad, NULL, 0);
    tj_expect_failure(&c, failing,
                      "dataset error during training step: injected read error at step 5", "data");
    ts_watch_to_end(&c, good, &w);
    assert_string_equal(w.final_state, "succeeded");
    assert_int_equal(w.train_loss_rows, 300);
    assert_int_equal(w.dup_or_disorder, 0);
    ts_client_close(&c);
    assert_int_equal(tj_stored_rows(&d, good, "train_loss"), 300);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* The memory guard at dispatch refuses a job that cannot fit its device with the numbers
 * (an MLP with two hidden layers of 2^20: over 4 TB of parameters alone), and the scheduler
 * goes on with the next job. */
static void test_memory_guard_refuses_at_dispatch(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    tj_extra huge = {.devices = 1, .fail_devices = {-1}, .hidden2 = 1 << 20};
    int64_t big, small;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    big = tj_submit_ex(&c, "huge", 1 << 20, 10, &huge, NULL, 0);
    assert_true(big >= 1);
    small = tj_submit(&c, "small", 32, 20, NULL, 0);
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
 * checkpoint's configuration, and the job would fail). The job has more steps than it ever
 * runs, so it is mid-run at the kill whatever the box's speed; once it has trained on past
 * where it was killed, it is cancelled. */
static void test_auto_batch_is_kept_across_restart(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    tj_extra x = {.devices = 2, .fail_devices = {-1}, .batch_auto = 1, .checkpoint_every = 20};
    char st[32];
    int64_t id, killed_at;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    id = tj_submit_ex(&c, "auto", 32, 1000000, &x, NULL, 0);
    assert_true(id >= 1);
    ts_wait_state(&c, id, "running", 30);
    assert_int_equal(stored_batch(&c, id), 2048);
    assert_int_equal(ts_log_count(&d, "batch_size auto: 2048 (needs "), 1);
    ts_wait_step(&c, id, 30, 60); /* past its first checkpoint, at step 20 */
    ts_client_close(&c);
    ts_daemon_kill9(&d);
    killed_at = tj_stored_rows(&d, id, "train_loss");
    assert_true(killed_at > 20);

    ts_daemon_start_in(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    /* It was running at the kill, so the new daemon requeued it and resumed it. */
    assert_int_equal(ts_log_count(&d, "1 job(s) were running when the daemon stopped: requeued"),
                     1);
    ts_wait_step(&c, id, killed_at + 20, 120);
    ts_job_status(&c, id, st, sizeof(st));
    assert_string_equal(st, "running");
    ts_send_job_request(&c, "cancel", id);
    td_proto_frame_free(ts_client_recv(&c));
    ts_watch_to_end(&c, id, &w);
    if (strcmp(w.final_state, "cancelled") != 0)
        fail_msg("the resumed auto job ended %s: %s", w.final_state, w.error);
    assert_true(w.train_loss_rows > killed_at + 20);
    assert_int_equal(w.dup_or_disorder, 0);
    assert_int_equal(stored_batch(&c, id), 2048);
    ts_client_close(&c);
    assert_int_equal(tj_stored_rows(&d, id, "train_loss"), w.train_loss_rows);
    /* the log (both processes append to it): the batch was chosen once, not again on resume */
    assert_int_equal(ts_log_count(&d, "batch_size auto: "), 1);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_injected_failures_name_each_device, ts_kill_leftover),
        cmocka_unit_test_teardown(test_failure_spares_the_other_job, ts_kill_leftover),
        cmocka_unit_test_teardown(test_memory_guard_refuses_at_dispatch, ts_kill_leftover),
        cmocka_unit_test_teardown(test_auto_batch_is_kept_across_restart, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_x* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests_name("integration", tests, NULL, NULL);
}
