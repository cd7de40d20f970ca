/* A sensorlm job's data (slm.h): its sensor shards, the train and valid splits, the epoch's
 * order, and batches built in host memory (windows normalised, cut into patches; captions
 * tokenised). Every file is opened with data.h's td_data_open_file, so with the rights of the
 * user the calling thread's access names; globs are expanded as that user too. Owns the open
 * shards and its host buffers; used by one thread at a time. */
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/sensor.h"
#include "train/slm.h"

#define MAX_WINDOWS    ((int64_t)1 << 31)    /* windows of one job, both splits: uint32 order */
#define SHUFFLE_STREAM 0x534c4d0000ull       /* + epoch: the order's PRNG stream ("SLM") */
#define CUT_STREAM     0x4355540000000000ull /* + epoch * 2^32 + position: a caption's cut ("CUT") */
#define FIELD_BYTES    48                    /* "data.valid[15]" */
#define SPLIT_TRAIN    0
#define SPLIT_VALID    1

/* ---- the files of a split -------------------------------------------------------------------- */

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Calls fn(ud, split, fd, path, e) for every file of a split's patterns, in order: a plain path
 * must be a regular file; a glob's matches are sorted byte-wise, those that are not regular
 * files skipped, and at least one must be. fd is open (td_data_open_file: as the thread's
 * access says) and fn takes it. Errors are prefixed with the job's field ("data.train[0]: "). */
static int each_shard(int split, const char (*pats)[TD_PATH_MAX], int n,
                      int (*fn)(void *ud, int split, int fd, const char *path, td_error_t *e),
                      void *ud, td_error_t *err)
{
    const char *name = split == SPLIT_TRAIN ? "train" : "valid";
    td_error_t e = {0};

    for (int i = 0; i < n; i++) {
        int rc = 0, found = 0, fd;
        glob_t g;
        if (strpbrk(pats[i], "*?[") == NULL) {
            if ((rc = td_data_open_file(pats[i], &fd, &e)) == 0)
                rc = fn(ud, split, fd, pats[i], &e);
            if (rc != 0)
                return td_error_set(err, rc, "data.%s[%d]: %s", name, i, e.msg);
            continue;
        }
        if (td_data_glob(pats[i], GLOB_NOSORT, &g) != 0) {
            globfree(&g);
            return td_error_set(err, TD_EDATA, "data.%s[%d]: no file matches %s", name, i, pats[i]);
        }
        qsort(g.gl_pathv, g.gl_pathc, sizeof(char *), cmp_str);
        for (size_t k = 0; k < g.gl_pathc && rc == 0; k++) {
            struct stat st;
            if ((rc = td_data_open_path(g.gl_pathv[k], TD_OPEN_ANY, &fd, &st, &e)) != 0)
                break;
            if (!S_ISREG(st.st_mode)) {
                close(fd);
                continue;
            }
            found++;
            rc = fn(ud, split, fd, g.gl_pathv[k], &e);
        }
        globfree(&g);
        if (rc != 0)
            return td_error_set(err, rc, "data.%s[%d]: %s", name, i, e.msg);
        if (found == 0)
            return td_error_set(err, TD_EDATA, "data.%s[%d]: no regular file matches %s", name, i,
                                pats[i]);
    }
    return 0;
}

/* ---- peeking at the headers ------------------------------------------------------------------ */

typedef struct peeker {
    td_slm_peek *out;
    td_sensor_expect want;
    td_sensor_header first;
    char first_path[TD_PATH_MAX];
    int have;
    int64_t n[2];  /* windows of each split's files */
    int labels[2]; /* K of each split's files: -1 before the first, 0 once one has none */
} peeker;

/* Records a split's label count: K while every file of it has K labels. */
static void note_labels(int *k, int file_k)
{
    *k = *k < 0 ? file_k : *k == file_k ? *k : 0;
}

static int peek_one(void *ud, int split, int fd, const char *path, td_error_t *e)
{
    peeker *p = ud;
    td_sensor_header h;
    int rc = td_sensor_check_fd(fd, path, &p->want, &h, e);

    close(fd);
    if (rc != 0)
        return rc;
    if (!p->have) {
        p->first = h;
        snprintf(p->first_path, sizeof(p->first_path), "%s", path);
        p->have = 1;
        p->want.T = h.T, p->want.C = h.C;
    } else if ((rc = td_sensor_compatible(p->first_path, &p->first, path, &h, e)) != 0) {
        return rc;
    }
    if (++p->out->files > TD_SLM_MAX_FILES)
        return td_error_set(e, TD_E2BIG, "%s: more than %d sensor files in one job", path,
                            TD_SLM_MAX_FILES);
    p->n[split] += h.N;
    if (p->n[SPLIT_TRAIN] + p->n[SPLIT_VALID] > MAX_WINDOWS)
        return td_error_set(e, TD_E2BIG, "%s: more than %lld windows in one job", path,
                            (long long)MAX_WINDOWS);
    note_labels(&p->labels[split], h.n_labels);
    if (split == SPLIT_TRAIN && h.n_labels > 0)
        p->out->train_labeled++;
    if (h.n_labels > 0)
        p->out->host += 4 * (uint64_t)h.N + (uint64_t)TD_SENSOR_LABEL_BYTES * h.n_labels;
    return 0;
}

int td__slm_peek(const td_train_config *cfg, int T, int C, td_slm_peek *out, td_error_t *err)
{
    peeker p = {.out = out, .want = {.T = T, .C = C}, .labels = {-1, -1}};
    int rc;

    memset(out, 0, sizeof(*out));
    if (cfg->n_train_files < 1)
        return 0;
    if ((rc = each_shard(SPLIT_TRAIN, cfg->train_files, cfg->n_train_files, peek_one, &p, err)) ||
        (rc = each_shard(SPLIT_VALID, cfg->valid_files, cfg->n_valid_files, peek_one, &p, err)))
        return rc;
    out->T = p.first.T;
    out->C = p.first.C;
    if (cfg->n_valid_files > 0) {
        out->n_train = p.n[SPLIT_TRAIN];
        out->n_valid = p.n[SPLIT_VALID];
        out->labels = p.labels[SPLIT_VALID] > 0 ? p.labels[SPLIT_VALID] : 0;
    } else {
        out->n_valid = (int64_t)floor((double)p.n[SPLIT_TRAIN] * cfg->valid_fraction);
        out->n_train = p.n[SPLIT_TRAIN] - out->n_valid;
        out->labels = out->n_valid > 0 && p.labels[SPLIT_TRAIN] > 0 ? p.labels[SPLIT_TRAIN] : 0;
    }
    out->host += 4 * (uint64_t)out->n_train; /* the order */
    return 0;
}

int64_t td__slm_eval_windows(const td_train_config *cfg, int64_t n_valid)
{
    int64_t n = n_valid;

    if (cfg->eval_batches > 0 && (int64_t)cfg->eval_batches * cfg->batch_size < n)
        n = (int64_t)cfg->eval_batches * cfg->batch_size;
    return n < TD_SLM_EVAL_MAX ? n : TD_SLM_EVAL_MAX;
}

/* ---- the open data ------------------------------------------------------------------------- */

struct td_slm_data {
    td_slm_dims d;
    td_sensor *f[TD_SLM_MAX_FILES];      /* train's files, then valid's */
    int64_t start[TD_SLM_MAX_FILES + 1]; /* file i holds windows [start[i], start[i+1]) */
    int n_files;
    int64_t n_train, n_valid; /* train [0, n_train), valid [n_train, n_train + n_valid) */
    int B, shuffle;
    uint64_t seed;
    int64_t batches;
    td_data_cursor cur;
    uint32_t *order; /* (n_train): this epoch's */
    float *norm;     /* (2C) */
    float *grid;     /* (T, C): one window as read */
    char *caption;   /* the longest caption slot + 1 */
    float cut;       /* data.caption_cut: the chance a training caption is cut short */
    int K;           /* the valid split's labels (0: none) */
    int NP;          /* their prompts, every label's in label order */
    int *prompt_tok; /* (NP, L) */
    int *prompt_end; /* (NP) */
    int *prompt_of;  /* (NP): the label each prompt is of */
};

/* Adds one file to s (takes fd). */
static int open_one(void *ud, int split, int fd, const char *path, td_error_t *e)
{
    td_slm_data *s = ud;
    td_sensor_expect want = {.T = s->d.T, .C = s->d.C};
    td_sensor *f;
    int rc;

    (void)split;
    if (s->n_files >= TD_SLM_MAX_FILES) {
        close(fd);
        return td_error_set(e, TD_E2BIG, "%s: more than %d sensor files in one job", path,
                            TD_SLM_MAX_FILES);
    }
    if ((rc = td_sensor_open_fd(&f, fd, path, &want, e)) != 0)
        return rc;
    if (s->n_files > 0 &&
        (rc = td_sensor_compatible(td_sensor_path(s->f[0]), td_sensor_header_of(s->f[0]), path,
                                   td_sensor_header_of(f), e)) != 0) {
        td_sensor_close(f);
        return rc;
    }
    s->f[s->n_files] = f;
    s->start[s->n_files + 1] = s->start[s->n_files] + td_sensor_count(f);
    s->n_files++;
    return 0;
}

/* This epoch's order: the identity, Fisher-Yates shuffled from (seed, epoch) when shuffling. */
static void draw_order(td_slm_data *s)
{
    td_rng r;

    for (int64_t i = 0; i < s->n_train; i++)
        s->order[i] = (uint32_t)i;
    if (!s->shuffle || s->n_train < 2)
        return;
    td_rng_seed(&r, s->seed, SHUFFLE_STREAM + (uint64_t)s->cur.epoch);
    for (uint32_t i = (uint32_t)s->n_train - 1; i > 0; i--) {
        uint32_t j = td_rng_below(&r, i + 1), t = s->order[i];
        s->order[i] = s->order[j];
        s->order[j] = t;
    }
}

int td__slm_prompt_parts(const char *prompts, int *off, int *len, int max)
{
    int n = 0, at = 0;

    for (;;) {
        const char *bar = strchr(prompts + at, '|');
        int l = bar != NULL ? (int)(bar - (prompts + at)) : (int)strlen(prompts + at);
        if (l > 0 && n < max) {
            off[n] = at;
            len[n] = l;
            n++;
        }
        if (bar == NULL)
            return n;
        at += l + 1;
    }
}

/* The label prompts of the valid split's first file, each label's split at '|', tokenised. */
static int read_prompts(td_slm_data *s, int first_valid, int K, td_error_t *err)
{
    const td_sensor *f = s->f[first_valid];
    int off[TD_SLM_MAX_PROMPTS], len[TD_SLM_MAX_PROMPTS], np = 0;

    for (int k = 0; k < K; k++) {
        int n = td__slm_prompt_parts(td_sensor_label_prompt(f, k), off, len, TD_SLM_MAX_PROMPTS);
        np += n > 0 ? n : 1;
    }
    s->prompt_tok = malloc((size_t)np * s->d.L * sizeof(int));
    s->prompt_end = malloc((size_t)np * sizeof(int));
    s->prompt_of = malloc((size_t)np * sizeof(int));
    if (s->prompt_tok == NULL || s->prompt_end == NULL || s->prompt_of == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for %d label prompts", np);
    np = 0;
    for (int k = 0; k < K; k++) {
        const char *p = td_sensor_label_prompt(f, k);
        int n = td__slm_prompt_parts(p, off, len, TD_SLM_MAX_PROMPTS);
        if (n == 0) { /* nothing but '|': the label's name */
            p = td_sensor_label_name(f, k);
            off[0] = 0;
            len[0] = (int)strlen(p);
            n = 1;
        }
        for (int i = 0; i < n; i++, np++) {
            td__slm_tokenize(p + off[i], (size_t)len[i], s->d.L,
                             s->prompt_tok + (size_t)np * s->d.L, &s->prompt_end[np]);
            s->prompt_of[np] = k;
        }
    }
    s->K = K;
    s->NP = np;
    return 0;
}

/* Host buffers: the order, the statistics, one window and one caption. */
static int alloc_buffers(td_slm_data *s, td_error_t *err)
{
    const td_sensor_header *h = td_sensor_header_of(s->f[0]);
    int cap = 1;

    for (int i = 0; i < s->n_files; i++) {
        int l = td_sensor_header_of(s->f[i])->caption_len;
        cap = l > cap ? l : cap;
    }
    s->order = malloc((size_t)(s->n_train > 0 ? s->n_train : 1) * sizeof(uint32_t));
    s->norm = malloc(2 * (size_t)s->d.C * sizeof(float));
    s->grid = malloc((size_t)s->d.T * s->d.C * sizeof(float));
    s->caption = malloc((size_t)cap + 1);
    if (s->order == NULL || s->norm == NULL || s->grid == NULL || s->caption == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the sensor data's buffers");
    for (int c = 0; c < s->d.C; c++) {
        s->norm[c] = h->ch[c].mean;
        s->norm[s->d.C + c] = h->ch[c].std;
    }
    return 0;
}

int td__slm_data_open(td_slm_data **out, const td_train_config *cfg, const td_slm_dims *d,
                      td_error_t *err)
{
    td_slm_data *s = calloc(1, sizeof(*s));
    int rc, n_train_files, labeled = 0;

    *out = NULL;
    if (s == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for the sensor data");
    s->d = *d;
    s->B = cfg->batch_size;
    s->shuffle = cfg->shuffle;
    s->seed = cfg->seed;
    s->cut = cfg->caption_cut;
    rc = each_shard(SPLIT_TRAIN, cfg->train_files, cfg->n_train_files, open_one, s, err);
    n_train_files = s->n_files;
    if (rc == 0)
        rc = each_shard(SPLIT_VALID, cfg->valid_files, cfg->n_valid_files, open_one, s, err);
    if (rc != 0)
        goto fail;
    if (cfg->n_valid_files > 0) {
        s->n_train = s->start[n_train_files];
        s->n_valid = s->start[s->n_files] - s->n_train;
    } else {
        s->n_valid = (int64_t)floor((double)s->start[s->n_files] * cfg->valid_fraction);
        s->n_train = s->start[s->n_files] - s->n_valid;
    }
    if (s->n_train < s->B) {
        rc = td_error_set(err, TD_EDATA, "train split: %lld windows, a batch needs %d",
                          (long long)s->n_train, s->B);
        goto fail;
    }
    for (int i = 0; i < n_train_files; i++)
        labeled += td_sensor_header_of(s->f[i])->n_labels > 0;
    if (cfg->mask_same_label && labeled == 0) {
        rc = td_error_set(err, TD_EINVAL, TD_SLM_NO_TRAIN_LABELS);
        goto fail;
    }
    s->batches = s->n_train / s->B;
    if ((rc = alloc_buffers(s, err)) != 0)
        goto fail;
    draw_order(s);
    /* the valid split's labels: K when every valid file has the first's K (td__slm_peek's rule) */
    {
        int first = cfg->n_valid_files > 0 ? n_train_files : 0, K = -1;
        for (int i = first; i < s->n_files && s->n_valid > 0; i++)
            note_labels(&K, td_sensor_header_of(s->f[i])->n_labels);
        if (K > 0 && (rc = read_prompts(s, first, K, err)) != 0)
            goto fail;
    }
    *out = s;
    return 0;

fail:
    td__slm_data_free(s);
    return rc;
}

void td__slm_data_free(td_slm_data *s)
{
    if (s == NULL)
        return;
    for (int i = 0; i < s->n_files; i++)
        td_sensor_close(s->f[i]);
    free(s->order);
    free(s->norm);
    free(s->grid);
    free(s->caption);
    free(s->prompt_tok);
    free(s->prompt_end);
    free(s->prompt_of);
    free(s);
}

int64_t td__slm_train_windows(const td_slm_data *s)
{
    return s->n_train;
}

int64_t td__slm_valid_windows(const td_slm_data *s)
{
    return s->n_valid;
}

int64_t td__slm_batches(const td_slm_data *s)
{
    return s->batches;
}

float *td__slm_norm(td_slm_data *s)
{
    return s->norm;
}

td_data_cursor td__slm_tell(const td_slm_data *s)
{
    return s->cur;
}

int td__slm_seek(td_slm_data *s, td_data_cursor c, td_error_t *err)
{
    if (c.epoch < 0 || c.batch < 0 || c.batch >= s->batches)
        return td_error_set(err, TD_EINVAL,
                            "sensor data: no batch %lld of epoch %lld (%lld a "
                            "epoch)",
                            (long long)c.batch, (long long)c.epoch, (long long)s->batches);
    if (c.epoch != s->cur.epoch) {
        s->cur.epoch = c.epoch;
        draw_order(s);
    }
    s->cur = c;
    return 0;
}

void td__slm_advance(td_slm_data *s)
{
    if (++s->cur.batch < s->batches)
        return;
    s->cur.batch = 0;
    s->cur.epoch++;
    draw_order(s);
}

int td__slm_labels(const td_slm_data *s)
{
    return s->K;
}

int td__slm_prompt_count(const td_slm_data *s)
{
    return s->NP;
}

void td__slm_prompts(const td_slm_data *s, int *tok, int *end, int *of)
{
    memcpy(tok, s->prompt_tok, (size_t)s->NP * s->d.L * sizeof(int));
    memcpy(end, s->prompt_end, (size_t)s->NP * sizeof(int));
    memcpy(of, s->prompt_of, (size_t)s->NP * sizeof(int));
}

/* ---- windows and captions ------------------------------------------------------------------ */

/* Whether a clause ends at byte i of text (len bytes): "; " or ". " starts there, after at least
 * one byte. */
static int boundary_at(const char *text, size_t len, size_t i)
{
    return i > 0 && i + 1 < len && (text[i] == ';' || text[i] == '.') && text[i + 1] == ' ';
}

size_t td__slm_fit(const char *text, size_t len, size_t max)
{
    if (len <= max)
        return len;
    for (size_t i = max; i > 0; i--) /* the last clause that fits */
        if (boundary_at(text, len, i))
            return i;
    for (size_t i = max; i > 0; i--) /* else the last word */
        if (text[i] == ' ')
            return i;
    return max; /* one word longer than max */
}

size_t td__slm_cut(const char *text, size_t len, uint64_t seed, int64_t epoch, int64_t pos, float p)
{
    uint32_t n = 0, k;
    td_rng r;

    if (p <= 0.0f)
        return len;
    td_rng_seed(&r, seed, CUT_STREAM + ((uint64_t)epoch << 32) + (uint64_t)pos);
    if (!(td_rng_uniform(&r) < p))
        return len;
    for (size_t i = 0; i < len; i++)
        n += boundary_at(text, len, i);
    if (n == 0)
        return len;
    k = td_rng_below(&r, n);
    for (size_t i = 0; i < len; i++)
        if (boundary_at(text, len, i) && k-- == 0)
            return i;
    return len;
}

void td__slm_tokenize(const char *text, size_t len, int L, int *tok, int *end)
{
    size_t n = td__slm_fit(text, len, (size_t)(L - 1));

    for (size_t i = 0; i < n; i++)
        tok[i] = (unsigned char)text[i];
    tok[n] = TD_SLM_END;
    for (size_t i = n + 1; i < (size_t)L; i++)
        tok[i] = TD_SLM_PAD;
    *end = (int)n;
}

void td__slm_patchify(const float *grid, const float *norm, const td_slm_dims *d, float *x)
{
    int per_t = d->Cp / d->pc; /* patches along the channels */

    for (int ti = 0; ti < d->T / d->pt; ti++)
        for (int ci = 0; ci < per_t; ci++) {
            float *p = x + ((size_t)ti * per_t + ci) * d->P;
            for (int dt = 0; dt < d->pt; dt++)
                for (int dc = 0; dc < d->pc; dc++) {
                    int t = ti * d->pt + dt, c = ci * d->pc + dc;
                    float v = 0.0f;
                    if (c < d->C) {
                        v = (grid[(size_t)t * d->C + c] - norm[c]) / norm[d->C + c];
                        v = isnan(v) ? 0.0f : v;
                    }
                    p[dt * d->pc + dc] = v;
                }
        }
}

/* The file holding window g: start[lo] <= g < start[lo + 1]. */
static int file_of(const td_slm_data *s, int64_t g)
{
    int lo = 0, hi = s->n_files - 1;

    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (s->start[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Window g (of train's and valid's numbering) into row r of x, tok, end (and its label); pos >= 0
 * is its position in a training epoch's order, where its caption may be cut (td__slm_cut). */
static int read_window(td_slm_data *s, int64_t g, int64_t pos, int r, float *x, int *tok, int *end,
                       int *label, td_error_t *err)
{
    int lo = file_of(s, g), rc;
    const td_slm_dims *d = &s->d;
    size_t len = 0;
    int32_t lab = -1;

    rc = td_sensor_read(s->f[lo], g - s->start[lo], s->grid, s->caption, &len, &lab, err);
    if (rc != 0)
        return rc;
    td__slm_patchify(s->grid, s->norm, d, x + (size_t)r * d->N * d->P);
    if (pos >= 0) /* cut among the clauses the model reads, so that a cut is always shorter */
        len = td__slm_cut(s->caption, td__slm_fit(s->caption, len, (size_t)(d->L - 1)), s->seed,
                          s->cur.epoch, pos, s->cut);
    td__slm_tokenize(s->caption, len, d->L, tok + (size_t)r * d->L, &end[r]);
    if (label != NULL)
        label[r] = lab;
    return 0;
}

int td__slm_fill(td_slm_data *s, int r0, int r1, float *x, int *tok, int *end, td_error_t *err)
{
    int64_t first = s->cur.batch * s->B;

    for (int r = r0; r < r1; r++) {
        int rc = read_window(s, s->order[first + r], first + r, r - r0, x, tok, end, NULL, err);
        if (rc != 0)
            return rc;
    }
    return 0;
}

void td__slm_fill_labels(const td_slm_data *s, int *labels)
{
    int64_t first = s->cur.batch * s->B;

    for (int r = 0; r < s->B; r++) {
        int64_t g = s->order[first + r];
        int f = file_of(s, g);
        int32_t lab = -1;
        td_error_t e;
        /* labels live in memory: only an index out of range fails, and g is in range */
        if (td_sensor_read(s->f[f], g - s->start[f], NULL, NULL, NULL, &lab, &e) != 0)
            lab = -1;
        labels[r] = lab;
    }
}

int td__slm_valid_fill(td_slm_data *s, int64_t i, int n, float *x, int *tok, int *end, int *labels,
                       td_error_t *err)
{
    if (i < 0 || n < 0 || i + n > s->n_valid)
        return td_error_set(err, TD_EINVAL, "valid windows [%lld, %lld) of %lld", (long long)i,
                            (long long)(i + n), (long long)s->n_valid);
    for (int r = 0; r < n; r++) {
        int rc = read_window(s, s->n_train + i + r, -1, r, x, tok, end, labels, err);
        if (rc != 0)
            return rc;
    }
    return 0;
}
