"""The statistics: each analysis is a plan (see `plans`) plus the function the analyst calls.

Every function here takes a `Study` and runs the analysis's plan on it: the
sites check each round against their own copy of the plan and the study's
policy, and only secure totals (or per-site DP releases) come back. Importing
this package registers every plan.
"""

from . import sensitivity  # noqa: F401  (registers the ``sensitivity`` plan)
from .bootstrap import bootstrap_ci
from .bootstrap_result import BootstrapResult
from .calibration import BrierScore, brier_score, calibration_curve, log_loss
from .histogram import ScoreHistogram
from .histogram_plan import score_histogram
from .secure_auc import SecureAuc, secure_auc
from .glm import (
    AliasedWarning,
    ConvergenceWarning,
    FitError,
    SeparationWarning,
    fit_glm,
)
from .partial import partial_auc
from .precision_recall import distributed_average_precision as average_precision
from .precision_recall import (
    distributed_precision_recall_curve as precision_recall_curve,
)
from .results import CalibrationCurve, GlmResult, NamedArray, NonPrivateWarning
from .roc_compare_results import PartialAuc, RocCoords, RocTest
from .roc_coords import coords
from .roc_tests import roc_test
from .rocglm import AucAgreementWarning, binormal_auc, roc_glm
from .rocglm_result import AucTest, DegenerateAucWarning, RocGlmResult
from .sums import column_sums

__all__ = [
    "AliasedWarning",
    "AucAgreementWarning",
    "AucTest",
    "BootstrapResult",
    "BrierScore",
    "CalibrationCurve",
    "ConvergenceWarning",
    "DegenerateAucWarning",
    "FitError",
    "GlmResult",
    "NamedArray",
    "NonPrivateWarning",
    "PartialAuc",
    "RocCoords",
    "RocGlmResult",
    "RocTest",
    "ScoreHistogram",
    "SecureAuc",
    "SeparationWarning",
    "average_precision",
    "binormal_auc",
    "bootstrap_ci",
    "brier_score",
    "calibration_curve",
    "column_sums",
    "coords",
    "fit_glm",
    "log_loss",
    "partial_auc",
    "score_histogram",
    "secure_auc",
    "precision_recall_curve",
    "roc_glm",
    "roc_test",
]
