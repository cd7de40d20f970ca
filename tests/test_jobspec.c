/* Unit tests of job validation (daemon/jobspec.c) for the keys of the GPU path: precision,
 * tf32, batch_size "auto", nccl_timeout_s and debug.fail.kind "sticky", each accepted and
 * refused with the field named; and td_jobspec_set_batch, which rewrites a stored job's
 * batch_size for an "auto" job. Jobs are built as msgpack maps, the way a submit carries
 * them; their dataset is a small text file in a temporary directory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "jobspec.h"

static char dir[64];
static char text[128];

/* One extra top-level pair of a job: an integer, a number, a string or a boolean. */
typedef struct extra {
    const char *key;
    char type; /* 'i', 'd', 's', 'b', or 'F': debug: {fail: {kind: s, step: 1}} */
    int64_t i;
    double d;
    const char *s;
} extra;

/* Writes a valid gpt job on the text file with the extras, and decodes it into *f. */
static void build(td_proto_frame **f, const extra *x, size_t n)
{
    td_error_t err = {0};
    const void *body;
    size_t len;
    td_pw w;

    td_pw_init(&w);
    td_pw_map(&w, (uint32_t)(2 + n));
    td_pw_str(&w, "model");
    td_pw_map(&w, 6);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "gpt");
    td_pw_str(&w, "n_layer");
    td_pw_int(&w, 2);
    td_pw_str(&w, "n_head");
    td_pw_int(&w, 2);
    td_pw_str(&w, "n_embd");
    td_pw_int(&w, 32);
    td_pw_str(&w, "seq_len");
    td_pw_int(&w, 16);
    td_pw_str(&w, "vocab_size");
    td_pw_int(&w, 256);
    td_pw_str(&w, "data");
    td_pw_map(&w, 2);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "text");
    td_pw_str(&w, "train");
    td_pw_str(&w, text);
    for (size_t i = 0; i < n; i++) {
        td_pw_str(&w, x[i].key);
        switch (x[i].type) {
        case 'i':
            td_pw_int(&w, x[i].i);
            break;
        case 'd':
            td_pw_double(&w, x[i].d);
            break;
        case 's':
            td_pw_str(&w, x[i].s);
            break;
        case 'b':
            td_pw_bool(&w, (int)x[i].i);
            break;
        case 'F':
            td_pw_map(&w, 1);
            td_pw_str(&w, "fail");
            td_pw_map(&w, 2);
            td_pw_str(&w, "kind");
            td_pw_str(&w, x[i].s);
            td_pw_str(&w, "step");
            td_pw_int(&w, 3);
            break;
        }
    }
    body = td_pw_body(&w, &len);
    assert_non_null(body);
    assert_int_equal(td_proto_decode(body, len, f, &err), 0);
    td_pw_free(&w);
}

/* Parses a job with the extras; returns the code, err and *s filled. */
static int parse(const extra *x, size_t n, td_jobspec *s, td_error_t *err)
{
    td_proto_frame *f = NULL;
    int rc;

    build(&f, x, n);
    rc = td_jobspec_parse(td_proto_frame_root(f), s, err);
    td_proto_frame_free(f);
    return rc;
}

static void refused(const extra *x, size_t n, const char *msg)
{
    td_jobspec s;
    td_error_t err = {0};

    assert_int_equal(parse(x, n, &s, &err), TD_EJOB);
    assert_string_equal(err.msg, msg);
}

static int setup(void **state)
{
    FILE *f;

    (void)state;
    snprintf(dir, sizeof(dir), "/tmp/td-jobspec-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(text, sizeof(text), "%s/train.txt", dir);
    f = fopen(text, "w");
    assert_non_null(f);
    fputs("hello traind\n", f);
    assert_int_equal(fclose(f), 0);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    unlink(text);
    rmdir(dir);
    return 0;
}

static void test_defaults(void **state)
{
    td_jobspec s;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(parse(NULL, 0, &s, &err), 0);
    assert_int_equal(s.train.precision, TD_PRECISION_DEFAULT);
    assert_int_equal(s.train.tf32, 0);
    assert_int_equal(s.batch_auto, 0);
    assert_int_equal(s.train.batch_size, 128);
    assert_true(s.nccl_timeout_s == 0);
    assert_int_equal(s.fail_kind, TD_FAIL_NONE);
}

static void test_new_keys_accepted(void **state)
{
    const extra x[] = {
        {.key = "precision", .type = 's', .s = "bf16"},
        {.key = "tf32", .type = 'b', .i = 1},
        {.key = "batch_size", .type = 's', .s = "auto"},
        {.key = "nccl_timeout_s", .type = 'd', .d = 12.5},
        {.key = "debug", .type = 'F', .s = "sticky"},
    };
    const extra y[] = {
        {.key = "precision", .type = 's', .s = "fp32"},
        {.key = "batch_size", .type = 'i', .i = 32},
        {.key = "nccl_timeout_s", .type = 'i', .i = 60},
    };
    td_jobspec s;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(parse(x, 5, &s, &err), 0);
    assert_int_equal(s.train.precision, TD_PRECISION_BF16);
    assert_int_equal(s.train.tf32, 1);
    assert_int_equal(s.batch_auto, 1);
    assert_int_equal(s.train.batch_size, 0);
    assert_true(s.nccl_timeout_s == 12.5);
    assert_int_equal(s.fail_kind, TD_FAIL_STICKY);
    assert_int_equal(s.fail_step, 3);

    assert_int_equal(parse(y, 3, &s, &err), 0);
    assert_int_equal(s.train.precision, TD_PRECISION_FP32);
    assert_int_equal(s.batch_auto, 0);
    assert_int_equal(s.train.batch_size, 32);
    assert_true(s.nccl_timeout_s == 60);
}

static void test_new_keys_refused(void **state)
{
    const extra p[] = {{.key = "precision", .type = 's', .s = "fp16"}};
    const extra p2[] = {{.key = "precision", .type = 'i', .i = 16}};
    const extra t[] = {{.key = "tf32", .type = 's', .s = "yes"}};
    const extra b[] = {{.key = "batch_size", .type = 's', .s = "max"}};
    const extra b0[] = {{.key = "batch_size", .type = 'i', .i = 0}};
    const extra bbig[] = {{.key = "batch_size", .type = 'i', .i = TD_JOB_MAX_BATCH + 1}};
    const extra n0[] = {{.key = "nccl_timeout_s", .type = 'i', .i = 0}};
    const extra nneg[] = {{.key = "nccl_timeout_s", .type = 'd', .d = -1}};
    const extra ns[] = {{.key = "nccl_timeout_s", .type = 's', .s = "5m"}};
    const extra f[] = {{.key = "debug", .type = 'F', .s = "segv"}};

    (void)state;
    refused(p, 1, "precision: must be one of \"fp32\", \"bf16\"");
    refused(p2, 1, "precision: must be one of \"fp32\", \"bf16\"");
    refused(t, 1, "tf32: must be true or false");
    refused(b, 1, "batch_size: must be a positive integer or \"auto\"");
    refused(b0, 1, "batch_size: must be a positive integer");
    refused(bbig, 1, "batch_size: must be a positive integer");
    refused(n0, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(nneg, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(ns, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(f, 1,
            "debug.fail.kind: must be one of \"panic\", \"nan\", \"oom\", \"data\", \"sticky\"");
}

/* set_batch: batch_size replaced in place, every other pair as it was; added when absent. */
static void test_set_batch(void **state)
{
    const extra x[] = {
        {.key = "name", .type = 's', .s = "auto-job"},
        {.key = "batch_size", .type = 's', .s = "auto"},
        {.key = "tf32", .type = 'b', .i = 1},
    };
    td_proto_frame *f = NULL, *g = NULL;
    const void *body;
    void *out = NULL;
    size_t len, out_len = 0;
    td_error_t err = {0};
    td_jobspec s;
    int64_t b = 0;

    (void)state;
    build(&f, x, 3);
    body = td_proto_frame_body(f, &len);
    assert_int_equal(td_jobspec_set_batch(body, len, 48, &out, &out_len, &err), 0);
    assert_int_equal(td_proto_decode(out, out_len, &g, &err), 0);
    assert_int_equal(td_pv_len(td_proto_frame_root(g)), td_pv_len(td_proto_frame_root(f)));
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(g), "batch_size"), &b), 0);
    assert_int_equal(b, 48);
    for (size_t i = 0; i < td_pv_len(td_proto_frame_root(f)); i++) {
        size_t a, c;
        const char *ka = td_pv_str(td_pv_key_at(td_proto_frame_root(f), i), &a);
        const char *kc = td_pv_str(td_pv_key_at(td_proto_frame_root(g), i), &c);
        assert_int_equal(a, c);
        assert_memory_equal(ka, kc, a); /* the keys keep their order */
    }
    assert_int_equal(td_jobspec_parse(td_proto_frame_root(g), &s, &err), 0);
    assert_int_equal(s.batch_auto, 0);
    assert_int_equal(s.train.batch_size, 48);
    assert_int_equal(s.train.tf32, 1);
    assert_string_equal(s.name, "auto-job");
    td_proto_frame_free(g);
    td_proto_frame_free(f);
    free(out);

    /* A job without batch_size gains one. */
    build(&f, NULL, 0);
    body = td_proto_frame_body(f, &len);
    assert_int_equal(td_jobspec_set_batch(body, len, 7, &out, &out_len, &err), 0);
    assert_int_equal(td_proto_decode(out, out_len, &g, &err), 0);
    assert_int_equal(td_pv_len(td_proto_frame_root(g)), td_pv_len(td_proto_frame_root(f)) + 1);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(g), "batch_size"), &b), 0);
    assert_int_equal(b, 7);
    td_proto_frame_free(g);
    td_proto_frame_free(f);
    free(out);

    /* Not a map: refused, nothing returned. */
    out = (void *)1;
    assert_int_equal(td_jobspec_set_batch("\x93\x01\x02\x03", 4, 7, &out, &out_len, &err),
                     TD_EPROTO);
    assert_null(out);
    assert_int_equal(out_len, 0);
    assert_non_null(strstr(err.msg, "not a msgpack map"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_new_keys_accepted),
        cmocka_unit_test(test_new_keys_refused),
        cmocka_unit_test(test_set_batch),
    };

    return cmocka_run_group_tests_name("jobspec", tests, setup, teardown);
}
