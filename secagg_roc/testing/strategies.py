"""Hypothesis strategies for sharing-scheme tests: ring vectors, sites' inputs, and every shipped scheme."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ..sharing import SharingScheme, make_scheme


def ring_vectors(size: int | st.SearchStrategy[int] = st.integers(1, 64)) -> st.SearchStrategy[np.ndarray]:
    """uint64 vectors (ring elements of Z_2^64), edge values included."""
    return hnp.arrays(np.uint64, size, elements=st.integers(0, 2**64 - 1))


@st.composite
def site_inputs(draw: Any, sites: st.SearchStrategy[int] = st.integers(1, 6),
                size: st.SearchStrategy[int] = st.integers(1, 40)) -> list[np.ndarray]:
    """One ring vector per site, all of one length."""
    k, d = draw(sites), draw(size)
    return [draw(ring_vectors(d)) for _ in range(k)]


@st.composite
def scheme_configs(draw: Any, private_only: bool = False) -> dict[str, Any]:
    """Keyword arguments of `make_scheme` covering every shipped scheme and its parameters."""
    names = ["additive", "shamir", "replicated"] + ([] if private_only else ["plaintext"])
    name = draw(st.sampled_from(names))
    if name == "additive":
        return {"name": name, "n_aggregators": draw(st.integers(2, 5))}
    if name == "shamir":
        n = draw(st.integers(2, 7))
        return {"name": name, "n_aggregators": n, "threshold": draw(st.integers(2, n))}
    return {"name": name}


def schemes(private_only: bool = False) -> st.SearchStrategy[SharingScheme]:
    """Every shipped scheme, with drawn parameters."""
    return scheme_configs(private_only).map(lambda kw: make_scheme(kw.pop("name"), **kw))
