"""The second simulation speed-up pass: what each shortcut keeps (results, checks, the interpreter's state)."""

from __future__ import annotations

import gc
import threading

import numpy as np

import secagg_roc as sr
from secagg_roc.ring import FixedPoint, shared_codec
from secagg_roc.round import _disagreeing
from secagg_roc.simulation import gc_pace
from secagg_roc.simulation.gc_pace import BATCH_GEN0_THRESHOLD, fewer_collections


def test_fewer_collections_raises_gen0_inside_and_restores_the_thresholds_after() -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, 11, 12)
    try:
        with fewer_collections():
            assert gc.get_threshold() == (BATCH_GEN0_THRESHOLD, 11, 12)
            with fewer_collections():  # re-entrant: the inner block leaves the outer's threshold
                pass
            assert gc.get_threshold()[0] == BATCH_GEN0_THRESHOLD
        assert gc.get_threshold() == (700, 11, 12)
    finally:
        gc.set_threshold(*before)


def test_fewer_collections_never_lowers_a_higher_threshold_and_restores_after_an_error() -> None:
    before = gc.get_threshold()
    gc.set_threshold(50_000, 10, 10)
    try:
        try:
            with fewer_collections():
                assert gc.get_threshold()[0] == 50_000
                raise RuntimeError("a task failed")
        except RuntimeError:
            pass
        assert gc.get_threshold() == (50_000, 10, 10)
    finally:
        gc.set_threshold(*before)


def test_overlapping_batches_in_threads_restore_the_thresholds_once_the_last_ends() -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def first() -> None:
        with fewer_collections():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with fewer_collections():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.get_threshold()[0])  # the first batch ended: still raised for this one
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [BATCH_GEN0_THRESHOLD]
        assert gc.get_threshold() == (700, 10, 10)
        assert gc_pace._state["depth"] == 0
    finally:
        gc.set_threshold(*before)


def test_run_tasks_gives_the_same_records_whatever_the_collectors_pace() -> None:
    header = sr.simulation.design_header(sr.simulation.MASTER_SEED)
    tasks = [(0, 0), (60, 1)]
    paced = sr.simulation.run_tasks(tasks, header)
    gc.disable()  # no collection at all, against one every 10,000 allocations
    try:
        unpaced = [sr.simulation.run_task(header["master_seed"], sr.simulation.paper_grid()[s], i,
                                          **{k: header[k] for k in ("n_sites", "mechanism", "ties", "alpha")})
                   for s, i in tasks]
    finally:
        gc.enable()
    assert [sr.simulation.runner.dumps(r) for r in paced] == [sr.simulation.runner.dumps(r) for r in unpaced]


def test_shared_codec_is_one_object_per_precision_sites_and_saturation_and_encodes_as_a_fresh_one() -> None:
    a, b = shared_codec(32, 5, True), shared_codec(32, 5, True)
    assert a is b
    assert shared_codec(32, 5, False) is not a and shared_codec(31, 5, True) is not a
    assert shared_codec(32, 6, True).max_encoded < FixedPoint(32, 5).max_encoded
    x = np.array([0.25, -3.5, 1e-9, 2.0**20])
    fresh = FixedPoint(32, max_sites=5, saturate=True)
    assert np.array_equal(a.encode(x), fresh.encode(x))
    assert a.encoding_for(x) == fresh.encoding_for(x)


def test_sites_of_a_federation_share_the_encoding_object_and_a_secure_sum_stays_exact() -> None:
    fed = sr.LocalFederation(["a", "b", "c"], transcripts=False)
    assert fed._bare is None  # made at the first secure sum, not with the federation
    total = fed.secure_sum({"a": np.array([1.5, 2.0]), "b": np.array([0.25, -1.0]), "c": np.array([3.0, 0.5])})
    assert np.allclose(total, [4.75, 1.5])
    codecs = {id(s._codecs[(fed.frac_bits, False)]) for s in fed._bare_sites.values()}
    assert len(codecs) == 1


def _share(site: str, layout: tuple, records: int = 3):
    from secagg_roc.messages import InputShare, RoundId
    from secagg_roc.ring import Encoding
    return InputShare(RoundId("s", 1, bytes(32)), site, 0, Encoding(32, False), records, layout,
                      vector=np.zeros(1, dtype=np.uint64))


def test_agreement_check_finds_the_odd_share_and_passes_equal_forms_built_separately() -> None:
    same = [_share(s, (("v", (1,), False),)) for s in "abc"]  # equal, not identical, layouts and encodings
    assert _disagreeing(same) == []
    odd = same[:2] + [_share("c", (("w", (1,), False),))]
    assert _disagreeing(odd) == ["c"]
    tie = [_share("a", (("v", (1,), False),)), _share("b", (("w", (1,), False),))]
    assert _disagreeing(tie) == ["a", "b"]


def test_array_digest_is_kept_for_read_only_arrays_and_follows_a_writeable_arrays_content() -> None:
    from secagg_roc.array_digest import array_digest
    a = np.arange(5.0)
    d = array_digest(a)
    a[0] = 7.0  # writeable: never kept, the new content gives a new digest
    assert array_digest(a) != d
    frozen = np.arange(5.0)
    frozen.flags.writeable = False
    assert array_digest(frozen) == d and array_digest(frozen) is array_digest(frozen)
    assert array_digest(np.arange(5.0).reshape(5, 1)) != d  # the shape is bound
    assert array_digest(np.arange(5, dtype=np.int64)) != d  # and the dtype


def test_released_start_key_tells_apart_pairs_that_join_to_the_same_bytes() -> None:
    from secagg_roc.stats.rocglm_rows import released_start
    rng = np.random.default_rng(3)
    neg, pos = np.sort(rng.normal(0, 1, 40)), np.sort(rng.normal(1.2, 1, 30))
    moved = np.concatenate([neg, pos[:1]]), pos[1:]  # the same bytes end to end, split elsewhere
    a, b = released_start(neg, pos, 20, "strict"), released_start(*moved, 20, "strict")
    assert a is not None and b is not None and not np.array_equal(a, b)


def test_flatten_gives_one_layout_object_per_layout_and_a_plain_verdict_is_kept_only_for_plain_ones() -> None:
    from secagg_roc.layout import flatten
    from secagg_roc.round import _plain_layout
    a, _ = flatten({"score": np.zeros(2), "rows": np.array([3])}, {"score": "float", "rows": "int"})
    b, _ = flatten({"rows": np.array([1]), "score": np.ones(2)}, {"score": "float", "rows": "int"})
    assert a is b and _plain_layout(a) and _plain_layout(a)
    bad = (("score", (2,), 1),)  # an int where a bool belongs: refused every time, never kept
    assert not _plain_layout(bad) and not _plain_layout(bad)
    assert not _plain_layout((("score", [2], False),))  # a list shape
    assert not _plain_layout([("score", (2,), False)])  # a list, not a tuple


def test_a_dp_releases_ledger_key_is_the_text_it_was_with_the_parameters_converted_again() -> None:
    import hashlib
    from types import SimpleNamespace

    from secagg_roc.plans import Step
    from secagg_roc.queries import canonical_params
    from secagg_roc.site_releases import _SORTED_JSON, NoisyReleases
    from secagg_roc.stats.roc_release import SCORES
    step = Step(SCORES, {"label": "y", "score": "s", "score_range": (0, 1.5), "epsilon": 0.25,
                         "nested": {2: [1, 2.5, None, True]}})
    site = SimpleNamespace(study="st", data_digest="ab" * 32)
    for contributors in (None, ("b", "a")):
        parts = ["st", SCORES, canonical_params(step.params), "ab" * 32]
        if contributors is not None:
            parts.append(sorted(contributors))
        expected = hashlib.sha256(_SORTED_JSON(parts).encode()).hexdigest()
        assert NoisyReleases._release_key(site, step, contributors) == expected


def test_scipys_scalar_normal_functions_give_the_ufuncs_bits_and_the_binormal_auc_is_unchanged() -> None:
    from scipy.integrate import quad
    from scipy.special import cython_special, ndtr, ndtri

    from secagg_roc.stats.rocglm import binormal_auc
    rng = np.random.default_rng(11)
    ts = np.concatenate([rng.random(20_000), rng.random(200) * 1e-12, 1 - rng.random(200) * 1e-12, [0.0, 0.5, 1.0]])
    xs = np.concatenate([rng.normal(0, 6, 20_000), [-40.0, -8.3, 0.0, 8.3, 40.0]])
    for t in ts.tolist():
        a, b = float(ndtri(t)), cython_special.ndtri(t)
        assert a == b or (np.isnan(a) and np.isnan(b))
    assert all(float(ndtr(x)) == cython_special.ndtr(x) for x in xs.tolist())
    for g1, g2 in [(0.8, 1.1), (-0.3, 0.4), (2.5, 3.0), (0.0, 1e-6)]:
        ufunc_integral, _ = quad(lambda t: float(ndtr(g1 + g2 * ndtri(t))), 0.0, 1.0, epsabs=1e-13, epsrel=1e-12,
                                 limit=200)
        assert binormal_auc(g1, g2)[0] == ufunc_integral
