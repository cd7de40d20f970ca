/* bench_gpt: trains the reference GPT (L=4, C=256, NH=4, T=256, B=8, V=256: byte-level text,
 * AdamW, 2 BLAS threads) for a fixed number of steps through train.h and prints figures: ms
 * per step, tokens/s, the GFLOP/s the step achieves counting nanoGPT's estimate (6 x the
 * non-embedding parameters x tokens, plus 12 L C T per token for attention, whose causal half
 * we do not compute but count, as everyone does), and, in the same run, what this machine's
 * cblas_sgemm does alone on the step's matmul shapes. Prints figures only, no pass/fail.
 *
 *   bench_gpt [STEPS]   train STEPS steps (default 20; the first WARMUP_STEPS are not timed)
 *   options: --threads T (BLAS threads; default 2), --data PATTERN (text files; default the
 *            fortunes, else a generated text), --batch B, --layers L,
 *            --world W: W data-parallel replicas in threads (as the daemon's cpu:W devices),
 *            each with T/W BLAS threads and a host all-reduce; prints the share of the step
 *            spent in the all-reduce (waiting for the slower replica included) */
#include <cblas.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "train.h"

#define DEFAULT_STEPS 20
#define WARMUP_STEPS  3  /* steps left out of the timing: first-touch page faults, BLAS start */
#define SGEMM_REPS    10 /* calls per shape when timing sgemm alone */
#define FORTUNES      "/usr/share/games/fortunes/*"
#define GEN_BYTES     (4 << 20) /* bytes of generated text when there are no fortunes */
#define MAX_WORLD     8

typedef struct stats {
    int64_t steps;  /* timed steps */
    double ms;      /* their step_ms summed */
    double min_ms;  /* the fastest */
    double last_ms; /* step_ms of the step being reported */
    double loss0, loss;
} stats;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void on_metric(void *ud, const char *key, int64_t step, double value)
{
    stats *s = ud;

    if (strcmp(key, "step_ms") == 0 && step > WARMUP_STEPS) {
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

/* The host all-reduce of the --world replicas: each copies its buffer into its slot; after a
 * barrier each sums a disjoint chunk of every slot in rank order (the same bits everywhere)
 * into the result; after another, each copies the result back. */
typedef struct reduce_group {
    pthread_barrier_t barrier;
    int world;
    float *slot[MAX_WORLD];
    float *result;
} reduce_group;

typedef struct replica {
    reduce_group *g;
    int rank;
    td_train_config cfg;
    stats s;
    double reduce_ms; /* in the all-reduce, timed steps only */
    int64_t step;
    int rc;
    td_error_t err;
} replica;

static void host_allreduce(void *ud, float *buf, size_t n)
{
    replica *me = ud;
    reduce_group *g = me->g;
    size_t lo = n * (size_t)me->rank / (size_t)g->world;
    size_t hi = n * (size_t)(me->rank + 1) / (size_t)g->world;
    double t0 = now_ms();

    memcpy(g->slot[me->rank], buf, n * sizeof(float));
    pthread_barrier_wait(&g->barrier);
    for (size_t i = lo; i < hi; i++) {
        float sum = 0.0f;
        for (int k = 0; k < g->world; k++)
            sum += g->slot[k][i];
        g->result[i] = sum / (float)g->world;
    }
    pthread_barrier_wait(&g->barrier);
    memcpy(buf, g->result, n * sizeof(float));
    pthread_barrier_wait(&g->barrier); /* nobody refills a slot before all have read */
    if (me->step > WARMUP_STEPS)
        me->reduce_ms += now_ms() - t0;
}

static void replica_metric(void *ud, const char *key, int64_t step, double value)
{
    replica *me = ud;

    me->step = step + 1;
    on_metric(&me->s, key, step, value);
}

static void *replica_main(void *arg)
{
    replica *me = arg;
    td_train_hooks hooks = {.ud = me, .metric = replica_metric, .allreduce = host_allreduce};
    td_trainer *t = NULL;

    me->step = 1;
    me->rc = td_trainer_new(&t, &me->cfg, &hooks, &me->err);
    while (me->rc == 0 && td_trainer_step(t) == 0)
        me->step = td_trainer_steps_done(t) + 1;
    td_trainer_free(t);
    return NULL;
}

/* Runs cfg as world replicas; prints tokens/s and the all-reduce's share of the step. */
static int run_world(const td_train_config *cfg, int world, double flops)
{
    reduce_group g = {.world = world};
    static replica reps[MAX_WORLD];
    pthread_t th[MAX_WORLD];
    size_t room = 64u << 20; /* floats: a slot holds any gradient buffer of this bench */
    double ms;
    int rc = 0;

    pthread_barrier_init(&g.barrier, NULL, (unsigned)world);
    g.result = malloc(room * sizeof(float));
    for (int k = 0; k < world; k++) {
        reps[k] = (replica){.g = &g, .rank = k, .cfg = *cfg};
        reps[k].cfg.rank = k;
        reps[k].cfg.world = world;
        g.slot[k] = malloc(room * sizeof(float));
    }
    for (int k = 0; k < world; k++)
        pthread_create(&th[k], NULL, replica_main, &reps[k]);
    for (int k = 0; k < world; k++) {
        pthread_join(th[k], NULL);
        if (reps[k].rc != 0) {
            fprintf(stderr, "bench_gpt: replica %d: %s: %s\n", k, td_errname(reps[k].rc),
                    reps[k].err.msg);
            rc = 1;
        }
        free(g.slot[k]);
    }
    free(g.result);
    pthread_barrier_destroy(&g.barrier);
    if (rc != 0)
        return rc;
    ms = reps[0].s.ms / reps[0].s.steps;
    printf("\n%d replicas (cpu:%d), BLAS threads %d each, loss %.3f -> %.3f:\n", world, world,
           cfg->threads, reps[0].s.loss0, reps[0].s.loss);
    printf("  %.1f ms/step, %.0f tokens/s, %.1f GFLOP/s; all-reduce %.1f ms/step (%.1f%%)\n", ms,
           (double)cfg->batch_size * cfg->seq_len / (ms / 1e3), flops / (ms * 1e6),
           reps[0].reduce_ms / reps[0].s.steps, 100.0 * reps[0].reduce_ms / reps[0].s.ms);
    return 0;
}

/* Times SGEMM_REPS calls of one row-major sgemm (beta 1, as the backward's are); ms per call. */
static double time_sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K,
                         const float *A, const float *B, float *C)
{
    int lda = ta == CblasNoTrans ? K : M;
    int ldb = tb == CblasNoTrans ? N : K;
    double t0;

    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, N);
    t0 = now_ms();
    for (int r = 0; r < SGEMM_REPS; r++)
        cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, N);
    return (now_ms() - t0) / SGEMM_REPS;
}

/* The step's linear layers (qkv, attproj, fc, fcproj, lm head) as kernels/cpu.c calls sgemm:
 * forward, dinp, dweight. Returns GFLOP/s over all of them, weighted by how often a step
 * makes each call. */
static double bench_sgemm(int BT, int C, int Vp, int L)
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

    for (size_t i = 0; i < big; i++) {
        A[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
        B[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
        Cm[i] = 0.0f;
    }
    printf("\ncblas_sgemm alone on the step's linear layers (%d calls each):\n", SGEMM_REPS);
    printf("  %-8s %-8s %5s %5s %5s  %8s %8s\n", "layer", "call", "M", "N", "K", "ms/call",
           "GFLOP/s");
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
            double ms =
                time_sgemm(calls[i].ta, calls[i].tb, calls[i].M, calls[i].N, calls[i].K, A, B, Cm);
            double f = 2.0 * calls[i].M * calls[i].N * calls[i].K;
            printf("  %-8s %-8s %5d %5d %5d  %8.3f %8.1f\n", layers[l].name, calls[i].name,
                   calls[i].M, calls[i].N, calls[i].K, ms, f / (ms * 1e6));
            total_ms += ms * layers[l].count;
            total_flops += f * layers[l].count;
        }
    }
    printf("  all of a step's linear-layer sgemms: %.1f ms, %.1f GFLOP/s\n", total_ms,
           total_flops / (total_ms * 1e6));
    free(A);
    free(B);
    free(Cm);
    return total_flops / (total_ms * 1e6);
}

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
    const char *data = access("/usr/share/games/fortunes", R_OK) == 0 ? FORTUNES : NULL;
    char gen[] = "/tmp/bench_gpt_XXXXXX";
    int64_t steps = DEFAULT_STEPS;
    int threads = 2, batch = 8, layers = 4, world = 1, rc;
    td_train_config cfg;
    td_trainer *t = NULL;
    td_error_t err = {0};
    stats s = {0};
    td_train_hooks hooks = {.ud = &s, .metric = on_metric};
    double t0, wall, n_params, flops, sgemm_gflops;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--data") == 0 && i + 1 < argc)
            data = argv[++i];
        else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
            batch = atoi(argv[++i]);
        else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc)
            layers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--world") == 0 && i + 1 < argc)
            world = atoi(argv[++i]);
        else
            steps = atoll(argv[i]);
    }
    if (data == NULL) {
        if (generate_text(gen) != 0) {
            perror("bench_gpt: generating text");
            return 1;
        }
        data = gen;
    }

    td_train_config_defaults(&cfg);
    cfg.model = TD_MODEL_GPT;
    cfg.data = TD_DATA_TEXT;
    cfg.n_layer = layers;
    cfg.n_head = 4;
    cfg.n_embd = 256;
    cfg.seq_len = 256;
    cfg.vocab_size = 256;
    snprintf(cfg.train_files[0], TD_PATH_MAX, "%s", data);
    cfg.n_train_files = 1;
    cfg.batch_size = batch;
    cfg.lr = 3e-4f;
    cfg.beta2 = 0.95f;
    cfg.weight_decay = 0.1f;
    cfg.grad_clip = 1.0f;
    cfg.max_steps = steps > WARMUP_STEPS ? steps : WARMUP_STEPS + 1;
    cfg.threads = threads;

    if (world < 1 || world > MAX_WORLD || world > batch) {
        fprintf(stderr, "bench_gpt: --world %d: 1 to %d, at most the batch\n", world, MAX_WORLD);
        return 1;
    }
    if (world > 1) {
        cfg.threads = threads / world > 0 ? threads / world : 1;
        flops = 0;
        {
            td_gpt_dims d = {.maxT = 256, .V = 256, .Vp = 256, .L = layers, .NH = 4, .C = 256};
            n_params = (double)td_gpt_num_params(&d);
            flops = (6.0 * (n_params - 256.0 * 256) + 12.0 * layers * 256 * 256) * batch * 256;
        }
        rc = run_world(&cfg, world, flops);
        if (data == gen)
            unlink(gen);
        return rc;
    }
    t0 = now_ms();
    rc = td_trainer_new(&t, &cfg, &hooks, &err);
    if (rc != 0) {
        fprintf(stderr, "bench_gpt: %s: %s\n", td_errname(rc), err.msg);
        return 1;
    }
    {
        td_gpt_dims d = {.maxT = 256, .V = 256, .Vp = 256, .L = layers, .NH = 4, .C = 256};
        double tokens = (double)batch * cfg.seq_len;
        n_params = (double)td_gpt_num_params(&d);
        /* nanoGPT's estimate_mfu: 6 N per token with N without the position embedding, plus
         * attention's 12 L C T per token */
        flops =
            (6.0 * (n_params - (double)d.maxT * d.C) + 12.0 * layers * d.C * cfg.seq_len) * tokens;
    }
    printf("gpt L=%d C=256 NH=4 T=256 B=%d V=256 (%.2fM parameters), adamw, BLAS threads %d\n",
           layers, batch, n_params / 1e6, openblas_get_num_threads());
    printf("data %s; trainer build %.0f ms; %.2f GFLOP a step (nanoGPT's count)\n", data,
           now_ms() - t0, flops / 1e9);

    t0 = now_ms();
    while (td_trainer_step(t) == 0)
        ;
    wall = now_ms() - t0;
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
           s.min_ms, (double)batch * cfg.seq_len / (s.ms / s.steps / 1e3),
           flops / (s.ms / s.steps * 1e6));
    printf("  wall time of the whole loop: %.2f s\n", wall / 1e3);

    sgemm_gflops = bench_sgemm(batch * cfg.seq_len, 256, 256, layers);
    printf("\nachieved / sgemm: %.2f (goal >= 0.5); PyTorch 1.13 on this config: ~800 ms/step\n",
           flops / (s.ms / s.steps * 1e6) / sgemm_gflops);
    if (data == gen)
        unlink(gen);
    return 0;
}
