/* bench_gpu --profile's instrument: a backend table (kernels.h) that forwards every op to the
 * CUDA table and brackets it with a pair of CUDA events on the context's stream, filed under
 * the op's class of work (matmuls, attention forward, ...). The trainer runs on it unchanged;
 * after a step the pairs are read back and summed per class. Events time what the GPU spent
 * between them, so a class's time is its kernels' and cuBLAS's, and what is left of the step's
 * span is the GPU idle between ops (the host's launches and waits). The events cost the host a
 * few microseconds each, so the profiled steps run a little slower than the plain ones: the
 * report gives both. One thread (the bench's); only in builds with CUDA. */
#ifndef TD_BENCH_GPU_PROFILE_H
#define TD_BENCH_GPU_PROFILE_H

#include <stdint.h>

#include "kernels/kernels.h"
#include "kernels/cuda/td_cuda.h"

/* The classes of work a step is split into. */
typedef enum {
    GP_MATMUL = 0,
    GP_ATTN_FWD,
    GP_ATTN_BWD,
    GP_LAYERNORM,
    GP_GELU,
    GP_RESIDUAL,
    GP_CLASSIFIER, /* the lm head's softmax and cross-entropy, argmax */
    GP_ENCODER,    /* token and position embeddings */
    GP_HEADS,      /* sensorlm: pooling, row gathers, l2 norms, the SigLIP loss */
    GP_OPTIM,      /* AdamW (or SGD), and the gradient norm and clip (sumsq, scale) */
    GP_MEMSET,     /* zero */
    GP_COPY,       /* upload and download: the host syncs of a step */
    GP_OTHER,      /* bias, relu */
    GP_NCLASSES
} gp_class;

/* One step as the profile saw it. */
typedef struct gp_step {
    double ms[GP_NCLASSES]; /* GPU time of each class, ms */
    int calls[GP_NCLASSES]; /* ops of each class */
    double span_ms;         /* GPU time from the step's first event to its last */
    double wall_ms;         /* host wall clock of the step */
    double wait_ms;         /* host time spent in upload and download (waiting for the GPU) */
    td_cuda_counts counts;  /* launches, cuBLAS calls, memsets, copies, syncs of the step */
    int dropped;            /* ops past the event pool, not timed (0 unless a step is huge) */
} gp_step;

/* The wrapping table, on the calling thread's CUDA context (bound, as the trainer needs it).
 * Creates the event pool on first use; td_panic on a CUDA error. Not timing until
 * gp_step_begin: outside a step it forwards only. Static; never NULL. */
const td_kernels *gp_table(void);

/* Brackets one step: begin records the step's first event and starts filing ops; end records
 * the last, waits for it, and fills *out. td_panic on a CUDA error. */
void gp_step_begin(void);
void gp_step_end(gp_step *out);

/* The class names, for the report: "matmuls", "attention fwd", ... */
const char *gp_class_name(gp_class c);

/* Prints the profile of n steps (the median of each figure over them), with plain_ms the
 * median wall time of the same step unprofiled, flops the FLOPs of one step, tokens its
 * tokens (or samples), peak the device's dense peak FLOP/s at the precision (0: unknown) and
 * gemm_tflops cuBLAS's own bf16 GEMM in this run (0: not measured). The block starts with a
 * line "profile: title"; the caller ends it with an empty line. */
void gp_report(const char *title, const gp_step *steps, int n, double plain_ms, double flops,
               double tokens, const char *unit, double peak, double gemm_tflops);

#endif
