/* Checkpoint files of one job: a directory (created if missing, parents too) holding
 * `ckpt-STEP.bin` files (STEP in decimal, no padding), each a job's whole state at the end of
 * step STEP: the step, the config hash, RNG state, data cursor, and a list of named float
 * sections (parameters, optimizer moments, ...).
 *
 * Writing is crash-safe: a temp file in the same directory (`.ckpt-STEP.bin.tmp`), written
 * whole, fsync'd, renamed over `ckpt-STEP.bin`, then the directory fsync'd. Then the
 * directory keeps only the newest `keep` checkpoints; files with a step above the one just
 * written (a timeline the job abandoned when it resumed from an older file) are deleted too.
 * A failed write (a full disk above all) removes its temp file and touches no checkpoint.
 *
 * File layout (host byte order, little-endian on every machine we run; a byte-swapped magic is
 * refused as "written on a machine of the other byte order"):
 *   header, TD_CKPT_HEADER_BYTES: magic "TDCK", version, header size, section count, step,
 *     config hash, rng[TD_CKPT_RNG_WORDS], cursor[TD_CKPT_CURSOR_WORDS], then per section a
 *     name (TD_CKPT_NAME_MAX bytes, NUL-padded) and a float count; zero padding; and a CRC32
 *     of the header's bytes before it;
 *   the sections' floats, in order, no padding;
 *   trailer: CRC32 (zlib's crc32) of every byte before it, then the magic "TDCE".
 * So a torn or corrupted file is told by its size (which the header fixes), its header CRC or
 * its trailing CRC, and td_ckpt_load_latest() skips it for the one before.
 *
 * Threads: blocking file I/O, called from whichever thread owns the job's trainer. Nothing
 * here is global; two jobs must use two directories. */
#ifndef TD_CKPT_H
#define TD_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_CKPT_MAGIC        0x4b434454u /* "TDCK" read as a little-endian uint32 */
#define TD_CKPT_END_MAGIC    0x45434454u /* "TDCE": the trailer's last 4 bytes */
#define TD_CKPT_VERSION      1
#define TD_CKPT_HEADER_BYTES 1024 /* bytes */
#define TD_CKPT_MAX_SECTIONS 16
#define TD_CKPT_NAME_MAX     24           /* bytes of a section name, NUL included */
#define TD_CKPT_RNG_WORDS    8            /* uint64 words of RNG state (two xoshiro256** states) */
#define TD_CKPT_CURSOR_WORDS 4            /* int64 words of data cursor (epoch, batch, ...) */
#define TD_CKPT_PATH_MAX     1024         /* bytes of a checkpoint's path, NUL included */
#define TD_CKPT_MAX_FLOATS   (1ull << 40) /* floats in one section */

/* FNV-1a 64: start with TD_CKPT_HASH_INIT, feed bytes in any number of calls. For the job's
 * config hash: feed fields (or a struct memset to zero before it was filled, so its padding
 * hashes the same every time), never a struct with uninitialised padding. */
#define TD_CKPT_HASH_INIT 0xcbf29ce484222325ull
uint64_t td_ckpt_hash(uint64_t h, const void *bytes, size_t n);

/* Everything in a checkpoint but the floats. What the words of rng and cursor mean is the
 * caller's; unused words should be zero. */
typedef struct td_ckpt_meta {
    int64_t step;         /* steps completed, >= 0 */
    uint64_t config_hash; /* td_ckpt_hash of what must not change across a resume */
    uint64_t rng[TD_CKPT_RNG_WORDS];
    int64_t cursor[TD_CKPT_CURSOR_WORDS];
} td_ckpt_meta;

/* One float section. name: 1 to TD_CKPT_NAME_MAX-1 bytes. Writing reads data (count floats);
 * reading expects exactly this name and count at this place in the file and stores the floats
 * into data, or only checks them when data is NULL. Borrowed for the call. */
typedef struct td_ckpt_section {
    const char *name;
    float *data;
    size_t count; /* floats */
} td_ckpt_section;

/* Writes meta and the n sections (1 to TD_CKPT_MAX_SECTIONS) as dir/ckpt-STEP.bin (meta->step),
 * replacing one of that step, then keeps the newest keep (keep < 1: all) and deletes files of
 * a higher step (above). path (may be NULL) receives the file's path. Errors, each with the
 * path in err: TD_EDISKFULL when the disk (or quota, or file size limit) is full — the
 * previous checkpoints are intact and the temp file is gone; TD_EIO for any other failure
 * to create the directory or write, sync or rename the file; TD_EINVAL for bad arguments.
 * A failure to delete an old checkpoint is not an error (it is retried at the next write). */
int td_ckpt_write(const char *dir, int keep, const td_ckpt_meta *meta,
                  const td_ckpt_section *sections, int n, char *path, size_t path_len,
                  td_error_t *err);

/* Reads one checkpoint file into meta and the sections' buffers, checking the magic, version,
 * header CRC, that the file's sections are exactly the n expected (same names, counts and
 * order), the file size, and the trailing CRC. Errors naming the file: TD_ENOTFOUND for no
 * such file; TD_EDATA for a file that is not a whole, intact checkpoint ("truncated: 1000
 * bytes, the header says 4136", "checksum mismatch: stored 0x..., computed 0x...");
 * TD_EVERSION for another version; TD_ESHAPE for sections that differ from the expected ones
 * ("section 1 is 'm' of 100 floats, expected 'm' of 200 floats"); TD_EIO for a read error.
 * The buffers may have been written to when it fails. */
int td_ckpt_read(const char *path, td_ckpt_meta *meta, const td_ckpt_section *sections, int n,
                 td_error_t *err);

/* What td_ckpt_load_latest() found. */
typedef struct td_ckpt_found {
    char path[TD_CKPT_PATH_MAX]; /* the checkpoint loaded */
    int skipped;                 /* newer files skipped as torn or corrupt (TD_EDATA) */
    char skip_msg[1024];         /* the newest skipped file's error, for the job's log */
} td_ckpt_found;

/* Loads the newest intact checkpoint in dir: tries dir's ckpt-STEP.bin files from the highest
 * step down with td_ckpt_read(), skipping (and counting in found) each that is TD_EDATA (torn
 * or corrupt). TD_ENOTFOUND when dir is missing or holds no checkpoint file; TD_EDATA when
 * every file was skipped (err names the newest); any other td_ckpt_read() error (TD_ESHAPE,
 * TD_EVERSION, TD_EIO) is returned at once, since an older file of the same job would not
 * fare better. The caller compares meta->config_hash with its own and refuses a mismatch.
 * found may be NULL. */
int td_ckpt_load_latest(const char *dir, td_ckpt_meta *meta, const td_ckpt_section *sections, int n,
                        td_ckpt_found *found, td_error_t *err);

/* One checkpoint file of a directory, as td_ckpt_list() finds it. */
typedef struct td_ckpt_entry {
    int64_t step;
    int64_t bytes;
    double mtime; /* unix seconds */
} td_ckpt_entry;

/* dir's checkpoint files, highest step first, at most max of them into out (*n); reads the
 * directory and each file's size and time, not the files. 0 with *n 0 when dir does not
 * exist; TD_EIO when it cannot be listed. */
int td_ckpt_list(const char *dir, td_ckpt_entry *out, int max, int *n, td_error_t *err);

/* A section as the file declares it. */
typedef struct td_ckpt_section_info {
    char name[TD_CKPT_NAME_MAX];
    uint64_t count; /* floats */
} td_ckpt_section_info;

/* Reads only path's header (magic, version, header CRC): meta and the sections it declares
 * (*n of them, at most TD_CKPT_MAX_SECTIONS), to size buffers before td_ckpt_read(). Does not
 * check the floats' CRC. Errors as td_ckpt_read(). */
int td_ckpt_peek(const char *path, td_ckpt_meta *meta, td_ckpt_section_info *sections, int *n,
                 td_error_t *err);

#endif
