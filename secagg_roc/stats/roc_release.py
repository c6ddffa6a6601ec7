"""The release every pROC-style analysis starts from: secure class counts, then each site's scores per class.

These are the ROC-GLM's first rounds (`stats.rocglm`), with the same site
queries (``rocglm.counts``, ``rocglm.scores``) and the same public
parameters: a score array released for one analysis is therefore replayed
from each site's ledger for another (same values, never re-noised, charged
once). Each score array is one release, one Gaussian mechanism: a test of
two scores releases two and is charged for both.

Privacy comes from the study's policy exactly as for the ROC-GLM:
``epsilon="auto"`` takes the policy's per-release parameters, the analyst
may ask for more noise, never less, and ``epsilon=None`` is the non-private
validation mode (exact scores), which the policy and every site's operator
must allow. Scores are clipped to the policy's score range at the sites.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Any, Generator, Mapping, Sequence

import numpy as np

from ..errors import PolicyError
from ..plans import PlanContext, Step, pooled_samples
from ..policy import Policy
from ..queries.roc_compare import NEGATIVES, POSITIVES
from .results import NON_PRIVATE_NOTE, NonPrivateWarning

#: The DP parameters a release carries (`policy.DPRequest.params`).
PRIVACY_KEYS = ("epsilon", "delta", "l2_sensitivity", "mechanism", "sigma")
#: The site queries of `release_rounds`: the secure class counts, then the per-site score release.
COUNTS, SCORES = "rocglm.counts", "rocglm.scores"
RELEASE_QUERIES = frozenset({COUNTS, SCORES})


def array_name(args: Mapping[str, Any], key: str) -> str:
    """The array named by argument `key` (a non-empty string)."""
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be an array name, got {value!r}")
    return value


def check_score_range(policy: Policy, args: Mapping[str, Any]) -> None:
    """The score range is the policy's: an analyst may state it, not change it."""
    lo_hi = args.get("score_range")
    if lo_hi is not None and [float(v) for v in lo_hi] != list(policy.score_range):
        raise PolicyError(
            f"policy: the score range is fixed by the study at {list(policy.score_range)}; scores outside it "
            "are clipped"
        )


def declare_privacy(policy: Policy, args: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical privacy arguments of a score release, checked against the policy (Analyst and Sites).

    ``{"mode": "non-private"}`` or ``{"mode": "dp", epsilon, delta,
    l2_sensitivity, mechanism, sigma}``. Canonical arguments (with "mode")
    are declared again by every site, which recomputes sigma itself.
    """
    mode = args.get("mode")
    if mode not in (None, "dp", "non-private"):
        raise ValueError(f"mode must be 'dp' or 'non-private', got {mode!r}")
    epsilon = args.get("epsilon", "auto") if mode is None else (None if mode == "non-private" else args.get("epsilon"))
    if epsilon is None:
        if any(args.get(k) is not None for k in ("delta", "l2_sensitivity")):
            raise ValueError("epsilon=None selects the non-private validation mode; do not pass delta or l2_sensitivity")
        policy.check_non_private()
        return {"mode": "non-private"}
    if mode != "dp":
        if epsilon == "auto":
            if args.get("delta") is not None:
                raise ValueError("epsilon='auto' takes (epsilon, delta) from the policy; pass both or neither")
            epsilon = None
        elif isinstance(epsilon, str):
            raise ValueError(f"epsilon must be a number, 'auto' or None, got {epsilon!r}")
        elif args.get("delta") is None:
            raise ValueError("delta is required with a numeric epsilon")
    l2 = args.get("l2_sensitivity")
    request = policy.check_dp(epsilon, args.get("delta"), None if l2 is None else float(l2), args.get("mechanism"))
    return {"mode": "dp", **request.params()}


def privacy_args(epsilon: Any, delta: Any, l2_sensitivity: Any, mechanism: Any,
                 score_range: Sequence[float] | None) -> dict[str, Any]:
    """The analyst's privacy keywords as declared arguments."""
    return {"epsilon": epsilon, "delta": delta, "mechanism": mechanism,
            "l2_sensitivity": None if l2_sensitivity is None else float(l2_sensitivity),
            "score_range": None if score_range is None else [float(v) for v in score_range]}


@dataclass(frozen=True)
class Released:
    """What the analyst and every site pooled from the release: class sizes and each score's samples."""

    n_negative: int
    n_positive: int
    negatives: dict[str, np.ndarray]
    positives: dict[str, np.ndarray]

    def context(self, scores: Sequence[str]) -> dict[str, np.ndarray]:
        """The pooled samples as a step's derived values: ``roc.negatives.<k>`` for the k-th score, and so on."""
        out = {}
        for k, score in enumerate(scores):
            out[f"{NEGATIVES}.{k}"] = self.negatives[score]
            out[f"{POSITIVES}.{k}"] = self.positives[score]
        return out

    def digest(self, scores: Sequence[str]) -> str:
        """SHA-256 of the pooled samples: a round's parameters bind the values the sites' queries read."""
        h = hashlib.sha256()
        for score in scores:
            for a in (self.negatives[score], self.positives[score]):
                h.update(np.ascontiguousarray(a, dtype=np.float64).tobytes())
                h.update(b"|")
        return h.hexdigest()


def base_params(policy: Policy, args: Mapping[str, Any], score: str) -> dict[str, Any]:
    """The public parameters naming one score array: the ROC-GLM's, so releases are shared."""
    return {"label": args["label"], "score": score, "score_range": list(policy.score_range)}


def release_rounds(ctx: PlanContext, args: Mapping[str, Any], scores: Sequence[str], *, least: int = 1
                   ) -> Generator[Step, Any, Released]:
    """Secure class counts, then one per-site release per score array (DP, or exact where allowed).

    Run by the Analyst and by each Site's copy of the plan. `least`: the
    fewest controls and cases over all sites the analysis needs.
    """
    policy = ctx.policy
    counts = yield Step(COUNTS, base_params(policy, args, scores[0]))
    n0 = int(np.asarray(counts["n_negative"]).reshape(-1)[0])
    n1 = int(np.asarray(counts["n_positive"]).reshape(-1)[0])
    if min(n0, n1) < least:
        raise ValueError(f"this analysis needs at least {least} controls and {least} cases over all sites "
                         f"(have {n0}, {n1})")
    private = args["mode"] == "dp"
    if not private and ctx.party == "analyst":
        warnings.warn(NON_PRIVATE_NOTE + " (epsilon=None)", NonPrivateWarning, stacklevel=5)
    negatives: dict[str, np.ndarray] = {}
    positives: dict[str, np.ndarray] = {}
    for score in scores:
        base = base_params(policy, args, score)
        extra = {k: args[k] for k in PRIVACY_KEYS} if private else {"non_private": True}
        released = yield Step(SCORES, {**base, **extra})
        check_class_sites(released, policy)
        neg, pos = pooled_samples(released, "negative"), pooled_samples(released, "positive")
        if neg.size != n0 or pos.size != n1:
            raise ValueError(f"the sites released {neg.size} negative and {pos.size} positive scores of {score!r}, "
                             f"but the secure counts are {n0} and {n1}")
        negatives[score], positives[score] = neg, pos
    return Released(n0, n1, negatives, positives)


def check_class_sites(released: Mapping[str, Any], policy: Policy) -> None:
    """Stop a run whose controls or cases sit at fewer than ``min_sites`` sites (Analyst and Sites alike).

    Later exact sums over one class (DeLong placement sums, partial areas)
    would otherwise be one site's totals. The per-site class sizes are public
    in the release, so this refusal depends on nothing else. Like the other
    small-group rules it is off where ``min_cell_count = 1`` (a simulation).
    """
    if policy.min_cell_count <= 1:
        return
    for kind, name in (("negative", "controls"), ("positive", "cases")):
        holding = sum(1 for arrays in released.values() if np.asarray(arrays[kind]).size > 0)
        if holding < policy.min_sites:
            raise PolicyError(f"policy: the {name} of this run sit at fewer than min_sites = {policy.min_sites} "
                              f"sites; sums over them would be one site's totals")


def privacy_record(policy: Policy, args: Mapping[str, Any], releases: int) -> dict[str, Any] | None:
    """The privacy parameters a result states (None in the non-private mode)."""
    if args["mode"] != "dp":
        return None
    out = {k: args[k] for k in PRIVACY_KEYS}
    out["policy_l2_sensitivity"] = policy.dp.l2_sensitivity if policy.dp else None
    out["releases"] = int(releases)
    return out


def mode_of(args: Mapping[str, Any]) -> str:
    """The mode a result states: "dp", or "non-private" for the validation mode."""
    return "dp" if args["mode"] == "dp" else "non-private"
