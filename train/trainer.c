/* The trainer of train.h: builds one job's dataset, model, flat buffers, arena and tape in
 * td_trainer_new(), then runs the step loop one td_trainer_step() at a time (batch, forward,
 * backward from the tape, optimizer update, metrics, evaluation when due). Owns everything it
 * acquired; the step allocates nothing. Used by one thread at a time, under its boundary.
 *
 * Batches: each epoch visits every train sample once, in an order reshuffled at the epoch's
 * first step (a Fisher-Yates shuffle from the seed's own stream). The last batch of an epoch
 * holds the remainder (60000 samples at 128 a batch: 468 batches of 128, then one of 96), as
 * PyTorch's DataLoader does by default (drop_last=False): every sample counts every epoch. So
 * an epoch is ceil(samples / batch_size) steps. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "td_panic.h"

#define EVAL_BATCH 1000 /* samples per forward when evaluating (no tape, so bigger is cheap) */

struct td_trainer {
    td_train_config cfg;
    td_train_hooks hooks;
    const td_kernels *k;

    td_idx train;
    td_idx test;        /* n == 0 when the job has no test split */
    uint32_t *order;    /* (train.n) sample indices in this epoch's order */
    td_rng shuffle_rng; /* stream 2 of the seed; stream 1 initialises the model */
    float pixel[256];   /* a byte's value as a float: x/255 */

    td_mlp mlp;
    td_params params;
    td_arena arena;
    td_tape tape;
    int eval_batch; /* samples */

    int64_t steps_per_epoch;
    int64_t total_steps;
    int64_t steps_done;
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
}

/* What the daemon's job validation should already have refused; checked again because a
 * trainer built from nonsense would divide by zero or index out of bounds. */
static int check_config(const td_train_config *cfg, td_error_t *err)
{
    if (cfg->model != TD_MODEL_MLP)
        return td_error_set(err, TD_EINVAL, "model: unknown kind %d", (int)cfg->model);
    if (cfg->data != TD_DATA_IDX)
        return td_error_set(err, TD_EINVAL, "data: unknown kind %d", (int)cfg->data);
    if (cfg->n_layers < 2 || cfg->n_layers > TD_MAX_LAYERS)
        return td_error_set(err, TD_EINVAL, "layers: %d sizes (2 to %d allowed)", cfg->n_layers,
                            TD_MAX_LAYERS);
    for (int l = 0; l < cfg->n_layers; l++)
        if (cfg->layers[l] < 1)
            return td_error_set(err, TD_EINVAL, "layers[%d] = %d, must be >= 1", l, cfg->layers[l]);
    if (cfg->optim != TD_OPTIM_ADAMW && cfg->optim != TD_OPTIM_SGD)
        return td_error_set(err, TD_EINVAL, "optim: unknown kind %d", (int)cfg->optim);
    if (cfg->schedule != TD_SCHED_CONSTANT)
        return td_error_set(err, TD_EINVAL, "schedule: unknown kind %d", (int)cfg->schedule);
    if (!isfinite(cfg->lr) || cfg->lr < 0.0f)
        return td_error_set(err, TD_EINVAL, "lr: %g, must be finite and >= 0", cfg->lr);
    if (cfg->batch_size < 1)
        return td_error_set(err, TD_EINVAL, "batch_size: %d, must be >= 1", cfg->batch_size);
    if (cfg->max_steps < -1)
        return td_error_set(err, TD_EINVAL, "max_steps: %lld, must be -1 or >= 0",
                            (long long)cfg->max_steps);
    if (cfg->max_steps == -1 && cfg->epochs < 1)
        return td_error_set(err, TD_EINVAL, "epochs: %d, must be >= 1", cfg->epochs);
    if (cfg->eval_every < 0)
        return td_error_set(err, TD_EINVAL, "eval_every: %lld, must be >= 0",
                            (long long)cfg->eval_every);
    if (cfg->train.images[0] == '\0' || cfg->train.labels[0] == '\0')
        return td_error_set(err, TD_EINVAL, "train: images and labels are required");
    return 0;
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

/* Arena bytes of one batch's input (pixels as floats, targets as ints). */
static size_t batch_bytes(int N, int pixels)
{
    return td_tensor_bytes((size_t)N * (size_t)pixels, 0) + td_arena_round((size_t)N * sizeof(int));
}

/* The model, its flat buffers, and an arena and tape sized for the larger of a training step
 * and an evaluation batch. */
static int build_engine(td_trainer *t, td_error_t *err)
{
    const td_train_config *cfg = &t->cfg;
    int P = cfg->layers[0];
    size_t step_bytes, eval_bytes = 0;
    int rc;

    rc = td_mlp_declare(&t->mlp, &t->params, cfg->layers, cfg->n_layers);
    if (rc != 0)
        return td_error_set(err, rc, "model: cannot lay out %d layers", cfg->n_layers);
    if (td_params_alloc(&t->params, td_optim_moments(cfg)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters (4 buffers)",
                            t->params.n);
    td_mlp_init(&t->mlp, cfg->seed);

    step_bytes = batch_bytes(cfg->batch_size, P) + td_mlp_arena_bytes(&t->mlp, cfg->batch_size, 1);
    if (t->test.n > 0) {
        t->eval_batch = t->test.n < EVAL_BATCH ? t->test.n : EVAL_BATCH;
        eval_bytes = batch_bytes(t->eval_batch, P) + td_mlp_arena_bytes(&t->mlp, t->eval_batch, 0);
    }
    if (td_arena_init(&t->arena, step_bytes > eval_bytes ? step_bytes : eval_bytes) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for a %zu-byte activation arena",
                            step_bytes > eval_bytes ? step_bytes : eval_bytes);
    if (td_tape_init(&t->tape, td_mlp_tape_len(&t->mlp)) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for the tape");
    return 0;
}

int td_trainer_new(td_trainer **out, const td_train_config *cfg, const td_train_hooks *hooks,
                   td_error_t *err)
{
    td_trainer *t = NULL;
    int rc;

    *out = NULL;
    rc = check_config(cfg, err);
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
    t->k = td_kernels_cpu();
    if (cfg->threads > 0)
        t->k->set_threads(cfg->threads);

    rc = td_idx_load(&t->train, &cfg->train, err);
    if (rc == 0 && cfg->test.images[0] != '\0')
        rc = td_idx_load(&t->test, &cfg->test, err);
    if (rc == 0)
        rc = check_shapes(t, err);
    if (rc == 0)
        rc = build_engine(t, err);
    if (rc != 0)
        goto out;

    t->order = malloc((size_t)t->train.n * sizeof(*t->order));
    if (t->order == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for the sample order");
        goto out;
    }
    for (int i = 0; i < t->train.n; i++)
        t->order[i] = (uint32_t)i;
    td_rng_seed(&t->shuffle_rng, cfg->seed, 2);
    for (int i = 0; i < 256; i++)
        t->pixel[i] = (float)i / 255.0f;

    t->steps_per_epoch = ((int64_t)t->train.n + cfg->batch_size - 1) / cfg->batch_size;
    t->total_steps = cfg->max_steps >= 0 ? cfg->max_steps : cfg->epochs * t->steps_per_epoch;
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

int64_t td_trainer_steps_done(const td_trainer *t)
{
    return t->steps_done;
}

static void emit(const td_trainer *t, const char *key, int64_t step, double value)
{
    if (t->hooks.metric != NULL)
        t->hooks.metric(t->hooks.ud, key, step, value);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Fisher-Yates over the whole train split. */
static void shuffle(td_trainer *t)
{
    for (uint32_t i = (uint32_t)t->train.n - 1; i > 0; i--) {
        uint32_t j = td_rng_below(&t->shuffle_rng, i + 1);
        uint32_t tmp = t->order[i];
        t->order[i] = t->order[j];
        t->order[j] = tmp;
    }
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

    for (int i = 0; i < N; i++) {
        size_t s = idx != NULL ? idx[i] : (size_t)(first + i);
        const uint8_t *img = d->images + s * (size_t)P;
        float *row = x->data + (size_t)i * P;
        for (int p = 0; p < P; p++)
            row[p] = t->pixel[img[p]];
        y[i] = d->labels[s];
    }
    *targets = y;
    return x;
}

/* Mean loss and accuracy over the whole test split, forward only, EVAL_BATCH at a time. */
static void evaluate(td_trainer *t, int64_t step)
{
    td_ctx c = {.k = t->k, .arena = &t->arena, .tape = NULL};
    int V = t->mlp.sizes[t->mlp.n_sizes - 1];
    double loss_sum = 0.0;
    int64_t correct = 0;

    for (int first = 0; first < t->test.n; first += t->eval_batch) {
        int N = t->test.n - first < t->eval_batch ? t->test.n - first : t->eval_batch;
        int64_t right = 0;
        td_tensor *logits, *loss, *x;
        int *y;

        td_arena_reset(&t->arena);
        x = load_batch(t, &c, &t->test, NULL, first, N, &y);
        loss = td_mlp_forward(&c, &t->mlp, x, y, &logits);
        t->k->argmax_correct(&right, logits->data, y, N, V);
        loss_sum += (double)loss->data[0] * N;
        correct += right;
    }
    emit(t, "test_loss", step, loss_sum / t->test.n);
    emit(t, "test_accuracy", step, (double)correct / t->test.n);
}

/* An evaluation follows the last step of each epoch, or every eval_every steps, and always the
 * job's last step. */
static int eval_due(const td_trainer *t, int64_t step, int64_t batch)
{
    if (t->test.n == 0)
        return 0;
    if (step == t->total_steps)
        return 1;
    if (t->cfg.eval_every > 0)
        return step % t->cfg.eval_every == 0;
    return batch == t->steps_per_epoch - 1;
}

int td_trainer_step(td_trainer *t)
{
    const td_train_config *cfg = &t->cfg;
    td_ctx c = {.k = t->k, .arena = &t->arena, .tape = &t->tape};
    int64_t step = t->steps_done + 1;
    int64_t batch = (step - 1) % t->steps_per_epoch; /* within the epoch, from 0 */
    int first = (int)(batch * cfg->batch_size);
    int N = t->train.n - first < cfg->batch_size ? t->train.n - first : cfg->batch_size;
    td_tensor *x, *loss;
    double t0, ms;
    float lr, value;
    int *y;

    if (t->steps_done >= t->total_steps)
        return 1;
    t0 = now_ms();
    if (batch == 0 && cfg->shuffle)
        shuffle(t);
    td_arena_reset(&t->arena);
    td_tape_reset(&t->tape);
    t->k->zero(t->params.grad, t->params.n);

    x = load_batch(t, &c, &t->train, t->order + first, 0, N, &y);
    loss = td_mlp_forward(&c, &t->mlp, x, y, NULL);
    value = loss->data[0];
    if (!isfinite(value))
        td_panic(TD_ENAN, "loss is %s at step %lld", isnan(value) ? "NaN" : "Inf", (long long)step);
    td_backward(&c, loss);
    lr = td_schedule_lr(cfg, step);
    td_optim_step(t->k, &t->params, cfg, lr, step);
    ms = now_ms() - t0;
    t->steps_done = step;

    if (batch == 0)
        emit(t, "epoch", step, (double)((step - 1) / t->steps_per_epoch + 1));
    emit(t, "train_loss", step, value);
    emit(t, "lr", step, lr);
    emit(t, "step_ms", step, ms);
    emit(t, "samples_per_s", step, ms > 0.0 ? N / (ms / 1e3) : 0.0);
    if (eval_due(t, step, batch))
        evaluate(t, step);
    return step == t->total_steps;
}

void td_trainer_free(td_trainer *t)
{
    if (t == NULL)
        return;
    td_tape_free(&t->tape);
    td_arena_free(&t->arena);
    td_params_free(&t->params);
    free(t->order);
    td_idx_free(&t->test);
    td_idx_free(&t->train);
    free(t);
}

const td_arena *td_trainer_arena(const td_trainer *t)
{
    return &t->arena;
}

td_params *td_trainer_params(td_trainer *t)
{
    return &t->params;
}

size_t td_trainer_step_bytes(const td_trainer *t)
{
    return batch_bytes(t->cfg.batch_size, t->cfg.layers[0]) +
           td_mlp_arena_bytes(&t->mlp, t->cfg.batch_size, 1);
}
