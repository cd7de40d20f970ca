/* The CPU backend of kernels.h: every matmul (forward and all three backward products, the
 * bias gradient included) goes through OpenBLAS cblas_sgemm; the elementwise and per-row ops
 * are plain C loops that the compiler vectorizes. Stateless; owns nothing. */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <string.h>

#include "kernels.h"

/* The elementwise loops are built twice, for AVX2 and for any x86-64, and the loader picks one
 * (GCC function multiversioning, an ifunc): twice the lanes where the CPU has them, without
 * -march=native. Not "fma": contracting a*b+c would round differently from the baseline
 * clone, and both clones must give the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
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

// Stable softmax (the row's max subtracted before exp) and its cross-entropy. The loss of a
// row is log(sum exp(x - max)) - (x[target] - max), which stays exact where the target's
// probability underflows to 0; rows accumulate in double before the mean. A NaN or infinite
// logit makes the loss NaN, which the trainer reports.
// loss is (1), probs is (N,V), logits is (N,V), targets is (N)
static void softmax_xent_forward(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V)
{
    double total = 0.0;

    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * V;
        float *p = probs + (size_t)i * V;
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
        total += log(sum) - ((double)x[targets[i]] - maxv);
    }
    total /= N;
    *loss = total > FLT_MAX ? INFINITY : (float)total; /* C leaves the overflowing cast undefined */
}

// dlogits += dloss/N * (probs - onehot(targets))
// dlogits is (N,V), dloss is (1), probs is (N,V), targets is (N)
static void softmax_xent_backward(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V)
{
    float scale = *dloss / (float)N;

    for (int i = 0; i < N; i++) {
        const float *p = probs + (size_t)i * V;
        float *d = dlogits + (size_t)i * V;
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

static const td_kernels cpu_kernels = {
    .name = "cpu",
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
    .adamw_update = adamw_update,
    .sgd_update = sgd_update,
};

/* The CPU table; static, never NULL. */
const td_kernels *td_kernels_cpu(void)
{
    return &cpu_kernels;
}
