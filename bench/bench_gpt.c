/* bench_gpt: trains the reference GPT (L=4, C=256, NH=4, T=256, B=8, V=256: byte-level text,
 * AdamW, 2 threads) through train.h and prints figures, never pass/fail. Three modes:
 *
 *   bench_gpt [STEPS]
 *       STEPS timed steps (default 20, after WARMUP_STEPS untimed ones): ms per step,
 *       tokens/s, the GFLOP/s the step achieves counting nanoGPT's estimate (6 x the
 *       parameters without the position embedding x tokens, plus 12 L C T per token for
 *       attention, whose causal half we do not compute but count, as everyone does), and, in
 *       the same run (before the training and after it), what this machine's cblas_sgemm
 *       does alone on the step's matmul shapes.
 *   bench_gpt --metrics [STEPS]
 *       the cost of recording metrics (issue 4: goal within 2%): one trainer alternates blocks
 *       of --block steps with every metric it records sent through the daemon's real pipeline
 *       (td_mq_start on a temporary store, a sink for the job, td_mq_push in the metric hook,
 *       td_mq_flush at the end of each block, timed with it) and blocks whose hook drops them,
 *       in the order off on on off off on ..., so that drift and the machine's other work fall
 *       on both alike. STEPS timed steps each (default 24). Prints ms/step of each, their
 *       difference, and the spread of that difference over the block pairs.
 *   bench_gpt --world W [STEPS]
 *       data parallelism (issue 5): the daemon's cpu:1 against its cpu:W on the same global
 *       batch, alternating blocks of --block steps of one against the other, STEPS timed steps
 *       each (default 16): W replicas on W threads, each with threads/W threads and
 *       pinned to its share of the cores as the daemon pins its workers, agreeing at every
 *       step boundary and averaging gradients through the daemon's host all-reduce (see
 *       "The daemon's host all-reduce" below). Prints tokens/s of both, the speed-up, the
 *       all-reduce's ms and share of the step (split into averaging and waiting at its
 *       barriers), and both runs' losses, which must agree.
 *
 *   options: --threads T (threads in all; default 2), --data PATTERN (text files;
 *            default the fortunes, else a generated text), --batch B, --layers L,
 *            --block N (steps per block in --metrics and --world; default 3 and 4) */
#include <cblas.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "train/engine.h"
#include "kernels/hostreduce.h"
#include "kernels/kernels.h"
#include "daemon/metricq.h"
#include "store/store.h"
#include "common/td_clock.h"
#include "train/train.h"

#define HEADLINE_STEPS 20
#define METRICS_STEPS  24 /* timed steps with metrics on, and as many off */
#define METRICS_BLOCK  3
#define WORLD_STEPS    16 /* timed steps of each world */
#define WORLD_BLOCK    4
#define WARMUP_STEPS   3  /* steps left out of the timing: first-touch page faults, BLAS start */
#define SGEMM_REPS     10 /* calls per shape when timing sgemm alone */
#define FORTUNES       "/usr/share/games/fortunes/*"
#define GEN_BYTES      (4 << 20) /* bytes of generated text when there are no fortunes */
#define MAX_WORLD      8
#define MAX_BLOCKS     1024

typedef struct opts {
    int64_t steps; /* timed steps; 0: the mode's default */
    int threads, batch, layers, block;
    const char *data;
} opts;

/* The reference config, as the job file of issue 3 gives it, with o's sizes. */
static void gpt_config(td_train_config *cfg, const opts *o, int64_t max_steps)
{
    td_train_config_defaults(cfg);
    cfg->model = TD_MODEL_GPT;
    cfg->data = TD_DATA_TEXT;
    cfg->n_layer = o->layers;
    cfg->n_head = 4;
    cfg->n_embd = 256;
    cfg->seq_len = 256;
    cfg->vocab_size = 256;
    snprintf(cfg->train_files[0], TD_PATH_MAX, "%s", o->data);
    cfg->n_train_files = 1;
    cfg->batch_size = o->batch;
    cfg->lr = 3e-4f;
    cfg->beta2 = 0.95f;
    cfg->weight_decay = 0.1f;
    cfg->grad_clip = 1.0f;
    cfg->max_steps = max_steps;
    cfg->threads = o->threads;
}

/* Flops of one step by nanoGPT's estimate_mfu: 6 N per token with N the parameters without
 * the position embedding, plus attention's 12 L C T per token. */
static double step_flops(const opts *o, double *n_params)
{
    td_gpt_dims d = {.maxT = 256, .V = 256, .Vp = 256, .L = o->layers, .NH = 4, .C = 256};

    *n_params = (double)td_gpt_num_params(&d);
    return (6.0 * (*n_params - (double)d.maxT * d.C) + 12.0 * d.L * d.C * d.maxT) * o->batch *
           d.maxT;
}

static int trainer_new(td_trainer **t, const td_train_config *cfg, const td_train_hooks *hooks)
{
    td_error_t err = {0};
    int rc = td_trainer_new(t, cfg, hooks, &err);

    if (rc != 0)
        fprintf(stderr, "bench_gpt: %s: %s\n", td_errname(rc), err.msg);
    return rc;
}

/* ---- the headline: ms/step, tokens/s, GFLOP/s next to sgemm's ---- */

/* The step's linear layers (qkv, attproj, fc, fcproj, lm head) as kernels/cpu.c calls sgemm:
 * forward, dinp, dweight. Returns GFLOP/s over all of them, weighted by how often a step
 * makes each call; prints each call's figures when verbose. */
static double bench_sgemm(int BT, int C, int Vp, int L, int threads, int verbose)
{
    struct {
        const char *name;
        int OC, IC, count;
    } layers[5] = {{"qkv", 3 * C, C, L},
                   {"attproj", C, C, L},
                   {"fc", 4 * C, C, L},
                   {"fcproj", C, 4 * C, L},
                   {"lm head", Vp, C, 1}};
    size_t big = (size_t)BT * 4 * C > (size_t)BT * Vp ? (size_t)BT * 4 * C : (size_t)BT * Vp;
    float *A = malloc(big * sizeof(float)), *B = malloc(big * sizeof(float));
    float *Cm = malloc(big * sizeof(float));
    double total_ms = 0, total_flops = 0;

    /* OpenBLAS's own threads, as many as the trainer has; the trainer's team keeps OpenBLAS
     * single-threaded (kernels/cpu_team.c), and gets it back so after this */
    openblas_set_num_threads(threads);
    for (size_t i = 0; i < big; i++) {
        A[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        B[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        Cm[i] = 0.0f;
    }
    if (verbose) {
        printf("\ncblas_sgemm alone on the step's linear layers (%d calls each):\n", SGEMM_REPS);
        printf("  %-8s %-8s %5s %5s %5s  %8s %8s\n", "layer", "call", "M", "N", "K", "ms/call",
               "GFLOP/s");
    }
    for (int l = 0; l < 5; l++) {
        int OC = layers[l].OC, IC = layers[l].IC;
        struct {
            const char *name;
            CBLAS_TRANSPOSE ta, tb;
            int M, N, K;
        } calls[3] = {
            {"forward", CblasNoTrans, CblasTrans, BT, OC, IC},
            {"dinp", CblasNoTrans, CblasNoTrans, BT, IC, OC},
            {"dweight", CblasTrans, CblasNoTrans, OC, IC, BT},
        };
        for (int i = 0; i < 3; i++) {
            double ms = bench_time_sgemm(calls[i].ta, calls[i].tb, calls[i].M, calls[i].N,
                                         calls[i].K, A, B, Cm, 1, SGEMM_REPS);
            double f = 2.0 * calls[i].M * calls[i].N * calls[i].K;
            if (verbose)
                printf("  %-8s %-8s %5d %5d %5d  %8.3f %8.1f\n", layers[l].name, calls[i].name,
                       calls[i].M, calls[i].N, calls[i].K, ms, f / (ms * 1e6));
            total_ms += ms * layers[l].count;
            total_flops += f * layers[l].count;
        }
    }
    if (verbose)
        printf("  all of a step's linear-layer sgemms: %.1f ms, %.1f GFLOP/s\n", total_ms,
               total_flops / (total_ms * 1e6));
    free(A);
    free(B);
    free(Cm);
    openblas_set_num_threads(1);
    return total_flops / (total_ms * 1e6);
}

static int run_headline(const opts *o)
{
    int64_t steps = o->steps > 0 ? o->steps : HEADLINE_STEPS;
    td_train_config cfg;
    td_trainer *t = NULL;
    bench_steps s = {.warmup = WARMUP_STEPS};
    td_train_hooks hooks = {.ud = &s, .metric = bench_steps_metric};
    double t0, c0, wall, busy, n_params, flops = step_flops(o, &n_params);
    double sgemm_before, sgemm_after;

    gpt_config(&cfg, o, steps + WARMUP_STEPS);
    t0 = td_mono_ms();
    if (trainer_new(&t, &cfg, &hooks) != 0)
        return 1;
    printf("gpt L=%d C=256 NH=4 T=256 B=%d V=256 (%.2fM parameters), adamw, threads %d\n",
           o->layers, o->batch, n_params / 1e6, o->threads);
    printf("data %s; trainer build %.0f ms; %.2f GFLOP a step (nanoGPT's count); %s\n", o->data,
           td_mono_ms() - t0, flops / 1e9, td_kernels_cpu_blas());

    /* sgemm is timed before the training and after it: on a shared machine a burst of other
     * work during one of them would otherwise decide the ratio. The faster of the two counts,
     * which can only make the ratio look worse. */
    sgemm_before = bench_sgemm(o->batch * cfg.seq_len, 256, 256, o->layers, o->threads, 0);
    t0 = td_mono_ms();
    c0 = bench_cpu_ms();
    while (td_trainer_step(t) == 0)
        ;
    wall = td_mono_ms() - t0;
    busy = (bench_cpu_ms() - c0) / wall;
    {
        struct rusage ru;
        double est = (double)td_trainer_params(t)->n * 16 + (double)td_trainer_arena(t)->cap;
        getrusage(RUSAGE_SELF, &ru);
        printf("memory: parameters x 16 bytes + activation arena = %.0f MB; peak RSS %.0f MB "
               "(%.2fx; the rest is the text, OpenBLAS's buffers and the program)\n",
               est / 1e6, ru.ru_maxrss / 1e3, ru.ru_maxrss * 1e3 / est);
    }
    td_trainer_free(t);
    printf("\ntraining steps %d..%lld (first %d left out), loss %.3f -> %.3f:\n", WARMUP_STEPS + 1,
           (long long)cfg.max_steps, WARMUP_STEPS, s.loss0, s.loss);
    printf("  %.1f ms/step (best %.1f), %.0f tokens/s, %.1f GFLOP/s achieved\n", s.ms / s.steps,
           s.min_ms, (double)o->batch * cfg.seq_len / (s.ms / s.steps / 1e3),
           flops / (s.ms / s.steps * 1e6));
    printf("  wall time of the whole loop: %.2f s; %.2f of %ld cores busy\n", wall / 1e3, busy,
           sysconf(_SC_NPROCESSORS_ONLN));

    sgemm_after = bench_sgemm(o->batch * cfg.seq_len, 256, 256, o->layers, o->threads, 1);
    printf("  the same before the training: %.1f GFLOP/s\n", sgemm_before);
    printf("\nachieved / sgemm: %.2f (goal >= 0.5; the faster sgemm figure); PyTorch on this "
           "config: bench/pytorch_ref.py\n",
           flops / (s.ms / s.steps * 1e6) /
               (sgemm_before > sgemm_after ? sgemm_before : sgemm_after));
    return 0;
}

/* ---- --metrics: the step with the metric pipeline on and off ---- */

typedef struct metrics_run {
    td_mq_sink *sink;
    int on;         /* push (1) or drop (0) */
    int64_t pushed; /* samples sent through the pipeline */
    int errors;     /* pushes and flushes that reported an error */
    double hook_ms; /* spent in the hook and the flushes, on the training thread */
} metrics_run;

/* The CPU time thread tid of this process has used, from /proc (ms; -1 when unreadable). */
static double task_cpu_ms(long tid)
{
    char path[64];
    unsigned long long ns;
    FILE *f;
    int n;

    snprintf(path, sizeof(path), "/proc/self/task/%ld/schedstat", tid);
    if ((f = fopen(path, "r")) == NULL)
        return -1;
    n = fscanf(f, "%llu", &ns);
    fclose(f);
    return n == 1 ? (double)ns / 1e6 : -1;
}

/* The largest thread id of this process: called right after td_mq_start, the store thread
 * it started (Linux gives ids in increasing order until they wrap; the figure it feeds says
 * "unknown" when this guess finds no thread). */
static long newest_task(void)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    long best = -1;

    while (d != NULL && (e = readdir(d)) != NULL)
        if (atol(e->d_name) > best)
            best = atol(e->d_name);
    if (d != NULL)
        closedir(d);
    return best;
}

/* The daemon's hook_metric (daemon/run.c) when on: every sample into the job's sink. */
static void metric_pipeline(void *ud, const char *key, int64_t step, double value)
{
    metrics_run *m = ud;
    td_error_t err;
    double t0;

    if (!m->on)
        return;
    t0 = td_mono_ms();
    m->pushed++;
    if (td_mq_push(m->sink, key, step, value, &err) != 0 && m->errors++ == 0)
        fprintf(stderr, "bench_gpt: metrics: %s\n", err.msg);
    m->hook_ms += td_mono_ms() - t0;
}

/* A store in a new temporary directory dir (mkdtemp template) with one job; its path in db. */
static int temp_store(char *dir, char *db, size_t dbsize, int64_t *job)
{
    td_store *s;
    td_error_t err;
    int rc;

    if (mkdtemp(dir) == NULL) {
        perror("bench_gpt: temporary directory");
        return 1;
    }
    snprintf(db, dbsize, "%s/traind.db", dir);
    rc = td_store_open(&s, db, &err);
    if (rc == 0)
        rc = td_store_job_insert(s, "bench_gpt", 1, 0, 0, "\x80", 1, "{}", job, &err);
    if (rc != 0)
        fprintf(stderr, "bench_gpt: %s\n", err.msg);
    td_store_close(s);
    return rc != 0;
}

/* mean and standard error of v[0..n) */
static void mean_se(const double *v, int n, double *mean, double *se)
{
    double sum = 0, ss = 0;

    for (int i = 0; i < n; i++)
        sum += v[i];
    *mean = sum / n;
    for (int i = 0; i < n; i++)
        ss += (v[i] - *mean) * (v[i] - *mean);
    *se = n > 1 ? sqrt(ss / (n - 1) / n) : 0;
}

static int run_metrics(const opts *o)
{
    int64_t steps = o->steps > 0 ? o->steps : METRICS_STEPS;
    int block = o->block > 0 ? o->block : METRICS_BLOCK;
    int nblocks = (int)((2 * steps + block - 1) / block);
    char dir[] = "/tmp/bench_gpt.XXXXXX", db[64], cmd[96];
    metrics_run m = {0};
    td_train_hooks hooks = {.ud = &m, .metric = metric_pipeline};
    double ms[2] = {0}, cpu[2] = {0}, pair_diff[MAX_BLOCKS / 2], block_ms[2] = {0};
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int64_t nsteps[2] = {0};
    int npairs = 0, rc = 1;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_mq *q = NULL;
    td_error_t err;
    int64_t job;
    long store_tid;
    double store_cpu0;

    if (nblocks % 2)
        nblocks++; /* every block has its partner */
    if (nblocks > MAX_BLOCKS) {
        fprintf(stderr, "bench_gpt: --metrics: at most %d blocks\n", MAX_BLOCKS);
        return 1;
    }
    if (temp_store(dir, db, sizeof(db), &job) != 0)
        goto out;
    if (td_mq_start(&q, db, 0, NULL, NULL, &err) != 0) {
        fprintf(stderr, "bench_gpt: %s\n", err.msg);
        goto out;
    }
    store_tid = newest_task();
    if (td_mq_sink_open(q, job, NULL, &m.sink) != 0)
        goto out;
    gpt_config(&cfg, o, WARMUP_STEPS + (int64_t)nblocks * block);
    if (trainer_new(&t, &cfg, &hooks) != 0)
        goto out;
    printf("gpt L=%d B=%d, threads %d: metrics through the pipeline (on) or dropped (off), "
           "%d blocks of %d steps, off on on off ...\n",
           o->layers, o->batch, o->threads, nblocks, block);
    m.on = 1;
    for (int i = 0; i < WARMUP_STEPS; i++)
        td_trainer_step(t);
    if (td_mq_flush(m.sink, &err) != 0 && m.errors++ == 0)
        fprintf(stderr, "bench_gpt: metrics: %s\n", err.msg);
    m.hook_ms = 0;
    store_cpu0 = task_cpu_ms(store_tid);
    for (int b = 0; b < nblocks; b++) {
        int on = ((b + 1) / 2) % 2; /* off on on off off on ... */
        double t0 = td_mono_ms(), c0 = bench_cpu_ms(), t1;
        m.on = on;
        for (int i = 0; i < block; i++)
            td_trainer_step(t);
        t1 = td_mono_ms();
        if (on && td_mq_flush(m.sink, &err) != 0 && m.errors++ == 0)
            fprintf(stderr, "bench_gpt: metrics: %s\n", err.msg);
        m.hook_ms += td_mono_ms() - t1;
        block_ms[on] = (td_mono_ms() - t0) / block;
        cpu[on] += bench_cpu_ms() - c0;
        ms[on] += block_ms[on] * block;
        nsteps[on] += block;
        if (b % 2 == 1) /* a pair: one block of each */
            pair_diff[npairs++] = 100.0 * (block_ms[1] - block_ms[0]) / block_ms[0];
    }
    {
        double off = ms[0] / nsteps[0], on = ms[1] / nsteps[1], mean, se;
        double store_ms = task_cpu_ms(store_tid) - store_cpu0;
        mean_se(pair_diff, npairs, &mean, &se);
        printf("  metrics off: %.1f ms/step (%lld steps); %.2f of %ld cores busy\n", off,
               (long long)nsteps[0], cpu[0] / ms[0], cores);
        printf("  metrics on:  %.1f ms/step (%lld steps; %lld samples stored, %d errors); %.2f of "
               "%ld cores busy\n",
               on, (long long)nsteps[1], (long long)m.pushed, m.errors, cpu[1] / ms[1], cores);
        printf("  on - off: %+.2f%% of the step (goal within 2%%); over %d block pairs %+.2f%% "
               "+- %.2f%% (mean +- standard error)\n",
               100.0 * (on - off) / off, npairs, mean, se);
        /* What the pipeline costs at most, free of the machine's noise: the time in the hook
         * and the flushes, plus every CPU ms of the store thread as though it all came out of
         * the training's cores. */
        printf("  pipeline work per step with metrics on: %.3f ms in the hook and flushes, ",
               m.hook_ms / nsteps[1]);
        if (store_cpu0 >= 0 && store_ms >= 0)
            printf("%.3f ms of store-thread CPU: at most %.2f%% of the step\n",
                   store_ms / nsteps[1], 100.0 * (m.hook_ms + store_ms) / nsteps[1] / off);
        else
            printf("store-thread CPU unknown\n");
    }
    rc = m.errors != 0;
out:
    td_trainer_free(t);
    td_mq_sink_close(m.sink);
    td_mq_stop(q);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0)
        rc = 1;
    return rc;
}

/* ---- --world: cpu:1 against cpu:W ---- */

/* The replicas meet in the daemon's own host all-reduce (daemon/hostreduce.c): a barrier
 * before every step, as run.c's replica_train has, and the in-place average of the gradient
 * buffers between two barriers inside each step. */
typedef td_hostreduce group;

typedef struct replica {
    group *g;
    int rank;
    int cores_from, cores_to; /* the cores the daemon would pin this worker to; to < 0: none */
    td_trainer *t;
    int64_t block;                /* steps to take in the current block */
    int threads;                  /* the worker's threads: its team (kernels.h set_threads) */
    int timed;                    /* count the all-reduce in the sums below */
    double reduce_ms, average_ms; /* the all-reduce, and its averaging between the barriers */
    double loss;
} replica;

static void host_allreduce(void *ud, float *buf, size_t n)
{
    replica *p = ud;
    double t0 = td_mono_ms(), avg0 = p->g->average_ms[p->rank];

    td_hostreduce_average(p->g, p->rank, buf, n);
    if (p->timed) {
        p->reduce_ms += td_mono_ms() - t0;
        p->average_ms += p->g->average_ms[p->rank] - avg0;
    }
}

static void replica_metric(void *ud, const char *key, int64_t step, double value)
{
    replica *p = ud;

    if (strcmp(key, "train_loss") == 0)
        p->loss = value;
}

/* One block of a replica: the daemon's step loop (barrier, then the step). */
static void *replica_block(void *arg)
{
    replica *p = arg;

    if (p->cores_to >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int c = p->cores_from; c <= p->cores_to; c++)
            CPU_SET(c, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set); /* best effort, as daemon.c */
    }
    td_kernels_cpu()->set_threads(p->threads); /* this thread's team, as a worker's */
    for (int64_t i = 0; i < p->block; i++) {
        td_hostreduce_barrier(p->g, NULL, NULL);
        td_trainer_step(p->t);
    }
    return NULL;
}

/* world replicas of cfg, ready to step; pinned as daemon.c's workers_start pins. */
static int world_new(group *g, replica *reps, int world, const td_train_config *base, int threads)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int per = (int)(cores > 0 ? cores : 1) / world;

    td_hostreduce_init(g, world);
    for (int k = 0; k < world; k++) {
        td_train_config cfg = *base;
        td_train_hooks hooks = {.ud = &reps[k], .metric = replica_metric};
        reps[k] = (replica){.g = g, .rank = k, .cores_to = -1};
        if (per > 0 && (long)(k + 1) * per <= cores) {
            reps[k].cores_from = k * per;
            reps[k].cores_to = (k + 1) * per - 1;
        }
        cfg.rank = k;
        cfg.world = world;
        cfg.threads = threads;
        if (world > 1)
            hooks.allreduce = host_allreduce;
        if (trainer_new(&reps[k].t, &cfg, &hooks) != 0)
            return 1;
    }
    return 0;
}

/* Takes steps steps on every replica; returns the wall ms they took and adds the process's
 * CPU ms to *cpu. */
static double world_block(replica *reps, int world, int threads, int64_t steps, int timed,
                          double *cpu)
{
    pthread_t th[MAX_WORLD];
    double t0, c0 = bench_cpu_ms();

    t0 = td_mono_ms();
    for (int k = 0; k < world; k++) {
        reps[k].threads = threads;
        reps[k].block = steps;
        reps[k].timed = timed;
        pthread_create(&th[k], NULL, replica_block, &reps[k]);
    }
    for (int k = 0; k < world; k++)
        pthread_join(th[k], NULL);
    *cpu += bench_cpu_ms() - c0;
    return td_mono_ms() - t0;
}

static void world_free(group *g, replica *reps, int world)
{
    if (g->world == 0)
        return; /* never made */
    for (int k = 0; k < world; k++)
        td_trainer_free(reps[k].t);
    td_hostreduce_destroy(g);
}

static int run_world(const opts *o, int world)
{
    int64_t steps = o->steps > 0 ? o->steps : WORLD_STEPS;
    int block = o->block > 0 ? o->block : WORLD_BLOCK;
    int64_t nblocks = (steps + block - 1) / block;
    int threads[2] = {o->threads, o->threads / world > 0 ? o->threads / world : 1};
    int worlds[2] = {1, world};
    replica reps[2][MAX_WORLD] = {0};
    group g[2] = {0};
    double ms[2] = {0}, cpu[2] = {0}, untimed = 0, speedup[MAX_BLOCKS], mean, se;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    td_train_config cfg;
    int rc = 1;

    if (nblocks > MAX_BLOCKS) {
        fprintf(stderr, "bench_gpt: --world: at most %d blocks\n", MAX_BLOCKS);
        return 1;
    }
    gpt_config(&cfg, o, WARMUP_STEPS + nblocks * block);
    if (world_new(&g[0], reps[0], 1, &cfg, threads[0]) != 0 ||
        world_new(&g[1], reps[1], world, &cfg, threads[1]) != 0)
        goto out;
    printf("gpt L=%d B=%d (global batch), %d threads in all: cpu:1 against cpu:%d, "
           "blocks of %d steps in turn\n",
           o->layers, o->batch, o->threads, world, block);
    for (int w = 0; w < 2; w++)
        world_block(reps[w], worlds[w], threads[w], WARMUP_STEPS, 0, &untimed);
    for (int64_t b = 0; b < nblocks; b++) {
        double pair[2];
        for (int i = 0; i < 2; i++) {
            int w = (int)((b + i) % 2); /* 1 W, W 1, 1 W, ... */
            pair[w] = world_block(reps[w], worlds[w], threads[w], block, 1, &cpu[w]);
            ms[w] += pair[w];
        }
        speedup[b] = pair[0] / pair[1];
    }
    for (int w = 0; w < 2; w++) {
        double per_step = ms[w] / (double)(nblocks * block);
        printf("  cpu:%d (%d replica%s x %d BLAS thread%s): %.1f ms/step, %.0f tokens/s", worlds[w],
               worlds[w], worlds[w] > 1 ? "s" : "", threads[w], threads[w] > 1 ? "s" : "", per_step,
               (double)o->batch * cfg.seq_len / (per_step / 1e3));
        /* Below the cores there are, the rest went to other processes or to waiting. */
        printf("; %.2f of %ld cores busy", cpu[w] / ms[w], cores);
        if (worlds[w] > 1) {
            double red = reps[w][0].reduce_ms / (double)(nblocks * block);
            double avg = reps[w][0].average_ms / (double)(nblocks * block);
            printf("\n    all-reduce %.1f ms/step (%.1f%% of the step): averaging %.1f ms, "
                   "waiting at its barriers %.1f ms",
                   red, 100.0 * red / per_step, avg, red - avg);
        }
        printf("\n");
    }
    mean_se(speedup, (int)nblocks, &mean, &se);
    printf("  cpu:%d / cpu:1 tokens/s: %.2f; over %lld block pairs %.2f +- %.2f (mean +- "
           "standard error)\n",
           world, ms[0] / ms[1], (long long)nblocks, mean, se);
    printf("  loss after %lld steps: cpu:1 %.6f, cpu:%d %.6f\n",
           (long long)(WARMUP_STEPS + nblocks * block), reps[0][0].loss, world, reps[1][0].loss);
    rc = 0;
out:
    world_free(&g[0], reps[0], 1);
    world_free(&g[1], reps[1], world);
    return rc;
}

/* ---- main ---- */

/* A text file of GEN_BYTES pseudo-random words, for machines without the fortunes. */
static int generate_text(char *path)
{
    static const char *words[] = {"the", "a",  "of",  "and", "to", "in",  "is", "you", "that",
                                  "it",  "he", "was", "for", "on", "are", "as", "with"};
    uint64_t s = 1;
    size_t n = 0;
    int fd = mkstemp(path);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;

    if (f == NULL)
        return -1;
    while (n < GEN_BYTES) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        n += (size_t)fprintf(f, "%s ", words[(s >> 33) % 17]);
    }
    return fclose(f);
}

int main(int argc, char **argv)
{
    opts o = {.threads = 2, .batch = 8, .layers = 4};
    char gen[] = "/tmp/bench_gpt_XXXXXX";
    int world = 0, metrics = 0, rc;

    o.data = access("/usr/share/games/fortunes", R_OK) == 0 ? FORTUNES : NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            o.threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--data") == 0 && i + 1 < argc)
            o.data = argv[++i];
        else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            o.batch = atoi(argv[++i]);
        else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc)
            o.layers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--block") == 0 && i + 1 < argc)
            o.block = atoi(argv[++i]);
        else if (strcmp(argv[i], "--world") == 0 && i + 1 < argc)
            world = atoi(argv[++i]);
        else if (strcmp(argv[i], "--metrics") == 0)
            metrics = 1;
        else if (argv[i][0] != '-' && atoll(argv[i]) > 0)
            o.steps = atoll(argv[i]);
        else {
            fprintf(stderr, "usage: bench_gpt [STEPS] [--metrics | --world W] [--threads T] "
                            "[--data PATTERN] [--batch B] [--layers L] [--block N]\n");
            return 64;
        }
    }
    if (o.threads < 1 || o.batch < 1 || o.layers < 1 || o.block < 0 ||
        (world != 0 && (world < 2 || world > MAX_WORLD || world > o.batch)) ||
        (world != 0 && metrics)) {
        fprintf(stderr,
                "bench_gpt: bad arguments (--world: 2 to %d, at most the batch; not "
                "with --metrics)\n",
                MAX_WORLD);
        return 64;
    }
    if (o.data == NULL) {
        if (generate_text(gen) != 0) {
            perror("bench_gpt: generating text");
            return 1;
        }
        o.data = gen;
    }
    if (metrics)
        rc = run_metrics(&o);
    else if (world != 0)
        rc = run_world(&o, world);
    else
        rc = run_headline(&o);
    if (o.data == gen)
        unlink(gen);
    return rc;
}
