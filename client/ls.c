/* trainctl ls's table: the fields a column can show (--format NAME,NAME), the default and the
 * wide sets (-o wide), the order (--sort [-]NAME), each cell made from a JOB map (PROTOCOL.md,
 * "status") and the columns lined up. A queued job's REASON is traind's, as squeue's is. */
#include <math.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"
#include "common/td_text.h"

#define LS_NAME_MAX  24  /* characters of a job name shown */
#define LS_ERROR_MAX 60  /* characters of an error shown (-o wide) */
#define LS_CELL      512 /* bytes of one cell */
#define LS_COLS_MAX  24  /* columns of one --format */

typedef void (*cell_fn)(const td_pval *job, double now, char *buf, size_t size);
typedef double (*num_fn)(const td_pval *job, double now);

typedef struct ls_field {
    const char *name;   /* in --format and --sort */
    const char *header; /* the column's */
    cell_fn cell;
    num_fn num; /* --sort by number; NULL: by the cell's text */
} ls_field;

/* Characters (not bytes) of a UTF-8 string, for lining up columns. */
static int text_width(const char *s)
{
    int n = 0;

    for (; *s != '\0'; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* Cuts s to at most max characters, at a character boundary, marking the cut with '~'. */
static void cut_text(char *s, int max)
{
    int n = 0;

    for (char *p = s; *p != '\0'; p++)
        if (((unsigned char)*p & 0xC0) != 0x80 && ++n == max && text_width(p) > 1) {
            p[0] = '~';
            p[1] = '\0';
            return;
        }
}

/* ---- the numbers ---- */

static double num_id(const td_pval *job, double now)
{
    return (double)tc_job_int(job, "id", -1);
}

static double num_priority(const td_pval *job, double now)
{
    return (double)tc_job_int(job, "priority", 0);
}

static double num_step(const td_pval *job, double now)
{
    return (double)tc_job_int(job, "step", 0);
}

static double num_devices(const td_pval *job, double now)
{
    return (double)tc_job_int(job, "devices", 0);
}

/* Seconds the job has run: to its end, or to now while it runs; -1 before it started. */
static double num_elapsed(const td_pval *job, double now)
{
    double started = tc_job_double(job, "started", 0), ended = tc_job_double(job, "ended", 0);

    if (started <= 0)
        return -1;
    return (ended > 0 ? ended : now) - started;
}

static double num_age(const td_pval *job, double now)
{
    double created = tc_job_double(job, "created", 0);

    return created > 0 ? now - created : -1;
}

static double num_created(const td_pval *job, double now)
{
    return tc_job_double(job, "created", 0);
}

static double num_started(const td_pval *job, double now)
{
    return tc_job_double(job, "started", 0);
}

static double num_ended(const td_pval *job, double now)
{
    return tc_job_double(job, "ended", 0);
}

/* ---- the cells ---- */

static void cell_id(const td_pval *job, double now, char *buf, size_t size)
{
    snprintf(buf, size, "%lld", (long long)tc_job_int(job, "id", -1));
}

static void cell_name(const td_pval *job, double now, char *buf, size_t size)
{
    tc_job_str(job, "name", buf, size);
    cut_text(buf, LS_NAME_MAX);
}

/* uids looked up already: a listing of thousands of jobs has a few owners */
#define LS_USERS 32
static struct {
    int64_t uid;
    char name[64];
} users[LS_USERS];
static size_t nusers;

/* The submitter's user name, else the uid; "-" for a job stored before traind kept it. */
static void cell_user(const td_pval *job, double now, char *buf, size_t size)
{
    int64_t uid = tc_job_int(job, "uid", -1);
    struct passwd pw, *found = NULL;
    char pwbuf[1024];
    size_t i;

    if (uid < 0) {
        snprintf(buf, size, "-");
        return;
    }
    for (i = 0; i < nusers && users[i].uid != uid; i++)
        ;
    if (i == nusers) {
        i = nusers < LS_USERS ? nusers++ : (size_t)uid % LS_USERS;
        users[i].uid = uid;
        if (getpwuid_r((uid_t)uid, &pw, pwbuf, sizeof(pwbuf), &found) == 0 && found != NULL)
            snprintf(users[i].name, sizeof(users[i].name), "%s", pw.pw_name);
        else
            snprintf(users[i].name, sizeof(users[i].name), "%lld", (long long)uid);
    }
    snprintf(buf, size, "%s", users[i].name);
}

static void cell_priority(const td_pval *job, double now, char *buf, size_t size)
{
    snprintf(buf, size, "%lld", (long long)tc_job_int(job, "priority", 0));
}

static void cell_state(const td_pval *job, double now, char *buf, size_t size)
{
    tc_job_str(job, "state", buf, size);
}

/* A queued job's reason (traind's), "-" for any other (or from a daemon that sends none). */
static void cell_reason(const td_pval *job, double now, char *buf, size_t size)
{
    tc_job_str(job, "reason", buf, size);
    if (buf[0] == '\0')
        snprintf(buf, size, "-");
}

/* "230/1407", the step alone while the total is not known, "-" before the first. */
static void cell_step(const td_pval *job, double now, char *buf, size_t size)
{
    int64_t step = tc_job_int(job, "step", 0), total = tc_job_int(job, "total_steps", 0);

    if (total > 0)
        snprintf(buf, size, "%lld/%lld", (long long)step, (long long)total);
    else if (step > 0)
        snprintf(buf, size, "%lld", (long long)step);
    else
        snprintf(buf, size, "-");
}

/* The devices it runs or ran on, else how many it asks for. */
static void cell_devices(const td_pval *job, double now, char *buf, size_t size)
{
    tc_job_str(job, "device_list", buf, size);
    if (buf[0] == '\0')
        snprintf(buf, size, "%lld", (long long)tc_job_int(job, "devices", 0));
}

static void cell_duration(double s, char *buf, size_t size)
{
    if (s < 0)
        snprintf(buf, size, "-");
    else
        tc_fmt_duration(buf, size, s);
}

static void cell_elapsed(const td_pval *job, double now, char *buf, size_t size)
{
    cell_duration(num_elapsed(job, now), buf, size);
}

static void cell_age(const td_pval *job, double now, char *buf, size_t size)
{
    cell_duration(num_age(job, now), buf, size);
}

static void cell_created(const td_pval *job, double now, char *buf, size_t size)
{
    tc_fmt_time(buf, size, tc_job_double(job, "created", 0));
}

static void cell_started(const td_pval *job, double now, char *buf, size_t size)
{
    tc_fmt_time(buf, size, tc_job_double(job, "started", 0));
}

static void cell_ended(const td_pval *job, double now, char *buf, size_t size)
{
    tc_fmt_time(buf, size, tc_job_double(job, "ended", 0));
}

/* The latest train_loss and accuracies, "key value" pairs. */
static void cell_metrics(const td_pval *job, double now, char *buf, size_t size)
{
    static const char *const shown[] = {"train_loss", "test_accuracy", "valid_accuracy",
                                        "zeroshot_accuracy"};
    const td_pval *m = td_pv_get(job, "metrics");
    char val[32];
    size_t n = 0;
    double d;

    buf[0] = '\0';
    for (size_t i = 0; i < sizeof(shown) / sizeof(shown[0]); i++)
        if (td_pv_double(td_pv_get(m, shown[i]), &d) == 0 && n + 1 < size) {
            tc_fmt_value(val, sizeof(val), d);
            int k = snprintf(buf + n, size - n, "%s%s %s", n ? "  " : "", shown[i], val);
            n = k > 0 && n + (size_t)k < size ? n + (size_t)k : size - 1;
        }
}

/* "team=vision,env=prod"; "-" for none. */
static void cell_labels(const td_pval *job, double now, char *buf, size_t size)
{
    const td_pval *m = td_pv_get(job, "labels");
    size_t n = 0;
    char k[4 * 64], v[4 * 64];

    buf[0] = '\0';
    for (size_t i = 0; i < td_pv_len(m) && n + 1 < size; i++) {
        size_t kl = 0, vl = 0;
        const char *ks = td_pv_str(td_pv_key_at(m, i), &kl),
                   *vs = td_pv_str(td_pv_val_at(m, i), &vl);
        td_text_escape(k, sizeof(k), ks != NULL ? ks : "", ks != NULL ? kl : 0, 0);
        td_text_escape(v, sizeof(v), vs != NULL ? vs : "", vs != NULL ? vl : 0, 0);
        int w = snprintf(buf + n, size - n, "%s%s=%s", n ? "," : "", k, v);
        n = w > 0 && n + (size_t)w < size ? n + (size_t)w : size - 1;
    }
    if (buf[0] == '\0')
        snprintf(buf, size, "-");
}

/* The error's code name and its first line, cut; "-" for none. */
static void cell_error(const td_pval *job, double now, char *buf, size_t size)
{
    char msg[1024], name[32];

    tc_job_error(job, msg, sizeof(msg));
    tc_job_str(td_pv_get(job, "error"), "name", name, sizeof(name));
    msg[strcspn(msg, "\n")] = '\0';
    if (msg[0] == '\0')
        snprintf(buf, size, "-");
    else
        snprintf(buf, size, "%s%s%s", name, name[0] ? ": " : "", msg);
    cut_text(buf, LS_ERROR_MAX);
}

static const ls_field fields[] = {
    {"id", "ID", cell_id, num_id},
    {"name", "NAME", cell_name, NULL},
    {"user", "USER", cell_user, NULL},
    {"priority", "PRIORITY", cell_priority, num_priority},
    {"state", "STATE", cell_state, NULL},
    {"reason", "REASON", cell_reason, NULL},
    {"step", "STEP", cell_step, num_step},
    {"devices", "DEVICES", cell_devices, num_devices},
    {"elapsed", "ELAPSED", cell_elapsed, num_elapsed},
    {"age", "AGE", cell_age, num_age},
    {"created", "CREATED", cell_created, num_created},
    {"started", "STARTED", cell_started, num_started},
    {"ended", "ENDED", cell_ended, num_ended},
    {"error", "ERROR", cell_error, NULL},
    {"labels", "LABELS", cell_labels, NULL},
    {"metrics", "METRICS", cell_metrics, NULL},
};
#define NFIELDS (sizeof(fields) / sizeof(fields[0]))

const char *const tc_ls_default_format = "id,name,user,priority,state,reason,step,devices,elapsed,"
                                         "metrics";
const char *const tc_ls_wide_format = "id,name,user,priority,state,reason,step,devices,elapsed,"
                                      "age,created,started,ended,labels,error,metrics";

static const ls_field *find_field(const char *name, size_t len)
{
    for (size_t i = 0; i < NFIELDS; i++)
        if (strlen(fields[i].name) == len && memcmp(fields[i].name, name, len) == 0)
            return &fields[i];
    return NULL;
}

/* "id, name, ..." into buf: what --format and --sort take. */
void tc_ls_field_names(char *buf, size_t size)
{
    size_t n = 0;

    buf[0] = '\0';
    for (size_t i = 0; i < NFIELDS && n + 1 < size; i++) {
        int k = snprintf(buf + n, size - n, "%s%s", i ? ", " : "", fields[i].name);
        n = k > 0 && n + (size_t)k < size ? n + (size_t)k : size - 1;
    }
}

int tc_ls_check_format(const char *format, char *bad, size_t size)
{
    const char *p = format, *end;
    int n = 0;

    for (;; p = end + 1) {
        end = strchrnul(p, ',');
        if (end == p || find_field(p, (size_t)(end - p)) == NULL || ++n > LS_COLS_MAX) {
            snprintf(bad, size, "%.*s", (int)(end - p), p);
            return -1;
        }
        if (*end == '\0')
            return 0;
    }
}

int tc_ls_check_sort(const char *sort)
{
    if (sort[0] == '-')
        sort++;
    return find_field(sort, strlen(sort)) != NULL ? 0 : -1;
}

/* ---- sorting ---- */

typedef struct sort_item {
    const td_pval *job;
    double num;
    char text[LS_CELL];
    size_t at; /* its place before sorting: the sort is stable */
} sort_item;

static const ls_field *sort_by;
static int sort_desc;

static int by_field(const void *a, const void *b)
{
    const sort_item *x = a, *y = b;
    int c = sort_by->num != NULL ? (x->num > y->num) - (x->num < y->num) : strcmp(x->text, y->text);

    if (sort_desc)
        c = -c;
    return c != 0 ? c : (x->at > y->at) - (x->at < y->at);
}

/* Sorts jobs[0..n) in place by --sort's field (a leading '-': descending); a tie keeps the
 * listing's order (by id). */
static int sort_jobs(const td_pval **jobs, size_t n, const char *sort, double now)
{
    sort_item *items;

    if (sort == NULL || n < 2)
        return TC_OK;
    sort_desc = sort[0] == '-';
    sort_by = find_field(sort + sort_desc, strlen(sort + sort_desc));
    items = calloc(n, sizeof(*items));
    if (items == NULL)
        return tc_err(TC_FAILED, "out of memory");
    for (size_t i = 0; i < n; i++) {
        items[i].job = jobs[i];
        items[i].at = i;
        if (sort_by->num != NULL)
            items[i].num = sort_by->num(jobs[i], now);
        else
            sort_by->cell(jobs[i], now, items[i].text, sizeof(items[i].text));
    }
    qsort(items, n, sizeof(*items), by_field);
    for (size_t i = 0; i < n; i++)
        jobs[i] = items[i].job;
    free(items);
    return TC_OK;
}

/* ---- the table ---- */

static size_t parse_columns(const char *format, const ls_field **cols)
{
    const char *p = format, *end;
    size_t n = 0;

    for (; n < LS_COLS_MAX; p = end + 1) {
        end = strchrnul(p, ',');
        if ((cols[n] = find_field(p, (size_t)(end - p))) != NULL)
            n++;
        if (*end == '\0')
            break;
    }
    return n;
}

int tc_ls_print(const td_pval **jobs, size_t n, const char *format, const char *sort)
{
    const ls_field *cols[LS_COLS_MAX];
    size_t ncols = parse_columns(format, cols);
    int width[LS_COLS_MAX], rc;
    double now = tc_now_real();
    char cell[LS_CELL];

    if ((rc = sort_jobs(jobs, n, sort, now)) != TC_OK)
        return rc;
    for (size_t c = 0; c < ncols; c++)
        width[c] = text_width(cols[c]->header);
    for (size_t i = 0; i < n; i++)
        for (size_t c = 0; c < ncols; c++) {
            cols[c]->cell(jobs[i], now, cell, sizeof(cell));
            if (text_width(cell) > width[c])
                width[c] = text_width(cell);
        }
    /* The last column is not padded: no trailing blanks. */
    for (size_t c = 0; c < ncols; c++)
        printf("%s%*s", cols[c]->header,
               c + 1 < ncols ? width[c] - text_width(cols[c]->header) + 2 : 0, "");
    putchar('\n');
    for (size_t i = 0; i < n; i++) {
        for (size_t c = 0; c < ncols; c++) {
            cols[c]->cell(jobs[i], now, cell, sizeof(cell));
            printf("%s%*s", cell, c + 1 < ncols ? width[c] - text_width(cell) + 2 : 0, "");
        }
        putchar('\n');
    }
    return TC_OK;
}

int tc_ls_sort(const td_pval **jobs, size_t n, const char *sort)
{
    return sort_jobs(jobs, n, sort, tc_now_real());
}
