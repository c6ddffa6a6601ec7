"""Distributed ROC-GLM fits per second against the pooled fit, in one run.

    python benchmarks/rocglm_fits.py            # 2 sites, n = 1000, non-private mode, default arguments
    python benchmarks/rocglm_fits.py --seconds 2 --repeat 7

Fits the ROC-GLM through an embedded study (`Study.local` with its default
arguments: every round goes through the sites' and aggregators' checks) and
`pooled.roc_glm` on the same records, alternating `--seconds` of each
`--repeat` times, and prints both rates, their ratio and the medians, by wall
time and by this process's CPU time (which other processes on the machine
disturb less). The target is 200 fits/s per core.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np

import secagg_roc as sr


def rate(fn, seconds: float) -> tuple[float, float]:
    """(calls per wall second, calls per CPU second of this process) over about `seconds`."""
    fn()  # warm up
    start, cpu, k = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - start < seconds:
        fn()
        k += 1
    return k / (time.perf_counter() - start), k / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of each measurement")
    parser.add_argument("--repeat", type=int, default=3, help="alternating measurements of each (medians printed)")
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
    runs = []
    for _ in range(args.repeat):
        distributed = rate(lambda: sr.roc_glm(study, "y", "score", epsilon=None), args.seconds)
        pooled = rate(lambda: sr.pooled.roc_glm(y, s), args.seconds)
        runs.append((distributed, pooled))
        print(f"ROC-GLM, 2 sites, n={n}: distributed {distributed[0]:.1f} fits/s, pooled {pooled[0]:.1f} fits/s, "
              f"ratio {pooled[0] / distributed[0]:.1f}x (per CPU second: {distributed[1]:.1f} and {pooled[1]:.1f}, "
              f"{pooled[1] / distributed[1]:.1f}x)")
    if args.repeat > 1:
        med = [statistics.median(r[i][k] for r in runs) for i in (0, 1) for k in (0, 1)]
        ratio = statistics.median(r[1][0] / r[0][0] for r in runs)
        ratio_cpu = statistics.median(r[1][1] / r[0][1] for r in runs)
        print(f"median of {args.repeat}: distributed {med[0]:.1f} fits/s, pooled {med[2]:.1f} fits/s, ratio "
              f"{ratio:.1f}x (per CPU second: {med[1]:.1f} and {med[3]:.1f}, {ratio_cpu:.1f}x)")


if __name__ == "__main__":
    main()
