"""Sharing schemes behind one interface; `make_scheme` picks one by name."""

from typing import Any

from .additive import AdditiveSharing
from .base import Payload, SharingScheme
from .pairwise import PairwiseSharing
from .plaintext import PlaintextSharing
from .replicated import ReplicatedSharing
from .shamir import ShamirSharing
from .threat import ThreatModel

SCHEMES: dict[str, type[SharingScheme]] = {
    AdditiveSharing.name: AdditiveSharing,
    PlaintextSharing.name: PlaintextSharing,
    ShamirSharing.name: ShamirSharing,
    ReplicatedSharing.name: ReplicatedSharing,
    PairwiseSharing.name: PairwiseSharing,
}

#: How many aggregators each scheme runs with when none is given.
DEFAULT_AGGREGATORS = {"additive": 2, "plaintext": 1, "shamir": 3, "replicated": 3, "pairwise": 1}


def make_scheme(name: str, n_aggregators: int | None = None, *, threshold: int | None = None) -> SharingScheme:
    """The scheme called `name` for `n_aggregators` aggregators (`threshold`: Shamir's t)."""
    try:
        cls: Any = SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown sharing scheme {name!r}; known: {', '.join(SCHEMES)}") from None
    n = DEFAULT_AGGREGATORS[name] if n_aggregators is None else n_aggregators
    if threshold is not None:
        if cls not in (ShamirSharing, PairwiseSharing):
            raise ValueError(f"the {name} scheme takes no threshold (only 'shamir' and 'pairwise' do)")
        return cls(n, threshold)
    return cls(n)


__all__ = ["AdditiveSharing", "DEFAULT_AGGREGATORS", "PairwiseSharing", "Payload", "PlaintextSharing", "ReplicatedSharing", "SCHEMES",
           "ShamirSharing", "SharingScheme", "ThreatModel", "make_scheme"]
