"""The messages of one pairwise-masking round: small frozen dataclasses with a byte encoding.

Each message has `encode()` (bytes), `nbytes()` (its encoded length), `kind`
(the class name) and `wire_size()` (= `nbytes()`), so a
`secagg_roc.transcript.Transcript` records it like the library's own messages,
and `decode(data)` parses any of them, raising only `MessageError`. The format
is the library's style but with its own magic, so the two never mix::

    b"SRP" | version u8 | kind u8 | fields in order (little-endian; bytes = u32 length + bytes;
    a site id = u64; a set of sites = u32 count + sorted u64s; a vector = u64 count + uint64 data)

Sites are non-negative integers. `round_tag` is the round id (bytes) each party
checks; it is not called `round_id` because transcripts read that as a `RoundId`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .errors import MessageError

MAGIC = b"SRP"
VERSION = 2  # 2: AdvertiseKeys carries a signature and a certificate
MAX_BYTES = 1 << 20
MAX_SITES = 1 << 20
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Writer:
    def __init__(self, kind: int):
        self.parts: list[Any] = [MAGIC + bytes([VERSION, kind])]

    def site(self, v: int) -> None:
        self.parts.append(_U64.pack(v))

    def raw(self, v: bytes) -> None:
        self.parts += [_U32.pack(len(v)), v]

    def sites(self, vs: frozenset[int]) -> None:
        self.parts.append(_U32.pack(len(vs)) + b"".join(_U64.pack(v) for v in sorted(vs)))

    def vector(self, a: np.ndarray) -> None:
        self.parts += [_U64.pack(a.size), memoryview(np.ascontiguousarray(a, dtype="<u8")).cast("B")]


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.view, self.pos = memoryview(data).cast("B"), 0

    def take(self, n: int, what: str) -> memoryview:
        if self.pos + n > len(self.view):
            raise MessageError(f"pairwise message truncated while reading {what}")
        self.pos += n
        return self.view[self.pos - n : self.pos]

    def count(self, what: str, limit: int) -> int:
        n = _U32.unpack(self.take(4, what))[0]
        if n > limit:
            raise MessageError(f"{what}: {n} is more than the {limit} allowed")
        return n

    def site(self, what: str = "site") -> int:
        v = _U64.unpack(self.take(8, what))[0]
        if v >= 1 << 63:
            raise MessageError(f"{what} {v} out of range")
        return v

    def raw(self, what: str) -> bytes:
        return bytes(self.take(self.count(what, MAX_BYTES), what))

    def sites(self, what: str) -> frozenset[int]:
        vs = [self.site(what) for _ in range(self.count(what, MAX_SITES))]
        if len(set(vs)) != len(vs):
            raise MessageError(f"{what} lists a site twice")
        return frozenset(vs)

    def vector(self, what: str) -> np.ndarray:
        n = _U64.unpack(self.take(8, what))[0]
        if n > (len(self.view) - self.pos) // 8:
            raise MessageError(f"{what}: {n} elements, the message has fewer")
        return np.frombuffer(self.take(8 * n, what), dtype="<u8").astype(np.uint64)


class PairwiseMessage:
    """Base: encoding, size and the registry `decode` dispatches on."""

    KIND: ClassVar[int]
    registry: ClassVar[dict[int, type["PairwiseMessage"]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        PairwiseMessage.registry[cls.KIND] = cls

    @property
    def kind(self) -> str:
        return type(self).__name__

    def _write(self, w: _Writer) -> None:
        raise NotImplementedError

    @classmethod
    def _read(cls, r: _Reader) -> "PairwiseMessage":
        raise NotImplementedError

    def to_buffers(self) -> list[Any]:
        w = _Writer(self.KIND)
        self._write(w)
        return w.parts

    def encode(self) -> bytes:
        return b"".join(bytes(b) for b in self.to_buffers())

    def nbytes(self) -> int:
        """Encoded size in bytes."""
        return sum(len(memoryview(b).cast("B")) for b in self.to_buffers())

    wire_size = nbytes


def decode(data: bytes | bytearray | memoryview) -> PairwiseMessage:
    """Parse one pairwise message; `MessageError` for anything malformed, never another exception."""
    try:
        r = _Reader(data)
        if bytes(r.take(3, "magic")) != MAGIC:
            raise MessageError("not a pairwise-masking message (bad magic bytes)")
        version, kind = r.take(2, "version and kind")
        if version != VERSION:
            raise MessageError(f"unsupported pairwise message version {version}")
        cls = PairwiseMessage.registry.get(kind)
        if cls is None:
            raise MessageError(f"unknown pairwise message kind {kind}")
        msg = cls._read(r)
        if r.pos != len(r.view):
            raise MessageError(f"{len(r.view) - r.pos} unexpected bytes after the message")
        return msg
    except MessageError:
        raise
    except Exception as exc:  # a bug in a parser must still be a clean refusal
        raise MessageError(f"malformed pairwise message: {type(exc).__name__}: {exc}") from None


@dataclass(frozen=True)
class AdvertiseKeys(PairwiseMessage):
    """Site -> server (and relayed to its neighbours): the site's two fresh X25519 public keys."""

    KIND: ClassVar[int] = 1
    round_tag: bytes
    site: int
    c_public: bytes  # encrypts the shares sent to this site
    s_public: bytes  # agrees pairwise masks
    #: A deployed site's signature over `signed_bytes` with its study certificate's key, and that certificate
    #: (DER); empty in the embedded federation (see `deploy.key_signing`).
    signature: bytes = b""
    certificate: bytes = b""

    def signed_bytes(self, study: str) -> bytes:
        """What a deployed site signs: the study, the round, the site and both keys (length-prefixed)."""
        w = _Writer(self.KIND)
        w.raw(b"secagg-roc pairwise keys v1"), w.raw(study.encode()), w.raw(self.round_tag), w.site(self.site)
        w.raw(self.c_public), w.raw(self.s_public)
        return b"".join(bytes(p) for p in w.parts)

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.site(self.site), w.raw(self.c_public), w.raw(self.s_public)
        w.raw(self.signature), w.raw(self.certificate)

    @classmethod
    def _read(cls, r: _Reader) -> "AdvertiseKeys":
        return cls(r.raw("round tag"), r.site(), r.raw("c public key"), r.raw("s public key"), r.raw("signature"),
                   r.raw("certificate"))


@dataclass(frozen=True)
class NeighbourKeys(PairwiseMessage):
    """Server -> site: the advertised keys of the site's neighbours that advertised in time."""

    KIND: ClassVar[int] = 2
    round_tag: bytes
    site: int
    keys: tuple[AdvertiseKeys, ...]

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.site(self.site)
        w.parts.append(_U32.pack(len(self.keys)))
        for k in self.keys:
            k._write(w)

    @classmethod
    def _read(cls, r: _Reader) -> "NeighbourKeys":
        tag, site = r.raw("round tag"), r.site()
        n = r.count("neighbour keys", MAX_SITES)
        return cls(tag, site, tuple(AdvertiseKeys._read(r) for _ in range(n)))


@dataclass(frozen=True)
class EncryptedShare(PairwiseMessage):
    """Site -> server -> site: AES-GCM(shares of the sender's b and s key held by the receiver)."""

    KIND: ClassVar[int] = 3
    round_tag: bytes
    sender: int
    receiver: int
    nonce: bytes
    ciphertext: bytes

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.site(self.sender), w.site(self.receiver), w.raw(self.nonce), w.raw(self.ciphertext)

    @classmethod
    def _read(cls, r: _Reader) -> "EncryptedShare":
        return cls(r.raw("round tag"), r.site("sender"), r.site("receiver"), r.raw("nonce"), r.raw("ciphertext"))


@dataclass(frozen=True)
class MaskedInput(PairwiseMessage):
    """Site -> server: y_u = x_u + self mask + pairwise masks (mod 2^64)."""

    KIND: ClassVar[int] = 4
    round_tag: bytes
    site: int
    y: np.ndarray = field(compare=False)

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.site(self.site), w.vector(self.y)

    @classmethod
    def _read(cls, r: _Reader) -> "MaskedInput":
        return cls(r.raw("round tag"), r.site(), r.vector("masked vector"))


@dataclass(frozen=True)
class UnmaskRequest(PairwiseMessage):
    """Server -> sites: who survived (sent y) and who dropped after sharing keys."""

    KIND: ClassVar[int] = 5
    round_tag: bytes
    survivors: frozenset[int]
    dropped: frozenset[int]

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.sites(self.survivors), w.sites(self.dropped)

    @classmethod
    def _read(cls, r: _Reader) -> "UnmaskRequest":
        return cls(r.raw("round tag"), r.sites("survivors"), r.sites("dropped"))


def _write_shares(w: _Writer, shares: tuple[tuple[int, bytes], ...]) -> None:
    w.parts.append(_U32.pack(len(shares)))
    for owner, share in shares:
        w.site(owner), w.raw(share)


def _read_shares(r: _Reader, what: str) -> tuple[tuple[int, bytes], ...]:
    return tuple((r.site(what), r.raw(what)) for _ in range(r.count(what, MAX_SITES)))


@dataclass(frozen=True)
class UnmaskResponse(PairwiseMessage):
    """Site -> server: its shares of b_v for surviving v and of s_v's key for dropped v ((owner, share) pairs)."""

    KIND: ClassVar[int] = 6
    round_tag: bytes
    site: int
    self_mask_shares: tuple[tuple[int, bytes], ...]
    key_shares: tuple[tuple[int, bytes], ...]

    def _write(self, w: _Writer) -> None:
        w.raw(self.round_tag), w.site(self.site)
        _write_shares(w, self.self_mask_shares)
        _write_shares(w, self.key_shares)

    @classmethod
    def _read(cls, r: _Reader) -> "UnmaskResponse":
        tag, site = r.raw("round tag"), r.site()
        return cls(tag, site, _read_shares(r, "self-mask shares"), _read_shares(r, "key shares"))


#: Every message kind, by class name (for protocol specs and transcripts).
KINDS: frozenset[str] = frozenset(cls.__name__ for cls in PairwiseMessage.registry.values())

__all__ = ["AdvertiseKeys", "EncryptedShare", "KINDS", "MaskedInput", "NeighbourKeys", "PairwiseMessage",
           "UnmaskRequest", "UnmaskResponse", "decode"]
