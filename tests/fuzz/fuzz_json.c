/* libFuzzer target: td_pv_to_json (proto/json.c), the readable copy of a job spec.
 *
 * Input: one frame body. Whatever the frame holds, its JSON must be text that a JSON parser
 * (jansson) reads back, and what it reads must be the frame's tree: nil as null, integers and
 * finite floats as the same numbers (floats as reals), non-finite floats as null, strings as
 * the same bytes with each byte that does not start valid UTF-8 as U+FFFD, bins and exts as
 * lowercase hex, maps as objects whose keys are the strings thus rendered (the last pair of a
 * repeated key counts, as jansson keeps it). The only text jansson may refuse is an integer
 * above INT64_MAX, which it cannot hold, or a NUL byte in a key, which it does not take. The
 * UTF-8 check here is written apart from json.c's, so the two check each other. */
#include <jansson.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "proto/proto.h"

/* Bytes of a valid UTF-8 sequence at s (n available), or 0: RFC 3629's well-formed forms. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    uint32_t cp;
    size_t len;

    if (s[0] < 0x80)
        return 1;
    if ((s[0] & 0xe0) == 0xc0) {
        len = 2;
        cp = s[0] & 0x1f;
    } else if ((s[0] & 0xf0) == 0xe0) {
        len = 3;
        cp = s[0] & 0x0f;
    } else if ((s[0] & 0xf8) == 0xf0) {
        len = 4;
        cp = s[0] & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000))
        return 0; /* overlong */
    if ((cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
        return 0;
    return len;
}

/* The bytes the JSON string of s (n bytes) reads back as: a malloc'd copy with each byte that
 * does not start a valid sequence replaced by U+FFFD; its length in *out_len. */
static char *expected_text(const char *s, size_t n, size_t *out_len)
{
    const unsigned char *u = (const unsigned char *)s;
    char *out = malloc(3 * n + 1);
    size_t o = 0;

    TDF_CHECK(out != NULL);
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(u + i, n - i);
        if (k == 0) {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        } else {
            memcpy(out + o, s + i, k);
            o += k;
            i += k;
        }
    }
    *out_len = o;
    return out;
}

static void check_value(const msgpack_object *v, const json_t *j);

static void check_string(const char *s, size_t n, const json_t *j)
{
    size_t len;
    char *want = expected_text(s, n, &len);

    TDF_CHECK(json_is_string(j));
    TDF_CHECK(json_string_length(j) == len && memcmp(json_string_value(j), want, len) == 0);
    free(want);
}

static void check_hex(const char *p, size_t n, const json_t *j)
{
    static const char digits[] = "0123456789abcdef";
    const char *h;

    TDF_CHECK(json_is_string(j) && json_string_length(j) == 2 * n);
    h = json_string_value(j);
    for (size_t i = 0; i < n; i++)
        TDF_CHECK(h[2 * i] == digits[(unsigned char)p[i] >> 4] &&
                  h[2 * i + 1] == digits[(unsigned char)p[i] & 15]);
}

/* One map key as rendered, and where its pair is. */
typedef struct rkey {
    char *s;
    size_t len;
    uint32_t at;
} rkey;

static int cmp_rkey(const void *a, const void *b)
{
    const rkey *x = a, *y = b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->s, y->s, n);

    if (c != 0)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at;
}

static void check_map(const msgpack_object *v, const json_t *j)
{
    uint32_t n = v->via.map.size;
    rkey *keys = malloc((n + 1) * sizeof(*keys));
    size_t distinct = 0;

    TDF_CHECK(json_is_object(j) && keys != NULL);
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *k = &v->via.map.ptr[i].key;
        TDF_CHECK(k->type == MSGPACK_OBJECT_STR); /* the reader takes string keys only */
        keys[i].s = expected_text(k->via.str.ptr, k->via.str.size, &keys[i].len);
        keys[i].at = i;
    }
    qsort(keys, n, sizeof(*keys), cmp_rkey);
    for (uint32_t i = 0; i < n; i++) {
        /* the last pair of each rendered key: the one jansson kept */
        if (i + 1 < n && keys[i + 1].len == keys[i].len &&
            memcmp(keys[i + 1].s, keys[i].s, keys[i].len) == 0)
            continue;
        distinct++;
        check_value(&v->via.map.ptr[keys[i].at].val, json_object_getn(j, keys[i].s, keys[i].len));
    }
    TDF_CHECK(json_object_size(j) == distinct);
    for (uint32_t i = 0; i < n; i++)
        free(keys[i].s);
    free(keys);
}

static void check_value(const msgpack_object *v, const json_t *j)
{
    TDF_CHECK(j != NULL);
    switch (v->type) {
    case MSGPACK_OBJECT_NIL:
        TDF_CHECK(json_is_null(j));
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        TDF_CHECK(v->via.boolean ? json_is_true(j) : json_is_false(j));
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        TDF_CHECK(json_is_integer(j) && v->via.u64 <= INT64_MAX &&
                  json_integer_value(j) == (json_int_t)v->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        TDF_CHECK(json_is_integer(j) && json_integer_value(j) == v->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (v->via.f64 - v->via.f64 != 0) /* NaN or an infinity */
            TDF_CHECK(json_is_null(j));
        else
            TDF_CHECK(json_is_real(j) && json_real_value(j) == v->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        check_string(v->via.str.ptr, v->via.str.size, j);
        break;
    case MSGPACK_OBJECT_BIN:
        check_hex(v->via.bin.ptr, v->via.bin.size, j);
        break;
    case MSGPACK_OBJECT_EXT:
        check_hex(v->via.ext.ptr, v->via.ext.size, j);
        break;
    case MSGPACK_OBJECT_ARRAY:
        TDF_CHECK(json_is_array(j) && json_array_size(j) == v->via.array.size);
        for (uint32_t i = 0; i < v->via.array.size; i++)
            check_value(&v->via.array.ptr[i], json_array_get(j, i));
        break;
    case MSGPACK_OBJECT_MAP:
        check_map(v, j);
        break;
    default:
        TDF_CHECK(!"a type msgpack-c does not have");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    td_proto_frame *f;
    td_error_t err;
    json_error_t jerr;
    json_t *j;
    char *text;

    if (td_proto_decode(data, size, &f, &err) != 0)
        return 0;
    text = td_pv_to_json(td_proto_frame_root(f));
    TDF_CHECK(text != NULL);
    j = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    if (j == NULL) {
        if (strstr(jerr.text, "too big") == NULL &&
            strstr(jerr.text, "NUL byte in object key") == NULL) {
            fprintf(stderr, "jansson: %s at byte %d of %.300s\n", jerr.text, jerr.position, text);
            TDF_CHECK(!"jansson reads the JSON back");
        }
    } else {
        check_value(td_proto_frame_root(f), j);
        json_decref(j);
    }
    free(text);
    text = td_pv_to_json(NULL);
    TDF_CHECK(text != NULL && strcmp(text, "null") == 0);
    free(text);
    td_proto_frame_free(f);
    return 0;
}
