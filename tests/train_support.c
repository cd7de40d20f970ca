/* Helpers shared by the train/ unit tests (test_train.c, test_gpt.c, test_memest.c, and
 * test_gpu.c's trainer tests): the temporary-directory fixture, the IDX and text file writers
 * and the metric recorder. See train_support.h. */
#include <ftw.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include <cmocka.h>

#include "train/sensor.h"
#include "train/train.h"
#include "tests/train_support.h"

char tt_tmpdir[64];

/* Copies the template into tt_tmpdir and lets mkdtemp fill in its Xs. */
int tt_tmpdir_make(const char *template)
{
    snprintf(tt_tmpdir, sizeof(tt_tmpdir), "%s", template);
    return mkdtemp(tt_tmpdir) == NULL ? -1 : 0;
}

/* nftw's callback for tt_tmpdir_remove: removes one file or (emptied) directory. */
static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Walks tt_tmpdir depth first, so each directory is empty when its turn comes. */
int tt_tmpdir_remove(void)
{
    return nftw(tt_tmpdir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* Joins tt_tmpdir and name into out, which holds TD_PATH_MAX bytes. */
void tt_path_of(char *out, const char *name)
{
    snprintf(out, TD_PATH_MAX, "%s/%s", tt_tmpdir, name);
}

/* Stores v big-endian at p, as IDX headers are. */
static void be32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* Writes the header (magic, dims) and body, through zlib when gz is set and stdio otherwise;
 * every write is asserted, so a failure fails the calling test. */
void tt_write_idx(const char *path, int gz, uint32_t magic, const uint32_t *dims, int ndim,
                  const uint8_t *body, size_t body_len)
{
    unsigned char h[16];

    be32(h, magic);
    for (int i = 0; i < ndim; i++)
        be32(h + 4 * (i + 1), dims[i]);
    if (gz) {
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, h, 4u * (unsigned)(ndim + 1)), 4 * (ndim + 1));
        if (body_len > 0)
            assert_int_equal(gzwrite(f, body, (unsigned)body_len), (int)body_len);
        assert_int_equal(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(h, 1, 4u * (size_t)(ndim + 1), f), 4u * (size_t)(ndim + 1));
        if (body_len > 0)
            assert_int_equal(fwrite(body, 1, body_len, f), body_len);
        assert_int_equal(fclose(f), 0);
    }
}

/* Appends one sample to the tt_recorder in ud; more than TT_MAX_SAMPLES fails the test. */
void tt_record(void *ud, const char *key, int64_t step, double value)
{
    tt_recorder *r = ud;

    assert_true(r->n < TT_MAX_SAMPLES);
    snprintf(r->s[r->n].key, sizeof(r->s[r->n].key), "%s", key);
    r->s[r->n].step = step;
    r->s[r->n].value = value;
    r->n++;
}

/* Scans the samples in order, copying the value and step of each one under key into out and
 * steps (either may be NULL) until max are found. */
int tt_values_of(const tt_recorder *r, const char *key, double *out, int64_t *steps, int max)
{
    int k = 0;

    for (int i = 0; i < r->n && k < max; i++)
        if (strcmp(r->s[i].key, key) == 0) {
            if (out != NULL)
                out[k] = r->s[i].value;
            if (steps != NULL)
                steps[k] = r->s[i].step;
            k++;
        }
    return k;
}

/* Sentences drawn from a few words by a fixed LCG: a tiny model learns its letters and words
 * in a few dozen steps. */
void tt_write_text(const char *path, size_t bytes)
{
    static const char *words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy",
                                  "dog", "and",   "cat",   "sat", "on",    "a",    "mat"};
    FILE *f = fopen(path, "wb");
    uint64_t s = 12345;
    size_t n = 0;

    assert_non_null(f);
    while (n < bytes) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const char *w = words[(s >> 33) % 14];
        n += (size_t)fprintf(f, "%s%s", w, (s >> 20) % 7 == 0 ? ".\n" : " ");
    }
    assert_int_equal(fclose(f), 0);
}

/* Labels' names and prompts of tt_write_sensor's shards. */
static const char *const tt_sensor_names[TT_SENSOR_LABELS] = {"alpha", "beta", "gamma"};
static const char *const tt_sensor_prompts[TT_SENSOR_LABELS] = {"alpha day", "beta day",
                                                                "gamma day"};

/* One sample of class k: channel 0 a sine whose frequency is the class's, channel 1 a level
 * set by the class, the rest noise; a reading in 50 missing. Its caption starts with the class's
 * prompt, then (three times in four) a word and a number that change from sample to sample. */
static void tt_sensor_sample(float *grid, char *cap, size_t size, int T, int C, int k, uint64_t *x)
{
    static const char *const words[] = {"calm", "busy", "long", "short", "late", "early"};

    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) {
            float noise;
            *x = *x * 6364136223846793005ull + 1442695040888963407ull;
            noise = (float)((*x >> 40) & 0xffff) / 65536.0f - 0.5f;
            if (c == 0)
                grid[t * C + c] = sinf(0.35f * (float)(k + 1) * (float)t) + 0.3f * noise;
            else if (c == 1)
                grid[t * C + c] = 2.0f * (float)k + 50.0f + noise;
            else
                grid[t * C + c] = 3.0f * noise;
            if ((*x >> 20) % 50 == 0)
                grid[t * C + c] = NAN;
        }
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    if ((*x >> 30) % 4 == 0) /* now and then the prompt alone, as a zero-shot query reads */
        snprintf(cap, size, "%s", tt_sensor_prompts[k]);
    else
        snprintf(cap, size, "%s: %s %d", tt_sensor_prompts[k], words[(*x >> 33) % 6],
                 (int)((*x >> 45) % 100));
}

void tt_write_sensor(const char *path, int N, int T, int C, int caption_len, uint64_t seed)
{
    tt_write_sensor_with(path, N, T, C, caption_len, seed, tt_sensor_prompts, 0);
}

void tt_write_sensor_with(const char *path, int N, int T, int C, int caption_len, uint64_t seed,
                          const char *const *prompts, int clauses)
{
    td_sensor_header h;
    td_sensor_writer *w = NULL;
    td_error_t err = {0};
    float *grid = malloc((size_t)T * C * sizeof(float));
    char cap[128];
    uint64_t x = seed * 2654435761u + 1;

    assert_non_null(grid);
    memset(&h, 0, sizeof(h));
    h.T = T;
    h.C = C;
    h.N = N;
    h.caption_len = caption_len;
    h.n_labels = TT_SENSOR_LABELS;
    h.period_s = 60;
    for (int c = 0; c < C; c++)
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), "ch%d", c);
    if (td_sensor_writer_open(&w, path, &h, tt_sensor_names, prompts, &err) != 0)
        fail_msg("%s", err.msg);
    for (int i = 0; i < N; i++) {
        int k = i % TT_SENSOR_LABELS;
        size_t len;
        tt_sensor_sample(grid, cap, sizeof(cap), T, C, k, &x);
        if (clauses) {
            size_t at = strlen(cap);
            snprintf(cap + at, sizeof(cap) - at, "; %s %d. %s %d", k == 0 ? "calm" : "busy", i % 7,
                     i % 2 ? "late" : "early", i % 5);
        }
        len = strlen(cap) < (size_t)caption_len ? strlen(cap) : (size_t)caption_len;
        if (td_sensor_writer_add(w, grid, cap, len, k, &err) != 0)
            fail_msg("%s", err.msg);
    }
    if (td_sensor_writer_finish(w, NULL, NULL, &err) != 0)
        fail_msg("%s", err.msg);
    td_sensor_writer_free(w);
    free(grid);
}

td_slm_dims tt_slm_tiny_dims(td_slm_pool pool)
{
    td_sensorlm_config c = {.patch_t = 3,
                            .patch_c = 2,
                            .s_width = 8,
                            .s_depth = 1,
                            .s_heads = 2,
                            .s_mlp = 16,
                            .pool = pool,
                            .text_len = 6,
                            .t_width = 8,
                            .t_depth = 1,
                            .t_heads = 2,
                            .t_mlp = 16,
                            .embed_dim = 8};
    td_slm_dims d;
    td_error_t err = {0};

    if (td_slm_dims_of(&c, 12, 3, &d, &err) != 0)
        fail_msg("%s", err.msg);
    return d;
}
