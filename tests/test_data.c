/* Unit tests of train/data.c (token data: text and llm.c shards, globs, refusals, llm.c's
 * window arithmetic, shuffling, cursors, splits, replica slices), of how train/ opens a job's
 * files (as the job's user, only regular files, a load that stops when asked, an IDX stream
 * held to its header, headers read without loading) and train/ckpt.c (checkpoint round trip,
 * pruning, torn and corrupt files, size checks, a full disk). Every test works in its own
 * temporary directory, removed at the end. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmocka.h>

#include "train/ckpt.h"
#include "train/data.h"
#include "train/engine.h"
#include "train/weights.h"

/* ---- helpers ----------------------------------------------------------------------------- */

typedef struct tmp {
    char dir[256];
} tmp;

static void tmp_make(tmp *t)
{
    const char *base = getenv("TMPDIR");

    snprintf(t->dir, sizeof(t->dir), "%s/td-data-XXXXXX", base != NULL ? base : "/tmp");
    assert_non_null(mkdtemp(t->dir));
}

static void tmp_remove(tmp *t)
{
    char cmd[512];

    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", t->dir);
    assert_int_equal(system(cmd), 0);
}

static const char *at(const tmp *t, const char *name)
{
    static char buf[4][512];
    static int i;

    i = (i + 1) % 4;
    snprintf(buf[i], sizeof(buf[i]), "%s/%s", t->dir, name);
    return buf[i];
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");

    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void write_text(const char *path, const char *s)
{
    write_bytes(path, s, strlen(s));
}

/* An llm.c shard with header (magic, version, count) and n tokens; n may differ from count. */
static void write_shard_raw(const char *path, int32_t magic, int32_t version, int32_t count,
                            const uint16_t *tok, size_t n)
{
    int32_t h[256] = {0};
    FILE *f = fopen(path, "wb");

    h[0] = magic;
    h[1] = version;
    h[2] = count;
    assert_non_null(f);
    assert_int_equal(fwrite(h, sizeof(h), 1, f), 1);
    if (n > 0)
        assert_int_equal(fwrite(tok, 2, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* A shard whose tokens are first, first+1, ...: each token names its place in the stream. */
static void write_shard_seq(const char *path, int first, int n)
{
    uint16_t *tok = malloc((size_t)n * 2 + 2);

    for (int i = 0; i < n; i++)
        tok[i] = (uint16_t)(first + i);
    write_shard_raw(path, TD_DATA_SHARD_MAGIC, TD_DATA_SHARD_VERSION, n, tok, (size_t)n);
    free(tok);
}

static td_data_spec spec_of(td_data_format f, const char **train, int n_train, int B, int T)
{
    td_data_spec s;

    memset(&s, 0, sizeof(s));
    s.format = f;
    s.train = train;
    s.n_train = n_train;
    s.B = B;
    s.T = T;
    s.seed = 1;
    return s;
}

static td_data *open_ok(const td_data_spec *s)
{
    td_error_t err = {0};
    td_data *d = NULL;
    int rc = td_data_open(&d, s, &err);

    if (rc != 0)
        fail_msg("td_data_open: %d %s", rc, err.msg);
    return d;
}

/* Opens and expects code with exactly msg. */
static void open_refused(const td_data_spec *s, int code, const char *msg)
{
    td_error_t err = {0};
    td_data *d = NULL;

    assert_int_equal(td_data_open(&d, s, &err), code);
    assert_null(d);
    assert_string_equal(err.msg, msg);
}

/* ---- data: sources --------------------------------------------------------------------- */

static void test_text_tokens_are_bytes(void **state)
{
    tmp t;
    const char *paths[2];
    td_data_info info;
    int in[2 * 3], tg[2 * 3];

    tmp_make(&t);
    write_text(at(&t, "one"), "abcdefg");
    write_text(at(&t, "two"), "\xffhijklm");
    paths[0] = at(&t, "one");
    paths[1] = at(&t, "two");
    td_data_spec s = spec_of(TD_DATA_FORMAT_TEXT, paths, 2, 2, 3);
    td_data *d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.train_tokens, 14);
    assert_int_equal(info.batches, (14 - 1) / 6);
    assert_int_equal(info.files, 2);
    /* batch 1 spans the two files: tokens 6..12 = "g" "\xff" "hijkl" */
    td_data_advance(d);
    assert_int_equal(td_data_fill(d, 0, 2, in, tg, NULL), 0);
    int want_in[6] = {'g', 0xff, 'h', 'i', 'j', 'k'};
    int want_tg[6] = {0xff, 'h', 'i', 'j', 'k', 'l'};
    assert_memory_equal(in, want_in, sizeof(in));
    assert_memory_equal(tg, want_tg, sizeof(tg));
    td_data_free(d);
    tmp_remove(&t);
}

/* A glob: sorted by name; a binary match (NUL byte), a symlink to a file already read and a
 * directory are skipped and counted; a binary file named outright is refused. */
static void test_text_glob_skips(void **state)
{
    tmp t;
    const char *paths[1];
    td_data_info info;
    int in[4], tg[4];
    char msg[600];

    tmp_make(&t);
    write_text(at(&t, "b"), "BBBB");
    write_text(at(&t, "a"), "AAAA");
    write_bytes(at(&t, "a.dat"), "\0\0\0\2xy", 6);
    assert_int_equal(symlink("a", at(&t, "a.u8")), 0);
    assert_int_equal(mkdir(at(&t, "sub"), 0755), 0);
    paths[0] = at(&t, "*");
    td_data_spec s = spec_of(TD_DATA_FORMAT_TEXT, paths, 1, 1, 4);
    td_data *d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.files, 2);
    assert_int_equal(info.train_tokens, 8);
    assert_int_equal(info.skipped_binary, 1);
    assert_int_equal(info.skipped_duplicate, 1);
    assert_int_equal(info.skipped_other, 1);
    assert_int_equal(td_data_next(d, in, tg, NULL), 0);
    int want_in[4] = {'A', 'A', 'A', 'A'}, want_tg[4] = {'A', 'A', 'A', 'B'};
    assert_memory_equal(in, want_in, sizeof(in));
    assert_memory_equal(tg, want_tg, sizeof(tg));
    td_data_free(d);

    paths[0] = at(&t, "a.dat");
    snprintf(msg, sizeof(msg), "%s: a NUL byte at offset 0: binary, not text", paths[0]);
    open_refused(&s, TD_EDATA, msg);
    paths[0] = at(&t, "*.dat");
    open_refused(&s, TD_EDATA,
                 "train: no file read (skipped: 1 binary, 0 duplicate, 0 not a regular file)");
    tmp_remove(&t);
}

/* Shards of a glob are concatenated in sorted order, tokens above 255 intact. */
static void test_shards_glob(void **state)
{
    tmp t;
    const char *paths[1];
    td_data_info info;
    int in[10], tg[10];

    tmp_make(&t);
    write_shard_seq(at(&t, "s_001.bin"), 1000, 7);
    write_shard_seq(at(&t, "s_000.bin"), 993, 7);
    write_shard_raw(at(&t, "s_002.bin"), TD_DATA_SHARD_MAGIC, 1, 0, NULL, 0); /* empty */
    write_shard_seq(at(&t, "s_003.bin"), 1007, 7);
    paths[0] = at(&t, "s_*.bin");
    td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, 2, 5);
    td_data *d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.files, 4);
    assert_int_equal(info.train_tokens, 21);
    assert_int_equal(info.batches, 2);
    td_data_advance(d);
    assert_int_equal(td_data_fill(d, 0, 2, in, tg, NULL), 0);
    for (int i = 0; i < 10; i++) {
        assert_int_equal(in[i], 993 + 10 + i); /* crosses the empty shard */
        assert_int_equal(tg[i], 993 + 11 + i);
    }
    td_data_free(d);
    tmp_remove(&t);
}

static void test_refusals(void **state)
{
    tmp t;
    const char *paths[1];
    char msg[700];
    uint16_t tok[1000] = {0};

    tmp_make(&t);
    td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, 1, 4);

    paths[0] = at(&t, "bad.bin");
    write_shard_raw(paths[0], 12345, 1, 10, tok, 10);
    snprintf(msg, sizeof(msg), "%s: bad magic 12345, expected 20240520 (llm.c token shard)",
             paths[0]);
    open_refused(&s, TD_EDATA, msg);

    write_shard_raw(paths[0], TD_DATA_SHARD_MAGIC, 2, 10, tok, 10);
    snprintf(msg, sizeof(msg), "%s: version 2, expected 1 (llm.c token shard)", paths[0]);
    open_refused(&s, TD_EDATA, msg);

    write_shard_raw(paths[0], TD_DATA_SHARD_MAGIC, 1, 1000, tok, 488);
    snprintf(msg, sizeof(msg),
             "%s: header says 1000 tokens (3024 bytes) but the file has 2000 bytes", paths[0]);
    open_refused(&s, TD_EDATA, msg);

    write_bytes(paths[0], "short", 5);
    snprintf(msg, sizeof(msg),
             "%s: 5 bytes, shorter than the 1024-byte header of an llm.c token shard", paths[0]);
    open_refused(&s, TD_EDATA, msg);

    paths[0] = at(&t, "*.nothing");
    snprintf(msg, sizeof(msg), "no files match %s", paths[0]);
    open_refused(&s, TD_EDATA, msg);

    s.format = TD_DATA_FORMAT_TEXT;
    paths[0] = at(&t, "a.txt");
    snprintf(msg, sizeof(msg), "%s: No such file or directory", paths[0]);
    open_refused(&s, TD_EDATA, msg);

    write_text(paths[0], "abcd");
    open_refused(&s, TD_EDATA, "train split: 4 tokens, a batch needs B*T+1 = 5");

    const char *vpaths[1] = {at(&t, "v.txt")};
    write_text(paths[0], "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN");
    write_text(vpaths[0], "abcdefghijklmnop");
    s.valid = vpaths;
    s.n_valid = 1;
    s.B = 4;
    open_refused(&s, TD_EDATA, "valid split: 16 tokens, a batch needs B*T+1 = 17");
    s.n_valid = 0;
    s.valid_fraction = 0.3; /* floor(40 * 0.3) = 12 tokens */
    open_refused(&s, TD_EDATA,
                 "valid split (valid_fraction of train): 12 tokens, a batch needs B*T+1 = 17");

    s.valid_fraction = 0.0;
    s.B = 0;
    open_refused(&s, TD_EINVAL, "batch of 0 rows of 4 tokens (B*T: 1 to 1073741824)");
    s.B = 1;
    s.valid_fraction = 1.0;
    open_refused(&s, TD_EINVAL, "valid_fraction 1 is not in [0, 1)");
    tmp_remove(&t);
}

/* A token at or above the vocabulary is a dataset error at fill, naming file and place. */
static void test_vocab_checked(void **state)
{
    tmp t;
    const char *paths[1];
    int in[4], tg[4];
    td_error_t err = {0};
    char msg[600];

    tmp_make(&t);
    paths[0] = at(&t, "v.bin");
    write_shard_seq(paths[0], 250, 13);
    td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, 1, 4);
    s.vocab = 256;
    td_data *d = open_ok(&s);
    assert_int_equal(td_data_next(d, in, tg, &err), 0);        /* tokens 250..254 */
    assert_int_equal(td_data_next(d, in, tg, &err), TD_EDATA); /* 254..258 holds 256 */
    snprintf(msg, sizeof(msg),
             "%s: token 256 at token 6 of the file is not below the vocabulary size 256", paths[0]);
    assert_string_equal(err.msg, msg);
    assert_int_equal(td_data_tell(d).batch, 1); /* an error does not move the cursor */
    td_data_free(d);
    tmp_remove(&t);
}

/* ---- data: batches ------------------------------------------------------------------- */

/* llm.c's loader, as train_gpt2.c has it: read B*T+1 at the position, advance by B*T, and go
 * back to 0 when the next read would run past the end. */
static int64_t llmc_position(int64_t N, int64_t B, int64_t T, int64_t k)
{
    int64_t pos = 0;

    for (int64_t i = 0; i <= k; i++) {
        if (pos + B * T + 1 > N)
            pos = 0;
        if (i == k)
            return pos;
        pos += B * T;
    }
    return -1;
}

/* Unshuffled batch k is tokens [k*B*T, +B*T+1), row b from k*B*T + b*T; the loader wraps
 * exactly as llm.c's does, for sizes that divide evenly and sizes that leave a remainder. */
static void test_unshuffled_is_llmc(void **state)
{
    static const int sizes[][3] = {{50, 3, 4}, {49, 3, 4}, {37, 3, 4}, {25, 2, 3}, {13, 1, 12}};
    tmp t;
    const char *paths[1];
    int in[64], tg[64];

    tmp_make(&t);
    paths[0] = at(&t, "seq.bin");
    for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
        int N = sizes[c][0], B = sizes[c][1], T = sizes[c][2];
        td_data_info info;
        write_shard_seq(paths[0], 0, N);
        td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, B, T);
        td_data *d = open_ok(&s);
        td_data_get_info(d, &info);
        assert_int_equal(info.batches, (N - 1) / (B * T));
        for (int k = 0; k < 12; k++) {
            int64_t pos = llmc_position(N, B, T, k);
            td_data_cursor c0 = td_data_tell(d);
            assert_int_equal(c0.epoch * info.batches + c0.batch, k);
            assert_int_equal(pos, (k % info.batches) * B * T);
            assert_int_equal(td_data_next(d, in, tg, NULL), 0);
            for (int i = 0; i < B * T; i++) {
                assert_int_equal(in[i], pos + i);
                assert_int_equal(tg[i], pos + i + 1);
            }
        }
        td_data_free(d);
    }
    tmp_remove(&t);
}

/* Captures n consecutive whole batches from d into out (n * B*T inputs then targets each). */
static void take_batches(td_data *d, int n, int BT, int *out)
{
    for (int i = 0; i < n; i++)
        assert_int_equal(td_data_next(d, out + 2 * i * BT, out + (2 * i + 1) * BT, NULL), 0);
}

/* Shuffled: rows are whole windows at multiples of T, none repeated within an epoch; the same
 * seed gives the same batches, another seed or the next epoch another order. */
static void test_shuffle(void **state)
{
    enum { N = 411, B = 4, T = 5, BT = B * T, EPOCH = (N - 1) / BT, ROWS = (N - 1) / T };
    tmp t;
    const char *paths[1];
    static int a[3 * EPOCH * 2 * BT], b[3 * EPOCH * 2 * BT];
    int seen[ROWS];

    tmp_make(&t);
    paths[0] = at(&t, "seq.bin");
    write_shard_seq(paths[0], 0, N);
    td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, B, T);
    s.shuffle = 1;
    s.seed = 7;
    td_data *d = open_ok(&s);
    take_batches(d, 3 * EPOCH, BT, a);
    assert_int_equal(td_data_tell(d).epoch, 3);
    td_data_free(d);
    d = open_ok(&s);
    take_batches(d, 3 * EPOCH, BT, b);
    td_data_free(d);
    assert_memory_equal(a, b, sizeof(a)); /* same seed: same batches */

    for (int e = 0; e < 3; e++) {
        memset(seen, 0, sizeof(seen));
        for (int k = 0; k < EPOCH; k++) {
            const int *in = a + 2 * (e * EPOCH + k) * BT, *tg = in + BT;
            for (int r = 0; r < B; r++) {
                int start = in[r * T];
                assert_int_equal(start % T, 0);
                assert_int_equal(seen[start / T]++, 0);
                for (int i = 0; i < T; i++) {
                    assert_int_equal(in[r * T + i], start + i);
                    assert_int_equal(tg[r * T + i], start + i + 1);
                }
            }
        }
    }
    assert_memory_not_equal(a, a + EPOCH * 2 * BT, EPOCH * 2 * BT * sizeof(int));
    assert_memory_not_equal(a + EPOCH * 2 * BT, a + 2 * EPOCH * 2 * BT,
                            EPOCH * 2 * BT * sizeof(int));
    s.seed = 8;
    d = open_ok(&s);
    take_batches(d, EPOCH, BT, b);
    td_data_free(d);
    assert_memory_not_equal(a, b, EPOCH * 2 * BT * sizeof(int));
    tmp_remove(&t);
}

/* A cursor saved mid-run and restored in a fresh td_data gives the same following batches,
 * across an epoch boundary, shuffled or not. */
static void test_cursor_resume(void **state)
{
    enum { N = 301, B = 3, T = 4, BT = B * T, EPOCH = (N - 1) / BT };
    tmp t;
    const char *paths[1];
    static int a[40 * 2 * BT], b[40 * 2 * BT];
    td_error_t err = {0};

    tmp_make(&t);
    paths[0] = at(&t, "seq.bin");
    write_shard_seq(paths[0], 0, N);
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, B, T);
        s.shuffle = shuffle;
        td_data *d = open_ok(&s);
        for (int i = 0; i < EPOCH + 17; i++)
            td_data_advance(d);
        td_data_cursor c = td_data_tell(d);
        assert_int_equal(c.epoch, 1);
        assert_int_equal(c.batch, 17);
        take_batches(d, 40, BT, a); /* crosses into epoch 2 */
        td_data_free(d);

        d = open_ok(&s);
        assert_int_equal(td_data_seek(d, c, &err), 0);
        take_batches(d, 40, BT, b);
        assert_memory_equal(a, b, sizeof(a));
        c.batch = EPOCH;
        assert_int_equal(td_data_seek(d, c, &err), TD_EINVAL);
        td_data_free(d);
    }
    tmp_remove(&t);
}

/* valid_fraction: valid is the last floor(N*f) tokens, train the rest; valid batches are the
 * unshuffled windows of valid. valid from its own files works the same. */
static void test_valid_split(void **state)
{
    tmp t;
    const char *paths[1], *vpaths[1];
    td_data_info info;
    int in[8], tg[8];
    td_error_t err = {0};

    tmp_make(&t);
    paths[0] = at(&t, "train.bin");
    vpaths[0] = at(&t, "valid.bin");
    write_shard_seq(paths[0], 0, 1000);
    write_shard_seq(vpaths[0], 5000, 30);
    td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, 2, 4);
    s.valid_fraction = 0.1;
    td_data *d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.train_tokens, 900);
    assert_int_equal(info.valid_tokens, 100);
    assert_int_equal(info.batches, 899 / 8);
    assert_int_equal(info.valid_batches, 99 / 8);
    assert_int_equal(td_data_valid_fill(d, 0, 0, 2, in, tg, &err), 0);
    assert_int_equal(in[0], 900);
    assert_int_equal(tg[7], 908);
    assert_int_equal(td_data_valid_fill(d, 11, 1, 2, in, tg, &err), 0);
    assert_int_equal(in[0], 900 + 11 * 8 + 4);
    assert_int_equal(tg[3], 996); /* window 11 is the last whole one: 12*8+1 <= 100 */
    assert_int_equal(td_data_valid_fill(d, 12, 0, 2, in, tg, &err), TD_EINVAL);
    for (int k = 0; k < info.batches; k++)
        td_data_advance(d);
    assert_int_equal(td_data_tell(d).epoch, 1); /* train never reads past token 899 */
    td_data_free(d);

    s.valid_fraction = 0.0;
    d = open_ok(&s);
    assert_int_equal(td_data_valid_fill(d, 0, 0, 2, in, tg, &err), TD_EINVAL);
    assert_string_equal(err.msg, "no valid split");
    td_data_free(d);

    s.valid = vpaths;
    s.n_valid = 1;
    d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.train_tokens, 1000);
    assert_int_equal(info.valid_tokens, 30);
    assert_int_equal(info.valid_batches, 29 / 8);
    assert_int_equal(td_data_valid_fill(d, 2, 0, 2, in, tg, &err), 0);
    assert_int_equal(in[0], 5016);
    assert_int_equal(tg[7], 5024);
    td_data_free(d);
    tmp_remove(&t);
}

/* Replicas filling rows [r0, r1) of the global batch together get the whole batch. */
static void test_replica_rows(void **state)
{
    enum { B = 5, T = 3 };
    tmp t;
    const char *paths[1];
    int whole_in[B * T], whole_tg[B * T], in[B * T], tg[B * T];
    td_error_t err = {0};

    tmp_make(&t);
    paths[0] = at(&t, "seq.bin");
    write_shard_seq(paths[0], 0, 200);
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        td_data_spec s = spec_of(TD_DATA_FORMAT_SHARDS, paths, 1, B, T);
        s.shuffle = shuffle;
        td_data *d = open_ok(&s);
        for (int k = 0; k < 20; k++) {
            assert_int_equal(td_data_fill(d, 0, B, whole_in, whole_tg, &err), 0);
            assert_int_equal(td_data_fill(d, 0, 2, in, tg, &err), 0);
            assert_int_equal(td_data_fill(d, 2, 3, in + 2 * T, tg + 2 * T, &err), 0);
            assert_int_equal(td_data_fill(d, 3, B, in + 3 * T, tg + 3 * T, &err), 0);
            assert_memory_equal(in, whole_in, sizeof(in));
            assert_memory_equal(tg, whole_tg, sizeof(tg));
            td_data_advance(d);
        }
        assert_int_equal(td_data_fill(d, 3, 3, in, tg, &err), TD_EINVAL);
        assert_int_equal(td_data_fill(d, 0, B + 1, in, tg, &err), TD_EINVAL);
        td_data_free(d);
    }
    tmp_remove(&t);
}

/* ---- checkpoints -------------------------------------------------------------------------- */

enum { NP = 1000 };

typedef struct state3 {
    float p[NP], m[NP], v[NP];
    td_ckpt_section sec[3];
} state3;

static void state_init(state3 *s, float base)
{
    for (int i = 0; i < NP; i++) {
        s->p[i] = base + (float)i;
        s->m[i] = base - (float)i;
        s->v[i] = base * 0.5f + (float)i;
    }
    s->sec[0] = (td_ckpt_section){"params", s->p, NP};
    s->sec[1] = (td_ckpt_section){"m", s->m, NP};
    s->sec[2] = (td_ckpt_section){"v", s->v, NP};
}

static void write_step(const char *dir, int64_t step, int keep)
{
    state3 s;
    td_ckpt_meta meta = {.step = step, .config_hash = 0x1234};
    td_error_t err = {0};
    int rc;

    state_init(&s, (float)step);
    meta.rng[0] = (uint64_t)step * 3;
    meta.cursor[0] = step;
    rc = td_ckpt_write(dir, keep, &meta, s.sec, 3, NULL, 0, &err);
    if (rc != 0)
        fail_msg("td_ckpt_write: %s", err.msg);
}

static int exists(const char *path)
{
    struct stat st;

    return stat(path, &st) == 0;
}

static void test_fnv1a(void **state)
{
    assert_true(td_ckpt_hash(TD_CKPT_HASH_INIT, "", 0) == 0xcbf29ce484222325ull);
    assert_true(td_ckpt_hash(TD_CKPT_HASH_INIT, "a", 1) == 0xaf63dc4c8601ec8cull);
    assert_true(td_ckpt_hash(TD_CKPT_HASH_INIT, "foobar", 6) == 0x85944171f73967e8ull);
    /* fed in pieces, the same */
    assert_true(td_ckpt_hash(td_ckpt_hash(TD_CKPT_HASH_INIT, "foo", 3), "bar", 3) ==
                0x85944171f73967e8ull);
}

static void test_ckpt_round_trip(void **state)
{
    tmp t;
    state3 w, r;
    td_ckpt_meta meta = {.step = 500, .config_hash = 0xfeedfacecafebeefull}, got;
    td_ckpt_found found;
    td_ckpt_section_info info[TD_CKPT_MAX_SECTIONS];
    td_error_t err = {0};
    char path[TD_CKPT_PATH_MAX];
    int n = 0;

    tmp_make(&t);
    state_init(&w, 3.25f);
    state_init(&r, 0.0f);
    for (int i = 0; i < TD_CKPT_RNG_WORDS; i++)
        meta.rng[i] = 0x0101010101010101ull * (uint64_t)(i + 1);
    meta.cursor[0] = 7;
    meta.cursor[1] = 123;
    const char *dir = at(&t, "state/job-1"); /* created, parents too */
    assert_int_equal(td_ckpt_write(dir, 3, &meta, w.sec, 3, path, sizeof(path), &err), 0);
    assert_string_equal(path, at(&t, "state/job-1/ckpt-500.bin"));
    memset(r.p, 0, sizeof(r.p));
    assert_int_equal(td_ckpt_load_latest(dir, &got, r.sec, 3, &found, &err), 0);
    assert_string_equal(found.path, path);
    assert_int_equal(found.skipped, 0);
    assert_memory_equal(&got, &meta, sizeof(meta));
    assert_memory_equal(r.p, w.p, sizeof(w.p));
    assert_memory_equal(r.m, w.m, sizeof(w.m));
    assert_memory_equal(r.v, w.v, sizeof(w.v));

    assert_int_equal(td_ckpt_peek(path, &got, info, &n, &err), 0);
    assert_int_equal(n, 3);
    assert_string_equal(info[1].name, "m");
    assert_int_equal(info[2].count, NP);
    assert_int_equal(got.step, 500);

    /* a section read with data NULL is checked, not stored */
    r.sec[1].data = NULL;
    assert_int_equal(td_ckpt_read(path, &got, r.sec, 3, &err), 0);

    /* the config hash comes back for the caller to compare */
    assert_true(got.config_hash != td_ckpt_hash(TD_CKPT_HASH_INIT, "other config", 12));
    tmp_remove(&t);
}

static void test_ckpt_keep(void **state)
{
    tmp t;
    char name[64];

    tmp_make(&t);
    for (int s = 1; s <= 5; s++)
        write_step(t.dir, s * 100, 3);
    for (int s = 1; s <= 5; s++) {
        snprintf(name, sizeof(name), "ckpt-%d.bin", s * 100);
        assert_int_equal(exists(at(&t, name)), s >= 3);
    }
    assert_false(exists(at(&t, ".ckpt-500.bin.tmp")));
    /* a job resumed from step 300 that writes step 350 drops the abandoned 400 and 500 */
    write_step(t.dir, 350, 2);
    assert_true(exists(at(&t, "ckpt-350.bin")));
    assert_true(exists(at(&t, "ckpt-300.bin")));
    assert_false(exists(at(&t, "ckpt-400.bin")));
    assert_false(exists(at(&t, "ckpt-500.bin")));
    tmp_remove(&t);
}

static void flip_byte(const char *path, long off)
{
    FILE *f = fopen(path, "r+b");
    int c;

    assert_non_null(f);
    assert_int_equal(fseek(f, off, SEEK_SET), 0);
    c = fgetc(f);
    assert_int_equal(fseek(f, off, SEEK_SET), 0);
    fputc(c ^ 0x10, f);
    assert_int_equal(fclose(f), 0);
}

/* A torn newest file is skipped for the previous; then a corrupt body, then a corrupt header;
 * with none left intact the load fails saying so. */
static void test_ckpt_skips_corrupt(void **state)
{
    tmp t;
    state3 r;
    td_ckpt_meta got;
    td_ckpt_found found;
    td_error_t err = {0};
    char msg[700];

    tmp_make(&t);
    state_init(&r, 0.0f);
    for (int s = 1; s <= 4; s++)
        write_step(t.dir, s, 5);
    assert_int_equal(truncate(at(&t, "ckpt-4.bin"), 3000), 0);
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, &found, &err), 0);
    assert_int_equal(got.step, 3);
    assert_int_equal(got.rng[0], 9);
    assert_int_equal(found.skipped, 1);
    snprintf(msg, sizeof(msg), "%s: truncated: 3000 bytes, the header says %d",
             at(&t, "ckpt-4.bin"), 1024 + 3 * NP * 4 + 8);
    assert_string_equal(found.skip_msg, msg);
    assert_true(r.p[10] == 3.0f + 10.0f);

    flip_byte(at(&t, "ckpt-3.bin"), 1024 + 4 * 1500); /* a float of m */
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, &found, &err), 0);
    assert_int_equal(got.step, 2);
    assert_int_equal(found.skipped, 2);
    assert_int_equal(td_ckpt_read(at(&t, "ckpt-3.bin"), &got, r.sec, 3, &err), TD_EDATA);
    assert_non_null(strstr(err.msg, "checksum mismatch"));

    flip_byte(at(&t, "ckpt-2.bin"), 20); /* the step, in the header */
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, &found, &err), 0);
    assert_int_equal(got.step, 1);
    assert_int_equal(found.skipped, 3);
    assert_int_equal(td_ckpt_read(at(&t, "ckpt-2.bin"), &got, r.sec, 3, &err), TD_EDATA);
    assert_non_null(strstr(err.msg, "header checksum mismatch"));

    write_bytes(at(&t, "ckpt-1.bin"), "not a checkpoint", 16);
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, &found, &err), TD_EDATA);
    assert_non_null(strstr(err.msg, "no intact checkpoint (4 skipped; the newest: "));

    assert_int_equal(td_ckpt_load_latest(at(&t, "none"), &got, r.sec, 3, &found, &err),
                     TD_ENOTFOUND);
    assert_int_equal(mkdir(at(&t, "empty"), 0755), 0);
    assert_int_equal(td_ckpt_load_latest(at(&t, "empty"), &got, r.sec, 3, &found, &err),
                     TD_ENOTFOUND);
    tmp_remove(&t);
}

/* Sections that differ from the expected ones are TD_ESHAPE naming the file and the section,
 * and not skipped over for an older file. */
static void test_ckpt_size_mismatch(void **state)
{
    tmp t;
    state3 r;
    td_ckpt_meta got;
    td_error_t err = {0};
    char msg[700];

    tmp_make(&t);
    write_step(t.dir, 1, 5);
    write_step(t.dir, 2, 5);
    state_init(&r, 0.0f);
    r.sec[1].count = NP - 1;
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, NULL, &err), TD_ESHAPE);
    snprintf(msg, sizeof(msg), "%s: section 1 is 'm' of %d floats, expected 'm' of %d floats",
             at(&t, "ckpt-2.bin"), NP, NP - 1);
    assert_string_equal(err.msg, msg);
    r.sec[1].count = NP;
    r.sec[2].name = "w";
    assert_int_equal(td_ckpt_read(at(&t, "ckpt-1.bin"), &got, r.sec, 3, &err), TD_ESHAPE);
    assert_int_equal(td_ckpt_read(at(&t, "ckpt-1.bin"), &got, r.sec, 2, &err), TD_ESHAPE);
    snprintf(msg, sizeof(msg), "%s: 3 sections, expected 2", at(&t, "ckpt-1.bin"));
    assert_string_equal(err.msg, msg);
    tmp_remove(&t);
}

/* A write that meets a full disk (here the file size limit: EFBIG, SIGXFSZ ignored) fails with
 * TD_EDISKFULL naming the temp file, leaves no temp file and the older checkpoints intact. */
static void test_ckpt_disk_full(void **state)
{
    tmp t;
    state3 r;
    td_ckpt_meta got;
    td_error_t err = {0};
    struct rlimit old, lim;
    void (*old_handler)(int);
    int rc;

    tmp_make(&t);
    write_step(t.dir, 1, 3);
    write_step(t.dir, 2, 3);
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 5000; /* bytes: a checkpoint here is 13032 */
    old_handler = signal(SIGXFSZ, SIG_IGN);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    state_init(&r, 3.0f);
    td_ckpt_meta meta = {.step = 3};
    rc = td_ckpt_write(t.dir, 3, &meta, r.sec, 3, NULL, 0, &err);
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &old), 0);
    signal(SIGXFSZ, old_handler);
    assert_int_equal(rc, TD_EDISKFULL);
    assert_non_null(strstr(err.msg, at(&t, ".ckpt-3.bin.tmp")));
    assert_false(exists(at(&t, ".ckpt-3.bin.tmp")));
    assert_false(exists(at(&t, "ckpt-3.bin")));
    assert_int_equal(td_ckpt_load_latest(t.dir, &got, r.sec, 3, NULL, &err), 0);
    assert_int_equal(got.step, 2);
    tmp_remove(&t);
}

/* ---- how a job's files are opened ---------------------------------------------------------- */

#define NOBODY 65534 /* uid and gid the access tests read as */

/* An IDX file: magic, ndim big-endian dims, then n bytes of body, gzipped when gz is set. */
static void write_idx(const char *path, int gz, uint32_t magic, const uint32_t *dims, int ndim,
                      const void *body, size_t n)
{
    unsigned char h[16];

    for (int i = 0; i <= ndim; i++) {
        uint32_t v = i == 0 ? magic : dims[i - 1];
        h[4 * i] = (unsigned char)(v >> 24);
        h[4 * i + 1] = (unsigned char)(v >> 16);
        h[4 * i + 2] = (unsigned char)(v >> 8);
        h[4 * i + 3] = (unsigned char)v;
    }
    if (gz) {
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, h, (unsigned)(4 * (ndim + 1))), 4 * (ndim + 1));
        if (n > 0)
            assert_int_equal(gzwrite(f, body, (unsigned)n), (int)n);
        assert_int_equal(gzclose(f), Z_OK);
        return;
    }
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(h, 4, (size_t)(ndim + 1), f), (size_t)(ndim + 1));
    if (n > 0)
        assert_int_equal(fwrite(body, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* td_idx_load of images and labels: the code, the message in err. */
static int idx_load(const char *images, const char *labels, td_error_t *err)
{
    td_idx_split split;
    td_idx d;
    int rc;

    snprintf(split.images, sizeof(split.images), "%s", images);
    snprintf(split.labels, sizeof(split.labels), "%s", labels);
    rc = td_idx_load(&d, &split, err);
    if (rc == 0)
        td_idx_free(&d);
    return rc;
}

static void expect_msg(const td_error_t *err, const char *needle)
{
    if (strstr(err->msg, needle) == NULL)
        fail_msg("message \"%s\" lacks \"%s\"", err->msg, needle);
}

/* A FIFO or a device as a dataset is refused at once, never waited on: an open or a read of a
 * FIFO without a writer blocks for good, and a job whose worker blocks cannot be cancelled
 * nor the daemon stopped. A glob's FIFO is skipped like a directory. If an open does block,
 * the alarm ends the test (and fails it). */
static void test_fifo_and_device_refused(void **state)
{
    tmp t;
    const char *paths[1];
    char msg[700];
    td_data_info info;
    td_gpt_dims dims;
    td_error_t err = {0};
    td_data *d;
    uint32_t ldims[1] = {3};

    tmp_make(&t);
    assert_int_equal(mkfifo(at(&t, "fifo"), 0644), 0);
    write_text(at(&t, "text"), "abcdefghijklmnopqrstuvwxyz");
    write_idx(at(&t, "labels"), 0, TD_IDX_MAGIC_LABELS, ldims, 1, "\1\2\3", 3);
    alarm(30);
    paths[0] = at(&t, "fifo");
    td_data_spec s = spec_of(TD_DATA_FORMAT_TEXT, paths, 1, 1, 4);
    snprintf(msg, sizeof(msg), "%s: not a regular file (a FIFO)", paths[0]);
    open_refused(&s, TD_EDATA, msg);
    paths[0] = "/dev/zero";
    open_refused(&s, TD_EDATA, "/dev/zero: not a regular file (a character device)");
    s.format = TD_DATA_FORMAT_SHARDS;
    paths[0] = at(&t, "fifo");
    open_refused(&s, TD_EDATA, msg);
    s.format = TD_DATA_FORMAT_TEXT;
    paths[0] = at(&t, "*");
    d = open_ok(&s);
    td_data_get_info(d, &info);
    assert_int_equal(info.files, 1);
    assert_int_equal(info.skipped_other, 1);
    td_data_free(d);

    assert_int_equal(idx_load(at(&t, "fifo"), at(&t, "labels"), &err), TD_EDATA);
    expect_msg(&err, "not a regular file (a FIFO)");
    assert_int_equal(td_weights_gpt_peek(at(&t, "fifo"), 0, &dims, &err), TD_EDATA);
    expect_msg(&err, "not a regular file (a FIFO)");
    assert_int_equal(td_data_peek_shard("/dev/null", &(int64_t){0}, &err), TD_EDATA);
    expect_msg(&err, "/dev/null: not a regular file (a character device)");
    alarm(0);
    tmp_remove(&t);
}

/* The one opener's flags: a missing file is a job's data error (TD_EDATA) or a model file's
 * TD_ENOTFOUND (TD_OPEN_MODEL), both "PATH: No such file or directory"; a FIFO is refused
 * unless the caller asks for any kind (TD_OPEN_ANY: open, st says what it is); a regular file
 * opens either way. The callers' messages rest on these (test_fifo_and_device_refused). */
static void test_open_path_flags(void **state)
{
    tmp t;
    char msg[600];
    struct stat st;
    td_error_t err = {0};
    int fd = 0;

    (void)state;
    tmp_make(&t);
    assert_int_equal(mkfifo(at(&t, "fifo"), 0644), 0);
    write_text(at(&t, "text"), "abc");
    alarm(30);
    snprintf(msg, sizeof(msg), "%s: No such file or directory", at(&t, "none"));
    assert_int_equal(td_data_open_path(at(&t, "none"), 0, &fd, &st, &err), TD_EDATA);
    assert_int_equal(fd, -1);
    assert_string_equal(err.msg, msg);
    assert_int_equal(td_data_open_path(at(&t, "none"), TD_OPEN_MODEL, &fd, &st, &err),
                     TD_ENOTFOUND);
    assert_string_equal(err.msg, msg);
    assert_int_equal(td_data_open_path(at(&t, "fifo"), TD_OPEN_MODEL, &fd, &st, &err), TD_EDATA);
    assert_int_equal(fd, -1);
    expect_msg(&err, "not a regular file (a FIFO)");
    assert_int_equal(td_data_open_path(at(&t, "fifo"), TD_OPEN_ANY, &fd, &st, &err), 0);
    assert_true(fd >= 0 && S_ISFIFO(st.st_mode));
    close(fd);
    assert_int_equal(td_data_open_path(at(&t, "text"), TD_OPEN_MODEL, &fd, &st, &err), 0);
    assert_true(fd >= 0 && S_ISREG(st.st_mode) && st.st_size == 3);
    close(fd);
    alarm(0);
    tmp_remove(&t);
}

/* Another thread's open while this one has an access set: its own rights. */
static void *open_elsewhere(void *arg)
{
    td_error_t err = {0};
    int fd = -1;
    intptr_t rc = td_data_open_file(arg, &fd, &err);

    if (fd >= 0)
        close(fd);
    return (void *)rc;
}

/* With an access set, every open is the user's: a symlink swapped in for a root-only file, a
 * file in a directory the user cannot search, and a glob into that directory fail as they
 * would for the user; a public file opens. The thread is root again after each open, and
 * other threads are never affected. Needs root (to be another user). */
static void test_opens_as_the_user(void **state)
{
    td_data_access as_nobody = {.uid = NOBODY, .gid = NOBODY};
    td_error_t err = {0};
    const char *paths[1];
    char msg[700], inner[600], link[600];
    td_gpt_dims dims;
    pthread_t th;
    void *other;
    tmp t;

    if (geteuid() != 0) {
        print_message("needs root, to read as another user: skipped\n");
        skip();
    }
    tmp_make(&t);
    assert_int_equal(chmod(t.dir, 0755), 0);
    write_text(at(&t, "secret"), "the root-only secret, which nobody may read");
    assert_int_equal(chmod(at(&t, "secret"), 0600), 0);
    write_text(at(&t, "public"), "text anyone may read, long enough for a batch");
    assert_int_equal(chmod(at(&t, "public"), 0644), 0);
    snprintf(link, sizeof(link), "%s", at(&t, "swapped"));
    assert_int_equal(symlink(at(&t, "secret"), link), 0);
    assert_int_equal(mkdir(at(&t, "private"), 0700), 0);
    snprintf(inner, sizeof(inner), "%s/inner", at(&t, "private"));
    write_text(inner, "public text in a private directory");
    assert_int_equal(chmod(inner, 0644), 0);

    paths[0] = link;
    td_data_spec s = spec_of(TD_DATA_FORMAT_TEXT, paths, 1, 1, 4);
    td_data_free(open_ok(&s)); /* the process's own rights: root reads it */

    assert_int_equal(td_data_access_begin(&as_nobody, &err), 0);
    snprintf(msg, sizeof(msg), "%s: Permission denied", link);
    open_refused(&s, TD_EPERM, msg);
    assert_int_equal(setfsuid((uid_t)-1), 0); /* root again after the open */
    assert_int_equal(setfsgid((gid_t)-1), 0);
    paths[0] = at(&t, "public");
    td_data_free(open_ok(&s));
    paths[0] = inner;
    snprintf(msg, sizeof(msg), "%s: Permission denied", inner);
    open_refused(&s, TD_EPERM, msg);
    snprintf(inner, sizeof(inner), "%s/*", at(&t, "private"));
    paths[0] = inner;
    snprintf(msg, sizeof(msg), "no files match %s", inner);
    open_refused(&s, TD_EDATA, msg);
    assert_int_equal(idx_load(link, link, &err), TD_EPERM);
    expect_msg(&err, "cannot open: Permission denied");
    assert_int_equal(td_weights_gpt_peek(link, 0, &dims, &err), TD_EPERM);
    expect_msg(&err, "Permission denied");
    /* The access is this thread's alone. */
    assert_int_equal(pthread_create(&th, NULL, open_elsewhere, link), 0);
    assert_int_equal(pthread_join(th, &other), 0);
    assert_int_equal((intptr_t)other, 0);
    td_data_access_end();

    paths[0] = link;
    td_data_free(open_ok(&s)); /* ended: root's rights again */
    tmp_remove(&t);
}

static int stop_after(void *ud)
{
    int *polls = ud;

    return (*polls)-- <= 0;
}

/* A load polls the stop callback between files and chunks: a cancel ends a long read with
 * TD_ECANCELLED, and nothing is kept. */
static void test_load_stops_when_asked(void **state)
{
    int polls = 0;
    td_data_access stoppable = {.uid = -1, .stop = stop_after, .ud = &polls};
    td_error_t err = {0};
    const char *paths[1];
    char msg[700], *big;
    uint32_t idims[3] = {4, 2, 2};
    tmp t;

    tmp_make(&t);
    big = malloc(3u << 20);
    assert_non_null(big);
    memset(big, 'x', 3u << 20);
    write_bytes(at(&t, "big"), big, 3u << 20);
    free(big);
    write_idx(at(&t, "images"), 1, TD_IDX_MAGIC_IMAGES, idims, 3, "0123456789abcdef", 16);
    paths[0] = at(&t, "big");
    td_data_spec s = spec_of(TD_DATA_FORMAT_TEXT, paths, 1, 1, 4);

    assert_int_equal(td_data_access_begin(&stoppable, &err), 0);
    snprintf(msg, sizeof(msg), "%s: reading stopped: the job was cancelled or traind is stopping",
             paths[0]);
    open_refused(&s, TD_ECANCELLED, msg); /* before the file */
    polls = 2;
    open_refused(&s, TD_ECANCELLED, msg); /* within it, after its first chunks */
    polls = 0;
    assert_int_equal(idx_load(at(&t, "images"), at(&t, "images"), &err), TD_ECANCELLED);
    polls = 1000;
    td_data_free(open_ok(&s));
    td_data_access_end();
    tmp_remove(&t);
}

/* The IDX reader holds a file to its header: a gzip stream (or a plain file) with more data
 * than the header declares is refused, less is truncated, exactly that loads. */
static void test_idx_held_to_header(void **state)
{
    uint32_t idims[3] = {10, 2, 2}, ldims[1] = {10};
    uint8_t body[80] = {0};
    td_error_t err = {0};
    tmp t;

    tmp_make(&t);
    write_idx(at(&t, "labels"), 1, TD_IDX_MAGIC_LABELS, ldims, 1, body, 10);
    for (int gz = 0; gz < 2; gz++) {
        write_idx(at(&t, "images"), gz, TD_IDX_MAGIC_IMAGES, idims, 3, body, 80);
        assert_int_equal(idx_load(at(&t, "images"), at(&t, "labels"), &err), TD_EDATA);
        expect_msg(&err, "more data than its header declares: 40 bytes of pixels, then more");
        write_idx(at(&t, "images"), gz, TD_IDX_MAGIC_IMAGES, idims, 3, body, 39);
        assert_int_equal(idx_load(at(&t, "images"), at(&t, "labels"), &err), TD_EDATA);
        expect_msg(&err, "truncated: expected 40 bytes of pixels, got 39");
        write_idx(at(&t, "images"), gz, TD_IDX_MAGIC_IMAGES, idims, 3, body, 40);
        assert_int_equal(idx_load(at(&t, "images"), at(&t, "labels"), &err), 0);
    }
    write_idx(at(&t, "labels"), 1, TD_IDX_MAGIC_LABELS, ldims, 1, body, 11);
    assert_int_equal(idx_load(at(&t, "images"), at(&t, "labels"), &err), TD_EDATA);
    expect_msg(&err, "more data than its header declares: 10 bytes of labels, then more");
    tmp_remove(&t);
}

/* A header that claims gigabytes of pixels for a file that holds four bytes costs what the file
 * holds, not what the header claims, before the file is found truncated (found by fuzz_idx:
 * td_idx_load allocated the claim first, 13 GB for an 88-byte file). The address space is held
 * to 1 GiB more than the test has, so an allocation of the 4 GiB claimed fails the load with
 * TD_ENOMEM. Not under a sanitizer, whose allocator maps its own memory. */
static void test_idx_claim_costs_nothing(void **state)
{
    uint32_t claim[3] = {1u << 20, 64, 64}; /* 4 GiB of pixels */
    struct rlimit old, lim;
    unsigned long pages = 0;
    td_error_t err = {0};
    FILE *statm;
    tmp t;
    int rc;

    tmp_make(&t);
    write_idx(at(&t, "labels"), 0, TD_IDX_MAGIC_LABELS, claim, 1, NULL, 0);
    for (int gz = 0; gz < 2; gz++) {
        write_idx(at(&t, "images"), gz, TD_IDX_MAGIC_IMAGES, claim, 3, "abcd", 4);
        assert_int_equal(getrlimit(RLIMIT_AS, &old), 0);
        lim = old;
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
        statm = fopen("/proc/self/statm", "r");
        assert_non_null(statm);
        assert_int_equal(fscanf(statm, "%lu", &pages), 1);
        fclose(statm);
        lim.rlim_cur = pages * (unsigned long)sysconf(_SC_PAGESIZE) + (1ul << 30);
#else
        (void)statm;
        (void)pages;
#endif
        assert_int_equal(setrlimit(RLIMIT_AS, &lim), 0);
        rc = idx_load(at(&t, "images"), at(&t, "labels"), &err);
        assert_int_equal(setrlimit(RLIMIT_AS, &old), 0);
        assert_int_equal(rc, TD_EDATA);
        expect_msg(&err, "truncated: expected 4294967296 bytes of pixels, got 4");
    }
    tmp_remove(&t);
}

/* td_idx_peek reads a header without the data: counts, sizes, the other kind named, a plain
 * file's size against its header, every label when asked, and a header that claims gigabytes
 * from a small gzip file is counted as it claims (what the memory guard needs) or refused past
 * the limit. */
static void test_idx_peek(void **state)
{
    uint32_t idims[3] = {3, 2, 2}, ldims[1] = {3}, bomb[3] = {1u << 20, 64, 64};
    uint32_t huge[3] = {1u << 28, 16, 16};
    td_idx_header h;
    td_error_t err = {0};
    char msg[700];
    tmp t;

    tmp_make(&t);
    write_idx(at(&t, "images.gz"), 1, TD_IDX_MAGIC_IMAGES, idims, 3, "0123456789ab", 12);
    write_idx(at(&t, "labels"), 0, TD_IDX_MAGIC_LABELS, ldims, 1, "\0\7\3", 3);
    assert_int_equal(td_idx_peek(at(&t, "images.gz"), TD_IDX_MAGIC_IMAGES, 0, &h, &err), 0);
    assert_int_equal(h.n, 3);
    assert_int_equal(h.rows, 2);
    assert_int_equal(h.cols, 2);
    assert_int_equal(h.bytes, 12);
    assert_int_equal(h.max_label, -1);
    assert_int_equal(td_idx_peek(at(&t, "labels"), TD_IDX_MAGIC_LABELS, 1, &h, &err), 0);
    assert_int_equal(h.n, 3);
    assert_int_equal(h.bytes, 3);
    assert_int_equal(h.max_label, 7);

    assert_int_equal(td_idx_peek(at(&t, "labels"), TD_IDX_MAGIC_IMAGES, 0, &h, &err), TD_EDATA);
    snprintf(msg, sizeof(msg),
             "%s: magic 0x00000801 is an IDX labels file, expected images (0x00000803)",
             at(&t, "labels"));
    assert_string_equal(err.msg, msg);

    write_idx(at(&t, "short"), 0, TD_IDX_MAGIC_IMAGES, idims, 3, "01234", 5);
    assert_int_equal(td_idx_peek(at(&t, "short"), TD_IDX_MAGIC_IMAGES, 0, &h, &err), TD_EDATA);
    snprintf(msg, sizeof(msg),
             "%s: truncated: 21 bytes, but its header declares 12 bytes of pixels after its "
             "16-byte header",
             at(&t, "short"));
    assert_string_equal(err.msg, msg);

    write_idx(at(&t, "bomb.gz"), 1, TD_IDX_MAGIC_IMAGES, bomb, 3, "x", 1);
    assert_int_equal(td_idx_peek(at(&t, "bomb.gz"), TD_IDX_MAGIC_IMAGES, 0, &h, &err), 0);
    assert_int_equal(h.bytes, 4ull << 30);
    write_idx(at(&t, "huge.gz"), 1, TD_IDX_MAGIC_IMAGES, huge, 3, "x", 1);
    assert_int_equal(td_idx_peek(at(&t, "huge.gz"), TD_IDX_MAGIC_IMAGES, 0, &h, &err), TD_EDATA);
    expect_msg(&err, "68719476736 bytes of pixels (at most 17179869184 allowed)");

    write_idx(at(&t, "long.gz"), 1, TD_IDX_MAGIC_LABELS, ldims, 1, "\1\2\3\4", 4);
    assert_int_equal(td_idx_peek(at(&t, "long.gz"), TD_IDX_MAGIC_LABELS, 1, &h, &err), TD_EDATA);
    expect_msg(&err, "more data than its header declares: 3 bytes of labels, then more");
    write_idx(at(&t, "cut.gz"), 1, TD_IDX_MAGIC_LABELS, ldims, 1, "\1\2", 2);
    assert_int_equal(td_idx_peek(at(&t, "cut.gz"), TD_IDX_MAGIC_LABELS, 1, &h, &err), TD_EDATA);
    expect_msg(&err, "truncated: expected 3 labels, got 2");
    tmp_remove(&t);
}

/* A shard's header read alone, with the loader's checks and messages. */
static void test_shard_peek(void **state)
{
    uint16_t tok[10] = {0};
    td_error_t err = {0};
    int64_t count = -1;
    char msg[700];
    tmp t;

    tmp_make(&t);
    write_shard_raw(at(&t, "good.bin"), TD_DATA_SHARD_MAGIC, 1, 10, tok, 10);
    assert_int_equal(td_data_peek_shard(at(&t, "good.bin"), &count, &err), 0);
    assert_int_equal(count, 10);
    write_shard_raw(at(&t, "bad.bin"), 12345, 1, 10, tok, 10);
    assert_int_equal(td_data_peek_shard(at(&t, "bad.bin"), &count, &err), TD_EDATA);
    snprintf(msg, sizeof(msg), "%s: bad magic 12345, expected 20240520 (llm.c token shard)",
             at(&t, "bad.bin"));
    assert_string_equal(err.msg, msg);
    write_shard_raw(at(&t, "bad.bin"), TD_DATA_SHARD_MAGIC, 7, 10, tok, 10);
    assert_int_equal(td_data_peek_shard(at(&t, "bad.bin"), &count, &err), TD_EDATA);
    expect_msg(&err, "version 7, expected 1");
    write_shard_raw(at(&t, "bad.bin"), TD_DATA_SHARD_MAGIC, 1, 10, tok, 9);
    assert_int_equal(td_data_peek_shard(at(&t, "bad.bin"), &count, &err), TD_EDATA);
    expect_msg(&err, "header says 10 tokens (1044 bytes) but the file has 1042 bytes");
    tmp_remove(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_tokens_are_bytes),
        cmocka_unit_test(test_text_glob_skips),
        cmocka_unit_test(test_shards_glob),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_vocab_checked),
        cmocka_unit_test(test_unshuffled_is_llmc),
        cmocka_unit_test(test_shuffle),
        cmocka_unit_test(test_cursor_resume),
        cmocka_unit_test(test_valid_split),
        cmocka_unit_test(test_replica_rows),
        cmocka_unit_test(test_fnv1a),
        cmocka_unit_test(test_ckpt_round_trip),
        cmocka_unit_test(test_ckpt_keep),
        cmocka_unit_test(test_ckpt_skips_corrupt),
        cmocka_unit_test(test_ckpt_size_mismatch),
        cmocka_unit_test(test_ckpt_disk_full),
        cmocka_unit_test(test_fifo_and_device_refused),
        cmocka_unit_test(test_open_path_flags),
        cmocka_unit_test(test_opens_as_the_user),
        cmocka_unit_test(test_load_stops_when_asked),
        cmocka_unit_test(test_idx_held_to_header),
        cmocka_unit_test(test_idx_claim_costs_nothing),
        cmocka_unit_test(test_idx_peek),
        cmocka_unit_test(test_shard_peek),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
