/* The MLP classifier: Linear layers with ReLU between them, the last Linear giving logits,
 * softmax cross-entropy on top. Written as a forward pass only; its backward is whatever the
 * ops recorded on the tape. Parameters live in the trainer's td_params. */
#include <math.h>

#include "train/engine.h"

int td_mlp_declare(td_mlp *m, td_params *p, const int *sizes, int n_sizes)
{
    int rc = 0;

    if (n_sizes < 2 || n_sizes > TD_MAX_LAYERS)
        return TD_EINVAL;
    m->n_sizes = n_sizes;
    for (int l = 0; l < n_sizes; l++) {
        if (sizes[l] < 1)
            return TD_EINVAL;
        m->sizes[l] = sizes[l];
    }
    for (int l = 0; l + 1 < n_sizes && rc == 0; l++) {
        rc = td_params_declare(p, &m->w[l], 2, (int[]){sizes[l + 1], sizes[l]});
        if (rc == 0)
            rc = td_params_declare(p, &m->b[l], 1, (int[]){sizes[l + 1]});
    }
    return rc;
}

/* Layer by layer, weights then bias, from one stream: the same seed gives the same model. */
void td_mlp_init(td_mlp *m, uint64_t seed)
{
    td_rng rng;

    td_rng_seed(&rng, seed, 1);
    for (int l = 0; l + 1 < m->n_sizes; l++) {
        float bound = 1.0f / sqrtf((float)m->sizes[l]);
        td_tensor *t[2] = {&m->w[l], &m->b[l]};
        for (int j = 0; j < 2; j++)
            for (size_t i = 0; i < t[j]->n; i++)
                t[j]->data[i] = bound * (2.0f * td_rng_uniform(&rng) - 1.0f);
    }
}

td_tensor *td_mlp_forward(td_ctx *c, td_mlp *m, td_tensor *x, const int *targets,
                          td_tensor **logits)
{
    int layers = m->n_sizes - 1;
    td_tensor *h = x;

    for (int l = 0; l < layers; l++) {
        h = td_linear(c, h, &m->w[l], &m->b[l]);
        if (l + 1 < layers)
            h = td_relu(c, h);
    }
    if (logits != NULL)
        *logits = h;
    return td_softmax_xent(c, h, targets);
}

/* Mirrors td_mlp_forward's allocations one for one: a linear output and a relu output per
 * hidden layer, the logits, then softmax's probs (no gradient) and the loss. */
size_t td_mlp_arena_bytes(const td_mlp *m, int N, int train)
{
    int layers = m->n_sizes - 1;
    size_t bytes = 0;

    for (int l = 0; l < layers; l++) {
        size_t n = (size_t)N * (size_t)m->sizes[l + 1];
        bytes += td_tensor_bytes(n, train);
        if (l + 1 < layers)
            bytes += td_tensor_bytes(n, train);
    }
    bytes += td_op_bytes_softmax_xent((size_t)N, m->sizes[layers], train); /* probs: train only */
    return bytes;
}

int td_mlp_tape_len(const td_mlp *m)
{
    return 2 * (m->n_sizes - 1);
}
