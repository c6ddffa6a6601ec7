"""The plaintext trusted-host baseline (NOT PRIVATE).

Each site sends its encoded sums in the clear to a single trusted host, as a
DataSHIELD server-side aggregate does. It exists so that researchers can run an
identical analysis under a weaker threat model and compare; the host sees every
site's input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .base import Payload, SharingScheme
from .threat import ThreatModel

if TYPE_CHECKING:
    from ..ring import FixedPoint


class PlaintextSharing(SharingScheme):
    name = "plaintext"
    private = False

    @property
    def threat_model(self) -> ThreatModel:
        return ThreatModel(
            scheme=self.name, servers=1, max_colluding_servers=0, server_dropouts=0,
            trust="NOT PRIVATE: the trusted host sees every site's input in the clear",
            site_dropouts="before its input arrives", coalition="none: the host sees every input",
            malicious={"aggregator alters its aggregate share": "undetected",
                       "aggregator withholds its aggregate share": "blocked",
                       "site sends a malformed share": "blocked"},
        )

    @classmethod
    def check_n(cls, n_aggregators: int) -> int:
        if int(n_aggregators) != 1:
            raise ValueError("the plaintext baseline has exactly one trusted host (n_aggregators=1)")
        return 1

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """No randomness: the input goes in the clear."""
        return {}

    def share(self, x: np.ndarray, codec: FixedPoint, *, holder: int = 0, out: np.ndarray | None = None,
              seeds: Mapping[int, bytes] | None = None, session: Any = None) -> list[Payload]:
        """Run by a Site: the encoded input itself (`seeds`, if given, must be empty: there is no randomness)."""
        if seeds:
            raise ValueError("the plaintext baseline has no randomness to re-create from seeds")
        return self.split(codec.encode(x, out=out), holder=holder)

    def split(self, encoded: np.ndarray, *, holder: int = 0) -> list[Payload]:
        """Run by a Site: the whole input goes to the host."""
        return [Payload(vector=np.ascontiguousarray(encoded, dtype=np.uint64))]

    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by the trusted host."""
        if payload.vector is None:
            raise ValueError("the plaintext baseline carries vectors, not seeds")
        np.add(acc, payload.vector, out=acc)
