/* Optimizers and learning-rate schedules over the flat buffers of td_params: one kernel call
 * updates every parameter of the model. Called by the trainer's step. */
#include "engine.h"

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

void td_optim_step(const td_kernels *k, td_params *p, const td_train_config *cfg, float lr,
                   int64_t t)
{
    switch (cfg->optim) {
    case TD_OPTIM_ADAMW:
        k->adamw_update(p->data, p->m, p->v, p->grad, p->n, lr, cfg->beta1, cfg->beta2, cfg->eps,
                        cfg->weight_decay, t);
        break;
    case TD_OPTIM_SGD:
        k->sgd_update(p->data, p->m, p->grad, p->n, lr, cfg->momentum, cfg->weight_decay);
        break;
    }
}

/* Constant is the only schedule so far; warmup and cosine will switch on cfg->schedule. */
float td_schedule_lr(const td_train_config *cfg, int64_t t)
{
    (void)t;
    return cfg->lr;
}
