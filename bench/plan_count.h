/* bench_gpu --plan's counting table (plan_count.c): a device backend whose ops compute nothing
 * and count, so a real step of the engine (train/engine.c) over a real model's shapes runs on
 * a machine without a GPU, in no time and without touching its memory, and says what the table
 * was asked to do: calls by op, the memsets and their bytes, the activation gradients the
 * backward kernels stored (written) and added into (read and written). One thread. */
#ifndef TD_BENCH_PLAN_COUNT_H
#define TD_BENCH_PLAN_COUNT_H

#include <stddef.h>

#include "kernels/kernels.h"

typedef struct pc_counts {
    long calls;       /* table calls of compute ops (not alloc, free, copies) */
    long zero_calls;  /* memsets (zero) */
    double zero_b;    /* their bytes */
    long stored;      /* gradient outputs of the five store-capable kernels, stored ... */
    double stored_b;  /* ... their bytes */
    long added;       /* ... and added into */
    double added_b;   /* ... their bytes */
    long passthrough; /* residual backwards with no first gradient: passed through */
    long syncs;       /* downloads and uploads, each of which waits for the device */
    long copies;      /* asynchronous uploads (no wait) */
} pc_counts;

/* The table: alloc maps address space that is never touched (no memory is committed), every op
 * counts into the counts pc_reset() cleared; a download writes zeros (a loss and a norm of 0,
 * so a trainer runs on it), an upload copies nothing. */
const td_kernels *pc_table(void);
void pc_reset(void);
pc_counts pc_get(void);

#endif
