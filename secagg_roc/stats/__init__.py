"""The statistics: each analysis is a plan (see `plans`) plus the function the analyst calls.

Every function here takes a `Study` and runs the analysis's plan on it: the
sites check each round against their own copy of the plan and the study's
policy, and only secure totals (or per-site DP releases) come back.
"""

from . import sensitivity  # noqa: F401  (registers the ``sensitivity`` plan)
from .sums import column_sums
from .calibration import BrierScore, brier_score, calibration_curve
from .glm import AliasedWarning, ConvergenceWarning, FitError, SeparationWarning, fit_glm
from .results import CalibrationCurve, GlmResult, NamedArray
from .rocglm_result import AucTest, DegenerateAucWarning, RocGlmResult
from .rocglm import AucAgreementWarning, NonPrivateWarning, binormal_auc, roc_glm

__all__ = [
    "AliasedWarning",
    "AucAgreementWarning",
    "DegenerateAucWarning",
    "SeparationWarning",
    "AucTest",
    "BrierScore",
    "CalibrationCurve",
    "ConvergenceWarning",
    "FitError",
    "GlmResult",
    "NamedArray",
    "NonPrivateWarning",
    "RocGlmResult",
    "binormal_auc",
    "brier_score",
    "calibration_curve",
    "column_sums",
    "fit_glm",
    "roc_glm",
]

