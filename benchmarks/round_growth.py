"""Does a round cost more after many rounds? Consecutive embedded Brier runs, first tenth vs last tenth.

Usage:
    python benchmarks/round_growth.py            # 3000 runs (a join and a sum each), ~15 s
    python benchmarks/round_growth.py --runs 50000 --window 500   # 100,000 rounds; first/last 1,000 rounds

Prints the mean time per run over the first and the last tenth of the runs
(or `--window` runs)
(their ratio is the growth; 1.0 is flat) and the process's peak RSS after the
first tenth, half-way and at the end, then the trend over the whole run: the medians of blocks of that many runs
and their Theil-Sen slope with its 95% interval (0 inside it: no growth the host's noise does not explain).
The study uses `Study.local`'s default arguments.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
from scipy import stats

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
    times, rss_early, rss_half = [], 0.0, 0.0
    for i in range(args.runs):
        start = time.perf_counter()
        sr.brier_score(study, "y", "score")
        times.append(time.perf_counter() - start)
        if i == tenth:
            rss_early = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if i == args.runs // 2:  # bounded state fills in the first runs (transcripts keep their last 20,000)
            rss_half = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    warm = min(100, args.runs - 2 * tenth) if args.window else 0  # imports and caches fill in the first runs
    first, last = 1e3 * np.mean(times[warm:warm + tenth]), 1e3 * np.mean(times[-tenth:])
    rss_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ends = f"{tenth} runs" + (f" (after {warm} warm-up runs)" if warm else "")
    print(f"{args.runs} runs ({2 * args.runs} rounds): first {ends} {first:.2f} ms/run, last {tenth} {last:.2f} ms/run, "
          f"ratio {last / first:.2f}; peak RSS {rss_early:.0f} MiB -> {rss_half:.0f} MiB half-way -> {rss_end:.0f} MiB "
          f"({1024 * (rss_end - rss_early) / max(1, args.runs - tenth):.1f} KiB/run)")
    print(trend(times[warm:], tenth))


def trend(times: list[float], block: int) -> str:
    """The growth over the whole run, robust to the host's bursts: the medians of consecutive blocks of runs,
    their Theil-Sen slope (per 10,000 runs, relative to the first block) with its 95% interval."""
    medians = [float(np.median(times[i:i + block])) for i in range(0, len(times) - block + 1, block)]
    if len(medians) < 3:
        return "trend: fewer than 3 blocks"
    slope, _, low, high = stats.theilslopes(medians)
    per = 1e4 / block / medians[0] * 100  # slope per block -> % of the first block's median per 10,000 runs
    first_last = medians[-1] / medians[0]
    return (f"trend over {len(medians)} blocks of {block} runs (block medians): last/first {first_last:.2f}, "
            f"slope {slope * per:+.2f}% per 10,000 runs (95% interval {low * per:+.2f}% .. {high * per:+.2f}%)")


if __name__ == "__main__":
    main()
