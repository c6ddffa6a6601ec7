"""A site restored from an older database (or a fresh one) must not spend its DP budget again.

The aggregators keep each site's chain of DP releases (`secagg_roc.dp_chain`): a DP share whose chain does not
extend it is refused, and a site agent on a database that forgot releases refuses to start unless its operator
says the ledger was lost on purpose (its budget then counts as spent). The red team's test of a restored copy
is in test_attacks_redteam_budget.py; here: the chain rules, a fork, the aggregators' restarts and
compactions, honest restarts, and the real processes' start check and override.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from secagg_roc.deploy.site_answers import SiteAnswers
from secagg_roc.dp_chain import HEAD_BYTES, ROLLBACK, ReleaseChains, extend
from secagg_roc.errors import PolicyError, SecAggError

from test_deploy_state import SITES, StateStudy, pair
from test_site_compaction import DeployedSite, dp_study

HIST = {"label": "y", "score": "s", "bins": 10, "privacy": "distdp"}


def chain(*names: str) -> bytes:
    return extend("site-a", b"", [(n, "run", 1, {"mu": 1.0, "epsilon": 0.5, "delta": 0.0}) for n in names])


# -- the rule ---------------------------------------------------------------------------------------------------------


def test_an_aggregator_accepts_a_chain_that_extends_or_is_a_prefix_and_refuses_any_other() -> None:
    held = ReleaseChains()
    held.check("site-a", chain("r1", "r2"), True)
    assert held.note("site-a", chain("r1", "r2")) and held.count("site-a") == 2
    for ok in (b"", chain("r1"), chain("r1", "r2"), chain("r1", "r2", "r3")):  # late share, replay, a new release
        held.check("site-a", ok, True)
    for bad in (chain("x"), chain("r1", "x"), chain("x", "r2"), chain("r1", "x", "r3")):  # forgotten or forked
        with pytest.raises(PolicyError, match=ROLLBACK):
            held.check("site-a", bad, True)
    assert not held.note("site-a", chain("r1")) and held.count("site-a") == 2  # never shortened
    held.check("site-b", None, False)  # a round without a DP release needs no chain
    with pytest.raises(PolicyError, match="carries the site's DP release chain"):
        held.check("site-b", None, True)
    with pytest.raises(PolicyError, match="digests"):
        held.check("site-b", b"x" * (HEAD_BYTES + 1), True)
    again = ReleaseChains()
    again.load(held.state())
    assert again.chains == held.chains


def test_a_rollback_refusal_names_the_problem_and_no_count() -> None:
    held = ReleaseChains()
    held.note("site-a", chain("r1", "r2", "r3"))
    with pytest.raises(PolicyError) as exc:
        held.check("site-a", chain("x"), True)
    text = str(exc.value)
    assert "site 'site-a'" in text and "restored from an older copy" in text and "--dp-ledger-lost-on-purpose" in text
    assert not any(d in text for d in "0123456789")  # how many DP releases it made is not the analyst's to see


# -- in process: real SQLite logs of sites and aggregators -------------------------------------------------------------


def backup(sites: dict) -> None:
    for site in sites.values():
        site.agent.store.close()
        shutil.copy(site.path, site.path.with_suffix(".backup"))
        site.restart()


def put_back(sites: dict) -> None:
    for site in sites.values():
        site.agent.store.close()
        shutil.copy(site.path.with_suffix(".backup"), site.path)
        site.restart()


def test_a_site_rolled_back_that_makes_a_different_release_is_refused_after_the_aggregators_restart(
        tmp_path: Path) -> None:
    """A summed release the sites noise themselves (DistDP histogram); the copies put back; the aggregators
    restarted (their compacted snapshot holds the chains: the shares of the settled round left their log); a
    different release (another epsilon) forks each site's chain: refused, and the analyst gets nothing."""
    config, _ = dp_study(tmp_path)
    sites = {s: DeployedSite(config, s, tmp_path / "state" / f"{s}.sqlite", restart=False) for s in SITES}
    study = StateStudy(pair(config, tmp_path / "d"), sites, config.policy)
    backup(sites)
    study.run("score_histogram", **HIST, epsilon=0.25)
    study.aggs = [a.restart() for a in study.aggs]
    assert not [e for a in study.aggs for e in a.store.entries() if e.kind == "share"]  # compacted away...
    assert all(a.state.core.chains.count(s) == 1 for a in study.aggs for s in SITES)  # ...the chains kept
    put_back(sites)
    with pytest.raises(SecAggError, match=ROLLBACK):
        study.run("score_histogram", **HIST, epsilon=0.2)


class NormalSyncSite(DeployedSite):
    """A site agent started with ``--sync normal`` (restarted before every round, compacting on start)."""

    def _open(self) -> SiteAnswers:
        agent = SiteAnswers(self.config, self.name, seed=3, state_path=self.path, synchronous="NORMAL")
        agent.compactor.every = self.every
        agent._replay()
        return agent


@pytest.mark.parametrize("kind", [DeployedSite, NormalSyncSite], ids=["sync-full", "sync-normal"])
def test_honest_restarts_and_compactions_of_sites_and_aggregators_keep_dp_rounds_working(
        tmp_path: Path, kind: type) -> None:
    """Sites restarted before every round and compacted after every release (``--sync full`` or ``normal``),
    aggregators restarted: DP releases are replayed and new ones made as before; every aggregator holds each
    site's ledger's chain."""
    config, _ = dp_study(tmp_path)
    sites = {s: kind(config, s, tmp_path / "state" / f"{s}.sqlite") for s in SITES}
    study = StateStudy(pair(config, tmp_path / "d"), sites, config.policy)
    study.run("score_histogram", **HIST, epsilon=0.1)
    study.aggs = [a.restart() for a in study.aggs]
    study.run("score_histogram", **HIST, epsilon=0.1)  # replayed from the ledger: the same chain
    study.run("score_histogram", **HIST, epsilon=0.15)  # a new release: the chain grows
    study.aggs = [a.restart() for a in study.aggs]
    for name, site in sites.items():
        assert len(site.ledger.dp_chain) == 2 * HEAD_BYTES
        assert all(a.state.core.chains.chains[name] == site.ledger.dp_chain for a in study.aggs)


def test_forwarded_per_site_shares_do_not_carry_the_sites_chains(tmp_path: Path) -> None:
    """The analyst (and the other sites) receive each site's per-site DP release without its chain: the
    number of DP releases a site made is for the aggregators alone."""
    config, _ = dp_study(tmp_path)
    sites = {s: DeployedSite(config, s, tmp_path / "state" / f"{s}.sqlite", restart=False) for s in SITES}
    study = StateStudy(pair(config, tmp_path / "d"), sites, config.policy)
    released = []
    inner = study._round

    def spy(name, params, frac_bits):
        out = inner(name, params, frac_bits)
        released.extend(out)
        return out

    study._round = spy
    study.run("rocglm", label="y", score="s")
    forwarded = [s for r in released for s in getattr(r, "shares", ())]
    assert forwarded and all(s.dp_chain is None for s in forwarded)
    assert all(a.state.core.chains.count(s) == 1 for a in study.aggs for s in SITES)


# -- real processes: the start check, the operator's override -----------------------------------------------------------


def _copy_database(src: Path, dest: Path) -> None:
    """An online backup (SQLite's backup API: what an operator's backup tool does)."""
    with sqlite3.connect(src) as a, sqlite3.connect(dest) as b:
        a.backup(b)


def _remove_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.slow
def test_a_site_agent_on_a_restored_or_empty_database_refuses_to_start_and_the_override_spends_the_budget(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real processes over TLS. site-a's database is backed up, a DP release is made, the agent killed:

    * on the backup put back, and on an empty database, the agent refuses to start, saying why;
    * with ``--dp-ledger-lost-on-purpose`` it starts, and refuses every new DP release (budget spent);
    * an honest kill -9 of another site, restarted on its own database, starts and answers as before."""
    import secagg_roc.stats as sr
    from secagg_roc.deploy.local_cluster import LocalCluster
    from test_attacks_deployed import STRICT, strict_data

    cl = LocalCluster(tmp_path_factory.mktemp("rollback"), strict_data(seed=43), seed=None, policy=STRICT,
                      round_timeout_s=15.0)
    with cl.start():
        db = cl.folder / "state" / "site-a.sqlite"
        _copy_database(db, cl.folder / "site-a.backup")
        with cl.study() as study:
            first = sr.roc_glm(study, "y", "score")
        for restore in ("backup", "empty"):
            cl.kill("site-a")
            _remove_database(db)
            if restore == "backup":
                _copy_database(cl.folder / "site-a.backup", db)
            cl.start_party("site-a", wait=False)
            assert cl.procs["site-a"].wait(timeout=60) == 2
            log = cl.log_text("site-a")
            assert "has forgotten DP releases that aggregator(s)" in log and "--dp-ledger-lost-on-purpose" in log
        cl.start_party("site-a", extra=("--dp-ledger-lost-on-purpose",))
        cl.kill("site-b")  # an honest restart: kill -9, the same database
        cl.start_party("site-b")
        with cl.study() as study:
            with pytest.raises(SecAggError) as exc:
                sr.roc_glm(study, "y", "score", epsilon=0.49, delta=0.3)
        assert "counts as spent" in str(exc.value)
        cl.kill("site-a")  # the override is durable: a plain restart now starts, its budget still spent
        cl.start_party("site-a")
        with cl.study() as study:
            with pytest.raises(SecAggError, match="counts as spent"):
                sr.roc_glm(study, "y", "score", epsilon=0.45, delta=0.3)
            brier = sr.brier_score(study, "y", "score")  # exact releases go on as before
    assert first is not None and 0.0 <= float(brier) <= 1.0 and "site-a" in brier.contributors


def test_the_embedded_study_refuses_a_site_whose_ledger_was_replaced_by_an_empty_one() -> None:
    """The embedded aggregators check the same chains: a site of `Study.local` whose ledger is swapped for an
    empty one after a DP release is refused at its next new DP release, naming the rollback."""
    import secagg_roc.stats as sr
    from secagg_roc import Study
    from secagg_roc.ledger import Ledger
    from secagg_roc.policy import DPPolicy, Policy

    rng = np.random.default_rng(5)
    data = {}
    for s, n in zip(SITES, (40, 50, 60)):
        y = rng.integers(0, 2, n)
        data[s] = {"y": y, "s": 1 / (1 + np.exp(-(rng.normal(size=n) + 1.5 * y - 0.7)))}
    policy = Policy(privacy_level=5, min_sites=2, dp=DPPolicy(0.5, 0.3, 0.05, budget_epsilon=2.0, budget_delta=0.9),
                    roles={"label": ["y"], "score": ["s"]})
    study = Study.local(data, policy=policy, seed=1)
    sr.roc_glm(study, "y", "s")
    sr.roc_glm(study, "y", "s", epsilon=0.45, delta=0.3)  # an honest second release: the chains grow
    study.site_objects["site-b"].ledger = Ledger(policy, "site-b")  # its ledger lost
    with pytest.raises(SecAggError, match=ROLLBACK):
        sr.roc_glm(study, "y", "s", epsilon=0.4, delta=0.3)


def test_a_share_carries_its_chain_on_the_wire_and_a_share_without_one_is_encoded_as_before() -> None:
    """Tags 2 and 3 carry the chain after the payload; tags 0 and 1 are the
    format of before, byte for byte; a chain that is not whole digests is a MessageError."""
    from dataclasses import replace

    from secagg_roc.errors import MessageError
    from secagg_roc.messages import InputShare, RoundId, decode
    from secagg_roc.ring import RawFloat

    rid = RoundId("st", 3, bytes(32))
    plain = InputShare(rid, "site-a", 0, RawFloat().encoding_for(np.zeros(2)), 7, (("v", (2,), False),),
                       vector=np.arange(2, dtype=np.uint64))
    chained = replace(plain, dp_chain=chain("r1", "r2"))
    back = decode(chained.encode())
    assert back.dp_chain == chain("r1", "r2") and np.array_equal(back.vector, plain.vector)
    assert decode(plain.encode()).dp_chain is None
    assert len(chained.encode()) == len(plain.encode()) + 4 + 2 * HEAD_BYTES
    body = bytearray(replace(plain, dp_chain=b"x" * 33).encode())
    with pytest.raises(MessageError, match="whole number"):
        decode(bytes(body))
