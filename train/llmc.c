/* llm.c's GPT-2 model file (train_gpt2.c's gpt2_build_from_checkpoint and its Python writer):
 * int32 header[256], little-endian: [0] magic 20240326, [1] version (3: fp32 parameters; 2
 * is the older fp32 version, read too), [2] maxT, [3] V, [4] L, [5] NH, [6] C, [7] Vp; the
 * rest zero. Then the parameters as float32 in llm.c's order, each tensor whole and the
 * tensors back to back: our td_params holds the same tensors in the same order with
 * alignment padding between them, so reading and writing is one copy per tensor.
 * A job's model file is opened as data.h's access says (the job's user; only a regular file),
 * and the stop callback is polled between tensors. Blocking file I/O on the caller's thread;
 * errors are returned, never panicked. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data.h"
#include "engine.h"

#define HEADER_INTS       256 /* int32 words of the header */
#define LLMC_VERSION_OLD  2   /* llm.c's first fp32 version: the same layout, no Vp field */
#define LLMC_VERSION_BF16 5   /* llm.c's bf16 files: refused, we train in fp32 */

/* The dimensions of a header, with the old version's Vp (= V) filled in. */
static void dims_of(const int32_t *h, td_gpt_dims *d)
{
    d->maxT = h[2];
    d->V = h[3];
    d->L = h[4];
    d->NH = h[5];
    d->C = h[6];
    d->Vp = h[1] == LLMC_VERSION_OLD ? h[3] : h[7];
}

/* Reads and checks path's header; *f is left open after it on success. */
static int open_checked(const char *path, FILE **f, td_gpt_dims *d, td_error_t *err)
{
    int32_t h[HEADER_INTS];
    td_error_t e = {0};
    struct stat st;
    size_t want;
    int rc, fd = td_data_open_fd(path, &st);

    *f = NULL;
    if (fd < 0)
        return td_error_set(err,
                            fd == -ENOENT                   ? TD_ENOTFOUND
                            : fd == -EACCES || fd == -EPERM ? TD_EPERM
                                                            : TD_EIO,
                            "%s: %s", path, strerror(-fd));
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return td_error_set(err, TD_EDATA, "%s: not a regular file (%s)", path,
                            td_data_file_kind(st.st_mode));
    }
    *f = fdopen(fd, "rb");
    if (*f == NULL) {
        close(fd);
        return td_error_set(err, TD_ENOMEM, "%s: %s", path, strerror(errno));
    }
    if (fread(h, sizeof(h), 1, *f) != 1) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: not an llm.c model file: shorter than its %d-byte header", path,
                          TD_LLMC_HEADER);
        goto fail;
    }
    if (h[0] != TD_LLMC_MAGIC) {
        rc = td_error_set(err, TD_EDATA, "%s: bad magic %d: an llm.c model file starts with %d",
                          path, (int)h[0], TD_LLMC_MAGIC);
        goto fail;
    }
    if (h[1] != TD_LLMC_VERSION && h[1] != LLMC_VERSION_OLD) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: unsupported version %d%s: traind reads version %d (fp32) and the "
                          "older fp32 version %d",
                          path, (int)h[1], h[1] == LLMC_VERSION_BF16 ? " (bf16)" : "",
                          TD_LLMC_VERSION, LLMC_VERSION_OLD);
        goto fail;
    }
    dims_of(h, d);
    if (td_gpt_check_dims(d, &e) != 0) {
        rc = td_error_set(err, TD_EDATA, "%s: bad header: %s", path, e.msg);
        goto fail;
    }
    want = TD_LLMC_HEADER + td_gpt_num_params(d) * sizeof(float);
    if ((uint64_t)st.st_size != want) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: wrong size: %lld bytes, but a model of maxT %d, V %d, L %d, NH %d, "
                          "C %d, Vp %d takes %zu",
                          path, (long long)st.st_size, d->maxT, d->V, d->L, d->NH, d->C, d->Vp,
                          want);
        goto fail;
    }
    return 0;

fail:
    fclose(*f);
    *f = NULL;
    return rc;
}

int td_llmc_peek(const char *path, td_gpt_dims *d, td_error_t *err)
{
    FILE *f;
    int rc = open_checked(path, &f, d, err);

    if (rc == 0)
        fclose(f);
    return rc;
}

int td_llmc_load(const char *path, td_gpt *m, td_error_t *err)
{
    td_gpt_dims d;
    FILE *f;
    int rc = open_checked(path, &f, &d, err);

    if (rc != 0)
        return rc;
    if (memcmp(&d, &m->d, sizeof(d)) != 0) {
        rc = td_error_set(err, TD_ESHAPE,
                          "%s: maxT %d, V %d, L %d, NH %d, C %d, Vp %d, but the model is maxT %d, "
                          "V %d, L %d, NH %d, C %d, Vp %d",
                          path, d.maxT, d.V, d.L, d.NH, d.C, d.Vp, m->d.maxT, m->d.V, m->d.L,
                          m->d.NH, m->d.C, m->d.Vp);
        goto out;
    }
    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        if ((rc = td_data_should_stop(path, err)) != 0)
            goto out;
        if (fread(m->p[i].data, sizeof(float), m->p[i].n, f) != m->p[i].n) {
            rc = td_error_set(err, TD_EIO, "%s: read error in tensor %d", path, i);
            goto out;
        }
    }
out:
    fclose(f);
    return rc;
}

int td_llmc_save(const char *path, const td_gpt *m, td_error_t *err)
{
    int32_t h[HEADER_INTS] = {0};
    char tmp[TD_PATH_MAX + 16];
    FILE *f;
    int rc = 0;

    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return td_error_set(err, TD_EINVAL, "%s: path too long", path);
    h[0] = TD_LLMC_MAGIC;
    h[1] = TD_LLMC_VERSION;
    h[2] = m->d.maxT;
    h[3] = m->d.V;
    h[4] = m->d.L;
    h[5] = m->d.NH;
    h[6] = m->d.C;
    h[7] = m->d.Vp;
    f = fopen(tmp, "wb");
    if (f == NULL)
        return td_error_set(err, TD_EIO, "%s: %s", tmp, strerror(errno));
    if (fwrite(h, sizeof(h), 1, f) != 1)
        rc = errno == ENOSPC ? TD_EDISKFULL : TD_EIO;
    for (int i = 0; i < TD_GPT_TENSORS && rc == 0; i++)
        if (fwrite(m->p[i].data, sizeof(float), m->p[i].n, f) != m->p[i].n)
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
