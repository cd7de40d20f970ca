/* Work requests (export, sample, classify, retrieve) against a real traind (issue 21, item 1):
 *   - a long sample whose client hangs up stops within a second, and says so in the log;
 *   - five long samples fill the model requests' lane (and queue one), and an export of the
 *     same job still comes back at once, in the exports' own lane;
 *   - max_work_per_user: a fifth request of one (non-root) uid is refused with its message;
 *   - work_timeout_s: a sample past it is stopped, and its client is told why.
 * The long work is a 4096-token sample of a GPT of 6 layers of 384 channels: a minute or more
 * of work here, of which each test takes only seconds. */
#include <grp.h>
#include <pwd.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "proto/proto.h"
#include "tests/support.h"

#define LANE_MODEL  4 /* the model requests' lane on the default pool of 8 (work.h) */
#define LONG_TOKENS 4096
#define DEADLINE_S  120

static char corpus_dir[64], corpus[128];

/* A text file every user may read, in a directory every user may enter. */
static void make_corpus(void)
{
    FILE *f;

    snprintf(corpus_dir, sizeof(corpus_dir), "/tmp/traind-lanes.XXXXXX");
    assert_non_null(mkdtemp(corpus_dir));
    assert_int_equal(chmod(corpus_dir, 0755), 0);
    snprintf(corpus, sizeof(corpus), "%s/text.txt", corpus_dir);
    f = fopen(corpus, "w");
    assert_non_null(f);
    for (int i = 0; i < 400; i++)
        fputs("the quick brown fox jumps over the lazy dog. ", f);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(chmod(corpus, 0644), 0);
}

/* Submits a GPT of 6 layers of 384 channels on the corpus for one step (a checkpoint to sample
 * from); returns its id once it has succeeded. */
static int64_t trained_gpt(ts_client *c)
{
    int64_t id;

    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, 5);
    td_pw_str(&c->w, "model");
    td_pw_map(&c->w, 6);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "gpt");
    td_pw_str(&c->w, "n_layer");
    td_pw_int(&c->w, 6);
    td_pw_str(&c->w, "n_head");
    td_pw_int(&c->w, 6);
    td_pw_str(&c->w, "n_embd");
    td_pw_int(&c->w, 384);
    td_pw_str(&c->w, "seq_len");
    td_pw_int(&c->w, 256);
    td_pw_str(&c->w, "vocab_size");
    td_pw_int(&c->w, 256);
    td_pw_str(&c->w, "data");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "text");
    td_pw_str(&c->w, "train");
    td_pw_str(&c->w, corpus);
    td_pw_str(&c->w, "batch_size");
    td_pw_int(&c->w, 2);
    td_pw_str(&c->w, "max_steps");
    td_pw_int(&c->w, 1);
    td_pw_str(&c->w, "name");
    td_pw_str(&c->w, "lanes");
    ts_client_send(c);
    id = ts_submitted(c);
    ts_wait_state(c, id, "succeeded", DEADLINE_S);
    return id;
}

/* Sends a long sample of job on c (its reply not read). */
static void send_long_sample(ts_client *c, int64_t job)
{
    ts_begin(c, "sample", 3);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "tokens");
    td_pw_int(&c->w, LONG_TOKENS);
    td_pw_str(&c->w, "temperature");
    td_pw_double(&c->w, 1.0);
    ts_client_send(c);
}

/* The error of the next frame on c: its code, its message into msg. */
static int64_t next_error(ts_client *c, char *msg, size_t size)
{
    td_proto_frame *f = ts_client_recv(c);
    int64_t code;

    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "error"));
    code = ts_get_i(td_proto_frame_root(f), "code");
    ts_get_s(td_proto_frame_root(f), "message", msg, size);
    td_proto_frame_free(f);
    return code;
}

/* A sample whose client hangs up stops within a second (it used to run its 4096 tokens to the
 * end, a pool thread taken all along). */
static void test_gone_client_stops_its_work(void **state)
{
    ts_daemon d;
    ts_client c, s;
    int64_t job;
    long long t0, ms;

    (void)state;
    make_corpus();
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    job = trained_gpt(&c);
    ts_connect_hello(&s, d.sock);
    send_long_sample(&s, job);
    ts_wait_log(&d, "sample of job", 1, DEADLINE_S);
    usleep(300 * 1000); /* well into its tokens: the hang-up comes mid-sample */
    t0 = ts_now_ms();
    ts_client_close(&s);
    ts_wait_log(&d, "sample stopped: its client is gone", 1, 30);
    ms = ts_now_ms() - t0;
    /* it stopped, and said why (one that ran to its end says nothing of the sort); how soon is
     * printed */
    print_message("a sample whose client hung up stopped %lld ms later\n", ms);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* Five long samples (root's: no cap) fill the model lane and queue the fifth; an export still
 * comes back at once, in its own lane. On libuv's 4 threads, as before, it waited for minutes. */
static void test_export_beside_long_work(void **state)
{
    ts_daemon d;
    ts_client c, s[LANE_MODEL + 1];
    td_proto_frame *f;
    int64_t job, bytes = 0;
    long long t0, ms;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    job = trained_gpt(&c);
    for (int i = 0; i <= LANE_MODEL; i++) {
        ts_connect_hello(&s[i], d.sock);
        send_long_sample(&s[i], job);
    }
    ts_wait_log(&d, "sample of job", LANE_MODEL + 1, DEADLINE_S);
    t0 = ts_now_ms();
    ts_send_job_request(&c, "export", job);
    for (;;) {
        f = ts_client_recv(&c);
        assert_non_null(f);
        if (ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "end")) {
            bytes = ts_get_i(td_proto_frame_root(f), "bytes");
            td_proto_frame_free(f);
            break;
        }
        assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "chunk"));
        td_proto_frame_free(f);
    }
    ms = ts_now_ms() - t0;
    print_message("an export of %lld bytes beside %d long samples: %lld ms\n", (long long)bytes,
                  LANE_MODEL + 1, ms);
    assert_true(bytes > 0);
    assert_true(ms < 30000);
    for (int i = 0; i <= LANE_MODEL; i++)
        ts_client_close(&s[i]);
    ts_wait_log(&d, "sample stopped: its client is gone", LANE_MODEL + 1, 30);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A connection as uid, wrapped as a client that has said hello. */
static void client_as(ts_client *c, const char *sock, uid_t uid, gid_t gid)
{
    td_proto_frame *f;

    memset(c, 0, sizeof(*c));
    c->fd = ts_connect_as(sock, uid, gid);
    assert_true(c->fd >= 0);
    assert_int_equal(td_proto_reader_new(&c->r, 0), 0);
    td_pw_init(&c->w);
    c->next_id = 1;
    ts_begin(c, "hello", 1);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    td_proto_frame_free(f);
}

/* max_work_per_user (4 by default): a user's fifth request under way is refused, naming the
 * limit; root's are not counted. */
static void test_work_cap_per_user(void **state)
{
    struct passwd *nobody = getpwnam("nobody");
    ts_daemon d;
    ts_client c[5];
    int64_t job;
    char msg[512], want[256];

    (void)state;
    if (nobody == NULL || geteuid() != 0)
        skip();
    ts_daemon_start(&d, "cpu:1");
    ts_open_socket(&d);
    client_as(&c[0], d.sock, nobody->pw_uid, nobody->pw_gid);
    job = trained_gpt(&c[0]);
    for (int i = 1; i < 5; i++)
        client_as(&c[i], d.sock, nobody->pw_uid, nobody->pw_gid);
    for (int i = 0; i < 4; i++)
        send_long_sample(&c[i], job);
    ts_wait_log(&d, "sample of job", 4, DEADLINE_S);
    send_long_sample(&c[4], job);
    assert_int_equal(next_error(&c[4], msg, sizeof(msg)), TD_E2BIG);
    snprintf(want, sizeof(want),
             "uid %u has 4 requests under way (export, sample, classify, retrieve, probe), the "
             "limit (max_work_per_user); wait for one to finish",
             (unsigned)nobody->pw_uid);
    assert_string_equal(msg, want);
    for (int i = 0; i < 5; i++)
        ts_client_close(&c[i]);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* work_timeout_s: a sample past it stops, and its client is told why. */
static void test_work_timeout(void **state)
{
    ts_daemon d;
    ts_client c;
    int64_t job;
    char msg[512], want[128];
    long long t0, ms;

    (void)state;
    snprintf(d.dir, sizeof(d.dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d.dir));
    ts_daemon_start_conf(&d, "cpu:1", "[limits]\nwork_timeout_s = 1\n");
    ts_connect_hello(&c, d.sock);
    job = trained_gpt(&c);
    t0 = ts_now_ms();
    send_long_sample(&c, job);
    assert_int_equal(next_error(&c, msg, sizeof(msg)), TD_ECANCELLED);
    ms = ts_now_ms() - t0;
    snprintf(want, sizeof(want), "job %lld: sample stopped after 1 s, the limit (work_timeout_s)",
             (long long)job);
    if (strncmp(msg, want, strlen(want)) != 0)
        fail_msg("the timeout's message: \"%s\"", msg);
    print_message("a sample past work_timeout_s = 1 answered after %lld ms: %s\n", ms, msg);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

static int cleanup(void **state)
{
    char cmd[128];

    (void)state;
    if (corpus_dir[0] != '\0') {
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", corpus_dir);
        if (system(cmd) != 0)
            return -1;
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_gone_client_stops_its_work, ts_kill_leftover),
        cmocka_unit_test_teardown(test_export_beside_long_work, ts_kill_leftover),
        cmocka_unit_test_teardown(test_work_cap_per_user, ts_kill_leftover),
        cmocka_unit_test_teardown(test_work_timeout, ts_kill_leftover),
    };

    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests_name("integration", tests, NULL, cleanup);
}
