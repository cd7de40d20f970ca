/* Tests of proto/: writer and reader round trips, the limits against hostile frames (each
 * with its code and message), the accessors, JSON rendering, error frames, and a bounded
 * deterministic fuzz loop over mutated frames. One cmocka executable, suites unit and fuzz. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <msgpack.h>

#include "proto/proto.h"

#define FUZZ_ITERATIONS 20000 /* mutated frames per fuzz test; a few seconds at -O0 */
#define FUZZ_SEED       0x7d5eedULL

/* ---- helpers ---- */

/* The body bytes of a writer, asserting that nothing failed. */
static const unsigned char *body_of(td_pw *w, size_t *len)
{
    const void *b = td_pw_body(w, len);
    assert_non_null(b);
    return b;
}

/* Decodes the writer's body, asserting success; caller frees the frame. */
static td_proto_frame *decode_pw(td_pw *w)
{
    size_t len;
    const unsigned char *b = body_of(w, &len);
    td_proto_frame *f = NULL;
    td_error_t err = {0};

    int rc = td_proto_decode(b, len, &f, &err);
    if (rc != 0)
        fail_msg("decode failed: %s", err.msg);
    assert_non_null(f);
    assert_int_equal(td_pv_type_of(td_proto_frame_root(f)), TD_PV_MAP);
    return f;
}

/* Decodes bytes, asserting the given code and exact message. */
static void expect_decode_error(const void *body, size_t len, int code, const char *msg)
{
    td_proto_frame *f = (td_proto_frame *)1;
    td_error_t err = {0};

    int rc = td_proto_decode(body, len, &f, &err);
    assert_null(f);
    assert_int_equal(rc, code);
    assert_int_equal(err.code, code);
    assert_string_equal(err.msg, msg);
}

/* Decodes bytes, asserting the given code and that the message starts with prefix. */
static void expect_decode_error_prefix(const void *body, size_t len, int code, const char *prefix)
{
    td_proto_frame *f = NULL;
    td_error_t err = {0};

    int rc = td_proto_decode(body, len, &f, &err);
    assert_null(f);
    assert_int_equal(rc, code);
    if (strncmp(err.msg, prefix, strlen(prefix)) != 0)
        fail_msg("message \"%s\" does not start with \"%s\"", err.msg, prefix);
}

/* A string value's text as a C string (asserting it is a string without NUL). */
static const char *str_of(const td_pval *v, char *buf, size_t size)
{
    assert_int_equal(td_pv_strcpy(v, buf, size), 0);
    return buf;
}

/* ---- writer round trips ---- */

static const int64_t int_cases[] = {0,
                                    1,
                                    127,
                                    128,
                                    255,
                                    256,
                                    65535,
                                    65536,
                                    4294967295LL,
                                    4294967296LL,
                                    INT64_MAX,
                                    -1,
                                    -32,
                                    -33,
                                    -128,
                                    -129,
                                    -32768,
                                    -32769,
                                    INT32_MIN,
                                    (int64_t)INT32_MIN - 1,
                                    -5000000000LL,
                                    INT64_MIN};

static void test_ints_round_trip(void **state)
{
    td_pw w;
    size_t n = sizeof(int_cases) / sizeof(int_cases[0]);

    td_pw_init(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "v");
    td_pw_array(&w, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        td_pw_int(&w, int_cases[i]);
    td_proto_frame *f = decode_pw(&w);
    const td_pval *arr = td_pv_get(td_proto_frame_root(f), "v");
    assert_int_equal(td_pv_len(arr), n);
    for (size_t i = 0; i < n; i++) {
        int64_t got = 0;
        double d = 0;
        assert_int_equal(td_pv_type_of(td_pv_at(arr, i)), TD_PV_INT);
        assert_int_equal(td_pv_int(td_pv_at(arr, i), &got), 0);
        assert_true(got == int_cases[i]);
        assert_int_equal(td_pv_double(td_pv_at(arr, i), &d), 0);
        assert_true(d == (double)int_cases[i]);
    }
    td_proto_frame_free(f);
    td_pw_free(&w);
}

/* Each integer takes the smallest msgpack encoding, negative ones the signed forms. */
static void test_int_encodings_are_smallest(void **state)
{
    static const struct {
        int64_t v;
        size_t len;
        unsigned char first;
    } cases[] = {
        {0, 1, 0x00},
        {127, 1, 0x7f},
        {128, 2, 0xcc},
        {255, 2, 0xcc},
        {256, 3, 0xcd},
        {65536, 5, 0xce},
        {4294967296LL, 9, 0xcf},
        {-1, 1, 0xff},
        {-32, 1, 0xe0},
        {-33, 2, 0xd0},
        {-128, 2, 0xd0},
        {-129, 3, 0xd1},
        {-32769, 5, 0xd2},
        {(int64_t)INT32_MIN - 1, 9, 0xd3},
    };
    td_pw w;

    td_pw_init(&w);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len;
        td_pw_reset(&w);
        td_pw_int(&w, cases[i].v);
        const unsigned char *b = body_of(&w, &len);
        assert_int_equal(len, cases[i].len);
        assert_int_equal(b[0], cases[i].first);
    }
    td_pw_free(&w);
}

static void test_doubles_bools_nil_round_trip(void **state)
{
    static const double ds[] = {0.0, 0.5, -1e300, 1.0, 3.141592653589793, 1e-310};
    size_t nd = sizeof(ds) / sizeof(ds[0]);
    td_pw w;
    size_t len;
    double d;
    int b;

    /* float64 always, even for a whole value. */
    td_pw_init(&w);
    td_pw_double(&w, 1.0);
    const unsigned char *raw = body_of(&w, &len);
    assert_int_equal(len, 9);
    assert_int_equal(raw[0], 0xcb);

    td_pw_reset(&w);
    td_pw_map(&w, 5);
    td_pw_str(&w, "d");
    td_pw_array(&w, (uint32_t)nd);
    for (size_t i = 0; i < nd; i++)
        td_pw_double(&w, ds[i]);
    td_pw_str(&w, "nan");
    td_pw_double(&w, NAN);
    td_pw_str(&w, "t");
    td_pw_bool(&w, 7);
    td_pw_str(&w, "f");
    td_pw_bool(&w, 0);
    td_pw_str(&w, "nil");
    td_pw_nil(&w);
    td_proto_frame *f = decode_pw(&w);
    const td_pval *root = td_proto_frame_root(f);
    const td_pval *arr = td_pv_get(root, "d");
    for (size_t i = 0; i < nd; i++) {
        assert_int_equal(td_pv_type_of(td_pv_at(arr, i)), TD_PV_FLOAT);
        assert_int_equal(td_pv_double(td_pv_at(arr, i), &d), 0);
        assert_memory_equal(&d, &ds[i], sizeof(d)); /* bit for bit */
    }
    assert_int_equal(td_pv_double(td_pv_get(root, "nan"), &d), 0);
    assert_true(isnan(d));
    assert_int_equal(td_pv_bool(td_pv_get(root, "t"), &b), 0);
    assert_int_equal(b, 1);
    assert_int_equal(td_pv_bool(td_pv_get(root, "f"), &b), 0);
    assert_int_equal(b, 0);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "nil")), TD_PV_NIL);
    assert_non_null(td_pv_get(root, "nil"));
    assert_int_equal(td_pv_bool(td_pv_get(root, "nil"), &b), TD_EINVAL);
    td_proto_frame_free(f);
    td_pw_free(&w);
}

static void test_strings_and_bin_round_trip(void **state)
{
    static const size_t lens[] = {0, 1, 31, 32, 255, 256, 65535, 65536, 200000};
    size_t nl = sizeof(lens) / sizeof(lens[0]);
    char *big = malloc(200000);
    td_pw w;
    size_t n;
    char buf[16];

    assert_non_null(big);
    for (size_t i = 0; i < 200000; i++)
        big[i] = (char)('a' + i % 26);
    td_pw_init(&w);
    td_pw_map(&w, 6);
    td_pw_str(&w, "empty");
    td_pw_str(&w, "");
    td_pw_str(&w, "nul");
    td_pw_strn(&w, "a\0b", 3);
    td_pw_str(&w, "null");
    td_pw_str(&w, NULL);
    td_pw_str(&w, "sizes");
    td_pw_array(&w, (uint32_t)nl);
    for (size_t i = 0; i < nl; i++)
        td_pw_strn(&w, big, lens[i]);
    td_pw_str(&w, "bin");
    td_pw_bin(&w, "\x00\xff\x01", 3);
    td_pw_str(&w, "bins");
    td_pw_array(&w, (uint32_t)nl);
    for (size_t i = 0; i < nl; i++)
        td_pw_bin(&w, big, lens[i]);
    td_proto_frame *f = decode_pw(&w);
    const td_pval *root = td_proto_frame_root(f);

    const char *s = td_pv_str(td_pv_get(root, "empty"), &n);
    assert_non_null(s);
    assert_int_equal(n, 0);
    assert_string_equal(str_of(td_pv_get(root, "empty"), buf, sizeof(buf)), "");
    s = td_pv_str(td_pv_get(root, "nul"), &n);
    assert_int_equal(n, 3);
    assert_memory_equal(s, "a\0b", 3);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "null")), TD_PV_NIL);
    for (size_t i = 0; i < nl; i++) {
        s = td_pv_str(td_pv_at(td_pv_get(root, "sizes"), i), &n);
        assert_non_null(s);
        assert_int_equal(n, lens[i]);
        assert_memory_equal(s, big, n);
        const td_pval *bv = td_pv_at(td_pv_get(root, "bins"), i);
        assert_int_equal(td_pv_type_of(bv), TD_PV_BIN);
        assert_int_equal(bv->via.bin.size, lens[i]);
        if (lens[i] > 0)
            assert_memory_equal(bv->via.bin.ptr, big, lens[i]);
    }
    const td_pval *bin = td_pv_get(root, "bin");
    assert_int_equal(td_pv_type_of(bin), TD_PV_BIN);
    assert_int_equal(bin->via.bin.size, 3);
    assert_memory_equal(bin->via.bin.ptr, "\x00\xff\x01", 3);
    assert_null(td_pv_str(bin, &n));
    assert_int_equal(n, 0);
    td_proto_frame_free(f);
    td_pw_free(&w);
    free(big);
}

static void test_nested_round_trip(void **state)
{
    td_pw w;
    int64_t v;
    char buf[32];

    td_pw_init(&w);
    td_pw_map(&w, 3);
    td_pw_str(&w, "type");
    td_pw_str(&w, "rows");
    td_pw_str(&w, "rows"); /* 100 rows: array16 of fixarrays */
    td_pw_array(&w, 100);
    for (int i = 0; i < 100; i++) {
        td_pw_array(&w, 4);
        td_pw_str(&w, "loss");
        td_pw_int(&w, i);
        td_pw_double(&w, 1.0 / (i + 1));
        td_pw_double(&w, 1.7e9 + i);
    }
    td_pw_str(&w, "job"); /* map16 of 20 pairs, each holding a nested map */
    td_pw_map(&w, 20);
    for (int i = 0; i < 20; i++) {
        snprintf(buf, sizeof(buf), "k%d", i);
        td_pw_str(&w, buf);
        td_pw_map(&w, 1);
        td_pw_str(&w, "x");
        td_pw_array(&w, 0);
    }
    td_proto_frame *f = decode_pw(&w);
    const td_pval *root = td_proto_frame_root(f);
    assert_int_equal(td_pv_len(root), 3);
    assert_string_equal(str_of(td_pv_key_at(root, 0), buf, sizeof(buf)), "type");
    assert_string_equal(str_of(td_pv_val_at(root, 0), buf, sizeof(buf)), "rows");
    const td_pval *rows = td_pv_get(root, "rows");
    assert_int_equal(td_pv_len(rows), 100);
    assert_int_equal(td_pv_int(td_pv_at(td_pv_at(rows, 57), 1), &v), 0);
    assert_int_equal(v, 57);
    assert_null(td_pv_at(rows, 100));
    const td_pval *job = td_pv_get(root, "job");
    assert_int_equal(td_pv_len(job), 20);
    const td_pval *k19 = td_pv_get(job, "k19");
    assert_int_equal(td_pv_type_of(td_pv_get(k19, "x")), TD_PV_ARRAY);
    assert_int_equal(td_pv_len(td_pv_get(k19, "x")), 0);
    assert_null(td_pv_key_at(job, 20));
    assert_null(td_pv_val_at(job, 20));
    assert_null(td_pv_get(job, "k20"));
    td_proto_frame_free(f);
    td_pw_free(&w);
}

/* td_pw_raw splices stored msgpack in; td_pw_val writes a decoded tree back byte for byte. */
static void test_raw_and_val(void **state)
{
    td_pw spec, w, again;
    size_t slen, len1, len2;
    int64_t v;
    char buf[16];

    td_pw_init(&spec);
    td_pw_map(&spec, 2);
    td_pw_str(&spec, "model");
    td_pw_str(&spec, "mlp");
    td_pw_str(&spec, "layers");
    td_pw_array(&spec, 2);
    td_pw_int(&spec, 784);
    td_pw_int(&spec, -10);
    const void *sb = body_of(&spec, &slen);

    td_pw_init(&w);
    td_pw_map(&w, 2);
    td_pw_str(&w, "type");
    td_pw_str(&w, "submit");
    td_pw_str(&w, "job");
    td_pw_raw(&w, sb, slen);
    td_proto_frame *f = decode_pw(&w);
    const td_pval *job = td_pv_get(td_proto_frame_root(f), "job");
    assert_string_equal(str_of(td_pv_get(job, "model"), buf, sizeof(buf)), "mlp");
    assert_int_equal(td_pv_int(td_pv_at(td_pv_get(job, "layers"), 1), &v), 0);
    assert_int_equal(v, -10);

    td_pw_init(&again);
    td_pw_val(&again, td_proto_frame_root(f));
    const unsigned char *b1 = body_of(&w, &len1);
    const unsigned char *b2 = body_of(&again, &len2);
    assert_int_equal(len1, len2);
    assert_memory_equal(b1, b2, len1);
    td_pw_val(&again, NULL); /* NULL writes nil */
    b2 = body_of(&again, &len2);
    assert_int_equal(b2[len2 - 1], 0xc0);

    td_proto_frame_free(f);
    td_pw_free(&again);
    td_pw_free(&w);
    td_pw_free(&spec);
}

/* Writes the same reply twice, counted by hand (counted 0) or by the writer (counted 1):
 * {type, id, memory: {rows, ...9 pairs}, devices: [{name, free}, {}], spec: raw, more}, with a
 * counted map inside a counted map and one inside a fixed array. */
static void write_reply(td_pw *w, int counted)
{
    static const char spec[] = "\x82\xa1"
                               "a\x01\xa1"
                               "b\x92\xc0\xc3"; /* {a: 1, b: [nil, true]} */

    td_pw_init(w);
    if (counted)
        td_pw_map_open(w);
    else
        td_pw_map(w, 6);
    td_pw_str(w, "type");
    td_pw_str(w, "estimate");
    td_pw_str(w, "id");
    td_pw_int(w, 7);
    td_pw_str(w, "memory");
    if (counted)
        td_pw_map_open(w);
    else
        td_pw_map(w, 9);
    for (int i = 0; i < 9; i++) {
        char key[8];
        snprintf(key, sizeof(key), "k%d", i);
        td_pw_str(w, key);
        td_pw_int(w, (int64_t)i << (4 * i));
    }
    if (counted)
        td_pw_map_close(w);
    td_pw_str(w, "devices");
    td_pw_array(w, 2);
    if (counted)
        td_pw_map_open(w);
    else
        td_pw_map(w, 2);
    td_pw_str(w, "name");
    td_pw_str(w, "cpu:0");
    td_pw_str(w, "free");
    td_pw_double(w, 0.5);
    if (counted)
        td_pw_map_close(w);
    if (counted) {
        td_pw_map_open(w);
        td_pw_map_close(w);
    } else {
        td_pw_map(w, 0);
    }
    td_pw_str(w, "spec");
    td_pw_raw(w, spec, sizeof(spec) - 1);
    td_pw_str(w, "more");
    td_pw_bool(w, 1);
    if (counted)
        td_pw_map_close(w);
}

/* A counted map (td_pw_map_open ... td_pw_map_close) gets the count of what was written into
 * it, nested ones included, in the same bytes a map counted by hand has. */
static void test_counted_map_is_counted_by_the_writer(void **state)
{
    td_pw hand, counted;
    size_t len1, len2;
    const char *frame;
    char buf[16];
    int64_t v;

    write_reply(&hand, 0);
    write_reply(&counted, 1);
    const unsigned char *b1 = body_of(&hand, &len1);
    const unsigned char *b2 = body_of(&counted, &len2);
    assert_int_equal(len1, len2);
    assert_memory_equal(b1, b2, len1);
    assert_int_equal(b2[0], 0x86); /* a fixmap, not the map32 reserved while it was open */
    assert_int_equal(td_pw_finish(&counted, &frame, &len2), 0);

    td_proto_frame *f = decode_pw(&counted);
    const td_pval *root = td_proto_frame_root(f);
    assert_int_equal(td_pv_len(root), 6);
    assert_int_equal(td_pv_len(td_pv_get(root, "memory")), 9);
    assert_int_equal(td_pv_int(td_pv_get(td_pv_get(root, "memory"), "k8"), &v), 0);
    assert_int_equal(v, (int64_t)8 << 32);
    assert_string_equal(
        str_of(td_pv_get(td_pv_at(td_pv_get(root, "devices"), 0), "name"), buf, sizeof(buf)),
        "cpu:0");
    assert_int_equal(td_pv_len(td_pv_at(td_pv_get(root, "devices"), 1)), 0);
    assert_int_equal(td_pv_len(td_pv_get(td_pv_get(root, "spec"), "b")), 2);
    assert_int_equal(td_pv_bool(td_pv_get(root, "more"), (int *)&v), 0);
    td_proto_frame_free(f);
    td_pw_free(&hand);
    td_pw_free(&counted);
}

/* Past 15 pairs a counted map is a map16, past 65535 a map32, as td_pw_map writes them. */
static void test_counted_map_takes_the_smallest_header(void **state)
{
    static const uint32_t counts[] = {15, 16, 65535, 65536};

    for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
        td_pw hand, counted;
        size_t len1, len2;

        td_pw_init(&hand);
        td_pw_init(&counted);
        td_pw_map(&hand, counts[k]);
        td_pw_map_open(&counted);
        for (uint32_t i = 0; i < counts[k]; i++) {
            td_pw_int(&hand, i);
            td_pw_nil(&hand);
            td_pw_int(&counted, i);
            td_pw_nil(&counted);
        }
        td_pw_map_close(&counted);
        const unsigned char *b1 = body_of(&hand, &len1);
        const unsigned char *b2 = body_of(&counted, &len2);
        assert_int_equal(len1, len2);
        assert_memory_equal(b1, b2, len1);
        assert_int_equal(b2[0], counts[k] <= 15      ? 0x80 | counts[k]
                                : counts[k] <= 65535 ? 0xde
                                                     : 0xdf);
        td_pw_free(&hand);
        td_pw_free(&counted);
    }
}

/* A counted map left open, closed with a key and no value, closed around an unfinished array,
 * or closed when none is open fails the frame: no frame with a wrong count goes out. */
static void test_counted_map_misuse_fails_the_frame(void **state)
{
    td_pw w;
    const char *frame;
    size_t len;

    td_pw_init(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "type");
    td_pw_str(&w, "hello");
    assert_null(td_pw_body(&w, &len));
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_EINVAL);
    assert_null(frame);

    td_pw_reset(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "key without a value");
    td_pw_map_close(&w);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_EINVAL);

    td_pw_reset(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "list");
    td_pw_array(&w, 3);
    td_pw_int(&w, 1);
    td_pw_map_close(&w);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_EINVAL);

    td_pw_reset(&w);
    td_pw_map(&w, 0);
    td_pw_map_close(&w);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_EINVAL);

    /* A reset forgets a map left open; nesting past TD_PW_MAX_OPEN is refused. */
    td_pw_reset(&w);
    td_pw_map_open(&w);
    td_pw_reset(&w);
    td_pw_map(&w, 0);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    td_pw_reset(&w);
    for (int i = 0; i <= TD_PW_MAX_OPEN; i++) {
        td_pw_map_open(&w);
        td_pw_str(&w, "k");
    }
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_E2BIG);
    td_pw_free(&w);
}

/* td_pw_array_raw: an array of values encoded elsewhere (a page of jobs) is one value. */
static void test_array_raw_is_one_value(void **state)
{
    td_pw items, w;
    size_t len;

    td_pw_init(&items);
    td_pw_int(&items, 1);
    td_pw_str(&items, "two");
    const void *b = body_of(&items, &len);
    td_pw_init(&w);
    td_pw_map_open(&w);
    td_pw_str(&w, "jobs");
    td_pw_array_raw(&w, 2, b, len);
    td_pw_str(&w, "more");
    td_pw_bool(&w, 0);
    td_pw_map_close(&w);
    td_proto_frame *f = decode_pw(&w);
    assert_int_equal(td_pv_len(td_proto_frame_root(f)), 2);
    assert_int_equal(td_pv_len(td_pv_get(td_proto_frame_root(f), "jobs")), 2);
    td_proto_frame_free(f);
    td_pw_free(&w);
    td_pw_free(&items);
}

/* td_pw_val keeps ext values, floats of either width and unsigned values above INT64_MAX. */
static void test_val_of_other_types(void **state)
{
    static const unsigned char body[] = {0x83, 0xa1, 'e',  0xd6, 0x05, 1,    2,    3,    4,
                                         0xa1, 'u',  0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                         0xff, 0xff, 0xa1, 'f',  0xca, 0x3f, 0xc0, 0x00, 0x00};
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    td_pw w;
    double d;

    assert_int_equal(td_proto_decode(body, sizeof(body), &f, &err), 0);
    const td_pval *root = td_proto_frame_root(f);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "e")), TD_PV_OTHER);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "u")), TD_PV_OTHER);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "f")), TD_PV_FLOAT);
    assert_int_equal(td_pv_double(td_pv_get(root, "f"), &d), 0);
    assert_true(d == 1.5);
    td_pw_init(&w);
    td_pw_val(&w, root);
    td_proto_frame *g = decode_pw(&w);
    const td_pval *r2 = td_proto_frame_root(g);
    const td_pval *e = td_pv_get(r2, "e");
    assert_int_equal(e->type, MSGPACK_OBJECT_EXT);
    assert_int_equal(e->via.ext.type, 5);
    assert_int_equal(e->via.ext.size, 4);
    assert_memory_equal(e->via.ext.ptr, "\x01\x02\x03\x04", 4);
    assert_true(td_pv_get(r2, "u")->via.u64 == UINT64_MAX);
    assert_int_equal(td_pv_double(td_pv_get(r2, "f"), &d), 0);
    assert_true(d == 1.5);
    td_proto_frame_free(g);
    td_proto_frame_free(f);
    td_pw_free(&w);
}

/* A hand-built tree deeper than any decoded one: td_pw_val fails the frame instead of
 * recursing on, td_pv_to_json writes null past its guard; neither overflows the stack. */
static void test_hand_built_deep_tree(void **state)
{
    enum { DEPTH = 100000 };
    msgpack_object *chain = calloc(DEPTH, sizeof(*chain));
    td_pw w;
    const char *frame;
    size_t len;

    assert_non_null(chain);
    for (int i = 0; i < DEPTH - 1; i++) {
        chain[i].type = MSGPACK_OBJECT_ARRAY;
        chain[i].via.array.size = 1;
        chain[i].via.array.ptr = &chain[i + 1];
    }
    chain[DEPTH - 1].type = MSGPACK_OBJECT_BOOLEAN;
    chain[DEPTH - 1].via.boolean = true;
    assert_int_equal(td_pv_type_of(&chain[DEPTH - 1]), TD_PV_BOOL);
    td_pw_init(&w);
    td_pw_val(&w, chain);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_E2BIG);
    assert_null(td_pw_body(&w, &len));
    assert_int_equal(len, 0);
    char *json = td_pv_to_json(chain);
    assert_non_null(json);
    assert_non_null(strstr(json, "[null]"));
    assert_null(strstr(json, "true"));
    free(json);
    td_pw_free(&w);
    free(chain);
}

/* A string or binary over 4 GiB cannot be encoded: the frame fails with E2BIG, and no byte
 * of the (pretend) source is read. */
static void test_oversized_string(void **state)
{
    td_pw w;
    const char *frame;
    size_t len;

    td_pw_init(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "s");
    td_pw_strn(&w, "tiny", (size_t)UINT32_MAX + 1);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_E2BIG);
    td_pw_reset(&w);
    td_pw_bin(&w, "tiny", (size_t)UINT32_MAX + 1);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_E2BIG);
    td_pw_free(&w);
}

static void test_finish_prefix_and_limits(void **state)
{
    td_pw w;
    const char *frame, *frame2;
    size_t len, len2;

    td_pw_init(&w);
    td_pw_map(&w, 0);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(frame, "\x00\x00\x00\x01\x80", 5);
    assert_ptr_equal(frame, w.buf);
    assert_int_equal(td_pw_finish(&w, &frame2, &len2), 0); /* again: the same frame */
    assert_ptr_equal(frame, frame2);
    assert_int_equal(len2, 5);

    /* Exactly TD_PROTO_MAX_FRAME bytes of body is allowed, one more is not. */
    char *big = calloc(1, TD_PROTO_MAX_FRAME);
    assert_non_null(big);
    td_pw_reset(&w);
    td_pw_raw(&w, big, TD_PROTO_MAX_FRAME);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(len, TD_PROTO_MAX_FRAME + TD_PROTO_PREFIX);
    assert_memory_equal(frame, "\x00\x10\x00\x00", 4);
    td_pw_nil(&w);
    assert_int_equal(td_pw_finish(&w, &frame, &len), TD_E2BIG);
    assert_null(frame);
    assert_int_equal(len, 0);

    /* reset forgets the failure and the bytes, and keeps the buffer */
    char *kept = w.buf;
    td_pw_reset(&w);
    td_pw_map(&w, 0);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_ptr_equal(frame, kept);
    assert_int_equal(len, 5);
    free(big);
    td_pw_free(&w);
    td_pw_free(&w); /* twice is harmless */
    td_pw_free(NULL);
}

/* submit --dry-run (PROTOCOL.md, "Dry run"): the request as trainctl writes it and the
 * estimate reply as traind writes it, through a reader one frame after the other: the job map
 * nested whole, dry_run a boolean, byte counts past 4 GiB exact, message nil or a string; and
 * the hello reply's features list. */
static void test_dry_run_round_trip(void **state)
{
    static const char *const parts[] = {"rows",        "parameters", "gradients", "optimizer",
                                        "activations", "attention",  "workspace", "total"};
    const int64_t sizes[] = {8,        497664,    497920,       995328, 85126348800LL,
                             67108864, 100933632, 85228440576LL};
    td_proto_reader *r = NULL;
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    const td_pval *root, *mem;
    const char *frame;
    size_t len;
    char buf[512];
    int64_t v;
    int b = -1;
    td_pw w;

    td_pw_init(&w);
    assert_int_equal(td_proto_reader_new(&r, 0), 0);

    /* the request */
    td_pw_map(&w, 4);
    td_pw_str(&w, "type");
    td_pw_str(&w, "submit");
    td_pw_str(&w, "id");
    td_pw_int(&w, 7);
    td_pw_str(&w, "job");
    td_pw_map(&w, 2);
    td_pw_str(&w, "batch_size");
    td_pw_str(&w, "auto");
    td_pw_str(&w, "model");
    td_pw_map(&w, 1);
    td_pw_str(&w, "kind");
    td_pw_str(&w, "gpt");
    td_pw_str(&w, "dry_run");
    td_pw_bool(&w, 1);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);

    /* the reply */
    td_pw_reset(&w);
    td_pw_map(&w, 13);
    td_pw_str(&w, "type");
    td_pw_str(&w, "estimate");
    td_pw_str(&w, "id");
    td_pw_int(&w, 7);
    td_pw_str(&w, "device");
    td_pw_str(&w, "cuda:1");
    td_pw_str(&w, "devices");
    td_pw_int(&w, 2);
    td_pw_str(&w, "batch_size");
    td_pw_int(&w, 16);
    td_pw_str(&w, "batch_auto");
    td_pw_bool(&w, 1);
    td_pw_str(&w, "memory");
    td_pw_map(&w, 8);
    for (size_t i = 0; i < 8; i++) {
        td_pw_str(&w, parts[i]);
        td_pw_int(&w, sizes[i]);
    }
    td_pw_str(&w, "free_bytes");
    td_pw_int(&w, 84427309056LL);
    td_pw_str(&w, "total_bytes");
    td_pw_int(&w, 85899345920LL);
    td_pw_str(&w, "fits");
    td_pw_bool(&w, 0);
    td_pw_str(&w, "largest_batch");
    td_pw_int(&w, 15);
    td_pw_str(&w, "auto_batch");
    td_pw_int(&w, 14);
    td_pw_str(&w, "message");
    td_pw_str(&w, "does not fit on cuda:1: needs 81279 MiB per device");
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);

    /* the hello reply with its features */
    td_pw_reset(&w);
    td_pw_map(&w, 5);
    td_pw_str(&w, "type");
    td_pw_str(&w, "hello");
    td_pw_str(&w, "id");
    td_pw_int(&w, 0);
    td_pw_str(&w, "version");
    td_pw_int(&w, TD_PROTO_VERSION);
    td_pw_str(&w, "server");
    td_pw_str(&w, "traind 0.1.0");
    td_pw_str(&w, "features");
    td_pw_array(&w, 1);
    td_pw_str(&w, "dry_run");
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);

    assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
    root = td_proto_frame_root(f);
    assert_string_equal(str_of(td_pv_get(root, "type"), buf, sizeof(buf)), "submit");
    assert_int_equal(td_pv_bool(td_pv_get(root, "dry_run"), &b), 0);
    assert_int_equal(b, 1);
    assert_int_equal(td_pv_type_of(td_pv_get(root, "job")), TD_PV_MAP);
    assert_string_equal(str_of(td_pv_get(td_pv_get(root, "job"), "batch_size"), buf, sizeof(buf)),
                        "auto");
    assert_string_equal(
        str_of(td_pv_get(td_pv_get(td_pv_get(root, "job"), "model"), "kind"), buf, sizeof(buf)),
        "gpt");
    td_proto_frame_free(f);

    assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
    root = td_proto_frame_root(f);
    assert_int_equal(td_pv_len(root), 13);
    assert_string_equal(str_of(td_pv_get(root, "type"), buf, sizeof(buf)), "estimate");
    assert_int_equal(td_pv_int(td_pv_get(root, "id"), &v), 0);
    assert_int_equal(v, 7);
    assert_string_equal(str_of(td_pv_get(root, "device"), buf, sizeof(buf)), "cuda:1");
    assert_int_equal(td_pv_bool(td_pv_get(root, "batch_auto"), &b), 0);
    assert_int_equal(b, 1);
    assert_int_equal(td_pv_bool(td_pv_get(root, "fits"), &b), 0);
    assert_int_equal(b, 0);
    mem = td_pv_get(root, "memory");
    assert_int_equal(td_pv_len(mem), 8);
    for (size_t i = 0; i < 8; i++) {
        assert_int_equal(td_pv_int(td_pv_get(mem, parts[i]), &v), 0);
        assert_true(v == sizes[i]);
    }
    assert_int_equal(td_pv_int(td_pv_get(root, "free_bytes"), &v), 0);
    assert_true(v == 84427309056LL);
    assert_int_equal(td_pv_int(td_pv_get(root, "total_bytes"), &v), 0);
    assert_true(v == 85899345920LL);
    assert_int_equal(td_pv_int(td_pv_get(root, "largest_batch"), &v), 0);
    assert_int_equal(v, 15);
    assert_int_equal(td_pv_int(td_pv_get(root, "auto_batch"), &v), 0);
    assert_int_equal(v, 14);
    assert_string_equal(str_of(td_pv_get(root, "message"), buf, sizeof(buf)),
                        "does not fit on cuda:1: needs 81279 MiB per device");
    td_proto_frame_free(f);

    assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
    root = td_proto_frame_root(f);
    assert_int_equal(td_pv_len(td_pv_get(root, "features")), 1);
    assert_string_equal(str_of(td_pv_at(td_pv_get(root, "features"), 0), buf, sizeof(buf)),
                        "dry_run");
    td_proto_frame_free(f);
    assert_int_equal(td_proto_reader_next(r, &f, &err), 0);

    /* a fitting estimate's message is nil */
    td_pw_reset(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "message");
    td_pw_str(&w, NULL);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_decode(frame + 4, len - 4, &f, &err), 0);
    assert_int_equal(td_pv_type_of(td_pv_get(td_proto_frame_root(f), "message")), TD_PV_NIL);
    td_proto_frame_free(f);

    td_proto_reader_free(r);
    td_pw_free(&w);
}

static void test_write_error(void **state)
{
    td_pw w;
    const char *frame;
    size_t len;
    int64_t v;
    char buf[256];
    td_proto_frame *f = NULL;
    td_error_t err = {0};

    td_pw_init(&w);
    td_pw_str(&w, "half a reply"); /* discarded by td_proto_write_error */
    td_proto_write_error(&w, 42, TD_EJOB, "batch_size: must be a positive integer");
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(((unsigned char)frame[2] << 8 | (unsigned char)frame[3]) + 4, len);
    assert_int_equal(td_proto_decode(frame + 4, len - 4, &f, &err), 0);
    const td_pval *root = td_proto_frame_root(f);
    assert_int_equal(td_pv_len(root), 5);
    assert_string_equal(str_of(td_pv_get(root, "type"), buf, sizeof(buf)), "error");
    assert_int_equal(td_pv_int(td_pv_get(root, "id"), &v), 0);
    assert_int_equal(v, 42);
    assert_int_equal(td_pv_int(td_pv_get(root, "code"), &v), 0);
    assert_int_equal(v, TD_EJOB);
    assert_string_equal(str_of(td_pv_get(root, "name"), buf, sizeof(buf)), "EJOB");
    assert_string_equal(str_of(td_pv_get(root, "message"), buf, sizeof(buf)),
                        "batch_size: must be a positive integer");
    td_proto_frame_free(f);

    /* id -1 and no message: the code's text stands in */
    td_proto_write_error(&w, -1, TD_EPROTO, NULL);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_decode(frame + 4, len - 4, &f, &err), 0);
    root = td_proto_frame_root(f);
    assert_int_equal(td_pv_int(td_pv_get(root, "id"), &v), 0);
    assert_int_equal(v, -1);
    assert_string_equal(str_of(td_pv_get(root, "name"), buf, sizeof(buf)), "EPROTO");
    assert_string_equal(str_of(td_pv_get(root, "message"), buf, sizeof(buf)), "protocol error");
    td_proto_frame_free(f);

    /* a huge message is cut at 4096 bytes, not inside a character */
    size_t n = 10000;
    char *msg = malloc(n + 1);
    assert_non_null(msg);
    for (size_t i = 0; i + 1 < n; i += 2)
        memcpy(msg + i, "\xc3\xa9", 2); /* é: the cut at 4096 falls on a boundary... */
    msg[n] = '\0';
    msg[0] = 'x'; /* ...so shift by one byte: now 4096 would split a character */
    memmove(msg + 1, msg + 2, n - 1);
    td_proto_write_error(&w, 1, TD_EIO, msg);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_decode(frame + 4, len - 4, &f, &err), 0);
    const char *s = td_pv_str(td_pv_get(td_proto_frame_root(f), "message"), &n);
    assert_int_equal(n, 4095);
    assert_memory_equal(s, msg, n);
    td_proto_frame_free(f);
    free(msg);
    td_pw_free(&w);
}

/* ---- the reader ---- */

/* A frame {type: "t", id: i, pad: "<i mod 50 bytes>"} appended to w's buffer as bytes. */
static size_t make_frame(td_pw *w, int64_t id, const char **out)
{
    char pad[64];
    size_t len;

    memset(pad, 'p', sizeof(pad));
    td_pw_reset(w);
    td_pw_map(w, 3);
    td_pw_str(w, "type");
    td_pw_str(w, "t");
    td_pw_str(w, "id");
    td_pw_int(w, id);
    td_pw_str(w, "pad");
    td_pw_strn(w, pad, (size_t)(id % 50));
    assert_int_equal(td_pw_finish(w, out, &len), 0);
    return len;
}

/* Takes every frame the reader has, checking ids count on from *next_id. */
static void drain(td_proto_reader *r, int64_t *next_id)
{
    td_proto_frame *f;
    td_error_t err = {0};
    int rc;
    int64_t id;

    while ((rc = td_proto_reader_next(r, &f, &err)) == 1) {
        assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "id"), &id), 0);
        assert_int_equal(id, *next_id);
        (*next_id)++;
        td_proto_frame_free(f);
    }
    if (rc != 0)
        fail_msg("reader error %d: %s", rc, err.msg);
    assert_null(f);
}

static void test_reader_one_byte_at_a_time(void **state)
{
    td_proto_reader *r;
    td_pw w;
    const char *frame;
    int64_t next = 0;

    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    td_pw_init(&w);
    for (int64_t id = 0; id < 60; id++) {
        size_t len = make_frame(&w, id, &frame);
        for (size_t i = 0; i < len; i++) {
            assert_int_equal(td_proto_reader_feed(r, frame + i, 1), 0);
            drain(r, &next);
            assert_int_equal(next, i + 1 == len ? id + 1 : id);
        }
    }
    td_pw_free(&w);
    td_proto_reader_free(r);
    td_proto_reader_free(NULL);
}

static void test_reader_many_frames_per_feed(void **state)
{
    td_proto_reader *r;
    td_pw w;
    const char *frame;
    size_t cap = 1 << 20, len = 0;
    char *stream = malloc(cap);
    int64_t next = 0;
    const int nframes = 5000;

    assert_non_null(stream);
    td_pw_init(&w);
    for (int64_t id = 0; id < nframes; id++) {
        size_t n = make_frame(&w, id, &frame);
        assert_true(len + n <= cap);
        memcpy(stream + len, frame, n);
        len += n;
    }
    /* all at once */
    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    assert_int_equal(td_proto_reader_feed(r, stream, len), 0);
    drain(r, &next);
    assert_int_equal(next, nframes);
    td_proto_reader_free(r);

    /* in chunks of awkward sizes that split prefixes and bodies everywhere */
    next = 0;
    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    for (size_t off = 0, step = 1; off < len; off += step, step = step * 7 % 1021 + 1) {
        size_t n = len - off < step ? len - off : step;
        assert_int_equal(td_proto_reader_feed(r, stream + off, n), 0);
        drain(r, &next);
    }
    assert_int_equal(next, nframes);
    td_proto_reader_free(r);
    td_pw_free(&w);
    free(stream);
}

/* The length prefix is judged as soon as its 4 bytes are in, before any body byte is fed. */
static void test_reader_rejects_huge_prefix_at_once(void **state)
{
    td_proto_reader *r;
    td_proto_frame *f;
    td_error_t err = {0};
    td_pw w;
    const char *frame;
    int64_t next = 0;

    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    td_pw_init(&w);
    size_t len = make_frame(&w, 0, &frame);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0); /* a good frame first */
    assert_int_equal(td_proto_reader_feed(r, "\xff\xff\xff", 3), 0);
    drain(r, &next); /* the good frame still comes out */
    assert_int_equal(next, 1);
    assert_int_equal(td_proto_reader_feed(r, "\xff", 1), 0);
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_E2BIG);
    assert_null(f);
    assert_string_equal(err.msg, "frame of 4294967295 bytes exceeds the limit of 1048576 bytes");
    /* the stream is dead: more data is dropped, the same error again */
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);
    memset(&err, 0, sizeof(err));
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_E2BIG);
    assert_int_equal(err.code, TD_E2BIG);
    assert_string_equal(err.msg, "frame of 4294967295 bytes exceeds the limit of 1048576 bytes");
    td_proto_reader_free(r);

    /* a reader's own limit: 100 bytes is allowed, 101 is not */
    assert_int_equal(td_proto_reader_new(&r, 100), 0);
    char body[105] = {0, 0, 0, 100, (char)0x81, (char)0xa1, 'a', (char)0xc4, 95};
    assert_int_equal(td_proto_reader_feed(r, body, sizeof(body) - 1), 0);
    assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
    assert_int_equal(td_pv_type_of(td_pv_get(td_proto_frame_root(f), "a")), TD_PV_BIN);
    td_proto_frame_free(f);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x00\x65", 4), 0);
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_E2BIG);
    assert_string_equal(err.msg, "frame of 101 bytes exceeds the limit of 100 bytes");
    td_proto_reader_free(r);
    td_pw_free(&w);
}

/* td_proto_reader_limit_first: the first frame is held to the smaller limit, with its own
 * message; from the second frame on the reader's full limit applies. */
static void test_reader_limits_the_first_frame(void **state)
{
    td_proto_reader *r;
    td_proto_frame *f;
    td_error_t err = {0};
    char *big = calloc(1, 5000);
    td_pw w;
    const char *frame;
    size_t len;

    assert_non_null(big);
    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    td_proto_reader_limit_first(r, 4096);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x10\x01", 4), 0); /* 4097 bytes */
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_E2BIG);
    assert_string_equal(err.msg,
                        "frame of 4097 bytes exceeds the limit of 4096 bytes before hello");
    td_proto_reader_free(r);

    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    td_proto_reader_limit_first(r, 4096);
    td_pw_init(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "pad");
    td_pw_strn(&w, big, 4000);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);
    td_pw_reset(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "pad");
    td_pw_strn(&w, big, 5000);
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_reader_feed(r, frame, len), 0);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
        td_proto_frame_free(f);
    }
    td_proto_reader_free(r);
    td_pw_free(&w);
    free(big);
}

/* Error frames carry UTF-8 text whatever the message held: controls but newlines and
 * malformed bytes escaped. */
static void test_write_error_escapes(void **state)
{
    td_pw w;
    const char *frame;
    size_t len, n;
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    const char *s;

    td_pw_init(&w);
    td_proto_write_error(&w, 3, TD_EPROTO, "type: unknown request \"\xff\x1b[2J\"\nsecond line");
    assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
    assert_int_equal(td_proto_decode(frame + 4, len - 4, &f, &err), 0);
    s = td_pv_str(td_pv_get(td_proto_frame_root(f), "message"), &n);
    assert_int_equal(n, strlen("type: unknown request \"\\xff\\x1b[2J\"\nsecond line"));
    assert_memory_equal(s, "type: unknown request \"\\xff\\x1b[2J\"\nsecond line", n);
    td_proto_frame_free(f);
    td_pw_free(&w);
}

/* A bad body kills the stream after the good frames before it. */
static void test_reader_bad_body(void **state)
{
    td_proto_reader *r;
    td_proto_frame *f;
    td_error_t err = {0};

    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x00\x01\x80", 5), 0);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x00\x03\x92\x01\x02", 7), 0);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x00\x01\x80", 5), 0);
    assert_int_equal(td_proto_reader_next(r, &f, &err), 1);
    assert_int_equal(td_pv_len(td_proto_frame_root(f)), 0);
    td_proto_frame_free(f);
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_EPROTO);
    assert_string_equal(err.msg, "top-level value is an array, not a map");
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_EPROTO);
    assert_null(f);
    td_proto_reader_free(r);

    /* an empty body */
    assert_int_equal(td_proto_reader_new(&r, 0), 0);
    assert_int_equal(td_proto_reader_feed(r, "\x00\x00\x00\x00", 4), 0);
    assert_int_equal(td_proto_reader_next(r, &f, &err), TD_EPROTO);
    assert_string_equal(err.msg, "truncated msgpack value at byte 0");
    td_proto_reader_free(r);
}

/* ---- limits and malformed bodies ---- */

static void test_hostile_array_header(void **state)
{
    /* The 5-byte header that makes msgpack-c reserve 100 GB, alone and inside a map. */
    expect_decode_error("\xdd\xff\xff\xff\xff", 5, TD_E2BIG,
                        "array of 4294967295 elements exceeds the limit of 65536, at byte 0");
    expect_decode_error("\x81\xa1"
                        "a\xdd\xff\xff\xff\xff",
                        8, TD_E2BIG,
                        "array of 4294967295 elements exceeds the limit of 65536, at byte 3");
    /* within the limit but more elements than bytes left */
    expect_decode_error("\x81\xa1"
                        "a\xdc\x00\x10",
                        6, TD_EPROTO,
                        "truncated msgpack value at byte 3 (array of 16 elements in 0 bytes)");
    expect_decode_error("\x81\xa1"
                        "a\xdd\x00\x01\x00\x00",
                        8, TD_EPROTO,
                        "truncated msgpack value at byte 3 (array of 65536 elements in 0 bytes)");
}

static void test_hostile_map_header(void **state)
{
    expect_decode_error("\xdf\xff\xff\xff\xff", 5, TD_E2BIG,
                        "map of 4294967295 pairs exceeds the limit of 65536, at byte 0");
    expect_decode_error("\x81\xa1"
                        "a\xdf\x00\x01\x00\x01",
                        8, TD_E2BIG, "map of 65537 pairs exceeds the limit of 65536, at byte 3");
    /* two bytes per pair at least: 4 pairs do not fit in 6 bytes */
    expect_decode_error("\x84\xa1"
                        "a\x01\xa1"
                        "b\x02",
                        7, TD_EPROTO,
                        "truncated msgpack value at byte 0 (map of 4 pairs in 6 bytes)");
    /* 3 pairs might, but the third is missing */
    expect_decode_error("\x83\xa1"
                        "a\x01\xa1"
                        "b\x02",
                        7, TD_EPROTO, "truncated msgpack value at byte 7");
}

static void test_hostile_string_lengths(void **state)
{
    expect_decode_error("\x81\xa1"
                        "a\xdb\x00\x04\x93\xe0",
                        8, TD_E2BIG,
                        "string of 300000 bytes exceeds the limit of 262144, at byte 3");
    expect_decode_error("\x81\xa1"
                        "a\xdb\xff\xff\xff\xff",
                        8, TD_E2BIG,
                        "string of 4294967295 bytes exceeds the limit of 262144, at byte 3");
    expect_decode_error("\x81\xa1"
                        "a\xc6\x00\x04\x00\x01",
                        8, TD_E2BIG,
                        "binary of 262145 bytes exceeds the limit of 262144, at byte 3");
    expect_decode_error("\x81\xa1"
                        "a\xc9\x7f\xff\xff\xff\x01",
                        9, TD_E2BIG,
                        "ext of 2147483647 bytes exceeds the limit of 262144, at byte 3");
    /* a map key is a string too */
    expect_decode_error("\x81\xdb\x10\x00\x00\x00", 6, TD_E2BIG,
                        "string of 268435456 bytes exceeds the limit of 262144, at byte 1");
    /* within the limit but longer than the body */
    expect_decode_error("\x81\xa1"
                        "a\xd9\x05"
                        "abc",
                        8, TD_EPROTO, "truncated msgpack value at byte 3");

    /* exactly TD_PROTO_MAX_STR bytes is allowed */
    td_pw w;
    char *s = calloc(1, TD_PROTO_MAX_STR);
    assert_non_null(s);
    td_pw_init(&w);
    td_pw_map(&w, 1);
    td_pw_str(&w, "s");
    td_pw_strn(&w, s, TD_PROTO_MAX_STR);
    td_proto_frame *f = decode_pw(&w);
    size_t n;
    assert_non_null(td_pv_str(td_pv_get(td_proto_frame_root(f), "s"), &n));
    assert_int_equal(n, TD_PROTO_MAX_STR);
    td_proto_frame_free(f);
    td_pw_free(&w);
    free(s);
}

static void test_depth_bomb(void **state)
{
    size_t n = 3 + 10000 + 1;
    unsigned char *b = malloc(n);
    td_proto_frame *f = NULL;
    td_error_t err = {0};

    assert_non_null(b);
    memcpy(b,
           "\x81\xa1"
           "a",
           3);
    memset(b + 3, 0x91, 10000);
    b[n - 1] = 0xc0;
    /* the top map is level 1, so the 16th fixarray (byte 18) is level 17 */
    expect_decode_error(b, n, TD_E2BIG, "array nested deeper than 16 levels, at byte 18");

    /* 16 levels exactly decode: the map and 15 arrays around a nil */
    memcpy(b + 3 + 15, "\xc0", 1);
    assert_int_equal(td_proto_decode(b, 3 + 15 + 1, &f, &err), 0);
    const td_pval *v = td_pv_get(td_proto_frame_root(f), "a");
    for (int i = 0; i < 15; i++) {
        assert_int_equal(td_pv_type_of(v), TD_PV_ARRAY);
        v = td_pv_at(v, 0);
    }
    assert_int_equal(td_pv_type_of(v), TD_PV_NIL);
    td_proto_frame_free(f);

    /* maps nest the same way: 17 nested {"a": ...} */
    for (int i = 0; i < 17; i++)
        memcpy(b + 3 * i,
               "\x81\xa1"
               "a",
               3);
    b[51] = 0xc0;
    expect_decode_error(b, 52, TD_E2BIG, "map nested deeper than 16 levels, at byte 48");
    free(b);
}

static void test_frame_size_limit(void **state)
{
    char *b = calloc(1, 2000000);
    td_proto_frame *f = (td_proto_frame *)1;
    td_error_t err = {0};

    assert_non_null(b);
    assert_int_equal(td_proto_decode(b, 2000000, &f, &err), TD_E2BIG);
    assert_null(f);
    assert_string_equal(err.msg, "frame of 2000000 bytes exceeds the limit of 1048576 bytes");
    free(b);
}

static void test_truncated_values(void **state)
{
    td_pw w;
    size_t len;
    static const char *msgs[] = {"truncated msgpack value at byte "};

    td_pw_init(&w);
    td_pw_map(&w, 3);
    td_pw_str(&w, "a");
    td_pw_int(&w, 100000);
    td_pw_str(&w, "b");
    td_pw_double(&w, 2.5);
    td_pw_str(&w, "c");
    td_pw_array(&w, 2);
    td_pw_str(&w, "hello");
    td_pw_bin(&w, "xyz", 3);
    const unsigned char *b = body_of(&w, &len);
    /* every proper prefix of a valid body is truncated */
    for (size_t cut = 0; cut < len; cut++)
        expect_decode_error_prefix(b, cut, TD_EPROTO, msgs[0]);
    expect_decode_error(b, 7, TD_EPROTO, "truncated msgpack value at byte 3");   /* in uint32 */
    expect_decode_error(b, 13, TD_EPROTO, "truncated msgpack value at byte 10"); /* the float */
    td_pw_free(&w);
}

static void test_trailing_bytes(void **state)
{
    expect_decode_error("\x80\x01\x02\x03", 4, TD_EPROTO, "3 bytes after the end of the value");
    expect_decode_error("\x81\xa1"
                        "a\x01\xc0",
                        5, TD_EPROTO, "1 byte after the end of the value");
}

static void test_top_level_not_a_map(void **state)
{
    expect_decode_error("\x92\x01\x02", 3, TD_EPROTO, "top-level value is an array, not a map");
    expect_decode_error("\x01", 1, TD_EPROTO, "top-level value is an integer, not a map");
    expect_decode_error("\xc0", 1, TD_EPROTO, "top-level value is nil, not a map");
    expect_decode_error("\xa1x", 2, TD_EPROTO, "top-level value is a string, not a map");
    expect_decode_error("\xcb\0\0\0\0\0\0\0\0", 9, TD_EPROTO,
                        "top-level value is a float, not a map");
    expect_decode_error("\xc3", 1, TD_EPROTO, "top-level value is a boolean, not a map");
    expect_decode_error("\xc4\x00", 2, TD_EPROTO, "top-level value is a binary, not a map");
    expect_decode_error("\xd4\x01\x00", 3, TD_EPROTO, "top-level value is an ext, not a map");
    expect_decode_error("", 0, TD_EPROTO, "truncated msgpack value at byte 0");
}

static void test_non_string_keys(void **state)
{
    expect_decode_error("\x81\x01\x02", 3, TD_EPROTO,
                        "map key at byte 1 is an integer, not a string");
    expect_decode_error("\x81\xa1"
                        "a\x81\x91\x01\x02",
                        7, TD_EPROTO, "map key at byte 4 is an array, not a string");
    expect_decode_error("\x82\xa1"
                        "a\x01\xc0\x02",
                        6, TD_EPROTO, "map key at byte 4 is nil, not a string");
    expect_decode_error("\x81\xc4\x01"
                        "a\x01",
                        5, TD_EPROTO, "map key at byte 1 is a binary, not a string");
    /* strings as values in arrays are fine; arrays hold anything */
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    assert_int_equal(td_proto_decode("\x81\xa1"
                                     "a\x92\x01\x80",
                                     6, &f, &err),
                     0);
    td_proto_frame_free(f);
}

static void test_invalid_type_byte(void **state)
{
    expect_decode_error("\x81\xa1"
                        "a\xc1",
                        4, TD_EPROTO, "invalid msgpack type byte 0xc1 at byte 3");
    expect_decode_error("\xc1", 1, TD_EPROTO, "invalid msgpack type byte 0xc1 at byte 0");
    expect_decode_error("\x81\xc1\x01", 3, TD_EPROTO, "invalid msgpack type byte 0xc1 at byte 1");
}

/* The frame owns a copy of the body; it outlives the caller's buffer. */
static void test_frame_body(void **state)
{
    char *b = malloc(6);
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    size_t len;
    char buf[8];

    assert_non_null(b);
    memcpy(b,
           "\x81\xa1"
           "k\xa1v",
           5);
    assert_int_equal(td_proto_decode(b, 5, &f, &err), 0);
    memset(b, 0, 5);
    free(b);
    const void *body = td_proto_frame_body(f, &len);
    assert_int_equal(len, 5);
    assert_memory_equal(body,
                        "\x81\xa1"
                        "k\xa1v",
                        5);
    assert_string_equal(str_of(td_pv_get(td_proto_frame_root(f), "k"), buf, sizeof(buf)), "v");
    td_proto_frame_free(f);
    td_proto_frame_free(NULL);
    assert_null(td_proto_frame_root(NULL));
    assert_null(td_proto_frame_body(NULL, &len));
    assert_int_equal(len, 0);
}

/* ---- accessors ---- */

/* Decodes a one-key map {"v": <value bytes>} and returns its frame. */
static td_proto_frame *one_value(const char *value, size_t n)
{
    char b[64] = "\x81\xa1v";
    td_proto_frame *f = NULL;
    td_error_t err = {0};

    assert_true(n + 3 <= sizeof(b));
    memcpy(b + 3, value, n);
    if (td_proto_decode(b, n + 3, &f, &err) != 0)
        fail_msg("decode: %s", err.msg);
    return f;
}

static void test_pv_int_conversions(void **state)
{
    static const struct {
        double d;
        int ok;
        int64_t want;
    } cases[] = {
        {3.0, 1, 3},
        {-7.0, 1, -7},
        {-0.0, 1, 0},
        {1e15, 1, 1000000000000000LL},
        {-9223372036854775808.0, 1, INT64_MIN},
        {3.5, 0, 0},
        {9223372036854775808.0, 0, 0},
        {1e19, 0, 0},
        {-1e19, 0, 0},
        {INFINITY, 0, 0},
        {NAN, 0, 0},
    };
    td_pw w;

    td_pw_init(&w);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int64_t got = 12345;
        td_pw_reset(&w);
        td_pw_map(&w, 1);
        td_pw_str(&w, "v");
        td_pw_double(&w, cases[i].d);
        td_proto_frame *f = decode_pw(&w);
        int rc = td_pv_int(td_pv_get(td_proto_frame_root(f), "v"), &got);
        if (cases[i].ok) {
            assert_int_equal(rc, 0);
            assert_true(got == cases[i].want);
        } else {
            assert_int_equal(rc, TD_EINVAL);
            assert_true(got == 12345);
        }
        td_proto_frame_free(f);
    }
    td_pw_free(&w);

    /* uint64 above INT64_MAX is not an int; INT64_MAX itself is */
    int64_t got;
    double d;
    td_proto_frame *f = one_value("\xcf\x80\x00\x00\x00\x00\x00\x00\x00", 9);
    const td_pval *v = td_pv_get(td_proto_frame_root(f), "v");
    assert_int_equal(td_pv_type_of(v), TD_PV_OTHER);
    assert_int_equal(td_pv_int(v, &got), TD_EINVAL);
    assert_int_equal(td_pv_double(v, &d), TD_EINVAL);
    td_proto_frame_free(f);
    f = one_value("\xcf\x7f\xff\xff\xff\xff\xff\xff\xff", 9);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "v"), &got), 0);
    assert_true(got == INT64_MAX);
    td_proto_frame_free(f);
    /* non-canonical encodings read the same: int8 -1, uint16 5 */
    f = one_value("\xd0\xff", 2);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "v"), &got), 0);
    assert_int_equal(got, -1);
    td_proto_frame_free(f);
    f = one_value("\xcd\x00\x05", 3);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "v"), &got), 0);
    assert_int_equal(got, 5);
    td_proto_frame_free(f);
    /* other types */
    f = one_value("\xa1"
                  "5",
                  2);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "v"), &got), TD_EINVAL);
    assert_int_equal(td_pv_double(td_pv_get(td_proto_frame_root(f), "v"), &d), TD_EINVAL);
    td_proto_frame_free(f);
}

static void test_pv_strcpy(void **state)
{
    char buf[6] = "zzzzz";
    td_proto_frame *f = one_value("\xa5hello", 6);
    const td_pval *v = td_pv_get(td_proto_frame_root(f), "v");

    assert_int_equal(td_pv_strcpy(v, buf, 6), 0);
    assert_string_equal(buf, "hello");
    assert_int_equal(td_pv_strcpy(v, buf, 5), TD_E2BIG);
    assert_string_equal(buf, "");
    assert_int_equal(td_pv_strcpy(v, NULL, 0), TD_E2BIG);
    td_proto_frame_free(f);

    f = one_value("\xa3"
                  "a\0b",
                  4);
    v = td_pv_get(td_proto_frame_root(f), "v");
    assert_int_equal(td_pv_strcpy(v, buf, sizeof(buf)), TD_EINVAL);
    td_proto_frame_free(f);

    f = one_value("\x05", 1);
    v = td_pv_get(td_proto_frame_root(f), "v");
    assert_int_equal(td_pv_strcpy(v, buf, sizeof(buf)), TD_EINVAL);
    td_proto_frame_free(f);
}

static void test_accessors_accept_null(void **state)
{
    int64_t i;
    double d;
    int b;
    size_t n = 99;
    char buf[4];

    assert_int_equal(td_pv_type_of(NULL), TD_PV_NIL);
    assert_null(td_pv_get(NULL, "x"));
    assert_int_equal(td_pv_int(NULL, &i), TD_EINVAL);
    assert_int_equal(td_pv_double(NULL, &d), TD_EINVAL);
    assert_int_equal(td_pv_bool(NULL, &b), TD_EINVAL);
    assert_null(td_pv_str(NULL, &n));
    assert_int_equal(n, 0);
    assert_int_equal(td_pv_strcpy(NULL, buf, sizeof(buf)), TD_EINVAL);
    assert_int_equal(td_pv_len(NULL), 0);
    assert_null(td_pv_at(NULL, 0));
    assert_null(td_pv_key_at(NULL, 0));
    assert_null(td_pv_val_at(NULL, 0));

    /* and values of the wrong type answer the same */
    td_proto_frame *f = one_value("\x92\x01\x02", 3);
    const td_pval *root = td_proto_frame_root(f);
    const td_pval *arr = td_pv_get(root, "v");
    assert_null(td_pv_get(arr, "x"));
    assert_null(td_pv_get(root, NULL));
    assert_null(td_pv_key_at(arr, 0));
    assert_null(td_pv_at(root, 0));
    assert_int_equal(td_pv_len(td_pv_at(arr, 0)), 0);
    td_proto_frame_free(f);

    /* a repeated key: the first counts */
    td_error_t err = {0};
    assert_int_equal(td_proto_decode("\x82\xa1k\x01\xa1k\x02", 7, &f, &err), 0);
    assert_int_equal(td_pv_int(td_pv_get(td_proto_frame_root(f), "k"), &i), 0);
    assert_int_equal(i, 1);
    td_proto_frame_free(f);
}

/* ---- JSON ---- */

/* JSON of the value under "v" in {"v": <bytes>}, compared with want. */
static void expect_json(const char *value, size_t n, const char *want)
{
    td_proto_frame *f = one_value(value, n);
    char *json = td_pv_to_json(td_pv_get(td_proto_frame_root(f), "v"));

    assert_non_null(json);
    assert_string_equal(json, want);
    free(json);
    td_proto_frame_free(f);
}

static void test_json_strings(void **state)
{
    expect_json("\xa0", 1, "\"\"");
    expect_json("\xa8q\"b\\s/x\x7f", 9, "\"q\\\"b\\\\s/x\x7f\"");
    expect_json("\xa5\n\t\x01\x1f\0", 6, "\"\\u000a\\u0009\\u0001\\u001f\\u0000\"");
    /* valid UTF-8 (2, 3 and 4 byte forms) passes through */
    expect_json("\xa8\xc3\xa9\xe2\x82\xac\xf0\x9f\x98", 9,
                "\"\xc3\xa9\xe2\x82\xac\\ufffd\\ufffd\\ufffd\"");
    expect_json("\xa9\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 10,
                "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"");
    /* invalid bytes: a lone continuation, 0xff, an overlong '/', a surrogate, > U+10FFFF */
    expect_json("\xa2\x80\xff", 3, "\"\\ufffd\\ufffd\"");
    expect_json("\xa3"
                "a\xc0\xaf",
                4, "\"a\\ufffd\\ufffd\"");
    expect_json("\xa3\xed\xa0\x80", 4, "\"\\ufffd\\ufffd\\ufffd\"");
    expect_json("\xa4\xf4\x90\x80\x80", 5, "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
    expect_json("\xa2\xc3"
                "a",
                3, "\"\\ufffda\"");
}

static void test_json_numbers_and_containers(void **state)
{
    expect_json("\x05", 1, "5");
    expect_json("\xff", 1, "-1");
    expect_json("\xcf\xff\xff\xff\xff\xff\xff\xff\xff", 9, "18446744073709551615");
    expect_json("\xd3\x80\0\0\0\0\0\0\0", 9, "-9223372036854775808");
    expect_json("\xcb\x3f\xf0\0\0\0\0\0\0", 9, "1.0");
    expect_json("\xcb\x3f\xe0\0\0\0\0\0\0", 9, "0.5");
    expect_json("\xcb\x3f\xb9\x99\x99\x99\x99\x99\x9a", 9, "0.10000000000000001");
    expect_json("\xcb\x7f\xf0\0\0\0\0\0\0", 9, "null"); /* +inf */
    expect_json("\xcb\xff\xf8\0\0\0\0\0\0", 9, "null"); /* NaN */
    expect_json("\xcb\x46\x29\x3e\x59\x39\xa0\x8c\xea", 9, "1e+30");
    expect_json("\xca\x3f\xc0\0\0", 5, "1.5");
    expect_json("\xc0", 1, "null");
    expect_json("\xc3", 1, "true");
    expect_json("\xc2", 1, "false");
    expect_json("\xc4\x03\x00\xab\xff", 5, "\"00abff\"");
    expect_json("\xd5\x01\xbe\xef", 4, "\"beef\"");
    expect_json("\x93\x01\x90\x80", 4, "[1,[],{}]");
    expect_json("\x82\xa1"
                "a\x91\xc0\xa1"
                "b\x81\xa1"
                "c\xa1"
                "d",
                12, "{\"a\":[null],\"b\":{\"c\":\"d\"}}");
    char *json = td_pv_to_json(NULL);
    assert_string_equal(json, "null");
    free(json);
}

/* Keys that are not strings (msgpack allows them; our frames do not, but a hand-built or
 * stored value may have them) become strings of their JSON text. */
static void test_json_non_string_keys(void **state)
{
    static const char raw[] = "\x84\x01\xa1"
                              "a\xc3\x02\x92\x01\xa1\"\x03\xc4\x01\x0f\x04";
    msgpack_zone zone;
    msgpack_object obj;
    size_t off = 0;

    assert_true(msgpack_zone_init(&zone, 1024));
    assert_int_equal(msgpack_unpack(raw, sizeof(raw) - 1, &off, &zone, &obj),
                     MSGPACK_UNPACK_SUCCESS);
    char *json = td_pv_to_json(&obj);
    assert_non_null(json);
    assert_string_equal(json,
                        "{\"1\":\"a\",\"true\":2,\"[1,\\\"\\\\\\\"\\\"]\":3,\"\\\"0f\\\"\":4}");
    free(json);
    msgpack_zone_destroy(&zone);
}

/* ---- fuzz ---- */

/* xorshift64*: a fixed seed gives the same run every time. */
typedef struct {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r)
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return r->s * 0x2545F4914F6CDD1DULL;
}

static size_t rng_below(rng *r, size_t n)
{
    return n == 0 ? 0 : (size_t)(rng_next(r) % n);
}

#define NSEEDS 5

/* Valid frame bodies to mutate: a hello, a submit with a nested job, rows, an error, and a
 * frame with every scalar type. Each is malloc'd into seeds[i] / lens[i]. */
static void make_seeds(char **seeds, size_t *lens)
{
    td_pw w;
    const void *b;
    size_t len;

    td_pw_init(&w);
    for (int i = 0; i < NSEEDS; i++) {
        td_pw_reset(&w);
        switch (i) {
        case 0:
            td_pw_map(&w, 4);
            td_pw_str(&w, "type");
            td_pw_str(&w, "hello");
            td_pw_str(&w, "id");
            td_pw_int(&w, 0);
            td_pw_str(&w, "version");
            td_pw_int(&w, 1);
            td_pw_str(&w, "client");
            td_pw_str(&w, "trainctl 0.1.0");
            break;
        case 1:
            td_pw_map(&w, 3);
            td_pw_str(&w, "type");
            td_pw_str(&w, "submit");
            td_pw_str(&w, "id");
            td_pw_int(&w, 7);
            td_pw_str(&w, "job");
            td_pw_map(&w, 4);
            td_pw_str(&w, "model");
            td_pw_map(&w, 2);
            td_pw_str(&w, "kind");
            td_pw_str(&w, "mlp");
            td_pw_str(&w, "layers");
            td_pw_array(&w, 3);
            td_pw_int(&w, 784);
            td_pw_int(&w, 128);
            td_pw_int(&w, 10);
            td_pw_str(&w, "lr");
            td_pw_double(&w, 3e-4);
            td_pw_str(&w, "batch_size");
            td_pw_int(&w, 64);
            td_pw_str(&w, "deep");
            for (int d = 0; d < 12; d++)
                td_pw_array(&w, 1);
            td_pw_map(&w, 0);
            break;
        case 2:
            td_pw_map(&w, 4);
            td_pw_str(&w, "type");
            td_pw_str(&w, "rows");
            td_pw_str(&w, "id");
            td_pw_int(&w, 3);
            td_pw_str(&w, "job_id");
            td_pw_int(&w, 17);
            td_pw_str(&w, "rows");
            td_pw_array(&w, 20);
            for (int r = 0; r < 20; r++) {
                td_pw_array(&w, 4);
                td_pw_str(&w, "train_loss");
                td_pw_int(&w, r * 1000);
                td_pw_double(&w, 2.3 / (r + 1));
                td_pw_double(&w, 1.7e9);
            }
            break;
        case 3:
            td_proto_write_error(&w, -1, TD_EPROTO, "bad frame");
            break;
        default:
            td_pw_map(&w, 8);
            td_pw_str(&w, "n");
            td_pw_nil(&w);
            td_pw_str(&w, "b");
            td_pw_bool(&w, 1);
            td_pw_str(&w, "i");
            td_pw_int(&w, -5000000000LL);
            td_pw_str(&w, "u");
            td_pw_int(&w, 70000);
            td_pw_str(&w, "s");
            td_pw_strn(&w, "0123456789012345678901234567890123456789", 40);
            td_pw_str(&w, "bin");
            td_pw_bin(&w, "\x01\x02\x03", 3);
            td_pw_str(&w, "ext");
            td_pw_raw(&w, "\xc7\x03\x01xyz", 6);
            td_pw_str(&w, "m16");
            td_pw_raw(&w, "\xde\x00\x01\xa1k\xdc\x00\x01\xc2", 9);
            break;
        }
        b = body_of(&w, &len);
        seeds[i] = malloc(len);
        assert_non_null(seeds[i]);
        memcpy(seeds[i], b, len);
        lens[i] = len;
    }
    td_pw_free(&w);
}

/* Bytes that make headers interesting when dropped in at random. */
static const unsigned char spicy[] = {0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0xd9, 0xda, 0xdb,
                                      0xc4, 0xc6, 0xc9, 0xd8, 0x91, 0x81, 0xff, 0x00};

/* Mutates buf (len bytes, room for cap) in place 1 to 4 times; returns the new length. */
static size_t mutate(rng *r, unsigned char *buf, size_t len, size_t cap)
{
    int times = 1 + (int)rng_below(r, 4);

    for (int t = 0; t < times; t++) {
        switch (rng_below(r, 6)) {
        case 0: /* flip a bit */
            if (len > 0)
                buf[rng_below(r, len)] ^= (unsigned char)(1u << rng_below(r, 8));
            break;
        case 1: /* truncate */
            len = rng_below(r, len + 1);
            break;
        case 2: /* insert a random byte */
            if (len < cap) {
                size_t at = rng_below(r, len + 1);
                memmove(buf + at + 1, buf + at, len - at);
                buf[at] = (unsigned char)rng_next(r);
                len++;
            }
            break;
        case 3: /* overwrite with a header byte */
            if (len > 0)
                buf[rng_below(r, len)] = spicy[rng_below(r, sizeof(spicy))];
            break;
        case 4: /* a big length after a header byte */
            if (len > 5) {
                size_t at = rng_below(r, len - 4);
                buf[at] = spicy[rng_below(r, sizeof(spicy))];
                for (int k = 1; k <= 4; k++)
                    buf[at + k] = (unsigned char)(rng_below(r, 2) ? 0xff : rng_next(r));
            }
            break;
        default: /* delete a byte */
            if (len > 0) {
                size_t at = rng_below(r, len);
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
            }
            break;
        }
    }
    return len;
}

/* A decode result is either a map root (which must re-encode and render as JSON) or an
 * EPROTO/E2BIG error with a message. */
static void check_result(int rc, td_proto_frame *f, const td_error_t *err, td_pw *w)
{
    if (rc == 0 || rc == 1) {
        assert_non_null(f);
        const td_pval *root = td_proto_frame_root(f);
        assert_int_equal(td_pv_type_of(root), TD_PV_MAP);
        for (size_t i = 0; i < td_pv_len(root); i++)
            assert_int_equal(td_pv_type_of(td_pv_key_at(root, i)), TD_PV_STR);
        /* writing it back and decoding again gives a map with as many pairs */
        td_pw_reset(w);
        td_pw_val(w, root);
        td_proto_frame *g = decode_pw(w);
        assert_int_equal(td_pv_len(td_proto_frame_root(g)), td_pv_len(root));
        td_proto_frame_free(g);
        char *json = td_pv_to_json(root);
        assert_non_null(json);
        assert_true(json[0] == '{');
        free(json);
        return;
    }
    assert_null(f);
    if (rc != TD_EPROTO && rc != TD_E2BIG)
        fail_msg("unexpected code %d: %s", rc, err->msg);
    assert_int_equal(err->code, rc);
    assert_true(err->msg[0] != '\0');
    /* the validator, not msgpack-c, must be the one that refused it */
    assert_null(strstr(err->msg, "msgpack-c"));
}

static void test_fuzz_decode(void **state)
{
    char *seeds[NSEEDS];
    size_t lens[NSEEDS];
    rng r = {FUZZ_SEED};
    size_t cap = 4096;
    unsigned char *buf = malloc(cap);
    td_pw w;
    int ok = 0, failed = 0;

    assert_non_null(buf);
    make_seeds(seeds, lens);
    td_pw_init(&w);
    for (int it = 0; it < FUZZ_ITERATIONS; it++) {
        size_t s = rng_below(&r, NSEEDS);
        assert_true(lens[s] < cap);
        memcpy(buf, seeds[s], lens[s]);
        size_t len = mutate(&r, buf, lens[s], cap);
        td_proto_frame *f = NULL;
        td_error_t err = {0};
        int rc = td_proto_decode(buf, len, &f, &err);
        check_result(rc, f, &err, &w);
        if (rc == 0)
            ok++;
        else
            failed++;
        td_proto_frame_free(f);
    }
    /* the mutations must reach both outcomes, or the loop tests little */
    assert_true(ok > FUZZ_ITERATIONS / 50);
    assert_true(failed > FUZZ_ITERATIONS / 2);
    for (int i = 0; i < NSEEDS; i++)
        free(seeds[i]);
    td_pw_free(&w);
    free(buf);
}

/* Streams of mutated frames behind true, nearly true and random length prefixes, fed in
 * random pieces to readers with random limits. */
static void test_fuzz_reader(void **state)
{
    char *seeds[NSEEDS];
    size_t lens[NSEEDS];
    rng r = {FUZZ_SEED + 1};
    size_t cap = 1 << 16;
    unsigned char *stream = malloc(cap);
    unsigned char body[4096];
    td_pw w;
    int frames = 0, errors = 0;

    assert_non_null(stream);
    make_seeds(seeds, lens);
    td_pw_init(&w);
    for (int it = 0; it < FUZZ_ITERATIONS / 10; it++) {
        td_proto_reader *rd;
        uint32_t max = rng_below(&r, 4) == 0 ? (uint32_t)(50 + rng_below(&r, 500)) : 0;
        size_t len = 0;

        assert_int_equal(td_proto_reader_new(&rd, max), 0);
        for (int k = 0; k < 10; k++) {
            size_t s = rng_below(&r, NSEEDS);
            memcpy(body, seeds[s], lens[s]);
            size_t blen = rng_below(&r, 3) == 0 ? mutate(&r, body, lens[s], sizeof(body)) : lens[s];
            uint32_t prefix = (uint32_t)blen;
            switch (rng_below(&r, 10)) {
            case 0:
                prefix = (uint32_t)rng_next(&r);
                break;
            case 1:
                prefix += (uint32_t)rng_below(&r, 5) - 2;
                break;
            default:
                break;
            }
            unsigned char p[4] = {prefix >> 24, prefix >> 16, prefix >> 8, prefix};
            memcpy(stream + len, p, 4);
            memcpy(stream + len + 4, body, blen);
            len += 4 + blen;
        }
        for (size_t off = 0; off < len;) {
            size_t n = 1 + rng_below(&r, 300);
            n = n < len - off ? n : len - off;
            assert_int_equal(td_proto_reader_feed(rd, stream + off, n), 0);
            off += n;
            int rc;
            do {
                td_proto_frame *f = NULL;
                td_error_t err = {0};
                rc = td_proto_reader_next(rd, &f, &err);
                if (rc != 0)
                    check_result(rc, f, &err, &w);
                if (rc == 1)
                    frames++;
                else if (rc < 0)
                    errors++;
                td_proto_frame_free(f);
            } while (rc == 1);
            if (rc < 0)
                break; /* the stream is dead, as a daemon would close it */
        }
        td_proto_reader_free(rd);
    }
    assert_true(frames > 0);
    assert_true(errors > 0);
    for (int i = 0; i < NSEEDS; i++)
        free(seeds[i]);
    td_pw_free(&w);
    free(stream);
}

int main(void)
{
    const struct CMUnitTest writer[] = {
        cmocka_unit_test(test_ints_round_trip),
        cmocka_unit_test(test_int_encodings_are_smallest),
        cmocka_unit_test(test_doubles_bools_nil_round_trip),
        cmocka_unit_test(test_strings_and_bin_round_trip),
        cmocka_unit_test(test_nested_round_trip),
        cmocka_unit_test(test_raw_and_val),
        cmocka_unit_test(test_counted_map_is_counted_by_the_writer),
        cmocka_unit_test(test_counted_map_takes_the_smallest_header),
        cmocka_unit_test(test_counted_map_misuse_fails_the_frame),
        cmocka_unit_test(test_array_raw_is_one_value),
        cmocka_unit_test(test_val_of_other_types),
        cmocka_unit_test(test_hand_built_deep_tree),
        cmocka_unit_test(test_oversized_string),
        cmocka_unit_test(test_finish_prefix_and_limits),
        cmocka_unit_test(test_write_error),
        cmocka_unit_test(test_dry_run_round_trip),
    };
    const struct CMUnitTest reader[] = {
        cmocka_unit_test(test_reader_one_byte_at_a_time),
        cmocka_unit_test(test_reader_many_frames_per_feed),
        cmocka_unit_test(test_reader_rejects_huge_prefix_at_once),
        cmocka_unit_test(test_reader_bad_body),
        cmocka_unit_test(test_reader_limits_the_first_frame),
        cmocka_unit_test(test_write_error_escapes),
        cmocka_unit_test(test_frame_body),
    };
    const struct CMUnitTest limits[] = {
        cmocka_unit_test(test_hostile_array_header),   cmocka_unit_test(test_hostile_map_header),
        cmocka_unit_test(test_hostile_string_lengths), cmocka_unit_test(test_depth_bomb),
        cmocka_unit_test(test_frame_size_limit),       cmocka_unit_test(test_truncated_values),
        cmocka_unit_test(test_trailing_bytes),         cmocka_unit_test(test_top_level_not_a_map),
        cmocka_unit_test(test_non_string_keys),        cmocka_unit_test(test_invalid_type_byte),
    };
    const struct CMUnitTest accessors[] = {
        cmocka_unit_test(test_pv_int_conversions),
        cmocka_unit_test(test_pv_strcpy),
        cmocka_unit_test(test_accessors_accept_null),
    };
    const struct CMUnitTest json[] = {
        cmocka_unit_test(test_json_strings),
        cmocka_unit_test(test_json_numbers_and_containers),
        cmocka_unit_test(test_json_non_string_keys),
    };
    const struct CMUnitTest fuzz[] = {
        cmocka_unit_test(test_fuzz_decode),
        cmocka_unit_test(test_fuzz_reader),
    };
    int failed = 0;

    failed += cmocka_run_group_tests_name("proto_writer", writer, NULL, NULL);
    failed += cmocka_run_group_tests_name("proto_reader", reader, NULL, NULL);
    failed += cmocka_run_group_tests_name("proto_limits", limits, NULL, NULL);
    failed += cmocka_run_group_tests_name("proto_accessors", accessors, NULL, NULL);
    failed += cmocka_run_group_tests_name("proto_json", json, NULL, NULL);
    failed += cmocka_run_group_tests_name("proto_fuzz", fuzz, NULL, NULL);
    return failed == 0 ? 0 : 1;
}
