/* libFuzzer target: sensor shards (train/sensor.c), the data of a sensorlm job.
 *
 * Input: the shard file. Its header is checked by path and by descriptor (td_sensor_check,
 * td_sensor_check_fd), which must agree, and against what a model could ask of it; then the
 * file is opened (td_sensor_open) and every sample read through the API with every output
 * and with none, every label name and prompt with it. A file whose every sample reads is
 * written again with the writer (td_sensor_writer_*, in the scratch directory), its samples,
 * captions, labels, names and statistics as read: the copy must be the input, byte for byte,
 * but for what follows a caption's NUL in its slot (the writer zeroes it; the reader ignores
 * it). */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/fuzz.h"
#include "train/sensor.h"

/* Reads path whole into a malloc'd buffer; its size in *n. */
static uint8_t *read_file(const char *path, size_t *n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    off_t size;
    uint8_t *p;

    TDF_CHECK(fd >= 0 && (size = lseek(fd, 0, SEEK_END)) >= 0);
    p = malloc((size_t)size + 1);
    TDF_CHECK(p != NULL && pread(fd, p, (size_t)size, 0) == size);
    close(fd);
    *n = (size_t)size;
    return p;
}

/* Writes what s read as a new shard and compares it with the input. */
static void check_rewrite(const td_sensor *s, const uint8_t *data, size_t size)
{
    const td_sensor_header *h = td_sensor_header_of(s);
    const char *names[TD_SENSOR_MAX_LABELS], *prompts[TD_SENSOR_MAX_LABELS];
    float mean[TD_SENSOR_MAX_CHANNELS], std[TD_SENSOR_MAX_CHANNELS];
    size_t grid_n = (size_t)h->T * (size_t)h->C, L = (size_t)h->caption_len, n;
    size_t captions = size - (size_t)h->N * L;
    float *grid = malloc(grid_n * sizeof(float));
    char caption[TD_SENSOR_MAX_CAPTION + 1], path[512];
    td_sensor_writer *w;
    td_error_t err;
    uint8_t *copy;

    TDF_CHECK(grid != NULL);
    for (int k = 0; k < h->n_labels; k++) {
        names[k] = td_sensor_label_name(s, k);
        prompts[k] = td_sensor_label_prompt(s, k);
    }
    for (int c = 0; c < h->C; c++) {
        mean[c] = h->ch[c].mean;
        std[c] = h->ch[c].std;
    }
    tdf_path(path, sizeof(path), "copy.bin");
    TDF_CHECK(td_sensor_writer_open(&w, path, h, names, prompts, &err) == 0);
    for (int64_t i = 0; i < h->N; i++) {
        size_t len;
        int32_t label;
        TDF_CHECK(td_sensor_read(s, i, grid, caption, &len, &label, &err) == 0);
        TDF_CHECK(td_sensor_writer_add(w, grid, caption, len, label, &err) == 0);
    }
    TDF_CHECK(td_sensor_writer_finish(w, mean, std, &err) == 0);
    td_sensor_writer_free(w);
    copy = read_file(path, &n);
    TDF_CHECK(n == size && memcmp(copy, data, captions) == 0);
    for (int64_t i = 0; i < h->N; i++) {
        const uint8_t *a = data + captions + (size_t)i * L, *b = copy + captions + (size_t)i * L;
        size_t len = strnlen((const char *)a, L);
        TDF_CHECK(memcmp(a, b, len) == 0);
        for (size_t k = len; k < L; k++)
            TDF_CHECK(b[k] == 0);
    }
    free(copy);
    free(grid);
}

/* Reads every sample of s with every output, and with none. Returns whether all read. */
static int read_all(const td_sensor *s)
{
    const td_sensor_header *h = td_sensor_header_of(s);
    size_t grid_n = (size_t)h->T * (size_t)h->C;
    float *grid = malloc(grid_n * sizeof(float));
    char caption[TD_SENSOR_MAX_CAPTION + 1];
    td_error_t err;
    int all = 1;

    TDF_CHECK(grid != NULL);
    for (int64_t i = 0; i < h->N; i++) {
        size_t len = 0;
        int32_t label = -2;
        int rc = td_sensor_read(s, i, grid, caption, &len, &label, &err);
        if (rc != 0) {
            /* an infinite reading; a NaN is a missing one */
            TDF_CHECK(rc == TD_EDATA && err.msg[0] != '\0');
            all = 0;
            continue;
        }
        for (size_t k = 0; k < grid_n; k++)
            TDF_CHECK(!isinf(grid[k]));
        TDF_CHECK(len <= (size_t)h->caption_len && strlen(caption) == len);
        TDF_CHECK(h->n_labels > 0 ? label >= 0 && label < h->n_labels : label == -1);
        TDF_CHECK(td_sensor_read(s, i, NULL, NULL, NULL, NULL, &err) == 0);
    }
    TDF_CHECK(td_sensor_read(s, -1, grid, NULL, NULL, NULL, &err) == TD_EINVAL);
    TDF_CHECK(td_sensor_read(s, h->N, NULL, caption, NULL, NULL, &err) == TD_EINVAL);
    free(grid);
    return all;
}

static void check_labels(const td_sensor *s)
{
    const td_sensor_header *h = td_sensor_header_of(s);

    for (int k = -1; k <= h->n_labels; k++) {
        const char *name = td_sensor_label_name(s, k), *prompt = td_sensor_label_prompt(s, k);
        int in = k >= 0 && k < h->n_labels;
        TDF_CHECK((name != NULL) == in && (prompt != NULL) == in);
        if (in)
            TDF_CHECK(strlen(name) > 0 && strlen(name) < TD_SENSOR_NAME_BYTES &&
                      strlen(prompt) > 0 && strlen(prompt) < TD_SENSOR_PROMPT_BYTES);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[512];
    td_sensor_header h1, h2;
    td_sensor_expect want;
    td_sensor *s;
    td_error_t err;
    int rc1, rc2, rc, fd;

    tdf_write(path, sizeof(path), "shard.bin", data, size);
    rc1 = td_sensor_check(path, NULL, &h1, &err);
    TDF_CHECK(rc1 == 0 || ((rc1 == TD_EDATA || rc1 == TD_E2BIG) && err.msg[0] != '\0'));
    fd = open(path, O_RDONLY | O_CLOEXEC);
    TDF_CHECK(fd >= 0);
    rc2 = td_sensor_check_fd(fd, path, NULL, &h2, &err);
    close(fd);
    TDF_CHECK(rc1 == rc2 && (rc1 != 0 || memcmp(&h1, &h2, sizeof(h1)) == 0));
    if (rc1 == 0) {
        TDF_CHECK(td_sensor_file_bytes(&h1) == size);
        want = (td_sensor_expect){.T = h1.T, .C = h1.C, .labels = 1};
        rc = td_sensor_check(path, &want, NULL, &err);
        TDF_CHECK(h1.n_labels > 0 ? rc == 0 : rc == TD_ESHAPE);
        want = (td_sensor_expect){.T = h1.T + 1};
        TDF_CHECK(td_sensor_check(path, &want, NULL, &err) == TD_ESHAPE);
        TDF_CHECK(td_sensor_compatible(path, &h1, path, &h2, &err) == 0);
    }
    rc = td_sensor_open(&s, path, NULL, &err);
    if (rc != 0) {
        TDF_CHECK(s == NULL && (rc == TD_EDATA || rc == TD_E2BIG) && err.msg[0] != '\0');
        return 0;
    }
    TDF_CHECK(rc1 == 0 && memcmp(td_sensor_header_of(s), &h1, sizeof(h1)) == 0);
    TDF_CHECK(td_sensor_count(s) == h1.N && strcmp(td_sensor_path(s), path) == 0);
    check_labels(s);
    if (read_all(s))
        check_rewrite(s, data, size);
    td_sensor_close(s);
    return 0;
}
