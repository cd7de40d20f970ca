/* tests/test_attn_plan.c - the fused attention's plan (kernels/attn_plan.h), which both tables
 * walk: every (sequence, head, query row) in exactly one block, no block past the scratch's,
 * the way with fewer blocks taken, causal blocks aligned, and the counts issue 24 asks of the
 * shapes that matter: GPT-2 124M at B 16, T 1024 in at most 100 attention calls a layer a
 * step, SensorLM base at batch 32 reading each sequence's keys and values once. Then the CPU
 * table against the plan: its scores stay inside the plan's largest block. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/attn_plan.h"
#include "kernels/kernels.h"
#include "train/engine.h"

/* Walks d's plan and checks it covers each (b, row) once, inside the block, in order. Returns
 * the blocks. */
static int check_plan(const td_attn_dims *d)
{
    size_t room = (size_t)d->B * d->NH * d->chunk * d->Nk;
    unsigned char *seen = calloc((size_t)d->B * d->Nq, 1);
    td_attn_block k = {0};
    int n = 0, way = -1;

    while (td_attn_next(d, &k)) {
        assert_int_equal(k.index, n);
        assert_true(k.nb >= 1 && k.b0 >= 0 && k.b0 + k.nb <= d->B);
        assert_true(k.rows >= 1 && k.r0 >= 0 && k.r0 + k.rows <= d->Nq);
        assert_int_equal(k.cols, d->causal ? k.r0 + k.rows : d->Nk);
        if ((size_t)k.nb * d->NH * k.rows * k.cols > room)
            fail_msg("B %d NH %d Nq %d Nk %d chunk %d%s: block %d (%d seqs x %d rows x %d cols) "
                     "past the scratch's %zu floats",
                     d->B, d->NH, d->Nq, d->Nk, d->chunk, d->causal ? " causal" : "", n, k.nb,
                     k.rows, k.cols, room);
        if (way < 0)
            way = k.by_seq;
        assert_int_equal(k.by_seq, way);
        if (k.by_seq)
            assert_true(k.r0 == 0 && k.rows == d->Nq);
        else
            assert_true(k.b0 == 0 && k.nb == d->B);
        for (int b = k.b0; b < k.b0 + k.nb; b++)
            for (int r = k.r0; r < k.r0 + k.rows; r++) {
                assert_int_equal(seen[(size_t)b * d->Nq + r], 0);
                seen[(size_t)b * d->Nq + r] = 1;
            }
        n++;
    }
    for (size_t i = 0; i < (size_t)d->B * d->Nq; i++)
        assert_int_equal(seen[i], 1);
    free(seen);
    return n;
}

static td_attn_dims dims(int B, int NH, int Nq, int Nk, int causal, int chunk)
{
    td_attn_dims d = {.B = B, .NH = NH, .Nq = Nq, .Nk = Nk, .hs = 8, .causal = causal};

    d.ldq = d.ldk = d.ldv = NH * 8;
    d.chunk = td_attn_chunk(chunk, B, NH, Nq, Nk);
    return d;
}

/* 3000 random shapes, causal or not, at every kind of chunk: covered once, inside the block,
 * and the way with fewer blocks (rows: ceil(Nq / chunk) when not causal; whole sequences:
 * ceil(B / per)). */
static void test_cover(void **state)
{
    td_rng rng;

    td_rng_seed(&rng, 24, 1);
    for (int i = 0; i < 3000; i++) {
        int B = 1 + (int)td_rng_below(&rng, 6), NH = 1 + (int)td_rng_below(&rng, 4);
        int causal = (int)td_rng_below(&rng, 2), Nq = 1 + (int)td_rng_below(&rng, 300);
        int Nk = causal ? Nq : 1 + (int)td_rng_below(&rng, 300);
        int chunk = 1 + (int)td_rng_below(&rng, (uint64_t)Nq);
        td_attn_dims d = dims(B, NH, Nq, Nk, causal, chunk);
        td_attn_calls c;
        int n = check_plan(&d);
        int per = chunk * B / Nq; /* whole sequences a block holds */

        td_attn_plan(&d, &c);
        assert_int_equal(c.blocks, n);
        assert_int_equal(c.gemms_fwd, 2 * n);
        assert_int_equal(c.gemms_bwd, 5 * n);
        if (per > 0) /* never more blocks than whole sequences would take */
            assert_true(n <= (B + (per < B ? per : B) - 1) / (per < B ? per : B));
        /* never more than chunks of rows (a causal block takes at least chunk rows) */
        assert_true(n <= (Nq + d.chunk - 1) / d.chunk);
        assert_true(c.kv_reads == (c.by_seq ? 1 : n));
    }
}

/* With a chunk that is a multiple of 64, every causal block starts at a multiple of 64 (the
 * CPU's sgemms of 64 rows are the replaced attention's), and one chunk's worth of keys is all
 * a causal block's rows * cols ever takes. */
static void test_causal_aligned(void **state)
{
    const int Ts[] = {130, 256, 1000, 1024, 2048};

    for (size_t i = 0; i < sizeof(Ts) / sizeof(Ts[0]); i++)
        for (int chunk = 64; chunk < Ts[i]; chunk += 64) {
            td_attn_dims d = dims(3, 4, Ts[i], Ts[i], 1, chunk);
            td_attn_block k = {0};
            check_plan(&d);
            while (td_attn_next(&d, &k))
                if (!k.by_seq && k.r0 % 64 != 0)
                    fail_msg("T %d chunk %d: block %d starts at row %d", Ts[i], chunk, k.index,
                             k.r0);
        }
}

/* GPT-2 124M (12 heads of 64, T 1024) at B 16, the automatic chunk (85 rows of all 16 in
 * 64 MiB): rows of every sequence, the causal blocks 256, 192, 128, then 122 down to 90 rows
 * and the 30 left, 8 blocks, so 16 calls forward and 40 backward a layer, at most 100 (the
 * loop over heads in chunks of 85 issued 1,092). */
static void test_gpt2(void **state)
{
    td_attn_dims d = dims(16, 12, 1024, 1024, 1, 0);
    td_attn_calls c;

    td_attn_plan(&d, &c);
    print_message("GPT-2 124M B 16 T 1024: chunk %d, %d blocks (%s), %d + %d gemms, %d + %d other "
                  "launches a layer, keys read %d times, fewest rows %d, largest block %zu "
                  "floats\n",
                  d.chunk, c.blocks, c.by_seq ? "whole sequences" : "rows", c.gemms_fwd,
                  c.gemms_bwd, c.kernels_fwd, c.kernels_bwd, c.kv_reads, c.min_rows,
                  c.block_floats);
    assert_int_equal(d.chunk, 85);
    assert_int_equal(check_plan(&d), c.blocks);
    assert_true(c.gemms_fwd + c.gemms_bwd <= 100);
    assert_int_equal(c.blocks, 8);
    /* D, then two a block, then the stored dk and dv zeroed (causal, rows of every sequence) */
    assert_int_equal(td_attn_by_seq(&d), 0);
    assert_int_equal(c.kernels_bwd, 1 + 2 * c.blocks + 2);
}

/* SensorLM base's sensor tower (12 heads, N = 2448, not causal) at batch 32: the automatic
 * chunk grows to one whole sequence (77 rows of all 32), and the plan is 32 blocks of one
 * sequence each: keys and values read once a sequence, 224 calls a layer (row chunks of 17 in
 * a loop over heads issued 12,096). */
static void test_sensorlm_base(void **state)
{
    td_attn_dims d = dims(32, 12, 2448, 2448, 0, 0);
    td_attn_calls c;

    td_attn_plan(&d, &c);
    print_message("SensorLM base B 32 N 2448: chunk %d, %d blocks (%s), %d + %d gemms a layer, "
                  "keys read %d times, largest block %zu floats\n",
                  d.chunk, c.blocks, c.by_seq ? "whole sequences" : "rows", c.gemms_fwd,
                  c.gemms_bwd, c.kv_reads, c.block_floats);
    assert_int_equal(d.chunk, 77);
    assert_int_equal(check_plan(&d), c.blocks);
    assert_int_equal(c.by_seq, 1);
    assert_int_equal(c.kv_reads, 1);
    assert_int_equal(c.blocks, 32);
    assert_int_equal(c.gemms_fwd + c.gemms_bwd, 224);
    assert_int_equal(td_attn_by_seq(&d), 1);
    assert_int_equal(c.kernels_bwd, 1 + 2 * c.blocks); /* every block sees every key */
    /* its MAP head: one probe query against the 2448 tokens, one block */
    d = dims(32, 12, 1, 2448, 0, 0);
    td_attn_plan(&d, &c);
    assert_int_equal(c.blocks, 1);
}

/* The CPU table computes in the plan's blocks: with the scratch filled with a sentinel, the
 * scores it writes lie inside the plan's largest block, the last float touched in that block's
 * last pair, and the pointer arrays (the CUDA table's) are left alone. Shapes: rows of every
 * sequence (causal, chunk 64 of 200) and whole sequences (not causal, 2 of 5 a block). */
static void test_cpu_follows_plan(void **state)
{
    const td_kernels *K = td_kernels_cpu();
    td_attn_dims ds[2];
    td_rng rng;

    ds[0] = dims(2, 3, 200, 200, 1, 64);
    ds[1] = dims(5, 2, 40, 30, 0, 16);
    td_rng_seed(&rng, 5, 5);
    for (int w = 0; w < 2; w++) {
        const td_attn_dims *d = &ds[w];
        int C = d->NH * d->hs;
        size_t nq = (size_t)d->B * d->Nq * C, nk = (size_t)d->B * d->Nk * C;
        size_t ns = td_attn_scratch(d, 0), last = 0;
        float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
        float *out = malloc(nq * 4), *lse = malloc((size_t)d->B * d->NH * d->Nq * 4);
        float *scratch = malloc(ns * 4);
        td_attn_calls c;
        td_attn_block blk = {0};
        size_t pairs = 0; /* the largest block's (sequence, head) pairs */

        td_attn_plan(d, &c);
        assert_int_equal(c.by_seq, w);
        while (td_attn_next(d, &blk))
            if ((size_t)blk.nb * d->NH * blk.rows * blk.cols == c.block_floats && pairs == 0)
                pairs = (size_t)blk.nb * d->NH;
        for (size_t i = 0; i < nq; i++)
            q[i] = td_rng_uniform(&rng) - 0.5f;
        for (size_t i = 0; i < nk; i++) {
            k[i] = td_rng_uniform(&rng) - 0.5f;
            v[i] = td_rng_uniform(&rng) - 0.5f;
        }
        for (size_t i = 0; i < ns; i++)
            scratch[i] = -1234.5f;
        K->attention_forward(out, lse, scratch, q, k, v, d);
        for (size_t i = 0; i < ns; i++)
            if (scratch[i] != -1234.5f)
                last = i;
        print_message("%s: %d blocks, the last float of scores written at %zu of the largest "
                      "block's %zu (the scratch's block %zu)\n",
                      w ? "whole sequences" : "rows", c.blocks, last, c.block_floats,
                      (size_t)d->B * d->NH * d->chunk * d->Nk);
        assert_true(c.blocks > 1);
        assert_true(last < c.block_floats);
        assert_true(last >= c.block_floats - c.block_floats / pairs);
        for (size_t i = td_attn_scratch_ptrs(d, 0); i < ns; i++)
            assert_true(scratch[i] == -1234.5f);
        free(q);
        free(k);
        free(v);
        free(out);
        free(lse);
        free(scratch);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cover),
        cmocka_unit_test(test_causal_aligned),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_sensorlm_base),
        cmocka_unit_test(test_cpu_follows_plan),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
