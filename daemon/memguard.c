/* The memory guard (see memguard.h): holds a job's estimated peak on one device against the
 * least free memory among its devices, finds the largest batch that fits, and gives a
 * batch_size "auto" job that batch. No state; its only I/O is the dataset's headers and sizes,
 * read as the job's user (td_train_data_bytes), for the dataset's share. Loop thread. */
#include <stdio.h>
#include <string.h>

#include "train/data.h"
#include "train/device.h"
#include "daemon/memguard.h"

#define MIB(x) ((unsigned long long)((x) >> 20))

/* The refusal: the estimate by part, what is free, and what would fit. */
static int refuse(const td_memguard *g, int world, int batch_auto, td_error_t *err)
{
    const td_mem_estimate *e = &g->est;
    char tail[96], data[48] = "";

    if (g->largest_batch > 0)
        snprintf(tail, sizeof(tail), "batch_size %d would fit", g->largest_batch);
    else
        snprintf(tail, sizeof(tail), "not even batch_size %d (one row per device) would fit",
                 world);
    if (g->need > e->total)
        snprintf(data, sizeof(data), ", data %llu", MIB(g->need - e->total));
    return td_error_set(err, TD_ENOMEM,
                        "does not fit on %s: needs %llu MiB per device (parameters %llu, "
                        "gradients %llu, optimizer %llu, activations %llu of which attention "
                        "%llu, workspace %llu%s), %llu MiB free; %s%s",
                        g->device, MIB(g->need), MIB(e->params), MIB(e->grads), MIB(e->optim),
                        MIB(e->activations), MIB(e->attention), MIB(e->workspace), data,
                        MIB(g->free_bytes), tail, batch_auto ? " (batch_size \"auto\")" : "");
}

/* The largest global batch that fits, as a job could ask for it: td_train_largest_batch's
 * answer, cut to what a job file accepts (TD_JOB_MAX_BATCH); 0 when not even world rows fit. */
static int largest_batch(const td_train_config *c, size_t free_bytes, int *out, td_error_t *err)
{
    int batch = 0, rc = td_train_largest_batch(c, free_bytes, &batch, err);

    *out = 0;
    if (rc == TD_ENOMEM) {
        td_error_clear(err);
        return 0;
    }
    if (rc != 0)
        return rc;
    *out = batch < TD_JOB_MAX_BATCH ? batch : TD_JOB_MAX_BATCH;
    return 0;
}

int td_memguard_auto_batch(int largest, int world)
{
    if (world < 1 || largest < world)
        return 0;
    if (largest / world > TD_MEMGUARD_AUTO_MAX_ROWS)
        return TD_MEMGUARD_AUTO_MAX_ROWS * world;
    return largest / world * world;
}

/* td_memguard_check with the files' access set. */
static int check(td_jobspec *spec, size_t free_bytes, size_t total_bytes, const char *device,
                 td_memguard *g, td_error_t *err)
{
    td_train_config c = spec->train;
    int world = c.world > 0 ? c.world : 1, rc;
    /* cpu devices' free memory is the host's, which the dataset shares */
    int host = c.kernels == NULL || c.kernels == td_device_kernels(TD_DEVICE_CPU);
    size_t data = 0;

    memset(g, 0, sizeof(*g));
    g->free_bytes = free_bytes;
    g->total_bytes = total_bytes;
    snprintf(g->device, sizeof(g->device), "%s", device != NULL ? device : "?");
    c.world = world;
    if (!spec->batch_auto && c.batch_size < world)
        return td_error_set(err, TD_EINVAL, "batch_size %d cannot be split across %d devices",
                            c.batch_size, world);
    if (spec->batch_auto)
        c.batch_size = world; /* the smallest batch, for largest_batch to start from */
    if (host && (rc = td_train_data_bytes(&c, &data, err)) != 0)
        return rc;
    rc = largest_batch(&c, free_bytes > data ? free_bytes - data : 0, &g->largest_batch, err);
    if (rc != 0)
        return rc;
    if (spec->batch_auto && g->largest_batch > 0)
        c.batch_size = td_memguard_auto_batch(g->largest_batch, world);
    rc = td_train_memory_estimate(&c, &g->est, err);
    if (rc != 0)
        return rc;
    g->need = g->est.total + (host ? g->est.data : 0);
    g->fits = g->need <= free_bytes;
    if (!g->fits)
        return refuse(g, world, spec->batch_auto, err);
    if (spec->batch_auto) {
        g->chose_batch = c.batch_size;
        spec->train.batch_size = c.batch_size;
        spec->batch_auto = 0;
    }
    return 0;
}

int td_memguard_check(td_jobspec *spec, size_t free_bytes, size_t total_bytes, const char *device,
                      td_memguard *g, td_error_t *err)
{
    td_data_access as_user = {.uid = spec->uid, .gid = spec->gid};
    int rc = td_data_access_begin(&as_user, err);

    if (rc != 0) {
        memset(g, 0, sizeof(*g));
        return rc;
    }
    rc = check(spec, free_bytes, total_bytes, device, g, err);
    td_data_access_end();
    return rc;
}
