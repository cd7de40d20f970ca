/* Unit tests of the memory estimate (train/memest.c) on the CPU: for an mlp and a gpt, alone
 * and as one replica of two, the estimate's buffers and arena against what a real CPU trainer
 * allocates (td_params.n, the arena's capacity, and its peak after training steps and an
 * evaluation), the attention scores' share, the largest batch that fits a given number of
 * bytes, and GPT-2 124M's figures, which are printed for the record.
 *
 * Tolerance: none. The estimate sizes the model and the arena with the trainer's own functions,
 * so on the CPU every figure is equal to the byte, with one stated exception: without reading
 * the data the estimate takes an mlp's evaluation batch at its largest (1000 samples), so for
 * a test split smaller than that it is an upper bound, checked as such.
 *
 * Also the dataset's share (td_train_data_bytes: what the headers declare, read without
 * loading) and td_train_check_files, a job's files against its model before it starts, each
 * refusal naming the field, the file and what is wrong. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmocka.h>

#include "train/engine.h"
#include "train/llmc.h"
#include "common/td_panic.h"
#include "train/train.h"
#include "tests/train_support.h"

#define SIDE    8
#define PIXELS  (SIDE * SIDE)
#define CLASSES 4

static char text_path[TD_PATH_MAX];

/* ---- data the trainers read ----------------------------------------------------------------- */

/* n random SIDE x SIDE images with labels in [0, CLASSES), as name-images / name-labels. */
static void write_split(td_idx_split *split, const char *name, int n)
{
    uint8_t *img = malloc((size_t)n * PIXELS), *lab = malloc((size_t)n);
    uint32_t idims[3] = {(uint32_t)n, SIDE, SIDE}, ldims[1] = {(uint32_t)n};
    char fname[64];
    td_rng rng;

    assert_non_null(img);
    assert_non_null(lab);
    td_rng_seed(&rng, 5, 9);
    for (int i = 0; i < n; i++) {
        lab[i] = (uint8_t)td_rng_below(&rng, CLASSES);
        for (int p = 0; p < PIXELS; p++)
            img[(size_t)i * PIXELS + p] = (uint8_t)td_rng_below(&rng, 256);
    }
    snprintf(fname, sizeof(fname), "%s-images", name);
    tt_path_of(split->images, fname);
    tt_write_idx(split->images, 0, TD_IDX_MAGIC_IMAGES, idims, 3, img, (size_t)n * PIXELS);
    snprintf(fname, sizeof(fname), "%s-labels", name);
    tt_path_of(split->labels, fname);
    tt_write_idx(split->labels, 0, TD_IDX_MAGIC_LABELS, ldims, 1, lab, (size_t)n);
    free(img);
    free(lab);
}

/* 64-32-4, batch 128, SGD with momentum (one moment buffer), a test split of n_test. */
static void mlp_config(td_train_config *cfg, int n_test)
{
    char name[32];

    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_MLP;
    cfg->data = TD_DATA_IDX;
    cfg->layers[0] = PIXELS;
    cfg->layers[1] = 32;
    cfg->layers[2] = CLASSES;
    cfg->n_layers = 3;
    cfg->optim = TD_OPTIM_SGD;
    cfg->lr = 1e-2f;
    cfg->max_steps = 3;
    cfg->eval_every = 2;
    cfg->threads = 1;
    write_split(&cfg->train, "train", 1200);
    snprintf(name, sizeof(name), "test%d", n_test);
    write_split(&cfg->test, name, n_test);
}

/* test_gpt.c's job: L=2, C=32, NH=4, T=16, batch 4, AdamW, 10% held out. */
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
    cfg->max_steps = 3;
    cfg->eval_every = 2;
    cfg->eval_batches = 2;
    cfg->threads = 1;
}

/* ---- a real trainer to compare with ------------------------------------------------------- */

/* Data-parallel replicas need an all-reduce; averaging with nobody is the identity. */
static void allreduce_alone(void *ud, float *buf, size_t n)
{
}

static td_trainer *new_trainer(const td_train_config *cfg)
{
    td_train_hooks hooks = {.allreduce = allreduce_alone};
    td_trainer *t = NULL;
    td_error_t err = {0};

    if (td_trainer_new(&t, cfg, cfg->world > 1 ? &hooks : NULL, &err) != 0)
        fail_msg("td_trainer_new: %s: %s", td_errname(err.code), err.msg);
    return t;
}

static void run_all(td_trainer *t)
{
    td_error_t err = {0};
    int done = 0;

    while (done == 0)
        done = td_trainer_step_caught(t, &err);
    if (done < 0)
        fail_msg("step failed: %s: %s", td_errname(err.code), err.msg);
}

static void estimate(const td_train_config *cfg, td_mem_estimate *e)
{
    td_error_t err = {0};

    if (td_train_memory_estimate(cfg, e, &err) != 0)
        fail_msg("estimate: %s: %s", td_errname(err.code), err.msg);
    assert_int_equal(e->total, e->params + e->grads + e->optim + e->activations + e->workspace);
    if (cfg->kernels == NULL || cfg->kernels->host)
        assert_int_equal(e->workspace, 0);
}

/* The CUDA context's workspace counts only on a device backend: a table whose memory is not
 * host memory adds the cuBLAS workspace, the scratch and the fixed buffers (96 MiB and a bit),
 * the CPU's adds nothing; the rest of the estimate is the same. */
static void test_workspace_on_device_only(void **state)
{
    static const td_kernels device = {.name = "device", .host = 0};
    td_train_config cfg;
    td_mem_estimate cpu, dev;

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_MLP;
    cfg.data = TD_DATA_IDX;
    cfg.layers[0] = 784, cfg.layers[1] = 256, cfg.layers[2] = 10;
    cfg.n_layers = 3;
    estimate(&cfg, &cpu);
    cfg.kernels = td_kernels_cpu();
    estimate(&cfg, &dev);
    assert_memory_equal(&cpu, &dev, sizeof(cpu));
    cfg.kernels = &device;
    estimate(&cfg, &dev);
    assert_int_equal(dev.workspace, (size_t)(96u << 20) + 1024 * 8 + 65536 * 4);
    assert_int_equal(dev.total, cpu.total + dev.workspace);
}

/* The flat buffers: td_params_alloc rounds each to the arena's alignment, the gradient with its
 * TD_PARAMS_ALIGN floats of slack. Exact. */
static void assert_buffers(const td_mem_estimate *e, const td_params *p, int moments)
{
    assert_int_equal(e->n_floats, p->n);
    assert_int_equal(e->params, td_arena_round(p->n * sizeof(float)));
    assert_int_equal(e->grads, td_arena_round((p->n + TD_PARAMS_ALIGN) * sizeof(float)));
    assert_int_equal(e->optim, (size_t)moments * e->params);
    assert_int_equal((p->m != NULL) + (p->v != NULL), moments);
}

/* ---- the tests ------------------------------------------------------------------------------ */

/* With a test split of 1000 the trainer's evaluation batch is the estimate's: the arena's
 * capacity equals the estimate, and so does its peak once an evaluation has run. */
static void test_mlp_exact(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    td_trainer *t;

    mlp_config(&cfg, 1000);
    estimate(&cfg, &e);
    t = new_trainer(&cfg);
    assert_buffers(&e, td_trainer_params(t), 1);
    assert_int_equal(e.activations, td_trainer_arena(t)->cap);
    assert_int_equal(e.attention, 0);
    assert_int_equal(e.batch, 128);
    run_all(t);
    assert_int_equal(td_trainer_arena(t)->peak, e.activations);
    td_trainer_free(t);
}

/* A test split of 200: the trainer evaluates 200 at a time, the estimate assumes 1000, so it is
 * an upper bound, and still equal in every other figure. Without any evaluation data, the
 * training step alone sizes both. */
static void test_mlp_upper_bound(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    td_trainer *t;

    mlp_config(&cfg, 200);
    estimate(&cfg, &e);
    t = new_trainer(&cfg);
    assert_buffers(&e, td_trainer_params(t), 1);
    assert_true(e.activations >= td_trainer_arena(t)->cap);
    run_all(t);
    assert_true(td_trainer_arena(t)->peak <= e.activations);
    td_trainer_free(t);

    cfg.test.images[0] = cfg.test.labels[0] = '\0';
    cfg.optim = TD_OPTIM_ADAMW;
    estimate(&cfg, &e);
    t = new_trainer(&cfg);
    assert_buffers(&e, td_trainer_params(t), 2);
    assert_int_equal(e.activations, td_trainer_arena(t)->cap);
    assert_int_equal(e.activations, td_trainer_step_bytes(t));
    run_all(t);
    assert_int_equal(td_trainer_arena(t)->peak, e.activations);
    td_trainer_free(t);
}

/* What a gpt's fused attention holds in a training step: each of the L layers' log-sum-exps
 * (B*NH*T floats) and the backward's transient block, two (B,NH,chunk,T) blocks, a float
 * per row and head, and the CUDA table's 9 arrays of B*NH pointers (2 floats each). */
static size_t gpt_attention(int L, int B, int NH, int T, int chunk)
{
    size_t lse = td_arena_round((size_t)B * NH * T * sizeof(float));
    size_t block = (size_t)B * NH * td_attn_chunk(chunk, B, NH, T, T) * T;

    return (size_t)L * lse +
           td_arena_round((2 * block + (size_t)B * NH * T + (size_t)18 * B * NH) * sizeof(float));
}

/* A gpt: the training step (with the attention backward's scratch on top) is the larger part,
 * and a step's peak reaches it exactly. The attention: gpt_attention's, with the automatic
 * chunk all of T = 16. */
static void test_gpt_exact(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    td_trainer *t;

    gpt_config(&cfg);
    estimate(&cfg, &e);
    t = new_trainer(&cfg);
    assert_buffers(&e, td_trainer_params(t), 2);
    assert_int_equal(e.activations, td_trainer_arena(t)->cap);
    assert_int_equal(e.activations, td_trainer_step_bytes(t));
    assert_int_equal(td_attn_chunk(0, 4, 4, 16, 16), 16);
    assert_int_equal(e.attention, gpt_attention(2, 4, 4, 16, 16));
    assert_true(e.attention < e.activations);
    run_all(t);
    assert_int_equal(td_trainer_arena(t)->peak, e.activations);
    td_trainer_free(t);
}

/* model.attn_chunk 5, which does not divide T = 16: the trainer's arena and a step's peak are
 * still exactly the estimate, and the smaller block makes both smaller than the automatic
 * chunk's by the difference of the backward's blocks, 2 (B,NH,16-5,T) blocks. */
static void test_gpt_chunk(void **state)
{
    td_train_config cfg;
    td_mem_estimate e, e0;
    td_trainer *t;

    gpt_config(&cfg);
    estimate(&cfg, &e0);
    cfg.attn_chunk = 5;
    estimate(&cfg, &e);
    assert_int_equal(e.attention, gpt_attention(2, 4, 4, 16, 5));
    assert_int_equal(
        e0.attention - e.attention,
        td_arena_round((2 * (size_t)4 * 4 * 16 * 16 + 4 * 4 * 16 + 18 * 4 * 4) * sizeof(float)) -
            td_arena_round((2 * (size_t)4 * 4 * 5 * 16 + 4 * 4 * 16 + 18 * 4 * 4) * sizeof(float)));
    assert_true(e.activations < e0.activations);
    t = new_trainer(&cfg);
    assert_int_equal(e.activations, td_trainer_arena(t)->cap);
    assert_int_equal(e.activations, td_trainer_step_bytes(t));
    run_all(t);
    assert_int_equal(td_trainer_arena(t)->peak, e.activations);
    td_trainer_free(t);
}

/* One replica of two: each sizes for ceil(5/2) = 3 rows, the most any replica computes. Rank 1
 * computes rows [2,5), reaching the estimate; rank 0 computes rows [0,2), so only its
 * evaluation (5 rows, no gradients) comes near it, never past. Rank 1 does not evaluate. */
static void test_gpt_replica(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    td_trainer *t;

    gpt_config(&cfg);
    cfg.batch_size = 5;
    cfg.world = 2;
    for (int rank = 0; rank < 2; rank++) {
        cfg.rank = rank;
        estimate(&cfg, &e);
        assert_int_equal(e.batch, 3);
        t = new_trainer(&cfg);
        assert_buffers(&e, td_trainer_params(t), 2);
        assert_int_equal(e.activations, td_trainer_arena(t)->cap);
        run_all(t);
        if (rank == 1)
            assert_int_equal(td_trainer_arena(t)->peak, e.activations);
        else
            assert_true(td_trainer_arena(t)->peak <= e.activations);
        td_trainer_free(t);
    }
}

/* The largest batch for a budget is the one whose estimate fits while the next one's does not;
 * exactly the estimate's total of batch 9 fits 9, a byte less fits 8. */
static void test_largest_batch(void **state)
{
    td_train_config cfg;
    td_mem_estimate e9, e1;
    td_error_t err = {0};
    int b = -1;

    gpt_config(&cfg);
    cfg.batch_size = 9;
    estimate(&cfg, &e9);
    assert_int_equal(td_train_largest_batch(&cfg, e9.total, &b, &err), 0);
    assert_int_equal(b, 9);
    assert_int_equal(td_train_largest_batch(&cfg, e9.total - 1, &b, &err), 0);
    assert_int_equal(b, 8);

    cfg.batch_size = 1;
    estimate(&cfg, &e1);
    assert_int_equal(td_train_largest_batch(&cfg, e1.total - 1, &b, &err), TD_ENOMEM);
    assert_int_equal(b, 0);
    assert_non_null(strstr(err.msg, "a batch of 1 needs"));

    /* the search stops at its cap when everything fits */
    assert_int_equal(td_train_largest_batch(&cfg, SIZE_MAX, &b, &err), 0);
    assert_true(b >= 1 && b <= TD_MEM_MAX_BATCH);
    /* two replicas: never below world rows */
    cfg.world = 2;
    assert_int_equal(td_train_largest_batch(&cfg, e9.total, &b, &err), 0);
    assert_true(b >= 9);
}

/* Bad configurations are refused with the trainer's codes. */
static void test_estimate_errors(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    td_error_t err = {0};

    gpt_config(&cfg);
    cfg.n_embd = 30; /* not a multiple of 4 heads */
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "n_embd"));
    assert_int_equal(e.total, 0);
    gpt_config(&cfg);
    cfg.batch_size = 0;
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), TD_EINVAL);
    gpt_config(&cfg);
    cfg.seq_len = 1 << 20;
    cfg.n_head = 4096;
    cfg.n_embd = 4096;
    cfg.batch_size = 1 << 20;
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), TD_E2BIG);
    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_MLP;
    cfg.n_layers = 1;
    assert_int_equal(td_train_memory_estimate(&cfg, &e, &err), TD_EINVAL);
}

/* GPT-2 124M (L=12, C=768, NH=12, T=1024, V=50257 padded to 50304) at batch 8 with AdamW:
 * llm.c's 124,475,904 parameters (padded vocabulary) plus the 16-float alignment of each
 * tensor, and the attention: 12 layers' log-sum-exps (8 x 12 x 1024 floats each) and the
 * backward's block at the automatic chunk, 170 rows (170 x 8 x 12 x 1024 floats fit in 64 MiB),
 * where the attention it replaced kept 12 x 8 x 12 x 1024 x 1024 floats of scores. Printed for
 * the record. */
static void test_gpt2_124m_figures(void **state)
{
    td_train_config cfg;
    td_mem_estimate e;
    const size_t MiB = 1 << 20;

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_GPT;
    cfg.data = TD_DATA_TOKENS;
    cfg.n_layer = 12;
    cfg.n_head = 12;
    cfg.n_embd = 768;
    cfg.seq_len = 1024;
    cfg.vocab_size = 50257;
    cfg.batch_size = 8;
    estimate(&cfg, &e);
    assert_true(e.n_floats >= 124475904 && e.n_floats <= 124475904 + 16 * TD_PARAMS_ALIGN);
    assert_int_equal(td_attn_chunk(0, 8, 12, 1024, 1024), 170);
    assert_int_equal(e.attention, gpt_attention(12, 8, 12, 1024, 170));
    assert_true(e.attention * 20 < (size_t)12 * 8 * 12 * 1024 * 1024 * sizeof(float));
    print_message("GPT-2 124M, B=8, T=1024, AdamW: params %zu MiB, grads %zu MiB, moments %zu "
                  "MiB, activations %zu MiB (attention %zu MiB), workspace %zu MiB, "
                  "total %zu MiB\n",
                  e.params / MiB, e.grads / MiB, e.optim / MiB, e.activations / MiB,
                  e.attention / MiB, e.workspace / MiB, e.total / MiB);
}

/* ---- the dataset's share and the files against the model ------------------------------------ */

static size_t file_size(const char *path)
{
    struct stat st;

    assert_int_equal(stat(path, &st), 0);
    return (size_t)st.st_size;
}

/* The dataset's bytes: an mlp's pixels and labels as the headers declare them plus its sample
 * order; text as 2-byte tokens plus the shuffle's row order (an upper bound of what the loader
 * holds: the rows of the whole file, valid_fraction's included). Not part of total. A gzip
 * file whose header claims 64 MiB of pixels in a few bytes is counted as it claims. */
static void test_data_bytes(void **state)
{
    uint32_t bomb[3] = {1u << 20, SIDE, SIDE}, bomb_labels[1] = {1u << 20};
    td_train_config cfg;
    td_mem_estimate e;
    td_error_t err = {0};
    size_t bytes = 0, n;

    mlp_config(&cfg, 200);
    estimate(&cfg, &e);
    assert_int_equal(e.data, (1200 * 64 + 1200) + (200 * 64 + 200) + 4 * 1200);
    assert_int_equal(td_train_data_bytes(&cfg, &bytes, &err), 0);
    assert_int_equal(bytes, e.data);

    gpt_config(&cfg);
    n = file_size(text_path);
    estimate(&cfg, &e);
    assert_int_equal(e.data, 2 * n + 4 * ((n - 1) / 16));
    cfg.shuffle = 0;
    estimate(&cfg, &e);
    assert_int_equal(e.data, 2 * n);

    mlp_config(&cfg, 200);
    tt_path_of(cfg.train.images, "bomb-images.gz");
    tt_write_idx(cfg.train.images, 1, TD_IDX_MAGIC_IMAGES, bomb, 3, (const uint8_t *)"x", 1);
    tt_path_of(cfg.train.labels, "bomb-labels.gz");
    tt_write_idx(cfg.train.labels, 1, TD_IDX_MAGIC_LABELS, bomb_labels, 1, (const uint8_t *)"x", 1);
    estimate(&cfg, &e);
    assert_int_equal(e.data, (64u << 20) + (1u << 20) + (200 * 64 + 200) + (4u << 20));
}

/* An llm.c model file's header (magic, version, maxT, V, L, NH, C, Vp) and n bytes of zeros. */
static void write_llmc(const char *path, int version, size_t n)
{
    int32_t h[256] = {TD_LLMC_MAGIC, version, 16, 256, 2, 4, 32, 256};
    FILE *f = fopen(path, "wb");
    char *zeros = calloc(1, n + 1);

    assert_non_null(f);
    assert_non_null(zeros);
    assert_int_equal(fwrite(h, sizeof(h), 1, f), 1);
    assert_int_equal(fwrite(zeros, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
    free(zeros);
}

static void expect_files_refused(const td_train_config *cfg, int code, const char *msg)
{
    td_error_t err = {0};
    int rc = td_train_check_files(cfg, &err);

    if (rc != code || strcmp(err.msg, msg) != 0)
        fail_msg("expected %s \"%s\", got %s \"%s\"", td_errname(code), msg, td_errname(rc),
                 err.msg);
}

/* What would fail at start fails here, before: a last layer short of the labels, a first
 * layer that is not the image size, a labels file given as the images, labels that do not
 * match the images in count, an llm.c file of another version or cut short, job dimensions
 * that disagree with init_from, a token shard with a bad magic, a glob of no regular file,
 * text with a vocabulary under 256, and a dataset past TD_DATA_MAX_BYTES. */
static void test_check_files(void **state)
{
    uint32_t big[3] = {1u << 24, 32, 32}, big_labels[1] = {1u << 24};
    td_train_config cfg;
    td_gpt_dims d = {.maxT = 16, .V = 256, .Vp = 256, .L = 2, .NH = 4, .C = 32};
    td_error_t err = {0};
    char msg[3 * TD_PATH_MAX], path[TD_PATH_MAX];
    uint8_t *zeros;
    int32_t bad[256] = {12345, 1, 0};
    FILE *f;

    mlp_config(&cfg, 200);
    assert_int_equal(td_train_check_files(&cfg, &err), 0);
    cfg.layers[2] = CLASSES - 1;
    snprintf(msg, sizeof(msg), "model.layers[2]: 3 outputs, but %s has labels up to 3 (4 classes)",
             cfg.train.labels);
    expect_files_refused(&cfg, TD_ESHAPE, msg);
    mlp_config(&cfg, 200);
    cfg.layers[0] = 100;
    snprintf(msg, sizeof(msg),
             "model.layers[0]: 100 inputs, but the images of %s are 8x8 = 64 pixels",
             cfg.train.images);
    expect_files_refused(&cfg, TD_ESHAPE, msg);
    mlp_config(&cfg, 200);
    snprintf(cfg.train.images, TD_PATH_MAX, "%s", cfg.train.labels);
    snprintf(msg, sizeof(msg),
             "data.train.images: %s: magic 0x00000801 is an IDX labels file, expected images "
             "(0x00000803)",
             cfg.train.labels);
    expect_files_refused(&cfg, TD_EDATA, msg);
    mlp_config(&cfg, 200);
    snprintf(path, sizeof(path), "%s", cfg.test.labels);
    snprintf(cfg.test.labels, TD_PATH_MAX, "%s", cfg.train.labels);
    snprintf(msg, sizeof(msg), "data.test.labels: %s has 1200 labels, but %s has 200 images",
             cfg.train.labels, cfg.test.images);
    expect_files_refused(&cfg, TD_EDATA, msg);

    gpt_config(&cfg);
    assert_int_equal(td_train_check_files(&cfg, &err), 0);
    tt_path_of(cfg.init_from, "bf16.bin");
    write_llmc(cfg.init_from, 5, 0);
    snprintf(msg, sizeof(msg),
             "model.init_from: %s: unsupported version 5 (bf16): traind reads version 3 (fp32) "
             "and the older fp32 version 2",
             cfg.init_from);
    expect_files_refused(&cfg, TD_EDATA, msg);
    tt_path_of(cfg.init_from, "cut.bin");
    write_llmc(cfg.init_from, 3, 4000);
    snprintf(msg, sizeof(msg),
             "model.init_from: %s: wrong size: 5024 bytes, but a model of maxT 16, V 256, L 2, NH "
             "4, C 32, Vp 256 takes %zu",
             cfg.init_from, 1024 + td_gpt_num_params(&d) * sizeof(float));
    expect_files_refused(&cfg, TD_EDATA, msg);
    tt_path_of(cfg.init_from, "good.bin");
    write_llmc(cfg.init_from, 3, td_gpt_num_params(&d) * sizeof(float));
    assert_int_equal(td_train_check_files(&cfg, &err), 0);
    cfg.n_layer = 3;
    snprintf(msg, sizeof(msg), "model.n_layer: 3 in the job but 2 in %s", cfg.init_from);
    expect_files_refused(&cfg, TD_ESHAPE, msg);

    gpt_config(&cfg);
    cfg.vocab_size = 100;
    expect_files_refused(&cfg, TD_ESHAPE,
                         "model.vocab_size: 100, but text data is bytes: a vocabulary of 256");
    gpt_config(&cfg);
    cfg.data = TD_DATA_TOKENS;
    tt_path_of(cfg.train_files[0], "bad-shard.bin");
    f = fopen(cfg.train_files[0], "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bad, sizeof(bad), 1, f), 1);
    assert_int_equal(fclose(f), 0);
    snprintf(msg, sizeof(msg),
             "data.train[0]: %s: bad magic 12345, expected 20240520 (llm.c token shard)",
             cfg.train_files[0]);
    expect_files_refused(&cfg, TD_EDATA, msg);
    tt_path_of(path, "a-dir.d");
    assert_int_equal(mkdir(path, 0755), 0);
    tt_path_of(cfg.train_files[0], "a-dir.*");
    snprintf(msg, sizeof(msg), "data.train[0]: no regular file matches %s", cfg.train_files[0]);
    expect_files_refused(&cfg, TD_EDATA, msg);

    /* 16 GiB of pixels (the most one file may declare) and their labels: past the job's
     * limit, refused before anything is read but the headers and the labels. */
    mlp_config(&cfg, 200);
    cfg.layers[0] = 1024;
    cfg.test.images[0] = cfg.test.labels[0] = '\0';
    tt_path_of(cfg.train.images, "big-images.gz");
    tt_write_idx(cfg.train.images, 1, TD_IDX_MAGIC_IMAGES, big, 3, (const uint8_t *)"x", 1);
    tt_path_of(cfg.train.labels, "big-labels.gz");
    zeros = calloc(1, 1u << 24);
    assert_non_null(zeros);
    tt_write_idx(cfg.train.labels, 1, TD_IDX_MAGIC_LABELS, big_labels, 1, zeros, 1u << 24);
    free(zeros);
    expect_files_refused(&cfg, TD_E2BIG,
                         "data: the dataset takes 16464 MiB in memory on each device, more than "
                         "the limit of 16384 MiB");
}

static int setup(void **state)
{
    if (tt_tmpdir_make("/tmp/td_test_memest_XXXXXX") != 0)
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
        cmocka_unit_test(test_workspace_on_device_only),
        cmocka_unit_test(test_mlp_exact),
        cmocka_unit_test(test_mlp_upper_bound),
        cmocka_unit_test(test_gpt_exact),
        cmocka_unit_test(test_gpt_chunk),
        cmocka_unit_test(test_gpt_replica),
        cmocka_unit_test(test_largest_batch),
        cmocka_unit_test(test_estimate_errors),
        cmocka_unit_test(test_gpt2_124m_figures),
        cmocka_unit_test(test_data_bytes),
        cmocka_unit_test(test_check_files),
    };

    return cmocka_run_group_tests(tests, setup, teardown);
}
