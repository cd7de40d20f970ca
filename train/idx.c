/* The IDX dataset reader (the format of MNIST and Fashion-MNIST, yann.lecun.com/exdb/mnist):
 * a big-endian magic 0x000008NN (unsigned bytes, NN dimensions), NN big-endian uint32
 * dimensions, then the bytes. Images are 0x00000803 (count, rows, cols), labels 0x00000801
 * (count). A file may be gzipped: the 1f 8b magic tells, and zlib's gzread reads both kinds
 * (a plain file is copied through). Every number in a header is checked against a named
 * limit before anything is allocated from it, and the stream is held to the header: a file
 * (or a gzip stream: a small file can claim gigabytes) that holds less or more data than its
 * header declares is refused, so what is allocated is what the header says, which is what the
 * memory guard counts. Files are opened as data.h's access says (the job's user; a FIFO or a
 * device refused, never waited on), and reads poll its stop callback between chunks. Owns the
 * pixel and label arrays of a td_idx; called from td_trainer_new() and, for td_idx_peek, from
 * the daemon's checks at submit, so it returns errors and never panics. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "train/data.h"
#include "train/engine.h"

/* Bytes per gzread call (16 MiB): the stop callback is polled between them. */
#define READ_CHUNK (1u << 24)
#define GZ_BUFFER  (1u << 17) /* bytes: zlib's input buffer, 8 times its default */
#define SCAN_CHUNK (1u << 16) /* bytes of labels read at a time by td_idx_peek's scan */
#define GROW_MIN   (1u << 20) /* bytes: the pixel buffer's first size (read_pixels) */

/* One open dataset file and what a message about it needs. */
typedef struct idx_file {
    gzFile f;
    const char *path;
    int gzipped;
    long long size; /* the file's bytes (compressed, when gzipped) */
} idx_file;

/* Opens path (as the thread's access says, refusing what is not a regular file), tells gzip
 * from plain by the first two bytes, and hands the descriptor to zlib. */
static int idx_open(idx_file *x, const char *path, td_error_t *err)
{
    unsigned char magic[2] = {0, 0};
    struct stat st;
    int fd;

    x->f = NULL;
    x->path = path;
    fd = td_data_open_fd(path, &st);
    if (fd == -ENOENT)
        return td_error_set(err, TD_EDATA, "%s: no such file", path);
    if (fd < 0)
        return td_error_set(err, fd == -EACCES || fd == -EPERM ? TD_EPERM : TD_EDATA,
                            "%s: cannot open: %s", path, strerror(-fd));
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return td_error_set(err, TD_EDATA, "%s: not a regular file (%s)", path,
                            td_data_file_kind(st.st_mode));
    }
    x->size = (long long)st.st_size;
    x->gzipped = pread(fd, magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    x->f = gzdopen(fd, "rb");
    if (x->f == NULL) {
        close(fd);
        return td_error_set(err, TD_ENOMEM, "%s: cannot start zlib", path);
    }
    gzbuffer(x->f, GZ_BUFFER);
    return 0;
}

static void idx_close(idx_file *x)
{
    if (x->f != NULL)
        gzclose(x->f);
    x->f = NULL;
}

/* Reads up to len bytes into buf; *got says how many came. A file (or gzip stream) that ends
 * early is not an error here: the caller names what was missing. Other read and gzip errors
 * are TD_EDATA. */
static int idx_read(idx_file *x, void *buf, size_t len, size_t *got, td_error_t *err)
{
    size_t total = 0;
    int errnum = Z_OK;

    while (total < len) {
        unsigned chunk = len - total > READ_CHUNK ? READ_CHUNK : (unsigned)(len - total);
        int n, rc = td_data_should_stop(x->path, err);
        if (rc != 0)
            return rc;
        n = gzread(x->f, (char *)buf + total, chunk);
        if (n <= 0) {
            const char *msg = gzerror(x->f, &errnum);
            if (errnum == Z_ERRNO)
                return td_error_set(err, TD_EDATA, "%s: read error: %s", x->path, strerror(errno));
            if (errnum != Z_OK && errnum != Z_BUF_ERROR)
                return td_error_set(err, TD_EDATA, "%s: bad gzip data: %s", x->path, msg);
            break; /* end of file, or Z_BUF_ERROR: a gzip stream cut short */
        }
        total += (size_t)n;
    }
    *got = total;
    return 0;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* The other kind's name, for a file given as the wrong one. */
static const char *idx_kind(uint32_t magic)
{
    if (magic == TD_IDX_MAGIC_IMAGES)
        return "images";
    return magic == TD_IDX_MAGIC_LABELS ? "labels" : NULL;
}

/* Reads the magic and ndim dimensions; checks the magic against want. named: a file of the
 * other IDX kind is named as such (the submit check's wording) rather than "bad magic". */
static int idx_header(idx_file *x, uint32_t want, const char *what, uint32_t *dims, int ndim,
                      int named, td_error_t *err)
{
    unsigned char h[4 * 4];
    size_t len = 4 * (size_t)(1 + ndim), got = 0;
    int rc = idx_read(x, h, len, &got, err);
    uint32_t magic;

    if (rc != 0)
        return rc;
    magic = got >= 4 ? be32(h) : 0;
    if (got >= 4 && magic != want && named && idx_kind(magic) != NULL)
        return td_error_set(err, TD_EDATA,
                            "%s: magic 0x%08x is an IDX %s file, expected %s (0x%08x)", x->path,
                            magic, idx_kind(magic), idx_kind(want), want);
    if (got >= 4 && magic != want)
        return td_error_set(err, TD_EDATA, "%s: bad magic 0x%08x, expected 0x%08x (%s)%s", x->path,
                            magic, want, what,
                            x->gzipped ? "" : " (not gzipped: read as a plain file)");
    if (got < len)
        return td_error_set(err, TD_EDATA,
                            "%s: truncated: expected a %zu-byte IDX header (%s), got %zu bytes",
                            x->path, len, what, got);
    for (int i = 0; i < ndim; i++)
        dims[i] = be32(h + 4 * (i + 1));
    return 0;
}

/* After the data the header declared, the stream must end: a file (or gzip stream) that holds
 * more is refused, not read on (what it holds past the header is nobody's count). */
static int idx_expect_end(idx_file *x, uint64_t declared, const char *what, td_error_t *err)
{
    unsigned char extra;
    size_t got = 0;
    int rc = idx_read(x, &extra, 1, &got, err);

    if (rc != 0)
        return rc;
    if (got != 0)
        return td_error_set(err, TD_EDATA,
                            "%s: more data than its header declares: %llu bytes of %s, then more",
                            x->path, (unsigned long long)declared, what);
    return 0;
}

/* The image header's dimensions against the limits; the pixels' bytes in *bytes. */
static int image_dims(const idx_file *x, const uint32_t *dims, uint64_t *bytes, td_error_t *err)
{
    uint64_t pixels;

    if (dims[0] == 0 || dims[0] > TD_IDX_MAX_ITEMS)
        return td_error_set(err, TD_EDATA, "%s: %u images (1 to %d allowed)", x->path, dims[0],
                            TD_IDX_MAX_ITEMS);
    pixels = (uint64_t)dims[1] * dims[2];
    if (pixels == 0 || pixels > TD_IDX_MAX_PIXELS)
        return td_error_set(err, TD_EDATA, "%s: images of %ux%u pixels (1 to %d pixels allowed)",
                            x->path, dims[1], dims[2], TD_IDX_MAX_PIXELS);
    *bytes = pixels * dims[0];
    if (*bytes > TD_IDX_MAX_BYTES)
        return td_error_set(err, TD_EDATA, "%s: %llu bytes of pixels (at most %llu allowed)",
                            x->path, (unsigned long long)*bytes,
                            (unsigned long long)TD_IDX_MAX_BYTES);
    return 0;
}

/* Reads up to bytes pixels into *out, a buffer that grows with what the stream holds (doubling
 * from GROW_MIN, never past bytes): a header can claim gigabytes for a file (or gzip stream)
 * that holds a few bytes, and that must cost a few bytes before it is found truncated, not the
 * gigabytes. A whole file ends in a buffer of exactly bytes, the size the memory guard counts.
 * *got: the pixels read. */
static int read_pixels(idx_file *x, uint8_t **out, uint64_t bytes, size_t *got, td_error_t *err)
{
    size_t cap = 0, n = 0;
    int rc = 0;

    *got = 0;
    while (rc == 0 && *got == cap && cap < bytes) {
        size_t next = cap < GROW_MIN / 2 ? GROW_MIN : 2 * cap;
        uint8_t *grown = realloc(*out, next < bytes ? next : (size_t)bytes);
        if (grown == NULL)
            return td_error_set(err, TD_ENOMEM, "%s: no memory for %llu bytes of pixels", x->path,
                                (unsigned long long)bytes);
        *out = grown;
        cap = next < bytes ? next : (size_t)bytes;
        n = 0;
        rc = idx_read(x, *out + *got, cap - *got, &n, err);
        *got += n;
    }
    return rc;
}

/* The image file: count, rows, cols, then count*rows*cols pixels, and nothing more. */
static int load_images(td_idx *d, idx_file *x, td_error_t *err)
{
    uint32_t dims[3] = {0, 0, 0};
    uint64_t bytes = 0;
    size_t got = 0;
    int rc = idx_header(x, TD_IDX_MAGIC_IMAGES, "IDX images", dims, 3, 0, err);

    if (rc == 0)
        rc = image_dims(x, dims, &bytes, err);
    if (rc != 0)
        return rc;
    rc = read_pixels(x, &d->images, bytes, &got, err);
    if (rc != 0)
        return rc;
    if (got < bytes)
        return td_error_set(err, TD_EDATA, "%s: truncated: expected %llu bytes of pixels, got %zu",
                            x->path, (unsigned long long)bytes, got);
    if ((rc = idx_expect_end(x, bytes, "pixels", err)) != 0)
        return rc;
    d->n = (int)dims[0];
    d->rows = (int)dims[1];
    d->cols = (int)dims[2];
    return 0;
}

/* The label file: count (which must match the images'), then count labels. */
static int load_labels(td_idx *d, idx_file *x, const char *images_path, td_error_t *err)
{
    uint32_t count = 0;
    size_t got = 0;
    int rc = idx_header(x, TD_IDX_MAGIC_LABELS, "IDX labels", &count, 1, 0, err);

    if (rc != 0)
        return rc;
    if (count != (uint32_t)d->n)
        return td_error_set(err, TD_EDATA, "%s: labels file has %u items but images file %s has %d",
                            x->path, count, images_path, d->n);
    d->labels = malloc(count);
    if (d->labels == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for %u labels", x->path, count);
    rc = idx_read(x, d->labels, count, &got, err);
    if (rc != 0)
        return rc;
    if (got < count)
        return td_error_set(err, TD_EDATA, "%s: truncated: expected %u labels, got %zu", x->path,
                            count, got);
    if ((rc = idx_expect_end(x, count, "labels", err)) != 0)
        return rc;
    d->classes = 0;
    for (uint32_t i = 0; i < count; i++)
        if (d->labels[i] + 1 > d->classes)
            d->classes = d->labels[i] + 1;
    return 0;
}

/* td_idx_peek's scan: every one of n labels read, a chunk at a time, for the largest; the
 * stream must hold exactly n. */
static int scan_labels(idx_file *x, uint32_t n, int *max_label, td_error_t *err)
{
    unsigned char buf[SCAN_CHUNK];
    uint64_t seen = 0;
    int rc;

    *max_label = -1;
    while (seen < n) {
        size_t want = n - seen < SCAN_CHUNK ? (size_t)(n - seen) : SCAN_CHUNK, got = 0;
        if ((rc = idx_read(x, buf, want, &got, err)) != 0)
            return rc;
        for (size_t i = 0; i < got; i++)
            if (buf[i] > *max_label)
                *max_label = buf[i];
        seen += got;
        if (got < want)
            return td_error_set(err, TD_EDATA, "%s: truncated: expected %u labels, got %llu",
                                x->path, n, (unsigned long long)seen);
    }
    return idx_expect_end(x, n, "labels", err);
}

int td_idx_peek(const char *path, uint32_t want, int scan, td_idx_header *h, td_error_t *err)
{
    int images = want == TD_IDX_MAGIC_IMAGES;
    uint32_t dims[3] = {0, 0, 0};
    idx_file x = {0};
    uint64_t header = images ? 16 : 8;
    int rc;

    memset(h, 0, sizeof(*h));
    h->max_label = -1;
    if (!images && want != TD_IDX_MAGIC_LABELS)
        return td_error_set(err, TD_EINVAL, "%s: magic 0x%08x is not an IDX kind traind reads",
                            path, want);
    rc = idx_open(&x, path, err);
    if (rc == 0)
        rc = idx_header(&x, want, images ? "IDX images" : "IDX labels", dims, images ? 3 : 1, 1,
                        err);
    if (rc == 0 && images)
        rc = image_dims(&x, dims, &h->bytes, err);
    if (rc == 0 && !images && (dims[0] == 0 || dims[0] > TD_IDX_MAX_ITEMS))
        rc = td_error_set(err, TD_EDATA, "%s: %u labels (1 to %d allowed)", path, dims[0],
                          TD_IDX_MAX_ITEMS);
    if (rc != 0)
        goto out;
    h->n = dims[0];
    h->rows = images ? dims[1] : 0;
    h->cols = images ? dims[2] : 0;
    if (!images)
        h->bytes = dims[0];
    /* A plain file's size says at once whether it holds what the header declares. */
    if (!x.gzipped && (uint64_t)x.size != header + h->bytes) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: %s: %lld bytes, but its header declares %llu bytes of %s after "
                          "its %llu-byte header",
                          path, (uint64_t)x.size < header + h->bytes ? "truncated" : "too long",
                          x.size, (unsigned long long)h->bytes, images ? "pixels" : "labels",
                          (unsigned long long)header);
        goto out;
    }
    if (scan && !images)
        rc = scan_labels(&x, h->n, &h->max_label, err);
out:
    idx_close(&x);
    return rc;
}

int td_idx_load(td_idx *d, const td_idx_split *split, td_error_t *err)
{
    idx_file x = {0};
    int rc;

    memset(d, 0, sizeof(*d));
    rc = idx_open(&x, split->images, err);
    if (rc == 0)
        rc = load_images(d, &x, err);
    idx_close(&x);
    if (rc != 0)
        goto fail;
    rc = idx_open(&x, split->labels, err);
    if (rc == 0)
        rc = load_labels(d, &x, split->images, err);
    idx_close(&x);
    if (rc != 0)
        goto fail;
    return 0;

fail:
    td_idx_free(d);
    return rc;
}

void td_idx_free(td_idx *d)
{
    if (d == NULL)
        return;
    free(d->images);
    free(d->labels);
    memset(d, 0, sizeof(*d));
}
