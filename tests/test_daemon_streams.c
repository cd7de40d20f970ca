/* Integration test of traind's metric streams: a watcher that reads nothing stalls neither the
 * job nor the other watchers, late watchers get every row once, and a stalled one catches up.
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

#define STALL_STEPS   8000
#define TD_HIGH_WATER (256 << 10) /* server/connection.h's TD_CONN_HIGH_WATER, bytes */
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
    tj_extra x = {.batch = 16, .fail_devices = {-1}};
    int64_t id;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&run, d.sock);
    ts_connect_hello(&stalled, d.sock);
    ts_connect_hello(&early, d.sock);
    /* Small batches: many steps, so many rows (4 per step: 8000 steps, 32000+ rows and
     * about 1.6 MB of frames, 6 times the daemon's per-client high-water mark and 4 times
     * what the kernel's socket buffers take in besides; 20000 steps took minutes under TSan). */
    id = tj_submit_ex(&run, "chatty", 16, STALL_STEPS, &x, NULL, 0);
    ts_send_job_request(&stalled, "watch", id); /* and never read until the job has ended */

    ts_wait_state(&run, id, "running", 30);
    for (int i = 0; i < 300 && ts_job_status(&run, id, NULL, 0) < 500; i++)
        usleep(20 * 1000);
    assert_true(max_pending(&run) <= TD_HIGH_WATER + TD_PAGE_FRAME);
    ts_connect_hello(&late, d.sock);
    ts_watch_to_end(&late, id, &wl);
    ts_watch_to_end(&early, id, &we);
    /* The stalled client was sent no more than the high-water mark and one page, although
     * the job produced 6 times that. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_stalled_and_late_watchers, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_x* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests_name("integration", tests, NULL, NULL);
}
