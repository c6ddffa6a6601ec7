"""The study file's ``[policy]`` table: the sites' privacy policy, read and written.

Read by every party with the rest of the study file (`read_policy`, called by
`config_read.parse_study`); every site then checks every request against the
resulting `Policy`. Written back by `config_write` (`policy_table`). The
policy's q and min_sites are the ``[study]`` keys ``privacy_level`` and
``min_sites``: one setting, given once, so the ``[policy]`` table refuses them.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import PolicyError
from ..policy import ACCOUNTING, MAX_HISTOGRAM_BINS, MECHANISMS, ROCGLM_FITS, ROLES as POLICY_ROLES, DPPolicy, Policy
from .config_table import REQUIRED, TomlTable

__all__ = ["POLICY_IN_STUDY", "read_policy", "policy_table"]


#: `Policy` fields the [policy] table takes (q and min_sites are [study] keys).
POLICY_IN_STUDY = ("privacy_level", "min_sites")
#: The keys of ``[policy]`` and ``[policy.dp]``, all optional but epsilon, delta and l2_sensitivity in ``dp``
#: (named in the error for an unknown key, whichever of them a file sets).
POLICY_KEYS = ("min_cell_count", "allow_dropouts", "allow_non_private", "analyses", "roles", "score_range",
               "calibration_bins", "calibration_strategy", "rocglm_thresholds", "rocglm_fit", "sensitivity_resolution",
               "histogram_bins", "dp")
DP_KEYS = ("epsilon", "delta", "l2_sensitivity", "mechanism", "accounting", "budget_epsilon", "budget_delta")


def read_policy(top: TomlTable, privacy_level: int, min_sites: int) -> Policy:
    """The ``[policy]`` table (optional) as a `Policy`, with q and min_sites from ``[study]``."""
    if "policy" not in top.data:
        top.used.add("policy")
        return Policy(privacy_level=privacy_level, min_sites=min_sites)
    p = top.table("policy")
    for key in POLICY_IN_STUDY:
        if key in p.data:
            raise p.error(f"is set once, as study.{key} (the policy uses that value); remove it here", key)
    fields: dict[str, Any] = {"privacy_level": privacy_level, "min_sites": min_sites}
    if "min_cell_count" in p.data:
        fields["min_cell_count"] = p.integer("min_cell_count", REQUIRED, lo=1)
    for key in ("allow_dropouts", "allow_non_private"):
        if key in p.data:
            fields[key] = p.boolean(key)
    if "analyses" in p.data:
        import secagg_roc.stats  # noqa: F401  (the built-in analyses register their plans on import)
        from ..plans import PLANS

        fields["analyses"] = p.names("analyses", "analysis", sorted(PLANS))
    if "roles" in p.data:
        r = p.table("roles")
        roles = {}
        for role in r.data:
            if role not in POLICY_ROLES:
                raise r.error(f"unknown role {role!r} (roles: {', '.join(POLICY_ROLES)})", key=None)
            roles[role] = r.names(role, "array", single=True)
        r.finish()
        fields["roles"] = roles
    if "score_range" in p.data:
        value = p.raw("score_range")
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
                or not all(math.isfinite(float(v)) for v in value) or not float(value[0]) < float(value[1])):
            raise p.error(f"must be two finite numbers [lower, upper] with lower < upper, got {value!r}", "score_range")
        fields["score_range"] = (float(value[0]), float(value[1]))
    if "calibration_bins" in p.data:
        fields["calibration_bins"] = p.integer("calibration_bins", REQUIRED, lo=1, hi=10_000)
    if "calibration_strategy" in p.data:
        fields["calibration_strategy"] = p.choice("calibration_strategy", "uniform", ("uniform", "quantile"))
    if "rocglm_thresholds" in p.data:
        fields["rocglm_thresholds"] = p.integer("rocglm_thresholds", REQUIRED, lo=3, hi=10_000)
    if "rocglm_fit" in p.data:
        fields["rocglm_fit"] = p.choice("rocglm_fit", "released", ROCGLM_FITS)
    if "sensitivity_resolution" in p.data:
        fields["sensitivity_resolution"] = p.number("sensitivity_resolution", REQUIRED)
    if "histogram_bins" in p.data:  # (`policy_table` writes it when it is not the default)
        fields["histogram_bins"] = p.integer("histogram_bins", REQUIRED, lo=1, hi=MAX_HISTOGRAM_BINS)
    if "dp" in p.data:
        d = p.table("dp")
        dp: dict[str, Any] = {
            "epsilon": d.number("epsilon", REQUIRED),
            "delta": _unit(d, "delta"),
            "l2_sensitivity": d.number("l2_sensitivity", REQUIRED),
            "mechanism": d.choice("mechanism", "analytic", MECHANISMS),
            "accounting": d.choice("accounting", "gaussian", ACCOUNTING),
        }
        if "budget_epsilon" in d.data:
            dp["budget_epsilon"] = d.number("budget_epsilon", REQUIRED)
        if "budget_delta" in d.data:
            dp["budget_delta"] = _unit(d, "budget_delta")
        d.finish(DP_KEYS)
        try:
            fields["dp"] = DPPolicy(**dp)
        except PolicyError as exc:
            raise d.error(str(exc).removeprefix("policy: "), key=None) from None
    p.finish(POLICY_KEYS)
    try:
        return Policy(**fields)
    except PolicyError as exc:
        raise p.error(str(exc).removeprefix("policy: "), key=None) from None


def _unit(t: TomlTable, key: str) -> float:
    """A probability such as delta: a number strictly between 0 and 1."""
    value = t.number(key, REQUIRED)
    if not value < 1.0:
        raise t.error(f"must lie strictly between 0 and 1, got {value}", key)
    return value


def policy_table(policy: Policy) -> dict[str, Any]:
    """The ``[policy]`` table of `policy` (TOML shape: no q or min_sites, which are [study] keys; no nulls)."""
    table: dict[str, Any] = {}
    for key, value in policy.to_dict().items():
        if key in POLICY_IN_STUDY or value is None:
            continue
        if key == "dp":
            value = {k: v for k, v in value.items() if v is not None}
        table[key] = value
    return table
