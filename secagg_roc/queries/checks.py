"""Data checks of a site's arrays for the roles an analysis gives them (run by each Site).

Run when a site loads its data (`secagg-roc site check` prints the result for
the operator, with counts) and once when a run starts, never per round: a site
whose data fail the checks for an analysis does not join its runs, and says
which check failed without any count or value (`detail=False`: that text
reaches the analyst). Per-round queries take no analyst-chosen bound that
could turn a refusal into a probe.
"""

from __future__ import annotations

from typing import Collection, Iterable

import numpy as np

from .registry import SiteData


def _numeric(a: np.ndarray) -> bool:
    return a.dtype.kind in "iufb"


def _all_finite(values: np.ndarray) -> bool:
    """Whether every entry of float64 `values` is finite, without a temporary (a copy and a mask of a wide
    array cost more than the round that follows). A NaN or an infinity makes the sum non-finite, so a finite
    sum settles it in one pass; a non-finite one (or finite values whose sum overflows) is decided by the
    least and greatest values, which are finite iff every entry is (both are NaN if any entry is)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(values, axis=None)):
            return True
    return bool(np.isfinite(np.minimum.reduce(values, axis=None)) and np.isfinite(np.maximum.reduce(values, axis=None)))


def _problem(site: SiteData, role: str, name: str, detail: bool,
             public_names: Collection[str] | None) -> tuple[str | None, int | None]:
    """(what is wrong with array `name` as a `role`, its number of records)."""
    if name not in site.arrays:
        # The names of a site's arrays are its data too: the analyst is told only those it may name anyway.
        shown = sorted(site.arrays) if detail or public_names is None else sorted(set(site.arrays) & set(public_names))
        have = f" (it has: {', '.join(shown) or 'none'})" if detail or shown else ""
        return f"no array named {name!r}{have}", None
    a = np.asarray(site.arrays[name])
    if a.ndim == 0 or not _numeric(a):
        return f"{role} array {name!r} must be numeric with one entry per record", None
    n = int(a.shape[0])
    if role in ("label", "score", "weight") and a.ndim != 1:
        return f"{role} array {name!r} must be one-dimensional", n
    if role == "covariate" and a.ndim > 2:
        return f"covariate array {name!r} must be 1-D or 2-D", n
    values = a if a.dtype == np.float64 else a.astype(np.float64)  # (read only below: no copy of float data)
    if values.size and not _all_finite(values):
        count = f" ({int(np.count_nonzero(~np.isfinite(values)))} entries)" if detail else ""
        return f"{role} array {name!r} contains NaN or infinite values{count}", n
    if role == "label":
        other = (values != 0.0) & (values != 1.0)  # np.isin(values, (0, 1)) negated, without its set-up cost
        if other.any():
            count = f" ({int(other.sum())} records)" if detail else ""
            return f"label array {name!r} holds values other than 0 and 1{count}", n
    if role == "weight" and np.any(values < 0):
        return f"weight array {name!r} must be non-negative", n
    return None, n


def role_problems(site: SiteData, uses: Iterable[tuple[str, str]], *, detail: bool = False,
                  public_names: Collection[str] | None = ()) -> list[str]:
    """What is wrong with `site`'s arrays for the (role, array) pairs of an analysis; [] if nothing.

    With `detail` (for the site's operator) problems carry counts and a missing
    array's message lists every array the site holds; without it (for a refusal
    the analyst sees) they name the array and the check only, and list of the
    site's arrays only those in `public_names` (the arrays the policy's roles
    name; None: every name, as under a policy without roles, where the analyst
    may name any array anyway).
    """
    problems: list[str] = []
    lengths: dict[str, int] = {}
    for role, name in uses:
        problem, n = _problem(site, role, name, detail, public_names)
        if problem is not None:
            problems.append(problem)
        if n is not None:
            lengths[name] = n
    if len(set(lengths.values())) > 1:
        names = ", ".join(sorted(lengths))
        sizes = " (" + ", ".join(f"{k}: {v}" for k, v in sorted(lengths.items())) + ")" if detail else ""
        problems.append(f"arrays {names} of one analysis must have one entry per record; their lengths differ{sizes}")
    return problems


def out_of_range(site: SiteData, name: str, lo: float, hi: float) -> int:
    """How many of the named scores lie outside the public range (they will be clipped to it)."""
    s = np.asarray(site.array(name), dtype=np.float64)
    return int(np.sum((s < lo) | (s > hi)))
