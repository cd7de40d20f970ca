/* The server's metric streams (server_int.h): watch and metrics. A stream is a producer on its
 * connection (connection.h) and never holds rows beyond one page: it reads a page from the
 * store while its connection's output is below TD_CONN_HIGH_WATER, and otherwise waits for the
 * connection to pump it once the client has drained it, so a stalled client costs at most the
 * high-water mark and catches up from the store when it reads again. While a job runs, a watch
 * delivers only rows of steps before the newest durable step, so a step whose rows span two store
 * batches is never split across the cursor (rows come in (step, key) order). A stream names at most
 * TD_PROTO_MAX_KEYS keys, held with it in one allocation, and asks the store only for those the job
 * has rows of. Loop thread only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/server/server_int.h"
#include "common/td_log.h"
#include "common/td_text.h"

struct td_stream {
    td_producer p; /* first: the connection pumps and drops it */
    td_server *s;
    td_conn *c;
    int64_t req_id, job;
    int watch;
    td_metric_cursor cur;
    /* The names the request asked for (nkeys 0: every key), and those of them the job has
     * rows of (known), which is what a page asks the store for: a name the job has never
     * written costs no query. keys, known, is_known and the names' text are one allocation. */
    char **keys;
    size_t nkeys;
    const char **known;
    size_t nknown;
    unsigned char *is_known;
    uint64_t known_gen; /* s->gen when known was last brought up to date... */
    size_t known_n;     /* ...and how many names the job had then */
    int known_valid;
    td_stream *next; /* s->streams */
};

static void stream_pump(td_producer *p);
static void stream_drop(td_producer *p);

static const td_producer_ops stream_ops = {.pump = stream_pump, .drop = stream_drop};

typedef struct page_row {
    char key[TD_STORE_MAX_KEY];
    int key_id;
    int64_t step;
    double value, time;
} page_row;

typedef struct page_ctx {
    page_row rows[TD_STREAM_PAGE];
    size_t n;
    int64_t bound; /* rows at or past this step wait */
    int held;      /* a row was held back by bound */
} page_ctx;

static page_ctx page; /* loop thread only */

static int collect_row(void *ud, const td_metric_row *row)
{
    page_ctx *p = ud;
    page_row *r;

    if (row->step >= p->bound) {
        p->held = 1;
        return 1;
    }
    r = &p->rows[p->n++];
    snprintf(r->key, sizeof(r->key), "%s", row->key);
    r->key_id = row->key_id;
    r->step = row->step;
    r->value = row->value;
    r->time = row->time;
    return 0;
}

/* Unlinks a stream from the server's list and frees it, sending nothing; the caller has
 * detached it from its connection, or the connection dropped it. */
static void stream_free(td_stream *st)
{
    for (td_stream **p = &st->s->streams; *p != NULL; p = &(*p)->next)
        if (*p == st) {
            *p = st->next;
            break;
        }
    free(st); /* its keys are in the same allocation */
}

/* Ends a stream its connection still holds: detached, then freed. */
static void stream_close(td_stream *st)
{
    td_conn_detach(&st->p);
    stream_free(st);
}

/* The connection went: the stream goes with it. */
static void stream_drop(td_producer *p)
{
    stream_free((td_stream *)p);
}

int td__streams_of(const td_conn *c)
{
    return td_conn_producers(c, &stream_ops);
}

/* ---- the metric names a job has ---- */

static int by_name(const void *a, const void *b)
{
    return strcmp(a, b);
}

static int collect_name(void *ud, const td_metric_summary *row)
{
    key_set *k = ud;

    if (k->n == k->cap) {
        size_t cap = k->cap ? k->cap * 2 : 16;
        void *p = realloc(k->names, cap * sizeof(*k->names));
        if (p == NULL)
            return 1;
        k->names = p;
        k->cap = cap;
    }
    snprintf(k->names[k->n++], TD_STORE_MAX_KEY, "%s", row->key);
    return 0;
}

/* The metric names job has rows of, sorted; read again only when some job changed since
 * (s->gen), or when fresh is set. NULL when they cannot be read: every name then counts as
 * unknown for now. */
static const key_set *job_keys(td_server *s, int64_t job, int fresh)
{
    key_set *k = &s->keys;
    td_error_t err;

    if (!fresh && k->job == job && k->gen == s->gen)
        return k;
    k->job = 0;
    k->n = 0;
    if (td_store_metrics_summary(s->store, job, collect_name, k, &err) != 0) {
        td_log_warn("job %lld: cannot read its metric names: %s", (long long)job, err.msg);
        return NULL;
    }
    if (k->n > 1)
        qsort(k->names, k->n, sizeof(*k->names), by_name);
    k->job = job;
    k->gen = s->gen;
    return k;
}

/* Brings st->known up to date with the names its job has rows of: at most once per change
 * of a job, so that names the job never wrote cost a watcher nothing per batch of rows. A
 * watch reads only what the daemon has been told is durable, and that news is a change of
 * the job; a metrics stream of a running job reads whatever the store holds, so it looks
 * again before each page (fresh) while some of its names are still unknown. */
static void stream_known(td_stream *st, int fresh)
{
    td_server *s = st->s;
    const key_set *k;

    if (st->nkeys == 0 || st->nknown == st->nkeys ||
        (!fresh && st->known_valid && st->known_gen == s->gen))
        return;
    if ((k = job_keys(s, st->job, fresh)) == NULL || k->n == 0)
        return; /* nothing known yet (and bsearch may not be given a NULL array) */
    /* A job's names are only ever added to: the same count is the same set. */
    if (st->known_valid && st->known_n == k->n) {
        st->known_gen = s->gen;
        return;
    }
    for (size_t i = 0; i < st->nkeys; i++)
        if (!st->is_known[i] &&
            bsearch(st->keys[i], k->names, k->n, sizeof(*k->names), by_name) != NULL) {
            st->is_known[i] = 1;
            st->known[st->nknown++] = st->keys[i];
        }
    st->known_gen = s->gen;
    st->known_n = k->n;
    st->known_valid = 1;
}

/* The end frame of a metrics stream that named keys the job has no rows of: which ones, and
 * which names the job has (the first TD_PROTO_MAX_KEYS), so a client can say both. */
static void write_missing(td_stream *st, td_pw *w)
{
    const key_set *k = job_keys(st->s, st->job, 0);
    size_t navail = k == NULL ? 0 : k->n < TD_PROTO_MAX_KEYS ? k->n : TD_PROTO_MAX_KEYS;

    td_pw_str(w, "missing");
    td_pw_array(w, (uint32_t)(st->nkeys - st->nknown));
    for (size_t i = 0; i < st->nkeys; i++)
        if (!st->is_known[i])
            td_pw_str(w, st->keys[i]);
    td_pw_str(w, "available");
    td_pw_array(w, (uint32_t)navail);
    for (size_t i = 0; i < navail; i++)
        td_pw_str(w, k->names[i]);
}

/* Ends a stream: metrics streams with a bare end frame (naming the keys asked for that the
 * job has no rows of, when there are any), watches with the job's final map. */
static void stream_end(td_stream *st)
{
    td_conn *c = st->c;
    td_server *s = st->s;
    td_job_row row = {0};
    td_error_t err;
    int with_job = st->watch && td_store_job_get(s->store, st->job, &row, &err) == 0;
    td_pw *w;

    if (!st->watch)
        stream_known(st, 0);
    w = td_conn_reply(c, "end", st->req_id);
    td_pw_str(w, "job_id");
    td_pw_int(w, st->job);
    if (with_job) {
        td_pw_str(w, "job");
        td__write_job(s, w, &row, 0);
    }
    if (!st->watch && st->nknown < st->nkeys)
        write_missing(st, w);
    td_job_row_clear(&row);
    td_conn_send(c);
    stream_close(st);
}

/* Sends pages of stored rows while the client keeps up; ends the stream when it is done. */
static void stream_pump(td_producer *p)
{
    td_stream *st = (td_stream *)p;
    td_conn *c = st->c;
    td_server *s = st->s;
    td_job_live live;
    int ended = !td_daemon_job_live(s->d, st->job, &live);

    while (td_conn_has_room(c)) {
        td_metric_cursor before = st->cur;
        td_error_t err;
        size_t ndone = 0;

        page.n = 0;
        page.held = 0;
        page.bound = st->watch && !ended ? live.durable_step : INT64_MAX;
        stream_known(st, !st->watch && !ended);
        if (st->nkeys > 0 && st->nknown == 0) {
            /* None of the names has a row yet: nothing to ask the store. */
        } else if (td_store_metrics_page(s->store, st->job, &st->cur, st->known, st->nknown,
                                         TD_STREAM_PAGE, collect_row, &page, &ndone, &err) != 0) {
            td_conn_error(c, st->req_id, err.code, err.msg);
            stream_close(st);
            return;
        }
        if (page.held) {
            /* The held row was counted as delivered: rewind to the last row kept. */
            st->cur = before;
            if (page.n > 0) {
                st->cur.step = page.rows[page.n - 1].step;
                st->cur.key_id = page.rows[page.n - 1].key_id;
            }
        }
        if (page.n > 0) {
            td_pw *w = td_conn_reply(c, "rows", st->req_id);
            td_pw_str(w, "job_id");
            td_pw_int(w, st->job);
            td_pw_str(w, "rows");
            td_pw_array(w, (uint32_t)page.n);
            for (size_t i = 0; i < page.n; i++) {
                td_pw_array(w, 4);
                td_pw_str(w, page.rows[i].key);
                td_pw_int(w, page.rows[i].step);
                td_pw_double(w, page.rows[i].value);
                td_pw_double(w, page.rows[i].time);
            }
            td_conn_send(c);
        }
        if (page.n == TD_STREAM_PAGE)
            continue;
        /* Caught up with what the store holds. */
        if (!st->watch || ended)
            stream_end(st);
        return;
    }
}

static void send_state(td_stream *st, const td_job_live *job)
{
    td_pw *w = td_conn_reply(st->c, "state", st->req_id);

    td_pw_str(w, "job_id");
    td_pw_int(w, st->job);
    td_pw_str(w, "state");
    td_pw_str(w, job->state);
    td_pw_str(w, "step");
    td_pw_int(w, job->step);
    td_pw_str(w, "total_steps");
    td_pw_int(w, job->total_steps);
    td_conn_send(st->c);
}

void td_server_job_changed(td_server *s, int64_t job, const char *state)
{
    td_job_live live;
    int held = td_daemon_job_live(s->d, job, &live);

    td_stream *st = s->streams;

    s->gen++; /* the job may have rows of metric names it had none of */

    /* A stream that ends here is freed, so the next is taken first; one whose connection
     * closes here stays (unpumped: no room) until the connection's close callback drops it. */
    while (st != NULL) {
        td_stream *next = st->next;
        if (st->job == job && !td_conn_closing(st->c)) {
            if (st->watch && state != NULL && held)
                send_state(st, &live);
            stream_pump(&st->p);
        }
        st = next;
    }
}

/* ---- the requests ---- */

/* The stream for a request naming keys (an array of metric names, or NULL for every key):
 * the names checked (each 1 to 63 bytes of text, at most TD_PROTO_MAX_KEYS, repeats dropped) and
 * copied with the stream into one allocation. NULL after an error frame. */
static td_stream *stream_new(td_conn *c, int64_t id, const td_pval *keys)
{
    size_t n = td_pv_len(keys), text = 0, len, k = 0;
    char msg[128];
    td_stream *st;
    char *p;

    if (keys != NULL && td_pv_type_of(keys) != TD_PV_ARRAY) {
        td_conn_error(c, id, TD_EPROTO, "keys: must be a list of metric names");
        return NULL;
    }
    if (n > TD_PROTO_MAX_KEYS) {
        snprintf(msg, sizeof(msg), "keys: %zu names; a request may name at most %d", n,
                 TD_PROTO_MAX_KEYS);
        td_conn_error(c, id, TD_E2BIG, msg);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        const char *s = td_pv_str(td_pv_at(keys, i), &len);
        if (s == NULL || len == 0 || len >= TD_STORE_MAX_KEY || td_text_check(s, len, NULL) != 0) {
            td_conn_error(c, id, TD_EPROTO,
                          "keys: each must be a metric name of 1 to 63 bytes of text");
            return NULL;
        }
        text += len + 1;
    }
    st = calloc(1, sizeof(*st) + n * (2 * sizeof(char *) + 1) + text);
    if (st == NULL) {
        td_conn_error(c, id, TD_ENOMEM, "out of memory");
        return NULL;
    }
    st->keys = (char **)(st + 1);
    st->known = (const char **)(st->keys + n);
    st->is_known = (unsigned char *)(st->known + n);
    p = (char *)(st->is_known + n);
    for (size_t i = 0; i < n; i++) {
        const char *s = td_pv_str(td_pv_at(keys, i), &len);
        int seen = 0;
        for (size_t j = 0; j < k && !seen; j++)
            seen = strlen(st->keys[j]) == len && memcmp(st->keys[j], s, len) == 0;
        if (seen)
            continue;
        memcpy(p, s, len);
        p[len] = '\0';
        st->keys[k++] = p;
        p += len + 1;
    }
    st->nkeys = k;
    return st;
}

/* metrics and watch: both start a stream; watch follows the job until it ends. */
static void req_stream(td_server *s, td_conn *c, const td_pval *root, int64_t id, int watch)
{
    td_job_live live;
    td_stream *st;
    td_job_row row = {0};
    int64_t job, since = 0;
    char msg[160];

    if (td__get_job_id(c, root, id, &job) != 0)
        return;
    if (td_pv_get(root, "since") != NULL &&
        (td_pv_int(td_pv_get(root, "since"), &since) != 0 || since < 0)) {
        td_conn_error(c, id, TD_EPROTO, "since: must be an integer >= 0");
        return;
    }
    if (td__streams_of(c) >= s->cfg.max_streams_per_conn) {
        snprintf(msg, sizeof(msg),
                 "this connection has %d streams open, the limit (max_streams_per_connection); "
                 "end one, or open another connection",
                 td__streams_of(c));
        td_conn_error(c, id, TD_E2BIG, msg);
        return;
    }
    if (td__get_job_row(s, c, id, job, &row) != 0)
        return;
    td_job_row_clear(&row);
    if ((st = stream_new(c, id, td_pv_get(root, "keys"))) == NULL)
        return;
    st->s = s;
    st->req_id = id;
    st->job = job;
    st->watch = watch;
    td_metric_cursor_init(&st->cur, since);
    st->next = s->streams;
    s->streams = st;
    td_conn_attach(c, &st->p, &stream_ops);
    st->c = c;
    if (watch && td_daemon_job_live(s->d, job, &live))
        send_state(st, &live);
    stream_pump(&st->p);
}

void td__req_metrics(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    req_stream(s, c, root, id, 0);
}

void td__req_watch(td_server *s, td_conn *c, const td_pval *root, int64_t id)
{
    req_stream(s, c, root, id, 1);
}
