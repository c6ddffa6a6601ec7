"""The messages of the aggregators' joint computation (`secure_auc`), in the wire format of `messages`.

Field elements (of Z_p, p = 2^255 - 19) travel as four little-endian uint64 limbs each.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..errors import MessageError
from ..messages import Message, RoundId, _Reader, _Writer

LIMBS = 4
_MASK = (1 << 64) - 1


def to_limbs(values: list[int]) -> np.ndarray:
    """Field elements (ints in [0, 2^256)) -> a uint64 vector of 4 limbs each."""
    out = np.empty(LIMBS * len(values), dtype=np.uint64)
    for i, v in enumerate(values):
        for k in range(LIMBS):
            out[LIMBS * i + k] = (v >> (64 * k)) & _MASK
    return out


def from_limbs(limbs: np.ndarray) -> list[int]:
    """The inverse of `to_limbs`."""
    a = np.asarray(limbs, dtype=np.uint64)
    if a.size % LIMBS:
        raise MessageError("field elements come in groups of four limbs")
    return [sum(int(a[i + k]) << (64 * k) for k in range(LIMBS)) for i in range(0, a.size, LIMBS)]


def _check_vector(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype != np.uint64 or a.ndim != 1:
        raise MessageError(f"{what} must be a 1-d uint64 vector")
    return a


@dataclass(frozen=True)
class MpcMaterial(Message):
    """Helper -> aggregator j: its shares of the correlated randomness of one secure AUC (from the OS)."""

    KIND: ClassVar[int] = 20
    round_id: RoundId
    aggregator: int
    ring: np.ndarray = field(compare=False)  # shares in Z_2^64
    field_limbs: np.ndarray = field(compare=False)  # shares in Z_p

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.u64(self.aggregator)
        w.array(self.ring)
        w.array(self.field_limbs)

    @classmethod
    def _read(cls, r: _Reader) -> "MpcMaterial":
        rid, agg = r.round_id(), r.u64("aggregator index")
        return cls(rid, agg, _check_vector(r.array("ring shares"), "ring shares"),
                   _check_vector(r.array("field shares"), "field shares"))


@dataclass(frozen=True)
class MpcOpen(Message):
    """Aggregator j -> every other aggregator: its share of values being opened at `step` (all masked)."""

    KIND: ClassVar[int] = 21
    round_id: RoundId
    aggregator: int
    step: int
    ring: np.ndarray = field(compare=False)
    field_limbs: np.ndarray = field(compare=False)

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.u64(self.aggregator)
        w.u64(self.step)
        w.array(self.ring)
        w.array(self.field_limbs)

    @classmethod
    def _read(cls, r: _Reader) -> "MpcOpen":
        rid, agg, step = r.round_id(), r.u64("aggregator index"), r.u64("step")
        return cls(rid, agg, step, _check_vector(r.array("ring values"), "ring values"),
                   _check_vector(r.array("field values"), "field values"))


@dataclass(frozen=True)
class AucRelease(Message):
    """Aggregator -> analyst and contributing sites: the AUC of a secure AUC round, one float, nothing else."""

    KIND: ClassVar[int] = 22
    round_id: RoundId
    value: float

    def _write(self, w: _Writer) -> None:
        w.round_id(self.round_id)
        w.raw(struct.pack("<d", float(self.value)))

    @classmethod
    def _read(cls, r: _Reader) -> "AucRelease":
        rid = r.round_id()
        raw = r.raw("value", 8)
        if len(raw) != 8:
            raise MessageError("an AUC release carries one float64")
        value = struct.unpack("<d", raw)[0]
        if not 0.0 <= value <= 1.0:  # NaN fails this too: an AUC is a number in [0, 1]
            raise MessageError(f"an AUC release carries an AUC in [0, 1], not {value!r}")
        return cls(rid, value)
