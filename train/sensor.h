/* Sensor shards: the data of a sensorlm job. One file holds N samples, each a (T, C) grid of
 * float32 sensor readings (time-major: T time steps of C channels, NaN where a reading is
 * missing), a caption of at most caption_len bytes, and optionally an integer label whose name
 * and text prompt are in the file too. README.md ("Sensor data") documents the layout byte by
 * byte; in short, all little-endian:
 *
 *   header      4096 bytes: 256 bytes of fixed fields, then 60 channel entries of 64 bytes
 *   samples     N * T * C float32, sample-major, then time, then channel
 *   labels      N int32 in [0, K)                      (only when K, the label count, > 0)
 *   label table K entries of 128 bytes: name[32], prompt[96]     (only when K > 0)
 *   captions    N slots of caption_len bytes; a caption ends at its slot's first NUL byte
 *
 * The file's size is exactly the sum, so a header can be checked against the size without
 * reading the rest, and every count is bounded by a named limit before it sizes anything: the
 * files come from the users of a shared daemon.
 *
 * Three parts:
 *   - td_sensor_check(): the header and the file size only, for submit and --dry-run time
 *     (daemon/jobspec.c), and td_sensor_compatible() across the files of one job.
 *   - td_sensor_open() / td_sensor_read(): the reader for the trainer and the verbs that will
 *     classify and retrieve. Reads with pread(2), never mmap, so a file truncated under a
 *     running job is a TD_EDATA from td_sensor_read(), not a SIGBUS.
 *   - td_sensor_writer_*: writes a shard through FILE.tmp, renamed when whole (trainctl's
 *     `sensor synth` and `sensor import`).
 *
 * Errors are returned (TD_EDATA for a file that is not a good shard, TD_ESHAPE for one that
 * does not fit the model, TD_E2BIG past a limit, TD_ENOTFOUND, TD_EIO, TD_EINVAL, TD_ENOMEM)
 * with a message that names the file and, for a header, the field: "/data/x.bin: header field
 * channels: 8, but the model expects 10". Nothing here panics or keeps global state; a td_sensor
 * may be read from several threads at once (td_sensor_read only reads it). */
#ifndef TD_SENSOR_H
#define TD_SENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_SENSOR_MAGIC        "TDSENSOR" /* the file's first 8 bytes */
#define TD_SENSOR_VERSION      1
#define TD_SENSOR_HEADER_BYTES 4096 /* bytes: 256 of fields + 60 channel entries of 64 */
#define TD_SENSOR_LABEL_BYTES  128  /* bytes of one label table entry */

#define TD_SENSOR_MAX_T        65536     /* time steps per sample (45 days of minutes) */
#define TD_SENSOR_MAX_CHANNELS 60        /* channels: the entries the header has room for */
#define TD_SENSOR_MAX_SAMPLES  (1 << 24) /* samples per file */
#define TD_SENSOR_MAX_CAPTION  4096      /* bytes: caption_len, the caption slot's size */
#define TD_SENSOR_MAX_LABELS   256       /* label names per file */
#define TD_SENSOR_MAX_PERIOD   86400     /* seconds per time step */
#define TD_SENSOR_NAME_BYTES   32        /* a channel's or label's name, NUL included */
#define TD_SENSOR_UNIT_BYTES   16        /* a channel's unit, NUL included */
#define TD_SENSOR_PROMPT_BYTES 96        /* a label's prompt, NUL included */

/* What the header's split field says the file is. */
enum { TD_SENSOR_SPLIT_NONE = 0, TD_SENSOR_SPLIT_TRAIN = 1, TD_SENSOR_SPLIT_VALID = 2 };

/* One channel: its name (1 to 31 printable ASCII bytes, unique in the file), its unit (0 to 15
 * printable ASCII bytes), and the mean and standard deviation of its readings over the
 * training split, NaNs left out (std > 0: a channel whose readings are all equal, or that has
 * none, stores std 1, so (x - mean) / std is always defined). A validation shard carries the
 * training split's values, so that both splits are normalised alike. */
typedef struct td_sensor_channel {
    char name[TD_SENSOR_NAME_BYTES];
    char unit[TD_SENSOR_UNIT_BYTES];
    float mean;
    float std;
} td_sensor_channel;

/* A header, as read (or to be written). */
typedef struct td_sensor_header {
    int32_t version;     /* TD_SENSOR_VERSION */
    int32_t T;           /* time steps per sample, 1..TD_SENSOR_MAX_T */
    int32_t C;           /* channels, 1..TD_SENSOR_MAX_CHANNELS */
    int64_t N;           /* samples, 1..TD_SENSOR_MAX_SAMPLES */
    int32_t caption_len; /* bytes of each caption slot, 1..TD_SENSOR_MAX_CAPTION */
    int32_t n_labels;    /* K: 0 for a file without labels, else 1..TD_SENSOR_MAX_LABELS */
    int32_t period_s;    /* seconds per time step; 0: not known */
    int32_t split;       /* TD_SENSOR_SPLIT_* */
    td_sensor_channel ch[TD_SENSOR_MAX_CHANNELS]; /* [0, C) used */
} td_sensor_header;

/* What a model needs of a file; a zero field asks nothing. */
typedef struct td_sensor_expect {
    int T;      /* time steps the sensor tower takes */
    int C;      /* channels it takes */
    int labels; /* nonzero: the file must have labels (zero-shot evaluation, classify) */
} td_sensor_expect;

/* The size in bytes a file with header h must have. h's counts must be within the limits. */
uint64_t td_sensor_file_bytes(const td_sensor_header *h);

/* Reads path's header and checks it and the file's size: the magic, the version, each count
 * against its limit, the names, units and statistics, the reserved bytes, the size against the
 * counts, and (when want is not NULL) T, C and labels against want. Reads the 4096 header bytes
 * and nothing else. *out (when not NULL) receives the header. 0, or TD_ENOTFOUND / TD_EIO (the
 * file cannot be opened or read), TD_EDATA (not a good shard), TD_E2BIG (a count past its
 * limit) or TD_ESHAPE (good, but not what want asks), each naming path and the field. */
int td_sensor_check(const char *path, const td_sensor_expect *want, td_sensor_header *out,
                    td_error_t *err);

/* td_sensor_check() of a file the caller opened (fd, read-only; named path in messages), for
 * a caller that opens files with another user's rights (data.h's td_data_open_file): the same
 * checks, the regular-file one included. Reads the header with pread; fd stays the caller's. */
int td_sensor_check_fd(int fd, const char *path, const td_sensor_expect *want,
                       td_sensor_header *out, td_error_t *err);

/* Files that one job reads together must agree on T, C, the channel names in order, and the
 * label names in order where both have labels. TD_ESHAPE naming both files and the field. */
int td_sensor_compatible(const char *path_a, const td_sensor_header *a, const char *path_b,
                         const td_sensor_header *b, td_error_t *err);

/* ---- the reader ---- */

typedef struct td_sensor td_sensor;

/* Opens path: td_sensor_check() (with want), then reads the labels (4 bytes a sample) and the
 * label table, and checks every label is below K and every label name and prompt. Errors as
 * td_sensor_check(), and TD_EDATA for a bad label ("sample 12: label 9, but the file has 7
 * labels") or label entry. Caller frees with td_sensor_close(). */
int td_sensor_open(td_sensor **out, const char *path, const td_sensor_expect *want,
                   td_error_t *err);

/* td_sensor_open() of a file the caller opened (fd, read-only, named path in messages), as
 * td_sensor_check_fd(): the td_sensor takes fd, and closes it on failure too. */
int td_sensor_open_fd(td_sensor **out, int fd, const char *path, const td_sensor_expect *want,
                      td_error_t *err);

void td_sensor_close(td_sensor *s); /* accepts NULL */

/* The header: borrowed, valid until td_sensor_close(). */
const td_sensor_header *td_sensor_header_of(const td_sensor *s);

/* The path the file was opened with: borrowed, valid until td_sensor_close(). */
const char *td_sensor_path(const td_sensor *s);

/* N, the samples in the file. */
int64_t td_sensor_count(const td_sensor *s);

/* Sample i, 0 <= i < N. Each output may be NULL:
 *   grid    (T, C) floats, time-major: grid[t * C + c]; NaN where a reading is missing
 *   caption caption_len + 1 bytes: the caption, NUL-terminated (it holds no NUL of its own)
 *   len     the caption's length in bytes
 *   label   its label in [0, K), or -1 when the file has no labels
 * Allocates nothing. TD_EINVAL for i out of range; TD_EDATA for a short read (the file changed
 * since it was opened) or an infinite reading ("sample 3, step 17, channel heart_rate: inf"). */
int td_sensor_read(const td_sensor *s, int64_t i, float *grid, char *caption, size_t *len,
                   int32_t *label, td_error_t *err);

/* Label k's name and prompt (0 <= k < K): borrowed until td_sensor_close(); NULL for k out of
 * range. The prompt is the text a zero-shot classifier embeds for the label. */
const char *td_sensor_label_name(const td_sensor *s, int k);
const char *td_sensor_label_prompt(const td_sensor *s, int k);

/* ---- the writer ---- */

typedef struct td_sensor_writer td_sensor_writer;

/* Starts writing path: creates path.tmp (mode 0644 less the umask) for h->N samples of h's T,
 * C and caption_len, with h's channel names and units (each up to its NUL), period_s and split
 * (h's version and statistics are ignored). With h->n_labels > 0, label_names and label_prompts
 * hold K strings each (a NULL or empty prompt is the name). Checks h as td_sensor_check() would
 * (TD_EINVAL naming the field, TD_E2BIG past a limit). Copies what it keeps. Caller finishes with
 * td_sensor_writer_finish() and frees with td_sensor_writer_free() either way. */
int td_sensor_writer_open(td_sensor_writer **out, const char *path, const td_sensor_header *h,
                          const char *const *label_names, const char *const *label_prompts,
                          td_error_t *err);

/* Appends the next sample: grid (T, C) time-major (finite or NaN), the caption's len bytes (no
 * NUL among them, len <= caption_len), and label (in [0, K), ignored without labels). TD_EINVAL
 * for a bad value, naming the sample; TD_EIO or TD_EDISKFULL when the write fails. */
int td_sensor_writer_add(td_sensor_writer *w, const float *grid, const char *caption, size_t len,
                         int32_t label, td_error_t *err);

/* The mean and std of each channel over the samples added so far, NaNs left out, as
 * td_sensor_channel says (std 1 when it would be 0). mean and std hold C floats each. */
void td_sensor_writer_stats(const td_sensor_writer *w, float *mean, float *std);

/* Writes the header with the statistics mean and std (C floats each; both NULL: the writer's
 * own, td_sensor_writer_stats), flushes, fsyncs and renames path.tmp to path. TD_EINVAL when
 * fewer than N samples were added or a statistic is bad; TD_EIO / TD_EDISKFULL. */
int td_sensor_writer_finish(td_sensor_writer *w, const float *mean, const float *std,
                            td_error_t *err);

/* Frees w; an unfinished writer's path.tmp is removed. Accepts NULL. */
void td_sensor_writer_free(td_sensor_writer *w);

#endif
