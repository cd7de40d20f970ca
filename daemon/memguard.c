/* The memory guard (see memguard.h): holds a job's estimated peak on one device against the
 * least free memory among its devices, finds the largest batch that fits, and gives a
 * batch_size "auto" job that batch. Pure: no I/O, no state. Loop thread. */
#include <stdio.h>
#include <string.h>

#include "memguard.h"

#define MIB(x) ((unsigned long long)((x) >> 20))

/* The refusal: the estimate by part, what is free, and what would fit. */
static int refuse(const td_memguard *g, int world, int batch_auto, td_error_t *err)
{
    const td_mem_estimate *e = &g->est;
    char tail[96];

    if (g->largest_batch > 0)
        snprintf(tail, sizeof(tail), "batch_size %d would fit", g->largest_batch);
    else
        snprintf(tail, sizeof(tail), "not even batch_size %d (one row per device) would fit",
                 world);
    return td_error_set(err, TD_ENOMEM,
                        "does not fit on %s: needs %llu MiB per device (parameters %llu, "
                        "gradients %llu, optimizer %llu, activations %llu of which attention "
                        "%llu, workspace %llu), %llu MiB free; %s%s",
                        g->device, MIB(e->total), MIB(e->params), MIB(e->grads), MIB(e->optim),
                        MIB(e->activations), MIB(e->attention), MIB(e->workspace),
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

int td_memguard_check(td_jobspec *spec, size_t free_bytes, size_t total_bytes, const char *device,
                      td_memguard *g, td_error_t *err)
{
    td_train_config c = spec->train;
    int world = c.world > 0 ? c.world : 1, rc;

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
    rc = largest_batch(&c, free_bytes, &g->largest_batch, err);
    if (rc != 0)
        return rc;
    if (spec->batch_auto && g->largest_batch > 0)
        c.batch_size = td_memguard_auto_batch(g->largest_batch, world);
    rc = td_train_memory_estimate(&c, &g->est, err);
    if (rc != 0)
        return rc;
    g->fits = g->est.total <= free_bytes;
    if (!g->fits)
        return refuse(g, world, spec->batch_auto, err);
    if (spec->batch_auto) {
        g->chose_batch = c.batch_size;
        spec->train.batch_size = c.batch_size;
        spec->batch_auto = 0;
    }
    return 0;
}
