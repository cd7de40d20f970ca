/* libFuzzer target: the IDX reader (train/idx.c), plain and gzipped.
 *
 * Input: a 2-byte little-endian length, that many bytes of an images file, then the bytes of a
 * labels file. Both are written to the scratch directory and read as a job's dataset is: each
 * header peeked as submit does (td_idx_peek; the labels scanned), each also peeked as the other
 * kind, and the split loaded as a run does (td_idx_load), every pixel and label then read. A
 * load that succeeds must agree with the peeks: the same counts and sizes, and classes one
 * above the largest label. */
#include <string.h>

#include "train/data.h"
#include "train/engine.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tdf_in in = {data, size};
    size_t ilen, llen;
    uint16_t want = tdf_u16(&in);
    const uint8_t *images = tdf_bytes(&in, want, &ilen);
    const uint8_t *labels = tdf_bytes(&in, in.n, &llen);
    td_idx_split split;
    td_idx_header hi, hl, other;
    td_error_t err;
    td_idx d;
    int rc_i, rc_l, rc;
    uint64_t sum = 0;

    tdf_write(split.images, sizeof(split.images), "images", images, ilen);
    tdf_write(split.labels, sizeof(split.labels), "labels", labels, llen);
    rc_i = td_idx_peek(split.images, TD_IDX_MAGIC_IMAGES, 0, &hi, &err);
    TDF_CHECK(rc_i == 0 || (rc_i == TD_EDATA && err.msg[0] != '\0'));
    rc_l = td_idx_peek(split.labels, TD_IDX_MAGIC_LABELS, 1, &hl, &err);
    TDF_CHECK(rc_l == 0 || (rc_l == TD_EDATA && err.msg[0] != '\0'));
    TDF_CHECK(rc_l != 0 || (hl.max_label >= 0 && hl.max_label <= 255 && hl.bytes == hl.n));
    TDF_CHECK(rc_i != 0 || hi.bytes == (uint64_t)hi.n * hi.rows * hi.cols);
    rc = td_idx_peek(split.images, TD_IDX_MAGIC_LABELS, 1, &other, &err);
    TDF_CHECK(rc == 0 || rc == TD_EDATA);
    rc = td_idx_peek(split.labels, TD_IDX_MAGIC_IMAGES, 0, &other, &err);
    TDF_CHECK(rc == 0 || rc == TD_EDATA);
    TDF_CHECK(td_idx_peek(split.labels, 0x00000802u, 0, &other, &err) == TD_EINVAL);

    rc = td_idx_load(&d, &split, &err);
    if (rc != 0) {
        TDF_CHECK((rc == TD_EDATA || rc == TD_ENOMEM) && err.msg[0] != '\0');
        TDF_CHECK(d.images == NULL && d.labels == NULL);
        return 0;
    }
    TDF_CHECK(rc_i == 0 && rc_l == 0);
    TDF_CHECK(d.n > 0 && (uint32_t)d.n == hi.n && hl.n == hi.n);
    TDF_CHECK((uint32_t)d.rows == hi.rows && (uint32_t)d.cols == hi.cols);
    TDF_CHECK(d.classes == hl.max_label + 1);
    for (size_t i = 0; i < (size_t)d.n * d.rows * d.cols; i++)
        sum += d.images[i];
    for (int i = 0; i < d.n; i++) {
        TDF_CHECK(d.labels[i] < d.classes);
        sum += d.labels[i];
    }
    TDF_CHECK(sum <= 255ull * ((size_t)d.n * d.rows * d.cols + (size_t)d.n));
    td_idx_free(&d);
    return 0;
}
