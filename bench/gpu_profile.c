/* bench_gpu --profile's instrument (gpu_profile.h): the wrapping table, its event pool, and the
 * report. One thread: the bench's, with its CUDA context bound. */
#include "bench/gpu_profile.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/td_clock.h"
#include "common/td_panic.h"

#define GP_MAX_OPS 16384 /* ops timed in one step: a GPT-2 124M step issues about 600 */

static const char *const class_names[GP_NCLASSES] = {
    [GP_MATMUL] = "matmuls",
    [GP_ATTN_FWD] = "attention fwd",
    [GP_ATTN_BWD] = "attention bwd",
    [GP_LAYERNORM] = "layernorm",
    [GP_GELU] = "GELU",
    [GP_RESIDUAL] = "residual",
    [GP_CLASSIFIER] = "classifier",
    [GP_ENCODER] = "encoder",
    [GP_HEADS] = "sensorlm heads",
    [GP_OPTIM] = "AdamW + clip",
    [GP_MEMSET] = "memsets",
    [GP_COPY] = "host copies",
    [GP_OTHER] = "bias, relu",
};

static struct {
    const td_kernels *base; /* the CUDA table */
    cudaStream_t stream;    /* the context's, when the step began */
    int on;                 /* inside a step */
    cudaEvent_t *ev;        /* 2 * GP_MAX_OPS + 2: a pair per op, then the step's two */
    unsigned char cls[GP_MAX_OPS];
    int n, dropped;
    double wait_ms, t0;
    td_cuda_counts c0;
} P;

static void record(cudaEvent_t e)
{
    cudaError_t rc = cudaEventRecord(e, P.stream);

    if (rc != cudaSuccess)
        td_panic(TD_ECUDA, "cudaEventRecord: %s", cudaGetErrorString(rc));
}

static int begin(gp_class c)
{
    if (!P.on)
        return 0;
    if (P.n >= GP_MAX_OPS) {
        P.dropped++;
        return 0;
    }
    P.cls[P.n] = (unsigned char)c;
    record(P.ev[2 * P.n]);
    return 1;
}

static void end(int timed)
{
    if (timed)
        record(P.ev[2 * P.n++ + 1]);
}

/* The forwarding functions: one a table entry, its class fixed. */
#define WRAP(cls, op, params, args) \
    static void w_##op params       \
    {                               \
        int timed_ = begin(cls);    \
        P.base->op args;            \
        end(timed_);                \
    }

WRAP(GP_MEMSET, zero, (float *p, size_t n), (p, n))
WRAP(GP_MATMUL, matmul_forward,
     (float *out, const float *inp, const float *weight, const float *bias, int N, int C, int OC),
     (out, inp, weight, bias, N, C, OC))
WRAP(GP_MATMUL, matmul_backward,
     (float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
      const float *weight, int N, int C, int OC, int store),
     (dinp, dweight, dbias, dout, inp, weight, N, C, OC, store))
WRAP(GP_OTHER, bias_forward, (float *out, const float *inp, const float *bias, int N, int C),
     (out, inp, bias, N, C))
WRAP(GP_OTHER, bias_backward, (float *dinp, float *dbias, const float *dout, int N, int C),
     (dinp, dbias, dout, N, C))
WRAP(GP_OTHER, relu_forward, (float *out, const float *inp, size_t n), (out, inp, n))
WRAP(GP_OTHER, relu_backward, (float *dinp, const float *dout, const float *out, size_t n),
     (dinp, dout, out, n))
WRAP(GP_CLASSIFIER, softmax_xent_forward,
     (float *loss, float *probs, const float *logits, const int *targets, int N, int V, int Vp),
     (loss, probs, logits, targets, N, V, Vp))
WRAP(GP_CLASSIFIER, softmax_xent_backward,
     (float *dlogits, const float *dloss, const float *probs, const int *targets, int N, int V,
      int Vp),
     (dlogits, dloss, probs, targets, N, V, Vp))
WRAP(GP_CLASSIFIER, argmax_correct,
     (int64_t * correct, const float *logits, const int *targets, int N, int V),
     (correct, logits, targets, N, V))
WRAP(GP_ENCODER, encoder_forward,
     (float *out, const int *inp, const float *wte, const float *wpe, int B, int T, int C),
     (out, inp, wte, wpe, B, T, C))
WRAP(GP_ENCODER, encoder_backward,
     (float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T, int C),
     (dwte, dwpe, dout, inp, B, T, C))
WRAP(GP_LAYERNORM, layernorm_forward,
     (float *out, float *mean, float *rstd, const float *inp, const float *weight,
      const float *bias, int N, int C),
     (out, mean, rstd, inp, weight, bias, N, C))
WRAP(GP_LAYERNORM, residual_layernorm_forward,
     (float *res, float *out, float *mean, float *rstd, const float *a, const float *b,
      const float *weight, const float *bias, int N, int C),
     (res, out, mean, rstd, a, b, weight, bias, N, C))
WRAP(GP_LAYERNORM, layernorm_backward,
     (float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
      const float *weight, const float *mean, const float *rstd, int N, int C, int store),
     (dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, store))
WRAP(GP_GELU, gelu_forward, (float *out, const float *inp, size_t n), (out, inp, n))
WRAP(GP_GELU, gelu_backward,
     (float *dinp, const float *inp, const float *dout, size_t n, int store),
     (dinp, inp, dout, n, store))
WRAP(GP_RESIDUAL, residual_forward, (float *out, const float *inp1, const float *inp2, size_t n),
     (out, inp1, inp2, n))
WRAP(GP_RESIDUAL, residual_backward,
     (float *dinp1, float *dinp2, const float *dout, size_t n, int store),
     (dinp1, dinp2, dout, n, store))
WRAP(GP_ATTN_FWD, attention_forward,
     (float *out, float *lse, float *scratch, const float *q, const float *k, const float *v,
      const td_attn_dims *d),
     (out, lse, scratch, q, k, v, d))
WRAP(GP_ATTN_BWD, attention_backward,
     (float *dq, float *dk, float *dv, float *scratch, const float *dout, const float *q,
      const float *k, const float *v, const float *out, const float *lse, const td_attn_dims *d,
      int store),
     (dq, dk, dv, scratch, dout, q, k, v, out, lse, d, store))
WRAP(GP_OPTIM, sumsq, (double *out, const float *p, size_t n), (out, p, n))
WRAP(GP_OPTIM, scale, (float *p, float s, size_t n), (p, s, n))
WRAP(GP_OPTIM, clip_scale, (float *out, const double *sumsq, const float *loss, float max_norm),
     (out, sumsq, loss, max_norm))
WRAP(GP_OPTIM, adamw_flat,
     (float *param, float *m, float *v, float *grad, size_t n, const td_adamw_span *spans,
      int nspans, const float *scale, float lr, float beta1, float beta2, float eps,
      float weight_decay, int64_t t),
     (param, m, v, grad, n, spans, nspans, scale, lr, beta1, beta2, eps, weight_decay, t))
WRAP(GP_OPTIM, adamw_update,
     (float *param, float *m, float *v, const float *grad, size_t n, float lr, float beta1,
      float beta2, float eps, float weight_decay, int64_t t),
     (param, m, v, grad, n, lr, beta1, beta2, eps, weight_decay, t))
WRAP(GP_OPTIM, sgd_flat,
     (float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
      float momentum, float weight_decay),
     (param, buf, grad, n, factor, lr, momentum, weight_decay))
WRAP(GP_OPTIM, sgd_update,
     (float *param, float *buf, const float *grad, size_t n, float lr, float momentum,
      float weight_decay),
     (param, buf, grad, n, lr, momentum, weight_decay))
WRAP(GP_HEADS, token_mean_forward, (float *out, const float *inp, int B, int N, int C),
     (out, inp, B, N, C))
WRAP(GP_HEADS, token_mean_backward, (float *dinp, const float *dout, int B, int N, int C),
     (dinp, dout, B, N, C))
WRAP(GP_HEADS, gather_rows_forward,
     (float *out, const float *inp, const int *idx, int B, int T, int C), (out, inp, idx, B, T, C))
WRAP(GP_HEADS, gather_rows_backward,
     (float *dinp, const float *dout, const int *idx, int B, int T, int C),
     (dinp, dout, idx, B, T, C))
WRAP(GP_HEADS, l2norm_forward, (float *out, float *norm, const float *inp, int N, int C),
     (out, norm, inp, N, C))
WRAP(GP_HEADS, l2norm_backward,
     (float *dinp, const float *dout, const float *out, const float *norm, int N, int C),
     (dinp, dout, out, norm, N, C))
WRAP(GP_HEADS, siglip_forward,
     (float *loss, const float *dots, const float *t, const float *b, const int *labels, float same,
      int N, int M, int diag, float weight),
     (loss, dots, t, b, labels, same, N, M, diag, weight))
WRAP(GP_HEADS, siglip_backward,
     (float *ddots, float *dt, float *db, const float *dloss, const float *dots, const float *t,
      const float *b, const int *labels, float same, int N, int M, int diag, float weight),
     (ddots, dt, db, dloss, dots, t, b, labels, same, N, M, diag, weight))

/* The copies wait for the stream: their host time is the step's time spent waiting. */
static void w_upload(void *dst, const void *src, size_t bytes)
{
    int timed = begin(GP_COPY);
    double t0 = td_mono_ms();

    P.base->upload(dst, src, bytes);
    P.wait_ms += td_mono_ms() - t0;
    end(timed);
}

static void w_download(void *dst, const void *src, size_t bytes)
{
    int timed = begin(GP_COPY);
    double t0 = td_mono_ms();

    P.base->download(dst, src, bytes);
    P.wait_ms += td_mono_ms() - t0;
    end(timed);
}

static td_kernels table;

const td_kernels *gp_table(void)
{
    if (P.base != NULL)
        return &table;
    P.base = td_kernels_cuda();
    P.ev = calloc(2 * GP_MAX_OPS + 2, sizeof(*P.ev));
    if (P.ev == NULL)
        td_panic(TD_ENOMEM, "no memory for the profile's events");
    for (int i = 0; i < 2 * GP_MAX_OPS + 2; i++) {
        cudaError_t rc = cudaEventCreate(&P.ev[i]);
        if (rc != cudaSuccess)
            td_panic(TD_ECUDA, "cudaEventCreate: %s", cudaGetErrorString(rc));
    }
    table = *P.base; /* name, host, alloc, free, set_threads as they are */
#define SET(op) table.op = w_##op
    SET(upload), SET(download), SET(zero), SET(matmul_forward), SET(matmul_backward);
    SET(bias_forward), SET(bias_backward), SET(relu_forward), SET(relu_backward);
    SET(softmax_xent_forward), SET(softmax_xent_backward), SET(argmax_correct);
    SET(encoder_forward), SET(encoder_backward), SET(layernorm_forward), SET(layernorm_backward);
    SET(residual_layernorm_forward);
    SET(gelu_forward), SET(gelu_backward), SET(residual_forward), SET(residual_backward);
    SET(attention_forward), SET(attention_backward), SET(sumsq), SET(scale);
    SET(adamw_update), SET(clip_scale), SET(adamw_flat), SET(sgd_update), SET(sgd_flat),
        SET(token_mean_forward), SET(token_mean_backward);
    SET(gather_rows_forward), SET(gather_rows_backward), SET(l2norm_forward);
    SET(l2norm_backward), SET(siglip_forward), SET(siglip_backward);
#undef SET
    return &table;
}

void gp_step_begin(void)
{
    td_cuda_ctx *c = td_cuda_ctx_current();

    if (c == NULL)
        td_panic(TD_ESTATE, "gp_step_begin: no CUDA context on this thread");
    P.stream = td_cuda_ctx_stream(c);
    P.n = 0, P.dropped = 0, P.wait_ms = 0.0;
    td_cuda_counts_get(&P.c0);
    P.t0 = td_mono_ms();
    record(P.ev[2 * GP_MAX_OPS]);
    P.on = 1;
}

static float elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0.0f;
    cudaError_t rc = cudaEventElapsedTime(&ms, a, b);

    if (rc != cudaSuccess)
        td_panic(TD_ECUDA, "cudaEventElapsedTime: %s", cudaGetErrorString(rc));
    return ms;
}

void gp_step_end(gp_step *out)
{
    cudaEvent_t last = P.ev[2 * GP_MAX_OPS + 1];
    cudaError_t rc;
    td_cuda_counts c1;

    P.on = 0;
    record(last);
    rc = cudaEventSynchronize(last);
    if (rc != cudaSuccess)
        td_panic(TD_ECUDA, "cudaEventSynchronize: %s", cudaGetErrorString(rc));
    memset(out, 0, sizeof(*out));
    out->wall_ms = td_mono_ms() - P.t0;
    for (int i = 0; i < P.n; i++) {
        out->ms[P.cls[i]] += elapsed(P.ev[2 * i], P.ev[2 * i + 1]);
        out->calls[P.cls[i]]++;
    }
    out->span_ms = elapsed(P.ev[2 * GP_MAX_OPS], last);
    out->wait_ms = P.wait_ms;
    out->dropped = P.dropped;
    td_cuda_counts_get(&c1);
    out->counts = (td_cuda_counts){.launches = c1.launches - P.c0.launches,
                                   .blas_calls = c1.blas_calls - P.c0.blas_calls,
                                   .memsets = c1.memsets - P.c0.memsets,
                                   .copies = c1.copies - P.c0.copies,
                                   .syncs = c1.syncs - P.c0.syncs};
}

const char *gp_class_name(gp_class c)
{
    return c >= 0 && c < GP_NCLASSES ? class_names[c] : "?";
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* The median of n values picked out of the steps by get. */
static double median(const gp_step *s, int n, double (*get)(const gp_step *, int), int k)
{
    double v[256];
    int m = n < 256 ? n : 256;

    for (int i = 0; i < m; i++)
        v[i] = get(&s[i], k);
    qsort(v, (size_t)m, sizeof(v[0]), cmp_double);
    return m == 0 ? 0.0 : m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
}

static double get_ms(const gp_step *s, int k)
{
    return s->ms[k];
}
static double get_calls(const gp_step *s, int k)
{
    return s->calls[k];
}
static double get_span(const gp_step *s, int k)
{
    (void)k;
    return s->span_ms;
}
static double get_wall(const gp_step *s, int k)
{
    (void)k;
    return s->wall_ms;
}
static double get_wait(const gp_step *s, int k)
{
    (void)k;
    return s->wait_ms;
}
static double get_count(const gp_step *s, int k)
{
    const td_cuda_counts *c = &s->counts;

    return (double)(k == 0   ? c->launches
                    : k == 1 ? c->blas_calls
                    : k == 2 ? c->memsets
                    : k == 3 ? c->copies
                             : c->syncs);
}
static double get_gap(const gp_step *s, int k)
{
    double busy = 0.0;

    (void)k;
    for (int c = 0; c < GP_NCLASSES; c++)
        busy += s->ms[c];
    return s->span_ms - busy;
}

void gp_report(const char *title, const gp_step *steps, int n, double plain_ms, double flops,
               double tokens, const char *unit, double peak, double gemm_tflops)
{
    double span = median(steps, n, get_span, 0), wall = median(steps, n, get_wall, 0);
    double tf = plain_ms > 0 ? flops / (plain_ms * 1e-3) / 1e12 : 0.0;
    int dropped = 0;

    for (int i = 0; i < n; i++)
        dropped += steps[i].dropped;
    printf("profile: %s, the median of %d steps\n", title, n);
    printf("  plain step %.2f ms: %.0f %s/s, %.1f TFLOP/s", plain_ms,
           plain_ms > 0 ? tokens / (plain_ms * 1e-3) : 0.0, unit, tf);
    if (peak > 0)
        printf(", MFU %.1f%% of the dense peak %.1f TFLOP/s", 100.0 * tf * 1e12 / peak,
               peak / 1e12);
    if (gemm_tflops > 0)
        printf("; cuBLAS bf16 GEMM %.1f TFLOP/s (%.1f%% of it)", gemm_tflops,
               100.0 * tf / gemm_tflops);
    printf("\n  profiled step %.2f ms wall, %.2f ms of GPU span\n", wall, span);
    printf("  %-16s %9s %7s %7s\n", "class", "ms/step", "% step", "ops");
    for (int c = 0; c < GP_NCLASSES; c++) {
        double ms = median(steps, n, get_ms, c), calls = median(steps, n, get_calls, c);
        if (calls == 0)
            continue;
        printf("  %-16s %9.3f %6.1f%% %7.0f\n", class_names[c], ms, span > 0 ? 100 * ms / span : 0,
               calls);
    }
    printf("  %-16s %9.3f %6.1f%%\n", "GPU idle (gaps)", median(steps, n, get_gap, 0),
           span > 0 ? 100 * median(steps, n, get_gap, 0) / span : 0);
    printf("  per step: %.0f kernel launches, %.0f cuBLAS calls, %.0f memsets, %.0f copies, %.0f "
           "host syncs (%.2f ms waited on the host)%s\n",
           median(steps, n, get_count, 0), median(steps, n, get_count, 1),
           median(steps, n, get_count, 2), median(steps, n, get_count, 3),
           median(steps, n, get_count, 4), median(steps, n, get_wait, 0),
           dropped ? " (some ops past the event pool were not timed)" : "");
}
