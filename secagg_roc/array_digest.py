"""Content digests of arrays, kept for read-only ones: `array_digest`.

Run by every party that binds a round to derived arrays: the Analyst's and the Sites' copies of a ROC-GLM
plan digest the pooled released samples (the design's reference, the released start's key), and each Site's
GLM query digests its step's derived values (`queries.glm`). Those arrays are made read-only by the plan
that derived them, and each is read by several rounds, so its digest is computed once per party and kept
with the array itself (its id alone could be reused once it is freed; the entry holds it).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

__all__ = ["array_digest"]

#: Read-only arrays digested lately: id -> (array, digest); the latest `_KEPT` only.
_DIGESTS: dict[int, tuple[np.ndarray, bytes]] = {}
_KEPT = 32
_LOCK = threading.Lock()  # sites of one process run in threads


def array_digest(v: np.ndarray) -> bytes:
    """SHA-256 of an array's dtype, shape and bytes; kept for read-only arrays (which cannot change under
    the digest), found again by identity."""
    keep = not v.flags.writeable
    if keep:
        hit = _DIGESTS.get(id(v))
        if hit is not None and hit[0] is v:  # the very same array (held below, so its id is not reused)
            return hit[1]
    a = np.ascontiguousarray(v)
    digest = hashlib.sha256(a.dtype.str.encode() + repr(a.shape).encode() + (a.tobytes() if a.size else b"")).digest()
    if keep:
        with _LOCK:
            _DIGESTS[id(v)] = (v, digest)
            while len(_DIGESTS) > _KEPT:
                del _DIGESTS[next(iter(_DIGESTS))]
    return digest
