"""Distributed ROC-GLM with differential privacy vs the pooled analysis, at the paper's recommended settings.

Usage:
    python benchmarks/dp_auc_gap.py            # 100 simulated data sets per setting (~1.5 min on 2 cores)
    python benchmarks/dp_auc_gap.py --quick    # 25 per setting
    python benchmarks/dp_auc_gap.py --reps 200 --sites 5

Each data set follows the paper's simulation design (benchmarks/_simulation.py)
and is split over `--sites` sites of an embedded study (secure sums over two
aggregators, DP release of Gaussian-noised scores, survivor functions
pooled by every site). For every l2-sensitivity of the paper's table the recommended
(epsilon, delta) is used, with the paper's classic Gaussian mechanism and with
the analytic one. Reported: mean |AUC_distributed - AUC_pooled| (distributed
ROC-GLM AUC against the pooled empirical AUC, and against the pooled ROC-GLM
AUC), and the mean summed distance of the two CI bounds to the pooled CI (the
paper's Delta ci).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _simulation import generate  # noqa: E402

from secagg_roc import pooled  # noqa: E402
from secagg_roc.dp import gaussian_sigma, recommended_privacy  # noqa: E402
from secagg_roc import DPPolicy, Policy  # noqa: E402
from secagg_roc.stats import roc_glm  # noqa: E402
from secagg_roc.study import Study  # noqa: E402

SENSITIVITIES = (0.01, 0.03, 0.05, 0.07)


def run(l2: float, mechanism: str, reps: int, n_sites: int, seed: int) -> dict[str, float]:
    eps, delta = recommended_privacy(l2) if l2 else (None, None)
    rng = np.random.default_rng(seed)
    gap_emp, gap_fit, gap_ci, auc_emp = [], [], [], []
    for rep in range(reps):
        y, s = generate(rng)
        parts = np.array_split(rng.permutation(y.size), n_sites)
        data = {f"site{k}": {"y": y[p], "score": s[p]} for k, p in enumerate(parts)}
        policy = Policy(allow_non_private=True, roles={"label": ["y"], "score": ["score"]}, dp=None if mechanism == "none" else DPPolicy(
            epsilon=eps, delta=delta, l2_sensitivity=l2, mechanism=mechanism))
        study = Study.local(data, policy=policy, seed=seed * 100_003 + rep)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mechanism == "none":  # baseline: the ROC-GLM's own approximation error, no noise
                got = roc_glm(study, "y", "score", epsilon=None)
            else:
                got = roc_glm(study, "y", "score")
            ref = pooled.roc_glm(y, s)
        auc_emp.append(pooled.auc(y, s))
        gap_emp.append(abs(got.auc - auc_emp[-1]))
        gap_fit.append(abs(got.auc - ref.auc))
        gap_ci.append(abs(got.ci[0] - ref.ci[0]) + abs(got.ci[1] - ref.ci[1]))
    high = np.asarray(auc_emp) > 0.8
    gaps = np.asarray(gap_emp)
    return {
        "low": float(np.mean(gaps[~high])) if (~high).any() else float("nan"),
        "high": float(np.mean(gaps[high])) if high.any() else float("nan"),
        "epsilon": eps,
        "delta": delta,
        "sigma": gaussian_sigma(l2, eps, delta, mechanism) if mechanism != "none" else 0.0,
        "gap_emp": float(np.mean(gap_emp)),
        "gap_emp_p90": float(np.quantile(gap_emp, 0.9)),
        "gap_fit": float(np.mean(gap_fit)),
        "gap_ci": float(np.mean(gap_ci)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="25 data sets per setting")
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2022)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a DP row has a mean gap >= 0.01")
    args = ap.parse_args(argv)
    reps = 25 if args.quick else args.reps
    t0 = time.time()
    print(f"Distributed DP ROC-GLM vs pooled: {reps} simulated data sets per row (paper's design), "
          f"{args.sites} sites, 2 aggregators, recommended (epsilon, delta)")
    print("gap = mean |AUC_distributed - AUC_pooled|; emp: pooled empirical AUC, fit: pooled ROC-GLM AUC; "
          "ci: mean |lower - lower_pooled| + |upper - upper_pooled|;\nAUC<=.8 / AUC>.8: gap emp among data sets with pooled empirical AUC up to / above 0.8\n")
    head = (f"{'l2-sens':>7} {'eps':>4} {'delta':>5} {'mechanism':>9} {'sigma':>7} "
            f"{'gap emp':>8} {'p90':>7} {'AUC<=.8':>8} {'AUC>.8':>7} {'gap fit':>8} {'ci gap':>7}")
    print(head)
    print("-" * len(head))
    ok = True
    r = run(0.0, "none", reps, args.sites, args.seed)
    print(f"{'-':>7} {'-':>4} {'-':>5} {'no DP':>9} {0.0:>7.4f} {r['gap_emp']:>8.4f} {r['gap_emp_p90']:>7.4f} "
          f"{r['low']:>8.4f} {r['high']:>7.4f} {r['gap_fit']:>8.4f} {r['gap_ci']:>7.4f}")
    for l2 in SENSITIVITIES:
        for mech in ("classic", "analytic"):
            r = run(l2, mech, reps, args.sites, args.seed)
            flag = ""
            if r["gap_emp"] >= 0.01:
                ok, flag = False, "  <-- mean gap >= 0.01"
            print(f"{l2:>7} {r['epsilon']:>4} {r['delta']:>5} {mech:>9} {r['sigma']:>7.4f} "
                  f"{r['gap_emp']:>8.4f} {r['gap_emp_p90']:>7.4f} {r['low']:>8.4f} {r['high']:>7.4f} {r['gap_fit']:>8.4f} {r['gap_ci']:>7.4f}{flag}")
    print(f"\nmean |AUC_distributed - AUC_pooled empirical| below 0.01 in every DP row: {'yes' if ok else 'NO'}")
    print(f"({time.time() - t0:.1f} s)")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
