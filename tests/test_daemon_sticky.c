/* Integration test of a sticky CUDA error in traind (injected on the CPU): its job fails, the
 * daemon re-executes itself and resumes the other job. A program of its own, the longest of
 * the test_daemon_* under ThreadSanitizer. The other job never ends by itself (it would have to
 * outlast the sticky job's dataset load and the re-exec however slow the build, thousands of
 * steps, 10 minutes under TSan): once it has trained past its interruption in the new process,
 * the test cancels it and checks its rows up to there.
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

#define SURVIVOR_STEPS 1000000 /* more than it ever runs: it is cancelled */
#define PAST_INTERRUPT 20      /* steps it trains in the new process past where it stopped */

/* The step at which the daemon's log says job 1 was interrupted; fails the test when it does
 * not say. */
static int64_t interrupted_step(const ts_daemon *d)
{
    static const char needle[] = "job 1 (survivor): interrupted at step ";
    char path[320], *buf = NULL;
    size_t cap = 0;
    const char *p = NULL;
    long long step = -1;
    FILE *f;

    snprintf(path, sizeof(path), "%s/traind.log", d->dir);
    f = fopen(path, "r");
    assert_non_null(f);
    if (getdelim(&buf, &cap, '\0', f) > 0)
        p = strstr(buf, needle);
    if (p != NULL)
        step = strtoll(p + strlen(needle), NULL, 10);
    free(buf);
    fclose(f);
    if (step < 1)
        fail_msg("no \"%s<step>\" in %s", needle, path);
    return step;
}

/* A sticky CUDA error (injected on the CPU: debug.fail kind "sticky" fails the step with
 * TD_ECUDA as a real illegal address would) fails its job with the message naming its
 * device; the daemon then checkpoints and requeues the other running job, re-executes itself
 * (the same pid, listening again on the same socket), and the new process resumes that job
 * past the step it stopped at, with every metric row once and in order. */
static void test_sticky_error_reexecs_and_resumes(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w;
    tj_extra survivor = {.devices = 1, .fail_devices = {-1}, .checkpoint_every = 50};
    tj_extra sticky = {
        .devices = 1, .fail_step = 3, .fail_kind = "sticky", .fail_devices = {1, -1}};
    const td_pval *job;
    td_proto_frame *f;
    int64_t b, a, stopped;
    int status;

    ts_daemon_start(&d, "cpu:2");
    ts_connect_hello(&c, d.sock);
    b = tj_submit_ex(&c, "survivor", 256, SURVIVOR_STEPS, &survivor, NULL, 0);
    ts_wait_state(&c, b, "running", 30);
    for (int i = 0; i < 300 && ts_job_status(&c, b, NULL, 0) < 20; i++)
        usleep(50 * 1000);
    /* The survivor runs on cpu:0, so the sticky job gets cpu:1, the device its fault names. */
    a = tj_submit_ex(&c, "sticky", 64, 50, &sticky, NULL, 0);
    tj_expect_failure(&c, a,
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

    /* It was interrupted by the re-exec, and resumed: it trains on past where it stopped. */
    assert_int_equal(ts_log_count(&d, "job 1 (survivor): interrupted at step"), 1);
    stopped = interrupted_step(&d);
    /* Bounds, not timings: a sanitizer build loads the data again slowly on a busy box. */
    ts_wait_log(&d, "job 1 (survivor, uid 0): running on", 2, 300);
    for (int i = 0; i < 6000 && ts_job_status(&c, b, NULL, 0) < stopped + PAST_INTERRUPT; i++)
        usleep(50 * 1000);
    assert_true(ts_job_status(&c, b, NULL, 0) >= stopped + PAST_INTERRUPT);
    ts_send_job_request(&c, "cancel", b);
    f = ts_client_recv(&c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "cancelled"));
    td_proto_frame_free(f);

    /* Every step once, in order, across the re-exec: in the watch and in the database. */
    ts_watch_to_end(&c, b, &w);
    assert_string_equal(w.final_state, "cancelled");
    assert_true(w.train_loss_rows >= stopped + PAST_INTERRUPT);
    assert_int_equal(w.dup_or_disorder, 0);
    ts_client_close(&c);
    assert_int_equal(tj_stored_rows(&d, b, "train_loss"), w.train_loss_rows);
    assert_int_equal(ts_log_count(&d, "job 1 (survivor, uid 0): running on"), 2);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sticky_error_reexecs_and_resumes, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_x* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests_name("integration", tests, NULL, NULL);
}
