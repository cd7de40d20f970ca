/* GPT-2 as llm.c's train_gpt2.c has it, written as a forward pass over the engine's ops (its
 * backward is what the ops record on the tape): its parameter layout (llm.c's 16 tensors in
 * llm.c's order, in the trainer's td_params), llm.c's initialisation, the forward, and the
 * model's own count of the arena bytes and tape entries a step takes. Used by the thread that
 * owns the trainer. */
#include <math.h>
#include <string.h>

#include "train/engine.h"

#define INIT_STD 0.02 /* llm.c's (and GPT-2's) initial weight standard deviation */

#define DIM_MAX_T  (1 << 20) /* positions */
#define DIM_MAX_V  (1 << 24) /* tokens in a vocabulary */
#define DIM_MAX_C  (1 << 16) /* channels */
#define DIM_MAX_NH (1 << 12) /* heads */

int td_gpt_padded_vocab(int V)
{
    return (V + TD_GPT_VP_ALIGN - 1) / TD_GPT_VP_ALIGN * TD_GPT_VP_ALIGN;
}

/* The shape of tensor i: its stacked (L, ...) form. */
static int shape_of(const td_gpt_dims *d, int i, int *shape)
{
    int C = d->C, L = d->L;

    switch (i) {
    case TD_GPT_WTE:
        shape[0] = d->Vp, shape[1] = C;
        return 2;
    case TD_GPT_WPE:
        shape[0] = d->maxT, shape[1] = C;
        return 2;
    case TD_GPT_QKVW:
        shape[0] = L, shape[1] = 3 * C, shape[2] = C;
        return 3;
    case TD_GPT_QKVB:
        shape[0] = L, shape[1] = 3 * C;
        return 2;
    case TD_GPT_ATTPROJW:
        shape[0] = L, shape[1] = C, shape[2] = C;
        return 3;
    case TD_GPT_FCW:
        shape[0] = L, shape[1] = 4 * C, shape[2] = C;
        return 3;
    case TD_GPT_FCB:
        shape[0] = L, shape[1] = 4 * C;
        return 2;
    case TD_GPT_FCPROJW:
        shape[0] = L, shape[1] = C, shape[2] = 4 * C;
        return 3;
    case TD_GPT_LNFW:
    case TD_GPT_LNFB:
        shape[0] = C;
        return 1;
    default: /* ln1w, ln1b, attprojb, ln2w, ln2b, fcprojb */
        shape[0] = L, shape[1] = C;
        return 2;
    }
}

size_t td_gpt_num_params(const td_gpt_dims *d)
{
    size_t n = 0;

    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        int shape[TD_TENSOR_MAX_DIMS], nd = shape_of(d, i, shape);
        size_t k = 1;
        for (int j = 0; j < nd; j++)
            k *= (size_t)shape[j];
        n += k;
    }
    return n;
}

/* The dimensions, each against the engine's limits, so no product below overflows. */
int td_gpt_check_dims(const td_gpt_dims *d, td_error_t *err)
{
    if (d->L < 1 || d->L > TD_GPT_MAX_LAYERS)
        return td_error_set(err, TD_EINVAL, "model.n_layer: %d, must be 1 to %d", d->L,
                            TD_GPT_MAX_LAYERS);
    if (d->NH < 1 || d->NH > DIM_MAX_NH)
        return td_error_set(err, TD_EINVAL, "model.n_head: %d, must be 1 to %d", d->NH, DIM_MAX_NH);
    if (d->C < 1 || d->C > DIM_MAX_C || d->C % d->NH != 0)
        return td_error_set(err, TD_EINVAL,
                            "model.n_embd: %d, must be 1 to %d and a multiple of n_head %d", d->C,
                            DIM_MAX_C, d->NH);
    if (d->maxT < 1 || d->maxT > DIM_MAX_T)
        return td_error_set(err, TD_EINVAL, "model.seq_len: %d, must be 1 to %d", d->maxT,
                            DIM_MAX_T);
    if (d->V < 1 || d->V > DIM_MAX_V || d->Vp < d->V || d->Vp > DIM_MAX_V + TD_GPT_VP_ALIGN * 2)
        return td_error_set(err, TD_EINVAL, "model.vocab_size: %d (padded %d), must be 1 to %d",
                            d->V, d->Vp, DIM_MAX_V);
    return 0;
}

int td_gpt_declare(td_gpt *m, td_params *p, const td_gpt_dims *d, td_error_t *err)
{
    int rc = td_gpt_check_dims(d, err);

    if (rc != 0)
        return rc;
    memset(m, 0, sizeof(*m));
    m->d = *d;
    for (int i = 0; i < TD_GPT_TENSORS && rc == 0; i++) {
        int shape[TD_TENSOR_MAX_DIMS], nd = shape_of(d, i, shape);
        rc = td_params_declare(p, &m->p[i], nd, shape);
        if (rc == 0)
            p->decay[p->count - 1] = i == TD_GPT_WTE || i == TD_GPT_WPE || i == TD_GPT_QKVW ||
                                     i == TD_GPT_ATTPROJW || i == TD_GPT_FCW || i == TD_GPT_FCPROJW;
    }
    if (rc != 0)
        return td_error_set(err, rc, "model: %d parameter tensors do not fit in td_params",
                            TD_GPT_TENSORS);
    return 0;
}

void td_gpt_bind(td_gpt *m)
{
    for (int l = 0; l < m->d.L; l++)
        for (int i = 0; i < TD_GPT_LAYER_T; i++) {
            td_tensor *s = &m->p[TD_GPT_LN1W + i], *v = &m->layer[l][i];
            size_t n = s->n / (size_t)m->d.L;
            memset(v, 0, sizeof(*v));
            v->ndim = s->ndim - 1;
            memcpy(v->shape, s->shape + 1, sizeof(int) * (size_t)v->ndim);
            v->n = n;
            v->data = s->data + (size_t)l * n;
            v->grad = s->grad != NULL ? s->grad + (size_t)l * n : NULL;
        }
}

/* One N(0, std) draw: Box-Muller on two uniforms of 53 bits, in double. */
static float normal(td_rng *r, double std)
{
    double u1 = ((double)(td_rng_next(r) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
    double u2 = (double)(td_rng_next(r) >> 11) * 0x1p-53;
    return (float)(std * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

static void fill_normal(td_rng *r, float *p, size_t n, double std)
{
    for (size_t i = 0; i < n; i++)
        p[i] = normal(r, std);
}

/* llm.c's gpt2_build_from_random order: layer by layer, and within a layer tensor by tensor
 * (wte, wpe at layer 0 only; LayerNorm weights, all layers at once, at layer 0). */
void td_gpt_init(td_gpt *m, uint64_t seed)
{
    const td_gpt_dims *d = &m->d;
    double resid_std = INIT_STD / sqrt(2.0 * d->L);
    td_rng rng;

    td_rng_seed(&rng, seed, 1);
    for (int i = 0; i < TD_GPT_TENSORS; i++)
        memset(m->p[i].data, 0, m->p[i].n * sizeof(float));
    for (int l = 0; l < d->L; l++)
        for (int i = 0; i < TD_GPT_TENSORS; i++) {
            td_tensor *t = &m->p[i];
            size_t per = t->n / (size_t)d->L;
            if (l == 0 && (i == TD_GPT_LN1W || i == TD_GPT_LN2W || i == TD_GPT_LNFW))
                for (size_t j = 0; j < t->n; j++)
                    t->data[j] = 1.0f;
            if (l == 0 && i == TD_GPT_WTE)
                fill_normal(&rng, t->data, (size_t)d->V * d->C, INIT_STD);
            if (l == 0 && i == TD_GPT_WPE)
                fill_normal(&rng, t->data, t->n, INIT_STD);
            if (i == TD_GPT_QKVW || i == TD_GPT_FCW)
                fill_normal(&rng, t->data + (size_t)l * per, per, INIT_STD);
            if (i == TD_GPT_ATTPROJW || i == TD_GPT_FCPROJW)
                fill_normal(&rng, t->data + (size_t)l * per, per, resid_std);
        }
}

/* Block l of the residual stream x (B,T,C), h = ln1(x) given:
 * x + attproj(attention(qkv(h))), then + fcproj(gelu(fc(ln2(.)))) into *x, and returned the
 * layernorm after it (the next block's ln1, or lnf after the last): each residual and the
 * layernorm that reads it in one op (td_residual_layernorm) */
static td_tensor *block(td_ctx *c, td_gpt *m, int l, td_tensor **x, td_tensor *h)
{
    td_tensor *w = m->layer[l];
    td_tensor *x2, *nw, *nb;

    if (l + 1 < m->d.L) {
        nw = &m->layer[l + 1][TD_GPT_LN1W - 2];
        nb = &m->layer[l + 1][TD_GPT_LN1B - 2];
    } else {
        nw = &m->p[TD_GPT_LNFW];
        nb = &m->p[TD_GPT_LNFB];
    }
    h = td_linear(c, h, &w[TD_GPT_QKVW - 2], &w[TD_GPT_QKVB - 2]); /* (B,T,3C) */
    h = td_attention_chunk(c, h, m->d.NH, m->attn_chunk);          /* (B,T,C) */
    h = td_linear(c, h, &w[TD_GPT_ATTPROJW - 2], &w[TD_GPT_ATTPROJB - 2]);
    h = td_residual_layernorm(c, *x, h, &w[TD_GPT_LN2W - 2], &w[TD_GPT_LN2B - 2], &x2);
    h = td_linear(c, h, &w[TD_GPT_FCW - 2], &w[TD_GPT_FCB - 2]); /* (B,T,4C) */
    h = td_gelu(c, h);
    h = td_linear(c, h, &w[TD_GPT_FCPROJW - 2], &w[TD_GPT_FCPROJB - 2]); /* (B,T,C) */
    return td_residual_layernorm(c, x2, h, nw, nb, x);
}

td_tensor *td_gpt_forward(td_ctx *c, td_gpt *m, const int *tokens, const int *targets, int B, int T,
                          td_tensor **logits)
{
    td_tensor *x = td_embed(c, tokens, B, T, &m->p[TD_GPT_WTE], &m->p[TD_GPT_WPE]); /* (B,T,C) */
    td_tensor *h;

    /* ln1 of the first block; each block returns the next one's (lnf after the last) */
    h = m->d.L > 0
            ? td_layernorm(c, x, &m->layer[0][TD_GPT_LN1W - 2], &m->layer[0][TD_GPT_LN1B - 2])
            : td_layernorm(c, x, &m->p[TD_GPT_LNFW], &m->p[TD_GPT_LNFB]);
    for (int l = 0; l < m->d.L; l++)
        h = block(c, m, l, &x, h);
    /* The fused classifier overwrites the logits with their gradient in training, so their
     * gradient needs no buffer of its own; a caller that asked for them (or for no loss) gets
     * logits of their own and the unfused op (td_gpt_arena_bytes counts the fused one). */
    if (logits == NULL && targets != NULL)
        return td_softmax_xent_fused(c, td_linear_logits(c, h, &m->p[TD_GPT_WTE], NULL), targets,
                                     m->d.V);
    h = td_linear(c, h, &m->p[TD_GPT_WTE], NULL); /* (B,T,Vp) */
    if (logits != NULL)
        *logits = h;
    if (targets == NULL)
        return NULL;
    return td_softmax_xent_padded(c, h, targets, m->d.V);
}

/* Mirrors td_gpt_forward's allocations one for one, and the transient blocks on the arena's
 * top: each attention's forward block (given back at once; the last layer's, on top of the
 * most, counts) and, training, the attention backward's, on top of everything the forward
 * took. The larger of the two ends is the peak. */
size_t td_gpt_arena_bytes(const td_gpt *m, int B, int T, int train)
{
    const td_gpt_dims *d = &m->d;
    size_t BT = (size_t)B * T, C = (size_t)d->C, bytes = 0, peak = 0;

    bytes += td_tensor_bytes(BT * C, train); /* embedding */
    for (int l = 0; l < d->L; l++) {
        bytes += td_op_bytes_layernorm(BT, d->C, train);
        bytes += td_tensor_bytes(BT * 3 * C, train); /* qkv */
        bytes += td_op_bytes_attention(B, T, d->C, d->NH, train);
        peak = bytes + td_op_bytes_attention_scratch(B, d->NH, T, T, m->attn_chunk, 0);
        bytes += td_tensor_bytes(BT * C, train); /* attproj */
        bytes += td_tensor_bytes(BT * C, train); /* residual */
        bytes += td_op_bytes_layernorm(BT, d->C, train);
        bytes += 2 * td_tensor_bytes(BT * 4 * C, train); /* fc, gelu */
        bytes += 2 * td_tensor_bytes(BT * C, train);     /* fcproj, residual */
    }
    bytes += td_op_bytes_layernorm(BT, d->C, train);
    bytes += td_tensor_bytes(BT * (size_t)d->Vp, 0); /* logits: their gradient in place */
    bytes += td_op_bytes_softmax_xent_fused(train);  /* no probs buffer */
    if (train)
        bytes += td_op_bytes_attention_scratch(B, d->NH, T, T, m->attn_chunk, 1);
    return bytes > peak ? bytes : peak;
}

int td_gpt_tape_len(const td_gpt *m)
{
    return 1 + 10 * m->d.L + 3;
}
