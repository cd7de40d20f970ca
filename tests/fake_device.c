/* The fake device of fake_device.h: the CPU table behind a pointer translation. */
#include <stdlib.h>
#include <string.h>

#include "tests/fake_device.h"

#define OFFSET ((uintptr_t)1 << 62) /* heap address + this: non-canonical, faults on access */

static fd_counters counts;
static int64_t allocs_left = -1; /* fd_fail_allocs_after */

void fd_fail_allocs_after(int64_t n)
{
    allocs_left = n;
}

void *fd_host(const void *device)
{
    return device != NULL ? (void *)((uintptr_t)device - OFFSET) : NULL;
}

static void *dev(void *host)
{
    return host != NULL ? (void *)((uintptr_t)host + OFFSET) : NULL;
}

#define H(p)  ((float *)fd_host(p))
#define HC(p) ((const float *)fd_host(p))
#define CPU   td_kernels_cpu()

static int fd_alloc(void **p, size_t bytes, td_error_t *err)
{
    int rc;

    if (allocs_left == 0) {
        *p = NULL;
        return td_error_set(err, TD_ENOMEM, "fake device: out of memory allocating %zu bytes",
                            bytes);
    }
    if (allocs_left > 0)
        allocs_left--;
    rc = CPU->alloc(p, bytes, err);

    if (rc == 0) {
        *p = dev(*p);
        __atomic_add_fetch(&counts.allocs, 1, __ATOMIC_RELAXED); /* replicas share it */
    }
    return rc;
}

static void fd_free(void *p)
{
    if (p != NULL)
        __atomic_add_fetch(&counts.frees, 1, __ATOMIC_RELAXED); /* replicas share it */
    CPU->free(fd_host(p));
}

/* Host memory: the host touches it (the trainer's batch stage) */
static int fd_alloc_host(void **p, size_t bytes, td_error_t *err)
{
    return CPU->alloc_host(p, bytes, err);
}

static void fd_free_host(void *p)
{
    CPU->free_host(p);
}

static void fd_upload(void *dst, const void *src, size_t bytes)
{
    __atomic_add_fetch(&counts.uploads, 1, __ATOMIC_RELAXED); /* replicas share it */
    memcpy(fd_host(dst), src, bytes);
}

static void fd_upload_async(void *dst, const void *src, size_t bytes)
{
    __atomic_add_fetch(&counts.uploads, 1, __ATOMIC_RELAXED); /* replicas share it */
    memcpy(fd_host(dst), src, bytes);
}

static void fd_download(void *dst, const void *src, size_t bytes)
{
    __atomic_add_fetch(&counts.downloads, 1, __ATOMIC_RELAXED); /* replicas share it */
    memcpy(dst, fd_host(src), bytes);
}

static void set_threads(int n)
{
    CPU->set_threads(n);
}

static void zero(float *p, size_t n)
{
    CPU->zero(H(p), n);
}

static void matmul_forward(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC)
{
    CPU->matmul_forward(H(out), HC(inp), HC(weight), HC(bias), N, C, OC);
}

static void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int store)
{
    CPU->matmul_backward(H(dinp), H(dweight), H(dbias), HC(dout), HC(inp), HC(weight), N, C, OC,
                         store);
}

static void bias_forward(float *out, const float *inp, const float *bias, int N, int C)
{
    CPU->bias_forward(H(out), HC(inp), HC(bias), N, C);
}

static void bias_backward(float *dinp, float *dbias, const float *dout, int N, int C)
{
    CPU->bias_backward(H(dinp), H(dbias), HC(dout), N, C);
}

static void relu_forward(float *out, const float *inp, size_t n)
{
    CPU->relu_forward(H(out), HC(inp), n);
}

static void relu_backward(float *dinp, const float *dout, const float *out, size_t n)
{
    CPU->relu_backward(H(dinp), HC(dout), HC(out), n);
}

static void softmax_xent_forward(float *loss, float *probs, const float *logits, const int *targets,
                                 int N, int V, int Vp)
{
    CPU->softmax_xent_forward(H(loss), H(probs), HC(logits), fd_host(targets), N, V, Vp);
}

static void softmax_xent_backward(float *dlogits, const float *dloss, const float *probs,
                                  const int *targets, int N, int V, int Vp)
{
    CPU->softmax_xent_backward(H(dlogits), HC(dloss), HC(probs), fd_host(targets), N, V, Vp);
}

static void softmax_xent_fused(float *loss, float *logits, const int *targets, int N, int V, int Vp,
                               int grad)
{
    CPU->softmax_xent_fused(H(loss), H(logits), fd_host(targets), N, V, Vp, grad);
}

static void argmax_correct(int64_t *correct, const float *logits, const int *targets, int N, int V)
{
    CPU->argmax_correct(fd_host(correct), HC(logits), fd_host(targets), N, V);
}

static void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B,
                            int T, int C)
{
    CPU->encoder_forward(H(out), fd_host(inp), HC(wte), HC(wpe), B, T, C);
}

static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                             int T, int C)
{
    CPU->encoder_backward(H(dwte), H(dwpe), HC(dout), fd_host(inp), B, T, C);
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                              const float *weight, const float *bias, int N, int C)
{
    CPU->layernorm_forward(H(out), H(mean), H(rstd), HC(inp), HC(weight), HC(bias), N, C);
}

static void residual_layernorm_forward(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C)
{
    CPU->residual_layernorm_forward(H(res), H(out), H(mean), H(rstd), HC(a), HC(b), HC(weight),
                                    HC(bias), N, C);
}

static void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C, int store)
{
    CPU->layernorm_backward(H(dinp), H(dweight), H(dbias), HC(dout), HC(inp), HC(weight), HC(mean),
                            HC(rstd), N, C, store);
}

static void gelu_forward(float *out, const float *inp, size_t n)
{
    CPU->gelu_forward(H(out), HC(inp), n);
}

static void gelu_backward(float *dinp, const float *inp, const float *dout, size_t n, int store)
{
    CPU->gelu_backward(H(dinp), HC(inp), HC(dout), n, store);
}

static void residual_forward(float *out, const float *inp1, const float *inp2, size_t n)
{
    CPU->residual_forward(H(out), HC(inp1), HC(inp2), n);
}

static void residual_backward(float *dinp1, float *dinp2, const float *dout, size_t n, int store)
{
    CPU->residual_backward(H(dinp1), H(dinp2), HC(dout), n, store);
}

static void attention_forward(float *out, float *lse, float *scratch, const float *q,
                              const float *k, const float *v, const td_attn_dims *d)
{
    CPU->attention_forward(H(out), H(lse), H(scratch), HC(q), HC(k), HC(v), d);
}

static void attention_backward(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const td_attn_dims *d, int store)
{
    CPU->attention_backward(H(dq), H(dk), H(dv), H(scratch), HC(dout), HC(q), HC(k), HC(v), HC(out),
                            HC(lse), d, store);
}

static void sumsq(double *out, const float *p, size_t n)
{
    CPU->sumsq(fd_host(out), HC(p), n);
}

static void scale(float *p, float s, size_t n)
{
    CPU->scale(H(p), s, n);
}

static void adamw_update(float *param, float *m, float *v, const float *grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    CPU->adamw_update(H(param), H(m), H(v), HC(grad), n, lr, beta1, beta2, eps, weight_decay, t);
}

static void clip_scale(float *out, const double *sumsq, const float *loss, float max_norm)
{
    CPU->clip_scale(H(out), fd_host(sumsq), HC(loss), max_norm);
}

static void adamw_flat(float *param, float *m, float *v, float *grad, size_t n,
                       const td_adamw_span *spans, int nspans, const float *scale, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int64_t t)
{
    CPU->adamw_flat(H(param), H(m), H(v), H(grad), n, fd_host(spans), nspans, HC(scale), lr, beta1,
                    beta2, eps, weight_decay, t);
}

static void sgd_update(float *param, float *buf, const float *grad, size_t n, float lr,
                       float momentum, float weight_decay)
{
    CPU->sgd_update(H(param), H(buf), HC(grad), n, lr, momentum, weight_decay);
}

static void sgd_flat(float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
                     float momentum, float weight_decay)
{
    CPU->sgd_flat(H(param), H(buf), H(grad), n, HC(factor), lr, momentum, weight_decay);
}

static void token_mean_forward(float *out, const float *inp, int B, int N, int C)
{
    CPU->token_mean_forward(H(out), HC(inp), B, N, C);
}

static void token_mean_backward(float *dinp, const float *dout, int B, int N, int C)
{
    CPU->token_mean_backward(H(dinp), HC(dout), B, N, C);
}

static void gather_rows_forward(float *out, const float *inp, const int *idx, int B, int T, int C)
{
    CPU->gather_rows_forward(H(out), HC(inp), fd_host(idx), B, T, C);
}

static void gather_rows_backward(float *dinp, const float *dout, const int *idx, int B, int T,
                                 int C)
{
    CPU->gather_rows_backward(H(dinp), HC(dout), fd_host(idx), B, T, C);
}

static void l2norm_forward(float *out, float *norm, const float *inp, int N, int C)
{
    CPU->l2norm_forward(H(out), H(norm), HC(inp), N, C);
}

static void l2norm_backward(float *dinp, const float *dout, const float *out, const float *norm,
                            int N, int C)
{
    CPU->l2norm_backward(H(dinp), HC(dout), HC(out), HC(norm), N, C);
}

static void siglip_forward(float *loss, const float *dots, const float *t, const float *b,
                           const int *labels, float same, int N, int M, int diag, float weight)
{
    CPU->siglip_forward(H(loss), HC(dots), HC(t), HC(b), fd_host(labels), same, N, M, diag, weight);
}

static void siglip_backward(float *ddots, float *dt, float *db, const float *dloss,
                            const float *dots, const float *t, const float *b, const int *labels,
                            float same, int N, int M, int diag, float weight)
{
    CPU->siglip_backward(H(ddots), H(dt), H(db), HC(dloss), HC(dots), HC(t), HC(b), fd_host(labels),
                         same, N, M, diag, weight);
}

static const td_kernels fake = {
    .name = "fake-device",
    .host = 0,
    .alloc = fd_alloc,
    .free = fd_free,
    .alloc_host = fd_alloc_host,
    .free_host = fd_free_host,
    .upload = fd_upload,
    .download = fd_download,
    .upload_async = fd_upload_async,
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
    .token_mean_forward = token_mean_forward,
    .token_mean_backward = token_mean_backward,
    .gather_rows_forward = gather_rows_forward,
    .gather_rows_backward = gather_rows_backward,
    .l2norm_forward = l2norm_forward,
    .l2norm_backward = l2norm_backward,
    .siglip_forward = siglip_forward,
    .siglip_backward = siglip_backward,
};

const td_kernels *fd_kernels(void)
{
    return &fake;
}

fd_counters fd_counts(void)
{
    fd_counters c;

    c.allocs = __atomic_load_n(&counts.allocs, __ATOMIC_RELAXED);
    c.frees = __atomic_load_n(&counts.frees, __ATOMIC_RELAXED);
    c.uploads = __atomic_load_n(&counts.uploads, __ATOMIC_RELAXED);
    c.downloads = __atomic_load_n(&counts.downloads, __ATOMIC_RELAXED);
    return c;
}
