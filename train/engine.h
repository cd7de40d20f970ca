/* The engine's machinery, internal to train/ (the daemon sees only train.h; tests and benches
 * may include this): tensors; the flat parameter, gradient and moment buffers (td_params);
 * the per-step activation arena; the tape on which ops record their backward; the ops; the
 * MLP; the optimizers and LR schedule; the IDX reader; the PRNG. A model writes only its
 * forward from the ops below, and td_backward() replays the tape.
 *
 * Memory: td_params and the arena and tape are acquired once, when a trainer is built; in
 * the step loop the ops take everything from the arena, which td_arena_reset() empties. An
 * op that finds the arena or the tape full panics (TD_ENOMEM), so ops must run under a panic
 * boundary (common/td_panic.h), as td_trainer_step() does.
 *
 * Threads: all of it is used by one thread at a time, the one that owns the trainer. */
#ifndef TD_ENGINE_H
#define TD_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "td_errno.h"
#include "train.h"

/* ---- tensors ---------------------------------------------------------------------------- */

#define TD_TENSOR_MAX_DIMS 4

/* A view of floats that something else owns: td_params for parameters, the arena for
 * activations. The last dimension is the fastest-moving one (row-major). */
typedef struct td_tensor {
    float *data;
    float *grad; /* same shape as data; NULL when no gradient flows into this tensor */
    size_t n;    /* elements: the product of shape */
    int ndim;
    int shape[TD_TENSOR_MAX_DIMS];
} td_tensor;

/* ---- the activation arena ------------------------------------------------------------- */

#define TD_ARENA_ALIGN 64 /* bytes: a cache line, enough for any SIMD load */

/* A bump allocator: td_arena_alloc() hands out aligned slices, td_arena_reset() takes them
 * all back at once. peak remembers the most ever in use, so tests can hold the trainer's
 * size estimate to what a step really takes. The slices are where the backend computes (host
 * memory, or a device's for td_arena_init_on with a device backend); the tensor headers that
 * point into them are host memory, from a pool of TD_ARENA_TENSORS kept beside the slices, so
 * the engine reads shapes and pointers without touching the device. */
#define TD_ARENA_TENSORS 2048 /* headers: a forward of the largest gpt (64 layers) makes ~1050 */

typedef struct td_arena {
    char *base;
    size_t cap;          /* bytes */
    size_t used;         /* bytes */
    size_t peak;         /* bytes */
    const td_kernels *k; /* base came from k->alloc; NULL: from aligned_alloc */
    td_tensor *tensors;  /* TD_ARENA_TENSORS headers, host memory */
    int n_tensors;       /* in use */
} td_arena;

/* Acquires cap bytes of host memory. 0 or TD_ENOMEM. Release with td_arena_free(). */
int td_arena_init(td_arena *a, size_t cap);
/* Acquires cap bytes where k computes (k->alloc). 0, or k's error with err saying why. */
int td_arena_init_on(td_arena *a, size_t cap, const td_kernels *k, td_error_t *err);
void td_arena_free(td_arena *a); /* accepts a zeroed or freed arena */
void td_arena_reset(td_arena *a);

/* bytes rounded up to TD_ARENA_ALIGN: what td_arena_alloc(bytes) takes from the arena. */
size_t td_arena_round(size_t bytes);

/* An aligned slice of bytes, not cleared. Panics with TD_ENOMEM when the arena is full. */
void *td_arena_alloc(td_arena *a, size_t bytes);

/* ---- the flat parameter buffers ------------------------------------------------------ */

#define TD_PARAMS_MAX   64 /* parameter tensors in one model */
#define TD_PARAMS_ALIGN 16 /* floats: every tensor starts on a 64-byte line */

/* One model replica's parameters, gradients and optimizer moments, each ONE buffer with the
 * same layout, so a checkpoint is one write and an all-reduce one call. A model declares its
 * tensors (td_params_declare), then td_params_alloc() acquires the buffers and points every
 * declared tensor's data and grad into them. Padding between tensors stays zero. */
typedef struct td_params {
    /* where the backend computes: host memory, or after td_params_place() on a device backend
     * the device's */
    float *data; /* parameters, n floats */
    float *grad; /* gradients, n floats, then TD_PARAMS_ALIGN floats of slack: grad[n] carries
                  * the loss through a data-parallel all-reduce of n + 1 floats */
    float *m;    /* first moment (AdamW) or momentum buffer (SGD); NULL if unused */
    float *v;    /* second moment (AdamW); NULL if unused */
    /* host memory: data, m and v themselves on a host backend; after td_params_place() on a
     * device backend, host copies, current after td_params_to_host() (checkpoints) */
    float *host_data, *host_m, *host_v;
    const td_kernels *k; /* the device backend data, grad, m, v came from; NULL: host */
    size_t n;            /* floats in each buffer, padding included */
    int count;
    td_tensor *tensors[TD_PARAMS_MAX];
    size_t offset[TD_PARAMS_MAX];       /* floats from the start of each buffer */
    unsigned char decay[TD_PARAMS_MAX]; /* AdamW decays this tensor: declared 1 for 2-D and
                                         * larger, 0 for vectors; a model may change it */
} td_params;

/* Adds t (shape given, data not yet) to the layout. TD_E2BIG past TD_PARAMS_MAX tensors. */
int td_params_declare(td_params *p, td_tensor *t, int ndim, const int *shape);

/* Acquires the buffers, zeroed, with n_moments (0, 1: m, 2: m and v) moment buffers, and
 * points the declared tensors into them. 0 or TD_ENOMEM. Release with td_params_free(). */
int td_params_alloc(td_params *p, int n_moments);
void td_params_free(td_params *p); /* accepts a zeroed or freed td_params */

/* Moves the buffers to where k computes, once initialised or loaded on the host: nothing for a
 * host backend; for a device backend, acquires data, grad, m and v there (k->alloc), uploads
 * the parameters and moments, zeroes the gradient, keeps the host parameters and moments as
 * host_data, host_m, host_v and points every declared tensor into the device buffers (a gpt's
 * layer views need td_gpt_bind() again). 0, or k's error with err saying why; the buffers
 * are the host's as before then. The copies panic on a device error: call it under a
 * boundary; p then owns the device buffers, and td_params_free releases them. */
int td_params_place(td_params *p, const td_kernels *k, td_error_t *err);

/* Copies the device's parameters and moments into host_data, host_m, host_v (nothing on a
 * host backend). Panics on a device error: call it under a boundary. */
void td_params_to_host(td_params *p);

/* ---- the tape --------------------------------------------------------------------------- */

typedef enum {
    TD_OP_LINEAR = 1,   /* out = in[0] . in[1]^T + in[2] */
    TD_OP_RELU,         /* out = max(in[0], 0) */
    TD_OP_SOFTMAX_XENT, /* out = mean cross-entropy of softmax(in[0][:, :arg[0]]); saved = probs */
    TD_OP_EMBED,        /* out = in[0][ids] + in[1][t]; ids = tokens, arg = B, T */
    TD_OP_LAYERNORM,    /* out = layernorm(in[0]) * in[1] + in[2]; saved = mean, rstd */
    TD_OP_GELU,         /* out = GELU(in[0]) */
    TD_OP_RESIDUAL,     /* out = in[0] + in[1] */
    TD_OP_ATTENTION,    /* out = causal attention of qkv in[0], arg[0] heads; saved = att */
    TD_OP_COUNT
} td_op_id;

/* One op's backward closure: which op, and the tensors its backward reads and writes. */
typedef struct td_tape_entry {
    td_op_id op;
    td_tensor *out;
    td_tensor *in[3];
    td_tensor *saved[2]; /* what the forward kept for the backward, or NULL */
    const int *ids;      /* softmax_xent: the (N) class of each row; embed: the (B,T) tokens */
    int arg[2];          /* the op's dimensions its tensors do not carry */
} td_tape_entry;

/* The ops of one forward pass, in order. One per trainer (per worker), so no lock. */
typedef struct td_tape {
    td_tape_entry *entries;
    int len;
    int cap; /* entries */
} td_tape;

/* Acquires room for cap entries. 0 or TD_ENOMEM. Release with td_tape_free(). */
int td_tape_init(td_tape *t, int cap);
void td_tape_free(td_tape *t); /* accepts a zeroed or freed tape */
void td_tape_reset(td_tape *t);

/* ---- ops ---------------------------------------------------------------------------------- */

/* Where ops run: the backend, the arena their outputs come from, and the tape they record on.
 * With tape NULL (evaluation) nothing is recorded and no gradient buffers are allocated. */
typedef struct td_ctx {
    const td_kernels *k;
    td_arena *arena;
    td_tape *tape;
} td_ctx;

/* Arena bytes one td_tensor_new() of n elements takes, with or without its gradient. Models
 * add these up to size the arena before the first step (td_mlp_arena_bytes). */
size_t td_tensor_bytes(size_t n, int with_grad);

/* A tensor from the arena, data not cleared; with_grad: a zeroed gradient too. */
td_tensor *td_tensor_new(td_ctx *c, int ndim, const int *shape, int with_grad);

/* out = inp . w^T + b. inp is (..., C), w is (OC, C), b is (OC); out is (..., OC). */
td_tensor *td_linear(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b);

/* out = max(inp, 0), same shape. */
td_tensor *td_relu(td_ctx *c, td_tensor *inp);

/* Mean softmax cross-entropy of logits (..., V) against targets (one per row, in [0,V));
 * out is a one-element tensor. targets is borrowed until the tape is reset. */
td_tensor *td_softmax_xent(td_ctx *c, td_tensor *logits, const int *targets);

/* The same over the first V columns of logits (..., Vp): llm.c's padded vocabulary, whose
 * padding columns get probability 0 and no gradient. */
td_tensor *td_softmax_xent_padded(td_ctx *c, td_tensor *logits, const int *targets, int V);

/* Token + position embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].
 * tokens is (B,T) (borrowed until the tape is reset), wte is (V,C), wpe is (maxT,C), T <= maxT;
 * out is (B,T,C). */
td_tensor *td_embed(td_ctx *c, const int *tokens, int B, int T, td_tensor *wte, td_tensor *wpe);

/* LayerNorm over the last dimension: inp is (..., C), w and b are (C); out like inp. Keeps the
 * (rows) mean and rstd for its backward. */
td_tensor *td_layernorm(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b);

/* GELU (tanh form), same shape. */
td_tensor *td_gelu(td_ctx *c, td_tensor *inp);

/* out = a + b, same shape (the residual stream). */
td_tensor *td_residual(td_ctx *c, td_tensor *a, td_tensor *b);

/* Causal multi-head self-attention: qkv is (B,T,3C) (q, k, v side by side, heads of C/NH
 * inside each), out is (B,T,C). Keeps the (B,NH,T,T) attention for its backward, whose
 * (T,T) scratch is taken from the arena's top and given back. */
td_tensor *td_attention(td_ctx *c, td_tensor *qkv, int NH);

/* Arena bytes the ops above take, for models to size the arena exactly: each mirrors the op's
 * allocations one for one (train: the op records, so outputs carry gradients). */
size_t td_op_bytes_softmax_xent(size_t rows, int Vp, int train);
size_t td_op_bytes_layernorm(size_t rows, int C, int train);
size_t td_op_bytes_attention(int B, int T, int C, int NH, int train);
size_t td_op_bytes_attention_backward(int T); /* the scratch on top, during td_backward */

/* Seeds loss's gradient with 1 and replays the tape in reverse, each op accumulating into
 * its inputs' gradients (parameters' land in td_params.grad). Then empties the tape. */
void td_backward(td_ctx *c, td_tensor *loss);

/* ---- the MLP -------------------------------------------------------------------------- */

/* Linear layers with ReLU between them; the last Linear gives the logits. */
typedef struct td_mlp {
    int n_sizes;                /* >= 2 */
    int sizes[TD_MAX_LAYERS];   /* input features, hidden sizes, classes */
    td_tensor w[TD_MAX_LAYERS]; /* w[l] is (sizes[l+1], sizes[l]) */
    td_tensor b[TD_MAX_LAYERS]; /* b[l] is (sizes[l+1]) */
} td_mlp;

/* Declares the MLP's tensors in p (then call td_params_alloc). TD_EINVAL for bad sizes. */
int td_mlp_declare(td_mlp *m, td_params *p, const int *sizes, int n_sizes);

/* PyTorch's nn.Linear initialisation, deterministic from seed: every weight and bias of layer
 * l drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = sizes[l]. */
void td_mlp_init(td_mlp *m, uint64_t seed);

/* The forward pass: x is (N, sizes[0]); logits (when not NULL) receives the (N, classes)
 * logits; returns the mean cross-entropy against targets (N). */
td_tensor *td_mlp_forward(td_ctx *c, td_mlp *m, td_tensor *x, const int *targets,
                          td_tensor **logits);

/* Arena bytes one td_mlp_forward of a batch of N takes (train: with gradients), and tape
 * entries it records. */
size_t td_mlp_arena_bytes(const td_mlp *m, int N, int train);
int td_mlp_tape_len(const td_mlp *m);

/* ---- GPT-2 ------------------------------------------------------------------------------ */

#define TD_GPT_MAX_LAYERS 64 /* transformer blocks */
#define TD_GPT_TENSORS    16 /* parameter tensors, llm.c's */
#define TD_GPT_LAYER_T    12 /* of them, the ones stacked per layer (2 .. 13) */
#define TD_GPT_VP_ALIGN   64 /* the lm head's rows are padded to a multiple of this */

/* llm.c's GPT2Config. */
typedef struct td_gpt_dims {
    int maxT; /* positions in wpe: the longest sequence */
    int V;    /* vocabulary */
    int Vp;   /* V padded (llm.c: to a multiple of 128 in its files; ours to TD_GPT_VP_ALIGN) */
    int L;    /* blocks */
    int NH;   /* heads */
    int C;    /* channels */
} td_gpt_dims;

/* llm.c's parameter tensors, in llm.c's order; the layer ones hold all L layers stacked. */
enum {
    TD_GPT_WTE,      /* (Vp, C) token embedding, tied to the lm head */
    TD_GPT_WPE,      /* (maxT, C) */
    TD_GPT_LN1W,     /* (L, C) */
    TD_GPT_LN1B,     /* (L, C) */
    TD_GPT_QKVW,     /* (L, 3C, C) */
    TD_GPT_QKVB,     /* (L, 3C) */
    TD_GPT_ATTPROJW, /* (L, C, C) */
    TD_GPT_ATTPROJB, /* (L, C) */
    TD_GPT_LN2W,     /* (L, C) */
    TD_GPT_LN2B,     /* (L, C) */
    TD_GPT_FCW,      /* (L, 4C, C) */
    TD_GPT_FCB,      /* (L, 4C) */
    TD_GPT_FCPROJW,  /* (L, C, 4C) */
    TD_GPT_FCPROJB,  /* (L, C) */
    TD_GPT_LNFW,     /* (C) */
    TD_GPT_LNFB,     /* (C) */
};

/* GPT-2 as llm.c has it: token + position embedding, L pre-LayerNorm blocks (attention and
 * a GELU MLP, each added to the residual stream), a final LayerNorm, and the lm head tied to
 * wte. p[] are declared in td_params in llm.c's order, so the flat buffer is llm.c's
 * parameter file with alignment padding between tensors; layer[l][i] are views of layer l
 * of the stacked tensor p[2 + i] (pointed by td_gpt_bind). */
typedef struct td_gpt {
    td_gpt_dims d;
    td_tensor p[TD_GPT_TENSORS];
    td_tensor layer[TD_GPT_MAX_LAYERS][TD_GPT_LAYER_T];
} td_gpt;

/* V rounded up to a multiple of TD_GPT_VP_ALIGN: 256 -> 256, 50257 -> 50304. */
int td_gpt_padded_vocab(int V);

/* Checks d against the engine's limits: TD_EINVAL with err naming the job's field. */
int td_gpt_check_dims(const td_gpt_dims *d, td_error_t *err);

/* Checks d (TD_EINVAL with err naming the field) and declares the 16 tensors in p (then call
 * td_params_alloc and td_gpt_bind). AdamW decays wte, wpe and the four weight matrices. */
int td_gpt_declare(td_gpt *m, td_params *p, const td_gpt_dims *d, td_error_t *err);

/* Points the layer views into the tensors' data and grad (after td_params_alloc). */
void td_gpt_bind(td_gpt *m);

/* llm.c's initialisation, deterministic from seed: weights N(0, 0.02), the residual
 * projections (attproj, fcproj) N(0, 0.02/sqrt(2L)), wte's first V rows only (the padding
 * stays 0), biases 0, LayerNorm weights 1. Draws from the seed's stream 1 in llm.c's order. */
void td_gpt_init(td_gpt *m, uint64_t seed);

/* Parameters, padding excluded (llm.c's num_parameters). */
size_t td_gpt_num_params(const td_gpt_dims *d);

/* The forward pass over tokens (B,T), T <= maxT. logits (when not NULL) receives the (B,T,Vp)
 * logits. Returns the mean cross-entropy against targets (B,T), or NULL when targets is NULL
 * (sampling). tokens and targets are borrowed until the tape is reset. */
td_tensor *td_gpt_forward(td_ctx *c, td_gpt *m, const int *tokens, const int *targets, int B, int T,
                          td_tensor **logits);

/* Arena bytes one td_gpt_forward of (B,T) takes (train: with gradients, and the backward's
 * scratch on top), and the tape entries it records. */
size_t td_gpt_arena_bytes(const td_gpt *m, int B, int T, int train);
int td_gpt_tape_len(const td_gpt *m);

/* ---- llm.c model files ------------------------------------------------------------------ */

#define TD_LLMC_MAGIC   20240326 /* header[0] of an llm.c model file */
#define TD_LLMC_VERSION 3        /* header[1]: fp32 parameters (2 is fp32 in older files) */
#define TD_LLMC_HEADER  1024     /* bytes: int32 header[256] */

/* Reads path's header into d, checking the magic, the version, the dimensions against the
 * engine's limits, and the file's size against them. TD_EDATA naming the file and which of
 * these was wrong; TD_ENOTFOUND / TD_EIO. */
int td_llmc_peek(const char *path, td_gpt_dims *d, td_error_t *err);

/* Reads path's parameters into m (whose dimensions must be the file's). Errors as
 * td_llmc_peek, plus TD_ESHAPE when m's dimensions differ. */
int td_llmc_load(const char *path, td_gpt *m, td_error_t *err);

/* Writes m as an llm.c model file (version 3, fp32) through a temp file renamed over path.
 * TD_EIO / TD_EDISKFULL naming the file. */
int td_llmc_save(const char *path, const td_gpt *m, td_error_t *err);

/* ---- optimizers and LR schedules ------------------------------------------------------- */

/* Moment buffers an optimizer needs in td_params (td_params_alloc's n_moments). */
int td_optim_moments(const td_train_config *cfg);

/* One update of every parameter from its gradient, step t (1-based) at learning rate lr. AdamW
 * decays only the tensors marked in p->decay (as llm.c: matrices, not biases or LayerNorm);
 * SGD's L2 term applies to every parameter, as torch.optim.SGD's does. */
void td_optim_step(const td_kernels *k, td_params *p, const td_train_config *cfg, float lr,
                   int64_t t);

/* The global L2 norm of the gradients (over p->n floats; padding is zero). sumsq is one double
 * of k's memory for the kernel's result (downloaded; panics on a device error). */
double td_grad_norm(const td_kernels *k, const td_params *p, double *sumsq);

/* The learning rate of step t (1-based) of a job of total steps (schedule.c). */
float td_schedule_lr(const td_train_config *cfg, int64_t t, int64_t total);

/* ---- datasets ---------------------------------------------------------------------------- */

#define TD_IDX_MAGIC_IMAGES 0x00000803u  /* unsigned bytes, 3 dimensions */
#define TD_IDX_MAGIC_LABELS 0x00000801u  /* unsigned bytes, 1 dimension */
#define TD_IDX_MAX_ITEMS    (1 << 28)    /* images in one file */
#define TD_IDX_MAX_PIXELS   (1 << 20)    /* pixels in one image */
#define TD_IDX_MAX_BYTES    (1ull << 34) /* bytes of pixels in one file: 16 GiB */

/* An IDX image file and its labels, in memory as they are on disk: uint8 pixels and labels. */
typedef struct td_idx {
    uint8_t *images; /* (n, rows*cols) */
    uint8_t *labels; /* (n) */
    int n;
    int rows, cols;
    int classes; /* the largest label + 1 */
} td_idx;

/* Reads split's two files, gzipped or not (told by the 1f 8b magic). TD_EDATA with a message
 * naming the file and what was wrong; TD_ENOMEM. Release with td_idx_free(). */
int td_idx_load(td_idx *d, const td_idx_split *split, td_error_t *err);
void td_idx_free(td_idx *d); /* accepts a zeroed or freed td_idx */

/* ---- random numbers ---------------------------------------------------------------------- */

/* xoshiro256** (Blackman and Vigna), seeded through splitmix64: small, fast, and the same
 * stream on every machine. */
typedef struct td_rng {
    uint64_t s[4];
} td_rng;

/* Seeds from (seed, stream): different streams of one seed are independent sequences. */
void td_rng_seed(td_rng *r, uint64_t seed, uint64_t stream);
uint64_t td_rng_next(td_rng *r);
float td_rng_uniform(td_rng *r);              /* in [0, 1), 24 random bits */
uint32_t td_rng_below(td_rng *r, uint32_t n); /* in [0, n), unbiased; n > 0 */

/* ---- the trainer's helpers for export and sampling (trainer.c) -------------------------- */

/* A hash of what must not change across a resume (the model, data, optimizer, schedule and
 * the job's length), stored in every checkpoint. */
uint64_t td__train_config_hash(const td_train_config *cfg);

/* Builds m in p (zeroed by the caller; release with td_params_free) from cfg and loads the
 * job's latest checkpoint into it; *step is the checkpoint's. TD_ENOTFOUND when there is none,
 * TD_ESTATE when it belongs to another configuration. */
int td__train_load_gpt(const td_train_config *cfg, td_gpt *m, td_params *p, int64_t *step,
                       td_error_t *err);

/* ---- a trainer's insides, for tests and benches ---------------------------------------- */

const td_arena *td_trainer_arena(const td_trainer *t);
td_params *td_trainer_params(td_trainer *t);

/* Arena bytes a training step takes by the trainer's own estimate (what sized the arena,
 * before the evaluation batch is considered). */
size_t td_trainer_step_bytes(const td_trainer *t);

#endif
