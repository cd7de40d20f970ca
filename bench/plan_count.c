/* bench_gpu --plan's counting table (plan_count.h): every op a no-op that counts. */
#include "bench/plan_count.h"

#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

static pc_counts K;

void pc_reset(void)
{
    memset(&K, 0, sizeof(K));
}

pc_counts pc_get(void)
{
    return K;
}

/* An output of a store-capable kernel: stored when its bit is set, else added into. */
static void grad_out(const float *p, size_t n, int store, int bit)
{
    if (p == NULL)
        return;
    if (store & bit)
        K.stored++, K.stored_b += (double)n * sizeof(float);
    else
        K.added++, K.added_b += (double)n * sizeof(float);
}

/* Address space only (MAP_NORESERVE, never written but for the length kept in the first 64
 * bytes, which munmap needs), so a GPT-2 step's arena commits one page. */
static int pc_alloc(void **p, size_t bytes, td_error_t *err)
{
    size_t len = bytes + 64;
    char *m =
        mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

    if (m == MAP_FAILED) {
        snprintf(err->msg, sizeof(err->msg), "counting table: no %zu bytes of address space",
                 bytes);
        return TD_ENOMEM;
    }
    memcpy(m, &len, sizeof(len));
    *p = m + 64;
    return 0;
}

static void pc_free(void *p)
{
    size_t len;

    if (p == NULL)
        return;
    memcpy(&len, (char *)p - 64, sizeof(len));
    munmap((char *)p - 64, len);
}

static void pc_upload(void *dst, const void *src, size_t bytes)
{
    (void)dst, (void)src, (void)bytes;
    K.syncs++;
}

static void pc_upload_async(void *dst, const void *src, size_t bytes)
{
    (void)dst, (void)src, (void)bytes;
    K.copies++;
}

static void pc_download(void *dst, const void *src, size_t bytes)
{
    (void)src;
    memset(dst, 0, bytes);
    K.syncs++;
}

static void pc_set_threads(int n)
{
    (void)n;
}

static void pc_zero(float *p, size_t n)
{
    (void)p;
    K.zero_calls++;
    K.zero_b += (double)n * sizeof(float);
}

/* The rest: count, and for the five with a store mask, their gradient outputs. */
#define OP(op, params)        \
    static void c_##op params \
    {                         \
        K.calls++;            \
    }

OP(matmul_forward,
   (float *out, const float *inp, const float *weight, const float *bias, int N, int C, int OC))
OP(bias_forward, (float *out, const float *inp, const float *bias, int N, int C))
OP(bias_backward, (float *dinp, float *dbias, const float *dout, int N, int C))
OP(relu_forward, (float *out, const float *inp, size_t n))
OP(relu_backward, (float *dinp, const float *dout, const float *out, size_t n))
OP(softmax_xent_forward,
   (float *loss, float *probs, const float *logits, const int *targets, int N, int V, int Vp))
OP(softmax_xent_backward, (float *dlogits, const float *dloss, const float *probs,
                           const int *targets, int N, int V, int Vp))
OP(softmax_xent_fused,
   (float *loss, float *logits, const int *targets, int N, int V, int Vp, int grad))
OP(argmax_correct, (int64_t * correct, const float *logits, const int *targets, int N, int V))
OP(encoder_forward,
   (float *out, const int *inp, const float *wte, const float *wpe, int B, int T, int C))
OP(encoder_backward,
   (float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T, int C))
OP(layernorm_forward, (float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int N, int C))
OP(residual_layernorm_forward,
   (float *res, float *out, float *mean, float *rstd, const float *a, const float *b,
    const float *weight, const float *bias, int N, int C))
OP(gelu_forward, (float *out, const float *inp, size_t n))
OP(residual_forward, (float *out, const float *inp1, const float *inp2, size_t n))
OP(attention_forward, (float *out, float *lse, float *scratch, const float *q, const float *k,
                       const float *v, const td_attn_dims *d))
OP(sumsq, (double *sumsq, const float *p, size_t n))
OP(scale, (float *p, float s, size_t n))
OP(adamw_update, (float *param, float *m, float *v, const float *grad, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t))
OP(clip_scale, (float *out, const double *sumsq, const float *loss, float max_norm))
OP(adamw_flat, (float *param, float *m, float *v, float *grad, size_t n,
                const struct td_adamw_span *spans, int nspans, const float *scale, float lr,
                float beta1, float beta2, float eps, float weight_decay, int64_t t))
OP(sgd_flat, (float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
              float momentum, float weight_decay))
OP(sgd_update, (float *param, float *buf, const float *grad, size_t n, float lr, float momentum,
                float weight_decay))
OP(token_mean_forward, (float *out, const float *inp, int B, int N, int C))
OP(token_mean_backward, (float *dinp, const float *dout, int B, int N, int C))
OP(gather_rows_forward, (float *out, const float *inp, const int *idx, int B, int T, int C))
OP(gather_rows_backward, (float *dinp, const float *dout, const int *idx, int B, int T, int C))
OP(l2norm_forward, (float *out, float *norm, const float *inp, int N, int C))
OP(l2norm_backward,
   (float *dinp, const float *dout, const float *out, const float *norm, int N, int C))
OP(siglip_forward, (float *loss, const float *dots, const float *t, const float *b,
                    const int *labels, float same, int N, int M, int diag, float weight))
OP(siglip_backward,
   (float *ddots, float *dt, float *db, const float *dloss, const float *dots, const float *t,
    const float *b, const int *labels, float same, int N, int M, int diag, float weight))
#undef OP

static void c_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                              const float *inp, const float *weight, int N, int C, int OC,
                              int store)
{
    K.calls++;
    grad_out(dinp, (size_t)N * C, store, TD_STORE_1);
}

static void c_layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                                 const float *inp, const float *weight, const float *mean,
                                 const float *rstd, int N, int C, int store)
{
    K.calls++;
    grad_out(dinp, (size_t)N * C, store, TD_STORE_1);
}

static void c_gelu_backward(float *dinp, const float *inp, const float *dout, size_t n, int store)
{
    K.calls++;
    grad_out(dinp, n, store, TD_STORE_1);
}

static void c_residual_backward(float *dinp1, float *dinp2, const float *dout, size_t n, int store)
{
    K.calls++;
    grad_out(dinp1, n, store, TD_STORE_1);
    grad_out(dinp2, n, store, TD_STORE_2);
    K.passthrough += dinp1 == NULL && dinp2 != NULL;
}

static void c_attention_backward(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                                 const float *q, const float *k, const float *v, const float *out,
                                 const float *lse, const td_attn_dims *d, int store)
{
    size_t C = (size_t)d->NH * d->hs;

    K.calls++;
    grad_out(dq, (size_t)d->B * d->Nq * C, store, TD_STORE_1);
    grad_out(dk, (size_t)d->B * d->Nk * C, store, TD_STORE_2);
    grad_out(dv, (size_t)d->B * d->Nk * C, store, TD_STORE_3);
}

const td_kernels *pc_table(void)
{
    static td_kernels t;

    if (t.name != NULL)
        return &t;
#define SET(op) t.op = c_##op
    SET(matmul_forward), SET(matmul_backward), SET(bias_forward), SET(bias_backward);
    SET(relu_forward), SET(relu_backward), SET(softmax_xent_forward), SET(softmax_xent_backward);
    SET(softmax_xent_fused), SET(argmax_correct), SET(encoder_forward), SET(encoder_backward);
    SET(layernorm_forward), SET(residual_layernorm_forward), SET(layernorm_backward);
    SET(gelu_forward), SET(gelu_backward), SET(residual_forward), SET(residual_backward);
    SET(attention_forward), SET(attention_backward), SET(sumsq), SET(scale), SET(adamw_update);
    SET(clip_scale), SET(adamw_flat), SET(sgd_update), SET(sgd_flat), SET(token_mean_forward);
    SET(token_mean_backward), SET(gather_rows_forward), SET(gather_rows_backward);
    SET(l2norm_forward), SET(l2norm_backward), SET(siglip_forward), SET(siglip_backward);
#undef SET
    t.alloc = pc_alloc;
    t.free = pc_free;
    t.alloc_host = td_kernels_cpu()->alloc_host;
    t.free_host = td_kernels_cpu()->free_host;
    t.upload = pc_upload;
    t.download = pc_download;
    t.upload_async = pc_upload_async;
    t.set_threads = pc_set_threads;
    t.zero = pc_zero;
    t.host = 0;
    t.name = "counting";
    return &t;
}
