/* Launched jobs (launch.h): the launcher's command line, the job's directory on the shared file
 * system, the launcher as a child process of the loop, rank 0's frames read on a thread of the
 * launch's own, the launcher's stderr, the escalation of a stop, and the one outcome.
 *
 * Threads. The loop thread does everything but two things: the job's directory and spec are
 * written on libuv's threadpool (a shared file system may be slow), and rank 0's stdout is read
 * by the launch's reader thread, which pushes the metric rows into the metric queue (a push
 * blocks while the queue is full: the reader stops reading, the pipe fills and rank 0 waits in
 * its write, so the ranks are held up, never the loop) and leaves what the loop must hear in
 * the shared part of the launch (guarded by mu), then wakes the loop through the uv_async_t.
 * The store thread's failure callback for the launch's sink also writes there. No lock is held
 * while calling into the metric queue. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "common/td_log.h"
#include "common/td_text.h"
#include "common/td_tsan.h"
#include "daemon/launch.h"
#include "proto/proto.h"

#define READ_CHUNK   65536     /* bytes the reader thread reads at once */
#define STDERR_CHUNK 65536     /* bytes of stderr read at once on the loop */
#define PIPE_BYTES   (1 << 20) /* the stdout pipe's capacity asked for: a few frames */
#define LAST_LINES   3         /* lines of stderr a failure without a report quotes */
#define SPEC_FILE    "job.spec"
#define SPEC_TMP     ".job.spec.tmp"

extern char **environ;

enum { STOP_NONE, STOP_CANCEL, STOP_INTERRUPT };

/* A line for the job's log, waiting for the loop. */
typedef struct log_item {
    struct log_item *next;
    int level;
    char line[];
} log_item;

/* What the reader thread (and the store thread's callback) leave for the loop; guarded by mu. */
typedef struct shared {
    int world_new;
    td_launch_world world; /* names malloc'd; handed to the loop with world_new */
    int started_new;
    int64_t start_step, total_steps;
    int progress_new;
    int64_t progress;
    log_item *logs, *logs_tail;
    size_t nlogs, dropped_logs;
    int done_seen;
    char done_state[TD_STORE_MAX_STATE];
    int64_t done_step;
    td_error_t done_err;
    td_launch_failed *failed; /* malloc'd; nfailed */
    size_t nfailed;
    int stream_bad_new;
    td_error_t stream_err; /* rank 0's stream broke the protocol */
    td_error_t store_err;  /* a push or the final flush failed */
    int store_failed_new;
    td_error_t store_failed; /* the store thread gave up on the sink's rows */
    int reader_end;          /* the reader has ended: every row pushed is durable or failed */
} shared;

/* The user the ranks run as: name and home, from passwd. */
typedef struct user_info {
    char name[64];
    char home[512];
} user_info;

struct td_launch {
    uv_loop_t *loop;
    int64_t job;
    td_launch_cbs cbs;
    td_cluster_config cluster;
    td_mq *mq;
    uid_t uid;
    gid_t gid; /* -1 until the threadpool has read the user's primary group */
    user_info user;
    int nodes, min_nodes;
    char exclude[1024];
    char host[64];
    char job_dir[600];
    char spec_path[700];
    void *spec_bytes; /* the spec, until the threadpool has written it */
    size_t spec_len;
    char jobname[128];
    const char *launcher_name; /* "srun", "mpirun" */

    /* handles; the memory goes when every one initialised has closed */
    uv_async_t async;
    uv_timer_t timer;
    uv_pipe_t err_pipe;
    uv_process_t proc;
    uv_work_t work;
    int handles, closed;
    int have_pipe, have_proc;
    int closing;

    /* the reader thread */
    pthread_t reader;
    int have_reader;
    int out_fd;     /* the read end of the launcher's stdout */
    int wake_fd[2]; /* the loop writes a byte to stop the reader */
    td_mq_sink *sink;
    pthread_mutex_t mu;
    shared sh;

    /* the loop's own */
    td_error_t prep_err; /* the threadpool's: the directory, the spec */
    int preparing;
    int spawned, exited, stderr_closed, reader_done, finished;
    int pid;
    int64_t exit_status;
    int term_signal;
    int stop;      /* STOP_*: what was asked of the ranks */
    int escalated; /* 0 signalled; 1 launcher ended (scancel, SIGTERM); 2 SIGKILL */
    int draining;  /* the drain timer runs (after the exit) */
    td_error_t fail_why;
    int64_t step;
    int saw_started;
    td_launch_world world; /* names malloc'd */
    int have_world;
    td_launch_death death;
    int have_death;
    char usage[TD_LAUNCH_LINE_MAX]; /* "traind rank: ..." */
    char last[LAST_LINES][TD_LAUNCH_LINE_MAX];
    int nlast;
    char line[TD_LAUNCH_LINE_MAX];
    size_t line_len;
    int line_cut;
    int logged, unlogged;
    char errbuf[STDERR_CHUNK];
    td_launch_failed *failed;
    size_t nfailed;
};

/* ---- the command line (pure) ---- */

/* Appends one argument, printf-formatted, to cmd. */
static int __attribute__((format(printf, 2, 3))) add(td_launch_cmd *cmd, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (cmd->argc >= TD_LAUNCH_MAX_ARGS || cmd->used >= sizeof(cmd->buf))
        return TD_E2BIG;
    va_start(ap, fmt);
    n = vsnprintf(cmd->buf + cmd->used, sizeof(cmd->buf) - cmd->used, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(cmd->buf) - cmd->used)
        return TD_E2BIG;
    cmd->argv[cmd->argc++] = cmd->buf + cmd->used;
    cmd->argv[cmd->argc] = NULL;
    cmd->used += (size_t)n + 1;
    return 0;
}

/* Appends launcher_args, split at spaces. */
static int add_words(td_launch_cmd *cmd, const char *words)
{
    const char *p = words;

    while (*p != '\0') {
        size_t n;
        while (*p == ' ')
            p++;
        n = strcspn(p, " ");
        if (n > 0 && add(cmd, "%.*s", (int)n, p) != 0)
            return TD_E2BIG;
        p += n;
    }
    return 0;
}

static const char *launcher_file(const td_cluster_config *c)
{
    if (c->launcher_path[0] != '\0')
        return c->launcher_path;
    return c->launcher == TD_LAUNCHER_SRUN ? "srun" : "mpirun";
}

static int srun_argv(const td_launch_plan *p, td_launch_cmd *cmd)
{
    const td_cluster_config *c = p->cluster;
    int rc = add(cmd, "%s", launcher_file(c));

    rc = rc ? rc : add(cmd, "--mpi=pmix");
    if (p->min_nodes < p->nodes)
        rc = rc ? rc : add(cmd, "--nodes=%d-%d", p->min_nodes, p->nodes);
    else
        rc = rc ? rc : add(cmd, "--nodes=%d", p->nodes);
    rc = rc ? rc : add(cmd, "--ntasks-per-node=1");
    rc = rc ? rc : add(cmd, "--job-name=traind-%s-%lld", p->host, (long long)p->job);
    /* A rank that fails exits 1 once rank 0 has reported it: the step must not be killed
     * before. One that dies leaves the others waiting in a collective: --wait ends them. */
    rc = rc ? rc : add(cmd, "--kill-on-bad-exit=0");
    rc = rc ? rc : add(cmd, "--wait=%d", c->exit_wait_s);
    rc = rc ? rc : add(cmd, "--input=none");
    if (p->exclude != NULL && p->exclude[0] != '\0')
        rc = rc ? rc : add(cmd, "--exclude=%s", p->exclude);
    return rc ? rc : add_words(cmd, c->launcher_args);
}

static int mpirun_argv(const td_launch_plan *p, td_launch_cmd *cmd)
{
    const td_cluster_config *c = p->cluster;
    int rc = add(cmd, "%s", launcher_file(c));

    rc = rc ? rc : add(cmd, "--hostfile");
    rc = rc ? rc : add(cmd, "%s", c->hostfile);
    rc = rc ? rc : add(cmd, "-np");
    rc = rc ? rc : add(cmd, "%d", p->nodes);
    /* One process per node, and each free to use all of its node's cores. */
    rc = rc ? rc : add(cmd, "--map-by");
    rc = rc ? rc : add(cmd, "node");
    rc = rc ? rc : add(cmd, "--bind-to");
    rc = rc ? rc : add(cmd, "none");
    if (c->mpi_ifname[0] != '\0') {
        rc = rc ? rc : add(cmd, "--mca");
        rc = rc ? rc : add(cmd, "btl_tcp_if_include");
        rc = rc ? rc : add(cmd, "%s", c->mpi_ifname);
        rc = rc ? rc : add(cmd, "--mca");
        rc = rc ? rc : add(cmd, "oob_tcp_if_include");
        rc = rc ? rc : add(cmd, "%s", c->mpi_ifname);
    }
    if (c->nccl_ifname[0] != '\0') {
        rc = rc ? rc : add(cmd, "-x");
        rc = rc ? rc : add(cmd, "NCCL_SOCKET_IFNAME");
    }
    return rc ? rc : add_words(cmd, c->launcher_args);
}

int td_launch_argv(const td_launch_plan *p, td_launch_cmd *cmd, td_error_t *err)
{
    int rc;

    cmd->argc = 0;
    cmd->used = 0;
    cmd->argv[0] = NULL;
    if (p->cluster->launcher == TD_LAUNCHER_SRUN)
        rc = srun_argv(p, cmd);
    else if (p->cluster->launcher == TD_LAUNCHER_MPIRUN)
        rc = mpirun_argv(p, cmd);
    else
        return td_error_set(err, TD_EINVAL, "no launcher is configured ([cluster] launcher)");
    rc = rc ? rc : add(cmd, "%s", p->traind);
    rc = rc ? rc : add(cmd, "rank");
    rc = rc ? rc : add(cmd, "--spec");
    rc = rc ? rc : add(cmd, "%s", p->spec);
    rc = rc ? rc : add(cmd, "--job");
    rc = rc ? rc : add(cmd, "%lld", (long long)p->job);
    rc = rc ? rc : add(cmd, "--checkpoint-dir");
    rc = rc ? rc : add(cmd, "%s", p->ckpt_dir);
    if (rc != 0)
        return td_error_set(err, TD_E2BIG,
                            "the launcher's command line is longer than %d arguments or %d bytes",
                            TD_LAUNCH_MAX_ARGS, TD_LAUNCH_ARGV_BYTES);
    return 0;
}

/* The daemon's host name, short (up to the first dot). */
static void short_host(char *out, size_t size)
{
    if (gethostname(out, size) != 0 || out[0] == '\0')
        snprintf(out, size, "localhost");
    out[size - 1] = '\0';
    out[strcspn(out, ".")] = '\0';
}

int td_launch_dir_prefix(const td_cluster_config *c, char *out, size_t size, td_error_t *err)
{
    char host[64];

    short_host(host, sizeof(host));
    if (snprintf(out, size, "%s/%s-job-", c->shared_dir, host) >= (int)size)
        return td_error_set(err, TD_E2BIG, "[cluster] shared_dir: too long a path");
    return 0;
}

int td_launch_job_dir(const td_cluster_config *c, int64_t job, char *out, size_t size,
                      td_error_t *err)
{
    char host[64];

    short_host(host, sizeof(host));
    if (snprintf(out, size, "%s/%s-job-%lld", c->shared_dir, host, (long long)job) >= (int)size)
        return td_error_set(err, TD_E2BIG,
                            "[cluster] shared_dir: the job's directory in it is "
                            "too long a path");
    return 0;
}

/* ---- the launcher's report of a death (pure) ---- */

/* Copies at most size - 1 bytes of s up to the first of stop (or the end) into out. */
static const char *copy_until(char *out, size_t size, const char *s, const char *stop)
{
    size_t n = strcspn(s, stop);

    snprintf(out, size, "%.*s", (int)(n < size ? n : size - 1), s);
    return s + n;
}

int td_launch_parse_death(const char *line, td_launch_death *out)
{
    static const char srun_pfx[] = "srun: error: ";
    static const char mpi_pfx[] = "process rank ";
    const char *p, *q;
    char *end;
    long task;

    memset(out, 0, sizeof(*out));
    /* srun: error: NODE: task N: WHY  (also "tasks 0-1: WHY"; the first task counts) */
    if ((p = strstr(line, srun_pfx)) != NULL) {
        p = copy_until(out->node, sizeof(out->node), p + sizeof(srun_pfx) - 1, ":");
        if (strncmp(p, ": task ", 7) == 0)
            q = p + 7;
        else if (strncmp(p, ": tasks ", 8) == 0)
            q = p + 8;
        else
            return 0;
        task = strtol(q, &end, 10);
        if (end == q || task < 0)
            return 0;
        end += strcspn(end, ":");
        if (*end != ':' || out->node[0] == '\0')
            return 0;
        out->task = (int)task;
        snprintf(out->why, sizeof(out->why), "%s", end[1] == ' ' ? end + 2 : end + 1);
        return 1;
    }
    /* mpirun noticed that process rank N with PID P on node H exited on signal S (NAME). */
    if (strstr(line, "mpirun noticed") != NULL && (p = strstr(line, mpi_pfx)) != NULL) {
        task = strtol(p + sizeof(mpi_pfx) - 1, &end, 10);
        if (end == p + sizeof(mpi_pfx) - 1 || task < 0 || (q = strstr(end, " on node ")) == NULL)
            return 0;
        q = copy_until(out->node, sizeof(out->node), q + 9, " ");
        if (*q != ' ' || out->node[0] == '\0')
            return 0;
        out->task = (int)task;
        copy_until(out->why, sizeof(out->why), q + 1, "\n");
        /* the sentence's full stop is mpirun's, not the reason's */
        if (out->why[0] != '\0' && out->why[strlen(out->why) - 1] == '.')
            out->why[strlen(out->why) - 1] = '\0';
        return 1;
    }
    return 0;
}

/* ---- the shared part: the reader thread and the store thread write, the loop takes ---- */

/* Queues a line for the job's log; past TD_LAUNCH_LOG_PENDING lines they are counted. */
static void post_log(td_launch *l, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void post_log(td_launch *l, int level, const char *fmt, ...)
{
    char raw[TD_LAUNCH_LINE_MAX];
    log_item *it;
    va_list ap;
    int n;

    va_start(ap, fmt);
    n = vsnprintf(raw, sizeof(raw), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    pthread_mutex_lock(&l->mu);
    if (l->sh.nlogs >= TD_LAUNCH_LOG_PENDING ||
        (it = malloc(sizeof(*it) + strlen(raw) + 1)) == NULL) {
        l->sh.dropped_logs++;
    } else {
        it->next = NULL;
        it->level = level;
        memcpy(it->line, raw, strlen(raw) + 1);
        if (l->sh.logs_tail != NULL)
            l->sh.logs_tail->next = it;
        else
            l->sh.logs = it;
        l->sh.logs_tail = it;
        l->sh.nlogs++;
    }
    pthread_mutex_unlock(&l->mu);
}

/* The sink's failure callback: the store thread, with the queue's lock held. */
static void on_sink_failed(void *ud, void *sink_ud, int64_t job, const td_error_t *err)
{
    td_launch *l = ud;

    (void)sink_ud;
    (void)job;
    pthread_mutex_lock(&l->mu);
    if (l->sh.store_failed.code == 0) {
        l->sh.store_failed = *err;
        l->sh.store_failed_new = 1;
    }
    pthread_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
}

/* ---- rank 0's frames (the reader thread) ---- */

/* An integer field key of m, or TD_EPROTO naming it (as what, e.g. "failed[].node"; NULL:
 * key). */
static int get_field(const td_pval *m, const char *type, const char *key, const char *what,
                     int64_t lo, int64_t hi, int64_t *out, td_error_t *err)
{
    if (td_pv_int(td_pv_get(m, key), out) != 0 || *out < lo || *out > hi)
        return td_error_set(err, TD_EPROTO,
                            "a \"%s\" frame's %s must be an integer from %lld to %lld", type,
                            what != NULL ? what : key, (long long)lo, (long long)hi);
    return 0;
}

static int get_i(const td_pval *m, const char *type, const char *key, int64_t lo, int64_t hi,
                 int64_t *out, td_error_t *err)
{
    return get_field(m, type, key, NULL, lo, hi, out, err);
}

/* A text field of m escaped into out, or TD_EPROTO naming it. */
static int get_text(const td_pval *m, const char *type, const char *key, char *out, size_t size,
                    td_error_t *err)
{
    size_t len;
    const char *s = td_pv_str(td_pv_get(m, key), &len);

    if (s == NULL)
        return td_error_set(err, TD_EPROTO, "a \"%s\" frame's %s must be a string", type, key);
    td_text_escape(out, size, s, len, TD_TEXT_KEEP_NEWLINES);
    return 0;
}

/* A node's name: 1 to 63 bytes of text. */
static int node_name(const td_pval *v, char *out, td_error_t *err)
{
    size_t len;
    const char *s = td_pv_str(v, &len);

    if (s == NULL || len == 0 || len >= TD_LAUNCH_MAX_NODE_NAME ||
        td_text_check(s, len, NULL) != TD_TEXT_OK)
        return td_error_set(err, TD_EPROTO,
                            "node_names: each must be a name of 1 to %d bytes of text",
                            TD_LAUNCH_MAX_NODE_NAME - 1);
    memcpy(out, s, len);
    out[len] = '\0';
    return 0;
}

static int on_rank(td_launch *l, const td_pval *m, td_error_t *err)
{
    const td_pval *names = td_pv_get(m, "node_names");
    td_launch_world w = {0};
    int64_t v, nodes, per, world;
    int rc;

    if ((rc = get_i(m, "rank", "version", 1, 1, &v, err)) != 0 ||
        (rc = get_i(m, "rank", "nodes", 1, TD_JOB_MAX_NODES, &nodes, err)) != 0 ||
        (rc = get_i(m, "rank", "devices_per_node", 1, TD_JOB_MAX_DEVICES, &per, err)) != 0 ||
        (rc = get_i(m, "rank", "world", 1, TD_JOB_MAX_NODES * TD_JOB_MAX_DEVICES, &world, err)) !=
            0 ||
        (rc = get_text(m, "rank", "device_kind", w.device_kind, sizeof(w.device_kind), err)) != 0)
        return rc;
    if (td_pv_type_of(names) != TD_PV_ARRAY || td_pv_len(names) != (size_t)nodes)
        return td_error_set(err, TD_EPROTO,
                            "a \"rank\" frame's node_names must list its %lld nodes",
                            (long long)nodes);
    w.nodes = (int)nodes;
    w.devices_per_node = (int)per;
    w.world = (int)world;
    w.names = calloc((size_t)nodes, sizeof(*w.names));
    if (w.names == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory for the job's node names");
    for (int64_t i = 0; i < nodes; i++)
        if ((rc = node_name(td_pv_at(names, (size_t)i), w.names[i], err)) != 0) {
            free(w.names);
            return rc;
        }
    pthread_mutex_lock(&l->mu);
    free(l->sh.world.names);
    l->sh.world = w;
    l->sh.world_new = 1;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

static int on_started(td_launch *l, const td_pval *m, td_error_t *err)
{
    int64_t step, total;
    int rc;

    if ((rc = get_i(m, "started", "step", 0, INT64_MAX, &step, err)) != 0 ||
        (rc = get_i(m, "started", "total_steps", 0, INT64_MAX, &total, err)) != 0)
        return rc;
    pthread_mutex_lock(&l->mu);
    l->sh.start_step = step;
    l->sh.total_steps = total;
    l->sh.started_new = 1;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

static int on_progress(td_launch *l, const td_pval *m, td_error_t *err)
{
    int64_t step;
    int rc = get_i(m, "progress", "step", 0, INT64_MAX, &step, err);

    if (rc != 0)
        return rc;
    pthread_mutex_lock(&l->mu);
    l->sh.progress = step;
    l->sh.progress_new = 1;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

/* Each row [key, step, value] into the metric queue (blocking while it is full). A push's
 * error (an earlier batch's) is kept for the outcome; the rows go on being pushed. */
static int on_metrics(td_launch *l, const td_pval *m, td_error_t *err)
{
    const td_pval *rows = td_pv_get(m, "rows");

    if (td_pv_type_of(rows) != TD_PV_ARRAY)
        return td_error_set(err, TD_EPROTO, "a \"metrics\" frame's rows must be an array");
    for (size_t i = 0; i < td_pv_len(rows); i++) {
        const td_pval *r = td_pv_at(rows, i);
        char key[TD_STORE_MAX_KEY];
        int64_t step;
        double value;
        td_error_t e;
        size_t len;
        const char *k = td_pv_str(td_pv_at(r, 0), &len);
        if (td_pv_type_of(r) != TD_PV_ARRAY || td_pv_len(r) != 3 || k == NULL || len == 0 ||
            len >= sizeof(key) || td_text_check(k, len, NULL) != TD_TEXT_OK ||
            td_pv_int(td_pv_at(r, 1), &step) != 0 || step < 0 ||
            td_pv_double(td_pv_at(r, 2), &value) != 0)
            return td_error_set(err, TD_EPROTO,
                                "a \"metrics\" frame's row %zu must be [key: 1 to %d bytes of "
                                "text, step: an integer >= 0, value: a number]",
                                i, TD_STORE_MAX_KEY - 1);
        memcpy(key, k, len);
        key[len] = '\0';
        if (l->sink != NULL && td_mq_push(l->sink, key, step, value, &e) != 0) {
            pthread_mutex_lock(&l->mu);
            if (l->sh.store_err.code == 0)
                l->sh.store_err = e;
            pthread_mutex_unlock(&l->mu);
        }
    }
    return 0;
}

static int on_log(td_launch *l, const td_pval *m, td_error_t *err)
{
    char line[TD_LAUNCH_LINE_MAX];
    int rc = get_text(m, "log", "message", line, sizeof(line), err);

    if (rc == 0)
        post_log(l, TD_LOG_NOTICE, "%s", line);
    return rc;
}

/* The failed devices of a done frame, in the order rank 0 lists them. */
static int done_failed(const td_pval *list, td_launch_failed **out, size_t *n, td_error_t *err)
{
    size_t count = td_pv_len(list);
    int rc = 0;

    *out = NULL;
    *n = 0;
    if (list == NULL)
        return 0;
    if (td_pv_type_of(list) != TD_PV_ARRAY || count > TD_LAUNCH_MAX_FAILED)
        return td_error_set(err, TD_EPROTO,
                            "a \"done\" frame's failed must be a list of at most %d devices",
                            TD_LAUNCH_MAX_FAILED);
    if (count == 0)
        return 0;
    *out = calloc(count, sizeof(**out));
    if (*out == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory for the job's failed devices");
    for (size_t i = 0; i < count && rc == 0; i++) {
        const td_pval *f = td_pv_at(list, i);
        td_launch_failed *d = &(*out)[i];
        int64_t node, dev, code;
        if ((rc = get_field(f, "done", "node", "failed[].node", 0, TD_JOB_MAX_NODES - 1, &node,
                            err)) == 0 &&
            (rc = get_field(f, "done", "device", "failed[].device", 0, TD_JOB_MAX_DEVICES - 1, &dev,
                            err)) == 0 &&
            (rc = get_field(f, "done", "code", "failed[].code", INT32_MIN, 0, &code, err)) == 0 &&
            (rc = get_text(f, "done", "message", d->message, sizeof(d->message), err)) == 0 &&
            (rc = node_name(td_pv_get(f, "node_name"), d->node_name, err)) == 0) {
            d->node = (int)node;
            d->device = (int)dev;
            d->code = (int)code;
        }
    }
    if (rc != 0) {
        free(*out);
        *out = NULL;
        return rc;
    }
    *n = count;
    return 0;
}

static int on_done(td_launch *l, const td_pval *m, td_error_t *err)
{
    static const char *const states[] = {"succeeded", "failed", "cancelled", "interrupted", NULL};
    char state[TD_STORE_MAX_STATE], msg[sizeof(err->msg)];
    td_launch_failed *failed = NULL;
    size_t nfailed = 0;
    int64_t step, code = 0;
    int known = 0, rc;

    if ((rc = get_text(m, "done", "state", state, sizeof(state), err)) != 0)
        return rc;
    for (int i = 0; states[i] != NULL; i++)
        known |= strcmp(state, states[i]) == 0;
    if (!known)
        return td_error_set(err, TD_EPROTO,
                            "a \"done\" frame's state must be succeeded, failed, cancelled or "
                            "interrupted");
    msg[0] = '\0';
    if ((rc = get_i(m, "done", "step", 0, INT64_MAX, &step, err)) != 0)
        return rc;
    if (td_pv_get(m, "code") != NULL &&
        (rc = get_i(m, "done", "code", INT32_MIN, 0, &code, err)) != 0)
        return rc;
    if (td_pv_get(m, "message") != NULL &&
        (rc = get_text(m, "done", "message", msg, sizeof(msg), err)) != 0)
        return rc;
    if ((rc = done_failed(td_pv_get(m, "failed"), &failed, &nfailed, err)) != 0)
        return rc;
    pthread_mutex_lock(&l->mu);
    if (l->sh.done_seen) {
        pthread_mutex_unlock(&l->mu);
        free(failed);
        return td_error_set(err, TD_EPROTO, "a second \"done\" frame");
    }
    l->sh.done_seen = 1;
    snprintf(l->sh.done_state, sizeof(l->sh.done_state), "%s", state);
    l->sh.done_step = step;
    l->sh.done_err.code = (int)code;
    snprintf(l->sh.done_err.msg, sizeof(l->sh.done_err.msg), "%s", msg);
    l->sh.failed = failed;
    l->sh.nfailed = nfailed;
    pthread_mutex_unlock(&l->mu);
    return 0;
}

/* Whether v is the string s. */
static int str_is(const td_pval *v, const char *s)
{
    size_t len;
    const char *p = td_pv_str(v, &len);

    return p != NULL && len == strlen(s) && memcmp(p, s, len) == 0;
}

/* One frame of rank 0's stream. A type this daemon does not know is skipped (a newer rank may
 * say more); a known one with bad fields breaks the stream. */
static int on_frame(td_launch *l, const td_pval *m, td_error_t *err)
{
    static const struct {
        const char *type;
        int (*fn)(td_launch *, const td_pval *, td_error_t *);
    } table[] = {{"rank", on_rank},         {"started", on_started}, {"metrics", on_metrics},
                 {"progress", on_progress}, {"log", on_log},         {"done", on_done}};
    const td_pval *type = td_pv_get(m, "type");

    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (str_is(type, table[i].type))
            return table[i].fn(l, m, err);
    return 0;
}

/* Reads rank 0's stream until it ends (or the loop says stop), then makes every row pushed
 * durable, and says so. After a bad frame it reads on and throws the bytes away, so that the
 * ranks are never blocked on a full pipe. */
static void *reader_main(void *arg)
{
    td_launch *l = arg;
    td_proto_reader *r = NULL;
    char *buf = malloc(READ_CHUNK), spare[512];
    td_error_t err = {0}, fe;
    int bad = buf == NULL || td_proto_reader_new(&r, TD_PROTO_MAX_FRAME) != 0;

    if (bad)
        td_error_set(&err, TD_ENOMEM, "out of memory reading rank 0's stream");
    for (;;) {
        struct pollfd pf[2] = {{.fd = l->out_fd, .events = POLLIN},
                               {.fd = l->wake_fd[0], .events = POLLIN}};
        td_proto_frame *f;
        ssize_t n;
        int rc, frames;
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pf[1].revents != 0)
            break;
        n = buf != NULL ? read(l->out_fd, buf, READ_CHUNK) : read(l->out_fd, spare, sizeof(spare));
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            break;
        if (bad)
            continue;
        if (td_proto_reader_feed(r, buf, (size_t)n) != 0) {
            bad = 1;
            td_error_set(&err, TD_ENOMEM, "out of memory reading rank 0's stream");
        }
        frames = 0;
        while (!bad && (rc = td_proto_reader_next(r, &f, &fe)) != 0) {
            if (rc < 0 || on_frame(l, td_proto_frame_root(f), &fe) != 0) {
                bad = 1;
                err = fe;
            }
            if (rc > 0)
                td_proto_frame_free(f);
            frames++;
        }
        /* The loop takes every frame's news at once (libuv coalesces the wake-ups). */
        if (frames > 0 && !bad)
            uv_async_send(&l->async);
        if (bad) {
            pthread_mutex_lock(&l->mu);
            if (l->sh.stream_err.code == 0) {
                td_error_set(&l->sh.stream_err, err.code, "rank 0's stream: %s", err.msg);
                l->sh.stream_bad_new = 1;
            }
            pthread_mutex_unlock(&l->mu);
            uv_async_send(&l->async);
        }
    }
    td_proto_reader_free(r);
    free(buf);
    if (l->sink != NULL) {
        td_error_t e;
        int rc = td_mq_flush(l->sink, &e);
        td_mq_sink_close(l->sink);
        l->sink = NULL;
        pthread_mutex_lock(&l->mu);
        if (rc != 0 && l->sh.store_err.code == 0)
            l->sh.store_err = e;
        pthread_mutex_unlock(&l->mu);
    }
    pthread_mutex_lock(&l->mu);
    l->sh.reader_end = 1;
    pthread_mutex_unlock(&l->mu);
    uv_async_send(&l->async);
    return NULL;
}

/* ---- the job's directory and spec (the threadpool) ---- */

/* Makes dir (mode 0750) if it is missing, owned by uid:gid, and writes the spec into it as
 * job.spec (mode 0640, through a temporary file and a rename, so a rank never reads half of
 * one). A symbolic link, or a directory of another user's, is refused: shared_dir may be
 * writable by every user. */
static int prepare_dir(const char *dir, uid_t uid, gid_t gid, const void *spec, size_t len,
                       td_error_t *err)
{
    struct stat st;
    const char *p = spec;
    size_t left = len;
    int dfd, fd, rc = 0;

    if (mkdir(dir, 0750) != 0 && errno != EEXIST)
        return td_error_set(err, TD_EIO, "[cluster] shared_dir: cannot create %s: %s", dir,
                            strerror(errno));
    dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        return td_error_set(err, TD_EIO, "[cluster] shared_dir: cannot open %s: %s", dir,
                            errno == ELOOP || errno == ENOTDIR ? "not a directory (a symbolic "
                                                                 "link or a file is there)"
                                                               : strerror(errno));
    if (fstat(dfd, &st) != 0 || (st.st_uid != uid && st.st_uid != geteuid())) {
        rc = td_error_set(err, TD_EPERM,
                          "[cluster] shared_dir: %s belongs to uid %lld, not to the "
                          "job's user (uid %lld)",
                          dir, (long long)st.st_uid, (long long)uid);
        goto out;
    }
    if (st.st_uid != uid && fchown(dfd, uid, gid) != 0) {
        rc = td_error_set(err, TD_EIO, "[cluster] shared_dir: cannot give %s to uid %lld: %s", dir,
                          (long long)uid, strerror(errno));
        goto out;
    }
    fd = openat(dfd, SPEC_TMP, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0640);
    if (fd < 0) {
        rc = td_error_set(err, TD_EIO, "cannot write %s/%s: %s", dir, SPEC_TMP, strerror(errno));
        goto out;
    }
    if (geteuid() == 0 && uid != 0 && fchown(fd, uid, gid) != 0)
        rc = td_error_set(err, TD_EIO, "cannot give %s/%s to uid %lld: %s", dir, SPEC_TMP,
                          (long long)uid, strerror(errno));
    while (rc == 0 && left > 0) {
        ssize_t n = write(fd, p, left);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            rc = td_error_set(err, errno == ENOSPC ? TD_EDISKFULL : TD_EIO,
                              "cannot write %s/%s: %s", dir, SPEC_TMP, strerror(errno));
            break;
        }
        p += n;
        left -= (size_t)n;
    }
    if (close(fd) != 0 && rc == 0)
        rc = td_error_set(err, TD_EIO, "cannot write %s/%s: %s", dir, SPEC_TMP, strerror(errno));
    if (rc == 0 && renameat(dfd, SPEC_TMP, dfd, SPEC_FILE) != 0)
        rc = td_error_set(err, TD_EIO, "cannot rename %s/%s: %s", dir, SPEC_TMP, strerror(errno));
out:
    close(dfd);
    return rc;
}

static void prep_work(uv_work_t *w)
{
    td_launch *l = w->data;
    user_info *u = &l->user;
    struct passwd pw, *found = NULL;
    char buf[4096];
    int e = getpwuid_r(l->uid, &pw, buf, sizeof(buf), &found);

    if (e == 0 && found != NULL) {
        snprintf(u->name, sizeof(u->name), "%s", pw.pw_name);
        snprintf(u->home, sizeof(u->home), "%s", pw.pw_dir);
        if (l->gid == (gid_t)-1)
            l->gid = pw.pw_gid;
    } else if (l->gid == (gid_t)-1) {
        td_error_set(&l->prep_err, TD_EPERM, "uid %lld has no passwd entry: no group to run as",
                     (long long)l->uid);
        return;
    }
    if (geteuid() != 0 && l->uid != geteuid()) {
        td_error_set(&l->prep_err, TD_EPERM,
                     "traind runs as uid %lld and cannot start ranks as uid %lld (run it as root)",
                     (long long)geteuid(), (long long)l->uid);
        return;
    }
    prepare_dir(l->job_dir, l->uid, l->gid, l->spec_bytes, l->spec_len, &l->prep_err);
}

/* ---- the loop: closing ---- */

static void free_launch(td_launch *l)
{
    while (l->sh.logs != NULL) {
        log_item *next = l->sh.logs->next;
        free(l->sh.logs);
        l->sh.logs = next;
    }
    free(l->sh.world.names);
    free(l->sh.failed);
    free(l->world.names);
    free(l->failed);
    free(l->spec_bytes);
    if (l->out_fd >= 0)
        close(l->out_fd);
    if (l->wake_fd[0] >= 0)
        close(l->wake_fd[0]);
    if (l->wake_fd[1] >= 0)
        close(l->wake_fd[1]);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

static void on_closed(uv_handle_t *h)
{
    td_launch *l = h->data;

    if (++l->closed == l->handles)
        free_launch(l);
}

/* Stops the reader thread (when it is still reading) and joins it. */
static void reader_stop(td_launch *l)
{
    if (!l->have_reader)
        return;
    if (write(l->wake_fd[1], "x", 1) < 0 && errno != EAGAIN)
        td_log_warn("job %lld: cannot wake the stream's reader: %s", (long long)l->job,
                    strerror(errno));
    pthread_join(l->reader, NULL);
    l->have_reader = 0;
}

void td_launch_close(td_launch *l)
{
    if (l == NULL || l->closing)
        return;
    l->closing = 1;
    reader_stop(l);
    uv_close((uv_handle_t *)&l->async, on_closed);
    uv_close((uv_handle_t *)&l->timer, on_closed);
    if (l->have_pipe) {
        uv_os_fd_t fd;
        if (uv_fileno((uv_handle_t *)&l->err_pipe, &fd) == 0)
            td_tsan_fd_closing(fd);
        uv_close((uv_handle_t *)&l->err_pipe, on_closed);
    }
    if (l->have_proc)
        uv_close((uv_handle_t *)&l->proc, on_closed);
}

int td_launch_pid(const td_launch *l)
{
    return l->spawned && !l->exited ? l->pid : 0;
}

/* ---- the loop: the outcome ---- */

static void say(td_launch *l, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void say(td_launch *l, int level, const char *fmt, ...)
{
    char line[TD_LAUNCH_LINE_MAX];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (l->cbs.log != NULL)
        l->cbs.log(l->cbs.ud, l, level, line);
}

/* The node a rank runs on, as the rank frame named it, else as the launcher did. */
static const char *node_of(const td_launch *l, int task, const char *launchers)
{
    if (l->have_world && task >= 0 && task < l->world.nodes)
        return l->world.names[task];
    return launchers;
}

/* How the launcher ended, for a message: "exited with status 1", "was killed by signal 9". */
static void exit_words(const td_launch *l, char *out, size_t size)
{
    if (l->term_signal != 0)
        snprintf(out, size, "%s was killed by signal %d (%s)", l->launcher_name, l->term_signal,
                 strsignal(l->term_signal));
    else
        snprintf(out, size, "%s exited with status %lld", l->launcher_name,
                 (long long)l->exit_status);
}

/* Without an outcome from rank 0, and not stopped by the daemon: a rank, or the launcher,
 * died. */
static void died(td_launch *l, td_launch_outcome *o)
{
    char how[128];

    o->rank_died = 1;
    snprintf(o->state, sizeof(o->state), TD_JOB_FAILED);
    if (l->have_death) {
        snprintf(o->dead_node, sizeof(o->dead_node), "%s", l->death.node);
        td_error_set(&o->err, TD_EWORKERS, "node %s (rank %d) died: %s",
                     node_of(l, l->death.task, l->death.node), l->death.task, l->death.why);
        return;
    }
    exit_words(l, how, sizeof(how));
    if (l->nlast > 0)
        td_error_set(&o->err, TD_EWORKERS,
                     "%s before rank 0 reported how the job ended; its last words: \"%s\"", how,
                     l->last[(l->nlast - 1) % LAST_LINES]);
    else
        td_error_set(&o->err, TD_EWORKERS, "%s before rank 0 reported how the job ended", how);
}

static void outcome(td_launch *l, td_launch_outcome *o)
{
    int done_seen;
    char state[TD_STORE_MAX_STATE];
    td_error_t derr, store_err;
    int64_t dstep;

    memset(o, 0, sizeof(*o));
    pthread_mutex_lock(&l->mu);
    done_seen = l->sh.done_seen;
    memcpy(state, l->sh.done_state, sizeof(state));
    derr = l->sh.done_err;
    dstep = l->sh.done_step;
    store_err = l->sh.store_err;
    l->failed = l->sh.failed;
    l->nfailed = l->sh.nfailed;
    l->sh.failed = NULL;
    l->sh.nfailed = 0;
    pthread_mutex_unlock(&l->mu);
    o->step = done_seen && dstep > l->step ? dstep : l->step;
    if (l->fail_why.code != 0 || l->prep_err.code != 0) {
        snprintf(o->state, sizeof(o->state), TD_JOB_FAILED);
        o->err = l->fail_why.code != 0 ? l->fail_why : l->prep_err;
    } else if (done_seen && strcmp(state, "interrupted") == 0 && l->stop == STOP_CANCEL) {
        /* A cancel the ranks took for an interrupt: the SIGTERM that ends the launcher. */
        snprintf(o->state, sizeof(o->state), TD_JOB_CANCELLED);
        td_error_set(&o->err, TD_ECANCELLED, "cancelled at step %lld", (long long)o->step);
    } else if (done_seen && strcmp(state, "interrupted") == 0 && l->stop == STOP_INTERRUPT) {
        snprintf(o->state, sizeof(o->state), TD_JOB_QUEUED);
    } else if (done_seen && strcmp(state, "interrupted") == 0) {
        /* Stopped by a signal the daemon did not send: the launcher ending the others after a
         * rank's death, a scancel, a preemption. A failure a restart may mend. */
        died(l, o);
        if (!l->have_death)
            td_error_set(&o->err, TD_EWORKERS,
                         "the ranks stopped at step %lld for an interrupt traind did not ask for "
                         "(a SIGTERM from outside: scancel, a preemption)",
                         (long long)o->step);
    } else if (done_seen && strcmp(state, TD_JOB_SUCCEEDED) == 0 && store_err.code != 0) {
        snprintf(o->state, sizeof(o->state), TD_JOB_FAILED);
        td_error_set(&o->err, store_err.code, "metrics could not be stored: %s", store_err.msg);
    } else if (done_seen && strcmp(state, TD_JOB_SUCCEEDED) == 0) {
        snprintf(o->state, sizeof(o->state), TD_JOB_SUCCEEDED);
    } else if (done_seen && strcmp(state, TD_JOB_CANCELLED) == 0) {
        snprintf(o->state, sizeof(o->state), TD_JOB_CANCELLED);
        if (derr.msg[0] != '\0')
            td_error_set(&o->err, TD_ECANCELLED, "%s", derr.msg);
        else
            td_error_set(&o->err, TD_ECANCELLED, "cancelled at step %lld", (long long)o->step);
    } else if (done_seen) {
        snprintf(o->state, sizeof(o->state), TD_JOB_FAILED);
        td_error_set(&o->err, derr.code != 0 ? derr.code : TD_EWORKERS, "%s",
                     derr.msg[0] != '\0' ? derr.msg : "the ranks failed without a message");
        o->failed = l->failed;
        o->nfailed = l->nfailed;
    } else if (l->stop == STOP_CANCEL) {
        snprintf(o->state, sizeof(o->state), TD_JOB_CANCELLED);
        td_error_set(&o->err, TD_ECANCELLED, "cancelled at step %lld%s", (long long)o->step,
                     l->saw_started ? "; the ranks were ended before they wrote a checkpoint" : "");
    } else if (l->stop == STOP_INTERRUPT) {
        snprintf(o->state, sizeof(o->state), TD_JOB_QUEUED);
    } else if (l->exit_status == 64 && l->term_signal == 0) {
        snprintf(o->state, sizeof(o->state), TD_JOB_FAILED);
        td_error_set(&o->err, TD_EJOB, "%s",
                     l->usage[0] != '\0' ? l->usage
                                         : "traind rank refused its command line (exit status 64)");
    } else {
        died(l, o);
    }
}

/* Calls done once everything has ended: the launcher (or its start), its pipes, the reader. */
static void maybe_finish(td_launch *l)
{
    td_launch_outcome o;

    if (l->finished || l->preparing || l->closing)
        return;
    if (l->spawned && !(l->exited && l->reader_done && l->stderr_closed))
        return;
    l->finished = 1;
    uv_timer_stop(&l->timer);
    if (l->unlogged > 0)
        say(l, TD_LOG_INFO, "%d more line(s) of %s's output were not logged", l->unlogged,
            l->launcher_name);
    outcome(l, &o);
    if (l->cbs.done != NULL)
        l->cbs.done(l->cbs.ud, l, &o);
}

/* ---- the loop: stopping ---- */

/* SIGKILL to every process of the launcher's session (it was started as the leader of one):
 * mpirun puts each rank it starts in a process group of its own, so the group alone is not
 * enough. Only while the launcher has not been reaped, so that its pid is still its own. */
static void kill_session(td_launch *l)
{
    DIR *dp = opendir("/proc");
    struct dirent *e;

    kill(-l->pid, SIGKILL);
    while (dp != NULL && (e = readdir(dp)) != NULL) {
        char path[300], stat[512], *p;
        long pid = strtol(e->d_name, &p, 10), sid = 0;
        FILE *f;
        if (*p != '\0' || pid <= 0)
            continue;
        snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
        f = fopen(path, "re");
        if (f == NULL)
            continue;
        p = fgets(stat, sizeof(stat), f) != NULL ? strrchr(stat, ')') : NULL;
        fclose(f);
        /* after the command's ")": state, ppid, pgrp, session */
        if (p != NULL && sscanf(p + 1, " %*c %*d %*d %ld", &sid) == 1 && sid == l->pid)
            kill((pid_t)pid, SIGKILL);
    }
    if (dp != NULL)
        closedir(dp);
}

typedef struct helper {
    uv_process_t proc;
} helper;

static void helper_closed(uv_handle_t *h)
{
    free(h->data);
}

static void helper_exit(uv_process_t *p, int64_t status, int sig)
{
    if (status != 0 || sig != 0)
        td_log_info("scancel exited with status %lld, signal %d", (long long)status, sig);
    uv_close((uv_handle_t *)p, helper_closed);
}

/* Flags and ids for a child that runs as the job's user (none to set for one of the daemon's
 * own uid). */
static void as_user(const td_launch *l, uv_process_options_t *o)
{
    if (geteuid() == 0 && l->uid != 0) {
        o->flags |= UV_PROCESS_SETUID | UV_PROCESS_SETGID;
        o->uid = l->uid;
        o->gid = l->gid;
    }
}

/* scancel --name=traind-HOST-JOB: ends the Slurm job srun made, wherever its ranks are. */
static void spawn_scancel(td_launch *l)
{
    helper *h = calloc(1, sizeof(*h));
    char name[200], file[256];
    char *args[] = {file, name, NULL};
    uv_process_options_t o = {.exit_cb = helper_exit, .file = args[0], .args = args};
    int rc;

    if (h == NULL)
        return;
    snprintf(file, sizeof(file), "%s",
             l->cluster.scancel_path[0] != '\0' ? l->cluster.scancel_path : "scancel");
    snprintf(name, sizeof(name), "--name=%s", l->jobname);
    as_user(l, &o);
    h->proc.data = h;
    rc = uv_spawn(l->loop, &h->proc, &o);
    if (rc != 0) {
        td_log_warn("job %lld: cannot run %s: %s", (long long)l->job, args[0], uv_strerror(rc));
        uv_close((uv_handle_t *)&h->proc, helper_closed);
    }
}

static void on_escalate(uv_timer_t *t);

/* Ends the launcher (why says why, for the log): scancel and SIGTERM now, SIGKILL later. */
static void escalate(td_launch *l, const char *why)
{
    if (l->exited || l->escalated > 0)
        return;
    l->escalated = 1;
    if (l->cluster.launcher == TD_LAUNCHER_SRUN) {
        say(l, TD_LOG_WARNING, "%s: ending the Slurm job (scancel --name=%s, SIGTERM to srun)", why,
            l->jobname);
        spawn_scancel(l);
    } else {
        say(l, TD_LOG_WARNING, "%s: ending mpirun (SIGTERM)", why);
    }
    uv_process_kill(&l->proc, SIGTERM);
    uv_timer_start(&l->timer, on_escalate, (uint64_t)(l->cluster.kill_timeout_s * 1e3), 0);
}

static void on_escalate(uv_timer_t *t)
{
    td_launch *l = t->data;
    char why[128];

    if (l->exited)
        return;
    if (l->escalated == 0) {
        snprintf(why, sizeof(why), "the ranks did not stop within %.0f s",
                 l->cluster.stop_timeout_s);
        escalate(l, why);
        return;
    }
    l->escalated = 2;
    say(l, TD_LOG_WARNING, "%s has not exited %.0f s after it was ended: SIGKILL to its processes",
        l->launcher_name, l->cluster.kill_timeout_s);
    kill_session(l);
}

/* Asks the ranks to stop (see launch.h). Before the launcher runs, its start sees it. */
static void request_stop(td_launch *l, int kind)
{
    int sig = kind == STOP_CANCEL ? SIGUSR1 : SIGUSR2;

    if (l->finished || l->stop == STOP_CANCEL || (kind == STOP_INTERRUPT && l->stop != STOP_NONE))
        return;
    l->stop = kind;
    if (!l->spawned || l->exited)
        return;
    if (!l->have_world) {
        /* No rank has joined yet (Slurm may not even have given the nodes): nothing to
         * checkpoint, nothing to wait for. */
        escalate(l, "the ranks have not started");
        return;
    }
    uv_process_kill(&l->proc, sig);
    say(l, TD_LOG_NOTICE, "asked the ranks to %s at their next step (%s to %s)",
        kind == STOP_CANCEL ? "checkpoint and stop" : "checkpoint and stop for the shutdown",
        kind == STOP_CANCEL ? "SIGUSR1" : "SIGUSR2", l->launcher_name);
    if (l->escalated == 0)
        uv_timer_start(&l->timer, on_escalate, (uint64_t)(l->cluster.stop_timeout_s * 1e3), 0);
}

void td_launch_cancel(td_launch *l)
{
    request_stop(l, STOP_CANCEL);
}

void td_launch_interrupt(td_launch *l)
{
    request_stop(l, STOP_INTERRUPT);
}

void td_launch_fail(td_launch *l, const td_error_t *why)
{
    if (l->fail_why.code == 0)
        l->fail_why = *why;
    request_stop(l, STOP_CANCEL);
}

/* ---- the loop: the reader's news ---- */

static void on_async(uv_async_t *a)
{
    td_launch *l = a->data;
    td_launch_world w = {0};
    int world_new, started_new, progress_new, bad_new, store_new;
    int64_t start_step, total, progress;
    td_error_t bad, store;
    log_item *logs;
    size_t dropped;

    pthread_mutex_lock(&l->mu);
    world_new = l->sh.world_new;
    if (world_new) {
        w = l->sh.world;
        l->sh.world.names = NULL;
        l->sh.world_new = 0;
    }
    started_new = l->sh.started_new;
    start_step = l->sh.start_step;
    total = l->sh.total_steps;
    progress_new = l->sh.progress_new;
    progress = l->sh.progress;
    logs = l->sh.logs;
    dropped = l->sh.dropped_logs;
    bad_new = l->sh.stream_bad_new;
    bad = l->sh.stream_err;
    store_new = l->sh.store_failed_new;
    store = l->sh.store_failed;
    l->reader_done = l->sh.reader_end;
    l->sh.started_new = l->sh.progress_new = l->sh.stream_bad_new = l->sh.store_failed_new = 0;
    l->sh.logs = l->sh.logs_tail = NULL;
    l->sh.nlogs = l->sh.dropped_logs = 0;
    pthread_mutex_unlock(&l->mu);

    if (world_new) {
        free(l->world.names);
        l->world = w;
        l->have_world = 1;
        if (l->cbs.world != NULL)
            l->cbs.world(l->cbs.ud, l, &l->world);
    }
    if (started_new) {
        l->saw_started = 1;
        l->step = start_step;
        if (l->cbs.started != NULL)
            l->cbs.started(l->cbs.ud, l, start_step, total);
    }
    while (logs != NULL) {
        log_item *next = logs->next;
        say(l, logs->level, "%s", logs->line);
        free(logs);
        logs = next;
    }
    if (dropped > 0)
        say(l, TD_LOG_WARNING, "%zu line(s) of the ranks' log were dropped (too many at once)",
            dropped);
    if (progress_new && progress >= l->step) {
        l->step = progress;
        if (l->cbs.progress != NULL)
            l->cbs.progress(l->cbs.ud, l, progress);
    }
    if (store_new && l->cbs.store_failed != NULL)
        l->cbs.store_failed(l->cbs.ud, l, &store);
    if (bad_new)
        td_launch_fail(l, &bad);
    maybe_finish(l);
}

/* ---- the loop: the launcher's stderr ---- */

/* Whether s is a line of mpirun's dashes, which frame its messages. */
static int rule_line(const char *s)
{
    return s[0] == '-' && s[strspn(s, "-")] == '\0';
}

static void stderr_line(td_launch *l, const char *raw, size_t len)
{
    char line[TD_LAUNCH_LINE_MAX];
    td_launch_death d;

    while (len > 0 && (raw[len - 1] == '\r' || raw[len - 1] == ' '))
        len--;
    if (len == 0)
        return;
    td_text_escape(line, sizeof(line), raw, len, 0);
    if (!l->have_death && td_launch_parse_death(line, &d)) {
        int done_seen;
        l->death = d;
        l->have_death = 1;
        pthread_mutex_lock(&l->mu);
        done_seen = l->sh.done_seen;
        pthread_mutex_unlock(&l->mu);
        /* A rank killed by a signal leaves the others waiting in a collective, and srun would
         * let them wait for --wait: end the step now. A rank that exited after rank 0 told the
         * outcome is the normal end. */
        if (!done_seen && strncmp(d.why, "Exited", 6) != 0 && !l->exited) {
            char why[256];
            snprintf(why, sizeof(why), "the rank on node %.63s died (%.128s)", d.node, d.why);
            escalate(l, why);
        }
    }
    if (l->usage[0] == '\0' && strncmp(line, "traind rank: ", 13) == 0)
        snprintf(l->usage, sizeof(l->usage), "%s", line);
    if (rule_line(line))
        return;
    snprintf(l->last[l->nlast++ % LAST_LINES], TD_LAUNCH_LINE_MAX, "%s", line);
    if (l->logged >= TD_LAUNCH_LOG_LINES) {
        l->unlogged++;
        return;
    }
    l->logged++;
    say(l, strstr(line, "error") != NULL ? TD_LOG_WARNING : TD_LOG_INFO, "%s", line);
}

static void err_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    td_launch *l = h->data;

    (void)hint;
    *buf = uv_buf_init(l->errbuf, sizeof(l->errbuf));
}

/* Cuts the bytes into lines; a line longer than TD_LAUNCH_LINE_MAX is cut there. */
static void err_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    td_launch *l = s->data;

    for (ssize_t i = 0; i < n; i++) {
        char c = buf->base[i];
        if (c == '\n') {
            if (!l->line_cut)
                stderr_line(l, l->line, l->line_len);
            l->line_len = 0;
            l->line_cut = 0;
        } else if (l->line_len < sizeof(l->line) - 1) {
            l->line[l->line_len++] = c;
        } else if (!l->line_cut) {
            stderr_line(l, l->line, l->line_len);
            l->line_cut = 1;
        }
    }
    if (n >= 0)
        return;
    if (!l->line_cut && l->line_len > 0)
        stderr_line(l, l->line, l->line_len);
    l->line_len = 0;
    uv_read_stop(s);
    l->stderr_closed = 1;
    maybe_finish(l);
}

/* ---- the loop: the launcher's exit ---- */

/* The launcher has exited, and its pipes have not closed within TD_LAUNCH_DRAIN_MS: something
 * it started holds them. Reading stops; the outcome is what came so far. */
static void on_drain(uv_timer_t *t)
{
    td_launch *l = t->data;

    say(l, TD_LOG_WARNING,
        "%s has exited but its output stayed open for %d ms (a process it started holds it): "
        "no longer read",
        l->launcher_name, TD_LAUNCH_DRAIN_MS);
    if (!l->stderr_closed) {
        uv_read_stop((uv_stream_t *)&l->err_pipe);
        l->stderr_closed = 1;
    }
    if (!l->reader_done) {
        reader_stop(l);
        l->reader_done = 1;
    }
    maybe_finish(l);
}

static void on_launcher_exit(uv_process_t *p, int64_t status, int sig)
{
    td_launch *l = p->data;

    l->exited = 1;
    l->exit_status = status;
    l->term_signal = sig;
    uv_timer_stop(&l->timer);
    uv_timer_start(&l->timer, on_drain, TD_LAUNCH_DRAIN_MS, 0);
    maybe_finish(l);
}

/* ---- the loop: starting ---- */

/* Whether env entry e names variable name. */
static int env_is(const char *e, const char *name)
{
    size_t n = strlen(name);

    return strncmp(e, name, n) == 0 && e[n] == '=';
}

/* The launcher's environment: the daemon's, with the user's HOME, USER and LOGNAME, the
 * interfaces [cluster] pins, and none of a Slurm job's ids (srun would make a step of that job
 * instead of a job of its own). The strings the array adds are in *extra; caller frees both. */
static char **launch_env(td_launch *l, char **extra)
{
    static const char *const drop[] = {"HOME",
                                       "USER",
                                       "LOGNAME",
                                       "SLURM_JOB_ID",
                                       "SLURM_JOBID",
                                       "SLURM_STEP_ID",
                                       "SLURM_STEPID",
                                       "NCCL_SOCKET_IFNAME",
                                       "OMPI_MCA_btl_tcp_if_include",
                                       "OMPI_MCA_oob_tcp_if_include",
                                       NULL};
    const user_info *u = &l->user;
    size_t n = 0, k = 0, used = 0, cap = 4096;
    char **env, *buf = malloc(cap);

    while (environ[n] != NULL)
        n++;
    env = calloc(n + 8, sizeof(*env));
    if (env == NULL || buf == NULL) {
        free(env);
        free(buf);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        int keep = 1;
        for (int j = 0; drop[j] != NULL && keep; j++)
            keep = !env_is(environ[i], drop[j]);
        if (keep)
            env[k++] = environ[i];
    }
#define ADD(...)                                                \
    do {                                                        \
        int w_ = snprintf(buf + used, cap - used, __VA_ARGS__); \
        if (w_ > 0 && (size_t)w_ < cap - used) {                \
            env[k++] = buf + used;                              \
            used += (size_t)w_ + 1;                             \
        }                                                       \
    } while (0)
    if (u->name[0] != '\0') {
        ADD("HOME=%s", u->home);
        ADD("USER=%s", u->name);
        ADD("LOGNAME=%s", u->name);
    } else {
        ADD("HOME=/");
    }
    if (l->cluster.nccl_ifname[0] != '\0')
        ADD("NCCL_SOCKET_IFNAME=%s", l->cluster.nccl_ifname);
    if (l->cluster.mpi_ifname[0] != '\0') {
        ADD("OMPI_MCA_btl_tcp_if_include=%s", l->cluster.mpi_ifname);
        ADD("OMPI_MCA_oob_tcp_if_include=%s", l->cluster.mpi_ifname);
    }
#undef ADD
    env[k] = NULL;
    *extra = buf;
    return env;
}

/* The traind the ranks run: [cluster] traind_path, else this daemon's own executable. */
static int traind_path(const td_launch *l, char *out, size_t size, td_error_t *err)
{
    ssize_t n;

    if (l->cluster.traind_path[0] != '\0') {
        snprintf(out, size, "%s", l->cluster.traind_path);
        return 0;
    }
    n = readlink("/proc/self/exe", out, size - 1);
    if (n <= 0 || (size_t)n >= size - 1)
        return td_error_set(err, TD_EIO,
                            "cannot tell where this traind is (/proc/self/exe): %s; "
                            "set [cluster] traind_path",
                            n < 0 ? strerror(errno) : "too long");
    out[n] = '\0';
    return 0;
}

/* Spawns the launcher with its stdout on a pipe of the reader thread's and its stderr on the
 * loop, starts the reader. On error the launch is left unspawned with err set. */
static int spawn(td_launch *l, td_error_t *err)
{
    td_launch_plan p = {.job = l->job,
                        .cluster = &l->cluster,
                        .host = l->host,
                        .spec = l->spec_path,
                        .ckpt_dir = l->job_dir,
                        .nodes = l->nodes,
                        .min_nodes = l->min_nodes,
                        .exclude = l->exclude};
    td_launch_cmd *cmd = malloc(sizeof(*cmd));
    char traind[512], *extra = NULL, **env = NULL, shown[1024];
    int out[2] = {-1, -1}, rc;
    uv_stdio_container_t io[3];
    uv_process_options_t o = {0};
    size_t len = 0;

    if (cmd == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory starting the launcher");
    rc = traind_path(l, traind, sizeof(traind), err);
    p.traind = traind;
    if (rc == 0)
        rc = td_launch_argv(&p, cmd, err);
    if (rc == 0 && (env = launch_env(l, &extra)) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "out of memory starting the launcher");
    if (rc == 0 && (pipe2(out, O_CLOEXEC) != 0 || pipe2(l->wake_fd, O_CLOEXEC | O_NONBLOCK) != 0))
        rc = td_error_set(err, TD_EIO, "cannot make a pipe: %s", strerror(errno));
    if (rc == 0 && td_mq_sink_open_cb(l->mq, l->job, on_sink_failed, l, NULL, &l->sink) != 0)
        rc = td_error_set(err, TD_ENOMEM, "out of memory opening the job's metric sink");
    if (rc == 0 && (rc = uv_pipe_init(l->loop, &l->err_pipe, 0)) != 0)
        td_error_set(err, rc, "uv_pipe_init: %s", uv_strerror(rc));
    if (rc != 0)
        goto out;
    l->err_pipe.data = l;
    l->have_pipe = 1;
    l->handles++;
    (void)fcntl(out[0], F_SETPIPE_SZ, PIPE_BYTES); /* more room for frames; a refusal costs none */
    io[0].flags = UV_IGNORE;
    io[1].flags = UV_INHERIT_FD;
    io[1].data.fd = out[1];
    io[2].flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE;
    io[2].data.stream = (uv_stream_t *)&l->err_pipe;
    o.exit_cb = on_launcher_exit;
    o.file = cmd->argv[0];
    o.args = cmd->argv;
    o.env = env;
    o.cwd = l->job_dir;
    /* A session of its own: the ranks mpirun starts stay in it, whatever their groups. */
    o.flags = UV_PROCESS_DETACHED;
    o.stdio_count = 3;
    o.stdio = io;
    as_user(l, &o);
    l->proc.data = l;
    rc = uv_spawn(l->loop, &l->proc, &o);
    /* uv_spawn initialises the handle even when it fails: it must be closed either way. */
    l->have_proc = 1;
    l->handles++;
    close(out[1]);
    out[1] = -1;
    if (rc != 0) {
        td_error_set(err, rc, "cannot start %s: %s", cmd->argv[0], uv_strerror(rc));
        goto out;
    }
    l->spawned = 1;
    l->pid = l->proc.pid;
    l->out_fd = out[0];
    out[0] = -1;
    for (int i = 0; i < cmd->argc && len < sizeof(shown); i++)
        len +=
            (size_t)snprintf(shown + len, sizeof(shown) - len, "%s%s", i ? " " : "", cmd->argv[i]);
    say(l, TD_LOG_NOTICE, "launched on %d%s%.0d node(s) as uid %lld: %s", l->min_nodes,
        l->min_nodes < l->nodes ? " to " : "", l->min_nodes < l->nodes ? l->nodes : 0,
        (long long)l->uid, shown);
    rc = uv_read_start((uv_stream_t *)&l->err_pipe, err_alloc, err_read);
    if (rc != 0) {
        td_log_warn("job %lld: cannot read %s's stderr: %s", (long long)l->job, l->launcher_name,
                    uv_strerror(rc));
        l->stderr_closed = 1;
    }
    if (pthread_create(&l->reader, NULL, reader_main, l) == 0) {
        l->have_reader = 1;
    } else {
        td_error_t why;
        td_error_set(&why, TD_ENOMEM, "cannot start the thread that reads rank 0's stream");
        l->reader_done = 1;
        td_launch_fail(l, &why);
    }
    rc = 0;
out:
    if (out[0] >= 0)
        close(out[0]);
    if (out[1] >= 0)
        close(out[1]);
    if (rc != 0 && l->sink != NULL) {
        td_mq_sink_close(l->sink);
        l->sink = NULL;
    }
    free(env);
    free(extra);
    free(cmd);
    return rc;
}

/* The threadpool has written the job's directory and spec (or failed to): spawn, unless a
 * stop came meanwhile. */
static void prep_done(uv_work_t *w, int status)
{
    td_launch *l = w->data;

    (void)status;
    l->preparing = 0;
    free(l->spec_bytes);
    l->spec_bytes = NULL;
    if (l->prep_err.code == 0 && l->stop == STOP_NONE && l->fail_why.code == 0)
        spawn(l, &l->prep_err);
    maybe_finish(l);
}

int td_launch_start(td_launch **out, uv_loop_t *loop, const td_launch_args *a, td_error_t *err)
{
    td_launch *l = calloc(1, sizeof(*l));
    int rc;

    *out = NULL;
    if (l == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory launching job %lld", (long long)a->job);
    l->loop = loop;
    l->job = a->job;
    l->cbs = a->cbs;
    l->cluster = *a->cluster;
    l->mq = a->mq;
    l->uid = (uid_t)a->spec->uid;
    l->gid = a->spec->gid >= 0 ? (gid_t)a->spec->gid : (gid_t)-1;
    l->nodes = a->nodes;
    l->min_nodes = a->min_nodes < a->nodes ? a->min_nodes : a->nodes;
    snprintf(l->exclude, sizeof(l->exclude), "%s", a->exclude != NULL ? a->exclude : "");
    l->out_fd = l->wake_fd[0] = l->wake_fd[1] = -1;
    l->launcher_name = l->cluster.launcher == TD_LAUNCHER_SRUN ? "srun" : "mpirun";
    short_host(l->host, sizeof(l->host));
    snprintf(l->jobname, sizeof(l->jobname), "traind-%s-%lld", l->host, (long long)l->job);
    pthread_mutex_init(&l->mu, NULL);
    if (a->spec->uid < 0)
        rc = td_error_set(err, TD_EPERM, "job %lld has no known user: its ranks are not started",
                          (long long)a->job);
    else if ((rc = td_launch_job_dir(&l->cluster, l->job, l->job_dir, sizeof(l->job_dir), err)) ==
             0)
        snprintf(l->spec_path, sizeof(l->spec_path), "%s/%s", l->job_dir, SPEC_FILE);
    if (rc == 0 && (l->spec_bytes = malloc(a->spec_len > 0 ? a->spec_len : 1)) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "out of memory launching job %lld", (long long)a->job);
    if (rc != 0) {
        free(l->spec_bytes);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return rc;
    }
    memcpy(l->spec_bytes, a->spec_bytes, a->spec_len);
    l->spec_len = a->spec_len;
    rc = uv_async_init(loop, &l->async, on_async);
    if (rc != 0) {
        free_launch(l);
        return td_error_set(err, rc, "uv_async_init: %s", uv_strerror(rc));
    }
    l->async.data = l;
    l->handles = 1;
    rc = uv_timer_init(loop, &l->timer);
    l->timer.data = l;
    if (rc == 0) {
        l->handles = 2;
        l->work.data = l;
        rc = uv_queue_work(loop, &l->work, prep_work, prep_done);
    }
    if (rc != 0) {
        td_error_set(err, rc, "starting job %lld's launch: %s", (long long)a->job, uv_strerror(rc));
        l->closing = 1;
        uv_close((uv_handle_t *)&l->async, on_closed);
        if (l->handles == 2)
            uv_close((uv_handle_t *)&l->timer, on_closed);
        return rc;
    }
    l->preparing = 1;
    *out = l;
    return 0;
}
