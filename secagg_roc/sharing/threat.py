"""The threat model of a sharing scheme, as data: who must not collude, what may fail, what a cheat achieves.

Every scheme states one (`SharingScheme.threat_model`); `secagg-roc compare`
prints them side by side, and `tests/test_protocols.py` holds each scheme's
spec in `protocols/` to the same values, so the words and the code agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

#: What happens when a party deviates from the protocol in one way.
Outcome = Literal["detected", "undetected", "blocked", "not possible"]


@dataclass(frozen=True)
class ThreatModel:
    """Machine-readable threat model of one scheme with its parameters."""

    scheme: str
    #: One sentence: who must not collude for a site's input to stay hidden.
    trust: str
    #: Aggregators (or servers) in a round.
    servers: int
    #: The largest coalition of servers that learns nothing about any site's input (0: one server sees inputs).
    max_colluding_servers: int
    #: Servers that may be down, or drop out mid-round, with the total still exact.
    server_dropouts: int
    #: Sites that may drop out after they began a round, with the survivors' total still exact.
    site_dropouts: str
    #: What each kind of deviation by a malicious party achieves.
    malicious: dict[str, Outcome] = field(default_factory=dict)
    #: Round trips a site makes per secure sum.
    site_round_trips: int = 1
    #: Ring- or field-element vectors of the input's length that one site uploads per secure sum.
    upload_vectors_per_site: float = 1.0
    #: The largest coalition that learns nothing about a site's input, in a few words.
    coalition: str = ""
    #: Free-form notes (ranges, statistical distances, what the analyst sees).
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """A JSON- and TOML-ready dict."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d
