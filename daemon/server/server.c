/* The control socket (server.h): accepts connections, cuts frames, answers requests, closes
 * connections past their timeouts. The metric streams are in stream.c, the job maps and the
 * pages of list and logs in listing.c (server_int.h). Loop thread only.
 *
 * A connection's output is held to TD_CONN_HIGH_WATER: streams send only below it, and a
 * connection whose unsent replies pass it is read no further (its requests wait in the
 * socket) until it has drained below TD_CONN_LOW_WATER.
 * What one connection can make the daemon hold is therefore bounded: its reader (one read
 * plus one frame), the high-water mark plus one frame of replies, and its streams (at most
 * max_streams_per_conn of them, each naming at most TD_PROTO_MAX_KEYS keys in one
 * allocation), all freed when it closes. A sweep timer closes connections that have not
 * said hello within hello_timeout_s and idle ones after idle_timeout_s; a connection with a
 * stream, an export or a sample under way is not idle.
 *
 * Replies that list things (list, logs, info) are bounded whatever the daemon holds: list
 * and logs are paged (PROTOCOL.md), info caps its lists and says how long they are.
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
#include "server_int.h"
#include "td_log.h"
#include "td_text.h"
#include "work.h"

typedef struct wreq {
    uv_write_t req;
    td_conn *c;
    size_t len;
    char data[];
} wreq;

static void conn_close(td_conn *c);
static void xfer_pump(td_conn *c);
static void serve_frames(td_conn *c, const char *bytes, size_t n);
static void conn_want_read(td_conn *c);

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
    c->since_ms = uv_now(c->s->loop);
    if (c->pending < TD_CONN_LOW_WATER) {
        td_stream *st = c->streams;
        while (st != NULL && !c->closing) {
            td_stream *next = st->next;
            td__stream_pump(st);
            st = next;
        }
        if (c->xfer != NULL && !c->closing)
            xfer_pump(c);
    }
    if (c->paused && c->pending < TD_CONN_LOW_WATER && !c->closing) {
        /* Drained: the requests that waited in the reader first, then the socket again. */
        c->paused = 0;
        serve_frames(c, "", 0);
        conn_want_read(c);
    }
}

/* Sends the frame built in c->w. */
void td__conn_send(td_conn *c)
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
void td__reply_begin(td_conn *c, const char *type, int64_t id, uint32_t extra)
{
    td_pw_reset(&c->w);
    td_pw_map(&c->w, 2 + extra);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, id);
}

void td__send_error(td_conn *c, int64_t id, int code, const char *msg)
{
    td_pw_reset(&c->w);
    td_proto_write_error(&c->w, id, code, msg);
    td__conn_send(c);
}

/* ---- requests ---- */

int td__get_job_id(td_conn *c, const td_pval *root, int64_t id, int64_t *job)
{
    if (td_pv_int(td_pv_get(root, "job_id"), job) != 0 || *job < 1) {
        td__send_error(c, id, TD_EPROTO, "job_id: must be a positive integer");
        return -1;
    }
    return 0;
}

/* Reads job's row into *row (caller clears it); else answers request id with an error frame
 * and returns -1. A job that does not exist is "no job 12", whichever request asked. */
int td__get_job_row(td_conn *c, int64_t id, int64_t job, td_job_row *row)
{
    td_error_t err;
    int rc = td_store_job_get(c->s->store, job, row, &err);

    if (rc == TD_ENOTFOUND)
        td_error_set(&err, rc, "no job %lld", (long long)job);
    if (rc != 0) {
        td__send_error(c, id, rc, err.msg);
        return -1;
    }
    return 0;
}

/* An optional integer field from lo to hi: 0 with *out set (left alone when absent), or -1
 * after an error frame "name: must be an integer from lo to hi". */
int td__opt_int(td_conn *c, const td_pval *root, int64_t id, const char *name, int64_t lo,
                int64_t hi, int64_t *out)
{
    const td_pval *v = td_pv_get(root, name);
    char msg[128];

    if (v == NULL)
        return 0;
    if (td_pv_int(v, out) == 0 && *out >= lo && *out <= hi)
        return 0;
    snprintf(msg, sizeof(msg), "%s: must be an integer from %lld to %lld", name, (long long)lo,
             (long long)hi);
    td__send_error(c, id, TD_EPROTO, msg);
    return -1;
}

static void req_hello(td_conn *c, const td_pval *root, int64_t id)
{
    int64_t version = 0;

    if (td_pv_int(td_pv_get(root, "version"), &version) != 0 || version != TD_PROTO_VERSION) {
        char msg[128];
        snprintf(msg, sizeof(msg), "protocol version %lld is not spoken here; traind speaks %d",
                 (long long)version, TD_PROTO_VERSION);
        td__send_error(c, id, TD_EVERSION, msg);
        conn_close(c);
        return;
    }
    c->hello = 1;
    td__reply_begin(c, "hello", id, 3);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    td_pw_str(&c->w, "server");
    td_pw_str(&c->w, "traind " TD_VERSION);
    /* What this daemon understands beyond version 1's first form, so that a client never
     * sends a flag an older daemon would ignore (a submit's dry_run would queue the job). */
    td_pw_str(&c->w, "features");
    td_pw_array(&c->w, 6);
    td_pw_str(&c->w, "dry_run");
    td_pw_str(&c->w, "list_pages");
    td_pw_str(&c->w, "logs_pages");
    td_pw_str(&c->w, "delete");
    td_pw_str(&c->w, "safetensors");
    td_pw_str(&c->w, "classify");
    td__conn_send(c);
}

/* ---- submit --dry-run ---- */

/* The estimate reply of PROTOCOL.md ("submit", dry run). */
static void send_estimate(td_conn *c, int64_t id, const td_jobspec *spec, int asked_auto,
                          const td_memguard *g, const char *message)
{
    td_pw *w = &c->w;
    int world = spec->train.world;
    int batch = asked_auto ? (g->chose_batch > 0 ? g->chose_batch : world) : spec->train.batch_size;

    td__reply_begin(c, "estimate", id, 11);
    td_pw_str(w, "device");
    td_pw_str(w, g->device);
    td_pw_str(w, "devices");
    td_pw_int(w, world);
    td_pw_str(w, "batch_size");
    td_pw_int(w, batch);
    td_pw_str(w, "batch_auto");
    td_pw_bool(w, asked_auto);
    td_pw_str(w, "memory");
    td_pw_map(w, 9);
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
    td_pw_str(w, "data");
    td_pw_int(w, (int64_t)g->est.data);
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
    td__conn_send(c);
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
        td__send_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    rc = td_daemon_dry_run(c->s->d, job, c->uid, c->gid, spec, &g, &asked_auto, &estimated, &err);
    /* Not fitting is an answer, not an error: the estimate goes back with the refusal. */
    if (estimated) {
        send_estimate(c, id, spec, asked_auto, &g, rc == 0 ? NULL : err.msg);
    } else {
        td_log_info("client pid %lld uid %lld: dry run refused: %s", (long long)c->pid,
                    (long long)c->uid, err.msg);
        td__send_error(c, id, err.code, err.msg);
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
        td__send_error(c, id, TD_EPROTO, "dry_run: must be true or false");
        return;
    }
    if (dry_run) {
        req_dry_run(c, td_pv_get(root, "job"), id);
        return;
    }

    if (td_daemon_submit(c->s->d, td_pv_get(root, "job"), c->uid, c->gid, &job, &err) != 0) {
        td_log_info("client pid %lld uid %lld: job refused: %s", (long long)c->pid,
                    (long long)c->uid, err.msg);
        td__send_error(c, id, err.code, err.msg);
        return;
    }
    td__reply_begin(c, "submitted", id, 1);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td__conn_send(c);
}

static void req_cancel(td_conn *c, const td_pval *root, int64_t id)
{
    char state[TD_STORE_MAX_STATE];
    td_error_t err;
    int64_t job;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_daemon_cancel(c->s->d, job, c->uid, state, &err) != 0) {
        td__send_error(c, id, err.code, err.msg);
        return;
    }
    td__reply_begin(c, "cancelled", id, 2);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "state");
    td_pw_str(&c->w, state);
    td__conn_send(c);
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
        if (v.job_name != NULL)
            td__write_text(&c->w, v.job_name, strlen(v.job_name), 0, 4 * TD_STORE_MAX_NAME);
        else
            td_pw_nil(&c->w);
    }
}

/* Who is connected, and how much each has not yet read: a stalled watcher shows here. The
 * first TD_INFO_CLIENTS connections (newest first); clients_total counts them all. */
static void write_clients(td_conn *c)
{
    uint32_t n = c->s->nconns < TD_INFO_CLIENTS ? (uint32_t)c->s->nconns : TD_INFO_CLIENTS, k = 0;

    td_pw_array(&c->w, n);
    for (td_conn *o = c->s->conns; o != NULL && k < n; o = o->next, k++) {
        td_pw_map(&c->w, 4);
        td_pw_str(&c->w, "pid");
        td_pw_int(&c->w, o->pid);
        td_pw_str(&c->w, "uid");
        td_pw_int(&c->w, o->uid);
        td_pw_str(&c->w, "pending_bytes");
        td_pw_int(&c->w, (int64_t)o->pending);
        td_pw_str(&c->w, "streams");
        td_pw_int(&c->w, o->nstreams);
    }
}

/* The first TD_INFO_QUEUED queued jobs' ids, in the order the scheduler takes them:
 * priority, then submission; queued_total counts them all. */
static void write_queued(td_conn *c, int64_t id)
{
    static int64_t ids[TD_INFO_QUEUED]; /* loop thread only */
    size_t total = td_daemon_queued(c->s->d, ids, TD_INFO_QUEUED);
    size_t n = total < TD_INFO_QUEUED ? total : TD_INFO_QUEUED;

    (void)id;
    td_pw_str(&c->w, "queued");
    td_pw_array(&c->w, (uint32_t)n);
    for (size_t i = 0; i < n; i++)
        td_pw_int(&c->w, ids[i]);
    td_pw_str(&c->w, "queued_total");
    td_pw_int(&c->w, (int64_t)total);
}

static void req_info(td_conn *c, int64_t id)
{
    struct stat st;

    td__reply_begin(c, "info", id, 8);
    td_pw_str(&c->w, "version");
    td_pw_str(&c->w, TD_VERSION);
    td_pw_str(&c->w, "protocol");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    td_pw_str(&c->w, "store");
    td_pw_map(&c->w, 3);
    td_pw_str(&c->w, "path");
    td_pw_str(&c->w, c->s->cfg.db_path);
    td_pw_str(&c->w, "size_bytes");
    td_pw_int(&c->w, stat(c->s->cfg.db_path, &st) == 0 ? (int64_t)st.st_size : 0);
    td_pw_str(&c->w, "wal_bytes"); /* a reader holding checkpoints back shows here */
    td_pw_int(&c->w, td_store_wal_bytes(c->s->store));
    td_pw_str(&c->w, "devices");
    write_devices(c);
    td_pw_str(&c->w, "clients");
    write_clients(c);
    td_pw_str(&c->w, "clients_total");
    td_pw_int(&c->w, c->s->nconns);
    write_queued(c, id);
    td__conn_send(c);
}

/* ---- export and sample: work on the threadpool, then a reply or a run of chunks ---- */

/* Bytes of model file per chunk frame: the protocol's limit on one bin (a frame stays far
 * below TD_PROTO_MAX_FRAME). */
#define TD_EXPORT_CHUNK TD_PROTO_MAX_STR

static char xfer_buf[TD_EXPORT_CHUNK]; /* loop thread only */

static void conn_free(td_conn *c);

static const char *work_name(const td_work *w)
{
    return w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST ? "export"
           : w->kind == TD_WORK_SAMPLE                               ? "sample"
           : w->kind == TD_WORK_CLASSIFY                             ? "classify"
                                                                     : "retrieve";
}

/* The connection's export or sample is answered: it reads requests again, first those that
 * arrived meanwhile and wait in its reader. */
static void conn_resume(td_conn *c)
{
    c->busy = 0;
    c->exporting = 0;
    if (c->closing)
        return;
    serve_frames(c, "", 0);
    conn_want_read(c);
}

void td__conn_hold(td_conn *c)
{
    c->refs++;
    c->busy = 1;
    conn_want_read(c);
}

void td__conn_release(td_conn *c)
{
    c->refs--;
    if (c->closing) {
        if (c->closed && c->refs == 0)
            conn_free(c);
        return;
    }
    conn_resume(c);
}

static void xfer_done(td_conn *c)
{
    td_work_free(c->xfer);
    c->xfer = NULL;
    conn_resume(c);
}

/* Begins work w's reply of type with extra pairs after type and id (as td__reply_begin), and
 * writes the first of them, job_id, which every reply to export, sample, classify and retrieve
 * carries. */
static void work_reply_begin(td_conn *c, const td_work *w, const char *type, uint32_t extra)
{
    td__reply_begin(c, type, w->req_id, extra);
    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, w->job);
}

static void send_chunk(td_conn *c, const td_work *w, const char *data, size_t len)
{
    work_reply_begin(c, w, "chunk", 2);
    td_pw_str(&c->w, "data");
    td_pw_bin(&c->w, data, len);
    td__conn_send(c);
}

static void send_xfer_end(td_conn *c, const td_work *w)
{
    work_reply_begin(c, w, "end", 2);
    td_pw_str(&c->w, "bytes");
    td_pw_int(&c->w, w->size);
    td__conn_send(c);
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
            td__send_error(c, w->req_id, TD_EIO, msg);
            xfer_done(c);
            return;
        }
        c->xfer_sent += n;
        send_chunk(c, w, xfer_buf, (size_t)n);
    }
}

static void send_sample(td_conn *c, const td_work *w)
{
    work_reply_begin(c, w, "sample", 3);
    td_pw_str(&c->w, "text");
    td_pw_strn(&c->w, w->text, w->text_len);
    td_pw_str(&c->w, "seed");
    td_pw_int(&c->w, (int64_t)w->seed);
    td__conn_send(c);
}

/* The classify reply of PROTOCOL.md: the labels, then each window's [index, label, score]. */
static void send_classify(td_conn *c, const td_work *w)
{
    work_reply_begin(c, w, "classify", 6);
    td_pw_str(&c->w, "windows");
    td_pw_int(&c->w, w->windows);
    td_pw_str(&c->w, "labels");
    td_pw_array(&c->w, (uint32_t)w->nlabels);
    for (int k = 0; k < w->nlabels; k++) {
        td_pw_map(&c->w, 2);
        td_pw_str(&c->w, "name");
        td_pw_str(&c->w, w->names[k]);
        td_pw_str(&c->w, "prompt");
        td_pw_str(&c->w, w->prompts[k]);
    }
    td_pw_str(&c->w, "results");
    td_pw_array(&c->w, (uint32_t)w->nhits);
    for (int i = 0; i < w->nhits; i++) {
        td_pw_array(&c->w, 3);
        td_pw_int(&c->w, w->hits[i].index);
        td_pw_int(&c->w, w->hits[i].label);
        td_pw_double(&c->w, w->hits[i].score);
    }
    td_pw_str(&c->w, "more");
    td_pw_bool(&c->w, w->first + w->nhits < w->windows);
    td_pw_str(&c->w, "next");
    td_pw_int(&c->w, w->first + w->nhits);
    td__conn_send(c);
}

/* Bytes of a caption in a retrieve reply, escaped (td_text_escape): TD_RETRIEVE_MAX_TOP of them
 * stay inside a frame whatever the shard's bytes. */
#define TD_RETRIEVE_CAPTION_MAX 8192

static char caption_buf[TD_RETRIEVE_CAPTION_MAX + 1]; /* loop thread only */

/* The retrieve reply: the best windows first, each [index, score, caption]. */
static void send_retrieve(td_conn *c, const td_work *w)
{
    work_reply_begin(c, w, "retrieve", 3);
    td_pw_str(&c->w, "windows");
    td_pw_int(&c->w, w->windows);
    td_pw_str(&c->w, "results");
    td_pw_array(&c->w, (uint32_t)w->nhits);
    for (int i = 0; i < w->nhits; i++) {
        const char *cap = w->hits[i].caption != NULL ? w->hits[i].caption : "";
        td_text_escape(caption_buf, sizeof(caption_buf), cap, strlen(cap), 0);
        td_pw_array(&c->w, 3);
        td_pw_int(&c->w, w->hits[i].index);
        td_pw_double(&c->w, w->hits[i].score);
        td_pw_str(&c->w, caption_buf);
    }
    td__conn_send(c);
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
        td__send_error(c, w->req_id, w->rc, w->err.msg);
        td_work_free(w);
        conn_resume(c);
        return;
    }
    if (w->kind == TD_WORK_SAMPLE || w->kind == TD_WORK_CLASSIFY || w->kind == TD_WORK_RETRIEVE) {
        if (w->kind == TD_WORK_SAMPLE)
            send_sample(c, w);
        else if (w->kind == TD_WORK_CLASSIFY)
            send_classify(c, w);
        else
            send_retrieve(c, w);
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
        td__send_error(c, id, rc, uv_strerror(rc));
        td_work_free(w);
        return;
    }
    td_log_info("client pid %lld uid %lld: %s of job %lld", (long long)c->pid, (long long)c->uid,
                work_name(w), (long long)w->job);
    c->refs++;
    c->busy = 1;
    c->exporting = w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST;
    conn_want_read(c);
}

/* Exports uid has under way on every connection: each holds a temporary file as large as its
 * model until its last chunk is read. */
static int exports_of(const td_server *s, int64_t uid)
{
    int n = 0;

    for (const td_conn *o = s->conns; o != NULL; o = o->next)
        n += !o->closing && o->exporting && o->uid == uid;
    return n;
}

/* Whether v is the string s. */
static int pv_is(const td_pval *v, const char *s)
{
    size_t len = 0;
    const char *p = td_pv_str(v, &len);

    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

static void req_export(td_conn *c, const td_pval *root, int64_t id)
{
    int max = c->s->cfg.max_exports_per_user;
    const td_pval *format = td_pv_get(root, "format");
    td_work_kind kind = TD_WORK_EXPORT;
    td_work *w;
    td_error_t err;
    char msg[200];
    int64_t job;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (format != NULL && pv_is(format, "safetensors"))
        kind = TD_WORK_EXPORT_ST;
    else if (format != NULL && !pv_is(format, "llmc")) {
        td__send_error(c, id, TD_EPROTO, "format: must be \"llmc\" or \"safetensors\"");
        return;
    }
    if (max > 0 && exports_of(c->s, c->uid) >= max) {
        snprintf(msg, sizeof(msg),
                 "uid %lld has %d exports under way, the limit (max_exports_per_user); wait for "
                 "one to finish",
                 (long long)c->uid, max);
        td_log_info("client pid %lld: export of job %lld refused: %s", (long long)c->pid,
                    (long long)job, msg);
        td__send_error(c, id, TD_E2BIG, msg);
        return;
    }
    if (td_work_new(&w, c->s->d, c->s->cfg.state_dir, kind, job, c->uid, &err) != 0) {
        td__send_error(c, id, err.code, err.msg);
        return;
    }
    w->uid = c->uid;
    w->gid = c->gid;
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
        td__send_error(c, id, TD_EPROTO, "tokens: must be an integer from 1 to 4096");
        return -1;
    }
    if ((v = td_pv_get(root, "temperature")) != NULL &&
        (td_pv_double(v, &temperature) != 0 || !isfinite(temperature) || temperature < 0)) {
        td__send_error(c, id, TD_EPROTO,
                       "temperature: must be a number >= 0 (0: always the likeliest)");
        return -1;
    }
    if ((v = td_pv_get(root, "prompt")) != NULL &&
        ((prompt = td_pv_str(v, &len)) == NULL || memchr(prompt, '\0', len) != NULL)) {
        td__send_error(c, id, TD_EPROTO, "prompt: must be a string without NUL bytes");
        return -1;
    }
    if ((v = td_pv_get(root, "seed")) != NULL && (td_pv_int(v, &seed) != 0 || seed < 0)) {
        td__send_error(c, id, TD_EPROTO, "seed: must be an integer >= 0");
        return -1;
    }
    w->prompt = strndup(prompt, len);
    if (w->prompt == NULL) {
        td__send_error(c, id, TD_ENOMEM, "out of memory");
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

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, c->s->d, c->s->cfg.state_dir, TD_WORK_SAMPLE, job, c->uid, &err) != 0) {
        td__send_error(c, id, err.code, err.msg);
        return;
    }
    if (sample_args(c, root, id, w) != 0) {
        td_work_free(w);
        return;
    }
    work_start(c, w, id);
}

/* ---- classify and retrieve: a sensorlm's embeddings over a shard ---- */

/* A text field of 1 to max bytes of UTF-8 without control characters, NUL-terminated in a
 * malloc'd copy (*out); -1 after an error frame naming it (what). */
static int text_field(td_conn *c, int64_t id, const td_pval *v, const char *what, size_t max,
                      char **out)
{
    char msg[160];
    size_t len = 0;
    const char *s = v != NULL ? td_pv_str(v, &len) : NULL;

    if (s == NULL || len == 0 || len > max || td_text_check(s, len, NULL) != TD_TEXT_OK) {
        snprintf(msg, sizeof(msg),
                 "%s: must be 1 to %zu bytes of text (UTF-8 without control "
                 "characters)",
                 what, max);
        td__send_error(c, id, TD_EPROTO, msg);
        return -1;
    }
    if ((*out = strndup(s, len)) == NULL) {
        td__send_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    return 0;
}

/* The request's data: an absolute path (the daemon's working directory is nobody's). */
static int data_field(td_conn *c, const td_pval *root, int64_t id, td_work *w)
{
    if (text_field(c, id, td_pv_get(root, "data"), "data", TD_PATH_MAX - 1, &w->data) != 0)
        return -1;
    if (w->data[0] != '/') {
        td__send_error(c, id, TD_EPROTO,
                       "data: must be an absolute path; trainctl resolves relative paths where "
                       "you run it");
        return -1;
    }
    return 0;
}

/* An optional integer field in [lo, hi]; -1 after an error frame with msg. */
static int int_field(td_conn *c, const td_pval *root, int64_t id, const char *key, int64_t lo,
                     int64_t hi, const char *msg, int64_t *out)
{
    const td_pval *v = td_pv_get(root, key);

    if (v != NULL && (td_pv_int(v, out) != 0 || *out < lo || *out > hi)) {
        td__send_error(c, id, TD_EPROTO, msg);
        return -1;
    }
    return 0;
}

/* classify's labels: [{name, prompt (optional)}, ...], 1 to TD_CLASSIFY_MAX_LABELS. */
static int labels_field(td_conn *c, const td_pval *root, int64_t id, td_work *w)
{
    const td_pval *v = td_pv_get(root, "labels");
    size_t n = v != NULL ? td_pv_len(v) : 0;

    if (v == NULL)
        return 0;
    if (td_pv_type_of(v) != TD_PV_ARRAY || n < 1 || n > TD_CLASSIFY_MAX_LABELS) {
        td__send_error(c, id, TD_EPROTO, "labels: must be a list of 1 to 256 {name, prompt}");
        return -1;
    }
    w->names = calloc(n, sizeof(char *));
    w->prompts = calloc(n, sizeof(char *));
    if (w->names == NULL || w->prompts == NULL) {
        td__send_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    for (size_t k = 0; k < n; k++) {
        const td_pval *e = td_pv_at(v, k), *prompt;
        w->nlabels = (int)k + 1;
        if (td_pv_type_of(e) != TD_PV_MAP) {
            td__send_error(c, id, TD_EPROTO, "labels: each must be a map {name, prompt}");
            return -1;
        }
        prompt = td_pv_get(e, "prompt");
        if (text_field(c, id, td_pv_get(e, "name"), "labels: name", 255, &w->names[k]) != 0 ||
            (prompt != NULL &&
             text_field(c, id, prompt, "labels: prompt", TD_LABEL_PROMPT_MAX, &w->prompts[k]) != 0))
            return -1;
    }
    return 0;
}

static void req_classify(td_conn *c, const td_pval *root, int64_t id, td_work_kind kind)
{
    int64_t job,
        first = 0,
        limit = kind == TD_WORK_CLASSIFY ? TD_CLASSIFY_MAX_WINDOWS : TD_RETRIEVE_DEFAULT_TOP;
    td_error_t err;
    td_work *w;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, c->s->d, c->s->cfg.state_dir, kind, job, c->uid, &err) != 0) {
        td__send_error(c, id, err.code, err.msg);
        return;
    }
    w->uid = c->uid;
    w->gid = c->gid;
    if (data_field(c, root, id, w) != 0)
        goto fail;
    if (kind == TD_WORK_CLASSIFY &&
        (labels_field(c, root, id, w) != 0 ||
         int_field(c, root, id, "first", 0, INT64_MAX / 2, "first: must be an integer >= 0",
                   &first) != 0 ||
         int_field(c, root, id, "limit", 1, TD_CLASSIFY_MAX_WINDOWS,
                   "limit: must be an integer from 1 to 4096", &limit) != 0))
        goto fail;
    if (kind == TD_WORK_RETRIEVE &&
        (text_field(c, id, td_pv_get(root, "query"), "query", TD_LABEL_PROMPT_MAX, &w->prompt) !=
             0 ||
         int_field(c, root, id, "top", 1, TD_RETRIEVE_MAX_TOP,
                   "top: must be an integer from 1 to 100", &limit) != 0))
        goto fail;
    w->first = first;
    w->limit = (int)limit;
    work_start(c, w, id);
    return;
fail:
    td_work_free(w);
}

static void handle_frame(td_conn *c, const td_proto_frame *f)
{
    const td_pval *root = td_proto_frame_root(f);
    char type[32], shown[TD_SHOWN_MAX], msg[TD_SHOWN_MAX + 64];
    const char *t;
    size_t len;
    int64_t id;

    c->since_ms = uv_now(c->s->loop);
    /* Before hello, anything but a hello closes the connection, a malformed one included: a
     * peer cannot keep one open by sending frames the daemon answers. */
    if (td_pv_int(td_pv_get(root, "id"), &id) != 0 || id < 0) {
        td__send_error(c, -1, TD_EPROTO, "id: every request needs an integer id >= 0");
        if (!c->hello)
            conn_close(c);
        return;
    }
    if ((t = td_pv_str(td_pv_get(root, "type"), &len)) == NULL) {
        td__send_error(c, id, TD_EPROTO, "type: every request needs a type string");
        if (!c->hello)
            conn_close(c);
        return;
    }
    if (td_pv_strcpy(td_pv_get(root, "type"), type, sizeof(type)) != 0)
        type[0] = '\0'; /* too long, or NUL inside: no request is called that */
    if (!c->hello && strcmp(type, "hello") != 0) {
        td__send_error(c, id, TD_EPROTO, "the first request must be hello");
        conn_close(c);
        return;
    }
    if (strcmp(type, "hello") == 0)
        req_hello(c, root, id);
    else if (strcmp(type, "submit") == 0)
        req_submit(c, root, id);
    else if (strcmp(type, "status") == 0)
        td__req_status(c, root, id);
    else if (strcmp(type, "list") == 0)
        td__req_list(c, root, id);
    else if (strcmp(type, "cancel") == 0)
        req_cancel(c, root, id);
    else if (strcmp(type, "metrics") == 0)
        td__req_stream(c, root, id, 0);
    else if (strcmp(type, "info") == 0)
        req_info(c, id);
    else if (strcmp(type, "logs") == 0)
        td__req_logs(c, root, id);
    else if (strcmp(type, "watch") == 0)
        td__req_stream(c, root, id, 1);
    else if (strcmp(type, "export") == 0)
        req_export(c, root, id);
    else if (strcmp(type, "sample") == 0)
        req_sample(c, root, id);
    else if (strcmp(type, "classify") == 0)
        req_classify(c, root, id, TD_WORK_CLASSIFY);
    else if (strcmp(type, "retrieve") == 0)
        req_classify(c, root, id, TD_WORK_RETRIEVE);
    else if (strcmp(type, "rm") == 0)
        td__req_rm(c, root, id);
    else if (strcmp(type, "prune") == 0)
        td__req_prune(c, root, id);
    else {
        /* The client's own bytes, escaped: whatever it sent, the reply is printable UTF-8. */
        td_text_escape(shown, sizeof(shown), t, len < TD_SHOWN_TYPE ? len : TD_SHOWN_TYPE, 0);
        snprintf(msg, sizeof(msg), "type: unknown request \"%s%s\"", shown,
                 len > TD_SHOWN_TYPE ? "..." : "");
        td__send_error(c, id, TD_EPROTO, msg);
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
        td__stream_free(c->streams);
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

/* Handles the frames the reader holds, in order, until the connection closes, a request
 * makes it busy, or its unsent replies pass the high-water mark (the rest wait in the
 * reader, and reading stops until they drain). bytes (n) are the last read, for the log. */
static void serve_frames(td_conn *c, const char *bytes, size_t n)
{
    td_proto_frame *f;
    td_error_t err;
    int rc = 0;

    while (!c->closing && !c->busy && !c->paused &&
           (rc = td_proto_reader_next(c->reader, &f, &err)) == 1) {
        handle_frame(c, f);
        td_proto_frame_free(f);
        if (c->pending >= TD_CONN_HIGH_WATER)
            c->paused = 1;
    }
    if (!c->closing && rc < 0) {
        char sample[40];
        sample_bytes(sample, sizeof(sample), bytes, n);
        td_log_warn("client pid %lld uid %lld: bad frame (%s), closing; bytes %s...",
                    (long long)c->pid, (long long)c->uid, err.msg, sample);
        td__send_error(c, -1, rc, err.msg);
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
    conn_want_read(c);
}

/* Reads from c while it may: not while an export or sample is under way (busy: replies keep
 * the order of requests), nor while its unsent replies are over the high-water mark (paused:
 * a client that sends requests and never reads the replies gets no more of them), nor once
 * it is closing. What it sends meanwhile waits in the socket. */
static void conn_want_read(td_conn *c)
{
    int want = !c->busy && !c->paused, rc;

    if (c->closing || want == c->reading) /* a closing handle has stopped reading already */
        return;
    if (!want) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
        return;
    }
    rc = uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read);
    if (rc != 0) {
        td_log_warn("client pid %lld: cannot read: %s", (long long)c->pid, uv_strerror(rc));
        conn_close(c);
        return;
    }
    c->reading = 1;
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

/* Why a new connection c may not stay, into msg; 0 when it may. Root always gets in, so that
 * an administrator can look at a daemon other users have filled; anyone else is held to
 * max_connections in all and max_connections_per_user of their own. */
static int refuse_why(const td_server *s, const td_conn *c, char *msg, size_t size)
{
    int max = s->cfg.max_conns > 0 ? s->cfg.max_conns : TD_MAX_CONNS, mine = 0;

    if (c->uid == 0)
        return 0;
    if (s->nconns > max) {
        snprintf(msg, size, "too many connections: %d open, the limit (max_connections)",
                 s->nconns - 1);
        return 1;
    }
    if (s->cfg.max_conns_per_user <= 0)
        return 0;
    for (const td_conn *o = s->conns; o != NULL; o = o->next)
        mine += !o->closing && o->uid == c->uid;
    if (mine > s->cfg.max_conns_per_user) {
        snprintf(msg, size,
                 "too many connections: uid %lld has %d open, the limit "
                 "(max_connections_per_user)",
                 (long long)c->uid, mine - 1);
        return 1;
    }
    return 0;
}

static void on_connection(uv_stream_t *listener, int status)
{
    td_server *s = listener->data;
    char why[160];
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
    c->accepted_ms = c->since_ms = uv_now(s->loop);
    td_pw_init(&c->w);
    c->next = s->conns;
    s->conns = c;
    s->nconns++;
    if (uv_accept(listener, (uv_stream_t *)&c->pipe) != 0 ||
        td_proto_reader_new(&c->reader, 0) != 0) {
        conn_close(c);
        return;
    }
    /* Until it has said hello, a peer gets a hello's worth of buffer, not a whole frame's. */
    td_proto_reader_limit_first(c->reader, TD_PROTO_MAX_HELLO);
    peer_creds(c);
    if (refuse_why(s, c, why, sizeof(why))) {
        td_log_warn("client pid %lld uid %lld: refused, %s", (long long)c->pid, (long long)c->uid,
                    why);
        td__send_error(c, -1, TD_E2BIG, why);
        conn_close(c);
        return;
    }
    conn_want_read(c);
}

/* ---- timeouts ---- */

/* Closes the connections that have not said hello in time, and those idle for too long: no
 * request read and no reply written for idle_timeout_s, and no stream, export or sample
 * under way (a watcher of a queued job may wait for hours). Work per tick is one look at
 * each connection: at most max_connections (plus root's). */
static void on_sweep(uv_timer_t *t)
{
    td_server *s = t->data;
    uint64_t now = uv_now(s->loop);
    uint64_t hello_ms = (uint64_t)(s->cfg.hello_timeout_s * 1000);
    uint64_t idle_ms = (uint64_t)(s->cfg.idle_timeout_s * 1000);
    char msg[128];

    for (td_conn *c = s->conns; c != NULL; c = c->next) {
        uint64_t quiet = now - c->since_ms;
        if (c->closing)
            continue;
        if (!c->hello && hello_ms > 0 && now - c->accepted_ms >= hello_ms) {
            snprintf(msg, sizeof(msg), "no hello within %g s of connecting; closing",
                     s->cfg.hello_timeout_s);
        } else if (c->hello && idle_ms > 0 && quiet >= idle_ms && c->streams == NULL && !c->busy &&
                   c->xfer == NULL) {
            snprintf(msg, sizeof(msg), "idle for %g s; closing", s->cfg.idle_timeout_s);
        } else {
            continue;
        }
        td_log_info("client pid %lld uid %lld: %s", (long long)c->pid, (long long)c->uid, msg);
        td__send_error(c, -1, TD_ECLOSED, msg);
        conn_close(c);
    }
}

/* Starts the sweep at a period that finds a timed-out connection within about a quarter of
 * the shorter timeout. */
static int sweep_start(td_server *s, td_error_t *err)
{
    double shortest = s->cfg.hello_timeout_s;
    uint64_t period;
    int rc;

    if (s->cfg.idle_timeout_s > 0 && s->cfg.idle_timeout_s < shortest)
        shortest = s->cfg.idle_timeout_s;
    period = (uint64_t)(shortest * 1000 / 4);
    period = period < TD_SWEEP_MIN_MS   ? TD_SWEEP_MIN_MS
             : period > TD_SWEEP_MAX_MS ? TD_SWEEP_MAX_MS
                                        : period;
    rc = uv_timer_init(s->loop, &s->sweep);
    if (rc != 0)
        return td_error_set(err, rc, "uv_timer_init: %s", uv_strerror(rc));
    s->sweeping = 1;
    s->sweep.data = s;
    rc = uv_timer_start(&s->sweep, on_sweep, period, period);
    if (rc != 0)
        return td_error_set(err, rc, "uv_timer_start: %s", uv_strerror(rc));
    /* The sweep alone must not keep the loop turning once everything else has stopped. */
    uv_unref((uv_handle_t *)&s->sweep);
    return 0;
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
    td_pw_init(&s->scratch);
    rc = sweep_start(s, err);
    if (rc == 0)
        rc = listen_socket(s, err);
    if (rc != 0 && s->sweeping) {
        uv_close((uv_handle_t *)&s->sweep, NULL);
        s->sweeping = 0;
    }
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
    if (s->sweeping) {
        uv_close((uv_handle_t *)&s->sweep, NULL);
        s->sweeping = 0;
    }
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
    if (s == NULL)
        return;
    td_pw_free(&s->scratch);
    free(s->keys.names);
    free(s);
}
