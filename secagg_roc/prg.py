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

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SEED_BYTES = 16
_NONCE = bytes(16)
_CHUNK = 1 << 15  # uint64 elements per AES call: 256 KiB, fits in L2
_ZEROS = bytes(8 * _CHUNK)


def new_seed() -> bytes:
    """A fresh seed from the operating system's CSPRNG."""
    return secrets.token_bytes(SEED_BYTES)


def _keystream(seed: bytes):
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        raise ValueError(f"a seed is {SEED_BYTES} bytes")
    return Cipher(algorithms.AES(bytes(seed)), modes.CTR(_NONCE)).encryptor()


def expand(seed: bytes, n: int) -> np.ndarray:
    """The first `n` ring elements of the stream of `seed` (uint64)."""
    out = np.empty(n, dtype=np.uint64)
    stream = _keystream(seed)
    view = memoryview(out).cast("B")
    for start in range(0, 8 * n, 8 * _CHUNK):
        stop = min(start + 8 * _CHUNK, 8 * n)
        stream.update_into(_ZEROS[: stop - start], view[start:stop])
    return out


def add_stream(seed: bytes, target: np.ndarray, *, subtract: bool = False) -> None:
    """target += stream(seed) (or -=), mod 2^64, in place; `target` is a C-contiguous uint64 array."""
    if target.dtype != np.uint64 or not target.flags.c_contiguous:
        raise ValueError("target must be a C-contiguous uint64 array")
    flat = target.reshape(-1)
    n = flat.size
    stream = _keystream(seed)
    buf = np.empty(min(_CHUNK, max(n, 1)), dtype=np.uint64)
    buf_bytes = memoryview(buf).cast("B")
    op = np.subtract if subtract else np.add
    for start in range(0, n, _CHUNK):
        part = flat[start : start + _CHUNK]
        block = buf[: part.size]
        stream.update_into(_ZEROS[: 8 * part.size], buf_bytes[: 8 * part.size])
        op(part, block, out=part)
