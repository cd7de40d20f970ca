/* train/probe.c and `trainctl probe` (issue 23: few-shot beside zero-shot).
 *
 * unit: the k-shot subsets (the first k windows of each class in order, the short classes
 * counted), accuracy and macro-F1 on a case worked by hand, a fit that is the same bits every
 * run and separates what is separable, a class without rows never predicted, the refusals and
 * the stop callback. (tests/test_probe_fit.py holds the fit against numpy's gradient.)
 *
 * integration: a real traind (TRAIND_BIN) and trainctl (TRAINCTL_BIN) on a temporary socket; a
 * tiny sensorlm trained on `trainctl sensor synth` days, then `trainctl probe` prints the rows
 * for 1, 5, 10 and all windows a class with accuracies in [0, 1], the all-shot one above chance;
 * its JSON; a --shots row past some classes' windows with those classes named; a train shard
 * without a class (never predicted); and the refusals: a gpt job, a shard without labels, label
 * tables that differ. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>
#include <jansson.h>

#include "train/probe.h"
#include "train/sensor.h"
#include "tests/support.h"

/* ---- unit ---------------------------------------------------------------------------------- */

static void test_subset(void **state)
{
    const int32_t y[] = {0, 1, 0, 2, 0, 1, 7, 0};
    int64_t idx[8];
    int shorts = -1;

    (void)state;
    /* k = 2: rows 0 and 2 of class 0, 1 and 5 of class 1, class 2's only row 3; 7 is no class */
    assert_int_equal(td_probe_subset(y, 8, 3, 2, idx, &shorts), 5);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 1);
    assert_int_equal(idx[2], 2);
    assert_int_equal(idx[3], 3);
    assert_int_equal(idx[4], 5);
    assert_int_equal(shorts, 1); /* class 2 */
    assert_int_equal(td_probe_subset(y, 8, 3, 1, idx, &shorts), 3);
    assert_int_equal(shorts, 0);
    assert_int_equal(td_probe_subset(y, 8, 3, 0, idx, &shorts), 7); /* all but the 7 */
    assert_int_equal(shorts, 0);
    assert_int_equal(td_probe_subset(y, 8, 4, 10, idx, &shorts), 7);
    assert_int_equal(shorts, 3); /* classes 0, 1, 2; class 3 has no row and is not short */
}

static void test_score(void **state)
{
    /* class 0: TP 1, FP 1, FN 1 -> F1 2/4; class 1: TP 2, FP 1, FN 1 -> 4/6; class 2: never
     * right -> 0; class 3 is predicted once but never true: not in the mean */
    const int32_t y[] = {0, 0, 1, 1, 2, 1};
    const int32_t pred[] = {0, 1, 1, 1, 0, 3};
    double acc, f1;

    (void)state;
    td_probe_score(y, pred, 6, 4, &acc, &f1);
    assert_float_equal(acc, 3.0 / 6.0, 1e-15);
    assert_float_equal(f1, (0.5 + 4.0 / 6.0 + 0.0) / 3.0, 1e-15);
    td_probe_score(y, pred, 0, 4, &acc, &f1);
    assert_true(isnan(acc) && isnan(f1));
}

/* Two clusters on each axis of the plane: class k around (cos, sin) of k * 90 degrees. */
static void four_corners(float *x, int32_t *y, int n)
{
    static const float dir[4][2] = {{1, 0}, {0, 1}, {-1, 0}, {0, -1}};

    for (int i = 0; i < n; i++) {
        float wob = 0.2f * (float)((i * 37) % 11 - 5) / 5.0f;
        y[i] = i % 4;
        x[2 * i] = dir[y[i]][0] + wob;
        x[2 * i + 1] = dir[y[i]][1] - wob;
    }
}

static void test_fit(void **state)
{
    float x[2 * 40];
    int32_t y[40], pred[40];
    double W[8], b[4], W2[8], b2[4], acc, f1;
    td_probe_stats st;
    td_error_t err = {0};

    (void)state;
    four_corners(x, y, 40);
    assert_int_equal(td_probe_fit(x, y, 40, 2, 4, 1e-3, 500, NULL, NULL, W, b, &st, &err), 0);
    assert_true(st.converged);
    assert_true(st.grad_max <= TD_PROBE_GTOL);
    assert_true(st.iterations > 0 && st.iterations < 500);
    td_probe_predict(W, b, x, 40, 2, 4, pred);
    td_probe_score(y, pred, 40, 4, &acc, &f1);
    assert_float_equal(acc, 1.0, 0);
    assert_float_equal(f1, 1.0, 0);
    /* the same rows: the same bits */
    assert_int_equal(td_probe_fit(x, y, 40, 2, 4, 1e-3, 500, NULL, NULL, W2, b2, NULL, &err), 0);
    assert_memory_equal(W, W2, sizeof(W));
    assert_memory_equal(b, b2, sizeof(b));
    /* zero iterations: the start, W = 0 and b = 0, the loss log 4 */
    assert_int_equal(td_probe_fit(x, y, 40, 2, 4, 1e-3, 0, NULL, NULL, W2, b2, &st, &err), 0);
    assert_int_equal(st.iterations, 0);
    assert_false(st.converged);
    assert_float_equal(st.loss, log(4.0), 1e-12);
    for (int k = 0; k < 4; k++)
        assert_float_equal(b2[k], 0.0, 0);
}

static void test_class_without_rows(void **state)
{
    float x[2 * 40];
    int32_t y[40], pred[40];
    double W[10], b[5];
    td_error_t err = {0};

    (void)state;
    four_corners(x, y, 40);
    for (int i = 0; i < 40; i++)
        y[i] = y[i] == 1 ? 4 : y[i]; /* class 1 has none, class 4 takes its rows */
    assert_int_equal(td_probe_fit(x, y, 40, 2, 5, 1e-3, 500, NULL, NULL, W, b, NULL, &err), 0);
    assert_true(isinf(b[1]) && b[1] < 0);
    assert_float_equal(W[2], 0.0, 0);
    assert_float_equal(W[3], 0.0, 0);
    td_probe_predict(W, b, x, 40, 2, 5, pred);
    for (int i = 0; i < 40; i++)
        assert_int_equal(pred[i], y[i]);
}

static int stop_now(void *ud)
{
    (void)ud;
    return 1;
}

static void test_refusals(void **state)
{
    float x[2 * 8];
    int32_t y[8];
    double W[8], b[4];
    td_error_t err = {0};

    (void)state;
    four_corners(x, y, 8);
    assert_int_equal(td_probe_fit(x, y, 0, 2, 4, 1e-3, 10, NULL, NULL, W, b, NULL, &err),
                     TD_EINVAL);
    assert_string_equal(err.msg, "probe: 0 rows of 2 features in 4 classes, 10 iterations");
    y[3] = 4;
    assert_int_equal(td_probe_fit(x, y, 8, 2, 4, 1e-3, 10, NULL, NULL, W, b, NULL, &err),
                     TD_EINVAL);
    assert_string_equal(err.msg, "probe: row 3: label 4, but there are 4");
    y[3] = 3;
    x[5] = NAN;
    assert_int_equal(td_probe_fit(x, y, 8, 2, 4, 1e-3, 10, NULL, NULL, W, b, NULL, &err),
                     TD_EINVAL);
    assert_string_equal(err.msg, "probe: row 2: feature 1 is not finite");
    x[5] = 0;
    assert_int_equal(td_probe_fit(x, y, 8, 2, 4, -1, 10, NULL, NULL, W, b, NULL, &err), TD_EINVAL);
    assert_int_equal(td_probe_fit(x, y, 8, 2, 4, 1e-3, 10, stop_now, NULL, W, b, NULL, &err),
                     TD_ECANCELLED);
    assert_string_equal(err.msg, "probe: stopped after 0 of 10 iterations");
}

/* ---- integration --------------------------------------------------------------------------- */

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;

    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    return buf;
}

/* trainctl --socket SOCK ARGS, its stdout and stderr in *out and *err (malloc'd, either may be
 * NULL): its exit status. */
static int trainctl(const ts_daemon *d, char **out, char **err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int trainctl(const ts_daemon *d, char **out, char **err, const char *fmt, ...)
{
    char args[2048], cmd[4096], path[320];
    va_list ap;
    int status;

    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "%s --socket %s %s >%s/tc.out 2>%s/tc.err",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), d->sock, args, d->dir, d->dir);
    status = system(cmd);
    snprintf(path, sizeof(path), "%s/tc.out", d->dir);
    if (out != NULL)
        *out = slurp(path);
    snprintf(path, sizeof(path), "%s/tc.err", d->dir);
    if (err != NULL)
        *err = slurp(path);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");

    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* The job file json, written to the daemon's directory and submitted by trainctl: its id. */
static int64_t submit(const ts_daemon *d, const char *json)
{
    char path[400], *out;
    int64_t id;

    snprintf(path, sizeof(path), "%s/job.json", d->dir);
    write_text(path, json);
    assert_int_equal(trainctl(d, &out, NULL, "submit %s", path), 0);
    id = strtoll(out, NULL, 10);
    free(out);
    assert_true(id > 0);
    return id;
}

/* A copy of the shard src at dst: every window but those of class drop (-1: none), with src's
 * label table (K < 0), none (K == 0) or names[0..K) (each window's label taken modulo K). */
static void copy_shard(const char *src, const char *dst, int drop, const char *const *names, int K)
{
    td_sensor *s;
    td_sensor_writer *w;
    td_sensor_header h;
    const char *own[TD_SENSOR_MAX_LABELS];
    td_error_t err = {0};
    float *grid;
    char caption[TD_SENSOR_MAX_CAPTION + 1];
    int64_t n = 0;

    if (td_sensor_open(&s, src, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    h = *td_sensor_header_of(s);
    for (int64_t i = 0; i < h.N; i++) {
        int32_t label;
        assert_int_equal(td_sensor_read(s, i, NULL, NULL, NULL, &label, &err), 0);
        n += label != drop;
    }
    if (K < 0) {
        for (int k = 0; k < h.n_labels; k++)
            own[k] = td_sensor_label_name(s, k);
        names = own;
        K = h.n_labels;
    }
    grid = malloc((size_t)h.T * h.C * sizeof(float));
    assert_non_null(grid);
    h.N = n;
    h.n_labels = K;
    if (td_sensor_writer_open(&w, dst, &h, K > 0 ? names : NULL, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    for (int64_t i = 0; i < td_sensor_count(s); i++) {
        int32_t label;
        size_t len;
        assert_int_equal(td_sensor_read(s, i, grid, caption, &len, &label, &err), 0);
        if (label == drop)
            continue;
        if (td_sensor_writer_add(w, grid, caption, len, K > 0 ? label % K : 0, &err) != 0)
            fail_msg("%s", err.msg);
    }
    if (td_sensor_writer_finish(w, NULL, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    td_sensor_writer_free(w);
    td_sensor_close(s);
    free(grid);
}

/* The probe's JSON rows: shots, windows, short and accuracy of each, checked for shape. */
static json_t *probe_json(const char *out)
{
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);

    if (j == NULL)
        fail_msg("probe -o json: %s: %s", je.text, out);
    assert_true(json_is_array(json_object_get(j, "results")));
    assert_true(json_is_array(json_object_get(j, "labels")));
    return j;
}

static int64_t jint(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);

    assert_true(json_is_integer(v));
    return json_integer_value(v);
}

static double jnum(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);

    assert_true(json_is_number(v));
    return json_number_value(v);
}

/* The sensorlm of test_daemon_sensorlm (the tiny preset, an hour of every channel a patch,
 * mean pooled, text_len 22) for 150 steps of 32 on dir's synthetic days. */
#define SLM_JOB                                                                                    \
    "{\"name\": \"probe\", \"model\": {\"kind\": \"sensorlm\", \"size\": \"tiny\", \"sensor\": "   \
    "{\"patch_t\": 60, \"patch_c\": 10, \"pool\": \"gap\"}, \"text\": {\"text_len\": 22}}, "       \
    "\"data\": {\"kind\": \"sensor\", \"train\": \"%s/synth-train.bin\", \"valid\": "              \
    "\"%s/synth-valid.bin\"}, \"optim\": {\"lr\": 1e-3, \"grad_clip\": 1.0}, \"batch_size\": 32, " \
    "\"max_steps\": 150, \"eval_every\": 150, \"checkpoint_every\": 150, \"seed\": 5}"

#define GPT_JOB                                                                                    \
    "{\"name\": \"gpt\", \"model\": {\"kind\": \"gpt\", \"n_layer\": 1, \"n_head\": 2, "           \
    "\"n_embd\": 16, \"seq_len\": 16, \"vocab_size\": 256}, \"data\": {\"kind\": \"text\", "       \
    "\"train\": \"%s\", \"valid_fraction\": 0.1}, \"batch_size\": 2, \"max_steps\": 1, \"seed\": " \
    "1}"

static void test_probe_verb(void **state)
{
    ts_daemon d;
    ts_client c;
    char job[2048], data[320], train[400], valid[400], eval[400], bare[400], other[400];
    char nohike[400], corpus[400], name[24], *out, *err;
    const char *names[TD_SENSOR_MAX_LABELS];
    int64_t slm, gpt, want_windows = 0;
    int K, want_short = 0;
    td_sensor *s;
    td_error_t e;
    json_t *j, *rows, *labels;

    (void)state;
    ts_daemon_start(&d, "cpu:1");
    snprintf(data, sizeof(data), "%s/data", d.dir);
    snprintf(job, sizeof(job), "%s sensor synth -o %s --days 400 --seed 3 >/dev/null",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), data);
    assert_int_equal(system(job), 0);
    /* VALID: 200 other days (the same people's generator, another seed), the train file of a
     * second synth; its label table is the same */
    snprintf(job, sizeof(job), "%s sensor synth -o %s/other --days 200 --seed 4 >/dev/null",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), data);
    assert_int_equal(system(job), 0);
    snprintf(train, sizeof(train), "%s/synth-train.bin", data);
    snprintf(valid, sizeof(valid), "%s/synth-valid.bin", data);
    snprintf(eval, sizeof(eval), "%s/other/synth-train.bin", data);

    ts_connect_hello(&c, d.sock);
    snprintf(job, sizeof(job), SLM_JOB, data, data);
    slm = submit(&d, job);
    ts_wait_state(&c, slm, "succeeded", 120);

    /* the default rows: 1, 5, 10, all */
    assert_int_equal(
        trainctl(&d, &out, NULL, "probe %lld --data %s --eval %s", (long long)slm, train, eval), 0);
    print_message("probe:\n%s", out);
    assert_non_null(strstr(out, "SHOTS  WINDOWS  SHORT  ACCURACY  MACRO_F1\n1  "));
    assert_non_null(strstr(out, "\n5  "));
    assert_non_null(strstr(out, "\n10  "));
    assert_non_null(strstr(out, "\nall  "));
    free(out);
    assert_int_equal(trainctl(&d, &out, NULL, "probe %lld --data %s --eval %s -o json",
                              (long long)slm, train, eval),
                     0);
    j = probe_json(out);
    rows = json_object_get(j, "results");
    labels = json_object_get(j, "labels");
    K = (int)json_array_size(labels);
    assert_int_equal(K, 7);
    assert_int_equal(json_array_size(rows), 4);
    assert_int_equal(jint(j, "step"), 150);
    assert_int_equal(jint(j, "embed_dim"), 64);
    assert_int_equal(jint(j, "train_windows"), 360);
    assert_int_equal(jint(j, "valid_windows"), 180);
    for (int r = 0; r < 4; r++) {
        const json_t *row = json_array_get(rows, (size_t)r);
        double acc = jnum(row, "accuracy"), f1 = jnum(row, "macro_f1");
        int64_t k = jint(row, "shots");
        assert_int_equal(k, r == 3 ? 0 : r == 0 ? 1 : r == 1 ? 5 : 10);
        assert_true(acc >= 0 && acc <= 1 && f1 >= 0 && f1 <= 1);
        assert_true(json_is_true(json_object_get(row, "converged")));
        /* every class has more than 10 train windows of the 360: k of each, or all */
        assert_int_equal(jint(row, "windows"), k > 0 ? k * K : 360);
        assert_int_equal(jint(row, "short"), 0);
        snprintf(name, sizeof(name), "%lld", (long long)k);
        print_message("%s-shot on %lld windows: accuracy %.4f, macro-F1 %.4f (%lld iterations)\n",
                      k > 0 ? name : "all", (long long)jint(row, "windows"), acc, f1,
                      (long long)jint(row, "iterations"));
    }
    /* the all-shot probe is well above chance (1/7) */
    assert_true(jnum(json_array_get(rows, 3), "accuracy") > 2.0 / K);
    json_decref(j);
    free(out);

    /* 40 a class is more than some classes have of the 360 windows: those give all they have,
     * counted and named */
    assert_int_equal(trainctl(&d, &out, NULL, "probe %lld --data %s --eval %s --shots 40 -o json",
                              (long long)slm, train, eval),
                     0);
    j = probe_json(out);
    labels = json_object_get(j, "labels");
    for (int k = 0; k < K; k++) {
        int64_t n = jint(json_array_get(labels, (size_t)k), "train");
        want_windows += n < 40 ? n : 40;
        want_short += n > 0 && n < 40;
    }
    rows = json_object_get(j, "results");
    assert_int_equal(json_array_size(rows), 1);
    assert_int_equal(jint(json_array_get(rows, 0), "windows"), want_windows);
    assert_int_equal(jint(json_array_get(rows, 0), "short"), want_short);
    assert_true(want_short > 0); /* 360 days over 7 labels: some below 40 */
    json_decref(j);
    free(out);
    assert_int_equal(trainctl(&d, &out, NULL, "probe %lld --data %s --eval %s --shots 40,all",
                              (long long)slm, train, eval),
                     0);
    print_message("probe --shots 40,all:\n%s", out);
    assert_non_null(strstr(out, "40-shot: "));
    /* "40-shot: 1 class has fewer than 40 train windows and gave all it has: strength 35" */
    assert_non_null(strstr(out, " fewer than 40 train windows and gave all "));
    free(out);

    /* a train shard without hike (label 6): hike is never predicted, and said */
    snprintf(nohike, sizeof(nohike), "%s/nohike.bin", data);
    copy_shard(train, nohike, 6, NULL, -1);
    assert_int_equal(trainctl(&d, &out, NULL, "probe %lld --data %s --eval %s --shots all",
                              (long long)slm, nohike, eval),
                     0);
    print_message("probe without hike:\n%s", out);
    assert_non_null(strstr(out, "never predicted: hike has no train windows ("));
    free(out);

    /* refusals, each naming what is wrong */
    snprintf(corpus, sizeof(corpus), "%s/corpus.txt", d.dir);
    write_text(corpus, "the cat sat on the mat and the dog sat on the log; "
                       "the cat sat on the mat and the dog sat on the log.\n");
    snprintf(job, sizeof(job), GPT_JOB, corpus);
    gpt = submit(&d, job);
    assert_int_equal(
        trainctl(&d, NULL, &err, "probe %lld --data %s --eval %s", (long long)gpt, train, eval), 1);
    assert_non_null(strstr(err, "is a gpt job; only sensorlm jobs can be probed"));
    free(err);

    snprintf(bare, sizeof(bare), "%s/bare.bin", data);
    copy_shard(valid, bare, -1, NULL, 0);
    assert_int_equal(
        trainctl(&d, NULL, &err, "probe %lld --data %s --eval %s", (long long)slm, bare, eval), 1);
    assert_non_null(strstr(err, "carries no labels; a probe is fitted on labelled windows"));
    assert_non_null(strstr(err, bare));
    free(err);
    assert_int_equal(
        trainctl(&d, NULL, &err, "probe %lld --data %s --eval %s", (long long)slm, train, bare), 1);
    assert_non_null(strstr(err, "eval: "));
    assert_non_null(strstr(err, "carries no labels; a probe is judged on labelled windows"));
    free(err);

    /* the same count of labels, one name changed; then fewer labels */
    assert_int_equal(td_sensor_open(&s, valid, NULL, &e), 0);
    for (int k = 0; k < K; k++)
        names[k] = td_sensor_label_name(s, k);
    names[2] = "jog";
    snprintf(other, sizeof(other), "%s/other-labels.bin", data);
    copy_shard(valid, other, -1, names, K);
    assert_int_equal(
        trainctl(&d, NULL, &err, "probe %lld --data %s --eval %s", (long long)slm, train, other),
        1);
    print_message("%s", err);
    assert_non_null(strstr(err, ": label 2 is \"jog\", but in data: "));
    assert_non_null(strstr(err, "both shards must have the same label table"));
    free(err);
    copy_shard(valid, other, -1, names, 3);
    assert_int_equal(
        trainctl(&d, NULL, &err, "probe %lld --data %s --eval %s", (long long)slm, train, other),
        1);
    assert_non_null(strstr(err, "has 3 labels, data: "));
    free(err);
    td_sensor_close(s);

    assert_int_equal(trainctl(&d, NULL, &err, "probe %lld --data %s", (long long)slm, train), 64);
    assert_non_null(strstr(err, "missing --eval SHARD"));
    free(err);

    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest unit[] = {
        cmocka_unit_test(test_subset),   cmocka_unit_test(test_score),
        cmocka_unit_test(test_fit),      cmocka_unit_test(test_class_without_rows),
        cmocka_unit_test(test_refusals),
    };
    const struct CMUnitTest integration[] = {
        cmocka_unit_test_teardown(test_probe_verb, ts_kill_leftover),
    };
    int failed = cmocka_run_group_tests_name("unit", unit, NULL, NULL);

    return failed + cmocka_run_group_tests_name("integration", integration, NULL, NULL);
}
