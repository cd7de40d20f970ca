/* Export, sample, classify, retrieve and probe on libuv's threadpool (work.h): the loop thread
 * rebuilds the job's config and queues the work; a threadpool thread writes the model file
 * (llm.c or safetensors) to a temp file under the state directory (then opens and unlinks it,
 * so that the bytes live only as long as the descriptor the loop thread streams them from),
 * generates the sample, embeds a sensor shard's windows (opened with the requester's rights)
 * against label prompts or a query, or embeds two shards and fits linear probes on one judged
 * on the other (train/probe.h); the loop thread gets the result back in the done callback. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/probe.h"
#include "train/sensor.h"
#include "daemon/work.h"

#define EMBED_ROWS 64 /* windows per forward of an embedding pass */

#define TOKEN_TEXT_MAX                                                      \
    12 /* bytes one token takes in a sample's text: a tokens job writes its \
        * id (at most 10 digits) and a space */

static unsigned export_serial; /* loop thread: tells concurrent exports' temp files apart */

/* Whether w is to stop now, and why (td_work.cancel): its client gone, its time up, the
 * daemon stopping. Threadpool thread. */
static int work_stopped(const td_work *w)
{
    int why = atomic_load(&w->cancel);

    return why != TD_WORK_GOING ? why : atomic_load(w->stop) ? TD_WORK_STOPPING : 0;
}

/* err's message, now prefixed: "job 3: " + what it said. */
static int prefix_job(td_error_t *err, int64_t job)
{
    td_error_t was = *err;

    return td_error_set(err, was.code, "job %lld: %s", (long long)job, was.msg);
}

static const char *model_name(td_model_kind m)
{
    return m == TD_MODEL_MLP ? "an mlp" : m == TD_MODEL_GPT ? "a gpt" : "a sensorlm";
}

/* Whether kind applies to cfg's model. */
static int check_kind(const td_train_config *cfg, td_work_kind kind, int64_t job, td_error_t *err)
{
    td_model_kind m = cfg->model;

    if ((kind == TD_WORK_EXPORT || kind == TD_WORK_SAMPLE) && m != TD_MODEL_GPT)
        return td_error_set(err, TD_EINVAL, "job %lld is %s job; only gpt jobs %s", (long long)job,
                            model_name(m),
                            kind == TD_WORK_EXPORT ? "export to llm.c files" : "can be sampled");
    if ((kind == TD_WORK_CLASSIFY || kind == TD_WORK_RETRIEVE || kind == TD_WORK_PROBE) &&
        m != TD_MODEL_SENSORLM)
        return td_error_set(err, TD_EINVAL, "job %lld is %s job; only sensorlm jobs %s",
                            (long long)job, model_name(m),
                            kind == TD_WORK_CLASSIFY   ? "classify"
                            : kind == TD_WORK_RETRIEVE ? "retrieve"
                                                       : "can be probed");
    return 0;
}

int td_work_new(td_work **out, td_daemon *d, const char *state_dir, td_work_kind kind, int64_t job,
                int64_t uid, td_error_t *err)
{
    td_work *w = calloc(1, sizeof(*w));
    td_train_config *cfg;
    int rc;

    *out = NULL;
    if (w == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    w->kind = kind;
    w->job = job;
    w->stop = td_daemon_stop_flag(d);
    w->fd = -1;
    cfg = &w->cfg;
    /* Export and sample read the checkpoints every run writes. A model can recite the text it
     * was trained on, so only the job's owner (or root) may (td_daemon_job_config checks). */
    rc = td_daemon_job_config(d, job, uid, cfg, err);
    if (rc == 0)
        rc = check_kind(cfg, kind, job, err);
    if (rc == 0 && (kind == TD_WORK_EXPORT || kind == TD_WORK_EXPORT_ST) &&
        snprintf(w->path, sizeof(w->path), "%s/export-%lld-%u.%s", state_dir, (long long)job,
                 ++export_serial,
                 kind == TD_WORK_EXPORT ? "bin" : "safetensors") >= (int)sizeof(w->path))
        rc = td_error_set(err, TD_EINVAL, "the state directory's path is too long");
    if (rc != 0) {
        free(w);
        return rc;
    }
    *out = w;
    return 0;
}

/* Whether dir holds a checkpoint file (ckpt.h names them ckpt-STEP.bin), so that a job that
 * has none yet is told apart from one whose files cannot be read. */
static int has_checkpoint(const char *dir)
{
    DIR *dh = opendir(dir);
    struct dirent *e;
    int found = 0;

    if (dh == NULL)
        return 0;
    while (!found && (e = readdir(dh)) != NULL)
        found = strncmp(e->d_name, "ckpt-", 5) == 0;
    closedir(dh);
    return found;
}

/* The llm.c file, written to w->path, opened, and unlinked: a daemon that dies while it
 * streams leaves nothing behind. */
static void run_export(td_work *w)
{
    td_data_access as_user = {.uid = w->uid, .gid = w->gid};
    struct stat st;

    if (w->kind == TD_WORK_EXPORT) {
        w->rc = td_export_llmc(&w->cfg, w->path, &w->err);
    } else if ((w->rc = td_data_access_begin(&as_user, &w->err)) == 0) {
        /* A sensorlm's T and C may come from its shards' headers: read with the requester's
         * rights (the owner's, or root's), as classify reads. */
        w->rc = td_export_safetensors(&w->cfg, w->path, &w->err);
        td_data_access_end();
    }
    if (w->rc != 0)
        return;
    w->fd = open(w->path, O_RDONLY | O_CLOEXEC);
    if (w->fd < 0 || fstat(w->fd, &st) != 0)
        w->rc = td_error_set(&w->err, TD_EIO, "%s: %s", w->path, strerror(errno));
    else
        w->size = (int64_t)st.st_size;
    unlink(w->path);
}

static void run_sample(td_work *w)
{
    size_t cap = (size_t)w->tokens * TOKEN_TEXT_MAX + 1;

    w->text = malloc(cap);
    if (w->text == NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "no memory for %zu bytes of text", cap);
        return;
    }
    /* the lanes set w->cancel, when the client goes, the time is up or the daemon stops */
    w->rc = td_sample(&w->cfg, w->prompt != NULL ? w->prompt : "", w->tokens, w->temperature,
                      w->seed, &w->cancel, w->text, cap, &w->err);
    if (w->rc != 0)
        return;
    /* A text job writes exactly one byte per token, NUL included (the text is NUL-terminated
     * right after the last token), so its length is the token count, not strlen's. */
    if (w->cfg.data == TD_DATA_TEXT && w->text[w->tokens] == '\0')
        w->text_len = (size_t)w->tokens;
    else
        w->text_len = strlen(w->text);
}

/* ---- classify and retrieve ---- */

/* What one embedding pass over a shard holds. */
typedef struct shard_pass {
    td_sensorlm_embedder *e;
    td_sensorlm_info info;
    td_sensor *s;
    float *grids; /* rows (T, C) windows */
    float *emb;   /* rows embeddings of E */
    int rows;
} shard_pass;

static int stopping(void *ud)
{
    return work_stopped(ud) != 0;
}

static void pass_close(shard_pass *p)
{
    td_sensor_close(p->s);
    td_sensorlm_embedder_free(p->e);
    free(p->grids);
    free(p->emb);
}

/* Opens the shard at path (what: the request's field, for messages) with the requester's
 * rights, checked against want, into *out. Inside td_data_access_begin. */
static int open_shard(td_work *w, const char *what, const char *path, const td_sensor_expect *want,
                      td_sensor **out)
{
    td_error_t e = {0};
    int rc, fd = -1;

    rc = td_data_open_file(path, &fd, &e);
    if (rc == 0)
        rc = td_sensor_open_fd(out, fd, path, want, &e);
    if (rc != 0)
        td_error_set(&w->err, rc, "%s: %s", what, e.msg);
    return rc;
}

/* The job's model from its latest checkpoint and the shard (w->data; with eval not NULL also
 * that one, into *eval), opened with the requester's rights (data.h: the kernel checks the open
 * as it would theirs) and checked against the model's T and C. */
static int pass_open(td_work *w, shard_pass *p, td_sensor **eval)
{
    td_data_access as_user = {.uid = w->uid, .gid = w->gid, .stop = stopping, .ud = w};
    td_sensor_expect want;
    int rc;

    memset(p, 0, sizeof(*p));
    rc = td_data_access_begin(&as_user, &w->err);
    if (rc != 0)
        return rc;
    rc = td_sensorlm_embedder_open(&p->e, &w->cfg, EMBED_ROWS, &w->err);
    if (rc == 0) {
        td_sensorlm_embedder_info(p->e, &p->info);
        want = (td_sensor_expect){.T = p->info.time_steps, .C = p->info.channels};
        rc = open_shard(w, "data", w->data, &want, &p->s);
        if (rc == 0 && eval != NULL)
            rc = open_shard(w, "eval", w->eval, &want, eval);
    }
    td_data_access_end();
    if (rc != 0)
        return rc;
    p->rows = EMBED_ROWS;
    w->windows = td_sensor_count(p->s);
    p->grids = malloc((size_t)p->rows * p->info.time_steps * p->info.channels * sizeof(float));
    p->emb = malloc((size_t)p->rows * p->info.embed_dim * sizeof(float));
    if (p->grids == NULL || p->emb == NULL)
        return td_error_set(&w->err, TD_ENOMEM, "no memory for %d windows", p->rows);
    return 0;
}

/* Windows [i, i + n) of shard s, n <= p->rows, into p->emb, and (labels not NULL) their labels
 * into labels[0..n). */
static int pass_embed(td_work *w, shard_pass *p, const td_sensor *s, int64_t i, int n,
                      int32_t *labels)
{
    size_t grid = (size_t)p->info.time_steps * p->info.channels;
    int rc;

    if (work_stopped(w))
        return td_error_set(&w->err, TD_ECANCELLED, "stopped after %lld windows", (long long)i);
    for (int r = 0; r < n; r++)
        if ((rc = td_sensor_read(s, i + r, p->grids + (size_t)r * grid, NULL, NULL,
                                 labels != NULL ? &labels[r] : NULL, &w->err)) != 0)
            return rc;
    return td_sensorlm_embed_windows(p->e, p->grids, n, p->emb, &w->err);
}

static float dot(const float *a, const float *b, int n)
{
    float s = 0;

    for (int k = 0; k < n; k++)
        s += a[k] * b[k];
    return s;
}

/* The labels: the request's, or the shard's own names and prompts. A name the request gives
 * without a prompt (prompts[k] NULL) takes the shard's prompt for a label of that name, else
 * the name itself (as sensor import's default prompt is the name). */
static int resolve_labels(td_work *w, const td_sensor *s)
{
    int K = td_sensor_header_of(s)->n_labels;

    if (w->nlabels == 0) {
        if (K == 0)
            return td_error_set(&w->err, TD_EINVAL,
                                "data: %s carries no labels; name them (labels)", w->data);
        w->names = calloc((size_t)K, sizeof(char *));
        w->prompts = calloc((size_t)K, sizeof(char *));
        if (w->names == NULL || w->prompts == NULL)
            return td_error_set(&w->err, TD_ENOMEM, "out of memory");
        for (w->nlabels = 0; w->nlabels < K; w->nlabels++)
            w->names[w->nlabels] = strdup(td_sensor_label_name(s, w->nlabels));
    }
    for (int k = 0; k < w->nlabels; k++) {
        const char *from = w->names[k];
        if (w->names[k] == NULL)
            return td_error_set(&w->err, TD_ENOMEM, "out of memory");
        if (w->prompts[k] != NULL)
            continue;
        for (int j = 0; j < K; j++)
            if (strcmp(td_sensor_label_name(s, j), w->names[k]) == 0)
                from = td_sensor_label_prompt(s, j);
        if ((w->prompts[k] = strdup(from)) == NULL)
            return td_error_set(&w->err, TD_ENOMEM, "out of memory");
    }
    return 0;
}

/* Each window of the page [first, first + limit) gets the label whose prompt it scores highest
 * with (the first of equals), as the evaluation's zero-shot does. */
static void run_classify(td_work *w)
{
    shard_pass p;
    float *u = NULL;
    int64_t end;
    int E;

    if ((w->rc = pass_open(w, &p, NULL)) != 0 || (w->rc = resolve_labels(w, p.s)) != 0)
        goto out;
    E = p.info.embed_dim;
    end = w->first + w->limit < w->windows ? w->first + w->limit : w->windows;
    if ((u = malloc((size_t)w->nlabels * E * sizeof(float))) == NULL ||
        (w->hits = calloc((size_t)(end > w->first ? end - w->first : 1), sizeof(*w->hits))) ==
            NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "out of memory");
        goto out;
    }
    if ((w->rc = td_sensorlm_embed_labels(p.e, (const char *const *)w->prompts, w->nlabels, u,
                                          &w->err)) != 0)
        goto out;
    for (int64_t i = w->first; i < end; i += p.rows) {
        int n = end - i < p.rows ? (int)(end - i) : p.rows;
        if ((w->rc = pass_embed(w, &p, p.s, i, n, NULL)) != 0)
            goto out;
        for (int r = 0; r < n; r++) {
            td_work_hit *h = &w->hits[w->nhits++];
            h->index = i + r;
            h->score = dot(p.emb + (size_t)r * E, u, E);
            for (int k = 1; k < w->nlabels; k++) {
                float sc = dot(p.emb + (size_t)r * E, u + (size_t)k * E, E);
                if (sc > h->score)
                    h->score = sc, h->label = k;
            }
        }
    }
out:
    free(u);
    pass_close(&p);
}

/* Whether window a (score sa) ranks before window b. */
static int ranks_before(int64_t a, float sa, int64_t b, float sb)
{
    return sa > sb || (sa == sb && a < b);
}

/* Keeps hits[0..*n) the best k windows so far, best first (the lower index among equals). */
static void keep_best(td_work_hit *hits, int *n, int k, int64_t index, float score)
{
    int at;

    if (*n == k && !ranks_before(index, score, hits[k - 1].index, hits[k - 1].score))
        return;
    at = *n < k ? (*n)++ : k - 1;
    hits[at] = (td_work_hit){.index = index, .score = score};
    for (; at > 0 &&
           ranks_before(hits[at].index, hits[at].score, hits[at - 1].index, hits[at - 1].score);
         at--) {
        td_work_hit t = hits[at];
        hits[at] = hits[at - 1];
        hits[at - 1] = t;
    }
}

/* The w->limit windows of the shard whose embeddings score highest with the query's, best
 * first, with their captions. */
static void run_retrieve(td_work *w)
{
    const char *q[1] = {w->prompt};
    shard_pass p;
    float *u = NULL;
    int E;

    if ((w->rc = pass_open(w, &p, NULL)) != 0)
        goto out;
    E = p.info.embed_dim;
    if ((u = malloc((size_t)E * sizeof(float))) == NULL ||
        (w->hits = calloc((size_t)w->limit, sizeof(*w->hits))) == NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "out of memory");
        goto out;
    }
    if ((w->rc = td_sensorlm_embed_texts(p.e, q, 1, u, &w->err)) != 0)
        goto out;
    for (int64_t i = 0; i < w->windows; i += p.rows) {
        int n = w->windows - i < p.rows ? (int)(w->windows - i) : p.rows;
        if ((w->rc = pass_embed(w, &p, p.s, i, n, NULL)) != 0)
            goto out;
        for (int r = 0; r < n; r++)
            keep_best(w->hits, &w->nhits, w->limit, i + r, dot(p.emb + (size_t)r * E, u, E));
    }
    for (int k = 0; k < w->nhits; k++) {
        size_t L = (size_t)td_sensor_header_of(p.s)->caption_len, len = 0;
        if ((w->hits[k].caption = malloc(L + 1)) == NULL) {
            w->rc = td_error_set(&w->err, TD_ENOMEM, "out of memory");
            goto out;
        }
        if ((w->rc = td_sensor_read(p.s, w->hits[k].index, NULL, w->hits[k].caption, &len, NULL,
                                    &w->err)) != 0)
            goto out;
    }
out:
    free(u);
    pass_close(&p);
}

/* ---- probe ---- */

/* That both shards carry labels and the same label table (the names, in order); the names
 * are kept in w->names. */
static int probe_labels(td_work *w, const td_sensor *t, const td_sensor *v)
{
    int K = td_sensor_header_of(t)->n_labels, Kv = td_sensor_header_of(v)->n_labels;

    if (K == 0)
        return td_error_set(&w->err, TD_EINVAL,
                            "data: %s carries no labels; a probe is fitted on labelled windows",
                            w->data);
    if (Kv == 0)
        return td_error_set(&w->err, TD_EINVAL,
                            "eval: %s carries no labels; a probe is judged on labelled windows",
                            w->eval);
    if (K != Kv)
        return td_error_set(&w->err, TD_EINVAL,
                            "eval: %s has %d labels, data: %s has %d; both shards must have the "
                            "same label table",
                            w->eval, Kv, w->data, K);
    for (int k = 0; k < K; k++)
        if (strcmp(td_sensor_label_name(t, k), td_sensor_label_name(v, k)) != 0)
            return td_error_set(&w->err, TD_EINVAL,
                                "eval: %s: label %d is \"%s\", but in data: %s it is \"%s\"; "
                                "both shards must have the same label table",
                                w->eval, k, td_sensor_label_name(v, k), w->data,
                                td_sensor_label_name(t, k));
    w->names = calloc((size_t)K, sizeof(char *));
    w->train_counts = calloc((size_t)K, sizeof(int64_t));
    w->eval_counts = calloc((size_t)K, sizeof(int64_t));
    if (w->names == NULL || w->train_counts == NULL || w->eval_counts == NULL)
        return td_error_set(&w->err, TD_ENOMEM, "out of memory");
    for (w->nlabels = 0; w->nlabels < K; w->nlabels++)
        if ((w->names[w->nlabels] = strdup(td_sensor_label_name(t, w->nlabels))) == NULL)
            return td_error_set(&w->err, TD_ENOMEM, "out of memory");
    return 0;
}

/* A probe's shard within TD_PROBE_MAX_WINDOWS: every one of its windows' embeddings is kept. */
static int probe_size(td_work *w, const char *what, const char *path, int64_t n)
{
    if (n > TD_PROBE_MAX_WINDOWS)
        return td_error_set(&w->err, TD_E2BIG,
                            "%s: %s has %lld windows; a probe takes at most %d a shard", what, path,
                            (long long)n, TD_PROBE_MAX_WINDOWS);
    return 0;
}

/* Every window of shard s (n) through the sensor tower into x (n, E), its labels into y (n),
 * and each class's count into counts. */
static int embed_shard(td_work *w, shard_pass *p, const td_sensor *s, int64_t n, float *x,
                       int32_t *y, int64_t *counts)
{
    size_t E = (size_t)p->info.embed_dim;
    int rc;

    for (int64_t i = 0; i < n; i += p->rows) {
        int m = n - i < p->rows ? (int)(n - i) : p->rows;
        if ((rc = pass_embed(w, p, s, i, m, y + i)) != 0)
            return rc;
        memcpy(x + (size_t)i * E, p->emb, (size_t)m * E * sizeof(float));
        for (int r = 0; r < m; r++)
            counts[y[i + r]]++;
    }
    return 0;
}

/* Both shards embedded with the job's model, then for each k of w->shots a linear probe
 * (train/probe.h: TD_PROBE_L2, at most TD_PROBE_MAX_ITER iterations of L-BFGS) fitted on the
 * first k windows of each class of the train shard, its accuracy and macro-F1 on the valid
 * shard's windows. */
static void run_probe(td_work *w)
{
    td_sensor *v = NULL;
    float *xt = NULL, *xv = NULL;
    int32_t *yt = NULL, *yv = NULL;
    shard_pass p;
    size_t E;

    if ((w->rc = pass_open(w, &p, &v)) != 0 || (w->rc = probe_labels(w, p.s, v)) != 0)
        goto out;
    w->eval_windows = td_sensor_count(v);
    w->step = p.info.step;
    w->embed_dim = p.info.embed_dim;
    E = (size_t)p.info.embed_dim;
    if ((w->rc = probe_size(w, "data", w->data, w->windows)) != 0 ||
        (w->rc = probe_size(w, "eval", w->eval, w->eval_windows)) != 0)
        goto out;
    xt = malloc((size_t)w->windows * E * sizeof(float));
    xv = malloc((size_t)w->eval_windows * E * sizeof(float));
    yt = malloc((size_t)w->windows * sizeof(int32_t));
    yv = malloc((size_t)w->eval_windows * sizeof(int32_t));
    if (xt == NULL || xv == NULL || yt == NULL || yv == NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "no memory for the embeddings of %lld windows",
                             (long long)(w->windows + w->eval_windows));
        goto out;
    }
    if ((w->rc = embed_shard(w, &p, p.s, w->windows, xt, yt, w->train_counts)) != 0 ||
        (w->rc = embed_shard(w, &p, v, w->eval_windows, xv, yv, w->eval_counts)) != 0)
        goto out;
    w->rc = td_probe_run(xt, yt, w->windows, xv, yv, w->eval_windows, (int)E, w->nlabels, w->shots,
                         w->nshots, TD_PROBE_L2, TD_PROBE_MAX_ITER, stopping, w, w->rows, NULL,
                         NULL, &w->err);
out:
    free(xt);
    free(xv);
    free(yt);
    free(yv);
    td_sensor_close(v);
    pass_close(&p);
}

/* Threadpool thread. */
static void on_work(uv_work_t *req)
{
    td_work *w = req->data;

    if (work_stopped(w)) {
        w->rc = td_error_set(&w->err, TD_ECANCELLED, "stopped before it began");
        return;
    }
    if (!has_checkpoint(w->cfg.checkpoint_dir)) {
        w->rc = td_error_set(&w->err, TD_ENOTFOUND, "job %lld has no checkpoint yet",
                             (long long)w->job);
        return;
    }
    if (w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST)
        run_export(w);
    else if (w->kind == TD_WORK_SAMPLE)
        run_sample(w);
    else if (w->kind == TD_WORK_CLASSIFY)
        run_classify(w);
    else if (w->kind == TD_WORK_RETRIEVE)
        run_retrieve(w);
    else
        run_probe(w);
    if (w->rc != 0)
        prefix_job(&w->err, w->job);
}

/* ---- the lanes ---- */

struct td_work_lanes {
    uv_timer_t tick; /* first: the handle's data is the lanes; times works out, sees a stop */
    uv_loop_t *loop;
    const atomic_int *stop;
    double timeout_s;
    int cap[TD_NLANES];        /* threads a lane may hold */
    int busy[TD_NLANES];       /* ... and holds now */
    td_work *queue[TD_NLANES]; /* waiting, oldest first */
    td_work *running;          /* on the threadpool */
    int ticking, closed;
};

#define TD_WORK_TICK_MS 100 /* how often running works are looked at (a timeout, a stop) */

static const char *kind_name(const td_work *w)
{
    return w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST ? "export"
           : w->kind == TD_WORK_SAMPLE                               ? "sample"
           : w->kind == TD_WORK_CLASSIFY                             ? "classify"
           : w->kind == TD_WORK_RETRIEVE                             ? "retrieve"
                                                                     : "probe";
}

int td_work_pool_size(void)
{
    const char *env = getenv("UV_THREADPOOL_SIZE");
    char v[16];
    int n = env != NULL ? atoi(env) : 0;

    if (n > 0)
        return n > 1024 ? 1024 : n; /* libuv's own bound */
    snprintf(v, sizeof(v), "%d", TD_WORK_POOL);
    setenv("UV_THREADPOOL_SIZE", v, 1);
    return TD_WORK_POOL;
}

int td_work_lanes_new(td_work_lanes **out, uv_loop_t *loop, int pool, double timeout_s,
                      const atomic_int *stop, td_error_t *err)
{
    td_work_lanes *l = calloc(1, sizeof(*l));
    int spare = pool - TD_WORK_POOL_RESERVE;

    *out = NULL;
    if (l == NULL)
        return td_error_set(err, TD_ENOMEM, "out of memory");
    l->loop = loop;
    l->stop = stop;
    l->timeout_s = timeout_s;
    /* a third of what is not reserved for exports, the rest for the model's work; one each
     * at least, on the smallest pool too */
    l->cap[TD_LANE_EXPORT] = spare / 3 > 0 ? spare / 3 : 1;
    l->cap[TD_LANE_MODEL] = spare - l->cap[TD_LANE_EXPORT] > 0 ? spare - l->cap[TD_LANE_EXPORT] : 1;
    uv_timer_init(loop, &l->tick);
    l->tick.data = l;
    *out = l;
    return 0;
}

int td_work_lane_threads(const td_work_lanes *l, int lane)
{
    return l->cap[lane];
}

static void dispatch(td_work_lanes *l);
static void tick(uv_timer_t *t);

/* The work's end as the loop sees it: a stop (a work that stopped for it, or never began)
 * becomes its error, with the reason, and the pool's own words ("stopped after 4096 windows")
 * where there are any; a work that finished all the same keeps its result. Then its cb. */
static void finish(td_work_lanes *l, td_work *w)
{
    int why = atomic_load(&w->cancel);
    td_error_t was = w->err;
    const char *detail = w->running && w->rc != 0 ? was.msg : "";

    if (strncmp(detail, "job ", 4) == 0 && strstr(detail, ": ") != NULL)
        detail = strstr(detail, ": ") + 2; /* on_work's "job 3: " again */

    if (why == TD_WORK_GOING && atomic_load(l->stop))
        why = TD_WORK_STOPPING;
    if (why != TD_WORK_GOING && (w->rc == TD_ECANCELLED || !w->running)) {
        if (why == TD_WORK_TIMEOUT)
            td_error_set(&w->err, TD_ECANCELLED,
                         "job %lld: %s stopped after %g s, the limit (work_timeout_s)%s%s",
                         (long long)w->job, kind_name(w), l->timeout_s, detail[0] ? "; " : "",
                         detail);
        else
            td_error_set(&w->err, TD_ECANCELLED, "job %lld: %s stopped: %s%s%s", (long long)w->job,
                         kind_name(w),
                         why == TD_WORK_GONE ? "its client is gone" : "traind is stopping",
                         detail[0] ? "; " : "", detail);
        w->rc = TD_ECANCELLED;
    }
    w->cb(w);
}

/* Loop thread: the threadpool is done with w. */
static void on_after_work(uv_work_t *req, int status)
{
    td_work *w = req->data;
    td_work_lanes *l = w->lanes;

    for (td_work **p = &l->running; *p != NULL; p = &(*p)->qnext)
        if (*p == w) {
            *p = w->qnext;
            break;
        }
    l->busy[w->lane]--;
    if (status != 0 && w->rc == 0)
        w->rc =
            td_error_set(&w->err, status, "job %lld: %s", (long long)w->job, uv_strerror(status));
    finish(l, w);
    dispatch(l);
}

/* Running works of uid in lane. */
static int running_of(const td_work_lanes *l, int lane, int64_t uid)
{
    int n = 0;

    for (const td_work *w = l->running; w != NULL; w = w->qnext)
        n += w->lane == lane && w->uid == uid;
    return n;
}

/* Hands the threadpool the next works of each lane while it has threads: the queued work of
 * the uid with the fewest running in the lane, the oldest among equals. */
static void dispatch(td_work_lanes *l)
{
    for (int lane = 0; lane < TD_NLANES; lane++)
        while (!l->closed && l->busy[lane] < l->cap[lane] && l->queue[lane] != NULL) {
            td_work **pick = &l->queue[lane], *w;
            int fewest = running_of(l, lane, (*pick)->uid);
            for (td_work **p = &(*pick)->qnext; *p != NULL && fewest > 0; p = &(*p)->qnext) {
                int n = running_of(l, lane, (*p)->uid);
                if (n < fewest) {
                    fewest = n;
                    pick = p;
                }
            }
            w = *pick;
            *pick = w->qnext;
            w->qnext = l->running;
            l->running = w;
            w->running = 1;
            w->started_ms = uv_now(l->loop);
            l->busy[lane]++;
            if (uv_queue_work(l->loop, &w->req, on_work, on_after_work) != 0) {
                l->running = w->qnext; /* the pool refused (never, in practice): answered now */
                l->busy[lane]--;
                w->running = 0;
                w->rc = td_error_set(&w->err, TD_EBUSY, "job %lld: the threadpool refused the %s",
                                     (long long)w->job, kind_name(w));
                w->cb(w);
            }
        }
    if (!l->closed && !l->ticking && (l->running != NULL || l->queue[0] || l->queue[1])) {
        uv_timer_start(&l->tick, tick, TD_WORK_TICK_MS, TD_WORK_TICK_MS);
        l->ticking = 1;
    } else if (l->ticking && l->running == NULL && !l->queue[0] && !l->queue[1]) {
        uv_timer_stop(&l->tick);
        l->ticking = 0;
    }
}

/* Queued works whose client went (or all, stopping) are answered without running. */
static void drop_queued(td_work_lanes *l, int all)
{
    for (int lane = 0; lane < TD_NLANES; lane++)
        for (td_work **p = &l->queue[lane]; *p != NULL;) {
            td_work *w = *p;
            if (all || atomic_load(&w->cancel) != TD_WORK_GOING) {
                *p = w->qnext;
                if (all && atomic_load(&w->cancel) == TD_WORK_GOING)
                    atomic_store(&w->cancel, TD_WORK_STOPPING);
                finish(l, w);
            } else {
                p = &w->qnext;
            }
        }
}

/* Every TD_WORK_TICK_MS while works run or wait: a running work past the timeout, or every
 * one once the daemon stops, is told to stop; the queued ones of gone clients are answered. */
static void tick(uv_timer_t *t)
{
    td_work_lanes *l = t->data;
    uint64_t now = uv_now(l->loop);
    int stop = atomic_load(l->stop);

    for (td_work *w = l->running; w != NULL; w = w->qnext)
        if (stop)
            atomic_store(&w->cancel, TD_WORK_STOPPING);
        else if (l->timeout_s > 0 && atomic_load(&w->cancel) == TD_WORK_GOING &&
                 (double)(now - w->started_ms) > l->timeout_s * 1e3)
            atomic_store(&w->cancel, TD_WORK_TIMEOUT);
    drop_queued(l, stop);
    dispatch(l);
}

void td_work_queue(td_work_lanes *l, td_work *w, td_work_cb cb)
{
    td_work **p;

    w->cb = cb;
    w->req.data = w;
    w->lanes = l;
    w->lane =
        w->kind == TD_WORK_EXPORT || w->kind == TD_WORK_EXPORT_ST ? TD_LANE_EXPORT : TD_LANE_MODEL;
    w->qnext = NULL;
    for (p = &l->queue[w->lane]; *p != NULL; p = &(*p)->qnext)
        ;
    *p = w;
    dispatch(l);
}

void td_work_cancel(td_work *w)
{
    atomic_store(&w->cancel, TD_WORK_GONE);
}

void td_work_lanes_close(td_work_lanes *l)
{
    if (l == NULL || l->closed)
        return;
    for (td_work *w = l->running; w != NULL; w = w->qnext)
        atomic_store(&w->cancel, TD_WORK_STOPPING);
    drop_queued(l, 1);
    l->closed = 1;
    uv_close((uv_handle_t *)&l->tick, NULL);
}

void td_work_lanes_free(td_work_lanes *l)
{
    free(l);
}

void td_work_free(td_work *w)
{
    if (w == NULL)
        return;
    if (w->fd >= 0)
        close(w->fd);
    free(w->prompt);
    free(w->text);
    free(w->data);
    free(w->eval);
    free(w->train_counts);
    free(w->eval_counts);
    for (int k = 0; k < w->nlabels; k++) {
        free(w->names != NULL ? w->names[k] : NULL);
        free(w->prompts != NULL ? w->prompts[k] : NULL);
    }
    free(w->names);
    free(w->prompts);
    for (int k = 0; k < w->nhits; k++)
        free(w->hits[k].caption);
    free(w->hits);
    free(w);
}
