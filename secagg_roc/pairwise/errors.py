"""Errors of the pairwise-masking engine (all `SecAggError`s, so services map them as usual)."""

from __future__ import annotations

from ..errors import MessageError, RoundError


class TooFewSurvivors(RoundError):
    """Fewer than `threshold` sites survived a phase (in the whole round or in one neighbourhood).

    The round cannot finish without revealing less than its threshold promises,
    so it stops here; `phase`, `survived` and `threshold` say where and why.
    """

    def __init__(self, phase: str, survived: int, threshold: int, where: str = "the round"):
        super().__init__(
            f"{phase}: only {survived} site(s) survived in {where}, below the threshold {threshold}; "
            "the round cannot be completed (retry with more sites or a lower threshold)"
        )
        self.phase = phase
        self.survived = survived
        self.threshold = threshold


class ShareAuthenticationError(MessageError):
    """An encrypted share failed AES-GCM authentication: tampered, misrouted or for another round."""


__all__ = ["MessageError", "RoundError", "ShareAuthenticationError", "TooFewSurvivors"]
