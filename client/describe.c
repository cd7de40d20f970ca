/* trainctl describe JOB: the whole job as a person reads it, as kubectl describe shows a pod:
 * who, what state and why, its devices and times, its error device by device, its spec, its
 * last metrics, its checkpoints, and its events (the job's log). From one status and the log's
 * pages; another user's events are left out with a line saying so. */
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"
#include "common/td_text.h"

#define DESCRIBE_EVENTS 20 /* the log's last lines shown */
#define LABEL_WIDTH     16

static void label(const char *name)
{
    printf("%-*s", LABEL_WIDTH, name);
}

/* "root (uid 0)", "uid 1234" when the name is unknown. */
static void print_user(int64_t uid)
{
    struct passwd pw, *found = NULL;
    char buf[1024];

    label("User:");
    if (uid < 0)
        printf("unknown\n");
    else if (getpwuid_r((uid_t)uid, &pw, buf, sizeof(buf), &found) == 0 && found != NULL)
        printf("%s (uid %lld)\n", pw.pw_name, (long long)uid);
    else
        printf("uid %lld\n", (long long)uid);
}

/* A time and, after it, what it means: "2026-12-02 21:40:57 (after waiting 3s)", or with
 * after "(5m03s ago)". */
static void print_when(const char *name, double t, const char *before, double dur,
                       const char *after)
{
    char when[64], d[32];

    label(name);
    tc_fmt_time(when, sizeof(when), t);
    tc_fmt_duration(d, sizeof(d), dur);
    printf("%s (%s%s%s)\n", when, before, d, after);
}

static void print_error(const td_pval *job)
{
    const td_pval *e = td_pv_get(job, "error"), *devs = td_pv_get(e, "devices");
    char msg[1024], name[32], line[1024];
    int nodes;

    tc_job_error(job, msg, sizeof(msg));
    if (msg[0] == '\0')
        return;
    tc_job_str(e, "name", name, sizeof(name));
    label("Error:");
    for (char *p = msg, *nl; p != NULL; p = nl) {
        nl = strchr(p, '\n');
        if (nl != NULL)
            *nl++ = '\0';
        printf("%s%s%s\n", p == msg ? name : "", p == msg && name[0] ? ": " : "", p);
        if (nl != NULL)
            printf("%*s", LABEL_WIDTH, "");
    }
    if (td_pv_len(devs) == 0)
        return;
    /* a job that spans nodes names each device's node */
    nodes = td_pv_get(td_pv_at(devs, 0), "node_name") != NULL;
    printf("Failed devices:\n  %s%-8s%-12s%s\n", nodes ? "NODE            " : "", "DEVICE", "CODE",
           "MESSAGE");
    for (size_t i = 0; i < td_pv_len(devs); i++) {
        const td_pval *d = td_pv_at(devs, i);
        char node[80];
        tc_job_str(d, "node_name", node, sizeof(node));
        tc_job_str(d, "message", line, sizeof(line));
        if (nodes)
            printf("  %-16s", node);
        else
            printf("  ");
        printf("%-8lld%-12s%s\n", (long long)tc_job_int(d, "device", -1),
               td_errname((int)tc_job_int(d, "code", 0)), line);
    }
}

/* The spec as YAML, indented under its label. */
static int print_spec(const td_pval *job)
{
    json_t *j = tc_pv_to_json(td_pv_get(job, "spec"));
    char *text = NULL;
    size_t len = 0;
    FILE *mem;
    int rc = TC_OK;

    if (j == NULL)
        return TC_OK;
    mem = open_memstream(&text, &len);
    if (mem == NULL) {
        json_decref(j);
        return tc_err(TC_FAILED, "out of memory");
    }
    rc = tc_dump_yaml(mem, j);
    fclose(mem);
    json_decref(j);
    printf("Spec:\n");
    for (char *p = text, *nl; rc == TC_OK && p != NULL && *p != '\0'; p = nl) {
        nl = strchr(p, '\n');
        if (nl != NULL)
            *nl++ = '\0';
        printf("  %s\n", p);
    }
    free(text);
    return rc;
}

static int by_key(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void print_metrics(const td_pval *job)
{
    const td_pval *m = td_pv_get(job, "metrics");
    size_t n = td_pv_len(m);
    char(*keys)[64] = n > 0 ? calloc(n, sizeof(*keys)) : NULL;
    const char **order = n > 0 ? calloc(n, sizeof(*order)) : NULL;
    char val[32];
    double v;

    if (keys == NULL || order == NULL) {
        free(keys);
        free(order);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        size_t len = 0;
        const char *k = td_pv_str(td_pv_key_at(m, i), &len);
        td_text_escape(keys[i], sizeof(keys[i]), k != NULL ? k : "", k != NULL ? len : 0, 0);
        order[i] = keys[i];
    }
    qsort(order, n, sizeof(*order), by_key);
    printf("Last metrics:\n");
    for (size_t i = 0; i < n; i++) {
        v = tc_job_double(m, order[i], NAN);
        tc_fmt_value(val, sizeof(val), v);
        printf("  %-22s %s\n", order[i], val);
    }
    free(keys);
    free(order);
}

static void print_checkpoints(const td_pval *job)
{
    const td_pval *ck = td_pv_get(job, "checkpoints");
    char size[32], when[64];

    if (ck == NULL || td_pv_type_of(ck) != TD_PV_ARRAY) {
        printf("Checkpoints:    %s\n",
               ck == NULL ? "(traind does not list them)" : "on the cluster's shared file system");
        return;
    }
    if (td_pv_len(ck) == 0) {
        printf("Checkpoints:    none\n");
        return;
    }
    printf("Checkpoints:\n  %-10s%-12s%s\n", "STEP", "SIZE", "WRITTEN");
    for (size_t i = 0; i < td_pv_len(ck); i++) {
        const td_pval *e = td_pv_at(ck, i);
        tc_fmt_bytes(size, sizeof(size), (double)tc_job_int(e, "bytes", 0));
        tc_fmt_time(when, sizeof(when), tc_job_double(e, "time", 0));
        printf("  %-10lld%-12s%s\n", (long long)tc_job_int(e, "step", 0), size, when);
    }
}

static const char *level_name(int64_t level)
{
    return level <= 3 ? "err" : level == 4 ? "warning" : level == 5 ? "notice" : "info";
}

/* The log's last DESCRIBE_EVENTS lines, read page by page. */
static void print_events(tc_conn *c, int64_t job)
{
    static char lines[DESCRIBE_EVENTS][1024];
    static double times[DESCRIBE_EVENTS];
    static int64_t levels[DESCRIBE_EVENTS];
    int64_t after = 0, next = 0;
    size_t total = 0;
    int more = 1, rc = TC_OK;
    char when[64];

    tc_conn_quiet(c, 1);
    while (more && rc == TC_OK) {
        td_proto_frame *f = NULL;
        td_pw *w = tc_conn_request(c, "logs", 5);
        const td_pval *page;
        td_pw_str(w, "job_id");
        td_pw_int(w, job);
        td_pw_str(w, "after");
        td_pw_int(w, after);
        td_pw_str(w, "limit");
        td_pw_int(w, TD_PROTO_PAGE_MAX);
        if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "logs", &f)) != TC_OK)
            break;
        page = td_pv_get(td_proto_frame_root(f), "lines");
        for (size_t i = 0; i < td_pv_len(page); i++, total++) {
            const td_pval *l = td_pv_at(page, i);
            size_t len = 0, k = total % DESCRIBE_EVENTS;
            const char *m = td_pv_str(td_pv_at(l, 2), &len);
            times[k] = NAN;
            td_pv_double(td_pv_at(l, 0), &times[k]);
            td_pv_int(td_pv_at(l, 1), &levels[k]);
            td_text_escape(lines[k], sizeof(lines[k]), m != NULL ? m : "", m != NULL ? len : 0, 0);
        }
        more = 0;
        td_pv_bool(td_pv_get(td_proto_frame_root(f), "more"), &more);
        if (more && td_pv_int(td_pv_get(td_proto_frame_root(f), "next"), &next) == 0 &&
            next > after)
            after = next;
        else
            more = 0;
        td_proto_frame_free(f);
    }
    tc_conn_quiet(c, 0);
    if (rc == TC_NOPERM) {
        printf("Events:         (only the job's owner or root may read them)\n");
        return;
    }
    if (rc != TC_OK) {
        printf("Events:         (traind did not send them)\n");
        return;
    }
    printf("Events:%s\n",
           total > DESCRIBE_EVENTS ? " (the last 20; trainctl logs JOB has all)" : "");
    for (size_t i = total > DESCRIBE_EVENTS ? total - DESCRIBE_EVENTS : 0; i < total; i++) {
        size_t k = i % DESCRIBE_EVENTS;
        tc_fmt_time(when, sizeof(when), times[k]);
        printf("  %s  %-7s  %s\n", when, level_name(levels[k]), lines[k]);
    }
}

int tc_describe(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *job;
    char text[1024], state[32];
    double created, started, ended, now = tc_now_real();
    int64_t step, total;
    int rc = tc_conn_open(&c, o->socket);

    if (rc == TC_OK)
        rc = tc_conn_job_request(c, "status", o->job, "job", &f);
    if (rc != TC_OK)
        goto out;
    job = td_pv_get(td_proto_frame_root(f), "job");
    created = tc_job_double(job, "created", 0);
    started = tc_job_double(job, "started", 0);
    ended = tc_job_double(job, "ended", 0);
    step = tc_job_int(job, "step", 0);
    total = tc_job_int(job, "total_steps", 0);
    tc_job_str(job, "name", text, sizeof(text));
    label("Name:");
    printf("%s\n", text);
    label("Job:");
    printf("%lld\n", (long long)o->job);
    print_user(tc_job_int(job, "uid", -1));
    tc_job_str(job, "state", state, sizeof(state));
    label("State:");
    tc_job_str(job, "reason", text, sizeof(text));
    printf("%s%s%s%s\n", state, text[0] ? " (" : "", text, text[0] ? ")" : "");
    label("Priority:");
    printf("%lld\n", (long long)tc_job_int(job, "priority", 0));
    label("Step:");
    if (total > 0)
        printf("%lld of %lld (%d%%)\n", (long long)step, (long long)total,
               (int)(100 * step / total));
    else
        printf("%lld\n", (long long)step);
    tc_job_str(job, "device_list", text, sizeof(text));
    label("Devices:");
    printf("%lld%s%s%s\n", (long long)tc_job_int(job, "devices", 0), text[0] ? " (" : "", text,
           text[0] ? ")" : "");
    print_when("Created:", created, "", now - created, " ago");
    if (started > 0)
        print_when("Started:", started, "after waiting ", started - created, "");
    if (ended > 0 && started > 0)
        print_when("Ended:", ended, "after running ", ended - started, "");
    else if (ended > 0)
        print_when("Ended:", ended, "never started, ", ended - created, " after it was created");
    else if (started > 0) {
        label("Running for:");
        tc_fmt_duration(text, sizeof(text), now - started);
        printf("%s\n", text);
    }
    print_error(job);
    if ((rc = print_spec(job)) != TC_OK)
        goto out;
    print_metrics(job);
    print_checkpoints(job);
    print_events(c, o->job);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}
