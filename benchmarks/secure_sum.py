"""Embedded secure sum vs the plain numpy sum of the same vectors, in one run.

    python benchmarks/secure_sum.py            # full grid
    python benchmarks/secure_sum.py --quick    # d <= 1e5

Prints, for K sites with vectors of length d and N aggregators, the median
wall time of `LocalFederation.secure_sum` (encode, split with AES-CTR seeds,
aggregate, combine, decode) and of `acc += v` over the same K vectors, and
their ratio. Target: ratio <= 10 at K=10, d=1e6, N=2.

Where the time goes at K=10, d=1e6, N=2 (cProfile, ~25 ms a round on a host whose
plain sum takes ~2.5 ms): AES-CTR keystreams ~7 ms (each site expands its seed
once, keeping the stream whole for its aggregator, which adds it instead of
expanding the seed again: ~0.7 ms per 8 MB, OpenSSL's speed), fixed-point
encoding ~8 ms (one add rounds to the ring's resolution, an integer subtract
extracts the value, two reductions check the range), masking ~2 ms, the
aggregators' sums ~5.5 ms (20 vectors of 8 MB read from memory), combine and
decode ~1.2 ms, Python per-message work the rest. The plain sum is one
memory-bound pass per site (~0.25 ms).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from secagg_roc import LocalFederation


def median_time(fn, repeats: int) -> float:
    fn()  # warm up: page faults, imports, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plain_sum(vectors: list[np.ndarray]) -> np.ndarray:
    acc = np.zeros_like(vectors[0])
    for v in vectors:
        acc += v
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip d = 1e6")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    dims = [10**3, 10**5] if args.quick else [10**3, 10**5, 10**6]
    print(f"{'K':>4} {'d':>8} {'N':>2} {'plain ms':>10} {'secure ms':>10} {'ratio':>7}")
    for k in (10, 100):
        for d in dims:
            if k * d > 10**7 and args.quick:
                continue
            vectors = [rng.standard_normal(d) for _ in range(k)]
            sites = [f"s{i}" for i in range(k)]
            values = dict(zip(sites, vectors))
            plain = median_time(lambda: plain_sum(vectors), args.repeats)
            for n in (2, 3):
                fed = LocalFederation(sites, n_aggregators=n)  # the default arguments: light transcripts
                total = fed.secure_sum(values)
                assert np.allclose(total, plain_sum(vectors), atol=k * 2.0**-31)
                secure = median_time(lambda: fed.secure_sum(values), args.repeats)
                print(f"{k:>4} {d:>8.0e} {n:>2} {plain * 1e3:>10.2f} {secure * 1e3:>10.2f} {secure / plain:>7.1f}")


if __name__ == "__main__":
    main()
