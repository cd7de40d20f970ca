/* safetensors files: a model's parameters under names, for other frameworks to load and for a
 * job's model.init_from to start from. The format (Hugging Face's): an 8-byte little-endian
 * header length N, N bytes of a JSON object mapping each tensor's name to {"dtype", "shape",
 * "data_offsets": [begin, end)} (offsets into the data that follows the header) plus an
 * optional "__metadata__" object of strings, then the tensors' little-endian bytes, back to
 * back, covering the data exactly. README.md ("Using a trained model") fixes the names traind
 * writes:
 *
 *   - gpt: Hugging Face GPT-2's (GPT2Model's state dict): wte.weight (V, C) with the padded
 *     vocabulary rows left out, wpe.weight, h.N.ln_1.*, h.N.attn.c_attn.* (Conv1D: weights
 *     (in, out), the transpose of traind's (out, in)), h.N.attn.c_proj.*, h.N.ln_2.*,
 *     h.N.mlp.c_fc.*, h.N.mlp.c_proj.*, ln_f.*; metadata format "pt" (what transformers'
 *     loader asks for), traind.model "gpt", n_layer, n_head, n_embd, n_positions, vocab_size,
 *     step.
 *   - sensorlm: the README's parameter names and shapes as they are, then norm.mean and
 *     norm.std (C each: the statistics windows are normalised with); metadata format "pt",
 *     traind.model "sensorlm", the dimensions and step.
 *
 * Reading is checked before anything is sized from the file's numbers: the header's length
 * against TD_ST_MAX_HEADER and the file's size, each tensor's dtype, shape and offsets against
 * the data (no overlap, no hole, nothing past the end). Files are opened as data.h's access
 * says (the job's user; only a regular file). Blocking file I/O on the caller's thread (a
 * worker building a trainer, the daemon's threadpool for an export, the loop thread's submit
 * check for a header); errors are returned, never panicked. */
#ifndef TD_SAFETENSORS_H
#define TD_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "td_errno.h"
#include "train.h"

/* engine.h's models, for the functions train/ itself calls (the daemon sees only train.h's
 * types and td_export_safetensors). */
struct td_gpt;
struct td_gpt_dims;
struct td_sensorlm;

#define TD_ST_MAX_HEADER  (100u << 20) /* bytes of JSON header: the format's own limit */
#define TD_ST_MAX_TENSORS 65536        /* tensors in one file */
#define TD_ST_NAME_MAX    256          /* bytes of a tensor's name, NUL included */
#define TD_ST_MAX_DIMS    8            /* dimensions of one tensor */
#define TD_ST_MAX_META    64           /* __metadata__ entries kept (later ones are ignored) */
#define TD_ST_META_MAX    256          /* bytes of a metadata key or value kept, NUL included */
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
 * (4, 8) takes 128"). Caller frees with td_st_close(). */
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

/* ---- models ------------------------------------------------------------------------------- */

/* Writes the latest checkpoint of the gpt or sensorlm job cfg (cfg->checkpoint_dir) to out_path
 * as safetensors, names and metadata as above, through out_path.tmp renamed when whole.
 * TD_ENOTFOUND without a checkpoint; TD_EINVAL for an mlp job; TD_ESTATE for a checkpoint of
 * another configuration; TD_EIO / TD_EDISKFULL naming the file. */
int td_export_safetensors(const td_train_config *cfg, const char *out_path, td_error_t *err);

/* A gpt's dimensions from a safetensors file's shapes: V and C from wte.weight, maxT from
 * wpe.weight, L from the h.N blocks, NH from the metadata's n_head, else n_head (the job's;
 * 0: none, which is an error). Every tensor the model needs must be there with its shape, each
 * name plain or under "transformer." (Hugging Face GPT2LMHeadModel's files); others
 * (lm_head.weight, tied to wte; attention mask buffers) are ignored. TD_EDATA naming the
 * tensor and both shapes ("h.1.mlp.c_fc.weight: (64, 200) in the file, the model needs (64,
 * 256)"), or the open's errors. */
int td_st_gpt_peek(const char *path, int n_head, struct td_gpt_dims *d, td_error_t *err);

/* Reads path's tensors into m, whose dimensions must be the file's (td_st_gpt_peek with m's
 * n_head): the transposed weights turned back, wte's padded rows set to 0. Errors as
 * td_st_gpt_peek, TD_ESHAPE when the dimensions differ. */
int td_st_gpt_load(const char *path, struct td_gpt *m, td_error_t *err);

/* Checks that path holds every parameter of m (declared: td_sensorlm_declare; data not needed)
 * under its name with its shape: TD_ESHAPE naming the tensor and both shapes
 * ("sensor.patch.weight: (64, 20) in the file, the job's model has (64, 40)"), TD_EDATA for
 * one missing or of a dtype traind does not read. norm.* and other extra tensors are ignored. */
int td_st_slm_check(const char *path, const struct td_sensorlm *m, td_error_t *err);

/* td_st_slm_check, then reads every parameter into m (allocated: td_params_alloc). */
int td_st_slm_load(const char *path, struct td_sensorlm *m, td_error_t *err);

#endif
