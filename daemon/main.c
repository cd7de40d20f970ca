/* traind: the training daemon's entry point. Reads the configuration file and then the
 * command line (a flag overrides the file), opens the state directory and the store, starts
 * the device workers and the metric store thread, listens on the control socket (its own, or
 * the one systemd passed), tells systemd it is ready and feeds systemd's watchdog, and runs
 * the libuv loop until SIGTERM or SIGINT.
 *
 * After a sticky CUDA error (DESIGN.md, "Failures") the loop ends without a signal, every
 * other job checkpointed and requeued, and main() re-executes traind with the argv it was
 * started with: the same pid, so systemd sees the same service, told RELOADING=1 before and
 * READY=1 again after.
 *
 * Exit status: 0 after a clean stop, 64 for a bad command line, 78 for a bad configuration
 * (systemd does not restart it: RestartPreventExitStatus=78), 1 when it cannot start. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "daemon.h"
#include "notify.h"
#include "server.h"
#include "td_clock.h"
#include "td_log.h"

#define EX_USAGE  64
#define EX_CONFIG 78

#ifndef TD_CONFIG_PATH
#define TD_CONFIG_PATH "/etc/traind/traind.conf"
#endif

/* What the command line said; NULL or 0 where it said nothing, so the file's value stays. */
typedef struct flags {
    const char *config;
    const char *socket, *state_dir, *devices, *log_level;
} flags;

static void usage(FILE *to)
{
    fprintf(to,
            "usage: traind [--config FILE] [--socket PATH] [--state-dir DIR] "
            "[--devices DEVICES] [--log-level LEVEL]\n"
            "\n"
            "  --config FILE      configuration file (default " TD_CONFIG_PATH ");\n"
            "                     the flags below override its keys\n"
            "  --socket PATH      control socket (default /run/traind/traind.sock)\n"
            "  --state-dir DIR    where traind.db lives (default /var/lib/traind)\n"
            "  --devices DEVICES  cpu:N: N CPU devices, each a worker thread with its\n"
            "                     share of the cores (default cpu:1); cuda:all: every\n"
            "                     GPU; cuda:0,1: those GPUs%s\n"
            "  --log-level LEVEL  err, warning, notice, info or debug (default info)\n"
            "  --version          print the version and exit\n",
            td_device_kind_built(TD_DEVICE_CUDA) ? "" : " (not in this build: it has no CUDA)");
}

/* mkdir -p for the state directory. */
static int make_dirs(const char *path)
{
    char buf[512];
    size_t n = strlen(path);

    if (n == 0 || n >= sizeof(buf))
        return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0750) != 0 && errno != EEXIST)
            return -errno;
        buf[i] = c;
    }
    return 0;
}

/* Reads the command line into f. Returns 0, or the exit status after printing why. */
static int parse_flags(int argc, char **argv, flags *f)
{
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'},  {"state-dir", required_argument, NULL, 'd'},
        {"devices", required_argument, NULL, 'D'}, {"log-level", required_argument, NULL, 'l'},
        {"config", required_argument, NULL, 'c'},  {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},       {NULL, 0, NULL, 0}};
    int c;

    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            f->socket = optarg;
            break;
        case 'd':
            f->state_dir = optarg;
            break;
        case 'D':
            f->devices = optarg;
            break;
        case 'l':
            f->log_level = optarg;
            break;
        case 'c':
            f->config = optarg;
            break;
        case 'h':
            usage(stdout);
            exit(0);
        case 'V':
            printf("traind %s (protocol %d)\n", TD_VERSION, TD_PROTO_VERSION);
            exit(0);
        default:
            usage(stderr);
            return EX_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "traind: unexpected argument %s\n", argv[optind]);
        return EX_USAGE;
    }
    return 0;
}

/* Puts the command line's values over the file's. Returns 0 or the exit status. */
static int apply_flags(const flags *f, td_config *cfg)
{
    char why[256];

    if (f->devices != NULL && td_config_set_devices(cfg, f->devices, why, sizeof(why)) != 0) {
        fprintf(stderr, "traind: --devices %s: %s\n", f->devices, why);
        return EX_USAGE;
    }
    if (f->log_level != NULL && td_config_set_log_level(cfg, f->log_level, why, sizeof(why)) != 0) {
        fprintf(stderr, "traind: --log-level %s: %s\n", f->log_level, why);
        return EX_USAGE;
    }
    /* libuv 1.44 silently truncates a long path; refuse it instead. */
    if (f->socket != NULL && td_config_set_socket(cfg, f->socket, why, sizeof(why)) != 0) {
        fprintf(stderr, "traind: socket path %s is %zu bytes; the limit is %zu\n", f->socket,
                strlen(f->socket), sizeof(cfg->socket_path) - 1);
        return EX_CONFIG;
    }
    if (f->state_dir != NULL && td_config_set_state_dir(cfg, f->state_dir, why, sizeof(why)) != 0) {
        fprintf(stderr, "traind: state directory path is too long\n");
        return EX_CONFIG;
    }
    return 0;
}

/* The configuration: defaults, then the file, then the flags. Returns 0 or the exit status. */
static int configure(int argc, char **argv, td_config *cfg)
{
    flags f = {0};
    td_error_t err = {0};
    int loaded, rc;

    rc = parse_flags(argc, argv, &f);
    if (rc != 0)
        return rc;
    td_config_defaults(cfg);
    if (td_config_load(cfg, f.config != NULL ? f.config : TD_CONFIG_PATH, f.config != NULL, &loaded,
                       &err) != 0) {
        td_log_err("traind: %s", err.msg);
        return EX_CONFIG;
    }
    rc = apply_flags(&f, cfg);
    if (rc != 0)
        return rc;
    td_log_set_level(cfg->log_level);
    if (loaded)
        td_log_debug("configuration read from %s", f.config != NULL ? f.config : TD_CONFIG_PATH);
    return 0;
}

static td_notify notify;

/* What main() runs: the daemon, the server in front of it, the signals that stop them. Loop
 * thread. */
typedef struct traind {
    uv_loop_t *loop;
    td_daemon *d;
    td_server *server;
    uv_signal_t sigint, sigterm;
    int signals_open; /* sigint and sigterm are started and not yet closed */
    int reexec_fd;    /* a copy of the inherited listening socket kept for the new process
                       * while the server closes its own; -1 when none */
} traind;

/* The watchdog's health check: every busy worker has started or finished a step within the
 * watchdog interval. An idle worker has nothing to prove. */
static int workers_fresh(void *ud, int64_t stale_ms, char *why, size_t size)
{
    traind *t = ud;

    return td_daemon_workers_fresh(t->d, stale_ms, why, size);
}

static void close_signals(traind *t)
{
    if (!t->signals_open)
        return;
    uv_close((uv_handle_t *)&t->sigint, NULL);
    uv_close((uv_handle_t *)&t->sigterm, NULL);
    t->signals_open = 0;
}

static void on_signal(uv_signal_t *h, int signum);

/* SIGTERM and SIGINT stop the daemon (its jobs are requeued). A libuv code on failure, with
 * whatever was started closed again. */
static int start_signals(traind *t)
{
    int rc;

    if ((rc = uv_signal_init(t->loop, &t->sigint)) != 0)
        return rc;
    if ((rc = uv_signal_init(t->loop, &t->sigterm)) != 0) {
        uv_close((uv_handle_t *)&t->sigint, NULL);
        return rc;
    }
    t->sigint.data = t->sigterm.data = t;
    t->signals_open = 1;
    if ((rc = uv_signal_start(&t->sigint, on_signal, SIGINT)) != 0 ||
        (rc = uv_signal_start(&t->sigterm, on_signal, SIGTERM)) != 0)
        close_signals(t);
    return rc;
}

static void on_signal(uv_signal_t *h, int signum)
{
    traind *t = h->data;

    td_log_notice("signal %d received", signum);
    td_notify_send(&notify, "STOPPING=1\nSTATUS=stopping: running jobs go back to the queue");
    close_signals(t);
    td_daemon_shutdown(t->d);
}

/* The daemon's hooks: its job changes feed the server's streams, and once every job has
 * stopped the server and the signals go (a re-exec ends the loop without a signal), keeping
 * an inherited socket for the new process when the stop is a re-exec's. */
static void on_job_changed(void *ud, int64_t job, const char *state)
{
    traind *t = ud;

    if (t->server != NULL)
        td_server_job_changed(t->server, job, state);
}

static void on_stopped(void *ud)
{
    traind *t = ud;

    if (t->server != NULL)
        t->reexec_fd = td_server_close(t->server, td_daemon_reexec_why(t->d) != NULL);
    close_signals(t);
}

/* Tells systemd the daemon is ready (store open, interrupted jobs requeued, socket
 * listening) and starts feeding its watchdog. */
static void ready(traind *t)
{
    char msg[256];
    int rc;

    snprintf(msg, sizeof(msg), "READY=1\nSTATUS=listening on %s; %d device(s)%s",
             td_server_path(t->server), td_daemon_ndevices(t->d),
             getenv("TRAIND_REEXEC") != NULL ? "; re-executed" : "");
    td_notify_send(&notify, msg);
    rc = td_notify_watchdog_start(&notify, t->loop, workers_fresh, t);
    if (rc != 0)
        td_log_err("cannot start the watchdog timer: %s", uv_strerror(rc));
}

/* "cuda:0, cuda:1" for the start's log line. */
static void device_names(const td_daemon *d, char *out, size_t size)
{
    size_t len = 0;

    out[0] = '\0';
    for (int i = 0; i < td_daemon_ndevices(d) && len < size; i++) {
        td_device_view v;
        td_daemon_device(d, i, &v);
        len += (size_t)snprintf(out + len, size - len, "%s%s", i ? ", " : "", v.name);
    }
}

/* Marks every descriptor from 3 up close-on-exec but keep (-1: none). */
static void cloexec_all_but(int keep)
{
    DIR *dir = opendir("/proc/self/fd");
    struct dirent *e;

    if (dir == NULL) {
        /* No /proc: the descriptors traind opens itself are close-on-exec already. */
        td_log_warn("cannot list /proc/self/fd: %s", strerror(errno));
        return;
    }
    while ((e = readdir(dir)) != NULL) {
        int fd = atoi(e->d_name);
        if (fd > 2 && fd != keep && fd != dirfd(dir))
            (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    closedir(dir);
}

/* Replaces the process with a fresh traind, the same pid, executing /proc/self/exe with argv
 * (main's original). Every descriptor but 0-2 is closed on exec, except the listening socket
 * systemd passed (LISTEN_FDS), which is put back on descriptor 3 for the new process to take
 * again. Returns only on failure. */
static void exec_self(traind *t, char *const argv[], const char *why)
{
    int keep = -1, e;

    if (t->reexec_fd >= 0) {
        /* sd_listen_fds(3): the passed socket is descriptor 3; LISTEN_PID (this pid, which
         * exec keeps) and LISTEN_FDS are still set, so the new process takes it again. */
        if (dup2(t->reexec_fd, 3) == 3) {
            keep = 3;
            if (t->reexec_fd != 3)
                close(t->reexec_fd);
        } else {
            td_log_err("cannot put the socket systemd passed back on descriptor 3: %s",
                       strerror(errno));
        }
        t->reexec_fd = -1;
    }
    /* CUDA, NCCL and the libraries below them may hold descriptors opened without
     * close-on-exec (/dev/nvidia*, sockets): none may leak into the new process. */
    cloexec_all_but(keep);
    td_log_notice("re-executing traind (same pid %ld) after a sticky CUDA error in %s",
                  (long)getpid(), why);
    execv("/proc/self/exe", argv);
    e = errno;
    td_log_err("cannot re-execute /proc/self/exe: %s", strerror(e));
}

/* The end of a loop that a sticky CUDA error stopped: tells systemd, then becomes a fresh
 * traind. Returns only when the exec failed (exit 1: systemd restarts it, and the store
 * resumes the queue all the same). */
static int reexec(traind *t, char **argv)
{
    char why[512], msg[700];

    snprintf(why, sizeof(why), "%s", td_daemon_reexec_why(t->d));
    snprintf(msg, sizeof(msg),
             "RELOADING=1\nMONOTONIC_USEC=%lld\nSTATUS=re-executing after a sticky CUDA error in "
             "%.500s",
             (long long)(td_mono_ms() * 1e3), why);
    td_notify_send(&notify, msg);
    td_notify_close(&notify);
    uv_run(t->loop, UV_RUN_DEFAULT); /* the watchdog timer's close callback */
    uv_loop_close(t->loop);
    td_server_free(t->server);
    td_daemon_free(t->d);
    /* The new process reads it only to say, in its status, that it is one. */
    setenv("TRAIND_REEXEC", "1", 1);
    exec_self(t, argv, why);
    return 1;
}

int main(int argc, char **argv)
{
    static traind t = {.reexec_fd = -1};
    static char *args[256];
    td_config cfg;
    td_error_t err = {0};
    td_daemon_hooks hooks = {.ud = &t, .job_changed = on_job_changed, .stopped = on_stopped};
    char names[TD_MAX_DEVICES * 12];
    int rc;

    /* getopt_long may permute argv: a re-exec needs it as it came. */
    if (argc >= (int)(sizeof(args) / sizeof(args[0]))) {
        fprintf(stderr, "traind: too many arguments\n");
        return EX_USAGE;
    }
    memcpy(args, argv, (size_t)argc * sizeof(*argv));
    args[argc] = NULL;
    rc = configure(argc, argv, &cfg);
    if (rc != 0)
        return rc;
    t.loop = uv_default_loop();
    signal(SIGPIPE, SIG_IGN);
    /* A file-size limit then fails the write (EFBIG, reported as a full disk, with the older
     * checkpoints kept) instead of killing the daemon and every job with it. */
    signal(SIGXFSZ, SIG_IGN);
    td_notify_open(&notify);
    rc = make_dirs(cfg.state_dir);
    if (rc != 0) {
        td_log_err("cannot create state directory %s: %s", cfg.state_dir, strerror(-rc));
        rc = EX_CONFIG;
        goto out;
    }
    if (td_daemon_new(&t.d, t.loop, &cfg, &err) != 0) {
        td_log_err("cannot start: %s", err.msg);
        rc = 1;
        goto out;
    }
    td_daemon_set_hooks(t.d, &hooks);
    if (td_server_new(&t.server, t.loop, &cfg, t.d, &err) != 0) {
        td_log_err("%s", err.msg);
        td_daemon_shutdown(t.d);
        uv_run(t.loop, UV_RUN_DEFAULT);
        rc = 1;
        goto out;
    }
    rc = start_signals(&t);
    if (rc != 0) {
        td_log_err("cannot watch for SIGTERM and SIGINT: %s", uv_strerror(rc));
        td_daemon_shutdown(t.d);
        uv_run(t.loop, UV_RUN_DEFAULT);
        rc = 1;
        goto out;
    }
    device_names(t.d, names, sizeof(names));
    td_log_notice("traind %s listening on %s; state in %s; %d device(s): %s", TD_VERSION,
                  td_server_path(t.server), cfg.db_path, td_daemon_ndevices(t.d), names);
    ready(&t);
    uv_run(t.loop, UV_RUN_DEFAULT);
    if (td_daemon_reexec_why(t.d) != NULL)
        return reexec(&t, args);
    rc = 0;
out:
    td_notify_close(&notify);
    uv_run(t.loop, UV_RUN_DEFAULT); /* the watchdog timer's close callback */
    uv_loop_close(t.loop);
    td_server_free(t.server);
    td_daemon_free(t.d);
    return rc;
}
