/* A job's sizes (sizes.h): what the trainer allocates by and the memory estimate counts. */
#include <stdint.h>

#include "train/sizes.h"
#include "train/slm.h"
#include "train/weights.h"

int td__train_gpt_dims(const td_train_config *cfg, td_gpt_dims *d, td_error_t *err)
{
    const char *f = cfg->init_from;
    td_gpt_dims fd;
    int rc;

    if (f[0] == '\0') {
        d->maxT = cfg->seq_len;
        d->V = cfg->vocab_size;
        d->Vp = td_gpt_padded_vocab(cfg->vocab_size);
        d->L = cfg->n_layer;
        d->NH = cfg->n_head;
        d->C = cfg->n_embd;
        return td_gpt_check_dims(d, err);
    }
    rc = td_weights_gpt_peek(f, cfg->n_head, &fd, err);
    if (rc != 0)
        return rc;
    if (cfg->n_layer != 0 && cfg->n_layer != fd.L)
        return td_error_set(err, TD_ESHAPE, "model.n_layer: %d in the job but %d in %s",
                            cfg->n_layer, fd.L, f);
    if (cfg->n_head != 0 && cfg->n_head != fd.NH)
        return td_error_set(err, TD_ESHAPE, "model.n_head: %d in the job but %d in %s", cfg->n_head,
                            fd.NH, f);
    if (cfg->n_embd != 0 && cfg->n_embd != fd.C)
        return td_error_set(err, TD_ESHAPE, "model.n_embd: %d in the job but %d in %s", cfg->n_embd,
                            fd.C, f);
    if (cfg->vocab_size != 0 && cfg->vocab_size != fd.V)
        return td_error_set(err, TD_ESHAPE, "model.vocab_size: %d in the job but %d in %s",
                            cfg->vocab_size, fd.V, f);
    if (cfg->seq_len > fd.maxT)
        return td_error_set(err, TD_ESHAPE,
                            "model.seq_len: %d in the job but %s holds %d positions", cfg->seq_len,
                            f, fd.maxT);
    *d = fd;
    return 0;
}

int td__train_local_rows(const td_train_config *cfg, int N)
{
    int r0 = (int)((int64_t)cfg->rank * N / cfg->world);
    int r1 = (int)((int64_t)(cfg->rank + 1) * N / cfg->world);
    return r1 - r0;
}

int td__train_max_rows(const td_train_config *cfg)
{
    return (cfg->batch_size + cfg->world - 1) / cfg->world;
}

size_t td__train_mlp_input_bytes(int N, int pixels)
{
    return td_tensor_bytes((size_t)N * (size_t)pixels, 0) + td_arena_round((size_t)N * sizeof(int));
}

size_t td__train_gpt_input_bytes(int rows, int T)
{
    return 2 * td_arena_round((size_t)rows * (size_t)T * sizeof(int));
}

size_t td__train_mlp_arena_bytes(const td_mlp *m, int rows, int train)
{
    return td__train_mlp_input_bytes(rows, m->sizes[0]) + td_mlp_arena_bytes(m, rows, train);
}

size_t td__train_gpt_arena_bytes(const td_gpt *m, int rows, int T, int train)
{
    return td__train_gpt_input_bytes(rows, T) + td_gpt_arena_bytes(m, rows, T, train);
}

int td__train_slm_dims(const td_train_config *cfg, td_slm_dims *d, td_slm_peek *peek,
                       td_error_t *err)
{
    const td_sensorlm_config *c = &cfg->slm;
    td_slm_peek own;
    int T = c->time_steps, C = c->channels, rc;

    if (peek == NULL && T > 0 && C > 0)
        return td_slm_dims_of(c, T, C, d, err);
    if (peek == NULL)
        peek = &own;
    if ((rc = td__slm_peek(cfg, T, C, peek, err)) != 0)
        return rc;
    if (T <= 0 && (T = peek->T) <= 0)
        return td_error_set(err, TD_EINVAL,
                            "model.sensor.time_steps: not given, and no sensor file to take it "
                            "from");
    if (C <= 0 && (C = peek->C) <= 0)
        return td_error_set(err, TD_EINVAL,
                            "model.sensor.channels: not given, and no sensor file to take it from");
    return td_slm_dims_of(c, T, C, d, err);
}

size_t td__slm_input_bytes(const td_slm_dims *d, int B)
{
    return td_tensor_bytes((size_t)B * d->N * d->P, 0) +
           td_arena_round((size_t)B * d->L * sizeof(int)) + td_arena_round((size_t)B * sizeof(int));
}

size_t td__slm_label_bytes(const td_sensorlm *m, int rows)
{
    return m->mask_same_label ? td_arena_round((size_t)rows * sizeof(int)) : 0;
}

size_t td__train_slm_arena_bytes(const td_sensorlm *m, int B, int rows, int world, int train)
{
    return td__slm_input_bytes(&m->d, B) + td__slm_label_bytes(m, rows) +
           td_sensorlm_arena_bytes(m, B, rows, world, train);
}

size_t td__slm_eval_bytes(const td_sensorlm *m, int B, int64_t nv, int K)
{
    size_t E = (size_t)m->d.E, kept, batch, sims;
    int rows = nv < B ? (int)nv : B;

    if (nv <= 0)
        return 0;
    kept = 2 * td_tensor_bytes((size_t)nv * E, 0) + (K > 0 ? td_tensor_bytes((size_t)K * E, 0) : 0);
    batch = td__slm_input_bytes(&m->d, rows) + td_sensorlm_embed_bytes(m, rows, 1, 1, rows);
    sims = td_tensor_bytes((size_t)rows * (size_t)(nv > K ? nv : K), 0);
    return kept + (batch > sims ? batch : sims);
}

/* llm.c's count (gpt2_estimate_mfu): per token 6 FLOPs per parameter (forward 2, backward 4;
 * its parameter count includes the padded vocabulary rows) plus attention's 6*L*C*T; an mlp 6
 * per parameter per sample. Over the global batch. */
double td_train_flops_per_step(const td_train_config *cfg)
{
    td_error_t e;

    if (cfg->model == TD_MODEL_GPT) {
        td_gpt_dims d;
        double N, T;
        if (td__train_gpt_dims(cfg, &d, &e) != 0)
            return 0.0;
        T = cfg->seq_len > 0 ? cfg->seq_len : d.maxT;
        N = (double)td_gpt_num_params(&d) + (double)(d.Vp - d.V) * d.C;
        return (6.0 * N + 6.0 * d.L * d.C * T) * T * cfg->batch_size;
    }
    if (cfg->model == TD_MODEL_SENSORLM) {
        td_slm_dims d;
        if (td__train_slm_dims(cfg, &d, NULL, &e) != 0)
            return 0.0;
        return td_sensorlm_flops(&d, cfg->batch_size);
    }
    if (cfg->model == TD_MODEL_MLP) {
        double N = 0.0;
        for (int l = 0; l + 1 < cfg->n_layers; l++)
            N += (double)cfg->layers[l] * cfg->layers[l + 1] + cfg->layers[l + 1];
        return 6.0 * N * cfg->batch_size;
    }
    return 0.0;
}
