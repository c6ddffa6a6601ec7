"""Fixed-point codec between float64/int arrays and the ring Z_2^64.

Values are stored as two's-complement integers in ``uint64`` so that numpy's
wrapping unsigned arithmetic *is* arithmetic mod 2^64. Floats are scaled by
2^frac_bits and rounded; integers are stored unscaled and sum exactly. Encoding
refuses any value that could wrap the ring once `max_sites` such values are
summed, because a wrapped total decodes to a plausible but wrong number; a
`wrap` codec (the sites' in a round) instead reduces every value modulo 2^64,
so that the total is exact whenever it is in range and, when it is not, a
function of the exact total alone (never of which site's value was large).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import EncodingError

RING_BITS = 64
_HALF = 1 << (RING_BITS - 1)
# Floats are encoded in chunks small enough to stay in cache (512 KiB, measured
# best here), so rounding, the range check and masking cost one pass over memory.
_CHUNK = 1 << 16


@dataclass(frozen=True)
class Encoding:
    """How a ring vector decodes: `frac_bits` of scale, and whether it holds integers.

    This travels with every share so that the analyst decodes integers as integers.
    """

    frac_bits: int
    integer: bool
    #: The ring elements are the bit patterns of float64 values: exact, but only for
    #: shares that are forwarded one site at a time, never summed (per-site DP releases).
    raw: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.frac_bits <= 62:
            raise EncodingError(f"frac_bits must be in 0..62, got {self.frac_bits}")
        if self.integer and self.frac_bits != 0:
            raise EncodingError("an integer encoding has frac_bits = 0")
        if self.raw and (self.integer or self.frac_bits != 0):
            raise EncodingError("a raw float64 encoding has no fractional bits and is not integer")

    def decode(self, values: np.ndarray) -> np.ndarray:
        """Ring values (uint64) -> a new int64 array for integer encodings, float64 otherwise."""
        ring = np.asarray(values, dtype=np.uint64)
        if self.raw:
            return ring.view(np.float64).copy()
        signed = ring.view(np.int64)
        if self.integer:
            return signed.copy()
        return np.multiply(signed, 2.0 ** -self.frac_bits)


INTEGER = Encoding(0, True)
RAW_FLOAT = Encoding(0, False, raw=True)


def encode_raw(x: np.ndarray) -> np.ndarray:
    """float64 values -> their bit patterns as ring elements (a new uint64 vector): exact, not summable."""
    x = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise EncodingError("cannot encode NaN or infinite values: every value must be a finite number")
    return x.view(np.uint64).copy()


class RawFloat:
    """The codec of per-site releases: float64 bit patterns, exact, forwarded one site at a time, never summed.

    It has `FixedPoint`'s `encode` signature, so every sharing scheme splits with it unchanged.
    """

    max_float = float("inf")

    def encoding_for(self, x: np.ndarray) -> Encoding:
        return RAW_FLOAT

    def encode(self, x: np.ndarray, out: np.ndarray | None = None, *,
               on_chunk: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        bits = encode_raw(x)
        if out is not None:
            np.copyto(out.reshape(-1), bits)
            bits = out.reshape(-1)
        if on_chunk is not None:
            on_chunk(bits)
        return bits


class FixedPoint:
    """Fixed-point codec over Z_2^64.

    `frac_bits` is the resolution for floats (2^-frac_bits); `max_sites` is the
    largest number of encoded values that will ever be summed, which sets the
    largest magnitude a single value may have. A `saturate` codec clips values
    beyond that range to it (``min(max(x, -limit), limit)``, NaN stays NaN and
    is refused) instead of refusing them, chunk by chunk as it encodes. A `wrap`
    codec neither refuses nor clips: it encodes ``rint(x 2^frac_bits) mod 2^64``
    exactly (NaN refused, +-inf taken as +-max_float), so a sum of such values
    decodes to the exact total while the TOTAL is within +-2^63 / 2^frac_bits,
    whatever each summand was, and otherwise to that total modulo the ring:
    a function of the total alone. Clipping each summand instead made a
    summed release the total of the sites below the limit plus a known
    constant per site above it: one site's own total, when all others
    exceeded it (tests/test_attacks_redteam_18.py). The sites encode every
    round this way (`site.Site.share`).
    """

    def __init__(self, frac_bits: int = 32, max_sites: int = 64, *, saturate: bool = False, wrap: bool = False):
        if not 0 <= frac_bits <= 62:
            raise EncodingError(f"frac_bits must be in 0..62, got {frac_bits}")
        if max_sites < 1:
            raise EncodingError(f"max_sites must be >= 1, got {max_sites}")
        self.frac_bits = int(frac_bits)
        self.max_sites = int(max_sites)
        self.saturate = bool(saturate)
        self.wrap = bool(wrap)
        if self.saturate and self.wrap:
            raise EncodingError("a codec saturates or wraps, not both")
        self.float_encoding = Encoding(self.frac_bits, False)
        # Largest |encoded value| such that max_sites of them cannot leave [-2^63, 2^63).
        self.max_encoded = (_HALF - 1) // self.max_sites
        # ... as a float: the largest one not above it (float(max_encoded) may round up past it).
        limit = float(self.max_encoded)
        while int(limit) > self.max_encoded:
            limit = float(np.nextafter(limit, 0.0))
        self._limit = limit
        self.max_float = limit * 2.0 ** -self.frac_bits
        self.max_int = self.max_encoded
        # `_encode_float`'s constants, made once per codec (a site encodes every round with the same one).
        self._scale = float(2 ** self.frac_bits)
        self._offset = 1.5 * 2.0 ** (52 - self.frac_bits)
        self._offset_bits = np.float64(self._offset).view(np.int64)
        self._magic_limit = min(limit, float(2**51 - 1)) / self._scale

    def __repr__(self) -> str:
        mode = ", saturate=True" if self.saturate else ", wrap=True" if self.wrap else ""
        return f"FixedPoint(frac_bits={self.frac_bits}, max_sites={self.max_sites}{mode})"

    def encoding_for(self, x: np.ndarray) -> Encoding:
        """The encoding `encode` uses for `x`: exact integers for integer/bool dtypes."""
        kind = np.asarray(x).dtype.kind
        if kind in "iub":
            return INTEGER
        if kind == "f":
            return self.float_encoding
        raise EncodingError(
            f"cannot encode dtype {np.asarray(x).dtype}: give a float or integer array"
        )

    def encode(
        self,
        x: np.ndarray,
        out: np.ndarray | None = None,
        *,
        on_chunk: Callable[[np.ndarray], None] | None = None,
    ) -> np.ndarray:
        """Encode `x` into ring elements (uint64, same shape); refuses values that could wrap.

        `on_chunk(block)` is called with each flat block of `out` right after it
        is encoded, while it is still in cache: a sharing scheme masks it there
        instead of making another pass over memory.
        """
        x = np.asarray(x)
        encoding = self.encoding_for(x)
        if out is None:
            out = np.empty(x.shape, dtype=np.uint64)
        elif out.shape != x.shape or out.dtype != np.uint64:
            raise EncodingError(f"output buffer must be uint64 of shape {x.shape}")
        if encoding.integer:
            self._encode_int(x, out)
            if on_chunk is not None:
                on_chunk(out.reshape(-1))
        else:
            self._encode_float(x, out, on_chunk)
        return out

    def decode(self, values: np.ndarray, encoding: Encoding | None = None) -> np.ndarray:
        """Decode ring elements; floats by default, or as `encoding` says."""
        return (encoding or self.float_encoding).decode(values)

    def _encode_int(self, x: np.ndarray, out: np.ndarray) -> None:
        if self.wrap:  # two's complement: every integer dtype's value modulo 2^64
            np.copyto(out, np.asarray(x).astype(np.uint64, casting="unsafe"), casting="unsafe")
            return
        if self.saturate:  # clipped in the output itself: no temporary array
            target = out.view(np.int64)
            np.maximum(x, -self.max_int, out=target)
            np.minimum(target, self.max_int, out=target)
            return
        if x.size:
            lo, hi = int(x.min()), int(x.max())
            if lo < -self.max_int or hi > self.max_int:
                bad = lo if lo < -self.max_int else hi
                rule = (
                    f"could wrap the ring when {self.max_sites} values are summed: "
                    f"|value| must be <= {self.max_int} (about 2^63 / max_sites); "
                    "declare fewer max_sites or split the value"
                )
                raise EncodingError(f"integer {bad} {rule}", f"an integer {rule}")
        np.copyto(out.view(np.int64), x, casting="unsafe")

    def _encode_float(self, x: np.ndarray, out: np.ndarray, on_chunk: Callable[[np.ndarray], None] | None) -> None:
        flat_x = x.reshape(-1)
        flat_out = out.reshape(-1).view(np.int64)
        scale = self._scale
        limit = self._limit
        # Adding offset = 1.5 * 2^(52 - frac_bits) to x puts the sum in a binade
        # whose spacing is exactly 2^-frac_bits: the add rounds x to the ring's
        # resolution (ties to even, as np.rint(x * 2^frac_bits)) and leaves the
        # integer in the low mantissa bits. One add and one integer subtract thus
        # replace scaling, rint and a slow float->int cast. Valid while
        # |x * 2^frac_bits| < 2^51; other chunks take the exact slow path.
        offset, offset_bits, magic_limit = self._offset, self._offset_bits, self._magic_limit
        # (Reductions called directly: a round's few totals would spend most of their encoding in the
        # methods' wrappers.)
        top, bottom = np.maximum.reduce, np.minimum.reduce
        buf = np.empty(min(_CHUNK, flat_x.size), dtype=np.float64)
        for start in range(0, flat_x.size, _CHUNK):
            chunk = flat_x[start : start + _CHUNK]
            target = flat_out[start : start + _CHUNK]
            shifted = buf[: chunk.size]
            # The common case first, tested on the values themselves: a chunk within +-magic_limit (so
            # within +-max_float: nothing to clip) takes two reductions, the add and the subtract, four
            # passes over a chunk in cache instead of six. Its rounded values pass the test below too,
            # so it is encoded exactly as there. NaN fails `<=`: such a chunk goes the long way.
            hi, lo = top(chunk), bottom(chunk)
            if hi <= magic_limit and lo >= -magic_limit:
                np.add(chunk, offset, out=shifted)
                np.subtract(shifted.view(np.int64), offset_bits, out=target)
                if on_chunk is not None:
                    on_chunk(target.view(np.uint64))
                continue
            if self.wrap:
                self._wrap_chunk(chunk, target)
                if on_chunk is not None:
                    on_chunk(target.view(np.uint64))
                continue
            if self.saturate:  # while the chunk is in cache, not as whole-vector passes over memory
                np.maximum(chunk, -self.max_float, out=shifted)
                np.minimum(shifted, self.max_float, out=shifted)
                np.add(shifted, offset, out=shifted)
            else:
                np.add(chunk, offset, out=shifted)
            # Exact: the sum and the offset share a binade. `not (a <= b)` is also
            # true for NaN, so one test catches NaN, inf and overflow.
            hi, lo = top(shifted) - offset, bottom(shifted) - offset
            if hi <= magic_limit and lo >= -magic_limit:
                np.subtract(shifted.view(np.int64), offset_bits, out=target)
            else:
                if self.saturate:  # the exact path works on the clipped values (a temporary: rare)
                    chunk = np.minimum(np.maximum(chunk, -self.max_float), self.max_float)
                with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, by name
                    np.multiply(chunk, scale, out=shifted)
                if not (shifted.max() <= limit and shifted.min() >= -limit):
                    self._raise_float(chunk)
                np.rint(shifted, out=shifted)
                np.copyto(target, shifted, casting="unsafe")
            if on_chunk is not None:
                on_chunk(target.view(np.uint64))

    def _wrap_chunk(self, chunk: np.ndarray, target: np.ndarray) -> None:
        """``rint(chunk 2^frac_bits) mod 2^64`` into `target` (int64 view), exactly: x = k 2^(64-f) + r with
        r = fmod(x, 2^(64-f)) (fmod is exact), so x 2^f = k 2^64 + r 2^f and rint(x 2^f) = rint(r 2^f) mod 2^64."""
        if np.isnan(chunk).any():
            raise EncodingError("cannot encode NaN: every value must be a finite number")
        x = np.clip(chunk, -self.max_float, self.max_float) if np.isinf(chunk).any() else chunk
        v = np.fmod(x, 2.0 ** (RING_BITS - self.frac_bits))
        np.multiply(v, self._scale, out=v)
        np.rint(v, out=v)
        np.fmod(v, 2.0 ** RING_BITS, out=v)  # rint may reach 2^64 itself
        v[v >= 2.0 ** (RING_BITS - 1)] -= 2.0 ** RING_BITS
        v[v < -(2.0 ** (RING_BITS - 1))] += 2.0 ** RING_BITS
        np.copyto(target, v, casting="unsafe")

    def _raise_float(self, chunk: np.ndarray) -> None:
        bad = float(chunk[~(np.abs(chunk) <= self.max_float)][0])
        if np.isnan(bad):
            raise EncodingError("cannot encode NaN: every value must be a finite number")
        if np.isinf(bad):
            raise EncodingError(f"cannot encode {bad}: every value must be a finite number",
                                "cannot encode an infinite value: every value must be a finite number")
        rule = (
            f"could wrap the ring when {self.max_sites} values are summed: "
            f"|value| must be <= {self.max_float:.6g} at frac_bits={self.frac_bits}; "
            "use fewer fractional bits, rescale the value, or declare a smaller max_sites"
        )
        raise EncodingError(f"value {bad!r} {rule}", f"a value {rule}")


@functools.lru_cache(maxsize=64)
def shared_codec(frac_bits: int, max_sites: int, saturate: bool, wrap: bool = False) -> FixedPoint:
    """The process's one `FixedPoint(frac_bits, max_sites, saturate=saturate, wrap=wrap)`: a codec is never changed
    after it is made, so every site of a process may encode with the same one (an embedded study makes
    five sites per task, and each derived its codec's range limits again). Its shares then carry the very
    same `Encoding` object, which the aggregators' agreement check compares by identity first."""
    return FixedPoint(frac_bits, max_sites, saturate=saturate, wrap=wrap)
