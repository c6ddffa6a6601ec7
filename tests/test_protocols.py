"""Each protocol spec lists every message its parties receive; running the protocol proves it."""

import tomllib
from pathlib import Path

import numpy as np
import pytest

import secagg_roc as sr
import secagg_roc.pairwise
import secagg_roc.sharing  # noqa: F401
from secagg_roc.messages import Message

PROTOCOLS = Path(__file__).resolve().parent.parent / "protocols"


def load(name):
    with open(PROTOCOLS / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


def role_of(party, sites):
    if party == "analyst":
        return "analyst"
    if party.startswith("aggregator-"):
        return "aggregator"
    assert party in sites
    return "site"


def allowed(spec):
    return {(m["sender"], m["receiver"], m["kind"]) for m in spec["messages"]}


def seen(fed):
    out = set()
    for party, transcript in fed.transcripts.items():
        for e in transcript:
            out.add((role_of(e.sender, fed.sites), role_of(party, fed.sites), e.kind))
    return out


@pytest.mark.parametrize("name", sorted(p.stem for p in PROTOCOLS.glob("*.toml")))
def test_spec_is_well_formed(name):
    spec = load(name)
    assert {"protocol", "parties", "messages", "assumptions", "failures"} <= set(spec)
    assert {p["role"] for p in spec["parties"]} == {"site", "aggregator", "analyst"}
    assert all(p["learns"] for p in spec["parties"])
    kinds = {cls.__name__ for cls in Message.registry.values()} | secagg_roc.pairwise.KINDS
    for m in spec["messages"]:
        assert m["kind"] in kinds, m
        assert m["sender"] in {"site", "aggregator", "analyst"} and m["receiver"] in {"site", "aggregator", "analyst"}


@pytest.mark.parametrize("name, scheme, n", [("additive-secure-sum", "additive", 3), ("plaintext-baseline", "plaintext", 1),
                                             ("shamir-secure-sum", "shamir", 4), ("replicated-secure-sum", "replicated", 3),
                                             ("pairwise-masking", "pairwise", 1)])
def test_parties_receive_only_what_the_spec_lists(name, scheme, n):
    spec = load(name)
    assert spec["protocol"]["scheme"] == scheme
    fed = sr.LocalFederation(["h1", "h2", "h3"], n_aggregators=n, scheme=scheme, wire=True)
    assert fed.scheme.private is spec["protocol"]["private"]
    fed.secure_sum({s: np.arange(4.0) for s in fed.sites}, records={s: 10 for s in fed.sites})
    with pytest.raises(sr.PrivacyError):
        fed.secure_sum({s: np.arange(4.0) for s in fed.sites}, records={s: 1 for s in fed.sites})
    received = seen(fed)
    assert received, "the protocol ran"
    unlisted = received - allowed(spec)
    assert not unlisted, f"{name}: parties received messages the spec does not list: {sorted(unlisted)}"


@pytest.mark.parametrize("name", ["shamir-secure-sum", "replicated-secure-sum", "pairwise-masking"])
def test_spec_threat_model_matches_the_scheme(name):
    """The words in `[threat_model]` state what the scheme's `ThreatModel` says (for n=5, t=3 and n=3)."""
    spec = load(name)["threat_model"]
    n = {"shamir": 5, "replicated": 3, "pairwise": 1}[spec["scheme"]]
    scheme = sr.sharing.make_scheme(spec["scheme"], n, **({"threshold": 3} if spec["scheme"] == "shamir" else {}))
    tm = scheme.threat_model
    n, t = scheme.n_aggregators, scheme.threshold
    assert eval(spec["max_colluding_servers"], {"n": n, "t": t}) == tm.max_colluding_servers
    assert eval(spec["server_dropouts"], {"n": n, "t": t}) == tm.server_dropouts
    assert spec["aggregator alters its aggregate share"].startswith(tm.malicious["aggregator alters its aggregate share"])


def test_the_check_would_catch_an_unlisted_message():
    spec = load("additive-secure-sum")
    assert ("aggregator", "site", "AggregateShare") not in allowed(spec)


@pytest.mark.parametrize("name", ["distributed-rocglm", "declared-analysis"])
def test_analysis_messages_are_all_listed(name):
    spec = load(name)
    rng = np.random.default_rng(3)
    data = {}
    for i, n in enumerate((40, 35, 50)):
        y = rng.integers(0, 2, n)
        data[f"h{i}"] = {"y": y, "score": np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1)}
        data[f"h{i}"]["x"] = rng.normal(size=n)
    policy = sr.Policy(dp=sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016),
                       roles={"label": ["y"], "score": ["score"], "covariate": ["x"]}, analyses=(
        "rocglm", "brier", "calibration", "glm", "sensitivity"))
    study = sr.Study.local(data, n_aggregators=2, policy=policy, seed=1, transcripts=True)
    sr.roc_glm(study, label="y", score="score")
    sr.calibration_curve(study, label="y", score="score")
    sr.brier_score(study, label="y", score="score")
    sr.fit_glm(study, "y", "x")
    sr.dp.l2_sensitivity(study, "x", "score")
    fed = study.federation
    received = seen(fed)
    assert ("aggregator", "analyst", "ForwardedShares") in received and ("aggregator", "site", "ForwardedShares") in received
    assert not any(sender == "site" and receiver == "analyst" for sender, receiver, _ in received)
    unlisted = received - allowed(spec)
    assert not unlisted, f"unlisted messages: {sorted(unlisted)}"
