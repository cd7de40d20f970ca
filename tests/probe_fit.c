/* probe_fit: train/probe.c's td_probe_run on rows read from standard input, its table and
 * every fit's weights printed, for tests/test_probe_fit.py to hold against numpy. Input, as
 * whitespace-separated text:
 *
 *   nt nv E K l2 max_iter nshots
 *   shots[0] ... shots[nshots-1]            (0: every train row)
 *   nt rows: label x_1 ... x_E              (the train rows)
 *   nv rows: label x_1 ... x_E              (the valid rows)
 *
 * Output, one line each: "row SHOTS WINDOWS SHORT ITERATIONS CONVERGED LOSS GRAD_MAX ACCURACY
 * MACRO_F1", then "W k w_k1 ... w_kE" for each class k and "b b_1 ... b_K" (-inf for a class
 * without train rows), every double with 17 significant digits. Exits 1 with td_probe_run's
 * message on standard error when it refuses, 2 on unreadable input. */
#include <stdio.h>
#include <stdlib.h>

#include "train/probe.h"

static int read_rows(int64_t n, int E, int32_t *y, float *x)
{
    for (int64_t i = 0; i < n; i++) {
        if (scanf("%d", &y[i]) != 1)
            return -1;
        for (int e = 0; e < E; e++)
            if (scanf("%f", &x[(size_t)i * E + e]) != 1)
                return -1;
    }
    return 0;
}

int main(void)
{
    long long nt, nv;
    int E, K, max_iter, nshots, rc = 2;
    double l2, *W = NULL, *b = NULL;
    int64_t *shots = NULL;
    int32_t *yt = NULL, *yv = NULL;
    float *xt = NULL, *xv = NULL;
    td_probe_row *rows = NULL;
    td_error_t err = {0};

    if (scanf("%lld %lld %d %d %lf %d %d", &nt, &nv, &E, &K, &l2, &max_iter, &nshots) != 7 ||
        nt < 1 || nv < 1 || E < 1 || K < 1 || nshots < 1 || nshots > 64)
        goto out;
    shots = calloc((size_t)nshots, sizeof(*shots));
    rows = calloc((size_t)nshots, sizeof(*rows));
    yt = calloc((size_t)nt, sizeof(*yt));
    yv = calloc((size_t)nv, sizeof(*yv));
    xt = calloc((size_t)nt * E, sizeof(*xt));
    xv = calloc((size_t)nv * E, sizeof(*xv));
    W = calloc((size_t)nshots * K * E, sizeof(*W));
    b = calloc((size_t)nshots * K, sizeof(*b));
    if (!shots || !rows || !yt || !yv || !xt || !xv || !W || !b)
        goto out;
    for (int j = 0; j < nshots; j++)
        if (scanf("%lld", (long long *)&shots[j]) != 1)
            goto out;
    if (read_rows(nt, E, yt, xt) != 0 || read_rows(nv, E, yv, xv) != 0)
        goto out;
    if (td_probe_run(xt, yt, nt, xv, yv, nv, E, K, shots, nshots, l2, max_iter, NULL, NULL, rows, W,
                     b, &err) != 0) {
        fprintf(stderr, "probe_fit: %s\n", err.msg);
        rc = 1;
        goto out;
    }
    for (int j = 0; j < nshots; j++) {
        const td_probe_row *r = &rows[j];
        printf("row %lld %lld %d %d %d %.17g %.17g %.17g %.17g\n", (long long)r->shots,
               (long long)r->windows, r->short_classes, r->fit.iterations, r->fit.converged,
               r->fit.loss, r->fit.grad_max, r->accuracy, r->macro_f1);
        for (int k = 0; k < K; k++) {
            printf("W %d", k);
            for (int e = 0; e < E; e++)
                printf(" %.17g", W[((size_t)j * K + k) * E + e]);
            printf("\n");
        }
        printf("b");
        for (int k = 0; k < K; k++)
            printf(" %.17g", b[(size_t)j * K + k]);
        printf("\n");
    }
    rc = 0;
out:
    if (rc == 2)
        fprintf(stderr, "probe_fit: unreadable input\n");
    free(shots);
    free(rows);
    free(yt);
    free(yv);
    free(xt);
    free(xv);
    free(W);
    free(b);
    return rc;
}
