/* The verbs that take a model out of traind: export (the job's latest checkpoint as an llm.c
 * or a safetensors model file, received as a run of chunk frames and written here, with the user's
 * own permissions, as FILE.tmp renamed to FILE once whole) and sample (text generated from it).
 * Both may keep traind busy for a while before the first byte of the reply (a large model to
 * write, a long generation), so their first wait has no time limit. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int tc_export(const tc_opts *o)
{
    struct sigaction sa = {.sa_handler = on_sigint, .sa_flags = SA_RESETHAND}, old;
    outfile out = {0};
    tc_conn *c = NULL;
    char size[32];
    size_t len = strlen(o->output), sfx = strlen(".safetensors");
    /* --format wins; else the name says: FILE.safetensors */
    int safetensors = o->export_format != NULL
                          ? strcmp(o->export_format, "safetensors") == 0
                          : len > sfx && strcmp(o->output + len - sfx, ".safetensors") == 0;
    td_pw *w;
    int rc;

    /* Ctrl-C stops the export cleanly: no FILE.tmp is left behind. */
    sigaction(SIGINT, &sa, &old);
    if ((rc = outfile_open(&out, o->output)) != TC_OK ||
        (rc = tc_conn_open(&c, o->socket)) != TC_OK)
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
    tc_fmt_bytes(size, sizeof(size), (double)out.bytes);
    fprintf(stderr, "job %lld exported to %s: %lld bytes (%s)\n", (long long)o->job, o->output,
            (long long)out.bytes, size);
out:
    if (rc == TC_INTERRUPTED)
        tc_err(rc, "export interrupted; %s was not written", o->output);
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
