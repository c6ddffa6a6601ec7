"""Differential privacy: Gaussian mechanisms and the l2-sensitivity (exported here), the policy's DP part
(`dp.policy`: `DPPolicy`, `DPRequest`), discrete noise for histograms (`dp.discrete`) and budget accounting
(`dp.accounting`)."""

from .gaussian import (
    MECHANISMS,
    analytic_sigma,
    classic_sigma,
    gaussian_noise,
    gaussian_sigma,
    privacy_profile,
    release_grid,
)
from .sensitivity import (
    RECOMMENDED,
    L2Sensitivity,
    SensitivityWarning,
    histogram_representation,
    l2_sensitivity,
    max_gap_at_distance,
    min_positive_distance,
    recommended_privacy,
)

__all__ = [
    "MECHANISMS",
    "RECOMMENDED",
    "L2Sensitivity",
    "SensitivityWarning",
    "analytic_sigma",
    "classic_sigma",
    "gaussian_noise",
    "gaussian_sigma",
    "histogram_representation",
    "l2_sensitivity",
    "max_gap_at_distance",
    "min_positive_distance",
    "privacy_profile",
    "recommended_privacy",
    "release_grid",
]
