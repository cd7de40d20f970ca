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
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "config.h"
#include "daemon.h"
#include "notify.h"
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
#ifdef TD_HAVE_CUDA
            ""
#else
            " (not in this build: it has no CUDA)"
#endif
    );
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

/* The watchdog's health check: every busy worker has started or finished a step within the
 * watchdog interval. An idle worker has nothing to prove. */
static int workers_fresh(void *ud, int64_t stale_ms, char *why, size_t size)
{
    td_daemon *d = ud;
    long long now = (long long)td_mono_ms();

    for (int i = 0; i < d->nworkers; i++) {
        td_worker *w = &d->workers[i];
        long long age;
        if (w->running == NULL)
            continue;
        age = now - atomic_load(&w->heartbeat_ms);
        if (age > stale_ms) {
            snprintf(why, size, "device %s (job %lld) has not started or ended a step for %lld ms",
                     w->name, (long long)w->running->id, age);
            return 0;
        }
    }
    return 1;
}

static void on_signal(uv_signal_t *h, int signum)
{
    td_daemon *d = h->data;

    td_log_notice("signal %d received", signum);
    td_notify_send(&notify, "STOPPING=1\nSTATUS=stopping: running jobs go back to the queue");
    if (d->signals_open) {
        uv_close((uv_handle_t *)&d->sigint, NULL);
        uv_close((uv_handle_t *)&d->sigterm, NULL);
        d->signals_open = 0;
    }
    td_daemon_shutdown(d);
}

/* Tells systemd the daemon is ready (store open, interrupted jobs requeued, socket
 * listening) and starts feeding its watchdog. */
static void ready(td_daemon *d)
{
    char msg[256];
    int rc;

    snprintf(msg, sizeof(msg), "READY=1\nSTATUS=listening on %s; %d device(s)%s",
             d->cfg.socket_path, d->nworkers,
             getenv("TRAIND_REEXEC") != NULL ? "; re-executed" : "");
    td_notify_send(&notify, msg);
    rc = td_notify_watchdog_start(&notify, d->loop, workers_fresh, d);
    if (rc != 0)
        td_log_err("cannot start the watchdog timer: %s", uv_strerror(rc));
}

/* "cuda:0, cuda:1" for the start's log line. */
static void device_names(const td_daemon *d, char *out, size_t size)
{
    size_t len = 0;

    out[0] = '\0';
    for (int i = 0; i < d->nworkers && len < size; i++)
        len += (size_t)snprintf(out + len, size - len, "%s%s", i ? ", " : "", d->workers[i].name);
}

/* The end of a loop that a sticky CUDA error stopped: tells systemd, then becomes a fresh
 * traind. Returns only when the exec failed (exit 1: systemd restarts it, and the store
 * resumes the queue all the same). */
static int reexec(td_daemon *d, char **argv)
{
    char msg[700];

    snprintf(msg, sizeof(msg),
             "RELOADING=1\nMONOTONIC_USEC=%lld\nSTATUS=re-executing after a sticky CUDA error in "
             "%.500s",
             (long long)(td_mono_ms() * 1e3), d->reexec_why);
    td_notify_send(&notify, msg);
    td_notify_close(&notify);
    uv_run(d->loop, UV_RUN_DEFAULT); /* the watchdog timer's close callback */
    uv_loop_close(d->loop);
    /* The new process reads it only to say, in its status, that it is one. */
    setenv("TRAIND_REEXEC", "1", 1);
    td_daemon_reexec(d, argv);
    return 1;
}

int main(int argc, char **argv)
{
    static td_daemon d;
    static char *args[256];
    td_config cfg;
    td_error_t err = {0};
    uv_loop_t *loop = uv_default_loop();
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
    if (td_daemon_init(&d, loop, &cfg, &err) != 0) {
        td_log_err("cannot start: %s", err.msg);
        rc = 1;
        goto out;
    }
    if (td_server_listen(&d, &err) != 0) {
        td_log_err("%s", err.msg);
        td_daemon_shutdown(&d);
        uv_run(loop, UV_RUN_DEFAULT);
        rc = 1;
        goto out;
    }
    uv_signal_init(loop, &d.sigint);
    uv_signal_init(loop, &d.sigterm);
    d.sigint.data = d.sigterm.data = &d;
    uv_signal_start(&d.sigint, on_signal, SIGINT);
    uv_signal_start(&d.sigterm, on_signal, SIGTERM);
    d.signals_open = 1;
    device_names(&d, names, sizeof(names));
    td_log_notice("traind %s listening on %s; state in %s; %d device(s): %s", TD_VERSION,
                  d.cfg.socket_path, cfg.db_path, d.nworkers, names);
    ready(&d);
    uv_run(loop, UV_RUN_DEFAULT);
    if (d.reexec)
        return reexec(&d, args);
    rc = d.exit_code;
out:
    td_notify_close(&notify);
    uv_run(loop, UV_RUN_DEFAULT); /* the watchdog timer's close callback */
    uv_loop_close(loop);
    return rc;
}
