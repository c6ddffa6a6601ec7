"""secagg-roc: validate a prediction model on data no one may pool.

Sites secret-share their local sums across non-colluding aggregators; only
totals are reconstructed. On top sit the statistics of the distributed ROC-GLM
(Schalk et al.): DP survivor functions, the ROC-GLM by distributed Newton
iterations, its AUC with DeLong confidence intervals, the Brier score and
calibration curves.
"""

from . import pooled
from .errors import (
    TamperError,
    CombineError,
    ConfigError,
    EncodingError,
    MessageError,
    PolicyError,
    PrivacyError,
    RoundError,
    SecAggError,
    SiteQueryError,
    WeakThresholdWarning,
)
from .federation import LocalFederation
from .mpc import messages as _mpc_messages  # noqa: F401  (registers the joint computation's message kinds)
from .ledger import Ledger
from .policy import DPPolicy, Policy
from .ring import Encoding, FixedPoint
from .stats import (
    BootstrapResult,
    BrierScore,
    CalibrationCurve,
    GlmResult,
    PartialAuc,
    RocCoords,
    RocGlmResult,
    RocTest,
    average_precision,
    bootstrap_ci,
    brier_score,
    calibration_curve,
    coords,
    fit_glm,
    log_loss,
    partial_auc,
    precision_recall_curve,
    roc_glm,
    roc_test,
    ScoreHistogram,
    SecureAuc,
    score_histogram,
    secure_auc,
)
from .study import LocalStudy, Study, Totals
from .compare import compare_schemes  # after the statistics and the study it runs

__version__ = "0.1.0"

__all__ = [
    "compare_schemes",
    "BrierScore",
    "CalibrationCurve",
    "CombineError",
    "TamperError",
    "WeakThresholdWarning",
    "ConfigError",
    "DPPolicy",
    "Encoding",
    "EncodingError",
    "FixedPoint",
    "GlmResult",
    "Ledger",
    "LocalFederation",
    "LocalStudy",
    "MessageError",
    "Policy",
    "PolicyError",
    "PrivacyError",
    "RocGlmResult",
    "RoundError",
    "SecAggError",
    "SiteQueryError",
    "Study",
    "Totals",
    "brier_score",
    "log_loss",
    "BootstrapResult",
    "PartialAuc",
    "RocCoords",
    "RocTest",
    "average_precision",
    "bootstrap_ci",
    "coords",
    "partial_auc",
    "precision_recall_curve",
    "roc_test",
    "calibration_curve",
    "fit_glm",
    "pooled",
    "roc_glm",
    "ScoreHistogram",
    "SecureAuc",
    "score_histogram",
    "secure_auc",
]
