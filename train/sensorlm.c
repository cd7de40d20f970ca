/* SensorLM written as forward passes over the engine's ops (its backward is what the ops record
 * on the tape): the presets and the job's keys resolved into dimensions, the parameters
 * declared in the README's order under their export names, the initialisation, the sensor
 * tower (a ViT over patches, pooled by a MAP head or the tokens' mean), the text tower (a causal
 * transformer over bytes, read at the end token), SigLIP's loss over the (gathered) batch, and
 * the model's own count of the arena bytes, tape entries and FLOPs a step takes. README.md
 * ("SensorLM") is the reference every line here answers to. Used by the thread that owns the
 * trainer (or an embedder). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "train/engine.h"
#include "train/sensor.h"
#include "common/td_panic.h"

#define INIT_STD   0.02              /* every linear weight, tok, pos and the probe: N(0, 0.02) */
#define INIT_SCALE 2.302585092994046 /* logit_scale: ln 10 */
#define INIT_BIAS  -10.0             /* logit_bias */

#define DEFAULT_PATCH_T 10 /* model.sensor.patch_t */
#define DEFAULT_PATCH_C 2  /* model.sensor.patch_c */
#define DEFAULT_L       64 /* model.text.text_len */

#define DIM_MAX_D   (1 << 14) /* a tower's width */
#define DIM_MAX_M   (1 << 16) /* a tower's MLP width */
#define DIM_MAX_E   (1 << 14) /* the embedding */
#define DIM_MAX_N   (1 << 16) /* tokens of a window */
#define DIM_MAX_P   (1 << 16) /* floats of a patch */
#define DIM_MAX_L   4096      /* text tokens: a shard's longest caption slot */
#define DIM_MAX_PCH 64        /* channels of a patch */

/* ---- dimensions --------------------------------------------------------------------------- */

void td_slm_preset(td_slm_size size, td_slm_tower *tower, int *E)
{
    static const td_slm_tower presets[] = {
        [TD_SLM_TINY] = {64, 2, 4, 256},
        [TD_SLM_SMALL] = {256, 6, 4, 1024},
        [TD_SLM_BASE] = {768, 12, 12, 3072},
    };
    int i = size == TD_SLM_SMALL || size == TD_SLM_BASE ? (int)size : (int)TD_SLM_TINY;

    *tower = presets[i];
    *E = presets[i].D;
}

/* v when the job gives it (non-zero), else the default. */
static int or_default(int v, int def)
{
    return v != 0 ? v : def;
}

int td_slm_dims_of(const td_sensorlm_config *cfg, int T, int C, td_slm_dims *d, td_error_t *err)
{
    td_slm_tower pre;
    int E;

    td_slm_preset(cfg->size, &pre, &E);
    memset(d, 0, sizeof(*d));
    d->T = T;
    d->C = C;
    d->pt = or_default(cfg->patch_t, DEFAULT_PATCH_T);
    d->pc = or_default(cfg->patch_c, DEFAULT_PATCH_C);
    d->L = or_default(cfg->text_len, DEFAULT_L);
    d->E = or_default(cfg->embed_dim, E);
    d->pool = cfg->pool;
    d->s = (td_slm_tower){or_default(cfg->s_width, pre.D), or_default(cfg->s_depth, pre.depth),
                          or_default(cfg->s_heads, pre.H), or_default(cfg->s_mlp, pre.M)};
    d->t = (td_slm_tower){or_default(cfg->t_width, pre.D), or_default(cfg->t_depth, pre.depth),
                          or_default(cfg->t_heads, pre.H), or_default(cfg->t_mlp, pre.M)};
    /* the derived sizes only from sizes within their limits; td_slm_check_dims names the rest */
    if (d->pt >= 1 && d->pt <= d->T && d->T <= TD_SENSOR_MAX_T && d->pc >= 1 &&
        d->pc <= DIM_MAX_PCH && d->C >= 1 && d->C <= TD_SENSOR_MAX_CHANNELS) {
        int64_t n;
        d->Cp = (d->C + d->pc - 1) / d->pc * d->pc;
        n = (int64_t)(d->T / d->pt) * (d->Cp / d->pc);
        d->N = n > DIM_MAX_N ? DIM_MAX_N + 1 : (int)n;
        d->P = d->pt * d->pc;
    }
    return td_slm_check_dims(d, err);
}

/* One tower's dimensions against the limits; key is "sensor" or "text". */
static int check_tower(const td_slm_tower *t, const char *key, td_error_t *err)
{
    if (t->depth < 1 || t->depth > TD_SLM_MAX_DEPTH)
        return td_error_set(err, TD_EINVAL, "model.%s.depth: %d, must be 1 to %d", key, t->depth,
                            TD_SLM_MAX_DEPTH);
    if (t->H < 1 || t->H > t->D)
        return td_error_set(err, TD_EINVAL, "model.%s.n_head: %d, must be 1 to d_model %d", key,
                            t->H, t->D);
    if (t->D < 1 || t->D > DIM_MAX_D || t->D % t->H != 0)
        return td_error_set(err, TD_EINVAL,
                            "model.%s.d_model: %d, must be 1 to %d and a multiple of n_head %d",
                            key, t->D, DIM_MAX_D, t->H);
    if (t->M < 1 || t->M > DIM_MAX_M)
        return td_error_set(err, TD_EINVAL, "model.%s.mlp_dim: %d, must be 1 to %d", key, t->M,
                            DIM_MAX_M);
    return 0;
}

int td_slm_check_dims(const td_slm_dims *d, td_error_t *err)
{
    int rc;

    if (d->T < 1 || d->T > TD_SENSOR_MAX_T)
        return td_error_set(err, TD_EINVAL, "model.sensor.time_steps: %d, must be 1 to %d", d->T,
                            TD_SENSOR_MAX_T);
    if (d->C < 1 || d->C > TD_SENSOR_MAX_CHANNELS)
        return td_error_set(err, TD_EINVAL, "model.sensor.channels: %d, must be 1 to %d", d->C,
                            TD_SENSOR_MAX_CHANNELS);
    if (d->pt < 1 || d->pt > d->T || d->T % d->pt != 0)
        return td_error_set(err, TD_EINVAL,
                            "model.sensor.patch_t: %d does not divide time_steps %d (a window "
                            "must be whole patches)",
                            d->pt, d->T);
    if (d->pc < 1 || d->pc > DIM_MAX_PCH)
        return td_error_set(err, TD_EINVAL, "model.sensor.patch_c: %d, must be 1 to %d", d->pc,
                            DIM_MAX_PCH);
    if (d->N < 1 || d->N > DIM_MAX_N || d->P > DIM_MAX_P)
        return td_error_set(err, TD_EINVAL,
                            "model.sensor: patches of %d x %d over %d x %d make %d tokens of %d "
                            "floats; at most %d tokens of %d",
                            d->pt, d->pc, d->T, d->C, d->N, d->P, DIM_MAX_N, DIM_MAX_P);
    if ((rc = check_tower(&d->s, "sensor", err)) != 0 || (rc = check_tower(&d->t, "text", err)))
        return rc;
    if (d->pool != TD_SLM_POOL_MAP && d->pool != TD_SLM_POOL_GAP)
        return td_error_set(err, TD_EINVAL, "model.sensor.pool: unknown pooling %d", (int)d->pool);
    if (d->L < 2 || d->L > DIM_MAX_L)
        return td_error_set(err, TD_EINVAL,
                            "model.text.text_len: %d, must be 2 to %d (a byte and the end token)",
                            d->L, DIM_MAX_L);
    if (d->E < 1 || d->E > DIM_MAX_E)
        return td_error_set(err, TD_EINVAL, "model.embed_dim: %d, must be 1 to %d", d->E,
                            DIM_MAX_E);
    return 0;
}

/* ---- parameters --------------------------------------------------------------------------- */

/* Declares the next tensor, named, and returns it; *rc keeps the first error. */
static td_tensor *decl(td_sensorlm *m, td_params *p, int *rc, const char *name, int ndim, int d0,
                       int d1)
{
    td_tensor *t;

    if (*rc != 0 || m->n >= TD_SLM_MAX_TENSORS) {
        *rc = TD_E2BIG;
        return &m->p[0];
    }
    t = &m->p[m->n];
    snprintf(m->name[m->n], TD_SLM_NAME_MAX, "%s", name);
    *rc = td_params_declare(p, t, ndim, (int[]){d0, d1});
    m->n++;
    return t;
}

/* A block's twelve tensors under prefix ("sensor.blocks.3"). */
static void decl_block(td_sensorlm *m, td_params *p, int *rc, td_slm_block *b, const char *prefix,
                       const td_slm_tower *t)
{
    char n[TD_SLM_NAME_MAX];
    int D = t->D, M = t->M;

#define NAME(s) (snprintf(n, sizeof(n), "%s.%s", prefix, s), n)
    b->ln1_w = decl(m, p, rc, NAME("ln1.weight"), 1, D, 0);
    b->ln1_b = decl(m, p, rc, NAME("ln1.bias"), 1, D, 0);
    b->qkv_w = decl(m, p, rc, NAME("attn.qkv.weight"), 2, 3 * D, D);
    b->qkv_b = decl(m, p, rc, NAME("attn.qkv.bias"), 1, 3 * D, 0);
    b->out_w = decl(m, p, rc, NAME("attn.out.weight"), 2, D, D);
    b->out_b = decl(m, p, rc, NAME("attn.out.bias"), 1, D, 0);
    b->ln2_w = decl(m, p, rc, NAME("ln2.weight"), 1, D, 0);
    b->ln2_b = decl(m, p, rc, NAME("ln2.bias"), 1, D, 0);
    b->fc1_w = decl(m, p, rc, NAME("mlp.fc1.weight"), 2, M, D);
    b->fc1_b = decl(m, p, rc, NAME("mlp.fc1.bias"), 1, M, 0);
    b->fc2_w = decl(m, p, rc, NAME("mlp.fc2.weight"), 2, D, M);
    b->fc2_b = decl(m, p, rc, NAME("mlp.fc2.bias"), 1, D, 0);
#undef NAME
}

static void decl_sensor(td_sensorlm *m, td_params *p, int *rc)
{
    const td_slm_dims *d = &m->d;
    int D = d->s.D, M = d->s.M;
    char prefix[32];

    m->s.patch_w = decl(m, p, rc, "sensor.patch.weight", 2, D, d->P);
    m->s.patch_b = decl(m, p, rc, "sensor.patch.bias", 1, D, 0);
    m->s.pos = decl(m, p, rc, "sensor.pos", 2, d->N, D);
    for (int l = 0; l < d->s.depth; l++) {
        snprintf(prefix, sizeof(prefix), "sensor.blocks.%d", l);
        decl_block(m, p, rc, &m->s.blk[l], prefix, &d->s);
    }
    m->s.lnf_w = decl(m, p, rc, "sensor.ln_f.weight", 1, D, 0);
    m->s.lnf_b = decl(m, p, rc, "sensor.ln_f.bias", 1, D, 0);
    if (d->pool == TD_SLM_POOL_MAP) {
        m->s.probe = decl(m, p, rc, "sensor.map.probe", 1, D, 0);
        m->s.q_w = decl(m, p, rc, "sensor.map.q.weight", 2, D, D);
        m->s.q_b = decl(m, p, rc, "sensor.map.q.bias", 1, D, 0);
        m->s.k_w = decl(m, p, rc, "sensor.map.k.weight", 2, D, D);
        m->s.k_b = decl(m, p, rc, "sensor.map.k.bias", 1, D, 0);
        m->s.v_w = decl(m, p, rc, "sensor.map.v.weight", 2, D, D);
        m->s.v_b = decl(m, p, rc, "sensor.map.v.bias", 1, D, 0);
        m->s.o_w = decl(m, p, rc, "sensor.map.out.weight", 2, D, D);
        m->s.o_b = decl(m, p, rc, "sensor.map.out.bias", 1, D, 0);
        m->s.ln_w = decl(m, p, rc, "sensor.map.ln.weight", 1, D, 0);
        m->s.ln_b = decl(m, p, rc, "sensor.map.ln.bias", 1, D, 0);
        m->s.fc1_w = decl(m, p, rc, "sensor.map.mlp.fc1.weight", 2, M, D);
        m->s.fc1_b = decl(m, p, rc, "sensor.map.mlp.fc1.bias", 1, M, 0);
        m->s.fc2_w = decl(m, p, rc, "sensor.map.mlp.fc2.weight", 2, D, M);
        m->s.fc2_b = decl(m, p, rc, "sensor.map.mlp.fc2.bias", 1, D, 0);
    }
    m->s.proj = decl(m, p, rc, "sensor.proj.weight", 2, d->E, D);
}

static void decl_text(td_sensorlm *m, td_params *p, int *rc)
{
    const td_slm_dims *d = &m->d;
    char prefix[32];

    m->t.tok = decl(m, p, rc, "text.tok", 2, TD_SLM_VOCAB, d->t.D);
    m->t.pos = decl(m, p, rc, "text.pos", 2, d->L, d->t.D);
    for (int l = 0; l < d->t.depth; l++) {
        snprintf(prefix, sizeof(prefix), "text.blocks.%d", l);
        decl_block(m, p, rc, &m->t.blk[l], prefix, &d->t);
    }
    m->t.lnf_w = decl(m, p, rc, "text.ln_f.weight", 1, d->t.D, 0);
    m->t.lnf_b = decl(m, p, rc, "text.ln_f.bias", 1, d->t.D, 0);
    m->t.proj = decl(m, p, rc, "text.proj.weight", 2, d->E, d->t.D);
}

int td_sensorlm_declare(td_sensorlm *m, td_params *p, const td_slm_dims *d, td_error_t *err)
{
    int rc = td_slm_check_dims(d, err);

    if (rc != 0)
        return rc;
    memset(m, 0, sizeof(*m));
    m->d = *d;
    decl_sensor(m, p, &rc);
    decl_text(m, p, &rc);
    m->logit_scale = decl(m, p, &rc, "logit_scale", 1, 1, 0);
    m->logit_bias = decl(m, p, &rc, "logit_bias", 1, 1, 0);
    if (rc != 0)
        return td_error_set(err, rc, "model: %d parameter tensors do not fit in td_params (%d)",
                            m->n, TD_PARAMS_MAX);
    return 0;
}

size_t td_sensorlm_num_params(const td_slm_dims *d)
{
    const td_slm_tower *s = &d->s, *t = &d->t;
    size_t sb = 4 * (size_t)s->D * s->D + 2 * (size_t)s->D * s->M + 9 * (size_t)s->D + s->M;
    size_t tb = 4 * (size_t)t->D * t->D + 2 * (size_t)t->D * t->M + 9 * (size_t)t->D + t->M;
    size_t n = (size_t)s->D * d->P + s->D + (size_t)d->N * s->D + s->depth * sb + 2 * (size_t)s->D;

    if (d->pool == TD_SLM_POOL_MAP)
        n += s->D + 4 * ((size_t)s->D * s->D + s->D) + 2 * (size_t)s->D + 2 * (size_t)s->D * s->M +
             s->M + s->D;
    n += (size_t)d->E * s->D;
    n += (size_t)TD_SLM_VOCAB * t->D + (size_t)d->L * t->D + t->depth * tb + 2 * (size_t)t->D;
    return n + (size_t)d->E * t->D + 2;
}

/* One N(0, std) draw: Box-Muller on two uniforms of 53 bits, in double (as gpt.c's). */
static float normal(td_rng *r, double std)
{
    double u1 = ((double)(td_rng_next(r) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
    double u2 = (double)(td_rng_next(r) >> 11) * 0x1p-53;
    return (float)(std * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

/* Whether name ends with suffix. */
static int ends_with(const char *name, const char *suffix)
{
    size_t n = strlen(name), k = strlen(suffix);
    return n >= k && strcmp(name + n - k, suffix) == 0;
}

/* What a tensor starts as, from its name (README.md's initialisation): LayerNorm weights 1. */
static int is_ones(const char *name)
{
    return ends_with(name, "ln1.weight") || ends_with(name, "ln2.weight") ||
           ends_with(name, "ln_f.weight") || ends_with(name, "map.ln.weight");
}

/* Every other weight (the linear ones), the tables and the probe: N(0, 0.02). */
static int is_normal(const char *name)
{
    return (ends_with(name, ".weight") && !is_ones(name)) || ends_with(name, ".pos") ||
           strcmp(name, "text.tok") == 0 || strcmp(name, "sensor.map.probe") == 0;
}

void td_sensorlm_init(td_sensorlm *m, uint64_t seed)
{
    td_rng rng;

    td_rng_seed(&rng, seed, 1);
    for (int i = 0; i < m->n; i++) {
        td_tensor *t = &m->p[i];
        const char *name = m->name[i];
        for (size_t j = 0; j < t->n; j++)
            t->data[j] = 0.0f;
        if (is_ones(name))
            for (size_t j = 0; j < t->n; j++)
                t->data[j] = 1.0f;
        else if (is_normal(name))
            for (size_t j = 0; j < t->n; j++)
                t->data[j] = normal(&rng, INIT_STD);
    }
    m->logit_scale->data[0] = (float)INIT_SCALE;
    m->logit_bias->data[0] = (float)INIT_BIAS;
}

/* ---- the forward -------------------------------------------------------------------------- */

/* Block b of a residual stream x (B,N,D): x + out(attention(qkv(ln1(x)))), then
 * + fc2(gelu(fc1(ln2(.)))). */
static td_tensor *block(td_ctx *c, const td_slm_block *b, td_tensor *x, int H, int causal,
                        int chunk)
{
    td_tensor *h, *x2;

    h = td_layernorm(c, x, b->ln1_w, b->ln1_b);
    h = td_linear(c, h, b->qkv_w, b->qkv_b);         /* (B,N,3D) */
    h = td_attention_packed(c, h, H, causal, chunk); /* (B,N,D) */
    h = td_linear(c, h, b->out_w, b->out_b);
    h = td_residual_layernorm(c, x, h, b->ln2_w, b->ln2_b, &x2); /* x2 = x + h, ln2(x2) */
    h = td_linear(c, h, b->fc1_w, b->fc1_b);                     /* (B,N,M) */
    h = td_gelu(c, h);
    h = td_linear(c, h, b->fc2_w, b->fc2_b); /* (B,N,D) */
    return td_residual(c, x2, h);
}

/* The MAP head: the probe's query against every token of h (B,N,D), then an MLP on the
 * residual -> (B,D). */
static td_tensor *map_pool(td_ctx *c, td_sensorlm *m, td_tensor *h)
{
    int B = h->shape[0], D = m->d.s.D;
    td_tensor *q, *k, *v, *y, *f;

    q = td_linear(c, td_view(c, m->s.probe, 2, (int[]){1, D}), m->s.q_w, m->s.q_b); /* (1,D) */
    q = td_repeat(c, q, B);                                                         /* (B,1,D) */
    k = td_linear(c, h, m->s.k_w, m->s.k_b);                                        /* (B,N,D) */
    v = td_linear(c, h, m->s.v_w, m->s.v_b);
    y = td_attention_qkv(c, q, k, v, m->d.s.H, 0, m->attn_chunk); /* (B,1,D) */
    y = td_linear(c, y, m->s.o_w, m->s.o_b);
    f = td_layernorm(c, y, m->s.ln_w, m->s.ln_b);
    f = td_linear(c, f, m->s.fc1_w, m->s.fc1_b);
    f = td_gelu(c, f);
    f = td_linear(c, f, m->s.fc2_w, m->s.fc2_b);
    y = td_residual(c, y, f);
    return td_view(c, y, 2, (int[]){B, D});
}

td_tensor *td_sensorlm_sensor(td_ctx *c, td_sensorlm *m, td_tensor *patches)
{
    const td_slm_dims *d = &m->d;
    td_tensor *h, *y;

    if (patches->ndim != 3 || patches->shape[1] != d->N || patches->shape[2] != d->P)
        td_panic(TD_ESHAPE, "sensorlm: patches (%d,%d,%d), the model takes (B,%d,%d)",
                 patches->shape[0], patches->shape[1], patches->shape[2], d->N, d->P);
    h = td_linear(c, patches, m->s.patch_w, m->s.patch_b); /* (B,N,D) */
    h = td_add_broadcast(c, h, m->s.pos);
    for (int l = 0; l < d->s.depth; l++)
        h = block(c, &m->s.blk[l], h, d->s.H, 0, m->attn_chunk);
    h = td_layernorm(c, h, m->s.lnf_w, m->s.lnf_b);
    y = d->pool == TD_SLM_POOL_MAP ? map_pool(c, m, h) : td_token_mean(c, h); /* (B,D) */
    return td_l2norm(c, td_linear(c, y, m->s.proj, NULL));                    /* (B,E) */
}

td_tensor *td_sensorlm_text(td_ctx *c, td_sensorlm *m, const int *tokens, const int *end, int B)
{
    const td_slm_dims *d = &m->d;
    td_tensor *h = td_embed(c, tokens, B, d->L, m->t.tok, m->t.pos); /* (B,L,D) */

    for (int l = 0; l < d->t.depth; l++)
        h = block(c, &m->t.blk[l], h, d->t.H, 1, m->attn_chunk);
    h = td_layernorm(c, h, m->t.lnf_w, m->t.lnf_b);
    h = td_gather_rows(c, h, end);                         /* (B,D) */
    return td_l2norm(c, td_linear(c, h, m->t.proj, NULL)); /* (B,E) */
}

td_tensor *td_sensorlm_loss(td_ctx *c, td_sensorlm *m, td_tensor *s, td_tensor *u, int rows,
                            int row0)
{
    return td_sensorlm_loss_masked(c, m, s, u, NULL, rows, row0);
}

td_tensor *td_sensorlm_loss_masked(td_ctx *c, td_sensorlm *m, td_tensor *s, td_tensor *u,
                                   const int *labels, int rows, int row0)
{
    int world = c->world > 1 ? c->world : 1;
    td_tensor *all = world > 1 ? td_allgather_rows(c, u, rows, row0) : u; /* (rows,E) */
    td_tensor *dots = td_linear(c, s, all, NULL);                         /* (B,rows) */

    return td_siglip_weighted(c, dots, m->logit_scale, m->logit_bias, labels, m->same_label_weight,
                              row0, (float)world / (float)rows);
}

/* ---- the model's own counts --------------------------------------------------------------- */

/* A forward's arena, as its ops take it: used grows by each allocation; peak is the most ever
 * in use, the forward attention's transient block on top; bwd the largest backward block. */
typedef struct tally {
    size_t used, peak, bwd, attn;
    int train;
} tally;

static void take(tally *a, size_t bytes)
{
    a->used += bytes;
    a->peak = a->used > a->peak ? a->used : a->peak;
}

static size_t act(const tally *a, size_t n)
{
    return td_tensor_bytes(n, a->train);
}

static void tally_attention(tally *a, int chunk, int B, int H, int Nq, int Nk, int C)
{
    size_t fwd = td_op_bytes_attention_scratch(B, H, Nq, Nk, chunk, 0);
    size_t bwd = td_op_bytes_attention_scratch(B, H, Nq, Nk, chunk, 1);
    size_t kept = td_op_bytes_attention(B, Nq, C, H, a->train);

    take(a, kept);
    a->peak = a->used + fwd > a->peak ? a->used + fwd : a->peak;
    a->bwd = bwd > a->bwd ? bwd : a->bwd;
    a->attn += td_tensor_bytes((size_t)B * H * Nq, 0); /* the log-sum-exps */
}

/* block()'s allocations over rows (B,N). */
static void tally_block(tally *a, const td_slm_tower *t, int chunk, int B, int N)
{
    size_t rows = (size_t)B * N, D = (size_t)t->D;

    take(a, td_op_bytes_layernorm(rows, t->D, a->train));
    take(a, act(a, rows * 3 * D)); /* qkv */
    tally_attention(a, chunk, B, t->H, N, N, t->D);
    take(a, act(a, rows * D)); /* out */
    take(a, act(a, rows * D)); /* residual */
    take(a, td_op_bytes_layernorm(rows, t->D, a->train));
    take(a, 2 * act(a, rows * (size_t)t->M)); /* fc1, gelu */
    take(a, 2 * act(a, rows * D));            /* fc2, residual */
}

static void tally_sensor(tally *a, const td_sensorlm *m, int B)
{
    const td_slm_dims *d = &m->d;
    size_t D = (size_t)d->s.D, rows = (size_t)B * d->N;

    take(a, 2 * act(a, rows * D)); /* patch, + pos */
    for (int l = 0; l < d->s.depth; l++)
        tally_block(a, &d->s, m->attn_chunk, B, d->N);
    take(a, td_op_bytes_layernorm(rows, d->s.D, a->train));
    if (d->pool == TD_SLM_POOL_MAP) {
        take(a, act(a, D));             /* q */
        take(a, act(a, (size_t)B * D)); /* repeated */
        take(a, 2 * act(a, rows * D));  /* k, v */
        tally_attention(a, m->attn_chunk, B, d->s.H, 1, d->N, d->s.D);
        take(a, act(a, (size_t)B * D)); /* out */
        take(a, td_op_bytes_layernorm((size_t)B, d->s.D, a->train));
        take(a, 2 * act(a, (size_t)B * d->s.M)); /* fc1, gelu */
        take(a, 2 * act(a, (size_t)B * D));      /* fc2, residual */
    } else {
        take(a, act(a, (size_t)B * D)); /* the mean */
    }
    take(a, act(a, (size_t)B * d->E)); /* proj */
    take(a, td_op_bytes_l2norm((size_t)B, d->E, a->train));
}

static void tally_text(tally *a, const td_sensorlm *m, int B)
{
    const td_slm_dims *d = &m->d;
    size_t rows = (size_t)B * d->L;

    take(a, act(a, rows * (size_t)d->t.D)); /* embedding */
    for (int l = 0; l < d->t.depth; l++)
        tally_block(a, &d->t, m->attn_chunk, B, d->L);
    take(a, td_op_bytes_layernorm(rows, d->t.D, a->train));
    take(a, act(a, (size_t)B * d->t.D)); /* the end tokens */
    take(a, act(a, (size_t)B * d->E));   /* proj */
    take(a, td_op_bytes_l2norm((size_t)B, d->E, a->train));
}

static void tally_loss(tally *a, const td_sensorlm *m, int B, int rows, int world)
{
    if (world > 1)
        take(a, act(a, (size_t)rows * m->d.E)); /* the gathered rows */
    take(a, act(a, (size_t)B * rows));          /* dots */
    take(a, td_op_bytes_siglip(a->train));
}

/* The peak of a pass that ended with a.used in use: with the backward's block on top when
 * training. */
static size_t tally_peak(const tally *a)
{
    size_t end = a->used + (a->train ? a->bwd : 0);
    return end > a->peak ? end : a->peak;
}

size_t td_sensorlm_arena_bytes(const td_sensorlm *m, int B, int rows, int world, int train)
{
    tally a = {.train = train};

    tally_sensor(&a, m, B);
    tally_text(&a, m, B);
    tally_loss(&a, m, B, rows, world);
    return tally_peak(&a);
}

size_t td_sensorlm_embed_bytes(const td_sensorlm *m, int B, int sensor, int text, int rows)
{
    tally a = {0};

    if (sensor)
        tally_sensor(&a, m, B);
    if (text)
        tally_text(&a, m, B);
    if (rows > 0)
        tally_loss(&a, m, B, rows, 1);
    return tally_peak(&a);
}

size_t td_sensorlm_attention_bytes(const td_sensorlm *m, int B, int train)
{
    tally a = {.train = train};

    tally_sensor(&a, m, B);
    tally_text(&a, m, B);
    return a.attn + (train ? a.bwd : 0);
}

int td_sensorlm_tape_len(const td_sensorlm *m)
{
    const td_slm_dims *d = &m->d;
    int sensor = 2 + 10 * d->s.depth + 1 + (d->pool == TD_SLM_POOL_MAP ? 11 : 1) + 2;
    int text = 1 + 10 * d->t.depth + 1 + 1 + 2;

    return sensor + text + 3; /* the gather, dots, the loss */
}

/* A block's FLOPs per token (the weights' 6 per multiply-add) and its attention's per token
 * (QK^T and AV: 2 * 2 * keys * D multiply-adds forward, times 3 for the backward; half the
 * keys when causal). */
static double block_flops(const td_slm_tower *t, int keys, int causal)
{
    double D = t->D, weights = 4.0 * D * D + 2.0 * D * t->M;

    return 6.0 * weights + (causal ? 6.0 : 12.0) * D * keys;
}

double td_sensorlm_flops(const td_slm_dims *d, int B)
{
    double D = d->s.D, tokens = (double)B * d->N, text = (double)B * d->L;
    double f = tokens * 6.0 * D * d->P; /* the patches */

    f += tokens * d->s.depth * block_flops(&d->s, d->N, 0);
    if (d->pool == TD_SLM_POOL_MAP) /* k, v over the tokens; the probe's attention; q, out, MLP */
        f += tokens * (6.0 * 2.0 * D * D + 12.0 * D) + B * 6.0 * (D * D + 2.0 * D * d->s.M) +
             6.0 * D * D;
    f += B * 6.0 * D * d->E; /* proj */
    f += text * d->t.depth * block_flops(&d->t, d->L, 1);
    f += B * 6.0 * (double)d->t.D * d->E;
    return f + 6.0 * (double)B * B * d->E; /* the head's dot products */
}
