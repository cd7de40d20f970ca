/* The CPU backend of kernels.h, its ops and its table: every matmul (forward and all three
 * backward products, the bias gradient included) and the fused attention's products go through
 * OpenBLAS cblas_sgemm; the elementwise and per-row ops are plain C loops that the compiler
 * vectorizes. Every op shares its work out to the calling thread's team (cpu_team.h): tasks of
 * a fixed size, set by the op's shape alone and claimed by whichever thread is free, each
 * writing its own outputs, so the results have the same bits whatever the team's size. A
 * matmul is cut into tiles of rows (or columns), each an sgemm of its own, which computes every
 * output element exactly as the whole call would (td__cpu_sgemm). Owns nothing; the teams are
 * cpu_team.c's. Any thread. */
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn_plan.h"
#include "kernels/cpu_int.h"
#include "kernels/cpu_team.h"
#include "kernels/kernels.h"
#include "common/td_panic.h"

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

/* ---- tasks over a range: an elementwise op cut into spans of SPAN floats -------------------- */

#define SPAN 16384 /* floats per task of an elementwise op: 64 KiB, a few microseconds */

typedef struct span_job span_job;
struct span_job {
    void (*fn)(const span_job *j, size_t i0, size_t i1);
    size_t n;
    float *p[3];
    const float *c[2];
    float s[8];
    int store; /* a backward's TD_STORE_ mask */
};

static void span_task(void *ctx, int task)
{
    const span_job *j = ctx;
    size_t i0 = (size_t)task * SPAN, i1 = i0 + SPAN < j->n ? i0 + SPAN : j->n;

    j->fn(j, i0, i1);
}

static void run_spans(const span_job *j)
{
    td__cpu_team_run((int)((j->n + SPAN - 1) / SPAN), span_task, (void *)j);
}

/* Tasks of about `grain` rows each over n rows (never more than `most` tasks): the same cut
 * for any team. */
static int row_tasks(int n, int grain, int most, int *per)
{
    int tasks = (n + grain - 1) / grain;

    tasks = tasks > most ? most : tasks < 1 ? 1 : tasks;
    *per = (n + tasks - 1) / tasks;
    return n > 0 ? (n + *per - 1) / *per : 0;
}

/* ---- GPT-2's constants and the float helpers of the row ops ------------------------------- */

#define LN_EPS      1e-5f               /* layernorm's variance epsilon, PyTorch's default */
#define GELU_K      0.7978845608028654f /* sqrt(2/pi) */
#define GELU_C      0.044715f           /* the cubic term of GELU's tanh form */
#define EXP_LO      -87.3f              /* below this fexp() answers exp(EXP_LO) ~ 1e-38 */
#define EXP_HI      88.3f               /* above this fexp() answers exp(EXP_HI) ~ 2e38 */
#define ROUND_MAGIC 12582912.0f         /* 1.5 * 2^23: adding it rounds to an integer */

#define ROW_GRAIN  16  /* rows per task of a per-row op (layernorm, softmax, encoder) */
#define ROW_TASKS  256 /* tasks of a per-row op at most: its partial sums live on the stack */
#define COL_BLOCK  64  /* columns per task of a sum over rows (bias, layernorm, wte gradients) */
#define SUMSQ_PART 64  /* partial sums of sumsq at most */

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

/* ---- sums over rows, by columns ------------------------------------------------------------- */

// dst[j] += src[i][j] for i in [0,N), j in [c0,c1): each column in row order
// dst is (C), src is (N,C)
TD_VECTOR_CLONES
static void add_rows(float *restrict dst, const float *restrict src, int N, int C, int c0, int c1)
{
    for (int i = 0; i < N; i++) {
        const float *s = src + (size_t)i * C;
        for (int j = c0; j < c1; j++)
            dst[j] += s[j];
    }
}

typedef struct cols_job {
    float *dst;
    const float *src;
    int N, C;
} cols_job;

static void cols_task(void *ctx, int task)
{
    const cols_job *j = ctx;
    int c0 = task * COL_BLOCK, c1 = c0 + COL_BLOCK < j->C ? c0 + COL_BLOCK : j->C;

    add_rows(j->dst, j->src, j->N, j->C, c0, c1);
}

// dbias += sum over rows of dout, column blocks shared out
// dbias is (C), dout is (N,C)
static void sum_rows(float *dbias, const float *dout, int N, int C)
{
    cols_job j = {dbias, dout, N, C};

    td__cpu_team_run((C + COL_BLOCK - 1) / COL_BLOCK, cols_task, &j);
}

/* ---- the ops ---------------------------------------------------------------------------- */

static void zero_span(const span_job *j, size_t i0, size_t i1)
{
    memset(j->p[0] + i0, 0, (i1 - i0) * sizeof(float));
}

static void zero(float *p, size_t n)
{
    span_job j = {.fn = zero_span, .n = n, .p = {p}};

    run_spans(&j);
}

typedef struct bias_job {
    float *out;
    const float *inp, *bias;
    int N, C, per;
} bias_job;

static void bias_rows_task(void *ctx, int task)
{
    const bias_job *j = ctx;
    int i1 = (task + 1) * j->per < j->N ? (task + 1) * j->per : j->N;

    for (int i = task * j->per; i < i1; i++) {
        float *out_i = j->out + (size_t)i * j->C;
        if (j->inp == NULL) {
            memcpy(out_i, j->bias, (size_t)j->C * sizeof(float));
            continue;
        }
        const float *inp_i = j->inp + (size_t)i * j->C;
        for (int c = 0; c < j->C; c++)
            out_i[c] = inp_i[c] + j->bias[c];
    }
}

// out = inp . weight^T + bias: the bias is copied into every row, then sgemm adds (beta 1)
// out is (N,OC), inp is (N,C), weight is (OC,C), bias is (OC) or NULL
static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC)
{
    float beta = 0.0f;

    if (bias != NULL) {
        bias_job j = {out, NULL, bias, N, OC, 0};
        td__cpu_team_run(row_tasks(N, ROW_GRAIN * 4, ROW_TASKS, &j.per), bias_rows_task, &j);
        beta = 1.0f;
    }
    td__cpu_sgemm(CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

// dinp += dout . weight; dweight += dout^T . inp; dbias += sum over rows of dout. Storing dinp
// is beta 0, which OpenBLAS does by zeroing it and then adding the same partial products as
// beta 1 does: the bits of accumulating into zeros
// dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dbias is (OC) or NULL,
// dout is (N,OC), inp is (N,C), weight is (OC,C)
static void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int store)
{
    if (dinp != NULL)
        td__cpu_sgemm(CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                      store & TD_STORE_1 ? 0.0f : 1.0f, dinp, C);
    if (dweight != NULL)
        td__cpu_sgemm(CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
    if (dbias != NULL)
        sum_rows(dbias, dout, N, OC);
}

// out = inp + bias by row
// out is (N,C), inp is (N,C), bias is (C)
static void bias_forward(float *out, const float *inp, const float *bias, int N, int C)
{
    bias_job j = {out, inp, bias, N, C, 0};

    td__cpu_team_run(row_tasks(N, ROW_GRAIN * 4, ROW_TASKS, &j.per), bias_rows_task, &j);
}

static void add_span(const span_job *j, size_t i0, size_t i1);

// dinp += dout; dbias += sum over rows of dout
// dinp is (N,C) or NULL, dbias is (C) or NULL, dout is (N,C)
static void bias_backward(float *dinp, float *dbias, const float *dout, int N, int C)
{
    if (dinp != NULL) {
        span_job j = {.fn = add_span, .n = (size_t)N * C, .p = {dinp}, .c = {dout}};
        run_spans(&j);
    }
    if (dbias != NULL)
        sum_rows(dbias, dout, N, C);
}

// out = inp < 0 ? 0 : inp (a NaN input compares false and passes through)
// out is (n), inp is (n)
TD_VECTOR_CLONES
static void relu_forward_n(float *out, const float *inp, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = inp[i] < 0.0f ? 0.0f : inp[i];
}

static void relu_forward_span(const span_job *j, size_t i0, size_t i1)
{
    relu_forward_n(j->p[0] + i0, j->c[0] + i0, i1 - i0);
}

static void relu_forward(float *out, const float *inp, size_t n)
{
    span_job j = {.fn = relu_forward_span, .n = n, .p = {out}, .c = {inp}};

    run_spans(&j);
}

// dinp += out > 0 ? dout : 0
// dinp is (n), dout is (n), out is (n)
TD_VECTOR_CLONES
static void relu_backward_n(float *restrict dinp, const float *restrict dout,
                            const float *restrict out, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float d = dout[i]; /* loaded unconditionally, so the loop vectorizes as a select */
        dinp[i] += out[i] > 0.0f ? d : 0.0f;
    }
}

static void relu_backward_span(const span_job *j, size_t i0, size_t i1)
{
    relu_backward_n(j->p[0] + i0, j->c[0] + i0, j->c[1] + i0, i1 - i0);
}

static void relu_backward(float *dinp, const float *dout, const float *out, size_t n)
{
    span_job j = {.fn = relu_backward_span, .n = n, .p = {dinp}, .c = {dout, out}};

    run_spans(&j);
}

typedef struct xent_job {
    float *probs;
    const float *logits, *dloss, *cprobs;
    const int *targets;
    float *dlogits;
    int N, V, Vp, per, grad;
    double part[ROW_TASKS];
} xent_job;

// Rows of the stable softmax (the row's max subtracted before exp) and their cross-entropy
// over the first V of Vp columns; the padding's probabilities are 0. The loss of a row is
// log(sum exp(x - max)) - (x[target] - max), which stays exact where the target's probability
// underflows to 0; a task's rows add up in double into its partial sum.
static void xent_forward_task(void *ctx, int task)
{
    xent_job *J = ctx;
    int V = J->V, Vp = J->Vp, i1 = (task + 1) * J->per < J->N ? (task + 1) * J->per : J->N;
    double total = 0.0;

    for (int i = task * J->per; i < i1; i++) {
        const float *x = J->logits + (size_t)i * Vp;
        float *p = J->probs + (size_t)i * Vp;
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
        total += log(sum) - ((double)x[J->targets[i]] - maxv);
    }
    J->part[task] = total;
}

// The mean loss over rows: the tasks' partial sums (a cut set by N alone) added in task order,
// in double. A NaN or infinite logit makes the loss NaN, which the trainer reports.
// loss is (1), probs is (N,Vp), logits is (N,Vp), targets is (N)
static void softmax_xent_forward(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V, int Vp)
{
    xent_job *J =
        &(xent_job){.probs = probs, .logits = logits, .targets = targets, .N = N, .V = V, .Vp = Vp};
    int tasks = row_tasks(N, ROW_GRAIN, ROW_TASKS, &J->per);
    double total = 0.0;

    td__cpu_team_run(tasks, xent_forward_task, J);
    for (int t = 0; t < tasks; t++)
        total += J->part[t];
    total /= N;
    *loss = total > FLT_MAX ? INFINITY : (float)total; /* C leaves the overflowing cast undefined */
}

static void xent_backward_task(void *ctx, int task)
{
    const xent_job *J = ctx;
    float scale = *J->dloss / (float)J->N;
    int i1 = (task + 1) * J->per < J->N ? (task + 1) * J->per : J->N;

    for (int i = task * J->per; i < i1; i++) {
        const float *p = J->cprobs + (size_t)i * J->Vp;
        float *d = J->dlogits + (size_t)i * J->Vp;
        for (int j = 0; j < J->V; j++)
            d[j] += scale * (p[j] - (j == J->targets[i] ? 1.0f : 0.0f));
    }
}

// dlogits[:, :V] += dloss/N * (probs - onehot(targets)); the padding's gradient stays as it is
// dlogits is (N,Vp), dloss is (1), probs is (N,Vp), targets is (N)
static void softmax_xent_backward(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V, int Vp)
{
    xent_job *J = &(xent_job){.cprobs = probs,
                              .dloss = dloss,
                              .targets = targets,
                              .dlogits = dlogits,
                              .N = N,
                              .V = V,
                              .Vp = Vp};

    td__cpu_team_run(row_tasks(N, ROW_GRAIN, ROW_TASKS, &J->per), xent_backward_task, J);
}

// The fused classifier's rows: the forward's softmax and loss, arithmetic for arithmetic (so
// the loss has softmax_xent_forward's bits), then, where J->grad is set, the row overwritten
// with softmax_xent_backward's dlogits for dloss 1 (1/N * (p - onehot), padding 0) instead of kept
// as probs: the row's exps live in the logits' own row between the two passes.
static void xent_fused_task(void *ctx, int task)
{
    xent_job *J = ctx;
    int V = J->V, Vp = J->Vp, i1 = (task + 1) * J->per < J->N ? (task + 1) * J->per : J->N;
    float scale = 1.0f / (float)J->N; /* softmax_xent_backward's *dloss / N, dloss 1 */
    double total = 0.0;

    for (int i = task * J->per; i < i1; i++) {
        float *x = J->dlogits + (size_t)i * Vp;
        float maxv = x[0];
        double sum = 0.0;
        int t = J->targets[i];

        for (int j = 1; j < V; j++)
            if (x[j] > maxv)
                maxv = x[j];
        for (int j = 0; j < V; j++)
            sum += expf(x[j] - maxv);
        total += log(sum) - ((double)x[t] - maxv);
        if (!J->grad)
            continue;
        float inv = (float)(1.0 / sum);
        for (int j = 0; j < V; j++) {
            float p = expf(x[j] - maxv) * inv;
            x[j] = scale * (p - (j == t ? 1.0f : 0.0f));
        }
        for (int j = V; j < Vp; j++)
            x[j] = 0.0f;
    }
    J->part[task] = total;
}

// The loss as softmax_xent_forward sums it (same cut, same order); logits become the dlogits
// (of a loss whose gradient is 1) in place when grad, and are left as they are otherwise.
// loss is (1), logits is (N,Vp), targets is (N)
static void softmax_xent_fused(float *loss, float *logits, const int *targets, int N, int V, int Vp,
                               int grad)
{
    xent_job *J =
        &(xent_job){.dlogits = logits, .grad = grad, .targets = targets, .N = N, .V = V, .Vp = Vp};
    int tasks = row_tasks(N, ROW_GRAIN, ROW_TASKS, &J->per);
    double total = 0.0;

    td__cpu_team_run(tasks, xent_fused_task, J);
    for (int t = 0; t < tasks; t++)
        total += J->part[t];
    total /= N;
    *loss = total > FLT_MAX ? INFINITY : (float)total;
}

typedef struct argmax_job {
    const float *logits;
    const int *targets;
    int N, V, per;
    int64_t part[ROW_TASKS];
} argmax_job;

static void argmax_task(void *ctx, int task)
{
    argmax_job *J = ctx;
    int i1 = (task + 1) * J->per < J->N ? (task + 1) * J->per : J->N;
    int64_t c = 0;

    for (int i = task * J->per; i < i1; i++) {
        const float *x = J->logits + (size_t)i * J->V;
        int best = 0;
        for (int j = 1; j < J->V; j++)
            if (x[j] > x[best])
                best = j;
        c += best == J->targets[i];
    }
    J->part[task] = c;
}

// correct = rows whose first largest logit sits at the target
// correct is (1), logits is (N,V), targets is (N)
static void argmax_correct(int64_t *correct, const float *logits, const int *targets, int N, int V)
{
    argmax_job *J = &(argmax_job){.logits = logits, .targets = targets, .N = N, .V = V};
    int tasks = row_tasks(N, ROW_GRAIN, ROW_TASKS, &J->per);
    int64_t c = 0;

    td__cpu_team_run(tasks, argmax_task, J);
    for (int t = 0; t < tasks; t++)
        c += J->part[t];
    *correct = c;
}

typedef struct enc_job {
    float *out, *dwte, *dwpe;
    const int *inp;
    const float *wte, *wpe, *dout;
    int B, T, C, per;
} enc_job;

static void encoder_forward_task(void *ctx, int task)
{
    const enc_job *J = ctx;
    int BT = J->B * J->T, C = J->C, r1 = (task + 1) * J->per < BT ? (task + 1) * J->per : BT;

    for (int r = task * J->per; r < r1; r++) {
        float *o = J->out + (size_t)r * C;
        const float *e = J->wte + (size_t)J->inp[r] * C;
        const float *p = J->wpe + (size_t)(r % J->T) * C;
        for (int i = 0; i < C; i++)
            o[i] = e[i] + p[i];
    }
}

// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
// out is (B,T,C), inp is (B,T), wte is (V,C), wpe is (maxT,C)
static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C)
{
    enc_job J = {.out = out, .inp = inp, .wte = wte, .wpe = wpe, .B = B, .T = T, .C = C};

    td__cpu_team_run(row_tasks(B * T, ROW_GRAIN, ROW_TASKS, &J.per), encoder_forward_task, &J);
}

// Columns [c0, c1) of every (b,t), in (b,t) order
static void encoder_backward_task(void *ctx, int task)
{
    const enc_job *J = ctx;
    int C = J->C, c0 = task * COL_BLOCK, c1 = c0 + COL_BLOCK < C ? c0 + COL_BLOCK : C;

    for (int r = 0; r < J->B * J->T; r++) {
        const float *d = J->dout + (size_t)r * C;
        if (J->dwte != NULL) {
            float *e = J->dwte + (size_t)J->inp[r] * C;
            for (int i = c0; i < c1; i++)
                e[i] += d[i];
        }
        if (J->dwpe != NULL) {
            float *p = J->dwpe + (size_t)(r % J->T) * C;
            for (int i = c0; i < c1; i++)
                p[i] += d[i];
        }
    }
}

// dwte[inp[b,t],:] += dout[b,t,:]; dwpe[t,:] += dout[b,t,:]; in (b,t) order, so a token seen
// twice collects its gradients in the same order every time; column blocks shared out
// dwte is (V,C) or NULL, dwpe is (maxT,C) or NULL, dout is (B,T,C), inp is (B,T)
static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C)
{
    enc_job J = {.dwte = dwte, .dwpe = dwpe, .dout = dout, .inp = inp, .B = B, .T = T, .C = C};

    if (dwte != NULL || dwpe != NULL)
        td__cpu_team_run((C + COL_BLOCK - 1) / COL_BLOCK, encoder_backward_task, &J);
}

typedef struct ln_job {
    float *out, *mean, *rstd, *dinp, *dweight, *dbias, *res;
    const float *inp, *weight, *bias, *dout, *cmean, *crstd, *a, *b;
    int N, C, per, row_tasks, store;
} ln_job;

// llm.c's layernorm of rows [i0, i1): mean, then the biased variance around it,
// rstd = 1/sqrt(var + eps)
// out is (N,C), mean and rstd are (N), inp is (N,C), weight and bias are (C)
TD_VECTOR_CLONES
static void layernorm_forward_rows(float *out, float *mean, float *rstd, const float *inp,
                                   const float *weight, const float *bias, int i0, int i1, int C)
{
    for (int i = i0; i < i1; i++) {
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

static void layernorm_forward_task(void *ctx, int task)
{
    const ln_job *J = ctx;
    int i0 = task * J->per, i1 = i0 + J->per < J->N ? i0 + J->per : J->N;

    layernorm_forward_rows(J->out, J->mean, J->rstd, J->inp, J->weight, J->bias, i0, i1, J->C);
}

// out is (N,C), mean and rstd are (N), inp is (N,C), weight and bias are (C)
static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
    ln_job J = {.out = out,
                .mean = mean,
                .rstd = rstd,
                .inp = inp,
                .weight = weight,
                .bias = bias,
                .N = N,
                .C = C};

    td__cpu_team_run(row_tasks(N, ROW_GRAIN, ROW_TASKS, &J.per), layernorm_forward_task, &J);
}

// The residual stream's sum and its layernorm in one pass over rows [i0, i1): res = a + b by row,
// then layernorm_forward_rows of that row while it is in cache: the bits of residual_forward
// and then layernorm_forward
static void residual_layernorm_task(void *ctx, int task)
{
    const ln_job *J = ctx;
    int i0 = task * J->per, i1 = i0 + J->per < J->N ? i0 + J->per : J->N;

    for (int i = i0; i < i1; i++) {
        size_t at = (size_t)i * J->C;
        for (int j = 0; j < J->C; j++)
            J->res[at + j] = J->a[at + j] + J->b[at + j];
        layernorm_forward_rows(J->out, J->mean, J->rstd, J->res, J->weight, J->bias, i, i + 1,
                               J->C);
    }
}

// res = a + b, out = layernorm(res)
// res and out are (N,C), mean and rstd are (N), a and b are (N,C), weight and bias are (C)
static void residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C)
{
    ln_job J = {.out = out,
                .mean = mean,
                .rstd = rstd,
                .res = res,
                .a = a,
                .b = b,
                .weight = weight,
                .bias = bias,
                .N = N,
                .C = C};

    td__cpu_team_run(row_tasks(N, ROW_GRAIN, ROW_TASKS, &J.per), residual_layernorm_task, &J);
}

// llm.c's layernorm backward of rows [i0, i1): with norm = (x - mean) rstd and
// dnorm = weight * dout, dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm))
TD_VECTOR_CLONES
static void layernorm_backward_rows(float *dinp, const float *dout, const float *inp,
                                    const float *weight, const float *mean, const float *rstd,
                                    int i0, int i1, int C, int store)
{
    for (int i = i0; i < i1; i++) {
        const float *d = dout + (size_t)i * C;
        const float *x = inp + (size_t)i * C;
        float m = mean[i], s = rstd[i];
        float a1[8] = {0}, a2[8] = {0}, dnorm_mean, dnorm_norm_mean;
        int j;

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
            di[j] = (store ? 0.0f : di[j]) +
                    (weight[j] * d[j] - dnorm_mean - norm * dnorm_norm_mean) * s;
        }
    }
}

// dweight[j] += sum over rows of norm * dout, dbias[j] += sum over rows of dout, for columns
// [c0, c1), each in row order
TD_VECTOR_CLONES
static void layernorm_backward_cols(float *dweight, float *dbias, const float *dout,
                                    const float *inp, const float *mean, const float *rstd, int N,
                                    int C, int c0, int c1)
{
    for (int i = 0; i < N; i++) {
        const float *d = dout + (size_t)i * C;
        const float *x = inp + (size_t)i * C;
        float m = mean[i], s = rstd[i];
        if (dbias != NULL)
            for (int j = c0; j < c1; j++)
                dbias[j] += d[j];
        if (dweight != NULL)
            for (int j = c0; j < c1; j++)
                dweight[j] += ((x[j] - m) * s) * d[j];
    }
}

// Tasks [0, row_tasks) are blocks of rows of dinp, the rest blocks of columns of dweight and
// dbias
static void layernorm_backward_task(void *ctx, int task)
{
    const ln_job *J = ctx;

    if (task < J->row_tasks) {
        int i0 = task * J->per, i1 = i0 + J->per < J->N ? i0 + J->per : J->N;
        layernorm_backward_rows(J->dinp, J->dout, J->inp, J->weight, J->cmean, J->crstd, i0, i1,
                                J->C, J->store);
    } else {
        int c0 = (task - J->row_tasks) * COL_BLOCK;
        int c1 = c0 + COL_BLOCK < J->C ? c0 + COL_BLOCK : J->C;
        layernorm_backward_cols(J->dweight, J->dbias, J->dout, J->inp, J->cmean, J->crstd, J->N,
                                J->C, c0, c1);
    }
}

// dinp is (N,C) or NULL, dweight and dbias are (C) or NULL, dout and inp are (N,C),
// weight is (C), mean and rstd are (N)
static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C, int store)
{
    ln_job J = {.dinp = dinp,
                .dweight = dweight,
                .dbias = dbias,
                .dout = dout,
                .inp = inp,
                .weight = weight,
                .cmean = mean,
                .crstd = rstd,
                .N = N,
                .C = C,
                .store = store & TD_STORE_1};
    int cols = dweight != NULL || dbias != NULL ? (C + COL_BLOCK - 1) / COL_BLOCK : 0;

    J.row_tasks = dinp != NULL ? row_tasks(N, ROW_GRAIN, ROW_TASKS, &J.per) : 0;
    td__cpu_team_run(J.row_tasks + cols, layernorm_backward_task, &J);
}

// GELU's tanh form through 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): out = x / (1 + exp(-2u)),
// u = sqrt(2/pi) (x + 0.044715 x^3). Same function, no cancellation near 0, and fexp
// vectorizes where tanhf does not.
// out is (n), inp is (n)
TD_VECTOR_CLONES
static void gelu_forward_n(float *restrict out, const float *restrict inp, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        out[i] = x / (1.0f + fexp(-2.0f * u));
    }
}

static void gelu_forward_span(const span_job *j, size_t i0, size_t i1)
{
    gelu_forward_n(j->p[0] + i0, j->c[0] + i0, i1 - i0);
}

static void gelu_forward(float *out, const float *inp, size_t n)
{
    span_job j = {.fn = gelu_forward_span, .n = n, .p = {out}, .c = {inp}};

    run_spans(&j);
}

// With s = 1/(1 + exp(-2u)) = (1 + tanh u)/2, sech^2 u = 4 s (1 - s), so
// GELU'(x) = s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 0.044715 x^2)
// dinp is (n), inp is (n), dout is (n); store: dinp = 0 + ..., never read
TD_VECTOR_CLONES
static void gelu_backward_n(float *restrict dinp, const float *restrict inp,
                            const float *restrict dout, size_t n, int store)
{
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        float s = 1.0f / (1.0f + fexp(-2.0f * u));
        float du = GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        dinp[i] = (store ? 0.0f : dinp[i]) + (s + 2.0f * x * s * (1.0f - s) * du) * dout[i];
    }
}

static void gelu_backward_span(const span_job *j, size_t i0, size_t i1)
{
    gelu_backward_n(j->p[0] + i0, j->c[0] + i0, j->c[1] + i0, i1 - i0, j->store & TD_STORE_1);
}

static void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n, int store)
{
    span_job j = {.fn = gelu_backward_span, .n = n, .p = {dinp}, .c = {inp, dout}, .store = store};

    run_spans(&j);
}

// out = inp1 + inp2
// out, inp1, inp2 are (n)
TD_VECTOR_CLONES
static void residual_forward_n(float *out, const float *inp1, const float *inp2, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = inp1[i] + inp2[i];
}

static void residual_forward_span(const span_job *j, size_t i0, size_t i1)
{
    residual_forward_n(j->p[0] + i0, j->c[0] + i0, j->c[1] + i0, i1 - i0);
}

static void residual_forward(float *out, const float *inp1, const float *inp2, size_t n)
{
    span_job j = {.fn = residual_forward_span, .n = n, .p = {out}, .c = {inp1, inp2}};

    run_spans(&j);
}

// dst += src
// dst is (n), src is (n)
TD_VECTOR_CLONES
static void add_n(float *restrict dst, const float *restrict src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] += src[i];
}

static void add_span(const span_job *j, size_t i0, size_t i1)
{
    add_n(j->p[0] + i0, j->c[0] + i0, i1 - i0);
}

// dst = 0 + src (accumulating into zeros, bit for bit: -0 becomes +0)
// dst is (n), src is (n)
TD_VECTOR_CLONES
static void store_n(float *restrict dst, const float *restrict src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = 0.0f + src[i];
}

static void add2_span(const span_job *j, size_t i0, size_t i1)
{
    for (int a = 0; a < 2; a++)
        if (j->p[a] != NULL && j->store & (TD_STORE_1 << a))
            store_n(j->p[a] + i0, j->c[0] + i0, i1 - i0);
        else if (j->p[a] != NULL)
            add_n(j->p[a] + i0, j->c[0] + i0, i1 - i0);
}

// dinp1 += dout; dinp2 += dout (each stored instead when store names it)
// dinp1 and dinp2 are (n) or NULL, dout is (n)
static void residual_backward(float *dinp1, float *dinp2, const float *dout, size_t n, int store)
{
    span_job j = {.fn = add2_span, .n = n, .p = {dinp1, dinp2}, .c = {dout}, .store = store};

    run_spans(&j);
}

/* ---- fused attention ------------------------------------------------------------------------
 *
 * The plan's blocks one after another (attn_plan.h: whole sequences, or rows of every sequence,
 * the same blocks the CUDA table's batched calls take), a task per (sequence, head) of a block:
 * its rows cut again into sgemms of at most ATT_BLOCK rows when causal (a causal sgemm then
 * stops at its last row's diagonal, so the upper triangle is mostly never computed),
 * ATT_BLOCK_FULL without a mask; a (rows, Nk) block of scores stays in the core's cache. A task
 * keeps its scores in its pair's part of the block (rows * cols floats), and writes only its
 * head's columns of out, lse, dq, dk and dv. A plan's blocks start at multiples of ATT_BLOCK
 * (or hold whole sequences) whenever its chunk is a multiple of ATT_BLOCK, and then the sgemms
 * and softmax rows of a causal forward are those of the (B,NH,T,T) attention this op replaced,
 * so its out has the same bits. */

#define ATT_BLOCK 64 /* query rows per sgemm of the attention */
/* The same without a mask, where no diagonal cuts the sgemms short: every block packs all the
 * keys and values again, and four times fewer blocks cut that packing four times (sensorlm's
 * tiny preset, N = 720, hs = 16: a step 8% faster on one thread). Its (256, Nk) blocks of
 * scores and of their gradient still stay in a core's L2 at N = 720 (1.5 MB). */
#define ATT_BLOCK_FULL 256

// Row softmax in place over a[0..n), a[n..cols) = 0; *lse = log sum exp a[0..n)
// a is (cols)
TD_VECTOR_CLONES
static void softmax_row(float *a, int n, int cols, float *lse)
{
    float mx[8], maxv, sum, inv;
    int j = 0;

    for (int l = 0; l < 8; l++)
        mx[l] = a[0];
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++)
            mx[l] = a[j + l] > mx[l] ? a[j + l] : mx[l];
    for (; j < n; j++)
        mx[j & 7] = a[j] > mx[j & 7] ? a[j] : mx[j & 7];
    maxv = mx[0];
    for (int l = 1; l < 8; l++)
        maxv = mx[l] > maxv ? mx[l] : maxv;
    for (j = 0; j < n; j++)
        a[j] = fexp(a[j] - maxv);
    sum = sum8(a, n);
    inv = 1.0f / sum;
    for (j = 0; j < n; j++)
        a[j] *= inv;
    for (j = n; j < cols; j++)
        a[j] = 0.0f;
    *lse = maxv + logf(sum);
}

// The softmax of one row again from its scores and lse, then its gradient in place over dp:
// p[j] = exp(s[j] - lse) for j < n, 0 past; dp[j] = scale p[j] (dp[j] - D)
// p is (cols) (scores in, probabilities out), dp is (cols) (dout . v in, dS out)
TD_VECTOR_CLONES
static void softmax_row_backward(float *restrict p, float *restrict dp, float lse, float D,
                                 float scale, int n, int cols)
{
    for (int j = 0; j < n; j++)
        p[j] = fexp(p[j] - lse);
    for (int j = n; j < cols; j++)
        p[j] = 0.0f;
    for (int j = 0; j < cols; j++)
        dp[j] = scale * (p[j] * (dp[j] - D));
}

/* Query rows per sgemm: ATT_BLOCK when causal, else ATT_BLOCK_FULL; at most the chunk. */
static int att_block(const td_attn_dims *d)
{
    int b = d->causal ? ATT_BLOCK : ATT_BLOCK_FULL;

    return d->chunk < b ? d->chunk : b;
}

typedef struct attn_job {
    float *out, *lse, *scratch, *dq, *dk, *dv;
    const float *q, *k, *v, *dout, *o, *clse;
    const td_attn_dims *d;
    const td_attn_block *blk; /* the plan's block the tasks are of */
    int store;                /* the backward's TD_STORE_ mask */
} attn_job;

/* One (sequence, head)'s pointers: q, k, v and out at its first row and column. */
typedef struct attn_head {
    size_t q, k, v, o; /* float offsets into q (and dq), k, v, out (and dout) */
    int C;             /* floats in a row of out: NH * hs */
} attn_head;

static attn_head head_of(const td_attn_dims *d, int bh)
{
    int b = bh / d->NH, h = bh % d->NH;
    attn_head a;

    a.C = d->NH * d->hs;
    a.q = (size_t)b * d->Nq * d->ldq + (size_t)h * d->hs;
    a.k = (size_t)b * d->Nk * d->ldk + (size_t)h * d->hs;
    a.v = (size_t)b * d->Nk * d->ldv + (size_t)h * d->hs;
    a.o = (size_t)b * d->Nq * a.C + (size_t)h * d->hs;
    return a;
}

/* Task p of a block: the pair (b0 + p / NH, p % NH), its scores at p * rows * cols floats of the
 * block's scratch (attn_plan.h's layout), its rows in sgemms of att_block rows. */
static void attention_forward_task(void *ctx, int p)
{
    const attn_job *J = ctx;
    const td_attn_dims *d = J->d;
    const td_attn_block *K = J->blk;
    int bh = K->b0 * d->NH + p;
    attn_head a = head_of(d, bh);
    const float *q = J->q + a.q, *k = J->k + a.k, *v = J->v + a.v;
    float *out = J->out + a.o, *lse = J->lse + (size_t)bh * d->Nq;
    float *s = J->scratch + (size_t)p * K->rows * K->cols;
    float scale = 1.0f / sqrtf((float)d->hs);
    int blk = att_block(d), rend = K->r0 + K->rows;

    for (int s0 = K->r0; s0 < rend; s0 += blk) {
        int rows = rend - s0 < blk ? rend - s0 : blk, cols = d->causal ? s0 + rows : d->Nk;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d->hs, scale,
                    q + (size_t)s0 * d->ldq, d->ldq, k, d->ldk, 0.0f, s, cols);
        for (int t = 0; t < rows; t++)
            softmax_row(s + (size_t)t * cols, d->causal ? s0 + t + 1 : cols, cols, lse + s0 + t);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d->hs, cols, 1.0f, s, cols, v,
                    d->ldv, 0.0f, out + (size_t)s0 * a.C, a.C);
    }
}

// out is (B,Nq,NH*hs), lse is (B,NH,Nq), scratch is td_attn_scratch(d, 0),
// q is (B,Nq,ldq), k is (B,Nk,ldk), v is (B,Nk,ldv)
static void attention_forward(float *out, float *lse, float *scratch, const float *q,
                              const float *k, const float *v, const td_attn_dims *d)
{
    attn_job J = {.out = out, .lse = lse, .scratch = scratch, .q = q, .k = k, .v = v, .d = d};
    td_attn_block blk = {0};

    if (d->chunk < 1)
        td_panic(TD_EINVAL, "attention: a chunk of %d query rows", d->chunk);
    J.blk = &blk;
    while (td_attn_next(d, &blk))
        td__cpu_team_run(blk.nb * d->NH, attention_forward_task, &J);
}

/* D_i = dout_i . out_i for every query row of pair bh, into the scratch's head. */
static void attention_d_task(void *ctx, int bh)
{
    const attn_job *J = ctx;
    const td_attn_dims *d = J->d;
    attn_head a = head_of(d, bh);
    const float *dout = J->dout + a.o, *o = J->o + a.o;
    float *D = J->scratch + (size_t)bh * d->Nq;

    for (int i = 0; i < d->Nq; i++)
        D[i] = dot8(dout + (size_t)i * a.C, o + (size_t)i * a.C, d->hs);
}

// rows (rows, cols) ld floats apart = 0
static void zero_cols(float *p, int rows, int cols, int ld)
{
    for (int i = 0; i < rows; i++)
        memset(p + (size_t)i * ld, 0, (size_t)cols * sizeof(float));
}

// Per block of rows: P = exp(scale q k^T - lse) again, dP = dout v^T, dv += P^T dout,
// dS = scale P (dP - D) (D_i = dout_i . out_i), dq += dS k, dk += dS^T q; a stored gradient's
// head columns zeroed first (dq's rows of the block; dk's and dv's at the pair's first block,
// r0 = 0), the sgemms then as they accumulate, so stored and accumulated bits agree. The scratch
// holds D (B*NH*Nq) first, then the block's P (B*NH*chunk*Nk floats of room), then its dP; task p
// of a block is its pair p, as the forward's.
static void attention_backward_task(void *ctx, int p)
{
    const attn_job *J = ctx;
    const td_attn_dims *d = J->d;
    const td_attn_block *K = J->blk;
    int bh = K->b0 * d->NH + p;
    attn_head a = head_of(d, bh);
    size_t nd = (size_t)d->B * d->NH * d->Nq, block = (size_t)d->B * d->NH * d->chunk * d->Nk;
    size_t slot = (size_t)p * K->rows * K->cols;
    const float *q = J->q + a.q, *k = J->k + a.k, *v = J->v + a.v;
    const float *dout = J->dout + a.o, *lse = J->clse + (size_t)bh * d->Nq;
    float *dq = J->dq != NULL ? J->dq + a.q : NULL, *dk = J->dk != NULL ? J->dk + a.k : NULL;
    float *dv = J->dv != NULL ? J->dv + a.v : NULL, *D = J->scratch + (size_t)bh * d->Nq;
    float *pp = J->scratch + nd + slot, *dp = J->scratch + nd + block + slot;
    float scale = 1.0f / sqrtf((float)d->hs);
    int blk = att_block(d), rend = K->r0 + K->rows;

    if (dq != NULL && J->store & TD_STORE_1)
        zero_cols(dq + (size_t)K->r0 * d->ldq, K->rows, d->hs, d->ldq);
    if (dk != NULL && J->store & TD_STORE_2 && K->r0 == 0)
        zero_cols(dk, d->Nk, d->hs, d->ldk);
    if (dv != NULL && J->store & TD_STORE_3 && K->r0 == 0)
        zero_cols(dv, d->Nk, d->hs, d->ldv);
    for (int s0 = K->r0; s0 < rend; s0 += blk) {
        int rows = rend - s0 < blk ? rend - s0 : blk, cols = d->causal ? s0 + rows : d->Nk;
        const float *qs = q + (size_t)s0 * d->ldq, *gs = dout + (size_t)s0 * a.C;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d->hs, scale, qs, d->ldq,
                    k, d->ldk, 0.0f, pp, cols);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, d->hs, 1.0f, gs, a.C, v,
                    d->ldv, 0.0f, dp, cols);
        for (int t = 0; t < rows; t++)
            softmax_row_backward(pp + (size_t)t * cols, dp + (size_t)t * cols, lse[s0 + t],
                                 D[s0 + t], scale, d->causal ? s0 + t + 1 : cols, cols);
        if (dv != NULL)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, d->hs, rows, 1.0f, pp, cols,
                        gs, a.C, 1.0f, dv, d->ldv);
        if (dq != NULL)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d->hs, cols, 1.0f, dp,
                        cols, k, d->ldk, 1.0f, dq + (size_t)s0 * d->ldq, d->ldq);
        if (dk != NULL)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, d->hs, rows, 1.0f, dp, cols,
                        qs, d->ldq, 1.0f, dk, d->ldk);
    }
}

// dq, dk, dv like q, k, v (or NULL), scratch is td_attn_scratch(d, 1), dout and out are
// (B,Nq,NH*hs), lse is (B,NH,Nq)
static void attention_backward(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const td_attn_dims *d, int store)
{
    attn_job J = {.scratch = scratch,
                  .dq = dq,
                  .dk = dk,
                  .dv = dv,
                  .q = q,
                  .k = k,
                  .v = v,
                  .dout = dout,
                  .o = out,
                  .clse = lse,
                  .d = d,
                  .store = store};
    td_attn_block blk = {0};

    if (d->chunk < 1)
        td_panic(TD_EINVAL, "attention: a chunk of %d query rows", d->chunk);
    if (d->causal && d->Nq != d->Nk)
        td_panic(TD_EINVAL, "attention: causal with %d queries and %d keys", d->Nq, d->Nk);
    if (dq == NULL && dk == NULL && dv == NULL)
        return;
    J.blk = &blk;
    if (d->Nq > 0 && d->Nk > 0)
        td__cpu_team_run(d->B * d->NH, attention_d_task, &J);
    while (td_attn_next(d, &blk))
        td__cpu_team_run(blk.nb * d->NH, attention_backward_task, &J);
}

/* ---- sums of squares, scaling, optimizers -------------------------------------------------- */

typedef struct sumsq_job {
    const float *p;
    size_t n, per;
    double part[SUMSQ_PART];
} sumsq_job;

// The sum of squares of one part in eight double partial sums, added pairwise
TD_VECTOR_CLONES
static double sumsq_n(const float *p, size_t n)
{
    double acc[8] = {0};
    size_t i = 0;

    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += (double)p[i + l] * (double)p[i + l];
    for (; i < n; i++)
        acc[i & 7] += (double)p[i] * (double)p[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static void sumsq_task(void *ctx, int task)
{
    sumsq_job *J = ctx;
    size_t i0 = (size_t)task * J->per, i1 = i0 + J->per < J->n ? i0 + J->per : J->n;

    J->part[task] = sumsq_n(J->p + i0, i1 - i0);
}

// sumsq = sum of p[i]^2: up to SUMSQ_PART parts (a cut set by n alone, each a multiple of 8
// long) summed in double, then the parts added in order: a fixed order
// sumsq is (1), p is (n)
static void sumsq(double *out, const float *p, size_t n)
{
    sumsq_job *J = &(sumsq_job){.p = p, .n = n};
    size_t parts = (n + SPAN - 1) / SPAN;
    double total = 0.0;

    parts = parts > SUMSQ_PART ? SUMSQ_PART : parts < 1 ? 1 : parts;
    J->per = ((n + parts - 1) / parts + 7) / 8 * 8;
    J->per = J->per > 0 ? J->per : 8;
    parts = (n + J->per - 1) / J->per;
    td__cpu_team_run((int)parts, sumsq_task, J);
    for (size_t i = 0; i < parts; i++)
        total += J->part[i];
    *out = total;
}

// p *= s
// p is (n)
TD_VECTOR_CLONES
static void scale_n(float *p, float s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] *= s;
}

static void scale_span(const span_job *j, size_t i0, size_t i1)
{
    scale_n(j->p[0] + i0, j->s[0], i1 - i0);
}

static void scale(float *p, float s, size_t n)
{
    span_job j = {.fn = scale_span, .n = n, .p = {p}, .s = {s}};

    run_spans(&j);
}

// One AdamW step of n elements in the order torch.optim.AdamW's single-tensor path computes
// it, with the scalars of adamw_update
// param, m, v, grad are (n)
TD_VECTOR_CLONES
static void adamw_n(float *restrict param, float *restrict m, float *restrict v,
                    const float *restrict grad, size_t n, float beta2, float eps, float step_size,
                    float bc2_sqrt, float decay, float w1, float w2)
{
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

static void adamw_span(const span_job *j, size_t i0, size_t i1)
{
    const float *s = j->s;

    adamw_n(j->p[0] + i0, j->p[1] + i0, j->p[2] + i0, j->c[0] + i0, i1 - i0, s[0], s[1], s[2], s[3],
            s[4], s[5], s[6]);
}

// The bias corrections are computed in double, as PyTorch computes them in Python floats.
// param, m, v, grad are (n)
static void adamw_update(float *param, float *m, float *v, const float *grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    double bc1 = 1.0 - pow(beta1, (double)t);
    double bc2 = 1.0 - pow(beta2, (double)t);
    span_job j = {.fn = adamw_span, .n = n, .p = {param, m, v}, .c = {grad}};

    j.s[0] = beta2;
    j.s[1] = eps;
    j.s[2] = (float)(lr / bc1); /* step size */
    j.s[3] = (float)sqrt(bc2);  /* sqrt of the second bias correction */
    j.s[4] = 1.0f - lr * weight_decay;
    j.s[5] = 1.0f - beta1;
    j.s[6] = 1.0f - beta2;
    run_spans(&j);
}

// The clip's factor from the sum of squares and the loss, as the trainer computed it on the
// host before adamw_flat (double norm and coefficient)
// out is (2), sumsq is (1), loss is (1) or NULL
static void clip_scale(float *out, const double *sumsq, const float *loss, float max_norm)
{
    double norm = sqrt(*sumsq);
    float l = loss != NULL ? *loss : 0.0f;

    if (!isfinite(l) || !isfinite(norm))
        out[0] = NAN;
    else if (max_norm > 0.0f && norm > max_norm)
        out[0] = (float)(max_norm / (norm + 1e-6));
    else
        out[0] = 1.0f;
    out[1] = l;
}

// The clip over the whole buffer (scale), then adamw_update span by span: exactly the per-tensor
// path the trainer took before, bit for bit
// param, m, v, grad are (n), spans is (nspans), factor is (1)
static void adamw_flat(float *param, float *m, float *v, float *grad, size_t n,
                       const td_adamw_span *spans, int nspans, const float *factor, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    float s = *factor;

    if (!isfinite(s))
        return;
    if (s != 1.0f)
        scale(grad, s, n);
    for (int i = 0; i < nspans; i++) {
        size_t o = spans[i].offset;
        adamw_update(param + o, m + o, v + o, grad + o, spans[i].n, lr, beta1, beta2, eps,
                     spans[i].decay ? weight_decay : 0.0f, t);
    }
}

// One SGD step with momentum (dampening 0) and L2 weight decay folded into the gradient.
// param, buf, grad are (n); buf NULL when momentum is 0
TD_VECTOR_CLONES
static void sgd_n(float *restrict param, float *restrict buf, const float *restrict grad, size_t n,
                  float lr, float momentum, float weight_decay)
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

static void sgd_span(const span_job *j, size_t i0, size_t i1)
{
    sgd_n(j->p[0] + i0, j->p[1] != NULL ? j->p[1] + i0 : NULL, j->c[0] + i0, i1 - i0, j->s[0],
          j->s[1], j->s[2]);
}

static void sgd_update(float *param, float *buf, const float *grad, size_t n, float lr,
                       float momentum, float weight_decay)
{
    span_job j = {
        .fn = sgd_span, .n = n, .p = {param, buf}, .c = {grad}, .s = {lr, momentum, weight_decay}};

    run_spans(&j);
}

// The clip (scale), then sgd_update: the trainer's host-clipped step, bit for bit
// param, buf, grad are (n), factor is (1)
static void sgd_flat(float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
                     float momentum, float weight_decay)
{
    float s = *factor;

    if (!isfinite(s))
        return;
    if (s != 1.0f)
        scale(grad, s, n);
    sgd_update(param, buf, grad, n, lr, momentum, weight_decay);
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
    .alloc_host = cpu_alloc,
    .free_host = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .upload_async = cpu_copy,
    .set_threads = td__cpu_team_set_threads,
    .zero = zero,
    .matmul_forward = matmul_forward,
    .matmul_backward = matmul_backward,
    .bias_forward = bias_forward,
    .bias_backward = bias_backward,
    .relu_forward = relu_forward,
    .relu_backward = relu_backward,
    .softmax_xent_forward = softmax_xent_forward,
    .softmax_xent_backward = softmax_xent_backward,
    .softmax_xent_fused = softmax_xent_fused,
    .argmax_correct = argmax_correct,
    .encoder_forward = encoder_forward,
    .encoder_backward = encoder_backward,
    .layernorm_forward = layernorm_forward,
    .residual_layernorm_forward = residual_layernorm_forward,
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
    .clip_scale = clip_scale,
    .adamw_flat = adamw_flat,
    .sgd_update = sgd_update,
    .sgd_flat = sgd_flat,
    .token_mean_forward = td__cpu_token_mean_forward,
    .token_mean_backward = td__cpu_token_mean_backward,
    .gather_rows_forward = td__cpu_gather_rows_forward,
    .gather_rows_backward = td__cpu_gather_rows_backward,
    .l2norm_forward = td__cpu_l2norm_forward,
    .l2norm_backward = td__cpu_l2norm_backward,
    .siglip_forward = td__cpu_siglip_forward,
    .siglip_backward = td__cpu_siglip_backward,
};

/* The CPU table; static, never NULL. */
const td_kernels *td_kernels_cpu(void)
{
    return &cpu_kernels;
}
