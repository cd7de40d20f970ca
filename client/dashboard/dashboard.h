/* The dashboard's internal interface, between dashboard.c (the verb, the HTTP server, static
 * files and the JSON API), dashboard_stream.c (the live server-sent-events streams and their
 * thinning) and dashboard_conn.c (its own blocking connection to traind). Nothing outside
 * these three files includes it; trainctl's other verbs know only tc_dashboard() (client.h).
 *
 * Threads: libmicrohttpd runs one thread per HTTP connection (dashboard.c says why); every
 * function here is called from such a thread, on objects that thread alone owns, except the
 * tc_dash fields marked shared, which are atomics or written once before the server starts. */
#ifndef TC_DASHBOARD_H
#define TC_DASHBOARD_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <microhttpd.h>

#include "proto/proto.h"

#define TC_DASH_TOKEN_BYTES 16 /* random bytes of the URL's token (32 hex digits) */
#define TC_DASH_MAX_CONNS                                             \
    2048 /* HTTP connections (and so threads) at once, fewer when the \
          * open-file limit is lower (dashboard.c) */
#define TC_DASH_REQUEST_MS                                                                    \
    5000                           /* ms from a connection's accept (or the start of its next \
                                    * request) to its request being whole */
#define TC_DASH_MAX_STREAMS  16    /* live streams (each one traind connection) at once */
#define TC_DASH_STREAM_JOBS  8     /* jobs one stream follows (a comparison of 8 runs) */
#define TC_DASH_MAX_KEYS     64    /* metric names of one job a stream draws; more are counted */
#define TC_DASH_BUCKETS      1024  /* points one series keeps and sends, at most */
#define TC_DASH_FLUSH_MS     100   /* ms between two sends of a stream while rows pour in */
#define TC_DASH_QUIET_MS     10    /* ms of silence from traind after which a stream sends */
#define TC_DASH_KEEPALIVE_MS 15000 /* ms of silence after which a stream sends a comment */
#define TC_DASH_REPLY_MS     30000 /* ms a request waits for traind's answer */
#define TC_DASH_LIST_MAX     200   /* jobs of one list page the page may ask for */
#define TC_DASH_LOG_MAX      500   /* log lines of one page the page may ask for */
#define TC_DASH_ERR_MAX      512   /* bytes of an error message for the page */

/* The running dashboard: what every request handler reads. Written before the server starts,
 * then read-only, but for the fields marked shared. */
typedef struct tc_dash {
    const char *socket;                      /* traind's socket, borrowed from the command line */
    char token[2 * TC_DASH_TOKEN_BYTES + 1]; /* the URL's secret path segment, hex */
    char assets[4096];                       /* folder of index.html, app.js, style.css */
    char chartlib[4096];                     /* folder of dygraph.min.js and dygraph.min.css */
    int stop_fd;            /* read end of a pipe that becomes readable when the server stops */
    atomic_int streams;     /* shared: live streams open now */
    atomic_llong served;    /* shared: requests answered, for the closing line */
    struct tc_guard *guard; /* dashboard.c's table of connections, with its own lock */
} tc_dash;

/* ---- dashboard_conn.c: a connection to traind ---- */

typedef struct tc_dconn tc_dconn;

/* Connects to traind's socket at path and says hello. Returns 0, or an HTTP status (502 when
 * traind cannot be reached, 403 when the socket refuses this user) with msg filled. Caller
 * closes with tc__dconn_close(). */
int tc__dconn_open(tc_dconn **out, const char *path, char *msg, size_t size);
void tc__dconn_close(tc_dconn *c);

/* The socket, for poll(). */
int tc__dconn_fd(const tc_dconn *c);

/* Nonzero when traind's hello listed feature ("list_pages", "logs_pages"). */
int tc__dconn_has(const tc_dconn *c, const char *feature);

/* Starts a request of type with npairs pairs in all (type and id included, which this writes)
 * and returns the writer, borrowed from the connection, for the other pairs; *id (may be NULL)
 * receives the request's id. tc__dconn_send() sends it: 0, or 502 with msg filled. */
td_pw *tc__dconn_begin(tc_dconn *c, const char *type, uint32_t npairs, int64_t *id);
int tc__dconn_send(tc_dconn *c, char *msg, size_t size);

/* Reads what the socket holds (call when poll() says it is readable): 0, or -1 with msg filled
 * when traind closed the connection or it broke. */
int tc__dconn_read(tc_dconn *c, char *msg, size_t size);

/* The next frame already read: 1 with *out set (caller frees with td_proto_frame_free()), 0
 * when no whole frame is buffered, -1 with msg filled when traind sent an unreadable one. */
int tc__dconn_take(tc_dconn *c, td_proto_frame **out, char *msg, size_t size);

/* Waits up to TC_DASH_REPLY_MS for the next frame answering the last request, which must be of
 * type type. Returns 0 with *out set (caller frees), or an HTTP status with msg filled: traind's
 * error frames become 403 (EPERM), 404 (ENOTFOUND), 400 (EPROTO, EINVAL, E2BIG), 503 (EBUSY)
 * or 502, with traind's message; a timeout or a lost connection 504 or 502. */
int tc__dconn_call(tc_dconn *c, const char *type, td_proto_frame **out, char *msg, size_t size);

/* The HTTP status for traind's error frame root, and its message into msg. */
int tc__dconn_error(const td_pval *root, char *msg, size_t size);

/* ---- dashboard_stream.c: live streams ---- */

/* Answers GET api/stream?jobs=1,2: a text/event-stream that follows the jobs (dashboard.c has
 * checked the ids: 1 to TC_DASH_STREAM_JOBS of them, distinct). Returns what MHD_queue_response
 * returned, or MHD_NO when even an error could not be queued. */
enum MHD_Result tc__dash_stream(tc_dash *d, struct MHD_Connection *conn, const int64_t *jobs,
                                size_t njobs);

/* Queues a JSON error reply {"error": msg} with status. */
enum MHD_Result tc__dash_error(struct MHD_Connection *conn, unsigned status, const char *msg);

/* ---- dashboard.c: helpers the stream shares ---- */

/* Appends s (len bytes) to the growable buffer as a JSON string literal, quotes included:
 * quotes, backslashes and control characters escaped, and <, > and & as \u003c, \u003e and
 * \u0026 so that no string from traind can close a tag wherever the text ends up. Malformed
 * UTF-8 bytes become U+FFFD. Returns 0, or -1 when out of memory. */
typedef struct tc_buf {
    char *p;
    size_t len, cap;
} tc_buf;
int tc__buf_add(tc_buf *b, const void *p, size_t len);
int tc__buf_printf(tc_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int tc__buf_json_str(tc_buf *b, const char *s, size_t len);
void tc__buf_free(tc_buf *b);

/* A decoded value as JSON text appended to b (maps, arrays, numbers, strings escaped as
 * tc__buf_json_str does; non-finite floats and binaries as null). */
int tc__buf_json_val(tc_buf *b, const td_pval *v);

/* The user name of uid ("root"), or "uid N" when it has none; "" for a negative uid. */
void tc__dash_owner(int64_t uid, char *buf, size_t size);

#endif
