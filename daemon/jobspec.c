/* Job validation (see jobspec.h). Each section of the job file has one function; each takes
 * the dotted path of its section so that every message names the exact field. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "jobspec.h"

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

static int get_bool(const td_pval *m, const char *path, const char *key, int *out,
                    td_error_t *err)
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

/* A readable file path: the daemon refuses a missing dataset at submit, naming it. */
static int get_path(const td_pval *m, const char *path, const char *key, char *out, size_t size,
                    td_error_t *err)
{
    const td_pval *v = td_pv_get(m, key);
    char why[TD_PATH_MAX + 64];

    if (v == NULL)
        return bad(err, path, key, "is required");
    if (td_pv_strcpy(v, out, size) != 0 || out[0] == '\0')
        return bad(err, path, key, "must be a file path (a non-empty string)");
    if (access(out, R_OK) != 0) {
        snprintf(why, sizeof(why), "cannot read %s: %s", out, strerror(errno));
        return bad(err, path, key, why);
    }
    return 0;
}

static int need_map(const td_pval *v, const char *path, const char *key, td_error_t *err)
{
    if (v == NULL)
        return bad(err, path, key, "is required");
    if (td_pv_type_of(v) != TD_PV_MAP)
        return bad(err, path, key, "must be an object");
    return 0;
}

static int parse_model(const td_pval *m, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind", "layers", NULL};
    static const char *const kinds[] = {"mlp", NULL};
    const td_pval *layers;
    int kind = 0, rc;
    char path[32];

    if ((rc = need_map(m, "", "model", err)) != 0 || (rc = check_keys(m, "model", keys, err)))
        return rc;
    if ((rc = get_choice(m, "model", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    c->model = TD_MODEL_MLP;
    layers = td_pv_get(m, "layers");
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

static int parse_split(const td_pval *d, const char *key, td_idx_split *s, td_error_t *err)
{
    static const char *const keys[] = {"images", "labels", NULL};
    const td_pval *m = td_pv_get(d, key);
    char path[32];
    int rc;

    snprintf(path, sizeof(path), "data.%s", key);
    if ((rc = need_map(m, "data", key, err)) != 0 || (rc = check_keys(m, path, keys, err)) != 0)
        return rc;
    if ((rc = get_path(m, path, "images", s->images, sizeof(s->images), err)) != 0)
        return rc;
    return get_path(m, path, "labels", s->labels, sizeof(s->labels), err);
}

static int parse_data(const td_pval *d, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind", "train", "test", "shuffle", NULL};
    static const char *const kinds[] = {"idx", NULL};
    int kind = 0, rc;

    if ((rc = need_map(d, "", "data", err)) != 0 || (rc = check_keys(d, "data", keys, err)) != 0)
        return rc;
    if ((rc = get_choice(d, "data", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    c->data = TD_DATA_IDX;
    if ((rc = parse_split(d, "train", &c->train, err)) != 0)
        return rc;
    if (td_pv_get(d, "test") != NULL && (rc = parse_split(d, "test", &c->test, err)) != 0)
        return rc;
    return get_bool(d, "data", "shuffle", &c->shuffle, err);
}

static int parse_optim(const td_pval *o, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind",         "lr",       "beta1", "beta2", "eps",
                                       "weight_decay", "momentum", NULL};
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
        (rc = get_float(o, "optim", "momentum", 0, 1, 1, "must be in [0, 1)", &c->momentum,
                        err)) ||
        (rc = get_float(o, "optim", "weight_decay", 0, 1e6, 0, "must be a number >= 0",
                        &c->weight_decay, err)))
        return rc;
    if ((rc = get_float(o, "optim", "eps", 0, 1, 0, "must be a positive number", &c->eps, err)))
        return rc;
    if (c->eps <= 0)
        return bad(err, "optim", "eps", "must be a positive number");
    return 0;
}

static int parse_schedule(const td_pval *s, td_train_config *c, td_error_t *err)
{
    static const char *const keys[] = {"kind", NULL};
    static const char *const kinds[] = {"constant", NULL};
    int kind = 0, rc;

    if (s == NULL)
        return 0;
    if ((rc = need_map(s, "", "schedule", err)) != 0 ||
        (rc = check_keys(s, "schedule", keys, err)) != 0)
        return rc;
    if ((rc = get_choice(s, "schedule", "kind", kinds, 1, &kind, err)) != 0)
        return rc;
    c->schedule = TD_SCHED_CONSTANT;
    return 0;
}

int td_jobspec_parse(const td_pval *job, td_jobspec *out, td_error_t *err)
{
    static const char *const keys[] = {"name",       "model",   "data",      "optim",
                                       "schedule",   "batch_size", "epochs", "max_steps",
                                       "eval_every", "seed",    "devices",   "priority",
                                       NULL};
    td_train_config *c = &out->train;
    const td_pval *name;
    int64_t seed;
    int rc;

    memset(out, 0, sizeof(*out));
    td_train_config_defaults(c);
    snprintf(out->name, sizeof(out->name), "job");
    out->devices = 1;
    if (td_pv_type_of(job) != TD_PV_MAP)
        return td_error_set(err, TD_EJOB, "job: must be an object");
    if ((rc = check_keys(job, "", keys, err)) != 0)
        return rc;
    name = td_pv_get(job, "name");
    if (name != NULL && (td_pv_strcpy(name, out->name, sizeof(out->name)) != 0 ||
                         out->name[0] == '\0'))
        return bad(err, "", "name", "must be a non-empty string of at most 127 bytes");
    if ((rc = parse_model(td_pv_get(job, "model"), c, err)) != 0 ||
        (rc = parse_data(td_pv_get(job, "data"), c, err)) != 0 ||
        (rc = parse_optim(td_pv_get(job, "optim"), c, err)) != 0 ||
        (rc = parse_schedule(td_pv_get(job, "schedule"), c, err)) != 0)
        return rc;
    if ((rc = get_int32(job, "", "batch_size", 1, 1 << 20, "must be a positive integer",
                        &c->batch_size, err)) ||
        (rc = get_int32(job, "", "epochs", 1, 1 << 20, "must be a positive integer", &c->epochs,
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
    return 0;
}
