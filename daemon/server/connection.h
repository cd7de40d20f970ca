/* The server's connection layer: the accepted connections of the control socket, below the
 * requests (server_int.h). It cuts frames out of what a peer sends and hands each to the
 * on_frame callback it was given; it writes reply frames and holds each connection's unsent
 * output to its water marks; it keeps the per-connection and per-user limits of PROTOCOL.md
 * ("Limits": connections in all and per user, the hello and idle timeouts); it holds a
 * connection for a reply that comes later, and it pumps the producers attached to a
 * connection (a metric stream, an export's chunks) when its output drains. It knows no
 * request: it calls up only through on_frame and the producers' ops.
 *
 * What one connection can make the daemon hold is bounded here: its reader (one read plus
 * one frame), the high-water mark plus one frame of replies; what its producers hold is
 * theirs to bound. A connection that must go is closed at once and freed later, in its
 * handle's close callback, or once the last hold on it is let go (td_conn_release).
 *
 * Threads: loop thread only. */
#ifndef TD_CONNECTION_H
#define TD_CONNECTION_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "proto/proto.h"
#include "common/td_errno.h"

#define TD_CONN_HIGH_WATER                                                                  \
    (256 << 10)                      /* bytes queued to a client before its producers pause \
                                      * and its requests wait */
#define TD_CONN_LOW_WATER (64 << 10) /* bytes queued below which they resume */
/* bytes of a held connection's next requests read ahead (so that its hang-up is seen) */
#define TD_CONN_HELD_READ_MAX (64 << 10)

typedef struct td_conn td_conn;
typedef struct td_conns td_conns;
typedef struct td_producer td_producer;

/* A frame a connection sent, in order; f is borrowed until the callback returns. The callback
 * may send replies, hold c, attach producers to it or close it. */
typedef void (*td_conn_frame_cb)(void *ud, td_conn *c, const td_proto_frame *f);

/* What writes to a connection beyond one reply: "the socket drained, write more". */
typedef struct td_producer_ops {
    /* c's output drained below TD_CONN_LOW_WATER (or p was just attached and td_conn_pump
     * asked): write while td_conn_has_room(c). May detach p and free it. */
    void (*pump)(td_producer *p);
    /* c is gone: let go of p, sending nothing. p is detached already. */
    void (*drop)(td_producer *p);
} td_producer_ops;

/* Embedded in what produces (its first member or not: the ops get it back). */
struct td_producer {
    const td_producer_ops *ops;
    td_conn *c;
    td_producer *next; /* the connection's */
};

/* The limits the layer keeps; 0 (or less) for a timeout or a per-user count: none. */
typedef struct td_conn_limits {
    int max_conns;          /* connections open at once; root's get in past it */
    int max_conns_per_user; /* connections of one uid other than root */
    double hello_timeout_s; /* from accept to a completed hello (td_conn_hello_done) */
    double idle_timeout_s;  /* without a frame read or written, nothing attached or held */
} td_conn_limits;

/* The connections of loop: each frame goes to on_frame(ud, ...). lim is copied. Starts the
 * sweep timer that closes connections past their timeouts. 0, or a libuv code with err set;
 * *out is set even then, and the caller closes it (td_conns_close) and frees it
 * (td_conns_free) once the loop has run the close. */
int td_conns_new(td_conns **out, uv_loop_t *loop, const td_conn_limits *lim,
                 td_conn_frame_cb on_frame, void *ud, td_error_t *err);

/* Accepts a connection from listener (a uv_pipe_t that has one waiting): reads its peer's
 * credentials, refuses it past the limits (an error frame saying which, then the close), or
 * starts reading it. */
void td_conns_accept(td_conns *cs, uv_stream_t *listener);

/* Closes every connection and the sweep timer. */
void td_conns_close(td_conns *cs);

/* Once the loop has run td_conns_close's closes. Accepts NULL. */
void td_conns_free(td_conns *cs);

/* The connections open (closing ones until their close callback), newest first. */
int td_conns_count(const td_conns *cs);
td_conn *td_conns_first(td_conns *cs);
td_conn *td_conn_next(td_conn *c);

/* The peer's credentials (SO_PEERCRED), -1 each when they could not be read. */
int64_t td_conn_uid(const td_conn *c);
int64_t td_conn_gid(const td_conn *c);
int64_t td_conn_pid(const td_conn *c);

/* Bytes handed to the socket and not yet written. */
size_t td_conn_pending(const td_conn *c);

/* Whether c is closing: nothing it is sent goes out. */
int td_conn_closing(const td_conn *c);

/* Whether a producer may write to c now: open, and below TD_CONN_HIGH_WATER. */
int td_conn_has_room(const td_conn *c);

/* Whether c has said hello; td_conn_hello_done says it has (its hello timeout is over). */
int td_conn_said_hello(const td_conn *c);
void td_conn_hello_done(td_conn *c);

/* Starts a reply frame {type, id, ...}: the rest of its pairs go into the writer returned
 * (borrowed until td_conn_send), which counts them (td_pw_map_open). */
td_pw *td_conn_reply(td_conn *c, const char *type, int64_t id);

/* Sends the reply begun by td_conn_reply (closing c when it cannot be built or written). */
void td_conn_send(td_conn *c);

/* Sends an error frame answering request id (-1: no request). */
void td_conn_error(td_conn *c, int64_t id, int code, const char *msg);

/* Closes c: it is read and written no more, its producers are dropped, and its memory goes
 * later (never inside this call). */
void td_conn_close(td_conn *c);

/* Holds c for a reply that comes later (threadpool work, a deletion): c reads no further
 * request until td_conn_release, so that replies keep the order of requests, and its memory
 * outlives a close until then. Holds nest. */
void td_conn_hold(td_conn *c);

/* Lets go of a hold: once none is left, c reads requests again (first those that wait in its
 * reader), or, when it is closing and closed, its memory goes here: do not touch it after. */
void td_conn_release(td_conn *c);

/* Whether c is held (td_conn_hold). */
int td_conn_held(const td_conn *c);

/* Attaches p to c (p->c set): its pump is called when c's output drains, its drop when c
 * goes. Not pumped here: the caller writes its first frames itself. */
void td_conn_attach(td_conn *c, td_producer *p, const td_producer_ops *ops);

/* Detaches p from its connection; neither op is called for it again. */
void td_conn_detach(td_producer *p);

/* The producers attached to c whose ops are ops. */
int td_conn_producers(const td_conn *c, const td_producer_ops *ops);

#endif
