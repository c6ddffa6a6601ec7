"""Sharing schemes behind one interface; `make_scheme` picks one by name."""

from .additive import AdditiveSharing
from .base import Payload, SharingScheme
from .plaintext import PlaintextSharing

SCHEMES: dict[str, type[SharingScheme]] = {
    AdditiveSharing.name: AdditiveSharing,
    PlaintextSharing.name: PlaintextSharing,
}


def make_scheme(name: str, n_aggregators: int) -> SharingScheme:
    """The scheme called `name` for `n_aggregators` aggregators."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown sharing scheme {name!r}; known: {', '.join(SCHEMES)}") from None
    return cls(n_aggregators)


__all__ = ["AdditiveSharing", "Payload", "PlaintextSharing", "SCHEMES", "SharingScheme", "make_scheme"]
