/* Export, sample, classify and retrieve on libuv's threadpool (work.h): the loop thread
 * rebuilds the job's config and queues the work; a threadpool thread writes the model file
 * (llm.c or safetensors) to a temp file under the state directory (then opens and unlinks it,
 * so that the bytes live only as long as the descriptor the loop thread streams them from),
 * generates the sample, or embeds a sensor shard's windows (opened with the requester's
 * rights) against label prompts or a query; the loop thread gets the result back in the done
 * callback. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/sensor.h"
#include "daemon/work.h"

#define EMBED_ROWS 64 /* windows per forward of an embedding pass */

#define TOKEN_TEXT_MAX                                                      \
    12 /* bytes one token takes in a sample's text: a tokens job writes its \
        * id (at most 10 digits) and a space */

static unsigned export_serial; /* loop thread: tells concurrent exports' temp files apart */

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
    if (kind == TD_WORK_EXPORT_ST && m != TD_MODEL_GPT && m != TD_MODEL_SENSORLM)
        return td_error_set(err, TD_EINVAL,
                            "job %lld is %s job; only gpt and sensorlm jobs export to safetensors",
                            (long long)job, model_name(m));
    if ((kind == TD_WORK_CLASSIFY || kind == TD_WORK_RETRIEVE) && m != TD_MODEL_SENSORLM)
        return td_error_set(err, TD_EINVAL, "job %lld is %s job; only sensorlm jobs %s",
                            (long long)job, model_name(m),
                            kind == TD_WORK_CLASSIFY ? "classify" : "retrieve");
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
    w->rc = td_sample(&w->cfg, w->prompt != NULL ? w->prompt : "", w->tokens, w->temperature,
                      w->seed, w->stop, w->text, cap, &w->err);
    if (w->rc == TD_ECANCELLED) {
        td_error_t why = w->err;
        td_error_set(&w->err, w->rc, "%s: traind is stopping", why.msg);
    }
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
    return atomic_load((const atomic_int *)ud);
}

static void pass_close(shard_pass *p)
{
    td_sensor_close(p->s);
    td_sensorlm_embedder_free(p->e);
    free(p->grids);
    free(p->emb);
}

/* The job's model from its latest checkpoint and the shard, opened with the requester's rights
 * (data.h: the kernel checks the open as it would theirs) and checked against the model's T and
 * C. */
static int pass_open(td_work *w, shard_pass *p)
{
    td_data_access as_user = {
        .uid = w->uid, .gid = w->gid, .stop = stopping, .ud = (void *)w->stop};
    td_sensor_expect want;
    td_error_t e = {0};
    int rc, fd = -1;

    memset(p, 0, sizeof(*p));
    rc = td_data_access_begin(&as_user, &w->err);
    if (rc != 0)
        return rc;
    rc = td_sensorlm_embedder_open(&p->e, &w->cfg, EMBED_ROWS, &w->err);
    if (rc == 0) {
        td_sensorlm_embedder_info(p->e, &p->info);
        want = (td_sensor_expect){.T = p->info.time_steps, .C = p->info.channels};
        rc = td_data_open_file(w->data, &fd, &e);
        if (rc == 0)
            rc = td_sensor_open_fd(&p->s, fd, w->data, &want, &e);
        if (rc != 0)
            td_error_set(&w->err, rc, "data: %s", e.msg);
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

/* Windows [i, i + n) of the shard, n <= p->rows, into p->emb. */
static int pass_embed(td_work *w, shard_pass *p, int64_t i, int n)
{
    size_t grid = (size_t)p->info.time_steps * p->info.channels;
    int rc;

    if (atomic_load(w->stop))
        return td_error_set(&w->err, TD_ECANCELLED, "traind is stopping");
    for (int r = 0; r < n; r++)
        if ((rc = td_sensor_read(p->s, i + r, p->grids + (size_t)r * grid, NULL, NULL, NULL,
                                 &w->err)) != 0)
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

    if ((w->rc = pass_open(w, &p)) != 0 || (w->rc = resolve_labels(w, p.s)) != 0)
        goto out;
    E = p.info.embed_dim;
    end = w->first + w->limit < w->windows ? w->first + w->limit : w->windows;
    if ((u = malloc((size_t)w->nlabels * E * sizeof(float))) == NULL ||
        (w->hits = calloc((size_t)(end > w->first ? end - w->first : 1), sizeof(*w->hits))) ==
            NULL) {
        w->rc = td_error_set(&w->err, TD_ENOMEM, "out of memory");
        goto out;
    }
    if ((w->rc = td_sensorlm_embed_texts(p.e, (const char *const *)w->prompts, w->nlabels, u,
                                         &w->err)) != 0)
        goto out;
    for (int64_t i = w->first; i < end; i += p.rows) {
        int n = end - i < p.rows ? (int)(end - i) : p.rows;
        if ((w->rc = pass_embed(w, &p, i, n)) != 0)
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

    if ((w->rc = pass_open(w, &p)) != 0)
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
        if ((w->rc = pass_embed(w, &p, i, n)) != 0)
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

/* Threadpool thread. */
static void on_work(uv_work_t *req)
{
    td_work *w = req->data;

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
    else
        run_retrieve(w);
    if (w->rc != 0)
        prefix_job(&w->err, w->job);
}

/* Loop thread. */
static void on_after_work(uv_work_t *req, int status)
{
    td_work *w = req->data;

    if (status != 0 && w->rc == 0)
        w->rc =
            td_error_set(&w->err, status, "job %lld: %s", (long long)w->job, uv_strerror(status));
    w->cb(w);
}

int td_work_start(td_work *w, uv_loop_t *loop, td_work_cb cb)
{
    w->cb = cb;
    w->req.data = w;
    return uv_queue_work(loop, &w->req, on_work, on_after_work);
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
