/* The request/reply verbs: submit, status, ls, cancel, metrics, info and logs. Each opens a
 * connection, sends one request, reads its reply (or, for metrics, the run of rows frames up
 * to `end`), and prints it. watch, which follows a job live, is in watch.c; plot in plot.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

static int print_reply_json(const td_pval *root);

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

/* A dry run's answer: the estimate printed (or as JSON), and whether the job fits. */
static int dry_run_reply(const tc_opts *o, const td_pval *est)
{
    char msg[1100];
    int fits = 0, rc;

    if (td_pv_bool(td_pv_get(est, "fits"), &fits) != 0 ||
        td_pv_type_of(td_pv_get(est, "memory")) != TD_PV_MAP)
        return tc_err(TC_PROTOCOL, "traind's estimate reply has no fits or memory");
    if (o->json) {
        if ((rc = print_reply_json(est)) != TC_OK)
            return rc;
    } else {
        tc_print_estimate(est);
    }
    if (fits)
        return TC_OK;
    tc_job_str(est, "message", msg, sizeof(msg));
    return tc_err(TC_FAILED, "%s", msg[0] ? msg : "the job does not fit its devices");
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
    /* An older traind would ignore dry_run and queue the job: never send it one. */
    if (o->dry_run && !tc_conn_has(c, "dry_run")) {
        rc = tc_err(TC_UNAVAILABLE,
                    "traind at %s is too old for submit --dry-run; nothing was submitted",
                    o->socket);
        goto out;
    }
    w = tc_conn_request(c, "submit", o->dry_run ? 4 : 3);
    job = td_pw_body(&body, &len);
    td_pw_str(w, "job");
    td_pw_raw(w, job, len);
    if (o->dry_run) {
        td_pw_str(w, "dry_run");
        td_pw_bool(w, 1);
    }
    if ((rc = tc_conn_send(c)) != TC_OK ||
        (rc = tc_conn_expect(c, o->dry_run ? "estimate" : "submitted", &f)) != TC_OK)
        goto out;
    if (o->dry_run) {
        rc = dry_run_reply(o, td_proto_frame_root(f));
        goto out;
    }
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

/* Connects, sends {type, id, job_id} and waits for a reply of type reply. */
static int job_request(const tc_opts *o, tc_conn **c, const char *type, const char *reply,
                       td_proto_frame **f)
{
    int rc = tc_conn_open(c, o->socket);

    if (rc != TC_OK)
        return rc;
    return tc_conn_job_request(*c, type, o->job, reply, f);
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

static int sink_row(void *ud, const tc_row *row)
{
    return tc_sink_add(ud, row);
}

int tc_metrics(const tc_opts *o)
{
    tc_conn *c = NULL;
    tc_sink *s = NULL;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK || (rc = tc_sink_new(&s, o)) != TC_OK)
        goto out;
    if ((rc = tc_conn_metrics(c, o->job, o->keys, sink_row, s)) == TC_OK)
        rc = tc_sink_finish(s);
out:
    tc_sink_free(s);
    tc_conn_close(c);
    return rc;
}

/* A reply's top map as pretty JSON, without the protocol's own type and id. */
static int print_reply_json(const td_pval *root)
{
    json_t *j = tc_pv_to_json(root);
    int rc;

    if (j == NULL)
        return tc_err(TC_FAILED, "out of memory");
    json_object_del(j, "type");
    json_object_del(j, "id");
    rc = tc_dump_json(j, 1);
    json_decref(j);
    return rc;
}

int tc_info(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *root;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK)
        goto out;
    tc_conn_request(c, "info", 2);
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "info", &f)) != TC_OK)
        goto out;
    root = td_proto_frame_root(f);
    if (o->json)
        rc = print_reply_json(root);
    else
        tc_print_info(root);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}

/* syslog priorities as traind's --log-level names them. */
static const char *level_name(int64_t level)
{
    static const char *const names[] = {"emerg",   "alert",  "crit", "err",
                                        "warning", "notice", "info", "debug"};

    return level >= 0 && level < 8 ? names[level] : "level?";
}

/* One logs line, [time, level, message], checked. */
static int log_line(const td_pval *lines, size_t i, double *t, int64_t *level, const char **msg,
                    size_t *len)
{
    const td_pval *l = td_pv_at(lines, i);

    *msg = td_pv_str(td_pv_at(l, 2), len);
    if (td_pv_len(l) < 3 || td_pv_double(td_pv_at(l, 0), t) != 0 ||
        td_pv_int(td_pv_at(l, 1), level) != 0 || *msg == NULL)
        return tc_err(TC_PROTOCOL, "traind sent a log line that is not [time, level, message]");
    return TC_OK;
}

/* Prints the message and a newline; its own further lines start indent columns in, under
 * its first. */
static void print_indented(const char *msg, size_t len, int indent)
{
    const char *nl;

    while ((nl = memchr(msg, '\n', len)) != NULL) {
        printf("%.*s\n%*s", (int)(nl - msg), msg, indent, "");
        len -= (size_t)(nl + 1 - msg);
        msg = nl + 1;
    }
    printf("%.*s\n", (int)len, msg);
}

/* One line as "2026-11-30 05:16:51 notice message", or as a JSON object after sep. */
static void print_log_line(const tc_opts *o, const char *sep, double t, int64_t level,
                           const char *msg, size_t len)
{
    char when[64];

    if (o->json) {
        fprintf(stdout, "%s{\"job\":%lld,\"time\":%.3f,\"level\":%lld,\"level_name\":\"%s\",", sep,
                (long long)o->job, isfinite(t) ? t : 0.0, (long long)level, level_name(level));
        fputs("\"message\":", stdout);
        tc_json_str(stdout, msg, len);
        fputc('}', stdout);
    } else {
        tc_fmt_time(when, sizeof(when), t);
        printf("%s %s ", when, level_name(level));
        print_indented(msg, len, (int)(strlen(when) + strlen(level_name(level)) + 2));
    }
}

/* Checks every line first, so that a bad one leaves nothing half printed; then prints them,
 * as text or as a JSON array. */
static int print_logs(const tc_opts *o, const td_pval *lines)
{
    size_t i, n = td_pv_len(lines), len;
    const char *msg;
    int64_t level;
    double t;
    int rc = TC_OK;

    for (i = 0; i < n && rc == TC_OK; i++)
        rc = log_line(lines, i, &t, &level, &msg, &len);
    if (rc != TC_OK)
        return rc;
    if (o->json)
        fputs("[", stdout);
    for (i = 0; i < n; i++) {
        log_line(lines, i, &t, &level, &msg, &len);
        print_log_line(o, i ? ",\n" : "\n", t, level, msg, len);
    }
    if (o->json)
        fputs(n ? "\n]\n" : "]\n", stdout);
    return TC_OK;
}

int tc_logs(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *lines;
    int rc = job_request(o, &c, "logs", "logs", &f);

    if (rc != TC_OK)
        goto out;
    lines = td_pv_get(td_proto_frame_root(f), "lines");
    if (td_pv_type_of(lines) != TD_PV_ARRAY)
        rc = tc_err(TC_PROTOCOL, "traind's logs reply has no lines array");
    else
        rc = print_logs(o, lines);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}
