/* The CPU backend's team (cpu_team.h): the calling thread's helper threads and the jobs of
 * tasks they claim, sgemm cut into tiles over them, and OpenBLAS under them (kept to one thread;
 * its kernel set chosen again for this CPU before main, td_kernels_cpu_blas). Owns the teams,
 * one per thread that asked for one, released when that thread exits. The ops are cpu.c's. */
#include <cblas.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/cpu_team.h"
#include "kernels/kernels.h"

/* ---- the team: the calling thread's helper threads ------------------------------------------
 *
 * An op cuts its work into tasks 0..n-1 and calls td__cpu_team_run(n, fn, ctx): the calling
 * thread and its helpers claim task numbers from one atomic word, the job's generation, its
 * number of tasks and the next task to claim, run them, and the caller returns once every task
 * is done. A claim is a compare-and-swap of the whole word, so it succeeds only while that job
 * is the current one and has tasks left, whatever a helper that woke late read of the job's
 * function and arguments (those change only once every task of the job is done, and a claim on
 * an earlier word then fails). A helper polls for the next job for about TEAM_SPIN_US, yielding
 * its core to any other runnable thread while it does, then sleeps on the condition variable
 * until woken: back-to-back ops find it awake, an idle trainer costs nothing. No allocation
 * after td__cpu_team_set_threads. */

#define TEAM_MAX     64 /* helper threads of one team */
#define TASK_BITS    16 /* bits of the word for the task count, and for the next task */
#define TASK_MASK    0xffffu
#define TASKS_MAX    0xffff /* tasks of one job; td__cpu_team_run runs more as several */
#define TEAM_POLLS   64     /* polls with a pause before a waiting thread starts yielding */
#define TEAM_SPIN_US 200    /* microseconds a helper polls before it sleeps */

typedef struct team {
    _Atomic uint64_t word; /* generation << 32 | tasks << 16 | next task, of the current job */
    _Atomic(td__cpu_task_fn) fn; /* the current job, written before the word publishes it */
    _Atomic(void *) ctx;
    _Atomic int base;     /* the job's first task number (a long run is cut into jobs) */
    _Atomic int done;     /* tasks of the current job finished */
    _Atomic int sleepers; /* helpers waiting on cv */
    _Atomic int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n; /* helpers */
    pthread_t th[TEAM_MAX];
} team;

static __thread team *my_team;
static pthread_key_t team_key;
static pthread_once_t team_once = PTHREAD_ONCE_INIT;

static inline void cpu_pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* Claims and runs tasks of the job that w (a value of t->word) belongs to until none is left or
 * a later job has replaced it. fn, ctx and base may already be a later job's when they are
 * read (w's job then has no task left), and then every claim on w's job fails. */
static void team_work(team *t, uint64_t w)
{
    td__cpu_task_fn fn = atomic_load_explicit(&t->fn, memory_order_relaxed);
    void *ctx = atomic_load_explicit(&t->ctx, memory_order_relaxed);
    int base = atomic_load_explicit(&t->base, memory_order_relaxed);
    uint64_t gen = w >> 32;

    while ((w & TASK_MASK) < (w >> TASK_BITS & TASK_MASK)) {
        if (atomic_compare_exchange_weak_explicit(&t->word, &w, w + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            fn(ctx, base + (int)(w & TASK_MASK));
            atomic_fetch_add_explicit(&t->done, 1, memory_order_release);
            w++;
        } else if (w >> 32 != gen) {
            return;
        }
    }
}

static void *helper_main(void *arg)
{
    team *t = arg;
    uint64_t seen = 0;

    for (;;) {
        uint64_t w = atomic_load(&t->word);
        double since = 0.0;
        for (int polls = 0; w >> 32 == seen; polls++) {
            if (atomic_load(&t->stop))
                return NULL;
            if (polls < TEAM_POLLS) {
                cpu_pause();
            } else if (since == 0.0 || now_us() - since < TEAM_SPIN_US) {
                since = since == 0.0 ? now_us() : since;
                sched_yield();
            } else {
                pthread_mutex_lock(&t->mu);
                atomic_fetch_add(&t->sleepers, 1);
                while (atomic_load(&t->word) >> 32 == seen && !atomic_load(&t->stop))
                    pthread_cond_wait(&t->cv, &t->mu);
                atomic_fetch_sub(&t->sleepers, 1);
                pthread_mutex_unlock(&t->mu);
                polls = 0;
                since = 0.0;
            }
            w = atomic_load(&t->word);
        }
        seen = w >> 32;
        team_work(t, w);
    }
}

static void team_free(team *t)
{
    if (t == NULL)
        return;
    pthread_mutex_lock(&t->mu);
    atomic_store(&t->stop, 1);
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    for (int i = 0; i < t->n; i++)
        pthread_join(t->th[i], NULL);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static void team_key_make(void)
{
    pthread_key_create(&team_key, (void (*)(void *))team_free);
}

/* A team of up to n helpers; NULL when not even one could be started (ops then run on the
 * calling thread alone, which gives the same results). */
static team *team_new(int n)
{
    team *t = calloc(1, sizeof(*t));

    if (t == NULL)
        return NULL;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    for (t->n = 0; t->n < n; t->n++)
        if (pthread_create(&t->th[t->n], NULL, helper_main, t) != 0)
            break;
    if (t->n == 0) {
        team_free(t);
        return NULL;
    }
    return t;
}

/* Threads that work on the calling thread's ops: it and its helpers. */
int td__cpu_team_size(void)
{
    return my_team != NULL ? my_team->n + 1 : 1;
}

/* One job: tasks [base, base + n), n <= TASKS_MAX, on the team. */
static void team_job(team *t, int base, int n, td__cpu_task_fn fn, void *ctx)
{
    uint64_t w;

    atomic_store_explicit(&t->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&t->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&t->base, base, memory_order_relaxed);
    atomic_store_explicit(&t->done, 0, memory_order_relaxed);
    w = ((atomic_load_explicit(&t->word, memory_order_relaxed) >> 32) + 1) << 32;
    w |= (uint64_t)n << TASK_BITS;
    atomic_store(&t->word, w); /* publishes the job (sequentially consistent: see sleepers) */
    if (atomic_load(&t->sleepers) > 0) {
        pthread_mutex_lock(&t->mu);
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    team_work(t, w);
    for (int polls = 0; atomic_load_explicit(&t->done, memory_order_acquire) < n; polls++)
        if (polls < TEAM_POLLS)
            cpu_pause();
        else
            sched_yield(); /* a helper holds a task; on a busy machine it may need this core */
}

/* fn(ctx, i) for every i in [0, ntasks), shared among the calling thread and its helpers;
 * returns when all are done. Tasks must not depend on each other's order. */
void td__cpu_team_run(int ntasks, td__cpu_task_fn fn, void *ctx)
{
    team *t = my_team;

    if (t == NULL || ntasks < 2) {
        for (int i = 0; i < ntasks; i++)
            fn(ctx, i);
        return;
    }
    for (int base = 0; base < ntasks; base += TASKS_MAX)
        team_job(t, base, ntasks - base < TASKS_MAX ? ntasks - base : TASKS_MAX, fn, ctx);
}

/* The calling thread's team becomes n-1 helpers; OpenBLAS is kept to one thread, as the team
 * calls it from several threads at once. */
void td__cpu_team_set_threads(int n)
{
    int helpers = n - 1 < TEAM_MAX ? n - 1 : TEAM_MAX;

    openblas_set_num_threads(1);
    pthread_once(&team_once, team_key_make);
    if (helpers == (my_team != NULL ? my_team->n : 0))
        return;
    team_free(my_team);
    my_team = helpers > 0 ? team_new(helpers) : NULL;
    pthread_setspecific(team_key, my_team);
}

/* ---- sgemm over the team ------------------------------------------------------------------- */

#define GEMM_TILE_FLOPS (1 << 22) /* multiply-adds a tile of a split sgemm does at least */
/* Tiles of a split sgemm per thread of the team at most. Each tile packs the operand it shares
 * with the others again: at 16 tiles on 2 threads the packing took a fifth of the GPT's step
 * (perf, bench_gpt), and one thread's sgemm of a weight gradient (256 x 256 over 2048 rows)
 * cost twice the CPU time in 16 tiles that it does in 2. Two per thread leave a thread that
 * finishes first one more tile to take. */
#define GEMM_TILES_PER 2
#define GEMM_ALIGN     16 /* rows or columns: a tile's edge is a multiple of this */

typedef struct gemm_job {
    enum CBLAS_TRANSPOSE ta, tb;
    int M, N, K, per, by_rows;
    float alpha, beta;
    const float *A, *B;
    float *C;
    int lda, ldb, ldc;
} gemm_job;

static void gemm_task(void *ctx, int task)
{
    const gemm_job *g = ctx;
    int o = task * g->per;

    if (g->by_rows) {
        int m = g->M - o < g->per ? g->M - o : g->per;
        const float *A = g->A + (g->ta == CblasNoTrans ? (size_t)o * g->lda : (size_t)o);
        cblas_sgemm(CblasRowMajor, g->ta, g->tb, m, g->N, g->K, g->alpha, A, g->lda, g->B, g->ldb,
                    g->beta, g->C + (size_t)o * g->ldc, g->ldc);
    } else {
        int n = g->N - o < g->per ? g->N - o : g->per;
        const float *B = g->B + (g->tb == CblasNoTrans ? (size_t)o : (size_t)o * g->ldb);
        cblas_sgemm(CblasRowMajor, g->ta, g->tb, g->M, n, g->K, g->alpha, g->A, g->lda, B, g->ldb,
                    g->beta, g->C + o, g->ldc);
    }
}

/* The most tiles a split sgemm is cut into: GEMM_TILES_PER for each core of the machine (as
 * the process starts), so the same on every team of the process, whatever its size. */
static int gemm_max_tiles(void)
{
    static _Atomic int max;
    int m = atomic_load(&max);

    if (m == 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        cores = cores < 1 ? 1 : cores > TEAM_MAX + 1 ? TEAM_MAX + 1 : cores;
        m = GEMM_TILES_PER * (int)cores;
        atomic_store(&max, m);
    }
    return m;
}

// C = alpha op(A) op(B) + beta C (row-major, cblas_sgemm's arguments), cut into tiles of rows
// of C (or of columns, when C has fewer rows than columns, so that the operand every tile
// packs again is the smaller one), each at least GEMM_TILE_FLOPS, at most gemm_max_tiles();
// the team takes the tiles, a thread without one runs them in turn. The tiles depend on the
// shape (and the machine's core count) alone, never on the team's size: OpenBLAS does not
// compute an element the same way whichever tile holds it (on its Zen and Haswell kernels a
// 512 x 384 x 128 product cut into 2 tiles differs from the whole in about 4% of its elements,
// in the last bits), so the same tiles are what make the bits the same on 1, 2 or 3 threads.
void td__cpu_sgemm(enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                   float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                   float *C, int ldc)
{
    double flops = (double)M * N * K;
    int by_rows = M >= N, edge = by_rows ? M : N, tiles, per;
    gemm_job g = {ta, tb, M, N, K, 0, by_rows, alpha, beta, A, B, C, lda, ldb, ldc};

    tiles = flops / GEMM_TILE_FLOPS > gemm_max_tiles() ? gemm_max_tiles()
                                                       : (int)(flops / GEMM_TILE_FLOPS);
    tiles = tiles > edge / GEMM_ALIGN ? edge / GEMM_ALIGN : tiles;
    if (tiles < 2) {
        cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    per = (edge + tiles - 1) / tiles;
    g.per = (per + GEMM_ALIGN - 1) / GEMM_ALIGN * GEMM_ALIGN;
    td__cpu_team_run((edge + g.per - 1) / g.per, gemm_task, &g);
}

/* ---- OpenBLAS's kernels for this CPU --------------------------------------------------------
 *
 * A DYNAMIC_ARCH OpenBLAS (Debian's) picks its kernel set as it loads, from the CPU's model
 * number and the OSXSAVE bit. A CPU newer than the library (0.3.21 does not know Sapphire
 * Rapids) or a virtual machine that hides OSXSAVE gets the SSE3 "Prescott" set: on this 2-core
 * Xeon with AVX-512, one thread's 2048x768x256 sgemm does about 20 GFLOP/s with it and about
 * 130 with the SkylakeX set, and PyTorch, which loads the same library, is slowed alike. When
 * nobody chose (OPENBLAS_CORETYPE unset) and the library took a set older than Haswell's on a
 * CPU whose AVX2 and FMA (AVX-512 F, BW, DQ and VL) the compiler's runtime reports usable, the
 * library is asked to choose again as OPENBLAS_CORETYPE=Haswell (SkylakeX) would have made it,
 * through its own gotoblas_dynamic_quit / gotoblas_dynamic_init. Both are weak: an OpenBLAS
 * without them (not DYNAMIC_ARCH) is left alone. Every result of the library is still its
 * own; only its speed changes. Runs once before main, when no thread of ours exists and
 * OpenBLAS's pool is idle; the environment is as it was afterwards. */

extern void gotoblas_dynamic_init(void) __attribute__((weak));
extern void gotoblas_dynamic_quit(void) __attribute__((weak));
extern char *openblas_get_corename(void);

static char blas_note[96]; /* what blas_choose found and did, for td_kernels_cpu_blas */

/* OpenBLAS's names of the x86-64 kernel sets that use AVX2 or AVX-512. */
static int core_has_avx2(const char *core)
{
    static const char *const modern[] = {"Haswell", "Zen", "SkylakeX", "Cooperlake",
                                         "SapphireRapids"};

    for (size_t i = 0; i < sizeof(modern) / sizeof(modern[0]); i++)
        if (strcmp(core, modern[i]) == 0)
            return 1;
    return 0;
}

__attribute__((constructor)) static void blas_choose(void)
{
    const char *was = openblas_get_corename(), *want = NULL;

    snprintf(blas_note, sizeof(blas_note), "OpenBLAS %s", was);
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (getenv("OPENBLAS_CORETYPE") != NULL || core_has_avx2(was) ||
        gotoblas_dynamic_init == NULL || gotoblas_dynamic_quit == NULL)
        return;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        want = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        want = "Haswell";
    if (want == NULL || setenv("OPENBLAS_CORETYPE", want, 1) != 0)
        return;
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    unsetenv("OPENBLAS_CORETYPE");
    snprintf(blas_note, sizeof(blas_note),
             "OpenBLAS %s (it chose %s on this CPU; traind asked again)", openblas_get_corename(),
             was);
#endif
}

const char *td_kernels_cpu_blas(void)
{
    return blas_note;
}
