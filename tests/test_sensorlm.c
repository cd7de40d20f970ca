/* Unit tests of SensorLM (train/sensorlm.c, slm_data.c, slm_eval.c, the two-tower ops of
 * train/engine.c and their kernels): every new op's tape gradient against central differences,
 * SigLIP's loss and gradients against a double-precision reference (and, with
 * loss.mask_same_label, against the README's masked equations and central differences, and bit
 * for bit the unmasked loss when no two labels are equal), the whole model's gradient against
 * central differences (both poolings), the parameters' names, shapes and count, the windows'
 * patches and the captions' tokens exactly as the README has them, the arena's exact
 * accounting, and the trainer: it learns, allocates nothing per step, resumes bit for bit,
 * gives 2 and 3 replicas the loss of one within 1e-5 (masked too), computes on the fake device
 * the CPU's bits, and embeds through the embedder what its evaluation ranks. Each numerical
 * check states its tolerance and why. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "train/engine.h"
#include "tests/fake_device.h"
#include "train/sensor.h"
#include "train/sizes.h"
#include "train/slm.h"
#include "common/td_panic.h"
#include "train/train.h"
#include "tests/train_support.h"

static char train_path[TD_PATH_MAX], valid_path[TD_PATH_MAX];

/* ---- counting allocations (as test_gpt.c) --------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define COUNT_ALLOCATIONS 0
#else
#define COUNT_ALLOCATIONS 1
#endif

static _Atomic int counting;
static _Atomic long allocations;

#if COUNT_ALLOCATIONS
extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);

void *malloc(size_t n)
{
    if (counting)
        allocations++;
    return __libc_malloc(n);
}

void *calloc(size_t n, size_t size)
{
    if (counting)
        allocations++;
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t n)
{
    if (counting)
        allocations++;
    return __libc_realloc(p, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    if (counting)
        allocations++;
    return __libc_memalign(align, n);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    if (counting)
        allocations++;
    *out = __libc_memalign(align, n);
    return *out != NULL ? 0 : 12 /* ENOMEM */;
}
#endif

/* ---- fixtures ---------------------------------------------------------------------------------
 */

#define T_STEPS 24 /* the test shards' windows: 24 steps of 3 channels */
#define C_CH    3

/* A small sensorlm on the test shards: patches of 4 steps x 2 channels (N = 6 * 2 = 12, the
 * third channel padded), both towers D 16, 1 block, 2 heads, M 32; L 24 (every caption
 * whole); E 8; B 8. */
static void slm_config(td_train_config *cfg)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_SENSORLM;
    cfg->data = TD_DATA_SENSOR;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", train_path);
    snprintf(cfg->valid_files[0], TD_PATH_MAX, "%s", valid_path);
    cfg->n_train_files = cfg->n_valid_files = 1;
    cfg->slm.patch_t = 4;
    cfg->slm.patch_c = 2;
    cfg->slm.s_width = cfg->slm.t_width = 16;
    cfg->slm.s_depth = cfg->slm.t_depth = 1;
    cfg->slm.s_heads = cfg->slm.t_heads = 2;
    cfg->slm.s_mlp = cfg->slm.t_mlp = 32;
    cfg->slm.text_len = 24;
    cfg->slm.embed_dim = 8;
    cfg->batch_size = 8;
    cfg->lr = 1e-3f;
    cfg->schedule = TD_SCHED_RSQRT;
    cfg->warmup = 0.1f;
    cfg->cooldown = 0.1f;
    cfg->max_steps = 12;
    cfg->eval_every = 6;
    cfg->threads = 1;
}

static int64_t run_steps(td_trainer *t, int64_t max)
{
    td_error_t e = {0};
    int64_t n = 0;
    int done = 0;

    while (!done && n < max) {
        done = td_trainer_step_caught(t, &e);
        if (done < 0)
            fail_msg("panic at step %lld: %s: %s", (long long)td_trainer_steps_done(t) + 1,
                     td_errname(e.code), e.msg);
        n++;
    }
    return n;
}

static td_trainer *new_trainer(const td_train_config *cfg, tt_recorder *r)
{
    td_train_hooks hooks = {.ud = r, .metric = tt_record};
    td_trainer *t = NULL;
    td_error_t err = {0};

    if (r != NULL)
        memset(r, 0, sizeof(*r));
    if (td_trainer_new(&t, cfg, r != NULL ? &hooks : NULL, &err) != 0)
        fail_msg("td_trainer_new: %s: %s", td_errname(err.code), err.msg);
    return t;
}

static void expect_new_fails(const td_train_config *cfg, int code, const char *n1, const char *n2)
{
    td_trainer *t = (td_trainer *)1;
    td_error_t err = {0};

    assert_int_equal(td_trainer_new(&t, cfg, NULL, &err), code);
    assert_null(t);
    if (n1 != NULL && strstr(err.msg, n1) == NULL)
        fail_msg("message '%s' lacks '%s'", err.msg, n1);
    if (n2 != NULL && strstr(err.msg, n2) == NULL)
        fail_msg("message '%s' lacks '%s'", err.msg, n2);
}

/* ---- the ops' gradients ------------------------------------------------------------------------
 */

#define MAX_IN 3

/* One op over inputs in[0..n) and the objective L = sum r_i out_i (L = out for a loss). */
typedef struct op_case {
    const char *name;
    td_tensor *(*fn)(td_ctx *c, struct op_case *o);
    int n;
    int ndim[MAX_IN];
    int shape[MAX_IN][4];
    unsigned grads; /* bit i: in[i] has a gradient */
    td_tensor *in[MAX_IN];
    float *r;
    int idx[8]; /* gather_rows' rows */
    int world;  /* allgather_rows: 2, with half_with_nobody for the all-reduce; else 0 */
} op_case;

/* The all-reduce of a replica whose one peer contributes zeros: the average halves the buffer.
 * The gather then holds this replica's rows and zeros (x/2 times the world, 2), and its
 * backward returns this replica's own gradient; the row offset and the scaling are what a
 * gradient check sees. */
static void half_with_nobody(void *ud, float *buf, size_t n)
{
    (void)ud;
    for (size_t i = 0; i < n; i++)
        buf[i] *= 0.5f;
}

static td_tensor *op_add_broadcast(td_ctx *c, op_case *o)
{
    return td_add_broadcast(c, o->in[0], o->in[1]);
}

static td_tensor *op_repeat(td_ctx *c, op_case *o)
{
    return td_repeat(c, o->in[0], 3);
}

static td_tensor *op_token_mean(td_ctx *c, op_case *o)
{
    return td_token_mean(c, o->in[0]);
}

static td_tensor *op_gather_rows(td_ctx *c, op_case *o)
{
    return td_gather_rows(c, o->in[0], o->idx);
}

static td_tensor *op_l2norm(td_ctx *c, op_case *o)
{
    return td_l2norm(c, o->in[0]);
}

static td_tensor *op_siglip(td_ctx *c, op_case *o)
{
    return td_siglip(c, o->in[0], o->in[1], o->in[2], 1, 0.37f);
}

static td_tensor *op_attention(td_ctx *c, op_case *o)
{
    return td_attention_packed(c, o->in[0], 2, 0, 2);
}

static td_tensor *op_allgather_rows(td_ctx *c, op_case *o)
{
    return td_allgather_rows(c, o->in[0], 7, 3); /* rows [3, 6) of 7 */
}

/* L again without recording, the arena left as it was. */
static double op_objective(td_ctx *c, op_case *o)
{
    td_ctx ev = {
        .k = c->k, .arena = c->arena, .tape = NULL, .allreduce = c->allreduce, .world = c->world};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    td_tensor *out = o->fn(&ev, o);
    double v = 0.0;

    for (size_t i = 0; i < out->n; i++)
        v += (double)o->r[i] * out->data[i];
    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return v;
}

/* The tape's gradient of every input element against central differences of L, inputs
 * U(-1.5, 1.5). Tolerance 1e-2 relative + 1e-4 absolute with a step of 1e-3 (as
 * test_attention.c's): the outputs are O(1) float sums, each perturbed one carrying ~1e-7 of
 * rounding, ~1e-5 after dividing by 2e-3; a missing term or a wrong index is off by O(1). */
static void op_check(op_case *o)
{
    volatile int checked = 0;
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(),
                .arena = &arena,
                .tape = &tape,
                .allreduce = o->world > 1 ? half_with_nobody : NULL,
                .world = o->world};
    td_boundary b;
    td_rng rng;

    td_rng_seed(&rng, 5, (uint64_t)o->n);
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 2), 0);
    o->r = malloc(4096 * sizeof(float));
    assert_non_null(o->r);
    for (int i = 0; i < 4096; i++)
        o->r[i] = i == 0 ? 1.0f : 2 * td_rng_uniform(&rng) - 1;
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *out;
        for (int i = 0; i < o->n; i++) {
            o->in[i] = td_tensor_new(&c, o->ndim[i], o->shape[i], o->grads >> i & 1);
            for (size_t j = 0; j < o->in[i]->n; j++)
                o->in[i]->data[j] = 1.5f * (2 * td_rng_uniform(&rng) - 1);
        }
        out = o->fn(&c, o);
        assert_int_equal(tape.len, 1);
        assert_true(out->n <= 4096);
        memcpy(out->grad, o->r, out->n * sizeof(float));
        td_backward(&c, out);
        for (int i = 0; i < o->n; i++) {
            td_tensor *t = o->in[i];
            if (t->grad == NULL)
                continue;
            for (size_t j = 0; j < t->n; j++) {
                float keep = t->data[j];
                double lp, lm, num, ana = t->grad[j];
                t->data[j] = keep + 1e-3f;
                lp = op_objective(&c, o);
                t->data[j] = keep - 1e-3f;
                lm = op_objective(&c, o);
                t->data[j] = keep;
                num = (lp - lm) / 2e-3;
                if (fabs(ana - num) > 1e-2 * fmax(fabs(ana), fabs(num)) + 1e-4)
                    fail_msg("%s: input %d [%zu]: tape %.6g, central differences %.6g", o->name, i,
                             j, ana, num);
                checked++;
            }
        }
        td_boundary_leave(&b);
    } else {
        fail_msg("%s: panic: %s", o->name, b.err.msg);
    }
    print_message("  %-16s %d gradients checked\n", o->name, checked);
    free(o->r);
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* Every op of the two-tower models: the broadcast position table, the repeated probe, the
 * tokens' mean, the end token's row, unit rows, SigLIP's loss (with a diagonal shifted by one,
 * as a replica's rows are, and a weight), the packed self-attention without a mask, and the
 * replicas' gather of rows (a replica's 3 rows at 3 of 7, its peer's all-reduce share zeros).
 * (td_attention_qkv's cross-attention, the MAP head's, is checked in test_attention.c.) */
static void test_op_gradients(void **state)
{
    op_case cases[] = {
        {.name = "add_broadcast",
         .fn = op_add_broadcast,
         .n = 2,
         .ndim = {3, 2},
         .shape = {{2, 3, 4}, {3, 4}},
         .grads = 3},
        {.name = "repeat", .fn = op_repeat, .n = 1, .ndim = {2}, .shape = {{1, 5}}, .grads = 1},
        {.name = "token_mean",
         .fn = op_token_mean,
         .n = 1,
         .ndim = {3},
         .shape = {{2, 5, 3}},
         .grads = 1},
        {.name = "gather_rows",
         .fn = op_gather_rows,
         .n = 1,
         .ndim = {3},
         .shape = {{3, 4, 5}},
         .grads = 1,
         .idx = {0, 3, 2}},
        {.name = "l2norm", .fn = op_l2norm, .n = 1, .ndim = {2}, .shape = {{4, 6}}, .grads = 1},
        {.name = "siglip",
         .fn = op_siglip,
         .n = 3,
         .ndim = {2, 1, 1},
         .shape = {{3, 5}, {1}, {1}},
         .grads = 7},
        {.name = "attention (ViT)",
         .fn = op_attention,
         .n = 1,
         .ndim = {3},
         .shape = {{2, 5, 24}},
         .grads = 1},
        {.name = "allgather_rows",
         .fn = op_allgather_rows,
         .n = 1,
         .ndim = {2},
         .shape = {{3, 4}},
         .grads = 1,
         .world = 2},
    };

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        op_check(&cases[i]);
}

/* A row whose norm is below the floor is divided by the floor, and so is its gradient,
 * exactly (TD_L2NORM_EPS: both are one division by it). */
static void test_l2norm_floor(void **state)
{
    const td_kernels *k = td_kernels_cpu();
    float x[3] = {1e-14f, -2e-14f, 0.0f}, out[3], norm[1], dout[3] = {1.0f, 2.0f, -1.0f};
    float dinp[3] = {0};

    k->l2norm_forward(out, norm, x, 1, 3);
    assert_true(norm[0] == TD_L2NORM_EPS);
    for (int i = 0; i < 3; i++)
        assert_true(out[i] == x[i] / TD_L2NORM_EPS);
    k->l2norm_backward(dinp, dout, out, norm, 1, 3);
    for (int i = 0; i < 3; i++)
        assert_true(dinp[i] == dout[i] / TD_L2NORM_EPS);
}

/* ---- SigLIP against double precision ------------------------------------------------------- */

/* s (N,E) and u (M,E) unit rows; the loss and every gradient (s, u, t, b) of
 * weight * sum_ij softplus(-y_ij z_ij), z = exp(t) s_i.u_j + b, y_ij = 1 on the diagonal shifted
 * by diag, all in double. */
static double ref_siglip(const float *s, const float *u, int N, int M, int E, double t, double b,
                         int diag, double weight, double *ds, double *du, double *dt, double *db)
{
    double loss = 0.0, et = exp(t);

    *dt = *db = 0.0;
    memset(ds, 0, (size_t)N * E * sizeof(double));
    memset(du, 0, (size_t)M * E * sizeof(double));
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            double dot = 0.0, z, y = j == i + diag ? 1.0 : -1.0, g;
            for (int e = 0; e < E; e++)
                dot += (double)s[i * E + e] * u[j * E + e];
            z = et * dot + b;
            loss += weight * (fmax(-y * z, 0.0) + log1p(exp(-fabs(y * z))));
            g = -weight * y / (1.0 + exp(y * z)); /* dL/dz */
            for (int e = 0; e < E; e++) {
                ds[i * E + e] += g * et * u[j * E + e];
                du[j * E + e] += g * et * s[i * E + e];
            }
            *dt += g * et * dot;
            *db += g;
        }
    return loss;
}

/* The loss through td_linear and td_siglip, as td_sensorlm_loss computes it, against the
 * double reference at the initial scale (t = ln 10, b = -10), a large one (t = 5: exp(t) = 148,
 * so |z| reaches ~160 and a naive log(1 + exp(-yz)) overflows) and a small one; with the
 * diagonal at 0 and shifted (a replica's rows). Tolerance: a float dot product of E terms of
 * unit rows is within (E+2)u of the exact one, so z within exp(t)(E+2)u + u|z|, and each term
 * (the softplus' slope is below 1) within that plus 4u of itself; the loss and the gradients
 * are held to the sum of those bounds over their terms, times 4. */
/* One case of test_siglip_reference. */
static void siglip_case(td_ctx *c, td_rng *rng, double tv, double bv, int diag)
{
    const int N = 5, M = 7, E = 6;
    const double U = 1.0 / 16777216.0, weight = 1.0 / N, et = exp(tv);
    double ds[64], du[64], dt, db, ref, bound_l = 0.0;
    td_tensor *s, *u, *t, *bb, *raw, *unit, *dots, *loss;
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};

    td_arena_reset(c->arena);
    s = td_tensor_new(c, 2, (int[]){N, E}, 1);
    u = td_tensor_new(c, 2, (int[]){M, E}, 1);
    t = td_tensor_new(c, 1, (int[]){1}, 1);
    bb = td_tensor_new(c, 1, (int[]){1}, 1);
    raw = td_tensor_new(c, 2, (int[]){N + M, E}, 0);
    for (size_t j = 0; j < raw->n; j++)
        raw->data[j] = 2 * td_rng_uniform(rng) - 1;
    unit = td_l2norm(&ev, raw);
    memcpy(s->data, unit->data, (size_t)N * E * sizeof(float));
    memcpy(u->data, unit->data + N * E, (size_t)M * E * sizeof(float));
    t->data[0] = (float)tv;
    bb->data[0] = (float)bv;
    dots = td_linear(c, s, u, NULL);
    loss = td_siglip(c, dots, t, bb, diag, (float)weight);
    td_backward(c, loss);
    ref = ref_siglip(s->data, u->data, N, M, E, (double)t->data[0], (double)bb->data[0], diag,
                     weight, ds, du, &dt, &db);
    for (int i = 0; i < N * M; i++) {
        double z = et * dots->data[i] + bv;
        bound_l += weight * (et * (E + 2) * U + U * fabs(z) + 4 * U * (fabs(z) + 1));
    }
    bound_l *= 4.0;
    if (fabs(loss->data[0] - ref) > bound_l + 2 * U * ref)
        fail_msg("t %g b %g diag %d: loss %.9g, reference %.12g (bound %.3g)", tv, bv, diag,
                 loss->data[0], ref, bound_l);
    /* each gradient entry sums M (or N) terms of slope <= weight exp(t): within (E+4)u of each
     * term's size, times 4 */
    for (int i = 0; i < N * E; i++) {
        double bnd = 4.0 * weight * et * M * (E + 4) * U * (1 + et) + 1e-12;
        if (fabs(s->grad[i] - ds[i]) > bnd)
            fail_msg("ds[%d]: %.9g, reference %.12g (bound %.3g)", i, s->grad[i], ds[i], bnd);
    }
    for (int i = 0; i < M * E; i++) {
        double bnd = 4.0 * weight * et * N * (E + 4) * U * (1 + et) + 1e-12;
        if (fabs(u->grad[i] - du[i]) > bnd)
            fail_msg("du[%d]: %.9g, reference %.12g (bound %.3g)", i, u->grad[i], du[i], bnd);
    }
    if (fabs(t->grad[0] - dt) > 4.0 * N * M * weight * et * (E + 4) * U * (1 + et) + 1e-9 ||
        fabs(bb->grad[0] - db) > 4.0 * N * M * weight * (E + 4) * U * (1 + et) + 1e-9)
        fail_msg("dt %.9g (reference %.12g), db %.9g (reference %.12g)", t->grad[0], dt,
                 bb->grad[0], db);
    print_message("  t %5.2f b %6.2f diag %d: loss %.9g, reference %.12g\n", tv, bv, diag,
                  loss->data[0], ref);
}

/* The loss through td_linear and td_siglip, as td_sensorlm_loss computes it, against the
 * double reference at the initial scale (t = ln 10, b = -10), a large one (t = 5: exp(t) = 148,
 * so |z| reaches ~150 and a naive log(1 + exp(-yz)) overflows) and a small one; with the
 * diagonal at 0 and shifted (a replica's rows). Tolerance: a float dot product of E terms of
 * unit rows is within (E+2)u of the exact one, so z within exp(t)(E+2)u + u|z|, and each term
 * (the softplus' slope is below 1) within that plus 4u of itself; the loss is held to the sum
 * of those bounds over its terms, times 4, and each gradient likewise to its terms'. */
static void test_siglip_reference(void **state)
{
    const double ts[] = {log(10.0), 5.0, -1.0}, bs[] = {-10.0, 2.0, 0.3};
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_boundary b;
    td_rng rng;

    td_rng_seed(&rng, 9, 0);
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b))
        fail_msg("panic: %s", b.err.msg);
    for (int v = 0; v < 3; v++) {
        siglip_case(&c, &rng, ts[v], bs[v], 0);
        siglip_case(&c, &rng, ts[v], bs[v], 2);
    }
    td_boundary_leave(&b);
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* ---- the model ----------------------------------------------------------------------------- */

/* The loss of one forward over (B) rows, no tape. */
static double model_loss(td_ctx *c, td_sensorlm *m, td_tensor *x, const int *tok, const int *end,
                         int B)
{
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    td_tensor *s = td_sensorlm_sensor(&ev, m, x), *u = td_sensorlm_text(&ev, m, tok, end, B);
    double v = td_sensorlm_loss(&ev, m, s, u, B, 0)->data[0];

    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return v;
}

/* The whole model's tape gradient against central differences of its loss, at up to six
 * elements spread over every tensor, for both poolings. Weights U(-0.4, 0.4) (LayerNorm weights
 * 1 +- 0.3, the logit scale 0 and bias 0: the loss is then O(1) and every tensor's gradient
 * O(1e-3..1)). Tolerance 3e-2 relative + 3e-4 absolute with a step of 1e-3 (as test_gpt.c's
 * whole-model check): the loss is one float, ~1e-7 of rounding per evaluation, ~1e-4 after
 * dividing by 2e-3, plus the rounding of the few hundred activations a perturbation moves; a
 * missing term or wrong index is off by far more. The training step's arena peak must equal
 * td_sensorlm_arena_bytes exactly. */
static void model_fd(td_slm_pool pool)
{
    td_slm_dims d = tt_slm_tiny_dims(pool);
    const int B = 3;
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0};
    td_error_t err = {0};
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    int tok[3 * 6], end[3] = {2, 5, 0};
    volatile int checked = 0;
    td_boundary b;
    td_rng rng;

    assert_non_null(m);
    assert_int_equal(td_sensorlm_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_sensorlm_init(m, 3);
    td_rng_seed(&rng, 13, (uint64_t)pool);
    for (int i = 0; i < m->n; i++) {
        int ones = strstr(m->name[i], "ln") != NULL && strstr(m->name[i], ".weight") != NULL;
        for (size_t j = 0; j < m->p[i].n; j++)
            m->p[i].data[j] =
                (ones ? 1.0f : 0.0f) + (ones ? 0.3f : 0.4f) * (2 * td_rng_uniform(&rng) - 1);
    }
    m->logit_scale->data[0] = 0.0f;
    m->logit_bias->data[0] = 0.0f;
    for (int i = 0; i < B; i++)
        td__slm_tokenize("abcdefgh", (size_t)end[i], d.L, tok + i * d.L, &end[i]);
    assert_int_equal(td_arena_init(&arena, td_sensorlm_arena_bytes(m, B, B, 1, 1) + (1 << 16)), 0);
    assert_int_equal(td_tape_init(&tape, td_sensorlm_tape_len(m)), 0);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *x = td_tensor_new(&c, 3, (int[]){B, d.N, d.P}, 0), *s, *u, *loss;
        size_t base = arena.used;
        for (size_t j = 0; j < x->n; j++)
            x->data[j] = 2 * td_rng_uniform(&rng) - 1;
        arena.peak = base;
        s = td_sensorlm_sensor(&c, m, x);
        u = td_sensorlm_text(&c, m, tok, end, B);
        loss = td_sensorlm_loss(&c, m, s, u, B, 0);
        td_backward(&c, loss);
        assert_int_equal(arena.peak - base, td_sensorlm_arena_bytes(m, B, B, 1, 1));
        for (int i = 0; i < m->n; i++) {
            td_tensor *t = &m->p[i];
            size_t stride = t->n / 6 + 1;
            double gmax = 0.0;
            for (size_t j = 0; j < t->n; j++)
                gmax = fmax(gmax, fabs(t->grad[j]));
            for (size_t j = 0; j < t->n; j += stride) {
                float keep = t->data[j];
                double lp, lm, num, ana = t->grad[j];
                t->data[j] = keep + 1e-3f;
                lp = model_loss(&c, m, x, tok, end, B);
                t->data[j] = keep - 1e-3f;
                lm = model_loss(&c, m, x, tok, end, B);
                t->data[j] = keep;
                num = (lp - lm) / 2e-3;
                if (fabs(ana - num) > 3e-2 * fmax(fabs(ana), fabs(num)) + 3e-4)
                    fail_msg("%s[%zu]: tape %.6g, central differences %.6g", m->name[i], j, ana,
                             num);
                checked++;
            }
            if (gmax == 0.0 && strcmp(m->name[i], "text.tok") != 0)
                fail_msg("%s: no gradient at all", m->name[i]);
        }
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    print_message("  pool %s: %d gradients over %d tensors\n",
                  pool == TD_SLM_POOL_MAP ? "map" : "gap", checked, m->n);
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
    free(m);
}

static void test_model_gradient_fd(void **state)
{
    model_fd(TD_SLM_POOL_MAP);
    model_fd(TD_SLM_POOL_GAP);
}

/* The tiny model's loss and every parameter's gradient over rows x (B,N,P), tok, end, through
 * td_sensorlm_loss (lab NULL) or td_sensorlm_loss_masked, into *loss and grad (p->n floats). */
static void model_grads(td_ctx *c, td_sensorlm *m, td_params *p, const float *xh, const int *tok,
                        const int *end, const int *lab, int B, float *loss, float *grad)
{
    td_tensor *x, *s, *u, *l;

    td_arena_reset(c->arena);
    memset(p->grad, 0, p->n * sizeof(float));
    x = td_tensor_new(c, 3, (int[]){B, m->d.N, m->d.P}, 0);
    memcpy(x->data, xh, x->n * sizeof(float));
    s = td_sensorlm_sensor(c, m, x);
    u = td_sensorlm_text(c, m, tok, end, B);
    l = lab != NULL ? td_sensorlm_loss_masked(c, m, s, u, lab, B, 0)
                    : td_sensorlm_loss(c, m, s, u, B, 0);
    td_backward(c, l);
    *loss = l->data[0];
    memcpy(grad, p->grad, p->n * sizeof(float));
}

/* test_mask_distinct_is_unmasked through the model: 4 windows of distinct labels give
 * td_sensorlm_loss's loss and gradients bit for bit; with two of one label they do not (the
 * mask reaches the loss through td_sensorlm_loss_masked). */
static void mask_model_distinct(void)
{
    td_slm_dims d = tt_slm_tiny_dims(TD_SLM_POOL_MAP);
    const int B = 4;
    static const int distinct[4] = {2, 0, -1, 1}, repeated[4] = {2, 0, 2, 1};
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0};
    td_error_t err = {0};
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    int tok[4 * 6], end[4] = {2, 5, 1, 3};
    float *x, *g0, *g1, l0, l1, l2;
    td_boundary b;
    td_rng rng;

    assert_non_null(m);
    assert_int_equal(td_sensorlm_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_sensorlm_init(m, 5);
    m->logit_scale->data[0] = 0.5f; /* negatives that weigh: b -10 makes them ~1e-5 each */
    m->logit_bias->data[0] = -1.0f;
    x = malloc((size_t)B * d.N * d.P * sizeof(float));
    g0 = malloc(p.n * sizeof(float));
    g1 = malloc(p.n * sizeof(float));
    assert_true(x != NULL && g0 != NULL && g1 != NULL);
    td_rng_seed(&rng, 31, 0);
    for (size_t j = 0; j < (size_t)B * d.N * d.P; j++)
        x[j] = 2 * td_rng_uniform(&rng) - 1;
    for (int i = 0; i < B; i++)
        td__slm_tokenize("wxyzabcd", (size_t)end[i], d.L, tok + i * d.L, &end[i]);
    assert_int_equal(td_arena_init(&arena, td_sensorlm_arena_bytes(m, B, B, 1, 1) + (1 << 16)), 0);
    assert_int_equal(td_tape_init(&tape, td_sensorlm_tape_len(m)), 0);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b))
        fail_msg("panic: %s", b.err.msg);
    model_grads(&c, m, &p, x, tok, end, NULL, B, &l0, g0);
    model_grads(&c, m, &p, x, tok, end, distinct, B, &l1, g1);
    if (memcmp(&l0, &l1, sizeof(float)) != 0)
        fail_msg("model: unmasked loss %.9g, masked with distinct labels %.9g", l0, l1);
    for (size_t i = 0; i < p.n; i++)
        if (memcmp(&g0[i], &g1[i], sizeof(float)) != 0)
            fail_msg("model: gradient %zu: unmasked %.9g, masked with distinct labels %.9g", i,
                     g0[i], g1[i]);
    model_grads(&c, m, &p, x, tok, end, repeated, B, &l2, g1);
    td_boundary_leave(&b);
    print_message("  model: loss %.9g unmasked and with distinct labels, %.9g with two of one\n",
                  l0, l2);
    assert_true(l2 < l0);
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
    free(x), free(g0), free(g1), free(m);
}

/* ---- loss.mask_same_label: the op ---------------------------------------------------------- */

/* README.md's masked loss ("The loss") in double, rows i < N at global rows i + diag of M
 * columns: weight * sum_ij m_ij (max(-y_ij z_ij, 0) + log1p(exp(-|y_ij z_ij|))), z_ij =
 * exp(t) s_i.u_j + b, y_ij = 1 when j == i + diag and -1 otherwise, m_ij = 0 when
 * j != i + diag and lab[i + diag] == lab[j] >= 0, else 1; and its gradients written out:
 * dL/dz_ij = -weight m_ij y_ij / (1 + exp(y_ij z_ij)), ds_i = sum_j dL/dz_ij exp(t) u_j, du_j =
 * sum_i dL/dz_ij exp(t) s_i, dt = sum_ij dL/dz_ij exp(t) s_i.u_j, db = sum_ij dL/dz_ij.
 * *pairs counts the pairs left out. */
static double ref_masked(const float *s, const float *u, const int *lab, int N, int M, int E,
                         double t, double b, int diag, double weight, double *ds, double *du,
                         double *dt, double *db, int *pairs)
{
    double loss = 0.0, et = exp(t);

    *dt = *db = 0.0;
    *pairs = 0;
    memset(ds, 0, (size_t)N * E * sizeof(double));
    memset(du, 0, (size_t)M * E * sizeof(double));
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            int gi = i + diag;
            double dot = 0.0, z, y = j == gi ? 1.0 : -1.0, g;
            if (j != gi && lab[gi] >= 0 && lab[j] == lab[gi]) {
                (*pairs)++;
                continue;
            }
            for (int e = 0; e < E; e++)
                dot += (double)s[i * E + e] * u[j * E + e];
            z = et * dot + b;
            loss += weight * (fmax(-y * z, 0.0) + log1p(exp(-fabs(y * z))));
            g = -weight * y / (1.0 + exp(y * z));
            for (int e = 0; e < E; e++) {
                ds[i * E + e] += g * et * u[j * E + e];
                du[j * E + e] += g * et * s[i * E + e];
            }
            *dt += g * et * dot;
            *db += g;
        }
    return loss;
}

/* One masked op's inputs: unit rows s (N,E) and u (M,E), the scale t and bias b, all with
 * gradients. */
typedef struct masked_in {
    td_tensor *s, *u, *t, *b;
} masked_in;

static masked_in masked_inputs(td_ctx *c, td_rng *rng, int N, int M, int E, double tv, double bv)
{
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};
    masked_in in;
    td_tensor *raw, *unit;

    in.s = td_tensor_new(c, 2, (int[]){N, E}, 1);
    in.u = td_tensor_new(c, 2, (int[]){M, E}, 1);
    in.t = td_tensor_new(c, 1, (int[]){1}, 1);
    in.b = td_tensor_new(c, 1, (int[]){1}, 1);
    raw = td_tensor_new(c, 2, (int[]){N + M, E}, 0);
    for (size_t j = 0; j < raw->n; j++)
        raw->data[j] = 2 * td_rng_uniform(rng) - 1;
    unit = td_l2norm(&ev, raw);
    memcpy(in.s->data, unit->data, (size_t)N * E * sizeof(float));
    memcpy(in.u->data, unit->data + N * E, (size_t)M * E * sizeof(float));
    in.t->data[0] = (float)tv;
    in.b->data[0] = (float)bv;
    return in;
}

/* The masked loss of in, without a tape (central differences' evaluations). */
static double masked_loss(td_ctx *c, const masked_in *in, const int *lab, int diag, float weight)
{
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    td_tensor *dots = td_linear(&ev, in->s, in->u, NULL);
    double v = td_siglip_masked(&ev, dots, in->t, in->b, lab, diag, weight)->data[0];

    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return v;
}

/* Central differences of the masked loss at element j of x against its tape gradient g: a
 * step of 1e-2 (the loss is one float of ~3: its rounding, ~1e-6, over the 2e-2 step is ~1e-4;
 * the cubic term, h^2/6 times a third derivative of O(exp(t)^3 weight M) at exp(t) 1.65, ~2e-5),
 * so within 1e-3 + 1e-2 relative; a term left in or out wrongly is off by ~weight exp(t)/4
 * ~ 0.06. Returns the difference quotient. */
static double masked_fd(td_ctx *c, const masked_in *in, const int *lab, int diag, float weight,
                        float *x, size_t j, double g, const char *what)
{
    float keep = x[j], hi = keep + 1e-2f, lo = keep - 1e-2f;
    double lp, lm, num;

    x[j] = hi;
    lp = masked_loss(c, in, lab, diag, weight);
    x[j] = lo;
    lm = masked_loss(c, in, lab, diag, weight);
    x[j] = keep;
    num = (lp - lm) / ((double)hi - (double)lo);
    if (fabs(num - g) > 1e-3 + 1e-2 * fabs(num))
        fail_msg("%s[%zu]: tape %.9g, central differences %.9g", what, j, g, num);
    return num;
}

/* One case of test_mask_reference: N rows at global rows diag.. of M columns, labels lab (M),
 * pairs the pairs it must leave out. The loss and every gradient against ref_masked, with
 * siglip_case's bounds (they hold term by term, and the kept terms are a subset); the gradient
 * of every left-out pair's dot product exactly 0; with fd, each gradient of s, u, t and b against
 * central differences too. */
static void masked_case(td_ctx *c, td_rng *rng, const int *lab, int N, int M, int diag, int pairs,
                        double tv, double bv, int fd)
{
    const int E = 6;
    const double U = 1.0 / 16777216.0, weight = 1.0 / N, et = exp(tv);
    double ds[64], du[64], dt, db, ref, bound_l = 0.0;
    td_tensor *dots, *loss;
    masked_in in;
    int left = 0;

    td_arena_reset(c->arena);
    in = masked_inputs(c, rng, N, M, E, tv, bv);
    dots = td_linear(c, in.s, in.u, NULL);
    loss = td_siglip_masked(c, dots, in.t, in.b, lab, diag, (float)weight);
    td_backward(c, loss);
    ref = ref_masked(in.s->data, in.u->data, lab, N, M, E, (double)in.t->data[0],
                     (double)in.b->data[0], diag, weight, ds, du, &dt, &db, &left);
    assert_int_equal(left, pairs);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            double z = et * dots->data[i * M + j] + bv;
            if (j != i + diag && lab[i + diag] >= 0 && lab[j] == lab[i + diag]) {
                if (dots->grad[i * M + j] != 0.0f)
                    fail_msg("pair (%d, %d) of label %d: gradient %.9g, left out must be 0",
                             i + diag, j, lab[j], dots->grad[i * M + j]);
                continue;
            }
            bound_l += weight * (et * (E + 2) * U + U * fabs(z) + 4 * U * (fabs(z) + 1));
        }
    bound_l *= 4.0;
    if (fabs(loss->data[0] - ref) > bound_l + 2 * U * ref)
        fail_msg("t %g b %g diag %d: loss %.9g, reference %.12g (bound %.3g)", tv, bv, diag,
                 loss->data[0], ref, bound_l);
    for (int i = 0; i < N * E; i++) {
        double bnd = 4.0 * weight * et * M * (E + 4) * U * (1 + et) + 1e-12;
        if (fabs(in.s->grad[i] - ds[i]) > bnd)
            fail_msg("ds[%d]: %.9g, reference %.12g (bound %.3g)", i, in.s->grad[i], ds[i], bnd);
    }
    for (int i = 0; i < M * E; i++) {
        double bnd = 4.0 * weight * et * N * (E + 4) * U * (1 + et) + 1e-12;
        if (fabs(in.u->grad[i] - du[i]) > bnd)
            fail_msg("du[%d]: %.9g, reference %.12g (bound %.3g)", i, in.u->grad[i], du[i], bnd);
    }
    if (fabs(in.t->grad[0] - dt) > 4.0 * N * M * weight * et * (E + 4) * U * (1 + et) + 1e-9 ||
        fabs(in.b->grad[0] - db) > 4.0 * N * M * weight * (E + 4) * U * (1 + et) + 1e-9)
        fail_msg("dt %.9g (reference %.12g), db %.9g (reference %.12g)", in.t->grad[0], dt,
                 in.b->grad[0], db);
    if (fd) {
        for (size_t j = 0; j < in.s->n; j++)
            masked_fd(c, &in, lab, diag, (float)weight, in.s->data, j, in.s->grad[j], "ds");
        for (size_t j = 0; j < in.u->n; j++)
            masked_fd(c, &in, lab, diag, (float)weight, in.u->data, j, in.u->grad[j], "du");
        masked_fd(c, &in, lab, diag, (float)weight, in.t->data, 0, in.t->grad[0], "dt");
        masked_fd(c, &in, lab, diag, (float)weight, in.b->data, 0, in.b->grad[0], "db");
    }
    print_message("  rows %d of %d at %d, %d pairs left out, t %5.2f b %6.2f: loss %.9g, "
                  "reference %.12g%s\n",
                  N, M, diag, left, tv, bv, loss->data[0], ref,
                  fd ? "; every gradient within central differences' bound" : "");
}

/* loss.same_label_weight: the same-label negatives weighted by w lie between leaving them out
 * and SigLIP's loss, linearly in w, for the loss and every gradient (each term is the same
 * float; the sums, in double, differ by rounding only); w = 0 is the masked loss bit for bit. */
static void test_same_label_weight(void **state)
{
    static const int lab[7] = {0, 1, 0, -1, 1, -1, 0};
    const int N = 7, M = 7, E = 6;
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    double loss[3], gs[3][42], gt[3];
    td_boundary b;
    td_rng rng;

    (void)state;
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b))
        fail_msg("panic: %s", b.err.msg);
    for (int v = 0; v < 4; v++) { /* left out, w 0.3, SigLIP's, w 0 through the weighted op */
        const float w[4] = {0.0f, 0.3f, 0.0f, 0.0f};
        td_tensor *dots, *l;
        masked_in in;
        td_arena_reset(&arena);
        td_rng_seed(&rng, 31, 0);
        in = masked_inputs(&c, &rng, N, M, E, 1.2, -2.0);
        dots = td_linear(&c, in.s, in.u, NULL);
        l = v == 0   ? td_siglip_masked(&c, dots, in.t, in.b, lab, 0, 1.0f / N)
            : v == 2 ? td_siglip(&c, dots, in.t, in.b, 0, 1.0f / N)
                     : td_siglip_weighted(&c, dots, in.t, in.b, lab, w[v], 0, 1.0f / N);
        td_backward(&c, l);
        if (v == 3) {
            assert_memory_equal(&l->data[0], &(float){(float)loss[0]}, sizeof(float));
            for (int i = 0; i < N * E; i++)
                assert_true(in.s->grad[i] == (float)gs[0][i]);
            continue;
        }
        loss[v] = l->data[0];
        for (int i = 0; i < N * E; i++)
            gs[v][i] = in.s->grad[i];
        gt[v] = in.t->grad[0];
    }
    td_boundary_leave(&b);
    print_message("  same-label negatives left out %.7f, weighted 0.3 %.7f, counted %.7f\n",
                  loss[0], loss[1], loss[2]);
    assert_true(loss[0] < loss[1] && loss[1] < loss[2]);
    assert_true(fabs(loss[1] - (loss[0] + 0.3 * (loss[2] - loss[0]))) < 1e-6 * loss[2]);
    assert_true(fabs(gt[1] - (gt[0] + 0.3 * (gt[2] - gt[0]))) < 1e-5);
    for (int i = 0; i < N * E; i++)
        if (fabs(gs[1][i] - (gs[0][i] + 0.3 * (gs[2][i] - gs[0][i]))) > 1e-6)
            fail_msg("ds[%d]: %.9g weighted, %.9g left out, %.9g counted", i, gs[1][i], gs[0][i],
                     gs[2][i]);
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* The masked loss and its gradients against README.md's equations in double (ref_masked), on
 * a batch of 7 windows whose labels repeat (0 three times, 1 twice) beside two unknown ones
 * (-1: never left out, not even against each other), whole and as a replica's 3 rows at 2; at
 * the initial scale, a large one and a moderate one (t 0.5, b -1), where central differences
 * check every gradient too. Tolerances as test_siglip_reference's (and masked_fd's). */
static void test_mask_reference(void **state)
{
    static const int lab[7] = {0, 1, 0, -1, 1, -1, 0};
    const double ts[] = {log(10.0), 5.0, 0.5}, bs[] = {-10.0, 2.0, -1.0};
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_boundary b;
    td_rng rng;

    td_rng_seed(&rng, 23, 0);
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b))
        fail_msg("panic: %s", b.err.msg);
    for (int v = 0; v < 3; v++) {
        /* label 0 at 0, 2, 6: 6 ordered pairs; label 1 at 1, 4: 2 */
        masked_case(&c, &rng, lab, 7, 7, 0, 8, ts[v], bs[v], v == 2);
        /* rows 2, 3, 4: row 2 leaves out columns 0 and 6, row 4 column 1, row 3 none */
        masked_case(&c, &rng, lab, 3, 7, 2, 3, ts[v], bs[v], v == 2);
    }
    td_boundary_leave(&b);
    td_tape_free(&tape);
    td_arena_free(&arena);
}

/* The loss and gradients of in through td_siglip (lab NULL) or td_siglip_masked into out:
 * loss, then s's, u's, t's and b's gradients. */
static void masked_run(td_ctx *c, masked_in *in, const int *lab, int diag, float weight, float *out)
{
    td_tensor *dots, *loss;
    size_t n = 1;

    memset(in->s->grad, 0, in->s->n * sizeof(float));
    memset(in->u->grad, 0, in->u->n * sizeof(float));
    in->t->grad[0] = in->b->grad[0] = 0.0f;
    dots = td_linear(c, in->s, in->u, NULL);
    loss = lab != NULL ? td_siglip_masked(c, dots, in->t, in->b, lab, diag, weight)
                       : td_siglip(c, dots, in->t, in->b, diag, weight);
    td_backward(c, loss);
    out[0] = loss->data[0];
    memcpy(out + n, in->s->grad, in->s->n * sizeof(float));
    n += in->s->n;
    memcpy(out + n, in->u->grad, in->u->n * sizeof(float));
    n += in->u->n;
    out[n] = in->t->grad[0];
    out[n + 1] = in->b->grad[0];
}

/* With every known label distinct (and the unknown ones, -1, never equal to anything), the mask
 * leaves nothing out, and the masked loss is the unmasked one bit for bit, gradients included:
 * the same terms summed in the same order. Whole (7 rows of 7 labels) and as a replica (rows
 * 2..4 of 7, two of the labels unknown), at two scales; then through the model
 * (td_sensorlm_loss_masked against td_sensorlm_loss, every parameter's gradient). */
static void test_mask_distinct_is_unmasked(void **state)
{
    static const int whole[7] = {6, 5, 4, 3, 2, 1, 0}, part[7] = {5, -1, 3, -1, 0, 1, 2};
    const double ts[] = {log(10.0), 0.5}, bs[] = {-10.0, -1.0};
    float a[1 + 2 * 7 * 6 + 2], b2[1 + 2 * 7 * 6 + 2];
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_boundary b;
    td_rng rng;

    td_rng_seed(&rng, 29, 0);
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b))
        fail_msg("panic: %s", b.err.msg);
    for (int v = 0; v < 2; v++)
        for (int k = 0; k < 2; k++) {
            int N = k == 0 ? 7 : 3, diag = k == 0 ? 0 : 2;
            size_t n = 1 + (size_t)(N + 7) * 6 + 2;
            masked_in in;
            td_arena_reset(&arena);
            in = masked_inputs(&c, &rng, N, 7, 6, ts[v], bs[v]);
            masked_run(&c, &in, NULL, diag, 1.0f / (float)N, a);
            masked_run(&c, &in, k == 0 ? whole : part, diag, 1.0f / (float)N, b2);
            for (size_t i = 0; i < n; i++)
                if (memcmp(&a[i], &b2[i], sizeof(float)) != 0)
                    fail_msg("rows %d at %d, value %zu (0 the loss): unmasked %.9g, masked %.9g", N,
                             diag, i, a[i], b2[i]);
            print_message("  rows %d of 7 at %d, t %5.2f: the loss and %zu gradients bit for bit\n",
                          N, diag, ts[v], n - 1);
        }
    td_boundary_leave(&b);
    td_tape_free(&tape);
    td_arena_free(&arena);
    mask_model_distinct();
}

/* The parameters in the README's order, names and shapes, the count td_sensorlm_num_params
 * gives, the initialisation's values, and the presets. */
static void test_parameters(void **state)
{
    td_slm_dims d = tt_slm_tiny_dims(TD_SLM_POOL_MAP), g = tt_slm_tiny_dims(TD_SLM_POOL_GAP);
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0}, pg = {0};
    td_error_t err = {0};
    size_t n = 0;
    static const char *const first[] = {
        "sensor.patch.weight",
        "sensor.patch.bias",
        "sensor.pos",
        "sensor.blocks.0.ln1.weight",
        "sensor.blocks.0.ln1.bias",
        "sensor.blocks.0.attn.qkv.weight",
        "sensor.blocks.0.attn.qkv.bias",
        "sensor.blocks.0.attn.out.weight",
        "sensor.blocks.0.attn.out.bias",
        "sensor.blocks.0.ln2.weight",
        "sensor.blocks.0.ln2.bias",
        "sensor.blocks.0.mlp.fc1.weight",
        "sensor.blocks.0.mlp.fc1.bias",
        "sensor.blocks.0.mlp.fc2.weight",
        "sensor.blocks.0.mlp.fc2.bias",
        "sensor.ln_f.weight",
        "sensor.ln_f.bias",
        "sensor.map.probe",
        "sensor.map.q.weight",
        "sensor.map.q.bias",
        "sensor.map.k.weight",
        "sensor.map.k.bias",
        "sensor.map.v.weight",
        "sensor.map.v.bias",
        "sensor.map.out.weight",
        "sensor.map.out.bias",
        "sensor.map.ln.weight",
        "sensor.map.ln.bias",
        "sensor.map.mlp.fc1.weight",
        "sensor.map.mlp.fc1.bias",
        "sensor.map.mlp.fc2.weight",
        "sensor.map.mlp.fc2.bias",
        "sensor.proj.weight",
        "text.tok",
        "text.pos",
        "text.blocks.0.ln1.weight",
    };
    td_slm_tower tw;
    int E;

    assert_int_equal(d.N, 8);
    assert_int_equal(d.P, 6);
    assert_int_equal(d.Cp, 4);
    assert_int_equal(td_sensorlm_declare(m, &p, &d, &err), 0);
    for (size_t i = 0; i < sizeof(first) / sizeof(first[0]); i++)
        assert_string_equal(m->name[i], first[i]);
    assert_string_equal(m->name[m->n - 3], "text.proj.weight");
    assert_string_equal(m->name[m->n - 2], "logit_scale");
    assert_string_equal(m->name[m->n - 1], "logit_bias");
    assert_int_equal(m->n, p.count);
    assert_true(m->s.patch_w->shape[0] == 8 && m->s.patch_w->shape[1] == 6);
    assert_true(m->s.pos->shape[0] == 8 && m->s.pos->shape[1] == 8);
    assert_true(m->t.tok->shape[0] == 258 && m->t.pos->shape[0] == 6);
    assert_true(m->s.blk[0].qkv_w->shape[0] == 24 && m->s.blk[0].fc1_w->shape[0] == 16);
    assert_true(m->s.proj->shape[0] == 8 && m->s.proj->shape[1] == 8);
    for (int i = 0; i < m->n; i++)
        n += m->p[i].n;
    assert_int_equal(n, td_sensorlm_num_params(&d));
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_sensorlm_init(m, 1);
    assert_true(m->logit_scale->data[0] == (float)log(10.0));
    assert_true(m->logit_bias->data[0] == -10.0f);
    assert_true(m->s.blk[0].ln1_w->data[0] == 1.0f && m->s.blk[0].ln1_b->data[0] == 0.0f);
    assert_true(m->s.ln_w->data[3] == 1.0f && m->s.q_b->data[0] == 0.0f);
    {
        double sum = 0.0, sq = 0.0; /* N(0, 0.02): 48 draws of the patch weight */
        for (size_t j = 0; j < m->s.patch_w->n; j++)
            sum += m->s.patch_w->data[j],
                sq += (double)m->s.patch_w->data[j] * m->s.patch_w->data[j];
        assert_true(sqrt(sq / 48) > 0.01 && sqrt(sq / 48) < 0.03 && fabs(sum / 48) < 0.01);
        assert_true(m->s.probe->data[0] != 0.0f && m->t.tok->data[0] != 0.0f);
    }
    td_params_free(&p);
    /* gap: no map tensors */
    assert_int_equal(td_sensorlm_declare(m, &pg, &g, &err), 0);
    assert_string_equal(m->name[17], "sensor.proj.weight");
    n = 0;
    for (int i = 0; i < m->n; i++)
        n += m->p[i].n;
    assert_int_equal(n, td_sensorlm_num_params(&g));
    td_slm_preset(TD_SLM_BASE, &tw, &E);
    assert_true(tw.D == 768 && tw.depth == 12 && tw.H == 12 && tw.M == 3072 && E == 768);
    td_slm_preset(TD_SLM_SMALL, &tw, &E);
    assert_true(tw.D == 256 && tw.depth == 6 && tw.H == 4 && tw.M == 1024 && E == 256);
    td_slm_preset(TD_SLM_TINY, &tw, &E);
    assert_true(tw.D == 64 && tw.depth == 2 && tw.H == 4 && tw.M == 256 && E == 64);
    free(m);
}

/* The dimensions' checks name the job's keys. */
static void test_dims_errors(void **state)
{
    td_sensorlm_config c = {0};
    td_slm_dims d;
    td_error_t err = {0};

    c.patch_t = 7;
    assert_int_equal(td_slm_dims_of(&c, 1440, 10, &d, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "model.sensor.patch_t: 7 does not divide time_steps 1440"));
    c.patch_t = 10;
    c.s_heads = 5;
    assert_int_equal(td_slm_dims_of(&c, 1440, 10, &d, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "model.sensor.d_model: 64"));
    c.s_heads = 0;
    c.t_depth = 40;
    assert_int_equal(td_slm_dims_of(&c, 1440, 10, &d, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "model.text.depth: 40"));
    c.t_depth = 0;
    c.text_len = 1;
    assert_int_equal(td_slm_dims_of(&c, 1440, 10, &d, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "model.text.text_len"));
    c.text_len = 0;
    c.size = TD_SLM_BASE;
    assert_int_equal(td_slm_dims_of(&c, 1440, 34, &d, &err), 0);
    assert_int_equal(d.N, 2448); /* the reference ViT-B input: 144 x 17 patches */
    assert_int_equal(d.P, 20);
}

/* ---- windows and captions ------------------------------------------------------------------ */

/* The README's layout, element by element: x' = (x - mean) / std, NaN -> 0, channels C..Cp-1
 * 0, patch n = ti*(Cp/pc) + ci, element dt*pc + dc. Exact: one subtraction and one division. */
static void test_patchify_and_tokens(void **state)
{
    td_slm_dims d = tt_slm_tiny_dims(TD_SLM_POOL_MAP); /* T 12, C 3, pt 3, pc 2, Cp 4 */
    float grid[12 * 3], norm[6] = {1, 2, 3, 0.5f, 4, 2}, x[8 * 6];
    int tok[6], end;

    for (int i = 0; i < 36; i++)
        grid[i] = (float)i * 0.25f;
    grid[7] = NAN;
    td__slm_patchify(grid, norm, &d, x);
    for (int ti = 0; ti < 4; ti++)
        for (int ci = 0; ci < 2; ci++)
            for (int dt = 0; dt < 3; dt++)
                for (int dc = 0; dc < 2; dc++) {
                    int t = ti * 3 + dt, ch = ci * 2 + dc;
                    float want = ch >= 3 ? 0.0f : (grid[t * 3 + ch] - norm[ch]) / norm[3 + ch];
                    if (isnan(want))
                        want = 0.0f;
                    assert_true(x[(ti * 2 + ci) * 6 + dt * 2 + dc] == want);
                }
    assert_true(x[(0 * 2 + 0) * 6 + 2 * 2 + 1] == 0.0f); /* grid[7]: t 2, channel 1, NaN */
    td__slm_tokenize("running day: a run", 18, 6, tok, &end);
    assert_int_equal(end, 5);
    assert_true(tok[0] == 'r' && tok[4] == 'i' && tok[5] == TD_SLM_END);
    td__slm_tokenize("ab", 2, 6, tok, &end);
    assert_int_equal(end, 2);
    assert_true(tok[0] == 'a' && tok[1] == 'b' && tok[2] == TD_SLM_END && tok[3] == TD_SLM_PAD &&
                tok[5] == TD_SLM_PAD);
    td__slm_tokenize("\xff", 1, 6, tok, &end);
    assert_int_equal(tok[0], 255);
}

/* A caption longer than the model reads is cut at its last clause boundary that fits ("; " or
 * ". ", the bytes before it), else at its last space, never inside a word unless one word is
 * longer than what fits; one that fits is whole. */
static void test_caption_fit(void **state)
{
    const char *cap =
        "running day: a 38-minute run at 13:02; 7 h 53 min of sleep. heart rate peaks";
    size_t len = strlen(cap);
    int tok[48], end;

    (void)state;
    assert_int_equal(td__slm_fit(cap, len, len), len);
    assert_int_equal(td__slm_fit(cap, len, 200), len);
    assert_int_equal(td__slm_fit(cap, len, 40), 37); /* "...at 13:02" */
    assert_int_equal(td__slm_fit(cap, len, 37), 37); /* the boundary at the last byte that fits */
    assert_int_equal(td__slm_fit(cap, len, 60), 58); /* "...of sleep", before ". " */
    assert_int_equal(td__slm_fit(cap, len, 36), 31); /* no clause fits: the last word, "...at" */
    assert_int_equal(td__slm_fit("walking day: a 116-minute walk", 30, 20),
                     14);                                  /* "walking day: a" */
    assert_int_equal(td__slm_fit("abcdefgh", 8, 5), 5);    /* one word longer than 5 */
    assert_int_equal(td__slm_fit("a; bcdefgh", 10, 1), 1); /* "a", before "; " */
    assert_int_equal(td__slm_fit("; abcdefgh", 10, 4),
                     1); /* a boundary at byte 0 is none: the space at 1 */
    td__slm_tokenize(cap, len, 48, tok, &end);
    assert_int_equal(end, 37);
    assert_true(tok[36] == '2' && tok[37] == TD_SLM_END && tok[38] == TD_SLM_PAD);
    td__slm_tokenize(cap, 37, 38, tok, &end); /* 37 bytes fit in 38 - 1 whole */
    assert_int_equal(end, 37);
}

/* README.md's draws for a caption's cut, written from its text: xoshiro256** seeded through
 * splitmix64 from seed ^ (stream * 0xd1342543de82ef95), a float in [0, 1) from the top 24 bits,
 * a number below n by Lemire's multiply-and-reject. */
typedef struct ref_rng {
    uint64_t s[4];
} ref_rng;

static uint64_t ref_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static void ref_seed(ref_rng *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull);
    for (int i = 0; i < 4; i++) {
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        r->s[i] = z ^ (z >> 31);
    }
}

static uint64_t ref_next(ref_rng *r)
{
    uint64_t *s = r->s, out = ref_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = ref_rotl(s[3], 45);
    return out;
}

static uint32_t ref_below(ref_rng *r, uint32_t n)
{
    uint64_t m = (ref_next(r) >> 32) * n;
    while ((uint32_t)m < (uint32_t)(-n) % n)
        m = (ref_next(r) >> 32) * n;
    return (uint32_t)(m >> 32);
}

/* The cut README.md specifies, from the reference draws. */
static size_t ref_cut(const char *text, size_t len, uint64_t seed, int64_t epoch, int64_t pos,
                      float p)
{
    size_t at[64];
    uint32_t n = 0;
    ref_rng r;

    ref_seed(&r, seed, 0x4355540000000000ull + ((uint64_t)epoch << 32) + (uint64_t)pos);
    if (!((float)(ref_next(&r) >> 40) * (1.0f / 16777216.0f) < p))
        return len;
    for (size_t i = 1; i + 1 < len; i++)
        if ((text[i] == ';' || text[i] == '.') && text[i + 1] == ' ')
            at[n++] = i;
    return n == 0 ? len : at[ref_below(&r, n)];
}

/* data.caption_cut: the draws are README.md's (a reference written from it agrees on every
 * window), deterministic from (seed, epoch, position), cut only at clause boundaries, at the
 * chance asked, each boundary about as often; and a batch is the same whether the data got to
 * it by advancing or by seeking, as a resumed job does. */
static void test_caption_cut(void **state)
{
    const char *cap = "alpha day: calm 3; busy 4. late 2; early 9.";
    size_t len = strlen(cap), kept[4] = {17, 25, 33, 0};
    int per[4] = {0}, cuts = 0;
    char path[TD_PATH_MAX];
    td_train_config cfg;
    td_slm_dims d;
    td_slm_data *a, *b;
    td_error_t err = {0};

    (void)state;
    for (int64_t pos = 0; pos < 4000; pos++) {
        size_t got = td__slm_cut(cap, len, 7, pos % 3, pos, 0.5f);
        assert_int_equal(got, ref_cut(cap, len, 7, pos % 3, pos, 0.5f));
        assert_int_equal(got, td__slm_cut(cap, len, 7, pos % 3, pos, 0.5f));
        assert_int_equal(td__slm_cut(cap, len, 7, pos % 3, pos, 0.0f), len);
        assert_int_equal(td__slm_cut(cap, len, 7, pos % 3, pos, 1.0f),
                         ref_cut(cap, len, 7, pos % 3, pos, 1.0f));
        assert_true(td__slm_cut(cap, len, 7, pos % 3, pos, 1.0f) < len);
        assert_int_equal(td__slm_cut("no clause here", 14, 7, 0, pos, 1.0f), 14);
        for (int k = 0; k < 4; k++)
            if (got == (k < 3 ? kept[k] : len))
                per[k]++;
        cuts += got < len;
    }
    assert_int_equal(per[0] + per[1] + per[2] + per[3], 4000);
    print_message("caption_cut 0.5 over 4000 windows: %d cut (%d, %d, %d at each boundary)\n", cuts,
                  per[0], per[1], per[2]);
    assert_true(cuts > 1800 && cuts < 2200);
    for (int k = 0; k < 3; k++)
        assert_true(per[k] > 520 && per[k] < 820);

    /* batches of a shard whose captions have clauses */
    tt_path_of(path, "clauses.bin");
    tt_write_sensor_with(path, 64, T_STEPS, C_CH, 64, 3,
                         (const char *const[]){"alpha day", "beta day", "gamma day"}, 1);
    slm_config(&cfg);
    snprintf(cfg.train_files[0], TD_PATH_MAX, "%s", path);
    cfg.shuffle = 1;
    cfg.caption_cut = 0.5f;
    cfg.slm.text_len = 40;
    assert_int_equal(td__train_slm_dims(&cfg, &d, NULL, &err), 0);
    assert_int_equal(td__slm_data_open(&a, &cfg, &d, &err), 0);
    assert_int_equal(td__slm_data_open(&b, &cfg, &d, &err), 0);
    {
        enum { B = 8 };
        float *xa = malloc((size_t)B * d.N * d.P * sizeof(float)),
              *xb = malloc((size_t)B * d.N * d.P * sizeof(float));
        int ta[B * 40], tb[B * 40], ea[B], eb[B], distinct = 0, seen[41] = {0};
        for (int i = 0; i < 8 * 2 + 3; i++) /* to epoch 2, batch 3 */
            td__slm_advance(a);
        assert_int_equal(td__slm_seek(b, td__slm_tell(a), &err), 0);
        assert_int_equal(td__slm_fill(a, 0, B, xa, ta, ea, &err), 0);
        assert_int_equal(td__slm_fill(b, 0, B, xb, tb, eb, &err), 0);
        assert_memory_equal(ta, tb, sizeof(ta));
        assert_memory_equal(ea, eb, sizeof(ea));
        assert_memory_equal(xa, xb, (size_t)B * d.N * d.P * sizeof(float));
        for (int r = 0; r < B; r++) {
            distinct += !seen[ea[r]];
            seen[ea[r]] = 1;
            assert_int_equal(ta[r * 40 + ea[r]], TD_SLM_END);
            assert_true(ta[r * 40 + ea[r] - 1] != ';' && ta[r * 40 + ea[r] - 1] != ' ');
        }
        assert_true(distinct >= 2); /* the end token at more than one position */
        free(xa);
        free(xb);
    }
    td__slm_data_free(a);
    td__slm_data_free(b);
}

/* A label with several prompts ("a|b") is embedded as the normalised mean of its prompts'
 * embeddings, by td_sensorlm_embed_labels and by the evaluation's zero-shot alike; one prompt
 * is that prompt's embedding. */
static void test_multi_prompt(void **state)
{
    static tt_recorder r;
    const char *const multi[3] = {"alpha day|alpha day: calm 1", "beta day||beta", "gamma day"};
    const char *parts[4] = {"alpha day", "alpha day: calm 1", "beta day", "beta"};
    int off[4], len[4];
    char vpath[TD_PATH_MAX];
    td_train_config cfg;
    td_trainer *t;
    td_sensorlm_embedder *e = NULL;
    td_sensor *sh;
    td_error_t err = {0};
    enum { NV = 24 };
    float *grids = malloc((size_t)NV * T_STEPS * C_CH * sizeof(float));
    float lab[3 * 8], one[4 * 8], single[8], s[NV * 8];
    int32_t labels[NV];
    double v[8];
    int zs = 0;

    (void)state;
    assert_int_equal(td__slm_prompt_parts("a|bc||d|", off, len, 4), 3);
    assert_true(off[0] == 0 && len[0] == 1 && off[1] == 2 && len[1] == 2 && off[2] == 6 &&
                len[2] == 1);
    assert_int_equal(td__slm_prompt_parts("|", off, len, 4), 0);
    assert_int_equal(td__slm_prompt_parts("a|b|c", off, len, 2), 2);

    tt_path_of(vpath, "valid-multi.bin");
    tt_write_sensor_with(vpath, NV, T_STEPS, C_CH, 24, 2, multi, 0);
    slm_config(&cfg);
    snprintf(cfg.valid_files[0], TD_PATH_MAX, "%s", vpath);
    cfg.max_steps = 30;
    cfg.eval_every = 30;
    tt_path_of(cfg.checkpoint_dir, "ckpt-multi");
    t = new_trainer(&cfg, &r);
    run_steps(t, 100);
    assert_int_equal(td_sensorlm_embedder_from_trainer(&e, t, 5, &err), 0);
    td_trainer_free(t);

    assert_int_equal(td_sensorlm_embed_labels(e, multi, 3, lab, &err), 0);
    assert_int_equal(td_sensorlm_embed_texts(e, parts, 4, one, &err), 0);
    assert_int_equal(td_sensorlm_embed_texts(e, (const char *[]){"gamma day"}, 1, single, &err), 0);
    for (int k = 0; k < 2; k++) {
        double m[8], n2 = 0;
        for (int j = 0; j < 8; j++) {
            m[j] = (double)one[(2 * k) * 8 + j] + one[(2 * k + 1) * 8 + j];
            n2 += m[j] * m[j];
        }
        for (int j = 0; j < 8; j++)
            assert_true(fabs(lab[k * 8 + j] - m[j] / sqrt(n2)) < 1e-6);
    }
    for (int j = 0; j < 8; j++)
        assert_true(fabs(lab[2 * 8 + j] - single[j]) < 1e-6);

    /* the evaluation's zero-shot, from the same label embeddings */
    assert_int_equal(td_sensor_open(&sh, vpath, NULL, &err), 0);
    for (int i = 0; i < NV; i++) {
        char cap[64];
        size_t l;
        assert_int_equal(
            td_sensor_read(sh, i, grids + (size_t)i * T_STEPS * C_CH, cap, &l, &labels[i], &err),
            0);
    }
    td_sensor_close(sh);
    assert_int_equal(td_sensorlm_embed_windows(e, grids, NV, s, &err), 0);
    for (int i = 0; i < NV; i++) {
        double best = -2;
        int cls = 0;
        for (int k = 0; k < 3; k++) {
            double d = 0;
            for (int j = 0; j < 8; j++)
                d += (double)s[i * 8 + j] * lab[k * 8 + j];
            if (d > best)
                best = d, cls = k;
        }
        zs += cls == labels[i];
    }
    assert_int_equal(tt_values_of(&r, "zeroshot_accuracy", v, NULL, 8), 1);
    print_message("zero-shot with two prompts for two of three labels: %.3f\n", v[0]);
    assert_true(fabs(v[0] - (double)zs / NV) < 1e-12);
    td_sensorlm_embedder_free(e);
    free(grids);
}

/* ---- the trainer ------------------------------------------------------------------------------
 */

/* It learns: the loss falls, the evaluation reports every metric, zero-shot is well above
 * chance (1/3) after 400 steps on the class-made signal (0.96 here; 0.6 leaves room for another
 * BLAS's rounding); the arena was sized exactly for the larger of the step and the evaluation,
 * and the memory estimate's numbers are the trainer's. */
static void test_trains(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_mem_estimate est;
    td_error_t err = {0};
    double v[32], loss[400];
    td_trainer *t;
    int n;

    slm_config(&cfg);
    cfg.max_steps = 400;
    cfg.eval_every = 100;
    t = new_trainer(&cfg, &r);
    assert_int_equal(td_train_memory_estimate(&cfg, &est, &err), 0);
    assert_int_equal(est.activations, td_trainer_arena(t)->cap);
    assert_int_equal(est.n_floats, td_trainer_params(t)->n);
    run_steps(t, 500);
    assert_int_equal(td_trainer_arena(t)->peak, td_trainer_arena(t)->cap);
    td_trainer_free(t);
    n = tt_values_of(&r, "train_loss", loss, NULL, 400);
    assert_int_equal(n, 400);
    assert_int_equal(tt_values_of(&r, "valid_loss", v, NULL, 32), 4);
    assert_true(v[3] < v[0]);
    assert_int_equal(tt_values_of(&r, "recall_at_1", v, NULL, 32), 4);
    assert_int_equal(tt_values_of(&r, "recall_at_5", v, NULL, 32), 4);
    assert_int_equal(tt_values_of(&r, "text_recall_at_1", v, NULL, 32), 4);
    assert_int_equal(tt_values_of(&r, "samples_per_s", NULL, NULL, 400), 400);
    assert_int_equal(tt_values_of(&r, "zeroshot_accuracy", v, NULL, 32), 4);
    print_message("  zero-shot %.3f %.3f %.3f %.3f, loss %.3f -> %.3f\n", v[0], v[1], v[2], v[3],
                  loss[0], loss[399]);
    assert_true(v[3] > 0.6);
}

/* td_trainer_step allocates nothing, evaluation steps included. */
static void test_no_malloc_in_step(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;

    if (!COUNT_ALLOCATIONS)
        skip();
    slm_config(&cfg);
    cfg.eval_every = 3;
    cfg.grad_clip = 0.5f;
    t = new_trainer(&cfg, &r);
    run_steps(t, 2);
    allocations = 0;
    counting = 1;
    run_steps(t, 4);
    counting = 0;
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "valid_loss", NULL, NULL, 4), 2);
    assert_int_equal(allocations, 0);
}

/* 2N steps straight, and N steps + checkpoint + a new trainer + N steps, give identical losses
 * and evaluations, across an epoch's reshuffle (56 windows: 7 batches an epoch); a checkpoint of
 * another configuration (another preset under the same dimensions) is refused. */
static void test_resume(void **state)
{
    static tt_recorder r1, r2, r3;
    td_train_config cfg;
    td_trainer *t;
    double a[32], b[32];
    int64_t sa[32], sb[32];
    int n;

    slm_config(&cfg);
    cfg.max_steps = 14;
    cfg.eval_every = 5;
    t = new_trainer(&cfg, &r1);
    run_steps(t, 100);
    td_trainer_free(t);

    tt_path_of(cfg.checkpoint_dir, "ckpt-slm");
    cfg.checkpoint_every = 6;
    t = new_trainer(&cfg, &r2);
    run_steps(t, 8);
    td_trainer_free(t);
    t = new_trainer(&cfg, &r3);
    assert_int_equal(td_trainer_steps_done(t), 6);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r1, "train_loss", a, sa, 32), 14);
    n = tt_values_of(&r3, "train_loss", b, sb, 32);
    assert_int_equal(n, 8);
    for (int i = 0; i < n; i++)
        if (memcmp(&a[6 + i], &b[i], sizeof(double)) != 0)
            fail_msg("step %d: straight %.9g, resumed %.9g", 7 + i, a[6 + i], b[i]);
    assert_int_equal(tt_values_of(&r1, "zeroshot_accuracy", a, sa, 32), 3);
    assert_int_equal(tt_values_of(&r3, "zeroshot_accuracy", b, sb, 32), 2);
    assert_true(a[1] == b[0] && a[2] == b[1]);
    assert_int_equal(tt_values_of(&r1, "valid_loss", a, sa, 32), 3);
    assert_int_equal(tt_values_of(&r3, "valid_loss", b, sb, 32), 2);
    assert_true(memcmp(a + 1, b, 2 * sizeof(double)) == 0);
    cfg.slm.size = TD_SLM_BASE; /* every dimension is the job's: the same shapes, another job */
    expect_new_fails(&cfg, TD_ESTATE, "another configuration", "ckpt-14.bin");
}

/* Another model.attn_chunk sums the attention's gradients in other blocks: the parameters after
 * a few steps differ in their last bits (chunk 5 against the automatic 12 of N = 12 tokens, a
 * whole sequence), so a checkpoint of one chunk is not resumed with another; the chunk it was
 * written with resumes it. */
static void test_resume_needs_its_chunk(void **state)
{
    td_train_config cfg;
    td_trainer *t;
    float *a;
    size_t n;
    int same;

    slm_config(&cfg);
    cfg.max_steps = 4;
    cfg.eval_every = 0;
    t = new_trainer(&cfg, NULL);
    run_steps(t, 100);
    n = td_trainer_params(t)->n;
    a = malloc(n * sizeof(float));
    assert_non_null(a);
    memcpy(a, td_trainer_params(t)->host_data, n * sizeof(float));
    td_trainer_free(t);
    cfg.attn_chunk = 5;
    t = new_trainer(&cfg, NULL);
    run_steps(t, 100);
    assert_int_equal(td_trainer_params(t)->n, n);
    same = memcmp(a, td_trainer_params(t)->host_data, n * sizeof(float)) == 0;
    td_trainer_free(t);
    free(a);
    assert_false(same);

    tt_path_of(cfg.checkpoint_dir, "ckpt-chunk");
    cfg.checkpoint_every = 2;
    cfg.attn_chunk = 0;
    t = new_trainer(&cfg, NULL);
    run_steps(t, 2);
    td_trainer_free(t);
    cfg.attn_chunk = 5;
    expect_new_fails(&cfg, TD_ESTATE, "another configuration", "ckpt-2.bin");
    cfg.attn_chunk = 0;
    t = new_trainer(&cfg, NULL);
    assert_int_equal(td_trainer_steps_done(t), 2);
    td_trainer_free(t);
}

/* ---- data parallel --------------------------------------------------------------------------- */

#define MAX_WORLD 3

/* An in-test all-reduce across replica threads, as test_gpt.c's: the copies summed in rank
 * order, divided by the world. Called three times a step by a sensorlm (the text embeddings'
 * gather, its gradient's, the gradients). */
typedef struct reduce_group {
    pthread_barrier_t barrier;
    int world;
    float *slot[MAX_WORLD];
} reduce_group;

typedef struct replica {
    reduce_group *g;
    int rank;
    td_train_config cfg;
    tt_recorder *r;
    td_error_t err;
    int rc;
} replica;

static void test_allreduce(void *ud, float *buf, size_t n)
{
    replica *me = ud;
    reduce_group *g = me->g;

    if (me->cfg.kernels == fd_kernels())
        buf = fd_host(buf);
    memcpy(g->slot[me->rank], buf, n * sizeof(float));
    pthread_barrier_wait(&g->barrier);
    for (size_t i = 0; i < n; i++) {
        float s = 0;
        for (int k = 0; k < g->world; k++)
            s += g->slot[k][i];
        buf[i] = s / (float)g->world;
    }
    pthread_barrier_wait(&g->barrier);
}

static void replica_record(void *ud, const char *key, int64_t step, double value)
{
    tt_record(((replica *)ud)->r, key, step, value);
}

static void *replica_main(void *arg)
{
    replica *me = arg;
    td_train_hooks hooks = {.ud = me, .allreduce = test_allreduce};
    td_trainer *t = NULL;
    int done = 0;

    if (me->r != NULL)
        hooks.metric = replica_record;
    me->rc = td_trainer_new(&t, &me->cfg, &hooks, &me->err);
    while (me->rc == 0 && !done) {
        done = td_trainer_step_caught(t, &me->err);
        me->rc = done < 0 ? me->err.code : 0;
    }
    td_trainer_free(t);
    return NULL;
}

static void run_replicas(const td_train_config *cfg, int world, tt_recorder *r)
{
    reduce_group g = {.world = world};
    replica reps[MAX_WORLD];
    pthread_t th[MAX_WORLD];

    memset(r, 0, sizeof(*r));
    pthread_barrier_init(&g.barrier, NULL, (unsigned)world);
    for (int k = 0; k < world; k++) {
        reps[k] = (replica){.g = &g, .rank = k, .cfg = *cfg, .r = r};
        reps[k].cfg.rank = k;
        reps[k].cfg.world = world;
        g.slot[k] = malloc(4u << 20);
    }
    for (int k = 0; k < world; k++)
        assert_int_equal(pthread_create(&th[k], NULL, replica_main, &reps[k]), 0);
    for (int k = 0; k < world; k++) {
        pthread_join(th[k], NULL);
        if (reps[k].rc != 0)
            fail_msg("replica %d: %s: %s", k, td_errname(reps[k].rc), reps[k].err.msg);
        free(g.slot[k]);
    }
    pthread_barrier_destroy(&g.barrier);
}

/* world 2 (even slices) and world 3 (8 rows as 2, 3, 3) against world 1 on the same global
 * batches: every train loss and gradient norm, and the valid loss (rank 0's, over the whole
 * valid split either way), agree within 1e-5 relative (the rankings' counts are left out: a
 * near-tie may turn on the last bit). The replicas gather every text
 * embedding, so each sees the whole batch's B x B logits; what differs is float summation
 * order (the loss's halves, the gradient's average, the gather's x/world*world), a few ulps
 * (~1e-7) per step, which AdamW carries on at about its own size over these 8 steps (the
 * gradient's norm, falling from ~2000 to ~10, shows them most: ~1e-6); a wrong
 * row offset, weight or missing gather is off by 1e-2 or more. */
static void test_data_parallel(void **state)
{
    static tt_recorder r1, rw;
    td_train_config cfg;
    double a[32], b[32];
    td_trainer *t;
    const char *keys[] = {"train_loss", "grad_norm", "valid_loss"};

    slm_config(&cfg);
    cfg.max_steps = 8;
    cfg.eval_every = 4;
    cfg.grad_clip = 1.0f;
    t = new_trainer(&cfg, &r1);
    run_steps(t, 100);
    td_trainer_free(t);
    for (int world = 2; world <= 3; world++) {
        run_replicas(&cfg, world, &rw);
        for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
            int na = tt_values_of(&r1, keys[k], a, NULL, 32);
            assert_int_equal(tt_values_of(&rw, keys[k], b, NULL, 32), na);
            assert_true(na >= 2);
            double worst = 0.0;
            for (int i = 0; i < na; i++)
                worst = fmax(worst, fabs(a[i] - b[i]) / fabs(a[i]));
            print_message("  world %d: %-10s within %.2g relative\n", world, keys[k], worst);

            for (int i = 0; i < na; i++)
                if (fabs(a[i] - b[i]) > 1e-5 * fabs(a[i]))
                    fail_msg("world %d: %s #%d: %.9g, world 1 %.9g", world, keys[k], i, b[i], a[i]);
        }
    }
}

/* ---- on the fake device -------------------------------------------------------------------- */

static int timing(const char *key)
{
    return strcmp(key, "step_ms") == 0 || strcmp(key, "samples_per_s") == 0;
}

static void assert_same_metrics(const tt_recorder *a, const tt_recorder *b)
{
    int j = 0;

    for (int i = 0; i < a->n; i++) {
        if (timing(a->s[i].key))
            continue;
        while (j < b->n && timing(b->s[j].key))
            j++;
        assert_true(j < b->n);
        assert_string_equal(a->s[i].key, b->s[j].key);
        assert_int_equal(a->s[i].step, b->s[j].step);
        if (memcmp(&a->s[i].value, &b->s[j].value, sizeof(double)) != 0)
            fail_msg("%s at step %lld: %.9g vs %.9g", a->s[i].key, (long long)a->s[i].step,
                     a->s[i].value, b->s[j].value);
        j++;
    }
}

/* The sensorlm on the fake device (memory the host cannot touch, the CPU's arithmetic behind
 * it) records the CPU's metrics bit for bit, evaluations included; a step allocates nothing on
 * the device and moves the batch up (patches, tokens, end positions) and the loss and norm
 * down; two replicas on it match two on the CPU bit for bit (the gathers' buffers are device
 * memory). */
static void test_on_device(void **state)
{
    static tt_recorder cpu, dev;
    td_train_config cfg;
    fd_counters before, after;
    td_trainer *t;

    slm_config(&cfg);
    cfg.max_steps = 8;
    cfg.eval_every = 4;
    cfg.grad_clip = 0.5f;
    t = new_trainer(&cfg, &cpu);
    run_steps(t, 100);
    td_trainer_free(t);
    cfg.kernels = fd_kernels();
    t = new_trainer(&cfg, &dev);
    before = fd_counts();
    run_steps(t, 3);
    after = fd_counts();
    assert_int_equal(after.allocs, before.allocs);
    assert_int_equal(after.uploads - before.uploads, 3 * 4); /* x, tok, end, the loss seed */
    /* the loss and the norm in one read-back, the step's only host sync */
    assert_int_equal(after.downloads - before.downloads, 3 * 1);
    assert_int_equal(td_trainer_host_syncs(t), 1);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(fd_counts().allocs, fd_counts().frees);
    assert_same_metrics(&cpu, &dev);

    cfg.kernels = NULL;
    run_replicas(&cfg, 2, &cpu);
    cfg.kernels = fd_kernels();
    run_replicas(&cfg, 2, &dev);
    assert_same_metrics(&cpu, &dev);
}

/* ---- loss.mask_same_label in the trainer ----------------------------------------------------- */

/* A sensor shard at path of N windows of the test grid without labels. */
static void write_unlabeled(const char *path, int N)
{
    td_sensor_header h = {.T = T_STEPS, .C = C_CH, .N = N, .caption_len = 24, .period_s = 60};
    td_sensor_writer *w = NULL;
    td_error_t err = {0};
    float grid[T_STEPS * C_CH];

    for (int c = 0; c < C_CH; c++)
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), "ch%d", c);
    if (td_sensor_writer_open(&w, path, &h, NULL, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < T_STEPS * C_CH; j++)
            grid[j] = (float)((i * 7 + j) % 11);
        if (td_sensor_writer_add(w, grid, "a day", 5, 0, &err) != 0)
            fail_msg("%s", err.msg);
    }
    if (td_sensor_writer_finish(w, NULL, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    td_sensor_writer_free(w);
}

/* loss.mask_same_label through the trainer, on the train shard's 3 labels (every batch of 8
 * repeats them): the first step's loss is below the unmasked one (the same model and batch,
 * fewer negatives; at b = -10 each weighs ~5e-5, so the gap is ~1e-5 relative, far above the
 * float loss's rounding); the arena holds one batch of labels more, and the memory estimate is
 * the trainer's arena; a step allocates nothing, evaluations included; world 2 and 3 give world
 * 1's train losses, gradient norms and valid losses within 1e-5 relative (test_data_parallel's
 * tolerance, for its reasons: every replica takes all 8 labels, as it takes all 8 text rows); the
 * fake device gives the CPU's bits, moving the labels up with the batch; a checkpoint of the
 * masked job is not resumed unmasked (another configuration), only masked; a train shard
 * without labels is refused, by the trainer and by the files' check at submit. */
static void test_mask_trainer(void **state)
{
    static tt_recorder r0, r1, rw, dev;
    const char *keys[] = {"train_loss", "grad_norm", "valid_loss"};
    char nolab[TD_PATH_MAX];
    td_train_config cfg;
    td_mem_estimate est;
    td_error_t err = {0};
    fd_counters before, after;
    double a[32], b[32];
    size_t plain;
    td_trainer *t;

    slm_config(&cfg);
    cfg.max_steps = 8;
    cfg.eval_every = 4;
    cfg.grad_clip = 1.0f;
    t = new_trainer(&cfg, &r0);
    plain = td_trainer_step_bytes(t);
    run_steps(t, 100);
    td_trainer_free(t);

    cfg.mask_same_label = 1;
    t = new_trainer(&cfg, &r1);
    assert_int_equal(td_trainer_step_bytes(t) - plain, td_arena_round(8 * sizeof(int)));
    assert_int_equal(td_train_memory_estimate(&cfg, &est, &err), 0);
    assert_int_equal(est.activations, td_trainer_arena(t)->cap);
    run_steps(t, 2);
    allocations = 0;
    counting = 1;
    run_steps(t, 100);
    counting = 0;
    td_trainer_free(t);
    if (COUNT_ALLOCATIONS)
        assert_int_equal(allocations, 0);
    assert_int_equal(tt_values_of(&r0, "train_loss", a, NULL, 32), 8);
    assert_int_equal(tt_values_of(&r1, "train_loss", b, NULL, 32), 8);
    print_message("  first step: loss %.9g unmasked, %.9g masked\n", a[0], b[0]);
    assert_true(b[0] < a[0]);

    for (int world = 2; world <= 3; world++) {
        run_replicas(&cfg, world, &rw);
        for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
            int na = tt_values_of(&r1, keys[k], a, NULL, 32);
            double worst = 0.0;
            assert_int_equal(tt_values_of(&rw, keys[k], b, NULL, 32), na);
            assert_true(na >= 2);
            for (int i = 0; i < na; i++)
                worst = fmax(worst, fabs(a[i] - b[i]) / fabs(a[i]));
            print_message("  masked, world %d: %-10s within %.2g relative\n", world, keys[k],
                          worst);
            for (int i = 0; i < na; i++)
                if (fabs(a[i] - b[i]) > 1e-5 * fabs(a[i]))
                    fail_msg("masked, world %d: %s #%d: %.9g, world 1 %.9g", world, keys[k], i,
                             b[i], a[i]);
        }
    }

    cfg.kernels = fd_kernels();
    t = new_trainer(&cfg, &dev);
    before = fd_counts();
    run_steps(t, 1);
    after = fd_counts();
    assert_int_equal(after.uploads - before.uploads, 5); /* x, tok, end, the labels, the seed */
    run_steps(t, 100);
    td_trainer_free(t);
    assert_same_metrics(&r1, &dev);
    cfg.kernels = NULL;

    /* another loss is another job: a checkpoint of one setting resumes only that setting */
    tt_path_of(cfg.checkpoint_dir, "ckpt-mask");
    cfg.checkpoint_every = 2;
    t = new_trainer(&cfg, NULL);
    run_steps(t, 2);
    td_trainer_free(t);
    cfg.mask_same_label = 0;
    expect_new_fails(&cfg, TD_ESTATE, "another configuration", "ckpt-2.bin");
    cfg.mask_same_label = 1;
    t = new_trainer(&cfg, NULL);
    assert_int_equal(td_trainer_steps_done(t), 2);
    td_trainer_free(t);
    cfg.checkpoint_dir[0] = '\0';
    cfg.checkpoint_every = 0;

    tt_path_of(nolab, "nolabels.bin");
    write_unlabeled(nolab, 16);
    snprintf(cfg.train_files[0], TD_PATH_MAX, "%s", nolab);
    expect_new_fails(&cfg, TD_EINVAL, "loss.mask_same_label: data.train's shards carry no labels",
                     NULL);
    assert_int_equal(td_train_check_files(&cfg, &err), TD_EINVAL);
    assert_string_equal(err.msg, "loss.mask_same_label: data.train's shards carry no labels");
    cfg.mask_same_label = 0;
    assert_int_equal(td_train_check_files(&cfg, &err), 0);
}

/* ---- the embedder ------------------------------------------------------------------------------
 */

/* An embedder from the trainer and one from the job's last checkpoint give the same bits (at the
 * same rows per forward: sgemm's blocking, so the last bits, may depend on the rows); the
 * embeddings are unit rows; the valid windows' and captions' embeddings ranked as the
 * evaluation ranks them give its recall_at_1 and zeroshot_accuracy exactly; an embedder on the
 * fake device gives the CPU's bits. */
static void test_embedder(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    td_sensorlm_embedder *a = NULL, *b = NULL, *f = NULL;
    td_sensorlm_info info;
    td_error_t err = {0};
    td_sensor *sh;
    enum { NV = 24 };
    float *grids = malloc((size_t)NV * T_STEPS * C_CH * sizeof(float));
    float sa[NV * 8], sb[NV * 8], ua[NV * 8], pa[3 * 8], sf[NV * 8];
    char caps[NV][64];
    const char *texts[NV], *prompts[3] = {"alpha day", "beta day", "gamma day"};
    int32_t labels[NV];
    double v[8];
    int hits = 0, zs = 0;

    slm_config(&cfg);
    cfg.max_steps = 40;
    cfg.eval_every = 40;
    tt_path_of(cfg.checkpoint_dir, "ckpt-embed");
    t = new_trainer(&cfg, &r);
    run_steps(t, 100);
    assert_int_equal(td_sensorlm_embedder_from_trainer(&a, t, 5, &err), 0);
    td_trainer_free(t);
    assert_int_equal(td_sensorlm_embedder_open(&b, &cfg, 5, &err), 0);
    td_sensorlm_embedder_info(b, &info);
    assert_true(info.time_steps == T_STEPS && info.channels == C_CH && info.embed_dim == 8 &&
                info.text_len == 24 && info.step == 40);
    assert_int_equal(td_sensor_open(&sh, valid_path, NULL, &err), 0);
    for (int i = 0; i < NV; i++) {
        size_t len;
        assert_int_equal(td_sensor_read(sh, i, grids + (size_t)i * T_STEPS * C_CH, caps[i], &len,
                                        &labels[i], &err),
                         0);
        texts[i] = caps[i];
    }
    td_sensor_close(sh);
    assert_int_equal(td_sensorlm_embed_windows(a, grids, NV, sa, &err), 0);
    assert_int_equal(td_sensorlm_embed_windows(b, grids, NV, sb, &err), 0);
    assert_memory_equal(sa, sb, sizeof(sa));
    assert_int_equal(td_sensorlm_embed_texts(a, texts, NV, ua, &err), 0);
    assert_int_equal(td_sensorlm_embed_texts(a, prompts, 3, pa, &err), 0);
    for (int i = 0; i < NV; i++) {
        double n2 = 0.0;
        for (int e = 0; e < 8; e++)
            n2 += (double)sa[i * 8 + e] * sa[i * 8 + e];
        assert_true(fabs(n2 - 1.0) < 1e-5); /* 8 squares of floats rounded: ~1e-7 */
    }
    /* the evaluation's own ranking of the same embeddings (float dot products as sgemm gives
     * them may differ in the last bit from these double ones; the test shards' margins are far
     * wider) */
    for (int i = 0; i < NV; i++) {
        double best = -2.0, self = 0.0, zb = -2.0;
        int rank = 0, cls = 0;
        for (int j = 0; j < NV; j++) {
            double s = 0.0;
            for (int e = 0; e < 8; e++)
                s += (double)sa[i * 8 + e] * ua[j * 8 + e];
            if (j == i)
                self = s;
            best = fmax(best, s);
        }
        for (int j = 0; j < NV; j++) {
            double s = 0.0;
            for (int e = 0; e < 8; e++)
                s += (double)sa[i * 8 + e] * ua[j * 8 + e];
            rank += j != i && s >= self;
        }
        for (int k = 0; k < 3; k++) {
            double s = 0.0;
            for (int e = 0; e < 8; e++)
                s += (double)sa[i * 8 + e] * pa[k * 8 + e];
            if (s > zb)
                zb = s, cls = k;
        }
        hits += rank == 0;
        zs += cls == labels[i];
    }
    assert_int_equal(tt_values_of(&r, "recall_at_1", v, NULL, 8), 1);
    assert_true(fabs(v[0] - (double)hits / NV) < 1e-12);
    assert_int_equal(tt_values_of(&r, "zeroshot_accuracy", v, NULL, 8), 1);
    assert_true(fabs(v[0] - (double)zs / NV) < 1e-12);

    cfg.kernels = fd_kernels();
    assert_int_equal(td_sensorlm_embedder_open(&f, &cfg, 5, &err), 0);
    assert_int_equal(td_sensorlm_embed_windows(f, grids, NV, sf, &err), 0);
    assert_memory_equal(sa, sf, sizeof(sa));
    td_sensorlm_embedder_free(f);
    td_sensorlm_embedder_free(a);
    td_sensorlm_embedder_free(b);
    free(grids);
    cfg.kernels = NULL;
    cfg.max_steps = 41; /* another configuration */
    assert_int_equal(td_sensorlm_embedder_open(&b, &cfg, 0, &err), TD_ESTATE);
}

/* ---- the data's errors ------------------------------------------------------------------------
 */

/* What td_trainer_new refuses: a window grid the model's keys disagree with, a train split
 * smaller than a batch, data of another kind. */
static void test_config_errors(void **state)
{
    td_train_config cfg;

    slm_config(&cfg);
    cfg.slm.channels = 4;
    expect_new_fails(&cfg, TD_ESHAPE, "header field channels: 3, but the model expects 4",
                     train_path);
    slm_config(&cfg);
    cfg.slm.time_steps = 25;
    cfg.slm.channels = 3;
    expect_new_fails(&cfg, TD_EINVAL, "patch_t: 4 does not divide time_steps 25", NULL);
    slm_config(&cfg);
    cfg.batch_size = 100;
    expect_new_fails(&cfg, TD_EDATA, "train split: 56 windows, a batch needs 100", NULL);
    slm_config(&cfg);
    cfg.data = TD_DATA_TEXT;
    expect_new_fails(&cfg, TD_EINVAL, "a sensorlm reads sensor data", NULL);
}

/* ---- the memory table of README.md -------------------------------------------------------------
 */

/* The reference ViT-B input (1440 x 34 in patches of 10 x 2: N = 2448) on one GPU, model.size
 * base, fp32 AdamW, at batch 8, 32 and 128: traind's estimate (what the trainer allocates) next
 * to the seed learner's all-layers attention, depth * 2 * B * H * N^2 * 4 bytes, and whether it
 * fits an 80 GB (H100, 81559 MiB) and a 141 GB (H200, 143771 MiB) GPU, each less the 1 GiB the
 * guard keeps; then the largest batch each takes. README.md ("SensorLM", "Memory") prints this
 * table. Asserted: traind's attention stays under 1 GiB at every batch (its scores live in one
 * transient block, which holds one whole sequence's, 288 MB, so that the kernels read each
 * sequence's keys once, twice that in the backward; the rest is O(B*H*N) log-sum-exps), far
 * below the seed formula's, and the estimate grows with the batch. */
static void test_memory_table(void **state)
{
    const double MiB = 1048576.0, cap[2] = {81559.0 - 1024.0, 143771.0 - 1024.0};
    const int batches[] = {8, 32, 128};
    td_train_config cfg;
    td_mem_estimate e;
    td_error_t err = {0};
    size_t last = 0;
    int largest[2];

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_SENSORLM;
    cfg.data = TD_DATA_SENSOR;
    cfg.slm.size = TD_SLM_BASE;
    cfg.slm.time_steps = 1440;
    cfg.slm.channels = 34;
    cfg.kernels = fd_kernels(); /* a device backend: the CUDA workspace counted */
    print_message("  | batch | attention, traind | attention, seed formula | total, traind | "
                  "80 GB | 141 GB |\n");
    for (int i = 0; i < 3; i++) {
        double seed = 12.0 * 2 * batches[i] * 12 * 2448.0 * 2448.0 * 4;
        cfg.batch_size = batches[i];
        if (td_train_memory_estimate(&cfg, &e, &err) != 0)
            fail_msg("%s", err.msg);
        print_message("  | %d | %.0f MiB | %.0f MiB | %.0f MiB (params %.0f, grads %.0f, optim "
                      "%.0f, activations %.0f, workspace %.0f) | %s | %s |\n",
                      batches[i], e.attention / MiB, seed / MiB, e.total / MiB, e.params / MiB,
                      e.grads / MiB, e.optim / MiB, e.activations / MiB, e.workspace / MiB,
                      e.total / MiB <= cap[0] ? "fits" : "no",
                      e.total / MiB <= cap[1] ? "fits" : "no");
        assert_true(e.attention < (size_t)1 << 30);
        assert_true((double)e.attention < seed / 50);
        assert_true(e.total > last);
        last = e.total;
    }
    for (int g = 0; g < 2; g++)
        assert_int_equal(td_train_largest_batch(&cfg, (size_t)(cap[g] * MiB), &largest[g], &err),
                         0);
    print_message("  largest batch: %d on 80 GB, %d on 141 GB\n", largest[0], largest[1]);
    assert_true(largest[1] > largest[0] && largest[0] >= 8);
}

static int group_setup(void **state)
{
    if (tt_tmpdir_make("/tmp/td_test_slm_XXXXXX") != 0)
        return -1;
    tt_path_of(train_path, "train.bin");
    tt_path_of(valid_path, "valid.bin");
    tt_write_sensor(train_path, 56, T_STEPS, C_CH, 24, 1);
    tt_write_sensor(valid_path, 24, T_STEPS, C_CH, 24, 2);
    return 0;
}

static int group_teardown(void **state)
{
    return tt_tmpdir_remove();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_op_gradients),
        cmocka_unit_test(test_l2norm_floor),
        cmocka_unit_test(test_siglip_reference),
        cmocka_unit_test(test_model_gradient_fd),
        cmocka_unit_test(test_mask_reference),
        cmocka_unit_test(test_mask_distinct_is_unmasked),
        cmocka_unit_test(test_parameters),
        cmocka_unit_test(test_dims_errors),
        cmocka_unit_test(test_patchify_and_tokens),
        cmocka_unit_test(test_same_label_weight),
        cmocka_unit_test(test_caption_fit),
        cmocka_unit_test(test_caption_cut),
        cmocka_unit_test(test_multi_prompt),
        cmocka_unit_test(test_trains),
        cmocka_unit_test(test_no_malloc_in_step),
        cmocka_unit_test(test_resume),
        cmocka_unit_test(test_resume_needs_its_chunk),
        cmocka_unit_test(test_data_parallel),
        cmocka_unit_test(test_on_device),
        cmocka_unit_test(test_mask_trainer),
        cmocka_unit_test(test_embedder),
        cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_memory_table),
    };
    td_kernels_cpu()->set_threads(1);
    return cmocka_run_group_tests_name("sensorlm", tests, group_setup, group_teardown);
}
