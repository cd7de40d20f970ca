/* A sensorlm job's data and evaluation, internal to train/ (the trainer, the embedder, the
 * memory estimate and tests use it):
 *
 *   - slm_data.c: the job's sensor shards (every file opened as data.h's access says: with the
 *     job's user's rights), the train and valid splits, the epoch's order, and batches built in
 *     host memory: each window normalised with the first train shard's statistics, cut into
 *     patches, its caption tokenised. The same cutting and tokenising for the embedder.
 *   - slm_eval.c: the evaluation (valid_loss, recall_at_1, recall_at_5, text_recall_at_1,
 *     zeroshot_accuracy) and the embedder of train.h.
 *
 * Splits. train is the windows of data.train's files in order (each pattern's files sorted
 * byte-wise, the patterns in the order given); valid is data.valid's, or, with valid_fraction,
 * the last floor(N * valid_fraction) windows of train's N (train keeps the rest). An epoch is
 * floor(train / B) batches of B windows (B the global batch): with shuffle, epoch e's order is
 * a Fisher-Yates permutation drawn from (seed, e) alone, so a cursor (epoch, batch) is the whole
 * position; the train % B windows left over are that epoch's unused ones. Valid windows are
 * never shuffled; an evaluation reads the first td__slm_eval_windows() of them.
 *
 * Threads: a td_slm_data is used by one thread at a time (it owns one window's buffers).
 * Errors are returned, never panicked. */
#ifndef TD_SLM_H
#define TD_SLM_H

#include <stddef.h>
#include <stdint.h>

#include "train/data.h"
#include "train/engine.h"
#include "common/td_errno.h"
#include "train/train.h"

#define TD_SLM_MAX_FILES   1024  /* sensor shards of one job, both splits */
#define TD_SLM_EVAL_MAX    16384 /* valid windows one evaluation ranks, at most */
#define TD_SLM_EMBED_ROWS  64    /* windows or texts per forward of an embedder by default */
#define TD_SLM_MAX_PROMPTS 16    /* prompts of one label ("a|b|c"), at most: the rest are ignored */

/* The refusal of loss.mask_same_label on train shards without labels (at submit and by the
 * trainer alike). */
#define TD_SLM_NO_TRAIN_LABELS "loss.mask_same_label: data.train's shards carry no labels"

/* What a sensorlm job's files hold, from their headers (td__slm_peek): what the model's
 * dimensions and the memory estimate need without opening the data for training. */
typedef struct td_slm_peek {
    int T, C;          /* the first train file's: every file must agree */
    int64_t n_train;   /* train windows, after the valid fraction */
    int64_t n_valid;   /* valid windows (0: no valid split) */
    int labels;        /* K of the valid split's files when every one has labels, else 0 */
    int train_labeled; /* data.train's files that carry labels (loss.mask_same_label needs one) */
    uint64_t host;     /* bytes the open data holds in host memory: the order, the labels, the
                        * label tables */
    int files;         /* files read */
} td_slm_peek;

/* Reads the headers of cfg's sensor files as the thread's access says (td_sensor_check_fd on
 * td_data_open_file's descriptors): each checked against want (T, C when not 0), every file
 * against the first (td_sensor_compatible). A config without train files peeks nothing (all
 * zero). Errors name the job's field and the file ("data.train[0]: /x.bin: header field
 * channels: 8, but the model expects 10"). */
int td__slm_peek(const td_train_config *cfg, int T, int C, td_slm_peek *out, td_error_t *err);

/* The valid windows one evaluation of cfg reads: the valid split's, at most eval_batches *
 * batch_size (eval_batches > 0) and at most TD_SLM_EVAL_MAX. */
int64_t td__slm_eval_windows(const td_train_config *cfg, int64_t n_valid);

/* Arena bytes of one evaluation of m over nv windows in batches of B with K label prompts
 * (sizes.c's home for it): the kept embeddings (2 nv + K rows of E) and, above them, the larger
 * of a batch's inputs, towers and loss, and a block of B x max(nv, K) similarities. */
size_t td__slm_eval_bytes(const td_sensorlm *m, int B, int64_t nv, int K);

/* Arena bytes of a batch's inputs of B rows: patches (B,N,P) floats, tokens (B,L) and end
 * positions (B) ints. */
size_t td__slm_input_bytes(const td_slm_dims *d, int B);

/* ---- the data ------------------------------------------------------------------------------ */

typedef struct td_slm_data td_slm_data;

/* Opens cfg's sensor files for a model of dimensions d (T, C checked against every file), the
 * splits, the order and the label prompts. TD_EDATA when the train split has fewer windows
 * than a batch ("train split: 50 windows, a batch needs 64"); TD_EINVAL for
 * loss.mask_same_label when no train file carries labels; the files' errors as td__slm_peek. Caller
 * frees with td__slm_data_free. */
int td__slm_data_open(td_slm_data **out, const td_train_config *cfg, const td_slm_dims *d,
                      td_error_t *err);
void td__slm_data_free(td_slm_data *s); /* accepts NULL */

int64_t td__slm_train_windows(const td_slm_data *s);
int64_t td__slm_valid_windows(const td_slm_data *s);
int64_t td__slm_batches(const td_slm_data *s); /* per epoch */

/* The channels' mean and std the windows are normalised with (2*C floats: C means, C stds),
 * writable so that a resumed job takes its checkpoint's. */
float *td__slm_norm(td_slm_data *s);

/* The position of the next batch, and moving it (as data.h's td_data_tell/seek/advance). */
td_data_cursor td__slm_tell(const td_slm_data *s);
int td__slm_seek(td_slm_data *s, td_data_cursor c, td_error_t *err);
void td__slm_advance(td_slm_data *s);

/* Rows [r0, r1) of the global train batch at the cursor, into host memory: x (r1-r0, N, P)
 * patches, tok (r1-r0, L) tokens, end (r1-r0) end positions. TD_EDATA naming the file and the
 * window for a read that fails (a file that changed since it was opened). */
int td__slm_fill(td_slm_data *s, int r0, int r1, float *x, int *tok, int *end, td_error_t *err);

/* The labels of all B rows of the global train batch at the cursor into labels (B): each
 * window's label, -1 for a window of a file without labels (loss.mask_same_label's; every
 * replica takes them all, since its rows meet every column). From the labels the open files
 * hold in memory: nothing is read. */
void td__slm_fill_labels(const td_slm_data *s, int *labels);

/* Valid windows [i, i+n) likewise, and their labels (when labels is not NULL and the split has
 * them). */
int td__slm_valid_fill(td_slm_data *s, int64_t i, int n, float *x, int *tok, int *end, int *labels,
                       td_error_t *err);

/* The valid split's labels: K (0 when the split has none); their NP prompts (each label's
 * table entry split at '|', empty parts skipped, the label's name when none is left; at most
 * TD_SLM_MAX_PROMPTS a label), in label order, tokenised: tok (NP, L), end (NP), and of (NP),
 * the label each one is of. */
int td__slm_labels(const td_slm_data *s);
int td__slm_prompt_count(const td_slm_data *s);
void td__slm_prompts(const td_slm_data *s, int *tok, int *end, int *of);

/* The parts of a label's prompts ("running day|running day: a run"): the offset and length of
 * each non-empty part between '|', at most max of them. Returns their number (0: none). */
int td__slm_prompt_parts(const char *prompts, int *off, int *len, int max);

/* ---- a window and a text as the model takes them ------------------------------------------- */

/* The bytes of text (len of them) a model that reads max bytes keeps: all when len <= max, else
 * up to the last clause boundary that fits (a "; " or ". " at byte i <= max, after at least one
 * byte: the i bytes before it), else up to the last space at byte i <= max (i bytes, i > 0),
 * else max bytes (a word longer than max). README.md's "Text tower". */
size_t td__slm_fit(const char *text, size_t len, size_t max);

/* A training caption's augmentation (data.caption_cut, README.md's "Captions cut short"): with
 * the chance p, text (len bytes, already fitted) is cut at one of its clause boundaries drawn
 * uniformly, keeping the bytes before it; the draws are from (seed, epoch, pos) alone, pos the
 * window's position in the epoch's order. Returns the bytes kept (len when not cut). */
size_t td__slm_cut(const char *text, size_t len, uint64_t seed, int64_t epoch, int64_t pos,
                   float p);

/* A caption's bytes as tokens: its first td__slm_fit(text, len, L-1) bytes, the end token at
 * their end (*end), pad tokens to L. tok is (L). */
void td__slm_tokenize(const char *text, size_t len, int L, int *tok, int *end);

/* A raw window grid (T, C) (NaN for a missing reading) as patches x (N, P): (x - mean) / std by
 * channel, NaN -> 0, channels C..Cp-1 zero, patch n = ti*(Cp/pc) + ci holding
 * [dt*pc + dc] = x'[ti*pt + dt][ci*pc + dc]. norm is (2*C): means, then stds. */
void td__slm_patchify(const float *grid, const float *norm, const td_slm_dims *d, float *x);

/* ---- evaluation (slm_eval.c) --------------------------------------------------------------- */

/* Everything one evaluation uses, the trainer's: the model, its data, the arena (reset and used
 * from the bottom), the backend and, on a device backend, a host stage for the inputs; host
 * buffers: sims (B * max(nv, K) floats), labels (nv ints), the prompts. */
typedef struct td_slm_eval {
    td_sensorlm *m;
    td_slm_data *data;
    td_arena *arena;
    const td_kernels *k;
    char *stage; /* NULL: build inputs in the arena (host backend) */
    float *sims;
    int *labels;
    int *ptok, *pend; /* the label prompts' tokens (NP, L) and end positions (NP), host memory */
    int *pof;         /* (NP): the label each prompt is of */
    float *pemb;      /* host (K + B, E): the labels' embeddings, and one batch of prompts' */
    int B;            /* windows per forward: the job's batch_size */
    int64_t nv;       /* windows ranked */
    int K;            /* labels (0: no zero-shot) */
    int NP;           /* their prompts */
} td_slm_eval;

/* The results of one evaluation. */
typedef struct td_slm_metrics {
    double valid_loss;
    double recall_at_1, recall_at_5, text_recall_at_1;
    double zeroshot_accuracy; /* NaN without labels */
} td_slm_metrics;

/* Evaluates on the first ev->nv valid windows: valid_loss, SigLIP's loss of each batch of B
 * windows (the last may be shorter) weighted by its windows; sensor -> text recall at 1 and 5
 * and text -> sensor recall at 1 over all nv windows, by dot products of the unit embeddings
 * (window i's caption is at rank r when r others score at least as high: ties count against);
 * zero-shot accuracy, each window's class the label it scores highest with (the first of
 * equals), against its label, a label's embedding being the normalised mean of its prompts'. Runs
 * forwards without a tape; panics as ops do (a read error is TD_EDATA). */
void td__slm_evaluate(td_slm_eval *ev, td_slm_metrics *out);

/* An embedder (train.h) of cfg's model with dimensions d from host parameters (n floats, the
 * model's td_params layout: copied), the statistics norm (2*C: copied) and the step they are
 * of; rows per forward (0: TD_SLM_EMBED_ROWS). For td_sensorlm_embedder_open and the trainer's
 * td_sensorlm_embedder_from_trainer. TD_ESHAPE when n is not the model's. */
int td__slm_embedder_new(td_sensorlm_embedder **out, const td_train_config *cfg,
                         const td_slm_dims *d, const float *params, size_t n, const float *norm,
                         int64_t step, int rows, td_error_t *err);

#endif
