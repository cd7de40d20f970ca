/* Compute kernels: every op the engine (train/) runs, as one backend table per device kind.
 * A backend is a struct of function pointers; train/ picks one table per trainer and calls
 * only through it, so the same model code runs on the CPU (OpenBLAS sgemm + C loops, cpu.c)
 * and, later, CUDA (kernels + cuBLAS). Owns no memory: every pointer is the caller's and lives
 * where the backend computes (host memory for "cpu").
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

#ifdef __cplusplus
extern "C" {
#endif

typedef struct td_kernels {
    const char *name; /* "cpu" */

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

    // probs = softmax(logits) by row; loss = mean over rows of -log probs[row][targets[row]]
    // loss is (1), probs is (N,V), logits is (N,V), targets is (N) with values in [0,V)
    void (*softmax_xent_forward)(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V);
    // dlogits += dloss * (probs - onehot(targets)) / N
    // dlogits is (N,V), dloss is (1), probs is (N,V) from the forward, targets is (N)
    void (*softmax_xent_backward)(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V);
    // correct = how many rows have their largest logit (first of equals) at the target
    // correct is (1), logits is (N,V), targets is (N)
    void (*argmax_correct)(int64_t *correct, const float *logits, const int *targets, int N, int V);

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
