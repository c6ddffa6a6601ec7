"""Every message between parties (each a kind of the binary format in `wire`).

A message is produced as a list of buffers (header bytes + the arrays' own
memory), so a large share vector is never copied before it reaches the
socket; `encode` joins them when one `bytes` is wanted. `decode` checks every
length, code, identifier and shape and raises `MessageError` for anything
else: it never raises another exception on any input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .dp_chain import HEAD_BYTES, MAX_CHAIN
from .errors import MessageError
from .memo import SizedMemo
from .ring import Encoding
from .quick_init import quick_init
from .wire import (  # noqa: F401  (re-exported: the identifiers and format constants callers import from here)
    DIGEST_BYTES,
    MAGIC,
    MAX_NDIM,
    MAX_STR,
    NAME_RE,
    VERSION,
    Layout,
    Reader as _Reader,
    RoundId,
    Writer as _Writer,
    check_name,
    layout_json as _layout_json,
    layout_size,
    parse_layout as _parse_layout,
)

#: A DP release chain on the wire: whole digests, at most `dp_chain.MAX_CHAIN` of them.
_MAX_CHAIN_BYTES = MAX_CHAIN * HEAD_BYTES

# --------------------------------------------------------------------------- messages


class Message:
    """Base of all messages: `to_buffers`/`encode` and the registry `decode` dispatches on."""

    KIND: ClassVar[int]
    registry: ClassVar[dict[int, type["Message"]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.KIND in Message.registry:
            raise TypeError(f"message kind {cls.KIND} defined twice")
        Message.registry[cls.KIND] = cls

    @property
    def kind(self) -> str:
        return type(self).__name__

    def _write(self, w: _Writer) -> None:
        raise NotImplementedError

    @classmethod
    def _read(cls, r: _Reader) -> "Message":
        raise NotImplementedError

    def to_buffers(self) -> list[Any]:
        """The encoded message as buffers to write in order (arrays are not copied)."""
        w = _Writer(self.KIND)
        self._write(w)
        return w.buffers()

    def encode(self) -> bytes:
        return b"".join(self.to_buffers())

    def wire_size(self) -> int:
        return sum(len(memoryview(b).cast("B")) for b in self.to_buffers())


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse one message; `MessageError` for anything malformed, never another exception."""
    try:
        r = _Reader(data)
        if bytes(r.take(3, "magic")) != MAGIC:
            raise MessageError("not a secagg-roc message (bad magic bytes)")
        version = r.u8("version")
        if version != VERSION:
            raise MessageError(f"unsupported message version {version} (this build speaks {VERSION})")
        kind = r.u8("kind")
        cls = Message.registry.get(kind)
        if cls is None:
            raise MessageError(f"unknown message kind {kind}")
        msg = cls._read(r)
        r.end()
        return msg
    except MessageError:
        raise
    except Exception as exc:  # a bug in a validator must still surface as a clean refusal
        raise MessageError(f"malformed message: {type(exc).__name__}: {exc}") from None


@quick_init
@dataclass(frozen=True)
class Query(Message):
    """Analyst -> aggregators and sites: open round `round_id` for site query `name(params)`.

    `params_json` is the canonical JSON of the public parameters and `frac_bits`
    the precision of float outputs; the digest in `round_id` binds both, so a
    site recomputes the digest before computing anything.
    """

    KIND: ClassVar[int] = 1
    round_id: RoundId
    name: str
    params_json: str
    frac_bits: int = 32

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.str(self.name)
        w.str(self.params_json)
        w.u8(self.frac_bits)

    @classmethod
    def _read(cls, r: _Reader) -> "Query":
        rid, name, params = r.round_id(), r.name("query name"), r.str("query parameters")
        frac_bits = r.u8("frac_bits")
        if frac_bits > 62:
            raise MessageError(f"frac_bits {frac_bits} out of range 0..62")
        return cls(rid, name, params, frac_bits)

    @property
    def params(self) -> dict[str, Any]:
        """The parameters as a JSON object (MessageError if they are not one); a fresh dict on every call."""
        return dict(_PARSED(self.params_json)[0])

    @property
    def contributors(self) -> tuple[Any, ...] | None:
        """The contributor set the parameters name, as a tuple (None if they name no list).

        The same tuple while the parse is memoised: an embedded federation hands one message to every
        site, and each site's check of the set (`site_sets.same_sites`) is then O(1) after the first."""
        return _PARSED(self.params_json)[1]


def _parse_params(text: str) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
    """(the parameters, their contributor list as a tuple or None); MessageError unless a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise MessageError(f"query parameters are not JSON: {exc}") from None
    except RecursionError:  # e.g. "[[[[...]]]]": a refusal like any malformed message, not an internal error
        raise MessageError("query parameters are nested too deeply") from None
    if not isinstance(value, dict):
        raise MessageError("query parameters must be a JSON object")
    named = value.get("contributors")
    return value, tuple(named) if isinstance(named, list) else None


#: Parsed parameters by their text, within 2 MiB of it (texts over 256 KiB are parsed each time): K sites
#: handed one message parse it once, not K times. Bounded in text because parsed JSON can take ~24x its
#: text in memory (a megabyte of nested lists), so the memo holds ~50 MB at the very most.
_PARSED: SizedMemo[tuple[dict[str, Any], tuple[Any, ...] | None]] = SizedMemo(
    _parse_params, lambda key: len(key[0]), max_entries=256, max_chars=2 << 20)


def _payload_sizes(layout: Layout) -> tuple[int, int]:
    """The lengths a vector for `layout` may have: the round checks the exact one its sharing scheme gives
    (Shamir's limbs and replicated sharing's component pairs are twice the layout's length)."""
    n = layout_size(layout)
    return (n, 2 * n)


@quick_init
@dataclass(frozen=True)
class InputShare(Message):
    """Site -> aggregator j: the site's share of its query output for one round.

    Exactly one of `seed` (a PRG seed standing for a whole vector) and `vector`
    (ring elements) is set. `records` is the public count of records behind the
    output (-1: not counted). `layout` names the flattened output arrays.
    """

    KIND: ClassVar[int] = 2
    round_id: RoundId
    site: str
    aggregator: int
    encoding: Encoding
    records: int
    layout: Layout
    seed: bytes | None = None
    vector: np.ndarray | None = field(default=None, compare=False)
    dp_chain: bytes | None = field(default=None, compare=False)
    #: With a seed, inside one process only: its stream as the site wrote it (`prg.Expansion`). Never encoded.
    expansion: Any = field(default=None, compare=False, repr=False)

    @property
    def length(self) -> int:
        return layout_size(self.layout)

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.str(self.site)
        w.u64(self.aggregator)
        w.encoding(self.encoding)
        w.i64(self.records)
        w.str(_layout_json(self.layout))
        # Tags 2 and 3 add the DP release chain after the payload; 0 and 1 (no chain) stay byte for byte.
        chained = 0 if self.dp_chain is None else 2
        if self.seed is not None:
            w.u8(0 + chained)
            w.raw(self.seed)
        else:
            w.u8(1 + chained)
            w.array(self.vector)
        if self.dp_chain is not None:
            w.raw(self.dp_chain)

    @classmethod
    def _read(cls, r: _Reader) -> "InputShare":
        round_id = r.round_id()
        site = r.name("site")
        aggregator = r.u64("aggregator index")
        encoding = r.encoding()
        records = r.i64("records")
        if records < -1:
            raise MessageError(f"record count {records} is negative")
        layout = _parse_layout(r.str("layout"))
        tag = r.u8("payload tag")
        if tag not in (0, 1, 2, 3):
            raise MessageError(f"unknown payload tag {tag}")
        if tag % 2 == 0:
            seed, vector = r.raw("seed", 64), None
        else:
            seed, vector = None, r.array("share vector")
            if vector.dtype != np.uint64 or vector.ndim != 1:
                raise MessageError("a share vector is a 1-d uint64 array")
            if vector.size not in _payload_sizes(layout):
                raise MessageError(f"share vector has {vector.size} elements, layout says {layout_size(layout)} "
                                   "(or twice that, under a scheme whose payloads are twice as long)")
        chain = None
        if tag >= 2:
            chain = r.raw("DP release chain", _MAX_CHAIN_BYTES)
            if len(chain) % HEAD_BYTES:
                raise MessageError(f"a DP release chain is a whole number of {HEAD_BYTES}-byte digests")
        return cls(round_id, site, aggregator, encoding, records, layout, seed=seed, vector=vector, dp_chain=chain)


@quick_init
@dataclass(frozen=True)
class StatusRequest(Message):
    """Analyst -> aggregator: which sites have you accepted in this round?"""

    KIND: ClassVar[int] = 3
    round_id: RoundId

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)

    @classmethod
    def _read(cls, r: _Reader) -> "StatusRequest":
        return cls(r.round_id())


@quick_init
@dataclass(frozen=True)
class RoundStatus(Message):
    """Aggregator -> analyst: the sites accepted so far and whether the round was released."""

    KIND: ClassVar[int] = 4
    round_id: RoundId
    accepted: tuple[str, ...]
    released: bool

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.strs(self.accepted)
        w.u8(1 if self.released else 0)

    @classmethod
    def _read(cls, r: _Reader) -> "RoundStatus":
        rid, accepted, released = r.round_id(), r.names("accepted sites"), r.u8("released flag")
        if released not in (0, 1):
            raise MessageError("released flag must be 0 or 1")
        return cls(rid, accepted, bool(released))


@quick_init
@dataclass(frozen=True)
class CloseRound(Message):
    """Analyst -> every aggregator: close the round over this agreed contributor set."""

    KIND: ClassVar[int] = 5
    round_id: RoundId
    contributors: tuple[str, ...]

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.strs(self.contributors)

    @classmethod
    def _read(cls, r: _Reader) -> "CloseRound":
        return cls(r.round_id(), r.names("contributors"))


@quick_init
@dataclass(frozen=True)
class AggregateShare(Message):
    """Aggregator j -> analyst: its share of the total over the agreed contributors."""

    KIND: ClassVar[int] = 6
    round_id: RoundId
    aggregator: int
    contributors: tuple[str, ...]
    records: int
    encoding: Encoding
    layout: Layout
    vector: np.ndarray = field(compare=False)

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.u64(self.aggregator)
        w.strs(self.contributors)
        w.i64(self.records)
        w.encoding(self.encoding)
        w.str(_layout_json(self.layout))
        w.array(self.vector)

    @classmethod
    def _read(cls, r: _Reader) -> "AggregateShare":
        rid, agg, contributors = r.round_id(), r.u64("aggregator index"), r.names("contributors")
        records, encoding, layout = r.i64("records"), r.encoding(), _parse_layout(r.str("layout"))
        vector = r.array("aggregate vector")
        if vector.dtype != np.uint64 or vector.ndim != 1 or vector.size not in _payload_sizes(layout):
            raise MessageError("aggregate vector must be 1-d uint64 matching its layout")
        return cls(rid, agg, contributors, records, encoding, layout, vector)


@quick_init
@dataclass(frozen=True)
class ForwardedShares(Message):
    """Aggregator j -> analyst and contributing sites: site j's shares of a per-site release, unsummed.

    A round of a query declared ``release="dp"`` (per-site DP values) is not
    summed: each aggregator forwards the share it holds of every contributor's
    values, so that no single aggregator ever holds a site's release; the
    receiver combines each site's shares from all aggregators.
    """

    KIND: ClassVar[int] = 10
    round_id: RoundId
    aggregator: int
    contributors: tuple[str, ...]
    records: int
    shares: tuple[InputShare, ...] = field(compare=False)

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.u64(self.aggregator)
        w.strs(self.contributors)
        w.i64(self.records)
        w.u64(len(self.shares))
        for share in self.shares:
            share._write(w)

    @classmethod
    def _read(cls, r: _Reader) -> "ForwardedShares":
        rid, agg, contributors = r.round_id(), r.u64("aggregator index"), r.names("contributors")
        records, n = r.i64("records"), r.u64("number of forwarded shares")
        if n != len(contributors):
            raise MessageError(f"{n} forwarded shares for {len(contributors)} contributors")
        shares = tuple(InputShare._read(r) for _ in range(n))
        if tuple(s.site for s in shares) != contributors or any(s.round_id != rid for s in shares):
            raise MessageError("forwarded shares must belong to the round and list the contributors in order")
        return cls(rid, agg, contributors, records, shares)


@dataclass(frozen=True)
class ErrorReply(Message):
    """Any party -> sender: the message was refused; `code` is the error class, `text` says why."""

    KIND: ClassVar[int] = 9
    code: str
    text: str

    def _write(self, w: _Writer) -> None:
        w.str(self.code)
        w.str(self.text)

    @classmethod
    def _read(cls, r: _Reader) -> "ErrorReply":
        return cls(r.name("error code"), r.str("error text"))
