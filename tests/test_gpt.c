/* Unit tests of the GPT engine (train/gpt.c, schedule.c, llmc.c, sample.c and the gpt paths of
 * trainer.c): the whole model's tape gradient against finite differences, the arena estimate,
 * training on a small text, determinism, resume equality, the llm.c model file round trip and
 * its refusals, data-parallel replicas against one, the schedules, AdamW's decay, clipping,
 * the NaN policy and injected faults, evaluation-only jobs, sampling and token shards. Each
 * numerical check states its tolerance and why. Tiny models, so the file runs in seconds. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/engine.h"
#include "tests/fake_device.h"
#include "common/td_panic.h"
#include "train/train.h"
#include "tests/train_support.h"

static char text_path[TD_PATH_MAX];

/* ---- counting allocations ------------------------------------------------------------------- */

/* This executable's malloc family forwards to glibc's own and counts calls while counting is
 * set, on any thread (OpenBLAS's workers included): "no malloc in the step loop" as a test.
 * Not under a sanitizer, whose own malloc must stay in charge (the test is skipped there). */
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

/* ---- fixtures: text, metrics, steps --------------------------------------------------------- */

/* The test job: L=2, C=32, NH=4, T=16, B=4 on the text, AdamW lr 1e-2, 10% held out. */
static void gpt_config(td_train_config *cfg)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_GPT;
    cfg->data = TD_DATA_TEXT;
    cfg->n_layer = 2;
    cfg->n_head = 4;
    cfg->n_embd = 32;
    cfg->seq_len = 16;
    cfg->vocab_size = 256;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", text_path);
    cfg->n_train_files = 1;
    cfg->valid_fraction = 0.1f;
    cfg->batch_size = 4;
    cfg->lr = 1e-2f;
    cfg->max_steps = 10;
    cfg->eval_batches = 4;
    cfg->threads = 1;
}

/* Runs steps until done or max steps; fails the test on a panic. Returns steps taken. */
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

/* A trainer from cfg recording into r (cleared); fails the test when it cannot be built. */
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

/* td_trainer_new on cfg must fail with code and a message holding every needle. */
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

/* ---- the model's gradient ------------------------------------------------------------------- */

/* The loss of one forward, no tape. */
static double gpt_loss(td_ctx *c, td_gpt *m, const int *tok, const int *tgt, int B, int T)
{
    td_ctx ev = {.k = c->k, .arena = c->arena, .tape = NULL};
    size_t mark = c->arena->used;
    int tensors = c->arena->n_tensors;
    double v = td_gpt_forward(&ev, m, tok, tgt, B, T, NULL)->data[0];

    c->arena->used = mark;
    c->arena->n_tensors = tensors;
    return v;
}

/* The whole GPT's tape gradient against central differences of its loss, at a spread of
 * elements of every one of the 16 tensors (padding rows of wte included: both 0). Tiny dims
 * (L=2, C=8, NH=2, T=5, B=2, V=11 padded to 64) and weights drawn wider than llm.c's 0.02
 * (U(-0.4, 0.4), LayerNorm weights 1 +- 0.3) so that gradients reach every tensor at O(1e-2..1).
 * Tolerance 3e-2 relative + 2e-4 absolute: the loss (~2.4) is one float32, so each FD
 * evaluation carries ~2e-7 of rounding, ~1e-4 after dividing by 2*eps = 2e-3, plus the
 * rounding of the ~500 activations a perturbation moves; a missing term or a wrong index is
 * off by far more. */
static void test_gpt_gradient_fd(void **state)
{
    td_gpt_dims d = {.maxT = 6, .V = 11, .Vp = 64, .L = 2, .NH = 2, .C = 8};
    const int B = 2, T = 5;
    const float eps = 1e-3f;
    int tok[10], tgt[10];
    td_params p = {0};
    td_gpt *m = calloc(1, sizeof(*m));
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_error_t err = {0};
    td_boundary b;
    td_rng rng;
    float *grad;
    int live = 0, checked = 0;

    assert_int_equal(td_gpt_padded_vocab(11), 64);
    assert_int_equal(td_gpt_padded_vocab(256), 256);
    assert_int_equal(td_gpt_padded_vocab(50257), 50304);
    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 3);
    td_rng_seed(&rng, 5, 0);
    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        td_tensor *t = &m->p[i];
        int ln = i == TD_GPT_LN1W || i == TD_GPT_LN2W || i == TD_GPT_LNFW;
        size_t n = i == TD_GPT_WTE ? (size_t)d.V * d.C : t->n;
        for (size_t j = 0; j < n; j++)
            t->data[j] = (ln ? 1.0f : 0.0f) + (ln ? 0.3f : 0.4f) * (2 * td_rng_uniform(&rng) - 1);
    }
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int)td_rng_below(&rng, 11);
        tgt[i] = (int)td_rng_below(&rng, 11);
    }
    assert_int_equal(td_arena_init(&arena, td_gpt_arena_bytes(m, B, T, 1)), 0);
    assert_int_equal(td_tape_init(&tape, td_gpt_tape_len(m)), 0);
    grad = malloc(p.n * sizeof(float));
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *loss = td_gpt_forward(&c, m, tok, tgt, B, T, NULL);
        assert_int_equal(tape.len, td_gpt_tape_len(m));
        td_backward(&c, loss);
        assert_int_equal(arena.peak, td_gpt_arena_bytes(m, B, T, 1));
        memcpy(grad, p.grad, p.n * sizeof(float));
        td_arena_reset(&arena);
        for (int i = 0; i < TD_GPT_TENSORS; i++) {
            td_tensor *t = &m->p[i];
            size_t stride = t->n / 7 + 1;
            for (size_t j = i % 3; j < t->n; j += stride) {
                float keep = t->data[j];
                double lp, lm, num, ana = grad[p.offset[i] + j];
                t->data[j] = keep + eps;
                lp = gpt_loss(&c, m, tok, tgt, B, T);
                t->data[j] = keep - eps;
                lm = gpt_loss(&c, m, tok, tgt, B, T);
                t->data[j] = keep;
                num = (lp - lm) / (2.0 * eps);
                if (fabs(ana - num) > 3e-2 * fmax(fabs(ana), fabs(num)) + 2e-4)
                    fail_msg("tensor %d [%zu]: tape %.6g vs numeric %.6g", i, j, ana, num);
                live += fabs(ana) > 1e-2;
                checked++;
            }
        }
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    print_message("gpt gradient: %d elements checked, %d with |g| > 1e-2\n", checked, live);
    assert_true(live > checked / 2);
    free(grad);
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
    free(m);
}

/* The fused classifier against the unfused op over a few steps of plain SGD: td_gpt_forward
 * fuses when no logits are asked for and keeps probs when they are, so the same model goes both
 * ways at each step. Same float operations in the same order (test_kernels's
 * test_softmax_xent_fused), so losses and every gradient are equal bit for bit, and the fused
 * step's arena peak is td_gpt_arena_bytes exactly (the unfused one takes the probs on top). */
static void test_gpt_fused_classifier(void **state)
{
    td_gpt_dims d = {.maxT = 6, .V = 11, .Vp = 64, .L = 2, .NH = 2, .C = 8};
    const int B = 2, T = 5;
    int tok[10], tgt[10];
    td_params p = {0};
    td_gpt *m = calloc(1, sizeof(*m));
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = td_kernels_cpu(), .arena = &arena, .tape = &tape};
    td_error_t err = {0};
    td_boundary b;
    td_rng rng;
    float *grad;
    size_t fused_bytes;

    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 3);
    td_rng_seed(&rng, 9, 0);
    for (int i = 0; i < B * T; i++) {
        tok[i] = (int)td_rng_below(&rng, 11);
        tgt[i] = (int)td_rng_below(&rng, 11);
    }
    fused_bytes = td_gpt_arena_bytes(m, B, T, 1);
    /* the unfused op's probs, and the gradient buffer of logits asked back */
    assert_int_equal(
        td_arena_init(&arena, fused_bytes + td_op_bytes_softmax_xent(B * T, d.Vp, 1) +
                                  td_arena_round((size_t)B * T * d.Vp * sizeof(float))),
        0);
    assert_int_equal(td_tape_init(&tape, td_gpt_tape_len(m)), 0);
    grad = malloc(p.n * sizeof(float));
    assert_non_null(grad);
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        for (int step = 0; step < 4; step++) {
            td_tensor *logits = NULL, *loss;
            float fused, unfused;

            memset(p.grad, 0, p.n * sizeof(float));
            td_arena_reset(&arena);
            arena.peak = 0;
            loss = td_gpt_forward(&c, m, tok, tgt, B, T, NULL);
            fused = loss->data[0];
            td_backward(&c, loss);
            assert_int_equal(arena.peak, fused_bytes);
            memcpy(grad, p.grad, p.n * sizeof(float));

            memset(p.grad, 0, p.n * sizeof(float));
            td_arena_reset(&arena);
            loss = td_gpt_forward(&c, m, tok, tgt, B, T, &logits);
            unfused = loss->data[0];
            td_backward(&c, loss);
            if (fused != unfused)
                fail_msg("step %d: fused loss %.9g, unfused %.9g", step, fused, unfused);
            print_message("step %d: loss %.9g\n", step, fused);
            assert_memory_equal(grad, p.grad, p.n * sizeof(float));
            for (size_t j = 0; j < p.n; j++)
                p.data[j] -= 0.5f * grad[j];
        }
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    free(grad);
    td_tape_free(&tape);
    td_arena_free(&arena);
    td_params_free(&p);
    free(m);
}

/* llm.c's init: LayerNorm weights 1, biases 0, wte's padding rows 0, weights with standard
 * deviation 0.02 and the residual projections 0.02/sqrt(2L) (sample std within 5%: tens of
 * thousands of draws), and the same seed gives the same bits. */
static void test_gpt_init(void **state)
{
    td_gpt_dims d = {.maxT = 64, .V = 250, .Vp = 256, .L = 2, .NH = 4, .C = 64};
    td_gpt *m = calloc(1, sizeof(*m)), *m2 = calloc(1, sizeof(*m2));
    td_params p = {0}, p2 = {0};
    td_error_t err = {0};
    double ss = 0, ss2 = 0;
    size_t per = (size_t)d.C * d.C;

    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 7);
    assert_int_equal(td_gpt_declare(m2, &p2, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p2, 0), 0);
    td_gpt_bind(m2);
    td_gpt_init(m2, 7);
    assert_memory_equal(p.data, p2.data, p.n * sizeof(float));
    assert_int_equal(td_gpt_num_params(&d),
                     256 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64);
    for (size_t i = 0; i < m->p[TD_GPT_LN1W].n; i++)
        assert_true(m->p[TD_GPT_LN1W].data[i] == 1.0f && m->p[TD_GPT_LN2B].data[i] == 0.0f);
    for (size_t i = (size_t)d.V * d.C; i < m->p[TD_GPT_WTE].n; i++)
        assert_true(m->p[TD_GPT_WTE].data[i] == 0.0f);
    for (size_t i = 0; i < m->p[TD_GPT_QKVW].n; i++)
        ss += (double)m->p[TD_GPT_QKVW].data[i] * m->p[TD_GPT_QKVW].data[i];
    for (size_t i = 0; i < 2 * per; i++)
        ss2 += (double)m->p[TD_GPT_ATTPROJW].data[i] * m->p[TD_GPT_ATTPROJW].data[i];
    assert_float_equal(sqrt(ss / m->p[TD_GPT_QKVW].n), 0.02, 0.001);
    assert_float_equal(sqrt(ss2 / (2 * per)), 0.02 / sqrt(4.0), 0.0005);
    /* the layer views point into the stacked tensors */
    assert_ptr_equal(m->layer[1][TD_GPT_QKVW - 2].data, m->p[TD_GPT_QKVW].data + 3 * per);
    td_params_free(&p);
    td_params_free(&p2);
    free(m);
    free(m2);
}

/* ---- the trainer ------------------------------------------------------------------------------
 */

/* A training step takes exactly the arena bytes the model's own count says (the arena is sized
 * from it, evaluation batches being smaller); metrics every step, valid_loss when due. */
static void test_gpt_trains_and_metrics(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    double loss[40], v[40];
    int64_t steps[40];

    gpt_config(&cfg);
    cfg.max_steps = 40;
    cfg.eval_every = 15;
    t = new_trainer(&cfg, &r);
    assert_int_equal(td_trainer_total_steps(t), 40);
    assert_int_equal(run_steps(t, 100), 40);
    assert_int_equal(td_trainer_arena(t)->peak, td_trainer_step_bytes(t));
    assert_int_equal(td_trainer_arena(t)->cap, td_trainer_step_bytes(t));
    td_trainer_free(t);

    assert_int_equal(tt_values_of(&r, "train_loss", loss, NULL, 40), 40);
    assert_int_equal(tt_values_of(&r, "lr", NULL, NULL, 40), 40);
    assert_int_equal(tt_values_of(&r, "grad_norm", v, NULL, 40), 40);
    assert_true(v[0] > 0 && isfinite(v[0]));
    assert_int_equal(tt_values_of(&r, "step_ms", NULL, NULL, 40), 40);
    assert_int_equal(tt_values_of(&r, "tokens_per_s", NULL, NULL, 40), 40);
    assert_int_equal(tt_values_of(&r, "samples_per_s", NULL, NULL, 40), 0);
    assert_int_equal(tt_values_of(&r, "epoch", NULL, NULL, 40), 0);
    /* starts near log(256) = 5.55 (a uniform guess), learns the text's letters */
    assert_true(loss[0] > 5.0 && loss[0] < 6.0);
    assert_true(loss[39] < 0.6 * loss[0]);
    assert_int_equal(tt_values_of(&r, "valid_loss", v, steps, 40), 3);
    assert_int_equal(steps[0], 15);
    assert_int_equal(steps[1], 30);
    assert_int_equal(steps[2], 40);
    assert_true(v[2] < 0.6 * loss[0]);
}

/* td_trainer_step allocates nothing, evaluation steps included (a checkpoint step writes a
 * file and is left out): every buffer comes from td_trainer_new. */
static void test_no_malloc_in_step(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;

    if (!COUNT_ALLOCATIONS)
        skip();
    gpt_config(&cfg);
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

/* The same job twice: bit-identical losses. */
static void test_gpt_determinism(void **state)
{
    static tt_recorder r1, r2;
    td_train_config cfg;
    double a[12], b[12];
    td_trainer *t;

    gpt_config(&cfg);
    t = new_trainer(&cfg, &r1);
    run_steps(t, 100);
    td_trainer_free(t);
    t = new_trainer(&cfg, &r2);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r1, "train_loss", a, NULL, 12), 10);
    assert_int_equal(tt_values_of(&r2, "train_loss", b, NULL, 12), 10);
    assert_memory_equal(a, b, 10 * sizeof(double));
    assert_int_equal(tt_values_of(&r1, "valid_loss", a, NULL, 12), 1);
    assert_int_equal(tt_values_of(&r2, "valid_loss", b, NULL, 12), 1);
    assert_true(a[0] == b[0]);
}

/* The same job on 1, 2 and 3 threads: bit-identical losses, since every op cuts its work by its
 * shape alone (kernels/README.md, "Threads"); and on 2 threads a step still allocates nothing
 * (the team is made by td_trainer_new). The model is large enough that every kind of op is cut
 * into several tasks: matmuls into tiles (qkv is 512x384x128), layernorms, the softmax and the
 * encoder into blocks of rows, the attention into its 32 (sequence, head) pairs, GELU and
 * AdamW into spans. */
static void test_gpt_threads(void **state)
{
    static tt_recorder r[3];
    td_train_config cfg;
    double loss[3][6], valid[3][2];
    td_trainer *t;

    gpt_config(&cfg);
    cfg.n_embd = 128;
    cfg.seq_len = 64;
    cfg.batch_size = 8;
    cfg.max_steps = 5;
    cfg.eval_every = 5;
    cfg.eval_batches = 1;
    for (int n = 0; n < 3; n++) {
        cfg.threads = n + 1;
        t = new_trainer(&cfg, &r[n]);
        run_steps(t, 1);
        if (n == 1 && COUNT_ALLOCATIONS) {
            allocations = 0;
            counting = 1;
        }
        run_steps(t, 100);
        counting = 0;
        td_trainer_free(t);
        if (n == 1 && COUNT_ALLOCATIONS)
            assert_int_equal(allocations, 0);
        assert_int_equal(tt_values_of(&r[n], "train_loss", loss[n], NULL, 6), 5);
        assert_int_equal(tt_values_of(&r[n], "valid_loss", valid[n], NULL, 2), 1);
    }
    for (int n = 1; n < 3; n++) {
        assert_memory_equal(loss[0], loss[n], 5 * sizeof(double));
        assert_true(valid[0][0] == valid[n][0]);
    }
}

/* 2N steps straight, and N steps + checkpoint + a new trainer + N steps, give identical losses:
 * the parameters, moments, step and data cursor all come back. The text's train split holds
 * 4 batches an epoch here, so the resumed run crosses a reshuffle. A checkpoint of another
 * configuration is refused. */
static void test_gpt_resume(void **state)
{
    static tt_recorder r1, r2, r3;
    td_train_config cfg;
    td_trainer *t;
    double a[16], b[16];
    int64_t sa[16], sb[16];
    char dir[TD_PATH_MAX];
    int n;

    gpt_config(&cfg);
    tt_path_of(cfg.train_files[0], "small.txt");
    tt_write_text(cfg.train_files[0], 330);
    cfg.valid_fraction = 0.2f;
    cfg.eval_every = 3;
    cfg.max_steps = 12;
    t = new_trainer(&cfg, &r1);
    run_steps(t, 100);
    td_trainer_free(t);

    tt_path_of(dir, "ckpt-resume");
    snprintf(cfg.checkpoint_dir, TD_PATH_MAX, "%s", dir);
    cfg.checkpoint_every = 4;
    t = new_trainer(&cfg, &r2);
    run_steps(t, 6); /* checkpoint at 4, then two steps the resume repeats */
    td_trainer_free(t);
    t = new_trainer(&cfg, &r3);
    assert_int_equal(td_trainer_steps_done(t), 4);
    run_steps(t, 100);
    td_trainer_free(t);

    assert_int_equal(tt_values_of(&r1, "train_loss", a, sa, 16), 12);
    n = tt_values_of(&r3, "train_loss", b, sb, 16);
    assert_int_equal(n, 8);
    for (int i = 0; i < n; i++) {
        assert_int_equal(sb[i], 5 + i);
        if (a[4 + i] != b[i])
            fail_msg("step %d: straight %.9g, resumed %.9g", 5 + i, a[4 + i], b[i]);
    }
    assert_int_equal(tt_values_of(&r1, "valid_loss", a, sa, 16), 4);
    assert_int_equal(tt_values_of(&r3, "valid_loss", b, sb, 16), 3);
    for (int i = 0; i < 3; i++)
        assert_true(a[1 + i] == b[i] && sa[1 + i] == sb[i]);

    /* explicit checkpoint (cancel): a new trainer continues from it */
    cfg.max_steps = 12;
    t = new_trainer(&cfg, NULL); /* resumes at 12: done */
    assert_int_equal(td_trainer_steps_done(t), 12);
    assert_int_equal(td_trainer_step(t), 1);
    td_trainer_free(t);

    /* another configuration in the same directory is refused */
    cfg.lr = 2e-2f;
    expect_new_fails(&cfg, TD_ESTATE, "another configuration", "ckpt-12.bin");
}

/* td_trainer_checkpoint() writes now; rank != 0 and no directory do nothing. */
static void test_gpt_checkpoint_now(void **state)
{
    td_train_config cfg;
    td_trainer *t;
    td_error_t err = {0};
    char path[TD_PATH_MAX + 32];
    struct stat st;

    gpt_config(&cfg);
    t = new_trainer(&cfg, NULL);
    assert_int_equal(td_trainer_checkpoint(t, &err), 0); /* no directory: nothing */
    td_trainer_free(t);
    tt_path_of(cfg.checkpoint_dir, "ckpt-now");
    t = new_trainer(&cfg, NULL);
    run_steps(t, 3);
    assert_int_equal(td_trainer_checkpoint(t, &err), 0);
    td_trainer_free(t);
    snprintf(path, sizeof(path), "%s/ckpt-3.bin", cfg.checkpoint_dir);
    assert_int_equal(stat(path, &st), 0);
    t = new_trainer(&cfg, NULL);
    assert_int_equal(td_trainer_steps_done(t), 3);
    td_trainer_free(t);
}

/* ---- llm.c model files ------------------------------------------------------------------------
 */

static void write_header(const char *path, int32_t magic, int32_t version, const int32_t *dims,
                         size_t body_floats)
{
    int32_t h[256] = {0};
    FILE *f = fopen(path, "wb");
    float zero = 0;

    h[0] = magic;
    h[1] = version;
    memcpy(h + 2, dims, 6 * sizeof(int32_t));
    assert_non_null(f);
    assert_int_equal(fwrite(h, sizeof(h), 1, f), 1);
    for (size_t i = 0; i < body_floats; i++)
        assert_int_equal(fwrite(&zero, sizeof(zero), 1, f), 1);
    assert_int_equal(fclose(f), 0);
}

/* Train, export, and start a new job from the file (max_steps 0: evaluate only): the valid
 * loss is the trained job's last one, bit for bit (same parameters, same batches, same
 * arithmetic). The file is llm.c's: header and size. Then the refusals. */
static void test_llmc_round_trip(void **state)
{
    static tt_recorder r1, r2;
    td_train_config cfg, cfg2;
    td_trainer *t;
    td_error_t err = {0};
    char model[TD_PATH_MAX], bad[TD_PATH_MAX];
    int32_t h[256];
    double v1[4], v2[4];
    int64_t s2[4];
    struct stat st;
    FILE *f;
    td_gpt_dims d = {.maxT = 16, .V = 256, .Vp = 256, .L = 2, .NH = 4, .C = 32};
    size_t nparams = td_gpt_num_params(&d);

    gpt_config(&cfg);
    cfg.max_steps = 3;
    tt_path_of(cfg.checkpoint_dir, "ckpt-export");
    tt_path_of(model, "model.bin");
    assert_int_equal(td_export_llmc(&cfg, model, &err), TD_ENOTFOUND);
    t = new_trainer(&cfg, &r1);
    run_steps(t, 10);
    td_trainer_free(t);
    assert_int_equal(td_export_llmc(&cfg, model, &err), 0);

    f = fopen(model, "rb");
    assert_non_null(f);
    assert_int_equal(fread(h, sizeof(h), 1, f), 1);
    fclose(f);
    assert_int_equal(h[0], 20240326);
    assert_int_equal(h[1], 3);
    assert_int_equal(h[2], 16);
    assert_int_equal(h[3], 256);
    assert_int_equal(h[4], 2);
    assert_int_equal(h[5], 4);
    assert_int_equal(h[6], 32);
    assert_int_equal(h[7], 256);
    assert_int_equal(stat(model, &st), 0);
    assert_int_equal(st.st_size, 1024 + 4 * nparams);

    cfg2 = cfg;
    cfg2.checkpoint_dir[0] = '\0';
    cfg2.max_steps = 0;
    snprintf(cfg2.init_from, TD_PATH_MAX, "%s", model);
    cfg2.n_layer = cfg2.n_head = cfg2.n_embd = cfg2.vocab_size = 0; /* from the file */
    t = new_trainer(&cfg2, &r2);
    assert_int_equal(td_trainer_step(t), 1);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r1, "valid_loss", v1, NULL, 4), 1);
    assert_int_equal(tt_values_of(&r2, "valid_loss", v2, s2, 4), 1);
    assert_int_equal(s2[0], 0);
    assert_int_equal(tt_values_of(&r2, "train_loss", NULL, NULL, 4), 0);
    if (v1[0] != v2[0])
        fail_msg("valid loss %.9g trained, %.9g imported", v1[0], v2[0]);

    /* dimensions the job gives must agree with the file's */
    cfg2.n_embd = 64;
    expect_new_fails(&cfg2, TD_ESHAPE, "model.n_embd: 64 in the job but 32 in", model);
    cfg2.n_embd = 32;
    cfg2.seq_len = 32;
    expect_new_fails(&cfg2, TD_ESHAPE, "model.seq_len: 32", "16 positions");
    cfg2.seq_len = 16;

    /* bad files */
    tt_path_of(bad, "bad.bin");
    snprintf(cfg2.init_from, TD_PATH_MAX, "%s", bad);
    int32_t dims[6] = {16, 256, 2, 4, 32, 256};
    write_header(bad, 20240520, 3, dims, nparams);
    expect_new_fails(&cfg2, TD_EDATA, "bad magic 20240520", "20240326");
    write_header(bad, 20240326, 5, dims, nparams);
    expect_new_fails(&cfg2, TD_EDATA, "unsupported version 5", "version 3");
    write_header(bad, 20240326, 3, dims, nparams - 1);
    expect_new_fails(&cfg2, TD_EDATA, "wrong size", "bad.bin");
    dims[4] = 30; /* C not a multiple of NH */
    write_header(bad, 20240326, 3, dims, nparams);
    expect_new_fails(&cfg2, TD_EDATA, "bad header", "n_embd");
    tt_path_of(cfg2.init_from, "missing.bin");
    expect_new_fails(&cfg2, TD_ENOTFOUND, "missing.bin", NULL);
}

/* ---- data parallel ----------------------------------------------------------------------------
 */

#define MAX_WORLD 3

/* An in-test all-reduce across replica threads: each copies its buffer in, and after a
 * barrier every replica sums the copies in rank order and divides by the world, so all get
 * the same bits. */
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

    if (me->cfg.kernels == fd_kernels()) /* the fake device's memory, as the host sees it */
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

/* tt_record() for replicas: the recorder hangs off the replica. */
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

/* Runs cfg on world replicas in threads; rank 0's metrics land in r. */
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

/* world 2 (even slices) and world 3 (4 rows as 1, 1, 2: weighted) against world 1 with the
 * same global batch: train and valid losses agree within 1e-5 relative. The only difference is
 * float summation order (a mean of two half-batch means vs one mean, then the average), a few
 * float32 ulps (~1e-7) in each gradient; AdamW's normalised updates carry such differences on
 * at about their own size over these 8 steps, so 1e-5 leaves room and still catches a wrong
 * slice, weight or missing average (off by 1e-2 or more). Only rank 0 records. */
static void test_data_parallel(void **state)
{
    static tt_recorder r1, rw;
    td_train_config cfg;
    double a[16], b[16];
    int64_t sa[16], sb[16];
    td_trainer *t;

    gpt_config(&cfg);
    cfg.max_steps = 8;
    cfg.eval_every = 4;
    cfg.grad_clip = 1.0f;
    t = new_trainer(&cfg, &r1);
    run_steps(t, 100);
    td_trainer_free(t);
    for (int world = 2; world <= 3; world++) {
        run_replicas(&cfg, world, &rw);
        assert_int_equal(tt_values_of(&r1, "train_loss", a, sa, 16), 8);
        assert_int_equal(tt_values_of(&rw, "train_loss", b, sb, 16), 8);
        for (int i = 0; i < 8; i++)
            if (fabs(a[i] - b[i]) > 1e-5 * fabs(a[i]))
                fail_msg("world %d, step %d: %.9g vs world 1 %.9g", world, i + 1, b[i], a[i]);
        assert_int_equal(tt_values_of(&r1, "valid_loss", a, sa, 16), 2);
        assert_int_equal(tt_values_of(&rw, "valid_loss", b, sb, 16), 2);
        for (int i = 0; i < 2; i++)
            assert_true(fabs(a[i] - b[i]) <= 1e-5 * fabs(a[i]));
        assert_int_equal(tt_values_of(&rw, "grad_norm", NULL, NULL, 16), 8);
    }
}

/* ---- on a device backend ----------------------------------------------------------------------
 */

/* Every metric but the timings of two runs, bit for bit. */
static void assert_same_metrics(const tt_recorder *a, const tt_recorder *b)
{
    int j = 0;

    for (int i = 0; i < a->n; i++) {
        if (strcmp(a->s[i].key, "step_ms") == 0 || strcmp(a->s[i].key, "tokens_per_s") == 0 ||
            strcmp(a->s[i].key, "samples_per_s") == 0)
            continue;
        while (j < b->n &&
               (strcmp(b->s[j].key, "step_ms") == 0 || strcmp(b->s[j].key, "tokens_per_s") == 0 ||
                strcmp(b->s[j].key, "samples_per_s") == 0))
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

/* The gpt trained on the fake device (tests/fake_device.h: memory the host cannot touch, the
 * CPU's arithmetic behind it) records the CPU run's metrics bit for bit, with gradient
 * clipping, evaluation and a checkpoint resumed on the device; the step loop allocates
 * nothing there, and each step moves only the batch in and the scalars out. A host read or
 * write of device memory anywhere in train/ would crash this test. */
static void test_gpt_on_device(void **state)
{
    static tt_recorder cpu, dev, resumed;
    td_train_config cfg;
    fd_counters before, after;
    double a[16], b[16];
    td_trainer *t;

    gpt_config(&cfg);
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
    /* per step: tokens, targets and the loss's seed up (none waits), and one download, the
     * loss with the norm: the step's only host sync */
    assert_int_equal(after.uploads - before.uploads, 3 * 3);
    assert_int_equal(after.downloads - before.downloads, 3 * 1);
    assert_int_equal(td_trainer_host_syncs(t), 1);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(fd_counts().allocs, fd_counts().frees);
    assert_same_metrics(&cpu, &dev);

    tt_path_of(cfg.checkpoint_dir, "gpt-device-ckpt");
    cfg.checkpoint_every = 5;
    t = new_trainer(&cfg, NULL);
    run_steps(t, 6);
    td_trainer_free(t);
    t = new_trainer(&cfg, &resumed);
    assert_int_equal(td_trainer_steps_done(t), 5);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&cpu, "train_loss", a, NULL, 16), 8);
    assert_int_equal(tt_values_of(&resumed, "train_loss", b, NULL, 16), 3);
    assert_memory_equal(a + 5, b, 3 * sizeof(double));
}

/* A device that runs out of memory while the trainer acquires its buffers (arena, parameters,
 * gradients, moments, scalars, AdamW's spans: each of the first seven allocations failing in
 * turn) makes
 * td_trainer_new fail with TD_ENOMEM and the device's message, and leaves nothing allocated
 * on it. */
static void test_gpt_device_out_of_memory(void **state)
{
    td_train_config cfg;

    gpt_config(&cfg);
    cfg.kernels = fd_kernels();
    for (int n = 0; n < 7; n++) {
        fd_fail_allocs_after(n);
        expect_new_fails(&cfg, TD_ENOMEM, "fake device: out of memory allocating", NULL);
        assert_int_equal(fd_counts().allocs, fd_counts().frees);
    }
    fd_fail_allocs_after(-1);
}

/* Data parallel on the fake device: the all-reduce gets device buffers, the loss goes up into
 * the gradient's slack and comes back; world 2 records world 2 on the CPU's metrics bit for
 * bit. */
static void test_gpt_data_parallel_on_device(void **state)
{
    static tt_recorder cpu, dev;
    td_train_config cfg;

    gpt_config(&cfg);
    cfg.max_steps = 6;
    cfg.eval_every = 3;
    run_replicas(&cfg, 2, &cpu);
    cfg.kernels = fd_kernels();
    run_replicas(&cfg, 2, &dev);
    assert_int_equal(tt_values_of(&dev, "train_loss", NULL, NULL, 16), 6);
    assert_same_metrics(&cpu, &dev);
}

/* ---- schedules, decay, clipping ------------------------------------------------------------ */

/* The schedules at their key steps, 100 steps, lr 1, min_lr 0.1. Tolerance 1e-6:
 * computed in double, rounded once to float. */
static void test_schedules(void **state)
{
    td_train_config cfg;

    td_train_config_defaults(&cfg);
    cfg.lr = 1.0f;
    cfg.min_lr = 0.1f;
    cfg.warmup = 0.1f;
    cfg.cooldown = 0.2f;
    cfg.schedule = TD_SCHED_CONSTANT;
    assert_float_equal(td_schedule_lr(&cfg, 1, 100), 1.0, 0);
    assert_float_equal(td_schedule_lr(&cfg, 100, 100), 1.0, 0);

    cfg.schedule = TD_SCHED_COSINE; /* W = 10 */
    assert_float_equal(td_schedule_lr(&cfg, 1, 100), 0.1, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 5, 100), 0.5, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 10, 100), 1.0, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 55, 100), 0.1 + 0.9 * 0.5, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 100, 100), 0.1, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 32, 100),
                       0.1 + 0.9 * 0.5 * (1 + cos(M_PI * 22.0 / 90.0)), 1e-6);
    cfg.warmup = 0.0f; /* no warmup: the cosine starts at once */
    assert_float_equal(td_schedule_lr(&cfg, 1, 100), 0.1 + 0.9 * 0.5 * (1 + cos(M_PI / 100)), 1e-6);

    cfg.schedule = TD_SCHED_RSQRT; /* W = 10, cooldown over the last D = 20 steps */
    cfg.warmup = 0.1f;
    assert_float_equal(td_schedule_lr(&cfg, 5, 100), 0.5, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 10, 100), 1.0, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 40, 100), 0.5, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 80, 100), sqrt(10.0 / 80.0), 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 90, 100), sqrt(10.0 / 80.0) * 0.5, 1e-6);
    assert_float_equal(td_schedule_lr(&cfg, 100, 100), 0.0, 0);
}

/* The trainer records lr from the schedule, step by step. */
static void test_schedule_through_trainer(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    double v[16];

    gpt_config(&cfg);
    cfg.schedule = TD_SCHED_COSINE;
    cfg.warmup = 0.3f;
    cfg.min_lr = 1e-3f;
    t = new_trainer(&cfg, &r);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "lr", v, NULL, 16), 10);
    for (int i = 0; i < 10; i++)
        assert_true(v[i] == (double)td_schedule_lr(&cfg, i + 1, 10));
    assert_float_equal(v[2], 1e-2, 1e-8);
    assert_float_equal(v[9], 1e-3, 1e-8);
}

/* AdamW decays wte, wpe and the four weight matrices (llm.c's "2-D" tensors) and nothing else:
 * with zero gradients and moments an AdamW step is exactly param * (1 - lr*wd) for those and
 * leaves the biases and LayerNorm parameters bit for bit. The MLP: weights yes, biases no. */
static void test_adamw_decays_matrices_only(void **state)
{
    td_gpt_dims d = {.maxT = 8, .V = 64, .Vp = 64, .L = 2, .NH = 2, .C = 16};
    td_gpt *m = calloc(1, sizeof(*m));
    td_params p = {0}, q = {0};
    td_train_config cfg;
    td_error_t err = {0};
    td_mlp mlp;
    float *before;

    td_train_config_defaults(&cfg);
    cfg.lr = 0.1f;
    cfg.weight_decay = 0.5f;
    assert_int_equal(td_gpt_declare(m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 2), 0);
    td_gpt_bind(m);
    td_gpt_init(m, 1);
    for (int i = 0; i < TD_GPT_TENSORS; i++) /* biases nonzero, so "unchanged" means something */
        for (size_t j = 0; j < m->p[i].n; j++)
            m->p[i].data[j] += 0.25f;
    before = malloc(p.n * sizeof(float));
    memcpy(before, p.data, p.n * sizeof(float));
    td_optim_step(td_kernels_cpu(), &p, &cfg, cfg.lr, 1);
    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        int decays = i == TD_GPT_WTE || i == TD_GPT_WPE || i == TD_GPT_QKVW ||
                     i == TD_GPT_ATTPROJW || i == TD_GPT_FCW || i == TD_GPT_FCPROJW;
        assert_int_equal(p.decay[i], decays);
        for (size_t j = 0; j < m->p[i].n; j++) {
            float b = before[p.offset[i] + j];
            assert_true(m->p[i].data[j] == (decays ? b * (1.0f - 0.1f * 0.5f) : b));
        }
    }
    td_params_free(&p);
    free(m);
    free(before);

    assert_int_equal(td_mlp_declare(&mlp, &q, (int[]){4, 3, 2}, 3), 0);
    assert_int_equal(td_params_alloc(&q, 2), 0);
    td_mlp_init(&mlp, 1);
    float w0 = mlp.w[0].data[0], b0 = mlp.b[0].data[0];
    td_optim_step(td_kernels_cpu(), &q, &cfg, cfg.lr, 1);
    assert_true(mlp.w[0].data[0] == w0 * 0.95f);
    assert_true(mlp.b[0].data[0] == b0);
    td_params_free(&q);
}

/* Clipping: plain SGD at lr 1 moves the parameters by exactly the clipped gradient, whose
 * norm is grad_clip * norm/(norm + 1e-6) (PyTorch's clip_grad_norm_); grad_norm records the
 * norm before clipping. Tolerance 1e-4 relative: the moved distance is recomputed from float
 * parameters of size ~0.02..1, differences of ~1e-3 each. */
static void test_grad_clip(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    td_params *p;
    float *before;
    double norm = 0, ss = 0;

    gpt_config(&cfg);
    cfg.optim = TD_OPTIM_SGD;
    cfg.momentum = 0.0f;
    cfg.lr = 1.0f;
    cfg.grad_clip = 0.05f;
    t = new_trainer(&cfg, &r);
    p = td_trainer_params(t);
    before = malloc(p->n * sizeof(float));
    memcpy(before, p->data, p->n * sizeof(float));
    run_steps(t, 1);
    assert_int_equal(tt_values_of(&r, "grad_norm", &norm, NULL, 1), 1);
    assert_true(norm > 0.05);
    for (size_t i = 0; i < p->n; i++)
        ss += ((double)p->data[i] - before[i]) * ((double)p->data[i] - before[i]);
    assert_float_equal(sqrt(ss), 0.05 * norm / (norm + 1e-6), 0.05 * 1e-4);
    free(before);
    td_trainer_free(t);
}

/* ---- failures ----------------------------------------------------------------------------------
 */

/* debug.fail nan at step 3: with on_nan fail, step 3 panics TD_ENAN with the message
 * before any update (steps_done stays 2); with on_nan skip, step 3 leaves every parameter as
 * it was, records nan_skipped 1 and no train_loss, and the job goes on. */
static void test_nan_policy(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    td_error_t e = {0};
    td_params *p;
    float *before;
    double v[4];
    int64_t s[4];

    gpt_config(&cfg);
    cfg.debug_fail_step = 3;
    cfg.debug_fail_kind = TD_FAIL_NAN;
    t = new_trainer(&cfg, &r);
    run_steps(t, 2);
    assert_int_equal(td_trainer_step_caught(t, &e), -1);
    assert_int_equal(e.code, TD_ENAN);
    assert_string_equal(e.msg, "loss is NaN at step 3");
    assert_int_equal(td_trainer_steps_done(t), 2);
    td_trainer_free(t);

    cfg.on_nan = TD_ON_NAN_SKIP;
    t = new_trainer(&cfg, &r);
    p = td_trainer_params(t);
    run_steps(t, 2);
    before = malloc(p->n * sizeof(float));
    memcpy(before, p->data, p->n * sizeof(float));
    run_steps(t, 1);
    assert_memory_equal(before, p->data, p->n * sizeof(float));
    run_steps(t, 100);
    td_trainer_free(t);
    free(before);
    assert_int_equal(tt_values_of(&r, "nan_skipped", v, s, 4), 1);
    assert_int_equal(s[0], 3);
    assert_true(v[0] == 1.0);
    assert_int_equal(tt_values_of(&r, "train_loss", NULL, NULL, 16), 9);
    assert_int_equal(tt_values_of(&r, "lr", NULL, NULL, 16), 10);
}

/* A NaN in the parameters is a NaN loss: the policy applies to real NaNs the same way. */
static void test_real_nan_panics(void **state)
{
    td_train_config cfg;
    td_trainer *t;
    td_error_t e = {0};

    gpt_config(&cfg);
    t = new_trainer(&cfg, NULL);
    td_trainer_params(t)->data[0] = NAN; /* wte[0][0]: every row of logits sees it */
    assert_int_equal(td_trainer_step_caught(t, &e), -1);
    assert_int_equal(e.code, TD_ENAN);
    assert_string_equal(e.msg, "loss is NaN at step 1");
    td_trainer_free(t);
}

/* debug.fail's other kinds: the exact codes and messages, at the exact step. */
static void test_injected_faults(void **state)
{
    struct {
        td_fail_kind kind;
        int code;
        const char *msg;
    } cases[] = {
        {TD_FAIL_PANIC, TD_EPANIC, "injected panic at step 2"},
        {TD_FAIL_OOM, TD_ENOMEM, "out of memory"},
        {TD_FAIL_DATA, TD_EDATA, "injected read error at step 2"},
    };

    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        td_train_config cfg;
        td_trainer *t;
        td_error_t e = {0};

        gpt_config(&cfg);
        cfg.debug_fail_step = 2;
        cfg.debug_fail_kind = cases[k].kind;
        t = new_trainer(&cfg, NULL);
        run_steps(t, 1);
        assert_int_equal(td_trainer_step_caught(t, &e), -1);
        assert_int_equal(e.code, cases[k].code);
        assert_string_equal(e.msg, cases[k].msg);
        assert_int_equal(td_trainer_steps_done(t), 1);
        td_trainer_free(t);
    }
}

/* Configurations the trainer refuses itself. */
static void test_gpt_config_errors(void **state)
{
    td_train_config cfg;

    gpt_config(&cfg);
    cfg.vocab_size = 128;
    expect_new_fails(&cfg, TD_ESHAPE, "model.vocab_size: 128", "256");
    gpt_config(&cfg);
    cfg.n_embd = 30;
    expect_new_fails(&cfg, TD_EINVAL, "model.n_embd", "n_head");
    gpt_config(&cfg);
    cfg.world = 2;
    expect_new_fails(&cfg, TD_EINVAL, "allreduce", NULL);
    gpt_config(&cfg);
    cfg.data = TD_DATA_IDX;
    expect_new_fails(&cfg, TD_EINVAL, "text or tokens", NULL);
    gpt_config(&cfg);
    tt_path_of(cfg.train_files[0], "nothing-here-*.txt");
    expect_new_fails(&cfg, TD_EDATA, "nothing-here-*.txt", NULL);
}

/* ---- evaluation only, sampling, token shards ------------------------------------------------ */

/* max_steps 0: one call evaluates, records valid_loss at step 0 and answers done. */
static void test_max_steps_zero(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    double v;
    int64_t s;

    gpt_config(&cfg);
    cfg.max_steps = 0;
    t = new_trainer(&cfg, &r);
    assert_int_equal(td_trainer_total_steps(t), 0);
    assert_int_equal(td_trainer_step(t), 1);
    assert_int_equal(td_trainer_step(t), 1);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "valid_loss", &v, &s, 1), 1);
    assert_int_equal(s, 0);
    assert_true(v > 5.0 && v < 6.0);
    assert_int_equal(r.n, 1);
}

/* Sampling from the latest checkpoint: ntokens bytes after the prompt, the same for the same
 * seed, greedy at temperature 0; a job without a checkpoint says so. */
static void test_sample(void **state)
{
    td_train_config cfg;
    td_trainer *t;
    td_error_t err = {0};
    char a[64], b[64], c[64];

    gpt_config(&cfg);
    cfg.max_steps = 30;
    tt_path_of(cfg.checkpoint_dir, "ckpt-sample");
    assert_int_equal(td_sample(&cfg, "the ", 10, 1.0f, 1, NULL, a, sizeof(a), &err), TD_ENOTFOUND);
    t = new_trainer(&cfg, NULL);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(td_sample(&cfg, "the ", 20, 0.8f, 7, NULL, a, sizeof(a), &err), 0);
    assert_int_equal(strlen(a), 20);
    assert_int_equal(td_sample(&cfg, "the ", 20, 0.8f, 7, NULL, b, sizeof(b), &err), 0);
    assert_string_equal(a, b);
    assert_int_equal(td_sample(&cfg, "", 20, 0.0f, 1, NULL, b, sizeof(b), &err), 0);
    assert_int_equal(td_sample(&cfg, "", 20, 0.0f, 2, NULL, c, sizeof(c), &err), 0);
    assert_string_equal(b, c);
    assert_int_equal(td_sample(&cfg, "x", 100, 1.0f, 1, NULL, c, 8, &err), 0); /* cut to fit */
    assert_int_equal(strlen(c), 7);
    /* a set stop flag (the daemon stopping) ends the sample before its next token */
    {
        atomic_int stop = 1;
        assert_int_equal(td_sample(&cfg, "the ", 20, 0.8f, 7, &stop, c, sizeof(c), &err),
                         TD_ECANCELLED);
        assert_string_equal(err.msg, "sampling: stopped after 0 of 20 tokens");
        assert_string_equal(c, "");
    }
    print_message("sample after 30 steps: \"the %s\"\n", a);
}

/* An llm.c token shard: header[256] (magic 20240520, version 1, count), uint16 tokens. */
static void write_shard(const char *path, int n, int vocab)
{
    int32_t h[256] = {0};
    FILE *f = fopen(path, "wb");

    h[0] = 20240520;
    h[1] = 1;
    h[2] = n;
    assert_non_null(f);
    assert_int_equal(fwrite(h, sizeof(h), 1, f), 1);
    for (int i = 0; i < n; i++) {
        uint16_t tok = (uint16_t)((i * 7 + i / 13) % vocab);
        assert_int_equal(fwrite(&tok, sizeof(tok), 1, f), 1);
    }
    assert_int_equal(fclose(f), 0);
}

/* A tokens job on llm.c shards (vocabulary 300, padded to 320) trains and evaluates; sampling
 * prints token ids. */
static void test_token_shards(void **state)
{
    static tt_recorder r;
    td_train_config cfg;
    td_trainer *t;
    td_error_t err = {0};
    double v[8];
    char out[256];

    gpt_config(&cfg);
    cfg.data = TD_DATA_TOKENS;
    cfg.vocab_size = 300;
    tt_path_of(cfg.train_files[0], "shard_train.bin");
    write_shard(cfg.train_files[0], 4000, 300);
    tt_path_of(cfg.valid_files[0], "shard_valid.bin");
    write_shard(cfg.valid_files[0], 600, 300);
    cfg.n_valid_files = 1;
    cfg.valid_fraction = 0.0f;
    tt_path_of(cfg.checkpoint_dir, "ckpt-tokens");
    t = new_trainer(&cfg, &r);
    assert_int_equal(td_trainer_params(t)->tensors[TD_GPT_WTE]->shape[0], 320);
    run_steps(t, 100);
    td_trainer_free(t);
    assert_int_equal(tt_values_of(&r, "train_loss", v, NULL, 8), 8);
    assert_int_equal(tt_values_of(&r, "valid_loss", NULL, NULL, 8), 1);
    assert_int_equal(td_sample(&cfg, "5, 12", 3, 1.0f, 1, NULL, out, sizeof(out), &err), 0);
    assert_non_null(strchr(out, ' '));
    assert_int_equal(td_sample(&cfg, "5 400", 3, 1.0f, 1, NULL, out, sizeof(out), &err), TD_EINVAL);
}

/* ---- fixture ------------------------------------------------------------------------------------
 */

static int setup(void **state)
{
    if (tt_tmpdir_make("/tmp/td_test_gpt_XXXXXX") != 0)
        return -1;
    tt_path_of(text_path, "text.txt");
    tt_write_text(text_path, 20000);
    return 0;
}

static int teardown(void **state)
{
    return tt_tmpdir_remove();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt_gradient_fd),
        cmocka_unit_test(test_gpt_fused_classifier),
        cmocka_unit_test(test_gpt_init),
        cmocka_unit_test(test_gpt_trains_and_metrics),
        cmocka_unit_test(test_gpt_determinism),
        cmocka_unit_test(test_gpt_threads),
        cmocka_unit_test(test_no_malloc_in_step),
        cmocka_unit_test(test_gpt_resume),
        cmocka_unit_test(test_gpt_checkpoint_now),
        cmocka_unit_test(test_llmc_round_trip),
        cmocka_unit_test(test_data_parallel),
        cmocka_unit_test(test_schedules),
        cmocka_unit_test(test_schedule_through_trainer),
        cmocka_unit_test(test_adamw_decays_matrices_only),
        cmocka_unit_test(test_grad_clip),
        cmocka_unit_test(test_nan_policy),
        cmocka_unit_test(test_real_nan_panics),
        cmocka_unit_test(test_injected_faults),
        cmocka_unit_test(test_gpt_config_errors),
        cmocka_unit_test(test_max_steps_zero),
        cmocka_unit_test(test_sample),
        cmocka_unit_test(test_token_shards),
        cmocka_unit_test(test_gpt_on_device),
        cmocka_unit_test(test_gpt_data_parallel_on_device),
        cmocka_unit_test(test_gpt_device_out_of_memory),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
