/* Token data for language models: a train split and an optional valid split of uint16 tokens,
 * read from text files (each byte is a token, vocabulary 256) or from llm.c token shards, and
 * cut into (B, T) batches of inputs and next-token targets.
 *
 * Sources. A split is a list of paths or glob(3) patterns. The files of one pattern are taken
 * in byte-wise sorted order (strcmp, whatever the locale), the patterns in the order given, and
 * all of them are concatenated into one token stream. A pattern without glob characters
 * (*, ?, [) is a path: a missing one is "PATH: No such file or directory". A pattern with them
 * that matches nothing is "no files match PATTERN". Each file is read once: a name that
 * reaches a file already taken (same device and inode: fortunes' `art.u8 -> art`) is skipped
 * and counted. A glob match that is not a regular file (a directory, a FIFO, a device) is
 * skipped and counted; a file named without a glob must be a regular one. Every file is opened
 * as the thread's access says (below: the job's user), without blocking.
 *   - text: a file's bytes are its tokens. A glob match that holds a NUL byte is binary (a
 *     fortune `.dat` index) and is skipped and counted; a file named without a glob that holds
 *     one is refused. So the glob `*` in /usr/share/games/fortunes/ reads each fortune once.
 *   - shards (llm.c): int32 header[256], little-endian: header[0] = 20240520 (magic),
 *     header[1] = 1 (version), header[2] = token count; then count uint16 tokens. The file size
 *     must be exactly 1024 + 2 * count. Shards are mapped read-only, never copied.
 * Text is read a chunk at a time, the access's stop callback polled between chunks (a cancel
 * ends the load with TD_ECANCELLED), into one array sized exactly: 2 bytes a byte of text.
 * Every refusal is TD_EDATA with a message naming the file (or pattern) and what was wrong
 * (TD_EPERM for a file the job's user may not open).
 *
 * Splits. train comes from spec->train. valid comes from spec->valid when given; otherwise,
 * when valid_fraction > 0, valid is the LAST floor(N * valid_fraction) tokens of the N train
 * tokens and train keeps the first N - floor(N * valid_fraction) (disjoint token ranges, cut
 * at a token, not a document, boundary); otherwise there is no valid split.
 *
 * Batches. A window is T+1 consecutive tokens: its first T are a row of inputs, its last T the
 * row's targets. An epoch of the train split has
 *     batches = floor((N - 1) / (B * T))
 * batches (N: train tokens), shuffled or not; fewer than one is refused at open.
 *   - shuffle off: exactly llm.c's loader. Batch k of an epoch is the B*T+1 tokens from token
 *     k*B*T; row b of the inputs is tokens [k*B*T + b*T, +T), its targets the same shifted by
 *     one. After the last batch the next epoch starts again at token 0 (llm.c's wrap "when the
 *     next window would run past the end"). llm.c restarts at each shard of a shard list; we
 *     concatenate them, so the two agree on a single shard.
 *   - shuffle on: the split holds rows = floor((N - 1) / T) row windows, window r at token r*T.
 *     Each epoch draws a permutation of them (Fisher-Yates, xoshiro256** seeded with the job's
 *     seed and a stream made from the epoch number, so epoch e's order depends only on (seed,
 *     e)); batch k takes windows perm[k*B .. k*B + B). The rows - batches*B left over (< B)
 *     are that epoch's unused rows, different each epoch.
 * The valid split is never shuffled: valid batch i is the unshuffled window i, for evaluation
 * over the first eval_batches of them.
 *
 * A cursor (epoch, batch within the epoch) says which batch comes next. Saving it (in a
 * checkpoint) and restoring it with td_data_seek() gives a resumed job exactly the batches it
 * would have seen.
 *
 * Data parallel: every replica sees the same global batch order; td_data_fill() takes the
 * rows [r0, r1) of the global batch at the cursor, so each replica fills only its slice.
 *
 * Memory: td_data_open() acquires everything (the text tokens as uint16, the shard mappings,
 * the permutation: 4 bytes a row when shuffling). td_data_fill() and td_data_valid_fill()
 * allocate nothing and only read the td_data, so several threads may fill from one td_data at
 * once; td_data_advance() and td_data_seek() change it and need the caller to exclude fills.
 * td_data_advance() reshuffles (O(rows), no allocation) at an epoch boundary.
 *
 * Threads: see Memory. Errors are returned, never panicked. */
#ifndef TD_DATA_H
#define TD_DATA_H

#include <glob.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "common/td_errno.h"

#define TD_DATA_SHARD_MAGIC   20240520 /* header[0] of an llm.c token shard */
#define TD_DATA_SHARD_VERSION 1        /* header[1] */
#define TD_DATA_SHARD_HEADER  1024     /* bytes: int32 header[256] */

#define TD_DATA_MAX_PATTERNS   256          /* paths or globs in one split */
#define TD_DATA_MAX_FILES      65536        /* files in one td_data, all splits together */
#define TD_DATA_MAX_TEXT_BYTES (1ull << 31) /* bytes of text in all; 2 bytes each in memory */
#define TD_DATA_MAX_ROWS       (1ll << 31)  /* row windows of the train split when shuffling */
/* Bytes of dataset one replica of a job holds in memory, all its files together (16 GiB): IDX
 * pixels and labels as their headers declare them, text as 2-byte tokens, the shuffle's order.
 * A job past it is refused at submit. */
#define TD_DATA_MAX_BYTES (1ull << 34)

typedef enum {
    TD_DATA_FORMAT_TEXT = 1,  /* bytes are tokens, vocabulary 256 */
    TD_DATA_FORMAT_SHARDS = 2 /* llm.c token shards */
} td_data_format;

/* What to open. Borrowed for the call only (td_data_open copies what it keeps). */
typedef struct td_data_spec {
    td_data_format format;
    const char *const *train; /* paths or globs, n_train >= 1 */
    int n_train;
    const char *const *valid; /* paths or globs; n_valid 0: no valid sources */
    int n_valid;
    double valid_fraction; /* in [0, 1): used only when n_valid == 0; 0: no valid split */
    int B, T;              /* rows per global batch and tokens per row, both >= 1 */
    int shuffle;           /* 0: llm.c's consecutive windows; 1: shuffled rows (above) */
    uint64_t seed;         /* the job's seed: the shuffle's permutations */
    int vocab;             /* tokens must be < vocab (checked as batches are filled);
                            * 0: no check beyond the format's own range */
} td_data_spec;

/* What was read, for the job's log. */
typedef struct td_data_info {
    int64_t train_tokens;
    int64_t valid_tokens;  /* 0: no valid split */
    int64_t batches;       /* train batches per epoch */
    int64_t valid_batches; /* valid windows of B*T+1 (0: no valid split) */
    int files;             /* files read, both splits */
    int skipped_binary;    /* text glob matches skipped for holding a NUL byte */
    int skipped_duplicate; /* names that reached a file already read */
    int skipped_other;     /* glob matches that are not regular files */
} td_data_info;

/* Which batch comes next: batch (0 .. batches-1) of epoch (0, 1, ...). */
typedef struct td_data_cursor {
    int64_t epoch;
    int64_t batch;
} td_data_cursor;

typedef struct td_data td_data;

/* Reads both splits' sources and sets the cursor to (0, 0). Errors: TD_EDATA naming the file
 * or pattern and what was wrong (a missing file, a pattern matching nothing, a bad shard
 * header or size, text that is all binary, a split too short for one batch: "train split:
 * 100 tokens, a batch needs B*T+1 = 1025"); TD_EINVAL for a bad spec (B, T, fraction);
 * TD_E2BIG past a TD_DATA_MAX_* limit; TD_ENOMEM. Copies spec.
 * Caller frees with td_data_free(). */
int td_data_open(td_data **out, const td_data_spec *spec, td_error_t *err);

void td_data_free(td_data *d); /* accepts NULL */

/* Token counts, batches per epoch and file counts. */
void td_data_get_info(const td_data *d, td_data_info *info);

/* The cursor: the batch td_data_fill() fills next. */
td_data_cursor td_data_tell(const td_data *d);

/* Moves the cursor to c (as td_data_tell() gave it), drawing epoch c.epoch's permutation when
 * shuffling. TD_EINVAL (the cursor unchanged) for c.epoch < 0 or c.batch outside
 * [0, batches). */
int td_data_seek(td_data *d, td_data_cursor c, td_error_t *err);

/* Rows [r0, r1) of the global train batch at the cursor, 0 <= r0 < r1 <= B:
 * inputs and targets are (r1 - r0, T), row-major; row i is global row r0 + i. Does not move
 * the cursor. TD_EDATA ("PATH: token 50300 at token 1234 of the file is not below the
 * vocabulary size 50257") when a token is >= spec.vocab; TD_EINVAL for bad rows. */
int td_data_fill(const td_data *d, int r0, int r1, int *inputs, int *targets, td_error_t *err);

/* Moves the cursor to the next batch; after an epoch's last batch, to batch 0 of the next
 * epoch (reshuffled when shuffling). */
void td_data_advance(td_data *d);

/* td_data_fill(d, 0, B, ...) then td_data_advance(d): the whole next batch, for one replica.
 * On error the cursor does not move. */
int td_data_next(td_data *d, int *inputs, int *targets, td_error_t *err);

/* Rows [r0, r1) of valid batch i (0 <= i < valid_batches): the unshuffled window i of the
 * valid split, as in td_data_fill. TD_EINVAL for no valid split, i or rows out of range;
 * TD_EDATA for a token outside the vocabulary. */
int td_data_valid_fill(const td_data *d, int64_t i, int r0, int r1, int *inputs, int *targets,
                       td_error_t *err);

/* ---- whose rights a job's files are read with ---------------------------------------------- */

/* traind runs as root and reads files for other users. A check when the job is submitted is
 * not enough: the path can be swapped for a symlink to a root-only file before the job opens
 * it, at its start or at a resume after a restart. So every open of a job's file by train/
 * (td_data_open, td_data_peek_shard, td_idx_load, td_idx_peek, the model files' opens) and
 * by the daemon's checks (td_data_open_file, td_data_glob) is made with the rights of the
 * user the calling thread named with td_data_access_begin. For that one open (or glob) the
 * thread's filesystem uid and gid (setfsuid, setfsgid) and its supplementary groups (the raw
 * setgroups system call: glibc's setgroups() changes every thread of the process) become the
 * user's, and are restored right after. Linux keeps these per thread, so no other thread of
 * the daemon is affected, and the kernel checks the open as it would the user's own: every
 * directory on the path, every symlink's target, ACLs. That is why this and not "open as root
 * with O_NOFOLLOW, then check the descriptor": a swapped directory higher up the path, ACLs
 * and group membership would then be ours to get right, and the kernel already does.
 *
 * A process that may not change its filesystem ids (traind started as an ordinary user) opens
 * as itself and then checks the opened file's owner, group and mode bits against the user:
 * weaker (directories on the path and ACLs are not checked), and said so here.
 *
 * Every open is also non-blocking, so a FIFO or a device is opened and refused (fstat on the
 * descriptor), never waited on; only regular files are read. Long reads poll the thread's
 * stop callback between chunks, so a cancel or a shutdown ends a load of many gigabytes. */

#define TD_DATA_MAX_GROUPS 256   /* groups of a job's user taken into account, at most */
#define TD_DATA_NOGROUP    65534 /* the group of a uid with no passwd entry and no known gid */

/* Who a thread's reads are for, and when to stop them. Copied by td_data_access_begin. */
typedef struct td_data_access {
    int64_t uid; /* the job's user; < 0: the process's own rights (no change) */
    int64_t gid; /* the group it submitted with; < 0: its passwd entry's (TD_DATA_NOGROUP for
                  * a uid without one) */
    int (*stop)(void *ud); /* polled between chunks of long reads; nonzero ends the read with
                            * TD_ECANCELLED. NULL: never */
    void *ud;
} td_data_access;

/* Sets the calling thread's access until td_data_access_end(): the user's groups are looked
 * up here, once (getpwuid_r, getgrouplist). A uid equal to the process's effective uid needs no
 * change and gets none. TD_EPERM when the user is in more than TD_DATA_MAX_GROUPS groups. */
int td_data_access_begin(const td_data_access *a, td_error_t *err);
void td_data_access_end(void);

/* TD_ECANCELLED ("PATH: reading stopped: the job was cancelled or traind is stopping") when
 * the thread's stop callback says so; else 0. */
int td_data_should_stop(const char *path, td_error_t *err);

/* Opens path read-only, close-on-exec, without blocking, as the thread's access says, and
 * fstats the descriptor into *st. Returns the descriptor (>= 0; O_NONBLOCK cleared on a
 * regular file), or -errno (-ENOENT, -EACCES, ...). A descriptor of something that is not a
 * regular file is returned too, so that a caller can skip it or name it: check st. */
int td_data_open_fd(const char *path, struct stat *st);

/* How td_data_open_path reports (flags, or'ed). TD_OPEN_MODEL: a model file (init_from), where
 * a missing file is TD_ENOTFOUND and another failure but a refusal TD_EIO; without it both are
 * TD_EDATA (a job's data, which the job cannot run without). TD_OPEN_ANY: something that is
 * not a regular file is returned open too (st says what), for a caller that skips it; without
 * it, TD_EDATA. */
#define TD_OPEN_MODEL 1
#define TD_OPEN_ANY   2

/* The one opener of a job's files in train/ (data, shards, model files: data.c, llmc.c,
 * safetensors.c, the submit checks): td_data_open_fd, its errno turned into an error naming
 * the file. 0 with *fd open and *st its fstat; else *fd = -1 and TD_EPERM ("PATH: Permission
 * denied"), TD_ENOTFOUND or TD_EDATA ("PATH: No such file or directory"), TD_EIO or TD_EDATA
 * (another errno), TD_EDATA ("PATH: not a regular file (a FIFO)"), as flags say. */
int td_data_open_path(const char *path, int flags, int *fd, struct stat *st, td_error_t *err);

/* td_data_open_path for a data file that must be regular (flags 0): 0 with *fd open, else
 * *fd = -1 and TD_EPERM ("PATH: Permission denied"), TD_EDATA ("PATH: No such file or
 * directory", "PATH: not a regular file (a FIFO)"). */
int td_data_open_file(const char *path, int *fd, td_error_t *err);

/* What kind of file st_mode is, for a message: "a FIFO", "a directory", ... */
const char *td_data_file_kind(unsigned mode);

/* glob(3) of pattern with flags, as the thread's access says (directories are read with the
 * user's rights). glob's return value; caller frees with globfree(). */
int td_data_glob(const char *pattern, int flags, glob_t *g);

/* ---- IDX files (idx.c): a header read without loading the file ------------------------------ */

/* An IDX file's header, as td_idx_peek read it. */
typedef struct td_idx_header {
    uint32_t n;          /* items: images or labels */
    uint32_t rows, cols; /* an image's size; 0 for a labels file */
    uint64_t bytes;      /* the data after the header: n*rows*cols pixels or n labels */
    int max_label;       /* a scanned labels file's largest label; -1 when not scanned */
} td_idx_header;

/* Reads path's IDX header (gzipped or not; opened as the thread's access says) and checks it
 * as td_idx_load would, without reading the data: the magic against want (TD_IDX_MAGIC_IMAGES
 * or TD_IDX_MAGIC_LABELS; the other kind is named: "PATH: magic 0x00000801 is an IDX labels
 * file, expected images (0x00000803)"), the counts against the TD_IDX_MAX_* limits, and a
 * plain file's size against what the header declares. With scan (labels only) it reads every
 * label, a chunk at a time, for the largest, and checks the stream holds exactly n of them.
 * TD_EDATA naming the file and the field; TD_EPERM; TD_ECANCELLED (the stop callback). */
int td_idx_peek(const char *path, uint32_t want, int scan, td_idx_header *h, td_error_t *err);

/* Reads path's llm.c token shard header as td_data_open does (magic, version, the size the
 * count implies against the file's) into *count. TD_EDATA naming the file and the field. */
int td_data_peek_shard(const char *path, int64_t *count, td_error_t *err);

#endif
