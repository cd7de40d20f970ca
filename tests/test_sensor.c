/* Unit tests of sensor shards (train/sensor.c) and of trainctl's local sensor tools
 * (client/sensor.c, client/synth.c), run as a user would through TRAINCTL_BIN: the shard round
 * trip, each bad header field refused naming the file and the field, truncated files, huge
 * counts refused before anything is allocated, the writer's refusals; the generator's
 * determinism, label balance and physiology; CSV import, its missing values and its errors.
 * Every test works in its own temporary directory, removed at the end. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "train/sensor.h"

/* ---- helpers ------------------------------------------------------------------------------- */

static char dir[256];
static char out[1 << 16], err_text[1 << 16]; /* the last command's stdout and stderr */

static int setup(void **state)
{
    const char *base = getenv("TMPDIR");

    (void)state;
    snprintf(dir, sizeof(dir), "%s/td-sensor-XXXXXX", base != NULL ? base : "/tmp");
    assert_non_null(mkdtemp(dir));
    return 0;
}

static int teardown(void **state)
{
    char cmd[512];

    (void)state;
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
    return 0;
}

/* dir/name, in one of four rotating buffers. */
static const char *at(const char *name)
{
    static char buf[4][512];
    static int i;

    i = (i + 1) % 4;
    snprintf(buf[i], sizeof(buf[i]), "%s/%s", dir, name);
    return buf[i];
}

static void slurp(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "rb");
    size_t n = 0;

    if (f != NULL) {
        n = fread(buf, 1, size - 1, f);
        fclose(f);
    }
    buf[n] = '\0';
}

/* Runs a shell command (a printf format) with stdout and stderr kept in out and err_text;
 * returns its exit status. */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int sh(const char *fmt, ...)
{
    char command[4096], cmd[5000];
    va_list ap;
    int status;

    va_start(ap, fmt);
    vsnprintf(command, sizeof(command), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "(%s) >'%s/out' 2>'%s/err'", command, dir, dir);
    status = system(cmd);
    slurp(at("out"), out, sizeof(out));
    slurp(at("err"), err_text, sizeof(err_text));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static const char *trainctl(void)
{
    const char *env = getenv("TRAINCTL_BIN");

    return env != NULL && env[0] != '\0' ? env : "build/client/trainctl";
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void write_text(const char *path, const char *s)
{
    write_file(path, s, strlen(s));
}

/* The whole file at path; caller frees. */
static unsigned char *read_file(const char *path, size_t *n)
{
    struct stat st;
    unsigned char *b;
    FILE *f = fopen(path, "rb");

    assert_non_null(f);
    assert_int_equal(fstat(fileno(f), &st), 0);
    b = malloc((size_t)st.st_size + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)st.st_size, f), (size_t)st.st_size);
    fclose(f);
    *n = (size_t)st.st_size;
    return b;
}

static int files_equal(const char *a, const char *b)
{
    size_t na, nb;
    unsigned char *x = read_file(a, &na), *y = read_file(b, &nb);
    int same = na == nb && memcmp(x, y, na) == 0;

    free(x);
    free(y);
    return same;
}

static void header(td_sensor_header *h, int T, int C, int64_t N, int L, int K)
{
    memset(h, 0, sizeof(*h));
    h->T = T;
    h->C = C;
    h->N = N;
    h->caption_len = L;
    h->n_labels = K;
    h->period_s = 60;
    h->split = TD_SENSOR_SPLIT_TRAIN;
    for (int c = 0; c < C; c++) {
        snprintf(h->ch[c].name, sizeof(h->ch[c].name), "chan%d", c);
        snprintf(h->ch[c].unit, sizeof(h->ch[c].unit), "u%d", c);
    }
}

/* The small shard most tests use: T 4, C 3, N 3, caption_len 16, labels "sleep" and "run".
 * Sample i's reading (t, c) is 100 i + 10 t + c, except NaN at (sample 1, t 2, channel 0). */
#define ST 4
#define SC 3
#define SN 3
#define SL 16

static float reading(int i, int t, int c)
{
    return i == 1 && t == 2 && c == 0 ? NAN : (float)(100 * i + 10 * t + c);
}

static const char *const small_captions[SN] = {"", "a run at 07:10", "exactly16bytes!!"};
static const char *const small_names[2] = {"sleep", "run"};
static const char *const small_prompts[2] = {"a night of sleep", NULL};

static void write_small(const char *path)
{
    td_sensor_header h;
    td_sensor_writer *w;
    td_error_t e = {0};
    float grid[ST * SC];

    header(&h, ST, SC, SN, SL, 2);
    assert_int_equal(td_sensor_writer_open(&w, path, &h, small_names, small_prompts, &e), 0);
    for (int i = 0; i < SN; i++) {
        for (int t = 0; t < ST; t++)
            for (int c = 0; c < SC; c++)
                grid[t * SC + c] = reading(i, t, c);
        assert_int_equal(
            td_sensor_writer_add(w, grid, small_captions[i], strlen(small_captions[i]), i % 2, &e),
            0);
    }
    assert_int_equal(td_sensor_writer_finish(w, NULL, NULL, &e), 0);
    td_sensor_writer_free(w);
}

/* Asserts that rc is code and that the message names path and holds what. */
static void assert_refused(int rc, int code, const td_error_t *e, const char *path,
                           const char *what)
{
    if (rc != code || strstr(e->msg, path) == NULL || strstr(e->msg, what) == NULL)
        fail_msg("expected %s (%d) naming '%s' and '%s', got %d: %s", td_errname(code), code, path,
                 what, rc, e->msg);
}

/* ---- the format ---------------------------------------------------------------------------- */

static void test_round_trip(void **state)
{
    const char *path = at("small.bin");
    const td_sensor_header *h;
    td_sensor *s;
    td_error_t e = {0};
    float grid[ST * SC];
    char cap[SL + 1];
    size_t len;
    int32_t label;
    struct stat st;

    (void)state;
    write_small(path);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(access(at("small.bin.tmp"), F_OK), -1); /* renamed, not left behind */
    assert_int_equal(td_sensor_open(&s, path, NULL, &e), 0);
    h = td_sensor_header_of(s);
    assert_int_equal(h->version, TD_SENSOR_VERSION);
    assert_int_equal(h->T, ST);
    assert_int_equal(h->C, SC);
    assert_int_equal(td_sensor_count(s), SN);
    assert_int_equal(h->caption_len, SL);
    assert_int_equal(h->n_labels, 2);
    assert_int_equal(h->period_s, 60);
    assert_int_equal(h->split, TD_SENSOR_SPLIT_TRAIN);
    assert_string_equal(h->ch[2].name, "chan2");
    assert_string_equal(h->ch[2].unit, "u2");
    /* 4096 header + 3*4*3*4 samples + 3*4 labels + 2*128 label table + 3*16 captions */
    assert_int_equal(st.st_size, 4096 + 144 + 12 + 256 + 48);
    assert_int_equal(td_sensor_file_bytes(h), (uint64_t)st.st_size);
    assert_string_equal(td_sensor_path(s), path);
    for (int i = 0; i < SN; i++) {
        assert_int_equal(td_sensor_read(s, i, grid, cap, &len, &label, &e), 0);
        for (int t = 0; t < ST; t++)
            for (int c = 0; c < SC; c++) {
                float want = reading(i, t, c);
                if (isnan(want))
                    assert_true(isnan(grid[t * SC + c]));
                else
                    assert_true(grid[t * SC + c] == want); /* stored as written, bit for bit */
            }
        assert_string_equal(cap, small_captions[i]);
        assert_int_equal(len, strlen(small_captions[i]));
        assert_int_equal(label, i % 2);
    }
    /* Only the caption, through len alone. */
    assert_int_equal(td_sensor_read(s, 2, NULL, NULL, &len, NULL, &e), 0);
    assert_int_equal(len, SL);
    assert_string_equal(td_sensor_label_name(s, 0), "sleep");
    assert_string_equal(td_sensor_label_prompt(s, 0), "a night of sleep");
    assert_string_equal(td_sensor_label_prompt(s, 1), "run"); /* no prompt: the name */
    assert_null(td_sensor_label_name(s, 2));
    assert_null(td_sensor_label_prompt(s, -1));
    assert_int_equal(td_sensor_read(s, SN, grid, NULL, NULL, NULL, &e), TD_EINVAL);
    assert_int_equal(td_sensor_read(s, -1, grid, NULL, NULL, NULL, &e), TD_EINVAL);
    td_sensor_close(s);
}

/* The statistics: mean and population std over the readings, NaN left out. */
static void test_stats(void **state)
{
    const char *path = at("small.bin");
    td_sensor_header h;
    td_error_t e = {0};

    (void)state;
    write_small(path);
    assert_int_equal(td_sensor_check(path, NULL, &h, &e), 0);
    for (int c = 0; c < SC; c++) {
        double sum = 0, sq = 0, n = 0, mean, std;
        for (int i = 0; i < SN; i++)
            for (int t = 0; t < ST; t++)
                if (!isnan(reading(i, t, c))) {
                    sum += reading(i, t, c);
                    sq += (double)reading(i, t, c) * reading(i, t, c);
                    n++;
                }
        mean = sum / n;
        std = sqrt(sq / n - mean * mean);
        /* float rounding of the stored values: 1e-5 relative is ample */
        assert_true(fabs(h.ch[c].mean - mean) <= 1e-5 * fabs(mean));
        assert_true(fabs(h.ch[c].std - std) <= 1e-5 * std);
    }
    /* Channel 0 left out its NaN: (12 * 115 - 120) / 11 readings, not channel 1's mean - 1. */
    assert_true(fabs(h.ch[0].mean - 1260.0 / 11) < 1e-4);
}

/* A valid shard written with the train split's statistics carries them exactly; a constant
 * channel stores std 1. */
static void test_given_and_constant_stats(void **state)
{
    const char *path = at("v.bin");
    td_sensor_header h;
    td_sensor_writer *w;
    td_error_t e = {0};
    float grid[2 * 2] = {5, 1, 5, 2}, mean[2] = {1.5f, -2}, std[2] = {0.25f, 3}, m[2], sd[2];

    (void)state;
    header(&h, 2, 2, 1, 8, 0);
    h.split = TD_SENSOR_SPLIT_VALID;
    assert_int_equal(td_sensor_writer_open(&w, path, &h, NULL, NULL, &e), 0);
    assert_int_equal(td_sensor_writer_add(w, grid, "x", 1, -1, &e), 0);
    td_sensor_writer_stats(w, m, sd);
    assert_true(m[0] == 5 && sd[0] == 1); /* channel 0 is constant: std 1 */
    assert_true(fabs(m[1] - 1.5) < 1e-6 && fabs(sd[1] - 0.5) < 1e-6);
    assert_int_equal(td_sensor_writer_finish(w, mean, std, &e), 0);
    td_sensor_writer_free(w);
    assert_int_equal(td_sensor_check(path, NULL, &h, &e), 0);
    assert_true(h.ch[0].mean == 1.5f && h.ch[0].std == 0.25f);
    assert_true(h.ch[1].mean == -2 && h.ch[1].std == 3);
    assert_int_equal(h.split, TD_SENSOR_SPLIT_VALID);
    assert_int_equal(h.n_labels, 0);
}

/* One corruption of a good header: bytes at off, and what the refusal must say. */
typedef struct corruption {
    int off;
    int n;
    const char *bytes;
    int code;
    const char *what;
} corruption;

#define LE32(v)                                                               \
    (const char[])                                                            \
    {                                                                         \
        (char)((v)&255), (char)(((v) >> 8) & 255), (char)(((v) >> 16) & 255), \
            (char)(((unsigned)(v) >> 24) & 255)                               \
    }
#define CH(c, field) (256 + 64 * (c) + (field))

static void test_bad_headers(void **state)
{
    const corruption cases[] = {
        /* not static: LE32's compound literals live in this block */
        {0, 8, "XDSENSOR", TD_EDATA, "header field magic: \"XDSENSOR\""},
        {0, 1, "\x01", TD_EDATA, "header field magic: \"\\x01DSENSOR\""},
        {8, 4, LE32(2), TD_EDATA, "header field version: 2, but only version 1 is read"},
        {12, 4, LE32(1024), TD_EDATA, "header field header_bytes: 1024, must be 4096"},
        {16, 4, LE32(0), TD_EDATA, "header field time_steps: 0, must be 1 to 65536"},
        {16, 4, LE32(70000), TD_E2BIG, "header field time_steps: 70000"},
        {20, 4, LE32(0), TD_EDATA, "header field channels: 0"},
        {20, 4, LE32(61), TD_E2BIG, "header field channels: 61, must be 1 to 60"},
        {24, 4, LE32(0), TD_EDATA, "header field samples: 0"},
        {28, 4, LE32(1), TD_E2BIG, "header field samples: 4294967299"},
        {28, 4, LE32(-1), TD_EDATA, "header field samples: -"},
        {32, 4, LE32(0), TD_EDATA, "header field caption_len: 0"},
        {32, 4, LE32(5000), TD_E2BIG, "header field caption_len: 5000, must be 1 to 4096"},
        {36, 4, LE32(-1), TD_EDATA, "header field labels: -1"},
        {36, 4, LE32(300), TD_E2BIG, "header field labels: 300, must be 0 to 256"},
        {40, 4, LE32(-5), TD_EDATA, "header field period_s: -5"},
        {44, 4, LE32(3), TD_E2BIG, "header field split: 3, must be 0 to 2"},
        {100, 1, "\x07", TD_EDATA, "header field reserved: byte 100 is 7, must be 0"},
        {CH(1, 0), 1, "\0", TD_EDATA, "header field channel[1].name: empty"},
        {CH(1, 4), 1, "0", TD_EDATA, "header field channel[1].name: \"chan0\" again"},
        {CH(1, 5), 27, "xxxxxxxxxxxxxxxxxxxxxxxxxxx", TD_EDATA,
         "header field channel[1].name: not NUL-terminated"},
        {CH(2, 1), 1, "\t", TD_EDATA, "header field channel[2].name: byte 0x09"},
        {CH(2, 36), 1, "z", TD_EDATA, "header field channel[2].unit: nonzero byte after its end"},
        {CH(0, 52), 4, LE32(0), TD_EDATA, "header field channel[0].std (chan0): 0"},
        {CH(0, 52), 4, LE32(0xbf800000u), TD_EDATA, "header field channel[0].std (chan0): -1"},
        {CH(1, 48), 4, LE32(0x7fc00000u), TD_EDATA, "header field channel[1].mean (chan1): nan"},
        {CH(2, 60), 1, "\x01", TD_EDATA, "header field channel[2].reserved: byte 60"},
        {CH(5, 0), 1, "a", TD_EDATA, "header field channel[5] (unused): byte 0 is 97"},
        {24, 4, LE32(SN + 1), TD_EDATA, "file size: 4556 bytes, but the header's 4 samples"},
        {36, 4, LE32(0), TD_EDATA, "file size: 4556 bytes"},
    };
    const char *good = at("good.bin"), *bad = at("bad.bin");
    size_t n;
    unsigned char *b;

    (void)state;
    write_small(good);
    b = read_file(good, &n);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const corruption *k = &cases[i];
        unsigned char *copy = malloc(n);
        td_error_t e = {0};
        td_sensor *s = (td_sensor *)1;
        assert_non_null(copy);
        memcpy(copy, b, n);
        memcpy(copy + k->off, k->bytes, (size_t)k->n);
        write_file(bad, copy, n);
        assert_refused(td_sensor_check(bad, NULL, NULL, &e), k->code, &e, bad, k->what);
        memset(&e, 0, sizeof(e));
        assert_refused(td_sensor_open(&s, bad, NULL, &e), k->code, &e, bad, k->what);
        assert_null(s);
        free(copy);
    }
    free(b);
}

/* A good file that does not fit the model: TD_ESHAPE naming the field and both numbers. */
static void test_model_mismatch(void **state)
{
    const char *path = at("small.bin");
    td_sensor_expect want = {.T = ST, .C = 10};
    td_sensor_header h;
    td_error_t e = {0};
    char msg[600];

    (void)state;
    write_small(path);
    snprintf(msg, sizeof(msg), "%s: header field channels: 3, but the model expects 10", path);
    assert_int_equal(td_sensor_check(path, &want, &h, &e), TD_ESHAPE);
    assert_string_equal(e.msg, msg);
    want = (td_sensor_expect){.T = 1440, .C = SC};
    assert_refused(td_sensor_check(path, &want, &h, &e), TD_ESHAPE, &e, path,
                   "header field time_steps: 4, but the model expects 1440");
    want = (td_sensor_expect){.T = ST, .C = SC, .labels = 1};
    assert_int_equal(td_sensor_check(path, &want, &h, &e), 0);
    want = (td_sensor_expect){.labels = 1};
    {
        td_sensor_header g;
        td_sensor_writer *w;
        float grid[2] = {1, 2};
        header(&g, 1, 2, 1, 4, 0);
        assert_int_equal(td_sensor_writer_open(&w, at("nolabels.bin"), &g, NULL, NULL, &e), 0);
        assert_int_equal(td_sensor_writer_add(w, grid, "", 0, -1, &e), 0);
        assert_int_equal(td_sensor_writer_finish(w, NULL, NULL, &e), 0);
        td_sensor_writer_free(w);
    }
    assert_refused(td_sensor_check(at("nolabels.bin"), &want, NULL, &e), TD_ESHAPE, &e,
                   "nolabels.bin", "header field labels: 0, but the job needs labelled samples");
}

static void test_compatible(void **state)
{
    td_sensor_header a, b;
    td_error_t e = {0};

    (void)state;
    header(&a, 1440, 10, 5, 256, 7);
    b = a;
    assert_int_equal(td_sensor_compatible("/a.bin", &a, "/b.bin", &b, &e), 0);
    b.C = 9;
    assert_refused(td_sensor_compatible("/a.bin", &a, "/b.bin", &b, &e), TD_ESHAPE, &e, "/b.bin",
                   "header field channels: 9, but /a.bin has 10");
    b = a;
    snprintf(b.ch[3].name, sizeof(b.ch[3].name), "steps");
    assert_refused(td_sensor_compatible("/a.bin", &a, "/b.bin", &b, &e), TD_ESHAPE, &e, "/b.bin",
                   "header field channel[3].name: \"steps\", but /a.bin has \"chan3\"");
    b = a;
    b.T = 60;
    assert_refused(td_sensor_compatible("/a.bin", &a, "/b.bin", &b, &e), TD_ESHAPE, &e, "/b.bin",
                   "time_steps: 60");
}

/* Files cut short, or shorter than a header, or changed under an open reader. */
static void test_truncated(void **state)
{
    const char *path = at("small.bin"), *cut = at("cut.bin");
    size_t n;
    unsigned char *b;
    td_error_t e = {0};
    td_sensor *s;
    float grid[ST * SC];

    (void)state;
    write_small(path);
    b = read_file(path, &n);
    write_file(cut, b, n - 1);
    assert_refused(td_sensor_check(cut, NULL, NULL, &e), TD_EDATA, &e, cut,
                   "file size: 4555 bytes, but the header's 3 samples of 4 x 3, caption_len 16 "
                   "and 2 labels take 4556");
    write_file(cut, b, 100);
    assert_refused(td_sensor_check(cut, NULL, NULL, &e), TD_EDATA, &e, cut,
                   "file size: 100 bytes, shorter than a sensor shard's 4096-byte header");
    write_file(cut, b, 0);
    assert_refused(td_sensor_check(cut, NULL, NULL, &e), TD_EDATA, &e, cut, "file size: 0 bytes");
    assert_refused(td_sensor_check(at("missing.bin"), NULL, NULL, &e), TD_ENOTFOUND, &e,
                   "missing.bin", "No such file");
    /* Open whole, then cut under the reader: a read past the new end is TD_EDATA, not a crash. */
    write_file(cut, b, n);
    assert_int_equal(td_sensor_open(&s, cut, NULL, &e), 0);
    assert_int_equal(truncate(cut, 4096 + 48), 0); /* the first sample only */
    assert_int_equal(td_sensor_read(s, 0, grid, NULL, NULL, NULL, &e), 0);
    assert_refused(td_sensor_read(s, 2, grid, NULL, NULL, NULL, &e), TD_EDATA, &e, cut,
                   "reading sample 2: 0 of 48 bytes at offset 4192: the file changed");
    td_sensor_close(s);
    free(b);
}

/* A directory or a FIFO named as a shard: refused at once (a FIFO must not block). */
static void test_not_a_file(void **state)
{
    td_error_t e = {0};

    (void)state;
    assert_int_equal(mkfifo(at("fifo"), 0600), 0);
    assert_refused(td_sensor_check(at("fifo"), NULL, NULL, &e), TD_EDATA, &e, "fifo",
                   "not a regular file");
    assert_refused(td_sensor_check(dir, NULL, NULL, &e), TD_EDATA, &e, dir, "not a regular file");
}

/* A header that promises 2^24 samples and 256 labels in a 4-kB file: refused by its size
 * before the 64 MiB of labels it names are allocated (the message would otherwise be a short
 * read of the labels). And counts past the limits are refused as such. */
static void test_huge_counts(void **state)
{
    const char *path = at("small.bin"), *huge = at("huge.bin");
    size_t n;
    unsigned char *b;
    td_error_t e = {0};
    td_sensor *s = NULL;

    (void)state;
    write_small(path);
    b = read_file(path, &n);
    memcpy(b + 24, LE32(TD_SENSOR_MAX_SAMPLES), 4);
    memcpy(b + 36, LE32(TD_SENSOR_MAX_LABELS), 4);
    write_file(huge, b, TD_SENSOR_HEADER_BYTES);
    assert_refused(td_sensor_open(&s, huge, NULL, &e), TD_EDATA, &e, huge,
                   "file size: 4096 bytes, but the header's 16777216 samples");
    assert_null(s);
    memcpy(b + 24, LE32(TD_SENSOR_MAX_SAMPLES + 1), 4);
    write_file(huge, b, TD_SENSOR_HEADER_BYTES);
    assert_refused(td_sensor_open(&s, huge, NULL, &e), TD_E2BIG, &e, huge,
                   "header field samples: 16777217, must be 1 to 16777216");
    memcpy(b + 24, LE32(SN), 4);
    memcpy(b + 28, LE32(0x7fffffff), 4); /* 2^62 samples */
    write_file(huge, b, TD_SENSOR_HEADER_BYTES);
    assert_refused(td_sensor_check(huge, NULL, NULL, &e), TD_E2BIG, &e, huge,
                   "header field samples: 9223372032559808515");
    free(b);
}

/* What the header cannot show: a label past K, a bad label entry, an infinite reading. */
static void test_bad_body(void **state)
{
    const char *path = at("small.bin"), *bad = at("bad.bin");
    size_t n, labels_at = 4096 + SN * ST * SC * 4, table_at = labels_at + SN * 4;
    unsigned char *b;
    td_error_t e = {0};
    td_sensor *s;
    float grid[ST * SC], inf = INFINITY;

    (void)state;
    write_small(path);
    b = read_file(path, &n);
    memcpy(b + labels_at + 4, LE32(7), 4);
    write_file(bad, b, n);
    assert_int_equal(td_sensor_check(bad, NULL, NULL, &e), 0); /* the header is fine */
    assert_refused(td_sensor_open(&s, bad, NULL, &e), TD_EDATA, &e, bad,
                   "sample 1: label 7, but the file has 2 labels");
    memcpy(b + labels_at + 4, LE32(1), 4);
    memcpy(b + table_at + 128 + 32, "\0", 1); /* label 1's prompt: empty */
    write_file(bad, b, n);
    assert_refused(td_sensor_open(&s, bad, NULL, &e), TD_EDATA, &e, bad, "label[1].prompt: empty");
    memcpy(b + table_at + 128 + 32, "r", 1);
    memcpy(b + table_at + 128, "sleep", 5); /* label 1 named like label 0 */
    write_file(bad, b, n);
    assert_refused(td_sensor_open(&s, bad, NULL, &e), TD_EDATA, &e, bad,
                   "label[1].name: \"sleep\" again");
    memcpy(b + table_at + 128, "run\0\0", 5);
    memcpy(b + 4096 + (ST * SC + 2 * SC + 1) * 4, &inf, 4); /* sample 1, step 2, channel 1 */
    write_file(bad, b, n);
    assert_int_equal(td_sensor_open(&s, bad, NULL, &e), 0);
    assert_refused(td_sensor_read(s, 1, grid, NULL, NULL, NULL, &e), TD_EDATA, &e, bad,
                   "sample 1, step 2, channel chan1: inf");
    assert_int_equal(td_sensor_read(s, 0, grid, NULL, NULL, NULL, &e), 0);
    td_sensor_close(s);
    free(b);
}

/* The writer refuses a bad header or sample and leaves no file behind when not finished. */
static void test_writer_refusals(void **state)
{
    const char *path = at("w.bin");
    const char *names[2] = {"a", "a"};
    td_sensor_header h;
    td_sensor_writer *w = NULL;
    td_error_t e = {0};
    float grid[2] = {1, INFINITY};

    (void)state;
    header(&h, 1, 2, 2, 4, 0);
    h.C = 0;
    assert_refused(td_sensor_writer_open(&w, path, &h, NULL, NULL, &e), TD_EINVAL, &e, path,
                   "header field channels: 0");
    header(&h, 1, 2, 2, 4, 0);
    snprintf(h.ch[1].name, sizeof(h.ch[1].name), "chan0");
    assert_refused(td_sensor_writer_open(&w, path, &h, NULL, NULL, &e), TD_EINVAL, &e, path,
                   "channel[1].name: \"chan0\" again");
    header(&h, 1, 2, 2, 4, 2);
    assert_refused(td_sensor_writer_open(&w, path, &h, names, NULL, &e), TD_EINVAL, &e, path,
                   "label[1].name: \"a\" again");
    header(&h, 1, 2, 2, 4, 1);
    assert_int_equal(td_sensor_writer_open(&w, path, &h, names, NULL, &e), 0);
    assert_int_equal(access(at("w.bin.tmp"), F_OK), 0);
    assert_refused(td_sensor_writer_add(w, grid, "", 0, 0, &e), TD_EINVAL, &e, path,
                   "sample 0, step 0, channel chan1: inf");
    grid[1] = 2;
    assert_refused(td_sensor_writer_add(w, grid, "12345", 5, 0, &e), TD_EINVAL, &e, path,
                   "caption of 5 bytes, longer than caption_len 4");
    assert_refused(td_sensor_writer_add(w, grid, "a\0b", 3, 0, &e), TD_EINVAL, &e, path,
                   "caption holds a NUL byte");
    assert_refused(td_sensor_writer_add(w, grid, "", 0, 1, &e), TD_EINVAL, &e, path,
                   "label 1, but the file has 1 labels");
    assert_int_equal(td_sensor_writer_add(w, grid, "ok", 2, 0, &e), 0);
    assert_refused(td_sensor_writer_finish(w, NULL, NULL, &e), TD_EINVAL, &e, path,
                   "1 of 2 samples written");
    td_sensor_writer_free(w);
    assert_int_equal(access(at("w.bin.tmp"), F_OK), -1);
    assert_int_equal(access(path, F_OK), -1);
    td_sensor_writer_free(NULL);
    td_sensor_close(NULL);
}

/* ---- trainctl sensor synth ----------------------------------------------------------------- */

/* Each day of a shard, with its label and caption, to f(ud, ...). */
static void each_day(const char *path,
                     void (*f)(void *ud, const td_sensor *s, int64_t i, const float *grid,
                               const char *cap, int label),
                     void *ud)
{
    td_sensor *s;
    td_error_t e = {0};
    const td_sensor_header *h;
    float *grid;
    char cap[TD_SENSOR_MAX_CAPTION + 1];
    int32_t label;

    if (td_sensor_open(&s, path, NULL, &e) != 0)
        fail_msg("%s", e.msg);
    h = td_sensor_header_of(s);
    grid = malloc(sizeof(float) * (size_t)h->T * (size_t)h->C);
    assert_non_null(grid);
    for (int64_t i = 0; i < h->N; i++) {
        assert_int_equal(td_sensor_read(s, i, grid, cap, NULL, &label, &e), 0);
        f(ud, s, i, grid, cap, label);
    }
    free(grid);
    td_sensor_close(s);
}

static void test_synth_deterministic(void **state)
{
    (void)state;
    assert_int_equal(sh("%s sensor synth -o %s --days 40 --seed 5", trainctl(), at("a")), 0);
    assert_non_null(strstr(out, "sensor synth: 36 train days in "));
    assert_non_null(strstr(out, "4 valid days in "));
    assert_non_null(strstr(out, "10 channels, 1440 minutes a day; labels (train+valid): rest "));
    assert_int_equal(sh("%s sensor synth -o %s --days 40 --seed 5", trainctl(), at("b")), 0);
    assert_int_equal(sh("%s sensor synth -o %s --days 40 --seed 6", trainctl(), at("c")), 0);
    assert_true(files_equal(at("a/synth-train.bin"), at("b/synth-train.bin")));
    assert_true(files_equal(at("a/synth-valid.bin"), at("b/synth-valid.bin")));
    assert_false(files_equal(at("a/synth-train.bin"), at("c/synth-train.bin")));
    assert_false(files_equal(at("a/synth-valid.bin"), at("c/synth-valid.bin")));
    /* The valid split's people are not the train split's: its days differ from train's. */
    assert_false(files_equal(at("a/synth-train.bin"), at("a/synth-valid.bin")));
}

static void test_synth_usage(void **state)
{
    (void)state;
    assert_int_equal(sh("%s sensor synth -o %s", trainctl(), at("x")), 64);
    assert_non_null(strstr(err_text, "missing --days N"));
    assert_int_equal(sh("%s sensor synth -o %s --days 1", trainctl(), at("x")), 64);
    assert_non_null(strstr(err_text, "--days needs a number from 2 to 100000, not '1'"));
    assert_int_equal(sh("%s sensor synth --days 5", trainctl()), 64);
    assert_non_null(strstr(err_text, "missing -o DIR"));
    assert_int_equal(sh("%s sensor synth -o %s --days 5 --valid 1", trainctl(), at("x")), 64);
    assert_int_equal(sh("%s sensor synth -o %s --days 5 --bogus 1", trainctl(), at("x")), 64);
    assert_non_null(strstr(err_text, "unknown option '--bogus'"));
    assert_int_equal(sh("%s sensor synth -o %s --days 5 --channels a", trainctl(), at("x")), 64);
    assert_non_null(strstr(err_text, "'--channels' is not an option here"));
    assert_int_equal(sh("%s sensor frobnicate", trainctl()), 64);
    assert_int_equal(sh("%s sensor synth --help", trainctl()), 0);
    assert_non_null(strstr(out, "usage: trainctl sensor synth -o DIR --days N"));
    assert_int_equal(sh("%s completion bash", trainctl()), 0);
    assert_non_null(strstr(out, "sensor) flags='"));
    assert_non_null(strstr(out, "--days"));
}

/* What a day's caption says of its workout: "<prompt>: a 35-minute run at 07:10". */
typedef struct workout {
    int start, dur; /* dur 0: a rest day */
} workout;

static workout parse_workout(const td_sensor *s, const char *cap, int label)
{
    const char *prompts = td_sensor_label_prompt(s, label), *p;
    size_t lead = strcspn(prompts, "|"); /* the first of the label's prompts leads its captions */
    char prompt[TD_SENSOR_PROMPT_BYTES];
    workout w = {0, 0};
    int hh, mm;

    snprintf(prompt, sizeof(prompt), "%.*s", (int)lead, prompts);
    if (strncmp(cap, prompt, strlen(prompt)) != 0 || cap[strlen(prompt)] != ':')
        fail_msg("caption does not start with its label's prompt '%s': %s", prompt, cap);
    if (strcmp(td_sensor_label_name(s, label), "rest") == 0) {
        assert_non_null(strstr(cap, ": no workout"));
        return w;
    }
    p = strchr(cap, ':') + 2;
    p += strncmp(p, "an ", 3) == 0 ? 3 : 2;
    if (sscanf(p, "%d-minute", &w.dur) != 1 || (p = strstr(p, " at ")) == NULL ||
        sscanf(p, " at %d:%d", &hh, &mm) != 2)
        fail_msg("no workout in: %s", cap);
    w.start = hh * 60 + mm;
    return w;
}

enum { HR, STEPS, SKIN, EDA, SLEEP, ACCEL, ALT }; /* the generator's first channels */

/* Sums over many days, by the label's name. */
typedef struct physio {
    int64_t labels[8], days;
    double sleep_hr, sleep_n, run_hr, run_n, run_steps, walk_steps, walk_n;
    double sleep_skin, sleep_skin_n, awake_skin, awake_n, swim_skin, swim_n;
    double hike_climb, hikes;
    double steps_not_on_foot; /* steps in sleep, in swims and on bikes */
    double missing, cells;
    int caption_max;
} physio;

static void physio_day(void *ud, const td_sensor *s, int64_t i, const float *g, const char *cap,
                       int label)
{
    physio *ph = ud;
    const td_sensor_header *h = td_sensor_header_of(s);
    const char *name = td_sensor_label_name(s, label);
    workout w = parse_workout(s, cap, label);
    int C = h->C;
    double climb = 0;

    (void)i;
    ph->labels[label]++;
    ph->days++;
    ph->caption_max = (int)strlen(cap) > ph->caption_max ? (int)strlen(cap) : ph->caption_max;
    for (int t = 0; t < h->T; t++) {
        const float *r = g + (size_t)t * C;
        int in = t >= w.start && t < w.start + w.dur;
        for (int c = 0; c < C; c++)
            ph->missing += isnan(r[c]);
        ph->cells += C;
        if (isnan(r[SLEEP]))
            continue; /* the watch was off */
        if (r[SLEEP] > 0) {
            ph->steps_not_on_foot += isnan(r[STEPS]) ? 0 : r[STEPS];
            if (!isnan(r[HR])) {
                ph->sleep_hr += r[HR];
                ph->sleep_n++;
            }
            if (!isnan(r[SKIN])) {
                ph->sleep_skin += r[SKIN];
                ph->sleep_skin_n++;
            }
        } else if (!in && r[ACCEL] < 0.1 && !isnan(r[SKIN])) {
            ph->awake_skin += r[SKIN];
            ph->awake_n++;
        }
        if (in && (strcmp(name, "swim") == 0 || strcmp(name, "cycle") == 0))
            ph->steps_not_on_foot += isnan(r[STEPS]) ? 0 : r[STEPS];
        if (in && strcmp(name, "swim") == 0 && t >= w.start + 10 && !isnan(r[SKIN])) {
            ph->swim_skin += r[SKIN];
            ph->swim_n++;
        }
        if (in && strcmp(name, "run") == 0 && t >= w.start + 6 && t < w.start + w.dur - 3) {
            ph->run_hr += isnan(r[HR]) ? 0 : r[HR];
            ph->run_n += !isnan(r[HR]);
            ph->run_steps += r[STEPS];
        }
        if (in && strcmp(name, "walk") == 0) {
            ph->walk_steps += r[STEPS];
            ph->walk_n++;
        }
        if (in && strcmp(name, "hike") == 0 && !isnan(r[ALT]))
            climb += r[ALT] > 0 ? r[ALT] : 0;
    }
    if (strcmp(name, "hike") == 0) {
        ph->hike_climb += climb;
        ph->hikes++;
    }
}

/* 700 days: the labels are balanced, and the physiology holds on average and minute by
 * minute where it is a rule (no steps asleep, in the pool or on the bike). */
static void test_synth_physiology(void **state)
{
    physio ph;
    td_sensor_header h;
    td_error_t e = {0};
    td_sensor *s;

    (void)state;
    memset(&ph, 0, sizeof(ph));
    assert_int_equal(sh("%s sensor synth -o %s --days 700 --seed 11", trainctl(), at("d")), 0);
    assert_int_equal(td_sensor_check(at("d/synth-train.bin"), NULL, &h, &e), 0);
    assert_int_equal(h.T, 1440);
    assert_true(h.C >= 8);
    assert_int_equal(h.n_labels, 7);
    assert_int_equal(h.period_s, 60);
    assert_string_equal(h.ch[HR].name, "heart_rate");
    assert_string_equal(h.ch[STEPS].name, "steps");
    assert_string_equal(h.ch[SLEEP].name, "sleep_state");
    assert_int_equal(h.caption_len, 256);
    assert_int_equal(td_sensor_open(&s, at("d/synth-train.bin"), NULL, &e), 0);
    assert_string_equal(td_sensor_label_name(s, 2), "run");
    assert_string_equal(td_sensor_label_prompt(s, 2), "running day|running day: a 50-minute run");
    assert_string_equal(td_sensor_label_prompt(s, 0), "rest day|rest day: no workout");
    td_sensor_close(s);
    each_day(at("d/synth-train.bin"), physio_day, &ph);
    each_day(at("d/synth-valid.bin"), physio_day, &ph);
    assert_int_equal(ph.days, 700);
    for (int l = 0; l < 7; l++) /* each label between 8% and 25% of the days */
        if (ph.labels[l] < 0.08 * 700 || ph.labels[l] > 0.25 * 700)
            fail_msg("label %d: %lld of 700 days", l, (long long)ph.labels[l]);
    assert_true(ph.caption_max <= 256);
    assert_true(ph.steps_not_on_foot == 0);
    /* Running heart rate (bpm) is far above sleeping heart rate; runs have a running cadence
     * (steps/min), walks a walking one. */
    assert_true(ph.run_hr / ph.run_n > ph.sleep_hr / ph.sleep_n + 50);
    assert_true(ph.run_steps / ph.run_n > 150);
    assert_true(ph.walk_steps / ph.walk_n > 90 && ph.walk_steps / ph.walk_n < 130);
    /* Skin temperature (degC): warmer asleep than awake at rest, cold in the pool. */
    assert_true(ph.sleep_skin / ph.sleep_skin_n > ph.awake_skin / ph.awake_n + 0.5);
    assert_true(ph.swim_skin / ph.swim_n < 30);
    /* A hike climbs (m) and comes down. */
    assert_true(ph.hike_climb / ph.hikes > 300);
    /* Some readings are missing, not most: between 0.5% and 10% of all. */
    assert_true(ph.missing / ph.cells > 0.005 && ph.missing / ph.cells < 0.10);
}

/* A shorter caption slot: every caption fits, and the semantic part still leads. */
static void test_synth_caption_len(void **state)
{
    physio ph;

    (void)state;
    memset(&ph, 0, sizeof(ph));
    assert_int_equal(
        sh("%s sensor synth -o %s --days 30 --seed 3 --caption-len 64", trainctl(), at("e")), 0);
    each_day(at("e/synth-train.bin"), physio_day, &ph); /* parse_workout checks the lead */
    assert_true(ph.caption_max <= 64 && ph.caption_max > 20);
}

/* ---- trainctl sensor import ---------------------------------------------------------------- */

static const char csv[] = "time,heart_rate,steps,note,activity\n"
                          "0,60,0,\"asleep, deeply\",sleep\n"
                          "1,61,,,\n"
                          "2,nan,NA,,\n"
                          "\n"
                          "3,120,150,,run\n"
                          "4, 125 ,160,a run,\n"
                          "5,130,N/A,,\n"
                          "6,70,10,,sleep\n"
                          "7,71,11,,\n"
                          "8,72,12,third,\n"
                          "9,73,13,,\n";

static void test_import(void **state)
{
    td_sensor *s;
    td_error_t e = {0};
    const td_sensor_header *h;
    td_sensor_header hv;
    float g[3 * 2];
    char cap[TD_SENSOR_MAX_CAPTION + 1];
    int32_t label;

    (void)state;
    write_text(at("day.csv"), csv);
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 3 --channels heart_rate,steps "
                        "--caption-column note --label-column activity --valid 0.34 --period 30 "
                        "--label-prompt 'run=a day with a run'",
                        trainctl(), at("day.csv"), at("shards")),
                     0);
    assert_non_null(strstr(out, "sensor import: 2 windows in "));
    assert_non_null(strstr(out, "day-train.bin, 1 in "));
    assert_non_null(strstr(out, "the last 1 rows dropped"));
    assert_non_null(strstr(out, "labels (train+valid): run 1+0 sleep 1+1"));
    assert_int_equal(td_sensor_open(&s, at("shards/day-train.bin"), NULL, &e), 0);
    h = td_sensor_header_of(s);
    assert_int_equal(h->T, 3);
    assert_int_equal(h->C, 2);
    assert_int_equal(h->N, 2);
    assert_int_equal(h->period_s, 30);
    assert_int_equal(h->split, TD_SENSOR_SPLIT_TRAIN);
    assert_string_equal(h->ch[0].name, "heart_rate");
    assert_string_equal(h->ch[1].name, "steps");
    assert_string_equal(td_sensor_label_name(s, 0), "run"); /* sorted */
    assert_string_equal(td_sensor_label_prompt(s, 0), "a day with a run");
    assert_string_equal(td_sensor_label_prompt(s, 1), "sleep");
    assert_int_equal(td_sensor_read(s, 0, g, cap, NULL, &label, &e), 0);
    assert_true(g[0] == 60 && g[1] == 0 && g[2] == 61 && isnan(g[3]) && isnan(g[4]) && isnan(g[5]));
    assert_string_equal(cap, "asleep, deeply");
    assert_int_equal(label, 1);
    assert_int_equal(td_sensor_read(s, 1, g, cap, NULL, &label, &e), 0);
    assert_true(g[0] == 120 && g[1] == 150 && g[2] == 125 && g[3] == 160 && g[4] == 130 &&
                isnan(g[5]));
    assert_string_equal(cap, "a run");
    assert_int_equal(label, 0);
    /* mean of the train readings: heart rate (60+61+120+125+130)/5 = 99.2 bpm */
    assert_true(fabs(h->ch[0].mean - 99.2) < 1e-4);
    assert_int_equal(td_sensor_check(at("shards/day-valid.bin"), NULL, &hv, &e), 0);
    assert_int_equal(hv.split, TD_SENSOR_SPLIT_VALID);
    assert_true(hv.ch[0].mean == h->ch[0].mean && hv.ch[1].std == h->ch[1].std);
    td_sensor_close(s);
    assert_int_equal(td_sensor_open(&s, at("shards/day-valid.bin"), NULL, &e), 0);
    assert_int_equal(td_sensor_read(s, 0, g, cap, NULL, &label, &e), 0);
    assert_true(g[0] == 70 && g[5] == 12);
    assert_string_equal(cap, "third");
    assert_int_equal(label, 1);
    td_sensor_close(s);
}

/* What a new user hits: 4 windows still get a valid file (one, at --valid 0.1); a column
 * named time is the time, not a channel, and the summary names the channels; a single window
 * says it has no valid file; a column that is missing names the columns there are; a text
 * column taken for a channel says how to leave it out. */
static void test_import_rough_edges(void **state)
{
    char text[2048];
    size_t n = 0;

    (void)state;
    n += (size_t)snprintf(text + n, sizeof(text) - n, "time,hr,steps\n");
    for (int i = 0; i < 12; i++)
        n += (size_t)snprintf(text + n, sizeof(text) - n, "2026-01-01T00:%02d,%d,%d\n", i, 60 + i,
                              i % 3);
    write_text(at("watch.csv"), text);
    assert_int_equal(
        sh("%s sensor import %s -o %s --time-steps 3", trainctl(), at("watch.csv"), at("edges")),
        0);
    assert_non_null(strstr(out, "sensor import: 3 windows in "));
    assert_non_null(strstr(out, "watch-train.bin, 1 in "));
    assert_non_null(strstr(out, "; 2 channels (hr, steps), 3 rows a window"));
    assert_non_null(strstr(out, "; column 'time' taken as the time, not a channel"));
    assert_int_equal(access(at("edges/watch-valid.bin"), F_OK), 0);
    /* one window: no valid file, said */
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 12 --name one", trainctl(),
                        at("watch.csv"), at("edges")),
                     0);
    assert_non_null(strstr(out, "sensor import: 1 windows in "));
    assert_non_null(strstr(out, " and no valid file (one window: the valid split needs two)"));
    /* a missing column: the columns there are */
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 3 --channels hr,bpm", trainctl(),
                        at("watch.csv"), at("edges")),
                     65);
    assert_non_null(strstr(err_text, "watch.csv:1: no column named 'bpm' (--channels); the "
                                     "columns are 'time', 'hr', 'steps'"));
    /* a text column of another name is a channel until --channels leaves it out */
    write_text(at("when.csv"), "when,hr\nmonday,60\ntuesday,61\n");
    assert_int_equal(
        sh("%s sensor import %s -o %s --time-steps 1", trainctl(), at("when.csv"), at("edges")),
        65);
    assert_non_null(strstr(err_text, "when.csv:2:1: channel when: 'monday' is not a number (every "
                                     "column is a channel: --channels names those that are)"));
}

/* Captions and labels from files of one line per window; every other column a channel. */
static void test_import_side_files(void **state)
{
    td_sensor *s;
    td_error_t e = {0};
    float g[2 * 3];
    char cap[TD_SENSOR_MAX_CAPTION + 1];
    int32_t label;

    (void)state;
    write_text(at("x.csv"), "a,b,c\n1,2,3\n4,5,6\n7,8,9\n10,11,12\n");
    write_text(at("caps.txt"), "first window\r\nsecond window\n");
    write_text(at("labs.txt"), "walk\nrest\n");
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 2 --captions %s --labels %s "
                        "--label-names rest,walk --valid 0 --name z",
                        trainctl(), at("x.csv"), at("o"), at("caps.txt"), at("labs.txt")),
                     0);
    assert_int_equal(access(at("o/z-valid.bin"), F_OK), -1); /* --valid 0: no valid shard */
    assert_int_equal(td_sensor_open(&s, at("o/z-train.bin"), NULL, &e), 0);
    assert_int_equal(td_sensor_header_of(s)->C, 3);
    assert_string_equal(td_sensor_label_name(s, 0), "rest"); /* --label-names' order */
    assert_int_equal(td_sensor_read(s, 1, g, cap, NULL, &label, &e), 0);
    assert_true(g[0] == 7 && g[5] == 12);
    assert_string_equal(cap, "second window");
    assert_int_equal(label, 0);
    assert_int_equal(td_sensor_read(s, 0, NULL, cap, NULL, &label, &e), 0);
    assert_string_equal(cap, "first window");
    assert_int_equal(label, 1);
    td_sensor_close(s);
    /* Without a caption source the captions are empty. */
    assert_int_equal(
        sh("%s sensor import %s -o %s --time-steps 4", trainctl(), at("x.csv"), at("p")), 0);
    assert_int_equal(td_sensor_open(&s, at("p/x-train.bin"), NULL, &e), 0);
    assert_int_equal(td_sensor_read(s, 0, NULL, cap, NULL, &label, &e), 0);
    assert_string_equal(cap, "");
    assert_int_equal(label, -1);
    td_sensor_close(s);
}

/* Malformed input: exit 65 and FILE:LINE:COLUMN, and no shard written. */
static void test_import_errors(void **state)
{
    static const struct {
        const char *csv, *flags, *what;
        int status;
    } cases[] = {
        {"a,b\n1,2\n3,abc\n", "", "bad.csv:3:3: channel b: 'abc' is not a number", 65},
        {"a,b\n1,2\n3\n", "", "bad.csv:3: 1 fields, but the header has 2", 65},
        {"a,b\n1,2\n3,4,5\n", "", "bad.csv:3: 3 fields, but the header has 2", 65},
        {"a,b\n1,\"2\n", "", "bad.csv:2:3: a quote that is never closed", 65},
        {"a,b\n1,2\"x\n", "", "bad.csv:2:4: a quote inside a field", 65},
        {"a,b\n1,inf\n", "", "bad.csv:2:3: channel b: 'inf' is not a number", 65},
        {"a,b\n1,2\n", "--time-steps 2", "bad.csv: 1 rows, fewer than one window of 2", 65},
        {"a,b\n1,2\n", "--channels a,q", "bad.csv:1: no column named 'q' (--channels)", 65},
        {"a,b,l\n1,2,\n3,4,\n", "--time-steps 2 --label-column l",
         "bad.csv: the window of lines 2 to 3 has no label in column 'l'", 65},
        {"a,b,l\n1,2,x\n", "--time-steps 1 --label-column l --label-names y",
         "bad.csv:2:5: label 'x' is not among --label-names", 65},
        {"a,b,c\n1,2,long caption\n", "--time-steps 1 --caption-column c --caption-len 4",
         "bad.csv:2:5: a caption of 12 bytes, longer than --caption-len 4", 65},
        {"a,b\n1,2\n3,4\n", "--time-steps 1 --captions CAPS", "caps.txt: 1 lines, but", 65},
        {"a,a\n1,2\n", "", "bad.csv:1:3: channel 'a' twice", 65},
        {"a,b\n1,2\n", "--captions x --caption-column a", "cannot be used together", 64},
        {"a,b\n1,2\n", "--label-names a", "--label-names and --label-prompt need", 64},
    };
    char flags[512];

    (void)state;
    write_text(at("caps.txt"), "only one\n");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *c = strstr(cases[i].flags, "CAPS");
        write_text(at("bad.csv"), cases[i].csv);
        if (c != NULL)
            snprintf(flags, sizeof(flags), "%.*s%s", (int)(c - cases[i].flags), cases[i].flags,
                     at("caps.txt"));
        else
            snprintf(flags, sizeof(flags), "%s", cases[i].flags);
        if (sh("%s sensor import %s -o %s --time-steps 1 %s", trainctl(), at("bad.csv"),
               at("never"), flags) != cases[i].status ||
            strstr(err_text, cases[i].what) == NULL)
            fail_msg("case %zu: expected %d and '%s', got: %s", i, cases[i].status, cases[i].what,
                     err_text);
        assert_int_equal(access(at("never/bad-train.bin"), F_OK), -1);
    }
    assert_int_equal(sh("%s sensor import %s -o %s", trainctl(), at("nope.csv"), at("never")), 66);
}

/* Runs trainctl with args (a printf format) as sh() does, but as the shell's own process (exec),
 * so that wait4 gives its peak resident memory in *rss_kb and the wall time in *secs. A time
 * limit (timeout 20) keeps a hang from hanging the test; outside the sanitizer runs an address
 * space limit keeps a reader that grows without bound from taking the box with it. */
static int sh_rss(long *rss_kb, double *secs, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int sh_rss(long *rss_kb, double *secs, const char *fmt, ...)
{
    char command[4096], cmd[5000];
    struct rusage ru;
    struct timespec t0, t1;
    va_list ap;
    pid_t pid;
    int status;

    va_start(ap, fmt);
    vsnprintf(command, sizeof(command), fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof(cmd), "%s exec timeout 20 %s >'%s/out' 2>'%s/err'",
             getenv("ASAN_OPTIONS") != NULL ? "" : "ulimit -v 1000000;", command, dir, dir);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    assert_int_equal(wait4(pid, &status, 0, &ru), pid);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    *rss_kb = ru.ru_maxrss;
    *secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    slurp(at("out"), out, sizeof(out));
    slurp(at("err"), err_text, sizeof(err_text));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A 300 MB line (a sparse file of zeros, no newline) is refused at the 1 MiB line limit
 * without being buffered: the importer's peak memory stays far below the file's size. */
static void test_import_line_limit_memory(void **state)
{
    long rss;
    double secs;
    int fd;

    (void)state;
    fd = open(at("zeros.csv"), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 300L * 1000 * 1000), 0);
    close(fd);
    assert_int_equal(
        sh_rss(&rss, &secs, "%s sensor import %s -o %s", trainctl(), at("zeros.csv"), at("never")),
        65);
    print_message("sensor import of a 300 MB line: exit 65 in %.2f s, max RSS %ld KiB\n", secs,
                  rss);
    if (strstr(err_text, "zeros.csv:1: longer than 1048576 bytes") == NULL)
        fail_msg("expected the line limit, got: %s", err_text);
    assert_true(rss < 64 * 1024); /* today's reader held the whole line: 314 MiB */
    assert_int_equal(access(at("never/zeros-train.bin"), F_OK), -1);
}

/* Input that is not a regular file is refused at once, naming it: /dev/zero (which never ends)
 * and a FIFO with no writer (whose open blocks, and which cannot be read twice). */
static void test_import_not_regular(void **state)
{
    long rss;
    double secs;

    (void)state;
    assert_int_equal(
        sh_rss(&rss, &secs, "%s sensor import /dev/zero -o %s --name z", trainctl(), at("never")),
        66);
    print_message("sensor import /dev/zero: exit 66 in %.3f s, max RSS %ld KiB\n", secs, rss);
    if (strstr(err_text, "/dev/zero: not a regular file (a character device)") == NULL)
        fail_msg("expected a refusal naming /dev/zero, got: %s", err_text);
    assert_true(rss < 64 * 1024); /* a hang is sh_rss's timeout, exit 124, not 66 */
    assert_int_equal(mkfifo(at("pipe.csv"), 0600), 0);
    assert_int_equal(
        sh_rss(&rss, &secs, "%s sensor import %s -o %s", trainctl(), at("pipe.csv"), at("never")),
        66);
    print_message("sensor import of a FIFO: exit 66 in %.3f s\n", secs);
    if (strstr(err_text, "pipe.csv: not a regular file (a FIFO)") == NULL)
        fail_msg("expected a refusal naming the FIFO, got: %s", err_text);
    /* A side file is read the same way. */
    write_text(at("ok.csv"), "a,b\n1,2\n3,4\n");
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 1 --captions %s", trainctl(),
                        at("ok.csv"), at("never"), at("pipe.csv")),
                     66);
    assert_non_null(strstr(err_text, "pipe.csv: not a regular file (a FIFO)"));
}

/* A NUL byte in a field is refused with FILE:LINE:COLUMN, not read as the end of the field. */
static void test_import_nul(void **state)
{
    static const char body[] = "a,b\n1,2\n3,\0"
                               "5\n";
    static const char caps[] = "one\nt\0wo\n";

    (void)state;
    write_file(at("nul.csv"), body, sizeof(body) - 1);
    assert_int_equal(
        sh("%s sensor import %s -o %s --time-steps 1", trainctl(), at("nul.csv"), at("never")), 65);
    if (strstr(err_text, "nul.csv:3:3: a NUL byte") == NULL)
        fail_msg("expected nul.csv:3:3, got: %s", err_text);
    assert_int_equal(access(at("never/nul-train.bin"), F_OK), -1);
    write_text(at("ok.csv"), "a,b\n1,2\n3,4\n");
    write_file(at("caps.txt"), caps, sizeof(caps) - 1);
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 1 --captions %s", trainctl(),
                        at("ok.csv"), at("never"), at("caps.txt")),
                     65);
    if (strstr(err_text, "caps.txt:2:2: a NUL byte") == NULL)
        fail_msg("expected caps.txt:2:2, got: %s", err_text);
}

/* --name is a name, not a path: 1 to 64 bytes of [A-Za-z0-9._-], not starting with a dot. */
static void test_import_name(void **state)
{
    static const char *const bad[] = {
        "../../x", "a/b",
        "/tmp/x",  ".hidden",
        "..",      "a b",
        "a\\\\b",  "x12345678901234567890123456789012345678901234567890123456789012345"};
    char sub[600];

    (void)state;
    write_text(at("ok.csv"), "a,b\n1,2\n3,4\n");
    assert_int_equal(mkdir(at("o"), 0700), 0);
    snprintf(sub, sizeof(sub), "%s", at("o/p"));
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        if (sh("%s sensor import %s -o %s --time-steps 1 --name '%s'", trainctl(), at("ok.csv"),
               sub, bad[i]) != 64 ||
            strstr(err_text, "a name is 1 to 64 bytes of letters, digits") == NULL)
            fail_msg("--name '%s': expected 64 and the rule, got: %s", bad[i], err_text);
    }
    assert_int_equal(access(at("x-train.bin"), F_OK), -1);
    assert_int_equal(access(at("o/p/b-train.bin"), F_OK), -1);
    assert_int_equal(access(at("o/p"), F_OK), -1);
    /* 64 bytes of the allowed characters, and a dot inside, are a name. */
    assert_int_equal(sh("%s sensor import %s -o %s --time-steps 1 --valid 0 --name "
                        "A.b_c-1234567890123456789012345678901234567890123456789012345678",
                        trainctl(), at("ok.csv"), sub),
                     0);
    assert_int_equal(
        access(at("o/p/A.b_c-1234567890123456789012345678901234567890123456789012345678-train.bin"),
               F_OK),
        0);
}

/* A normal large input: memory is the windows being built, not the file. */
static void test_import_large_memory(void **state)
{
    FILE *f;
    long rss;
    double secs;
    struct stat st;

    (void)state;
    f = fopen(at("big.csv"), "w");
    assert_non_null(f);
    fputs("heart_rate,steps,temp,spo2\n", f);
    for (int i = 0; i < 600000; i++)
        fprintf(f, "%d.%03d,%d,%d.%02d,%d\n", 50 + i % 90, i % 1000, i % 200, 36 + i % 2, i % 100,
                90 + i % 10);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(stat(at("big.csv"), &st), 0);
    assert_int_equal(sh_rss(&rss, &secs, "%s sensor import %s -o %s --time-steps 60", trainctl(),
                            at("big.csv"), at("o")),
                     0);
    print_message("sensor import of a %lld-byte CSV (600000 rows, 10000 windows): %.2f s, max RSS "
                  "%ld KiB\n",
                  (long long)st.st_size, secs, rss);
    assert_non_null(strstr(out, "sensor import: 9000 windows in "));
    assert_true(rss < 64 * 1024);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_given_and_constant_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_headers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_model_mismatch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_compatible, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncated, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_a_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_huge_counts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_body, setup, teardown),
        cmocka_unit_test_setup_teardown(test_writer_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_synth_deterministic, setup, teardown),
        cmocka_unit_test_setup_teardown(test_synth_usage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_synth_physiology, setup, teardown),
        cmocka_unit_test_setup_teardown(test_synth_caption_len, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_side_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_rough_edges, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_line_limit_memory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_not_regular, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_nul, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_name, setup, teardown),
        cmocka_unit_test_setup_teardown(test_import_large_memory, setup, teardown),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
