/* The trainer of train.h: builds one job's dataset, model, flat buffers, arena and tape in
 * td_trainer_new() (resuming from the job's latest checkpoint when there is one), then runs
 * the step loop one td_trainer_step() at a time: batch, forward, backward from the tape, the
 * data-parallel all-reduce, the NaN policy, clipping, the optimizer, metrics, evaluation and
 * checkpoints when due. Owns everything it acquired; the step allocates nothing. Used by one
 * thread at a time, under its panic boundary.
 *
 * MLP batches: each epoch visits every train sample once, in an order reshuffled at the
 * epoch's first step (a Fisher-Yates shuffle from the seed's own stream, applied to the
 * previous epoch's order). The last batch of an epoch holds the remainder (60000 samples at
 * 128 a batch: 468 batches of 128, then one of 96), as PyTorch's DataLoader does by default
 * (drop_last=False): every sample counts every epoch. So an epoch is
 * ceil(samples / batch_size) steps. GPT batches come from data.h's td_data.
 *
 * Data parallel (world > 1): every replica takes the same global batch and computes its rows
 * [rank*N/world, (rank+1)*N/world); its gradients and loss (grad[n], the buffer's slack) are
 * scaled by world*rows/N (1 for even slices, then left alone) and averaged by one
 * hooks.allreduce call of n + 1 floats, so every replica sees the global batch's mean and
 * takes the same update. Only rank 0 records metrics, evaluates and writes checkpoints.
 *
 * sensorlm: batches and evaluation come from slm.h (slm_data.c, slm_eval.c); each replica's
 * loss is already weighted for the global batch (the text embeddings are gathered across the
 * replicas inside the step, engine.h td_allgather_rows), so its slice is never reweighted. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "train/ckpt.h"
#include "train/data.h"
#include "train/engine.h"
#include "train/sizes.h"
#include "train/slm.h"
#include "common/td_clock.h"
#include "common/td_panic.h"
#include "train/weights.h"

#define CLIP_EPS       1e-6 /* torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6) */
#define SCALARS_FLOATS 16   /* bytes from scalars to clip_scale's out */
#define SCALARS_READ   (SCALARS_FLOATS + 8) /* bytes: sumsq, the count, factor and loss */

struct td_trainer {
    td_train_config cfg;
    td_train_hooks hooks;
    const td_kernels *k;
    td_params params;
    td_arena arena;
    td_tape tape;
    uint64_t config_hash;
    void *scalars;        /* backend memory: the grad norm's double, then the accuracy count, then
                           * clip_scale's factor and loss (floats): the step's one read-back is the
                           * first SCALARS_READ bytes */
    td_adamw_span *spans; /* backend memory: AdamW's tensors for adamw_flat (td_optim_spans) */
    int64_t syncs;        /* downloads and waiting uploads since the step began */
    int64_t step_syncs;   /* syncs of the last step's training part (td_trainer_host_syncs) */
    char *stage;          /* host memory a batch is built in before its upload; NULL when the
                           * backend's memory is host memory (the batch is built in place) */
    double flops;         /* per step, td_train_flops_per_step() */

    /* mlp */
    td_mlp mlp;
    td_idx train;
    td_idx test;        /* n == 0 when the job has no test split */
    int n_train;        /* train samples: [0, n_train) of train */
    int n_valid;        /* valid samples: [n_train, n_train + n_valid) of train */
    uint32_t *order;    /* (n_train) sample indices in this epoch's order */
    td_rng shuffle_rng; /* stream 2 of the seed; stream 1 initialises the model */
    float pixel[256];   /* a byte's value as a float: x/255 */
    int eval_batch;     /* samples */
    int64_t steps_per_epoch;

    /* gpt */
    td_gpt gpt;
    td_data *data;
    td_data_info info;
    int T;          /* tokens per row */
    int64_t n_eval; /* valid batches per evaluation */

    /* sensorlm */
    td_sensorlm *slm;
    td_slm_data *sdata;
    td_slm_eval ev; /* ev.nv == 0: no evaluation */

    int64_t total_steps;
    int64_t steps_done;
    int64_t ckpt_failed; /* the step whose due checkpoint the last step could not write; 0 */
    int64_t nan_skipped;
    int evaluated_zero; /* max_steps 0: the one evaluation is done */
};

void td_train_config_defaults(td_train_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->shuffle = 1;
    cfg->optim = TD_OPTIM_ADAMW;
    cfg->lr = 1e-3f;
    cfg->beta1 = 0.9f;
    cfg->beta2 = 0.999f;
    cfg->eps = 1e-8f;
    cfg->weight_decay = 0.0f;
    cfg->momentum = 0.9f;
    cfg->schedule = TD_SCHED_CONSTANT;
    cfg->batch_size = 128;
    cfg->epochs = 1;
    cfg->max_steps = -1;
    cfg->eval_every = 0;
    cfg->seed = 1;
    cfg->threads = 0;
    cfg->keep_checkpoints = 3;
    cfg->world = 1;
    cfg->on_nan = TD_ON_NAN_FAIL;
    cfg->debug_fail_kind = TD_FAIL_NONE;
}

/* ---- building ------------------------------------------------------------------------------- */

/* The model and data fields an mlp job needs. */
static int check_mlp_config(const td_train_config *cfg, td_error_t *err)
{
    if (cfg->data != TD_DATA_IDX)
        return td_error_set(err, TD_EINVAL, "data: an mlp reads idx data, not kind %d",
                            (int)cfg->data);
    if (cfg->n_layers < 2 || cfg->n_layers > TD_MAX_LAYERS)
        return td_error_set(err, TD_EINVAL, "layers: %d sizes (2 to %d allowed)", cfg->n_layers,
                            TD_MAX_LAYERS);
    for (int l = 0; l < cfg->n_layers; l++)
        if (cfg->layers[l] < 1)
            return td_error_set(err, TD_EINVAL, "layers[%d] = %d, must be >= 1", l, cfg->layers[l]);
    if (cfg->train.images[0] == '\0' || cfg->train.labels[0] == '\0')
        return td_error_set(err, TD_EINVAL, "train: images and labels are required");
    return 0;
}

static int check_slm_config(const td_train_config *cfg, td_error_t *err)
{
    if (cfg->data != TD_DATA_SENSOR)
        return td_error_set(err, TD_EINVAL, "data: a sensorlm reads sensor data, not kind %d",
                            (int)cfg->data);
    if (cfg->n_train_files < 1 || cfg->n_train_files > TD_MAX_PATTERNS || cfg->n_valid_files < 0 ||
        cfg->n_valid_files > TD_MAX_PATTERNS)
        return td_error_set(err, TD_EINVAL, "data: %d train and %d valid paths (train 1 to %d)",
                            cfg->n_train_files, cfg->n_valid_files, TD_MAX_PATTERNS);
    if (cfg->eval_batches < 0 || cfg->attn_chunk < 0)
        return td_error_set(err, TD_EINVAL, "eval_batches %d, attn_chunk %d: must be >= 0",
                            cfg->eval_batches, cfg->attn_chunk);
    return 0;
}

static int check_gpt_config(const td_train_config *cfg, td_error_t *err)
{
    if (cfg->data != TD_DATA_TEXT && cfg->data != TD_DATA_TOKENS)
        return td_error_set(err, TD_EINVAL, "data: a gpt reads text or tokens, not kind %d",
                            (int)cfg->data);
    if (cfg->n_train_files < 1 || cfg->n_train_files > TD_MAX_PATTERNS || cfg->n_valid_files < 0 ||
        cfg->n_valid_files > TD_MAX_PATTERNS)
        return td_error_set(err, TD_EINVAL, "data: %d train and %d valid paths (train 1 to %d)",
                            cfg->n_train_files, cfg->n_valid_files, TD_MAX_PATTERNS);
    if (cfg->eval_batches < 0)
        return td_error_set(err, TD_EINVAL, "eval_batches: %d, must be >= 0", cfg->eval_batches);
    return 0;
}

/* What the daemon's job validation should already have refused; checked again because a
 * trainer built from nonsense would divide by zero or index out of bounds. */
static int check_config(const td_train_config *cfg, const td_train_hooks *hooks, td_error_t *err)
{
    int rc;

    if (cfg->model == TD_MODEL_MLP)
        rc = check_mlp_config(cfg, err);
    else if (cfg->model == TD_MODEL_GPT)
        rc = check_gpt_config(cfg, err);
    else if (cfg->model == TD_MODEL_SENSORLM)
        rc = check_slm_config(cfg, err);
    else
        rc = td_error_set(err, TD_EINVAL, "model: unknown kind %d", (int)cfg->model);
    if (rc != 0)
        return rc;
    if (cfg->optim != TD_OPTIM_ADAMW && cfg->optim != TD_OPTIM_SGD)
        return td_error_set(err, TD_EINVAL, "optim: unknown kind %d", (int)cfg->optim);
    if (cfg->schedule != TD_SCHED_CONSTANT && cfg->schedule != TD_SCHED_COSINE &&
        cfg->schedule != TD_SCHED_RSQRT)
        return td_error_set(err, TD_EINVAL, "schedule: unknown kind %d", (int)cfg->schedule);
    if (!isfinite(cfg->lr) || cfg->lr < 0.0f || !isfinite(cfg->min_lr) || cfg->min_lr < 0.0f)
        return td_error_set(err, TD_EINVAL, "lr %g, min_lr %g: must be finite and >= 0", cfg->lr,
                            cfg->min_lr);
    if (!(cfg->warmup >= 0.0f && cfg->cooldown >= 0.0f && cfg->warmup + cfg->cooldown <= 1.0f))
        return td_error_set(err, TD_EINVAL,
                            "schedule: warmup %g and cooldown %g must be >= 0 with a sum <= 1",
                            cfg->warmup, cfg->cooldown);
    if (!(cfg->grad_clip >= 0.0f) || !(cfg->valid_fraction >= 0.0f && cfg->valid_fraction < 1.0f))
        return td_error_set(err, TD_EINVAL, "grad_clip %g must be >= 0, valid_fraction %g in [0,1)",
                            cfg->grad_clip, cfg->valid_fraction);
    if (cfg->batch_size < 1)
        return td_error_set(err, TD_EINVAL, "batch_size: %d, must be >= 1", cfg->batch_size);
    if (cfg->max_steps < -1)
        return td_error_set(err, TD_EINVAL, "max_steps: %lld, must be -1 or >= 0",
                            (long long)cfg->max_steps);
    if (cfg->max_steps == -1 && cfg->epochs < 1)
        return td_error_set(err, TD_EINVAL, "epochs: %d, must be >= 1", cfg->epochs);
    if (cfg->eval_every < 0 || cfg->checkpoint_every < 0)
        return td_error_set(err, TD_EINVAL, "eval_every %lld, checkpoint_every %lld: must be >= 0",
                            (long long)cfg->eval_every, (long long)cfg->checkpoint_every);
    if (cfg->world < 1 || cfg->rank < 0 || cfg->rank >= cfg->world)
        return td_error_set(err, TD_EINVAL, "rank %d of world %d", cfg->rank, cfg->world);
    if (cfg->world > cfg->batch_size)
        return td_error_set(err, TD_EINVAL, "batch_size %d cannot be split across %d replicas",
                            cfg->batch_size, cfg->world);
    if (cfg->world > 1 && (hooks == NULL || hooks->allreduce == NULL))
        return td_error_set(err, TD_EINVAL, "world %d needs an allreduce hook", cfg->world);
    return 0;
}

/* The trainer's sections (td__train_ckpt_sections). */
static int trainer_sections(td_trainer *t, td_ckpt_section *s)
{
    if (t->sdata != NULL)
        return td__train_ckpt_sections(&t->params, td__slm_norm(t->sdata), t->slm->d.C, s);
    return td__train_ckpt_sections(&t->params, NULL, 0, s);
}

/* The model must fit the data: one input per pixel, one output per class present. */
static int check_shapes(const td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    const td_idx *splits[2] = {&t->train, &t->test};
    const char *paths[2] = {cfg->train.images, cfg->test.images};
    int last = cfg->n_layers - 1;

    for (int i = 0; i < 2; i++) {
        const td_idx *d = splits[i];
        if (d->n == 0)
            continue;
        if (cfg->layers[0] != d->rows * d->cols)
            return td_error_set(err, TD_ESHAPE,
                                "layers[0] = %d inputs but the images of %s are %dx%d = %d "
                                "pixels",
                                cfg->layers[0], paths[i], d->rows, d->cols, d->rows * d->cols);
        if (cfg->layers[last] < d->classes)
            return td_error_set(err, TD_ESHAPE,
                                "layers[%d] = %d outputs but the labels of %s go up to %d "
                                "(%d classes)",
                                last, cfg->layers[last],
                                i == 0 ? cfg->train.labels : cfg->test.labels, d->classes - 1,
                                d->classes);
    }
    return 0;
}

/* The host buffer batches are built in on a device backend (bytes: the largest batch's
 * inputs, laid out as in the arena), page-locked where the table makes it so (k->alloc_host),
 * so the step's uploads are DMAs; none on a host backend. */
static int alloc_stage(td_trainer *t, size_t bytes, td_error_t *err)
{
    td_error_t why = {0};
    void *p = NULL;
    int rc;

    if (t->k->host)
        return 0;
    rc = t->k->alloc_host(&p, td_arena_round(bytes > 0 ? bytes : 1), &why);
    if (rc != 0)
        return td_error_set(err, rc, "no memory for a %zu-byte batch staging buffer: %s", bytes,
                            why.msg);
    t->stage = p;
    return 0;
}

/* Dataset, model, its flat buffers, and an arena and tape for the larger of a training step
 * and an evaluation batch (rank 0 evaluates). */
static int build_mlp(td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    int P = cfg->layers[0], rc, BL = td__train_max_rows(cfg);
    size_t step_bytes, eval_bytes = 0;

    rc = td_idx_load(&t->train, &cfg->train, err);
    if (rc == 0 && cfg->test.images[0] != '\0')
        rc = td_idx_load(&t->test, &cfg->test, err);
    if (rc == 0)
        rc = check_shapes(t, err);
    if (rc != 0)
        return rc;
    t->n_valid = (int)floor((double)t->train.n * cfg->valid_fraction);
    t->n_train = t->train.n - t->n_valid;
    if (t->n_train < 1)
        return td_error_set(err, TD_EDATA, "%s: no train samples left after valid_fraction %g",
                            cfg->train.images, cfg->valid_fraction);

    rc = td_mlp_declare(&t->mlp, &t->params, cfg->layers, cfg->n_layers);
    if (rc != 0)
        return td_error_set(err, rc, "model: cannot lay out %d layers", cfg->n_layers);
    if (td_params_alloc(&t->params, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters (4 buffers)",
                            t->params.n);
    td_mlp_init(&t->mlp, cfg->seed);

    step_bytes = td__train_mlp_arena_bytes(&t->mlp, BL, 1);
    if (cfg->rank == 0 && (t->test.n > 0 || t->n_valid > 0)) {
        int most = t->test.n > t->n_valid ? t->test.n : t->n_valid;
        t->eval_batch = most < TD_MLP_EVAL_BATCH ? most : TD_MLP_EVAL_BATCH;
        eval_bytes = td__train_mlp_arena_bytes(&t->mlp, t->eval_batch, 0);
    }
    rc = td_arena_init_on(&t->arena, step_bytes > eval_bytes ? step_bytes : eval_bytes, t->k, err);
    if (rc == 0)
        rc = alloc_stage(t, td__train_mlp_input_bytes(BL > t->eval_batch ? BL : t->eval_batch, P),
                         err);
    if (rc != 0)
        return rc;
    if (td_tape_init(&t->tape, td_mlp_tape_len(&t->mlp)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for the tape");

    t->order = malloc((size_t)t->n_train * sizeof(*t->order));
    if (t->order == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the sample order");
    for (int i = 0; i < t->n_train; i++)
        t->order[i] = (uint32_t)i;
    td_rng_seed(&t->shuffle_rng, cfg->seed, 2);
    for (int i = 0; i < 256; i++)
        t->pixel[i] = (float)i / 255.0f;
    t->steps_per_epoch = ((int64_t)t->n_train + cfg->batch_size - 1) / cfg->batch_size;
    return 0;
}

/* The token data of a gpt job (data.h). */
static int open_data(td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    const char *train[TD_MAX_PATTERNS], *valid[TD_MAX_PATTERNS];
    td_data_spec spec = {0};

    for (int i = 0; i < cfg->n_train_files; i++)
        train[i] = cfg->train_files[i];
    for (int i = 0; i < cfg->n_valid_files; i++)
        valid[i] = cfg->valid_files[i];
    spec.format = cfg->data == TD_DATA_TEXT ? TD_DATA_FORMAT_TEXT : TD_DATA_FORMAT_SHARDS;
    spec.train = train;
    spec.n_train = cfg->n_train_files;
    spec.valid = valid;
    spec.n_valid = cfg->n_valid_files;
    spec.valid_fraction = cfg->valid_fraction;
    spec.B = cfg->batch_size;
    spec.T = t->T;
    spec.shuffle = cfg->shuffle;
    spec.seed = cfg->seed;
    spec.vocab = t->gpt.d.V;
    return td_data_open(&t->data, &spec, err);
}

static int build_gpt(td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    int BL = td__train_max_rows(cfg), rc;
    td_gpt_dims d;
    size_t step_bytes, eval_bytes = 0;

    rc = td__train_gpt_dims(cfg, &d, err);
    if (rc != 0)
        return rc;
    if (cfg->data == TD_DATA_TEXT && d.V < TD_TEXT_VOCAB)
        return td_error_set(err, TD_ESHAPE,
                            "model.vocab_size: %d, but text data is bytes: a vocabulary of %d", d.V,
                            TD_TEXT_VOCAB);
    t->T = cfg->seq_len > 0 ? cfg->seq_len : d.maxT;
    rc = td_gpt_declare(&t->gpt, &t->params, &d, err);
    if (rc != 0)
        return rc;
    t->gpt.attn_chunk = cfg->attn_chunk;
    if (td_params_alloc(&t->params, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters (4 buffers)",
                            t->params.n);
    td_gpt_bind(&t->gpt);
    if (cfg->init_from[0] != '\0')
        rc = td_weights_gpt_load(cfg->init_from, &t->gpt, err);
    else
        td_gpt_init(&t->gpt, cfg->seed);
    if (rc == 0)
        rc = open_data(t, err);
    if (rc != 0)
        return rc;
    td_data_get_info(t->data, &t->info);
    t->n_eval = t->info.valid_batches;
    if (cfg->eval_batches > 0 && cfg->eval_batches < t->n_eval)
        t->n_eval = cfg->eval_batches;

    step_bytes = td__train_gpt_arena_bytes(&t->gpt, BL, t->T, 1);
    if (cfg->rank == 0 && t->n_eval > 0)
        eval_bytes = td__train_gpt_arena_bytes(&t->gpt, cfg->batch_size, t->T, 0);
    rc = td_arena_init_on(&t->arena, step_bytes > eval_bytes ? step_bytes : eval_bytes, t->k, err);
    if (rc == 0)
        rc = alloc_stage(t, td__train_gpt_input_bytes(t->n_eval > 0 ? cfg->batch_size : BL, t->T),
                         err);
    if (rc != 0)
        return rc;
    if (td_tape_init(&t->tape, td_gpt_tape_len(&t->gpt)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for the tape");
    t->steps_per_epoch = t->info.batches;
    return 0;
}

/* A sensorlm's evaluation buffers on the host: the similarities of a block of rows, the valid
 * windows' labels, the label prompts. */
static int alloc_slm_eval(td_trainer *t, td_error_t *err)
{
    td_slm_eval *ev = &t->ev;
    int64_t wide = ev->nv > ev->K ? ev->nv : ev->K, rows = ev->nv < ev->B ? ev->nv : ev->B;
    int L = t->slm->d.L, np = ev->NP > 0 ? ev->NP : 1;

    ev->sims = malloc((size_t)(rows * wide) * sizeof(float));
    ev->labels = malloc((size_t)ev->nv * sizeof(int));
    ev->ptok = malloc((size_t)np * L * sizeof(int));
    ev->pend = malloc((size_t)np * sizeof(int));
    ev->pof = malloc((size_t)np * sizeof(int));
    ev->pemb = malloc((size_t)(ev->K + ev->B) * t->slm->d.E * sizeof(float));
    if (ev->sims == NULL || ev->labels == NULL || ev->ptok == NULL || ev->pend == NULL ||
        ev->pof == NULL || ev->pemb == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the evaluation of %lld windows",
                            (long long)ev->nv);
    if (ev->K > 0)
        td__slm_prompts(t->sdata, ev->ptok, ev->pend, ev->pof);
    return 0;
}

/* The model, its flat buffers and initialisation, the sensor data, and an arena and tape for
 * the larger of a training step and an evaluation (rank 0, with a valid split). */
static int build_sensorlm(td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    int BL = td__train_max_rows(cfg), B = cfg->batch_size, rc;
    size_t step_bytes, eval_bytes = 0, stage;
    td_slm_dims d;

    if ((rc = td__train_slm_dims(cfg, &d, NULL, err)) != 0)
        return rc;
    if ((t->slm = calloc(1, sizeof(*t->slm))) == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a sensorlm");
    if ((rc = td_sensorlm_declare(t->slm, &t->params, &d, err)) != 0)
        return rc;
    t->slm->attn_chunk = cfg->attn_chunk;
    t->slm->mask_same_label = cfg->mask_same_label;
    t->slm->same_label_weight = cfg->same_label_weight;
    if (td_params_alloc(&t->params, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters (4 buffers)",
                            t->params.n);
    if (cfg->init_from[0] != '\0' && (rc = td_weights_slm_load(cfg->init_from, t->slm, err)) != 0)
        return rc;
    if (cfg->init_from[0] == '\0')
        td_sensorlm_init(t->slm, cfg->seed);
    if ((rc = td__slm_data_open(&t->sdata, cfg, &d, err)) != 0)
        return rc;
    t->ev = (td_slm_eval){.m = t->slm, .data = t->sdata, .arena = &t->arena, .k = t->k, .B = B};
    if (cfg->rank == 0) {
        t->ev.nv = td__slm_eval_windows(cfg, td__slm_valid_windows(t->sdata));
        t->ev.K = td__slm_labels(t->sdata);
        t->ev.NP = td__slm_prompt_count(t->sdata);
    }
    step_bytes = td__train_slm_arena_bytes(t->slm, BL, B, cfg->world, 1);
    stage = td__slm_input_bytes(&d, BL) + td__slm_label_bytes(t->slm, B);
    if (t->ev.nv > 0) {
        int rows = t->ev.nv < B ? (int)t->ev.nv : B;
        eval_bytes = td__slm_eval_bytes(t->slm, B, t->ev.nv, t->ev.K);
        stage = td__slm_input_bytes(&d, rows) > stage ? td__slm_input_bytes(&d, rows) : stage;
        if ((rc = alloc_slm_eval(t, err)) != 0)
            return rc;
    }
    rc = td_arena_init_on(&t->arena, step_bytes > eval_bytes ? step_bytes : eval_bytes, t->k, err);
    if (rc == 0)
        rc = alloc_stage(t, stage, err);
    if (rc != 0)
        return rc;
    t->ev.stage = t->stage;
    if (td_tape_init(&t->tape, td_sensorlm_tape_len(t->slm)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for the tape");
    t->steps_per_epoch = td__slm_batches(t->sdata);
    return 0;
}

/* Fisher-Yates over the mlp's train samples. */
static void shuffle(td_trainer *t)
{
    for (uint32_t i = (uint32_t)t->n_train - 1; i > 0; i--) {
        uint32_t j = td_rng_below(&t->shuffle_rng, i + 1);
        uint32_t tmp = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = tmp;
    }
}

/* Resumes from the latest checkpoint in checkpoint_dir, if any: the parameters and moments,
 * the step, the NaN count, and the data's position (gpt: the cursor; mlp: the shuffles of
 * every epoch begun so far, replayed). */
static int resume(td_trainer *t, td_error_t *err)
{
    td_ckpt_section sec[4];
    td_ckpt_meta meta;
    td_ckpt_found found;
    int n = trainer_sections(t, sec), rc;

    if (t->cfg.checkpoint_dir[0] == '\0')
        return 0;
    rc = td_ckpt_load_latest(t->cfg.checkpoint_dir, &meta, sec, n, &found, err);
    if (rc == TD_ENOTFOUND) {
        td_error_clear(err);
        return 0;
    }
    if (rc != 0)
        return rc;
    if (meta.config_hash != t->config_hash)
        return td_error_set(err, TD_ESTATE,
                            "%s was written by a job with another configuration (config hash "
                            "%016llx, this job's %016llx): it cannot be resumed with this one",
                            found.path, (unsigned long long)meta.config_hash,
                            (unsigned long long)t->config_hash);
    if (meta.step > t->total_steps)
        return td_error_set(err, TD_ESTATE, "%s is at step %lld, past the job's %lld steps",
                            found.path, (long long)meta.step, (long long)t->total_steps);
    t->steps_done = meta.step;
    t->nan_skipped = meta.cursor[2];
    if (t->data != NULL) {
        td_data_cursor c = {.epoch = meta.cursor[0], .batch = meta.cursor[1]};
        rc = td_data_seek(t->data, c, err);
    } else if (t->sdata != NULL) {
        td_data_cursor c = {.epoch = meta.cursor[0], .batch = meta.cursor[1]};
        rc = td__slm_seek(t->sdata, c, err);
    } else if (t->cfg.shuffle) {
        int64_t begun = (meta.step + t->steps_per_epoch - 1) / t->steps_per_epoch;
        for (int64_t e = 0; e < begun; e++)
            shuffle(t);
    }
    return rc;
}

/* Moves the model, built and resumed on the host, to where the backend computes, with the
 * step's device scalars. A device's copies panic on its errors, so they run under a boundary
 * of their own: td_trainer_new returns errors. */
static int place(td_trainer *t, td_error_t *err)
{
    td_boundary b;
    int rc;

    td_boundary_enter(&b);
    if (TD_CAUGHT(&b)) {
        *err = b.err;
        return err->code;
    }
    rc = td_params_place(&t->params, t->k, err);
    if (rc == 0 && t->cfg.model == TD_MODEL_GPT)
        td_gpt_bind(&t->gpt);
    if (rc == 0)
        rc = t->k->alloc(&t->scalars, 3 * sizeof(double), err);
    if (rc == 0)
        rc = td_optim_spans(t->k, &t->params, &t->spans, err);
    td_boundary_leave(&b);
    return rc;
}

int td_trainer_new(td_trainer **out, const td_train_config *cfg, const td_train_hooks *hooks,
                   td_error_t *err)
{
    td_trainer *t = NULL;
    int rc;

    *out = NULL;
    rc = check_config(cfg, hooks, err);
    if (rc != 0)
        goto out;
    t = calloc(1, sizeof(*t));
    if (t == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for a trainer");
        goto out;
    }
    t->cfg = *cfg;
    if (hooks != NULL)
        t->hooks = *hooks;
    t->k = cfg->kernels != NULL ? cfg->kernels : td_kernels_cpu();
    if (cfg->threads > 0)
        t->k->set_threads(cfg->threads);
    t->config_hash = td__train_config_hash(cfg);

    rc = cfg->model == TD_MODEL_MLP   ? build_mlp(t, err)
         : cfg->model == TD_MODEL_GPT ? build_gpt(t, err)
                                      : build_sensorlm(t, err);
    if (rc != 0)
        goto out;
    t->total_steps = cfg->max_steps >= 0 ? cfg->max_steps : cfg->epochs * t->steps_per_epoch;
    rc = resume(t, err);
    if (rc == 0)
        rc = place(t, err);
    if (rc != 0)
        goto out;
    t->flops = td_train_flops_per_step(cfg);
    *out = t;
    t = NULL;

out:
    td_trainer_free(t);
    return rc;
}

int64_t td_trainer_total_steps(const td_trainer *t)
{
    return t->total_steps;
}

int64_t td_trainer_checkpoint_failed(const td_trainer *t)
{
    return t->ckpt_failed;
}

int64_t td_trainer_steps_done(const td_trainer *t)
{
    return t->steps_done;
}

int64_t td_trainer_host_syncs(const td_trainer *t)
{
    return t->step_syncs;
}

/* ---- evaluation ----------------------------------------------------------------------------- */

static void emit(const td_trainer *t, const char *key, int64_t step, double value)
{
    if (t->hooks.metric != NULL && t->cfg.rank == 0)
        t->hooks.metric(t->hooks.ud, key, step, value);
}

/* k->download, counted: each blocks the host until the backend has run every op before it. */
static void sync_download(td_trainer *t, void *dst, const void *src, size_t bytes)
{
    t->syncs++;
    t->k->download(dst, src, bytes);
}

/* A one-element tensor's value, from wherever the backend keeps it. */
static float scalar(td_trainer *t, const td_tensor *x)
{
    float v;

    sync_download(t, &v, x->data, sizeof(v));
    return v;
}

/* Where rows of (T) tokens and targets are built for the arena's tok and tgt: in place on a
 * host backend; in the stage on a device one, then uploaded by upload_tokens. */
static void stage_tokens(const td_trainer *t, int rows, int *tok, int *tgt, int **htok, int **htgt)
{
    size_t bytes = (size_t)rows * t->T * sizeof(int);

    *htok = t->stage != NULL ? (int *)t->stage : tok;
    *htgt = t->stage != NULL ? (int *)(t->stage + td_arena_round(bytes)) : tgt;
}

static void upload_tokens(const td_trainer *t, int rows, int *tok, int *tgt, const int *htok,
                          const int *htgt)
{
    size_t bytes = (size_t)rows * t->T * sizeof(int);

    if (t->stage == NULL)
        return;
    t->k->upload_async(tok, htok, bytes); /* the stage is refilled after the step's read-back */
    t->k->upload_async(tgt, htgt, bytes);
}

/* A batch of N samples of d into the arena: samples idx[0..N) (or first..first+N when idx is
 * NULL), pixels as floats in [0,1] and labels as ints.
 * x is (N, rows*cols), *targets is (N) */
static td_tensor *load_batch(const td_trainer *t, td_ctx *c, const td_idx *d, const uint32_t *idx,
                             int first, int N, int **targets)
{
    int P = d->rows * d->cols;
    td_tensor *x = td_tensor_new(c, 2, (int[]){N, P}, 0);
    int *y = td_arena_alloc(c->arena, (size_t)N * sizeof(int));
    size_t xbytes = (size_t)N * P * sizeof(float);
    float *hx = t->stage != NULL ? (float *)t->stage : x->data;
    int *hy = t->stage != NULL ? (int *)(t->stage + td_arena_round(xbytes)) : y;

    for (int i = 0; i < N; i++) {
        size_t s = idx != NULL ? idx[i] : (size_t)(first + i);
        const uint8_t *img = d->images + s * (size_t)P;
        float *row = hx + (size_t)i * P;
        for (int p = 0; p < P; p++)
            row[p] = t->pixel[img[p]];
        hy[i] = d->labels[s];
    }
    if (t->stage != NULL) {
        t->k->upload_async(x->data, hx, xbytes);
        t->k->upload_async(y, hy, (size_t)N * sizeof(int));
    }
    *targets = y;
    return x;
}

/* Mean loss and accuracy over samples [first, first+n) of d, forward only, eval_batch at a
 * time; records them as name_loss and name_accuracy. */
static void evaluate_idx(td_trainer *t, const td_idx *d, int first, int n, const char *name,
                         int64_t step)
{
    td_ctx c = {.k = t->k, .arena = &t->arena, .tape = NULL};
    int V = t->mlp.sizes[t->mlp.n_sizes - 1];
    double loss_sum = 0.0;
    int64_t correct = 0;
    char key[32];

    for (int i = 0; i < n; i += t->eval_batch) {
        int N = n - i < t->eval_batch ? n - i : t->eval_batch;
        int64_t right = 0;
        td_tensor *logits, *loss, *x;
        int *y;

        td_arena_reset(&t->arena);
        x = load_batch(t, &c, d, NULL, first + i, N, &y);
        loss = td_mlp_forward(&c, &t->mlp, x, y, &logits);
        t->k->argmax_correct((int64_t *)t->scalars + 1, logits->data, y, N, V);
        sync_download(t, &right, (int64_t *)t->scalars + 1, sizeof(right));
        loss_sum += (double)scalar(t, loss) * N;
        correct += right;
    }
    snprintf(key, sizeof(key), "%s_loss", name);
    emit(t, key, step, loss_sum / n);
    snprintf(key, sizeof(key), "%s_accuracy", name);
    emit(t, key, step, (double)correct / n);
}

/* Mean loss over the first n_eval windows of the valid split, batch by batch, no tape. */
static void evaluate_gpt(td_trainer *t, int64_t step)
{
    td_ctx c = {.k = t->k, .arena = &t->arena, .tape = NULL};
    int B = t->cfg.batch_size, T = t->T;
    double loss_sum = 0.0;
    td_error_t e = {0};

    for (int64_t i = 0; i < t->n_eval; i++) {
        int *tok, *tgt, *htok, *htgt;
        td_tensor *loss;

        td_arena_reset(&t->arena);
        tok = td_arena_alloc(&t->arena, (size_t)B * T * sizeof(int));
        tgt = td_arena_alloc(&t->arena, (size_t)B * T * sizeof(int));
        stage_tokens(t, B, tok, tgt, &htok, &htgt);
        if (td_data_valid_fill(t->data, i, 0, B, htok, htgt, &e) != 0)
            td_panic(TD_EDATA, "dataset error in the valid split at step %lld: %s", (long long)step,
                     e.msg);
        upload_tokens(t, B, tok, tgt, htok, htgt);
        loss = td_gpt_forward(&c, &t->gpt, tok, tgt, B, T, NULL);
        loss_sum += scalar(t, loss);
    }
    emit(t, "valid_loss", step, loss_sum / (double)t->n_eval);
}

/* A sensorlm's evaluation (slm_eval.c) on the first ev.nv valid windows, its five metrics. */
static void evaluate_slm(td_trainer *t, int64_t step)
{
    td_slm_metrics m;

    td__slm_evaluate(&t->ev, &m);
    emit(t, "valid_loss", step, m.valid_loss);
    emit(t, "recall_at_1", step, m.recall_at_1);
    emit(t, "recall_at_5", step, m.recall_at_5);
    emit(t, "text_recall_at_1", step, m.text_recall_at_1);
    if (!isnan(m.zeroshot_accuracy))
        emit(t, "zeroshot_accuracy", step, m.zeroshot_accuracy);
}

/* The evaluations due after step (rank 0 alone: the others go on to the next step and wait
 * for rank 0 in its all-reduce). */
static void evaluate(td_trainer *t, int64_t step)
{
    if (t->cfg.rank != 0)
        return;
    if (t->cfg.model == TD_MODEL_SENSORLM) {
        if (t->ev.nv > 0)
            evaluate_slm(t, step);
        return;
    }
    if (t->cfg.model == TD_MODEL_GPT) {
        if (t->n_eval > 0)
            evaluate_gpt(t, step);
        return;
    }
    if (t->n_valid > 0)
        evaluate_idx(t, &t->train, t->n_train, t->n_valid, "valid", step);
    if (t->test.n > 0)
        evaluate_idx(t, &t->test, 0, t->test.n, "test", step);
}

/* An evaluation follows every eval_every steps and the job's last step; with eval_every 0, an
 * mlp's each epoch's last step too. */
static int eval_due(const td_trainer *t, int64_t step)
{
    if (step == t->total_steps)
        return 1;
    if (t->cfg.eval_every > 0)
        return step % t->cfg.eval_every == 0;
    return t->cfg.model == TD_MODEL_MLP && step % t->steps_per_epoch == 0;
}

/* ---- checkpoints ---------------------------------------------------------------------------- */

/* The device's parameters and moments into their host copies, under a boundary of its own
 * (a device error is an error here, not a panic). */
static int params_to_host(td_params *p, td_error_t *err)
{
    td_boundary b;

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_params_to_host(p);
        td_boundary_leave(&b);
        return 0;
    }
    *err = b.err;
    return err->code;
}

int td_sensorlm_embedder_from_trainer(td_sensorlm_embedder **out, td_trainer *t, int rows,
                                      td_error_t *err)
{
    td_train_config cfg = t->cfg;
    int rc;

    *out = NULL;
    if (t->slm == NULL)
        return td_error_set(err, TD_EINVAL, "not a sensorlm trainer");
    if ((rc = params_to_host(&t->params, err)) != 0)
        return rc;
    cfg.kernels = t->k;
    return td__slm_embedder_new(out, &cfg, &t->slm->d, t->params.host_data, t->params.n,
                                td__slm_norm(t->sdata), t->steps_done, rows, err);
}

int td_trainer_checkpoint(td_trainer *t, td_error_t *err)
{
    td_ckpt_section sec[4];
    td_ckpt_meta meta = {0};
    int n, rc;

    if (t->cfg.rank != 0 || t->cfg.checkpoint_dir[0] == '\0')
        return 0;
    if ((rc = params_to_host(&t->params, err)) != 0)
        return rc;
    n = trainer_sections(t, sec);
    meta.step = t->steps_done;
    meta.config_hash = t->config_hash;
    memcpy(meta.rng, t->shuffle_rng.s, sizeof(t->shuffle_rng.s));
    if (t->data != NULL || t->sdata != NULL) {
        td_data_cursor c = t->data != NULL ? td_data_tell(t->data) : td__slm_tell(t->sdata);
        meta.cursor[0] = c.epoch;
        meta.cursor[1] = c.batch;
    } else {
        meta.cursor[0] = t->steps_done / t->steps_per_epoch;
        meta.cursor[1] = t->steps_done % t->steps_per_epoch;
    }
    meta.cursor[2] = t->nan_skipped;
    if (t->hooks.flush != NULL)
        t->hooks.flush(t->hooks.ud);
    return td_ckpt_write(t->cfg.checkpoint_dir, t->cfg.keep_checkpoints, &meta, sec, n, NULL, 0,
                         err);
}

/* Every checkpoint_every steps, and after the last step (so the job's final model is the
 * latest checkpoint, for export and sampling). A failed write fails the job. */
static void checkpoint_if_due(td_trainer *t, int64_t step)
{
    const td_train_config *cfg = &t->cfg;
    td_error_t e = {0};
    int rc;

    if (cfg->rank != 0 || cfg->checkpoint_dir[0] == '\0')
        return;
    if (step != t->total_steps && (cfg->checkpoint_every == 0 || step % cfg->checkpoint_every != 0))
        return;
    rc = td_trainer_checkpoint(t, &e);
    if (rc != 0) {
        t->ckpt_failed = step;
        td_panic(rc, "checkpoint at step %lld: %s", (long long)step, e.msg);
    }
}

/* ---- the step ---------------------------------------------------------------------------------
 */

/* debug.fail: the faults that strike before the step computes anything. */
static void inject_fault(const td_trainer *t, int64_t step)
{
    if (t->cfg.debug_fail_step != step)
        return;
    switch (t->cfg.debug_fail_kind) {
    case TD_FAIL_PANIC:
        td_panic(TD_EPANIC, "injected panic at step %lld", (long long)step);
    case TD_FAIL_OOM:
        td_panic(TD_ENOMEM, "out of memory");
    case TD_FAIL_DATA:
        td_panic(TD_EDATA, "injected read error at step %lld", (long long)step);
    case TD_FAIL_STICKY:
        td_panic(TD_ECUDA,
                 "injected sticky CUDA error at step %lld: cudaErrorIllegalAddress: an illegal "
                 "memory access was encountered",
                 (long long)step);
    case TD_FAIL_NAN: /* poisons the loss, in step_loss() */
    case TD_FAIL_NONE:
        break;
    }
}

/* What one replica's forward gave: its loss, the loss tensor to run backward from (NULL when
 * it has no rows), its rows and the global batch's. */
typedef struct pass {
    td_tensor *loss;
    int rows, global_rows;
    double samples; /* samples (mlp) or tokens (gpt) in the global batch */
} pass;

/* The mlp's forward on this replica's rows of the step's batch. */
static pass mlp_forward(td_trainer *t, td_ctx *c, int64_t step)
{
    const td_train_config *cfg = &t->cfg;
    int64_t batch = (step - 1) % t->steps_per_epoch; /* within the epoch, from 0 */
    int first = (int)(batch * cfg->batch_size);
    int N = t->n_train - first < cfg->batch_size ? t->n_train - first : cfg->batch_size;
    int r0 = (int)((int64_t)cfg->rank * N / cfg->world);
    pass p = {.rows = td__train_local_rows(cfg, N), .global_rows = N, .samples = N};
    td_tensor *x;
    int *y;

    if (batch == 0 && cfg->shuffle)
        shuffle(t);
    if (p.rows > 0) {
        x = load_batch(t, c, &t->train, t->order + first + r0, 0, p.rows, &y);
        p.loss = td_mlp_forward(c, &t->mlp, x, y, NULL);
    }
    return p;
}

/* The gpt's forward on this replica's rows of the batch at the data's cursor. */
static pass gpt_forward(td_trainer *t, td_ctx *c)
{
    const td_train_config *cfg = &t->cfg;
    int B = cfg->batch_size, T = t->T;
    int r0 = (int)((int64_t)cfg->rank * B / cfg->world);
    pass p = {.rows = td__train_local_rows(cfg, B), .global_rows = B, .samples = (double)B * T};
    td_error_t e = {0};
    int *tok = td_arena_alloc(c->arena, (size_t)p.rows * T * sizeof(int));
    int *tgt = td_arena_alloc(c->arena, (size_t)p.rows * T * sizeof(int));
    int *htok, *htgt;

    stage_tokens(t, p.rows, tok, tgt, &htok, &htgt);
    if (td_data_fill(t->data, r0, r0 + p.rows, htok, htgt, &e) != 0)
        td_panic(TD_EDATA, "%s", e.msg);
    upload_tokens(t, p.rows, tok, tgt, htok, htgt);
    p.loss = td_gpt_forward(c, &t->gpt, tok, tgt, p.rows, T, NULL);
    return p;
}

/* The sensorlm's forward on this replica's rows of the batch at the data's cursor: both towers,
 * then the loss over the global batch (the text side gathered across the replicas; with
 * loss.mask_same_label, the labels of every row of the global batch beside the inputs). */
static pass slm_forward(td_trainer *t, td_ctx *c)
{
    const td_train_config *cfg = &t->cfg;
    const td_slm_dims *d = &t->slm->d;
    int B = cfg->batch_size, r0 = (int)((int64_t)cfg->rank * B / cfg->world);
    pass p = {.rows = td__train_local_rows(cfg, B), .global_rows = B, .samples = B};
    size_t xb = td_tensor_bytes((size_t)p.rows * d->N * d->P, 0);
    size_t tb = td_arena_round((size_t)p.rows * d->L * sizeof(int));
    size_t eb = td_arena_round((size_t)p.rows * sizeof(int));
    td_tensor *x = td_tensor_new(c, 3, (int[]){p.rows, d->N, d->P}, 0), *s, *u;
    int *tok = td_arena_alloc(c->arena, (size_t)p.rows * d->L * sizeof(int));
    int *end = td_arena_alloc(c->arena, (size_t)p.rows * sizeof(int));
    int *lab = t->slm->mask_same_label ? td_arena_alloc(c->arena, (size_t)B * sizeof(int)) : NULL;
    float *hx = t->stage != NULL ? (float *)t->stage : x->data;
    int *htok = t->stage != NULL ? (int *)(t->stage + xb) : tok;
    int *hend = t->stage != NULL ? (int *)(t->stage + xb + tb) : end;
    int *hlab = t->stage != NULL ? (int *)(t->stage + xb + tb + eb) : lab;
    td_error_t e = {0};

    if (td__slm_fill(t->sdata, r0, r0 + p.rows, hx, htok, hend, &e) != 0)
        td_panic(TD_EDATA, "%s", e.msg);
    if (lab != NULL)
        td__slm_fill_labels(t->sdata, hlab);
    if (t->stage != NULL) {
        t->k->upload_async(x->data, hx, (size_t)p.rows * d->N * d->P * sizeof(float));
        t->k->upload_async(tok, htok, (size_t)p.rows * d->L * sizeof(int));
        t->k->upload_async(end, hend, (size_t)p.rows * sizeof(int));
        if (lab != NULL)
            t->k->upload_async(lab, hlab, (size_t)B * sizeof(int));
    }
    if (cfg->world > 1) {
        c->allreduce = t->hooks.allreduce;
        c->allreduce_ud = t->hooks.ud;
        c->world = cfg->world;
    }
    s = td_sensorlm_sensor(c, t->slm, x);
    u = td_sensorlm_text(c, t->slm, tok, end, p.rows);
    p.loss = td_sensorlm_loss_masked(c, t->slm, s, u, lab, B, r0);
    return p;
}

static const char *nonfinite(float x)
{
    return isnan(x) ? "NaN" : "Inf";
}

/* Forward, the NaN policy's first check (this replica's loss, before any work is shared),
 * backward. Returns the local loss (NaN when poisoned by debug.fail). With defer, the loss is
 * not read back (0 returned): the fused step reads it with the norm, after the update. */
static float step_loss(td_trainer *t, td_ctx *c, int64_t step, pass *p, int defer)
{
    const td_train_config *cfg = &t->cfg;
    float value = 0.0f;

    *p = cfg->model == TD_MODEL_MLP   ? mlp_forward(t, c, step)
         : cfg->model == TD_MODEL_GPT ? gpt_forward(t, c)
                                      : slm_forward(t, c);
    if (defer) {
        if (p->loss != NULL)
            td_backward(c, p->loss);
        return 0.0f;
    }
    if (p->loss != NULL)
        value = scalar(t, p->loss);
    if (cfg->debug_fail_kind == TD_FAIL_NAN && cfg->debug_fail_step == step)
        value = NAN;
    if (!isfinite(value) && cfg->on_nan == TD_ON_NAN_FAIL)
        td_panic(TD_ENAN, "loss is %s at step %lld", nonfinite(value), (long long)step);
    if (p->loss != NULL)
        td_backward(c, p->loss);
    return value;
}

/* Averages gradients and loss across the replicas: one all-reduce of the gradient buffer with
 * the loss in its slack. Uneven slices are weighted by their rows first. Returns the global
 * batch's loss. */
static float allreduce(td_trainer *t, const pass *p, float value)
{
    float *g = t->params.grad;
    size_t n = t->params.n;
    float w;

    if (t->cfg.world == 1)
        return value;
    t->syncs++;
    t->k->upload(g + n, &value, sizeof(value));
    w = (float)((double)t->cfg.world * p->rows / p->global_rows);
    if (w != 1.0f && t->cfg.model != TD_MODEL_SENSORLM) /* its loss is weighted already */
        t->k->scale(g, w, n + 1);
    t->hooks.allreduce(t->hooks.ud, g, n + 1);
    sync_download(t, &value, g + n, sizeof(value));
    return value;
}

/* One process, AdamW or SGD: the norm, the clip's factor and the update on the backend, then the
 * step's only host sync, one download of the sum of squares and the loss. A NaN or Inf loss or
 * norm has made adamw_flat or sgd_flat skip the update; the caller applies the NaN policy to what
 * comes back. Returns the loss, *norm the gradient's global norm. */
static float fused_update(td_trainer *t, const pass *p, float lr, int64_t step, double *norm)
{
    unsigned char *s = t->scalars;
    unsigned char back[SCALARS_READ];
    float *f = (float *)(void *)(s + SCALARS_FLOATS), out[2];
    double ss;

    t->k->sumsq((double *)t->scalars, t->params.grad, t->params.n);
    t->k->clip_scale(f, (double *)t->scalars, p->loss != NULL ? p->loss->data : NULL,
                     t->cfg.grad_clip);
    td_optim_step_flat(t->k, &t->params, &t->cfg, t->spans, f, lr, step);
    sync_download(t, back, s, sizeof(back));
    memcpy(&ss, back, sizeof(ss));
    memcpy(out, back + SCALARS_FLOATS, sizeof(out));
    *norm = sqrt(ss);
    return out[1];
}

int td_trainer_step_caught(td_trainer *t, td_error_t *err)
{
    td_boundary b;
    int done;

    t->ckpt_failed = 0;
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        done = td_trainer_step(t);
        td_boundary_leave(&b);
        return done;
    }
    *err = b.err;
    return -1;
}

int td_trainer_step(td_trainer *t)
{
    const td_train_config *cfg = &t->cfg;
    td_ctx c = {.k = t->k, .arena = &t->arena, .tape = &t->tape};
    int64_t step = t->steps_done + 1;
    double t0, ms, norm;
    float lr, value;
    int skipped = 0, fused;
    pass p;

    if (t->total_steps == 0 && !t->evaluated_zero) {
        t->evaluated_zero = 1;
        evaluate(t, 0);
        return 1;
    }
    if (t->steps_done >= t->total_steps)
        return 1;
    t0 = td_mono_ms();
    inject_fault(t, step);
    td_arena_reset(&t->arena);
    td_tape_reset(&t->tape);
    t->k->zero(t->params.grad, t->params.n);

    t->syncs = 0;
    fused = cfg->world == 1 && td_optim_has_flat(t->k, cfg) &&
            !(cfg->debug_fail_kind == TD_FAIL_NAN && cfg->debug_fail_step == step);
    value = step_loss(t, &c, step, &p, fused);
    lr = td_schedule_lr(cfg, step, t->total_steps);
    if (fused) {
        value = fused_update(t, &p, lr, step, &norm);
    } else {
        value = allreduce(t, &p, value);
        t->syncs++;
        norm = td_grad_norm(t->k, &t->params, t->scalars);
    }
    if (!isfinite(value) || !isfinite(norm)) {
        if (cfg->on_nan == TD_ON_NAN_FAIL)
            td_panic(TD_ENAN, "%s is %s at step %lld", isfinite(value) ? "gradient" : "loss",
                     isfinite(value) ? nonfinite((float)norm) : nonfinite(value), (long long)step);
        skipped = 1;
        t->nan_skipped++;
    } else if (!fused) {
        if (cfg->grad_clip > 0.0f && norm > cfg->grad_clip)
            t->k->scale(t->params.grad, (float)(cfg->grad_clip / (norm + CLIP_EPS)), t->params.n);
        td_optim_step(t->k, &t->params, cfg, lr, step);
    }
    if (t->data != NULL)
        td_data_advance(t->data);
    if (t->sdata != NULL)
        td__slm_advance(t->sdata);
    ms = td_mono_ms() - t0;
    t->steps_done = step;
    t->step_syncs = t->syncs;

    if (cfg->model == TD_MODEL_MLP && (step - 1) % t->steps_per_epoch == 0)
        emit(t, "epoch", step, (double)((step - 1) / t->steps_per_epoch + 1));
    if (!skipped) {
        emit(t, "train_loss", step, value);
        emit(t, "grad_norm", step, norm);
    } else {
        emit(t, "nan_skipped", step, (double)t->nan_skipped);
    }
    emit(t, "lr", step, lr);
    emit(t, "step_ms", step, ms);
    emit(t, cfg->model == TD_MODEL_GPT ? "tokens_per_s" : "samples_per_s", step,
         ms > 0.0 ? p.samples / (ms / 1e3) : 0.0);
    if (cfg->peak_flops > 0.0 && ms > 0.0)
        emit(t, "mfu", step, t->flops / (ms / 1e3) / (cfg->peak_flops * cfg->world));
    if (eval_due(t, step))
        evaluate(t, step);
    checkpoint_if_due(t, step);
    return step == t->total_steps;
}

void td_trainer_free(td_trainer *t)
{
    if (t == NULL)
        return;
    td_tape_free(&t->tape);
    td__slm_data_free(t->sdata);
    free(t->ev.sims);
    free(t->ev.labels);
    free(t->ev.ptok);
    free(t->ev.pend);
    free(t->ev.pof);
    free(t->ev.pemb);
    if (t->scalars != NULL)
        t->k->free(t->scalars);
    if (t->spans != NULL)
        t->k->free(t->spans);
    if (t->stage != NULL)
        t->k->free_host(t->stage);
    td_arena_free(&t->arena);
    td_params_free(&t->params); /* it points into t->slm's tensors */
    free(t->slm);
    td_data_free(t->data);
    free(t->order);
    td_idx_free(&t->test);
    td_idx_free(&t->train);
    free(t);
}

const td_arena *td_trainer_arena(const td_trainer *t)
{
    return &t->arena;
}

const void *td_trainer_stage(const td_trainer *t)
{
    return t->stage;
}

td_params *td_trainer_params(td_trainer *t)
{
    return &t->params;
}

size_t td_trainer_step_bytes(const td_trainer *t)
{
    int BL = td__train_max_rows(&t->cfg);

    if (t->cfg.model == TD_MODEL_GPT)
        return td__train_gpt_arena_bytes(&t->gpt, BL, t->T, 1);
    if (t->cfg.model == TD_MODEL_SENSORLM)
        return td__train_slm_arena_bytes(t->slm, BL, t->cfg.batch_size, t->cfg.world, 1);
    return td__train_mlp_arena_bytes(&t->mlp, BL, 1);
}
