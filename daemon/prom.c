/* The Prometheus textfile (prom.h). Every write builds the whole exposition in memory, then
 * replaces the file. The series, each with its HELP and TYPE:
 *
 *   traind_up                                   gauge    1 while traind runs; 0 in the file a clean
 * stop leaves traind_info{version}                        gauge    always 1
 *   traind_start_time_seconds                   gauge    unix time traind started (a re-exec keeps
 * it) traind_uptime_seconds                       gauge    seconds since then
 *   traind_worker_restarts_total                counter  re-executions (every device worker
 * restarted) traind_jobs{state}                          gauge    jobs by state traind_queue_length
 * gauge    queued jobs traind_device_busy{device}                  gauge    1 while a job trains on
 * the device traind_device_memory_used_bytes{device}     gauge    total - free (cpu devices: the
 * machine's) traind_device_memory_total_bytes{device}    gauge traind_job_step{job,name,uid} gauge
 * per running job traind_job_total_steps{job,name,uid}        gauge
 *   traind_job_train_loss{job,name,uid}         gauge    its latest stored train_loss
 *   traind_job_tokens_per_second{job,name,uid}  gauge    its latest tokens_per_s (gpt, sensorlm)
 *   traind_job_samples_per_second{job,name,uid} gauge    its latest samples_per_s (mlp)
 *   traind_metric_rows_written_total            counter  rows the store thread wrote
 *   traind_metric_queue_blocked_seconds_total   counter  time workers waited on a full queue
 *   traind_metric_queue_samples                 gauge    samples waiting in the queue
 *   traind_store_size_bytes                     gauge    traind.db's size on disk
 *   traind_store_wal_bytes                      gauge    its -wal file's size
 *
 * Counters count from this process's start, except traind_worker_restarts_total, which a
 * re-exec carries on. Loop thread only. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/prom.h"
#include "common/td_clock.h"
#include "common/td_log.h"
#include "common/td_text.h"

/* The exposition being built. */
typedef struct text {
    char *buf;
    size_t len, cap;
    int failed; /* out of memory: the write is skipped */
} text;

static void add(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void add(text *t, const char *fmt, ...)
{
    va_list ap;
    int n;

    for (int tries = 0; !t->failed && tries < 2; tries++) {
        va_start(ap, fmt);
        n = vsnprintf(t->buf != NULL ? t->buf + t->len : NULL, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = (t->cap + (size_t)n + 1) * 2;
        char *b = realloc(t->buf, cap);
        if (b == NULL) {
            t->failed = 1;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
}

/* A series' HELP and TYPE lines. */
static void family(text *t, const char *name, const char *type, const char *help)
{
    add(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value as the format wants it: printable UTF-8 first (td_text_escape writes control
 * bytes and malformed UTF-8 as \xNN, as traind shows names everywhere), then backslash and
 * double quote escaped. out holds at least 2 * (4 * len) + 1 bytes. */
static void label_value(char *out, size_t size, const char *s)
{
    char esc[4 * TD_STORE_MAX_NAME + 1];
    size_t n = td_text_escape(esc, sizeof(esc), s, strlen(s), 0), o = 0;

    for (size_t i = 0; i < n && o + 3 < size; i++) {
        if (esc[i] == '\\' || esc[i] == '"')
            out[o++] = '\\';
        out[o++] = esc[i];
    }
    out[o] = '\0';
}

/* A sample's value: NaN and the infinities as the format spells them. */
static void value(text *t, double v)
{
    if (isnan(v))
        add(t, " NaN\n");
    else if (isinf(v))
        add(t, v > 0 ? " +Inf\n" : " -Inf\n");
    else if (v == floor(v) && fabs(v) < 1e15)
        add(t, " %.0f\n", v);
    else
        add(t, " %.9g\n", v);
}

/* ---- the series ---- */

static void daemon_series(td_prom *p, text *t, int up)
{
    double now = td_wall_s();

    family(t, "traind_up", "gauge",
           "Whether traind is running: 1, or 0 in the file its clean stop leaves.");
    add(t, "traind_up %d\n", up);
    family(t, "traind_info", "gauge", "traind's version, as a label; the value is always 1.");
    add(t, "traind_info{version=\"%s\"} 1\n", TD_VERSION);
    family(t, "traind_start_time_seconds", "gauge",
           "When traind started, in unix seconds; a re-execution keeps it.");
    add(t, "traind_start_time_seconds");
    value(t, floor(p->started));
    family(t, "traind_uptime_seconds", "gauge", "Seconds since traind started.");
    add(t, "traind_uptime_seconds");
    value(t, floor(now - p->started));
    family(t, "traind_worker_restarts_total", "counter",
           "Times traind restarted every device worker by re-executing itself (after a sticky "
           "CUDA error) since it started.");
    add(t, "traind_worker_restarts_total %lld\n", (long long)p->restarts);
}

static void job_series(td_prom *p, text *t)
{
    static const char *const states[TD_STORE_NSTATES] = {
        TD_JOB_QUEUED, TD_JOB_RUNNING, TD_JOB_SUCCEEDED, TD_JOB_FAILED, TD_JOB_CANCELLED};
    int64_t counts[TD_STORE_NSTATES];
    td_error_t err;

    memcpy(counts, p->counts, sizeof(counts));
    /* A store that cannot answer now leaves the ended states' last counts. */
    if (td_daemon_job_counts(p->d, counts, &err) != 0)
        td_log_debug("prometheus: counting jobs: %s; the last counts stay", err.msg);
    memcpy(p->counts, counts, sizeof(counts));
    family(t, "traind_jobs", "gauge",
           "Jobs by state: queued and running as traind holds them, ended ones as the store "
           "counts them (deleted jobs left out).");
    for (int i = 0; i < TD_STORE_NSTATES; i++)
        add(t, "traind_jobs{state=\"%s\"} %lld\n", states[i], (long long)counts[i]);
    family(t, "traind_queue_length", "gauge", "Jobs waiting for devices.");
    add(t, "traind_queue_length %lld\n", (long long)counts[0]);
}

static void device_series(td_prom *p, text *t)
{
    int n = td_daemon_ndevices(p->d), mem = 0;
    size_t free_b = 0, total_b = 0;
    char used[TD_MAX_DEVICES][48], total[TD_MAX_DEVICES][48];
    td_device_view v;
    td_error_t err;

    family(t, "traind_device_busy", "gauge", "Whether a job trains on the device: 1 or 0.");
    for (int i = 0; i < n; i++) {
        td_daemon_device(p->d, i, &v);
        add(t, "traind_device_busy{device=\"%s\"} %d\n", v.name, v.job != 0);
        /* cpu devices share the machine's memory: read once for all of them. */
        if (i == 0 || v.kind != TD_DEVICE_CPU)
            mem = td_daemon_device_memory(p->d, i, &free_b, &total_b, &err) == 0;
        used[i][0] = total[i][0] = '\0';
        if (mem) {
            snprintf(used[i], sizeof(used[i]), "%zu", total_b - (free_b < total_b ? free_b : 0));
            snprintf(total[i], sizeof(total[i]), "%zu", total_b);
        }
    }
    family(t, "traind_device_memory_used_bytes", "gauge",
           "Memory in use on the device (total less free); cpu devices show the machine's.");
    for (int i = 0; i < n; i++)
        if (used[i][0] != '\0') {
            td_daemon_device(p->d, i, &v);
            add(t, "traind_device_memory_used_bytes{device=\"%s\"} %s\n", v.name, used[i]);
        }
    family(t, "traind_device_memory_total_bytes", "gauge",
           "The device's memory; cpu devices show the machine's.");
    for (int i = 0; i < n; i++)
        if (total[i][0] != '\0') {
            td_daemon_device(p->d, i, &v);
            add(t, "traind_device_memory_total_bytes{device=\"%s\"} %s\n", v.name, total[i]);
        }
}

/* A running job's latest stored values of the metrics the file shows (NaN: none yet). */
typedef struct latest {
    double train_loss, tokens_per_s, samples_per_s;
    int has_loss;
} latest;

static int take_latest(void *ud, const td_metric_summary *row)
{
    latest *l = ud;

    if (strcmp(row->key, "train_loss") == 0) {
        l->train_loss = row->last;
        l->has_loss = 1;
    } else if (strcmp(row->key, "tokens_per_s") == 0)
        l->tokens_per_s = row->last;
    else if (strcmp(row->key, "samples_per_s") == 0)
        l->samples_per_s = row->last;
    return 0;
}

/* One running job's sample of a per-job series. A rate a job does not record is left out; a
 * loss it recorded as NaN (on_nan "skip") is shown as NaN. */
static void job_sample(text *t, const char *name, const char *labels, double v)
{
    add(t, "%s{%s}", name, labels);
    value(t, v);
}

static void running_series(td_prom *p, text *t)
{
    static td_running_view jobs[TD_PROM_MAX_JOBS]; /* loop thread only */
    static char labels[TD_PROM_MAX_JOBS][8 * TD_STORE_MAX_NAME + 96];
    static latest vals[TD_PROM_MAX_JOBS];
    size_t n = td_daemon_running(p->d, jobs, TD_PROM_MAX_JOBS);
    char name[8 * TD_STORE_MAX_NAME + 1];
    td_error_t err;

    n = n < TD_PROM_MAX_JOBS ? n : TD_PROM_MAX_JOBS;
    for (size_t i = 0; i < n; i++) {
        label_value(name, sizeof(name), jobs[i].name);
        snprintf(labels[i], sizeof(labels[i]), "job=\"%lld\",name=\"%s\",uid=\"%lld\"",
                 (long long)jobs[i].id, name, (long long)jobs[i].uid);
        vals[i] = (latest){NAN, NAN, NAN, 0};
        if (td_store_metrics_summary(td_daemon_store(p->d), jobs[i].id, take_latest, &vals[i],
                                     &err) != 0)
            td_log_debug("prometheus: job %lld's latest metrics: %s", (long long)jobs[i].id,
                         err.msg);
    }
    family(t, "traind_job_step", "gauge", "Steps a running job has completed.");
    for (size_t i = 0; i < n; i++)
        job_sample(t, "traind_job_step", labels[i], (double)jobs[i].step);
    family(t, "traind_job_total_steps", "gauge",
           "Steps a running job will take (0 until it knows).");
    for (size_t i = 0; i < n; i++)
        job_sample(t, "traind_job_total_steps", labels[i], (double)jobs[i].total_steps);
    family(t, "traind_job_train_loss", "gauge", "A running job's latest stored train_loss.");
    for (size_t i = 0; i < n; i++)
        if (vals[i].has_loss)
            job_sample(t, "traind_job_train_loss", labels[i], vals[i].train_loss);
    family(t, "traind_job_tokens_per_second", "gauge",
           "A running job's latest stored tokens_per_s (gpt and sensorlm jobs).");
    for (size_t i = 0; i < n; i++)
        if (!isnan(vals[i].tokens_per_s))
            job_sample(t, "traind_job_tokens_per_second", labels[i], vals[i].tokens_per_s);
    family(t, "traind_job_samples_per_second", "gauge",
           "A running job's latest stored samples_per_s (mlp jobs).");
    for (size_t i = 0; i < n; i++)
        if (!isnan(vals[i].samples_per_s))
            job_sample(t, "traind_job_samples_per_second", labels[i], vals[i].samples_per_s);
}

static void store_series(td_prom *p, text *t)
{
    td_mq_stats_t q;
    struct stat st;

    td_daemon_metric_stats(p->d, &q);
    family(t, "traind_metric_rows_written_total", "counter",
           "Metric rows the store thread has written since traind started.");
    add(t, "traind_metric_rows_written_total %llu\n", (unsigned long long)q.rows_written);
    family(t, "traind_metric_queue_blocked_seconds_total", "counter",
           "Seconds training workers spent blocked on a full metric queue since traind started.");
    add(t, "traind_metric_queue_blocked_seconds_total");
    value(t, q.blocked_ms / 1000.0);
    family(t, "traind_metric_queue_samples", "gauge", "Metric samples waiting to be written.");
    add(t, "traind_metric_queue_samples %zu\n", q.queued);
    family(t, "traind_store_size_bytes", "gauge", "The size of traind.db on disk.");
    add(t, "traind_store_size_bytes %lld\n", stat(p->db, &st) == 0 ? (long long)st.st_size : 0LL);
    family(t, "traind_store_wal_bytes", "gauge", "The size of traind.db's write-ahead log.");
    add(t, "traind_store_wal_bytes %lld\n",
        td_daemon_store(p->d) != NULL ? (long long)td_store_wal_bytes(td_daemon_store(p->d)) : 0LL);
}

/* ---- the file ---- */

/* Replaces the file with len bytes of buf: a fresh NAME.tmp in the held directory, its mode,
 * the rename. Nothing here looks a path up: every call is relative to the directory opened at
 * start, so a directory swapped for a link since then is never followed. */
static int replace_file(td_prom *p, const char *buf, size_t len, td_error_t *err)
{
    const char *step = "create";
    ssize_t n = 0;
    int fd, e;

    /* Whatever is in the temporary file's place (a file, a link somebody put there) goes:
     * O_EXCL then creates a new file, and nothing is written through a link. */
    if (unlinkat(p->dirfd, p->tmp_name, 0) != 0 && errno != ENOENT)
        return td_error_set(err, -errno, "%s: cannot remove: %s", p->tmp, strerror(errno));
    fd = openat(p->dirfd, p->tmp_name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return td_error_set(err, -errno, "%s: cannot create: %s", p->tmp, strerror(errno));
    for (size_t off = 0; off < len; off += (size_t)n) {
        n = write(fd, buf + off, len - off);
        if (n < 0 && errno == EINTR) {
            n = 0;
            continue;
        }
        if (n <= 0) {
            step = "write";
            goto fail;
        }
    }
    step = "set the mode of";
    if (fchmod(fd, (mode_t)p->mode) != 0)
        goto fail;
    step = "close";
    if (close(fd) != 0) {
        fd = -1;
        goto fail;
    }
    fd = -1;
    step = "rename";
    if (renameat(p->dirfd, p->tmp_name, p->dirfd, p->name) != 0)
        goto fail;
    return 0;
fail:
    e = n == 0 && errno == 0 ? ENOSPC : errno;
    if (fd >= 0)
        close(fd);
    unlinkat(p->dirfd, p->tmp_name, 0);
    return td_error_set(err, -e, "%s: cannot %s it: %s", p->tmp, step, strerror(e));
}

/* Says once when the directory's path no longer leads to the directory held since the start
 * (replaced, or swapped for a link): the writes go on into the held one. The path is only
 * looked at, never written through. */
static void check_moved(td_prom *p)
{
    struct stat st;
    int moved = lstat(p->dir, &st) != 0 || st.st_dev != p->dir_dev || st.st_ino != p->dir_ino;

    if (moved && !p->moved)
        td_log_warn("prometheus: %s is no longer the directory traind opened at start; the "
                    "file is still written in the directory it holds (restart traind to take "
                    "the new one)",
                    p->dir);
    p->moved = moved;
}

/* Builds the exposition and writes it; a failure is logged once until a write succeeds. */
static void write_now(td_prom *p, int up)
{
    text t = {0};
    td_error_t err;
    int rc;

    check_moved(p);
    daemon_series(p, &t, up);
    job_series(p, &t);
    device_series(p, &t);
    running_series(p, &t);
    store_series(p, &t);
    rc = t.failed ? td_error_set(&err, TD_ENOMEM, "out of memory building the exposition")
                  : replace_file(p, t.buf, t.len, &err);
    free(t.buf);
    if (rc != 0 && !p->failing)
        td_log_warn("prometheus: cannot write %s: %s; tried again every %g s", p->path, err.msg,
                    (double)p->interval_ms / 1000.0);
    else if (rc == 0 && p->failing)
        td_log_notice("prometheus: %s written again", p->path);
    p->failing = rc != 0;
}

static void on_tick(uv_timer_t *h)
{
    write_now(h->data, 1);
}

/* Whether a user other than root and traind's own may change what the directory at fd
 * holds (path names it in the message): it or its group, when not root's or traind's, can
 * write it, or every user can, and it is not sticky. The owner can always chmod it: an owner
 * other than root or traind is refused, sticky or not. As logrotate refuses an "insecure
 * parent directory". */
static int check_dir(int fd, const char *path, td_error_t *err)
{
    struct stat st;
    int sticky;

    if (fstat(fd, &st) != 0)
        return td_error_set(err, -errno, "[metrics] prometheus_textfile: %s: %s", path,
                            strerror(errno));
    sticky = (st.st_mode & S_ISVTX) != 0;
    if (st.st_uid != 0 && st.st_uid != geteuid())
        return td_error_set(err, TD_EINVAL,
                            "[metrics] prometheus_textfile: insecure directory %s: owned by uid "
                            "%lu (only root or traind's own uid may own it or a directory above "
                            "it)",
                            path, (unsigned long)st.st_uid);
    if ((st.st_mode & S_IWGRP) && st.st_gid != 0 && st.st_gid != getegid() && !sticky)
        return td_error_set(err, TD_EINVAL,
                            "[metrics] prometheus_textfile: insecure directory %s: writable by "
                            "group %lu and not sticky",
                            path, (unsigned long)st.st_gid);
    if ((st.st_mode & S_IWOTH) && !sticky)
        return td_error_set(err, TD_EINVAL,
                            "[metrics] prometheus_textfile: insecure directory %s: writable by "
                            "every user and not sticky",
                            path);
    return 0;
}

/* Opens the absolute directory dir one component at a time from /, each with O_NOFOLLOW and
 * checked by check_dir, as systemd-tmpfiles walks a path: a link anywhere in it, or a
 * directory others may change, is refused. The descriptor in *out. */
static int open_dir(const char *file, const char *dir, int *out, td_error_t *err)
{
    char walked[sizeof(((td_prom *)0)->dir)], comp[sizeof(walked)];
    const char *s = dir;
    size_t wl = 0;
    int fd, next;

    fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return td_error_set(err, -errno, "[metrics] prometheus_textfile: /: %s", strerror(errno));
    if (check_dir(fd, "/", err) != 0)
        goto fail;
    walked[0] = '\0';
    for (;;) {
        size_t n;
        struct stat st;
        while (*s == '/')
            s++;
        if (*s == '\0')
            break;
        n = strcspn(s, "/");
        snprintf(comp, sizeof(comp), "%.*s", (int)n, s);
        wl += (size_t)snprintf(walked + wl, sizeof(walked) - wl, "/%s", comp);
        s += n;
        next = openat(fd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0) {
            int e = errno;
            if (e == ENOENT)
                td_error_set(err, -e, "cannot write the Prometheus file %s: %s does not exist",
                             file, walked);
            else if (fstatat(fd, comp, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
                td_error_set(err, TD_EINVAL,
                             "[metrics] prometheus_textfile: insecure directory %s: a symbolic "
                             "link (traind follows none on the way to the file)",
                             walked);
            else if (e == ENOTDIR)
                td_error_set(err, -e, "cannot write the Prometheus file %s: %s is not a directory",
                             file, walked);
            else
                td_error_set(err, -e, "[metrics] prometheus_textfile: %s: %s", walked, strerror(e));
            goto fail;
        }
        close(fd);
        fd = next;
        if (check_dir(fd, walked, err) != 0)
            goto fail;
    }
    *out = fd;
    return 0;
fail:
    close(fd);
    return -1;
}

int td_prom_open(td_prom *p, const td_config *cfg, td_error_t *err)
{
    const char *slash = strrchr(cfg->prom_path, '/');
    struct stat st;

    memset(p, 0, sizeof(*p));
    p->dirfd = -1;
    snprintf(p->path, sizeof(p->path), "%s", cfg->prom_path);
    snprintf(p->tmp, sizeof(p->tmp), "%s.tmp", cfg->prom_path);
    /* The config checked an absolute path with a name after its last slash. */
    snprintf(p->dir, sizeof(p->dir), "%.*s",
             slash == cfg->prom_path ? 1 : (int)(slash - cfg->prom_path), cfg->prom_path);
    snprintf(p->name, sizeof(p->name), "%s", slash + 1);
    snprintf(p->tmp_name, sizeof(p->tmp_name), "%s.tmp", slash + 1);
    if (open_dir(p->path, p->dir, &p->dirfd, err) != 0) {
        p->dirfd = -1;
        return -1;
    }
    if (fstat(p->dirfd, &st) == 0) {
        p->dir_dev = st.st_dev;
        p->dir_ino = st.st_ino;
    }
    return 0;
}

int td_prom_start(td_prom *p, uv_loop_t *loop, td_daemon *d, const td_config *cfg, double started,
                  int64_t restarts)
{
    int rc;

    p->d = d;
    snprintf(p->db, sizeof(p->db), "%s", cfg->db_path);
    p->mode = cfg->prom_mode;
    p->interval_ms = (uint64_t)(cfg->prom_interval_s * 1000);
    p->started = started;
    p->restarts = restarts;
    if ((rc = uv_timer_init(loop, &p->tick)) != 0)
        return rc;
    if ((rc = uv_timer_init(loop, &p->soon)) != 0) {
        uv_close((uv_handle_t *)&p->tick, NULL);
        return rc;
    }
    p->tick.data = p->soon.data = p;
    p->open = 1;
    uv_timer_start(&p->tick, on_tick, 0, p->interval_ms);
    /* The timers alone must not keep the loop turning once everything else has stopped. */
    uv_unref((uv_handle_t *)&p->tick);
    uv_unref((uv_handle_t *)&p->soon);
    td_log_info("prometheus: writing %s every %g s", p->path, (double)p->interval_ms / 1000.0);
    return 0;
}

void td_prom_job_changed(td_prom *p)
{
    /* A timer of 0 runs at the next turn's timers: every change of this turn writes once. */
    if (p->open && !uv_is_active((uv_handle_t *)&p->soon))
        uv_timer_start(&p->soon, on_tick, 0, 0);
}

void td_prom_close(td_prom *p)
{
    if (!p->open)
        return;
    p->open = 0;
    write_now(p, 0);
    uv_close((uv_handle_t *)&p->tick, NULL);
    uv_close((uv_handle_t *)&p->soon, NULL);
    if (p->dirfd >= 0)
        close(p->dirfd);
    p->dirfd = -1;
}
