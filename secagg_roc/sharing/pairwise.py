"""Pairwise masking with one server (Bonawitz et al. 2017; SecAgg+), as a sharing scheme.

The scheme is interactive: before a site can mask its input, the sites of the
round agree pairwise keys and Shamir-share their self-mask seeds and mask keys
among their neighbours, all relayed by the server (`secagg_roc.pairwise`,
driven round by round by `pairwise.rounds.PairwiseRounds`). A Site's share is
then its encoded output plus masks that cancel in the sum (`session.mask`);
the server adds the masked vectors of the survivors and removes what is left
of the masks from the seeds and keys the survivors reveal. Its one aggregate
is the total itself, so the analyst combines a single vector.

Per-site (DP) releases are not summed, so masks cannot cancel: they pass the
server unmasked. The server thus sees each site's DP release, the same values
the analyst receives -- stated in the threat model.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Mapping

import numpy as np

from ..errors import RoundError, WeakThresholdWarning
from ..ring import FixedPoint, RawFloat
from .base import Payload, SharingScheme
from .threat import ThreatModel


def _outside_the_package() -> int:
    """The stack level of the first caller outside secagg_roc (a warning points at the user's line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def warn_weak_threshold(threshold: int | None, n_sites: int, setting: str = "threshold") -> None:
    """Warn (`WeakThresholdWarning`) when an explicit threshold is at most half of `n_sites`. A lying server
    needs t answers revealing a site's self-mask seed and t others revealing its mask key; the site itself
    gives one and each of c colluding sites both, so it succeeds when 2t <= K + c: at t <= K/2 with no
    colluding site at all. Run where a study is set up (the deployed study file, `LocalFederation`)."""
    if threshold is not None and 2 * int(threshold) <= n_sites:
        warnings.warn(
            f"{setting} = {threshold} is at most half of the {n_sites} sites: the server alone (no site colluding) "
            "can unmask a site's input by sending two survivor sets (see PairwiseSharing.threat_model); the safe "
            f"minimum is {n_sites // 2 + 1}, a majority (the default when no threshold is set), and t > (K + c) / 2 "
            "against a server colluding with c sites", WeakThresholdWarning, stacklevel=_outside_the_package())


class PairwiseSharing(SharingScheme):
    name = "pairwise"
    private = True

    def __init__(self, n_aggregators: int = 1, threshold: int | None = None):
        super().__init__(n_aggregators)
        #: Shamir threshold among each site's neighbourhood (None: a majority of the round's sites).
        self.site_threshold = None if threshold is None else int(threshold)
        if self.site_threshold is not None and self.site_threshold < 2:
            raise ValueError(f"a pairwise-masking threshold must be at least 2 sites, got {threshold}")

    @classmethod
    def check_n(cls, n_aggregators: int) -> int:
        if int(n_aggregators) != 1:
            raise ValueError("pairwise masking runs with one server (n_aggregators=1)")
        return 1

    def threshold_for(self, k: int) -> int:
        """The threshold a round of `k` sites uses: the one given, or a majority (so a server that lies about
        dropouts cannot gather both masks of a site from the honest ones)."""
        t = self.site_threshold if self.site_threshold is not None else k // 2 + 1
        return max(2, t)

    @property
    def threat_model(self) -> ThreatModel:
        t = "t" if self.site_threshold is None else str(self.site_threshold)
        return ThreatModel(
            scheme=self.name, servers=1, max_colluding_servers=1, server_dropouts=0,
            trust=(f"a server that follows the protocol, even with up to {t}-1 colluding sites, learns only the "
                   f"survivors' total; one that lies about dropouts while c sites collude with it, only while "
                   f"{t} > (K + c) / 2 (see the notes)"),
            site_dropouts=f"any, at any phase, while every live site keeps {t} live sites in its neighbourhood",
            malicious={"aggregator alters its aggregate share": "undetected",
                       "aggregator withholds its aggregate share": "blocked",
                       # A site answers one unmask request per round, so two disjoint sets of sites would each
                       # have to reach t: impossible at a majority threshold unless sites collude with the server.
                       "server claims a surviving site dropped": "blocked" if self.site_threshold is None
                       else "undetected",
                       "site sends a malformed share": "blocked"},
            site_round_trips=4, upload_vectors_per_site=1.0, coalition=f"the server + {t}-1 sites",
            notes=("default threshold t: a majority of the round's sites",
                   "a site never reveals both the self-mask seed and the mask key of one site in one request, and "
                   "answers one request per round, so a server sending different requests to different sites needs "
                   "two groups of t answers: blocked at the default majority threshold; with c sites colluding "
                   "it needs t > (K + c) / 2, and an explicit threshold of at most half the sites gives no "
                   "protection (Bonawitz et al.'s signed consistency round is not implemented)",
                   "per-site (DP) releases pass the server unmasked: it sees the same DP values as the analyst",
                   "sites stay outbound-only: the server relays keys and AES-GCM-encrypted shares"),
        )

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """No seeds: a masked input's randomness is the round's key agreement, which a deployed Site logs
        itself (`deploy.site_pairwise`) before anything derived from it leaves."""
        return {}

    def share(self, x: np.ndarray, codec: FixedPoint | RawFloat, *, holder: int = 0, out: np.ndarray | None = None,
              seeds: Mapping[int, bytes] | None = None, session: Any = None) -> list[Payload]:
        """Run by a Site: its encoded output masked by this round's `session` (a `PairwiseClient`)."""
        if seeds:
            raise ValueError("pairwise masks come from the round's key agreement, not from given seeds")
        encoded = codec.encode(x, out=out).reshape(-1)
        if isinstance(codec, RawFloat):
            return [Payload(vector=np.array(encoded, dtype=np.uint64))]  # a per-site release: never summed
        if session is None:
            raise RoundError("a pairwise-masked share needs this round's key agreement: the site took no part in "
                             "it, or already answered the round (its masks are used once)")
        return [Payload(vector=session.mask(encoded, in_place=True).y)]  # encoded is this share's own buffer

    def split(self, encoded: np.ndarray, *, holder: int = 0) -> list[Payload]:
        raise ValueError("pairwise masking is interactive: use share() with the round's session")

    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by the server: masked vectors add mod 2^64 (the masks cancel only over the survivors)."""
        np.add(acc, payload.vector, out=acc)

    def materialize(self, out: np.ndarray, payload: Payload) -> None:
        np.copyto(out, payload.vector)
