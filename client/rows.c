/* Metric rows as traind streams them ([key, step, value, time] arrays in `rows` frames), and
 * the sink that prints a metrics reply as CSV, as a JSON array, or as a per-key summary.
 * Rows are written straight to stdout with stdio (no JSON objects per row, one pass), so
 * 100,000 rows cost what printing them costs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"

#define TC_SUMMARY_MIN_SLOTS 64 /* slots of the first summary table (a power of two) */

int tc_row_at(const td_pval *rows, size_t i, tc_row *out)
{
    const td_pval *row = td_pv_at(rows, i);

    out->key = td_pv_str(td_pv_at(row, 0), &out->keylen);
    if (td_pv_len(row) < 4 || out->key == NULL || td_pv_int(td_pv_at(row, 1), &out->step) != 0 ||
        td_pv_double(td_pv_at(row, 2), &out->value) != 0 ||
        td_pv_double(td_pv_at(row, 3), &out->time) != 0)
        return tc_err(TC_PROTOCOL, "traind sent a metric row that is not [key, step, value, time]");
    return TC_OK;
}

/* A number for JSON: a time with 3 decimals, any other value with %.9g. Non-finite values
 * have no JSON form and become null. */
static void json_num(FILE *f, double v, int is_time)
{
    if (!isfinite(v))
        fputs("null", f);
    else if (is_time)
        fprintf(f, "%.3f", v);
    else
        fprintf(f, "%.9g", v);
}

void tc_row_json(FILE *f, int64_t job, const tc_row *row)
{
    fprintf(f, "{\"job\":%lld,\"key\":", (long long)job);
    tc_json_str(f, row->key, row->keylen);
    fprintf(f, ",\"step\":%lld,\"value\":", (long long)row->step);
    json_num(f, row->value, 0);
    fputs(",\"time\":", f);
    json_num(f, row->time, 1);
    fputc('}', f);
}

/* A CSV field: quoted only when it holds a comma, a quote or a line break. */
static void csv_str(FILE *f, const char *s, size_t len)
{
    size_t i;

    for (i = 0; i < len && s[i] != ',' && s[i] != '"' && s[i] != '\r' && s[i] != '\n'; i++)
        ;
    if (i == len) {
        fwrite(s, 1, len, f);
        return;
    }
    fputc('"', f);
    for (i = 0; i < len; i++) {
        if (s[i] == '"')
            fputc('"', f);
        fputc(s[i], f);
    }
    fputc('"', f);
}

/* ---- the summary: one entry per key in an open-addressing table ---- */

typedef struct stat_entry {
    char *key; /* NULL: empty slot */
    size_t keylen;
    int64_t count, last_step;
    double last, min, max;
} stat_entry;

struct tc_sink {
    int json, csv, summary;
    int64_t job;
    int opened;        /* the header (CSV) or "[" (JSON) is out */
    size_t nrows;      /* rows seen */
    stat_entry *slots; /* summary only */
    size_t cap, used;
};

static uint64_t hash_key(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    size_t i;

    for (i = 0; i < len; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* The slot for key in a table of cap slots: its entry, or the empty slot where it goes. */
static stat_entry *find_slot(stat_entry *slots, size_t cap, const char *key, size_t len)
{
    size_t i = (size_t)hash_key(key, len) & (cap - 1);

    while (slots[i].key != NULL && !(slots[i].keylen == len && memcmp(slots[i].key, key, len) == 0))
        i = (i + 1) & (cap - 1);
    return &slots[i];
}

/* Doubles the table when it is half full, so probes stay short. */
static int grow(tc_sink *s)
{
    size_t cap = s->cap ? s->cap * 2 : TC_SUMMARY_MIN_SLOTS, i;
    stat_entry *slots;

    if (s->used * 2 < s->cap)
        return TC_OK;
    slots = calloc(cap, sizeof(*slots));
    if (slots == NULL)
        return tc_err(TC_FAILED, "out of memory");
    for (i = 0; i < s->cap; i++)
        if (s->slots[i].key != NULL)
            *find_slot(slots, cap, s->slots[i].key, s->slots[i].keylen) = s->slots[i];
    free(s->slots);
    s->slots = slots;
    s->cap = cap;
    return TC_OK;
}

static int summarize(tc_sink *s, const tc_row *row)
{
    stat_entry *e;
    int rc = grow(s);

    if (rc != TC_OK)
        return rc;
    e = find_slot(s->slots, s->cap, row->key, row->keylen);
    if (e->key == NULL) {
        e->key = strndup(row->key, row->keylen);
        if (e->key == NULL)
            return tc_err(TC_FAILED, "out of memory");
        e->keylen = row->keylen;
        e->last_step = INT64_MIN;
        e->min = INFINITY;
        e->max = -INFINITY;
        s->used++;
    }
    e->count++;
    if (row->step >= e->last_step) {
        e->last_step = row->step;
        e->last = row->value;
    }
    e->min = fmin(e->min, row->value); /* fmin and fmax pass over NaN */
    e->max = fmax(e->max, row->value);
    return TC_OK;
}

int tc_sink_new(tc_sink **out, const tc_opts *o)
{
    tc_sink *s = calloc(1, sizeof(*s));

    *out = s;
    if (s == NULL)
        return tc_err(TC_FAILED, "out of memory");
    s->json = o->json;
    s->csv = o->csv;
    s->summary = o->summary;
    s->job = o->job;
    return TC_OK;
}

/* Starts the output on the first row (or at the end), so that a refused request prints
 * nothing on stdout. */
static void open_rows(tc_sink *s)
{
    if (s->opened || s->summary)
        return;
    s->opened = 1;
    fputs(s->json ? "[" : "job,key,step,value,time\n", stdout);
}

int tc_sink_add(tc_sink *s, const tc_row *row)
{
    open_rows(s);
    if (s->summary)
        return summarize(s, row);
    if (s->json) {
        fputs(s->nrows++ ? ",\n" : "\n", stdout);
        tc_row_json(stdout, s->job, row);
        return TC_OK;
    }
    fprintf(stdout, "%lld,", (long long)s->job);
    csv_str(stdout, row->key, row->keylen);
    fprintf(stdout, ",%lld,%.9g,%.3f\n", (long long)row->step, row->value, row->time);
    return TC_OK;
}

static int by_key(const void *a, const void *b)
{
    const stat_entry *x = a, *y = b;

    if (x->key == NULL || y->key == NULL)
        return (x->key == NULL) - (y->key == NULL);
    return strcmp(x->key, y->key);
}

/* One key's line; width is the KEY column's for the table. */
static void summary_line(const tc_sink *s, const stat_entry *e, int width)
{
    char last[32], min[32], max[32];

    if (s->json) {
        fprintf(stdout, "{\"job\":%lld,\"key\":", (long long)s->job);
        tc_json_str(stdout, e->key, e->keylen);
        fprintf(stdout, ",\"count\":%lld,\"last_step\":%lld,\"last\":", (long long)e->count,
                (long long)e->last_step);
        json_num(stdout, e->last, 0);
        fputs(",\"min\":", stdout);
        json_num(stdout, e->min, 0);
        fputs(",\"max\":", stdout);
        json_num(stdout, e->max, 0);
        fputc('}', stdout);
    } else if (s->csv) {
        fprintf(stdout, "%lld,", (long long)s->job);
        csv_str(stdout, e->key, e->keylen);
        fprintf(stdout, ",%lld,%lld,%.9g,%.9g,%.9g\n", (long long)e->count, (long long)e->last_step,
                e->last, e->min, e->max);
    } else {
        tc_fmt_value(last, sizeof(last), e->last);
        tc_fmt_value(min, sizeof(min), e->min);
        tc_fmt_value(max, sizeof(max), e->max);
        fprintf(stdout, "%-*s %8lld %10lld %12s %12s %12s\n", width, e->key, (long long)e->count,
                (long long)e->last_step, last, min, max);
    }
}

/* Prints the summary sorted by key: a table, CSV (with --csv) or a JSON array. */
static void print_summary(tc_sink *s)
{
    int width = 3;
    size_t i;

    qsort(s->slots, s->cap, sizeof(*s->slots), by_key);
    for (i = 0; i < s->used; i++)
        width = s->slots[i].keylen > (size_t)width ? (int)s->slots[i].keylen : width;
    if (s->json)
        fputs("[", stdout);
    else if (s->csv)
        fputs("job,key,count,last_step,last,min,max\n", stdout);
    else
        fprintf(stdout, "%-*s %8s %10s %12s %12s %12s\n", width, "KEY", "COUNT", "LAST_STEP",
                "LAST", "MIN", "MAX");
    for (i = 0; i < s->used; i++) {
        if (s->json)
            fputs(i ? ",\n" : "\n", stdout);
        summary_line(s, &s->slots[i], width);
    }
    if (s->json)
        fputs(s->used ? "\n]\n" : "]\n", stdout);
}

int tc_sink_finish(tc_sink *s)
{
    open_rows(s);
    if (s->summary)
        print_summary(s);
    else if (s->json)
        fputs(s->nrows ? "\n]\n" : "]\n", stdout);
    return tc_flush_stdout();
}

void tc_sink_free(tc_sink *s)
{
    size_t i;

    if (s == NULL)
        return;
    for (i = 0; i < s->cap; i++)
        free(s->slots[i].key);
    free(s->slots);
    free(s);
}
