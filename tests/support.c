/* Test support for the integration tests (support.h): a real traind started on a temporary
 * socket and state directory, and a small blocking client of its wire protocol. Owns nothing
 * between calls but ts_live_pid; called from the test process's one thread. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/support.h"
#include "common/td_clock.h"

#define RECV_TIMEOUT_MS 120000 /* a frame the daemon owes us; generous for a loaded CI box */
#define LISTEN_WAIT_MS  50     /* between tries to connect to a starting traind */
#define LISTEN_DEADLINE 60000  /* ms it may take to listen: a sanitizer build on a loaded box */
#define STATUS_POLL_MS  50     /* between status requests while waiting for a state */
#define TS_MAX_COPIES   4      /* binaries ts_bin_for_user copies for another user */

pid_t ts_live_pid = -1;

/* Milliseconds on the monotonic clock, for deadlines. */
long long ts_now_ms(void)
{
    return (long long)td_mono_ms();
}

/* The environment variable name, or dflt when it is unset or empty. */
const char *ts_env_or(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return v != NULL && v[0] != '\0' ? v : dflt;
}

/* A cmocka teardown: kills the daemon a failed test left behind, so that nothing outlives the
 * test run (an orphan would also hold meson's output pipe open). */
int ts_kill_leftover(void **state)
{
    (void)state;
    if (ts_live_pid > 0) {
        kill(ts_live_pid, SIGKILL);
        waitpid(ts_live_pid, NULL, 0);
        ts_live_pid = -1;
    }
    return 0;
}

/* Whether user uid (group gid) may execute path: asked of a child that becomes that user. */
static int runnable_by(const char *path, uid_t uid, gid_t gid)
{
    int status = 0;
    pid_t pid = fork();

    assert_true(pid >= 0);
    if (pid == 0) {
        gid_t groups[1] = {gid};
        if (setgroups(1, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(2);
        _exit(access(path, X_OK) == 0 ? 0 : 1);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) != 2);
    return WEXITSTATUS(status) == 0;
}

/* The copies ts_bin_for_user made: their directory and their paths. */
static char copy_dir[64];
static char copies[TS_MAX_COPIES][300];
static char copied_from[TS_MAX_COPIES][300];
static int ncopies;

static void remove_copies(void)
{
    for (int i = 0; i < ncopies; i++)
        unlink(copies[i]);
    if (copy_dir[0] != '\0')
        rmdir(copy_dir);
}

/* Copies the file src to dst, made with mode 0755 whatever the umask. */
static void copy_executable(const char *src, const char *dst)
{
    static char buf[1 << 16];
    int in = open(src, O_RDONLY), out;
    ssize_t n;

    assert_true(in >= 0);
    out = open(dst, O_WRONLY | O_CREAT | O_EXCL, 0700);
    assert_true(out >= 0);
    while ((n = read(in, buf, sizeof(buf))) > 0)
        assert_int_equal(write(out, buf, (size_t)n), n);
    assert_int_equal(n, 0);
    assert_int_equal(fchmod(out, 0755), 0);
    assert_int_equal(close(out), 0);
    close(in);
}

/* bin itself when user uid (group gid) may run it where it is; else a copy of it in a
 * directory every user may enter, /tmp/traind-bin.XXXXXX (0755), made once per binary and
 * removed when the test program exits. A checkout under /root, or in a mktemp -d directory
 * (0700), is out of another user's reach, but the binaries load only system libraries, so a
 * copy runs as the original does. */
const char *ts_bin_for_user(const char *bin, uid_t uid, gid_t gid)
{
    const char *base = strrchr(bin, '/') != NULL ? strrchr(bin, '/') + 1 : bin;
    int i;

    if (runnable_by(bin, uid, gid))
        return bin;
    for (i = 0; i < ncopies; i++)
        if (strcmp(copied_from[i], bin) == 0)
            return copies[i];
    assert_true(ncopies < TS_MAX_COPIES);
    if (copy_dir[0] == '\0') {
        snprintf(copy_dir, sizeof(copy_dir), "/tmp/traind-bin.XXXXXX");
        assert_non_null(mkdtemp(copy_dir));
        assert_int_equal(chmod(copy_dir, 0755), 0);
        atexit(remove_copies);
    }
    snprintf(copies[i], sizeof(copies[i]), "%s/%s", copy_dir, base);
    snprintf(copied_from[i], sizeof(copied_from[i]), "%s", bin);
    copy_executable(bin, copies[i]);
    ncopies++;
    assert_true(runnable_by(copies[i], uid, gid));
    return copies[i];
}

/* Whether a connection to sock is accepted. No cmocka asserts: forked children that dropped to
 * another user call it, and read errno after a refusal. */
int ts_can_connect(const char *sock)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM, 0), ok;

    if (strlen(sock) >= sizeof(sa.sun_path))
        return 0;
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(fd);
    return ok;
}

/* Makes a fresh /tmp/traind-test.XXXXXX for d and starts traind in it on devices. */
void ts_daemon_start(ts_daemon *d, const char *devices)
{
    snprintf(d->dir, sizeof(d->dir), "/tmp/traind-test.XXXXXX");
    assert_non_null(mkdtemp(d->dir));
    ts_daemon_start_in(d, devices);
}

/* Starts traind on d->dir as ts_daemon_start_in() does, with d->dir/traind.conf holding conf
 * (an INI text, e.g. "[server]\nidle_timeout_s = 2\n") as its --config. */
void ts_daemon_start_conf(ts_daemon *d, const char *devices, const char *conf)
{
    char path[320];
    FILE *f;

    snprintf(path, sizeof(path), "%s/traind.conf", d->dir);
    f = fopen(path, "w");
    assert_non_null(f);
    assert_true(fputs(conf, f) >= 0);
    assert_int_equal(fclose(f), 0);
    ts_daemon_start_in(d, devices);
}

/* Starts traind (TRAIND_BIN) on d->dir, which exists (a restart finds its state there), with
 * its log in d->dir/traind.log (and d->dir/traind.conf as its --config when there is one, as
 * ts_daemon_start_conf() writes it); returns once its socket accepts, or fails the test after
 * 10 s. */
void ts_daemon_start_in(ts_daemon *d, const char *devices)
{
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    char log[320], conf[320];
    int has_conf;

    snprintf(conf, sizeof(conf), "%s/traind.conf", d->dir);
    has_conf = access(conf, F_OK) == 0;
    snprintf(d->sock, sizeof(d->sock), "%s/traind.sock", d->dir);
    snprintf(d->db, sizeof(d->db), "%s/traind.db", d->dir);
    snprintf(log, sizeof(log), "%s/traind.log", d->dir);
    d->pid = fork();
    assert_true(d->pid >= 0);
    if (d->pid == 0) {
        if (freopen(log, "a", stderr) == NULL || freopen("/dev/null", "w", stdout) == NULL)
            _exit(126);
        if (has_conf) {
            execl(bin, bin, "--config", conf, "--socket", d->sock, "--state-dir", d->dir,
                  "--devices", devices, "--log-level", "debug", (char *)NULL);
        } else {
            execl(bin, bin, "--socket", d->sock, "--state-dir", d->dir, "--devices", devices,
                  "--log-level", "debug", (char *)NULL);
        }
        _exit(127);
    }
    ts_live_pid = d->pid;
    for (long long until = ts_now_ms() + LISTEN_DEADLINE; ts_now_ms() < until;) {
        if (ts_can_connect(d->sock))
            return;
        usleep(LISTEN_WAIT_MS * 1000);
    }
    fail_msg("traind did not listen on %s within %d s", d->sock, LISTEN_DEADLINE / 1000);
}

/* SIGTERM and wait; returns the wait status, and removes the directory after a clean exit (a
 * failed test leaves it, log included, to read). */
int ts_daemon_stop(ts_daemon *d)
{
    char cmd[300];
    int status = 0;

    kill(d->pid, SIGTERM);
    assert_int_equal(waitpid(d->pid, &status, 0), d->pid);
    ts_live_pid = -1;
    if (status == 0) {
        snprintf(cmd, sizeof(cmd), "rm -rf %s", d->dir);
        assert_int_equal(system(cmd), 0);
    }
    return status;
}

/* SIGKILL and reap, as a crash would end it; the directory stays for a restart. */
void ts_daemon_kill9(ts_daemon *d)
{
    int status;

    kill(d->pid, SIGKILL);
    waitpid(d->pid, &status, 0);
    ts_live_pid = -1;
}

/* How many times needle occurs in the daemon's log (d->dir/traind.log); 0 when it cannot be
 * read. */
int ts_log_count(const ts_daemon *d, const char *needle)
{
    char path[320], *buf = NULL;
    size_t cap = 0;
    FILE *f;
    int n = 0;

    snprintf(path, sizeof(path), "%s/traind.log", d->dir);
    f = fopen(path, "r");
    if (f == NULL)
        return 0;
    if (getdelim(&buf, &cap, '\0', f) > 0)
        for (const char *p = strstr(buf, needle); p != NULL; p = strstr(p + 1, needle))
            n++;
    free(buf);
    fclose(f);
    return n;
}

/* Polls the daemon's log until needle occurs count times; fails the test after timeout_s. */
void ts_wait_log(const ts_daemon *d, const char *needle, int count, int timeout_s)
{
    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        if (ts_log_count(d, needle) >= count)
            return;
        usleep(STATUS_POLL_MS * 1000);
    }
    fail_msg("\"%s\" is in %s/traind.log %d time(s), not %d, after %d s", needle, d->dir,
             ts_log_count(d, needle), count, timeout_s);
}

/* Connects c to sock: 0, or -errno when the connection is refused (nothing is then left
 * open). */
int ts_client_connect(ts_client *c, const char *sock)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};

    memset(c, 0, sizeof(*c));
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    c->fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(c->fd >= 0);
    if (connect(c->fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        int err = errno;
        close(c->fd);
        return -err;
    }
    assert_int_equal(td_proto_reader_new(&c->r, 0), 0);
    td_pw_init(&c->w);
    c->next_id = 1;
    return 0;
}

/* Closes the connection and frees what c holds. */
void ts_client_close(ts_client *c)
{
    close(c->fd);
    td_proto_reader_free(c->r);
    td_pw_free(&c->w);
}

/* Writes len bytes as they are: for frames the writer would never build. */
void ts_send_raw(ts_client *c, const void *p, size_t len)
{
    const char *b = p;

    while (len > 0) {
        ssize_t n = write(c->fd, b, len);
        assert_true(n > 0);
        b += n;
        len -= (size_t)n;
    }
}

/* Sends the request built in c->w since ts_begin(). */
void ts_client_send(ts_client *c)
{
    const char *frame;
    size_t len;

    assert_int_equal(td_pw_finish(&c->w, &frame, &len), 0);
    ts_send_raw(c, frame, len);
}

/* Next frame, or NULL when the daemon closed the connection. Fails the test on timeout. */
td_proto_frame *ts_client_recv(ts_client *c)
{
    char buf[65536];
    td_proto_frame *f = NULL;
    td_error_t err;

    for (;;) {
        int rc = td_proto_reader_next(c->r, &f, &err);
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        ssize_t n;

        assert_true(rc >= 0);
        if (rc == 1)
            return f;
        if (poll(&p, 1, RECV_TIMEOUT_MS) == 0)
            fail_msg("no frame from traind within %d ms", RECV_TIMEOUT_MS);
        n = read(c->fd, buf, sizeof(buf));
        if (n <= 0)
            return NULL;
        assert_int_equal(td_proto_reader_feed(c->r, buf, (size_t)n), 0);
    }
}

/* Connects and says hello; fails the test unless traind answers hello with our version. */
void ts_connect_hello(ts_client *c, const char *sock)
{
    td_proto_frame *f;

    assert_int_equal(ts_client_connect(c, sock), 0);
    ts_begin(c, "hello", 1);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "hello"));
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "version"), TD_PROTO_VERSION);
    td_proto_frame_free(f);
}

/* Whether v is the string s. */
int ts_str_is(const td_pval *v, const char *s)
{
    size_t len;
    const char *p = td_pv_str(v, &len);
    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

/* The integer at key in map m; fails the test when there is none. */
int64_t ts_get_i(const td_pval *m, const char *key)
{
    int64_t v = -999;
    assert_int_equal(td_pv_int(td_pv_get(m, key), &v), 0);
    return v;
}

/* The string at key in map m into buf (size bytes); fails the test when there is none or it
 * does not fit. */
void ts_get_s(const td_pval *m, const char *key, char *buf, size_t size)
{
    assert_int_equal(td_pv_strcpy(td_pv_get(m, key), buf, size), 0);
}

/* Starts a request of type with its id and room for extra more pairs, which the caller
 * writes into c->w before ts_client_send(); returns its id. */
int64_t ts_begin(ts_client *c, const char *type, uint32_t extra)
{
    td_pw_reset(&c->w);
    td_pw_map(&c->w, 2 + extra);
    td_pw_str(&c->w, "type");
    td_pw_str(&c->w, type);
    td_pw_str(&c->w, "id");
    td_pw_int(&c->w, c->next_id);
    return c->next_id++;
}

/* Sends a request of type whose one argument is job_id (status, cancel, watch, export);
 * returns its id. */
int64_t ts_send_job_request(ts_client *c, const char *type, int64_t job)
{
    int64_t id = ts_begin(c, type, 1);

    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    ts_client_send(c);
    return id;
}

/* The reply to a submit: the new job's id. Fails the test, with the daemon's message, when the
 * job was refused. */
int64_t ts_submitted(ts_client *c)
{
    td_proto_frame *f = ts_client_recv(c);
    int64_t id;

    assert_non_null(f);
    if (!ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "submitted")) {
        char msg[1024] = "";
        td_pv_strcpy(td_pv_get(td_proto_frame_root(f), "message"), msg, sizeof(msg));
        fail_msg("job refused: %s", msg);
    }
    id = ts_get_i(td_proto_frame_root(f), "job_id");
    td_proto_frame_free(f);
    return id;
}

/* Asks for job id's status; returns the reply (caller frees) and sets *job to its job map. */
td_proto_frame *ts_status(ts_client *c, int64_t id, const td_pval **job)
{
    td_proto_frame *f;

    ts_send_job_request(c, "status", id);
    f = ts_client_recv(c);
    assert_non_null(f);
    *job = td_pv_get(td_proto_frame_root(f), "job");
    return f;
}

/* Job id's last completed step, and its state into state (size bytes) unless state is NULL. */
int64_t ts_job_status(ts_client *c, int64_t id, char *state, size_t size)
{
    const td_pval *job;
    td_proto_frame *f = ts_status(c, id, &job);
    int64_t step;

    if (state != NULL)
        ts_get_s(job, "state", state, size);
    step = ts_get_i(job, "step");
    td_proto_frame_free(f);
    return step;
}

/* Polls job id's status until it is in state want; fails the test after timeout_s. */
void ts_wait_state(ts_client *c, int64_t id, const char *want, int timeout_s)
{
    char state[32] = "";

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        ts_job_status(c, id, state, sizeof(state));
        if (strcmp(state, want) == 0)
            return;
        usleep(STATUS_POLL_MS * 1000);
    }
    fail_msg("job %lld is %s, not %s, after %d s", (long long)id, state, want, timeout_s);
}

/* Polls job id's status until it has run past step; fails the test after timeout_s. */
void ts_wait_step(ts_client *c, int64_t id, int64_t step, int timeout_s)
{
    int64_t now = 0;

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        now = ts_job_status(c, id, NULL, 0);
        if (now > step)
            return;
        usleep(STATUS_POLL_MS * 1000);
    }
    fail_msg("job %lld is at step %lld, not past %lld, after %d s", (long long)id, (long long)now,
             (long long)step, timeout_s);
}

/* Polls info until the daemon holds n connections (c's own included); fails the test after
 * timeout_s. */
void ts_wait_clients(ts_client *c, size_t n, int timeout_s)
{
    size_t now = 0;

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        td_proto_frame *f;
        ts_begin(c, "info", 0);
        ts_client_send(c);
        f = ts_client_recv(c);
        assert_non_null(f);
        now = (size_t)ts_get_i(td_proto_frame_root(f), "clients_total");
        td_proto_frame_free(f);
        if (now == n)
            return;
        usleep(STATUS_POLL_MS * 1000);
    }
    fail_msg("the daemon holds %zu connections, not %zu, after %d s", now, n, timeout_s);
}

/* Records one metric row [key, step, value, time] of a watch into out. */
static void watch_row(const td_pval *row, ts_watched *out)
{
    int64_t step;
    double v;

    assert_int_equal(td_pv_len(row), 4);
    assert_int_equal(td_pv_int(td_pv_at(row, 1), &step), 0);
    assert_int_equal(td_pv_double(td_pv_at(row, 2), &v), 0);
    if (step < out->last_step)
        out->dup_or_disorder++;
    out->last_step = step;
    out->rows++;
    if (ts_str_is(td_pv_at(row, 0), "train_loss")) {
        if (step != out->train_loss_rows + 1)
            out->dup_or_disorder++;
        if (out->train_loss_rows == 0)
            out->first_loss = v;
        if (step >= 1 && step <= TS_MAX_LOSSES)
            out->losses[step - 1] = v;
        out->last_loss = v;
        out->train_loss_rows++;
    } else if (ts_str_is(td_pv_at(row, 0), "test_accuracy")) {
        out->test_accuracy = v;
    } else if (ts_str_is(td_pv_at(row, 0), "valid_loss")) {
        out->valid_step = step;
        out->valid_loss = v;
    }
}

/* Watches job id to its end frame, checking that every frame answers the watch, that only
 * rows, state and end frames come, and counting rows that arrive twice or out of step order;
 * fails the test when the connection closes first. */
void ts_watch_to_end(ts_client *c, int64_t id, ts_watched *out)
{
    td_proto_frame *f;
    int64_t req;

    memset(out, 0, sizeof(*out));
    out->test_accuracy = -1;
    out->valid_step = -1;
    req = ts_send_job_request(c, "watch", id);
    while ((f = ts_client_recv(c)) != NULL) {
        const td_pval *root = td_proto_frame_root(f);
        assert_int_equal(ts_get_i(root, "id"), req);
        if (ts_str_is(td_pv_get(root, "type"), "rows")) {
            const td_pval *rows = td_pv_get(root, "rows");
            for (size_t i = 0; i < td_pv_len(rows); i++)
                watch_row(td_pv_at(rows, i), out);
        } else if (ts_str_is(td_pv_get(root, "type"), "end")) {
            const td_pval *job = td_pv_get(root, "job");
            const td_pval *e = td_pv_get(job, "error");
            ts_get_s(job, "state", out->final_state, sizeof(out->final_state));
            if (td_pv_type_of(e) == TD_PV_MAP)
                ts_get_s(e, "message", out->error, sizeof(out->error));
            td_proto_frame_free(f);
            return;
        } else {
            assert_true(ts_str_is(td_pv_get(root, "type"), "state"));
        }
        td_proto_frame_free(f);
    }
    fail_msg("connection closed before the end of the watch");
}

/* A connection to sock made by a child running as uid/gid, handed back over a socket pair:
 * the daemon sees uid (SO_PEERCRED is the connecting process's), the test holds the
 * descriptor. -1 when the child could not connect. */
int ts_connect_as(const char *sock, uid_t uid, gid_t gid)
{
    int sv[2], fd = -1, status;
    char byte = 0, cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    pid_t pid;

    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        int s;
        close(sv[0]);
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(2);
        snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
        s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) != 0)
            _exit(3);
        mh.msg_control = cbuf;
        mh.msg_controllen = sizeof(cbuf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &s, sizeof(int));
        _exit(sendmsg(sv[1], &mh, 0) == 1 ? 0 : 4);
    }
    close(sv[1]);
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof(cbuf);
    if (recvmsg(sv[0], &mh, 0) == 1) {
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        if (cm != NULL && cm->cmsg_type == SCM_RIGHTS)
            memcpy(&fd, CMSG_DATA(cm), sizeof(int));
    }
    close(sv[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return fd;
}

/* Lets every user reach the daemon's socket (the tests run as root; other users' connections
 * are made by children that drop to them). */
void ts_open_socket(const ts_daemon *d)
{
    assert_int_equal(chmod(d->dir, 0711), 0);
    assert_int_equal(chmod(d->sock, 0666), 0);
}
