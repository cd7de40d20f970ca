/* The connection to traind: a blocking Unix stream socket with a frame reader and a frame
 * writer from proto/. Opening it says hello; each request gets the next id, and each frame
 * read must answer the last request (or be an error frame with id -1). A CLI waits for one
 * thing at a time, so blocking I/O with poll() for the timeouts is all it needs. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/client.h"
#include "common/td_text.h"

#define TC_READ_CHUNK   65536 /* bytes read from the socket at a time */
#define TC_MAX_FEATURES 32    /* feature names of traind's hello kept */

struct tc_conn {
    int fd;
    const char *path; /* borrowed from the command line, for messages */
    td_proto_reader *reader;
    td_pw w;
    int64_t id;                         /* id of the last request */
    const char *type;                   /* type of the last request, for messages */
    char features[TC_MAX_FEATURES][32]; /* traind's hello's features */
    size_t nfeatures;
    int quiet; /* traind's error frames are returned, not printed (tc_conn_quiet) */
    char buf[TC_READ_CHUNK];
};

volatile sig_atomic_t tc_interrupted;

int tc_connect_unix(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    int fd, saved;

    if (len >= sizeof(sa.sun_path)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(sa.sun_path, path, len + 1);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (const struct sockaddr *)&sa, sizeof(sa)) != 0) {
        saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* Keeps the names in hello's features (PROTOCOL.md); an older traind sends none. */
static void keep_features(tc_conn *c, const td_pval *features)
{
    for (size_t i = 0; i < td_pv_len(features) && c->nfeatures < TC_MAX_FEATURES; i++)
        if (td_pv_strcpy(td_pv_at(features, i), c->features[c->nfeatures], 32) == 0)
            c->nfeatures++;
}

int tc_conn_has(const tc_conn *c, const char *feature)
{
    for (size_t i = 0; i < c->nfeatures; i++)
        if (strcmp(c->features[i], feature) == 0)
            return 1;
    return 0;
}

/* Sends hello and checks that traind speaks our protocol version. */
static int hello(tc_conn *c)
{
    td_pw *w = tc_conn_request(c, "hello", 4);
    td_proto_frame *f = NULL;
    int64_t version = -1;
    int rc;

    td_pw_str(w, "version");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "client");
    td_pw_str(w, "trainctl " TD_VERSION);
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_expect(c, "hello", &f)) != TC_OK)
        goto out;
    if (td_pv_int(td_pv_get(td_proto_frame_root(f), "version"), &version) != 0 ||
        version != TD_PROTO_VERSION)
        rc = tc_err(TC_PROTOCOL, "traind at %s speaks protocol version %lld, not %d", c->path,
                    (long long)version, TD_PROTO_VERSION);
    else
        keep_features(c, td_pv_get(td_proto_frame_root(f), "features"));
out:
    td_proto_frame_free(f);
    return rc;
}

/* Says why connecting failed: a path no socket can have is a configuration error (78), a
 * socket we may not use a permission error (77), anything else traind not being there (69). */
static int connect_error(const char *path, int err)
{
    struct stat st;

    if (err == ENAMETOOLONG)
        return tc_err(TC_CONFIG,
                      "cannot connect to traind at %s: the path is %zu bytes, and a Unix socket "
                      "path holds at most %zu (set --socket or $TRAIND_SOCKET to a shorter one)",
                      path, strlen(path), sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    if (err == EACCES || err == EPERM)
        return tc_err(
            TC_NOPERM,
            "cannot connect to traind at %s: %s (the socket admits its owner and its group only)",
            path, strerror(err));
    if (stat(path, &st) == 0 && !S_ISSOCK(st.st_mode))
        return tc_err(TC_CONFIG,
                      "cannot connect to traind at %s: it is %s, not a socket (set --socket or "
                      "$TRAIND_SOCKET to traind's socket)",
                      path, S_ISDIR(st.st_mode) ? "a directory" : "a file");
    if (err == ENOENT)
        return tc_err(TC_UNAVAILABLE,
                      "cannot connect to traind at %s: no such socket; is traind running? Start "
                      "it (systemctl start traind, or traind --socket PATH), or set --socket or "
                      "$TRAIND_SOCKET to the socket of one that runs",
                      path);
    if (err == ECONNREFUSED)
        return tc_err(TC_UNAVAILABLE,
                      "cannot connect to traind at %s: nothing listens on it (a socket left by a "
                      "traind that stopped); start traind (systemctl start traind), or set "
                      "--socket or $TRAIND_SOCKET to the socket of one that runs",
                      path);
    return tc_err(TC_UNAVAILABLE, "cannot connect to traind at %s: %s", path, strerror(err));
}

int tc_conn_open(tc_conn **out, const char *path)
{
    tc_conn *c = calloc(1, sizeof(*c));
    int rc;

    *out = NULL;
    if (c == NULL)
        return tc_err(TC_FAILED, "out of memory");
    c->fd = -1;
    c->path = path;
    td_pw_init(&c->w);
    if (td_proto_reader_new(&c->reader, 0) != 0) {
        rc = tc_err(TC_FAILED, "out of memory");
        goto fail;
    }
    c->fd = tc_connect_unix(path);
    if (c->fd < 0) {
        rc = connect_error(path, errno);
        goto fail;
    }
    if ((rc = hello(c)) != TC_OK)
        goto fail;
    *out = c;
    return TC_OK;
fail:
    tc_conn_close(c);
    return rc;
}

void tc_conn_close(tc_conn *c)
{
    if (c == NULL)
        return;
    if (c->fd >= 0)
        close(c->fd);
    td_proto_reader_free(c->reader);
    td_pw_free(&c->w);
    free(c);
}

td_pw *tc_conn_request(tc_conn *c, const char *type, uint32_t npairs)
{
    td_pw_reset(&c->w);
    c->id++;
    c->type = type;
    td_pw_map(&c->w, npairs);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, c->id);
    return &c->w;
}

int tc_conn_send(tc_conn *c)
{
    const char *p;
    size_t len;
    ssize_t n;
    int rc = td_pw_finish(&c->w, &p, &len);

    if (rc == TD_E2BIG)
        return tc_err(TC_DATAERR, "the %s request is larger than traind accepts (%u bytes)",
                      c->type, TD_PROTO_MAX_FRAME);
    if (rc != 0)
        return tc_err(TC_FAILED, "out of memory");
    while (len > 0) {
        n = send(c->fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR && !tc_interrupted)
            continue;
        if (n < 0 && errno == EINTR)
            return TC_INTERRUPTED;
        if (n < 0)
            return tc_err(TC_UNAVAILABLE, "lost the connection to traind at %s: %s", c->path,
                          strerror(errno));
        p += n;
        len -= (size_t)n;
    }
    return TC_OK;
}

/* Waits up to timeout_ms for bytes and feeds them to the reader; *timed_out when none came. */
static int fill(tc_conn *c, int timeout_ms, int *timed_out)
{
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    ssize_t n;
    int ready;

    *timed_out = 0;
    do {
        ready = poll(&pfd, 1, timeout_ms);
        if (ready < 0 && errno == EINTR && tc_interrupted)
            return TC_INTERRUPTED;
    } while (ready < 0 && errno == EINTR);
    if (ready == 0) {
        *timed_out = 1;
        return TC_OK;
    }
    n = ready < 0 ? -1 : read(c->fd, c->buf, sizeof(c->buf));
    if (n < 0 && errno == EINTR)
        return tc_interrupted ? TC_INTERRUPTED : TC_OK;
    if (n < 0)
        return tc_err(TC_UNAVAILABLE, "lost the connection to traind at %s: %s", c->path,
                      strerror(errno));
    if (n == 0)
        return tc_err(TC_UNAVAILABLE, "traind at %s closed the connection", c->path);
    if (td_proto_reader_feed(c->reader, c->buf, (size_t)n) != 0)
        return tc_err(TC_FAILED, "out of memory");
    return TC_OK;
}

/* Prints an error frame's message and turns its code (or, for EPERM, its name, which is what
 * PROTOCOL.md promises a client can rely on) into an exit status. */
static int remote_error(const tc_conn *c, const td_pval *root)
{
    char msg[4096];
    int64_t code = 0;
    size_t len = 0;
    const char *m = td_pv_str(td_pv_get(root, "message"), &len);

    td_pv_int(td_pv_get(root, "code"), &code);
    /* Printed escaped: a message may quote what some client sent (a path, a name). */
    if (m == NULL || len == 0)
        snprintf(msg, sizeof(msg), "%s", td_strerror((int)code));
    else
        td_text_escape(msg, sizeof(msg), m, len, TD_TEXT_KEEP_NEWLINES);
    if (!c->quiet)
        tc_err(TC_FAILED, "%s", msg);
    if (code == TD_EPERM || tc_pv_is(td_pv_get(root, "name"), "EPERM"))
        return TC_NOPERM;
    if (code == TD_EJOB)
        return TC_DATAERR;
    if (code == TD_EPROTO || code == TD_EVERSION)
        return TC_PROTOCOL;
    if (code == TD_EBUSY || tc_pv_is(td_pv_get(root, "name"), "EBUSY"))
        return TC_TEMPFAIL;
    return TC_FAILED;
}

/* Checks that frame f answers the last request; takes f. */
static int check_reply(tc_conn *c, td_proto_frame *f, td_proto_frame **out)
{
    const td_pval *root = td_proto_frame_root(f);
    int64_t id = -2;
    size_t len = 0;
    int rc = TC_OK;

    td_pv_int(td_pv_get(root, "id"), &id);
    if (tc_pv_is(td_pv_get(root, "type"), "error"))
        rc = remote_error(c, root);
    else if (td_pv_str(td_pv_get(root, "type"), &len) == NULL)
        rc = tc_err(TC_PROTOCOL, "traind sent a frame without a type");
    else if (id != c->id)
        rc = tc_err(TC_PROTOCOL, "traind answered request %lld while %lld was waiting",
                    (long long)id, (long long)c->id);
    if (rc != TC_OK) {
        td_proto_frame_free(f);
        return rc;
    }
    *out = f;
    return TC_OK;
}

/* ---- --selector ---- */

#define TC_MAX_LABELS 16
#define TC_LABEL_MAX  63

int tc_selector_check(const char *sel, char *why, size_t size)
{
    const char *p = sel, *end, *eq;
    int n = 0;

    for (;; p = end + 1) {
        end = strchrnul(p, ',');
        eq = memchr(p, '=', (size_t)(end - p));
        if (eq == NULL || eq == p || eq - p > TC_LABEL_MAX || end - eq - 1 > TC_LABEL_MAX) {
            snprintf(why, size,
                     "'%.*s' is not NAME=VALUE (a name of 1 to %d bytes, a value of "
                     "at most %d)",
                     (int)(end - p), p, TC_LABEL_MAX, TC_LABEL_MAX);
            return -1;
        }
        if (++n > TC_MAX_LABELS) {
            snprintf(why, size, "at most %d labels", TC_MAX_LABELS);
            return -1;
        }
        if (*end == '\0')
            return 0;
    }
}

uint32_t tc_selector_count(const char *sel)
{
    uint32_t n = 1;

    for (const char *p = sel; *p != '\0'; p++)
        n += *p == ',';
    return n;
}

void tc_pw_selector(td_pw *w, const char *sel)
{
    const char *p = sel, *end, *eq;

    td_pw_str(w, "labels");
    td_pw_map(w, tc_selector_count(sel));
    for (;; p = end + 1) {
        end = strchrnul(p, ',');
        eq = memchr(p, '=', (size_t)(end - p));
        td_pw_strn(w, p, (size_t)(eq - p));
        td_pw_strn(w, eq + 1, (size_t)(end - eq - 1));
        if (*end == '\0')
            return;
    }
}

void tc_conn_quiet(tc_conn *c, int quiet)
{
    c->quiet = quiet;
}

int tc_conn_recv(tc_conn *c, td_proto_frame **out, int timeout_ms)
{
    td_proto_frame *f = NULL;
    td_error_t err = {0};
    int rc, timed_out = 0;

    *out = NULL;
    for (;;) {
        rc = td_proto_reader_next(c->reader, &f, &err);
        if (rc < 0)
            return tc_err(TC_PROTOCOL, "unreadable frame from traind: %s", err.msg);
        if (rc == 1)
            return check_reply(c, f, out);
        if ((rc = fill(c, timeout_ms, &timed_out)) != TC_OK || timed_out)
            return rc;
    }
}

int tc_conn_expect(tc_conn *c, const char *type, td_proto_frame **out)
{
    td_proto_frame *f = NULL;
    const char *got;
    size_t len = 0;
    int rc = tc_conn_recv(c, &f, TC_REPLY_TIMEOUT_MS);

    *out = NULL;
    if (rc != TC_OK)
        return rc;
    if (f == NULL)
        return tc_err(TC_UNAVAILABLE, "traind at %s did not answer the %s request within %d s",
                      c->path, c->type, TC_REPLY_TIMEOUT_MS / 1000);
    if (!tc_pv_is(td_pv_get(td_proto_frame_root(f), "type"), type)) {
        got = td_pv_str(td_pv_get(td_proto_frame_root(f), "type"), &len);
        rc = tc_err(TC_PROTOCOL, "traind answered %s with '%.*s', not '%s'", c->type, (int)len, got,
                    type);
        td_proto_frame_free(f);
        return rc;
    }
    *out = f;
    return TC_OK;
}

int tc_conn_job_request(tc_conn *c, const char *type, int64_t job, const char *reply,
                        td_proto_frame **out)
{
    td_pw *w = tc_conn_request(c, type, 3);
    int rc;

    *out = NULL;
    td_pw_str(w, "job_id");
    td_pw_int(w, job);
    if ((rc = tc_conn_send(c)) != TC_OK)
        return rc;
    return tc_conn_expect(c, reply, out);
}

/* Passes the rows of one rows frame to row(). */
static int each_row(const td_proto_frame *f, tc_row_fn row, void *ud)
{
    const td_pval *rows = td_pv_get(td_proto_frame_root(f), "rows");
    tc_row r;
    size_t i;
    int rc = TC_OK;

    if (td_pv_type_of(rows) != TD_PV_ARRAY)
        return tc_err(TC_PROTOCOL, "traind sent a rows frame without rows");
    for (i = 0; i < td_pv_len(rows) && rc == TC_OK; i++)
        if ((rc = tc_row_at(rows, i, &r)) == TC_OK)
            rc = row(ud, &r);
    return rc;
}

/* Appends the names of the array at key of the end frame to buf, ", "-separated and
 * escaped; returns how many there were. */
static size_t names_of(const td_pval *end, const char *key, char *buf, size_t size)
{
    const td_pval *a = td_pv_get(end, key);
    size_t n = td_pv_len(a), used = 0, len;
    char name[4 * 64 + 1];

    buf[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        const char *s = td_pv_str(td_pv_at(a, i), &len);
        if (s == NULL)
            continue;
        td_text_escape(name, sizeof(name), s, len, 0);
        if (used + strlen(name) + 8 >= size) {
            snprintf(buf + used, size - used, "%s...", used ? ", " : "");
            break;
        }
        used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? ", " : "", name);
    }
    return n;
}

/* Reads rows frames up to the end frame, and what it says of the keys asked for. */
static int stream_rows(tc_conn *c, tc_row_fn row, void *ud, tc_key_report *report)
{
    td_proto_frame *f = NULL;
    const td_pval *type;
    int rc = TC_OK, done = 0;

    while (rc == TC_OK && !done) {
        if ((rc = tc_conn_recv(c, &f, TC_REPLY_TIMEOUT_MS)) != TC_OK)
            break;
        if (f == NULL)
            return tc_err(TC_UNAVAILABLE, "traind at %s stopped sending metrics for %d s", c->path,
                          TC_REPLY_TIMEOUT_MS / 1000);
        type = td_pv_get(td_proto_frame_root(f), "type");
        if (tc_pv_is(type, "rows")) {
            rc = each_row(f, row, ud);
        } else if (tc_pv_is(type, "end")) {
            done = 1;
            if (report != NULL) {
                const td_pval *end = td_proto_frame_root(f);
                report->nmissing =
                    names_of(end, "missing", report->missing, sizeof(report->missing));
                names_of(end, "available", report->available, sizeof(report->available));
            }
        } else
            rc = tc_err(TC_PROTOCOL, "traind sent an unexpected frame in a metrics reply");
        td_proto_frame_free(f);
        f = NULL;
    }
    return rc;
}

int tc_conn_metrics(tc_conn *c, int64_t job, const char *keys, tc_row_fn row, void *ud,
                    tc_key_report *report)
{
    td_pw *w = tc_conn_request(c, "metrics", keys != NULL ? 4 : 3);
    int rc;

    if (report != NULL)
        memset(report, 0, sizeof(*report));
    td_pw_str(w, "job_id");
    td_pw_int(w, job);
    if (keys != NULL)
        tc_pw_keys(w, keys);
    if ((rc = tc_conn_send(c)) != TC_OK)
        return rc;
    return stream_rows(c, row, ud, report);
}

void tc_pw_keys(td_pw *w, const char *s)
{
    const char *p, *end;
    uint32_t n = 0;

    for (p = s; *p != '\0'; p = *end != '\0' ? end + 1 : end) {
        end = strchrnul(p, ',');
        n += end > p;
    }
    td_pw_str(w, "keys");
    td_pw_array(w, n);
    for (p = s; *p != '\0'; p = *end != '\0' ? end + 1 : end) {
        end = strchrnul(p, ',');
        if (end > p)
            td_pw_strn(w, p, (size_t)(end - p));
    }
}

int tc_pv_is(const td_pval *v, const char *s)
{
    size_t len = 0;
    const char *p = td_pv_str(v, &len);

    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}
