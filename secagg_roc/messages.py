"""Every message between parties, and its versioned binary encoding.

Wire format (all integers little-endian)::

    b"SRM" | version u8 | kind u8 | fields of that kind, in order | nothing else

Field encodings: ``str``/``bytes`` = u32 length + bytes (UTF-8 for str);
``u64``/``i64``; a tuple of str = u32 count + strs; an array = dtype code u8,
ndim u8, each dim u64, then the raw little-endian element bytes. A message is
produced as a list of buffers (header bytes + the arrays' own memory), so a
large share vector is never copied before it reaches the socket; `encode`
joins them when one `bytes` is wanted. `decode` checks every length, code,
identifier and shape and raises `MessageError` for anything else: it never
raises another exception on any input.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .errors import MessageError
from .ring import Encoding

MAGIC = b"SRM"
VERSION = 2
DIGEST_BYTES = 32
MAX_NDIM = 8
MAX_STR = 1 << 20
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

_DTYPES = {1: np.dtype("<u8"), 2: np.dtype("<f8"), 3: np.dtype("<i8")}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def check_name(value: str, what: str) -> str:
    """A party, study or value name: 1-64 characters of [A-Za-z0-9_.-]."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise MessageError(f"{what} {value!r} is not a valid name (1-64 of A-Z a-z 0-9 _ . -)")
    return value


@dataclass(frozen=True)
class RoundId:
    """A round: its study, its number, and the digest of the query that produced it."""

    study: str
    number: int
    query: bytes

    def __post_init__(self) -> None:
        check_name(self.study, "study id")
        if not isinstance(self.number, int) or not 0 <= self.number < 2**63:
            raise MessageError(f"round number {self.number!r} out of range")
        if not isinstance(self.query, bytes) or len(self.query) != DIGEST_BYTES:
            raise MessageError(f"query digest must be {DIGEST_BYTES} bytes")

    def __str__(self) -> str:
        return f"{self.study}/round-{self.number}/{self.query.hex()[:12]}"


# --------------------------------------------------------------------------- writer / reader


class _Writer:
    def __init__(self, kind: int):
        self.parts: list[Any] = [MAGIC + _U8.pack(VERSION) + _U8.pack(kind)]
        self.head = bytearray()

    def _flush(self) -> None:
        if self.head:
            self.parts.append(bytes(self.head))
            self.head = bytearray()

    def u8(self, v: int) -> None:
        self.head += _U8.pack(v)

    def u64(self, v: int) -> None:
        self.head += _U64.pack(v)

    def i64(self, v: int) -> None:
        self.head += _I64.pack(v)

    def raw(self, v: bytes) -> None:
        self.head += _U32.pack(len(v)) + v

    def str(self, v: str) -> None:
        self.raw(v.encode())

    def strs(self, vs: tuple[str, ...]) -> None:
        self.head += _U32.pack(len(vs))
        for v in vs:
            self.str(v)

    def round_id(self, r: RoundId) -> None:
        self.str(r.study)
        self.u64(r.number)
        self.raw(r.query)

    def encoding(self, e: Encoding) -> None:
        self.u8(e.frac_bits)
        self.u8(2 if e.raw else 1 if e.integer else 0)

    def array(self, a: np.ndarray) -> None:
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        code = _DTYPE_CODES.get(np.dtype(dtype))
        if code is None:
            raise MessageError(f"arrays on the wire are uint64, int64 or float64, not {a.dtype}")
        self.u8(code)
        self.u8(a.ndim)
        for d in a.shape:
            self.u64(d)
        self._flush()
        self.parts.append(memoryview(np.ascontiguousarray(a, dtype=_DTYPES[code])).cast("B"))

    def buffers(self) -> list[Any]:
        self._flush()
        return self.parts


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise MessageError(f"message truncated while reading {what}")
        out = self.view[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u64(self, what: str) -> int:
        return _U64.unpack(self.take(8, what))[0]

    def i64(self, what: str) -> int:
        return _I64.unpack(self.take(8, what))[0]

    def raw(self, what: str, max_len: int = MAX_STR) -> bytes:
        n = _U32.unpack(self.take(4, what))[0]
        if n > max_len:
            raise MessageError(f"{what} is {n} bytes, more than the {max_len} allowed")
        return bytes(self.take(n, what))

    def str(self, what: str) -> str:
        try:
            return self.raw(what).decode("utf-8")
        except UnicodeDecodeError:
            raise MessageError(f"{what} is not valid UTF-8") from None

    def name(self, what: str) -> str:
        return check_name(self.str(what), what)

    def names(self, what: str) -> tuple[str, ...]:
        n = _U32.unpack(self.take(4, what))[0]
        if n > 1 << 16:
            raise MessageError(f"{what}: {n} names is more than allowed")
        out = tuple(self.name(what) for _ in range(n))
        if len(set(out)) != len(out):
            raise MessageError(f"{what} lists a name twice")
        return out

    def round_id(self) -> RoundId:
        study = self.name("study id")
        number = self.u64("round number")
        if number >= 2**63:
            raise MessageError("round number out of range")
        query = self.raw("query digest", DIGEST_BYTES)
        return RoundId(study, number, query)

    def encoding(self) -> Encoding:
        frac_bits, kind = self.u8("frac_bits"), self.u8("encoding kind")
        if kind not in (0, 1, 2) or frac_bits > 62 or (kind and frac_bits):
            raise MessageError(f"invalid encoding (frac_bits={frac_bits}, kind={kind})")
        return Encoding(frac_bits, kind == 1, raw=kind == 2)

    def array(self, what: str) -> np.ndarray:
        code = self.u8(f"{what} dtype")
        if code not in _DTYPES:
            raise MessageError(f"{what}: unknown dtype code {code}")
        ndim = self.u8(f"{what} ndim")
        if ndim > MAX_NDIM:
            raise MessageError(f"{what}: {ndim} dimensions, at most {MAX_NDIM}")
        shape = tuple(self.u64(f"{what} shape") for _ in range(ndim))
        count = 1
        for d in shape:
            count *= d
        nbytes = count * _DTYPES[code].itemsize
        if nbytes > len(self.view) - self.pos:
            raise MessageError(f"{what}: shape {shape} needs {nbytes} bytes, message has fewer")
        buf = self.take(nbytes, what)
        return np.frombuffer(buf, dtype=_DTYPES[code]).reshape(shape)

    def end(self) -> None:
        if self.pos != len(self.view):
            raise MessageError(f"{len(self.view) - self.pos} unexpected bytes after the message")


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


def _layout_json(layout: tuple[tuple[str, tuple[int, ...], bool], ...]) -> str:
    return json.dumps([[n, list(s), i] for n, s, i in layout], separators=(",", ":"))


def _parse_layout(text: str) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    try:
        items = json.loads(text)
        layout = tuple((str(n), tuple(int(d) for d in s), bool(i)) for n, s, i in items)
    except (ValueError, TypeError) as exc:
        raise MessageError(f"invalid layout: {exc}") from None
    for n, s, _ in layout:
        check_name(n, "layout entry")
        if any(d < 0 for d in s):
            raise MessageError("layout has a negative dimension")
    return layout


Layout = tuple[tuple[str, tuple[int, ...], bool], ...]


def layout_size(layout: Layout) -> int:
    """Number of ring elements a layout flattens to."""
    total = 0
    for _, shape, _ in layout:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


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
        try:
            value = json.loads(self.params_json)
        except ValueError as exc:
            raise MessageError(f"query parameters are not JSON: {exc}") from None
        except RecursionError:  # e.g. "[[[[...]]]]": a refusal like any malformed message, not an internal error
            raise MessageError("query parameters are nested too deeply") from None
        if not isinstance(value, dict):
            raise MessageError("query parameters must be a JSON object")
        return value


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
        if self.seed is not None:
            w.u8(0)
            w.raw(self.seed)
        else:
            w.u8(1)
            w.array(self.vector)

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
        if tag == 0:
            seed = r.raw("seed", 64)
            return cls(round_id, site, aggregator, encoding, records, layout, seed=seed)
        if tag == 1:
            vector = r.array("share vector")
            if vector.dtype != np.uint64 or vector.ndim != 1:
                raise MessageError("a share vector is a 1-d uint64 array")
            if vector.size != layout_size(layout):
                raise MessageError(f"share vector has {vector.size} elements, layout says {layout_size(layout)}")
            return cls(round_id, site, aggregator, encoding, records, layout, vector=vector)
        raise MessageError(f"unknown payload tag {tag}")


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
        if vector.dtype != np.uint64 or vector.ndim != 1 or vector.size != layout_size(layout):
            raise MessageError("aggregate vector must be 1-d uint64 matching its layout")
        return cls(rid, agg, contributors, records, encoding, layout, vector)


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
