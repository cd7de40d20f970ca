/* The metric queue and the store thread (see metricq.h). One mutex guards the ring, the sinks'
 * counters and their pending errors; the store thread holds it only to take a batch and to
 * account for one, never while SQLite works. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "metricq.h"
#include "td_clock.h"

typedef struct mq_event {
    td_metric m;
    td_mq_sink *sink;
} mq_event;

struct td_mq_sink {
    td_mq *q;
    int64_t job;
    uint64_t pushed;    /* samples queued; guarded by q->mu */
    uint64_t done;      /* samples written or failed; guarded by q->mu */
    td_error_t err;     /* errors not yet reported, merged; guarded by q->mu */
    uint64_t err_batch; /* batch number of the last error attached, so one batch counts once */
    double blocked_ms;
};

struct td_mq {
    pthread_mutex_t mu;
    pthread_cond_t not_empty, not_full, progress;
    mq_event *ring;
    size_t cap, head, count;
    int stopping;
    int killed;       /* td_mq_kill asked the thread to die */
    int exited;       /* the store thread has returned */
    td_error_t death; /* code != 0 once the store thread has died */
    uint64_t batches;
    pthread_t thread;
    td_store *store;
    td_mq_durable_cb cb;
    void *ud;
    mq_event *batch; /* the store thread's copy of the batch it writes */
    td_metric *rows;
};

/* Appends e to a sink's pending errors: the first code wins, messages join in order. */
static void sink_add_error(td_mq_sink *s, const td_error_t *e)
{
    size_t len = strlen(s->err.msg);

    if (s->err.code == 0) {
        s->err = *e;
        return;
    }
    snprintf(s->err.msg + len, sizeof(s->err.msg) - len, "; %s", e->msg);
}

/* Hands a sink's pending errors to the caller and clears them. Called with q->mu held. */
static int sink_take_error(td_mq_sink *s, td_error_t *err)
{
    int code = s->err.code;

    if (code != 0) {
        if (err != NULL)
            *err = s->err;
        td_error_clear(&s->err);
    }
    return code;
}

/* Reports the cause of the store thread's death. Called with q->mu held. */
static int mq_dead(td_mq *q, td_error_t *err)
{
    if (q->death.code == 0)
        return td_error_set(err, TD_ESTORE, "metric store thread has stopped");
    return td_error_set(err, q->death.code, "metric store thread died: %s", q->death.msg);
}

/* Tells the daemon, per job in the batch, the highest step now durable. */
static void notify_durable(td_mq *q, const mq_event *b, size_t n)
{
    int64_t jobs[8], steps[8];
    size_t njobs = 0;

    for (size_t i = 0; i < n; i++) {
        size_t j = 0;
        while (j < njobs && jobs[j] != b[i].m.job)
            j++;
        if (j == njobs) {
            if (njobs == 8) {
                q->cb(q->ud, jobs[0], steps[0]);
                memmove(jobs, jobs + 1, 7 * sizeof(*jobs));
                memmove(steps, steps + 1, 7 * sizeof(*steps));
                j = --njobs;
            }
            jobs[j] = b[i].m.job;
            steps[j] = b[i].m.step;
            njobs++;
        } else if (b[i].m.step > steps[j]) {
            steps[j] = b[i].m.step;
        }
    }
    for (size_t j = 0; j < njobs; j++)
        q->cb(q->ud, jobs[j], steps[j]);
}

/* Accounts for samples [from, to) of the batch: done, and rc's error for their sinks. */
static void account(td_mq *q, size_t from, size_t to, int rc, const td_error_t *e,
                    uint64_t batch_no)
{
    for (size_t i = from; i < to; i++) {
        td_mq_sink *s = q->batch[i].sink;
        if (rc != 0 && s->err_batch != batch_no) {
            sink_add_error(s, e);
            s->err_batch = batch_no;
        }
        s->done++;
    }
}

/* A batch that failed is written again one sink at a time, so that one job's bad sample
 * (or its deleted row) does not cost other jobs theirs. Groups samples by sink in place,
 * keeping each sink's order. Called without q->mu; returns with q->mu held. */
static void write_per_sink(td_mq *q, size_t n, uint64_t batch_no)
{
    size_t start = 0;

    for (size_t i = 0; i < n; i++) {
        /* Stable partition: move the samples of batch[start]'s sink to the front. */
        td_mq_sink *s = q->batch[start].sink;
        size_t k = start;
        for (size_t j = start; j < n; j++)
            if (q->batch[j].sink == s) {
                mq_event ev = q->batch[j];
                memmove(&q->batch[k + 1], &q->batch[k], (j - k) * sizeof(*q->batch));
                q->batch[k++] = ev;
            }
        for (size_t j = start; j < k; j++)
            q->rows[j - start] = q->batch[j].m;
        td_error_t e = {0};
        int rc = td_store_metrics_write(q->store, q->rows, k - start, &e);
        if (rc == 0 && q->cb != NULL)
            notify_durable(q, q->batch + start, k - start);
        pthread_mutex_lock(&q->mu);
        account(q, start, k, rc, &e, batch_no);
        pthread_mutex_unlock(&q->mu);
        start = k;
        if (start == n)
            break;
    }
    pthread_mutex_lock(&q->mu);
}

/* Writes one batch and accounts for it. Called with q->mu held; drops it while writing. */
static void write_batch(td_mq *q)
{
    size_t n = q->count < TD_MQ_BATCH ? q->count : TD_MQ_BATCH;
    td_error_t e = {0};
    uint64_t batch_no;
    int rc, one_sink = 1;

    for (size_t i = 0; i < n; i++) {
        q->batch[i] = q->ring[(q->head + i) % q->cap];
        q->rows[i] = q->batch[i].m;
        one_sink &= q->batch[i].sink == q->batch[0].sink;
    }
    q->head = (q->head + n) % q->cap;
    q->count -= n;
    batch_no = ++q->batches;
    pthread_cond_broadcast(&q->not_full);
    pthread_mutex_unlock(&q->mu);

    rc = td_store_metrics_write(q->store, q->rows, n, &e);
    if (rc != 0 && !one_sink) {
        write_per_sink(q, n, batch_no);
    } else {
        if (rc == 0 && q->cb != NULL)
            notify_durable(q, q->batch, n);
        pthread_mutex_lock(&q->mu);
        account(q, 0, n, rc, &e, batch_no);
    }
    pthread_cond_broadcast(&q->progress);
}

static void *store_thread(void *arg)
{
    td_mq *q = arg;

    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (q->count == 0 && !q->stopping && !q->killed)
            pthread_cond_wait(&q->not_empty, &q->mu);
        if (q->killed)
            break;
        if (q->count == 0 && q->stopping)
            break;
        write_batch(q);
    }
    if (q->killed && q->death.code == 0)
        td_error_set(&q->death, TD_ESTORE, "killed");
    q->exited = 1;
    /* Whoever waits must learn of the death rather than hang. */
    pthread_cond_broadcast(&q->not_full);
    pthread_cond_broadcast(&q->progress);
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

int td_mq_start(td_mq **out, const char *db_path, size_t capacity, td_mq_durable_cb cb, void *ud,
                td_error_t *err)
{
    td_mq *q = calloc(1, sizeof(*q));
    int rc = TD_ENOMEM;

    if (q == NULL)
        return td_error_set(err, TD_ENOMEM, "metric queue: out of memory");
    q->cap = capacity ? capacity : TD_MQ_CAPACITY;
    q->cb = cb;
    q->ud = ud;
    q->ring = calloc(q->cap, sizeof(*q->ring));
    q->batch = calloc(TD_MQ_BATCH, sizeof(*q->batch));
    q->rows = calloc(TD_MQ_BATCH, sizeof(*q->rows));
    if (q->ring == NULL || q->batch == NULL || q->rows == NULL) {
        td_error_set(err, rc, "metric queue: out of memory");
        goto fail_mem;
    }
    rc = td_store_open(&q->store, db_path, err);
    if (rc != 0)
        goto fail_mem;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->not_empty, NULL);
    pthread_cond_init(&q->not_full, NULL);
    pthread_cond_init(&q->progress, NULL);
    rc = pthread_create(&q->thread, NULL, store_thread, q);
    if (rc != 0) {
        td_error_set(err, -rc, "cannot start the store thread: %s", strerror(rc));
        rc = -rc;
        goto fail_thread;
    }
    *out = q;
    return 0;

fail_thread:
    pthread_cond_destroy(&q->progress);
    pthread_cond_destroy(&q->not_full);
    pthread_cond_destroy(&q->not_empty);
    pthread_mutex_destroy(&q->mu);
    td_store_close(q->store);
fail_mem:
    free(q->rows);
    free(q->batch);
    free(q->ring);
    free(q);
    return rc;
}

void td_mq_stop(td_mq *q)
{
    if (q == NULL)
        return;
    pthread_mutex_lock(&q->mu);
    q->stopping = 1;
    pthread_cond_signal(&q->not_empty);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    pthread_cond_destroy(&q->progress);
    pthread_cond_destroy(&q->not_full);
    pthread_cond_destroy(&q->not_empty);
    pthread_mutex_destroy(&q->mu);
    td_store_close(q->store);
    free(q->rows);
    free(q->batch);
    free(q->ring);
    free(q);
}

int td_mq_sink_open(td_mq *q, int64_t job, td_mq_sink **out)
{
    td_mq_sink *s = calloc(1, sizeof(*s));

    if (s == NULL)
        return TD_ENOMEM;
    s->q = q;
    s->job = job;
    *out = s;
    return 0;
}

void td_mq_sink_close(td_mq_sink *s)
{
    if (s == NULL)
        return;
    /* The store thread may still hold pointers to s in its batch: wait them out. */
    td_mq_flush(s, NULL);
    free(s);
}

int td_mq_push(td_mq_sink *s, const char *key, int64_t step, double value, td_error_t *err)
{
    td_mq *q = s->q;
    double t0 = 0;
    mq_event *ev;
    int rc;

    pthread_mutex_lock(&q->mu);
    while (q->count == q->cap && !q->killed && !q->exited) {
        if (t0 == 0)
            t0 = td_mono_ms();
        pthread_cond_wait(&q->not_full, &q->mu);
    }
    if (t0 != 0)
        s->blocked_ms += td_mono_ms() - t0;
    if (q->killed || q->exited) {
        rc = mq_dead(q, err);
        goto out;
    }
    ev = &q->ring[(q->head + q->count) % q->cap];
    ev->sink = s;
    ev->m.job = s->job;
    snprintf(ev->m.key, sizeof(ev->m.key), "%s", key);
    ev->m.step = step;
    ev->m.value = value;
    ev->m.time = td_wall_s();
    q->count++;
    s->pushed++;
    pthread_cond_signal(&q->not_empty);
    rc = sink_take_error(s, err);
out:
    pthread_mutex_unlock(&q->mu);
    return rc;
}

int td_mq_flush(td_mq_sink *s, td_error_t *err)
{
    td_mq *q = s->q;
    int rc;

    pthread_mutex_lock(&q->mu);
    while (s->done < s->pushed && !q->exited)
        pthread_cond_wait(&q->progress, &q->mu);
    rc = sink_take_error(s, err);
    if (rc == 0 && s->done < s->pushed)
        rc = mq_dead(q, err);
    pthread_mutex_unlock(&q->mu);
    return rc;
}

double td_mq_sink_blocked_ms(const td_mq_sink *s)
{
    return s->blocked_ms;
}

void td_mq_kill(td_mq *q, int code, const char *msg)
{
    pthread_mutex_lock(&q->mu);
    q->killed = 1;
    td_error_set(&q->death, code, "%s", msg);
    pthread_cond_signal(&q->not_empty);
    pthread_mutex_unlock(&q->mu);
}
