/* safetensors files: a model's parameters under names, for other frameworks to load and for a
 * job's model.init_from to start from. The format (Hugging Face's): an 8-byte little-endian
 * header length N, N bytes of a JSON object mapping each tensor's name to {"dtype", "shape",
 * "data_offsets": [begin, end)} (offsets into the data that follows the header) plus an
 * optional "__metadata__" object of strings, then the tensors' little-endian bytes, back to
 * back, covering the data exactly. This module is the format only: which name is which
 * parameter of a model (Hugging Face GPT-2's for a gpt, the README's for a sensorlm) is
 * weights.h's.
 *
 * Reading is checked before anything is sized from the file's numbers: the header's length
 * against TD_ST_MAX_HEADER and the file's size, each tensor's dtype, shape and offsets against
 * the data (no overlap, no hole, nothing past the end). Files are opened as data.h's access
 * says (the job's user; only a regular file). Blocking file I/O on the caller's thread (a
 * worker building a trainer, the daemon's threadpool for an export or a submit's check of a
 * header); errors are returned, never panicked. */
#ifndef TD_SAFETENSORS_H
#define TD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "common/td_errno.h"

/* traind's own limits, below the format's (a 100 MiB header): every file traind reads (a
 * submit's check, a run's init_from) is held to them, so that one hostile header costs a
 * thread at most this much parsing. GPT-2 XL's header is ~40 KiB of ~580 tensors. */
#define TD_ST_MAX_HEADER  (16u << 20) /* bytes of JSON header */
#define TD_ST_MAX_TENSORS 16384       /* tensors in one file (a power of two: add_tensor) */
#define TD_ST_NAME_MAX    256         /* bytes of a tensor's name, NUL included */
#define TD_ST_MAX_DIMS    8           /* dimensions of one tensor */
#define TD_ST_MAX_META    64          /* __metadata__ entries kept (later ones are ignored) */
#define TD_ST_META_MAX    256         /* bytes of a metadata key or value kept, NUL included */
#define TD_ST_SUFFIX      ".safetensors"

/* Whether path names a safetensors file: it ends in ".safetensors" (how model.init_from and
 * trainctl export tell the format). */
int td_st_is_path(const char *path);

/* ---- reading ------------------------------------------------------------------------------- */

typedef enum { TD_ST_F32 = 0, TD_ST_F16, TD_ST_BF16, TD_ST_OTHER } td_st_dtype;

/* One tensor as the header declares it. */
typedef struct td_st_tensor {
    char name[TD_ST_NAME_MAX];
    char dtype_name[16]; /* as written: "F32", "BF16", "I64" ... */
    td_st_dtype dtype;   /* TD_ST_OTHER: not a float type traind reads */
    int ndim;
    int64_t shape[TD_ST_MAX_DIMS];
    uint64_t begin, end; /* bytes into the data */
} td_st_tensor;

typedef struct td_st_file td_st_file;

/* Opens path and reads and checks its header (the file's data is read by td_st_read). Errors:
 * TD_ENOTFOUND, TD_EPERM, TD_EIO for the open; TD_EDATA naming the file and what is wrong
 * ("/x/m.safetensors: header: tensor wpe.weight: data_offsets [0, 96) hold 96 bytes, but F32
 * (4, 8) takes 128"); TD_E2BIG past traind's limits: "/x/m.safetensors: safetensors header of
 * N bytes exceeds traind's limit of 16777216", "/x/m.safetensors: safetensors header holds
 * more than 16384 tensors, traind's limit". Caller frees with td_st_close(). */
int td_st_open(td_st_file **out, const char *path, td_error_t *err);
void td_st_close(td_st_file *f); /* accepts NULL */

int td_st_count(const td_st_file *f);
const td_st_tensor *td_st_at(const td_st_file *f, int i);

/* The tensor called name, or NULL. */
const td_st_tensor *td_st_find(const td_st_file *f, const char *name);

/* The __metadata__ value of key, or NULL. */
const char *td_st_meta(const td_st_file *f, const char *key);

/* t's elements as float32 into out (n floats, n = its element count): F32 as is, F16 and BF16
 * widened. transpose: t is 2-D (r, c) and out receives its transpose (c, r). TD_EDATA for
 * another dtype or a short read (the file changed), TD_EINVAL for n not the count; polls the
 * thread's stop callback (data.h). */
int td_st_read(const td_st_file *f, const td_st_tensor *t, float *out, size_t n, int transpose,
               td_error_t *err);

/* ---- writing ------------------------------------------------------------------------------- */

/* One tensor to write: its name and shape in the file, its floats, and whether they are stored
 * transposed here (src is (shape[1], shape[0]) and the file gets its transpose). */
typedef struct td_st_out {
    char name[TD_ST_NAME_MAX];
    int ndim;
    int64_t shape[TD_ST_MAX_DIMS];
    const float *src;
    int transpose;
} td_st_out;

/* Writes the n tensors t as F32, back to back in that order, with the metadata pairs
 * meta[0..2*nmeta) (names and values: printable ASCII without quotes or backslashes), through
 * path.tmp renamed over path when whole. TD_EIO / TD_EDISKFULL naming the file; TD_ENOMEM. */
int td_st_write(const char *path, const td_st_out *t, int n, const char *const *meta, int nmeta,
                td_error_t *err);

/* ---- for messages ------------------------------------------------------------------------- */

/* The path f was opened with. */
const char *td_st_path(const td_st_file *f);

/* A shape as "(4, 8)" into out (size bytes). */
void td_st_shape_str(char *out, size_t size, int ndim, const int64_t *shape);

#endif
