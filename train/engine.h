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

#include "kernels/kernels.h"
#include "common/td_errno.h"
#include "train/train.h"

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
    /* the backward's bookkeeping of an activation's gradient (td_backward): */
    struct td_tensor *base; /* a view's tensor (td_view), which keeps the state for both */
    unsigned char fresh;    /* grad holds nothing yet, not even zeros: its first writer stores */
    unsigned char viewed;   /* some td_view shares grad, so grad must stay where it is */
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

#define TD_PARAMS_MAX   1024 /* parameter tensors in one model (a sensorlm declares each layer's) */
#define TD_PARAMS_ALIGN 16   /* floats: every tensor starts on a 64-byte line */

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
    TD_OP_ATTENTION,    /* out = attention of q in[0], k in[1], v in[2] (arg[3]: in[0] is llm.c's
                         * packed qkv), arg[0] heads, arg[1] query rows per block, arg[2]
                         * causal; saved = lse, the (B,NH,Nq) log-sum-exp of each row */
    TD_OP_ADD_BCAST,    /* out = in[0] + in[1] repeated over in[0]'s leading rows */
    TD_OP_REPEAT,       /* out = arg[0] copies of in[0] */
    TD_OP_TOKEN_MEAN,   /* out[b] = mean over n of in[0][b,n]; arg = B, N */
    TD_OP_GATHER_ROWS,  /* out[b] = in[0][b,ids[b]]; arg = B, T */
    TD_OP_L2NORM,       /* out = in[0] / max(||in[0]||, eps) by row; saved = the norms */
    TD_OP_SIGLIP,       /* out = SigLIP loss of dots in[0], scale in[1], bias in[2]; arg[0] the
                         * diagonal's column offset, arg[1] the weight's bits */
    TD_OP_ALLGATHER,    /* out = every replica's rows of in[0], at arg[0] of arg[1] rows */
    TD_OP_COUNT
} td_op_id;

/* One op's backward closure: which op, and the tensors its backward reads and writes. */
typedef struct td_tape_entry {
    td_op_id op;
    td_tensor *out;
    td_tensor *in[3];
    td_tensor *saved[2]; /* what the forward kept for the backward, or NULL */
    const int *ids;      /* softmax_xent: the (N) class of each row; embed: the (B,T) tokens;
                          * siglip: the (M) labels of a masked loss, or NULL */
    int arg[4];          /* the op's dimensions its tensors do not carry */
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
 * With tape NULL (evaluation) nothing is recorded and no gradient buffers are allocated.
 * Data parallel (td_allgather_rows): allreduce averages n floats of k's memory across the
 * job's world replicas in place (the trainer's hooks.allreduce, called by every replica at
 * the same point); NULL and world 0 or 1 for one replica. */
typedef struct td_ctx {
    const td_kernels *k;
    td_arena *arena;
    td_tape *tape;
    void (*allreduce)(void *ud, float *buf, size_t n);
    void *allreduce_ud;
    int world;
    int zero_grads; /* the reference path: every gradient zeroed when allocated, every backward
                     * accumulating, no gradient passed through (tests hold td_backward's
                     * first writers to it bit for bit) */
} td_ctx;

/* Arena bytes one td_tensor_new() of n elements takes, with or without its gradient. Models
 * add these up to size the arena before the first step (td_mlp_arena_bytes). */
size_t td_tensor_bytes(size_t n, int with_grad);

/* A tensor from the arena, data not cleared; with_grad: a gradient too, not cleared either
 * (fresh: td_backward's first writer of it stores), zeroed when c->zero_grads. */
td_tensor *td_tensor_new(td_ctx *c, int ndim, const int *shape, int with_grad);

/* out = inp . w^T + b. inp is (..., C), w is (OC, C), b is (OC); out is (..., OC). */
td_tensor *td_linear(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b);

/* td_linear for logits whose only consumer is td_softmax_xent_fused: training, out's grad is
 * out's data (the fused classifier writes the gradient there), so it takes no gradient buffer
 * (td_tensor_bytes(n, 0)). Any other consumer would read gradients as logits. */
td_tensor *td_linear_logits(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b);

/* out = max(inp, 0), same shape. */
td_tensor *td_relu(td_ctx *c, td_tensor *inp);

/* Mean softmax cross-entropy of logits (..., V) against targets (one per row, in [0,V));
 * out is a one-element tensor. targets is borrowed until the tape is reset. */
td_tensor *td_softmax_xent(td_ctx *c, td_tensor *logits, const int *targets);

/* The same over the first V columns of logits (..., Vp): llm.c's padded vocabulary, whose
 * padding columns get probability 0 and no gradient. */
td_tensor *td_softmax_xent_padded(td_ctx *c, td_tensor *logits, const int *targets, int V);

/* td_softmax_xent_padded through the fused classifier, for logits whose only consumer is this
 * loss and a loss that is td_backward's root (its gradient 1): training, the logits' data are
 * overwritten by their gradient at forward time and their grad pointer aliases their data, no
 * probs buffer. Without gradients, td_softmax_xent_padded (which keeps no probs either). */
td_tensor *td_softmax_xent_fused(td_ctx *c, td_tensor *logits, const int *targets, int V);

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

/* *res = td_residual(a, b), then td_layernorm(*res, w, bias) returned: the same tensors in the
 * arena, the same tape entries and bits, computed in one pass when the table has
 * residual_layernorm_forward (one launch on CUDA where there were two). */
td_tensor *td_residual_layernorm(td_ctx *c, td_tensor *a, td_tensor *b, td_tensor *w,
                                 td_tensor *bias, td_tensor **res);

/* Multi-head attention, fused (kernels.h's attention_forward): queries in blocks of `chunk`
 * rows against all keys, the scores only in a transient block of the arena, given back when
 * the op is done, so an op keeps only out and each row's log-sum-exp, O(B*NH*N) floats. Its
 * backward recomputes the scores block by block in a transient block of its own (the arena's
 * top again). chunk 0 is td_attn_chunk's automatic choice.
 *
 * td_attention: the GPT's causal self-attention of llm.c's packed qkv (B,T,3C) (q, k, v side
 * by side, heads of C/NH inside each) -> (B,T,C), chunk automatic; td_attention_chunk the
 * same with a chunk. td_attention_qkv: q (B,Nq,C), k and v (B,Nk,C), three tensors -> out
 * (B,Nq,C), causal (then Nq == Nk) or not: a ViT's self-attention (q, k, v of one input) or
 * cross-attention (a MAP head's probe, Nq = 1, against Nk patches). */
td_tensor *td_attention(td_ctx *c, td_tensor *qkv, int NH);
td_tensor *td_attention_chunk(td_ctx *c, td_tensor *qkv, int NH, int chunk);
td_tensor *td_attention_qkv(td_ctx *c, td_tensor *q, td_tensor *k, td_tensor *v, int NH, int causal,
                            int chunk);

/* td_attention_chunk's self-attention of a packed qkv (B,T,3C), causal or not (a ViT's): the
 * same op, any mask. */
td_tensor *td_attention_packed(td_ctx *c, td_tensor *qkv, int NH, int causal, int chunk);

/* The automatic chunk's bound: the largest chunk whose block of scores, B*NH*chunk*Nk floats,
 * takes at most this many bytes (the backward takes two such blocks). */
#define TD_ATTN_BLOCK_BYTES ((size_t)64 << 20)
/* ... unless one sequence's scores, NH*Nq*Nk floats, do not fit there but fit in this many
 * bytes: then the block holds one whole sequence. */
#define TD_ATTN_SEQ_BYTES ((size_t)512 << 20)

/* The chunk an attention op of these dimensions uses for `chunk`: 0 picks the largest chunk
 * whose block B*NH*chunk*Nk floats fits in TD_ATTN_BLOCK_BYTES (at least 1), or, when that
 * block is smaller than one sequence's scores and those take at most TD_ATTN_SEQ_BYTES, the
 * smallest whose block holds them, ceil(Nq / B); any other value is taken as it is; either way
 * at most Nq. */
int td_attn_chunk(int chunk, int B, int NH, int Nq, int Nk);

/* Arena bytes the ops above take, for models to size the arena exactly: each mirrors the op's
 * allocations one for one (train: the op records, so outputs carry gradients). */
size_t td_op_bytes_softmax_xent(size_t rows, int Vp, int train);
size_t td_op_bytes_softmax_xent_fused(int train);
size_t td_op_bytes_layernorm(size_t rows, int C, int train);
/* An attention op's out (B,Nq,C) (with its gradient when train) and lse (B,NH,Nq). */
size_t td_op_bytes_attention(int B, int Nq, int C, int NH, int train);
/* Its transient block on the arena's top (not kept): the forward's (backward 0) or the
 * backward's (1), td_attn_scratch floats for td_attn_chunk(chunk, ...). */
size_t td_op_bytes_attention_scratch(int B, int NH, int Nq, int Nk, int chunk, int backward);

/* ---- ops of two-tower models (sensorlm) ---------------------------------------------------- */

/* A view of t with another shape of the same elements: a header from the arena's pool that
 * points at t's data and gradient, so gradients flow through it as through t. No tape entry,
 * no arena bytes. */
td_tensor *td_view(td_ctx *c, td_tensor *t, int ndim, const int *shape);

/* out = x + p, p repeated over x's leading rows: x's elements are rows of p->n (a ViT's (N,D)
 * position table added to (B,N,D)); out like x. The backward sums dout over the rows into
 * p's gradient (kernels.h's bias_forward and bias_backward). */
td_tensor *td_add_broadcast(td_ctx *c, td_tensor *x, td_tensor *p);

/* out = B copies of x, shape (B, x's shape) (a MAP head's one query for every sequence); the
 * backward sums the copies' gradients into x's. */
td_tensor *td_repeat(td_ctx *c, td_tensor *x, int B);

/* x (B,N,C) -> (B,C), the mean over the N tokens (global average pooling). */
td_tensor *td_token_mean(td_ctx *c, td_tensor *x);

/* x (B,T,C) -> (B,C): row idx[b] of each sequence b (a text tower's end token). idx is (B) ints
 * of the backend's memory, borrowed until the tape is reset. */
td_tensor *td_gather_rows(td_ctx *c, td_tensor *x, const int *idx);

/* Rows of x (..., C) scaled to unit length: x / max(||x||_2, 1e-12); keeps each row's norm. */
td_tensor *td_l2norm(td_ctx *c, td_tensor *x);

/* SigLIP's loss (1) over dots (N,M), scale t and bias b (one-element tensors):
 * weight * sum_ij -log sigmoid(y_ij (exp(t) dots_ij + b)), y_ij = 1 when j == i + diag, else
 * -1. */
td_tensor *td_siglip(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b, int diag,
                     float weight);

/* td_siglip with same-label negatives left out: a pair (i, j), j != i + diag, whose labels
 * labels[i + diag] >= 0 and labels[j] are equal adds nothing to the loss or its gradients (the
 * weight is the caller's, unchanged). labels is (M) ints of the backend's memory, row i's label
 * at i + diag (diag + N <= M), borrowed until the tape is reset; NULL is td_siglip. */
td_tensor *td_siglip_masked(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b,
                            const int *labels, int diag, float weight);

/* td_siglip_masked with the same-label negatives weighted by same instead (m_ij = same in
 * kernels.h's siglip: each such term times same; 0 is td_siglip_masked, bit for bit). */
td_tensor *td_siglip_weighted(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b,
                              const int *labels, float same, int diag, float weight);

/* Data parallel: x (n,C), this replica's rows, becomes (rows,C) holding every replica's rows,
 * this one's at row0: a zeroed buffer with x at row0, averaged across c's replicas and
 * multiplied by c->world (an all-gather through one all-reduce). The backward does the same
 * to the gradient, so each row's gradient from every replica's loss reaches its owner, which
 * takes its own rows'. Every replica must call it, with the same rows. */
td_tensor *td_allgather_rows(td_ctx *c, td_tensor *x, int rows, int row0);

/* Arena bytes of td_l2norm over rows of C (with the gradient when train) and of td_siglip. */
size_t td_op_bytes_l2norm(size_t rows, int C, int train);
size_t td_op_bytes_siglip(int train);

/* Seeds loss's gradient with 1 and replays the tape in reverse, each op adding into its inputs'
 * gradients (parameters' land in td_params.grad, which the caller zeroes). An activation's
 * gradient is never zeroed: the op that writes it first (the last of its consumers) stores,
 * the rest add; a residual passes its gradient through to its first input (the input's grad
 * becomes the output's, which nothing reads after), and stores a copy in the second. The five
 * kernels with a store form (matmul, layernorm, GELU, residual, attention) store; the others
 * find a fresh gradient zeroed first. An op whose output gradient nobody wrote (no consumer
 * on the tape) contributes nothing and is skipped, but for the all-gather, which every replica
 * must join. The gradients are those of accumulating into zeros, bit for bit (c->zero_grads
 * runs that path). A gradient nobody wrote (a tensor the loss does not depend on) holds what
 * the arena held, not zeros. Then empties the tape. */
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
    int attn_chunk; /* query rows per block of the attention (td_attn_chunk; 0, as
                     * td_gpt_declare leaves it: automatic); the trainer sets the job's */
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

/* ---- SensorLM (sensorlm.c) ------------------------------------------------------------------
 *
 * A sensor tower (a ViT over patches of a (T, C) grid of readings) and a text tower (a causal
 * transformer over a caption's bytes) whose embeddings meet in SigLIP's sigmoid loss. README.md
 * ("SensorLM") is the reference: every parameter's name and shape, the forward pass, the loss,
 * the initialisation, the presets. */

#define TD_SLM_MAX_DEPTH   32  /* blocks of one tower */
#define TD_SLM_VOCAB       258 /* text tokens: the bytes 0..255, then the end and pad tokens */
#define TD_SLM_END         256 /* the token after a caption's last byte */
#define TD_SLM_PAD         257 /* the tokens after the end token */
#define TD_SLM_BLOCK_T     12  /* parameter tensors of one transformer block */
#define TD_SLM_MAX_TENSORS (2 * TD_SLM_MAX_DEPTH * TD_SLM_BLOCK_T + 32)
#define TD_SLM_NAME_MAX    48 /* bytes of a parameter's name, NUL included */

/* One tower's transformer: width, blocks, heads, MLP width. */
typedef struct td_slm_tower {
    int D, depth, H, M;
} td_slm_tower;

/* A sensorlm's dimensions, resolved from the job (sizes.c td__train_slm_dims): the preset, the
 * job's keys over it, the shards' T and C where the job gives none. */
typedef struct td_slm_dims {
    int T, C;   /* a window: T time steps of C channels */
    int pt, pc; /* a patch: pt time steps of pc channels */
    int Cp;     /* C rounded up to a multiple of pc (channels C..Cp-1 are zero) */
    int N;      /* tokens of a window: (T/pt) * (Cp/pc) */
    int P;      /* floats of a patch: pt * pc */
    int L;      /* text tokens (text_len), the end token included */
    int E;      /* the shared embedding */
    td_slm_pool pool;
    td_slm_tower s, t; /* sensor and text towers */
} td_slm_dims;

/* The tensors of one pre-LayerNorm block, in their declared order. */
typedef struct td_slm_block {
    td_tensor *ln1_w, *ln1_b, *qkv_w, *qkv_b, *out_w, *out_b;
    td_tensor *ln2_w, *ln2_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
} td_slm_block;

/* The model: its parameters p[0..n) declared in this order in the trainer's td_params (so the
 * flat buffer is this list with alignment padding), name[i] p[i]'s export name
 * ("sensor.blocks.0.attn.qkv.weight"), and named pointers into p for the forward. */
typedef struct td_sensorlm {
    td_slm_dims d;
    int attn_chunk;          /* query rows per attention block (td_attn_chunk; 0: automatic) */
    int mask_same_label;     /* loss.mask_same_label: a training step's inputs carry the global
                              * batch's labels (td__train_slm_arena_bytes counts them) */
    float same_label_weight; /* loss.same_label_weight: those pairs' m_ij (0: left out) */
    int n;
    td_tensor p[TD_SLM_MAX_TENSORS];
    char name[TD_SLM_MAX_TENSORS][TD_SLM_NAME_MAX];
    struct {
        td_tensor *patch_w, *patch_b, *pos;
        td_slm_block blk[TD_SLM_MAX_DEPTH];
        td_tensor *lnf_w, *lnf_b;
        td_tensor *probe, *q_w, *q_b, *k_w, *k_b, *v_w, *v_b, *o_w, *o_b; /* map. (pool map) */
        td_tensor *ln_w, *ln_b, *fc1_w, *fc1_b, *fc2_w, *fc2_b;
        td_tensor *proj;
    } s;
    struct {
        td_tensor *tok, *pos;
        td_slm_block blk[TD_SLM_MAX_DEPTH];
        td_tensor *lnf_w, *lnf_b, *proj;
    } t;
    td_tensor *logit_scale, *logit_bias;
} td_sensorlm;

/* A preset's tower and embedding width (train.h td_slm_size). */
void td_slm_preset(td_slm_size size, td_slm_tower *tower, int *E);

/* Resolves cfg's model keys over its preset, with T and C for a window (the job's, or the
 * shards' when the job gives none), and checks them: TD_EINVAL naming the job's key
 * ("model.sensor.patch_t: 7 does not divide time_steps 1440"). */
int td_slm_dims_of(const td_sensorlm_config *cfg, int T, int C, td_slm_dims *d, td_error_t *err);

/* Checks d against the engine's limits (td_slm_dims_of does), TD_EINVAL naming the key. */
int td_slm_check_dims(const td_slm_dims *d, td_error_t *err);

/* Checks d and declares every parameter in p in the README's order, each with its name (then
 * call td_params_alloc). AdamW decays the 2-D tensors: every linear weight, the position
 * tables, the token table. */
int td_sensorlm_declare(td_sensorlm *m, td_params *p, const td_slm_dims *d, td_error_t *err);

/* Initialisation, deterministic from seed (its stream 1): tensor by tensor in the declared
 * order, each element of a linear weight, tok, pos and the MAP probe from N(0, 0.02) (Box-Muller
 * in double, as the gpt's), biases 0, LayerNorm weights 1, logit_scale ln 10, logit_bias -10. */
void td_sensorlm_init(td_sensorlm *m, uint64_t seed);

/* Parameters (no padding). */
size_t td_sensorlm_num_params(const td_slm_dims *d);

/* FLOPs of one training step over a global batch of B rows, llm.c's convention: 6 per weight of
 * a matmul per row it multiplies, plus attention's 12 per score element (6 when causal: half
 * the scores), plus the head's B*B*E dot products, times 6. */
double td_sensorlm_flops(const td_slm_dims *d, int B);

/* The sensor tower: patches (B,N,P) -> s (B,E), unit rows. */
td_tensor *td_sensorlm_sensor(td_ctx *c, td_sensorlm *m, td_tensor *patches);

/* The text tower: tokens (B,L) and each caption's end position end (B), both ints of the
 * backend's memory borrowed until the tape is reset -> u (B,E), unit rows. */
td_tensor *td_sensorlm_text(td_ctx *c, td_sensorlm *m, const int *tokens, const int *end, int B);

/* SigLIP's loss of this replica's s and u (B,E each), rows [row0, row0+B) of a global batch of
 * `rows`: u gathered from every replica when c->world > 1 (td_allgather_rows), then
 * (world/rows) * sum over this replica's rows i and all rows j of -log sigmoid(y_ij z_ij), so
 * that the mean over replicas is the global batch's loss. */
td_tensor *td_sensorlm_loss(td_ctx *c, td_sensorlm *m, td_tensor *s, td_tensor *u, int rows,
                            int row0);

/* td_sensorlm_loss with the same-label negatives of loss.mask_same_label left out, or weighted
 * by m->same_label_weight (td_siglip_weighted): labels is the (rows) labels of the whole global
 * batch, -1 where unknown, ints of the backend's memory borrowed until the tape is reset (every
 * replica passes all of them: its rows meet every column). NULL is td_sensorlm_loss. */
td_tensor *td_sensorlm_loss_masked(td_ctx *c, td_sensorlm *m, td_tensor *s, td_tensor *u,
                                   const int *labels, int rows, int row0);

/* Arena bytes, mirroring the functions above allocation for allocation with the attention's
 * transient blocks on top (the peak): a training step's sensor, text and loss of B rows of a
 * global batch of `rows` (train: with gradients and the backward's scratch; world > 1: the
 * gather's rows), or an evaluation's (no tape: the towers asked for, and the loss when
 * `rows` > 0). */
size_t td_sensorlm_arena_bytes(const td_sensorlm *m, int B, int rows, int world, int train);
size_t td_sensorlm_embed_bytes(const td_sensorlm *m, int B, int sensor, int text, int rows);
/* Of a training step's (as td_sensorlm_arena_bytes), what the attention ops keep of their own
 * (each row's log-sum-exp; their outputs are activations like any layer's) plus their largest
 * transient block of scores (the backward's): the estimate's "attention", what stands where a
 * non-fused attention keeps its (B,H,N,N) scores and probabilities in every layer. */
size_t td_sensorlm_attention_bytes(const td_sensorlm *m, int B, int train);
/* Tape entries one training step records. */
int td_sensorlm_tape_len(const td_sensorlm *m);

/* ---- optimizers and LR schedules ------------------------------------------------------- */

/* Moment buffers an optimizer needs in td_params (td_params_alloc's n_moments). */
int td_optim_moments(const td_train_config *cfg);

/* One update of every parameter from its gradient, step t (1-based) at learning rate lr. AdamW
 * decays only the tensors marked in p->decay (as llm.c: matrices, not biases or LayerNorm);
 * SGD's L2 term applies to every parameter, as torch.optim.SGD's does. */
void td_optim_step(const td_kernels *k, td_params *p, const td_train_config *cfg, float lr,
                   int64_t t);

/* AdamW's spans of p (one per tensor, its offset, size and decay flag) in k's memory, for
 * td_optim_step_flat: *spans is p->count of them; caller frees with k->free(). TD_ENOMEM or
 * TD_ECUDA from k->alloc; a device's upload panics on its errors (call under a boundary). */
int td_optim_spans(const td_kernels *k, const td_params *p, td_adamw_span **spans, td_error_t *err);

/* The step over every tensor of p in one call, the gradient first multiplied by *scale (k's
 * memory, from clip_scale; not finite: the step is skipped on the backend): AdamW's adamw_flat
 * over spans, SGD's sgd_flat over the whole buffer. Bit for bit td_optim_step after the host's
 * clip on the CPU. */
void td_optim_step_flat(const td_kernels *k, td_params *p, const td_train_config *cfg,
                        const td_adamw_span *spans, const float *scale, float lr, int64_t t);

/* Whether k has cfg's optimizer's one-call form and clip_scale (td_optim_step_flat). */
int td_optim_has_flat(const td_kernels *k, const td_train_config *cfg);

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

/* ---- a job's checkpoints, for the trainer, export and sampling (jobckpt.c) ------------- */

/* A hash of what must not change across a resume (the model, data, optimizer, schedule and
 * the job's length), stored in every checkpoint. */
uint64_t td__train_config_hash(const td_train_config *cfg);

/* The checkpoint's float sections into s (room for 4): the parameters and the optimizer's
 * moments, each a whole flat buffer (padding included), and a sensorlm's statistics ("norm":
 * the C means, then the C stds its windows are normalised with; norm NULL for the other
 * models). Returns how many. */
struct td_ckpt_section;
int td__train_ckpt_sections(td_params *p, float *norm, int C, struct td_ckpt_section *s);

/* Builds m in p (zeroed by the caller; release with td_params_free) from cfg and loads the
 * job's latest checkpoint into it; *step is the checkpoint's. TD_ENOTFOUND when there is none,
 * TD_ESTATE when it belongs to another configuration. */
int td__train_load_gpt(const td_train_config *cfg, td_gpt *m, td_params *p, int64_t *step,
                       td_error_t *err);

/* Builds m in p (zeroed by the caller; release with td_params_free) from cfg and loads the
 * sensorlm job's latest checkpoint into it: *step is the checkpoint's, *norm (2*C floats: the
 * channels' mean, then their std; caller frees with free(), also after an error) the
 * statistics the job normalised windows with. Errors as td__train_load_gpt's; TD_EINVAL for a
 * job that is not sensorlm. */
int td__train_load_mlp(const td_train_config *cfg, td_mlp *m, td_params *p, int64_t *step,
                       td_error_t *err);
int td__train_load_sensorlm(const td_train_config *cfg, td_sensorlm *m, td_params *p, int64_t *step,
                            float **norm, td_error_t *err);

/* ---- a trainer's insides, for tests and benches ---------------------------------------- */

const td_arena *td_trainer_arena(const td_trainer *t);
/* The host buffer batches are built in before their upload (k->alloc_host's), NULL on a host
 * backend. */
const void *td_trainer_stage(const td_trainer *t);
td_params *td_trainer_params(td_trainer *t);

/* Arena bytes a training step takes by the trainer's own estimate (what sized the arena,
 * before the evaluation batch is considered). */
size_t td_trainer_step_bytes(const td_trainer *t);

#endif
