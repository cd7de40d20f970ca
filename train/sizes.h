/* A job's sizes: the one home of the numbers the trainer allocates by and the memory estimate
 * counts (train.h td_train_memory_estimate), so that the two cannot drift apart: the gpt's
 * dimensions, the rows each replica computes of a batch, the arena bytes of a batch's inputs
 * and of a whole step, and the FLOPs of a step (train.h td_train_flops_per_step). trainer.c
 * and memest.c both call these and neither calls the other. Internal to train/; pure; any
 * thread. */
#ifndef TD_SIZES_H
#define TD_SIZES_H

#include <stddef.h>

#include "train/engine.h"

#define TD_MLP_EVAL_BATCH                                                                  \
    1000                  /* samples per forward when evaluating an mlp, at most (no tape, \
                           * so bigger is cheap) */
#define TD_TEXT_VOCAB 256 /* tokens of text data: bytes */

/* A gpt job's dimensions: the job's, or init_from's (its header only is read) where the job's
 * (when given) agree; seq_len may be shorter than the file's positions. TD_ESHAPE naming the
 * key that disagrees, init_from's read errors, td_gpt_check_dims's. */
int td__train_gpt_dims(const td_train_config *cfg, td_gpt_dims *d, td_error_t *err);

/* Rows replica cfg->rank computes of a global batch of N: [rank*N/world, (rank+1)*N/world). */
int td__train_local_rows(const td_train_config *cfg, int N);

/* The largest slice of a full batch any replica takes: the step's arena is sized for it. */
int td__train_max_rows(const td_train_config *cfg);

/* Arena bytes of one batch's inputs: an mlp's N samples of pixels floats and their int
 * targets; a gpt's rows sequences of T int tokens and T int targets. */
size_t td__train_mlp_input_bytes(int N, int pixels);
size_t td__train_gpt_input_bytes(int rows, int T);

/* Arena bytes of one forward of rows (with its backward's gradients and scratch when train is
 * set): the batch's inputs plus the model's own count (td_mlp_arena_bytes, td_gpt_arena_bytes).
 * The trainer sizes its arena with the larger of a training step and an evaluation. */
size_t td__train_mlp_arena_bytes(const td_mlp *m, int rows, int train);
size_t td__train_gpt_arena_bytes(const td_gpt *m, int rows, int T, int train);

/* A sensorlm job's dimensions (engine.h td_slm_dims): its keys over its preset, with T and C
 * the job's or, where it gives none, the first train shard's (its header read as data.h's
 * access says); the whole data's headers into *peek when not NULL (and then always read).
 * Errors: td_slm_dims_of's naming the key, the files' (slm.h td__slm_peek). */
struct td_slm_peek;
int td__train_slm_dims(const td_train_config *cfg, td_slm_dims *d, struct td_slm_peek *peek,
                       td_error_t *err);

/* Arena bytes of a sensorlm training step of B rows (of a global batch of rows, over world
 * replicas): the batch's inputs (with m->mask_same_label, the labels of all rows of the global
 * batch too: td__slm_label_bytes, 0 without) plus td_sensorlm_arena_bytes. */
size_t td__train_slm_arena_bytes(const td_sensorlm *m, int B, int rows, int world, int train);
size_t td__slm_label_bytes(const td_sensorlm *m, int rows);

#endif
