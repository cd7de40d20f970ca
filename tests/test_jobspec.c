/* Unit tests of job validation (daemon/jobspec.c) for the keys of the GPU path: precision,
 * tf32, batch_size "auto", nccl_timeout_s and debug.fail.kind "sticky", each accepted and
 * refused with the field named; td_jobspec_set_batch, which rewrites a stored job's
 * batch_size for an "auto" job; and the files checked at submit (td_jobspec_check_access:
 * absolute paths, regular files, headers, label ranges, the dataset's size), with the memory
 * guard counting the dataset. Jobs are built as msgpack maps, the way a submit carries them;
 * their dataset is a small text file in a temporary directory, or Fashion-MNIST. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmocka.h>

#include "daemon/jobspec.h"
#include "daemon/memguard.h"
#include "train/sensor.h"

#define FMNIST "/usr/share/datasets/fashion-mnist"

static char dir[64];
static char text[128];

/* One extra top-level pair of a job: an integer, a number, a string or a boolean. */
typedef struct extra {
    const char *key;
    char type; /* 'i', 'd', 's', 'b', 'F': debug: {fail: {kind: s, step: 1}}, or 'L': loss:
                * {mask_same_label: i as a boolean} */
    int64_t i;
    double d;
    const char *s;
} extra;

/* An extra whose key begins "model." goes into the model map, under the rest of its key. */
static int model_key(const extra *x)
{
    return strncmp(x->key, "model.", 6) == 0;
}

/* Writes a valid gpt job on the text file with the extras, and decodes it into *f. */
static void build(td_proto_frame **f, const extra *x, size_t n)
{
    td_error_t err = {0};
    const void *body;
    size_t len, in_model = 0;
    td_pw w;

    for (size_t i = 0; i < n; i++)
        in_model += model_key(&x[i]);
    td_pw_init(&w);
    td_pw_map(&w, (uint32_t)(2 + n - in_model));
    td_pw_str(&w, "model");
    td_pw_map(&w, (uint32_t)(6 + in_model));
    for (size_t i = 0; i < n; i++)
        if (model_key(&x[i])) {
            td_pw_str(&w, x[i].key + 6);
            td_pw_int(&w, x[i].i);
        }
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
        if (model_key(&x[i]))
            continue;
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
        case 'L':
            td_pw_map(&w, 1);
            td_pw_str(&w, "mask_same_label");
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
    refused(bbig, 1, "batch_size: 1048577 is more than the limit, 1048576 rows");
    refused(n0, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(nneg, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(ns, 1, "nccl_timeout_s: must be a number of seconds > 0 (at most 86400, a day)");
    refused(f, 1,
            "debug.fail.kind: must be one of \"panic\", \"nan\", \"oom\", \"data\", \"sticky\"");
}

/* A gpt's model.attn_chunk: absent is 0 (automatic), any integer 0 to 2^20 is taken, anything
 * else refused naming the key. */
static void test_gpt_attn_chunk(void **state)
{
    const extra c7[] = {{.key = "model.attn_chunk", .type = 'i', .i = 7}};
    const extra c0[] = {{.key = "model.attn_chunk", .type = 'i', .i = 0}};
    const extra cmax[] = {{.key = "model.attn_chunk", .type = 'i', .i = 1 << 20}};
    const extra cneg[] = {{.key = "model.attn_chunk", .type = 'i', .i = -1}};
    const extra cbig[] = {{.key = "model.attn_chunk", .type = 'i', .i = (1 << 20) + 1}};
    td_jobspec s;
    td_error_t err = {0};

    (void)state;
    assert_int_equal(parse(NULL, 0, &s, &err), 0);
    assert_int_equal(s.train.attn_chunk, 0);
    assert_int_equal(parse(c7, 1, &s, &err), 0);
    assert_int_equal(s.train.model, TD_MODEL_GPT);
    assert_int_equal(s.train.attn_chunk, 7);
    assert_int_equal(parse(c0, 1, &s, &err), 0);
    assert_int_equal(s.train.attn_chunk, 0);
    assert_int_equal(parse(cmax, 1, &s, &err), 0);
    assert_int_equal(s.train.attn_chunk, 1 << 20);
    refused(cneg, 1, "model.attn_chunk: must be an integer >= 0 (0: automatic)");
    refused(cbig, 1, "model.attn_chunk: must be an integer >= 0 (0: automatic)");
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

/* ---- the files, checked at submit -------------------------------------------------------- */

/* A job map: model (mlp layers, or gpt dims with init_from when given) and data, written by
 * the caller's fields. */
typedef struct job_desc {
    const char *model; /* "mlp" or "gpt" */
    int layers[3];     /* mlp */
    const char *init_from;
    const char *data;            /* "idx", "text" or "tokens" */
    const char *images, *labels; /* idx */
    const char *train;           /* text, tokens */
} job_desc;

static void write_job(td_pw *w, const job_desc *j)
{
    int mlp = strcmp(j->model, "mlp") == 0, idx = strcmp(j->data, "idx") == 0;

    td_pw_map(w, 2);
    td_pw_str(w, "model");
    td_pw_map(w, mlp ? 2 : 6 + (j->init_from != NULL));
    td_pw_str(w, "kind");
    td_pw_str(w, j->model);
    if (mlp) {
        td_pw_str(w, "layers");
        td_pw_array(w, 3);
        for (int i = 0; i < 3; i++)
            td_pw_int(w, j->layers[i]);
    } else {
        static const char *const keys[] = {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"};
        static const int vals[] = {2, 4, 32, 16, 256};
        for (int i = 0; i < 5; i++) {
            td_pw_str(w, keys[i]);
            td_pw_int(w, vals[i]);
        }
        if (j->init_from != NULL) {
            td_pw_str(w, "init_from");
            td_pw_str(w, j->init_from);
        }
    }
    td_pw_str(w, "data");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, j->data);
    td_pw_str(w, "train");
    if (idx) {
        td_pw_map(w, 2);
        td_pw_str(w, "images");
        td_pw_str(w, j->images);
        td_pw_str(w, "labels");
        td_pw_str(w, j->labels);
    } else {
        td_pw_str(w, j->train);
    }
}

/* Parses j as a submit does, then checks its files as root would be checked (uid 0: every
 * check but the permission bits). The code; err and *s filled. */
static int submit_check(const job_desc *j, td_jobspec *s, td_error_t *err)
{
    td_proto_frame *f = NULL;
    const void *body;
    size_t len;
    td_pw w;
    int rc;

    td_pw_init(&w);
    write_job(&w, j);
    body = td_pw_body(&w, &len);
    assert_non_null(body);
    assert_int_equal(td_proto_decode(body, len, &f, err), 0);
    td_pw_free(&w);
    rc = td_jobspec_parse(td_proto_frame_root(f), s, err);
    if (rc == 0)
        rc = td_jobspec_check_access(s, 0, 0, err);
    td_proto_frame_free(f);
    return rc;
}

static void submit_refused(const job_desc *j, const char *msg)
{
    td_jobspec *s = malloc(sizeof(*s));
    td_error_t err = {0};
    int rc;

    assert_non_null(s);
    rc = submit_check(j, s, &err);
    if (rc != TD_EJOB || strcmp(err.msg, msg) != 0)
        fail_msg("expected EJOB \"%s\", got %s \"%s\"", msg, td_errname(rc), err.msg);
    free(s);
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Headers, magics, versions, sizes and label ranges are checked at submit, naming the field
 * and the file: what used to pass submit and --dry-run and fail only at start. */
static void test_files_checked_at_submit(void **state)
{
    char path[160], msg[600];
    int32_t h[256] = {20240326, 5, 16, 256, 2, 4, 32, 256};
    job_desc mlp = {.model = "mlp",
                    .layers = {784, 16, 5},
                    .data = "idx",
                    .images = FMNIST "/train-images-idx3-ubyte.gz",
                    .labels = FMNIST "/train-labels-idx1-ubyte.gz"};
    job_desc gpt = {.model = "gpt", .data = "text", .train = text, .init_from = path};
    job_desc tok = {.model = "gpt", .data = "tokens", .train = path};

    (void)state;
    submit_refused(&mlp, "model.layers[2]: 5 outputs, but " FMNIST
                         "/train-labels-idx1-ubyte.gz has labels up to 9 (10 classes)");
    mlp.layers[2] = 10;
    mlp.images = mlp.labels;
    submit_refused(&mlp, "data.train.images: " FMNIST "/train-labels-idx1-ubyte.gz: magic "
                         "0x00000801 is an IDX labels file, expected images (0x00000803)");

    snprintf(path, sizeof(path), "%s/gpt2-bf16.bin", dir);
    write_file(path, h, sizeof(h));
    snprintf(msg, sizeof(msg),
             "model.init_from: %s: unsupported version 5 (bf16): traind reads version 3 (fp32) "
             "and the older fp32 version 2",
             path);
    submit_refused(&gpt, msg);
    h[1] = 3;
    write_file(path, h, sizeof(h));
    snprintf(msg, sizeof(msg), "model.init_from: %s: wrong size: 1024 bytes, but a model of ",
             path);
    {
        td_jobspec *s = malloc(sizeof(*s));
        td_error_t err = {0};
        assert_int_equal(submit_check(&gpt, s, &err), TD_EJOB);
        assert_memory_equal(err.msg, msg, strlen(msg)); /* truncated: named with its sizes */
        free(s);
    }
    unlink(path);

    snprintf(path, sizeof(path), "%s/shard.bin", dir);
    h[0] = 12345;
    h[1] = 1;
    h[2] = 0;
    write_file(path, h, sizeof(h));
    snprintf(msg, sizeof(msg),
             "data.train[0]: %s: bad magic 12345, expected 20240520 (llm.c token shard)", path);
    submit_refused(&tok, msg);
    h[0] = 20240520;
    h[1] = 9;
    write_file(path, h, sizeof(h));
    snprintf(msg, sizeof(msg), "data.train[0]: %s: version 9, expected 1 (llm.c token shard)",
             path);
    submit_refused(&tok, msg);
    unlink(path);
}

/* A FIFO or a device is refused at submit (and, since the file can change after, at every
 * open: tests/test_data.c); a relative path is refused with where it should be resolved. */
static void test_paths_refused_at_submit(void **state)
{
    char fifo[160], msg[600];
    job_desc j = {.model = "gpt", .data = "text", .train = fifo};
    job_desc rel = {.model = "gpt", .data = "text", .train = "data/train.txt"};
    job_desc idx = {.model = "mlp",
                    .layers = {784, 16, 10},
                    .data = "idx",
                    .images = "train-images-idx3-ubyte.gz",
                    .labels = FMNIST "/train-labels-idx1-ubyte.gz"};
    job_desc from = {.model = "gpt", .data = "text", .train = text, .init_from = "gpt2.bin"};

    (void)state;
    snprintf(fifo, sizeof(fifo), "%s/fifo", dir);
    assert_int_equal(mkfifo(fifo, 0644), 0);
    alarm(30); /* an open that blocks on the FIFO fails the test */
    snprintf(msg, sizeof(msg), "data.train[0]: %s: not a regular file (a FIFO)", fifo);
    submit_refused(&j, msg);
    j.train = "/dev/zero";
    submit_refused(&j, "data.train[0]: /dev/zero: not a regular file (a character device)");
    alarm(0);
    unlink(fifo);

    submit_refused(&rel, "data.train: must be an absolute path; trainctl resolves relative "
                         "paths where you run it");
    submit_refused(&idx, "data.train.images: must be an absolute path; trainctl resolves "
                         "relative paths where you run it");
    submit_refused(&from, "model.init_from: must be an absolute path; trainctl resolves "
                          "relative paths where you run it");
}

/* An IDX file written with zlib: magic, ndim dims, body. */
static void write_idx_gz(const char *path, uint32_t magic, const uint32_t *dims, int ndim,
                         const void *body, size_t n)
{
    gzFile f = gzopen(path, "wb");
    unsigned char h[16];

    assert_non_null(f);
    for (int i = 0; i <= ndim; i++) {
        uint32_t v = i == 0 ? magic : dims[i - 1];
        h[4 * i] = (unsigned char)(v >> 24);
        h[4 * i + 1] = (unsigned char)(v >> 16);
        h[4 * i + 2] = (unsigned char)(v >> 8);
        h[4 * i + 3] = (unsigned char)v;
    }
    assert_int_equal(gzwrite(f, h, (unsigned)(4 * (ndim + 1))), 4 * (ndim + 1));
    if (n > 0)
        assert_int_equal(gzwrite(f, body, (unsigned)n), (int)n);
    assert_int_equal(gzclose(f), Z_OK);
}

/* A gzip bomb: a few kilobytes whose header declares 1 GiB of pixels. The memory guard counts
 * what the header declares (the reader will hold the file to it) on a cpu device, whose free
 * memory the dataset shares: 512 MiB free does not fit it, and the refusal names the data. */
static void test_guard_counts_the_dataset(void **state)
{
    uint32_t idims[3] = {1u << 24, 8, 8}, ldims[1] = {1u << 24};
    char images[160], labels[160];
    job_desc j = {
        .model = "mlp", .layers = {64, 16, 10}, .data = "idx", .images = images, .labels = labels};
    td_jobspec *s = malloc(sizeof(*s));
    void *zeros = calloc(1, 1u << 24);
    td_error_t err = {0};
    td_memguard g;

    (void)state;
    assert_non_null(s);
    assert_non_null(zeros);
    snprintf(images, sizeof(images), "%s/bomb-images.gz", dir);
    snprintf(labels, sizeof(labels), "%s/bomb-labels.gz", dir);
    write_idx_gz(images, 0x803, idims, 3, "x", 1);
    write_idx_gz(labels, 0x801, ldims, 1, zeros, 1u << 24);
    free(zeros);
    assert_int_equal(submit_check(&j, s, &err), 0);
    s->train.world = 1;
    s->train.batch_size = 64;
    assert_int_equal(td_memguard_check(s, 512u << 20, 1u << 30, "cpu:0", &g, &err), TD_ENOMEM);
    if (strstr(err.msg, ", data 1104), 512 MiB free; not even batch_size 1") == NULL)
        fail_msg("the refusal does not count the dataset: %s", err.msg);
    assert_false(g.fits);
    unlink(images);
    unlink(labels);
    free(s);
}

/* ---- sensorlm: its keys, and its shards checked at submit ---------------------------------- */

static double slm_caption_cut = -1; /* >= 0: slm_submit's job sets data.caption_cut to it */

/* What slm_submit's job says of loss: */
enum {
    LOSS_NONE,         /* no loss map */
    LOSS_TRUE,         /* loss: {mask_same_label: true} */
    LOSS_FALSE,        /* ... false */
    LOSS_STRING,       /* ... "yes" */
    LOSS_INT,          /* ... 1 */
    LOSS_OTHER,        /* loss: {mask: true} */
    LOSS_NUMBER,       /* loss: 3 */
    LOSS_WEIGHT,       /* loss: {mask_same_label: true, same_label_weight: 0.25} */
    LOSS_WEIGHT_BAD,   /* ... same_label_weight: 1 */
    LOSS_WEIGHT_ALONE, /* loss: {same_label_weight: 0.25} */
};
static int slm_loss = LOSS_NONE;

/* slm_loss's loss pair, when it has one. */
static void put_loss(td_pw *w)
{
    td_pw_str(w, "loss");
    if (slm_loss == LOSS_NUMBER) {
        td_pw_int(w, 3);
        return;
    }
    if (slm_loss >= LOSS_WEIGHT) {
        td_pw_map(w, slm_loss == LOSS_WEIGHT_ALONE ? 1 : 2);
        if (slm_loss != LOSS_WEIGHT_ALONE) {
            td_pw_str(w, "mask_same_label");
            td_pw_bool(w, 1);
        }
        td_pw_str(w, "same_label_weight");
        td_pw_double(w, slm_loss == LOSS_WEIGHT_BAD ? 1.0 : 0.25);
        return;
    }
    td_pw_map(w, 1);
    td_pw_str(w, slm_loss == LOSS_OTHER ? "mask" : "mask_same_label");
    if (slm_loss == LOSS_STRING)
        td_pw_str(w, "yes");
    else if (slm_loss == LOSS_INT)
        td_pw_int(w, 1);
    else
        td_pw_bool(w, slm_loss != LOSS_FALSE);
}

/* A sensorlm job on sensor shards train (and valid when not NULL): model.size, then the
 * model.sensor pairs (key, value; a value starting with a letter is a string), data.kind
 * dkind. */
static int slm_submit(const char *train, const char *valid, const char *dkind,
                      const char *const *sensor, int n, td_jobspec *s, td_error_t *err)
{
    td_proto_frame *f = NULL;
    const void *body;
    size_t len;
    td_pw w;
    int rc;

    td_pw_init(&w);
    td_pw_map(&w, 3 + (slm_loss != LOSS_NONE));
    if (slm_loss != LOSS_NONE)
        put_loss(&w);
    td_pw_str(&w, "model");
    td_pw_map(&w, 5);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "sensorlm");
    td_pw_str(&w, "size");
    td_pw_str(&w, "base");
    td_pw_str(&w, "embed_dim");
    td_pw_int(&w, 32);
    td_pw_str(&w, "text");
    td_pw_map(&w, 2);
    td_pw_str(&w, "text_len");
    td_pw_int(&w, 16);
    td_pw_str(&w, "d_model");
    td_pw_int(&w, 48);
    td_pw_str(&w, "sensor");
    td_pw_map(&w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        td_pw_str(&w, sensor[2 * i]);
        if (sensor[2 * i + 1][0] >= 'a')
            td_pw_str(&w, sensor[2 * i + 1]);
        else
            td_pw_int(&w, atoi(sensor[2 * i + 1]));
    }
    td_pw_str(&w, "data");
    td_pw_map(&w, (valid != NULL ? 3 : 2) + (slm_caption_cut >= 0));
    td_pw_str(&w, "kind");
    td_pw_str(&w, dkind);
    if (slm_caption_cut >= 0) {
        td_pw_str(&w, "caption_cut");
        td_pw_double(&w, slm_caption_cut);
    }
    td_pw_str(&w, "train");
    td_pw_str(&w, train);
    if (valid != NULL) {
        td_pw_str(&w, "valid");
        td_pw_str(&w, valid);
    }
    td_pw_str(&w, "batch_size");
    td_pw_int(&w, 4);
    body = td_pw_body(&w, &len);
    assert_non_null(body);
    assert_int_equal(td_proto_decode(body, len, &f, err), 0);
    td_pw_free(&w);
    rc = td_jobspec_parse(td_proto_frame_root(f), s, err);
    if (rc == 0)
        rc = td_jobspec_check_access(s, 0, 0, err);
    td_proto_frame_free(f);
    return rc;
}

/* A good shard: 8 windows of 20 x 3 with K labels (0 or 2); channel 2 named name2. */
static void write_shard_k(const char *path, const char *name2, int K)
{
    td_sensor_header h = {.T = 20, .C = 3, .N = 8, .caption_len = 16, .n_labels = K};
    const char *names[2] = {"rest", "run"}, *prompts[2] = {"rest day", "running day"};
    td_sensor_writer *w = NULL;
    td_error_t err = {0};
    float grid[60];

    snprintf(h.ch[0].name, sizeof(h.ch[0].name), "heart_rate");
    snprintf(h.ch[1].name, sizeof(h.ch[1].name), "steps");
    snprintf(h.ch[2].name, sizeof(h.ch[2].name), "%s", name2);
    assert_int_equal(td_sensor_writer_open(&w, path, &h, names, prompts, &err), 0);
    for (int i = 0; i < 8; i++) {
        for (int j = 0; j < 60; j++)
            grid[j] = (float)(i * j % 7);
        assert_int_equal(td_sensor_writer_add(w, grid, "rest day: calm", 14, i % 2, &err), 0);
    }
    assert_int_equal(td_sensor_writer_finish(w, NULL, NULL, &err), 0);
    td_sensor_writer_free(w);
}

static void write_shard(const char *path, const char *name2)
{
    write_shard_k(path, name2, 2);
}

/* Overwrites n bytes at off of path. */
static void patch_file(const char *path, long off, const void *p, size_t n)
{
    FILE *f = fopen(path, "r+b");

    assert_non_null(f);
    assert_int_equal(fseek(f, off, SEEK_SET), 0);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* The keys land in the config, the recipe's schedule is the default, and every refusal names
 * its key. */
static void test_sensorlm_keys(void **state)
{
    char train[160], msg[400];
    const char *ok[] = {"patch_t", "4",       "patch_c", "2",    "depth", "3",       "n_head",
                        "2",       "mlp_dim", "64",      "pool", "gap",   "d_model", "16"};
    const char *bad_pool[] = {"pool", "max"};
    const char *bad_key[] = {"patches", "4"};
    const char *bad_patch[] = {"time_steps", "20", "patch_t", "3"};
    td_jobspec *s = malloc(sizeof(*s));
    td_error_t err = {0};

    (void)state;
    assert_non_null(s);
    snprintf(train, sizeof(train), "%s/keys.bin", dir);
    write_shard(train, "skin_temp");
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 7, s, &err), 0);
    assert_int_equal(s->train.model, TD_MODEL_SENSORLM);
    assert_int_equal(s->train.data, TD_DATA_SENSOR);
    assert_int_equal(s->train.slm.size, TD_SLM_BASE);
    assert_int_equal(s->train.slm.patch_t, 4);
    assert_int_equal(s->train.slm.s_depth, 3);
    assert_int_equal(s->train.slm.s_width, 16);
    assert_int_equal(s->train.slm.pool, TD_SLM_POOL_GAP);
    assert_int_equal(s->train.slm.t_width, 48);
    assert_int_equal(s->train.slm.text_len, 16);
    assert_int_equal(s->train.slm.embed_dim, 32);
    assert_int_equal(s->train.slm.time_steps, 0); /* the shards' */
    assert_int_equal(s->train.schedule, TD_SCHED_RSQRT);
    assert_true(s->train.warmup > 0.0f && s->train.cooldown > 0.0f);
    assert_int_equal(s->train.optim, TD_OPTIM_ADAMW);
    assert_true(s->train.caption_cut == 0.0f);
    assert_int_equal(slm_submit(train, NULL, "sensor", bad_pool, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "model.sensor.pool: must be one of \"map\", \"gap\"");
    assert_int_equal(slm_submit(train, NULL, "sensor", bad_key, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "model.sensor.patches: unknown key");
    assert_int_equal(slm_submit(train, NULL, "sensor", bad_patch, 2, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "model.sensor.patch_t: 3 does not divide time_steps 20 (a window "
                                 "must be whole patches)");
    assert_int_equal(slm_submit(train, NULL, "text", ok, 7, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "data.kind: a sensorlm model reads \"sensor\" data");
    slm_caption_cut = 0.25;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 7, s, &err), 0);
    assert_true(s->train.caption_cut == 0.25f);
    slm_caption_cut = 1.5;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 7, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "data.caption_cut: must be a probability in [0, 1]");
    slm_caption_cut = -1;
    /* time_steps from the shard: patch_t checked against it when the files are */
    ok[1] = "7";
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 7, s, &err), TD_EJOB);
    snprintf(msg, sizeof(msg), "model.sensor.patch_t: 7 does not divide time_steps 20");
    if (strstr(err.msg, msg) == NULL)
        fail_msg("%s", err.msg);
    unlink(train);
    free(s);
}

/* loss.mask_same_label: off by default, true and false taken; anything but a boolean, another
 * key in loss, a loss that is no object, and the key on a gpt refused naming it; refused at
 * submit when the train shards carry no labels (accepted there when off). */
static void test_loss_mask_same_label(void **state)
{
    const char *ok[] = {"patch_t", "4"};
    const extra gpt[] = {{.key = "loss", .type = 'L', .i = 1}};
    char train[160], bare[160];
    td_jobspec *s = malloc(sizeof(*s));
    td_error_t err = {0};

    (void)state;
    assert_non_null(s);
    snprintf(train, sizeof(train), "%s/loss.bin", dir);
    snprintf(bare, sizeof(bare), "%s/loss-nolabels.bin", dir);
    write_shard(train, "skin_temp");
    write_shard_k(bare, "skin_temp", 0);
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), 0);
    assert_int_equal(s->train.mask_same_label, 0);
    slm_loss = LOSS_TRUE;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), 0);
    assert_int_equal(s->train.mask_same_label, 1);
    slm_loss = LOSS_FALSE;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), 0);
    assert_int_equal(s->train.mask_same_label, 0);
    slm_loss = LOSS_STRING;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.mask_same_label: must be true or false");
    slm_loss = LOSS_INT;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.mask_same_label: must be true or false");
    slm_loss = LOSS_OTHER;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.mask: unknown key");
    slm_loss = LOSS_NUMBER;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss: must be an object");
    slm_loss = LOSS_WEIGHT;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), 0);
    assert_true(s->train.mask_same_label == 1 && s->train.same_label_weight == 0.25f);
    slm_loss = LOSS_WEIGHT_BAD;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.same_label_weight: must be a number in [0, 1)");
    slm_loss = LOSS_WEIGHT_ALONE;
    assert_int_equal(slm_submit(train, NULL, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.same_label_weight: weighs the pairs of "
                                 "loss.mask_same_label, which is not true");
    /* the labels are the train shards': a valid shard's do not count */
    slm_loss = LOSS_TRUE;
    assert_int_equal(slm_submit(bare, train, "sensor", ok, 1, s, &err), TD_EJOB);
    assert_string_equal(err.msg, "loss.mask_same_label: data.train's shards carry no labels");
    slm_loss = LOSS_FALSE;
    assert_int_equal(slm_submit(bare, train, "sensor", ok, 1, s, &err), 0);
    slm_loss = LOSS_NONE;
    refused(gpt, 1, "loss.mask_same_label: is a sensorlm key (model.kind \"sensorlm\")");
    unlink(train);
    unlink(bare);
    free(s);
}

/* Every header field a shard can get wrong is refused at submit, naming the field, the file
 * and what is wrong: magic, version, size, a statistic, a reserved byte, the grid against the
 * model's keys, a valid shard against the train shard, a train split smaller than a batch. */
static void test_sensor_shards_at_submit(void **state)
{
    char train[160], valid[160], msg[600];
    const char *none[] = {"pool", "map"};
    const char *chans[] = {"channels", "8"};
    const char *steps[] = {"time_steps", "40", "patch_t", "10"};
    td_jobspec *s = malloc(sizeof(*s));
    td_error_t err = {0};
    uint32_t v2 = 2;
    float zero = 0.0f;
    unsigned char seven = 7;
    struct {
        const char *what;
        long off;
        const void *p;
        size_t n;
        const char *field;
    } bad[] = {
        {"magic", 0, "XDSENSOR", 8, "header field magic"},
        {"version", 8, &v2, 4, "header field version: 2"},
        {"std", 256 + 128 + 52, &zero, 4, "header field channel[2].std"},
        {"reserved", 100, &seven, 1, "header field reserved"},
    };

    (void)state;
    assert_non_null(s);
    snprintf(train, sizeof(train), "%s/sensor-train.bin", dir);
    snprintf(valid, sizeof(valid), "%s/sensor-valid.bin", dir);
    write_shard(train, "skin_temp");
    write_shard(valid, "skin_temp");
    assert_int_equal(slm_submit(train, valid, "sensor", none, 1, s, &err), 0);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        write_shard(valid, "skin_temp");
        patch_file(valid, bad[i].off, bad[i].p, bad[i].n);
        assert_int_equal(slm_submit(train, valid, "sensor", none, 1, s, &err), TD_EJOB);
        snprintf(msg, sizeof(msg), "data.valid[0]: %s: %s", valid, bad[i].field);
        if (strncmp(err.msg, msg, strlen(msg)) != 0)
            fail_msg("%s: expected \"%s...\", got \"%s\"", bad[i].what, msg, err.msg);
    }
    write_shard(valid, "skin_temp");
    assert_int_equal(truncate(valid, 4096 + 8 * 60 * 4), 0);
    assert_int_equal(slm_submit(train, valid, "sensor", none, 1, s, &err), TD_EJOB);
    snprintf(msg, sizeof(msg),
             "data.valid[0]: %s: file size: 6016 bytes, but the header's 8 "
             "samples of 20 x 3, caption_len 16 and 2 labels take ",
             valid);
    if (strncmp(err.msg, msg, strlen(msg)) != 0)
        fail_msg("size: got \"%s\"", err.msg);
    write_shard(valid, "skin_temperature");
    assert_int_equal(slm_submit(train, valid, "sensor", none, 1, s, &err), TD_EJOB);
    snprintf(msg, sizeof(msg),
             "data.valid[0]: %s: header field channel[2].name: \"skin_temperature\", but %s has "
             "\"skin_temp\"",
             valid, train);
    assert_string_equal(err.msg, msg);
    assert_int_equal(slm_submit(train, NULL, "sensor", chans, 1, s, &err), TD_EJOB);
    snprintf(msg, sizeof(msg),
             "data.train[0]: %s: header field channels: 3, but the model expects 8", train);
    assert_string_equal(err.msg, msg);
    assert_int_equal(slm_submit(train, NULL, "sensor", steps, 2, s, &err), TD_EJOB);
    snprintf(msg, sizeof(msg),
             "data.train[0]: %s: header field time_steps: 20, but the model expects 40", train);
    assert_string_equal(err.msg, msg);
    write_shard(valid, "skin_temp");
    assert_int_equal(slm_submit(train, valid, "sensor", none, 1, s, &err), 0);
    s->train.batch_size = 9;
    assert_int_equal(td_jobspec_check_access(s, 0, 0, &err), TD_EJOB);
    assert_string_equal(err.msg, "data.train: 8 windows in the train split, but a batch takes 9");
    unlink(train);
    unlink(valid);
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_new_keys_accepted),
        cmocka_unit_test(test_new_keys_refused),
        cmocka_unit_test(test_gpt_attn_chunk),
        cmocka_unit_test(test_set_batch),
        cmocka_unit_test(test_files_checked_at_submit),
        cmocka_unit_test(test_paths_refused_at_submit),
        cmocka_unit_test(test_guard_counts_the_dataset),
        cmocka_unit_test(test_sensorlm_keys),
        cmocka_unit_test(test_loss_mask_same_label),
        cmocka_unit_test(test_sensor_shards_at_submit),
    };

    return cmocka_run_group_tests_name("jobspec", tests, setup, teardown);
}
