/* Learning-rate schedules by step (train.h's td_sched_kind). Pure functions of the config, the
 * step and the job's total steps, computed in double and rounded once to float, so a resumed
 * job gets the same rates as one never stopped. Called by the trainer's step.
 *
 * With total steps N (1-based steps t = 1..N), W = floor(warmup * N), D = floor(cooldown * N):
 *   constant  lr
 *   cosine    lr * t / W                                   for t <= W (linear warmup)
 *             min_lr + (lr - min_lr) * (1 + cos(pi * (t - W) / (N - W))) / 2     after:
 *             lr right after the warmup, min_lr at the last step
 *   rsqrt     base(t) = lr * t / W for t <= W, else lr * sqrt(max(W, 1) / t);
 *             base(t) until the cooldown, then for t > N - D:
 *             base(N - D) * (N - t) / D, a straight line down to 0 at the last step */
#include <math.h>

#include "train/engine.h"

/* The warmup's rate at step t of W warmup steps (t <= W, W >= 1). */
static double warmup_lr(double lr, int64_t t, int64_t W)
{
    return lr * (double)t / (double)W;
}

static double rsqrt_base(double lr, int64_t t, int64_t W)
{
    if (t <= W)
        return warmup_lr(lr, t, W);
    return lr * sqrt((double)(W > 1 ? W : 1) / (double)t);
}

float td_schedule_lr(const td_train_config *cfg, int64_t t, int64_t total)
{
    double lr = cfg->lr, out = lr;
    int64_t W = (int64_t)floor((double)cfg->warmup * (double)total);
    int64_t D = (int64_t)floor((double)cfg->cooldown * (double)total);

    switch (cfg->schedule) {
    case TD_SCHED_CONSTANT:
        break;
    case TD_SCHED_COSINE:
        if (t <= W) {
            out = warmup_lr(lr, t, W);
        } else {
            double ratio = total > W ? (double)(t - W) / (double)(total - W) : 1.0;
            double coeff = 0.5 * (1.0 + cos(M_PI * (ratio > 1.0 ? 1.0 : ratio)));
            out = cfg->min_lr + coeff * (lr - cfg->min_lr);
        }
        break;
    case TD_SCHED_RSQRT:
        if (D > 0 && t > total - D)
            out = rsqrt_base(lr, total - D, W) * (double)(total - t) / (double)D;
        else
            out = rsqrt_base(lr, t, W);
        break;
    }
    return (float)out;
}
