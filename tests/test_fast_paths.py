"""The per-round fast paths agree with the definitions they shortcut, and a curious analyst gets nothing more
from them: digests of canonical text, memoised digests, the same-value check, the design caches, the
layout check, whole-mask splits of short vectors, batched trimming of settled rounds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import testing as kit
from secagg_roc.aggregator import Aggregator, RoundPolicy
from secagg_roc.errors import MessageError, SiteQueryError
from secagg_roc.messages import InputShare, Query, RoundId
from secagg_roc.plans.base import REL_TOL, ABS_TOL, same_value
from secagg_roc.queries import canonical_params, json_digest, message_digest, params_json, query_digest
from secagg_roc.queries import glm as qglm
from secagg_roc.queries.registry import SiteData
from secagg_roc.ring import FixedPoint, Encoding
from secagg_roc.sharing import AdditiveSharing
from secagg_roc.sharing.additive import WHOLE_MASKS
from secagg_roc.stats.survival import default_thresholds

# -- canonical parameters and their digests --------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=8))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
params = st.dictionaries(st.text(max_size=8), json_values, max_size=6)


@given(params, names, st.integers(0, 62))
def test_digest_of_canonical_text_is_the_query_digest(p, name, frac_bits):
    text = params_json(canonical_params(p))
    assert json_digest("study-1", name, text, frac_bits) == query_digest("study-1", name, p, frac_bits)
    assert message_digest("study-1", name, text, frac_bits) == query_digest("study-1", name, p, frac_bits)


@given(params, params)
def test_two_different_queries_never_share_a_digest(a, b):
    """The memoised digest is keyed by the message's own text: different parameters, different digests."""
    ta, tb = params_json(canonical_params(a)), params_json(canonical_params(b))
    da, db = message_digest("s", "q", ta, 32), message_digest("s", "q", tb, 32)
    assert (da == db) == (ta == tb)
    assert message_digest("s", "q", ta, 31) != da and message_digest("s", "r", ta, 32) != da


@given(params)
def test_non_canonical_text_gets_the_digest_of_its_canonical_form(p):
    """A query whose text is spaced or ordered differently is digested as before: over its canonical form."""
    loose = json.dumps(canonical_params(p), indent=1)
    assert message_digest("s", "q", loose, 32) == query_digest("s", "q", json.loads(loose), 32)


@pytest.mark.parametrize("text", ['{"a":NaN}', '{"a":[1.0,Infinity]}', '{"a":{"b":-Infinity}}'])
def test_a_digest_over_non_finite_text_is_refused(text):
    """The analyst digests the raw text of a non-finite parameter itself: the fast path must not accept it."""
    with pytest.raises(SiteQueryError, match="finite"):
        message_digest("s", "q", text, 32)
    rid = RoundId("s", 0, json_digest("s", "q", text, 32))
    agg = Aggregator("s", 0, RoundPolicy(frozenset({"a", "b"})), AdditiveSharing(2))
    with pytest.raises(SiteQueryError, match="finite"):
        agg.open(Query(rid, "q", text, 32))
    assert not agg.rounds


def test_a_deeply_nested_query_is_refused_cleanly():
    text = '{"a":' + "[" * 5000 + "]" * 5000 + "}"
    with pytest.raises((MessageError, SiteQueryError), match="nested too deeply"):
        message_digest("s", "q", text, 32)


# -- the same-value check of a request against a site's plan ---------------------------------------------

def reference_same_value(a, b) -> bool:
    """The definition (the check before its fast paths)."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(reference_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(reference_same_value(a[k], b[k]) for k in a)
    return False


near = st.sampled_from([0, 1, -1, True, False, 1.0, -0.0, 0.0, 1 + 1e-12, 1.5, math.nan, math.inf, "1", None])
plain = st.recursive(near, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from("ab"), inner,
                                                                                        max_size=2), max_leaves=8)


@given(plain, plain)
@settings(max_examples=400)
def test_same_value_is_its_definition(a, b):
    assert same_value(a, b) == reference_same_value(a, b)


@given(st.lists(near, max_size=6))
def test_same_value_of_a_list_against_itself_and_its_variants(xs):
    """Equal lists (even holding the same NaN object), and lists that differ only by a bool against a number."""
    assert same_value(xs, list(xs)) == reference_same_value(xs, list(xs))
    swapped = [1 if x is True else x for x in xs]
    assert same_value(xs, swapped) == reference_same_value(xs, swapped)


def test_same_value_keeps_bools_apart_from_numbers():
    assert not same_value([True, 2.0], [1, 2.0]) and not same_value([[0]], [[False]])
    assert same_value([1, 2.5], [1.0, 2.5 * (1 + 1e-12)]) and not same_value([math.nan], [math.nan])


# -- the site's design caches ------------------------------------------------------------------------------

def _site(arrays=None, public=None) -> SiteData:
    rng = np.random.default_rng(3)
    arrays = arrays or {"y": rng.integers(0, 2, 40), "x": rng.normal(size=40)}
    return SiteData("a", arrays, public or {})


def _fisher(site, center, scale, beta=(0.1, -0.2)):
    params = canonical_params({"design": {"kind": "arrays", "y": "y", "X": ["x"], "weights": None}, "family": "logit",
                               "beta": list(beta), "center": center, "scale": scale})
    return qglm.glm_fisher(site, params).values


@given(st.floats(-3, 3), st.floats(0.1, 5), st.floats(-3, 3), st.floats(0.1, 5))
@settings(max_examples=30)
def test_standardized_designs_are_kept_per_centre_and_scale(c1, s1, c2, s2):
    """Two scalings never share a kept matrix: every result is the one computed afresh."""
    site = _site()
    for c, s in ((c1, s1), (c2, s2), (c1, s1)):
        got = _fisher(site, [c], [s])
        qglm._DESIGNS_BUILT.clear()
        fresh = _fisher(site, [c], [s])
        for k in got:
            np.testing.assert_array_equal(got[k], fresh[k])


def test_a_changed_writeable_derived_array_is_not_taken_from_the_cache():
    ref = np.linspace(0.1, 0.9, 9)
    data = {"y": np.array([0, 1] * 10), "score": np.linspace(0, 1, 20)}
    design = {"kind": "rocglm", "label": "y", "score": "score", "score_range": [0.0, 1.0], "grid": 10,
              "ties": "half"}
    site = SiteData("a", data, {"rocglm.negatives": ref})
    first = qglm.build_design(site, {"design": design})
    ref[:] = ref[::-1].copy() * 0 + 0.5  # the plan never does this; a cache must still not hide it
    second = qglm.build_design(SiteData("a", data, {"rocglm.negatives": ref}), {"design": design})
    assert not np.array_equal(first[2], second[2])


def test_the_rocglm_design_names_its_grid_or_its_thresholds():
    data = {"y": np.array([0, 1] * 10), "score": np.linspace(0, 1, 20)}
    site = SiteData("a", data, {"rocglm.negatives": np.linspace(0, 1, 10)})
    base = {"kind": "rocglm", "label": "y", "score": "score", "score_range": [0.0, 1.0], "ties": "half"}
    by_grid = qglm.build_design(site, {"design": {**base, "grid": 30}})
    t = default_thresholds(30).tolist()
    by_list = qglm.build_design(site, {"design": {**base, "grid": 30, "thresholds": t}})
    for a, b in zip(by_grid, by_list):
        np.testing.assert_array_equal(a, b)
    for bad in ({}, {"grid": True}, {"grid": "30"}, {"grid": 2}):
        with pytest.raises(SiteQueryError, match="grid|thresholds"):
            qglm.build_design(site, {"design": {**base, **bad}})


# -- the round's layout check ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [
    [("v", (3,), True)],  # a list, not a tuple
    (["v", (3,), True],),
    (("v", [3], True),),
    (("v", (np.int64(3),), True),),
    (("v", (True,), True),),
    (("v", (3.0,), True),),
    (("v", (3,), 1),),
    (("v", (-3,), True),),
    (("bad name!", (3,), True),),
    (("v", (3,)),),
    "v",
])
def test_the_round_refuses_a_layout_the_wire_could_not_carry(layout):
    policy = RoundPolicy(frozenset({"a", "b"}))
    agg = Aggregator("s", 0, policy, AdditiveSharing(2))
    rid = RoundId("s", 0, query_digest("s", "secure_sum", {}, 32))
    agg.open(Query(rid, "secure_sum", "{}", 32))
    share = InputShare(rid, "a", 0, Encoding(0, True), 10, layout, vector=np.zeros(3, dtype=np.uint64))
    with pytest.raises(MessageError, match="layout"):
        agg.handle(share)
    assert not agg.rounds[0].accepted


# -- short vectors split with whole masks --------------------------------------------------------------------

@given(st.integers(2, 4), st.integers(1, WHOLE_MASKS + 3), st.data())
@settings(max_examples=40)
def test_additive_shares_sum_to_the_input_at_every_length(n, d, data):
    scheme, codec = AdditiveSharing(n), FixedPoint(0, max_sites=4)
    x = np.array(data.draw(st.lists(st.integers(-2**40, 2**40), min_size=d, max_size=d)), dtype=np.int64)
    holder = data.draw(st.integers(0, n - 1))
    payloads = scheme.share(x, codec, holder=holder)
    total = np.zeros(d, dtype=np.uint64)
    for p in payloads:
        scheme.accumulate(total, p)
    np.testing.assert_array_equal(total.view(np.int64), x)
    whole = d <= WHOLE_MASKS
    assert all((p.seed is None) == whole for j, p in enumerate(payloads) if j != holder)


def test_whole_masks_are_uniform_fresh_and_independent_of_the_input():
    """What N-1 aggregators see of a short vector's split looks uniform, the same for two inputs, and is new
    every time (the statistical test that would catch a leaky share, `testing.properties`)."""
    for n in (2, 3):
        scheme, codec, d = AdditiveSharing(n), FixedPoint(0, max_sites=4), WHOLE_MASKS
        views = []
        for x in (np.zeros(d, dtype=np.int64), np.full(d, -(2**60) - 12345, dtype=np.int64)):
            seen = []
            for r in range(200):
                payloads = scheme.share(x, codec, holder=r % n)
                coalition = [p.vector for j, p in enumerate(payloads) if j != n - 1]  # N-1 of them
                seen += coalition
            views.append(seen)
        assert kit.looks_uniform_and_input_independent(*views)
        assert len({v.tobytes() for v in views[0]}) == len(views[0])


def test_a_split_with_given_seeds_is_still_re_created_exactly_when_short():
    scheme, codec = AdditiveSharing(3), FixedPoint(32, max_sites=3)
    x = np.array([1.5, -2.25, 3.0])
    seeds = scheme.fresh_seeds(1)
    first, again = scheme.share(x, codec, holder=1, seeds=seeds), scheme.share(x, codec, holder=1, seeds=seeds)
    assert [p.seed for p in first] == [seeds.get(j) for j in range(3)]
    np.testing.assert_array_equal(first[1].vector, again[1].vector)


# -- the embedded study end to end -----------------------------------------------------------------------------

def test_many_fits_keep_state_bounded_and_results_identical():
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 300)
    s = np.clip(0.3 * y + 0.7 * rng.random(300), 0, 1)
    data = {"a": {"y": y[:150], "score": s[:150]}, "b": {"y": y[150:], "score": s[150:]}}
    policy = sr.Policy(allow_non_private=True, min_cell_count=1, roles={"label": ["y"], "score": ["score"]})
    study = sr.Study.local(data, policy=policy)
    with pytest.warns(sr.stats.results.NonPrivateWarning):
        first = sr.roc_glm(study, "y", "score", epsilon=None)
    pooled = sr.pooled.roc_glm(y, s)
    assert abs(first.auc - pooled.auc) < 1e-9
    for _ in range(60):  # 305 rounds (5 a fit): past the aggregators' trimming of settled rounds
        with pytest.warns(sr.stats.results.NonPrivateWarning):
            again = sr.roc_glm(study, "y", "score", epsilon=None)
        assert (again.auc, tuple(again.params)) == (first.auc, tuple(first.params))
    for agg in study.federation.aggregators:
        assert len(agg.rounds) <= agg.keep_settled + agg.keep_settled // 8 + agg.max_open_rounds
    counts = study.transcript("aggregator-0").counts  # every message counted, light transcript or not
    assert counts["InputShare"] == 2 * counts["Query"] == 2 * counts["CloseRound"] == 2 * 61 * 5
