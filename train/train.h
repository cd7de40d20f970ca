/* The training engine: one job's model, optimizer, data and step loop, as a library. It knows
 * nothing of the daemon: a caller (a device worker) builds a td_trainer from a validated
 * td_train_config, calls td_trainer_step() inside its panic boundary (common/td_panic.h) until
 * it answers "done", and receives metric samples through td_train_hooks.
 *
 * Memory: td_trainer_new() acquires everything a job needs (the flat parameter, gradient and
 * optimizer buffers, the per-step activation arena, the tape, the dataset). td_trainer_step()
 * allocates nothing; a panic inside it leaves the trainer's memory owned by the trainer, so
 * td_trainer_free() after a panic releases all of it.
 *
 * Threads: a td_trainer is used by one thread at a time. */
#ifndef TD_TRAIN_H
#define TD_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "td_errno.h"

#define TD_MAX_LAYERS 16   /* sizes in an MLP, input and output included */
#define TD_PATH_MAX   1024 /* bytes of a path in a job, NUL included */

typedef enum { TD_MODEL_MLP = 1 } td_model_kind;
typedef enum { TD_DATA_IDX = 1 } td_data_kind;
typedef enum { TD_OPTIM_ADAMW = 1, TD_OPTIM_SGD = 2 } td_optim_kind;
typedef enum { TD_SCHED_CONSTANT = 1 } td_sched_kind;

/* An IDX image file and its label file (gzipped or not, told apart by the gzip magic). */
typedef struct td_idx_split {
    char images[TD_PATH_MAX];
    char labels[TD_PATH_MAX];
} td_idx_split;

/* A validated job. The daemon fills it from the job file (daemon/jobspec.c) and documents
 * each key in README.md; defaults noted here are the job file's. */
typedef struct td_train_config {
    td_model_kind model;
    int layers[TD_MAX_LAYERS]; /* mlp: sizes from input to classes, e.g. 784,256,256,10 */
    int n_layers;              /* entries used in layers, >= 2 */

    td_data_kind data;
    td_idx_split train; /* required */
    td_idx_split test;  /* optional: images[0] == '\0' when absent */
    int shuffle;        /* reshuffle the train split each epoch with the job's seed; default 1 */

    td_optim_kind optim;
    float lr;           /* default 1e-3 */
    float beta1, beta2; /* adamw; default 0.9, 0.999 */
    float eps;          /* adamw; default 1e-8 */
    float weight_decay; /* adamw (decoupled) and sgd; default 0 */
    float momentum;     /* sgd; default 0.9 */
    td_sched_kind schedule;

    int batch_size;     /* samples per step; default 128. An epoch is ceil(samples / batch_size)
                         * steps: its last batch holds the remainder (PyTorch's drop_last=False) */
    int epochs;         /* passes over the train split; default 1 */
    int64_t max_steps;  /* -1: epochs decide; otherwise exactly this many steps, in place of
                         * epochs: fewer, or more (the data cycles on, reshuffled each epoch),
                         * or 0 (none) */
    int64_t eval_every; /* steps between evaluations of the test split; 0: at each epoch end.
                         * Either way the last step evaluates too */
    uint64_t seed;      /* initialisation and shuffling; default 1 */
    int threads;        /* BLAS threads for this trainer; 0: the library's default. OpenBLAS
                         * keeps one pool per process, so the last trainer built sets it */
} td_train_config;

/* Fills cfg with the defaults above (model, data and paths left empty). */
void td_train_config_defaults(td_train_config *cfg);

/* How a trainer reports. Called on the thread that calls td_trainer_step(). */
typedef struct td_train_hooks {
    void *ud;
    /* One sample. May block (the daemon's metric queue applies back-pressure). Keys a job
     * records: train_loss, step_ms, samples_per_s and lr every step; epoch at the first step
     * of each epoch; test_loss and test_accuracy at each evaluation. */
    void (*metric)(void *ud, const char *key, int64_t step, double value);
} td_train_hooks;

typedef struct td_trainer td_trainer;

/* Builds a trainer: reads the dataset, checks it against the model (layers[0] must equal the
 * image size, the last layer must cover every label), initialises parameters from the seed.
 * Errors are returned, never panicked: TD_EDATA naming the file and what was wrong,
 * TD_ESHAPE for a model that does not fit its data (naming the layer), TD_ENOMEM, and
 * TD_EINVAL for a config that job validation should have refused. Copies cfg and hooks
 * (hooks may be NULL: no metrics).
 * Caller frees with td_trainer_free(). */
int td_trainer_new(td_trainer **out, const td_train_config *cfg, const td_train_hooks *hooks,
                   td_error_t *err);

/* Steps the job will take in all. */
int64_t td_trainer_total_steps(const td_trainer *t);

/* Steps taken so far (the number of the last completed step; steps count from 1). */
int64_t td_trainer_steps_done(const td_trainer *t);

/* Takes one optimizer step, then evaluates when one is due. Returns 0 when steps remain and
 * 1 when the job has taken its last step (and 1, doing nothing, when called after that). Must
 * run under a panic boundary: a non-finite loss panics with TD_ENAN ("loss is NaN at step 41",
 * "loss is Inf at step 41") before any update, so the step does not count; an exhausted
 * activation arena panics with TD_ENOMEM. (The data is read and checked whole by
 * td_trainer_new(), so a step meets no TD_EDATA today; a streaming dataset may.)
 * Metrics of step S, in order: epoch (first step of an epoch), train_loss, lr, step_ms (batch,
 * forward, backward and update; not the evaluation), samples_per_s, then test_loss and
 * test_accuracy when it evaluates (the whole test split, in batches, no tape). */
int td_trainer_step(td_trainer *t);

void td_trainer_free(td_trainer *t);

#endif
