/* Integration tests of language models in traind: a small GPT learns a text corpus, and a GPT
 * job killed after a checkpoint resumes bit for bit.
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
#include "store/store.h"
#include "tests/support.h"

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
 * the same losses, bit for bit, as the same job run straight through. The killed one has more
 * steps than it ever runs (its learning rate is constant, so its first 80 steps are the
 * straight job's), so it is mid-run at the kill whatever the box's speed; once it has trained
 * past step 80 in the new daemon, it is cancelled. */
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
    b = submit_gpt(&c, "killed", corpus, 1000000, 20);
    ts_wait_step(&c, b, 45, 60); /* past its checkpoint at step 40 */
    ts_client_close(&c);
    ts_daemon_kill9(&d);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    assert_int_equal(ts_log_count(&d, "1 job(s) were running when the daemon stopped: requeued"),
                     1);
    ts_wait_step(&c, b, 80, 120);
    ts_send_job_request(&c, "cancel", b);
    td_proto_frame_free(ts_client_recv(&c));
    ts_watch_to_end(&c, b, &w);
    assert_string_equal(w.final_state, "cancelled");
    assert_int_equal(w.dup_or_disorder, 0);
    stored_values(&d, a, "train_loss", &straight);
    stored_values(&d, b, "train_loss", &resumed);
    assert_int_equal(straight.n, 80);
    assert_true(resumed.n > 80);
    for (size_t i = 0; i < 80; i++)
        if (resumed.steps[i] != straight.steps[i] ||
            memcmp(&straight.v[i], &resumed.v[i], sizeof(double)) != 0)
            fail_msg("step %lld: %.9g straight, %.9g resumed (step %lld)",
                     (long long)straight.steps[i], straight.v[i], resumed.v[i],
                     (long long)resumed.steps[i]);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_gpt_learns_text, ts_kill_leftover),
        cmocka_unit_test_teardown(test_gpt_resume_is_exact, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_x* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests_name("integration", tests, NULL, NULL);
}
