/* The server's replies that list or describe jobs (server_int.h): the JOB map, status, and
 * the pages of list and logs. A page is written into the server's scratch writer first, so
 * that it stops before its frame would pass TD_REPLY_BUDGET, and goes out with more and next
 * saying where the following page starts (PROTOCOL.md, "list", "logs"). Loop thread only. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/server/server_int.h"
#include "train/ckpt.h"
#include "common/td_log.h"
#include "common/td_text.h"

#define TD_STATUS_CHECKPOINTS 32 /* checkpoint files a status reply lists, newest first */

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

void td__write_text(td_pw *w, const char *s, size_t len, int keep_nl, size_t out_max)
{
    char buf[4 * TD_STORE_MAX_NAME + 1];
    char *out = out_max < sizeof(buf) ? buf : malloc(out_max + 1);
    size_t n;

    if (out == NULL) {
        td_pw_str(w, "");
        return;
    }
    n = td_text_escape(out, out_max + 1, s, len, keep_nl ? TD_TEXT_KEEP_NEWLINES : 0);
    td_pw_strn(w, out, n);
    if (out != buf)
        free(out);
}

/* Whether every string (and map key) in v is text (td_text_check). */
static int all_text(const td_pval *v)
{
    size_t len;
    const char *s;

    switch (td_pv_type_of(v)) {
    case TD_PV_STR:
        s = td_pv_str(v, &len);
        return td_text_check(s, len, NULL) == TD_TEXT_OK;
    case TD_PV_ARRAY:
        for (size_t i = 0; i < td_pv_len(v); i++)
            if (!all_text(td_pv_at(v, i)))
                return 0;
        return 1;
    case TD_PV_MAP:
        for (size_t i = 0; i < td_pv_len(v); i++)
            if (!all_text(td_pv_key_at(v, i)) || !all_text(td_pv_val_at(v, i)))
                return 0;
        return 1;
    default:
        return 1;
    }
}

/* Writes v with every string escaped (td__write_text): a stored spec or list of device errors
 * from before submit checked strings. */
static void write_escaped(td_pw *w, const td_pval *v)
{
    size_t len;
    const char *s;

    switch (td_pv_type_of(v)) {
    case TD_PV_STR:
        s = td_pv_str(v, &len);
        td__write_text(w, s, len, 0, 4 * len < TD_PROTO_MAX_STR ? 4 * len : TD_PROTO_MAX_STR);
        break;
    case TD_PV_ARRAY:
        td_pw_array(w, (uint32_t)td_pv_len(v));
        for (size_t i = 0; i < td_pv_len(v); i++)
            write_escaped(w, td_pv_at(v, i));
        break;
    case TD_PV_MAP:
        td_pw_map(w, (uint32_t)td_pv_len(v));
        for (size_t i = 0; i < td_pv_len(v); i++) {
            write_escaped(w, td_pv_key_at(v, i));
            write_escaped(w, td_pv_val_at(v, i));
        }
        break;
    default:
        td_pw_val(w, v);
        break;
    }
}

/* Writes a msgpack value the daemon stored (a job's spec, its device errors) as it is when
 * its strings are text, else with them escaped: traind never sends a client's control
 * characters or malformed UTF-8 on to another client. */
static void write_stored(td_pw *w, const void *blob, size_t len)
{
    td_proto_frame *f = NULL;
    const void *body;
    td_error_t err;
    size_t n;
    td_pw tmp;

    /* td_proto_decode wants a map at the top: the value goes in as {"v": value}. */
    td_pw_init(&tmp);
    td_pw_map_open(&tmp);
    td_pw_str(&tmp, "v");
    td_pw_raw(&tmp, blob, len);
    td_pw_map_close(&tmp);
    body = td_pw_body(&tmp, &n);
    if (body != NULL && td_proto_decode(body, n, &f, &err) == 0 &&
        !all_text(td_pv_get(td_proto_frame_root(f), "v")))
        write_escaped(w, td_pv_get(td_proto_frame_root(f), "v"));
    else
        td_pw_raw(w, blob, len);
    td_proto_frame_free(f);
    td_pw_free(&tmp);
}

/* Writes a job's nodes and restarts (a job that spans nodes; PROTOCOL.md, "status") from the
 * stored map {names, restarts}: both empty arrays for any other job. */
static void write_nodes(td_pw *w, const void *blob, size_t len)
{
    td_proto_frame *f = NULL;
    td_error_t err;
    const td_pval *root = NULL;

    if (blob != NULL && td_proto_decode(blob, len, &f, &err) == 0)
        root = td_proto_frame_root(f);
    td_pw_str(w, "nodes");
    if (td_pv_type_of(td_pv_get(root, "names")) == TD_PV_ARRAY)
        write_escaped(w, td_pv_get(root, "names"));
    else
        td_pw_array(w, 0);
    td_pw_str(w, "restarts");
    if (td_pv_type_of(td_pv_get(root, "restarts")) == TD_PV_ARRAY)
        write_escaped(w, td_pv_get(root, "restarts"));
    else
        td_pw_array(w, 0);
    td_proto_frame_free(f);
}

/* ---- labels ---- */

int td__get_labels(td_conn *c, const td_pval *root, int64_t id, td_label *out,
                   char (*buf)[2][TD_LABEL_BUF], size_t *n)
{
    const td_pval *v = td_pv_get(root, "labels");

    *n = 0;
    if (v == NULL)
        return 0;
    if (td_pv_type_of(v) != TD_PV_MAP || td_pv_len(v) > TD_STORE_MAX_LABELS)
        goto bad;
    for (size_t i = 0; i < td_pv_len(v); i++) {
        if (td_pv_strcpy(td_pv_key_at(v, i), buf[i][0], TD_LABEL_BUF) != 0 ||
            td_pv_strcpy(td_pv_val_at(v, i), buf[i][1], TD_LABEL_BUF) != 0 || buf[i][0][0] == '\0')
            goto bad;
        out[i] = (td_label){.key = buf[i][0], .value = buf[i][1]};
    }
    *n = td_pv_len(v);
    return 0;
bad:
    td_conn_error(c, id, TD_EPROTO,
                  "labels: must be a map of at most 16 label names and values, strings of 1 to "
                  "63 and 0 to 63 bytes");
    return -1;
}

/* A job's labels (td_job_row.labels: "name\x1fvalue\x1e...") as a map. */
static void write_labels(td_pw *w, const char *labels)
{
    td_pw_str(w, "labels");
    td_pw_map_open(w);
    for (const char *p = labels; p != NULL && *p != '\0';) {
        const char *us = strchr(p, '\x1f'), *rs = strchr(p, '\x1e');
        const char *end = rs != NULL ? rs : p + strlen(p);
        if (us != NULL && us < end) {
            td__write_text(w, p, (size_t)(us - p), 0, 4 * TD_LABEL_BUF);
            td__write_text(w, us + 1, (size_t)(end - us - 1), 0, 4 * TD_LABEL_BUF);
        }
        p = rs != NULL ? rs + 1 : end;
    }
    td_pw_map_close(w);
}

/* status's checkpoints: the job's files on this box, newest first (a directory the daemon
 * owns, a few files: listed here); nil for a job that spans nodes, whose checkpoints are on
 * the shared file system. */
static void write_checkpoints(td_server *s, td_pw *w, const td_job_row *row)
{
    td_ckpt_entry e[TD_STATUS_CHECKPOINTS];
    char dir[TD_CKPT_PATH_MAX];
    td_error_t err;
    int n = 0;

    td_pw_str(w, "checkpoints");
    if (td_daemon_checkpoint_dir(s->d, row->id, row->nodes != NULL, dir, sizeof(dir)) != 0) {
        td_pw_nil(w);
        return;
    }
    if (td_ckpt_list(dir, e, TD_STATUS_CHECKPOINTS, &n, &err) != 0)
        td_log_warn("job %lld: cannot list its checkpoints: %s", (long long)row->id, err.msg);
    td_pw_array(w, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        td_pw_map(w, 3);
        td_pw_str(w, "step");
        td_pw_int(w, e[i].step);
        td_pw_str(w, "bytes");
        td_pw_int(w, e[i].bytes);
        td_pw_str(w, "time");
        td_pw_double(w, e[i].mtime);
    }
}

/* Writes the JOB map of PROTOCOL.md for row, with live figures for a job in memory. */
void td__write_job(td_server *s, td_pw *w, td_job_row *row, int with_spec)
{
    td_job_live jl, *live = td_daemon_job_live(s->d, row->id, &jl) ? &jl : NULL;
    /* An ended job whose final state the store cannot take yet shows the error it will get. */
    int err_code = live != NULL && live->err.code != 0 ? live->err.code : row->err_code;
    const char *msg = live != NULL && live->err.code != 0
                          ? live->err.msg
                          : (row->err_msg != NULL ? row->err_msg : td_strerror(row->err_code));
    last_vals lv = {0};
    td_error_t err;

    if (td_store_metrics_summary(s->store, row->id, collect_last, &lv, &err) != 0)
        td_log_warn("job %lld: cannot read metric summary: %s", (long long)row->id, err.msg);
    td_pw_map_open(w);
    td_pw_str(w, "id");
    td_pw_int(w, row->id);
    td_pw_str(w, "name");
    td__write_text(w, row->name, strlen(row->name), 0, 4 * TD_STORE_MAX_NAME);
    td_pw_str(w, "uid"); /* the submitter, so that a client can show an owner */
    td_pw_int(w, row->uid);
    td_pw_str(w, "state");
    td_pw_str(w, live != NULL ? live->state : row->state);
    td_pw_str(w, "step");
    td_pw_int(w, live != NULL ? live->step : row->step);
    td_pw_str(w, "total_steps");
    td_pw_int(w, live != NULL && live->total_steps ? live->total_steps : row->total_steps);
    td_pw_str(w, "devices");
    td_pw_int(w, row->devices);
    td_pw_str(w, "priority");
    td_pw_int(w, row->priority);
    write_labels(w, row->labels);
    td_pw_str(w, "reason"); /* why a queued job waits; nil for every other */
    if (live != NULL && live->reason[0] != '\0')
        td_pw_str(w, live->reason);
    else
        td_pw_nil(w);
    td_pw_str(w, "device_list");
    td_pw_str(w, live != NULL && live->running ? live->device_list : row->device_list);
    if (live != NULL && live->nodes != NULL)
        write_nodes(w, live->nodes, live->nodes_len);
    else
        write_nodes(w, row->nodes, row->nodes_len);
    td_pw_str(w, "created");
    td_pw_double(w, row->created);
    td_pw_str(w, "started");
    td_pw_double(w, row->started);
    td_pw_str(w, "ended");
    td_pw_double(w, row->ended);
    td_pw_str(w, "error");
    if (err_code == 0) {
        td_pw_nil(w);
    } else {
        td_pw_map_open(w);
        td_pw_str(w, "code");
        td_pw_int(w, err_code);
        td_pw_str(w, "name");
        td_pw_str(w, td_errname(err_code));
        td_pw_str(w, "message");
        td__write_text(w, msg, strlen(msg), 1, TD_LOG_LINE_WIRE);
        td_pw_str(w, "devices");
        if (row->err_devices != NULL)
            write_stored(w, row->err_devices, row->err_devices_len);
        else
            td_pw_array(w, 0);
        td_pw_map_close(w);
    }
    td_pw_str(w, "metrics");
    td_pw_map_open(w);
    for (size_t i = 0; i < lv.n; i++) {
        td_pw_str(w, lv.keys[i]);
        td_pw_double(w, lv.vals[i]);
    }
    td_pw_map_close(w);
    if (with_spec)
        write_checkpoints(s, w, row);
    if (with_spec) {
        td_pw_str(w, "spec");
        if (row->spec != NULL)
            write_stored(w, row->spec, row->spec_len);
        else
            td_pw_nil(w);
    }
    td_pw_map_close(w);
    free(lv.keys);
    free(lv.vals);
}

/* ---- status and list ---- */

void td__req_status(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_job_row row = {0};
    int64_t job;
    td_pw *w;

    if (td__get_job_id(c, root, id, &job) != 0 || td__get_job_row(s, c, id, job, &row) != 0)
        return;
    w = td_conn_reply(c, "job", id);
    td_pw_str(w, "job");
    td__write_job(s, w, &row, 1);
    td_job_row_clear(&row);
    td_conn_send(c);
}

static int is_state(const char *w)
{
    static const char *const words[] = {TD_JOB_QUEUED, TD_JOB_RUNNING, TD_JOB_SUCCEEDED,
                                        TD_JOB_FAILED, TD_JOB_CANCELLED};

    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++)
        if (strcmp(w, words[i]) == 0)
            return 1;
    return 0;
}

/* The filters and cursor of a list request (PROTOCOL.md, "list") into *q; states and glob
 * hold what q points at. -1 after an error frame naming the bad field. */
static int list_query(td_conn *c, const td_pval *root, int64_t id, td_job_query *q,
                      const char **states, char (*state_buf)[TD_STORE_MAX_STATE], char *glob,
                      size_t glob_size)
{
    const td_pval *v;
    int64_t uid = -1;
    size_t len;
    const char *p;
    double since = 0;
    int b = 0;

    if (td__opt_int(c, root, id, "after", 0, INT64_MAX, &q->after) != 0 ||
        td__opt_int(c, root, id, "uid", 0, UINT32_MAX, &uid) != 0)
        return -1;
    q->by_uid = uid >= 0;
    q->uid = uid;
    if ((v = td_pv_get(root, "newest_first")) != NULL && td_pv_bool(v, &b) != 0) {
        td_conn_error(c, id, TD_EPROTO, "newest_first: must be true or false");
        return -1;
    }
    q->newest_first = b;
    if ((v = td_pv_get(root, "since")) != NULL &&
        (td_pv_double(v, &since) != 0 || !isfinite(since) || since < 0)) {
        td_conn_error(c, id, TD_EPROTO, "since: must be a unix time in seconds, >= 0");
        return -1;
    }
    q->since = since;
    if ((v = td_pv_get(root, "states")) != NULL) {
        if (td_pv_type_of(v) != TD_PV_ARRAY || td_pv_len(v) > TD_STORE_MAX_STATES) {
            td_conn_error(c, id, TD_EPROTO,
                          "states: must be a list of at most 5 of queued, running, succeeded, "
                          "failed, cancelled");
            return -1;
        }
        for (size_t i = 0; i < td_pv_len(v); i++) {
            if (td_pv_strcpy(td_pv_at(v, i), state_buf[i], TD_STORE_MAX_STATE) != 0 ||
                !is_state(state_buf[i])) {
                td_conn_error(
                    c, id, TD_EPROTO,
                    "states: each must be queued, running, succeeded, failed or cancelled");
                return -1;
            }
            states[i] = state_buf[i];
        }
        q->states = states;
        q->nstates = td_pv_len(v);
    }
    if ((v = td_pv_get(root, "name")) != NULL) {
        p = td_pv_str(v, &len);
        if (p == NULL || len == 0 || len >= glob_size || td_text_check(p, len, NULL) != 0) {
            td_conn_error(c, id, TD_EPROTO,
                          "name: must be a pattern of 1 to 255 bytes of text (* ? [a-z] [^x])");
            return -1;
        }
        memcpy(glob, p, len);
        glob[len] = '\0';
        q->name_glob = glob;
    }
    return 0;
}

/* list: one page of jobs (PROTOCOL.md). As many of the page's jobs as fit TD_REPLY_BUDGET
 * go out; more and next tell the client where the following page starts. */
void td__req_list(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_job_query q = {0};
    const char *states[TD_STORE_MAX_STATES];
    char state_buf[TD_STORE_MAX_STATES][TD_STORE_MAX_STATE], glob[2 * TD_STORE_MAX_NAME];
    int64_t limit = TD_PROTO_PAGE_MAX, next;
    td_label labels[TD_STORE_MAX_LABELS];
    char label_buf[TD_STORE_MAX_LABELS][2][TD_LABEL_BUF];
    td_job_row *rows = NULL;
    size_t n = 0, fit = 0, len;
    const void *body;
    td_error_t err;
    int more = 0;
    td_pw *w;

    if (list_query(c, root, id, &q, states, state_buf, glob, sizeof(glob)) != 0 ||
        td__opt_int(c, root, id, "limit", 1, TD_PROTO_PAGE_MAX, &limit) != 0 ||
        td__get_labels(c, root, id, labels, label_buf, &q.nlabels) != 0)
        return;
    q.labels = labels;
    if (td_store_job_page(s->store, &q, (size_t)limit, &rows, &n, &more, &err) != 0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    /* The jobs go to scratch first: how many of them fit is known once they are written. */
    td_pw_reset(&s->scratch);
    next = q.after;
    for (size_t i = 0; i < n; i++) {
        size_t before = s->scratch.len;
        td__write_job(s, &s->scratch, &rows[i], 0);
        if (fit > 0 && s->scratch.len > TD_REPLY_BUDGET) {
            s->scratch.len = before;
            more = 1;
            break;
        }
        fit++;
        next = rows[i].id;
    }
    for (size_t i = 0; i < n; i++)
        td_job_row_clear(&rows[i]);
    free(rows);
    body = td_pw_body(&s->scratch, &len);
    if (body == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    w = td_conn_reply(c, "jobs", id);
    td_pw_str(w, "jobs");
    td_pw_array_raw(w, (uint32_t)fit, body, len);
    td_pw_str(w, "more");
    td_pw_bool(w, more);
    td_pw_str(w, "next");
    td_pw_int(w, next);
    td_conn_send(c);
}

/* ---- logs ---- */

/* A page of a job's log as it is written into a writer. */
typedef struct log_page {
    td_pw *w;
    size_t limit, n; /* lines asked for, lines written */
    int64_t next;    /* the last line written's id */
    int more;        /* a line past the last one written exists */
} log_page;

static int write_log_line(void *ud, const td_job_log_row *row)
{
    log_page *l = ud;
    const char *msg = row->msg != NULL ? row->msg : "";

    /* A line takes at most its escaped message plus ~30 bytes: stop before the budget. */
    if (l->n == l->limit || l->w->len + TD_LOG_LINE_WIRE + 64 > TD_REPLY_BUDGET) {
        l->more = 1;
        return 1;
    }
    td_pw_array(l->w, 3);
    td_pw_double(l->w, row->time);
    td_pw_int(l->w, row->level);
    td__write_text(l->w, msg, strlen(msg), 1, TD_LOG_LINE_WIRE);
    l->n++;
    l->next = row->id;
    return 0;
}

/* logs: one page of a job's log (PROTOCOL.md), for its owner or root only: lines carry paths
 * and error messages. */
void td__req_logs(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    td_job_row row = {0};
    int64_t job, after = 0, limit = TD_PROTO_PAGE_MAX;
    log_page l = {.w = &s->scratch};
    size_t ndone = 0, len;
    const void *body;
    td_error_t err;
    td_pw *w;
    int rc;

    if (td__get_job_id(c, root, id, &job) != 0 ||
        td__opt_int(c, root, id, "after", 0, INT64_MAX, &after) != 0 ||
        td__opt_int(c, root, id, "limit", 1, TD_PROTO_PAGE_MAX, &limit) != 0 ||
        td__get_job_row(s, c, id, job, &row) != 0)
        return;
    rc = td_daemon_check_owner(job, row.uid, td_conn_uid(c), &err);
    td_job_row_clear(&row);
    if (rc != 0) {
        td_conn_error(c, id, rc, err.msg);
        return;
    }
    td_pw_reset(&s->scratch);
    l.limit = (size_t)limit;
    l.next = after;
    /* One line more than asked for says whether another page follows. */
    if (td_store_log_read(s->store, job, after, l.limit + 1, write_log_line, &l, &ndone, &err) !=
        0) {
        td_conn_error(c, id, err.code, err.msg);
        return;
    }
    body = td_pw_body(&s->scratch, &len);
    if (body == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return;
    }
    w = td_conn_reply(c, "logs", id);
    td_pw_str(w, "job_id");
    td_pw_int(w, job);
    td_pw_str(w, "lines");
    td_pw_array_raw(w, (uint32_t)l.n, body, len);
    td_pw_str(w, "more");
    td_pw_bool(w, l.more);
    td_pw_str(w, "next");
    td_pw_int(w, l.next);
    td_conn_send(c);
}
