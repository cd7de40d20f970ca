/* A model's weights in files (weights.h): each model's parameters as one list of named tensors
 * (the gpt in llm.c's order or under Hugging Face GPT-2's names, the sensorlm under the
 * README's), and the loads, checks and saves of both formats through it. The formats are
 * llmc.c's and safetensors.c's; the models gpt.c's and sensorlm.c's. Runs on the caller's
 * thread: a worker building a trainer, the daemon's threadpool (export), the loop thread's
 * submit check (headers only). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/llmc.h"
#include "train/safetensors.h"
#include "train/weights.h"

/* One parameter under a format's name: the file's name and shape and the floats to write
 * (st), where a load puts them (dst), and how many (n). */
typedef struct named {
    td_st_out st;
    float *dst;
    size_t n;
} named;

/* ---- the gpt's lists ------------------------------------------------------------------------ */

/* The per-layer tensors of td_gpt's layer[l][i] (i = tensor - 2) under GPT-2's names, and
 * whether Hugging Face stores them transposed (Conv1D's (in, out) weights). */
static const struct {
    const char *name;
    int transpose;
} gpt_layer[TD_GPT_LAYER_T] = {
    {"ln_1.weight", 0},      {"ln_1.bias", 0},          {"attn.c_attn.weight", 1},
    {"attn.c_attn.bias", 0}, {"attn.c_proj.weight", 1}, {"attn.c_proj.bias", 0},
    {"ln_2.weight", 0},      {"ln_2.bias", 0},          {"mlp.c_fc.weight", 1},
    {"mlp.c_fc.bias", 0},    {"mlp.c_proj.weight", 1},  {"mlp.c_proj.bias", 0},
};

/* The file's shape of layer tensor i for channels C: traind's per-layer shape, transposed for
 * the Conv1D weights. */
static int gpt_layer_shape(int i, int64_t C, int64_t *shape)
{
    static const int rows[TD_GPT_LAYER_T] = {1, 1, 3, 3, 1, 1, 1, 1, 4, 4, 1, 1};
    static const int cols[TD_GPT_LAYER_T] = {0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 0};

    shape[0] = rows[i] * C;
    if (cols[i] == 0)
        return 1;
    shape[1] = cols[i] * C;
    if (gpt_layer[i].transpose) {
        int64_t s = shape[0];
        shape[0] = shape[1];
        shape[1] = s;
    }
    return 2;
}

/* Room for the longest list of m (Hugging Face's names: 4 + 12 L), or NULL. */
static named *gpt_alloc(const td_gpt *m)
{
    return calloc(4 + TD_GPT_LAYER_T * (size_t)m->d.L, sizeof(named));
}

/* m's tensors in llm.c's order (the llm.c file's tensors): TD_GPT_TENSORS of them. */
static int gpt_llmc_names(const td_gpt *m, named *t)
{
    for (int i = 0; i < TD_GPT_TENSORS; i++) {
        t[i].st.src = t[i].dst = m->p[i].data;
        t[i].n = m->p[i].n;
    }
    return TD_GPT_TENSORS;
}

static named one(const char *name, int ndim, int64_t r, int64_t c, float *data, size_t n)
{
    named t = {.st = {.ndim = ndim, .shape = {r, c}, .src = data}, .dst = data, .n = n};

    snprintf(t.st.name, sizeof(t.st.name), "%s", name);
    return t;
}

/* m's tensors under Hugging Face GPT-2's names, in the order traind writes them. wte's first V
 * rows only: Hugging Face's vocabulary is the real one; the Vp - V padded rows traind keeps
 * for the lm head's alignment are never a token's and stay zero. */
static int gpt_st_names(const td_gpt *m, named *t)
{
    const td_gpt_dims *d = &m->d;
    int n = 0;

    t[n++] = one("wte.weight", 2, d->V, d->C, m->p[TD_GPT_WTE].data, (size_t)d->V * (size_t)d->C);
    t[n++] = one("wpe.weight", 2, d->maxT, d->C, m->p[TD_GPT_WPE].data, m->p[TD_GPT_WPE].n);
    for (int l = 0; l < d->L; l++)
        for (int i = 0; i < TD_GPT_LAYER_T; i++, n++) {
            snprintf(t[n].st.name, sizeof(t[n].st.name), "h.%d.%s", l, gpt_layer[i].name);
            t[n].st.ndim = gpt_layer_shape(i, d->C, t[n].st.shape);
            t[n].st.src = t[n].dst = m->layer[l][i].data;
            t[n].st.transpose = gpt_layer[i].transpose;
            t[n].n = m->layer[l][i].n;
        }
    t[n++] = one("ln_f.weight", 1, d->C, 0, m->p[TD_GPT_LNFW].data, (size_t)d->C);
    t[n++] = one("ln_f.bias", 1, d->C, 0, m->p[TD_GPT_LNFB].data, (size_t)d->C);
    return n;
}

/* ---- the sensorlm's list -------------------------------------------------------------------- */

/* m's parameters under their names (td_sensorlm.name[i] names p[i]), in the declared order. */
static int slm_names(const td_sensorlm *m, named *t)
{
    for (int i = 0; i < m->n; i++) {
        snprintf(t[i].st.name, sizeof(t[i].st.name), "%s", m->name[i]);
        t[i].st.ndim = m->p[i].ndim;
        for (int j = 0; j < m->p[i].ndim; j++)
            t[i].st.shape[j] = m->p[i].shape[j];
        t[i].st.src = t[i].dst = m->p[i].data;
        t[i].n = m->p[i].n;
    }
    return m->n;
}

/* ---- a list through a format ------------------------------------------------------------- */

/* Writes t[0..n) as safetensors with the metadata pairs meta[0..2*nmeta). */
static int save_st(const char *path, const named *t, int n, const char *const *meta, int nmeta,
                   td_error_t *err)
{
    td_st_out *o = calloc((size_t)(n > 0 ? n : 1), sizeof(*o));
    int rc;

    if (o == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    for (int i = 0; i < n; i++)
        o[i] = t[i].st;
    rc = td_st_write(path, o, n, meta, nmeta, err);
    free(o);
    return rc;
}

/* Reads t[0..n) from f, each found by find (the caller checked they are there). */
static int load_st(const td_st_file *f, const named *t, int n,
                   const td_st_tensor *(*find)(const td_st_file *, const char *), td_error_t *err)
{
    int rc = 0;

    for (int i = 0; i < n && rc == 0; i++)
        rc = td_st_read(f, find(f, t[i].st.name), t[i].dst, t[i].n, t[i].st.transpose, err);
    return rc;
}

/* ---- the gpt in llm.c's file --------------------------------------------------------------- */

/* Opens path as an llm.c file of a gpt traind can build: the header's dimensions into d,
 * checked against the engine's limits, and the file's size against them. */
static int llmc_open(td_llmc_file **f, const char *path, td_gpt_dims *d, td_error_t *err)
{
    td_llmc_header h;
    td_error_t e = {0};
    size_t want;
    int rc = td_llmc_open(f, path, &h, err);

    if (rc != 0)
        return rc;
    *d = (td_gpt_dims){.maxT = h.maxT, .V = h.V, .Vp = h.Vp, .L = h.L, .NH = h.NH, .C = h.C};
    if (td_gpt_check_dims(d, &e) != 0) {
        rc = td_error_set(err, TD_EDATA, "%s: bad header: %s", path, e.msg);
        goto fail;
    }
    want = TD_LLMC_HEADER + td_gpt_num_params(d) * sizeof(float);
    if (td_llmc_size(*f) != want) {
        rc = td_error_set(err, TD_EDATA,
                          "%s: wrong size: %lld bytes, but a model of maxT %d, V %d, L %d, NH %d, "
                          "C %d, Vp %d takes %zu",
                          path, (long long)td_llmc_size(*f), d->maxT, d->V, d->L, d->NH, d->C,
                          d->Vp, want);
        goto fail;
    }
    return 0;

fail:
    td_llmc_close(*f);
    *f = NULL;
    return rc;
}

static int llmc_load(const char *path, td_gpt *m, td_error_t *err)
{
    named t[TD_GPT_TENSORS];
    td_llmc_file *f;
    td_gpt_dims d;
    int n, rc = llmc_open(&f, path, &d, err);

    if (rc != 0)
        return rc;
    if (memcmp(&d, &m->d, sizeof(d)) != 0) {
        rc = td_error_set(err, TD_ESHAPE,
                          "%s: maxT %d, V %d, L %d, NH %d, C %d, Vp %d, but the model is maxT %d, "
                          "V %d, L %d, NH %d, C %d, Vp %d",
                          path, d.maxT, d.V, d.L, d.NH, d.C, d.Vp, m->d.maxT, m->d.V, m->d.L,
                          m->d.NH, m->d.C, m->d.Vp);
        goto out;
    }
    n = gpt_llmc_names(m, t);
    for (int i = 0; i < n && rc == 0; i++)
        rc = td_llmc_read(f, i, t[i].dst, t[i].n, err);
out:
    td_llmc_close(f);
    return rc;
}

int td_weights_gpt_save_llmc(const char *path, const td_gpt *m, td_error_t *err)
{
    named t[TD_GPT_TENSORS];
    const float *src[TD_GPT_TENSORS];
    size_t count[TD_GPT_TENSORS];
    const td_llmc_header h = {TD_LLMC_VERSION, m->d.maxT, m->d.V, m->d.L, m->d.NH, m->d.C, m->d.Vp};
    int n = gpt_llmc_names(m, t);

    for (int i = 0; i < n; i++) {
        src[i] = t[i].st.src;
        count[i] = t[i].n;
    }
    return td_llmc_write(path, &h, src, count, n, err);
}

/* ---- the gpt in safetensors -------------------------------------------------------------- */

/* name, or "transformer." + name (GPT2LMHeadModel's files), in f. */
static const td_st_tensor *gpt_find(const td_st_file *f, const char *name)
{
    char full[TD_ST_NAME_MAX];
    const td_st_tensor *t = td_st_find(f, name);

    if (t != NULL)
        return t;
    snprintf(full, sizeof(full), "transformer.%s", name);
    return td_st_find(f, full);
}

/* name with the shape the model needs, a float type. */
static int need(const td_st_file *f, const char *name, int ndim, const int64_t *shape,
                td_error_t *err)
{
    const td_st_tensor *t = gpt_find(f, name);
    char have[96], want[96];

    td_st_shape_str(want, sizeof(want), ndim, shape);
    if (t == NULL)
        return td_error_set(err, TD_EDATA, "%s: no tensor %s (the model needs one of %s)",
                            td_st_path(f), name, want);
    td_st_shape_str(have, sizeof(have), t->ndim, t->shape);
    if (t->ndim != ndim || memcmp(t->shape, shape, (size_t)ndim * sizeof(*shape)) != 0)
        return td_error_set(err, TD_EDATA, "%s: tensor %s: %s in the file, the model needs %s",
                            td_st_path(f), name, have, want);
    if (t->dtype == TD_ST_OTHER)
        return td_error_set(err, TD_EDATA, "%s: tensor %s is %s; traind reads F32, F16 and BF16",
                            td_st_path(f), name, t->dtype_name);
    return 0;
}

/* The number in f's metadata n_head, else n_head (the job's), into *nh. */
static int gpt_heads(const td_st_file *f, int n_head, int *nh, td_error_t *err)
{
    const char *mh = td_st_meta(f, "n_head");

    if (mh != NULL) {
        char *end;
        long v = strtol(mh, &end, 10);
        if (*mh == '\0' || *end != '\0' || v < 1 || v > 1 << 20)
            return td_error_set(err, TD_EDATA, "%s: __metadata__ n_head: \"%s\" is not a number",
                                td_st_path(f), mh);
        *nh = (int)v;
    } else if (n_head > 0) {
        *nh = n_head;
    } else {
        return td_error_set(err, TD_EDATA,
                            "%s: the file does not say its n_head (no __metadata__ n_head): give "
                            "model.n_head",
                            td_st_path(f));
    }
    return 0;
}

/* Every tensor of a gpt of dimensions d in f with its shape (wte's was read off the file). */
static int gpt_need_all(const td_st_file *f, const td_gpt_dims *d, td_error_t *err)
{
    char name[64];
    int64_t shape[2] = {d->maxT, d->C};
    int rc;

    if ((rc = need(f, "wpe.weight", 2, shape, err)) != 0)
        return rc;
    for (int l = 0; l < d->L; l++)
        for (int i = 0; i < TD_GPT_LAYER_T; i++) {
            int nd = gpt_layer_shape(i, d->C, shape);
            snprintf(name, sizeof(name), "h.%d.%s", l, gpt_layer[i].name);
            if ((rc = need(f, name, nd, shape, err)) != 0)
                return rc;
        }
    shape[0] = d->C;
    if ((rc = need(f, "ln_f.weight", 1, shape, err)) != 0 ||
        (rc = need(f, "ln_f.bias", 1, shape, err)) != 0)
        return rc;
    return 0;
}

/* The dimensions of f's GPT-2, every tensor's shape checked. */
static int gpt_dims_of(const td_st_file *f, int n_head, td_gpt_dims *d, td_error_t *err)
{
    const td_st_tensor *wte = gpt_find(f, "wte.weight"), *wpe = gpt_find(f, "wpe.weight");
    const char *path = td_st_path(f);
    char name[64];
    td_error_t e = {0};
    int rc;

    if (wte == NULL || wte->ndim != 2)
        return td_error_set(err, TD_EDATA, "%s: no 2-D tensor wte.weight: not a GPT-2", path);
    if (wpe == NULL || wpe->ndim != 2)
        return td_error_set(err, TD_EDATA, "%s: no 2-D tensor wpe.weight: not a GPT-2", path);
    if (wte->shape[0] > 1 << 20 || wte->shape[1] > 1 << 20 || wpe->shape[0] > 1 << 20)
        return td_error_set(err, TD_EDATA, "%s: wte.weight or wpe.weight is too large", path);
    memset(d, 0, sizeof(*d));
    d->V = (int)wte->shape[0];
    d->C = (int)wte->shape[1];
    d->maxT = (int)wpe->shape[0];
    for (d->L = 0; d->L <= TD_GPT_MAX_LAYERS; d->L++) {
        snprintf(name, sizeof(name), "h.%d.ln_1.weight", d->L);
        if (gpt_find(f, name) == NULL)
            break;
    }
    d->Vp = td_gpt_padded_vocab(d->V);
    if ((rc = gpt_heads(f, n_head, &d->NH, err)) != 0)
        return rc;
    if (td_gpt_check_dims(d, &e) != 0)
        return td_error_set(err, TD_EDATA, "%s: %s", path, e.msg);
    if ((rc = gpt_need_all(f, d, err)) != 0)
        return rc;
    if (wte->dtype == TD_ST_OTHER)
        return td_error_set(err, TD_EDATA,
                            "%s: tensor wte.weight is %s; traind reads F32, F16 "
                            "and BF16",
                            path, wte->dtype_name);
    return 0;
}

static int st_gpt_load(const char *path, td_gpt *m, td_error_t *err)
{
    td_st_file *f;
    td_gpt_dims d;
    named *t = NULL;
    int rc = td_st_open(&f, path, err);

    if (rc == 0)
        rc = gpt_dims_of(f, m->d.NH, &d, err);
    if (rc == 0 && memcmp(&d, &m->d, sizeof(d)) != 0)
        rc = td_error_set(err, TD_ESHAPE,
                          "%s: maxT %d, V %d, L %d, NH %d, C %d, but the model is maxT %d, V %d, "
                          "L %d, NH %d, C %d",
                          path, d.maxT, d.V, d.L, d.NH, d.C, m->d.maxT, m->d.V, m->d.L, m->d.NH,
                          m->d.C);
    if (rc == 0 && (t = gpt_alloc(m)) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    if (rc == 0) {
        memset(m->p[TD_GPT_WTE].data, 0, m->p[TD_GPT_WTE].n * sizeof(float));
        rc = load_st(f, t, gpt_st_names(m, t), gpt_find, err);
    }
    free(t);
    td_st_close(f);
    return rc;
}

int td_weights_gpt_save_st(const char *path, const td_gpt *m, int64_t step, td_error_t *err)
{
    named *t = gpt_alloc(m);
    char nums[6][24];
    const char *meta[16];
    int rc;

    if (t == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    snprintf(nums[0], sizeof(nums[0]), "%d", m->d.L);
    snprintf(nums[1], sizeof(nums[1]), "%d", m->d.NH);
    snprintf(nums[2], sizeof(nums[2]), "%d", m->d.C);
    snprintf(nums[3], sizeof(nums[3]), "%d", m->d.maxT);
    snprintf(nums[4], sizeof(nums[4]), "%d", m->d.V);
    snprintf(nums[5], sizeof(nums[5]), "%lld", (long long)step);
    meta[0] = "format", meta[1] = "pt";
    meta[2] = "traind.model", meta[3] = "gpt";
    meta[4] = "n_layer", meta[5] = nums[0];
    meta[6] = "n_head", meta[7] = nums[1];
    meta[8] = "n_embd", meta[9] = nums[2];
    meta[10] = "n_positions", meta[11] = nums[3];
    meta[12] = "vocab_size", meta[13] = nums[4];
    meta[14] = "step", meta[15] = nums[5];
    rc = save_st(path, t, gpt_st_names(m, t), meta, 8, err);
    free(t);
    return rc;
}

/* ---- the gpt, either format ---------------------------------------------------------------- */

int td_weights_gpt_peek(const char *path, int n_head, td_gpt_dims *d, td_error_t *err)
{
    td_st_file *sf;
    td_llmc_file *lf;
    int rc;

    if (td_st_is_path(path)) {
        rc = td_st_open(&sf, path, err);
        if (rc == 0)
            rc = gpt_dims_of(sf, n_head, d, err);
        td_st_close(sf);
    } else {
        rc = llmc_open(&lf, path, d, err);
        td_llmc_close(lf);
    }
    return rc;
}

int td_weights_gpt_load(const char *path, td_gpt *m, td_error_t *err)
{
    return td_st_is_path(path) ? st_gpt_load(path, m, err) : llmc_load(path, m, err);
}

/* ---- the sensorlm in safetensors ----------------------------------------------------------- */

/* Every tensor of t[0..n) (the job's model's) in f under its name with its shape, of a float
 * dtype. */
static int slm_check(const td_st_file *f, const named *t, int n, td_error_t *err)
{
    char have[96], want[96];
    const char *path = td_st_path(f);

    for (int i = 0; i < n; i++) {
        const td_st_tensor *ft = td_st_find(f, t[i].st.name);
        const int64_t *shape = t[i].st.shape;
        int same;
        td_st_shape_str(want, sizeof(want), t[i].st.ndim, shape);
        if (ft == NULL)
            return td_error_set(err, TD_EDATA, "%s: no tensor %s (the job's model has one of %s)",
                                path, t[i].st.name, want);
        same = ft->ndim == t[i].st.ndim &&
               memcmp(ft->shape, shape, (size_t)ft->ndim * sizeof(*shape)) == 0;
        td_st_shape_str(have, sizeof(have), ft->ndim, ft->shape);
        if (!same)
            return td_error_set(err, TD_ESHAPE,
                                "%s: tensor %s: %s in the file, the job's model "
                                "has %s",
                                path, t[i].st.name, have, want);
        if (ft->dtype == TD_ST_OTHER)
            return td_error_set(err, TD_EDATA,
                                "%s: tensor %s is %s; traind reads F32, F16 and "
                                "BF16",
                                path, t[i].st.name, ft->dtype_name);
    }
    return 0;
}

/* Opens path and checks m's tensors in it (slm_check); *t their list (n of them), which the
 * caller frees. */
static int slm_open(td_st_file **f, const char *path, const td_sensorlm *m, named **t, int *n,
                    td_error_t *err)
{
    int rc = td_st_open(f, path, err);

    *t = NULL;
    if (rc == 0 && (*t = calloc((size_t)m->n + 2, sizeof(named))) == NULL)
        rc = td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    if (rc == 0)
        *n = slm_names(m, *t);
    if (rc == 0)
        rc = slm_check(*f, *t, *n, err);
    return rc;
}

int td_weights_slm_check(const char *path, const td_sensorlm *m, td_error_t *err)
{
    td_st_file *f;
    named *t;
    int n, rc = slm_open(&f, path, m, &t, &n, err);

    free(t);
    td_st_close(f);
    return rc;
}

int td_weights_slm_load(const char *path, td_sensorlm *m, td_error_t *err)
{
    td_st_file *f;
    named *t;
    int n, rc = slm_open(&f, path, m, &t, &n, err);

    if (rc == 0)
        rc = load_st(f, t, n, td_st_find, err);
    free(t);
    td_st_close(f);
    return rc;
}

int td_weights_slm_save_st(const char *path, const td_sensorlm *m, const float *norm, int64_t step,
                           td_error_t *err)
{
    const td_slm_dims *d = &m->d;
    const char *keys[] = {
        "time_steps",   "channels",       "patch_t",      "patch_c",       "text_len",
        "embed_dim",    "sensor.d_model", "sensor.depth", "sensor.n_head", "sensor.mlp_dim",
        "text.d_model", "text.depth",     "text.n_head",  "text.mlp_dim",  "step"};
    long long vals[] = {d->T,   d->C,       d->pt,      d->pc,  d->L,
                        d->E,   d->s.D,     d->s.depth, d->s.H, d->s.M,
                        d->t.D, d->t.depth, d->t.H,     d->t.M, (long long)step};
    named *t = calloc((size_t)m->n + 2, sizeof(named));
    char nums[19][24];
    const char *meta[2 * 21];
    int n, k = 0, rc;

    if (t == NULL)
        return td_error_set(err, TD_ENOMEM, "no memory for a model's names");
    n = slm_names(m, t);
    for (int i = 0; i < 2; i++, n++) { /* written only: no dst */
        snprintf(t[n].st.name, sizeof(t[n].st.name), "%s", i == 0 ? "norm.mean" : "norm.std");
        t[n].st.ndim = 1;
        t[n].st.shape[0] = d->C;
        t[n].st.src = norm + (size_t)i * (size_t)d->C;
        t[n].n = (size_t)d->C;
    }
    meta[k++] = "format", meta[k++] = "pt";
    meta[k++] = "traind.model", meta[k++] = "sensorlm";
    meta[k++] = "sensor.pool", meta[k++] = d->pool == TD_SLM_POOL_GAP ? "gap" : "map";
    for (size_t i = 0; i < sizeof(vals) / sizeof(vals[0]); i++) {
        snprintf(nums[i], sizeof(nums[i]), "%lld", vals[i]);
        meta[k++] = keys[i];
        meta[k++] = nums[i];
    }
    rc = save_st(path, t, n, meta, k / 2, err);
    free(t);
    return rc;
}

int td_weights_mlp_save_st(const char *path, const td_mlp *m, int64_t step, td_error_t *err)
{
    named t[2 * TD_MAX_LAYERS];
    char layers[16 * TD_MAX_LAYERS], scale[32], steps[24];
    const char *meta[2 * 7];
    size_t used = 0;
    int n = 0, k = 0;

    memset(t, 0, sizeof(t));
    for (int l = 0; l + 1 < m->n_sizes; l++)
        for (int j = 0; j < 2; j++, n++) {
            const td_tensor *x = j == 0 ? &m->w[l] : &m->b[l];
            snprintf(t[n].st.name, sizeof(t[n].st.name), "layers.%d.%s", l,
                     j == 0 ? "weight" : "bias");
            t[n].st.ndim = x->ndim;
            for (int d = 0; d < x->ndim; d++)
                t[n].st.shape[d] = x->shape[d];
            t[n].st.src = x->data;
            t[n].n = x->n;
        }
    for (int l = 0; l < m->n_sizes && used < sizeof(layers); l++)
        used += (size_t)snprintf(layers + used, sizeof(layers) - used, "%s%d", l ? "," : "",
                                 m->sizes[l]);
    snprintf(scale, sizeof(scale), "%.17g", 1.0 / 255.0);
    snprintf(steps, sizeof(steps), "%lld", (long long)step);
    meta[k++] = "format", meta[k++] = "pt";
    meta[k++] = "traind.model", meta[k++] = "mlp";
    meta[k++] = "layers", meta[k++] = layers;
    meta[k++] = "activation", meta[k++] = "relu";
    meta[k++] = "input.scale", meta[k++] = scale;
    meta[k++] = "input.offset", meta[k++] = "0";
    meta[k++] = "step", meta[k++] = steps;
    return save_st(path, t, n, meta, k / 2, err);
}
