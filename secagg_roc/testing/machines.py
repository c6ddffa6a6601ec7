"""A stateful test of one aggregation round under any sharing scheme, with an adversarial analyst.

Honest sites submit shares to every aggregator; the analyst (the adversary)
closes the round over any subset it likes, from any subset of aggregators,
and may make one aggregator alter its sum. After every step the machine
checks the round's release rules: a release only over sites that all
submitted, with at least `min_sites` sites and q records, never a second,
different release; a combined total is the exact sum or a `TamperError`,
never a wrong number.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..aggregator import Aggregator
from ..analyst import combine
from ..errors import CombineError, MessageError, PrivacyError, RoundError, TamperError
from ..messages import InputShare, Query, RoundId
from ..queries import query_digest
from ..ring import INTEGER, FixedPoint
from ..round import RoundPolicy, RoundState
from ..sharing import SharingScheme

SITES = ("s0", "s1", "s2", "s3")
D = 3
MIN_SITES, Q = 2, 5


def _query() -> Query:
    rid = RoundId("kit", 0, query_digest("kit", "secure_sum", {}, 32))
    return Query(rid, "secure_sum", "{}", 32)


def round_machine(make: Callable[[], SharingScheme]) -> type[RuleBasedStateMachine]:
    """A `RuleBasedStateMachine` class for the scheme `make()` builds; use its ``.TestCase`` in pytest."""

    class SchemeRoundMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.scheme = make()
            self.policy = RoundPolicy(frozenset(SITES), min_sites=MIN_SITES, privacy_level=Q)
            self.query = _query()
            self.aggs = [Aggregator("kit", j, self.policy, self.scheme) for j in range(self.scheme.n_aggregators)]
            for a in self.aggs:
                a.open(self.query)
            self.model: dict[str, tuple[np.ndarray, int, list[InputShare]]] = {}
            self.release: tuple[tuple[str, ...], np.ndarray] | None = None
            #: The set the aggregators released over (even if the analyst could not combine what came back).
            self.closed_over: tuple[str, ...] | None = None

        def _shares(self, site: str, value: np.ndarray, records: int) -> list[InputShare]:
            layout = (("v", (value.size,), True),)
            payloads = self.scheme.split(FixedPoint().encode(value), holder=len(self.model) % len(self.aggs))
            return [InputShare(self.query.round_id, site, j, INTEGER, records, layout, seed=p.seed, vector=p.vector)
                    for j, p in enumerate(payloads)]

        @rule(site=st.sampled_from(SITES), value=st.lists(st.integers(-(2**40), 2**40), min_size=D, max_size=D),
              records=st.integers(0, 4))
        def submit(self, site: str, value: list[int], records: int) -> None:
            shares = self._shares(site, np.array(value, dtype=np.int64), records)
            if site in self.model and self.closed_over is None and all(
                    s.seed == o.seed and np.array_equal(s.vector, o.vector) and s.records == o.records
                    for s, o in zip(shares, self.model[site][2])):
                return  # a deterministic scheme (the plaintext baseline) made the same share again: idempotent
            if self.closed_over is not None or site in self.model:
                for a, s in zip(self.aggs, shares):
                    try:
                        a.handle(s)
                    except RoundError:
                        continue
                    raise AssertionError("a share after the release, or a second different one, was accepted")
                return
            for a, s in zip(self.aggs, shares):
                a.handle(s)
            self.model[site] = (np.array(value, dtype=np.int64), records, shares)

        @precondition(lambda self: self.model and self.closed_over is None)
        @rule(data=st.data())
        def resubmit_identical(self, data: st.DataObject) -> None:
            site = data.draw(st.sampled_from(sorted(self.model)))
            for a, s in zip(self.aggs, self.model[site][2]):
                a.handle(s)  # idempotent

        @rule(j=st.integers(0, 7), cut=st.integers(1, D))
        def malformed_share(self, j: int, cut: int) -> None:
            """A share whose vector has the wrong length for the scheme is refused and changes nothing."""
            a = self.aggs[j % len(self.aggs)]
            good = self._shares("s0", np.zeros(D, np.int64), 3)[a.index]
            if good.vector is None:
                return
            bad = InputShare(good.round_id, good.site, good.aggregator, good.encoding, good.records, good.layout,
                             vector=good.vector[:-cut])
            before = set(a.round(self.query.round_id).accepted)
            try:
                a.handle(bad)
            except (MessageError, RoundError):
                pass
            else:
                raise AssertionError("a share of the wrong length was accepted")
            assert set(a.round(self.query.round_id).accepted) == before

        @rule(contributors=st.sets(st.sampled_from(SITES)), answering=st.sets(st.integers(0, 6), min_size=1),
              cheat=st.one_of(st.none(), st.integers(0, 6)))
        def close(self, contributors: set[str], answering: set[int], cheat: int | None) -> None:
            """Every aggregator is asked to close; the analyst combines the replies of `answering` only (the
            others are lost), one of them altered by aggregator `cheat` when the scheme claims to detect that."""
            agreed = tuple(sorted(contributors))
            records = sum(self.model[s][1] for s in agreed if s in self.model)
            try:
                replies = [a.round(self.query.round_id).close(agreed) for a in self.aggs]
            except PrivacyError:
                assert len(agreed) < MIN_SITES or records < Q or (self.closed_over not in (None, agreed))
                return
            except RoundError:
                assert any(s not in self.model for s in agreed)
                return
            assert all(s in self.model for s in agreed) and len(agreed) >= MIN_SITES and records >= Q
            assert self.closed_over in (None, agreed)  # never a second, different release
            self.closed_over = agreed
            shares = [r for r in replies if r.aggregator in answering]
            detects = self.scheme.threat_model.malicious.get("aggregator alters its aggregate share") == "detected"
            cheating = cheat is not None and detects and len(shares) == len(self.aggs) and cheat < len(self.aggs)
            if cheating:
                v = shares[cheat].vector.copy()
                v[-1] ^= np.uint64(1 << 3)
                shares[cheat] = dataclasses.replace(shares[cheat], vector=v)
            expect = sum((self.model[s][0] for s in agreed), np.zeros(D, np.int64))
            try:
                total = combine(shares, self.scheme)["v"]
            except TamperError:
                assert cheating, "TamperError without a cheat"
                return
            except CombineError:
                assert len(shares) < self.scheme.threshold
                return
            assert not cheating, "an altered sum was combined without TamperError"
            np.testing.assert_array_equal(total, expect)  # and every combination of the same release agrees
            self.release = (agreed, total)

        @invariant()
        def aggregators_agree_on_state(self) -> None:
            states = {a.round(self.query.round_id).state for a in self.aggs}
            assert len(states) == 1
            for a in self.aggs:
                assert set(a.round(self.query.round_id).accepted) == set(self.model)
            assert (self.closed_over is not None) == (states == {RoundState.RELEASED})

    SchemeRoundMachine.__name__ = f"RoundMachine_{make().name}"
    return SchemeRoundMachine
