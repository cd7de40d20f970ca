/* Integration tests of the limits traind keeps against hostile or careless clients (issue 12,
 * the wire-facing part), each driven by a raw client written against proto/PROTOCOL.md and,
 * where a user would see it, by trainctl (TRAINCTL_BIN):
 *
 *   - a connection that has not said hello within hello_timeout_s, and one idle past
 *     idle_timeout_s, is closed; a watcher waiting for a queued job is not idle;
 *   - a connection's first frame is at most 4096 bytes; after hello, 1 MiB;
 *   - max_connections_per_user: one user cannot take every connection; root always gets in;
 *   - a client that pipelines requests and never reads its replies stops being read: the
 *     daemon holds a bounded amount for it and answers everyone else at once;
 *   - streams per connection and keys per request are capped; names no job has cost a
 *     watcher nothing per batch, and the running job keeps its pace;
 *   - exports in flight per user are capped;
 *   - logs are owner-or-root;
 *   - strings from clients are UTF-8 text without control characters (refused at submit),
 *     and what traind sends or logs and trainctl prints of older ones is escaped;
 *   - queued jobs per user are capped by default; info is bounded with 5000 queued jobs;
 *   - a configuration file with NUL bytes is refused (exit 78);
 *   - list and logs are paged (10,000 ended jobs; 2,500 log lines of 6 KB), with the list's
 *     filters; trainctl pages through both;
 *   - errors name their cause: "no job 99" for every request, metrics --keys naming a key the
 *     job does not have, and a cancelled job's log line said once.
 *
 * Jobs and log lines are written straight into the store (tests/ may use anything) before the
 * daemon starts, so that thousands of them take a second, not minutes. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
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
#include <unistd.h>

#include <cmocka.h>
#include <msgpack.h>

#include "proto/proto.h"
#include "store/store_int.h"
#include "tests/support.h"
#include "common/td_text.h"

#define FMNIST         "/usr/share/datasets/fashion-mnist"
#define E2BIG_CODE     -4204
#define EPROTO_CODE    -4203
#define ENOTFOUND_CODE -4205
#define EJOB_CODE      -4206
#define EPERM_CODE     -4215
#define ECLOSED_CODE   -4218
#define HIGH_WATER     (256 << 10) /* daemon/server/connection.h TD_CONN_HIGH_WATER */
#define OUT_MAX        (32 << 20)  /* bytes of trainctl's stdout kept */

static char out[OUT_MAX], err_out[1 << 16]; /* the last trainctl's stdout and stderr */

/* ---- helpers ---- */

/* A fresh directory for a daemon that a test prepares (a store, a configuration) first. */
static void fresh_dir(ts_daemon *d)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/traind-limits.XXXXXX");
    assert_non_null(mkdtemp(d->dir));
    snprintf(d->db, sizeof(d->db), "%s/traind.db", d->dir);
}

/* Removes a directory fresh_dir() made, once the test that used it has passed. */
static void remove_dir(const ts_daemon *d)
{
    char cmd[320];

    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
    assert_int_equal(system(cmd), 0);
}

/* The next frame within ms: 1 with *f set, 0 when the daemon closed the connection, -1 when
 * nothing came in time. */
static int recv_within(ts_client *c, int ms, td_proto_frame **f)
{
    char buf[65536];
    td_error_t err;
    long long until = ts_now_ms() + ms;

    for (;;) {
        int rc = td_proto_reader_next(c->r, f, &err);
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        long long left = until - ts_now_ms();
        ssize_t n;

        assert_true(rc >= 0);
        if (rc == 1)
            return 1;
        if (left <= 0 || poll(&p, 1, (int)left) == 0)
            return -1;
        n = read(c->fd, buf, sizeof(buf));
        if (n <= 0)
            return 0;
        assert_int_equal(td_proto_reader_feed(c->r, buf, (size_t)n), 0);
    }
}

/* An error frame's code and message (msg may be NULL); fails the test for any other frame. */
static int64_t error_of(td_proto_frame *f, char *msg, size_t size)
{
    const td_pval *root;
    int64_t code;

    assert_non_null(f);
    root = td_proto_frame_root(f);
    if (!ts_str_is(td_pv_get(root, "type"), "error")) {
        char type[32] = "";
        td_pv_strcpy(td_pv_get(root, "type"), type, sizeof(type));
        fail_msg("expected an error frame, got %s", type);
    }
    code = ts_get_i(root, "code");
    if (msg != NULL)
        ts_get_s(root, "message", msg, size);
    td_proto_frame_free(f);
    return code;
}

/* Receives the reply to the last request and returns its error code and message. */
static int64_t recv_error(ts_client *c, char *msg, size_t size)
{
    return error_of(ts_client_recv(c), msg, size);
}

/* Sends hello on a connected client and checks the answer. */
static void say_hello(ts_client *c)
{
    td_proto_frame *f;

    ts_begin(c, "hello", 1);
    td_pw_str(&c->w, "version");
    td_pw_int(&c->w, TD_PROTO_VERSION);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "hello"));
    td_proto_frame_free(f);
}

/* A client around an already connected descriptor. */
static void client_on(ts_client *c, int fd)
{
    memset(c, 0, sizeof(*c));
    c->fd = fd;
    assert_int_equal(td_proto_reader_new(&c->r, 0), 0);
    td_pw_init(&c->w);
    c->next_id = 1;
}

/* Whether this test can act as other users: it runs as root and nobody exists. */
typedef struct user {
    uid_t uid;
    gid_t gid;
} user;

/* A user by name, for a test that acts as other users: it runs as root and name exists. */
static user user_or_skip(const char *name)
{
    struct passwd *pw = getpwnam(name);

    if (geteuid() != 0 || pw == NULL) {
        print_message("needs root and the %s user: skipped\n", name);
        skip();
    }
    return (user){pw->pw_uid, pw->pw_gid};
}

/* Runs trainctl with args (printf format) against d, stdout into out and stderr into
 * err_out; returns its exit status and, in *ms (when not NULL), how long it took. */
static int trainctl(const ts_daemon *d, double *ms, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int trainctl(const ts_daemon *d, double *ms, const char *fmt, ...)
{
    char cmd[4096], args[2048], o[320], e[320];
    long long t0 = ts_now_ms();
    va_list ap;
    FILE *f;
    size_t n;
    int status;

    va_start(ap, fmt);
    vsnprintf(args, sizeof(args), fmt, ap);
    va_end(ap);
    snprintf(o, sizeof(o), "%s/tc.out", d->dir);
    snprintf(e, sizeof(e), "%s/tc.err", d->dir);
    snprintf(cmd, sizeof(cmd), "%s --socket %s %s >%s 2>%s",
             ts_env_or("TRAINCTL_BIN", "build/client/trainctl"), d->sock, args, o, e);
    status = system(cmd);
    if (ms != NULL)
        *ms = (double)(ts_now_ms() - t0);
    f = fopen(o, "rb");
    n = f != NULL ? fread(out, 1, sizeof(out) - 1, f) : 0;
    out[n] = '\0';
    if (f != NULL)
        fclose(f);
    f = fopen(e, "rb");
    n = f != NULL ? fread(err_out, 1, sizeof(err_out) - 1, f) : 0;
    err_out[n] = '\0';
    if (f != NULL)
        fclose(f);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static size_t count_of(const char *hay, const char *needle)
{
    size_t n = 0;

    for (const char *p = strstr(hay, needle); p != NULL; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* An MLP job on Fashion-MNIST as a client sends it, named name, on devices devices (0: the
 * key left out). */
static void write_job_on(td_pw *w, const char *name, int64_t max_steps, int devices)
{
    td_pw_map(w, devices > 0 ? 6 : 5);
    if (devices > 0) {
        td_pw_str(w, "devices");
        td_pw_int(w, devices);
    }
    td_pw_str(w, "name");
    td_pw_str(w, name);
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, 3);
    td_pw_int(w, 784);
    td_pw_int(w, 32);
    td_pw_int(w, 10);
    td_pw_str(w, "data");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, FMNIST "/train-images-idx3-ubyte.gz");
    td_pw_str(w, "labels");
    td_pw_str(w, FMNIST "/train-labels-idx1-ubyte.gz");
    td_pw_str(w, "batch_size");
    td_pw_int(w, 32);
    td_pw_str(w, "max_steps");
    td_pw_int(w, max_steps);
}

static void write_job(td_pw *w, const char *name, int64_t max_steps)
{
    write_job_on(w, name, max_steps, 0);
}

/* Submits an MLP job; returns its id, or the error code with msg filled. */
static int64_t submit(ts_client *c, const char *name, int64_t max_steps, char *msg, size_t size)
{
    td_proto_frame *f;
    const td_pval *root;
    int64_t r;

    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    write_job(&c->w, name, max_steps);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    root = td_proto_frame_root(f);
    if (ts_str_is(td_pv_get(root, "type"), "submitted")) {
        r = ts_get_i(root, "job_id");
        td_proto_frame_free(f);
        return r;
    }
    return error_of(f, msg, size);
}

/* Waits until job id has run past step. */
static void wait_step(ts_client *c, int64_t id, int64_t step, int timeout_s)
{
    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        if (ts_job_status(c, id, NULL, 0) > step)
            return;
        usleep(50 * 1000);
    }
    fail_msg("job %lld did not pass step %lld in %d s", (long long)id, (long long)step, timeout_s);
}

/* Opens d's store (the daemon not running yet, or running: WAL lets both write). */
static td_store *store_of(const ts_daemon *d)
{
    td_store *s;
    td_error_t err;

    assert_int_equal(td_store_open(&s, d->db, &err), 0);
    return s;
}

static void exec_sql(td_store *s, const char *sql)
{
    td_error_t err;

    if (td__store_exec(s, sql, &err) != 0)
        fail_msg("%s: %s", sql, err.msg);
}

/* Inserts n jobs by SQL: ids from the next free one, names job-00001..., the given state,
 * uid alternating between 0 and 1000 (odd ids 1000), created one second apart from 2020-01-01
 * (1577836800), ended ones ended. No spec: they are never run. */
static void seed_jobs(td_store *s, int n, const char *state)
{
    char sql[1024];

    snprintf(sql, sizeof(sql),
             "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < %d) "
             "INSERT INTO jobs (name, state, step, total_steps, devices, device_list, uid, "
             "created, started, ended) SELECT printf('job-%%05d', i), '%s', 100, 100, 1, "
             "'cpu:0', CASE i %% 2 WHEN 1 THEN 1000 ELSE 0 END, 1577836800 + i, "
             "1577836800 + i, 1577836900 + i FROM k",
             n, state);
    exec_sql(s, sql);
}

/* ---- timeouts ---- */

/* A connection that sends one byte and no hello is closed after the default hello timeout
 * (5 s), with an error frame saying why; one that sends nothing too. */
static void test_hello_timeout(void **state)
{
    ts_daemon d;
    ts_client a, b;
    td_proto_frame *f = NULL;
    char msg[256];
    long long t0;

    ts_daemon_start(&d, "cpu:1");
    assert_int_equal(ts_client_connect(&a, d.sock), 0);
    assert_int_equal(ts_client_connect(&b, d.sock), 0);
    ts_send_raw(&a, "\0", 1);
    t0 = ts_now_ms();
    assert_int_equal(recv_within(&a, 9000, &f), 1);
    assert_int_equal(error_of(f, msg, sizeof(msg)), ECLOSED_CODE);
    assert_string_equal(msg, "no hello within 5 s of connecting; closing");
    assert_true(ts_now_ms() - t0 >= 4000);
    assert_int_equal(recv_within(&a, 2000, &f), 0);
    assert_int_equal(recv_within(&b, 3000, &f), 1);
    assert_int_equal(error_of(f, NULL, 0), ECLOSED_CODE);
    assert_int_equal(recv_within(&b, 2000, &f), 0);
    ts_client_close(&a);
    ts_client_close(&b);
    assert_true(ts_log_count(&d, "no hello within 5 s") >= 2);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* With idle_timeout_s 2: a connection that asks nothing is closed; one that keeps asking is
 * not, nor is a watcher of a queued job that nothing has happened to. */
static void test_idle_timeout(void **state)
{
    ts_daemon d;
    ts_client idle, busy, watcher, ctl;
    td_proto_frame *f = NULL;
    char msg[256];
    int64_t running, queued, req, ended = 0;

    fresh_dir(&d);
    ts_daemon_start_conf(&d, "cpu:1", "[server]\nidle_timeout_s = 2\nhello_timeout_s = 1\n");
    ts_connect_hello(&ctl, d.sock);
    running = submit(&ctl, "long", 1000000, NULL, 0);
    queued = submit(&ctl, "waits", 10, NULL, 0);
    assert_true(running > 0 && queued > 0);
    ts_connect_hello(&idle, d.sock);
    ts_connect_hello(&busy, d.sock);
    ts_connect_hello(&watcher, d.sock);
    req = ts_send_job_request(&watcher, "watch", queued);
    for (int i = 0; i < 8; i++) { /* 4 s of a request every half second */
        ts_job_status(&busy, running, NULL, 0);
        usleep(500 * 1000);
    }
    /* due 2 s into those 4 (a deadline, not a bound: a loaded box may be late with it) */
    assert_int_equal(recv_within(&idle, 30000, &f), 1);
    assert_int_equal(error_of(f, msg, sizeof(msg)), ECLOSED_CODE);
    assert_string_equal(msg, "idle for 2 s; closing");
    assert_int_equal(recv_within(&idle, 1000, &f), 0);
    ts_job_status(&busy, running, NULL, 0);
    /* The watcher is still there: cancelling the job it waits for ends its watch. */
    ts_send_job_request(&busy, "cancel", queued);
    f = ts_client_recv(&busy);
    assert_non_null(f);
    td_proto_frame_free(f);
    while (!ended && recv_within(&watcher, 10000, &f) == 1) {
        const td_pval *root = td_proto_frame_root(f);
        assert_int_equal(ts_get_i(root, "id"), req);
        ended = ts_str_is(td_pv_get(root, "type"), "end");
        td_proto_frame_free(f);
    }
    assert_true(ended);
    ts_client_close(&idle);
    ts_client_close(&busy);
    ts_client_close(&watcher);
    ts_client_close(&ctl);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- frames before hello ---- */

static void test_first_frame_is_small(void **state)
{
    static const unsigned char big_prefix[4] = {0, 0, 0x13, 0x88}; /* 5000 bytes */
    ts_daemon d;
    ts_client c;
    char msg[256], *pad = calloc(1, 200000);
    td_proto_frame *f;

    assert_non_null(pad);
    ts_daemon_start(&d, "cpu:1");
    /* Before hello: 5000 bytes announced is refused before any of them is read. */
    assert_int_equal(ts_client_connect(&c, d.sock), 0);
    ts_send_raw(&c, big_prefix, sizeof(big_prefix));
    assert_int_equal(recv_within(&c, 5000, &f), 1);
    assert_int_equal(error_of(f, msg, sizeof(msg)), E2BIG_CODE);
    assert_string_equal(msg, "frame of 5000 bytes exceeds the limit of 4096 bytes before hello");
    assert_null(ts_client_recv(&c));
    ts_client_close(&c);

    /* A hello of 4000 bytes is fine, and after it a frame of 200 KB is read whole. */
    assert_int_equal(ts_client_connect(&c, d.sock), 0);
    ts_begin(&c, "hello", 2);
    td_pw_str(&c.w, "version");
    td_pw_int(&c.w, TD_PROTO_VERSION);
    td_pw_str(&c.w, "client");
    memset(pad, 'x', 3900);
    td_pw_strn(&c.w, pad, 3900);
    ts_client_send(&c);
    f = ts_client_recv(&c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "hello"));
    td_proto_frame_free(f);
    ts_begin(&c, "status", 2);
    td_pw_str(&c.w, "job_id");
    td_pw_int(&c.w, 7);
    td_pw_str(&c.w, "pad");
    memset(pad, 'y', 200000 - 1);
    td_pw_strn(&c.w, pad, 200000 - 1);
    ts_client_send(&c);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), ENOTFOUND_CODE);
    assert_string_equal(msg, "no job 7");
    ts_client_close(&c);
    free(pad);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- connections per user ---- */

/* One user's connections cannot lock out another: past the default 64 per user they are
 * refused with the reason, while another user still gets in; and root gets in even past
 * max_connections (here 80). */
static void test_connections_per_user(void **state)
{
    enum { PER_USER = 64, MAX = 80 };
    user nobody = user_or_skip("nobody"), other = user_or_skip("daemon");
    ts_daemon d;
    ts_client held[PER_USER], c, roots[MAX];
    td_proto_frame *f = NULL;
    char msg[256], want[256];
    int fd;

    fresh_dir(&d);
    ts_daemon_start_conf(&d, "cpu:1", "[limits]\nmax_connections = 80\n");
    ts_open_socket(&d);
    for (int i = 0; i < PER_USER; i++) {
        fd = ts_connect_as(d.sock, nobody.uid, nobody.gid);
        assert_true(fd >= 0);
        client_on(&held[i], fd);
        say_hello(&held[i]);
    }
    for (int i = 0; i < 3; i++) {
        fd = ts_connect_as(d.sock, nobody.uid, nobody.gid);
        assert_true(fd >= 0);
        client_on(&c, fd);
        assert_int_equal(recv_within(&c, 5000, &f), 1);
        assert_int_equal(error_of(f, msg, sizeof(msg)), E2BIG_CODE);
        snprintf(want, sizeof(want),
                 "too many connections: uid %u has 64 open, the limit (max_connections_per_user)",
                 (unsigned)nobody.uid);
        assert_string_equal(msg, want);
        assert_int_equal(recv_within(&c, 2000, &f), 0);
        ts_client_close(&c);
    }
    /* Another user still gets in. */
    fd = ts_connect_as(d.sock, other.uid, other.gid);
    assert_true(fd >= 0);
    client_on(&c, fd);
    say_hello(&c);
    ts_client_close(&c);
    /* Root: as many again as max_connections allows in all, every one served. */
    for (int i = 0; i < MAX; i++)
        ts_connect_hello(&roots[i], d.sock);
    ts_begin(&roots[MAX - 1], "info", 0);
    ts_client_send(&roots[MAX - 1]);
    f = ts_client_recv(&roots[MAX - 1]);
    assert_non_null(f);
    assert_int_equal(ts_get_i(td_proto_frame_root(f), "clients_total"), PER_USER + MAX);
    assert_int_equal(td_pv_len(td_pv_get(td_proto_frame_root(f), "clients")), PER_USER + MAX);
    td_proto_frame_free(f);
    /* ...while anyone else is now over max_connections. */
    fd = ts_connect_as(d.sock, other.uid, other.gid);
    assert_true(fd >= 0);
    client_on(&c, fd);
    assert_int_equal(recv_within(&c, 5000, &f), 1);
    assert_int_equal(error_of(f, msg, sizeof(msg)), E2BIG_CODE);
    snprintf(want, sizeof(want), "too many connections: %d open, the limit (max_connections)",
             PER_USER + MAX);
    assert_string_equal(msg, want);
    ts_client_close(&c);
    for (int i = 0; i < MAX; i++)
        ts_client_close(&roots[i]);
    for (int i = 0; i < PER_USER; i++)
        ts_client_close(&held[i]);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- replies nobody reads ---- */

/* The bytes traind holds for each client, from info: the largest, and the one of pid. */
static size_t pending_most(ts_client *c)
{
    td_proto_frame *f;
    const td_pval *clients;
    size_t most = 0;

    ts_begin(c, "info", 0);
    ts_client_send(c);
    f = ts_client_recv(c);
    assert_non_null(f);
    clients = td_pv_get(td_proto_frame_root(f), "clients");
    for (size_t i = 0; i < td_pv_len(clients); i++) {
        int64_t p = ts_get_i(td_pv_at(clients, i), "pending_bytes");
        most = (size_t)p > most ? (size_t)p : most;
    }
    td_proto_frame_free(f);
    return most;
}

/* One client pipelines 1000 list requests (each answered by ~25 KB) and reads nothing: the
 * daemon stops reading it at the high-water mark instead of holding gigabytes, answers
 * another client at once, and answers every one of the requests, in order, once the client
 * reads. */
static void test_pipelined_requests_never_read(void **state)
{
    enum { NREQ = 1000, NJOBS = 100 };
    ts_daemon d;
    ts_client p, q;
    td_store *s;
    td_pw w;
    const char *frame;
    size_t len, sent = 0, got = 0;
    char *all = NULL;
    size_t alen = 0, acap = 0;
    td_proto_frame *f;
    long long t0, worst = 0;

    fresh_dir(&d);
    s = store_of(&d);
    seed_jobs(s, NJOBS, "succeeded");
    td_store_close(s);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&p, d.sock);
    ts_connect_hello(&q, d.sock);
    td_pw_init(&w);
    for (int i = 0; i < NREQ; i++) {
        td_pw_reset(&w);
        td_pw_map(&w, 2);
        td_pw_str(&w, "type");
        td_pw_str(&w, "list");
        td_pw_str(&w, "id");
        td_pw_int(&w, 100 + i);
        assert_int_equal(td_pw_finish(&w, &frame, &len), 0);
        if (alen + len > acap) {
            acap = (alen + len) * 2;
            all = realloc(all, acap);
            assert_non_null(all);
        }
        memcpy(all + alen, frame, len);
        alen += len;
    }
    td_pw_free(&w);
    /* As much as the socket takes without blocking: the daemon must keep up or stop reading. */
    assert_int_equal(fcntl(p.fd, F_SETFL, O_NONBLOCK), 0);
    for (long long until = ts_now_ms() + 3000; sent < alen && ts_now_ms() < until;) {
        ssize_t n = write(p.fd, all + sent, alen - sent);
        if (n > 0)
            sent += (size_t)n;
        else
            usleep(10 * 1000);
    }
    usleep(500 * 1000);
    for (int i = 0; i < 10; i++) {
        size_t most;
        t0 = ts_now_ms();
        most = pending_most(&q);
        worst = ts_now_ms() - t0 > worst ? ts_now_ms() - t0 : worst;
        if (most > HIGH_WATER + TD_PROTO_MAX_FRAME + 4)
            fail_msg("traind holds %zu bytes of replies for a client that reads nothing", most);
    }
    /* answered at all is what counts (a loop stuck writing to p would answer nothing); how
     * long it took is printed */
    print_message("info beside a client that reads nothing: at most %lld ms\n", worst);
    /* Now it reads: every request is answered, in order. */
    assert_int_equal(sent, alen);
    assert_int_equal(fcntl(p.fd, F_SETFL, 0), 0);
    while (got < NREQ && recv_within(&p, 20000, &f) == 1) {
        const td_pval *root = td_proto_frame_root(f);
        assert_int_equal(ts_get_i(root, "id"), 100 + (int64_t)got);
        assert_true(ts_str_is(td_pv_get(root, "type"), "jobs"));
        assert_int_equal(td_pv_len(td_pv_get(root, "jobs")), NJOBS);
        got++;
        td_proto_frame_free(f);
    }
    assert_int_equal(got, NREQ);
    free(all);
    ts_client_close(&p);
    ts_client_close(&q);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- streams and keys ---- */

/* Sends a metrics or watch request for job naming nkeys keys ("k0", "k1", ...; or all the same
 * key when same is set); returns its id. */
static int64_t send_keys(ts_client *c, const char *type, int64_t job, int nkeys, int same)
{
    int64_t id = ts_begin(c, type, 2);
    char key[32];

    td_pw_str(&c->w, "job_id");
    td_pw_int(&c->w, job);
    td_pw_str(&c->w, "keys");
    td_pw_array(&c->w, (uint32_t)nkeys);
    for (int i = 0; i < nkeys; i++) {
        snprintf(key, sizeof(key), same ? "unknown" : "unknown_%d", i);
        td_pw_str(&c->w, key);
    }
    ts_client_send(c);
    return id;
}

/* A request names at most 256 keys; a connection holds at most max_streams_per_connection
 * (16 by default) streams, which info shows. */
static void test_streams_and_keys_capped(void **state)
{
    ts_daemon d;
    ts_client c, w, ctl;
    char msg[256];
    td_proto_frame *f;
    int64_t running, queued;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&ctl, d.sock);
    running = submit(&ctl, "long", 1000000, NULL, 0);
    queued = submit(&ctl, "waits", 10, NULL, 0);
    ts_connect_hello(&c, d.sock);
    send_keys(&c, "metrics", running, 257, 0);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), E2BIG_CODE);
    assert_string_equal(msg, "keys: 257 names; a request may name at most 256");
    send_keys(&c, "watch", running, 300, 1);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), E2BIG_CODE);

    ts_connect_hello(&w, d.sock);
    for (int i = 0; i < 16; i++)
        send_keys(&w, "watch", queued, 256, 0);
    for (int i = 0; i < 16; i++) { /* each watch of a queued job starts with a state frame */
        f = ts_client_recv(&w);
        assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "state"));
        td_proto_frame_free(f);
    }
    ts_send_job_request(&w, "watch", running);
    assert_int_equal(recv_error(&w, msg, sizeof(msg)), E2BIG_CODE);
    assert_string_equal(msg, "this connection has 16 streams open, the limit "
                             "(max_streams_per_connection); end one, or open another "
                             "connection");
    ts_begin(&ctl, "info", 0);
    ts_client_send(&ctl);
    f = ts_client_recv(&ctl);
    {
        const td_pval *clients = td_pv_get(td_proto_frame_root(f), "clients");
        int64_t most = 0;
        for (size_t i = 0; i < td_pv_len(clients); i++) {
            int64_t n = ts_get_i(td_pv_at(clients, i), "streams");
            most = n > most ? n : most;
        }
        assert_int_equal(most, 16);
    }
    td_proto_frame_free(f);
    ts_client_close(&w);
    ts_client_close(&c);
    ts_client_close(&ctl);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* The steps job makes in ms, measured from its status. */
static int64_t steps_in(ts_client *c, int64_t job, int ms)
{
    int64_t a = ts_job_status(c, job, NULL, 0), b;

    usleep((useconds_t)ms * 1000);
    b = ts_job_status(c, job, NULL, 0);
    return b - a;
}

/* 64 watches of a running job, each naming 256 metric names the job never writes, do not stall
 * the loop: the job keeps training and another client's lists are answered, with the watchers
 * and once they have gone (before the fix: no answer for minutes, no step). What it costs is
 * printed, steps in 1.5 s and the slowest list, and decides nothing: a box loaded by other
 * suites slows every figure (TSan beside an ASan build: 178 steps alone, 12 after). */
static void test_unknown_keys_do_not_stall(void **state)
{
    ts_daemon d;
    ts_client ctl, ws[4];
    int64_t job, alone, watched, after;
    long long worst = 0, base = 0, t0;
    td_proto_frame *f;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&ctl, d.sock);
    job = submit(&ctl, "paced", 1000000, NULL, 0);
    wait_step(&ctl, job, 20, 60);
    alone = steps_in(&ctl, job, 1500);
    for (int i = 0; i < 20; i++) {
        t0 = ts_now_ms();
        ts_begin(&ctl, "list", 0);
        ts_client_send(&ctl);
        f = ts_client_recv(&ctl);
        assert_non_null(f);
        td_proto_frame_free(f);
        base = ts_now_ms() - t0 > base ? ts_now_ms() - t0 : base;
        usleep(50 * 1000);
    }
    for (int i = 0; i < 4; i++) {
        ts_connect_hello(&ws[i], d.sock);
        for (int k = 0; k < 16; k++)
            send_keys(&ws[i], "watch", job, 256, 0);
    }
    for (int i = 0; i < 20; i++) {
        t0 = ts_now_ms();
        ts_begin(&ctl, "list", 0);
        ts_client_send(&ctl);
        f = ts_client_recv(&ctl);
        assert_non_null(f);
        td_proto_frame_free(f);
        worst = ts_now_ms() - t0 > worst ? ts_now_ms() - t0 : worst;
        usleep(50 * 1000);
    }
    watched = steps_in(&ctl, job, 1500);
    /* every list was answered (ts_client_recv fails after its timeout); the job goes on */
    wait_step(&ctl, job, ts_job_status(&ctl, job, NULL, 0) + 10, 60);
    for (int i = 0; i < 4; i++)
        ts_client_close(&ws[i]);
    ts_wait_clients(&ctl, 1, 30); /* the watchers are gone */
    after = steps_in(&ctl, job, 1500);
    wait_step(&ctl, job, ts_job_status(&ctl, job, NULL, 0) + 10, 60);
    print_message("steps in 1.5 s: %lld alone, %lld with 64 watchers, %lld after; list at most "
                  "%lld ms alone, %lld ms with the watchers\n",
                  (long long)alone, (long long)watched, (long long)after, base, worst);
    ts_client_close(&ctl);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- exports in flight ---- */

static void write_corpus(const char *dir, char *path, size_t size)
{
    FILE *f;

    snprintf(path, size, "%s/corpus.txt", dir);
    f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 200; i++)
        fputs("The cat sat on the mat and looked at the rain. A dog ran in the park. ", f);
    fclose(f);
}

/* A GPT of about 430,000 parameters (a 1.7 MB model file) on the corpus. */
static int64_t submit_gpt(ts_client *c, const char *corpus)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, 6);
    td_pw_str(&c->w, "model");
    td_pw_map(&c->w, 6);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "gpt");
    td_pw_str(&c->w, "n_layer");
    td_pw_int(&c->w, 2);
    td_pw_str(&c->w, "n_head");
    td_pw_int(&c->w, 2);
    td_pw_str(&c->w, "n_embd");
    td_pw_int(&c->w, 128);
    td_pw_str(&c->w, "seq_len");
    td_pw_int(&c->w, 32);
    td_pw_str(&c->w, "vocab_size");
    td_pw_int(&c->w, 256);
    td_pw_str(&c->w, "data");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "text");
    td_pw_str(&c->w, "train");
    td_pw_str(&c->w, corpus);
    td_pw_str(&c->w, "batch_size");
    td_pw_int(&c->w, 2);
    td_pw_str(&c->w, "max_steps");
    td_pw_int(&c->w, 4);
    td_pw_str(&c->w, "checkpoint_every");
    td_pw_int(&c->w, 2);
    td_pw_str(&c->w, "seed");
    td_pw_int(&c->w, 3);
    ts_client_send(c);
    return ts_submitted(c);
}

#define EXPORT_WAIT_MS 30000 /* an export's first frame, or its slot given back */

/* Waits until the daemon has begun its reply on c (something to read), for up to ms. */
static void wait_readable(const ts_client *c, int ms, const char *what)
{
    struct pollfd p = {.fd = c->fd, .events = POLLIN};

    if (poll(&p, 1, ms) != 1)
        fail_msg("%s: no reply within %d ms", what, ms);
}

/* Asks c for an export of job until the daemon takes it: refusals must be the per-user cap's
 * (a slot not given back yet); fails the test after EXPORT_WAIT_MS. Returns the request's id
 * and the first frame of the export in *first. */
static int64_t export_once_free(ts_client *c, int64_t job, td_proto_frame **first)
{
    long long until = ts_now_ms() + EXPORT_WAIT_MS;
    char msg[256];

    for (;;) {
        int64_t id = ts_send_job_request(c, "export", job);
        td_proto_frame *f = ts_client_recv(c);
        assert_non_null(f);
        if (!ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "error")) {
            *first = f;
            return id;
        }
        assert_int_equal(error_of(f, msg, sizeof(msg)), E2BIG_CODE);
        if (ts_now_ms() > until)
            fail_msg("an export is still refused %d ms after another one went: %s", EXPORT_WAIT_MS,
                     msg);
        usleep(50 * 1000);
    }
}

/* Two exports nobody reads hold their model files; a third from the same user is refused
 * until one of them has gone, and then goes through. */
static void test_exports_capped_per_user(void **state)
{
    ts_daemon d;
    ts_client a, b, c;
    char corpus[320], msg[256];
    td_proto_frame *f;
    int64_t job, id, bytes = -1, got = 0;

    ts_daemon_start(&d, "cpu:1");
    write_corpus(d.dir, corpus, sizeof(corpus));
    ts_connect_hello(&c, d.sock);
    job = submit_gpt(&c, corpus);
    ts_wait_state(&c, job, "succeeded", 120);
    ts_connect_hello(&a, d.sock);
    ts_connect_hello(&b, d.sock);
    ts_send_job_request(&a, "export", job);
    ts_send_job_request(&b, "export", job);
    /* Both under way: each has begun to send its file. */
    wait_readable(&a, EXPORT_WAIT_MS, "the first export");
    wait_readable(&b, EXPORT_WAIT_MS, "the second export");
    ts_send_job_request(&c, "export", job);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), E2BIG_CODE);
    assert_string_equal(msg, "uid 0 has 2 exports under way, the limit (max_exports_per_user); "
                             "wait for one to finish");
    /* Once the daemon has seen the first client go, its slot is free. */
    ts_client_close(&a);
    id = export_once_free(&c, job, &f);
    for (; f != NULL; f = ts_client_recv(&c)) {
        const td_pval *root = td_proto_frame_root(f);
        assert_int_equal(ts_get_i(root, "id"), id);
        if (ts_str_is(td_pv_get(root, "type"), "end")) {
            bytes = ts_get_i(root, "bytes");
            td_proto_frame_free(f);
            break;
        }
        assert_true(ts_str_is(td_pv_get(root, "type"), "chunk"));
        assert_int_equal(td_pv_type_of(td_pv_get(root, "data")), TD_PV_BIN);
        got += (int64_t)td_pv_get(root, "data")->via.bin.size;
        td_proto_frame_free(f);
    }
    assert_true(bytes > 1000000);
    assert_int_equal(got, bytes);
    ts_client_close(&b);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- logs belong to their owner ---- */

static void test_logs_owner_or_root(void **state)
{
    user nobody = user_or_skip("nobody");
    ts_daemon d;
    ts_client c, other;
    char msg[256], want[256];
    td_proto_frame *f;
    int64_t job;
    int fd;

    ts_daemon_start(&d, "cpu:1");
    ts_open_socket(&d);
    ts_connect_hello(&c, d.sock);
    job = submit(&c, "root's", 5, NULL, 0);
    ts_wait_state(&c, job, "succeeded", 60);
    fd = ts_connect_as(d.sock, nobody.uid, nobody.gid);
    assert_true(fd >= 0);
    client_on(&other, fd);
    say_hello(&other);
    ts_send_job_request(&other, "logs", job);
    assert_int_equal(recv_error(&other, msg, sizeof(msg)), EPERM_CODE);
    snprintf(want, sizeof(want), "permission denied: job %lld belongs to root", (long long)job);
    assert_string_equal(msg, want);
    /* status stays public; the owner reads the log. */
    ts_send_job_request(&other, "status", job);
    f = ts_client_recv(&other);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "job"));
    td_proto_frame_free(f);
    ts_send_job_request(&c, "logs", job);
    f = ts_client_recv(&c);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "logs"));
    assert_true(td_pv_len(td_pv_get(td_proto_frame_root(f), "lines")) >= 3);
    td_proto_frame_free(f);
    ts_client_close(&other);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- strings from clients ---- */

/* Submits a job whose name is the len bytes at name; returns the error code, msg filled. */
static int64_t submit_named(ts_client *c, const char *name, size_t len, char *msg, size_t size)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, 1);
    td_pw_str(&c->w, "name");
    td_pw_strn(&c->w, name, len);
    ts_client_send(c);
    return recv_error(c, msg, size);
}

/* Checks that s is printable text: no ESC, BEL, CR or any other control but newlines, and
 * valid UTF-8. */
static void assert_printable(const char *what, const char *s, size_t len)
{
    size_t at = 0;
    char *copy = malloc(len + 1);

    assert_non_null(copy);
    memcpy(copy, s, len);
    for (size_t i = 0; i < len; i++)
        if (copy[i] == '\n')
            copy[i] = ' ';
    if (td_text_check(copy, len, &at) != TD_TEXT_OK)
        fail_msg("%s: byte %zu (0x%02x) is not printable text", what, at, (unsigned char)s[at]);
    free(copy);
}

/* Names and paths with control characters or malformed UTF-8 are refused at submit naming
 * the field; an unknown request type is quoted back escaped; a job stored before these
 * checks (written here straight into the store) is shown escaped by traind's replies,
 * traind's log and trainctl's ls and status. */
static void test_client_strings(void **state)
{
    static const char evil[] = "evil\x1b[31m\n<0>forged \xff\x07";
    ts_daemon d;
    ts_client c;
    char msg[1024];
    td_store *s;
    td_pw w;
    int64_t id;
    const void *spec;
    size_t len;
    td_error_t err;
    td_proto_frame *f;
    const td_pval *jobs;

    fresh_dir(&d);
    s = store_of(&d);
    td_pw_init(&w);
    write_job(&w, evil, 1000000);
    spec = td_pw_body(&w, &len);
    /* A queued job: the daemon loads it at start and logs its name as it runs it. */
    assert_int_equal(td_store_job_insert(s, evil, 1, 0, 0, spec, len, NULL, &id, &err), 0);
    td_pw_free(&w);
    td_store_close(s);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);

    assert_int_equal(submit_named(&c, "a\n<0>x", 6, msg, sizeof(msg)), EJOB_CODE);
    assert_string_equal(msg, "name: must be text without control characters (byte 1 is 0x0a)");
    assert_int_equal(submit_named(&c, "x\xff", 2, msg, sizeof(msg)), EJOB_CODE);
    assert_string_equal(msg, "name: must be valid UTF-8 text (byte 1 is 0xff)");
    assert_int_equal(submit_named(&c,
                                  "x\xc2\x9b"
                                  "31m",
                                  6, msg, sizeof(msg)),
                     EJOB_CODE);
    assert_string_equal(msg, "name: must be text without control characters (byte 1 is 0xc2)");
    ts_begin(&c, "submit", 1);
    td_pw_str(&c.w, "job");
    write_job(&c.w, "fine", 5);
    ts_client_send(&c);
    f = ts_client_recv(&c);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "submitted"));
    td_proto_frame_free(f);
    /* A nested path, and a map key. */
    ts_begin(&c, "submit", 1);
    td_pw_str(&c.w, "job");
    td_pw_map(&c.w, 2);
    td_pw_str(&c.w, "model");
    td_pw_map(&c.w, 1);
    td_pw_str(&c.w, "init_from");
    td_pw_str(&c.w, "/tmp/\x1b]0;owned\x07");
    td_pw_str(&c.w, "name\r");
    td_pw_str(&c.w, "x");
    ts_client_send(&c);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EJOB_CODE);
    assert_string_equal(
        msg, "model.init_from: must be text without control characters (byte 5 is 0x1b)");

    /* An unknown type comes back escaped. */
    ts_begin(&c, "\xff\x1b[2Jzap", 0);
    ts_client_send(&c);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);
    assert_string_equal(msg, "type: unknown request \"\\xff\\x1b[2Jzap\"");

    /* The stored job: list sends its name escaped, and so do status and the log. */
    ts_wait_state(&c, id, "running", 60);
    ts_begin(&c, "list", 0);
    ts_client_send(&c);
    f = ts_client_recv(&c);
    jobs = td_pv_get(td_proto_frame_root(f), "jobs");
    {
        const char *name = td_pv_str(td_pv_get(td_pv_at(jobs, 0), "name"), &len);
        assert_non_null(name);
        assert_printable("list's name", name, len);
        assert_int_equal(td_text_check(name, len, NULL), TD_TEXT_OK);
        assert_true(len == strlen("evil\\x1b[31m\\x0a<0>forged \\xff\\x07"));
        assert_memory_equal(name, "evil\\x1b[31m\\x0a<0>forged \\xff\\x07", len);
    }
    td_proto_frame_free(f);
    /* status: the stored spec too. */
    {
        const td_pval *job;
        const char *name;
        f = ts_status(&c, id, &job);
        name = td_pv_str(td_pv_get(td_pv_get(job, "spec"), "name"), &len);
        assert_non_null(name);
        assert_int_equal(td_text_check(name, len, NULL), TD_TEXT_OK);
        assert_int_equal(len, strlen("evil\\x1b[31m\\x0a<0>forged \\xff\\x07"));
        td_proto_frame_free(f);
    }
    assert_int_equal(trainctl(&d, NULL, "ls"), 0);
    assert_printable("ls", out, strlen(out));
    assert_non_null(strstr(out, "evil\\x1b"));
    assert_int_equal(trainctl(&d, NULL, "status %lld", (long long)id), 0);
    assert_printable("status", out, strlen(out));
    assert_non_null(strstr(out, "evil\\x1b[31m\\x0a<0>forged"));
    assert_int_equal(trainctl(&d, NULL, "info"), 0);
    assert_printable("info", out, strlen(out));
    {
        char path[320], *log = NULL;
        size_t cap = 0;
        ssize_t n;
        FILE *lf;
        snprintf(path, sizeof(path), "%s/traind.log", d.dir);
        lf = fopen(path, "r");
        assert_non_null(lf);
        while ((n = getline(&log, &cap, lf)) > 0) {
            if (strncmp(log, "<0>", 3) == 0 || strstr(log, "\n<0>") != NULL)
                fail_msg("a log line of priority 0: %s", log);
            assert_printable("traind's log", log, (size_t)n);
        }
        free(log);
        fclose(lf);
        /* The name's newline continues the line, indented (the log is a file here, not the
         * journal: no "<N>" prefixes; test_log.c checks the journal's). */
        assert_true(ts_log_count(&d, "evil\\x1b[31m\n  <0>forged \\xff\\x07") >= 1);
    }
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* A fake traind for trainctl: answers hello, list, status and logs on sock with strings full
 * of terminal controls, as an older traind could send them, until killed. In a child: no
 * cmocka asserts. */
static void write_evil_job(td_pw *w)
{
    td_pw_map(w, 5);
    td_pw_str(w, "id");
    td_pw_int(w, 1);
    td_pw_str(w, "name");
    td_pw_str(w, "evil\x1b]0;owned\x07\x1b[2J\xc2\x9b"
                 "31m\xff");
    td_pw_str(w, "state");
    td_pw_str(w, "failed");
    td_pw_str(w, "created");
    td_pw_double(w, 1577836800);
    td_pw_str(w, "error");
    td_pw_map(w, 2);
    td_pw_str(w, "code");
    td_pw_int(w, -4207);
    td_pw_str(w, "message");
    td_pw_str(w, "cannot read /data/\x1b[31mred\nsecond line\r");
}

static void fake_reply(int fd, const td_pval *req, td_pw *w)
{
    int64_t id = -1;
    const char *frame;
    size_t len;

    td_pv_int(td_pv_get(req, "id"), &id);
    td_pw_reset(w);
    if (ts_str_is(td_pv_get(req, "type"), "hello")) {
        td_pw_map(w, 3);
        td_pw_str(w, "type");
        td_pw_str(w, "hello");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "version");
        td_pw_int(w, TD_PROTO_VERSION);
    } else if (ts_str_is(td_pv_get(req, "type"), "list")) {
        td_pw_map(w, 3);
        td_pw_str(w, "type");
        td_pw_str(w, "jobs");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "jobs");
        td_pw_array(w, 1);
        write_evil_job(w);
    } else if (ts_str_is(td_pv_get(req, "type"), "status")) {
        td_pw_map(w, 3);
        td_pw_str(w, "type");
        td_pw_str(w, "job");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "job");
        write_evil_job(w);
    } else if (ts_str_is(td_pv_get(req, "type"), "logs")) {
        td_pw_map(w, 4);
        td_pw_str(w, "type");
        td_pw_str(w, "logs");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "job_id");
        td_pw_int(w, 1);
        td_pw_str(w, "lines");
        td_pw_array(w, 1);
        td_pw_array(w, 3);
        td_pw_double(w, 1577836800);
        td_pw_int(w, 3);
        td_pw_str(w, "failed: \x1b[1;31mred\x1b[0m\x9b\nsecond\x07");
    } else { /* an error frame by hand: td_proto_write_error would escape the message */
        td_pw_map(w, 5);
        td_pw_str(w, "type");
        td_pw_str(w, "error");
        td_pw_str(w, "id");
        td_pw_int(w, id);
        td_pw_str(w, "code");
        td_pw_int(w, -4215);
        td_pw_str(w, "name");
        td_pw_str(w, "EPERM");
        td_pw_str(w, "message");
        td_pw_str(w, "evil \x1b[31m refusal");
    }
    if (td_pw_finish(w, &frame, &len) == 0 && write(fd, frame, len) != (ssize_t)len)
        _exit(3);
}

static void fake_traind(const char *sock)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    td_pw w;

    if (strlen(sock) >= sizeof(sa.sun_path))
        _exit(2);
    memcpy(sa.sun_path, sock, strlen(sock) + 1);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(lfd, 8) != 0)
        _exit(2);
    td_pw_init(&w);
    for (;;) {
        int fd = accept(lfd, NULL, NULL);
        td_proto_reader *r = NULL;
        td_proto_frame *f;
        td_error_t err;
        char buf[4096];
        ssize_t n;

        if (fd < 0 || td_proto_reader_new(&r, 0) != 0)
            _exit(2);
        while ((n = read(fd, buf, sizeof(buf))) > 0) {
            td_proto_reader_feed(r, buf, (size_t)n);
            while (td_proto_reader_next(r, &f, &err) == 1) {
                fake_reply(fd, td_proto_frame_root(f), &w);
                td_proto_frame_free(f);
            }
        }
        td_proto_reader_free(r);
        close(fd);
    }
}

/* trainctl prints what a traind sends escaped, whatever that traind checked: names, errors
 * and log lines full of controls (a retitle, a clear screen, a C1 CSI, colours, a carriage
 * return) come out as \xNN, newlines in messages indented, nothing raw. */
static void test_trainctl_escapes(void **state)
{
    ts_daemon d;
    pid_t pid;

    fresh_dir(&d);
    snprintf(d.sock, sizeof(d.sock), "%s/fake.sock", d.dir);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        fake_traind(d.sock);
    ts_live_pid = pid; /* killed by the teardown should a check fail */
    for (int i = 0; i < 200 && !ts_can_connect(d.sock); i++)
        usleep(20 * 1000);
    assert_int_equal(trainctl(&d, NULL, "ls"), 0);
    assert_printable("ls", out, strlen(out));
    assert_non_null(strstr(out, "evil\\x1b]0;owned\\x07")); /* ls cuts names at 24 */
    assert_int_equal(trainctl(&d, NULL, "status 1"), 0);
    assert_printable("status", out, strlen(out));
    assert_non_null(strstr(out, "evil\\x1b]0;owned\\x07\\x1b[2J\\xc2\\x9b31m\\xff"));
    assert_non_null(strstr(out, "cannot read /data/\\x1b[31mred\n"));
    assert_non_null(strstr(out, "second line\\x0d"));
    assert_int_equal(trainctl(&d, NULL, "logs 1"), 0);
    assert_printable("logs", out, strlen(out));
    assert_non_null(strstr(out, "failed: \\x1b[1;31mred\\x1b[0m\\x9b\n"));
    assert_int_equal(trainctl(&d, NULL, "cancel 1"), 77);
    assert_printable("an error", err_out, strlen(err_out));
    assert_string_equal(err_out, "trainctl: evil \\x1b[31m refusal\n");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ts_live_pid = -1;
    remove_dir(&d);
}

/* ---- the queue and info ---- */

/* With 5,000 queued jobs: a user is held to the default 1,000 queued jobs, and info answers
 * with the first 1,000 ids and the total, a list with a page of 1,000. How long they took is
 * printed (TSan on a loaded 2-core box: about 100 ms and 6 s) and decides nothing. */
static void test_queue_per_user_and_info_bounded(void **state)
{
    ts_daemon d;
    ts_client c;
    td_store *s;
    td_pw w;
    td_error_t err;
    const void *spec;
    size_t len;
    int64_t id;
    char msg[256];
    td_proto_frame *f;
    long long t0, worst = 0, worst_list = 0;

    fresh_dir(&d);
    s = store_of(&d);
    td_pw_init(&w);
    write_job(&w, "queued", 1000000);
    spec = td_pw_body(&w, &len);
    assert_int_equal(td_store_job_insert(s, "queued", 1, 0, 0, spec, len, NULL, &id, &err), 0);
    exec_sql(s, "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 4999) "
                "INSERT INTO jobs (name, state, devices, priority, uid, created, spec) "
                "SELECT name, state, devices, i % 7, uid, created, spec FROM jobs, k "
                "WHERE jobs.id = 1");
    td_pw_free(&w);
    td_store_close(s);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    for (int i = 0; i < 10; i++) {
        t0 = ts_now_ms();
        ts_begin(&c, "info", 0);
        ts_client_send(&c);
        f = ts_client_recv(&c);
        worst = ts_now_ms() - t0 > worst ? ts_now_ms() - t0 : worst;
        assert_int_equal(td_pv_len(td_pv_get(td_proto_frame_root(f), "queued")), 1000);
        assert_true(ts_get_i(td_proto_frame_root(f), "queued_total") >= 4999);
        td_proto_frame_free(f);
        t0 = ts_now_ms();
        ts_begin(&c, "list", 0);
        ts_client_send(&c);
        f = ts_client_recv(&c);
        worst_list = ts_now_ms() - t0 > worst_list ? ts_now_ms() - t0 : worst_list;
        assert_int_equal(td_pv_len(td_pv_get(td_proto_frame_root(f), "jobs")), 1000);
        td_proto_frame_free(f);
    }
    print_message("5000 queued jobs: info at most %lld ms, a page of 1000 jobs at most %lld ms\n",
                  worst, worst_list);
    assert_int_equal(submit(&c, "one more", 10, msg, sizeof(msg)), EPERM_CODE);
    assert_string_equal(msg, "permission denied: uid 0 already has 1000 queued jobs, the limit");
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* The queue's other limits, driven as a client meets them: max_queued for everyone, and
 * max_devices_per_user. */
static void test_queue_and_device_limits(void **state)
{
    ts_daemon d;
    ts_client c;
    char msg[256];
    int64_t id;

    fresh_dir(&d);
    ts_daemon_start_conf(&d, "cpu:2",
                         "[limits]\nmax_queued = 2\nmax_queued_per_user = 0\n"
                         "max_devices_per_user = 1\n");
    ts_connect_hello(&c, d.sock);
    ts_begin(&c, "submit", 1);
    td_pw_str(&c.w, "job");
    write_job_on(&c.w, "wide", 10, 2);
    ts_client_send(&c);
    assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPERM_CODE);
    assert_string_equal(msg, "devices: the job asks for 2 devices but each user may hold 1");
    /* One job runs (the user's one device), two wait, and the queue is full. */
    id = submit(&c, "runs", 1000000, NULL, 0);
    assert_true(id > 0);
    ts_wait_state(&c, id, "running", 60);
    for (int i = 0; i < 2; i++)
        assert_true(submit(&c, "waits", 10, NULL, 0) > 0);
    assert_int_equal(submit(&c, "one too many", 10, msg, sizeof(msg)), EPERM_CODE);
    assert_string_equal(msg, "the queue is full: 2 jobs wait, the limit");
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- the configuration file ---- */

/* A configuration file that starts with NUL bytes is refused, exit 78, naming the byte. */
static void test_config_with_nul_bytes(void **state)
{
    ts_daemon d;
    char path[320], log[320];
    FILE *f;
    pid_t pid;
    int status = -1;

    fresh_dir(&d);
    snprintf(path, sizeof(path), "%s/traind.conf", d.dir);
    snprintf(log, sizeof(log), "%s/traind.log", d.dir);
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite("\0\0\0\0[daemon]\nlog_level = debug\n", 1, 32, f), 32);
    fclose(f);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
        char sock[320];
        snprintf(sock, sizeof(sock), "%s/traind.sock", d.dir);
        if (freopen(log, "w", stderr) == NULL)
            _exit(126);
        execl(bin, bin, "--config", path, "--socket", sock, "--state-dir", d.dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 200; i++) {
        if (waitpid(pid, &status, WNOHANG) == pid)
            break;
        usleep(50 * 1000);
        status = -1;
    }
    if (status == -1) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fail_msg("traind ran on a configuration file of NUL bytes");
    }
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 78);
    assert_int_equal(ts_log_count(&d, "byte 0 is a NUL byte; a configuration file is text"), 1);
    remove_dir(&d);
}

/* ---- paged list and logs ---- */

/* Asks for a list page with the fields given (a JSON-ish description is not worth it: the
 * caller writes them) and returns the reply; *n the jobs, *more and *next. */
typedef struct page {
    td_proto_frame *f;
    const td_pval *jobs;
    int more;
    int64_t next;
} page;

static void list_page(ts_client *c, void (*fields)(td_pw *w, void *ud), uint32_t nfields, void *ud,
                      page *p)
{
    ts_begin(c, "list", nfields);
    if (fields != NULL)
        fields(&c->w, ud);
    ts_client_send(c);
    p->f = ts_client_recv(c);
    assert_non_null(p->f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(p->f), "type"), "jobs"));
    p->jobs = td_pv_get(td_proto_frame_root(p->f), "jobs");
    assert_int_equal(td_pv_bool(td_pv_get(td_proto_frame_root(p->f), "more"), &p->more), 0);
    p->next = ts_get_i(td_proto_frame_root(p->f), "next");
}

typedef struct filters {
    int64_t after;
    int newest_first;
    const char *state;
    int64_t uid;
    const char *name;
    double since;
    int64_t limit;
} filters;

static uint32_t nfields_of(const filters *q)
{
    return (q->after > 0) + (q->newest_first != 0) + (q->state != NULL) + (q->uid >= 0) +
           (q->name != NULL) + (q->since > 0) + (q->limit > 0);
}

static void write_filters(td_pw *w, void *ud)
{
    const filters *q = ud;

    if (q->after > 0) {
        td_pw_str(w, "after");
        td_pw_int(w, q->after);
    }
    if (q->newest_first) {
        td_pw_str(w, "newest_first");
        td_pw_bool(w, 1);
    }
    if (q->state != NULL) {
        td_pw_str(w, "states");
        td_pw_array(w, 1);
        td_pw_str(w, q->state);
    }
    if (q->uid >= 0) {
        td_pw_str(w, "uid");
        td_pw_int(w, q->uid);
    }
    if (q->name != NULL) {
        td_pw_str(w, "name");
        td_pw_str(w, q->name);
    }
    if (q->since > 0) {
        td_pw_str(w, "since");
        td_pw_double(w, q->since);
    }
    if (q->limit > 0) {
        td_pw_str(w, "limit");
        td_pw_int(w, q->limit);
    }
}

/* Every job matching q, page after page; their ids into ids (at most max); returns how many. */
static size_t list_all(ts_client *c, filters q, int64_t *ids, size_t max, size_t *pages)
{
    size_t n = 0;
    page p;

    *pages = 0;
    do {
        list_page(c, write_filters, nfields_of(&q), &q, &p);
        (*pages)++;
        for (size_t i = 0; i < td_pv_len(p.jobs) && n < max; i++)
            ids[n++] = ts_get_i(td_pv_at(p.jobs, i), "id");
        if (p.more)
            assert_true(q.newest_first ? p.next < q.after || q.after == 0 : p.next > q.after);
        q.after = p.next;
        td_proto_frame_free(p.f);
    } while (p.more);
    return n;
}

/* 10,000 ended jobs: a list without paging fields gets the first 1,000 and where to go on;
 * paging reads each job once, in order, either way; the filters select what they say; and
 * trainctl ls prints them all (its time is printed, not judged). */
static void test_list_is_paged(void **state)
{
    enum { N = 10000 };
    ts_daemon d;
    ts_client c;
    td_store *s;
    page p;
    size_t n, pages;
    int64_t *ids = calloc(N + 1, sizeof(*ids));
    double ms = 0, ms_json = 0;

    assert_non_null(ids);
    fresh_dir(&d);
    s = store_of(&d);
    seed_jobs(s, N / 2, "succeeded");
    seed_jobs(s, N / 2, "failed");
    exec_sql(s, "UPDATE jobs SET err_code = -4209, err_msg = 'loss is NaN at step 41' "
                "WHERE state = 'failed'");
    td_store_close(s);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);

    /* As a version-1 client asks: the first page, and where the next one starts. */
    list_page(&c, NULL, 0, NULL, &p);
    assert_int_equal(td_pv_len(p.jobs), 1000);
    assert_true(p.more);
    assert_int_equal(p.next, 1000);
    assert_int_equal(ts_get_i(td_pv_at(p.jobs, 0), "id"), 1);
    td_proto_frame_free(p.f);

    n = list_all(&c, (filters){.uid = -1}, ids, N + 1, &pages);
    assert_int_equal(n, N);
    assert_int_equal(pages, 10);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(ids[i], (int64_t)i + 1);
    n = list_all(&c, (filters){.uid = -1, .newest_first = 1, .limit = 333}, ids, N + 1, &pages);
    assert_int_equal(n, N);
    assert_int_equal(pages, 31);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(ids[i], N - (int64_t)i);
    /* Filters: state, uid, name pattern, creation time, and all of them at once. */
    n = list_all(&c, (filters){.uid = -1, .state = "failed"}, ids, N + 1, &pages);
    assert_int_equal(n, N / 2);
    assert_int_equal(ids[0], N / 2 + 1);
    n = list_all(&c, (filters){.uid = 1000}, ids, N + 1, &pages);
    assert_int_equal(n, N / 2);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(ids[i] % 2, 1);
    n = list_all(&c, (filters){.uid = -1, .name = "job-0001?"}, ids, N + 1, &pages);
    assert_int_equal(n, 20); /* job-00010..19 of both halves */
    n = list_all(&c, (filters){.uid = -1, .since = 1577836800 + 4990}, ids, N + 1, &pages);
    assert_int_equal(n, 22); /* created 4990..5000 s after 2020-01-01: 11 of each half */
    n = list_all(
        &c, (filters){.uid = 0, .state = "succeeded", .name = "job-000[1-2]*", .newest_first = 1},
        ids, N + 1, &pages);
    assert_int_equal(n, 10); /* job-00010..job-00029 succeeded, even ones (uid 0) */
    for (size_t i = 0; i + 1 < n; i++)
        assert_true(ids[i] > ids[i + 1]);

    /* Bad fields are refused, naming the field. */
    {
        char msg[256];
        ts_begin(&c, "list", 1);
        td_pw_str(&c.w, "limit");
        td_pw_int(&c.w, 1001);
        ts_client_send(&c);
        assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);
        assert_string_equal(msg, "limit: must be an integer from 1 to 1000");
        ts_begin(&c, "list", 1);
        td_pw_str(&c.w, "states");
        td_pw_array(&c.w, 1);
        td_pw_str(&c.w, "done");
        ts_client_send(&c);
        assert_int_equal(recv_error(&c, msg, sizeof(msg)), EPROTO_CODE);
    }

    assert_int_equal(trainctl(&d, &ms, "ls"), 0);
    assert_int_equal(count_of(out, "\n"), N + 1);
    assert_non_null(strstr(out, "job-05000"));
    assert_int_equal(trainctl(&d, &ms_json, "ls --json"), 0);
    assert_int_equal(count_of(out, "\"id\":"), N);
    print_message("trainctl ls with %d jobs: %.0f ms (--json: %.0f ms)\n", N, ms, ms_json);
    free(ids);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* 2,500 log lines of about 6 KB (15 MB in all) come in pages that each fit a frame; trainctl
 * logs prints every line once, in order. */
static void test_logs_are_paged(void **state)
{
    enum { N = 2500 };
    ts_daemon d;
    ts_client c;
    td_store *s;
    td_proto_frame *f;
    int64_t after = 0, job, seen = 0;
    int more = 1, pages = 0;
    char line[64];

    fresh_dir(&d);
    s = store_of(&d);
    seed_jobs(s, 1, "succeeded");
    exec_sql(s, "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 2500) "
                "INSERT INTO job_logs (job, time, level, message) SELECT 1, 1577836800 + i, 5, "
                "printf('line %05d ', i) || hex(zeroblob(3000)) FROM k");
    td_store_close(s);
    ts_daemon_start_in(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    job = 1;
    /* As a version-1 client asks: the first page. */
    ts_send_job_request(&c, "logs", job);
    f = ts_client_recv(&c);
    assert_non_null(f);
    assert_true(td_pv_len(td_pv_get(td_proto_frame_root(f), "lines")) < N);
    assert_int_equal(td_pv_bool(td_pv_get(td_proto_frame_root(f), "more"), &more), 0);
    assert_true(more);
    td_proto_frame_free(f);
    while (more) {
        const td_pval *lines;
        size_t body;
        ts_begin(&c, "logs", 2);
        td_pw_str(&c.w, "job_id");
        td_pw_int(&c.w, job);
        td_pw_str(&c.w, "after");
        td_pw_int(&c.w, after);
        ts_client_send(&c);
        f = ts_client_recv(&c);
        assert_non_null(f);
        td_proto_frame_body(f, &body);
        assert_true(body <= TD_PROTO_MAX_FRAME);
        lines = td_pv_get(td_proto_frame_root(f), "lines");
        for (size_t i = 0; i < td_pv_len(lines); i++) {
            size_t len;
            const char *m = td_pv_str(td_pv_at(td_pv_at(lines, i), 2), &len);
            snprintf(line, sizeof(line), "line %05lld ", (long long)++seen);
            assert_true(len > 6000 && memcmp(m, line, strlen(line)) == 0);
        }
        assert_int_equal(td_pv_bool(td_pv_get(td_proto_frame_root(f), "more"), &more), 0);
        after = ts_get_i(td_proto_frame_root(f), "next");
        pages++;
        td_proto_frame_free(f);
    }
    assert_int_equal(seen, N);
    assert_true(pages >= 15);
    assert_int_equal(trainctl(&d, NULL, "logs %lld", (long long)job), 0);
    assert_int_equal(count_of(out, "\n"), N);
    assert_non_null(strstr(out, "notice line 02500 "));
    assert_int_equal(trainctl(&d, NULL, "logs %lld --json", (long long)job), 0);
    assert_int_equal(count_of(out, "\"message\":"), N);
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

/* ---- errors that name the cause ---- */

static void test_errors_name_the_cause(void **state)
{
    static const char *const types[] = {"status", "logs", "metrics", "watch", "cancel", "export"};
    ts_daemon d;
    ts_client c;
    char msg[256], want[256];
    int64_t done, cancelled;

    ts_daemon_start(&d, "cpu:1");
    ts_connect_hello(&c, d.sock);
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        ts_send_job_request(&c, types[i], 99);
        assert_int_equal(recv_error(&c, msg, sizeof(msg)), ENOTFOUND_CODE);
        if (strcmp(msg, "no job 99") != 0)
            fail_msg("%s 99: \"%s\", not \"no job 99\"", types[i], msg);
    }
    assert_int_equal(trainctl(&d, NULL, "status 99"), 1);
    assert_string_equal(err_out, "trainctl: no job 99\n");

    /* metrics --keys naming what the job does not have: the ones missing, and what it has. */
    done = submit(&c, "done", 5, NULL, 0);
    ts_wait_state(&c, done, "succeeded", 60);
    assert_int_equal(trainctl(&d, NULL, "metrics %lld --keys nosuchkey", (long long)done), 1);
    assert_string_equal(out, "job,key,step,value,time\n");
    snprintf(want, sizeof(want),
             "trainctl: job %lld has no metric named nosuchkey; its metrics are epoch, grad_norm, "
             "lr, ",
             (long long)done);
    assert_memory_equal(err_out, want, strlen(want));
    assert_non_null(strstr(err_out, ", train_loss"));
    assert_int_equal(
        trainctl(&d, NULL, "metrics %lld --keys train_loss,nosuchkey", (long long)done), 1);
    assert_int_equal(count_of(out, ",train_loss,"), 5);
    assert_non_null(strstr(err_out, "has no metric named nosuchkey;"));
    assert_int_equal(trainctl(&d, NULL, "metrics %lld --keys train_loss", (long long)done), 0);

    /* A cancelled job's log says so once. */
    cancelled = submit(&c, "cancelled", 1000000, NULL, 0);
    wait_step(&c, cancelled, 3, 60);
    ts_send_job_request(&c, "cancel", cancelled);
    td_proto_frame_free(ts_client_recv(&c));
    ts_wait_state(&c, cancelled, "cancelled", 60);
    assert_int_equal(trainctl(&d, NULL, "logs %lld", (long long)cancelled), 0);
    assert_int_equal(count_of(out, "cancelled at step"), 1);
    assert_null(strstr(out, ": cancelled at step"));
    ts_client_close(&c);
    assert_int_equal(ts_daemon_stop(&d), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_hello_timeout, ts_kill_leftover),
        cmocka_unit_test_teardown(test_idle_timeout, ts_kill_leftover),
        cmocka_unit_test_teardown(test_first_frame_is_small, ts_kill_leftover),
        cmocka_unit_test_teardown(test_connections_per_user, ts_kill_leftover),
        cmocka_unit_test_teardown(test_pipelined_requests_never_read, ts_kill_leftover),
        cmocka_unit_test_teardown(test_streams_and_keys_capped, ts_kill_leftover),
        cmocka_unit_test_teardown(test_unknown_keys_do_not_stall, ts_kill_leftover),
        cmocka_unit_test_teardown(test_exports_capped_per_user, ts_kill_leftover),
        cmocka_unit_test_teardown(test_logs_owner_or_root, ts_kill_leftover),
        cmocka_unit_test_teardown(test_client_strings, ts_kill_leftover),
        cmocka_unit_test_teardown(test_trainctl_escapes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_queue_per_user_and_info_bounded, ts_kill_leftover),
        cmocka_unit_test_teardown(test_queue_and_device_limits, ts_kill_leftover),
        cmocka_unit_test_teardown(test_config_with_nul_bytes, ts_kill_leftover),
        cmocka_unit_test_teardown(test_list_is_paged, ts_kill_leftover),
        cmocka_unit_test_teardown(test_logs_are_paged, ts_kill_leftover),
        cmocka_unit_test_teardown(test_errors_name_the_cause, ts_kill_leftover),
    };

    signal(SIGPIPE, SIG_IGN);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
