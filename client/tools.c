/* The verbs that use a trained SensorLM: classify (zero-shot: each window of a sensor shard
 * gets the label whose prompt's text embedding it scores highest with, asked a page of
 * windows at a time), retrieve (the windows nearest a query's text embedding) and probe (few-
 * shot: linear classifiers fitted on one shard's sensor embeddings, judged on another's).
 * traind computes; the shards are opened there with this user's rights, so their paths are
 * made absolute here, where the user runs trainctl. Called from main() on the one thread
 * trainctl has. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/client.h"
#include "common/td_text.h"

#define TC_LABELS_MAX 256 /* labels one --labels may name: the request's limit */

/* path made absolute against the current directory (not resolved further: traind opens it
 * with this user's rights, symlinks and all). Caller frees. */
static int absolute_path(const char *path, char **out)
{
    char *cwd;

    if (path[0] == '/') {
        *out = strdup(path);
        return *out != NULL ? TC_OK : tc_err(TC_FAILED, "out of memory");
    }
    if ((cwd = getcwd(NULL, 0)) == NULL)
        return tc_err(TC_NOINPUT, "cannot resolve %s: %s", path, strerror(errno));
    *out = malloc(strlen(cwd) + strlen(path) + 2);
    if (*out != NULL)
        sprintf(*out, "%s/%s", cwd, path);
    free(cwd);
    return *out != NULL ? TC_OK : tc_err(TC_FAILED, "out of memory");
}

/* One --labels entry: NAME or NAME=PROMPT, spaces around either trimmed. */
typedef struct label {
    char *name, *prompt; /* into the copy of --labels; prompt NULL when not given */
} label;

static char *trim(char *s)
{
    char *e;

    while (*s == ' ' || *s == '\t')
        s++;
    e = s + strlen(s);
    while (e > s && (e[-1] == ' ' || e[-1] == '\t'))
        *--e = '\0';
    return s;
}

/* Splits buf (a copy of --labels, written into) at commas into labels[0..*n). */
static int parse_labels(char *buf, label *labels, int *n)
{
    char *save = NULL, *item;

    *n = 0;
    for (item = strtok_r(buf, ",", &save); item != NULL; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (*n == TC_LABELS_MAX)
            return tc_err(TC_USAGE, "--labels: more than %d labels", TC_LABELS_MAX);
        if (eq != NULL)
            *eq = '\0';
        labels[*n].name = trim(item);
        labels[*n].prompt = eq != NULL ? trim(eq + 1) : NULL;
        if (labels[*n].name[0] == '\0' || (eq != NULL && labels[*n].prompt[0] == '\0'))
            return tc_err(TC_USAGE, "--labels: each label needs a name (NAME or NAME=PROMPT)");
        (*n)++;
    }
    if (*n == 0)
        return tc_err(TC_USAGE, "--labels: no label names");
    return TC_OK;
}

static void classify_request(tc_conn *c, const tc_opts *o, const char *data, const label *labels,
                             int n, int64_t first)
{
    td_pw *w = tc_conn_request(c, "classify", 4 + (n > 0) + 1);

    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    td_pw_str(w, "data");
    td_pw_str(w, data);
    if (n > 0) {
        td_pw_str(w, "labels");
        td_pw_array(w, (uint32_t)n);
        for (int k = 0; k < n; k++) {
            td_pw_map(w, 1 + (labels[k].prompt != NULL));
            td_pw_str(w, "name");
            td_pw_str(w, labels[k].name);
            if (labels[k].prompt != NULL) {
                td_pw_str(w, "prompt");
                td_pw_str(w, labels[k].prompt);
            }
        }
    }
    td_pw_str(w, "first");
    td_pw_int(w, first);
}

/* The reply's labels, escaped for this terminal, into names (cap each). */
static int reply_labels(const td_pval *root, char (*names)[128], char (*prompts)[512], int *n)
{
    const td_pval *l = td_pv_get(root, "labels");
    size_t len;

    *n = (int)td_pv_len(l);
    if (td_pv_type_of(l) != TD_PV_ARRAY || *n < 1 || *n > TC_LABELS_MAX)
        return tc_err(TC_PROTOCOL, "traind answered classify without labels");
    for (int k = 0; k < *n; k++) {
        const char *s = td_pv_str(td_pv_get(td_pv_at(l, (size_t)k), "name"), &len);
        td_text_escape(names[k], sizeof(names[k]), s != NULL ? s : "", s != NULL ? len : 0, 0);
        s = td_pv_str(td_pv_get(td_pv_at(l, (size_t)k), "prompt"), &len);
        td_text_escape(prompts[k], sizeof(prompts[k]), s != NULL ? s : "", s != NULL ? len : 0, 0);
    }
    return TC_OK;
}

/* Prints one page's results; *count counts the windows printed so far (JSON: commas). */
static int print_page(const td_pval *root, const tc_opts *o, char (*names)[128], int n,
                      int64_t *count)
{
    const td_pval *res = td_pv_get(root, "results");
    size_t m = td_pv_len(res);

    if (td_pv_type_of(res) != TD_PV_ARRAY)
        return tc_err(TC_PROTOCOL, "traind answered classify without results");
    for (size_t i = 0; i < m; i++, (*count)++) {
        const td_pval *r = td_pv_at(res, i);
        int64_t index = -1, lab = -1;
        double score = 0;
        if (td_pv_int(td_pv_at(r, 0), &index) != 0 || td_pv_int(td_pv_at(r, 1), &lab) != 0 ||
            td_pv_double(td_pv_at(r, 2), &score) != 0 || lab < 0 || lab >= n)
            return tc_err(TC_PROTOCOL, "traind sent a malformed classify result");
        if (o->json) {
            printf("%s\n    {\"index\": %lld, \"label\": ", *count > 0 ? "," : "",
                   (long long)index);
            tc_json_str(stdout, names[lab], strlen(names[lab]));
            printf(", \"score\": %.6g}", score);
        } else {
            printf("%lld  %s  %.4f\n", (long long)index, names[lab], score);
        }
    }
    return TC_OK;
}

static void print_json_head(const tc_opts *o, const char *data, int64_t windows, char (*names)[128],
                            char (*prompts)[512], int n)
{
    printf("{\n  \"job\": %lld,\n  \"data\": ", (long long)o->job);
    tc_json_str(stdout, data, strlen(data));
    printf(",\n  \"windows\": %lld,\n  \"labels\": [", (long long)windows);
    for (int k = 0; k < n; k++) {
        printf("%s{\"name\": ", k > 0 ? ", " : "");
        tc_json_str(stdout, names[k], strlen(names[k]));
        printf(", \"prompt\": ");
        tc_json_str(stdout, prompts[k], strlen(prompts[k]));
        printf("}");
    }
    printf("],\n  \"results\": [");
}

/* The pages of a classify, first 0 on, until traind says there is no more. */
static int classify_pages(tc_conn *c, const tc_opts *o, const char *data, const label *labels,
                          int n)
{
    char(*names)[128] = calloc(TC_LABELS_MAX, sizeof(*names));
    char(*prompts)[512] = calloc(TC_LABELS_MAX, sizeof(*prompts));
    td_proto_frame *f = NULL;
    int64_t first = 0, count = 0, windows = 0, next;
    int more = 1, nl = 0, rc = TC_OK;

    if (names == NULL || prompts == NULL)
        rc = tc_err(TC_FAILED, "out of memory");
    while (rc == TC_OK && more) {
        const td_pval *root;
        classify_request(c, o, data, labels, n, first);
        /* A page of windows through the model may take a while on a busy machine. */
        if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_recv(c, &f, -1)) != TC_OK)
            break;
        root = td_proto_frame_root(f);
        if (!tc_pv_is(td_pv_get(root, "type"), "classify") ||
            td_pv_bool(td_pv_get(root, "more"), &more) != 0 ||
            td_pv_int(td_pv_get(root, "next"), &next) != 0 || (more && next <= first)) {
            rc = tc_err(TC_PROTOCOL, "traind answered classify with a malformed page");
            break;
        }
        if (first == 0 && (rc = reply_labels(root, names, prompts, &nl)) == TC_OK && o->json) {
            td_pv_int(td_pv_get(root, "windows"), &windows);
            print_json_head(o, data, windows, names, prompts, nl);
        }
        if (rc == TC_OK)
            rc = print_page(root, o, names, nl, &count);
        first = next;
        td_proto_frame_free(f);
        f = NULL;
    }
    if (rc == TC_OK && o->json)
        printf("\n  ]\n}\n");
    td_proto_frame_free(f);
    free(names);
    free(prompts);
    return rc;
}

int tc_classify(const tc_opts *o)
{
    label *labels = calloc(TC_LABELS_MAX, sizeof(*labels));
    char *data = NULL, *buf = NULL;
    tc_conn *c = NULL;
    int n = 0, rc = labels != NULL ? TC_OK : tc_err(TC_FAILED, "out of memory");

    if (rc == TC_OK && o->labels != NULL) {
        if ((buf = strdup(o->labels)) == NULL)
            rc = tc_err(TC_FAILED, "out of memory");
        else
            rc = parse_labels(buf, labels, &n);
    }
    if (rc == TC_OK)
        rc = absolute_path(o->data, &data);
    if (rc == TC_OK)
        rc = tc_conn_open(&c, o->socket);
    if (rc == TC_OK && !tc_conn_has(c, "classify"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old for classify", o->socket);
    if (rc == TC_OK)
        rc = classify_pages(c, o, data, labels, n);
    if (rc == TC_OK)
        rc = tc_flush_stdout();
    tc_conn_close(c);
    free(labels);
    free(buf);
    free(data);
    return rc;
}

/* One retrieve result, printed. */
static int print_hit(const td_pval *r, const tc_opts *o, size_t i)
{
    char caption[8192 + 1];
    const char *s;
    int64_t index = -1;
    double score = 0;
    size_t len = 0;

    s = td_pv_str(td_pv_at(r, 2), &len);
    if (td_pv_int(td_pv_at(r, 0), &index) != 0 || td_pv_double(td_pv_at(r, 1), &score) != 0 ||
        s == NULL)
        return tc_err(TC_PROTOCOL, "traind sent a malformed retrieve result");
    td_text_escape(caption, sizeof(caption), s, len, 0);
    if (o->json) {
        printf("%s\n    {\"index\": %lld, \"score\": %.6g, \"caption\": ", i > 0 ? "," : "",
               (long long)index, score);
        tc_json_str(stdout, caption, strlen(caption));
        printf("}");
    } else {
        printf("%lld  %.4f  %s\n", (long long)index, score, caption);
    }
    return TC_OK;
}

int tc_retrieve(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    const td_pval *root, *res;
    char *data = NULL;
    tc_conn *c = NULL;
    int64_t windows = 0;
    td_pw *w;
    int rc = absolute_path(o->data, &data);

    if (rc == TC_OK)
        rc = tc_conn_open(&c, o->socket);
    if (rc == TC_OK && !tc_conn_has(c, "classify"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old for retrieve", o->socket);
    if (rc != TC_OK)
        goto out;
    w = tc_conn_request(c, "retrieve", 5 + (o->top > 0));
    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    td_pw_str(w, "data");
    td_pw_str(w, data);
    td_pw_str(w, "query");
    td_pw_str(w, o->query);
    if (o->top > 0) {
        td_pw_str(w, "top");
        td_pw_int(w, o->top);
    }
    /* Every window of the shard goes through the model: no time limit. */
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_recv(c, &f, -1)) != TC_OK)
        goto out;
    root = td_proto_frame_root(f);
    res = td_pv_get(root, "results");
    if (!tc_pv_is(td_pv_get(root, "type"), "retrieve") || td_pv_type_of(res) != TD_PV_ARRAY) {
        rc = tc_err(TC_PROTOCOL, "traind answered retrieve without results");
        goto out;
    }
    td_pv_int(td_pv_get(root, "windows"), &windows);
    if (o->json) {
        printf("{\n  \"job\": %lld,\n  \"data\": ", (long long)o->job);
        tc_json_str(stdout, data, strlen(data));
        printf(",\n  \"query\": ");
        tc_json_str(stdout, o->query, strlen(o->query));
        printf(",\n  \"windows\": %lld,\n  \"results\": [", (long long)windows);
    }
    for (size_t i = 0; i < td_pv_len(res) && rc == TC_OK; i++)
        rc = print_hit(td_pv_at(res, i), o, i);
    if (rc == TC_OK && o->json)
        printf("\n  ]\n}\n");
    if (rc == TC_OK)
        rc = tc_flush_stdout();
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    free(data);
    return rc;
}

/* ---- probe ---- */

/* One class of a probe reply: its name (escaped for this terminal) and windows. */
typedef struct probe_class {
    char name[128];
    int64_t train, valid;
} probe_class;

/* One row of a probe reply. */
typedef struct probe_row {
    int64_t shots, windows, shorts, iterations;
    double accuracy, macro_f1, loss; /* macro_f1 NaN: nil */
    int converged;
} probe_row;

/* A probe reply as read: the classes and rows; what is not as PROTOCOL.md says is TC_PROTOCOL. */
typedef struct probe_reply {
    int64_t step, embed_dim, train_windows, valid_windows, max_iterations;
    double l2;
    probe_class *classes;
    int nclasses;
    probe_row rows[TC_PROBE_MAX_SHOTS];
    int nrows;
} probe_reply;

static int read_probe_classes(const td_pval *l, probe_reply *r)
{
    size_t len;

    r->nclasses = (int)td_pv_len(l);
    if (td_pv_type_of(l) != TD_PV_ARRAY || r->nclasses < 1 || r->nclasses > TC_LABELS_MAX)
        return tc_err(TC_PROTOCOL, "traind answered probe without labels");
    if ((r->classes = calloc((size_t)r->nclasses, sizeof(*r->classes))) == NULL)
        return tc_err(TC_FAILED, "out of memory");
    for (int k = 0; k < r->nclasses; k++) {
        const td_pval *e = td_pv_at(l, (size_t)k);
        const char *name = td_pv_str(td_pv_get(e, "name"), &len);
        if (name == NULL || td_pv_int(td_pv_get(e, "train"), &r->classes[k].train) != 0 ||
            td_pv_int(td_pv_get(e, "valid"), &r->classes[k].valid) != 0)
            return tc_err(TC_PROTOCOL, "traind sent a malformed probe label");
        td_text_escape(r->classes[k].name, sizeof(r->classes[k].name), name, len, 0);
    }
    return TC_OK;
}

static int read_probe_rows(const td_pval *res, probe_reply *r)
{
    r->nrows = (int)td_pv_len(res);
    if (td_pv_type_of(res) != TD_PV_ARRAY || r->nrows < 1 || r->nrows > TC_PROBE_MAX_SHOTS)
        return tc_err(TC_PROTOCOL, "traind answered probe without results");
    for (int j = 0; j < r->nrows; j++) {
        const td_pval *e = td_pv_at(res, (size_t)j), *f1 = td_pv_get(e, "macro_f1");
        probe_row *w = &r->rows[j];
        w->macro_f1 = NAN;
        if (td_pv_int(td_pv_get(e, "shots"), &w->shots) != 0 ||
            td_pv_int(td_pv_get(e, "windows"), &w->windows) != 0 ||
            td_pv_int(td_pv_get(e, "short"), &w->shorts) != 0 ||
            td_pv_int(td_pv_get(e, "iterations"), &w->iterations) != 0 ||
            td_pv_bool(td_pv_get(e, "converged"), &w->converged) != 0 ||
            td_pv_double(td_pv_get(e, "accuracy"), &w->accuracy) != 0 ||
            td_pv_double(td_pv_get(e, "loss"), &w->loss) != 0 ||
            (td_pv_type_of(f1) != TD_PV_NIL && td_pv_double(f1, &w->macro_f1) != 0))
            return tc_err(TC_PROTOCOL, "traind sent a malformed probe result");
    }
    return TC_OK;
}

static int read_probe(const td_pval *root, probe_reply *r)
{
    int rc;

    if (!tc_pv_is(td_pv_get(root, "type"), "probe") ||
        td_pv_int(td_pv_get(root, "step"), &r->step) != 0 ||
        td_pv_int(td_pv_get(root, "embed_dim"), &r->embed_dim) != 0 ||
        td_pv_int(td_pv_get(root, "train_windows"), &r->train_windows) != 0 ||
        td_pv_int(td_pv_get(root, "valid_windows"), &r->valid_windows) != 0 ||
        td_pv_int(td_pv_get(root, "max_iterations"), &r->max_iterations) != 0 ||
        td_pv_double(td_pv_get(root, "l2"), &r->l2) != 0)
        return tc_err(TC_PROTOCOL, "traind answered probe with a malformed reply");
    if ((rc = read_probe_classes(td_pv_get(root, "labels"), r)) != TC_OK)
        return rc;
    return read_probe_rows(td_pv_get(root, "results"), r);
}

/* A JSON number, or null for NaN. */
static void json_number(double v)
{
    if (isnan(v))
        printf("null");
    else
        printf("%.6g", v);
}

static void print_probe_json(const tc_opts *o, const char *data, const char *eval,
                             const probe_reply *r)
{
    printf("{\n  \"job\": %lld,\n  \"data\": ", (long long)o->job);
    tc_json_str(stdout, data, strlen(data));
    printf(",\n  \"eval\": ");
    tc_json_str(stdout, eval, strlen(eval));
    printf(",\n  \"step\": %lld,\n  \"embed_dim\": %lld,\n  \"train_windows\": %lld,\n"
           "  \"valid_windows\": %lld,\n  \"l2\": %.6g,\n  \"max_iterations\": %lld,\n"
           "  \"labels\": [",
           (long long)r->step, (long long)r->embed_dim, (long long)r->train_windows,
           (long long)r->valid_windows, r->l2, (long long)r->max_iterations);
    for (int k = 0; k < r->nclasses; k++) {
        printf("%s\n    {\"name\": ", k > 0 ? "," : "");
        tc_json_str(stdout, r->classes[k].name, strlen(r->classes[k].name));
        printf(", \"train\": %lld, \"valid\": %lld}", (long long)r->classes[k].train,
               (long long)r->classes[k].valid);
    }
    printf("\n  ],\n  \"results\": [");
    for (int j = 0; j < r->nrows; j++) {
        const probe_row *w = &r->rows[j];
        printf("%s\n    {\"shots\": %lld, \"windows\": %lld, \"short\": %lld, \"accuracy\": ",
               j > 0 ? "," : "", (long long)w->shots, (long long)w->windows, (long long)w->shorts);
        json_number(w->accuracy);
        printf(", \"macro_f1\": ");
        json_number(w->macro_f1);
        printf(", \"iterations\": %lld, \"converged\": %s, \"loss\": ", (long long)w->iterations,
               w->converged ? "true" : "false");
        json_number(w->loss);
        printf("}");
    }
    printf("\n  ]\n}\n");
}

/* The classes with fewer than k train windows but some, "hike 4, swim 7", into buf. */
static void short_classes(const probe_reply *r, int64_t k, char *buf, size_t size)
{
    size_t n = 0;

    buf[0] = '\0';
    for (int c = 0; c < r->nclasses; c++) {
        int m;
        if (r->classes[c].train == 0 || r->classes[c].train >= k)
            continue;
        m = snprintf(buf + n, size - n, "%s%s %lld", n > 0 ? ", " : "", r->classes[c].name,
                     (long long)r->classes[c].train);
        if (m < 0 || (size_t)m >= size - n)
            break;
        n += (size_t)m;
    }
}

/* A row's k as the table says it: "all" for 0. */
static const char *shots_name(const probe_row *w, char *buf, size_t size)
{
    if (w->shots == 0)
        return "all";
    snprintf(buf, size, "%lld", (long long)w->shots);
    return buf;
}

/* The table, then what a reader needs to know about it: the classes that had fewer windows
 * than a row's k, those never predicted, a fit that ran out of iterations. */
static void print_probe_table(const tc_opts *o, const probe_reply *r)
{
    char shots[24], list[2048];

    printf("SHOTS  WINDOWS  SHORT  ACCURACY  MACRO_F1\n");
    for (int j = 0; j < r->nrows; j++) {
        const probe_row *w = &r->rows[j];
        printf("%-5s  %7lld  %5lld  %8.4f  %8.4f\n", shots_name(w, shots, sizeof(shots)),
               (long long)w->windows, (long long)w->shorts, w->accuracy, w->macro_f1);
    }
    for (int j = 0; j < r->nrows; j++) {
        const probe_row *w = &r->rows[j];
        if (w->shorts > 0 && (j == 0 || w->shots != r->rows[j - 1].shots)) {
            short_classes(r, w->shots, list, sizeof(list));
            printf("%lld-shot: %lld %s fewer than %lld train windows and gave all %s: %s\n",
                   (long long)w->shots, (long long)w->shorts,
                   w->shorts == 1 ? "class has" : "classes have", (long long)w->shots,
                   w->shorts == 1 ? "it has" : "they have", list);
        }
        if (!w->converged)
            printf("%s-shot: the fit stopped at %lld iterations before it converged\n",
                   shots_name(w, shots, sizeof(shots)), (long long)w->iterations);
    }
    for (int c = 0; c < r->nclasses; c++)
        if (r->classes[c].train == 0 && r->classes[c].valid > 0)
            printf("never predicted: %s has no train windows (%lld valid)\n", r->classes[c].name,
                   (long long)r->classes[c].valid);
    printf("job %lld at step %lld: %d classes, %lld train and %lld valid windows\n",
           (long long)o->job, (long long)r->step, r->nclasses, (long long)r->train_windows,
           (long long)r->valid_windows);
}

int tc_probe(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    probe_reply r = {0};
    char *data = NULL, *eval = NULL;
    tc_conn *c = NULL;
    td_pw *w;
    int rc = absolute_path(o->data, &data);

    if (rc == TC_OK)
        rc = absolute_path(o->eval, &eval);
    if (rc == TC_OK)
        rc = tc_conn_open(&c, o->socket);
    if (rc == TC_OK && !tc_conn_has(c, "probe"))
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old for probe", o->socket);
    if (rc != TC_OK)
        goto out;
    w = tc_conn_request(c, "probe", 5 + (o->nshots > 0));
    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    td_pw_str(w, "data");
    td_pw_str(w, data);
    td_pw_str(w, "eval");
    td_pw_str(w, eval);
    if (o->nshots > 0) {
        td_pw_str(w, "shots");
        td_pw_array(w, (uint32_t)o->nshots);
        for (int j = 0; j < o->nshots; j++)
            td_pw_int(w, o->shots[j]);
    }
    /* Both shards go through the model, then the fits: no time limit. */
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_recv(c, &f, -1)) != TC_OK)
        goto out;
    if ((rc = read_probe(td_proto_frame_root(f), &r)) != TC_OK)
        goto out;
    if (o->json)
        print_probe_json(o, data, eval, &r);
    else
        print_probe_table(o, &r);
    rc = tc_flush_stdout();
out:
    free(r.classes);
    td_proto_frame_free(f);
    tc_conn_close(c);
    free(data);
    free(eval);
    return rc;
}
