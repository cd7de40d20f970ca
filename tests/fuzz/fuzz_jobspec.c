/* libFuzzer target: the job-spec parser (daemon/jobspec.c), as submit meets it.
 *
 * Input: one frame body: a submit request ({type: "submit", id, job: {...}}) or a bare job
 * map. The job goes through td_jobspec_check_text, td_jobspec_parse_stored and
 * td_jobspec_parse; a job that parses is also checked against its files (td_jobspec_check_files)
 * when every path in it is one of the fixtures below, and re-encoded with a batch size
 * (td_jobspec_set_batch), which must parse again to the same spec with that batch.
 *
 * Paths in a fuzzed job mostly name nothing; the parser only looks at them (access, glob), and
 * nothing here writes anywhere but the fixture directory, FIXTURES: small valid files the seed
 * corpus's jobs name (IDX images and labels, plain and gzipped, a text file, an llm.c token
 * shard and model, a sensor shard), written afresh at start. It is made 0700 and refused when it is
 * a symlink or someone else's, so that a file planted in /tmp is never written through. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "train/data.h"
#include "train/engine.h"
#include "tests/fuzz/fuzz.h"
#include "daemon/jobspec.h"
#include "train/sensor.h"
#include "train/weights.h"

#define FIXTURES "/tmp/traind-fuzz-jobspec"

static int have_fixtures; /* the fixture directory is ours and filled */
static int verbose;       /* $TD_FUZZ_VERBOSE: each step's outcome on stderr */

/* Writes n bytes as FIXTURES/name through a temporary file of this process, renamed. */
static void put_fixture(const char *name, const void *p, size_t n)
{
    char tmp[512], path[512];
    FILE *f;

    snprintf(tmp, sizeof(tmp), "%s/.%s.%ld", FIXTURES, name, (long)getpid());
    snprintf(path, sizeof(path), "%s/%s", FIXTURES, name);
    f = fopen(tmp, "wbx");
    TDF_CHECK(f != NULL);
    TDF_CHECK(fwrite(p, 1, n, f) == n && fclose(f) == 0);
    TDF_CHECK(rename(tmp, path) == 0);
}

/* data, gzipped with a fixed header (no name, no time), as FIXTURES/name. */
static void put_gzipped(const char *name, const void *data, size_t n)
{
    unsigned char out[4096];
    z_stream z = {0};

    TDF_CHECK(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    z.next_in = (unsigned char *)data;
    z.avail_in = (unsigned)n;
    z.next_out = out;
    z.avail_out = sizeof(out);
    TDF_CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END);
    put_fixture(name, out, sizeof(out) - z.avail_out);
    deflateEnd(&z);
}

/* Copies the file at path (in the scratch directory) to FIXTURES/name. */
static void copy_fixture(const char *path, const char *name)
{
    unsigned char *bytes;
    long n;
    FILE *f = fopen(path, "rb");

    TDF_CHECK(f != NULL && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) > 0);
    bytes = malloc((size_t)n);
    TDF_CHECK(bytes != NULL && fseek(f, 0, SEEK_SET) == 0 &&
              fread(bytes, 1, (size_t)n, f) == (size_t)n);
    fclose(f);
    put_fixture(name, bytes, (size_t)n);
    free(bytes);
}

/* A 1-layer GPT of vocabulary 256, written by td_weights_gpt_save_llmc. */
static void put_model(void)
{
    static td_gpt m;
    td_params p = {0};
    td_gpt_dims d = {.maxT = 8, .V = 256, .Vp = 256, .L = 1, .NH = 1, .C = 4};
    td_error_t err;
    char path[512];

    TDF_CHECK(td_gpt_declare(&m, &p, &d, &err) == 0 && td_params_alloc(&p, 0) == 0);
    td_gpt_bind(&m);
    td_gpt_init(&m, 1);
    tdf_path(path, sizeof(path), "model.bin");
    TDF_CHECK(td_weights_gpt_save_llmc(path, &m, &err) == 0);
    copy_fixture(path, "model.bin");
    td_params_free(&p);
}

/* A sensor shard of 4 labelled samples of 4 steps of 2 channels, written by the writer. */
static void put_sensor(void)
{
    static const char *const names[] = {"rest", "walk"};
    td_sensor_header h = {.T = 4, .C = 2, .N = 4, .caption_len = 16, .n_labels = 2};
    float grid[8];
    td_sensor_writer *w;
    td_error_t err;
    char path[512];

    snprintf(h.ch[0].name, sizeof(h.ch[0].name), "heart_rate");
    snprintf(h.ch[1].name, sizeof(h.ch[1].name), "steps");
    tdf_path(path, sizeof(path), "sensor.bin");
    TDF_CHECK(td_sensor_writer_open(&w, path, &h, names, NULL, &err) == 0);
    for (int i = 0; i < 4; i++) {
        for (int k = 0; k < 8; k++)
            grid[k] = (float)(60 + i * k);
        TDF_CHECK(td_sensor_writer_add(w, grid, i % 2 ? "a walk" : "at rest", 6 + !(i % 2), i % 2,
                                       &err) == 0);
    }
    TDF_CHECK(td_sensor_writer_finish(w, NULL, NULL, &err) == 0);
    td_sensor_writer_free(w);
    copy_fixture(path, "sensor.bin");
}

/* Makes FIXTURES (or checks it is this user's own directory) and writes the files. */
static void make_fixtures(void)
{
    static const unsigned char images[16 + 16] = {
        0, 0,   8,  3,  0,  0,  0,  4,  0,    0,    0,    2,    0,   0,   0,   2,
        0, 255, 10, 20, 30, 40, 50, 60, 0x80, 0x81, 0x82, 0x83, 255, 254, 253, 252};
    static const unsigned char labels[8 + 4] = {0, 0, 8, 1, 0, 0, 0, 4, 0, 1, 2, 1};
    static const char text[] = "It is a truth universally acknowledged, that a single man in "
                               "possession of a good fortune, must be in want of a wife.\n";
    unsigned char shard[1024 + 2 * 64] = {0};
    int32_t h[3] = {TD_DATA_SHARD_MAGIC, TD_DATA_SHARD_VERSION, 64};
    struct stat st;

    if (mkdir(FIXTURES, 0700) != 0 && errno != EEXIST)
        return;
    if (lstat(FIXTURES, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 077) != 0) {
        fprintf(stderr,
                "fuzz_jobspec: %s is not a private directory of this user; jobs that "
                "name it are parsed but their files not checked\n",
                FIXTURES);
        return;
    }
    memcpy(shard, h, sizeof(h));
    for (int i = 0; i < 64; i++) {
        shard[1024 + 2 * i] = (unsigned char)(i * 7);
        shard[1024 + 2 * i + 1] = (unsigned char)(i == 63);
    }
    put_fixture("images.idx", images, sizeof(images));
    put_fixture("labels.idx", labels, sizeof(labels));
    put_gzipped("images.idx.gz", images, sizeof(images));
    put_gzipped("labels.idx.gz", labels, sizeof(labels));
    put_fixture("text.txt", text, sizeof(text) - 1);
    put_fixture("tokens.bin", shard, sizeof(shard));
    put_model();
    put_sensor();
    have_fixtures = 1;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    verbose = getenv("TD_FUZZ_VERBOSE") != NULL;
    make_fixtures();
    return 0;
}

/* Whether path is empty or names something inside FIXTURES. */
static int fixture_path(const char *path)
{
    return path[0] == '\0' ||
           (strncmp(path, FIXTURES "/", sizeof(FIXTURES)) == 0 && strstr(path, "..") == NULL);
}

/* Whether every file the spec names is a fixture. */
static int only_fixtures(const td_jobspec *s)
{
    const td_train_config *c = &s->train;
    int ok = fixture_path(c->train.images) && fixture_path(c->train.labels) &&
             fixture_path(c->test.images) && fixture_path(c->test.labels) &&
             fixture_path(c->init_from);

    for (int i = 0; i < c->n_train_files; i++)
        ok = ok && fixture_path(c->train_files[i]);
    for (int i = 0; i < c->n_valid_files; i++)
        ok = ok && fixture_path(c->valid_files[i]);
    return ok;
}

/* What holds of any spec that parsed. */
static void check_spec(const td_jobspec *s)
{
    const td_train_config *c = &s->train;

    TDF_CHECK(memchr(s->name, '\0', sizeof(s->name)) != NULL && s->name[0] != '\0');
    TDF_CHECK(s->devices >= 1 && s->devices <= TD_JOB_MAX_DEVICES);
    TDF_CHECK(s->batch_auto ? c->batch_size == 0
                            : c->batch_size >= 1 && c->batch_size <= TD_JOB_MAX_BATCH);
    TDF_CHECK(s->nccl_timeout_s >= 0 && s->nccl_timeout_s <= TD_JOB_MAX_NCCL_TIMEOUT);
    TDF_CHECK(c->n_train_files >= 0 && c->n_train_files <= TD_MAX_PATTERNS);
    TDF_CHECK(c->n_valid_files >= 0 && c->n_valid_files <= TD_MAX_PATTERNS);
    TDF_CHECK(c->valid_fraction >= 0 && c->valid_fraction < 1);
    if (c->model == TD_MODEL_MLP)
        TDF_CHECK(c->n_layers >= 2 && c->n_layers <= TD_MAX_LAYERS);
}

/* td_jobspec_set_batch of the job's bytes: the result decodes, holds batch_size = batch, and
 * (when the job parsed) parses to the same spec with that batch. */
static void check_set_batch(const td_pval *job, const td_jobspec *parsed, int batch)
{
    static td_jobspec again;
    td_pw w;
    const void *body;
    size_t len, out_len;
    void *out = NULL;
    td_proto_frame *f = NULL;
    td_error_t err;
    int64_t got;
    int rc;

    td_pw_init(&w);
    td_pw_val(&w, job);
    body = td_pw_body(&w, &len);
    TDF_CHECK(body != NULL);
    rc = td_jobspec_set_batch(body, len, batch, &out, &out_len, &err);
    if (td_pv_type_of(job) != TD_PV_MAP) {
        TDF_CHECK(rc == TD_EPROTO && out == NULL);
        goto out;
    }
    /* one pair more than a map of the limit's size is no frame */
    if (rc != 0 || td_proto_decode(out, out_len, &f, &err) != 0) {
        TDF_CHECK(td_pv_len(job) == TD_PROTO_MAX_ITEMS || len > TD_PROTO_MAX_FRAME - 16);
        goto out;
    }
    TDF_CHECK(td_pv_int(td_pv_get(td_proto_frame_root(f), "batch_size"), &got) == 0 &&
              got == batch);
    if (parsed != NULL) {
        td_jobspec want = *parsed;
        want.train.batch_size = batch;
        want.batch_auto = 0;
        TDF_CHECK(td_jobspec_parse_stored(td_proto_frame_root(f), &again, &err) == 0);
        TDF_CHECK(memcmp(&want, &again, sizeof(want)) == 0);
    }
out:
    td_proto_frame_free(f);
    free(out);
    td_pw_free(&w);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static td_jobspec stored, parsed;
    td_proto_frame *f;
    const td_pval *root, *job;
    td_error_t err;
    int rc_stored, rc;

    if (td_proto_decode(data, size, &f, &err) != 0)
        return 0;
    root = td_proto_frame_root(f);
    job = td_pv_get(root, "job") != NULL ? td_pv_get(root, "job") : root;
    rc = td_jobspec_check_text(job, &err);
    TDF_CHECK(rc == 0 || (rc == TD_EJOB && err.msg[0] != '\0'));
    rc_stored = td_jobspec_parse_stored(job, &stored, &err);
    if (verbose)
        fprintf(stderr, "parse_stored: %d %s\n", rc_stored, rc_stored ? err.msg : "");
    TDF_CHECK(rc_stored == 0 || (rc_stored == TD_EJOB && err.msg[0] != '\0'));
    rc = td_jobspec_parse(job, &parsed, &err);
    if (verbose)
        fprintf(stderr, "parse: %d %s\n", rc, rc ? err.msg : "");
    TDF_CHECK(rc == 0 || (rc == TD_EJOB && err.msg[0] != '\0'));
    if (rc == 0) {
        /* the same checks and more: what parses, parses stored, to the same spec */
        TDF_CHECK(rc_stored == 0 && memcmp(&stored, &parsed, sizeof(parsed)) == 0);
        check_spec(&parsed);
        if (have_fixtures && only_fixtures(&parsed)) {
            rc = td_jobspec_check_files(&parsed, -1, -1, &err);
            if (verbose)
                fprintf(stderr, "check_files: %d %s\n", rc, rc ? err.msg : "");
            TDF_CHECK(rc == 0 || (rc < 0 && err.msg[0] != '\0'));
        }
    }
    if (rc_stored == 0)
        check_spec(&stored);
    check_set_batch(job, rc_stored == 0 ? &stored : NULL, 1 + (int)(size % TD_JOB_MAX_BATCH));
    td_proto_frame_free(f);
    return 0;
}
