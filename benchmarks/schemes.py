"""Every sharing scheme's embedded secure sum against the plain numpy sum, in one run.

    python benchmarks/schemes.py             # K = 10, d = 1e3, 1e5, 1e6
    python benchmarks/schemes.py --quick     # d <= 1e5

For K sites with vectors of length d, prints the median wall time of
`LocalFederation.secure_sum` with each scheme's defaults (light transcripts,
no wire copies) and its ratio to `acc += v` over the same vectors, measured
in the same run. Shamir pays for two 32-bit limbs per element and a field
multiply per coefficient and aggregator; replicated sharing for three pairs
of full vectors; pairwise masking for a key agreement per round and K - 1
pairwise keystreams per site (quadratic in K on the complete graph).
"""

from __future__ import annotations

import argparse

import numpy as np

from secagg_roc import LocalFederation

from secure_sum import median_time, plain_sum  # noqa: E402  (benchmarks/ is the script's folder)

SETUPS = [
    ("plaintext", dict(scheme="plaintext")),
    ("additive 2-of-2", dict(scheme="additive", n_aggregators=2)),
    ("additive 3-of-3", dict(scheme="additive", n_aggregators=3)),
    ("shamir 2-of-3", dict(scheme="shamir", n_aggregators=3, threshold=2)),
    ("shamir 3-of-5", dict(scheme="shamir", n_aggregators=5, threshold=3)),
    ("replicated", dict(scheme="replicated")),
    ("pairwise (K/2+1)", dict(scheme="pairwise")),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip d = 1e6")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sites", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    k = args.sites
    dims = [10**3, 10**5] if args.quick else [10**3, 10**5, 10**6]
    print(f"K = {k} sites; ratio = secure sum / plain numpy sum, both measured here")
    print(f"{'scheme':<18} {'d':>8} {'plain ms':>10} {'secure ms':>10} {'ratio':>8}")
    for d in dims:
        vectors = [rng.standard_normal(d) for _ in range(k)]
        sites = [f"s{i}" for i in range(k)]
        values = dict(zip(sites, vectors))
        plain = median_time(lambda: plain_sum(vectors), args.repeats)
        for label, kw in SETUPS:
            fed = LocalFederation(sites, **kw)
            assert np.allclose(fed.secure_sum(values), plain_sum(vectors), atol=k * 2.0**-31)
            secure = median_time(lambda: fed.secure_sum(values), args.repeats)
            print(f"{label:<18} {d:>8.0e} {plain * 1e3:>10.2f} {secure * 1e3:>10.2f} {secure / plain:>8.1f}")


if __name__ == "__main__":
    main()
