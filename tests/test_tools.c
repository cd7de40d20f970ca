/* Integration tests of the tools around a trained model: safetensors export of a gpt job (the
 * file parsed back here: Hugging Face GPT-2's names, shapes, offsets, and every value equal to
 * the llm.c export's, transposed where GPT-2's Conv1D stores (in, out)) and of a sensorlm job
 * (the README's names, the statistics), model.init_from from those files (a gpt started from
 * the safetensors file takes the same first step as one started from the llm.c file; a
 * sensorlm started from its export evaluates to the same valid_loss; a file whose shapes do not
 * fit the job is refused at submit and by a dry run naming the tensor and both shapes), and
 * trainctl classify and retrieve on a synthetic shard, with the requester's rights (a shard
 * the user cannot read is refused, as is another user's job). A real traind (TRAIND_BIN) on a
 * temporary socket and a real trainctl (TRAINCTL_BIN), as the other integration tests. */
#include <fcntl.h>
#include <math.h>
#include <pwd.h>
#include <setjmp.h>
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
#include <jansson.h>
#include <msgpack.h>

#include "proto/proto.h"
#include "tests/support.h"

#define LLMC_HEADER 1024 /* bytes of an llm.c model file's header */

/* ---- files and trainctl ---- */

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;

    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    *len = (size_t)n;
    return buf;
}

static void write_file(const char *path, const char *buf, size_t len)
{
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* trainctl --socket SOCK ARGS, stdout in DIR/tc.out, stderr in DIR/tc.err: its exit status. */
static int trainctl(const ts_daemon *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int trainctl(const ts_daemon *d, const char *fmt, ...)
{
    char args[1024], cmd[2048];
    va_list ap;
    int status;

    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "%s --socket %s %s >%s/tc.out 2>%s/tc.err",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), d->sock, args, d->dir, d->dir);
    status = system(cmd);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* trainctl's last stdout ("out") or stderr ("err"), malloc'd. */
static char *tc_output(const ts_daemon *d, const char *which)
{
    char path[320];
    size_t len;
    char *buf;

    snprintf(path, sizeof(path), "%s/tc.%s", d->dir, which);
    buf = read_file(path, &len);
    assert_non_null(buf);
    return buf;
}

static int count_lines(const char *s)
{
    int n = 0;

    for (; *s != '\0'; s++)
        n += *s == '\n';
    return n;
}

/* An error frame's code and message, or 0 for another frame. Frees f. */
static int take_error(td_proto_frame *f, char *msg, size_t size)
{
    const td_pval *root;
    int64_t code = 0;

    assert_non_null(f);
    root = td_proto_frame_root(f);
    msg[0] = '\0';
    if (ts_str_is(td_pv_get(root, "type"), "error")) {
        code = ts_get_i(root, "code");
        td_pv_strcpy(td_pv_get(root, "message"), msg, size);
    }
    td_proto_frame_free(f);
    return (int)code;
}

/* An export's chunks up to its end: the file, malloc'd, and its size. format NULL: llm.c. */
static char *export_file(ts_client *c, int64_t job, const char *format, size_t *len)
{
    size_t cap = 0;
    char *buf = NULL;
    td_proto_frame *f;

    ts_begin(c, "export", format != NULL ? 2 : 1);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    if (format != NULL) {
        td_pw_str(&c->w, "format");
        td_pw_str(&c->w, format);
    }
    ts_client_send(c);
    *len = 0;
    while ((f = ts_client_recv(c)) != NULL) {
        const td_pval *root = td_proto_frame_root(f), *data = td_pv_get(root, "data");
        if (ts_str_is(td_pv_get(root, "type"), "end")) {
            assert_int_equal(ts_get_i(root, "bytes"), (int64_t)*len);
            td_proto_frame_free(f);
            return buf;
        }
        if (!ts_str_is(td_pv_get(root, "type"), "chunk")) {
            char msg[1024] = "";
            td_pv_strcpy(td_pv_get(root, "message"), msg, sizeof(msg));
            fail_msg("export of job %lld: %s", (long long)job, msg);
        }
        if (*len + data->via.bin.size > cap) {
            cap = (*len + data->via.bin.size) * 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        memcpy(buf + *len, data->via.bin.ptr, data->via.bin.size);
        *len += data->via.bin.size;
        td_proto_frame_free(f);
    }
    fail_msg("connection closed during an export");
    return NULL;
}

/* ---- a safetensors reader of the test's own: the format from its description ---- */

typedef struct st {
    const char *buf;
    size_t len;
    json_t *header;
    size_t data; /* offset of the data */
} st;

/* Parses buf as safetensors: the header's length, its JSON, every tensor F32 with offsets
 * that tile the data exactly in the order written. */
static void st_parse(st *s, const char *buf, size_t len)
{
    uint64_t n = 0, at = 0;
    json_error_t e;
    const char *name;
    json_t *v;
    size_t count = 0;

    assert_true(len >= 8);
    for (int i = 7; i >= 0; i--)
        n = n << 8 | (unsigned char)buf[i];
    assert_true(n % 8 == 0 && 8 + n <= len);
    s->buf = buf;
    s->len = len;
    s->data = 8 + n;
    s->header = json_loadb(buf + 8, n, 0, &e);
    if (s->header == NULL)
        fail_msg("the header is not JSON: %s", e.text);
    /* jansson keeps the order of keys: the writer's order is the data's */
    json_object_foreach(s->header, name, v)
    {
        json_t *off = json_object_get(v, "data_offsets");
        if (strcmp(name, "__metadata__") == 0)
            continue;
        assert_string_equal(json_string_value(json_object_get(v, "dtype")), "F32");
        assert_int_equal(json_integer_value(json_array_get(off, 0)), at);
        count = 1;
        for (size_t k = 0; k < json_array_size(json_object_get(v, "shape")); k++)
            count *= (size_t)json_integer_value(json_array_get(json_object_get(v, "shape"), k));
        at = (uint64_t)json_integer_value(json_array_get(off, 1));
        assert_int_equal(at - (uint64_t)json_integer_value(json_array_get(off, 0)), 4 * count);
    }
    assert_int_equal(s->data + at, len);
}

/* Tensor name's shape as "(a, b)" and its floats (borrowed from the buffer). */
static const float *st_tensor(const st *s, const char *name, char *shape, size_t size)
{
    json_t *v = json_object_get(s->header, name), *sh;
    size_t n = 0;

    if (v == NULL)
        fail_msg("no tensor %s", name);
    sh = json_object_get(v, "shape");
    n += (size_t)snprintf(shape + n, size - n, "(");
    for (size_t k = 0; k < json_array_size(sh); k++)
        n += (size_t)snprintf(shape + n, size - n, "%s%lld", k > 0 ? ", " : "",
                              (long long)json_integer_value(json_array_get(sh, k)));
    snprintf(shape + n, size - n, ")");
    return (
        const float *)(s->buf + s->data +
                       json_integer_value(json_array_get(json_object_get(v, "data_offsets"), 0)));
}

static const char *st_meta(const st *s, const char *key)
{
    return json_string_value(json_object_get(json_object_get(s->header, "__metadata__"), key));
}

static size_t st_tensors(const st *s)
{
    return json_object_size(s->header) - (json_object_get(s->header, "__metadata__") != NULL);
}

/* ---- gpt ---- */

static void write_corpus(const char *dir, char *path, size_t size)
{
    static const char *const lines[] = {
        "The cat sat on the mat and looked at the rain. ",
        "A dog ran across the park to fetch a stick. ",
        "Birds sing in the old oak tree at dawn. ",
    };
    uint64_t x = 7;
    FILE *f;

    snprintf(path, size, "%s/corpus.txt", dir);
    f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 120; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        fputs(lines[(x >> 33) % 3], f);
    }
    fclose(f);
}

/* A 2-layer GPT (C 32, 2 heads, T 32, bytes), or with init_from whatever the file says: a
 * submit request, sent. */
static void send_gpt(ts_client *c, const char *corpus, const char *init_from, int64_t max_steps)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, 7);
    td_pw_str(&c->w, "name");
    td_pw_str(&c->w, "gpt");
    td_pw_str(&c->w, "model");
    if (init_from != NULL) {
        td_pw_map(&c->w, 2);
        td_pw_str(&c->w, "kind");
        td_pw_str(&c->w, "gpt");
        td_pw_str(&c->w, "init_from");
        td_pw_str(&c->w, init_from);
    } else {
        td_pw_map(&c->w, 6);
        td_pw_str(&c->w, "kind");
        td_pw_str(&c->w, "gpt");
        td_pw_str(&c->w, "n_layer");
        td_pw_int(&c->w, 2);
        td_pw_str(&c->w, "n_head");
        td_pw_int(&c->w, 2);
        td_pw_str(&c->w, "n_embd");
        td_pw_int(&c->w, 32);
        td_pw_str(&c->w, "seq_len");
        td_pw_int(&c->w, 32);
        td_pw_str(&c->w, "vocab_size");
        td_pw_int(&c->w, 256);
    }
    td_pw_str(&c->w, "data");
    td_pw_map(&c->w, 3);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "text");
    td_pw_str(&c->w, "train");
    td_pw_str(&c->w, corpus);
    td_pw_str(&c->w, "valid_fraction");
    td_pw_double(&c->w, 0.1);
    td_pw_str(&c->w, "batch_size");
    td_pw_int(&c->w, 4);
    td_pw_str(&c->w, "max_steps");
    td_pw_int(&c->w, max_steps);
    td_pw_str(&c->w, "checkpoint_every");
    td_pw_int(&c->w, 10);
    td_pw_str(&c->w, "seed");
    td_pw_int(&c->w, 3);
    ts_client_send(c);
}

static int64_t submit_gpt(ts_client *c, const char *corpus, const char *init_from,
                          int64_t max_steps)
{
    send_gpt(c, corpus, init_from, max_steps);
    return ts_submitted(c);
}

/* A submit from init_from refused: its message must hold want. */
static void refused(ts_client *c, const char *corpus, const char *init_from, const char *want)
{
    char msg[1024];

    send_gpt(c, corpus, init_from, 1);
    assert_int_equal(take_error(ts_client_recv(c), msg, sizeof(msg)), -4206 /* EJOB */);
    if (strstr(msg, "model.init_from: ") == NULL || strstr(msg, want) == NULL)
        fail_msg("init_from %s: \"%s\", expected \"%s\"", init_from, msg, want);
}

/* A safetensors file of header (compact JSON, padded to 8) and data. */
static void write_st(const char *path, json_t *header, const char *data, size_t len)
{
    char *json = json_dumps(header, JSON_COMPACT | JSON_PRESERVE_ORDER);
    size_t n = strlen(json), padded = (n + 7) / 8 * 8;
    unsigned char len8[8];
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    assert_int_equal(fwrite(len8, 1, 8, f), 8);
    assert_int_equal(fwrite(json, 1, n, f), n);
    for (size_t i = n; i < padded; i++)
        fputc(' ', f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
    free(json);
}

/* The export good (len bytes) with the first `from` of its header's JSON replaced by `to`,
 * the header padded again, the data as it was. */
static void write_edited(const char *path, const char *good, size_t len, const char *from,
                         const char *to)
{
    uint64_t n = 0;
    char *json, *at, *out;
    size_t m, padded;
    FILE *f;

    for (int i = 7; i >= 0; i--)
        n = n << 8 | (unsigned char)good[i];
    json = strndup(good + 8, n);
    assert_non_null(json);
    at = strstr(json, from);
    assert_non_null(at);
    out = malloc(n + strlen(to) + 8);
    assert_non_null(out);
    m = (size_t)(at - json);
    memcpy(out, json, m);
    strcpy(out + m, to);
    strcat(out, at + strlen(from));
    m = strlen(out);
    while (m > 0 && out[m - 1] == ' ') /* the old padding */
        m--;
    padded = (m + 7) / 8 * 8;
    f = fopen(path, "wb");
    assert_non_null(f);
    for (int i = 0; i < 8; i++)
        fputc((int)((uint64_t)padded >> (8 * i) & 255), f);
    fwrite(out, 1, m, f);
    for (size_t i = m; i < padded; i++)
        fputc(' ', f);
    fwrite(good + 8 + n, 1, len - 8 - n, f);
    assert_int_equal(fclose(f), 0);
    free(json);
    free(out);
}

/* The header's JSON read strictly: escapes, duplicates, metadata, fields, dtypes. */
static void check_header_grammar(ts_client *c, const char *dir, const char *corpus,
                                 const char *good, size_t len)
{
    static const struct {
        const char *from, *to, *want;
    } bad[] = {
        {"\"wpe.weight\"", "\"wte.weight\"", "tensor wte.weight is named twice"},
        {"\"format\":\"pt\"", "\"format\":1",
         "__metadata__: the value of \"format\" is not a string"},
        {"\"dtype\":\"F32\"", "\"dtype\":\"F32\",\"extra\":1", "unknown field \"extra\""},
        {"\"dtype\":\"F32\"", "\"dtype\":\"I32\"", "tensor wte.weight is I32; traind reads F32"},
        {"\"dtype\":\"F32\"", "\"dtype\":\"Q4\"", "unknown dtype \"Q4\""},
        {"\"wte.weight\"", "\"wte\\u002", "a \\u escape needs 4 hex digits"},
        {"}}", "}}x", "bytes after the header's object"},
        {"\"shape\":[", "\"shape\":[-", "expected a non-negative integer"},
    };
    char path[320];
    ts_watched w;

    snprintf(path, sizeof(path), "%s/edited.safetensors", dir);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        write_edited(path, good, len, bad[i].from, bad[i].to);
        refused(c, corpus, path, bad[i].want);
    }
    /* an escaped name is the name */
    write_edited(path, good, len, "\"wte.weight\"", "\"wte\\u002eweight\"");
    ts_watch_to_end(c, submit_gpt(c, corpus, path, 1), &w);
    assert_string_equal(w.final_state, "succeeded");
}

/* Files that are not good safetensors, or not a GPT-2 that fits, are refused at submit naming
 * what is wrong. good is the export (len bytes). */
static void check_refusals(ts_client *c, const char *dir, const char *corpus, const char *good,
                           size_t len)
{
    char path[320];
    st s;
    json_t *h, *t;
    const char *data;

    snprintf(path, sizeof(path), "%s/bad.safetensors", dir);
    write_file(path, "abcd", 4);
    refused(c, corpus, path, "not a safetensors file: 4 bytes, shorter than the 8-byte header");
    write_file(path, "\xff\xff\0\0\0\0\0\0{}", 10);
    refused(c, corpus, path, "not a safetensors file: a header of 65535 bytes (the file has 2");
    write_file(path, "\x08\0\0\0\0\0\0\0{\"a\":[1]", 16);
    refused(c, corpus, path, "header: byte 5: expected '{'");

    st_parse(&s, good, len);
    data = good + s.data;
    /* a hole: wpe's data a float later */
    h = json_deep_copy(s.header);
    t = json_object_get(json_object_get(h, "wpe.weight"), "data_offsets");
    json_array_set_new(t, 0, json_integer(json_integer_value(json_array_get(t, 0)) + 4));
    json_array_set_new(t, 1, json_integer(json_integer_value(json_array_get(t, 1)) + 4));
    write_st(path, h, data, len - s.data);
    refused(c, corpus, path,
            "tensor wpe.weight starts at byte 32772 of the data, but the tensors before it end "
            "at 32768");
    json_decref(h);
    /* a shape whose bytes disagree with its offsets */
    h = json_deep_copy(s.header);
    json_object_set_new(json_object_get(h, "ln_f.bias"), "shape", json_pack("[i]", 33));
    write_st(path, h, data, len - s.data);
    refused(c, corpus, path, "tensor ln_f.bias: data_offsets");
    json_decref(h);
    /* the same bytes, another shape: not this GPT-2 */
    h = json_deep_copy(s.header);
    json_object_set_new(json_object_get(h, "h.1.mlp.c_fc.weight"), "shape",
                        json_pack("[i,i]", 128, 32));
    write_st(path, h, data, len - s.data);
    refused(c, corpus, path,
            "tensor h.1.mlp.c_fc.weight: (128, 32) in the file, the model needs (32, 128)");
    json_decref(h);
    /* no n_head in the file, none in the job */
    h = json_deep_copy(s.header);
    json_object_del(json_object_get(h, "__metadata__"), "n_head");
    write_st(path, h, data, len - s.data);
    refused(c, corpus, path, "the file does not say its n_head");
    json_decref(h);
    json_decref(s.header);
}

/* GPT-2's names of llm.c's layer tensors (2 .. 13), and whether GPT-2 stores them (in, out). */
static const struct {
    const char *name;
    int transpose;
    int rows, cols; /* llm.c's per-layer shape in units of C: (rows C, cols C); cols 0: 1-D */
} layer_t[12] = {
    {"ln_1.weight", 0, 1, 0},      {"ln_1.bias", 0, 1, 0},          {"attn.c_attn.weight", 1, 3, 1},
    {"attn.c_attn.bias", 0, 3, 0}, {"attn.c_proj.weight", 1, 1, 1}, {"attn.c_proj.bias", 0, 1, 0},
    {"ln_2.weight", 0, 1, 0},      {"ln_2.bias", 0, 1, 0},          {"mlp.c_fc.weight", 1, 4, 1},
    {"mlp.c_fc.bias", 0, 4, 0},    {"mlp.c_proj.weight", 1, 1, 4},  {"mlp.c_proj.bias", 0, 1, 0},
};

/* The safetensors export against the llm.c export of the same checkpoint, tensor by tensor. */
static void check_gpt_safetensors(const char *llmc, size_t llmc_len, const char *sf, size_t sf_len)
{
    const int C = 32, L = 2, V = 256, maxT = 32;
    const float *lp = (const float *)(llmc + LLMC_HEADER), *t;
    char shape[64], want[64], name[64];
    st s;

    st_parse(&s, sf, sf_len);
    assert_string_equal(st_meta(&s, "format"), "pt");
    assert_string_equal(st_meta(&s, "n_head"), "2");
    assert_string_equal(st_meta(&s, "n_layer"), "2");
    assert_int_equal(st_tensors(&s), 2 + 12 * L + 2);
    t = st_tensor(&s, "wte.weight", shape, sizeof(shape));
    assert_string_equal(shape, "(256, 32)");
    assert_memory_equal(t, lp, (size_t)V * C * 4);
    lp += (size_t)V * C; /* Vp = V here */
    t = st_tensor(&s, "wpe.weight", shape, sizeof(shape));
    assert_string_equal(shape, "(32, 32)");
    assert_memory_equal(t, lp, (size_t)maxT * C * 4);
    lp += (size_t)maxT * C;
    for (int i = 0; i < 12; i++) {
        size_t r = (size_t)layer_t[i].rows * C,
               c = layer_t[i].cols > 0 ? (size_t)layer_t[i].cols * C : 0;
        size_t per = r * (c > 0 ? c : 1);
        for (int l = 0; l < L; l++, lp += per) {
            snprintf(name, sizeof(name), "h.%d.%s", l, layer_t[i].name);
            t = st_tensor(&s, name, shape, sizeof(shape));
            if (c == 0)
                snprintf(want, sizeof(want), "(%zu)", r);
            else if (layer_t[i].transpose)
                snprintf(want, sizeof(want), "(%zu, %zu)", c, r);
            else
                snprintf(want, sizeof(want), "(%zu, %zu)", r, c);
            if (strcmp(shape, want) != 0)
                fail_msg("%s: %s, expected %s", name, shape, want);
            for (size_t a = 0; a < r; a++)
                for (size_t b = 0; b < (c > 0 ? c : 1); b++) {
                    float x = lp[a * (c > 0 ? c : 1) + b];
                    float y = layer_t[i].transpose ? t[b * r + a] : t[a * (c > 0 ? c : 1) + b];
                    if (memcmp(&x, &y, 4) != 0)
                        fail_msg("%s[%zu][%zu]: %g in the llm.c file, %g here", name, a, b, x, y);
                }
        }
    }
    t = st_tensor(&s, "ln_f.weight", shape, sizeof(shape));
    assert_memory_equal(t, lp, (size_t)C * 4);
    t = st_tensor(&s, "ln_f.bias", shape, sizeof(shape));
    assert_memory_equal(t, lp + C, (size_t)C * 4);
    assert_int_equal((const char *)(lp + 2 * C), llmc + llmc_len);
    json_decref(s.header);
}

/* float32 to bfloat16 (truncated) and to IEEE half (round to nearest; the small weights here
 * are normal halves or flush to zero). */
static uint16_t to_bf16(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static uint16_t to_f16(float f)
{
    uint32_t u, sign, man;
    int exp;

    memcpy(&u, &f, 4);
    sign = u >> 16 & 0x8000;
    exp = (int)(u >> 23 & 255) - 127 + 15;
    man = u & 0x7fffff;
    if (exp <= 0)
        return (uint16_t)sign;
    if (exp >= 31)
        return (uint16_t)(sign | 0x7c00);
    man += 0x1000; /* round the 13 bits dropped */
    if (man & 0x800000)
        man = 0, exp++;
    return (uint16_t)(sign | (uint32_t)exp << 10 | man >> 13);
}

/* The export (buf, len) rewritten as Hugging Face's files may be: every name under
 * "transformer." with a tied lm_head.weight and a mask buffer beside (prefix), or its data as
 * BF16 or F16 (dtype "BF16", "F16"; NULL: F32). */
static void rewrite(const char *buf, size_t len, const char *path, int prefix, const char *dtype)
{
    json_t *h = json_object(), *v;
    const char *name;
    char *data = malloc(2 * len), full[256];
    size_t at = 0;
    st s;

    assert_non_null(data);
    st_parse(&s, buf, len);
    json_object_set(h, "__metadata__", json_object_get(s.header, "__metadata__"));
    json_object_foreach(s.header, name, v)
    {
        json_t *off = json_object_get(v, "data_offsets"), *e;
        size_t b = (size_t)json_integer_value(json_array_get(off, 0));
        size_t n = ((size_t)json_integer_value(json_array_get(off, 1)) - b) / 4;
        const float *x = (const float *)(buf + s.data + b);
        if (strcmp(name, "__metadata__") == 0)
            continue;
        e = json_deep_copy(v);
        json_object_set_new(e, "dtype", json_string(dtype != NULL ? dtype : "F32"));
        json_object_set_new(
            e, "data_offsets",
            json_pack("[I,I]", (json_int_t)at, (json_int_t)(at + n * (dtype != NULL ? 2 : 4))));
        for (size_t i = 0; i < n; i++) {
            uint16_t hv = dtype == NULL                ? 0
                          : strcmp(dtype, "BF16") == 0 ? to_bf16(x[i])
                                                       : to_f16(x[i]);
            if (dtype == NULL)
                memcpy(data + at + 4 * i, &x[i], 4);
            else
                memcpy(data + at + 2 * i, &hv, 2);
        }
        at += n * (dtype != NULL ? 2 : 4);
        snprintf(full, sizeof(full), "%s%s", prefix ? "transformer." : "", name);
        json_object_set_new(h, full, e);
        if (prefix && strcmp(name, "wte.weight") == 0) { /* the tied head, and a mask buffer */
            memcpy(data + at, x, n * 4);
            json_object_set_new(h, "lm_head.weight",
                                json_pack("{s:s,s:O,s:[I,I]}", "dtype", "F32", "shape",
                                          json_object_get(v, "shape"), "data_offsets",
                                          (json_int_t)at, (json_int_t)(at + n * 4)));
            at += n * 4;
            memset(data + at, 0, 16);
            json_object_set_new(h, "h.0.attn.bias",
                                json_pack("{s:s,s:[i,i],s:[I,I]}", "dtype", "U8", "shape", 4, 4,
                                          "data_offsets", (json_int_t)at, (json_int_t)(at + 16)));
            at += 16;
        }
    }
    write_st(path, h, data, at);
    json_decref(h);
    json_decref(s.header);
    free(data);
}

/* Hugging Face's ways of writing the same GPT-2: under "transformer." with the tied head and a
 * mask buffer (the same first step as the export's), in BF16 and F16 (a first step within the
 * halves' rounding). */
static void check_hf_variants(ts_client *c, const char *dir, const char *corpus, const char *buf,
                              size_t len, double first_loss)
{
    static const char *const dtypes[3] = {NULL, "BF16", "F16"};
    ts_watched w;
    char path[320];

    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "%s/hf%d.safetensors", dir, i);
        rewrite(buf, len, path, i == 0, dtypes[i]);
        ts_watch_to_end(c, submit_gpt(c, corpus, path, 1), &w);
        if (strcmp(w.final_state, "succeeded") != 0)
            fail_msg("%s: %s", path, w.error);
        if (i == 0)
            assert_memory_equal(&w.losses[0], &first_loss, sizeof(double));
        else if (fabs(w.losses[0] - first_loss) > 0.02 * first_loss)
            fail_msg("first step from %s: %.6g, from F32 %.6g", dtypes[i], w.losses[0], first_loss);
        print_message("first step from %s: %.9g\n", i == 0 ? "transformer.*" : dtypes[i],
                      w.losses[0]);
    }
}

/* traind's greedy sample of job against GPT-2's math in torch over the safetensors file sf
 * (tests/gpt2_safetensors.py, a reader of the format of its own): the same 24 bytes. Skipped
 * where /usr/bin/python3 has no torch. Greedy tokens are compared rather than logits, which
 * traind does not send: a float32 difference could change one only at a near tie of the top
 * two logits, and the script prints each step's margin for that case. */
static void check_with_torch(const ts_daemon *d, ts_client *c, int64_t job, const char *sf)
{
    char cmd[1024], path[320], *want = NULL, *got;
    const td_pval *root;
    td_proto_frame *f;
    size_t len = 0, got_len;
    const char *text;
    int status;

    if (access("/usr/bin/python3", X_OK) != 0) {
        print_message("no /usr/bin/python3: the torch check is skipped\n");
        return;
    }
    ts_begin(c, "sample", 4);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "tokens");
    td_pw_int(&c->w, 24);
    td_pw_str(&c->w, "prompt");
    td_pw_str(&c->w, "The cat ");
    td_pw_str(&c->w, "temperature");
    td_pw_double(&c->w, 0);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    text = td_pv_str(td_pv_get(root, "text"), &len);
    assert_non_null(text);
    want = malloc(len + 1);
    memcpy(want, text, len);
    td_proto_frame_free(f);
    snprintf(path, sizeof(path), "%s/torch.out", d->dir);
    snprintf(cmd, sizeof(cmd),
             "/usr/bin/python3 %s/tests/gpt2_safetensors.py %s 'The cat ' 24 >%s 2>%s/torch.err",
             ts_env_or("TD_SOURCE_ROOT", "."), sf, path, d->dir);
    status = system(cmd);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        print_message("python3 has no torch: the torch check is skipped\n");
        free(want);
        return;
    }
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    got = read_file(path, &got_len);
    assert_non_null(got);
    if (got_len != len || memcmp(got, want, len) != 0)
        fail_msg("traind's greedy sample \"%.*s\", GPT-2 in torch from the safetensors file "
                 "\"%.*s\" (margins in %s/torch.err)",
                 (int)len, want, (int)got_len, got, d->dir);
    print_message("greedy from \"The cat \": traind and torch's GPT-2 both \"%.*s\"\n", (int)len,
                  want);
    free(got);
    free(want);
}

/* A gpt's safetensors export is the llm.c export under GPT-2's names and layouts; trainctl
 * writes the same bytes; a job started from it takes the same first step as one started from
 * the llm.c file. */
static void test_gpt_safetensors(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w, from_llmc, from_st;
    char corpus[320], bin[320], sf[320], other[320];
    char *llmc, *st_buf, *again;
    size_t llmc_len, st_len, again_len;
    int64_t job;

    ts_daemon_start(&d, "cpu:1");
    write_corpus(d.dir, corpus, sizeof(corpus));
    ts_connect_hello(&c, d.sock);
    job = submit_gpt(&c, corpus, NULL, 300);
    ts_watch_to_end(&c, job, &w);
    assert_string_equal(w.final_state, "succeeded");
    llmc = export_file(&c, job, NULL, &llmc_len);
    st_buf = export_file(&c, job, "safetensors", &st_len);
    check_gpt_safetensors(llmc, llmc_len, st_buf, st_len);

    /* trainctl: the name picks the format, and the bytes are the protocol's */
    snprintf(sf, sizeof(sf), "%s/model.safetensors", d.dir);
    assert_int_equal(trainctl(&d, "export %lld -o %s", (long long)job, sf), 0);
    again = read_file(sf, &again_len);
    assert_int_equal(again_len, st_len);
    assert_memory_equal(again, st_buf, st_len);
    free(again);
    snprintf(other, sizeof(other), "%s/model.weights", d.dir);
    assert_int_equal(trainctl(&d, "export %lld -o %s --format safetensors", (long long)job, other),
                     0);
    again = read_file(other, &again_len);
    assert_int_equal(again_len, st_len);
    free(again);
    assert_int_equal(trainctl(&d, "export %lld -o %s --format onnx", (long long)job, other), 64);

    check_refusals(&c, d.dir, corpus, st_buf, st_len);
    check_header_grammar(&c, d.dir, corpus, st_buf, st_len);
    check_with_torch(&d, &c, job, sf);

    /* init_from both files: the same first step, bit for bit */
    snprintf(bin, sizeof(bin), "%s/model.bin", d.dir);
    write_file(bin, llmc, llmc_len);
    ts_watch_to_end(&c, submit_gpt(&c, corpus, bin, 1), &from_llmc);
    ts_watch_to_end(&c, submit_gpt(&c, corpus, sf, 1), &from_st);
    assert_string_equal(from_llmc.final_state, "succeeded");
    assert_string_equal(from_st.final_state, "succeeded");
    assert_int_equal(from_st.train_loss_rows, 1);
    assert_memory_equal(&from_llmc.losses[0], &from_st.losses[0], sizeof(double));
    print_message("first step from the llm.c file %.9g, from safetensors %.9g\n",
                  from_llmc.losses[0], from_st.losses[0]);
    check_hf_variants(&c, d.dir, corpus, st_buf, st_len, from_st.losses[0]);

    free(llmc);
    free(st_buf);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- sensorlm ---- */

/* `trainctl sensor synth -o dir --days days --seed 3`. */
static void synth(const char *dir, int days)
{
    char cmd[1024];

    snprintf(cmd, sizeof(cmd), "%s sensor synth -o %s --days %d --seed 3 >/dev/null",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), dir, days);
    assert_int_equal(system(cmd), 0);
}

/* test_daemon_sensorlm's tiny model (patches of an hour of every channel, mean pooled, text_len
 * 22), the sensor tower's width d_model; init_from when not NULL. */
static void write_slm_job(td_pw *w, const char *dir, const char *init_from, int d_model,
                          int64_t max_steps)
{
    char train[400], valid[400];

    snprintf(train, sizeof(train), "%s/synth-train.bin", dir);
    snprintf(valid, sizeof(valid), "%s/synth-valid.bin", dir);
    td_pw_map(w, 7);
    td_pw_str(w, "name");
    td_pw_str(w, "slm");
    td_pw_str(w, "model");
    td_pw_map(w, 4 + (init_from != NULL));
    td_pw_str(w, "kind");
    td_pw_str(w, "sensorlm");
    td_pw_str(w, "size");
    td_pw_str(w, "tiny");
    td_pw_str(w, "sensor");
    td_pw_map(w, 4);
    td_pw_str(w, "patch_t");
    td_pw_int(w, 60);
    td_pw_str(w, "patch_c");
    td_pw_int(w, 10);
    td_pw_str(w, "pool");
    td_pw_str(w, "gap");
    td_pw_str(w, "d_model");
    td_pw_int(w, d_model);
    td_pw_str(w, "text");
    td_pw_map(w, 1);
    td_pw_str(w, "text_len");
    td_pw_int(w, 22);
    if (init_from != NULL) {
        td_pw_str(w, "init_from");
        td_pw_str(w, init_from);
    }
    td_pw_str(w, "data");
    td_pw_map(w, 3);
    td_pw_str(w, "kind");
    td_pw_str(w, "sensor");
    td_pw_str(w, "train");
    td_pw_str(w, train);
    td_pw_str(w, "valid");
    td_pw_str(w, valid);
    td_pw_str(w, "batch_size");
    td_pw_int(w, 16);
    td_pw_str(w, "max_steps");
    td_pw_int(w, max_steps);
    td_pw_str(w, "checkpoint_every");
    td_pw_int(w, 10);
    td_pw_str(w, "seed");
    td_pw_int(w, 5);
}

static int64_t submit_slm(ts_client *c, const char *dir, const char *init_from, int d_model,
                          int64_t max_steps)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    write_slm_job(&c->w, dir, init_from, d_model, max_steps);
    ts_client_send(c);
    return ts_submitted(c);
}

/* A classify request over the protocol: the error code and message (0 for a reply). */
static int classify_code(ts_client *c, int64_t job, const char *data, char *msg, size_t size)
{
    ts_begin(c, "classify", 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "data");
    td_pw_str(&c->w, data);
    ts_client_send(c);
    return take_error(ts_client_recv(c), msg, size);
}

/* As nobody: the sensorlm job submitted (its id the exit status), or the refusals. */
static int as_nobody_submit(const char *sock, const char *dir)
{
    ts_client c;
    int64_t job;

    ts_connect_hello(&c, sock);
    job = submit_slm(&c, dir, NULL, 64, 20);
    ts_client_close(&c);
    return (int)job;
}

static int as_nobody_refusals(const char *sock, int64_t own, int64_t roots, const char *secret,
                              const char *readable)
{
    ts_client c;
    char msg[1024], want[256];
    int code, bad = 0;

    ts_connect_hello(&c, sock);
    code = classify_code(&c, own, secret, msg, sizeof(msg));
    if (code != -4215 || strstr(msg, secret) == NULL || strstr(msg, "ermission denied") == NULL)
        bad = 1, fprintf(stderr, "unreadable shard: code %d \"%s\"\n", code, msg);
    code = classify_code(&c, own, readable, msg, sizeof(msg));
    if (code != 0)
        bad = 1, fprintf(stderr, "readable shard: code %d \"%s\"\n", code, msg);
    snprintf(want, sizeof(want), "permission denied: job %lld belongs to root", (long long)roots);
    code = classify_code(&c, roots, readable, msg, sizeof(msg));
    if (code != -4215 || strcmp(msg, want) != 0)
        bad = 1, fprintf(stderr, "root's job: code %d \"%s\"\n", code, msg);
    ts_client_close(&c);
    return bad;
}

/* Runs fn's case as nobody in a child; its exit status. */
static int run_as_nobody(const ts_daemon *d, const char *data_dir, int what, int64_t own,
                         int64_t roots, const char *secret, const char *readable)
{
    struct passwd *nobody = getpwnam("nobody");
    int status;
    pid_t pid;

    assert_non_null(nobody);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgid(nobody->pw_gid) != 0 || setuid(nobody->pw_uid) != 0)
            _exit(255);
        _exit(what == 0 ? as_nobody_submit(d->sock, data_dir)
                        : as_nobody_refusals(d->sock, own, roots, secret, readable));
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

/* The sensorlm export's names, shapes and statistics. */
static void check_slm_safetensors(const char *buf, size_t len)
{
    char shape[64];
    const float *mean, *sd;
    st s;

    st_parse(&s, buf, len);
    assert_string_equal(st_meta(&s, "format"), "pt");
    assert_string_equal(st_meta(&s, "traind.model"), "sensorlm");
    assert_string_equal(st_meta(&s, "channels"), "10");
    /* gap: no map head. 3 + 12 per block x 2 + 2 + proj; tok, pos, 24, 2, proj; scale, bias;
     * norm.mean and norm.std */
    assert_int_equal(st_tensors(&s), 3 + 24 + 2 + 1 + 2 + 24 + 2 + 1 + 2 + 2);
    st_tensor(&s, "sensor.patch.weight", shape, sizeof(shape));
    assert_string_equal(shape, "(64, 600)");
    st_tensor(&s, "sensor.blocks.1.mlp.fc2.weight", shape, sizeof(shape));
    assert_string_equal(shape, "(64, 256)");
    st_tensor(&s, "text.tok", shape, sizeof(shape));
    assert_string_equal(shape, "(258, 64)");
    st_tensor(&s, "logit_scale", shape, sizeof(shape));
    assert_string_equal(shape, "(1)");
    mean = st_tensor(&s, "norm.mean", shape, sizeof(shape));
    assert_string_equal(shape, "(10)");
    sd = st_tensor(&s, "norm.std", shape, sizeof(shape));
    for (int k = 0; k < 10; k++)
        assert_true(isfinite(mean[k]) && sd[k] > 0);
    assert_true(mean[0] > 40 && mean[0] < 120); /* heart_rate, bpm */
    json_decref(s.header);
}

/* A sensorlm job: exported, started from, refused from a file of other shapes; classify and
 * retrieve through trainctl; the requester's rights. */
static void test_sensorlm_tools(void **state)
{
    ts_daemon d;
    ts_client c;
    ts_watched w, from;
    char data[320], valid[400], secret[400], sf[400], msg[1024];
    char corpus[320], *buf, *out;
    json_error_t je;
    json_t *j;
    size_t len;
    int64_t job, gpt;

    ts_daemon_start(&d, "cpu:1");
    /* nobody reaches the socket and the data, not the rest of the directory */
    assert_int_equal(chmod(d.dir, 0711), 0);
    assert_int_equal(chmod(d.sock, 0666), 0);
    snprintf(data, sizeof(data), "%s/data", d.dir);
    assert_int_equal(mkdir(data, 0755), 0);
    synth(data, 40);
    snprintf(valid, sizeof(valid), "%s/synth-valid.bin", data);
    snprintf(secret, sizeof(secret), "%s/secret.bin", data);
    buf = read_file(valid, &len);
    write_file(secret, buf, len);
    free(buf);
    assert_int_equal(chmod(secret, 0600), 0);

    ts_connect_hello(&c, d.sock);
    write_corpus(d.dir, corpus, sizeof(corpus));
    gpt = submit_gpt(&c, corpus, NULL, 1);
    job = run_as_nobody(&d, data, 0, 0, 0, NULL, NULL);
    assert_true(job > 0 && job < 255);
    ts_watch_to_end(&c, job, &w);
    assert_string_equal(w.final_state, "succeeded");
    ts_watch_to_end(&c, gpt, &from);

    /* the requester's rights: nobody's own job on a shard nobody cannot read, on one it can;
     * root's job */
    assert_int_equal(run_as_nobody(&d, data, 1, job, gpt, secret, valid), 0);
    /* root may use nobody's job; an mlp... a gpt job does not classify */
    assert_int_equal(classify_code(&c, gpt, valid, msg, sizeof(msg)), -4200 /* EINVAL */);
    assert_non_null(strstr(msg, "only sensorlm jobs classify"));

    /* classify: one line per window (4 valid days), its JSON, named labels */
    assert_int_equal(trainctl(&d, "classify %lld --data %s", (long long)job, valid), 0);
    out = tc_output(&d, "out");
    assert_int_equal(count_lines(out), 4);
    print_message("classify:\n%s", out);
    free(out);
    assert_int_equal(trainctl(&d,
                              "classify %lld --data %s -o json --labels 'rest,run=running "
                              "day,cycle'",
                              (long long)job, valid),
                     0);
    out = tc_output(&d, "out");
    j = json_loads(out, 0, &je);
    if (j == NULL)
        fail_msg("classify -o json: %s: %s", je.text, out);
    assert_int_equal(json_array_size(json_object_get(j, "results")), 4);
    assert_int_equal(json_array_size(json_object_get(j, "labels")), 3);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "labels"), 1), "prompt")),
                        "running day");
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(j, "labels"), 0), "prompt")),
                        "rest day|rest day: no workout"); /* the shard's prompts for rest */
    json_decref(j);
    free(out);
    assert_int_equal(trainctl(&d, "classify %lld --data %s", (long long)job, secret), 0);
    assert_int_equal(trainctl(&d, "classify %lld", (long long)job), 64);

    /* retrieve --top 3: three windows, best first */
    assert_int_equal(trainctl(&d, "retrieve %lld --data %s --query 'a morning run' --top 3",
                              (long long)job, valid),
                     0);
    out = tc_output(&d, "out");
    assert_int_equal(count_lines(out), 3);
    print_message("retrieve:\n%s", out);
    free(out);
    assert_int_equal(
        trainctl(&d, "retrieve %lld --data %s --query run -o json", (long long)job, valid), 0);
    out = tc_output(&d, "out");
    j = json_loads(out, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_array_size(json_object_get(j, "results")), 4); /* top 5 of 4 */
    json_decref(j);
    free(out);
    assert_int_equal(
        trainctl(&d, "retrieve %lld --data %s --query x --top 101", (long long)job, valid), 64);

    /* export, and a job started from the file evaluates as the job's last evaluation did */
    buf = export_file(&c, job, "safetensors", &len);
    check_slm_safetensors(buf, len);
    snprintf(sf, sizeof(sf), "%s/slm.safetensors", data);
    write_file(sf, buf, len);
    free(buf);
    ts_watch_to_end(&c, submit_slm(&c, data, sf, 64, 0), &from);
    assert_string_equal(from.final_state, "succeeded");
    assert_int_equal(from.valid_step, 0);
    if (fabs(from.valid_loss - w.valid_loss) > 1e-5 * fabs(w.valid_loss))
        fail_msg("valid_loss %.9g from the export, %.9g at the job's end", from.valid_loss,
                 w.valid_loss);

    /* shapes that do not fit the job: refused at submit and by a dry run, naming the tensor */
    for (int dry = 0; dry < 2; dry++) {
        ts_begin(&c, "submit", 1 + dry);
        td_pw_str(&c.w, "job");
        write_slm_job(&c.w, data, sf, 32, 10);
        if (dry) {
            td_pw_str(&c.w, "dry_run");
            td_pw_bool(&c.w, 1);
        }
        ts_client_send(&c);
        assert_int_equal(take_error(ts_client_recv(&c), msg, sizeof(msg)), -4206 /* EJOB */);
        if (strstr(msg, "model.init_from:") == NULL ||
            strstr(msg, "tensor sensor.patch.weight: (64, 600) in the file, the job's model has "
                        "(32, 600)") == NULL)
            fail_msg("refusal: %s", msg);
    }
    print_message("refused: %s\n", msg);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_gpt_safetensors, ts_kill_leftover),
        cmocka_unit_test_teardown(test_sensorlm_tools, ts_kill_leftover),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
