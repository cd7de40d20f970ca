/* traind's configuration file. inih cuts the file into (section, key, value); this file
 * knows the keys, checks every value and says where a bad one is. inih reports only the
 * number of the first bad line, so the file is fed to it through a reader that counts lines:
 * the handler then knows which line it is looking at, and the message for the first error,
 * whether inih's (syntax) or the handler's (a key or a value), names the right line. Called
 * from main() only. */
#include <errno.h>
#include <grp.h>
#include <ini.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/metricq.h"
#include "common/td_log.h"

#define GROUP_BUF_MAX (1 << 20) /* bytes getgrnam_r may need for a group with many members */
#define VALUE_SHOWN   80        /* bytes of a bad value quoted in a message */

#define NCCL_TIMEOUT_DEFAULT                                                                 \
    300.0                        /* seconds a collective may take: NCCL's init of 8 GPUs and \
                                  * a large model's all-reduce stay far below it */
#define NCCL_TIMEOUT_MAX 86400.0 /* seconds: a day */

#define PROM_INTERVAL_MAX  3600.0 /* seconds between writes of the Prometheus file: an hour */
#define DISK_FULL_WAIT_MAX 3600.0 /* seconds a full disk may be waited out: an hour */

#define HELLO_TIMEOUT_MAX 3600.0   /* seconds: an hour */
#define IDLE_TIMEOUT_MAX  604800.0 /* seconds: a week */
#define WORK_TIMEOUT_MAX  604800.0 /* seconds: a week */

typedef enum {
    K_SOCKET,
    K_STATE_DIR,
    K_DEVICES,
    K_GROUP,
    K_LOG_LEVEL,
    K_INT,
    K_SECONDS,
    K_SECONDS_OR_0,
    K_PROM_PATH,
    K_MODE,
    K_LAUNCHER,
    K_PATH, /* an absolute path into a char[hi] of td_config at off */
    K_WORDS /* text without control characters into a char[hi] at off */
} key_kind;

/* Every key the file may hold. K_INT keys are an int of td_config at off, from lo to hi;
 * K_SECONDS keys a double of td_config at off, above 0 and at most hi (K_SECONDS_OR_0: 0 is
 * allowed too, and means "never"); K_PATH and K_WORDS keys a char[hi] at off. */
static const struct key_def {
    const char *section, *name;
    key_kind kind;
    size_t off;
    int lo, hi;
    const char *meaning; /* for the message about a bad integer */
} keys[] = {
    {"daemon", "socket", K_SOCKET, 0, 0, 0, NULL},
    {"daemon", "state_dir", K_STATE_DIR, 0, 0, 0, NULL},
    {"daemon", "devices", K_DEVICES, 0, 0, 0, NULL},
    {"daemon", "socket_group", K_GROUP, 0, 0, 0, NULL},
    {"daemon", "log_level", K_LOG_LEVEL, 0, 0, 0, NULL},
    {"limits", "max_connections", K_INT, offsetof(td_config, max_conns), 1, 65536,
     "connections, at least 1"},
    {"limits", "max_queued", K_INT, offsetof(td_config, max_queued), 0, 1000000,
     "queued jobs, 0 for no limit"},
    {"limits", "max_queued_per_user", K_INT, offsetof(td_config, max_queued_per_user), 0, 1000000,
     "queued jobs, 0 for no limit"},
    {"limits", "max_devices_per_user", K_INT, offsetof(td_config, max_devices_per_user), 0,
     TD_MAX_DEVICES, "devices, 0 for no limit"},
    {"limits", "max_connections_per_user", K_INT, offsetof(td_config, max_conns_per_user), 0, 65536,
     "connections, 0 for no limit"},
    {"limits", "max_streams_per_connection", K_INT, offsetof(td_config, max_streams_per_conn), 1,
     1024, "streams, at least 1"},
    {"limits", "max_exports_per_user", K_INT, offsetof(td_config, max_exports_per_user), 0, 1024,
     "exports, 0 for no limit"},
    {"limits", "max_work_per_user", K_INT, offsetof(td_config, max_work_per_user), 0, 1024,
     "requests, 0 for no limit"},
    {"limits", "work_timeout_s", K_SECONDS_OR_0, offsetof(td_config, work_timeout_s), 0,
     (int)WORK_TIMEOUT_MAX, "seconds a request may run, 0 for no limit"},
    {"server", "hello_timeout_s", K_SECONDS, offsetof(td_config, hello_timeout_s), 0,
     (int)HELLO_TIMEOUT_MAX, "seconds a new connection has to say hello"},
    {"server", "idle_timeout_s", K_SECONDS_OR_0, offsetof(td_config, idle_timeout_s), 0,
     (int)IDLE_TIMEOUT_MAX, "seconds a connection may sit idle, 0 for no limit"},
    {"cuda", "nccl_timeout_s", K_SECONDS, offsetof(td_config, nccl_timeout_s), 0,
     (int)NCCL_TIMEOUT_MAX, "seconds a collective may take"},
    {"metrics", "prometheus_textfile", K_PROM_PATH, 0, 0, 0, NULL},
    {"metrics", "prometheus_interval_s", K_SECONDS, offsetof(td_config, prom_interval_s), 0,
     (int)PROM_INTERVAL_MAX, "seconds between writes of the file"},
    {"metrics", "prometheus_textfile_mode", K_MODE, offsetof(td_config, prom_mode), 0, 0666, NULL},
    {"metrics", "disk_full_wait_s", K_SECONDS, offsetof(td_config, disk_full_wait_s), 0,
     (int)DISK_FULL_WAIT_MAX, "seconds a full disk is waited out"},
#define CL(field)   (offsetof(td_config, cluster) + offsetof(td_cluster_config, field))
#define CLSZ(field) (int)sizeof(((td_cluster_config *)0)->field)
    {"cluster", "launcher", K_LAUNCHER, 0, 0, 0, NULL},
    {"cluster", "launcher_path", K_PATH, CL(launcher_path), 0, CLSZ(launcher_path),
     "the srun or mpirun executable"},
    {"cluster", "scancel_path", K_PATH, CL(scancel_path), 0, CLSZ(scancel_path),
     "the scancel executable"},
    {"cluster", "hostfile", K_PATH, CL(hostfile), 0, CLSZ(hostfile), "mpirun's host file"},
    {"cluster", "shared_dir", K_PATH, CL(shared_dir), 0, CLSZ(shared_dir),
     "a directory every node mounts"},
    {"cluster", "traind_path", K_PATH, CL(traind_path), 0, CLSZ(traind_path),
     "the traind executable the ranks run"},
    {"cluster", "launcher_args", K_WORDS, CL(launcher_args), 0, CLSZ(launcher_args),
     "more arguments for the launcher"},
    {"cluster", "nccl_socket_ifname", K_WORDS, CL(nccl_ifname), 0, CLSZ(nccl_ifname),
     "NCCL_SOCKET_IFNAME"},
    {"cluster", "mpi_tcp_if_include", K_WORDS, CL(mpi_ifname), 0, CLSZ(mpi_ifname),
     "Open MPI's btl_tcp_if_include"},
    {"cluster", "max_running", K_INT, CL(max_running), 0, 65536,
     "jobs that span nodes running at once, 0 for no limit"},
    {"cluster", "stop_timeout_s", K_SECONDS, CL(stop_timeout_s), 0, 86400,
     "seconds the ranks have to checkpoint and stop"},
    {"cluster", "kill_timeout_s", K_SECONDS, CL(kill_timeout_s), 0, 3600,
     "seconds from ending the launcher to SIGKILL"},
    {"cluster", "rank_exit_wait_s", K_INT, CL(exit_wait_s), 1, 65535,
     "seconds srun lets the other ranks run once one has ended"},
#undef CL
#undef CLSZ
};

typedef struct load_ctx {
    td_config *cfg;
    const char *path;
    FILE *f;
    int lineno;        /* the line inih is looking at */
    int max_line;      /* bytes of a line inih takes, its newline left out */
    int long_line;     /* first line longer than that, or 0 */
    int err_line;      /* line of the first error the handler found, or 0 */
    char err_msg[512]; /* that error, without the "path:line: " */
} load_ctx;

void td_config_defaults(td_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    snprintf(cfg->socket_path, sizeof(cfg->socket_path), "/run/traind/traind.sock");
    snprintf(cfg->state_dir, sizeof(cfg->state_dir), "/var/lib/traind");
    snprintf(cfg->db_path, sizeof(cfg->db_path), "/var/lib/traind/traind.db");
    cfg->dev_kind = TD_DEVICE_CPU;
    cfg->ncpu_devices = 1;
    cfg->nccl_timeout_s = NCCL_TIMEOUT_DEFAULT;
    cfg->max_conns = TD_MAX_CONNS;
    cfg->max_conns_per_user = TD_MAX_CONNS_PER_USER;
    cfg->max_streams_per_conn = TD_MAX_STREAMS_PER_CONN;
    cfg->max_exports_per_user = TD_MAX_EXPORTS_PER_USER;
    cfg->max_work_per_user = TD_MAX_WORK_PER_USER;
    cfg->work_timeout_s = TD_WORK_TIMEOUT_S;
    cfg->max_queued_per_user = TD_MAX_QUEUED_PER_USER;
    cfg->hello_timeout_s = TD_HELLO_TIMEOUT_S;
    cfg->idle_timeout_s = TD_IDLE_TIMEOUT_S;
    cfg->log_level = TD_LOG_INFO;
    cfg->socket_gid = -1;
    cfg->prom_interval_s = TD_PROM_INTERVAL_S;
    cfg->prom_mode = TD_PROM_MODE;
    cfg->disk_full_wait_s = TD_MQ_FULL_WAIT_MS / 1e3;
    cfg->cluster.max_running = TD_CLUSTER_MAX_RUNNING;
    cfg->cluster.stop_timeout_s = TD_CLUSTER_STOP_S;
    cfg->cluster.kill_timeout_s = TD_CLUSTER_KILL_S;
    cfg->cluster.exit_wait_s = TD_CLUSTER_EXIT_WAIT_S;
}

/* [cluster] launcher: srun, mpirun, or empty for none. */
static int set_launcher(td_config *cfg, const char *value, char *why, size_t size)
{
    if (strcmp(value, "srun") == 0)
        cfg->cluster.launcher = TD_LAUNCHER_SRUN;
    else if (strcmp(value, "mpirun") == 0)
        cfg->cluster.launcher = TD_LAUNCHER_MPIRUN;
    else if (value[0] == '\0')
        cfg->cluster.launcher = TD_LAUNCHER_NONE;
    else {
        snprintf(why, size, "expected srun, mpirun, or nothing for no launcher");
        return -1;
    }
    return 0;
}

/* An absolute path (or nothing: the key's default) that fits k's buffer. */
static int set_path(td_config *cfg, const struct key_def *k, const char *value, char *why,
                    size_t size)
{
    size_t n = strlen(value);

    if (n > 0 && value[0] != '/') {
        snprintf(why, size, "expected an absolute path (%s)", k->meaning);
        return -1;
    }
    if (n >= (size_t)k->hi) {
        snprintf(why, size, "the path is %zu bytes; the limit is %d", n, k->hi - 1);
        return -1;
    }
    memcpy((char *)cfg + k->off, value, n + 1);
    return 0;
}

/* Printable ASCII that fits k's buffer: the value goes into a command line or an environment
 * variable of the launcher. */
static int set_words(td_config *cfg, const struct key_def *k, const char *value, char *why,
                     size_t size)
{
    size_t n = strlen(value);

    for (size_t i = 0; i < n; i++)
        if (value[i] < 0x20 || value[i] > 0x7e) {
            snprintf(why, size, "expected printable ASCII (%s); byte %zu is 0x%02x", k->meaning, i,
                     (unsigned char)value[i]);
            return -1;
        }
    if (n >= (size_t)k->hi) {
        snprintf(why, size, "the value is %zu bytes; the limit is %d", n, k->hi - 1);
        return -1;
    }
    memcpy((char *)cfg + k->off, value, n + 1);
    return 0;
}

/* The keys of [cluster] that only make sense together. */
static int check_cluster(const td_config *cfg, const char *path, td_error_t *err)
{
    const td_cluster_config *c = &cfg->cluster;
    const char *name = c->launcher == TD_LAUNCHER_SRUN ? "srun" : "mpirun";

    if (c->launcher == TD_LAUNCHER_NONE)
        return 0;
    if (c->shared_dir[0] == '\0')
        return td_error_set(err, TD_EINVAL,
                            "%s: [cluster] launcher = %s needs shared_dir (a directory every node "
                            "mounts, for the jobs' specs and checkpoints)",
                            path, name);
    if (c->launcher == TD_LAUNCHER_MPIRUN && c->hostfile[0] == '\0')
        return td_error_set(err, TD_EINVAL,
                            "%s: [cluster] launcher = mpirun needs hostfile (mpirun's --hostfile)",
                            path);
    return 0;
}

/* The Prometheus file: an absolute path named *.prom (the node exporter's textfile collector
 * reads nothing else), with room for the ".tmp" it is written through; empty for none. */
int td_config_set_prom_path(td_config *cfg, const char *path, char *why, size_t size)
{
    size_t n = strlen(path);

    if (n == 0) {
        cfg->prom_path[0] = '\0';
        return 0;
    }
    if (path[0] != '/' || n < 7 || strcmp(path + n - 5, ".prom") != 0 || path[n - 6] == '/') {
        snprintf(why, size,
                 "expected an absolute path ending in .prom (the node exporter's textfile "
                 "collector reads only *.prom files)");
        return -1;
    }
    if (n + 4 >= sizeof(cfg->prom_path)) {
        snprintf(why, size, "the path is %zu bytes; the limit is %zu", n,
                 sizeof(cfg->prom_path) - 5);
        return -1;
    }
    memcpy(cfg->prom_path, path, n + 1);
    return 0;
}

/* A file mode in octal (0644), with no bit past rw for owner, group and others. */
static int set_mode(td_config *cfg, const struct key_def *k, const char *value, char *why,
                    size_t size)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(value, &end, 8);
    if (errno != 0 || end == value || *end != '\0' || value[0] != '0' || v < 0 ||
        (v & ~(long)k->hi) != 0 || (v & 0600) != 0600) {
        snprintf(why, size,
                 "expected a mode in octal with a leading 0, from 0600 to 0666 and no execute "
                 "bit (0644: the node exporter, running as another user, reads the file)");
        return -1;
    }
    *(int *)((char *)cfg + k->off) = (int)v;
    return 0;
}

/* The socket path must fit sockaddr_un's sun_path with its NUL: libuv 1.44 would silently
 * cut a longer one and bind somewhere else. */
int td_config_set_socket(td_config *cfg, const char *path, char *why, size_t size)
{
    size_t n = strlen(path);

    if (n == 0) {
        snprintf(why, size, "expected the path of the control socket");
        return -1;
    }
    if (n >= sizeof(cfg->socket_path)) {
        snprintf(why, size, "the path is %zu bytes; the limit is %zu", n,
                 sizeof(cfg->socket_path) - 1);
        return -1;
    }
    memcpy(cfg->socket_path, path, n + 1);
    return 0;
}

/* Sets the state directory and the database path inside it. */
int td_config_set_state_dir(td_config *cfg, const char *dir, char *why, size_t size)
{
    size_t n = strlen(dir);

    if (n == 0) {
        snprintf(why, size, "expected the directory that holds traind.db");
        return -1;
    }
    if (n >= sizeof(cfg->state_dir)) {
        snprintf(why, size, "the path is %zu bytes; the limit is %zu", n,
                 sizeof(cfg->state_dir) - 1);
        return -1;
    }
    memcpy(cfg->state_dir, dir, n + 1);
    snprintf(cfg->db_path, sizeof(cfg->db_path), "%s/traind.db", dir);
    return 0;
}

/* cuda:0,1,3 into cfg: ordinals from 0 to TD_MAX_DEVICES - 1, each once, kept ascending
 * (device order is rank order). */
static int set_cuda_list(td_config *cfg, const char *list, char *why, size_t size)
{
    int seen[TD_MAX_DEVICES] = {0};
    const char *p = list;

    for (;;) {
        char *end;
        long v;
        errno = 0;
        v = strtol(p, &end, 10);
        if (errno != 0 || end == p || *p < '0' || *p > '9' || v >= TD_MAX_DEVICES ||
            (*end != ',' && *end != '\0')) {
            snprintf(why, size,
                     "expected cuda:all or cuda:N[,N...] with each N a GPU number from 0 to %d",
                     TD_MAX_DEVICES - 1);
            return -1;
        }
        if (seen[v]) {
            snprintf(why, size, "cuda:%ld is named twice", v);
            return -1;
        }
        seen[v] = 1;
        if (*end == '\0')
            break;
        p = end + 1;
    }
    cfg->ncuda_devices = 0;
    for (int i = 0; i < TD_MAX_DEVICES; i++)
        if (seen[i])
            cfg->cuda_devices[cfg->ncuda_devices++] = i;
    return 0;
}

/* cpu:N, cuda:all or cuda:N[,N...]. Whether the GPUs named exist is known only once CUDA is
 * asked, at start (daemon.c); a build without CUDA refuses cuda: here. */
int td_config_set_devices(td_config *cfg, const char *spec, char *why, size_t size)
{
    char *end;
    long v;

    if (strncmp(spec, "cuda:", 5) == 0) {
        if (!td_device_kind_built(TD_DEVICE_CUDA)) {
            snprintf(why, size, "this traind was built without CUDA; its devices are cpu:N");
            return -1;
        }
        if (strcmp(spec + 5, "all") == 0) {
            cfg->cuda_all = 1;
            cfg->ncuda_devices = 0;
        } else if (set_cuda_list(cfg, spec + 5, why, size) != 0) {
            return -1;
        } else {
            cfg->cuda_all = 0;
        }
        cfg->dev_kind = TD_DEVICE_CUDA;
        return 0;
    }
    if (strncmp(spec, "cpu:", 4) != 0)
        goto bad;
    errno = 0;
    v = strtol(spec + 4, &end, 10);
    if (errno != 0 || end == spec + 4 || *end != '\0' || v < 1 || v > TD_MAX_DEVICES)
        goto bad;
    cfg->dev_kind = TD_DEVICE_CPU;
    cfg->ncpu_devices = (int)v;
    return 0;
bad:
    snprintf(why, size, "expected cpu:N with N from 1 to %d, cuda:all or cuda:N[,N...]",
             TD_MAX_DEVICES);
    return -1;
}

int td_config_set_log_level(td_config *cfg, const char *name, char *why, size_t size)
{
    static const char *const names[] = {"err", "warning", "notice", "info", "debug"};

    for (int i = 0; i < 5; i++)
        if (strcmp(name, names[i]) == 0) {
            cfg->log_level = TD_LOG_ERR + i;
            return 0;
        }
    snprintf(why, size, "expected err, warning, notice, info or debug");
    return -1;
}

/* A group name, or a number taken as a gid as it is; empty for the daemon's own group. The
 * name is resolved now, so that a typo stops the start instead of leaving a socket nobody
 * may use. */
int td_config_set_group(td_config *cfg, const char *group, char *why, size_t size)
{
    struct group gr, *found = NULL;
    size_t buflen = 4096;
    char *buf = NULL, *end;
    int rc = -1, e;
    long v;

    if (group[0] == '\0') {
        cfg->socket_group[0] = '\0';
        cfg->socket_gid = -1;
        return 0;
    }
    if (strlen(group) >= sizeof(cfg->socket_group)) {
        snprintf(why, size, "expected a group name or number");
        return -1;
    }
    errno = 0;
    v = strtol(group, &end, 10);
    if (*end == '\0' && errno == 0 && v >= 0 && v < INT_MAX) {
        cfg->socket_gid = v;
        snprintf(cfg->socket_group, sizeof(cfg->socket_group), "%s", group);
        return 0;
    }
    for (;;) {
        char *nbuf = realloc(buf, buflen);
        if (nbuf == NULL) {
            snprintf(why, size, "out of memory looking up the group");
            goto out;
        }
        buf = nbuf;
        e = getgrnam_r(group, &gr, buf, buflen, &found);
        if (e != ERANGE || buflen >= GROUP_BUF_MAX)
            break;
        buflen *= 2;
    }
    if (found == NULL) {
        if (e != 0)
            snprintf(why, size, "cannot look the group up: %s", strerror(e));
        else
            snprintf(why, size, "no such group");
        goto out;
    }
    cfg->socket_gid = found->gr_gid;
    snprintf(cfg->socket_group, sizeof(cfg->socket_group), "%s", group);
    rc = 0;
out:
    free(buf);
    return rc;
}

static int set_int(td_config *cfg, const struct key_def *k, const char *value, char *why,
                   size_t size)
{
    char *end;
    long v;

    errno = 0;
    v = strtol(value, &end, 10);
    if (errno != 0 || end == value || *end != '\0' || v < k->lo || v > k->hi) {
        snprintf(why, size, "expected an integer from %d to %d (%s)", k->lo, k->hi, k->meaning);
        return -1;
    }
    *(int *)((char *)cfg + k->off) = (int)v;
    return 0;
}

static int set_seconds(td_config *cfg, const struct key_def *k, const char *value, char *why,
                       size_t size)
{
    char *end;
    double v;

    int zero = k->kind == K_SECONDS_OR_0;

    errno = 0;
    v = strtod(value, &end);
    if (errno != 0 || end == value || *end != '\0' || !(zero ? v >= 0 : v > 0) || v > k->hi) {
        snprintf(why, size, "expected a number %s 0 and at most %d (%s)", zero ? "from" : "above",
                 k->hi, k->meaning);
        return -1;
    }
    *(double *)((char *)cfg + k->off) = v;
    return 0;
}

static int set_key(td_config *cfg, const struct key_def *k, const char *value, char *why,
                   size_t size)
{
    switch (k->kind) {
    case K_SOCKET:
        return td_config_set_socket(cfg, value, why, size);
    case K_STATE_DIR:
        return td_config_set_state_dir(cfg, value, why, size);
    case K_DEVICES:
        return td_config_set_devices(cfg, value, why, size);
    case K_GROUP:
        return td_config_set_group(cfg, value, why, size);
    case K_LOG_LEVEL:
        return td_config_set_log_level(cfg, value, why, size);
    case K_INT:
        return set_int(cfg, k, value, why, size);
    case K_SECONDS:
    case K_SECONDS_OR_0:
        return set_seconds(cfg, k, value, why, size);
    case K_PROM_PATH:
        return td_config_set_prom_path(cfg, value, why, size);
    case K_MODE:
        return set_mode(cfg, k, value, why, size);
    case K_LAUNCHER:
        return set_launcher(cfg, value, why, size);
    case K_PATH:
        return set_path(cfg, k, value, why, size);
    case K_WORDS:
        return set_words(cfg, k, value, why, size);
    }
    return -1;
}

/* Copies at most VALUE_SHOWN bytes of s into out with anything unprintable as '?', so a
 * message about a binary or endless value stays one readable line. */
static void shown(char *out, size_t size, const char *s)
{
    size_t i = 0;

    for (; s[i] != '\0' && i < VALUE_SHOWN && i + 4 < size; i++)
        out[i] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (s[i] != '\0' && i + 4 < size) {
        memcpy(out + i, "...", 3);
        i += 3;
    }
    out[i] = '\0';
}

/* inih's handler: one key. Returns 1 to go on, 0 for an error (inih keeps reading, but
 * only the first error is kept). */
static int on_key(void *user, const char *section, const char *name, const char *value)
{
    load_ctx *c = user;
    char why[256], v[VALUE_SHOWN + 4];
    int section_known = 0;

    if (c->err_line != 0)
        return 1;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        if (strcmp(section, keys[i].section) != 0)
            continue;
        section_known = 1;
        if (strcmp(name, keys[i].name) != 0)
            continue;
        if (set_key(c->cfg, &keys[i], value, why, sizeof(why)) == 0)
            return 1;
        shown(v, sizeof(v), value);
        snprintf(c->err_msg, sizeof(c->err_msg), "bad value \"%s\" for key \"%s\" in [%s]: %s", v,
                 name, section, why);
        c->err_line = c->lineno;
        return 0;
    }
    if (section[0] == '\0')
        snprintf(c->err_msg, sizeof(c->err_msg),
                 "key \"%s\" is outside any section; put it under [daemon], [server], [limits], "
                 "[metrics], [cuda] or [cluster]",
                 name);
    else if (!section_known)
        snprintf(c->err_msg, sizeof(c->err_msg),
                 "unknown section [%s] (key \"%s\"); the sections are [daemon], [server], "
                 "[limits], [metrics], [cuda] and [cluster]",
                 section, name);
    else
        snprintf(c->err_msg, sizeof(c->err_msg), "unknown key \"%s\" in [%s]", name, section);
    c->err_line = c->lineno;
    return 0;
}

/* inih's reader: fgets that counts lines. A line longer than inih's buffer is swallowed
 * whole and handed on as "!", which inih rejects, so it stops being two half lines. */
static char *read_line(char *str, int num, void *stream)
{
    load_ctx *c = stream;
    size_t n;
    int ch;

    if (fgets(str, num, c->f) == NULL)
        return NULL;
    c->lineno++;
    c->max_line = num - 1;
    n = strlen(str);
    if (n + 1 < (size_t)num || str[n - 1] == '\n')
        return str;
    ch = fgetc(c->f);
    if (ch == EOF || ch == '\n')
        return str; /* the line just fits */
    while (ch != EOF && ch != '\n')
        ch = fgetc(c->f);
    if (c->long_line == 0)
        c->long_line = c->lineno;
    snprintf(str, (size_t)num, "!\n");
    return str;
}

/* The offset of the first NUL byte in f, or -1 when there is none; f is rewound. fgets (and
 * so inih) would take a NUL for the end of its line and read a file of them as empty lines:
 * a file that is not text is refused instead of read as an empty configuration. */
static long first_nul(FILE *f)
{
    char buf[4096];
    long off = 0, at = -1;
    size_t n;

    while (at < 0 && (n = fread(buf, 1, sizeof(buf), f)) > 0) {
        const char *p = memchr(buf, '\0', n);
        if (p != NULL)
            at = off + (long)(p - buf);
        off += (long)n;
    }
    rewind(f);
    return at;
}

int td_config_load(td_config *cfg, const char *path, int must_exist, int *loaded, td_error_t *err)
{
    load_ctx c = {.cfg = cfg, .path = path};
    int line, rc = 0;
    long nul;

    *loaded = 0;
    c.f = fopen(path, "re");
    if (c.f == NULL) {
        if (errno == ENOENT && !must_exist)
            return 0;
        return td_error_set(err, TD_EINVAL, "%s: cannot open: %s", path, strerror(errno));
    }
    nul = first_nul(c.f);
    if (nul >= 0) {
        rc = td_error_set(err, TD_EINVAL,
                          "%s: byte %ld is a NUL byte; a configuration file is text (INI)", path,
                          nul);
        fclose(c.f);
        return rc;
    }
    line = ini_parse_stream(read_line, &c, on_key, &c);
    if (ferror(c.f))
        rc = td_error_set(err, TD_EINVAL, "%s: cannot read: %s", path, strerror(errno));
    else if (line < 0)
        rc = td_error_set(err, TD_EINVAL, "%s: cannot read: out of memory", path);
    else if (line > 0 && line == c.err_line)
        rc = td_error_set(err, TD_EINVAL, "%s:%d: %s", path, line, c.err_msg);
    else if (line > 0 && line == c.long_line)
        rc = td_error_set(err, TD_EINVAL, "%s:%d: the line is longer than %d bytes", path, line,
                          c.max_line);
    else if (line > 0)
        rc = td_error_set(err, TD_EINVAL,
                          "%s:%d: syntax error: expected \"key = value\", \"[section]\" or a "
                          "comment starting with ; or #",
                          path, line);
    fclose(c.f);
    if (rc == 0)
        rc = check_cluster(cfg, path, err);
    *loaded = rc == 0;
    return rc;
}
