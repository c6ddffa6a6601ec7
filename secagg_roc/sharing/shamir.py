"""Shamir t-of-n secret sharing among n aggregators, over F_p with p = 2^61 - 1.

A Site cuts each ring element of its encoded output (Z_2^64, two's-complement
fixed point) into two 32-bit limbs and shares every limb with its own random
polynomial of degree t-1 over F_p: aggregator j receives the evaluations at
x = j+1. Aggregators add shares in F_p. The Analyst interpolates at 0 from any
t aggregators' sums: each limb sum is an integer below K * 2^32 < p, so it is
exact, and lo + 2^32 * hi (mod 2^64) is the ring total -- the full 64-bit range
of the fixed-point codec, nothing narrower. Any t-1 aggregators see field
elements that are uniform and independent of the input; up to n-t may be down
or drop out mid-round. When more than t aggregators answer, the extra sums
must lie on the same polynomials: a mismatch raises `TamperError`.

The Analyst interpolates the two limb sums themselves, not only the total
they make: bare limbs would tell it, for every element, how many sites' low
limbs carried and how many sites' values were negative (their high limbs
are near 2^32), beyond the total. So a Site masks its limbs
(`carry_masks`): lo + 2^32 m and hi - m + 2^32 u, which leave lo + 2^32 hi
unchanged mod 2^64, with m and u uniform over 2^s values, s as large as the
K sites' limb sums allow below p. The limb sums the Analyst sees then hide
the carries and the count of negative values up to a statistical distance
of K / 2^s per element (s = 28 - ceil(log2 K): 2^-20.7 for K = 10).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import numpy as np

from .. import field, prg
from ..errors import TamperError
from ..ring import FixedPoint
from .base import Payload, SharingScheme
from .threat import ThreatModel

_32 = np.uint64(32)
_LOW = np.uint64(0xFFFFFFFF)
#: Limb sums of this many sites stay below p, so reconstruction is exact.
MAX_SITES = (field.P - 1) // 0xFFFFFFFF
#: Masked limbs are below 2^32 (2^s + 1); K of them sum below p while K (2^s + 1) <= 2^29 - 1.
_MASK_ROOM_BITS = 28


def carry_mask_bits(summands: int) -> int:
    """The bits s of the carry masks when `summands` sites' limbs are summed (0: no room, no masks)."""
    return max(0, _MASK_ROOM_BITS - max(0, int(summands) - 1).bit_length())


def carry_masks(seed: bytes, size: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Run by a Site: (m, u) for `size` ring elements, m uniform in [0, 2^bits) and u in [1, 2^bits], from a
    keystream of `seed` kept apart from the coefficients' (a re-created split re-creates its masks too)."""
    stream = prg.expand(hashlib.sha256(b"secagg-roc shamir carry masks" + bytes(seed)).digest()[:prg.SEED_BYTES],
                        2 * size)
    np.bitwise_and(stream, np.uint64((1 << bits) - 1), out=stream)
    m, u = stream[:size], stream[size:]
    u += np.uint64(1)
    return m, u


class ShamirSharing(SharingScheme):
    name = "shamir"
    private = True
    max_sites = MAX_SITES
    element_bits = 61

    def __init__(self, n_aggregators: int, threshold: int | None = None):
        super().__init__(n_aggregators)
        t = self.n_aggregators // 2 + 1 if threshold is None else int(threshold)
        if not 2 <= t <= self.n_aggregators:
            why = ("with threshold 1 every aggregator would hold a site's input in the clear" if t < 2 else
                   "more than the aggregators there are could never reconstruct")
            raise ValueError(f"a Shamir threshold must be in 2..{self.n_aggregators} (n_aggregators), got {threshold}: "
                             f"{why}")
        self.threshold = t

    @classmethod
    def check_n(cls, n_aggregators: int) -> int:
        if int(n_aggregators) < 2:
            raise ValueError("Shamir sharing needs at least 2 aggregators")
        if int(n_aggregators) >= 1 << 16:
            raise ValueError("Shamir sharing here supports fewer than 65536 aggregators")
        return int(n_aggregators)

    @property
    def threat_model(self) -> ThreatModel:
        n, t = self.n_aggregators, self.threshold
        return ThreatModel(
            scheme=self.name, servers=n, max_colluding_servers=t - 1, server_dropouts=n - t,
            trust=f"any {t - 1} of the {n} aggregators may collude; {t} together can reconstruct a site's input",
            site_dropouts="before its shares arrive at the answering aggregators",
            malicious={"aggregator alters its aggregate share": "detected" if n > t else "undetected",
                       "aggregator withholds its aggregate share": "blocked" if n == t else "undetected",
                       "site sends a malformed share": "blocked"},
            upload_vectors_per_site=2.0 * n, coalition=f"{t - 1} of {n} aggregators",
            notes=(f"field F_p, p = 2^61 - 1; each ring element travels as two 32-bit limbs, so totals keep "
                   f"the full 64-bit fixed-point range for up to {MAX_SITES} sites",
                   "alterations are detected when more than threshold aggregators answer: with exactly "
                   "threshold answering, an altered sum goes unnoticed",
                   "a malicious site sending one aggregator an inconsistent share produces the same evidence: the "
                   "round is blocked (no wrong total), and the named aggregator may be innocent",
                   "a run names its contributor set in every round after its join, checked by every site and "
                   "aggregator, so no two quorums release one run over different sets",
                   "random coefficients are 61 keystream bits with p folded onto 0: statistical distance "
                   "below 2^-61 per element from uniform",
                   "the analyst interpolates both limb sums; each site masks its limbs so that they hide how many "
                   "sites' values carried or were negative, up to a statistical distance of K / 2^(28 - "
                   "ceil(log2 K)) per element"),
        )

    def payload_length(self, n: int) -> int:
        return 2 * n

    def check_payload(self, vector: np.ndarray) -> str | None:
        if vector.size and int(vector.max()) >= field.P:
            return "a Shamir share holds field elements below 2^61 - 1"
        return None

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """One seed per random coefficient a_1 .. a_{t-1}."""
        return {k: prg.new_seed() for k in range(self.threshold - 1)}

    def split(self, encoded: np.ndarray, *, holder: int = 0, seeds: Mapping[int, bytes] | None = None,
              summands: int | None = None) -> list[Payload]:
        """Run by a Site: n shares of the limbs of `encoded` (`holder` plays no part: every share is alike);
        the coefficients are the keystreams of `seeds` (fresh from the OS unless given: see `fresh_seeds`).
        `summands`: how many sites' shares will be summed; the limbs are masked for that many (`carry_masks`;
        None: bare limbs, for tests of the field arithmetic alone)."""
        seeds = self.fresh_seeds() if seeds is None else _check_seeds(seeds, range(self.threshold - 1))
        ring = np.ascontiguousarray(encoded, dtype=np.uint64).reshape(-1)
        n = 2 * ring.size
        limbs, scratch = self._take(n), self._take(n)
        np.bitwise_and(ring, _LOW, out=limbs[: ring.size])
        np.right_shift(ring, _32, out=limbs[ring.size:])
        bits = 0 if summands is None else carry_mask_bits(summands)
        if bits:  # lo + 2^32 m and hi - m + 2^32 u: the same ring element, carries and signs hidden
            m, u = carry_masks(seeds[0], ring.size, bits)
            lo, hi = limbs[: ring.size], limbs[ring.size:]
            np.add(hi, np.left_shift(u, _32, out=u), out=hi)
            np.subtract(hi, m, out=hi)
            np.add(lo, np.left_shift(m, _32, out=m), out=lo)
        coefficients = [field.random_elements(n, seeds[k]) for k in range(self.threshold - 1)]
        small = self.n_aggregators < 8  # evaluation points below 8: in-place multiplies, no temporaries
        payloads = []
        for j in range(self.n_aggregators):
            x = j + 1
            acc = self._take(n)
            np.copyto(acc, coefficients[-1] if coefficients else limbs)
            # Horner's rule: ((a_{t-1} x + a_{t-2}) x + ... + a_1) x + limbs.
            for a in [*reversed(coefficients[:-1]), limbs] if coefficients else []:
                if small:
                    field.mul_small_into(acc, x, scratch)
                else:
                    acc = field.mul_scalar(acc, x)
                field.add(acc, a, scratch)
            payloads.append(Payload(vector=acc))
        if self.buffers is not None:
            for spare in (limbs, scratch, *coefficients):
                self.buffers.give(spare)
        return payloads

    def _take(self, n: int) -> np.ndarray:
        return np.empty(n, dtype=np.uint64) if self.buffers is None else self.buffers.take(n)

    def share(self, x: np.ndarray, codec: FixedPoint, *, holder: int = 0, out: np.ndarray | None = None,
              seeds: Mapping[int, bytes] | None = None, session: Any = None) -> list[Payload]:
        """Run by a Site: encode and split (the shares are fresh vectors; `out` only holds the encoding), its
        limbs masked for as many summands as the codec's sites (one for a per-site release, never summed)."""
        return self.split(codec.encode(x, out=out), holder=holder, seeds=seeds,
                          summands=getattr(codec, "max_sites", 1))

    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator: acc += share (mod p)."""
        field.add(acc, payload.vector)

    def materialize(self, out: np.ndarray, payload: Payload) -> None:
        np.copyto(out, payload.vector)

    def combine(self, aggregate_vectors: Mapping[int, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Run by the Analyst: interpolate at 0 from any `threshold` sums; check every further sum against them."""
        have = sorted(aggregate_vectors)
        if len(have) < self.threshold or any(not 0 <= j < self.n_aggregators for j in have):
            raise ValueError(f"need the sums of at least {self.threshold} of the {self.n_aggregators} aggregators "
                             f"(threshold {self.threshold}), got those of {have}")
        _check_consistent(aggregate_vectors, self.threshold)
        base = have[: self.threshold]
        limbs = field.combination([aggregate_vectors[j] for j in base], field.lagrange_at([j + 1 for j in base], 0))
        half = limbs.size // 2
        total = np.empty(half, dtype=np.uint64) if out is None else out
        np.left_shift(limbs[half:], _32, out=total)
        np.add(total, limbs[:half], out=total)
        return total


def _check_seeds(seeds: Mapping[int, bytes], keys: range) -> dict[int, bytes]:
    if set(seeds) != set(keys):
        raise ValueError(f"seeds must be given for {sorted(keys)} exactly, got {sorted(seeds)}")
    return {k: bytes(seeds[k]) for k in keys}


def _inconsistent(vectors: Mapping[int, np.ndarray], t: int) -> list[int]:
    """The aggregators beyond the first t whose sums do not lie on the polynomial through the first t."""
    have = sorted(vectors)
    base = have[:t]
    bad = []
    for j in have[t:]:
        predicted = field.combination([vectors[b] for b in base], field.lagrange_at([b + 1 for b in base], j + 1))
        if not np.array_equal(predicted, vectors[j]):
            bad.append(j)
    return bad


def _check_consistent(vectors: Mapping[int, np.ndarray], t: int) -> None:
    """Raise `TamperError` unless every sum lies on one polynomial of degree t-1 (naming the culprit if it can)."""
    if len(vectors) <= t or not _inconsistent(vectors, t):
        return
    # One liar among >= t + 2 answers: leaving it out makes the rest consistent, and no one else does.
    suspects = tuple(j for j in sorted(vectors) if len(vectors) - 1 > t
                     and not _inconsistent({k: v for k, v in vectors.items() if k != j}, t))
    who = (f"aggregator {suspects[0]} returned a sum" if len(suspects) == 1
           else f"the sums of aggregators {sorted(vectors)} are")
    raise TamperError(f"{who} inconsistent with the other aggregators' Shamir shares (an aggregator altered "
                      "its sum, or a site sent it an inconsistent share); refusing to return a wrong total", suspects if len(suspects) == 1 else tuple(sorted(vectors)))
