/* bench_gpu: GPT-2 124M's shape (L=12, C=768, NH=12, T=1024, V=50257 padded to 50304) trained
 * on one GPU, in bf16 mixed precision and in fp32 (TF32 and plain) for comparison. Prints
 * figures, no pass/fail; exits 77 (skipped) where the build has no CUDA or no GPU is seen.
 *
 * What it runs, in one process on device 0:
 *  1. The reference figure: cuBLAS's own bf16 GEMM (cublasGemmEx, bf16 inputs, fp32 sums and
 *     output) of 8192x8192x8192, TFLOP/s achieved, and its share of the datasheet peak.
 *  2. The real trainer (train.h: td_trainer_new with cfg.kernels = td_kernels_cuda() on this
 *     thread's context) on an llm.c token shard it writes itself (a block of 65536 random
 *     tokens repeated, so the loss falls as the model memorizes it), AdamW as llm.c trains
 *     GPT-2 (lr 6e-4, betas 0.9/0.95, weight decay 0.1, clip 1.0), for each precision:
 *     warm-up steps, then timed steps: ms/step, tokens/s, TFLOP/s and MFU, llm.c's count of
 *     FLOPs (td_train_flops_per_step) over the device's dense peak for the precision
 *     (td_cuda_peak_flops; TD_PEAK_TFLOPS overrides it for a device it does not know).
 *     The batch is the largest that fits, at most 16 (td_train_largest_batch against
 *     td_cuda_mem_info), unless --batch says.
 *  3. With --direct, instead: the same step driven through the CUDA table by hand (the forward
 *     and backward of td_gpt_forward replayed op by op, AdamW per tensor) on device buffers laid
 *     out as llm.c's train_gpt2.c lays them out, one fixed batch: the difference to 2. is the
 *     trainer's own cost (the batch's upload, the loss and norm read back each step).
 *
 *  4. With --profile, instead of 2.: the trainer on a table that brackets every op with CUDA
 *     events (gpu_profile.h), for GPT-2 124M (B 16 unless --batch, T 1024, bf16 matmuls) and,
 *     with --slm-data SHARD, the SensorLM base preset at the largest batch the memory guard
 *     allows (at most 1024): W warm-up steps, S plain steps timed by the host clock, then S
 *     profiled steps; per class of work (matmuls, attention forward and backward, layernorm,
 *     GELU, residual, classifier, encoder, the sensorlm heads, AdamW and the clip, memsets,
 *     host copies) the median ms per step and its share of the step, the GPU idle between
 *     ops, kernel launches, cuBLAS calls, memsets and host syncs per step, tokens (samples)
 *     per second and MFU of the plain steps against the device's dense bf16 peak, next to
 *     cuBLAS's own bf16 GEMM measured in the same run (unless --no-gemm).
 *  5. With --probe, instead of all of that: the driver's and the runtime's CUDA versions (a
 *     driver too old for the runtime said as such), cuBLAS's and NCCL's versions as the
 *     libraries loaded report them, and each device with its memory. Exit 0; no GPU needed.
 *  6. With --plan, instead of all of that: the fused attention's plan (kernels/attn_plan.h)
 *     for GPT-2 124M (B 16 unless --batch, T 1024) and SensorLM base's towers at batch 32:
 *     blocks, cuBLAS calls and other launches a layer a step, how often a sequence's keys are
 *     read, the largest block, next to the loop over heads in row chunks that the plan
 *     replaced; then a training step of each model through the engine on a table that only
 *     counts (plan_count.c): table calls, memsets and their bytes, activation gradients stored
 *     and added into, residual gradients passed through, now and with every gradient zeroed
 *     when allocated (the path before the first writers); then the real trainer's second step
 *     of GPT-2 124M on that table: calls, memsets, host syncs, now and without the flat
 *     optimizer (the step before issue 24's one read-back). Exit 0; no GPU needed.
 *
 *   bench_gpu [--batch B] [--steps S] [--warmup W] [--precision LIST] [--direct] [--no-gemm]
 *             [--csv FILE] [--profile [--slm-data SHARD]] [--probe] [--plan]
 *     B rows of T=1024 tokens (default: the largest that fits, at most 16); S timed steps
 *     (default 20) after W untimed (default 3); LIST of bf16,tf32,fp32 (default all three, in
 *     that order); --csv appends one line per run:
 *     path,precision,batch,ms_per_step,tokens_per_s,tflops,mfu,first_loss,last_loss,gemm_tflops,
 *     host_syncs (the context's host syncs per timed step: 1 for the trainer, whose step reads
 *     its loss and gradient norm back in one download)
 *
 * The attention is the fused one of every model (kernels.h, ops.cu): the plan's blocks, each
 * product one cuBLAS batched gemm over a block's (sequence, head) pairs in TF32, a warp per row
 * for the softmax, only the output and each row's log-sum-exp kept, the scores recomputed in
 * the backward. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "train/engine.h"
#include "common/td_clock.h"
#include "common/td_panic.h"
#include "train/train.h"

#ifdef TD_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "bench/gpu_profile.h"
#include "bench/plan_count.h"
#include "kernels/attn_plan.h"
#include "kernels/cuda/td_cuda.h"

#define GEMM_N     8192      /* the reference GEMM's m = n = k */
#define GEMM_ITERS 20        /* timed GEMMs, after 3 untimed */
#define MAX_BATCH  16        /* rows: the default batch's cap */
#define SHARD_TOK  (1 << 22) /* tokens in the shard written: 8 MiB */
#define MiB        ((size_t)1 << 20)

typedef enum { P_BF16 = 0, P_TF32 = 1, P_FP32 = 2, N_PREC } prec;
static const char *prec_names[N_PREC] = {"bf16", "tf32", "fp32"};

static const td_kernels *K;

/* One layer's forward tensors, and the same again for their gradients. */
typedef struct layer_acts {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *lse, *attproj, *res2;
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
    td_attn_dims ad;       /* the fused attention's shape: packed qkv, causal, auto chunk */
    float *scratch;        /* td_attn_scratch(&ad, 1) floats: the attention's transient block */
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
        carve(&x->lse, base, &at, (size_t)B * d->NH * T);
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
    m->ad = (td_attn_dims){.B = B, .NH = m->d.NH, .Nq = T, .Nk = T, .hs = m->d.C / m->d.NH};
    m->ad.ldq = m->ad.ldk = m->ad.ldv = 3 * m->d.C; /* llm.c's packed qkv */
    m->ad.causal = 1;
    m->ad.chunk = td_attn_chunk(0, B, m->d.NH, T, T);
    m->scratch = dalloc(td_attn_scratch(&m->ad, 1) * sizeof(float));
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
        K->attention_forward(x->atty, x->lse, m->scratch, x->qkv, x->qkv + C, x->qkv + 2 * C,
                             &m->ad);
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

/* The tape of td_gpt_forward, replayed by hand in reverse with the engine's first writers: each
 * activation gradient stored by the op that writes it first (kernels.h's store), added into by
 * the rest; only the parameters' gradients and the logits' (the unfused classifier adds) are
 * zeroed. */
static void backward(model *m)
{
    const td_gpt_dims *d = &m->d;
    int B = m->B, T = m->T, C = d->C, BT = B * T;
    float *p = m->params, *gp = m->grads;
    acts *a = &m->a, *g = &m->g;
    const int S1 = TD_STORE_1, S12 = TD_STORE_1 | TD_STORE_2;
    const int S123 = TD_STORE_1 | TD_STORE_2 | TD_STORE_3;

    K->zero(m->grads, m->hp.n);
    K->zero(g->logits, (size_t)BT * d->Vp);
    K->softmax_xent_backward(g->logits, m->dloss, a->probs, m->targets, BT, d->V, d->Vp);
    K->matmul_backward(g->lnf, P(m, gp, TD_GPT_WTE, 0), NULL, g->logits, a->lnf,
                       P(m, p, TD_GPT_WTE, 0), BT, C, d->Vp, S1);
    K->layernorm_backward(g->l[d->L - 1].res3, P(m, gp, TD_GPT_LNFW, 0), P(m, gp, TD_GPT_LNFB, 0),
                          g->lnf, a->l[d->L - 1].res3, P(m, p, TD_GPT_LNFW, 0), a->lnf_mean,
                          a->lnf_rstd, BT, C, S1);
    for (int l = d->L - 1; l >= 0; l--) {
        layer_acts *x = &a->l[l], *gx = &g->l[l];
        float *res = l > 0 ? a->l[l - 1].res3 : a->encoded;
        float *gres = l > 0 ? g->l[l - 1].res3 : g->encoded;
        K->residual_backward(gx->res2, gx->fcproj, gx->res3, (size_t)BT * C, S12);
        K->matmul_backward(gx->fch_gelu, P(m, gp, TD_GPT_FCPROJW, l), P(m, gp, TD_GPT_FCPROJB, l),
                           gx->fcproj, x->fch_gelu, P(m, p, TD_GPT_FCPROJW, l), BT, 4 * C, C, S1);
        K->gelu_backward(gx->fch, x->fch, gx->fch_gelu, (size_t)BT * 4 * C, S1);
        K->matmul_backward(gx->ln2, P(m, gp, TD_GPT_FCW, l), P(m, gp, TD_GPT_FCB, l), gx->fch,
                           x->ln2, P(m, p, TD_GPT_FCW, l), BT, C, 4 * C, S1);
        K->layernorm_backward(gx->res2, P(m, gp, TD_GPT_LN2W, l), P(m, gp, TD_GPT_LN2B, l), gx->ln2,
                              x->res2, P(m, p, TD_GPT_LN2W, l), x->ln2_mean, x->ln2_rstd, BT, C, 0);
        K->residual_backward(gres, gx->attproj, gx->res2, (size_t)BT * C, S12);
        K->matmul_backward(gx->atty, P(m, gp, TD_GPT_ATTPROJW, l), P(m, gp, TD_GPT_ATTPROJB, l),
                           gx->attproj, x->atty, P(m, p, TD_GPT_ATTPROJW, l), BT, C, C, S1);
        K->attention_backward(gx->qkv, gx->qkv + C, gx->qkv + 2 * C, m->scratch, gx->atty, x->qkv,
                              x->qkv + C, x->qkv + 2 * C, x->atty, x->lse, &m->ad, S123);
        K->matmul_backward(gx->ln1, P(m, gp, TD_GPT_QKVW, l), P(m, gp, TD_GPT_QKVB, l), gx->qkv,
                           x->ln1, P(m, p, TD_GPT_QKVW, l), BT, C, 3 * C, S1);
        K->layernorm_backward(gres, P(m, gp, TD_GPT_LN1W, l), P(m, gp, TD_GPT_LN1B, l), gx->ln1,
                              res, P(m, p, TD_GPT_LN1W, l), x->ln1_mean, x->ln1_rstd, BT, C, 0);
    }
    K->encoder_backward(P(m, gp, TD_GPT_WTE, 0), P(m, gp, TD_GPT_WPE, 0), g->encoded, m->tokens, B,
                        T, C);
}

/* AdamW tensor by tensor (td_optim_step), decay where td_params says; the trainer's
 * single-process step runs the same update in one adamw_flat call. */
static void update(model *m, int64_t t)
{
    K->sumsq(m->norm, m->grads, m->hp.n);
    for (int i = 0; i < m->hp.count; i++) {
        size_t o = m->hp.offset[i];
        K->adamw_update(m->params + o, m->m + o, m->v + o, m->grads + o, m->hp.tensors[i]->n, 3e-4f,
                        0.9f, 0.95f, 1e-8f, m->hp.decay[i] ? 0.1f : 0.0f, t);
    }
}

/* ---- figures ----------------------------------------------------------------------------- */

/* The device's dense peak for the precision, FLOP/s: TD_PEAK_TFLOPS when set, else
 * td_cuda_peak_flops; 0 when unknown (MFU is then not printed). */
static double peak_flops(int device, prec p)
{
    const char *env = getenv("TD_PEAK_TFLOPS");
    td_error_t err = {0};
    double f = 0.0;

    if (env != NULL)
        return atof(env) * 1e12;
    if (td_cuda_peak_flops(device, p == P_BF16, p == P_TF32, &f, &err) != 0)
        return 0.0;
    return f;
}

typedef struct result {
    const char *path; /* "trainer" or "direct" */
    prec p;
    int B;
    double ms, flops_per_step, first_loss, last_loss;
    double host_syncs; /* the context's host syncs per timed step (td_cuda_counts) */
} result;

static void report(const result *r, int device, double gemm_tflops, const char *csv)
{
    double tokens = (double)r->B * 1024, sec = r->ms * 1e-3;
    double tf = r->flops_per_step / sec / 1e12, peak = peak_flops(device, r->p);
    char mfu[32] = "n/a";

    if (peak > 0)
        snprintf(mfu, sizeof(mfu), "%.1f%%", 100.0 * tf * 1e12 / peak);
    printf("%s %s: B=%d, %.1f ms/step, %.0f tokens/s, %.1f TFLOP/s, MFU %s (peak %.1f TFLOP/s), "
           "loss %.3f -> %.3f, host_syncs %.2f/step\n",
           prec_names[r->p], r->path, r->B, r->ms, tokens / sec, tf, mfu, peak / 1e12,
           r->first_loss, r->last_loss, r->host_syncs);
    if (csv != NULL) {
        FILE *f = fopen(csv, "a");
        if (f != NULL) {
            fprintf(f, "%s,%s,%d,%.2f,%.0f,%.2f,%.4f,%.4f,%.4f,%.1f,%.2f\n", r->path,
                    prec_names[r->p], r->B, r->ms, tokens / sec, tf,
                    peak > 0 ? tf * 1e12 / peak : 0.0, r->first_loss, r->last_loss, gemm_tflops,
                    r->host_syncs);
            fclose(f);
        }
    }
}

/* Runs fn(arg) under a panic boundary of its own: 0, or 1 after printing the panic. A function
 * of its own so that no caller's local lives across the setjmp. */
static int guarded(void (*fn)(void *), void *arg)
{
    td_boundary b;

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        fn(arg);
        td_boundary_leave(&b);
        return 0;
    }
    fprintf(stderr, "bench_gpu: %s: %s\n", td_errname(b.err.code), b.err.msg);
    return 1;
}

/* Sets the context's precision for a run. */
static void set_precision(td_cuda_ctx *ctx, prec p)
{
    td_cuda_ctx_set_tf32(ctx, p == P_TF32);
    td_cuda_ctx_set_bf16(ctx, p == P_BF16);
}

/* ---- 1. the reference GEMM ------------------------------------------------------------------ */

typedef struct gemm_arg {
    td_cuda_ctx *ctx;
    double tflops;
} gemm_arg;

/* A float's bf16 bits, rounded to nearest even (the values here are finite) */
static uint16_t bf16_bits(float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* C (fp32) = A B for bf16 A, B of GEMM_N^2 random values in [-1, 1) (not zeros: tensor cores
 * draw less power, and may clock higher, on zeros), a cuBLAS handle of its own with a 32 MiB
 * workspace on the context's stream, 3 untimed then GEMM_ITERS timed between two events. */
static void gemm_run(void *arg)
{
    gemm_arg *g = arg;
    size_t n = (size_t)GEMM_N * GEMM_N;
    uint16_t *h = malloc(n * sizeof(uint16_t));
    void *A = NULL, *B = NULL, *C = NULL, *ws = NULL;
    cublasHandle_t blas = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    cudaStream_t st = td_cuda_ctx_stream(g->ctx);
    const float one = 1.0f, zero = 0.0f;
    uint64_t s = 3;
    float ms = 0.0f;
    td_error_t err = {0};

    if (h == NULL)
        td_panic(TD_ENOMEM, "no host memory for the GEMM's operands");
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = bf16_bits((float)(s >> 40) / 8388608.0f - 1.0f);
    }
    if (td_cuda_alloc(&A, n * 2, &err) != 0 || td_cuda_alloc(&B, n * 2, &err) != 0 ||
        td_cuda_alloc(&C, n * 4, &err) != 0 || td_cuda_alloc(&ws, 32 * MiB, &err) != 0)
        td_panic(err.code, "%s", err.msg);
    td_cuda_upload(A, h, n * 2);
    td_cuda_upload(B, h, n * 2); /* the same values: the speed does not care */
    free(h);
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(blas, st) != 0 ||
        cublasSetWorkspace(blas, ws, 32 * MiB) != 0)
        td_panic(TD_ECUDA, "cannot set up a cuBLAS handle for the reference GEMM");
    if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)
        td_panic(TD_ECUDA, "cudaEventCreate failed");
    for (int i = 0; i < 3 + GEMM_ITERS; i++) {
        if (i == 3 && cudaEventRecord(e0, st) != cudaSuccess)
            td_panic(TD_ECUDA, "cudaEventRecord failed");
        cublasStatus_t r =
            cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, GEMM_N, GEMM_N, GEMM_N, &one, A,
                         CUDA_R_16BF, GEMM_N, B, CUDA_R_16BF, GEMM_N, &zero, C, CUDA_R_32F, GEMM_N,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (r != CUBLAS_STATUS_SUCCESS)
            td_panic(TD_ECUDA, "cublasGemmEx: %s", cublasGetStatusName(r));
    }
    if (cudaEventRecord(e1, st) != cudaSuccess || cudaEventSynchronize(e1) != cudaSuccess ||
        cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
        td_panic(TD_ECUDA, "timing the GEMM failed");
    g->tflops = 2.0 * GEMM_N * (double)GEMM_N * GEMM_N * GEMM_ITERS / (ms * 1e-3) / 1e12;
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cublasDestroy(blas);
    td_cuda_free(A), td_cuda_free(B), td_cuda_free(C), td_cuda_free(ws);
}

/* ---- 2. the trainer ------------------------------------------------------------------------- */

/* An llm.c token shard (train/data.h): int32 header[256] = {20240520, 1, count}, then count
 * uint16 tokens: a block of 65536 random tokens below V, repeated. */
static int write_shard(const char *path, int V)
{
    int32_t header[256] = {0};
    uint16_t *tok = malloc((size_t)SHARD_TOK * sizeof(uint16_t));
    uint64_t s = 1;
    FILE *f;
    int ok;

    if (tok == NULL)
        return -1;
    header[0] = 20240520, header[1] = 1, header[2] = SHARD_TOK;
    for (size_t i = 0; i < 65536; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tok[i] = (uint16_t)((s >> 33) % (uint64_t)V);
    }
    for (size_t i = 65536; i < SHARD_TOK; i++)
        tok[i] = tok[i % 65536];
    f = fopen(path, "wb");
    ok = f != NULL && fwrite(header, sizeof(header), 1, f) == 1 &&
         fwrite(tok, sizeof(uint16_t), SHARD_TOK, f) == SHARD_TOK;
    if (f != NULL && fclose(f) != 0)
        ok = 0;
    free(tok);
    return ok ? 0 : -1;
}

/* A temporary directory (dir, a mkdtemp template) with GPT-2's token shard in it (shard,
 * TD_PATH_MAX bytes): 0, or -1 having said so on stderr. temp_shard_remove takes both away. */
static int temp_shard(char *dir, char *shard)
{
    if (mkdtemp(dir) == NULL || snprintf(shard, TD_PATH_MAX, "%s/tokens.bin", dir) < 0 ||
        write_shard(shard, 50257) != 0) {
        fprintf(stderr, "bench_gpu: cannot write the token shard in %s\n", dir);
        return -1;
    }
    return 0;
}

static void temp_shard_remove(const char *dir, const char *shard)
{
    unlink(shard);
    rmdir(dir);
}

static void gpt2_config(td_train_config *cfg, const char *shard, int B, int steps)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_GPT;
    cfg->data = TD_DATA_TOKENS;
    cfg->n_layer = 12, cfg->n_head = 12, cfg->n_embd = 768, cfg->seq_len = 1024;
    cfg->vocab_size = 50257;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", shard);
    cfg->n_train_files = 1;
    cfg->batch_size = B;
    cfg->max_steps = steps;
    cfg->lr = 6e-4f, cfg->beta1 = 0.9f, cfg->beta2 = 0.95f, cfg->weight_decay = 0.1f;
    cfg->grad_clip = 1.0f;
    cfg->seed = 1;
    cfg->kernels = td_kernels_cuda();
}

typedef struct train_arg {
    td_cuda_ctx *ctx;
    td_train_config cfg;
    int steps, warmup;
    result r;
} train_arg;

static void loss_hook(void *ud, const char *key, int64_t step, double value)
{
    result *r = ud;

    if (strcmp(key, "train_loss") != 0)
        return;
    if (step == 1)
        r->first_loss = value;
    r->last_loss = value;
}

/* Builds the trainer (the device's free memory must fall by at least the parameters' size: it
 * keeps its buffers on the device), then warmup + steps steps, timed after the warm-up. Each
 * step reads its loss and gradient norm back, so the wall clock is the device's. */
static void train_run(void *arg)
{
    train_arg *a = arg;
    td_train_hooks hooks = {.ud = &a->r, .metric = loss_hook};
    td_trainer *t = NULL;
    td_mem_estimate e;
    td_error_t err = {0};
    size_t free0 = 0, free1 = 0, total = 0;
    int dev = td_cuda_ctx_device(a->ctx);
    double t0 = 0.0;
    td_cuda_counts c0 = {0}, c1 = {0};

    set_precision(a->ctx, a->r.p);
    a->cfg.precision = a->r.p == P_BF16 ? TD_PRECISION_BF16 : TD_PRECISION_FP32;
    a->cfg.tf32 = a->r.p == P_TF32;
    a->cfg.peak_flops = peak_flops(dev, a->r.p);
    if (td_train_memory_estimate(&a->cfg, &e, &err) != 0 ||
        td_cuda_mem_info(dev, &free0, &total, &err) != 0 ||
        td_trainer_new(&t, &a->cfg, &hooks, &err) != 0 ||
        td_cuda_mem_info(dev, &free1, &total, &err) != 0) {
        td_trainer_free(t);
        td_panic(err.code, "%s", err.msg);
    }
    if (free0 < free1 + e.params) {
        td_trainer_free(t);
        td_panic(TD_ESTATE,
                 "the trainer's buffers are not on the device: its free memory fell "
                 "by %zu MiB, the parameters alone are %zu MiB",
                 free0 > free1 ? (free0 - free1) >> 20 : 0, e.params >> 20);
    }
    for (int s = 0; s < a->warmup + a->steps; s++) {
        if (s == a->warmup) {
            t0 = (td_mono_ms() / 1e3);
            td_cuda_counts_get(&c0);
        }
        if (td_trainer_step_caught(t, &err) < 0) {
            td_trainer_free(t);
            td_panic(err.code, "step %d: %s", s + 1, err.msg);
        }
        if (s < a->warmup || s == a->warmup + a->steps - 1 || (s - a->warmup) % 5 == 0)
            printf("  step %2d: loss %.4f%s\n", s + 1, a->r.last_loss,
                   s < a->warmup ? " (warm-up)" : "");
    }
    a->r.ms = ((td_mono_ms() / 1e3) - t0) * 1e3 / a->steps;
    td_cuda_counts_get(&c1);
    a->r.host_syncs = (double)(c1.syncs - c0.syncs) / a->steps;
    a->r.flops_per_step = td_train_flops_per_step(&a->cfg);
    td_trainer_free(t);
    set_precision(a->ctx, P_FP32);
}

/* The batch: the largest whose estimate fits the device's free memory (plus the context this
 * process already holds, which the estimate counts, less 1 GiB of reserve), at most cap. */
static int pick_batch(const td_train_config *cfg0, int device, int cap)
{
    td_train_config cfg = *cfg0;
    size_t free_b = 0, total = 0, room;
    td_error_t err = {0};
    int batch = 0;

    if (td_cuda_mem_info(device, &free_b, &total, &err) != 0)
        return 1;
    room = free_b + TD_CUDA_CUBLAS_WORKSPACE + TD_CUDA_SCRATCH_DEFAULT + TD_CUDA_CTX_FIXED;
    room = room > 1024 * MiB ? room - 1024 * MiB : 0;
    cfg.batch_size = 1;
    if (td_train_largest_batch(&cfg, room, &batch, &err) != 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        return 1;
    }
    printf("%zu MiB free of %zu: the largest batch that fits is %d%s\n", free_b / MiB, total / MiB,
           batch, batch > cap ? ", capped" : "");
    return batch < cap ? batch : cap;
}

/* ---- 3. the table driven by hand ------------------------------------------------------------ */

typedef struct run_arg {
    model *m;
    int steps, warmup, B;
    td_cuda_ctx *ctx;
    result r;
} run_arg;

static void build(void *arg)
{
    run_arg *a = arg;

    if (model_new(a->m, a->B, 1024) != 0)
        td_panic(TD_ENOMEM, "cannot build the model");
}

/* From the initial parameters and fresh moments: warmup untimed steps, then steps timed. */
static void run(void *arg)
{
    run_arg *a = arg;
    model *m = a->m;
    double t0 = 0.0, N = (double)td_gpt_num_params(&m->d);
    float loss = 0.0f;
    td_cuda_counts c0 = {0}, c1 = {0};

    set_precision(a->ctx, a->r.p);
    td_cuda_upload(m->params, m->hp.data, m->hp.n * sizeof(float));
    K->zero(m->m, m->hp.n);
    K->zero(m->v, m->hp.n);
    for (int s = 0; s < a->warmup + a->steps; s++) {
        if (s == a->warmup) {
            td_cuda_sync();
            t0 = (td_mono_ms() / 1e3);
            td_cuda_counts_get(&c0);
        }
        forward(m);
        backward(m);
        update(m, s + 1);
        td_cuda_download(&loss, m->loss, sizeof(float)); /* as a trainer reads its loss */
        if (s == 0)
            a->r.first_loss = loss;
        if (s < a->warmup || s == a->warmup + a->steps - 1 || (s - a->warmup) % 5 == 0)
            printf("  step %2d: loss %.4f%s\n", s + 1, loss, s < a->warmup ? " (warm-up)" : "");
    }
    a->r.ms = ((td_mono_ms() / 1e3) - t0) * 1e3 / a->steps;
    td_cuda_counts_get(&c1);
    a->r.host_syncs = (double)(c1.syncs - c0.syncs) / a->steps;
    a->r.last_loss = loss;
    a->r.flops_per_step = (6.0 * N + 6.0 * m->d.L * m->d.C * m->T) * (double)m->B * m->T;
    set_precision(a->ctx, P_FP32);
}

/* ---- 4. the profile ------------------------------------------------------------------------ */

typedef struct prof_arg {
    td_cuda_ctx *ctx;
    td_train_config cfg;
    int steps, warmup;
    const char *unit;   /* "tokens" or "samples" */
    double per_step;    /* tokens or samples a step */
    double gemm_tflops; /* cuBLAS's bf16 GEMM in this run, 0: not measured */
    char title[160];
    result r;
} prof_arg;

static int cmp_ms(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* One trainer in bf16 on the profiling table: warmup steps, steps plain (each one timed by the
 * host: a step reads its loss back, so it ends synchronised), then steps profiled. */
static void profile_run(void *arg)
{
    prof_arg *a = arg;
    td_train_hooks hooks = {.ud = &a->r, .metric = loss_hook};
    td_trainer *t = NULL;
    td_error_t err = {0};
    gp_step *st = calloc((size_t)a->steps, sizeof(*st));
    double *plain = calloc((size_t)a->steps, sizeof(*plain)), t0, plain_ms;
    int dev = td_cuda_ctx_device(a->ctx), rc = 0;

    set_precision(a->ctx, P_BF16);
    a->cfg.precision = TD_PRECISION_BF16;
    a->cfg.tf32 = 0;
    a->cfg.kernels = gp_table();
    a->cfg.max_steps = a->warmup + 2 * a->steps;
    if (st == NULL || plain == NULL)
        rc = td_error_set(&err, TD_ENOMEM, "no memory for %d steps' figures", a->steps);
    if (rc == 0)
        rc = td_trainer_new(&t, &a->cfg, &hooks, &err);
    for (int s = 0; rc == 0 && s < a->warmup + 2 * a->steps; s++) {
        int profiled = s >= a->warmup + a->steps;
        t0 = td_mono_ms();
        if (profiled)
            gp_step_begin();
        if (td_trainer_step_caught(t, &err) < 0) {
            rc = err.code;
            break;
        }
        if (profiled)
            gp_step_end(&st[s - a->warmup - a->steps]);
        else if (s >= a->warmup)
            plain[s - a->warmup] = td_mono_ms() - t0;
    }
    td_trainer_free(t);
    set_precision(a->ctx, P_FP32);
    if (rc != 0) {
        free(st), free(plain);
        td_panic(rc, "%s", err.msg);
    }
    qsort(plain, (size_t)a->steps, sizeof(*plain), cmp_ms);
    plain_ms =
        a->steps % 2 ? plain[a->steps / 2] : 0.5 * (plain[a->steps / 2 - 1] + plain[a->steps / 2]);
    gp_report(a->title, st, a->steps, plain_ms, td_train_flops_per_step(&a->cfg), a->per_step,
              a->unit, peak_flops(dev, P_BF16), a->gemm_tflops);
    printf("  loss %.4f at step 1, %.4f at step %d\n\n", a->r.first_loss, a->r.last_loss,
           a->warmup + 2 * a->steps);
    free(st), free(plain);
}

/* The SensorLM base preset on a sensor shard, llm.c-like AdamW at 1e-4, bf16. */
static void slm_config(td_train_config *cfg, const char *shard)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_SENSORLM;
    cfg->data = TD_DATA_SENSOR;
    memset(&cfg->slm, 0, sizeof(cfg->slm));
    cfg->slm.size = TD_SLM_BASE;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", shard);
    cfg->n_train_files = 1;
    cfg->lr = 1e-4f, cfg->grad_clip = 1.0f, cfg->seed = 1;
    cfg->precision = TD_PRECISION_BF16;
    cfg->kernels = td_kernels_cuda();
}

/* GPT-2 124M at B (16 by default), then the SensorLM base at the guard's batch when a shard is
 * given. Returns 0, or 1 after a failed run (printed). */
static int profile_all(td_cuda_ctx *ctx, int B, int steps, int warmup, const char *slm_shard,
                       double gemm_tflops, const char *shard)
{
    static prof_arg a;
    int rc = 0, slm_batch = 0;

    memset(&a, 0, sizeof(a));
    a.ctx = ctx, a.steps = steps, a.warmup = warmup, a.gemm_tflops = gemm_tflops;
    gpt2_config(&a.cfg, shard, B > 0 ? B : MAX_BATCH, warmup + 2 * steps);
    a.unit = "tokens", a.per_step = (double)a.cfg.batch_size * 1024;
    snprintf(a.title, sizeof(a.title), "GPT-2 124M, B=%d, T=1024, bf16 matmuls", a.cfg.batch_size);
    if (guarded(profile_run, &a) != 0)
        rc = 1;
    if (slm_shard == NULL)
        return rc;

    memset(&a, 0, sizeof(a));
    a.ctx = ctx, a.steps = steps, a.warmup = warmup, a.gemm_tflops = gemm_tflops;
    slm_config(&a.cfg, slm_shard);
    slm_batch = pick_batch(&a.cfg, 0, 1024);
    a.cfg.batch_size = slm_batch;
    a.unit = "samples", a.per_step = slm_batch;
    snprintf(a.title, sizeof(a.title), "SensorLM base, B=%d (the guard's largest), bf16 matmuls",
             slm_batch);
    if (guarded(profile_run, &a) != 0)
        rc = 1;
    return rc;
}

/* ---- 5. the probe --------------------------------------------------------------------------- */

/* "13.0" of 13000. */
static void cuda_ver(char *buf, size_t n, int v)
{
    snprintf(buf, n, "%d.%d", v / 1000, (v % 1000) / 10);
}

static int probe(void)
{
    int drv = 0, rt = 0, n = 0, nccl = 0, maj = 0, min = 0, pat = 0, rc = 0;
    char d[16], r[16];
    td_error_t err = {0};

    (void)cudaDriverGetVersion(&drv);
    (void)cudaRuntimeGetVersion(&rt);
    cuda_ver(d, sizeof(d), drv), cuda_ver(r, sizeof(r), rt);
    printf("runtime: CUDA %s (%d), linked statically\n", r, rt);
    if (drv == 0)
        printf("driver: none (no libcuda.so.1 loads, or no NVIDIA driver)\n");
    else if (drv < rt)
        printf("driver: CUDA %s (%d): too old for this build's CUDA %s runtime: update the "
               "driver\n",
               d, drv, r);
    else
        printf("driver: CUDA %s (%d)\n", d, drv);
    if (cublasGetProperty(MAJOR_VERSION, &maj) == CUBLAS_STATUS_SUCCESS &&
        cublasGetProperty(MINOR_VERSION, &min) == CUBLAS_STATUS_SUCCESS &&
        cublasGetProperty(PATCH_LEVEL, &pat) == CUBLAS_STATUS_SUCCESS)
        printf("cuBLAS: %d.%d.%d\n", maj, min, pat);
    else
        printf("cuBLAS: cannot tell its version\n"), rc = 1;
    if (ncclGetVersion(&nccl) == ncclSuccess)
        printf("NCCL: %d.%d.%d (%d)\n", nccl / 10000, (nccl / 100) % 100, nccl % 100, nccl);
    else
        printf("NCCL: cannot tell its version\n"), rc = 1;
    if (drv == 0 || drv < rt) {
        printf("devices: 0\n");
        return rc;
    }
    if (td_cuda_devices(&n, &err) != 0) {
        printf("devices: 0 (%s)\n", err.msg);
        return 1;
    }
    printf("devices: %d\n", n);
    for (int i = 0; i < n; i++) {
        struct cudaDeviceProp p;
        size_t fr = 0, tot = 0;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess ||
            td_cuda_mem_info(i, &fr, &tot, &err) != 0) {
            printf("device %d: cannot be read\n", i);
            rc = 1;
            continue;
        }
        printf("device %d: %s, sm_%d%d, %d SMs, %zu MiB free of %zu; dense bf16 peak %.1f "
               "TFLOP/s%s\n",
               i, p.name, p.major, p.minor, p.multiProcessorCount, fr / MiB, tot / MiB,
               peak_flops(i, P_BF16) / 1e12, peak_flops(i, P_BF16) > 0 ? "" : " (unknown)");
    }
    return rc;
}

/* ---- main ------------------------------------------------------------------------------------ */

static int usage(void)
{
    fprintf(stderr, "usage: bench_gpu [--batch B] [--steps S] [--warmup W] "
                    "[--precision bf16,tf32,fp32] [--direct] [--no-gemm] [--csv FILE]\n"
                    "                 [--profile [--slm-data SHARD]] [--probe]\n");
    return 2;
}

/* Which precisions a comma list names, as bits of 1 << prec; 0 for a bad list. */
static int parse_precisions(const char *list)
{
    int mask = 0;
    char buf[64], *save = NULL;

    snprintf(buf, sizeof(buf), "%s", list);
    for (char *w = strtok_r(buf, ",", &save); w != NULL; w = strtok_r(NULL, ",", &save)) {
        int found = 0;
        for (int p = 0; p < N_PREC; p++)
            if (strcmp(w, prec_names[p]) == 0)
                mask |= 1 << p, found = 1;
        if (!found)
            return 0;
    }
    return mask;
}

/* One attention's plan and what the replaced kernel issued: row chunks of all B sequences
 * within 64 MiB, each product a loop of min(B, NH) strided-batched gemms. */
static void plan_line(const char *what, int B, int NH, int Nq, int Nk, int causal)
{
    td_attn_dims d = {.B = B, .NH = NH, .Nq = Nq, .Nk = Nk, .hs = 64, .causal = causal};
    size_t row = (size_t)B * NH * Nk * sizeof(float), fit = TD_ATTN_BLOCK_BYTES / row;
    int old = fit < 1 ? 1 : fit < (size_t)Nq ? (int)fit : Nq, chunks = (Nq + old - 1) / old;
    int loop = B < NH ? B : NH;
    td_attn_calls c;

    d.ldq = d.ldk = d.ldv = 3 * NH * 64;
    d.chunk = td_attn_chunk(0, B, NH, Nq, Nk);
    td_attn_plan(&d, &c);
    printf("%s (B %d, %d heads, %d x %d%s):\n"
           "  plan:     chunk %d, %d blocks of %s, gemms %d fwd + %d bwd, other launches %d + %d "
           "a layer; keys read %d times a sequence; largest block %.0f MiB\n"
           "  replaced: chunk %d, %d row chunks, gemms %d fwd + %d bwd, other launches %d + %d "
           "a layer; keys read %d times a sequence\n",
           what, B, NH, Nq, Nk, causal ? ", causal" : "", d.chunk, c.blocks,
           c.by_seq ? "whole sequences" : "rows of every sequence", c.gemms_fwd, c.gemms_bwd,
           c.kernels_fwd, c.kernels_bwd, c.kv_reads, c.block_floats * 4.0 / 1048576.0, old, chunks,
           2 * loop * chunks, 5 * loop * chunks, chunks, chunks + 1, chunks);
}

/* ---- a whole step on the counting table (--plan) ----------------------------------------------
 */

typedef td_tensor *(*plan_fwd)(td_ctx *c, void *mdl);

/* One forward and backward of mdl through the engine on plan_count.c's table, in an arena
 * of bytes (address space only): the first writers (zero_grads 0) or the reference path that
 * zeroes every gradient when it is allocated and adds everywhere (1: the backward before
 * issue 24). */
static pc_counts plan_count(plan_fwd fwd, void *mdl, size_t bytes, int tape_len, int zero_grads)
{
    const td_kernels *k = pc_table();
    td_arena arena = {0};
    td_tape tape = {0};
    td_error_t err = {0};
    td_ctx c = {.k = k, .arena = &arena, .tape = &tape, .zero_grads = zero_grads};
    td_boundary b;
    pc_counts r;

    if (td_arena_init_on(&arena, bytes, k, &err) != 0 || td_tape_init(&tape, tape_len) != 0) {
        fprintf(stderr, "bench_gpu --plan: %s\n", err.msg[0] ? err.msg : "no memory for the tape");
        exit(1);
    }
    pc_reset();
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_backward(&c, fwd(&c, mdl));
        td_boundary_leave(&b);
    } else {
        fprintf(stderr, "bench_gpu --plan: %s\n", b.err.msg);
        exit(1);
    }
    r = pc_get();
    td_tape_free(&tape);
    td_arena_free(&arena);
    return r;
}

static void plan_counts_line(const char *when, const pc_counts *c)
{
    printf("  %-7s %ld table calls; memsets %ld, %.2f GB; activation gradients %ld stored (%.2f "
           "GB written), %ld added into (%.2f GB read and written); %ld residual gradients "
           "passed through\n",
           when, c->calls, c->zero_calls, c->zero_b / 1e9, c->stored, c->stored_b / 1e9, c->added,
           c->added_b / 1e9, c->passthrough);
}

static void plan_step(const char *what, plan_fwd fwd, void *mdl, size_t bytes, int tape_len)
{
    pc_counts now = plan_count(fwd, mdl, bytes, tape_len, 0);
    pc_counts before = plan_count(fwd, mdl, bytes, tape_len, 1);

    printf("%s, one step's forward and backward through the engine (a counting table):\n", what);
    plan_counts_line("now:", &now);
    plan_counts_line("before:", &before);
}

typedef struct plan_gpt {
    td_gpt m;
    int *tok; /* B*T, never read: the table computes nothing */
    int B, T;
} plan_gpt;

static td_tensor *plan_gpt_fwd(td_ctx *c, void *mdl)
{
    plan_gpt *g = mdl;

    return td_gpt_forward(c, &g->m, g->tok, g->tok, g->B, g->T, NULL);
}

typedef struct plan_slm {
    td_sensorlm m;
    int *tok, *end; /* never read */
    int B;
} plan_slm;

static td_tensor *plan_slm_fwd(td_ctx *c, void *mdl)
{
    plan_slm *s = mdl;
    td_tensor *x = td_tensor_new(c, 3, (int[]){s->B, s->m.d.N, s->m.d.P}, 0);
    td_tensor *se = td_sensorlm_sensor(c, &s->m, x);
    td_tensor *u = td_sensorlm_text(c, &s->m, s->tok, s->end, s->B);

    return td_sensorlm_loss(c, &s->m, se, u, s->B, 0);
}

/* GPT-2 124M at B, T 1024, and SensorLM base (T 1440, C 34) at batch 32: the parameters in host
 * memory never touched (calloc), the arena address space. */
static void plan_steps(int B)
{
    static plan_gpt g;
    static plan_slm s;
    td_gpt_dims d = {.maxT = 1024, .V = 50257, .Vp = 50304, .L = 12, .NH = 12, .C = 768};
    td_sensorlm_config cfg = {.size = TD_SLM_BASE, .time_steps = 1440, .channels = 34};
    td_params gp = {0}, sp = {0};
    td_slm_dims sd;
    td_error_t err = {0};
    char what[96];

    g.B = B, g.T = 1024;
    g.tok = calloc((size_t)B * 1024, sizeof(int));
    if (g.tok == NULL || td_gpt_declare(&g.m, &gp, &d, &err) != 0 || td_params_alloc(&gp, 0) != 0) {
        fprintf(stderr, "bench_gpu --plan: the GPT: %s\n", err.msg[0] ? err.msg : "no memory");
        exit(1);
    }
    td_gpt_bind(&g.m);
    snprintf(what, sizeof(what), "GPT-2 124M (B %d, T 1024)", B);
    plan_step(what, plan_gpt_fwd, &g, td_gpt_arena_bytes(&g.m, B, 1024, 1), td_gpt_tape_len(&g.m));
    td_params_free(&gp);
    free(g.tok);

    s.B = 32;
    s.tok = calloc((size_t)32 * 64, sizeof(int));
    s.end = calloc(32, sizeof(int));
    if (s.tok == NULL || s.end == NULL || td_slm_dims_of(&cfg, 1440, 34, &sd, &err) != 0 ||
        td_sensorlm_declare(&s.m, &sp, &sd, &err) != 0 || td_params_alloc(&sp, 0) != 0) {
        fprintf(stderr, "bench_gpu --plan: SensorLM base: %s\n",
                err.msg[0] ? err.msg : "no memory");
        exit(1);
    }
    plan_step("SensorLM base (B 32, T 1440, C 34)", plan_slm_fwd, &s,
              td_sensorlm_arena_bytes(&s.m, 32, 32, 1, 1) +
                  td_tensor_bytes((size_t)32 * sd.N * sd.P, 0), /* and the patches */
              td_sensorlm_tape_len(&s.m));
    td_params_free(&sp);
    free(s.tok), free(s.end);
}

/* Step 2 of the real trainer (GPT-2 124M at B, T 1024, fp32, AdamW with the clip) on the counting
 * table, or (legacy) on it without adamw_flat and clip_scale: the path before issue 24's fused
 * step, which read the loss, then the norm, and updated tensor by tensor. */
static pc_counts plan_trainer_step(const char *shard, int B, int legacy, int64_t *syncs)
{
    static td_kernels old;
    td_train_config cfg;
    td_train_hooks hooks = {0};
    td_trainer *t = NULL;
    td_error_t err = {0};
    pc_counts c;

    old = *pc_table();
    old.adamw_flat = NULL;
    old.clip_scale = NULL;
    gpt2_config(&cfg, shard, B, 3);
    cfg.kernels = legacy ? &old : pc_table();
    if (td_trainer_new(&t, &cfg, &hooks, &err) != 0 || td_trainer_step_caught(t, &err) < 0) {
        fprintf(stderr, "bench_gpu --plan: the trainer on the counting table: %s\n", err.msg);
        exit(1);
    }
    pc_reset();
    if (td_trainer_step_caught(t, &err) < 0) {
        fprintf(stderr, "bench_gpu --plan: the trainer's step 2: %s\n", err.msg);
        exit(1);
    }
    c = pc_get();
    *syncs = td_trainer_host_syncs(t);
    td_trainer_free(t);
    return c;
}

static void plan_trainer(int B)
{
    char dir[64] = "/tmp/td_bench_gpu_XXXXXX", shard[TD_PATH_MAX];

    if (temp_shard(dir, shard) != 0)
        exit(1);
    printf("GPT-2 124M (B %d, T 1024, fp32 AdamW, clip 1), a whole training step of the trainer "
           "(the counting table):\n",
           B);
    for (int legacy = 0; legacy < 2; legacy++) {
        int64_t syncs = 0;
        pc_counts c = plan_trainer_step(shard, B, legacy, &syncs);
        printf("  %-7s %ld table calls; memsets %ld, %.2f GB; host syncs %ld (the trainer counts "
               "%lld), asynchronous uploads %ld%s\n",
               legacy ? "before:" : "now:", c.calls, c.zero_calls, c.zero_b / 1e9, c.syncs,
               (long long)syncs, c.copies,
               legacy ? " (no adamw_flat, clip_scale: the loss, then the norm read back, the "
                        "clip on the host, AdamW tensor by tensor)"
                      : "");
    }
    temp_shard_remove(dir, shard);
}

static int plan(int B)
{
    plan_line("GPT-2 124M", B > 0 ? B : 16, 12, 1024, 1024, 1);
    plan_line("SensorLM base, sensor tower", 32, 12, 2448, 2448, 0);
    plan_line("SensorLM base, text tower", 32, 12, 64, 64, 1);
    plan_line("SensorLM base, MAP head", 32, 12, 1, 2448, 0);
    plan_steps(B > 0 ? B : 16);
    plan_trainer(B > 0 ? B : 16);
    return 0;
}

int main(int argc, char **argv)
{
    static model m;
    int B = 0, steps = 20, warmup = 3, modes = 7, direct = 0, gemm = 1, rc = 0, n = 0;
    int profile = 0;
    const char *csv = NULL, *slm = NULL;
    td_error_t err = {0};
    td_cuda_ctx *ctx = NULL;
    struct cudaDeviceProp prop;
    gemm_arg g = {0};
    char dir[64] = "/tmp/td_bench_gpu_XXXXXX", shard[TD_PATH_MAX] = "";

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            B = atoi(argv[++i]);
        else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--warmup") == 0 && i + 1 < argc)
            warmup = atoi(argv[++i]);
        else if (strcmp(argv[i], "--precision") == 0 && i + 1 < argc)
            modes = parse_precisions(argv[++i]);
        else if (strcmp(argv[i], "--direct") == 0)
            direct = 1;
        else if (strcmp(argv[i], "--no-gemm") == 0)
            gemm = 0;
        else if (strcmp(argv[i], "--csv") == 0 && i + 1 < argc)
            csv = argv[++i];
        else if (strcmp(argv[i], "--profile") == 0)
            profile = 1;
        else if (strcmp(argv[i], "--slm-data") == 0 && i + 1 < argc)
            slm = argv[++i];
        else if (strcmp(argv[i], "--probe") == 0)
            return probe();
        else if (strcmp(argv[i], "--plan") == 0)
            return plan(B);
        else
            return usage();
    }
    if (B < 0 || steps < 1 || warmup < 0 || modes == 0)
        return usage();
    if (td_cuda_device_count(&n) != 0 || n == 0) {
        printf("bench_gpu: no CUDA device: skipped\n");
        return 77;
    }
    if (td_cuda_ctx_new(&ctx, 0, NULL, &err) != 0) {
        fprintf(stderr, "bench_gpu: %s\n", err.msg);
        return 1;
    }
    K = td_kernels_cuda();
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        snprintf(prop.name, sizeof(prop.name), "unknown");
    printf("device 0: %s, %d SMs, sm_%d%d; dense peak TFLOP/s: bf16 %.1f, tf32 %.1f, fp32 %.1f "
           "(0: unknown)\n",
           prop.name, prop.multiProcessorCount, prop.major, prop.minor,
           peak_flops(0, P_BF16) / 1e12, peak_flops(0, P_TF32) / 1e12,
           peak_flops(0, P_FP32) / 1e12);

    if (gemm) {
        g.ctx = ctx;
        if (guarded(gemm_run, &g) == 0) {
            double pk = peak_flops(0, P_BF16);
            printf("cuBLAS bf16 GEMM %dx%dx%d: %.1f TFLOP/s", GEMM_N, GEMM_N, GEMM_N, g.tflops);
            if (pk > 0)
                printf(" (%.1f%% of the datasheet peak)", 100.0 * g.tflops * 1e12 / pk);
            printf("\n");
        } else {
            rc = 1;
        }
    }

    if (profile) {
        if (temp_shard(dir, shard) != 0) {
            td_cuda_ctx_free(ctx);
            return 1;
        }
        rc |= profile_all(ctx, B, steps, warmup, slm, g.tflops, shard);
        temp_shard_remove(dir, shard);
    } else if (!direct) {
        train_arg a = {.ctx = ctx, .steps = steps, .warmup = warmup};
        if (temp_shard(dir, shard) != 0) {
            td_cuda_ctx_free(ctx);
            return 1;
        }
        gpt2_config(&a.cfg, shard, 1, warmup + steps);
        a.cfg.batch_size = B > 0 ? B : pick_batch(&a.cfg, 0, MAX_BATCH);
        printf("GPT-2 124M through the trainer: B=%d, T=1024, %d + %d steps\n", a.cfg.batch_size,
               warmup, steps);
        for (int p = 0; p < N_PREC; p++) {
            if (!(modes & (1 << p)))
                continue;
            memset(&a.r, 0, sizeof(a.r));
            a.r.path = "trainer", a.r.p = (prec)p, a.r.B = a.cfg.batch_size;
            printf("%s:\n", prec_names[p]);
            if (guarded(train_run, &a) != 0) {
                rc = 1;
                continue;
            }
            report(&a.r, 0, g.tflops, csv);
        }
        temp_shard_remove(dir, shard);
        if (B == 0)
            B = a.cfg.batch_size;
    }

    if (direct) {
        run_arg a = {.m = &m, .steps = steps, .warmup = warmup, .B = B > 0 ? B : 8, .ctx = ctx};
        printf("GPT-2 124M through the table by hand: B=%d, T=1024, %d + %d steps\n", a.B, warmup,
               steps);
        if (guarded(build, &a) != 0)
            rc = 1;
        for (int p = 0; p < N_PREC && rc == 0; p++) {
            if (!(modes & (1 << p)))
                continue;
            memset(&a.r, 0, sizeof(a.r));
            a.r.path = "direct", a.r.p = (prec)p, a.r.B = a.B;
            printf("%s:\n", prec_names[p]);
            if (guarded(run, &a) != 0)
                rc = 1;
            else
                report(&a.r, 0, g.tflops, csv);
        }
    }
    td_cuda_ctx_free(ctx);
    return rc;
}

#else

int main(void)
{
    printf("bench_gpu: built without CUDA: skipped\n");
    return 77;
}

#endif
