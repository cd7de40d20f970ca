/* The server's requests that delete ended jobs (server_int.h): rm and prune (PROTOCOL.md). The
 * daemon marks the jobs at once (from then on nobody sees them) and deletes their rows a slice
 * at a time (daemon_purge.h); meanwhile the connection reads no further request, gets a progress
 * frame about once a second, and the reply comes once the rows are gone and the space given
 * back. Loop thread only. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/server/server_int.h"
#include "common/td_log.h"

#define TD_RM_MAX_JOBS 1000 /* job ids one rm names */

/* A deletion a connection waits for: its request and what was marked. */
typedef struct purge_req {
    td_conn *c; /* held until the reply */
    int64_t id;
    td_purge_listing l;
} purge_req;

/* The deleted reply of PROTOCOL.md ("rm", "prune"); r NULL for a dry run. */
static void send_deleted(td_conn *c, int64_t id, const td_purge_listing *l, int dry_run,
                         const td_purge_result *r)
{
    td_pw *w = td_conn_reply(c, "deleted", id);

    td_pw_str(w, "dry_run");
    td_pw_bool(w, dry_run);
    td_pw_str(w, "count");
    td_pw_int(w, l->tot.jobs);
    td_pw_str(w, "metric_rows");
    td_pw_int(w, l->tot.metric_rows);
    td_pw_str(w, "more");
    td_pw_bool(w, (int64_t)l->n < l->tot.jobs);
    td_pw_str(w, "db_bytes_before");
    td_pw_int(w, l->bytes_before);
    if (r != NULL) {
        td_pw_str(w, "db_bytes_after");
        td_pw_int(w, r->bytes_after);
        td_pw_str(w, "free_bytes");
        td_pw_int(w, r->free_bytes);
        td_pw_str(w, "reclaimed");
        td_pw_bool(w, r->reclaimed);
    }
    td_pw_str(w, "jobs");
    td_pw_array(w, (uint32_t)l->n);
    for (size_t i = 0; i < l->n; i++) {
        const td_job_brief *b = &l->jobs[i];
        td_pw_map_open(w);
        td_pw_str(w, "id");
        td_pw_int(w, b->id);
        td_pw_str(w, "name");
        td__write_text(w, b->name, strlen(b->name), 0, 4 * TD_STORE_MAX_NAME);
        td_pw_str(w, "state");
        td_pw_str(w, b->state);
        td_pw_str(w, "uid");
        td_pw_int(w, b->uid);
        td_pw_str(w, "ended");
        td_pw_double(w, b->ended);
        td_pw_str(w, "metric_rows");
        td_pw_int(w, b->metric_rows);
        td_pw_map_close(w);
    }
    td_conn_send(c);
}

static void on_progress(void *ud, int64_t jobs_left)
{
    purge_req *q = ud;
    td_pw *w;

    if (td_conn_closing(q->c))
        return;
    w = td_conn_reply(q->c, "progress", q->id);
    td_pw_str(w, "jobs_left");
    td_pw_int(w, jobs_left);
    td_conn_send(q->c);
}

static void on_done(void *ud, const td_purge_result *r)
{
    purge_req *q = ud;
    td_conn *c = q->c;

    if (!td_conn_closing(c) && r->err.code != 0)
        td_conn_error(c, q->id, r->err.code, r->err.msg);
    else if (!td_conn_closing(c))
        send_deleted(c, q->id, &q->l, 0, r);
    td_purge_listing_free(&q->l);
    free(q);
    td_conn_release(c);
}

/* Answers a deletion the daemon took: at once when nothing is to wait for, else once it is
 * done (q then belongs to the wait). */
static void answer(td_conn *c, purge_req *q, int dry_run)
{
    if (!q->l.waiting) {
        send_deleted(c, q->id, &q->l, dry_run, NULL);
        td_purge_listing_free(&q->l);
        free(q);
        return;
    }
    td_conn_hold(c);
}

static purge_req *req_new(td_conn *c, int64_t id)
{
    purge_req *q = calloc(1, sizeof(*q));

    if (q == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return NULL;
    }
    q->c = c;
    q->id = id;
    return q;
}

/* The job_ids of an rm into ids (*n of them); -1 after an error frame. */
static int rm_ids(td_conn *c, const td_pval *root, int64_t id, int64_t *ids, size_t *n)
{
    const td_pval *v = td_pv_get(root, "job_ids");

    *n = td_pv_len(v);
    if (td_pv_type_of(v) != TD_PV_ARRAY || *n < 1 || *n > TD_RM_MAX_JOBS) {
        td_conn_error(c, id, TD_EPROTO, "job_ids: must be a list of 1 to 1000 job ids");
        return -1;
    }
    for (size_t i = 0; i < *n; i++)
        if (td_pv_int(td_pv_at(v, i), &ids[i]) != 0 || ids[i] < 1) {
            td_conn_error(c, id, TD_EPROTO, "job_ids: each must be a positive integer");
            return -1;
        }
    return 0;
}

void td__req_rm(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    static int64_t ids[TD_RM_MAX_JOBS]; /* loop thread only */
    td_error_t err;
    purge_req *q;
    size_t n;

    if (rm_ids(c, root, id, ids, &n) != 0 || (q = req_new(c, id)) == NULL)
        return;
    if (td_daemon_rm(s->d, ids, n, td_conn_uid(c), &q->l, on_done, on_progress, q, &err) != 0) {
        td_log_info("client pid %lld uid %lld: rm refused: %s", (long long)td_conn_pid(c),
                    (long long)td_conn_uid(c), err.msg);
        td_conn_error(c, id, err.code, err.msg);
        free(q);
        return;
    }
    answer(c, q, 0);
}

/* The states of a prune: each an ended one. -1 after an error frame. */
static int prune_states(td_conn *c, const td_pval *root, int64_t id, const char **states,
                        char (*buf)[TD_STORE_MAX_STATE], size_t *n)
{
    static const char *const ended[] = {TD_JOB_SUCCEEDED, TD_JOB_FAILED, TD_JOB_CANCELLED};
    const td_pval *v = td_pv_get(root, "states");
    int ok = 1;

    *n = 0;
    if (v == NULL)
        return 0;
    if (td_pv_type_of(v) != TD_PV_ARRAY || td_pv_len(v) < 1 || td_pv_len(v) > 3)
        ok = 0;
    for (size_t i = 0; ok && i < td_pv_len(v); i++) {
        ok = td_pv_strcpy(td_pv_at(v, i), buf[i], TD_STORE_MAX_STATE) == 0 &&
             (strcmp(buf[i], ended[0]) == 0 || strcmp(buf[i], ended[1]) == 0 ||
              strcmp(buf[i], ended[2]) == 0);
        states[i] = buf[i];
    }
    if (!ok) {
        td_conn_error(c, id, TD_EPROTO,
                      "states: must be a list of 1 to 3 of succeeded, failed, cancelled (a "
                      "queued or running job is never pruned)");
        return -1;
    }
    *n = td_pv_len(v);
    return 0;
}

void td__req_prune(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    const char *states[3];
    char buf[3][TD_STORE_MAX_STATE];
    td_label labels[TD_STORE_MAX_LABELS];
    char label_buf[TD_STORE_MAX_LABELS][2][TD_LABEL_BUF];
    td_prune_args a = {.states = states};
    const td_pval *v;
    td_error_t err;
    purge_req *q;

    v = td_pv_get(root, "older_than");
    if (td_pv_double(v, &a.older_than_s) != 0 || !isfinite(a.older_than_s) || a.older_than_s < 0) {
        td_conn_error(c, id, TD_EPROTO, "older_than: must be a number of seconds, >= 0");
        return;
    }
    if ((v = td_pv_get(root, "dry_run")) != NULL && td_pv_bool(v, &a.dry_run) != 0) {
        td_conn_error(c, id, TD_EPROTO, "dry_run: must be true or false");
        return;
    }
    if (prune_states(c, root, id, states, buf, &a.nstates) != 0 ||
        td__get_labels(c, root, id, labels, label_buf, &a.nlabels) != 0 ||
        (q = req_new(c, id)) == NULL)
        return;
    a.labels = labels;
    if (td_daemon_prune(s->d, &a, td_conn_uid(c), &q->l, on_done, on_progress, q, &err) != 0) {
        td_log_info("client pid %lld uid %lld: prune refused: %s", (long long)td_conn_pid(c),
                    (long long)td_conn_uid(c), err.msg);
        td_conn_error(c, id, err.code, err.msg);
        free(q);
        return;
    }
    answer(c, q, a.dry_run);
}
