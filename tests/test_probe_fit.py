#!/usr/bin/python3
"""train/probe.c's linear probe held against numpy (through tests/probe_fit.c, which runs
td_probe_run on rows given as text): on small fixed datasets, for each k-shot row,

- the subset is the first k rows of each class in row order (numpy picks it again), with the
  short classes counted;
- the weights returned are the minimum of the regularised loss of probe.h: the loss numpy
  computes at them is the one reported, and every entry of its gradient, numpy's own formula
  (1/n) sum_i (p_i - onehot(y_i)) x_i^T + l2 W and (1/n) sum_i (p_i - onehot(y_i)), is within
  1e-6 of 0 (TD_PROBE_GTOL), the optimality condition of a convex loss;
- accuracy and macro-F1 are numpy's from the same weights on the valid rows.

And two closed forms: all-zero features, where the minimum is W = 0 and b_k = log n_k minus the
mean of those logs (softmax of b = the class frequencies); a class without train rows, b = -inf,
never predicted. Exits 77 (skipped) without numpy.

Usage: test_probe_fit.py PROBE_FIT_BIN."""

import subprocess
import sys
import unittest

try:
    import numpy as np
except ImportError as e:
    print("skipped: %s (python3-numpy)" % e)
    sys.exit(77)

PROBE_FIT = sys.argv[1] if len(sys.argv) > 1 else "build/tests/probe_fit"
GTOL = 1e-6  # TD_PROBE_GTOL


def run(xt, yt, xv, yv, K, l2, max_iter, shots):
    """probe_fit's rows: a list of (fields, W, b) per shot."""
    xt, xv = np.asarray(xt, np.float32), np.asarray(xv, np.float32)
    E = xt.shape[1]
    lines = ["%d %d %d %d %.17g %d %d" % (len(yt), len(yv), E, K, l2, max_iter, len(shots)),
             " ".join(str(s) for s in shots)]
    for x, y in ((xt, yt), (xv, yv)):
        for xi, yi in zip(x, y):
            lines.append("%d %s" % (yi, " ".join(repr(float(v)) for v in xi)))
    r = subprocess.run([PROBE_FIT], input="\n".join(lines) + "\n", capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise AssertionError("probe_fit: %d %s" % (r.returncode, r.stderr))
    out, cur = [], None
    for line in r.stdout.splitlines():
        w = line.split()
        if w[0] == "row":
            cur = {"shots": int(w[1]), "windows": int(w[2]), "short": int(w[3]),
                   "iterations": int(w[4]), "converged": int(w[5]), "loss": float(w[6]),
                   "grad_max": float(w[7]), "accuracy": float(w[8]), "macro_f1": float(w[9]),
                   "W": []}
            out.append(cur)
        elif w[0] == "W":
            cur["W"].append([float(v) for v in w[2:]])
        elif w[0] == "b":
            cur["b"] = np.array([float(v) for v in w[1:]])
            cur["W"] = np.array(cur["W"])
    return out


def subset(y, K, k):
    """The first k rows of each class in row order (k == 0: all), and the short classes."""
    taken, idx = [0] * K, []
    for i, c in enumerate(y):
        if k == 0 or taken[c] < k:
            taken[c] += 1
            idx.append(i)
    short = sum(1 for t in taken if 0 < t < k) if k else 0
    return np.array(idx), short


def loss_grad(W, b, x, y, l2):
    """probe.h's loss and its gradient, in float64 over float32 features."""
    x = x.astype(np.float64)
    active = np.isfinite(b)
    z = x @ W.T + b
    z[:, ~active] = -np.inf
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    p = np.exp(z - lse[:, None])
    n = len(y)
    onehot = np.zeros_like(p)
    onehot[np.arange(n), y] = 1
    loss = (lse - z[np.arange(n), y]).mean() + 0.5 * l2 * (W[active] ** 2).sum()
    d = (p - onehot) / n
    gW = d.T @ x + l2 * W
    gW[~active] = 0
    gb = d.sum(axis=0)
    gb[~active] = 0
    return loss, gW, gb


def predict(W, b, x):
    z = x.astype(np.float64) @ W.T + b
    z[:, ~np.isfinite(b)] = -np.inf
    return z.argmax(axis=1)  # the first of equals, as probe.c


def score(y, pred, K):
    acc = float((y == pred).mean())
    f1 = []
    for k in range(K):
        tp = int(((y == k) & (pred == k)).sum())
        fp = int(((y != k) & (pred == k)).sum())
        fn = int(((y == k) & (pred != k)).sum())
        if tp + fn > 0:
            f1.append(2 * tp / (2 * tp + fp + fn))
    return acc, float(np.mean(f1))


def blobs(rng, n, centres, spread):
    """n unit rows around the K centres (K, E), labels drawn uniformly."""
    K, E = centres.shape
    y = rng.integers(0, K, size=n)
    x = centres[y] + spread * rng.normal(size=(n, E))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), y


class ProbeFit(unittest.TestCase):
    def check_rows(self, xt, yt, xv, yv, K, l2, shots, rows):
        self.assertEqual(len(rows), len(shots))
        for k, r in zip(shots, rows):
            idx, short = subset(yt, K, k)
            self.assertEqual((r["shots"], r["windows"], r["short"]), (k, len(idx), short))
            self.assertEqual(r["converged"], 1, r)
            loss, gW, gb = loss_grad(r["W"], r["b"], xt[idx], yt[idx], l2)
            gmax = max(np.abs(gW).max(), np.abs(gb).max())
            print("%3s-shot, l2 %g: %3d rows, %3d iterations, loss %.6f, numpy's gradient max "
                  "%.2e" % (k or "all", l2, len(idx), r["iterations"], loss, gmax))
            self.assertLess(gmax, 2 * GTOL)  # float32 features read back exactly
            self.assertAlmostEqual(loss, r["loss"], delta=1e-9 * max(1, abs(loss)))
            # biases of the classes fitted sum to 0 (softmax's free constant stays at its start)
            self.assertLess(abs(r["b"][np.isfinite(r["b"])].sum()), 1e-9)
            acc, f1 = score(yv, predict(r["W"], r["b"], xv), K)
            self.assertAlmostEqual(acc, r["accuracy"], delta=1e-12)
            self.assertAlmostEqual(f1, r["macro_f1"], delta=1e-12)

    def test_blobs_optimal(self):
        rng = np.random.default_rng(23)
        K, E = 4, 6
        centres = rng.normal(size=(K, E))
        xt, yt = blobs(rng, 120, centres, 0.8)
        xv, yv = blobs(rng, 60, centres, 0.8)
        shots = [1, 5, 10, 0]
        for l2 in (1e-2, 1e-4):  # 1e-4 is trainctl probe's
            rows = run(xt, yt, xv, yv, K, l2, 2000, shots)
            self.check_rows(xt, yt, xv, yv, K, l2, shots, rows)
        # the all-row fit on well-separated classes is better than chance on the valid rows
        self.assertGreater(rows[-1]["accuracy"], 0.5)

    def test_short_classes(self):
        rng = np.random.default_rng(5)
        K, E = 3, 4
        centres = rng.normal(size=(K, E))
        xt, yt = blobs(rng, 30, centres, 1.0)
        yt[:] = 0
        yt[3:5] = 1  # class 1 has 2 rows, class 2 has 3
        yt[10:13] = 2
        xv, yv = blobs(rng, 20, centres, 1.0)
        rows = run(xt, yt, xv, yv, K, 1e-2, 2000, [1, 5, 10, 0])
        self.assertEqual([r["short"] for r in rows], [0, 2, 2, 0])
        self.assertEqual([r["windows"] for r in rows], [3, 5 + 2 + 3, 10 + 2 + 3, 30])
        self.check_rows(xt, yt, xv, yv, K, 1e-2, [1, 5, 10, 0], rows)

    def test_zero_features_closed_form(self):
        K, E = 3, 5
        yt = np.array([0] * 6 + [1] * 3 + [2] * 1)
        xt = np.zeros((len(yt), E), np.float32)
        rows = run(xt, yt, xt, yt, K, 1e-3, 500, [0])
        counts = np.bincount(yt, minlength=K)
        want = np.log(counts) - np.log(counts).mean()
        np.testing.assert_allclose(rows[0]["b"], want, atol=1e-6)
        np.testing.assert_array_equal(rows[0]["W"], np.zeros((K, E)))
        self.assertAlmostEqual(rows[0]["accuracy"], 0.6)  # every row gets the commonest class

    def test_class_without_rows(self):
        rng = np.random.default_rng(9)
        K, E = 4, 3
        centres = rng.normal(size=(K, E))
        xt, yt = blobs(rng, 40, centres, 0.5)
        yt[yt == 2] = 1  # class 2 has no train rows
        xv, yv = blobs(rng, 40, centres, 0.5)
        rows = run(xt, yt, xv, yv, K, 1e-2, 2000, [5, 0])
        for r in rows:
            self.assertEqual(r["b"][2], -np.inf)
            np.testing.assert_array_equal(r["W"][2], np.zeros(E))
            self.assertNotIn(2, set(predict(r["W"], r["b"], xv)))
        self.check_rows(xt, yt, xv, yv, K, 1e-2, [5, 0], rows)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
