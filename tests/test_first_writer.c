/* Unit tests of td_backward's first writers (train/engine.c, issue 24): no activation gradient
 * is zeroed, the op that writes one first stores into it (kernels.h's store mask), a residual
 * passes its gradient through. Held to the reference path (td_ctx.zero_grads: every gradient
 * zeroed at allocation, every backward adding) bit for bit, parameter gradients and loss, for a
 * GPT (fused classifier and not), a SensorLM (MAP and mean pools, one replica and the
 * all-gather of two), an MLP and an op whose output no one reads; the arena is filled with NaN
 * before each run, so a first writer that read what it stores would show. Also counted: the
 * table's zero calls in a GPT step (none now), and the arena's peak (the same both ways). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "train/engine.h"
#include "train/slm.h"
#include "common/td_panic.h"
#include "tests/train_support.h"

/* ---- a CPU table that counts its zero calls ------------------------------------------------- */

static td_kernels counting;
static long zero_calls;
static size_t zero_floats;

static void counting_zero(float *p, size_t n)
{
    zero_calls++;
    zero_floats += n;
    td_kernels_cpu()->zero(p, n);
}

static const td_kernels *table(void)
{
    counting = *td_kernels_cpu();
    counting.zero = counting_zero;
    return &counting;
}

/* ---- one step of a model both ways ---------------------------------------------------------- */

typedef struct run {
    float loss;
    float *grad; /* the parameters' gradients, p->n floats */
    size_t peak;
    long zeros; /* zero calls from the forward's start to the backward's end */
} run;

typedef td_tensor *(*forward_fn)(td_ctx *c, void *model);

/* A forward and backward of model through fwd in a fresh arena of cap bytes, filled with NaN
 * first, zero_grads as asked. */
static run step(void *model, td_params *p, forward_fn fwd, size_t cap, int tape_len, int zero_grads,
                void (*allreduce)(void *, float *, size_t), int world)
{
    td_arena arena;
    td_tape tape;
    td_ctx c = {.k = table(),
                .arena = &arena,
                .tape = &tape,
                .allreduce = allreduce,
                .world = world,
                .zero_grads = zero_grads};
    td_boundary b;
    run r = {0};

    assert_int_equal(td_arena_init(&arena, cap), 0);
    assert_int_equal(td_tape_init(&tape, tape_len), 0);
    memset(arena.base, 0xff, arena.cap); /* NaN in every float */
    memset(p->grad, 0, p->n * sizeof(float));
    zero_calls = 0;
    td_boundary_enter(&b);
    if (TD_TRY(&b)) {
        td_tensor *loss = fwd(&c, model);
        r.loss = loss->data[0];
        td_backward(&c, loss);
        td_boundary_leave(&b);
    } else {
        fail_msg("panic: %s", b.err.msg);
    }
    r.zeros = zero_calls;
    r.peak = arena.peak;
    r.grad = malloc(p->n * sizeof(float));
    assert_non_null(r.grad);
    memcpy(r.grad, p->grad, p->n * sizeof(float));
    td_tape_free(&tape);
    td_arena_free(&arena);
    return r;
}

/* Both ways, compared bit for bit; returns the first-writer run's zero calls. */
static long both_ways(const char *what, void *model, td_params *p, forward_fn fwd, size_t cap,
                      int tape_len, void (*allreduce)(void *, float *, size_t), int world)
{
    run ref = step(model, p, fwd, cap, tape_len, 1, allreduce, world);
    run now = step(model, p, fwd, cap, tape_len, 0, allreduce, world);
    size_t nonzero = 0;

    if (memcmp(&ref.loss, &now.loss, sizeof(float)) != 0)
        fail_msg("%s: loss %.9g, the reference path's %.9g", what, now.loss, ref.loss);
    for (size_t i = 0; i < p->n; i++) {
        if (memcmp(&ref.grad[i], &now.grad[i], sizeof(float)) != 0)
            fail_msg("%s: gradient %zu is %.9g, the reference path's %.9g", what, i, now.grad[i],
                     ref.grad[i]);
        nonzero += ref.grad[i] != 0.0f;
    }
    assert_true(isfinite(ref.loss));
    if (nonzero < p->n / 4) /* a gradient that flowed (a token table is mostly zero) */
        fail_msg("%s: only %zu of %zu gradients non-zero", what, nonzero, p->n);
    assert_int_equal(now.peak, ref.peak);
    print_message("  %s: loss and %zu gradients bit for bit; zero calls %ld, reference %ld\n", what,
                  p->n, now.zeros, ref.zeros);
    free(ref.grad);
    free(now.grad);
    return now.zeros;
}

/* ---- a GPT ---------------------------------------------------------------------------------- */

typedef struct gpt_case {
    td_gpt m;
    int tok[2 * 40], tgt[2 * 40];
    int B, T, want_logits;
} gpt_case;

static td_tensor *gpt_forward(td_ctx *c, void *model)
{
    gpt_case *g = model;
    td_tensor *logits = NULL;

    return td_gpt_forward(c, &g->m, g->tok, g->tgt, g->B, g->T, g->want_logits ? &logits : NULL);
}

/* L 2, C 32, 4 heads, T 40, B 2, V 50: the attention of rows of every sequence at chunk 16
 * (its stored dk and dv zeroed first) and in whole sequences at the automatic chunk; the fused
 * classifier, and the unfused one when the logits are asked back. */
static void test_gpt(void **state)
{
    td_gpt_dims d = {.maxT = 40, .V = 50, .Vp = 64, .L = 2, .NH = 4, .C = 32};
    gpt_case *g = calloc(1, sizeof(*g));
    td_params p = {0};
    td_error_t err = {0};
    td_rng rng;
    long zeros;

    assert_non_null(g);
    assert_int_equal(td_gpt_declare(&g->m, &p, &d, &err), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_gpt_bind(&g->m);
    td_gpt_init(&g->m, 5);
    g->B = 2, g->T = 40;
    td_rng_seed(&rng, 9, 0);
    for (int i = 0; i < g->B * g->T; i++) {
        g->tok[i] = (int)td_rng_below(&rng, d.V);
        g->tgt[i] = (int)td_rng_below(&rng, d.V);
    }
    for (int chunk = 0; chunk <= 16; chunk += 16)
        for (int logits = 0; logits < 2; logits++) {
            char what[64];
            size_t cap;
            g->m.attn_chunk = chunk;
            g->want_logits = logits;
            cap = td_gpt_arena_bytes(&g->m, g->B, g->T, 1) +
                  (logits ? td_op_bytes_softmax_xent((size_t)g->B * g->T, d.Vp, 1) +
                                td_arena_round((size_t)g->B * g->T * d.Vp * sizeof(float))
                          : 0);
            snprintf(what, sizeof(what), "gpt, chunk %d, %s classifier", chunk,
                     logits ? "unfused" : "fused");
            zeros = both_ways(what, g, &p, gpt_forward, cap, td_gpt_tape_len(&g->m), NULL, 0);
            if (!logits) /* every activation gradient has a storing first writer */
                assert_int_equal(zeros, 0);
        }
    td_params_free(&p);
    free(g);
}

/* ---- a SensorLM ----------------------------------------------------------------------------- */

typedef struct slm_case {
    td_sensorlm m;
    float x[3 * 8 * 6];
    int tok[3 * 6], end[3];
    int B, rows;
} slm_case;

static td_tensor *slm_forward(td_ctx *c, void *model)
{
    slm_case *s = model;
    td_tensor *x = td_tensor_new(c, 3, (int[]){s->B, s->m.d.N, s->m.d.P}, 0);
    td_tensor *se, *u;

    memcpy(x->data, s->x, x->n * sizeof(float));
    se = td_sensorlm_sensor(c, &s->m, x);
    u = td_sensorlm_text(c, &s->m, s->tok, s->end, s->B);
    return td_sensorlm_loss(c, &s->m, se, u, s->rows, 0);
}

/* Replica 1's rows as zeros: this replica's rows are all the sum has. */
static void lone_replica(void *ud, float *buf, size_t n)
{
    (void)ud;
    for (size_t i = 0; i < n; i++)
        buf[i] *= 0.5f;
}

/* tt_slm_tiny_dims at B 3, both pools: the MAP head's cross-attention stores three separate
 * gradients, the probe is a parameter's view, the loss's dots take the text embedding as their
 * weight (added, zeroed first). */
static void test_sensorlm(void **state)
{
    for (int pool = 0; pool < 2; pool++)
        for (int world = 1; world <= 2; world++) {
            slm_case *s = calloc(1, sizeof(*s));
            td_params p = {0};
            td_error_t err = {0};
            td_slm_dims d = tt_slm_tiny_dims(pool ? TD_SLM_POOL_MAP : TD_SLM_POOL_GAP);
            td_rng rng;
            char what[64];
            assert_non_null(s);
            assert_int_equal(td_sensorlm_declare(&s->m, &p, &d, &err), 0);
            assert_int_equal(td_params_alloc(&p, 0), 0);
            td_sensorlm_init(&s->m, 3);
            td_rng_seed(&rng, 17, (uint64_t)pool);
            for (int i = 0; i < s->m.n; i++) /* biases and the probe away from 0 as well */
                for (size_t j = 0; j < s->m.p[i].n; j++)
                    s->m.p[i].data[j] += 0.2f * (2 * td_rng_uniform(&rng) - 1);
            s->B = 3;
            s->rows = 3 * world;
            for (size_t j = 0; j < sizeof(s->x) / sizeof(s->x[0]); j++)
                s->x[j] = 2 * td_rng_uniform(&rng) - 1;
            for (int i = 0; i < s->B; i++) {
                s->end[i] = 2 + i;
                td__slm_tokenize("abcdefgh", (size_t)s->end[i], d.L, s->tok + i * d.L, &s->end[i]);
            }
            snprintf(what, sizeof(what), "sensorlm, %s pool, world %d", pool ? "map" : "mean (gap)",
                     world);
            both_ways(what, s, &p, slm_forward,
                      td_sensorlm_arena_bytes(&s->m, s->B, s->rows, world, 1) + (1 << 16),
                      td_sensorlm_tape_len(&s->m), world > 1 ? lone_replica : NULL, world);
            td_params_free(&p);
            free(s);
        }
}

/* ---- an MLP, and an op whose output nobody reads -------------------------------------------- */

typedef struct mlp_case {
    td_mlp m;
    float x[6 * 5];
    int y[6];
    int dangling; /* a GELU of a hidden layer nothing reads, recorded on the tape */
} mlp_case;

static td_tensor *mlp_forward(td_ctx *c, void *model)
{
    mlp_case *q = model;
    td_tensor *x = td_tensor_new(c, 2, (int[]){6, 5}, 0), *h, *loss;

    memcpy(x->data, q->x, sizeof(q->x));
    if (!q->dangling)
        return td_mlp_forward(c, &q->m, x, q->y, NULL);
    h = td_linear(c, x, &q->m.w[0], &q->m.b[0]);
    td_gelu(c, h); /* its gradient is never written: its backward is skipped, h's not read */
    h = td_relu(c, h);
    h = td_linear(c, h, &q->m.w[1], &q->m.b[1]);
    h = td_relu(c, h);
    h = td_linear(c, h, &q->m.w[2], &q->m.b[2]);
    loss = td_softmax_xent(c, h, q->y);
    return loss;
}

/* Sizes 5, 7, 4, 3 over 6 rows: ReLU and the unfused classifier, which add into gradients
 * zeroed by their first writer. */
static void test_mlp(void **state)
{
    mlp_case *q = calloc(1, sizeof(*q));
    td_params p = {0};
    td_rng rng;

    assert_non_null(q);
    assert_int_equal(td_mlp_declare(&q->m, &p, (int[]){5, 7, 4, 3}, 4), 0);
    assert_int_equal(td_params_alloc(&p, 0), 0);
    td_mlp_init(&q->m, 2);
    td_rng_seed(&rng, 3, 0);
    for (int i = 0; i < 6 * 5; i++)
        q->x[i] = 2 * td_rng_uniform(&rng) - 1;
    for (int i = 0; i < 6; i++)
        q->y[i] = (int)td_rng_below(&rng, 3);
    for (q->dangling = 0; q->dangling < 2; q->dangling++)
        both_ways(q->dangling ? "mlp with a dangling GELU" : "mlp", q, &p, mlp_forward, 1 << 20,
                  td_mlp_tape_len(&q->m) + 1, NULL, 0);
    td_params_free(&p);
    free(q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt),
        cmocka_unit_test(test_sensorlm),
        cmocka_unit_test(test_mlp),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
