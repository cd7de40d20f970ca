/* The control socket (server.h): accepts connections, cuts frames, answers requests, and
 * feeds metric streams (watch, metrics) from the store. Loop thread only.
 *
 * A stream never holds rows in memory beyond one page: it reads a page from the store when
 * its connection's output is below TD_CONN_HIGH_WATER, and otherwise waits for the client to
 * drain it. A stalled client therefore costs at most the high-water mark, and catches up
 * from the store when it reads again. While a job runs, a watch delivers only rows of steps
 * before the newest durable step, so a step whose rows span two store batches is never
 * split across the cursor (rows come in (step, key) order).
 *
 * export and sample run their slow half on libuv's threadpool (work.c); meanwhile their
 * connection reads no further request, so that its replies keep the order of its requests. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "memguard.h"
#include "server.h"
#include "td_log.h"
#include "work.h"

typedef struct td_conn td_conn;

struct td_server {
    uv_pipe_t listener; /* first: the handle's data is the server */
    uv_loop_t *loop;
    td_config cfg; /* socket_path is the one clients use (systemd's, when it passed one) */
    td_daemon *d;
    td_store *store; /* the daemon's: the loop thread's connection */
    td_conn *conns;
    int nconns;
    int listening; /* listener is initialised and not yet closed */
    int inherited; /* listener came from systemd (LISTEN_FDS): its path is not ours */
};

typedef struct td_stream {
    td_conn *c;
    int64_t req_id, job;
    int watch;
    td_metric_cursor cur;
    char **keys;
    size_t nkeys;
    struct td_stream *next;
} td_stream;

struct td_conn {
    uv_pipe_t pipe; /* first: the handle's memory is the connection's */
    td_server *s;
    td_proto_reader *reader;
    td_pw w;
    size_t pending; /* bytes handed to uv_write and not yet written */
    int hello;
    int closing;
    int64_t uid, gid, pid;
    td_stream *streams;
    td_conn *next;
    int refs;          /* threadpool work holding the connection: its memory outlives the close */
    int closed;        /* the handle's close callback has run; the memory waits for refs == 0 */
    int busy;          /* an export or sample is under way: later requests wait their turn */
    td_work *xfer;     /* the export being sent, or NULL */
    int64_t xfer_sent; /* bytes of xfer sent so far */
};

typedef struct wreq {
    uv_write_t req;
    td_conn *c;
    size_t len;
    char data[];
} wreq;

static void conn_close(td_conn *c);
static void stream_pump(td_stream *st);
static void xfer_pump(td_conn *c);

/* ---- output ---- */

static void on_write(uv_write_t *req, int status)
{
    wreq *r = (wreq *)req;
    td_conn *c = r->c;

    c->pending -= r->len;
    free(r);
    if (status == UV_ECANCELED || c->closing)
        return;
    if (status < 0) {
        td_log_info("client pid %lld: write failed: %s", (long long)c->pid, uv_strerror(status));
        conn_close(c);
        return;
    }
    if (c->pending < TD_CONN_LOW_WATER) {
        td_stream *st = c->streams;
        while (st != NULL && !c->closing) {
            td_stream *next = st->next;
            stream_pump(st);
            st = next;
        }
        if (c->xfer != NULL && !c->closing)
            xfer_pump(c);
    }
}

/* Sends the frame built in c->w. */
static void conn_send(td_conn *c)
{
    const char *frame;
    size_t len;
    wreq *r;
    uv_buf_t buf;
    int rc;

    if (c->closing)
        return;
    rc = td_pw_finish(&c->w, &frame, &len);
    if (rc != 0) {
        td_log_err("client pid %lld: cannot build a reply: %s", (long long)c->pid, td_strerror(rc));
        conn_close(c);
        return;
    }
    r = malloc(sizeof(*r) + len);
    if (r == NULL) {
        conn_close(c);
        return;
    }
    r->c = c;
    r->len = len;
    memcpy(r->data, frame, len);
    buf = uv_buf_init(r->data, (unsigned)len);
    c->pending += len;
    rc = uv_write(&r->req, (uv_stream_t *)&c->pipe, &buf, 1, on_write);
    if (rc != 0) {
        c->pending -= len;
        free(r);
        conn_close(c);
    }
}

/* Starts a reply frame in c->w: {type, id} and room for extra more pairs. */
static void reply_begin(td_conn *c, const char *type, int64_t id, uint32_t extra)
{
    td_pw_reset(&c->w);
    td_pw_map(&c->w, 2 + extra);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, id);
}

static void send_error(td_conn *c, int64_t id, int code, const char *msg)
{
    td_pw_reset(&c->w);
    td_proto_write_error(&c->w, id, code, msg);
    conn_send(c);
}

/* ---- job maps ---- */

typedef struct last_vals {
    char (*keys)[TD_STORE_MAX_KEY];
    double *vals;
    size_t n, cap;
} last_vals;

static int collect_last(void *ud, const td_metric_summary *row)
{
    last_vals *lv = ud;

    if (lv->n == lv->cap) {
        size_t cap = lv->cap ? lv->cap * 2 : 16;
        void *k = realloc(lv->keys, cap * sizeof(*lv->keys));
        if (k == NULL)
            return 1;
        lv->keys = k;
        void *v = realloc(lv->vals, cap * sizeof(*lv->vals));
        if (v == NULL)
            return 1;
        lv->vals = v;
        lv->cap = cap;
    }
    snprintf(lv->keys[lv->n], TD_STORE_MAX_KEY, "%s", row->key);
    lv->vals[lv->n++] = row->last;
    return 0;
}

/* Writes the JOB map of PROTOCOL.md for row, with live figures for a job in memory. */
static void write_job(td_server *s, td_pw *w, td_job_row *row, int with_spec)
{
    td_job_live jl, *live = td_daemon_job_live(s->d, row->id, &jl) ? &jl : NULL;
    last_vals lv = {0};
    td_error_t err;

    if (td_store_metrics_summary(s->store, row->id, collect_last, &lv, &err) != 0)
        td_log_warn("job %lld: cannot read metric summary: %s", (long long)row->id, err.msg);
    td_pw_map(w, with_spec ? 13 : 12);
    td_pw_str(w, "id");
    td_pw_int(w, row->id);
    td_pw_str(w, "name");
    td_pw_str(w, row->name);
    td_pw_str(w, "state");
    td_pw_str(w, live != NULL ? live->state : row->state);
    td_pw_str(w, "step");
    td_pw_int(w, live != NULL ? live->step : row->step);
    td_pw_str(w, "total_steps");
    td_pw_int(w, live != NULL && live->total_steps ? live->total_steps : row->total_steps);
    td_pw_str(w, "devices");
    td_pw_int(w, row->devices);
    td_pw_str(w, "device_list");
    td_pw_str(w, live != NULL && live->running ? live->device_list : row->device_list);
    td_pw_str(w, "created");
    td_pw_double(w, row->created);
    td_pw_str(w, "started");
    td_pw_double(w, row->started);
    td_pw_str(w, "ended");
    td_pw_double(w, row->ended);
    td_pw_str(w, "error");
    if (row->err_code == 0) {
        td_pw_nil(w);
    } else {
        td_pw_map(w, 4);
        td_pw_str(w, "code");
        td_pw_int(w, row->err_code);
        td_pw_str(w, "name");
        td_pw_str(w, td_errname(row->err_code));
        td_pw_str(w, "message");
        td_pw_str(w, row->err_msg != NULL ? row->err_msg : td_strerror(row->err_code));
        td_pw_str(w, "devices");
        if (row->err_devices != NULL)
            td_pw_raw(w, row->err_devices, row->err_devices_len);
        else
            td_pw_array(w, 0);
    }
    td_pw_str(w, "metrics");
    td_pw_map(w, (uint32_t)lv.n);
    for (size_t i = 0; i < lv.n; i++) {
        td_pw_str(w, lv.keys[i]);
        td_pw_double(w, lv.vals[i]);
    }
    if (with_spec) {
        td_pw_str(w, "spec");
        if (row->spec != NULL)
            td_pw_raw(w, row->spec, row->spec_len);
        else
            td_pw_nil(w);
    }
    free(lv.keys);
    free(lv.vals);
}

/* ---- streams ---- */

typedef struct page_row {
    char key[TD_STORE_MAX_KEY];
    int key_id;
    int64_t step;
    double value, time;
} page_row;

typedef struct page_ctx {
    page_row rows[TD_STREAM_PAGE];
    size_t n;
    int64_t bound; /* rows at or past this step wait */
    int held;      /* a row was held back by bound */
} page_ctx;

static page_ctx page; /* loop thread only */

static int collect_row(void *ud, const td_metric_row *row)
{
    page_ctx *p = ud;
    page_row *r;

    if (row->step >= p->bound) {
        p->held = 1;
        return 1;
    }
    r = &p->rows[p->n++];
    snprintf(r->key, sizeof(r->key), "%s", row->key);
    r->key_id = row->key_id;
    r->step = row->step;
    r->value = row->value;
    r->time = row->time;
    return 0;
}

static void stream_free(td_stream *st)
{
    td_conn *c = st->c;

    for (td_stream **p = &c->streams; *p != NULL; p = &(*p)->next)
        if (*p == st) {
            *p = st->next;
            break;
        }
    for (size_t i = 0; i < st->nkeys; i++)
        free(st->keys[i]);
    free(st->keys);
    free(st);
}

/* Ends a stream: metrics streams with a bare end frame, watches with the job's final map. */
static void stream_end(td_stream *st)
{
    td_conn *c = st->c;
    td_server *s = c->s;
    td_job_row row = {0};
    td_error_t err;
    int with_job = st->watch && td_store_job_get(s->store, st->job, &row, &err) == 0;

    reply_begin(c, "end", st->req_id, with_job ? 2 : 1);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, st->job);
    if (with_job) {
        td_pw_str(&c->w, "job");
        write_job(s, &c->w, &row, 0);
    }
    td_job_row_clear(&row);
    conn_send(c);
    stream_free(st);
}

/* Sends pages of stored rows while the client keeps up; ends the stream when it is done. */
static void stream_pump(td_stream *st)
{
    td_conn *c = st->c;
    td_server *s = c->s;
    td_job_live live;
    int ended = !td_daemon_job_live(s->d, st->job, &live);

    while (!c->closing && c->pending < TD_CONN_HIGH_WATER) {
        td_metric_cursor before = st->cur;
        td_error_t err;
        size_t ndone = 0;

        page.n = 0;
        page.held = 0;
        page.bound = st->watch && !ended ? live.durable_step : INT64_MAX;
        if (td_store_metrics_page(s->store, st->job, &st->cur, (const char *const *)st->keys,
                                  st->nkeys, TD_STREAM_PAGE, collect_row, &page, &ndone,
                                  &err) != 0) {
            send_error(c, st->req_id, err.code, err.msg);
            stream_free(st);
            return;
        }
        if (page.held) {
            /* The held row was counted as delivered: rewind to the last row kept. */
            st->cur = before;
            if (page.n > 0) {
                st->cur.step = page.rows[page.n - 1].step;
                st->cur.key_id = page.rows[page.n - 1].key_id;
            }
        }
        if (page.n > 0) {
            reply_begin(c, "rows", st->req_id, 2);
            td_pw_str(&c->w, "job_id");
            td_pw_int(&c->w, st->job);
            td_pw_str(&c->w, "rows");
            td_pw_array(&c->w, (uint32_t)page.n);
            for (size_t i = 0; i < page.n; i++) {
                td_pw_array(&c->w, 4);
                td_pw_str(&c->w, page.rows[i].key);
                td_pw_int(&c->w, page.rows[i].step);
                td_pw_double(&c->w, page.rows[i].value);
                td_pw_double(&c->w, page.rows[i].time);
            }
            conn_send(c);
        }
        if (page.n == TD_STREAM_PAGE)
            continue;
        /* Caught up with what the store holds. */
        if (!st->watch || ended)
            stream_end(st);
        return;
    }
}

static void send_state(td_stream *st, const td_job_live *job)
{
    td_conn *c = st->c;

    reply_begin(c, "state", st->req_id, 4);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, st->job);
    td_pw_str(&c->w, "state");
    td_pw_str(&c->w, job->state);
    td_pw_str(&c->w, "step");
    td_pw_int(&c->w, job->step);
    td_pw_str(&c->w, "total_steps");
    td_pw_int(&c->w, job->total_steps);
    conn_send(c);
}

void td_server_job_changed(td_server *s, int64_t job, const char *state)
{
    td_job_live live;
    int held = td_daemon_job_live(s->d, job, &live);

    for (td_conn *c = s->conns; c != NULL; c = c->next) {
        td_stream *st = c->streams;
        while (st != NULL && !c->closing) {
            td_stream *next = st->next;
            if (st->job == job) {
                if (st->watch && state != NULL && held)
                    send_state(st, &live);
                stream_pump(st);
            }
            st = next;
        }
    }
}

/* ---- requests ---- */

static int get_job_id(td_conn *c, const td_pval *root, int64_t id, int64_t *job)
{
    if (td_pv_int(td_pv_get(root, "job_id"), job) != 0 || *job < 1) {
        send_error(c, id, TD_EPROTO, "job_id: must be a positive integer");
        return -1;
    }
    return 0;
}

static void req_hello(td_conn *c, const td_pval *root, int64_t id)
{
    int64_t version = 0;

    if (td_pv_int(td_pv_get(root, "version"), &version) != 0 || version != TD_PROTO_VERSION) {
        char msg[128];
        snprintf(msg, sizeof(msg), "protocol version %lld is not spoken here; traind speaks %d",
                 (long long)version, TD_PROTO_VERSION);
        send_error(c, id, TD_EVERSION, msg);
        conn_close(c);
        return;
    }
    c->hello = 1;
    reply_begin(c, "hello", id, 3);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    td_pw_str(&c->w, "server");
    td_pw_str(&c->w, "traind " TD_VERSION);
    /* What this daemon understands beyond version 1's first form, so that a client never
     * sends a flag an older daemon would ignore (a submit's dry_run would queue the job). */
    td_pw_str(&c->w, "features");
    td_pw_array(&c->w, 1);
    td_pw_str(&c->w, "dry_run");
    conn_send(c);
}

/* ---- submit --dry-run ---- */

/* The estimate reply of PROTOCOL.md ("submit", dry run). */
static void send_estimate(td_conn *c, int64_t id, const td_jobspec *spec, int asked_auto,
                          const td_memguard *g, const char *message)
{
    td_pw *w = &c->w;
    int world = spec->train.world;
    int batch = asked_auto ? (g->chose_batch > 0 ? g->chose_batch : world) : spec->train.batch_size;

    reply_begin(c, "estimate", id, 11);
    td_pw_str(w, "device");
    td_pw_str(w, g->device);
    td_pw_str(w, "devices");
    td_pw_int(w, world);
    td_pw_str(w, "batch_size");
    td_pw_int(w, batch);
    td_pw_str(w, "batch_auto");
    td_pw_bool(w, asked_auto);
    td_pw_str(w, "memory");
    td_pw_map(w, 8);
    td_pw_str(w, "rows");
    td_pw_int(w, g->est.batch);
    td_pw_str(w, "parameters");
    td_pw_int(w, (int64_t)g->est.params);
    td_pw_str(w, "gradients");
    td_pw_int(w, (int64_t)g->est.grads);
    td_pw_str(w, "optimizer");
    td_pw_int(w, (int64_t)g->est.optim);
    td_pw_str(w, "activations");
    td_pw_int(w, (int64_t)g->est.activations);
    td_pw_str(w, "attention");
    td_pw_int(w, (int64_t)g->est.attention);
    td_pw_str(w, "workspace");
    td_pw_int(w, (int64_t)g->est.workspace);
    td_pw_str(w, "total");
    td_pw_int(w, (int64_t)g->est.total);
    td_pw_str(w, "free_bytes");
    td_pw_int(w, (int64_t)g->free_bytes);
    td_pw_str(w, "total_bytes");
    td_pw_int(w, (int64_t)g->total_bytes);
    td_pw_str(w, "fits");
    td_pw_bool(w, g->fits);
    td_pw_str(w, "largest_batch");
    td_pw_int(w, g->largest_batch);
    td_pw_str(w, "auto_batch");
    td_pw_int(w, td_memguard_auto_batch(g->largest_batch, world));
    td_pw_str(w, "message");
    td_pw_str(w, message);
    conn_send(c);
}

/* submit with dry_run: the job validated as a submit would be, then the memory guard against
 * the devices it would get, and the estimate sent back. Nothing is stored or queued. */
static void req_dry_run(td_conn *c, const td_pval *job, int64_t id)
{
    td_jobspec *spec = malloc(sizeof(*spec)); /* ~70 KiB of paths: not on the stack */
    td_error_t err = {0};
    td_memguard g;
    int asked_auto = 0, estimated = 0, rc;

    if (spec == NULL) {
        send_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    rc = td_daemon_dry_run(c->s->d, job, c->uid, c->gid, spec, &g, &asked_auto, &estimated, &err);
    /* Not fitting is an answer, not an error: the estimate goes back with the refusal. */
    if (estimated) {
        send_estimate(c, id, spec, asked_auto, &g, rc == 0 ? NULL : err.msg);
    } else {
        td_log_info("client pid %lld uid %lld: dry run refused: %s", (long long)c->pid,
                    (long long)c->uid, err.msg);
        send_error(c, id, err.code, err.msg);
    }
    free(spec);
}

static void req_submit(td_conn *c, const td_pval *root, int64_t id)
{
    const td_pval *dry = td_pv_get(root, "dry_run");
    td_error_t err = {0};
    int64_t job = 0;
    int dry_run = 0;

    if (dry != NULL && td_pv_bool(dry, &dry_run) != 0) {
        send_error(c, id, TD_EPROTO, "dry_run: must be true or false");
        return;
    }
    if (dry_run) {
        req_dry_run(c, td_pv_get(root, "job"), id);
        return;
    }

    if (td_daemon_submit(c->s->d, td_pv_get(root, "job"), c->uid, c->gid, &job, &err) != 0) {
        td_log_info("client pid %lld uid %lld: job refused: %s", (long long)c->pid,
                    (long long)c->uid, err.msg);
        send_error(c, id, err.code, err.msg);
        return;
    }
    reply_begin(c, "submitted", id, 1);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    conn_send(c);
}

static void req_status(td_conn *c, const td_pval *root, int64_t id)
{
    td_job_row row = {0};
    td_error_t err;
    int64_t job;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_store_job_get(c->s->store, job, &row, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    reply_begin(c, "job", id, 1);
    td_pw_str(&c->w, "job");
    write_job(c->s, &c->w, &row, 1);
    td_job_row_clear(&row);
    conn_send(c);
}

static void req_list(td_conn *c, int64_t id)
{
    td_job_row *rows = NULL;
    size_t n = 0;
    td_error_t err;

    if (td_store_job_list(c->s->store, 0, &rows, &n, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    reply_begin(c, "jobs", id, 1);
    td_pw_str(&c->w, "jobs");
    td_pw_array(&c->w, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
        write_job(c->s, &c->w, &rows[i], 0);
        td_job_row_clear(&rows[i]);
    }
    free(rows);
    conn_send(c);
}

static void req_cancel(td_conn *c, const td_pval *root, int64_t id)
{
    char state[TD_STORE_MAX_STATE];
    td_error_t err;
    int64_t job;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_daemon_cancel(c->s->d, job, c->uid, state, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    reply_begin(c, "cancelled", id, 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "state");
    td_pw_str(&c->w, state);
    conn_send(c);
}

/* Each device with its job and, where it can be read, its memory. */
static void write_devices(td_conn *c)
{
    td_daemon *d = c->s->d;
    int n = td_daemon_ndevices(d), mem = 0;
    size_t free_b = 0, total_b = 0;

    td_pw_array(&c->w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        td_device_view v;
        td_error_t e;
        td_daemon_device(d, i, &v);
        /* A device whose memory cannot be read is listed without it; cpu devices share the
         * machine's memory, read once for all of them. */
        if (i == 0 || v.kind != TD_DEVICE_CPU)
            mem = td_daemon_device_memory(d, i, &free_b, &total_b, &e) == 0;
        td_pw_map(&c->w, mem ? 5 : 3);
        if (mem) {
            td_pw_str(&c->w, "free_bytes");
            td_pw_int(&c->w, (int64_t)free_b);
            td_pw_str(&c->w, "total_bytes");
            td_pw_int(&c->w, (int64_t)total_b);
        }
        td_pw_str(&c->w, "name");
        td_pw_str(&c->w, v.name);
        td_pw_str(&c->w, "job_id");
        if (v.job != 0)
            td_pw_int(&c->w, v.job);
        else
            td_pw_nil(&c->w);
        td_pw_str(&c->w, "job_name");
        td_pw_str(&c->w, v.job_name);
    }
}

/* Who is connected, and how much each has not yet read: a stalled watcher shows here. */
static void write_clients(td_conn *c)
{
    td_pw_array(&c->w, (uint32_t)c->s->nconns);
    for (td_conn *o = c->s->conns; o != NULL; o = o->next) {
        uint32_t nstreams = 0;
        for (td_stream *st = o->streams; st != NULL; st = st->next)
            nstreams++;
        td_pw_map(&c->w, 4);
        td_pw_str(&c->w, "pid");
        td_pw_int(&c->w, o->pid);
        td_pw_str(&c->w, "uid");
        td_pw_int(&c->w, o->uid);
        td_pw_str(&c->w, "pending_bytes");
        td_pw_int(&c->w, (int64_t)o->pending);
        td_pw_str(&c->w, "streams");
        td_pw_int(&c->w, nstreams);
    }
}

/* The queued jobs' ids, in the order the scheduler takes them: priority, then submission. */
static void write_queued(td_conn *c, int64_t id)
{
    size_t n = td_daemon_queued(c->s->d, NULL, 0);
    int64_t *ids = n > 0 ? malloc(n * sizeof(*ids)) : NULL;

    if (n > 0 && ids == NULL) {
        td_pw_array(&c->w, 0);
        td_log_warn("client pid %lld: info (request %lld) lists no queued job: out of memory",
                    (long long)c->pid, (long long)id);
        return;
    }
    n = td_daemon_queued(c->s->d, ids, n);
    td_pw_array(&c->w, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        td_pw_int(&c->w, ids[i]);
    free(ids);
}

static void req_info(td_conn *c, int64_t id)
{
    struct stat st;

    reply_begin(c, "info", id, 6);
    td_pw_str(&c->w, "version");
    td_pw_str(&c->w, TD_VERSION);
    td_pw_str(&c->w, "protocol");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    td_pw_str(&c->w, "store");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "path");
    td_pw_str(&c->w, c->s->cfg.db_path);
    td_pw_str(&c->w, "size_bytes");
    td_pw_int(&c->w, stat(c->s->cfg.db_path, &st) == 0 ? (int64_t)st.st_size : 0);
    td_pw_str(&c->w, "devices");
    write_devices(c);
    td_pw_str(&c->w, "clients");
    write_clients(c);
    td_pw_str(&c->w, "queued");
    write_queued(c, id);
    conn_send(c);
}

typedef struct log_lines {
    td_pw *w;
    int64_t last_id;
} log_lines;

static int write_log_line(void *ud, const td_job_log_row *row)
{
    log_lines *l = ud;
    td_pw_array(l->w, 3);
    td_pw_double(l->w, row->time);
    td_pw_int(l->w, row->level);
    td_pw_str(l->w, row->msg);
    return 0;
}

static int skip_log_line(void *ud, const td_job_log_row *row)
{
    ((log_lines *)ud)->last_id = row->id;
    return 0;
}

#define TD_LOG_LINES_MAX 10000 /* lines one logs reply carries: the newest */

static void req_logs(td_conn *c, const td_pval *root, int64_t id)
{
    td_store *store = c->s->store;
    td_job_row row = {0};
    td_error_t err;
    log_lines l = {.w = &c->w};
    size_t ndone = 0, count = 0;
    int64_t job;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_store_job_get(store, job, &row, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    td_job_row_clear(&row);
    /* Count first, so that the array header can be written before the lines, and skip the
     * oldest lines past the limit. */
    if (td_store_log_read(store, job, 0, SIZE_MAX, skip_log_line, &l, &count, &err) != 0 ||
        (l.last_id = 0,
         count > TD_LOG_LINES_MAX && td_store_log_read(store, job, 0, count - TD_LOG_LINES_MAX,
                                                       skip_log_line, &l, &ndone, &err) != 0)) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    reply_begin(c, "logs", id, 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "lines");
    td_pw_array(&c->w, (uint32_t)(count < TD_LOG_LINES_MAX ? count : TD_LOG_LINES_MAX));
    if (td_store_log_read(store, job, l.last_id, TD_LOG_LINES_MAX, write_log_line, &l, &ndone,
                          &err) != 0) {
        /* Half a reply is already in c->w: the frame cannot be finished honestly. */
        td_log_warn("client pid %lld: logs of job %lld: %s", (long long)c->pid, (long long)job,
                    err.msg);
        send_error(c, id, err.code, err.msg);
        return;
    }
    conn_send(c);
}

/* metrics and watch: both start a stream; watch follows the job until it ends. */
static void req_stream(td_conn *c, const td_pval *root, int64_t id, int watch)
{
    const td_pval *keys = td_pv_get(root, "keys");
    td_job_live live;
    td_stream *st;
    td_job_row row = {0};
    td_error_t err;
    int64_t job, since = 0;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_pv_get(root, "since") != NULL &&
        (td_pv_int(td_pv_get(root, "since"), &since) != 0 || since < 0)) {
        send_error(c, id, TD_EPROTO, "since: must be an integer >= 0");
        return;
    }
    if (keys != NULL && td_pv_type_of(keys) != TD_PV_ARRAY) {
        send_error(c, id, TD_EPROTO, "keys: must be a list of metric names");
        return;
    }
    if (td_store_job_get(c->s->store, job, &row, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    td_job_row_clear(&row);
    st = calloc(1, sizeof(*st));
    if (st == NULL ||
        (td_pv_len(keys) > 0 && (st->keys = calloc(td_pv_len(keys), sizeof(char *))) == NULL)) {
        free(st);
        send_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    for (size_t i = 0; i < td_pv_len(keys); i++) {
        char key[TD_STORE_MAX_KEY];
        if (td_pv_strcpy(td_pv_at(keys, i), key, sizeof(key)) != 0 ||
            (st->keys[st->nkeys++] = strdup(key)) == NULL) {
            st->c = c;
            st->next = c->streams;
            c->streams = st;
            stream_free(st);
            send_error(c, id, TD_EPROTO, "keys: each must be a metric name under 64 bytes");
            return;
        }
    }
    st->c = c;
    st->req_id = id;
    st->job = job;
    st->watch = watch;
    td_metric_cursor_init(&st->cur, since);
    st->next = c->streams;
    c->streams = st;
    if (watch && td_daemon_job_live(c->s->d, job, &live))
        send_state(st, &live);
    stream_pump(st);
}

/* ---- export and sample: work on the threadpool, then a reply or a run of chunks ---- */

/* Bytes of model file per chunk frame: the protocol's limit on one bin (a frame stays far
 * below TD_PROTO_MAX_FRAME). */
#define TD_EXPORT_CHUNK TD_PROTO_MAX_STR

static char xfer_buf[TD_EXPORT_CHUNK]; /* loop thread only */

static void conn_free(td_conn *c);
static void serve_frames(td_conn *c, const char *bytes, size_t n);
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static const char *work_name(const td_work *w)
{
    return w->kind == TD_WORK_EXPORT ? "export" : "sample";
}

/* The connection's export or sample is answered: it reads requests again, first those that
 * arrived meanwhile and wait in its reader. */
static void conn_resume(td_conn *c)
{
    int rc;

    c->busy = 0;
    if (c->closing)
        return;
    rc = uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read);
    if (rc != 0) {
        td_log_warn("client pid %lld: cannot read again: %s", (long long)c->pid, uv_strerror(rc));
        conn_close(c);
        return;
    }
    serve_frames(c, "", 0);
}

static void xfer_done(td_conn *c)
{
    td_work_free(c->xfer);
    c->xfer = NULL;
    conn_resume(c);
}

static void send_chunk(td_conn *c, const td_work *w, const char *data, size_t len)
{
    reply_begin(c, "chunk", w->req_id, 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, w->job);
    td_pw_str(&c->w, "data");
    td_pw_bin(&c->w, data, len);
    conn_send(c);
}

static void send_xfer_end(td_conn *c, const td_work *w)
{
    reply_begin(c, "end", w->req_id, 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, w->job);
    td_pw_str(&c->w, "bytes");
    td_pw_int(&c->w, w->size);
    conn_send(c);
}

/* Sends the exported file a chunk at a time while the client keeps up (below
 * TD_CONN_HIGH_WATER; on_write calls again once it has drained below TD_CONN_LOW_WATER), then
 * the end frame. The file was written just now, so its reads come from the page cache: one
 * chunk costs the loop thread a copy, not a wait on the disk. */
static void xfer_pump(td_conn *c)
{
    td_work *w = c->xfer;
    char msg[160];
    ssize_t n;

    while (!c->closing && c->pending < TD_CONN_HIGH_WATER) {
        if (c->xfer_sent == w->size) {
            td_log_info("client pid %lld: job %lld exported, %lld bytes", (long long)c->pid,
                        (long long)w->job, (long long)w->size);
            send_xfer_end(c, w);
            xfer_done(c);
            return;
        }
        do
            n = read(w->fd, xfer_buf, sizeof(xfer_buf));
        while (n < 0 && errno == EINTR);
        if (n <= 0) {
            snprintf(msg, sizeof(msg),
                     "job %lld: the exported file ended after %lld of %lld bytes%s%s",
                     (long long)w->job, (long long)c->xfer_sent, (long long)w->size,
                     n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
            send_error(c, w->req_id, TD_EIO, msg);
            xfer_done(c);
            return;
        }
        c->xfer_sent += n;
        send_chunk(c, w, xfer_buf, (size_t)n);
    }
}

static void send_sample(td_conn *c, const td_work *w)
{
    reply_begin(c, "sample", w->req_id, 3);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, w->job);
    td_pw_str(&c->w, "text");
    td_pw_strn(&c->w, w->text, w->text_len);
    td_pw_str(&c->w, "seed");
    td_pw_int(&c->w, (int64_t)w->seed);
    conn_send(c);
}

/* Back on the loop thread. A connection that closed meanwhile only lets go of its memory. */
static void on_work_done(td_work *w)
{
    td_conn *c = w->ud;

    c->refs--;
    if (c->closing) {
        td_work_free(w);
        if (c->closed && c->refs == 0)
            conn_free(c);
        return;
    }
    if (w->rc != 0) {
        td_log_info("client pid %lld: %s refused: %s", (long long)c->pid, work_name(w), w->err.msg);
        send_error(c, w->req_id, w->rc, w->err.msg);
        td_work_free(w);
        conn_resume(c);
        return;
    }
    if (w->kind == TD_WORK_SAMPLE) {
        send_sample(c, w);
        td_work_free(w);
        conn_resume(c);
        return;
    }
    c->xfer = w;
    c->xfer_sent = 0;
    xfer_pump(c);
}

/* Runs w on the threadpool for c, which reads no further request until w is answered (so that
 * replies keep the order of requests). Takes w. */
static void work_start(td_conn *c, td_work *w, int64_t id)
{
    int rc;

    w->ud = c;
    w->req_id = id;
    rc = td_work_start(w, c->s->loop, on_work_done);
    if (rc != 0) {
        send_error(c, id, rc, uv_strerror(rc));
        td_work_free(w);
        return;
    }
    td_log_info("client pid %lld uid %lld: %s of job %lld", (long long)c->pid, (long long)c->uid,
                work_name(w), (long long)w->job);
    c->refs++;
    c->busy = 1;
    uv_read_stop((uv_stream_t *)&c->pipe);
}

static void req_export(td_conn *c, const td_pval *root, int64_t id)
{
    td_work *w;
    td_error_t err;
    int64_t job;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, c->s->d, c->s->cfg.state_dir, TD_WORK_EXPORT, job, c->uid, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    work_start(c, w, id);
}

/* The optional fields of a sample request; -1 after an error frame naming the bad one. */
static int sample_args(td_conn *c, const td_pval *root, int64_t id, td_work *w)
{
    const td_pval *v;
    int64_t tokens = TD_SAMPLE_DEFAULT_TOKENS, seed = -1;
    double temperature = 1.0;
    const char *prompt = "";
    size_t len = 0;

    if ((v = td_pv_get(root, "tokens")) != NULL &&
        (td_pv_int(v, &tokens) != 0 || tokens < 1 || tokens > TD_SAMPLE_MAX_TOKENS)) {
        send_error(c, id, TD_EPROTO, "tokens: must be an integer from 1 to 4096");
        return -1;
    }
    if ((v = td_pv_get(root, "temperature")) != NULL &&
        (td_pv_double(v, &temperature) != 0 || !isfinite(temperature) || temperature < 0)) {
        send_error(c, id, TD_EPROTO,
                   "temperature: must be a number >= 0 (0: always the likeliest)");
        return -1;
    }
    if ((v = td_pv_get(root, "prompt")) != NULL &&
        ((prompt = td_pv_str(v, &len)) == NULL || memchr(prompt, '\0', len) != NULL)) {
        send_error(c, id, TD_EPROTO, "prompt: must be a string without NUL bytes");
        return -1;
    }
    if ((v = td_pv_get(root, "seed")) != NULL && (td_pv_int(v, &seed) != 0 || seed < 0)) {
        send_error(c, id, TD_EPROTO, "seed: must be an integer >= 0");
        return -1;
    }
    w->prompt = strndup(prompt, len);
    if (w->prompt == NULL) {
        send_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    w->tokens = (int)tokens;
    w->temperature = (float)temperature;
    /* No seed: a new one each time, sent back so that the text can be had again. */
    w->seed = seed >= 0 ? (uint64_t)seed : uv_hrtime() & INT64_MAX;
    return 0;
}

static void req_sample(td_conn *c, const td_pval *root, int64_t id)
{
    td_work *w;
    td_error_t err;
    int64_t job;

    if (get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, c->s->d, c->s->cfg.state_dir, TD_WORK_SAMPLE, job, c->uid, &err) != 0) {
        send_error(c, id, err.code, err.msg);
        return;
    }
    if (sample_args(c, root, id, w) != 0) {
        td_work_free(w);
        return;
    }
    work_start(c, w, id);
}

static void handle_frame(td_conn *c, const td_proto_frame *f)
{
    const td_pval *root = td_proto_frame_root(f);
    char type[32];
    int64_t id;

    if (td_pv_int(td_pv_get(root, "id"), &id) != 0 || id < 0) {
        send_error(c, -1, TD_EPROTO, "id: every request needs an integer id >= 0");
        return;
    }
    if (td_pv_strcpy(td_pv_get(root, "type"), type, sizeof(type)) != 0) {
        send_error(c, id, TD_EPROTO, "type: every request needs a type string");
        return;
    }
    if (!c->hello && strcmp(type, "hello") != 0) {
        send_error(c, id, TD_EPROTO, "the first request must be hello");
        conn_close(c);
        return;
    }
    if (strcmp(type, "hello") == 0)
        req_hello(c, root, id);
    else if (strcmp(type, "submit") == 0)
        req_submit(c, root, id);
    else if (strcmp(type, "status") == 0)
        req_status(c, root, id);
    else if (strcmp(type, "list") == 0)
        req_list(c, id);
    else if (strcmp(type, "cancel") == 0)
        req_cancel(c, root, id);
    else if (strcmp(type, "metrics") == 0)
        req_stream(c, root, id, 0);
    else if (strcmp(type, "info") == 0)
        req_info(c, id);
    else if (strcmp(type, "logs") == 0)
        req_logs(c, root, id);
    else if (strcmp(type, "watch") == 0)
        req_stream(c, root, id, 1);
    else if (strcmp(type, "export") == 0)
        req_export(c, root, id);
    else if (strcmp(type, "sample") == 0)
        req_sample(c, root, id);
    else {
        char msg[96];
        snprintf(msg, sizeof(msg), "type: unknown request \"%s\"", type);
        send_error(c, id, TD_EPROTO, msg);
    }
}

/* ---- connections ---- */

static void conn_free(td_conn *c)
{
    td_proto_reader_free(c->reader);
    td_pw_free(&c->w);
    free(c);
}

static void on_conn_closed(uv_handle_t *h)
{
    td_conn *c = (td_conn *)h;
    td_server *s = c->s;

    for (td_conn **p = &s->conns; *p != NULL; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    s->nconns--;
    c->closed = 1;
    if (c->refs == 0)
        conn_free(c);
}

/* Closes a connection; its memory goes in the close callback (or, when threadpool work still
 * holds it, when the last of that work is back), never here. */
static void conn_close(td_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    while (c->streams != NULL)
        stream_free(c->streams);
    td_work_free(c->xfer);
    c->xfer = NULL;
    uv_close((uv_handle_t *)&c->pipe, on_conn_closed);
}

static char readbuf[64 << 10]; /* loop thread only */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    *buf = uv_buf_init(readbuf, sizeof(readbuf));
}

/* A printable sample of bad bytes for the log. */
static void sample_bytes(char *out, size_t size, const char *p, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < n && i < 16 && o + 4 < size; i++)
        o += (size_t)snprintf(out + o, size - o, "%02x", (unsigned char)p[i]);
    out[o] = '\0';
}

/* Handles the frames the reader holds, in order, until the connection closes or a request
 * makes it busy (the rest wait in the reader). bytes (n) are the last read, for the log. */
static void serve_frames(td_conn *c, const char *bytes, size_t n)
{
    td_proto_frame *f;
    td_error_t err;
    int rc = 0;

    while (!c->closing && !c->busy && (rc = td_proto_reader_next(c->reader, &f, &err)) == 1) {
        handle_frame(c, f);
        td_proto_frame_free(f);
    }
    if (!c->closing && rc < 0) {
        char sample[40];
        sample_bytes(sample, sizeof(sample), bytes, n);
        td_log_warn("client pid %lld uid %lld: bad frame (%s), closing; bytes %s...",
                    (long long)c->pid, (long long)c->uid, err.msg, sample);
        send_error(c, -1, rc, err.msg);
        conn_close(c);
    }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    td_conn *c = (td_conn *)s;

    if (nread < 0) {
        if (nread != UV_EOF)
            td_log_info("client pid %lld: read: %s", (long long)c->pid, uv_strerror((int)nread));
        conn_close(c);
        return;
    }
    if (td_proto_reader_feed(c->reader, buf->base, (size_t)nread) != 0) {
        conn_close(c);
        return;
    }
    serve_frames(c, buf->base, (size_t)nread);
}

static void peer_creds(td_conn *c)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);
    uv_os_fd_t fd;

    c->uid = -1;
    c->gid = -1;
    c->pid = -1;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0 &&
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->pid = cred.pid;
    }
}

static void on_connection(uv_stream_t *listener, int status)
{
    td_server *s = listener->data;
    int max = s->cfg.max_conns > 0 ? s->cfg.max_conns : TD_MAX_CONNS, rc;
    td_conn *c;

    if (status < 0) {
        td_log_warn("accept: %s", uv_strerror(status));
        return;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL || uv_pipe_init(s->loop, &c->pipe, 0) != 0) {
        free(c);
        return;
    }
    c->s = s;
    td_pw_init(&c->w);
    c->next = s->conns;
    s->conns = c;
    s->nconns++;
    if (uv_accept(listener, (uv_stream_t *)&c->pipe) != 0 ||
        td_proto_reader_new(&c->reader, 0) != 0) {
        conn_close(c);
        return;
    }
    peer_creds(c);
    if (s->nconns > max) {
        td_log_warn("client pid %lld: refused, %d connections open", (long long)c->pid,
                    s->nconns - 1);
        send_error(c, -1, TD_E2BIG, "too many connections");
        conn_close(c);
        return;
    }
    rc = uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read);
    if (rc != 0) {
        td_log_warn("client pid %lld: cannot read: %s", (long long)c->pid, uv_strerror(rc));
        conn_close(c);
    }
}

#define TD_LISTEN_BACKLOG   128  /* connections the kernel holds for traind before accept */
#define TD_LISTEN_FDS_START 3    /* sd_listen_fds(3): the first descriptor systemd passes */
#define TD_SOCKET_MODE      0660 /* owner and group may connect; nobody else */

/* Removes a stale socket file left by a daemon that died, but never a live one. */
static int clear_stale_socket(const char *path, td_error_t *err)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat stt;
    int fd, live;

    if (lstat(path, &stt) != 0)
        return 0;
    if (!S_ISSOCK(stt.st_mode))
        return td_error_set(err, TD_EINVAL, "%s exists and is not a socket", path);
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return td_error_set(err, -errno, "socket: %s", strerror(errno));
    live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    if (live)
        return td_error_set(err, TD_EINVAL, "another traind is listening on %s", path);
    unlink(path);
    return 0;
}

/* The listening socket systemd passed by socket activation (sd_listen_fds(3)): descriptor 3,
 * when $LISTEN_PID is this process and $LISTEN_FDS is at least 1. Sets *fd to it, or to -1
 * when nothing was passed; fails when what was passed is not a listening Unix stream socket.
 * The variables are left set: they name this pid, so no child takes them for its own, and a
 * re-exec of traind itself (the same pid) finds the same socket again. */
static int inherited_socket(td_server *s, int *fd, td_error_t *err)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    struct sockaddr_un sa;
    socklen_t salen = sizeof(sa), len;
    int type = 0, listening = 0;
    char *end;
    long n;

    *fd = -1;
    if (pid == NULL || fds == NULL || strtol(pid, &end, 10) != (long)getpid() || *end != '\0')
        return 0;
    n = strtol(fds, &end, 10);
    if (*end != '\0' || n < 1)
        return 0;
    len = sizeof(type);
    if (getsockopt(TD_LISTEN_FDS_START, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
        type != SOCK_STREAM)
        goto bad;
    len = sizeof(listening);
    if (getsockopt(TD_LISTEN_FDS_START, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        !listening)
        goto bad;
    if (getsockname(TD_LISTEN_FDS_START, (struct sockaddr *)&sa, &salen) != 0 ||
        sa.sun_family != AF_UNIX)
        goto bad;
    if (n > 1)
        td_log_warn("LISTEN_FDS=%ld: traind uses descriptor %d only", n, TD_LISTEN_FDS_START);
    /* The path systemd bound is the one clients use: report that one, not the configured. */
    if (salen > offsetof(struct sockaddr_un, sun_path) && sa.sun_path[0] != '\0') {
        sa.sun_path[sizeof(sa.sun_path) - 1] = '\0';
        if (strcmp(sa.sun_path, s->cfg.socket_path) != 0)
            td_log_notice("socket activation: listening on %s, which systemd passed, not on %s",
                          sa.sun_path, s->cfg.socket_path);
        snprintf(s->cfg.socket_path, sizeof(s->cfg.socket_path), "%s", sa.sun_path);
    }
    *fd = TD_LISTEN_FDS_START;
    return 0;
bad:
    return td_error_set(err, TD_EINVAL,
                        "LISTEN_FDS=%s: descriptor %d is not a listening Unix stream socket", fds,
                        TD_LISTEN_FDS_START);
}

/* Binds the configured path and gives it mode 0660 and the configured group, both set
 * explicitly: neither the umask nor the daemon's own group decides who may connect. Until
 * uv_listen() the socket refuses connections, so nobody gets in while the mode is still the
 * umask's. On failure the path is removed again. */
static int bind_socket(td_server *s, td_error_t *err)
{
    const char *path = s->cfg.socket_path;
    size_t max = sizeof(((struct sockaddr_un *)NULL)->sun_path) - 1;
    int rc;

    /* libuv 1.44 would silently cut a longer path and bind somewhere else. */
    if (strlen(path) > max)
        return td_error_set(err, TD_EINVAL, "socket path %s is %zu bytes; the limit is %zu", path,
                            strlen(path), max);
    rc = clear_stale_socket(path, err);
    if (rc != 0)
        return rc;
    rc = uv_pipe_bind(&s->listener, path);
    if (rc != 0)
        return td_error_set(err, rc, "cannot bind %s: %s", path, uv_strerror(rc));
    if (s->cfg.socket_group[0] != '\0' && chown(path, (uid_t)-1, (gid_t)s->cfg.socket_gid) != 0)
        rc = td_error_set(err, -errno, "cannot give %s to group %s: %s", path, s->cfg.socket_group,
                          strerror(errno));
    else if (chmod(path, TD_SOCKET_MODE) != 0)
        rc = td_error_set(err, -errno, "cannot set the mode of %s: %s", path, strerror(errno));
    if (rc != 0)
        unlink(path);
    return rc;
}

/* Listens on the socket systemd passed, or else on one bound here. */
static int listen_socket(td_server *s, td_error_t *err)
{
    int fd, rc;

    rc = inherited_socket(s, &fd, err);
    if (rc != 0)
        return rc;
    rc = uv_pipe_init(s->loop, &s->listener, 0);
    if (rc != 0)
        return td_error_set(err, rc, "uv_pipe_init: %s", uv_strerror(rc));
    s->listening = 1;
    s->listener.data = s;
    if (fd >= 0) {
        rc = uv_pipe_open(&s->listener, fd);
        if (rc != 0)
            td_error_set(err, rc, "cannot use the socket systemd passed: %s", uv_strerror(rc));
        s->inherited = rc == 0;
    } else {
        rc = bind_socket(s, err);
    }
    if (rc == 0) {
        rc = uv_listen((uv_stream_t *)&s->listener, TD_LISTEN_BACKLOG, on_connection);
        if (rc != 0) {
            td_error_set(err, rc, "cannot listen on %s: %s", s->cfg.socket_path, uv_strerror(rc));
            if (!s->inherited)
                unlink(s->cfg.socket_path);
        }
    }
    if (rc != 0) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        s->listening = 0;
    }
    return rc;
}

int td_server_new(td_server **out, uv_loop_t *loop, const td_config *cfg, td_daemon *d,
                  td_error_t *err)
{
    td_server *s = calloc(1, sizeof(*s));
    int rc;

    *out = NULL;
    if (s == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    s->loop = loop;
    s->cfg = *cfg;
    s->d = d;
    s->store = td_daemon_store(d);
    rc = listen_socket(s, err);
    /* Even on failure: a listener that failed after uv_pipe_init is closing, and its memory,
     * s, must outlive the close, which the caller's loop runs before td_server_free. */
    *out = s;
    return rc;
}

const char *td_server_path(const td_server *s)
{
    return s->cfg.socket_path;
}

int td_server_close(td_server *s, int keep_listener)
{
    uv_os_fd_t fd = -1;
    int kept = -1;

    for (td_conn *c = s->conns; c != NULL; c = c->next)
        conn_close(c);
    if (!s->listening)
        return -1;
    if (keep_listener && s->inherited && uv_fileno((uv_handle_t *)&s->listener, &fd) == 0) {
        kept = fcntl(fd, F_DUPFD_CLOEXEC, 10);
        if (kept < 0)
            td_log_err("cannot keep the socket systemd passed for the re-exec: %s; systemd's "
                       "socket unit still holds it",
                       strerror(errno));
    }
    uv_close((uv_handle_t *)&s->listener, NULL);
    s->listening = 0;
    if (!s->inherited)
        unlink(s->cfg.socket_path);
    return kept;
}

void td_server_free(td_server *s)
{
    free(s);
}
