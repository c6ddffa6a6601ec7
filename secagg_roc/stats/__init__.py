"""The statistics layer: GLM, ROC-GLM with DeLong intervals, Brier score, calibration.

Every function here is run by the Analyst and talks to the sites only through
the `Study` interface (secure totals, DP releases, broadcasts).
"""

from .calibration import brier_score, calibration_curve
from .glm import ConvergenceWarning, FitError, fit_glm
from .results import AucTest, CalibrationCurve, GlmResult, NamedArray, RocGlmResult
from .rocglm import AucAgreementWarning, NonPrivateWarning, binormal_auc, roc_glm

__all__ = [
    "AucAgreementWarning",
    "AucTest",
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
    "fit_glm",
    "roc_glm",
]
