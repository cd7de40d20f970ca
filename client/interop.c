/* The verbs that take a model out of traind: export (the job's latest checkpoint as an llm.c
 * or a safetensors model file, received as a run of chunk frames and written here, with the user's
 * own permissions, as FILE.tmp renamed to FILE once whole) and sample (text generated from it).
 * Both may keep traind busy for a while before the first byte of the reply (a large model to
 * write, a long generation), so their first wait has no time limit. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <msgpack.h>

#include "client/client.h"

/* A bin value's bytes and length, or NULL when v is not a bin. proto.h has no accessor for
 * bin; td_pval is msgpack-c's object. */
static const char *pv_bin(const td_pval *v, size_t *len)
{
    if (td_pv_type_of(v) != TD_PV_BIN)
        return NULL;
    *len = v->via.bin.size;
    return v->via.bin.ptr;
}

static void on_sigint(int sig)
{
    (void)sig;
    tc_interrupted = 1;
}

/* Where the export writes until the file is whole. */
typedef struct outfile {
    const char *path; /* borrowed: -o */
    char *tmp;        /* path.tmp */
    FILE *f;
    int64_t bytes; /* written so far */
} outfile;

static int outfile_open(outfile *o, const char *path)
{
    o->path = path;
    o->bytes = 0;
    o->tmp = malloc(strlen(path) + sizeof(".tmp"));
    if (o->tmp == NULL)
        return tc_err(TC_FAILED, "out of memory");
    sprintf(o->tmp, "%s.tmp", path);
    o->f = fopen(o->tmp, "wb");
    if (o->f == NULL)
        return tc_err(TC_CANTCREAT, "cannot create %s: %s", o->tmp, strerror(errno));
    return TC_OK;
}

static int outfile_write(outfile *o, const char *p, size_t len)
{
    if (fwrite(p, 1, len, o->f) != len)
        return tc_err(TC_CANTCREAT, "cannot write %s: %s", o->tmp, strerror(errno));
    o->bytes += (int64_t)len;
    return TC_OK;
}

/* Flushes, syncs and renames the temp file over path: a crash leaves the old file or the new
 * one, never half of it. */
static int outfile_commit(outfile *o)
{
    int rc = fflush(o->f) != 0 || fsync(fileno(o->f)) != 0 ? -1 : 0;

    if (fclose(o->f) != 0)
        rc = -1;
    o->f = NULL;
    if (rc != 0)
        return tc_err(TC_CANTCREAT, "cannot write %s: %s", o->tmp, strerror(errno));
    if (rename(o->tmp, o->path) != 0)
        return tc_err(TC_CANTCREAT, "cannot rename %s to %s: %s", o->tmp, o->path, strerror(errno));
    return TC_OK;
}

/* Removes the temp file of an export that did not finish. Accepts one never opened. */
static void outfile_drop(outfile *o)
{
    if (o->f != NULL) {
        fclose(o->f);
        unlink(o->tmp);
    }
    free(o->tmp);
}

/* One frame of the export's reply: a chunk (written), or the end (*done, its size checked). */
static int export_frame(const td_proto_frame *f, outfile *out, int *done)
{
    const td_pval *root = td_proto_frame_root(f);
    const td_pval *type = td_pv_get(root, "type");
    const char *data;
    int64_t bytes = -1;
    size_t len = 0;

    if (tc_pv_is(type, "chunk")) {
        data = pv_bin(td_pv_get(root, "data"), &len);
        if (data == NULL)
            return tc_err(TC_PROTOCOL, "traind sent a chunk without data");
        return outfile_write(out, data, len);
    }
    if (!tc_pv_is(type, "end"))
        return tc_err(TC_PROTOCOL, "traind sent an unexpected frame in an export");
    *done = 1;
    if (td_pv_int(td_pv_get(root, "bytes"), &bytes) != 0 || bytes != out->bytes)
        return tc_err(TC_PROTOCOL, "traind announced a model file of %lld bytes but sent %lld",
                      (long long)bytes, (long long)out->bytes);
    return TC_OK;
}

/* Receives the chunks up to the end frame into out. The first frame waits as long as traind
 * takes to write the file; each later one at most TC_REPLY_TIMEOUT_MS. */
static int receive_export(tc_conn *c, const char *sock, outfile *out)
{
    td_proto_frame *f = NULL;
    int rc = TC_OK, done = 0, first = 1;

    while (rc == TC_OK && !done) {
        rc = tc_conn_recv(c, &f, first ? -1 : TC_REPLY_TIMEOUT_MS);
        first = 0;
        if (rc != TC_OK)
            break;
        if (f == NULL)
            return tc_err(TC_UNAVAILABLE, "traind at %s stopped sending the model for %d s", sock,
                          TC_REPLY_TIMEOUT_MS / 1000);
        rc = export_frame(f, out, &done);
        td_proto_frame_free(f);
        f = NULL;
    }
    return rc;
}

/* ---- a directory that loads elsewhere: model.safetensors and config.json ---- */

#define TC_HEADER_MAX (16 << 20) /* bytes of a safetensors header read back: traind's limit */

/* The __metadata__ of the safetensors file at path (a new object), or NULL with the error
 * printed. */
static json_t *read_metadata(const char *path)
{
    unsigned char len8[8];
    uint64_t n = 0;
    json_error_t je;
    json_t *head = NULL, *meta = NULL;
    char *buf = NULL;
    FILE *f = fopen(path, "rb");

    if (f == NULL || fread(len8, 1, 8, f) != 8) {
        tc_err(TC_FAILED, "cannot read %s back: %s", path, f == NULL ? strerror(errno) : "short");
        goto out;
    }
    for (int i = 7; i >= 0; i--)
        n = n << 8 | len8[i];
    if (n == 0 || n > TC_HEADER_MAX || (buf = malloc(n)) == NULL || fread(buf, 1, n, f) != n) {
        tc_err(TC_PROTOCOL, "%s: a safetensors header of %llu bytes could not be read", path,
               (unsigned long long)n);
        goto out;
    }
    head = json_loadb(buf, n, 0, &je);
    meta = json_incref(json_object_get(head, "__metadata__"));
    if (!json_is_object(meta))
        tc_err(TC_PROTOCOL, "%s: no __metadata__ in the header", path);
out:
    if (f != NULL)
        fclose(f);
    free(buf);
    json_decref(head);
    if (meta != NULL && !json_is_object(meta)) {
        json_decref(meta);
        meta = NULL;
    }
    return meta;
}

/* A metadata value (a decimal string) as a JSON integer; 0 when absent. */
static json_t *meta_int(const json_t *meta, const char *key)
{
    const char *v = json_string_value(json_object_get(meta, key));

    return json_integer(v != NULL ? strtoll(v, NULL, 10) : 0);
}

static json_t *meta_str(const json_t *meta, const char *key)
{
    const char *v = json_string_value(json_object_get(meta, key));

    return json_string(v != NULL ? v : "");
}

/* Hugging Face's GPT2Config for a gpt export: transformers' GPT2LMHeadModel.from_pretrained
 * loads the directory (the file's names are GPT2Model's; the lm head is tied to wte).
 * traind's GPT-2 is llm.c's: the tanh GELU ("gelu_new"), LayerNorm eps 1e-5, no dropout. Its
 * tokens are its job's (bytes for a text job: vocab_size 256), so no token is begin or end. */
static json_t *gpt_config(const json_t *meta, int64_t job)
{
    json_t *c =
        json_pack("{s:[s],s:s,s:o,s:o,s:o,s:o,s:o,s:o,s:n,s:s,s:f,s:f,s:f,s:f,s:f,s:b,s:b,"
                  "s:b,s:n,s:n,s:s}",
                  "architectures", "GPT2LMHeadModel", "model_type", "gpt2", "vocab_size",
                  meta_int(meta, "vocab_size"), "n_positions", meta_int(meta, "n_positions"),
                  "n_ctx", meta_int(meta, "n_positions"), "n_embd", meta_int(meta, "n_embd"),
                  "n_layer", meta_int(meta, "n_layer"), "n_head", meta_int(meta, "n_head"),
                  "n_inner", "activation_function", "gelu_new", "resid_pdrop", 0.0, "embd_pdrop",
                  0.0, "attn_pdrop", 0.0, "layer_norm_epsilon", 1e-5, "initializer_range", 0.02,
                  "scale_attn_weights", 1, "tie_word_embeddings", 1, "use_cache", 1, "bos_token_id",
                  "eos_token_id", "torch_dtype", "float32");

    if (c != NULL)
        json_object_set_new(
            c, "traind",
            json_pack("{s:I,s:o}", "job", (json_int_t)job, "step", meta_int(meta, "step")));
    return c;
}

/* A sensorlm export's config: every dimension of README.md's "SensorLM", as numbers. */
static json_t *sensorlm_config(const json_t *meta, int64_t job)
{
    return json_pack(
        "{s:s,s:o,s:o,s:o,s:o,s:o,s:o,s:{s:o,s:o,s:o,s:o,s:o},s:{s:o,s:o,s:o,s:o},"
        "s:{s:I,s:o}}",
        "model_type", "traind-sensorlm", "time_steps", meta_int(meta, "time_steps"), "channels",
        meta_int(meta, "channels"), "patch_t", meta_int(meta, "patch_t"), "patch_c",
        meta_int(meta, "patch_c"), "text_len", meta_int(meta, "text_len"), "embed_dim",
        meta_int(meta, "embed_dim"), "sensor", "pool", meta_str(meta, "sensor.pool"), "d_model",
        meta_int(meta, "sensor.d_model"), "depth", meta_int(meta, "sensor.depth"), "n_head",
        meta_int(meta, "sensor.n_head"), "mlp_dim", meta_int(meta, "sensor.mlp_dim"), "text",
        "d_model", meta_int(meta, "text.d_model"), "depth", meta_int(meta, "text.depth"), "n_head",
        meta_int(meta, "text.n_head"), "mlp_dim", meta_int(meta, "text.mlp_dim"), "traind", "job",
        (json_int_t)job, "step", meta_int(meta, "step"));
}

/* An mlp export's config: its layers, activation and the inputs' scale and offset. */
static json_t *mlp_config(const json_t *meta, int64_t job)
{
    const char *layers = json_string_value(json_object_get(meta, "layers"));
    const char *scale = json_string_value(json_object_get(meta, "input.scale"));
    const char *offset = json_string_value(json_object_get(meta, "input.offset"));
    json_t *list = json_array();

    for (const char *p = layers; p != NULL && *p != '\0' && list != NULL;) {
        char *end;
        json_array_append_new(list, json_integer(strtoll(p, &end, 10)));
        p = *end == ',' ? end + 1 : NULL;
    }
    return json_pack("{s:s,s:o,s:o,s:{s:f,s:f},s:{s:I,s:o}}", "model_type", "traind-mlp", "layers",
                     list, "activation", meta_str(meta, "activation"), "input", "scale",
                     scale != NULL ? strtod(scale, NULL) : 0.0, "offset",
                     offset != NULL ? strtod(offset, NULL) : 0.0, "traind", "job", (json_int_t)job,
                     "step", meta_int(meta, "step"));
}

/* Writes dir/config.json for the safetensors file dir/model.safetensors just written, as
 * config.json.tmp renamed over it. */
static int write_config(const char *dir, const char *model, int64_t job)
{
    json_t *meta = read_metadata(model), *cfg = NULL;
    const char *kind = json_string_value(json_object_get(meta, "traind.model"));
    char path[4096], tmp[4112];
    int rc = TC_OK;

    if (meta == NULL)
        return TC_PROTOCOL;
    if (kind != NULL && strcmp(kind, "gpt") == 0)
        cfg = gpt_config(meta, job);
    else if (kind != NULL && strcmp(kind, "sensorlm") == 0)
        cfg = sensorlm_config(meta, job);
    else if (kind != NULL && strcmp(kind, "mlp") == 0)
        cfg = mlp_config(meta, job);
    else
        rc = tc_err(TC_PROTOCOL, "%s: a model of kind '%s', which has no config.json", model,
                    kind != NULL ? kind : "?");
    snprintf(path, sizeof(path), "%s/config.json", dir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    if (rc == TC_OK && cfg == NULL)
        rc = tc_err(TC_FAILED, "out of memory");
    if (rc == TC_OK && (json_dump_file(cfg, tmp, JSON_INDENT(2) | JSON_SORT_KEYS) != 0 ||
                        rename(tmp, path) != 0)) {
        rc = tc_err(TC_CANTCREAT, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
    }
    json_decref(cfg);
    json_decref(meta);
    return rc;
}

/* -o DIR/ (a name ending in '/', or a directory there already): the export goes into the
 * directory, made when missing (its parent must exist), as model.safetensors with a
 * config.json. */
static int export_dir(const char *output, char *model, size_t size, int *is_dir)
{
    size_t len = strlen(output);
    struct stat st;

    *is_dir =
        (len > 0 && output[len - 1] == '/') || (stat(output, &st) == 0 && S_ISDIR(st.st_mode));
    if (!*is_dir)
        return TC_OK;
    if (mkdir(output, 0755) != 0 && errno != EEXIST)
        return tc_err(TC_CANTCREAT, "cannot create the directory %s: %s", output, strerror(errno));
    if (snprintf(model, size, "%s%smodel.safetensors", output, output[len - 1] == '/' ? "" : "/") >=
        (int)size)
        return tc_err(TC_USAGE, "-o %s: too long", output);
    return TC_OK;
}

int tc_export(const tc_opts *o)
{
    struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = SA_RESETHAND}, old;
    outfile out = {0};
    tc_conn *c = NULL;
    char size[32];
    size_t len = strlen(o->output), sfx = strlen(".safetensors");
    char model[4096];
    const char *path = o->output;
    /* --format wins; else the name says: FILE.safetensors, or a directory */
    int safetensors = o->export_format != NULL
                          ? strcmp(o->export_format, "safetensors") == 0
                          : len > sfx && strcmp(o->output + len - sfx, ".safetensors") == 0;
    int is_dir = 0;
    td_pw *w;
    int rc;

    if ((rc = export_dir(o->output, model, sizeof(model), &is_dir)) != TC_OK)
        return rc;
    if (is_dir && o->export_format != NULL && !safetensors)
        return tc_err(TC_USAGE,
                      "-o %s is a directory, which gets model.safetensors and "
                      "config.json: --format llmc writes a file",
                      o->output);
    if (is_dir) {
        safetensors = 1;
        path = model;
    }
    /* Ctrl-C stops the export cleanly: no FILE.tmp is left behind. */
    sigaction(SIGINT, &sa, &old);
    if ((rc = outfile_open(&out, path)) != TC_OK || (rc = tc_conn_open(&c, o->socket)) != TC_OK)
        goto out;
    if (safetensors && !tc_conn_has(c, "safetensors")) {
        rc = tc_err(TC_UNAVAILABLE, "traind at %s is too old to export safetensors", o->socket);
        goto out;
    }
    /* The default format goes without a field, so that an older daemon still answers. */
    w = tc_conn_request(c, "export", 3 + safetensors);
    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    if (safetensors) {
        td_pw_str(w, "format");
        td_pw_str(w, "safetensors");
    }
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = receive_export(c, o->socket, &out)) != TC_OK ||
        (rc = outfile_commit(&out)) != TC_OK)
        goto out;
    if (is_dir && (rc = write_config(o->output, model, o->job)) != TC_OK)
        goto out;
    tc_fmt_bytes(size, sizeof(size), (double)out.bytes);
    if (is_dir)
        fprintf(stderr,
                "job %lld exported to %s: model.safetensors, %lld bytes (%s), and "
                "config.json\n",
                (long long)o->job, o->output, (long long)out.bytes, size);
    else
        fprintf(stderr, "job %lld exported to %s: %lld bytes (%s)\n", (long long)o->job, o->output,
                (long long)out.bytes, size);
out:
    if (rc == TC_INTERRUPTED)
        tc_err(rc, "export interrupted; %s was not written", path);
    outfile_drop(&out);
    tc_conn_close(c);
    sigaction(SIGINT, &old, NULL);
    return rc;
}

/* The sample request: job_id and whichever options were given. */
static void sample_request(tc_conn *c, const tc_opts *o)
{
    uint32_t n =
        3 + (o->tokens >= 0) + (o->prompt != NULL) + (o->temperature >= 0) + (o->seed >= 0);
    td_pw *w = tc_conn_request(c, "sample", n);

    td_pw_str(w, "job_id");
    td_pw_int(w, o->job);
    if (o->tokens >= 0) {
        td_pw_str(w, "tokens");
        td_pw_int(w, o->tokens);
    }
    if (o->prompt != NULL) {
        td_pw_str(w, "prompt");
        td_pw_str(w, o->prompt);
    }
    if (o->temperature >= 0) {
        td_pw_str(w, "temperature");
        td_pw_double(w, o->temperature);
    }
    if (o->seed >= 0) {
        td_pw_str(w, "seed");
        td_pw_int(w, o->seed);
    }
}

int tc_sample(const tc_opts *o)
{
    td_proto_frame *f = NULL;
    tc_conn *c = NULL;
    const td_pval *root;
    const char *text;
    int64_t seed = -1;
    size_t len = 0;
    int rc = tc_conn_open(&c, o->socket);

    if (rc != TC_OK)
        goto out;
    sample_request(c, o);
    /* A long generation from a large model may take minutes: no time limit. */
    if ((rc = tc_conn_send(c)) != TC_OK || (rc = tc_conn_recv(c, &f, -1)) != TC_OK)
        goto out;
    root = td_proto_frame_root(f);
    text = td_pv_str(td_pv_get(root, "text"), &len);
    if (!tc_pv_is(td_pv_get(root, "type"), "sample") || text == NULL) {
        rc = tc_err(TC_PROTOCOL, "traind answered sample without text");
        goto out;
    }
    /* The bytes as they are (a byte-level model's output may hold any byte); a newline after
     * them only for a person at a terminal. */
    fwrite(text, 1, len, stdout);
    if (isatty(STDOUT_FILENO) && (len == 0 || text[len - 1] != '\n'))
        fputc('\n', stdout);
    td_pv_int(td_pv_get(root, "seed"), &seed);
    if (o->seed < 0 && seed >= 0 && isatty(STDERR_FILENO))
        fprintf(stderr, "(seed %lld: --seed %lld gives this text again)\n", (long long)seed,
                (long long)seed);
    rc = tc_flush_stdout();
out:
    td_proto_frame_free(f);
    tc_conn_close(c);
    return rc;
}
