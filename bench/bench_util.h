/* What the training benchmarks (bench_gpt, bench_sensorlm, bench_mlp) share: the process's CPU
 * time, one sgemm shape timed alone, and the step times and losses a trainer's metric hook
 * reports. Single-threaded callers; nothing here prints. */
#ifndef TD_BENCH_UTIL_H
#define TD_BENCH_UTIL_H

#include <cblas.h>
#include <stdint.h>

/* This process's CPU time, all threads, in ms. Over a wall-clock span it says how many cores
 * the process had: well below the cores there are, the machine's other work took the rest (or
 * the process waited), and the figures of that span are the machine's, not the code's. */
double bench_cpu_ms(void);

/* Times reps calls of one row-major sgemm (beta 1, as the backward's are) after warm untimed
 * ones; ms per call. */
double bench_time_sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, const float *A,
                        const float *B, float *C, int warm, int reps);

/* A run's timed steps, filled by bench_steps_metric (a td_train_hooks metric callback whose ud
 * is this): step_ms of the steps after warmup, and train_loss at step 1 and at the last step. */
typedef struct bench_steps {
    int64_t warmup; /* steps left out of the timing; set before the run */
    int64_t steps;  /* timed steps */
    double ms;      /* their step_ms summed */
    double min_ms;  /* the fastest */
    double loss0, loss;
} bench_steps;

void bench_steps_metric(void *ud, const char *key, int64_t step, double value);

#endif
