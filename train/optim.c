/* Optimizers over the flat buffers of td_params: one kernel call per tensor (AdamW, so that
 * decay follows p->decay) or for the whole buffer (SGD), and the gradient's global norm for
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

double td_grad_norm(const td_kernels *k, const td_params *p, double *sumsq)
{
    double ss = 0.0;

    k->sumsq(sumsq, p->grad, p->n);
    k->download(&ss, sumsq, sizeof(ss));
    return sqrt(ss);
}
