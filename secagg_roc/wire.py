"""The binary wire format every message uses: identifiers, layouts, and the reader and writer.

Format (all integers little-endian)::

    b"SRM" | version u8 | kind u8 | fields of that kind, in order | nothing else

Field encodings: ``str``/``bytes`` = u32 length + bytes (UTF-8 for str);
``u64``/``i64``; a tuple of str = u32 count + strs; an array = dtype code u8,
ndim u8, each dim u64, then the raw little-endian element bytes. The writer
produces a list of buffers (header bytes + the arrays' own memory), so a large
share vector is never copied before it reaches the socket. The reader checks
every length, code, identifier and shape and raises only `MessageError`.
`messages` defines the message kinds on top of this.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import MessageError
from .ring import Encoding
from .quick_init import quick_init

MAGIC = b"SRM"
VERSION = 2
DIGEST_BYTES = 32
MAX_NDIM = 8
MAX_STR = 1 << 20
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")  # \Z, not $: "$" would let a trailing newline through

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


@quick_init
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


class Writer:
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


class Reader:
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




def layout_json(layout: tuple[tuple[str, tuple[int, ...], bool], ...]) -> str:
    """A layout (name, shape, integer?) per array as compact JSON, as the wire header carries it."""
    return json.dumps([[n, list(s), i] for n, s, i in layout], separators=(",", ":"))


def parse_layout(text: str) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """A wire header's layout JSON, checked (names, non-negative dimensions), or MessageError."""
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
    """Number of ring elements a layout flattens to (found by identity for a layout `layout.flatten` made: every
    party checks every share's length, and an embedded study's sites hand over the same layout objects)."""
    hit = _SIZES.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    total = 0
    for _, shape, _ in layout:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


#: Sizes of the layouts `layout.flatten` made (immutable by construction: names, tuples of ints, bools): id ->
#: (the layout, its size). Held with the layout, so an id is not reused while its entry lives.
_SIZES: dict[int, tuple[Layout, int]] = {}
_SIZES_KEPT = 256


def remember_size(layout: Layout) -> None:
    """Keep the size of `layout`, an immutable layout made in this process (`layout.flatten`)."""
    if len(_SIZES) >= _SIZES_KEPT:
        _SIZES.clear()
    _SIZES[id(layout)] = (layout, layout_size(layout))
