/* bench_metrics: the metric pipeline's throughput next to SQLite's own, in one run.
 *
 * Pushes ROWS samples from P producer threads (one job each, KEYS keys per step) through the
 * daemon's real queue and store thread (daemon/metricq.c, store/), and inserts the same number
 * of rows into the same schema with one raw prepared statement, RAW_BATCH rows per
 * transaction, in the order the producers' rows reach the queue (step by step, job after
 * job). The raw insert runs twice: with SQLite's default connection settings (foreign keys
 * not enforced), the fastest plain way to store these rows and the figure the goal is
 * measured against, and with the store's own settings (foreign_keys=ON, its page cache), which
 * tells how much of any gap is the enforcement of the schema's foreign keys rather than the
 * pipeline. The three alternate for ROUNDS rounds, each on new jobs and in a rotated order,
 * so that whatever else the machine is doing and the growth of the database fall on all of
 * them alike; the median round of each is printed, in rows/s of wall time (the goal) and of
 * CPU time (the process's, all threads; steadier on a busy machine). Figures only.
 *
 * usage: bench_metrics [ROWS] [PRODUCERS] [ROUNDS]   (defaults 1000000, 4, 3) */
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/metricq.h"
#include "store/store.h"
#include "common/td_clock.h"

#define KEYS          8    /* metric names per step, as a training step records */
#define RAW_BATCH     4096 /* rows per raw transaction: TD_MQ_BATCH, the store thread's most */
#define MAX_PRODUCERS 64
#define MAX_ROUNDS    15
/* The page cache store/store.c gives its connections, copied here because it is private. */
#define STORE_CACHE_KIB 32768 /* KiB */

static const char *const key_names[KEYS] = {"train_loss",   "lr",         "grad_norm", "step_ms",
                                            "tokens_per_s", "valid_loss", "epoch",     "mfu"};

enum { PIPELINE, RAW_DEFAULTS, RAW_STORE, PHASES };

static const char *const phase_names[PHASES] = {
    "pipeline (queue + store thread + summary)",
    "raw INSERT, SQLite's defaults (no FK checks)",
    "raw INSERT, the store's settings (FK checks)",
};

typedef struct timing {
    double wall_s, cpu_s;
} timing;

static double clock_s(clockid_t clock)
{
    return td_clock_ms(clock) / 1e3;
}

static timing timing_start(void)
{
    return (timing){clock_s(CLOCK_MONOTONIC), clock_s(CLOCK_PROCESS_CPUTIME_ID)};
}

static timing timing_since(timing t0)
{
    return (timing){clock_s(CLOCK_MONOTONIC) - t0.wall_s,
                    clock_s(CLOCK_PROCESS_CPUTIME_ID) - t0.cpu_s};
}

typedef struct producer {
    td_mq *q;
    int64_t job;
    long rows;
} producer;

static void *produce(void *arg)
{
    producer *p = arg;
    td_mq_sink *s;
    td_error_t err;

    if (td_mq_sink_open(p->q, p->job, NULL, &s) != 0)
        return NULL;
    for (long i = 0; i < p->rows; i++)
        if (td_mq_push(s, key_names[i % KEYS], i / KEYS + 1, (double)i * 1e-3, &err) != 0)
            fprintf(stderr, "job %lld: %s\n", (long long)p->job, err.msg);
    if (td_mq_flush(s, &err) != 0)
        fprintf(stderr, "job %lld: %s\n", (long long)p->job, err.msg);
    td_mq_sink_close(s);
    return NULL;
}

/* rows / np samples from each of np threads through the queue; ends once all are durable. */
static timing run_pipeline(const char *db, const int64_t *jobs, int np, long rows)
{
    producer ps[MAX_PRODUCERS];
    pthread_t th[MAX_PRODUCERS];
    td_mq *q;
    td_error_t err;
    timing t0;

    if (td_mq_start(&q, db, 0, NULL, NULL, &err) != 0) {
        fprintf(stderr, "bench_metrics: pipeline: %s\n", err.msg);
        exit(1);
    }
    t0 = timing_start();
    for (int i = 0; i < np; i++) {
        ps[i] = (producer){.q = q, .job = jobs[i], .rows = rows / np};
        pthread_create(&th[i], NULL, produce, &ps[i]);
    }
    for (int i = 0; i < np; i++)
        pthread_join(th[i], NULL);
    td_mq_stop(q);
    return timing_since(t0);
}

static void raw_exec(sqlite3 *h, const char *sql)
{
    if (sqlite3_exec(h, sql, NULL, NULL, NULL) != SQLITE_OK) {
        fprintf(stderr, "bench_metrics: raw: %s: %s\n", sql, sqlite3_errmsg(h));
        exit(1);
    }
}

/* The same rows through one prepared INSERT, RAW_BATCH rows per transaction: each job's
 * steps in turn (one job's KEYS keys of step s, the next job's, ...), as np producers that
 * keep pace with each other fill the queue. store_settings: the store's pragmas. */
static timing run_raw(const char *db, const int64_t *jobs, int np, long rows, int store_settings)
{
    sqlite3 *h;
    sqlite3_stmt *st;
    int key_ids[KEYS];
    long per = rows / np;
    char sql[128];
    timing t0;

    if (sqlite3_open(db, &h) != SQLITE_OK) {
        fprintf(stderr, "bench_metrics: raw: cannot open %s\n", db);
        exit(1);
    }
    raw_exec(h, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL");
    if (store_settings) {
        snprintf(sql, sizeof(sql), "PRAGMA foreign_keys=ON; PRAGMA cache_size=-%d",
                 STORE_CACHE_KIB);
        raw_exec(h, sql);
    }
    for (int k = 0; k < KEYS; k++) {
        snprintf(sql, sizeof(sql), "INSERT OR IGNORE INTO metric_keys(name) VALUES ('raw_%s')",
                 key_names[k]);
        raw_exec(h, sql);
        snprintf(sql, sizeof(sql), "SELECT id FROM metric_keys WHERE name = 'raw_%s'",
                 key_names[k]);
        sqlite3_prepare_v2(h, sql, -1, &st, NULL);
        sqlite3_step(st);
        key_ids[k] = sqlite3_column_int(st, 0);
        sqlite3_finalize(st);
    }
    /* The store's own statement form: with foreign keys on, INSERT OR REPLACE takes about 30%
     * longer than an upsert, so the raw writer is given the faster of the two. */
    sqlite3_prepare_v2(h,
                       "INSERT INTO metrics(job, key, step, value, time) "
                       "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (job, key, step) DO UPDATE "
                       "SET value = excluded.value, time = excluded.time",
                       -1, &st, NULL);
    t0 = timing_start();
    for (long i = 0; i < per * np; i++) {
        long step_row = i / KEYS; /* the i-th group of KEYS rows */
        long j = (step_row / np) * KEYS + i % KEYS;
        if (i % RAW_BATCH == 0)
            raw_exec(h, "BEGIN IMMEDIATE");
        sqlite3_bind_int64(st, 1, jobs[step_row % np]);
        sqlite3_bind_int(st, 2, key_ids[j % KEYS]);
        sqlite3_bind_int64(st, 3, j / KEYS + 1);
        sqlite3_bind_double(st, 4, (double)j * 1e-3);
        sqlite3_bind_double(st, 5, clock_s(CLOCK_REALTIME));
        if (sqlite3_step(st) != SQLITE_DONE) {
            fprintf(stderr, "bench_metrics: raw insert: %s\n", sqlite3_errmsg(h));
            exit(1);
        }
        sqlite3_reset(st);
        if (i % RAW_BATCH == RAW_BATCH - 1 || i == per * np - 1)
            raw_exec(h, "COMMIT");
    }
    timing t = timing_since(t0);
    sqlite3_finalize(st);
    sqlite3_close(h);
    return t;
}

/* np new jobs to write rows for. */
static void new_jobs(const char *db, int np, int64_t *jobs)
{
    td_store *s;
    td_error_t err;

    if (td_store_open(&s, db, &err) != 0) {
        fprintf(stderr, "bench_metrics: %s\n", err.msg);
        exit(1);
    }
    for (int i = 0; i < np; i++)
        if (td_store_job_insert(s, "bench", 1, 0, 0, "\x80", 1, "{}", &jobs[i], &err) != 0) {
            fprintf(stderr, "bench_metrics: %s\n", err.msg);
            exit(1);
        }
    td_store_close(s);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv)
{
    long rows = argc > 1 ? atol(argv[1]) : 1000000;
    int np = argc > 2 ? atoi(argv[2]) : 4;
    int rounds = argc > 3 ? atoi(argv[3]) : 3;
    char dir[] = "/tmp/bench_metrics.XXXXXX", db[64], cmd[96];
    double wall[PHASES][MAX_ROUNDS], cpu[PHASES][MAX_ROUNDS], med_wall[PHASES], med_cpu[PHASES];
    int64_t jobs[MAX_PRODUCERS];

    if (np < 1 || np > MAX_PRODUCERS || rows < np * KEYS || rounds < 1 || rounds > MAX_ROUNDS ||
        mkdtemp(dir) == NULL) {
        fprintf(stderr, "usage: bench_metrics [ROWS] [PRODUCERS 1-%d] [ROUNDS 1-%d]\n",
                MAX_PRODUCERS, MAX_ROUNDS);
        return 64;
    }
    rows = rows / np * np;
    snprintf(db, sizeof(db), "%s/traind.db", dir);
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < PHASES; k++) {
            int phase = (r + k) % PHASES;
            timing t;
            new_jobs(db, np, jobs);
            if (phase == PIPELINE)
                t = run_pipeline(db, jobs, np, rows);
            else
                t = run_raw(db, jobs, np, rows, phase == RAW_STORE);
            wall[phase][r] = rows / t.wall_s;
            cpu[phase][r] = rows / t.cpu_s;
        }
    printf("metric rows: %ld per round from %d producer threads, %d keys per step; "
           "median of %d rounds\n",
           rows, np, KEYS, rounds);
    printf("  %-46s %12s %12s\n", "", "rows/s wall", "rows/s CPU");
    for (int k = 0; k < PHASES; k++) {
        med_wall[k] = median(wall[k], rounds);
        med_cpu[k] = median(cpu[k], rounds);
        printf("  %-46s %12.0f %12.0f\n", phase_names[k], med_wall[k], med_cpu[k]);
    }
    printf("  pipeline / raw (SQLite's defaults): %.2f wall, %.2f CPU (goal >= 0.80)\n",
           med_wall[PIPELINE] / med_wall[RAW_DEFAULTS], med_cpu[PIPELINE] / med_cpu[RAW_DEFAULTS]);
    printf("  pipeline / raw (the store's settings): %.2f wall, %.2f CPU\n",
           med_wall[PIPELINE] / med_wall[RAW_STORE], med_cpu[PIPELINE] / med_cpu[RAW_STORE]);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : 1;
}
