/* The training benchmarks' shared pieces (bench_util.h). */
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "common/td_clock.h"

double bench_cpu_ms(void)
{
    return td_clock_ms(CLOCK_PROCESS_CPUTIME_ID);
}

double bench_time_sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, const float *A,
                        const float *B, float *C, int warm, int reps)
{
    int lda = ta == CblasNoTrans ? K : M;
    int ldb = tb == CblasNoTrans ? N : K;
    double t0;

    for (int r = 0; r < warm; r++)
        cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, N);
    t0 = td_mono_ms();
    for (int r = 0; r < reps; r++)
        cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, N);
    return (td_mono_ms() - t0) / reps;
}

void bench_steps_metric(void *ud, const char *key, int64_t step, double value)
{
    bench_steps *s = ud;

    if (strcmp(key, "step_ms") == 0 && step > s->warmup) {
        s->steps++;
        s->ms += value;
        if (s->min_ms == 0 || value < s->min_ms)
            s->min_ms = value;
    } else if (strcmp(key, "train_loss") == 0) {
        if (step == 1)
            s->loss0 = value;
        s->loss = value;
    }
}
