/* llm.c's model file as a format (llmc.h): the header read and its magic and version checked,
 * tensors read in order, the writer. Knows no model. Runs on the caller's thread: a worker
 * building a trainer, the daemon's threadpool (export), the loop thread's submit check. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/llmc.h"
#include "train/train.h"

#define HEADER_INTS       256 /* int32 words of the header */
#define LLMC_VERSION_OLD  2   /* llm.c's first fp32 version: the same layout, no Vp field */
#define LLMC_VERSION_BF16 5   /* llm.c's bf16 files: refused, we train in fp32 */

struct td_llmc_file {
    FILE *f;
    uint64_t size; /* bytes */
    char path[TD_PATH_MAX];
};

/* The numbers of a header, with the old version's Vp (= V) filled in. */
static void header_of(const int32_t *w, td_llmc_header *h)
{
    h->version = w[1];
    h->maxT = w[2];
    h->V = w[3];
    h->L = w[4];
    h->NH = w[5];
    h->C = w[6];
    h->Vp = w[1] == LLMC_VERSION_OLD ? w[3] : w[7];
}

/* The header's magic and version. */
static int check_header(const char *path, const int32_t *w, td_error_t *err)
{
    if (w[0] != TD_LLMC_MAGIC)
        return td_error_set(err, TD_EDATA, "%s: bad magic %d: an llm.c model file starts with %d",
                            path, (int)w[0], TD_LLMC_MAGIC);
    if (w[1] != TD_LLMC_VERSION && w[1] != LLMC_VERSION_OLD)
        return td_error_set(err, TD_EDATA,
                            "%s: unsupported version %d%s: traind reads version %d (fp32) and the "
                            "older fp32 version %d",
                            path, (int)w[1], w[1] == LLMC_VERSION_BF16 ? " (bf16)" : "",
                            TD_LLMC_VERSION, LLMC_VERSION_OLD);
    return 0;
}

int td_llmc_open(td_llmc_file **out, const char *path, td_llmc_header *h, td_error_t *err)
{
    td_llmc_file *f = calloc(1, sizeof(*f));
    int32_t w[HEADER_INTS];
    struct stat st;
    int rc, fd = -1;

    *out = NULL;
    if (f == NULL)
        return td_error_set(err, TD_ENOMEM, "%s: no memory", path);
    snprintf(f->path, sizeof(f->path), "%s", path);
    if ((rc = td_data_open_path(path, TD_OPEN_MODEL, &fd, &st, err)) != 0)
        goto out;
    f->size = (uint64_t)st.st_size;
    if ((f->f = fdopen(fd, "rb")) == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "%s: %s", path, strerror(errno));
        close(fd);
        goto out;
    }
    if (fread(w, sizeof(w), 1, f->f) != 1) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not an llm.c model file: shorter than its %d-byte header", path,
                          TD_LLMC_HEADER);
        goto out;
    }
    if ((rc = check_header(path, w, err)) == 0)
        header_of(w, h);
out:
    if (rc != 0)
        td_llmc_close(f);
    else
        *out = f;
    return rc;
}

void td_llmc_close(td_llmc_file *f)
{
    if (f == NULL)
        return;
    if (f->f != NULL)
        fclose(f->f);
    free(f);
}

uint64_t td_llmc_size(const td_llmc_file *f)
{
    return f->size;
}

int td_llmc_read(td_llmc_file *f, int i, float *out, size_t n, td_error_t *err)
{
    int rc = td_data_should_stop(f->path, err);

    if (rc == 0 && fread(out, sizeof(float), n, f->f) != n)
        rc = td_error_set(err, TD_EIO, "%s: read error in tensor %d", f->path, i);
    return rc;
}

int td_llmc_write(const char *path, const td_llmc_header *h, const float *const *t, const size_t *n,
                  int count, td_error_t *err)
{
    int32_t w[HEADER_INTS] = {0};
    char tmp[TD_PATH_MAX + 16];
    FILE *f;
    int rc = 0;

    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return td_error_set(err, TD_EINVAL, "%s: path too long", path);
    w[0] = TD_LLMC_MAGIC;
    w[1] = TD_LLMC_VERSION;
    w[2] = h->maxT;
    w[3] = h->V;
    w[4] = h->L;
    w[5] = h->NH;
    w[6] = h->C;
    w[7] = h->Vp;
    f = fopen(tmp, "wb");
    if (f == NULL)
        return td_error_set(err, TD_EIO, "%s: %s", tmp, strerror(errno));
    if (fwrite(w, sizeof(w), 1, f) != 1)
        rc = errno == ENOSPC ? TD_EDISKFULL : TD_EIO;
    for (int i = 0; i < count && rc == 0; i++)
        if (fwrite(t[i], sizeof(float), n[i], f) != n[i])
            rc = errno == ENOSPC ? TD_EDISKFULL : TD_EIO;
    if (rc == 0 && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        rc = errno == ENOSPC ? TD_EDISKFULL : TD_EIO;
    if (fclose(f) != 0 && rc == 0)
        rc = errno == ENOSPC ? TD_EDISKFULL : TD_EIO;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = TD_EIO;
    if (rc != 0) {
        td_error_set(err, rc, "%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
    }
    return rc;
}
