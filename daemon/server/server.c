/* The control socket (server.h): the listening socket (its own, or the one systemd passed),
 * the table of requests and the dispatch from it, and what every family asks of a request.
 * The connections are the layer below (connection.c); each family of requests has its own
 * file (server_int.h). Loop thread only.
 *
 * Replies that list things (list, logs, info) are bounded whatever the daemon holds: list
 * and logs are paged (PROTOCOL.md), info caps its lists and says how long they are.
 *
 * export and sample run their slow half on libuv's threadpool (req_work.c); meanwhile their
 * connection reads no further request, so that its replies keep the order of its requests. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/server/server_int.h"
#include "common/td_log.h"
#include "common/td_text.h"

#define TD_SHOWN_TYPE 64                      /* bytes of an unknown request type quoted back... */
#define TD_SHOWN_MAX  (4 * TD_SHOWN_TYPE + 1) /* ...which escaping may make 4 times longer */

/* ---- the requests ---- */

/* Every request the server answers, one entry each, grouped by the file of its family; each
 * has its section in proto/PROTOCOL.md ("Requests and replies"). */
static const td_request requests[] = {
    /* req_jobs.c */
    {"hello", td__req_hello, TD_REQ_FIRST},
    {"submit", td__req_submit, 0},
    {"cancel", td__req_cancel, 0},
    {"info", td__req_info, 0},
    /* req_listing.c */
    {"status", td__req_status, 0},
    {"list", td__req_list, 0},
    {"logs", td__req_logs, 0},
    /* req_streams.c */
    {"metrics", td__req_metrics, 0},
    {"watch", td__req_watch, 0},
    /* req_work.c */
    {"export", td__req_export, 0},
    {"sample", td__req_sample, 0},
    {"classify", td__req_classify, 0},
    {"retrieve", td__req_retrieve, 0},
    {"probe", td__req_probe, 0},
    /* req_history.c */
    {"rm", td__req_rm, 0},
    {"prune", td__req_prune, 0},
};

#define NREQUESTS (sizeof(requests) / sizeof(requests[0]))

const char *td_server_request(size_t i)
{
    return i < NREQUESTS ? requests[i].name : NULL;
}

/* The table's entry for type (len bytes, not NUL-terminated), or NULL. */
static const td_request *find_request(const char *type, size_t len)
{
    for (size_t i = 0; i < NREQUESTS; i++)
        if (strlen(requests[i].name) == len && memcmp(requests[i].name, type, len) == 0)
            return &requests[i];
    return NULL;
}

/* One request of c (the connection layer's on_frame): its id and type checked, then its
 * handler from the table. Before hello, anything but a hello closes the connection, a
 * malformed one included: a peer cannot keep one open by sending frames the daemon answers. */
static void on_frame(void *ud, td_conn *c, const td_proto_frame *f)
{
    td_server *s = ud;
    const td_pval *root = td_proto_frame_root(f);
    char shown[TD_SHOWN_MAX], msg[TD_SHOWN_MAX + 64];
    const td_request *r;
    const char *t;
    size_t len;
    int64_t id;

    if (td_pv_int(td_pv_get(root, "id"), &id) != 0 || id < 0) {
        td_conn_error(c, -1, TD_EPROTO, "id: every request needs an integer id >= 0");
        if (!td_conn_said_hello(c))
            td_conn_close(c);
        return;
    }
    if ((t = td_pv_str(td_pv_get(root, "type"), &len)) == NULL) {
        td_conn_error(c, id, TD_EPROTO, "type: every request needs a type string");
        if (!td_conn_said_hello(c))
            td_conn_close(c);
        return;
    }
    r = find_request(t, len);
    if (!td_conn_said_hello(c) && (r == NULL || !(r->flags & TD_REQ_FIRST))) {
        td_conn_error(c, id, TD_EPROTO, "the first request must be hello");
        td_conn_close(c);
        return;
    }
    if (r != NULL) {
        r->handler(s, c, root, id);
        return;
    }
    /* The client's own bytes, escaped: whatever it sent, the reply is printable UTF-8. */
    td_text_escape(shown, sizeof(shown), t, len < TD_SHOWN_TYPE ? len : TD_SHOWN_TYPE, 0);
    snprintf(msg, sizeof(msg), "type: unknown request \"%s%s\"", shown,
             len > TD_SHOWN_TYPE ? "..." : "");
    td_conn_error(c, id, TD_EPROTO, msg);
}

/* ---- what every family asks of a request ---- */

int td__get_job_id(td_conn *c, const td_pval *root, int64_t id, int64_t *job)
{
    if (td_pv_int(td_pv_get(root, "job_id"), job) != 0 || *job < 1) {
        td_conn_error(c, id, TD_EPROTO, "job_id: must be a positive integer");
        return -1;
    }
    return 0;
}

/* Reads job's row into *row (caller clears it); else answers request id with an error frame
 * and returns -1. A job that does not exist is "no job 12", whichever request asked. */
int td__get_job_row(td_server *s, td_conn *c, int64_t id, int64_t job, td_job_row *row)
{
    td_error_t err;
    int rc = td_store_job_get(s->store, job, row, &err);

    if (rc == TD_ENOTFOUND)
        td_error_set(&err, rc, "no job %lld", (long long)job);
    if (rc != 0) {
        td_conn_error(c, id, rc, err.msg);
        return -1;
    }
    return 0;
}

int td__opt_int(td_conn *c, const td_pval *root, int64_t id, const char *name, int64_t lo,
                int64_t hi, int64_t *out)
{
    const td_pval *v = td_pv_get(root, name);
    char msg[128];

    if (v == NULL)
        return 0;
    if (td_pv_int(v, out) == 0 && *out >= lo && *out <= hi)
        return 0;
    snprintf(msg, sizeof(msg), "%s: must be an integer from %lld to %lld", name, (long long)lo,
             (long long)hi);
    td_conn_error(c, id, TD_EPROTO, msg);
    return -1;
}

/* ---- the listening socket ---- */

static void on_connection(uv_stream_t *listener, int status)
{
    td_server *s = listener->data;

    if (status < 0) {
        td_log_warn("accept: %s", uv_strerror(status));
        return;
    }
    td_conns_accept(s->conns, listener);
}

#define TD_LISTEN_BACKLOG   128  /* connections the kernel holds for traind before accept */
#define TD_LISTEN_FDS_START 3    /* sd_listen_fds(3): the first descriptor systemd passes */
#define TD_SOCKET_MODE      0660 /* owner and group may connect; nobody else */

/* Removes a stale socket file left by a daemon that died, but never a live one. */
static int clear_stale_socket(const char *path, td_error_t *err)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    struct stat stt;
    int fd, live;

    if (lstat(path, &stt) != 0)
        return 0;
    if (!S_ISSOCK(stt.st_mode))
        return td_error_set(err, TD_EINVAL, "%s exists and is not a socket", path);
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return td_error_set(err, -errno, "socket: %s", strerror(errno));
    live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    if (live)
        return td_error_set(err, TD_EINVAL, "another traind is listening on %s", path);
    unlink(path);
    return 0;
}

/* The listening socket systemd passed by socket activation (sd_listen_fds(3)): descriptor 3,
 * when $LISTEN_PID is this process and $LISTEN_FDS is at least 1. Sets *fd to it, or to -1
 * when nothing was passed; fails when what was passed is not a listening Unix stream socket.
 * The variables are left set: they name this pid, so no child takes them for its own, and a
 * re-exec of traind itself (the same pid) finds the same socket again. */
static int inherited_socket(td_server *s, int *fd, td_error_t *err)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    struct sockaddr_un sa;
    socklen_t salen = sizeof(sa), len;
    int type = 0, listening = 0;
    char *end;
    long n;

    *fd = -1;
    if (pid == NULL || fds == NULL || strtol(pid, &end, 10) != (long)getpid() || *end != '\0')
        return 0;
    n = strtol(fds, &end, 10);
    if (*end != '\0' || n < 1)
        return 0;
    len = sizeof(type);
    if (getsockopt(TD_LISTEN_FDS_START, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
        type != SOCK_STREAM)
        goto bad;
    len = sizeof(listening);
    if (getsockopt(TD_LISTEN_FDS_START, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        !listening)
        goto bad;
    if (getsockname(TD_LISTEN_FDS_START, (struct sockaddr *)&sa, &salen) != 0 ||
        sa.sun_family != AF_UNIX)
        goto bad;
    if (n > 1)
        td_log_warn("LISTEN_FDS=%ld: traind uses descriptor %d only", n, TD_LISTEN_FDS_START);
    /* The path systemd bound is the one clients use: report that one, not the configured. */
    if (salen > offsetof(struct sockaddr_un, sun_path) && sa.sun_path[0] != '\0') {
        sa.sun_path[sizeof(sa.sun_path) - 1] = '\0';
        if (strcmp(sa.sun_path, s->cfg.socket_path) != 0)
            td_log_notice("socket activation: listening on %s, which systemd passed, not on %s",
                          sa.sun_path, s->cfg.socket_path);
        snprintf(s->cfg.socket_path, sizeof(s->cfg.socket_path), "%s", sa.sun_path);
    }
    *fd = TD_LISTEN_FDS_START;
    return 0;
bad:
    return td_error_set(err, TD_EINVAL,
                        "LISTEN_FDS=%s: descriptor %d is not a listening Unix stream socket", fds,
                        TD_LISTEN_FDS_START);
}

/* Binds the configured path and gives it mode 0660 and the configured group, both set
 * explicitly: neither the umask nor the daemon's own group decides who may connect. Until
 * uv_listen() the socket refuses connections, so nobody gets in while the mode is still the
 * umask's. On failure the path is removed again. */
static int bind_socket(td_server *s, td_error_t *err)
{
    const char *path = s->cfg.socket_path;
    size_t max = sizeof(((struct sockaddr_un *)NULL)->sun_path) - 1;
    int rc;

    /* libuv 1.44 would silently cut a longer path and bind somewhere else. */
    if (strlen(path) > max)
        return td_error_set(err, TD_EINVAL, "socket path %s is %zu bytes; the limit is %zu", path,
                            strlen(path), max);
    rc = clear_stale_socket(path, err);
    if (rc != 0)
        return rc;
    rc = uv_pipe_bind(&s->listener, path);
    if (rc != 0)
        return td_error_set(err, rc, "cannot bind %s: %s", path, uv_strerror(rc));
    if (s->cfg.socket_group[0] != '\0' && chown(path, (uid_t)-1, (gid_t)s->cfg.socket_gid) != 0)
        rc = td_error_set(err, -errno, "cannot give %s to group %s: %s", path, s->cfg.socket_group,
                          strerror(errno));
    else if (chmod(path, TD_SOCKET_MODE) != 0)
        rc = td_error_set(err, -errno, "cannot set the mode of %s: %s", path, strerror(errno));
    if (rc != 0)
        unlink(path);
    return rc;
}

/* Listens on the socket systemd passed, or else on one bound here. */
static int listen_socket(td_server *s, td_error_t *err)
{
    int fd, rc;

    rc = inherited_socket(s, &fd, err);
    if (rc != 0)
        return rc;
    rc = uv_pipe_init(s->loop, &s->listener, 0);
    if (rc != 0)
        return td_error_set(err, rc, "uv_pipe_init: %s", uv_strerror(rc));
    s->listening = 1;
    s->listener.data = s;
    if (fd >= 0) {
        rc = uv_pipe_open(&s->listener, fd);
        if (rc != 0)
            td_error_set(err, rc, "cannot use the socket systemd passed: %s", uv_strerror(rc));
        s->inherited = rc == 0;
    } else {
        rc = bind_socket(s, err);
    }
    if (rc == 0) {
        rc = uv_listen((uv_stream_t *)&s->listener, TD_LISTEN_BACKLOG, on_connection);
        if (rc != 0) {
            td_error_set(err, rc, "cannot listen on %s: %s", s->cfg.socket_path, uv_strerror(rc));
            if (!s->inherited)
                unlink(s->cfg.socket_path);
        }
    }
    if (rc != 0) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        s->listening = 0;
    }
    return rc;
}

int td_server_new(td_server **out, uv_loop_t *loop, const td_config *cfg, td_daemon *d,
                  td_error_t *err)
{
    td_server *s = calloc(1, sizeof(*s));
    td_conn_limits lim;
    int rc;

    *out = NULL;
    if (s == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    s->loop = loop;
    s->cfg = *cfg;
    s->d = d;
    s->store = td_daemon_store(d);
    td_pw_init(&s->scratch);
    lim = (td_conn_limits){.max_conns = cfg->max_conns > 0 ? cfg->max_conns : TD_MAX_CONNS,
                           .max_conns_per_user = cfg->max_conns_per_user,
                           .hello_timeout_s = cfg->hello_timeout_s,
                           .idle_timeout_s = cfg->idle_timeout_s};
    rc = td_work_lanes_new(&s->lanes, loop, td_work_pool_size(), cfg->work_timeout_s,
                           td_daemon_stop_flag(d), err);
    if (rc != 0) {
        free(s);
        return rc;
    }
    rc = td_conns_new(&s->conns, loop, &lim, on_frame, s, err);
    if (rc == 0)
        rc = listen_socket(s, err);
    if (rc != 0)
        td_conns_close(s->conns);
    /* Even on failure: a listener or sweep that failed after its init is closing, and its
     * memory, s, must outlive the close, which the caller's loop runs before td_server_free. */
    *out = s;
    return rc;
}

const char *td_server_path(const td_server *s)
{
    return s->cfg.socket_path;
}

int td_server_close(td_server *s, int keep_listener)
{
    uv_os_fd_t fd = -1;
    int kept = -1;

    td_work_lanes_close(s->lanes);
    td_conns_close(s->conns);
    if (!s->listening)
        return -1;
    if (keep_listener && s->inherited && uv_fileno((uv_handle_t *)&s->listener, &fd) == 0) {
        kept = fcntl(fd, F_DUPFD_CLOEXEC, 10);
        if (kept < 0)
            td_log_err("cannot keep the socket systemd passed for the re-exec: %s; systemd's "
                       "socket unit still holds it",
                       strerror(errno));
    }
    uv_close((uv_handle_t *)&s->listener, NULL);
    s->listening = 0;
    if (!s->inherited)
        unlink(s->cfg.socket_path);
    return kept;
}

void td_server_free(td_server *s)
{
    if (s == NULL)
        return;
    td_conns_free(s->conns);
    td_work_lanes_free(s->lanes);
    td_pw_free(&s->scratch);
    free(s->keys.names);
    free(s);
}
