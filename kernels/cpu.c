/* The CPU backend of kernels.h: every matmul (forward and all three backward products, the
 * bias gradient included) goes through OpenBLAS cblas_sgemm; the elementwise and per-row ops
 * are plain C loops that the compiler vectorizes. Stateless; owns nothing. */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* The elementwise loops are built twice, for AVX2 and for any x86-64, and the loader picks one
 * (GCC function multiversioning, an ifunc): twice the lanes where the CPU has them, without
 * -march=native. Not "fma": contracting a*b+c would round differently from the baseline
 * clone, and both clones must give the same bits. Not under a sanitizer: the ifunc resolver
 * runs before the sanitizer's runtime is up, and its instrumented code crashes there. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__) && !defined(__SANITIZE_ADDRESS__)
#define TD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TD_VECTOR_CLONES
#endif

/* Rows summed per sgemm call for a bias gradient: a row of ones this long lives in .rodata. */
#define ONES_LEN 256 /* floats */

static const float ones[ONES_LEN] = {[0 ... ONES_LEN - 1] = 1.0f};

/* OpenBLAS keeps one thread pool per process, so the last caller's count wins. */
static void set_threads(int n)
{
    openblas_set_num_threads(n);
}

static void zero(float *p, size_t n)
{
    memset(p, 0, n * sizeof(float));
}

// dbias += sum over rows of dout, as ones(1,N) . dout(N,C) through sgemm, ONES_LEN rows a call
// dbias is (C), dout is (N,C)
static void sum_rows(float *dbias, const float *dout, int N, int C)
{
    for (int r = 0; r < N; r += ONES_LEN) {
        int rows = N - r < ONES_LEN ? N - r : ONES_LEN;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, C, rows, 1.0f, ones, rows,
                    dout + (size_t)r * C, C, 1.0f, dbias, C);
    }
}

// out = inp . weight^T + bias: the bias is copied into every row, then sgemm adds (beta 1)
// out is (N,OC), inp is (N,C), weight is (OC,C), bias is (OC) or NULL
static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC)
{
    float beta = 0.0f;

    if (bias != NULL) {
        for (int i = 0; i < N; i++)
            memcpy(out + (size_t)i * OC, bias, (size_t)OC * sizeof(float));
        beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta,
                out, OC);
}

// dinp += dout . weight; dweight += dout^T . inp; dbias += ones . dout
// dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dbias is (OC) or NULL,
// dout is (N,OC), inp is (N,C), weight is (OC,C)
static void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC)
{
    if (dinp != NULL)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                    1.0f, dinp, C);
    if (dweight != NULL)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
                    dweight, C);
    if (dbias != NULL)
        sum_rows(dbias, dout, N, OC);
}

// out = inp + bias by row
// out is (N,C), inp is (N,C), bias is (C)
static void bias_forward(float *out, const float *inp, const float *bias, int N, int C)
{
    for (int i = 0; i < N; i++) {
        const float *inp_i = inp + (size_t)i * C;
        float *out_i = out + (size_t)i * C;
        for (int j = 0; j < C; j++)
            out_i[j] = inp_i[j] + bias[j];
    }
}

// dinp += dout; dbias += ones . dout
// dinp is (N,C) or NULL, dbias is (C) or NULL, dout is (N,C)
static void bias_backward(float *dinp, float *dbias, const float *dout, int N, int C)
{
    if (dinp != NULL) {
        size_t n = (size_t)N * C;
        for (size_t i = 0; i < n; i++)
            dinp[i] += dout[i];
    }
    if (dbias != NULL)
        sum_rows(dbias, dout, N, C);
}

// out = inp < 0 ? 0 : inp (a NaN input compares false and passes through)
// out is (n), inp is (n)
TD_VECTOR_CLONES
static void relu_forward(float *out, const float *inp, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = inp[i] < 0.0f ? 0.0f : inp[i];
}

// dinp += out > 0 ? dout : 0
// dinp is (n), dout is (n), out is (n)
TD_VECTOR_CLONES
static void relu_backward(float *restrict dinp, const float *restrict dout,
                          const float *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float d = dout[i]; /* loaded unconditionally, so the loop vectorizes as a select */
        dinp[i] += out[i] > 0.0f ? d : 0.0f;
    }
}

// Stable softmax (the row's max subtracted before exp) and its cross-entropy over the first V
// of Vp columns; the padding's probabilities are 0. The loss of a row is
// log(sum exp(x - max)) - (x[target] - max), which stays exact where the target's probability
// underflows to 0; rows accumulate in double before the mean. A NaN or infinite logit makes
// the loss NaN, which the trainer reports.
// loss is (1), probs is (N,Vp), logits is (N,Vp), targets is (N)
static void softmax_xent_forward(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V, int Vp)
{
    double total = 0.0;

    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        float *p = probs + (size_t)i * Vp;
        float maxv = x[0];
        double sum = 0.0;

        for (int j = 1; j < V; j++)
            if (x[j] > maxv)
                maxv = x[j];
        for (int j = 0; j < V; j++) {
            p[j] = expf(x[j] - maxv);
            sum += p[j];
        }
        float inv = (float)(1.0 / sum);
        for (int j = 0; j < V; j++)
            p[j] *= inv;
        for (int j = V; j < Vp; j++)
            p[j] = 0.0f;
        total += log(sum) - ((double)x[targets[i]] - maxv);
    }
    total /= N;
    *loss = total > FLT_MAX ? INFINITY : (float)total; /* C leaves the overflowing cast undefined */
}

// dlogits[:, :V] += dloss/N * (probs - onehot(targets)); the padding's gradient stays as it is
// dlogits is (N,Vp), dloss is (1), probs is (N,Vp), targets is (N)
static void softmax_xent_backward(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V, int Vp)
{
    float scale = *dloss / (float)N;

    for (int i = 0; i < N; i++) {
        const float *p = probs + (size_t)i * Vp;
        float *d = dlogits + (size_t)i * Vp;
        for (int j = 0; j < V; j++)
            d[j] += scale * (p[j] - (j == targets[i] ? 1.0f : 0.0f));
    }
}

// correct = rows whose first largest logit sits at the target
// correct is (1), logits is (N,V), targets is (N)
static void argmax_correct(int64_t *correct, const float *logits, const int *targets, int N, int V)
{
    int64_t c = 0;

    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * V;
        int best = 0;
        for (int j = 1; j < V; j++)
            if (x[j] > x[best])
                best = j;
        c += best == targets[i];
    }
    *correct = c;
}

// ---- GPT-2's ops ----------------------------------------------------------------------------

#define LN_EPS      1e-5f               /* layernorm's variance epsilon, PyTorch's default */
#define GELU_K      0.7978845608028654f /* sqrt(2/pi) */
#define GELU_C      0.044715f           /* the cubic term of GELU's tanh form */
#define ATT_BLOCK   64                  /* rows per causal block of an attention sgemm */
#define EXP_LO      -87.3f              /* below this fexp() answers exp(EXP_LO) ~ 1e-38 */
#define EXP_HI      88.3f               /* above this fexp() answers exp(EXP_HI) ~ 2e38 */
#define ROUND_MAGIC 12582912.0f         /* 1.5 * 2^23: adding it rounds to an integer */

// exp(x) in plain float arithmetic, so the loops that call it vectorize and every clone gives
// the same bits (glibc's expf is a call per element): x = n ln2 + r with |r| <= ln2/2, 2^n put
// together in the exponent bits, exp(r) by Cephes' expf polynomial (about 1 ulp). Inputs
// past [EXP_LO, EXP_HI] are clamped, so nothing overflows to inf or sinks into subnormals;
// a NaN stays NaN.
static inline __attribute__((always_inline)) float fexp(float x)
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

// The sum of x[0..n) in eight interleaved partial sums, added pairwise at the end: a fixed
// order (so the same bits in every clone and every call) that the compiler turns into one
// vector accumulator.
// x is (n)
static inline __attribute__((always_inline)) float sum8(const float *x, int n)
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

// The dot product of a and b in the order of sum8.
// a is (n), b is (n)
static inline __attribute__((always_inline)) float dot8(const float *a, const float *b, int n)
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

// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
// out is (B,T,C), inp is (B,T), wte is (V,C), wpe is (maxT,C)
static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            const float *e = wte + (size_t)inp[b * T + t] * C;
            const float *p = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++)
                o[i] = e[i] + p[i];
        }
}

// dwte[inp[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:]; in (b,t) order, so a token seen
// twice collects its gradients in the same order every time
// dwte is (V,C) or NULL, dwpe is (maxT,C) or NULL, dout is (B,T,C), inp is (B,T)
static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C)
{
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            if (dwte != NULL) {
                float *e = dwte + (size_t)inp[b * T + t] * C;
                for (int i = 0; i < C; i++)
                    e[i] += d[i];
            }
            if (dwpe != NULL) {
                float *p = dwpe + (size_t)t * C;
                for (int i = 0; i < C; i++)
                    p[i] += d[i];
            }
        }
}

// llm.c's layernorm: mean, then the biased variance around it, rstd = 1/sqrt(var + eps)
// out is (N,C), mean and rstd are (N), inp is (N,C), weight and bias are (C)
TD_VECTOR_CLONES
static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
    for (int i = 0; i < N; i++) {
        const float *x = inp + (size_t)i * C;
        float *o = out + (size_t)i * C;
        float m = sum8(x, C) / (float)C;
        float acc[8] = {0}, v, s;
        int j = 0;

        for (; j + 8 <= C; j += 8)
            for (int l = 0; l < 8; l++)
                acc[l] += (x[j + l] - m) * (x[j + l] - m);
        for (; j < C; j++)
            acc[j & 7] += (x[j] - m) * (x[j] - m);
        v = (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) /
            (float)C;
        s = 1.0f / sqrtf(v + LN_EPS);
        for (j = 0; j < C; j++)
            o[j] = (s * (x[j] - m)) * weight[j] + bias[j];
        mean[i] = m;
        rstd[i] = s;
    }
}

// llm.c's layernorm backward: with norm = (x - mean) rstd and dnorm = weight * dout,
// dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm))
// dinp is (N,C) or NULL, dweight and dbias are (C) or NULL, dout and inp are (N,C),
// weight is (C), mean and rstd are (N)
TD_VECTOR_CLONES
static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C)
{
    for (int i = 0; i < N; i++) {
        const float *d = dout + (size_t)i * C;
        const float *x = inp + (size_t)i * C;
        float m = mean[i], s = rstd[i];
        float a1[8] = {0}, a2[8] = {0}, dnorm_mean, dnorm_norm_mean;
        int j = 0;

        if (dbias != NULL)
            for (j = 0; j < C; j++)
                dbias[j] += d[j];
        if (dweight != NULL)
            for (j = 0; j < C; j++)
                dweight[j] += ((x[j] - m) * s) * d[j];
        if (dinp == NULL)
            continue;
        for (j = 0; j + 8 <= C; j += 8)
            for (int l = 0; l < 8; l++) {
                float dn = weight[j + l] * d[j + l];
                a1[l] += dn;
                a2[l] += dn * ((x[j + l] - m) * s);
            }
        for (; j < C; j++) {
            float dn = weight[j] * d[j];
            a1[j & 7] += dn;
            a2[j & 7] += dn * ((x[j] - m) * s);
        }
        dnorm_mean =
            (((a1[0] + a1[1]) + (a1[2] + a1[3])) + ((a1[4] + a1[5]) + (a1[6] + a1[7]))) / (float)C;
        dnorm_norm_mean =
            (((a2[0] + a2[1]) + (a2[2] + a2[3])) + ((a2[4] + a2[5]) + (a2[6] + a2[7]))) / (float)C;
        float *di = dinp + (size_t)i * C;
        for (j = 0; j < C; j++) {
            float norm = (x[j] - m) * s;
            di[j] += (weight[j] * d[j] - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}

// GELU's tanh form through 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): out = x / (1 + exp(-2u)),
// u = sqrt(2/pi) (x + 0.044715 x^3). Same function, no cancellation near 0, and fexp
// vectorizes where tanhf does not.
// out is (n), inp is (n)
TD_VECTOR_CLONES
static void gelu_forward(float *restrict out, const float *restrict inp, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        out[i] = x / (1.0f + fexp(-2.0f * u));
    }
}

// With s = 1/(1 + exp(-2u)) = (1 + tanh u)/2, sech^2 u = 4 s (1 - s), so
// GELU'(x) = s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 0.044715 x^2)
// dinp is (n), inp is (n), dout is (n)
TD_VECTOR_CLONES
static void gelu_backward(float *restrict dinp, const float *restrict inp,
                          const float *restrict dout, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        float s = 1.0f / (1.0f + fexp(-2.0f * u));
        float du = GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        dinp[i] += (s + 2.0f * x * s * (1.0f - s) * du) * dout[i];
    }
}

// out = inp1 + inp2
// out, inp1, inp2 are (n)
TD_VECTOR_CLONES
static void residual_forward(float *out, const float *inp1, const float *inp2, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = inp1[i] + inp2[i];
}

// dinp1 += dout; dinp2 += dout
// dinp1 and dinp2 are (n) or NULL, dout is (n)
TD_VECTOR_CLONES
static void residual_backward(float *restrict dinp1, float *restrict dinp2,
                              const float *restrict dout, size_t n)
{
    if (dinp1 != NULL)
        for (size_t i = 0; i < n; i++)
            dinp1[i] += dout[i];
    if (dinp2 != NULL)
        for (size_t i = 0; i < n; i++)
            dinp2[i] += dout[i];
}

// Row t of a causal attention matrix: softmax over a[0..t] in place, a[t+1..T) = 0
// a is (T)
TD_VECTOR_CLONES
static void causal_softmax_row(float *a, int t, int T)
{
    float mx[8], maxv, sum, inv;
    int j = 0;

    for (int l = 0; l < 8; l++)
        mx[l] = a[0];
    for (; j + 8 <= t + 1; j += 8)
        for (int l = 0; l < 8; l++)
            mx[l] = a[j + l] > mx[l] ? a[j + l] : mx[l];
    for (; j <= t; j++)
        mx[j & 7] = a[j] > mx[j & 7] ? a[j] : mx[j & 7];
    maxv = mx[0];
    for (int l = 1; l < 8; l++)
        maxv = mx[l] > maxv ? mx[l] : maxv;
    for (j = 0; j <= t; j++)
        a[j] = fexp(a[j] - maxv);
    sum = sum8(a, t + 1);
    inv = 1.0f / sum;
    for (j = 0; j <= t; j++)
        a[j] *= inv;
    for (j = t + 1; j < T; j++)
        a[j] = 0.0f;
}

// Row t of the softmax's backward, in place over datt: with s = att . datt over [0..t],
// dpreatt[j] = scale * att[j] (datt[j] - s) for j <= t, 0 past t
// d is (T) (datt in, dpreatt out), a is (T) (the forward's att row)
TD_VECTOR_CLONES
static void causal_softmax_row_backward(float *restrict d, const float *restrict a, float scale,
                                        int t, int T)
{
    float s = dot8(a, d, t + 1);

    for (int j = 0; j <= t; j++)
        d[j] = scale * (a[j] * (d[j] - s));
    for (int j = t + 1; j < T; j++)
        d[j] = 0.0f;
}

// One head of one sequence, with sgemm: preatt = q k^T / sqrt(hs), att = causal softmax,
// out = att v. Causal: rows come in blocks of ATT_BLOCK and each block's sgemm stops at the
// block's last column, so the upper triangle is (mostly) never computed.
// q, k, v are (T,hs) with row stride 3C; out is (T,hs) with row stride C; att is (T,T)
static void attention_head_forward(float *out, float *att, const float *q, const float *k,
                                   const float *v, int T, int C, int hs)
{
    int C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);

    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
        int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, scale,
                    q + (size_t)r0 * C3, C3, k, C3, 0.0f, att + (size_t)r0 * T, T);
        for (int t = r0; t < cols; t++)
            causal_softmax_row(att + (size_t)t * T, t, T);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f,
                    att + (size_t)r0 * T, T, v, C3, 0.0f, out + (size_t)r0 * C, C);
    }
}

// out is (B,T,C), att is (B,NH,T,T), qkv is (B,T,3C)
static void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
    int hs = C / NH;

    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            const float *q = qkv + (size_t)b * T * 3 * C + (size_t)h * hs;
            attention_head_forward(out + (size_t)b * T * C + (size_t)h * hs,
                                   att + ((size_t)b * NH + h) * T * T, q, q + C, q + 2 * C, T, C,
                                   hs);
        }
}

// One head's backward, causal blocks as in the forward:
// datt = dout v^T; dv += att^T dout; dpreatt = softmax backward; dq += dpreatt k / sqrt(hs)
// (the scale is folded into dpreatt); dk += dpreatt^T q. dv and dk of rows [r0, r0+rows)
// only see rows t >= r0, so their sgemms start there.
// dq, dk, dv, q, k, v have row stride 3C; dout has row stride C; att and d are (T,T)
static void attention_head_backward(float *dq, float *dk, float *dv, float *d, const float *dout,
                                    const float *q, const float *k, const float *v,
                                    const float *att, int T, int C, int hs)
{
    int C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)hs);

    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
        int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hs, 1.0f,
                    dout + (size_t)r0 * C, C, v, C3, 0.0f, d + (size_t)r0 * T, T);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, hs, T - r0, 1.0f,
                    att + (size_t)r0 * T + r0, T, dout + (size_t)r0 * C, C, 1.0f,
                    dv + (size_t)r0 * C3, C3);
        for (int t = r0; t < cols; t++)
            causal_softmax_row_backward(d + (size_t)t * T, att + (size_t)t * T, scale, t, T);
    }
    for (int r0 = 0; r0 < T; r0 += ATT_BLOCK) {
        int rows = T - r0 < ATT_BLOCK ? T - r0 : ATT_BLOCK, cols = r0 + rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, cols, 1.0f,
                    d + (size_t)r0 * T, T, k, C3, 1.0f, dq + (size_t)r0 * C3, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, rows, hs, T - r0, 1.0f,
                    d + (size_t)r0 * T + r0, T, q + (size_t)r0 * C3, C3, 1.0f, dk + (size_t)r0 * C3,
                    C3);
    }
}

// dqkv is (B,T,3C), scratch is (T,T), dout is (B,T,C), qkv is (B,T,3C), att is (B,NH,T,T)
static void attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH)
{
    int hs = C / NH;

    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            size_t off = (size_t)b * T * 3 * C + (size_t)h * hs;
            const float *q = qkv + off;
            float *dq = dqkv + off;
            attention_head_backward(dq, dq + C, dq + 2 * C, scratch,
                                    dout + (size_t)b * T * C + (size_t)h * hs, q, q + C, q + 2 * C,
                                    att + ((size_t)b * NH + h) * T * T, T, C, hs);
        }
}

// sumsq = sum of p[i]^2 in eight double partial sums, added pairwise: a fixed order
// sumsq is (1), p is (n)
TD_VECTOR_CLONES
static void sumsq(double *out, const float *p, size_t n)
{
    double acc[8] = {0};
    size_t i = 0;

    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += (double)p[i + l] * (double)p[i + l];
    for (; i < n; i++)
        acc[i & 7] += (double)p[i] * (double)p[i];
    *out = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// p *= s
// p is (n)
TD_VECTOR_CLONES
static void scale(float *p, float s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] *= s;
}

// One AdamW step in the order torch.optim.AdamW's single-tensor path computes it; the bias
// corrections are computed in double, as PyTorch computes them in Python floats.
// param, m, v, grad are (n)
TD_VECTOR_CLONES
static void adamw_update(float *restrict param, float *restrict m, float *restrict v,
                         const float *restrict grad, size_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int64_t t)
{
    double bc1 = 1.0 - pow(beta1, (double)t);
    double bc2 = 1.0 - pow(beta2, (double)t);
    float step_size = (float)(lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float decay = 1.0f - lr * weight_decay;
    float w1 = 1.0f - beta1, w2 = 1.0f - beta2;

    for (size_t i = 0; i < n; i++) {
        float g = grad[i];
        float mi = m[i] + w1 * (g - m[i]);
        float vi = beta2 * v[i] + w2 * g * g;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        m[i] = mi;
        v[i] = vi;
        param[i] = param[i] * decay - step_size * mi / denom;
    }
}

// One SGD step with momentum (dampening 0) and L2 weight decay folded into the gradient.
// param, buf, grad are (n); buf NULL when momentum is 0
TD_VECTOR_CLONES
static void sgd_update(float *restrict param, float *restrict buf, const float *restrict grad,
                       size_t n, float lr, float momentum, float weight_decay)
{
    for (size_t i = 0; i < n; i++) {
        float g = grad[i] + weight_decay * param[i];
        if (buf != NULL && momentum != 0.0f) {
            buf[i] = momentum * buf[i] + g;
            g = buf[i];
        }
        param[i] -= lr * g;
    }
}

/* ---- memory: host memory, so the copies are memcpy ------------------------------------ */

#define CPU_ALIGN 256 /* bytes: the CUDA backend's alignment, so layouts match across tables */

static int cpu_alloc(void **p, size_t bytes, td_error_t *err)
{
    size_t rounded = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;

    *p = aligned_alloc(CPU_ALIGN, rounded > 0 ? rounded : CPU_ALIGN);
    if (*p == NULL)
        return td_error_set(err, TD_ENOMEM, "out of host memory allocating %zu bytes", bytes);
    return 0;
}

static void cpu_free(void *p)
{
    free(p);
}

static void cpu_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes > 0 && dst != src)
        memcpy(dst, src, bytes);
}

static const td_kernels cpu_kernels = {
    .name = "cpu",
    .host = 1,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .set_threads = set_threads,
    .zero = zero,
    .matmul_forward = matmul_forward,
    .matmul_backward = matmul_backward,
    .bias_forward = bias_forward,
    .bias_backward = bias_backward,
    .relu_forward = relu_forward,
    .relu_backward = relu_backward,
    .softmax_xent_forward = softmax_xent_forward,
    .softmax_xent_backward = softmax_xent_backward,
    .argmax_correct = argmax_correct,
    .encoder_forward = encoder_forward,
    .encoder_backward = encoder_backward,
    .layernorm_forward = layernorm_forward,
    .layernorm_backward = layernorm_backward,
    .gelu_forward = gelu_forward,
    .gelu_backward = gelu_backward,
    .residual_forward = residual_forward,
    .residual_backward = residual_backward,
    .attention_forward = attention_forward,
    .attention_backward = attention_backward,
    .sumsq = sumsq,
    .scale = scale,
    .adamw_update = adamw_update,
    .sgd_update = sgd_update,
};

/* The CPU table; static, never NULL. */
const td_kernels *td_kernels_cpu(void)
{
    return &cpu_kernels;
}
