/* Deleting ended jobs a slice at a time on the loop thread (daemon_purge.h). One step is one store
 * transaction (a batch of rows, a job's last rows and its row, a batch of free pages) or one
 * batch of the checkpoint sweep; a slice runs steps for TD_PURGE_SLICE_MS and yields. */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/daemon_purge.h"
#include "common/td_clock.h"
#include "common/td_log.h"

/* What the next step does. */
enum { PH_ROWS, PH_VACUUM, PH_SWEEP, PH_DONE };

typedef struct td_purge_waiter {
    td_purge_done_cb done;
    td_purge_progress_cb progress;
    void *ud;
    struct td_purge_waiter *next;
} td_purge_waiter;

/* ---- checkpoint directories ---- */

static int64_t removed_files; /* nftw has no user data; loop thread only */

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if ((flag == FTW_DP ? rmdir(path) : unlink(path)) == 0)
        removed_files += flag != FTW_DP;
    else if (errno != ENOENT)
        td_log_warn("cannot remove %s: %s", path, strerror(errno));
    return 0; /* go on with the rest */
}

/* Removes ckpt_root/JOB and everything in it, never following a symbolic link (one in its
 * place is removed itself). Returns the files removed; -1 when there was no directory. */
static int64_t remove_ckpt_dir(const td_purge *p, int64_t job)
{
    char path[700];
    struct stat st;

    snprintf(path, sizeof(path), "%s/%lld", p->ckpt_root, (long long)job);
    if (lstat(path, &st) != 0)
        return -1;
    removed_files = 0;
    if (nftw(path, remove_entry, 8, FTW_DEPTH | FTW_PHYS | FTW_MOUNT) != 0)
        td_log_warn("cannot remove %s: %s", path, strerror(errno));
    return removed_files;
}

/* Removes a job that spans nodes' directory on the shared file system, PREFIX<job>, as
 * remove_ckpt_dir does. */
static void remove_shared_dir(const td_purge *p, int64_t job)
{
    char path[700];
    struct stat st;

    if (p->shared_prefix[0] == '\0')
        return;
    snprintf(path, sizeof(path), "%s%lld", p->shared_prefix, (long long)job);
    if (lstat(path, &st) != 0)
        return;
    if (nftw(path, remove_entry, 8, FTW_DEPTH | FTW_PHYS | FTW_MOUNT) != 0)
        td_log_warn("cannot remove %s: %s", path, strerror(errno));
}

void td_purge_set_shared(td_purge *p, const char *prefix)
{
    snprintf(p->shared_prefix, sizeof(p->shared_prefix), "%s", prefix);
}

/* A checkpoint directory's name: a job id in decimal, nothing else. */
static int64_t dir_job(const char *name)
{
    int64_t id = 0;

    if (name[0] < '1' || name[0] > '9' || strlen(name) > 18)
        return 0;
    for (const char *c = name; *c != '\0'; c++) {
        if (*c < '0' || *c > '9')
            return 0;
        id = id * 10 + (*c - '0');
    }
    return id;
}

/* Looks at up to TD_PURGE_SWEEP_BATCH entries of the checkpoints directory and removes those
 * of jobs that do not exist (or are being deleted). Sets *done once the directory is read. */
static int sweep_some(td_purge *p, int *done, td_error_t *err)
{
    struct dirent *e;
    int exists, rc = 0;

    *done = 0;
    if (p->sweep_dir == NULL && (p->sweep_dir = opendir(p->ckpt_root)) == NULL) {
        if (errno != ENOENT)
            td_log_warn("cannot read %s: %s", p->ckpt_root, strerror(errno));
        *done = 1;
        return 0;
    }
    for (int i = 0; i < TD_PURGE_SWEEP_BATCH && rc == 0; i++) {
        int64_t job;
        if ((e = readdir(p->sweep_dir)) == NULL) {
            closedir(p->sweep_dir);
            p->sweep_dir = NULL;
            *done = 1;
            return 0;
        }
        if ((job = dir_job(e->d_name)) == 0)
            continue;
        rc = td_store_job_exists(p->store, job, &exists, err);
        if (rc == 0 && !exists) {
            int64_t n = remove_ckpt_dir(p, job);
            if (n >= 0)
                td_log_notice("removed %s/%lld (%lld file(s)): job %lld does not exist",
                              p->ckpt_root, (long long)job, (long long)n, (long long)job);
        }
    }
    return rc;
}

/* ---- the work ---- */

static void on_idle(uv_idle_t *h);

static void finish_waits(td_purge *p, const td_purge_result *r)
{
    td_purge_waiter *w = p->waiters;

    p->waiters = NULL;
    while (w != NULL) {
        td_purge_waiter *next = w->next;
        w->done(w->ud, r);
        free(w);
        w = next;
    }
}

static void stop_running(td_purge *p)
{
    uv_idle_stop(&p->idle);
    uv_timer_stop(&p->retry);
    p->running = 0;
    if (p->checkpoint != NULL)
        td_store_set_autocheckpoint(p->store, TD_PURGE_AUTOCKPT);
}

/* While the work goes on, the WAL is checkpointed on another thread, every TD_PURGE_CKPT_MS. */
static void ask_checkpoint(td_purge *p)
{
    double now = td_mono_ms();

    if (p->checkpoint == NULL || now - p->ckpt_at < TD_PURGE_CKPT_MS)
        return;
    p->ckpt_at = now;
    p->checkpoint(p->checkpoint_ud);
}

/* Every step is done: the waits end with the database's size now. */
static void work_done(td_purge *p)
{
    td_purge_result r = {0};
    td_store_space sp;

    stop_running(p);
    p->phase = PH_DONE;
    if (td_store_space_get(p->store, &sp, &r.err) == 0) {
        r.bytes_after = sp.pages * sp.page_bytes;
        r.free_bytes = sp.free_pages * sp.page_bytes;
        r.reclaimed = sp.auto_vacuum == 2;
    }
    if (p->deleted > 0)
        td_log_notice("deleted %lld job(s) in %.1f s (%lld steps, the longest %.0f ms); the "
                      "store is %.1f MiB%s",
                      (long long)p->deleted, (td_mono_ms() - p->began) / 1000.0,
                      (long long)p->steps, p->longest_ms, (double)r.bytes_after / (1024.0 * 1024.0),
                      r.reclaimed ? ""
                                  : " (its free pages stay in the file until it is converted "
                                    "to incremental auto-vacuum: see traind(8))");
    p->deleted = 0;
    p->steps = 0;
    p->longest_ms = 0;
    td_error_clear(&r.err);
    finish_waits(p, &r);
}

/* purge_step's callback: a job is about to go; its checkpoints go first, while its row still
 * stands and its id is not free. */
static void job_gone(void *ud, int64_t job)
{
    td_purge *p = ud;

    remove_ckpt_dir(p, job);
    remove_shared_dir(p, job);
    td_log_debug("job %lld deleted", (long long)job);
}

/* One step of the marked jobs: up to TD_PURGE_BATCH rows of theirs, and every job that has
 * none left. Moves on to the vacuum when no job is marked. */
static int step_rows(td_purge *p, td_error_t *err)
{
    int64_t jobs = 0;
    size_t rows = 0;
    int rc;

    if (p->left < 0 && (rc = td_store_purge_next(p->store, &p->job, &p->left, err)) != 0)
        return rc;
    rc = td_store_purge_step(p->store, TD_PURGE_BATCH, job_gone, p, &jobs, &rows, err);
    if (rc != 0)
        return rc;
    p->deleted += jobs;
    p->left = p->left > jobs ? p->left - jobs : 0;
    if (jobs == 0 && rows == 0) {
        p->left = 0;
        p->phase = PH_VACUUM;
    }
    return 0;
}

/* One step of the vacuum: a batch of free pages back to the file system, until none is left
 * (or the database keeps its free pages: no incremental auto-vacuum). */
static int step_vacuum(td_purge *p, td_error_t *err)
{
    td_store_space sp;
    int64_t left = 0;
    int rc = td_store_space_get(p->store, &sp, err);

    if (rc == 0 && sp.auto_vacuum == 2 && sp.free_pages > 0)
        rc = td_store_vacuum_step(p->store, TD_PURGE_VACUUM_PAGES, &left, err);
    if (rc == 0 && (sp.auto_vacuum != 2 || left == 0))
        p->phase = PH_SWEEP;
    return rc;
}

/* One step. Sets *more to 0 once everything is done. */
static int step(td_purge *p, int *more, td_error_t *err)
{
    int done = 0, rc = 0;

    *more = 1;
    switch (p->phase) {
    case PH_ROWS:
        return step_rows(p, err);
    case PH_VACUUM:
        return step_vacuum(p, err);
    case PH_SWEEP:
        if (p->sweep_wanted)
            rc = sweep_some(p, &done, err);
        if (rc == 0 && (done || !p->sweep_wanted)) {
            p->sweep_wanted = 0;
            p->phase = PH_DONE;
        }
        return rc;
    default:
        *more = 0;
        return 0;
    }
}

static void report_progress(td_purge *p);

/* The store was locked by another process or full: the work waits, and is tried again. */
static int pausable(int rc)
{
    return rc == TD_EBUSY || rc == TD_EDISKFULL;
}

static void on_retry(uv_timer_t *t)
{
    td_purge *p = t->data;

    uv_idle_start(&p->idle, on_idle);
}

/* A step failed with rc: pause and try again later, or give up on the waits. */
static void step_failed(td_purge *p, int rc, const td_error_t *err)
{
    double now = td_mono_ms();
    td_purge_result r = {0};

    if (pausable(rc)) {
        if (p->paused_since == 0) {
            p->paused_since = now;
            p->retry_ms = TD_PURGE_RETRY_MIN_MS;
        }
        if (!p->pause_logged && now - p->paused_since >= TD_PURGE_WARN_MS) {
            td_log_warn("deleting jobs waits: %s; tried again every %.0f s at most", err->msg,
                        TD_PURGE_RETRY_MAX_MS / 1000.0);
            p->pause_logged = 1;
        }
        /* A waiter keeps hearing from the work while it waits: its client does not time out. */
        report_progress(p);
        uv_idle_stop(&p->idle);
        uv_timer_start(&p->retry, on_retry, (uint64_t)p->retry_ms, 0);
        p->retry_ms =
            p->retry_ms * 2 < TD_PURGE_RETRY_MAX_MS ? p->retry_ms * 2 : TD_PURGE_RETRY_MAX_MS;
        return;
    }
    td_log_err("deleting jobs stopped: %s; the jobs marked stay hidden and are tried again at "
               "the next rm, prune or start",
               err->msg);
    stop_running(p);
    p->phase = PH_DONE;
    if (p->sweep_dir != NULL) {
        closedir(p->sweep_dir);
        p->sweep_dir = NULL;
    }
    r.err = *err;
    finish_waits(p, &r);
}

static void report_progress(td_purge *p)
{
    double now = td_mono_ms();

    if (now - p->progress_at < TD_PURGE_PROGRESS_MS)
        return;
    p->progress_at = now;
    for (td_purge_waiter *w = p->waiters; w != NULL; w = w->next)
        if (w->progress != NULL)
            w->progress(w->ud, p->left > 0 ? p->left : 0);
}

/* A slice: steps for up to TD_PURGE_SLICE_MS, then back to the loop. */
static void on_idle(uv_idle_t *h)
{
    td_purge *p = h->data;
    double t0 = td_mono_ms();
    td_error_t err = {0};
    int more = 1, rc = 0;

    while (more && td_mono_ms() - t0 < TD_PURGE_SLICE_MS) {
        double s0 = td_mono_ms();
        if ((rc = step(p, &more, &err)) != 0)
            break;
        p->steps++;
        if (td_mono_ms() - s0 > p->longest_ms)
            p->longest_ms = td_mono_ms() - s0;
    }
    if (rc != 0) {
        step_failed(p, rc, &err);
        return;
    }
    if (p->paused_since != 0 && p->pause_logged)
        td_log_notice("deleting jobs goes on after %.1f s", (td_mono_ms() - p->paused_since) / 1e3);
    p->paused_since = 0;
    p->pause_logged = 0;
    if (!more) {
        work_done(p);
        return;
    }
    ask_checkpoint(p);
    report_progress(p);
}

int td_purge_init(td_purge *p, uv_loop_t *loop, td_store *s, const char *state_dir,
                  void (*checkpoint)(void *ud), void *ud)
{
    int rc;

    memset(p, 0, sizeof(*p));
    p->store = s;
    p->checkpoint = checkpoint;
    p->checkpoint_ud = ud;
    p->phase = PH_DONE;
    snprintf(p->ckpt_root, sizeof(p->ckpt_root), "%s/checkpoints", state_dir);
    rc = uv_idle_init(loop, &p->idle);
    if (rc != 0)
        return rc;
    rc = uv_timer_init(loop, &p->retry);
    if (rc != 0) {
        uv_close((uv_handle_t *)&p->idle, NULL);
        return rc;
    }
    p->idle.data = p->retry.data = p;
    p->open = 1;
    return 0;
}

void td_purge_kick(td_purge *p, int sweep)
{
    if (!p->open)
        return;
    p->sweep_wanted |= sweep;
    if (p->phase == PH_DONE) {
        p->began = td_mono_ms();
        p->progress_at = p->began;
    }
    p->phase = PH_ROWS;
    p->left = -1; /* read again: new jobs were marked */
    if (!p->running) {
        p->running = 1;
        if (p->checkpoint != NULL)
            td_store_set_autocheckpoint(p->store, 0);
        uv_idle_start(&p->idle, on_idle);
    }
}

int td_purge_wait(td_purge *p, td_purge_done_cb done, td_purge_progress_cb progress, void *ud)
{
    td_purge_waiter *w = calloc(1, sizeof(*w)), **tail = &p->waiters;

    if (w == NULL)
        return TD_ENOMEM;
    w->done = done;
    w->progress = progress;
    w->ud = ud;
    /* At the end: the waits end in the order they began. */
    while (*tail != NULL)
        tail = &(*tail)->next;
    *tail = w;
    return 0;
}

void td_purge_close(td_purge *p)
{
    td_purge_result r = {0};

    if (!p->open)
        return;
    p->open = 0;
    td_error_set(&r.err, TD_ECLOSED,
                 "traind is stopping; the deletion goes on when it starts again");
    finish_waits(p, &r);
    stop_running(p);
    if (p->sweep_dir != NULL)
        closedir(p->sweep_dir);
    p->sweep_dir = NULL;
    uv_close((uv_handle_t *)&p->idle, NULL);
    uv_close((uv_handle_t *)&p->retry, NULL);
}
