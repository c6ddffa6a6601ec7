"""Which sharing schemes the aggregators' joint computation on kept sums (the secure AUC) runs under."""

from __future__ import annotations

from ..errors import RoundError
from ..sharing import SharingScheme

#: Schemes whose aggregators' kept sums are additive shares in Z_2^64 (replicated: each aggregator's own
#: component), the form the joint secure-AUC computation takes.
JOINT_SCHEMES = ("additive", "replicated", "plaintext")


def check_joint_scheme(scheme: SharingScheme) -> None:
    """Refuse a joint computation on kept sums under a scheme whose shares it cannot take."""
    if scheme.name not in JOINT_SCHEMES:
        raise RoundError(f"the aggregators' joint computation (secure_auc) runs under {' or '.join(JOINT_SCHEMES)} "
                         f"sharing; this study uses {scheme.name!r}")




#: The declared analyses whose release is a joint computation on kept sums (checked before their join).
JOINT_ANALYSES = ("secure_auc",)
