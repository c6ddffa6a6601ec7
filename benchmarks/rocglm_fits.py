"""Distributed ROC-GLM fits per second against the pooled fit, in one run.

    python benchmarks/rocglm_fits.py            # 2 sites, n = 1000, non-private mode, default arguments
    python benchmarks/rocglm_fits.py --seconds 10

Fits the ROC-GLM through an embedded study (`Study.local` with its default
arguments: every round goes through the sites' and aggregators' checks) and
`pooled.roc_glm` on the same records for `--seconds` each, and prints both
rates and their ratio. The target is 200 fits/s per core.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

import secagg_roc as sr


def rate(fn, seconds: float) -> float:
    fn()  # warm up
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        k += 1
    return k / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--records", type=int, default=1000)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the non-private mode says so on every fit
    rng = np.random.default_rng(0)
    n = args.records
    y = rng.integers(0, 2, n)
    s = np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1)
    half = n // 2
    data = {"a": {"y": y[:half], "score": s[:half]}, "b": {"y": y[half:], "score": s[half:]}}
    policy = sr.Policy(allow_non_private=True, min_cell_count=1, roles={"label": ["y"], "score": ["score"]})
    study = sr.Study.local(data, policy=policy)
    distributed = rate(lambda: sr.roc_glm(study, "y", "score", epsilon=None), args.seconds)
    pooled = rate(lambda: sr.pooled.roc_glm(y, s), args.seconds)
    print(f"ROC-GLM, 2 sites, n={n}: distributed {distributed:.1f} fits/s, pooled {pooled:.1f} fits/s, "
          f"ratio {pooled / distributed:.1f}x")


if __name__ == "__main__":
    main()
