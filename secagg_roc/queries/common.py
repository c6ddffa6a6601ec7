"""Validation shared by the statistics site queries (run by each Site).

Every check raises `SiteQueryError` through ``site.fail`` so the message names
the site and the problem; nothing here returns or logs record values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import SiteQueryError
from .registry import SiteData


def param(site: SiteData, params: dict[str, Any], key: str, kind: type | tuple[type, ...] = str) -> Any:
    """A required query parameter of the given type."""
    if key not in params:
        raise site.fail(f"query parameter {key!r} is missing")
    value = params[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise site.fail(f"query parameter {key!r} has type {type(value).__name__}")
    return value


def labels(site: SiteData, name: str) -> np.ndarray:
    """The named 0/1 label vector as int64; refuses other values, NaN and non-vectors."""
    raw = np.asarray(site.array(name))
    if raw.ndim != 1:
        raise site.fail(f"label array {name!r} must be one-dimensional, got shape {raw.shape}")
    if raw.dtype.kind == "b":
        return raw.astype(np.int64)
    if raw.dtype.kind not in "iuf":
        raise site.fail(f"label array {name!r} must be numeric 0/1, got dtype {raw.dtype}")
    if raw.dtype.kind == "f" and not np.isfinite(raw).all():
        raise site.fail(f"label array {name!r} contains NaN or infinite values")
    # The same test as np.isin(raw, (0, 1)), at a tenth of its cost: every query of a run checks its labels.
    if ((raw != 0) & (raw != 1)).any():
        # Neither values nor a count: this text may leave the site (the operator's `site check` counts).
        raise site.fail(f"label array {name!r} holds values other than 0 and 1")
    return raw.astype(np.int64)


def scores(site: SiteData, name: str, *, n: int | None = None) -> np.ndarray:
    """The named score vector as float64: finite and of length `n` (checked when a run starts)."""
    raw = np.asarray(site.array(name))
    if raw.ndim != 1:
        raise site.fail(f"score array {name!r} must be one-dimensional, got shape {raw.shape}")
    if raw.dtype.kind not in "iufb":
        raise site.fail(f"score array {name!r} must be numeric, got dtype {raw.dtype}")
    s = raw.astype(np.float64)
    if not np.isfinite(s).all():
        raise site.fail(f"score array {name!r} contains NaN or infinite values")
    if n is not None and s.size != n:
        raise site.fail(f"score array {name!r} has a different length than the labels")
    return s


def weights(site: SiteData, name: str | None, n: int) -> np.ndarray:
    """The named prior-weight vector (finite, non-negative, length `n`) as float64; ones when `name` is None."""
    if name is None:
        return np.ones(n)
    if not isinstance(name, str):
        raise site.fail("query parameter 'weights' must be an array name")
    w = np.asarray(site.array(name))
    if w.ndim != 1 or w.dtype.kind not in "iuf":
        raise site.fail(f"weight array {name!r} must be a numeric vector")
    w = w.astype(np.float64)
    if w.size != n:
        raise site.fail(f"weight array {name!r} has a different length than the labels")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise site.fail(f"weight array {name!r} must be finite and non-negative")
    return w


def score_range(site: SiteData, params: dict[str, Any]) -> tuple[float, float]:
    """The public score range ``params["score_range"]`` (the policy's, as the plan passes it)."""
    value = param(site, params, "score_range", list)
    if len(value) != 2:
        raise site.fail("score_range must be [lower, upper]")
    lo, hi = float(value[0]), float(value[1])
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise site.fail(f"score_range must be two finite numbers, lower < upper; got {[lo, hi]}")
    return lo, hi


def clipped_scores(site: SiteData, params: dict[str, Any], n: int | None = None) -> np.ndarray:
    """The scores named by ``params["score"]``, clipped to the public score range.

    Values outside the declared range are clipped, as DP practice does, never
    refused: a refusal would tell the analyst something about the data.
    """
    lo, hi = score_range(site, params)
    return scores(site, param(site, params, "score"), n=n).clip(lo, hi)  # (what `np.clip` calls)


def labels_scores(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The (labels, clipped scores) pair named by ``params["label"]`` and ``params["score"]``."""
    y = labels(site, param(site, params, "label"))
    return y, clipped_scores(site, params, n=y.size)


def reference(site: SiteData, key: str) -> np.ndarray:
    """A reference sample the step derived (the pooled released scores), sorted, as survivor() expects."""
    ref = np.asarray(site.public_value(key), dtype=float).ravel()
    if ref.size == 0 or not np.isfinite(ref).all():
        raise site.fail(f"derived value {key!r} must be a non-empty finite sample")
    ref = ref.copy()  # sorted in place, as `np.sort` does on its copy
    ref.sort()
    return ref


def matrix(site: SiteData, names: Any, n: int | None) -> np.ndarray:
    """Columns from one or more named arrays (1-D or 2-D), as a float (records x columns) matrix."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(v, str) for v in names):
        raise site.fail("covariates must be an array name or a list of array names")
    cols = []
    for name in names:
        a = np.asarray(site.array(name))
        if a.dtype.kind not in "iufb":
            raise site.fail(f"covariate array {name!r} must be numeric, got dtype {a.dtype}")
        a = a.astype(np.float64)
        if a.ndim == 1:
            a = a[:, None]
        if a.ndim != 2:
            raise site.fail(f"covariate array {name!r} must be 1-D or 2-D, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise site.fail(f"covariate array {name!r} contains NaN or infinite values")
        cols.append(a)
    if not cols:
        return np.zeros((0 if n is None else n, 0))
    rows = {c.shape[0] for c in cols}
    if len(rows) != 1 or (n is not None and rows != {n}):
        raise site.fail(f"covariate arrays {', '.join(names)} have mismatched lengths")
    return np.hstack(cols)


__all__ = ["SiteQueryError", "param", "labels", "scores", "score_range", "clipped_scores", "labels_scores", "reference",
           "matrix"]
