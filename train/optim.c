/* Optimizers over the flat buffers of td_params: one kernel call per tensor (AdamW, so that
 * decay follows p->decay) or for the whole buffer (SGD, and AdamW through adamw_flat with the
 * tensors as spans and the clip's factor on the backend), and the gradient's global norm for
 * clipping. Called by the trainer's step. The schedules are in schedule.c. */
#include <math.h>

#include "train/engine.h"

int td_optim_moments(const td_train_config *cfg)
{
    switch (cfg->optim) {
    case TD_OPTIM_ADAMW:
        return 2;
    case TD_OPTIM_SGD:
        return cfg->momentum != 0.0f ? 1 : 0;
    }
    return 0;
}

/* AdamW runs tensor by tensor over its own elements (the padding between tensors stays zero
 * whatever the decay), with weight_decay where p->decay says and 0 elsewhere. */
void td_optim_step(const td_kernels *k, td_params *p, const td_train_config *cfg, float lr,
                   int64_t t)
{
    switch (cfg->optim) {
    case TD_OPTIM_ADAMW:
        for (int i = 0; i < p->count; i++) {
            size_t o = p->offset[i];
            k->adamw_update(p->data + o, p->m + o, p->v + o, p->grad + o, p->tensors[i]->n, lr,
                            cfg->beta1, cfg->beta2, cfg->eps,
                            p->decay[i] ? cfg->weight_decay : 0.0f, t);
        }
        break;
    case TD_OPTIM_SGD:
        k->sgd_update(p->data, p->m, p->grad, p->n, lr, cfg->momentum, cfg->weight_decay);
        break;
    }
}

int td_optim_spans(const td_kernels *k, const td_params *p, td_adamw_span **spans, td_error_t *err)
{
    td_adamw_span host[TD_PARAMS_MAX];
    size_t bytes = (size_t)(p->count > 0 ? p->count : 1) * sizeof(host[0]);
    void *dev = NULL;
    int rc;

    *spans = NULL;
    for (int i = 0; i < p->count; i++)
        host[i] = (td_adamw_span){
            .offset = p->offset[i], .n = p->tensors[i]->n, .decay = p->decay[i] ? 1u : 0u};
    rc = k->alloc(&dev, bytes, err);
    if (rc != 0)
        return rc;
    if (p->count > 0)
        k->upload(dev, host, (size_t)p->count * sizeof(host[0]));
    *spans = dev;
    return 0;
}

void td_optim_step_flat(const td_kernels *k, td_params *p, const td_train_config *cfg,
                        const td_adamw_span *spans, const float *scale, float lr, int64_t t)
{
    switch (cfg->optim) {
    case TD_OPTIM_ADAMW:
        k->adamw_flat(p->data, p->m, p->v, p->grad, p->n, spans, p->count, scale, lr, cfg->beta1,
                      cfg->beta2, cfg->eps, cfg->weight_decay, t);
        break;
    case TD_OPTIM_SGD:
        k->sgd_flat(p->data, p->m, p->grad, p->n, scale, lr, cfg->momentum, cfg->weight_decay);
        break;
    }
}

int td_optim_has_flat(const td_kernels *k, const td_train_config *cfg)
{
    if (k->clip_scale == NULL)
        return 0;
    return cfg->optim == TD_OPTIM_ADAMW ? k->adamw_flat != NULL : k->sgd_flat != NULL;
}

double td_grad_norm(const td_kernels *k, const td_params *p, double *sumsq)
{
    double ss = 0.0;

    k->sumsq(sumsq, p->grad, p->n);
    k->download(&ss, sumsq, sizeof(ss));
    return sqrt(ss);
}
