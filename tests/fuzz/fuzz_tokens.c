/* libFuzzer target: a language model's token data (train/data.c): text files and llm.c token
 * shards, one split or two, named or globbed, cut into batches.
 *
 * Input: a settings byte (bit 0: shards, else text; bit 1: shuffle; bit 2: a valid file; bit
 * 3: the train split is a glob over two files; bits 4-5: valid_fraction 0, 0.1, 0.5 or 0.9),
 * then B-1 (mod 8), T-1 (mod 32), a 2-byte vocabulary (0: unchecked) and a seed byte, then a
 * 2-byte length and that many bytes of the first train file, with a glob another 2-byte
 * length and the second, then the valid file. Every file is peeked as submit peeks a shard
 * (td_data_peek_shard), and the whole opened as a run does (td_data_open). An open that
 * succeeds is read batch by batch, each batch also in two parts, then sought back to its
 * start, and every valid batch read too. Every token read is checked against the token stream
 * the files make, worked out here from their bytes: a row's targets are its inputs shifted by
 * one, and without shuffling each batch is exactly its window of the stream. */
#include <stdlib.h>
#include <string.h>

#include "train/data.h"
#include "tests/fuzz/fuzz.h"

#define MAX_B        8
#define MAX_T        32
#define MAX_BATCHES  64 /* train batches read, over epochs */
#define MAX_VALID    16 /* valid batches read */
#define MAX_FILES    3
#define SHARD_HEADER TD_DATA_SHARD_HEADER

/* One file of the input and what it holds as tokens. */
typedef struct file {
    const uint8_t *p;
    size_t n;
    char path[512];
} file;

/* Appends the tokens file f holds to stream (n so far) and returns the new count; -1 when the
 * open would refuse or skip it (a text file with a NUL byte, a bad shard). */
static long add_tokens(const file *f, int shards, uint16_t *stream, long n)
{
    if (!shards) {
        if (memchr(f->p, 0, f->n) != NULL)
            return -1;
        for (size_t i = 0; i < f->n; i++)
            stream[n++] = f->p[i];
        return n;
    }
    int32_t h[3];
    if (f->n < SHARD_HEADER)
        return -1;
    memcpy(h, f->p, sizeof(h));
    if (h[0] != TD_DATA_SHARD_MAGIC || h[1] != TD_DATA_SHARD_VERSION || h[2] < 0 ||
        (size_t)SHARD_HEADER + 2 * (size_t)h[2] != f->n)
        return -1;
    for (int32_t i = 0; i < h[2]; i++)
        stream[n++] = (uint16_t)(f->p[SHARD_HEADER + 2 * i] | f->p[SHARD_HEADER + 2 * i + 1] << 8);
    return n;
}

/* Rows [r0, r1) as read: targets are inputs shifted by one; tokens in range; without shuffling
 * (or for valid), row b is the window of the stream at base + b*T. */
static void check_rows(const int *inp, const int *tgt, int r0, int r1, int T, int vocab,
                       const uint16_t *stream, long total, long base)
{
    for (int b = r0; b < r1; b++) {
        const int *x = inp + (size_t)(b - r0) * T, *y = tgt + (size_t)(b - r0) * T;
        for (int t = 0; t < T; t++) {
            TDF_CHECK(x[t] >= 0 && x[t] <= 65535 && (vocab == 0 || (x[t] < vocab && y[t] < vocab)));
            if (t + 1 < T)
                TDF_CHECK(y[t] == x[t + 1]);
            if (base >= 0) {
                long at = base + (long)b * T + t;
                TDF_CHECK(at + 1 < total && x[t] == stream[at] && y[t] == stream[at + 1]);
            }
        }
    }
}

/* Reads the train batches: each whole and in two parts, which must agree. */
static void read_train(td_data *d, const td_data_spec *s, const td_data_info *info,
                       const uint16_t *stream, long total)
{
    static int inp[MAX_B * MAX_T], tgt[MAX_B * MAX_T], part_i[MAX_B * MAX_T], part_t[MAX_B * MAX_T];
    int first_i[MAX_B * MAX_T], first_t[MAX_B * MAX_T];
    int n = s->B * s->T, split = s->B / 2;
    td_data_cursor c;
    td_error_t err;

    for (int k = 0; k < MAX_BATCHES && k < 2 * info->batches + 1; k++) {
        c = td_data_tell(d);
        TDF_CHECK(c.batch >= 0 && c.batch < info->batches && c.epoch == k / info->batches);
        int rc = td_data_fill(d, 0, s->B, inp, tgt, &err);
        if (rc != 0) { /* only a token past the vocabulary fails a read */
            TDF_CHECK(rc == TD_EDATA && s->vocab > 0);
            return;
        }
        check_rows(inp, tgt, 0, s->B, s->T, s->vocab, stream, total,
                   s->shuffle ? -1 : (long)(c.batch * n));
        if (split > 0) {
            TDF_CHECK(td_data_fill(d, 0, split, part_i, part_t, &err) == 0);
            TDF_CHECK(td_data_fill(d, split, s->B, part_i + split * s->T, part_t + split * s->T,
                                   &err) == 0);
            TDF_CHECK(memcmp(inp, part_i, n * sizeof(int)) == 0 &&
                      memcmp(tgt, part_t, n * sizeof(int)) == 0);
        }
        if (k == 0) {
            memcpy(first_i, inp, n * sizeof(int));
            memcpy(first_t, tgt, n * sizeof(int));
        }
        td_data_advance(d);
    }
    TDF_CHECK(td_data_fill(d, 0, s->B + 1, inp, tgt, &err) == TD_EINVAL);
    TDF_CHECK(td_data_fill(d, 1, 1, inp, tgt, &err) == TD_EINVAL);
    c.epoch = 0;
    c.batch = info->batches;
    TDF_CHECK(td_data_seek(d, c, &err) == TD_EINVAL);
    c.batch = 0;
    TDF_CHECK(td_data_seek(d, c, &err) == 0);
    TDF_CHECK(td_data_next(d, inp, tgt, &err) == 0);
    TDF_CHECK(memcmp(inp, first_i, n * sizeof(int)) == 0 &&
              memcmp(tgt, first_t, n * sizeof(int)) == 0);
}

static void read_valid(const td_data *d, const td_data_spec *s, const td_data_info *info,
                       const uint16_t *stream, long total)
{
    static int inp[MAX_B * MAX_T], tgt[MAX_B * MAX_T];
    td_error_t err;

    for (int64_t i = 0; i < info->valid_batches && i < MAX_VALID; i++) {
        int rc = td_data_valid_fill(d, i, 0, s->B, inp, tgt, &err);
        if (rc != 0) {
            TDF_CHECK(rc == TD_EDATA && s->vocab > 0);
            return;
        }
        check_rows(inp, tgt, 0, s->B, s->T, s->vocab, stream, total,
                   (long)(info->train_tokens + i * s->B * s->T));
    }
    TDF_CHECK(td_data_valid_fill(d, info->valid_batches, 0, s->B, inp, tgt, &err) == TD_EINVAL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const double fractions[4] = {0, 0.1, 0.5, 0.9};
    tdf_in in = {data, size};
    uint8_t flags = tdf_u8(&in);
    int shards = flags & 1, globbed = (flags >> 3) & 1, has_valid = (flags >> 2) & 1;
    file f[MAX_FILES];
    int nf = 0;
    char pattern[512];
    const char *train[1], *valid[1];
    td_data_spec s = {
        .format = shards ? TD_DATA_FORMAT_SHARDS : TD_DATA_FORMAT_TEXT,
        .shuffle = (flags >> 1) & 1,
        .valid_fraction = has_valid ? 0 : fractions[(flags >> 4) & 3],
        .train = train,
        .n_train = 1,
        .valid = valid,
        .n_valid = has_valid,
    };
    uint16_t *stream;
    long total = 0, train_total;
    td_data *d;
    td_data_info info;
    td_error_t err;
    int rc;

    s.B = 1 + tdf_u8(&in) % MAX_B;
    s.T = 1 + tdf_u8(&in) % MAX_T;
    s.vocab = tdf_u16(&in);
    s.seed = tdf_u8(&in);
    for (int i = 0; i < 1 + globbed; i++) {
        uint16_t n = tdf_u16(&in);
        f[nf].p = tdf_bytes(&in, n, &f[nf].n);
        tdf_write(f[nf].path, sizeof(f[nf].path), i == 0 ? "train-a" : "train-b", f[nf].p, f[nf].n);
        nf++;
    }
    if (has_valid) {
        f[nf].p = tdf_bytes(&in, in.n, &f[nf].n);
        tdf_write(f[nf].path, sizeof(f[nf].path), "valid", f[nf].p, f[nf].n);
        nf++;
    }
    tdf_path(pattern, sizeof(pattern), globbed ? "train-*" : "train-a");
    train[0] = pattern;
    valid[0] = f[nf - 1].path;

    for (int i = 0; i < nf; i++) {
        int64_t count = -1;
        rc = td_data_peek_shard(f[i].path, &count, &err);
        TDF_CHECK(rc == 0 ? count >= 0 && (size_t)(SHARD_HEADER + 2 * count) == f[i].n
                          : rc == TD_EDATA && count == 0);
    }
    /* the stream the files make: a globbed text file with a NUL byte is skipped */
    stream = malloc((size + 1) * sizeof(*stream));
    TDF_CHECK(stream != NULL);
    for (int i = 0; i < nf && total >= 0; i++) {
        long n = add_tokens(&f[i], shards, stream, total);
        if (n < 0 && !shards && globbed && i < 2)
            continue;
        total = n;
    }
    train_total = total; /* where it goes wrong, the open must refuse */

    rc = td_data_open(&d, &s, &err);
    if (rc != 0) {
        TDF_CHECK((rc == TD_EDATA || rc == TD_E2BIG) && err.msg[0] != '\0');
        free(stream);
        return 0;
    }
    td_data_get_info(d, &info);
    TDF_CHECK(train_total >= 0 && info.train_tokens + info.valid_tokens == total);
    TDF_CHECK(info.batches == (info.train_tokens - 1) / ((int64_t)s.B * s.T) && info.batches >= 1);
    TDF_CHECK(info.valid_batches ==
              (info.valid_tokens > 0 ? (info.valid_tokens - 1) / ((int64_t)s.B * s.T) : 0));
    read_valid(d, &s, &info, stream, total);
    read_train(d, &s, &info, stream, total);
    td_data_free(d);
    free(stream);
    return 0;
}
