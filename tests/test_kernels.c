/* Unit tests of kernels/ (the CPU backend table): every backward kernel against central finite
 * differences of its forward, matmul and attention against naive references, layernorm and
 * GELU against their formulas in double, softmax cross-entropy (padded too) and both
 * optimizers against values worked out by hand from PyTorch's formulas, and the CUDA probe
 * where the build has CUDA. Each numerical check states its tolerance and why. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kernels.h"
#include "common/td_errno.h"

/* Finite differences: central, step FD_EPS, of an objective L = sum_i r_i * out_i accumulated
 * in double (r random), compared with the backward kernel given dout = r.
 *
 * Tolerance: |analytic - numeric| <= FD_REL * max(|analytic|, |numeric|) + FD_ABS. The forward
 * runs in float32, so each output that a perturbation moves carries a rounding error of about
 * 6e-8 * |out| (|out| <= ~4 here); a handful of such outputs over 2*FD_EPS = 2e-3 puts up to
 * ~5e-4 of noise into a numeric gradient. Outputs the perturbation does not move are
 * recomputed bit-identically and cancel exactly in double. Gradients here are O(0.1..1), so
 * 1e-2 relative is a real check (a wrong index or a missing term is off by O(1)), and the
 * 1e-3 absolute floor covers gradients that are near zero. */
#define FD_EPS 1e-3f
#define FD_REL 1e-2
#define FD_ABS 1e-3

static const td_kernels *K;

static uint64_t rng_state = 0x853c49e6748fea9bull;

/* Uniform in [lo, hi): a tiny LCG is plenty for test data, and keeps runs reproducible. */
static float urand(float lo, float hi)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)(rng_state >> 40) / 16777216.0f;
}

static float *rand_buf(size_t n, float lo, float hi)
{
    float *p = malloc(n * sizeof(float));
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = urand(lo, hi);
    return p;
}

static float *zero_buf(size_t n)
{
    float *p = calloc(n, sizeof(float));
    assert_non_null(p);
    return p;
}

static void assert_close(double analytic, double numeric, double rel, double abs_tol,
                         const char *what, size_t i)
{
    double diff = fabs(analytic - numeric);
    double scale = fmax(fabs(analytic), fabs(numeric));

    if (diff > rel * scale + abs_tol)
        fail_msg("%s[%zu]: analytic %.7g vs numeric %.7g (diff %.3g)", what, i, analytic, numeric,
                 diff);
}

static double dot(const float *r, const float *out, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)r[i] * out[i];
    return s;
}

/* ---- matmul ------------------------------------------------------------------------------- */

typedef struct mm_case {
    float *inp, *weight, *bias, *out, *r;
    int N, C, OC;
} mm_case;

static double mm_objective(mm_case *m)
{
    K->matmul_forward(m->out, m->inp, m->weight, m->bias, m->N, m->C, m->OC);
    return dot(m->r, m->out, (size_t)m->N * m->OC);
}

/* Central difference of the objective with respect to x[i]. */
static double mm_numeric(mm_case *m, float *x, size_t i)
{
    float keep = x[i];
    double lp, lm;

    x[i] = keep + FD_EPS;
    lp = mm_objective(m);
    x[i] = keep - FD_EPS;
    lm = mm_objective(m);
    x[i] = keep;
    return (lp - lm) / (2.0 * (double)FD_EPS);
}

/* out = inp . W^T + b against a triple loop accumulated in double. Tolerance 1e-5 absolute:
 * with |inp|, |W|, |b| <= 1 and C = 37 terms, sgemm's float32 sums are off by at most about
 * C * 6e-8 * C = 8e-5 in the worst case and ~1e-6 typically. */
static void test_matmul_forward_vs_naive(void **state)
{
    int N = 9, C = 37, OC = 11;
    float *inp = rand_buf((size_t)N * C, -1, 1), *w = rand_buf((size_t)OC * C, -1, 1);
    float *b = rand_buf(OC, -1, 1), *out = zero_buf((size_t)N * OC);

    for (int with_bias = 0; with_bias < 2; with_bias++) {
        K->matmul_forward(out, inp, w, with_bias ? b : NULL, N, C, OC);
        for (int i = 0; i < N; i++)
            for (int o = 0; o < OC; o++) {
                double ref = with_bias ? b[o] : 0.0;
                for (int c = 0; c < C; c++)
                    ref += (double)inp[i * C + c] * w[o * C + c];
                assert_close(out[i * OC + o], ref, 0.0, 1e-5, "out", (size_t)(i * OC + o));
            }
    }
    free(inp);
    free(w);
    free(b);
    free(out);
}

/* dinp, dweight, dbias against finite differences, every element, on a small random shape. */
static void test_matmul_backward_fd(void **state)
{
    mm_case m = {.N = 5, .C = 7, .OC = 4};
    size_t ni = (size_t)m.N * m.C, nw = (size_t)m.OC * m.C, no = (size_t)m.N * m.OC;
    float *dinp = zero_buf(ni), *dw = zero_buf(nw), *db = zero_buf(m.OC);

    m.inp = rand_buf(ni, -1, 1);
    m.weight = rand_buf(nw, -1, 1);
    m.bias = rand_buf(m.OC, -1, 1);
    m.out = zero_buf(no);
    m.r = rand_buf(no, -1, 1);
    K->matmul_backward(dinp, dw, db, m.r, m.inp, m.weight, m.N, m.C, m.OC, 0);
    for (size_t i = 0; i < ni; i++)
        assert_close(dinp[i], mm_numeric(&m, m.inp, i), FD_REL, FD_ABS, "dinp", i);
    for (size_t i = 0; i < nw; i++)
        assert_close(dw[i], mm_numeric(&m, m.weight, i), FD_REL, FD_ABS, "dweight", i);
    for (size_t i = 0; i < (size_t)m.OC; i++)
        assert_close(db[i], mm_numeric(&m, m.bias, i), FD_REL, FD_ABS, "dbias", i);

    free(dinp);
    free(dw);
    free(db);
    free(m.inp);
    free(m.weight);
    free(m.bias);
    free(m.out);
    free(m.r);
}

/* Backward kernels add into their outputs (a tensor read twice collects both gradients), NULL
 * outputs are skipped, and the bias gradient is right past the 256-row chunks cpu.c sums in.
 * Exact products of small integers keep this check at float32 rounding (1e-4 on sums ~300). */
static void test_matmul_backward_accumulates(void **state)
{
    int N = 300, C = 3, OC = 2;
    float *dout = malloc((size_t)N * OC * sizeof(float));
    float *inp = malloc((size_t)N * C * sizeof(float));
    float w[6] = {1, 2, 3, 4, 5, 6};
    float db[2] = {10, 20}, dw[6] = {0};
    float *dinp = malloc((size_t)N * C * sizeof(float));

    for (int i = 0; i < N; i++) {
        dout[i * OC] = 1.0f;
        dout[i * OC + 1] = (float)(i % 3);
        for (int c = 0; c < C; c++) {
            inp[i * C + c] = 1.0f;
            dinp[i * C + c] = 100.0f;
        }
    }
    K->matmul_backward(dinp, NULL, db, dout, inp, w, N, C, OC, 0);
    assert_float_equal(db[0], 10.0f + 300.0f, 1e-4);
    assert_float_equal(db[1], 20.0f + 300.0f, 1e-4); /* 100 rows each of 0, 1, 2 */
    /* row 4: dout = (1, 1): dinp += (1*1 + 1*4, 1*2 + 1*5, 1*3 + 1*6) */
    assert_float_equal(dinp[4 * C + 0], 105.0f, 1e-4);
    assert_float_equal(dinp[4 * C + 1], 107.0f, 1e-4);
    assert_float_equal(dinp[4 * C + 2], 109.0f, 1e-4);
    K->matmul_backward(NULL, dw, NULL, dout, inp, w, N, C, OC, 0);
    assert_float_equal(dw[0], 300.0f, 1e-4);
    assert_float_equal(dw[3], 300.0f, 1e-4);
    free(dout);
    free(inp);
    free(dinp);
}

/* ---- bias add ---------------------------------------------------------------------------- */

static void test_bias_fd(void **state)
{
    int N = 6, C = 5;
    size_t n = (size_t)N * C;
    float *inp = rand_buf(n, -1, 1), *b = rand_buf(C, -1, 1), *out = zero_buf(n);
    float *r = rand_buf(n, -1, 1), *dinp = zero_buf(n), *db = zero_buf(C);
    float *xs[2] = {inp, b}, *grads[2] = {dinp, db};
    size_t sizes[2] = {n, (size_t)C};

    K->bias_forward(out, inp, b, N, C);
    assert_float_equal(out[2 * C + 3], inp[2 * C + 3] + b[3], 1e-7);
    K->bias_backward(dinp, db, r, N, C);
    for (int t = 0; t < 2; t++)
        for (size_t i = 0; i < sizes[t]; i++) {
            float keep = xs[t][i];
            double lp, lm;
            xs[t][i] = keep + FD_EPS;
            K->bias_forward(out, inp, b, N, C);
            lp = dot(r, out, n);
            xs[t][i] = keep - FD_EPS;
            K->bias_forward(out, inp, b, N, C);
            lm = dot(r, out, n);
            xs[t][i] = keep;
            assert_close(grads[t][i], (lp - lm) / (2.0 * FD_EPS), FD_REL, FD_ABS,
                         t == 0 ? "dinp" : "dbias", i);
        }
    free(inp);
    free(b);
    free(out);
    free(r);
    free(dinp);
    free(db);
}

/* ---- ReLU ------------------------------------------------------------------------------- */

/* Inputs are kept at least 0.05 away from the kink at 0, so a step of FD_EPS never crosses it
 * and the finite difference is of a linear piece. */
static void test_relu_fd(void **state)
{
    size_t n = 40;
    float *inp = rand_buf(n, -1, 1), *out = zero_buf(n), *r = rand_buf(n, -1, 1);
    float *dinp = zero_buf(n);

    for (size_t i = 0; i < n; i++)
        if (fabsf(inp[i]) < 0.05f)
            inp[i] = inp[i] < 0 ? -0.5f : 0.5f;
    K->relu_forward(out, inp, n);
    K->relu_backward(dinp, r, out, n);
    for (size_t i = 0; i < n; i++) {
        float keep = inp[i];
        double lp, lm;
        assert_true(out[i] == (inp[i] > 0 ? inp[i] : 0.0f));
        inp[i] = keep + FD_EPS;
        K->relu_forward(out, inp, n);
        lp = dot(r, out, n);
        inp[i] = keep - FD_EPS;
        K->relu_forward(out, inp, n);
        lm = dot(r, out, n);
        inp[i] = keep;
        assert_close(dinp[i], (lp - lm) / (2.0 * FD_EPS), FD_REL, FD_ABS, "dinp", i);
    }
    free(inp);
    free(out);
    free(r);
    free(dinp);
}

/* ReLU passes NaN through (as PyTorch does), so a NaN is not hidden from the loss check. */
static void test_relu_nan_passes(void **state)
{
    float in[3] = {NAN, -1.0f, 2.0f}, out[3];

    K->relu_forward(out, in, 3);
    assert_true(isnan(out[0]));
    assert_true(out[1] == 0.0f);
    assert_true(out[2] == 2.0f);
}

/* ---- softmax cross-entropy -------------------------------------------------------------- */

/* logits (1,2,3) target 2 and (1,1,1) target 0: losses log(1+e+e^2) - 2 = 0.40760596 and
 * log 3 = 1.09861229, mean 0.75310913; probs by hand. Tolerance 1e-6: float32 rounding of
 * values near 1. The backward is (probs - onehot) * dloss / N. */
static void test_softmax_xent_by_hand(void **state)
{
    float logits[6] = {1, 2, 3, 1, 1, 1}, probs[6], loss = 0.0f;
    int targets[2] = {2, 0};
    float dlogits[6] = {0}, dloss = 2.0f;
    const float p0[3] = {0.09003057f, 0.24472847f, 0.66524096f};

    K->softmax_xent_forward(&loss, probs, logits, targets, 2, 3, 3);
    assert_float_equal(loss, 0.75310913f, 1e-6);
    for (int j = 0; j < 3; j++) {
        assert_float_equal(probs[j], p0[j], 1e-6);
        assert_float_equal(probs[3 + j], 1.0f / 3.0f, 1e-6);
    }
    K->softmax_xent_backward(dlogits, &dloss, probs, targets, 2, 3, 3);
    /* dloss/N = 1 */
    assert_float_equal(dlogits[0], p0[0], 1e-6);
    assert_float_equal(dlogits[2], p0[2] - 1.0f, 1e-6);
    assert_float_equal(dlogits[3], 1.0f / 3.0f - 1.0f, 1e-6);
    assert_float_equal(dlogits[5], 1.0f / 3.0f, 1e-6);
}

/* Huge logits neither overflow nor lose the loss: (1000, 0, -1000) with target 1 has loss
 * exactly 1000 (a naive exp overflows; a naive -log(prob) gives -log(0) = inf). */
static void test_softmax_xent_stable(void **state)
{
    float logits[3] = {1000, 0, -1000}, probs[3], loss = 0.0f;
    int target = 1;

    K->softmax_xent_forward(&loss, probs, logits, &target, 1, 3, 3);
    assert_true(isfinite(loss));
    assert_float_equal(loss, 1000.0f, 1e-3);
    assert_float_equal(probs[0], 1.0f, 1e-7);
    assert_float_equal(probs[1], 0.0f, 1e-7);
}

/* dlogits against finite differences of dloss * loss. The loss is one float rounded from a
 * double sum, so the numeric gradient's noise is ~1 ulp of ~1.5 over 2e-3, about 1e-4. */
static void test_softmax_xent_fd(void **state)
{
    int N = 4, V = 5;
    size_t n = (size_t)N * V;
    float *logits = rand_buf(n, -2, 2), *probs = zero_buf(n), *dlogits = zero_buf(n);
    int targets[4] = {0, 3, 4, 3};
    float dloss = 0.7f, loss = 0.0f;

    K->softmax_xent_forward(&loss, probs, logits, targets, N, V, V);
    K->softmax_xent_backward(dlogits, &dloss, probs, targets, N, V, V);
    for (size_t i = 0; i < n; i++) {
        float keep = logits[i];
        double lp, lm;
        logits[i] = keep + FD_EPS;
        K->softmax_xent_forward(&loss, probs, logits, targets, N, V, V);
        lp = (double)dloss * loss;
        logits[i] = keep - FD_EPS;
        K->softmax_xent_forward(&loss, probs, logits, targets, N, V, V);
        lm = (double)dloss * loss;
        logits[i] = keep;
        assert_close(dlogits[i], (lp - lm) / (2.0 * FD_EPS), FD_REL, FD_ABS, "dlogits", i);
    }
    free(logits);
    free(probs);
    free(dlogits);
}

static void test_argmax_correct(void **state)
{
    /* rows: argmax 2 (target 2: right), a tie between 0 and 1 goes to 0 (target 1: wrong),
     * argmax 0 (target 0: right) */
    float logits[9] = {0, 1, 2, 5, 5, 1, 3, -1, -2};
    int targets[3] = {2, 1, 0};
    int64_t correct = -1;

    K->argmax_correct(&correct, logits, targets, 3, 3);
    assert_int_equal(correct, 2);
}

/* ---- GPT-2's ops: a generic finite-difference check --------------------------------------- */

/* An op under test: forward() computes out (n_out floats) from the inputs it knows; the
 * objective is L = sum r_i out_i, whose gradient the op's backward gives for dout = r. */
typedef struct fd_op {
    void (*forward)(struct fd_op *op);
    float *out, *r;
    size_t n_out;
} fd_op;

static double fd_objective(fd_op *op)
{
    op->forward(op);
    return dot(op->r, op->out, op->n_out);
}

/* grad (n floats, the backward's) against central differences of L at every stride-th
 * element of x, with FD_REL/FD_ABS (see the top of the file). Returns how many checked
 * gradients were clearly nonzero (> 1e-2), so a test can refuse a vacuous pass. */
static int fd_check(fd_op *op, float *x, const float *grad, size_t n, size_t stride,
                    const char *what)
{
    int live = 0;

    for (size_t i = 0; i < n; i += stride) {
        float keep = x[i];
        double lp, lm;
        x[i] = keep + FD_EPS;
        lp = fd_objective(op);
        x[i] = keep - FD_EPS;
        lm = fd_objective(op);
        x[i] = keep;
        assert_close(grad[i], (lp - lm) / (2.0 * FD_EPS), FD_REL, FD_ABS, what, i);
        live += fabsf(grad[i]) > 1e-2f;
    }
    op->forward(op); /* leave out as the unperturbed forward gave it */
    return live;
}

/* ---- token + position embedding ---------------------------------------------------------- */

typedef struct enc_case {
    fd_op op;
    const int *tokens;
    float *wte, *wpe;
    int B, T, C;
} enc_case;

static void enc_forward(fd_op *op)
{
    enc_case *e = (enc_case *)op;
    K->encoder_forward(op->out, e->tokens, e->wte, e->wpe, e->B, e->T, e->C);
}

/* Token 1 appears three times, so its row of dwte must collect three rows of dout. */
static void test_encoder_fd(void **state)
{
    static const int tokens[6] = {1, 3, 1, 4, 1, 0};
    enc_case e = {.tokens = tokens, .B = 2, .T = 3, .C = 4};
    int V = 5, maxT = 4;
    size_t no = 2 * 3 * 4;
    float *dwte = zero_buf((size_t)V * e.C), *dwpe = zero_buf((size_t)maxT * e.C);

    e.wte = rand_buf((size_t)V * e.C, -1, 1);
    e.wpe = rand_buf((size_t)maxT * e.C, -1, 1);
    e.op =
        (fd_op){.forward = enc_forward, .out = zero_buf(no), .r = rand_buf(no, -1, 1), .n_out = no};
    enc_forward(&e.op);
    assert_true(e.op.out[1 * 4 + 2] == e.wte[3 * 4 + 2] + e.wpe[1 * 4 + 2]);
    K->encoder_backward(dwte, dwpe, e.op.r, tokens, e.B, e.T, e.C);
    fd_check(&e.op, e.wte, dwte, (size_t)V * e.C, 1, "dwte");
    fd_check(&e.op, e.wpe, dwpe, (size_t)maxT * e.C, 1, "dwpe");
    for (int c = 0; c < e.C; c++) /* token 2 never appears; position 3 is past T */
        assert_true(dwte[2 * 4 + c] == 0.0f && dwpe[3 * 4 + c] == 0.0f);
    free(dwte);
    free(dwpe);
    free(e.wte);
    free(e.wpe);
    free(e.op.out);
    free(e.op.r);
}

/* ---- layernorm ------------------------------------------------------------------------------ */

typedef struct ln_case {
    fd_op op;
    float *inp, *w, *b, *mean, *rstd;
    int N, C;
} ln_case;

static void ln_forward(fd_op *op)
{
    ln_case *l = (ln_case *)op;
    K->layernorm_forward(op->out, l->mean, l->rstd, l->inp, l->w, l->b, l->N, l->C);
}

/* C = 13 runs both the 8-wide partial sums and their tail. The forward is held to a double
 * reference within 1e-5 (|out| <= ~4, a few float roundings); every gradient to FD. The
 * numeric gradient of a normalisation is noisier than a matmul's (every output moves), but
 * the outputs are O(1) and there are 39 of them: ~40 * 6e-8 * 4 / 2e-3 = 5e-3 worst case,
 * inside FD_REL for the O(1) gradients here. */
static void test_layernorm(void **state)
{
    ln_case l = {.N = 3, .C = 13};
    size_t n = (size_t)l.N * l.C;
    float *dinp = zero_buf(n), *dw = zero_buf(l.C), *db = zero_buf(l.C);

    l.inp = rand_buf(n, -2, 2);
    l.w = rand_buf(l.C, 0.5f, 1.5f);
    l.b = rand_buf(l.C, -1, 1);
    l.mean = zero_buf(l.N);
    l.rstd = zero_buf(l.N);
    l.op = (fd_op){.forward = ln_forward, .out = zero_buf(n), .r = rand_buf(n, -1, 1), .n_out = n};
    ln_forward(&l.op);
    for (int i = 0; i < l.N; i++) {
        double m = 0, v = 0;
        for (int j = 0; j < l.C; j++)
            m += l.inp[i * l.C + j];
        m /= l.C;
        for (int j = 0; j < l.C; j++)
            v += (l.inp[i * l.C + j] - m) * (l.inp[i * l.C + j] - m);
        v /= l.C;
        for (int j = 0; j < l.C; j++) {
            double ref = (l.inp[i * l.C + j] - m) / sqrt(v + 1e-5) * l.w[j] + l.b[j];
            assert_close(l.op.out[i * l.C + j], ref, 0.0, 1e-5, "layernorm out",
                         (size_t)(i * l.C + j));
        }
    }
    K->layernorm_backward(dinp, dw, db, l.op.r, l.inp, l.w, l.mean, l.rstd, l.N, l.C, 0);
    assert_true(fd_check(&l.op, l.inp, dinp, n, 1, "dinp") > 10);
    fd_check(&l.op, l.w, dw, (size_t)l.C, 1, "dweight");
    fd_check(&l.op, l.b, db, (size_t)l.C, 1, "dbias");
    free(dinp);
    free(dw);
    free(db);
    free(l.inp);
    free(l.w);
    free(l.b);
    free(l.mean);
    free(l.rstd);
    free(l.op.out);
    free(l.op.r);
}

/* ---- GELU ----------------------------------------------------------------------------------- */

typedef struct gelu_case {
    fd_op op;
    float *inp;
} gelu_case;

static void gelu_fwd(fd_op *op)
{
    K->gelu_forward(op->out, ((gelu_case *)op)->inp, op->n_out);
}

/* The forward against llm.c's formula in double, 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715
 * x^3))), over [-12, 12] (past the clamp of the kernel's exp at both ends): within 4e-7 of
 * |x| + 1e-7 absolute, a few ulps. The backward against FD. */
static void test_gelu(void **state)
{
    size_t n = 301, nf = 64;
    float *x = malloc(n * sizeof(float)), *out = zero_buf(n);
    gelu_case g;
    float *dinp = zero_buf(nf);

    for (size_t i = 0; i < n; i++)
        x[i] = -12.0f + 24.0f * (float)i / (float)(n - 1);
    K->gelu_forward(out, x, n);
    for (size_t i = 0; i < n; i++) {
        double xi = x[i];
        double ref = 0.5 * xi * (1.0 + tanh(sqrt(2.0 / M_PI) * (xi + 0.044715 * xi * xi * xi)));
        assert_close(out[i], ref, 0.0, 4e-7 * fabs(xi) + 1e-7, "gelu", i);
    }
    g.inp = rand_buf(nf, -4, 4);
    g.op = (fd_op){.forward = gelu_fwd, .out = zero_buf(nf), .r = rand_buf(nf, -1, 1), .n_out = nf};
    K->gelu_backward(dinp, g.inp, g.op.r, nf, 0);
    assert_true(fd_check(&g.op, g.inp, dinp, nf, 1, "dinp") > 20);
    free(x);
    free(out);
    free(dinp);
    free(g.inp);
    free(g.op.out);
    free(g.op.r);
}

/* ---- residual ------------------------------------------------------------------------------- */

static void test_residual(void **state)
{
    float a[3] = {1, 2, 3}, b[3] = {0.5f, -2, 4}, out[3];
    float da[3] = {1, 1, 1}, db[3] = {0}, dout[3] = {0.25f, 0.5f, -1};

    K->residual_forward(out, a, b, 3);
    assert_true(out[0] == 1.5f && out[1] == 0.0f && out[2] == 7.0f);
    K->residual_backward(da, db, dout, 3, 0);
    assert_true(da[0] == 1.25f && da[2] == 0.0f && db[1] == 0.5f && db[2] == -1.0f);
    K->residual_backward(NULL, db, dout, 3, 0);
    assert_true(db[1] == 1.0f);
}

/* residual_layernorm_forward is residual_forward then layernorm_forward, bit for bit (res, out,
 * mean, rstd), on one thread and on a team of 3 (rows cut into tasks), over 37 rows of 300 */
static void test_residual_layernorm(void **state)
{
    const int N = 37, C = 300;
    size_t n = (size_t)N * C;
    float *a = rand_buf(n, -2, 2), *b = rand_buf(n, -1, 1), *w = rand_buf(C, 0.5f, 1.5f);
    float *bias = rand_buf(C, -1, 1);
    float *res0 = zero_buf(n), *out0 = zero_buf(n), *m0 = zero_buf(N), *r0 = zero_buf(N);

    K->residual_forward(res0, a, b, n);
    K->layernorm_forward(out0, m0, r0, res0, w, bias, N, C);
    for (int threads = 1; threads <= 3; threads += 2) {
        float *res = zero_buf(n), *out = zero_buf(n), *m = zero_buf(N), *r = zero_buf(N);
        K->set_threads(threads);
        K->residual_layernorm_forward(res, out, m, r, a, b, w, bias, N, C);
        assert_memory_equal(res, res0, n * sizeof(float));
        assert_memory_equal(out, out0, n * sizeof(float));
        assert_memory_equal(m, m0, N * sizeof(float));
        assert_memory_equal(r, r0, N * sizeof(float));
        free(res), free(out), free(m), free(r);
    }
    K->set_threads(1);
    free(a), free(b), free(w), free(bias), free(res0), free(out0), free(m0), free(r0);
}

/* ---- fused attention ------------------------------------------------------------------------ */

/* One attention case: q, k, v in one buffer each (packed: one (B,T,3C) buffer, k and v inside
 * it), the kernels' dims, and the forward's out and lse. */
typedef struct att_case {
    fd_op op;
    td_attn_dims d;
    float *q, *k, *v; /* q is the buffer; k, v point into it when packed */
    float *lse, *scratch;
    size_t nq, nk; /* floats of the q and k (= v) buffers */
    size_t ns;     /* floats of scratch before its canaries */
    int packed;
} att_case;

static void att_forward(fd_op *op)
{
    att_case *a = (att_case *)op;
    K->attention_forward(op->out, a->lse, a->scratch, a->q, a->k, a->v, &a->d);
}

#define CANARY 64 /* floats after a scratch, which the kernels must leave as they are */

/* The case's scratch becomes exactly what its chunk needs forward (backward 0) or backward,
 * with CANARY floats after it. */
static void att_scratch(att_case *a, int chunk, int backward)
{
    a->d.chunk = chunk;
    a->ns = td_attn_scratch(&a->d, backward);
    free(a->scratch);
    a->scratch = malloc((a->ns + CANARY) * sizeof(float));
    assert_non_null(a->scratch);
    for (int i = 0; i < CANARY; i++)
        a->scratch[a->ns + i] = 1234.5f;
}

/* A case of B sequences, NH heads of hs, Nq queries against Nk keys, the given chunk. packed:
 * llm.c's qkv layout (Nq == Nk); otherwise separate q (B,Nq,C), k and v (B,Nk,C). Its scratch
 * is the backward's, the larger. */
static att_case att_new(int B, int NH, int hs, int Nq, int Nk, int causal, int chunk, int packed,
                        float range)
{
    att_case a = {.packed = packed};
    int C = NH * hs;
    size_t nout = (size_t)B * Nq * C;

    a.d = (td_attn_dims){
        .B = B, .NH = NH, .Nq = Nq, .Nk = Nk, .hs = hs, .causal = causal, .chunk = chunk};
    if (packed) {
        a.d.ldq = a.d.ldk = a.d.ldv = 3 * C;
        a.nq = (size_t)B * Nq * 3 * C;
        a.q = rand_buf(a.nq, -range, range);
        a.k = a.q + C;
        a.v = a.q + 2 * C;
    } else {
        a.d.ldq = a.d.ldk = a.d.ldv = C;
        a.nq = nout;
        a.nk = (size_t)B * Nk * C;
        a.q = rand_buf(a.nq, -range, range);
        a.k = rand_buf(a.nk, -range, range);
        a.v = rand_buf(a.nk, -range, range);
    }
    att_scratch(&a, chunk, 1);
    a.lse = zero_buf((size_t)B * NH * Nq);
    a.op = (fd_op){
        .forward = att_forward, .out = zero_buf(nout), .r = rand_buf(nout, -1, 1), .n_out = nout};
    return a;
}

/* The kernels stayed inside their scratch. */
static void att_canaries(const att_case *a)
{
    for (int i = 0; i < CANARY; i++)
        assert_true(a->scratch[a->ns + i] == 1234.5f);
}

static void att_free(att_case *a)
{
    free(a->q);
    if (!a->packed) {
        free(a->k);
        free(a->v);
    }
    free(a->scratch);
    free(a->lse);
    free(a->op.out);
    free(a->op.r);
}

/* The attention of a case computed directly in double: for every (b, h, i), the scores of the
 * keys it sees, their log-sum-exp, and out = softmax . v. out is (B,Nq,C), lse is (B,NH,Nq). */
static void att_reference(double *out, double *lse, const att_case *a)
{
    const td_attn_dims *d = &a->d;
    int C = d->NH * d->hs;
    double scale = 1.0 / sqrt(d->hs), *w = malloc((size_t)d->Nk * sizeof(double));

    assert_non_null(w);
    for (int b = 0; b < d->B; b++)
        for (int h = 0; h < d->NH; h++)
            for (int i = 0; i < d->Nq; i++) {
                const float *q = a->q + ((size_t)b * d->Nq + i) * d->ldq + h * d->hs;
                int n = d->causal ? i + 1 : d->Nk;
                double maxv = -INFINITY, sum = 0.0;
                for (int j = 0; j < n; j++) {
                    const float *k = a->k + ((size_t)b * d->Nk + j) * d->ldk + h * d->hs;
                    double s = 0.0;
                    for (int e = 0; e < d->hs; e++)
                        s += (double)q[e] * k[e];
                    w[j] = s * scale;
                    maxv = fmax(maxv, w[j]);
                }
                for (int j = 0; j < n; j++)
                    sum += (w[j] = exp(w[j] - maxv));
                lse[((size_t)b * d->NH + h) * d->Nq + i] = maxv + log(sum);
                for (int e = 0; e < d->hs; e++) {
                    double o = 0.0;
                    for (int j = 0; j < n; j++)
                        o += w[j] / sum * a->v[((size_t)b * d->Nk + j) * d->ldv + h * d->hs + e];
                    out[((size_t)b * d->Nq + i) * C + h * d->hs + e] = o;
                }
            }
    free(w);
}

/* Forward against the double reference for every chunk of `chunks` (0 ends the list).
 * Tolerance 2e-6 absolute on out and on lse: a score is a float sum of hs <= 16 products of
 * numbers within [-1, 1] (error ~1e-7), the softmax and the (<= 150)-term sums of weights of
 * size <= 1 times |v| <= 1 add a few float roundings of O(1) numbers each, so the float
 * results sit within a few 1e-7; a missed key, a wrong mask or row is off by 1e-2 or more.
 * Rows of out must not depend on the chunk beyond that tolerance, and a causal forward with
 * chunks that are multiples of the 64-row sgemm block (or all rows) gives the same bits as one
 * chunk of all rows. */
static void att_forward_case(int B, int NH, int hs, int Nq, int Nk, int causal, int packed,
                             const int *chunks)
{
    att_case a = att_new(B, NH, hs, Nq, Nk, causal, Nq, packed, 1.0f);
    size_t nout = a.op.n_out, nl = (size_t)B * NH * Nq;
    double *ref = malloc(nout * sizeof(double)), *rl = malloc(nl * sizeof(double));
    float *first = zero_buf(nout);

    att_reference(ref, rl, &a);
    for (int c = 0; chunks[c] > 0; c++) {
        att_scratch(&a, chunks[c], 0);
        memset(a.op.out, 0xff, nout * sizeof(float)); /* NaN: every element must be written */
        att_forward(&a.op);
        att_canaries(&a);
        for (size_t i = 0; i < nout; i++)
            assert_close(a.op.out[i], ref[i], 0.0, 2e-6, "attention out", i);
        for (size_t i = 0; i < nl; i++)
            assert_close(a.lse[i], rl[i], 0.0, 2e-6, "attention lse", i);
        if (c == 0)
            memcpy(first, a.op.out, nout * sizeof(float));
        else if (causal && (chunks[0] >= Nq || chunks[0] % 64 == 0) &&
                 (chunks[c] >= Nq || chunks[c] % 64 == 0))
            assert_memory_equal(first, a.op.out, nout * sizeof(float));
    }
    att_free(&a);
    free(ref);
    free(rl);
    free(first);
}

/* Causal self-attention in llm.c's packed layout past three 64-row blocks (T = 150, chunks
 * all of it, 128, 64, and 37, 10, 1, which do not divide T); non-causal self-attention of
 * separate q, k, v (chunks 70, 16, 9); cross-attention, a MAP head's single probe against 50
 * keys and 5 queries against 33 keys with a chunk of 2. */
static void test_attention_forward_vs_double(void **state)
{
    static const int causal_chunks[] = {150, 128, 64, 37, 10, 1, 0};
    static const int self_chunks[] = {70, 16, 9, 0}, probe_chunks[] = {1, 0};
    static const int cross_chunks[] = {5, 2, 0};

    att_forward_case(2, 4, 4, 150, 150, 1, 1, causal_chunks);
    att_forward_case(2, 3, 8, 70, 70, 0, 0, self_chunks);
    att_forward_case(3, 2, 8, 1, 50, 0, 0, probe_chunks);
    att_forward_case(2, 2, 6, 5, 33, 0, 0, cross_chunks);
}

/* Gradients against central differences: the causal packed layout on one block (T = 7) and
 * across blocks (T = 70, chunks 64 and 9), a non-causal self-attention of separate q, k, v
 * (chunk 4 of 13), a cross-attention of 3 queries against 11 keys, and the same with dk not
 * asked for (NULL: dq and dv still right, nothing written for k). Every element on the small
 * cases, every 17th on T = 70. Attention outputs are O(1) sums of softmax-weighted values; a
 * perturbation moves the outputs of one head at the rows that see it (up to N*hs of them),
 * so the noise is like layernorm's: within FD_REL for the O(0.1..1) gradients. */
typedef struct att_grad_case {
    int B, NH, hs, Nq, Nk, causal, chunk, packed, no_dk;
    size_t stride;
} att_grad_case;

static void att_grad(const att_grad_case *g)
{
    att_case a = att_new(g->B, g->NH, g->hs, g->Nq, g->Nk, g->causal, g->chunk, g->packed, 1.5f);
    float *dq = zero_buf(a.nq), *dk = NULL, *dv = NULL;
    int live = 0;

    att_forward(&a.op);
    if (g->packed) {
        K->attention_backward(dq, dq + a.d.hs * a.d.NH, dq + 2 * a.d.hs * a.d.NH, a.scratch, a.op.r,
                              a.q, a.k, a.v, a.op.out, a.lse, &a.d, 0);
        live += fd_check(&a.op, a.q, dq, a.nq, g->stride, "dqkv");
    } else {
        dk = zero_buf(a.nk);
        dv = zero_buf(a.nk);
        K->attention_backward(dq, g->no_dk ? NULL : dk, dv, a.scratch, a.op.r, a.q, a.k, a.v,
                              a.op.out, a.lse, &a.d, 0);
        live += fd_check(&a.op, a.q, dq, a.nq, g->stride, "dq");
        live += fd_check(&a.op, a.v, dv, a.nk, g->stride, "dv");
        if (g->no_dk)
            for (size_t i = 0; i < a.nk; i++)
                assert_true(dk[i] == 0.0f);
        else
            live += fd_check(&a.op, a.k, dk, a.nk, g->stride, "dk");
    }
    att_canaries(&a);
    assert_true(live > 20);
    free(dq);
    free(dk);
    free(dv);
    att_free(&a);
}

static void test_attention_fd(void **state)
{
    static const att_grad_case cases[] = {
        {.B = 2,
         .NH = 2,
         .hs = 4,
         .Nq = 7,
         .Nk = 7,
         .causal = 1,
         .chunk = 7,
         .packed = 1,
         .stride = 1},
        {.B = 2,
         .NH = 2,
         .hs = 4,
         .Nq = 70,
         .Nk = 70,
         .causal = 1,
         .chunk = 64,
         .packed = 1,
         .stride = 17},
        {.B = 2,
         .NH = 2,
         .hs = 4,
         .Nq = 70,
         .Nk = 70,
         .causal = 1,
         .chunk = 9,
         .packed = 1,
         .stride = 17},
        {.B = 2, .NH = 2, .hs = 4, .Nq = 13, .Nk = 13, .causal = 0, .chunk = 4, .stride = 1},
        {.B = 2, .NH = 2, .hs = 3, .Nq = 3, .Nk = 11, .causal = 0, .chunk = 2, .stride = 1},
        {.B = 1,
         .NH = 2,
         .hs = 3,
         .Nq = 3,
         .Nk = 11,
         .causal = 0,
         .chunk = 3,
         .stride = 1,
         .no_dk = 1},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        att_grad(&cases[i]);
}

/* The backward accumulates: onto gradients g0 already there it adds what it gives from zero,
 * g - g0 = g1 within a few roundings of the additions, 2^-21 (|g0| + |g1|) (the increments
 * arrive in pieces, a block of rows at a time, so the sums are not bit-identical). */
static void test_attention_accumulates(void **state)
{
    att_case a = att_new(2, 2, 4, 20, 20, 1, 8, 1, 1.0f);
    float *g1 = zero_buf(a.nq), *g0 = rand_buf(a.nq, -1, 1), *g = malloc(a.nq * sizeof(float));
    int C = a.d.NH * a.d.hs;

    memcpy(g, g0, a.nq * sizeof(float));
    att_forward(&a.op);
    K->attention_backward(g1, g1 + C, g1 + 2 * C, a.scratch, a.op.r, a.q, a.k, a.v, a.op.out, a.lse,
                          &a.d, 0);
    K->attention_backward(g, g + C, g + 2 * C, a.scratch, a.op.r, a.q, a.k, a.v, a.op.out, a.lse,
                          &a.d, 0);
    for (size_t i = 0; i < a.nq; i++)
        assert_close((double)g[i] - g0[i], g1[i], 0.0, 0x1p-21 * (fabs(g0[i]) + fabs(g1[i])),
                     "accumulated", i);
    free(g1);
    free(g0);
    free(g);
    att_free(&a);
}

/* ---- stored gradients (kernels.h's store mask) ---------------------------------------------- */

/* n floats of NaN, what a stored gradient's buffer may hold before (an arena's old bytes) */
static float *nan_buf(size_t n)
{
    float *p = malloc(n * sizeof(float));

    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
    return p;
}

/* stored (written over NaN) must be added (added into zeros), bit for bit */
static void assert_stored(const char *what, const float *stored, const float *added, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&stored[i], &added[i], sizeof(float)) != 0)
            fail_msg("%s[%zu]: stored %.9g, added into zeros %.9g", what, i, stored[i], added[i]);
}

/* One attention case: every gradient, and each alone, stored over NaN against added into zeros. */
static void store_attention_case(int B, int NH, int Nq, int Nk, int causal, int chunk, int packed)
{
    att_case a = att_new(B, NH, 4, Nq, Nk, causal, chunk, packed, 1.0f);
    size_t ng = packed ? a.nq : a.nq + 2 * a.nk, off[3];
    int C = a.d.NH * a.d.hs;
    float *added = zero_buf(ng), *g = malloc(ng * sizeof(float));

    assert_non_null(g);
    off[0] = 0, off[1] = packed ? (size_t)C : a.nq, off[2] = packed ? 2 * (size_t)C : a.nq + a.nk;
    att_forward(&a.op);
    K->attention_backward(added + off[0], added + off[1], added + off[2], a.scratch, a.op.r, a.q,
                          a.k, a.v, a.op.out, a.lse, &a.d, 0);
    for (int st = 1; st <= (TD_STORE_1 | TD_STORE_2 | TD_STORE_3); st++) {
        for (size_t i = 0; i < ng; i++) { /* NaN in the stored gradients, zeros in the rest */
            int part = packed       ? (int)(i % (3 * (size_t)C) / C)
                       : i < off[1] ? 0
                       : i < off[2] ? 1
                                    : 2;
            g[i] = st & (TD_STORE_1 << part) ? NAN : 0.0f;
        }
        K->attention_backward(g + off[0], g + off[1], g + off[2], a.scratch, a.op.r, a.q, a.k, a.v,
                              a.op.out, a.lse, &a.d, st);
        assert_stored("attention", g, added, ng);
    }
    att_canaries(&a);
    free(added);
    free(g);
    att_free(&a);
}

/* The five kernels with a store form, on 1 and 3 threads: a stored gradient over NaN has the
 * bits of the same call adding into zeros (so the engine's first writers change nothing but
 * the memsets), and an output not named in the mask still adds. The attention in each plan:
 * causal rows of every sequence (chunk 8 of T 40, whose stored dk and dv are zeroed first), whole
 * sequences, not causal in rows, cross-attention of separate q, k, v. */
static void test_store_forms(void **state)
{
    const int N = 37, C = 24, OC = 50;
    float *inp = rand_buf((size_t)N * C, -1, 1), *w = rand_buf((size_t)OC * C, -1, 1);
    float *dout = rand_buf((size_t)N * OC, -1, 1), *dx = rand_buf((size_t)N * C, -1, 1);
    float *lw = rand_buf(C, 0.5f, 1.5f), *lb = rand_buf(C, -1, 1);
    float *mean = zero_buf(N), *rstd = zero_buf(N), *lout = zero_buf((size_t)N * C);
    float *dw_a = zero_buf((size_t)OC * C), *dw_s = zero_buf((size_t)OC * C);
    size_t n = (size_t)N * C;

    K->layernorm_forward(lout, mean, rstd, inp, lw, lb, N, C);
    for (int threads = 1; threads <= 3; threads += 2) {
        float *a = zero_buf(n), *s = nan_buf(n), *a2 = rand_buf(n, -1, 1), *s2;
        K->set_threads(threads);

        K->matmul_backward(a, dw_a, NULL, dout, inp, w, N, C, OC, 0);
        K->matmul_backward(s, dw_s, NULL, dout, inp, w, N, C, OC, TD_STORE_1);
        assert_stored("matmul dinp", s, a, n);
        assert_stored("matmul dweight, added both times", dw_s, dw_a, (size_t)OC * C);

        memset(a, 0, n * sizeof(float)), free(s), s = nan_buf(n);
        K->layernorm_backward(a, NULL, NULL, dx, inp, lw, mean, rstd, N, C, 0);
        K->layernorm_backward(s, NULL, NULL, dx, inp, lw, mean, rstd, N, C, TD_STORE_1);
        assert_stored("layernorm dinp", s, a, n);

        memset(a, 0, n * sizeof(float)), free(s), s = nan_buf(n);
        K->gelu_backward(a, inp, dx, n, 0);
        K->gelu_backward(s, inp, dx, n, TD_STORE_1);
        assert_stored("gelu dinp", s, a, n);

        /* residual: dinp1 stored, dinp2 added onto a2, and the other way round */
        for (int st = TD_STORE_1; st <= TD_STORE_2; st <<= 1) {
            float *z = zero_buf(n), *want2 = malloc(n * sizeof(float));
            assert_non_null(want2);
            memcpy(want2, a2, n * sizeof(float));
            free(s), s = nan_buf(n);
            s2 = malloc(n * sizeof(float));
            assert_non_null(s2);
            memcpy(s2, a2, n * sizeof(float));
            K->residual_backward(z, want2, dx, n, 0);
            if (st == TD_STORE_1)
                K->residual_backward(s, s2, dx, n, st);
            else
                K->residual_backward(s2, s, dx, n, st);
            assert_stored("residual, the stored one", s, z, n);
            assert_stored("residual, the added one", s2, want2, n);
            free(z), free(want2), free(s2);
        }
        free(a), free(s), free(a2);

        store_attention_case(2, 2, 40, 40, 1, 8, 1);
        store_attention_case(2, 2, 40, 40, 1, 40, 1);
        store_attention_case(2, 3, 30, 30, 0, 7, 0);
        store_attention_case(3, 2, 1, 50, 0, 1, 0);
    }
    K->set_threads(1);
    free(inp), free(w), free(dout), free(dx), free(lw), free(lb), free(mean), free(rstd),
        free(lout);
    free(dw_a), free(dw_s);
}

/* ---- the team ----------------------------------------------------------------------------- */

/* Many small jobs back to back on a team of 3 (on any number of cores): each task must run
 * exactly once with its own job's arguments. residual_backward accumulates (dinp += dout), its
 * tasks are spans of 16384 floats, and each job here has 2 to 5 of them and a dout of its own
 * value, so a task run twice, run with another job's arguments or not run at all leaves a
 * value that is not the exact sum (small integers, exact in float). A race of that kind is
 * rare by nature (an earlier team, whose helper could claim a task of the next job with the
 * previous job's task count, failed about once in 600,000 jobs of a stress of this shape), so
 * this is a guard, not a proof; test_gpt's threads test holds whole training runs to the bit. */
static void test_team_each_task_once(void **state)
{
    enum { SPAN_F = 16384, JOBS = 40000 };
    float *d = zero_buf(5 * SPAN_F), *ones = malloc(5 * SPAN_F * sizeof(float));
    float *twos = malloc(5 * SPAN_F * sizeof(float));
    double want[5] = {0};

    assert_true(ones != NULL && twos != NULL);
    for (int i = 0; i < 5 * SPAN_F; i++)
        ones[i] = 1.0f, twos[i] = 2.0f;
    K->set_threads(3);
    for (int j = 0; j < JOBS; j++) {
        int spans = 2 + j % 4;
        K->residual_backward(d, NULL, j % 3 == 0 ? twos : ones, (size_t)spans * SPAN_F, 0);
        for (int s = 0; s < spans; s++)
            want[s] += j % 3 == 0 ? 2.0 : 1.0;
    }
    K->set_threads(1);
    for (int s = 0; s < 5; s++)
        for (int i = 0; i < SPAN_F; i++)
            if (d[s * SPAN_F + i] != (float)want[s])
                fail_msg("span %d [%d]: %.1f, want %.1f", s, i, d[s * SPAN_F + i], want[s]);
    free(d);
    free(ones);
    free(twos);
}

/* ---- padded softmax cross-entropy, sums of squares, scaling --------------------------------- */

/* V = 5 real columns of Vp = 8: the loss and probabilities equal the unpadded ones exactly
 * (same operations on the same numbers), the padding's probabilities are 0 and its gradient
 * is left as it was, whatever its logits hold. */
static void test_softmax_xent_padded(void **state)
{
    int N = 3, V = 5, Vp = 8;
    float *lp = rand_buf((size_t)N * Vp, -2, 2), *l = zero_buf((size_t)N * V);
    float *pp = zero_buf((size_t)N * Vp), *p = zero_buf((size_t)N * V);
    float *dp = malloc((size_t)N * Vp * sizeof(float)), *d = zero_buf((size_t)N * V);
    int targets[3] = {4, 0, 2};
    float loss_p, loss, dloss = 1.0f;

    for (int i = 0; i < N; i++) {
        memcpy(l + i * V, lp + i * Vp, (size_t)V * sizeof(float));
        lp[i * Vp + 6] = 1e30f; /* padding: would dominate a softmax over all Vp */
    }
    for (int i = 0; i < N * Vp; i++)
        dp[i] = 0.5f;
    K->softmax_xent_forward(&loss_p, pp, lp, targets, N, V, Vp);
    K->softmax_xent_forward(&loss, p, l, targets, N, V, V);
    assert_true(loss_p == loss);
    K->softmax_xent_backward(dp, &dloss, pp, targets, N, V, Vp);
    K->softmax_xent_backward(d, &dloss, p, targets, N, V, V);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < Vp; j++) {
            if (j < V) {
                assert_true(pp[i * Vp + j] == p[i * V + j]);
                assert_true(dp[i * Vp + j] == 0.5f + d[i * V + j]);
            } else {
                assert_true(pp[i * Vp + j] == 0.0f);
                assert_true(dp[i * Vp + j] == 0.5f);
            }
        }
    free(lp);
    free(l);
    free(pp);
    free(p);
    free(dp);
    free(d);
}

/* The fused classifier against softmax_xent_forward + softmax_xent_backward into a zeroed
 * buffer with dloss 1: the same float operations on the same numbers in the same order, so the
 * loss and every dlogit are equal bit for bit (no tolerance); the padding columns come out 0
 * whatever their logits held; the answer does not depend on the thread count (rows are cut by
 * N alone); grad 0 leaves the logits as they were and gives the same loss. N = 300 rows make
 * several row tasks. */
static void test_softmax_xent_fused(void **state)
{
    enum { N = 300, V = 50, Vp = 64 };
    float *l = rand_buf((size_t)N * Vp, -4, 4), *probs = zero_buf((size_t)N * Vp);
    float *d = zero_buf((size_t)N * Vp), *f1 = malloc((size_t)N * Vp * sizeof(float));
    float *f3 = malloc((size_t)N * Vp * sizeof(float)), *e = malloc((size_t)N * Vp * sizeof(float));
    int *targets = malloc(N * sizeof(int));
    float loss, loss1, loss3, loss_e, dloss = 1.0f;

    assert_true(f1 != NULL && f3 != NULL && e != NULL && targets != NULL);
    for (int i = 0; i < N; i++) {
        targets[i] = (i * 7) % V;
        l[(size_t)i * Vp + V + 3] = 1e30f; /* padding: would dominate a softmax over all Vp */
    }
    l[5 * Vp + targets[5]] = 30.0f; /* a near-certain row, and one whose target underflows */
    l[6 * Vp + (targets[6] + 1) % V] = 80.0f;
    memcpy(f1, l, (size_t)N * Vp * sizeof(float));
    memcpy(f3, l, (size_t)N * Vp * sizeof(float));
    memcpy(e, l, (size_t)N * Vp * sizeof(float));
    K->softmax_xent_forward(&loss, probs, l, targets, N, V, Vp);
    K->softmax_xent_backward(d, &dloss, probs, targets, N, V, Vp);
    K->set_threads(1);
    K->softmax_xent_fused(&loss1, f1, targets, N, V, Vp, 1);
    K->set_threads(3);
    K->softmax_xent_fused(&loss3, f3, targets, N, V, Vp, 1);
    K->softmax_xent_fused(&loss_e, e, targets, N, V, Vp, 0);
    K->set_threads(1);
    assert_true(loss1 == loss);
    assert_true(loss3 == loss);
    assert_true(loss_e == loss);
    assert_memory_equal(e, l, (size_t)N * Vp * sizeof(float));
    assert_memory_equal(f1, f3, (size_t)N * Vp * sizeof(float));
    for (int i = 0; i < N; i++)
        for (int j = 0; j < Vp; j++) {
            float want = j < V ? d[(size_t)i * Vp + j] : 0.0f;
            if (f1[(size_t)i * Vp + j] != want)
                fail_msg("dlogits[%d][%d]: %g, want %g", i, j, f1[(size_t)i * Vp + j], want);
        }
    free(l);
    free(probs);
    free(d);
    free(f1);
    free(f3);
    free(e);
    free(targets);
}

/* sumsq in double of 1..1000 (odd length: the tail) is exactly 333833500; scale multiplies. */
static void test_sumsq_and_scale(void **state)
{
    size_t n = 1001;
    float *x = malloc(n * sizeof(float));
    double ss = 0;

    for (size_t i = 0; i < n; i++)
        x[i] = (float)i;
    K->sumsq(&ss, x, n);
    assert_true(ss == 333833500.0);
    K->scale(x, 0.5f, n);
    assert_true(x[1000] == 500.0f && x[3] == 1.5f);
    free(x);
}

/* ---- optimizers ----------------------------------------------------------------------------- */

/* Two AdamW steps (lr 0.01, betas 0.9/0.999, eps 1e-8, weight decay 0.1) against
 * torch.optim.AdamW's formula evaluated in double by hand:
 *   p *= 1 - lr*wd; m += (1-b1)(g-m); v = b2 v + (1-b2) g^2;
 *   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
 * e.g. step 1 of p=0.5, g=0.1: p = 0.4995 - 0.1*0.01/(0.1+1e-8) = 0.489500001. Tolerance
 * 1e-6 relative for p and m: a few float32 roundings. v gets 2e-5: the job's betas are
 * float32, and 0.999f is 0.99900001287, so 1 - beta2 is 1.3e-5 (relatively) short of the
 * 0.001 the hand values use; that moves an update by ~6e-6 of itself, far below p's
 * tolerance. Element 2 has a zero gradient (only
 * the decay moves it), element 3 a large one (the update is ~lr whatever the gradient's size). */
static void test_adamw_two_steps(void **state)
{
    float p[4] = {0.5f, -1.0f, 2.0f, 0.25f};
    float m[4] = {0}, v[4] = {0};
    const float g1[4] = {0.1f, -0.2f, 0.0f, 3.0f}, g2[4] = {-0.05f, 0.3f, 0.01f, 3.0f};
    const double p1[4] = {0.489500001, -0.989, 1.998, 0.23975};
    const double m1[4] = {0.01, -0.02, 0.0, 0.3}, v1[4] = {1e-05, 4e-05, 0.0, 0.009};
    const double p2[4] = {0.486347131, -0.990488019, 1.98856064, 0.22951025};
    const double m2[4] = {0.004, 0.012, 0.001, 0.57},
                 v2[4] = {1.249e-05, 0.00012996, 1e-07, 0.017991};

    K->adamw_update(p, m, v, g1, 4, 0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 1);
    for (int i = 0; i < 4; i++) {
        assert_close(p[i], p1[i], 1e-6, 1e-9, "p after step 1", (size_t)i);
        assert_close(m[i], m1[i], 1e-6, 1e-9, "m after step 1", (size_t)i);
        assert_close(v[i], v1[i], 2e-5, 1e-12, "v after step 1", (size_t)i);
    }
    K->adamw_update(p, m, v, g2, 4, 0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 2);
    for (int i = 0; i < 4; i++) {
        assert_close(p[i], p2[i], 1e-6, 1e-9, "p after step 2", (size_t)i);
        assert_close(m[i], m2[i], 1e-6, 1e-9, "m after step 2", (size_t)i);
        assert_close(v[i], v2[i], 2e-5, 1e-12, "v after step 2", (size_t)i);
    }
}

/* Fills a with n pseudo-random floats in [-r, r) (a fixed LCG: the same values every run). */
static void fill_lcg(float *a, size_t n, float r, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        a[i] = r * ((float)(seed >> 8) / 8388608.0f - 1.0f);
    }
}

/* adamw_flat over spans equals what the trainer did before it, bit for bit: scale over the
 * whole buffer by clip_scale's factor, then adamw_update tensor by tensor with weight_decay
 * where the tensor decays. Four tensors, decay mixed, padding between them (left untouched),
 * three steps: one clipped (norm 7.x > 0.5), one unclipped (factor exactly 1), one whose
 * factor is NaN (a NaN loss: nothing at all is written). Exact: the same arithmetic. */
static void test_adamw_flat_vs_per_tensor(void **state)
{
    enum { N = 1000 };
    static float p[N], m[N], v[N], g[N], p2[N], m2[N], v2[N], g2[N];
    const td_adamw_span spans[4] = {
        {.offset = 0, .n = 300, .decay = 1},
        {.offset = 304, .n = 7, .decay = 0},
        {.offset = 320, .n = 500, .decay = 1},
        {.offset = 832, .n = 160, .decay = 0},
    };
    const float max_norm[3] = {0.5f, 1e9f, 0.5f};

    fill_lcg(p, N, 1.0f, 1);
    memcpy(p2, p, sizeof(p));
    memset(m, 0, sizeof(m)), memset(v, 0, sizeof(v));
    memset(m2, 0, sizeof(m)), memset(v2, 0, sizeof(v));
    for (int t = 1; t <= 3; t++) {
        float loss = t == 3 ? NAN : 2.5f, out[2];
        double ss, norm;

        fill_lcg(g, N, 0.5f, 100u + (uint32_t)t);
        for (int i = 0; i < 4; i++) /* the padding's gradient stays zero, as td_params' */
            for (size_t j = (i < 3 ? spans[i].offset + spans[i].n : 992);
                 j < (i < 3 ? spans[i + 1].offset : N); j++)
                g[j] = 0.0f;
        memcpy(g2, g, sizeof(g));

        K->sumsq(&ss, g, N);
        norm = sqrt(ss);
        K->clip_scale(out, &ss, &loss, max_norm[t - 1]);
        if (t == 1)
            assert_true(norm > 0.5 && out[0] == (float)(0.5f / (norm + 1e-6)));
        if (t == 2)
            assert_true(out[0] == 1.0f);
        if (t == 3)
            assert_true(isnan(out[0]));
        assert_memory_equal(&out[1], &loss, sizeof(loss));
        K->adamw_flat(p, m, v, g, N, spans, 4, out, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);

        if (t == 3) /* the old trainer skipped the step altogether */
            continue;
        if (max_norm[t - 1] > 0.0f && norm > max_norm[t - 1])
            K->scale(g2, (float)(max_norm[t - 1] / (norm + 1e-6)), N);
        for (int i = 0; i < 4; i++) {
            size_t o = spans[i].offset;
            K->adamw_update(p2 + o, m2 + o, v2 + o, g2 + o, spans[i].n, 1e-2f, 0.9f, 0.95f, 1e-8f,
                            spans[i].decay ? 0.1f : 0.0f, t);
        }
    }
    assert_memory_equal(p, p2, sizeof(p));
    assert_memory_equal(m, m2, sizeof(m));
    assert_memory_equal(v, v2, sizeof(v));
    assert_memory_equal(g, g2, sizeof(g));
    for (int j = 300; j < 304; j++) /* padding: untouched */
        assert_true(m[j] == 0.0f && v[j] == 0.0f);

    /* no loss (a replica without rows): factor from the norm alone, loss 0 */
    {
        double ss = 4.0;
        float out[2];

        K->clip_scale(out, &ss, NULL, 1.0f);
        assert_true(out[0] == (float)(1.0 / (2.0 + 1e-6)) && out[1] == 0.0f);
        ss = INFINITY;
        K->clip_scale(out, &ss, NULL, 0.0f);
        assert_true(isnan(out[0]));
    }
}

/* sgd_flat is the trainer's old SGD step bit for bit: scale by clip_scale's factor where it
 * clips, then sgd_update over the buffer; momentum and weight decay on, then momentum 0 (no
 * buffer); three steps: clipped, unclipped (factor exactly 1), a NaN loss (nothing written). */
static void test_sgd_flat_vs_host_clip(void **state)
{
    enum { N = 777 };
    static float p[N], b[N], g[N], p2[N], b2[N], g2[N];
    const float max_norm[3] = {0.5f, 1e9f, 0.5f};

    for (int mom = 0; mom < 2; mom++) {
        fill_lcg(p, N, 1.0f, 7);
        memcpy(p2, p, sizeof(p));
        memset(b, 0, sizeof(b)), memset(b2, 0, sizeof(b2));
        for (int t = 1; t <= 3; t++) {
            float loss = t == 3 ? NAN : 1.25f, out[2];
            double ss, norm;
            fill_lcg(g, N, 0.5f, 200u + (uint32_t)t);
            memcpy(g2, g, sizeof(g));
            K->sumsq(&ss, g, N);
            norm = sqrt(ss);
            K->clip_scale(out, &ss, &loss, max_norm[t - 1]);
            K->sgd_flat(p, mom ? b : NULL, g, N, out, 0.1f, mom ? 0.9f : 0.0f, 0.01f);
            if (t == 3)
                continue;
            if (norm > max_norm[t - 1])
                K->scale(g2, (float)(max_norm[t - 1] / (norm + 1e-6)), N);
            K->sgd_update(p2, mom ? b2 : NULL, g2, N, 0.1f, mom ? 0.9f : 0.0f, 0.01f);
        }
        assert_memory_equal(p, p2, sizeof(p));
        assert_memory_equal(b, b2, sizeof(b));
        assert_memory_equal(g, g2, sizeof(g));
    }
}

/* torch.optim.SGD (momentum 0.9, dampening 0, weight decay 0.01 added to the gradient), lr
 * 0.1, the same gradient twice, by hand:
 *   step 1: g = (0.5, 0.25) + 0.01 (1, -2) = (0.51, 0.23); buf = g; p = (0.949, -2.023)
 *   step 2: g = (0.50949, 0.22977); buf = 0.9 (0.51, 0.23) + g = (0.96849, 0.43677);
 *           p = (0.852151, -2.0666770)
 * Tolerance 1e-6 relative, float32 rounding. Without momentum there is no buffer at all. */
static void test_sgd_momentum(void **state)
{
    float p[2] = {1.0f, -2.0f}, buf[2] = {0, 0};
    const float g[2] = {0.5f, 0.25f};
    float q[2] = {1.0f, -2.0f};

    K->sgd_update(p, buf, g, 2, 0.1f, 0.9f, 0.01f);
    assert_close(p[0], 0.949, 1e-6, 0, "p", 0);
    assert_close(p[1], -2.023, 1e-6, 0, "p", 1);
    assert_close(buf[0], 0.51, 1e-6, 0, "buf", 0);
    K->sgd_update(p, buf, g, 2, 0.1f, 0.9f, 0.01f);
    assert_close(buf[0], 0.96849, 1e-6, 0, "buf", 0);
    assert_close(buf[1], 0.43677, 1e-6, 0, "buf", 1);
    assert_close(p[0], 0.852151, 1e-6, 0, "p", 0);
    assert_close(p[1], -2.066677, 1e-6, 0, "p", 1);

    K->sgd_update(q, NULL, g, 2, 0.1f, 0.0f, 0.0f);
    assert_close(q[0], 0.95, 1e-6, 0, "plain sgd", 0);
    assert_close(q[1], -2.025, 1e-6, 0, "plain sgd", 1);
}

static void test_zero_and_name(void **state)
{
    float p[5] = {1, 2, 3, 4, 5};

    K->zero(p, 4);
    assert_true(p[0] == 0.0f && p[3] == 0.0f && p[4] == 5.0f);
    assert_string_equal(K->name, "cpu");
}

/* The CUDA probe: on a box without a GPU or driver it reports 0 devices, not an error; with
 * one, at least 1. Any other outcome must be TD_ECUDA with the count cleared. */
static void test_cuda_probe(void **state)
{
#ifdef TD_HAVE_CUDA
    int n = -1;
    int rc = td_cuda_device_count(&n);

    if (rc == 0)
        assert_true(n >= 0);
    else {
        assert_int_equal(rc, TD_ECUDA);
        assert_int_equal(n, 0);
    }
    print_message("cuda devices: %d (rc %d)\n", n, rc);
#else
    skip();
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_forward_vs_naive),
        cmocka_unit_test(test_matmul_backward_fd),
        cmocka_unit_test(test_matmul_backward_accumulates),
        cmocka_unit_test(test_store_forms),
        cmocka_unit_test(test_bias_fd),
        cmocka_unit_test(test_relu_fd),
        cmocka_unit_test(test_relu_nan_passes),
        cmocka_unit_test(test_softmax_xent_by_hand),
        cmocka_unit_test(test_softmax_xent_stable),
        cmocka_unit_test(test_softmax_xent_fd),
        cmocka_unit_test(test_argmax_correct),
        cmocka_unit_test(test_encoder_fd),
        cmocka_unit_test(test_layernorm),
        cmocka_unit_test(test_gelu),
        cmocka_unit_test(test_residual),
        cmocka_unit_test(test_residual_layernorm),
        cmocka_unit_test(test_attention_forward_vs_double),
        cmocka_unit_test(test_attention_fd),
        cmocka_unit_test(test_attention_accumulates),
        cmocka_unit_test(test_team_each_task_once),
        cmocka_unit_test(test_softmax_xent_padded),
        cmocka_unit_test(test_softmax_xent_fused),
        cmocka_unit_test(test_sumsq_and_scale),
        cmocka_unit_test(test_adamw_two_steps),
        cmocka_unit_test(test_adamw_flat_vs_per_tensor),
        cmocka_unit_test(test_sgd_flat_vs_host_clip),
        cmocka_unit_test(test_sgd_momentum),
        cmocka_unit_test(test_zero_and_name),
        cmocka_unit_test(test_cuda_probe),
    };

    K = td_kernels_cpu();
    return cmocka_run_group_tests(tests, NULL, NULL);
}
