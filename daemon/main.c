/* traind: the training daemon's entry point. Parses the command line, opens the state
 * directory and the store, starts the device workers and the metric store thread, listens
 * on the control socket and runs the libuv loop until SIGTERM or SIGINT. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "daemon.h"
#include "td_log.h"

#define EX_USAGE 64
#define EX_CONFIG 78

static void usage(FILE *to)
{
    fprintf(to, "usage: traind [--socket PATH] [--state-dir DIR] [--devices cpu:N] "
                "[--log-level LEVEL]\n"
                "\n"
                "  --socket PATH      control socket (default /run/traind/traind.sock)\n"
                "  --state-dir DIR    where traind.db lives (default /var/lib/traind)\n"
                "  --devices cpu:N    N CPU devices, each a worker thread with its share of\n"
                "                     the cores (default cpu:1)\n"
                "  --log-level LEVEL  err, warning, notice, info or debug (default info)\n"
                "  --version          print the version and exit\n");
}

static int parse_devices(const char *s, int *n)
{
    char *end;
    long v;

    if (strncmp(s, "cpu:", 4) != 0)
        return -1;
    errno = 0;
    v = strtol(s + 4, &end, 10);
    if (errno != 0 || *end != '\0' || v < 1 || v > TD_MAX_DEVICES)
        return -1;
    *n = (int)v;
    return 0;
}

static int parse_level(const char *s)
{
    static const char *const names[] = {"err", "warning", "notice", "info", "debug"};
    for (int i = 0; i < 5; i++)
        if (strcmp(s, names[i]) == 0)
            return TD_LOG_ERR + i;
    return -1;
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

static int parse_args(int argc, char **argv, td_config *cfg)
{
    static const struct option opts[] = {
        {"socket", required_argument, NULL, 's'},  {"state-dir", required_argument, NULL, 'd'},
        {"devices", required_argument, NULL, 'D'}, {"log-level", required_argument, NULL, 'l'},
        {"help", no_argument, NULL, 'h'},          {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0}};
    const char *socket = "/run/traind/traind.sock", *state = "/var/lib/traind";
    int c, level;

    cfg->ncpu_devices = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            socket = optarg;
            break;
        case 'd':
            state = optarg;
            break;
        case 'D':
            if (parse_devices(optarg, &cfg->ncpu_devices) != 0) {
                fprintf(stderr, "traind: --devices %s: expected cpu:N with N from 1 to %d\n",
                        optarg, TD_MAX_DEVICES);
                return EX_USAGE;
            }
            break;
        case 'l':
            if ((level = parse_level(optarg)) < 0) {
                fprintf(stderr, "traind: --log-level %s: expected err, warning, notice, info "
                                "or debug\n",
                        optarg);
                return EX_USAGE;
            }
            td_log_set_level(level);
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
    /* libuv 1.44 silently truncates a long path; refuse it instead. */
    if (strlen(socket) >= sizeof(cfg->socket_path)) {
        fprintf(stderr, "traind: socket path %s is %zu bytes; the limit is %zu\n", socket,
                strlen(socket), sizeof(cfg->socket_path) - 1);
        return EX_CONFIG;
    }
    snprintf(cfg->socket_path, sizeof(cfg->socket_path), "%s", socket);
    if (strlen(state) >= sizeof(cfg->state_dir)) {
        fprintf(stderr, "traind: state directory path is too long\n");
        return EX_CONFIG;
    }
    snprintf(cfg->state_dir, sizeof(cfg->state_dir), "%s", state);
    snprintf(cfg->db_path, sizeof(cfg->db_path), "%s/traind.db", state);
    return 0;
}

static void on_signal(uv_signal_t *h, int signum)
{
    td_daemon *d = h->data;

    td_log_notice("signal %d received", signum);
    uv_close((uv_handle_t *)&d->sigint, NULL);
    uv_close((uv_handle_t *)&d->sigterm, NULL);
    td_daemon_shutdown(d);
}

int main(int argc, char **argv)
{
    static td_daemon d;
    td_config cfg = {0};
    td_error_t err = {0};
    uv_loop_t *loop = uv_default_loop();
    int rc;

    rc = parse_args(argc, argv, &cfg);
    if (rc != 0)
        return rc;
    signal(SIGPIPE, SIG_IGN);
    rc = make_dirs(cfg.state_dir);
    if (rc != 0) {
        td_log_err("cannot create state directory %s: %s", cfg.state_dir, strerror(-rc));
        return EX_CONFIG;
    }
    if (td_daemon_init(&d, loop, &cfg, &err) != 0) {
        td_log_err("cannot start: %s", err.msg);
        return 1;
    }
    if (td_server_listen(&d, &err) != 0) {
        td_log_err("%s", err.msg);
        td_daemon_shutdown(&d);
        uv_run(loop, UV_RUN_DEFAULT);
        return 1;
    }
    uv_signal_init(loop, &d.sigint);
    uv_signal_init(loop, &d.sigterm);
    d.sigint.data = d.sigterm.data = &d;
    uv_signal_start(&d.sigint, on_signal, SIGINT);
    uv_signal_start(&d.sigterm, on_signal, SIGTERM);
    td_log_notice("traind %s listening on %s; state in %s; %d device(s) cpu:0..%d",
                  TD_VERSION, cfg.socket_path, cfg.db_path, d.nworkers, d.nworkers - 1);
    uv_run(loop, UV_RUN_DEFAULT);
    uv_loop_close(loop);
    return d.exit_code;
}
