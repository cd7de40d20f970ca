/* Linear probes (probe.h): multinomial logistic regression with an L2 penalty on the weights,
 * fitted by L-BFGS in double precision on the caller's thread; the k-shot subsets, predictions,
 * accuracy and macro-F1 around it. Nothing here keeps state: each call allocates what it needs
 * and frees it before it returns. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/probe.h"

#define ARMIJO_C1     1e-4  /* sufficient decrease of the line search */
#define LINE_HALVINGS 40    /* step halvings before the line search gives up */
#define CURVATURE_MIN 1e-12 /* s.y below this (relative to |s||y|) keeps no pair */

/* One fit's problem: the rows, and which classes have any. */
typedef struct problem {
    const float *x;
    const int32_t *y;
    int64_t n;
    int E, K;
    double l2;
    const unsigned char *active; /* K: the class has rows */
} problem;

/* The regularised loss at theta = (W (K, E), b (K)) and its gradient into g (same layout), z a
 * scratch row of K. Rows are summed in order, so the result is the same every run. */
static double objective(const problem *pr, const double *theta, double *g, double *z)
{
    int E = pr->E, K = pr->K;
    const double *W = theta, *b = theta + (size_t)K * E;
    double *gW = g, *gb = g + (size_t)K * E, loss = 0.0, reg = 0.0;

    memset(g, 0, ((size_t)K * E + K) * sizeof(double));
    for (int64_t i = 0; i < pr->n; i++) {
        const float *xi = pr->x + (size_t)i * E;
        double m = -INFINITY, s = 0.0, lse;
        for (int k = 0; k < K; k++) {
            double v = b[k];
            if (!pr->active[k])
                continue;
            for (int e = 0; e < E; e++)
                v += W[(size_t)k * E + e] * xi[e];
            z[k] = v;
            m = v > m ? v : m;
        }
        for (int k = 0; k < K; k++)
            if (pr->active[k])
                s += exp(z[k] - m);
        lse = m + log(s);
        loss += lse - z[pr->y[i]];
        for (int k = 0; k < K; k++) {
            double d;
            if (!pr->active[k])
                continue;
            d = exp(z[k] - lse) - (k == pr->y[i]);
            gb[k] += d;
            for (int e = 0; e < E; e++)
                gW[(size_t)k * E + e] += d * xi[e];
        }
    }
    for (size_t j = 0; j < (size_t)K * E + K; j++)
        g[j] /= (double)pr->n;
    for (int k = 0; k < K; k++)
        for (int e = 0; e < E && pr->active[k]; e++) {
            double w = W[(size_t)k * E + e];
            reg += w * w;
            gW[(size_t)k * E + e] += pr->l2 * w;
        }
    return loss / (double)pr->n + 0.5 * pr->l2 * reg;
}

static double dotd(const double *a, const double *b, size_t n)
{
    double s = 0.0;

    for (size_t j = 0; j < n; j++)
        s += a[j] * b[j];
    return s;
}

static double max_abs(const double *a, size_t n)
{
    double m = 0.0;

    for (size_t j = 0; j < n; j++)
        m = fabs(a[j]) > m ? fabs(a[j]) : m;
    return m;
}

/* L-BFGS's memory: up to TD_PROBE_HISTORY pairs (s, y) in a ring, newest at (head - 1). */
typedef struct history {
    double *s, *y; /* TD_PROBE_HISTORY rows of P */
    double rho[TD_PROBE_HISTORY], alpha[TD_PROBE_HISTORY];
    int head, count;
    size_t P;
} history;

/* d = -H g by the two-loop recursion, H the inverse-Hessian approximation of the pairs kept
 * (scaled by s.y / y.y of the newest); with none, the steepest descent step of length 1 per unit
 * of the gradient's largest entry. */
static void direction(history *h, const double *g, double *d)
{
    size_t P = h->P;

    for (size_t j = 0; j < P; j++)
        d[j] = -g[j];
    if (h->count == 0) {
        double gm = max_abs(g, P);
        for (size_t j = 0; j < P && gm > 1.0; j++)
            d[j] /= gm;
        return;
    }
    for (int c = 0; c < h->count; c++) {
        int at = (h->head - 1 - c + TD_PROBE_HISTORY) % TD_PROBE_HISTORY;
        double *s = h->s + (size_t)at * P, *y = h->y + (size_t)at * P;
        h->alpha[at] = h->rho[at] * dotd(s, d, P);
        for (size_t j = 0; j < P; j++)
            d[j] -= h->alpha[at] * y[j];
    }
    {
        int at = (h->head - 1 + TD_PROBE_HISTORY) % TD_PROBE_HISTORY;
        double *s = h->s + (size_t)at * P, *y = h->y + (size_t)at * P;
        double gamma = dotd(s, y, P) / dotd(y, y, P);
        for (size_t j = 0; j < P; j++)
            d[j] *= gamma;
    }
    for (int c = h->count - 1; c >= 0; c--) {
        int at = (h->head - 1 - c + TD_PROBE_HISTORY) % TD_PROBE_HISTORY;
        double *s = h->s + (size_t)at * P, *y = h->y + (size_t)at * P;
        double beta = h->rho[at] * dotd(y, d, P);
        for (size_t j = 0; j < P; j++)
            d[j] += s[j] * (h->alpha[at] - beta);
    }
}

/* Keeps the pair (s, y) = (theta' - theta, g' - g) when its curvature is positive. */
static void remember(history *h, const double *s, const double *y)
{
    size_t P = h->P;
    double sy = dotd(s, y, P), ss = dotd(s, s, P), yy = dotd(y, y, P);

    if (!(sy > CURVATURE_MIN * sqrt(ss * yy)))
        return;
    memcpy(h->s + (size_t)h->head * P, s, P * sizeof(double));
    memcpy(h->y + (size_t)h->head * P, y, P * sizeof(double));
    h->rho[h->head] = 1.0 / sy;
    h->head = (h->head + 1) % TD_PROBE_HISTORY;
    h->count += h->count < TD_PROBE_HISTORY;
}

static int check_args(const float *x, const int32_t *y, int64_t n, int E, int K, double l2,
                      int max_iter, td_error_t *err)
{
    if (n < 1 || E < 1 || K < 1 || K > TD_PROBE_MAX_K || max_iter < 0)
        return td_error_set(err, TD_EINVAL,
                            "probe: %lld rows of %d features in %d classes, %d iterations",
                            (long long)n, E, K, max_iter);
    if (!isfinite(l2) || l2 < 0)
        return td_error_set(err, TD_EINVAL, "probe: l2 %g; it must be finite and >= 0", l2);
    for (int64_t i = 0; i < n; i++) {
        if (y[i] < 0 || y[i] >= K)
            return td_error_set(err, TD_EINVAL, "probe: row %lld: label %d, but there are %d",
                                (long long)i, (int)y[i], K);
        for (int e = 0; e < E; e++)
            if (!isfinite(x[(size_t)i * E + e]))
                return td_error_set(err, TD_EINVAL, "probe: row %lld: feature %d is not finite",
                                    (long long)i, e);
    }
    return 0;
}

/* The buffers of one fit, in one allocation: theta, g, the trial point and its gradient, d, s,
 * y, z, and the history's rows. */
typedef struct work {
    double *theta, *g, *t2, *g2, *d, *s, *y, *z;
    history h;
    void *block;
} work;

static int work_alloc(work *w, size_t P, int K, td_error_t *err)
{
    size_t n = 7 * P + (size_t)K + 2 * (size_t)TD_PROBE_HISTORY * P;
    double *p = calloc(n, sizeof(double));

    memset(w, 0, sizeof(*w));
    if (p == NULL)
        return td_error_set(err, TD_ENOMEM, "probe: no memory for %zu parameters", P);
    w->block = p;
    w->theta = p, p += P;
    w->g = p, p += P;
    w->t2 = p, p += P;
    w->g2 = p, p += P;
    w->d = p, p += P;
    w->s = p, p += P;
    w->y = p, p += P;
    w->z = p, p += K;
    w->h.s = p, p += (size_t)TD_PROBE_HISTORY * P;
    w->h.y = p;
    w->h.P = P;
    return 0;
}

/* Backtracking from step 1 along w->d until the loss falls enough (Armijo); the new point and
 * its gradient go to t2, g2. 0 with *f2 its loss, or -1 when no step decreases the loss (the
 * fit is at the limit of double precision). */
static int line_search(const problem *pr, work *w, double f, double *f2)
{
    size_t P = w->h.P;
    double slope = dotd(w->g, w->d, P), t = 1.0;

    for (int k = 0; k < LINE_HALVINGS; k++, t *= 0.5) {
        for (size_t j = 0; j < P; j++)
            w->t2[j] = w->theta[j] + t * w->d[j];
        *f2 = objective(pr, w->t2, w->g2, w->z);
        if (isfinite(*f2) && *f2 <= f + ARMIJO_C1 * t * slope)
            return 0;
    }
    return -1;
}

int td_probe_fit(const float *x, const int32_t *y, int64_t n, int E, int K, double l2, int max_iter,
                 int (*stop)(void *ud), void *ud, double *W, double *b, td_probe_stats *st,
                 td_error_t *err)
{
    unsigned char active[TD_PROBE_MAX_K] = {0};
    size_t P = (size_t)K * E + (size_t)K;
    problem pr = {x, y, n, E, K, l2, active};
    td_probe_stats s = {0};
    double f, f2;
    work w;
    int rc;

    if ((rc = check_args(x, y, n, E, K, l2, max_iter, err)) != 0)
        return rc;
    if ((rc = work_alloc(&w, P, K, err)) != 0)
        return rc;
    for (int64_t i = 0; i < n; i++)
        active[y[i]] = 1;
    f = objective(&pr, w.theta, w.g, w.z);
    while ((s.grad_max = max_abs(w.g, P)) > TD_PROBE_GTOL && s.iterations < max_iter) {
        if (stop != NULL && stop(ud)) {
            rc = td_error_set(err, TD_ECANCELLED, "probe: stopped after %d of %d iterations",
                              s.iterations, max_iter);
            goto out;
        }
        direction(&w.h, w.g, w.d);
        if (dotd(w.g, w.d, P) >= 0) { /* not downhill (rounding): forget, go steepest */
            w.h.count = 0;
            direction(&w.h, w.g, w.d);
        }
        if (line_search(&pr, &w, f, &f2) != 0)
            break;
        for (size_t j = 0; j < P; j++) {
            w.s[j] = w.t2[j] - w.theta[j];
            w.y[j] = w.g2[j] - w.g[j];
        }
        remember(&w.h, w.s, w.y);
        memcpy(w.theta, w.t2, P * sizeof(double));
        memcpy(w.g, w.g2, P * sizeof(double));
        f = f2;
        s.iterations++;
    }
    s.loss = f;
    s.converged = s.grad_max <= TD_PROBE_GTOL;
    memcpy(W, w.theta, (size_t)K * E * sizeof(double));
    for (int k = 0; k < K; k++)
        b[k] = active[k] ? w.theta[(size_t)K * E + k] : -INFINITY;
    if (st != NULL)
        *st = s;
out:
    free(w.block);
    return rc;
}

int64_t td_probe_subset(const int32_t *y, int64_t n, int K, int64_t k, int64_t *idx,
                        int *short_classes)
{
    int64_t taken[TD_PROBE_MAX_K] = {0}, m = 0;
    int shorts = 0;

    K = K < TD_PROBE_MAX_K ? K : TD_PROBE_MAX_K;
    for (int64_t i = 0; i < n; i++) {
        if (y[i] < 0 || y[i] >= K || (k > 0 && taken[y[i]] >= k))
            continue;
        taken[y[i]]++;
        idx[m++] = i;
    }
    for (int c = 0; c < K && k > 0; c++)
        shorts += taken[c] > 0 && taken[c] < k;
    if (short_classes != NULL)
        *short_classes = shorts;
    return m;
}

void td_probe_predict(const double *W, const double *b, const float *x, int64_t n, int E, int K,
                      int32_t *pred)
{
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * E;
        double best = -INFINITY;
        pred[i] = 0;
        for (int k = 0; k < K; k++) {
            double v = b[k];
            if (isinf(v) && v < 0)
                continue;
            for (int e = 0; e < E; e++)
                v += W[(size_t)k * E + e] * xi[e];
            if (v > best) {
                best = v;
                pred[i] = k;
            }
        }
    }
}

void td_probe_score(const int32_t *y, const int32_t *pred, int64_t n, int K, double *accuracy,
                    double *macro_f1)
{
    int64_t tp[TD_PROBE_MAX_K] = {0}, fp[TD_PROBE_MAX_K] = {0}, fn[TD_PROBE_MAX_K] = {0};
    int64_t right = 0;
    double sum = 0.0;
    int classes = 0;

    if (n <= 0) {
        *accuracy = *macro_f1 = NAN;
        return;
    }
    K = K < TD_PROBE_MAX_K ? K : TD_PROBE_MAX_K;
    for (int64_t i = 0; i < n; i++) {
        int t = y[i], p = pred[i];
        if (t == p) {
            right++;
            if (t >= 0 && t < K)
                tp[t]++;
            continue;
        }
        if (t >= 0 && t < K)
            fn[t]++;
        if (p >= 0 && p < K)
            fp[p]++;
    }
    for (int k = 0; k < K; k++) {
        if (tp[k] + fn[k] == 0) /* not in y */
            continue;
        sum += 2.0 * (double)tp[k] / (double)(2 * tp[k] + fp[k] + fn[k]);
        classes++;
    }
    *accuracy = (double)right / (double)n;
    *macro_f1 = classes > 0 ? sum / classes : NAN;
}

int td_probe_run(const float *xt, const int32_t *yt, int64_t nt, const float *xv, const int32_t *yv,
                 int64_t nv, int E, int K, const int64_t *shots, int nshots, double l2,
                 int max_iter, int (*stop)(void *ud), void *ud, td_probe_row *rows, double *W,
                 double *b, td_error_t *err)
{
    int64_t *idx = malloc((size_t)(nt > 0 ? nt : 1) * sizeof(int64_t));
    float *xs = malloc((size_t)(nt > 0 ? nt : 1) * (size_t)(E > 0 ? E : 1) * sizeof(float));
    int32_t *ys = malloc((size_t)(nt > 0 ? nt : 1) * sizeof(int32_t));
    int32_t *pred = malloc((size_t)(nv > 0 ? nv : 1) * sizeof(int32_t));
    double *w = malloc((size_t)(K > 0 ? K : 1) * (size_t)(E > 0 ? E : 1) * sizeof(double));
    double *bias = malloc((size_t)(K > 0 ? K : 1) * sizeof(double));
    int rc = 0;

    if (idx == NULL || xs == NULL || ys == NULL || pred == NULL || w == NULL || bias == NULL) {
        rc = td_error_set(err, TD_ENOMEM, "probe: no memory for %lld rows", (long long)nt);
        goto out;
    }
    for (int j = 0; j < nshots && rc == 0; j++) {
        td_probe_row *r = &rows[j];
        memset(r, 0, sizeof(*r));
        r->shots = shots[j];
        r->windows = td_probe_subset(yt, nt, K, shots[j], idx, &r->short_classes);
        for (int64_t i = 0; i < r->windows; i++) {
            memcpy(xs + (size_t)i * E, xt + (size_t)idx[i] * E, (size_t)E * sizeof(float));
            ys[i] = yt[idx[i]];
        }
        rc = td_probe_fit(xs, ys, r->windows, E, K, l2, max_iter, stop, ud, w, bias, &r->fit, err);
        if (rc != 0) {
            td_error_t was = *err;
            if (shots[j] > 0)
                td_error_set(err, was.code, "%lld-shot: %s", (long long)shots[j], was.msg);
            else
                td_error_set(err, was.code, "all-shot: %s", was.msg);
            break;
        }
        td_probe_predict(w, bias, xv, nv, E, K, pred);
        td_probe_score(yv, pred, nv, K, &r->accuracy, &r->macro_f1);
        if (W != NULL)
            memcpy(W + (size_t)j * K * E, w, (size_t)K * E * sizeof(double));
        if (b != NULL)
            memcpy(b + (size_t)j * K, bias, (size_t)K * sizeof(double));
    }
out:
    free(idx);
    free(xs);
    free(ys);
    free(pred);
    free(w);
    free(bias);
    return rc;
}
