/* bench_sensorlm: trains the sensorlm presets through train.h on a representative input and
 * prints figures, never pass/fail (issue 13, "Speed and tests"). Single-threaded main; the
 * trainer's own team does the work.
 *
 *   bench_sensorlm [STEPS] [--size tiny|small|base|all] [--batch B] [--threads T]
 *                  [--time-steps T] [--channels C] [--repeat R]
 *
 * The input. A day of minutes from a wrist wearable, as `trainctl sensor synth` writes it and
 * issue 13's seed learner takes it: T = 1440 time steps of C = 10 channels, cut into 10 x 2
 * patches, so N = 144 x 5 = 720 tokens of P = 20 floats; captions of 30 to 120 bytes through
 * text_len 64 (L = 64). The readings are drawn here (a random walk around a mean per channel,
 * 3% of them NaN as the synth's lost minutes) into a temporary shard of 4 batches of windows;
 * their values change nothing in the time a step takes.
 *
 * For each preset (default: tiny at batch 32, then small at batch 8): WARMUP_STEPS untimed
 * steps, then STEPS timed ones (default 10 tiny, 4 small): ms/step (mean and best), samples/s,
 * the GFLOP/s the step achieves by td_sensorlm_flops' count (llm.c's convention: 6 per weight
 * per row, 12 per attention score, 6 when causal), and, in the same run, before the training
 * and after it, what cblas_sgemm alone does on the step's linear-layer shapes (the faster of
 * the two, so the ratio can only look worse). With --repeat R each preset is trained R times
 * in turn (tiny small tiny small ...), each run on a fresh trainer, and the mean and spread of
 * the runs' samples/s are printed after them.
 *
 * Each run prints one line "sensorlm SIZE: ... N samples/s" that bench/all.sh reads. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "train/engine.h"
#include "kernels/kernels.h"
#include "train/sensor.h"
#include "common/td_clock.h"
#include "train/train.h"

#define WARMUP_STEPS 2  /* steps left out of the timing: first-touch page faults, BLAS start */
#define SGEMM_REPS   5  /* calls per shape when timing sgemm alone */
#define NAN_PERMILLE 30 /* readings drawn as NaN, per 1000: the synth's lost minutes */
#define MAX_REPEAT   64
#define CAPTION_LEN  128 /* bytes of a caption slot in the shard */

typedef struct preset {
    const char *name;
    td_slm_size size;
    int batch;     /* the default global batch */
    int64_t steps; /* the default timed steps */
} preset;

static const preset presets[3] = {
    {"tiny", TD_SLM_TINY, 32, 10},
    {"small", TD_SLM_SMALL, 8, 4},
    {"base", TD_SLM_BASE, 2, 2},
};

typedef struct opts {
    int64_t steps; /* 0: the preset's */
    int batch;     /* 0: the preset's */
    int threads, T, C, repeat;
    int sizes[3]; /* which presets run */
} opts;

/* ---- the input ---------------------------------------------------------------------------- */

static uint64_t next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double unif(uint64_t *s)
{
    return (double)(next(s) >> 11) * 0x1p-53;
}

/* Writes a shard of n windows of T x C at path: each channel a random walk around its own mean
 * (60 + 10c), NAN_PERMILLE of the readings NaN, a caption of 30 to 120 bytes, two labels. */
static int write_shard(const char *path, int n, int T, int C)
{
    static const char words[] = "a calm day with a morning run and an evening walk after work ";
    const char *names[2] = {"rest", "run"}, *prompts[2] = {"a rest day", "a day with a run"};
    td_sensor_header h = {.T = T, .C = C, .N = n, .caption_len = CAPTION_LEN, .n_labels = 2};
    td_sensor_writer *w = NULL;
    td_error_t err = {0};
    float *grid = malloc((size_t)T * C * sizeof(float));
    char caption[CAPTION_LEN];
    uint64_t s = 1;
    int rc = grid == NULL ? TD_ENOMEM : 0;

    h.period_s = 60;
    h.split = TD_SENSOR_SPLIT_TRAIN;
    for (int c = 0; c < C; c++)
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), "channel%d", c);
    if (rc == 0)
        rc = td_sensor_writer_open(&w, path, &h, names, prompts, &err);
    for (int i = 0; rc == 0 && i < n; i++) {
        size_t len = 30 + next(&s) % 91;
        for (int c = 0; c < C; c++) {
            double v = 60.0 + 10.0 * c;
            for (int t = 0; t < T; t++) {
                v += unif(&s) - 0.5;
                grid[(size_t)t * C + c] =
                    next(&s) % 1000 < NAN_PERMILLE ? NAN : (float)(v + unif(&s));
            }
        }
        for (size_t j = 0; j < len; j++)
            caption[j] = words[(i + j) % (sizeof(words) - 1)];
        rc = td_sensor_writer_add(w, grid, caption, len, i % 2, &err);
    }
    if (rc == 0)
        rc = td_sensor_writer_finish(w, NULL, NULL, &err);
    if (rc != 0)
        fprintf(stderr, "bench_sensorlm: writing %s: %s\n", path, err.msg);
    td_sensor_writer_free(w);
    free(grid);
    return rc;
}

/* ---- sgemm alone --------------------------------------------------------------------------- */

/* A linear layer of the step: rows x in -> rows x out, count times a step. */
typedef struct layer {
    int rows, out, in, count;
} layer;

/* The step's linear layers: the patch projection, each tower's block layers (qkv, out, fc1,
 * fc2) and the MAP head's k and v over the tokens, as kernels/cpu.c calls sgemm (forward, dinp,
 * dweight), on OpenBLAS's own threads. GFLOP/s over all of them, weighted by how often a step
 * makes each call. */
static double bench_sgemm(const td_slm_dims *d, int B, int threads)
{
    int BN = B * d->N, BL = B * d->L, Ds = d->s.D, Dt = d->t.D;
    layer ls[] = {
        {BN, Ds, d->P, 1},
        {BN, 3 * Ds, Ds, d->s.depth},
        {BN, Ds, Ds, d->s.depth},
        {BN, d->s.M, Ds, d->s.depth},
        {BN, Ds, d->s.M, d->s.depth},
        {BN, Ds, Ds, d->pool == TD_SLM_POOL_MAP ? 2 : 0},
        {BL, 3 * Dt, Dt, d->t.depth},
        {BL, Dt, Dt, d->t.depth},
        {BL, d->t.M, Dt, d->t.depth},
        {BL, Dt, d->t.M, d->t.depth},
    };
    size_t big = 0;
    double total_ms = 0, total_flops = 0;
    float *A, *Bm, *Cm;

    for (size_t l = 0; l < sizeof(ls) / sizeof(ls[0]); l++) {
        size_t m = (size_t)ls[l].rows * (ls[l].out > ls[l].in ? ls[l].out : ls[l].in);
        big = m > big ? m : big;
    }
    A = malloc(big * sizeof(float)), Bm = malloc(big * sizeof(float));
    Cm = malloc(big * sizeof(float));
    if (A == NULL || Bm == NULL || Cm == NULL) {
        free(A), free(Bm), free(Cm);
        return 0;
    }
    openblas_set_num_threads(threads);
    for (size_t i = 0; i < big; i++) {
        A[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        Bm[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        Cm[i] = 0.0f;
    }
    for (size_t l = 0; l < sizeof(ls) / sizeof(ls[0]); l++) {
        int R = ls[l].rows, O = ls[l].out, K = ls[l].in;
        double f = 2.0 * R * O * K;
        if (ls[l].count == 0)
            continue;
        total_ms +=
            ls[l].count *
            (bench_time_sgemm(CblasNoTrans, CblasTrans, R, O, K, A, Bm, Cm, 1, SGEMM_REPS) +
             bench_time_sgemm(CblasNoTrans, CblasNoTrans, R, K, O, A, Bm, Cm, 1, SGEMM_REPS) +
             bench_time_sgemm(CblasTrans, CblasNoTrans, O, K, R, A, Bm, Cm, 1, SGEMM_REPS));
        total_flops += 3.0 * f * ls[l].count;
    }
    free(A), free(Bm), free(Cm);
    openblas_set_num_threads(1); /* the trainer's team keeps OpenBLAS single-threaded */
    return total_flops / (total_ms * 1e6);
}

/* ---- one run -------------------------------------------------------------------------------- */

static void slm_config(td_train_config *cfg, const preset *p, const opts *o, const char *shard,
                       int B, int64_t steps)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_SENSORLM;
    cfg->data = TD_DATA_SENSOR;
    cfg->slm.size = p->size;
    cfg->slm.time_steps = o->T;
    cfg->slm.channels = o->C;
    cfg->slm.patch_t = 10;
    cfg->slm.patch_c = 2;
    cfg->slm.text_len = 64;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", shard);
    cfg->n_train_files = 1;
    cfg->batch_size = B;
    cfg->lr = 1e-3f;
    cfg->weight_decay = 0.1f;
    cfg->max_steps = WARMUP_STEPS + steps;
    cfg->threads = o->threads;
}

/* Trains p once; its samples/s into *sps. */
static int run_preset(const preset *p, const opts *o, const char *shard, double *sps)
{
    int B = o->batch > 0 ? o->batch : p->batch;
    int64_t steps = o->steps > 0 ? o->steps : p->steps;
    td_train_config cfg;
    td_trainer *t = NULL;
    bench_steps s = {.warmup = WARMUP_STEPS};
    td_train_hooks hooks = {.ud = &s, .metric = bench_steps_metric};
    td_error_t err = {0};
    td_slm_dims d;
    double t0, c0, wall, busy, flops, ms, sg_before, sg_after, sg;

    slm_config(&cfg, p, o, shard, B, steps);
    if (td_slm_dims_of(&cfg.slm, o->T, o->C, &d, &err) != 0) {
        fprintf(stderr, "bench_sensorlm: %s: %s\n", p->name, err.msg);
        return 1;
    }
    flops = td_sensorlm_flops(&d, B);
    t0 = td_mono_ms();
    if (td_trainer_new(&t, &cfg, &hooks, &err) != 0) {
        fprintf(stderr, "bench_sensorlm: %s: %s\n", p->name, err.msg);
        return 1;
    }
    printf("\nsensorlm %s: sensor D=%d depth %d H=%d M=%d over N=%d tokens of P=%d "
           "(T=%d C=%d, patch 10x2), text D=%d depth %d L=%d, E=%d, pool map; batch %d, adamw, "
           "threads %d; %.2fM parameters\n",
           p->name, d.s.D, d.s.depth, d.s.H, d.s.M, d.N, d.P, d.T, d.C, d.t.D, d.t.depth, d.L, d.E,
           B, o->threads, (double)td_sensorlm_num_params(&d) / 1e6);
    printf("  trainer build %.0f ms; %.2f GFLOP a step (td_sensorlm_flops); arena %.0f MB\n",
           td_mono_ms() - t0, flops / 1e9, (double)td_trainer_arena(t)->cap / 1e6);
    sg_before = bench_sgemm(&d, B, o->threads);
    t0 = td_mono_ms();
    c0 = bench_cpu_ms();
    while (td_trainer_step(t) == 0)
        ;
    wall = td_mono_ms() - t0;
    busy = (bench_cpu_ms() - c0) / wall;
    td_trainer_free(t);
    sg_after = bench_sgemm(&d, B, o->threads);
    sg = sg_before > sg_after ? sg_before : sg_after;
    if (s.steps == 0) {
        fprintf(stderr, "bench_sensorlm: %s: no timed step\n", p->name);
        return 1;
    }
    ms = s.ms / s.steps;
    *sps = B / (ms / 1e3);
    printf("  steps %d..%lld timed, loss %.4f -> %.4f; %.2f of %ld cores busy\n", WARMUP_STEPS + 1,
           (long long)cfg.max_steps, s.loss0, s.loss, busy, sysconf(_SC_NPROCESSORS_ONLN));
    printf("sensorlm %s: %.1f ms/step (best %.1f), %.2f samples/s, %.1f GFLOP/s achieved; "
           "sgemm alone %.1f GFLOP/s (before %.1f, after %.1f); achieved / sgemm %.2f\n",
           p->name, ms, s.min_ms, *sps, flops / (ms * 1e6), sg, sg_before, sg_after,
           flops / (ms * 1e6) / sg);
    return 0;
}

/* ---- main ----------------------------------------------------------------------------------- */

static int usage(void)
{
    fprintf(stderr, "usage: bench_sensorlm [STEPS] [--size tiny|small|base|all] [--batch B] "
                    "[--threads T] [--time-steps T] [--channels C] [--repeat R]\n");
    return 64;
}

/* The mean and the smallest and largest of v[0..n). */
static void spread(const double *v, int n, double *mean, double *lo, double *hi)
{
    *mean = 0, *lo = v[0], *hi = v[0];
    for (int i = 0; i < n; i++) {
        *mean += v[i] / n;
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
}

int main(int argc, char **argv)
{
    opts o = {.threads = (int)sysconf(_SC_NPROCESSORS_ONLN), .T = 1440, .C = 10, .repeat = 1};
    char dir[] = "/tmp/bench_sensorlm_XXXXXX", shard[sizeof(dir) + 16];
    double sps[3][MAX_REPEAT];
    int rc = 0, any = 0, maxB = 0;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
            const char *v = argv[++i];
            int all = strcmp(v, "all") == 0, found = all;
            for (int k = 0; k < 3; k++)
                if (all || strcmp(v, presets[k].name) == 0)
                    o.sizes[k] = found = 1;
            if (!found) {
                fprintf(stderr, "bench_sensorlm: --size %s: tiny, small, base or all\n", v);
                return 64;
            }
        } else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            o.batch = atoi(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            o.threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--time-steps") == 0 && i + 1 < argc)
            o.T = atoi(argv[++i]);
        else if (strcmp(argv[i], "--channels") == 0 && i + 1 < argc)
            o.C = atoi(argv[++i]);
        else if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc)
            o.repeat = atoi(argv[++i]);
        else if (argv[i][0] != '-' && atoll(argv[i]) > 0)
            o.steps = atoll(argv[i]);
        else
            return usage();
    }
    if (o.threads < 1 || o.batch < 0 || o.T < 10 || o.T % 10 != 0 || o.C < 1 ||
        o.C > TD_SENSOR_MAX_CHANNELS || o.repeat < 1 || o.repeat > MAX_REPEAT) {
        fprintf(stderr, "bench_sensorlm: bad arguments (--time-steps a multiple of 10, "
                        "--channels 1 to 60, --repeat 1 to 64)\n");
        return 64;
    }
    for (int k = 0; k < 3; k++)
        any |= o.sizes[k];
    if (!any)
        o.sizes[0] = o.sizes[1] = 1; /* tiny and small */
    for (int k = 0; k < 3; k++) {
        int B = o.batch > 0 ? o.batch : presets[k].batch;
        if (o.sizes[k] && B > maxB)
            maxB = B;
    }
    if (mkdtemp(dir) == NULL) {
        perror("bench_sensorlm: temporary directory");
        return 1;
    }
    snprintf(shard, sizeof(shard), "%s/train.bin", dir);
    printf("input: %d windows of T=%d x C=%d (random walks, %d/1000 NaN), captions of 30-120 "
           "bytes, text_len 64; %d threads; %s\n",
           4 * maxB, o.T, o.C, NAN_PERMILLE, o.threads, td_kernels_cpu_blas());
    if (write_shard(shard, 4 * maxB, o.T, o.C) != 0)
        rc = 1;
    for (int r = 0; rc == 0 && r < o.repeat; r++)
        for (int k = 0; rc == 0 && k < 3; k++)
            if (o.sizes[k])
                rc = run_preset(&presets[k], &o, shard, &sps[k][r]);
    for (int k = 0; rc == 0 && o.repeat > 1 && k < 3; k++) {
        double mean, lo, hi;
        if (!o.sizes[k])
            continue;
        spread(sps[k], o.repeat, &mean, &lo, &hi);
        printf("sensorlm %s over %d runs: %.2f samples/s mean, %.2f to %.2f\n", presets[k].name,
               o.repeat, mean, lo, hi);
    }
    unlink(shard);
    rmdir(dir);
    return rc;
}
