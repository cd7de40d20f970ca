/* Text for people: the fields of a JOB map (see PROTOCOL.md), the `status` summary, the `ls`
 * table, the `info` summary, durations, times, sizes and metric values. Everything here writes to
 * stdout, which main() flushes once at the end. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/client.h"
#include "common/td_clock.h"
#include "common/td_text.h"

#define TC_INFO_QUEUE_MAX 20 /* queued job ids info lists before "and N more" */

/* One key/value pair of a map, for sorting by key. */
typedef struct kv {
    const char *key;
    size_t len;
    const td_pval *val;
} kv;

int64_t tc_job_int(const td_pval *job, const char *key, int64_t dflt)
{
    int64_t v;

    return td_pv_int(td_pv_get(job, key), &v) == 0 ? v : dflt;
}

double tc_job_double(const td_pval *job, const char *key, double dflt)
{
    double v;

    return td_pv_double(td_pv_get(job, key), &v) == 0 ? v : dflt;
}

/* The string at key, escaped (td_text_escape): what traind sends was written by some client
 * (a job's name, an error quoting a path) and is shown on this user's terminal. */
static void job_text(const td_pval *job, const char *key, char *buf, size_t size, int flags)
{
    size_t len = 0;
    const char *s = td_pv_str(td_pv_get(job, key), &len);

    td_text_escape(buf, size, s != NULL ? s : "", s != NULL ? len : 0, flags);
}

void tc_job_str(const td_pval *job, const char *key, char *buf, size_t size)
{
    job_text(job, key, buf, size, 0);
}

void tc_fmt_duration(char *buf, size_t size, double seconds)
{
    long long s = seconds > 0 && seconds < 1e12 ? (long long)(seconds + 0.5) : 0;

    if (s < 60)
        snprintf(buf, size, "%llds", s);
    else if (s < 3600)
        snprintf(buf, size, "%lldm%02llds", s / 60, s % 60);
    else if (s < 86400)
        snprintf(buf, size, "%lldh%02lldm", s / 3600, s / 60 % 60);
    else
        snprintf(buf, size, "%lldd%02lldh", s / 86400, s / 3600 % 24);
}

void tc_fmt_value(char *buf, size_t size, double v)
{
    if (v == floor(v) && fabs(v) < 1e15)
        snprintf(buf, size, "%.0f", v);
    else
        snprintf(buf, size, "%.6g", v);
}

double tc_now_real(void)
{
    return td_wall_s();
}

void tc_fmt_time(char *buf, size_t size, double t)
{
    time_t secs = (time_t)t;
    struct tm tm;

    if (t <= 0 || localtime_r(&secs, &tm) == NULL || strftime(buf, size, "%F %T", &tm) == 0)
        snprintf(buf, size, "-");
}

static int by_key(const void *a, const void *b)
{
    const kv *x = a, *y = b;
    int c = memcmp(x->key, y->key, x->len < y->len ? x->len : y->len);

    return c != 0 ? c : (x->len > y->len) - (x->len < y->len);
}

/* The map's string-keyed pairs, sorted by key. Caller frees; NULL (and *n 0) when there are
 * none or no memory. */
static kv *sorted_pairs(const td_pval *map, size_t *n)
{
    size_t i, len = td_pv_len(map);
    kv *out = len ? calloc(len, sizeof(*out)) : NULL;

    *n = 0;
    for (i = 0; out != NULL && i < len; i++) {
        out[*n].key = td_pv_str(td_pv_key_at(map, i), &out[*n].len);
        out[*n].val = td_pv_val_at(map, i);
        *n += out[*n].key != NULL;
    }
    if (out != NULL)
        qsort(out, *n, sizeof(*out), by_key);
    return out;
}

void tc_job_error(const td_pval *job, char *buf, size_t size)
{
    const td_pval *e = td_pv_get(job, "error");
    int64_t code = tc_job_int(e, "code", 0);

    buf[0] = '\0';
    if (td_pv_type_of(e) != TD_PV_MAP)
        return;
    job_text(e, "message", buf, size, TD_TEXT_KEEP_NEWLINES);
    if (buf[0] == '\0')
        snprintf(buf, size, "%s", td_strerror((int)code));
}

int tc_is_eval_key(const char *k, size_t len)
{
    /* a sensorlm's evaluation: recall_at_1, recall_at_5, text_recall_at_1, zeroshot_accuracy */
    static const char *const slm[] = {"recall_at_", "text_recall_at_", "zeroshot_"};

    for (size_t i = 0; i < sizeof(slm) / sizeof(slm[0]); i++)
        if (len > strlen(slm[i]) && memcmp(k, slm[i], strlen(slm[i])) == 0)
            return 1;
    return (len > 5 && memcmp(k, "test_", 5) == 0) || (len > 6 && memcmp(k, "valid_", 6) == 0) ||
           (len > 4 && memcmp(k, "val_", 4) == 0);
}

/* Appends " key value" to buf (of size bytes, holding *n). */
static void append_metric(char *buf, size_t size, size_t *n, const kv *p)
{
    char val[32];
    double d = NAN;
    int k;

    td_pv_double(p->val, &d);
    tc_fmt_value(val, sizeof(val), d);
    k = snprintf(buf + *n, size - *n, "%s%.*s %s", *n ? "  " : "", (int)p->len, p->key, val);
    if (k > 0)
        *n = *n + (size_t)k < size ? *n + (size_t)k : size - 1;
}

void tc_job_results(const td_pval *job, char *buf, size_t size)
{
    size_t n = 0, i, len = 0;
    kv *pairs = sorted_pairs(td_pv_get(job, "metrics"), &len);

    buf[0] = '\0';
    for (i = 0; i < len; i++)
        if (tc_is_eval_key(pairs[i].key, pairs[i].len))
            append_metric(buf, size, &n, &pairs[i]);
    for (i = 0; i < len; i++)
        if (pairs[i].len == 10 && memcmp(pairs[i].key, "train_loss", 10) == 0)
            append_metric(buf, size, &n, &pairs[i]);
    free(pairs);
}

/* "230/1407 (16%)" (percent) or "230/1407"; the step alone while the total is not known,
 * which ls shows as "-" before the first step. */
static void fmt_step(char *buf, size_t size, const td_pval *job, int percent)
{
    int64_t step = tc_job_int(job, "step", 0), total = tc_job_int(job, "total_steps", 0);

    if (total > 0 && percent)
        snprintf(buf, size, "%lld/%lld (%d%%)", (long long)step, (long long)total,
                 (int)(100 * step / total));
    else if (total > 0)
        snprintf(buf, size, "%lld/%lld", (long long)step, (long long)total);
    else if (step > 0 || percent)
        snprintf(buf, size, "%lld", (long long)step);
    else
        snprintf(buf, size, "-");
}

/* A time line of `status`: the time and, when dur is known (>= 0), a duration in words. */
static void print_time(const char *label, double t, double dur, const char *before,
                       const char *after)
{
    char when[64], d[32];

    tc_fmt_time(when, sizeof(when), t);
    tc_fmt_duration(d, sizeof(d), dur);
    if (t > 0 && dur >= 0)
        printf("%-9s%s (%s%s%s)\n", label, when, before, d, after);
    else
        printf("%-9s%s\n", label, when);
}

/* The error, its continuation lines indented under the first. */
static void print_error(const td_pval *job)
{
    char msg[1024], name[32];
    const char *p, *nl;

    tc_job_error(job, msg, sizeof(msg));
    if (msg[0] == '\0')
        return;
    tc_job_str(td_pv_get(job, "error"), "name", name, sizeof(name));
    printf("%-9s%s%s", "error", name, name[0] ? ": " : "");
    for (p = msg; (nl = strchr(p, '\n')) != NULL; p = nl + 1)
        printf("%.*s\n%9s", (int)(nl - p), p, "");
    printf("%s\n", p);
}

static void print_metrics(const td_pval *job)
{
    size_t i, n = 0;
    kv *pairs = sorted_pairs(td_pv_get(job, "metrics"), &n);
    char val[32];
    double d;

    if (n > 0)
        printf("metrics\n");
    for (i = 0; i < n; i++) {
        d = NAN;
        td_pv_double(pairs[i].val, &d);
        tc_fmt_value(val, sizeof(val), d);
        printf("  %-22.*s %s\n", (int)pairs[i].len, pairs[i].key, val);
    }
    free(pairs);
}

/* A job that spans nodes: its nodes, and each restart with its cause and new size. Nothing
 * for any other job (or from a daemon that sends neither field). */
static void print_nodes(const td_pval *job)
{
    const td_pval *nodes = td_pv_get(job, "nodes"), *restarts = td_pv_get(job, "restarts");
    char name[4 * 64 + 1], cause[4 * 512 + 1];

    if (td_pv_len(nodes) > 0) {
        printf("%-9s%zu:", "nodes", td_pv_len(nodes));
        for (size_t i = 0; i < td_pv_len(nodes); i++) {
            size_t len;
            const char *s = td_pv_str(td_pv_at(nodes, i), &len);
            td_text_escape(name, sizeof(name), s != NULL ? s : "?", s != NULL ? len : 1, 0);
            printf("%s %s", i ? "," : "", name);
        }
        printf("\n");
    }
    for (size_t i = 0; i < td_pv_len(restarts); i++) {
        const td_pval *r = td_pv_at(restarts, i);
        int64_t n = tc_job_int(r, "nodes", 0);
        size_t len;
        const char *s = td_pv_str(td_pv_get(r, "cause"), &len);
        td_text_escape(cause, sizeof(cause), s != NULL ? s : "", s != NULL ? len : 0, 0);
        if (n > 0)
            printf("%-9s%s; resumed on %lld node(s)\n", "restart", cause, (long long)n);
        else
            printf("%-9s%s; relaunched, waiting for its ranks\n", "restart", cause);
    }
}

void tc_print_status(const td_pval *job)
{
    char name[256], state[32], step[64], devs[256];
    double created = tc_job_double(job, "created", 0), started = tc_job_double(job, "started", 0);
    double ended = tc_job_double(job, "ended", 0), now = tc_now_real();

    tc_job_str(job, "name", name, sizeof(name));
    tc_job_str(job, "state", state, sizeof(state));
    tc_job_str(job, "device_list", devs, sizeof(devs));
    fmt_step(step, sizeof(step), job, 1);
    printf("job %lld  %s\n", (long long)tc_job_int(job, "id", -1), name);
    printf("%-9s%s\n", "state", state);
    printf("%-9s%s\n", "step", step);
    printf("%-9s%lld%s%s%s\n", "devices", (long long)tc_job_int(job, "devices", 0),
           devs[0] ? " (" : "", devs, devs[0] ? ")" : "");
    print_nodes(job);
    print_time("created", created, now - created, "", " ago");
    print_time("started", started, ended > 0 ? -1 : now - started, "running for ", "");
    print_time("ended", ended, started > 0 ? ended - started : -1, "took ", "");
    print_error(job);
    print_metrics(job);
}

/* ---- info ---- */

/* One line of the estimate: the part's name and its size in MiB. */
static void estimate_line(const char *name, const td_pval *mem, const char *key, const char *note)
{
    double mib = (double)tc_job_int(mem, key, 0) / (1 << 20);

    printf("  %-13s %12.1f MiB%s\n", name, mib, note);
}

void tc_print_estimate(const td_pval *est)
{
    const td_pval *mem = td_pv_get(est, "memory");
    int64_t devices = tc_job_int(est, "devices", 1), batch = tc_job_int(est, "batch_size", 0);
    int64_t largest = tc_job_int(est, "largest_batch", 0);
    char device[32];
    int fits = 0, bauto = 0;

    td_pv_bool(td_pv_get(est, "fits"), &fits);
    td_pv_bool(td_pv_get(est, "batch_auto"), &bauto);
    tc_job_str(est, "device", device, sizeof(device));
    printf("batch_size %lld%s over %lld device(s): %lld rows per device\n", (long long)batch,
           bauto ? " (auto)" : "", (long long)devices, (long long)tc_job_int(mem, "rows", 0));
    printf("memory per device:\n");
    estimate_line("parameters", mem, "parameters", "");
    estimate_line("gradients", mem, "gradients", "");
    estimate_line("optimizer", mem, "optimizer", "");
    estimate_line("activations", mem, "activations", "");
    estimate_line("  attention", mem, "attention", " (of activations)");
    estimate_line("workspace", mem, "workspace", "");
    estimate_line("total", mem, "total", "");
    estimate_line("data", mem, "data", " (the dataset, in host memory; on cpu: with the total)");
    printf("%-15s %12.1f MiB free of %.1f MiB\n", device,
           (double)tc_job_int(est, "free_bytes", 0) / (1 << 20),
           (double)tc_job_int(est, "total_bytes", 0) / (1 << 20));
    printf("fits: %s\n", fits ? "yes" : "no");
    if (largest > 0)
        printf("largest batch_size that fits: %lld\n", (long long)largest);
    else
        printf("largest batch_size that fits: none (not even one row per device)\n");
    printf("batch_size \"auto\" would take: %lld\n", (long long)tc_job_int(est, "auto_batch", 0));
}

void tc_fmt_bytes(char *buf, size_t size, double bytes)
{
    static const char *const units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    size_t u = 0;

    while (bytes >= 1024 && u + 1 < sizeof(units) / sizeof(units[0])) {
        bytes /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, size, "%.0f bytes", bytes);
    else
        snprintf(buf, size, "%.1f %s", bytes, units[u]);
}

/* "  cuda:0  80517/143771 MiB free  job 3  fashion-mnist-mlp" or "  cpu:1  idle" (the
 * memory when the daemon could read it) */
static void print_device(const td_pval *dev, int width)
{
    char name[128], job_name[256], mem[64] = "";
    int64_t job = tc_job_int(dev, "job_id", -1);
    int64_t free_b = tc_job_int(dev, "free_bytes", -1),
            total_b = tc_job_int(dev, "total_bytes", -1);

    tc_job_str(dev, "name", name, sizeof(name));
    tc_job_str(dev, "job_name", job_name, sizeof(job_name));
    if (free_b >= 0 && total_b > 0)
        snprintf(mem, sizeof(mem), "  %lld/%lld MiB free", (long long)(free_b >> 20),
                 (long long)(total_b >> 20));
    if (job >= 0)
        printf("  %-*s%s  job %lld  %s\n", width, name, mem, (long long)job, job_name);
    else
        printf("  %-*s%s  idle\n", width, name, mem);
}

/* "queue    3 jobs: 4 5 6", at most TC_INFO_QUEUE_MAX ids. n counts them all: traind lists
 * the first ones only (PROTOCOL.md, "info": queued_total). */
static void print_queue(const td_pval *queued, size_t n)
{
    size_t i;
    int64_t id;

    if (n == 0) {
        printf("%-9s%s\n", "queue", "empty");
        return;
    }
    printf("%-9s%zu job%s:", "queue", n, n == 1 ? "" : "s");
    for (i = 0; i < n && i < TC_INFO_QUEUE_MAX; i++)
        if (td_pv_int(td_pv_at(queued, i), &id) == 0)
            printf(" %lld", (long long)id);
    if (n > TC_INFO_QUEUE_MAX)
        printf(" and %zu more", n - TC_INFO_QUEUE_MAX);
    printf("\n");
}

void tc_print_info(const td_pval *info)
{
    const td_pval *store = td_pv_get(info, "store"), *devs = td_pv_get(info, "devices");
    char version[128], path[1024], size[32], wal[32], name[128];
    int64_t bytes = tc_job_int(store, "size_bytes", -1),
            wal_bytes = tc_job_int(store, "wal_bytes", -1);
    size_t i, n = td_pv_len(devs);
    int width = 0;

    tc_job_str(info, "version", version, sizeof(version));
    tc_job_str(store, "path", path, sizeof(path));
    /* PROTOCOL.md gives the version alone ("0.1.0"); hello's server field says "traind 0.1.0" */
    printf("%s%s, protocol %lld\n", strncmp(version, "traind", 6) != 0 ? "traind " : "",
           version[0] ? version : "(version unknown)", (long long)tc_job_int(info, "protocol", -1));
    tc_fmt_bytes(size, sizeof(size), (double)bytes);
    tc_fmt_bytes(wal, sizeof(wal), (double)wal_bytes);
    if (bytes >= 0 && wal_bytes >= 0)
        printf("%-9s%s (%s, WAL %s)\n", "store", path[0] ? path : "-", size, wal);
    else if (bytes >= 0)
        printf("%-9s%s (%s)\n", "store", path[0] ? path : "-", size);
    else
        printf("%-9s%s\n", "store", path[0] ? path : "-");
    for (i = 0; i < n; i++) {
        tc_job_str(td_pv_at(devs, i), "name", name, sizeof(name));
        width = (int)strlen(name) > width ? (int)strlen(name) : width;
    }
    printf("%-9s%zu\n", "devices", n);
    for (i = 0; i < n; i++)
        print_device(td_pv_at(devs, i), width);
    print_queue(
        td_pv_get(info, "queued"),
        (size_t)tc_job_int(info, "queued_total", (int64_t)td_pv_len(td_pv_get(info, "queued"))));
}

int tc_flush_stdout(void)
{
    if (fflush(stdout) != 0 || ferror(stdout))
        return tc_err(TC_FAILED, "cannot write to standard output: %s", strerror(errno));
    return TC_OK;
}
