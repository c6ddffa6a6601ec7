"""What the Analyst interpolates under Shamir sharing: the two 32-bit limb sums of every element, not only the
ring total they make. Bare limbs told it, for every element, how many sites' values were negative (their high
limbs are near 2^32) and how many low limbs carried: beyond the total, something of each site's own value (two
sites, total 2: -1 and 3, or 1 and 1). A Site now masks its limbs (`sharing.shamir.carry_masks`); the totals
stay exact (here, and in every scheme property test), and the limb sums no longer tell those cases apart."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from scipy import stats

from secagg_roc import field
from secagg_roc.ring import FixedPoint
from secagg_roc.sharing.shamir import ShamirSharing, carry_mask_bits


def _analyst_limbs(scheme: ShamirSharing, values: list[float], codec: FixedPoint) -> tuple[np.ndarray, float]:
    """(the limb sums the Analyst interpolates from t aggregators' sums, the decoded total)."""
    sums: list[np.ndarray | None] = [None] * scheme.n_aggregators
    for i, v in enumerate(values):
        for j, payload in enumerate(scheme.share(np.array([v]), codec, holder=i)):
            sums[j] = payload.vector.copy() if sums[j] is None else field_sum(sums[j], payload.vector)
    base = list(range(scheme.threshold))
    limbs = field.combination([sums[j] for j in base], field.lagrange_at([j + 1 for j in base], 0))
    total = scheme.combine({j: sums[j] for j in base})
    return limbs, float(codec.decode(total)[0])


def field_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = a.copy()
    field.add(out, b)
    return out


@pytest.mark.parametrize("t,n", [(2, 3), (3, 5)])
def test_the_limb_sums_do_not_tell_how_many_sites_were_negative(t: int, n: int) -> None:
    scheme, codec = ShamirSharing(n, t), FixedPoint(32, max_sites=2)
    seen: dict[str, list[tuple[int, int]]] = {"-1 and 3": [], "1 and 1": []}
    for case, values in (("-1 and 3", [-1.0, 3.0]), ("1 and 1", [1.0, 1.0])):
        for _ in range(300):
            limbs, total = _analyst_limbs(scheme, values, codec)
            assert total == 2.0  # exact, whatever the masks
            seen[case].append((int(limbs[0]) >> 32, int(limbs[1]) >> 32))  # the low limbs' carries, the signs
    for k, what in enumerate(("carries of the low limbs", "high limbs' wraps (negative values)")):
        a = [pair[k] for pair in seen["-1 and 3"]]
        b = [pair[k] for pair in seen["1 and 1"]]
        assert len(set(a)) > 250 and len(set(b)) > 250, what  # masked: spread, not one value per case
        assert stats.ks_2samp(a, b).pvalue > 1e-6, what  # and alike in both cases (bare: always 1 vs 0)


@settings(max_examples=60, deadline=None)
@given(values=hst.lists(hst.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=12),
       t_n=hst.sampled_from([(2, 2), (2, 3), (3, 4)]))
def test_masked_limbs_keep_the_total_exact(values: list[float], t_n: tuple[int, int]) -> None:
    codec = FixedPoint(32, max_sites=len(values))
    scheme = ShamirSharing(t_n[1], t_n[0])
    _, total = _analyst_limbs(scheme, values, codec)
    expect = np.zeros(1, dtype=np.uint64)
    for v in values:
        expect += codec.encode(np.array([v]))
    assert total == float(codec.decode(expect)[0])


def test_the_masks_leave_room_for_every_site_below_p() -> None:
    for k in (1, 2, 3, 10, 16, 17, 1000, 1 << 20):
        s = carry_mask_bits(k)
        assert s >= 8 and k * (2**32) * (2**s + 1) < field.P, k  # K masked limbs sum below p
    assert carry_mask_bits(10) == 24
