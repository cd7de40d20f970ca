/* The memory estimate of train.h: what one replica of a job holds on its device (parameters,
 * gradients, optimizer moments, the activation arena with attention's scores, the CUDA
 * backend's workspace), for the memory guard that refuses a job that cannot fit and for
 * batch_size "auto". The model is declared into a td_params that is never allocated, and
 * the arena is sized by sizes.h's functions, the ones the trainer sizes its own arena with;
 * tests/test_memest.c also holds the two together. Reads no file but init_from's header.
 * Any thread. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "engine.h"
#include "sizes.h"

/* Estimates past this are refused rather than risk a wrapped size_t. */
#define MAX_BYTES ((double)(1ull << 62))

/* What td_params_alloc acquires for p: data, grad with its slack, and the moments. */
static void buffers(td_mem_estimate *out, const td_params *p, int n_moments)
{
    out->n_floats = p->n;
    out->params = td_arena_round(p->n * sizeof(float));
    out->grads = td_arena_round((p->n + TD_PARAMS_ALIGN) * sizeof(float));
    out->optim = (size_t)n_moments * out->params;
}

static int estimate_mlp(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
{
    td_mlp *m = calloc(1, sizeof(*m));
    td_params *p = calloc(1, sizeof(*p));
    int BL = td__train_max_rows(cfg), rc = 0;
    size_t step, eval = 0;

    if (m == NULL || p == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for a memory estimate");
        goto out;
    }
    if (td_mlp_declare(m, p, cfg->layers, cfg->n_layers) != 0) {
        rc = td_error_set(err, TD_EINVAL, "layers: %d sizes (2 to %d, each >= 1)", cfg->n_layers,
                          TD_MAX_LAYERS);
        goto out;
    }
    buffers(out, p, td_optim_moments(cfg));
    step = td__train_mlp_arena_bytes(m, BL, 1);
    if (cfg->rank == 0 && (cfg->test.images[0] != '\0' || cfg->valid_fraction > 0.0f))
        eval = td__train_mlp_arena_bytes(m, TD_MLP_EVAL_BATCH, 0);
    out->activations = step > eval ? step : eval;
    out->attention = 0;
out:
    free(p);
    free(m);
    return rc;
}

/* A rough count of a gpt step's largest terms in double, to refuse sizes whose exact count
 * would wrap around. */
static int gpt_too_big(const td_gpt_dims *d, int B, int T)
{
    double rows = (double)B * T;
    double per_row = d->L * ((double)d->NH * T + 20.0 * d->C) + 3.0 * d->Vp;

    return rows * per_row * 2 * sizeof(float) > MAX_BYTES;
}

static int estimate_gpt(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
{
    td_gpt *m = calloc(1, sizeof(*m));
    td_params *p = calloc(1, sizeof(*p));
    int BL = td__train_max_rows(cfg), T, rc;
    td_gpt_dims d;
    size_t step, eval = 0;

    if (m == NULL || p == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for a memory estimate");
        goto out;
    }
    rc = td__train_gpt_dims(cfg, &d, err);
    if (rc == 0)
        rc = td_gpt_declare(m, p, &d, err);
    if (rc != 0)
        goto out;
    T = cfg->seq_len > 0 ? cfg->seq_len : d.maxT;
    if (gpt_too_big(&d, cfg->batch_size > BL ? cfg->batch_size : BL, T)) {
        rc = td_error_set(err, TD_E2BIG, "batch_size %d of %d tokens: too large to estimate",
                          cfg->batch_size, T);
        goto out;
    }
    buffers(out, p, td_optim_moments(cfg));
    step = td__train_gpt_arena_bytes(m, BL, T, 1);
    if (cfg->rank == 0 && (cfg->n_valid_files > 0 || cfg->valid_fraction > 0.0f))
        eval = td__train_gpt_arena_bytes(m, cfg->batch_size, T, 0);
    out->activations = step > eval ? step : eval;
    out->attention =
        (size_t)d.L * td_arena_round((size_t)BL * (size_t)d.NH * (size_t)T * T * sizeof(float));
out:
    free(p);
    free(m);
    return rc;
}

int td_train_memory_estimate(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
{
    int rc;

    memset(out, 0, sizeof(*out));
    if (cfg->batch_size < 1 || cfg->world < 1 || cfg->rank < 0 || cfg->rank >= cfg->world ||
        cfg->world > cfg->batch_size)
        return td_error_set(err, TD_EINVAL, "batch_size %d over rank %d of world %d",
                            cfg->batch_size, cfg->rank, cfg->world);
    if (cfg->model == TD_MODEL_MLP)
        rc = estimate_mlp(cfg, out, err);
    else if (cfg->model == TD_MODEL_GPT)
        rc = estimate_gpt(cfg, out, err);
    else
        rc = td_error_set(err, TD_EINVAL, "model: unknown kind %d", (int)cfg->model);
    if (rc != 0) {
        memset(out, 0, sizeof(*out));
        return rc;
    }
    out->batch = td__train_max_rows(cfg);
    out->workspace = cfg->kernels != NULL && !cfg->kernels->host ? TD_DEVICE_CUDA_CONTEXT_BYTES : 0;
    out->total = out->params + out->grads + out->optim + out->activations + out->workspace;
    return 0;
}

/* The estimate's total with batch_size b. */
static int total_at(const td_train_config *cfg, int b, size_t *total, td_error_t *err)
{
    td_train_config c = *cfg;
    td_mem_estimate e;
    int rc;

    c.batch_size = b;
    rc = td_train_memory_estimate(&c, &e, err);
    *total = e.total;
    return rc;
}

/* The total grows with the batch (never shrinks: an mlp's evaluation part is a constant under
 * a max), so: double until it no longer fits, then bisect between the last batch that fits and
 * the first that does not. A batch too large to estimate counts as not fitting. */
int td_train_largest_batch(const td_train_config *cfg, size_t bytes, int *batch, td_error_t *err)
{
    int lo = cfg->world > 1 ? cfg->world : 1, hi, rc;
    size_t total;

    *batch = 0;
    rc = total_at(cfg, lo, &total, err);
    if (rc != 0)
        return rc;
    if (total > bytes)
        return td_error_set(err, TD_ENOMEM, "a batch of %d needs %zu MiB, %zu MiB available", lo,
                            total >> 20, bytes >> 20);
    for (hi = lo;;) {
        hi = hi > TD_MEM_MAX_BATCH / 2 ? TD_MEM_MAX_BATCH : 2 * hi;
        rc = total_at(cfg, hi, &total, err);
        if (rc == TD_E2BIG) {
            td_error_clear(err);
            break;
        }
        if (rc != 0)
            return rc;
        if (total > bytes)
            break;
        lo = hi;
        if (hi == TD_MEM_MAX_BATCH) {
            *batch = hi;
            return 0;
        }
    }
    while (hi - lo > 1) { /* lo fits, hi does not */
        int mid = lo + (hi - lo) / 2;
        rc = total_at(cfg, mid, &total, err);
        if (rc != 0 && rc != TD_E2BIG)
            return rc;
        if (rc == 0 && total <= bytes)
            lo = mid;
        else
            hi = mid;
        td_error_clear(err);
    }
    *batch = lo;
    return 0;
}
