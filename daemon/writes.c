/* The loop thread's store writes, made at once or kept and made later (writes.h). A write is
 * first tried on the spot, unless writes are already kept, in which case it joins the end of
 * the queue without a try, so that nothing overtakes what is kept. The timer drains the queue
 * from its head and stops at the first write that still cannot be made. Loop thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/td_clock.h"
#include "common/td_log.h"
#include "daemon/writes.h"

enum { W_STATE, W_PROGRESS, W_LOG, W_SPEC, W_ERR_DEVICES, W_NODES };

/* One write: its kind, its job and its arguments. On the stack the pointers borrow the
 * caller's; once kept, text and blob are malloc'd copies. */
struct td_write {
    int kind;
    int64_t job;
    char state[TD_STORE_MAX_STATE];
    char devs[64];       /* td_job_row.device_list's size */
    int code;            /* the state's error code; the log line's level */
    int64_t step, total; /* progress; total is a node list's restarts */
    const char *text;    /* the state's error message, the log line, the spec's JSON; or NULL */
    const void *blob;    /* the spec, the device errors; or NULL */
    size_t len;
    struct td_write *next;
};

static const char *kind_name(int kind)
{
    static const char *const names[] = {"state", "progress",      "log line",
                                        "spec",  "device errors", "nodes"};
    return names[kind];
}

static void item_free(struct td_write *it)
{
    if (it == NULL)
        return;
    free((void *)it->text);
    free((void *)it->blob);
    free(it);
}

/* A malloc'd copy of it, its text and blob copied too; NULL when out of memory. */
static struct td_write *item_dup(const struct td_write *it)
{
    struct td_write *c = malloc(sizeof(*c));

    if (c == NULL)
        return NULL;
    *c = *it;
    c->next = NULL;
    c->text = it->text != NULL ? strdup(it->text) : NULL;
    c->blob = NULL;
    if (it->blob != NULL && (c->blob = malloc(it->len > 0 ? it->len : 1)) != NULL)
        memcpy((void *)c->blob, it->blob, it->len);
    if ((it->text != NULL && c->text == NULL) || (it->blob != NULL && c->blob == NULL)) {
        item_free(c);
        return NULL;
    }
    return c;
}

/* Makes the write in the store. */
static int do_write(td_writes *w, const struct td_write *it, td_error_t *err)
{
    switch (it->kind) {
    case W_STATE:
        return td_store_job_set_state(w->store, it->job, it->state, it->devs, it->code, it->text,
                                      err);
    case W_PROGRESS:
        return td_store_job_set_progress(w->store, it->job, it->step, it->total, err);
    case W_LOG:
        return td_store_log(w->store, it->job, it->code, it->text, err);
    case W_SPEC:
        return td_store_job_set_spec_json(w->store, it->job, it->blob, it->len, it->text, err);
    case W_NODES:
        return td_store_job_set_nodes(w->store, it->job, it->blob, it->len, (int)it->total, err);
    default:
        return td_store_job_set_error_devices(w->store, it->job, it->blob, it->len, err);
    }
}

/* Whether a failure may pass: another process's lock, a full disk, an I/O error. */
static int retryable(int rc)
{
    return rc == TD_EBUSY || rc == TD_EDISKFULL || rc == TD_EIO;
}

static void on_timer(uv_timer_t *t);

static void arm(td_writes *w)
{
    int rc = uv_timer_start(&w->timer, on_timer, (uint64_t)w->retry_ms, 0);

    if (rc != 0)
        td_log_err("store: cannot arm the timer for kept writes: %s", uv_strerror(rc));
}

/* A write that was kept left the queue: tells the daemon when it was a state. */
static void left(td_writes *w, struct td_write *it)
{
    if (it->kind == W_STATE && w->state_cb != NULL)
        w->state_cb(w->ud, it->job, it->state);
    item_free(it);
}

/* Makes kept writes from the head until one still fails. Returns how many were made. */
static size_t drain(td_writes *w)
{
    size_t made = 0;

    while (w->head != NULL) {
        struct td_write *it = w->head;
        td_error_t err = {0};
        int rc = do_write(w, it, &err);
        if (rc != 0 && retryable(rc)) {
            w->why = err;
            break;
        }
        if (rc != 0)
            td_log_warn("job %lld: its %s, kept while the store could not be written, is "
                        "refused: %s",
                        (long long)it->job, kind_name(it->kind), err.msg);
        w->head = it->next;
        if (w->head == NULL)
            w->tail = NULL;
        w->n--;
        w->nlogs -= it->kind == W_LOG;
        made++;
        left(w, it);
    }
    return made;
}

static void on_timer(uv_timer_t *t)
{
    td_writes *w = t->data;
    size_t made = drain(w);

    if (w->head != NULL) {
        w->retry_ms *= 2;
        if (w->retry_ms > TD_WRITES_RETRY_MAX_MS)
            w->retry_ms = TD_WRITES_RETRY_MAX_MS;
        arm(w);
        return;
    }
    td_log_notice("store: writes again after %.1f s; the %zu write(s) kept meanwhile are made",
                  (td_mono_ms() - w->since) / 1000.0, made);
    if (w->dropped_logs > 0)
        td_log_warn("store: %zu job log line(s) were dropped while it could not be written",
                    w->dropped_logs);
    w->dropped_logs = 0;
    td_error_clear(&w->why);
}

/* Appends a copy of it to the queue. */
static int keep(td_writes *w, const struct td_write *it, td_error_t *err)
{
    struct td_write *c;

    if (it->kind == W_PROGRESS)
        for (c = w->head; c != NULL; c = c->next)
            if (c->kind == W_PROGRESS && c->job == it->job) {
                /* Only the latest progress matters; its columns are no other write's. */
                c->step = it->step;
                c->total = it->total;
                return 1;
            }
    if (it->kind == W_LOG && w->nlogs >= TD_WRITES_MAX_LOGS) {
        w->dropped_logs++;
        return 1;
    }
    c = item_dup(it);
    if (c == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory keeping job %lld's %s for later",
                            (long long)it->job, kind_name(it->kind));
    if (w->tail != NULL)
        w->tail->next = c;
    else
        w->head = c;
    w->tail = c;
    w->n++;
    w->nlogs += c->kind == W_LOG;
    if (c->kind == W_STATE)
        td_log_notice("job %lld: state %s is kept in memory until the store can take it",
                      (long long)c->job, c->state);
    return 1;
}

/* Makes it now, or keeps it (see the file's comment). */
static int submit(td_writes *w, const struct td_write *it, td_error_t *err)
{
    int rc;

    if (w->head != NULL)
        return keep(w, it, err);
    rc = do_write(w, it, err);
    if (rc == 0 || !retryable(rc))
        return rc;
    w->why = *err;
    w->since = td_mono_ms();
    w->retry_ms = TD_WRITES_RETRY_MIN_MS;
    td_log_warn("store: cannot write now (%s); job states, progress and log lines are kept in "
                "memory, in order, and written as soon as it can take them",
                err->msg);
    rc = keep(w, it, err);
    if (w->head != NULL)
        arm(w);
    return rc;
}

int td_writes_init(td_writes *w, uv_loop_t *loop, td_store *s, td_writes_state_cb cb, void *ud)
{
    int rc;

    memset(w, 0, sizeof(*w));
    rc = uv_timer_init(loop, &w->timer);
    if (rc != 0)
        return rc;
    w->timer.data = w;
    w->store = s;
    w->state_cb = cb;
    w->ud = ud;
    w->retry_ms = TD_WRITES_RETRY_MIN_MS;
    w->open = 1;
    return 0;
}

void td_writes_close(td_writes *w)
{
    if (!w->open)
        return;
    if (w->head != NULL) {
        td_store_set_lock_wait(w->store, TD_STORE_WAIT);
        drain(w);
    }
    while (w->head != NULL) {
        struct td_write *it = w->head;
        w->head = it->next;
        if (it->kind == W_STATE)
            td_log_err("job %lld: its state %s could not be recorded before the stop (%s); the "
                       "store keeps its earlier state",
                       (long long)it->job, it->state, w->why.msg);
        item_free(it);
    }
    w->tail = NULL;
    w->n = w->nlogs = 0;
    uv_timer_stop(&w->timer);
    uv_close((uv_handle_t *)&w->timer, NULL);
    w->open = 0;
}

int td_writes_state(td_writes *w, int64_t job, const char *state, const char *device_list,
                    int err_code, const char *err_msg, td_error_t *err)
{
    struct td_write it = {.kind = W_STATE, .job = job, .code = err_code, .text = err_msg};

    snprintf(it.state, sizeof(it.state), "%s", state);
    snprintf(it.devs, sizeof(it.devs), "%s", device_list != NULL ? device_list : "");
    return submit(w, &it, err);
}

int td_writes_progress(td_writes *w, int64_t job, int64_t step, int64_t total_steps,
                       td_error_t *err)
{
    struct td_write it = {.kind = W_PROGRESS, .job = job, .step = step, .total = total_steps};

    return submit(w, &it, err);
}

int td_writes_log(td_writes *w, int64_t job, int level, const char *line, td_error_t *err)
{
    struct td_write it = {.kind = W_LOG, .job = job, .code = level, .text = line};

    return submit(w, &it, err);
}

int td_writes_spec(td_writes *w, int64_t job, const void *blob, size_t len, const char *json,
                   td_error_t *err)
{
    struct td_write it = {.kind = W_SPEC, .job = job, .blob = blob, .len = len, .text = json};

    return submit(w, &it, err);
}

int td_writes_err_devices(td_writes *w, int64_t job, const void *blob, size_t len, td_error_t *err)
{
    struct td_write it = {.kind = W_ERR_DEVICES, .job = job, .blob = blob, .len = len};

    return submit(w, &it, err);
}

int td_writes_nodes(td_writes *w, int64_t job, const void *blob, size_t len, int restarts,
                    td_error_t *err)
{
    struct td_write it = {.kind = W_NODES, .job = job, .blob = blob, .len = len, .total = restarts};

    return submit(w, &it, err);
}

size_t td_writes_pending(const td_writes *w, td_error_t *why)
{
    if (why != NULL && w->n > 0)
        *why = w->why;
    return w->n;
}
