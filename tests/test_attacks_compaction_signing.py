"""Red team of signed pairwise keys (`deploy.key_signing`): a malicious server or site tries to get keys
accepted that the named site did not sign (another round, another study, another role, an expired or revoked
certificate, a malleated signature, a crafted identity, an oversize certificate).

Real certificates from the study's own CA code (`deploy.pki`), real ECDSA. Blocked attacks are plain tests;
weaknesses found are ``xfail(strict=True)`` tests asserting the secure behaviour (reason "VULN: ...")."""

from __future__ import annotations

import dataclasses
import json
import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature
from cryptography.x509.oid import NameOID

from secagg_roc.deploy import pki
from secagg_roc.deploy.key_signing import KeySigner, KeyVerifier
from secagg_roc.deploy.revocation import write_crl
from secagg_roc.errors import MessageError
from secagg_roc.pairwise import PairwiseClient
from secagg_roc.pairwise.messages import AdvertiseKeys, NeighbourKeys

STUDY = "study-red"
SITES = ("site-a", "site-b", "site-c", "site-d")
TAG = b"study-red/7/rt"
# Order of the P-256 group: (r, s) and (r, N - s) both verify.
P256_N = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class Study:
    """A study CA and its parties' keys and certificates, written as `secagg-roc keys` lays them out."""

    def __init__(self, root: Path, study: str = STUDY):
        self.root, self.study = root, study
        self.ca_key, self.ca = pki._make_ca(study)
        self.ca_path = root / "ca.pem"
        self.ca_path.write_bytes(pki._cert_pem(self.ca))
        self.certs: dict[tuple[str, str], x509.Certificate] = {}
        for name in SITES:
            self.issue("site", name)
        self.issue("aggregator", "agg-0")
        self.issue("analyst", "analyst")

    def issue(self, role: str, name: str, cert: x509.Certificate | None = None,
              key: ec.EllipticCurvePrivateKey | None = None) -> KeySigner:
        if cert is None:
            key, cert = pki._issue(self.ca_key, self.ca, self.study, role, name, None)
        assert key is not None
        d = self.root / f"{role}-{name}".replace("\n", "_")
        d.mkdir(exist_ok=True)
        (d / "cert.pem").write_bytes(pki._cert_pem(cert)), (d / "key.pem").write_bytes(pki._key_pem(key))
        self.certs[role, name] = cert
        return KeySigner(self.study, d / "cert.pem", d / "key.pem")

    def signer(self, role: str, name: str) -> KeySigner:
        d = self.root / f"{role}-{name}"
        return KeySigner(self.study, d / "cert.pem", d / "key.pem")

    def verifier(self) -> KeyVerifier:
        return KeyVerifier(self.study, self.ca_path, SITES, self.root / "crl.pem")


def _keys(site: int, tag: bytes = TAG) -> AdvertiseKeys:
    return PairwiseClient(site, tag, 3, set(range(len(SITES))) - {site}).advertise_keys()


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Study:
    return Study(tmp_path_factory.mktemp("pki"))


def test_honest_keys_verify_and_any_change_to_a_signed_field_is_refused(study: Study) -> None:
    v = study.verifier()
    honest = study.signer("site", "site-c").sign(_keys(2))
    v.check(honest)
    for field, value in (("c_public", _keys(2).c_public), ("s_public", _keys(2).s_public),
                         ("round_tag", b"study-red/8/rt"), ("site", 1)):
        with pytest.raises(MessageError):
            v.check(dataclasses.replace(honest, **{field: value}))


def test_keys_replayed_from_another_study_or_round_are_refused(study: Study, tmp_path: Path) -> None:
    """A site's signed keys of round 6 replayed in round 7 fail verification if re-tagged, and the pairwise
    client refuses keys whose (signed) round tag is not its round's; keys signed for another study (same site
    name, same CA code, another study id) fail the study check."""
    old = study.signer("site", "site-b").sign(_keys(1, tag=b"study-red/6/rt"))
    study.verifier().check(old)  # a valid signature, but for round 6
    with pytest.raises(MessageError, match="does not verify"):
        study.verifier().check(dataclasses.replace(old, round_tag=TAG))
    me = PairwiseClient(0, TAG, 3, {1, 2, 3})
    me.advertise_keys()
    relayed = NeighbourKeys(TAG, 0, (old, *(_keys(i) for i in (2, 3))))
    with pytest.raises(Exception, match="(?i)round|tag"):
        me.share_keys(relayed)
    other = Study(tmp_path, study="study-other")
    foreign = other.signer("site", "site-b").sign(_keys(1))
    with pytest.raises(MessageError, match="did not issue|not by that site"):
        study.verifier().check(foreign)
    # same CA, a certificate naming another study: refused on the identity
    key, cert = pki._issue(study.ca_key, study.ca, "study-other", "site", "site-b", None)
    cross = study.issue("site", "site-b-x", cert, key).sign(_keys(1))
    with pytest.raises(MessageError, match="not by that site"):
        study.verifier().check(cross)


def test_a_certificate_of_another_role_or_site_is_refused(study: Study) -> None:
    v = study.verifier()
    for role, name in (("aggregator", "agg-0"), ("analyst", "analyst"), ("site", "site-a")):
        forged = study.signer(role, name).sign(_keys(3))
        with pytest.raises(MessageError, match="not by that site"):
            v.check(forged)


def _crafted(study: Study, uri: str, *, not_after: dt.datetime | None = None
             ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate the study CA signed with a hand-written SAN URI (a CA mistake, or a crafted request)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "crafted")]))
            .issuer_name(study.ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=2))
            .not_valid_after(not_after or now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
            .sign(study.ca_key, hashes.SHA256()))
    return key, cert


def test_a_name_with_a_trailing_newline_or_a_second_identity_is_refused(study: Study) -> None:
    v = study.verifier()
    for i, uri in enumerate((f"secagg-roc://{STUDY}/site/site-d\n", f"secagg-roc://{STUDY}/site/site-d/x",
                             f"secagg-roc://{STUDY}/Site/site-d")):
        key, cert = _crafted(study, uri)
        signed = study.issue("site", f"crafted-{i}", cert, key).sign(_keys(3))
        with pytest.raises(MessageError, match="malformed identity|not by that site"):
            v.check(signed)


def test_an_expired_certificate_is_refused_by_sites_and_accepted_only_by_the_servers_replayable_check(
        study: Study) -> None:
    key, cert = _crafted(study, f"secagg-roc://{STUDY}/site/site-d",
                         not_after=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1))
    signed = study.issue("site", "expired-d", cert, key).sign(_keys(3))
    with pytest.raises(MessageError, match="not valid now"):
        study.verifier().check(signed)  # what every site runs on the keys it is relayed
    study.verifier().check(signed, valid_now=False)  # the server's log replay: by design, sites re-check


def test_a_malleated_signature_still_names_the_same_keys(study: Study) -> None:
    """ECDSA (r, s) -> (r, N - s) verifies too; a relay could re-encode a site's signature. Harmless here: the
    signed bytes (study, round, site, both keys) are unchanged and nothing keys on the signature bytes."""
    honest = study.signer("site", "site-a").sign(_keys(0))
    r, s = decode_dss_signature(honest.signature)
    twin = dataclasses.replace(honest, signature=encode_dss_signature(r, P256_N - s))
    assert twin.signature != honest.signature
    study.verifier().check(twin)
    assert twin.signed_bytes(STUDY) == honest.signed_bytes(STUDY)
    for junk in (b"\x00", honest.signature + b"\x00", b"\x30" * 72):
        with pytest.raises(MessageError, match="does not verify"):
            study.verifier().check(dataclasses.replace(honest, signature=junk))


def test_an_oversize_or_garbage_certificate_is_refused_with_a_clear_error(study: Study) -> None:
    honest = study.signer("site", "site-a").sign(_keys(0))
    for junk in (b"\x00" * (1 << 20), b"\x30\x82\xff\xff" + b"\x00" * 100, honest.certificate[:-1]):
        with pytest.raises(MessageError, match="did not issue"):
            study.verifier().check(dataclasses.replace(honest, certificate=junk))


def test_keys_signed_with_a_revoked_certificate_are_refused(study: Study) -> None:
    stolen = study.certs["site", "site-b"]
    write_crl(study.root / "crl.pem", study.ca_key, study.ca, {stolen.serial_number: dt.datetime.now(dt.timezone.utc)})
    forged = study.signer("site", "site-b").sign(_keys(1))  # whoever holds the revoked key
    with pytest.raises(MessageError, match="revoked"):
        study.verifier().check(forged)


# -- log compaction of an aggregator (`deploy.compaction`): real SQLite, the service's apply/append/compact ----

from secagg_roc.deploy.store import Store  # noqa: E402
from secagg_roc.errors import ConfigError, PolicyError, PrivacyError, RoundError  # noqa: E402
from secagg_roc.messages import CloseRound  # noqa: E402

from test_deploy_compaction import KEEP, config  # noqa: E402,F401  (the fixture: few settled rounds kept)
from test_deploy_state import SITES as AGG_SITES, STUDY as AGG_STUDY  # noqa: E402
from test_deploy_state import Aggregator, join, make_sites, next_step, run_round, submit  # noqa: E402


def test_a_release_long_before_the_snapshot_still_guards_against_differencing_and_retired_rounds_stay_shut(
        config, tmp_path: Path) -> None:  # noqa: F811
    """A guarded release over {a, b, c} in round 1, then more than KEEP rounds so that rounds 0 and 1 leave the
    snapshot's round table, then a restart: a release over {a, b} (isolating site-c) is still refused, the
    retired numbers do not open again, and a close re-sent for round 1 over another set moves nothing."""
    aggs = [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]
    sites = make_sites(config)
    first = run_round(aggs, join(config, 0, run="run-1"), sites, AGG_SITES)
    step = next_step(sites["site-a"], 1, "run-1")
    run_round(aggs, step, sites, AGG_SITES)  # guarded: brier over a, b, c
    for n in range(2, 2 * KEEP + 4):
        run_round(aggs, join(config, n, run=f"run-{n}"), sites, AGG_SITES)
    aggs = [a.restart() for a in aggs]
    assert 1 not in aggs[0].state.core.rounds  # retired from the round table: only the disclosure log remains
    n = 2 * KEEP + 4
    q = join(config, n, run="run-z")
    for a in aggs:
        a.apply("query", q)
    submit(aggs, q, sites, ["site-a", "site-b"])
    counts = [a.store.count() for a in aggs]
    snaps = [a.store.snapshot() for a in aggs]
    for a in aggs:
        with pytest.raises(PolicyError, match="would isolate 1 site"):
            a.apply("close", CloseRound(q.round_id, ("site-a", "site-b")))
    assert [a.store.count() for a in aggs] == counts and [a.store.snapshot() for a in aggs] == snaps
    for a in aggs:
        for old in (join(config, 0, run="run-1"), step):
            with pytest.raises(RoundError, match="older than the rounds|already used|abandoned|retired"):
                a.apply("query", old)
        with pytest.raises((RoundError, PolicyError)):
            a.apply("close", CloseRound(first[0].round_id, ("site-a", "site-b")))
    assert [a.store.count() for a in aggs] == counts


def _damage(path: Path, text: str) -> None:
    with Store(path, study=AGG_STUDY, party="agg-1") as store:
        store._db.execute("UPDATE meta SET value = ? WHERE key = 'snapshot'", (text,))


def _snapshotted(config, tmp_path: Path) -> tuple[Path, dict]:  # noqa: F811
    aggs = [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]
    run_round(aggs, join(config, 0, run="run-1"), make_sites(config), AGG_SITES)
    snap = json.loads(aggs[0].store.snapshot())
    for a in aggs:
        a.store.close()
    return tmp_path / "agg-1.sqlite", snap


@pytest.mark.parametrize("damage", ["truncated", "bad-hex", "bad-state", "rounds-null", "negative-retired-str"])
def test_a_damaged_snapshot_of_the_right_shape_fails_closed_with_a_clear_error(  # noqa: F811
        config, tmp_path: Path, damage: str) -> None:  # noqa: F811
    path, snap = _snapshotted(config, tmp_path)
    text = json.dumps(snap)
    if damage == "truncated":  # a half-written value
        text = text[: len(text) // 2]
    elif damage == "bad-hex":
        snap["rounds"][0]["query"] = snap["rounds"][0]["query"][:-3]
    elif damage == "bad-state":
        snap["rounds"][0]["state"] = "reopened"
    elif damage == "rounds-null":
        snap["rounds"] = None
    else:
        snap["retired_max"] = "many"
    if damage != "truncated":
        text = json.dumps(snap)
    _damage(path, text)
    with pytest.raises(ConfigError, match="snapshot cannot be restored"):
        Aggregator(config, "agg-1", path)


@pytest.mark.parametrize("text", ["[]", "null", "42", '"aggregator-snapshot-v1"'])
def test_a_snapshot_that_is_not_an_object_fails_with_a_clear_error(  # noqa: F811
        config, tmp_path: Path, text: str) -> None:  # noqa: F811
    path, _ = _snapshotted(config, tmp_path)
    _damage(path, text)
    with pytest.raises(ConfigError, match="snapshot cannot be restored"):
        Aggregator(config, "agg-1", path)


# -- log compaction of a site agent (`deploy.site_compaction`) --------------------------------------------------


def _site_snapshotted(tmp_path: Path):
    from test_site_compaction import DeployedSite, brier_runs, dp_study

    cfg, _ = dp_study(tmp_path)
    _, sites = brier_runs(cfg, tmp_path, 2)
    site: DeployedSite = sites["site-a"]
    site.agent.compactor.compact()
    snap = site.agent.store.snapshot()
    assert snap is not None
    site.agent.store.close()
    return site, json.loads(snap)


def _damage_site(site, text: str) -> None:
    with Store(site.path, study=site.config.study_id, party=site.name) as store:
        store._db.execute("UPDATE meta SET value = ? WHERE key = 'snapshot'", (text,))


def test_a_half_written_or_mistyped_site_snapshot_fails_closed_with_a_clear_error(tmp_path: Path) -> None:
    site, snap = _site_snapshotted(tmp_path)
    text = json.dumps(snap)
    bad_ledger = dict(snap, ledger=dict(snap["ledger"], sets=[["site-a"]]))  # a set without its count
    for damaged in (text[: len(text) // 2], json.dumps(dict(snap, retired_max="x")), json.dumps(bad_ledger),
                    json.dumps(dict(snap, numbers=[[1, "zz", None]]))):
        _damage_site(site, damaged)
        with pytest.raises(ConfigError, match="snapshot cannot be restored"):
            site.restart()


def test_a_site_snapshot_that_is_not_an_object_fails_with_a_clear_error(tmp_path: Path) -> None:
    site, _ = _site_snapshotted(tmp_path)
    _damage_site(site, "[]")
    with pytest.raises(ConfigError, match="snapshot cannot be restored"):
        site.restart()


# -- checks before keys (`Site.vet`, run by `SitePairwise.agree` before any key is made) ------------------------


def _vetted_then_refused(tmp_path: Path, script) -> list[tuple[str, str]]:
    """Drive `script` (analysis, args) through deployed sites; for site-a, every round that `Site.vet` let
    through (so a pairwise site would make and share keys for it) but whose answer was then a refusal."""
    from test_site_compaction import DeployedSite, dp_study

    cfg, _ = dp_study(tmp_path)
    sites = {s: DeployedSite(cfg, s, tmp_path / "state" / f"{s}.sqlite", restart=False) for s in AGG_SITES}
    from test_deploy_state import pair

    study = StateStudy(pair(cfg, tmp_path / "d"), sites, cfg.policy)
    site, answer, found = sites["site-a"], sites["site-a"].answer, []

    def vetted_answer(query):
        try:
            site.agent.site.vet(query)
        except PolicyError:
            return answer(query)  # refused before keys: fine
        try:
            return answer(query)
        except PolicyError as exc:
            found.append((query.name, str(exc)))
            raise

    site.answer = vetted_answer
    for analysis, args in script:
        try:
            study.run(analysis, **args)
        except SecAggError:
            pass
    return found


from secagg_roc.errors import SecAggError  # noqa: E402
from test_deploy_state import StateStudy  # noqa: E402


def test_a_round_over_the_dp_budget_is_refused_before_any_key_is_made(tmp_path: Path) -> None:
    found = _vetted_then_refused(tmp_path, [("rocglm", {"label": "y", "score": "s"}),
                                            ("rocglm", {"label": "y", "score": "s2"})])
    assert found == []


def test_a_held_release_is_not_re_sent_over_another_set_after_compaction_and_restart(
        config, tmp_path: Path) -> None:  # noqa: F811
    """The analyst re-sends the close of a released round (still held for the sites) over a smaller set after a
    compaction and a restart: refused; the same set gets the identical release."""
    aggs = [Aggregator(config, f"agg-{j + 1}", tmp_path / f"agg-{j + 1}.sqlite") for j in range(2)]
    sites = make_sites(config)
    first = run_round(aggs, join(config, 0, run="run-1"), sites, AGG_SITES)
    aggs = [a.restart() for a in aggs]
    counts = [a.store.count() for a in aggs]
    for a, share in zip(aggs, first):
        for other in (("site-a", "site-b"), ("site-a", "site-b", "site-c", "site-d")):
            with pytest.raises((PrivacyError, RoundError), match="released over|unknown site|not a site"):
                a.apply("close", CloseRound(share.round_id, other))
        assert a.apply("close", CloseRound(share.round_id, tuple(AGG_SITES))).reply == share
    assert [a.store.count() for a in aggs] == counts
