"""Site queries of the distributed GLM (run by each Site).

The GLM plan (`stats.glm`) fits a logit or probit model by Fisher scoring:
every iteration each site evaluates the score vector, the Fisher information
and its deviance contribution at the current coefficients (which it derived
itself from the earlier totals); only their secure totals are released. Before
that, two rounds (column sums, then sums of squared deviations from the public
means) standardize the covariates so that the summed quantities stay well
inside the fixed-point range.

Which records form the model is a *design*: ``{"kind": "arrays", ...}`` reads
response, covariates and optional weights from named arrays; other modules
register designs built from derived data (the ROC-GLM registers one built from
placement values, see `queries.roc`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from ..array_digest import array_digest as _array_digest
from ..stats.families import check_family, fisher_parts, null_parts
from .common import labels, matrix, param, weights
from .registry import QueryResult, SiteData, site_query

#: A design builder returns (y, X without intercept, prior weights, record count).
Design = tuple[np.ndarray, np.ndarray, np.ndarray, int]
DesignBuilder = Callable[[SiteData, dict[str, Any]], Design]
DESIGNS: dict[str, DesignBuilder] = {}


def design(kind: str) -> Callable[[DesignBuilder], DesignBuilder]:
    """Register a design builder under `kind` (run by each Site when a GLM query names it)."""

    def register(func: DesignBuilder) -> DesignBuilder:
        if kind in DESIGNS:
            raise ValueError(f"GLM design {kind!r} is registered twice")
        DESIGNS[kind] = func
        return func

    return register


@design("arrays")
def arrays_design(site: SiteData, spec: dict[str, Any]) -> Design:
    """Response ``spec["y"]`` (0/1), covariates ``spec["X"]`` (names, may be empty), weights ``spec["weights"]``."""
    y = labels(site, param(site, spec, "y")).astype(np.float64)
    X = matrix(site, spec.get("X") or [], y.size)
    return y, X, weights(site, spec.get("weights"), y.size), int(y.size)


def _spec(site: SiteData, params: dict[str, Any]) -> tuple[dict[str, Any], Callable]:
    spec = params.get("design")
    if not isinstance(spec, dict):
        raise site.fail("query parameter 'design' must be an object naming a design 'kind'")
    builder = DESIGNS.get(spec.get("kind"))
    if builder is None:
        raise site.fail(f"unknown GLM design {spec.get('kind')!r}; known: {sorted(DESIGNS)}")
    return spec, builder


def build_design(site: SiteData, params: dict[str, Any]) -> Design:
    """The site's (y, X, w, records) for the design named in ``params["design"]``.

    Fisher scoring asks for the same design every iteration; a design is a pure function of the site's
    arrays, the design's parameters and the step's derived values, so the last few are kept (callers
    never change a design's arrays)."""
    spec, builder = _spec(site, params)
    return _built(site, spec, builder)[1]


def _built(site: SiteData, spec: dict[str, Any], builder: Callable) -> tuple[dict, Design, dict, dict]:
    """The cache entry of a design: (the site's arrays, the design, its standardized matrices by centre/scale,
    values that depend on the design alone: its null-deviance parts)."""
    key = (id(site.arrays), *_design_key(site, spec))
    hit = _DESIGNS_BUILT.get(key)
    if hit is not None and hit[0] is site.arrays:  # the very same arrays object (held below, so its id is not reused)
        _DESIGNS_BUILT.move_to_end(key)
        return hit
    entry = _DESIGNS_BUILT[key] = (site.arrays, builder(site, spec), {}, {})
    while len(_DESIGNS_BUILT) > _DESIGNS_KEPT:
        _DESIGNS_BUILT.popitem(last=False)
    return entry


def _design_key(site: SiteData, spec: dict[str, Any]) -> tuple[str, str]:
    """(the design's parameters as sorted JSON, a digest of the step's derived values): the part of a design's
    cache key that is a function of the step alone, made once per step for the sites that share it."""
    def compute() -> tuple[str, str]:
        return _SORTED_JSON(spec), _context_digest(site.public)

    return compute() if site.derive is None else site.derive("glm.design", compute)


#: `json.dumps(value, sort_keys=True)`, its encoder made once.
_SORTED_JSON = json.JSONEncoder(sort_keys=True).encode

#: Designs built lately: (arrays id, design parameters, derived values) -> (arrays, design, standardized, constants).
_DESIGNS_BUILT: "OrderedDict[tuple, tuple[dict, Design, dict, dict]]" = OrderedDict()
_DESIGNS_KEPT = 32


def _context_digest(public: dict[str, Any]) -> str:
    """A digest of a step's derived values (pooled reference samples and the like)."""
    h = hashlib.sha256()
    for k in sorted(public):
        v = public[k]
        h.update(k.encode())
        if isinstance(v, np.ndarray):
            h.update(_array_digest(v))
        else:
            h.update(json.dumps(v, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def _standardize(site: SiteData, X: np.ndarray, params: dict[str, Any]) -> np.ndarray:
    """Apply the analyst's public centre/scale to the covariates and prepend the intercept."""
    p = X.shape[1]
    center = np.asarray(params.get("center", [0.0] * p), dtype=float)
    scale = np.asarray(params.get("scale", [1.0] * p), dtype=float)
    if center.shape != (p,) or scale.shape != (p,) or np.any(scale <= 0):
        raise site.fail(f"center/scale must be {p} numbers with positive scales")
    return np.hstack([np.ones((X.shape[0], 1)), (X - center) / scale])


#: The coarse copies of the centring and scaling rounds' sums: suffix -> the same totals times 2^-shift, so that
#: they stay within the ring 2^shift times longer. A site's value beyond the ring's range wraps
#: (`ring.FixedPoint` ``wrap``: clipping it would let the others' total out), so the plan reads a total from
#: the finest copy that cannot have wrapped (`stats.glm.wrap_safe`). One copy, and a coarse one: each site
#: rounds its copy on its own, so a copy and the fine total differ by the sum of the sites' rounding residuals,
#: a function of each site's sum beyond the total. At 2^-48 that residual is the whole sum (the copy is 0) at
#: every site whose sum is below 2^31 (centring) or 2^39 (scaling): nothing more is said of ordinary data; of
#: sums beyond, the carries (at most log2 of the sites' count in bits). A copy at 2^-24 said them of sums
#: above 2^7 (red team 18).
COARSE_SHIFTS = {"_coarse": 48}


def _with_coarse(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(values)
    for key, v in values.items():
        out.update({key + suffix: np.ldexp(v, -shift) for suffix, shift in COARSE_SHIFTS.items()})
    return out


@site_query("glm.means", outputs={"sum": "float", "rows": "int", "weight": "float",
                                  **{k + s: "float" for k in ("sum", "weight") for s in COARSE_SHIFTS}})
def glm_means(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Column sums of the covariates (for centring), the row count and the sum of prior weights (for precision),
    and coarse copies of the sums (`COARSE_SHIFTS`)."""
    _, X, w, records = build_design(site, params)
    return QueryResult({"rows": np.array([X.shape[0]]), **_with_coarse({"sum": X.sum(axis=0), "weight": np.array([w.sum()])})},
                       records=records)


@site_query("glm.ssd", outputs={"ssd": "float", **{"ssd" + s: "float" for s in COARSE_SHIFTS}})
def glm_ssd(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Column sums of squared deviations from the public ``params["center"]`` (for scaling).

    Two passes (means, then deviations) keep the sums small where one pass of
    sums of squares would not fit the fixed-point range (covariates near 1e6); a
    coarse copy (`COARSE_SHIFTS`) serves where even they would not.
    """
    _, X, _, records = build_design(site, params)
    center = np.asarray(params.get("center", []), dtype=float)
    if center.shape != (X.shape[1],):
        raise site.fail(f"center must be {X.shape[1]} numbers")
    return QueryResult(_with_coarse({"ssd": ((X - center) ** 2).sum(axis=0)}), records=records)


def _at_beta(site: SiteData, params: dict[str, Any]) -> tuple:
    """(y, standardized design, weights, beta, family, records, the design's constants) of a Fisher or Newton
    round."""
    family = params.get("family", "logit")
    try:
        family = check_family(family)
    except ValueError as exc:
        raise site.fail(str(exc)) from None
    entry = _built(site, *_spec(site, params))
    y, X, w, records = entry[1]
    # Fisher scoring standardizes with the same public centre and scale every iteration: kept with the design.
    def scaling_text() -> str:
        return json.dumps([params.get("center"), params.get("scale")])

    scaling = scaling_text() if site.derive is None else site.derive("glm.scaling", scaling_text)
    Z = entry[2].get(scaling)
    if Z is None:
        Z = _standardize(site, X, params)
        Z.flags.writeable = False  # shared by the iterations: nothing may change it
        entry[2].clear()  # one scaling per design at a time: a fit keeps its centre and scale
        entry[2][scaling] = Z
    beta = np.asarray(params.get("beta", []), dtype=float)
    if beta.shape != (Z.shape[1],) or not np.isfinite(beta).all():
        raise site.fail(f"beta must be {Z.shape[1]} finite numbers (intercept first), got {beta.shape[0]}")
    return y, Z, w, beta, family, records, entry[3]


@site_query("glm.fisher", outputs={"score": "float", "info": "float", "deviance": "float"})
def glm_fisher(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Score vector, Fisher information and deviance at the public ``params["beta"]``."""
    y, Z, w, beta, family, records, constants = _at_beta(site, params)
    score, info, dev = fisher_parts(y, Z, w, beta, family, fixed=constants.setdefault("fisher", {}))
    return QueryResult({"score": score, "info": info, "deviance": np.array([dev])}, records=records)


@site_query("glm.newton", outputs={"score": "float", "info": "float", "observed": "float", "deviance": "float",
                                   "null": "float"})
def glm_newton(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """What `glm.fisher` gives, plus the observed information (Newton's step) and the null deviance's
    parts (sum w y, sum w, the saturated term: a Newton fit need not begin at beta = 0)."""
    y, Z, w, beta, family, records, constants = _at_beta(site, params)
    score, info, dev, observed = fisher_parts(y, Z, w, beta, family, observed=True,
                                              fixed=constants.setdefault("fisher", {}))
    null = constants.get("null")
    if null is None:  # the same at every beta: computed once per design (the same arithmetic, so the same bits)
        null = constants["null"] = null_parts(y, w)
    return QueryResult({"score": score, "info": info, "observed": observed, "deviance": np.array([dev]),
                        "null": null.copy()}, records=records)
