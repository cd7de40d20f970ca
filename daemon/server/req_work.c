/* The server's requests whose slow half runs on libuv's threadpool (server_int.h, work.h):
 * export (llm.c, safetensors), sample, classify, retrieve and probe. Meanwhile the connection is
 * held (td_conn_hold), so it reads no further request and its replies keep the order of its
 * requests; an export's file then goes out a chunk at a time, a producer on the connection
 * pumped as the client reads. Exports are counted per user (max_exports_per_user): each holds
 * a temporary file as large as its model until its last chunk is read. Loop thread only. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/server/server_int.h"
#include "common/td_log.h"
#include "common/td_text.h"
#include "daemon/work.h"

/* Bytes of model file per chunk frame: the protocol's limit on one bin (a frame stays far
 * below TD_PROTO_MAX_FRAME). */
#define TD_EXPORT_CHUNK TD_PROTO_MAX_STR

static char xfer_buf[TD_EXPORT_CHUNK]; /* loop thread only */

/* A request's work, from td_work_start until its reply (an export's: its last chunk) is sent
 * or its connection has gone. */
struct work_req {
    td_producer p; /* an export's chunks, once its file is written */
    td_server *s;
    td_conn *c; /* held until the work is answered */
    td_work *w;
    int64_t sent;   /* bytes of an export's file sent so far */
    work_req *next; /* s->works */
};

static const char *work_name(const td_work *w)
{
    return w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST ? "export"
           : w->kind == TD_WORK_SAMPLE                               ? "sample"
           : w->kind == TD_WORK_CLASSIFY                             ? "classify"
           : w->kind == TD_WORK_RETRIEVE                             ? "retrieve"
                                                                     : "probe";
}

static int is_export(const td_work *w)
{
    return w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST;
}

/* While the work runs (or waits for its lane): the connection's going stops it. Nothing to
 * pump; the drop tells the work, which stops at its next check and comes back to
 * on_work_done, where q goes. */
static void run_pump(td_producer *p)
{
    (void)p;
}

static void run_drop(td_producer *p)
{
    td_work_cancel(((work_req *)p)->w);
}

static const td_producer_ops run_ops = {.pump = run_pump, .drop = run_drop};

/* The work is answered, or its connection gone: q leaves the server's list and goes, with its
 * work, and the connection's hold is let go (which may free a closed connection). */
static void req_end(work_req *q)
{
    td_conn *c = q->c;

    for (work_req **p = &q->s->works; *p != NULL; p = &(*p)->next)
        if (*p == q) {
            *p = q->next;
            break;
        }
    td_work_free(q->w);
    free(q);
    td_conn_release(c);
}

/* Begins work w's reply of type (td_conn_reply), and writes the first of its fields, job_id,
 * which every reply to export, sample, classify, retrieve and probe carries. */
static td_pw *work_reply_begin(td_conn *c, const td_work *w, const char *type)
{
    td_pw *pw = td_conn_reply(c, type, w->req_id);

    td_pw_str(pw, "job_id");
    td_pw_int(pw, w->job);
    return pw;
}

static void send_chunk(td_conn *c, const td_work *w, const char *data, size_t len)
{
    td_pw *pw = work_reply_begin(c, w, "chunk");

    td_pw_str(pw, "data");
    td_pw_bin(pw, data, len);
    td_conn_send(c);
}

static void send_xfer_end(td_conn *c, const td_work *w)
{
    td_pw *pw = work_reply_begin(c, w, "end");

    td_pw_str(pw, "bytes");
    td_pw_int(pw, w->size);
    td_conn_send(c);
}

/* The export's last chunk is sent (or its file could not be read): the producer goes. */
static void xfer_done(work_req *q)
{
    td_conn_detach(&q->p);
    req_end(q);
}

/* Sends the exported file a chunk at a time while the client keeps up (td_conn_has_room; the
 * connection pumps again once it has drained below TD_CONN_LOW_WATER), then the end frame.
 * The file was written just now, so its reads come from the page cache: one chunk costs the
 * loop thread a copy, not a wait on the disk. */
static void xfer_pump(td_producer *p)
{
    work_req *q = (work_req *)p;
    td_conn *c = q->c;
    td_work *w = q->w;
    char msg[160];
    ssize_t n;

    while (td_conn_has_room(c)) {
        if (q->sent == w->size) {
            td_log_info("client pid %lld: job %lld exported, %lld bytes", (long long)td_conn_pid(c),
                        (long long)w->job, (long long)w->size);
            send_xfer_end(c, w);
            xfer_done(q);
            return;
        }
        do
            n = read(w->fd, xfer_buf, sizeof(xfer_buf));
        while (n < 0 && errno == EINTR);
        if (n <= 0) {
            snprintf(msg, sizeof(msg),
                     "job %lld: the exported file ended after %lld of %lld bytes%s%s",
                     (long long)w->job, (long long)q->sent, (long long)w->size, n < 0 ? ": " : "",
                     n < 0 ? strerror(errno) : "");
            td_conn_error(c, w->req_id, TD_EIO, msg);
            xfer_done(q);
            return;
        }
        q->sent += n;
        send_chunk(c, w, xfer_buf, (size_t)n);
    }
}

/* The connection went while its export was being sent. */
static void xfer_drop(td_producer *p)
{
    req_end((work_req *)p);
}

static const td_producer_ops xfer_ops = {.pump = xfer_pump, .drop = xfer_drop};

static void send_sample(td_conn *c, const td_work *w)
{
    td_pw *pw = work_reply_begin(c, w, "sample");

    td_pw_str(pw, "text");
    td_pw_strn(pw, w->text, w->text_len);
    td_pw_str(pw, "seed");
    td_pw_int(pw, (int64_t)w->seed);
    td_conn_send(c);
}

/* The classify reply of PROTOCOL.md: the labels, then each window's [index, label, score]. */
static void send_classify(td_conn *c, const td_work *w)
{
    td_pw *pw = work_reply_begin(c, w, "classify");

    td_pw_str(pw, "windows");
    td_pw_int(pw, w->windows);
    td_pw_str(pw, "labels");
    td_pw_array(pw, (uint32_t)w->nlabels);
    for (int k = 0; k < w->nlabels; k++) {
        td_pw_map_open(pw);
        td_pw_str(pw, "name");
        td_pw_str(pw, w->names[k]);
        td_pw_str(pw, "prompt");
        td_pw_str(pw, w->prompts[k]);
        td_pw_map_close(pw);
    }
    td_pw_str(pw, "results");
    td_pw_array(pw, (uint32_t)w->nhits);
    for (int i = 0; i < w->nhits; i++) {
        td_pw_array(pw, 3);
        td_pw_int(pw, w->hits[i].index);
        td_pw_int(pw, w->hits[i].label);
        td_pw_double(pw, w->hits[i].score);
    }
    td_pw_str(pw, "more");
    td_pw_bool(pw, w->first + w->nhits < w->windows);
    td_pw_str(pw, "next");
    td_pw_int(pw, w->first + w->nhits);
    td_conn_send(c);
}

/* Bytes of a caption in a retrieve reply, escaped (td_text_escape): TD_RETRIEVE_MAX_TOP of them
 * stay inside a frame whatever the shard's bytes. */
#define TD_RETRIEVE_CAPTION_MAX 8192

static char caption_buf[TD_RETRIEVE_CAPTION_MAX + 1]; /* loop thread only */

/* The retrieve reply: the best windows first, each [index, score, caption]. */
static void send_retrieve(td_conn *c, const td_work *w)
{
    td_pw *pw = work_reply_begin(c, w, "retrieve");

    td_pw_str(pw, "windows");
    td_pw_int(pw, w->windows);
    td_pw_str(pw, "results");
    td_pw_array(pw, (uint32_t)w->nhits);
    for (int i = 0; i < w->nhits; i++) {
        const char *cap = w->hits[i].caption != NULL ? w->hits[i].caption : "";
        td_text_escape(caption_buf, sizeof(caption_buf), cap, strlen(cap), 0);
        td_pw_array(pw, 3);
        td_pw_int(pw, w->hits[i].index);
        td_pw_double(pw, w->hits[i].score);
        td_pw_str(pw, caption_buf);
    }
    td_conn_send(c);
}

/* The probe reply of PROTOCOL.md: what was fitted on, each class's windows, then a row per
 * shot count. A double that is not finite (a macro-F1 of no class: never, a shard has a
 * window) goes as nil rather than as a NaN a client's JSON cannot hold. */
static void send_probe(td_conn *c, const td_work *w)
{
    td_pw *pw = work_reply_begin(c, w, "probe");

    td_pw_str(pw, "step");
    td_pw_int(pw, w->step);
    td_pw_str(pw, "embed_dim");
    td_pw_int(pw, w->embed_dim);
    td_pw_str(pw, "train_windows");
    td_pw_int(pw, w->windows);
    td_pw_str(pw, "valid_windows");
    td_pw_int(pw, w->eval_windows);
    td_pw_str(pw, "l2");
    td_pw_double(pw, TD_PROBE_L2);
    td_pw_str(pw, "max_iterations");
    td_pw_int(pw, TD_PROBE_MAX_ITER);
    td_pw_str(pw, "labels");
    td_pw_array(pw, (uint32_t)w->nlabels);
    for (int k = 0; k < w->nlabels; k++) {
        td_pw_map_open(pw);
        td_pw_str(pw, "name");
        td_pw_str(pw, w->names[k]);
        td_pw_str(pw, "train");
        td_pw_int(pw, w->train_counts[k]);
        td_pw_str(pw, "valid");
        td_pw_int(pw, w->eval_counts[k]);
        td_pw_map_close(pw);
    }
    td_pw_str(pw, "results");
    td_pw_array(pw, (uint32_t)w->nshots);
    for (int j = 0; j < w->nshots; j++) {
        const td_probe_row *r = &w->rows[j];
        td_pw_map_open(pw);
        td_pw_str(pw, "shots");
        td_pw_int(pw, r->shots);
        td_pw_str(pw, "windows");
        td_pw_int(pw, r->windows);
        td_pw_str(pw, "short");
        td_pw_int(pw, r->short_classes);
        td_pw_str(pw, "accuracy");
        td_pw_double(pw, r->accuracy);
        td_pw_str(pw, "macro_f1");
        if (isfinite(r->macro_f1))
            td_pw_double(pw, r->macro_f1);
        else
            td_pw_nil(pw);
        td_pw_str(pw, "iterations");
        td_pw_int(pw, r->fit.iterations);
        td_pw_str(pw, "converged");
        td_pw_bool(pw, r->fit.converged);
        td_pw_str(pw, "loss");
        td_pw_double(pw, r->fit.loss);
        td_pw_map_close(pw);
    }
    td_conn_send(c);
}

/* Back on the loop thread. A connection that closed meanwhile only lets go of its hold. */
static void on_work_done(td_work *w)
{
    work_req *q = w->ud;
    td_conn *c = q->c;

    if (td_conn_closing(c)) {
        if (w->rc == TD_ECANCELLED)
            td_log_info("client pid %lld uid %lld: %s after %.1f s", (long long)td_conn_pid(c),
                        (long long)td_conn_uid(c), w->err.msg,
                        (uv_now(q->s->loop) - w->started_ms) / 1e3);
        req_end(q);
        return;
    }
    td_conn_detach(&q->p);
    if (w->rc != 0) {
        td_log_info("client pid %lld: %s refused: %s", (long long)td_conn_pid(c), work_name(w),
                    w->err.msg);
        td_conn_error(c, w->req_id, w->rc, w->err.msg);
        req_end(q);
        return;
    }
    if (!is_export(w)) {
        if (w->kind == TD_WORK_SAMPLE)
            send_sample(c, w);
        else if (w->kind == TD_WORK_CLASSIFY)
            send_classify(c, w);
        else if (w->kind == TD_WORK_RETRIEVE)
            send_retrieve(c, w);
        else
            send_probe(c, w);
        req_end(q);
        return;
    }
    td_conn_attach(c, &q->p, &xfer_ops);
    xfer_pump(&q->p);
}

/* Work requests uid has under way on every open connection, queued or running. */
static int works_of(const td_server *s, int64_t uid)
{
    int n = 0;

    for (const work_req *q = s->works; q != NULL; q = q->next)
        n += !td_conn_closing(q->c) && td_conn_uid(q->c) == uid;
    return n;
}

/* Runs w in its lane of the threadpool for c, which is held until w is answered (so that
 * replies keep the order of requests), past max_work_per_user refused (root is exempt). Takes
 * w. */
static void work_start(td_server *s, td_conn *c, td_work *w, int64_t id)
{
    int max = s->cfg.max_work_per_user;
    work_req *q;
    char msg[200];

    if (max > 0 && td_conn_uid(c) != 0 && works_of(s, td_conn_uid(c)) >= max) {
        snprintf(msg, sizeof(msg),
                 "uid %lld has %d requests under way (export, sample, classify, retrieve, "
                 "probe), the limit (max_work_per_user); wait for one to finish",
                 (long long)td_conn_uid(c), max);
        td_log_info("client pid %lld: %s of job %lld refused: %s", (long long)td_conn_pid(c),
                    work_name(w), (long long)w->job, msg);
        td_conn_error(c, id, TD_E2BIG, msg);
        td_work_free(w);
        return;
    }
    q = calloc(1, sizeof(*q));
    if (q == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        td_work_free(w);
        return;
    }
    q->s = s;
    q->c = c;
    q->w = w;
    w->ud = q;
    w->req_id = id;
    w->uid = td_conn_uid(c);
    w->gid = td_conn_gid(c);
    td_log_info("client pid %lld uid %lld: %s of job %lld", (long long)td_conn_pid(c),
                (long long)td_conn_uid(c), work_name(w), (long long)w->job);
    q->next = s->works;
    s->works = q;
    td_conn_hold(c);
    td_conn_attach(c, &q->p, &run_ops);
    td_work_queue(s->lanes, w, on_work_done);
}

/* Exports uid has under way on every open connection: each holds a temporary file as large
 * as its model until its last chunk is read. */
static int exports_of(const td_server *s, int64_t uid)
{
    int n = 0;

    for (const work_req *q = s->works; q != NULL; q = q->next)
        n += is_export(q->w) && !td_conn_closing(q->c) && td_conn_uid(q->c) == uid;
    return n;
}

/* Whether v is the string s. */
static int pv_is(const td_pval *v, const char *s)
{
    size_t len = 0;
    const char *p = td_pv_str(v, &len);

    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

void td__req_export(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    int max = s->cfg.max_exports_per_user;
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
        td_conn_error(c, id, TD_EPROTO, "format: must be \"llmc\" or \"safetensors\"");
        return;
    }
    if (max > 0 && exports_of(s, td_conn_uid(c)) >= max) {
        snprintf(msg, sizeof(msg),
                 "uid %lld has %d exports under way, the limit (max_exports_per_user); wait for "
                 "one to finish",
                 (long long)td_conn_uid(c), max);
        td_log_info("client pid %lld: export of job %lld refused: %s", (long long)td_conn_pid(c),
                    (long long)job, msg);
        td_conn_error(c, id, TD_E2BIG, msg);
        return;
    }
    if (td_work_new(&w, s->d, s->cfg.state_dir, kind, job, td_conn_uid(c), &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    w->uid = td_conn_uid(c);
    w->gid = td_conn_gid(c);
    work_start(s, c, w, id);
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
        td_conn_error(c, id, TD_EPROTO, "tokens: must be an integer from 1 to 4096");
        return -1;
    }
    if ((v = td_pv_get(root, "temperature")) != NULL &&
        (td_pv_double(v, &temperature) != 0 || !isfinite(temperature) || temperature < 0)) {
        td_conn_error(c, id, TD_EPROTO,
                      "temperature: must be a number >= 0 (0: always the likeliest)");
        return -1;
    }
    if ((v = td_pv_get(root, "prompt")) != NULL &&
        ((prompt = td_pv_str(v, &len)) == NULL || memchr(prompt, '\0', len) != NULL)) {
        td_conn_error(c, id, TD_EPROTO, "prompt: must be a string without NUL bytes");
        return -1;
    }
    if ((v = td_pv_get(root, "seed")) != NULL && (td_pv_int(v, &seed) != 0 || seed < 0)) {
        td_conn_error(c, id, TD_EPROTO, "seed: must be an integer >= 0");
        return -1;
    }
    w->prompt = strndup(prompt, len);
    if (w->prompt == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    w->tokens = (int)tokens;
    w->temperature = (float)temperature;
    /* No seed: a new one each time, sent back so that the text can be had again. */
    w->seed = seed >= 0 ? (uint64_t)seed : uv_hrtime() & INT64_MAX;
    return 0;
}

void td__req_sample(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_work *w;
    td_error_t err;
    int64_t job;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, s->d, s->cfg.state_dir, TD_WORK_SAMPLE, job, td_conn_uid(c), &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    if (sample_args(c, root, id, w) != 0) {
        td_work_free(w);
        return;
    }
    work_start(s, c, w, id);
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
        td_conn_error(c, id, TD_EPROTO, msg);
        return -1;
    }
    if ((*out = strndup(s, len)) == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    return 0;
}

/* The request's field key (data, eval): an absolute path (the daemon's working directory is
 * nobody's), into *out. */
static int path_field(td_conn *c, const td_pval *root, int64_t id, const char *key, char **out)
{
    char msg[160];

    if (text_field(c, id, td_pv_get(root, key), key, TD_PATH_MAX - 1, out) != 0)
        return -1;
    if ((*out)[0] != '/') {
        snprintf(msg, sizeof(msg),
                 "%s: must be an absolute path; trainctl resolves relative paths where you run "
                 "it",
                 key);
        td_conn_error(c, id, TD_EPROTO, msg);
        return -1;
    }
    return 0;
}

static int data_field(td_conn *c, const td_pval *root, int64_t id, td_work *w)
{
    return path_field(c, root, id, "data", &w->data);
}

/* An optional integer field in [lo, hi]; -1 after an error frame with msg. */
static int int_field(td_conn *c, const td_pval *root, int64_t id, const char *key, int64_t lo,
                     int64_t hi, const char *msg, int64_t *out)
{
    const td_pval *v = td_pv_get(root, key);

    if (v != NULL && (td_pv_int(v, out) != 0 || *out < lo || *out > hi)) {
        td_conn_error(c, id, TD_EPROTO, msg);
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
        td_conn_error(c, id, TD_EPROTO, "labels: must be a list of 1 to 256 {name, prompt}");
        return -1;
    }
    w->names = calloc(n, sizeof(char *));
    w->prompts = calloc(n, sizeof(char *));
    if (w->names == NULL || w->prompts == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return -1;
    }
    for (size_t k = 0; k < n; k++) {
        const td_pval *e = td_pv_at(v, k), *prompt;
        w->nlabels = (int)k + 1;
        if (td_pv_type_of(e) != TD_PV_MAP) {
            td_conn_error(c, id, TD_EPROTO, "labels: each must be a map {name, prompt}");
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

/* classify and retrieve: a sensorlm's embeddings over a shard, on the threadpool. */
static void req_embed(td_server *s, td_conn *c, const td_pval *root, int64_t id, td_work_kind kind)
{
    int64_t job,
        first = 0,
        limit = kind == TD_WORK_CLASSIFY ? TD_CLASSIFY_MAX_WINDOWS : TD_RETRIEVE_DEFAULT_TOP;
    td_error_t err;
    td_work *w;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, s->d, s->cfg.state_dir, kind, job, td_conn_uid(c), &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    w->uid = td_conn_uid(c);
    w->gid = td_conn_gid(c);
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
    work_start(s, c, w, id);
    return;
fail:
    td_work_free(w);
}

void td__req_classify(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    req_embed(s, c, root, id, TD_WORK_CLASSIFY);
}

void td__req_retrieve(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    req_embed(s, c, root, id, TD_WORK_RETRIEVE);
}

/* ---- probe: linear probes on a sensorlm's embeddings ---- */

/* probe's shots: [int, ...], 1 to TD_PROBE_MAX_SHOTS of them, each 0 (every window) or 1 to
 * TD_PROBE_MAX_WINDOWS; without it 1, 5, 10 and 0. */
static int shots_field(td_conn *c, const td_pval *root, int64_t id, td_work *w)
{
    static const int64_t dflt[] = {1, 5, 10, 0};
    const td_pval *v = td_pv_get(root, "shots");
    size_t n = v != NULL ? td_pv_len(v) : 0;

    if (v == NULL) {
        w->nshots = (int)(sizeof(dflt) / sizeof(dflt[0]));
        memcpy(w->shots, dflt, sizeof(dflt));
        return 0;
    }
    if (td_pv_type_of(v) != TD_PV_ARRAY || n < 1 || n > TD_PROBE_MAX_SHOTS) {
        td_conn_error(c, id, TD_EPROTO, "shots: must be a list of 1 to 16 integers");
        return -1;
    }
    for (size_t j = 0; j < n; j++)
        if (td_pv_int(td_pv_at(v, j), &w->shots[j]) != 0 || w->shots[j] < 0 ||
            w->shots[j] > TD_PROBE_MAX_WINDOWS) {
            td_conn_error(c, id, TD_EPROTO,
                          "shots: each must be 0 (every window) or 1 to 65536 windows a class");
            return -1;
        }
    w->nshots = (int)n;
    return 0;
}

void td__req_probe(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_error_t err;
    td_work *w;
    int64_t job;

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_work_new(&w, s->d, s->cfg.state_dir, TD_WORK_PROBE, job, td_conn_uid(c), &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    if (path_field(c, root, id, "data", &w->data) != 0 ||
        path_field(c, root, id, "eval", &w->eval) != 0 || shots_field(c, root, id, w) != 0) {
        td_work_free(w);
        return;
    }
    work_start(s, c, w, id);
}
