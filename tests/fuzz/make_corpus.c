/* Writes the seed corpus of the libFuzzer targets (corpus/NAME/seed-*) with the project's own
 * writers where it has them (frames with td_pw, llm.c models with td_weights_gpt_save_llmc, sensor
 * shards with td_sensor_writer), so that the seeds follow the formats as the code writes them.
 * Files the fuzzers found (corpus/NAME/regress-*) are not touched. usage: fuzz_make_corpus DIR
 * (DIR: tests/fuzz/corpus; its NAME folders must exist) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "train/data.h"
#include "train/engine.h"
#include "proto/proto.h"
#include "train/sensor.h"
#include "train/weights.h"

#define FIXTURES "/tmp/traind-fuzz-jobspec" /* fuzz_jobspec.c's fixture directory */

static const char *root;

_Noreturn static void die(const char *what)
{
    fprintf(stderr, "fuzz_make_corpus: %s\n", what);
    exit(1);
}

/* A growable byte string. */
typedef struct buf {
    unsigned char *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (b->p == NULL)
            die("out of memory");
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void put_u8(buf *b, unsigned v)
{
    unsigned char c = (unsigned char)v;
    put(b, &c, 1);
}

static void put_le16(buf *b, unsigned v)
{
    put_u8(b, v & 0xff);
    put_u8(b, (v >> 8) & 0xff);
}

static void put_be32(buf *b, uint32_t v)
{
    for (int i = 3; i >= 0; i--)
        put_u8(b, (v >> (8 * i)) & 0xff);
}

static void write_file(const char *target, const char *name, const void *p, size_t n)
{
    char path[1024];
    FILE *f;

    snprintf(path, sizeof(path), "%s/%s/seed-%s", root, target, name);
    f = fopen(path, "wb");
    if (f == NULL || fwrite(p, 1, n, f) != n || fclose(f) != 0)
        die(path);
}

static void emit(const char *target, const char *name, buf *b)
{
    write_file(target, name, b->p, b->n);
    free(b->p);
    memset(b, 0, sizeof(*b));
}

/* The body of the frame w holds (without its prefix), appended to b. */
static void put_body(buf *b, td_pw *w)
{
    size_t n;
    const void *body = td_pw_body(w, &n);

    if (body == NULL)
        die("a seed frame failed to encode");
    put(b, body, n);
}

/* The whole frame w holds, prefix included, appended to b. */
static void put_frame(buf *b, td_pw *w)
{
    const char *f;
    size_t n;

    if (td_pw_finish(w, &f, &n) != 0)
        die("a seed frame failed to encode");
    put(b, f, n);
}

/* ---- frames ---- */

static void hello(td_pw *w)
{
    td_pw_reset(w);
    td_pw_map(w, 4);
    td_pw_str(w, "type");
    td_pw_str(w, "hello");
    td_pw_str(w, "id");
    td_pw_int(w, 1);
    td_pw_str(w, "version");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "client");
    td_pw_str(w, "trainctl 0.1.0");
}

static void hello_reply(td_pw *w)
{
    td_pw_reset(w);
    td_pw_map(w, 5);
    td_pw_str(w, "type");
    td_pw_str(w, "hello");
    td_pw_str(w, "id");
    td_pw_int(w, 1);
    td_pw_str(w, "version");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "server");
    td_pw_str(w, "traind 0.1.0");
    td_pw_str(w, "features");
    td_pw_array(w, 3);
    td_pw_str(w, "watch");
    td_pw_str(w, "export");
    td_pw_str(w, "batch_auto");
}

/* An idx split {images, labels} of the fixtures, gzipped or not. */
static void idx_split(td_pw *w, int gz)
{
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, gz ? FIXTURES "/images.idx.gz" : FIXTURES "/images.idx");
    td_pw_str(w, "labels");
    td_pw_str(w, gz ? FIXTURES "/labels.idx.gz" : FIXTURES "/labels.idx");
}

/* An mlp on the fixtures' 2x2 images with every optional key. */
static void job_mlp(td_pw *w, int gz)
{
    td_pw_map(w, 19);
    td_pw_str(w, "name");
    td_pw_str(w, "fuzz-mlp");
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, 3);
    td_pw_int(w, 4);
    td_pw_int(w, 8);
    td_pw_int(w, 3);
    td_pw_str(w, "data");
    td_pw_map(w, 4);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    idx_split(w, gz);
    td_pw_str(w, "test");
    idx_split(w, !gz);
    td_pw_str(w, "shuffle");
    td_pw_bool(w, 1);
    td_pw_str(w, "optim");
    td_pw_map(w, 6);
    td_pw_str(w, "kind");
    td_pw_str(w, "adamw");
    td_pw_str(w, "lr");
    td_pw_double(w, 0.001);
    td_pw_str(w, "beta1");
    td_pw_double(w, 0.9);
    td_pw_str(w, "beta2");
    td_pw_double(w, 0.999);
    td_pw_str(w, "eps");
    td_pw_double(w, 1e-8);
    td_pw_str(w, "grad_clip");
    td_pw_double(w, 1.0);
    td_pw_str(w, "schedule");
    td_pw_map(w, 4);
    td_pw_str(w, "kind");
    td_pw_str(w, "cosine");
    td_pw_str(w, "warmup");
    td_pw_double(w, 0.1);
    td_pw_str(w, "cooldown");
    td_pw_double(w, 0.2);
    td_pw_str(w, "min_lr");
    td_pw_double(w, 1e-5);
    td_pw_str(w, "batch_size");
    td_pw_int(w, 2);
    td_pw_str(w, "epochs");
    td_pw_int(w, 3);
    td_pw_str(w, "eval_every");
    td_pw_int(w, 10);
    td_pw_str(w, "eval_batches");
    td_pw_int(w, 0);
    td_pw_str(w, "seed");
    td_pw_int(w, 7);
    td_pw_str(w, "devices");
    td_pw_int(w, 2);
    td_pw_str(w, "priority");
    td_pw_int(w, -5);
    td_pw_str(w, "checkpoint_every");
    td_pw_int(w, 100);
    td_pw_str(w, "keep_checkpoints");
    td_pw_int(w, 3);
    td_pw_str(w, "on_nan");
    td_pw_str(w, "skip");
    td_pw_str(w, "debug");
    td_pw_map(w, 1);
    td_pw_str(w, "fail");
    td_pw_map(w, 3);
    td_pw_str(w, "step");
    td_pw_int(w, 5);
    td_pw_str(w, "device");
    td_pw_array(w, 2);
    td_pw_int(w, 0);
    td_pw_int(w, 1);
    td_pw_str(w, "kind");
    td_pw_str(w, "nan");
    td_pw_str(w, "precision");
    td_pw_str(w, "fp32");
    td_pw_str(w, "tf32");
    td_pw_bool(w, 0);
    td_pw_str(w, "nccl_timeout_s");
    td_pw_double(w, 30.5);
}

/* A gpt on the fixtures' text or token shard; from the fixture model or from dimensions. */
static void job_gpt(td_pw *w, int tokens, int from_file)
{
    td_pw_map(w, 7);
    td_pw_str(w, "name");
    td_pw_str(w, tokens ? "fuzz-gpt-tokens" : "fuzz-gpt-text");
    td_pw_str(w, "model");
    if (from_file) {
        td_pw_map(w, 3);
        td_pw_str(w, "kind");
        td_pw_str(w, "gpt");
        td_pw_str(w, "init_from");
        td_pw_str(w, FIXTURES "/model.bin");
        td_pw_str(w, "seq_len");
        td_pw_int(w, 8);
    } else {
        td_pw_map(w, 6);
        td_pw_str(w, "kind");
        td_pw_str(w, "gpt");
        td_pw_str(w, "n_layer");
        td_pw_int(w, 2);
        td_pw_str(w, "n_head");
        td_pw_int(w, 2);
        td_pw_str(w, "n_embd");
        td_pw_int(w, 8);
        td_pw_str(w, "seq_len");
        td_pw_int(w, 16);
        td_pw_str(w, "vocab_size");
        td_pw_int(w, 256);
    }
    td_pw_str(w, "data");
    td_pw_map(w, 4);
    td_pw_str(w, "kind");
    td_pw_str(w, tokens ? "tokens" : "text");
    td_pw_str(w, "train");
    if (tokens) {
        td_pw_array(w, 2);
        td_pw_str(w, FIXTURES "/tokens*");
        td_pw_str(w, FIXTURES "/tokens.bin");
        td_pw_str(w, "valid");
        td_pw_str(w, FIXTURES "/tok?ns.bin");
    } else {
        td_pw_str(w, FIXTURES "/text.txt");
        td_pw_str(w, "valid_fraction");
        td_pw_double(w, 0.25);
    }
    td_pw_str(w, "shuffle");
    td_pw_bool(w, 0);
    td_pw_str(w, "batch_size");
    if (from_file)
        td_pw_str(w, "auto");
    else
        td_pw_int(w, 4);
    td_pw_str(w, "max_steps");
    td_pw_int(w, 20);
    td_pw_str(w, "optim");
    td_pw_map(w, 4);
    td_pw_str(w, "kind");
    td_pw_str(w, "sgd");
    td_pw_str(w, "lr");
    td_pw_double(w, 0.1);
    td_pw_str(w, "momentum");
    td_pw_double(w, 0.5);
    td_pw_str(w, "weight_decay");
    td_pw_int(w, 0);
    td_pw_str(w, "schedule");
    td_pw_map(w, 1);
    td_pw_str(w, "kind");
    td_pw_str(w, tokens ? "rsqrt" : "constant");
}

/* A sensorlm on the fixtures' sensor shard, with every model key. */
static void job_sensorlm(td_pw *w)
{
    td_pw_map(w, 5);
    td_pw_str(w, "name");
    td_pw_str(w, "fuzz-sensorlm");
    td_pw_str(w, "model");
    td_pw_map(w, 6);
    td_pw_str(w, "kind");
    td_pw_str(w, "sensorlm");
    td_pw_str(w, "size");
    td_pw_str(w, "tiny");
    td_pw_str(w, "sensor");
    td_pw_map(w, 9);
    td_pw_str(w, "time_steps");
    td_pw_int(w, 4);
    td_pw_str(w, "channels");
    td_pw_int(w, 2);
    td_pw_str(w, "patch_t");
    td_pw_int(w, 2);
    td_pw_str(w, "patch_c");
    td_pw_int(w, 1);
    td_pw_str(w, "d_model");
    td_pw_int(w, 8);
    td_pw_str(w, "depth");
    td_pw_int(w, 1);
    td_pw_str(w, "n_head");
    td_pw_int(w, 2);
    td_pw_str(w, "mlp_dim");
    td_pw_int(w, 16);
    td_pw_str(w, "pool");
    td_pw_str(w, "gap");
    td_pw_str(w, "text");
    td_pw_map(w, 5);
    td_pw_str(w, "text_len");
    td_pw_int(w, 16);
    td_pw_str(w, "d_model");
    td_pw_int(w, 8);
    td_pw_str(w, "depth");
    td_pw_int(w, 1);
    td_pw_str(w, "n_head");
    td_pw_int(w, 2);
    td_pw_str(w, "mlp_dim");
    td_pw_int(w, 16);
    td_pw_str(w, "embed_dim");
    td_pw_int(w, 8);
    td_pw_str(w, "attn_chunk");
    td_pw_int(w, 0);
    td_pw_str(w, "data");
    td_pw_map(w, 3);
    td_pw_str(w, "kind");
    td_pw_str(w, "sensor");
    td_pw_str(w, "train");
    td_pw_str(w, FIXTURES "/sensor.bin");
    td_pw_str(w, "valid_fraction");
    td_pw_double(w, 0.5);
    td_pw_str(w, "batch_size");
    td_pw_int(w, 2);
    td_pw_str(w, "max_steps");
    td_pw_int(w, 2);
}

/* {type: "submit", id, job}, the job written by fn(w, a, b). */
static void submit(td_pw *w, int64_t id, int dry_run, void (*fn)(td_pw *, int, int), int a, int b)
{
    td_pw_reset(w);
    td_pw_map(w, dry_run ? 4 : 3);
    td_pw_str(w, "type");
    td_pw_str(w, "submit");
    td_pw_str(w, "id");
    td_pw_int(w, id);
    td_pw_str(w, "job");
    fn(w, a, b);
    if (dry_run) {
        td_pw_str(w, "dry_run");
        td_pw_bool(w, 1);
    }
}

static void mlp_fn(td_pw *w, int gz, int unused)
{
    job_mlp(w, gz);
}

static void gpt_fn(td_pw *w, int tokens, int from_file)
{
    job_gpt(w, tokens, from_file);
}

/* A JOB of a list reply. */
static void job_row(td_pw *w, int64_t id, int failed)
{
    td_pw_map(w, 9);
    td_pw_str(w, "id");
    td_pw_int(w, id);
    td_pw_str(w, "name");
    td_pw_str(w, "fashion-mnist-mlp");
    td_pw_str(w, "state");
    td_pw_str(w, failed ? "failed" : "running");
    td_pw_str(w, "uid");
    td_pw_int(w, 1000);
    td_pw_str(w, "step");
    td_pw_int(w, 1234);
    td_pw_str(w, "total_steps");
    td_pw_int(w, 1407);
    td_pw_str(w, "submitted_at");
    td_pw_double(w, 1716200000.25);
    td_pw_str(w, "error");
    if (failed) {
        td_pw_map(w, 4);
        td_pw_str(w, "code");
        td_pw_int(w, TD_EWORKERS);
        td_pw_str(w, "name");
        td_pw_str(w, "EWORKERS");
        td_pw_str(w, "message");
        td_pw_str(w, "2 training workers failed:\n  device 0: out of memory");
        td_pw_str(w, "devices");
        td_pw_array(w, 1);
        td_pw_map(w, 3);
        td_pw_str(w, "device");
        td_pw_int(w, 0);
        td_pw_str(w, "code");
        td_pw_int(w, TD_ENOMEM);
        td_pw_str(w, "message");
        td_pw_str(w, "out of memory");
    } else {
        td_pw_nil(w);
    }
    td_pw_str(w, "metrics");
    td_pw_map(w, 2);
    td_pw_str(w, "train_loss");
    td_pw_double(w, 0.3125);
    td_pw_str(w, "test_acc");
    td_pw_double(w, 0.875);
}

static void list_reply(td_pw *w)
{
    td_pw_reset(w);
    td_pw_map(w, 5);
    td_pw_str(w, "type");
    td_pw_str(w, "jobs");
    td_pw_str(w, "id");
    td_pw_int(w, 3);
    td_pw_str(w, "jobs");
    td_pw_array(w, 2);
    job_row(w, 1, 0);
    job_row(w, 2, 1);
    td_pw_str(w, "more");
    td_pw_bool(w, 0);
    td_pw_str(w, "next");
    td_pw_int(w, 2);
}

static void rows_reply(td_pw *w)
{
    td_pw_reset(w);
    td_pw_map(w, 4);
    td_pw_str(w, "type");
    td_pw_str(w, "rows");
    td_pw_str(w, "id");
    td_pw_int(w, 4);
    td_pw_str(w, "job_id");
    td_pw_int(w, 1);
    td_pw_str(w, "rows");
    td_pw_array(w, 3);
    for (int i = 0; i < 3; i++) {
        td_pw_array(w, 4);
        td_pw_int(w, 10 * i);
        td_pw_str(w, "train_loss");
        td_pw_double(w, 2.5 / (i + 1));
        td_pw_double(w, 1716200000.0 + i);
    }
}

static void chunk_reply(td_pw *w)
{
    static const unsigned char data[40] = {0x1f, 0x8b, 0, 0xff, 0xc1, 0x80};

    td_pw_reset(w);
    td_pw_map(w, 4);
    td_pw_str(w, "type");
    td_pw_str(w, "chunk");
    td_pw_str(w, "id");
    td_pw_int(w, 9);
    td_pw_str(w, "job_id");
    td_pw_int(w, 1);
    td_pw_str(w, "data");
    td_pw_bin(w, data, sizeof(data));
}

/* A map holding every msgpack type, in forms td_pw does not write (float32, ext, the 16- and
 * 32-bit container forms), hand-encoded. */
static void every_type(td_pw *w)
{
    static const unsigned char raw[] = {
        0xa1, 'a',  0xdc, 0x00, 0x03, 0x01, 0xe0, 0xc0,                /* array16 [1, -32, nil] */
        0xa1, 'b',  0xdf, 0x00, 0x00, 0x00, 0x01, 0xa1, 'x',  0xc3,    /* map32 {x: true} */
        0xa1, 'c',  0xca, 0x3f, 0xc0, 0x00, 0x00,                      /* float32 1.5 */
        0xa1, 'd',  0xca, 0x7f, 0xc0, 0x00, 0x00,                      /* float32 NaN */
        0xa1, 'e',  0xcb, 0x7f, 0xf0, 0,    0,    0,    0,    0,    0, /* float64 inf */
        0xa1, 'f',  0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,    /* uint64 max */
        0xff, 0xa1, 'g',  0xd3, 0x80, 0,    0,    0,    0,    0,    0, 0, /* int64 min */
        0xa1, 'h',  0xd4, 0x05, 0x2a,                                     /* fixext1 */
        0xa1, 'i',  0xc7, 0x03, 0x01, 'e',  'x',  't',                    /* ext8 */
        0xa1, 'j',  0xda, 0x00, 0x02, 0xc3, 0xa9,                         /* str16 "é" */
        0xa1, 'k',  0xc5, 0x00, 0x01, 0x00,                               /* bin16 */
        0xa1, 'l',  0xd0, 0x80, 0xa1, 'm',  0xd1, 0x80, 0x00,             /* int8, int16 */
        0xa1, 'n',  0xce, 0xff, 0xff, 0xff, 0xff,                         /* uint32 */
        0xa1, 'o',  0xa3, 0xff, 0x1b, '"',                                /* invalid UTF-8, ESC */
        0xa1, 'p',  0xcb, 0x80, 0,    0,    0,    0,    0,    0,    0,    /* -0.0 */
        0xa3, 0xef, 0xbf, 0xbd, 0x01, 0xa1, 0xfe, 0x02,                   /* keys U+FFFD and \xfe */
        0xa1, 'a',  0xc2,                                                 /* a repeated key */
    };

    td_pw_reset(w);
    td_pw_map(w, 20);
    td_pw_raw(w, raw, sizeof(raw));
}

/* A map of maps, depth levels deep. */
static void nested(td_pw *w, int depth)
{
    td_pw_reset(w);
    for (int i = 1; i < depth; i++) {
        td_pw_map(w, 1);
        td_pw_str(w, "k");
    }
    td_pw_map(w, 0);
}

/* A proto seed: settings byte, chunking seed, then the frames. */
static void proto_seed(buf *b, unsigned settings, uint32_t seed)
{
    put_u8(b, settings);
    put(b, &seed, sizeof(seed));
}

static void frames(void)
{
    td_pw w;
    buf b = {0};

    td_pw_init(&w);
    proto_seed(&b, 0, 1);
    hello(&w);
    put_frame(&b, &w);
    emit("proto", "hello", &b);
    proto_seed(&b, 1, 5);
    hello(&w);
    put_frame(&b, &w);
    emit("proto", "hello-first-limit", &b);

    proto_seed(&b, 0, 0x9e3779b9);
    hello(&w);
    put_frame(&b, &w);
    submit(&w, 2, 0, mlp_fn, 0, 0);
    put_frame(&b, &w);
    list_reply(&w);
    put_frame(&b, &w);
    rows_reply(&w);
    put_frame(&b, &w);
    td_proto_write_error(&w, 5, TD_EJOB, "model.layers[1]: must be a positive integer");
    put_frame(&b, &w);
    chunk_reply(&w);
    put_frame(&b, &w);
    emit("proto", "session", &b);

    proto_seed(&b, 2 << 1, 77);
    hello_reply(&w);
    put_frame(&b, &w);
    put_be32(&b, 5000); /* past the 4096-byte limit */
    put_u8(&b, 0x80);
    emit("proto", "oversized", &b);

    proto_seed(&b, 0, 3);
    every_type(&w);
    put_frame(&b, &w);
    nested(&w, TD_PROTO_MAX_DEPTH);
    put_frame(&b, &w);
    nested(&w, TD_PROTO_MAX_DEPTH + 1);
    put_frame(&b, &w);
    emit("proto", "types-and-depth", &b);

    proto_seed(&b, 1 << 1, 11);
    submit(&w, 2, 1, gpt_fn, 1, 0);
    put_frame(&b, &w);
    b.n -= 3; /* cut short */
    emit("proto", "truncated", &b);

    /* json: frame bodies */
    hello_reply(&w);
    put_body(&b, &w);
    emit("json", "hello", &b);
    list_reply(&w);
    put_body(&b, &w);
    emit("json", "list", &b);
    rows_reply(&w);
    put_body(&b, &w);
    emit("json", "rows", &b);
    every_type(&w);
    put_body(&b, &w);
    emit("json", "types", &b);
    chunk_reply(&w);
    put_body(&b, &w);
    emit("json", "chunk", &b);
    submit(&w, 2, 0, gpt_fn, 0, 1);
    put_body(&b, &w);
    emit("json", "submit", &b);

    /* jobspec: submit bodies and bare jobs */
    submit(&w, 2, 0, mlp_fn, 0, 0);
    put_body(&b, &w);
    emit("jobspec", "mlp", &b);
    submit(&w, 3, 1, mlp_fn, 1, 0);
    put_body(&b, &w);
    emit("jobspec", "mlp-gz", &b);
    submit(&w, 4, 0, gpt_fn, 0, 1);
    put_body(&b, &w);
    emit("jobspec", "gpt-text-init-from", &b);
    submit(&w, 5, 0, gpt_fn, 1, 0);
    put_body(&b, &w);
    emit("jobspec", "gpt-tokens", &b);
    td_pw_reset(&w);
    job_gpt(&w, 0, 0);
    put_body(&b, &w);
    emit("jobspec", "bare-job", &b);
    td_pw_reset(&w);
    job_sensorlm(&w);
    put_body(&b, &w);
    emit("jobspec", "sensorlm", &b);
    td_pw_free(&w);
}

/* ---- IDX ---- */

static void idx_images(buf *b, uint32_t n, uint32_t rows, uint32_t cols)
{
    put_be32(b, TD_IDX_MAGIC_IMAGES);
    put_be32(b, n);
    put_be32(b, rows);
    put_be32(b, cols);
    for (uint32_t i = 0; i < n * rows * cols; i++)
        put_u8(b, (i * 37) & 0xff);
}

static void idx_labels(buf *b, uint32_t n)
{
    put_be32(b, TD_IDX_MAGIC_LABELS);
    put_be32(b, n);
    for (uint32_t i = 0; i < n; i++)
        put_u8(b, i % 10);
}

/* in, gzipped (no name, no time in the header). */
static buf gzipped(const buf *in)
{
    buf out = {0};
    z_stream z = {0};

    out.cap = in->n + 128;
    out.p = malloc(out.cap);
    if (out.p == NULL || deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY))
        die("zlib");
    z.next_in = in->p;
    z.avail_in = (unsigned)in->n;
    z.next_out = out.p;
    z.avail_out = (unsigned)out.cap;
    if (deflate(&z, Z_FINISH) != Z_STREAM_END)
        die("zlib");
    out.n = out.cap - z.avail_out;
    deflateEnd(&z);
    return out;
}

/* An idx seed: the images file's length, the images, the labels. */
static void idx_seed(const char *name, const buf *images, const buf *labels)
{
    buf b = {0};

    put_le16(&b, (unsigned)images->n);
    put(&b, images->p, images->n);
    put(&b, labels->p, labels->n);
    emit("idx", name, &b);
}

static void idx(void)
{
    buf im = {0}, lb = {0}, gim, glb, lb5 = {0};

    idx_images(&im, 6, 3, 4);
    idx_labels(&lb, 6);
    idx_labels(&lb5, 5);
    gim = gzipped(&im);
    glb = gzipped(&lb);
    idx_seed("plain", &im, &lb);
    idx_seed("gzip", &gim, &glb);
    idx_seed("gzip-images", &gim, &lb);
    idx_seed("count-mismatch", &im, &lb5);
    idx_seed("swapped", &lb, &im);
    free(im.p);
    free(lb.p);
    free(lb5.p);
    free(gim.p);
    free(glb.p);
}

/* ---- llm.c models and token shards ---- */

static void model(const char *name, td_gpt_dims d, int old_version)
{
    static td_gpt m;
    td_params p = {0};
    td_error_t err;
    char path[1024];
    buf b = {0};
    unsigned char chunk[4096];
    size_t n;
    FILE *f;

    if (td_gpt_declare(&m, &p, &d, &err) != 0 || td_params_alloc(&p, 0) != 0)
        die(err.msg);
    td_gpt_bind(&m);
    td_gpt_init(&m, 42);
    snprintf(path, sizeof(path), "%s/llmc/.model.tmp", root);
    if (td_weights_gpt_save_llmc(path, &m, &err) != 0 || (f = fopen(path, "rb")) == NULL)
        die(err.msg);
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0)
        put(&b, chunk, n);
    fclose(f);
    unlink(path);
    if (old_version) { /* llm.c's version 2: no Vp field */
        int32_t v2 = 2, zero = 0;
        memcpy(b.p + 4, &v2, 4);
        memcpy(b.p + 28, &zero, 4);
    }
    emit("llmc", name, &b);
    td_params_free(&p);
}

/* A tokens seed: settings, B-1, T-1, vocabulary, seed, then the files. */
static void tokens_settings(buf *b, unsigned flags, int B, int T, unsigned vocab)
{
    put_u8(b, flags);
    put_u8(b, (unsigned)(B - 1));
    put_u8(b, (unsigned)(T - 1));
    put_le16(b, vocab);
    put_u8(b, 3);
}

static void shard(buf *b, int count, int step)
{
    int32_t h[256] = {TD_DATA_SHARD_MAGIC, TD_DATA_SHARD_VERSION, count};

    put(b, h, sizeof(h));
    for (int i = 0; i < count; i++)
        put_le16(b, (unsigned)(i * step) % 50257);
}

static void tokens(void)
{
    static const char text[] = "When in the Course of human events, it becomes necessary for "
                               "one people to dissolve the political bands which have connected "
                               "them with another.\n";
    buf b = {0}, s = {0};

    tokens_settings(&b, 0, 2, 8, 0);
    put_le16(&b, sizeof(text) - 1);
    put(&b, text, sizeof(text) - 1);
    emit("tokens", "text", &b);

    tokens_settings(&b, 2 | 4, 3, 5, 256); /* shuffled, a valid file */
    put_le16(&b, sizeof(text) - 1);
    put(&b, text, sizeof(text) - 1);
    put(&b, text, 40);
    emit("tokens", "text-shuffle-valid", &b);

    tokens_settings(&b, 8 | (1 << 4), 2, 4, 0); /* glob, valid_fraction 0.1; b holds a NUL */
    put_le16(&b, 60);
    put(&b, text, 60);
    put_le16(&b, 8);
    put(&b, "bin\0ary!", 8);
    emit("tokens", "text-glob", &b);

    shard(&s, 100, 7);
    tokens_settings(&b, 1 | 8, 4, 6, 50257); /* shards, globbed */
    put_le16(&b, (unsigned)s.n);
    put(&b, s.p, s.n);
    put_le16(&b, (unsigned)s.n);
    put(&b, s.p, s.n);
    emit("tokens", "shards-glob", &b);

    tokens_settings(&b, 1 | 2 | 4, 2, 3, 300); /* shards, shuffled, valid, small vocabulary */
    put_le16(&b, (unsigned)s.n);
    put(&b, s.p, s.n);
    free(s.p);
    memset(&s, 0, sizeof(s));
    shard(&s, 20, 3);
    put(&b, s.p, s.n);
    emit("tokens", "shards-valid", &b);
    free(s.p);
}

/* ---- sensor shards ---- */

static void sensor(const char *name, int T, int C, int N, int L, int K)
{
    static const char *const labels[] = {"walking", "sleeping", "running"};
    static const char *const prompts[] = {"a person walking", "", "someone out for a run"};
    static const char *const captions[] = {"calm morning", "", "a run in the rain"};
    td_sensor_header h = {.T = T,
                          .C = C,
                          .N = N,
                          .caption_len = L,
                          .n_labels = K,
                          .period_s = 60,
                          .split = TD_SENSOR_SPLIT_TRAIN};
    td_sensor_writer *w;
    td_error_t err;
    char path[1024];
    float grid[64];
    buf b = {0};
    unsigned char chunk[4096];
    size_t n;
    FILE *f;

    for (int c = 0; c < C; c++) {
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), c == 0 ? "heart_rate" : "steps_%d", c);
        snprintf(h.ch[c].unit, sizeof(h.ch[c].unit), c == 0 ? "bpm" : "");
    }
    snprintf(path, sizeof(path), "%s/sensor/.shard", root);
    if (td_sensor_writer_open(&w, path, &h, labels, prompts, &err) != 0)
        die(err.msg);
    for (int i = 0; i < N; i++) {
        const char *cap = captions[i % 3];
        for (int k = 0; k < T * C; k++)
            grid[k] = (i + k) % 5 == 4 ? NAN : (float)(60 + 3 * i + k);
        if (td_sensor_writer_add(w, grid, cap, strlen(cap) < (size_t)L ? strlen(cap) : (size_t)L,
                                 i % (K > 0 ? K : 1), &err) != 0)
            die(err.msg);
    }
    if (td_sensor_writer_finish(w, NULL, NULL, &err) != 0 || (f = fopen(path, "rb")) == NULL)
        die(err.msg);
    td_sensor_writer_free(w);
    while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0)
        put(&b, chunk, n);
    fclose(f);
    unlink(path);
    emit("sensor", name, &b);
}

int main(int argc, char **argv)
{
    if (argc != 2)
        die("usage: fuzz_make_corpus DIR");
    root = argv[1];
    frames();
    idx();
    model("v3", (td_gpt_dims){.maxT = 4, .V = 8, .Vp = 8, .L = 1, .NH = 1, .C = 4}, 0);
    model("v2", (td_gpt_dims){.maxT = 4, .V = 6, .Vp = 6, .L = 1, .NH = 2, .C = 2}, 1);
    model("two-layers", (td_gpt_dims){.maxT = 2, .V = 5, .Vp = 8, .L = 2, .NH = 2, .C = 2}, 0);
    tokens();
    sensor("labels", 4, 2, 3, 16, 3);
    sensor("no-labels", 2, 3, 2, 8, 0);
    sensor("one", 1, 1, 1, 1, 0);
    return 0;
}
