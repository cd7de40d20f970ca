/* The dashboard's connection to traind: a blocking Unix stream socket with proto/'s frame
 * reader and writer, as conn.c's, but made for a server: it prints nothing (an error becomes
 * an HTTP status and a message for the page), and a stream may read frames answering any of
 * the requests it sent, so one connection carries the watches of several jobs. Each object
 * belongs to the one HTTP connection thread that opened it. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/client.h"
#include "client/dashboard/dashboard.h"
#include "common/td_clock.h"
#include "common/td_text.h"

#define DCONN_READ_CHUNK   65536 /* bytes read from the socket at a time */
#define DCONN_MAX_FEATURES 32    /* feature names of traind's hello kept */

struct tc_dconn {
    int fd;
    const char *path; /* borrowed, for messages */
    td_proto_reader *reader;
    td_pw w;
    int64_t id; /* id of the last request */
    char features[DCONN_MAX_FEATURES][32];
    size_t nfeatures;
    char buf[DCONN_READ_CHUNK];
};

int tc__dconn_fd(const tc_dconn *c)
{
    return c->fd;
}

int tc__dconn_has(const tc_dconn *c, const char *feature)
{
    for (size_t i = 0; i < c->nfeatures; i++)
        if (strcmp(c->features[i], feature) == 0)
            return 1;
    return 0;
}

td_pw *tc__dconn_begin(tc_dconn *c, const char *type, uint32_t npairs, int64_t *id)
{
    td_pw_reset(&c->w);
    c->id++;
    if (id != NULL)
        *id = c->id;
    td_pw_map(&c->w, npairs);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, c->id);
    return &c->w;
}

int tc__dconn_send(tc_dconn *c, char *msg, size_t size)
{
    const char *p;
    size_t len;
    ssize_t n;

    if (td_pw_finish(&c->w, &p, &len) != 0) {
        snprintf(msg, size, "the request is larger than traind accepts");
        return 400;
    }
    while (len > 0) {
        n = send(c->fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(msg, size, "lost the connection to traind at %s: %s", c->path,
                     strerror(errno));
            return 502;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int tc__dconn_read(tc_dconn *c, char *msg, size_t size)
{
    ssize_t n;

    do
        n = read(c->fd, c->buf, sizeof(c->buf));
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN)
        return 0;
    if (n <= 0) {
        snprintf(msg, size,
                 n == 0 ? "traind at %s closed the connection%s"
                        : "lost the connection to traind at %s: %s",
                 c->path, n == 0 ? "" : strerror(errno));
        return -1;
    }
    if (td_proto_reader_feed(c->reader, c->buf, (size_t)n) != 0) {
        snprintf(msg, size, "out of memory");
        return -1;
    }
    return 0;
}

int tc__dconn_take(tc_dconn *c, td_proto_frame **out, char *msg, size_t size)
{
    td_error_t err = {0};
    int rc = td_proto_reader_next(c->reader, out, &err);

    if (rc < 0) {
        snprintf(msg, size, "unreadable frame from traind: %s", err.msg);
        return -1;
    }
    return rc == 1;
}

int tc__dconn_error(const td_pval *root, char *msg, size_t size)
{
    int64_t code = 0;
    size_t len = 0;
    const char *m = td_pv_str(td_pv_get(root, "message"), &len);

    td_pv_int(td_pv_get(root, "code"), &code);
    if (m == NULL || len == 0)
        snprintf(msg, size, "%s", td_strerror((int)code));
    else
        td_text_escape(msg, size, m, len, TD_TEXT_KEEP_NEWLINES);
    if (code == TD_EPERM)
        return 403;
    if (code == TD_ENOTFOUND)
        return 404;
    if (code == TD_EPROTO || code == TD_EINVAL || code == TD_E2BIG)
        return 400;
    if (code == TD_EBUSY)
        return 503;
    return 502;
}

int tc__dconn_call(tc_dconn *c, const char *type, td_proto_frame **out, char *msg, size_t size)
{
    int64_t deadline = (int64_t)td_mono_ms() + TC_DASH_REPLY_MS, id = -2;
    td_proto_frame *f = NULL;
    const td_pval *root;
    int rc;

    *out = NULL;
    while ((rc = tc__dconn_take(c, &f, msg, size)) == 0) {
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int64_t left = deadline - (int64_t)td_mono_ms();
        if (left <= 0 || poll(&p, 1, (int)left) == 0) {
            snprintf(msg, size, "traind at %s did not answer within %d s", c->path,
                     TC_DASH_REPLY_MS / 1000);
            return 504;
        }
        if (tc__dconn_read(c, msg, size) != 0)
            return 502;
    }
    if (rc < 0)
        return 502;
    rc = 0;
    root = td_proto_frame_root(f);
    td_pv_int(td_pv_get(root, "id"), &id);
    if (tc_pv_is(td_pv_get(root, "type"), "error"))
        rc = tc__dconn_error(root, msg, size);
    else if (id != c->id || !tc_pv_is(td_pv_get(root, "type"), type))
        rc = (snprintf(msg, size, "traind answered the request with something else than %s", type),
              502);
    if (rc != 0) {
        td_proto_frame_free(f);
        return rc;
    }
    *out = f;
    return 0;
}

/* Says hello and keeps the features traind lists. */
static int hello(tc_dconn *c, char *msg, size_t size)
{
    td_pw *w = tc__dconn_begin(c, "hello", 4, NULL);
    td_proto_frame *f = NULL;
    const td_pval *features;
    int64_t version = -1;
    int rc;

    td_pw_str(w, "version");
    td_pw_int(w, TD_PROTO_VERSION);
    td_pw_str(w, "client");
    td_pw_str(w, "trainctl-dashboard " TD_VERSION);
    if ((rc = tc__dconn_send(c, msg, size)) != 0 ||
        (rc = tc__dconn_call(c, "hello", &f, msg, size)) != 0)
        return rc;
    if (td_pv_int(td_pv_get(td_proto_frame_root(f), "version"), &version) != 0 ||
        version != TD_PROTO_VERSION) {
        snprintf(msg, size, "traind at %s speaks protocol version %lld, not %d", c->path,
                 (long long)version, TD_PROTO_VERSION);
        td_proto_frame_free(f);
        return 502;
    }
    features = td_pv_get(td_proto_frame_root(f), "features");
    for (size_t i = 0; i < td_pv_len(features) && c->nfeatures < DCONN_MAX_FEATURES; i++)
        if (td_pv_strcpy(td_pv_at(features, i), c->features[c->nfeatures], 32) == 0)
            c->nfeatures++;
    td_proto_frame_free(f);
    return 0;
}

int tc__dconn_open(tc_dconn **out, const char *path, char *msg, size_t size)
{
    tc_dconn *c = calloc(1, sizeof(*c));
    int rc;

    *out = NULL;
    if (c == NULL) {
        snprintf(msg, size, "out of memory");
        return 503;
    }
    c->fd = -1;
    c->path = path;
    td_pw_init(&c->w);
    if (td_proto_reader_new(&c->reader, 0) != 0) {
        snprintf(msg, size, "out of memory");
        rc = 503;
        goto fail;
    }
    c->fd = tc_connect_unix(path);
    if (c->fd < 0) {
        int err = errno;
        snprintf(msg, size, "cannot connect to traind at %s: %s", path, strerror(err));
        rc = err == EACCES || err == EPERM ? 403 : 502;
        goto fail;
    }
    if ((rc = hello(c, msg, size)) != 0)
        goto fail;
    *out = c;
    return 0;
fail:
    tc__dconn_close(c);
    return rc;
}

void tc__dconn_close(tc_dconn *c)
{
    if (c == NULL)
        return;
    if (c->fd >= 0)
        close(c->fd);
    td_proto_reader_free(c->reader);
    td_pw_free(&c->w);
    free(c);
}
