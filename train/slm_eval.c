/* A sensorlm's evaluation and its embedder (slm.h, train.h): the valid split embedded batch by
 * batch into the arena's bottom (the loss of each batch on the way), then ranked by blocks of
 * dot products downloaded to the host; and a model built from a checkpoint or a trainer that
 * embeds windows and texts on request. Forwards run without a tape on the thread that owns the
 * trainer or the embedder. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/sizes.h"
#include "train/slm.h"
#include "common/td_panic.h"

/* ---- evaluation ---------------------------------------------------------------------------- */

/* The arena's position, to take back everything above it. */
typedef struct mark {
    size_t used;
    int tensors;
} mark;

static mark mark_of(const td_arena *a)
{
    return (mark){a->used, a->n_tensors};
}

static void back_to(td_arena *a, mark m)
{
    a->used = m.used;
    a->n_tensors = m.tensors;
}

/* A batch's inputs of n rows in the arena (td__slm_input_bytes's layout), and where the host
 * builds them: in place on a host backend, in the stage on a device one. */
typedef struct inputs {
    td_tensor *x;
    int *tok, *end;
    float *hx;
    int *htok, *hend;
} inputs;

static inputs take_inputs(td_ctx *c, const td_slm_dims *d, char *stage, int n, int patches)
{
    inputs in = {0};
    size_t xb = td_tensor_bytes((size_t)n * d->N * d->P, 0);
    size_t tb = td_arena_round((size_t)n * d->L * sizeof(int));

    if (patches)
        in.x = td_tensor_new(c, 3, (int[]){n, d->N, d->P}, 0);
    in.tok = td_arena_alloc(c->arena, (size_t)n * d->L * sizeof(int));
    in.end = td_arena_alloc(c->arena, (size_t)n * sizeof(int));
    in.hx = patches ? (stage != NULL ? (float *)stage : in.x->data) : NULL;
    in.htok = stage != NULL ? (int *)(stage + xb) : in.tok;
    in.hend = stage != NULL ? (int *)(stage + xb + tb) : in.end;
    return in;
}

static void upload_inputs(const td_kernels *k, const td_slm_dims *d, const char *stage,
                          const inputs *in, int n)
{
    if (stage == NULL)
        return;
    if (in->x != NULL)
        k->upload(in->x->data, in->hx, (size_t)n * d->N * d->P * sizeof(float));
    k->upload(in->tok, in->htok, (size_t)n * d->L * sizeof(int));
    k->upload(in->end, in->hend, (size_t)n * sizeof(int));
}

/* rows [i, i+n) of t (rows, C), as a header of the caller's (no tape, no gradient). */
static td_tensor rows_of(const td_tensor *t, int64_t i, int n)
{
    int C = t->shape[1];
    td_tensor v = {.data = t->data + i * C, .n = (size_t)n * C, .ndim = 2, .shape = {n, C}};

    return v;
}

/* Embeds valid windows [0, nv) into S and U, batch by batch; returns the loss's sum weighted by
 * each batch's windows. */
static double embed_valid(td_slm_eval *ev, td_ctx *c, td_tensor *S, td_tensor *U)
{
    const td_slm_dims *d = &ev->m->d;
    mark base = mark_of(ev->arena);
    double sum = 0.0;
    td_error_t e = {0};

    for (int64_t i = 0; i < ev->nv; i += ev->B) {
        int n = ev->nv - i < ev->B ? (int)(ev->nv - i) : ev->B;
        td_tensor *s, *u, *dots, *loss;
        float value;
        inputs in;

        back_to(ev->arena, base);
        in = take_inputs(c, d, ev->stage, n, 1);
        if (td__slm_valid_fill(ev->data, i, n, in.hx, in.htok, in.hend, ev->labels + i, &e) != 0)
            td_panic(TD_EDATA, "dataset error in the valid split: %s", e.msg);
        upload_inputs(ev->k, d, ev->stage, &in, n);
        s = td_sensorlm_sensor(c, ev->m, in.x);
        u = td_sensorlm_text(c, ev->m, in.tok, in.end, n);
        dots = td_linear(c, s, u, NULL);
        loss = td_siglip(c, dots, ev->m->logit_scale, ev->m->logit_bias, 0, 1.0f / (float)n);
        ev->k->download(&value, loss->data, sizeof(value));
        sum += (double)value * n;
        ev->k->residual_backward(S->data + i * d->E, NULL, s->data, s->n, 0);
        ev->k->residual_backward(U->data + i * d->E, NULL, u->data, u->n, 0);
    }
    back_to(ev->arena, base);
    return sum;
}

/* The unit mean of each label's prompt embeddings: sum (K, E) holds their sums, normalised in
 * place as the towers normalise (by max(||x||, 1e-12)). */
static void label_means(float *sum, int K, int E)
{
    for (int k = 0; k < K; k++) {
        float *v = sum + (size_t)k * E;
        double nn = 0;
        for (int j = 0; j < E; j++)
            nn += (double)v[j] * v[j];
        float inv = 1.0f / (float)fmax(sqrt(nn), 1e-12);
        for (int j = 0; j < E; j++)
            v[j] *= inv;
    }
}

/* The labels' text embeddings into P (K, E): each label's prompts embedded, B at a time, and
 * their normalised mean. */
static void embed_prompts(td_slm_eval *ev, td_ctx *c, td_tensor *P)
{
    const td_slm_dims *d = &ev->m->d;
    mark base = mark_of(ev->arena);
    float *sum = ev->pemb, *rows = ev->pemb + (size_t)ev->K * d->E;

    memset(sum, 0, (size_t)ev->K * d->E * sizeof(float));
    for (int j = 0; j < ev->NP; j += ev->B) {
        int n = ev->NP - j < ev->B ? ev->NP - j : ev->B;
        inputs in;
        td_tensor *u;

        back_to(ev->arena, base);
        in = take_inputs(c, d, ev->stage, n, 0);
        memcpy(in.htok, ev->ptok + (size_t)j * d->L, (size_t)n * d->L * sizeof(int));
        memcpy(in.hend, ev->pend + j, (size_t)n * sizeof(int));
        upload_inputs(ev->k, d, ev->stage, &in, n);
        u = td_sensorlm_text(c, ev->m, in.tok, in.end, n);
        ev->k->download(rows, u->data, u->n * sizeof(float));
        for (int r = 0; r < n; r++) {
            float *to = sum + (size_t)ev->pof[j + r] * d->E;
            for (int e = 0; e < d->E; e++)
                to[e] += rows[(size_t)r * d->E + e];
        }
    }
    back_to(ev->arena, base);
    label_means(sum, ev->K, d->E);
    ev->k->upload(P->data, sum, (size_t)ev->K * d->E * sizeof(float));
}

/* Rows [i, i+n) of A against every row of Bt: the (n, rows of Bt) dot products, downloaded
 * into ev->sims. */
static const float *scores(td_slm_eval *ev, td_ctx *c, const td_tensor *A, td_tensor *Bt, int64_t i,
                           int n)
{
    mark base = mark_of(ev->arena);
    td_tensor blk = rows_of(A, i, n), *s = td_linear(c, &blk, Bt, NULL);

    ev->k->download(ev->sims, s->data, s->n * sizeof(float));
    back_to(ev->arena, base);
    return ev->sims;
}

/* How many of row's cols entries other than self score at least as high as self's. */
static int64_t rank_of(const float *row, int64_t cols, int64_t self)
{
    int64_t r = 0;

    for (int64_t j = 0; j < cols; j++)
        r += j != self && row[j] >= row[self];
    return r;
}

/* The first of the largest of row's n entries. */
static int argmax(const float *row, int n)
{
    int best = 0;

    for (int j = 1; j < n; j++)
        best = row[j] > row[best] ? j : best;
    return best;
}

void td__slm_evaluate(td_slm_eval *ev, td_slm_metrics *out)
{
    td_ctx c = {.k = ev->k, .arena = ev->arena, .tape = NULL};
    int E = ev->m->d.E;
    td_tensor *S, *U, *P = NULL;
    int64_t r1 = 0, r5 = 0, t1 = 0, zs = 0, labelled = 0;

    td_arena_reset(ev->arena);
    S = td_tensor_new(&c, 2, (int[]){(int)ev->nv, E}, 0);
    U = td_tensor_new(&c, 2, (int[]){(int)ev->nv, E}, 0);
    ev->k->zero(S->data, S->n);
    ev->k->zero(U->data, U->n);
    if (ev->K > 0) {
        P = td_tensor_new(&c, 2, (int[]){ev->K, E}, 0);
        ev->k->zero(P->data, P->n);
    }
    out->valid_loss = embed_valid(ev, &c, S, U) / (double)ev->nv;
    if (P != NULL)
        embed_prompts(ev, &c, P);
    for (int64_t i = 0; i < ev->nv; i += ev->B) {
        int n = ev->nv - i < ev->B ? (int)(ev->nv - i) : ev->B;
        const float *sim = scores(ev, &c, S, U, i, n);
        for (int r = 0; r < n; r++) {
            int64_t rank = rank_of(sim + (size_t)r * ev->nv, ev->nv, i + r);
            r1 += rank < 1;
            r5 += rank < 5;
        }
        sim = scores(ev, &c, U, S, i, n);
        for (int r = 0; r < n; r++)
            t1 += rank_of(sim + (size_t)r * ev->nv, ev->nv, i + r) < 1;
        if (P == NULL)
            continue;
        sim = scores(ev, &c, S, P, i, n);
        for (int r = 0; r < n; r++) {
            int label = ev->labels[i + r];
            labelled += label >= 0;
            zs += label >= 0 && argmax(sim + (size_t)r * ev->K, ev->K) == label;
        }
    }
    out->recall_at_1 = (double)r1 / (double)ev->nv;
    out->recall_at_5 = (double)r5 / (double)ev->nv;
    out->text_recall_at_1 = (double)t1 / (double)ev->nv;
    out->zeroshot_accuracy = labelled > 0 ? (double)zs / (double)labelled : NAN;
}

/* ---- the embedder ---------------------------------------------------------------------------- */

struct td_sensorlm_embedder {
    td_sensorlm *m;
    td_params p;
    td_arena arena;
    const td_kernels *k;
    char *stage; /* a device backend's inputs, built on the host; NULL on a host backend */
    float *norm; /* (2C) */
    int rows;    /* windows or texts per forward */
    int64_t step;
};

/* Everything but the parameters' values: the model declared, its buffers (host), the arena
 * and stage for rows, the statistics. */
static int embedder_alloc(td_sensorlm_embedder **out, const td_train_config *cfg,
                          const td_slm_dims *d, int rows, td_error_t *err)
{
    td_sensorlm_embedder *e = calloc(1, sizeof(*e));
    size_t in, a, b;
    int rc;

    *out = NULL;
    if (e == NULL || (e->m = calloc(1, sizeof(*e->m))) == NULL) {
        free(e);
        return td_error_set(err, TD_ENOMEM, "no memory for an embedder");
    }
    *out = e;
    e->k = cfg->kernels != NULL ? cfg->kernels : td_kernels_cpu();
    e->rows = rows > 0 ? rows : TD_SLM_EMBED_ROWS;
    if ((rc = td_sensorlm_declare(e->m, &e->p, d, err)) != 0)
        return rc;
    e->m->attn_chunk = cfg->attn_chunk;
    if (td_params_alloc(&e->p, 0) != 0)
        return td_error_set(err, TD_ENOMEM, "no memory for %zu parameters", e->p.n);
    in = td__slm_input_bytes(d, e->rows);
    a = td_sensorlm_embed_bytes(e->m, e->rows, 1, 0, 0);
    b = td_sensorlm_embed_bytes(e->m, e->rows, 0, 1, 0);
    if ((rc = td_arena_init_on(&e->arena, in + (a > b ? a : b), e->k, err)) != 0)
        return rc;
    if (!e->k->host && (e->stage = aligned_alloc(TD_ARENA_ALIGN, td_arena_round(in))) == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for an embedder's stage");
    if ((e->norm = malloc(2 * (size_t)d->C * sizeof(float))) == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for an embedder");
    return 0;
}

/* The host parameters to where the embedder computes, under a boundary of its own. */
static int embedder_place(td_sensorlm_embedder *e, td_error_t *err)
{
    td_boundary b;
    int rc;

    td_boundary_enter(&b);
    if (TD_CAUGHT(&b)) {
        *err = b.err;
        return err->code;
    }
    rc = td_params_place(&e->p, e->k, err);
    td_boundary_leave(&b);
    return rc;
}

int td__slm_embedder_new(td_sensorlm_embedder **out, const td_train_config *cfg,
                         const td_slm_dims *d, const float *params, size_t n, const float *norm,
                         int64_t step, int rows, td_error_t *err)
{
    int rc = embedder_alloc(out, cfg, d, rows, err);

    if (rc == 0 && n != (*out)->p.n)
        rc = td_error_set(err, TD_ESHAPE, "embedder: %zu parameters given, the model has %zu", n,
                          (*out)->p.n);
    if (rc == 0) {
        memcpy((*out)->p.host_data, params, n * sizeof(float));
        memcpy((*out)->norm, norm, 2 * (size_t)d->C * sizeof(float));
        (*out)->step = step;
        rc = embedder_place(*out, err);
    }
    if (rc != 0) {
        td_sensorlm_embedder_free(*out);
        *out = NULL;
    }
    return rc;
}

int td_sensorlm_embedder_open(td_sensorlm_embedder **out, const td_train_config *cfg, int rows,
                              td_error_t *err)
{
    td_sensorlm *m = calloc(1, sizeof(*m));
    td_params p = {0};
    float *norm = NULL;
    int64_t step = 0;
    int rc;

    *out = NULL;
    if (m == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for an embedder");
    rc = td__train_load_sensorlm(cfg, m, &p, &step, &norm, err);
    if (rc == 0)
        rc = td__slm_embedder_new(out, cfg, &m->d, p.host_data, p.n, norm, step, rows, err);
    td_params_free(&p);
    free(norm);
    free(m);
    return rc;
}

void td_sensorlm_embedder_free(td_sensorlm_embedder *e)
{
    if (e == NULL)
        return;
    td_arena_free(&e->arena);
    td_params_free(&e->p);
    free(e->stage);
    free(e->norm);
    free(e->m);
    free(e);
}

void td_sensorlm_embedder_info(const td_sensorlm_embedder *e, td_sensorlm_info *info)
{
    const td_slm_dims *d = &e->m->d;

    info->time_steps = d->T;
    info->channels = d->C;
    info->embed_dim = d->E;
    info->text_len = d->L;
    info->step = e->step;
    info->mean = e->norm;
    info->std = e->norm + d->C;
}

/* One forward of n rows: windows (grids, n of (T,C)) or texts. */
static void embed_rows(td_sensorlm_embedder *e, const float *grids, const char *const *texts, int n,
                       float *out)
{
    const td_slm_dims *d = &e->m->d;
    td_ctx c = {.k = e->k, .arena = &e->arena, .tape = NULL};
    inputs in;
    td_tensor *y;

    td_arena_reset(&e->arena);
    in = take_inputs(&c, d, e->stage, n, grids != NULL);
    for (int r = 0; r < n; r++) {
        if (grids != NULL)
            td__slm_patchify(grids + (size_t)r * d->T * d->C, e->norm, d,
                             in.hx + (size_t)r * d->N * d->P);
        else
            td__slm_tokenize(texts[r], strlen(texts[r]), d->L, in.htok + (size_t)r * d->L,
                             &in.hend[r]);
    }
    for (int r = 0; r < n && grids != NULL; r++) /* unused by the sensor tower; defined bytes */
        in.hend[r] = 0;
    if (grids != NULL)
        memset(in.htok, 0, (size_t)n * d->L * sizeof(int));
    upload_inputs(e->k, d, e->stage, &in, n);
    y = grids != NULL ? td_sensorlm_sensor(&c, e->m, in.x)
                      : td_sensorlm_text(&c, e->m, in.tok, in.end, n);
    e->k->download(out, y->data, y->n * sizeof(float));
}

/* Every row, e->rows at a time, under a boundary: a device error is returned. */
static int embed_all(td_sensorlm_embedder *e, const float *grids, const char *const *texts, int n,
                     float *out, td_error_t *err)
{
    const td_slm_dims *d = &e->m->d;
    td_boundary b;

    if (n < 0 || (n > 0 && out == NULL))
        return td_error_set(err, TD_EINVAL, "embed: %d rows, out %p", n, (void *)out);
    td_boundary_enter(&b);
    if (TD_CAUGHT(&b)) {
        *err = b.err;
        return err->code;
    }
    for (int i = 0; i < n; i += e->rows) {
        int k = n - i < e->rows ? n - i : e->rows;
        embed_rows(e, grids != NULL ? grids + (size_t)i * d->T * d->C : NULL,
                   texts != NULL ? texts + i : NULL, k, out + (size_t)i * d->E);
    }
    td_boundary_leave(&b);
    return 0;
}

int td_sensorlm_embed_windows(td_sensorlm_embedder *e, const float *grids, int n, float *out,
                              td_error_t *err)
{
    if (grids == NULL && n > 0)
        return td_error_set(err, TD_EINVAL, "embed: no windows");
    return embed_all(e, grids, NULL, n, out, err);
}

int td_sensorlm_embed_texts(td_sensorlm_embedder *e, const char *const *texts, int n, float *out,
                            td_error_t *err)
{
    if (texts == NULL && n > 0)
        return td_error_set(err, TD_EINVAL, "embed: no texts");
    for (int i = 0; i < n; i++)
        if (texts[i] == NULL)
            return td_error_set(err, TD_EINVAL, "embed: text %d is NULL", i);
    return embed_all(e, NULL, texts, n, out, err);
}

int td_sensorlm_embed_labels(td_sensorlm_embedder *e, const char *const *prompts, int n, float *out,
                             td_error_t *err)
{
    int off[TD_SLM_MAX_PROMPTS], len[TD_SLM_MAX_PROMPTS], np = 0, E = e->m->d.E, rc = 0;
    char **parts;
    int *of;
    float *u;

    if (prompts == NULL && n > 0)
        return td_error_set(err, TD_EINVAL, "embed: no prompts");
    for (int k = 0; k < n; k++) {
        if (prompts[k] == NULL)
            return td_error_set(err, TD_EINVAL, "embed: label %d has no prompt", k);
        int m = td__slm_prompt_parts(prompts[k], off, len, TD_SLM_MAX_PROMPTS);
        np += m > 0 ? m : 1;
    }
    parts = calloc((size_t)(np > 0 ? np : 1), sizeof(char *));
    of = malloc((size_t)(np > 0 ? np : 1) * sizeof(int));
    u = malloc((size_t)(np > 0 ? np : 1) * E * sizeof(float));
    if (parts == NULL || of == NULL || u == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "embed: no memory for %d prompts", np);
        goto done;
    }
    np = 0;
    for (int k = 0; k < n; k++) {
        int m = td__slm_prompt_parts(prompts[k], off, len, TD_SLM_MAX_PROMPTS);
        if (m == 0) { /* nothing but '|': embedded as it is */
            off[0] = 0;
            len[0] = (int)strlen(prompts[k]);
            m = 1;
        }
        for (int i = 0; i < m; i++, np++) {
            of[np] = k;
            if ((parts[np] = strndup(prompts[k] + off[i], (size_t)len[i])) == NULL) {
                rc = td_error_set(err, TD_ENOMEM, "embed: no memory for %d prompts", np);
                goto done;
            }
        }
    }
    if ((rc = embed_all(e, NULL, (const char *const *)parts, np, u, err)) != 0)
        goto done;
    memset(out, 0, (size_t)n * E * sizeof(float));
    for (int p = 0; p < np; p++)
        for (int j = 0; j < E; j++)
            out[(size_t)of[p] * E + j] += u[(size_t)p * E + j];
    label_means(out, n, E);
done:
    for (int p = 0; parts != NULL && p < np; p++)
        free(parts[p]);
    free(parts);
    free(of);
    free(u);
    return rc;
}
