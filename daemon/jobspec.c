/* Job validation (see jobspec.h). Each section of the job file has one function; each takes
 * the dotted path of its section so that every message names the exact field. */
#include <ctype.h>
#include <errno.h>
#include <glob.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "daemon/jobspec.h"
#include "common/td_text.h"

typedef struct field {
    const char *name;
    const td_pval *val;
} field;

static int bad(td_error_t *err, const char *path, const char *key, const char *why)
{
    if (path[0] != '\0')
        return td_error_set(err, TD_EJOB, "%s.%s: %s", path, key, why);
    return td_error_set(err, TD_EJOB, "%s: %s", key, why);
}

/* Refuses a key of map m that is not among the allowed names. */
static int check_keys(const td_pval *m, const char *path, const char *const *allowed,
                      td_error_t *err)
{
    for (size_t i = 0; i < td_pv_len(m); i++) {
        char key[64];
        int known = 0;
        if (td_pv_strcpy(td_pv_key_at(m, i), key, sizeof(key)) != 0)
            return bad(err, path, "?", "keys must be short strings");
        for (size_t j = 0; allowed[j] != NULL && !known; j++)
            known = strcmp(key, allowed[j]) == 0;
        if (!known)
            return bad(err, path, key, "unknown key");
    }
    return 0;
}

/* Reads an integer in [lo, hi] when present; leaves *out alone when absent. */
static int get_int(const td_pval *m, const char *path, const char *key, int64_t lo, int64_t hi,
                   const char *why, int64_t *out, td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);
    int64_t x;

    if (v == NULL)
        return 0;
    if (td_pv_int(v, &x) != 0 || x < lo || x > hi)
        return bad(err, path, key, why);
    *out = x;
    return 0;
}

static int get_int32(const td_pval *m, const char *path, const char *key, int64_t lo, int64_t hi,
                     const char *why, int *out, td_error_t *err)
{
    int64_t x = *out;
    int rc = get_int(m, path, key, lo, hi, why, &x, err);
    *out = (int)x;
    return rc;
}

/* Reads a finite number in [lo, hi] (hi_open: strictly below hi) when present. */
static int get_float(const td_pval *m, const char *path, const char *key, double lo, double hi,
                     int hi_open, const char *why, float *out, td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);
    double x;

    if (v == NULL)
        return 0;
    if (td_pv_double(v, &x) != 0 || !isfinite(x) || x < lo || x > hi || (hi_open && x == hi))
        return bad(err, path, key, why);
    *out = (float)x;
    return 0;
}

static int get_bool(const td_pval *m, const char *path, const char *key, int *out, td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);

    if (v == NULL)
        return 0;
    if (td_pv_bool(v, out) != 0)
        return bad(err, path, key, "must be true or false");
    return 0;
}

/* Reads a required string naming one of choices; returns its index in *out. */
static int get_choice(const td_pval *m, const char *path, const char *key,
                      const char *const *choices, int required, int *out, td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);
    char s[32], why[160];
    size_t n = 0;

    if (v == NULL) {
        if (!required)
            return 0;
        snprintf(why, sizeof(why), "is required");
        return bad(err, path, key, why);
    }
    if (td_pv_strcpy(v, s, sizeof(s)) == 0) {
        for (int i = 0; choices[i] != NULL; i++)
            if (strcmp(s, choices[i]) == 0) {
                *out = i;
                return 0;
            }
    }
    n = (size_t)snprintf(why, sizeof(why), "must be one of");
    for (int i = 0; choices[i] != NULL && n < sizeof(why); i++)
        n += (size_t)snprintf(why + n, sizeof(why) - n, "%s \"%s\"", i ? "," : "", choices[i]);
    return bad(err, path, key, why);
}

/* Paths are resolved where the user is, not where the daemon runs (its working directory is
 * nobody's): trainctl makes a job file's relative paths absolute before it sends them. */
#define TD_JOB_RELATIVE_PATH \
    "must be an absolute path; trainctl resolves relative paths where you run it"

/* How parse_job treats the job's files: a stored spec's are not checked (they were at submit
 * and may have gone since); a submit's paths must be absolute, and what is at them is checked
 * later, off the loop (td_jobspec_check_paths); every other caller's are checked here. */
enum { FILES_NONE = 0, FILES_CHECK = 1, FILES_DEFER = 2 };

/* "cannot read P: why" for a path that is not readable now, naming the field; 0 if it is. */
static int readable(const char *path, const char *key, const char *out, td_error_t *err)
{
    char why[TD_PATH_MAX + 64];

    if (access(out, R_OK) == 0)
        return 0;
    snprintf(why, sizeof(why), "cannot read %s: %s", out, strerror(errno));
    return bad(err, path, key, why);
}

/* A readable file path: the daemon refuses a missing dataset at submit, naming it. files 0:
 * a stored spec, whose files were checked at submit (and may have gone since): not checked. */
static int get_path(const td_pval *m, const char *path, const char *key, char *out, size_t size,
                    int files, td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);

    if (v == NULL)
        return bad(err, path, key, "is required");
    if (td_pv_strcpy(v, out, size) != 0 || out[0] == '\0')
        return bad(err, path, key, "must be a file path (a non-empty string)");
    if (files && out[0] != '/')
        return bad(err, path, key, TD_JOB_RELATIVE_PATH);
    return files == FILES_CHECK ? readable(path, key, out, err) : 0;
}

static int need_map(const td_pval *v, const char *path, const char *key, td_error_t *err)
{
    if (v == NULL)
        return bad(err, path, key, "is required");
    if (td_pv_type_of(v) != TD_PV_MAP)
        return bad(err, path, key, "must be an object");
    return 0;
}

static int parse_mlp(const td_pval *m, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind", "layers", NULL};
    const td_pval *layers = td_pv_get(m, "layers");
    char path[32];
    int rc;

    if ((rc = check_keys(m, "model", keys, err)) != 0)
        return rc;
    c->model = TD_MODEL_MLP;
    if (layers == NULL)
        return bad(err, "model", "layers", "is required");
    if (td_pv_type_of(layers) != TD_PV_ARRAY || td_pv_len(layers) < 2 ||
        td_pv_len(layers) > TD_MAX_LAYERS)
        return td_error_set(err, TD_EJOB,
                            "model.layers: must be a list of 2 to %d layer sizes, input first",
                            TD_MAX_LAYERS);
    c->n_layers = (int)td_pv_len(layers);
    for (int i = 0; i < c->n_layers; i++) {
        int64_t x;
        if (td_pv_int(td_pv_at(layers, (size_t)i), &x) != 0 || x < 1 || x > 1 << 20) {
            snprintf(path, sizeof(path), "layers[%d]", i);
            return bad(err, "model", path, "must be a positive integer");
        }
        c->layers[i] = (int)x;
    }
    return 0;
}

/* GPT dimensions. With init_from they may be left out (the file has them); any given must
 * agree with the file, which the trainer checks when it opens it. And model.attn_chunk. */
static int parse_gpt(const td_pval *m, td_train_config *c, int files, td_error_t *err)
{
    static const char *const keys[] = {"kind",       "n_layer",   "n_head",     "n_embd", "seq_len",
                                       "vocab_size", "init_from", "attn_chunk", NULL};
    static const char *const dims[] = {"n_layer", "n_head", "n_embd", "seq_len", "vocab_size"};
    int *vals[] = {&c->n_layer, &c->n_head, &c->n_embd, &c->seq_len, &c->vocab_size};
    const td_pval *from = td_pv_get(m, "init_from");
    int rc;

    if ((rc = check_keys(m, "model", keys, err)) != 0)
        return rc;
    c->model = TD_MODEL_GPT;
    if (from != NULL && (rc = get_path(m, "model", "init_from", c->init_from, sizeof(c->init_from),
                                       files, err)) != 0)
        return rc;
    for (int i = 0; i < 5; i++) {
        *vals[i] = 0;
        if ((rc = get_int32(m, "model", dims[i], 1, 1 << 20, "must be a positive integer", vals[i],
                            err)) != 0)
            return rc;
        if (*vals[i] == 0 && from == NULL)
            return bad(err, "model", dims[i], "is required (or give model.init_from)");
    }
    if ((rc = get_int32(m, "model", "attn_chunk", 0, 1 << 20,
                        "must be an integer >= 0 (0: automatic)", &c->attn_chunk, err)) != 0)
        return rc;
    if (c->vocab_size > 65536)
        return bad(err, "model", "vocab_size", "must be at most 65536 (tokens are uint16)");
    if (c->n_head > 0 && c->n_embd > 0 && c->n_embd % c->n_head != 0)
        return td_error_set(err, TD_EJOB, "model.n_embd: %d is not a multiple of n_head %d",
                            c->n_embd, c->n_head);
    return 0;
}

/* One sensorlm tower's keys into the four dimensions (0 where absent: the preset's). */
static int parse_tower(const td_pval *m, const char *key, const char *const *keys, int *const *vals,
                       int n, td_error_t *err)
{
    char path[16];
    int rc;

    snprintf(path, sizeof(path), "model.%s", key);
    if ((rc = need_map(m, "model", key, err)) != 0 || (rc = check_keys(m, path, keys, err)) != 0)
        return rc;
    for (int i = 0; i < n; i++)
        if ((rc = get_int32(m, path, keys[i], 1, 1 << 20, "must be a positive integer", vals[i],
                            err)) != 0)
            return rc;
    return 0;
}

/* sensorlm: model.size, model.sensor.*, model.text.*, model.embed_dim, model.attn_chunk. Each
 * dimension given overrides the preset's; T and C default to the shards', against which the
 * files' check (td_train_check_files) holds them, with every other dimension. */
static int parse_sensorlm(const td_pval *m, td_train_config *c, int files, td_error_t *err)
{
    static const char *const keys[] = {"kind",      "size",       "sensor",    "text",
                                       "embed_dim", "attn_chunk", "init_from", NULL};
    static const char *const skeys[] = {"time_steps", "channels", "patch_t", "patch_c", "d_model",
                                        "depth",      "n_head",   "mlp_dim", "pool",    NULL};
    static const char *const tkeys[] = {"text_len", "d_model", "depth", "n_head", "mlp_dim", NULL};
    static const char *const sizes[] = {"tiny", "small", "base", NULL};
    static const char *const pools[] = {"map", "gap", NULL};
    td_sensorlm_config *s = &c->slm;
    int *sv[] = {&s->time_steps, &s->channels, &s->patch_t, &s->patch_c,
                 &s->s_width,    &s->s_depth,  &s->s_heads, &s->s_mlp};
    int *tv[] = {&s->text_len, &s->t_width, &s->t_depth, &s->t_heads, &s->t_mlp};
    const td_pval *sensor = td_pv_get(m, "sensor"), *text = td_pv_get(m, "text");
    int size = 0, pool = 0, rc;

    if ((rc = check_keys(m, "model", keys, err)) != 0)
        return rc;
    c->model = TD_MODEL_SENSORLM;
    memset(s, 0, sizeof(*s));
    if (td_pv_get(m, "init_from") != NULL && (rc = get_path(m, "model", "init_from", c->init_from,
                                                            sizeof(c->init_from), files, err)) != 0)
        return rc;
    if ((rc = get_choice(m, "model", "size", sizes, 0, &size, err)) != 0 ||
        (rc = get_int32(m, "model", "embed_dim", 1, 1 << 14, "must be a positive integer",
                        &s->embed_dim, err)) != 0 ||
        (rc = get_int32(m, "model", "attn_chunk", 0, 1 << 20,
                        "must be an integer >= 0 (0: automatic)", &c->attn_chunk, err)) != 0)
        return rc;
    s->size = (td_slm_size)size;
    if (sensor != NULL) {
        if ((rc = parse_tower(sensor, "sensor", skeys, sv, 8, err)) != 0 ||
            (rc = get_choice(sensor, "model.sensor", "pool", pools, 0, &pool, err)) != 0)
            return rc;
        s->pool = pool == 0 ? TD_SLM_POOL_MAP : TD_SLM_POOL_GAP;
    }
    if (text != NULL && (rc = parse_tower(text, "text", tkeys, tv, 5, err)) != 0)
        return rc;
    if (s->time_steps > 0 && s->patch_t > 0 && s->time_steps % s->patch_t != 0)
        return td_error_set(err, TD_EJOB,
                            "model.sensor.patch_t: %d does not divide time_steps %d (a window "
                            "must be whole patches)",
                            s->patch_t, s->time_steps);
    return 0;
}

static int parse_model(const td_pval *m, td_train_config *c, int files, td_error_t *err)
{
    static const char *const kinds[] = {"mlp", "gpt", "sensorlm", NULL};
    int kind = 0, rc;

    if ((rc = need_map(m, "", "model", err)) != 0)
        return rc;
    if ((rc = get_choice(m, "model", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    if (kind == 2)
        return parse_sensorlm(m, c, files, err);
    return kind == 0 ? parse_mlp(m, c, err) : parse_gpt(m, c, files, err);
}

static int parse_split(const td_pval *d, const char *key, td_idx_split *s, int files,
                       td_error_t *err)
{
    static const char *const keys[] = {"images", "labels", NULL};
    const td_pval *m = td_pv_get(d, key);
    char path[32];
    int rc;

    snprintf(path, sizeof(path), "data.%s", key);
    if ((rc = need_map(m, "data", key, err)) != 0 || (rc = check_keys(m, path, keys, err)) != 0)
        return rc;
    if ((rc = get_path(m, path, "images", s->images, sizeof(s->images), files, err)) != 0)
        return rc;
    return get_path(m, path, "labels", s->labels, sizeof(s->labels), files, err);
}

/* One path or glob of a text/tokens split; it must match at least one readable file now. */
static int check_pattern(const char *where, const char *pat, td_error_t *err)
{
    glob_t g;
    int rc;

    rc = glob(pat, GLOB_NOSORT, NULL, &g);
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
        globfree(&g);
        return td_error_set(err, TD_EJOB, "%s: no file matches %s", where, pat);
    }
    if (rc != 0) {
        globfree(&g);
        return td_error_set(err, TD_EJOB, "%s: cannot expand %s", where, pat);
    }
    for (size_t i = 0; i < g.gl_pathc; i++)
        if (access(g.gl_pathv[i], R_OK) != 0) {
            rc = td_error_set(err, TD_EJOB, "%s: cannot read %s: %s", where, g.gl_pathv[i],
                              strerror(errno));
            break;
        }
    globfree(&g);
    return rc;
}

/* A path, glob, or list of them; each must match readable files now when files is set. */
static int parse_files(const td_pval *d, const char *key, char (*out)[TD_PATH_MAX], int *n,
                       int files, td_error_t *err)
{
    const td_pval *v = td_pv_get(d, key);
    int list = td_pv_type_of(v) == TD_PV_ARRAY;
    size_t count = list ? td_pv_len(v) : 1;
    char where[48];

    *n = 0;
    if (v == NULL)
        return 0;
    if (count == 0 || count > TD_MAX_PATTERNS)
        return td_error_set(err, TD_EJOB, "data.%s: must list 1 to %d paths or globs", key,
                            TD_MAX_PATTERNS);
    for (size_t i = 0; i < count; i++) {
        const td_pval *p = list ? td_pv_at(v, i) : v;
        int rc;
        if (list)
            snprintf(where, sizeof(where), "data.%s[%zu]", key, i);
        else
            snprintf(where, sizeof(where), "data.%s", key);
        if (td_pv_strcpy(p, out[i], TD_PATH_MAX) != 0 || out[i][0] == '\0')
            return td_error_set(err, TD_EJOB, "%s: must be a path or glob (a non-empty string)",
                                where);
        if (files && out[i][0] != '/')
            return td_error_set(err, TD_EJOB, "%s: %s", where, TD_JOB_RELATIVE_PATH);
        if (files == FILES_CHECK && (rc = check_pattern(where, out[i], err)) != 0)
            return rc;
        (*n)++;
    }
    return 0;
}

static int parse_data(const td_pval *d, td_train_config *c, int files, td_error_t *err)
{
    static const char *const idx_keys[] = {"kind", "train", "test", "shuffle", NULL};
    static const char *const tok_keys[] = {"kind",           "train",       "valid", "shuffle",
                                           "valid_fraction", "caption_cut", NULL};
    static const char *const kinds[] = {"idx", "text", "tokens", "sensor", NULL};
    static const td_data_kind map[] = {TD_DATA_IDX, TD_DATA_TEXT, TD_DATA_TOKENS, TD_DATA_SENSOR};
    int kind = 0, rc;

    if ((rc = need_map(d, "", "data", err)) != 0)
        return rc;
    if ((rc = get_choice(d, "data", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    if ((rc = get_bool(d, "data", "shuffle", &c->shuffle, err)) != 0)
        return rc;
    if (kind == 0) {
        c->data = TD_DATA_IDX;
        if ((rc = check_keys(d, "data", idx_keys, err)) != 0 ||
            (rc = parse_split(d, "train", &c->train, files, err)) != 0)
            return rc;
        if (td_pv_get(d, "test") != NULL &&
            (rc = parse_split(d, "test", &c->test, files, err)) != 0)
            return rc;
        return 0;
    }
    c->data = map[kind];
    if ((rc = check_keys(d, "data", tok_keys, err)) != 0)
        return rc;
    if (td_pv_get(d, "train") == NULL)
        return bad(err, "data", "train", "is required");
    if ((rc = parse_files(d, "train", c->train_files, &c->n_train_files, files, err)) != 0 ||
        (rc = parse_files(d, "valid", c->valid_files, &c->n_valid_files, files, err)) != 0)
        return rc;
    if ((rc = get_float(d, "data", "valid_fraction", 0, 1, 1, "must be in [0, 1)",
                        &c->valid_fraction, err)) != 0)
        return rc;
    if (c->n_valid_files > 0 && c->valid_fraction > 0)
        return bad(err, "data", "valid_fraction", "cannot be used together with data.valid");
    if (td_pv_get(d, "caption_cut") != NULL && c->data != TD_DATA_SENSOR)
        return bad(err, "data", "caption_cut", "is a sensor data key (data.kind \"sensor\")");
    if ((rc = get_float(d, "data", "caption_cut", 0, 1, 0, "must be a probability in [0, 1]",
                        &c->caption_cut, err)) != 0)
        return rc;
    return 0;
}

/* loss: {mask_same_label, same_label_weight}, a sensorlm's only (the model is parsed before
 * it). */
static int parse_loss(const td_pval *l, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"mask_same_label", "same_label_weight", NULL};
    int rc;

    if (l == NULL)
        return 0;
    if ((rc = need_map(l, "", "loss", err)) != 0 || (rc = check_keys(l, "loss", keys, err)) != 0)
        return rc;
    if (c->model != TD_MODEL_SENSORLM)
        return bad(err, td_pv_len(l) > 0 ? "loss" : "",
                   td_pv_len(l) > 0 ? "mask_same_label" : "loss",
                   "is a sensorlm key (model.kind \"sensorlm\")");
    if ((rc = get_bool(l, "loss", "mask_same_label", &c->mask_same_label, err)) != 0 ||
        (rc = get_float(l, "loss", "same_label_weight", 0, 1, 1, "must be a number in [0, 1)",
                        &c->same_label_weight, err)) != 0)
        return rc;
    if (td_pv_get(l, "same_label_weight") != NULL && !c->mask_same_label)
        return bad(err, "loss", "same_label_weight",
                   "weighs the pairs of loss.mask_same_label, "
                   "which is not true");
    return 0;
}

static int parse_optim(const td_pval *o, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind",         "lr",       "beta1",     "beta2", "eps",
                                       "weight_decay", "momentum", "grad_clip", NULL};
    static const char *const kinds[] = {"adamw", "sgd", NULL};
    int kind = 0, rc;

    if (o == NULL)
        return 0;
    if ((rc = need_map(o, "", "optim", err)) != 0 || (rc = check_keys(o, "optim", keys, err)))
        return rc;
    if ((rc = get_choice(o, "optim", "kind", kinds, 0, &kind, err)) != 0)
        return rc;
    c->optim = kind == 0 ? TD_OPTIM_ADAMW : TD_OPTIM_SGD;
    if ((rc = get_float(o, "optim", "lr", 0, 1e6, 0, "must be a positive number", &c->lr, err)))
        return rc;
    if (c->lr <= 0)
        return bad(err, "optim", "lr", "must be a positive number");
    if ((rc = get_float(o, "optim", "beta1", 0, 1, 1, "must be in [0, 1)", &c->beta1, err)) ||
        (rc = get_float(o, "optim", "beta2", 0, 1, 1, "must be in [0, 1)", &c->beta2, err)) ||
        (rc = get_float(o, "optim", "momentum", 0, 1, 1, "must be in [0, 1)", &c->momentum, err)) ||
        (rc = get_float(o, "optim", "weight_decay", 0, 1e6, 0, "must be a number >= 0",
                        &c->weight_decay, err)) ||
        (rc = get_float(o, "optim", "grad_clip", 0, 1e30, 0,
                        "must be a number >= 0 (0 turns clipping off)", &c->grad_clip, err)))
        return rc;
    if ((rc = get_float(o, "optim", "eps", 0, 1, 0, "must be a positive number", &c->eps, err)))
        return rc;
    if (c->eps <= 0)
        return bad(err, "optim", "eps", "must be a positive number");
    return 0;
}

static int parse_schedule(const td_pval *s, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind", "warmup", "cooldown", "min_lr", NULL};
    static const char *const kinds[] = {"constant", "cosine", "rsqrt", NULL};
    static const td_sched_kind map[] = {TD_SCHED_CONSTANT, TD_SCHED_COSINE, TD_SCHED_RSQRT};
    int kind = 0, rc;

    if (s == NULL)
        return 0;
    if ((rc = need_map(s, "", "schedule", err)) != 0 ||
        (rc = check_keys(s, "schedule", keys, err)) != 0)
        return rc;
    if ((rc = get_choice(s, "schedule", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    c->schedule = map[kind];
    if ((rc = get_float(s, "schedule", "warmup", 0, 1, 1,
                        "must be a fraction of the steps in "
                        "[0, 1)",
                        &c->warmup, err)) ||
        (rc = get_float(s, "schedule", "cooldown", 0, 1, 1,
                        "must be a fraction of the steps in "
                        "[0, 1)",
                        &c->cooldown, err)) ||
        (rc = get_float(s, "schedule", "min_lr", 0, 1e6, 0, "must be a number >= 0", &c->min_lr,
                        err)))
        return rc;
    if (c->warmup + c->cooldown >= 1)
        return bad(err, "schedule", "cooldown", "warmup + cooldown must be below 1");
    return 0;
}

/* debug.fail's device or node: a number 0-63 or a list of them, as a mask; absent, all. */
static int get_mask(const td_pval *v, const char *key, const char *why, uint64_t *mask,
                    td_error_t *err)
{
    *mask = 0;
    if (v == NULL) {
        *mask = ~0ull;
        return 0;
    }
    for (size_t i = 0; i < (td_pv_type_of(v) == TD_PV_ARRAY ? td_pv_len(v) : 1); i++) {
        const td_pval *d = td_pv_type_of(v) == TD_PV_ARRAY ? td_pv_at(v, i) : v;
        int64_t x;
        if (td_pv_int(d, &x) != 0 || x < 0 || x >= 64)
            return bad(err, "debug.fail", key, why);
        *mask |= 1ull << x;
    }
    return 0;
}

/* debug.hold: {step: S}: the job waits before step S + 1 until it is cancelled or
 * interrupted, so that a test can act on a job in a known state without racing it. */
static int parse_hold(const td_pval *h, td_jobspec *out, td_error_t *err)
{
    static const char *const hkeys[] = {"step", NULL};
    int rc;

    out->hold_step = -1;
    if (h == NULL)
        return 0;
    if ((rc = need_map(h, "debug", "hold", err)) != 0 ||
        (rc = check_keys(h, "debug.hold", hkeys, err)) != 0)
        return rc;
    out->hold_step = 0;
    return get_int(h, "debug.hold", "step", 0, INT64_MAX / 2, "must be an integer >= 0",
                   &out->hold_step, err);
}

/* debug.fail: {step, device: D or [D, ...], node: N or [N, ...], kind}. Kept in the spec; the
 * daemon applies it to the replicas on the named devices. */
static int parse_debug(const td_pval *dbg, td_jobspec *out, td_error_t *err)
{
    static const char *const keys[] = {"fail", "hold", NULL};
    static const char *const fkeys[] = {"step", "device", "node", "kind", NULL};
    static const char *const kinds[] = {"panic", "nan", "oom", "data", "sticky", NULL};
    static const td_fail_kind map[] = {TD_FAIL_PANIC, TD_FAIL_NAN, TD_FAIL_OOM, TD_FAIL_DATA,
                                       TD_FAIL_STICKY};
    const td_pval *f, *dev, *node;
    int kind = 0, rc;

    if (dbg == NULL)
        return 0;
    if ((rc = need_map(dbg, "", "debug", err)) != 0 ||
        (rc = check_keys(dbg, "debug", keys, err)) != 0)
        return rc;
    if ((rc = parse_hold(td_pv_get(dbg, "hold"), out, err)) != 0)
        return rc;
    f = td_pv_get(dbg, "fail");
    if (f == NULL)
        return 0;
    if ((rc = need_map(f, "debug", "fail", err)) != 0 ||
        (rc = check_keys(f, "debug.fail", fkeys, err)) != 0 ||
        (rc = get_choice(f, "debug.fail", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    out->fail_kind = map[kind];
    out->fail_step = 1;
    if ((rc = get_int(f, "debug.fail", "step", 0, INT64_MAX / 2, "must be an integer >= 0",
                      &out->fail_step, err)) != 0)
        return rc;
    dev = td_pv_get(f, "device");
    node = td_pv_get(f, "node");
    if ((rc = get_mask(dev, "device", "must be a device number 0-63 or a list of them",
                       &out->fail_devices, err)) != 0)
        return rc;
    return get_mask(node, "node", "must be a node number 0-63 or a list of them", &out->fail_nodes,
                    err);
}

/* batch_size: a positive integer, or "auto" (the memory guard picks it at the job's first
 * start; train.batch_size stays 0 until then). */
static int parse_batch(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    const td_pval *v = td_pv_get(job, "batch_size");
    int64_t n;
    char s[8];

    if (td_pv_type_of(v) == TD_PV_STR) {
        if (td_pv_strcpy(v, s, sizeof(s)) != 0 || strcmp(s, "auto") != 0)
            return bad(err, "", "batch_size", "must be a positive integer or \"auto\"");
        out->batch_auto = 1;
        out->train.batch_size = 0;
        return 0;
    }
    if (td_pv_int(v, &n) == 0 && n > TD_JOB_MAX_BATCH)
        return td_error_set(err, TD_EJOB, "batch_size: %lld is more than the limit, %d rows",
                            (long long)n, TD_JOB_MAX_BATCH);
    return get_int32(job, "", "batch_size", 1, TD_JOB_MAX_BATCH, "must be a positive integer",
                     &out->train.batch_size, err);
}

/* precision, tf32 and nccl_timeout_s: how the job computes on its devices. An absent
 * precision stays TD_PRECISION_DEFAULT, which the daemon resolves once it knows the devices
 * (bf16 for a gpt on cuda, fp32 otherwise). */
static int parse_device_keys(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    static const char *const precisions[] = {"fp32", "bf16", NULL};
    static const td_precision map[] = {TD_PRECISION_FP32, TD_PRECISION_BF16};
    const td_pval *t = td_pv_get(job, "nccl_timeout_s");
    int p = 0, rc;
    double x;

    if ((rc = get_choice(job, "", "precision", precisions, 0, &p, err)) != 0 ||
        (rc = get_bool(job, "", "tf32", &out->train.tf32, err)) != 0)
        return rc;
    if (td_pv_get(job, "precision") != NULL)
        out->train.precision = map[p];
    if (t == NULL)
        return 0;
    if (td_pv_double(t, &x) != 0 || !isfinite(x) || x <= 0 || x > TD_JOB_MAX_NCCL_TIMEOUT)
        return bad(err, "", "nccl_timeout_s",
                   "must be a number of seconds > 0 (at most 86400, a day)");
    out->nccl_timeout_s = x;
    return 0;
}

/* The schedule a sensorlm takes when its job names none: the seed learner's recipe (AdamW, the
 * optimizer's default anyway, and rsqrt with these fractions of the steps). */
#define TD_SLM_WARMUP   0.1f
#define TD_SLM_COOLDOWN 0.1f

/* sensorlm reads sensor data and only it does; its default schedule. */
static int sensorlm_pairing(const td_pval *job, td_train_config *c, td_error_t *err)
{
    if (c->model == TD_MODEL_SENSORLM && c->data != TD_DATA_SENSOR)
        return td_error_set(err, TD_EJOB, "data.kind: a sensorlm model reads \"sensor\" data");
    if (c->model != TD_MODEL_SENSORLM && c->data == TD_DATA_SENSOR)
        return td_error_set(err, TD_EJOB,
                            "data.kind: \"sensor\" data is read by a \"sensorlm\" model only");
    if (c->model == TD_MODEL_SENSORLM && td_pv_get(job, "schedule") == NULL) {
        c->schedule = TD_SCHED_RSQRT;
        c->warmup = TD_SLM_WARMUP;
        c->cooldown = TD_SLM_COOLDOWN;
    }
    return 0;
}

/* nodes, devices_per_node, min_nodes, max_restarts: the shape of a job that spans nodes. A
 * job of one node names its devices with "devices"; one of several, with devices_per_node,
 * the same on every node. */
static int parse_nodes(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    int rc;

    out->nodes = 1;
    out->devices_per_node = 1;
    out->max_restarts = 0;
    if ((rc = get_int32(job, "", "nodes", 1, TD_JOB_MAX_NODES,
                        "must be a positive integer (at most 256)", &out->nodes, err)) ||
        (rc = get_int32(job, "", "devices_per_node", 1, TD_JOB_MAX_DEVICES,
                        "must be a positive integer (at most 64)", &out->devices_per_node, err)) ||
        (rc = get_int32(job, "", "max_restarts", 0, 1000, "must be an integer from 0 to 1000",
                        &out->max_restarts, err)))
        return rc;
    out->min_nodes = out->nodes;
    if ((rc = get_int32(job, "", "min_nodes", 1, out->nodes,
                        "must be a positive integer, at most nodes", &out->min_nodes, err)))
        return rc;
    if (out->nodes == 1) {
        if (td_pv_get(job, "devices_per_node") != NULL && td_pv_get(job, "devices") != NULL)
            return td_error_set(err, TD_EJOB,
                                "devices_per_node: give devices or devices_per_node, not both");
        if (td_pv_get(job, "devices_per_node") != NULL)
            out->devices = out->devices_per_node;
        out->devices_per_node = out->devices;
        return 0;
    }
    if (td_pv_get(job, "devices") != NULL)
        return td_error_set(err, TD_EJOB,
                            "devices: a job of %d nodes names its devices with devices_per_node",
                            out->nodes);
    if ((int64_t)out->nodes * out->devices_per_node > out->train.batch_size && !out->batch_auto)
        return td_error_set(err, TD_EJOB,
                            "batch_size: %d rows cannot be split over %d nodes x %d devices",
                            out->train.batch_size, out->nodes, out->devices_per_node);
    return 0;
}

/* A label's key (labels' keys): 1 to TD_JOB_LABEL_MAX bytes of letters, digits, '.', '_', '-'
 * and '/', starting with a letter or a digit, as Kubernetes' label names. */
static int label_key_ok(const char *k, size_t len)
{
    if (len == 0 || len > TD_JOB_LABEL_MAX || !isalnum((unsigned char)k[0]))
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!isalnum((unsigned char)k[i]) && k[i] != '.' && k[i] != '_' && k[i] != '-' &&
            k[i] != '/')
            return 0;
    return 1;
}

/* labels: {key: value, ...}: at most TD_JOB_MAX_LABELS, each value a string of at most
 * TD_JOB_LABEL_MAX bytes. The daemon keeps them in the job's spec; list, prune and the
 * clients select jobs by them (PROTOCOL.md, "list"). */
static int parse_labels(const td_pval *labels, td_error_t *err)
{
    if (labels == NULL)
        return 0;
    if (td_pv_type_of(labels) != TD_PV_MAP)
        return td_error_set(err, TD_EJOB, "labels: must be an object of names and strings");
    if (td_pv_len(labels) > TD_JOB_MAX_LABELS)
        return td_error_set(err, TD_EJOB, "labels: %zu labels; a job may have at most %d",
                            td_pv_len(labels), TD_JOB_MAX_LABELS);
    for (size_t i = 0; i < td_pv_len(labels); i++) {
        size_t klen = 0, vlen = 0;
        const char *k = td_pv_str(td_pv_key_at(labels, i), &klen);
        const char *v = td_pv_str(td_pv_val_at(labels, i), &vlen);
        if (k == NULL || !label_key_ok(k, klen))
            return td_error_set(err, TD_EJOB,
                                "labels: '%.*s': a label's name is 1 to %d bytes of letters, "
                                "digits, '.', '_', '-' and '/', starting with a letter or digit",
                                k != NULL ? (int)(klen > 80 ? 80 : klen) : 1, k != NULL ? k : "?",
                                TD_JOB_LABEL_MAX);
        if (v == NULL || vlen > TD_JOB_LABEL_MAX)
            return td_error_set(err, TD_EJOB, "labels.%.*s: must be a string of at most %d bytes",
                                (int)klen, k, TD_JOB_LABEL_MAX);
    }
    return 0;
}

static int parse_job(const td_pval *job, td_jobspec *out, int files, td_error_t *err)
{
    static const char *const keys[] = {"name",
                                       "model",
                                       "data",
                                       "optim",
                                       "schedule",
                                       "batch_size",
                                       "epochs",
                                       "max_steps",
                                       "eval_every",
                                       "eval_batches",
                                       "seed",
                                       "devices",
                                       "priority",
                                       "checkpoint_every",
                                       "keep_checkpoints",
                                       "on_nan",
                                       "debug",
                                       "precision",
                                       "tf32",
                                       "nccl_timeout_s",
                                       "nodes",
                                       "devices_per_node",
                                       "min_nodes",
                                       "max_restarts",
                                       "labels",
                                       "loss",
                                       NULL};
    static const char *const nan_policies[] = {"fail", "skip", NULL};
    int on_nan = 0;
    td_train_config *c = &out->train;
    const td_pval *name;
    int64_t seed;
    int rc;

    memset(out, 0, sizeof(*out));
    out->uid = out->gid = -1; /* the daemon names the submitter */
    out->hold_step = -1;
    td_train_config_defaults(c);
    snprintf(out->name, sizeof(out->name), "job");
    out->devices = 1;
    if (td_pv_type_of(job) != TD_PV_MAP)
        return td_error_set(err, TD_EJOB, "job: must be an object");
    if ((rc = check_keys(job, "", keys, err)) != 0)
        return rc;
    name = td_pv_get(job, "name");
    if (name != NULL &&
        (td_pv_strcpy(name, out->name, sizeof(out->name)) != 0 || out->name[0] == '\0'))
        return bad(err, "", "name", "must be a non-empty string of at most 127 bytes");
    if ((rc = parse_model(td_pv_get(job, "model"), c, files, err)) != 0 ||
        (rc = parse_data(td_pv_get(job, "data"), c, files, err)) != 0 ||
        (rc = parse_loss(td_pv_get(job, "loss"), c, err)) != 0 ||
        (rc = parse_optim(td_pv_get(job, "optim"), c, err)) != 0 ||
        (rc = parse_schedule(td_pv_get(job, "schedule"), c, err)) != 0 ||
        (rc = parse_debug(td_pv_get(job, "debug"), out, err)) != 0 ||
        (rc = parse_labels(td_pv_get(job, "labels"), err)) != 0 ||
        (rc = sensorlm_pairing(job, c, err)) != 0)
        return rc;
    if ((rc = get_choice(job, "", "on_nan", nan_policies, 0, &on_nan, err)) != 0)
        return rc;
    c->on_nan = on_nan == 0 ? TD_ON_NAN_FAIL : TD_ON_NAN_SKIP;
    if ((rc = get_int32(job, "", "eval_batches", 0, 1 << 30,
                        "must be an integer >= 0 (0: the whole valid split)", &c->eval_batches,
                        err)) ||
        (rc = get_int(job, "", "checkpoint_every", 0, INT64_MAX / 2,
                      "must be an integer >= 0 (0: only on cancel and shutdown)",
                      &c->checkpoint_every, err)) ||
        (rc = get_int32(job, "", "keep_checkpoints", 1, 1000, "must be an integer from 1 to 1000",
                        &c->keep_checkpoints, err)))
        return rc;
    if ((rc = parse_batch(job, out, err)) != 0 || (rc = parse_device_keys(job, out, err)) != 0)
        return rc;
    if ((rc = get_int32(job, "", "epochs", 1, 1 << 20, "must be a positive integer", &c->epochs,
                        err)) ||
        (rc = get_int(job, "", "max_steps", 0, INT64_MAX / 2, "must be an integer >= 0",
                      &c->max_steps, err)) ||
        (rc = get_int(job, "", "eval_every", 0, INT64_MAX / 2, "must be an integer >= 0",
                      &c->eval_every, err)) ||
        (rc = get_int32(job, "", "devices", 1, TD_JOB_MAX_DEVICES,
                        "must be a positive integer (at most 64)", &out->devices, err)) ||
        (rc = get_int32(job, "", "priority", -1000000, 1000000,
                        "must be an integer in [-1000000, 1000000]", &out->priority, err)))
        return rc;
    seed = (int64_t)c->seed;
    if ((rc = get_int(job, "", "seed", 0, INT64_MAX, "must be an integer >= 0", &seed, err)))
        return rc;
    c->seed = (uint64_t)seed;
    return parse_nodes(job, out, err);
}

/* Whether map key k is the string name. */
static int is_key(const td_pval *k, const char *name)
{
    size_t len;
    const char *s = td_pv_str(k, &len);

    return s != NULL && len == strlen(name) && memcmp(s, name, len) == 0;
}

int td_jobspec_set_batch(const void *spec, size_t len, int batch, void **out, size_t *out_len,
                         td_error_t *err)
{
    td_proto_frame *f = NULL;
    const td_pval *root;
    const void *body;
    size_t n, blen;
    int has = 0, rc;
    td_error_t why;
    td_pw w;

    *out = NULL;
    *out_len = 0;
    td_pw_init(&w);
    rc = td_proto_decode(spec, len, &f, &why);
    if (rc != 0) {
        rc = td_error_set(err, TD_EPROTO, "the stored job is not a msgpack map: %s", why.msg);
        goto out;
    }
    root = td_proto_frame_root(f);
    n = td_pv_len(root);
    for (size_t i = 0; i < n; i++)
        has |= is_key(td_pv_key_at(root, i), "batch_size");
    /* The other pairs go out as they came, in their order; batch_size keeps its place, or
     * comes last when the job had none. */
    td_pw_map_open(&w);
    for (size_t i = 0; i < n; i++) {
        const td_pval *k = td_pv_key_at(root, i);
        td_pw_val(&w, k);
        if (is_key(k, "batch_size"))
            td_pw_int(&w, batch);
        else
            td_pw_val(&w, td_pv_val_at(root, i));
    }
    if (!has) {
        td_pw_str(&w, "batch_size");
        td_pw_int(&w, batch);
    }
    td_pw_map_close(&w);
    body = td_pw_body(&w, &blen);
    if (w.failed || body == NULL || (*out = malloc(blen)) == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "out of memory re-encoding a job");
        goto out;
    }
    memcpy(*out, body, blen);
    *out_len = blen;
out:
    td_pw_free(&w);
    td_proto_frame_free(f);
    return rc;
}

/* The groups of uid: its primary gid and its supplementary groups. */
static int user_groups(int64_t uid, int64_t gid, gid_t *groups, int *n)
{
    struct passwd pw, *found = NULL;
    char buf[2048];

    groups[0] = (gid_t)gid;
    if (getpwuid_r((uid_t)uid, &pw, buf, sizeof(buf), &found) != 0 || found == NULL) {
        *n = 1; /* a uid without a passwd entry has only the group it connected with */
        return 0;
    }
    if (getgrouplist(pw.pw_name, (gid_t)gid, groups, n) < 0)
        return -1;
    return 0;
}

/* Whether a (uid, groups) process may access st with the rwx bit (4, 2 or 1) given. */
static int may(const struct stat *st, int64_t uid, const gid_t *groups, int ngroups, int bit)
{
    if ((int64_t)st->st_uid == uid)
        return (st->st_mode >> 6) & bit;
    for (int i = 0; i < ngroups; i++)
        if (st->st_gid == groups[i])
            return (st->st_mode >> 3) & bit;
    return st->st_mode & bit;
}

#define TD_MAX_GROUPS 256 /* supplementary groups looked at per user */

/* Whether uid could read path: search on every directory of its resolved path, read on it. */
static int readable_as(const char *path, int64_t uid, const gid_t *groups, int ngroups)
{
    char real[PATH_MAX];
    struct stat st;

    if (realpath(path, real) == NULL)
        return 0;
    for (char *p = real + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (stat(real, &st) != 0)
                return 0;
            if (c == '\0')
                return may(&st, uid, groups, ngroups, 4);
            if (!may(&st, uid, groups, ngroups, 1))
                return 0;
            *p = c;
        }
    }
}

/* Checks one path or glob of the job's field as the submitter. */
static int check_one(const char *what, const char *pat, int64_t uid, const gid_t *groups,
                     int ngroups, td_error_t *err)
{
    glob_t g;
    int rc = 0;

    if (glob(pat, GLOB_NOSORT, NULL, &g) != 0) {
        globfree(&g);
        return td_error_set(err, TD_EJOB, "%s: no file matches %s", what, pat);
    }
    for (size_t i = 0; i < g.gl_pathc && rc == 0; i++)
        if (!readable_as(g.gl_pathv[i], uid, groups, ngroups))
            rc = td_error_set(err, TD_EPERM, "%s: permission denied: uid %lld cannot read %s", what,
                              (long long)uid, g.gl_pathv[i]);
    globfree(&g);
    return rc;
}

int td_jobspec_check_access(const td_jobspec *spec, int64_t uid, int64_t gid, td_error_t *err)
{
    const td_train_config *c = &spec->train;
    gid_t groups[TD_MAX_GROUPS];
    int ngroups = TD_MAX_GROUPS, rc = 0;
    char name[48];

    if (uid == 0)
        return td_jobspec_check_files(spec, uid, gid, err);
    if (uid < 0 || gid < 0)
        return td_error_set(err, TD_EPERM, "permission denied: the submitter is unknown");
    if (user_groups(uid, gid, groups, &ngroups) != 0)
        return td_error_set(err, TD_EPERM, "permission denied: uid %lld is in too many groups",
                            (long long)uid);
    if (c->data == TD_DATA_IDX) {
        if ((rc = check_one("data.train.images", c->train.images, uid, groups, ngroups, err)) ||
            (rc = check_one("data.train.labels", c->train.labels, uid, groups, ngroups, err)))
            return rc;
        if (c->test.images[0] != '\0' &&
            ((rc = check_one("data.test.images", c->test.images, uid, groups, ngroups, err)) ||
             (rc = check_one("data.test.labels", c->test.labels, uid, groups, ngroups, err))))
            return rc;
    }
    for (int i = 0; i < c->n_train_files && rc == 0; i++) {
        snprintf(name, sizeof(name), "data.train[%d]", i);
        rc = check_one(name, c->train_files[i], uid, groups, ngroups, err);
    }
    for (int i = 0; i < c->n_valid_files && rc == 0; i++) {
        snprintf(name, sizeof(name), "data.valid[%d]", i);
        rc = check_one(name, c->valid_files[i], uid, groups, ngroups, err);
    }
    if (rc == 0 && c->init_from[0] != '\0')
        rc = check_one("model.init_from", c->init_from, uid, groups, ngroups, err);
    if (rc == 0)
        rc = td_jobspec_check_files(spec, uid, gid, err);
    return rc;
}

int td_jobspec_check_files(const td_jobspec *spec, int64_t uid, int64_t gid, td_error_t *err)
{
    td_data_access as_user = {.uid = uid, .gid = gid};
    td_error_t e = {0};
    int rc = td_data_access_begin(&as_user, &e);

    if (rc == 0) {
        rc = td_train_check_files(&spec->train, &e);
        td_data_access_end();
    }
    if (rc == 0)
        return 0;
    return td_error_set(err, rc == TD_EPERM ? TD_EPERM : TD_EJOB, "%s", e.msg);
}

/* ---- text from the submitter ---- */

#define TEXT_PATH_MAX 160 /* bytes of a field's dotted path in a message */

/* Refuses a str at path that is not UTF-8 text without control characters, naming the
 * offending byte. */
static int check_str(const td_pval *v, const char *path, const char *what, td_error_t *err)
{
    size_t len, at = 0;
    const char *s = td_pv_str(v, &len);
    int bad_text = s != NULL ? td_text_check(s, len, &at) : TD_TEXT_OK;

    if (bad_text == TD_TEXT_OK)
        return 0;
    return td_error_set(err, TD_EJOB, "%s%s: must be %s (byte %zu is 0x%02x)", path, what,
                        bad_text == TD_TEXT_CONTROL ? "text without control characters"
                                                    : "valid UTF-8 text",
                        at, (unsigned char)s[at]);
}

/* Walks v, the value at path, checking every string in it and every map key. */
static int check_text(const td_pval *v, char *path, size_t used, td_error_t *err)
{
    int rc = 0;

    if (td_pv_type_of(v) == TD_PV_ARRAY) {
        for (size_t i = 0; i < td_pv_len(v) && rc == 0; i++) {
            snprintf(path + used, TEXT_PATH_MAX - used, "[%zu]", i);
            rc = check_text(td_pv_at(v, i), path, strlen(path), err);
        }
    } else if (td_pv_type_of(v) == TD_PV_MAP) {
        for (size_t i = 0; i < td_pv_len(v) && rc == 0; i++) {
            const td_pval *k = td_pv_key_at(v, i);
            size_t klen = 0;
            const char *ks = td_pv_str(k, &klen);
            path[used] = '\0';
            if ((rc = check_str(k, used > 0 ? path : "job", ": a key", err)) != 0)
                break;
            snprintf(path + used, TEXT_PATH_MAX - used, "%s%.*s", used > 0 ? "." : "", (int)klen,
                     ks != NULL ? ks : "?");
            rc = check_text(td_pv_val_at(v, i), path, strlen(path), err);
        }
    } else {
        rc = check_str(v, used > 0 ? path : "job", "", err);
    }
    path[used] = '\0';
    return rc;
}

int td_jobspec_check_text(const td_pval *job, td_error_t *err)
{
    char path[TEXT_PATH_MAX] = "";

    return check_text(job, path, 0, err);
}

int td_jobspec_parse(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    return parse_job(job, out, FILES_CHECK, err);
}

int td_jobspec_parse_submit(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    return parse_job(job, out, FILES_DEFER, err);
}

int td_jobspec_check_paths(const td_jobspec *spec, td_error_t *err)
{
    const td_train_config *c = &spec->train;
    char where[48];
    int rc = 0;

    /* in td_jobspec_parse's order: the model's, then the data's */
    if (c->init_from[0] != '\0' && (rc = readable("model", "init_from", c->init_from, err)) != 0)
        return rc;
    if (c->data == TD_DATA_IDX) {
        if ((rc = readable("data.train", "images", c->train.images, err)) != 0 ||
            (rc = readable("data.train", "labels", c->train.labels, err)) != 0)
            return rc;
        if (c->test.images[0] != '\0' &&
            ((rc = readable("data.test", "images", c->test.images, err)) != 0 ||
             (rc = readable("data.test", "labels", c->test.labels, err)) != 0))
            return rc;
    }
    for (int i = 0; i < c->n_train_files && rc == 0; i++) {
        snprintf(where, sizeof(where), c->n_train_files > 1 ? "data.train[%d]" : "data.train", i);
        rc = check_pattern(where, c->train_files[i], err);
    }
    for (int i = 0; i < c->n_valid_files && rc == 0; i++) {
        snprintf(where, sizeof(where), c->n_valid_files > 1 ? "data.valid[%d]" : "data.valid", i);
        rc = check_pattern(where, c->valid_files[i], err);
    }
    return rc;
}

int td_jobspec_parse_stored(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    return parse_job(job, out, 0, err);
}
