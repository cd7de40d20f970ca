/* The metric queue and the store thread (see metricq.h). One mutex guards the ring, the sinks'
 * counters, their pending errors and the stall report; the store thread holds it only to take
 * a batch and to account for one, never while SQLite works or while it waits to try again. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/metricq.h"
#include "common/td_clock.h"
#include "common/td_log.h"

/* What the store thread is waiting for, if anything (td_mq_stalled). */
enum { STALL_NONE, STALL_LOCK, STALL_FULL };

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
    td_error_t refused; /* code != 0 once the store gave up on this sink; guarded by q->mu */
    int told;           /* the failure callback has named this sink's job; guarded by q->mu */
    void *ud;           /* for the failure callback */
    td_mq_failed_cb cb; /* the sink's own failure callback (td_mq_sink_open_cb), or NULL */
    void *cb_ud;
    double blocked_ms;
};

struct td_mq {
    pthread_mutex_t mu;
    pthread_cond_t not_empty, not_full, progress;
    pthread_cond_t wake; /* ends a wait before a retry: signalled by td_mq_kill */
    mq_event *ring;
    size_t cap, head, count;
    int stopping;
    int killed;       /* td_mq_kill asked the thread to die */
    int exited;       /* the store thread has returned */
    td_error_t death; /* code != 0 once the store thread has died */
    uint64_t batches;
    uint64_t written;        /* samples written since the start; guarded by mu */
    int ckpt_wanted;         /* td_mq_checkpoint asked for a checkpoint; guarded by mu */
    double blocked_ms_total; /* every push's time blocked on a full queue; guarded by mu */
    pthread_t thread;
    td_store *store;
    td_mq_durable_cb cb;
    void *ud;
    td_mq_failed_cb failed_cb;
    void *failed_ud;
    mq_event *batch; /* the store thread's copy of the batch it writes */
    td_metric *rows;
    /* Waiting for a lock or for room: the store thread's own, except stall, stall_since and
     * stall_msg, which td_mq_stalled reads under mu. */
    double full_wait_ms;  /* how long a full disk is waited out */
    double full_since;    /* monotonic ms the disk was first found full; 0 when it is not */
    int out_of_room;      /* the wait for room ran out: full batches fail at once */
    int stall;            /* STALL_* */
    double stall_since;   /* monotonic ms the current stall began */
    double stall_logged;  /* monotonic ms it was last logged; 0: not yet */
    char stall_msg[600];  /* SQLite's words for it */
    double wal_checked;   /* monotonic ms of the last look at the WAL */
    int wal_warned;       /* the WAL was reported held back and has not recovered since */
    double wal_warned_at; /* monotonic ms of that report */
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

/* Accounts for samples [from, to) of the batch: done, and rc's error for their sinks, whose
 * jobs the failure callback names, once each. With give_up (a full disk waited out), the store
 * also refuses those sinks from now on. Called with q->mu held. */
static void account(td_mq *q, size_t from, size_t to, int rc, const td_error_t *e,
                    uint64_t batch_no, int give_up)
{
    for (size_t i = from; i < to; i++) {
        td_mq_sink *s = q->batch[i].sink;
        if (rc != 0 && s->err_batch != batch_no) {
            sink_add_error(s, e);
            s->err_batch = batch_no;
        }
        if (give_up && s->refused.code == 0)
            s->refused = *e;
        if (rc != 0 && !s->told) {
            s->told = 1;
            if (s->cb != NULL)
                s->cb(s->cb_ud, s->ud, s->job, e);
            else if (q->failed_cb != NULL)
                q->failed_cb(q->failed_ud, s->ud, s->job, e);
        }
        q->written += rc == 0;
        s->done++;
    }
}

/* Sleeps ms before a write is tried again; td_mq_kill ends the sleep. Returns 1 when killed.
 * Called without q->mu. */
static int retry_sleep(td_mq *q, double ms)
{
    struct timespec until;
    int killed;

    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(ms / 1000);
    until.tv_nsec += (long)((ms - 1000.0 * (double)(time_t)(ms / 1000)) * 1e6);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&q->mu);
    while (!q->killed && pthread_cond_timedwait(&q->wake, &q->mu, &until) != ETIMEDOUT)
        ;
    killed = q->killed;
    pthread_mutex_unlock(&q->mu);
    return killed;
}

/* Notes that the store thread waits (for a lock or for room, kind) and logs it: a full disk at
 * once, a lock once it has lasted TD_MQ_WARN_AFTER_MS, both again every TD_MQ_WARN_EVERY_MS. */
static void stall_note(td_mq *q, int kind, const td_error_t *e)
{
    double now = td_mono_ms();
    size_t waiting;

    pthread_mutex_lock(&q->mu);
    if (q->stall != kind) {
        q->stall = kind;
        q->stall_since = now;
        q->stall_logged = 0;
    }
    snprintf(q->stall_msg, sizeof(q->stall_msg), "%.500s", e->msg);
    waiting = q->count;
    pthread_mutex_unlock(&q->mu);
    if (q->stall_logged != 0 && now - q->stall_logged < TD_MQ_WARN_EVERY_MS)
        return;
    if (kind == STALL_FULL) {
        td_log_warn("metric store: the disk is full (%s); metric writes wait for room, and "
                    "training pauses once %zu samples wait; jobs whose samples wait fail if there "
                    "is no room within %.0f s",
                    e->msg, q->cap, (q->full_wait_ms - (now - q->full_since)) / 1000.0);
    } else if (now - q->stall_since >= TD_MQ_WARN_AFTER_MS) {
        td_log_warn("metric store: the database has been locked by another process for %.0f s "
                    "(a write transaction left open, in an sqlite3 shell say); metric writes "
                    "wait, %zu samples are queued, and training pauses once %zu are: %s",
                    (now - q->stall_since) / 1000.0, waiting, q->cap, e->msg);
    } else {
        return;
    }
    q->stall_logged = now;
}

/* A write went through: whatever the store thread waited for is over. */
static void stall_end(td_mq *q)
{
    double since = q->stall_since;
    int logged = q->stall_logged != 0, was = q->stall;

    q->full_since = 0;
    if (q->out_of_room) {
        q->out_of_room = 0;
        logged = 1;
    }
    if (was == STALL_NONE && !logged)
        return;
    pthread_mutex_lock(&q->mu);
    q->stall = STALL_NONE;
    pthread_mutex_unlock(&q->mu);
    q->stall_logged = 0;
    if (logged)
        td_log_notice("metric store: writing again%s after %.1f s",
                      was == STALL_LOCK ? " (the lock is gone)" : " (there is room)",
                      (td_mono_ms() - since) / 1000.0);
}

/* Whether the wait for room is over: the disk has been full for the whole room wait (or was
 * already given up on). Then e becomes the error the jobs see. */
static int room_ran_out(td_mq *q, td_error_t *e)
{
    double now = td_mono_ms();
    td_error_t why = *e;

    if (q->full_since == 0)
        q->full_since = now;
    if (!q->out_of_room && now - q->full_since < q->full_wait_ms)
        return 0;
    if (!q->out_of_room) {
        td_log_err("metric store: the disk stayed full for %g s: the jobs whose samples wait "
                   "fail",
                   q->full_wait_ms / 1000.0);
        q->out_of_room = 1;
        pthread_mutex_lock(&q->mu);
        q->stall = STALL_NONE;
        pthread_mutex_unlock(&q->mu);
        q->stall_logged = 0;
    }
    td_error_set(e, TD_EDISKFULL, "disk full: no room to store metrics for %g s (%s)",
                 q->full_wait_ms / 1000.0, why.msg);
    return 1;
}

/* Writes rows [0, n) of q->rows, waiting out another process's lock for as long as it lasts
 * and a full disk for up to the room wait (metricq.h). Returns 0, or the error that stays,
 * with *give_up set when it is a full disk waited out. Called without q->mu. */
static int write_retrying(td_mq *q, size_t n, td_error_t *e, int *give_up)
{
    double backoff = TD_MQ_BACKOFF_MIN_MS;
    int rc, kind;

    *give_up = 0;
    for (;;) {
        rc = td_store_metrics_write(q->store, q->rows, n, e);
        if (rc == 0) {
            stall_end(q);
            return 0;
        }
        kind = rc == TD_EBUSY ? STALL_LOCK : rc == TD_EDISKFULL ? STALL_FULL : STALL_NONE;
        if (kind == STALL_NONE)
            return rc;
        if (kind == STALL_FULL && room_ran_out(q, e)) {
            *give_up = 1;
            return rc;
        }
        stall_note(q, kind, e);
        if (retry_sleep(q, backoff))
            return rc;
        backoff = backoff * 2 < TD_MQ_BACKOFF_MAX_MS ? backoff * 2 : TD_MQ_BACKOFF_MAX_MS;
    }
}

/* Looks at the WAL every TD_MQ_WAL_CHECK_MS: a passive checkpoint, and a warning when it
 * cannot empty a WAL grown past TD_MQ_WAL_WARN_BYTES, which means that a reader keeps a
 * transaction open (README.md, "The database"). Store thread. */
static void wal_watch(td_mq *q)
{
    double now = td_mono_ms();
    td_store_wal w;
    td_error_t e;
    int held;

    if (now - q->wal_checked < TD_MQ_WAL_CHECK_MS)
        return;
    q->wal_checked = now;
    if (td_store_wal_checkpoint(q->store, &w, &e) != 0) {
        td_log_warn("metric store: checkpointing the WAL: %s", e.msg);
        return;
    }
    held = w.checkpointed < w.frames && w.frames * w.page_bytes >= TD_MQ_WAL_WARN_BYTES;
    if (held && (!q->wal_warned || now - q->wal_warned_at >= TD_MQ_WARN_EVERY_MS)) {
        td_log_warn("store: the WAL is %.0f MiB and a checkpoint cannot empty it (%lld of %lld "
                    "pages copied back): another process keeps a read transaction open on the "
                    "database (an sqlite3 shell inside BEGIN, a query left unfinished); the WAL "
                    "grows until it ends",
                    (double)w.file_bytes / (1024.0 * 1024.0), (long long)w.checkpointed,
                    (long long)w.frames);
        q->wal_warned = 1;
        q->wal_warned_at = now;
    } else if (!held && q->wal_warned && w.checkpointed == w.frames) {
        td_log_notice("store: the WAL is checkpointed again (%.0f MiB now; the next write cuts it "
                      "back)",
                      (double)w.file_bytes / (1024.0 * 1024.0));
        q->wal_warned = 0;
    }
}

/* A batch that failed is written again one sink at a time, so that one job's bad sample
 * (or its deleted row) does not cost other jobs theirs. Groups samples by sink in place,
 * keeping each sink's order. Called and returns without q->mu, which it takes to account for
 * each sink's samples. */
static void write_per_sink(td_mq *q, size_t n, uint64_t batch_no)
{
    size_t start = 0;

    for (size_t i = 0; i < n; i++) {
        /* Stable partition: move the samples of batch[start]'s sink to the front. */
        td_mq_sink *s = q->batch[start].sink;
        size_t k = start;
        int give_up;
        for (size_t j = start; j < n; j++)
            if (q->batch[j].sink == s) {
                mq_event ev = q->batch[j];
                memmove(&q->batch[k + 1], &q->batch[k], (j - k) * sizeof(*q->batch));
                q->batch[k++] = ev;
            }
        for (size_t j = start; j < k; j++)
            q->rows[j - start] = q->batch[j].m;
        td_error_t e = {0};
        int rc = write_retrying(q, k - start, &e, &give_up);
        if (rc == 0 && q->cb != NULL)
            notify_durable(q, q->batch + start, k - start);
        pthread_mutex_lock(&q->mu);
        account(q, start, k, rc, &e, batch_no, give_up);
        pthread_mutex_unlock(&q->mu);
        start = k;
        if (start == n)
            break;
    }
}

/* Takes up to TD_MQ_BATCH samples off the ring into q->batch and q->rows, leaving out (and
 * accounting for) those of sinks the store has given up on. Returns how many are left to
 * write; *one_sink says whether they all belong to one sink. Called with q->mu held. */
static size_t take_batch(td_mq *q, int *one_sink)
{
    size_t take = q->count < TD_MQ_BATCH ? q->count : TD_MQ_BATCH, n = 0;

    *one_sink = 1;
    for (size_t i = 0; i < take; i++) {
        mq_event ev = q->ring[(q->head + i) % q->cap];
        if (ev.sink->refused.code != 0) {
            ev.sink->done++;
            continue;
        }
        q->batch[n] = ev;
        q->rows[n] = ev.m;
        *one_sink &= ev.sink == q->batch[0].sink;
        n++;
    }
    q->head = (q->head + take) % q->cap;
    q->count -= take;
    pthread_cond_broadcast(&q->not_full);
    if (n < take)
        pthread_cond_broadcast(&q->progress);
    return n;
}

/* Writes one batch and accounts for it. Called with q->mu held; drops it while writing. */
static void write_batch(td_mq *q)
{
    td_error_t e = {0};
    uint64_t batch_no;
    int rc, one_sink, give_up, per_sink;
    size_t n = take_batch(q, &one_sink);

    if (n == 0)
        return;
    batch_no = ++q->batches;
    pthread_mutex_unlock(&q->mu);

    rc = write_retrying(q, n, &e, &give_up);
    if (rc == 0)
        wal_watch(q);
    per_sink = rc != 0 && !give_up && !one_sink;
    if (per_sink)
        write_per_sink(q, n, batch_no);
    else if (rc == 0 && q->cb != NULL)
        notify_durable(q, q->batch, n);
    pthread_mutex_lock(&q->mu);
    if (!per_sink)
        account(q, 0, n, rc, &e, batch_no, give_up);
    pthread_cond_broadcast(&q->progress);
}

/* A checkpoint td_mq_checkpoint asked for: passive (it never waits, nor makes anyone wait),
 * whatever the WAL holds. Its failures are the next wal_watch's to report. Store thread,
 * without q->mu. */
static void checkpoint_now(td_mq *q)
{
    td_store_wal w;
    td_error_t e;

    if (td_store_wal_checkpoint(q->store, &w, &e) != 0)
        td_log_debug("metric store: checkpoint asked for: %s", e.msg);
}

static void *store_thread(void *arg)
{
    td_mq *q = arg;

    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (q->count == 0 && !q->stopping && !q->killed && !q->ckpt_wanted)
            pthread_cond_wait(&q->not_empty, &q->mu);
        if (q->killed)
            break;
        if (q->ckpt_wanted) {
            q->ckpt_wanted = 0;
            pthread_mutex_unlock(&q->mu);
            checkpoint_now(q);
            pthread_mutex_lock(&q->mu);
            continue;
        }
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
    pthread_condattr_t attr;
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
    /* Another process's lock is waited out here, with a backoff, not inside SQLite. */
    td_store_set_lock_wait(q->store, TD_STORE_NOWAIT);
    q->full_wait_ms = TD_MQ_FULL_WAIT_MS;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->not_empty, NULL);
    pthread_cond_init(&q->not_full, NULL);
    pthread_cond_init(&q->progress, NULL);
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&q->wake, &attr);
    pthread_condattr_destroy(&attr);
    rc = pthread_create(&q->thread, NULL, store_thread, q);
    if (rc != 0) {
        td_error_set(err, -rc, "cannot start the store thread: %s", strerror(rc));
        rc = -rc;
        goto fail_thread;
    }
    *out = q;
    return 0;

fail_thread:
    pthread_cond_destroy(&q->wake);
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
    pthread_cond_destroy(&q->wake);
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

void td_mq_on_failure(td_mq *q, td_mq_failed_cb cb, void *ud)
{
    pthread_mutex_lock(&q->mu);
    q->failed_cb = cb;
    q->failed_ud = ud;
    pthread_mutex_unlock(&q->mu);
}

void td_mq_set_full_wait(td_mq *q, double ms)
{
    pthread_mutex_lock(&q->mu);
    q->full_wait_ms = ms;
    pthread_mutex_unlock(&q->mu);
}

int td_mq_stalled(td_mq *q, char *why, size_t size)
{
    int stall;

    pthread_mutex_lock(&q->mu);
    stall = q->stall;
    if (stall == STALL_LOCK)
        snprintf(why, size, "the database is locked by another process (for %.0f s)",
                 (td_mono_ms() - q->stall_since) / 1000.0);
    else if (stall == STALL_FULL)
        snprintf(why, size, "the disk is full (for %.0f s): %s",
                 (td_mono_ms() - q->stall_since) / 1000.0, q->stall_msg);
    pthread_mutex_unlock(&q->mu);
    return stall != STALL_NONE;
}

int td_mq_sink_open(td_mq *q, int64_t job, void *ud, td_mq_sink **out)
{
    td_mq_sink *s = calloc(1, sizeof(*s));

    if (s == NULL)
        return TD_ENOMEM;
    s->q = q;
    s->job = job;
    s->ud = ud;
    *out = s;
    return 0;
}

int td_mq_sink_open_cb(td_mq *q, int64_t job, td_mq_failed_cb cb, void *cb_ud, void *ud,
                       td_mq_sink **out)
{
    int rc = td_mq_sink_open(q, job, ud, out);

    if (rc == 0) {
        (*out)->cb = cb;
        (*out)->cb_ud = cb_ud;
    }
    return rc;
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
    while (q->count == q->cap && !q->killed && !q->exited && s->refused.code == 0) {
        if (t0 == 0)
            t0 = td_mono_ms();
        pthread_cond_wait(&q->not_full, &q->mu);
    }
    if (t0 != 0) {
        double blocked = td_mono_ms() - t0;
        s->blocked_ms += blocked;
        q->blocked_ms_total += blocked;
    }
    if (q->killed || q->exited) {
        rc = mq_dead(q, err);
        goto out;
    }
    if (s->refused.code != 0) {
        /* The pending error, when there is one, is this same refusal: report it once. */
        rc = sink_take_error(s, err);
        if (rc == 0)
            rc = td_error_set(err, s->refused.code, "%s", s->refused.msg);
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
    pthread_cond_signal(&q->wake);
    pthread_mutex_unlock(&q->mu);
}

void td_mq_stats(td_mq *q, td_mq_stats_t *out)
{
    pthread_mutex_lock(&q->mu);
    out->rows_written = q->written;
    out->blocked_ms = q->blocked_ms_total;
    out->queued = q->count;
    out->capacity = q->cap;
    pthread_mutex_unlock(&q->mu);
}

void td_mq_checkpoint(td_mq *q)
{
    pthread_mutex_lock(&q->mu);
    q->ckpt_wanted = 1;
    pthread_cond_signal(&q->not_empty);
    pthread_mutex_unlock(&q->mu);
}
