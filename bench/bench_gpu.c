/* bench_gpu: GPT-2 124M's shape (L=12, C=768, NH=12, T=1024, V=50257 padded to 50304) trained
 * on one GPU through the CUDA backend's table (kernels/cuda, td_kernels_cuda()): every op of a
 * step, forward, backward, the gradient norm and AdamW, on device buffers laid out as llm.c's
 * train_gpt2.c lays them out (one activation and one activation-gradient buffer per tensor of
 * the forward, the parameters, gradients and moments each one flat buffer). One fixed batch of
 * random tokens, so the loss must fall from about ln(50257) = 10.8 as the model memorizes it:
 * the whole backend, end to end. Prints figures, no pass/fail: ms per step, tokens/s, and MFU,
 * the model FLOPs achieved over the device's peak for the precision used, with llm.c's count
 * of 6 N + 6 L C T FLOPs per token (N parameters, the vocabulary padded).
 *
 *   bench_gpu [--batch B] [--steps S] [--fp32 | --tf32] [--csv FILE]
 *     B rows of T=1024 tokens (default 8); S timed steps (default 10) after 2 untimed;
 *     --fp32 or --tf32 runs one precision (default both, fp32 first); --csv appends one line
 *     per precision: precision,batch,ms_per_step,tokens_per_s,tflops,mfu,first_loss,last_loss
 *   The peak is the device's dense figure from its datasheet for H100/H200 (SXM: FP32 66.9,
 *   TF32 494.7 TFLOP/s) and A100 (19.5, 156); TD_PEAK_TFLOPS overrides it for other devices.
 *
 * The attention computes its whole (T,T) products where a causal one needs half (ops.cu), and
 * nothing is recomputed or fused: this is the backend's speed, not llm.c's. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "td_panic.h"

#ifdef TD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "td_cuda.h"

#define WARMUP 2

static const td_kernels *K;

static double now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One layer's forward tensors, and the same again for their gradients. */
typedef struct layer_acts {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *attproj, *res2;
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu, *fcproj, *res3;
} layer_acts;

typedef struct acts {
    float *encoded, *lnf, *lnf_mean, *lnf_rstd, *logits, *probs;
    layer_acts l[TD_GPT_MAX_LAYERS];
} acts;

typedef struct model {
    td_gpt_dims d;
    int B, T;
    td_params hp; /* the host layout (and initial values) of the flat buffers */
    td_gpt host;
    float *params, *grads, *m, *v; /* device, hp.n floats each */
    acts a, g;                     /* activations and their gradients, device */
    float *acts_block, *grads_block;
    size_t acts_n;         /* floats in each block */
    float *scratch;        /* (T,T): attention backward's */
    int *tokens, *targets; /* (B,T) */
    float *loss, *dloss;   /* (1) */
    double *norm;          /* (1) */
} model;

/* Points *p at the next n floats of a block being laid out (base NULL: only counts). */
static void carve(float **p, float *base, size_t *at, size_t n)
{
    *p = base != NULL ? base + *at : NULL;
    *at += (n + 63) / 64 * 64; /* 256-byte aligned, as cudaMalloc's own */
}

static size_t lay_out(acts *a, float *base, const td_gpt_dims *d, int B, int T)
{
    size_t BT = (size_t)B * T, C = (size_t)d->C, at = 0;

    carve(&a->encoded, base, &at, BT * C);
    for (int l = 0; l < d->L; l++) {
        layer_acts *x = &a->l[l];
        carve(&x->ln1, base, &at, BT * C);
        carve(&x->ln1_mean, base, &at, BT);
        carve(&x->ln1_rstd, base, &at, BT);
        carve(&x->qkv, base, &at, BT * 3 * C);
        carve(&x->atty, base, &at, BT * C);
        carve(&x->att, base, &at, (size_t)B * d->NH * T * T);
        carve(&x->attproj, base, &at, BT * C);
        carve(&x->res2, base, &at, BT * C);
        carve(&x->ln2, base, &at, BT * C);
        carve(&x->ln2_mean, base, &at, BT);
        carve(&x->ln2_rstd, base, &at, BT);
        carve(&x->fch, base, &at, BT * 4 * C);
        carve(&x->fch_gelu, base, &at, BT * 4 * C);
        carve(&x->fcproj, base, &at, BT * C);
        carve(&x->res3, base, &at, BT * C);
    }
    carve(&a->lnf, base, &at, BT * C);
    carve(&a->lnf_mean, base, &at, BT);
    carve(&a->lnf_rstd, base, &at, BT);
    carve(&a->logits, base, &at, BT * d->Vp);
    carve(&a->probs, base, &at, BT * d->Vp);
    return at;
}

/* Tensor i of layer l (or the whole tensor for wte, wpe, lnf) in a device flat buffer. */
static float *P(const model *m, float *buf, int i, int l)
{
    const td_tensor *t = &m->host.p[i];
    size_t per = (i >= TD_GPT_LN1W && i <= TD_GPT_FCPROJB) ? t->n / (size_t)m->d.L : 0;

    return buf + m->hp.offset[i] + (size_t)l * per;
}

static void *dalloc(size_t bytes)
{
    td_error_t err = {0};
    void *p = NULL;

    if (td_cuda_alloc(&p, bytes, &err) != 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        exit(1);
    }
    return p;
}

static int model_new(model *m, int B, int T)
{
    td_error_t err = {0};
    size_t BT = (size_t)B * T;
    int *tok = malloc(BT * sizeof(int)), rc;
    float one = 1.0f;
    uint64_t s = 42;

    memset(m, 0, sizeof(*m));
    m->d = (td_gpt_dims){
        .maxT = 1024, .V = 50257, .Vp = td_gpt_padded_vocab(50257), .L = 12, .NH = 12, .C = 768};
    m->B = B, m->T = T;
    rc = td_gpt_declare(&m->host, &m->hp, &m->d, &err);
    if (rc == 0 && td_params_alloc(&m->hp, 0) != 0)
        rc = td_error_set(&err, TD_ENOMEM, "host parameters");
    if (rc != 0 || tok == NULL) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        return 1;
    }
    td_gpt_bind(&m->host);
    td_gpt_init(&m->host, 1);

    m->params = dalloc(m->hp.n * sizeof(float));
    m->grads = dalloc(m->hp.n * sizeof(float));
    m->m = dalloc(m->hp.n * sizeof(float));
    m->v = dalloc(m->hp.n * sizeof(float));
    m->acts_n = lay_out(&m->a, NULL, &m->d, B, T);
    m->acts_block = dalloc(m->acts_n * sizeof(float));
    m->grads_block = dalloc(m->acts_n * sizeof(float));
    lay_out(&m->a, m->acts_block, &m->d, B, T);
    lay_out(&m->g, m->grads_block, &m->d, B, T);
    m->scratch = dalloc((size_t)T * T * sizeof(float));
    m->tokens = dalloc(BT * sizeof(int));
    m->targets = dalloc(BT * sizeof(int));
    m->loss = dalloc(sizeof(float));
    m->dloss = dalloc(sizeof(float));
    m->norm = dalloc(sizeof(double));

    td_cuda_upload(m->params, m->hp.data, m->hp.n * sizeof(float));
    K->zero(m->m, m->hp.n);
    K->zero(m->v, m->hp.n);
    for (size_t i = 0; i < BT; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (int)((s >> 33) % (uint64_t)m->d.V);
    }
    td_cuda_upload(m->tokens, tok, BT * sizeof(int));
    td_cuda_upload(m->targets, tok + 1, (BT - 1) * sizeof(int)); /* the next token */
    td_cuda_upload(m->targets + BT - 1, tok, sizeof(int));
    td_cuda_upload(m->dloss, &one, sizeof(float));
    free(tok);
    printf("GPT-2 124M: %zu parameters (padded), B=%d T=%d, %.1f GiB of activations and as "
           "much for their gradients\n",
           td_gpt_num_params(&m->d), B, T, (double)m->acts_n * 4 / (1u << 30));
    return 0;
}

static void forward(model *m)
{
    const td_gpt_dims *d = &m->d;
    int B = m->B, T = m->T, C = d->C, BT = B * T;
    float *p = m->params, *res = m->a.encoded;

    K->encoder_forward(m->a.encoded, m->tokens, P(m, p, TD_GPT_WTE, 0), P(m, p, TD_GPT_WPE, 0), B,
                       T, C);
    for (int l = 0; l < d->L; l++) {
        layer_acts *x = &m->a.l[l];
        K->layernorm_forward(x->ln1, x->ln1_mean, x->ln1_rstd, res, P(m, p, TD_GPT_LN1W, l),
                             P(m, p, TD_GPT_LN1B, l), BT, C);
        K->matmul_forward(x->qkv, x->ln1, P(m, p, TD_GPT_QKVW, l), P(m, p, TD_GPT_QKVB, l), BT, C,
                          3 * C);
        K->attention_forward(x->atty, x->att, x->qkv, B, T, C, d->NH);
        K->matmul_forward(x->attproj, x->atty, P(m, p, TD_GPT_ATTPROJW, l),
                          P(m, p, TD_GPT_ATTPROJB, l), BT, C, C);
        K->residual_forward(x->res2, res, x->attproj, (size_t)BT * C);
        K->layernorm_forward(x->ln2, x->ln2_mean, x->ln2_rstd, x->res2, P(m, p, TD_GPT_LN2W, l),
                             P(m, p, TD_GPT_LN2B, l), BT, C);
        K->matmul_forward(x->fch, x->ln2, P(m, p, TD_GPT_FCW, l), P(m, p, TD_GPT_FCB, l), BT, C,
                          4 * C);
        K->gelu_forward(x->fch_gelu, x->fch, (size_t)BT * 4 * C);
        K->matmul_forward(x->fcproj, x->fch_gelu, P(m, p, TD_GPT_FCPROJW, l),
                          P(m, p, TD_GPT_FCPROJB, l), BT, 4 * C, C);
        K->residual_forward(x->res3, x->res2, x->fcproj, (size_t)BT * C);
        res = x->res3;
    }
    K->layernorm_forward(m->a.lnf, m->a.lnf_mean, m->a.lnf_rstd, res, P(m, p, TD_GPT_LNFW, 0),
                         P(m, p, TD_GPT_LNFB, 0), BT, C);
    K->matmul_forward(m->a.logits, m->a.lnf, P(m, p, TD_GPT_WTE, 0), NULL, BT, C, d->Vp);
    K->softmax_xent_forward(m->loss, m->a.probs, m->a.logits, m->targets, BT, d->V, d->Vp);
}

/* The tape of td_gpt_forward, replayed by hand in reverse; every backward accumulates, so the
 * gradients of parameters and activations are zeroed first. */
static void backward(model *m)
{
    const td_gpt_dims *d = &m->d;
    int B = m->B, T = m->T, C = d->C, BT = B * T;
    float *p = m->params, *gp = m->grads;
    acts *a = &m->a, *g = &m->g;

    K->zero(m->grads, m->hp.n);
    K->zero(m->grads_block, m->acts_n);
    K->softmax_xent_backward(g->logits, m->dloss, a->probs, m->targets, BT, d->V, d->Vp);
    K->matmul_backward(g->lnf, P(m, gp, TD_GPT_WTE, 0), NULL, g->logits, a->lnf,
                       P(m, p, TD_GPT_WTE, 0), BT, C, d->Vp);
    K->layernorm_backward(g->l[d->L - 1].res3, P(m, gp, TD_GPT_LNFW, 0), P(m, gp, TD_GPT_LNFB, 0),
                          g->lnf, a->l[d->L - 1].res3, P(m, p, TD_GPT_LNFW, 0), a->lnf_mean,
                          a->lnf_rstd, BT, C);
    for (int l = d->L - 1; l >= 0; l--) {
        layer_acts *x = &a->l[l], *gx = &g->l[l];
        float *res = l > 0 ? a->l[l - 1].res3 : a->encoded;
        float *gres = l > 0 ? g->l[l - 1].res3 : g->encoded;
        K->residual_backward(gx->res2, gx->fcproj, gx->res3, (size_t)BT * C);
        K->matmul_backward(gx->fch_gelu, P(m, gp, TD_GPT_FCPROJW, l), P(m, gp, TD_GPT_FCPROJB, l),
                           gx->fcproj, x->fch_gelu, P(m, p, TD_GPT_FCPROJW, l), BT, 4 * C, C);
        K->gelu_backward(gx->fch, x->fch, gx->fch_gelu, (size_t)BT * 4 * C);
        K->matmul_backward(gx->ln2, P(m, gp, TD_GPT_FCW, l), P(m, gp, TD_GPT_FCB, l), gx->fch,
                           x->ln2, P(m, p, TD_GPT_FCW, l), BT, C, 4 * C);
        K->layernorm_backward(gx->res2, P(m, gp, TD_GPT_LN2W, l), P(m, gp, TD_GPT_LN2B, l), gx->ln2,
                              x->res2, P(m, p, TD_GPT_LN2W, l), x->ln2_mean, x->ln2_rstd, BT, C);
        K->residual_backward(gres, gx->attproj, gx->res2, (size_t)BT * C);
        K->matmul_backward(gx->atty, P(m, gp, TD_GPT_ATTPROJW, l), P(m, gp, TD_GPT_ATTPROJB, l),
                           gx->attproj, x->atty, P(m, p, TD_GPT_ATTPROJW, l), BT, C, C);
        K->attention_backward(gx->qkv, m->scratch, gx->atty, x->qkv, x->att, B, T, C, d->NH);
        K->matmul_backward(gx->ln1, P(m, gp, TD_GPT_QKVW, l), P(m, gp, TD_GPT_QKVB, l), gx->qkv,
                           x->ln1, P(m, p, TD_GPT_QKVW, l), BT, C, 3 * C);
        K->layernorm_backward(gres, P(m, gp, TD_GPT_LN1W, l), P(m, gp, TD_GPT_LN1B, l), gx->ln1,
                              res, P(m, p, TD_GPT_LN1W, l), x->ln1_mean, x->ln1_rstd, BT, C);
    }
    K->encoder_backward(P(m, gp, TD_GPT_WTE, 0), P(m, gp, TD_GPT_WPE, 0), g->encoded, m->tokens, B,
                        T, C);
}

/* AdamW as the trainer runs it (td_optim_step): tensor by tensor, decay where td_params says. */
static void update(model *m, int64_t t)
{
    K->sumsq(m->norm, m->grads, m->hp.n);
    for (int i = 0; i < m->hp.count; i++) {
        size_t o = m->hp.offset[i];
        K->adamw_update(m->params + o, m->m + o, m->v + o, m->grads + o, m->hp.tensors[i]->n, 3e-4f,
                        0.9f, 0.95f, 1e-8f, m->hp.decay[i] ? 0.1f : 0.0f, t);
    }
}

/* The dense peak of the device for the precision, TFLOP/s; 0 when unknown. */
static double peak_tflops(const char *name, int tf32)
{
    const char *env = getenv("TD_PEAK_TFLOPS");

    if (env != NULL)
        return atof(env);
    if (strstr(name, "H100") != NULL || strstr(name, "H200") != NULL)
        return tf32 ? 494.7 : 66.9;
    if (strstr(name, "A100") != NULL)
        return tf32 ? 156.0 : 19.5;
    return 0.0;
}

typedef struct result {
    double ms, first_loss, last_loss;
} result;

/* Runs fn(arg) under a panic boundary of its own: 0, or 1 after printing the panic. A function
 * of its own so that no caller's local lives across the setjmp. */
static int guarded(void (*fn)(void *), void *arg)
{
    td_boundary b;

    if (TD_TRY(&b)) {
        fn(arg);
        td_boundary_leave(&b);
        return 0;
    }
    fprintf(stderr, "bench_gpu: %s: %s\n", td_errname(b.err.code), b.err.msg);
    return 1;
}

typedef struct run_arg {
    model *m;
    int steps, tf32, B;
    td_cuda_ctx *ctx;
    result r;
} run_arg;

static void build(void *arg)
{
    run_arg *a = arg;

    if (model_new(a->m, a->B, 1024) != 0)
        exit(1);
}

/* From the initial parameters and fresh moments: WARMUP untimed steps, then steps timed. */
static void run(void *arg)
{
    run_arg *a = arg;
    model *m = a->m;
    double t0 = 0.0;
    float loss = 0.0f;

    td_cuda_ctx_set_tf32(a->ctx, a->tf32);
    td_cuda_upload(m->params, m->hp.data, m->hp.n * sizeof(float));
    K->zero(m->m, m->hp.n);
    K->zero(m->v, m->hp.n);
    for (int s = 0; s < WARMUP + a->steps; s++) {
        if (s == WARMUP) {
            td_cuda_sync();
            t0 = now_s();
        }
        forward(m);
        backward(m);
        update(m, s + 1);
        td_cuda_download(&loss, m->loss, sizeof(float)); /* as a trainer reads its loss */
        if (s == 0)
            a->r.first_loss = loss;
        printf("  step %2d: loss %.4f%s\n", s + 1, loss, s < WARMUP ? " (warmup)" : "");
    }
    a->r.ms = (now_s() - t0) * 1e3 / a->steps;
    a->r.last_loss = loss;
}

static void report(const run_arg *a, const char *device, const char *csv)
{
    const model *m = a->m;
    double N = (double)td_gpt_num_params(&m->d), tokens = (double)m->B * m->T;
    double flops = (6.0 * N + 6.0 * m->d.L * m->d.C * m->T) * tokens;
    double tf = flops / (a->r.ms * 1e-3) / 1e12, peak = peak_tflops(device, a->tf32);
    const char *name = a->tf32 ? "TF32" : "FP32";

    printf("%s: %.1f ms/step, %.0f tokens/s, %.1f TFLOP/s, MFU %s%.1f%% (peak %.1f), loss %.3f "
           "-> %.3f\n",
           name, a->r.ms, tokens / (a->r.ms * 1e-3), tf, peak > 0 ? "" : "n/a ",
           peak > 0 ? 100.0 * tf / peak : 0.0, peak, a->r.first_loss, a->r.last_loss);
    if (csv != NULL) {
        FILE *f = fopen(csv, "a");
        if (f != NULL) {
            fprintf(f, "%s,%d,%.2f,%.0f,%.2f,%.4f,%.4f,%.4f\n", a->tf32 ? "tf32" : "fp32", m->B,
                    a->r.ms, tokens / (a->r.ms * 1e-3), tf, peak > 0 ? tf / peak : 0.0,
                    a->r.first_loss, a->r.last_loss);
            fclose(f);
        }
    }
}

int main(int argc, char **argv)
{
    static model m;
    run_arg a = {.m = &m, .steps = 10, .B = 8};
    int modes = 3, rc = 0;
    const char *csv = NULL;
    td_error_t err = {0};
    struct cudaDeviceProp prop;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            a.B = atoi(argv[++i]);
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            a.steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--fp32") == 0)
            modes = 1;
        else if (strcmp(argv[i], "--tf32") == 0)
            modes = 2;
        else if (strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = argv[++i];
        else {
            fprintf(stderr, "usage: bench_gpu [--batch B] [--steps S] [--fp32|--tf32] "
                            "[--csv FILE]\n");
            return 2;
        }
    }
    if (a.B < 1 || a.steps < 1)
        return 2;
    if (td_cuda_ctx_new(&a.ctx, 0, NULL, &err) != 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        return 1;
    }
    K = td_kernels_cuda();
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        snprintf(prop.name, sizeof(prop.name), "unknown");
    printf("device 0: %s\n", prop.name);
    rc = guarded(build, &a);
    for (a.tf32 = 0; a.tf32 < 2 && rc == 0; a.tf32++) {
        if (!(modes & (1 << a.tf32)))
            continue;
        printf("%s:\n", a.tf32 ? "TF32" : "FP32");
        rc = guarded(run, &a);
        if (rc == 0)
            report(&a, prop.name, csv);
    }
    td_cuda_ctx_free(a.ctx);
    return rc;
}

#else

int main(void)
{
    printf("bench_gpu: built without CUDA\n");
    return 0;
}

#endif
