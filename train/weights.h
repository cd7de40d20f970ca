/* A model's weights in files: the one place that knows which tensor of a file format is which
 * parameter of a model. The formats (llmc.h, safetensors.h) only read and write tensors; here
 * each model gives its parameters as one list of named tensors, and every load, check and save
 * of either format goes through that list:
 *
 *   - gpt, llm.c's model file: the 16 tensors of td_params in llm.c's order (the file is the
 *     flat buffer without the alignment padding);
 *   - gpt, safetensors: Hugging Face GPT-2's names (wte.weight (V, C) without the padded
 *     vocabulary rows, wpe.weight, h.N.ln_1.*, h.N.attn.c_attn.* (Conv1D: weights (in, out),
 *     the transpose of traind's (out, in)), h.N.attn.c_proj.*, h.N.ln_2.*, h.N.mlp.c_fc.*,
 *     h.N.mlp.c_proj.*, ln_f.*), read plain or under "transformer." (GPT2LMHeadModel's files);
 *     metadata format "pt", traind.model "gpt", n_layer, n_head, n_embd, n_positions,
 *     vocab_size, step;
 *   - sensorlm, safetensors: the README's parameter names and shapes as they are, then
 *     norm.mean and norm.std (C each: the statistics windows are normalised with); metadata
 *     format "pt", traind.model "sensorlm", the dimensions and step;
 *   - mlp: no list; neither format carries an mlp.
 *
 * Files are opened as data.h's access says (the job's user; only a regular file). Blocking
 * file I/O on the caller's thread (a worker building a trainer, the daemon's threadpool for an
 * export, the loop thread's submit check for a header); errors are returned, never panicked. */
#ifndef TD_WEIGHTS_H
#define TD_WEIGHTS_H

#include <stdint.h>

#include "train/engine.h"

/* A gpt's dimensions from path: a safetensors file (its name ends in .safetensors) or else an
 * llm.c model file. safetensors: V and C from wte.weight, maxT from wpe.weight, L from the h.N
 * blocks, NH from the metadata's n_head, else n_head (the job's; 0: none, which is an error);
 * every tensor the model needs must be there with its shape (TD_EDATA naming the tensor and
 * both shapes: "h.1.mlp.c_fc.weight: (64, 200) in the file, the model needs (64, 256)"); others
 * (lm_head.weight, tied to wte; attention mask buffers) are ignored. llm.c: the header's
 * magic, version, the dimensions against the engine's limits and the file's size against them
 * (TD_EDATA naming the file and which was wrong). TD_ENOTFOUND, TD_EPERM, TD_EIO for the
 * open. */
int td_weights_gpt_peek(const char *path, int n_head, td_gpt_dims *d, td_error_t *err);

/* Reads path (either format, as td_weights_gpt_peek tells) into m, whose dimensions must be the
 * file's: safetensors' transposed weights turned back, wte's padded rows set to 0. Errors as
 * td_weights_gpt_peek, plus TD_ESHAPE when m's dimensions differ. */
int td_weights_gpt_load(const char *path, td_gpt *m, td_error_t *err);

/* Writes m as an llm.c model file (version 3, fp32), or as safetensors with step in its
 * metadata, each through path.tmp renamed over path when whole. TD_EIO / TD_EDISKFULL naming
 * the file. */
int td_weights_gpt_save_llmc(const char *path, const td_gpt *m, td_error_t *err);
int td_weights_gpt_save_st(const char *path, const td_gpt *m, int64_t step, td_error_t *err);

/* Checks that the safetensors file path holds every parameter of m (declared:
 * td_sensorlm_declare; data not needed) under its name with its shape: TD_ESHAPE naming the
 * tensor and both shapes ("sensor.patch.weight: (64, 20) in the file, the job's model has (64,
 * 40)"), TD_EDATA for one missing or of a dtype traind does not read. norm.* and other extra
 * tensors are ignored. */
int td_weights_slm_check(const char *path, const td_sensorlm *m, td_error_t *err);

/* td_weights_slm_check, then reads every parameter into m (allocated: td_params_alloc). */
int td_weights_slm_load(const char *path, td_sensorlm *m, td_error_t *err);

/* Writes an mlp as safetensors: layers.N.weight (out, in) and layers.N.bias for each Linear
 * N, with metadata format "pt", traind.model "mlp", layers ("784,256,10"), activation "relu",
 * input.scale (1/255 as %.17g: the pixels' bytes times it are the inputs), input.offset "0"
 * and step. */
int td_weights_mlp_save_st(const char *path, const td_mlp *m, int64_t step, td_error_t *err);

/* Writes m with its statistics norm (2*C floats: the means, then the stds) and step as
 * safetensors, as td_weights_gpt_save_st. */
int td_weights_slm_save_st(const char *path, const td_sensorlm *m, const float *norm, int64_t step,
                           td_error_t *err);

#endif
