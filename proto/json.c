/* td_pv_to_json: renders a decoded msgpack value as JSON text, for the readable copy of a job
 * spec kept in SQLite. Owns nothing beyond the string it returns; any thread may call it. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "proto/proto.h"

/* Levels followed before a deeper value is written as null: a decoded value is at most
 * TD_PROTO_MAX_DEPTH deep, so this only guards the stack against a hand-built tree. */
#define JSON_MAX_DEPTH 64

/* A growable string; failed is set on the first allocation failure and sticks. */
typedef struct {
    char *p;
    size_t len, cap;
    bool failed;
} jbuf;

/* Makes room for n more bytes plus the terminating NUL. */
static bool jb_room(jbuf *b, size_t n)
{
    size_t cap;
    char *np;

    if (b->failed)
        return false;
    if (b->cap - b->len > n)
        return true;
    if (b->len + n + 1 < b->len) {
        b->failed = true;
        return false;
    }
    cap = b->cap < 64 ? 64 : b->cap;
    while (cap <= b->len + n)
        cap = cap > SIZE_MAX / 2 ? b->len + n + 1 : cap * 2;
    np = realloc(b->p, cap);
    if (np == NULL) {
        b->failed = true;
        return false;
    }
    b->p = np;
    b->cap = cap;
    return true;
}

/* Appends n bytes and keeps the text NUL-terminated. */
static void jb_put(jbuf *b, const char *s, size_t n)
{
    if (n == 0 || !jb_room(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void jb_puts(jbuf *b, const char *s)
{
    jb_put(b, s, strlen(s));
}

/* Length of the valid UTF-8 sequence at s (n bytes available), or 0 when the bytes there
 * are not one: overlong forms, surrogates and code points above U+10FFFF are invalid. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t need;
    unsigned lo = 0x80, hi = 0xbf; /* allowed range of the second byte */

    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf) {
        need = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        if (c == 0xe0)
            lo = 0xa0; /* overlong */
        else if (c == 0xed)
            hi = 0x9f; /* surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        if (c == 0xf0)
            lo = 0x90; /* overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* above U+10FFFF */
    } else {
        return 0;
    }
    if (n < need || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t i = 2; i < need; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    return need;
}

/* Appends s as a JSON string: quote and backslash escaped, control characters as \u00XX,
 * valid UTF-8 as is, and each byte that does not begin a valid sequence as \ufffd. */
static void jb_string(jbuf *b, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;

    jb_put(b, "\"", 1);
    while (i < n) {
        size_t run = i;
        size_t k;
        char esc[8];

        /* Copy the longest stretch that needs no escape in one go. */
        while (run < n && u[run] >= 0x20 && u[run] != '"' && u[run] != '\\' &&
               (k = utf8_len(u + run, n - run)) > 0)
            run += k;
        jb_put(b, s + i, run - i);
        i = run;
        if (i >= n)
            break;
        if (u[i] == '"' || u[i] == '\\') {
            esc[0] = '\\';
            esc[1] = (char)u[i];
            jb_put(b, esc, 2);
        } else if (u[i] < 0x20) {
            snprintf(esc, sizeof(esc), "\\u%04x", u[i]);
            jb_put(b, esc, 6);
        } else {
            jb_put(b, "\\ufffd", 6);
        }
        i++;
    }
    jb_put(b, "\"", 1);
}

/* Appends bytes as a JSON string of lowercase hex digits. */
static void jb_hex(jbuf *b, const char *p, size_t n)
{
    static const char digits[] = "0123456789abcdef";

    jb_put(b, "\"", 1);
    for (size_t i = 0; i < n && !b->failed; i++) {
        char two[2] = {digits[(unsigned char)p[i] >> 4], digits[(unsigned char)p[i] & 15]};
        jb_put(b, two, 2);
    }
    jb_put(b, "\"", 1);
}

/* Appends a double as a JSON number that reads back as the same double: "%.17g", with ".0"
 * added to whole values so they stay floats, and null for NaN and the infinities (JSON has
 * none). A locale's decimal comma becomes a point. */
static void jb_double(jbuf *b, double d)
{
    char num[40];

    if (d != d || d > 1.7976931348623157e308 || d < -1.7976931348623157e308) {
        jb_puts(b, "null");
        return;
    }
    snprintf(num, sizeof(num), "%.17g", d);
    for (char *c = num; *c != '\0'; c++)
        if (*c == ',')
            *c = '.';
    if (strpbrk(num, ".e") == NULL)
        strcat(num, ".0");
    jb_puts(b, num);
}

static void jb_value(jbuf *b, const td_pval *v, int depth);

/* Appends a map key: a string as itself, anything else as a JSON string of its JSON text. */
static void jb_key(jbuf *b, const td_pval *k, int depth)
{
    jbuf inner = {0};

    if (k->type == MSGPACK_OBJECT_STR) {
        jb_string(b, k->via.str.ptr, k->via.str.size);
        return;
    }
    jb_value(&inner, k, depth);
    if (inner.failed)
        b->failed = true;
    else
        jb_string(b, inner.p, inner.len);
    free(inner.p);
}

/* Appends v as JSON; depth counts the containers around it. */
static void jb_value(jbuf *b, const td_pval *v, int depth)
{
    char num[32];

    if (v == NULL || depth > JSON_MAX_DEPTH) {
        jb_puts(b, "null");
        return;
    }
    switch (v->type) {
    case MSGPACK_OBJECT_BOOLEAN:
        jb_puts(b, v->via.boolean ? "true" : "false");
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        snprintf(num, sizeof(num), "%llu", (unsigned long long)v->via.u64);
        jb_puts(b, num);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        snprintf(num, sizeof(num), "%lld", (long long)v->via.i64);
        jb_puts(b, num);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        jb_double(b, v->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        jb_string(b, v->via.str.ptr, v->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        jb_hex(b, v->via.bin.ptr, v->via.bin.size);
        break;
    case MSGPACK_OBJECT_EXT:
        jb_hex(b, v->via.ext.ptr, v->via.ext.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        jb_put(b, "[", 1);
        for (uint32_t i = 0; i < v->via.array.size && !b->failed; i++) {
            if (i > 0)
                jb_put(b, ",", 1);
            jb_value(b, &v->via.array.ptr[i], depth + 1);
        }
        jb_put(b, "]", 1);
        break;
    case MSGPACK_OBJECT_MAP:
        jb_put(b, "{", 1);
        for (uint32_t i = 0; i < v->via.map.size && !b->failed; i++) {
            if (i > 0)
                jb_put(b, ",", 1);
            jb_key(b, &v->via.map.ptr[i].key, depth + 1);
            jb_put(b, ":", 1);
            jb_value(b, &v->via.map.ptr[i].val, depth + 1);
        }
        jb_put(b, "}", 1);
        break;
    default: /* nil */
        jb_puts(b, "null");
        break;
    }
}

char *td_pv_to_json(const td_pval *v)
{
    jbuf b = {0};

    jb_value(&b, v, 1);
    if (b.failed) {
        free(b.p);
        b.p = NULL;
    }
    return b.p;
}
