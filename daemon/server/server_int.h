/* The server's requests (server.h), shared by its files: server.c (the socket, the table of
 * requests and the dispatch from it) and one file per family of requests: req_jobs.c (hello,
 * submit, cancel, info), req_listing.c (job maps, status, the pages of list and logs),
 * req_streams.c (the metric streams: watch and metrics), req_history.c (rm and prune) and
 * req_work.c (export, sample, classify, retrieve and probe on the threadpool). They sit on the
 * connection layer (connection.h), which knows none of them. Loop thread only; nothing
 * outside the server includes it. td__ functions are the server's own, not an interface. */
#ifndef TD_SERVER_INT_H
#define TD_SERVER_INT_H

#include "daemon/server/connection.h"
#include "daemon/work.h"
#include "daemon/server/server.h"

#define TD_REPLY_BUDGET                                                                 \
    (768u << 10)              /* bytes of jobs or lines one list or logs reply carries, \
                               * well inside TD_PROTO_MAX_FRAME with the frame's own */
#define TD_LOG_LINE_WIRE 8192 /* bytes of one log line's message a logs reply carries */

typedef struct td_stream td_stream;
typedef struct work_req work_req;

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
    uv_loop_t *loop;
    td_config cfg; /* socket_path is the one clients use (systemd's, when it passed one) */
    td_daemon *d;
    td_store *store; /* the daemon's: the loop thread's connection */
    td_conns *conns;
    int listening; /* listener is initialised and not yet closed */
    int inherited; /* listener came from systemd (LISTEN_FDS): its path is not ours */
    uint64_t gen;  /* counts td_server_job_changed calls: a job's metric names may have grown */
    key_set keys;  /* the job's metric names, as of gen */
    td_pw scratch; /* a list or logs page before it is known how much of it fits */
    td_stream *streams;   /* every connection's, newest first (req_streams.c) */
    work_req *works;      /* every connection's export, sample, classify, retrieve or probe */
    td_work_lanes *lanes; /* the threadpool's lanes the works run in (work.h) */
};

/* A request's handler: answers request id of c, whose frame's root map is root (borrowed
 * until it returns). It replies (td_conn_reply ... td_conn_send, or td_conn_error), or holds
 * c for a reply that comes later, or attaches a producer; it may close c. */
typedef void (*td_request_fn)(td_server *s, td_conn *c, const td_pval *root, int64_t id);

#define TD_REQ_FIRST 1u /* may be a connection's first request: hello */

/* One entry of the table server.c dispatches from: the request's type on the wire. */
typedef struct td_request {
    const char *name;
    td_request_fn handler;
    unsigned flags; /* TD_REQ_ */
} td_request;

/* ---- server.c: what every family asks of a request ---- */

/* The request's job_id into *job, or -1 after an error frame. */
int td__get_job_id(td_conn *c, const td_pval *root, int64_t id, int64_t *job);

/* A request's optional labels: {name: value, ...} into out (at most TD_STORE_MAX_LABELS), the
 * strings copied into buf; *n 0 when absent. -1 after an EPROTO error frame naming it. */
#define TD_LABEL_BUF 64
int td__get_labels(td_conn *c, const td_pval *root, int64_t id, td_label *out,
                   char (*buf)[2][TD_LABEL_BUF], size_t *n);

/* Reads job's row into *row (caller clears it), or -1 after an error frame ("no job 12"). */
int td__get_job_row(td_server *s, td_conn *c, int64_t id, int64_t job, td_job_row *row);

/* An optional integer field from lo to hi: 0 with *out set (left alone when absent), or -1
 * after an error frame "name: must be an integer from lo to hi". */
int td__opt_int(td_conn *c, const td_pval *root, int64_t id, const char *name, int64_t lo,
                int64_t hi, int64_t *out);

/* ---- req_jobs.c ---- */

void td__req_hello(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_submit(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_cancel(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_info(td_server *s, td_conn *c, const td_pval *root, int64_t id);

/* ---- req_listing.c ---- */

/* Writes s (len bytes) as a str with anything that is not printable UTF-8 escaped
 * (td_text_escape), newlines kept when keep_nl; cut at out_max bytes. For what clients wrote
 * and traind stored: rows stored before submit checked their strings may hold anything. */
void td__write_text(td_pw *w, const char *s, size_t len, int keep_nl, size_t out_max);

/* Writes the JOB map of PROTOCOL.md for row into w, with live figures for a job the daemon
 * holds, and the spec when with_spec is set. */
void td__write_job(td_server *s, td_pw *w, td_job_row *row, int with_spec);

void td__req_status(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_list(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_logs(td_server *s, td_conn *c, const td_pval *root, int64_t id);

/* ---- req_streams.c ---- */

/* The metric streams open on c (the limit max_streams_per_connection counts them). */
int td__streams_of(const td_conn *c);

/* metrics opens a stream of what is there; watch follows the job until it ends. */
void td__req_metrics(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_watch(td_server *s, td_conn *c, const td_pval *root, int64_t id);

/* ---- req_history.c ---- */

/* rm and prune (PROTOCOL.md): the jobs marked at once, the reply once they are deleted. */
void td__req_rm(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_prune(td_server *s, td_conn *c, const td_pval *root, int64_t id);

/* ---- req_work.c ---- */

void td__req_export(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_sample(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_classify(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_retrieve(td_server *s, td_conn *c, const td_pval *root, int64_t id);
void td__req_probe(td_server *s, td_conn *c, const td_pval *root, int64_t id);

#endif
