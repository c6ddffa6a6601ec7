"""The secure AUC: the aggregators compute the AUC from their shares of the class histograms, and open only it.

Input: after a ``histogram.shares`` round (``release="mpc"``) every aggregator
j keeps its additive share (mod 2^64) of the total per-bucket counts of
controls ``neg`` and cases ``pos``; nobody reconstructs them. With
``W_b = 2 sum_{c<b} neg_c + neg_b`` (local: linear in the shares),

    AUC = num / den,   num = sum_b pos_b W_b,   den = 2 P N,   P = sum pos, N = sum neg,

ties within a bucket counting 1/2. The steps (each aggregator's part is a
method of `AucParty`; the helper's is `Helper`):

1. **Products in Z_2^64.** One inner-product Beaver triple (vectors a, b of B
   elements, c = <a, b>) and one scalar triple from the helper give shares of
   num and of P N (Beaver 1991): open ``pos - a``, ``W - b``, ``P - a'``,
   ``N - b'`` (uniformly masked), then combine locally. Exact: the plan allows
   at most 2^31 records, so num and den stay below 2^63.
2. **Lift to Z_p** (p = 2^255 - 19) of the two scalars: the helper deals a
   random R in Z_2^64 shared both mod 2^64 and bit by bit in Z_p. The
   aggregators open ``c = x + R mod 2^64`` (uniform: hides x), and compute the
   wrap bit ``[c < R]`` by the standard comparison of a public value with
   shared bits (63 sequential Beaver products in Z_p for the prefix of
   equal bits); then ``x = c - R + 2^64 [c < R]`` over the integers, in Z_p.
3. **Multiplicative blinding.** Aggregator j draws rho_j uniform in Z_p from
   the operating system; ``r = sum rho_j`` is a uniform field element no
   coalition short of all aggregators knows. One Beaver product each gives
   shares of ``A = r num`` and ``D = r den``, which the aggregators open.
4. **The AUC.** Every aggregator computes ``t = A / D`` in Z_p, which is
   ``num / den`` in Z_p, recovers the fraction by rational reconstruction
   (numerator and denominator are below 2^63 < sqrt(p / 2), so it is unique)
   and the AUC as the nearest float. Aggregator 0 sends that one float to the
   analyst and to the contributing sites.

Leakage. The analyst receives one float, the AUC (NaN when a class is empty
over all sites). The pair (A, D), seen by the aggregators, is (r num, r den)
for r uniform in Z_p^*: D is uniform and A = D t, so the pair reveals exactly
the field ratio t, i.e. the AUC as a reduced fraction, and nothing about num or
den beyond it (no statistical leakage: the blinding is in a field, not over the
integers). The reduced fraction can tell more than the float (its denominator
divides 2 P N); so an analyst colluding with an aggregator learns the exact
rational AUC, no more. Every other opened value is masked by uniformly random
helper material. The helper learns nothing (it only sends). Security is
semi-honest, with the helper not colluding with any aggregator.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..prg import expand, new_seed

#: The field of steps 2-4: 2^255 - 19 is prime.
P = (1 << 255) - 19
RING = 1 << 64
BITS = 64
#: Step numbers of the openings.
PRODUCTS, MASKED, COMPARE0, BLIND, RESULT = 0, 1, 2, 2 + BITS - 1, 3 + BITS - 1


def _ring_shares(values: np.ndarray, n: int) -> list[np.ndarray]:
    """Additive shares mod 2^64 of a uint64 vector: n - 1 uniform ones from the OS, the last the difference."""
    parts = [expand(new_seed(), values.size) for _ in range(n - 1)]
    last = values.copy()
    for p in parts:
        last -= p
    return parts + [last]


def _field_shares(values: list[int], n: int) -> list[list[int]]:
    parts = [[secrets.randbelow(P) for _ in values] for _ in range(n - 1)]
    last = [(v - sum(col)) % P for v, col in zip(values, zip(*parts))] if parts else [v % P for v in values]
    return parts + [last]


@dataclass
class Material:
    """One aggregator's share of the helper's correlated randomness."""

    a: np.ndarray  # inner-product triple, B elements
    b: np.ndarray
    c: int
    scalar: tuple[int, int, int]  # a', b', c' = a' b' (mod 2^64)
    r_ring: np.ndarray  # R, two elements, mod 2^64
    r_bits: list[list[int]]  # R's bits in Z_p: [element][bit]
    triples: list[tuple[list[int], list[int], list[int]]]  # Z_p triples: one per round, two elements each

    def pack(self) -> tuple[np.ndarray, list[int]]:
        """As (ring vector, field elements) for an `MpcMaterial` message."""
        s = np.array([self.c, *self.scalar], dtype=np.uint64)
        ring = np.concatenate([self.a, self.b, s, self.r_ring])
        fld = [v for bits in self.r_bits for v in bits] + [v for t in self.triples for part in t for v in part]
        return ring, fld

    @classmethod
    def unpack(cls, ring: np.ndarray, fld: list[int], bins: int) -> "Material":
        """The inverse of `pack` (run by an Aggregator on the helper's message)."""
        if ring.size != 2 * bins + 6 or len(fld) != 2 * BITS + BITS * 6:
            raise ValueError("the helper's material does not fit this round")
        a, b, s, r = ring[:bins], ring[bins:2 * bins], ring[2 * bins:2 * bins + 4], ring[2 * bins + 4:]
        bits = [fld[:BITS], fld[BITS:2 * BITS]]
        rest = fld[2 * BITS:]
        triples = [(rest[6 * k:6 * k + 2], rest[6 * k + 2:6 * k + 4], rest[6 * k + 4:6 * k + 6]) for k in range(BITS)]
        return cls(a, b, int(s[0]), (int(s[1]), int(s[2]), int(s[3])), r, bits, triples)


class Helper:
    """The helper (dealer): correlated randomness for one secure AUC, drawn from the OS. Run by the Helper.

    It never receives anything; a third aggregator may play this role.
    """

    def deal(self, n: int, bins: int) -> list[Material]:
        """Each of the `n` aggregators' share of the material for histograms of `bins` buckets."""
        a, b = expand(new_seed(), bins), expand(new_seed(), bins)
        c = np.array([int(np.dot(a, b))], dtype=np.uint64)  # uint64 arithmetic wraps: the product mod 2^64
        sa, sb = expand(new_seed(), 2)
        sc = np.array([(int(sa) * int(sb)) % RING], dtype=np.uint64)
        r = expand(new_seed(), 2)
        bits = [[(int(v) >> i) & 1 for i in range(BITS)] for v in r]
        shares = {
            "a": _ring_shares(a, n), "b": _ring_shares(b, n), "c": _ring_shares(c, n),
            "s": _ring_shares(np.array([sa, sb, sc[0]], dtype=np.uint64), n), "r": _ring_shares(r, n),
            "bits": [_field_shares(element, n) for element in bits],
        }
        triples = []
        for _ in range(BITS):  # 63 comparison rounds and the blinding round, two products each
            x, y = [secrets.randbelow(P) for _ in range(2)], [secrets.randbelow(P) for _ in range(2)]
            z = [(u * v) % P for u, v in zip(x, y)]
            triples.append((_field_shares(x, n), _field_shares(y, n), _field_shares(z, n)))
        return [
            Material(shares["a"][j], shares["b"][j], int(shares["c"][j][0]),
                     tuple(int(v) for v in shares["s"][j]), shares["r"][j],  # type: ignore[arg-type]
                     [shares["bits"][e][j] for e in range(2)],
                     [(t[0][j], t[1][j], t[2][j]) for t in triples])
            for j in range(n)
        ]


class AucParty:
    """Aggregator `index` of `n` in one secure AUC: its shares and its local steps. Run by each Aggregator."""

    def __init__(self, index: int, n: int, negative: np.ndarray, positive: np.ndarray, material: Material):
        self.index, self.n, self.first = index, n, index == 0
        self.neg = np.ascontiguousarray(negative, dtype=np.uint64)
        self.pos = np.ascontiguousarray(positive, dtype=np.uint64)
        self.m = material
        # W_b = 2 (controls below bucket b) + (controls in b): linear, so computed on shares.
        below = np.cumsum(self.neg, dtype=np.uint64) - self.neg
        self.w = below * np.uint64(2) + self.neg
        self.p_sum, self.n_sum = int(self.pos.sum(dtype=np.uint64)), int(self.neg.sum(dtype=np.uint64))
        self.rho = secrets.randbelow(P)  # this aggregator's additive share of the blinding factor r

    # step 1 --------------------------------------------------------------------------

    def open_products(self) -> np.ndarray:
        """Masked inputs of the two Beaver products: pos - a, W - b, P - a', N - b' (mod 2^64)."""
        sa, sb, _ = self.m.scalar
        scal = np.array([(self.p_sum - sa) % RING, (self.n_sum - sb) % RING], dtype=np.uint64)
        return np.concatenate([self.pos - self.m.a, self.w - self.m.b, scal])

    def products(self, opened: np.ndarray) -> None:
        """Shares of num = <pos, W> and den = 2 P N from the opened masked values (mod 2^64)."""
        bins = self.pos.size
        d, e = opened[:bins], opened[bins:2 * bins]
        num = self.m.c + int(np.dot(d, self.m.b)) + int(np.dot(e, self.m.a)) + (int(np.dot(d, e)) if self.first else 0)
        sa, sb, sc = self.m.scalar
        d2, e2 = int(opened[2 * bins]), int(opened[2 * bins + 1])
        pn = sc + d2 * sb + e2 * sa + (d2 * e2 if self.first else 0)
        self.x = [num % RING, (2 * pn) % RING]

    # step 2 --------------------------------------------------------------------------

    def open_masked(self) -> np.ndarray:
        """x + R mod 2^64 for both scalars (uniform)."""
        return np.array([(self.x[k] + int(self.m.r_ring[k])) % RING for k in range(2)], dtype=np.uint64)

    def start_compare(self, c: np.ndarray) -> list[int]:
        """Given the public c, shares of d_i = c_i XOR r_i, and the first product's masked openings."""
        self.c = [int(v) for v in c]
        self.cbits = [[(self.c[k] >> i) & 1 for i in range(BITS)] for k in range(2)]
        one = 1 if self.first else 0
        self.d = [[((1 - 2 * cb) * rb + (cb if self.first else 0)) % P for cb, rb in zip(self.cbits[k], self.m.r_bits[k])]
                  for k in range(2)]
        self.e = [[0] * BITS for _ in range(2)]
        for k in range(2):
            self.e[k][BITS - 1] = self.d[k][BITS - 1]
        self.z = [(one - self.d[k][BITS - 1]) % P for k in range(2)]  # prod_{j >= 63} (1 - d_j)
        self.bit = BITS - 2
        return self._open_mul(self.z, [(one - self.d[k][self.bit]) % P for k in range(2)], 0)

    def _open_mul(self, x: list[int], y: list[int], t: int) -> list[int]:
        a, b, _ = self.m.triples[t]
        self._pending = (x, y, t)
        return [(x[k] - a[k]) % P for k in range(2)] + [(y[k] - b[k]) % P for k in range(2)]

    def _finish_mul(self, opened: list[int]) -> list[int]:
        _, _, t = self._pending
        a, b, c = self.m.triples[t]
        d, e = opened[:2], opened[2:]
        return [(c[k] + d[k] * b[k] + e[k] * a[k] + (d[k] * e[k] if self.first else 0)) % P for k in range(2)]

    def compare_step(self, opened: list[int]) -> list[int]:
        """One round of prefix products; returns the next openings (the blinding product's after the last)."""
        z_new = self._finish_mul(opened)
        for k in range(2):
            self.e[k][self.bit] = (self.z[k] - z_new[k]) % P  # d_i times the prefix of equal bits above i
        self.z = z_new
        self.bit -= 1
        one = 1 if self.first else 0
        if self.bit >= 0:
            return self._open_mul(self.z, [(one - self.d[k][self.bit]) % P for k in range(2)], BITS - 2 - self.bit)
        # The first differing bit from the top decides: c < R iff R has the 1 there, i.e. c has the 0.
        lifted = []
        for k in range(2):
            wrap = sum(self.e[k][i] * (1 - self.cbits[k][i]) for i in range(BITS)) % P
            r_p = sum(rb << i for i, rb in enumerate(self.m.r_bits[k])) % P
            lifted.append(((self.c[k] if self.first else 0) - r_p + RING * wrap) % P)
        return self._open_mul([self.rho, self.rho], lifted, BITS - 1)

    def blinded(self, opened: list[int]) -> list[int]:
        """Shares of (A, D) = (r num, r den) in Z_p, to open."""
        return self._finish_mul(opened)


def auc_from_blinded(a: int, d: int) -> float:
    """The AUC from the opened (r num, r den): num / den by rational reconstruction; NaN if den = 0."""
    if d % P == 0:
        return float("nan")
    t = a * pow(d, -1, P) % P
    # Extended Euclid on (P, t) until the remainder drops below sqrt(P / 2): remainder / coefficient = num / den.
    r0, r1, s0, s1 = P, t, 0, 1
    bound = 1 << 127
    while r1 >= bound:
        q = r0 // r1
        r0, r1, s0, s1 = r1, r0 - q * r1, s1, s0 - q * s1
    if s1 == 0:
        return float("nan")
    return float(Fraction(r1, s1)) if s1 > 0 else float(Fraction(-r1, -s1))
