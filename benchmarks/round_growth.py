"""Does a round cost more after many rounds? Consecutive embedded Brier runs, first tenth vs last tenth.

Usage:
    python benchmarks/round_growth.py            # 3000 runs (a join and a sum each), ~15 s
    python benchmarks/round_growth.py --runs 50000 --window 500   # 100,000 rounds; first/last 1,000 rounds

Prints the mean time per run over the first and the last tenth of the runs
(or `--window` runs)
(their ratio is the growth; 1.0 is flat) and the process's peak RSS after the
first tenth and at the end. The study uses `Study.local`'s default arguments.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import secagg_roc as sr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000, help="consecutive Brier runs (default 3000)")
    parser.add_argument("--window", type=int, default=0, help="runs compared at each end (default: a tenth)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = {f"s{k}": {"y": rng.integers(0, 2, 100), "score": rng.random(100)} for k in range(3)}
    study = sr.Study.local(data, policy=sr.Policy(min_cell_count=1), seed=1)
    tenth = args.window or max(1, args.runs // 10)
    times, rss_early = [], 0.0
    for i in range(args.runs):
        start = time.perf_counter()
        sr.brier_score(study, "y", "score")
        times.append(time.perf_counter() - start)
        if i == tenth:
            rss_early = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    warm = min(100, args.runs - 2 * tenth) if args.window else 0  # imports and caches fill in the first runs
    first, last = 1e3 * np.mean(times[warm:warm + tenth]), 1e3 * np.mean(times[-tenth:])
    rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ends = f"{tenth} runs" + (f" (after {warm} warm-up runs)" if warm else "")
    print(f"{args.runs} runs ({2 * args.runs} rounds): first {ends} {first:.2f} ms/run, last {tenth} {last:.2f} ms/run, "
          f"ratio {last / first:.2f}; peak RSS {rss_early:.0f} MiB -> {rss_end:.0f} MiB "
          f"({1024 * (rss_end - rss_early) / max(1, args.runs - tenth):.1f} KiB/run)")


if __name__ == "__main__":
    main()
