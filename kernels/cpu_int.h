/* Inside the CPU backend: the ops of kernels.h that live in files of their own beside cpu.c,
 * which puts them in its table. Same conventions as kernels.h (outputs, inputs, dimensions;
 * backward kernels accumulate); host memory. Any thread. */
#ifndef TD_CPU_INT_H
#define TD_CPU_INT_H

#include "kernels/kernels.h"

/* cpu_heads.c: a two-tower model's heads (kernels.h's token_mean ... siglip). Single-threaded:
 * they touch B rows of embeddings or one (B,N,C) activation once, next to a step's matmuls. */
void td__cpu_token_mean_forward(float *out, const float *inp, int B, int N, int C);
void td__cpu_token_mean_backward(float *dinp, const float *dout, int B, int N, int C);
void td__cpu_gather_rows_forward(float *out, const float *inp, const int *idx, int B, int T, int C);
void td__cpu_gather_rows_backward(float *dinp, const float *dout, const int *idx, int B, int T,
                                  int C);
void td__cpu_l2norm_forward(float *out, float *norm, const float *inp, int N, int C);
void td__cpu_l2norm_backward(float *dinp, const float *dout, const float *out, const float *norm,
                             int N, int C);
void td__cpu_siglip_forward(float *loss, const float *dots, const float *t, const float *b,
                            const int *labels, float same, int N, int M, int diag, float weight);
void td__cpu_siglip_backward(float *ddots, float *dt, float *db, const float *dloss,
                             const float *dots, const float *t, const float *b, const int *labels,
                             float same, int N, int M, int diag, float weight);

#endif
