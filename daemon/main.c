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
 * One daemon per state directory: before it touches the database, traind takes an exclusive
 * flock on STATE_DIR/traind.lock (holding its pid), for its whole life; the kernel drops it
 * when the process ends, kill -9 included, and a re-exec keeps it. A start refused for any
 * reason leaves nothing behind: what it created (the state directory, the database, the
 * lock file) is removed again, and it logs no "stopping" or "stopped".
 *
 * What traind creates is never readable by other users: it runs with group and other write
 * and other read taken out of its umask (027 at least), so the state directory is 0750 and
 * the database 0640; checkpoints are 0600 in 0700 directories (train/ckpt.c).
 *
 * Exit status: 0 after a clean stop, 64 for a bad command line, 78 for a bad configuration
 * (systemd does not restart it: RestartPreventExitStatus=78), including a socket or state
 * directory that cannot be used, 75 (EX_TEMPFAIL) when another traind uses the state
 * directory, 1 when it cannot start for another reason. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/daemon.h"
#include "daemon/notify.h"
#include "daemon/prom.h"
#include "daemon/rank.h"
#include "daemon/server/server.h"
#include "daemon/work.h"
#include "common/td_clock.h"
#include "common/td_log.h"

#define EX_USAGE    64
#define EX_TEMPFAIL 75
#define EX_CONFIG   78

#define TD_UMASK      027           /* at least: nothing for others, no group write */
#define TD_LOCK_NAME  "traind.lock" /* in the state directory */
#define TD_LOCK_TRIES 8             /* a lock file replaced under us is opened again this often */

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

/* What a start created in the state directory, to be removed again if the start fails. */
typedef struct created {
    char top[512]; /* the first directory of the state directory's path that mkdir made; "" */
    int db;        /* traind.db did not exist before */
    int lock;      /* nor did traind.lock */
    int lock_fd;   /* the lock, held for life; -1 before */
} created;

/* mkdir -p for the state directory, 0750, noting in c the first directory it made. Returns 0
 * or -errno. */
static int make_dirs(const char *path, created *c)
{
    char buf[512];
    size_t n = strlen(path);

    if (n == 0 || n >= sizeof(buf))
        return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char ch = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0750) == 0) {
            if (c->top[0] == '\0')
                snprintf(c->top, sizeof(c->top), "%s", buf);
        } else if (errno != EEXIST) {
            return -errno;
        }
        buf[i] = ch;
    }
    return 0;
}

/* The directory part of path ("." when there is none) into dir. */
static void dir_of(const char *path, char *dir, size_t size)
{
    const char *slash = strrchr(path, '/');

    if (slash == NULL)
        snprintf(dir, size, ".");
    else if (slash == path)
        snprintf(dir, size, "/");
    else
        snprintf(dir, size, "%.*s", (int)(slash - path), path);
}

/* Whether systemd passed a listening socket for this process (sd_listen_fds(3)); server.c
 * checks it further and takes it. */
static int socket_passed(void)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");

    return pid != NULL && fds != NULL && atol(pid) == (long)getpid() && atol(fds) >= 1;
}

/* The socket's directory must exist before traind creates anything: libuv reports a missing
 * one as "permission denied" (it maps bind's ENOENT onto EACCES). Returns 0 or the exit
 * status after saying why. */
static int check_socket_dir(const td_config *cfg)
{
    char dir[sizeof(cfg->socket_path)];
    struct stat st;

    if (socket_passed())
        return 0;
    dir_of(cfg->socket_path, dir, sizeof(dir));
    if (stat(dir, &st) != 0 && (errno == ENOENT || errno == ENOTDIR)) {
        td_log_err("cannot listen on %s: directory %s does not exist", cfg->socket_path, dir);
        return EX_CONFIG;
    }
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
        td_log_err("cannot listen on %s: %s is not a directory", cfg->socket_path, dir);
        return EX_CONFIG;
    }
    return 0;
}

/* The Prometheus file's directory must exist (traind creates the file, never its directory:
 * the node exporter's textfile directory is the operator's), be reached through no link, and
 * be safe from other users; it is held open from here on (td_prom_open). Returns 0 or the
 * exit status after saying why. */
static int check_prom_dir(td_prom *p, const td_config *cfg)
{
    td_error_t err;

    if (cfg->prom_path[0] == '\0')
        return 0;
    if (td_prom_open(p, cfg, &err) != 0) {
        td_log_err("%s", err.msg);
        return EX_CONFIG;
    }
    return 0;
}

/* When traind first started, and how often it has re-executed itself since: a re-exec passes
 * both on in its environment (TRAIND_STARTED, TRAIND_REEXEC), for the Prometheus file. */
static void start_record(double *started, int64_t *restarts)
{
    const char *s = getenv("TRAIND_STARTED"), *r = getenv("TRAIND_REEXEC");
    char buf[32];

    *started = s != NULL ? atof(s) : 0;
    if (*started <= 0) {
        *started = td_wall_s();
        snprintf(buf, sizeof(buf), "%.3f", *started);
        setenv("TRAIND_STARTED", buf, 1);
    }
    *restarts = r != NULL ? atoll(r) : 0;
}

/* Creates the state directory when it is missing, and checks that it is a directory. Returns
 * 0 or the exit status after saying why. */
static int state_dir(const td_config *cfg, created *c)
{
    struct stat st;
    int rc;

    if (stat(cfg->state_dir, &st) == 0 && !S_ISDIR(st.st_mode)) {
        td_log_err("state directory %s is not a directory", cfg->state_dir);
        return EX_CONFIG;
    }
    rc = make_dirs(cfg->state_dir, c);
    if (rc == -EEXIST || rc == -ENOTDIR) {
        td_log_err("state directory %s cannot be created: a part of its path is not a directory",
                   cfg->state_dir);
        return EX_CONFIG;
    }
    if (rc != 0) {
        td_log_err("state directory %s cannot be created: %s", cfg->state_dir, strerror(-rc));
        return EX_CONFIG;
    }
    return 0;
}

/* The pid a running traind wrote into its lock file, or 0. */
static long lock_holder(int fd)
{
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);

    if (n <= 0)
        return 0;
    buf[n] = '\0';
    return atol(buf);
}

/* Takes the state directory's lock (this file's comment): c->lock_fd. A re-exec finds it
 * already held on the descriptor $TRAIND_LOCK_FD. Returns 0 or the exit status. */
static int lock_state_dir(const td_config *cfg, created *c)
{
    char path[sizeof(cfg->state_dir) + sizeof(TD_LOCK_NAME) + 1], pid[32];
    const char *inherited = getenv("TRAIND_LOCK_FD");
    struct stat held, named;

    snprintf(path, sizeof(path), "%s/%s", cfg->state_dir, TD_LOCK_NAME);
    if (inherited != NULL) {
        int fd = atoi(inherited);
        unsetenv("TRAIND_LOCK_FD");
        if (fd > 2 && flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &held) == 0 &&
            stat(path, &named) == 0 && held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
            (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
            c->lock_fd = fd;
            return 0;
        }
        /* Not the lock after all: held open here, it would stand in the way of our own. */
        if (fd > 2)
            close(fd);
    }
    for (int i = 0; i < TD_LOCK_TRIES; i++) {
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0 && errno == ENOENT) {
            fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0640);
            c->lock = fd >= 0;
        }
        if (fd < 0 && errno == EEXIST)
            continue;
        if (fd < 0) {
            td_log_err("state directory %s is not writable: %s: %s", cfg->state_dir, path,
                       strerror(errno));
            return EX_CONFIG;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            long other = lock_holder(fd);
            close(fd);
            if (other > 0)
                td_log_err("state directory %s is in use by traind pid %ld", cfg->state_dir, other);
            else
                td_log_err("state directory %s is in use by another traind", cfg->state_dir);
            return EX_TEMPFAIL;
        }
        /* A failed start removes a lock file it created: one locked after that is no lock. */
        if (fstat(fd, &held) != 0 || stat(path, &named) != 0 || held.st_ino != named.st_ino ||
            held.st_dev != named.st_dev) {
            close(fd);
            c->lock = 0;
            continue;
        }
        snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, strlen(pid), 0) != (ssize_t)strlen(pid))
            td_log_warn("cannot write the pid into %s: %s", path, strerror(errno));
        c->lock_fd = fd;
        return 0;
    }
    td_log_err("state directory %s: %s keeps changing under traind", cfg->state_dir, path);
    return EX_TEMPFAIL;
}

/* Takes read access from other users on what an older traind left readable (the database, its
 * WAL, the checkpoints), now that traind creates nothing they may read. */
static void tighten_modes(const td_config *cfg)
{
    static const char *const suffixes[] = {"", "-wal", "-shm"};
    char path[sizeof(cfg->db_path) + 16];
    struct stat st;

    for (size_t i = 0; i < sizeof(suffixes) / sizeof(suffixes[0]); i++) {
        snprintf(path, sizeof(path), "%s%s", cfg->db_path, suffixes[i]);
        if (lstat(path, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 07) != 0 &&
            chmod(path, st.st_mode & 0770) == 0)
            td_log_notice("%s was readable by every user: now mode %04o", path,
                          (unsigned)(st.st_mode & 0770));
    }
    snprintf(path, sizeof(path), "%s/checkpoints", cfg->state_dir);
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 077) != 0 &&
        chmod(path, 0700) == 0)
        td_log_notice("%s was open to other users: now mode 0700", path);
}

/* Removes what a failed start created (c): the database, the lock file, the directories. */
static void undo_start(const td_config *cfg, created *c)
{
    char path[sizeof(cfg->db_path) + 16], dir[512];

    if (c->db)
        for (int i = 0; i < 3; i++) {
            snprintf(path, sizeof(path), "%s%s", cfg->db_path,
                     (const char *[]){"", "-wal", "-shm"}[i]);
            unlink(path);
        }
    if (c->lock) {
        /* Unlinked while still held: lock_state_dir tells a file unlinked under it. */
        snprintf(path, sizeof(path), "%s/%s", cfg->state_dir, TD_LOCK_NAME);
        unlink(path);
    }
    if (c->lock_fd >= 0)
        close(c->lock_fd);
    c->lock_fd = -1;
    if (c->top[0] == '\0')
        return;
    /* rmdir from the state directory up to the first one made: only empty ones go. */
    snprintf(dir, sizeof(dir), "%s", cfg->state_dir);
    for (;;) {
        if (rmdir(dir) != 0 || strcmp(dir, c->top) == 0)
            return;
        char *slash = strrchr(dir, '/');
        if (slash == NULL || slash == dir)
            return;
        *slash = '\0';
    }
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
    td_prom prom;     /* the Prometheus file, when traind.conf names one */
    double started;   /* unix seconds traind first started; a re-exec keeps it */
    int64_t restarts; /* re-executions since */
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
    if (state != NULL)
        td_prom_job_changed(&t->prom);
}

static void on_stopped(void *ud)
{
    traind *t = ud;

    if (t->server != NULL)
        t->reexec_fd = td_server_close(t->server, td_daemon_reexec_why(t->d) != NULL);
    td_prom_close(&t->prom);
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

/* Under systemd's watchdog (td_notify_open read $WATCHDOG_USEC for this pid), says at start
 * when [cuda] nccl_timeout_s is longer than WatchdogSec (README, "As a service"). A collective
 * that hangs keeps the watchdog fed (each NCCL poll refreshes its rank's heartbeat), so it
 * still fails its job after nccl_timeout_s; but a rank stuck in a call that never returns
 * stops the pings, and systemd restarts traind after WatchdogSec, before that timeout. Only a
 * cuda: daemon runs collectives, so only one is told. */
static void check_nccl_timeout(const td_config *cfg, const td_notify *n)
{
    double watchdog_s = (double)n->watchdog_ms / 1e3;

    if (n->watchdog_ms <= 0 || cfg->dev_kind != TD_DEVICE_CUDA || cfg->nccl_timeout_s <= watchdog_s)
        return;
    td_log_warn("[cuda] nccl_timeout_s (%g s) is longer than systemd's WatchdogSec (%g s): a hung "
                "collective still fails its job after %g s (NCCL's polls keep the watchdog fed), "
                "but a GPU call that never returns gets traind restarted after %g s; to keep "
                "every NCCL timeout within the watchdog, set nccl_timeout_s to at most %g in "
                "traind.conf's [cuda] or raise WatchdogSec above %g (systemctl edit traind)",
                cfg->nccl_timeout_s, watchdog_s, cfg->nccl_timeout_s, watchdog_s, watchdog_s,
                cfg->nccl_timeout_s);
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

/* Marks every descriptor from 3 up close-on-exec but keep and keep2 (-1: none). */
static void cloexec_all_but(int keep, int keep2)
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
        if (fd > 2 && fd != keep && fd != keep2 && fd != dirfd(dir))
            (void)fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    closedir(dir);
}

/* Replaces the process with a fresh traind, the same pid, executing /proc/self/exe with argv
 * (main's original). Every descriptor but 0-2 is closed on exec, except the listening socket
 * systemd passed (LISTEN_FDS), which is put back on descriptor 3 for the new process to take
 * again, and the state directory's lock (lock_fd), which the new process finds held on
 * $TRAIND_LOCK_FD, so that no other traind can take the directory in between. Returns only
 * on failure. */
static void exec_self(traind *t, char *const argv[], const char *why, int lock_fd)
{
    char fd_text[16];
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
    cloexec_all_but(keep, lock_fd);
    if (lock_fd >= 0 && lock_fd != keep && fcntl(lock_fd, F_SETFD, 0) == 0) {
        snprintf(fd_text, sizeof(fd_text), "%d", lock_fd);
        setenv("TRAIND_LOCK_FD", fd_text, 1);
    }
    td_log_notice("re-executing traind (same pid %ld) after a sticky CUDA error in %s",
                  (long)getpid(), why);
    execv("/proc/self/exe", argv);
    e = errno;
    td_log_err("cannot re-execute /proc/self/exe: %s", strerror(e));
}

/* The end of a loop that a sticky CUDA error stopped: tells systemd, then becomes a fresh
 * traind. Returns only when the exec failed (exit 1: systemd restarts it, and the store
 * resumes the queue all the same). */
static int reexec(traind *t, char **argv, int lock_fd)
{
    char why[512], msg[700], count[32];

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
    /* The new process says, in its status, that it is one, and counts it (start_record). */
    snprintf(count, sizeof(count), "%lld", (long long)t->restarts + 1);
    setenv("TRAIND_REEXEC", count, 1);
    exec_self(t, argv, why, lock_fd);
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
    created made = {.lock_fd = -1};
    int rc;

    /* One process of a job over nodes, started by a launcher: no daemon at all (rank.h). */
    if (argc > 1 && strcmp(argv[1], "rank") == 0)
        return td_rank_main(argc - 1, argv + 1);
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
    start_record(&t.started, &t.restarts);
    /* The threadpool's size, before anything uses it: the work requests' lanes and the short
     * work beside them (work.h). */
    td_work_pool_size();
    t.loop = uv_default_loop();
    signal(SIGPIPE, SIG_IGN);
    /* A file-size limit then fails the write (EFBIG, reported as a full disk, with the older
     * checkpoints kept) instead of killing the daemon and every job with it. */
    signal(SIGXFSZ, SIG_IGN);
    /* Whatever the umask it was started with, nothing traind creates is for other users. */
    umask(umask(0) | TD_UMASK);
    td_notify_open(&notify);
    check_nccl_timeout(&cfg, &notify);
    /* Checks first, then the state directory, its lock, and only then the database. */
    rc = check_socket_dir(&cfg);
    if (rc == 0)
        rc = check_prom_dir(&t.prom, &cfg);
    if (rc == 0)
        rc = state_dir(&cfg, &made);
    if (rc == 0)
        rc = lock_state_dir(&cfg, &made);
    if (rc != 0)
        goto out;
    tighten_modes(&cfg);
    made.db = access(cfg.db_path, F_OK) != 0;
    if (td_daemon_new(&t.d, t.loop, &cfg, &err) != 0) {
        td_log_err("cannot start: %s", err.msg);
        rc = 1;
        goto out;
    }
    td_daemon_set_hooks(t.d, &hooks);
    if (td_server_new(&t.server, t.loop, &cfg, t.d, &err) != 0) {
        td_log_err("%s", err.msg);
        td_daemon_discard(t.d);
        rc = 1;
        goto out;
    }
    rc = start_signals(&t);
    if (rc != 0) {
        td_log_err("cannot watch for SIGTERM and SIGINT: %s", uv_strerror(rc));
        td_daemon_discard(t.d);
        rc = 1;
        goto out;
    }
    if (cfg.prom_path[0] != '\0') {
        rc = td_prom_start(&t.prom, t.loop, t.d, &cfg, t.started, t.restarts);
        if (rc != 0)
            td_log_err("cannot start writing %s: %s", cfg.prom_path, uv_strerror(rc));
    }
    device_names(t.d, names, sizeof(names));
    td_log_notice("traind %s listening on %s; state in %s; %d device(s): %s", TD_VERSION,
                  td_server_path(t.server), cfg.db_path, td_daemon_ndevices(t.d), names);
    ready(&t);
    uv_run(t.loop, UV_RUN_DEFAULT);
    if (td_daemon_reexec_why(t.d) != NULL)
        return reexec(&t, args, made.lock_fd);
    rc = 0;
out:
    td_notify_close(&notify);
    uv_run(t.loop, UV_RUN_DEFAULT); /* the watchdog timer's and the discarded start's closes */
    uv_loop_close(t.loop);
    td_server_free(t.server);
    td_daemon_free(t.d);
    if (rc != 0)
        undo_start(&cfg, &made);
    /* A clean stop keeps the lock file; the kernel drops the lock with the process. */
    return rc;
}
