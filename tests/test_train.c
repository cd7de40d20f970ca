/* Unit tests of train/: the tape's gradient of a whole MLP against finite differences,
 * determinism from the seed, training on small synthetic IDX files the tests write (gzipped
 * and plain), dataset and shape errors with their messages, the NaN/Inf panic, exact step
 * counts and metric timing, the arena estimate, and one epoch of the real Fashion-MNIST. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/ckpt.h"
#include "train/engine.h"
#include "tests/fake_device.h"
#include "common/td_panic.h"
#include "train/train.h"
#include "tests/train_support.h"

#ifndef FASHION_DIR /* -DFASHION_DIR=... points the real-data test elsewhere */
#define FASHION_DIR "/usr/share/datasets/fashion-mnist"
#endif

/* The synthetic task: SIDE x SIDE images, CLASSES classes; class k lights up block k of the
 * image (a 2x2 grid of blocks) over dim noise, so a small MLP learns it in a few epochs. */
#define SIDE    8
#define PIXELS  (SIDE * SIDE)
#define CLASSES 4
#define N_TRAIN 1000
#define N_TEST  200

/* ---- writing IDX files ------------------------------------------------------------------ */

/* A synthetic split of n samples as (name)-images / (name)-labels, gzipped or not. */
static void write_split(td_idx_split *split, const char *name, int n, int gz, uint64_t seed)
{
    uint8_t *img = malloc((size_t)n * PIXELS), *lab = malloc((size_t)n);
    uint32_t idims[3] = {(uint32_t)n, SIDE, SIDE}, ldims[1] = {(uint32_t)n};
    td_rng rng;
    char fname[128];

    td_rng_seed(&rng, seed, 7);
    for (int i = 0; i < n; i++) {
        int k = (int)td_rng_below(&rng, CLASSES);
        lab[i] = (uint8_t)k;
        for (int y = 0; y < SIDE; y++)
            for (int x = 0; x < SIDE; x++) {
                int block = (y >= SIDE / 2) * 2 + (x >= SIDE / 2);
                int base = block == k ? 150 : 0;
                img[(size_t)i * PIXELS + y * SIDE + x] =
                    (uint8_t)(base + (int)td_rng_below(&rng, 100));
            }
    }
    snprintf(fname, sizeof(fname), "%s-images%s", name, gz ? ".gz" : "");
    tt_path_of(split->images, fname);
    tt_write_idx(split->images, gz, TD_IDX_MAGIC_IMAGES, idims, 3, img, (size_t)n * PIXELS);
    snprintf(fname, sizeof(fname), "%s-labels%s", name, gz ? ".gz" : "");
    tt_path_of(split->labels, fname);
    tt_write_idx(split->labels, gz, TD_IDX_MAGIC_LABELS, ldims, 1, lab, (size_t)n);
    free(img);
    free(lab);
}

/* The synthetic job: 64-32-4, AdamW lr 1e-2, batch 128 (so 8 steps an epoch, the last of
 * 104 samples), 3 epochs, test split of 200. */
static void synth_config(td_train_config *cfg, int gz)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_MLP;
    cfg->data = TD_DATA_IDX;
    cfg->layers[0] = PIXELS;
    cfg->layers[1] = 32;
    cfg->layers[2] = CLASSES;
    cfg->n_layers = 3;
    cfg->lr = 1e-2f;
    cfg->epochs = 3;
    write_split(&cfg->train, gz ? "gz-train" : "train", N_TRAIN, gz, 11);
    write_split(&cfg->test, gz ? "gz-test" : "test", N_TEST, gz, 12);
}

/* Runs every step; fails the test on a panic. Returns steps taken. */
static int64_t run_all(td_trainer *t)
{
    td_error_t e = {0};
    int64_t n = 0;
    int done = 0;

    while (!done) {
        done = td_trainer_step_caught(t, &e);
        if (done < 0)
            fail_msg("panic at step %lld: %s: %s", (long long)td_trainer_steps_done(t) + 1,
                     td_errname(e.code), e.msg);
        n++;
    }
    return n;
}

/* ---- the tape: gradient of a whole MLP ----------------------------------------------------- */

/* Loss of the MLP on (x, y), forward only (no tape), from a fresh arena. */
static double mlp_loss(td_ctx *c, td_mlp *m, td_tensor *x, const int *y)
{
    td_ctx eval = {.k = c->k, .arena = c->arena, .tape = NULL};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    double loss = td_mlp_forward(&eval, m, x, y, NULL)->data[0];

    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return loss;
}

/* The gradient the tape gives a 6-5-4-3 MLP (two ReLUs, softmax cross-entropy, batch 4),
 * checked against central differences on a handful of elements of every parameter tensor.
 * Tolerance: |tape - numeric| <= 2e-2 * max(|tape|, |numeric|) + 5e-4. The loss is a float32
 * (~1.1, one ulp 1.2e-7) computed through three layers whose every value moves with the
 * perturbed parameter, so a few ulps of noise over 2*eps = 2e-3 leave ~5e-4 in the numeric
 * gradient; gradients here are 1e-2..3e-1, so a missing or misrouted term (an O(1) relative
 * error) cannot pass. A step of eps in one parameter moves a ReLU input by at most ~1e-2
 * here (|x| <= 2, weights < 1), so the seeds are chosen to keep every ReLU input at least
 * KINK_MARGIN from 0 (and the test checks that), or the finite difference would straddle the
 * kink and disagree for a reason that is not a bug. */
#define KINK_MARGIN 0.02f
static void test_mlp_gradient_through_tape(void **state)
{
    const int sizes[4] = {6, 5, 4, 3};
    const int N = 4;
    const float eps = 1e-3f;
    td_params p = {0};
    td_mlp m;
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_boundary b;
    int y[4] = {0, 2, 1, 2};
    td_rng rng;
    float *saved;
    int live = 0;

    assert_int_equal(td_mlp_declare(&m, &p, sizes, 4), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_mlp_init(&m, 1);
    assert_int_equal(td_arena_init(&arena, 1 << 20), 0);
    assert_int_equal(td_tape_init(&tape, td_mlp_tape_len(&m)), 0);

    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *x = td_tensor_new(&c, 2, (int[]){N, 6}, 0);
        td_tensor *loss;
        td_rng_seed(&rng, 1, 0);
        for (size_t i = 0; i < x->n; i++)
            x->data[i] = 4.0f * td_rng_uniform(&rng) - 2.0f;
        size_t mark = arena.used;
        int tensors = arena.n_tensors;

        loss = td_mlp_forward(&c, &m, x, y, NULL);
        assert_int_equal(tape.len, td_mlp_tape_len(&m));
        /* The premise of the check: no ReLU input within KINK_MARGIN of 0. */
        for (int e = 0; e < tape.len; e++) {
            const td_tensor *pre = tape.entries[e].in[0];
            if (tape.entries[e].op != TD_OP_RELU)
                continue;
            for (size_t i = 0; i < pre->n; i++)
                if (fabsf(pre->data[i]) < KINK_MARGIN)
                    fail_msg("relu input %g is within %g of the kink", pre->data[i], KINK_MARGIN);
        }
        assert_true(arena.used - mark == td_mlp_arena_bytes(&m, N, 1));
        td_backward(&c, loss);
        assert_int_equal(tape.len, 0);
        saved = malloc(p.n * sizeof(float));
        memcpy(saved, p.grad, p.n * sizeof(float));
        arena.used = mark;
        arena.n_tensors = tensors;

        for (int t = 0; t < p.count; t++) {
            td_tensor *pt = p.tensors[t];
            for (size_t i = 0; i < pt->n; i += (pt->n + 3) / 4) {
                float keep = pt->data[i];
                double lp, lm, numeric, analytic = saved[p.offset[t] + i];
                pt->data[i] = keep + eps;
                lp = mlp_loss(&c, &m, x, y);
                pt->data[i] = keep - eps;
                lm = mlp_loss(&c, &m, x, y);
                pt->data[i] = keep;
                numeric = (lp - lm) / (2.0 * eps);
                if (fabs(analytic - numeric) > 2e-2 * fmax(fabs(analytic), fabs(numeric)) + 5e-4)
                    fail_msg("tensor %d [%zu]: tape %.6g vs numeric %.6g", t, i, analytic, numeric);
                live += fabs(analytic) > 5e-3;
            }
        }
        /* not a vacuous pass through dead units: most checked gradients are clearly nonzero */
        assert_true(live >= 12);
        free(saved);
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
}

/* Gradients accumulate (+=) rather than overwrite, which is what lets a tensor read by several
 * ops collect every contribution: two forward+backward passes without zeroing leave exactly
 * twice the gradient of one (the same float sums, added twice, so exactly). */
static void test_gradients_accumulate(void **state)
{
    const int sizes[2] = {3, 2};
    td_params p = {0};
    td_mlp m;
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_boundary b;
    int y[2] = {1, 0};
    float *g1;

    assert_int_equal(td_mlp_declare(&m, &p, sizes, 2), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_mlp_init(&m, 9);
    assert_int_equal(td_arena_init(&arena, 1 << 16), 0);
    assert_int_equal(td_tape_init(&tape, 4), 0);
    g1 = malloc(p.n * sizeof(float));
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *x = td_tensor_new(&c, 2, (int[]){2, 3}, 0);
        for (int i = 0; i < 6; i++)
            x->data[i] = (float)i * 0.25f - 0.5f;
        td_backward(&c, td_mlp_forward(&c, &m, x, y, NULL));
        memcpy(g1, p.grad, p.n * sizeof(float));
        td_backward(&c, td_mlp_forward(&c, &m, x, y, NULL));
        for (size_t i = 0; i < p.n; i++)
            assert_true(p.grad[i] == 2.0f * g1[i]);
        assert_true(g1[0] != 0.0f);
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    free(g1);
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
}

/* A full arena is a TD_ENOMEM panic, not an overrun. */
static void test_arena_exhausted_panics(void **state)
{
    td_arena a;
    td_boundary b;
    volatile int reached = 0;

    assert_int_equal(td_arena_init(&a, 256), 0);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        (void)td_arena_alloc(&a, 200);
        reached = 1;
        (void)td_arena_alloc(&a, 100);
        td_boundary_leave(&b);
        fail_msg("no panic");
    } else {
        assert_int_equal(reached, 1);
        assert_int_equal(b.err.code, TD_ENOMEM);
        assert_non_null(strstr(b.err.msg, "arena"));
    }
    td_arena_free(&a);
}

/* ---- training on synthetic files ------------------------------------------------------------ */

/* Loss falls and the task is learned, from gzipped and from plain files; both read the same
 * bytes, so their runs match bit for bit. */
static void test_synthetic_trains_gz_and_plain(void **state)
{
    static tt_recorder r[2];
    double loss[2][64], acc[4];

    for (int gz = 0; gz < 2; gz++) {
        td_train_config cfg;
        td_trainer *t = NULL;
        td_error_t err = {0};
        td_train_hooks hooks = {.ud = &r[gz], .metric = tt_record};
        int n;

        memset(&r[gz], 0, sizeof(r[gz]));
        synth_config(&cfg, gz);
        assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
        assert_int_equal(run_all(t), 24);
        td_trainer_free(t);
        n = tt_values_of(&r[gz], "train_loss", loss[gz], NULL, 64);
        assert_int_equal(n, 24);
        /* first loss near log(4) = 1.386 for a fresh model; last well below it */
        assert_true(loss[gz][0] > 1.0);
        assert_true(loss[gz][23] < 0.5 * loss[gz][0]);
        assert_int_equal(tt_values_of(&r[gz], "test_accuracy", acc, NULL, 4), 3);
        assert_true(acc[2] > 0.9);
    }
    assert_memory_equal(loss[0], loss[1], 24 * sizeof(double));
}

/* Same seed, same losses bit for bit; another seed, other losses. */
static void test_determinism(void **state)
{
    static tt_recorder r[3];
    double loss[3][24];
    uint64_t seeds[3] = {42, 42, 43};

    for (int i = 0; i < 3; i++) {
        td_train_config cfg;
        td_trainer *t = NULL;
        td_error_t err = {0};
        td_train_hooks hooks = {.ud = &r[i], .metric = tt_record};

        memset(&r[i], 0, sizeof(r[i]));
        synth_config(&cfg, 0);
        cfg.seed = seeds[i];
        cfg.max_steps = 20;
        assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
        run_all(t);
        td_trainer_free(t);
        assert_int_equal(tt_values_of(&r[i], "train_loss", loss[i], NULL, 24), 20);
    }
    assert_memory_equal(loss[0], loss[1], 20 * sizeof(double));
    assert_memory_not_equal(loss[0], loss[2], 20 * sizeof(double));
}

/* The fused step (norm, clip factor and one adamw_flat or sgd_flat call on the backend, one
 * read-back) gives the losses, norms and parameters of the step before it bit for bit: the
 * reference is the CPU table without the flat forms, on which the trainer still reads the loss,
 * then the norm, clips on the host and updates (AdamW tensor by tensor). AdamW with weight decay
 * on (the 2-D tensors only), then SGD with momentum and weight decay; a clip low enough to act
 * on every step. Host syncs per step: 1 fused, 2 the old way. */
static void test_fused_step_unchanged(void **state)
{
    static tt_recorder r[2];
    static td_kernels legacy;
    double loss[2][24], norm[2][24];
    float *params[2];
    size_t n = 0;

    legacy = *td_kernels_cpu();
    legacy.adamw_flat = NULL;
    legacy.sgd_flat = NULL;
    legacy.clip_scale = NULL;
    for (int sgd = 0; sgd < 2; sgd++) {
        for (int i = 0; i < 2; i++) {
            td_train_config cfg;
            td_trainer *t = NULL;
            td_error_t err = {0};
            td_train_hooks hooks = {.ud = &r[i], .metric = tt_record};
            td_params *p;

            memset(&r[i], 0, sizeof(r[i]));
            synth_config(&cfg, 0);
            cfg.max_steps = 20;
            cfg.weight_decay = 0.1f;
            cfg.grad_clip = 0.005f;
            if (sgd) {
                cfg.optim = TD_OPTIM_SGD;
                cfg.lr = 0.1f;
                cfg.momentum = 0.9f;
                cfg.weight_decay = 1e-3f;
            }
            cfg.kernels = i == 0 ? NULL : &legacy;
            assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
            run_all(t);
            assert_int_equal(td_trainer_host_syncs(t), i == 0 ? 1 : 2);
            p = td_trainer_params(t);
            n = p->n;
            params[i] = malloc(n * sizeof(float));
            assert_non_null(params[i]);
            memcpy(params[i], p->data, n * sizeof(float));
            td_trainer_free(t);
            assert_int_equal(tt_values_of(&r[i], "train_loss", loss[i], NULL, 24), 20);
            assert_int_equal(tt_values_of(&r[i], "grad_norm", norm[i], NULL, 24), 20);
        }
        for (int s = 0; s < 20; s++)
            assert_true(norm[0][s] > 0.005); /* the clip acted on every step */
        assert_memory_equal(loss[0], loss[1], 20 * sizeof(double));
        assert_memory_equal(norm[0], norm[1], 20 * sizeof(double));
        assert_memory_equal(params[0], params[1], n * sizeof(float));
        free(params[0]), free(params[1]);
    }
}

/* SGD with momentum trains the same task. */
static void test_sgd_trains(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};
    td_train_hooks hooks = {.ud = &r, .metric = tt_record};
    double loss[24];

    memset(&r, 0, sizeof(r));
    synth_config(&cfg, 0);
    cfg.optim = TD_OPTIM_SGD;
    cfg.lr = 0.1f;
    cfg.momentum = 0.9f;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    run_all(t);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "train_loss", loss, NULL, 24), 24);
    assert_true(loss[23] < 0.5 * loss[0]);
}

/* ---- step counts, metric timing, the arena estimate ---------------------------------------- */

/* 1000 samples at 128 a batch is 8 steps an epoch (7 of 128, one of 104). max_steps, when not
 * -1, replaces epochs: fewer steps, or more (the data cycles on), or none at all. */
static void test_total_steps_and_metrics(void **state)
{
    static tt_recorder r;
    struct {
        int epochs;
        int64_t max_steps, eval_every, total;
    } cases[] = {{3, -1, 0, 24}, {3, 5, 0, 5},   {3, 30, 0, 30},
                 {1, -1, 0, 8},  {3, -1, 5, 24}, {3, 0, 0, 0}};

    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        td_train_config cfg;
        td_trainer *t = NULL;
        td_error_t err = {0};
        td_train_hooks hooks = {.ud = &r, .metric = tt_record};
        int64_t steps[64];
        double v[64];
        int n;

        memset(&r, 0, sizeof(r));
        synth_config(&cfg, 0);
        cfg.epochs = cases[k].epochs;
        cfg.max_steps = cases[k].max_steps;
        cfg.eval_every = cases[k].eval_every;
        assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
        assert_int_equal(td_trainer_total_steps(t), cases[k].total);
        /* max_steps 0: the one step call evaluates (at step 0) and answers "done" */
        assert_int_equal(run_all(t), cases[k].total > 0 ? cases[k].total : 1);
        assert_int_equal(td_trainer_steps_done(t), cases[k].total);
        /* a finished trainer answers "done" and does nothing */
        assert_int_equal(td_trainer_step(t), 1);
        assert_int_equal(td_trainer_steps_done(t), cases[k].total);
        td_trainer_free(t);

        assert_int_equal(tt_values_of(&r, "train_loss", NULL, NULL, 64), cases[k].total);
        assert_int_equal(tt_values_of(&r, "lr", v, NULL, 64), cases[k].total);
        assert_true(cases[k].total == 0 || v[0] == (double)1e-2f);
        assert_int_equal(tt_values_of(&r, "step_ms", NULL, NULL, 64), cases[k].total);
        assert_int_equal(tt_values_of(&r, "samples_per_s", NULL, NULL, 64), cases[k].total);

        /* epoch at steps 1, 9, 17, ... with values 1, 2, 3, ... */
        n = tt_values_of(&r, "epoch", v, steps, 64);
        assert_int_equal(n, (int)((cases[k].total + 7) / 8));
        for (int i = 0; i < n; i++) {
            assert_int_equal(steps[i], 1 + 8 * i);
            assert_true(v[i] == i + 1);
        }

        /* evaluations: each epoch's last step (or every eval_every) and the last step */
        n = tt_values_of(&r, "test_accuracy", v, steps, 64);
        assert_int_equal(tt_values_of(&r, "test_loss", NULL, NULL, 64), n);
        int expect = 0;
        for (int64_t s = cases[k].total == 0 ? 0 : 1; s <= cases[k].total; s++) {
            int due = s == cases[k].total ||
                      (cases[k].eval_every > 0 ? s % cases[k].eval_every == 0 : s % 8 == 0);
            if (due) {
                assert_true(expect < n);
                assert_int_equal(steps[expect], s);
                assert_true(v[expect] >= 0.0 && v[expect] <= 1.0);
                expect++;
            }
        }
        assert_int_equal(n, expect);
    }
}

/* The last batch of an epoch is the remainder: samples_per_s * step_ms says 104 at step 8. */
static void test_last_batch_is_partial(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};
    td_train_hooks hooks = {.ud = &r, .metric = tt_record};
    double sps[8], ms[8];

    memset(&r, 0, sizeof(r));
    synth_config(&cfg, 0);
    cfg.epochs = 1;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    run_all(t);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "samples_per_s", sps, NULL, 8), 8);
    assert_int_equal(tt_values_of(&r, "step_ms", ms, NULL, 8), 8);
    assert_true(ms[7] > 0.0);
    assert_true(fabs(sps[0] * ms[0] / 1e3 - 128.0) < 0.01);
    assert_true(fabs(sps[7] * ms[7] / 1e3 - 104.0) < 0.01);
}

/* The arena is sized from the model's own count, and a training step uses exactly that. */
static void test_arena_estimate_exact(void **state)
{
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};

    synth_config(&cfg, 0);
    cfg.test.images[0] = '\0';
    cfg.max_steps = 3;
    assert_int_equal(td_trainer_new(&t, &cfg, NULL, &err), 0);
    run_all(t);
    assert_int_equal(td_trainer_arena(t)->peak, td_trainer_step_bytes(t));
    assert_int_equal(td_trainer_arena(t)->cap, td_trainer_step_bytes(t));
    td_trainer_free(t);
}

/* ---- errors ---------------------------------------------------------------------------------- */

/* td_trainer_new on cfg must fail with code, and the message must hold every needle. */
static void expect_new_fails(const td_train_config *cfg, int code, const char *n1, const char *n2)
{
    td_trainer *t = (td_trainer *)1;
    td_error_t err = {0};
    int rc = td_trainer_new(&t, cfg, NULL, &err);

    if (rc != code)
        fail_msg("expected %s, got %s: %s", td_errname(code), td_errname(rc), err.msg);
    assert_null(t);
    assert_int_equal(err.code, code);
    if (n1 != NULL && strstr(err.msg, n1) == NULL)
        fail_msg("message \"%s\" lacks \"%s\"", err.msg, n1);
    if (n2 != NULL && strstr(err.msg, n2) == NULL)
        fail_msg("message \"%s\" lacks \"%s\"", err.msg, n2);
}

static void test_bad_files(void **state)
{
    td_train_config cfg;
    uint8_t body[1000] = {0};
    uint32_t dims[3] = {100, SIDE, SIDE};
    char path[TD_PATH_MAX];

    synth_config(&cfg, 1);

    /* missing */
    tt_path_of(cfg.train.images, "nope-images.gz");
    expect_new_fails(&cfg, TD_EDATA, cfg.train.images, "no such file");

    /* bad magic: a labels file given as the images */
    snprintf(cfg.train.images, TD_PATH_MAX, "%s", cfg.train.labels);
    expect_new_fails(&cfg, TD_EDATA, cfg.train.images,
                     "bad magic 0x00000801, expected 0x00000803 (IDX images)");

    /* bad magic, zeros, plain file */
    tt_path_of(path, "zeros");
    tt_write_idx(path, 0, 0, dims, 3, body, sizeof(body));
    snprintf(cfg.train.images, TD_PATH_MAX, "%s", path);
    expect_new_fails(&cfg, TD_EDATA, path, "bad magic 0x00000000, expected 0x00000803");

    /* truncated pixels, gzipped and plain: 100 8x8 images promised, 1000 bytes given */
    for (int gz = 0; gz < 2; gz++) {
        tt_path_of(path, gz ? "short-images.gz" : "short-images");
        tt_write_idx(path, gz, TD_IDX_MAGIC_IMAGES, dims, 3, body, sizeof(body));
        snprintf(cfg.train.images, TD_PATH_MAX, "%s", path);
        expect_new_fails(&cfg, TD_EDATA, path,
                         "truncated: expected 6400 bytes of pixels, got 1000");
    }

    /* an empty file: not even a header */
    tt_path_of(path, "empty");
    fclose(fopen(path, "wb"));
    snprintf(cfg.train.images, TD_PATH_MAX, "%s", path);
    expect_new_fails(&cfg, TD_EDATA, path, "truncated");

    /* a gzip stream cut in half */
    synth_config(&cfg, 1);
    {
        FILE *f = fopen(cfg.train.images, "rb");
        static unsigned char buf[1 << 16];
        size_t n = fread(buf, 1, sizeof(buf), f);
        fclose(f);
        tt_path_of(path, "cut-images.gz");
        f = fopen(path, "wb");
        fwrite(buf, 1, n / 2, f);
        fclose(f);
        snprintf(cfg.train.images, TD_PATH_MAX, "%s", path);
        expect_new_fails(&cfg, TD_EDATA, path, "truncated");
    }

    /* labels count mismatch: 1000 images, 100 labels */
    synth_config(&cfg, 0);
    tt_path_of(cfg.train.labels, "few-labels");
    tt_write_idx(cfg.train.labels, 0, TD_IDX_MAGIC_LABELS, dims, 1, body, 100);
    expect_new_fails(&cfg, TD_EDATA, cfg.train.labels, "labels file has 100 items but images file");

    /* the test split is checked too, and named */
    synth_config(&cfg, 0);
    tt_path_of(cfg.test.labels, "missing-test-labels");
    expect_new_fails(&cfg, TD_EDATA, cfg.test.labels, "no such file");
}

static void test_shape_errors(void **state)
{
    td_train_config cfg;

    synth_config(&cfg, 0);
    cfg.layers[0] = 784;
    expect_new_fails(&cfg, TD_ESHAPE, "layers[0]", "8x8 = 64");

    synth_config(&cfg, 0);
    cfg.layers[2] = CLASSES - 1;
    expect_new_fails(&cfg, TD_ESHAPE, "layers[2]", "4 classes");

    synth_config(&cfg, 0);
    cfg.batch_size = 0;
    expect_new_fails(&cfg, TD_EINVAL, "batch_size", NULL);

    synth_config(&cfg, 0);
    cfg.n_layers = 1;
    expect_new_fails(&cfg, TD_EINVAL, "layers", NULL);
}

/* ---- NaN and Inf --------------------------------------------------------------------------- */

/* Steps until one panics; returns the boundary's error and the step that panicked. */
static td_error_t step_until_panic(td_trainer *t, int64_t *at)
{
    td_error_t e = {0};

    for (int i = 0; i < 100; i++) {
        int done = td_trainer_step_caught(t, &e);
        if (done < 0) {
            *at = td_trainer_steps_done(t) + 1;
            return e;
        }
        if (done)
            break;
    }
    fail_msg("no panic");
    return e;
}

/* lr = 1e30 blows the parameters up after the first update; the next loss is not finite. */
static void test_nan_loss_panics(void **state)
{
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0}, e;
    char want[64];
    int64_t at = 0;

    synth_config(&cfg, 0);
    cfg.lr = 1e30f;
    assert_int_equal(td_trainer_new(&t, &cfg, NULL, &err), 0);
    e = step_until_panic(t, &at);
    assert_int_equal(e.code, TD_ENAN);
    assert_int_equal(at, 2);
    snprintf(want, sizeof(want), "loss is NaN at step %lld", (long long)at);
    if (strcmp(e.msg, want) != 0) {
        snprintf(want, sizeof(want), "loss is Inf at step %lld", (long long)at);
        assert_string_equal(e.msg, want);
    }
    td_trainer_free(t); /* after a panic, free releases everything (valgrind-clean) */
}

/* Poisoned parameters: a NaN weight gives "NaN". Output biases of +3.4e38 for class 0 and
 * -3.4e38 for the others give each sample not of class 0 a loss of 6.8e38 (exact in the
 * kernel's double sum); with about 3/4 of a batch such, the mean is past FLT_MAX: "Inf". */
static void test_poisoned_params_panic(void **state)
{
    for (int kind = 0; kind < 2; kind++) {
        td_train_config cfg;
        td_trainer *t = NULL;
        td_error_t err = {0}, e;
        td_params *p;
        int64_t at = 0;

        synth_config(&cfg, 0);
        assert_int_equal(td_trainer_new(&t, &cfg, NULL, &err), 0);
        p = td_trainer_params(t);
        if (kind == 0) {
            p->tensors[0]->data[3] = NAN;
        } else {
            td_tensor *bias = p->tensors[p->count - 1];
            bias->data[0] = 3.4e38f;
            for (size_t i = 1; i < bias->n; i++)
                bias->data[i] = -3.4e38f;
        }
        e = step_until_panic(t, &at);
        assert_int_equal(e.code, TD_ENAN);
        assert_int_equal(at, 1);
        assert_string_equal(e.msg, kind == 0 ? "loss is NaN at step 1" : "loss is Inf at step 1");
        assert_int_equal(td_trainer_steps_done(t), 0);
        td_trainer_free(t);
    }
}

/* ---- defaults and the real dataset ------------------------------------------------------- */

static void test_config_defaults(void **state)
{
    td_train_config cfg;

    memset(&cfg, 0x5a, sizeof(cfg));
    td_train_config_defaults(&cfg);
    assert_int_equal(cfg.shuffle, 1);
    assert_int_equal(cfg.optim, TD_OPTIM_ADAMW);
    assert_true(cfg.lr == 1e-3f && cfg.beta1 == 0.9f && cfg.beta2 == 0.999f);
    assert_true(cfg.eps == 1e-8f && cfg.weight_decay == 0.0f && cfg.momentum == 0.9f);
    assert_int_equal(cfg.batch_size, 128);
    assert_int_equal(cfg.epochs, 1);
    assert_int_equal(cfg.max_steps, -1);
    assert_int_equal(cfg.eval_every, 0);
    assert_int_equal(cfg.seed, 1);
    assert_int_equal(cfg.threads, 0);
    assert_int_equal(cfg.n_layers, 0);
    assert_int_equal(cfg.train.images[0], '\0');
    assert_int_equal(cfg.test.images[0], '\0');
    /* issue 3 and 5's fields */
    assert_int_equal(cfg.n_layer, 0);
    assert_int_equal(cfg.init_from[0], '\0');
    assert_int_equal(cfg.n_train_files, 0);
    assert_true(cfg.valid_fraction == 0.0f && cfg.grad_clip == 0.0f && cfg.warmup == 0.0f);
    assert_int_equal(cfg.schedule, TD_SCHED_CONSTANT);
    assert_int_equal(cfg.eval_batches, 0);
    assert_int_equal(cfg.checkpoint_dir[0], '\0');
    assert_int_equal(cfg.checkpoint_every, 0);
    assert_int_equal(cfg.keep_checkpoints, 3);
    assert_int_equal(cfg.rank, 0);
    assert_int_equal(cfg.world, 1);
    assert_int_equal(cfg.on_nan, TD_ON_NAN_FAIL);
    assert_int_equal(cfg.debug_fail_kind, TD_FAIL_NONE);
}

/* An MLP resumes too: 20 steps straight (2.5 epochs, reshuffled at each) and 11 steps with a
 * checkpoint at 10, then a new trainer for the rest, give identical losses: the shuffles of
 * the epochs begun are replayed. */
static void test_mlp_resume(void **state)
{
    static tt_recorder r1, r2;
    td_train_config cfg;
    td_train_hooks h1 = {.ud = &r1, .metric = tt_record}, h2 = {.ud = &r2, .metric = tt_record};
    td_trainer *t = NULL;
    td_error_t err = {0};
    double a[24], b[24];

    memset(&r1, 0, sizeof(r1));
    memset(&r2, 0, sizeof(r2));
    synth_config(&cfg, 0);
    cfg.max_steps = 20;
    assert_int_equal(td_trainer_new(&t, &cfg, &h1, &err), 0);
    run_all(t);
    td_trainer_free(t);

    tt_path_of(cfg.checkpoint_dir, "mlp-ckpt");
    cfg.checkpoint_every = 10;
    assert_int_equal(td_trainer_new(&t, &cfg, &h2, &err), 0);
    for (int i = 0; i < 11; i++)
        assert_true(td_trainer_step_caught(t, &err) >= 0);
    td_trainer_free(t);
    memset(&r2, 0, sizeof(r2));
    assert_int_equal(td_trainer_new(&t, &cfg, &h2, &err), 0);
    assert_int_equal(td_trainer_steps_done(t), 10);
    run_all(t);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r1, "train_loss", a, NULL, 24), 20);
    assert_int_equal(tt_values_of(&r2, "train_loss", b, NULL, 24), 10);
    assert_memory_equal(a + 10, b, 10 * sizeof(double));
}

/* What the flush hook saw at each checkpoint: the newest checkpoint already written and the
 * last train_loss step given to the metric hook. */
typedef struct flush_probe {
    tt_recorder r;
    const char *dir;
    int n;
    int64_t newest[8], loss_step[8];
} flush_probe;

static void probe_metric(void *ud, const char *key, int64_t step, double value)
{
    tt_record(&((flush_probe *)ud)->r, key, step, value);
}

static void probe_flush(void *ud)
{
    flush_probe *p = ud;
    td_ckpt_entry e[1];
    int64_t steps[TT_MAX_SAMPLES];
    td_error_t err;
    int n, k = tt_values_of(&p->r, "train_loss", NULL, steps, TT_MAX_SAMPLES);

    assert_int_equal(td_ckpt_list(p->dir, e, 1, &n, &err), 0);
    assert_true(p->n < 8);
    p->newest[p->n] = n > 0 ? e[0].step : 0;
    p->loss_step[p->n] = k > 0 ? steps[k - 1] : 0;
    p->n++;
}

/* The flush hook runs before each checkpoint is written, the periodic ones and the last, once
 * its step's samples are given: whoever makes the samples durable there (the daemon's metric
 * queue, the rank stream) makes a checkpoint that is never ahead of the job's metrics. */
static void test_flush_before_checkpoint(void **state)
{
    static flush_probe p;
    td_train_config cfg;
    td_train_hooks h = {.ud = &p, .metric = probe_metric, .flush = probe_flush};
    td_trainer *t = NULL;
    td_error_t err = {0};

    (void)state;
    memset(&p, 0, sizeof(p));
    synth_config(&cfg, 0);
    cfg.max_steps = 12;
    tt_path_of(cfg.checkpoint_dir, "mlp-flush-ckpt");
    cfg.checkpoint_every = 5;
    p.dir = cfg.checkpoint_dir;
    assert_int_equal(td_trainer_new(&t, &cfg, &h, &err), 0);
    run_all(t);
    td_trainer_free(t);
    /* steps 5, 10 and 12 (the last) */
    assert_int_equal(p.n, 3);
    assert_int_equal(p.loss_step[0], 5);
    assert_int_equal(p.loss_step[1], 10);
    assert_int_equal(p.loss_step[2], 12);
    assert_int_equal(p.newest[0], 0);
    assert_int_equal(p.newest[1], 5);
    assert_int_equal(p.newest[2], 10);
}

/* The mlp on the fake device (tests/fake_device.h: memory the host cannot touch, the CPU's
 * arithmetic behind it): its losses, norms and accuracies (valid and test splits, whose
 * evaluation counts correct rows on the device) are the CPU run's bit for bit, with SGD and
 * momentum; the step loop allocates nothing there; a checkpoint written from the device
 * resumes on it exactly. */
static void test_mlp_on_device(void **state)
{
    static tt_recorder cpu, dev, resumed;
    td_train_config cfg;
    td_train_hooks hooks = {.ud = &cpu, .metric = tt_record};
    td_trainer *t = NULL;
    td_error_t err = {0};
    fd_counters before;
    double a[32], b[32], x[8], y[8];
    int n;

    synth_config(&cfg, 0);
    cfg.optim = TD_OPTIM_SGD;
    cfg.lr = 0.05f;
    cfg.valid_fraction = 0.1f;
    cfg.max_steps = 20;
    cfg.eval_every = 10;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    run_all(t);
    td_trainer_free(t);

    cfg.kernels = fd_kernels();
    hooks.ud = &dev;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    before = fd_counts();
    run_all(t);
    assert_int_equal(fd_counts().allocs, before.allocs);
    td_trainer_free(t);
    n = tt_values_of(&cpu, "train_loss", a, NULL, 32);
    assert_int_equal(n, 20);
    assert_int_equal(tt_values_of(&dev, "train_loss", b, NULL, 32), n);
    assert_memory_equal(a, b, (size_t)n * sizeof(double));
    for (int k = 0; k < 4; k++) {
        const char *key[] = {"grad_norm", "valid_accuracy", "test_loss", "test_accuracy"};
        n = tt_values_of(&cpu, key[k], k == 0 ? a : x, NULL, k == 0 ? 32 : 8);
        assert_true(n > 0);
        assert_int_equal(tt_values_of(&dev, key[k], k == 0 ? b : y, NULL, k == 0 ? 32 : 8), n);
        assert_memory_equal(k == 0 ? a : x, k == 0 ? b : y, (size_t)n * sizeof(double));
    }

    tt_path_of(cfg.checkpoint_dir, "mlp-device-ckpt");
    cfg.checkpoint_every = 7;
    hooks.ud = NULL;
    hooks.metric = NULL;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    for (int i = 0; i < 8; i++)
        assert_true(td_trainer_step_caught(t, &err) >= 0);
    td_trainer_free(t);
    hooks.ud = &resumed;
    hooks.metric = tt_record;
    memset(&resumed, 0, sizeof(resumed));
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    assert_int_equal(td_trainer_steps_done(t), 7);
    run_all(t);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&cpu, "train_loss", a, NULL, 32), 20);
    assert_int_equal(tt_values_of(&resumed, "train_loss", b, NULL, 32), 13);
    assert_memory_equal(a + 7, b, 13 * sizeof(double));
}

/* valid_fraction holds out the train split's last samples: valid_loss and valid_accuracy at
 * each evaluation, next to test_*; the epoch shrinks to the samples left (900: 8 steps of
 * 128, the last of 4). Every step records grad_norm. */
static void test_mlp_valid_split(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_train_hooks hooks = {.ud = &r, .metric = tt_record};
    td_trainer *t = NULL;
    td_error_t err = {0};
    double v[8], sps[8], ms[8];
    int64_t s[8];

    memset(&r, 0, sizeof(r));
    synth_config(&cfg, 0);
    cfg.valid_fraction = 0.1f;
    cfg.epochs = 2;
    assert_int_equal(td_trainer_new(&t, &cfg, &hooks, &err), 0);
    assert_int_equal(td_trainer_total_steps(t), 16);
    run_all(t);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "valid_accuracy", v, s, 8), 2);
    assert_int_equal(s[0], 8);
    assert_int_equal(s[1], 16);
    assert_true(v[1] > 0.5);
    assert_int_equal(tt_values_of(&r, "valid_loss", NULL, NULL, 8), 2);
    assert_int_equal(tt_values_of(&r, "test_loss", NULL, NULL, 8), 2);
    assert_int_equal(tt_values_of(&r, "grad_norm", NULL, NULL, 24), 16);
    assert_int_equal(tt_values_of(&r, "samples_per_s", sps, NULL, 8), 8);
    assert_int_equal(tt_values_of(&r, "step_ms", ms, NULL, 8), 8);
    assert_true(fabs(sps[7] * ms[7] / 1e3 - 4.0) < 0.01);
}

/* The default recipe for one epoch on Fashion-MNIST: 469 steps, test accuracy > 0.83
 * (PyTorch's recipe gets ~0.84 after one epoch and 0.867 after three). */
static void test_fashion_mnist_one_epoch(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};
    td_train_hooks hooks = {.ud = &r, .metric = tt_record};
    double acc[2], loss[2];
    const int layers[4] = {784, 256, 256, 10};

    if (access(FASHION_DIR, R_OK) != 0)
        skip();
    memset(&r, 0, sizeof(r));
    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_MLP;
    cfg.data = TD_DATA_IDX;
    memcpy(cfg.layers, layers, sizeof(layers));
    cfg.n_layers = 4;
    snprintf(cfg.train.images, TD_PATH_MAX, "%s/train-images-idx3-ubyte.gz", FASHION_DIR);
    snprintf(cfg.train.labels, TD_PATH_MAX, "%s/train-labels-idx1-ubyte.gz", FASHION_DIR);
    snprintf(cfg.test.images, TD_PATH_MAX, "%s/t10k-images-idx3-ubyte.gz", FASHION_DIR);
    snprintf(cfg.test.labels, TD_PATH_MAX, "%s/t10k-labels-idx1-ubyte.gz", FASHION_DIR);
    if (td_trainer_new(&t, &cfg, &hooks, &err) != 0)
        fail_msg("%s", err.msg);
    assert_int_equal(td_trainer_total_steps(t), 469);
    assert_int_equal(run_all(t), 469);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "test_accuracy", acc, NULL, 2), 1);
    assert_int_equal(tt_values_of(&r, "test_loss", loss, NULL, 2), 1);
    print_message("fashion-mnist, 1 epoch: test_loss %.4f, test_accuracy %.4f\n", loss[0], acc[0]);
    assert_true(acc[0] > 0.83);
    assert_true(loss[0] < 0.5);
}

/* ---- fixture --------------------------------------------------------------------------------- */

static int setup(void **state)
{
    return tt_tmpdir_make("/tmp/td_test_train_XXXXXX");
}

static int teardown(void **state)
{
    return tt_tmpdir_remove();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_gradient_through_tape),
        cmocka_unit_test(test_gradients_accumulate),
        cmocka_unit_test(test_arena_exhausted_panics),
        cmocka_unit_test(test_synthetic_trains_gz_and_plain),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_fused_step_unchanged),
        cmocka_unit_test(test_sgd_trains),
        cmocka_unit_test(test_total_steps_and_metrics),
        cmocka_unit_test(test_last_batch_is_partial),
        cmocka_unit_test(test_arena_estimate_exact),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_shape_errors),
        cmocka_unit_test(test_nan_loss_panics),
        cmocka_unit_test(test_poisoned_params_panic),
        cmocka_unit_test(test_config_defaults),
        cmocka_unit_test(test_mlp_resume),
        cmocka_unit_test(test_flush_before_checkpoint),
        cmocka_unit_test(test_mlp_valid_split),
        cmocka_unit_test(test_mlp_on_device),
        cmocka_unit_test(test_fashion_mnist_one_epoch),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
