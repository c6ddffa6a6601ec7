"""Test helper shared by the embedded and deployed plan tests: which queries a study asks for, in order."""

from __future__ import annotations

from typing import Any


def recording(study: Any) -> list[str]:
    """The query of every round `study` asks for from now on, in order (wrapping its round methods)."""
    sent: list[str] = []
    for method in ("aggregate", "release_dp", "release_mpc"):
        inner = getattr(study, method, None)
        if inner is None:  # a deployed study has no joint-computation rounds
            continue

        def record(query, params=None, _inner=inner, **kw):
            sent.append(query)
            return _inner(query, params, **kw)

        setattr(study, method, record)
    return sent
