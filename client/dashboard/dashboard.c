/* trainctl dashboard: a web page for the jobs this user can see, served over HTTP by
 * libmicrohttpd and drawn in the browser with dygraphs. The server is a client of traind like
 * every other verb: each request opens its own connection to traind's socket and asks it (list,
 * status, logs, watch), so traind's permission checks apply to everything the page shows, and
 * the page shows nothing the user running trainctl could not see with `trainctl ls` or `watch`.
 *
 * Threads. main() blocks SIGINT and SIGTERM, starts libmicrohttpd with its own listening
 * thread and one thread per HTTP connection (at most TC_DASH_MAX_CONNS), prints the URL and
 * waits for a signal; then it makes the stop pipe readable (every live stream polls it and
 * ends) and stops the server, which joins the connection threads. A connection's thread runs
 * its requests start to end, blocking on traind where it must: a JSON request waits for one
 * reply, a live stream (dashboard_stream.c) lives in its thread for as long as the page is
 * open. Thread per connection keeps each of them a plain blocking loop, at the price of a
 * thread each, which the connection limit bounds. Nothing is shared between the threads but
 * the read-only tc_dash and two atomic counters.
 *
 * Security. It listens on 127.0.0.1 unless --listen names another address, and a
 * non-loopback address gets a warning on stderr. Every path lives under a random token
 * (/TOKEN/...) printed at start: on a shared machine anyone can connect to a loopback port, and
 * without the token another user would see, through this user's dashboard, whatever this user
 * may see through traind; a page elsewhere in the user's browser cannot guess it either. The
 * page and its scripts come from this server alone (no CDN), under a Content-Security-Policy
 * that allows no other origin and no inline script; every string from traind reaches the page
 * as JSON data and is put into the page as text, never as markup (app.js).
 *
 * Other local users can connect but not lock the page: a request must be whole within
 * TC_DASH_REQUEST_MS, a connection without the token gets one reply, and at the connection limit
 * the oldest one without the token is shed ("connections", below).
 *
 * Limits (dashboard.h): TC_DASH_MAX_CONNS HTTP connections, TC_DASH_MAX_STREAMS live streams
 * (each one traind connection, TC_DASH_STREAM_JOBS jobs), TC_DASH_BUCKETS points per series,
 * TC_DASH_LIST_MAX jobs per list page, TC_DASH_REPLY_MS for traind's answer to a request. Past
 * a limit the page gets an error it shows (503 for too many streams), never a wait. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "client/dashboard/dashboard.h"
#include "common/td_clock.h"
#include "common/td_text.h"

#define DASH_DEFAULT_LISTEN "127.0.0.1:8080"
#define DASH_IDLE_S         60   /* seconds an HTTP connection may sit idle (streams talk) */
#define DASH_LIST_DEFAULT   50   /* jobs of one list page unless the page asks */
#define DASH_LOG_DEFAULT    200  /* log lines of one page unless the page asks */
#define DASH_PWBUF          4096 /* bytes for getpwuid_r's strings */
#define DASH_PORT_TRIES     100  /* ports tried from the default one when it is in use */

#ifndef TC_DASHBOARD_DATADIR
#define TC_DASHBOARD_DATADIR "/usr/local/share/traind/dashboard"
#endif
#ifndef TC_DASHBOARD_SRCDIR
#define TC_DASHBOARD_SRCDIR ""
#endif
#ifndef TC_DYGRAPHS_DIR
#define TC_DYGRAPHS_DIR "/usr/share/javascript/dygraphs"
#endif

/* The page's own files, and the chart library's, with their types. */
typedef struct asset {
    const char *name;
    const char *type;
    int chartlib; /* found in the chart library's folder, not ours */
} asset;

static const asset assets[] = {
    {"index.html", "text/html; charset=utf-8", 0},
    {"app.js", "text/javascript; charset=utf-8", 0},
    {"style.css", "text/css; charset=utf-8", 0},
    {"dygraph.min.js", "text/javascript; charset=utf-8", 1},
    {"dygraph.min.css", "text/css; charset=utf-8", 1},
};

/* Scripts and styles from this server only; no framing, no forms, no other origin. dygraphs
 * sets element styles from script, which style-src 'unsafe-inline' lets through; scripts get
 * no such exception. */
#define DASH_CSP                                                                               \
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' " \
    "data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

/* ---- growable buffers and JSON ---- */

int tc__buf_add(tc_buf *b, const void *p, size_t len)
{
    if (b->len + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        char *q;
        while (cap < b->len + len + 1)
            cap *= 2;
        if ((q = realloc(b->p, cap)) == NULL)
            return -1;
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, p, len);
    b->len += len;
    b->p[b->len] = '\0';
    return 0;
}

int tc__buf_printf(tc_buf *b, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    if ((size_t)n < sizeof(small))
        return tc__buf_add(b, small, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (big == NULL)
        return -1;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    n = tc__buf_add(b, big, strlen(big));
    free(big);
    return n;
}

void tc__buf_free(tc_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

int tc__buf_json_str(tc_buf *b, const char *s, size_t len)
{
    int rc = tc__buf_add(b, "\"", 1);
    size_t i = 0, n;
    uint32_t cp;
    char esc[8];

    while (i < len && rc == 0) {
        n = td_text_char(s + i, len - i, &cp);
        if (n == 0) {
            rc = tc__buf_add(b, "\\ufffd", 6); /* a byte of malformed UTF-8 */
            i++;
            continue;
        }
        if (cp == '"' || cp == '\\') {
            esc[0] = '\\';
            esc[1] = (char)cp;
            rc = tc__buf_add(b, esc, 2);
        } else if (cp == '\n') {
            rc = tc__buf_add(b, "\\n", 2);
        } else if (cp < 0x20 || cp == 0x7f || cp == '<' || cp == '>' || cp == '&' || cp == 0x2028 ||
                   cp == 0x2029 || (cp >= 0x80 && cp <= 0x9f)) {
            snprintf(esc, sizeof(esc), "\\u%04x", (unsigned)cp);
            rc = tc__buf_add(b, esc, 6);
        } else {
            rc = tc__buf_add(b, s + i, n);
        }
        i += n;
    }
    return rc | tc__buf_add(b, "\"", 1);
}

int tc__buf_json_val(tc_buf *b, const td_pval *v)
{
    size_t len = 0;
    int64_t i = 0;
    double d = 0;
    int t = 0, rc = 0;
    const char *s;

    switch (td_pv_type_of(v)) {
    case TD_PV_BOOL:
        td_pv_bool(v, &t);
        return tc__buf_add(b, t ? "true" : "false", t ? 4 : 5);
    case TD_PV_INT:
        td_pv_int(v, &i);
        return tc__buf_printf(b, "%lld", (long long)i);
    case TD_PV_FLOAT:
        td_pv_double(v, &d);
        return isfinite(d) ? tc__buf_printf(b, "%.17g", d) : tc__buf_add(b, "null", 4);
    case TD_PV_STR:
        s = td_pv_str(v, &len);
        return tc__buf_json_str(b, s, len);
    case TD_PV_ARRAY:
        rc = tc__buf_add(b, "[", 1);
        for (size_t k = 0; k < td_pv_len(v) && rc == 0; k++) {
            if (k > 0)
                rc |= tc__buf_add(b, ",", 1);
            rc |= tc__buf_json_val(b, td_pv_at(v, k));
        }
        return rc | tc__buf_add(b, "]", 1);
    case TD_PV_MAP:
        rc = tc__buf_add(b, "{", 1);
        for (size_t k = 0, n = 0; k < td_pv_len(v) && rc == 0; k++) {
            s = td_pv_str(td_pv_key_at(v, k), &len);
            if (s == NULL)
                continue; /* PROTOCOL.md: keys are strings */
            if (n++ > 0)
                rc |= tc__buf_add(b, ",", 1);
            rc |= tc__buf_json_str(b, s, len);
            rc |= tc__buf_add(b, ":", 1);
            rc |= tc__buf_json_val(b, td_pv_val_at(v, k));
        }
        return rc | tc__buf_add(b, "}", 1);
    default:
        return tc__buf_add(b, "null", 4);
    }
}

void tc__dash_owner(int64_t uid, char *buf, size_t size)
{
    struct passwd pw, *found = NULL;
    char strings[DASH_PWBUF];

    if (uid < 0 || uid > UINT32_MAX) {
        snprintf(buf, size, "%s", "");
        return;
    }
    if (getpwuid_r((uid_t)uid, &pw, strings, sizeof(strings), &found) == 0 && found != NULL)
        snprintf(buf, size, "%s", found->pw_name);
    else
        snprintf(buf, size, "uid %lld", (long long)uid);
}

/* A JOB map as JSON with "owner" added: the user name of its uid (traind sends the uid). */
static int job_json(tc_buf *b, const td_pval *job)
{
    char owner[256];
    int64_t uid = -1;
    int rc;

    if (td_pv_type_of(job) != TD_PV_MAP)
        return tc__buf_json_val(b, job);
    rc = tc__buf_json_val(b, job);
    if (rc != 0 || b->len == 0)
        return rc;
    b->len--; /* the closing brace, put back after owner */
    if (td_pv_int(td_pv_get(job, "uid"), &uid) != 0)
        uid = -1;
    tc__dash_owner(uid, owner, sizeof(owner));
    rc = tc__buf_add(b,
                     td_pv_len(job) > 0 ? ",\"owner\":" : "\"owner\":", td_pv_len(job) > 0 ? 9 : 8);
    rc |= tc__buf_json_str(b, owner, strlen(owner));
    return rc | tc__buf_add(b, "}", 1);
}

/* ---- replies ---- */

/* Headers every reply carries. */
static void common_headers(struct MHD_Response *r, const char *type)
{
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "Content-Security-Policy", DASH_CSP);
}

/* Queues len bytes at p (copied) as the reply. */
static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type,
                             const char *p, size_t len)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)p, MHD_RESPMEM_MUST_COPY);
    enum MHD_Result ret;

    if (r == NULL)
        return MHD_NO;
    common_headers(r, type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

enum MHD_Result tc__dash_error(struct MHD_Connection *conn, unsigned status, const char *msg)
{
    tc_buf b = {0};
    enum MHD_Result ret;

    if (tc__buf_add(&b, "{\"error\":", 9) != 0 || tc__buf_json_str(&b, msg, strlen(msg)) != 0 ||
        tc__buf_add(&b, "}", 1) != 0) {
        tc__buf_free(&b);
        return MHD_NO;
    }
    ret = reply(conn, status, "application/json", b.p, b.len);
    tc__buf_free(&b);
    return ret;
}

static enum MHD_Result reply_json(struct MHD_Connection *conn, tc_buf *b, int rc)
{
    enum MHD_Result ret;

    if (rc != 0)
        ret = tc__dash_error(conn, 503, "out of memory");
    else
        ret = reply(conn, MHD_HTTP_OK, "application/json", b->p, b->len);
    tc__buf_free(b);
    return ret;
}

/* A page's file, from our folder or the chart library's. */
static enum MHD_Result serve_asset(tc_dash *d, struct MHD_Connection *conn, const asset *a)
{
    char path[4200];
    struct MHD_Response *r;
    struct stat st;
    enum MHD_Result ret;
    int fd;

    snprintf(path, sizeof(path), "%s/%s", a->chartlib ? d->chartlib : d->assets, a->name);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (fd >= 0)
            close(fd);
        return tc__dash_error(conn, MHD_HTTP_NOT_FOUND, "the dashboard's file is missing");
    }
    r = MHD_create_response_from_fd((size_t)st.st_size, fd); /* takes fd */
    if (r == NULL) {
        close(fd);
        return MHD_NO;
    }
    common_headers(r, a->type);
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

/* ---- query parameters ---- */

/* The query parameter name as an integer in [lo, hi]; dflt when absent. -1 when malformed. */
static int param_int(struct MHD_Connection *conn, const char *name, int64_t lo, int64_t hi,
                     int64_t dflt, int64_t *out)
{
    const char *s = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, name);
    char *end;
    long long v;

    *out = dflt;
    if (s == NULL || s[0] == '\0')
        return 0;
    if (s[0] < '0' || s[0] > '9')
        return -1;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* Comma-separated job ids: 1 to max distinct positive ids into ids. -1 when malformed. */
static int param_jobs(const char *s, int64_t *ids, size_t max, size_t *n)
{
    *n = 0;
    while (s != NULL && *s != '\0') {
        char *end;
        long long v;
        errno = 0;
        v = strtoll(s, &end, 10);
        if (errno != 0 || end == s || v <= 0 || (*end != ',' && *end != '\0') || *n == max)
            return -1;
        for (size_t i = 0; i < *n; i++)
            if (ids[i] == v)
                return -1;
        ids[(*n)++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    return *n > 0 ? 0 : -1;
}

/* ---- the JSON API ---- */

/* Opens a connection to traind for one request; an HTTP error is queued on failure. */
static int open_traind(tc_dash *d, struct MHD_Connection *conn, tc_dconn **c, enum MHD_Result *ret)
{
    char msg[TC_DASH_ERR_MAX];
    int rc = tc__dconn_open(c, d->socket, msg, sizeof(msg));

    if (rc != 0)
        *ret = tc__dash_error(conn, (unsigned)rc, msg);
    return rc;
}

/* Sends what was built on c and waits for a reply of type; an HTTP error is queued on
 * failure. */
static int call(tc_dconn *c, struct MHD_Connection *conn, const char *type, td_proto_frame **f,
                enum MHD_Result *ret)
{
    char msg[TC_DASH_ERR_MAX];
    int rc = tc__dconn_send(c, msg, sizeof(msg));

    if (rc == 0)
        rc = tc__dconn_call(c, type, f, msg, sizeof(msg));
    if (rc != 0)
        *ret = tc__dash_error(conn, (unsigned)rc, msg);
    return rc;
}

/* The `states` parameter: comma-separated state names, each checked, written as an array. 0
 * when absent, the count when given, -1 when a name is not a state. */
static int parse_states(const char *s, char names[5][16])
{
    static const char *const valid[] = {"queued", "running", "succeeded", "failed", "cancelled"};
    int n = 0;

    while (s != NULL && *s != '\0') {
        size_t len = strcspn(s, ",");
        int ok = 0;
        for (size_t i = 0; i < 5 && !ok; i++)
            ok = strlen(valid[i]) == len && memcmp(valid[i], s, len) == 0;
        if (!ok || n == 5)
            return -1;
        memcpy(names[n], s, len);
        names[n++][len] = '\0';
        s += len + (s[len] == ',');
    }
    return n;
}

/* GET api/jobs?after=N&limit=N&states=a,b&name=PATTERN&labels=K=V,K=V&newest=1: one page of
 * traind's list, {"jobs": [...], "more": bool, "next": int}. */
static enum MHD_Result api_jobs(tc_dash *d, struct MHD_Connection *conn)
{
    const char *name = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "name");
    const char *labels = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "labels");
    char why[200];
    const char *newest = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "newest");
    char states[5][16];
    int64_t after, limit, next = 0;
    int nstates, more = 0, rc;
    enum MHD_Result ret = MHD_NO;
    td_proto_frame *f = NULL;
    tc_dconn *c = NULL;
    tc_buf b = {0};
    td_pw *w;

    if (param_int(conn, "after", 0, INT64_MAX, 0, &after) != 0 ||
        param_int(conn, "limit", 1, TC_DASH_LIST_MAX, DASH_LIST_DEFAULT, &limit) != 0)
        return tc__dash_error(conn, 400, "after and limit must be whole numbers (limit 1 to 200)");
    nstates =
        parse_states(MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "states"), states);
    if (nstates < 0)
        return tc__dash_error(conn, 400,
                              "states: each must be queued, running, succeeded, failed or "
                              "cancelled");
    if (labels != NULL && labels[0] == '\0')
        labels = NULL;
    if (labels != NULL && tc_selector_check(labels, why, sizeof(why)) != 0)
        return tc__dash_error(conn, 400, why);
    if (open_traind(d, conn, &c, &ret) != 0)
        return ret;
    if (!tc__dconn_has(c, "list_pages") || (labels != NULL && !tc__dconn_has(c, "labels"))) {
        tc__dconn_close(c);
        return tc__dash_error(conn, 502,
                              labels != NULL ? "this traind is too old to select jobs by labels"
                                             : "this traind is too old to list jobs in pages");
    }
    int has_name = name != NULL && name[0] != '\0';
    w = tc__dconn_begin(c, "list", 5 + (nstates > 0) + has_name + (labels != NULL), NULL);
    td_pw_str(w, "after");
    td_pw_int(w, after);
    td_pw_str(w, "limit");
    td_pw_int(w, limit);
    td_pw_str(w, "newest_first");
    td_pw_bool(w, newest != NULL && strcmp(newest, "1") == 0);
    if (nstates > 0) {
        td_pw_str(w, "states");
        td_pw_array(w, (uint32_t)nstates);
        for (int i = 0; i < nstates; i++)
            td_pw_str(w, states[i]);
    }
    if (has_name) {
        td_pw_str(w, "name");
        td_pw_str(w, name);
    }
    if (labels != NULL)
        tc_pw_selector(w, labels);
    if (call(c, conn, "jobs", &f, &ret) == 0) {
        const td_pval *root = td_proto_frame_root(f), *jobs = td_pv_get(root, "jobs");
        td_pv_bool(td_pv_get(root, "more"), &more);
        if (td_pv_int(td_pv_get(root, "next"), &next) != 0)
            next = after;
        rc = tc__buf_add(&b, "{\"jobs\":[", 9);
        for (size_t i = 0; i < td_pv_len(jobs) && rc == 0; i++) {
            if (i > 0)
                rc |= tc__buf_add(&b, ",", 1);
            rc |= job_json(&b, td_pv_at(jobs, i));
        }
        rc |= tc__buf_printf(&b, "],\"more\":%s,\"next\":%lld}", more ? "true" : "false",
                             (long long)next);
        ret = reply_json(conn, &b, rc);
    }
    td_proto_frame_free(f);
    tc__dconn_close(c);
    return ret;
}

/* GET api/job?id=N: traind's status, {"job": JOB} with the spec and the owner's name. */
static enum MHD_Result api_job(tc_dash *d, struct MHD_Connection *conn)
{
    enum MHD_Result ret = MHD_NO;
    td_proto_frame *f = NULL;
    tc_dconn *c = NULL;
    tc_buf b = {0};
    int64_t id;
    td_pw *w;
    int rc;

    if (param_int(conn, "id", 1, INT64_MAX, 0, &id) != 0 || id == 0)
        return tc__dash_error(conn, 400, "id must be a job id");
    if (open_traind(d, conn, &c, &ret) != 0)
        return ret;
    w = tc__dconn_begin(c, "status", 3, NULL);
    td_pw_str(w, "job_id");
    td_pw_int(w, id);
    if (call(c, conn, "job", &f, &ret) == 0) {
        rc = tc__buf_add(&b, "{\"job\":", 7);
        rc |= job_json(&b, td_pv_get(td_proto_frame_root(f), "job"));
        rc |= tc__buf_add(&b, "}", 1);
        ret = reply_json(conn, &b, rc);
    }
    td_proto_frame_free(f);
    tc__dconn_close(c);
    return ret;
}

/* GET api/logs?id=N&after=X&limit=N: one page of the job's log, as traind's logs reply
 * {"lines": [[time, level, message], ...], "more": bool, "next": int}. Only the job's owner
 * (or root) may read it: traind says EPERM otherwise, which becomes 403. */
static enum MHD_Result api_logs(tc_dash *d, struct MHD_Connection *conn)
{
    enum MHD_Result ret = MHD_NO;
    td_proto_frame *f = NULL;
    int64_t id, after, limit, next = 0;
    tc_dconn *c = NULL;
    tc_buf b = {0};
    int more = 0, rc, paged;
    td_pw *w;

    if (param_int(conn, "id", 1, INT64_MAX, 0, &id) != 0 || id == 0 ||
        param_int(conn, "after", 0, INT64_MAX, 0, &after) != 0 ||
        param_int(conn, "limit", 1, TC_DASH_LOG_MAX, DASH_LOG_DEFAULT, &limit) != 0)
        return tc__dash_error(conn, 400, "id, after and limit must be whole numbers");
    if (open_traind(d, conn, &c, &ret) != 0)
        return ret;
    paged = tc__dconn_has(c, "logs_pages");
    w = tc__dconn_begin(c, "logs", paged ? 5 : 3, NULL);
    td_pw_str(w, "job_id");
    td_pw_int(w, id);
    if (paged) {
        td_pw_str(w, "after");
        td_pw_int(w, after);
        td_pw_str(w, "limit");
        td_pw_int(w, limit);
    }
    if (call(c, conn, "logs", &f, &ret) == 0) {
        const td_pval *root = td_proto_frame_root(f);
        td_pv_bool(td_pv_get(root, "more"), &more);
        if (td_pv_int(td_pv_get(root, "next"), &next) != 0)
            next = after;
        rc = tc__buf_add(&b, "{\"lines\":", 9);
        rc |= tc__buf_json_val(&b, td_pv_get(root, "lines"));
        rc |= tc__buf_printf(&b, ",\"more\":%s,\"next\":%lld}", more ? "true" : "false",
                             (long long)next);
        ret = reply_json(conn, &b, rc);
    }
    td_proto_frame_free(f);
    tc__dconn_close(c);
    return ret;
}

/* GET api/stream?jobs=1,2 */
static enum MHD_Result api_stream(tc_dash *d, struct MHD_Connection *conn)
{
    int64_t ids[TC_DASH_STREAM_JOBS];
    size_t n;

    if (param_jobs(MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "jobs"), ids,
                   TC_DASH_STREAM_JOBS, &n) != 0)
        return tc__dash_error(conn, 400, "jobs must be 1 to 8 distinct job ids, comma-separated");
    return tc__dash_stream(d, conn, ids, n);
}

/* ---- connections: the request deadline and shedding ---- */

/* libmicrohttpd's timeout is an idle timer that any byte resets, and its connection limit is
 * first come, first served: a local user without the token could hold every connection by
 * trickling a header a byte at a time. So the dashboard keeps its own table of connections:
 * a request must be whole (request line, headers and any body) within TC_DASH_REQUEST_MS of
 * the connection's accept, or of its request line on a kept-alive connection, whatever trickles
 * in meanwhile; a connection that has not shown the token gets one reply and is closed; and when
 * the table is full, the oldest connection that has not shown the token is shed to make room,
 * never one that has while another has not. All clients are local, so it goes by the token, not
 * by address. A guard thread cuts the connections whose deadline passed: it writes a 408 where
 * the request was still arriving and shuts the socket down, which wakes the connection's own
 * thread to close it; the record goes when libmicrohttpd says the connection closed, which is
 * before it closes the socket, so a cut never reaches a descriptor reused since. */

#define DASH_FD_RESERVE 64 /* descriptors kept for traind connections, files and the rest */
#define DASH_SHED_SLACK 64 /* connections libmicrohttpd may hold past ours while cut ones close */

enum { PH_REQUEST, PH_HANDLING, PH_IDLE };

typedef struct guard_conn {
    struct guard_conn *prev, *next; /* in accept order, oldest first */
    int fd;
    int phase;       /* PH_: its request arriving, being answered, or kept alive between two */
    int token;       /* a request line of it has shown the token */
    int nul;         /* its current request's URL holds %00 */
    int cut;         /* shut down by the guard: its thread is closing it */
    double deadline; /* monotonic ms, in PH_REQUEST and PH_IDLE */
} guard_conn;

typedef struct tc_guard {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* on CLOCK_MONOTONIC: a deadline may be nearer, or stop */
    guard_conn *head, *tail;
    size_t live; /* connections in the table that are not cut */
    size_t cap;  /* connections at once, at most */
    int stop;
    pthread_t thread;
    long long timed_out, shed; /* for the closing line */
} tc_guard;

static const char body_408[] = "the request did not arrive whole within 5 seconds\n";
static const char body_503[] =
    "the dashboard is at its connection limit and this connection shows no token\n";

/* Shuts c down (locked); where its request was still arriving (its thread is only reading
 * then), a reply of status with body is written first. */
static void guard_cut(tc_guard *g, guard_conn *c, const char *status, const char *body)
{
    char what[512];
    int n;

    if (c->cut)
        return;
    if (status != NULL && c->phase == PH_REQUEST && c->fd >= 0) {
        n = snprintf(what, sizeof(what),
                     "HTTP/1.1 %s\r\nConnection: close\r\nContent-Type: text/plain; "
                     "charset=utf-8\r\nContent-Length: %zu\r\n\r\n%s",
                     status, strlen(body), body);
        if (n > 0 && (size_t)n < sizeof(what))
            (void)!send(c->fd, what, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    if (c->fd >= 0)
        shutdown(c->fd, SHUT_RDWR);
    c->cut = 1;
    g->live--;
}

/* The guard thread: cuts each connection whose deadline has passed, then sleeps until the
 * nearest one. */
static void *guard_main(void *arg)
{
    tc_guard *g = arg;

    pthread_mutex_lock(&g->mu);
    while (!g->stop) {
        double now = td_mono_ms(), next = -1;
        for (guard_conn *c = g->head; c != NULL; c = c->next) {
            if (c->cut || c->phase == PH_HANDLING)
                continue;
            if (c->deadline <= now) {
                if (c->phase == PH_REQUEST)
                    g->timed_out++;
                guard_cut(g, c, "408 Request Timeout", body_408);
            } else if (next < 0 || c->deadline < next) {
                next = c->deadline;
            }
        }
        if (next < 0) {
            pthread_cond_wait(&g->cv, &g->mu);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            double ms = next - now + 1;
            ts.tv_sec += (time_t)(ms / 1000);
            ts.tv_nsec += (long)((ms - (double)(long long)(ms / 1000) * 1000) * 1e6);
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* A table for cap connections, and its thread. Returns 0, or an errno. */
static int guard_start(tc_guard **out, size_t cap)
{
    tc_guard *g = calloc(1, sizeof(*g));
    pthread_condattr_t ca;
    int rc;

    *out = NULL;
    if (g == NULL)
        return ENOMEM;
    g->cap = cap;
    pthread_mutex_init(&g->mu, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
    if ((rc = pthread_create(&g->thread, NULL, guard_main, g)) != 0) {
        pthread_cond_destroy(&g->cv);
        pthread_mutex_destroy(&g->mu);
        free(g);
        return rc;
    }
    *out = g;
    return 0;
}

/* Stops the thread and frees the table; call after libmicrohttpd has stopped. NULL is
 * accepted. */
static void guard_stop(tc_guard *g)
{
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    g->stop = 1;
    pthread_cond_signal(&g->cv);
    pthread_mutex_unlock(&g->mu);
    pthread_join(g->thread, NULL);
    while (g->head != NULL) { /* none: libmicrohttpd said each one closed */
        guard_conn *c = g->head;
        g->head = c->next;
        free(c);
    }
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

/* libmicrohttpd's word that a connection started or closed. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **ctx,
                          enum MHD_ConnectionNotificationCode toe)
{
    tc_guard *g = ((tc_dash *)cls)->guard;
    guard_conn *c = *ctx;

    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        int fd = ci != NULL ? ci->connect_fd : -1;
        if ((c = calloc(1, sizeof(*c))) == NULL) {
            if (fd >= 0)
                shutdown(fd, SHUT_RDWR); /* no record, no deadline: not served */
            return;
        }
        c->fd = fd;
        c->phase = PH_REQUEST;
        c->deadline = td_mono_ms() + TC_DASH_REQUEST_MS;
        pthread_mutex_lock(&g->mu);
        c->prev = g->tail;
        if (g->tail != NULL)
            g->tail->next = c;
        else
            g->head = c;
        g->tail = c;
        g->live++;
        if (g->live > g->cap) {
            /* The oldest that has not shown the token; this one at the latest. */
            guard_conn *v = g->head;
            while (v != NULL && (v->cut || v->token))
                v = v->next;
            if (v != NULL) {
                guard_cut(g, v, "503 Service Unavailable", body_503);
                g->shed++;
            }
        }
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
        *ctx = c;
        return;
    }
    if (c == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        g->head = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    else
        g->tail = c->prev;
    if (!c->cut)
        g->live--;
    pthread_mutex_unlock(&g->mu);
    free(c);
    *ctx = NULL;
}

/* The connection's record, or NULL when it has none. */
static guard_conn *guard_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);

    return ci != NULL ? ci->socket_context : NULL;
}

static int same_secret(const char *a, const char *b, size_t len);

/* A request line has arrived (uri is as sent, before any %-decoding): on a kept-alive
 * connection its deadline starts now; the token, once shown, marks the connection. */
static void *on_uri(void *cls, const char *uri, struct MHD_Connection *conn)
{
    tc_dash *d = cls;
    guard_conn *c = guard_of(conn);
    size_t tlen = strlen(d->token);
    int token = uri[0] == '/' && strlen(uri + 1) >= tlen && same_secret(uri + 1, d->token, tlen) &&
                (uri[1 + tlen] == '/' || uri[1 + tlen] == '\0' || uri[1 + tlen] == '?');

    if (c == NULL)
        return NULL;
    pthread_mutex_lock(&d->guard->mu);
    if (c->phase != PH_REQUEST) {
        c->phase = PH_REQUEST;
        c->deadline = td_mono_ms() + TC_DASH_REQUEST_MS;
        pthread_cond_signal(&d->guard->cv);
    }
    c->token |= token;
    c->nul = strstr(uri, "%00") != NULL;
    pthread_mutex_unlock(&d->guard->mu);
    return NULL;
}

/* The request is whole and about to be answered: no deadline while it is (a live stream lasts
 * as long as its page). Returns whether its URL held %00. */
static int guard_answering(tc_dash *d, struct MHD_Connection *conn)
{
    guard_conn *c = guard_of(conn);
    int nul = 0;

    if (c == NULL)
        return 0;
    pthread_mutex_lock(&d->guard->mu);
    if (!c->cut)
        c->phase = PH_HANDLING;
    nul = c->nul;
    pthread_mutex_unlock(&d->guard->mu);
    return nul;
}

/* A request has been answered: a connection that showed the token may wait DASH_IDLE_S for its
 * next request, any other is closed. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    tc_dash *d = cls;
    guard_conn *c = guard_of(conn);

    (void)con_cls;
    (void)toe;
    if (c == NULL)
        return;
    pthread_mutex_lock(&d->guard->mu);
    if (!c->token) {
        guard_cut(d->guard, c, NULL, NULL);
    } else if (!c->cut) {
        c->phase = PH_IDLE;
        c->deadline = td_mono_ms() + DASH_IDLE_S * 1000.0;
        pthread_cond_signal(&d->guard->cv);
    }
    pthread_mutex_unlock(&d->guard->mu);
}

/* ---- routing ---- */

/* Whether the first len bytes of a and b are equal, in time that does not depend on where
 * they differ: the token must not be guessable a byte at a time from response times. */
static int same_secret(const char *a, const char *b, size_t len)
{
    unsigned char diff = 0;

    for (size_t i = 0; i < len; i++)
        diff |= (unsigned char)(a[i] ^ b[i]);
    return diff == 0;
}

static enum MHD_Result route(tc_dash *d, struct MHD_Connection *conn, const char *url)
{
    static const char not_found[] =
        "Not found. Open the URL that trainctl dashboard printed when it started.\n";
    size_t tlen = strlen(d->token);
    const char *rest;

    if (url[0] != '/' || strlen(url + 1) < tlen || !same_secret(url + 1, d->token, tlen) ||
        (url[1 + tlen] != '/' && url[1 + tlen] != '\0'))
        return reply(conn, MHD_HTTP_NOT_FOUND, "text/plain; charset=utf-8", not_found,
                     strlen(not_found));
    if (url[1 + tlen] == '\0') {
        /* /TOKEN: the page's relative URLs need the trailing slash. */
        struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        char to[2 * TC_DASH_TOKEN_BYTES + 4];
        enum MHD_Result ret;
        if (r == NULL)
            return MHD_NO;
        snprintf(to, sizeof(to), "/%s/", d->token);
        MHD_add_response_header(r, "Location", to);
        ret = MHD_queue_response(conn, MHD_HTTP_FOUND, r);
        MHD_destroy_response(r);
        return ret;
    }
    rest = url + 2 + tlen;
    if (rest[0] == '\0')
        return serve_asset(d, conn, &assets[0]);
    for (size_t i = 0; i < sizeof(assets) / sizeof(assets[0]); i++)
        if (strcmp(rest, assets[i].name) == 0)
            return serve_asset(d, conn, &assets[i]);
    if (strcmp(rest, "api/jobs") == 0)
        return api_jobs(d, conn);
    if (strcmp(rest, "api/job") == 0)
        return api_job(d, conn);
    if (strcmp(rest, "api/logs") == 0)
        return api_logs(d, conn);
    if (strcmp(rest, "api/stream") == 0)
        return api_stream(d, conn);
    return tc__dash_error(conn, MHD_HTTP_NOT_FOUND, "no such page");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    static int seen; /* its address marks a request whose headers have been read */
    tc_dash *d = cls;

    (void)version;
    (void)upload;
    if (*con_cls == NULL) {
        *con_cls = &seen;
        return MHD_YES;
    }
    /* %00 would end the decoded path early: app.js%00../../etc/passwd is not app.js. */
    if (guard_answering(d, conn))
        return tc__dash_error(conn, MHD_HTTP_BAD_REQUEST, "the URL holds a NUL byte (%00)");
    if (*upload_size != 0)
        return tc__dash_error(conn, 413, "the dashboard takes no uploads");
    atomic_fetch_add(&d->served, 1);
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return tc__dash_error(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET");
    return route(d, conn, url);
}

static void on_log(void *cls, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));

static void on_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    size_t n;

    (void)cls;
    vsnprintf(msg, sizeof(msg), fmt, ap);
    /* A connection the guard cut, or a browser that left: one line each would let a flood of
     * connections flood stderr too. */
    if (strstr(msg, "detected connection closure") != NULL)
        return;
    n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n')
        msg[--n] = '\0';
    fprintf(stderr, "trainctl: dashboard: %s\n", msg);
}

/* ---- starting ---- */

/* The listening address: --listen HOST:PORT ([::1]:PORT for IPv6, HOST numeric or
 * "localhost"; a bare PORT or :PORT means 127.0.0.1). */
static int parse_listen(const char *arg, struct sockaddr_storage *sa, socklen_t *salen, char *host,
                        size_t hostsize)
{
    const char *colon = strrchr(arg, ':'), *h = arg;
    size_t hlen = colon != NULL ? (size_t)(colon - arg) : 0;
    const char *port_s = colon != NULL ? colon + 1 : arg;
    struct sockaddr_in *s4 = (struct sockaddr_in *)sa;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)sa;
    char *end;
    long port;

    errno = 0;
    port = strtol(port_s, &end, 10);
    if (port_s[0] < '0' || port_s[0] > '9' || *end != '\0' || errno != 0 || port > 65535)
        return -1;
    if (hlen >= 2 && h[0] == '[' && h[hlen - 1] == ']') {
        h++;
        hlen -= 2;
    }
    if (hlen == 0 || (hlen == 9 && memcmp(h, "localhost", 9) == 0)) {
        h = "127.0.0.1";
        hlen = 9;
    }
    if (hlen + 1 > hostsize)
        return -1;
    memcpy(host, h, hlen);
    host[hlen] = '\0';
    memset(sa, 0, sizeof(*sa));
    if (inet_pton(AF_INET, host, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t)port);
        *salen = sizeof(*s4);
        return 0;
    }
    if (inet_pton(AF_INET6, host, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t)port);
        *salen = sizeof(*s6);
        return 0;
    }
    return -1;
}

static int is_loopback(const struct sockaddr_storage *sa)
{
    if (sa->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr);
}

/* Whether dir holds file as a regular file. */
static int has_file(const char *dir, const char *file)
{
    char path[4200];
    struct stat st;

    snprintf(path, sizeof(path), "%s/%s", dir, file);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* The page's folder: $TRAINCTL_DASHBOARD_DIR, else where meson installed it, else the source
 * tree this trainctl was built from (a build that was never installed). */
static int find_assets(tc_dash *d)
{
    const char *env = getenv("TRAINCTL_DASHBOARD_DIR");
    const char *tries[] = {env, TC_DASHBOARD_DATADIR, TC_DASHBOARD_SRCDIR};

    for (size_t i = 0; i < 3; i++)
        if (tries[i] != NULL && tries[i][0] != '\0' && has_file(tries[i], "app.js") &&
            has_file(tries[i], "index.html")) {
            snprintf(d->assets, sizeof(d->assets), "%s", tries[i]);
            return TC_OK;
        }
    return tc_err(TC_CONFIG,
                  "dashboard: cannot find the page's files (index.html, app.js): not in "
                  "$TRAINCTL_DASHBOARD_DIR, %s or %s",
                  TC_DASHBOARD_DATADIR, TC_DASHBOARD_SRCDIR[0] ? TC_DASHBOARD_SRCDIR : "-");
}

/* The chart library: $TRAINCTL_DYGRAPHS_DIR, else Debian's libjs-dygraphs. */
static int find_chartlib(tc_dash *d)
{
    const char *env = getenv("TRAINCTL_DYGRAPHS_DIR");
    const char *dir = env != NULL && env[0] != '\0' ? env : TC_DYGRAPHS_DIR;

    if (!has_file(dir, "dygraph.min.js") || !has_file(dir, "dygraph.min.css"))
        return tc_err(TC_CONFIG,
                      "dashboard: the chart library is missing: no dygraph.min.js in %s "
                      "(Debian's libjs-dygraphs installs it; scripts/deps.sh does)",
                      dir);
    snprintf(d->chartlib, sizeof(d->chartlib), "%s", dir);
    return TC_OK;
}

static int make_token(tc_dash *d)
{
    unsigned char raw[TC_DASH_TOKEN_BYTES];

    if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw))
        return tc_err(TC_FAILED, "dashboard: cannot get random bytes for the token: %s",
                      strerror(errno));
    for (size_t i = 0; i < sizeof(raw); i++)
        snprintf(d->token + 2 * i, 3, "%02x", raw[i]);
    return TC_OK;
}

/* Checks that traind answers before anything listens: the same first failure (and exit
 * status) as any other verb. */
static int check_traind(const char *socket)
{
    tc_conn *c = NULL;
    int rc = tc_conn_open(&c, socket);

    tc_conn_close(c);
    return rc;
}

/* Raises the open-file limit to its hard limit and returns the connections the dashboard may
 * hold: TC_DASH_MAX_CONNS, or fewer when each (its socket and, while it asks traind, a socket
 * there) would not fit in the limit besides DASH_FD_RESERVE. */
static size_t conn_cap(rlim_t *files)
{
    struct rlimit rl;
    size_t cap = TC_DASH_MAX_CONNS;

    *files = 0;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return cap;
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t was = rl.rlim_cur;
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            rl.rlim_cur = was;
    }
    *files = rl.rlim_cur;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < DASH_FD_RESERVE + 2 * (rlim_t)cap)
        cap = rl.rlim_cur > DASH_FD_RESERVE + 32 ? (size_t)(rl.rlim_cur - DASH_FD_RESERVE) / 2 : 16;
    return cap;
}

/* A listening socket on sa's address at its port or, when that one is in use, at one of the
 * tries - 1 ports after it. Returns the socket with *port set, or -1 with errno set. */
static int listen_on(const struct sockaddr_storage *sa, socklen_t salen, unsigned tries,
                     unsigned *port)
{
    struct sockaddr_storage at = *sa;
    in_port_t *p = sa->ss_family == AF_INET6 ? &((struct sockaddr_in6 *)&at)->sin6_port
                                             : &((struct sockaddr_in *)&at)->sin_port;
    unsigned first = ntohs(*p);
    int one = 1, fd = -1, err = 0;

    for (unsigned i = 0; i < tries && first + i <= 65535; i++) {
        *p = htons((uint16_t)(first + i));
        fd = socket(sa->ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            return -1;
        /* SO_REUSEADDR lets a restarted dashboard take its port from connections in TIME_WAIT;
         * it does not let two listen on one port (that would be SO_REUSEPORT). */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (sa->ss_family == AF_INET6) /* [::]:PORT is IPv6 alone, as libmicrohttpd made it */
            setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
        if (bind(fd, (struct sockaddr *)&at, salen) == 0 && listen(fd, SOMAXCONN) == 0)
            break;
        err = errno;
        close(fd);
        fd = -1;
        if (err != EADDRINUSE)
            break;
    }
    if (fd < 0) {
        errno = err;
        return -1;
    }
    socklen_t len = sizeof(at);
    if (getsockname(fd, (struct sockaddr *)&at, &len) == 0)
        *port = ntohs(*p);
    return fd;
}

/* Runs the server until SIGINT or SIGTERM. tries: the ports to try from sa's (1 when the
 * address was named with --listen). */
static int serve(tc_dash *d, const struct sockaddr_storage *sa, socklen_t salen, unsigned tries,
                 const char *host, const sigset_t *stop)
{
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ERROR_LOG |
                     (sa->ss_family == AF_INET6 ? MHD_USE_IPv6 : 0);
    unsigned want = ntohs(sa->ss_family == AF_INET6 ? ((const struct sockaddr_in6 *)sa)->sin6_port
                                                    : ((const struct sockaddr_in *)sa)->sin_port);
    struct MHD_Daemon *mhd;
    int pipefd[2], sig = 0, lfd, rc;
    unsigned port = 0;
    rlim_t files;
    size_t cap = conn_cap(&files);

    lfd = listen_on(sa, salen, want == 0 ? 1 : tries, &port);
    if (lfd < 0 && errno == EADDRINUSE && tries > 1)
        return tc_err(TC_OSERR,
                      "dashboard: cannot listen on %s: ports %u to %u are all in use (--listen "
                      "%s:0 takes any free port)",
                      host, want, want + tries - 1 > 65535 ? 65535 : want + tries - 1, host);
    if (lfd < 0)
        return tc_err(
            TC_OSERR, "dashboard: cannot listen on %s port %u: %s%s", host, want, strerror(errno),
            errno == EADDRINUSE ? " (another dashboard? port 0 takes any free port)" : "");
    if (port != want && want != 0)
        fprintf(stderr, "trainctl: dashboard: port %u is in use (another dashboard?); using %u\n",
                want, port);
    if (cap < TC_DASH_MAX_CONNS)
        fprintf(stderr,
                "trainctl: dashboard: at most %zu connections at once: open files are limited "
                "to %llu\n",
                cap, (unsigned long long)files);
    if ((rc = guard_start(&d->guard, cap)) != 0) {
        close(lfd);
        return tc_err(TC_FAILED, "dashboard: cannot start a thread: %s", strerror(rc));
    }
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        close(lfd);
        guard_stop(d->guard);
        return tc_err(TC_FAILED, "dashboard: pipe: %s", strerror(errno));
    }
    d->stop_fd = pipefd[0];
    /* The logger first, so that libmicrohttpd's own messages about the options use it too. Its
     * connection limit is ours plus room for connections cut but not yet closed; its timeout
     * (idle, reset by any byte) only bounds a request being answered: the guard bounds the rest. */
    mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, d, MHD_OPTION_EXTERNAL_LOGGER, on_log,
                           NULL, MHD_OPTION_LISTEN_SOCKET, lfd, MHD_OPTION_CONNECTION_LIMIT,
                           (unsigned)(cap + DASH_SHED_SLACK), MHD_OPTION_CONNECTION_TIMEOUT,
                           (unsigned)DASH_IDLE_S, MHD_OPTION_NOTIFY_CONNECTION, on_connection, d,
                           MHD_OPTION_URI_LOG_CALLBACK, on_uri, d, MHD_OPTION_NOTIFY_COMPLETED,
                           on_completed, d, MHD_OPTION_END);
    if (mhd == NULL) {
        int err = errno;
        close(lfd);
        close(pipefd[0]);
        close(pipefd[1]);
        guard_stop(d->guard);
        return tc_err(TC_OSERR, "dashboard: cannot listen on %s: %s", host,
                      err != 0 ? strerror(err) : "libmicrohttpd could not start");
    }
    printf("trainctl dashboard: http://%s%s%s:%u/%s/\n", sa->ss_family == AF_INET6 ? "[" : "", host,
           sa->ss_family == AF_INET6 ? "]" : "", port, d->token);
    if (is_loopback(sa))
        printf("listening on %s port %u, loopback only: other machines cannot connect, and "
               "other users here need the URL's token\n",
               host, port);
    else
        printf("listening on %s port %u\n", host, port);
    fflush(stdout);
    if (!is_loopback(sa)) {
        char me[256];
        tc__dash_owner((int64_t)getuid(), me, sizeof(me));
        fprintf(stderr,
                "trainctl: warning: %s is not a loopback address: anyone who can reach port %u "
                "and has the URL sees every job that %s can see through traind\n",
                host, port, me);
    }
    while (sigwait(stop, &sig) != 0)
        ;
    /* The stop pipe becomes readable for every live stream: they end, and their threads with
     * them, so that MHD_stop_daemon's joins do not wait for a keep-alive. */
    close(pipefd[1]);
    MHD_stop_daemon(mhd); /* closes lfd */
    close(pipefd[0]);
    pthread_mutex_lock(&d->guard->mu);
    long long timed_out = d->guard->timed_out, shed = d->guard->shed;
    pthread_mutex_unlock(&d->guard->mu);
    fprintf(stderr,
            "trainctl: dashboard stopped (%s) after %lld requests; %lld connections timed out, "
            "%lld shed\n",
            strsignal(sig), (long long)atomic_load(&d->served), timed_out, shed);
    guard_stop(d->guard);
    d->guard = NULL;
    return TC_OK;
}

int tc_dashboard(const tc_opts *o)
{
    const char *addr = o->listen != NULL ? o->listen : DASH_DEFAULT_LISTEN;
    struct sockaddr_storage sa;
    socklen_t salen = 0;
    char host[INET6_ADDRSTRLEN + 1];
    sigset_t stop, old;
    tc_dash *d;
    int rc;

    if (parse_listen(addr, &sa, &salen, host, sizeof(host)) != 0)
        return tc_err(TC_USAGE,
                      "--listen needs HOST:PORT with a numeric address (127.0.0.1:8080, "
                      "[::1]:8080, 0.0.0.0:8080) or localhost:PORT, not '%s'",
                      addr);
    if ((d = calloc(1, sizeof(*d))) == NULL)
        return tc_err(TC_FAILED, "out of memory");
    d->socket = o->socket;
    atomic_init(&d->streams, 0);
    atomic_init(&d->served, 0);
    if ((rc = find_assets(d)) != TC_OK || (rc = find_chartlib(d)) != TC_OK ||
        (rc = make_token(d)) != TC_OK || (rc = check_traind(o->socket)) != TC_OK)
        goto out;
    /* Blocked before libmicrohttpd starts its threads, which inherit the mask: the signals
     * reach sigwait() in this thread alone. A browser that goes away mid-reply must not kill
     * the server (libmicrohttpd sends with MSG_NOSIGNAL; this is for the rest). */
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    pthread_sigmask(SIG_BLOCK, &stop, &old);
    rc = serve(d, &sa, salen, o->listen != NULL ? 1 : DASH_PORT_TRIES, host, &stop);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
out:
    free(d);
    return rc;
}
