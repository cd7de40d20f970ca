/* safetensors files (safetensors.h): the header's JSON read by a small strict parser of the
 * format's own grammar (an object of tensor entries and one object of string metadata), the
 * checks of every entry against the data before any of it is read, float tensors read (and
 * widened from F16/BF16), and the writer traind's exports go through; then the two models'
 * names and layouts. Runs on the caller's thread: a worker building a trainer, the daemon's
 * threadpool (export), the loop thread at submit (headers only). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data.h"
#include "engine.h"
#include "safetensors.h"
#include "sizes.h"

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
        if (f->n == TD_ST_MAX_TENSORS)
            return fail(ps, "more than %d tensors", TD_ST_MAX_TENSORS);
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

static void shape_str(char *out, size_t size, int ndim, const int64_t *shape)
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
        shape_str(shape, sizeof(shape), t->ndim, t->shape);
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

static int open_fd(td_st_file *f, const char *path, struct stat *st, td_error_t *err)
{
    int fd = td_data_open_fd(path, st);

    if (fd < 0)
        return td_error_set(err,
                            fd == -ENOENT                   ? TD_ENOTFOUND
                            : fd == -EACCES || fd == -EPERM ? TD_EPERM
                                                            : TD_EIO,
                            "%s: %s", path, strerror(-fd));
    f->fd = fd;
    if (!S_ISREG(st->st_mode))
        return td_error_set(err, TD_EDATA, "%s: not a regular file (%s)", path,
                            td_data_file_kind(st->st_mode));
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
    if ((rc = open_fd(f, path, &st, err)) != 0)
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
    if (hlen < 2 || hlen > TD_ST_MAX_HEADER || hlen > (uint64_t)st.st_size - 8) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not a safetensors file: a header of %llu bytes (the file has "
                          "%lld; at most %u)",
                          path, (unsigned long long)hlen, (long long)st.st_size - 8,
                          TD_ST_MAX_HEADER);
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
    if (parse_header(&ps, f) != 0) {
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

/* One tensor to write: its name and shape in the file, its floats, and whether they are stored
 * transposed here (src is (shape[1], shape[0]) and the file gets its transpose). */
typedef struct st_out {
    char name[TD_SLM_NAME_MAX + 16];
    int ndim;
    int64_t shape[4];
    const float *src;
    int transpose;
} st_out;

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
static int header_json(sbuf *b, const st_out *t, int n, const char *const *meta, int nmeta)
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

static int write_tensor(FILE *f, const st_out *t, float *row)
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

/* Writes the file through path.tmp, renamed over path when whole. */
static int st_write(const char *path, const st_out *t, int n, const char *const *meta, int nmeta,
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

/* ---- gpt: Hugging Face GPT-2's names ----------------------------------------------------------
 */

/* The per-layer tensors of td_gpt's layer[l][i] (i = tensor - 2) under GPT-2's names, and
 * whether Hugging Face stores them transposed (Conv1D's (in, out) weights). */
static const struct {
    const char *name;
    int transpose;
} gpt_layer[TD_GPT_LAYER_T] = {
    {"ln_1.weight", 0},      {"ln_1.bias", 0},          {"attn.c_attn.weight", 1},
    {"attn.c_attn.bias", 0}, {"attn.c_proj.weight", 1}, {"attn.c_proj.bias", 0},
    {"ln_2.weight", 0},      {"ln_2.bias", 0},          {"mlp.c_fc.weight", 1},
    {"mlp.c_fc.bias", 0},    {"mlp.c_proj.weight", 1},  {"mlp.c_proj.bias", 0},
};

/* The file's shape of layer tensor i for channels C: traind's per-layer shape, transposed for
 * the Conv1D weights. */
static int gpt_layer_shape(int i, int64_t C, int64_t *shape)
{
    static const int rows[TD_GPT_LAYER_T] = {1, 1, 3, 3, 1, 1, 1, 1, 4, 4, 1, 1};
    static const int cols[TD_GPT_LAYER_T] = {0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 0};

    shape[0] = rows[i] * C;
    if (cols[i] == 0)
        return 1;
    shape[1] = cols[i] * C;
    if (gpt_layer[i].transpose) {
        int64_t s = shape[0];
        shape[0] = shape[1];
        shape[1] = s;
    }
    return 2;
}

static int export_gpt(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_gpt *m = calloc(1, sizeof(*m));
    td_params p = {0};
    st_out *t = NULL;
    char nums[7][24];
    const char *meta[16];
    int64_t step = 0;
    int n = 0, rc;

    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_load_gpt(cfg, m, &p, &step, err);
    if (rc == 0 && (t = calloc(4 + TD_GPT_LAYER_T * (size_t)m->d.L, sizeof(*t))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    if (rc != 0)
        goto out;
    /* wte's first V rows: Hugging Face's vocabulary is the real one; the Vp - V padded rows
     * traind keeps for the lm head's alignment are never a token's and stay zero. */
    t[n++] = (st_out){"wte.weight", 2, {m->d.V, m->d.C}, m->p[TD_GPT_WTE].data, 0};
    t[n++] = (st_out){"wpe.weight", 2, {m->d.maxT, m->d.C}, m->p[TD_GPT_WPE].data, 0};
    for (int l = 0; l < m->d.L; l++)
        for (int i = 0; i < TD_GPT_LAYER_T; i++, n++) {
            snprintf(t[n].name, sizeof(t[n].name), "h.%d.%s", l, gpt_layer[i].name);
            t[n].ndim = gpt_layer_shape(i, m->d.C, t[n].shape);
            t[n].src = m->layer[l][i].data;
            t[n].transpose = gpt_layer[i].transpose;
        }
    t[n++] = (st_out){"ln_f.weight", 1, {m->d.C}, m->p[TD_GPT_LNFW].data, 0};
    t[n++] = (st_out){"ln_f.bias", 1, {m->d.C}, m->p[TD_GPT_LNFB].data, 0};
    snprintf(nums[0], sizeof(nums[0]), "%d", m->d.L);
    snprintf(nums[1], sizeof(nums[1]), "%d", m->d.NH);
    snprintf(nums[2], sizeof(nums[2]), "%d", m->d.C);
    snprintf(nums[3], sizeof(nums[3]), "%d", m->d.maxT);
    snprintf(nums[4], sizeof(nums[4]), "%d", m->d.V);
    snprintf(nums[5], sizeof(nums[5]), "%lld", (long long)step);
    meta[0] = "format", meta[1] = "pt";
    meta[2] = "traind.model", meta[3] = "gpt";
    meta[4] = "n_layer", meta[5] = nums[0];
    meta[6] = "n_head", meta[7] = nums[1];
    meta[8] = "n_embd", meta[9] = nums[2];
    meta[10] = "n_positions", meta[11] = nums[3];
    meta[12] = "vocab_size", meta[13] = nums[4];
    meta[14] = "step", meta[15] = nums[5];
    rc = st_write(out_path, t, n, meta, 8, err);
out:
    free(t);
    td_params_free(&p);
    free(m);
    return rc;
}

/* name, or "transformer." + name (GPT2LMHeadModel's files), in f. */
static const td_st_tensor *gpt_find(const td_st_file *f, const char *name)
{
    char full[TD_ST_NAME_MAX];
    const td_st_tensor *t = td_st_find(f, name);

    if (t != NULL)
        return t;
    snprintf(full, sizeof(full), "transformer.%s", name);
    return td_st_find(f, full);
}

/* name with the shape the model needs, a float type. */
static int need(const td_st_file *f, const char *name, int ndim, const int64_t *shape,
                const td_st_tensor **out, td_error_t *err)
{
    const td_st_tensor *t = gpt_find(f, name);
    char have[96], want[96];

    shape_str(want, sizeof(want), ndim, shape);
    if (t == NULL)
        return td_error_set(err, TD_EDATA, "%s: no tensor %s (the model needs one of %s)", f->path,
                            name, want);
    shape_str(have, sizeof(have), t->ndim, t->shape);
    if (t->ndim != ndim || memcmp(t->shape, shape, (size_t)ndim * sizeof(*shape)) != 0)
        return td_error_set(err, TD_EDATA, "%s: tensor %s: %s in the file, the model needs %s",
                            f->path, name, have, want);
    if (t->dtype == TD_ST_OTHER)
        return td_error_set(err, TD_EDATA, "%s: tensor %s is %s; traind reads F32, F16 and BF16",
                            f->path, name, t->dtype_name);
    *out = t;
    return 0;
}

/* The dimensions of f's GPT-2, every tensor's shape checked. */
static int gpt_dims_of(const td_st_file *f, int n_head, td_gpt_dims *d, td_error_t *err)
{
    const td_st_tensor *wte = gpt_find(f, "wte.weight"), *wpe = gpt_find(f, "wpe.weight"), *t;
    const char *mh = td_st_meta(f, "n_head");
    char name[64];
    int64_t shape[2];
    td_error_t e = {0};
    int rc;

    if (wte == NULL || wte->ndim != 2)
        return td_error_set(err, TD_EDATA, "%s: no 2-D tensor wte.weight: not a GPT-2", f->path);
    if (wpe == NULL || wpe->ndim != 2)
        return td_error_set(err, TD_EDATA, "%s: no 2-D tensor wpe.weight: not a GPT-2", f->path);
    if (wte->shape[0] > 1 << 20 || wte->shape[1] > 1 << 20 || wpe->shape[0] > 1 << 20)
        return td_error_set(err, TD_EDATA, "%s: wte.weight or wpe.weight is too large", f->path);
    memset(d, 0, sizeof(*d));
    d->V = (int)wte->shape[0];
    d->C = (int)wte->shape[1];
    d->maxT = (int)wpe->shape[0];
    for (d->L = 0; d->L <= TD_GPT_MAX_LAYERS; d->L++) {
        snprintf(name, sizeof(name), "h.%d.ln_1.weight", d->L);
        if (gpt_find(f, name) == NULL)
            break;
    }
    d->Vp = td_gpt_padded_vocab(d->V);
    if (mh != NULL) {
        char *end;
        long v = strtol(mh, &end, 10);
        if (*mh == '\0' || *end != '\0' || v < 1 || v > 1 << 20)
            return td_error_set(err, TD_EDATA, "%s: __metadata__ n_head: \"%s\" is not a number",
                                f->path, mh);
        d->NH = (int)v;
    } else if (n_head > 0) {
        d->NH = n_head;
    } else {
        return td_error_set(err, TD_EDATA,
                            "%s: the file does not say its n_head (no __metadata__ n_head): give "
                            "model.n_head",
                            f->path);
    }
    if (td_gpt_check_dims(d, &e) != 0)
        return td_error_set(err, TD_EDATA, "%s: %s", f->path, e.msg);
    shape[0] = d->maxT, shape[1] = d->C;
    if ((rc = need(f, "wpe.weight", 2, shape, &t, err)) != 0)
        return rc;
    for (int l = 0; l < d->L; l++)
        for (int i = 0; i < TD_GPT_LAYER_T; i++) {
            int nd = gpt_layer_shape(i, d->C, shape);
            snprintf(name, sizeof(name), "h.%d.%s", l, gpt_layer[i].name);
            if ((rc = need(f, name, nd, shape, &t, err)) != 0)
                return rc;
        }
    shape[0] = d->C;
    if ((rc = need(f, "ln_f.weight", 1, shape, &t, err)) != 0 ||
        (rc = need(f, "ln_f.bias", 1, shape, &t, err)) != 0)
        return rc;
    if (wte->dtype == TD_ST_OTHER)
        return td_error_set(err, TD_EDATA,
                            "%s: tensor wte.weight is %s; traind reads F32, F16 "
                            "and BF16",
                            f->path, wte->dtype_name);
    return 0;
}

int td_st_gpt_peek(const char *path, int n_head, td_gpt_dims *d, td_error_t *err)
{
    td_st_file *f;
    int rc = td_st_open(&f, path, err);

    if (rc == 0)
        rc = gpt_dims_of(f, n_head, d, err);
    td_st_close(f);
    return rc;
}

int td_st_gpt_load(const char *path, td_gpt *m, td_error_t *err)
{
    td_st_file *f;
    td_gpt_dims d;
    char name[64];
    int rc = td_st_open(&f, path, err);

    if (rc == 0)
        rc = gpt_dims_of(f, m->d.NH, &d, err);
    if (rc == 0 && memcmp(&d, &m->d, sizeof(d)) != 0)
        rc = td_error_set(err, TD_ESHAPE,
                          "%s: maxT %d, V %d, L %d, NH %d, C %d, but the model is maxT %d, V %d, "
                          "L %d, NH %d, C %d",
                          path, d.maxT, d.V, d.L, d.NH, d.C, m->d.maxT, m->d.V, m->d.L, m->d.NH,
                          m->d.C);
    if (rc == 0) {
        memset(m->p[TD_GPT_WTE].data, 0, m->p[TD_GPT_WTE].n * sizeof(float));
        rc = td_st_read(f, gpt_find(f, "wte.weight"), m->p[TD_GPT_WTE].data,
                        (size_t)d.V * (size_t)d.C, 0, err);
    }
    if (rc == 0)
        rc = td_st_read(f, gpt_find(f, "wpe.weight"), m->p[TD_GPT_WPE].data, m->p[TD_GPT_WPE].n, 0,
                        err);
    for (int l = 0; l < d.L && rc == 0; l++)
        for (int i = 0; i < TD_GPT_LAYER_T && rc == 0; i++) {
            snprintf(name, sizeof(name), "h.%d.%s", l, gpt_layer[i].name);
            rc = td_st_read(f, gpt_find(f, name), m->layer[l][i].data, m->layer[l][i].n,
                            gpt_layer[i].transpose, err);
        }
    if (rc == 0)
        rc = td_st_read(f, gpt_find(f, "ln_f.weight"), m->p[TD_GPT_LNFW].data, (size_t)d.C, 0, err);
    if (rc == 0)
        rc = td_st_read(f, gpt_find(f, "ln_f.bias"), m->p[TD_GPT_LNFB].data, (size_t)d.C, 0, err);
    td_st_close(f);
    return rc;
}

/* ---- sensorlm: the README's names ------------------------------------------------------------ */

static int export_sensorlm(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0};
    st_out *t = NULL;
    float *norm = NULL;
    int64_t step = 0;
    td_slm_dims d;
    char nums[19][24];
    const char *meta[2 * 21];
    int n = 0, k = 0, rc;

    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model");
    rc = td__train_slm_dims(cfg, &d, NULL, err);
    if (rc == 0 && (norm = malloc(2 * (size_t)d.C * sizeof(float))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for a model");
    if (rc == 0)
        rc = td__train_load_sensorlm(cfg, m, &p, &step, norm, err);
    if (rc == 0 && (t = calloc((size_t)m->n + 2, sizeof(*t))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    if (rc != 0)
        goto out;
    for (int i = 0; i < m->n; i++, n++) {
        snprintf(t[n].name, sizeof(t[n].name), "%s", m->name[i]);
        t[n].ndim = m->p[i].ndim;
        for (int j = 0; j < m->p[i].ndim; j++)
            t[n].shape[j] = m->p[i].shape[j];
        t[n].src = m->p[i].data;
    }
    t[n++] = (st_out){"norm.mean", 1, {d.C}, norm, 0};
    t[n++] = (st_out){"norm.std", 1, {d.C}, norm + d.C, 0};
    {
        const char *keys[] = {
            "time_steps",   "channels",       "patch_t",      "patch_c",       "text_len",
            "embed_dim",    "sensor.d_model", "sensor.depth", "sensor.n_head", "sensor.mlp_dim",
            "text.d_model", "text.depth",     "text.n_head",  "text.mlp_dim",  "step"};
        long long vals[] = {d.T,   d.C,   d.pt,  d.pc,      d.L,   d.E,   d.s.D,          d.s.depth,
                            d.s.H, d.s.M, d.t.D, d.t.depth, d.t.H, d.t.M, (long long)step};
        meta[k++] = "format", meta[k++] = "pt";
        meta[k++] = "traind.model", meta[k++] = "sensorlm";
        meta[k++] = "sensor.pool", meta[k++] = d.pool == TD_SLM_POOL_GAP ? "gap" : "map";
        for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
            snprintf(nums[i], sizeof(nums[i]), "%lld", vals[i]);
            meta[k++] = keys[i];
            meta[k++] = nums[i];
        }
    }
    rc = st_write(out_path, t, n, meta, k / 2, err);
out:
    free(t);
    free(norm);
    td_params_free(&p);
    free(m);
    return rc;
}

int td_export_safetensors(const td_train_config *cfg, const char *out_path, td_error_t *err)
{
    if (cfg->model == TD_MODEL_GPT)
        return export_gpt(cfg, out_path, err);
    if (cfg->model == TD_MODEL_SENSORLM)
        return export_sensorlm(cfg, out_path, err);
    return td_error_set(err, TD_EINVAL, "only gpt and sensorlm jobs export to safetensors");
}

/* Every parameter of m under its name with its shape, of a float dtype. */
static int slm_check(const td_st_file *f, const td_sensorlm *m, td_error_t *err)
{
    char have[96], want[96];

    for (int i = 0; i < m->n; i++) {
        const td_st_tensor *t = td_st_find(f, m->name[i]);
        int64_t shape[TD_TENSOR_MAX_DIMS];
        int same;
        for (int j = 0; j < m->p[i].ndim; j++)
            shape[j] = m->p[i].shape[j];
        shape_str(want, sizeof(want), m->p[i].ndim, shape);
        if (t == NULL)
            return td_error_set(err, TD_EDATA, "%s: no tensor %s (the job's model has one of %s)",
                                f->path, m->name[i], want);
        same = t->ndim == m->p[i].ndim &&
               memcmp(t->shape, shape, (size_t)t->ndim * sizeof(*shape)) == 0;
        shape_str(have, sizeof(have), t->ndim, t->shape);
        if (!same)
            return td_error_set(err, TD_ESHAPE,
                                "%s: tensor %s: %s in the file, the job's model "
                                "has %s",
                                f->path, m->name[i], have, want);
        if (t->dtype == TD_ST_OTHER)
            return td_error_set(err, TD_EDATA,
                                "%s: tensor %s is %s; traind reads F32, F16 and "
                                "BF16",
                                f->path, m->name[i], t->dtype_name);
    }
    return 0;
}

int td_st_slm_check(const char *path, const td_sensorlm *m, td_error_t *err)
{
    td_st_file *f;
    int rc = td_st_open(&f, path, err);

    if (rc == 0)
        rc = slm_check(f, m, err);
    td_st_close(f);
    return rc;
}

int td_st_slm_load(const char *path, td_sensorlm *m, td_error_t *err)
{
    td_st_file *f;
    int rc = td_st_open(&f, path, err);

    if (rc == 0)
        rc = slm_check(f, m, err);
    for (int i = 0; i < m->n && rc == 0; i++)
        rc = td_st_read(f, td_st_find(f, m->name[i]), m->p[i].data, m->p[i].n, 0, err);
    td_st_close(f);
    return rc;
}
