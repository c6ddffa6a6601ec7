"""Shamir t-of-n sharing of 32-byte secrets over the prime field GF(2^521 - 1).

The field is larger than 2^256, so a 32-byte secret is one field element and
each share is one field element (66 bytes). A share's x-coordinate is the
holder's site id + 1 (never 0, where the secret lives). Any t shares
reconstruct the secret by Lagrange interpolation at 0; any t - 1 shares are
uniformly distributed and independent of it. Coefficients come from the
operating system (`secrets`).
"""

from __future__ import annotations

import secrets
from functools import lru_cache
from typing import Iterable, Mapping, Sequence

from .errors import MessageError, RoundError

PRIME = (1 << 521) - 1  # a Mersenne prime > 2^256
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def x_of(site: int) -> int:
    """The x-coordinate of the share held by `site`."""
    return site + 1


def split(secret: bytes, holders: Iterable[int], threshold: int) -> dict[int, int]:
    """One share of `secret` per holder (site id -> field element), any `threshold` of which rebuild it."""
    holders = list(holders)
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a shared secret is {SECRET_BYTES} bytes")
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be in 1..{len(holders)} (the number of holders)")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for h in holders:
        x, acc = x_of(h), 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        shares[h] = acc
    return shares


@lru_cache(maxsize=4096)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    # Cached: the server rebuilds many secrets from the same few holder sets.
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def reconstruct(shares: Mapping[int, int], threshold: int) -> bytes:
    """The 32-byte secret from at least `threshold` shares (holder site id -> field element)."""
    if len(shares) < threshold:
        raise RoundError(f"{len(shares)} shares cannot rebuild a {threshold}-of-n secret")
    holders = sorted(shares)[:threshold]
    coeffs = _lagrange_at_zero(tuple(x_of(h) for h in holders))
    value = sum(c * shares[h] for c, h in zip(coeffs, holders)) % PRIME
    if value >= 1 << (8 * SECRET_BYTES):
        # Honest shares of a 32-byte secret never interpolate above 2^256.
        raise RoundError("shares are inconsistent: they do not interpolate to a 32-byte secret")
    return value.to_bytes(SECRET_BYTES, "big")


def to_bytes(share: int) -> bytes:
    """A share as 66 big-endian bytes."""
    return share.to_bytes(SHARE_BYTES, "big")


def from_bytes(raw: bytes) -> int:
    """A share from its 66 bytes; refuses anything outside the field."""
    if len(raw) != SHARE_BYTES:
        raise MessageError(f"a Shamir share is {SHARE_BYTES} bytes, got {len(raw)}")
    value = int.from_bytes(raw, "big")
    if value >= PRIME:
        raise MessageError("a Shamir share is not a field element")
    return value


def holders_of(shares: Sequence[tuple[int, bytes]]) -> dict[int, int]:
    """Decoded shares keyed by holder; refuses a holder listed twice."""
    out: dict[int, int] = {}
    for holder, raw in shares:
        if holder in out:
            raise MessageError(f"site {holder} gave two shares of one secret")
        out[holder] = from_bytes(raw)
    return out
