"""Property checks every sharing scheme must pass: exact totals, coalitions below the threshold learn nothing,
tampering with a redundant scheme never yields a wrong total."""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Sequence

import numpy as np
from scipy import stats

from ..errors import TamperError
from ..sharing import Payload, SharingScheme


def _materialise(scheme: SharingScheme, payload: Payload, n: int) -> np.ndarray:
    out = np.empty(scheme.payload_length(n), dtype=np.uint64)
    scheme.materialize(out, payload)
    return out


def share_sum_combine(scheme: SharingScheme, xs: Sequence[np.ndarray], answering: Iterable[int] | None = None,
                      alter: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Run a whole round by hand: every site splits, every aggregator sums, the analyst combines the sums of
    `answering` aggregators (default all), each passed through `alter(j, sum)` if given (a cheating aggregator)."""
    n = xs[0].size
    sums = [None] * scheme.n_aggregators
    for i, x in enumerate(xs):
        for j, p in enumerate(scheme.split(x.copy(), holder=i % scheme.n_aggregators)):
            if p.vector is not None:
                assert scheme.check_payload(p.vector) is None, "a site produced a payload its scheme refuses"
            if sums[j] is None:
                sums[j] = _materialise(scheme, p, n)
            else:
                scheme.accumulate(sums[j], p)
    use = range(scheme.n_aggregators) if answering is None else answering
    return scheme.combine({j: sums[j] if alter is None else alter(j, sums[j]) for j in use})


def check_exact_reconstruction(scheme: SharingScheme, xs: Sequence[np.ndarray]) -> None:
    """The combined total equals the sum of the inputs mod 2^64, from every set of at least `threshold`
    aggregators (every set, for up to 5 aggregators; otherwise all and the first `threshold`)."""
    expect = np.zeros(xs[0].size, dtype=np.uint64)
    for x in xs:
        expect += x
    n, t = scheme.n_aggregators, scheme.threshold
    subsets: list[tuple[int, ...]] = [tuple(range(n)), tuple(range(t))]
    if n <= 5:
        subsets = [c for k in range(t, n + 1) for c in itertools.combinations(range(n), k)]
    for answering in subsets:
        got = share_sum_combine(scheme, xs, answering)
        np.testing.assert_array_equal(got, expect, err_msg=f"{scheme.name}: wrong total from {answering}")


def coalition_view(scheme: SharingScheme, x: np.ndarray, coalition: Sequence[int], reps: int) -> list[np.ndarray]:
    """What the aggregators in `coalition` receive from one site sharing `x`, over `reps` fresh splits: each
    member's payload, and (for coalitions of two or more) their sum in the scheme's group, which is where
    a linear scheme that hides each share alone but not their sum would leak."""
    seen = []
    for r in range(reps):
        payloads = scheme.split(x.copy(), holder=r % scheme.n_aggregators)
        views = [_materialise(scheme, payloads[j], x.size) for j in coalition]
        seen += views
        if len(views) > 1:
            joint = views[0].copy()
            for j in coalition[1:]:
                scheme.accumulate(joint, payloads[j])
            seen.append(joint)
    return seen


def looks_uniform_and_input_independent(view_a: list[np.ndarray], view_b: list[np.ndarray], bits: int = 64,
                                        alpha: float = 1e-9) -> bool:
    """Would catch a biased or input-dependent share: each of the low `bits` bit positions balanced (binomial
    z-test) and the two views' top 32 bits from one distribution (KS test). `alpha` bounds the chance that a
    uniform scheme fails (Bonferroni over all the tests); a leaky share fails with p-values far below any
    such bound, so a small `alpha` costs no power and keeps a test suite from failing at random."""
    def frequencies(vectors: list[np.ndarray]) -> tuple[np.ndarray, int]:
        v = np.concatenate(vectors)
        b = (v[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)
        return b.mean(axis=0), v.size

    (fa, na), (fb, nb) = frequencies(view_a), frequencies(view_b)
    z_limit = stats.norm.isf(alpha / 2 / (2 * 2 * bits))  # two-sided, 2 * bits tests, half of alpha
    balanced = all(np.abs(f - 0.5).max() < z_limit * 0.5 / np.sqrt(n) for f, n in ((fa, na), (fb, nb)))
    shift = np.uint64(bits - 32)
    top_a = (np.concatenate(view_a) >> shift).astype(np.float64)
    top_b = (np.concatenate(view_b) >> shift).astype(np.float64)
    return balanced and stats.ks_2samp(top_a, top_b).pvalue > alpha / 2


def check_coalitions_learn_nothing(scheme: SharingScheme, *, d: int = 64, reps: int = 200,
                                   max_colluding: int | None = None, alpha: float = 1e-9) -> None:
    """Every coalition of `max_colluding` aggregators (default: the scheme's own threat model's figure) sees
    shares that look uniform and the same for an all-zero input and a large one. `alpha` bounds the chance
    that a scheme that does hide its inputs fails, over all the coalitions together."""
    k = scheme.threat_model.max_colluding_servers if max_colluding is None else max_colluding
    if k == 0:
        raise AssertionError(f"the {scheme.name} scheme protects against no coalition at all")
    inputs = (np.zeros(d, dtype=np.uint64), np.full(d, 2**63 + 12345, dtype=np.uint64))
    coalitions = list(itertools.combinations(range(scheme.n_aggregators), k))
    for coalition in coalitions:
        a, b = (coalition_view(scheme, x, coalition, reps) for x in inputs)
        assert looks_uniform_and_input_independent(a, b, scheme.element_bits, alpha / len(coalitions)), \
            f"{scheme.name}: aggregators {coalition} together learn something about the input"


def check_tamper_detected(scheme: SharingScheme, xs: Sequence[np.ndarray], cheat: int,
                          alter: Callable[[np.ndarray], np.ndarray]) -> TamperError:
    """With every aggregator answering and aggregator `cheat` altering its sum, combining raises
    `TamperError` whose suspects include `cheat` (never a wrong total); returns the error."""
    try:
        got = share_sum_combine(scheme, xs, alter=lambda j, v: alter(v.copy()) if j == cheat else v)
    except TamperError as exc:
        assert cheat in exc.suspects, f"{scheme.name}: TamperError suspects {exc.suspects}, the cheat was {cheat}"
        return exc
    expect = np.zeros(xs[0].size, dtype=np.uint64)
    for x in xs:
        expect += x
    raise AssertionError(f"{scheme.name}: an altered sum was combined without TamperError "
                         f"({'a wrong' if not np.array_equal(got, expect) else 'the right'} total came back)")
