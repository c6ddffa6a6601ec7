"""The sites' privacy policy: everything a study may release, fixed before any analysis runs.

Owned by the sites (the ``[policy]`` table of a deployed study's file, or the
`policy` of `Study.local`) and checked by every Site against every request
before it reads a record; the analyst's side checks the same rules first only
to fail early. A request outside the policy raises `PolicyError` naming the
rule, never a value of the data.

What the policy fixes:

* disclosure rules for exact releases: ``privacy_level`` (q, the fewest records
  a release covers), ``min_sites`` and ``min_cell_count`` (the fewest records
  behind any released table cell, as DataSHIELD's ``nfilter.tab``);
* which analyses may run, and which arrays may play which role in them (a
  policy with DP releases must name its labels and scores);
* every cut point: the public score range (scores are clipped to it), the
  calibration bins, the score-histogram grid, the ROC-GLM threshold grid, the
  sensitivity grid;
* differential privacy (`DPPolicy`): the mechanism, the per-release
  (epsilon, delta) -- an analyst may ask for more noise, never less -- the
  l2-sensitivity, and each site's total budget with its composition rule;
* how a DP ROC-GLM is fitted (``rocglm_fit``): to its DP release alone (the
  default) or by the paper's exact rounds over the sites' scores;
* whether a run may start without every site (``allow_dropouts``) and whether
  the non-private validation mode is allowed at all (``allow_non_private``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from .dp.policy import ACCOUNTING, MECHANISMS, DPPolicy, DPRequest, _positive, _unit  # noqa: F401 (re-exported)
from .errors import PolicyError

#: The roles an array can play in an analysis.
ROLES = ("label", "score", "covariate", "weight")
#: Analyses every study allows unless its policy lists others.
DEFAULT_ANALYSES = ("glm", "rocglm", "brier", "calibration", "score_histogram", "secure_auc")
#: The finest score histogram a policy may fix (buckets per class).
MAX_HISTOGRAM_BINS = 1 << 20
#: Slack for comparing privacy parameters computed on different machines.
REL_TOL = 1e-9
#: The most noise a DP release may carry, as a multiple of the policy's least noise. Noise far above the
#: policy's costs almost nothing under the accounting, yet the exact rounds that follow it in the same run (the
#: ROC-GLM's fit against the released sample) still speak about the true scores: with a DP sample that says
#: nothing, such a fit visits coefficients far apart, and a few runs at 60-125x the policy's noise determined
#: the pooled per-threshold counts of the positives' exact scores (tests/test_attacks_newton.py).
MAX_NOISE_FACTOR = 8.0
#: The least epsilon of a DP histogram: below it exp(-epsilon / 2) nears 1 (the draw failed), the noise nears the
#: ring's range and unary encoding's p - q vanishes (tests/test_attacks_redteam_10.py).
MIN_PURE_EPSILON = 1e-9


#: A DP ROC-GLM's fits (`Policy.rocglm_fit`).
ROCGLM_FITS = ("exact", "released")


@dataclass(frozen=True)
class Policy:
    """A study's privacy policy; see the module docstring. Frozen and hashable."""

    privacy_level: int = 5
    min_sites: int = 2
    min_cell_count: int | None = None
    allow_dropouts: bool = False
    allow_non_private: bool = False
    analyses: tuple[str, ...] = DEFAULT_ANALYSES
    #: role -> the arrays that may play it; None: any array, but one role per array in an analysis.
    roles: Mapping[str, tuple[str, ...]] | None = None
    score_range: tuple[float, float] = (0.0, 1.0)
    calibration_bins: int = 10
    #: "uniform" (equidistant bins of [0, 1]) or "quantile" (equal-count bins, edges from the scores' DP release).
    #: One strategy per study: curves over different bins could be differenced.
    calibration_strategy: str = "uniform"
    rocglm_thresholds: int = 30
    #: How a DP ROC-GLM is fitted: "released" (the default: from the DP release alone, no exact round about the
    #: scores after it) or "exact" (the paper's: Newton rounds over the sites' exact scores placed against the DP
    #: survivor function, then exact placement sums for DeLong; their exact totals, solved over the integers,
    #: give the pooled number of positives between each two thresholds: tests/test_attacks_redteam_16.py).
    rocglm_fit: str = "released"
    sensitivity_resolution: float = 1e-4
    dp: DPPolicy | None = field(default=None)
    #: The study's score-histogram grid: equal-width buckets of the score range. An analyst may ask a DP histogram
    #: for a divisor of it (a coarsening, which reveals nothing the finest grid does not), never another grid:
    #: histograms over crossing grids could be differenced into cells narrower than either.
    histogram_bins: int = 1000

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for key, lo in (("privacy_level", 1), ("min_sites", 1), ("calibration_bins", 1), ("rocglm_thresholds", 3)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise PolicyError(f"policy: {key} must be an integer >= {lo}, got {value!r}")
        if isinstance(self.histogram_bins, bool) or not isinstance(self.histogram_bins, int) \
                or not 1 <= self.histogram_bins <= MAX_HISTOGRAM_BINS:
            raise PolicyError(f"policy: histogram_bins must be an integer in 1..{MAX_HISTOGRAM_BINS}, "
                              f"got {self.histogram_bins!r}")
        if self.calibration_bins > 10_000 or self.rocglm_thresholds > 10_000:
            raise PolicyError("policy: calibration_bins and rocglm_thresholds must be at most 10000")
        if self.rocglm_fit not in ROCGLM_FITS:
            raise PolicyError(f"policy: rocglm_fit must be one of {', '.join(map(repr, ROCGLM_FITS))}, "
                              f"got {self.rocglm_fit!r}")
        if self.calibration_strategy not in ("uniform", "quantile"):
            raise PolicyError(f"policy: calibration_strategy must be 'uniform' or 'quantile', got {self.calibration_strategy!r}")
        cell = self.privacy_level if self.min_cell_count is None else self.min_cell_count
        if isinstance(cell, bool) or not isinstance(cell, int) or cell < 1:
            raise PolicyError(f"policy: min_cell_count must be an integer >= 1, got {cell!r}")
        set_(self, "min_cell_count", cell)
        analyses = tuple(sorted(set(self.analyses)))
        set_(self, "analyses", analyses)
        if self.roles is not None:
            roles = {}
            for role, arrays in dict(self.roles).items():
                if role not in ROLES:
                    raise PolicyError(f"policy: unknown role {role!r}; roles are {', '.join(ROLES)}")
                arrays = (arrays,) if isinstance(arrays, str) else tuple(arrays)
                if not all(isinstance(a, str) and a for a in arrays):
                    raise PolicyError(f"policy: roles.{role} must list array names")
                roles[role] = arrays
            set_(self, "roles", _FrozenRoles(roles))
        lo, hi = (float(v) for v in self.score_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise PolicyError(f"policy: score_range must be two finite numbers, lower < upper; got {self.score_range!r}")
        set_(self, "score_range", (lo, hi))
        _positive(self.sensitivity_resolution, "sensitivity_resolution")
        if self.dp is not None and not isinstance(self.dp, DPPolicy):
            set_(self, "dp", DPPolicy(**dict(self.dp)))
        if self.calibration_strategy == "quantile" and (self.roles is None or len(self.roles.get("label", ())) != 1):
            # Edges come from a (label, score) release: two labels would bin the same scores two ways.
            raise PolicyError("policy: quantile calibration bins need exactly one declared label (roles.label), "
                              "so that every curve of a score bins it alike")
        if self.dp is not None and (self.roles is None or not self.roles.get("label") or not self.roles.get("score")):
            # The l2-sensitivity is a property of particular scores, and a DP release splits them by a label:
            # without roles an analyst could release any column, split by any 0/1 column.
            raise PolicyError(
                "policy: a policy that allows DP releases must name the arrays that may be labels and scores "
                "(roles.label and roles.score): the l2-sensitivity holds for those scores only"
            )

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Policy":
        """A policy from its dict form (`to_dict`, or a study file's ``[policy]`` table)."""
        data = dict(data)
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"policy: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(known))})")
        if "analyses" in data:
            data["analyses"] = tuple(data["analyses"])
        if "score_range" in data:
            data["score_range"] = tuple(data["score_range"])
        if data.get("dp") is not None and not isinstance(data["dp"], DPPolicy):
            dp = dict(data["dp"])
            unknown = sorted(set(dp) - set(DPPolicy.__dataclass_fields__))
            if unknown:
                raise PolicyError(f"policy: unknown key dp.{unknown[0]} (known: {', '.join(DPPolicy.__dataclass_fields__)})")
            data["dp"] = DPPolicy(**dp)
        return cls(**data)

    def replace(self, **changes: Any) -> "Policy":
        """A copy with `changes` (for a researcher who loosens or tightens a simulation's policy)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "privacy_level": self.privacy_level,
            "min_sites": self.min_sites,
            "min_cell_count": self.min_cell_count,
            "allow_dropouts": self.allow_dropouts,
            "allow_non_private": self.allow_non_private,
            "analyses": list(self.analyses),
            "roles": None if self.roles is None else {r: list(a) for r, a in self.roles.items()},
            "score_range": list(self.score_range),
            "calibration_bins": self.calibration_bins,
            # Only when set: the policies written before it keep their digests.
            **({"calibration_strategy": self.calibration_strategy} if self.calibration_strategy != "uniform" else {}),
            "rocglm_thresholds": self.rocglm_thresholds,
            **({"rocglm_fit": self.rocglm_fit} if self.rocglm_fit != "released" else {}),  # (as histogram_bins)
            "sensitivity_resolution": self.sensitivity_resolution,
            "dp": None if self.dp is None else self.dp.to_dict(),
            # Only when set: the policies written before it keep their digests.
            **({"histogram_bins": self.histogram_bins} if self.histogram_bins != 1000 else {}),
        }

    def digest(self) -> str:
        """SHA-256 of the canonical policy: a run names it, and sites refuse a run under another policy."""
        kept = self.__dict__.get("_digest")
        if kept is None:  # a frozen policy's digest never changes: kept with it (every run's join names it)
            blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
            kept = hashlib.sha256(blob).hexdigest()
            object.__setattr__(self, "_digest", kept)
        return kept

    # -- checks (run by each Site, and first by the Analyst) --------------------

    def check_analysis(self, name: str) -> None:
        """Refuse an analysis the policy does not list."""
        if name not in self.analyses:
            raise PolicyError(
                f"policy: analysis {name!r} is not allowed by this study (allowed: {', '.join(self.analyses)})"
            )

    def check_roles(self, uses: Iterable[tuple[str, str]]) -> None:
        """Refuse arrays outside their declared roles; `uses` is (role, array name) pairs of one analysis."""
        seen: dict[str, str] = {}
        for role, array in uses:
            if role not in ROLES:
                raise PolicyError(f"policy: unknown role {role!r}")
            if not isinstance(array, str) or not array:
                raise PolicyError(f"policy: the {role} must be named by an array name, got {array!r}")
            if array in seen and seen[array] != role:
                raise PolicyError(
                    f"policy: array {array!r} cannot be both {seen[array]} and {role} in one analysis"
                )
            seen[array] = role
            if self.roles is not None and array not in self.roles.get(role, ()):
                allowed = ", ".join(self.roles.get(role, ())) or "none"
                raise PolicyError(
                    f"policy: array {array!r} may not be used as a {role} (arrays allowed as {role}: {allowed})"
                )

    def check_dp(self, epsilon: Any, delta: Any, l2_sensitivity: Any, mechanism: Any) -> DPRequest:
        """The DP release an analysis asks for, if the policy allows it: never less noise than the policy's,
        nor more than `MAX_NOISE_FACTOR` times it.

        None for any argument takes the policy's value. Refuses larger epsilon or
        delta, a smaller l2-sensitivity, and any combination whose noise would
        fall below the policy's least noise or above the cap.
        """
        if self.dp is None:
            raise PolicyError(
                "policy: this study allows no differentially private release (its policy has no dp section); "
                "a study's sites must state dp.epsilon, dp.delta and dp.l2_sensitivity first"
            )
        dp = self.dp
        eps = dp.epsilon if epsilon is None else _positive(epsilon, "epsilon")
        dl = dp.delta if delta is None else _unit(delta, "delta")
        l2 = dp.l2_sensitivity if l2_sensitivity is None else _positive(l2_sensitivity, "l2_sensitivity")
        mech = dp.mechanism if mechanism is None else mechanism
        if mech not in MECHANISMS:
            raise PolicyError(f"mechanism must be one of {MECHANISMS}, got {mech!r}")
        if eps > dp.epsilon * (1 + REL_TOL):
            raise PolicyError(f"policy: epsilon {eps:g} exceeds the per-release maximum dp.epsilon = {dp.epsilon:g}")
        if dl > dp.delta * (1 + REL_TOL):
            raise PolicyError(f"policy: delta {dl:g} exceeds the per-release maximum dp.delta = {dp.delta:g}")
        if l2 < dp.l2_sensitivity * (1 - REL_TOL):
            raise PolicyError(
                f"policy: l2-sensitivity {l2:g} is below the policy's dp.l2_sensitivity = {dp.l2_sensitivity:g} "
                "(a smaller sensitivity would add less noise than the policy requires)"
            )
        from .dp.gaussian import gaussian_sigma

        try:
            sigma = gaussian_sigma(l2, eps, dl, mechanism=mech)
        except ValueError as exc:
            raise PolicyError(f"policy: {exc}") from None
        if sigma < dp.sigma * (1 - REL_TOL):
            raise PolicyError(
                f"policy: the {mech} mechanism at epsilon {eps:g}, delta {dl:g} adds noise sigma = {sigma:.6g}, "
                f"less than the policy's least noise {dp.sigma:.6g}"
            )
        if sigma > MAX_NOISE_FACTOR * dp.sigma * (1 + REL_TOL):
            raise PolicyError(
                f"policy: the {mech} mechanism at epsilon {eps:g}, delta {dl:g}, l2-sensitivity {l2:g} adds noise "
                f"sigma = {sigma:.6g}, more than {MAX_NOISE_FACTOR:g} times the policy's noise {dp.sigma:.6g}: "
                "a release that cheap would leave the exact rounds after it to speak about the true scores"
            )
        return DPRequest(eps, dl, l2, mech, sigma)

    def check_pure_dp(self, epsilon: Any) -> float:
        """The epsilon of a pure-DP release (a DP histogram), if the policy allows it: at most dp.epsilon."""
        if self.dp is None:
            raise PolicyError(
                "policy: this study allows no differentially private release (its policy has no dp section); "
                "a study's sites must state dp.epsilon, dp.delta and dp.l2_sensitivity first"
            )
        eps = self.dp.epsilon if epsilon is None else _positive(epsilon, "epsilon")
        if eps < MIN_PURE_EPSILON:
            raise PolicyError(f"policy: epsilon {eps:g} is below {MIN_PURE_EPSILON:g}, the least a DP histogram "
                              "may use (its noise could not be drawn as declared)")
        if eps > self.dp.epsilon * (1 + REL_TOL):
            raise PolicyError(f"policy: epsilon {eps:g} exceeds the per-release maximum dp.epsilon = {self.dp.epsilon:g}")
        return eps

    def check_non_private(self) -> None:
        """Refuse the non-private validation mode unless the policy allows it explicitly."""
        if not self.allow_non_private:
            raise PolicyError(
                "policy: the non-private validation mode (exact per-site scores) is not allowed by this study; "
                "a study file allows it with allow_non_private = true in [policy] (and each site's operator with "
                "--allow-non-private), a simulation with Policy(allow_non_private=True)"
            )

    @property
    def private(self) -> bool:
        """False when the policy allows the non-private validation mode."""
        return not self.allow_non_private

    def describe(self) -> str:
        """One line for reports."""
        parts = [f"q = {self.privacy_level}", f"min_sites = {self.min_sites}", f"min cell count = {self.min_cell_count}"]
        if self.dp is not None:
            d = self.dp
            parts.append(
                f"DP per release epsilon <= {d.epsilon:g}, delta <= {d.delta:g}, l2-sensitivity {d.l2_sensitivity:g} "
                f"({d.mechanism}); budget per site ({d.budget_epsilon:g}, {d.budget_delta:g}) by {d.accounting} composition"
            )
        if self.allow_dropouts:
            parts.append("runs may start without every site")
        if self.allow_non_private:
            parts.append("NON-PRIVATE validation mode allowed")
        return "; ".join(parts)


class _FrozenRoles(dict):
    """A read-only, hashable role map (a policy is frozen and hashable)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a policy's roles are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]


DEFAULT_POLICY = Policy()
