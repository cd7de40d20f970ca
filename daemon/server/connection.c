/* The server's connections (connection.h): accepting them against the limits, cutting
 * frames, writing replies, the water marks, holds, producers and the timeouts. Loop thread
 * only.
 *
 * A connection's output is held to TD_CONN_HIGH_WATER: producers write only below it, and a
 * connection whose unsent replies pass it is read no further (its requests wait in the
 * socket) until it has drained below TD_CONN_LOW_WATER. A sweep timer closes connections
 * that have not said hello within hello_timeout_s and idle ones after idle_timeout_s; a
 * connection with a producer attached or a hold on it is not idle. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "daemon/server/connection.h"
#include "common/td_log.h"
#include "common/td_tsan.h"

#define TD_SWEEP_MAX_MS 1000 /* the sweep timer's period, at most... */
#define TD_SWEEP_MIN_MS 20   /* ...and at least */

struct td_conns {
    uv_timer_t sweep; /* first: the handle's data is the set; closes timed-out connections */
    uv_loop_t *loop;
    td_conn_limits lim;
    td_conn_frame_cb on_frame;
    void *ud;
    td_conn *list; /* newest first */
    int n;
    int sweeping; /* sweep is initialised and not yet closed */
};

struct td_conn {
    uv_pipe_t pipe; /* first: the handle's memory is the connection's */
    td_conns *cs;
    td_proto_reader *reader;
    td_pw w;
    size_t pending; /* bytes handed to uv_write and not yet written */
    int hello;
    int replying; /* td_conn_reply began a frame that td_conn_send has not sent */
    int closing;
    int closed;  /* the handle's close callback has run; the memory waits for holds == 0 */
    int holds;   /* td_conn_hold's: no request is read, the memory outlives a close */
    int paused;  /* unsent replies passed TD_CONN_HIGH_WATER: no request is read until they
                  * drain below TD_CONN_LOW_WATER */
    int reading; /* uv_read_start is in effect */
    int64_t uid, gid, pid;
    uint64_t accepted_ms; /* uv_now at accept: the hello timeout counts from there */
    uint64_t since_ms;    /* uv_now at accept, then at the last frame read or write done */
    td_producer *producers;
    td_conn *next;
};

typedef struct wreq {
    uv_write_t req;
    td_conn *c;
    size_t len;
    char data[];
} wreq;

static void serve_frames(td_conn *c, const char *bytes, size_t n);
static void want_read(td_conn *c);

/* ---- output ---- */

/* The producers write more, in turn, while c has room; a pump may detach (and free) its own
 * producer, or close c, whose producers then stay until its close callback. */
static void pump_producers(td_conn *c)
{
    td_producer *p = c->producers;

    while (p != NULL && !c->closing) {
        td_producer *next = p->next;
        p->ops->pump(p);
        p = next;
    }
}

static void on_write(uv_write_t *req, int status)
{
    wreq *r = (wreq *)req;
    td_conn *c = r->c;

    c->pending -= r->len;
    free(r);
    if (status == UV_ECANCELED || c->closing)
        return;
    if (status < 0) {
        td_log_info("client pid %lld: write failed: %s", (long long)c->pid, uv_strerror(status));
        td_conn_close(c);
        return;
    }
    c->since_ms = uv_now(c->cs->loop);
    if (c->pending < TD_CONN_LOW_WATER)
        pump_producers(c);
    if (c->paused && c->pending < TD_CONN_LOW_WATER && !c->closing) {
        /* Drained: the requests that waited in the reader first, then the socket again. */
        c->paused = 0;
        serve_frames(c, "", 0);
        want_read(c);
    }
}

/* Sends the frame built in c->w. */
static void send_frame(td_conn *c)
{
    const char *frame;
    size_t len;
    wreq *r;
    uv_buf_t buf;
    int rc;

    if (c->closing)
        return;
    rc = td_pw_finish(&c->w, &frame, &len);
    if (rc != 0) {
        td_log_err("client pid %lld: cannot build a reply: %s", (long long)c->pid, td_strerror(rc));
        td_conn_close(c);
        return;
    }
    r = malloc(sizeof(*r) + len);
    if (r == NULL) {
        td_conn_close(c);
        return;
    }
    r->c = c;
    r->len = len;
    memcpy(r->data, frame, len);
    buf = uv_buf_init(r->data, (unsigned)len);
    c->pending += len;
    rc = uv_write(&r->req, (uv_stream_t *)&c->pipe, &buf, 1, on_write);
    if (rc != 0) {
        c->pending -= len;
        free(r);
        td_conn_close(c);
    }
}

td_pw *td_conn_reply(td_conn *c, const char *type, int64_t id)
{
    td_pw_reset(&c->w);
    td_pw_map_open(&c->w);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, id);
    c->replying = 1;
    return &c->w;
}

void td_conn_send(td_conn *c)
{
    /* The reply's map is closed here, so its count is whatever its writer wrote; a map left
     * open inside it fails the frame (td_pw_finish), and c closes rather than send it. */
    if (c->replying)
        td_pw_map_close(&c->w);
    c->replying = 0;
    send_frame(c);
}

void td_conn_error(td_conn *c, int64_t id, int code, const char *msg)
{
    c->replying = 0;
    td_proto_write_error(&c->w, id, code, msg);
    send_frame(c);
}

/* ---- closing ---- */

static void conn_free(td_conn *c)
{
    td_proto_reader_free(c->reader);
    td_pw_free(&c->w);
    free(c);
}

/* The handle is closed: c leaves the list, its producers are dropped (none of them is being
 * pumped: this is a callback of its own), and its memory goes unless a hold keeps it. */
static void on_conn_closed(uv_handle_t *h)
{
    td_conn *c = (td_conn *)h;
    td_conns *cs = c->cs;

    for (td_conn **p = &cs->list; *p != NULL; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    cs->n--;
    while (c->producers != NULL) {
        td_producer *p = c->producers;
        c->producers = p->next;
        p->next = NULL;
        p->ops->drop(p); /* may let go of a hold: c->closed is not yet set, so c stays */
    }
    c->closed = 1;
    if (c->holds == 0)
        conn_free(c);
}

void td_conn_close(td_conn *c)
{
    uv_os_fd_t fd;

    if (c->closing)
        return;
    c->closing = 1;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0)
        td_tsan_fd_closing(fd);
    uv_close((uv_handle_t *)&c->pipe, on_conn_closed);
}

/* ---- input ---- */

static char readbuf[64 << 10]; /* loop thread only */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    *buf = uv_buf_init(readbuf, sizeof(readbuf));
}

/* A printable sample of bad bytes for the log. */
static void sample_bytes(char *out, size_t size, const char *p, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < n && i < 16 && o + 4 < size; i++)
        o += (size_t)snprintf(out + o, size - o, "%02x", (unsigned char)p[i]);
    out[o] = '\0';
}

/* Hands the frames the reader holds to on_frame, in order, until the connection closes, a
 * request holds it, or its unsent replies pass the high-water mark (the rest wait in the
 * reader, and reading stops until they drain). bytes (n) are the last read, for the log. */
static void serve_frames(td_conn *c, const char *bytes, size_t n)
{
    td_proto_frame *f;
    td_error_t err;
    int rc = 0;

    while (!c->closing && c->holds == 0 && !c->paused &&
           (rc = td_proto_reader_next(c->reader, &f, &err)) == 1) {
        c->since_ms = uv_now(c->cs->loop);
        c->cs->on_frame(c->cs->ud, c, f);
        td_proto_frame_free(f);
        if (c->pending >= TD_CONN_HIGH_WATER)
            c->paused = 1;
    }
    if (!c->closing && rc < 0) {
        char sample[40];
        sample_bytes(sample, sizeof(sample), bytes, n);
        td_log_warn("client pid %lld uid %lld: bad frame (%s), closing; bytes %s...",
                    (long long)c->pid, (long long)c->uid, err.msg, sample);
        td_conn_error(c, -1, rc, err.msg);
        td_conn_close(c);
    }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    td_conn *c = (td_conn *)s;

    if (nread < 0) {
        if (nread != UV_EOF)
            td_log_info("client pid %lld: read: %s", (long long)c->pid, uv_strerror((int)nread));
        td_conn_close(c);
        return;
    }
    if (td_proto_reader_feed(c->reader, buf->base, (size_t)nread) != 0) {
        td_conn_close(c);
        return;
    }
    serve_frames(c, buf->base, (size_t)nread);
    want_read(c);
}

/* Reads from c while it may: not while its unsent replies are over the high-water mark
 * (paused: a client that sends requests and never reads the replies gets no more of them),
 * nor once it is closing. While it is held (replies keep the order of requests) it goes on
 * reading, so that a client that hangs up is seen at once and its work stopped, but only
 * until TD_CONN_HELD_READ_MAX bytes of its next requests wait in the reader (served once the
 * hold is let go); the rest waits in the socket. */
static void want_read(td_conn *c)
{
    int want = !c->paused &&
               (c->holds == 0 || td_proto_reader_buffered(c->reader) < TD_CONN_HELD_READ_MAX),
        rc;

    if (c->closing || want == c->reading) /* a closing handle has stopped reading already */
        return;
    if (!want) {
        uv_read_stop((uv_stream_t *)&c->pipe);
        c->reading = 0;
        return;
    }
    rc = uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read);
    if (rc != 0) {
        td_log_warn("client pid %lld: cannot read: %s", (long long)c->pid, uv_strerror(rc));
        td_conn_close(c);
        return;
    }
    c->reading = 1;
}

/* ---- holds and producers ---- */

void td_conn_hold(td_conn *c)
{
    c->holds++;
    want_read(c);
}

void td_conn_release(td_conn *c)
{
    c->holds--;
    if (c->closing) {
        if (c->closed && c->holds == 0)
            conn_free(c);
        return;
    }
    if (c->holds > 0)
        return;
    /* Answered: c reads requests again, first those that arrived meanwhile and wait in its
     * reader. */
    serve_frames(c, "", 0);
    want_read(c);
}

int td_conn_held(const td_conn *c)
{
    return c->holds > 0;
}

void td_conn_attach(td_conn *c, td_producer *p, const td_producer_ops *ops)
{
    p->ops = ops;
    p->c = c;
    p->next = c->producers;
    c->producers = p;
}

void td_conn_detach(td_producer *p)
{
    for (td_producer **q = &p->c->producers; *q != NULL; q = &(*q)->next)
        if (*q == p) {
            *q = p->next;
            break;
        }
    p->next = NULL;
}

int td_conn_producers(const td_conn *c, const td_producer_ops *ops)
{
    int n = 0;

    for (const td_producer *p = c->producers; p != NULL; p = p->next)
        n += p->ops == ops;
    return n;
}

/* ---- what a request may ask of its connection ---- */

int64_t td_conn_uid(const td_conn *c)
{
    return c->uid;
}

int64_t td_conn_gid(const td_conn *c)
{
    return c->gid;
}

int64_t td_conn_pid(const td_conn *c)
{
    return c->pid;
}

size_t td_conn_pending(const td_conn *c)
{
    return c->pending;
}

int td_conn_closing(const td_conn *c)
{
    return c->closing;
}

int td_conn_has_room(const td_conn *c)
{
    return !c->closing && c->pending < TD_CONN_HIGH_WATER;
}

int td_conn_said_hello(const td_conn *c)
{
    return c->hello;
}

void td_conn_hello_done(td_conn *c)
{
    c->hello = 1;
}

int td_conns_count(const td_conns *cs)
{
    return cs->n;
}

td_conn *td_conns_first(td_conns *cs)
{
    return cs->list;
}

td_conn *td_conn_next(td_conn *c)
{
    return c->next;
}

/* ---- accepting ---- */

static void peer_creds(td_conn *c)
{
    struct ucred cred;
    socklen_t len = sizeof(cred);
    uv_os_fd_t fd;

    c->uid = -1;
    c->gid = -1;
    c->pid = -1;
    if (uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0 &&
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->pid = cred.pid;
    }
}

/* Why a new connection c may not stay, into msg; 0 when it may. Root always gets in, so that
 * an administrator can look at a daemon other users have filled; anyone else is held to
 * max_connections in all and max_connections_per_user of their own. */
static int refuse_why(const td_conns *cs, const td_conn *c, char *msg, size_t size)
{
    int mine = 0;

    if (c->uid == 0)
        return 0;
    if (cs->n > cs->lim.max_conns) {
        snprintf(msg, size, "too many connections: %d open, the limit (max_connections)",
                 cs->n - 1);
        return 1;
    }
    if (cs->lim.max_conns_per_user <= 0)
        return 0;
    for (const td_conn *o = cs->list; o != NULL; o = o->next)
        mine += !o->closing && o->uid == c->uid;
    if (mine > cs->lim.max_conns_per_user) {
        snprintf(msg, size,
                 "too many connections: uid %lld has %d open, the limit "
                 "(max_connections_per_user)",
                 (long long)c->uid, mine - 1);
        return 1;
    }
    return 0;
}

void td_conns_accept(td_conns *cs, uv_stream_t *listener)
{
    char why[160];
    td_conn *c = calloc(1, sizeof(*c));

    if (c == NULL || uv_pipe_init(cs->loop, &c->pipe, 0) != 0) {
        free(c);
        return;
    }
    c->cs = cs;
    c->accepted_ms = c->since_ms = uv_now(cs->loop);
    td_pw_init(&c->w);
    c->next = cs->list;
    cs->list = c;
    cs->n++;
    if (uv_accept(listener, (uv_stream_t *)&c->pipe) != 0 ||
        td_proto_reader_new(&c->reader, 0) != 0) {
        td_conn_close(c);
        return;
    }
    /* Until it has said hello, a peer gets a hello's worth of buffer, not a whole frame's. */
    td_proto_reader_limit_first(c->reader, TD_PROTO_MAX_HELLO);
    peer_creds(c);
    if (refuse_why(cs, c, why, sizeof(why))) {
        td_log_warn("client pid %lld uid %lld: refused, %s", (long long)c->pid, (long long)c->uid,
                    why);
        td_conn_error(c, -1, TD_E2BIG, why);
        td_conn_close(c);
        return;
    }
    want_read(c);
}

/* ---- timeouts ---- */

/* Closes the connections that have not said hello in time, and those idle for too long: no
 * request read and no reply written for idle_timeout_s, and nothing attached or held (a
 * watcher of a queued job may wait for hours). Work per tick is one look at each connection:
 * at most max_connections (plus root's). */
static void on_sweep(uv_timer_t *t)
{
    td_conns *cs = t->data;
    uint64_t now = uv_now(cs->loop);
    uint64_t hello_ms = (uint64_t)(cs->lim.hello_timeout_s * 1000);
    uint64_t idle_ms = (uint64_t)(cs->lim.idle_timeout_s * 1000);
    char msg[128];

    for (td_conn *c = cs->list; c != NULL; c = c->next) {
        uint64_t quiet = now - c->since_ms;
        if (c->closing)
            continue;
        if (!c->hello && hello_ms > 0 && now - c->accepted_ms >= hello_ms) {
            snprintf(msg, sizeof(msg), "no hello within %g s of connecting; closing",
                     cs->lim.hello_timeout_s);
        } else if (c->hello && idle_ms > 0 && quiet >= idle_ms && c->producers == NULL &&
                   c->holds == 0) {
            snprintf(msg, sizeof(msg), "idle for %g s; closing", cs->lim.idle_timeout_s);
        } else {
            continue;
        }
        td_log_info("client pid %lld uid %lld: %s", (long long)c->pid, (long long)c->uid, msg);
        td_conn_error(c, -1, TD_ECLOSED, msg);
        td_conn_close(c);
    }
}

/* Starts the sweep at a period that finds a timed-out connection within about a quarter of
 * the shorter timeout. */
static int sweep_start(td_conns *cs, td_error_t *err)
{
    double shortest = cs->lim.hello_timeout_s;
    uint64_t period;
    int rc;

    if (cs->lim.idle_timeout_s > 0 && cs->lim.idle_timeout_s < shortest)
        shortest = cs->lim.idle_timeout_s;
    period = (uint64_t)(shortest * 1000 / 4);
    period = period < TD_SWEEP_MIN_MS   ? TD_SWEEP_MIN_MS
             : period > TD_SWEEP_MAX_MS ? TD_SWEEP_MAX_MS
                                        : period;
    rc = uv_timer_init(cs->loop, &cs->sweep);
    if (rc != 0)
        return td_error_set(err, rc, "uv_timer_init: %s", uv_strerror(rc));
    cs->sweeping = 1;
    cs->sweep.data = cs;
    rc = uv_timer_start(&cs->sweep, on_sweep, period, period);
    if (rc != 0)
        return td_error_set(err, rc, "uv_timer_start: %s", uv_strerror(rc));
    /* The sweep alone must not keep the loop turning once everything else has stopped. */
    uv_unref((uv_handle_t *)&cs->sweep);
    return 0;
}

int td_conns_new(td_conns **out, uv_loop_t *loop, const td_conn_limits *lim,
                 td_conn_frame_cb on_frame, void *ud, td_error_t *err)
{
    td_conns *cs = calloc(1, sizeof(*cs));

    *out = cs;
    if (cs == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    cs->loop = loop;
    cs->lim = *lim;
    cs->on_frame = on_frame;
    cs->ud = ud;
    return sweep_start(cs, err);
}

void td_conns_close(td_conns *cs)
{
    if (cs == NULL)
        return;
    for (td_conn *c = cs->list; c != NULL; c = c->next)
        td_conn_close(c);
    if (cs->sweeping) {
        uv_close((uv_handle_t *)&cs->sweep, NULL);
        cs->sweeping = 0;
    }
}

void td_conns_free(td_conns *cs)
{
    free(cs);
}
