/* The engine's machinery (engine.h): the activation arena, the flat parameter buffers, the
 * tape, the ops that record on it and td_backward() that replays it. Ops compute through the
 * backend table in their td_ctx and never call a kernel directly. Used by the one thread that
 * owns the trainer; ops may panic, so they run under the worker's boundary. */
#include <stdlib.h>
#include <string.h>

#include "train/engine.h"
#include "common/td_panic.h"

/* ---- the activation arena ------------------------------------------------------------- */

size_t td_arena_round(size_t bytes)
{
    return (bytes + TD_ARENA_ALIGN - 1) & ~(size_t)(TD_ARENA_ALIGN - 1);
}

/* Acquires cap bytes (rounded up to the alignment), aligned, from k or the heap, and the
 * header pool. */
static int arena_init(td_arena *a, size_t cap, const td_kernels *k, td_error_t *err)
{
    int rc = 0;

    memset(a, 0, sizeof(*a));
    cap = td_arena_round(cap > 0 ? cap : 1);
    a->tensors = calloc(TD_ARENA_TENSORS, sizeof(*a->tensors));
    if (a->tensors == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for %d tensor headers", TD_ARENA_TENSORS);
    if (k != NULL && !k->host) {
        rc = k->alloc((void **)&a->base, cap, err);
        a->k = rc == 0 ? k : NULL;
    } else if ((a->base = aligned_alloc(TD_ARENA_ALIGN, cap)) == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "no memory for a %zu-byte activation arena", cap);
    }
    if (rc != 0) {
        td_arena_free(a);
        return rc;
    }
    a->cap = cap;
    return 0;
}

int td_arena_init(td_arena *a, size_t cap)
{
    td_error_t e;

    return arena_init(a, cap, NULL, &e);
}

int td_arena_init_on(td_arena *a, size_t cap, const td_kernels *k, td_error_t *err)
{
    return arena_init(a, cap, k, err);
}

void td_arena_free(td_arena *a)
{
    if (a == NULL)
        return;
    if (a->k != NULL)
        a->k->free(a->base);
    else
        free(a->base);
    free(a->tensors);
    memset(a, 0, sizeof(*a));
}

void td_arena_reset(td_arena *a)
{
    a->used = 0;
    a->n_tensors = 0;
}

/* A slice of the arena; running out is a bug in the size estimate or a model bigger than
 * planned, either way fatal to the step. */
void *td_arena_alloc(td_arena *a, size_t bytes)
{
    size_t need = td_arena_round(bytes);
    void *p;

    if (need > a->cap - a->used)
        td_panic(TD_ENOMEM, "activation arena exhausted: %zu bytes wanted, %zu of %zu in use", need,
                 a->used, a->cap);
    p = a->base + a->used;
    a->used += need;
    if (a->used > a->peak)
        a->peak = a->used;
    return p;
}

/* ---- the flat parameter buffers ------------------------------------------------------ */

/* Records t's shape and its offset in the buffers-to-be; its data arrives in td_params_alloc. */
int td_params_declare(td_params *p, td_tensor *t, int ndim, const int *shape)
{
    size_t n = 1;

    if (p->count >= TD_PARAMS_MAX || ndim < 1 || ndim > TD_TENSOR_MAX_DIMS)
        return TD_E2BIG;
    memset(t, 0, sizeof(*t));
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t->ndim = ndim;
    t->n = n;
    p->decay[p->count] = ndim >= 2;
    p->tensors[p->count] = t;
    p->offset[p->count] = p->n;
    p->count++;
    p->n += (n + TD_PARAMS_ALIGN - 1) / TD_PARAMS_ALIGN * TD_PARAMS_ALIGN;
    return 0;
}

/* n floats, zeroed, on a cache line. */
static float *alloc_floats(size_t n)
{
    size_t bytes = td_arena_round(n * sizeof(float));
    float *f = aligned_alloc(TD_ARENA_ALIGN, bytes > 0 ? bytes : TD_ARENA_ALIGN);

    if (f != NULL)
        memset(f, 0, bytes);
    return f;
}

/* Acquires data and grad (and m, v as asked), then points each declared tensor into them. The
 * gradient buffer has TD_PARAMS_ALIGN floats of slack for the loss of a data-parallel
 * all-reduce. */
int td_params_alloc(td_params *p, int n_moments)
{
    p->data = p->host_data = alloc_floats(p->n);
    p->grad = alloc_floats(p->n + TD_PARAMS_ALIGN);
    if (p->data == NULL || p->grad == NULL)
        goto fail;
    if (n_moments >= 1 && (p->m = p->host_m = alloc_floats(p->n)) == NULL)
        goto fail;
    if (n_moments >= 2 && (p->v = p->host_v = alloc_floats(p->n)) == NULL)
        goto fail;
    for (int i = 0; i < p->count; i++) {
        p->tensors[i]->data = p->data + p->offset[i];
        p->tensors[i]->grad = p->grad + p->offset[i];
    }
    return 0;

fail:
    td_params_free(p);
    return TD_ENOMEM;
}

/* n floats of k's memory into *out (NULL for none). */
static int place_one(float **out, size_t n, const td_kernels *k, td_error_t *err)
{
    *out = NULL;
    return n > 0 ? k->alloc((void **)out, n * sizeof(float), err) : 0;
}

/* Everything is acquired first (errors are returned); then p owns the device buffers, and the
 * copies, which panic on a device error, leave nothing that td_params_free would miss. */
int td_params_place(td_params *p, const td_kernels *k, td_error_t *err)
{
    float *d = NULL, *g = NULL, *m = NULL, *v = NULL;
    int rc;

    if (k->host || p->k != NULL)
        return 0;
    rc = place_one(&d, p->n, k, err);
    if (rc == 0)
        rc = place_one(&g, p->n + TD_PARAMS_ALIGN, k, err);
    if (rc == 0 && p->m != NULL)
        rc = place_one(&m, p->n, k, err);
    if (rc == 0 && p->v != NULL)
        rc = place_one(&v, p->n, k, err);
    if (rc != 0) {
        k->free(d);
        k->free(g);
        k->free(m);
        k->free(v);
        return rc;
    }
    free(p->grad);
    p->data = d;
    p->grad = g;
    p->m = m;
    p->v = v;
    p->k = k;
    for (int i = 0; i < p->count; i++) {
        p->tensors[i]->data = p->data + p->offset[i];
        p->tensors[i]->grad = p->grad + p->offset[i];
    }
    k->upload(p->data, p->host_data, p->n * sizeof(float));
    k->zero(p->grad, p->n + TD_PARAMS_ALIGN);
    if (p->m != NULL)
        k->upload(p->m, p->host_m, p->n * sizeof(float));
    if (p->v != NULL)
        k->upload(p->v, p->host_v, p->n * sizeof(float));
    return 0;
}

void td_params_to_host(td_params *p)
{
    if (p->k == NULL)
        return;
    p->k->download(p->host_data, p->data, p->n * sizeof(float));
    if (p->m != NULL)
        p->k->download(p->host_m, p->m, p->n * sizeof(float));
    if (p->v != NULL)
        p->k->download(p->host_v, p->v, p->n * sizeof(float));
}

void td_params_free(td_params *p)
{
    if (p == NULL)
        return;
    if (p->k != NULL) {
        p->k->free(p->data);
        p->k->free(p->grad);
        p->k->free(p->m);
        p->k->free(p->v);
    } else {
        free(p->grad);
    }
    free(p->host_data);
    free(p->host_m);
    free(p->host_v);
    p->data = p->grad = p->m = p->v = NULL;
    p->host_data = p->host_m = p->host_v = NULL;
    p->k = NULL;
    for (int i = 0; i < p->count; i++)
        p->tensors[i]->data = p->tensors[i]->grad = NULL;
}

/* ---- the tape --------------------------------------------------------------------------- */

int td_tape_init(td_tape *t, int cap)
{
    memset(t, 0, sizeof(*t));
    t->entries = calloc((size_t)(cap > 0 ? cap : 1), sizeof(*t->entries));
    if (t->entries == NULL)
        return TD_ENOMEM;
    t->cap = cap;
    return 0;
}

void td_tape_free(td_tape *t)
{
    if (t == NULL)
        return;
    free(t->entries);
    memset(t, 0, sizeof(*t));
}

void td_tape_reset(td_tape *t)
{
    t->len = 0;
}

/* Appends one op's backward closure; a full tape means the model recorded more ops than it
 * said it would (td_mlp_tape_len), fatal to the step. */
static td_tape_entry *tape_push(td_tape *t, td_op_id op, td_tensor *out, td_tensor *in0,
                                td_tensor *in1, td_tensor *in2)
{
    td_tape_entry *e;

    if (t->len >= t->cap)
        td_panic(TD_ENOMEM, "tape full: %d ops recorded", t->len);
    e = &t->entries[t->len++];
    memset(e, 0, sizeof(*e));
    e->op = op;
    e->out = out;
    e->in[0] = in0;
    e->in[1] = in1;
    e->in[2] = in2;
    return e;
}

/* ---- ops: forward -------------------------------------------------------------------- */

/* A tensor's data (and gradient) are separate slices, so each starts aligned; its header comes
 * from the arena's host pool. */
size_t td_tensor_bytes(size_t n, int with_grad)
{
    size_t data = td_arena_round(n * sizeof(float));
    return data + (with_grad ? data : 0);
}

td_tensor *td_tensor_new(td_ctx *c, int ndim, const int *shape, int with_grad)
{
    td_tensor *t;
    size_t n = 1;

    if (ndim < 1 || ndim > TD_TENSOR_MAX_DIMS)
        td_panic(TD_ESHAPE, "tensor with %d dimensions (1 to %d supported)", ndim,
                 TD_TENSOR_MAX_DIMS);
    if (c->arena->n_tensors >= TD_ARENA_TENSORS)
        td_panic(TD_ENOMEM, "activation arena: more than %d tensors in one pass", TD_ARENA_TENSORS);
    t = &c->arena->tensors[c->arena->n_tensors++];
    memset(t, 0, sizeof(*t));
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= (size_t)shape[i];
    }
    t->ndim = ndim;
    t->n = n;
    t->data = td_arena_alloc(c->arena, n * sizeof(float));
    if (with_grad) {
        t->grad = td_arena_alloc(c->arena, n * sizeof(float));
        if (c->zero_grads)
            c->k->zero(t->grad, n);
        else
            t->fresh = 1;
    }
    return t;
}

/* Whether an op's output needs a gradient: only while recording, and only when one of its
 * inputs has one. */
static int wants_grad(const td_ctx *c, const td_tensor *a, const td_tensor *b, const td_tensor *d)
{
    if (c->tape == NULL)
        return 0;
    return (a != NULL && a->grad != NULL) || (b != NULL && b->grad != NULL) ||
           (d != NULL && d->grad != NULL);
}

/* Rows of a tensor seen as (rows, last dimension). */
static int rows_of(const td_tensor *t)
{
    return (int)(t->n / (size_t)t->shape[t->ndim - 1]);
}

/* td_linear and td_linear_logits: in_place, the output's gradient is its data (no buffer). */
static td_tensor *linear(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b, int in_place)
{
    int C = inp->shape[inp->ndim - 1];
    int OC = w->shape[0];
    int N = rows_of(inp);
    int shape[TD_TENSOR_MAX_DIMS], grad = wants_grad(c, inp, w, b);
    td_tensor *out;

    if (w->ndim != 2 || w->shape[1] != C)
        td_panic(TD_ESHAPE, "linear: input has %d features, weight is (%d,%d)", C, w->shape[0],
                 w->ndim == 2 ? w->shape[1] : -1);
    if (b != NULL && (int)b->n != OC)
        td_panic(TD_ESHAPE, "linear: bias has %zu elements, weight has %d outputs", b->n, OC);
    memcpy(shape, inp->shape, sizeof(shape));
    shape[inp->ndim - 1] = OC;
    out = td_tensor_new(c, inp->ndim, shape, grad && !in_place);
    if (grad && in_place) {
        out->grad = out->data;
        out->fresh = !c->zero_grads;
    }
    c->k->matmul_forward(out->data, inp->data, w->data, b != NULL ? b->data : NULL, N, C, OC);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_LINEAR, out, inp, w, b);
    return out;
}

td_tensor *td_linear(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b)
{
    return linear(c, inp, w, b, 0);
}

td_tensor *td_linear_logits(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b)
{
    return linear(c, inp, w, b, 1);
}

/* out = forward(inp) elementwise, same shape, recorded as op. */
static td_tensor *elementwise(td_ctx *c, td_tensor *inp,
                              void (*forward)(float *out, const float *inp, size_t n), td_op_id op)
{
    td_tensor *out = td_tensor_new(c, inp->ndim, inp->shape, wants_grad(c, inp, NULL, NULL));

    forward(out->data, inp->data, inp->n);
    if (out->grad != NULL)
        tape_push(c->tape, op, out, inp, NULL, NULL);
    return out;
}

td_tensor *td_relu(td_ctx *c, td_tensor *inp)
{
    return elementwise(c, inp, c->k->relu_forward, TD_OP_RELU);
}

td_tensor *td_softmax_xent_padded(td_ctx *c, td_tensor *logits, const int *targets, int V)
{
    int Vp = logits->shape[logits->ndim - 1];
    int N = rows_of(logits);
    td_tensor *probs, *loss;

    if (V < 1 || V > Vp)
        td_panic(TD_ESHAPE, "softmax_xent: %d classes in %d logits", V, Vp);
    if (!wants_grad(c, logits, NULL, NULL)) { /* eval: the loss alone, no probs kept */
        loss = td_tensor_new(c, 1, (int[]){1}, 0);
        c->k->softmax_xent_fused(loss->data, logits->data, targets, N, V, Vp, 0);
        return loss;
    }
    probs = td_tensor_new(c, logits->ndim, logits->shape, 0);
    loss = td_tensor_new(c, 1, (int[]){1}, 1);
    c->k->softmax_xent_forward(loss->data, probs->data, logits->data, targets, N, V, Vp);
    if (loss->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_SOFTMAX_XENT, loss, logits, NULL, NULL);
        e->saved[0] = probs;
        e->ids = targets;
        e->arg[0] = V;
    }
    return loss;
}

td_tensor *td_softmax_xent(td_ctx *c, td_tensor *logits, const int *targets)
{
    return td_softmax_xent_padded(c, logits, targets, logits->shape[logits->ndim - 1]);
}

size_t td_op_bytes_softmax_xent(size_t rows, int Vp, int train)
{
    return (train ? td_tensor_bytes(rows * (size_t)Vp, 0) : 0) + td_tensor_bytes(1, train);
}

/* The fused classifier. td_backward seeds the loss's gradient with 1 and nothing else reads
 * the loss, so the logits' gradient is known at forward time: the kernel writes it over the
 * logits' data (their values are no longer needed: the loss is their only consumer) for
 * dloss 1; a loss used further (scaled, summed) would need the unfused op. The logits'
 * grad pointer is then turned to their data, so the matmul's backward reads dlogits where the
 * kernel put them, and the tape entry's backward (saved[0] NULL) does nothing. Logits from
 * td_linear_logits never had a gradient buffer of their own; from td_linear, theirs stays
 * allocated, unused. What goes is the (N,Vp) probs buffer, the backward's read-modify-write
 * over the logits' gradient and, with td_linear_logits, the gradient's (N,Vp) floats. */
td_tensor *td_softmax_xent_fused(td_ctx *c, td_tensor *logits, const int *targets, int V)
{
    int Vp = logits->shape[logits->ndim - 1];
    int N = rows_of(logits);
    td_tensor *loss;
    td_tape_entry *e;

    if (V < 1 || V > Vp)
        td_panic(TD_ESHAPE, "softmax_xent: %d classes in %d logits", V, Vp);
    if (!wants_grad(c, logits, NULL, NULL))
        return td_softmax_xent_padded(c, logits, targets, V);
    if (logits->base != NULL) /* its tensor's gradient would stay unwritten */
        td_panic(TD_EINVAL, "fused classifier: the logits are a view; give it the op's output");
    loss = td_tensor_new(c, 1, (int[]){1}, 1);
    c->k->softmax_xent_fused(loss->data, logits->data, targets, N, V, Vp, 1);
    logits->grad = logits->data;
    logits->fresh = 0; /* written: the first writer was this forward */
    e = tape_push(c->tape, TD_OP_SOFTMAX_XENT, loss, logits, NULL, NULL);
    e->saved[0] = NULL;
    e->ids = targets;
    e->arg[0] = V;
    return loss;
}

size_t td_op_bytes_softmax_xent_fused(int train)
{
    return td_tensor_bytes(1, train);
}

td_tensor *td_embed(td_ctx *c, const int *tokens, int B, int T, td_tensor *wte, td_tensor *wpe)
{
    int C = wte->shape[1];
    td_tensor *out;

    if (wte->ndim != 2 || wpe->ndim != 2 || wpe->shape[1] != C || T > wpe->shape[0])
        td_panic(TD_ESHAPE, "embed: wte (%d,%d), wpe (%d,%d), T %d", wte->shape[0], C,
                 wpe->shape[0], wpe->shape[1], T);
    out = td_tensor_new(c, 3, (int[]){B, T, C}, wants_grad(c, wte, wpe, NULL));
    c->k->encoder_forward(out->data, tokens, wte->data, wpe->data, B, T, C);
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_EMBED, out, wte, wpe, NULL);
        e->ids = tokens;
        e->arg[0] = B;
        e->arg[1] = T;
    }
    return out;
}

td_tensor *td_layernorm(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b)
{
    int C = inp->shape[inp->ndim - 1];
    int N = rows_of(inp);
    td_tensor *out, *mean, *rstd;

    if ((int)w->n != C || (int)b->n != C)
        td_panic(TD_ESHAPE, "layernorm: %d features, weight %zu, bias %zu", C, w->n, b->n);
    out = td_tensor_new(c, inp->ndim, inp->shape, wants_grad(c, inp, w, b));
    mean = td_tensor_new(c, 1, (int[]){N}, 0);
    rstd = td_tensor_new(c, 1, (int[]){N}, 0);
    c->k->layernorm_forward(out->data, mean->data, rstd->data, inp->data, w->data, b->data, N, C);
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_LAYERNORM, out, inp, w, b);
        e->saved[0] = mean;
        e->saved[1] = rstd;
    }
    return out;
}

td_tensor *td_residual_layernorm(td_ctx *c, td_tensor *a, td_tensor *b, td_tensor *w,
                                 td_tensor *bias, td_tensor **res)
{
    int C = a->shape[a->ndim - 1];
    int N = rows_of(a);
    td_tensor *r, *out, *mean, *rstd;

    if (c->k->residual_layernorm_forward == NULL) {
        *res = td_residual(c, a, b);
        return td_layernorm(c, *res, w, bias);
    }
    if (a->n != b->n)
        td_panic(TD_ESHAPE, "residual: %zu + %zu elements", a->n, b->n);
    if ((int)w->n != C || (int)bias->n != C)
        td_panic(TD_ESHAPE, "layernorm: %d features, weight %zu, bias %zu", C, w->n, bias->n);
    /* td_residual's and then td_layernorm's tensors and tape entries, one for one */
    r = td_tensor_new(c, a->ndim, a->shape, wants_grad(c, a, b, NULL));
    out = td_tensor_new(c, r->ndim, r->shape, wants_grad(c, r, w, bias));
    mean = td_tensor_new(c, 1, (int[]){N}, 0);
    rstd = td_tensor_new(c, 1, (int[]){N}, 0);
    c->k->residual_layernorm_forward(r->data, out->data, mean->data, rstd->data, a->data, b->data,
                                     w->data, bias->data, N, C);
    if (r->grad != NULL)
        tape_push(c->tape, TD_OP_RESIDUAL, r, a, b, NULL);
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_LAYERNORM, out, r, w, bias);
        e->saved[0] = mean;
        e->saved[1] = rstd;
    }
    *res = r;
    return out;
}

size_t td_op_bytes_layernorm(size_t rows, int C, int train)
{
    return td_tensor_bytes(rows * (size_t)C, train) + 2 * td_tensor_bytes(rows, 0);
}

td_tensor *td_gelu(td_ctx *c, td_tensor *inp)
{
    return elementwise(c, inp, c->k->gelu_forward, TD_OP_GELU);
}

td_tensor *td_residual(td_ctx *c, td_tensor *a, td_tensor *b)
{
    td_tensor *out;

    if (a->n != b->n)
        td_panic(TD_ESHAPE, "residual: %zu + %zu elements", a->n, b->n);
    out = td_tensor_new(c, a->ndim, a->shape, wants_grad(c, a, b, NULL));
    c->k->residual_forward(out->data, a->data, b->data, a->n);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_RESIDUAL, out, a, b, NULL);
    return out;
}

int td_attn_chunk(int chunk, int B, int NH, int Nq, int Nk)
{
    if (chunk <= 0) {
        size_t row = (size_t)B * NH * Nk * sizeof(float); /* bytes of one query row's scores */
        size_t fit = row > 0 ? TD_ATTN_BLOCK_BYTES / row : (size_t)Nq;
        size_t seq = (size_t)NH * Nq * Nk * sizeof(float); /* one sequence's scores */
        chunk = fit < 1 ? 1 : fit < (size_t)Nq ? (int)fit : Nq;
        /* a block too small for a whole sequence that TD_ATTN_SEQ_BYTES holds grows to one,
         * so that the kernels read each sequence's keys once (kernels/attn_plan.h) */
        if (chunk < Nq && B > 0 && seq > (size_t)chunk * row && seq <= TD_ATTN_SEQ_BYTES)
            chunk = (Nq + B - 1) / B;
    }
    return chunk < Nq ? chunk : Nq > 0 ? Nq : 1;
}

/* The kernels' view of an attention op over q, k, v (packed: in[0] alone is the (B,T,3C) qkv)
 * and its pointers into their data or gradients. */
static td_attn_dims attn_dims(td_tensor *const in[3], int packed, int NH, int causal, int chunk)
{
    td_attn_dims d = {0};
    int C = packed ? in[0]->shape[2] / 3 : in[0]->shape[2];

    d.B = in[0]->shape[0];
    d.NH = NH;
    d.Nq = in[0]->shape[1];
    d.Nk = packed ? d.Nq : in[1]->shape[1];
    d.hs = C / NH;
    d.ldq = in[0]->shape[2];
    d.ldk = packed ? d.ldq : in[1]->shape[2];
    d.ldv = packed ? d.ldq : in[2]->shape[2];
    d.causal = causal;
    d.chunk = td_attn_chunk(chunk, d.B, NH, d.Nq, d.Nk);
    return d;
}

/* p[i]: the data (grad 0) or gradients (grad 1) of q, k, v; NULL where there are none. */
static void attn_ptrs(float *p[3], td_tensor *const in[3], int packed, int grad)
{
    for (int i = 0; i < 3; i++) {
        const td_tensor *t = packed ? in[0] : in[i];
        float *base = grad ? t->grad : t->data;
        p[i] = base == NULL ? NULL : packed ? base + (size_t)i * (t->shape[2] / 3) : base;
    }
}

/* out and lse from the arena, the forward's transient block on top of them, given back. */
static td_tensor *attention(td_ctx *c, td_tensor *const in[3], int packed, int NH, int causal,
                            int chunk)
{
    td_attn_dims d = attn_dims(in, packed, NH, causal, chunk);
    int C = d.NH * d.hs;
    td_tensor *out, *lse;
    float *p[3], *scratch;
    size_t mark;

    out = td_tensor_new(c, 3, (int[]){d.B, d.Nq, C},
                        wants_grad(c, in[0], packed ? NULL : in[1], packed ? NULL : in[2]));
    lse = td_tensor_new(c, 3, (int[]){d.B, d.NH, d.Nq}, 0);
    mark = c->arena->used;
    scratch = td_arena_alloc(c->arena, td_attn_scratch(&d, 0) * sizeof(float));
    attn_ptrs(p, in, packed, 0);
    c->k->attention_forward(out->data, lse->data, scratch, p[0], p[1], p[2], &d);
    c->arena->used = mark;
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_ATTENTION, out, in[0], packed ? NULL : in[1],
                                     packed ? NULL : in[2]);
        e->saved[0] = lse;
        e->arg[0] = NH;
        e->arg[1] = d.chunk;
        e->arg[2] = causal;
        e->arg[3] = packed;
    }
    return out;
}

td_tensor *td_attention_chunk(td_ctx *c, td_tensor *qkv, int NH, int chunk)
{
    td_tensor *in[3] = {qkv, NULL, NULL};

    if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0 || NH < 1 || (qkv->shape[2] / 3) % NH != 0)
        td_panic(TD_ESHAPE, "attention: qkv of %d dimensions, last %d, %d heads", qkv->ndim,
                 qkv->shape[qkv->ndim - 1], NH);
    return attention(c, in, 1, NH, 1, chunk);
}

td_tensor *td_attention_packed(td_ctx *c, td_tensor *qkv, int NH, int causal, int chunk)
{
    td_tensor *in[3] = {qkv, NULL, NULL};

    if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0 || NH < 1 || (qkv->shape[2] / 3) % NH != 0)
        td_panic(TD_ESHAPE, "attention: qkv of %d dimensions, last %d, %d heads", qkv->ndim,
                 qkv->shape[qkv->ndim - 1], NH);
    return attention(c, in, 1, NH, causal != 0, chunk);
}

td_tensor *td_attention(td_ctx *c, td_tensor *qkv, int NH)
{
    return td_attention_chunk(c, qkv, NH, 0);
}

td_tensor *td_attention_qkv(td_ctx *c, td_tensor *q, td_tensor *k, td_tensor *v, int NH, int causal,
                            int chunk)
{
    td_tensor *in[3] = {q, k, v};

    if (q->ndim != 3 || k->ndim != 3 || v->ndim != 3 || k->shape[0] != q->shape[0] ||
        v->shape[0] != q->shape[0] || v->shape[1] != k->shape[1] || k->shape[2] != q->shape[2] ||
        v->shape[2] != q->shape[2] || NH < 1 || q->shape[2] % NH != 0 ||
        (causal && q->shape[1] != k->shape[1]))
        td_panic(TD_ESHAPE,
                 "attention: q (%d,%d,%d), k (%d,%d,%d), v (%d,%d,%d), %d heads%s: q, k, v are "
                 "(B,N,C) with one B and C, k and v one N, C a multiple of the heads%s",
                 q->shape[0], q->shape[1], q->shape[2], k->shape[0], k->shape[1], k->shape[2],
                 v->shape[0], v->shape[1], v->shape[2], NH, causal ? ", causal" : "",
                 causal ? ", and causal needs as many queries as keys" : "");
    return attention(c, in, 0, NH, causal, chunk);
}

size_t td_op_bytes_attention(int B, int Nq, int C, int NH, int train)
{
    return td_tensor_bytes((size_t)B * Nq * C, train) + td_tensor_bytes((size_t)B * NH * Nq, 0);
}

size_t td_op_bytes_attention_scratch(int B, int NH, int Nq, int Nk, int chunk, int backward)
{
    td_attn_dims d = {.B = B, .NH = NH, .Nq = Nq, .Nk = Nk};

    d.chunk = td_attn_chunk(chunk, B, NH, Nq, Nk);
    return td_arena_round(td_attn_scratch(&d, backward) * sizeof(float));
}

/* ---- ops of two-tower models ------------------------------------------------------------- */

td_tensor *td_view(td_ctx *c, td_tensor *t, int ndim, const int *shape)
{
    td_tensor *v;
    size_t n = 1;

    for (int i = 0; i < ndim && ndim <= TD_TENSOR_MAX_DIMS; i++)
        n *= (size_t)shape[i];
    if (ndim < 1 || ndim > TD_TENSOR_MAX_DIMS || n != t->n)
        td_panic(TD_ESHAPE, "view: %zu elements as %d dimensions of %zu", t->n, ndim, n);
    if (c->arena->n_tensors >= TD_ARENA_TENSORS)
        td_panic(TD_ENOMEM, "activation arena: more than %d tensors in one pass", TD_ARENA_TENSORS);
    v = &c->arena->tensors[c->arena->n_tensors++];
    *v = *t;
    v->base = t->base != NULL ? t->base : t;
    v->base->viewed = 1;
    v->ndim = ndim;
    memset(v->shape, 0, sizeof(v->shape));
    memcpy(v->shape, shape, sizeof(int) * (size_t)ndim);
    return v;
}

td_tensor *td_add_broadcast(td_ctx *c, td_tensor *x, td_tensor *p)
{
    td_tensor *out;

    if (p->n == 0 || x->n % p->n != 0)
        td_panic(TD_ESHAPE, "add_broadcast: %zu elements are not rows of %zu", x->n, p->n);
    out = td_tensor_new(c, x->ndim, x->shape, wants_grad(c, x, p, NULL));
    c->k->bias_forward(out->data, x->data, p->data, (int)(x->n / p->n), (int)p->n);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_ADD_BCAST, out, x, p, NULL);
    return out;
}

td_tensor *td_repeat(td_ctx *c, td_tensor *x, int B)
{
    int shape[TD_TENSOR_MAX_DIMS] = {B};
    td_tensor *out;

    if (x->ndim >= TD_TENSOR_MAX_DIMS || B < 1)
        td_panic(TD_ESHAPE, "repeat: %d copies of %d dimensions", B, x->ndim);
    memcpy(shape + 1, x->shape, sizeof(int) * (size_t)x->ndim);
    out = td_tensor_new(c, x->ndim + 1, shape, wants_grad(c, x, NULL, NULL));
    c->k->zero(out->data, out->n);
    c->k->bias_forward(out->data, out->data, x->data, B, (int)x->n);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_REPEAT, out, x, NULL, NULL)->arg[0] = B;
    return out;
}

td_tensor *td_token_mean(td_ctx *c, td_tensor *x)
{
    td_tensor *out;

    if (x->ndim != 3)
        td_panic(TD_ESHAPE, "token_mean: %d dimensions, (B,N,C) expected", x->ndim);
    out = td_tensor_new(c, 2, (int[]){x->shape[0], x->shape[2]}, wants_grad(c, x, NULL, NULL));
    c->k->token_mean_forward(out->data, x->data, x->shape[0], x->shape[1], x->shape[2]);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_TOKEN_MEAN, out, x, NULL, NULL);
    return out;
}

td_tensor *td_gather_rows(td_ctx *c, td_tensor *x, const int *idx)
{
    td_tensor *out;

    if (x->ndim != 3)
        td_panic(TD_ESHAPE, "gather_rows: %d dimensions, (B,T,C) expected", x->ndim);
    out = td_tensor_new(c, 2, (int[]){x->shape[0], x->shape[2]}, wants_grad(c, x, NULL, NULL));
    c->k->gather_rows_forward(out->data, x->data, idx, x->shape[0], x->shape[1], x->shape[2]);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_GATHER_ROWS, out, x, NULL, NULL)->ids = idx;
    return out;
}

td_tensor *td_l2norm(td_ctx *c, td_tensor *x)
{
    int N = rows_of(x);
    td_tensor *out = td_tensor_new(c, x->ndim, x->shape, wants_grad(c, x, NULL, NULL));
    td_tensor *norm = td_tensor_new(c, 1, (int[]){N}, 0);

    c->k->l2norm_forward(out->data, norm->data, x->data, N, x->shape[x->ndim - 1]);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_L2NORM, out, x, NULL, NULL)->saved[0] = norm;
    return out;
}

size_t td_op_bytes_l2norm(size_t rows, int C, int train)
{
    return td_tensor_bytes(rows * (size_t)C, train) + td_tensor_bytes(rows, 0);
}

td_tensor *td_siglip(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b, int diag, float weight)
{
    return td_siglip_masked(c, dots, t, b, NULL, diag, weight);
}

td_tensor *td_siglip_masked(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b,
                            const int *labels, int diag, float weight)
{
    return td_siglip_weighted(c, dots, t, b, labels, 0.0f, diag, weight);
}

td_tensor *td_siglip_weighted(td_ctx *c, td_tensor *dots, td_tensor *t, td_tensor *b,
                              const int *labels, float same, int diag, float weight)
{
    td_tensor *loss;

    if (dots->ndim != 2 || t->n != 1 || b->n != 1)
        td_panic(TD_ESHAPE, "siglip: dots of %d dimensions, scale of %zu, bias of %zu", dots->ndim,
                 t->n, b->n);
    if (labels != NULL && (diag < 0 || diag + dots->shape[0] > dots->shape[1]))
        td_panic(TD_ESHAPE, "siglip: rows [%d, %d) of %d labels", diag, diag + dots->shape[0],
                 dots->shape[1]);
    loss = td_tensor_new(c, 1, (int[]){1}, wants_grad(c, dots, t, b));
    c->k->siglip_forward(loss->data, dots->data, t->data, b->data, labels, same, dots->shape[0],
                         dots->shape[1], diag, weight);
    if (loss->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_SIGLIP, loss, dots, t, b);
        e->arg[0] = diag;
        memcpy(&e->arg[1], &weight, sizeof(weight));
        memcpy(&e->arg[2], &same, sizeof(same));
        e->ids = labels;
    }
    return loss;
}

size_t td_op_bytes_siglip(int train)
{
    return td_tensor_bytes(1, train);
}

/* Every replica's rows in one buffer: zeros, this replica's rows added at row0, then the sum
 * over replicas, which the all-reduce gives as an average. */
static void gather_sum(td_ctx *c, float *all, const float *mine, size_t n, size_t at, size_t total)
{
    c->k->zero(all, total);
    c->k->residual_backward(all + at, NULL, mine, n, 0);
    c->allreduce(c->allreduce_ud, all, total);
    c->k->scale(all, (float)c->world, total);
}

td_tensor *td_allgather_rows(td_ctx *c, td_tensor *x, int rows, int row0)
{
    int C = x->shape[x->ndim - 1], n = rows_of(x);
    td_tensor *out;

    if (c->allreduce == NULL || c->world < 2 || row0 < 0 || row0 + n > rows)
        td_panic(TD_ESHAPE, "allgather: rows [%d, %d) of %d on %d replicas", row0, row0 + n, rows,
                 c->world);
    out = td_tensor_new(c, 2, (int[]){rows, C}, wants_grad(c, x, NULL, NULL));
    gather_sum(c, out->data, x->data, x->n, (size_t)row0 * C, out->n);
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_ALLGATHER, out, x, NULL, NULL);
        e->arg[0] = row0;
        e->arg[1] = rows;
    }
    return out;
}

/* ---- ops: backward, one per op id --------------------------------------------------------- */

static float *grad_of(const td_tensor *t)
{
    return t != NULL ? t->grad : NULL;
}

/* The tensor whose gradient state t shares: a view's, or t's own. */
static td_tensor *owner(td_tensor *t)
{
    return t->base != NULL ? t->base : t;
}

/* Whether the op about to write t's gradient is its first writer, which then stores: t's
 * gradient is fresh (an activation's, never written since the forward). Marks it written. */
static int first_write(td_tensor *t)
{
    td_tensor *o;

    if (t == NULL || t->grad == NULL)
        return 0;
    o = owner(t);
    if (!o->fresh)
        return 0;
    o->fresh = 0;
    return 1;
}

/* For a writer that only adds (no store form, or it writes part of t): a fresh gradient is
 * zeroed now, by its first writer, rather than for every tensor at allocation. */
static void zero_if_fresh(td_ctx *c, td_tensor *t)
{
    if (first_write(t))
        c->k->zero(t->grad, t->n);
}

static void linear_backward(td_ctx *c, const td_tape_entry *e)
{
    td_tensor *inp = e->in[0], *w = e->in[1];
    int C = inp->shape[inp->ndim - 1];

    zero_if_fresh(c, w); /* an activation as the weight (sensorlm's dots = s u^T) adds */
    zero_if_fresh(c, e->in[2]);
    c->k->matmul_backward(grad_of(inp), grad_of(w), grad_of(e->in[2]), e->out->grad, inp->data,
                          w->data, rows_of(inp), C, w->shape[0], first_write(inp) ? TD_STORE_1 : 0);
}

static void relu_backward(td_ctx *c, const td_tape_entry *e)
{
    if (e->in[0]->grad != NULL)
        c->k->relu_backward(e->in[0]->grad, e->out->grad, e->out->data, e->out->n);
}

static void softmax_xent_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *logits = e->in[0];

    if (logits->grad != NULL && e->saved[0] != NULL) /* fused: the gradient is in place */
        c->k->softmax_xent_backward(logits->grad, e->out->grad, e->saved[0]->data, e->ids,
                                    rows_of(logits), e->arg[0], logits->shape[logits->ndim - 1]);
}

static void embed_backward(td_ctx *c, const td_tape_entry *e)
{
    c->k->encoder_backward(grad_of(e->in[0]), grad_of(e->in[1]), e->out->grad, e->ids, e->arg[0],
                           e->arg[1], e->in[0]->shape[1]);
}

static void layernorm_backward(td_ctx *c, const td_tape_entry *e)
{
    td_tensor *inp = e->in[0];

    zero_if_fresh(c, e->in[1]);
    zero_if_fresh(c, e->in[2]);
    c->k->layernorm_backward(grad_of(inp), grad_of(e->in[1]), grad_of(e->in[2]), e->out->grad,
                             inp->data, e->in[1]->data, e->saved[0]->data, e->saved[1]->data,
                             rows_of(inp), inp->shape[inp->ndim - 1],
                             first_write(inp) ? TD_STORE_1 : 0);
}

static void gelu_backward(td_ctx *c, const td_tape_entry *e)
{
    td_tensor *x = e->in[0];

    if (x->grad != NULL)
        c->k->gelu_backward(x->grad, x->data, e->out->grad, e->out->n,
                            first_write(x) ? TD_STORE_1 : 0);
}

/* A fresh first input takes the output's gradient as its own (nothing reads that buffer after
 * this op: the output's consumers ran before, its producer is this op), unless views share its
 * gradient; a fresh second one stores a copy. The same tensor twice adds twice. */
static void residual_backward(td_ctx *c, const td_tape_entry *e)
{
    td_tensor *a = e->in[0], *b = e->in[1];
    float *da = grad_of(a);
    int store = 0;

    if (a->grad != NULL && b->grad != NULL && owner(a) == owner(b)) {
        zero_if_fresh(c, a);
    } else {
        if (first_write(a)) {
            if (a->base == NULL && !a->viewed) {
                a->grad = e->out->grad;
                da = NULL;
            } else {
                store |= TD_STORE_1;
            }
        }
        store |= first_write(b) ? TD_STORE_2 : 0;
    }
    if (da != NULL || b->grad != NULL)
        c->k->residual_backward(da, grad_of(b), e->out->grad, e->out->n, store);
}

/* The backward's transient block comes from the arena's top and goes back when the kernel is
 * done, so every attention backward of a step reuses the same bytes. */
static void attention_backward(td_ctx *c, const td_tape_entry *e)
{
    int packed = e->arg[3];
    td_attn_dims d = attn_dims(e->in, packed, e->arg[0], e->arg[2], e->arg[1]);
    size_t mark = c->arena->used;
    float *p[3], *g[3], *scratch;
    int store = 0;

    attn_ptrs(p, e->in, packed, 0);
    attn_ptrs(g, e->in, packed, 1);
    if (g[0] == NULL && g[1] == NULL && g[2] == NULL)
        return;
    if (packed) { /* q, k and v's gradients are the thirds of one tensor, all written */
        store = first_write(e->in[0]) ? TD_STORE_1 | TD_STORE_2 | TD_STORE_3 : 0;
    } else if ((g[0] != NULL && (g[0] == g[1] || g[0] == g[2])) ||
               (g[1] != NULL && g[1] == g[2])) { /* one tensor in two roles */
        for (int i = 0; i < 3; i++)
            zero_if_fresh(c, e->in[i]);
    } else {
        for (int i = 0; i < 3; i++)
            store |= first_write(e->in[i]) ? TD_STORE_1 << i : 0;
    }
    scratch = td_arena_alloc(c->arena, td_attn_scratch(&d, 1) * sizeof(float));
    c->k->attention_backward(g[0], g[1], g[2], scratch, e->out->grad, p[0], p[1], p[2],
                             e->out->data, e->saved[0]->data, &d, store);
    c->arena->used = mark;
}

static void add_broadcast_backward(td_ctx *c, const td_tape_entry *e)
{
    size_t n = e->in[1]->n;

    c->k->bias_backward(grad_of(e->in[0]), grad_of(e->in[1]), e->out->grad, (int)(e->out->n / n),
                        (int)n);
}

static void repeat_backward(td_ctx *c, const td_tape_entry *e)
{
    if (e->in[0]->grad != NULL)
        c->k->bias_backward(NULL, e->in[0]->grad, e->out->grad, e->arg[0], (int)e->in[0]->n);
}

static void token_mean_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *x = e->in[0];

    if (x->grad != NULL)
        c->k->token_mean_backward(x->grad, e->out->grad, x->shape[0], x->shape[1], x->shape[2]);
}

static void gather_rows_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *x = e->in[0];

    if (x->grad != NULL)
        c->k->gather_rows_backward(x->grad, e->out->grad, e->ids, x->shape[0], x->shape[1],
                                   x->shape[2]);
}

static void l2norm_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *x = e->in[0];

    if (x->grad != NULL)
        c->k->l2norm_backward(x->grad, e->out->grad, e->out->data, e->saved[0]->data, rows_of(x),
                              x->shape[x->ndim - 1]);
}

static void siglip_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *dots = e->in[0];
    float weight, same;

    memcpy(&weight, &e->arg[1], sizeof(weight));
    memcpy(&same, &e->arg[2], sizeof(same));
    c->k->siglip_backward(grad_of(dots), grad_of(e->in[1]), grad_of(e->in[2]), e->out->grad,
                          dots->data, e->in[1]->data, e->in[2]->data, e->ids, same, dots->shape[0],
                          dots->shape[1], e->arg[0], weight);
}

/* The gathered gradient, summed over replicas in place (every replica's loss reaches every
 * row), then this replica's rows of it into x's gradient. */
static void allgather_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *x = e->in[0];
    size_t at = (size_t)e->arg[0] * (size_t)x->shape[x->ndim - 1];

    c->allreduce(c->allreduce_ud, e->out->grad, e->out->n);
    c->k->scale(e->out->grad, (float)c->world, e->out->n);
    if (x->grad != NULL)
        c->k->residual_backward(x->grad, NULL, e->out->grad + at, x->n,
                                first_write(e->in[0]) ? TD_STORE_1 : 0);
}

typedef void (*backward_fn)(td_ctx *c, const td_tape_entry *e);

static const backward_fn backward_of[TD_OP_COUNT] = {
    [TD_OP_LINEAR] = linear_backward,
    [TD_OP_RELU] = relu_backward,
    [TD_OP_SOFTMAX_XENT] = softmax_xent_backward,
    [TD_OP_EMBED] = embed_backward,
    [TD_OP_LAYERNORM] = layernorm_backward,
    [TD_OP_GELU] = gelu_backward,
    [TD_OP_RESIDUAL] = residual_backward,
    [TD_OP_ATTENTION] = attention_backward,
    [TD_OP_ADD_BCAST] = add_broadcast_backward,
    [TD_OP_REPEAT] = repeat_backward,
    [TD_OP_TOKEN_MEAN] = token_mean_backward,
    [TD_OP_GATHER_ROWS] = gather_rows_backward,
    [TD_OP_L2NORM] = l2norm_backward,
    [TD_OP_SIGLIP] = siglip_backward,
    [TD_OP_ALLGATHER] = allgather_backward,
};

/* The ops whose backward stores its first writes (the rest add, into zeroed gradients). */
static const unsigned char stores[TD_OP_COUNT] = {
    [TD_OP_LINEAR] = 1,   [TD_OP_LAYERNORM] = 1, [TD_OP_GELU] = 1,
    [TD_OP_RESIDUAL] = 1, [TD_OP_ATTENTION] = 1, [TD_OP_ALLGATHER] = 1,
};

void td_backward(td_ctx *c, td_tensor *loss)
{
    if (c->tape == NULL || loss->grad == NULL)
        td_panic(TD_ESTATE, "backward without a recorded forward");
    static const float one = 1.0f; /* never changes, so an asynchronous upload may read it late */

    c->k->upload_async(loss->grad, &one, sizeof(one));
    owner(loss)->fresh = 0;
    for (int i = c->tape->len - 1; i >= 0; i--) {
        const td_tape_entry *e = &c->tape->entries[i];
        if (owner(e->out)->fresh) { /* no consumer wrote its gradient: zero */
            if (e->op != TD_OP_ALLGATHER)
                continue;
            zero_if_fresh(c, e->out); /* a collective: every replica joins */
        }
        if (!stores[e->op])
            for (int j = 0; j < 3; j++)
                if (e->in[j] != NULL)
                    zero_if_fresh(c, e->in[j]);
        backward_of[e->op](c, e);
    }
    td_tape_reset(c->tape);
}
