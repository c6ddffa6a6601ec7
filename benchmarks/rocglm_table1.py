"""Reproduce Table 1 of the distributed ROC-GLM paper: empirical AUC minus ROC-GLM AUC, by AUC bin.

Usage:
    python benchmarks/rocglm_table1.py            # 10000 simulated data sets (~1 min on 2 cores)
    python benchmarks/rocglm_table1.py --quick    # 2000 data sets
    python benchmarks/rocglm_table1.py --reps 500 --distributed 20

Each data set follows the paper's design (benchmarks/_simulation.py); the
ROC-GLM uses the paper's 30-point threshold grid. The ROC-GLM here is the pooled
reference (`secagg_roc.pooled.roc_glm`), which the test suite shows equal to the
distributed non-private ROC-GLM to 1e-9; ``--distributed N`` re-runs the first
N data sets through an embedded 5-site study to show that again.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _simulation import AUC_BINS, auc_bin, generate  # noqa: E402

from secagg_roc import pooled  # noqa: E402
from secagg_roc.stats import roc_glm  # noqa: E402
from secagg_roc.study import Study  # noqa: E402

# Table 1 of the paper (Mean and Median of AUC_emp - AUC_ROC-GLM per bin, 10000 simulations), as
# rendered in the authors' simulation repository README (difuture-lmu/simulations-distr-auc).
PAPER_TABLE1 = {
    0: (0.0040, 0.0005, 431), 1: (0.0027, 0.0006, 505), 2: (0.0014, 0.0009, 465), 3: (0.0015, 0.0012, 482),
    4: (0.0014, 0.0015, 485), 5: (0.0017, 0.0017, 501), 6: (0.0018, 0.0018, 503), 7: (0.0018, 0.0018, 465),
    8: (0.0016, 0.0016, 523), 9: (0.0014, 0.0015, 485), 10: (0.0010, 0.0011, 501), 11: (0.0005, 0.0004, 523),
    12: (-0.0004, -0.0002, 476), 13: (-0.0014, -0.0013, 484), 14: (-0.0025, -0.0026, 520),
    15: (-0.0043, -0.0044, 534), 16: (-0.0065, -0.0065, 515), 17: (-0.0089, -0.0091, 481),
    18: (-0.0113, -0.0113, 503), 19: (-0.0064, -0.0062, 529),
}


def simulate(reps: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    emp, fit = [], []
    failed = 0
    for _ in range(reps):
        y, s = generate(rng)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = pooled.roc_glm(y, s, ties="strict")  # the paper's placement values
        # Kept like the paper's code, which always reports the estimate after the iteration limit:
        # these are separated data (every positive above every negative's survivor threshold).
        failed += not r.glm.converged
        emp.append(pooled.auc(y, s))
        fit.append(r.auc)
    return np.array(emp), np.array(fit), failed


def distributed_check(n: int, seed: int) -> float:
    """Largest |distributed - pooled| ROC-GLM AUC over n data sets split over 5 sites (non-private mode)."""
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(n):
        y, s = generate(rng)
        parts = np.array_split(np.arange(y.size), 5)
        study = Study.local({f"site{k}": {"y": y[p], "score": s[p]} for k, p in enumerate(parts)}, seed=seed,
                            allow_non_private=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            worst = max(worst, abs(roc_glm(study, "y", "score", epsilon=None, ties="strict").auc
                                   - pooled.roc_glm(y, s, ties="strict").auc))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10_000)
    ap.add_argument("--quick", action="store_true", help="2000 data sets")
    ap.add_argument("--seed", type=int, default=31415)
    ap.add_argument("--distributed", type=int, default=0, help="also run N data sets through a 5-site study")
    args = ap.parse_args(argv)
    reps = 2000 if args.quick else args.reps
    t0 = time.time()
    emp, fit, failed = simulate(reps, args.seed)
    diff = emp - fit
    bins = np.array([auc_bin(a) for a in emp])
    print(f"ROC-GLM accuracy, the paper's simulation design: {reps} data sets, seed {args.seed}, "
          f"30-point threshold grid")
    print(f"({failed} fits hit the iteration limit on separated data, AUC ~ 1; kept, as in the paper's code)")
    print("diff = empirical AUC - ROC-GLM AUC; paper = Table 1 of Schalk et al. (10000 data sets)\n")
    head = f"{'AUC bin':>14} {'count':>6} {'mean':>8} {'median':>8} {'mean|d|':>8} {'sd':>7}   {'paper mean':>10} {'median':>7} {'count':>6}"
    print(head)
    print("-" * len(head))
    ok = True
    for b in range(AUC_BINS.size - 1):
        d = diff[bins == b]
        label = f"({AUC_BINS[b]:.3f},{AUC_BINS[b + 1]:.3f}]"
        pm, pmed, pc = PAPER_TABLE1[b]
        if d.size == 0:
            print(f"{label:>14} {0:>6} {'':>8} {'':>8} {'':>8} {'':>7}   {pm:>10.4f} {pmed:>7.4f} {pc:>6}")
            continue
        mad = np.mean(np.abs(d))
        flag = ""
        if AUC_BINS[b + 1] <= 0.95 + 1e-12 and mad >= 0.01:
            ok, flag = False, "  <-- mean |diff| >= 0.01"
        sd = np.std(d, ddof=1) if d.size > 1 else 0.0
        print(f"{label:>14} {d.size:>6} {np.mean(d):>8.4f} {np.median(d):>8.4f} {mad:>8.4f} {sd:>7.4f}   "
              f"{pm:>10.4f} {pmed:>7.4f} {pc:>6}{flag}")
    outside = int(np.sum(bins < 0))
    print(f"\n{outside} data sets with empirical AUC <= 0.5 fall outside the bins. pROC's auc(), which the paper "
          "used, flips the direction of such data sets to an AUC >= 0.5; that puts them into the paper's first "
          "bin and explains its larger mean there. No direction is flipped here.")
    below = AUC_BINS[np.clip(bins, 0, None) + 1] <= 0.95 + 1e-12
    print(f"mean |diff| over all data sets with AUC <= 0.95: {np.mean(np.abs(diff[below & (bins >= 0)])):.4f}")
    print(f"every bin below 0.95 has mean |diff| < 0.01: {'yes' if ok else 'NO'}")
    if args.distributed:
        print(f"distributed (5 sites, non-private) vs pooled ROC-GLM AUC, max |diff| over "
              f"{args.distributed} data sets: {distributed_check(args.distributed, args.seed):.2e}")
    print(f"({time.time() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
