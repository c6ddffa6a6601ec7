"""Every message type round-trips through its encoding; decoding anything else is a MessageError."""

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secagg_roc.errors import MessageError
from secagg_roc.messages import (
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

RID = RoundId("study-1", 7, hashlib.sha256(b"q").digest())
LAYOUT = (("info", (2, 2), False), ("n", (1,), True))
VEC = np.arange(5, dtype=np.uint64) * np.uint64(2**61)



def examples() -> list[Message]:
    return [
        Query(RID, "glm_step", '{"beta":[0.5,-1.0]}', 24),
        InputShare(RID, "site-a", 1, Encoding(32, False), 120, LAYOUT, seed=bytes(range(16))),
        InputShare(RID, "site-b", 0, INTEGER, -1, LAYOUT, vector=VEC),
        StatusRequest(RID),
        RoundStatus(RID, ("site-a", "site-b"), True),
        CloseRound(RID, ("site-a", "site-b")),
        AggregateShare(RID, 1, ("site-a", "site-b"), 240, Encoding(32, False), LAYOUT, VEC),
        ForwardedShares(RID, 0, ("site-a", "site-b"), 40, (
            InputShare(RID, "site-a", 0, RAW_FLOAT, 20, (("scores", (3,), False),), vector=VEC[:3]),
            InputShare(RID, "site-b", 0, RAW_FLOAT, 20, (("scores", (2,), False),), seed=bytes(16)),
        )),
        ErrorReply("RoundError", "round 7 is closed; share from 'site-a' refused"),
        MpcMaterial(RID, 1, VEC, to_limbs([7, 2**255 - 20])),
        MpcOpen(RID, 2, 65, VEC[:2], to_limbs([1, 2, 3])),
        AucRelease(RID, 0.8125),
    ]


def same(a: Message, b: Message) -> bool:
    if type(a) is not type(b) or a != b:  # dataclass equality skips arrays
        return False
    for attr in ("vector", "value"):
        if hasattr(a, attr) and getattr(a, attr) is not None:
            if not np.array_equal(getattr(a, attr), getattr(b, attr)):
                return False
    if isinstance(a, ForwardedShares):
        return len(a.shares) == len(b.shares) and all(same(x, y) for x, y in zip(a.shares, b.shares))
    return True


def test_every_message_kind_has_an_example():
    assert {type(m) for m in examples()} == set(Message.registry.values())


@pytest.mark.parametrize("msg", examples(), ids=lambda m: m.kind)
def test_roundtrip(msg):
    data = msg.encode()
    assert data[:3] == b"SRM" and data[3] == VERSION
    assert len(data) == msg.wire_size()
    assert same(decode(data), msg)


def test_arrays_are_not_copied_when_encoding():
    msg = InputShare(RID, "site-b", 0, INTEGER, 3, (("v", (100_000,), True),), vector=np.zeros(100_000, np.uint64))
    buffers = msg.to_buffers()
    big = [b for b in buffers if len(memoryview(b).cast("B")) >= 800_000]
    assert len(big) == 1 and np.shares_memory(np.frombuffer(big[0], np.uint64), msg.vector)


@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_message_error(data):
    try:
        decode(data)
    except MessageError:
        pass


@given(st.sampled_from(examples()), st.data())
def test_mutated_messages_raise_only_message_error_or_decode(msg, data):
    raw = bytearray(msg.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "extend", "insert"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del raw[pos:]
        elif op == "extend":
            raw += data.draw(st.binary(min_size=1, max_size=8))
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = decode(bytes(raw))
    except MessageError:
        return
    assert isinstance(out, Message)  # a mutation may still be a valid message: then it decodes fully
    out.encode()


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"", "truncated"),
        (b"XYZ\x01\x01", "magic"),
        (b"SRM\x01\x01", "version"),
        (b"SRM\x02\xee", "unknown message kind"),
        (StatusRequest(RID).encode() + b"\x00", "unexpected bytes"),
        (StatusRequest(RID).encode()[:-3], "truncated"),
    ],
)
def test_clear_errors(data, problem):
    with pytest.raises(MessageError, match=problem):
        decode(data)


def test_shape_that_claims_more_bytes_than_present():
    raw = bytearray(AggregateShare(RID, 0, ("a", "b"), 9, INTEGER, (("v", (4,), True),), np.zeros(4, np.uint64)).encode())
    # the last dimension field precedes 32 bytes of data: claim 2^40 elements
    dim_at = len(raw) - 32 - 8
    raw[dim_at : dim_at + 8] = (2**40).to_bytes(8, "little")
    with pytest.raises(MessageError, match="needs"):
        decode(bytes(raw))


def test_forwarded_shares_must_list_the_contributors_in_order():
    good = examples()[7]
    assert isinstance(good, ForwardedShares)
    swapped = ForwardedShares(RID, 0, ("site-b", "site-a"), 40, good.shares)
    with pytest.raises(MessageError, match="list the contributors in order"):
        decode(swapped.encode())
    short = ForwardedShares(RID, 0, ("site-a",), 40, good.shares)
    with pytest.raises(MessageError, match="2 forwarded shares for 1 contributors"):
        decode(short.encode())


def test_invalid_identifiers_are_refused_at_construction():
    with pytest.raises(MessageError, match="study id"):
        RoundId("bad study!", 1, bytes(32))
    with pytest.raises(MessageError, match="digest"):
        RoundId("s", 1, b"short")
    with pytest.raises(MessageError, match="out of range"):
        RoundId("s", -1, bytes(32))


def test_share_vector_must_match_layout():
    bad = InputShare(RID, "site-b", 0, INTEGER, 1, (("v", (3,), True),), vector=np.zeros(4, np.uint64))
    with pytest.raises(MessageError, match="layout"):
        decode(bad.encode())


def test_wrong_array_dtype_cannot_be_encoded():
    with pytest.raises(MessageError, match="uint64, int64 or float64"):
        AggregateShare(RID, 0, ("a",), 1, INTEGER, (("v", (2,), True),), np.zeros(2, np.float32)).encode()


@pytest.mark.parametrize("name", ["abc\n", "abc\r", "\nabc", "", "a" * 65, "a b", "ab\x00"])
def test_names_with_control_characters_or_out_of_range_are_refused(name):
    from secagg_roc.wire import check_name

    with pytest.raises(MessageError, match="not a valid name"):
        check_name(name, "site")
    with pytest.raises(MessageError):  # and on the wire: a share naming such a site never decodes
        decode(InputShare(RoundId("st", 0, b"\0" * 32), name, 0, INTEGER, 1, (("v", (1,), True),),
                          vector=np.zeros(1, np.uint64)).encode())
