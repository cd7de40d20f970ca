/* Compute kernels: every op the engine (train/) runs, as one backend table per device kind.
 * A backend is a struct of function pointers; train/ picks one table per trainer and calls
 * only through it, so the same model code runs on the CPU (OpenBLAS sgemm + C loops, cpu.c)
 * and CUDA (kernels + cuBLAS, kernels/cuda). Owns no memory: every pointer is the caller's and
 * lives where the backend computes (host memory for "cpu", device memory for "cuda").
 *
 * Conventions, llm.c style: outputs first, then inputs, then dimensions; shapes in comments
 * (`// inp is (N,C)`), row-major. Backward kernels ACCUMULATE (+=) into their gradient
 * outputs, so a tensor read by several ops collects every contribution. The five whose
 * activation gradients are large (matmul, layernorm, GELU, residual, attention) take a `store`
 * mask besides: an output whose bit is set is STORED, 0 + its contribution (the bits of
 * accumulating into a zeroed buffer), and never read, so it may hold anything before (the
 * engine's first writer of a gradient stores, and nobody zeroes it). A gradient output given
 * as NULL is not computed.
 *
 * Threads: a table may be used by any number of threads at once. The only state is per calling
 * thread: the CPU's team of helper threads (set_threads), the CUDA context (cuda/td_cuda.h). */
#ifndef TD_KERNELS_H
#define TD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The store mask's bits: a backward kernel's first gradient output (dinp, dinp1, dq), its
 * second (dinp2, dk), its third (dv). Parameter gradients (dweight, dbias) always accumulate. */
#define TD_STORE_1 1
#define TD_STORE_2 2
#define TD_STORE_3 4

/* One fused attention call's shape and layout (attention_forward, attention_backward).
 * Sequence b's rows of q start at q + b*Nq*ldq, its rows of k and v at k + b*Nk*ldk and
 * v + b*Nk*ldv; head h takes columns [h*hs, (h+1)*hs) of every row. So llm.c's packed qkv
 * (B,T,3C) is q = qkv, k = qkv + C, v = qkv + 2C with ldq = ldk = ldv = 3C, and separate
 * (B,N,C) tensors have ld = C. out, dout and the forward's out are (B,Nq,NH*hs), dense. */
typedef struct td_attn_dims {
    int B;             /* sequences */
    int NH;            /* heads */
    int Nq;            /* query rows of a sequence */
    int Nk;            /* key (and value) rows of a sequence */
    int hs;            /* head size */
    int ldq, ldk, ldv; /* floats from a row of q (k, v) to the next, >= NH*hs; dq (dk, dv) too */
    int causal;        /* 1: query i sees keys 0..i only (self-attention: Nq == Nk) */
    int chunk;         /* the scratch's block of scores, B*NH*chunk*Nk floats, in query rows:
                        * 1..Nq; the blocks the kernels compute in it are kernels/attn_plan.h's */
} td_attn_dims;

/* The CUDA table's pointer arrays (cuBLAS's batched gemms take one device pointer a pair), at
 * the scratch's end: this many arrays of B*NH pointers. */
#define TD_ATTN_PTR_ARRAYS 9

/* Floats of scratch attention_forward (backward 0) or attention_backward (1) takes: one block
 * of scores, B*NH*chunk*Nk floats, forward; two (probabilities and their gradient) and D, one
 * float per query row (B*NH*Nq), backward; then, from an even float on (8-byte aligned when
 * the scratch is), TD_ATTN_PTR_ARRAYS arrays of B*NH pointers (2 floats each), which only the
 * CUDA table uses. Both tables take exactly this much. td_attn_scratch_ptrs: the float at
 * which the pointer arrays start. */
static inline size_t td_attn_scratch_ptrs(const td_attn_dims *d, int backward)
{
    size_t block = (size_t)d->B * d->NH * d->chunk * d->Nk;
    size_t lead = backward ? 2 * block + (size_t)d->B * d->NH * d->Nq : block;

    return (lead + 1) / 2 * 2;
}

static inline size_t td_attn_scratch(const td_attn_dims *d, int backward)
{
    return td_attn_scratch_ptrs(d, backward) + (size_t)TD_ATTN_PTR_ARRAYS * 2 * d->B * d->NH;
}

/* One tensor of a flat parameter buffer for adamw_flat: floats [offset, offset + n), decayed
 * when decay is 1. */
typedef struct td_adamw_span {
    uint64_t offset; /* floats */
    uint64_t n;      /* floats */
    uint32_t decay;  /* 1: weight_decay applies; 0: none */
    uint32_t pad;
} td_adamw_span;

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
    // Host memory that batches are built in before upload_async: *p = bytes (not cleared),
    // aligned to 256 bytes, page-locked where that makes the copy a true DMA that overlaps the
    // host (cuda: cudaHostAlloc, portable across devices; cpu: aligned_alloc). TD_ENOMEM or
    // TD_ECUDA with err naming the size; *p NULL then. Release with free_host (NULL ok)
    int (*alloc_host)(void **p, size_t bytes, td_error_t *err);
    void (*free_host)(void *p);
    // dst (backend memory) = src (host memory), bytes of it; returns when the copy is done and
    // every op queued before it has run
    void (*upload)(void *dst, const void *src, size_t bytes);
    // dst (host memory) = src (backend memory); returns when the copy is done, after every op
    // queued before it. A failed op queued earlier panics here
    void (*download)(void *dst, const void *src, size_t bytes);
    // dst (backend memory) = src (host memory), queued after every op before it; returns at
    // once, without waiting for the device. src must stay unchanged until the next download or
    // sync (the trainer refills its stage only after the step's one read-back); pinned memory
    // makes it a true DMA. cpu: a memcpy, done on return
    void (*upload_async)(void *dst, const void *src, size_t bytes);

    // How many threads the calling thread's ops may use, n > 0. cpu: the calling thread gets a
    // team of n-1 helper threads (made here, kept until the thread exits or calls again), which
    // its ops share out their rows to; OpenBLAS itself is kept single-threaded. Ops on a thread
    // that never called it run on that thread alone. Results do not depend on n. cuda: nothing
    void (*set_threads)(int n);

    // p[i] = 0 for i in [0,n)
    void (*zero)(float *p, size_t n);

    // out = inp . weight^T + bias
    // out is (N,OC), inp is (N,C), weight is (OC,C), bias is (OC) or NULL
    void (*matmul_forward)(float *out, const float *inp, const float *weight, const float *bias,
                           int N, int C, int OC);
    // dinp += dout . weight (= when store has TD_STORE_1), dweight += dout^T . inp,
    // dbias += sum over rows of dout
    // dinp is (N,C) or NULL, dweight is (OC,C) or NULL, dbias is (OC) or NULL,
    // dout is (N,OC), inp is (N,C), weight is (OC,C)
    void (*matmul_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, int N, int C, int OC, int store);

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
    // The fused classifier (llm.c's): loss as softmax_xent_forward computes it, bit for bit,
    // and, when grad, logits overwritten in place by the dlogits softmax_xent_backward gives
    // for dloss 1 into a zeroed buffer (1/N * (probs - onehot), padding columns 0), without a
    // probs buffer; grad 0: logits are only read (eval). The gradient is the loss's with
    // respect to the logits at dloss 1: the caller scales it if the loss's own gradient is not 1.
    // loss is (1), logits is (N,Vp), targets is (N) in [0,V)
    void (*softmax_xent_fused)(float *loss, float *logits, const int *targets, int N, int V, int Vp,
                               int grad);
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
    // res = a + b, then out = layernorm(res) as layernorm_forward (the residual stream's sum and
    // the next layernorm in one pass: the bits of residual_forward then layernorm_forward)
    // res and out are (N,C), mean and rstd are (N), a and b are (N,C), weight and bias are (C);
    // NULL in a table that has no fused form (the engine then calls the two)
    void (*residual_layernorm_forward)(float *res, float *out, float *mean, float *rstd,
                                       const float *a, const float *b, const float *weight,
                                       const float *bias, int N, int C);
    // dinp += d/dinp (= with TD_STORE_1), dweight += sum over rows of dout*norm,
    // dbias += sum over rows of dout
    // dinp is (N,C) or NULL, dweight and dbias are (C) or NULL, dout and inp are (N,C),
    // weight is (C), mean and rstd are (N) from the forward
    void (*layernorm_backward)(float *dinp, float *dweight, float *dbias, const float *dout,
                               const float *inp, const float *weight, const float *mean,
                               const float *rstd, int N, int C, int store);

    // out = GELU(inp), the tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    // out is (n), inp is (n)
    void (*gelu_forward)(float *out, const float *inp, size_t n);
    // dinp += GELU'(inp) * dout (= with TD_STORE_1)
    // dinp is (n), inp is (n) (the forward's input), dout is (n)
    void (*gelu_backward)(float *dinp, const float *inp, const float *dout, size_t n, int store);

    // out = inp1 + inp2
    // out, inp1, inp2 are (n)
    void (*residual_forward)(float *out, const float *inp1, const float *inp2, size_t n);
    // dinp1 += dout (= with TD_STORE_1), dinp2 += dout (= with TD_STORE_2)
    // dinp1 and dinp2 are (n) or NULL, dout is (n)
    void (*residual_backward)(float *dinp1, float *dinp2, const float *dout, size_t n, int store);

    // Fused multi-head attention (see td_attn_dims): for sequence b, head h and query row i,
    // with S_ij = q_i . k_j / sqrt(hs) over the keys j it sees (all Nk, or j <= i when causal),
    // out_i = sum_j softmax_j(S_i) v_j and lse_i = log sum_j exp(S_ij). The (sequence, head,
    // query row)s go in kernels/attn_plan.h's blocks, each inside the scratch's block of
    // B*NH*chunk*Nk floats; the scores live only in the scratch, so what is kept for the
    // backward is out and lse, O(B*NH*Nq) floats. out is (B,Nq,NH*hs), lse is (B,NH,Nq), scratch is
    // td_attn_scratch(d, 0) floats, q is (B,Nq,ldq), k is (B,Nk,ldk), v is (B,Nk,ldv): head h in
    // columns [h*hs, (h+1)*hs)
    void (*attention_forward)(float *out, float *lse, float *scratch, const float *q,
                              const float *k, const float *v, const td_attn_dims *d);
    // dq += dL/dq, dk += dL/dk, dv += dL/dv from dout = dL/dout, the scores recomputed block by
    // block from q, k and the forward's lse; D_i = dout_i . out_i stands in for the softmax's
    // row sum. Each of dq, dk, dv may be NULL (not computed); store's TD_STORE_1, _2, _3 store
    // dq, dk, dv (their head columns: packed q, k, v's gradients are one tensor's thirds).
    // dq is like q (ldq), dk like k (ldk), dv like v (ldv); scratch is td_attn_scratch(d, 1)
    // floats; dout and out are (B,Nq,NH*hs), q, k, v and lse as in the forward
    void (*attention_backward)(float *dq, float *dk, float *dv, float *scratch, const float *dout,
                               const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const td_attn_dims *d, int store);

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
    // The gradient clip's factor and the step's loss, on the backend, for adamw_flat: with
    // norm = sqrt(*sumsq) (double), out[0] = NaN when *loss or norm is not finite (adamw_flat
    // then skips the step), else (float)(max_norm / (norm + 1e-6)) when max_norm > 0 and norm >
    // max_norm (torch.nn.utils.clip_grad_norm_'s coefficient, computed in double), else 1;
    // out[1] = *loss (0 when loss is NULL), so that one download reads the step's values
    // out is (2), sumsq is (1), loss is (1) or NULL
    void (*clip_scale)(float *out, const double *sumsq, const float *loss, float max_norm);
    // AdamW (adamw_update's arithmetic) over every span of one flat buffer in one call, the
    // span's weight decay weight_decay when its decay flag is set and 0 otherwise; elements in
    // no span (padding) are untouched. First, when *scale != 1, grad *= *scale over all n (the
    // clip, as scale does); when *scale is not finite nothing at all is written.
    // param, m, v, grad are (n); spans is (nspans) in backend memory, sorted by offset, not
    // overlapping, each within [0,n); scale is (1) in backend memory (clip_scale's out[0])
    void (*adamw_flat)(float *param, float *m, float *v, float *grad, size_t n,
                       const struct td_adamw_span *spans, int nspans, const float *scale, float lr,
                       float beta1, float beta2, float eps, float weight_decay, int64_t t);
    // SGD with momentum, PyTorch's torch.optim.SGD (dampening 0, not Nesterov):
    // g = grad + weight_decay*param; buf = momentum*buf + g; param -= lr*buf
    // (buf starts at zero, so the first step sets buf = g as PyTorch does)
    // param, buf, grad are (n); buf may be NULL when momentum is 0
    void (*sgd_update)(float *param, float *buf, const float *grad, size_t n, float lr,
                       float momentum, float weight_decay);
    // The clip over the whole buffer by the backend's factor (clip_scale's out[0]: grad *= it,
    // left so, as scale leaves it, when it is not 1), then sgd_update: one launch, no host sync.
    // A factor that is not finite (a NaN or Inf loss or norm) skips the step: nothing written.
    // param, buf, grad are (n) (buf NULL when momentum is 0), factor is (1)
    void (*sgd_flat)(float *param, float *buf, float *grad, size_t n, const float *factor, float lr,
                     float momentum, float weight_decay);

    // ---- a two-tower model's heads (sensorlm): pooling, one row per sequence, unit rows, and
    // the sigmoid contrastive loss. CPU twins in cpu_heads.c, CUDA twins in cuda/heads.cu

    // out[b,:] = (sum over n of inp[b,n,:], in n order) * (1/N): the mean over the tokens
    // out is (B,C), inp is (B,N,C)
    void (*token_mean_forward)(float *out, const float *inp, int B, int N, int C);
    // dinp[b,n,:] += dout[b,:] * (1/N)
    // dinp is (B,N,C), dout is (B,C)
    void (*token_mean_backward)(float *dinp, const float *dout, int B, int N, int C);

    // out[b,:] = inp[b,idx[b],:]: one row of each sequence (a text tower's end token)
    // out is (B,C), inp is (B,T,C), idx is (B) with values in [0,T)
    void (*gather_rows_forward)(float *out, const float *inp, const int *idx, int B, int T, int C);
    // dinp[b,idx[b],:] += dout[b,:]
    // dinp is (B,T,C), dout is (B,C), idx is (B)
    void (*gather_rows_backward)(float *dinp, const float *dout, const int *idx, int B, int T,
                                 int C);

    // norm[i] = max(||inp[i,:]||_2, TD_L2NORM_EPS) (the sum of squares in double, in column
    // order), out[i,:] = inp[i,:] / norm[i]
    // out is (N,C), norm is (N) (kept for the backward), inp is (N,C)
    void (*l2norm_forward)(float *out, float *norm, const float *inp, int N, int C);
    // dinp[i,:] += (dout[i,:] - out[i,:] (dout[i,:] . out[i,:])) / norm[i] where the norm was
    // not clamped (norm[i] > TD_L2NORM_EPS), dout[i,:] / norm[i] where it was (the dot in double)
    // dinp, dout and out are (N,C), norm is (N) from the forward
    void (*l2norm_backward)(float *dinp, const float *dout, const float *out, const float *norm,
                            int N, int C);

    // SigLIP's sigmoid loss over N rows and M columns of dot products, with a learned scale t
    // and bias b: z_ij = exp(t) dots_ij + b, y_ij = +1 when j == i + diag and -1 otherwise,
    // loss = -weight * sum_ij m_ij log sigmoid(y_ij z_ij), log sigmoid(x) = -(max(-x,0) +
    // log1p(exp(-|x|))), each term in float, the sum in double. m_ij = 1, except with labels
    // (not NULL): a negative pair (j != i + diag) whose labels[i + diag] >= 0 equals labels[j]
    // has m_ij = same (0: left out, so that rows of one class are not pushed apart; in (0, 1):
    // pushed apart less), its term multiplied by same in double
    // loss is (1), dots is (N,M), t and b are (1), labels is (M) ints or NULL (diag + N <= M)
    void (*siglip_forward)(float *loss, const float *dots, const float *t, const float *b,
                           const int *labels, float same, int N, int M, int diag, float weight);
    // g_ij = -dloss weight y_ij sigmoid(-y_ij z_ij), times same where m_ij = same (dL/dz_ij):
    // ddots_ij += exp(t) g_ij,
    // dt += sum_ij exp(t) dots_ij g_ij, db += sum_ij g_ij (both sums in double; a left-out
    // pair adds nothing, not even a zero)
    // ddots is (N,M) or NULL, dt and db are (1) or NULL, dloss is (1), dots is (N,M), labels as
    // the forward's
    void (*siglip_backward)(float *ddots, float *dt, float *db, const float *dloss,
                            const float *dots, const float *t, const float *b, const int *labels,
                            float same, int N, int M, int diag, float weight);
} td_kernels;

/* l2norm's floor on a row's norm: sensorlm's max(||s||_2, 1e-12). */
#define TD_L2NORM_EPS 1e-12f

/* The CPU backend: OpenBLAS sgemm for every matmul, plain C loops for the rest. A static
 * table; never NULL. */
const td_kernels *td_kernels_cpu(void);

/* The BLAS the CPU table computes with, for a person: "OpenBLAS SkylakeX", and when OpenBLAS
 * took a kernel set older than the CPU allows and kernels/cpu_team.c had it choose again, what it
 * took first ("OpenBLAS SkylakeX (it chose Prescott on this CPU; traind asked again)").
 * Static; any thread. */
const char *td_kernels_cpu_blas(void);

#ifdef TD_HAVE_CUDA
/* How many CUDA devices this process sees. *n = 0 and 0 returned when there is no device or
 * no driver; TD_ECUDA for any other CUDA runtime error. (kernels/cuda/probe.cu) */
int td_cuda_device_count(int *n);
#endif

#ifdef __cplusplus
}
#endif

#endif
