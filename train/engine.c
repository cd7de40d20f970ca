/* The engine's machinery (engine.h): the activation arena, the flat parameter buffers, the
 * tape, the ops that record on it and td_backward() that replays it. Ops compute through the
 * backend table in their td_ctx and never call a kernel directly. Used by the one thread that
 * owns the trainer; ops may panic, so they run under the worker's boundary. */
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "td_panic.h"

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
        c->k->zero(t->grad, n);
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

td_tensor *td_linear(td_ctx *c, td_tensor *inp, td_tensor *w, td_tensor *b)
{
    int C = inp->shape[inp->ndim - 1];
    int OC = w->shape[0];
    int N = rows_of(inp);
    int shape[TD_TENSOR_MAX_DIMS];
    td_tensor *out;

    if (w->ndim != 2 || w->shape[1] != C)
        td_panic(TD_ESHAPE, "linear: input has %d features, weight is (%d,%d)", C, w->shape[0],
                 w->ndim == 2 ? w->shape[1] : -1);
    if (b != NULL && (int)b->n != OC)
        td_panic(TD_ESHAPE, "linear: bias has %zu elements, weight has %d outputs", b->n, OC);
    memcpy(shape, inp->shape, sizeof(shape));
    shape[inp->ndim - 1] = OC;
    out = td_tensor_new(c, inp->ndim, shape, wants_grad(c, inp, w, b));
    c->k->matmul_forward(out->data, inp->data, w->data, b != NULL ? b->data : NULL, N, C, OC);
    if (out->grad != NULL)
        tape_push(c->tape, TD_OP_LINEAR, out, inp, w, b);
    return out;
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
    probs = td_tensor_new(c, logits->ndim, logits->shape, 0);
    loss = td_tensor_new(c, 1, (int[]){1}, wants_grad(c, logits, NULL, NULL));
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
    return td_tensor_bytes(rows * (size_t)Vp, 0) + td_tensor_bytes(1, train);
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

td_tensor *td_attention(td_ctx *c, td_tensor *qkv, int NH)
{
    int B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
    td_tensor *out, *att;

    if (qkv->ndim != 3 || qkv->shape[2] % 3 != 0 || NH < 1 || C % NH != 0)
        td_panic(TD_ESHAPE, "attention: qkv of %d dimensions, last %d, %d heads", qkv->ndim,
                 qkv->shape[qkv->ndim - 1], NH);
    out = td_tensor_new(c, 3, (int[]){B, T, C}, wants_grad(c, qkv, NULL, NULL));
    att = td_tensor_new(c, 4, (int[]){B, NH, T, T}, 0);
    c->k->attention_forward(out->data, att->data, qkv->data, B, T, C, NH);
    if (out->grad != NULL) {
        td_tape_entry *e = tape_push(c->tape, TD_OP_ATTENTION, out, qkv, NULL, NULL);
        e->saved[0] = att;
        e->arg[0] = NH;
    }
    return out;
}

size_t td_op_bytes_attention(int B, int T, int C, int NH, int train)
{
    return td_tensor_bytes((size_t)B * T * C, train) + td_tensor_bytes((size_t)B * NH * T * T, 0);
}

size_t td_op_bytes_attention_backward(int T)
{
    return td_arena_round((size_t)T * T * sizeof(float));
}

/* ---- ops: backward, one per op id --------------------------------------------------------- */

static float *grad_of(const td_tensor *t)
{
    return t != NULL ? t->grad : NULL;
}

static void linear_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *inp = e->in[0], *w = e->in[1];
    int C = inp->shape[inp->ndim - 1];

    c->k->matmul_backward(grad_of(inp), grad_of(w), grad_of(e->in[2]), e->out->grad, inp->data,
                          w->data, rows_of(inp), C, w->shape[0]);
}

static void relu_backward(td_ctx *c, const td_tape_entry *e)
{
    if (e->in[0]->grad != NULL)
        c->k->relu_backward(e->in[0]->grad, e->out->grad, e->out->data, e->out->n);
}

static void softmax_xent_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *logits = e->in[0];

    if (logits->grad != NULL)
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
    const td_tensor *inp = e->in[0];

    c->k->layernorm_backward(grad_of(inp), grad_of(e->in[1]), grad_of(e->in[2]), e->out->grad,
                             inp->data, e->in[1]->data, e->saved[0]->data, e->saved[1]->data,
                             rows_of(inp), inp->shape[inp->ndim - 1]);
}

static void gelu_backward(td_ctx *c, const td_tape_entry *e)
{
    if (e->in[0]->grad != NULL)
        c->k->gelu_backward(e->in[0]->grad, e->in[0]->data, e->out->grad, e->out->n);
}

static void residual_backward(td_ctx *c, const td_tape_entry *e)
{
    c->k->residual_backward(grad_of(e->in[0]), grad_of(e->in[1]), e->out->grad, e->out->n);
}

/* The (T,T) scratch comes from the arena's top and goes back when the kernel is done, so
 * every attention backward of a step reuses the same bytes. */
static void attention_backward(td_ctx *c, const td_tape_entry *e)
{
    const td_tensor *qkv = e->in[0];
    int B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
    size_t mark = c->arena->used;
    float *scratch;

    if (qkv->grad == NULL)
        return;
    scratch = td_arena_alloc(c->arena, (size_t)T * T * sizeof(float));
    c->k->attention_backward(qkv->grad, scratch, e->out->grad, qkv->data, e->saved[0]->data, B, T,
                             C, e->arg[0]);
    c->arena->used = mark;
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
};

void td_backward(td_ctx *c, td_tensor *loss)
{
    if (c->tape == NULL || loss->grad == NULL)
        td_panic(TD_ESTATE, "backward without a recorded forward");
    c->k->upload(loss->grad, &(float){1.0f}, sizeof(float));
    for (int i = c->tape->len - 1; i >= 0; i--) {
        const td_tape_entry *e = &c->tape->entries[i];
        backward_of[e->op](c, e);
    }
    td_tape_reset(c->tape);
}
