"""Score histograms and the secure AUC against the papers (Cormode & Markov; ppAURORA; the ROC-GLM's design).

Usage:
    python benchmarks/histograms.py            # ~1 min
    python benchmarks/histograms.py --quick

Prints, each against a baseline measured in the same run:

1. Cormode-Markov's trends: mean |AUC_histogram - AUC_exact| against the
   number of buckets B (Federated: O(1/B^2)), the number of sites M and
   epsilon (DistDP, LocalDP), with the fitted log-log slope. The papers'
   rates: Federated does not depend on M; DistDP's noise is one discrete
   Laplace per cell whatever M, so its error falls as 1/(M epsilon) for a fixed
   number of records per site; LocalDP's as 1/(sqrt(M) epsilon) for small
   epsilon.
2. On the ROC-GLM paper's simulation design (benchmarks/_simulation.py): the
   histogram AUC (Federated, DistDP), the ROC-GLM AUC (DP at the paper's
   setting for l2-sensitivity 0.01) and the exact AUC.
3. The secure AUC's time and bytes as n and the number of sites grow, with
   scikit-learn's pooled ``roc_auc_score`` time as the baseline: linear in
   n + B (ppAURORA's is quadratic in n and in the number of sources).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _simulation import generate  # noqa: E402

import secagg_roc as sr  # noqa: E402

ROLES = {"label": ["y"], "score": ["p"]}


def sites_data(rng, m, n):
    data, ys, ss = {}, [], []
    for k in range(m):
        y = rng.integers(0, 2, n)
        s = 1 / (1 + np.exp(-rng.normal(1.2 * y - 0.6, 1.0)))
        data[f"h{k}"] = {"y": y, "p": s}
        ys.append(y)
        ss.append(s)
    return data, np.concatenate(ys), np.concatenate(ss)


def hist_error(rng, privacy, m, n, bins, eps, seed):
    data, y, s = sites_data(rng, m, n)
    policy = sr.Policy(analyses=("score_histogram",), histogram_bins=bins, min_cell_count=1, roles=ROLES,
                       dp={"epsilon": eps, "delta": 1e-6, "l2_sensitivity": 0.05, "budget_epsilon": 100.0})
    study = sr.Study.local(data, policy=policy, seed=seed)
    h = sr.score_histogram(study, label="y", score="p", privacy=privacy,
                           epsilon=None if privacy == "federated" else eps)
    return abs(h.auc() - roc_auc_score(y, s))


def trend(label, xs, errs):
    slope = np.polyfit(np.log(xs), np.log(errs), 1)[0]
    cells = "  ".join(f"{x:>6g}: {e:.2e}" for x, e in zip(xs, errs))
    print(f"  {label:<34} {cells}   slope {slope:+.2f}")


def trends(reps):
    print("1. Mean |AUC_hist - AUC_exact| (Cormode & Markov's trends; slope of log error on log x)")
    rng = np.random.default_rng(1)
    bs = [4, 8, 16, 32, 64]
    trend("federated vs B (M=4, n=5000/site)", bs,
          [np.mean([hist_error(rng, "federated", 4, 5000, b, 1.0, r) for r in range(reps)]) for b in bs])
    ms = [2, 4, 8, 16]
    for privacy, eps in (("federated", 1.0), ("distdp", 1.0), ("localdp", 4.0)):
        trend(f"{privacy} vs M (B=20, n=500/site, e={eps:g})", ms,
              [np.nanmean([hist_error(rng, privacy, m, 500, 20, eps, r) for r in range(reps)]) for m in ms])
    es = [0.25, 0.5, 1.0, 2.0, 4.0]
    for privacy, m in (("distdp", 4), ("localdp", 16)):
        trend(f"{privacy} vs epsilon (M={m}, B=20)", es,
              [np.nanmean([hist_error(rng, privacy, m, 500, 20, e, r) for r in range(reps)]) for e in es])


def rocglm_design(reps):
    print("\n2. The ROC-GLM paper's simulation design, 5 sites: mean |AUC - AUC_exact| and time per analysis")
    rng = np.random.default_rng(2)
    rows = {"histogram federated (B=1000)": [], "histogram distdp (B=100, e=1)": [], "secure_auc (B=1000)": [],
            "ROC-GLM, DP (e=0.2, d=0.1)": []}
    times = {k: 0.0 for k in rows}
    base = 0.0
    for r in range(reps):
        y, s = generate(rng)
        parts = np.array_split(rng.permutation(y.size), 5)
        data = {f"h{k}": {"y": y[i], "p": s[i]} for k, i in enumerate(parts)}
        policy = sr.Policy(analyses=("score_histogram", "secure_auc", "rocglm"), histogram_bins=1000,
                           min_cell_count=1, roles=ROLES,
                           dp={"epsilon": 1.0, "delta": 0.1, "l2_sensitivity": 0.01, "budget_epsilon": 100.0,
                               "budget_delta": 0.99, "accounting": "basic"})
        study = sr.Study.local(data, policy=policy, seed=r)
        t = time.perf_counter()
        exact = roc_auc_score(y, s)
        base += time.perf_counter() - t
        runs = {
            "histogram federated (B=1000)": lambda: sr.score_histogram(study, label="y", score="p").auc(),
            "histogram distdp (B=100, e=1)": lambda: sr.score_histogram(study, label="y", score="p", bins=100,
                                                                        privacy="distdp", epsilon=1.0).auc(),
            "secure_auc (B=1000)": lambda: float(sr.secure_auc(study, label="y", score="p")),
            "ROC-GLM, DP (e=0.2, d=0.1)": lambda: sr.roc_glm(study, label="y", score="p", epsilon=0.2,
                                                             delta=0.1).auc,
        }
        for name, run in runs.items():
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = run()
            times[name] += time.perf_counter() - t
            rows[name].append(abs(value - exact))
    print(f"  {'analysis':<32} {'mean err':>9} {'max err':>9} {'time / sklearn pooled':>22}")
    for name, errs in rows.items():
        print(f"  {name:<32} {np.mean(errs):9.2e} {np.max(errs):9.2e} {times[name] / base:22.0f}x")


def secure_auc_cost(sizes, site_counts):
    print("\n3. secure_auc: time and bytes (all parties' received messages) as n and the sites grow, B=1000")
    print(f"  {'sites':>5} {'n':>8} {'seconds':>8} {'s / sklearn':>11} {'s / s(first n)':>14} {'MB':>7}")
    for m in site_counts:
        first = None
        for n in sizes:
            rng = np.random.default_rng(n + m)
            data, y, s = sites_data(rng, m, n // m)
            study = sr.Study.local(data, policy=sr.Policy(analyses=("secure_auc",), histogram_bins=1000),
                                   transcripts=True)
            t = time.perf_counter()
            sr.secure_auc(study, label="y", score="p")
            secs = time.perf_counter() - t
            t = time.perf_counter()
            roc_auc_score(y, s)
            base = time.perf_counter() - t
            mb = sum(tr.bytes_received() or 0 for tr in study.federation.transcripts.values()) / 1e6
            first = first or secs
            print(f"  {m:>5} {y.size:>8} {secs:8.3f} {secs / base:11.1f} {secs / first:14.2f} {mb:7.2f}")
    print("  (the bytes do not depend on n: every message is of B counts, a seed, or of constant size;\n"
          "   they grow with the sites, whose shares are seeds except one vector each)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 4 if args.quick else 12
    trends(reps)
    rocglm_design(3 if args.quick else 10)
    secure_auc_cost([10_000, 100_000, 1_000_000] if not args.quick else [10_000, 100_000], [2, 8, 32])


if __name__ == "__main__":
    main()
