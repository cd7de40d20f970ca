/* kernels/attn_plan.h - the fused attention's plan: the blocks of (sequence, head, query row)
 * that attention_forward and attention_backward compute one after another, the same on both
 * tables, and what each costs in calls.
 *
 * A block is nb whole sequences (every head of each) by query rows [r0, r0 + rows) against
 * keys [0, cols). Its scores sit dense in the scratch: the pair p = (b - b0) * NH + h at
 * p * rows * cols floats, row-major (rows, cols), and a block takes at most the scratch's
 * block, B * NH * chunk * Nk floats (td_attn_scratch). The CUDA table runs each block's
 * products as one batched cuBLAS call over its nb * NH pairs; the CPU table runs a task per pair.
 *
 * Two ways to cover the (B, Nq) rows, the one with fewer blocks taken (whole sequences on a tie):
 *  - whole sequences: when one sequence's scores, NH * Nq * Nk floats, fit in the block, blocks
 *    of as many whole sequences as fit (all rows each), so each sequence's keys and values are
 *    read once a pass;
 *  - rows of every sequence: blocks of all B sequences by `chunk` rows; a causal block takes
 *    more rows while it sees fewer keys: the most rows with rows * (r0 + rows) <= chunk * Nk
 *    (never fewer than chunk, which fits), rounded down to a multiple of TD_ATTN_ALIGN when
 *    that leaves at least chunk (so with a chunk that is a multiple of 64, the CPU's 64-row
 *    sgemms start where they did when every block was `chunk` rows).
 *
 * Pure functions of the dimensions: any thread, no state. */
#ifndef TD_ATTN_PLAN_H
#define TD_ATTN_PLAN_H

#include <stddef.h>

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A causal rows block's rows are a multiple of this when they are at least this many. */
#define TD_ATTN_ALIGN 64

typedef struct td_attn_block {
    int b0, nb;   /* sequences [b0, b0 + nb), every head of each */
    int r0, rows; /* query rows [r0, r0 + rows) of each */
    int cols;     /* keys [0, cols): r0 + rows when causal, else Nk */
    int by_seq;   /* 1: whole sequences, 0: rows of every sequence (the plan's choice) */
    int index;    /* 0 for the first block, then 1, 2, ... */
} td_attn_block;

/* The next block of d's plan after *k (a zeroed *k asks for the first): 1 and *k set, or 0
 * when the plan is done (at once when B, NH, Nq or Nk is 0). d->chunk must be >= 1. */
int td_attn_next(const td_attn_dims *d, td_attn_block *k);

/* Whether d's plan takes whole sequences (td_attn_block's by_seq of its first block). A causal
 * plan in rows of every sequence is the one whose first block does not see every key: a
 * backward storing dk or dv (kernels.h's store) zeroes their head columns first there. */
int td_attn_by_seq(const td_attn_dims *d);

/* What one forward and one backward (every gradient asked for and stored, as the engine's
 * first writer asks) of d issue. */
typedef struct td_attn_calls {
    int blocks;          /* blocks of the plan */
    int by_seq;          /* the plan's way (td_attn_block's) */
    int gemms_fwd;       /* cuBLAS calls of attention_forward: 2 a block (scores, P v) */
    int gemms_bwd;       /* of attention_backward: 5 a block (scores, dout v^T, dv, dq, dk) */
    int kernels_fwd;     /* other launches: a block's pointer arrays and its softmax */
    int kernels_bwd;     /* D once, then a block's pointer arrays and its scores' gradient;
                          * 2 more zeroing dk and dv when causal in rows of every sequence */
    int kv_reads;        /* blocks that read one sequence's keys and values (the most of any) */
    int min_rows;        /* the fewest query rows in a block (its sgemms' smallest side) */
    size_t block_floats; /* the largest block's scores: nb * NH * rows * cols */
} td_attn_calls;

/* Walks d's plan with td_attn_next, as the kernels do, and counts. */
void td_attn_plan(const td_attn_dims *d, td_attn_calls *c);

#ifdef __cplusplus
}
#endif

#endif
