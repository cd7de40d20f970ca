/* Integration tests of traind as a service: each starts a real traind (TRAIND_BIN) the way
 * systemd would and checks what systemd and an operator see. The configuration file (every
 * kind of bad file exits 78 naming the file, line and key; flags override keys); the socket
 * (mode 0660 and the configured group whatever the umask, and who may connect); socket
 * activation (a listening socket passed as descriptor 3 with LISTEN_FDS/LISTEN_PID); the
 * notification protocol (READY=1 only once the socket serves, WATCHDOG=1 while healthy,
 * none while a busy worker's heartbeat is stale, STOPPING=1 at SIGTERM); the start's warning
 * when [cuda] nccl_timeout_s outlasts the watchdog; and `systemd-analyze verify` on the
 * generated units, when systemd-analyze exists.
 *
 * A stale heartbeat is made for real, not by a debug switch: under a 20 ms watchdog, a job
 * whose every step is ~250 GFLOP (an MLP 784-4096-4096-10 on batches of 2048) takes well over
 * 100 ms a step on any CPU, so the worker's heartbeat (set at each step's start and end)
 * goes stale inside every step, and the pings must stop until the job ends. */
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

#include "proto/proto.h"
#include "tests/support.h"

#define FMNIST            "/usr/share/datasets/fashion-mnist"
#define START_TIMEOUT_MS  60000   /* traind's start, up to READY=1 or a listening socket */
#define PINGS_DEADLINE_MS 60000   /* for 10 WATCHDOG=1 pings, which come every 10 ms unloaded */
#define EXIT_TIMEOUT_MS   60000   /* traind's exit after SIGTERM or a bad configuration */
#define WATCHDOG_USEC     "20000" /* the watchdog the notify test asks for: 20 ms */
#define WATCHDOG_MS       20      /* the same, in ms */
#define HEAVY_HIDDEN      4096    /* the slow job's hidden width: ~250 GFLOP a step... */
#define HEAVY_BATCH       2048    /* ...with this batch */
#define SOCK_LIMIT        107     /* bytes of a socket path, the kernel's sun_path less its NUL */
#define EX_CONFIG         78

/* A temporary directory with the paths a test's traind uses. */
typedef struct svc {
    char dir[128];
    char sock[256];
    char conf[256];
    char log[256];
    pid_t pid;
} svc;

/* What a spawned traind gets besides its arguments. */
typedef struct spawn_opts {
    const char *const *env; /* "NAME=value" to set, NULL-terminated; may be NULL */
    int listen_fd;          /* passed as descriptor 3 with LISTEN_FDS=1, or -1 */
    const char *listen_pid; /* LISTEN_PID to set instead of the child's own, or NULL */
    mode_t umask;
} spawn_opts;

static void svc_init(svc *s)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->dir, sizeof(s->dir), "/tmp/traind-svc.XXXXXX");
    assert_non_null(mkdtemp(s->dir));
    snprintf(s->sock, sizeof(s->sock), "%s/traind.sock", s->dir);
    snprintf(s->conf, sizeof(s->conf), "%s/traind.conf", s->dir);
    snprintf(s->log, sizeof(s->log), "%s/traind.log", s->dir);
    s->pid = -1;
}

/* Removes a test's directory once the test has passed; a failed test leaves it to read. */
static void svc_remove(const svc *s)
{
    char cmd[160];

    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
    assert_int_equal(system(cmd), 0);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

/* The whole of a small file, NUL-terminated; empty when it cannot be read. */
static void read_file(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    size_t n = 0;

    if (f != NULL) {
        n = fread(buf, 1, size - 1, f);
        fclose(f);
    }
    buf[n] = '\0';
}

/* In the child: sets the environment spawn_opts asks for, systemd's variables unset first so
 * that the test's own environment cannot leak into the daemon's. */
static void child_env(const spawn_opts *o)
{
    static const char *const sd_vars[] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                                          "LISTEN_FDS",    "LISTEN_PID",    "LISTEN_FDNAMES"};
    char buf[512];

    for (size_t i = 0; i < sizeof(sd_vars) / sizeof(sd_vars[0]); i++)
        unsetenv(sd_vars[i]);
    for (size_t i = 0; o->env != NULL && o->env[i] != NULL; i++) {
        const char *eq = strchr(o->env[i], '=');
        if (eq == NULL || (size_t)(eq - o->env[i]) >= sizeof(buf))
            _exit(125);
        memcpy(buf, o->env[i], (size_t)(eq - o->env[i]));
        buf[eq - o->env[i]] = '\0';
        setenv(buf, eq + 1, 1);
    }
    if (o->listen_fd >= 0) {
        snprintf(buf, sizeof(buf), "%ld", (long)getpid());
        setenv("LISTEN_FDS", "1", 1);
        setenv("LISTEN_PID", o->listen_pid != NULL ? o->listen_pid : buf, 1);
        if (o->listen_fd != 3) {
            if (dup2(o->listen_fd, 3) != 3)
                _exit(124);
            close(o->listen_fd);
        }
    }
}

/* Starts traind with args (NULL-terminated, after the binary); stderr goes to s->log. */
static void spawn_traind(svc *s, const char *const *args, const spawn_opts *o)
{
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    const char *argv[24];
    size_t n = 0;

    argv[n++] = bin;
    for (size_t i = 0; args[i] != NULL && n + 1 < sizeof(argv) / sizeof(argv[0]); i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    s->pid = fork();
    assert_true(s->pid >= 0);
    if (s->pid == 0) {
        if (freopen(s->log, "a", stderr) == NULL || freopen("/dev/null", "w", stdout) == NULL)
            _exit(126);
        umask(o->umask);
        child_env(o);
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    ts_live_pid = s->pid;
}

/* Waits for the child to exit and returns its wait status; fails the test on timeout. */
static int wait_exit(svc *s, int timeout_ms)
{
    long long until = ts_now_ms() + timeout_ms;
    int status = 0;

    for (;;) {
        pid_t r = waitpid(s->pid, &status, WNOHANG);
        if (r == s->pid)
            break;
        assert_int_equal(r, 0);
        if (ts_now_ms() > until)
            fail_msg("traind (pid %d) did not exit within %d ms", (int)s->pid, timeout_ms);
        usleep(10 * 1000);
    }
    ts_live_pid = -1;
    s->pid = -1;
    return status;
}

static int stop_traind(svc *s)
{
    kill(s->pid, SIGTERM);
    return wait_exit(s, EXIT_TIMEOUT_MS);
}

static void wait_listening(svc *s, const char *sock)
{
    for (long long until = ts_now_ms() + START_TIMEOUT_MS; ts_now_ms() < until;) {
        if (ts_can_connect(sock))
            return;
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
            char log[4096];
            ts_live_pid = s->pid = -1;
            read_file(s->log, log, sizeof(log));
            fail_msg("traind exited before listening on %s; its log:\n%s", sock, log);
        }
        usleep(20 * 1000);
    }
    fail_msg("traind did not listen on %s within %d ms", sock, START_TIMEOUT_MS);
}

/* Submits an MLP 784-hidden-10 on Fashion-MNIST, named name; with sticky_at > 0 its one
 * device meets an injected sticky CUDA error at that step. Returns the job id. */
static int64_t submit_job(ts_client *c, const char *name, int hidden, int batch, int64_t max_steps,
                          int sticky_at)
{
    ts_begin(c, "submit", 1);
    td_pw_str(&c->w, "job");
    td_pw_map(&c->w, sticky_at > 0 ? 6 : 5);
    td_pw_str(&c->w, "name");
    td_pw_str(&c->w, name);
    td_pw_str(&c->w, "model");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "mlp");
    td_pw_str(&c->w, "layers");
    td_pw_array(&c->w, hidden == HEAVY_HIDDEN ? 4 : 3);
    td_pw_int(&c->w, 784);
    td_pw_int(&c->w, hidden);
    if (hidden == HEAVY_HIDDEN)
        td_pw_int(&c->w, hidden);
    td_pw_int(&c->w, 10);
    td_pw_str(&c->w, "data");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "kind");
    td_pw_str(&c->w, "idx");
    td_pw_str(&c->w, "train");
    td_pw_map(&c->w, 2);
    td_pw_str(&c->w, "images");
    td_pw_str(&c->w, FMNIST "/train-images-idx3-ubyte.gz");
    td_pw_str(&c->w, "labels");
    td_pw_str(&c->w, FMNIST "/train-labels-idx1-ubyte.gz");
    td_pw_str(&c->w, "batch_size");
    td_pw_int(&c->w, batch);
    td_pw_str(&c->w, "max_steps");
    td_pw_int(&c->w, max_steps);
    if (sticky_at > 0) {
        td_pw_str(&c->w, "debug");
        td_pw_map(&c->w, 1);
        td_pw_str(&c->w, "fail");
        td_pw_map(&c->w, 2);
        td_pw_str(&c->w, "step");
        td_pw_int(&c->w, sticky_at);
        td_pw_str(&c->w, "kind");
        td_pw_str(&c->w, "sticky");
    }
    ts_client_send(c);
    return ts_submitted(c);
}

static int64_t submit(ts_client *c, int hidden, int batch, int64_t max_steps)
{
    return submit_job(c, "service-test", hidden, batch, max_steps, 0);
}

/* Cancels job id; fails the test unless traind answers that it is cancelled. */
static void cancel(ts_client *c, int64_t id)
{
    td_proto_frame *f;

    ts_send_job_request(c, "cancel", id);
    f = ts_client_recv(c);
    assert_non_null(f);
    assert_true(ts_str_is(td_pv_get(td_proto_frame_root(f), "type"), "cancelled"));
    td_proto_frame_free(f);
}

/* Waits until job id has completed at least one step while running; fails on timeout. */
static void wait_running_step(ts_client *c, int64_t id, int timeout_s)
{
    char state[32];

    for (long long until = ts_now_ms() + timeout_s * 1000LL; ts_now_ms() < until;) {
        int64_t step = ts_job_status(c, id, state, sizeof(state));
        if (strcmp(state, "running") == 0 && step >= 1)
            return;
        if (strcmp(state, "running") != 0 && strcmp(state, "queued") != 0)
            fail_msg("job %lld ended (%s) before its first step", (long long)id, state);
        usleep(50 * 1000);
    }
    fail_msg("job %lld did not complete a step within %d s", (long long)id, timeout_s);
}

/* ---- the notification socket, as systemd holds it ---- */

/* A datagram socket bound at name: a path, or an abstract name given with a leading '@'. */
static int notify_listen(const char *name)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(name);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);

    assert_true(fd >= 0);
    assert_true(len < sizeof(sa.sun_path));
    memcpy(sa.sun_path, name, len);
    if (name[0] == '@')
        sa.sun_path[0] = '\0';
    assert_int_equal(
        bind(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)),
        0);
    return fd;
}

/* The next datagram within timeout_ms into buf, NUL-terminated; 0 on timeout. */
static int notify_recv(int fd, char *buf, size_t size, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    ssize_t n;

    if (poll(&p, 1, timeout_ms < 0 ? 0 : timeout_ms) <= 0)
        return 0;
    n = recv(fd, buf, size - 1, 0);
    assert_true(n >= 0);
    buf[n] = '\0';
    return 1;
}

/* Whether msg holds line as one of its "\n"-separated lines. */
static int has_line(const char *msg, const char *line)
{
    size_t n = strlen(line);

    for (const char *p = msg; p != NULL; p = strchr(p, '\n') != NULL ? strchr(p, '\n') + 1 : NULL)
        if (strncmp(p, line, n) == 0 && (p[n] == '\n' || p[n] == '\0'))
            return 1;
    return 0;
}

/* Reads datagrams until one holds line; its text goes to out. 0 when none did in time. */
static int notify_wait_for(int fd, const char *line, int timeout_ms, char *out, size_t size)
{
    char buf[1024];

    for (long long until = ts_now_ms() + timeout_ms; ts_now_ms() < until;)
        if (notify_recv(fd, buf, sizeof(buf), (int)(until - ts_now_ms())) && has_line(buf, line)) {
            if (out != NULL)
                snprintf(out, size, "%s", buf);
            return 1;
        }
    return 0;
}

/* Throws away what was sent so far: a measurement starts from now. */
static void notify_drain(int fd)
{
    char buf[1024];
    while (notify_recv(fd, buf, sizeof(buf), 0))
        ;
}

/* Counts WATCHDOG=1 datagrams from now until want have come or ms have passed: a deadline, so
 * that a loaded box that holds some pings back is not taken for one that stopped them. */
static int watchdog_count(int fd, int want, int ms)
{
    char buf[1024];
    int n = 0;

    notify_drain(fd);
    for (long long until = ts_now_ms() + ms; n < want && ts_now_ms() < until;)
        if (notify_recv(fd, buf, sizeof(buf), (int)(until - ts_now_ms())))
            n += has_line(buf, "WATCHDOG=1");
    return n;
}

/* Watches for up to ms and returns the longest silence (no WATCHDOG=1) seen, stopping as
 * soon as one lasts want ms. */
static long long watchdog_longest_gap(int fd, int ms, int want)
{
    char buf[1024];
    long long last, longest = 0, until;

    notify_drain(fd);
    last = ts_now_ms();
    until = last + ms;
    while (ts_now_ms() < until && longest < want) {
        int got = notify_recv(fd, buf, sizeof(buf), 10);
        long long t = ts_now_ms();
        if (t - last > longest)
            longest = t - last;
        if (got && has_line(buf, "WATCHDOG=1"))
            last = t;
    }
    return longest;
}

/* ---- configuration ---- */

/* Runs traind on a configuration file holding text (plus args) and checks it exits 78 with
 * want in its log. A "%s" in want is replaced by the file's path. */
static void expect_config_error(const char *text, const char *const *args, const char *want)
{
    spawn_opts o = {.listen_fd = -1, .umask = 022};
    const char *argv[12];
    char expected[512], log[8192], state[300];
    const char *pct;
    svc s;
    int status, n = 0;

    svc_init(&s);
    snprintf(state, sizeof(state), "%s/state", s.dir);
    if (text != NULL)
        write_file(s.conf, text);
    argv[n++] = "--config";
    argv[n++] = s.conf;
    argv[n++] = "--state-dir";
    argv[n++] = state;
    for (size_t i = 0; args != NULL && args[i] != NULL; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    spawn_traind(&s, argv, &o);
    status = wait_exit(&s, EXIT_TIMEOUT_MS);
    read_file(s.log, log, sizeof(log));
    /* Replaced by hand, not by using want as a format: -Wformat=2 wants literal formats. */
    pct = strstr(want, "%s");
    if (pct == NULL)
        snprintf(expected, sizeof(expected), "%s", want);
    else
        snprintf(expected, sizeof(expected), "%.*s%s%s", (int)(pct - want), want, s.conf, pct + 2);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != EX_CONFIG)
        fail_msg("expected exit %d for\n%s\ngot status 0x%x; log:\n%s", EX_CONFIG,
                 text != NULL ? text : "(no file)", status, log);
    if (strstr(log, expected) == NULL)
        fail_msg("expected \"%s\" in traind's log; got:\n%s", expected, log);
    /* It stops before it binds or creates anything. */
    assert_false(ts_can_connect(s.sock));
    svc_remove(&s);
}

static void test_config_errors(void **state)
{
    char long_socket[256], text[512], long_line[512];
    const char *long_flag[] = {"--socket", long_socket, NULL};

    expect_config_error("[daemon]\n# a comment\nsokcet = /tmp/x.sock\n", NULL,
                        "traind: %s:3: unknown key \"sokcet\" in [daemon]");
    expect_config_error("[daemon]\ndevices = gpu:2\n", NULL,
                        "traind: %s:2: bad value \"gpu:2\" for key \"devices\" in [daemon]: "
                        "expected cpu:N with N from 1 to 64");
    expect_config_error("[daemon]\nlog_level = loud\n", NULL,
                        "%s:2: bad value \"loud\" for key \"log_level\" in [daemon]");
    expect_config_error("[limits]\nmax_queued_per_user = -1\n", NULL,
                        "%s:2: bad value \"-1\" for key \"max_queued_per_user\" in [limits]");
    expect_config_error("[limits]\nmax_connections = lots\n", NULL,
                        "%s:2: bad value \"lots\" for key \"max_connections\" in [limits]");
    expect_config_error("[limits]\nmax_devices_per_user = 65\n", NULL,
                        "%s:2: bad value \"65\" for key \"max_devices_per_user\" in [limits]");
    expect_config_error("[daemon]\nsocket_group = traind-test-no-such-group\n", NULL,
                        "%s:2: bad value \"traind-test-no-such-group\" for key "
                        "\"socket_group\" in [daemon]: no such group");
    expect_config_error("[daemon]\ndevices = cuda:1,1\n", NULL,
                        "%s:2: bad value \"cuda:1,1\" for key \"devices\" in [daemon]: ");
    expect_config_error("[cuda]\nnccl_timeout_s = 0\n", NULL,
                        "%s:2: bad value \"0\" for key \"nccl_timeout_s\" in [cuda]: expected a "
                        "number above 0");
    expect_config_error("[gpu]\ncount = 2\n", NULL, "%s:2: unknown section [gpu]");
    expect_config_error("socket = /tmp/x.sock\n", NULL,
                        "%s:1: key \"socket\" is outside any section");
    expect_config_error("[daemon]\nthis line is not ini\n", NULL, "%s:2: syntax error");
    /* The first error is the one reported, whichever kind it is. */
    expect_config_error("[daemon]\nnot ini\nsokcet = 1\n", NULL, "%s:2: syntax error");
    expect_config_error("[daemon]\nsokcet = 1\nnot ini\n", NULL,
                        "%s:2: unknown key \"sokcet\" in [daemon]");
    memset(long_line, 'x', 300);
    long_line[0] = '#';
    snprintf(long_line + 300, sizeof(long_line) - 300, "\n[daemon]\n");
    expect_config_error(long_line, NULL, "%s:1: the line is longer than");

    /* A socket path the kernel cannot hold (108 bytes and more), in the file or a flag. */
    memset(long_socket, 'a', sizeof(long_socket));
    memcpy(long_socket, "/tmp/", 5);
    long_socket[SOCK_LIMIT + 1] = '\0';
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\n", long_socket);
    expect_config_error(text, NULL,
                        "%s:2: bad value \"/tmp/aaa"); /* the rest: "...the limit is 107" */
    expect_config_error(text, NULL, "the path is 108 bytes; the limit is 107");
    expect_config_error("[daemon]\n", long_flag, "is 108 bytes; the limit is 107");

    /* A file named by --config must exist; the default one need not. */
    expect_config_error(NULL, NULL, "traind: %s: cannot open: No such file or directory");
}

/* Keys apply, and a flag overrides the key it names. */
static void test_config_applies_and_flags_override(void **state)
{
    spawn_opts o = {.listen_fd = -1, .umask = 022};
    char text[1024], other[300], db[300];
    const char *args[] = {"--config", NULL, NULL, NULL, NULL};
    struct stat st;
    svc s;

    svc_init(&s);
    snprintf(other, sizeof(other), "%s/flag.sock", s.dir);
    snprintf(db, sizeof(db), "%s/state/traind.db", s.dir);
    snprintf(text, sizeof(text),
             "; traind test configuration\n"
             "[daemon]\n"
             "socket = %s\n"
             "state_dir = %s/state\n"
             "devices = cpu:2 ; two workers\n"
             "log_level = debug\n"
             "socket_group =\n"
             "[limits]\n"
             "max_connections = 16\n"
             "max_queued = 100\n"
             "max_queued_per_user = 10\n"
             "max_devices_per_user = 1\n",
             s.sock, s.dir);
    write_file(s.conf, text);
    args[1] = s.conf;
    spawn_traind(&s, args, &o);
    wait_listening(&s, s.sock);
    assert_int_equal(stat(db, &st), 0);
    assert_int_equal(stop_traind(&s), 0);

    args[2] = "--socket";
    args[3] = other;
    spawn_traind(&s, args, &o);
    wait_listening(&s, other);
    assert_false(ts_can_connect(s.sock));
    assert_int_equal(stop_traind(&s), 0);
    /* A socket traind bound itself is gone once it has stopped. */
    assert_int_not_equal(stat(other, &st), 0);
    svc_remove(&s);
}

/* ---- the socket's mode, group and who may connect ---- */

/* A group to give the socket: one the test may chown to (any, as root; else one of its own
 * supplementary groups) other than its own primary group. Returns -1 when there is none. */
static gid_t pick_group(char *name, size_t size)
{
    static const char *const candidates[] = {"daemon", "adm", "users", "sys", "bin", "staff"};
    gid_t groups[256];
    int n;

    if (geteuid() == 0) {
        for (size_t i = 0; i < sizeof(candidates) / sizeof(candidates[0]); i++) {
            struct group *g = getgrnam(candidates[i]);
            if (g != NULL && g->gr_gid != getegid()) {
                snprintf(name, size, "%s", g->gr_name);
                return g->gr_gid;
            }
        }
    }
    n = getgroups(256, groups);
    for (int i = 0; i < n; i++)
        if (groups[i] != getegid()) {
            snprintf(name, size, "%u", (unsigned)groups[i]);
            return groups[i];
        }
    return (gid_t)-1;
}

/* In a child running as uid/gid with the given supplementary groups, connects to sock:
 * 0 when it could, 1 when refused with EACCES, 2 for any other failure. */
static int connects_as(const char *sock, uid_t uid, gid_t gid, const gid_t *groups, int n)
{
    pid_t pid = fork();
    int status;

    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgroups((size_t)n, groups) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(3);
        _exit(ts_can_connect(sock) ? 0 : (errno == EACCES ? 1 : 2));
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_not_equal(WEXITSTATUS(status), 3);
    return WEXITSTATUS(status);
}

static void test_socket_mode_and_group(void **state)
{
    static const mode_t umasks[] = {0, 077};
    spawn_opts o = {.listen_fd = -1};
    char group[64], text[600];
    const char *args[] = {"--config", NULL, NULL};
    struct stat st;
    gid_t gid = pick_group(group, sizeof(group));
    svc s;

    if (gid == (gid_t)-1) {
        print_message("no group to give the socket (not root, no supplementary group): "
                      "skipped\n");
        skip();
    }
    for (size_t i = 0; i < sizeof(umasks) / sizeof(umasks[0]); i++) {
        svc_init(&s);
        snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\nsocket_group = %s\n",
                 s.sock, s.dir, group);
        write_file(s.conf, text);
        args[1] = s.conf;
        o.umask = umasks[i];
        spawn_traind(&s, args, &o);
        wait_listening(&s, s.sock);
        assert_int_equal(stat(s.sock, &st), 0);
        assert_true(S_ISSOCK(st.st_mode));
        if ((st.st_mode & 07777) != 0660)
            fail_msg("socket mode %04o under umask %03o; want 0660", st.st_mode & 07777, umasks[i]);
        assert_int_equal(st.st_gid, gid);

        /* As root: a user outside the group is refused, the same user in the group is not. */
        if (geteuid() == 0 && i == 0) {
            struct passwd *nobody = getpwnam("nobody");
            gid_t in_group[1] = {gid};
            if (nobody != NULL && nobody->pw_gid != gid) {
                assert_int_equal(chmod(s.dir, 0711), 0);
                assert_int_equal(connects_as(s.sock, nobody->pw_uid, nobody->pw_gid, NULL, 0), 1);
                assert_int_equal(connects_as(s.sock, nobody->pw_uid, nobody->pw_gid, in_group, 1),
                                 0);
            }
        }
        assert_int_equal(stop_traind(&s), 0);
        svc_remove(&s);
    }
}

/* ---- another user: owner checks and dataset access ---- */

/* One request as whoever runs this (a forked child that dropped to another user): no cmocka
 * asserts here, since a failing one would unwind into the parent's copy of the test runner.
 * Sends hello, then the request built by build(), and copies the reply's "type" and
 * "message" (or the JOB count of a list). Returns 0, or a non-zero step number. */
typedef void (*build_fn)(td_pw *w, void *ud);

static int raw_request(const char *sock, build_fn build, void *ud, char *type, char *msg,
                       size_t size, size_t *njobs)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    td_proto_reader *r = NULL;
    td_proto_frame *f = NULL;
    td_error_t err;
    td_pw w;
    const char *frame;
    size_t len;
    char buf[65536];
    int fd, got = 0;

    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        return 1;
    if (td_proto_reader_new(&r, 0) != 0)
        return 2;
    td_pw_init(&w);
    td_pw_map(&w, 3);
    td_pw_str(&w, "type");
    td_pw_str(&w, "hello");
    td_pw_str(&w, "id");
    td_pw_int(&w, 1);
    td_pw_str(&w, "version");
    td_pw_int(&w, TD_PROTO_VERSION);
    if (td_pw_finish(&w, &frame, &len) != 0 || write(fd, frame, len) != (ssize_t)len)
        return 3;
    td_pw_reset(&w);
    build(&w, ud);
    if (td_pw_finish(&w, &frame, &len) != 0 || write(fd, frame, len) != (ssize_t)len)
        return 4;
    while (got < 2) {
        int rc = td_proto_reader_next(r, &f, &err);
        if (rc < 0)
            return 5;
        if (rc == 1) {
            if (++got == 2) {
                const td_pval *root = td_proto_frame_root(f);
                td_pv_strcpy(td_pv_get(root, "type"), type, 32);
                msg[0] = '\0';
                td_pv_strcpy(td_pv_get(root, "message"), msg, size);
                *njobs = td_pv_len(td_pv_get(root, "jobs"));
            }
            td_proto_frame_free(f);
            continue;
        }
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n <= 0 || td_proto_reader_feed(r, buf, (size_t)n) != 0)
            return 6;
    }
    td_pw_free(&w);
    td_proto_reader_free(r);
    close(fd);
    return 0;
}

static void build_list(td_pw *w, void *ud)
{
    td_pw_map(w, 2);
    td_pw_str(w, "type");
    td_pw_str(w, "list");
    td_pw_str(w, "id");
    td_pw_int(w, 2);
}

static void build_cancel(td_pw *w, void *ud)
{
    td_pw_map(w, 3);
    td_pw_str(w, "type");
    td_pw_str(w, "cancel");
    td_pw_str(w, "id");
    td_pw_int(w, 2);
    td_pw_str(w, "job_id");
    td_pw_int(w, *(int64_t *)ud);
}

/* A job whose training images are the given path (labels are Fashion-MNIST's). */
static void build_submit_private(td_pw *w, void *ud)
{
    td_pw_map(w, 3);
    td_pw_str(w, "type");
    td_pw_str(w, "submit");
    td_pw_str(w, "id");
    td_pw_int(w, 2);
    td_pw_str(w, "job");
    td_pw_map(w, 2);
    td_pw_str(w, "model");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "mlp");
    td_pw_str(w, "layers");
    td_pw_array(w, 2);
    td_pw_int(w, 784);
    td_pw_int(w, 10);
    td_pw_str(w, "data");
    td_pw_map(w, 2);
    td_pw_str(w, "kind");
    td_pw_str(w, "idx");
    td_pw_str(w, "train");
    td_pw_map(w, 2);
    td_pw_str(w, "images");
    td_pw_str(w, (const char *)ud);
    td_pw_str(w, "labels");
    td_pw_str(w, FMNIST "/train-labels-idx1-ubyte.gz");
}

typedef struct as_other {
    const char *sock;
    int64_t job;
    const char *private_path;
    char want_cancel[160];
    char want_submit[600];
} as_other;

/* The checks another user makes, in a child: exit 0 when all held, else the failed step. */
static int other_user_checks(const as_other *o)
{
    char type[32], msg[1024];
    size_t njobs = 0;
    int64_t job = o->job;

    if (raw_request(o->sock, build_list, NULL, type, msg, sizeof(msg), &njobs) != 0 ||
        strcmp(type, "jobs") != 0 || njobs < 1)
        return 10;
    if (raw_request(o->sock, build_cancel, &job, type, msg, sizeof(msg), &njobs) != 0 ||
        strcmp(type, "error") != 0 || strcmp(msg, o->want_cancel) != 0) {
        fprintf(stderr, "cancel as another user: got %s \"%s\"\n", type, msg);
        return 11;
    }
    if (raw_request(o->sock, build_submit_private, (void *)o->private_path, type, msg, sizeof(msg),
                    &njobs) != 0 ||
        strcmp(type, "error") != 0 || strcmp(msg, o->want_submit) != 0) {
        fprintf(stderr, "private dataset as another user: got %s \"%s\"\n", type, msg);
        return 12;
    }
    return 0;
}

/* As root: another user in the socket's group lists root's jobs but cannot cancel them
 * (named owner), and cannot make the daemon read a file it could not read itself. */
static void test_other_user_owner_and_access(void **state)
{
    spawn_opts o = {.listen_fd = -1};
    char group[64], text[600], private_dir[200], private_path[240];
    const char *args[] = {"--config", NULL, NULL};
    gid_t gid = pick_group(group, sizeof(group));
    struct passwd *nobody = getpwnam("nobody");
    as_other a;
    ts_client c;
    pid_t pid;
    int status;
    svc s;

    if (geteuid() != 0 || gid == (gid_t)-1 || nobody == NULL) {
        print_message("needs root, a spare group and the nobody user: skipped\n");
        skip();
    }
    svc_init(&s);
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\nsocket_group = %s\n",
             s.sock, s.dir, group);
    write_file(s.conf, text);
    args[1] = s.conf;
    spawn_traind(&s, args, &o);
    wait_listening(&s, s.sock);
    assert_int_equal(chmod(s.dir, 0711), 0);
    snprintf(private_dir, sizeof(private_dir), "%s/private", s.dir);
    assert_int_equal(mkdir(private_dir, 0700), 0);
    snprintf(private_path, sizeof(private_path), "%s/images.gz", private_dir);
    write_file(private_path, "not for nobody");

    ts_connect_hello(&c, s.sock);
    a = (as_other){.sock = s.sock, .private_path = private_path};
    a.job = submit(&c, 32, 64, 1000000);
    snprintf(a.want_cancel, sizeof(a.want_cancel), "permission denied: job %lld belongs to root",
             (long long)a.job);
    snprintf(a.want_submit, sizeof(a.want_submit),
             "data.train.images: permission denied: uid %u cannot read %s",
             (unsigned)nobody->pw_uid, private_path);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        gid_t in_group[1] = {gid};
        if (setgroups(1, in_group) != 0 || setgid(nobody->pw_gid) != 0 ||
            setuid(nobody->pw_uid) != 0)
            _exit(3);
        _exit(other_user_checks(&a));
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* Its owner may cancel it. */
    cancel(&c, a.job);
    ts_client_close(&c);
    assert_int_equal(stop_traind(&s), 0);
    svc_remove(&s);
}

/* ---- socket activation ---- */

static int listen_at(const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);

    assert_true(fd >= 0);
    assert_true(strlen(path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(fd, 16), 0);
    return fd;
}

static void test_socket_activation(void **state)
{
    spawn_opts o = {.umask = 022};
    char activated[300], text[600], log[8192];
    const char *args[] = {"--config", NULL, NULL};
    struct stat st;
    ts_client c;
    svc s;
    int lfd, fd;

    svc_init(&s);
    snprintf(activated, sizeof(activated), "%s/activated.sock", s.dir);
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\n", s.sock, s.dir);
    write_file(s.conf, text);
    args[1] = s.conf;
    lfd = listen_at(activated);

    /* Twice on the same socket, as systemd restarts a service: traind serves on what it was
     * passed, never binds its configured path, and leaves the passed one in place. */
    for (int round = 0; round < 2; round++) {
        o.listen_fd = lfd;
        spawn_traind(&s, args, &o);
        ts_connect_hello(&c, activated);
        ts_client_close(&c);
        assert_int_not_equal(stat(s.sock, &st), 0);
        assert_int_equal(stop_traind(&s), 0);
        assert_int_equal(stat(activated, &st), 0);
    }
    read_file(s.log, log, sizeof(log));
    assert_non_null(strstr(log, "socket activation: listening on"));

    /* LISTEN_PID names another process: the variables are not for traind, which binds its
     * own socket. */
    o.listen_fd = lfd;
    o.listen_pid = "1";
    spawn_traind(&s, args, &o);
    wait_listening(&s, s.sock);
    assert_int_equal(stop_traind(&s), 0);
    close(lfd);

    /* Descriptor 3 is not a listening socket: refused with a message, exit 1. */
    fd = open("/dev/null", O_RDONLY);
    assert_true(fd >= 0);
    o.listen_fd = fd;
    o.listen_pid = NULL;
    spawn_traind(&s, args, &o);
    close(fd);
    assert_int_equal(WEXITSTATUS(wait_exit(&s, EXIT_TIMEOUT_MS)), 1);
    read_file(s.log, log, sizeof(log));
    assert_non_null(strstr(log, "LISTEN_FDS=1: descriptor 3 is not a listening Unix stream "
                                "socket"));
    svc_remove(&s);
}

/* --devices cuda:all on a box without a GPU (or a build without CUDA) refuses to start with
 * a message saying why, before it binds anything. On a box with GPUs it starts, and its start
 * line lists them. */
static void test_cuda_devices_without_gpu(void **state)
{
    spawn_opts o = {.listen_fd = -1, .umask = 022};
    const char *args[] = {"--config", NULL,        "--socket", NULL, "--state-dir",
                          NULL,       "--devices", "cuda:all", NULL};
    char log[8192];
    int status = 0, exited = 0;
    svc s;

    svc_init(&s);
    write_file(s.conf, "");
    args[1] = s.conf;
    args[3] = s.sock;
    args[5] = s.dir;
    spawn_traind(&s, args, &o);
    for (long long until = ts_now_ms() + START_TIMEOUT_MS; ts_now_ms() < until && !exited;) {
        if (waitpid(s.pid, &status, WNOHANG) == s.pid)
            exited = 1;
        else if (ts_can_connect(s.sock))
            break;
        else
            usleep(20 * 1000);
    }
    if (exited) {
        ts_live_pid = s.pid = -1;
        read_file(s.log, log, sizeof(log));
        if (strstr(log, "this traind was built without CUDA") != NULL) {
            assert_int_equal(WEXITSTATUS(status), 64); /* a flag this build cannot honour */
        } else {
            assert_int_equal(WEXITSTATUS(status), 1);
            if (strstr(log, "cannot start: --devices cuda:all: no CUDA device is visible") == NULL)
                fail_msg("expected the reason in traind's log; got:\n%s", log);
        }
        assert_false(ts_can_connect(s.sock));
    } else {
        /* A GPU box: every GPU is a device, named in the start line. */
        assert_true(ts_can_connect(s.sock));
        assert_int_equal(stop_traind(&s), 0);
        read_file(s.log, log, sizeof(log));
        assert_non_null(strstr(log, "device(s): cuda:0"));
    }
    svc_remove(&s);
}

/* A sticky CUDA error re-executes traind in place: systemd is told RELOADING=1, then READY=1
 * by the same pid, and the socket systemd passed (LISTEN_FDS) serves again in the new
 * process, which it took over rather than binding its own. */
static void test_sticky_reexec_keeps_passed_socket(void **state)
{
    char notify_path[300], notify_env[340], activated[300], text[600], msg[1024];
    const char *env[] = {notify_env, NULL};
    const char *args[] = {"--config", NULL, NULL};
    spawn_opts o = {.env = env, .umask = 022};
    const td_pval *job;
    td_proto_frame *f;
    struct stat st;
    ts_client c;
    int64_t id;
    svc s;
    int nfd, lfd;

    if (access(FMNIST "/train-images-idx3-ubyte.gz", R_OK) != 0) {
        print_message("%s missing (scripts/deps.sh installs it): skipped\n", FMNIST);
        skip();
    }
    svc_init(&s);
    snprintf(notify_path, sizeof(notify_path), "%s/notify", s.dir);
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", notify_path);
    snprintf(activated, sizeof(activated), "%s/activated.sock", s.dir);
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\n", s.sock, s.dir);
    write_file(s.conf, text);
    args[1] = s.conf;
    nfd = notify_listen(notify_path);
    lfd = listen_at(activated);
    o.listen_fd = lfd;
    spawn_traind(&s, args, &o);
    if (!notify_wait_for(nfd, "READY=1", START_TIMEOUT_MS, msg, sizeof(msg)))
        fail_msg("no READY=1 within %d ms", START_TIMEOUT_MS);
    ts_connect_hello(&c, activated);
    id = submit_job(&c, "sticky", 32, 128, 50, 2);
    if (!notify_wait_for(nfd, "RELOADING=1", 60000, msg, sizeof(msg)))
        fail_msg("no RELOADING=1 after the sticky error");
    assert_non_null(strstr(msg, "STATUS=re-executing after a sticky CUDA error in job"));
    assert_non_null(strstr(msg, "MONOTONIC_USEC="));
    if (!notify_wait_for(nfd, "READY=1", START_TIMEOUT_MS, msg, sizeof(msg)))
        fail_msg("no READY=1 from the re-executed traind");
    assert_non_null(strstr(msg, "re-executed"));
    assert_int_equal(waitpid(s.pid, NULL, WNOHANG), 0); /* the same process */
    ts_client_close(&c);
    ts_connect_hello(&c, activated);
    f = ts_status(&c, id, &job);
    assert_true(ts_str_is(td_pv_get(job, "state"), "failed"));
    td_proto_frame_free(f);
    ts_client_close(&c);
    assert_int_not_equal(stat(s.sock, &st), 0); /* it never bound its own */
    assert_int_equal(stop_traind(&s), 0);
    assert_int_equal(stat(activated, &st), 0);
    close(lfd);
    close(nfd);
    svc_remove(&s);
}

/* ---- the notification protocol ---- */

/* READY=1 once the socket serves; WATCHDOG=1 every half interval while healthy, also while a
 * job with quick steps runs; none while a step outlasts the interval; again once that job
 * ended; STOPPING=1 at SIGTERM. */
static void test_notify_ready_watchdog_stopping(void **state)
{
    char notify_path[300], notify_env[340], text[600], msg[1024];
    const char *env[] = {notify_env, "WATCHDOG_USEC=" WATCHDOG_USEC, NULL};
    const char *args[] = {"--config", NULL, NULL};
    spawn_opts o = {.env = env, .listen_fd = -1, .umask = 022};
    long long gap;
    ts_client c;
    int64_t id;
    svc s;
    int nfd, n;

    if (access(FMNIST "/train-images-idx3-ubyte.gz", R_OK) != 0) {
        print_message("%s missing (scripts/deps.sh installs it): skipped\n", FMNIST);
        skip();
    }
    svc_init(&s);
    snprintf(notify_path, sizeof(notify_path), "%s/notify", s.dir);
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", notify_path);
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\n", s.sock, s.dir);
    write_file(s.conf, text);
    args[1] = s.conf;
    nfd = notify_listen(notify_path);
    spawn_traind(&s, args, &o);

    /* READY=1 means the socket serves at that moment: no polling for it first. */
    if (!notify_wait_for(nfd, "READY=1", START_TIMEOUT_MS, msg, sizeof(msg)))
        fail_msg("no READY=1 within %d ms", START_TIMEOUT_MS);
    assert_true(ts_can_connect(s.sock));
    assert_non_null(strstr(msg, "STATUS=listening on "));
    ts_connect_hello(&c, s.sock);

    /* Idle: a ping every 10 ms. A loaded box may hold some back; they must go on. */
    n = watchdog_count(nfd, 10, PINGS_DEADLINE_MS);
    if (n < 10)
        fail_msg("only %d WATCHDOG=1 in %d ms with a %d ms watchdog", n, PINGS_DEADLINE_MS,
                 WATCHDOG_MS);

    /* A job with quick steps keeps its heartbeat fresh: the pings go on while it trains. */
    id = submit(&c, 32, 32, 1000000);
    wait_running_step(&c, id, 120);
    n = watchdog_count(nfd, 10, PINGS_DEADLINE_MS);
    if (n < 10)
        fail_msg("only %d WATCHDOG=1 in %d ms while a job with quick steps ran", n,
                 PINGS_DEADLINE_MS);
    cancel(&c, id);

    /* A job whose every step outlasts the interval: the pings stop during its steps. */
    id = submit(&c, HEAVY_HIDDEN, HEAVY_BATCH, 1000000);
    wait_running_step(&c, id, 300);
    gap = watchdog_longest_gap(nfd, 60000, 5 * WATCHDOG_MS);
    if (gap < 5 * WATCHDOG_MS)
        fail_msg("WATCHDOG=1 never paused for %d ms while a step outlasted the %d ms watchdog "
                 "(longest silence %lld ms)",
                 5 * WATCHDOG_MS, WATCHDOG_MS, gap);
    /* Once the job has ended, the idle worker has nothing to prove: the pings come back. */
    cancel(&c, id);
    ts_wait_state(&c, id, "cancelled", 300);
    n = watchdog_count(nfd, 10, PINGS_DEADLINE_MS);
    if (n < 10)
        fail_msg("only %d WATCHDOG=1 in %d ms after the slow job ended", n, PINGS_DEADLINE_MS);
    ts_client_close(&c);

    kill(s.pid, SIGTERM);
    if (!notify_wait_for(nfd, "STOPPING=1", EXIT_TIMEOUT_MS, NULL, 0))
        fail_msg("no STOPPING=1 after SIGTERM");
    assert_int_equal(wait_exit(&s, EXIT_TIMEOUT_MS), 0);
    close(nfd);
    svc_remove(&s);
}

/* NOTIFY_SOCKET may name an abstract socket ("@name"); a watchdog meant for another pid
 * (WATCHDOG_PID) is not fed. */
static void test_notify_abstract_socket(void **state)
{
    char name[64], notify_env[96], text[600], buf[1024];
    const char *env[] = {notify_env, "WATCHDOG_USEC=" WATCHDOG_USEC, "WATCHDOG_PID=1", NULL};
    const char *args[] = {"--config", NULL, NULL};
    spawn_opts o = {.env = env, .listen_fd = -1, .umask = 022};
    svc s;
    int nfd, pings = 0;

    svc_init(&s);
    snprintf(name, sizeof(name), "@traind-test-notify-%ld", (long)getpid());
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", name);
    snprintf(text, sizeof(text), "[daemon]\nsocket = %s\nstate_dir = %s\n", s.sock, s.dir);
    write_file(s.conf, text);
    args[1] = s.conf;
    nfd = notify_listen(name);
    spawn_traind(&s, args, &o);
    if (!notify_wait_for(nfd, "READY=1", START_TIMEOUT_MS, NULL, 0))
        fail_msg("no READY=1 on the abstract socket %s", name);
    for (long long until = ts_now_ms() + 300; ts_now_ms() < until;)
        if (notify_recv(nfd, buf, sizeof(buf), (int)(until - ts_now_ms())))
            pings += has_line(buf, "WATCHDOG=1");
    assert_int_equal(pings, 0);
    assert_int_equal(stop_traind(&s), 0);
    close(nfd);
    svc_remove(&s);
}

/* Starts a cuda:all traind under a systemd watchdog of watchdog_usec (for pid watchdog_pid,
 * when not NULL) with [cuda] nccl_timeout_s = nccl_s, and puts its log in log once it has
 * exited (no GPU) or served and been stopped (a GPU box). Returns 0, or -1 when this build
 * has no CUDA and refused the flag. */
static int start_under_watchdog(const char *watchdog_usec, const char *watchdog_pid, int nccl_s,
                                char *log, size_t size)
{
    char notify_path[300], notify_env[340], usec_env[64], pid_env[64], text[700];
    const char *env[] = {notify_env, usec_env, watchdog_pid != NULL ? pid_env : NULL, NULL};
    const char *args[] = {"--config", NULL, "--devices", "cuda:all", NULL};
    spawn_opts o = {.env = env, .listen_fd = -1, .umask = 022};
    int status = 0, exited = 0, nfd;
    svc s;

    svc_init(&s);
    snprintf(notify_path, sizeof(notify_path), "%s/notify", s.dir);
    snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", notify_path);
    snprintf(usec_env, sizeof(usec_env), "WATCHDOG_USEC=%s", watchdog_usec);
    snprintf(pid_env, sizeof(pid_env), "WATCHDOG_PID=%s", watchdog_pid != NULL ? watchdog_pid : "");
    snprintf(text, sizeof(text),
             "[daemon]\nsocket = %s\nstate_dir = %s\n[cuda]\nnccl_timeout_s = %d\n", s.sock, s.dir,
             nccl_s);
    write_file(s.conf, text);
    args[1] = s.conf;
    nfd = notify_listen(notify_path);
    spawn_traind(&s, args, &o);
    for (long long until = ts_now_ms() + START_TIMEOUT_MS; ts_now_ms() < until && !exited;) {
        if (waitpid(s.pid, &status, WNOHANG) == s.pid)
            exited = 1;
        else if (ts_can_connect(s.sock))
            break;
        else
            usleep(20 * 1000);
    }
    if (exited)
        ts_live_pid = s.pid = -1;
    else if (!ts_can_connect(s.sock))
        fail_msg("a cuda:all traind neither exited nor listened within %d ms", START_TIMEOUT_MS);
    else
        assert_int_equal(stop_traind(&s), 0);
    read_file(s.log, log, size);
    close(nfd);
    svc_remove(&s);
    if (exited && strstr(log, "this traind was built without CUDA") != NULL)
        return -1;
    return 0;
}

/* Under systemd's watchdog, a [cuda] nccl_timeout_s longer than WatchdogSec is named at start,
 * with both values and what to change (README, "As a service"); one within it is not, nor is
 * one under a watchdog meant for another process (WATCHDOG_PID). A build without CUDA refuses
 * cuda:all before anything else: skipped there. */
static void test_watchdog_shorter_than_nccl_timeout(void **state)
{
    static const char *const warning = "[cuda] nccl_timeout_s (30 s) is longer than systemd's "
                                       "WatchdogSec (2 s)";
    char log[16384];

    if (start_under_watchdog("2000000", NULL, 30, log, sizeof(log)) != 0) {
        print_message("this traind was built without CUDA: nccl_timeout_s does not apply\n");
        skip();
    }
    if (strstr(log, warning) == NULL)
        fail_msg("expected \"%s\" in traind's log; got:\n%s", warning, log);
    assert_non_null(strstr(log, "set nccl_timeout_s to at most 2 in traind.conf's [cuda] or "
                                "raise WatchdogSec above 30"));

    /* Within the watchdog's interval, or a watchdog for another pid: nothing to say. */
    assert_int_equal(start_under_watchdog("60000000", NULL, 30, log, sizeof(log)), 0);
    if (strstr(log, "nccl_timeout_s") != NULL)
        fail_msg("no warning expected with WatchdogSec=60 s and nccl_timeout_s=30; got:\n%s", log);
    assert_int_equal(start_under_watchdog("2000000", "1", 30, log, sizeof(log)), 0);
    if (strstr(log, "nccl_timeout_s") != NULL)
        fail_msg("no warning expected under a watchdog for pid 1; got:\n%s", log);
}

/* ---- the units ---- */

/* Runs a shell command; its exit status, and its output (stdout and stderr) in out. */
static int run_capture(const char *cmd, char *out, size_t size)
{
    char full[2048];
    FILE *p;
    size_t n;
    int status;

    snprintf(full, sizeof(full), "%s 2>&1", cmd);
    p = popen(full, "r");
    assert_non_null(p);
    n = fread(out, 1, size - 1, p);
    out[n] = '\0';
    status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* systemd-analyze verify on the units the build made. ExecStart= is pointed at the built
 * binary, since verify checks that the command exists and the install path may not yet;
 * --man=no, since the man pages are not installed either. */
static void test_units_verify(void **state)
{
    const char *bin = ts_env_or("TRAIND_BIN", "build/daemon/traind");
    char root[512], cmd[1536], out[16384], dir[128] = "/tmp/traind-units.XXXXXX";
    char *slash;
    int rc;

    if (system("command -v systemd-analyze >/dev/null 2>&1") != 0) {
        print_message("systemd-analyze not found: the units are not verified\n");
        skip();
    }
    /* TRAIND_BIN is BUILD/daemon/traind; the units are in BUILD/systemd. */
    snprintf(root, sizeof(root), "%s", bin);
    for (int i = 0; i < 2; i++) {
        slash = strrchr(root, '/');
        assert_non_null(slash);
        *slash = '\0';
    }
    assert_non_null(mkdtemp(dir));
    snprintf(cmd, sizeof(cmd),
             "cp '%s/systemd/traind.socket' '%s/' && "
             "sed 's|^ExecStart=[^ ]*|ExecStart=%s|' '%s/systemd/traind.service' "
             "> '%s/traind.service'",
             root, dir, bin, root, dir);
    rc = run_capture(cmd, out, sizeof(out));
    if (rc != 0)
        fail_msg("cannot copy the units from %s/systemd: %s", root, out);
    snprintf(cmd, sizeof(cmd),
             "systemd-analyze verify --man=no '%s/traind.socket' "
             "'%s/traind.service'",
             dir, dir);
    rc = run_capture(cmd, out, sizeof(out));
    if (rc != 0 || out[0] != '\0')
        fail_msg("%s: exit %d:\n%s", cmd, rc, out);

    /* The exposure score, for the record; it must stay "OK" or better (below 4.5). */
    snprintf(cmd, sizeof(cmd),
             "systemd-analyze security --offline=yes '%s/traind.service' | "
             "grep 'Overall exposure level'",
             dir);
    rc = run_capture(cmd, out, sizeof(out));
    if (rc == 0) {
        const char *colon = strstr(out, ": ");
        double score = colon != NULL ? strtod(colon + 2, NULL) : 99;
        print_message("%s", out);
        if (score >= 4.5)
            fail_msg("traind.service's exposure level rose to %.1f", score);
    } else {
        print_message("systemd-analyze security --offline=yes unavailable: no score\n");
    }
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_config_errors, ts_kill_leftover),
        cmocka_unit_test_teardown(test_config_applies_and_flags_override, ts_kill_leftover),
        cmocka_unit_test_teardown(test_socket_mode_and_group, ts_kill_leftover),
        cmocka_unit_test_teardown(test_other_user_owner_and_access, ts_kill_leftover),
        cmocka_unit_test_teardown(test_socket_activation, ts_kill_leftover),
        cmocka_unit_test_teardown(test_cuda_devices_without_gpu, ts_kill_leftover),
        cmocka_unit_test_teardown(test_sticky_reexec_keeps_passed_socket, ts_kill_leftover),
        cmocka_unit_test_teardown(test_notify_abstract_socket, ts_kill_leftover),
        cmocka_unit_test_teardown(test_notify_ready_watchdog_stopping, ts_kill_leftover),
        cmocka_unit_test_teardown(test_watchdog_shorter_than_nccl_timeout, ts_kill_leftover),
        cmocka_unit_test_teardown(test_units_verify, ts_kill_leftover),
    };
    signal(SIGPIPE, SIG_IGN);
    /* TD_TEST_FILTER=test_sticky* runs only the tests whose name matches. */
    if (getenv("TD_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TD_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
