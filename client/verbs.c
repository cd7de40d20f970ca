/* The request/reply verbs: submit, status, ls, cancel, metrics, info and logs. Each opens a
 * connection, sends one request, reads its reply (or, for metrics, the run of rows frames up
 * to `end`), and prints it. watch, which follows a job live, is in watch.c; plot in plot.c. */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/client.h"
#include "common/td_text.h"

/* The job file with its --set changes, as a msgpack body in *body. */
static int build_job(const tc_opts *o, td_pw *body)
{
    json_t *job = NULL;
    size_t i;
    int rc = tc_job_load(o->file, &job);

    for (i = 0; rc == TC_OK && i < o->nsets; i++)
        rc = tc_job_set(job, o->sets[i]);
    if (rc == TC_OK)
        rc = tc_job_resolve_paths(job);
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
        if ((rc = tc_print_reply_json(est)) != TC_OK)
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

static int print_yaml(const td_pval *v)
{
    json_t *j = tc_pv_to_json(v);
    int rc = j != NULL ? tc_dump_yaml(stdout, j) : tc_err(TC_FAILED, "out of memory");

    json_decref(j);
    return rc;
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
    else if (o->yaml)
        rc = print_yaml(job);
    else
        tc_print_status(job);
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}

/* Reads a paged reply's more and next (PROTOCOL.md, "list", "logs"): 0 with *more clear
 * when it is the last page (a traind too old to page sends neither), else the cursor of the
 * next page, which must move past after: up, or down when the listing is newest first (after
 * 0 being the start either way). */
static int next_page(const td_pval *root, const char *what, int64_t after, int descending,
                     int *more, int64_t *next)
{
    *more = 0;
    if (td_pv_get(root, "more") == NULL)
        return TC_OK;
    if (td_pv_bool(td_pv_get(root, "more"), more) != 0 ||
        (*more && (td_pv_int(td_pv_get(root, "next"), next) != 0 ||
                   (descending ? *next < 1 || (after > 0 && *next >= after) : *next <= after))))
        return tc_err(TC_PROTOCOL, "traind's %s reply has a bad more or next", what);
    return TC_OK;
}

/* The jobs ls prints, in the order it prints them, pointing into the reply frames they came
 * in. Caller frees the frames and both arrays. */
typedef struct job_list {
    td_proto_frame **frames;
    size_t nframes, cap_frames;
    const td_pval **jobs;
    size_t n, cap;
} job_list;

static int keep_frame(job_list *l, td_proto_frame *f)
{
    if (l->nframes == l->cap_frames) {
        size_t cap = l->cap_frames ? l->cap_frames * 2 : 16;
        void *fr = realloc(l->frames, cap * sizeof(*l->frames));
        if (fr == NULL) {
            td_proto_frame_free(f);
            return tc_err(TC_FAILED, "out of memory");
        }
        l->frames = fr;
        l->cap_frames = cap;
    }
    l->frames[l->nframes++] = f;
    return TC_OK;
}

/* Adds a page's jobs to the list, at most max of them. */
static int keep_jobs(job_list *l, const td_pval *jobs, int64_t max)
{
    size_t i, n = td_pv_len(jobs);

    if (max >= 0 && (int64_t)n > max)
        n = (size_t)max;
    if (l->n + n > l->cap) {
        size_t cap = l->cap ? l->cap : 1024;
        while (cap < l->n + n)
            cap *= 2;
        void *jo = realloc(l->jobs, cap * sizeof(*l->jobs));
        if (jo == NULL)
            return tc_err(TC_FAILED, "out of memory");
        l->jobs = jo;
        l->cap = cap;
    }
    for (i = 0; i < n; i++)
        l->jobs[l->n++] = td_pv_at(jobs, i);
    return TC_OK;
}

static int has_filters(const tc_opts *o)
{
    return o->states != 0 || o->uid >= 0 || o->name_glob != NULL || o->created_since >= 0 ||
           o->limit > 0 || o->selector != NULL;
}

/* Sends one list request: the page after `after`, of at most limit jobs, with ls's filters
 * (PROTOCOL.md, "list"). --limit asks for the newest jobs first, so that it stops after N. */
static int send_list(tc_conn *c, const tc_opts *o, int64_t after, int64_t limit)
{
    uint32_t n = 4 + (o->limit > 0) + (o->states != 0) + (o->uid >= 0) + (o->name_glob != NULL) +
                 (o->created_since >= 0) + (o->selector != NULL);
    td_pw *w = tc_conn_request(c, "list", n);
    uint32_t i, nstates = 0;

    td_pw_str(w, "after");
    td_pw_int(w, after);
    td_pw_str(w, "limit");
    td_pw_int(w, limit);
    if (o->limit > 0) {
        td_pw_str(w, "newest_first");
        td_pw_bool(w, 1);
    }
    if (o->states != 0) {
        for (i = 0; i < TC_NSTATES; i++)
            nstates += (o->states >> i) & 1;
        td_pw_str(w, "states");
        td_pw_array(w, nstates);
        for (i = 0; i < TC_NSTATES; i++)
            if (o->states & (1u << i))
                td_pw_str(w, tc_state_names[i]);
    }
    if (o->uid >= 0) {
        td_pw_str(w, "uid");
        td_pw_int(w, o->uid);
    }
    if (o->name_glob != NULL) {
        td_pw_str(w, "name");
        td_pw_str(w, o->name_glob);
    }
    if (o->created_since >= 0) {
        td_pw_str(w, "since");
        td_pw_double(w, o->created_since);
    }
    if (o->selector != NULL)
        tc_pw_selector(w, o->selector);
    return tc_conn_send(c);
}

/* Every page of the jobs that match (or, with --limit, the pages that hold the newest N),
 * then the list turned oldest first when traind sent it newest first. */
static int fetch_jobs(tc_conn *c, const tc_opts *o, job_list *l)
{
    td_proto_frame *f = NULL;
    const td_pval *jobs;
    int64_t after = 0, next = 0, left = o->limit > 0 ? o->limit : -1;
    int more = 1, rc = TC_OK;

    while (rc == TC_OK && more && left != 0) {
        int64_t page = left > 0 && left < TD_PROTO_PAGE_MAX ? left : TD_PROTO_PAGE_MAX;
        if ((rc = send_list(c, o, after, page)) != TC_OK ||
            (rc = tc_conn_expect(c, "jobs", &f)) != TC_OK || (rc = keep_frame(l, f)) != TC_OK)
            return rc;
        jobs = td_pv_get(td_proto_frame_root(f), "jobs");
        if (td_pv_type_of(jobs) != TD_PV_ARRAY)
            return tc_err(TC_PROTOCOL, "traind's jobs reply has no jobs array");
        if ((rc = keep_jobs(l, jobs, left)) != TC_OK)
            return rc;
        if (left > 0)
            left -= left < (int64_t)td_pv_len(jobs) ? left : (int64_t)td_pv_len(jobs);
        rc = next_page(td_proto_frame_root(f), "jobs", after, o->limit > 0, &more, &next);
        after = next;
    }
    for (size_t i = 0; o->limit > 0 && i < l->n / 2; i++) {
        const td_pval *t = l->jobs[i];
        l->jobs[i] = l->jobs[l->n - 1 - i];
        l->jobs[l->n - 1 - i] = t;
    }
    return rc;
}

/* The jobs as one JSON array (or YAML sequence). */
static int print_jobs_json(const job_list *l, int yaml)
{
    json_t *all = json_array();
    int rc = all != NULL ? TC_OK : tc_err(TC_FAILED, "out of memory");

    for (size_t i = 0; rc == TC_OK && i < l->n; i++)
        if (json_array_append_new(all, tc_pv_to_json(l->jobs[i])) != 0)
            rc = tc_err(TC_FAILED, "out of memory");
    if (rc == TC_OK)
        rc = yaml ? tc_dump_yaml(stdout, all) : tc_dump_json(all, 1);
    json_decref(all);
    return rc;
}

int tc_ls(const tc_opts *o)
{
    job_list l = {0};
    tc_conn *c = NULL;
    int rc = tc_conn_open(&c, o->socket);

    /* A traind that does not page ignores the filters and sends every job: never show that
     * as the jobs that match. */
    if (rc == TC_OK && has_filters(o) && !tc_conn_has(c, "list_pages"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old to filter or limit ls", o->socket);
    if (rc == TC_OK && o->selector != NULL && !tc_conn_has(c, "labels"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old to select jobs by labels", o->socket);
    if (rc == TC_OK)
        rc = fetch_jobs(c, o, &l);
    if (rc == TC_OK && (o->json || o->yaml))
        rc = tc_ls_sort(l.jobs, l.n, o->sort);
    if (rc == TC_OK && (o->json || o->yaml))
        rc = print_jobs_json(&l, o->yaml);
    else if (rc == TC_OK)
        rc = tc_ls_print(l.jobs, l.n,
                         o->ls_format != NULL ? o->ls_format
                         : o->wide            ? tc_ls_wide_format
                                              : tc_ls_default_format,
                         o->sort);
    for (size_t i = 0; i < l.nframes; i++)
        td_proto_frame_free(l.frames[i]);
    free(l.frames);
    free(l.jobs);
    tc_conn_close(c);
    return rc;
}

/* Cancels one job on c, printing how it went; an error is printed (tc_err) and returned. */
static int cancel_one(tc_conn *c, int64_t job)
{
    td_proto_frame *f = NULL;
    char state[32];
    int rc = tc_conn_job_request(c, "cancel", job, "cancelled", &f);

    if (rc != TC_OK)
        return rc;
    tc_job_str(td_proto_frame_root(f), "state", state, sizeof(state));
    if (strcmp(state, "running") == 0)
        printf("job %lld: cancelling (stops at its next step)\n", (long long)job);
    else
        printf("job %lld: %s\n", (long long)job, state[0] ? state : "cancelled");
    td_proto_frame_free(f);
    return TC_OK;
}

/* The ids of the queued and running jobs (or those of --state) that the filters match. */
static int matching_ids(tc_conn *c, const tc_opts *o, int64_t **ids, size_t *n)
{
    tc_opts q = *o;
    job_list l = {0};
    int rc;

    if (q.states == 0)
        q.states = 1u | 2u; /* queued, running: what can be cancelled */
    q.limit = -1;
    q.created_since = -1;
    *ids = NULL;
    *n = 0;
    if (!tc_conn_has(c, "list_pages") || (o->selector != NULL && !tc_conn_has(c, "labels")))
        return tc_err(TC_UNAVAILABLE, "traind at %s is too old to filter jobs for cancel",
                      o->socket);
    rc = fetch_jobs(c, &q, &l);
    if (rc == TC_OK && l.n > 0 && (*ids = calloc(l.n, sizeof(**ids))) == NULL)
        rc = tc_err(TC_FAILED, "out of memory");
    for (size_t i = 0; rc == TC_OK && i < l.n; i++)
        (*ids)[(*n)++] = tc_job_int(l.jobs[i], "id", -1);
    for (size_t i = 0; i < l.nframes; i++)
        td_proto_frame_free(l.frames[i]);
    free(l.frames);
    free(l.jobs);
    return rc;
}

/* cancel JOB..., or cancel with filters: each job in turn on one connection; one that cannot
 * be cancelled is named (tc_err) and the rest still are; the first failure's status is
 * returned. */
int tc_cancel(const tc_opts *o)
{
    tc_conn *c = NULL;
    int64_t *found = NULL;
    const int64_t *ids = o->jobs;
    size_t n = o->njobs;
    int rc = tc_conn_open(&c, o->socket), first = TC_OK;

    if (rc == TC_OK && n == 0) {
        rc = matching_ids(c, o, &found, &n);
        ids = found;
        if (rc == TC_OK && n == 0)
            fprintf(stderr, "trainctl: no %s job matches; nothing to cancel\n",
                    o->states == 1u   ? "queued"
                    : o->states == 2u ? "running"
                                      : "queued or running");
    }
    for (size_t i = 0; rc == TC_OK && i < n; i++) {
        int one = cancel_one(c, ids[i]);
        if (one != TC_OK && first == TC_OK)
            first = one;
        if (one == TC_UNAVAILABLE || one == TC_PROTOCOL)
            rc = one; /* the connection is gone: the rest cannot be asked */
    }
    free(found);
    tc_conn_close(c);
    return rc != TC_OK ? rc : first;
}

static int sink_row(void *ud, const tc_row *row)
{
    return tc_sink_add(ud, row);
}

int tc_metrics(const tc_opts *o)
{
    tc_key_report report;
    tc_conn *c = NULL;
    tc_sink *s = NULL;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK || (rc = tc_sink_new(&s, o)) != TC_OK)
        goto out;
    if ((rc = tc_conn_metrics(c, o->job, o->keys, sink_row, s, &report)) == TC_OK)
        rc = tc_sink_finish(s);
    /* The rows of the names that exist are printed; a name that does not is an error, which
     * says what the job has instead. */
    if (rc == TC_OK && report.nmissing > 0 && report.available[0] != '\0')
        rc = tc_err(TC_FAILED, "job %lld has no metric named %s; its metrics are %s",
                    (long long)o->job, report.missing, report.available);
    else if (rc == TC_OK && report.nmissing > 0)
        rc = tc_err(TC_FAILED, "job %lld has no metric named %s; it has no metrics yet",
                    (long long)o->job, report.missing);
out:
    tc_sink_free(s);
    tc_conn_close(c);
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
        rc = tc_print_reply_json(root);
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
        /* What a line quotes (a path, a name) is printed escaped: nothing in it may drive the
         * terminal. */
        static char esc[4 * 8192 + 1];
        size_t n = td_text_escape(esc, sizeof(esc), msg, len, TD_TEXT_KEEP_NEWLINES);
        tc_fmt_time(when, sizeof(when), t);
        printf("%s %s ", when, level_name(level));
        print_indented(esc, n, (int)(strlen(when) + strlen(level_name(level)) + 2));
    }
}

/* Checks every line of a page first, so that a bad one leaves nothing of it half printed;
 * then prints them, as text or as elements of a JSON array (*nprinted lines before them). */
static int print_logs(const tc_opts *o, const td_pval *lines, size_t *nprinted)
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
    for (i = 0; i < n; i++) {
        log_line(lines, i, &t, &level, &msg, &len);
        print_log_line(o, (*nprinted)++ ? ",\n" : "\n", t, level, msg, len);
    }
    return TC_OK;
}

#define TC_FOLLOW_POLL_MS 500 /* logs -f: how often traind is asked for new lines */

/* Whether job has ended, from its status; a request error is returned. */
static int job_ended(tc_conn *c, int64_t job, int *ended)
{
    td_proto_frame *f = NULL;
    char state[32];
    int rc = tc_conn_job_request(c, "status", job, "job", &f);

    if (rc != TC_OK)
        return rc;
    tc_job_str(td_pv_get(td_proto_frame_root(f), "job"), "state", state, sizeof(state));
    *ended = strcmp(state, "succeeded") == 0 || strcmp(state, "failed") == 0 ||
             strcmp(state, "cancelled") == 0;
    td_proto_frame_free(f);
    return TC_OK;
}

static void on_follow_sigint(int sig)
{
    (void)sig;
    tc_interrupted = 1;
}

int tc_logs(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *lines;
    int64_t after = 0, next = 0;
    size_t nprinted = 0, got;
    int more = 1, opened = 0, ended = 0, rc = tc_conn_open(&c, o->socket);
    struct sigaction sa = {.sa_handler = on_follow_sigint, .sa_flags = SA_RESETHAND};

    if (o->follow) { /* Ctrl-C ends the follow cleanly (a JSON array is closed) */
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
    }
    /* Page after page (PROTOCOL.md, "logs"), each printed as it comes; with -f, once the job
     * has ended (asked before the page, so that no line written before its end is missed),
     * a last empty page ends it, else traind is asked again TC_FOLLOW_POLL_MS later. */
    while (rc == TC_OK && !tc_interrupted) {
        td_pw *w;
        if (o->follow && !more && (rc = job_ended(c, o->job, &ended)) != TC_OK)
            break;
        w = tc_conn_request(c, "logs", 5);
        td_pw_str(w, "job_id");
        td_pw_int(w, o->job);
        td_pw_str(w, "after");
        td_pw_int(w, after);
        td_pw_str(w, "limit");
        td_pw_int(w, TD_PROTO_PAGE_MAX);
        if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "logs", &f)) != TC_OK)
            break;
        lines = td_pv_get(td_proto_frame_root(f), "lines");
        if (td_pv_type_of(lines) != TD_PV_ARRAY)
            rc = tc_err(TC_PROTOCOL, "traind's logs reply has no lines array");
        if (rc == TC_OK && o->json && !opened)
            fputs("[", stdout); /* only once traind has answered: a refusal prints nothing */
        opened |= rc == TC_OK;
        got = nprinted;
        if (rc == TC_OK)
            rc = print_logs(o, lines, &nprinted);
        if (rc == TC_OK)
            rc = next_page(td_proto_frame_root(f), "logs", after, 0, &more, &next);
        /* The last page's next too: where a follow asks from (the same after, when empty). */
        if (rc == TC_OK && !more && nprinted > got &&
            td_pv_int(td_pv_get(td_proto_frame_root(f), "next"), &next) == 0 && next < after)
            rc = tc_err(TC_PROTOCOL, "traind's logs reply has a bad next");
        after = rc == TC_OK && (more || nprinted > got) ? next : after;
        td_proto_frame_free(f);
        f = NULL;
        fflush(stdout);
        if (!more && (!o->follow || ended))
            break;
        if (!more) {
            struct timespec ts = {0, TC_FOLLOW_POLL_MS * 1000000L};
            nanosleep(&ts, NULL);
        }
    }
    if (o->json && opened)
        fputs(nprinted ? "\n]\n" : "]\n", stdout);
    tc_conn_close(c);
    return rc == TC_OK && tc_interrupted ? TC_INTERRUPTED : rc;
}
