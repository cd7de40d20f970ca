/* JSON for trainctl, through jansson: reading a job file, applying --set KEY=VALUE to it,
 * converting it to msgpack for the submit request, and the way back, from a decoded frame
 * value to JSON for --json output. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/client.h"
#include "proto/jsonpack.h"
#include "common/td_text.h"

/* 15 significant digits print every decimal a person wrote (3e-4, 1700000000.123) as written,
 * where jansson's default of 17 would show 0.00029999999999999997. */
#define TC_JSON_REAL_FLAGS JSON_REAL_PRECISION(15)

/* Opens the job file; "-" is standard input. */
static int open_job(const char *path, FILE **out)
{
    struct stat st;
    FILE *f;

    if (strcmp(path, "-") == 0) {
        *out = stdin;
        return TC_OK;
    }
    f = fopen(path, "r");
    if (f == NULL)
        return tc_err(TC_NOINPUT, "cannot open %s: %s", path, strerror(errno));
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
        fclose(f);
        return tc_err(TC_NOINPUT, "cannot read %s: %s", path, strerror(EISDIR));
    }
    *out = f;
    return TC_OK;
}

int tc_job_load(const char *path, json_t **out)
{
    const char *name = strcmp(path, "-") == 0 ? "<stdin>" : path;
    json_error_t je;
    json_t *j;
    FILE *f = NULL;
    int rc;

    *out = NULL;
    if ((rc = open_job(path, &f)) != TC_OK)
        return rc;
    j = json_loadf(f, JSON_REJECT_DUPLICATES, &je);
    if (j == NULL && ferror(f))
        rc = tc_err(TC_NOINPUT, "cannot read %s: %s", name, strerror(errno));
    else if (j == NULL)
        rc = tc_err(TC_DATAERR, "%s:%d:%d: %s", name, je.line, je.column, je.text);
    else if (!json_is_object(j))
        rc = tc_err(TC_DATAERR, "%s: the job must be a JSON object ({...})", name);
    if (f != stdin)
        fclose(f);
    if (rc != TC_OK)
        json_decref(j);
    else
        *out = j;
    return rc;
}

/* VALUE of --set: JSON when it parses as JSON, else the text as a string. */
static json_t *set_value(const char *text)
{
    json_t *v = json_loads(text, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, NULL);

    return v != NULL ? v : json_string(text);
}

/* One step of a --set key: a member name, or (after it) an array index, "layers[1]". */
typedef struct set_step {
    char name[128]; /* a member; empty for an index */
    long index;     /* -1 for a member */
} set_step;

/* Cuts KEY of --set (arg, for messages) into its steps: names between dots, each followed by
 * any number of [N] (the notation of the validator's own messages: model.layers[1]). */
static int set_steps(const char *arg, const char *key, size_t klen, set_step *steps, int max,
                     int *n)
{
    size_t i = 0;

    *n = 0;
    while (i < klen) {
        size_t j = i;
        while (j < klen && key[j] != '.' && key[j] != '[')
            j++;
        if (j == i || j - i >= sizeof(steps[0].name) || *n >= max)
            return tc_err(TC_USAGE, "--set %s: %s", arg,
                          j == i ? "empty key" : "key too long or too deep");
        memcpy(steps[*n].name, key + i, j - i);
        steps[*n].name[j - i] = '\0';
        steps[(*n)++].index = -1;
        while (j < klen && key[j] == '[') {
            char *end = NULL;
            long v = strtol(key + j + 1, &end, 10);
            if (end == key + j + 1 || end >= key + klen || *end != ']' || v < 0 || *n >= max ||
                key[j + 1] == '+' || key[j + 1] == '-' || key[j + 1] == ' ')
                return tc_err(TC_USAGE, "--set %s: an index is [N], N an integer >= 0", arg);
            steps[*n].name[0] = '\0';
            steps[(*n)++].index = v;
            j = (size_t)(end - key) + 1;
        }
        if (j < klen && key[j] != '.')
            return tc_err(TC_USAGE, "--set %s: expected '.' or '[' after ']'", arg);
        i = j + (j < klen);
        if (j < klen && i == klen)
            return tc_err(TC_USAGE, "--set %s: empty key", arg);
    }
    if (*n == 0)
        return tc_err(TC_USAGE, "--set %s: empty key", arg);
    return TC_OK;
}

/* The path so far, "model.layers[1]", for messages. */
static void path_text(const set_step *steps, int n, char *buf, size_t size)
{
    size_t used = 0;

    buf[0] = '\0';
    for (int i = 0; i < n && used < size; i++) {
        int k = steps[i].index >= 0
                    ? snprintf(buf + used, size - used, "[%ld]", steps[i].index)
                    : snprintf(buf + used, size - used, "%s%s", i ? "." : "", steps[i].name);
        used += k > 0 ? (size_t)k : 0;
    }
}

/* Sets value at steps[0..n) under v: a missing member is made an object on the way (a new
 * key), an index must be inside its array or one past its end (which appends). Takes value. */
static int set_at(json_t *v, const char *arg, const set_step *steps, int n, json_t *value)
{
    char where[256];

    for (int i = 0; i < n; i++) {
        const set_step *st = &steps[i];
        int last = i == n - 1;
        json_t *child;
        path_text(steps, i, where, sizeof(where));
        if (st->index < 0) {
            if (!json_is_object(v))
                goto not_object;
            if (last)
                return json_object_set_new(v, st->name, value) == 0
                           ? TC_OK
                           : tc_err(TC_FAILED, "out of memory");
            child = json_object_get(v, st->name);
            if (child == NULL) {
                child = steps[i + 1].index >= 0 ? NULL : json_object();
                if (child == NULL) {
                    json_decref(value);
                    path_text(steps, i + 1, where, sizeof(where));
                    return tc_err(TC_USAGE, "--set %s: the job has no list %s to index", arg,
                                  where);
                }
                if (json_object_set_new(v, st->name, child) != 0)
                    goto oom;
            }
        } else {
            size_t size = json_array_size(v);
            if (!json_is_array(v)) {
                json_decref(value);
                return tc_err(TC_USAGE, "--set %s: %s is not a list in the job", arg, where);
            }
            if ((size_t)st->index > size) {
                json_decref(value);
                return tc_err(TC_USAGE, "--set %s: %s has %zu elements (an index from 0 to %zu)",
                              arg, where, size, size);
            }
            if (last) {
                int rc = (size_t)st->index == size
                             ? json_array_append_new(v, value)
                             : json_array_set_new(v, (size_t)st->index, value);
                return rc == 0 ? TC_OK : tc_err(TC_FAILED, "out of memory");
            }
            if ((size_t)st->index == size) {
                json_decref(value);
                return tc_err(TC_USAGE, "--set %s: %s has %zu elements", arg, where, size);
            }
            child = json_array_get(v, (size_t)st->index);
        }
        v = child;
    }
    json_decref(value);
    return tc_err(TC_USAGE, "--set %s: empty key", arg);
not_object:
    json_decref(value);
    return tc_err(TC_USAGE, "--set %s: '%s' is not an object in the job", arg, where);
oom:
    json_decref(value);
    return tc_err(TC_FAILED, "out of memory");
}

#define SET_DEPTH 16 /* steps of a --set key */

int tc_job_set(json_t *job, const char *assignment)
{
    const char *eq = strchr(assignment, '=');
    set_step steps[SET_DEPTH];
    json_t *value;
    int n = 0, rc;

    if (eq == NULL)
        return tc_err(TC_USAGE, "--set needs KEY=VALUE, not '%s'", assignment);
    rc = set_steps(assignment, assignment, (size_t)(eq - assignment), steps, SET_DEPTH, &n);
    if (rc != TC_OK)
        return rc;
    value = set_value(eq + 1);
    if (value == NULL)
        return tc_err(TC_USAGE, "--set %s: the value is not valid UTF-8", assignment);
    return set_at(job, assignment, steps, n, value);
}

/* path made absolute against cwd into a new string in *out; NULL (nothing to change) for a
 * value that is not a string, empty, or already absolute. A leading "./" is dropped. */
static int absolute(const json_t *v, const char *cwd, json_t **out)
{
    const char *p = json_string_value(v);
    size_t n;
    char *joined;

    *out = NULL;
    if (p == NULL || p[0] == '\0' || p[0] == '/')
        return TC_OK;
    while (p[0] == '.' && p[1] == '/')
        for (p += 2; p[0] == '/'; p++)
            ;
    n = strlen(cwd) + 1 + strlen(p) + 1;
    joined = malloc(n);
    if (joined == NULL)
        return tc_err(TC_FAILED, "out of memory");
    snprintf(joined, n, "%s%s%s", cwd, strcmp(cwd, "/") == 0 ? "" : "/", p);
    *out = json_string(joined);
    free(joined);
    return *out != NULL ? TC_OK : tc_err(TC_DATAERR, "a path of the job is not valid UTF-8");
}

/* obj[key] made absolute when it is a relative path. */
static int resolve_member(json_t *obj, const char *key, const char *cwd)
{
    json_t *abs = NULL;
    int rc = absolute(json_object_get(obj, key), cwd, &abs);

    if (rc == TC_OK && abs != NULL && json_object_set_new(obj, key, abs) != 0)
        rc = tc_err(TC_FAILED, "out of memory");
    return rc;
}

/* A split of data: a path or glob, a list of them, or {images, labels}. */
static int resolve_split(json_t *data, const char *key, const char *cwd)
{
    json_t *v = json_object_get(data, key), *abs;
    int rc = TC_OK;

    if (json_is_string(v))
        return resolve_member(data, key, cwd);
    if (json_is_object(v)) {
        if ((rc = resolve_member(v, "images", cwd)) == TC_OK)
            rc = resolve_member(v, "labels", cwd);
        return rc;
    }
    for (size_t i = 0; json_is_array(v) && i < json_array_size(v) && rc == TC_OK; i++) {
        rc = absolute(json_array_get(v, i), cwd, &abs);
        if (rc == TC_OK && abs != NULL && json_array_set_new(v, i, abs) != 0)
            rc = tc_err(TC_FAILED, "out of memory");
    }
    return rc;
}

int tc_job_resolve_paths(json_t *job)
{
    static const char *const splits[] = {"train", "test", "valid"};
    json_t *data = json_object_get(job, "data"), *model = json_object_get(job, "model");
    char *cwd = getcwd(NULL, 0);
    int rc = TC_OK;

    if (cwd == NULL)
        return tc_err(TC_NOINPUT, "cannot resolve the job's relative paths: %s", strerror(errno));
    for (size_t i = 0; json_is_object(data) && i < 3 && rc == TC_OK; i++)
        rc = resolve_split(data, splits[i], cwd);
    if (rc == TC_OK && json_is_object(model))
        rc = resolve_member(model, "init_from", cwd);
    free(cwd);
    return rc;
}

int tc_json_to_pw(td_pw *w, const json_t *v, int depth)
{
    td_error_t err;

    if (td_json_to_pw(w, v, depth, &err) != 0)
        return tc_err(TC_DATAERR, "%s", err.msg);
    return TC_OK;
}

/* A string from the wire; bytes that are not UTF-8 become '?' so jansson accepts it. */
static json_t *string_to_json(const char *s, size_t len)
{
    json_t *j = json_stringn(s, len);
    char *copy;
    size_t i;

    if (j != NULL || len == 0)
        return j;
    copy = malloc(len);
    if (copy == NULL)
        return NULL;
    for (i = 0; i < len; i++)
        copy[i] = (unsigned char)s[i] < 0x80 ? s[i] : '?';
    j = json_stringn(copy, len);
    free(copy);
    return j;
}

static json_t *bin_to_json(const td_pval *v)
{
    static const char hex[] = "0123456789abcdef";
    size_t len = 0, i;
    const unsigned char *p = (const unsigned char *)td_pv_str(v, &len);
    char *text;
    json_t *j;

    if (p == NULL)
        return json_string("");
    text = malloc(2 * len + 1);
    if (text == NULL)
        return NULL;
    for (i = 0; i < len; i++) {
        text[2 * i] = hex[p[i] >> 4];
        text[2 * i + 1] = hex[p[i] & 15];
    }
    j = json_stringn(text, 2 * len);
    free(text);
    return j;
}

static json_t *array_to_json(const td_pval *v)
{
    json_t *arr = json_array(), *item;
    size_t i;

    for (i = 0; arr != NULL && i < td_pv_len(v); i++) {
        item = tc_pv_to_json(td_pv_at(v, i));
        if (item == NULL || json_array_append_new(arr, item) != 0) {
            json_decref(arr);
            arr = NULL;
        }
    }
    return arr;
}

/* Maps from traind have string keys; a key of another type is left out. */
static json_t *map_to_json(const td_pval *v)
{
    json_t *obj = json_object(), *item;
    const char *k;
    size_t i, klen = 0;
    char *key;

    for (i = 0; obj != NULL && i < td_pv_len(v); i++) {
        k = td_pv_str(td_pv_key_at(v, i), &klen);
        if (k == NULL)
            continue;
        key = strndup(k, klen);
        item = key != NULL ? tc_pv_to_json(td_pv_val_at(v, i)) : NULL;
        if (item == NULL || json_object_set_new(obj, key, item) != 0) {
            json_decref(obj);
            obj = NULL;
        }
        free(key);
    }
    return obj;
}

json_t *tc_pv_to_json(const td_pval *v)
{
    int64_t i = 0;
    double d = 0;
    int b = 0;
    size_t len = 0;
    const char *s;

    switch (td_pv_type_of(v)) {
    case TD_PV_BOOL:
        td_pv_bool(v, &b);
        return json_boolean(b);
    case TD_PV_INT:
        td_pv_int(v, &i);
        return json_integer(i);
    case TD_PV_FLOAT:
        td_pv_double(v, &d);
        return isfinite(d) ? json_real(d) : json_null();
    case TD_PV_STR:
        s = td_pv_str(v, &len);
        return string_to_json(s, len);
    case TD_PV_BIN:
        return bin_to_json(v);
    case TD_PV_ARRAY:
        return array_to_json(v);
    case TD_PV_MAP:
        return map_to_json(v);
    default:
        return json_null();
    }
}

int tc_dump_json(const json_t *j, int pretty)
{
    size_t flags = TC_JSON_REAL_FLAGS | (pretty ? JSON_INDENT(2) : JSON_COMPACT);

    if (json_dumpf(j, stdout, flags) != 0 || fputc('\n', stdout) == EOF)
        return tc_err(TC_FAILED, "cannot write to standard output: %s", strerror(errno));
    return TC_OK;
}

/* A scalar as YAML: strings double-quoted with JSON's escapes (YAML reads those as it does
 * JSON's), numbers, booleans and null as JSON writes them. */
static int yaml_scalar(FILE *f, const json_t *j)
{
    char *s = json_dumps(j, JSON_ENCODE_ANY | TC_JSON_REAL_FLAGS);

    if (s == NULL)
        return tc_err(TC_FAILED, "out of memory");
    fputs(s, f);
    free(s);
    return TC_OK;
}

/* j as block YAML at indent: a map's keys one per line, an array's items after "- ", empty
 * ones as {} and []. first: the line is already started (after "- " or "key:"). */
static int yaml_value(FILE *f, const json_t *j, int indent, int after_key)
{
    const char *key;
    json_t *v;
    size_t i, n = 0;
    int rc = TC_OK;

    if (json_is_object(j) && json_object_size(j) > 0) {
        json_object_foreach((json_t *)j, key, v)
        {
            json_t *k = json_string(key);
            if (after_key || n > 0)
                fprintf(f, "\n%*s", indent, "");
            n++;
            rc = k != NULL ? yaml_scalar(f, k) : tc_err(TC_FAILED, "out of memory");
            json_decref(k);
            if (rc != TC_OK)
                return rc;
            fputc(':', f);
            if (!((json_is_object(v) && json_object_size(v) > 0) ||
                  (json_is_array(v) && json_array_size(v) > 0)))
                fputc(' ', f);
            if ((rc = yaml_value(f, v, indent + 2, 1)) != TC_OK)
                return rc;
        }
        return TC_OK;
    }
    if (json_is_array(j) && json_array_size(j) > 0) {
        json_array_foreach(j, i, v)
        {
            if (after_key || i > 0)
                fprintf(f, "\n%*s", after_key ? indent - 2 : indent, "");
            fputs("- ", f);
            if ((rc = yaml_value(f, v, after_key ? indent : indent + 2, 0)) != TC_OK)
                return rc;
        }
        return TC_OK;
    }
    if (json_is_object(j))
        return fputs("{}", f), TC_OK;
    if (json_is_array(j))
        return fputs("[]", f), TC_OK;
    return yaml_scalar(f, j);
}

int tc_dump_yaml(FILE *f, const json_t *j)
{
    int rc = yaml_value(f, j, 0, 0);

    if (rc == TC_OK && (fputc('\n', f) == EOF || ferror(f)))
        rc = tc_err(TC_FAILED, "cannot write to standard output: %s", strerror(errno));
    return rc;
}

int tc_print_json(const td_pval *v, int pretty)
{
    json_t *j = tc_pv_to_json(v);
    int rc;

    if (j == NULL)
        return tc_err(TC_FAILED, "out of memory");
    rc = tc_dump_json(j, pretty);
    json_decref(j);
    return rc;
}

void tc_json_str(FILE *f, const char *s, size_t len)
{
    size_t i = 0, n;
    uint32_t cp;

    fputc('"', f);
    while (i < len) {
        n = td_text_char(s + i, len - i, &cp);
        if (n == 0) {
            fputs("\\ufffd", f); /* a byte of malformed UTF-8: JSON text is UTF-8 */
            i++;
            continue;
        }
        if (cp == '"' || cp == '\\')
            fprintf(f, "\\%c", (char)cp);
        else if (cp == '\n')
            fputs("\\n", f);
        else if (td_text_is_control(cp))
            fprintf(f, "\\u%04x", (unsigned)cp);
        else
            fwrite(s + i, 1, n, f);
        i += n;
    }
    fputc('"', f);
}

int tc_print_reply_json(const td_pval *root)
{
    json_t *j = tc_pv_to_json(root);
    int rc;

    if (j == NULL)
        return tc_err(TC_FAILED, "out of memory");
    json_object_del(j, "type");
    json_object_del(j, "id");
    rc = tc_dump_json(j, 1);
    json_decref(j);
    return rc;
}
