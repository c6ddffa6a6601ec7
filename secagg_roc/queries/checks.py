"""Data checks of a site's arrays for the roles an analysis gives them (run by each Site).

Run when a site loads its data (`secagg-roc site check` prints the result for
the operator) and once when a run starts, never per round: a site whose data
fail the checks for an analysis does not join its runs, and per-round queries
take no analyst-chosen bound that could turn a refusal into a probe.
Problems are described by array and kind of fault, with counts at most,
never with a value.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ..errors import SiteQueryError
from .common import labels, matrix, scores
from .registry import SiteData


def _weights(site: SiteData, name: str) -> None:
    w = np.asarray(site.array(name))
    if w.ndim != 1 or w.dtype.kind not in "iuf":
        raise site.fail(f"weight array {name!r} must be a numeric vector")
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise site.fail(f"weight array {name!r} must be finite and non-negative")


def role_problems(site: SiteData, uses: Iterable[tuple[str, str]]) -> list[str]:
    """What is wrong with `site`'s arrays for the (role, array) pairs of an analysis; [] if nothing."""
    problems: list[str] = []
    lengths: dict[str, int] = {}
    for role, name in uses:
        try:
            if role == "label":
                lengths[name] = labels(site, name).size
            elif role == "score":
                lengths[name] = scores(site, name).size
            elif role == "covariate":
                lengths[name] = matrix(site, name, None).shape[0]
            elif role == "weight":
                _weights(site, name)
                lengths[name] = int(np.asarray(site.array(name)).shape[0])
            else:
                problems.append(f"unknown role {role!r} for array {name!r}")
        except SiteQueryError as exc:
            problems.append(str(exc).removeprefix(f"site {site.name!r}: "))
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{n}: {k}" for n, k in sorted(lengths.items()))
        problems.append(f"arrays of one analysis must have one entry per record; lengths differ ({detail})")
    return problems


def out_of_range(site: SiteData, name: str, lo: float, hi: float) -> int:
    """How many of the named scores lie outside the public range (they will be clipped to it)."""
    s = np.asarray(site.array(name), dtype=np.float64)
    return int(np.sum((s < lo) | (s > hi)))
