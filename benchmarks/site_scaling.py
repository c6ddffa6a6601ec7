"""Many sites in one embedded study: the cost per site of a run, as K grows.

    python benchmarks/site_scaling.py              # K = 100, 1,000, 4,000
    python benchmarks/site_scaling.py --full       # and K = 10,000

Each of K sites holds one 3-vector; the analyst runs the declared `sum`
analysis (a join, then one secure sum, every site checking both rounds, the
contributor set and its ledger) on `Study.local` with its default arguments.
Printed per K: the study's set-up, the median run, the run's cost per site,
and that per-site cost as a ratio to the smallest K's in the same run. A
round's work is linear in K when the ratio stays near 1: every site checks the
K-name contributor set, and an embedded federation (one process, one message
for all sites) checks each distinct set once (`secagg_roc.site_sets`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import secagg_roc.stats as sr
from secagg_roc import Policy, Study


def measure(k: int, repeats: int) -> tuple[float, float]:
    """(set-up seconds, median seconds of one run) for K=`k` sites."""
    sites = {f"s{i:05d}": {"x": np.ones((1, 3))} for i in range(k)}
    t0 = time.perf_counter()
    study = Study.local(sites, policy=Policy(privacy_level=1, analyses=["sum"]))
    setup = time.perf_counter() - t0
    expected = 3.0 * k
    sr.column_sums(study, "x")  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = sr.column_sums(study, "x")
        times.append(time.perf_counter() - t0)
        assert float(np.sum(total)) == expected
    return setup, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also K = 10,000 (about a minute)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per K (default 3; the median is printed)")
    args = parser.parse_args()
    ks = [100, 1000, 4000] + ([10000] if args.full else [])
    print(f"{'K':>6} {'set-up s':>9} {'run ms':>9} {'us per site':>12} {'ratio':>6}")
    base = None
    for k in ks:
        setup, run = measure(k, args.repeats)
        per_site = run / k
        base = base or per_site
        print(f"{k:>6} {setup:>9.2f} {run * 1e3:>9.1f} {per_site * 1e6:>12.1f} {per_site / base:>6.2f}")
    print("(ratio: cost per site against K = 100 in this run; a join and a sum per run)")


if __name__ == "__main__":
    main()
