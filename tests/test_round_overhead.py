"""The round-overhead shortcuts give exactly what they replace: memoised pure functions hand out copies, kept
constants are the values computed afresh, and the cheaper checks refuse what the old ones refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.special import xlogy

import secagg_roc as sr
from secagg_roc.errors import SiteQueryError
from secagg_roc.layout import flatten
from secagg_roc.queries.common import labels
from secagg_roc.queries.registry import SiteData, _digest, json_digest, params_json
from secagg_roc.ring import FixedPoint
from secagg_roc.stats import fisher
from secagg_roc.stats.families import fisher_parts
from secagg_roc.stats.survival import default_thresholds

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@given(arrays(np.float64, (2, 2), elements=finite), arrays(np.float64, 2, elements=finite))
def test_a_kept_newton_solve_is_the_fresh_one_and_handed_out_as_a_copy(matrix, score):
    keep = np.ones(2, dtype=bool)
    first = fisher._solve(matrix, score, keep)
    fresh = fisher._solve_now(matrix, score, keep)
    if fresh is None:
        assert first is None and fisher._solve(matrix, score, keep) is None
        return
    np.testing.assert_array_equal(first, fresh)
    first[:] = 12345.0  # a caller changing its step changes nobody else's
    np.testing.assert_array_equal(fisher._solve(matrix, score, keep), fresh)


def test_the_threshold_grid_is_a_fresh_array_each_time():
    a = default_thresholds(30)
    a[:] = 0.0
    np.testing.assert_array_equal(default_thresholds(30), np.linspace(0.0, 1.0, 30)[1:-1])


def test_the_kept_policy_digest_is_the_digest_of_its_content():
    policy = sr.Policy(privacy_level=7, roles={"label": ["y"], "score": ["s"]},
                       dp=sr.DPPolicy(epsilon=1.0, delta=1e-5, l2_sensitivity=0.1))
    first = policy.digest()
    assert policy.digest() == first
    other = policy.replace(privacy_level=8)
    assert other.digest() != first
    assert other.replace(privacy_level=7).digest() == first
    assert policy == other.replace(privacy_level=7)  # the kept digest is no field: equality is unchanged


@settings(max_examples=60)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    arrays(np.float64, n, elements=st.sampled_from([0.0, 1.0, 0.25, 0.75])),
    arrays(np.float64, (n, 2), elements=finite), arrays(np.float64, n, elements=st.floats(0, 50)))),
    arrays(np.float64, 2, elements=st.floats(-3, 3)), st.sampled_from(["logit", "probit"]), st.booleans())
def test_fisher_parts_with_kept_response_terms_are_bitwise_the_fresh_ones(rows, beta, family, observed):
    y, X, w = rows
    fixed: dict = {}
    fresh = fisher_parts(y, X, w, beta, family, observed=observed)
    for _ in range(2):  # the call that fills `fixed`, then one that reads it
        kept = fisher_parts(y, X, w, beta, family, observed=observed, fixed=fixed)
        for a, b in zip(kept, fresh):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fixed["sat_0"], xlogy(1.0 - y, 1.0 - y))


@given(arrays(np.float64, st.integers(1, 30), elements=st.sampled_from([0.0, 1.0, -0.0, 2.0, 0.5, -1.0])))
def test_labels_refuse_exactly_what_np_isin_refuses(raw):
    site = SiteData("a", {"y": raw})
    if np.isin(raw, (0, 1)).all():
        np.testing.assert_array_equal(labels(site, "y"), raw.astype(np.int64))
    else:
        with pytest.raises(SiteQueryError, match="other than 0 and 1"):
            labels(site, "y")


@given(st.dictionaries(st.sampled_from(["a", "b", "c.d", "e_f"]),
                       st.one_of(arrays(np.float64, st.integers(0, 4), elements=finite),
                                 arrays(np.int64, (2, 2), elements=st.integers(-99, 99)),
                                 arrays(np.bool_, 3)), min_size=1),
       st.booleans())
def test_flatten_is_the_per_array_cast_and_join(values, declared):
    kinds = {n: ("int" if v.dtype.kind in "iub" else "float") for n, v in values.items()} if declared else None
    layout, flat = flatten(values, kinds)
    names = sorted(values)
    integer = [values[n].dtype.kind in "iub" for n in names]
    dtype = np.int64 if all(integer) else np.float64
    assert layout == tuple((n, values[n].shape, i) for n, i in zip(names, integer))
    expected = np.concatenate([values[n].reshape(-1).astype(dtype) for n in names])
    assert flat.dtype == expected.dtype
    np.testing.assert_array_equal(flat, expected)


@settings(max_examples=60)
@given(arrays(np.float64, st.integers(1, 70), elements=st.floats(-1e6, 1e6)), st.integers(0, 40), st.booleans())
def test_fixed_point_encoding_is_scaled_and_rounded_values(x, frac_bits, saturate):
    codec = FixedPoint(frac_bits, max_sites=5, saturate=saturate)
    if not saturate and np.any(np.abs(x) > codec.max_float):
        return  # refused, as before
    clipped = np.clip(x, -codec.max_float, codec.max_float)
    expected = np.rint(clipped * 2.0 ** frac_bits).astype(np.int64).view(np.uint64)
    np.testing.assert_array_equal(codec.encode(x), expected)


@given(st.dictionaries(st.text(max_size=5), st.one_of(finite, st.text(max_size=4), st.lists(finite, max_size=3)),
                       max_size=4),
       st.sampled_from(["glm.newton", "rocglm.counts"]), st.integers(0, 62))
def test_the_quantity_digest_is_the_digest_of_the_whole_canonical_object(canon, name, frac_bits):
    import hashlib
    import json

    blob = json.dumps({"study": "s-1", "query": name, "params": canon, "frac_bits": frac_bits},
                      sort_keys=True, separators=(",", ":")).encode()
    assert _digest("s-1", name, canon, frac_bits) == hashlib.sha256(blob).digest()
    assert json_digest("s-1", name, params_json(canon), frac_bits) == hashlib.sha256(blob).digest()


def test_a_site_plan_copy_keeps_warnings_quiet_with_or_without_an_ignore_filter():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 400)
    s = np.clip(0.3 * y + 0.7 * rng.random(400), 0, 1)
    data = {"a": {"y": y[:200], "score": s[:200]}, "b": {"y": y[200:], "score": s[200:]}}
    policy = sr.Policy(allow_non_private=True, min_cell_count=1, roles={"label": ["y"], "score": ["score"]})
    results = []
    for quiet in (True, False):
        study = sr.Study.local(data, policy=policy, transcripts=False)
        with warnings.catch_warnings(record=True) as seen:
            if quiet:
                warnings.simplefilter("ignore")
            else:
                warnings.simplefilter("always")
            results.append(sr.roc_glm(study, "y", "score", epsilon=None))
        if not quiet:  # the analyst's own non-private warning, once: the sites' plan copies add none
            assert [w.category.__name__ for w in seen] == ["NonPrivateWarning"]
    assert results[0].auc == results[1].auc and list(results[0].params) == list(results[1].params)
