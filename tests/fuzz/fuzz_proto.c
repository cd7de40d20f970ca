/* libFuzzer target: the frame reader and every accessor (proto.h).
 *
 * Input: one byte of settings (bit 0: a small first-frame limit, as a server sets for a hello;
 * bits 1-2: the reader's frame limit), four bytes seeding the chunking, then the byte stream.
 * The stream is fed to a reader in chunks of random sizes, every frame taken after each feed,
 * and the same stream is fed whole to a second reader: both must give the same frames and end
 * in the same error, however the bytes arrived. Every frame's tree is walked with every
 * accessor, each checked against the others (a value that reads as an integer reads as the
 * same double, td_pv_get finds the first pair with that key, ...), and written back out with
 * td_pw_val: that must decode again and write back out to the same bytes. */
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "proto/proto.h"

#define GET_CHECKED_PAIRS 64 /* pairs of a map whose key td_pv_get looks up (it is linear) */

/* What a reader made of a stream: the frames' count and a hash of their bodies, and the error
 * it ended with. */
typedef struct outcome {
    size_t frames;
    uint64_t hash;
    td_error_t err;
} outcome;

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;

    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static uint32_t next_rand(uint32_t *s)
{
    /* xorshift32; a zero state stays zero, so it never starts at zero */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static void walk(const td_pval *v, int depth);

/* The string accessors of v, whose type is t. */
static void check_str(const td_pval *v, td_pv_type t)
{
    size_t len = 99;
    const char *s = td_pv_str(v, &len);
    char small[4], *big;
    int rc;

    if (t != TD_PV_STR) {
        TDF_CHECK(s == NULL && len == 0);
        TDF_CHECK(td_pv_strcpy(v, small, sizeof(small)) == TD_EINVAL && small[0] == '\0');
        return;
    }
    TDF_CHECK(s != NULL);
    big = malloc(len + 1);
    TDF_CHECK(big != NULL);
    rc = td_pv_strcpy(v, big, len + 1);
    if (memchr(s, '\0', len) != NULL) {
        TDF_CHECK(rc == TD_EINVAL && big[0] == '\0');
    } else {
        TDF_CHECK(rc == 0 && memcmp(big, s, len) == 0 && big[len] == '\0');
        if (len > 0)
            TDF_CHECK(td_pv_strcpy(v, big, len) == TD_E2BIG && big[0] == '\0');
    }
    TDF_CHECK(td_pv_strcpy(v, NULL, 0) == (rc == 0 ? TD_E2BIG : TD_EINVAL));
    free(big);
}

/* The number and boolean accessors of v, whose type is t. */
static void check_scalars(const td_pval *v, td_pv_type t)
{
    int64_t i = 0;
    double d = 0;
    int b = -1;
    int ri = td_pv_int(v, &i), rd = td_pv_double(v, &d), rb = td_pv_bool(v, &b);

    TDF_CHECK(ri == 0 || ri == TD_EINVAL);
    TDF_CHECK((rd == 0) == (t == TD_PV_INT || t == TD_PV_FLOAT));
    TDF_CHECK((rb == 0) == (t == TD_PV_BOOL));
    TDF_CHECK(rb != 0 || b == 0 || b == 1);
    if (t == TD_PV_INT)
        TDF_CHECK(ri == 0 && (double)i == d);
    else if (t == TD_PV_FLOAT)
        TDF_CHECK(ri != 0 || (double)i == d);
    else
        TDF_CHECK(ri != 0);
}

/* The pairs of map m: keys are strings, and td_pv_get finds each key's first pair. */
static void walk_map(const td_pval *m, size_t n, int depth)
{
    for (size_t i = 0; i < n; i++) {
        const td_pval *k = td_pv_key_at(m, i), *val = td_pv_val_at(m, i);
        size_t klen;
        const char *ks = td_pv_str(k, &klen);
        TDF_CHECK(k != NULL && val != NULL && ks != NULL);
        walk(k, depth + 1);
        walk(val, depth + 1);
        if (i < GET_CHECKED_PAIRS && memchr(ks, '\0', klen) == NULL) {
            char *key = strndup(ks, klen);
            const td_pval *first = NULL;
            TDF_CHECK(key != NULL);
            for (size_t j = 0; j <= i && first == NULL; j++) {
                size_t jlen;
                const char *js = td_pv_str(td_pv_key_at(m, j), &jlen);
                if (jlen == klen && memcmp(js, ks, klen) == 0)
                    first = td_pv_val_at(m, j);
            }
            TDF_CHECK(td_pv_get(m, key) == first);
            free(key);
        }
    }
    TDF_CHECK(td_pv_key_at(m, n) == NULL && td_pv_val_at(m, n) == NULL && td_pv_at(m, 0) == NULL);
}

/* Every accessor on v and, recursively, on everything in it. */
static void walk(const td_pval *v, int depth)
{
    td_pv_type t = td_pv_type_of(v);
    size_t n = td_pv_len(v);

    TDF_CHECK(v != NULL && depth <= TD_PROTO_MAX_DEPTH + 1);
    TDF_CHECK(t >= TD_PV_NIL && t <= TD_PV_OTHER);
    check_scalars(v, t);
    check_str(v, t);
    TDF_CHECK(t == TD_PV_ARRAY || t == TD_PV_MAP || n == 0);
    if (t != TD_PV_MAP)
        TDF_CHECK(td_pv_get(v, "type") == NULL && td_pv_key_at(v, 0) == NULL);
    if (t == TD_PV_ARRAY) {
        for (size_t i = 0; i < n; i++) {
            const td_pval *e = td_pv_at(v, i);
            TDF_CHECK(e != NULL);
            walk(e, depth + 1);
        }
        TDF_CHECK(td_pv_at(v, n) == NULL && td_pv_val_at(v, 0) == NULL);
    } else if (t == TD_PV_MAP) {
        walk_map(v, n, depth);
    }
}

/* Writes the tree back out: it must decode, and write out again to the same bytes. */
static void check_rewrite(const td_pval *root)
{
    td_pw w1, w2;
    const char *f1, *f2;
    size_t n1, n2;
    td_proto_frame *again = NULL;
    td_error_t err;

    td_pw_init(&w1);
    td_pw_init(&w2);
    td_pw_val(&w1, root);
    /* A float32 is written back as a float64: a frame of them can outgrow the limit. */
    if (td_pw_finish(&w1, &f1, &n1) == 0) {
        TDF_CHECK(td_proto_decode(f1 + TD_PROTO_PREFIX, n1 - TD_PROTO_PREFIX, &again, &err) == 0);
        td_pw_val(&w2, td_proto_frame_root(again));
        TDF_CHECK(td_pw_finish(&w2, &f2, &n2) == 0);
        TDF_CHECK(n1 == n2 && memcmp(f1, f2, n1) == 0);
    }
    td_proto_frame_free(again);
    td_pw_free(&w1);
    td_pw_free(&w2);
}

/* A frame the reader gave: its tree, its body, and the body decoded again on its own. */
static void check_frame(td_proto_frame *f, outcome *o)
{
    const td_pval *root = td_proto_frame_root(f);
    size_t len;
    const void *body = td_proto_frame_body(f, &len);
    td_proto_frame *alone = NULL;
    td_error_t err;

    TDF_CHECK(td_pv_type_of(root) == TD_PV_MAP && body != NULL);
    walk(root, 1);
    TDF_CHECK(td_proto_decode(body, len, &alone, &err) == 0);
    td_proto_frame_free(alone);
    check_rewrite(root);
    o->frames++;
    o->hash = fnv(fnv(o->hash, &len, sizeof(len)), body, len);
}

/* Takes every complete frame; returns the error the stream ended with, or 0. */
static int drain(td_proto_reader *r, outcome *o)
{
    for (;;) {
        td_proto_frame *f;
        int rc = td_proto_reader_next(r, &f, &o->err);
        if (rc <= 0) {
            TDF_CHECK(f == NULL);
            TDF_CHECK(rc == 0 || rc == o->err.code);
            return rc;
        }
        check_frame(f, o);
        td_proto_frame_free(f);
    }
}

/* A reader with the input's limits. */
static td_proto_reader *reader(uint8_t settings)
{
    static const uint32_t limits[4] = {0, 64, 300, 4096}; /* bytes; 0: TD_PROTO_MAX_FRAME */
    td_proto_reader *r;

    TDF_CHECK(td_proto_reader_new(&r, limits[(settings >> 1) & 3]) == 0);
    if (settings & 1)
        td_proto_reader_limit_first(r, 32);
    return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tdf_in in = {data, size};
    uint8_t settings = tdf_u8(&in);
    uint32_t seed = tdf_u32(&in) | 1;
    td_proto_reader *chunked = reader(settings), *whole = reader(settings);
    outcome a = {0}, b = {0};
    int rc_a = 0, rc_b;
    size_t off = 0;

    while (off < in.n) {
        uint32_t r = next_rand(&seed);
        /* mostly small pieces, now and then up to everything left */
        size_t take = r % 4 == 0 ? r % (in.n - off) + 1 : r % 16 + 1;
        if (take > in.n - off)
            take = in.n - off;
        TDF_CHECK(td_proto_reader_feed(chunked, in.p + off, take) == 0);
        off += take;
        rc_a = drain(chunked, &a);
        if (rc_a < 0)
            break;
    }
    TDF_CHECK(td_proto_reader_feed(whole, in.p, in.n) == 0);
    rc_b = drain(whole, &b);
    /* A dead stream stays dead: more bytes change nothing. */
    if (rc_a < 0) {
        td_proto_frame *f;
        TDF_CHECK(td_proto_reader_feed(chunked, "\0\0\0\1\x80", 5) == 0);
        TDF_CHECK(td_proto_reader_next(chunked, &f, NULL) == rc_a && f == NULL);
    }
    TDF_CHECK(rc_a == rc_b && a.frames == b.frames && a.hash == b.hash);
    TDF_CHECK(strcmp(a.err.msg, b.err.msg) == 0);
    TDF_CHECK(td_pv_type_of(NULL) == TD_PV_NIL && td_pv_len(NULL) == 0);
    td_proto_reader_free(chunked);
    td_proto_reader_free(whole);
    return 0;
}
