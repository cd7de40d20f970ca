/* The CPU twins of kernels.h's two-tower heads (sensorlm): the mean over tokens, one row of
 * each sequence, rows scaled to unit length, and SigLIP's sigmoid loss with its learned scale
 * and bias. Plain loops on the calling thread: each touches a few rows of embeddings, or one
 * activation once, beside a step's matmuls. The sums are in a fixed order (and the long ones in
 * double), which cuda/heads.cu repeats where it can, so that token_mean, gather_rows and l2norm
 * give the same bits on both. Owns nothing; any thread. */
#include <math.h>
#include <string.h>

#include "kernels/cpu_int.h"

void td__cpu_token_mean_forward(float *out, const float *inp, int B, int N, int C)
{
    float inv = 1.0f / (float)N;

    for (int b = 0; b < B; b++) {
        float *o = out + (size_t)b * C;
        memset(o, 0, (size_t)C * sizeof(float));
        for (int n = 0; n < N; n++) {
            const float *x = inp + ((size_t)b * N + n) * C;
            for (int c = 0; c < C; c++)
                o[c] += x[c];
        }
        for (int c = 0; c < C; c++)
            o[c] *= inv;
    }
}

void td__cpu_token_mean_backward(float *dinp, const float *dout, int B, int N, int C)
{
    float inv = 1.0f / (float)N;

    for (int b = 0; b < B; b++)
        for (int n = 0; n < N; n++) {
            float *d = dinp + ((size_t)b * N + n) * C;
            const float *g = dout + (size_t)b * C;
            for (int c = 0; c < C; c++)
                d[c] += g[c] * inv;
        }
}

void td__cpu_gather_rows_forward(float *out, const float *inp, const int *idx, int B, int T, int C)
{
    for (int b = 0; b < B; b++)
        memcpy(out + (size_t)b * C, inp + ((size_t)b * T + idx[b]) * C, (size_t)C * sizeof(float));
}

void td__cpu_gather_rows_backward(float *dinp, const float *dout, const int *idx, int B, int T,
                                  int C)
{
    for (int b = 0; b < B; b++) {
        float *d = dinp + ((size_t)b * T + idx[b]) * C;
        const float *g = dout + (size_t)b * C;
        for (int c = 0; c < C; c++)
            d[c] += g[c];
    }
}

void td__cpu_l2norm_forward(float *out, float *norm, const float *inp, int N, int C)
{
    for (int i = 0; i < N; i++) {
        const float *x = inp + (size_t)i * C;
        float *o = out + (size_t)i * C, nrm;
        double ss = 0.0;
        for (int c = 0; c < C; c++)
            ss += (double)x[c] * x[c];
        nrm = (float)sqrt(ss);
        nrm = nrm > TD_L2NORM_EPS ? nrm : TD_L2NORM_EPS;
        norm[i] = nrm;
        for (int c = 0; c < C; c++)
            o[c] = x[c] / nrm;
    }
}

void td__cpu_l2norm_backward(float *dinp, const float *dout, const float *out, const float *norm,
                             int N, int C)
{
    for (int i = 0; i < N; i++) {
        const float *g = dout + (size_t)i * C, *o = out + (size_t)i * C;
        float *d = dinp + (size_t)i * C, nrm = norm[i], dot;
        double acc = 0.0;
        if (!(nrm > TD_L2NORM_EPS)) { /* clamped: out = inp / eps, a constant scale */
            for (int c = 0; c < C; c++)
                d[c] += g[c] / nrm;
            continue;
        }
        for (int c = 0; c < C; c++)
            acc += (double)g[c] * o[c];
        dot = (float)acc;
        for (int c = 0; c < C; c++)
            d[c] += (g[c] - o[c] * dot) / nrm;
    }
}

/* -log sigmoid(yz) = max(-yz, 0) + log1p(exp(-|yz|)): no overflow for any yz. */
static float neg_log_sigmoid(float yz)
{
    return fmaxf(-yz, 0.0f) + log1pf(expf(-fabsf(yz)));
}

/* sigmoid(-yz) without overflow: exp of a non-positive number only. */
static float sigmoid_neg(float yz)
{
    float e = expf(-fabsf(yz));

    return yz >= 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

/* Whether pair (i, j) is a negative (j != i + diag) between two rows of one known label, when
 * there are labels: its m_ij is same (kernels.h), 0 leaving it out. */
static int same_label(const int *labels, int i, int j, int diag)
{
    return labels != NULL && j != i + diag && labels[i + diag] >= 0 &&
           labels[j] == labels[i + diag];
}

void td__cpu_siglip_forward(float *loss, const float *dots, const float *t, const float *b,
                            const int *labels, float same, int N, int M, int diag, float weight)
{
    float et = expf(t[0]), bias = b[0];
    double sum = 0.0;

    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            float z = et * dots[(size_t)i * M + j] + bias;
            if (!same_label(labels, i, j, diag))
                sum += neg_log_sigmoid(j == i + diag ? z : -z);
            else if (same != 0.0f)
                sum += (double)same * neg_log_sigmoid(-z);
        }
    loss[0] = (float)((double)weight * sum);
}

void td__cpu_siglip_backward(float *ddots, float *dt, float *db, const float *dloss,
                             const float *dots, const float *t, const float *b, const int *labels,
                             float same, int N, int M, int diag, float weight)
{
    float et = expf(t[0]), bias = b[0], scale = dloss[0] * weight;
    double st = 0.0, sb = 0.0;

    for (int i = 0; i < N; i++)
        for (int j = 0; j < M; j++) {
            size_t k = (size_t)i * M + j;
            float z = et * dots[k] + bias, y = j == i + diag ? 1.0f : -1.0f;
            float g = -scale * y * sigmoid_neg(y * z); /* dL/dz */
            if (same_label(labels, i, j, diag)) {
                if (same == 0.0f)
                    continue;
                g *= same;
            }
            if (ddots != NULL)
                ddots[k] += et * g;
            st += (double)(et * dots[k]) * g;
            sb += g;
        }
    if (dt != NULL)
        dt[0] += (float)st;
    if (db != NULL)
        db[0] += (float)sb;
}
