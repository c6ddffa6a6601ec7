"""One analysis under every threat model, side by side: `compare_schemes` (library) and ``secagg-roc compare``.

Run by the researcher, in one process: for each sharing scheme and privacy
model the same declared analyses (by default the ROC-GLM with its interval,
the Brier score and the calibration curve) run on the same sites' data in a
fresh embedded study whose messages go through the wire encoding. Each row
holds the results and their error against the pooled computation, what each
party learned (from its transcript: message kinds, vectors, per-site values;
and from the scheme's threat model and spec), what the scheme tolerates, and
what it cost (bytes each party sent, rounds, wall time). `Comparison` writes
JSON and Markdown and, with the [plot] extra, a figure.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from . import pooled
from .errors import SecAggError
from .policy import Policy
from .sharing import SharingScheme, make_scheme
from .stats import brier_score, calibration_curve, roc_glm
from .study import Study

#: The privacy models of the ROC-GLM's score release: exact scores (non-private) or the policy's DP.
PRIVACY_MODELS = ("exact", "dp")
ANALYSES = ("rocglm", "brier", "calibration")
#: Further analyses a comparison may include: the score histogram's AUC (Federated under "exact", DistDP under
#: "dp") and the secure AUC (exact only, under the schemes whose kept sums it takes).
EXTRA_ANALYSES = ("histogram", "secure_auc")
_VECTOR_KINDS = {"InputShare", "AggregateShare", "ForwardedShares"}


@dataclass(frozen=True)
class SchemeSetup:
    """A sharing scheme with its parameters, as `LocalFederation` takes them."""

    scheme: str
    n_aggregators: int | None = None
    threshold: int | None = None

    @classmethod
    def parse(cls, text: str) -> "SchemeSetup":
        """"additive", "additive:3", "shamir:5:3" (n aggregators, threshold), "replicated", "plaintext",
        "pairwise", "pairwise:1:3" (one server, a threshold of 3 sites)."""
        name, *numbers = text.strip().split(":")
        try:
            values = [int(v) for v in numbers]
        except ValueError:
            raise ValueError(f"scheme {text!r}: give NAME[:AGGREGATORS[:THRESHOLD]] with whole numbers") from None
        if len(values) > 2:
            raise ValueError(f"scheme {text!r}: give NAME[:AGGREGATORS[:THRESHOLD]]")
        setup = cls(name, *values)
        setup.build()  # fails here, with the scheme's own message, for a bad name or parameters
        return setup

    def build(self) -> SharingScheme:
        """The scheme this row runs under."""
        return make_scheme(self.scheme, self.n_aggregators, threshold=self.threshold)

    @property
    def label(self) -> str:
        s = self.build()
        if s.name == "shamir":
            return f"shamir {s.threshold}-of-{s.n_aggregators}"
        if s.name == "pairwise":
            return "pairwise" + ("" if s.site_threshold is None else f" t={s.site_threshold}")
        return s.name if s.name in ("plaintext", "replicated") else f"{s.name} {s.n_aggregators}-of-{s.n_aggregators}"


DEFAULT_SCHEMES = (SchemeSetup("plaintext"), SchemeSetup("additive", 2), SchemeSetup("shamir", 3, 2),
                   SchemeSetup("replicated"), SchemeSetup("pairwise"))


@dataclass
class Row:
    """One scheme under one privacy model."""

    scheme: str
    privacy: str
    results: dict[str, Any]
    errors: dict[str, float]
    learned: dict[str, dict[str, Any]]
    threat: dict[str, Any]
    costs: dict[str, Any]


@dataclass
class Comparison:
    """Rows of `compare_schemes` and the pooled reference they are measured against."""

    reference: dict[str, Any]
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "rows": [dataclasses.asdict(r) for r in self.rows]}

    def to_json(self) -> str:
        from .compare_report import to_json
        return to_json(self)

    def to_markdown(self) -> str:
        from .compare_report import to_markdown
        return to_markdown(self)

    def plot(self, path: str | None = None) -> Any:
        """Errors and costs per row (needs the [plot] extra); saved to `path` if given."""
        from .compare_report import plot
        return plot(self, path)

    def __str__(self) -> str:
        return self.to_markdown()


def compare_schemes(data: Mapping[str, Mapping[str, Any]], *, label: str = "y", score: str = "score",
                    policy: Policy | None = None, schemes: Sequence[SchemeSetup | str] | None = None,
                    privacy: Sequence[str] = PRIVACY_MODELS, analyses: Sequence[str] = ANALYSES,
                    seed: int = 0) -> Comparison:
    """Run `analyses` on `data` (site -> named arrays) under every scheme and privacy model.

    `policy` must allow the analyses; the comparison turns on ``allow_non_private`` (it is a researcher's
    side-by-side, and the "exact" privacy model and the plaintext baseline are non-private by design) and
    the "dp" model needs the policy's DP settings. `seed` seeds the DP noise, the same for every scheme."""
    policy = policy or Policy(roles={"label": [label], "score": [score]})
    unknown = set(privacy) - set(PRIVACY_MODELS) or set(analyses) - set(ANALYSES) - set(EXTRA_ANALYSES)
    if unknown:
        raise ValueError(f"unknown privacy model or analysis {sorted(unknown)}; known: {PRIVACY_MODELS}, "
                         f"{ANALYSES + EXTRA_ANALYSES}")
    if "dp" in privacy and policy.dp is None:
        raise ValueError("the 'dp' privacy model needs a policy with DP settings (Policy(dp=DPPolicy(...)))")
    policy = dataclasses.replace(policy, allow_non_private=True)
    setups = [s if isinstance(s, SchemeSetup) else SchemeSetup.parse(s) for s in (schemes or DEFAULT_SCHEMES)]
    reference = _pooled_reference(data, label, score, policy)
    out = Comparison(reference)
    for setup in setups:
        for model in privacy:
            out.rows.append(_run_one(data, setup, model, label, score, policy, analyses, seed, reference))
    return out


def _pooled_reference(data: Mapping[str, Mapping[str, Any]], label: str, score: str, policy: Policy) -> dict[str, Any]:
    y = np.concatenate([np.asarray(d[label]) for d in data.values()])
    s = np.concatenate([np.asarray(d[score], dtype=float) for d in data.values()])
    sites = np.repeat(np.arange(len(data)), [len(np.asarray(d[label])) for d in data.values()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = pooled.roc_glm(y, s)
    calib = pooled.calibration_curve(y, s, n_bins=policy.calibration_bins, min_cell_count=policy.min_cell_count,
                                     sites=sites)
    return {"auc": fit.auc, "ci": list(fit.ci), "auc_empirical": pooled.auc(y, s),
            "brier": pooled.brier_score(y, s), "calibration_observed": _floats(calib.observed),
            "records": int(y.size), "sites": len(data)}


def _floats(a) -> list[float | None]:
    return [None if not np.isfinite(v) else float(v) for v in np.asarray(a, dtype=float)]


def _run_one(data, setup: SchemeSetup, model: str, label: str, score: str, policy: Policy,
             analyses: Sequence[str], seed: int, ref: dict[str, Any]) -> Row:
    study = Study.local(data, policy=policy, scheme=setup.scheme, n_aggregators=setup.n_aggregators,
                        threshold=setup.threshold, seed=seed, wire=True, transcripts="light")
    results: dict[str, Any] = {}
    errors: dict[str, float] = {}
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # every result says itself whether it is private
        if "rocglm" in analyses:
            r = roc_glm(study, label, score, epsilon=None) if model == "exact" else roc_glm(study, label, score)
            results.update(auc=r.auc, ci=list(r.ci), params=list(r.params))
            errors.update(auc=abs(r.auc - ref["auc"]), ci=float(np.max(np.abs(np.subtract(r.ci, ref["ci"])))))
        if "brier" in analyses:
            b = float(brier_score(study, label, score))
            results["brier"] = b
            errors["brier"] = abs(b - ref["brier"])
        if "calibration" in analyses:
            c = calibration_curve(study, label, score)
            results["calibration_observed"] = _floats(c.observed)
            diffs = [abs(a - b) for a, b in zip(results["calibration_observed"], ref["calibration_observed"])
                     if a is not None and b is not None]
            errors["calibration"] = max(diffs, default=0.0)
        _extra_analyses(study, analyses, model, label, score, ref, results, errors)
    seconds = time.perf_counter() - started
    scheme = study.federation.scheme
    return Row(setup.label, model, results, errors, _learned(study, model), scheme.threat_model.as_dict(),
               _costs(study, seconds))


def _extra_analyses(study, analyses: Sequence[str], model: str, label: str, score: str, ref: dict[str, Any],
                    results: dict[str, Any], errors: dict[str, float]) -> None:
    """The histogram AUC and the secure AUC, against the pooled empirical AUC; a row says why one is missing."""
    from .mpc.joint import JOINT_SCHEMES
    from .stats import score_histogram, secure_auc

    if "histogram" in analyses:
        try:
            h = score_histogram(study, label=label, score=score,
                                privacy="federated" if model == "exact" else "distdp")
            results["histogram_auc"] = h.auc()
            errors["histogram_auc"] = abs(h.auc() - ref["auc_empirical"])
        except SecAggError as exc:
            results["histogram_auc"] = f"refused: {type(exc).__name__}: {exc}"
    if "secure_auc" in analyses and model == "exact":
        if study.federation.scheme.name not in JOINT_SCHEMES:
            results["secure_auc"] = f"not run: the joint computation takes {' or '.join(JOINT_SCHEMES)} shares"
        else:
            value = float(secure_auc(study, label=label, score=score))
            results["secure_auc"] = value
            errors["secure_auc"] = abs(value - ref["auc_empirical"])


def _role(party: str, sites: tuple[str, ...]) -> str:
    return "site" if party in sites else ("analyst" if party == "analyst" else "aggregator")


def _learned(study, model: str) -> dict[str, dict[str, Any]]:
    """Per role, from the transcripts: the message kinds received, how many carried vectors, and what was
    in the clear -- checked against what the scheme promises."""
    fed = study.federation
    scheme = fed.scheme
    out: dict[str, dict[str, Any]] = {}
    for party, t in fed.transcripts.items():
        role = _role(party, fed.sites)
        entry = out.setdefault(role, {"kinds": set(), "vectors": 0, "per_site_releases": 0})
        entry["kinds"] |= t.kinds()
        entry["vectors"] += sum(n for k, n in t.counts.items() if k in _VECTOR_KINDS)
        entry["per_site_releases"] += t.counts.get("ForwardedShares", 0)
    k = scheme.threat_model.max_colluding_servers
    clear = {
        "aggregator": ("every site's sums in the clear (trusted host)" if not scheme.private else
                       f"shares only: uniformly random to any {k} colluding aggregator(s)"),
        "analyst": "totals over the contributor set" + (
            "; each site's exact scores (non-private ROC-GLM)" if model == "exact" else
            "; each site's DP-noised scores"),
        "site": "the same releases as the analyst (it combines them itself to check the plan)",
    }
    for role, entry in out.items():
        entry["kinds"] = sorted(entry["kinds"])
        entry["in_clear"] = clear[role]
    return out


def _costs(study, seconds: float) -> dict[str, Any]:
    fed = study.federation
    sent: dict[str, int] = {"site": 0, "aggregator": 0, "analyst": 0}
    for t in fed.transcripts.values():
        for e in t:
            sent[_role(e.sender, fed.sites)] += e.nbytes or 0
    rounds = fed.transcripts[fed.aggregators[0].name].counts.get("Query", 0)
    return {"bytes_sent": sent, "rounds": int(rounds), "seconds": round(seconds, 4)}
