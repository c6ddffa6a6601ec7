"""Vector arithmetic in the prime field F_p, p = 2^61 - 1, on uint64 numpy arrays.

Shamir sharing needs a field; Z_2^64 is not one. A Mersenne prime makes the
reduction a shift and a mask, and 2^61 - 1 is the largest Mersenne prime whose
elements fit a uint64 with room for a sum of two, so every operation here is a
handful of whole-vector numpy passes with no Python-level loop over elements.
Elements are uint64 values in [0, p).
"""

from __future__ import annotations

import numpy as np

from . import prg

P = (1 << 61) - 1
_P = np.uint64(P)
_M32 = np.uint64(0xFFFFFFFF)
_61 = np.uint64(61)
_32 = np.uint64(32)
_29 = np.uint64(29)
_M29 = np.uint64((1 << 29) - 1)


def _reduce_once(v: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """v (< 2p) reduced to [0, p), in place, without a mask: for v < p, v - p wraps above v.

    `scratch` (same shape, uint64) spares a temporary: fresh large arrays cost a page fault per page."""
    return np.minimum(v, np.subtract(v, _P, out=scratch), out=v)


def _fold(v: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """v (< 2^64) reduced to [0, p), in place: 2^61 = 1 (mod p), so v = (v mod 2^61) + (v >> 61)."""
    hi = np.right_shift(v, _61, out=scratch)
    np.bitwise_and(v, _P, out=v)
    np.add(v, hi, out=v)
    return _reduce_once(v, hi)


def add(acc: np.ndarray, v: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """acc += v (mod p), in place; both in [0, p)."""
    np.add(acc, v, out=acc)  # < 2^62: no wrap
    _reduce_once(acc, scratch)


def mul_small_into(acc: np.ndarray, c: int, scratch: np.ndarray | None = None) -> None:
    """acc *= c (mod p), in place, for 0 <= c < 8 (Horner's rule at a small evaluation point)."""
    np.multiply(acc, np.uint64(c), out=acc)  # < 2^64
    _fold(acc, scratch)


def mul_scalar(a: np.ndarray, c: int) -> np.ndarray:
    """A new array a * c (mod p), for a in [0, p) and an integer scalar c.

    Split both into 32-bit halves so no partial product leaves 64 bits, then fold
    the powers of two back with 2^61 = 1: 2^64 = 8, and mid * 2^32 = m1 + m0 * 2^32
    for mid = m1 * 2^29 + m0."""
    c %= P
    if c < 8:  # a small evaluation point (Horner's rule): a * c < 2^64, one multiply and one fold
        return _fold(a * np.uint64(c))
    c0, c1 = np.uint64(c & 0xFFFFFFFF), np.uint64(c >> 32)
    a0 = a & _M32
    a1 = a >> _32
    lo = a0 * c0                       # < 2^64
    mid = a1 * c0                      # < 2^61
    if c1:
        mid += a0 * c1                 # < 2^62
        lo_folded = _fold(lo)
        lo_folded += (a1 * c1) << np.uint64(3)   # hi * 2^64 = hi * 8, < 2^61
    else:
        lo_folded = _fold(lo)
    lo_folded += mid >> _29                        # m1 < 2^33
    lo_folded += (mid & _M29) << _32               # m0 * 2^32 < 2^61
    return _fold(lo_folded)                        # the sum stayed below 2^63


def random_elements(n: int, seed: bytes | None = None) -> np.ndarray:
    """n field elements from the AES-CTR keystream of `seed` (a fresh OS seed unless given; statistical
    distance <= n * 2^-61 from uniform: the 61 low bits are uniform and only the pattern p folds onto 0)."""
    v = prg.expand(prg.new_seed() if seed is None else seed, n)
    np.bitwise_and(v, _P, out=v)
    v[v == _P] = 0
    return v


def inverse(c: int) -> int:
    """The multiplicative inverse of c (mod p)."""
    if c % P == 0:
        raise ZeroDivisionError("0 has no inverse in F_p")
    return pow(c, P - 2, P)


def lagrange_at(points: list[int], x: int) -> list[int]:
    """The Lagrange coefficients that evaluate, at `x`, the polynomial through values at `points`."""
    coefficients = []
    for i, xi in enumerate(points):
        num, den = 1, 1
        for m, xm in enumerate(points):
            if m != i:
                num = num * (x - xm) % P
                den = den * (xi - xm) % P
        coefficients.append(num * inverse(den) % P)
    return coefficients


def combination(vectors: list[np.ndarray], coefficients: list[int]) -> np.ndarray:
    """A new array sum_i coefficients[i] * vectors[i] (mod p)."""
    total = mul_scalar(vectors[0], coefficients[0])
    for v, c in zip(vectors[1:], coefficients[1:]):
        add(total, mul_scalar(v, c))
    return total
