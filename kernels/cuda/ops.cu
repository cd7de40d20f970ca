/* The CUDA backend's ops (td_kernels_cuda(), td_cuda.h): every op of kernels.h as a CUDA
 * kernel or cuBLAS call on the calling thread's context (stream, cuBLAS handle, scratch).
 * Each op is the twin of its cpu.c namesake, same arguments and semantics, all pointers in
 * device memory; tests/test_gpu.c holds each pair together.
 *
 * Built with -fmad=false: nvcc would otherwise fuse a*b+c into one rounding, where cpu.c
 * (compiled without FMA) rounds twice. With it, the elementwise ops (ReLU, GELU with the same
 * fexp, the residual, the encoder, scale, AdamW, SGD) do exactly cpu.c's float operations in
 * cpu.c's order; they are memory-bound, so the lost FMAs cost nothing. The sums differ in
 * order only: per-warp tree sums for layernorm and the attention's rows, fixed-shape two-
 * stage sums for sumsq, the loss and layernorm's weight and bias gradients, cuBLAS for the
 * matmuls. No atomics on floats, so every op gives the same bits every run.
 *
 * With bf16 on (td_cuda_ctx_set_bf16), the matmuls multiply bf16 copies of their operands,
 * rounded into the context's scratch in chunks that fit, with fp32 sums and outputs
 * (cublasGemmEx); see "bf16 mixed precision". The fused attention's gemms stay fp32, in TF32.
 *
 * Ops run asynchronously on the context's stream; a launch is checked at once, a fault in a
 * kernel at the next synchronizing call. Owns nothing. */
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/attn_plan.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/heads.h"

extern "C" {
/* td_panic.h is C11 (_Noreturn), so its one function is declared here for C++. */
[[noreturn]] void td_panic(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
}

#define THREADS    256  /* threads per block of the elementwise and column kernels */
#define ROW_WARPS  8    /* rows per block of the warp-per-row kernels */
#define ROW_BLOCK  512  /* threads per block of the block-per-row kernels (softmax, argmax) */
#define ID_TILE    1024 /* token ids staged in shared memory by encoder_backward */
#define COL_CHUNKS 64   /* row chunks of a column sum (layernorm's weight and bias gradients) */
#define FULL_MASK  0xffffffffu

/* cpu.c's constants, the same values */
#define LN_EPS      1e-5f
#define GELU_K      0.7978845608028654f
#define GELU_C      0.044715f
#define EXP_LO      -87.3f
#define EXP_HI      88.3f
#define ROUND_MAGIC 12582912.0f

// ---- helpers --------------------------------------------------------------------------------

/* cpu.c's fexp, operation for operation (see there): the same bits, given -fmad=false. */
__device__ __forceinline__ float fexp(float x)
{
    float n, r, z, p;

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
    return p * __int_as_float(((int)(n == n ? n : 0.0f) + 127) << 23);
}

/* Sum and max over a warp, every lane getting the result; a fixed butterfly order. */
__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

/* cpu.c's comparison (a NaN never wins unless it came first) */
__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(FULL_MASK, v, o);
        v = w > v ? w : v;
    }
    return v;
}

/* Over the block (a multiple of 32 threads), every thread getting the result; sm holds one
 * value per warp. The two __syncthreads let the caller reuse sm at once. */
__device__ float block_max(float v, float *sm)
{
    int nw = (int)(blockDim.x >> 5);

    v = warp_max(v);
    if ((threadIdx.x & 31) == 0)
        sm[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sm[0];
    for (int k = 1; k < nw; k++)
        v = sm[k] > v ? sm[k] : v;
    __syncthreads();
    return v;
}

// ---- elementwise kernels --------------------------------------------------------------------

__global__ void fill_kernel(float *p, float v, size_t n)
{
    GRID_STRIDE(i, n)
    p[i] = v;
}

// out[i,:] = bias, the bias gemm then adds to (beta 1), as cpu.c's memcpy
// out is (N,OC), bias is (OC)
__global__ void bias_rows_kernel(float *out, const float *bias, size_t n, int OC)
{
    GRID_STRIDE(i, n)
    out[i] = bias[i % (size_t)OC];
}

// out = inp + bias by row; out is (N,C), inp is (N,C), bias is (C)
__global__ void bias_forward_kernel(float *out, const float *inp, const float *bias, size_t n,
                                    int C)
{
    GRID_STRIDE(i, n)
    out[i] = inp[i] + bias[i % (size_t)C];
}

// dst += src; dst, src are (n)
__global__ void add_kernel(float *dst, const float *src, size_t n)
{
    GRID_STRIDE(i, n)
    dst[i] += src[i];
}

// d1 += src and d2 += src in one pass, each stored (0 + src, never read) where store names it;
// either may be NULL. d1, d2, src are (n)
__global__ void residual_backward_kernel(float *d1, float *d2, const float *src, size_t n,
                                         int store)
{
    GRID_STRIDE(i, n)
    {
        float g = src[i];
        if (d1 != NULL)
            d1[i] = (store & TD_STORE_1 ? 0.0f : d1[i]) + g;
        if (d2 != NULL)
            d2[i] = (store & TD_STORE_2 ? 0.0f : d2[i]) + g;
    }
}

// p's (rows, cols) block, rows ld floats apart, = 0 (a causal attention's stored dk and dv
// before row-chunked blocks accumulate into them)
__global__ void zero_cols_kernel(float *p, size_t rows, int cols, size_t ld)
{
    GRID_STRIDE(i, rows * (size_t)cols)
    p[i / (size_t)cols * ld + i % (size_t)cols] = 0.0f;
}

// dst = src rounded to bf16 (round to nearest even; NaN stays NaN, a float beyond bf16's range
// becomes Inf, as PyTorch's .to(torch.bfloat16)): cols columns of rows rows of src, whose rows
// are ld floats apart, into a packed (rows, cols) dst.
// dst is (rows,cols), src is (rows,ld) with ld >= cols
__global__ void to_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t rows, int cols,
                               size_t ld)
{
    size_t n = rows * (size_t)cols;

    GRID_STRIDE(i, n)
    {
        size_t r = i / (size_t)cols, c = i % (size_t)cols;
        dst[i] = __float2bfloat16_rn(src[r * ld + c]);
    }
}

// The same for contiguous rows (ld == cols), without the division: dst is (n), src is (n)
__global__ void to_bf16_flat_kernel(__nv_bfloat16 *dst, const float *src, size_t n)
{
    GRID_STRIDE(i, n)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void relu_forward_kernel(float *out, const float *inp, size_t n)
{
    GRID_STRIDE(i, n)
    {
        float x = inp[i];
        out[i] = x < 0.0f ? 0.0f : x;
    }
}

__global__ void relu_backward_kernel(float *dinp, const float *dout, const float *out, size_t n)
{
    GRID_STRIDE(i, n)
    dinp[i] += out[i] > 0.0f ? dout[i] : 0.0f;
}

__global__ void gelu_forward_kernel(float *out, const float *inp, size_t n)
{
    GRID_STRIDE(i, n)
    {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        out[i] = x / (1.0f + fexp(-2.0f * u));
    }
}

__global__ void gelu_backward_kernel(float *dinp, const float *inp, const float *dout, size_t n,
                                     int store)
{
    GRID_STRIDE(i, n)
    {
        float x = inp[i];
        float u = GELU_K * (x + GELU_C * x * x * x);
        float s = 1.0f / (1.0f + fexp(-2.0f * u));
        float du = GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        dinp[i] = (store ? 0.0f : dinp[i]) + (s + 2.0f * x * s * (1.0f - s) * du) * dout[i];
    }
}

__global__ void residual_forward_kernel(float *out, const float *a, const float *b, size_t n)
{
    GRID_STRIDE(i, n)
    out[i] = a[i] + b[i];
}

__global__ void scale_kernel(float *p, float s, size_t n)
{
    GRID_STRIDE(i, n)
    p[i] *= s;
}

// cpu.c's adamw_update loop body: one element's step from its gradient g, the scalars computed
// on the host as cpu.c computes them
__device__ void adamw_one(float *param, float *m, float *v, float g, size_t i, float beta2,
                          float eps, float step_size, float bc2_sqrt, float decay, float w1,
                          float w2)
{
    float mi = m[i] + w1 * (g - m[i]);
    float vi = beta2 * v[i] + w2 * g * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    param[i] = param[i] * decay - step_size * mi / denom;
}

__global__ void adamw_kernel(float *param, float *m, float *v, const float *grad, size_t n,
                             float beta2, float eps, float step_size, float bc2_sqrt, float decay,
                             float w1, float w2)
{
    GRID_STRIDE(i, n)
    adamw_one(param, m, v, grad[i], i, beta2, eps, step_size, bc2_sqrt, decay, w1, w2);
}

// cpu.c's clip_scale, one thread: the norm and the coefficient in double
__global__ void clip_scale_kernel(float *out, const double *sumsq, const float *loss,
                                  float max_norm)
{
    double norm = sqrt(*sumsq);
    float l = loss != NULL ? *loss : 0.0f;

    if (!isfinite(l) || !isfinite(norm))
        out[0] = __int_as_float(0x7fc00000); /* a quiet NaN */
    else if (max_norm > 0.0f && norm > max_norm)
        out[0] = (float)(max_norm / (norm + 1e-6));
    else
        out[0] = 1.0f;
    out[1] = l;
}

// adamw_kernel over every element of the flat buffer: each finds its span by binary search
// (spans sorted by offset); elements in no span are untouched. The clip's factor is read from
// device memory, so no host sync sits between the norm and the update; a factor that is not
// finite (a NaN or Inf loss or norm) skips the step, as the trainer's NaN policy asks
__global__ void adamw_flat_kernel(float *param, float *m, float *v, float *grad, size_t n,
                                  const td_adamw_span *spans, int nspans, const float *scale,
                                  float beta2, float eps, float step_size, float bc2_sqrt,
                                  float decay_on, float decay_off, float w1, float w2)
{
    float s = *scale;

    if (!isfinite(s))
        return;
    GRID_STRIDE(i, n)
    {
        int lo = 0, hi = nspans - 1;
        float g = grad[i];

        if (s != 1.0f) {
            g *= s;
            grad[i] = g; /* as scale leaves it */
        }
        while (lo < hi) { /* the last span starting at or before i */
            int mid = (lo + hi + 1) / 2;
            if (spans[mid].offset <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        if (nspans == 0 || i < spans[lo].offset || i >= spans[lo].offset + spans[lo].n)
            continue;
        adamw_one(param, m, v, g, i, beta2, eps, step_size, bc2_sqrt,
                  spans[lo].decay ? decay_on : decay_off, w1, w2);
    }
}

// One element's SGD step from its gradient g (buf NULL: no momentum)
__device__ void sgd_one(float *param, float *buf, float g, size_t i, float lr, float momentum,
                        float weight_decay)
{
    g += weight_decay * param[i];
    if (buf != NULL) {
        buf[i] = momentum * buf[i] + g;
        g = buf[i];
    }
    param[i] -= lr * g;
}

__global__ void sgd_kernel(float *param, float *buf, const float *grad, size_t n, float lr,
                           float momentum, float weight_decay)
{
    GRID_STRIDE(i, n)
    sgd_one(param, buf, grad[i], i, lr, momentum, weight_decay);
}

// sgd_kernel after the clip's factor: a factor that is not finite skips the step; else the
// gradient scaled (and left so) when the factor is not 1
__global__ void sgd_flat_kernel(float *param, float *buf, float *grad, size_t n,
                                const float *factor, float lr, float momentum, float weight_decay)
{
    float s = *factor;

    if (!isfinite(s))
        return;
    GRID_STRIDE(i, n)
    {
        float g = grad[i];
        if (s != 1.0f) {
            g *= s;
            grad[i] = g;
        }
        sgd_one(param, buf, g, i, lr, momentum, weight_decay);
    }
}

// ---- softmax cross-entropy, argmax ------------------------------------------------------------

// Rows blockIdx.x, +gridDim.x, ... of the stable softmax over the first V of Vp columns, with
// cpu.c's arithmetic (expf, the sum in double); the block's rows' losses summed in row order
// into partial[blockIdx.x]. A target outside [0,V) gives a NaN loss instead of a wild read.
// partial is (gridDim.x), probs and logits are (N,Vp), targets is (N)
__global__ void softmax_xent_kernel(double *partial, float *probs, const float *logits,
                                    const int *targets, int N, int V, int Vp)
{
    __shared__ float smax[32];
    __shared__ double ssum[32];
    double acc = 0.0;

    for (int i = blockIdx.x; i < N; i += gridDim.x) {
        const float *x = logits + (size_t)i * Vp;
        float *p = probs + (size_t)i * Vp;
        float maxv = x[0], inv;
        double sum = 0.0;

        for (int j = threadIdx.x; j < V; j += blockDim.x)
            maxv = x[j] > maxv ? x[j] : maxv;
        maxv = block_max(maxv, smax);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float e = expf(x[j] - maxv);
            p[j] = e;
            sum += e;
        }
        sum = block_sum_d(sum, ssum);
        inv = (float)(1.0 / sum);
        for (int j = threadIdx.x; j < V; j += blockDim.x)
            p[j] *= inv;
        for (int j = V + threadIdx.x; j < Vp; j += blockDim.x)
            p[j] = 0.0f;
        if (threadIdx.x == 0) {
            int t = targets[i];
            double xt = t >= 0 && t < V ? (double)x[t] : (double)NAN;
            acc += log(sum) - (xt - maxv);
        }
    }
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

// loss = the mean of the rows' losses: partial[0..G) added in order, then cpu.c's cast
__global__ void finish_loss_kernel(float *loss, const double *partial, int G, int N)
{
    double total = 0.0;

    for (int g = 0; g < G; g++)
        total += partial[g];
    total /= N;
    *loss = total > FLT_MAX ? INFINITY : (float)total;
}

// dlogits[:, :V] += dloss/N * (probs - onehot(targets)); dlogits, probs are (N,Vp)
__global__ void softmax_xent_backward_kernel(float *dlogits, const float *dloss, const float *probs,
                                             const int *targets, int N, int V, int Vp)
{
    float scale = *dloss / (float)N;
    size_t n = (size_t)N * V;

    GRID_STRIDE(k, n)
    {
        size_t i = k / (size_t)V;
        int j = (int)(k % (size_t)V);
        size_t at = i * Vp + j;
        dlogits[at] += scale * (probs[at] - (j == targets[i] ? 1.0f : 0.0f));
    }
}

// The fused classifier (llm.c's): softmax_xent_kernel's rows and loss, arithmetic for
// arithmetic, but the exps are not stored: where grad, a second pass over the row overwrites
// the logits with 1/N * (p - onehot) (softmax_xent_backward_kernel's value into
// a zeroed buffer) and the padding with 0. The block reads the row's target and max before any
// thread writes (the __syncthreads in block_sum_d orders them).
// partial is (gridDim.x), logits is (N,Vp), targets is (N)
__global__ void softmax_xent_fused_kernel(double *partial, float *logits, const int *targets, int N,
                                          int V, int Vp, int grad)
{
    __shared__ float smax[32];
    __shared__ double ssum[32];
    float scale = 1.0f / (float)N; /* the backward kernel's *dloss / N, dloss 1 */
    double acc = 0.0;

    for (int i = blockIdx.x; i < N; i += gridDim.x) {
        float *x = logits + (size_t)i * Vp;
        float maxv = x[0], inv;
        double sum = 0.0, xt;
        int t = targets[i];

        for (int j = threadIdx.x; j < V; j += blockDim.x)
            maxv = x[j] > maxv ? x[j] : maxv;
        maxv = block_max(maxv, smax);
        for (int j = threadIdx.x; j < V; j += blockDim.x)
            sum += expf(x[j] - maxv);
        xt = t >= 0 && t < V ? (double)x[t] : (double)NAN;
        sum = block_sum_d(sum, ssum);
        if (threadIdx.x == 0)
            acc += log(sum) - (xt - maxv);
        if (!grad)
            continue;
        inv = (float)(1.0 / sum);
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float p = expf(x[j] - maxv) * inv;
            x[j] = scale * (p - (j == t ? 1.0f : 0.0f));
        }
        for (int j = V + threadIdx.x; j < Vp; j += blockDim.x)
            x[j] = 0.0f;
    }
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

// One block per row (strided): cpu.c's answer, the first largest logit, where a NaN never
// wins unless it is the first logit. The block's count is added once to *correct (integers:
// the order does not matter). correct is (1), logits is (N,V), targets is (N)
__global__ void argmax_correct_kernel(unsigned long long *correct, const float *logits,
                                      const int *targets, int N, int V)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    unsigned long long count = 0;

    for (int i = blockIdx.x; i < N; i += gridDim.x) {
        const float *x = logits + (size_t)i * V;
        float bv = 0.0f;
        int bi = INT_MAX; /* none yet */

        for (int j = threadIdx.x; j < V; j += blockDim.x)
            if (x[j] == x[j] && (bi == INT_MAX || x[j] > bv))
                bv = x[j], bi = j;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (oi != INT_MAX && (bi == INT_MAX || ov > bv || (ov == bv && oi < bi)))
                bv = ov, bi = oi;
        }
        if ((threadIdx.x & 31) == 0)
            sv[threadIdx.x >> 5] = bv, si[threadIdx.x >> 5] = bi;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int k = 1; k < (int)(blockDim.x >> 5); k++)
                if (si[k] != INT_MAX &&
                    (bi == INT_MAX || sv[k] > bv || (sv[k] == bv && si[k] < bi)))
                    bv = sv[k], bi = si[k];
            if (x[0] != x[0] || bi == INT_MAX)
                bi = 0;
            count += bi == targets[i];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && count > 0)
        atomicAdd(correct, count);
}

// ---- encoder ----------------------------------------------------------------------------------

// out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]; out is (B,T,C)
__global__ void encoder_forward_kernel(float *out, const int *inp, const float *wte,
                                       const float *wpe, int T, int C, size_t n)
{
    GRID_STRIDE(k, n)
    {
        size_t bt = k / (size_t)C;
        int c = (int)(k % (size_t)C), t = (int)(bt % (size_t)T);
        out[k] = wte[(size_t)inp[bt] * C + c] + wpe[(size_t)t * C + c];
    }
}

// dwte[id,c] += dout[bt,c] over the positions bt in order, as cpu.c does: thread (c, r) owns
// the rows id of dwte with id % R == r (R a power of two), so no two threads touch one float
// and each adds in cpu.c's order (the same bits, no atomics). Every thread reads every id,
// staged in shared memory, ID_TILE at a time.
// dwte is (V,C), dout is (BT,C), inp is (BT); grid (ceil(C/THREADS), R)
__global__ void encoder_backward_wte_kernel(float *dwte, const float *dout, const int *inp, int BT,
                                            int C, int R)
{
    __shared__ int ids[ID_TILE];
    int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;

    for (int b0 = 0; b0 < BT; b0 += ID_TILE) {
        int len = BT - b0 < ID_TILE ? BT - b0 : ID_TILE;
        __syncthreads();
        for (int k = threadIdx.x; k < len; k += blockDim.x)
            ids[k] = inp[b0 + k];
        __syncthreads();
        if (c >= C)
            continue;
        for (int k = 0; k < len; k++) {
            int id = ids[k];
            if ((id & (R - 1)) == r)
                dwte[(size_t)id * C + c] += dout[(size_t)(b0 + k) * C + c];
        }
    }
}

// dwpe[t,c] += dout[b,t,c] for b in order (cpu.c's order); dwpe is (maxT,C), thread per (t,c)
__global__ void encoder_backward_wpe_kernel(float *dwpe, const float *dout, int B, int T, int C)
{
    size_t n = (size_t)T * C;

    GRID_STRIDE(k, n)
    {
        float v = dwpe[k];
        for (int b = 0; b < B; b++)
            v += dout[(size_t)b * n + k];
        dwpe[k] = v;
    }
}

// ---- layernorm --------------------------------------------------------------------------------

// One row by one warp: mean, the biased variance around it, rstd = 1/sqrt(var + eps)
// o and x are (C), weight and bias are (C)
__device__ void layernorm_row(float *o, float *mean, float *rstd, const float *x,
                              const float *weight, const float *bias, int C, int lane)
{
    float m = 0.0f, v = 0.0f, s;

    for (int j = lane; j < C; j += 32)
        m += x[j];
    m = warp_sum(m) / (float)C;
    for (int j = lane; j < C; j += 32)
        v += (x[j] - m) * (x[j] - m);
    v = warp_sum(v) / (float)C;
    s = 1.0f / sqrtf(v + LN_EPS);
    for (int j = lane; j < C; j += 32)
        o[j] = (s * (x[j] - m)) * weight[j] + bias[j];
    if (lane == 0) {
        *mean = m;
        *rstd = s;
    }
}

// A warp per row
// out is (N,C), mean and rstd are (N), inp is (N,C), weight and bias are (C)
__global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd, const float *inp,
                                         const float *weight, const float *bias, int N, int C)
{
    int lane = threadIdx.x & 31;
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);

    if (row >= (size_t)N)
        return;
    layernorm_row(out + row * C, mean + row, rstd + row, inp + row * C, weight, bias, C, lane);
}

// res = a + b by row, then the row's layernorm from res (each lane reads back the columns it
// wrote): the bits of residual_forward_kernel then layernorm_forward_kernel
// res and out are (N,C), mean and rstd are (N), a and b are (N,C), weight and bias are (C)
__global__ void residual_layernorm_kernel(float *res, float *out, float *mean, float *rstd,
                                          const float *a, const float *b, const float *weight,
                                          const float *bias, int N, int C)
{
    int lane = threadIdx.x & 31;
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    float *r = res + row * C;

    if (row >= (size_t)N)
        return;
    for (int j = lane; j < C; j += 32)
        r[j] = a[row * C + j] + b[row * C + j];
    layernorm_row(out + row * C, mean + row, rstd + row, r, weight, bias, C, lane);
}

// dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)), dnorm = weight * dout (stored,
// 0 + ..., when store) for one row, by one warp
__device__ void layernorm_dinp_row(float *dinp, const float *d, const float *x, const float *weight,
                                   float m, float s, int C, int lane, int store)
{
    float a1 = 0.0f, a2 = 0.0f;

    for (int j = lane; j < C; j += 32) {
        float dn = weight[j] * d[j];
        a1 += dn;
        a2 += dn * ((x[j] - m) * s);
    }
    a1 = warp_sum(a1) / (float)C;
    a2 = warp_sum(a2) / (float)C;
    for (int j = lane; j < C; j += 32) {
        float norm = (x[j] - m) * s;
        dinp[j] = (store ? 0.0f : dinp[j]) + (weight[j] * d[j] - a1 - norm * a2) * s;
    }
}

static_assert(ROW_WARPS * 32 == THREADS, "the LayerNorm backward's blocks serve rows and columns");

// The LayerNorm backward in one launch, two kinds of block side by side: blocks [0, rb) a warp
// per row of dinp (rb = 0: no dinp); then G * cols blocks of the column sums, block
// rb + g * cols + k thread t summing column c = k * blockDim + t over rows [g N/G, (g+1) N/G) in
// order into part[g][c] (dbias's) and part[G + g][c] (dweight's). Each column block then
// counts itself in on *ticket after a fence, and the last one adds part's G rows of every column
// in order into dbias and dweight and puts the ticket back to 0 (the threadfence reduction of
// CUDA's samples). The partial sums and their order depend on N and C alone, not on which block
// ends last: the same bits every call. part is (2G, C); dweight, dbias may be NULL
__global__ void layernorm_backward_kernel(float *dinp, float *dweight, float *dbias, float *part,
                                          unsigned *ticket, const float *dout, const float *inp,
                                          const float *weight, const float *mean, const float *rstd,
                                          int N, int C, int G, int store, unsigned rb,
                                          unsigned cols)
{
    __shared__ int last;

    if (blockIdx.x < rb) {
        size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
        if (row < (size_t)N)
            layernorm_dinp_row(dinp + row * C, dout + row * C, inp + row * C, weight, mean[row],
                               rstd[row], C, threadIdx.x & 31, store);
        return;
    }
    unsigned b = blockIdx.x - rb;
    int g = (int)(b / cols), c = (int)(b % cols) * blockDim.x + threadIdx.x;
    int r0 = (int)((int64_t)g * N / G), r1 = (int)((int64_t)(g + 1) * N / G);

    if (c < C) {
        float sb = 0.0f, sw = 0.0f;
        for (int r = r0; r < r1; r++) {
            float d = dout[(size_t)r * C + c];
            sb += d;
            sw += ((inp[(size_t)r * C + c] - mean[r]) * rstd[r]) * d;
        }
        part[(size_t)g * C + c] = sb;
        part[(size_t)(G + g) * C + c] = sw;
    }
    __threadfence(); /* this block's partial sums visible before its ticket */
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(ticket, 1u) == (unsigned)G * cols - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        float sb = 0.0f, sw = 0.0f;
        for (int k = 0; k < G; k++) { /* from L2: other blocks wrote them */
            sb += __ldcg(part + (size_t)k * C + j);
            sw += __ldcg(part + (size_t)(G + k) * C + j);
        }
        if (dbias != NULL)
            dbias[j] += sb;
        if (dweight != NULL)
            dweight[j] += sw;
    }
    if (threadIdx.x == 0)
        *ticket = 0;
}

// ---- attention ------------------------------------------------------------------------------
//
// The fused attention's row kernels, a warp per query row of a block of scores. A block holds,
// for every (sequence, head) bh, rows [r0, r0 + rows) of its queries against keys [0, cols),
// at s + bh * slot, row t at t * cols; query r0 + t sees keys [0, n) with n = r0 + t + 1 when
// causal, else cols.

// Softmax of each row in place (cpu.c's softmax_row with fexp), zero past n, and its
// log-sum-exp: lse[bh * Nq + r0 + t] = max + log(sum)
// s is (BH, slot), lse is (BH, Nq)
__global__ void attn_softmax_kernel(float *s, float *lse, int BH, int rows, int cols, size_t slot,
                                    int r0, int Nq, int causal)
{
    int lane = threadIdx.x & 31;
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    float maxv, sum = 0.0f, inv;
    float *a;
    int bh, t, n;

    if (row >= (size_t)BH * rows)
        return;
    bh = (int)(row / (size_t)rows);
    t = (int)(row % (size_t)rows);
    a = s + (size_t)bh * slot + (size_t)t * cols;
    n = causal ? r0 + t + 1 : cols;
    maxv = a[0];
    for (int j = lane; j < n; j += 32)
        maxv = a[j] > maxv ? a[j] : maxv;
    maxv = warp_max(maxv);
    for (int j = lane; j < n; j += 32) {
        float e = fexp(a[j] - maxv);
        a[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    inv = 1.0f / sum;
    for (int j = lane; j < n; j += 32)
        a[j] *= inv;
    for (int j = n + lane; j < cols; j += 32)
        a[j] = 0.0f;
    if (lane == 0)
        lse[(size_t)bh * Nq + r0 + t] = maxv + logf(sum);
}

// The backward's row kernel: probabilities again from the scores and lse, then the gradient
// of the scores in place over dp: p = exp(s - lse) (0 past n), dp = scale p (dp - D)
// p and dp are (BH, slot), lse and D are (BH, Nq)
__global__ void attn_grad_kernel(float *p, float *dp, const float *lse, const float *D, int BH,
                                 int rows, int cols, size_t slot, int r0, int Nq, int causal,
                                 float scale)
{
    int lane = threadIdx.x & 31;
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), off;
    float l, d;
    int bh, t, n;

    if (row >= (size_t)BH * rows)
        return;
    bh = (int)(row / (size_t)rows);
    t = (int)(row % (size_t)rows);
    off = (size_t)bh * slot + (size_t)t * cols;
    n = causal ? r0 + t + 1 : cols;
    l = lse[(size_t)bh * Nq + r0 + t];
    d = D[(size_t)bh * Nq + r0 + t];
    for (int j = lane; j < cols; j += 32) {
        float e = j < n ? fexp(p[off + j] - l) : 0.0f;
        p[off + j] = e;
        dp[off + j] = scale * (e * (dp[off + j] - d));
    }
}

// D[bh * Nq + i] = dout_i . out_i over head h's hs columns, a warp per (b, h, i)
// D is (B, NH, Nq), dout and out are (B, Nq, NH * hs)
__global__ void attn_d_kernel(float *D, const float *dout, const float *out, int B, int NH, int Nq,
                              int hs)
{
    int lane = threadIdx.x & 31;
    size_t row = (size_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), off;
    float s = 0.0f;
    int bh, b, h, i;

    if (row >= (size_t)B * NH * Nq)
        return;
    bh = (int)(row / (size_t)Nq);
    i = (int)(row % (size_t)Nq);
    b = bh / NH;
    h = bh % NH;
    off = ((size_t)b * Nq + i) * ((size_t)NH * hs) + (size_t)h * hs;
    for (int e = lane; e < hs; e += 32)
        s += dout[off + e] * out[off + e];
    s = warp_sum(s);
    if (lane == 0)
        D[row] = s;
}

// The pointer arrays of a block's batched gemms: array a, entry p (the pair (p / NH, p % NH)
// of the block) = base[a] + (p / NH) * sb[a] + (p % NH) * sh[a]; arrays of npair pointers one
// after another from ptrs
struct attn_ptr_set {
    const float *base[TD_ATTN_PTR_ARRAYS];
    long long sb[TD_ATTN_PTR_ARRAYS], sh[TD_ATTN_PTR_ARRAYS];
};

__global__ void attn_ptrs_kernel(const float **ptrs, attn_ptr_set set, int n, int npair, int NH)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int a, pr;

    if (i >= (size_t)n * npair)
        return;
    a = (int)(i / (size_t)npair);
    pr = (int)(i % (size_t)npair);
    ptrs[i] = set.base[a] + (long long)(pr / NH) * set.sb[a] + (long long)(pr % NH) * set.sh[a];
}

// ---- sumsq ----------------------------------------------------------------------------------

// Sum of squares in double: each block's grid-stride share, tree-summed, into partial[block]
__global__ void sumsq_partial_kernel(double *partial, const float *p, size_t n)
{
    __shared__ double sm[32];
    double acc = 0.0;

    GRID_STRIDE(i, n)
    acc += (double)p[i] * (double)p[i];
    acc = block_sum_d(acc, sm);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = acc;
}

__global__ void sumsq_finish_kernel(double *out, const double *partial, int G)
{
    double s = 0.0;

    for (int g = 0; g < G; g++)
        s += partial[g];
    *out = s;
}

__global__ void fault_kernel(volatile int *p)
{
    *p = 1;
}

// ---- the table's functions --------------------------------------------------------------------

#define LAUNCH_CHECK(name) TD_CUDA_CHECK_LAUNCH(x, name)

/* The usual launch of a grid-stride kernel over n elements on the context's stream. */
#define LAUNCH_N(x, kernel, n, ...)                                                           \
    do {                                                                                      \
        if ((n) > 0) {                                                                        \
            kernel<<<td__cuda_grid(x, (n), THREADS), THREADS, 0, (x)->stream>>>(__VA_ARGS__); \
            LAUNCH_CHECK(#kernel);                                                            \
        }                                                                                     \
    } while (0)

static unsigned row_blocks(size_t rows)
{
    return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS);
}

/* The CPU's thread count means nothing here. */
static void set_threads(int n)
{
    (void)n;
}

static void zero(float *p, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    if (n > 0)
        x->counts.memsets++;
    TD_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(float), x->stream));
}

// dbias += sum over rows of dout, as a gemv with the context's ones, TD_CUDA_ONES rows a call
// dbias is (C), dout is (N,C)
static void sum_rows(td_cuda_ctx *x, float *dbias, const float *dout, int N, int C)
{
    const float one = 1.0f;

    for (int r = 0; r < N; r += TD_CUDA_ONES) {
        int rows = N - r < TD_CUDA_ONES ? N - r : TD_CUDA_ONES;
        TD_CUBLAS_OP(x, cublasSgemv(x->blas, CUBLAS_OP_N, C, rows, &one, dout + (size_t)r * C, C,
                                    x->ones, 1, &one, dbias, 1));
    }
}

// ---- bf16 mixed precision (td_cuda_ctx_set_bf16) ---------------------------------------------
//
// A matmul's operands are rounded into bf16 copies in the context's scratch and multiplied by
// cublasGemmEx with fp32 accumulation and fp32 output, the alpha and beta of the fp32 path, so
// kernels.h's semantics hold as they are (the bias broadcast first and added by beta 1; the
// backward accumulating with beta 1). The scratch is fixed (64 MiB by default), so the gemms are
// cut into chunks whose bf16 operands fit: chunks of rows of N, and, when a weight's bf16 copy
// would take more than half of the scratch (GPT-2's tied lm head, 50304x768, is 74 MiB), chunks
// of OC too. Chunks over N of dweight and chunks over OC of dinp add their partial products
// into the fp32 output one after another (beta 1): the sums are fp32 between chunks, within a
// chunk cuBLAS's. Everything queues on the context's stream, so the scratch is free again once
// the op's last gemm has been queued behind the conversions it reads.

#define BF16_ALIGN 128 /* bf16 elements: each copy in the scratch starts 256-byte aligned */

static size_t bf16_round_up(size_t n)
{
    return (n + BF16_ALIGN - 1) / BF16_ALIGN * BF16_ALIGN;
}

// dst (rows,cols) = bf16 of src, rows ld floats apart
static void to_bf16(td_cuda_ctx *x, __nv_bfloat16 *dst, const float *src, size_t rows, int cols,
                    size_t ld)
{
    size_t n = rows * (size_t)cols;

    if (ld == (size_t)cols)
        LAUNCH_N(x, to_bf16_flat_kernel, n, dst, src, n);
    else
        LAUNCH_N(x, to_bf16_kernel, n, dst, src, rows, cols, ld);
}

// Column-major C (m,n) = alpha op(A) op(B) + beta C with bf16 A and B, fp32 C, fp32 sums
static void gemm_bf16(td_cuda_ctx *x, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                      int k, const __nv_bfloat16 *A, int lda, const __nv_bfloat16 *B, int ldb,
                      float beta, float *C, int ldc)
{
    const float one = 1.0f;

    TD_CUBLAS_OP(x, cublasGemmEx(x->blas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, lda, B,
                                 CUDA_R_16BF, ldb, &beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                                 CUBLAS_GEMM_DEFAULT));
}

// The context's scratch as bf16 elements
static size_t bf16_room(const td_cuda_ctx *x)
{
    return x->scratch_bytes / sizeof(__nv_bfloat16);
}

// Columns of OC per chunk: all of OC when a weight's bf16 copy (OC,C) takes at most half of
// the scratch, else as many rows of the weight as half of it holds, a multiple of 64 (tensor
// core tiles) when there are that many. 0 when not even one row of C fits.
static int bf16_oc_chunk(const td_cuda_ctx *x, int C, int OC)
{
    size_t half = bf16_room(x) / 2, fit;

    if ((size_t)OC * C <= half)
        return OC;
    fit = half / (size_t)C;
    if (fit > 64)
        fit -= fit % 64;
    return (int)(fit < (size_t)OC ? fit : (size_t)OC);
}

TD_NORETURN static void bf16_too_big(const td_cuda_ctx *x, const char *what, int N, int C, int OC)
{
    td_panic(TD_E2BIG,
             "bf16 matmul %s (N=%d, C=%d, OC=%d): not one row of its bf16 operands fits in the "
             "context's %zu bytes of CUDA scratch",
             what, N, C, OC, x->scratch_bytes);
}

// out = inp . weight^T (+ out when beta 1) in bf16: per chunk of ocn output columns, the
// weight's rows [oc0, oc0+ocn) in bf16 (W, packed (ocn,C)); per chunk of nn rows, inp's rows in
// bf16 (I, packed (nn,C)); column-major out^T[oc0.., n0..] (ocn,nn) = W^T^T . I^T.
// out is (N,OC), inp is (N,C), weight is (OC,C)
static void matmul_forward_bf16(td_cuda_ctx *x, float *out, const float *inp, const float *weight,
                                float beta, int N, int C, int OC)
{
    int ocn = bf16_oc_chunk(x, C, OC), nn;
    size_t wroom, left;
    __nv_bfloat16 *W = (__nv_bfloat16 *)x->scratch, *I;

    if (ocn < 1)
        bf16_too_big(x, "forward", N, C, OC);
    wroom = bf16_round_up((size_t)ocn * C);
    left = bf16_room(x) > wroom ? bf16_room(x) - wroom : 0;
    nn = left / (size_t)C < (size_t)N ? (int)(left / (size_t)C) : N;
    if (nn < 1)
        bf16_too_big(x, "forward", N, C, OC);
    I = W + wroom;
    for (int oc0 = 0; oc0 < OC; oc0 += ocn) {
        int oc = OC - oc0 < ocn ? OC - oc0 : ocn;
        to_bf16(x, W, weight + (size_t)oc0 * C, (size_t)oc, C, (size_t)C);
        for (int n0 = 0; n0 < N; n0 += nn) {
            int n = N - n0 < nn ? N - n0 : nn;
            if (oc0 == 0 || nn < N) /* all of inp fits: rounded once */
                to_bf16(x, I, inp + (size_t)n0 * C, (size_t)n, C, (size_t)C);
            gemm_bf16(x, CUBLAS_OP_T, CUBLAS_OP_N, oc, n, C, W, C, I, C, beta,
                      out + (size_t)n0 * OC + oc0, OC);
        }
    }
}

// dinp += dout . weight (stored by the first chunk of OC, beta 0, when store) and
// dweight += dout^T . inp in bf16. Per chunk of ocn columns of OC:
// the weight's rows in bf16 (W, (ocn,C), for dinp); per chunk of nn rows: dout's (nn,ocn) block
// in bf16 (D), inp's rows in bf16 (I, (nn,C), for dweight), then
//   dinp[n0..]^T (C,nn)    += W (C,ocn col-major) . D (ocn,nn col-major)
//   dweight[oc0..]^T (C,ocn) += I (C,nn col-major) . D^T (nn,ocn)
// D, W, I take nn*ocn + ocn*C + nn*C bf16 elements of the scratch.
// dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dout is (N,OC), inp is (N,C), weight (OC,C)
static void matmul_backward_bf16(td_cuda_ctx *x, float *dinp, float *dweight, const float *dout,
                                 const float *inp, const float *weight, int N, int C, int OC,
                                 int store)
{
    int ocn = bf16_oc_chunk(x, C, OC), nn;
    size_t wroom, left, per_row;
    __nv_bfloat16 *W = (__nv_bfloat16 *)x->scratch, *D, *I;

    if (ocn < 1)
        bf16_too_big(x, "backward", N, C, OC);
    wroom = dinp != NULL ? bf16_round_up((size_t)ocn * C) : 0;
    /* two copies rounded up to the alignment: at most 2 BF16_ALIGN elements more */
    left = bf16_room(x) > wroom + 2 * BF16_ALIGN ? bf16_room(x) - wroom - 2 * BF16_ALIGN : 0;
    per_row = (size_t)ocn + (dweight != NULL ? (size_t)C : 0);
    nn = left / per_row < (size_t)N ? (int)(left / per_row) : N;
    if (nn < 1)
        bf16_too_big(x, "backward", N, C, OC);
    D = W + wroom;
    I = D + bf16_round_up((size_t)nn * ocn);
    for (int oc0 = 0; oc0 < OC; oc0 += ocn) {
        int oc = OC - oc0 < ocn ? OC - oc0 : ocn;
        if (dinp != NULL)
            to_bf16(x, W, weight + (size_t)oc0 * C, (size_t)oc, C, (size_t)C);
        for (int n0 = 0; n0 < N; n0 += nn) {
            int n = N - n0 < nn ? N - n0 : nn;
            to_bf16(x, D, dout + (size_t)n0 * OC + oc0, (size_t)n, oc, (size_t)OC);
            if (dinp != NULL)
                gemm_bf16(x, CUBLAS_OP_N, CUBLAS_OP_N, C, n, oc, W, C, D, oc,
                          store && oc0 == 0 ? 0.0f : 1.0f, dinp + (size_t)n0 * C, C);
            if (dweight != NULL) {
                if (oc0 == 0 || nn < N) /* all of inp fits: rounded once */
                    to_bf16(x, I, inp + (size_t)n0 * C, (size_t)n, C, (size_t)C);
                gemm_bf16(x, CUBLAS_OP_N, CUBLAS_OP_T, C, oc, n, I, C, D, oc, 1.0f,
                          dweight + (size_t)oc0 * C, C);
            }
        }
    }
}

// out = inp . weight^T + bias: the bias copied into every row, then one gemm with beta 1. In
// column-major terms out^T (OC,N) = weight^T^T . inp^T. With bf16 on (and C > 0: an empty sum
// is the fp32 path's beta alone) the gemm is matmul_forward_bf16's.
// out is (N,OC), inp is (N,C), weight is (OC,C), bias is (OC) or NULL
static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC)
{
    td_cuda_ctx *x = td__cuda_ctx();
    const float one = 1.0f;
    float beta = 0.0f;

    if (N == 0 || OC == 0)
        return;
    if (bias != NULL) {
        LAUNCH_N(x, bias_rows_kernel, (size_t)N * OC, out, bias, (size_t)N * OC, OC);
        beta = 1.0f;
    }
    if (x->bf16 && C > 0) {
        matmul_forward_bf16(x, out, inp, weight, beta, N, C, OC);
        return;
    }
    TD_CUBLAS_OP(x, cublasSgemm(x->blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, weight, C, inp,
                                C, &beta, out, OC));
}

// dinp += dout . weight (beta 0 when stored); dweight += dout^T . inp; dbias += ones . dout
// dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dbias is (OC) or NULL,
// dout is (N,OC), inp is (N,C), weight is (OC,C)
static void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int store)
{
    td_cuda_ctx *x = td__cuda_ctx();
    const float one = 1.0f, beta_dinp = store & TD_STORE_1 ? 0.0f : 1.0f;

    if (N == 0)
        return;
    if (x->bf16 && C > 0 && OC > 0 && (dinp != NULL || dweight != NULL)) {
        matmul_backward_bf16(x, dinp, dweight, dout, inp, weight, N, C, OC, store & TD_STORE_1);
        if (dbias != NULL)
            sum_rows(x, dbias, dout, N, OC);
        return;
    }
    if (dinp != NULL)
        TD_CUBLAS_OP(x, cublasSgemm(x->blas, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, weight, C,
                                    dout, OC, &beta_dinp, dinp, C));
    if (dweight != NULL)
        TD_CUBLAS_OP(x, cublasSgemm(x->blas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp, C, dout,
                                    OC, &one, dweight, C));
    if (dbias != NULL)
        sum_rows(x, dbias, dout, N, OC);
}

static void bias_forward(float *out, const float *inp, const float *bias, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();
    size_t n = (size_t)N * C;

    LAUNCH_N(x, bias_forward_kernel, n, out, inp, bias, n, C);
}

static void bias_backward(float *dinp, float *dbias, const float *dout, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();
    size_t n = (size_t)N * C;

    if (dinp != NULL)
        LAUNCH_N(x, add_kernel, n, dinp, dout, n);
    if (dbias != NULL && N > 0)
        sum_rows(x, dbias, dout, N, C);
}

static void relu_forward(float *out, const float *inp, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, relu_forward_kernel, n, out, inp, n);
}

static void relu_backward(float *dinp, const float *dout, const float *out, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, relu_backward_kernel, n, dinp, dout, out, n);
}

// The rows' losses go through the context's partial sums: at most TD_CUDA_REDUCE_BLOCKS blocks,
// each summing its rows in order, then one thread summing the blocks in order. The grid
// depends on N only, so the loss has the same bits every call.
static void softmax_xent_forward(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V, int Vp)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int G = N < TD_CUDA_REDUCE_BLOCKS ? N : TD_CUDA_REDUCE_BLOCKS;

    if (N <= 0)
        td_panic(TD_ESHAPE, "softmax_xent: %d rows", N);
    softmax_xent_kernel<<<G, ROW_BLOCK, 0, x->stream>>>(x->partial, probs, logits, targets, N, V,
                                                        Vp);
    LAUNCH_CHECK("softmax_xent_kernel");
    finish_loss_kernel<<<1, 1, 0, x->stream>>>(loss, x->partial, G, N);
    LAUNCH_CHECK("finish_loss_kernel");
}

static void softmax_xent_backward(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V, int Vp)
{
    td_cuda_ctx *x = td__cuda_ctx();
    size_t n = (size_t)N * V;

    LAUNCH_N(x, softmax_xent_backward_kernel, n, dlogits, dloss, probs, targets, N, V, Vp);
}

// softmax_xent_forward's grid and partial sums, so the loss has its bits
static void softmax_xent_fused(float *loss, float *logits, const int *targets, int N, int V, int Vp,
                               int grad)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int G = N < TD_CUDA_REDUCE_BLOCKS ? N : TD_CUDA_REDUCE_BLOCKS;

    if (N <= 0)
        td_panic(TD_ESHAPE, "softmax_xent: %d rows", N);
    softmax_xent_fused_kernel<<<G, ROW_BLOCK, 0, x->stream>>>(x->partial, logits, targets, N, V, Vp,
                                                              grad);
    LAUNCH_CHECK("softmax_xent_fused_kernel");
    finish_loss_kernel<<<1, 1, 0, x->stream>>>(loss, x->partial, G, N);
    LAUNCH_CHECK("finish_loss_kernel");
}

static void argmax_correct(int64_t *correct, const float *logits, const int *targets, int N, int V)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int G = N < TD_CUDA_REDUCE_BLOCKS ? N : TD_CUDA_REDUCE_BLOCKS;

    x->counts.memsets++;
    TD_CUDA_CHECK(cudaMemsetAsync(correct, 0, sizeof(*correct), x->stream));
    if (N <= 0 || V <= 0)
        return;
    argmax_correct_kernel<<<G, ROW_BLOCK, 0, x->stream>>>((unsigned long long *)correct, logits,
                                                          targets, N, V);
    LAUNCH_CHECK("argmax_correct_kernel");
}

static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();
    size_t n = (size_t)B * T * C;

    LAUNCH_N(x, encoder_forward_kernel, n, out, inp, wte, wpe, T, C, n);
}

// R, the number of id classes of encoder_backward_wte_kernel: a power of two, about 64K
// threads in all (C of them per class), at most 256 classes.
static int id_classes(int C)
{
    int R = 1;

    while (R < 256 && (int64_t)R * 2 * C <= 65536)
        R *= 2;
    return R;
}

static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    if ((size_t)B * T * C == 0)
        return;
    if (dwte != NULL) {
        int R = id_classes(C);
        dim3 grid((unsigned)((C + THREADS - 1) / THREADS), (unsigned)R);
        encoder_backward_wte_kernel<<<grid, THREADS, 0, x->stream>>>(dwte, dout, inp, B * T, C, R);
        LAUNCH_CHECK("encoder_backward_wte_kernel");
    }
    if (dwpe != NULL)
        LAUNCH_N(x, encoder_backward_wpe_kernel, (size_t)T * C, dwpe, dout, B, T, C);
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    if (N <= 0)
        return;
    layernorm_forward_kernel<<<row_blocks((size_t)N), ROW_WARPS * 32, 0, x->stream>>>(
        out, mean, rstd, inp, weight, bias, N, C);
    LAUNCH_CHECK("layernorm_forward_kernel");
}

static void residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C)
{
    td_cuda_ctx *x = td__cuda_ctx();

    if (N <= 0)
        return;
    residual_layernorm_kernel<<<row_blocks((size_t)N), ROW_WARPS * 32, 0, x->stream>>>(
        res, out, mean, rstd, a, b, weight, bias, N, C);
    LAUNCH_CHECK("residual_layernorm_kernel");
}

// One launch, where there were four (a dinp kernel, the column sums' partial sums, a finish for
// each of dbias and dweight): dinp a warp per row beside the column sums, whose (2G, C) partial
// sums sit in the context's scratch (G row chunks, as many up to COL_CHUNKS as fit) and whose
// last block finishes both columns. The arithmetic, and so the bits, of the four.
static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C, int store)
{
    td_cuda_ctx *x = td__cuda_ctx();
    unsigned rb = dinp != NULL ? row_blocks((size_t)N) : 0, cols = 0;
    int G = 0;

    if (N <= 0 || (dinp == NULL && dweight == NULL && dbias == NULL))
        return;
    if (dweight != NULL || dbias != NULL) {
        size_t fit = x->scratch_bytes / (2 * (size_t)C * sizeof(float));
        G = N < COL_CHUNKS ? N : COL_CHUNKS;
        cols = (unsigned)((C + THREADS - 1) / THREADS);
        if (fit < 1)
            td_panic(TD_E2BIG,
                     "layernorm backward: C = %d needs %zu bytes of CUDA scratch, the "
                     "context has %zu",
                     C, 2 * (size_t)C * sizeof(float), x->scratch_bytes);
        if ((size_t)G > fit)
            G = (int)fit;
    }
    layernorm_backward_kernel<<<rb + (unsigned)G * cols, ROW_WARPS * 32, 0, x->stream>>>(
        dinp, dweight, dbias, x->scratch, x->ticket, dout, inp, weight, mean, rstd, N, C, G,
        store & TD_STORE_1, rb, cols);
    LAUNCH_CHECK("layernorm_backward_kernel");
}

static void gelu_forward(float *out, const float *inp, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, gelu_forward_kernel, n, out, inp, n);
}

static void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n, int store)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, gelu_backward_kernel, n, dinp, inp, dout, n, store & TD_STORE_1);
}

static void residual_forward(float *out, const float *inp1, const float *inp2, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, residual_forward_kernel, n, out, inp1, inp2, n);
}

// Both gradients in one launch
static void residual_backward(float *dinp1, float *dinp2, const float *dout, size_t n, int store)
{
    td_cuda_ctx *x = td__cuda_ctx();

    if (dinp1 != NULL || dinp2 != NULL)
        LAUNCH_N(x, residual_backward_kernel, n, dinp1, dinp2, dout, n, store);
}

// ---- fused attention ------------------------------------------------------------------------
//
// The plan's blocks one after another (kernels/attn_plan.h, the CPU table's blocks): for each,
// one kernel fills the pointer arrays of its (sequence, head) pairs (in the scratch's tail),
// then every product is one cublasSgemmBatched over all nb * NH pairs of the block: the scores
// against keys [0, cols) (cols = r0 + rows when causal: the block's last row's diagonal) into
// the block's part of the scratch (pair p at p * rows * cols floats), a warp per row for the
// softmax, and the gemms that use them. So a GPT-2 layer at B 16, T 1024 is 8 blocks (56
// gemms a step, where a loop over heads or sequences in row chunks of 85 issued 1,092). Nothing
// is kept but out and lse; the backward recomputes the scores. With bf16 on, these fp32 gemms
// run in TF32 (the context's math mode: 10 mantissa bits, more than bf16's 7), where the
// replaced attention multiplied bf16 copies.

// The pointer arrays of one block (npair pairs from sequence b0) for n sets: set a's array at
// ptrs + a * npair; X_p = base + (b0 + p / NH) * sb + (p % NH) * sh
static const float **attn_ptrs(td_cuda_ctx *x, float *scratch, size_t at, attn_ptr_set *set, int n,
                               int npair, int NH)
{
    const float **ptrs = (const float **)(scratch + at);
    size_t total = (size_t)n * npair;

    attn_ptrs_kernel<<<(unsigned)((total + THREADS - 1) / THREADS), THREADS, 0, x->stream>>>(
        ptrs, *set, n, npair, NH);
    LAUNCH_CHECK("attn_ptrs_kernel");
    return ptrs;
}

// For every pair p < npair: C_p = alpha op(A_p) op(B_p) + beta C_p, column-major, A_p, B_p,
// C_p from the pointer arrays
static void gemm_pairs(td_cuda_ctx *x, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                       int k, float alpha, const float *const *A, int lda, const float *const *B,
                       int ldb, float beta, const float *const *C, int ldc, int npair)
{
    TD_CUBLAS_OP(x, cublasSgemmBatched(x->blas, ta, tb, m, n, k, &alpha, A, lda, B, ldb, &beta,
                                       (float *const *)C, ldc, npair));
}

// Pointer set a: base + b0's offset, strides by sequence and by head
static void set_ptr(attn_ptr_set *set, int a, const float *base, int b0, long long sb, long long sh)
{
    set->base[a] = base + (long long)b0 * sb;
    set->sb[a] = sb;
    set->sh[a] = sh;
}

// out is (B,Nq,NH*hs), lse is (B,NH,Nq), scratch is td_attn_scratch(d, 0),
// q is (B,Nq,ldq), k is (B,Nk,ldk), v is (B,Nk,ldv)
static void attention_forward(float *out, float *lse, float *scratch, const float *q,
                              const float *k, const float *v, const td_attn_dims *d)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int C = d->NH * d->hs;
    size_t at = td_attn_scratch_ptrs(d, 0);
    float scale = 1.0f / sqrtf((float)d->hs);
    td_attn_block blk = {};

    if (d->chunk < 1)
        td_panic(TD_EINVAL, "attention: a chunk of %d query rows", d->chunk);
    while (td_attn_next(d, &blk)) {
        int np = blk.nb * d->NH, rows = blk.rows, cols = blk.cols;
        long long slot = (long long)rows * cols;
        attn_ptr_set set;
        const float **P;
        set_ptr(&set, 0, k, blk.b0, (long long)d->Nk * d->ldk, d->hs);
        set_ptr(&set, 1, q + (size_t)blk.r0 * d->ldq, blk.b0, (long long)d->Nq * d->ldq, d->hs);
        set_ptr(&set, 2, scratch, 0, d->NH * slot, slot);
        set_ptr(&set, 3, v, blk.b0, (long long)d->Nk * d->ldv, d->hs);
        set_ptr(&set, 4, out + (size_t)blk.r0 * C, blk.b0, (long long)d->Nq * C, d->hs);
        P = attn_ptrs(x, scratch, at, &set, 5, np, d->NH);
        /* s^T (cols, rows) = scale k q^T */
        gemm_pairs(x, CUBLAS_OP_T, CUBLAS_OP_N, cols, rows, d->hs, scale, P, d->ldk, P + np, d->ldq,
                   0.0f, P + 2 * np, cols, np);
        attn_softmax_kernel<<<row_blocks((size_t)np * rows), ROW_WARPS * 32, 0, x->stream>>>(
            scratch, lse + (size_t)blk.b0 * d->NH * d->Nq, np, rows, cols, (size_t)slot, blk.r0,
            d->Nq, d->causal);
        LAUNCH_CHECK("attn_softmax_kernel");
        /* out^T (hs, rows) = v^T (hs, cols) p^T (cols, rows) */
        gemm_pairs(x, CUBLAS_OP_N, CUBLAS_OP_N, d->hs, rows, cols, 1.0f, P + 3 * np, d->ldv,
                   P + 2 * np, cols, 0.0f, P + 4 * np, C, np);
    }
}

// D = rowsum(dout * out) first, into the scratch's head; then per block: p = the scores again
// (then their softmax from lse), dp = dout v^T, one kernel turning them into p and
// dS = scale p (dp - D), and dv += p^T dout, dq += dS k, dk += dS^T q. Stored gradients: dq
// by beta 0 (every block writes its rows once), dk and dv by beta 0 at a sequence's first block
// when that block's keys are all of them (whole sequences, or no mask); a causal attention in
// row chunks zeroes their head columns first (one launch each) and accumulates.
// dq, dk, dv like q, k, v (or NULL), scratch is td_attn_scratch(d, 1): D (B*NH*Nq), then the
// block's p, then its dp (B*NH*chunk*Nk floats of room each), then the pointer arrays; dout and
// out are (B,Nq,NH*hs), lse is (B,NH,Nq)
static void attention_backward(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const td_attn_dims *d, int store)
{
    td_cuda_ctx *x = td__cuda_ctx();
    int C = d->NH * d->hs;
    size_t nd = (size_t)d->B * d->NH * d->Nq, room = (size_t)d->B * d->NH * d->chunk * d->Nk;
    size_t at = td_attn_scratch_ptrs(d, 1);
    float scale = 1.0f / sqrtf((float)d->hs), *D = scratch, *p = scratch + nd, *dp = p + room;
    long long qs = (long long)d->Nq * d->ldq, ks = (long long)d->Nk * d->ldk;
    long long vs = (long long)d->Nk * d->ldv, os = (long long)d->Nq * C;
    td_attn_block blk = {};

    if (d->chunk < 1)
        td_panic(TD_EINVAL, "attention: a chunk of %d query rows", d->chunk);
    if (d->causal && d->Nq != d->Nk) /* a stored dk, dv would miss keys [Nq, Nk) */
        td_panic(TD_EINVAL, "attention: causal with %d queries and %d keys", d->Nq, d->Nk);
    if (d->B == 0 || d->NH == 0 || d->Nq == 0 || d->Nk == 0 ||
        (dq == NULL && dk == NULL && dv == NULL))
        return;
    attn_d_kernel<<<row_blocks(nd), ROW_WARPS * 32, 0, x->stream>>>(D, dout, out, d->B, d->NH,
                                                                    d->Nq, d->hs);
    LAUNCH_CHECK("attn_d_kernel");
    if (d->causal && !td_attn_by_seq(d) && (store & (TD_STORE_2 | TD_STORE_3))) {
        size_t krows = (size_t)d->B * d->Nk;
        if (dk != NULL && store & TD_STORE_2)
            LAUNCH_N(x, zero_cols_kernel, krows * C, dk, krows, C, (size_t)d->ldk);
        if (dv != NULL && store & TD_STORE_3)
            LAUNCH_N(x, zero_cols_kernel, krows * C, dv, krows, C, (size_t)d->ldv);
        store &= ~(TD_STORE_2 | TD_STORE_3);
    }
    while (td_attn_next(d, &blk)) {
        int np = blk.nb * d->NH, rows = blk.rows, cols = blk.cols, b0 = blk.b0;
        /* beta 0 where this block is the first to write a stored gradient's rows */
        float bq = store & TD_STORE_1 ? 0.0f : 1.0f;
        float bk = store & TD_STORE_2 && blk.r0 == 0 ? 0.0f : 1.0f;
        float bv = store & TD_STORE_3 && blk.r0 == 0 ? 0.0f : 1.0f;
        long long slot = (long long)rows * cols;
        size_t r0 = (size_t)blk.r0, lo = (size_t)b0 * d->NH * d->Nq;
        attn_ptr_set set;
        const float **P;
        /* a gradient not asked for points at its input: its array is filled, never used */
        set_ptr(&set, 0, k, b0, ks, d->hs);
        set_ptr(&set, 1, q + r0 * d->ldq, b0, qs, d->hs);
        set_ptr(&set, 2, p, 0, d->NH * slot, slot);
        set_ptr(&set, 3, v, b0, vs, d->hs);
        set_ptr(&set, 4, dout + r0 * C, b0, os, d->hs);
        set_ptr(&set, 5, dp, 0, d->NH * slot, slot);
        set_ptr(&set, 6, dv != NULL ? dv : v, b0, vs, d->hs);
        set_ptr(&set, 7, (dq != NULL ? dq : q) + r0 * d->ldq, b0, qs, d->hs);
        set_ptr(&set, 8, dk != NULL ? dk : k, b0, ks, d->hs);
        P = attn_ptrs(x, scratch, at, &set, 9, np, d->NH);
        /* p^T = scale k q^T, dp^T = v dout^T */
        gemm_pairs(x, CUBLAS_OP_T, CUBLAS_OP_N, cols, rows, d->hs, scale, P, d->ldk, P + np, d->ldq,
                   0.0f, P + 2 * np, cols, np);
        gemm_pairs(x, CUBLAS_OP_T, CUBLAS_OP_N, cols, rows, d->hs, 1.0f, P + 3 * np, d->ldv,
                   P + 4 * np, C, 0.0f, P + 5 * np, cols, np);
        attn_grad_kernel<<<row_blocks((size_t)np * rows), ROW_WARPS * 32, 0, x->stream>>>(
            p, dp, lse + lo, D + lo, np, rows, cols, (size_t)slot, blk.r0, d->Nq, d->causal, scale);
        LAUNCH_CHECK("attn_grad_kernel");
        if (dv != NULL) /* dv^T (hs, cols) += dout^T (hs, rows) p (rows, cols) */
            gemm_pairs(x, CUBLAS_OP_N, CUBLAS_OP_T, d->hs, cols, rows, 1.0f, P + 4 * np, C,
                       P + 2 * np, cols, bv, P + 6 * np, d->ldv, np);
        if (dq != NULL) /* dq^T (hs, rows) += k^T (hs, cols) dS^T (cols, rows) */
            gemm_pairs(x, CUBLAS_OP_N, CUBLAS_OP_N, d->hs, rows, cols, 1.0f, P, d->ldk, P + 5 * np,
                       cols, bq, P + 7 * np, d->ldq, np);
        if (dk != NULL) /* dk^T (hs, cols) += q^T (hs, rows) dS (rows, cols) */
            gemm_pairs(x, CUBLAS_OP_N, CUBLAS_OP_T, d->hs, cols, rows, 1.0f, P + np, d->ldq,
                       P + 5 * np, cols, bk, P + 8 * np, d->ldk, np);
    }
}

// Two stages through the context's partial sums, the grid a function of n only: the same
// bits every call, as cpu.c promises.
static void sumsq(double *out, const float *p, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();
    size_t want = (n + (size_t)THREADS * 4 - 1) / ((size_t)THREADS * 4);
    int G = want < 1 ? 1 : want < TD_CUDA_REDUCE_BLOCKS ? (int)want : TD_CUDA_REDUCE_BLOCKS;

    sumsq_partial_kernel<<<G, THREADS, 0, x->stream>>>(x->partial, p, n);
    LAUNCH_CHECK("sumsq_partial_kernel");
    sumsq_finish_kernel<<<1, 1, 0, x->stream>>>(out, x->partial, G);
    LAUNCH_CHECK("sumsq_finish_kernel");
}

static void scale(float *p, float s, size_t n)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, scale_kernel, n, p, s, n);
}

// The scalars exactly as cpu.c's adamw_update computes them (double bias corrections)
static void adamw_update(float *param, float *m, float *v, const float *grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    td_cuda_ctx *x = td__cuda_ctx();
    double bc1 = 1.0 - pow(beta1, (double)t);
    double bc2 = 1.0 - pow(beta2, (double)t);
    float step_size = (float)(lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float decay = 1.0f - lr * weight_decay;
    float w1 = 1.0f - beta1, w2 = 1.0f - beta2;

    LAUNCH_N(x, adamw_kernel, n, param, m, v, grad, n, beta2, eps, step_size, bc2_sqrt, decay, w1,
             w2);
}

static void clip_scale(float *out, const double *sumsq, const float *loss, float max_norm)
{
    td_cuda_ctx *x = td__cuda_ctx();

    clip_scale_kernel<<<1, 1, 0, x->stream>>>(out, sumsq, loss, max_norm);
    LAUNCH_CHECK("clip_scale_kernel");
}

// One launch over all n elements; the scalars as adamw_update computes them
static void adamw_flat(float *param, float *m, float *v, float *grad, size_t n,
                       const td_adamw_span *spans, int nspans, const float *scale, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    td_cuda_ctx *x = td__cuda_ctx();
    double bc1 = 1.0 - pow(beta1, (double)t);
    double bc2 = 1.0 - pow(beta2, (double)t);
    float step_size = (float)(lr / bc1);
    float bc2_sqrt = (float)sqrt(bc2);
    float decay_on = 1.0f - lr * weight_decay, decay_off = 1.0f - lr * 0.0f;
    float w1 = 1.0f - beta1, w2 = 1.0f - beta2;

    LAUNCH_N(x, adamw_flat_kernel, n, param, m, v, grad, n, spans, nspans, scale, beta2, eps,
             step_size, bc2_sqrt, decay_on, decay_off, w1, w2);
}

static void sgd_update(float *param, float *buf, const float *grad, size_t n, float lr,
                       float momentum, float weight_decay)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, sgd_kernel, n, param, momentum != 0.0f ? buf : NULL, grad, n, lr, momentum,
             weight_decay);
}

static void sgd_flat(float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
                     float momentum, float weight_decay)
{
    td_cuda_ctx *x = td__cuda_ctx();

    LAUNCH_N(x, sgd_flat_kernel, n, param, momentum != 0.0f ? buf : NULL, grad, n, factor, lr,
             momentum, weight_decay);
}

// In kernels.h's order (C++ designated initializers must keep it).
static const td_kernels cuda_kernels = {
    .name = "cuda",
    .host = 0,
    .alloc = td_cuda_alloc,
    .free = td_cuda_free,
    .alloc_host = td_cuda_alloc_host,
    .free_host = td_cuda_free_host,
    .upload = td_cuda_upload,
    .download = td_cuda_download,
    .upload_async = td_cuda_upload_async,
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
    .token_mean_forward = td__cuda_token_mean_forward,
    .token_mean_backward = td__cuda_token_mean_backward,
    .gather_rows_forward = td__cuda_gather_rows_forward,
    .gather_rows_backward = td__cuda_gather_rows_backward,
    .l2norm_forward = td__cuda_l2norm_forward,
    .l2norm_backward = td__cuda_l2norm_backward,
    .siglip_forward = td__cuda_siglip_forward,
    .siglip_backward = td__cuda_siglip_backward,
};

extern "C" const td_kernels *td_kernels_cuda(void)
{
    return &cuda_kernels;
}

extern "C" cudaError_t td__cuda_fill(float *p, float v, size_t n, cudaStream_t stream)
{
    if (n == 0)
        return cudaSuccess;
    fill_kernel<<<(unsigned)((n + THREADS - 1) / THREADS < 4096 ? (n + THREADS - 1) / THREADS
                                                                : 4096),
                  THREADS, 0, stream>>>(p, v, n);
    return cudaGetLastError();
}

/* Address 16: the device's page 0 is never mapped, so the store faults. */
extern "C" void td_cuda_fault_illegal_address(void)
{
    td_cuda_ctx *x = td__cuda_ctx();

    fault_kernel<<<1, 1, 0, x->stream>>>((volatile int *)(uintptr_t)16);
    LAUNCH_CHECK("fault_kernel");
}
