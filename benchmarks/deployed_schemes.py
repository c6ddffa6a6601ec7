"""One declared analysis on a deployed study under each scheme the services run, as ratios to additive.

    python benchmarks/deployed_schemes.py            # K=5 site agents, 5 timed runs per scheme
    python benchmarks/deployed_schemes.py --sites 3 --repeats 3

Each scheme gets its own loopback deployment (real processes, mutual TLS 1.3,
SQLite with synchronous=FULL) with the same K sites' data; the analyst runs
the Brier score (a run's join, then one secure sum) once to warm up and then
`--repeats` times. Printed per scheme: the median wall time of one analysis
and its ratio to additive sharing with two aggregators, measured in the same
run ("1 down": the last aggregator's process killed before the warm-up). Pairwise masking adds three site-server round trips per secure sum (keys,
encrypted shares, the unmask answers) to the one of the other schemes, with one
server instead of two or three aggregators.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import secagg_roc.stats as sr
from secagg_roc.deploy.local_cluster import LocalCluster

SCHEMES = {  # name -> LocalCluster settings
    "additive (2 aggregators)": {"n_aggregators": 2},
    "shamir 2-of-3": {"n_aggregators": 3, "scheme": "shamir", "threshold": 2},
    "shamir 2-of-3, 1 down": {"n_aggregators": 3, "scheme": "shamir", "threshold": 2, "down": 1},
    "pairwise (1 server)": {"n_aggregators": 1, "scheme": "pairwise"},
}


def site_data(k: int, n: int = 200) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = {}
    for i in range(k):
        y = rng.integers(0, 2, n)
        out[f"site-{i}"] = {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1).round(4)}
    return out


def analysis_seconds(settings: dict, data: dict, repeats: int) -> tuple[float, float]:
    """(median seconds of one Brier analysis, its value) on a fresh deployment with `settings`."""
    settings = dict(settings)
    down = settings.pop("down", 0)
    with tempfile.TemporaryDirectory() as folder:
        cluster = LocalCluster(folder, data, round_timeout_s=30.0, policy={"min_cell_count": 1}, **settings)
        with cluster.start(), cluster.study() as study:
            for name in cluster.aggregator_names[len(cluster.aggregator_names) - down:]:
                cluster.kill(name)  # its process gone: the others carry every round
            value = float(sr.brier_score(study, "y", "score"))  # warm-up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                sr.brier_score(study, "y", "score")
                times.append(time.perf_counter() - start)
    return statistics.median(times), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=5, help="site agents (default 5)")
    parser.add_argument("--repeats", type=int, default=5, help="timed analyses per scheme (default 5)")
    args = parser.parse_args()
    data = site_data(args.sites)
    results = {name: analysis_seconds(settings, data, args.repeats) for name, settings in SCHEMES.items()}
    base, value = results["additive (2 aggregators)"]
    print(f"Brier score on a loopback deployment, K={args.sites} site agents, median of {args.repeats}")
    for name, (seconds, got) in results.items():
        same = "same value" if got == value else f"VALUE DIFFERS: {got!r} vs {value!r}"
        print(f"  {name:26s} {seconds * 1000:7.0f} ms   ratio {seconds / base:5.2f}   ({same})")


if __name__ == "__main__":
    main()
