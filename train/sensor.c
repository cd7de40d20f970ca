/* Sensor shards (sensor.h): the header codec and its checks, the reader (pread, bounded) and
 * the writer (FILE.tmp, renamed when whole). Owns nothing global; a reader's fd, labels and
 * label table belong to its td_sensor, a writer's fd and statistics to its td_sensor_writer.
 * Called from daemon/jobspec.c at submit time (td_sensor_check), from the trainer's open and
 * its workers (td_sensor_open, td_sensor_read), and from trainctl's local tools (writer). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/sensor.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "sensor shards are little-endian and their floats are read as they are"
#endif

/* Offsets of the header's fixed fields (README.md, "Sensor data"). */
enum {
    OFF_MAGIC = 0,
    OFF_VERSION = 8,
    OFF_HEADER_BYTES = 12,
    OFF_T = 16,
    OFF_C = 20,
    OFF_N = 24,
    OFF_CAPTION_LEN = 32,
    OFF_LABELS = 36,
    OFF_PERIOD = 40,
    OFF_SPLIT = 44,
    OFF_RESERVED = 48,  /* to 256, zero */
    OFF_CHANNELS = 256, /* TD_SENSOR_MAX_CHANNELS entries of CHANNEL_BYTES */
    CHANNEL_BYTES = 64, /* name[32], unit[16], mean, std, 8 reserved */
    CH_OFF_MEAN = 48,
    CH_OFF_STD = 52,
    CH_OFF_RESERVED = 56,
    LABEL_OFF_PROMPT = 32 /* in a label table entry: name[32], then prompt[96] */
};

_Static_assert(OFF_CHANNELS + TD_SENSOR_MAX_CHANNELS * CHANNEL_BYTES == TD_SENSOR_HEADER_BYTES,
               "the channel table fills the header");
_Static_assert(TD_SENSOR_NAME_BYTES + TD_SENSOR_PROMPT_BYTES == TD_SENSOR_LABEL_BYTES,
               "a label entry is a name and a prompt");

#define STD_FLOOR 1e-6 /* a std below this is stored as 1: the channel is constant */

/* ---- little-endian fields ------------------------------------------------------------------ */

static uint32_t ld32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t ld64(const unsigned char *p)
{
    return (uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32;
}

static float ldf(const unsigned char *p)
{
    uint32_t u = ld32(p);
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
}

static void st32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void st64(unsigned char *p, uint64_t v)
{
    st32(p, (uint32_t)v);
    st32(p + 4, (uint32_t)(v >> 32));
}

static void stf(unsigned char *p, float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    st32(p, u);
}

/* ---- sizes and checks ---------------------------------------------------------------------- */

/* Section offsets of a header whose counts are within the limits. */
typedef struct layout {
    uint64_t samples, labels, table, captions, end;
} layout;

static layout layout_of(const td_sensor_header *h)
{
    layout l;
    uint64_t n = (uint64_t)h->N, k = h->n_labels > 0 ? (uint64_t)h->n_labels : 0;

    l.samples = TD_SENSOR_HEADER_BYTES;
    l.labels = l.samples + n * (uint64_t)h->T * (uint64_t)h->C * sizeof(float);
    l.table = l.labels + (k > 0 ? n * sizeof(int32_t) : 0);
    l.captions = l.table + k * TD_SENSOR_LABEL_BYTES;
    l.end = l.captions + n * (uint64_t)h->caption_len;
    return l;
}

uint64_t td_sensor_file_bytes(const td_sensor_header *h)
{
    return layout_of(h).end;
}

/* A count field: lo..hi, else TD_EDATA below and TD_E2BIG above, naming the field. */
static int check_count(const char *path, const char *field, int64_t v, int64_t lo, int64_t hi,
                       td_error_t *err)
{
    if (v >= lo && v <= hi)
        return 0;
    return td_error_set(err, v > hi ? TD_E2BIG : TD_EDATA,
                        "%s: header field %s: %lld, must be %lld to %lld", path, field,
                        (long long)v, (long long)lo, (long long)hi);
}

/* A name, unit or prompt slot of size bytes: NUL-terminated inside the slot, every byte before
 * the NUL allowed, and nothing but NULs after it; at least min bytes long. ascii: printable
 * ASCII only (names, units); else any byte but controls (prompts may be UTF-8). */
static int check_text(const char *path, const char *field, const char *s, size_t size, size_t min,
                      int ascii, td_error_t *err)
{
    size_t len = strnlen(s, size);

    if (len == size)
        return td_error_set(err, TD_EDATA, "%s: %s: not NUL-terminated within its %zu bytes", path,
                            field, size);
    if (len < min)
        return td_error_set(err, TD_EDATA, "%s: %s: empty", path, field);
    for (size_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)s[i];
        if (b < 0x20 || b == 0x7f || (ascii && b > 0x7e))
            return td_error_set(err, TD_EDATA, "%s: %s: byte 0x%02x at offset %zu is not %s", path,
                                field, b, i, ascii ? "printable ASCII" : "printable text");
    }
    for (size_t i = len; i < size; i++)
        if (s[i] != '\0')
            return td_error_set(err, TD_EDATA, "%s: %s: nonzero byte after its end", path, field);
    return 0;
}

/* The counts of h. */
static int check_counts(const char *path, const td_sensor_header *h, td_error_t *err)
{
    int rc;

    if ((rc = check_count(path, "time_steps", h->T, 1, TD_SENSOR_MAX_T, err)) != 0 ||
        (rc = check_count(path, "channels", h->C, 1, TD_SENSOR_MAX_CHANNELS, err)) != 0 ||
        (rc = check_count(path, "samples", h->N, 1, TD_SENSOR_MAX_SAMPLES, err)) != 0 ||
        (rc = check_count(path, "caption_len", h->caption_len, 1, TD_SENSOR_MAX_CAPTION, err)) !=
            0 ||
        (rc = check_count(path, "labels", h->n_labels, 0, TD_SENSOR_MAX_LABELS, err)) != 0 ||
        (rc = check_count(path, "period_s", h->period_s, 0, TD_SENSOR_MAX_PERIOD, err)) != 0)
        return rc;
    return check_count(path, "split", h->split, 0, TD_SENSOR_SPLIT_VALID, err);
}

/* The channel names and units of h, whose counts are good. */
static int check_names(const char *path, const td_sensor_header *h, td_error_t *err)
{
    char field[64];
    int rc;

    for (int c = 0; c < h->C; c++) {
        snprintf(field, sizeof(field), "header field channel[%d].name", c);
        rc = check_text(path, field, h->ch[c].name, TD_SENSOR_NAME_BYTES, 1, 1, err);
        if (rc != 0)
            return rc;
        snprintf(field, sizeof(field), "header field channel[%d].unit", c);
        rc = check_text(path, field, h->ch[c].unit, TD_SENSOR_UNIT_BYTES, 0, 1, err);
        if (rc != 0)
            return rc;
        for (int d = 0; d < c; d++)
            if (strcmp(h->ch[d].name, h->ch[c].name) == 0)
                return td_error_set(err, TD_EDATA,
                                    "%s: header field channel[%d].name: \"%s\" again (channel "
                                    "%d has it)",
                                    path, c, h->ch[c].name, d);
    }
    return 0;
}

/* A writer's caller gave a bad header or value: TD_EINVAL, where a reader says TD_EDATA. */
static int as_einval(int rc, td_error_t *err)
{
    if (rc != TD_EDATA)
        return rc;
    if (err != NULL)
        err->code = TD_EINVAL;
    return TD_EINVAL;
}

/* One channel's mean and std. */
static int check_stat(const char *path, int c, const char *name, float mean, float std,
                      td_error_t *err)
{
    if (!isfinite(mean))
        return td_error_set(err, TD_EDATA,
                            "%s: header field channel[%d].mean (%s): %g, must be "
                            "finite",
                            path, c, name, (double)mean);
    if (!isfinite(std) || !(std > 0))
        return td_error_set(err, TD_EDATA,
                            "%s: header field channel[%d].std (%s): %g, must be finite and > 0",
                            path, c, name, (double)std);
    return 0;
}

/* A short printable rendering of n bytes, for a message about bad bytes. */
static void printable(char *out, size_t size, const unsigned char *p, size_t n)
{
    size_t o = 0;

    for (size_t i = 0; i < n && o + 5 < size; i++)
        o += (size_t)snprintf(out + o, size - o, p[i] >= 0x20 && p[i] < 0x7f ? "%c" : "\\x%02x",
                              p[i]);
    out[o] = '\0';
}

/* Decodes and checks the header bytes b of path. */
static int decode_header(const char *path, const unsigned char *b, td_sensor_header *h,
                         td_error_t *err)
{
    char shown[64];
    int rc;

    memset(h, 0, sizeof(*h));
    if (memcmp(b + OFF_MAGIC, TD_SENSOR_MAGIC, 8) != 0) {
        printable(shown, sizeof(shown), b + OFF_MAGIC, 8);
        return td_error_set(err, TD_EDATA,
                            "%s: header field magic: \"%s\", but a sensor shard starts with "
                            "\"" TD_SENSOR_MAGIC "\"",
                            path, shown);
    }
    h->version = (int32_t)ld32(b + OFF_VERSION);
    if (h->version != TD_SENSOR_VERSION)
        return td_error_set(err, TD_EDATA,
                            "%s: header field version: %d, but only version %d is read", path,
                            (int)h->version, TD_SENSOR_VERSION);
    if (ld32(b + OFF_HEADER_BYTES) != TD_SENSOR_HEADER_BYTES)
        return td_error_set(err, TD_EDATA, "%s: header field header_bytes: %u, must be %d", path,
                            ld32(b + OFF_HEADER_BYTES), TD_SENSOR_HEADER_BYTES);
    h->T = (int32_t)ld32(b + OFF_T);
    h->C = (int32_t)ld32(b + OFF_C);
    h->N = (int64_t)ld64(b + OFF_N);
    h->caption_len = (int32_t)ld32(b + OFF_CAPTION_LEN);
    h->n_labels = (int32_t)ld32(b + OFF_LABELS);
    h->period_s = (int32_t)ld32(b + OFF_PERIOD);
    h->split = (int32_t)ld32(b + OFF_SPLIT);
    if ((rc = check_counts(path, h, err)) != 0)
        return rc;
    for (int i = OFF_RESERVED; i < OFF_CHANNELS; i++)
        if (b[i] != 0)
            return td_error_set(err, TD_EDATA,
                                "%s: header field reserved: byte %d is %u, must be 0", path, i,
                                b[i]);
    for (int c = 0; c < TD_SENSOR_MAX_CHANNELS; c++) {
        const unsigned char *e = b + OFF_CHANNELS + c * CHANNEL_BYTES;
        int used = c < h->C;
        int first = used ? CH_OFF_RESERVED : 0; /* where an entry's must-be-zero bytes begin */
        for (int i = first; i < CHANNEL_BYTES; i++)
            if (e[i] != 0)
                return td_error_set(err, TD_EDATA,
                                    "%s: header field channel[%d]%s: byte %d is %u, must be 0",
                                    path, c, used ? ".reserved" : " (unused)", i, e[i]);
        if (!used)
            continue;
        memcpy(h->ch[c].name, e, TD_SENSOR_NAME_BYTES);
        memcpy(h->ch[c].unit, e + TD_SENSOR_NAME_BYTES, TD_SENSOR_UNIT_BYTES);
        h->ch[c].mean = ldf(e + CH_OFF_MEAN);
        h->ch[c].std = ldf(e + CH_OFF_STD);
    }
    if ((rc = check_names(path, h, err)) != 0)
        return rc;
    for (int c = 0; c < h->C; c++)
        if ((rc = check_stat(path, c, h->ch[c].name, h->ch[c].mean, h->ch[c].std, err)) != 0)
            return rc;
    return 0;
}

static void encode_header(const td_sensor_header *h, unsigned char *b)
{
    memset(b, 0, TD_SENSOR_HEADER_BYTES);
    memcpy(b + OFF_MAGIC, TD_SENSOR_MAGIC, 8);
    st32(b + OFF_VERSION, TD_SENSOR_VERSION);
    st32(b + OFF_HEADER_BYTES, TD_SENSOR_HEADER_BYTES);
    st32(b + OFF_T, (uint32_t)h->T);
    st32(b + OFF_C, (uint32_t)h->C);
    st64(b + OFF_N, (uint64_t)h->N);
    st32(b + OFF_CAPTION_LEN, (uint32_t)h->caption_len);
    st32(b + OFF_LABELS, (uint32_t)h->n_labels);
    st32(b + OFF_PERIOD, (uint32_t)h->period_s);
    st32(b + OFF_SPLIT, (uint32_t)h->split);
    for (int c = 0; c < h->C; c++) {
        unsigned char *e = b + OFF_CHANNELS + c * CHANNEL_BYTES;
        memcpy(e, h->ch[c].name, TD_SENSOR_NAME_BYTES);
        memcpy(e + TD_SENSOR_NAME_BYTES, h->ch[c].unit, TD_SENSOR_UNIT_BYTES);
        stf(e + CH_OFF_MEAN, h->ch[c].mean);
        stf(e + CH_OFF_STD, h->ch[c].std);
    }
}

/* The model's needs. */
static int check_expect(const char *path, const td_sensor_header *h, const td_sensor_expect *want,
                        td_error_t *err)
{
    if (want == NULL)
        return 0;
    if (want->T > 0 && h->T != want->T)
        return td_error_set(err, TD_ESHAPE,
                            "%s: header field time_steps: %d, but the model expects %d", path,
                            (int)h->T, want->T);
    if (want->C > 0 && h->C != want->C)
        return td_error_set(err, TD_ESHAPE,
                            "%s: header field channels: %d, but the model expects %d", path,
                            (int)h->C, want->C);
    if (want->labels && h->n_labels == 0)
        return td_error_set(err, TD_ESHAPE,
                            "%s: header field labels: 0, but the job needs labelled samples", path);
    return 0;
}

/* ---- reading ------------------------------------------------------------------------------- */

/* Reads n bytes at off; a short read is TD_EDATA (the file is shorter than its header says). */
static int pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path, const char *what,
                     td_error_t *err)
{
    size_t got = 0;

    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return td_error_set(err, TD_EIO, "%s: reading %s: %s", path, what, strerror(errno));
        if (r == 0)
            return td_error_set(err, TD_EDATA,
                                "%s: reading %s: %zu of %zu bytes at offset %llu: the file "
                                "changed since its header was checked",
                                path, what, got, n, (unsigned long long)off);
        got += (size_t)r;
    }
    return 0;
}

/* Checks the open file fd (named path in messages): a regular file, its header and its size
 * against the header. */
static int check_fd(int fd, const char *path, const td_sensor_expect *want, td_sensor_header *h,
                    td_error_t *err)
{
    unsigned char b[TD_SENSOR_HEADER_BYTES];
    struct stat st;
    uint64_t want_size;
    int rc;

    if (fstat(fd, &st) != 0)
        return td_error_set(err, TD_EIO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return td_error_set(err, TD_EDATA, "%s: not a regular file", path);
    if (st.st_size < TD_SENSOR_HEADER_BYTES)
        return td_error_set(err, TD_EDATA,
                            "%s: file size: %lld bytes, shorter than a sensor shard's %d-byte "
                            "header",
                            path, (long long)st.st_size, TD_SENSOR_HEADER_BYTES);
    if ((rc = pread_all(fd, b, sizeof(b), 0, path, "the header", err)) != 0 ||
        (rc = decode_header(path, b, h, err)) != 0)
        return rc;
    want_size = td_sensor_file_bytes(h);
    if ((uint64_t)st.st_size != want_size)
        return td_error_set(err, TD_EDATA,
                            "%s: file size: %lld bytes, but the header's %lld samples of %d x %d, "
                            "caption_len %d and %d labels take %llu",
                            path, (long long)st.st_size, (long long)h->N, (int)h->T, (int)h->C,
                            (int)h->caption_len, (int)h->n_labels, (unsigned long long)want_size);
    return check_expect(path, h, want, err);
}

/* Opens path read-only and checks its header and size; *fd stays open on success. */
static int open_checked(const char *path, const td_sensor_expect *want, td_sensor_header *h,
                        int *fd, td_error_t *err)
{
    int rc;

    /* O_NONBLOCK: a FIFO named as a shard must not hang the caller (traind's loop thread at
     * submit) in open(); it is then refused as not a regular file. */
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (*fd < 0)
        return td_error_set(err, errno == ENOENT ? TD_ENOTFOUND : TD_EIO, "%s: %s", path,
                            strerror(errno));
    if ((rc = check_fd(*fd, path, want, h, err)) != 0) {
        close(*fd);
        *fd = -1;
    }
    return rc;
}

int td_sensor_check(const char *path, const td_sensor_expect *want, td_sensor_header *out,
                    td_error_t *err)
{
    td_sensor_header h;
    int fd, rc = open_checked(path, want, &h, &fd, err);

    if (rc != 0)
        return rc;
    close(fd);
    if (out != NULL)
        *out = h;
    return 0;
}

int td_sensor_check_fd(int fd, const char *path, const td_sensor_expect *want,
                       td_sensor_header *out, td_error_t *err)
{
    td_sensor_header h;
    int rc = check_fd(fd, path, want, &h, err);

    if (rc == 0 && out != NULL)
        *out = h;
    return rc;
}

int td_sensor_compatible(const char *path_a, const td_sensor_header *a, const char *path_b,
                         const td_sensor_header *b, td_error_t *err)
{
    if (a->T != b->T)
        return td_error_set(err, TD_ESHAPE, "%s: header field time_steps: %d, but %s has %d",
                            path_b, (int)b->T, path_a, (int)a->T);
    if (a->C != b->C)
        return td_error_set(err, TD_ESHAPE, "%s: header field channels: %d, but %s has %d", path_b,
                            (int)b->C, path_a, (int)a->C);
    for (int c = 0; c < a->C; c++)
        if (strcmp(a->ch[c].name, b->ch[c].name) != 0)
            return td_error_set(err, TD_ESHAPE,
                                "%s: header field channel[%d].name: \"%s\", but %s has \"%s\"",
                                path_b, c, b->ch[c].name, path_a, a->ch[c].name);
    if (a->n_labels > 0 && b->n_labels > 0 && a->n_labels != b->n_labels)
        return td_error_set(err, TD_ESHAPE, "%s: header field labels: %d, but %s has %d", path_b,
                            (int)b->n_labels, path_a, (int)a->n_labels);
    return 0;
}

struct td_sensor {
    int fd;
    char *path;
    td_sensor_header h;
    layout at;
    int32_t *labels;      /* N, or NULL without labels */
    unsigned char *table; /* K entries of TD_SENSOR_LABEL_BYTES, or NULL */
    size_t grid_bytes;    /* T * C * 4 */
};

/* Reads and checks the labels and the label table. */
static int read_labels(td_sensor *s, td_error_t *err)
{
    const td_sensor_header *h = &s->h;
    size_t n = (size_t)h->N, k = (size_t)h->n_labels;
    char field[64];
    int rc;

    /* Both sizes are bounded by the file's size, which open_checked() matched to the header. */
    s->labels = malloc(n * sizeof(int32_t));
    s->table = malloc(k * TD_SENSOR_LABEL_BYTES);
    if (s->labels == NULL || s->table == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for %zu labels", s->path, n);
    if ((rc = pread_all(s->fd, s->labels, n * sizeof(int32_t), s->at.labels, s->path, "the labels",
                        err)) != 0 ||
        (rc = pread_all(s->fd, s->table, k * TD_SENSOR_LABEL_BYTES, s->at.table, s->path,
                        "the label table", err)) != 0)
        return rc;
    for (size_t i = 0; i < n; i++)
        if (s->labels[i] < 0 || s->labels[i] >= h->n_labels)
            return td_error_set(err, TD_EDATA,
                                "%s: sample %zu: label %d, but the file has %d labels", s->path, i,
                                (int)s->labels[i], (int)h->n_labels);
    for (size_t j = 0; j < k; j++) {
        const char *e = (const char *)s->table + j * TD_SENSOR_LABEL_BYTES;
        snprintf(field, sizeof(field), "label[%zu].name", j);
        if ((rc = check_text(s->path, field, e, TD_SENSOR_NAME_BYTES, 1, 1, err)) != 0)
            return rc;
        snprintf(field, sizeof(field), "label[%zu].prompt", j);
        if ((rc = check_text(s->path, field, e + LABEL_OFF_PROMPT, TD_SENSOR_PROMPT_BYTES, 1, 0,
                             err)) != 0)
            return rc;
        for (size_t i = 0; i < j; i++)
            if (strcmp(e, (const char *)s->table + i * TD_SENSOR_LABEL_BYTES) == 0)
                return td_error_set(err, TD_EDATA, "%s: label[%zu].name: \"%s\" again", s->path, j,
                                    e);
    }
    return 0;
}

/* td_sensor_open's and td_sensor_open_fd's: fd is open (and taken) or -1 (open path here). */
static int sensor_open(td_sensor **out, int fd, const char *path, const td_sensor_expect *want,
                       td_error_t *err)
{
    td_sensor *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL) {
        if (fd >= 0)
            close(fd);
        return td_error_set(err, TD_ENOMEM, "%s: no memory", path);
    }
    s->fd = fd;
    s->path = strdup(path);
    if (s->path == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: no memory", path);
        goto fail;
    }
    if (fd < 0)
        rc = open_checked(path, want, &s->h, &s->fd, err);
    else
        rc = check_fd(fd, path, want, &s->h, err);
    if (rc != 0)
        goto fail;
    s->at = layout_of(&s->h);
    s->grid_bytes = (size_t)s->h.T * (size_t)s->h.C * sizeof(float);
    if (s->h.n_labels > 0 && (rc = read_labels(s, err)) != 0)
        goto fail;
    *out = s;
    return 0;

fail:
    td_sensor_close(s);
    return rc;
}

int td_sensor_open(td_sensor **out, const char *path, const td_sensor_expect *want, td_error_t *err)
{
    return sensor_open(out, -1, path, want, err);
}

int td_sensor_open_fd(td_sensor **out, int fd, const char *path, const td_sensor_expect *want,
                      td_error_t *err)
{
    return sensor_open(out, fd, path, want, err);
}

void td_sensor_close(td_sensor *s)
{
    if (s == NULL)
        return;
    if (s->fd >= 0)
        close(s->fd);
    free(s->labels);
    free(s->table);
    free(s->path);
    free(s);
}

const td_sensor_header *td_sensor_header_of(const td_sensor *s)
{
    return &s->h;
}

const char *td_sensor_path(const td_sensor *s)
{
    return s->path;
}

int64_t td_sensor_count(const td_sensor *s)
{
    return s->h.N;
}

int td_sensor_read(const td_sensor *s, int64_t i, float *grid, char *caption, size_t *len,
                   int32_t *label, td_error_t *err)
{
    const td_sensor_header *h = &s->h;
    size_t L = (size_t)h->caption_len;
    char what[64];
    int rc;

    if (i < 0 || i >= h->N)
        return td_error_set(err, TD_EINVAL, "%s: sample %lld: the file has %lld", s->path,
                            (long long)i, (long long)h->N);
    if (grid != NULL) {
        snprintf(what, sizeof(what), "sample %lld", (long long)i);
        rc = pread_all(s->fd, grid, s->grid_bytes, s->at.samples + (uint64_t)i * s->grid_bytes,
                       s->path, what, err);
        if (rc != 0)
            return rc;
        for (size_t k = 0; k < (size_t)h->T * (size_t)h->C; k++)
            if (isinf(grid[k]))
                return td_error_set(err, TD_EDATA, "%s: sample %lld, step %zu, channel %s: %g",
                                    s->path, (long long)i, k / (size_t)h->C,
                                    h->ch[k % (size_t)h->C].name, (double)grid[k]);
    }
    if (caption != NULL || len != NULL) {
        char scratch[TD_SENSOR_MAX_CAPTION + 1];
        char *buf = caption != NULL ? caption : scratch;
        snprintf(what, sizeof(what), "the caption of sample %lld", (long long)i);
        rc = pread_all(s->fd, buf, L, s->at.captions + (uint64_t)i * L, s->path, what, err);
        if (rc != 0)
            return rc;
        buf[L] = '\0';
        if (len != NULL)
            *len = strlen(buf);
    }
    if (label != NULL)
        *label = s->labels != NULL ? s->labels[i] : -1;
    return 0;
}

const char *td_sensor_label_name(const td_sensor *s, int k)
{
    if (k < 0 || k >= s->h.n_labels)
        return NULL;
    return (const char *)s->table + (size_t)k * TD_SENSOR_LABEL_BYTES;
}

const char *td_sensor_label_prompt(const td_sensor *s, int k)
{
    const char *name = td_sensor_label_name(s, k);

    return name != NULL ? name + LABEL_OFF_PROMPT : NULL;
}

/* ---- writing ------------------------------------------------------------------------------- */

struct td_sensor_writer {
    int fd;
    char *path, *tmp;
    td_sensor_header h;
    layout at;
    int64_t added;
    int done;
    /* Per channel, for the statistics: the first reading seen (subtracted before summing, so
     * that a channel far from 0, such as an altitude, keeps its precision), and the count, sum
     * and sum of squares of the shifted readings. */
    double shift[TD_SENSOR_MAX_CHANNELS], sum[TD_SENSOR_MAX_CHANNELS],
        sumsq[TD_SENSOR_MAX_CHANNELS];
    int64_t count[TD_SENSOR_MAX_CHANNELS];
    char *slot; /* caption_len bytes */
};

static int write_err(const char *path, td_error_t *err)
{
    return td_error_set(err, errno == ENOSPC ? TD_EDISKFULL : TD_EIO, "%s: cannot write: %s", path,
                        strerror(errno));
}

static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path,
                      td_error_t *err)
{
    size_t put = 0;

    while (put < n) {
        ssize_t r = pwrite(fd, (const char *)buf + put, n - put, (off_t)(off + put));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return write_err(path, err);
        put += (size_t)r;
    }
    return 0;
}

/* Fills a label table entry from a name and a prompt (NULL or empty: the name). */
static int label_entry(const char *path, int k, const char *name, const char *prompt,
                       unsigned char *e, td_error_t *err)
{
    char field[64];
    size_t nl = name != NULL ? strlen(name) : 0, pl;
    int rc;

    if (prompt == NULL || prompt[0] == '\0')
        prompt = name != NULL ? name : "";
    pl = strlen(prompt);
    memset(e, 0, TD_SENSOR_LABEL_BYTES);
    if (nl >= TD_SENSOR_NAME_BYTES || pl >= TD_SENSOR_PROMPT_BYTES)
        return td_error_set(err, TD_EINVAL, "%s: label[%d]: %s longer than %d bytes", path, k,
                            nl >= TD_SENSOR_NAME_BYTES ? "name" : "prompt",
                            nl >= TD_SENSOR_NAME_BYTES ? TD_SENSOR_NAME_BYTES - 1
                                                       : TD_SENSOR_PROMPT_BYTES - 1);
    memcpy(e, name != NULL ? name : "", nl);
    memcpy(e + LABEL_OFF_PROMPT, prompt, pl);
    snprintf(field, sizeof(field), "label[%d].name", k);
    if ((rc = check_text(path, field, (const char *)e, TD_SENSOR_NAME_BYTES, 1, 1, err)) != 0)
        return rc;
    snprintf(field, sizeof(field), "label[%d].prompt", k);
    return check_text(path, field, (const char *)e + LABEL_OFF_PROMPT, TD_SENSOR_PROMPT_BYTES, 1, 0,
                      err);
}

/* Writes the label table of w at its place. */
static int write_label_table(td_sensor_writer *w, const char *const *names,
                             const char *const *prompts, td_error_t *err)
{
    size_t k = (size_t)w->h.n_labels;
    unsigned char *table = calloc(k, TD_SENSOR_LABEL_BYTES);
    int rc = 0;

    if (table == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory", w->path);
    for (size_t j = 0; j < k && rc == 0; j++) {
        unsigned char *e = table + j * TD_SENSOR_LABEL_BYTES;
        rc = as_einval(
            label_entry(w->path, (int)j, names[j], prompts != NULL ? prompts[j] : NULL, e, err),
            err);
        for (size_t i = 0; i < j && rc == 0; i++)
            if (strcmp((const char *)e, (const char *)table + i * TD_SENSOR_LABEL_BYTES) == 0)
                rc = td_error_set(err, TD_EINVAL, "%s: label[%zu].name: \"%s\" again", w->path, j,
                                  (const char *)e);
    }
    if (rc == 0)
        rc = pwrite_all(w->fd, table, k * TD_SENSOR_LABEL_BYTES, w->at.table, w->tmp, err);
    free(table);
    return rc;
}

int td_sensor_writer_open(td_sensor_writer **out, const char *path, const td_sensor_header *h,
                          const char *const *label_names, const char *const *label_prompts,
                          td_error_t *err)
{
    td_sensor_writer *w;
    size_t plen = strlen(path);
    int rc;

    *out = NULL;
    w = calloc(1, sizeof(*w));
    if (w == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory", path);
    w->fd = -1;
    w->h = *h;
    w->h.version = TD_SENSOR_VERSION;
    w->path = strdup(path);
    w->tmp = malloc(plen + 5);
    if (w->path == NULL || w->tmp == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: no memory", path);
        goto fail;
    }
    memcpy(w->tmp, path, plen);
    memcpy(w->tmp + plen, ".tmp", 5);
    for (int c = 0; c < TD_SENSOR_MAX_CHANNELS && c < w->h.C; c++) { /* zero after each NUL */
        td_sensor_channel *ch = &w->h.ch[c];
        size_t n = strnlen(ch->name, sizeof(ch->name)), u = strnlen(ch->unit, sizeof(ch->unit));
        memset(ch->name + n, 0, sizeof(ch->name) - n);
        memset(ch->unit + u, 0, sizeof(ch->unit) - u);
    }
    if ((rc = check_counts(path, &w->h, err)) != 0 || (rc = check_names(path, &w->h, err)) != 0) {
        rc = as_einval(rc, err);
        goto fail;
    }
    if (w->h.n_labels > 0 && label_names == NULL) {
        rc = td_error_set(err, TD_EINVAL, "%s: %d labels but no names", path, (int)w->h.n_labels);
        goto fail;
    }
    w->at = layout_of(&w->h);
    w->slot = malloc((size_t)w->h.caption_len);
    if (w->slot == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: no memory", path);
        goto fail;
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        rc = td_error_set(err, TD_EIO, "%s: cannot create: %s", w->tmp, strerror(errno));
        goto fail;
    }
    if (w->h.n_labels > 0 && (rc = write_label_table(w, label_names, label_prompts, err)) != 0)
        goto fail;
    *out = w;
    return 0;

fail:
    td_sensor_writer_free(w);
    return rc;
}

int td_sensor_writer_add(td_sensor_writer *w, const float *grid, const char *caption, size_t len,
                         int32_t label, td_error_t *err)
{
    const td_sensor_header *h = &w->h;
    size_t cells = (size_t)h->T * (size_t)h->C;
    int64_t i = w->added;
    int rc;

    if (w->done || i >= h->N)
        return td_error_set(err, TD_EINVAL, "%s: sample %lld: the file was opened for %lld",
                            w->path, (long long)i, (long long)h->N);
    if (len > (size_t)h->caption_len)
        return td_error_set(err, TD_EINVAL,
                            "%s: sample %lld: caption of %zu bytes, longer than caption_len %d",
                            w->path, (long long)i, len, (int)h->caption_len);
    if (len > 0 && memchr(caption, '\0', len) != NULL)
        return td_error_set(err, TD_EINVAL, "%s: sample %lld: caption holds a NUL byte", w->path,
                            (long long)i);
    if (h->n_labels > 0 && (label < 0 || label >= h->n_labels))
        return td_error_set(err, TD_EINVAL, "%s: sample %lld: label %d, but the file has %d labels",
                            w->path, (long long)i, (int)label, (int)h->n_labels);
    for (size_t k = 0; k < cells; k++)
        if (isinf(grid[k]))
            return td_error_set(err, TD_EINVAL, "%s: sample %lld, step %zu, channel %s: %g",
                                w->path, (long long)i, k / (size_t)h->C,
                                h->ch[k % (size_t)h->C].name, (double)grid[k]);
    rc = pwrite_all(w->fd, grid, cells * sizeof(float), w->at.samples + (uint64_t)i * cells * 4,
                    w->tmp, err);
    if (rc != 0)
        return rc;
    memset(w->slot, 0, (size_t)h->caption_len);
    if (len > 0)
        memcpy(w->slot, caption, len);
    rc = pwrite_all(w->fd, w->slot, (size_t)h->caption_len,
                    w->at.captions + (uint64_t)i * (uint64_t)h->caption_len, w->tmp, err);
    if (rc == 0 && h->n_labels > 0)
        rc = pwrite_all(w->fd, &label, sizeof(label), w->at.labels + (uint64_t)i * 4, w->tmp, err);
    if (rc != 0)
        return rc;
    for (size_t k = 0; k < cells; k++) {
        int c = (int)(k % (size_t)h->C);
        double x = grid[k];
        if (isnan(x))
            continue;
        if (w->count[c] == 0)
            w->shift[c] = x;
        x -= w->shift[c];
        w->count[c]++;
        w->sum[c] += x;
        w->sumsq[c] += x * x;
    }
    w->added++;
    return 0;
}

void td_sensor_writer_stats(const td_sensor_writer *w, float *mean, float *std)
{
    for (int c = 0; c < w->h.C; c++) {
        double n = (double)w->count[c], m, var;
        if (w->count[c] == 0) {
            mean[c] = 0;
            std[c] = 1;
            continue;
        }
        m = w->sum[c] / n;
        var = w->sumsq[c] / n - m * m;
        mean[c] = (float)(w->shift[c] + m);
        std[c] = var > STD_FLOOR * STD_FLOOR ? (float)sqrt(var) : 1.0f;
    }
}

int td_sensor_writer_finish(td_sensor_writer *w, const float *mean, const float *std,
                            td_error_t *err)
{
    unsigned char b[TD_SENSOR_HEADER_BYTES];
    float own_mean[TD_SENSOR_MAX_CHANNELS], own_std[TD_SENSOR_MAX_CHANNELS];
    int rc;

    if (w->done || w->added != w->h.N)
        return td_error_set(err, TD_EINVAL, "%s: %lld of %lld samples written", w->path,
                            (long long)w->added, (long long)w->h.N);
    if (mean == NULL || std == NULL) {
        td_sensor_writer_stats(w, own_mean, own_std);
        mean = own_mean;
        std = own_std;
    }
    for (int c = 0; c < w->h.C; c++) {
        if ((rc = check_stat(w->path, c, w->h.ch[c].name, mean[c], std[c], err)) != 0)
            return as_einval(rc, err);
        w->h.ch[c].mean = mean[c];
        w->h.ch[c].std = std[c];
    }
    encode_header(&w->h, b);
    if ((rc = pwrite_all(w->fd, b, sizeof(b), 0, w->tmp, err)) != 0)
        return rc;
    if (fsync(w->fd) != 0)
        return write_err(w->tmp, err);
    rc = close(w->fd);
    w->fd = -1;
    if (rc != 0)
        return write_err(w->tmp, err);
    if (rename(w->tmp, w->path) != 0)
        return td_error_set(err, TD_EIO, "%s: cannot rename %s to it: %s", w->path, w->tmp,
                            strerror(errno));
    w->done = 1;
    return 0;
}

void td_sensor_writer_free(td_sensor_writer *w)
{
    if (w == NULL)
        return;
    if (w->fd >= 0)
        close(w->fd);
    if (!w->done && w->tmp != NULL)
        unlink(w->tmp);
    free(w->slot);
    free(w->path);
    free(w->tmp);
    free(w);
}
