/* Unit tests of the fused attention through the engine (train/engine.c's td_attention,
 * td_attention_chunk, td_attention_qkv and train/gpt.c): the ops' tape gradients against
 * central differences of a loss through them (causal and not, llm.c's packed qkv and separate
 * q, k, v, cross-attention with fewer queries than keys), the automatic chunk, the arena's
 * exact accounting of what the ops keep and of their transient blocks, and the GPT with the
 * fused attention against the GPT with the attention it replaced (the (B,NH,T,T) one of
 * kernels/cpu.c before issue 13, kept below as the reference), loss and every gradient, at
 * several chunks. Each numerical check states its tolerance and why. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <cmocka.h>

#include "train/engine.h"
#include "common/td_panic.h"

/* ---- the attention this op replaced ----------------------------------------------------------
 *
 * kernels/cpu.c's causal attention before issue 13, as it was: per (b,h), rows in blocks of 64,
 * preatt = q k^T / sqrt(hs) by sgemm up to each block's diagonal, a causal softmax by row,
 * out = att v; the (B,NH,T,T) att kept for the backward. Here behind the fused op's interface
 * (llm.c's packed layout only): the forward keeps att in old_att, found again by the qkv
 * address in the backward, and writes no lse. */

#define OLD_BLOCK   64
#define EXP_LO      -87.3f
#define EXP_HI      88.3f
#define ROUND_MAGIC 12582912.0f
#define OLD_LAYERS  8 /* attention ops of one forward the reference keeps att for */

static float fexp(float x)
{
    float n, r, z, p, two_n;
    int32_t bits;

    x = x > EXP_HI ? EXP_HI : x;
    x = x < EXP_LO ? EXP_LO : x;
    n = (x * 1.44269504088896341f + ROUND_MAGIC) - ROUND_MAGIC;
    r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    z = r * r;
    p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
          4.1665795894e-2f) *
             r +
         1.6666665459e-1f) *
            r +
        5.0000001201e-1f;
    p = p * z + r + 1.0f;
    bits = ((int32_t)(n == n ? n : 0.0f) + 127) << 23;
    memcpy(&two_n, &bits, sizeof(two_n));
    return p * two_n;
}

static float sum8(const float *x, int n)
{
    float acc[8] = {0};
    int j = 0;

    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += x[j + l];
    for (; j < n; j++)
        acc[j & 7] += x[j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static float dot8(const float *a, const float *b, int n)
{
    float acc[8] = {0};
    int j = 0;

    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += a[j + l] * b[j + l];
    for (; j < n; j++)
        acc[j & 7] += a[j] * b[j];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static void causal_softmax_row(float *a, int t, int T)
{
    float maxv = a[0], sum, inv;

    for (int j = 1; j <= t; j++)
        maxv = a[j] > maxv ? a[j] : maxv;
    for (int j = 0; j <= t; j++)
        a[j] = fexp(a[j] - maxv);
    sum = sum8(a, t + 1);
    inv = 1.0f / sum;
    for (int j = 0; j <= t; j++)
        a[j] *= inv;
    for (int j = t + 1; j < T; j++)
        a[j] = 0.0f;
}

static void causal_softmax_row_backward(float *d, const float *a, float scale, int t, int T)
{
    float s = dot8(a, d, t + 1);

    for (int j = 0; j <= t; j++)
        d[j] = scale * (a[j] * (d[j] - s));
    for (int j = t + 1; j < T; j++)
        d[j] = 0.0f;
}

static void old_head_forward(float *out, float *att, const float *q, const float *k, const float *v,
                             int T, int C, int hs)
{
    int C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);

    for (int r0 = 0; r0 < T; r0 += OLD_BLOCK) {
        int rows = T - r0 < OLD_BLOCK ? T - r0 : OLD_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, scale,
                    q + (size_t)r0 * C3, C3, k, C3, 0.0f, att + (size_t)r0 * T, T);
        for (int t = r0; t < cols; t++)
            causal_softmax_row(att + (size_t)t * T, t, T);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f,
                    att + (size_t)r0 * T, T, v, C3, 0.0f, out + (size_t)r0 * C, C);
    }
}

static void old_head_backward(float *dq, float *dk, float *dv, float *d, const float *dout,
                              const float *q, const float *k, const float *v, const float *att,
                              int T, int C, int hs)
{
    int C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);

    for (int r0 = 0; r0 < T; r0 += OLD_BLOCK) {
        int rows = T - r0 < OLD_BLOCK ? T - r0 : OLD_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, 1.0f,
                    dout + (size_t)r0 * C, C, v, C3, 0.0f, d + (size_t)r0 * T, T);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, hs, T - r0, 1.0f,
                    att + (size_t)r0 * T + r0, T, dout + (size_t)r0 * C, C, 1.0f,
                    dv + (size_t)r0 * C3, C3);
        for (int t = r0; t < cols; t++)
            causal_softmax_row_backward(d + (size_t)t * T, att + (size_t)t * T, scale, t, T);
    }
    for (int r0 = 0; r0 < T; r0 += OLD_BLOCK) {
        int rows = T - r0 < OLD_BLOCK ? T - r0 : OLD_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f,
                    d + (size_t)r0 * T, T, k, C3, 1.0f, dq + (size_t)r0 * C3, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, hs, T - r0, 1.0f,
                    d + (size_t)r0 * T + r0, T, q + (size_t)r0 * C3, C3, 1.0f, dk + (size_t)r0 * C3,
                    C3);
    }
}

static struct {
    const float *qkv;
    float *att;
} old_att[OLD_LAYERS];

static float *old_att_of(const float *qkv, size_t n)
{
    for (int i = 0; i < OLD_LAYERS; i++) {
        if (old_att[i].qkv == qkv)
            return old_att[i].att;
        if (old_att[i].qkv == NULL) {
            old_att[i].qkv = qkv;
            old_att[i].att = malloc(n * sizeof(float));
            assert_non_null(old_att[i].att);
            return old_att[i].att;
        }
    }
    fail_msg("more than %d attention ops in one forward", OLD_LAYERS);
    return NULL;
}

static void old_att_free(void)
{
    for (int i = 0; i < OLD_LAYERS; i++)
        free(old_att[i].att);
    memset(old_att, 0, sizeof(old_att));
}

static void old_forward(float *out, float *lse, float *scratch, const float *q, const float *k,
                        const float *v, const td_attn_dims *d)
{
    int T = d->Nq, C = d->NH * d->hs;
    float *att = old_att_of(q, (size_t)d->B * d->NH * T * T);

    assert_true(d->causal && d->ldq == 3 * C && k == q + C && v == q + 2 * C);
    for (int b = 0; b < d->B; b++)
        for (int h = 0; h < d->NH; h++) {
            const float *qh = q + (size_t)b * T * 3 * C + (size_t)h * d->hs;
            old_head_forward(out + (size_t)b * T * C + (size_t)h * d->hs,
                             att + ((size_t)b * d->NH + h) * T * T, qh, qh + C, qh + 2 * C, T, C,
                             d->hs);
        }
}

static void old_backward(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                         const float *q, const float *k, const float *v, const float *out,
                         const float *lse, const td_attn_dims *d, int store)
{
    int T = d->Nq, C = d->NH * d->hs;
    float *att = old_att_of(q, (size_t)d->B * d->NH * T * T);
    float *tt = malloc((size_t)T * T * sizeof(float));
    float *g[3] = {dq, dk, dv};

    assert_non_null(tt);
    for (int a = 0; a < 3; a++) /* a stored gradient: its columns of every row zeroed first */
        if (store & (TD_STORE_1 << a))
            for (size_t r = 0; r < (size_t)d->B * T; r++)
                memset(g[a] + r * 3 * C, 0, (size_t)C * sizeof(float));
    for (int b = 0; b < d->B; b++)
        for (int h = 0; h < d->NH; h++) {
            size_t off = (size_t)b * T * 3 * C + (size_t)h * d->hs;
            old_head_backward(dq + off, dk + off, dv + off, tt,
                              dout + (size_t)b * T * C + (size_t)h * d->hs, q + off, q + off + C,
                              q + off + 2 * C, att + ((size_t)b * d->NH + h) * T * T, T, C, d->hs);
        }
    free(tt);
}

/* ---- a GPT on both attentions --------------------------------------------------------------- */

typedef struct gpt_run {
    double loss;
    float *grad; /* p.n floats */
} gpt_run;

/* One forward and backward of m on tokens (B,T) through table k, chunk as given. */
static gpt_run gpt_step(td_gpt *m, td_params *p, const td_kernels *k, int chunk, const int *tok,
                        const int *tgt, int B, int T)
{
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = k, .arena = &arena, .tape = &tape};
    td_boundary b;
    gpt_run r = {0};

    m->attn_chunk = chunk;
    assert_int_equal(td_arena_init(&arena, td_gpt_arena_bytes(m, B, T, 1)), 0);
    assert_int_equal(td_tape_init(&tape, td_gpt_tape_len(m)), 0);
    memset(p->grad, 0, p->n * sizeof(float));
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *loss = td_gpt_forward(&c, m, tok, tgt, B, T, NULL);
        r.loss = loss->data[0];
        td_backward(&c, loss);
        if (k == td_kernels_cpu())
            assert_int_equal(arena.peak, td_gpt_arena_bytes(m, B, T, 1));
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    r.grad = malloc(p->n * sizeof(float));
    assert_non_null(r.grad);
    memcpy(r.grad, p->grad, p->n * sizeof(float));
    td_tape_free(&tape);
    td_arena_free(&arena);
    old_att_free();
    return r;
}

/* A GPT (L=2, C=32, NH=4, T=130: three 64-row blocks, the last of 2 rows; B=3, V=50), with
 * weights drawn wider than llm.c's (U(-0.3, 0.3)) so attention is far from uniform, trained
 * one step through the fused attention at the automatic chunk (all 130 rows), 64, 37 (which
 * does not divide T) and 1, and through the replaced attention. Tolerance: the loss within
 * 1e-6 relative and every gradient within 1e-5 of the largest gradient of its tensor (plus
 * 1e-9): the two attentions compute the same function with float sums in other orders (the
 * softmax from the log-sum-exp in the backward, D from out), so they differ by float
 * rounding, ~1e-7 relative, carried through two layers; a wrong row, mask or term is off by
 * 1e-2 or more. At chunks that are multiples of 64 the forward is the replaced one's sgemm for
 * sgemm, so the loss is bit-identical there. */
static void test_gpt_against_replaced_attention(void **state)
{
    td_gpt_dims d = {.maxT = 130, .V = 50, .Vp = 64, .L = 2, .NH = 4, .C = 32};
    const int B = 3, T = 130, chunks[] = {0, 64, 37, 1};
    td_kernels old = *td_kernels_cpu();
    td_params p = {0};
    td_gpt *m = calloc(1, sizeof(*m));
    td_error_t err = {0};
    int *tok = malloc(B * T * sizeof(int)), *tgt = malloc(B * T * sizeof(int));
    gpt_run ref;
    td_rng rng;

    old.attention_forward = old_forward;
    old.attention_backward = old_backward;
    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 7);
    td_rng_seed(&rng, 11, 0);
    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        td_tensor *t = &m->p[i];
        int ln = i == TD_GPT_LN1W || i == TD_GPT_LN2W || i == TD_GPT_LNFW;
        size_t n = i == TD_GPT_WTE ? (size_t)d.V * d.C : t->n;
        for (size_t j = 0; j < n; j++)
            t->data[j] = (ln ? 1.0f : 0.0f) + 0.3f * (2 * td_rng_uniform(&rng) - 1);
    }
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int)td_rng_below(&rng, d.V);
        tgt[i] = (int)td_rng_below(&rng, d.V);
    }
    ref = gpt_step(m, &p, &old, 0, tok, tgt, B, T);
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        gpt_run r = gpt_step(m, &p, td_kernels_cpu(), chunks[c], tok, tgt, B, T);
        double worst = 0.0;
        if (fabs(r.loss - ref.loss) > 1e-6 * fabs(ref.loss))
            fail_msg("chunk %d: loss %.9g, the replaced attention's %.9g", chunks[c], r.loss,
                     ref.loss);
        if (chunks[c] % 64 == 0)
            assert_true(r.loss == ref.loss);
        for (int i = 0; i < p.count; i++) {
            const float *g = r.grad + p.offset[i], *h = ref.grad + p.offset[i];
            double gmax = 0.0;
            for (size_t j = 0; j < p.tensors[i]->n; j++)
                gmax = fmax(gmax, fabs(h[j]));
            for (size_t j = 0; j < p.tensors[i]->n; j++) {
                double e = fabs((double)g[j] - h[j]);
                if (e > 1e-5 * gmax + 1e-9)
                    fail_msg("chunk %d: tensor %d [%zu]: %.9g, the replaced attention's %.9g "
                             "(largest %.3g)",
                             chunks[c], i, j, g[j], h[j], gmax);
                worst = fmax(worst, gmax > 0 ? e / gmax : 0.0);
            }
        }
        print_message("chunk %3d: loss %.9g (replaced %.9g), gradients within %.2g of their "
                      "tensor's largest\n",
                      chunks[c], r.loss, ref.loss, worst);
        free(r.grad);
    }
    free(ref.grad);
    free(tok);
    free(tgt);
    td_params_free(&p);
    free(m);
}

/* ---- the ops through the tape -----------------------------------------------------------------
 */

/* One attention op over in[0..2], q, k, v (packed: in[0] is llm.c's qkv), and the objective
 * L = sum r_i out_i, accumulated in double, whose gradient the tape gives for dout = r. */
typedef struct op_case {
    td_tensor *in[3];
    int packed, NH, causal, chunk;
    float *r;
} op_case;

static td_tensor *op_out(td_ctx *c, const op_case *o)
{
    return o->packed
               ? td_attention_chunk(c, o->in[0], o->NH, o->chunk)
               : td_attention_qkv(c, o->in[0], o->in[1], o->in[2], o->NH, o->causal, o->chunk);
}

/* L again without recording, the arena left as it was. */
static double op_objective(td_ctx *c, const op_case *o)
{
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    td_tensor *out = op_out(&ev, o);
    double v = 0.0;

    for (size_t i = 0; i < out->n; i++)
        v += (double)o->r[i] * out->data[i];
    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return v;
}

/* The tape's gradient of every input element (of the inputs that have one; grads: bit i for
 * in[i]) against central differences of L, inputs U(-1.5, 1.5). The backward is the tape's:
 * the op's output gradient is set to r and td_backward replays the op (it seeds out's first
 * element with 1, so r[0] is 1). Tolerance, as test_kernels.c's: 1e-2 relative + 1e-4
 * absolute with a step of 1e-3, the absolute part 3e-4 here: L sums every output, each a float
 * sum carrying ~1e-7 of rounding, and their differences divided by 2e-3 reach 1.3e-4 with
 * OpenBLAS's FMA kernels (1e-4 with its SSE3 ones); the gradients are O(0.1..1): a missing
 * term, a wrong mask or index is off by O(1). */
static void op_check(int B, int NH, int hs, int Nq, int Nk, int packed, int causal, int chunk,
                     int grads)
{
    int C = NH * hs, n = packed ? 1 : 3;
    volatile int checked = 0, live = 0; /* across the boundary's setjmp */
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    op_case o = {.packed = packed, .NH = NH, .causal = causal, .chunk = chunk};
    td_boundary b;
    td_rng rng;

    td_rng_seed(&rng, 3, (uint64_t)(Nq * 100 + Nk));
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 2), 0);
    o.r = malloc((size_t)B * Nq * C * sizeof(float));
    assert_non_null(o.r);
    for (int i = 0; i < B * Nq * C; i++)
        o.r[i] = i == 0 ? 1.0f : 2 * td_rng_uniform(&rng) - 1;
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *out;
        for (int i = 0; i < n; i++) {
            int rows = i == 0 ? Nq : Nk;
            o.in[i] = td_tensor_new(&c, 3, (int[]){B, rows, packed ? 3 * C : C}, grads >> i & 1);
            for (size_t j = 0; j < o.in[i]->n; j++)
                o.in[i]->data[j] = 1.5f * (2 * td_rng_uniform(&rng) - 1);
        }
        out = op_out(&c, &o);
        assert_int_equal(tape.len, 1);
        memcpy(out->grad, o.r, out->n * sizeof(float));
        td_backward(&c, out);
        for (int i = 0; i < n; i++) {
            td_tensor *t = o.in[i];
            if (t->grad == NULL)
                continue;
            for (size_t j = 0; j < t->n; j++) {
                float keep = t->data[j];
                double lp, lm, num, ana = t->grad[j];
                t->data[j] = keep + 1e-3f;
                lp = op_objective(&c, &o);
                t->data[j] = keep - 1e-3f;
                lm = op_objective(&c, &o);
                t->data[j] = keep;
                num = (lp - lm) / 2e-3;
                if (fabs(ana - num) > 1e-2 * fmax(fabs(ana), fabs(num)) + 3e-4)
                    fail_msg("input %d [%zu]: tape %.6g vs numeric %.6g", i, j, ana, num);
                live += fabs(ana) > 1e-2;
                checked++;
            }
        }
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    print_message("attention op B=%d NH=%d Nq=%d Nk=%d %s%s chunk %d: %d checked, %d live\n", B, NH,
                  Nq, Nk, packed ? "packed" : "q,k,v", causal ? " causal" : "", chunk, checked,
                  live);
    assert_true(live > checked / 2);
    free(o.r);
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* The GPT's op on llm.c's packed qkv (causal, chunk 5 of 12), a ViT's self-attention of three
 * tensors (chunk 3 of 10), a causal one of three tensors, a MAP head's probe (one query against
 * 9 keys, chunk automatic), 4 queries against 7 keys, and the same with only q carrying a
 * gradient (k and v data: nothing computed for them). */
static void test_ops_gradient_fd(void **state)
{
    op_check(2, 2, 3, 12, 12, 1, 1, 5, 1);
    op_check(2, 2, 3, 10, 10, 0, 0, 3, 7);
    op_check(1, 2, 3, 8, 8, 0, 1, 4, 7);
    op_check(3, 2, 4, 1, 9, 0, 0, 0, 7);
    op_check(2, 3, 2, 4, 7, 0, 0, 2, 7);
    op_check(2, 3, 2, 4, 7, 0, 0, 2, 1);
}

/* Refused shapes: k and v of different lengths, causal with fewer queries than keys, C not a
 * multiple of the heads. */
static void test_ops_refuse_bad_shapes(void **state)
{
    td_arena arena;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = NULL};
    td_tensor *q, *k, *v, *v2;
    td_boundary b;

    assert_int_equal(td_arena_init(&arena, 1 << 16), 0);
    q = td_tensor_new(&c, 3, (int[]){2, 3, 8}, 0);
    k = td_tensor_new(&c, 3, (int[]){2, 5, 8}, 0);
    v = td_tensor_new(&c, 3, (int[]){2, 5, 8}, 0);
    v2 = td_tensor_new(&c, 3, (int[]){2, 4, 8}, 0);
    for (int i = 0; i < 3; i++) {
        td_boundary_enter(&b);
        if (TD_TRY(&b)) {
            if (i == 0)
                td_attention_qkv(&c, q, k, v2, 2, 0, 0);
            else if (i == 1)
                td_attention_qkv(&c, q, k, v, 2, 1, 0);
            else
                td_attention_qkv(&c, q, k, v, 3, 0, 0);
            td_boundary_leave(&b);
            fail_msg("case %d: no panic", i);
        } else {
            assert_int_equal(b.err.code, TD_ESHAPE);
        }
    }
    td_arena_free(&arena);
}

/* The automatic chunk: the largest whose block B*NH*chunk*Nk floats fits in 64 MiB, at least 1,
 * at most Nq, unless that block cannot hold one whole sequence's scores (NH*Nq*Nk floats) and
 * those take at most 512 MiB: then ceil(Nq / B), the smallest block that holds one; a chunk
 * given is kept (at most Nq). */
static void test_auto_chunk(void **state)
{
    int c = td_attn_chunk(0, 64, 24, 2448, 2448);
    size_t row = (size_t)64 * 24 * 2448 * sizeof(float);

    assert_int_equal(td_attn_chunk(0, 8, 4, 256, 256), 256); /* the bench's: all of it */
    /* a sequence of 24 heads at N = 2448 is 575 MB of scores: rows of all 64 in 64 MiB */
    assert_true((size_t)c * row <= TD_ATTN_BLOCK_BYTES);
    assert_true((size_t)(c + 1) * row > TD_ATTN_BLOCK_BYTES);
    assert_int_equal(c, 4);
    /* 6 heads: 144 MB, which 64 MiB (17 rows of all 64) does not hold: ceil(2448 / 64) */
    assert_true((size_t)17 * 64 * 6 * 2448 * 4 <= TD_ATTN_BLOCK_BYTES);
    assert_int_equal(td_attn_chunk(0, 64, 6, 2448, 2448), 39);
    /* SensorLM base at batch 32 (12 heads, N = 2448): one sequence, 288 MB */
    assert_int_equal(td_attn_chunk(0, 32, 12, 2448, 2448), 77);
    /* GPT-2 at B 16, T 1024: a sequence is 48 MiB and 85 rows of all 16 fit in 64 MiB */
    assert_int_equal(td_attn_chunk(0, 16, 12, 1024, 1024), 85);
    assert_int_equal(td_attn_chunk(0, 4096, 64, 100000, 100000), 1);
    assert_int_equal(td_attn_chunk(0, 16, 12, 1, 576), 1); /* a probe: one query */
    assert_int_equal(td_attn_chunk(7, 64, 6, 2448, 2448), 7);
    assert_int_equal(td_attn_chunk(100, 2, 2, 50, 50), 50);
}

/* What the ops keep and take, to the byte: after a forward through td_attention_qkv the arena
 * holds the inputs plus td_op_bytes_attention (out with its gradient, and lse), its peak was
 * that plus the forward's transient block, and the backward's block sits on top of everything
 * the forward kept. */
static void test_ops_bytes_exact(void **state)
{
    const int B = 2, NH = 3, hs = 4, Nq = 9, Nk = 21, chunk = 4, C = NH * hs;
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    int targets[2 * 9] = {0};
    td_tensor *q, *k, *v, *out, *loss;
    size_t base, kept, fwd, bwd;
    td_boundary b;

    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        q = td_tensor_new(&c, 3, (int[]){B, Nq, C}, 1);
        k = td_tensor_new(&c, 3, (int[]){B, Nk, C}, 1);
        v = td_tensor_new(&c, 3, (int[]){B, Nk, C}, 1);
        for (size_t i = 0; i < q->n; i++)
            q->data[i] = 0.01f * (float)(i % 7);
        memset(k->data, 0, k->n * sizeof(float));
        memset(v->data, 0, v->n * sizeof(float));
        base = arena.used;
        arena.peak = base;
        out = td_attention_qkv(&c, q, k, v, NH, 0, chunk);
        kept = td_op_bytes_attention(B, Nq, C, NH, 1);
        fwd = td_op_bytes_attention_scratch(B, NH, Nq, Nk, chunk, 0);
        assert_int_equal(arena.used - base, kept);
        assert_int_equal(arena.peak - base, kept + fwd);
        /* the block of scores (even), then the CUDA table's 9 arrays of B*NH pointers */
        assert_int_equal(
            fwd,
            td_arena_round(((size_t)B * NH * chunk * Nk + (size_t)9 * 2 * B * NH) * sizeof(float)));
        loss = td_softmax_xent(&c, out, targets);
        base = arena.used;
        td_backward(&c, loss);
        bwd = td_op_bytes_attention_scratch(B, NH, Nq, Nk, chunk, 1);
        assert_int_equal(bwd, td_arena_round(((size_t)2 * B * NH * chunk * Nk +
                                              (size_t)B * NH * Nq + (size_t)9 * 2 * B * NH) *
                                             4));
        assert_int_equal(arena.peak, base + bwd);
        assert_int_equal(arena.used, base);
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* The GPT's arena estimate is exact for training and for evaluation at any chunk (the peak of
 * a real step, backward included, or of a forward alone), and it no longer grows with T^2:
 * GPT-2 124M's shape at B=8 takes, at T=2048, at most twice its T=1024 bytes plus the two
 * bounded transient blocks (the replaced attention kept L*B*NH*T^2 floats, 4.5 GiB at 1024). */
static void test_gpt_bytes(void **state)
{
    td_gpt_dims d = {.maxT = 40, .V = 30, .Vp = 64, .L = 2, .NH = 2, .C = 8};
    td_gpt_dims big = {.maxT = 2048, .V = 50257, .Vp = 50304, .L = 12, .NH = 12, .C = 768};
    const int B = 2, T = 40, chunks[] = {0, 7, 40};
    int tok[80] = {0}, tgt[80] = {0};
    td_params p = {0}, pb = {0};
    td_gpt *m = calloc(1, sizeof(*m)), *mb = calloc(1, sizeof(*mb));
    td_error_t err = {0};
    size_t b1, b2;

    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 1);
    for (int i = 0; i < 80; i++)
        tok[i] = tgt[i] = i % 30;
    for (size_t ci = 0; ci < sizeof(chunks) / sizeof(chunks[0]); ci++)
        for (int train = 0; train <= 1; train++) {
            td_arena arena;
            td_tape tape;
            td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = train ? &tape : NULL};
            td_boundary b;
            m->attn_chunk = chunks[ci];
            assert_int_equal(td_arena_init(&arena, td_gpt_arena_bytes(m, B, T, train)), 0);
            assert_int_equal(td_tape_init(&tape, td_gpt_tape_len(m)), 0);
            td_boundary_enter(&b);
            if (TD_TRY(&b)) {
                td_tensor *loss = td_gpt_forward(&c, m, tok, tgt, B, T, NULL);
                if (train)
                    td_backward(&c, loss);
                td_boundary_leave(&b);
            } else {
                fail_msg("chunk %d, train %d: panic: %s", chunks[ci], train, b.err.msg);
            }
            assert_int_equal(arena.peak, td_gpt_arena_bytes(m, B, T, train));
            td_tape_free(&tape);
            td_arena_free(&arena);
        }
    assert_int_equal(td_gpt_declare(mb, &pb, &big, &err), 0);
    b1 = td_gpt_arena_bytes(mb, 8, 1024, 1);
    b2 = td_gpt_arena_bytes(mb, 8, 2048, 1);
    print_message("GPT-2 124M, B=8: arena %zu MiB at T=1024, %zu MiB at T=2048\n", b1 >> 20,
                  b2 >> 20);
    assert_true(b2 <= 2 * b1 + 2 * (2 * TD_ATTN_BLOCK_BYTES + ((size_t)8 * 12 * 2048 * 4)));
    td_params_free(&p);
    free(m);
    free(mb);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ops_gradient_fd),
        cmocka_unit_test(test_ops_refuse_bad_shapes),
        cmocka_unit_test(test_auto_chunk),
        cmocka_unit_test(test_ops_bytes_exact),
        cmocka_unit_test(test_gpt_bytes),
        cmocka_unit_test(test_gpt_against_replaced_attention),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
