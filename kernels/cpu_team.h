/* Inside the CPU backend: who computes. The calling thread's team of helper threads, which
 * every op of cpu.c shares its tasks out to; sgemm tiled over that team; and OpenBLAS under it
 * (one thread, its kernel set chosen for this CPU before main). The ops (cpu.c) cut their work
 * into tasks by their shape alone; the team only runs them, so results have the same bits
 * whatever its size. Each function acts on the calling thread's own team: any thread. */
#ifndef TD_CPU_TEAM_H
#define TD_CPU_TEAM_H

#include <cblas.h>

/* One task of a job: fn(ctx, task), task in [0, ntasks). */
typedef void (*td__cpu_task_fn)(void *ctx, int task);

/* The calling thread's team becomes n-1 helpers (at most 64; n <= 1: none, the thread works
 * alone); OpenBLAS is kept to one thread, as the team calls it from several threads at once.
 * The table's set_threads. */
void td__cpu_team_set_threads(int n);

/* Threads that work on the calling thread's ops: it and its helpers. */
int td__cpu_team_size(void);

/* fn(ctx, i) for every i in [0, ntasks), shared among the calling thread and its helpers;
 * returns when all are done. Tasks must not depend on each other's order. */
void td__cpu_team_run(int ntasks, td__cpu_task_fn fn, void *ctx);

/* C = alpha op(A) op(B) + beta C (row-major, cblas_sgemm's arguments), cut into tiles over the
 * team; the bits do not depend on the team's size. */
void td__cpu_sgemm(enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                   float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                   float *C, int ldc);

#endif
