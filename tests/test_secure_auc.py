"""The secure AUC: exact against scikit-learn, and the analyst receives the AUC and nothing else."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.metrics import roc_auc_score

import secagg_roc as sr
from secagg_roc.aggregator import Aggregator, RoundPolicy
from secagg_roc.messages import AggregateShare, CloseRound, decode
from secagg_roc.mpc.messages import AucRelease, MpcMaterial, MpcOpen, from_limbs, to_limbs
from secagg_roc.mpc.secure_auc import P, auc_from_blinded
from secagg_roc.plans.runner import join_params
from secagg_roc.sharing import make_scheme


def make_study(rng, sizes, *, decimals=3, bins=1000, **options):
    data, ys, ss = {}, [], []
    for k, n in enumerate(sizes):
        y = np.r_[0, 1, rng.integers(0, 2, n - 2)]
        s = np.clip(np.round(rng.normal(0.45 + 0.15 * y, 0.2), decimals), 0, 1 - 10.0 ** -decimals)
        data[f"h{k}"] = {"y": y, "p": s}
        ys.append(y)
        ss.append(s)
    policy = sr.Policy(analyses=("secure_auc", "score_histogram"), histogram_bins=bins, min_cell_count=1)
    return sr.Study.local(data, policy=policy, **options), np.concatenate(ys), np.concatenate(ss)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), sites=st.integers(2, 5), aggregators=st.integers(2, 3))
def test_secure_auc_equals_sklearn_on_a_grid(seed, sites, aggregators):
    rng = np.random.default_rng(seed)
    study, y, s = make_study(rng, rng.integers(5, 80, sites), n_aggregators=aggregators)
    auc = sr.secure_auc(study, label="y", score="p")
    assert auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert auc.n_records == y.size


def test_ties_within_a_bucket_count_half_as_the_histogram_auc():
    rng = np.random.default_rng(2)
    study, y, s = make_study(rng, [200, 150], decimals=4, bins=20)  # many scores share a bucket
    auc = sr.secure_auc(study, label="y", score="p")
    h = sr.score_histogram(study, label="y", score="p")
    assert auc == pytest.approx(h.auc(), abs=1e-15)
    assert abs(auc - roc_auc_score(y, s)) > 1e-6  # coarse buckets: not the exact AUC


def test_the_analyst_receives_one_value_and_no_histogram():
    rng = np.random.default_rng(3)
    study, y, s = make_study(rng, [60, 70, 80], transcripts=True)
    auc = sr.secure_auc(study, label="y", score="p")
    analyst = list(study.transcript("analyst"))
    auc_round = {e.round_number for e in analyst if e.kind == "AucRelease"}
    assert len(auc_round) == 1
    (number,) = auc_round
    received = [e for e in analyst if e.round_number == number]
    # In the AUC's round the analyst gets round statuses (which sites were accepted) and one AucRelease.
    assert {e.kind for e in received} == {"RoundStatus", "AucRelease"}
    (release,) = [e.message for e in received if e.kind == "AucRelease"]
    assert release.value == float(auc) and release.wire_size() < 80
    for e in received:
        if e.kind == "RoundStatus":
            assert set(e.message.accepted) <= set(study.sites)
    # No party but the aggregators receives a share of the kept sums, and no aggregator an unmasked one.
    for party in study.sites:
        kinds = {e.kind for e in study.transcript(party) if e.round_number == number}
        assert kinds <= {"Query", "RoundStatus", "AucRelease"}
    agg = [e for e in study.transcript("aggregator-1") if e.round_number == number]
    assert {e.kind for e in agg} >= {"MpcMaterial", "MpcOpen", "InputShare"}
    assert not any(e.kind == "AggregateShare" for e in agg)


def test_the_analyst_cannot_get_the_kept_histogram_by_asking_for_the_round_directly():
    rng = np.random.default_rng(4)
    study, _, _ = make_study(rng, [40, 40])
    # Through the study: a kept round is not a secure sum.
    with pytest.raises(sr.SiteQueryError, match="per-site|not"):
        study.aggregate("histogram.shares", {"label": "y", "score": "p", "score_range": [0.0, 1.0], "bins": 1000})
    # Crafting the run by hand and running the plan's own step as a plain round: the sites answer (it is the
    # plan's step), but the aggregators keep their shares and reply with a status, so nothing combines.
    run = "probe1"
    args = {"label": "y", "score": "p", "bins": 1000}
    study.aggregate("run.join", join_params(run, "secure_auc", args, study.policy.digest()))
    step = {"run": run, "step": 1, "contributors": sorted(study.sites), "label": "y", "score": "p",
            "score_range": [0.0, 1.0], "bins": 1000, "decimals": None}
    fed = study.federation
    with pytest.raises(sr.RoundError, match="kept by the aggregators"):
        fed.run_query(study.site_objects, "histogram.shares", step)
    for agg in fed.aggregators:
        number = max(agg.rounds)
        reply = agg.handle(CloseRound(agg.rounds[number].round_id, tuple(study.sites)))
        assert not isinstance(reply, AggregateShare)


def test_an_aggregator_without_joint_computation_opens_no_kept_round():
    rng = np.random.default_rng(5)
    study, _, _ = make_study(rng, [30, 30])
    fed = study.federation
    query = fed._query("histogram.shares", {"run": "x", "step": 1}, None)
    plain = Aggregator(fed.study_id, 0, RoundPolicy(frozenset(fed.sites)), make_scheme("additive", 2))
    with pytest.raises(sr.RoundError, match="jointly"):
        plain.open(query)


def test_a_study_without_joint_computation_refuses_the_secure_auc_before_any_site_joins():
    # A deployed study's aggregators do not compute jointly on kept sums: the run used to go as far as its join
    # (every site logging the join's release in its ledger) before the first joint round was refused.
    from secagg_roc.study import LocalStudy

    class WithoutJoint(LocalStudy):
        joint_computations = False

    rng = np.random.default_rng(4)
    study, _, _ = make_study(rng, [30, 30])
    plain = WithoutJoint({n: d.arrays for n, d in study.site_data.items()}, policy=study.policy, transcripts=True)
    with pytest.raises(sr.PolicyError, match="do not run joint computations on kept sums"):
        sr.secure_auc(plain, label="y", score="p")
    assert list(plain.transcript("analyst")) == []  # not even the join was sent
    assert all(plain.ledger(s).exact_counts == {} for s in plain.sites)


def test_the_plan_needs_the_policy_and_the_grid():
    rng = np.random.default_rng(6)
    study, _, _ = make_study(rng, [30, 30])
    coarse = sr.Study.local({k: v.arrays for k, v in study.site_data.items()},
                            policy=sr.Policy(analyses=("secure_auc",), min_cell_count=2))
    with pytest.raises(sr.PolicyError, match="histogram_bins"):
        sr.secure_auc(coarse, label="y", score="p", bins=7)
    other = sr.Study.local({k: v.arrays for k, v in study.site_data.items()},
                           policy=sr.Policy(analyses=("brier",)))
    with pytest.raises(sr.PolicyError, match="not allowed"):
        sr.secure_auc(other, label="y", score="p")


def test_messages_round_trip_on_the_wire_and_in_a_wire_federation():
    rid = sr.LocalFederation(["a", "b"])._query("histogram.shares", {}, None).round_id
    vals = [0, 1, P - 1, 2**200 + 5]
    assert from_limbs(to_limbs(vals)) == vals
    for m in (MpcOpen(rid, 1, 7, np.arange(3, dtype=np.uint64), to_limbs(vals)),
              MpcMaterial(rid, 0, np.arange(2, dtype=np.uint64), to_limbs(vals)), AucRelease(rid, 0.625)):
        back = decode(m.encode())
        assert type(back) is type(m) and back == m
    assert auc_from_blinded(0, 0) != auc_from_blinded(0, 0)  # an empty class: NaN


def test_blinding_reveals_only_the_ratio():
    # (r num, r den) for a random r: the opened pair for (3, 4) and for (6, 8) has the same distribution,
    # and each component alone is uniform; the ratio recovered is the reduced fraction.
    import secrets

    for num, den in ((3, 4), (6, 8), (2**62 - 1, 2**62)):
        r = secrets.randbelow(P - 1) + 1
        assert auc_from_blinded(r * num % P, r * den % P) == num / den


def test_every_message_is_listed_in_the_protocol_specs():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "protocols"

    def role(party, sites):
        return "analyst" if party == "analyst" else "aggregator" if party.startswith("aggregator-") else "site"

    rng = np.random.default_rng(8)
    for name, run in (("secure-auc", lambda s: sr.secure_auc(s, label="y", score="p")),
                      ("score-histograms", lambda s: sr.score_histogram(s, label="y", score="p"))):
        spec = tomllib.loads((root / f"{name}.toml").read_text())
        study, _, _ = make_study(rng, [40, 50, 60], n_aggregators=3, transcripts=True)
        run(study)
        fed = study.federation
        seen = {(role(e.sender, fed.sites), role(party, fed.sites), e.kind)
                for party, t in fed.transcripts.items() for e in t}
        listed = {(m["sender"], m["receiver"], m["kind"]) for m in spec["messages"]}
        assert seen and not seen - listed, (name, sorted(seen - listed))


def test_the_trusted_host_baseline_says_so():
    rng = np.random.default_rng(10)
    data = {f"h{k}": {"y": np.r_[0, 1, rng.integers(0, 2, 30)], "p": rng.random(32)} for k in range(2)}
    study = sr.Study.local(data, policy=sr.Policy(analyses=("secure_auc", "score_histogram"), min_cell_count=1),
                           scheme="plaintext")
    assert sr.secure_auc(study, label="y", score="p").mode == "trusted host"
    assert sr.score_histogram(study, label="y", score="p").mode == "trusted host"


@pytest.mark.parametrize("scheme,ok", [("additive", True), ("replicated", True), ("shamir", False),
                                       ("pairwise", False)])
def test_secure_auc_runs_under_the_schemes_whose_shares_it_takes_and_refuses_the_others(scheme, ok):
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(8)
    data = {f"h{k}": {"y": np.r_[[0, 1] * 3, rng.integers(0, 2, 30)], "p": rng.random(36).round(3)} for k in range(3)}
    study = sr.Study.local(data, min_cell_count=1, scheme=scheme)
    y = np.concatenate([d["y"] for d in data.values()])
    p = np.concatenate([d["p"] for d in data.values()])
    if ok:
        assert float(sr.secure_auc(study, label="y", score="p")) == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    else:
        with pytest.raises(sr.RoundError, match="runs under additive or replicated or plaintext sharing"):
            sr.secure_auc(study, label="y", score="p")
        assert all(a.open_rounds() == 0 for a in study.federation.aggregators)
