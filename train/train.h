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

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_MAX_LAYERS   16   /* sizes in an MLP, input and output included */
#define TD_PATH_MAX     1024 /* bytes of a path in a job, NUL included */
#define TD_MAX_PATTERNS 16   /* paths or globs per split */

typedef enum { TD_MODEL_MLP = 1, TD_MODEL_GPT = 2, TD_MODEL_SENSORLM = 3 } td_model_kind;
typedef enum {
    TD_DATA_IDX = 1,
    TD_DATA_TEXT = 2,
    TD_DATA_TOKENS = 3,
    TD_DATA_SENSOR = 4 /* sensor shards (train/sensor.h) */
} td_data_kind;
typedef enum { TD_OPTIM_ADAMW = 1, TD_OPTIM_SGD = 2 } td_optim_kind;
/* constant: lr. cosine: linear warmup over the first warmup*total steps, then cosine from lr
 * to min_lr at the last step. rsqrt: linear warmup over w = warmup*total steps, then
 * lr*sqrt(w/step), then a linear cooldown to zero over the last cooldown*total steps
 * (train/schedule.c has the exact formulas). */
typedef enum { TD_SCHED_CONSTANT = 1, TD_SCHED_COSINE = 2, TD_SCHED_RSQRT = 3 } td_sched_kind;
/* What a non-finite loss or gradient does: fail the job (TD_ENAN), or skip the update and
 * count it in the metric nan_skipped. */
typedef enum { TD_ON_NAN_FAIL = 0, TD_ON_NAN_SKIP = 1 } td_on_nan;
/* Faults a job can inject at one step (debug.fail), to test failure handling end to end. */
typedef enum {
    TD_FAIL_NONE = 0,
    TD_FAIL_PANIC,
    TD_FAIL_NAN,
    TD_FAIL_OOM,
    TD_FAIL_DATA,
    TD_FAIL_STICKY /* a sticky CUDA error (illegal address): TD_ECUDA, and the daemon treats
                    * the process's CUDA state as lost, as it would for a real one */
} td_fail_kind;
/* The precision of a job's matmuls on a GPU. fp32: fp32 throughout (TF32 only with tf32 on).
 * bf16: matmul operands rounded to bf16, products summed in fp32, everything else (activations
 * in memory, master weights, gradients, optimizer state) fp32: PyTorch autocast's split.
 * DEFAULT: bf16 for a gpt on cuda devices, fp32 otherwise (the daemon resolves it). The CPU
 * backend computes fp32 whatever this says. */
typedef enum { TD_PRECISION_DEFAULT = 0, TD_PRECISION_FP32, TD_PRECISION_BF16 } td_precision;

/* sensorlm's presets (model.size): both towers' width, depth, heads and MLP width, and the
 * embedding: tiny 64/2/4/256, E 64; small 256/6/4/1024, E 256; base 768/12/12/3072, E 768
 * (ViT-B for both towers). */
typedef enum { TD_SLM_TINY = 0, TD_SLM_SMALL = 1, TD_SLM_BASE = 2 } td_slm_size;
/* How the sensor tower pools its tokens: a multi-head attention-pooling head (SigLIP's MAP)
 * or the mean of the tokens (global average pooling). */
typedef enum { TD_SLM_POOL_MAP = 0, TD_SLM_POOL_GAP = 1 } td_slm_pool;

/* A sensorlm job's model keys (model.sensor.*, model.text.*, model.embed_dim, model.size); 0
 * in any dimension: the preset's (or the default's: patch_t 10, patch_c 2, text_len 64,
 * time_steps and channels the train shards'). README.md "SensorLM" is the model's reference;
 * train/engine.h td_slm_dims the resolved dimensions. */
typedef struct td_sensorlm_config {
    td_slm_size size;                     /* default tiny */
    int time_steps, channels;             /* the sensor grid (T, C) */
    int patch_t, patch_c;                 /* a patch: patch_t steps of patch_c channels */
    int s_width, s_depth, s_heads, s_mlp; /* sensor tower: d_model, depth, n_head, mlp_dim */
    td_slm_pool pool;                     /* default map */
    int text_len;                         /* L: tokens of a caption, the end token included */
    int t_width, t_depth, t_heads, t_mlp; /* text tower */
    int embed_dim;                        /* E: both towers' output */
} td_sensorlm_config;

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

    /* gpt: llm.c's GPT-2. vocab_size V is padded to Vp, a multiple of 64, for the lm head.
     * With init_from (an llm.c model file, or a safetensors file with Hugging Face GPT-2's
     * names; for a sensorlm a safetensors file of its own names) the dimensions come from the
     * file; any also given here (non-zero) must agree with it. */
    int n_layer, n_head, n_embd, seq_len, vocab_size;
    char init_from[TD_PATH_MAX]; /* "" = initialise from the seed */
    int attn_chunk;              /* gpt, sensorlm: query rows per block of the fused attention
                                  * (model.attn_chunk), >= 0; 0 (default): the largest whose block of
                                  * scores, rows x n_head x keys floats per sequence of the batch, fits in
                                  * 64 MiB (TD_ATTN_BLOCK_BYTES, td_attn_chunk in train/engine.h) */
    td_sensorlm_config slm;      /* sensorlm */

    /* text/tokens/sensor data: paths or globs; text files are read as bytes (vocabulary 256),
     * tokens files are llm.c shards, sensor files sensor shards (train/sensor.h).
     * valid_fraction holds out that fraction of the train data (sensor: of its windows) as
     * the valid split when valid_files is empty (0: no valid split). */
    char train_files[TD_MAX_PATTERNS][TD_PATH_MAX];
    int n_train_files;
    char valid_files[TD_MAX_PATTERNS][TD_PATH_MAX];
    int n_valid_files;
    float valid_fraction;    /* in [0, 1); 0: none unless valid_files */
    float caption_cut;       /* sensor: the chance a training caption is cut at a clause boundary
                              * (data.caption_cut, in [0, 1]; 0: never) */
    int mask_same_label;     /* sensorlm: loss.mask_same_label, default 0: SigLIP's negative pairs
                              * of two windows of one known label are left out of the loss (README.md,
                              * "The loss"); needs labels in the train shards */
    float same_label_weight; /* sensorlm: loss.same_label_weight, in [0, 1): with
                              * mask_same_label, the weight of those pairs (0: left out) */

    float grad_clip; /* global L2 norm the gradient is clipped to; 0: off */

    /* schedule: warmup and cooldown are fractions of the total steps */
    float warmup, cooldown;
    float min_lr; /* cosine's floor */

    int eval_batches; /* batches of the valid split per evaluation; 0: the whole split */

    /* checkpoints: the job's full state every checkpoint_every steps (0: only when asked),
     * the last keep_checkpoints kept. A trainer built with a checkpoint_dir that holds a
     * checkpoint resumes from the latest one. */
    char checkpoint_dir[TD_PATH_MAX]; /* "" = none */
    int64_t checkpoint_every;
    int keep_checkpoints; /* default 3 */

    /* data parallel: this replica computes rows [rank*B/world, (rank+1)*B/world) of each
     * global batch of batch_size rows; gradients and loss are averaged through
     * td_train_hooks.allreduce. world 1 by default. */
    int rank, world;

    td_on_nan on_nan; /* default fail */

    /* where the trainer computes: a backend table (kernels.h); NULL: td_kernels_cpu(). A
     * device backend (cuda) computes on the calling thread's context, which the caller binds
     * before td_trainer_new() and keeps bound for every call on the trainer (the daemon's
     * worker thread does). Not a job-file key, not part of the config hash. */
    const struct td_kernels *kernels;
    td_precision precision; /* job file "precision"; for the record and mfu's peak: the
                             * backend's context computes as the caller set it */
    int tf32;               /* job file "tf32": fp32 matmuls on a GPU may use TF32; default 0 */
    double peak_flops;      /* the device's peak FLOP/s at the precision used; > 0: record mfu
                             * every step (the daemon sets it for cuda devices) */

    /* fault injection: at step debug_fail_step (>= 1) this replica fails as debug_fail_kind
     * says (the daemon sets it only on the devices the job names) */
    int64_t debug_fail_step;
    td_fail_kind debug_fail_kind;
} td_train_config;

/* Fills cfg with the defaults above (model, data and paths left empty). */
void td_train_config_defaults(td_train_config *cfg);

/* How a trainer reports. Called on the thread that calls td_trainer_step(). */
typedef struct td_train_hooks {
    void *ud;
    /* One sample. May block (the daemon's metric queue applies back-pressure). Keys a job
     * records: train_loss, lr, grad_norm, step_ms and tokens_per_s (gpt) or samples_per_s
     * (mlp, sensorlm) every step; nan_skipped when a step was skipped (the count so far);
     * epoch at the first step of each epoch (mlp); valid_loss (and valid_accuracy, mlp;
     * recall_at_1, recall_at_5, text_recall_at_1 and, with labels, zeroshot_accuracy,
     * sensorlm) at each evaluation of the valid split; test_loss and test_accuracy at each
     * evaluation of an mlp's test
     * split; mfu every step when cfg.peak_flops > 0 (td_train_flops_per_step over the step's
     * time and the peak of all the job's devices). Only rank 0 of a data-parallel job
     * records. */
    void (*metric)(void *ud, const char *key, int64_t step, double value);
    /* Data-parallel: averages buf (n floats) in place across the job's replicas; called by
     * every replica at the same point of each step with the same n. NULL when world == 1.
     * It may td_panic (a peer failed). A sensorlm step calls it three times: the text
     * embeddings' gather in the forward, their gradient's in the backward, then the
     * gradients. */
    void (*allreduce)(void *ud, float *buf, size_t n);
    /* Rank 0, before each checkpoint is written (the periodic ones and td_trainer_checkpoint):
     * takes every sample metric has been given so far to where a crash cannot lose it (the
     * store, the rank stream), so that a job resumed from the checkpoint has the rows of every
     * step before it. May block. NULL: metric's samples are already there when it returns. */
    void (*flush)(void *ud);
} td_train_hooks;

typedef struct td_trainer td_trainer;

/* FLOPs of one training step of cfg's model over a global batch, llm.c's count (forward and
 * backward, 6 per parameter per token, plus attention's 6*L*C*T per token; an mlp 6 per
 * parameter per sample), so mfu here and llm.c's mean the same. 0 for a bad config. */
double td_train_flops_per_step(const td_train_config *cfg);

/* Builds a trainer: reads the dataset, checks it against the model (mlp: layers[0] must equal
 * the image size, the last layer must cover every label; gpt: text needs vocab_size >= 256),
 * initialises parameters from the seed or from init_from (an llm.c model file or a safetensors
 * file, README "Safetensors"), then, when
 * checkpoint_dir holds a checkpoint, resumes from the newest intact one.
 * Errors are returned, never panicked: TD_EDATA naming the file and what was wrong (a bad
 * llm.c file says whether its magic, version or size is wrong), TD_ESHAPE for a model that
 * does not fit its data (naming the layer) or a job dimension that disagrees with init_from's
 * ("model.n_embd: 256 in the job but 768 in /x/model.bin"), TD_ESTATE for a checkpoint of
 * another configuration, TD_ENOMEM, and TD_EINVAL for a config that job validation should
 * have refused (world > 1 without hooks->allreduce among them). Copies cfg and hooks (hooks
 * may be NULL: no metrics).
 * Caller frees with td_trainer_free(). */
int td_trainer_new(td_trainer **out, const td_train_config *cfg, const td_train_hooks *hooks,
                   td_error_t *err);

/* Steps the job will take in all. */
int64_t td_trainer_total_steps(const td_trainer *t);

/* Steps taken so far (the number of the last completed step; steps count from 1). */
int64_t td_trainer_steps_done(const td_trainer *t);

/* Host syncs of the last step's training part (evaluation and checkpoints not counted): the
 * trainer's downloads and waiting uploads, each of which blocks the host until the backend has
 * run every op queued before it. One for a single-process AdamW step (the loss and norm in one
 * read-back); SGD, data parallel and a debug.fail NaN step read the loss, then the norm. */
int64_t td_trainer_host_syncs(const td_trainer *t);

/* Takes one optimizer step, then evaluates and writes a checkpoint when due. Returns 0 when
 * steps remain and 1 when the job has taken its last step (and 1, doing nothing, when called
 * after that). With max_steps 0 the first call only evaluates (metrics at step 0) and returns
 * 1. Must run under a panic boundary. Panics: a non-finite loss with on_nan fail, TD_ENAN
 * ("loss is NaN at step 41", "loss is Inf at step 41", "gradient is NaN at step 41") before
 * any update, so the step does not count (with on_nan skip the step counts, without an
 * update); an exhausted activation arena, TD_ENOMEM; a token outside the vocabulary,
 * TD_EDATA; a failed checkpoint write, its code; debug.fail's injected faults (train/README);
 * and whatever hooks.allreduce panics with.
 * Metrics of step S, in order: epoch (mlp, first step of an epoch), train_loss and grad_norm
 * (or nan_skipped), lr, step_ms (batch, forward, backward, all-reduce and update; not the
 * evaluation), tokens_per_s or samples_per_s, then valid_loss (+ valid_accuracy) and the
 * mlp's test_loss, test_accuracy when it evaluates (no tape). */
int td_trainer_step(td_trainer *t);

/* After td_trainer_step_caught() returned -1: the step whose due checkpoint could not be
 * written (the step itself completed, steps_done counts it: td_trainer_checkpoint may write it
 * again), or 0 when the panic was another's. */
int64_t td_trainer_checkpoint_failed(const td_trainer *t);

/* td_trainer_step() inside a panic boundary of its own, as a device worker runs it: returns
 * what the step returned, or -1 after a panic with its code and message in *err. A function
 * of its own so that no caller's local lives across the setjmp. */
int td_trainer_step_caught(td_trainer *t, td_error_t *err);

/* Writes a checkpoint of the trainer's state now, into cfg.checkpoint_dir (rank 0 only;
 * other ranks and jobs without a checkpoint_dir return 0 doing nothing). For cancel and
 * shutdown; the step loop writes its own every checkpoint_every steps. Returns 0 or an error
 * (TD_EIO, TD_EDISKFULL) with err saying which file. Never panics. */
int td_trainer_checkpoint(td_trainer *t, td_error_t *err);

void td_trainer_free(td_trainer *t);

/* Writes the latest checkpoint of a gpt job (cfg.checkpoint_dir) as an llm.c model file
 * (fp32, version 3) to out_path. TD_ENOTFOUND when there is no checkpoint; TD_EINVAL for a
 * job that is not gpt; TD_EIO naming the file. */
int td_export_llmc(const td_train_config *cfg, const char *out_path, td_error_t *err);

/* Writes the latest checkpoint of the gpt or sensorlm job cfg (cfg->checkpoint_dir) to out_path
 * as safetensors (the names and metadata of train/weights.h), through out_path.tmp renamed
 * when whole. TD_ENOTFOUND without a checkpoint; TD_EINVAL for an mlp job; TD_ESTATE for a
 * checkpoint of another configuration; TD_EIO / TD_EDISKFULL naming the file. */
int td_export_safetensors(const td_train_config *cfg, const char *out_path, td_error_t *err);

/* Generates ntokens tokens after prompt (bytes, for a text job) from the latest checkpoint of
 * a gpt job, sampling at temperature (0: greedy) from seed, and writes them, NUL-terminated,
 * into out (outsize bytes; longer text is cut). Token jobs write token ids separated by
 * spaces. Errors as td_export_llmc; TD_EINVAL for a bad argument; TD_ECANCELLED once *stop
 * (read before each token; NULL: never) is set, "sampling: stopped after 12 of 4096 tokens"
 * (out holds those 12). Runs its own forwards: call it on any thread, never under another
 * trainer's step. */
int td_sample(const td_train_config *cfg, const char *prompt, int ntokens, float temperature,
              uint64_t seed, const atomic_int *stop, char *out, size_t outsize, td_error_t *err);

/* ---- memory estimate (memest.c) ---------------------------------------------------------- */

/* What one replica of a job holds on its device, in bytes, by what it is for. The parameter
 * buffers and the activation arena are sized by the same functions the trainer sizes its own
 * with (td_params, td_gpt_arena_bytes, td_mlp_arena_bytes), so on the CPU they are what the
 * trainer allocates; the evaluation batch is taken at its largest (an mlp's: 1000 samples,
 * a gpt's: the whole batch_size) since the dataset is not read. */
typedef struct td_mem_estimate {
    int batch;          /* rows this replica computes per step: batch_size split over world */
    size_t n_floats;    /* floats in each flat buffer, padding included (td_params.n) */
    size_t params;      /* the parameter buffer */
    size_t grads;       /* the gradient buffer (with the all-reduce's loss slot) */
    size_t optim;       /* the optimizer's moments: AdamW two buffers, SGD with momentum one */
    size_t activations; /* the activation arena: the larger of a training step (batch rows,
                         * with gradients and attention's backward scratch) and an evaluation */
    size_t attention;   /* of activations: a training step's attention scores, L times the
                         * (batch, n_head, T, T) matrix kept for the backward (gpt; mlp 0) */
    size_t workspace;   /* on a device backend (cfg.kernels not host memory), the CUDA
                         * backend's context: cuBLAS workspace, scratch, fixed buffers; 0 on
                         * the CPU */
    size_t total;       /* params + grads + optim + activations + workspace */
    size_t data;        /* not in total: the dataset this replica holds in host memory
                         * (td_train_data_bytes), which on a host backend shares the memory
                         * total is held against (the memory guard adds it there) */
} td_mem_estimate;

/* Estimates cfg's memory on one device into *out (no file is read but init_from's header and,
 * for out->data, the datasets' headers and sizes: td_train_data_bytes). Errors
 * as td_trainer_new's for a bad model (TD_EINVAL, TD_ESHAPE, TD_EDATA), TD_E2BIG when the
 * numbers do not fit in a size_t. */
int td_train_memory_estimate(const td_train_config *cfg, td_mem_estimate *out, td_error_t *err);

/* The bytes of dataset one replica of cfg holds in host memory, from the files' headers and
 * sizes (read as data.h's access says), without loading them: an mlp's IDX pixels and labels
 * as their headers declare them (the reader holds a file to its header) and its sample order;
 * text as 2-byte tokens (every regular file the patterns match, an upper bound: binary and
 * duplicate files are skipped at load) and the shuffle's row order; token shards are mapped,
 * not copied, so only their shuffle order counts. 0 for a config without files. Errors: the
 * files' (TD_EDATA, TD_EPERM naming the file), TD_E2BIG past TD_DATA_MAX_TEXT_BYTES of text. */
int td_train_data_bytes(const td_train_config *cfg, size_t *bytes, td_error_t *err);

/* Checks cfg's files against its model as td_trainer_new would, without loading them, for a
 * refusal at submit rather than at start: every file opened as data.h's access says and
 * regular; IDX headers (magic, counts, a plain file's size; a labels file's every label, for
 * its largest), the images' size against layers[0], the labels' range against the last
 * layer and their count against the images'; init_from's header (magic, version, size) and
 * the job's dimensions against it; each token shard's header (magic, version, size); text
 * data's vocabulary; and the dataset's bytes in memory (td_train_data_bytes) against
 * TD_DATA_MAX_BYTES. Messages name the job file's field, then the file and what was wrong:
 * "model.layers[3]: 5 outputs, but /x/labels.gz has labels up to 9 (10 classes)",
 * "data.train.images: /x/labels.gz: magic 0x00000801 is an IDX labels file, expected images
 * (0x00000803)". The files' codes (TD_EDATA, TD_EPERM, TD_ENOTFOUND, TD_EIO), TD_ESHAPE for a
 * model that does not fit its data, TD_E2BIG past the limit. */
int td_train_check_files(const td_train_config *cfg, td_error_t *err);

/* The largest global batch_size (at least cfg->world, at most TD_MEM_MAX_BATCH) whose estimate
 * fits in bytes, every other field of cfg as it is, into *batch. TD_ENOMEM when even a batch of
 * world rows does not fit, with err giving both numbers ("a batch of 1 needs 6012 MiB, 4096 MiB
 * available"); the estimate's errors. */
#define TD_MEM_MAX_BATCH (1 << 24) /* rows */
int td_train_largest_batch(const td_train_config *cfg, size_t bytes, int *batch, td_error_t *err);

/* ---- sensorlm embeddings (slm_eval.c) ---------------------------------------------------- */

/* A sensorlm model that embeds sensor windows and texts into its shared space: E floats a row,
 * unit length, so a dot product is a cosine similarity (what classification, retrieval and the
 * job's own evaluation rank by). Built from a job's latest checkpoint or from a trainer's
 * current parameters, it owns copies of them and its own buffers, computes on cfg->kernels
 * (NULL: the CPU; a device backend on the calling thread's context, as a trainer does) and is
 * used by one thread at a time. Nothing here panics: errors are returned. */
typedef struct td_sensorlm_embedder td_sensorlm_embedder;

/* What an embedder takes and gives. */
typedef struct td_sensorlm_info {
    int time_steps, channels; /* a window: a (T, C) grid of raw readings, time-major */
    int embed_dim;            /* E: floats of an embedding */
    int text_len;             /* L: a text's tokens; its first L-1 bytes are read */
    int64_t step;             /* the checkpoint's step (or the trainer's steps done) */
    const float *mean, *std;  /* (C) each: the statistics windows are normalised with (the first
                               * train shard's at the job's start); borrowed */
} td_sensorlm_info;

/* The latest checkpoint of the sensorlm job cfg (cfg->checkpoint_dir, the job's config as it
 * was submitted; its files are read for T and C only when the job gave no time_steps and
 * channels): its parameters and its statistics. rows: windows or texts per forward (0: 64),
 * which sizes the embedder's memory. Errors: TD_ENOTFOUND (no checkpoint yet), TD_ESTATE (a
 * checkpoint of another configuration), TD_EINVAL (not a sensorlm job), the files' errors.
 * Caller frees with td_sensorlm_embedder_free(). */
int td_sensorlm_embedder_open(td_sensorlm_embedder **out, const td_train_config *cfg, int rows,
                              td_error_t *err);

/* The same from trainer t's parameters as they are now (t goes on unchanged; on a device
 * backend they are copied down first, so call it between steps, on t's thread). TD_EINVAL
 * when t is not a sensorlm trainer. */
int td_sensorlm_embedder_from_trainer(td_sensorlm_embedder **out, td_trainer *t, int rows,
                                      td_error_t *err);

void td_sensorlm_embedder_free(td_sensorlm_embedder *e); /* accepts NULL */

void td_sensorlm_embedder_info(const td_sensorlm_embedder *e, td_sensorlm_info *info);

/* n windows of raw readings, grids (n, T, C) time-major (NaN: missing), each normalised,
 * patched and put through the sensor tower as in training -> out (n, E). */
int td_sensorlm_embed_windows(td_sensorlm_embedder *e, const float *grids, int n, float *out,
                              td_error_t *err);

/* n texts (NUL-terminated; read as captions are, cut to fit the text length at a clause
 * boundary) through the text tower -> out (n, E). */
int td_sensorlm_embed_texts(td_sensorlm_embedder *e, const char *const *texts, int n, float *out,
                            td_error_t *err);

/* n labels' embeddings -> out (n, E), as zero-shot classification compares windows with them:
 * prompts[k] is label k's prompts separated by '|' ("running day|running day: a run"; empty
 * parts skipped, at most 16 used), each embedded as a text; label k's embedding is the mean of
 * its prompts', normalised (by max(||x||, 1e-12)). One prompt gives that prompt's embedding. */
int td_sensorlm_embed_labels(td_sensorlm_embedder *e, const char *const *prompts, int n, float *out,
                             td_error_t *err);

#endif
