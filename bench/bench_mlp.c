/* bench_mlp: trains the default MLP recipe (784-256-256-10 ReLU, AdamW lr 1e-3, batch 128,
 * shuffled, seed 1) on Fashion-MNIST through train.h and prints figures: ms per step,
 * samples/s, the GFLOP/s the step achieves counting 2*M*N*K for every forward and backward
 * sgemm, and, in the same run, what this machine's cblas_sgemm does alone on those shapes.
 * Prints figures only, no pass/fail.
 *
 *   bench_mlp [STEPS]            train STEPS steps (default 500), no evaluation
 *   bench_mlp --epochs E         the full job: E epochs with the test split, accuracy per epoch
 *   options: --threads T (BLAS threads; default OpenBLAS's), --data DIR */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "train/engine.h"
#include "common/td_clock.h"
#include "train/train.h"

#define DEFAULT_STEPS 500
#define WARMUP_STEPS  10  /* steps left out of the timing: first-touch page faults, BLAS start */
#define SGEMM_REPS    200 /* calls per shape when timing sgemm alone */
#define DEFAULT_DATA  "/usr/share/datasets/fashion-mnist"

typedef struct stats {
    int64_t steps;  /* timed steps */
    double ms;      /* their step_ms summed */
    double samples; /* their samples */
    double flops;   /* their sgemm flops */
    double last_ms; /* step_ms of the step being reported */
    int epoch;
    double epoch_start_ms; /* wall clock when the current epoch began */
    double t0_ms;
} stats;

static const int sizes[] = {784, 256, 256, 10};
static const int n_sizes = 4;

/* Flops of the sgemms of one training step on a batch of N: per layer the forward, the weight
 * gradient, the bias gradient (ones . dout) and, past the first layer, the input gradient. */
static double step_flops(int N)
{
    double f = 0.0;

    for (int l = 0; l + 1 < n_sizes; l++) {
        double C = sizes[l], OC = sizes[l + 1];
        f += 2.0 * N * C * OC; /* forward */
        f += 2.0 * N * C * OC; /* dweight */
        f += 2.0 * N * OC;     /* dbias */
        if (l > 0)
            f += 2.0 * N * C * OC; /* dinp */
    }
    return f;
}

static void on_metric(void *ud, const char *key, int64_t step, double value)
{
    stats *s = ud;

    if (strcmp(key, "step_ms") == 0) {
        s->last_ms = value;
    } else if (strcmp(key, "samples_per_s") == 0 && step > WARMUP_STEPS) {
        double N = value * s->last_ms / 1e3 + 0.5;
        s->steps++;
        s->ms += s->last_ms;
        s->samples += (int)N;
        s->flops += step_flops((int)N);
    } else if (strcmp(key, "epoch") == 0) {
        s->epoch = (int)value;
        s->epoch_start_ms = td_mono_ms();
    } else if (strcmp(key, "test_loss") == 0) {
        printf("epoch %d: %.2f s (evaluation included), test_loss %.4f", s->epoch,
               (td_mono_ms() - s->epoch_start_ms) / 1e3, value);
    } else if (strcmp(key, "test_accuracy") == 0) {
        printf(", test_accuracy %.4f\n", value);
    }
}

/* The step's sgemm calls (as kernels/cpu.c makes them) on random data, alone. */
static void bench_sgemm(int N)
{
    size_t big = (size_t)1 << 20; /* floats: room for any operand here */
    float *A = malloc(big * sizeof(float)), *B = malloc(big * sizeof(float));
    float *C = malloc(big * sizeof(float));
    double total_ms = 0.0, total_flops = 0.0;

    for (size_t i = 0; i < big; i++) {
        A[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        B[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        C[i] = 0.0f;
    }
    printf("\ncblas_sgemm alone on the step's shapes (batch %d, %d calls each):\n", N, SGEMM_REPS);
    printf("  %-8s %5s %5s %5s  %9s %8s\n", "call", "M", "N", "K", "us/call", "GFLOP/s");
    for (int l = 0; l + 1 < n_sizes; l++) {
        int Cn = sizes[l], OC = sizes[l + 1];
        struct {
            const char *name;
            CBLAS_TRANSPOSE ta, tb;
            int M, N, K;
        } calls[4] = {
            {"forward", CblasNoTrans, CblasTrans, N, OC, Cn},
            {"dweight", CblasTrans, CblasNoTrans, OC, Cn, N},
            {"dbias", CblasNoTrans, CblasNoTrans, 1, OC, N},
            {"dinp", CblasNoTrans, CblasNoTrans, N, Cn, OC},
        };
        for (int i = 0; i < (l > 0 ? 4 : 3); i++) {
            double ms = bench_time_sgemm(calls[i].ta, calls[i].tb, calls[i].M, calls[i].N,
                                         calls[i].K, A, B, C, 5, SGEMM_REPS);
            double f = 2.0 * calls[i].M * calls[i].N * calls[i].K;
            printf("  %-8s %5d %5d %5d  %9.1f %8.1f   (layer %d)\n", calls[i].name, calls[i].M,
                   calls[i].N, calls[i].K, ms * 1e3, f / (ms * 1e6), l);
            total_ms += ms;
            total_flops += f;
        }
    }
    printf("  all of a step's sgemms: %.3f ms, %.1f GFLOP/s\n", total_ms,
           total_flops / (total_ms * 1e6));
    free(A);
    free(B);
    free(C);
}

int main(int argc, char **argv)
{
    const char *dir = DEFAULT_DATA;
    int64_t steps = DEFAULT_STEPS;
    int epochs = 0, threads = 0, rc;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};
    stats s = {0};
    td_train_hooks hooks = {.ud = &s, .metric = on_metric};
    double t_new;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--epochs") == 0 && i + 1 < argc)
            epochs = atoi(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--data") == 0 && i + 1 < argc)
            dir = argv[++i];
        else
            steps = atoll(argv[i]);
    }

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_MLP;
    cfg.data = TD_DATA_IDX;
    memcpy(cfg.layers, sizes, sizeof(sizes));
    cfg.n_layers = n_sizes;
    cfg.threads = threads;
    snprintf(cfg.train.images, TD_PATH_MAX, "%s/train-images-idx3-ubyte.gz", dir);
    snprintf(cfg.train.labels, TD_PATH_MAX, "%s/train-labels-idx1-ubyte.gz", dir);
    if (epochs > 0) {
        cfg.epochs = epochs;
        snprintf(cfg.test.images, TD_PATH_MAX, "%s/t10k-images-idx3-ubyte.gz", dir);
        snprintf(cfg.test.labels, TD_PATH_MAX, "%s/t10k-labels-idx1-ubyte.gz", dir);
    } else {
        cfg.max_steps = steps > WARMUP_STEPS ? steps : WARMUP_STEPS + 1;
    }

    s.t0_ms = td_mono_ms();
    rc = td_trainer_new(&t, &cfg, &hooks, &err);
    if (rc != 0) {
        fprintf(stderr, "bench_mlp: %s: %s\n", td_errname(rc), err.msg);
        return 1;
    }
    t_new = td_mono_ms() - s.t0_ms;
    printf("mlp 784-256-256-10, adamw, batch %d, %lld steps, BLAS threads %d\n", cfg.batch_size,
           (long long)td_trainer_total_steps(t), openblas_get_num_threads());
    printf("dataset load and trainer build: %.0f ms\n", t_new);

    s.t0_ms = td_mono_ms();
    while (td_trainer_step(t) == 0)
        ;
    printf("\ntraining steps %lld..%lld (first %d left out):\n", (long long)WARMUP_STEPS + 1,
           (long long)td_trainer_total_steps(t), WARMUP_STEPS);
    printf("  %.3f ms/step, %.0f samples/s, %.1f GFLOP/s in sgemm-counted flops\n", s.ms / s.steps,
           s.samples / (s.ms / 1e3), s.flops / (s.ms * 1e6));
    printf("  an epoch of 60000 samples at that rate: %.2f s (training only)\n",
           60000.0 / (s.samples / (s.ms / 1e3)));
    printf("  wall time of the whole loop: %.2f s\n", (td_mono_ms() - s.t0_ms) / 1e3);
    td_trainer_free(t);

    bench_sgemm(cfg.batch_size);
    return 0;
}
