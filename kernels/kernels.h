/* Compute kernels: every op the engine (train/) runs, as one backend table per device kind.
 * A backend is a struct of function pointers; train/ picks one table per trainer and calls
 * only through it, so the same model code runs on the CPU (OpenBLAS sgemm + C loops, cpu.c)
 * and CUDA (kernels + cuBLAS, kernels/cuda). Owns no memory: every pointer is the caller's and
 * lives where the backend computes (host memory for "cpu", device memory for "cuda").
 *
 * Conventions, llm.c style: outputs first, then inputs, then dimensions; shapes in comments
 * (`// inp is (N,C)`), row-major. Backward kernels ACCUMULATE (+=) into their gradient
 * outputs, so a tensor read by several ops collects every contribution; the caller zeroes
 * gradients before a backward pass. A gradient output given as NULL is not computed.
 *
 * Threads: kernels keep no state; a table may be used by any number of threads at once (the
 * BLAS thread count is process-wide, see openblas_set_num_threads). */
#ifndef TD_KERNELS_H
#define TD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "td_errno.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_kernels {
    const char *name; /* "cpu", "cuda" */

    /* 1 when the backend's memory is host memory that the caller may read and write in place
     * (cpu); 0 when it is not (cuda: device memory), and the caller moves bytes in and out
     * only with upload and download. */
    int host;

    // Memory where the backend computes: *p = bytes (not cleared), aligned to 256 bytes.
    // TD_ENOMEM or TD_ECUDA with err naming the size; *p NULL then. Release with free (NULL ok)
    int (*alloc)(void **p, size_t bytes, td_error_t *err);
    void (*free)(void *p);
    // dst (backend memory) = src (host memory), bytes of it; returns when the copy is done and
    // every op queued before it has run
    void (*upload)(void *dst, const void *src, size_t bytes);
    // dst (host memory) = src (backend memory); returns when the copy is done, after every op
    // queued before it. A failed op queued earlier panics here
    void (*download)(void *dst, const void *src, size_t bytes);

    // How many threads the backend's library may use (OpenBLAS: process-wide); n > 0
    void (*set_threads)(int n);

    // p[i] = 0 for i in [0,n)
    void (*zero)(float *p, size_t n);

    // out = inp . weight^T + bias
    // out is (N,OC), inp is (N,C), weight is (OC,C), bias is (OC) or NULL
    void (*matmul_forward)(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC);
    // dinp += dout . weight, dweight += dout^T . inp, dbias += sum over rows of dout
    // dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dbias is (OC) or NULL,
    // dout is (N,OC), inp is (N,C), weight is (OC,C)
    void (*matmul_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC);

    // out = inp + bias, the bias broadcast over rows
    // out is (N,C), inp is (N,C), bias is (C); out may be inp
    void (*bias_forward)(float *out, const float *inp, const float *bias, int N, int C);
    // dinp += dout, dbias += sum over rows of dout
    // dinp is (N,C) or NULL, dbias is (C) or NULL, dout is (N,C)
    void (*bias_backward)(float *dinp, float *dbias, const float *dout, int N, int C);

    // out = max(inp, 0), NaN passed through (as PyTorch does, so a NaN loss is not hidden)
    // out is (n), inp is (n); out may be inp
    void (*relu_forward)(float *out, const float *inp, size_t n);
    // dinp += dout where out > 0
    // dinp is (n), dout is (n), out is (n) (the forward's output)
    void (*relu_backward)(float *dinp, const float *dout, const float *out, size_t n);

    // probs = softmax(logits[:, :V]) by row, probs[:, V:Vp] = 0 (llm.c's padded vocabulary);
    // loss = mean over rows of -log probs[row][targets[row]]
    // loss is (1), probs is (N,Vp), logits is (N,Vp), targets is (N) with values in [0,V)
    void (*softmax_xent_forward)(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V, int Vp);
    // dlogits[:, :V] += dloss * (probs - onehot(targets)) / N (the padding gets nothing)
    // dlogits is (N,Vp), dloss is (1), probs is (N,Vp) from the forward, targets is (N)
    void (*softmax_xent_backward)(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V, int Vp);
    // correct = how many rows have their largest logit (first of equals) at the target
    // correct is (1), logits is (N,V), targets is (N)
    void (*argmax_correct)(int64_t *correct, const float *logits, const int *targets, int N, int V);

    // out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
    // out is (B,T,C), inp is (B,T) token ids, wte is (V,C), wpe is (maxT,C) with maxT >= T
    void (*encoder_forward)(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C);
    // dwte[inp[b,t],:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:]
    // dwte is (V,C) or NULL, dwpe is (maxT,C) or NULL, dout is (B,T,C), inp is (B,T)
    void (*encoder_backward)(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C);

    // out = (inp - mean) * rstd * weight + bias by row, eps 1e-5 (PyTorch's and llm.c's)
    // out is (N,C), mean and rstd are (N) (kept for the backward), inp is (N,C),
    // weight and bias are (C)
    void (*layernorm_forward)(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C);
    // dinp += d/dinp, dweight += sum over rows of dout*norm, dbias += sum over rows of dout
    // dinp is (N,C) or NULL, dweight and dbias are (C) or NULL, dout and inp are (N,C),
    // weight is (C), mean and rstd are (N) from the forward
    void (*layernorm_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C);

    // out = GELU(inp), the tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    // out is (n), inp is (n)
    void (*gelu_forward)(float *out, const float *inp, size_t n);
    // dinp += GELU'(inp) * dout
    // dinp is (n), inp is (n) (the forward's input), dout is (n)
    void (*gelu_backward)(float *dinp, const float *inp, const float *dout, size_t n);

    // out = inp1 + inp2
    // out, inp1, inp2 are (n)
    void (*residual_forward)(float *out, const float *inp1, const float *inp2, size_t n);
    // dinp1 += dout, dinp2 += dout
    // dinp1 and dinp2 are (n) or NULL, dout is (n)
    void (*residual_backward)(float *dinp1, float *dinp2, const float *dout, size_t n);

    // Causal multi-head self-attention, llm.c's layout: head h of position t reads
    // q = qkv[b,t,h*hs..], k = qkv[b,t,C+h*hs..], v = qkv[b,t,2C+h*hs..], hs = C/NH;
    // att[b,h,t,:] = softmax(q_t . k_{0..t} / sqrt(hs)) (entries past t are 0);
    // out[b,t,h*hs..] = att[b,h,t,:] . v
    // out is (B,T,C), att is (B,NH,T,T) (kept for the backward), qkv is (B,T,3C)
    void (*attention_forward)(float *out, float *att, const float *qkv, int B, int T, int C,
                              int NH);
    // dqkv += the gradient through the attention of dout
    // dqkv is (B,T,3C), scratch is (T,T) floats of room, dout is (B,T,C), qkv is (B,T,3C),
    // att is (B,NH,T,T) from the forward
    void (*attention_backward)(float *dqkv, float *scratch, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH);

    // sumsq = sum of p[i]^2, accumulated in double in a fixed order (the same bits every call)
    // sumsq is (1), p is (n)
    void (*sumsq)(double *sumsq, const float *p, size_t n);
    // p *= s
    // p is (n)
    void (*scale)(float *p, float s, size_t n);

    // AdamW step t (1-based), PyTorch's torch.optim.AdamW: param *= 1 - lr*weight_decay;
    // m = lerp(m, grad, 1-beta1); v = beta2*v + (1-beta2)*grad^2;
    // param -= lr/(1-beta1^t) * m / (sqrt(v)/sqrt(1-beta2^t) + eps)
    // param, m, v, grad are (n)
    void (*adamw_update)(float *param, float *m, float *v, const float *grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t t);
    // SGD with momentum, PyTorch's torch.optim.SGD (dampening 0, not Nesterov):
    // g = grad + weight_decay*param; buf = momentum*buf + g; param -= lr*buf
    // (buf starts at zero, so the first step sets buf = g as PyTorch does)
    // param, buf, grad are (n); buf may be NULL when momentum is 0
    void (*sgd_update)(float *param, float *buf, const float *grad, size_t n, float lr,
                       float momentum, float weight_decay);
} td_kernels;

/* The CPU backend: OpenBLAS sgemm for every matmul, plain C loops for the rest. A static
 * table; never NULL. */
const td_kernels *td_kernels_cpu(void);

#ifdef TD_HAVE_CUDA
/* How many CUDA devices this process sees. *n = 0 and 0 returned when there is no device or
 * no driver; TD_ECUDA for any other CUDA runtime error. (kernels/cuda/probe.cu) */
int td_cuda_device_count(int *n);
#endif

#ifdef __cplusplus
}
#endif

#endif
