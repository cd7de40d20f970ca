/* bench_metrics: the metric pipeline's throughput next to SQLite's own, in one run.
 *
 * Pushes ROWS samples from P producer threads (one job each, K keys per step) through the
 * daemon's real queue and store thread (daemon/metricq.c, store/), then inserts the same
 * number of rows into the same schema with a raw prepared statement in batched transactions,
 * and prints rows/s for both and their ratio. Figures only; no pass/fail.
 *
 * usage: bench_metrics [ROWS] [PRODUCERS]   (defaults 1000000, 4) */
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "metricq.h"
#include "store.h"

#define KEYS 8         /* metric names per step, as a training step records */
#define RAW_BATCH 4096 /* rows per raw transaction, the store thread's batch size */

static const char *const key_names[KEYS] = {"train_loss", "lr",        "grad_norm", "step_ms",
                                            "tokens_per_s", "valid_loss", "epoch",   "mfu"};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
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

    if (td_mq_sink_open(p->q, p->job, &s) != 0)
        return NULL;
    for (long i = 0; i < p->rows; i++)
        td_mq_push(s, key_names[i % KEYS], i / KEYS + 1, (double)i * 1e-3, &err);
    if (td_mq_flush(s, &err) != 0)
        fprintf(stderr, "job %lld: %s\n", (long long)p->job, err.msg);
    td_mq_sink_close(s);
    return NULL;
}

static double run_pipeline(const char *db, const int64_t *jobs, int np, long rows)
{
    producer ps[64];
    pthread_t th[64];
    td_mq *q;
    td_error_t err;
    double t0;

    if (td_mq_start(&q, db, 0, NULL, NULL, &err) != 0) {
        fprintf(stderr, "pipeline: %s\n", err.msg);
        exit(1);
    }
    t0 = now_s();
    for (int i = 0; i < np; i++) {
        ps[i] = (producer){.q = q, .job = jobs[i], .rows = rows / np};
        pthread_create(&th[i], NULL, produce, &ps[i]);
    }
    for (int i = 0; i < np; i++)
        pthread_join(th[i], NULL);
    td_mq_stop(q);
    return now_s() - t0;
}

/* The same rows through one prepared INSERT, RAW_BATCH rows per transaction. */
static double run_raw(const char *db, const int64_t *jobs, int np, long rows)
{
    sqlite3 *h;
    sqlite3_stmt *st;
    int key_ids[KEYS];
    double t0;

    if (sqlite3_open(db, &h) != SQLITE_OK)
        exit(1);
    sqlite3_exec(h, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL", NULL, NULL, NULL);
    for (int k = 0; k < KEYS; k++) {
        char sql[128];
        snprintf(sql, sizeof(sql), "INSERT OR IGNORE INTO metric_keys(name) VALUES ('raw_%s')",
                 key_names[k]);
        sqlite3_exec(h, sql, NULL, NULL, NULL);
        snprintf(sql, sizeof(sql), "SELECT id FROM metric_keys WHERE name = 'raw_%s'",
                 key_names[k]);
        sqlite3_prepare_v2(h, sql, -1, &st, NULL);
        sqlite3_step(st);
        key_ids[k] = sqlite3_column_int(st, 0);
        sqlite3_finalize(st);
    }
    sqlite3_prepare_v2(h,
                       "INSERT OR REPLACE INTO metrics(job, key, step, value, time) "
                       "VALUES (?1, ?2, ?3, ?4, ?5)",
                       -1, &st, NULL);
    t0 = now_s();
    for (long i = 0; i < rows; i++) {
        long per = rows / np;
        if (i % RAW_BATCH == 0)
            sqlite3_exec(h, "BEGIN IMMEDIATE", NULL, NULL, NULL);
        sqlite3_bind_int64(st, 1, jobs[(i / per) % np]);
        sqlite3_bind_int(st, 2, key_ids[i % KEYS]);
        sqlite3_bind_int64(st, 3, (i % per) / KEYS + 1);
        sqlite3_bind_double(st, 4, (double)i * 1e-3);
        sqlite3_bind_double(st, 5, 1.7e9);
        if (sqlite3_step(st) != SQLITE_DONE) {
            fprintf(stderr, "raw insert: %s\n", sqlite3_errmsg(h));
            exit(1);
        }
        sqlite3_reset(st);
        if (i % RAW_BATCH == RAW_BATCH - 1 || i == rows - 1)
            sqlite3_exec(h, "COMMIT", NULL, NULL, NULL);
    }
    double t = now_s() - t0;
    sqlite3_finalize(st);
    sqlite3_close(h);
    return t;
}

int main(int argc, char **argv)
{
    long rows = argc > 1 ? atol(argv[1]) : 1000000;
    int np = argc > 2 ? atoi(argv[2]) : 4;
    char dir[] = "/tmp/bench_metrics.XXXXXX", db[64], cmd[96];
    int64_t jobs_pipe[64], jobs_raw[64];
    td_store *s;
    td_error_t err;
    double tp, tr;

    if (np < 1 || np > 64 || rows < np * KEYS || mkdtemp(dir) == NULL) {
        fprintf(stderr, "usage: bench_metrics [ROWS] [PRODUCERS 1-64]\n");
        return 64;
    }
    snprintf(db, sizeof(db), "%s/traind.db", dir);
    if (td_store_open(&s, db, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    for (int i = 0; i < np; i++) {
        td_store_job_insert(s, "pipe", 1, 0, 0, "\x80", 1, "{}", &jobs_pipe[i], &err);
        td_store_job_insert(s, "raw", 1, 0, 0, "\x80", 1, "{}", &jobs_raw[i], &err);
    }
    td_store_close(s);

    tp = run_pipeline(db, jobs_pipe, np, rows);
    tr = run_raw(db, jobs_raw, np, rows);
    printf("metric rows: %ld from %d producer threads, %d keys per step\n", rows, np, KEYS);
    printf("pipeline (queue + store thread + summary): %10.0f rows/s  (%.2f s)\n", rows / tp, tp);
    printf("raw prepared INSERT, %d rows/transaction: %10.0f rows/s  (%.2f s)\n", RAW_BATCH,
           rows / tr, tr);
    printf("pipeline / raw: %.2f\n", tr / tp);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : 1;
}
