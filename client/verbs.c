/* The request/reply verbs: submit, status, ls, cancel and metrics. Each opens a connection,
 * sends one request, reads its reply (or, for metrics, the run of rows frames up to `end`),
 * and prints it. watch, which follows a job live, is in watch.c. */
#include <stdlib.h>
#include <string.h>

#include "client.h"

/* The job file with its --set changes, as a msgpack body in *body. */
static int build_job(const tc_opts *o, td_pw *body)
{
    json_t *job = NULL;
    size_t i;
    int rc = tc_job_load(o->file, &job);

    for (i = 0; rc == TC_OK && i < o->nsets; i++)
        rc = tc_job_set(job, o->sets[i]);
    if (rc == TC_OK)
        rc = tc_json_to_pw(body, job, 2); /* the job map sits in the request's top map */
    if (rc == TC_OK && body->failed)
        rc = tc_err(TC_FAILED, "out of memory");
    json_decref(job);
    return rc;
}

int tc_submit(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const void *job;
    size_t len;
    int64_t id;
    td_pw body;
    td_pw *w;
    int rc;

    td_pw_init(&body);
    /* The file is checked before connecting, so a bad file says so even with traind down. */
    if ((rc = build_job(o, &body)) != TC_OK || (rc = tc_conn_open(&c, o->socket)) != TC_OK)
        goto out;
    w = tc_conn_request(c, "submit", 3);
    job = td_pw_body(&body, &len);
    td_pw_str(w, "job");
    td_pw_raw(w, job, len);
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "submitted", &f)) != TC_OK)
        goto out;
    if (td_pv_int(td_pv_get(td_proto_frame_root(f), "job_id"), &id) != 0) {
        rc = tc_err(TC_PROTOCOL, "traind's submitted reply has no job_id");
        goto out;
    }
    printf("%lld\n", (long long)id);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    td_pw_free(&body);
    return rc;
}

/* Sends {type, id, job_id} and waits for a reply of type reply. */
static int job_request(const tc_opts *o, tc_conn **c, const char *type, const char *reply,
                       td_proto_frame **f)
{
    td_pw *w;
    int rc = tc_conn_open(c, o->socket);

    if (rc != TC_OK)
        return rc;
    w = tc_conn_request(*c, type, 3);
    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    if ((rc = tc_conn_send(*c)) != TC_OK)
        return rc;
    return tc_conn_expect(*c, reply, f);
}

int tc_status(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *job;
    int rc = job_request(o, &c, "status", "job", &f);

    if (rc != TC_OK)
        goto out;
    job = td_pv_get(td_proto_frame_root(f), "job");
    if (td_pv_type_of(job) != TD_PV_MAP)
        rc = tc_err(TC_PROTOCOL, "traind's job reply has no job map");
    else if (o->json)
        rc = tc_print_json(job, 1);
    else
        tc_print_status(job);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}

int tc_ls(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *jobs;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK)
        goto out;
    tc_conn_request(c, "list", 2);
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "jobs", &f)) != TC_OK)
        goto out;
    jobs = td_pv_get(td_proto_frame_root(f), "jobs");
    if (td_pv_type_of(jobs) != TD_PV_ARRAY)
        rc = tc_err(TC_PROTOCOL, "traind's jobs reply has no jobs array");
    else if (o->json)
        rc = tc_print_json(jobs, 1);
    else
        tc_print_jobs(jobs);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}

int tc_cancel(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    char state[32];
    int rc = job_request(o, &c, "cancel", "cancelled", &f);

    if (rc != TC_OK)
        goto out;
    tc_job_str(td_proto_frame_root(f), "state", state, sizeof(state));
    if (strcmp(state, "running") == 0)
        printf("job %lld: cancelling (stops at its next step)\n", (long long)o->job);
    else
        printf("job %lld: %s\n", (long long)o->job, state[0] ? state : "cancelled");
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}

/* Feeds the rows of one rows frame to the sink. */
static int sink_rows(tc_sink *s, const td_proto_frame *f)
{
    const td_pval *rows = td_pv_get(td_proto_frame_root(f), "rows");
    tc_row row;
    size_t i;
    int rc = TC_OK;

    if (td_pv_type_of(rows) != TD_PV_ARRAY)
        return tc_err(TC_PROTOCOL, "traind sent a rows frame without rows");
    for (i = 0; i < td_pv_len(rows) && rc == TC_OK; i++)
        if ((rc = tc_row_at(rows, i, &row)) == TC_OK)
            rc = tc_sink_add(s, &row);
    return rc;
}

/* Reads rows frames into the sink until the end frame. */
static int stream_rows(tc_conn *c, tc_sink *s)
{
    td_proto_frame *f = NULL;
    const td_pval *type;
    int rc = TC_OK, done = 0;

    while (rc == TC_OK && !done) {
        if ((rc = tc_conn_recv(c, &f, TC_REPLY_TIMEOUT_MS)) != TC_OK)
            break;
        if (f == NULL)
            return tc_err(TC_UNAVAILABLE, "traind stopped sending metrics for %d s",
                          TC_REPLY_TIMEOUT_MS / 1000);
        type = td_pv_get(td_proto_frame_root(f), "type");
        if (tc_pv_is(type, "rows"))
            rc = sink_rows(s, f);
        else if (tc_pv_is(type, "end"))
            done = 1;
        else
            rc = tc_err(TC_PROTOCOL, "traind sent an unexpected frame in a metrics reply");
        td_proto_frame_free(f);
        f = NULL;
    }
    return rc;
}

int tc_metrics(const tc_opts *o)
{
    tc_conn *c = NULL;
    tc_sink *s = NULL;
    td_pw *w;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK)
        goto out;
    w = tc_conn_request(c, "metrics", o->keys ? 4 : 3);
    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    if (o->keys != NULL)
        tc_pw_keys(w, o->keys);
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_sink_new(&s, o)) != TC_OK)
        goto out;
    if ((rc = stream_rows(c, s)) == TC_OK)
        rc = tc_sink_finish(s);
out:
    tc_sink_free(s);
    tc_conn_close(c);
    return rc;
}
