"""The site queries' fast paths give what the plain numpy expressions give: the finiteness check of a
role's array (a sum, then min/max, instead of a copy and a mask) and the sum over the records of an
array (one record: a read-only view of it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from secagg_roc.queries.basic import _sum_rows
from secagg_roc.queries.checks import role_problems
from secagg_roc.queries.registry import SiteData

_FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=64)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, st.integers(0, 40), elements=_FLOATS))
def test_the_finiteness_check_refuses_exactly_the_arrays_with_a_nan_or_an_infinity(values) -> None:
    problems = role_problems(SiteData("s", {"score": values}), [("score", "score")], detail=True)
    bad = int(np.count_nonzero(~np.isfinite(values)))
    if bad:
        assert problems == [f"score array 'score' contains NaN or infinite values ({bad} entries)"]
    else:
        assert problems == []


def test_the_finiteness_check_leaves_integer_and_float32_arrays_to_the_same_rules() -> None:
    ints = SiteData("s", {"w": np.arange(5, dtype=np.int64), "f": np.array([1.0, np.inf], np.float32)})
    assert role_problems(ints, [("weight", "w")]) == []
    assert role_problems(ints, [("score", "f")]) == ["score array 'f' contains NaN or infinite values"]


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=12),
                  elements=st.floats(-1e300, 1e300, width=64)))
def test_the_row_sum_equals_numpys_sum_over_the_records_axis(x) -> None:
    # The same additions in the same order: equal values (0.0 == -0.0 for a zero total).
    total = _sum_rows(x)
    assert total.shape == x.sum(axis=0).shape
    np.testing.assert_array_equal(total, x.sum(axis=0))


def test_the_sum_of_one_record_is_a_read_only_view_of_it_and_the_data_stay_untouched() -> None:
    x = np.arange(12.0).reshape(1, 3, 4)
    total = _sum_rows(x)
    np.testing.assert_array_equal(total, x.sum(axis=0))
    assert not total.flags.writeable and np.shares_memory(total, x)
    with pytest.raises(ValueError, match="read-only"):
        total += 1.0
    assert x.flags.writeable and np.array_equal(x, np.arange(12.0).reshape(1, 3, 4))


def test_finite_values_whose_sum_overflows_pass_the_finiteness_check() -> None:
    huge = np.full(4, 1.5e308)  # finite, but their sum is not
    assert role_problems(SiteData("s", {"score": huge}), [("score", "score")]) == []
    huge[2] = -np.inf
    assert role_problems(SiteData("s", {"score": huge}), [("score", "score")]) == [
        "score array 'score' contains NaN or infinite values"]
