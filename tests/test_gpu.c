/* The gpu suite (STYLE.md habit 10, 11): every op of the CUDA backend against its CPU twin,
 * forward and backward, on random inputs; a 2-GPU NCCL all-reduce and its watchdog; a sticky
 * error in a child process, classified sticky; the memory guard (train/memest.c) against real
 * allocations and cudaMemGetInfo. Exits 77 (skipped) when built without CUDA or when the
 * process sees no GPU, after the checks that need no device (error classification and
 * messages) have passed.
 *
 * Tolerances, and why. u = 2^-24, float32's unit roundoff.
 *  - Exact (bit for bit): ops whose CUDA twin does cpu.c's float operations in cpu.c's order
 *    (ops.cu is built with -fmad=false so nothing is fused): zero, bias add, ReLU, residual,
 *    encoder forward and backward (the backward adds in (b,t) order on both), softmax
 *    cross-entropy's backward, argmax, scale, SGD.
 *  - 4 ulp: GELU and AdamW. The same operations too, with IEEE division and square root on
 *    both sides, so equality is expected; 4 ulp leaves room only for a libm pow() or a host
 *    compiler that differs between the two builds, and is printed when not 0.
 *  - Sums in another order (cuBLAS for matmuls, warp trees, two-stage column sums): each
 *    output is held against a reference computed in double, within a bound computed for that
 *    output from the absolute values of its terms: a float sum of K terms is off by at most
 *    about K u sum|terms| (Higham's gamma_K), so the bound is 2 (K+2) u sum|terms|, twice the
 *    worst case, plus a few u of the output for each rounding after the sum. Chains (layernorm,
 *    softmax, attention) propagate their inputs' bounds to first order. CPU and GPU are each
 *    held to the same bound, so each is checked, and their largest difference is printed.
 *    TF32 matmuls: the inputs lose 13 mantissa bits (relative 2^-10 each), so the bound adds
 *    2^-8 sum|terms|.
 *  - Deterministic: ops that sum are run twice on the GPU and must give the same bits.
 *
 * `test_gpu --fake-device` runs the op checks with the CPU table standing in for the device
 * (host memory): a check of this file's references and bounds on a machine without a GPU. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/engine.h"
#include "kernels/kernels.h"
#include "common/td_clock.h"
#include "common/td_panic.h"
#include "train/train.h"
#include "tests/train_support.h"

#ifdef TD_HAVE_CUDA
#include "kernels/cuda/cuda_internal.h"
#endif

#define U      (1.0 / 16777216.0) /* 2^-24 */
#define ULP4   (4.0 * 2.0 * U)    /* 4 ulp, relative */
#define TF32_U (1.0 / 256.0)      /* 2^-8: two TF32-rounded inputs of a product, twice */
/* bf16 keeps 8 significant bits (7 stored), so rounding to nearest even is off by at most
 * u_bf16 = 2^-8 relative, and a product of two rounded operands by at most
 * (1 + 2^-8)^2 - 1 = 2^-7 + 2^-16 of the exact product. */
#define BF16_U (1.0 / 128.0 + 1.0 / 65536.0)
#define MiB    ((size_t)1 << 20)

static const td_kernels *KC; /* the CPU twin */
static const td_kernels *KD; /* the backend under test */
static int fake;             /* --fake-device: KD is the CPU table in host memory */
static int tf32_on;          /* the current context allows TF32 */
static int bf16_on;          /* the current context's matmuls are bf16 mixed precision */

/* ---- random data ---------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float urand(float lo, float hi)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)(rng_state >> 40) / 16777216.0f;
}

static float *rand_host(size_t n, float lo, float hi)
{
    float *p = malloc((n > 0 ? n : 1) * sizeof(float));

    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = urand(lo, hi);
    return p;
}

static float *copy_host(const float *src, size_t n)
{
    float *p = malloc((n > 0 ? n : 1) * sizeof(float));

    assert_non_null(p);
    memcpy(p, src, n * sizeof(float));
    return p;
}

static double *dbuf(size_t n)
{
    double *p = calloc(n > 0 ? n : 1, sizeof(double));

    assert_non_null(p);
    return p;
}

/* ---- the device, or its stand-in ------------------------------------------------------------ */

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;

    if (fake) {
        p = malloc(bytes > 0 ? bytes : 1);
        assert_non_null(p);
        return p;
    }
#ifdef TD_HAVE_CUDA
    td_error_t err = {0};
    if (td_cuda_alloc(&p, bytes, &err) != 0)
        fail_msg("%s", err.msg);
#endif
    return p;
}

static void dev_free(void *p)
{
    if (fake)
        free(p);
#ifdef TD_HAVE_CUDA
    else
        td_cuda_free(p);
#endif
}

static void dev_up(void *dst, const void *src, size_t bytes)
{
    if (fake)
        memcpy(dst, src, bytes);
#ifdef TD_HAVE_CUDA
    else
        td_cuda_upload(dst, src, bytes);
#endif
}

static void dev_down(void *dst, const void *src, size_t bytes)
{
    if (fake)
        memcpy(dst, src, bytes);
#ifdef TD_HAVE_CUDA
    else
        td_cuda_download(dst, src, bytes);
#endif
}

/* A device copy of n floats (or ints) of host memory. */
static float *to_dev(const float *h, size_t n)
{
    float *d = dev_alloc(n * sizeof(float));

    dev_up(d, h, n * sizeof(float));
    return d;
}

static int *ints_to_dev(const int *h, size_t n)
{
    int *d = dev_alloc(n * sizeof(int));

    dev_up(d, h, n * sizeof(int));
    return d;
}

/* A host copy of n device floats; caller frees. */
static float *to_host(const float *d, size_t n)
{
    float *h = malloc((n > 0 ? n : 1) * sizeof(float));

    assert_non_null(h);
    dev_down(h, d, n * sizeof(float));
    return h;
}

/* Runs body under a panic boundary of its own, so a CUDA error fails the test with its message
 * rather than aborting the run. A failed cmocka assertion inside body jumps out past the
 * boundary, so the thread's boundary stack is reset first (tests have no outer boundary). */
static void caught(void (*body)(void))
{
    td_boundary b;

    td__boundary_top = NULL;
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
#ifdef TD_HAVE_CUDA
        /* a test that failed half way may have left TF32 on */
        if (!fake && td_cuda_ctx_current() != NULL) {
            td_cuda_ctx_set_tf32(td_cuda_ctx_current(), 0);
            td_cuda_ctx_set_bf16(td_cuda_ctx_current(), 0);
        }
#endif
        tf32_on = 0;
        bf16_on = 0;
        body();
        td_boundary_leave(&b);
        return;
    }
    fail_msg("panic: %s: %s", td_errname(b.err.code), b.err.msg);
}

/* ---- comparisons ------------------------------------------------------------------------------
 */

static int both_nan(float a, float b)
{
    return isnan(a) && isnan(b);
}

/* got must equal want bit for bit (two NaNs count as equal: their payloads may differ). */
static void check_exact(const char *what, const float *got, const float *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0 && !both_nan(got[i], want[i]))
            fail_msg("%s[%zu]: %.9g, the CPU %.9g (must be bit-identical)", what, i, got[i],
                     want[i]);
    print_message("  %-28s %8zu values, bit-identical\n", what, n);
}

/* |got - want| <= rel |want|, both NaN allowed; prints how many differ at all. */
static void check_ulps(const char *what, const float *got, const float *want, size_t n, double rel)
{
    size_t differ = 0;
    double worst = 0.0;

    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        if (both_nan(got[i], want[i]) || got[i] == want[i])
            continue;
        differ++;
        if (!(d <= rel * fabs((double)want[i])))
            fail_msg("%s[%zu]: %.9g, the CPU %.9g (tolerance %.2g relative)", what, i, got[i],
                     want[i], rel);
        worst = fmax(worst, d / fabs((double)want[i]));
    }
    print_message("  %-28s %8zu values, %zu not bit-identical (largest %.2g relative)\n", what, n,
                  differ, worst);
}

/* |got[i] - ref[i]| <= bound[i] for the backend under test, and for the CPU's values too;
 * prints the largest error as a fraction of its bound and the largest GPU-CPU difference. */
static void check_bound(const char *what, const float *got, const float *cpu, const double *ref,
                        const double *bound, size_t n)
{
    double worst = 0.0, worst_cpu = 0.0, gap = 0.0;

    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]), ec = fabs((double)cpu[i] - ref[i]);
        if (!(e <= bound[i]))
            fail_msg("%s[%zu]: %.9g, the reference %.12g, off by %.3g > bound %.3g (the CPU: "
                     "%.9g)",
                     what, i, got[i], ref[i], e, bound[i], cpu[i]);
        if (!(ec <= bound[i]))
            fail_msg("%s[%zu]: the CPU's %.9g, the reference %.12g, off by %.3g > bound %.3g", what,
                     i, cpu[i], ref[i], ec, bound[i]);
        if (bound[i] > 0) {
            worst = fmax(worst, e / bound[i]);
            worst_cpu = fmax(worst_cpu, ec / bound[i]);
        }
        gap = fmax(gap, fabs((double)got[i] - cpu[i]));
    }
    print_message("  %-28s %8zu values, error <= %.2f of the bound (CPU %.2f), |gpu-cpu| <= %.3g\n",
                  what, n, worst, worst_cpu, gap);
}

/* A stored gradient (kernels.h's store) into a buffer of NaN against the same call storing
 * nothing into zeros: the same values (the sign of a zero aside: beta 0 never adds the +0; NaN
 * where the inputs make the gradient NaN). */
static void check_stored(const char *what, const float *stored, const float *added, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!(stored[i] == added[i]) && !both_nan(stored[i], added[i]))
            fail_msg("%s[%zu]: %.9g stored, %.9g added into zeros", what, i, stored[i], added[i]);
    print_message("  %-28s %8zu values, as added into zeros\n", what, n);
}

/* n floats of the device = NaN */
static void dev_nan(float *d, size_t n)
{
    float *h = malloc(n * sizeof(float));

    assert_non_null(h);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    dev_up(d, h, n * sizeof(float));
    free(h);
}

/* Two device results of the same call must have the same bits. */
static void check_same_bits(const char *what, const float *a, const float *b, size_t n)
{
    if (memcmp(a, b, n * sizeof(float)) != 0)
        fail_msg("%s: two runs of the same call differ", what);
}

/* |got[i] - ref[i]| <= bound[i] for the backend under test only (a reference the CPU's fp32
 * values are not meant to meet: the bf16-rounded operands' own product). */
static void check_bound_dev(const char *what, const float *got, const double *ref,
                            const double *bound, size_t n)
{
    double worst = 0.0;

    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]);
        if (!(e <= bound[i]))
            fail_msg("%s[%zu]: %.9g, the reference %.12g, off by %.3g > bound %.3g", what, i,
                     got[i], ref[i], e, bound[i]);
        if (bound[i] > 0)
            worst = fmax(worst, e / bound[i]);
    }
    print_message("  %-28s %8zu values, error <= %.2f of the bound\n", what, n, worst);
}

/* f rounded to bf16, to nearest even (NaN kept; beyond bf16's range it becomes Inf), as
 * __float2bfloat16_rn does: the host's model of what ops.cu's bf16 path multiplies. */
static double bf16r(float f)
{
    uint32_t u;

    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* With bf16 on (a real device), each matmul output is checked twice:
 *  - against the exact product of the fp32 operands (ref, in double), within
 *    (BF16_U + 2 (K+2) u) sum|terms|: each term's operands rounded to bf16 move it by at most
 *    BF16_U of itself (rigorous, whatever K), and cuBLAS's fp32 sum of K terms adds the fp32
 *    bound used everywhere here. The CPU (fp32) meets it too. Relative to the output, whose
 *    size for random signs is about sqrt(K) times a term's, this is about 2^-7 sqrt(K): the
 *    "2^-8 sqrt(K)" of a bf16 dot product, held as a worst case, not a probable one;
 *  - against the product of the bf16-rounded operands (rref: each operand put through bf16r)
 *    within 2 (K+2) u sum|rounded terms|: only fp32 sums remain. This one is sharp: it fails
 *    for a wrong rounding (truncation instead of nearest even), for an operand not rounded at
 *    all (the fp32 path taken), and for any chunk read from or written to the wrong place.
 * The bias and dbias stay fp32 (dbias a gemv of fp32 operands, TF32 at most). */

/* ---- matmul -----------------------------------------------------------------------------------
 */

/* The precision a matmul check holds the backend to: TF32's or bf16's extra, or none. */
static double matmul_extra(void)
{
    return tf32_on ? TF32_U : bf16_on ? BF16_U : 0.0;
}

/* A sharp check of the bf16-rounded operands' product is made on a real device with bf16 on. */
static int bf16_sharp(void)
{
    return bf16_on && !fake;
}

static const char *prec_name(void)
{
    return tf32_on ? " tf32" : bf16_on ? " bf16" : "";
}

/* out = inp . w^T + bias against double, with and without a bias. */
static void matmul_forward_case(int N, int C, int OC)
{
    float *inp = rand_host((size_t)N * C, -1, 1), *w = rand_host((size_t)OC * C, -1, 1);
    float *bias = rand_host(OC, -1, 1), *cpu = rand_host((size_t)N * OC, -1, 1);
    float *d_inp = to_dev(inp, (size_t)N * C), *d_w = to_dev(w, (size_t)OC * C);
    float *d_bias = to_dev(bias, OC), *d_out = dev_alloc((size_t)N * OC * sizeof(float));
    double *ref = dbuf((size_t)N * OC), *bound = dbuf((size_t)N * OC);
    double *rref = NULL, *rbound = NULL, *rw = NULL, *ri = NULL, extra = matmul_extra();
    char what[80];

    if (bf16_sharp()) {
        rref = dbuf((size_t)N * OC), rbound = dbuf((size_t)N * OC);
        rw = dbuf((size_t)OC * C), ri = dbuf((size_t)N * C);
        for (size_t i = 0; i < (size_t)OC * C; i++)
            rw[i] = bf16r(w[i]);
        for (size_t i = 0; i < (size_t)N * C; i++)
            ri[i] = bf16r(inp[i]);
    }
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        float *got;
        KC->matmul_forward(cpu, inp, w, with_bias ? bias : NULL, N, C, OC);
        KD->matmul_forward(d_out, d_inp, d_w, with_bias ? d_bias : NULL, N, C, OC);
        got = to_host(d_out, (size_t)N * OC);
        for (int i = 0; i < N; i++)
            for (int o = 0; o < OC; o++) {
                double s = with_bias ? bias[o] : 0.0, a = with_bias ? fabs(bias[o]) : 0.0;
                double rs = s, ra = a;
                const float *x = inp + (size_t)i * C, *wr = w + (size_t)o * C;
                for (int c = 0; c < C; c++) {
                    double t = (double)x[c] * wr[c];
                    s += t;
                    a += fabs(t);
                }
                ref[(size_t)i * OC + o] = s;
                bound[(size_t)i * OC + o] = (2.0 * (C + 2) * U + extra) * a;
                if (rref != NULL) {
                    const double *rx = ri + (size_t)i * C, *rwr = rw + (size_t)o * C;
                    for (int c = 0; c < C; c++) {
                        double t = rx[c] * rwr[c];
                        rs += t;
                        ra += fabs(t);
                    }
                    rref[(size_t)i * OC + o] = rs;
                    rbound[(size_t)i * OC + o] = 2.0 * (C + 2) * U * ra;
                }
            }
        snprintf(what, sizeof(what), "matmul fwd %dx%dx%d%s%s", N, C, OC, with_bias ? " +b" : "",
                 prec_name());
        check_bound(what, got, cpu, ref, bound, (size_t)N * OC);
        if (rref != NULL) {
            snprintf(what, sizeof(what), "  .. of bf16 operands%s", with_bias ? " +b" : "");
            check_bound_dev(what, got, rref, rbound, (size_t)N * OC);
        }
        free(got);
    }
    free(inp), free(w), free(bias), free(cpu), free(ref), free(bound);
    free(rref), free(rbound), free(rw), free(ri);
    dev_free(d_inp), dev_free(d_w), dev_free(d_bias), dev_free(d_out);
}

/* ref[r*cols + c] = acc0[..] + sum over k of A(r,k) B(k,c) in double, and bound = (2(K+2)u +
 * extra) sum|terms| (|acc0| included), where A(r,k) = a[r*as + k*ak] and B(k,c) = b[k*bs +
 * c*bc]: the three backward products as one loop nest. */
static void ref_product(double *ref, double *bound, const float *acc0, const double *a, size_t as,
                        size_t ak, const double *b, size_t bs, size_t bc, int rows, int cols, int K,
                        double extra)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            double s = acc0[(size_t)r * cols + c], sa = fabs(s);
            for (int k = 0; k < K; k++) {
                double t = a[r * as + k * ak] * b[k * bs + c * bc];
                s += t;
                sa += fabs(t);
            }
            ref[(size_t)r * cols + c] = s;
            bound[(size_t)r * cols + c] = (2.0 * (K + 2) * U + extra) * sa;
        }
}

/* n floats as doubles, put through bf16r when round is set */
static double *widen(const float *p, size_t n, int round)
{
    double *d = dbuf(n);

    for (size_t i = 0; i < n; i++)
        d[i] = round ? bf16r(p[i]) : p[i];
    return d;
}

/* One backward product's checks: against the fp32 operands (the CPU too) and, with bf16 on a
 * device, against the bf16-rounded operands. */
static void backward_check(const char *name, int N, int C, int OC, const float *got,
                           const float *cpu, const float *acc0, const double *a, const double *ra,
                           size_t as, size_t ak, const double *b, const double *rb, size_t bs,
                           size_t bc, int rows, int cols, int K)
{
    size_t n = (size_t)rows * cols;
    double *ref = dbuf(n), *bound = dbuf(n);
    char what[80];

    ref_product(ref, bound, acc0, a, as, ak, b, bs, bc, rows, cols, K, matmul_extra());
    snprintf(what, sizeof(what), "matmul %s %dx%dx%d%s", name, N, C, OC, prec_name());
    check_bound(what, got, cpu, ref, bound, n);
    if (bf16_sharp()) {
        ref_product(ref, bound, acc0, ra, as, ak, rb, bs, bc, rows, cols, K, 0.0);
        check_bound_dev("  .. of bf16 operands", got, ref, bound, n);
    }
    free(ref), free(bound);
}

/* The three backward products, each accumulated into random values (kernels accumulate). */
static void matmul_backward_case(int N, int C, int OC)
{
    float *inp = rand_host((size_t)N * C, -1, 1), *w = rand_host((size_t)OC * C, -1, 1);
    float *dout = rand_host((size_t)N * OC, -1, 1);
    float *dinp0 = rand_host((size_t)N * C, -1, 1), *dw0 = rand_host((size_t)OC * C, -1, 1);
    float *db0 = rand_host(OC, -1, 1);
    float *dinp = copy_host(dinp0, (size_t)N * C), *dw = copy_host(dw0, (size_t)OC * C);
    float *db = copy_host(db0, OC);
    float *d_inp = to_dev(inp, (size_t)N * C), *d_w = to_dev(w, (size_t)OC * C);
    float *d_dout = to_dev(dout, (size_t)N * OC), *d_dinp = to_dev(dinp0, (size_t)N * C);
    float *d_dw = to_dev(dw0, (size_t)OC * C), *d_db = to_dev(db0, OC), *g;
    int sharp = bf16_sharp();
    double *x = widen(inp, (size_t)N * C, 0), *wd = widen(w, (size_t)OC * C, 0);
    double *dd = widen(dout, (size_t)N * OC, 0);
    double *rx = sharp ? widen(inp, (size_t)N * C, 1) : NULL;
    double *rw = sharp ? widen(w, (size_t)OC * C, 1) : NULL;
    double *rd = sharp ? widen(dout, (size_t)N * OC, 1) : NULL;
    /* dbias is a gemv in fp32 operands; TF32's allowance where the context's math mode allows
     * TF32 (tf32, and bf16, which lets attention's fp32 gemms use it), as for any Sgemm* */
    double *ref = dbuf(OC), *bound = dbuf(OC), extra = tf32_on || bf16_on ? TF32_U : 0.0;

    KC->matmul_backward(dinp, dw, db, dout, inp, w, N, C, OC, 0);
    KD->matmul_backward(d_dinp, d_dw, d_db, d_dout, d_inp, d_w, N, C, OC, 0);

    /* dinp(i,c) = dinp0 + sum over o of dout(i,o) w(o,c) */
    g = to_host(d_dinp, (size_t)N * C);
    backward_check("dinp", N, C, OC, g, dinp, dinp0, dd, rd, (size_t)OC, 1, wd, rw, (size_t)C, 1, N,
                   C, OC);
    free(g);

    /* dweight(o,c) = dw0 + sum over i of dout(i,o) inp(i,c) */
    g = to_host(d_dw, (size_t)OC * C);
    backward_check("dweight", N, C, OC, g, dw, dw0, dd, rd, 1, (size_t)OC, x, rx, (size_t)C, 1, OC,
                   C, N);
    free(g);

    /* dbias: fp32 operands whatever the matmuls' precision */
    for (int o = 0; o < OC; o++) {
        double s = db0[o], a = fabs(s);
        for (int i = 0; i < N; i++) {
            s += dout[(size_t)i * OC + o];
            a += fabs(dout[(size_t)i * OC + o]);
        }
        ref[o] = s;
        bound[o] = (2.0 * (N + 2) * U + extra) * a;
    }
    g = to_host(d_db, OC);
    check_bound("matmul dbias", g, db, ref, bound, OC);
    free(g);

    /* NULL outputs are skipped: only dweight, then only dbias; dinp must not move, nor dbias
     * the first time */
    {
        float *before = to_host(d_dinp, (size_t)N * C);
        KD->matmul_backward(NULL, d_dw, NULL, d_dout, d_inp, d_w, N, C, OC, 0);
        g = to_host(d_db, OC);
        check_exact("matmul dbias untouched", g, db, OC);
        free(g);
        KD->matmul_backward(NULL, NULL, d_db, d_dout, d_inp, d_w, N, C, OC, 0);
        g = to_host(d_dinp, (size_t)N * C);
        check_exact("matmul dinp untouched", g, before, (size_t)N * C);
        free(g);
        free(before);
    }

    /* dinp stored (beta 0, the first chunk of OC in bf16) over NaN, as added into zeros */
    {
        float *added;
        KD->zero(d_dinp, (size_t)N * C);
        KD->matmul_backward(d_dinp, NULL, NULL, d_dout, d_inp, d_w, N, C, OC, 0);
        added = to_host(d_dinp, (size_t)N * C);
        dev_nan(d_dinp, (size_t)N * C);
        KD->matmul_backward(d_dinp, NULL, NULL, d_dout, d_inp, d_w, N, C, OC, TD_STORE_1);
        g = to_host(d_dinp, (size_t)N * C);
        check_stored("matmul dinp stored", g, added, (size_t)N * C);
        free(g), free(added);
    }

    free(inp), free(w), free(dout), free(dinp0), free(dw0), free(db0), free(dinp), free(dw),
        free(db), free(ref), free(bound);
    free(x), free(wd), free(dd), free(rx), free(rw), free(rd);
    dev_free(d_inp), dev_free(d_w), dev_free(d_dout), dev_free(d_dinp), dev_free(d_dw),
        dev_free(d_db);
}

static void body_matmul(void)
{
    matmul_forward_case(67, 100, 45);
    matmul_backward_case(67, 100, 45);
    matmul_forward_case(256, 768, 2304); /* GPT-2's qkv shape, 256 rows */
    matmul_backward_case(256, 768, 2304);
}

/* The same products with TF32 allowed, held to the TF32 bound. */
static void body_matmul_tf32(void)
{
#ifdef TD_HAVE_CUDA
    if (!fake) {
        td_cuda_ctx_set_tf32(td_cuda_ctx_current(), 1);
        tf32_on = 1;
    }
#endif
    matmul_forward_case(256, 768, 2304);
    matmul_backward_case(256, 768, 2304);
#ifdef TD_HAVE_CUDA
    if (!fake) {
        td_cuda_ctx_set_tf32(td_cuda_ctx_current(), 0);
        tf32_on = 0;
    }
#endif
}

/* The same products in bf16 mixed precision (td_cuda_ctx_set_bf16), each held to the bf16
 * bound against the fp32 operands and to the fp32 bound against the bf16-rounded ones (see
 * check_bound_dev's comment). GPT-2's tied lm head (OC = 50304, C = 768, a weight of 74 MiB in
 * bf16) is cut over OC by the default 64 MiB scratch; a context with 1 MiB of scratch cuts a
 * small product over rows and columns at once. On --fake-device (the CPU, fp32) only the first
 * bound applies, and holds. */
static void body_matmul_bf16(void)
{
#ifdef TD_HAVE_CUDA
    td_cuda_ctx *main = NULL, *small = NULL;
    td_cuda_options opt;
    td_error_t err = {0};

    if (!fake) {
        main = td_cuda_ctx_current();
        td_cuda_ctx_set_bf16(main, 1);
        assert_int_equal(td_cuda_ctx_bf16(main), 1);
    }
#endif
    bf16_on = 1;
    matmul_forward_case(67, 100, 45);
    matmul_backward_case(67, 100, 45);
    matmul_forward_case(256, 768, 2304); /* GPT-2's qkv, 256 rows */
    matmul_backward_case(256, 768, 2304);
    matmul_forward_case(32, 768, 50304); /* the lm head: 3 chunks of OC */
    matmul_backward_case(32, 768, 50304);
#ifdef TD_HAVE_CUDA
    if (!fake) {
        /* 1 MiB of scratch: the weight (1000x768) in 4 chunks of 320 rows, and inp's 700 rows in
         * 2 chunks (forward) and 3 (backward) */
        td_cuda_options_defaults(&opt);
        opt.bf16 = 1;
        opt.scratch_bytes = MiB;
        if (td_cuda_ctx_new(&small, td_cuda_ctx_device(main), &opt, &err) != 0)
            fail_msg("%s", err.msg);
        assert_int_equal(td_cuda_ctx_bf16(small), 1);
        matmul_forward_case(700, 768, 1000);
        matmul_backward_case(700, 768, 1000);
        td_cuda_ctx_free(small);
        if (td_cuda_ctx_bind(main, &err) != 0)
            fail_msg("%s", err.msg);
        td_cuda_ctx_set_bf16(main, 0);
        assert_int_equal(td_cuda_ctx_bf16(main), 0);
    }
#endif
    bf16_on = 0;
}

/* ---- the table's memory ops ------------------------------------------------------------------ */

/* host, alloc (256-byte aligned), upload and download (a round trip, and a download that must
 * see an op queued before it), free (NULL too), and an allocation too large for any device:
 * an error naming the size, *p NULL, the process not poisoned. */
static void body_memory_ops(void)
{
    size_t n = 1000003;
    float *h = rand_host(n, -1, 1), *back = malloc(n * sizeof(float)), *d = NULL;
    void *huge = (void *)1;
    td_error_t err = {0};

    assert_non_null(back);
    if (!fake) {
        assert_int_equal(KD->host, 0);
        assert_string_equal(KD->name, "cuda");
    }
    assert_int_equal(KD->alloc((void **)&d, n * sizeof(float), &err), 0);
    assert_non_null(d);
    assert_int_equal((uintptr_t)d % 256, 0);
    KD->upload(d, h, n * sizeof(float));
    KD->download(back, d, n * sizeof(float));
    check_exact("upload, download", back, h, n);
    KD->scale(d, 2.0f, n); /* queued; the download must come after it */
    KD->download(back, d, n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        h[i] *= 2.0f;
    check_exact("download after an op", back, h, n);
    KD->free(d);
    KD->free(NULL);
    if (!fake) {
        int rc = KD->alloc(&huge, (size_t)1 << 50, &err);
        print_message("  alloc of 1 PiB: %s\n", err.msg);
        assert_int_equal(rc, TD_ECUDA);
        assert_null(huge);
        assert_non_null(strstr(err.msg, "1125899906842624"));
#ifdef TD_HAVE_CUDA
        assert_false(td_cuda_poisoned());
#endif
    }
    free(h), free(back);
}

/* ---- bias, ReLU, residual, GELU, scale, zero ------------------------------------------------ */

#define NE 100003 /* elements of the elementwise checks: not a multiple of any block */
/* Elements of the grid-stride checks: more than blocks_for's cap (32 blocks of 256 threads per
 * SM, ops.cu and heads.cu) on any GPU of up to 1536 SMs, so every thread of a grid-stride
 * kernel goes round its loop more than once and the last lap is partial. */
#define WRAP_N (((size_t)3 << 22) + 5)
/* Rows of the bias gradient's wrap check: past two of sum_rows' gemv chunks of TD_CUDA_ONES
 * (65536) rows, the last one partial. */
#define BIAS_ROWS (2 * 65536 + 1001)

/* bias, ReLU, residual, GELU, scale and zero over n elements, the bias ops over (N,C), N*C <= n */
static void elementwise_case(size_t n, int N, int C)
{
    float *a = rand_host(n, -3, 3), *b = rand_host(n, -1, 1), *g0 = rand_host(n, -1, 1);
    float *bias = rand_host(C, -1, 1), *cpu = copy_host(g0, n), *cpu2 = copy_host(g0, n), *h;
    float *d_a, *d_b, *d_g, *d_g2, *d_bias = to_dev(bias, C), *d_out;

    a[0] = NAN, a[1] = -0.0f, a[2] = 0.0f, a[3] = INFINITY, a[4] = -INFINITY;
    a[5] = 12.0f, a[6] = -12.0f, a[7] = 90.0f, a[8] = -90.0f; /* past fexp's clamps */
    print_message("  elementwise: %zu elements, bias (%d,%d)\n", n, N, C);
    d_a = to_dev(a, n), d_b = to_dev(b, n), d_g = to_dev(g0, n), d_g2 = to_dev(g0, n);
    d_out = dev_alloc(n * sizeof(float));

    KC->bias_forward(cpu, a, bias, N, C);
    KD->bias_forward(d_out, d_a, d_bias, N, C);
    h = to_host(d_out, (size_t)N * C);
    check_exact("bias fwd", h, cpu, (size_t)N * C);
    free(h);
    KD->bias_forward(d_out, d_out, d_bias, N, C); /* in place */
    KC->bias_forward(cpu, cpu, bias, N, C);
    h = to_host(d_out, (size_t)N * C);
    check_exact("bias fwd in place", h, cpu, (size_t)N * C);
    free(h);

    KC->relu_forward(cpu, a, n);
    KD->relu_forward(d_out, d_a, n);
    h = to_host(d_out, n);
    check_exact("relu fwd", h, cpu, n);
    free(h);
    memcpy(cpu2, g0, n * sizeof(float));
    KC->relu_backward(cpu2, b, cpu, n);
    KD->relu_backward(d_g, d_b, d_out, n);
    h = to_host(d_g, n);
    check_exact("relu bwd", h, cpu2, n);
    free(h);

    KC->residual_forward(cpu, a, b, n);
    KD->residual_forward(d_out, d_a, d_b, n);
    h = to_host(d_out, n);
    check_exact("residual fwd", h, cpu, n);
    free(h);
    memcpy(cpu, g0, n * sizeof(float));
    memcpy(cpu2, g0, n * sizeof(float));
    dev_up(d_g, g0, n * sizeof(float));
    dev_up(d_g2, g0, n * sizeof(float));
    KC->residual_backward(cpu, cpu2, b, n, 0);
    KD->residual_backward(d_g, d_g2, d_b, n, 0);
    KD->residual_backward(NULL, d_g2, d_b, n, 0);
    KC->residual_backward(NULL, cpu2, b, n, 0);
    h = to_host(d_g, n);
    check_exact("residual bwd dinp1", h, cpu, n);
    free(h);
    h = to_host(d_g2, n);
    check_exact("residual bwd dinp2", h, cpu2, n);
    free(h);
    /* stored: dinp1 over NaN, dinp2 added onto g0; then the other way round */
    for (int st = TD_STORE_1; st <= TD_STORE_2; st <<= 1) {
        float *nan1 = st == TD_STORE_1 ? d_g : d_g2, *add1 = st == TD_STORE_1 ? d_g2 : d_g;
        float *cs = st == TD_STORE_1 ? cpu : cpu2, *ca = st == TD_STORE_1 ? cpu2 : cpu;
        for (size_t i = 0; i < n; i++)
            cs[i] = NAN, ca[i] = g0[i];
        dev_nan(nan1, n);
        dev_up(add1, g0, n * sizeof(float));
        KC->residual_backward(cpu, cpu2, b, n, st);
        KD->residual_backward(d_g, d_g2, d_b, n, st);
        h = to_host(nan1, n);
        check_exact(st == TD_STORE_1 ? "residual bwd dinp1 stored" : "residual bwd dinp2 stored", h,
                    cs, n);
        for (size_t i = 0; i < n; i++)
            if (!(h[i] == b[i]))
                fail_msg("residual stored [%zu]: %.9g, dout %.9g", i, h[i], b[i]);
        free(h);
        h = to_host(add1, n);
        check_exact("residual bwd, the other added", h, ca, n);
        free(h);
    }

    memcpy(cpu, g0, n * sizeof(float));
    dev_up(d_g, g0, n * sizeof(float));
    dev_up(d_g2, g0, C * sizeof(float));
    memcpy(cpu2, g0, C * sizeof(float));
    KC->bias_backward(cpu, cpu2, b, N, C);
    KD->bias_backward(d_g, d_g2, d_b, N, C);
    h = to_host(d_g, (size_t)N * C);
    check_exact("bias bwd dinp", h, cpu, (size_t)N * C);
    free(h);
    {
        double *ref = dbuf(C), *bound = dbuf(C);
        for (int c = 0; c < C; c++) {
            double s = g0[c], ab = fabs(s);
            for (int i = 0; i < N; i++)
                s += b[(size_t)i * C + c], ab += fabs(b[(size_t)i * C + c]);
            ref[c] = s;
            bound[c] = 2.0 * (N + 2) * U * ab;
        }
        h = to_host(d_g2, C);
        check_bound("bias bwd dbias", h, cpu2, ref, bound, C);
        free(h), free(ref), free(bound);
    }

    KC->gelu_forward(cpu, a, n);
    KD->gelu_forward(d_out, d_a, n);
    h = to_host(d_out, n);
    check_ulps("gelu fwd", h, cpu, n, ULP4);
    free(h);
    memcpy(cpu, g0, n * sizeof(float));
    dev_up(d_g, g0, n * sizeof(float));
    KC->gelu_backward(cpu, a, b, n, 0);
    KD->gelu_backward(d_g, d_a, d_b, n, 0);
    h = to_host(d_g, n);
    check_ulps("gelu bwd", h, cpu, n, ULP4);
    free(h);
    {
        float *added;
        KD->zero(d_g, n);
        KD->gelu_backward(d_g, d_a, d_b, n, 0);
        added = to_host(d_g, n);
        dev_nan(d_g, n);
        KD->gelu_backward(d_g, d_a, d_b, n, TD_STORE_1);
        h = to_host(d_g, n);
        check_stored("gelu bwd stored", h, added, n);
        free(h), free(added);
    }

    memcpy(cpu, a, n * sizeof(float));
    KC->scale(cpu, 0.37f, n);
    KD->scale(d_a, 0.37f, n);
    h = to_host(d_a, n);
    check_exact("scale", h, cpu, n);
    free(h);

    KD->zero(d_a, n);
    memset(cpu, 0, n * sizeof(float));
    h = to_host(d_a, n);
    check_exact("zero", h, cpu, n);
    free(h);
    KD->set_threads(4); /* nothing to check: the CPU's thread count means nothing here */

    free(a), free(b), free(g0), free(bias), free(cpu), free(cpu2);
    dev_free(d_a), dev_free(d_b), dev_free(d_g), dev_free(d_g2), dev_free(d_bias), dev_free(d_out);
}

/* The small case (several blocks, a partial last one), then the grid-stride wrap-around and the
 * bias gradient's 65536-row chunks. */
static void body_elementwise(void)
{
    elementwise_case(NE, 1009, 97);
    elementwise_case(WRAP_N, BIAS_ROWS, 48);
}

/* ---- softmax cross-entropy, argmax ----------------------------------------------------------- */

/* probs within (8 + |x - max| + r) u of the reference, relative, twice: expf (GPU 2 ulp, glibc
 * 1), the float x - max (u |x - max| relative after exp), the row's sum (r: the exp-weighted
 * mean of |x - max| over the row), the reciprocal and the product; the loss
 * within (4 + range) u + u |loss|, twice: the row's log of a sum whose terms carry those
 * errors, the rows summed in double. The backward from the same probs is exact. */
static void softmax_case(int N, int V, int Vp)
{
    size_t n = (size_t)N * Vp;
    float *logits = rand_host(n, -5, 5), *probs = rand_host(n, -1, 1), *g0 = rand_host(n, -1, 1);
    float *dl = copy_host(g0, n), loss = 0.0f, gloss[2], dloss = 1.7f, *h;
    int *targets = malloc((size_t)N * sizeof(int));
    float *d_logits, *d_probs = dev_alloc(n * sizeof(float)), *d_loss = dev_alloc(sizeof(float));
    float *d_dl = to_dev(g0, n), *d_dloss = to_dev(&dloss, 1), *d_cpu_probs;
    int *d_targets;
    double *ref = dbuf(n), *bound = dbuf(n), lref = 0.0, lbound = 0.0;
    char what[64];

    assert_non_null(targets);
    for (int i = 0; i < N; i++)
        targets[i] = (int)(urand(0, 1) * V) % V;
    d_logits = to_dev(logits, n);
    d_targets = ints_to_dev(targets, N);

    KC->softmax_xent_forward(&loss, probs, logits, targets, N, V, Vp);
    KD->softmax_xent_forward(d_loss, d_probs, d_logits, d_targets, N, V, Vp);
    dev_down(&gloss[0], d_loss, sizeof(float));
    KD->softmax_xent_forward(d_loss, d_probs, d_logits, d_targets, N, V, Vp);
    dev_down(&gloss[1], d_loss, sizeof(float));
    check_same_bits("softmax loss, twice", &gloss[0], &gloss[1], 1);

    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        double mx = x[0], mn = x[0], z = 0.0;
        for (int j = 0; j < V; j++)
            mx = fmax(mx, x[j]), mn = fmin(mn, x[j]);
        double r = 0.0; /* the exp-weighted mean of |x - max|: the sum's share of the error */
        for (int j = 0; j < V; j++)
            z += exp((double)x[j] - mx), r += exp((double)x[j] - mx) * (mx - x[j]);
        r /= z;
        for (int j = 0; j < Vp; j++) {
            double p = j < V ? exp((double)x[j] - mx) / z : 0.0;
            ref[(size_t)i * Vp + j] = p;
            bound[(size_t)i * Vp + j] = 2.0 * (8.0 + fabs((double)x[j] - mx) + r) * U * p;
        }
        lref += log(z) - ((double)x[targets[i]] - mx);
        lbound += 2.0 * (4.0 + (mx - mn)) * U;
    }
    lref /= N;
    lbound = lbound / N + 2.0 * U * fabs(lref);
    h = to_host(d_probs, n);
    snprintf(what, sizeof(what), "softmax probs %dx%d/%d", N, V, Vp);
    check_bound(what, h, probs, ref, bound, n);
    free(h);
    check_bound("softmax loss", &gloss[0], &loss, &lref, &lbound, 1);

    /* the backward from the CPU's probs on both sides, so it alone is compared */
    d_cpu_probs = to_dev(probs, n);
    KC->softmax_xent_backward(dl, &dloss, probs, targets, N, V, Vp);
    KD->softmax_xent_backward(d_dl, d_dloss, d_cpu_probs, d_targets, N, V, Vp);
    h = to_host(d_dl, n);
    check_exact("softmax bwd (padding kept)", h, dl, n);
    free(h);

    /* The fused classifier: the unfused kernel's arithmetic, so its loss has gloss[0]'s bits
     * (eval, logits untouched, and training alike); dlogits = (p - onehot)/N within the probs'
     * bound over N plus the subtraction's and the scale's rounding (2 u |ref|), padding 0 on
     * both sides exactly (bound 0). */
    {
        float *cf = copy_host(logits, n), fl = 0.0f, gf[2];
        float *d_f = to_dev(logits, n);

        KD->softmax_xent_fused(d_loss, d_f, d_targets, N, V, Vp, 0);
        dev_down(&gf[0], d_loss, sizeof(float));
        h = to_host(d_f, n);
        check_exact("fused eval leaves logits", h, logits, n);
        free(h);
        KD->softmax_xent_fused(d_loss, d_f, d_targets, N, V, Vp, 1);
        dev_down(&gf[1], d_loss, sizeof(float));
        check_same_bits("fused loss (eval)", &gf[0], &gloss[0], 1);
        check_same_bits("fused loss (train)", &gf[1], &gloss[0], 1);
        KC->softmax_xent_fused(&fl, cf, targets, N, V, Vp, 1);
        assert_true(fl == loss);
        for (int i = 0; i < N; i++)
            for (int j = 0; j < Vp; j++) {
                size_t k = (size_t)i * Vp + j;
                double r = (ref[k] - (j == targets[i] ? 1.0 : 0.0)) / N;
                bound[k] = j < V ? bound[k] / N + 2.0 * U * fabs(r) : 0.0;
                ref[k] = j < V ? r : 0.0;
            }
        h = to_host(d_f, n);
        snprintf(what, sizeof(what), "fused dlogits %dx%d/%d", N, V, Vp);
        check_bound(what, h, cf, ref, bound, n);
        free(h), free(cf);
        dev_free(d_f);
    }

    free(logits), free(probs), free(g0), free(dl), free(targets), free(ref), free(bound);
    dev_free(d_logits), dev_free(d_probs), dev_free(d_loss), dev_free(d_dl), dev_free(d_dloss),
        dev_free(d_cpu_probs), dev_free(d_targets);
}

/* A target outside [0,V) gives a NaN loss on the GPU (the CPU would read out of bounds). */
static void softmax_bad_target(void)
{
    float logits[8] = {1, 2, 3, 4, 5, 6, 7, 8}, loss = 0.0f;
    int targets[2] = {1, 9};
    float *d_logits = to_dev(logits, 8), *d_probs = dev_alloc(8 * sizeof(float));
    float *d_loss = dev_alloc(sizeof(float));
    int *d_targets = ints_to_dev(targets, 2);

    KD->softmax_xent_forward(d_loss, d_probs, d_logits, d_targets, 2, 4, 4);
    dev_down(&loss, d_loss, sizeof(float));
    assert_true(isnan(loss));
    dev_free(d_logits), dev_free(d_probs), dev_free(d_loss), dev_free(d_targets);
}

static void body_softmax(void)
{
    softmax_case(67, 1000, 1024);
    softmax_case(33, 50257, 50304); /* GPT-2's padded vocabulary */
    /* more rows than the kernel's TD_CUDA_REDUCE_BLOCKS (1024) blocks: each block's loop takes
     * two or three rows, and its partial sum adds their losses in order */
    softmax_case(2500, 300, 320);
    if (!fake)
        softmax_bad_target();
}

/* argmax with ties (first wins), a NaN first logit (it wins), NaNs elsewhere (never win). */
static void argmax_case(int N, int V)
{
    float *x = rand_host((size_t)N * V, -1, 1), *d_x;
    int *targets = malloc((size_t)N * sizeof(int)), *d_t;
    int64_t cpu = -1, got = -1, *d_c = dev_alloc(sizeof(int64_t));

    assert_non_null(targets);
    for (int i = 0; i < N; i++) {
        float *r = x + (size_t)i * V;
        int k = (int)(urand(0, 1) * V) % V;
        targets[i] = i % 3 == 0 ? k : (int)(urand(0, 1) * V) % V;
        r[k] = 2.0f;
        if (i % 5 == 1)
            r[(k + 100) % V] = 2.0f, targets[i] = k < (k + 100) % V ? k : (k + 100) % V;
        if (i % 7 == 2)
            r[0] = NAN, targets[i] = 0;
        if (i % 11 == 3)
            r[(k + 7) % V] = NAN;
    }
    d_x = to_dev(x, (size_t)N * V);
    d_t = ints_to_dev(targets, N);
    KC->argmax_correct(&cpu, x, targets, N, V);
    KD->argmax_correct(d_c, d_x, d_t, N, V);
    dev_down(&got, d_c, sizeof(got));
    print_message("  %-28s %8d rows, %lld correct (CPU %lld)\n", "argmax", N, (long long)got,
                  (long long)cpu);
    assert_int_equal(got, cpu);
    assert_true(cpu > N / 3);
    free(x), free(targets);
    dev_free(d_x), dev_free(d_t), dev_free(d_c);
}

/* Then more rows than the kernel's 1024 blocks: each block's loop over rows goes round twice or
 * three times. */
static void body_argmax(void)
{
    argmax_case(300, 777);
    argmax_case(2500, 129);
}

/* ---- encoder ----------------------------------------------------------------------------------
 */

static void encoder_case(int B, int T, int C, int V, int maxT)
{
    size_t n = (size_t)B * T * C;
    float *wte = rand_host((size_t)V * C, -1, 1), *wpe = rand_host((size_t)maxT * C, -1, 1);
    float *dout = rand_host(n, -1, 1), *cpu = rand_host(n, -1, 1);
    float *dwte = rand_host((size_t)V * C, -1, 1), *dwpe = rand_host((size_t)maxT * C, -1, 1);
    int *tok = malloc((size_t)B * T * sizeof(int));
    float *d_wte = to_dev(wte, (size_t)V * C), *d_wpe = to_dev(wpe, (size_t)maxT * C);
    float *d_dout = to_dev(dout, n), *d_out = dev_alloc(n * sizeof(float));
    float *d_dwte = to_dev(dwte, (size_t)V * C), *d_dwpe = to_dev(dwpe, (size_t)maxT * C);
    float *d_dwte2 = to_dev(dwte, (size_t)V * C), *h, *h2;
    int *d_tok;

    assert_non_null(tok);
    for (int i = 0; i < B * T; i++)
        tok[i] = (int)(urand(0, 1) * V) % V;
    tok[0] = tok[1] = tok[B * T - 1]; /* a token seen several times */
    d_tok = ints_to_dev(tok, (size_t)B * T);

    KC->encoder_forward(cpu, tok, wte, wpe, B, T, C);
    KD->encoder_forward(d_out, d_tok, d_wte, d_wpe, B, T, C);
    h = to_host(d_out, n);
    check_exact("encoder fwd", h, cpu, n);
    free(h);

    KC->encoder_backward(dwte, dwpe, dout, tok, B, T, C);
    KD->encoder_backward(d_dwte, d_dwpe, d_dout, d_tok, B, T, C);
    KD->encoder_backward(d_dwte2, NULL, d_dout, d_tok, B, T, C);
    h = to_host(d_dwte, (size_t)V * C);
    h2 = to_host(d_dwte2, (size_t)V * C);
    check_exact("encoder bwd dwte", h, dwte, (size_t)V * C);
    check_same_bits("encoder bwd dwte, twice", h, h2, (size_t)V * C);
    free(h), free(h2);
    h = to_host(d_dwpe, (size_t)maxT * C);
    check_exact("encoder bwd dwpe", h, dwpe, (size_t)maxT * C);
    free(h);

    free(wte), free(wpe), free(dout), free(cpu), free(dwte), free(dwpe), free(tok);
    dev_free(d_wte), dev_free(d_wpe), dev_free(d_dout), dev_free(d_out), dev_free(d_dwte),
        dev_free(d_dwpe), dev_free(d_dwte2), dev_free(d_tok);
}

static void body_encoder(void)
{
    encoder_case(3, 37, 100, 50, 40);
    encoder_case(4, 256, 768, 50304, 1024);
    /* B*T = 1500 positions: the backward's loop over tiles of ID_TILE (1024) token ids takes
     * a whole tile, then a partial one */
    encoder_case(5, 300, 96, 1000, 320);
}

/* ---- layernorm --------------------------------------------------------------------------------
 */

/* Forward: the mean of C floats within 2(C+2)u sum|x|/C; rstd within 2(C+8)u relative (the
 * variance's sum of squares, each square's rounding, the square root and the reciprocal);
 * out within the effect of both plus 4u of its terms. Backward from the CPU's mean and rstd
 * (so it alone is compared): dinp's two row means of C terms within 2(C+4)u of their
 * sum|terms|, carried through; dweight and dbias, sums of N rows, within 2(N+4)u sum|terms|. */
static void layernorm_case(int N, int C)
{
    size_t n = (size_t)N * C;
    float *x = rand_host(n, 0.5f, 2.5f), *w = rand_host(C, -1, 1), *b = rand_host(C, -1, 1);
    float *dout = rand_host(n, -1, 1), *out = rand_host(n, -1, 1);
    float *mean = rand_host(N, -1, 1), *rstd = rand_host(N, -1, 1), *g0 = rand_host(n, -1, 1);
    float *dw0 = rand_host(C, -1, 1), *db0 = rand_host(C, -1, 1);
    float *dinp = copy_host(g0, n), *dw = copy_host(dw0, C), *db = copy_host(db0, C), *h;
    float *d_x = to_dev(x, n), *d_w = to_dev(w, C), *d_b = to_dev(b, C), *d_dout = to_dev(dout, n);
    float *d_out = dev_alloc(n * sizeof(float)), *d_mean = dev_alloc((size_t)N * sizeof(float));
    float *d_rstd = dev_alloc((size_t)N * sizeof(float)), *d_dinp = to_dev(g0, n);
    float *d_dw = to_dev(dw0, C), *d_db = to_dev(db0, C), *d_cmean, *d_crstd;
    double *ref = dbuf(n), *bound = dbuf(n), *rm = dbuf(N), *bm = dbuf(N), *rr = dbuf(N);
    double *br = dbuf(N);
    char what[64];

    KC->layernorm_forward(out, mean, rstd, x, w, b, N, C);
    KD->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_w, d_b, N, C);
    for (int i = 0; i < N; i++) {
        const float *xi = x + (size_t)i * C;
        double m = 0.0, a = 0.0, v = 0.0, s;
        for (int j = 0; j < C; j++)
            m += xi[j], a += fabs(xi[j]);
        m /= C;
        for (int j = 0; j < C; j++)
            v += (xi[j] - m) * (xi[j] - m);
        v /= C;
        s = 1.0 / sqrt(v + 1e-5);
        rm[i] = m, bm[i] = 2.0 * (C + 2) * U * a / C;
        rr[i] = s, br[i] = 2.0 * (C + 8) * U * s;
        for (int j = 0; j < C; j++) {
            double o = (xi[j] - m) * s * w[j] + b[j];
            ref[(size_t)i * C + j] = o;
            bound[(size_t)i * C + j] = fabs(s * w[j]) * bm[i] + fabs((xi[j] - m) * w[j]) * br[i] +
                                       4.0 * U * (fabs((xi[j] - m) * s * w[j]) + fabs(b[j]));
        }
    }
    snprintf(what, sizeof(what), "layernorm fwd %dx%d", N, C);
    h = to_host(d_out, n);
    check_bound(what, h, out, ref, bound, n);
    free(h);
    h = to_host(d_mean, N);
    check_bound("layernorm mean", h, mean, rm, bm, N);
    free(h);
    h = to_host(d_rstd, N);
    check_bound("layernorm rstd", h, rstd, rr, br, N);
    free(h);

    /* backward, from the CPU forward's mean and rstd */
    d_cmean = to_dev(mean, N);
    d_crstd = to_dev(rstd, N);
    KC->layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd, N, C, 0);
    KD->layernorm_backward(d_dinp, d_dw, d_db, d_dout, d_x, d_w, d_cmean, d_crstd, N, C, 0);
    for (int i = 0; i < N; i++) {
        const float *xi = x + (size_t)i * C, *di = dout + (size_t)i * C;
        double m = mean[i], s = rstd[i], a1 = 0, a2 = 0, s1 = 0, s2 = 0, e1, e2;
        for (int j = 0; j < C; j++) {
            double dn = (double)w[j] * di[j], nm = (xi[j] - m) * s;
            a1 += dn, a2 += dn * nm, s1 += fabs(dn), s2 += fabs(dn * nm);
        }
        a1 /= C, a2 /= C;
        e1 = 2.0 * (C + 4) * U * s1 / C, e2 = 2.0 * (C + 4) * U * s2 / C;
        for (int j = 0; j < C; j++) {
            double dn = (double)w[j] * di[j], nm = (xi[j] - m) * s;
            size_t k = (size_t)i * C + j;
            ref[k] = g0[k] + (dn - a1 - nm * a2) * s;
            bound[k] = s * (e1 + fabs(nm) * e2) +
                       8.0 * U * (fabs(g0[k]) + s * (fabs(dn) + fabs(a1) + fabs(nm * a2)));
        }
    }
    snprintf(what, sizeof(what), "layernorm dinp %dx%d", N, C);
    h = to_host(d_dinp, n);
    check_bound(what, h, dinp, ref, bound, n);
    free(h);
    { /* dinp stored over NaN, as added into zeros */
        float *added;
        KD->zero(d_dinp, n);
        KD->layernorm_backward(d_dinp, NULL, NULL, d_dout, d_x, d_w, d_cmean, d_crstd, N, C, 0);
        added = to_host(d_dinp, n);
        dev_nan(d_dinp, n);
        KD->layernorm_backward(d_dinp, NULL, NULL, d_dout, d_x, d_w, d_cmean, d_crstd, N, C,
                               TD_STORE_1);
        h = to_host(d_dinp, n);
        check_stored("layernorm dinp stored", h, added, n);
        free(h), free(added);
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int j = 0; j < C; j++) {
            double s = pass ? dw0[j] : db0[j], a = fabs(s);
            for (int i = 0; i < N; i++) {
                size_t k = (size_t)i * C + j;
                double t = pass ? (x[k] - (double)mean[i]) * rstd[i] * dout[k] : dout[k];
                s += t, a += fabs(t);
            }
            ref[j] = s;
            bound[j] = 2.0 * (N + 4) * U * a;
        }
        h = to_host(pass ? d_dw : d_db, C);
        check_bound(pass ? "layernorm dweight" : "layernorm dbias", h, pass ? dw : db, ref, bound,
                    C);
        free(h);
    }
    /* the same call again, from the same start: the same bits */
    {
        float *first = to_host(d_dw, C), *again;
        dev_up(d_dw, dw0, C * sizeof(float));
        KD->layernorm_backward(NULL, d_dw, NULL, d_dout, d_x, d_w, d_cmean, d_crstd, N, C, 0);
        again = to_host(d_dw, C);
        check_same_bits("layernorm dweight, twice", first, again, C);
        free(first), free(again);
    }

    free(x), free(w), free(b), free(dout), free(out), free(mean), free(rstd), free(g0), free(dw0),
        free(db0), free(dinp), free(dw), free(db), free(ref), free(bound), free(rm), free(bm),
        free(rr), free(br);
    dev_free(d_x), dev_free(d_w), dev_free(d_b), dev_free(d_dout), dev_free(d_out),
        dev_free(d_mean), dev_free(d_rstd), dev_free(d_dinp), dev_free(d_dw), dev_free(d_db),
        dev_free(d_cmean), dev_free(d_crstd);
}

/* residual_layernorm_forward against the same table's residual_forward then layernorm_forward,
 * bit for bit (res, out, mean and rstd): it is those two kernels' arithmetic in one launch */
static void residual_layernorm_case(int N, int C)
{
    size_t n = (size_t)N * C;
    float *a = rand_host(n, -2, 2), *b = rand_host(n, -1, 1), *w = rand_host(C, -1, 1);
    float *bias = rand_host(C, -1, 1);
    float *d_a = to_dev(a, n), *d_b = to_dev(b, n), *d_w = to_dev(w, C), *d_bias = to_dev(bias, C);
    float *d_res[2], *d_out[2], *d_mean[2], *d_rstd[2], *h[2];
    char what[64];

    for (int i = 0; i < 2; i++) {
        d_res[i] = dev_alloc(n * sizeof(float)), d_out[i] = dev_alloc(n * sizeof(float));
        d_mean[i] = dev_alloc((size_t)N * sizeof(float));
        d_rstd[i] = dev_alloc((size_t)N * sizeof(float));
    }
    KD->residual_forward(d_res[0], d_a, d_b, n);
    KD->layernorm_forward(d_out[0], d_mean[0], d_rstd[0], d_res[0], d_w, d_bias, N, C);
    KD->residual_layernorm_forward(d_res[1], d_out[1], d_mean[1], d_rstd[1], d_a, d_b, d_w, d_bias,
                                   N, C);
    for (int k = 0; k < 4; k++) {
        float *const *src = k == 0 ? d_res : k == 1 ? d_out : k == 2 ? d_mean : d_rstd;
        size_t m = k < 2 ? n : (size_t)N;
        h[0] = to_host(src[0], m), h[1] = to_host(src[1], m);
        snprintf(what, sizeof(what), "residual+layernorm %dx%d %s", N, C,
                 k == 0   ? "res"
                 : k == 1 ? "out"
                 : k == 2 ? "mean"
                          : "rstd");
        check_same_bits(what, h[1], h[0], m);
        free(h[0]), free(h[1]);
    }
    for (int i = 0; i < 2; i++)
        dev_free(d_res[i]), dev_free(d_out[i]), dev_free(d_mean[i]), dev_free(d_rstd[i]);
    dev_free(d_a), dev_free(d_b), dev_free(d_w), dev_free(d_bias);
    free(a), free(b), free(w), free(bias);
}

static void body_layernorm(void)
{
    layernorm_case(67, 100);
    layernorm_case(512, 768);
    layernorm_case(4099, 300); /* rows blocks with a short last one beside 64 x 2 column blocks */
    residual_layernorm_case(67, 100);
    residual_layernorm_case(4099, 768);
}

/* ---- attention --------------------------------------------------------------------------------
 *
 * The fused attention (kernels.h's attention_forward and attention_backward) on both tables
 * from the same inputs, each side's backward from its own forward's out and lse, against a
 * reference computed in double from the inputs for the heads it checks, every element within a
 * first-order bound built from its terms (below); the device's results twice give the same
 * bits. A head the reference does not check (the large cases check three: the first, one in
 * the middle and the last) holds the device to the CPU within twice the largest bound seen on
 * the checked heads of that output: the same data distribution, so a wrong index or a lost
 * block, which is off by the outputs' own size, fails it. */

typedef struct gatt {
    td_attn_dims d;
    int packed, C;
    size_t nq, nk, nout, nl; /* floats of the q buffer, of k's and v's, of out, of lse */
    float *q, *k, *v;        /* host; k and v inside q when packed */
    float *dout, *g0;        /* dout, and every gradient's value before the backward (packed:
                              * one buffer of nq, else nq + 2 nk: dq's, dk's, dv's) */
} gatt;

/* The reference of one output and its bound, in the layout of its buffer; bound INFINITY
 * where no head was checked. */
typedef struct gref {
    double *ref, *bound;
    size_t n;
} gref;

static gref gref_new(size_t n)
{
    gref r = {dbuf(n), dbuf(n), n};

    for (size_t i = 0; i < n; i++)
        r.bound[i] = INFINITY;
    return r;
}

static void gref_free(gref *r)
{
    free(r->ref);
    free(r->bound);
}

/* Head (b,h) in double. u = 2^-24; t = TF32_U where the device's fp32 gemms run in TF32
 * (tf32, or bf16, whose math mode lets them), else 0; every bound is twice the first-order one.
 *  S_ij = scale q_i.k_j: delta_S = (2(hs+2)u + t) scale sum|q k| + u|S|;
 *  p_ij (the forward's exp(S - max)/sum, the backward's exp(S - lse)): relative
 *      e_ij = 2 max_j delta_S + (n + 12 + |S - max| + 2|lse|) u (the sums of n exps, fexp's
 *      few ulp, the rounding of lse);
 *  out = sum p v: sum e p |v| + (2(n+2)u + t) sum p |v|; lse: max delta_S + (n + 10 + 2|lse|)u;
 *  dP_ij = dout_i.v_j: (2(hs+2)u + t) sum|dout v|; D_i = dout_i.out_i: 2(hs+2)u sum|dout out|
 *      + sum |dout| delta_out;
 *  dS = scale p (dP - D): scale (e p |dP - D| + p (delta_dP + delta_D) + 4u p (|dP| + |D|));
 *  dq_i = g0 + sum_j dS_ij k_j, dk_j = g0 + sum_i dS_ij q_i, dv_j = g0 + sum_i p_ij dout_i:
 *      the terms' bounds times |factor|, plus (2(K+2)u + t) (sum|terms| + |g0|), K the terms. */
static void gatt_ref_head(const gatt *a, int b, int h, gref *ro, gref *rl, gref *rq, gref *rk,
                          gref *rv)
{
    const td_attn_dims *d = &a->d;
    int hs = d->hs, Nq = d->Nq, Nk = d->Nk, C = a->C;
    double scale = 1.0 / sqrt((double)hs), t = tf32_on || bf16_on ? TF32_U : 0.0;
    double *S = dbuf((size_t)Nq * Nk), *P = dbuf((size_t)Nq * Nk), *E = dbuf((size_t)Nq * Nk);
    double *dS = dbuf((size_t)Nq * Nk), *edS = dbuf((size_t)Nq * Nk), *dl = dbuf(Nk);
    double *bo = dbuf((size_t)Nq * hs);
    const float *g0q = a->g0, *g0k = a->packed ? a->g0 + C : a->g0 + a->nq;
    const float *g0v = a->packed ? a->g0 + 2 * C : a->g0 + a->nq + a->nk;
    size_t ldq = d->ldq, ldk = d->ldk, ldv = d->ldv;
#define Q(i, e)  ((double)a->q[((size_t)b * Nq + (i)) * ldq + (size_t)h * hs + (e)])
#define K_(j, e) ((double)a->k[((size_t)b * Nk + (j)) * ldk + (size_t)h * hs + (e)])
#define V(j, e)  ((double)a->v[((size_t)b * Nk + (j)) * ldv + (size_t)h * hs + (e)])
#define G(i, e)  ((double)a->dout[((size_t)b * Nq + (i)) * C + (size_t)h * hs + (e)])
#define OI(i, e) (((size_t)b * Nq + (i)) * C + (size_t)h * hs + (e))
#define QI(i, e) (((size_t)b * Nq + (i)) * ldq + (size_t)h * hs + (e))
#define KI(j, e) (((size_t)b * Nk + (j)) * ldk + (size_t)h * hs + (e))
#define VI(j, e) (((size_t)b * Nk + (j)) * ldv + (size_t)h * hs + (e))

    for (int i = 0; i < Nq; i++) {
        int n = d->causal ? i + 1 : Nk;
        double mx = -INFINITY, z = 0.0, dmax = 0.0, lse, D = 0.0, aD = 0.0, eD = 0.0;
        for (int j = 0; j < n; j++) {
            double s = 0.0, as = 0.0;
            for (int e = 0; e < hs; e++)
                s += Q(i, e) * K_(j, e), as += fabs(Q(i, e) * K_(j, e));
            S[(size_t)i * Nk + j] = s * scale;
            dl[j] = (2.0 * (hs + 2) * U + t) * scale * as + U * fabs(s * scale);
            mx = fmax(mx, s * scale);
            dmax = fmax(dmax, dl[j]);
        }
        for (int j = 0; j < n; j++)
            z += exp(S[(size_t)i * Nk + j] - mx);
        lse = mx + log(z);
        rl->ref[((size_t)b * d->NH + h) * Nq + i] = lse;
        rl->bound[((size_t)b * d->NH + h) * Nq + i] = 2.0 * (dmax + (n + 10 + 2 * fabs(lse)) * U);
        for (int j = 0; j < n; j++) {
            double s = S[(size_t)i * Nk + j], p = exp(s - lse);
            P[(size_t)i * Nk + j] = p;
            E[(size_t)i * Nk + j] = p * (2.0 * dmax + (n + 12 + fabs(s - mx) + 2 * fabs(lse)) * U);
        }
        for (int e = 0; e < hs; e++) {
            double o = 0.0, ao = 0.0, eo = 0.0;
            for (int j = 0; j < n; j++) {
                o += P[(size_t)i * Nk + j] * V(j, e);
                ao += P[(size_t)i * Nk + j] * fabs(V(j, e));
                eo += E[(size_t)i * Nk + j] * fabs(V(j, e));
            }
            ro->ref[OI(i, e)] = o;
            bo[(size_t)i * hs + e] = 2.0 * (eo + (2.0 * (n + 2) * U + t) * ao);
            ro->bound[OI(i, e)] = bo[(size_t)i * hs + e];
            D += G(i, e) * o;
            aD += fabs(G(i, e) * o);
            eD += fabs(G(i, e)) * bo[(size_t)i * hs + e];
        }
        eD += 2.0 * (hs + 2) * U * aD;
        for (int j = 0; j < n; j++) {
            double dp = 0.0, adp = 0.0, p = P[(size_t)i * Nk + j], edp;
            for (int e = 0; e < hs; e++)
                dp += G(i, e) * V(j, e), adp += fabs(G(i, e) * V(j, e));
            edp = (2.0 * (hs + 2) * U + t) * adp;
            dS[(size_t)i * Nk + j] = scale * p * (dp - D);
            edS[(size_t)i * Nk + j] = scale * (E[(size_t)i * Nk + j] * fabs(dp - D) +
                                               p * (edp + eD) + 4.0 * U * p * (fabs(dp) + fabs(D)));
        }
    }
    for (int i = 0; i < Nq; i++) { /* dq */
        int n = d->causal ? i + 1 : Nk;
        for (int e = 0; e < hs; e++) {
            double s = g0q[QI(i, e)], as = 0.0, es = 0.0;
            for (int j = 0; j < n; j++) {
                s += dS[(size_t)i * Nk + j] * K_(j, e);
                as += fabs(dS[(size_t)i * Nk + j] * K_(j, e));
                es += edS[(size_t)i * Nk + j] * fabs(K_(j, e));
            }
            rq->ref[QI(i, e)] = s;
            rq->bound[QI(i, e)] = 2.0 * (es + (2.0 * (n + 2) * U + t) * (as + fabs(g0q[QI(i, e)])));
        }
    }
    for (int j = 0; j < Nk; j++) /* dk, dv */
        for (int e = 0; e < hs; e++) {
            double sk = g0k[KI(j, e)], ak = 0.0, ek = 0.0;
            double sv = g0v[VI(j, e)], av = 0.0, ev = 0.0;
            for (int i = d->causal ? j : 0; i < Nq; i++) {
                double ds = dS[(size_t)i * Nk + j], p = P[(size_t)i * Nk + j];
                sk += ds * Q(i, e);
                ak += fabs(ds * Q(i, e));
                ek += edS[(size_t)i * Nk + j] * fabs(Q(i, e));
                sv += p * G(i, e);
                av += fabs(p * G(i, e));
                ev += E[(size_t)i * Nk + j] * fabs(G(i, e));
            }
            rk->ref[KI(j, e)] = sk;
            rk->bound[KI(j, e)] =
                2.0 * (ek + (2.0 * (Nq + 2) * U + t) * (ak + fabs(g0k[KI(j, e)])));
            rv->ref[VI(j, e)] = sv;
            rv->bound[VI(j, e)] =
                2.0 * (ev + (2.0 * (Nq + 2) * U + t) * (av + fabs(g0v[VI(j, e)])));
        }
#undef Q
#undef K_
#undef V
#undef G
#undef OI
#undef QI
#undef KI
#undef VI
    free(S), free(P), free(E), free(dS), free(edS), free(dl), free(bo);
}

/* Elements of heads the reference did not check (bound INFINITY) get twice the largest bound
 * of the checked ones of the same output, against the CPU's value: then check_bound holds the
 * device to the CPU. The output is elements [0, n) of r whose column (i mod ld) falls in
 * [c0, c0 + C): q's, k's or v's part of a packed qkv (ld 3C), or all of a tensor (ld C). */
static void gref_fill(gref *r, const float *cpu, size_t n, size_t ld, size_t c0, size_t C)
{
    double worst = 0.0;

    for (size_t i = 0; i < n; i++)
        if (i % ld - c0 < C && isfinite(r->bound[i]))
            worst = fmax(worst, r->bound[i]);
    for (size_t i = 0; i < n; i++)
        if (i % ld - c0 < C && !isfinite(r->bound[i])) {
            r->ref[i] = cpu[i];
            r->bound[i] = 2.0 * worst;
        }
}

/* One case: B sequences, NH heads of hs, Nq queries against Nk keys, causal or not, llm.c's
 * packed qkv or three tensors, the given chunk (0: td_attn_chunk's automatic one); every head
 * checked against the reference, or (sampled) three of them. */
static void attention_case(int B, int NH, int hs, int Nq, int Nk, int causal, int packed, int chunk,
                           int sampled)
{
    gatt a = {.packed = packed, .C = NH * hs};
    int C = a.C, BH = B * NH;
    size_t ng, ns;
    float *out, *lse, *gc, *scratch, *h, *h2;
    float *d_q, *d_k, *d_v, *d_dout, *d_out, *d_lse, *d_g, *d_scratch;
    gref ro = gref_new((size_t)B * Nq * C), rl = gref_new((size_t)BH * Nq), rq, rk, rv;
    int heads[3] = {0, BH / 2, BH - 1};
    char what[64];

    a.d = (td_attn_dims){.B = B,
                         .NH = NH,
                         .Nq = Nq,
                         .Nk = Nk,
                         .hs = hs,
                         .causal = causal,
                         .chunk = td_attn_chunk(chunk, B, NH, Nq, Nk)};
    a.nout = (size_t)B * Nq * C;
    a.nl = (size_t)BH * Nq;
    if (packed) {
        a.d.ldq = a.d.ldk = a.d.ldv = 3 * C;
        a.nq = (size_t)B * Nq * 3 * C;
        a.q = rand_host(a.nq, -1, 1);
        a.k = a.q + C;
        a.v = a.q + 2 * C;
        ng = a.nq;
    } else {
        a.d.ldq = a.d.ldk = a.d.ldv = C;
        a.nq = a.nout;
        a.nk = (size_t)B * Nk * C;
        a.q = rand_host(a.nq, -1, 1);
        a.k = rand_host(a.nk, -1, 1);
        a.v = rand_host(a.nk, -1, 1);
        ng = a.nq + 2 * a.nk;
    }
    a.dout = rand_host(a.nout, -1, 1);
    a.g0 = rand_host(ng, -1, 1);
    ns = td_attn_scratch(&a.d, 1);
    print_message("  attention B=%d NH=%d hs=%d Nq=%d Nk=%d%s%s chunk %d%s:\n", B, NH, hs, Nq, Nk,
                  causal ? " causal" : "", packed ? " packed qkv" : "", a.d.chunk, prec_name());

    /* the CPU */
    out = malloc(a.nout * sizeof(float));
    lse = malloc(a.nl * sizeof(float));
    scratch = malloc(ns * sizeof(float));
    gc = copy_host(a.g0, ng);
    assert_true(out != NULL && lse != NULL && scratch != NULL);
    KC->attention_forward(out, lse, scratch, a.q, a.k, a.v, &a.d);
    if (packed)
        KC->attention_backward(gc, gc + C, gc + 2 * C, scratch, a.dout, a.q, a.k, a.v, out, lse,
                               &a.d, 0);
    else
        KC->attention_backward(gc, gc + a.nq, gc + a.nq + a.nk, scratch, a.dout, a.q, a.k, a.v, out,
                               lse, &a.d, 0);

    /* the device */
    d_q = to_dev(a.q, a.nq);
    d_k = packed ? d_q + C : to_dev(a.k, a.nk);
    d_v = packed ? d_q + 2 * C : to_dev(a.v, a.nk);
    d_dout = to_dev(a.dout, a.nout);
    d_g = to_dev(a.g0, ng);
    d_out = dev_alloc(a.nout * sizeof(float));
    d_lse = dev_alloc(a.nl * sizeof(float));
    d_scratch = dev_alloc(ns * sizeof(float));
#define DEV_BACKWARD(store)                                                                       \
    (packed ? KD->attention_backward(d_g, d_g + C, d_g + 2 * C, d_scratch, d_dout, d_q, d_k, d_v, \
                                     d_out, d_lse, &a.d, store)                                   \
            : KD->attention_backward(d_g, d_g + a.nq, d_g + a.nq + a.nk, d_scratch, d_dout, d_q,  \
                                     d_k, d_v, d_out, d_lse, &a.d, store))
    KD->attention_forward(d_out, d_lse, d_scratch, d_q, d_k, d_v, &a.d);
    DEV_BACKWARD(0);

    /* the reference */
    if (packed) {
        rq = gref_new(a.nq);
        rk = (gref){rq.ref + C, rq.bound + C, 0};
        rv = (gref){rq.ref + 2 * C, rq.bound + 2 * C, 0};
    } else {
        gref all = gref_new(ng);
        rq = (gref){all.ref, all.bound, a.nq};
        rk = (gref){all.ref + a.nq, all.bound + a.nq, 0};
        rv = (gref){all.ref + a.nq + a.nk, all.bound + a.nq + a.nk, 0};
    }
    rq.n = ng; /* rq owns the whole gradient buffer's reference */
    for (int bh = 0; bh < BH; bh++)
        if (!sampled || bh == heads[0] || bh == heads[1] || bh == heads[2])
            gatt_ref_head(&a, bh / NH, bh % NH, &ro, &rl, &rq, &rk, &rv);
    gref_fill(&ro, out, a.nout, a.nout, 0, a.nout);
    gref_fill(&rl, lse, a.nl, a.nl, 0, a.nl);
    if (packed) {
        for (int part = 0; part < 3; part++)
            gref_fill(&rq, gc, ng, 3 * (size_t)C, (size_t)part * C, C);
    } else {
        gref r2 = {rq.ref + a.nq, rq.bound + a.nq, 0}, r3 = {rk.ref + a.nk, rk.bound + a.nk, 0};
        gref_fill(&rq, gc, a.nq, a.nq, 0, a.nq);
        gref_fill(&r2, gc + a.nq, a.nk, a.nk, 0, a.nk);
        gref_fill(&r3, gc + a.nq + a.nk, a.nk, a.nk, 0, a.nk);
    }

    h = to_host(d_out, a.nout);
    check_bound("attention out", h, out, ro.ref, ro.bound, a.nout);
    free(h);
    h = to_host(d_lse, a.nl);
    check_bound("attention lse", h, lse, rl.ref, rl.bound, a.nl);
    free(h);
    h = to_host(d_g, ng);
    snprintf(what, sizeof(what), "attention %s", packed ? "dqkv" : "dq, dk, dv");
    check_bound(what, h, gc, rq.ref, rq.bound, ng);

    /* deterministic: forward and backward again, the same bits */
    dev_up(d_g, a.g0, ng * sizeof(float));
    KD->attention_forward(d_out, d_lse, d_scratch, d_q, d_k, d_v, &a.d);
    DEV_BACKWARD(0);
    h2 = to_host(d_g, ng);
    check_same_bits("attention backward, twice", h, h2, ng);
    free(h), free(h2);

    /* dq, dk, dv stored over NaN (beta 0 where a block writes first; a causal plan in rows
     * zeroes dk and dv first), all three and dk alone, as added into zeros; on the fake device
     * only the small cases (the large ones' CPU backward is long) */
    for (int st = TD_STORE_1 | TD_STORE_2 | TD_STORE_3; !sampled || !fake; st = TD_STORE_2) {
        float *z = calloc(ng, sizeof(float));
        assert_non_null(z);
        KD->zero(d_g, ng);
        DEV_BACKWARD(0);
        h2 = to_host(d_g, ng);
        for (size_t i = 0; i < ng; i++) { /* NaN where stored, zeros where added */
            int in_dk = packed ? i % (3 * (size_t)C) / C == 1 : i >= a.nq && i < a.nq + a.nk;
            z[i] = st != TD_STORE_2 || in_dk ? NAN : 0.0f;
        }
        dev_up(d_g, z, ng * sizeof(float));
        DEV_BACKWARD(st);
        h = to_host(d_g, ng);
        check_stored(st == TD_STORE_2 ? "attention dk stored" : "attention dq, dk, dv stored", h,
                     h2, ng);
        free(h), free(h2), free(z);
        if (st == TD_STORE_2)
            break;
    }
#undef DEV_BACKWARD

    gref_free(&ro), gref_free(&rl), gref_free(&rq);
    free(a.q), free(a.dout), free(a.g0), free(out), free(lse), free(scratch), free(gc);
    if (!packed)
        free(a.k), free(a.v), dev_free(d_k), dev_free(d_v);
    dev_free(d_q), dev_free(d_dout), dev_free(d_g), dev_free(d_out), dev_free(d_lse),
        dev_free(d_scratch);
}

/* Small cases, every head against the reference: GPT-2's heads (causal, packed, T past a
 * 64-row block, hs 64), a causal T = 129 with hs 24 and a chunk of 50 (not dividing T), a
 * non-causal self-attention of three tensors, a MAP head's probe. Then the sizes of issue 13,
 * three heads against the reference and the rest against the CPU: a ViT tower's
 * self-attention over N = 2448 patches with B*NH = 144 (several blocks of rows at the
 * automatic chunk), the GPT's causal attention at T = 2448 with B*NH = 128, and a MAP head's
 * probe against 2448 keys for B*NH = 256. The CPU twin takes every core meanwhile. */
static void attention_cases(int large)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);

    attention_case(1, 12, 64, 256, 256, 1, 1, 0, 0);
    attention_case(2, 4, 24, 129, 129, 1, 1, 50, 0);
    attention_case(2, 3, 16, 97, 97, 0, 0, 16, 0);
    attention_case(4, 2, 16, 1, 300, 0, 0, 0, 0);
    KC->set_threads(cores > 1 ? (int)cores : 1);
    if (large)
        attention_case(24, 6, 32, 2448, 2448, 0, 0, 0, 1);
    attention_case(16, 8, 32, 2448, 2448, 1, 1, 0, 1);
    if (large)
        attention_case(32, 8, 32, 1, 2448, 0, 0, 0, 1);
    KC->set_threads(1);
}

static void body_attention(void)
{
    attention_cases(1);
}

/* The same with bf16 on, as a GPT job on a GPU runs: the attention's fp32 gemms then run in
 * TF32, so every product's bound grows by TF32_U of the sum of its terms' absolute values. Of
 * the large cases, the GPT's causal one. */
static void body_attention_bf16(void)
{
#ifdef TD_HAVE_CUDA
    if (!fake)
        td_cuda_ctx_set_bf16(td_cuda_ctx_current(), 1);
#endif
    bf16_on = 1;
    attention_cases(0);
#ifdef TD_HAVE_CUDA
    if (!fake)
        td_cuda_ctx_set_bf16(td_cuda_ctx_current(), 0);
#endif
    bf16_on = 0;
}

/* ---- sumsq and the optimizers -------------------------------------------------------------- */

/* Squares of floats are exact in double; both sides sum n of them in double: within
 * 2(n+2) 2^-53 of the sum. Twice on the GPU: the same bits. */
static void body_sumsq(void)
{
    size_t n = 1000003;
    float *p = rand_host(n, -2, 2), *d_p = to_dev(p, n);
    double cpu = 0.0, got[2] = {0, 0}, *d_s = dev_alloc(2 * sizeof(double));
    long double ref = 0.0L;

    for (size_t i = 0; i < n; i++)
        ref += (long double)p[i] * p[i];
    KC->sumsq(&cpu, p, n);
    KD->sumsq(d_s, d_p, n);
    KD->sumsq(d_s + 1, d_p, n);
    dev_down(got, d_s, sizeof(got));
    print_message("  %-28s %8zu values, |gpu-ref| %.3g, |cpu-ref| %.3g (bound %.3g)\n", "sumsq", n,
                  fabs(got[0] - (double)ref), fabs(cpu - (double)ref),
                  2.0 * (n + 2) * 0x1p-53 * (double)ref);
    assert_true(fabs(got[0] - (double)ref) <= 2.0 * (n + 2) * 0x1p-53 * (double)ref);
    assert_true(fabs(cpu - (double)ref) <= 2.0 * (n + 2) * 0x1p-53 * (double)ref);
    assert_memory_equal(&got[0], &got[1], sizeof(double));
    free(p);
    dev_free(d_p), dev_free(d_s);
}

/* Two AdamW steps (step 1 and 2, with decay), SGD with and without momentum: the same float
 * operations on both sides. */
static void optimizers_case(size_t n)
{
    float *p = rand_host(n, -1, 1), *g = rand_host(n, -1, 1), *m = calloc(n, sizeof(float));
    float *v = calloc(n, sizeof(float)), *d_p = to_dev(p, n), *d_g = to_dev(g, n);
    float *d_m = to_dev(m, n), *d_v = to_dev(v, n), *h;

    for (int64_t t = 1; t <= 2; t++) {
        KC->adamw_update(p, m, v, g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
        KD->adamw_update(d_p, d_m, d_v, d_g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    }
    h = to_host(d_p, n);
    check_ulps("adamw param", h, p, n, ULP4);
    free(h);
    h = to_host(d_m, n);
    check_ulps("adamw m", h, m, n, ULP4);
    free(h);
    h = to_host(d_v, n);
    check_ulps("adamw v", h, v, n, ULP4);
    free(h);

    memset(m, 0, n * sizeof(float));
    dev_up(d_m, m, n * sizeof(float));
    for (int i = 0; i < 2; i++) {
        KC->sgd_update(p, m, g, n, 0.05f, 0.9f, 1e-4f);
        KD->sgd_update(d_p, d_m, d_g, n, 0.05f, 0.9f, 1e-4f);
    }
    KC->sgd_update(p, NULL, g, n, 0.05f, 0.0f, 0.0f);
    KD->sgd_update(d_p, NULL, d_g, n, 0.05f, 0.0f, 0.0f);
    h = to_host(d_p, n);
    check_exact("sgd param", h, p, n);
    free(h);
    h = to_host(d_m, n);
    check_exact("sgd momentum", h, m, n);
    free(h);
    free(p), free(g), free(m), free(v);
    dev_free(d_p), dev_free(d_g), dev_free(d_m), dev_free(d_v);
}

/* adamw_flat in one launch against the CPU twin: three spans over n (decay on, off, on) with
 * padding between and after them, the clip factor from clip_scale on each side (a norm above
 * max_norm, so the gradient is scaled), two steps, then a NaN loss whose factor skips the third
 * step on the device as on the CPU. The factor within 4 ulp (the sums of squares add in other
 * orders; the sqrt and division are correctly rounded doubles on both); the update within 4 ulp
 * as adamw_update's (nvcc may contract into fma), m and v within 16 (the scaled gradient). */
static void adamw_flat_case(size_t n)
{
    float *p = rand_host(n, -1, 1), *g = rand_host(n, -1, 1), *m = calloc(n, sizeof(float));
    float *v = calloc(n, sizeof(float)), *d_p = to_dev(p, n), *d_g, *d_m = to_dev(m, n);
    float *d_v = to_dev(v, n), *h, out[2], dout[2], *d_out = dev_alloc(2 * sizeof(float));
    float *d_loss = dev_alloc(sizeof(float)), loss = 1.5f;
    double ss, *d_ss = dev_alloc(sizeof(double));
    size_t a = n / 3, b = n / 3 + 5, c = 2 * (n / 3);
    const td_adamw_span spans[3] = {
        {.offset = 0, .n = a, .decay = 1},
        {.offset = b, .n = c - b - 3, .decay = 0},
        {.offset = c, .n = n - c - 7, .decay = 1},
    };
    td_adamw_span *d_spans = dev_alloc(sizeof(spans));
    const float max_norm[3] = {1.0f, 0.25f, 1.0f}; /* step 1 leaves the norm at 1: 0.25 clips */

    for (size_t i = 0; i < n; i++) /* padding has a zero gradient, as td_params' */
        if ((i >= a && i < b) || (i >= c - 3 && i < c) || i >= n - 7)
            g[i] = 0.0f;
    d_g = to_dev(g, n);
    dev_up(d_spans, spans, sizeof(spans));
    for (int64_t t = 1; t <= 3; t++) {
        if (t == 3)
            loss = NAN;
        dev_up(d_loss, &loss, sizeof(loss));
        KC->sumsq(&ss, g, n);
        KC->clip_scale(out, &ss, &loss, max_norm[t - 1]);
        KD->sumsq(d_ss, d_g, n);
        KD->clip_scale(d_out, d_ss, d_loss, max_norm[t - 1]);
        dev_down(dout, d_out, sizeof(dout));
        if (t < 3) {
            assert_true(out[0] < 1.0f);
            assert_true(fabs(dout[0] - out[0]) <= ULP4 * out[0]);
        } else {
            assert_true(isnan(out[0]) && isnan(dout[0]));
        }
        KC->adamw_flat(p, m, v, g, n, spans, 3, out, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
        KD->adamw_flat(d_p, d_m, d_v, d_g, n, d_spans, 3, d_out, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                       t);
    }
    h = to_host(d_p, n);
    check_ulps("adamw_flat param", h, p, n, ULP4);
    free(h);
    h = to_host(d_m, n);
    check_ulps("adamw_flat m", h, m, n, 4 * ULP4); /* the scaled gradient, twice */
    free(h);
    h = to_host(d_v, n);
    check_ulps("adamw_flat v", h, v, n, 4 * ULP4);
    free(h);
    free(p), free(g), free(m), free(v);
    dev_free(d_p), dev_free(d_g), dev_free(d_m), dev_free(d_v);
    dev_free(d_out), dev_free(d_loss), dev_free(d_ss), dev_free(d_spans);
}

/* sgd_flat in one launch against the CPU twin: momentum and weight decay, the clip's factor
 * from clip_scale on each side (scaling on step 1), then a NaN loss that skips step 3 on both.
 * Within 4 ulp of the CPU (nvcc may contract into fma), the buffer within 16. */
static void sgd_flat_case(size_t n)
{
    float *p = rand_host(n, -1, 1), *g = rand_host(n, -1, 1), *b = calloc(n, sizeof(float));
    float *d_p = to_dev(p, n), *d_g = to_dev(g, n), *d_b = to_dev(b, n), *h, out[2];
    float *d_out = dev_alloc(2 * sizeof(float)), *d_loss = dev_alloc(sizeof(float)), loss = 0.5f;
    double ss, *d_ss = dev_alloc(sizeof(double));

    for (int t = 1; t <= 3; t++) {
        float max_norm = t == 1 ? 0.25f : 1e9f;
        if (t == 3)
            loss = NAN;
        dev_up(d_loss, &loss, sizeof(loss));
        KC->sumsq(&ss, g, n);
        KC->clip_scale(out, &ss, &loss, max_norm);
        KD->sumsq(d_ss, d_g, n);
        KD->clip_scale(d_out, d_ss, d_loss, max_norm);
        KC->sgd_flat(p, b, g, n, out, 0.1f, 0.9f, 0.01f);
        KD->sgd_flat(d_p, d_b, d_g, n, d_out, 0.1f, 0.9f, 0.01f);
    }
    h = to_host(d_p, n);
    check_ulps("sgd_flat param", h, p, n, ULP4);
    free(h);
    h = to_host(d_b, n);
    check_ulps("sgd_flat momentum", h, b, n, 4 * ULP4);
    free(h);
    free(p), free(g), free(b);
    dev_free(d_p), dev_free(d_g), dev_free(d_b), dev_free(d_out), dev_free(d_loss), dev_free(d_ss);
}

/* Several blocks with a partial last one, then the grid-stride wrap-around. */
static void body_optimizers(void)
{
    optimizers_case(NE);
    optimizers_case(WRAP_N);
    adamw_flat_case(NE);
    adamw_flat_case(WRAP_N);
    sgd_flat_case(NE);
    sgd_flat_case(WRAP_N);
}

/* ---- a two-tower model's heads (kernels/cpu_heads.c, cuda/heads.cu) ----------------------- */

/* token_mean, gather_rows and l2norm: the CUDA twins add in the CPU's order (one thread per
 * output: the tokens in order; one per row: the row's squares and dot in double, in column
 * order; IEEE division and square root), so each is held to the CPU's bits. The sizes make
 * several blocks of each kernel: B*C = 903 outputs of token_mean (256 a block), 300 rows of
 * l2norm (64 a block), a (7,300,129) backward; and a row of l2norm below its floor. */
static void heads_exact_case(void)
{
    const int B = 7, N = 300, C = 129, R = 300, E = 777, T = 17;
    size_t nx = (size_t)B * N * C, ny = (size_t)B * C, ne = (size_t)R * E, ng = (size_t)R * T * 100;
    float *x = rand_host(nx, -2, 2), *y = rand_host(ny, -1, 1), *gx = rand_host(nx, -1, 1);
    float *gy = rand_host(ny, -1, 1), *v = rand_host(ne, -3, 3), *gv = rand_host(ne, -1, 1);
    float *g0 = rand_host(ne, -1, 1), *gt = rand_host(ng, -1, 1),
          *go = rand_host((size_t)R * 100, -1, 1);
    float *vo = rand_host(ne, -1, 1), *vn = rand_host(R, -1, 1), *gi = copy_host(g0, ne), *h;
    float *gti = copy_host(gt, ng), *gx2 = copy_host(gx, nx), *d_x, *d_y, *d_gx, *d_gy, *d_v;
    float *d_vo, *d_vn, *d_gv, *d_gi, *d_gt, *d_go, *d_gout;
    int *idx = malloc((size_t)R * sizeof(int)), *d_idx;

    assert_non_null(idx);
    for (int e = 0; e < E; e++) /* row 3 below the floor: divided by it */
        v[(size_t)3 * E + e] = e < 2 ? 1e-14f : 0.0f;
    for (int r = 0; r < R; r++)
        idx[r] = (r * 7) % T;
    d_x = to_dev(x, nx), d_y = dev_alloc(ny * sizeof(float)), d_gx = to_dev(gx, nx);
    d_gy = to_dev(gy, ny), d_v = to_dev(v, ne), d_vo = dev_alloc(ne * sizeof(float));
    d_vn = dev_alloc((size_t)R * sizeof(float)), d_gv = to_dev(gv, ne), d_gi = to_dev(g0, ne);
    d_gt = to_dev(gt, ng), d_go = dev_alloc((size_t)R * 100 * sizeof(float));
    d_gout = to_dev(go, (size_t)R * 100), d_idx = ints_to_dev(idx, R);

    KC->token_mean_forward(y, x, B, N, C);
    KD->token_mean_forward(d_y, d_x, B, N, C);
    h = to_host(d_y, ny), check_exact("token_mean fwd 7x300x129", h, y, ny), free(h);
    KC->token_mean_backward(gx2, gy, B, N, C);
    KD->token_mean_backward(d_gx, d_gy, B, N, C);
    h = to_host(d_gx, nx), check_exact("token_mean bwd", h, gx2, nx), free(h);

    KC->l2norm_forward(vo, vn, v, R, E);
    KD->l2norm_forward(d_vo, d_vn, d_v, R, E);
    assert_true(vn[3] == TD_L2NORM_EPS);
    h = to_host(d_vo, ne), check_exact("l2norm fwd 300x777", h, vo, ne), free(h);
    h = to_host(d_vn, R), check_exact("l2norm norms", h, vn, R), free(h);
    KC->l2norm_backward(gi, gv, vo, vn, R, E);
    dev_up(d_vo, vo, ne * sizeof(float)), dev_up(d_vn, vn, R * sizeof(float));
    KD->l2norm_backward(d_gi, d_gv, d_vo, d_vn, R, E);
    h = to_host(d_gi, ne), check_exact("l2norm bwd", h, gi, ne), free(h);

    /* gather: rows of a (R, T, 100) input; the forward reads gt as the input */
    KC->gather_rows_forward(go, gt, idx, R, T, 100);
    KD->gather_rows_forward(d_go, d_gt, d_idx, R, T, 100);
    h = to_host(d_go, (size_t)R * 100), check_exact("gather_rows fwd 300x17x100", h, go, R * 100),
    free(h);
    KC->gather_rows_backward(gti, go, idx, R, T, 100);
    KD->gather_rows_backward(d_gt, d_go, d_idx, R, T, 100);
    h = to_host(d_gt, ng), check_exact("gather_rows bwd", h, gti, ng), free(h);

    free(x), free(y), free(gx), free(gy), free(v), free(gv), free(g0), free(gt), free(go), free(vo),
        free(vn), free(gi), free(gti), free(gx2), free(idx);
    dev_free(d_x), dev_free(d_y), dev_free(d_gx), dev_free(d_gy), dev_free(d_v), dev_free(d_vo),
        dev_free(d_vn), dev_free(d_gv), dev_free(d_gi), dev_free(d_gt), dev_free(d_go),
        dev_free(d_gout), dev_free(d_idx);
}

/* SigLIP's loss and gradients, N x M = 100 x 300 (30000 terms: 30 blocks of the forward's
 * grid), a diagonal shifted by 37 (a replica's rows), a weight; dots in [-1, 1] and t = 2.5
 * (exp(t) = 12.2) so z spans both signs. Each term is float on both sides (expf and log1pf:
 * glibc's and CUDA's, within 2 ulp each), the sums double. Against a double reference:
 *  - z = exp(t) dots + b within (|exp(t) dots| + |b|) 4u (expf's ulps, the product, the sum);
 *    a term (softplus, slope below 1) within that plus 8u of itself; the loss within the sum
 *    of those, times weight, times 2;
 *  - g = dL/dz, -scale y sigmoid(-yz): sigmoid's slope is at most 1/4, so g within
 *    |scale| (z's bound / 4 + 8u sigmoid); ddots (+= exp(t) g) within exp(t) g's bound + 4u
 *    |exp(t) g| + u |ddots|; dt, db (sums in double of exp(t) dots g and g) within the sums of
 *    their terms' bounds, plus u of the result for the cast, times 2.
 * Both backends are held to these; the GPU run twice gives the same bits. With labels (M, or
 * NULL), the same-label negatives (loss.mask_same_label) are left out of the reference too. */
static void siglip_gpu_case(int N, int M, int diag, float weight, const int *labels)
{
    const float same = 0.0f; /* left out; a weight in (0, 1) is test_sensorlm's, on the CPU */
    size_t n = (size_t)N * M;
    float *dots = rand_host(n, -1, 1), t = 2.5f, b = -3.0f, dloss = 1.3f, loss, *h;
    float *dd0 = rand_host(n, -1, 1), *dd = copy_host(dd0, n), tb0[2] = {0.25f, -0.5f};
    float dt = tb0[0], db = tb0[1], got[2];
    float *d_dots = to_dev(dots, n), *d_t = to_dev(&t, 1), *d_b = to_dev(&b, 1);
    float *d_loss = dev_alloc(sizeof(float)), *d_dl = to_dev(&dloss, 1), *d_dd = to_dev(dd0, n);
    float *d_dt = to_dev(&tb0[0], 1), *d_db = to_dev(&tb0[1], 1), first;
    double et = exp((double)t), ref = 0.0, lb = 0.0, st = tb0[0], sb = tb0[1], bt = 0.0, bb = 0.0;
    double *rd = dbuf(n), *bd = dbuf(n), scale = (double)dloss * weight;
    int *d_lab = labels != NULL ? ints_to_dev(labels, (size_t)M) : NULL;
    char what[48];

    for (size_t k = 0; k < n; k++) {
        int i = (int)(k / (size_t)M), j = (int)(k % (size_t)M);
        double y = j == i + diag ? 1.0 : -1.0, z = et * dots[k] + b, term, sg, g, zb, gb;
        if (labels != NULL && j != i + diag && labels[i + diag] >= 0 &&
            labels[j] == labels[i + diag]) {
            rd[k] = dd0[k], bd[k] = 0.0; /* left out: ddots untouched */
            continue;
        }
        term = fmax(-y * z, 0.0) + log1p(exp(-fabs(y * z)));
        zb = (fabs(et * dots[k]) + fabs((double)b)) * 4.0 * U;
        ref += term;
        lb += zb + 8.0 * U * term;
        sg = 1.0 / (1.0 + exp(y * z));
        g = -scale * y * sg;
        gb = fabs(scale) * (zb / 4.0 + 8.0 * U * sg);
        rd[k] = dd0[k] + et * g;
        bd[k] = 2.0 * (et * gb + 4.0 * U * fabs(et * g) + U * fabs(rd[k]));
        st += et * dots[k] * g, bt += fabs(et * dots[k]) * gb + 4.0 * U * fabs(et * dots[k] * g);
        sb += g, bb += gb;
    }
    ref *= weight, lb = 2.0 * weight * lb;
    bt = 2.0 * bt + U * fabs(st), bb = 2.0 * bb + U * fabs(sb);
    KC->siglip_forward(&loss, dots, &t, &b, labels, same, N, M, diag, weight);
    KD->siglip_forward(d_loss, d_dots, d_t, d_b, d_lab, same, N, M, diag, weight);
    dev_down(&got[0], d_loss, sizeof(float));
    snprintf(what, sizeof(what), "siglip loss %dx%d%s", N, M, labels != NULL ? " masked" : "");
    check_bound(what, &got[0], &loss, &ref, &lb, 1);
    first = got[0];
    KD->siglip_forward(d_loss, d_dots, d_t, d_b, d_lab, same, N, M, diag, weight);
    dev_down(&got[0], d_loss, sizeof(float));
    check_same_bits("siglip loss, twice", &got[0], &first, 1);

    KC->siglip_backward(dd, &dt, &db, &dloss, dots, &t, &b, labels, same, N, M, diag, weight);
    KD->siglip_backward(d_dd, d_dt, d_db, d_dl, d_dots, d_t, d_b, d_lab, same, N, M, diag, weight);
    h = to_host(d_dd, n), check_bound("siglip ddots", h, dd, rd, bd, n), free(h);
    dev_down(&got[0], d_dt, sizeof(float)), dev_down(&got[1], d_db, sizeof(float));
    check_bound("siglip dt", &got[0], &dt, &st, &bt, 1);
    check_bound("siglip db", &got[1], &db, &sb, &bb, 1);

    free(dots), free(dd0), free(dd), free(rd), free(bd);
    dev_free(d_dots), dev_free(d_t), dev_free(d_b), dev_free(d_loss), dev_free(d_dl),
        dev_free(d_dd), dev_free(d_dt), dev_free(d_db), dev_free(d_lab);
}

/* token_mean and gather_rows with more outputs than their grids have threads (heads.cu's
 * grid_for caps a grid at 32 blocks of 256 per SM): B*C = 4096*1031 = 4.2M outputs, so each
 * thread goes round its grid-stride loop several times on any GPU of up to 512 SMs; each held
 * to the CPU's bits as above. */
static void heads_wrap_case(void)
{
    const int B = 4096, N = 3, C = 1031, T = 3;
    size_t nx = (size_t)B * N * C, ny = (size_t)B * C;
    float *x = rand_host(nx, -2, 2), *y = rand_host(ny, -1, 1), *gx = rand_host(nx, -1, 1);
    float *gy = rand_host(ny, -1, 1), *gx2 = copy_host(gx, nx), *h;
    float *d_x = to_dev(x, nx), *d_y = dev_alloc(ny * sizeof(float)), *d_gx = to_dev(gx, nx);
    float *d_gy = to_dev(gy, ny);
    int *idx = malloc((size_t)B * sizeof(int)), *d_idx;

    assert_non_null(idx);
    for (int b = 0; b < B; b++)
        idx[b] = (b * 7) % T;
    d_idx = ints_to_dev(idx, B);
    KC->token_mean_forward(y, x, B, N, C);
    KD->token_mean_forward(d_y, d_x, B, N, C);
    h = to_host(d_y, ny), check_exact("token_mean fwd 4096x3x1031", h, y, ny), free(h);
    KC->token_mean_backward(gx2, gy, B, N, C);
    KD->token_mean_backward(d_gx, d_gy, B, N, C);
    h = to_host(d_gx, nx), check_exact("token_mean bwd", h, gx2, nx), free(h);

    /* gather: rows of the (B, T, C) input x; y, gy the outputs and their gradient */
    KC->gather_rows_forward(y, x, idx, B, T, C);
    KD->gather_rows_forward(d_y, d_x, d_idx, B, T, C);
    h = to_host(d_y, ny), check_exact("gather_rows fwd 4096x3x1031", h, y, ny), free(h);
    KC->gather_rows_backward(gx2, gy, idx, B, T, C);
    KD->gather_rows_backward(d_gx, d_gy, d_idx, B, T, C);
    h = to_host(d_gx, nx), check_exact("gather_rows bwd", h, gx2, nx), free(h);

    free(x), free(y), free(gx), free(gy), free(gx2), free(idx);
    dev_free(d_x), dev_free(d_y), dev_free(d_gx), dev_free(d_gy), dev_free(d_idx);
}

static void body_heads(void)
{
    heads_exact_case();
    heads_wrap_case();
    siglip_gpu_case(100, 300, 37, 0.02f, NULL);
    siglip_gpu_case(3, 5, 0, 1.0f / 3.0f, NULL); /* one block */
    /* loss.mask_same_label: 300 columns of 7 labels, every 11th unknown (-1, never masked) */
    {
        int lab[300];
        for (int j = 0; j < 300; j++)
            lab[j] = j % 11 == 0 ? -1 : j % 7;
        siglip_gpu_case(100, 300, 37, 0.02f, lab);
    }
    /* 1024 x 1031 terms, past the grid's cap (SIG_MAX_GRID = 512 blocks of 256 threads, at
     * least 4 terms each): every thread takes eight or nine terms in its grid-stride loop; a
     * batch of 1024 with a diagonal shifted by 5 */
    siglip_gpu_case(1024, 1031, 5, 1.0f / 1024.0f, NULL);
}

#define OP_TEST(name)                     \
    static void test_##name(void **state) \
    {                                     \
        caught(body_##name);              \
    }
OP_TEST(matmul)
OP_TEST(matmul_tf32)
OP_TEST(matmul_bf16)
OP_TEST(memory_ops)
OP_TEST(elementwise)
OP_TEST(softmax)
OP_TEST(argmax)
OP_TEST(encoder)
OP_TEST(layernorm)
OP_TEST(attention)
OP_TEST(attention_bf16)
OP_TEST(sumsq)
OP_TEST(optimizers)
OP_TEST(heads)

static const struct CMUnitTest op_tests[] = {
    cmocka_unit_test(test_matmul),         cmocka_unit_test(test_matmul_tf32),
    cmocka_unit_test(test_matmul_bf16),    cmocka_unit_test(test_memory_ops),
    cmocka_unit_test(test_elementwise),    cmocka_unit_test(test_softmax),
    cmocka_unit_test(test_argmax),         cmocka_unit_test(test_encoder),
    cmocka_unit_test(test_layernorm),      cmocka_unit_test(test_attention),
    cmocka_unit_test(test_attention_bf16), cmocka_unit_test(test_sumsq),
    cmocka_unit_test(test_optimizers),     cmocka_unit_test(test_heads),
};

#ifdef TD_HAVE_CUDA

/* ---- errors, without a device --------------------------------------------------------------- */

/* The sticky set, and two of the codes that are not. */
static void test_sticky_classification(void **state)
{
    int sticky[] = {
        cudaErrorIllegalAddress,      cudaErrorLaunchTimeout,      cudaErrorAssert,
        cudaErrorHardwareStackError,  cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
        cudaErrorInvalidAddressSpace, cudaErrorInvalidPc,          cudaErrorLaunchFailure,
        cudaErrorECCUncorrectable,    cudaErrorContained};
    int fine[] = {cudaSuccess,
                  cudaErrorMemoryAllocation,
                  cudaErrorInvalidValue,
                  cudaErrorNotReady,
                  cudaErrorNoDevice,
                  cudaErrorInvalidDevice,
                  cudaErrorLaunchOutOfResources};

    for (size_t i = 0; i < sizeof(sticky) / sizeof(sticky[0]); i++)
        assert_true(td_cuda_error_is_sticky(sticky[i]));
    for (size_t i = 0; i < sizeof(fine) / sizeof(fine[0]); i++)
        assert_false(td_cuda_error_is_sticky(fine[i]));
    assert_false(td_cuda_poisoned());
}

static td_error_t panicked;

static void panic_with_oom(void)
{
    td__cuda_fail(cudaErrorMemoryAllocation, "../kernels/cuda/ops.cu", 42, "cudaMalloc(&p, n)");
}

static void panic_with_cublas(void)
{
    td__cublas_fail(CUBLAS_STATUS_INVALID_VALUE, "../kernels/cuda/ops.cu", 7, "cublasSgemm(...)");
}

static void catch_panic(void (*fn)(void))
{
    td_boundary b;

    td__boundary_top = NULL;
    memset(&panicked, 0, sizeof(panicked));
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        fn();
        td_boundary_leave(&b);
        fail_msg("no panic");
    }
    panicked = b.err;
}

/* The message a CUDA or cuBLAS failure panics with: file (without ../), line, the library's
 * name for the code, its message, the call. A non-sticky error does not poison. */
static void test_error_messages(void **state)
{
    catch_panic(panic_with_oom);
    assert_int_equal(panicked.code, TD_ECUDA);
    print_message("  %s\n", panicked.msg);
    assert_non_null(strstr(panicked.msg, "kernels/cuda/ops.cu:42: cudaErrorMemoryAllocation: "));
    assert_null(strstr(panicked.msg, "../"));
    assert_non_null(strstr(panicked.msg, "(cudaMalloc(&p, n))"));
    assert_false(td_cuda_poisoned());

    catch_panic(panic_with_cublas);
    assert_int_equal(panicked.code, TD_ECUDA);
    print_message("  %s\n", panicked.msg);
    assert_non_null(strstr(panicked.msg, "kernels/cuda/ops.cu:7: CUBLAS_STATUS_INVALID_VALUE: "));
}

/* An op on a thread without a context is a panic, not a crash. */
static void op_without_context(void)
{
    td_kernels_cuda()->zero(NULL, 1);
}

static void test_op_without_context(void **state)
{
    assert_null(td_cuda_ctx_current());
    catch_panic(op_without_context);
    assert_int_equal(panicked.code, TD_ESTATE);
}

static const struct CMUnitTest no_device_tests[] = {
    cmocka_unit_test(test_sticky_classification),
    cmocka_unit_test(test_error_messages),
    cmocka_unit_test(test_op_without_context),
};

/* ---- child processes ------------------------------------------------------------------------ */

/* How long a child may take: the sticky child takes a second or two, the NCCL timeout child
 * its 3 s deadline and a teardown. Past it the child is killed and the test fails, naming it,
 * so that a child stuck in the driver or in NCCL cannot hang the suite. */
#define CHILD_LIMIT_S 120 /* seconds */

/* Runs this executable again with mode as its argument (a fresh process: CUDA does not survive
 * fork, and a sticky error must not reach this one), its output into out. Returns its exit
 * status, or 128 + signal; fails the test (killing the child) when it runs past
 * CHILD_LIMIT_S. */
static int run_child(const char *mode, char *out, size_t outsize)
{
    int fd[2], status = 0, hung = 0;
    size_t used = 0;
    double deadline = td_mono_ms() + CHILD_LIMIT_S * 1e3;
    pid_t pid;

    assert_int_equal(pipe(fd), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(fd[1], 1);
        dup2(fd[1], 2);
        close(fd[0]);
        execl("/proc/self/exe", "test_gpu", mode, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    for (;;) {
        struct pollfd p = {.fd = fd[0], .events = POLLIN};
        double left = deadline - td_mono_ms();
        int n;
        ssize_t r;
        if (left <= 0) {
            hung = 1;
            break;
        }
        n = poll(&p, 1, (int)(left < 1000 ? left + 1 : 1000));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            continue;
        r = read(fd[0], out + used, outsize - 1 - used);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        used += (size_t)r;
        if (used == outsize - 1)
            break;
    }
    out[used] = '\0';
    close(fd[0]);
    if (hung)
        kill(pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    if (hung)
        fail_msg("the child %s hung: killed after %d s; its output:\n%s", mode, CHILD_LIMIT_S, out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* How a child ends: its output flushed, then _exit, never exit(). The NCCL child has just
 * aborted a non-blocking communicator, whose teardown NCCL's own threads may still be running;
 * exit() would run the CUDA runtime's and NCCL's exit-time destructors under them (issue 12:
 * "a child that exits right after a non-blocking ncclCommAbort races NCCL's teardown thread"),
 * and the sticky child's context is broken, whose teardown can only fail. _exit ends every
 * thread at once, and the driver takes the device's resources back with the process. */
__attribute__((noreturn)) static void child_exit(int rc)
{
    fflush(stdout);
    fflush(stderr);
    _exit(rc);
}

/* The child of test_sticky_error: an illegal store, then the sync that reports it. Exit 0 when
 * the panic came with cudaErrorIllegalAddress, the error is classified sticky, the process is
 * marked poisoned and the context stays broken; else the number of the check that failed. */
static int sticky_child(void)
{
    td_cuda_ctx *c = NULL;
    td_error_t err = {0};
    td_boundary b;
    void *p = NULL;
    int rc;

    alarm(60);
    if (td_cuda_ctx_new(&c, 0, NULL, &err) != 0) {
        printf("context: %s\n", err.msg);
        return 10;
    }
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_cuda_fault_illegal_address();
        td_cuda_sync();
        td_boundary_leave(&b);
        printf("the illegal store was not reported\n");
        return 11;
    }
    printf("panic: %s: %s\n", td_errname(b.err.code), b.err.msg);
    if (b.err.code != TD_ECUDA || strstr(b.err.msg, "cudaErrorIllegalAddress") == NULL)
        return 12;
    if (!td_cuda_error_is_sticky(cudaErrorIllegalAddress) || !td_cuda_poisoned())
        return 13;
    rc = td_cuda_alloc(&p, MiB, &err);
    printf("cudaMalloc afterwards: %s\n", rc == 0 ? "succeeded" : err.msg);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_cuda_sync();
        td_boundary_leave(&b);
        printf("the context works again after a sticky error\n");
        return 14;
    }
    printf("sync afterwards: %s\n", b.err.msg);
    return 0;
}

/* The child of test_nccl_init_timeout: rank 0 of a communicator of 2 whose rank 1 never comes
 * must fail after the timeout, not hang. */
static int nccl_timeout_child(void)
{
    td_cuda_ctx *c = NULL;
    td_nccl *comm = NULL;
    td_nccl_id id;
    td_error_t err = {0};
    int rc;

    alarm(30); /* an abort that hangs is a failure too */
    if (td_cuda_ctx_new(&c, 0, NULL, &err) != 0 || td_nccl_unique_id(&id, &err) != 0) {
        printf("setup: %s\n", err.msg);
        return 10;
    }
    rc = td_nccl_init(&comm, &id, 2, 0, c, 3.0, &err);
    printf("td_nccl_init: %d: %s\n", rc, err.msg);
    if (rc != TD_ECUDA || comm != NULL || strstr(err.msg, "did not complete within 3 s") == NULL)
        return 11;
    td_cuda_ctx_free(c);
    return 0;
}

static void test_sticky_error(void **state)
{
    char out[4096];
    int rc = run_child("--sticky-child", out, sizeof(out));

    print_message("%s", out);
    if (rc != 0)
        fail_msg("sticky child exited %d", rc);
    assert_false(td_cuda_poisoned()); /* this process is untouched */
}

static void test_nccl_init_timeout(void **state)
{
    char out[4096];
    int rc = run_child("--nccl-timeout-child", out, sizeof(out));

    print_message("%s", out);
    if (rc != 0)
        fail_msg("NCCL timeout child exited %d", rc);
}

/* ---- NCCL -------------------------------------------------------------------------------------
 */

#define AR_N 1000003 /* floats all-reduced */

typedef struct rank_job {
    int rank, nranks;
    int skip; /* never call the all-reduce, and stay 5 s (its peer must time out first) */
    double timeout_s;
    const td_nccl_id *id;
    int rc;         /* 0, or the failure's code */
    char msg[1024]; /* what failed */
    double max_err; /* against the exact mean */
} rank_job;

/* One worker thread per GPU, as the daemon has them: its own context and communicator rank;
 * rank r's buffer holds (r+1) * (i % 1000), whose mean over 2 ranks is exact in float. */
static void *rank_main(void *arg)
{
    rank_job *j = arg;
    td_cuda_ctx *c = NULL;
    td_nccl *comm = NULL;
    td_error_t err = {0};
    td_boundary b;
    float *h = malloc(AR_N * sizeof(float)), *d = NULL;

    if (td_cuda_ctx_new(&c, j->rank, NULL, &err) != 0 ||
        td_nccl_init(&comm, j->id, j->nranks, j->rank, c, j->timeout_s, &err) != 0 ||
        td_cuda_alloc((void **)&d, AR_N * sizeof(float), &err) != 0) {
        j->rc = err.code;
        snprintf(j->msg, sizeof(j->msg), "%s", err.msg);
        goto out;
    }
    for (size_t i = 0; i < AR_N; i++)
        h[i] = (float)(j->rank + 1) * (float)(i % 1000);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_cuda_upload(d, h, AR_N * sizeof(float));
        if (!j->skip) {
            td_nccl_allreduce_avg(comm, d, AR_N);
            /* a kernel launched right after the collective, as the trainer's grad norm is:
             * its launch check must not see an error the watchdog's polling left behind */
            td_kernels_cuda()->scale(d, 1.0f, AR_N);
        }
        td_cuda_download(h, d, AR_N * sizeof(float));
        td_boundary_leave(&b);
    } else {
        j->rc = b.err.code;
        snprintf(j->msg, sizeof(j->msg), "%s", b.err.msg);
        goto out;
    }
    if (j->skip)
        sleep(5);
    for (size_t i = 0; i < AR_N && !j->skip; i++) {
        double want = (double)(i % 1000) * (j->nranks + 1) / 2.0;
        j->max_err = fmax(j->max_err, fabs(h[i] - want));
    }
out:
    td_cuda_free(d);
    td_nccl_free(comm);
    td_cuda_ctx_free(c);
    free(h);
    return NULL;
}

static void run_ranks(rank_job *jobs, int n)
{
    pthread_t th[8];
    td_nccl_id id;
    td_error_t err = {0};

    if (td_nccl_unique_id(&id, &err) != 0)
        fail_msg("%s", err.msg);
    for (int r = 0; r < n; r++) {
        jobs[r].id = &id;
        assert_int_equal(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
    }
    for (int r = 0; r < n; r++)
        pthread_join(th[r], NULL);
}

/* One rank on one GPU: the whole NCCL path (init, all-reduce, watchdog, finalize) with the
 * identity for an answer. */
static void test_nccl_one_rank(void **state)
{
    rank_job j = {.rank = 0, .nranks = 1, .timeout_s = 60};

    run_ranks(&j, 1);
    if (j.rc != 0)
        fail_msg("%s", j.msg);
    assert_true(j.max_err == 0.0);
}

/* Two GPUs: the mean is exact (small integers over 2). Then rank 1 skips the all-reduce and
 * rank 0's watchdog must fail it after its 2 s, with the message the daemon reports. */
static void test_nccl_two_gpus(void **state)
{
    rank_job j[2] = {{.rank = 0, .nranks = 2, .timeout_s = 60},
                     {.rank = 1, .nranks = 2, .timeout_s = 60}};
    int n = 0;

    assert_int_equal(td_cuda_device_count(&n), 0);
    if (n < 2) {
        print_message("  one GPU: the 2-GPU all-reduce is not run\n");
        skip();
    }
    run_ranks(j, 2);
    for (int r = 0; r < 2; r++) {
        if (j[r].rc != 0)
            fail_msg("rank %d: %s", r, j[r].msg);
        assert_true(j[r].max_err == 0.0);
    }

    memset(j, 0, sizeof(j));
    j[0] = (rank_job){.rank = 0, .nranks = 2, .timeout_s = 2};
    j[1] = (rank_job){.rank = 1, .nranks = 2, .timeout_s = 2, .skip = 1};
    run_ranks(j, 2);
    print_message("  rank 0 without its peer: %s\n", j[0].msg);
    assert_int_equal(j[0].rc, TD_ECUDA);
    assert_non_null(strstr(j[0].msg, "NCCL all-reduce did not complete within 2 s"));
}

/* ---- the memory guard -------------------------------------------------------------------------
 */

/* GPT-2 124M's shape with AdamW: the largest batch whose estimate fits what the device has
 * free (less the context already made, whose workspace the estimate counts, and a reserve)
 * really allocates: the parameter, gradient and moment buffers and the arena as separate
 * cudaMallocs, as a GPU trainer would make them. cudaMemGetInfo's drop must be their sum
 * within 2 MiB per allocation (the driver's page) plus 64 MiB (its bookkeeping). A batch the
 * estimate says does not fit really fails: cudaErrorMemoryAllocation, not sticky, and the
 * context still works afterwards. */
static void body_memory_guard(void)
{
    td_cuda_ctx *c = td_cuda_ctx_current();
    size_t free0, total, free1, sum, reserve = 512 * MiB;
    td_train_config cfg;
    td_mem_estimate e;
    td_error_t err = {0};
    void *p[4] = {NULL, NULL, NULL, NULL}, *big = NULL;
    size_t sizes[4];
    int batch = 0, rc;

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_GPT;
    cfg.data = TD_DATA_TOKENS;
    cfg.n_layer = 12, cfg.n_head = 12, cfg.n_embd = 768, cfg.seq_len = 1024;
    cfg.vocab_size = 50257;
    cfg.kernels = td_kernels_cuda(); /* the estimate counts the context's workspace */
    assert_int_equal(td_cuda_mem_info(td_cuda_ctx_device(c), &free0, &total, &err), 0);
    rc = td_train_largest_batch(&cfg,
                                free0 + TD_CUDA_CUBLAS_WORKSPACE + TD_CUDA_SCRATCH_DEFAULT +
                                    TD_CUDA_CTX_FIXED - reserve,
                                &batch, &err);
    if (rc != 0)
        fail_msg("largest batch: %s", err.msg);
    cfg.batch_size = batch;
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), 0);
    print_message("  %zu MiB free of %zu: GPT-2 124M fits a batch of %d (%zu MiB estimated, of "
                  "which activations %zu MiB, attention scores %zu MiB)\n",
                  free0 / MiB, total / MiB, batch, e.total / MiB, e.activations / MiB,
                  e.attention / MiB);
    assert_true(batch >= 1);

    sizes[0] = e.params, sizes[1] = e.grads, sizes[2] = e.optim, sizes[3] = e.activations;
    sum = 0;
    for (int i = 0; i < 4; i++) {
        if (td_cuda_alloc(&p[i], sizes[i], &err) != 0)
            fail_msg("the estimate said batch %d fits, but: %s", batch, err.msg);
        sum += sizes[i];
    }
    assert_int_equal(td_cuda_mem_info(td_cuda_ctx_device(c), &free1, &total, &err), 0);
    print_message("  allocated %zu MiB, cudaMemGetInfo's free fell by %zu MiB\n", sum / MiB,
                  (free0 - free1) / MiB);
    assert_true(free0 - free1 >= sum);
    assert_true(free0 - free1 <= sum + 4 * 2 * MiB + 64 * MiB);
    for (int i = 0; i < 4; i++)
        td_cuda_free(p[i]);

    /* twice the batch: the estimate refuses it, and so does the device */
    cfg.batch_size = 2 * batch + 2;
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), 0);
    assert_true(e.total - e.workspace > free0);
    rc = td_cuda_alloc(&big, e.params + e.grads + e.optim + e.activations, &err);
    print_message("  batch %d (%zu MiB): %s\n", cfg.batch_size, e.total / MiB,
                  rc != 0 ? err.msg : "allocated?");
    assert_int_equal(rc, TD_ECUDA);
    assert_non_null(strstr(err.msg, "cudaErrorMemoryAllocation"));
    assert_false(td_cuda_poisoned());
    assert_int_equal(td_cuda_alloc(&big, MiB, &err), 0);
    td_cuda_free(big);
    td_cuda_sync();
}

OP_TEST(memory_guard)

/* td_cuda_peak_flops on this device: a known device gets bf16 >= TF32 >= fp32 > 0, at most the
 * datasheet's largest figure (scaling never raises it), and an H100/H200 SXM with all its 132
 * SMs at 1980 MHz exactly the datasheet's 989.4, 494.7 and 66.9 TFLOP/s; an unknown device
 * TD_ENOTFOUND naming it. A bad device number is TD_ECUDA. */
static void test_peak_flops(void **state)
{
    double bf = 0, tf = 0, fp = 0;
    td_error_t err = {0};
    struct cudaDeviceProp prop;
    int rc = td_cuda_peak_flops(0, 1, 0, &bf, &err), clock_khz = 0;

    assert_int_equal(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    (void)cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    if (rc == TD_ENOTFOUND) {
        print_message("  %s: %s\n", prop.name, err.msg);
        assert_non_null(strstr(err.msg, prop.name));
        return;
    }
    assert_int_equal(rc, 0);
    assert_int_equal(td_cuda_peak_flops(0, 0, 1, &tf, &err), 0);
    assert_int_equal(td_cuda_peak_flops(0, 0, 0, &fp, &err), 0);
    print_message("  %s (%d SMs, %d MHz): bf16 %.1f, tf32 %.1f, fp32 %.1f TFLOP/s\n", prop.name,
                  prop.multiProcessorCount, clock_khz / 1000, bf / 1e12, tf / 1e12, fp / 1e12);
    assert_true(bf >= tf && tf >= fp && fp > 0);
    assert_true(bf <= 989.4e12 * 1.0000001);
    if ((strstr(prop.name, "H100") != NULL || strstr(prop.name, "H200") != NULL) &&
        strstr(prop.name, "NVL") == NULL && strstr(prop.name, "PCIe") == NULL &&
        prop.multiProcessorCount == 132 && clock_khz >= 1980000) {
        assert_true(fabs(bf - 989.4e12) < 1e9);
        assert_true(fabs(tf - 494.7e12) < 1e9);
        assert_true(fabs(fp - 66.9e12) < 1e9);
    }
    assert_int_equal(td_cuda_peak_flops(1 << 20, 1, 0, &bf, &err), TD_ECUDA);
    (void)cudaGetLastError();
}

/* ---- the trainer on CUDA, end to end ----------------------------------------------------------
 *
 * The engine (train/) built with cfg.kernels = td_kernels_cuda() on this thread's context
 * (bound by gpu_setup), against the same job on the CPU table, through nothing but train.h:
 * a small GPT on a text file and an mlp on IDX files the tests write, 10 steps each, seed 1,
 * train_loss compared step by step (td_train_hooks.metric).
 *  - CUDA fp32 within 1e-4 relative of the CPU: the two compute the same float operations
 *    but for the order of their sums (matmuls, layernorm, softmax, attention), each op within
 *    its few-ulp bound above; 10 AdamW steps carry such differences along without much growth
 *    (the step is lr times about m/sqrt(v), which a relative change of 1e-6 in the gradient
 *    moves by about as much), so 1e-4 is 100 times what one expects and still catches any op
 *    that is wrong (a wrong op moves the loss in the second or first digit).
 *  - CUDA bf16 within 2e-2 relative: every matmul's operands lose all but 8 significant bits,
 *    so each matmul output is off by about 2^-8 relative (2^-7 at worst, see check_bound_dev);
 *    the logits at step 1 and so the loss move by a few 1e-3 of the loss, and the ten steps
 *    after it follow a slightly different trajectory (AdamW's normalised steps amplify the
 *    gradients' rounding for small components). 2e-2 is what PyTorch autocast's bf16 runs
 *    typically keep to their fp32 twins over short runs, with room; a wrong op is still far
 *    outside it. The bf16 run must also differ from the CPU's somewhere: if it does not, the
 *    trainer did not compute on the device at all (cfg.kernels ignored).
 *  - A checkpoint written by the CUDA trainer (bf16) resumes bit-exactly on CUDA: the losses
 *    of steps 6..10 after a resume at step 5 equal those of the uninterrupted run, bit for bit
 *    (every op of the CUDA table gives the same bits every run, cuBLAS included). */

#define E2E_STEPS 10
#define E2E_MAX   64 /* losses compared */

/* The losses of one run, from tt_recorder (train_support.h). */
typedef struct e2e_rec {
    int n;
    double loss[E2E_MAX];
    int64_t step[E2E_MAX];
} e2e_rec;

/* An IDX image file (n x 8 x 8) and its labels: class k lights up quadrant k (of 4), with
 * noise everywhere; 10 classes, the other 6 rare. */
static void e2e_write_idx(td_idx_split *split, int n)
{
    uint32_t idims[3] = {(uint32_t)n, 8, 8}, ldims[1] = {(uint32_t)n};
    uint8_t *img = malloc((size_t)n * 64), *lab = malloc((size_t)n);
    uint64_t s = 7;

    assert_non_null(img), assert_non_null(lab);
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((s >> 33) % 12);
        k = k < 10 ? k % 4 : 4 + k % 6;
        lab[i] = (uint8_t)k;
        for (int p = 0; p < 64; p++) {
            int q = (p / 8 >= 4) * 2 + (p % 8 >= 4);
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            img[(size_t)i * 64 + p] = (uint8_t)((q == k ? 150 : 0) + (int)((s >> 33) % 100));
        }
    }
    tt_path_of(split->images, "train-images");
    tt_path_of(split->labels, "train-labels");
    tt_write_idx(split->images, 0, TD_IDX_MAGIC_IMAGES, idims, 3, img, (size_t)n * 64);
    tt_write_idx(split->labels, 0, TD_IDX_MAGIC_LABELS, ldims, 1, lab, (size_t)n);
    free(img), free(lab);
}

/* The GPT job: L=2, C=64, NH=4, T=64, V=256 (bytes), batch 4, 10 steps, AdamW 1e-3, seed 1 */
static void e2e_gpt_config(td_train_config *cfg)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_GPT;
    cfg->data = TD_DATA_TEXT;
    cfg->n_layer = 2, cfg->n_head = 4, cfg->n_embd = 64, cfg->seq_len = 64;
    cfg->vocab_size = 256;
    tt_path_of(cfg->train_files[0], "text.txt");
    tt_write_text(cfg->train_files[0], 40000);
    cfg->n_train_files = 1;
    cfg->batch_size = 4;
    cfg->lr = 1e-3f;
    cfg->max_steps = E2E_STEPS;
    cfg->seed = 1;
    cfg->threads = 1;
}

/* The mlp job: 64-32-10 on 512 samples, batch 32, 10 steps, AdamW 1e-2, seed 1 */
static void e2e_mlp_config(td_train_config *cfg)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_MLP;
    cfg->data = TD_DATA_IDX;
    cfg->layers[0] = 64, cfg->layers[1] = 32, cfg->layers[2] = 10;
    cfg->n_layers = 3;
    e2e_write_idx(&cfg->train, 512);
    cfg->batch_size = 32;
    cfg->lr = 1e-2f;
    cfg->max_steps = E2E_STEPS;
    cfg->seed = 1;
    cfg->threads = 1;
}

/* Builds a trainer for cfg on table k (the CUDA one computing at bf16 or fp32 on this
 * thread's context), takes up to steps steps recording train_loss into r, frees it. */
static void e2e_run(td_train_config *cfg, const td_kernels *k, int bf16, e2e_rec *r, int64_t steps)
{
    static tt_recorder all;
    td_cuda_ctx *c = fake ? NULL : td_cuda_ctx_current();
    td_train_hooks hooks = {.ud = &all, .metric = tt_record};
    td_trainer *t = NULL;
    td_error_t err = {0};
    int done = 0;

    if (c != NULL) {
        td_cuda_ctx_set_tf32(c, 0);
        td_cuda_ctx_set_bf16(c, k == KD && bf16);
    }
    cfg->kernels = k;
    cfg->precision = bf16 ? TD_PRECISION_BF16 : TD_PRECISION_FP32;
    cfg->tf32 = 0;
    memset(&all, 0, sizeof(all));
    if (td_trainer_new(&t, cfg, &hooks, &err) != 0)
        fail_msg("td_trainer_new (%s%s): %s: %s", k->name, bf16 ? " bf16" : "",
                 td_errname(err.code), err.msg);
#ifdef TD_HAVE_CUDA
    if (c != NULL && k == KD) { /* the batch stage is page-locked: its uploads are DMAs */
        struct cudaPointerAttributes at;
        assert_non_null(td_trainer_stage(t));
        assert_int_equal(cudaPointerGetAttributes(&at, td_trainer_stage(t)), cudaSuccess);
        assert_int_equal(at.type, cudaMemoryTypeHost);
    }
#endif
    for (int64_t s = 0; s < steps && !done; s++) {
        done = td_trainer_step_caught(t, &err);
        if (done < 0) {
            long long at = (long long)td_trainer_steps_done(t) + 1;
            td_trainer_free(t);
            fail_msg("%s%s step %lld: %s: %s", k->name, bf16 ? " bf16" : "", at,
                     td_errname(err.code), err.msg);
        }
    }
    td_trainer_free(t);
    if (c != NULL)
        td_cuda_ctx_set_bf16(c, 0);
    r->n = tt_values_of(&all, "train_loss", r->loss, r->step, E2E_MAX);
}

/* got's losses against want's, step by step, within rel; returns how many differ at all */
static int e2e_compare(const char *what, const e2e_rec *got, const e2e_rec *want, double rel)
{
    double worst = 0.0;
    int differ = 0;

    assert_int_equal(got->n, want->n);
    assert_true(want->n >= E2E_STEPS);
    for (int i = 0; i < want->n; i++) {
        double d = fabs(got->loss[i] - want->loss[i]);
        assert_int_equal(got->step[i], want->step[i]);
        if (!(d <= rel * fabs(want->loss[i])))
            fail_msg("%s: train_loss at step %lld is %.9g, the CPU's %.9g (tolerance %.1g "
                     "relative)",
                     what, (long long)want->step[i], got->loss[i], want->loss[i], rel);
        worst = fmax(worst, d / fabs(want->loss[i]));
        differ += got->loss[i] != want->loss[i];
    }
    print_message("  %-14s %d steps, loss %.4f -> %.4f, largest difference %.2g relative (%d "
                  "steps not identical)\n",
                  what, want->n, got->loss[0], got->loss[got->n - 1], worst, differ);
    return differ;
}

static void e2e_three_ways(td_train_config *cfg, const char *name)
{
    static e2e_rec cpu, f32, b16;
    char what[64];

    memset(&cpu, 0, sizeof(cpu)), memset(&f32, 0, sizeof(f32)), memset(&b16, 0, sizeof(b16));
    e2e_run(cfg, KC, 0, &cpu, E2E_STEPS);
    e2e_run(cfg, KD, 0, &f32, E2E_STEPS);
    e2e_run(cfg, KD, 1, &b16, E2E_STEPS);
    print_message("  %s: CPU loss %.4f -> %.4f\n", name, cpu.loss[0], cpu.loss[cpu.n - 1]);
    snprintf(what, sizeof(what), "%s fp32", name);
    e2e_compare(what, &f32, &cpu, 1e-4);
    snprintf(what, sizeof(what), "%s bf16", name);
    if (e2e_compare(what, &b16, &cpu, 2e-2) == 0 && !fake)
        fail_msg("%s: bf16 on CUDA gave the CPU's losses bit for bit: the trainer did not "
                 "compute with td_kernels_cuda() (cfg.kernels ignored?)",
                 name);
}

/* The sensorlm job: the tiny preset's shape, scaled down (both towers D 32, 2 blocks, 4
 * heads, M 64, E 32) on 64 windows of 24 x 3 in patches of 4 x 2, L 24, batch 8, 10 steps,
 * AdamW 1e-3, seed 1: every new op, the fused attention (causal and not, the MAP's one query),
 * the embedding, in one step. */
static void e2e_slm_config(td_train_config *cfg)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_SENSORLM;
    cfg->data = TD_DATA_SENSOR;
    tt_path_of(cfg->train_files[0], "sensor.bin");
    tt_write_sensor(cfg->train_files[0], 64, 24, 3, 24, 1);
    cfg->n_train_files = 1;
    cfg->slm.patch_t = 4, cfg->slm.patch_c = 2, cfg->slm.text_len = 24, cfg->slm.embed_dim = 32;
    cfg->slm.s_width = cfg->slm.t_width = 32, cfg->slm.s_depth = cfg->slm.t_depth = 2;
    cfg->slm.s_heads = cfg->slm.t_heads = 4, cfg->slm.s_mlp = cfg->slm.t_mlp = 64;
    cfg->batch_size = 8;
    cfg->lr = 1e-3f;
    cfg->max_steps = E2E_STEPS;
    cfg->seed = 1;
    cfg->threads = 1;
}

static void body_train_sensorlm(void)
{
    td_train_config cfg;

    e2e_slm_config(&cfg);
    e2e_three_ways(&cfg, "sensorlm");
}

static void body_train_gpt(void)
{
    td_train_config cfg;

    e2e_gpt_config(&cfg);
    e2e_three_ways(&cfg, "gpt");
}

static void body_train_mlp(void)
{
    td_train_config cfg;

    e2e_mlp_config(&cfg);
    e2e_three_ways(&cfg, "mlp");
}

/* Run A: 10 steps, a checkpoint every 5, into a directory of its own. Run B: the same job into
 * another directory, stopped after 5 steps (its checkpoint at step 5 written), then a new
 * trainer on that directory, which resumes at step 5 and takes steps 6..10. */
static void body_train_resume(void)
{
    static e2e_rec a, b1, b2;
    td_train_config cfg;
    char dir_a[TD_PATH_MAX], dir_b[TD_PATH_MAX];

    memset(&a, 0, sizeof(a)), memset(&b1, 0, sizeof(b1)), memset(&b2, 0, sizeof(b2));
    e2e_gpt_config(&cfg);
    cfg.checkpoint_every = 5;
    tt_path_of(dir_a, "ckpt-a");
    tt_path_of(dir_b, "ckpt-b");
    assert_int_equal(mkdir(dir_a, 0700), 0);
    assert_int_equal(mkdir(dir_b, 0700), 0);

    snprintf(cfg.checkpoint_dir, TD_PATH_MAX, "%s", dir_a);
    e2e_run(&cfg, KD, 1, &a, E2E_STEPS);
    snprintf(cfg.checkpoint_dir, TD_PATH_MAX, "%s", dir_b);
    e2e_run(&cfg, KD, 1, &b1, 5);
    e2e_run(&cfg, KD, 1, &b2, E2E_STEPS);

    assert_int_equal(a.n, E2E_STEPS);
    assert_int_equal(b1.n, 5);
    assert_int_equal(b2.n, E2E_STEPS - 5);
    for (int i = 0; i < 5; i++)
        if (memcmp(&b1.loss[i], &a.loss[i], sizeof(double)) != 0)
            fail_msg("two CUDA runs of one job differ at step %d: %.9g and %.9g", i + 1, b1.loss[i],
                     a.loss[i]);
    for (int i = 0; i < b2.n; i++) {
        assert_int_equal(b2.step[i], 6 + i);
        if (memcmp(&b2.loss[i], &a.loss[5 + i], sizeof(double)) != 0)
            fail_msg("resumed at step 5, step %d's loss is %.9g, the uninterrupted run's %.9g",
                     6 + i, b2.loss[i], a.loss[5 + i]);
    }
    print_message("  resumed at step 5 on CUDA (bf16): steps 6..10 bit-identical (loss %.6f)\n",
                  b2.loss[b2.n - 1]);
}

OP_TEST(train_gpt)
OP_TEST(train_mlp)
OP_TEST(train_resume)
OP_TEST(train_sensorlm)

static int e2e_setup(void **state)
{
    return tt_tmpdir_make("/tmp/td_gpu_e2e_XXXXXX");
}

static int e2e_teardown(void **state)
{
    return tt_tmpdir_remove();
}

static const struct CMUnitTest trainer_tests[] = {
    cmocka_unit_test(test_train_gpt),
    cmocka_unit_test(test_train_mlp),
    cmocka_unit_test(test_train_resume),
    cmocka_unit_test(test_train_sensorlm),
};

static td_cuda_ctx *main_ctx;

static int gpu_setup(void **state)
{
    td_error_t err = {0};

    if (td_cuda_ctx_new(&main_ctx, 0, NULL, &err) != 0) {
        print_error("%s\n", err.msg);
        return -1;
    }
    return 0;
}

static int gpu_teardown(void **state)
{
    td_cuda_ctx_free(main_ctx);
    return 0;
}

/* The memory guard first: cudaMemGetInfo's figures are steadiest before the other tests'
 * processes and communicators have come and gone. */
static const struct CMUnitTest device_tests[] = {
    cmocka_unit_test(test_memory_guard),      cmocka_unit_test(test_sticky_error),
    cmocka_unit_test(test_nccl_init_timeout), cmocka_unit_test(test_nccl_one_rank),
    cmocka_unit_test(test_nccl_two_gpus),     cmocka_unit_test(test_peak_flops),
};

#endif /* TD_HAVE_CUDA */

int main(int argc, char **argv)
{
    KC = td_kernels_cpu();
    KC->set_threads(1);
    if (argc > 1 && strcmp(argv[1], "--fake-device") == 0) {
        fake = 1;
        KD = KC;
#ifdef TD_HAVE_CUDA
        if (argc > 2 && strcmp(argv[2], "--trainer") == 0) {
            int failed;
            if (e2e_setup(NULL) != 0)
                return 1;
            failed = cmocka_run_group_tests_name("the trainer, the CPU standing in", trainer_tests,
                                                 NULL, NULL);
            e2e_teardown(NULL);
            return failed != 0;
        }
#endif
        return cmocka_run_group_tests_name("ops, the CPU standing in", op_tests, NULL, NULL);
    }
#ifndef TD_HAVE_CUDA
    printf("built without CUDA: skipped\n");
    return 77;
#else
    int failed, n = 0;

    if (argc > 1 && strcmp(argv[1], "--sticky-child") == 0)
        child_exit(sticky_child());
    if (argc > 1 && strcmp(argv[1], "--nccl-timeout-child") == 0)
        child_exit(nccl_timeout_child());
    failed = cmocka_run_group_tests_name("without a device", no_device_tests, NULL, NULL);
    if (failed != 0)
        return 1;
    if (td_cuda_device_count(&n) != 0 || n == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    KD = td_kernels_cuda();
    failed +=
        cmocka_run_group_tests_name("CUDA ops against the CPU", op_tests, gpu_setup, gpu_teardown);
    failed += cmocka_run_group_tests_name("CUDA devices", device_tests, gpu_setup, gpu_teardown);
    if (e2e_setup(NULL) != 0) {
        printf("cannot make a temporary directory: %s\n", strerror(errno));
        return 1;
    }
    failed +=
        cmocka_run_group_tests_name("the trainer on CUDA", trainer_tests, gpu_setup, gpu_teardown);
    e2e_teardown(NULL);
    return failed != 0;
#endif
}
