/* The memory estimate of train.h: what one replica of a job holds on its device (parameters,
 * gradients, optimizer moments, the activation arena with attention's scores, the CUDA
 * backend's workspace), for the memory guard that refuses a job that cannot fit and for
 * batch_size "auto". The model is declared into a td_params that is never allocated, and
 * the arena is sized by sizes.h's functions, the ones the trainer sizes its own arena with;
 * tests/test_memest.c also holds the two together. Reads no file but the headers and sizes of
 * init_from and the datasets (for the dataset's share, td_train_data_bytes). Also here, since
 * it reads the same headers: td_train_check_files, a job's files against its model before it
 * starts. Files are opened as data.h's access says. Any thread. */
#include <errno.h>
#include <glob.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/device.h"
#include "train/engine.h"
#include "train/safetensors.h"
#include "train/weights.h"
#include "train/sizes.h"
#include "train/slm.h"

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
    m->attn_chunk = cfg->attn_chunk;
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
    /* What the fused attention holds of its own in a training step: each layer's log-sum-exps,
     * kept for the backward, and the backward's transient block (two blocks of scores and a
     * float per row and head; the forward's one block is smaller), as gpt.c counts them. */
    out->attention = (size_t)d.L * td_tensor_bytes((size_t)BL * d.NH * T, 0) +
                     td_op_bytes_attention_scratch(BL, d.NH, T, T, m->attn_chunk, 1);
out:
    free(p);
    free(m);
    return rc;
}

/* A rough count of a sensorlm step's largest terms in double, to refuse sizes whose exact
 * count would wrap around. */
static int slm_too_big(const td_slm_dims *d, int B)
{
    double s = (double)d->N *
               (d->s.depth * (20.0 * d->s.D + 4.0 * d->s.M + 2.0 * d->s.H) + 8.0 * d->s.D + d->P);
    double t =
        (double)d->L * (d->t.depth * (20.0 * d->t.D + 4.0 * d->t.M + 2.0 * d->t.H) + 8.0 * d->t.D);

    return (double)B * (s + t + 4.0 * B) * 2 * sizeof(float) > MAX_BYTES;
}

/* A sensorlm: its buffers; the larger of a training step's arena and (rank 0, with a valid
 * split) an evaluation's over the windows and label prompts the shards' headers promise. */
static int estimate_slm(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
{
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params *p = calloc(1, sizeof(*p));
    int BL = td__train_max_rows(cfg), rc;
    size_t step, eval = 0;
    td_slm_peek pk;
    td_slm_dims d;

    if (m == NULL || p == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for a memory estimate");
        goto out;
    }
    rc = td__train_slm_dims(cfg, &d, &pk, err);
    if (rc == 0)
        rc = td_sensorlm_declare(m, p, &d, err);
    if (rc != 0)
        goto out;
    m->attn_chunk = cfg->attn_chunk;
    m->mask_same_label = cfg->mask_same_label;
    if (slm_too_big(&d, cfg->batch_size)) {
        rc = td_error_set(err, TD_E2BIG,
                          "batch_size %d of %d patches and %d text tokens: too "
                          "large to estimate",
                          cfg->batch_size, d.N, d.L);
        goto out;
    }
    buffers(out, p, td_optim_moments(cfg));
    step = td__train_slm_arena_bytes(m, BL, cfg->batch_size, cfg->world, 1);
    if (cfg->rank == 0)
        eval = td__slm_eval_bytes(m, cfg->batch_size, td__slm_eval_windows(cfg, pk.n_valid),
                                  pk.labels);
    out->activations = step > eval ? step : eval;
    out->attention = td_sensorlm_attention_bytes(m, BL, 1);
out:
    free(p);
    free(m);
    return rc;
}

/* The estimate without the dataset's share, which does not depend on the batch: what the
 * largest-batch search repeats, without reading the files each time. */
static int estimate(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
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
    else if (cfg->model == TD_MODEL_SENSORLM)
        rc = estimate_slm(cfg, out, err);
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

int td_train_memory_estimate(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err)
{
    size_t data = 0;
    int rc = estimate(cfg, out, err);

    if (rc == 0 && (rc = td_train_data_bytes(cfg, &data, err)) != 0)
        memset(out, 0, sizeof(*out));
    out->data = data;
    return rc;
}

/* The estimate's total with batch_size b. */
static int total_at(const td_train_config *cfg, int b, size_t *total, td_error_t *err)
{
    td_train_config c = *cfg;
    td_mem_estimate e;
    int rc;

    c.batch_size = b;
    rc = estimate(&c, &e, err);
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

/* ---- the dataset's bytes and the files against the model ----------------------------------- */

/* The field a pattern of a text/tokens split is named by in a message. */
static void pattern_field(char *out, size_t size, const char *split, int i)
{
    snprintf(out, size, "data.%s[%d]", split, i);
}

/* Calls fn on every regular file pattern i of split names: a plain path must be one; a glob's
 * matches that are not regular files are skipped (as td_data_open skips them), and at least
 * one must be. Errors are prefixed with the field. */
static int each_file(const char *split, const char (*pats)[TD_PATH_MAX], int n,
                     int (*fn)(void *ud, const char *path, td_error_t *e), void *ud,
                     td_error_t *err)
{
    char field[48];
    td_error_t e = {0};

    for (int i = 0; i < n; i++) {
        const char *pat = pats[i];
        int rc, found = 0;
        glob_t g;
        pattern_field(field, sizeof(field), split, i);
        if (strpbrk(pat, "*?[") == NULL) {
            int fd;
            if ((rc = td_data_open_file(pat, &fd, &e)) == 0) {
                close(fd);
                rc = fn(ud, pat, &e);
            }
            if (rc != 0)
                return td_error_set(err, rc, "%s: %s", field, e.msg);
            continue;
        }
        rc = td_data_glob(pat, 0, &g);
        if (rc != 0) {
            globfree(&g);
            return td_error_set(err, TD_EDATA, "%s: no file matches %s", field, pat);
        }
        for (size_t k = 0; k < g.gl_pathc && rc == 0; k++) {
            struct stat st;
            int fd;
            if ((rc = td_data_open_path(g.gl_pathv[k], TD_OPEN_ANY, &fd, &st, &e)) != 0)
                break;
            close(fd);
            if (!S_ISREG(st.st_mode))
                continue;
            found++;
            rc = fn(ud, g.gl_pathv[k], &e);
        }
        globfree(&g);
        if (rc != 0)
            return td_error_set(err, rc, "%s: %s", field, e.msg);
        if (found == 0)
            return td_error_set(err, TD_EDATA, "%s: no regular file matches %s", field, pat);
    }
    return 0;
}

/* Text: the file's bytes (its tokens). */
static int add_text(void *ud, const char *path, td_error_t *e)
{
    struct stat st;
    int fd, rc = td_data_open_file(path, &fd, e);

    if (rc != 0)
        return rc;
    if (fstat(fd, &st) == 0)
        *(uint64_t *)ud += (uint64_t)st.st_size;
    close(fd);
    return 0;
}

/* Shards: the header's token count (the header checked as the loader checks it). */
static int add_shard(void *ud, const char *path, td_error_t *e)
{
    int64_t count = 0;
    int rc = td_data_peek_shard(path, &count, e);

    *(uint64_t *)ud += (uint64_t)count;
    return rc;
}

/* Tokens of a text/tokens job's splits: train's into *train, all into *all. */
static int count_tokens(const td_train_config *cfg, uint64_t *train, uint64_t *all, td_error_t *err)
{
    int (*fn)(void *, const char *, td_error_t *) =
        cfg->data == TD_DATA_TEXT ? add_text : add_shard;
    int rc;

    *train = *all = 0;
    rc = each_file("train", cfg->train_files, cfg->n_train_files, fn, train, err);
    *all = *train;
    if (rc == 0)
        rc = each_file("valid", cfg->valid_files, cfg->n_valid_files, fn, all, err);
    return rc;
}

/* An IDX split's pixels and labels, as their headers declare them; its images in *n. */
static int idx_bytes(const td_idx_split *s, uint64_t *bytes, uint64_t *n, td_error_t *err)
{
    td_idx_header hi, hl;
    int rc;

    *n = 0;
    if (s->images[0] == '\0')
        return 0;
    if ((rc = td_idx_peek(s->images, TD_IDX_MAGIC_IMAGES, 0, &hi, err)) != 0 ||
        (rc = td_idx_peek(s->labels, TD_IDX_MAGIC_LABELS, 0, &hl, err)) != 0)
        return rc;
    *bytes += hi.bytes + hl.bytes;
    *n = hi.n;
    return 0;
}

int td_train_data_bytes(const td_train_config *cfg, size_t *bytes, td_error_t *err)
{
    uint64_t total = 0, n = 0, test_n = 0, train_tok = 0, all_tok = 0;
    td_gpt_dims d;
    int rc, T;

    *bytes = 0;
    if (cfg->data == TD_DATA_SENSOR) { /* the order, the labels and label tables (slm.h) */
        td_slm_peek pk;
        if ((rc = td__slm_peek(cfg, cfg->slm.time_steps, cfg->slm.channels, &pk, err)) != 0)
            return rc;
        *bytes = (size_t)pk.host;
        return 0;
    }
    if (cfg->data == TD_DATA_IDX) {
        if ((rc = idx_bytes(&cfg->train, &total, &n, err)) != 0 ||
            (rc = idx_bytes(&cfg->test, &total, &test_n, err)) != 0)
            return rc;
        *bytes = (size_t)(total + 4 * n); /* and the trainer's sample order, 4 bytes a sample */
        return 0;
    }
    if (cfg->data != TD_DATA_TEXT && cfg->data != TD_DATA_TOKENS)
        return 0;
    if ((rc = count_tokens(cfg, &train_tok, &all_tok, err)) != 0)
        return rc;
    if (cfg->data == TD_DATA_TEXT && all_tok > TD_DATA_MAX_TEXT_BYTES)
        return td_error_set(err, TD_E2BIG, "data: %llu bytes of text, more than the %llu read",
                            (unsigned long long)all_tok,
                            (unsigned long long)TD_DATA_MAX_TEXT_BYTES);
    if (cfg->data == TD_DATA_TEXT)
        total = 2 * all_tok; /* uint16 tokens */
    T = cfg->seq_len;
    if (T <= 0 && cfg->init_from[0] != '\0') {
        if ((rc = td__train_gpt_dims(cfg, &d, err)) != 0)
            return rc;
        T = d.maxT;
    }
    if (cfg->shuffle && T > 0 && train_tok > 0)
        total += 4 * ((train_tok - 1) / (uint64_t)T); /* the rows' order, 4 bytes a row */
    *bytes = (size_t)total;
    return 0;
}

/* An IDX split's headers against each other and the mlp's first and last layers. */
static int check_idx_split(const td_train_config *c, const char *key, const td_idx_split *s,
                           td_error_t *err)
{
    td_idx_header hi, hl;
    td_error_t e = {0};
    int last = c->n_layers - 1, rc;

    if ((rc = td_idx_peek(s->images, TD_IDX_MAGIC_IMAGES, 0, &hi, &e)) != 0)
        return td_error_set(err, rc, "data.%s.images: %s", key, e.msg);
    if ((rc = td_idx_peek(s->labels, TD_IDX_MAGIC_LABELS, 1, &hl, &e)) != 0)
        return td_error_set(err, rc, "data.%s.labels: %s", key, e.msg);
    if (hl.n != hi.n)
        return td_error_set(err, TD_EDATA, "data.%s.labels: %s has %u labels, but %s has %u images",
                            key, s->labels, hl.n, s->images, hi.n);
    /* A batch larger than the split would be one step of the whole split, every epoch: refused,
     * as a sensor job's is. */
    if (strcmp(key, "train") == 0 && c->batch_size > 0 && (uint64_t)c->batch_size > hi.n)
        return td_error_set(err, TD_EDATA,
                            "batch_size: %d, but the train split (%s) has %u images: at most %u",
                            c->batch_size, s->images, hi.n, hi.n);
    if (c->model != TD_MODEL_MLP || last < 1)
        return 0;
    if ((uint64_t)c->layers[0] != (uint64_t)hi.rows * hi.cols)
        return td_error_set(err, TD_ESHAPE,
                            "model.layers[0]: %d inputs, but the images of %s are %ux%u = %llu "
                            "pixels",
                            c->layers[0], s->images, hi.rows, hi.cols,
                            (unsigned long long)hi.rows * hi.cols);
    if (c->layers[last] <= hl.max_label)
        return td_error_set(err, TD_ESHAPE,
                            "model.layers[%d]: %d outputs, but %s has labels up to %d (%d classes)",
                            last, c->layers[last], s->labels, hl.max_label, hl.max_label + 1);
    return 0;
}

/* init_from's header, then the job's dimensions against it; text data's vocabulary. */
static int check_gpt_files(const td_train_config *c, td_error_t *err)
{
    td_gpt_dims d;
    td_error_t e = {0};
    int rc;

    if (c->init_from[0] != '\0' && (rc = td_weights_gpt_peek(c->init_from, c->n_head, &d, &e)) != 0)
        return td_error_set(err, rc, "model.init_from: %s", e.msg);
    if ((rc = td__train_gpt_dims(c, &d, err)) != 0)
        return rc;
    if (c->data == TD_DATA_TEXT && d.V < TD_TEXT_VOCAB)
        return td_error_set(err, TD_ESHAPE,
                            "model.vocab_size: %d, but text data is bytes: a vocabulary of %d", d.V,
                            TD_TEXT_VOCAB);
    return 0;
}

/* A sensorlm's init_from (a safetensors file only): every parameter of the job's model d in it
 * under its name with its shape. */
static int check_slm_init_from(const td_train_config *c, const td_slm_dims *d, td_error_t *err)
{
    td_sensorlm *m;
    td_params p = {0};
    td_error_t e = {0};
    int rc;

    if (c->init_from[0] == '\0')
        return 0;
    if (!td_st_is_path(c->init_from))
        return td_error_set(err, TD_EDATA,
                            "model.init_from: %s: a sensorlm starts only from a safetensors file "
                            "(a name ending in .safetensors)",
                            c->init_from);
    if ((m = calloc(1, sizeof(*m))) == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a sensorlm");
    rc = td_sensorlm_declare(m, &p, d, &e);
    if (rc == 0)
        rc = td_weights_slm_check(c->init_from, m, &e);
    if (rc != 0)
        td_error_set(err, rc, "model.init_from: %s", e.msg);
    td_params_free(&p);
    free(m);
    return rc;
}

/* Every sensor file's header, against the model's T and C and each other; the model's
 * dimensions against the files' (patch_t against T); the train split against the batch. */
static int check_slm_files(const td_train_config *c, td_error_t *err)
{
    td_slm_peek pk;
    td_slm_dims d;
    int rc = td__train_slm_dims(c, &d, &pk, err);

    if (rc == 0)
        rc = check_slm_init_from(c, &d, err);
    if (rc != 0)
        return rc;
    if (c->batch_size > 0 && pk.n_train < c->batch_size)
        return td_error_set(err, TD_EDATA,
                            "data.train: %lld windows in the train split, but a batch takes %d",
                            (long long)pk.n_train, c->batch_size);
    if (c->mask_same_label && pk.files > 0 && pk.train_labeled == 0)
        return td_error_set(err, TD_EINVAL, TD_SLM_NO_TRAIN_LABELS);
    return 0;
}

int td_train_check_files(const td_train_config *cfg, td_error_t *err)
{
    uint64_t train_tok = 0, all_tok = 0;
    size_t bytes = 0;
    int rc = 0;

    if (cfg->data == TD_DATA_IDX) {
        rc = check_idx_split(cfg, "train", &cfg->train, err);
        if (rc == 0 && cfg->test.images[0] != '\0')
            rc = check_idx_split(cfg, "test", &cfg->test, err);
    } else if (cfg->data == TD_DATA_TEXT || cfg->data == TD_DATA_TOKENS) {
        rc = count_tokens(cfg, &train_tok, &all_tok, err);
    } else if (cfg->data == TD_DATA_SENSOR && cfg->model == TD_MODEL_SENSORLM) {
        rc = check_slm_files(cfg, err);
    }
    if (rc == 0 && cfg->model == TD_MODEL_GPT)
        rc = check_gpt_files(cfg, err);
    if (rc == 0)
        rc = td_train_data_bytes(cfg, &bytes, err);
    if (rc == 0 && (uint64_t)bytes > TD_DATA_MAX_BYTES)
        rc = td_error_set(err, TD_E2BIG,
                          "data: the dataset takes %llu MiB in memory on each device, more than "
                          "the limit of %llu MiB",
                          (unsigned long long)(bytes >> 20),
                          (unsigned long long)(TD_DATA_MAX_BYTES >> 20));
    return rc;
}
