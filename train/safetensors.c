/* safetensors files (safetensors.h): the header's JSON read by a small strict parser of the
 * format's own grammar (an object of tensor entries and one object of string metadata), the
 * checks of every entry against the data before any of it is read, float tensors read (and
 * widened from F16/BF16), and the writer traind's exports go through. Knows no model: which
 * name is which parameter is weights.c's. Runs on the caller's thread: a worker building a
 * trainer, the daemon's threadpool (an export, a submit's check of a header), never the loop. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/safetensors.h"
#include "train/train.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c reads and writes float32 as the host stores it: a little-endian host"
#endif

#define HEADER_ALIGN 8 /* bytes: the writer pads the JSON with spaces to a multiple of this */
#define MAX_DIM      (1ll << 40) /* elements along one dimension, at most */

struct td_st_file {
    int fd;
    char path[TD_PATH_MAX];
    uint64_t data_start; /* bytes: 8 + the header's length */
    uint64_t data_size;  /* bytes of data after the header */
    td_st_tensor *t;
    int n, cap;
    char meta_key[TD_ST_MAX_META][TD_ST_META_MAX];
    char meta_val[TD_ST_MAX_META][TD_ST_META_MAX];
    int n_meta;
};

int td_st_is_path(const char *path)
{
    size_t n = strlen(path), s = strlen(TD_ST_SUFFIX);

    return n > s && strcmp(path + n - s, TD_ST_SUFFIX) == 0;
}

/* ---- the header's JSON ---------------------------------------------------------------------- */

typedef struct parser {
    const char *p, *end, *start;
    int too_many; /* the header holds more than TD_ST_MAX_TENSORS tensors */
    char msg[200];
} parser;

static int fail(parser *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int fail(parser *ps, const char *fmt, ...)
{
    va_list ap;
    int n = snprintf(ps->msg, sizeof(ps->msg), "byte %td: ", ps->p - ps->start);

    va_start(ap, fmt);
    vsnprintf(ps->msg + n, sizeof(ps->msg) - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

static void ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static int expect(parser *ps, char ch)
{
    ws(ps);
    if (ps->p >= ps->end || *ps->p != ch)
        return fail(ps, "expected '%c'", ch);
    ps->p++;
    return 0;
}

/* Whether the next non-space byte is ch (consumed when it is). */
static int take(parser *ps, char ch)
{
    ws(ps);
    if (ps->p < ps->end && *ps->p == ch) {
        ps->p++;
        return 1;
    }
    return 0;
}

static int hex4(parser *ps, unsigned *out)
{
    unsigned v = 0;

    if (ps->end - ps->p < 4)
        return fail(ps, "a \\u escape needs 4 hex digits");
    for (int i = 0; i < 4; i++) {
        char h = *ps->p++;
        int d = h >= '0' && h <= '9'   ? h - '0'
                : h >= 'a' && h <= 'f' ? h - 'a' + 10
                : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                       : -1;
        if (d < 0)
            return fail(ps, "a \\u escape needs 4 hex digits");
        v = v * 16 + (unsigned)d;
    }
    *out = v;
    return 0;
}

/* Appends code point u as UTF-8 to out (cap bytes, NUL kept room for); *n grows, past cap
 * only counted. */
static void put_utf8(char *out, size_t cap, size_t *n, unsigned u)
{
    unsigned char b[4];
    int k;

    if (u < 0x80)
        b[0] = (unsigned char)u, k = 1;
    else if (u < 0x800)
        b[0] = (unsigned char)(0xc0 | u >> 6), b[1] = (unsigned char)(0x80 | (u & 63)), k = 2;
    else if (u < 0x10000)
        b[0] = (unsigned char)(0xe0 | u >> 12), b[1] = (unsigned char)(0x80 | (u >> 6 & 63)),
        b[2] = (unsigned char)(0x80 | (u & 63)), k = 3;
    else
        b[0] = (unsigned char)(0xf0 | u >> 18), b[1] = (unsigned char)(0x80 | (u >> 12 & 63)),
        b[2] = (unsigned char)(0x80 | (u >> 6 & 63)), b[3] = (unsigned char)(0x80 | (u & 63)),
        k = 4;
    for (int i = 0; i < k; i++, (*n)++)
        if (*n + 1 < cap)
            out[*n] = (char)b[i];
}

/* A JSON string into out (cap bytes, NUL-terminated); *len its full length, which may pass
 * cap - 1 (out then holds the first bytes). NUL (\u0000) is refused: names are C strings. */
static int string(parser *ps, char *out, size_t cap, size_t *len)
{
    size_t n = 0;
    unsigned u, lo;

    if (expect(ps, '"') != 0)
        return -1;
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char ch = (unsigned char)*ps->p++;
        if (ch < 0x20)
            return fail(ps, "a control byte 0x%02x in a string", ch);
        if (ch != '\\') { /* UTF-8 passes through byte by byte */
            if (n + 1 < cap)
                out[n] = (char)ch;
            n++;
            continue;
        }
        if (ps->p >= ps->end)
            break;
        ch = (unsigned char)*ps->p++;
        switch (ch) {
        case '"':
        case '\\':
        case '/':
            put_utf8(out, cap, &n, ch);
            break;
        case 'b':
            put_utf8(out, cap, &n, '\b');
            break;
        case 'f':
            put_utf8(out, cap, &n, '\f');
            break;
        case 'n':
            put_utf8(out, cap, &n, '\n');
            break;
        case 'r':
            put_utf8(out, cap, &n, '\r');
            break;
        case 't':
            put_utf8(out, cap, &n, '\t');
            break;
        case 'u':
            if (hex4(ps, &u) != 0)
                return -1;
            if (u >= 0xd800 && u < 0xdc00) {
                if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u')
                    return fail(ps, "a lone surrogate in a \\u escape");
                ps->p += 2;
                if (hex4(ps, &lo) != 0)
                    return -1;
                if (lo < 0xdc00 || lo > 0xdfff)
                    return fail(ps, "a lone surrogate in a \\u escape");
                u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
            } else if (u >= 0xdc00 && u < 0xe000) {
                return fail(ps, "a lone surrogate in a \\u escape");
            }
            if (u == 0)
                return fail(ps, "a NUL (\\u0000) in a string");
            put_utf8(out, cap, &n, u);
            break;
        default:
            return fail(ps, "unknown escape \\%c", ch);
        }
    }
    if (ps->p >= ps->end)
        return fail(ps, "unterminated string");
    ps->p++;
    out[n < cap ? n : cap - 1] = '\0';
    *len = n;
    return 0;
}

/* A non-negative integer (no sign, fraction or exponent), at most max. */
static int uint_value(parser *ps, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    const char *s;

    ws(ps);
    s = ps->p;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        unsigned d = (unsigned)(*ps->p++ - '0');
        if (v > (max - d) / 10)
            return fail(ps, "a number past %llu", (unsigned long long)max);
        v = v * 10 + d;
    }
    if (ps->p == s)
        return fail(ps, "expected a non-negative integer");
    if (ps->p < ps->end && (*ps->p == '.' || *ps->p == 'e' || *ps->p == 'E'))
        return fail(ps, "expected an integer, not a fraction");
    *out = v;
    return 0;
}

static const struct {
    const char *name;
    int bytes;
    td_st_dtype kind;
} dtypes[] = {
    {"F32", 4, TD_ST_F32},    {"F16", 2, TD_ST_F16},       {"BF16", 2, TD_ST_BF16},
    {"F64", 8, TD_ST_OTHER},  {"I64", 8, TD_ST_OTHER},     {"I32", 4, TD_ST_OTHER},
    {"I16", 2, TD_ST_OTHER},  {"I8", 1, TD_ST_OTHER},      {"U64", 8, TD_ST_OTHER},
    {"U32", 4, TD_ST_OTHER},  {"U16", 2, TD_ST_OTHER},     {"U8", 1, TD_ST_OTHER},
    {"BOOL", 1, TD_ST_OTHER}, {"F8_E4M3", 1, TD_ST_OTHER}, {"F8_E5M2", 1, TD_ST_OTHER},
};

static int dtype_bytes(const char *name, td_st_dtype *kind)
{
    for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++)
        if (strcmp(dtypes[i].name, name) == 0) {
            *kind = dtypes[i].kind;
            return dtypes[i].bytes;
        }
    return 0;
}

/* One tensor's entry: {"dtype": str, "shape": [int...], "data_offsets": [begin, end]}. */
static int tensor_entry(parser *ps, td_st_tensor *t)
{
    char key[32];
    size_t len;
    uint64_t v;
    int seen = 0;

    if (expect(ps, '{') != 0)
        return -1;
    if (take(ps, '}'))
        return fail(ps, "tensor %s: an empty entry", t->name);
    do {
        if (string(ps, key, sizeof(key), &len) != 0 || expect(ps, ':') != 0)
            return -1;
        if (strcmp(key, "dtype") == 0) {
            if (string(ps, t->dtype_name, sizeof(t->dtype_name), &len) != 0)
                return -1;
            seen |= 1;
        } else if (strcmp(key, "shape") == 0) {
            if (expect(ps, '[') != 0)
                return -1;
            t->ndim = 0;
            if (!take(ps, ']')) {
                do {
                    if (t->ndim == TD_ST_MAX_DIMS)
                        return fail(ps, "tensor %s: more than %d dimensions", t->name,
                                    TD_ST_MAX_DIMS);
                    if (uint_value(ps, (uint64_t)MAX_DIM, &v) != 0)
                        return -1;
                    t->shape[t->ndim++] = (int64_t)v;
                } while (take(ps, ','));
                if (expect(ps, ']') != 0)
                    return -1;
            }
            seen |= 2;
        } else if (strcmp(key, "data_offsets") == 0) {
            if (expect(ps, '[') != 0 || uint_value(ps, UINT64_MAX / 2, &t->begin) != 0 ||
                expect(ps, ',') != 0 || uint_value(ps, UINT64_MAX / 2, &t->end) != 0 ||
                expect(ps, ']') != 0)
                return -1;
            seen |= 4;
        } else {
            return fail(ps, "tensor %s: unknown field \"%s\"", t->name, key);
        }
    } while (take(ps, ','));
    if (expect(ps, '}') != 0)
        return -1;
    if (seen != 7)
        return fail(ps, "tensor %s: needs dtype, shape and data_offsets", t->name);
    return 0;
}

/* "__metadata__": {str: str, ...}; entries past TD_ST_MAX_META, and bytes of a key or value past
 * TD_ST_META_MAX, are read and not kept. */
static int metadata(parser *ps, td_st_file *f)
{
    char key[TD_ST_META_MAX], val[TD_ST_META_MAX];
    size_t len;

    if (expect(ps, '{') != 0)
        return -1;
    if (take(ps, '}'))
        return 0;
    do {
        if (string(ps, key, sizeof(key), &len) != 0 || expect(ps, ':') != 0)
            return -1;
        ws(ps);
        if (ps->p < ps->end && *ps->p != '"')
            return fail(ps, "__metadata__: the value of \"%s\" is not a string", key);
        if (string(ps, val, sizeof(val), &len) != 0)
            return -1;
        if (f->n_meta < TD_ST_MAX_META) {
            memcpy(f->meta_key[f->n_meta], key, sizeof(key));
            memcpy(f->meta_val[f->n_meta], val, sizeof(val));
            f->n_meta++;
        }
    } while (take(ps, ','));
    return expect(ps, '}');
}

static int add_tensor(td_st_file *f, parser *ps, td_st_tensor **out)
{
    *out = NULL;
    if (f->n == f->cap) {
        int cap = f->cap == 0 ? 64 : 2 * f->cap;
        td_st_tensor *t;
        if (f->n == TD_ST_MAX_TENSORS) {
            ps->too_many = 1;
            return fail(ps, "more than %d tensors", TD_ST_MAX_TENSORS);
        }
        if ((t = realloc(f->t, (size_t)cap * sizeof(*t))) == NULL)
            return fail(ps, "out of memory for %d tensors", cap);
        f->t = t;
        f->cap = cap;
    }
    *out = &f->t[f->n++];
    memset(*out, 0, sizeof(**out));
    return 0;
}

static int parse_header(parser *ps, td_st_file *f)
{
    char name[TD_ST_NAME_MAX];
    td_st_tensor *t = NULL;
    size_t len;

    if (expect(ps, '{') != 0)
        return -1;
    if (!take(ps, '}')) {
        do {
            if (string(ps, name, sizeof(name), &len) != 0 || expect(ps, ':') != 0)
                return -1;
            if (len >= sizeof(name))
                return fail(ps, "a tensor name of %zu bytes (at most %d)", len, TD_ST_NAME_MAX - 1);
            if (strcmp(name, "__metadata__") == 0) {
                if (metadata(ps, f) != 0)
                    return -1;
                continue;
            }
            if (add_tensor(f, ps, &t) != 0)
                return -1;
            memcpy(t->name, name, len + 1);
            if (tensor_entry(ps, t) != 0)
                return -1;
        } while (take(ps, ','));
        if (expect(ps, '}') != 0)
            return -1;
    }
    ws(ps);
    if (ps->p != ps->end)
        return fail(ps, "bytes after the header's object");
    return 0;
}

/* ---- the checks of the entries against the data --------------------------------------------- */

void td_st_shape_str(char *out, size_t size, int ndim, const int64_t *shape)
{
    size_t n = (size_t)snprintf(out, size, "(");

    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t)snprintf(out + n, size - n, "%s%lld", i > 0 ? ", " : "", (long long)shape[i]);
    if (n < size)
        snprintf(out + n, size - n, ")");
}

static int by_begin(const void *a, const void *b)
{
    const td_st_tensor *x = *(td_st_tensor *const *)a, *y = *(td_st_tensor *const *)b;

    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp((*(td_st_tensor *const *)a)->name, (*(td_st_tensor *const *)b)->name);
}

/* Each entry's dtype and byte count; names unique; the entries tiling the data exactly. */
static int check_entries(td_st_file *f, td_error_t *err)
{
    td_st_tensor **s = malloc((size_t)(f->n > 0 ? f->n : 1) * sizeof(*s));
    char shape[96];
    uint64_t at = 0;
    int rc = 0;

    if (s == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for %d tensors", f->path, f->n);
    for (int i = 0; i < f->n && rc == 0; i++) {
        td_st_tensor *t = &f->t[i];
        uint64_t count = 1, bytes;
        int size = dtype_bytes(t->dtype_name, &t->dtype);
        s[i] = t;
        for (int k = 0; k < t->ndim; k++)
            if (__builtin_mul_overflow(count, (uint64_t)t->shape[k], &count))
                count = UINT64_MAX;
        td_st_shape_str(shape, sizeof(shape), t->ndim, t->shape);
        if (size == 0)
            rc = td_error_set(err, TD_EDATA, "%s: header: tensor %s: unknown dtype \"%s\"", f->path,
                              t->name, t->dtype_name);
        else if (t->end < t->begin)
            rc = td_error_set(err, TD_EDATA,
                              "%s: header: tensor %s: data_offsets [%llu, %llu) end before they "
                              "begin",
                              f->path, t->name, (unsigned long long)t->begin,
                              (unsigned long long)t->end);
        else if (__builtin_mul_overflow(count, (uint64_t)size, &bytes) ||
                 bytes != t->end - t->begin)
            rc = td_error_set(err, TD_EDATA,
                              "%s: header: tensor %s: data_offsets [%llu, %llu) hold %llu bytes, "
                              "but %s %s takes %llu",
                              f->path, t->name, (unsigned long long)t->begin,
                              (unsigned long long)t->end, (unsigned long long)(t->end - t->begin),
                              t->dtype_name, shape,
                              count > UINT64_MAX / 8 ? 0ull : (unsigned long long)(count * size));
        else if (t->end > f->data_size)
            rc = td_error_set(err, TD_EDATA,
                              "%s: header: tensor %s: data_offsets [%llu, %llu) pass the end of "
                              "the data (%llu bytes)",
                              f->path, t->name, (unsigned long long)t->begin,
                              (unsigned long long)t->end, (unsigned long long)f->data_size);
    }
    if (rc == 0) {
        qsort(s, (size_t)f->n, sizeof(*s), by_name);
        for (int i = 1; i < f->n && rc == 0; i++)
            if (strcmp(s[i - 1]->name, s[i]->name) == 0)
                rc = td_error_set(err, TD_EDATA, "%s: header: tensor %s is named twice", f->path,
                                  s[i]->name);
    }
    if (rc == 0) {
        qsort(s, (size_t)f->n, sizeof(*s), by_begin);
        for (int i = 0; i < f->n && rc == 0; i++) {
            if (s[i]->begin != at)
                rc = td_error_set(err, TD_EDATA,
                                  "%s: header: tensor %s starts at byte %llu of the data, but the "
                                  "tensors before it end at %llu (tensors must tile the data)",
                                  f->path, s[i]->name, (unsigned long long)s[i]->begin,
                                  (unsigned long long)at);
            at = s[i]->end;
        }
        if (rc == 0 && at != f->data_size)
            rc = td_error_set(err, TD_EDATA,
                              "%s: file size: the tensors take %llu bytes of data, but %llu follow "
                              "the header",
                              f->path, (unsigned long long)at, (unsigned long long)f->data_size);
    }
    free(s);
    return rc;
}

/* ---- opening and reading -------------------------------------------------------------------- */

static int read_at(int fd, void *buf, size_t n, uint64_t off)
{
    char *p = buf;

    while (n > 0) {
        ssize_t k = pread(fd, p, n, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

int td_st_open(td_st_file **out, const char *path, td_error_t *err)
{
    td_st_file *f = calloc(1, sizeof(*f));
    unsigned char len8[8];
    uint64_t hlen = 0;
    struct stat st;
    char *json = NULL;
    parser ps = {0};
    int rc;

    *out = NULL;
    if (f == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory", path);
    f->fd = -1;
    snprintf(f->path, sizeof(f->path), "%s", path);
    if ((rc = td_data_open_path(path, TD_OPEN_MODEL, &f->fd, &st, err)) != 0)
        goto out;
    if (st.st_size < 8 || read_at(f->fd, len8, 8, 0) != 0) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not a safetensors file: %lld bytes, shorter than "
                          "the 8-byte header length",
                          path, (long long)st.st_size);
        goto out;
    }
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    if (hlen < 2 || hlen > (uint64_t)st.st_size - 8) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not a safetensors file: a header of %llu bytes (the file has %lld)",
                          path, (unsigned long long)hlen, (long long)st.st_size - 8);
        goto out;
    }
    if (hlen > TD_ST_MAX_HEADER) {
        rc = td_error_set(err, TD_E2BIG,
                          "%s: safetensors header of %llu bytes exceeds traind's "
                          "limit of %u",
                          path, (unsigned long long)hlen, TD_ST_MAX_HEADER);
        goto out;
    }
    if ((json = malloc(hlen)) == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: no memory for a %llu-byte header", path,
                          (unsigned long long)hlen);
        goto out;
    }
    if (read_at(f->fd, json, hlen, 8) != 0) {
        rc = td_error_set(err, TD_EIO, "%s: cannot read the header", path);
        goto out;
    }
    f->data_start = 8 + hlen;
    f->data_size = (uint64_t)st.st_size - f->data_start;
    ps.p = ps.start = json;
    ps.end = json + hlen;
    if (json[0] != '{') {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not a safetensors file: the header does not start "
                          "with '{'",
                          path);
        goto out;
    }
    if ((rc = parse_header(&ps, f)) != 0 && ps.too_many) {
        rc = td_error_set(err, TD_E2BIG,
                          "%s: safetensors header holds more than %d tensors, traind's limit", path,
                          TD_ST_MAX_TENSORS);
        goto out;
    }
    if (rc != 0) {
        rc = td_error_set(err, TD_EDATA, "%s: header: %s", path, ps.msg);
        goto out;
    }
    rc = check_entries(f, err);
out:
    free(json);
    if (rc != 0)
        td_st_close(f);
    else
        *out = f;
    return rc;
}

void td_st_close(td_st_file *f)
{
    if (f == NULL)
        return;
    if (f->fd >= 0)
        close(f->fd);
    free(f->t);
    free(f);
}

const char *td_st_path(const td_st_file *f)
{
    return f->path;
}

int td_st_count(const td_st_file *f)
{
    return f->n;
}

const td_st_tensor *td_st_at(const td_st_file *f, int i)
{
    return i >= 0 && i < f->n ? &f->t[i] : NULL;
}

const td_st_tensor *td_st_find(const td_st_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->t[i].name, name) == 0)
            return &f->t[i];
    return NULL;
}

const char *td_st_meta(const td_st_file *f, const char *key)
{
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_key[i], key) == 0)
            return f->meta_val[i];
    return NULL;
}

/* IEEE half to float. */
static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 31, man = h & 1023, bits;
    float f;

    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalise */
        exp = 127 - 15 + 1;
        while (!(man & 1024))
            man <<= 1, exp--;
        bits = sign | exp << 23 | (man & 1023) << 13;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    memcpy(&f, &bits, sizeof(f));
    return f;
}

int td_st_read(const td_st_file *f, const td_st_tensor *t, float *out, size_t n, int transpose,
               td_error_t *err)
{
    size_t count = 1, bytes = (size_t)(t->end - t->begin);
    int64_t r = t->ndim == 2 ? t->shape[0] : 0, c = t->ndim == 2 ? t->shape[1] : 0;
    char *buf;
    int rc;

    for (int k = 0; k < t->ndim; k++)
        count *= (size_t)t->shape[k];
    if (t->dtype == TD_ST_OTHER)
        return td_error_set(err, TD_EDATA, "%s: tensor %s is %s; traind reads F32, F16 and BF16",
                            f->path, t->name, t->dtype_name);
    if (count != n || (transpose && t->ndim != 2))
        return td_error_set(err, TD_EINVAL, "%s: tensor %s: %zu elements asked, it has %zu",
                            f->path, t->name, n, count);
    if ((rc = td_data_should_stop(f->path, err)) != 0)
        return rc;
    /* An F32 tensor read in place needs no buffer; the rest go through one. */
    buf = t->dtype == TD_ST_F32 && !transpose ? (char *)out : malloc(bytes > 0 ? bytes : 1);
    if (buf == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for tensor %s (%zu bytes)", f->path,
                            t->name, bytes);
    if (bytes > 0 && read_at(f->fd, buf, bytes, f->data_start + t->begin) != 0) {
        if (buf != (char *)out)
            free(buf);
        return td_error_set(err, TD_EDATA, "%s: tensor %s: short read (did the file change?)",
                            f->path, t->name);
    }
    for (size_t i = 0; i < count && buf != (char *)out; i++) {
        float v;
        uint16_t h;
        uint32_t bits;
        size_t at = transpose ? (i % (size_t)r) * (size_t)c + i / (size_t)r : i;
        if (t->dtype == TD_ST_F32) {
            memcpy(&v, buf + 4 * at, 4);
        } else {
            memcpy(&h, buf + 2 * at, 2);
            bits = (uint32_t)h << 16;
            if (t->dtype == TD_ST_BF16)
                memcpy(&v, &bits, 4);
            else
                v = half_to_float(h);
        }
        out[i] = v; /* out is (c, r): out[j * r + i'] = file[i'][j] with i = j * r + i' */
    }
    if (buf != (char *)out)
        free(buf);
    return 0;
}

/* ---- writing -------------------------------------------------------------------------------- */

/* A growing string for the header. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    int k;

    for (;;) {
        va_start(ap, fmt);
        k = vsnprintf(b->p != NULL ? b->p + b->n : NULL, b->p != NULL ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->p != NULL && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

/* The JSON header of tensors t[0..n) laid out back to back in order, with metadata pairs
 * meta[0..2*nmeta) (names and values here are traind's own: printable ASCII without quotes or
 * backslashes), padded with spaces to a multiple of HEADER_ALIGN. */
static int header_json(sbuf *b, const td_st_out *t, int n, const char *const *meta, int nmeta)
{
    uint64_t at = 0;

    sb_printf(b, "{\"__metadata__\":{");
    for (int i = 0; i < nmeta; i++)
        sb_printf(b, "%s\"%s\":\"%s\"", i > 0 ? "," : "", meta[2 * i], meta[2 * i + 1]);
    sb_printf(b, "}");
    for (int i = 0; i < n; i++) {
        uint64_t count = 1;
        sb_printf(b, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", t[i].name);
        for (int k = 0; k < t[i].ndim; k++) {
            sb_printf(b, "%s%lld", k > 0 ? "," : "", (long long)t[i].shape[k]);
            count *= (uint64_t)t[i].shape[k];
        }
        sb_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)at,
                  (unsigned long long)(at + 4 * count));
        at += 4 * count;
    }
    sb_printf(b, "}");
    while (!b->oom && (b->n + 8) % HEADER_ALIGN != 0)
        sb_printf(b, " ");
    return b->oom ? -1 : 0;
}

static int write_tensor(FILE *f, const td_st_out *t, float *row)
{
    uint64_t count = 1;

    for (int k = 0; k < t->ndim; k++)
        count *= (uint64_t)t->shape[k];
    if (!t->transpose)
        return fwrite(t->src, sizeof(float), count, f) == count ? 0 : -1;
    /* file (R, C) from src (C, R): row r of the file is column r of src */
    for (int64_t r = 0; r < t->shape[0]; r++) {
        for (int64_t c = 0; c < t->shape[1]; c++)
            row[c] = t->src[c * t->shape[0] + r];
        if (fwrite(row, sizeof(float), (size_t)t->shape[1], f) != (size_t)t->shape[1])
            return -1;
    }
    return 0;
}

int td_st_write(const char *path, const td_st_out *t, int n, const char *const *meta, int nmeta,
                td_error_t *err)
{
    char tmp[TD_PATH_MAX + 16];
    unsigned char len8[8];
    int64_t widest = 1;
    sbuf b = {0};
    float *row = NULL;
    FILE *f = NULL;
    int rc = 0;

    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return td_error_set(err, TD_EINVAL, "%s: path too long", path);
    for (int i = 0; i < n; i++)
        if (t[i].transpose && t[i].shape[1] > widest)
            widest = t[i].shape[1];
    if (header_json(&b, t, n, meta, nmeta) != 0 ||
        (row = malloc((size_t)widest * sizeof(float))) == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: no memory for the header", path);
        goto out;
    }
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)b.n >> (8 * i));
    if ((f = fopen(tmp, "wb")) == NULL) {
        rc = td_error_set(err, TD_EIO, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    if (fwrite(len8, 8, 1, f) != 1 || fwrite(b.p, 1, b.n, f) != b.n)
        rc = -1;
    for (int i = 0; i < n && rc == 0; i++)
        rc = write_tensor(f, &t[i], row);
    if (rc == 0 && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        rc = -1;
    if (fclose(f) != 0)
        rc = -1;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -1;
    if (rc != 0) {
        rc = td_error_set(err, errno == ENOSPC ? TD_EDISKFULL : TD_EIO, "%s: cannot write: %s",
                          path, strerror(errno));
        unlink(tmp);
    }
out:
    free(b.p);
    free(row);
    return rc;
}
