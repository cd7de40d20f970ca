/* The wire protocol's frame codec: a reader that cuts a byte stream into length-prefixed
 * frames, a validator that walks a frame body's msgpack bytes and checks every number a peer
 * supplied against the limits in proto.h before msgpack-c sees them, the read-only accessors
 * over a decoded frame, and the writer. No global state; each reader and writer belongs to
 * one thread at a time. td_pv_to_json lives in json.c. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "proto/proto.h"
#include "common/td_text.h"

/* A zone chunk never smaller or larger than these, so a small frame does not pay for a
 * large chunk and a large one does not make thousands of tiny ones. */
#define ZONE_CHUNK_MIN   512  /* bytes */
#define ZONE_CHUNK_MAX   8192 /* bytes */
#define READER_MIN_CAP   4096 /* bytes: first allocation of a reader's buffer */
#define WRITER_MIN_CAP   256  /* bytes: first allocation of a writer's buffer */
#define PW_VAL_MAX_DEPTH 64   /* levels td_pw_val follows before giving up (stack guard) */

struct td_proto_frame {
    msgpack_zone zone; /* owns every msgpack_object of the tree */
    msgpack_object root;
    size_t len;
    char body[]; /* the body bytes; strings and bins of the tree point in here */
};

struct td_proto_reader {
    char *buf;
    size_t cap;
    size_t rpos;      /* start of the first frame not yet taken */
    size_t wpos;      /* end of the bytes fed */
    size_t hdr_at;    /* prefix of the first frame not yet fully buffered */
    size_t frame_end; /* end of that frame once its prefix passed the check, else 0 */
    uint32_t max_frame;
    uint32_t first_max; /* the first frame's limit (td_proto_reader_limit_first), or 0 */
    uint64_t nframes;   /* frames whose prefix passed the check */
    td_error_t err;     /* sticky: once set, the stream is dead */
};

/* ---- the validator ---- */

/* What a msgpack type byte starts. */
typedef enum { K_NIL, K_BOOL, K_INT, K_FLOAT, K_STR, K_BIN, K_EXT, K_ARRAY, K_MAP, K_BAD } kind;

/* One parsed msgpack header: its kind, header size, and either the payload size (scalars,
 * str, bin, ext) or the element count (arrays; pairs for maps). */
typedef struct {
    kind k;
    size_t hdr; /* bytes of the type byte and the length field (and an ext's type byte) */
    uint64_t n; /* payload bytes, or element/pair count for containers */
} head;

/* One open container while walking: elements left to see (keys and values for a map). */
typedef struct {
    uint64_t left;
    bool is_map;
} open_container;

/* Name of a kind with its article, for messages ("top-level value is an array, not a map"). */
static const char *kind_name(kind k)
{
    static const char *const names[] = {"nil",      "a boolean", "an integer", "a float",
                                        "a string", "a binary",  "an ext",     "an array",
                                        "a map",    "invalid"};
    return names[k];
}

/* Reads an n-byte big-endian unsigned number. */
static uint64_t be(const unsigned char *p, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* Parses the header starting at p (avail >= 1 bytes there). Returns false when the length
 * field (or an ext's type byte) runs past avail; h->k is K_BAD for the unused byte 0xc1. */
static bool parse_head(const unsigned char *p, size_t avail, head *h)
{
    unsigned b = p[0];
    size_t lenbytes = 0;

    h->hdr = 1;
    h->n = 0;
    if (b <= 0x7f || b >= 0xe0) {
        h->k = K_INT;
    } else if (b <= 0x8f) {
        h->k = K_MAP;
        h->n = b & 0x0f;
    } else if (b <= 0x9f) {
        h->k = K_ARRAY;
        h->n = b & 0x0f;
    } else if (b <= 0xbf) {
        h->k = K_STR;
        h->n = b & 0x1f;
    } else {
        switch (b) {
        case 0xc0:
            h->k = K_NIL;
            break;
        case 0xc1:
            h->k = K_BAD;
            break;
        case 0xc2:
        case 0xc3:
            h->k = K_BOOL;
            break;
        case 0xc4: /* bin 8, 16, 32 */
        case 0xc5:
        case 0xc6:
            h->k = K_BIN;
            lenbytes = (size_t)1 << (b - 0xc4);
            break;
        case 0xc7: /* ext 8, 16, 32: length, then the ext's type byte */
        case 0xc8:
        case 0xc9:
            h->k = K_EXT;
            lenbytes = (size_t)1 << (b - 0xc7);
            h->hdr = 2;
            break;
        case 0xca:
            h->k = K_FLOAT;
            h->n = 4;
            break;
        case 0xcb:
            h->k = K_FLOAT;
            h->n = 8;
            break;
        case 0xcc: /* uint 8..64 */
        case 0xcd:
        case 0xce:
        case 0xcf:
            h->k = K_INT;
            h->n = (uint64_t)1 << (b - 0xcc);
            break;
        case 0xd0: /* int 8..64 */
        case 0xd1:
        case 0xd2:
        case 0xd3:
            h->k = K_INT;
            h->n = (uint64_t)1 << (b - 0xd0);
            break;
        case 0xd4: /* fixext 1..16: the ext's type byte, then the data */
        case 0xd5:
        case 0xd6:
        case 0xd7:
        case 0xd8:
            h->k = K_EXT;
            h->hdr = 2;
            h->n = (uint64_t)1 << (b - 0xd4);
            break;
        case 0xd9: /* str 8, 16, 32 */
        case 0xda:
        case 0xdb:
            h->k = K_STR;
            lenbytes = (size_t)1 << (b - 0xd9);
            break;
        case 0xdc: /* array 16, 32 */
        case 0xdd:
            h->k = K_ARRAY;
            lenbytes = (size_t)2 << (b - 0xdc);
            break;
        default: /* 0xde, 0xdf: map 16, 32 */
            h->k = K_MAP;
            lenbytes = (size_t)2 << (b - 0xde);
            break;
        }
    }
    if (1 + lenbytes > avail)
        return false;
    if (lenbytes > 0)
        h->n = be(p + 1, lenbytes);
    h->hdr += lenbytes;
    return h->hdr <= avail;
}

/* The error for a top-level value that is not a map. */
static int not_a_map(kind k, td_error_t *err)
{
    return td_error_set(err, TD_EPROTO, "top-level value is %s, not a map", kind_name(k));
}

/* Checks a container header at pos: its count against the limit, that it is a map when it
 * is the top value, its nesting depth, and that its elements can fit in the left bytes after
 * the header (each element takes at least one byte). */
static int check_container(const head *h, size_t pos, size_t left, int depth, td_error_t *err)
{
    bool is_map = h->k == K_MAP;
    const char *what = is_map ? "map" : "array";
    const char *unit = is_map ? "pairs" : "elements";

    if (h->n > TD_PROTO_MAX_ITEMS)
        return td_error_set(err, TD_E2BIG, "%s of %llu %s exceeds the limit of %d, at byte %zu",
                            what, (unsigned long long)h->n, unit, TD_PROTO_MAX_ITEMS, pos);
    if (depth == 1 && !is_map)
        return not_a_map(h->k, err);
    if (depth > TD_PROTO_MAX_DEPTH)
        return td_error_set(err, TD_E2BIG, "%s nested deeper than %d levels, at byte %zu", what,
                            TD_PROTO_MAX_DEPTH, pos);
    if ((is_map ? 2 * h->n : h->n) > left)
        return td_error_set(err, TD_EPROTO,
                            "truncated msgpack value at byte %zu (%s of %llu %s in %zu bytes)", pos,
                            what, (unsigned long long)h->n, unit, left);
    return 0;
}

/* Checks a scalar header at pos: a str/bin/ext length against the limit, that a top value
 * is not a scalar, and that the payload fits in the left bytes after the header. */
static int check_scalar(const head *h, size_t pos, size_t left, int depth, td_error_t *err)
{
    bool has_len = h->k == K_STR || h->k == K_BIN || h->k == K_EXT;
    const char *what = h->k == K_STR ? "string" : h->k == K_BIN ? "binary" : "ext";

    if (has_len && h->n > TD_PROTO_MAX_STR)
        return td_error_set(err, TD_E2BIG, "%s of %llu bytes exceeds the limit of %u, at byte %zu",
                            what, (unsigned long long)h->n, TD_PROTO_MAX_STR, pos);
    if (depth == 1)
        return not_a_map(h->k, err);
    if (h->n > left)
        return td_error_set(err, TD_EPROTO, "truncated msgpack value at byte %zu", pos);
    return 0;
}

/* Walks one frame body without recursion and without allocating, checking every peer
 * number against the limits (PROTOCOL.md "Limits") before msgpack-c would act on it.
 * Returns 0 when the body is exactly one map within the limits, else an error in err. */
static int validate(const unsigned char *p, size_t len, td_error_t *err)
{
    open_container stack[TD_PROTO_MAX_DEPTH];
    int sp = 0; /* open containers; the value being read is at depth sp + 1 */
    size_t pos = 0;
    int rc = 0;

    for (;;) {
        head h;
        bool is_key = sp > 0 && stack[sp - 1].is_map && stack[sp - 1].left % 2 == 0;

        if (pos >= len || !parse_head(p + pos, len - pos, &h)) {
            rc = td_error_set(err, TD_EPROTO, "truncated msgpack value at byte %zu", pos);
            goto out;
        }
        if (h.k == K_BAD) {
            rc = td_error_set(err, TD_EPROTO, "invalid msgpack type byte 0x%02x at byte %zu",
                              p[pos], pos);
            goto out;
        }
        if (is_key && h.k != K_STR) {
            rc = td_error_set(err, TD_EPROTO, "map key at byte %zu is %s, not a string", pos,
                              kind_name(h.k));
            goto out;
        }
        size_t left = len - pos - h.hdr;
        if (h.k == K_ARRAY || h.k == K_MAP) {
            if ((rc = check_container(&h, pos, left, sp + 1, err)) < 0)
                goto out;
            pos += h.hdr;
            if (h.n > 0) {
                stack[sp].left = h.k == K_MAP ? 2 * h.n : h.n;
                stack[sp].is_map = h.k == K_MAP;
                sp++;
                continue;
            }
        } else {
            if ((rc = check_scalar(&h, pos, left, sp + 1, err)) < 0)
                goto out;
            pos += h.hdr + h.n;
        }
        /* A value ended: count it in its container, closing every container it completes. */
        while (sp > 0 && --stack[sp - 1].left == 0)
            sp--;
        if (sp == 0)
            break;
    }
    if (pos != len)
        rc = td_error_set(err, TD_EPROTO, "%zu byte%s after the end of the value", len - pos,
                          len - pos == 1 ? "" : "s");
out:
    return rc;
}

/* ---- decoding ---- */

/* Validates body, copies it into a new frame and lets msgpack-c build the tree in the
 * frame's zone. No frame-size check here: the caller applies its own limit. */
static int decode(const void *body, size_t len, td_proto_frame **out, td_error_t *err)
{
    td_proto_frame *f = NULL;
    size_t off = 0;
    size_t chunk = len * 4 + ZONE_CHUNK_MIN;
    int rc;

    *out = NULL;
    if ((rc = validate(body, len, err)) < 0)
        goto out;
    f = malloc(sizeof(*f) + len);
    if (f == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "out of memory decoding a frame of %zu bytes", len);
        goto out;
    }
    memcpy(f->body, body, len);
    f->len = len;
    if (!msgpack_zone_init(&f->zone, chunk < ZONE_CHUNK_MAX ? chunk : ZONE_CHUNK_MAX)) {
        rc = td_error_set(err, TD_ENOMEM, "out of memory decoding a frame of %zu bytes", len);
        goto fail_zone;
    }
    switch (msgpack_unpack(f->body, len, &off, &f->zone, &f->root)) {
    case MSGPACK_UNPACK_SUCCESS:
        break;
    case MSGPACK_UNPACK_NOMEM_ERROR:
        rc = td_error_set(err, TD_ENOMEM, "out of memory decoding a frame of %zu bytes", len);
        goto fail_unpack;
    default: /* not reached: the validator accepts only what msgpack-c decodes whole */
        rc = td_error_set(err, TD_EPROTO, "msgpack-c could not decode the frame");
        goto fail_unpack;
    }
    *out = f;
    rc = 1;
    goto out;
fail_unpack:
    msgpack_zone_destroy(&f->zone);
fail_zone:
    free(f);
out:
    return rc;
}

int td_proto_decode(const void *body, size_t len, td_proto_frame **out, td_error_t *err)
{
    int rc;

    if (len > TD_PROTO_MAX_FRAME) {
        *out = NULL;
        return td_error_set(err, TD_E2BIG, "frame of %zu bytes exceeds the limit of %u bytes", len,
                            TD_PROTO_MAX_FRAME);
    }
    rc = decode(body, len, out, err);
    return rc < 0 ? rc : 0;
}

void td_proto_frame_free(td_proto_frame *f)
{
    if (f == NULL)
        return;
    msgpack_zone_destroy(&f->zone);
    free(f);
}

const td_pval *td_proto_frame_root(const td_proto_frame *f)
{
    return f == NULL ? NULL : &f->root;
}

const void *td_proto_frame_body(const td_proto_frame *f, size_t *len)
{
    if (len != NULL)
        *len = f == NULL ? 0 : f->len;
    return f == NULL ? NULL : f->body;
}

/* ---- the reader ---- */

int td_proto_reader_new(td_proto_reader **out, uint32_t max_frame)
{
    td_proto_reader *r = calloc(1, sizeof(*r));

    *out = r;
    if (r == NULL)
        return TD_ENOMEM;
    r->max_frame = max_frame == 0 ? TD_PROTO_MAX_FRAME : max_frame;
    return 0;
}

void td_proto_reader_limit_first(td_proto_reader *r, uint32_t first_max)
{
    r->first_max = first_max;
}

void td_proto_reader_free(td_proto_reader *r)
{
    if (r == NULL)
        return;
    free(r->buf);
    free(r);
}

/* Makes room for n more bytes at wpos: first by dropping the frames already taken (only
 * when the buffer would otherwise grow, so taking many small frames moves nothing), then by
 * doubling. */
static int reserve(td_proto_reader *r, size_t n)
{
    size_t need, cap;
    char *nb;

    if (r->cap - r->wpos >= n)
        return 0;
    if (r->rpos > 0) {
        memmove(r->buf, r->buf + r->rpos, r->wpos - r->rpos);
        r->wpos -= r->rpos;
        r->hdr_at -= r->rpos;
        if (r->frame_end > 0)
            r->frame_end -= r->rpos;
        r->rpos = 0;
        if (r->cap - r->wpos >= n)
            return 0;
    }
    need = r->wpos + n;
    if (need < r->wpos)
        return TD_ENOMEM;
    cap = r->cap < READER_MIN_CAP ? READER_MIN_CAP : r->cap;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    nb = realloc(r->buf, cap);
    if (nb == NULL)
        return TD_ENOMEM;
    r->buf = nb;
    r->cap = cap;
    return 0;
}

/* Appends n bytes (room was reserved). */
static void append(td_proto_reader *r, const char *p, size_t n)
{
    memcpy(r->buf + r->wpos, p, n);
    r->wpos += n;
}

/* Copies the data in pieces that never cross a frame's prefix, so each prefix is checked
 * before one byte of its body is kept. A prefix over the limit kills the stream: the error
 * waits in r->err for td_proto_reader_next (after the frames before it) and every byte from
 * there on is dropped. */
int td_proto_reader_feed(td_proto_reader *r, const void *data, size_t len)
{
    const char *p = data;
    int rc = 0;

    while (len > 0 && r->err.code == 0) {
        size_t take;

        if (r->frame_end == 0) {
            size_t have = r->wpos - r->hdr_at;
            take = TD_PROTO_PREFIX - have < len ? TD_PROTO_PREFIX - have : len;
        } else {
            take = r->frame_end - r->wpos < len ? r->frame_end - r->wpos : len;
        }
        if ((rc = reserve(r, take)) < 0)
            goto out;
        append(r, p, take);
        p += take;
        len -= take;
        if (r->frame_end == 0 && r->wpos - r->hdr_at == TD_PROTO_PREFIX) {
            uint32_t n = (uint32_t)be((const unsigned char *)r->buf + r->hdr_at, TD_PROTO_PREFIX);
            int first = r->nframes == 0 && r->first_max > 0 && r->first_max < r->max_frame;
            uint32_t max = first ? r->first_max : r->max_frame;
            if (n > max) {
                td_error_set(&r->err, TD_E2BIG, "frame of %u bytes exceeds the limit of %u bytes%s",
                             n, max, first ? " before hello" : "");
                r->wpos = r->hdr_at; /* the prefix is not a frame: forget it */
                break;
            }
            r->nframes++;
            r->frame_end = r->hdr_at + TD_PROTO_PREFIX + n;
        }
        if (r->frame_end != 0 && r->wpos == r->frame_end) {
            r->hdr_at = r->wpos;
            r->frame_end = 0;
        }
    }
out:
    return rc;
}

int td_proto_reader_next(td_proto_reader *r, td_proto_frame **out, td_error_t *err)
{
    int rc = 0;

    *out = NULL;
    if (r->rpos < r->hdr_at) {
        /* A whole frame whose prefix already passed the limit check in feed. */
        size_t n = (size_t)be((const unsigned char *)r->buf + r->rpos, TD_PROTO_PREFIX);
        rc = decode(r->buf + r->rpos + TD_PROTO_PREFIX, n, out, &r->err);
        r->rpos += TD_PROTO_PREFIX + n;
        if (r->rpos == r->wpos) /* everything taken: start over at the front, for free */
            r->rpos = r->wpos = r->hdr_at = r->frame_end = 0;
        if (rc < 0) {
            /* The stream is dead: drop everything and keep only the error. */
            r->rpos = r->wpos = r->hdr_at = r->frame_end = 0;
        }
    }
    if (rc == 0 && r->err.code != 0)
        rc = r->err.code;
    if (rc < 0 && err != NULL)
        *err = r->err;
    return rc;
}

/* ---- accessors ---- */

td_pv_type td_pv_type_of(const td_pval *v)
{
    if (v == NULL)
        return TD_PV_NIL;
    switch (v->type) {
    case MSGPACK_OBJECT_NIL:
        return TD_PV_NIL;
    case MSGPACK_OBJECT_BOOLEAN:
        return TD_PV_BOOL;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        return v->via.u64 <= INT64_MAX ? TD_PV_INT : TD_PV_OTHER;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return TD_PV_INT;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return TD_PV_FLOAT;
    case MSGPACK_OBJECT_STR:
        return TD_PV_STR;
    case MSGPACK_OBJECT_BIN:
        return TD_PV_BIN;
    case MSGPACK_OBJECT_ARRAY:
        return TD_PV_ARRAY;
    case MSGPACK_OBJECT_MAP:
        return TD_PV_MAP;
    default:
        return TD_PV_OTHER;
    }
}

const td_pval *td_pv_get(const td_pval *m, const char *key)
{
    size_t klen;

    if (m == NULL || key == NULL || m->type != MSGPACK_OBJECT_MAP)
        return NULL;
    klen = strlen(key);
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object *k = &m->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            memcmp(k->via.str.ptr, key, klen) == 0)
            return &m->via.map.ptr[i].val;
    }
    return NULL;
}

int td_pv_int(const td_pval *v, int64_t *out)
{
    /* 2^63 exactly; every double below it and at or above -2^63 converts without overflow. */
    const double two63 = 9223372036854775808.0;

    switch (td_pv_type_of(v)) {
    case TD_PV_INT:
        *out = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (int64_t)v->via.u64 : v->via.i64;
        return 0;
    case TD_PV_FLOAT:
        if (v->via.f64 >= -two63 && v->via.f64 < two63 &&
            (double)(int64_t)v->via.f64 == v->via.f64) {
            *out = (int64_t)v->via.f64;
            return 0;
        }
        return TD_EINVAL;
    default:
        return TD_EINVAL;
    }
}

int td_pv_double(const td_pval *v, double *out)
{
    switch (td_pv_type_of(v)) {
    case TD_PV_INT:
        *out = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (double)v->via.u64 : (double)v->via.i64;
        return 0;
    case TD_PV_FLOAT:
        *out = v->via.f64;
        return 0;
    default:
        return TD_EINVAL;
    }
}

int td_pv_bool(const td_pval *v, int *out)
{
    if (v == NULL || v->type != MSGPACK_OBJECT_BOOLEAN)
        return TD_EINVAL;
    *out = v->via.boolean ? 1 : 0;
    return 0;
}

const char *td_pv_str(const td_pval *v, size_t *len)
{
    bool is_str = v != NULL && v->type == MSGPACK_OBJECT_STR;

    if (len != NULL)
        *len = is_str ? v->via.str.size : 0;
    if (!is_str)
        return NULL;
    /* An empty string may carry a NULL pointer; callers get a valid one. */
    return v->via.str.ptr != NULL ? v->via.str.ptr : "";
}

int td_pv_strcpy(const td_pval *v, char *buf, size_t size)
{
    size_t n;
    const char *s = td_pv_str(v, &n);

    if (buf != NULL && size > 0)
        buf[0] = '\0';
    if (s == NULL || memchr(s, '\0', n) != NULL)
        return TD_EINVAL;
    if (buf == NULL || n >= size)
        return TD_E2BIG;
    memcpy(buf, s, n);
    buf[n] = '\0';
    return 0;
}

size_t td_pv_len(const td_pval *v)
{
    if (v == NULL)
        return 0;
    if (v->type == MSGPACK_OBJECT_ARRAY)
        return v->via.array.size;
    if (v->type == MSGPACK_OBJECT_MAP)
        return v->via.map.size;
    return 0;
}

const td_pval *td_pv_at(const td_pval *arr, size_t i)
{
    if (arr == NULL || arr->type != MSGPACK_OBJECT_ARRAY || i >= arr->via.array.size)
        return NULL;
    return &arr->via.array.ptr[i];
}

const td_pval *td_pv_key_at(const td_pval *map, size_t i)
{
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP || i >= map->via.map.size)
        return NULL;
    return &map->via.map.ptr[i].key;
}

const td_pval *td_pv_val_at(const td_pval *map, size_t i)
{
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP || i >= map->via.map.size)
        return NULL;
    return &map->via.map.ptr[i].val;
}

/* ---- the writer ---- */

/* Makes room for n more bytes; on failure remembers TD_ENOMEM for td_pw_finish. */
static bool pw_room(td_pw *w, size_t n)
{
    size_t cap;
    char *nb;

    if (w->failed)
        return false;
    if (w->cap - w->len >= n)
        return true;
    if (w->len + n < w->len) {
        w->failed = TD_ENOMEM;
        return false;
    }
    cap = w->cap < WRITER_MIN_CAP ? WRITER_MIN_CAP : w->cap;
    while (cap < w->len + n)
        cap = cap > SIZE_MAX / 2 ? w->len + n : cap * 2;
    nb = realloc(w->buf, cap);
    if (nb == NULL) {
        w->failed = TD_ENOMEM;
        return false;
    }
    w->buf = nb;
    w->cap = cap;
    return true;
}

/* Appends n bytes. */
static void pw_put(td_pw *w, const void *p, size_t n)
{
    if (n == 0 || !pw_room(w, n))
        return;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
}

/* Appends a type byte followed by the low nbytes of v, big-endian. */
static void pw_head(td_pw *w, unsigned char type, uint64_t v, size_t nbytes)
{
    unsigned char b[9];

    b[0] = type;
    for (size_t i = 0; i < nbytes; i++)
        b[1 + i] = (unsigned char)(v >> (8 * (nbytes - 1 - i)));
    pw_put(w, b, 1 + nbytes);
}

/* A str/bin/ext-style length header: the fix form when fix_max allows, else 8/16/32-bit.
 * fix_max 0 means there is no fix form; ty8 0 means there is no 8-bit form (arrays, maps). */
static void pw_len(td_pw *w, uint64_t n, unsigned char fix, uint64_t fix_max, unsigned char ty8,
                   unsigned char ty16, unsigned char ty32)
{
    if (n > UINT32_MAX) {
        if (!w->failed)
            w->failed = TD_E2BIG;
    } else if (fix_max > 0 && n <= fix_max) {
        pw_head(w, (unsigned char)(fix | n), 0, 0);
    } else if (ty8 != 0 && n <= UINT8_MAX) {
        pw_head(w, ty8, n, 1);
    } else if (n <= UINT16_MAX) {
        pw_head(w, ty16, n, 2);
    } else {
        pw_head(w, ty32, n, 4);
    }
}

/* One value is complete: it counts in the innermost open container, and a container it
 * completes is in its turn one value of the one around it. Nothing is followed outside a
 * counted map (nopen 0). */
static void pw_count(td_pw *w)
{
    while (w->nopen > 0) {
        td_pw_open *o = &w->open[w->nopen - 1];
        o->seen++;
        if (o->want == TD_PW_COUNTED || o->seen < o->want)
            return;
        w->nopen--;
    }
}

/* A container header with want values to follow was written: inside a counted map it is
 * followed until they are (an empty one is complete at once). */
static void pw_follow(td_pw *w, uint64_t want, size_t at)
{
    if (w->nopen == 0 && want != TD_PW_COUNTED)
        return;
    if (want == 0) {
        pw_count(w);
        return;
    }
    if (w->nopen == TD_PW_MAX_OPEN) {
        if (!w->failed)
            w->failed = TD_E2BIG;
        return;
    }
    w->open[w->nopen++] = (td_pw_open){.at = at, .want = want, .seen = 0};
}

void td_pw_init(td_pw *w)
{
    w->buf = NULL;
    w->len = w->cap = 0;
    w->failed = 0;
    td_pw_reset(w);
}

void td_pw_reset(td_pw *w)
{
    static const char zero[TD_PROTO_PREFIX];

    w->len = 0;
    w->failed = 0;
    w->nopen = 0;
    pw_put(w, zero, sizeof(zero));
}

void td_pw_free(td_pw *w)
{
    if (w == NULL)
        return;
    free(w->buf);
    w->buf = NULL;
    w->len = w->cap = 0;
}

void td_pw_map(td_pw *w, uint32_t npairs)
{
    pw_len(w, npairs, 0x80, 15, 0, 0xde, 0xdf);
    pw_follow(w, 2 * (uint64_t)npairs, 0);
}

#define PW_MAP32_HEAD 5 /* bytes of a map32 header: what a counted map reserves */

void td_pw_map_open(td_pw *w)
{
    size_t at = w->len;

    pw_head(w, 0xdf, 0, 4);
    pw_follow(w, TD_PW_COUNTED, at);
}

void td_pw_map_close(td_pw *w)
{
    td_pw_open *o = w->nopen > 0 ? &w->open[w->nopen - 1] : NULL;
    size_t at, hlen, body;
    uint64_t n;

    if (w->failed)
        return;
    if (o == NULL || o->want != TD_PW_COUNTED || o->seen % 2 != 0) {
        w->failed = TD_EINVAL;
        return;
    }
    at = o->at;
    n = o->seen / 2;
    w->nopen--;
    if (n > UINT32_MAX) {
        w->failed = TD_E2BIG;
        return;
    }
    /* The smallest header for n, written where the reserved one was, the pairs moved up to
     * it: the same bytes td_pw_map(w, n) would have written. */
    hlen = n <= 15 ? 1 : n <= UINT16_MAX ? 3 : PW_MAP32_HEAD;
    body = w->len - at - PW_MAP32_HEAD;
    memmove(w->buf + at + hlen, w->buf + at + PW_MAP32_HEAD, body);
    w->len = at + hlen + body;
    if (hlen == 1) {
        w->buf[at] = (char)(0x80 | n);
    } else {
        w->buf[at] = (char)(hlen == 3 ? 0xde : 0xdf);
        for (size_t i = 1; i < hlen; i++)
            w->buf[at + i] = (char)(n >> (8 * (hlen - 1 - i)));
    }
    pw_count(w);
}

void td_pw_array(td_pw *w, uint32_t n)
{
    pw_len(w, n, 0x90, 15, 0, 0xdc, 0xdd);
    pw_follow(w, n, 0);
}

void td_pw_array_raw(td_pw *w, uint32_t n, const void *p, size_t len)
{
    pw_len(w, n, 0x90, 15, 0, 0xdc, 0xdd);
    pw_put(w, p, len);
    pw_count(w);
}

void td_pw_str(td_pw *w, const char *s)
{
    if (s == NULL)
        td_pw_nil(w);
    else
        td_pw_strn(w, s, strlen(s));
}

void td_pw_strn(td_pw *w, const char *s, size_t len)
{
    pw_len(w, len, 0xa0, 31, 0xd9, 0xda, 0xdb);
    if (len <= UINT32_MAX)
        pw_put(w, s, len);
    pw_count(w);
}

void td_pw_bin(td_pw *w, const void *p, size_t len)
{
    /* bin has no fix form; its 8-bit form 0xc4 also covers the empty binary. */
    pw_len(w, len, 0, 0, 0xc4, 0xc5, 0xc6);
    if (len <= UINT32_MAX)
        pw_put(w, p, len);
    pw_count(w);
}

/* An unsigned integer in its smallest encoding. */
static void pw_uint(td_pw *w, uint64_t v)
{
    if (v <= 0x7f)
        pw_head(w, (unsigned char)v, 0, 0);
    else if (v <= UINT8_MAX)
        pw_head(w, 0xcc, v, 1);
    else if (v <= UINT16_MAX)
        pw_head(w, 0xcd, v, 2);
    else if (v <= UINT32_MAX)
        pw_head(w, 0xce, v, 4);
    else
        pw_head(w, 0xcf, v, 8);
}

void td_pw_int(td_pw *w, int64_t v)
{
    if (v >= 0)
        pw_uint(w, (uint64_t)v);
    else if (v >= -32)
        pw_head(w, (unsigned char)(int8_t)v, 0, 0);
    else if (v >= INT8_MIN)
        pw_head(w, 0xd0, (uint64_t)v, 1);
    else if (v >= INT16_MIN)
        pw_head(w, 0xd1, (uint64_t)v, 2);
    else if (v >= INT32_MIN)
        pw_head(w, 0xd2, (uint64_t)v, 4);
    else
        pw_head(w, 0xd3, (uint64_t)v, 8);
    pw_count(w);
}

void td_pw_double(td_pw *w, double v)
{
    uint64_t bits;

    memcpy(&bits, &v, sizeof(bits));
    pw_head(w, 0xcb, bits, 8);
    pw_count(w);
}

void td_pw_bool(td_pw *w, int v)
{
    pw_head(w, v ? 0xc3 : 0xc2, 0, 0);
    pw_count(w);
}

void td_pw_nil(td_pw *w)
{
    pw_head(w, 0xc0, 0, 0);
    pw_count(w);
}

void td_pw_raw(td_pw *w, const void *p, size_t len)
{
    pw_put(w, p, len);
    pw_count(w);
}

/* An ext value: the fixext forms for sizes 1, 2, 4, 8 and 16, else ext 8/16/32. */
static void pw_ext(td_pw *w, int8_t type, const char *p, uint32_t n)
{
    static const unsigned char fix[17] = {
        [1] = 0xd4, [2] = 0xd5, [4] = 0xd6, [8] = 0xd7, [16] = 0xd8};

    if (n <= 16 && fix[n] != 0)
        pw_head(w, fix[n], 0, 0);
    else
        pw_len(w, n, 0, 0, 0xc7, 0xc8, 0xc9);
    pw_head(w, (unsigned char)type, 0, 0);
    pw_put(w, p, n);
    pw_count(w);
}

/* td_pw_val at a given depth; a tree deeper than PW_VAL_MAX_DEPTH (never one that was
 * decoded, which is at most TD_PROTO_MAX_DEPTH) fails the frame rather than the stack. */
static void pw_val(td_pw *w, const td_pval *v, int depth)
{
    if (depth > PW_VAL_MAX_DEPTH) {
        if (!w->failed)
            w->failed = TD_E2BIG;
        return;
    }
    switch (v == NULL ? MSGPACK_OBJECT_NIL : v->type) {
    case MSGPACK_OBJECT_NIL:
        td_pw_nil(w);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        td_pw_bool(w, v->via.boolean);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        pw_uint(w, v->via.u64);
        pw_count(w);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        td_pw_int(w, v->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        td_pw_double(w, v->via.f64);
        break;
    case MSGPACK_OBJECT_STR:
        td_pw_strn(w, v->via.str.ptr, v->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        td_pw_bin(w, v->via.bin.ptr, v->via.bin.size);
        break;
    case MSGPACK_OBJECT_EXT:
        pw_ext(w, v->via.ext.type, v->via.ext.ptr, v->via.ext.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        td_pw_array(w, v->via.array.size);
        for (uint32_t i = 0; i < v->via.array.size; i++)
            pw_val(w, &v->via.array.ptr[i], depth + 1);
        break;
    case MSGPACK_OBJECT_MAP:
        td_pw_map(w, v->via.map.size);
        for (uint32_t i = 0; i < v->via.map.size; i++) {
            pw_val(w, &v->via.map.ptr[i].key, depth + 1);
            pw_val(w, &v->via.map.ptr[i].val, depth + 1);
        }
        break;
    default:
        td_pw_nil(w);
        break;
    }
}

void td_pw_val(td_pw *w, const td_pval *v)
{
    pw_val(w, v, 1);
}

int td_pw_finish(td_pw *w, const char **frame, size_t *len)
{
    int rc = 0;
    size_t body;

    *frame = NULL;
    *len = 0;
    if (w->failed || w->buf == NULL) {
        rc = w->failed < 0 ? w->failed : TD_ENOMEM;
        goto out;
    }
    if (w->nopen > 0) { /* a counted map was never closed: its count is not known */
        rc = TD_EINVAL;
        goto out;
    }
    body = w->len - TD_PROTO_PREFIX;
    if (body > TD_PROTO_MAX_FRAME) {
        rc = TD_E2BIG;
        goto out;
    }
    for (size_t i = 0; i < TD_PROTO_PREFIX; i++)
        w->buf[i] = (char)(body >> (8 * (TD_PROTO_PREFIX - 1 - i)));
    *frame = w->buf;
    *len = w->len;
out:
    return rc;
}

const void *td_pw_body(const td_pw *w, size_t *len)
{
    bool ok = !w->failed && w->buf != NULL && w->nopen == 0;

    if (len != NULL)
        *len = ok ? w->len - TD_PROTO_PREFIX : 0;
    return ok ? w->buf + TD_PROTO_PREFIX : NULL;
}

/* Longest message an error frame carries; a longer one is cut at a UTF-8 boundary. */
#define ERROR_MSG_MAX 4096 /* bytes */

void td_proto_write_error(td_pw *w, int64_t id, int code, const char *message)
{
    char text[ERROR_MSG_MAX + 1];
    const char *frame;
    size_t flen;
    size_t n;

    if (message == NULL || message[0] == '\0')
        message = td_strerror(code);
    /* A message may quote what a client sent (a path, a request's type): what goes back is
     * always UTF-8 without control characters but newlines, whatever the client sent, and it is
     * cut at a character's boundary. */
    n = td_text_escape(text, sizeof(text), message, strlen(message), TD_TEXT_KEEP_NEWLINES);
    td_pw_reset(w);
    td_pw_map_open(w);
    td_pw_str(w, "type");
    td_pw_str(w, "error");
    td_pw_str(w, "id");
    td_pw_int(w, id);
    td_pw_str(w, "code");
    td_pw_int(w, code);
    td_pw_str(w, "name");
    td_pw_str(w, td_errname(code));
    td_pw_str(w, "message");
    td_pw_strn(w, text, n);
    td_pw_map_close(w);
    td_pw_finish(w, &frame, &flen);
}

size_t td_proto_reader_buffered(const td_proto_reader *r)
{
    return r->wpos - r->rpos;
}
