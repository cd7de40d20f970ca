/* Linear probes: a multinomial logistic regression fitted on frozen features (a sensorlm's unit
 * sensor embeddings, for `trainctl probe`), and the k-shot subsets, predictions, accuracy and
 * macro-F1 it is judged by. README.md ("Using a trained SensorLM") states the definition; in
 * short, for n rows x_i (E floats) with labels y_i in [0, K):
 *
 *   z_ik = W_k . x_i + b_k                    W (K, E), b (K): one row per class
 *   loss = (1/n) sum_i [log sum_{k in A} exp(z_ik) - z_{i,y_i}] + (l2/2) sum_{k in A} ||W_k||^2
 *
 * A is the classes with at least one row; a class without any has W_k = 0 and b_k = -inf, so it
 * is never predicted. The biases are not penalised (softmax ignores a constant added to all of
 * them: started from 0 they stay summing to 0). Minimised by L-BFGS (TD_PROBE_HISTORY pairs, a
 * backtracking Armijo line search, in double) from W = 0, b = 0 for at most max_iter iterations,
 * stopping earlier once every gradient entry is within TD_PROBE_GTOL of 0. Deterministic: the
 * same rows in the same order give the same bits on every run.
 *
 * Pure functions: no state, no allocation kept, no thread of their own; they run on the caller's
 * thread (a daemon's work thread, a test). Errors are returned, never panicked. */
#ifndef TD_PROBE_H
#define TD_PROBE_H

#include <stdint.h>

#include "common/td_errno.h"

#define TD_PROBE_L2       1e-4 /* l2 of trainctl probe: the regularisation strength above */
#define TD_PROBE_MAX_ITER 1000 /* L-BFGS iterations of trainctl probe, at most */
#define TD_PROBE_GTOL     1e-6 /* the gradient's largest entry at which a fit has converged */
#define TD_PROBE_HISTORY  10   /* L-BFGS's correction pairs */
#define TD_PROBE_MAX_K    256  /* classes: a sensor shard's label table at most */

/* How a fit ended. */
typedef struct td_probe_stats {
    int iterations;  /* L-BFGS iterations taken */
    int converged;   /* 1: the gradient's largest entry <= TD_PROBE_GTOL */
    double loss;     /* the regularised loss at the weights returned */
    double grad_max; /* the largest |entry| of its gradient there */
} td_probe_stats;

/* Fits the probe on n rows: x (n, E) features, y (n) labels in [0, K), l2 >= 0, max_iter >= 0.
 * Writes W (K, E) and b (K) (a class without rows: W_k = 0, b_k = -INFINITY) and *st (when not
 * NULL). stop (when not NULL) is asked before each iteration; when it says nonzero the fit ends
 * with TD_ECANCELLED ("stopped after 12 of 1000 iterations"). TD_EINVAL for n < 1, E < 1, K out
 * of 1..TD_PROBE_MAX_K, a label out of range, a non-finite feature or l2; TD_ENOMEM. */
int td_probe_fit(const float *x, const int32_t *y, int64_t n, int E, int K, double l2, int max_iter,
                 int (*stop)(void *ud), void *ud, double *W, double *b, td_probe_stats *st,
                 td_error_t *err);

/* The k-shot subset of rows y[0..n): the first k rows of each class in row order (all of a
 * class's rows when it has fewer; k == 0: every row), written to idx in row order (idx holds n);
 * returns their count. *short_classes (when not NULL) receives how many classes have at least
 * one row but fewer than k (0 for k == 0). Labels out of [0, K) are skipped. */
int64_t td_probe_subset(const int32_t *y, int64_t n, int K, int64_t k, int64_t *idx,
                        int *short_classes);

/* Each of the n rows x (n, E) gets the class k whose z_k = W_k . x + b_k is largest (the lowest k
 * among equals; a class with b_k = -inf never), into pred (n). */
void td_probe_predict(const double *W, const double *b, const float *x, int64_t n, int E, int K,
                      int32_t *pred);

/* Accuracy: the fraction of the n rows whose pred equals y. Macro-F1: the mean over the classes
 * that occur in y of F1_k = 2 TP_k / (2 TP_k + FP_k + FN_k) (0 for a class never predicted
 * right); a class that is predicted but never occurs in y is not in the mean (its false
 * positives count against the true classes' recall). NaN for both when n is 0. */
void td_probe_score(const int32_t *y, const int32_t *pred, int64_t n, int K, double *accuracy,
                    double *macro_f1);

/* One row of a probe's table: the fit on the k-shot subset of the train rows, judged on the
 * valid rows. */
typedef struct td_probe_row {
    int64_t shots;     /* k; 0: every train row */
    int64_t windows;   /* train rows in the subset */
    int short_classes; /* classes with fewer than k train rows, each of which gave all it has */
    double accuracy, macro_f1;
    td_probe_stats fit;
} td_probe_row;

/* For each of nshots values k in shots (each >= 0): the subset (td_probe_subset) of the train
 * rows xt (nt, E), yt; the fit (l2, max_iter, stop as td_probe_fit); the predictions of the valid
 * rows xv (nv, E) and their score against yv, into rows[j]. W and b, when not NULL, receive each
 * fit's weights: nshots * K * E and nshots * K doubles. Errors as td_probe_fit, prefixed with the
 * row ("5-shot: ..."). */
int td_probe_run(const float *xt, const int32_t *yt, int64_t nt, const float *xv, const int32_t *yv,
                 int64_t nv, int E, int K, const int64_t *shots, int nshots, double l2,
                 int max_iter, int (*stop)(void *ud), void *ud, td_probe_row *rows, double *W,
                 double *b, td_error_t *err);

#endif
