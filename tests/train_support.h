/* Helpers shared by the train/ unit tests (test_train.c, test_gpt.c, test_memest.c) and
 * test_gpu.c's trainer tests: a temporary directory made before the group and removed after it,
 * IDX files written plain or gzipped, English-like text, tiny sensorlm dimensions, and a metric
 * hook that records every sample for the test to look up. They fail the calling test through
 * cmocka's assertions, so include <cmocka.h> first. */
#ifndef TD_TESTS_TRAIN_SUPPORT_H
#define TD_TESTS_TRAIN_SUPPORT_H

#include <stddef.h>
#include <stdint.h>

#include "train/engine.h"

/* The group's temporary directory, set by tt_tmpdir_make. */
extern char tt_tmpdir[64];

/* Makes tt_tmpdir from a mkdtemp template ("/tmp/td_test_x_XXXXXX"); 0, or -1 on failure. */
int tt_tmpdir_make(const char *template);

/* Removes tt_tmpdir and everything in it; 0, or nonzero on failure. */
int tt_tmpdir_remove(void);

/* out (TD_PATH_MAX bytes) = tt_tmpdir/name. */
void tt_path_of(char *out, const char *name);

/* Writes an IDX file: magic, ndim big-endian dims, then body, gzipped when gz is set.
 * body_len may be shorter than the header promises, to make a truncated file. */
void tt_write_idx(const char *path, int gz, uint32_t magic, const uint32_t *dims, int ndim,
                  const uint8_t *body, size_t body_len);

/* Writes at least bytes of English-like text (a fixed word list and generator, the same text
 * every time) to path, for byte-level gpt jobs. */
void tt_write_text(const char *path, size_t bytes);

/* A sensor shard (train/sensor.h) of N samples of (T, C) readings with TT_SENSOR_LABELS
 * labels ("alpha", "beta", "gamma", prompts "alpha day", ...) that a small sensorlm can learn:
 * sample i has label i % 3, a class-made signal in channels 0 and 1 (noise elsewhere, a NaN now
 * and then) and a caption starting with its label's prompt (a quarter of them the prompt
 * alone). The same seed, the same bytes. */
#define TT_SENSOR_LABELS 3
void tt_write_sensor(const char *path, int N, int T, int C, int caption_len, uint64_t seed);

/* The same shard with other label-table prompts (TT_SENSOR_LABELS of them, "a|b" lists allowed;
 * the captions still start with "alpha day", "beta day", "gamma day") and, with clauses, each
 * caption followed by "; <word> <n>. <word> <n>" clauses, so that it has clause boundaries. */
void tt_write_sensor_with(const char *path, int N, int T, int C, int caption_len, uint64_t seed,
                          const char *const *prompts, int clauses);

/* Tiny sensorlm dimensions for the model's own checks: T 12 C 3 in patches of 3 x 2 (N = 4 * 2
 * = 8, P = 6, the fourth channel padding), D 8, 1 block, 2 heads, M 16, L 6, E 8; pool as
 * given. */
td_slm_dims tt_slm_tiny_dims(td_slm_pool pool);

#define TT_MAX_SAMPLES 4096

typedef struct tt_sample {
    char key[32];
    int64_t step;
    double value;
} tt_sample;

/* Every metric a trainer reported, in order (up to TT_MAX_SAMPLES). */
typedef struct tt_recorder {
    int n;
    tt_sample s[TT_MAX_SAMPLES];
} tt_recorder;

/* A td_train_hooks metric hook; ud is a tt_recorder. */
void tt_record(void *ud, const char *key, int64_t step, double value);

/* The values recorded under key, in order, into out (up to max); returns how many. */
int tt_values_of(const tt_recorder *r, const char *key, double *out, int64_t *steps, int max);

#endif
