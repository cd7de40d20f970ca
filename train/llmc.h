/* llm.c's GPT-2 model file, as a format (train_gpt2.c's gpt2_build_from_checkpoint and its
 * Python writer): int32 header[256], little-endian: [0] magic 20240326, [1] version (3: fp32
 * parameters; 2 is the older fp32 version, read too), [2] maxT, [3] V, [4] L, [5] NH, [6] C,
 * [7] Vp; the rest zero. Then float32 tensors back to back, each whole, in llm.c's order. This
 * file knows the header and the floats, not the model: which tensor is which, and whether the
 * dimensions make a model traind can build, is weights.c's. A file is opened with data.h's
 * td_data_open_path (the job's user; only a regular file) and the stop callback is polled
 * before each tensor. Blocking file I/O on the caller's thread; errors are returned, never
 * panicked. */
#ifndef TD_LLMC_H
#define TD_LLMC_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

#define TD_LLMC_MAGIC   20240326 /* header[0] of an llm.c model file */
#define TD_LLMC_VERSION 3        /* header[1]: fp32 parameters (2 is fp32 in older files) */
#define TD_LLMC_HEADER  1024     /* bytes: int32 header[256] */

/* The header's numbers, with the old version's Vp (= V) filled in. */
typedef struct td_llmc_header {
    int version;
    int maxT, V, L, NH, C, Vp;
} td_llmc_header;

typedef struct td_llmc_file td_llmc_file;

/* Opens path and reads its header into *h, checking the magic and the version; the file is
 * then at its first tensor. TD_ENOTFOUND, TD_EPERM, TD_EIO for the open; TD_EDATA naming the
 * file ("PATH: bad magic 7: an llm.c model file starts with 20240326", "PATH: unsupported
 * version 5 (bf16): ..."). Caller frees with td_llmc_close(). */
int td_llmc_open(td_llmc_file **out, const char *path, td_llmc_header *h, td_error_t *err);
void td_llmc_close(td_llmc_file *f); /* accepts NULL */

/* The file's size in bytes, header included (to check against the tensors its header means). */
uint64_t td_llmc_size(const td_llmc_file *f);

/* The next n floats, tensor i of the file (i only names it in a message: "PATH: read error in
 * tensor 3", TD_EIO); TD_ECANCELLED when the thread's stop callback says so. */
int td_llmc_read(td_llmc_file *f, int i, float *out, size_t n, td_error_t *err);

/* Writes a file of version 3 with h's dimensions and the count tensors t[i] of n[i] floats,
 * through path.tmp renamed over path when whole. TD_EIO / TD_EDISKFULL naming the file. */
int td_llmc_write(const char *path, const td_llmc_header *h, const float *const *t, const size_t *n,
                  int count, td_error_t *err);

#endif
