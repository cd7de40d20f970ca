/* The dashboard's live streams: GET api/stream?jobs=1,2 answers with server-sent events that
 * follow the jobs, fed by one connection to traind carrying one `watch` per job: the same
 * replay-then-follow stream as `trainctl watch`, so a page opened late gets every stored row
 * once and then each new one, and traind's permission checks and limits apply unchanged.
 *
 * Thinning. A page never receives a whole series. Each (job, metric) keeps at most
 * TC_DASH_BUCKETS buckets of consecutive steps, all of one width, a power of two: a row goes
 * into the last bucket or opens the next one, and when a new one would pass the limit every
 * pair of neighbours merges and the width doubles. A bucket keeps its rows' count, mean, min
 * and max, and the step and time of its last row, so the chart draws the mean as the line and
 * min..max as a band: one point per bucket, about one per pixel column of a wide chart, and no
 * spike lost. A job of 1,000,000 rows costs the stream its buckets (TC_DASH_BUCKETS * 56
 * bytes per metric) whatever its length, and reaches the page as at most TC_DASH_BUCKETS
 * points per metric.
 *
 * Sending. Rows are folded into the buckets as they come; what changed is sent as events at
 * most every TC_DASH_FLUSH_MS while rows keep coming (a replay), and as soon as traind has
 * been quiet for TC_DASH_QUIET_MS (a live row, after its batch): `series` (every bucket of a
 * metric, after a merge or the first time), `points` (the buckets from one on, which replace the
 * page's from that step), `state`, `joberror` (traind refused the watch, or the connection broke),
 * `end` (the job's final map) and `done` when every job has ended.
 *
 * Bounds. The stream reads from traind only when the page has taken everything sent before,
 * so a slow browser holds at most one round of events here (at most TC_DASH_MAX_KEYS *
 * TC_DASH_BUCKETS points per job) and its rows wait in traind, which bounds each connection's
 * unsent bytes and catches a slow reader up from its store: a slow page slows nobody else.
 *
 * Threads: libmicrohttpd calls the content reader from the HTTP connection's own thread
 * (thread per connection), where it may block: it polls traind's socket, the browser's (for
 * a hang-up) and the server's stop pipe. Everything here belongs to that one thread. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"
#include "client/dashboard/dashboard.h"
#include "common/td_clock.h"

#define SSE_BLOCK   (32 * 1024) /* bytes libmicrohttpd asks the reader for at a time */
#define NO_DIRTY    SIZE_MAX    /* a series with nothing to send */
#define ERR_ESCAPED (4 * TC_DASH_ERR_MAX)
#define STATE_MAX   16   /* bytes of a state name, NUL included */
#define KEY_MAX     64   /* bytes of a metric name, NUL included (PROTOCOL.md: 1 to 63) */
#define RETRY_MS    5000 /* how long a browser waits before it reconnects a broken stream */

/* Consecutive steps of one metric, [start, start + width). */
typedef struct bucket {
    int64_t start;   /* the first step it covers, a multiple of its series' width */
    int64_t step;    /* its last row's step */
    double time;     /* its last row's time, unix seconds */
    double sum;      /* of its finite values */
    double min, max; /* of its finite values */
    int64_t n;       /* finite values */
} bucket;

/* One metric of one job. */
typedef struct series {
    char key[KEY_MAX];
    int64_t width; /* steps per bucket, a power of two */
    int64_t rows;  /* rows folded in, finite or not */
    bucket *b;
    size_t nb, cap; /* buckets used and allocated; cap <= TC_DASH_BUCKETS */
    size_t dirty;   /* the first bucket changed since the last send, or NO_DIRTY */
    int full;       /* merged (or new) since the last send: send every bucket */
} series;

/* One job the stream follows: its watch and what is still to send of it. */
typedef struct feed {
    int64_t job, req; /* the job id, and the id of its watch request */
    series *s;
    size_t ns, scap;
    size_t hint;           /* where the next row's metric likely is (rows cycle through them) */
    int64_t dropped;       /* rows of metrics past TC_DASH_MAX_KEYS, not drawn */
    int state_dirty;       /* a state frame came since the last send */
    char state[STATE_MAX]; /* ... its state, step and total */
    int64_t step, total;
    tc_buf end;             /* the end frame's job as JSON, to send after the last rows */
    int has_end, has_error; /* an end or an error frame came: the job's stream is over */
    char error[TC_DASH_ERR_MAX];
    int done; /* its end or error has been sent */
} feed;

typedef struct stream {
    tc_dash *d;
    tc_dconn *c;
    int client_fd; /* the browser's socket, polled for a hang-up; -1 when unknown */
    feed f[TC_DASH_STREAM_JOBS];
    size_t nf;
    tc_buf out;         /* events not yet handed to libmicrohttpd */
    size_t sent;        /* ... of which this many are */
    double last_flush;  /* monotonic ms of the last send of rows */
    double last_output; /* monotonic ms of the last bytes of any kind */
    int finished;       /* "done" is in out: the stream ends once out is taken */
} stream;

/* ---- folding rows into buckets ---- */

/* floor(a / b) * b for b > 0: the bucket start of step a, negative steps included. */
static int64_t align_down(int64_t a, int64_t b)
{
    int64_t q = a / b;

    if (a % b != 0 && a < 0)
        q--;
    return q * b;
}

static void bucket_merge(bucket *into, const bucket *b)
{
    if (b->step >= into->step) {
        into->step = b->step;
        into->time = b->time;
    }
    if (b->n > 0) {
        into->min = into->n > 0 && into->min < b->min ? into->min : b->min;
        into->max = into->n > 0 && into->max > b->max ? into->max : b->max;
    }
    into->sum += b->sum;
    into->n += b->n;
}

/* Doubles the series' width, merging each pair of neighbouring buckets. */
static void rebin(series *s)
{
    size_t j = 0;

    s->width *= 2;
    for (size_t i = 0; i < s->nb; i++) {
        int64_t start = align_down(s->b[i].start, s->width);
        if (j > 0 && s->b[j - 1].start == start) {
            bucket_merge(&s->b[j - 1], &s->b[i]);
        } else {
            s->b[j] = s->b[i];
            s->b[j].start = start;
            j++;
        }
    }
    s->nb = j;
    s->full = 1;
    s->dirty = NO_DIRTY;
}

static void mark(series *s, size_t i)
{
    if (!s->full && (s->dirty == NO_DIRTY || i < s->dirty))
        s->dirty = i;
}

/* Folds one row into its series. Rows come in step order (PROTOCOL.md, watch); one that does
 * not is folded into the last bucket rather than reordering what was sent. -1: out of
 * memory. */
static int series_add(series *s, int64_t step, double value, double time)
{
    bucket one = {.step = step, .time = time, .n = isfinite(value) ? 1 : 0};
    int64_t start;

    if (one.n > 0) {
        one.sum = value;
        one.min = one.max = value;
    }
    s->rows++;
    for (;;) {
        start = align_down(step, s->width);
        if (s->nb > 0 && start <= s->b[s->nb - 1].start) {
            bucket_merge(&s->b[s->nb - 1], &one);
            mark(s, s->nb - 1);
            return 0;
        }
        if (s->nb < TC_DASH_BUCKETS)
            break;
        rebin(s);
    }
    if (s->nb == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        bucket *b = realloc(s->b, cap * sizeof(*b));
        if (b == NULL)
            return -1;
        s->b = b;
        s->cap = cap;
    }
    one.start = start;
    s->b[s->nb++] = one;
    mark(s, s->nb - 1);
    return 0;
}

/* The series of key in f, made when it is new; NULL past TC_DASH_MAX_KEYS (or out of
 * memory). */
static series *feed_series(feed *f, const char *key, size_t len)
{
    series *s;

    for (size_t k = 0; k < f->ns; k++) {
        size_t i = (f->hint + k) % f->ns;
        if (strncmp(f->s[i].key, key, len) == 0 && f->s[i].key[len] == '\0') {
            f->hint = i + 1;
            return &f->s[i];
        }
    }
    if (f->ns == TC_DASH_MAX_KEYS || len >= KEY_MAX)
        return NULL;
    if (f->ns == f->scap) {
        size_t cap = f->scap ? f->scap * 2 : 8;
        series *p = realloc(f->s, cap * sizeof(*p));
        if (p == NULL)
            return NULL;
        f->s = p;
        f->scap = cap;
    }
    s = &f->s[f->ns++];
    memset(s, 0, sizeof(*s));
    memcpy(s->key, key, len);
    s->key[len] = '\0';
    s->width = 1;
    s->dirty = NO_DIRTY;
    s->full = 1;
    f->hint = f->ns;
    return s;
}

/* ---- frames from traind ---- */

static void on_rows(feed *f, const td_pval *rows)
{
    for (size_t i = 0; i < td_pv_len(rows); i++) {
        const td_pval *r = td_pv_at(rows, i);
        size_t len = 0;
        const char *key = td_pv_str(td_pv_at(r, 0), &len);
        int64_t step;
        double value = NAN, time = 0;
        series *s;

        if (key == NULL || td_pv_int(td_pv_at(r, 1), &step) != 0)
            continue; /* not a row (PROTOCOL.md): nothing to draw */
        if (td_pv_double(td_pv_at(r, 2), &value) != 0)
            value = NAN;
        td_pv_double(td_pv_at(r, 3), &time);
        s = feed_series(f, key, len);
        if (s == NULL || series_add(s, step, value, time) != 0)
            f->dropped++;
    }
}

/* Handles one frame of a watch: rows, state, end, or an error that ends the job's part. */
static void on_frame(stream *st, const td_proto_frame *fr)
{
    const td_pval *root = td_proto_frame_root(fr), *type = td_pv_get(root, "type");
    int64_t id = -1;
    feed *f = NULL;

    td_pv_int(td_pv_get(root, "id"), &id);
    for (size_t i = 0; i < st->nf && f == NULL; i++)
        if (st->f[i].req == id)
            f = &st->f[i];
    if (f == NULL && tc_pv_is(type, "error")) {
        /* id -1: traind is closing the connection (ECLOSED, a limit); every job hears it. */
        for (size_t i = 0; i < st->nf; i++)
            if (!st->f[i].has_end && !st->f[i].has_error) {
                tc__dconn_error(root, st->f[i].error, sizeof(st->f[i].error));
                st->f[i].has_error = 1;
            }
        return;
    }
    if (f == NULL || f->has_end || f->has_error)
        return;
    if (tc_pv_is(type, "rows")) {
        on_rows(f, td_pv_get(root, "rows"));
    } else if (tc_pv_is(type, "state")) {
        td_pv_strcpy(td_pv_get(root, "state"), f->state, sizeof(f->state));
        td_pv_int(td_pv_get(root, "step"), &f->step);
        td_pv_int(td_pv_get(root, "total_steps"), &f->total);
        f->state_dirty = 1;
    } else if (tc_pv_is(type, "end")) {
        f->end.len = 0;
        if (tc__buf_json_val(&f->end, td_pv_get(root, "job")) != 0)
            f->end.len = 0;
        f->has_end = 1;
    } else if (tc_pv_is(type, "error")) {
        tc__dconn_error(root, f->error, sizeof(f->error));
        f->has_error = 1;
    }
}

/* Every job whose stream has not ended hears that the connection to traind is gone. */
static void lost(stream *st, const char *msg)
{
    for (size_t i = 0; i < st->nf; i++)
        if (!st->f[i].has_end && !st->f[i].has_error) {
            snprintf(st->f[i].error, sizeof(st->f[i].error), "%s", msg);
            st->f[i].has_error = 1;
        }
}

/* ---- events ---- */

/* One bucket as [step, time, mean, min, max] (null values for a bucket of no finite one). */
static int point(tc_buf *b, const bucket *k)
{
    if (k->n == 0)
        return tc__buf_printf(b, "[%lld,%.3f,null,null,null]", (long long)k->step, k->time);
    return tc__buf_printf(b, "[%lld,%.3f,%.9g,%.9g,%.9g]", (long long)k->step, k->time,
                          k->sum / (double)k->n, k->min, k->max);
}

/* event: series (every bucket) or points (from bucket `from` on). */
static int series_event(tc_buf *b, const feed *f, const series *s, size_t from)
{
    int rc = tc__buf_printf(b, "event: %s\ndata: {\"job\":%lld,\"key\":",
                            from == 0 && s->full ? "series" : "points", (long long)f->job);

    rc |= tc__buf_json_str(b, s->key, strlen(s->key));
    rc |= tc__buf_printf(b, ",\"width\":%lld,\"rows\":%lld,\"from\":%lld,\"points\":[",
                         (long long)s->width, (long long)s->rows,
                         (long long)(from < s->nb ? s->b[from].start : 0));
    for (size_t i = from; i < s->nb; i++) {
        if (i > from)
            rc |= tc__buf_add(b, ",", 1);
        rc |= point(b, &s->b[i]);
    }
    return rc | tc__buf_add(b, "]}\n\n", 4);
}

static int state_event(tc_buf *b, const feed *f)
{
    int rc = tc__buf_printf(b, "event: state\ndata: {\"job\":%lld,\"state\":", (long long)f->job);

    rc |= tc__buf_json_str(b, f->state, strlen(f->state));
    return rc | tc__buf_printf(b, ",\"step\":%lld,\"total_steps\":%lld,\"dropped\":%lld}\n\n",
                               (long long)f->step, (long long)f->total, (long long)f->dropped);
}

static int end_event(tc_buf *b, const feed *f)
{
    int rc;

    if (f->has_error) {
        rc = tc__buf_printf(b,
                            "event: joberror\ndata: {\"job\":%lld,\"message\":", (long long)f->job);
        rc |= tc__buf_json_str(b, f->error, strlen(f->error));
        return rc | tc__buf_add(b, "}\n\n", 3);
    }
    rc = tc__buf_printf(b, "event: end\ndata: {\"job\":%lld,\"dropped\":%lld,\"final\":",
                        (long long)f->job, (long long)f->dropped);
    if (f->end.len > 0)
        rc |= tc__buf_add(b, f->end.p, f->end.len);
    else
        rc |= tc__buf_add(b, "null", 4);
    return rc | tc__buf_add(b, "}\n\n", 3);
}

/* Whether any job has something to send. */
static int pending(const stream *st)
{
    for (size_t i = 0; i < st->nf; i++) {
        const feed *f = &st->f[i];
        if (f->done)
            continue;
        if (f->state_dirty || f->has_end || f->has_error)
            return 1;
        for (size_t k = 0; k < f->ns; k++)
            if (f->s[k].full || f->s[k].dirty != NO_DIRTY)
                return 1;
    }
    return 0;
}

/* Writes every change as events into st->out: rows before state, state before the end. -1
 * when out of memory. */
static int flush(stream *st)
{
    int rc = 0, all_done = 1;

    for (size_t i = 0; i < st->nf; i++) {
        feed *f = &st->f[i];
        if (f->done)
            continue;
        for (size_t k = 0; k < f->ns; k++) {
            series *s = &f->s[k];
            if (s->full && s->nb > 0)
                rc |= series_event(&st->out, f, s, 0);
            else if (!s->full && s->dirty != NO_DIRTY)
                rc |= series_event(&st->out, f, s, s->dirty);
            if (s->nb > 0)
                s->full = 0;
            s->dirty = NO_DIRTY;
        }
        if (f->state_dirty)
            rc |= state_event(&st->out, f);
        f->state_dirty = 0;
        if (f->has_end || f->has_error) {
            rc |= end_event(&st->out, f);
            f->done = 1;
        }
        all_done &= f->done;
    }
    if (all_done) {
        rc |= tc__buf_add(&st->out, "event: done\ndata: {}\n\n", 22);
        st->finished = 1;
    }
    st->last_flush = st->last_output = td_mono_ms();
    return rc;
}

/* ---- the reader ---- */

/* Fills st->out with the next events, or a keep-alive comment after TC_DASH_KEEPALIVE_MS of
 * silence. Returns 0; 1 when the stream ends as it should, the browser having hung up or the
 * server stopping; -1 when it must stop on an error (poll failed, memory ran out). */
static int pump(stream *st)
{
    char msg[TC_DASH_ERR_MAX];
    td_proto_frame *fr;
    int rc;

    for (;;) {
        while ((rc = tc__dconn_take(st->c, &fr, msg, sizeof(msg))) == 1) {
            on_frame(st, fr);
            td_proto_frame_free(fr);
        }
        if (rc < 0)
            lost(st, msg);
        double now = td_mono_ms();
        int want = pending(st);
        if (want && (rc < 0 || now - st->last_flush >= TC_DASH_FLUSH_MS))
            return flush(st);
        if (!want && now - st->last_output >= TC_DASH_KEEPALIVE_MS) {
            st->last_output = now;
            return tc__buf_add(&st->out, ": keep-alive\n\n", 14);
        }
        /* With changes to send, wait for more only while traind keeps talking. */
        double wait = want ? st->last_flush + TC_DASH_FLUSH_MS - now
                           : st->last_output + TC_DASH_KEEPALIVE_MS - now;
        if (want && wait > TC_DASH_QUIET_MS)
            wait = TC_DASH_QUIET_MS;
        struct pollfd p[3] = {
            {.fd = tc__dconn_fd(st->c), .events = POLLIN},
            {.fd = st->d->stop_fd, .events = POLLIN},
            {.fd = st->client_fd, .events = POLLRDHUP},
        };
        int ready = poll(p, st->client_fd >= 0 ? 3 : 2, wait < 1 ? 1 : (int)wait);
        if (ready < 0 && errno != EINTR)
            return -1;
        if (ready == 0 && want)
            return flush(st); /* traind went quiet: send what came */
        if (ready <= 0)
            continue;
        if (p[1].revents != 0 || (st->client_fd >= 0 && p[2].revents != 0))
            return 1;
        if (p[0].revents != 0 && tc__dconn_read(st->c, msg, sizeof(msg)) != 0) {
            lost(st, msg);
            return flush(st);
        }
    }
}

static ssize_t reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream *st = cls;

    (void)pos;
    for (;;) {
        if (st->sent < st->out.len) {
            size_t n = st->out.len - st->sent < max ? st->out.len - st->sent : max;
            memcpy(buf, st->out.p + st->sent, n);
            st->sent += n;
            return (ssize_t)n;
        }
        st->out.len = st->sent = 0;
        if (st->finished)
            return MHD_CONTENT_READER_END_OF_STREAM;
        /* A browser that left (a closed tab, another page) or a server that stops is no
         * error: libmicrohttpd would log one for END_WITH_ERROR. */
        int rc = pump(st);
        if (rc > 0)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (rc < 0)
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void stream_free(void *cls)
{
    stream *st = cls;

    if (st == NULL)
        return;
    for (size_t i = 0; i < st->nf; i++) {
        for (size_t k = 0; k < st->f[i].ns; k++)
            free(st->f[i].s[k].b);
        free(st->f[i].s);
        tc__buf_free(&st->f[i].end);
    }
    tc__buf_free(&st->out);
    tc__dconn_close(st->c);
    atomic_fetch_sub(&st->d->streams, 1);
    free(st);
}

/* Sends one watch per job and writes the opening events: the reconnect delay and hello. */
static int start(stream *st, const int64_t *jobs, size_t njobs, char *msg, size_t size)
{
    int rc = 0;

    for (size_t i = 0; i < njobs; i++) {
        td_pw *w = tc__dconn_begin(st->c, "watch", 3, &st->f[i].req);
        td_pw_str(w, "job_id");
        td_pw_int(w, jobs[i]);
        st->f[i].job = jobs[i];
        st->nf++;
        if ((rc = tc__dconn_send(st->c, msg, size)) != 0)
            return rc;
    }
    rc = tc__buf_printf(&st->out, "retry: %d\nevent: hello\ndata: {\"buckets\":%d,\"jobs\":[",
                        RETRY_MS, TC_DASH_BUCKETS);
    for (size_t i = 0; i < njobs; i++)
        rc |= tc__buf_printf(&st->out, "%s%lld", i > 0 ? "," : "", (long long)jobs[i]);
    rc |= tc__buf_add(&st->out, "]}\n\n", 4);
    if (rc != 0) {
        snprintf(msg, size, "out of memory");
        return 503;
    }
    st->last_flush = st->last_output = td_mono_ms();
    return 0;
}

enum MHD_Result tc__dash_stream(tc_dash *d, struct MHD_Connection *conn, const int64_t *jobs,
                                size_t njobs)
{
    const union MHD_ConnectionInfo *ci;
    struct MHD_Response *r;
    char msg[TC_DASH_ERR_MAX];
    enum MHD_Result ret;
    stream *st;
    int rc;

    if (atomic_fetch_add(&d->streams, 1) >= TC_DASH_MAX_STREAMS) {
        atomic_fetch_sub(&d->streams, 1);
        snprintf(msg, sizeof(msg),
                 "%d live streams are open, the dashboard's limit; close a page and reload",
                 TC_DASH_MAX_STREAMS);
        return tc__dash_error(conn, 503, msg);
    }
    st = calloc(1, sizeof(*st));
    if (st == NULL) {
        atomic_fetch_sub(&d->streams, 1);
        return tc__dash_error(conn, 503, "out of memory");
    }
    st->d = d;
    ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    st->client_fd = ci != NULL ? ci->connect_fd : -1;
    if ((rc = tc__dconn_open(&st->c, d->socket, msg, sizeof(msg))) != 0 ||
        (rc = start(st, jobs, njobs, msg, sizeof(msg))) != 0) {
        stream_free(st);
        return tc__dash_error(conn, (unsigned)rc, msg);
    }
    r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, SSE_BLOCK, reader, st, stream_free);
    if (r == NULL) {
        stream_free(st);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "text/event-stream; charset=utf-8");
    MHD_add_response_header(r, "Cache-Control", "no-store");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}
