"""Seed expansion: a short secret seed -> a pseudorandom vector in Z_2^64.

The seed is an AES-128 key; the stream is AES-CTR from a zero counter over a
zero plaintext (the keystream itself). Each seed is drawn fresh from the
operating system for exactly one share vector, so a fixed nonce never repeats
under a key. Streams are produced in cache-sized chunks and added into (or
subtracted from) the target in place, so expanding a seed costs one pass over
the target and no full-size temporary.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SEED_BYTES = 16
_NONCE = bytes(16)
#: The counter mode over `_NONCE`, made once: it holds only the nonce, which no cipher changes, and making
#: it (with its checks) was half the cost of setting up a seed's cipher (~8 -> ~4 us; a simulated task sets
#: up ~14).
_CTR = modes.CTR(_NONCE)
_CHUNK = 1 << 15  # uint64 elements per AES call: 256 KiB, fits in L2
_ZEROS = memoryview(bytes(8 * _CHUNK))  # a view: slicing it copies nothing
_EMPTY = np.empty(0, dtype=np.uint64)


def new_seed() -> bytes:
    """A fresh seed from the operating system's CSPRNG."""
    return secrets.token_bytes(SEED_BYTES)


class Keystream:
    """The ring-element stream of one seed, consumed in order by `apply`."""

    def __init__(self, seed: bytes):
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
            raise ValueError(f"a seed is {SEED_BYTES} bytes")
        self._cipher = Cipher(algorithms.AES(bytes(seed)), _CTR).encryptor()
        # The block buffer is sized by the first `apply`: a short vector needs no 256 KiB of it.
        self._buf = _EMPTY
        self._bytes = memoryview(_EMPTY).cast("B")

    def write(self, target: np.ndarray) -> None:
        """target = the next `target.size` stream elements (contiguous uint64), in place."""
        view = memoryview(target).cast("B")
        for start in range(0, view.nbytes, 8 * _CHUNK):
            stop = min(start + 8 * _CHUNK, view.nbytes)
            self._cipher.update_into(_ZEROS[: stop - start], view[start:stop])

    def apply(self, target: np.ndarray, *, subtract: bool = False) -> None:
        """target += (or -=) the next `target.size` stream elements, mod 2^64, in place."""
        op = np.subtract if subtract else np.add
        if self._buf.size < min(target.size, _CHUNK):
            self._buf = np.empty(min(target.size, _CHUNK), dtype=np.uint64)
            self._bytes = memoryview(self._buf).cast("B")
        for start in range(0, target.size, _CHUNK):
            part = target[start : start + _CHUNK]
            block = self._buf[: part.size]
            self._cipher.update_into(_ZEROS[: 8 * part.size], self._bytes[: 8 * part.size])
            op(part, block, out=part)


@dataclass(frozen=True, eq=False)
class Expansion:
    """A seed's stream, whole, as its site wrote it while masking with it.

    Handed over with the seed only inside one process (an embedded federation), so that the seed's
    aggregator adds the stream instead of expanding the seed a second time. It is what that aggregator
    would compute from the seed, so it tells it nothing more; it never goes on the wire."""

    seed: bytes
    stream: np.ndarray


def expand(seed: bytes, n: int) -> np.ndarray:
    """The first `n` ring elements of the stream of `seed` (uint64)."""
    out = np.empty(n, dtype=np.uint64)
    Keystream(seed).write(out)
    return out


def add_stream(seed: bytes, target: np.ndarray, *, subtract: bool = False) -> None:
    """target += stream(seed) (or -=), mod 2^64, in place; `target` is a C-contiguous uint64 array."""
    if target.dtype != np.uint64 or not target.flags.c_contiguous:
        raise ValueError("target must be a C-contiguous uint64 array")
    Keystream(seed).apply(target.reshape(-1), subtract=subtract)
