/* Unit tests of the memory guard (daemon/memguard.c): a job that fits, one that does not (the
 * refusal's numbers by part and the largest batch), batch_size "auto" taking the largest
 * multiple of world that fits, and the estimate's own errors passed through. The free memory
 * is made up, so nothing here depends on the machine; the figures are checked against
 * td_train_memory_estimate and td_train_largest_batch, whose own tests (test_memest.c) hold
 * them to what a trainer allocates.
 *
 * Tolerance: none. Every figure is an integer count of bytes computed the same way twice. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/memguard.h"

#define MIB (1ull << 20)

/* A small byte-level gpt (4 layers, 128 wide, T 256), AdamW, batch 16, on world devices. */
static void gpt_spec(td_jobspec *s, int batch, int world)
{
    memset(s, 0, sizeof(*s));
    td_train_config_defaults(&s->train);
    snprintf(s->name, sizeof(s->name), "guarded");
    s->devices = world;
    s->train.model = TD_MODEL_GPT;
    s->train.data = TD_DATA_TEXT;
    s->train.n_layer = 4;
    s->train.n_head = 4;
    s->train.n_embd = 128;
    s->train.seq_len = 256;
    s->train.vocab_size = 256;
    s->train.batch_size = batch;
    s->train.world = world;
}

static size_t estimate_at(const td_jobspec *s, int batch)
{
    td_train_config c = s->train;
    td_mem_estimate e;
    td_error_t err;

    c.batch_size = batch;
    assert_int_equal(td_train_memory_estimate(&c, &e, &err), 0);
    return e.total;
}

static void test_fits(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};
    size_t need;
    int largest = 0;

    (void)state;
    gpt_spec(&s, 16, 1);
    need = estimate_at(&s, 16);
    assert_int_equal(td_memguard_check(&s, need, 2 * need, "cpu:0", &g, &err), 0);
    assert_true(g.fits);
    assert_int_equal(g.est.total, need);
    assert_int_equal(g.est.batch, 16);
    assert_int_equal(g.free_bytes, need);
    assert_int_equal(g.total_bytes, 2 * need);
    assert_string_equal(g.device, "cpu:0");
    assert_int_equal(g.chose_batch, 0);
    assert_int_equal(s.train.batch_size, 16); /* a job with a batch keeps it */
    assert_int_equal(td_train_largest_batch(&s.train, need, &largest, &err), 0);
    assert_int_equal(g.largest_batch, largest);
    assert_true(g.largest_batch >= 16);
    assert_true(g.est.params > 0 && g.est.grads > 0 && g.est.optim == 2 * g.est.params);
    assert_true(g.est.attention > 0 && g.est.attention < g.est.activations);
}

static void test_does_not_fit(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};
    char want[512];
    size_t need, avail;

    (void)state;
    gpt_spec(&s, 64, 1);
    need = estimate_at(&s, 64);
    avail = estimate_at(&s, 12); /* batch 12 fits exactly, 13 cannot */
    assert_true(estimate_at(&s, 13) > avail);
    assert_int_equal(td_memguard_check(&s, avail, 8 * MIB * 1024, "cuda:1", &g, &err), TD_ENOMEM);
    assert_int_equal(err.code, TD_ENOMEM);
    assert_false(g.fits);
    assert_int_equal(g.est.total, need);
    assert_int_equal(g.largest_batch, 12);
    assert_int_equal(s.train.batch_size, 64);
    snprintf(want, sizeof(want),
             "does not fit on cuda:1: needs %llu MiB per device (parameters %llu, gradients %llu, "
             "optimizer %llu, activations %llu of which attention %llu, workspace %llu), %llu MiB "
             "free; batch_size 12 would fit",
             (unsigned long long)(need >> 20), (unsigned long long)(g.est.params >> 20),
             (unsigned long long)(g.est.grads >> 20), (unsigned long long)(g.est.optim >> 20),
             (unsigned long long)(g.est.activations >> 20),
             (unsigned long long)(g.est.attention >> 20),
             (unsigned long long)(g.est.workspace >> 20), (unsigned long long)(avail >> 20));
    assert_string_equal(err.msg, want);
}

static void test_nothing_fits(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};

    (void)state;
    gpt_spec(&s, 8, 2);
    assert_int_equal(td_memguard_check(&s, 1 * MIB, 1 * MIB, "cpu:0", &g, &err), TD_ENOMEM);
    assert_int_equal(g.largest_batch, 0);
    assert_non_null(strstr(err.msg, "does not fit on cpu:0: needs "));
    assert_non_null(strstr(err.msg, ", 1 MiB free; not even batch_size 2 (one row per device) "
                                    "would fit"));
}

/* auto takes the largest multiple of world that fits, writes it into the spec, and says so. */
static void test_auto_takes_largest_multiple_of_world(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};
    size_t avail;

    (void)state;
    gpt_spec(&s, 0, 2);
    s.batch_auto = 1;
    avail = estimate_at(&s, 21); /* 21 rows fit (11 per replica); auto takes 20 */
    assert_true(estimate_at(&s, 23) > avail);
    assert_int_equal(td_memguard_check(&s, avail, avail, "cuda:0", &g, &err), 0);
    assert_true(g.fits);
    assert_true(g.largest_batch == 21 || g.largest_batch == 22);
    assert_int_equal(g.chose_batch, g.largest_batch / 2 * 2);
    assert_int_equal(s.train.batch_size, g.chose_batch);
    assert_int_equal(s.batch_auto, 0);
    assert_int_equal(g.est.batch, g.chose_batch / 2);
    assert_int_equal(g.est.total, estimate_at(&s, g.chose_batch));

    /* Nothing fits: refused, the spec left as it was. */
    gpt_spec(&s, 0, 2);
    s.batch_auto = 1;
    assert_int_equal(td_memguard_check(&s, MIB, MIB, "cuda:0", &g, &err), TD_ENOMEM);
    assert_int_equal(s.batch_auto, 1);
    assert_int_equal(s.train.batch_size, 0);
    assert_int_equal(g.chose_batch, 0);
    assert_non_null(strstr(err.msg, "(batch_size \"auto\")"));
}

static void test_auto_batch_rounding(void **state)
{
    (void)state;
    assert_int_equal(td_memguard_auto_batch(21, 2), 20);
    assert_int_equal(td_memguard_auto_batch(21, 1), 21);
    assert_int_equal(td_memguard_auto_batch(3, 4), 0);
    assert_int_equal(td_memguard_auto_batch(8, 4), 8);
    assert_int_equal(td_memguard_auto_batch(5, 0), 0);
    assert_int_equal(td_memguard_auto_batch(1 << 20, 1), TD_MEMGUARD_AUTO_MAX_ROWS);
    assert_int_equal(td_memguard_auto_batch(1 << 20, 3), 3 * TD_MEMGUARD_AUTO_MAX_ROWS);
    assert_int_equal(td_memguard_auto_batch(3 * 1025 + 1, 3), 3 * TD_MEMGUARD_AUTO_MAX_ROWS);
}

/* A tiny mlp fits any batch a job file accepts: the largest is cut to TD_JOB_MAX_BATCH, so it
 * can be asked for, and auto takes TD_MEMGUARD_AUTO_MAX_ROWS, not a million rows. */
static void test_largest_is_what_a_job_accepts(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};

    (void)state;
    memset(&s, 0, sizeof(s));
    td_train_config_defaults(&s.train);
    s.train.model = TD_MODEL_MLP;
    s.train.layers[0] = 2;
    s.train.layers[1] = 2;
    s.train.n_layers = 2;
    s.train.world = 1;
    s.batch_auto = 1;
    assert_int_equal(td_memguard_check(&s, (size_t)1 << 60, (size_t)1 << 60, "cpu:0", &g, &err), 0);
    assert_int_equal(g.largest_batch, TD_JOB_MAX_BATCH);
    assert_int_equal(s.train.batch_size, TD_MEMGUARD_AUTO_MAX_ROWS);
}

/* The estimate's errors come through with its code and message. */
static void test_estimate_errors_pass_through(void **state)
{
    td_jobspec s;
    td_memguard g;
    td_error_t err = {0};

    (void)state;
    gpt_spec(&s, 16, 1);
    s.train.n_head = 3; /* 128 is not a multiple of 3 */
    assert_int_not_equal(td_memguard_check(&s, (size_t)1 << 40, (size_t)1 << 40, "cpu:0", &g, &err),
                         0);
    assert_true(err.code == TD_EINVAL || err.code == TD_ESHAPE);
    assert_false(g.fits);

    /* a batch smaller than the devices cannot be split */
    gpt_spec(&s, 1, 2);
    assert_int_equal(td_memguard_check(&s, (size_t)1 << 40, (size_t)1 << 40, "cpu:0", &g, &err),
                     TD_EINVAL);
    assert_string_equal(err.msg, "batch_size 1 cannot be split across 2 devices");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fits),
        cmocka_unit_test(test_does_not_fit),
        cmocka_unit_test(test_nothing_fits),
        cmocka_unit_test(test_auto_takes_largest_multiple_of_world),
        cmocka_unit_test(test_auto_batch_rounding),
        cmocka_unit_test(test_largest_is_what_a_job_accepts),
        cmocka_unit_test(test_estimate_errors_pass_through),
    };

    return cmocka_run_group_tests_name("memguard", tests, NULL, NULL);
}
