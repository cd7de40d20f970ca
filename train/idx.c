/* The IDX dataset reader (the format of MNIST and Fashion-MNIST, yann.lecun.com/exdb/mnist):
 * a big-endian magic 0x000008NN (unsigned bytes, NN dimensions), NN big-endian uint32
 * dimensions, then the bytes. Images are 0x00000803 (count, rows, cols), labels 0x00000801
 * (count). A file may be gzipped: the 1f 8b magic tells, and zlib's gzread reads both kinds
 * (a plain file is copied through). Every number in a header is checked against a named
 * limit before anything is allocated from it. Owns the pixel and label arrays of a td_idx;
 * called from td_trainer_new(), so it returns errors and never panics. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "engine.h"

#define READ_CHUNK (1u << 30) /* bytes per gzread call; gzread takes an unsigned length */
#define GZ_BUFFER  (1u << 17) /* bytes: zlib's input buffer, 8 times its default */

/* One open dataset file and what a message about it needs. */
typedef struct idx_file {
    gzFile f;
    const char *path;
    int gzipped;
} idx_file;

/* Opens path, tells gzip from plain by the first two bytes, and hands the descriptor to zlib. */
static int idx_open(idx_file *x, const char *path, td_error_t *err)
{
    unsigned char magic[2] = {0, 0};
    int fd;

    x->f = NULL;
    x->path = path;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return td_error_set(err, TD_EDATA, "%s: no such file", path);
        return td_error_set(err, TD_EDATA, "%s: cannot open: %s", path, strerror(errno));
    }
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
        int n = gzread(x->f, (char *)buf + total, chunk);
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

/* Reads the magic and ndim dimensions; checks the magic against want. */
static int idx_header(idx_file *x, uint32_t want, const char *what, uint32_t *dims, int ndim,
                      td_error_t *err)
{
    unsigned char h[4 * 4];
    size_t len = 4 * (size_t)(1 + ndim), got = 0;
    int rc = idx_read(x, h, len, &got, err);
    uint32_t magic;

    if (rc != 0)
        return rc;
    magic = got >= 4 ? be32(h) : 0;
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

/* The image file: count, rows, cols, then count*rows*cols pixels. */
static int load_images(td_idx *d, idx_file *x, td_error_t *err)
{
    uint32_t dims[3] = {0, 0, 0};
    uint64_t pixels, bytes;
    size_t got = 0;
    int rc = idx_header(x, TD_IDX_MAGIC_IMAGES, "IDX images", dims, 3, err);

    if (rc != 0)
        return rc;
    if (dims[0] == 0 || dims[0] > TD_IDX_MAX_ITEMS)
        return td_error_set(err, TD_EDATA, "%s: %u images (1 to %d allowed)", x->path, dims[0],
                            TD_IDX_MAX_ITEMS);
    pixels = (uint64_t)dims[1] * dims[2];
    if (pixels == 0 || pixels > TD_IDX_MAX_PIXELS)
        return td_error_set(err, TD_EDATA, "%s: images of %ux%u pixels (1 to %d pixels allowed)",
                            x->path, dims[1], dims[2], TD_IDX_MAX_PIXELS);
    bytes = pixels * dims[0];
    if (bytes > TD_IDX_MAX_BYTES)
        return td_error_set(err, TD_EDATA, "%s: %llu bytes of pixels (at most %llu allowed)",
                            x->path, (unsigned long long)bytes,
                            (unsigned long long)TD_IDX_MAX_BYTES);
    d->images = malloc((size_t)bytes);
    if (d->images == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory for %llu bytes of pixels", x->path,
                            (unsigned long long)bytes);
    rc = idx_read(x, d->images, (size_t)bytes, &got, err);
    if (rc != 0)
        return rc;
    if (got < bytes)
        return td_error_set(err, TD_EDATA, "%s: truncated: expected %llu bytes of pixels, got %zu",
                            x->path, (unsigned long long)bytes, got);
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
    int rc = idx_header(x, TD_IDX_MAGIC_LABELS, "IDX labels", &count, 1, err);

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
    d->classes = 0;
    for (uint32_t i = 0; i < count; i++)
        if (d->labels[i] + 1 > d->classes)
            d->classes = d->labels[i] + 1;
    return 0;
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
