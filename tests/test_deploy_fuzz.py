"""Fuzzing what a deployed party parses from the network: messages, frames, feeds, and the
aggregator's state machine fed mutated messages (it must refuse them cleanly and stay unchanged)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secagg_roc.deploy.aggregator_state import AggregatorState, parse_refusal
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.deploy.http_protocol import pack_feed, pack_frames, unpack_feed, unpack_frames
from secagg_roc.errors import MessageError, SecAggError
from secagg_roc.messages import (
    MAGIC,
    VERSION,
    AggregateShare,
    CloseRound,
    ErrorReply,
    ForwardedShares,
    InputShare,
    Message,
    Query,
    RoundId,
    RoundStatus,
    StatusRequest,
    decode,
)
from secagg_roc.mpc.messages import AucRelease, MpcMaterial, MpcOpen, to_limbs
from secagg_roc.ring import INTEGER, RAW_FLOAT, Encoding

from deploy_client import join_query

RID = RoundId("fuzz", 3, hashlib.sha256(b"q").digest())
LAYOUT = (("sum", (3,), False),)
VEC = np.array([1, 2**63, 2**64 - 1], dtype=np.uint64)


def every_kind() -> list[Message]:
    """One valid message of every kind (the seed corpus for mutations)."""
    return [
        Query(RID, "sum", '{"array":"x"}', 32),
        InputShare(RID, "site-a", 0, Encoding(32, False), 10, LAYOUT, seed=bytes(range(32))),
        InputShare(RID, "site-b", 1, INTEGER, 7, LAYOUT, vector=VEC),
        StatusRequest(RID),
        RoundStatus(RID, ("site-a", "site-b"), False),
        CloseRound(RID, ("site-a", "site-b")),
        AggregateShare(RID, 0, ("site-a", "site-b"), 17, Encoding(32, False), LAYOUT, VEC),
        ForwardedShares(RID, 1, ("site-a", "site-b"), 12, (
            InputShare(RID, "site-a", 1, RAW_FLOAT, 5, (("negative", (2,), False), ("positive", (1,), False)),
                       seed=bytes(range(16))),
            InputShare(RID, "site-b", 1, RAW_FLOAT, 7, (("negative", (1,), False), ("positive", (2,), False)),
                       vector=VEC),
        )),
        ErrorReply("RoundError", "round 3 is closed"),
        MpcMaterial(RID, 1, VEC, to_limbs([5, 2**255 - 20])),
        MpcOpen(RID, 0, 7, VEC[:0], to_limbs([3])),
        AucRelease(RID, 0.75),
    ]


def test_the_corpus_covers_every_message_kind() -> None:
    assert {type(m) for m in every_kind()} == set(Message.registry.values())


def _decode_only_message_error(data: bytes) -> Message | None:
    try:
        return decode(data)
    except MessageError:
        return None


def _same(a: Message, b: Message) -> bool:
    if type(a) is not type(b) or a != b:
        return False
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("vector",)
        if getattr(a, f, None) is not None
    )


@given(kind=st.sampled_from(sorted(Message.registry)), tail=st.binary(max_size=300))
def test_arbitrary_bodies_behind_a_valid_header(kind: int, tail: bytes) -> None:
    # Random bytes rarely get past the magic; behind a valid header they reach every field reader.
    _decode_only_message_error(MAGIC + bytes([VERSION, kind]) + tail)


_EDGES = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 2**31 - 1, 2**31, 2**32 - 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(msg=st.sampled_from(every_kind()), data=st.data())
def test_length_and_count_fields_set_to_edge_values(msg: Message, data: st.DataObject) -> None:
    """Overwrite 1-, 4- or 8-byte windows (where lengths, counts, shapes live) with boundary values."""
    raw = bytearray(msg.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        width = data.draw(st.sampled_from([1, 4, 8]))
        pos = data.draw(st.integers(0, max(0, len(raw) - width)))
        value = data.draw(st.sampled_from(_EDGES)) % (1 << (8 * width))
        raw[pos : pos + width] = value.to_bytes(width, "little")
    out = _decode_only_message_error(bytes(raw))
    if out is not None:
        # Whatever decodes is a complete, valid message: it re-encodes and decodes to itself.
        again = decode(out.encode())
        assert _same(again, out)


@given(msg=st.sampled_from(every_kind()), cut=st.integers(0, 400))
def test_every_truncation_is_refused(msg: Message, cut: int) -> None:
    raw = msg.encode()
    if cut < len(raw):
        with pytest.raises(MessageError):
            decode(raw[:cut])


@given(data=st.binary(max_size=300))
def test_frames_and_feeds_raise_only_message_error(data: bytes) -> None:
    for parse in (unpack_frames, unpack_feed, parse_refusal):
        try:
            parse(data)
        except MessageError:
            pass


@given(msgs=st.lists(st.sampled_from(every_kind()), max_size=4), data=st.data())
def test_mutated_frames_and_feeds(msgs: list[Message], data: st.DataObject) -> None:
    frames = bytearray(b"".join(pack_frames(msgs)))
    feed = bytearray(b"".join(pack_feed(9, [(i, m.encode()) for i, m in enumerate(msgs)])))
    assert [type(m) for m in unpack_frames(bytes(frames))] == [type(m) for m in msgs]
    assert unpack_feed(bytes(feed))[0] == 9
    for raw in (frames, feed):
        if raw:
            pos = data.draw(st.integers(0, len(raw) - 1))
            raw[pos] ^= data.draw(st.integers(1, 255))
        for parse in (unpack_frames, unpack_feed):
            try:
                parse(bytes(raw))
            except MessageError:
                pass


# --------------------------------------------------------------------------- the state machine


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory):
    return loopback_study(tmp_path_factory.mktemp("fuzz"), ["site-a", "site-b"], 2, [19001, 19002], study_id="fuzz",
                          privacy_level=1)


def _snapshot(state: AggregatorState) -> tuple:
    rounds = tuple(
        (n, r.state, tuple(sorted(r.accepted)), r.released_over) for n, r in sorted(state.core.rounds.items())
    )
    runs = tuple((k, r.contributors, r.step, r.failed) for k, r in sorted(state.core.runs.items()))
    return (rounds, runs, tuple(sorted(state.numbers)), len(state.feed), tuple(sorted(state.abandoned)),
            repr(state.core.disclosures.released))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
          deadline=None)
@given(data=st.data())
def test_mutated_messages_never_corrupt_an_aggregator(config, data: st.DataObject) -> None:
    state = AggregatorState(config, "agg-1")
    query = join_query(config, 0, "run-1", "brier", {"label": "y", "score": "s"})
    rid = query.round_id
    state.apply("query", query, at=0.0, body=query.encode())
    share = InputShare(rid, "site-a", 0, INTEGER, 4, (("sites", (1,), True),), vector=np.arange(1, dtype=np.uint64))
    valid = {
        "share": share,
        "close": CloseRound(rid, ("site-a",)),
        "query": join_query(config, 1, "run-2", "brier", {"label": "y", "score": "s"}),
    }
    kind = data.draw(st.sampled_from(sorted(valid)))
    raw = bytearray(valid[kind].encode())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= data.draw(st.integers(1, 255))
    before = _snapshot(state)
    try:
        message = decode(bytes(raw))
        state.apply(kind, message, number=5, at=1.0, body=bytes(raw))
    except SecAggError:
        assert _snapshot(state) == before  # a refusal never changes anything


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 1.5])
def test_an_auc_release_outside_0_1_is_refused_on_decoding(value: float) -> None:
    """Found by the edge-value fuzz above: a NaN AUC decoded, and NaN != NaN broke the re-encoding check."""
    import struct

    raw = AucRelease(RID, 0.75).encode()
    forged = raw[:-8] + struct.pack("<d", value)
    with pytest.raises(MessageError, match=r"an AUC in \[0, 1\]"):
        decode(forged)
    assert decode(raw).value == 0.75
