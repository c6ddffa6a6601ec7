"""Run by each Site: a round's release, combined from the aggregators' shares once per process.

Every site combines the release it receives itself (so that the analyst
cannot feed it a forged one) and checks, in doing so, that the shares
belong together (`analyst.combine`). Embedded (`LocalFederation`), the K
sites of one process are handed the very same share objects: combining
them K times gives K equal releases. Here the last release combined is
kept with the share objects it came from and given to a site handed the
same objects (by identity, element by element: the messages are frozen,
and their vectors are not written to after the aggregators release them).
Shares that are not the same objects are combined afresh; a combination
that fails is never kept (each site's refusal is its own). The release's
arrays are made read-only, as it is handed to several sites' plan copies.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .analyst import Totals, combine, combine_forwarded
from .messages import ForwardedShares
from .sharing import SharingScheme

#: (scheme, the shares, the release) of the last combination.
_LAST: tuple[Any, tuple, Any] | None = None
_LOCK = threading.Lock()  # a deployed site agent receives releases in its worker threads too


def _read_only(release: Any) -> Any:
    arrays = release.values() if isinstance(release, Totals) else (a for site in release.values() for a in site.values())
    for a in arrays:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return release


def combined(shares: list, scheme: SharingScheme) -> Any:
    """The release of `shares` (an aggregate or a per-site one): `Totals`, or site -> name -> array.

    Raises what `analyst.combine` / `combine_forwarded` raise for shares that do not belong together."""
    global _LAST
    last = _LAST
    if last is not None and last[0] is scheme and len(last[1]) == len(shares) and all(
            a is b for a, b in zip(last[1], shares)):
        return last[2]
    if isinstance(shares[0], ForwardedShares):
        release = combine_forwarded(shares, scheme)
    else:
        release = combine(shares, scheme)
    with _LOCK:
        _LAST = (scheme, tuple(shares), _read_only(release))
    return release
