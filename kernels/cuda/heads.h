/* Inside the CUDA backend: heads.cu's ops (kernels.h's token_mean ... siglip), the CUDA twins of
 * cpu_heads.c, which ops.cu puts in the table. Same arguments and semantics as kernels.h, every
 * pointer device memory; they run on the calling thread's context (td__cuda_ctx) and panic on a
 * CUDA error as the other ops do. */
#ifndef TD_CUDA_HEADS_H
#define TD_CUDA_HEADS_H

#ifdef __cplusplus
extern "C" {
#endif

void td__cuda_token_mean_forward(float *out, const float *inp, int B, int N, int C);
void td__cuda_token_mean_backward(float *dinp, const float *dout, int B, int N, int C);
void td__cuda_gather_rows_forward(float *out, const float *inp, const int *idx, int B, int T,
                                  int C);
void td__cuda_gather_rows_backward(float *dinp, const float *dout, const int *idx, int B, int T,
                                   int C);
void td__cuda_l2norm_forward(float *out, float *norm, const float *inp, int N, int C);
void td__cuda_l2norm_backward(float *dinp, const float *dout, const float *out, const float *norm,
                              int N, int C);
void td__cuda_siglip_forward(float *loss, const float *dots, const float *t, const float *b,
                             const int *labels, float same, int N, int M, int diag, float weight);
void td__cuda_siglip_backward(float *ddots, float *dt, float *db, const float *dloss,
                              const float *dots, const float *t, const float *b, const int *labels,
                              float same, int N, int M, int diag, float weight);

#ifdef __cplusplus
}
#endif

#endif
