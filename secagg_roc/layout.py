"""Named arrays <-> one flat vector (and back): the layout a round's shares carry.

Used by each Site (flatten before encoding) and by whoever combines a release
(the analyst, and the sites themselves: unflatten after decoding).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from .errors import SiteQueryError
from .messages import Layout, check_name
from .wire import remember_size


#: The layouts made lately, each its own key: a query's outputs give a handful.
_LAYOUTS: dict[Layout, Layout] = {}
_LAYOUTS_KEPT = 256


def flatten(values: Mapping[str, np.ndarray], kinds: Mapping[str, str] | None = None) -> tuple[Layout, np.ndarray]:
    """Named arrays -> (layout, one flat vector).

    With `kinds` (a query's declared outputs) the layout follows the
    declaration, never the data; without it (a caller's own vectors in
    `LocalFederation.secure_sum`) integer arrays stay integer when all are.
    """
    names = sorted(values)
    arrays = [np.asarray(values[n]) for n in names]
    integer = []
    for n, a in zip(names, arrays):
        if kinds is None or n not in kinds:  # a query's declared outputs were checked when it was registered
            check_name(n, "output name")
        kind = a.dtype.kind
        if kind not in "iubf":
            raise SiteQueryError(f"output {n!r} has dtype {a.dtype}; outputs are numbers")
        integer.append(kind in "iub" if kinds is None else kinds[n] == "int")
    layout = tuple(zip(names, [a.shape for a in arrays], integer))
    # One object per layout in this process: every round of a query and every site give the same one, so the
    # aggregators' checks of it (`round._plain_layout`) find it by identity after the first.
    known = _LAYOUTS.get(layout)
    if known is None:
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        _LAYOUTS[layout] = layout
        remember_size(layout)  # (its size, found by identity at every check of a share's length)
    else:
        layout = known
    dtype = np.int64 if all(integer) else np.float64
    if len(arrays) == 1 and arrays[0].dtype == dtype and arrays[0].flags.c_contiguous:
        return layout, arrays[0].reshape(-1)  # the common large case: no copy
    # One cast into the joined vector (astype's own, "unsafe"), not one per array first.
    return layout, np.concatenate([a.ravel() for a in arrays], dtype=dtype, casting="unsafe")


def unflatten(layout: Layout, vector: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of `flatten` for decoded totals; integer entries come back as int64."""
    out: dict[str, np.ndarray] = {}
    pos = 0
    for name, shape, integer in layout:
        n = math.prod(shape)
        part = vector[pos : pos + n].reshape(shape)
        if integer and part.dtype.kind == "f":
            part = np.rint(part).astype(np.int64)
        out[name] = part
        pos += n
    return out
