/* The server's insides (server.h), shared by its files: server.c (connections, their output
 * and reading, requests, hello, submit, cancel, info, export and sample, the timeouts, the
 * socket), stream.c (the metric streams: watch and metrics), listing.c (job maps, status, the
 * pages of list and logs) and history.c (rm and prune). Loop thread only; nothing outside the
 * server includes it. td__ functions are the server's own, not an interface. */
#ifndef TD_SERVER_INT_H
#define TD_SERVER_INT_H

#include "server.h"
#include "work.h"

#define TD_REPLY_BUDGET                                                                 \
    (768u << 10)              /* bytes of jobs or lines one list or logs reply carries, \
                               * well inside TD_PROTO_MAX_FRAME with the frame's own */
#define TD_LOG_LINE_WIRE 8192 /* bytes of one log line's message a logs reply carries */
#define TD_INFO_CLIENTS  256  /* connections an info reply lists */
#define TD_INFO_QUEUED   1000 /* queued job ids an info reply lists */
#define TD_SWEEP_MAX_MS  1000 /* the sweep timer's period, at most... */
#define TD_SWEEP_MIN_MS  20   /* ...and at least */
#define TD_SHOWN_TYPE    64   /* bytes of an unknown request type quoted back... */
#define TD_SHOWN_MAX     (4 * TD_SHOWN_TYPE + 1) /* ...which escaping may make 4 times longer */

typedef struct td_conn td_conn;

/* The metric names one job has rows of, sorted, read from the store's summary at most once
 * per gen (below) and shared by every stream of that job that names keys. */
typedef struct key_set {
    int64_t job; /* 0: nothing cached */
    uint64_t gen;
    char (*names)[TD_STORE_MAX_KEY];
    size_t n, cap;
} key_set;

struct td_server {
    uv_pipe_t listener; /* first: the handle's data is the server */
    uv_timer_t sweep;   /* closes connections past the hello or idle timeout */
    uv_loop_t *loop;
    td_config cfg; /* socket_path is the one clients use (systemd's, when it passed one) */
    td_daemon *d;
    td_store *store; /* the daemon's: the loop thread's connection */
    td_conn *conns;
    int nconns;
    int listening; /* listener is initialised and not yet closed */
    int inherited; /* listener came from systemd (LISTEN_FDS): its path is not ours */
    int sweeping;  /* sweep is initialised and not yet closed */
    uint64_t gen;  /* counts td_server_job_changed calls: a job's metric names may have grown */
    key_set keys;  /* the job's metric names, as of gen */
    td_pw scratch; /* a list or logs page before it is known how much of it fits */
};

typedef struct td_stream {
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
    struct td_stream *next;
} td_stream;

struct td_conn {
    uv_pipe_t pipe; /* first: the handle's memory is the connection's */
    td_server *s;
    td_proto_reader *reader;
    td_pw w;
    size_t pending; /* bytes handed to uv_write and not yet written */
    int hello;
    int closing;
    int64_t uid, gid, pid;
    td_stream *streams;
    int nstreams;
    td_conn *next;
    int refs;      /* threadpool work holding the connection: its memory outlives the close */
    int closed;    /* the handle's close callback has run; the memory waits for refs == 0 */
    int busy;      /* an export or sample is under way: later requests wait their turn */
    int paused;    /* unsent replies passed TD_CONN_HIGH_WATER: no request is read until
                    * they drain below TD_CONN_LOW_WATER */
    int reading;   /* uv_read_start is in effect */
    int exporting; /* an export is under way (worked on, or its chunks being sent) */
    uint64_t accepted_ms; /* uv_now at accept: the hello timeout counts from there */
    uint64_t since_ms;    /* uv_now at accept, then at the last request or write done */
    td_work *xfer;        /* the export being sent, or NULL */
    int64_t xfer_sent;    /* bytes of xfer sent so far */
};

/* ---- server.c ---- */

/* Sends the frame built in c->w (closing c when it cannot be built or written). */
void td__conn_send(td_conn *c);

/* Starts a reply frame in c->w: {type, id} and room for extra more pairs. */
void td__reply_begin(td_conn *c, const char *type, int64_t id, uint32_t extra);

/* Sends an error frame answering request id. */
void td__send_error(td_conn *c, int64_t id, int code, const char *msg);

/* The request's job_id into *job, or -1 after an error frame. */
int td__get_job_id(td_conn *c, const td_pval *root, int64_t id, int64_t *job);

/* Reads job's row into *row (caller clears it), or -1 after an error frame ("no job 12"). */
int td__get_job_row(td_conn *c, int64_t id, int64_t job, td_job_row *row);

/* Holds c for a reply that comes later (an rm or a prune waiting for its deletion): c reads
 * no further request until td__conn_release, and its memory outlives a close until then. */
void td__conn_hold(td_conn *c);

/* Lets go of td__conn_hold's hold, after the reply has been sent: c reads requests again, or,
 * when it is closing, may be freed here (do not touch it after). */
void td__conn_release(td_conn *c);

/* An optional integer field from lo to hi: 0 with *out set (left alone when absent), or -1
 * after an error frame "name: must be an integer from lo to hi". */
int td__opt_int(td_conn *c, const td_pval *root, int64_t id, const char *name, int64_t lo,
                int64_t hi, int64_t *out);

/* ---- listing.c ---- */

/* Writes s (len bytes) as a str with anything that is not printable UTF-8 escaped
 * (td_text_escape), newlines kept when keep_nl; cut at out_max bytes. For what clients wrote
 * and traind stored: rows stored before submit checked their strings may hold anything. */
void td__write_text(td_pw *w, const char *s, size_t len, int keep_nl, size_t out_max);

/* Writes the JOB map of PROTOCOL.md for row into w, with live figures for a job the daemon
 * holds, and the spec when with_spec is set. */
void td__write_job(td_server *s, td_pw *w, td_job_row *row, int with_spec);

void td__req_status(td_conn *c, const td_pval *root, int64_t id);
void td__req_list(td_conn *c, const td_pval *root, int64_t id);
void td__req_logs(td_conn *c, const td_pval *root, int64_t id);

/* ---- history.c ---- */

/* rm and prune (PROTOCOL.md): the jobs marked at once, the reply once they are deleted. */
void td__req_rm(td_conn *c, const td_pval *root, int64_t id);
void td__req_prune(td_conn *c, const td_pval *root, int64_t id);

/* ---- stream.c ---- */

/* Sends a stream's pages while its connection keeps up; ends it when it is done. */
void td__stream_pump(td_stream *st);

/* Unlinks a stream from its connection and frees it, sending nothing. */
void td__stream_free(td_stream *st);

/* metrics (watch 0) and watch (watch 1): opens a stream and sends what is there. */
void td__req_stream(td_conn *c, const td_pval *root, int64_t id, int watch);

#endif
