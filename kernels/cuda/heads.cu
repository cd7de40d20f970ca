/* The CUDA twins of cpu_heads.c (heads.h): a two-tower model's heads on the calling thread's
 * context. Built like ops.cu (-fmad=false, IEEE division and square root), so the ops whose
 * CPU twin adds in a fixed order do the same additions in the same order and give its bits:
 * token_mean (one thread per output, the tokens in order), gather_rows (copies and one add per
 * element) and l2norm (one thread per row, the row's sums in double in column order; rows are a
 * batch of embeddings, few and short). SigLIP's sums over all N*M terms go through the
 * context's partial sums in a grid fixed by the shape, then one thread adds the blocks in order:
 * the same bits every call; against the CPU they differ by the order of a double sum and by
 * the last bits of expf and log1pf (CUDA's and glibc's). No atomics. Owns nothing. */
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/heads.h"

extern "C" {
/* td_panic.h is C11 (_Noreturn), so its one function is declared here for C++. */
[[noreturn]] void td_panic(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
}

#define THREADS      256 /* threads per block of the elementwise kernels */
#define ROW_THREADS  64  /* threads per block of the thread-per-row kernels */
#define SIG_THREADS  256 /* threads per block of the SigLIP kernels */
#define SIG_PER      4   /* SigLIP terms per thread at least: sizes the grid */
#define SIG_MAX_GRID (TD_CUDA_REDUCE_BLOCKS / 2) /* the backward keeps two sums per block */

// ---- kernels -----------------------------------------------------------------------------------

// out[b,c] = (inp[b,0,c] + inp[b,1,c] + ...) * inv, the tokens in order as cpu_heads.c
__global__ void token_mean_forward_kernel(float *out, const float *inp, int B, int N, int C,
                                          float inv)
{
    GRID_STRIDE(i, (size_t)B * C)
    {
        size_t b = i / (size_t)C, c = i % (size_t)C;
        const float *x = inp + b * N * C + c;
        float s = 0.0f;
        for (int n = 0; n < N; n++)
            s += x[(size_t)n * C];
        out[i] = s * inv;
    }
}

__global__ void token_mean_backward_kernel(float *dinp, const float *dout, int B, int N, int C,
                                           float inv)
{
    GRID_STRIDE(i, (size_t)B * N * C)
    {
        size_t c = i % (size_t)C, b = i / ((size_t)N * C);
        dinp[i] += dout[b * C + c] * inv;
    }
}

__global__ void gather_rows_forward_kernel(float *out, const float *inp, const int *idx, int B,
                                           int T, int C)
{
    GRID_STRIDE(i, (size_t)B * C)
    {
        size_t b = i / (size_t)C, c = i % (size_t)C;
        out[i] = inp[(b * T + (size_t)idx[b]) * C + c];
    }
}

__global__ void gather_rows_backward_kernel(float *dinp, const float *dout, const int *idx, int B,
                                            int T, int C)
{
    GRID_STRIDE(i, (size_t)B * C)
    {
        size_t b = i / (size_t)C, c = i % (size_t)C;
        dinp[(b * T + (size_t)idx[b]) * C + c] += dout[i];
    }
}

// One thread per row, as cpu_heads.c: the sum of squares in double in column order
__global__ void l2norm_forward_kernel(float *out, float *norm, const float *inp, int N, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float *x;
    double ss = 0.0;
    float nrm;

    if (i >= N)
        return;
    x = inp + (size_t)i * C;
    for (int c = 0; c < C; c++)
        ss += (double)x[c] * x[c];
    nrm = (float)sqrt(ss);
    nrm = nrm > TD_L2NORM_EPS ? nrm : TD_L2NORM_EPS;
    norm[i] = nrm;
    for (int c = 0; c < C; c++)
        out[(size_t)i * C + c] = x[c] / nrm;
}

__global__ void l2norm_backward_kernel(float *dinp, const float *dout, const float *out,
                                       const float *norm, int N, int C)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float *g, *o;
    float *d, nrm, dot;
    double acc = 0.0;

    if (i >= N)
        return;
    g = dout + (size_t)i * C, o = out + (size_t)i * C, d = dinp + (size_t)i * C, nrm = norm[i];
    if (!(nrm > TD_L2NORM_EPS)) {
        for (int c = 0; c < C; c++)
            d[c] += g[c] / nrm;
        return;
    }
    for (int c = 0; c < C; c++)
        acc += (double)g[c] * o[c];
    dot = (float)acc;
    for (int c = 0; c < C; c++)
        d[c] += (g[c] - o[c] * dot) / nrm;
}

/* cpu_heads.c's -log sigmoid(yz) and sigmoid(-yz), operation for operation. */
static __device__ __forceinline__ float neg_log_sigmoid(float yz)
{
    return fmaxf(-yz, 0.0f) + log1pf(expf(-fabsf(yz)));
}

static __device__ __forceinline__ float sigmoid_neg(float yz)
{
    float e = expf(-fabsf(yz));

    return yz >= 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

// Whether pair (i, j) is a negative between two rows of one known label (cpu_heads.c's
// same_label): its m_ij is same (kernels.h), 0 leaving it out
static __device__ __forceinline__ bool same_label(const int *labels, int i, int j, int diag)
{
    return labels != NULL && j != i + diag && labels[i + diag] >= 0 &&
           labels[j] == labels[i + diag];
}

// Each block's grid-stride share of the N*M terms, tree-summed in double, into partial[block]
__global__ void siglip_forward_kernel(double *partial, const float *dots, const float *t,
                                      const float *b, const int *labels, float same, int N, int M,
                                      int diag)
{
    __shared__ double sm[32];
    float et = expf(t[0]), bias = b[0];
    double acc = 0.0;

    GRID_STRIDE(k, (size_t)N * M)
    {
        int i = (int)(k / (size_t)M), j = (int)(k % (size_t)M);
        float z = et * dots[k] + bias;
        if (!same_label(labels, i, j, diag))
            acc += neg_log_sigmoid(j == i + diag ? z : -z);
        else if (same != 0.0f)
            acc += (double)same * neg_log_sigmoid(-z);
    }
    acc = block_sum_d(acc, sm);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

__global__ void siglip_finish_kernel(float *loss, const double *partial, int G, float weight)
{
    double s = 0.0;

    for (int g = 0; g < G; g++)
        s += partial[g];
    *loss = (float)((double)weight * s);
}

// ddots += exp(t) g; the block's sums of exp(t) dots g and of g into partial[block] and
// partial[G + block]
__global__ void siglip_backward_kernel(double *partial, float *ddots, const float *dloss,
                                       const float *dots, const float *t, const float *b,
                                       const int *labels, float same, int N, int M, int diag,
                                       float weight)
{
    __shared__ double sm[32];
    float et = expf(t[0]), bias = b[0], scale = dloss[0] * weight;
    double st = 0.0, sb = 0.0;

    GRID_STRIDE(k, (size_t)N * M)
    {
        int i = (int)(k / (size_t)M), j = (int)(k % (size_t)M);
        float z = et * dots[k] + bias, y = j == i + diag ? 1.0f : -1.0f;
        float g = -scale * y * sigmoid_neg(y * z);
        if (same_label(labels, i, j, diag)) {
            if (same == 0.0f)
                continue;
            g *= same;
        }
        if (ddots != NULL)
            ddots[k] += et * g;
        st += (double)(et * dots[k]) * g;
        sb += g;
    }
    st = block_sum_d(st, sm);
    sb = block_sum_d(sb, sm);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = st;
        partial[gridDim.x + blockIdx.x] = sb;
    }
}

__global__ void siglip_backward_finish_kernel(float *dt, float *db, const double *partial, int G)
{
    double st = 0.0, sb = 0.0;

    for (int g = 0; g < G; g++)
        st += partial[g], sb += partial[G + g];
    if (dt != NULL)
        dt[0] += (float)st;
    if (db != NULL)
        db[0] += (float)sb;
}

// ---- the table's functions ---------------------------------------------------------------------

#define LAUNCH_CHECK(name) TD_CUDA_CHECK_LAUNCH(x, name)

/* The usual launch of a grid-stride kernel over n elements on the context's stream. */
#define LAUNCH_N(x, kernel, n, ...)                                                           \
    do {                                                                                      \
        if ((n) > 0) {                                                                        \
            kernel<<<td__cuda_grid(x, (n), THREADS), THREADS, 0, (x)->stream>>>(__VA_ARGS__); \
            LAUNCH_CHECK(#kernel);                                                            \
        }                                                                                     \
    } while (0)

/* One thread per row. */
#define LAUNCH_ROWS(x, kernel, rows, ...)                                                  \
    do {                                                                                   \
        if ((rows) > 0) {                                                                  \
            kernel<<<(unsigned)(((rows) + ROW_THREADS - 1) / ROW_THREADS), ROW_THREADS, 0, \
                     (x)->stream>>>(__VA_ARGS__);                                          \
            LAUNCH_CHECK(#kernel);                                                         \
        }                                                                                  \
    } while (0)

/* SigLIP's grid: a function of the shape only (so the sums' order is too), at most
 * SIG_MAX_GRID blocks. */
static int siglip_grid(int N, int M)
{
    size_t n = (size_t)N * M,
           want = (n + (size_t)SIG_THREADS * SIG_PER - 1) / ((size_t)SIG_THREADS * SIG_PER);

    return want < 1 ? 1 : want < SIG_MAX_GRID ? (int)want : SIG_MAX_GRID;
}

extern "C" void td__cuda_token_mean_forward(float *out, const float *inp, int B, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, token_mean_forward_kernel, (size_t)B * C, out, inp, B, N, C, 1.0f / (float)N);
}

extern "C" void td__cuda_token_mean_backward(float *dinp, const float *dout, int B, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, token_mean_backward_kernel, (size_t)B * N * C, dinp, dout, B, N, C,
             1.0f / (float)N);
}

extern "C" void td__cuda_gather_rows_forward(float *out, const float *inp, const int *idx, int B,
                                             int T, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, gather_rows_forward_kernel, (size_t)B * C, out, inp, idx, B, T, C);
}

extern "C" void td__cuda_gather_rows_backward(float *dinp, const float *dout, const int *idx, int B,
                                              int T, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, gather_rows_backward_kernel, (size_t)B * C, dinp, dout, idx, B, T, C);
}

extern "C" void td__cuda_l2norm_forward(float *out, float *norm, const float *inp, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_ROWS(x, l2norm_forward_kernel, N, out, norm, inp, N, C);
}

extern "C" void td__cuda_l2norm_backward(float *dinp, const float *dout, const float *out,
                                         const float *norm, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_ROWS(x, l2norm_backward_kernel, N, dinp, dout, out, norm, N, C);
}

extern "C" void td__cuda_siglip_forward(float *loss, const float *dots, const float *t,
                                        const float *b, const int *labels, float same, int N, int M,
                                        int diag, float weight)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int G = siglip_grid(N, M);

    if (N < 1 || M < 1)
        td_panic(TD_ESHAPE, "siglip: %d x %d logits", N, M);
    siglip_forward_kernel<<<G, SIG_THREADS, 0, x->stream>>>(x->partial, dots, t, b, labels, same, N,
                                                            M, diag);
    LAUNCH_CHECK("siglip_forward_kernel");
    siglip_finish_kernel<<<1, 1, 0, x->stream>>>(loss, x->partial, G, weight);
    LAUNCH_CHECK("siglip_finish_kernel");
}

extern "C" void td__cuda_siglip_backward(float *ddots, float *dt, float *db, const float *dloss,
                                         const float *dots, const float *t, const float *b,
                                         const int *labels, float same, int N, int M, int diag,
                                         float weight)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int G = siglip_grid(N, M);

    if (N < 1 || M < 1)
        td_panic(TD_ESHAPE, "siglip: %d x %d logits", N, M);
    siglip_backward_kernel<<<G, SIG_THREADS, 0, x->stream>>>(x->partial, ddots, dloss, dots, t, b,
                                                             labels, same, N, M, diag, weight);
    LAUNCH_CHECK("siglip_backward_kernel");
    siglip_backward_finish_kernel<<<1, 1, 0, x->stream>>>(dt, db, x->partial, G);
    LAUNCH_CHECK("siglip_backward_finish_kernel");
}
