/* The control socket (proto/PROTOCOL.md): the listening socket (its own, or the one systemd
 * passed), the connections, their requests, and the streams that feed watchers from the
 * store. It turns requests into calls on the daemon (daemon.h) and learns that a job changed
 * from td_server_job_changed(), which main() wires to the daemon's hooks; the daemon never
 * reaches into it. It keeps the limits of PROTOCOL.md ("Limits"): the first frame's size,
 * the hello and idle timeouts, connections in all and per user, streams per connection, keys
 * per request, exports per user, unread replies, the pages of list and logs.
 *
 * Two layers (daemon/README.md): the connections (connection.h: frames in and out, the water
 * marks, the limits on connections, holds, producers), which know no request; above them the
 * requests, dispatched from one table in server.c to one file per family (server_int.h).
 *
 * Threads: loop thread only. export, sample, classify, retrieve and probe run their slow half on
 * libuv's threadpool (work.h). */
#ifndef TD_SERVER_H
#define TD_SERVER_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/daemon.h"

#define TD_STREAM_PAGE 512 /* metric rows per rows frame */

typedef struct td_server td_server;

/* Listens on the socket systemd passed (LISTEN_FDS), or else binds cfg's socket path with
 * mode 0660 and cfg's group. Requests are answered by d (borrowed until td_server_free).
 * cfg is copied. TD_EINVAL naming the path ("another traind is listening on ..."), or libuv's
 * code. Caller frees with td_server_free() once the loop has run the close. */
int td_server_new(td_server **out, uv_loop_t *loop, const td_config *cfg, td_daemon *d,
                  td_error_t *err);

/* The path clients connect to: the configured one, or the one systemd bound. Borrowed. */
const char *td_server_path(const td_server *s);

/* Feeds every stream of job with newly durable rows, and watchers the job's new state
 * (state, NULL when only rows changed), or the stream's end once the job has ended. */
void td_server_job_changed(td_server *s, int64_t job, const char *state);

/* Closes every connection and the listening socket. The path of a socket traind bound is
 * removed; that of an inherited one is systemd's, which keeps listening on it. With
 * keep_listener set and an inherited socket, returns a close-on-exec duplicate of it for a
 * re-exec (the close closes the original); otherwise -1. */
int td_server_close(td_server *s, int keep_listener);

void td_server_free(td_server *s); /* accepts NULL */

/* The i-th request the server answers, by its type on the wire ("hello", "submit", ...), in
 * the order of its table; NULL past the last. Each is documented in proto/PROTOCOL.md
 * (tests/test_requests.c holds the two lists equal). */
const char *td_server_request(size_t i);

#endif
