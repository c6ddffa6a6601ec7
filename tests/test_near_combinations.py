"""Near combinations (`queries.combinations`) as a Site judges them: a pair's product among many covariates is
found by fits of packed pairs (fewer fits than pairs), and a combination off in a class of the label is judged
within that class only where the policy allows an analysis that sums values over classes (glm, brier)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg_roc.queries import combinations as cb
from secagg_roc.queries.registry import SiteData

Q = 5


def _role_arrays(covariates: list[str]):
    return lambda role: {"label": ["y"], "covariate": covariates}.get(role, [])


def _many_covariates(seed: int, n: int, m: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {f"x{j}": np.round(rng.normal(50, 10, n), 2) for j in range(m)}
    arrays["y"] = (np.arange(n) % 2).astype(np.int64)
    return arrays


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), pair=st.sampled_from([(0, 1), (3, 7), (10, 11), (2, 2)]),
       off=st.integers(1, Q - 1))
def test_a_product_of_two_of_many_covariates_off_in_a_few_records_is_found_by_fewer_fits_than_pairs(
        seed, pair, off):
    """12 covariates over 150 records: too many squares and products for one fit (90 terms), so the pairs'
    terms are packed into fits the records can hold (each at most 35 terms); a column that is x_i * x_j (or
    x_i^2) but in 1..q-1 records is refused, naming those arrays."""
    seen: list[int] = []
    real = cb.near_combination

    def counted(b, basis, min_cell, s):
        seen.append(basis.shape[1])
        return real(b, basis, min_cell, s)

    arrays = _many_covariates(seed, 150, 12)
    i, j = pair
    arrays["z"] = arrays[f"x{i}"] * arrays[f"x{j}"]
    arrays["z"][:off] += 7.5
    names = [f"x{k}" for k in range(12)] + ["z"]
    cb.near_combination = counted
    try:
        problems = cb.near_combinations(SiteData("h", arrays), [("covariate", "z")], Q, _role_arrays(names),
                                        analyses=("sum",))
    finally:
        cb.near_combination = real
    assert problems and f"x{i}" in problems[0] and f"x{j}" in problems[0], problems
    assert len(seen) < 66 and max(seen) <= (150 - (Q - 1)) // cb.RECORDS_PER_COLUMN - 1, seen


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(60, 300))
def test_unrelated_covariates_are_no_near_combination_when_the_pairs_are_packed(seed, n):
    arrays = _many_covariates(seed, n, 8)
    names = [f"x{k}" for k in range(8)]
    uses = [("covariate", name) for name in names]
    assert cb.near_combinations(SiteData("h", arrays), uses, Q, _role_arrays(names)) == []


def _off_in_one_case(seed: int) -> dict[str, np.ndarray]:
    """total = a + b but in 8 records: 7 controls and 1 case (red team 6's attack)."""
    rng = np.random.default_rng(seed)
    a, b = np.round(rng.uniform(1, 5, 80), 2), np.round(rng.uniform(1, 5, 80), 2)
    y = (np.arange(80) % 2).astype(np.int64)
    total = a + b
    group = np.r_[np.flatnonzero(y == 0)[:7], np.flatnonzero(y == 1)[:1]]
    total[group] += np.r_[np.round(rng.uniform(0.5, 3, 7), 2), 1.6]
    return {"y": y, "a": a, "b": b, "total": total}


@pytest.mark.parametrize("seed", range(5))
def test_a_combination_off_in_one_record_of_a_class_is_refused_where_an_analysis_sums_over_classes(seed):
    site = SiteData("h", _off_in_one_case(seed))
    uses, roles = [("covariate", "total")], _role_arrays(["a", "b", "total"])
    for analyses in (("glm",), ("brier",), ("glm", "sum")):
        problems = cb.near_combinations(site, uses, Q, roles, analyses)
        assert problems == [f"covariate total is a combination of a, b but for fewer than {Q} records here"]
    # Over all records it is off in 8 records: no analysis that sums only over all records gives that case.
    assert cb.near_combinations(site, uses, Q, roles, ("sum", "roc")) == []


def test_only_records_outside_the_kept_rows_span_are_undetermined():
    """The records a trimmed fit cannot place (a 0/1 cell it left out whole) are set aside as extrapolated;
    every record of a full-rank fit, and every record inside the kept rows' span, is judged."""
    from secagg_roc.queries.trimmed_fit import _undetermined

    rng = np.random.default_rng(0)
    M = np.hstack([np.ones((30, 1)), rng.normal(size=(30, 3))])
    assert not _undetermined(M, np.arange(25)).any()
    lone = np.hstack([M, (np.arange(30) == 29).astype(float)[:, None]])  # record 29 alone in its cell
    assert np.flatnonzero(_undetermined(lone, np.arange(29))).tolist() == [29]
    assert not _undetermined(lone, np.arange(30)).any()  # kept: its cell is fitted, not extrapolated
