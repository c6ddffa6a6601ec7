"""secagg-roc: validate a prediction model on data no one may pool.

Sites secret-share their local sums across non-colluding aggregators; only
totals are reconstructed. On top sit the statistics of the distributed ROC-GLM
(Schalk et al.): DP survivor functions, the ROC-GLM by distributed Fisher
scoring, its AUC with DeLong confidence intervals, the Brier score and
calibration curves.
"""

from .errors import (
    CombineError,
    ConfigError,
    EncodingError,
    MessageError,
    PolicyError,
    PrivacyError,
    RoundError,
    SecAggError,
    SiteQueryError,
)
from . import pooled
from .federation import LocalFederation
from .ledger import Ledger
from .policy import DPPolicy, Policy
from .ring import Encoding, FixedPoint
from .stats import (
    BrierScore,
    CalibrationCurve,
    GlmResult,
    RocGlmResult,
    brier_score,
    calibration_curve,
    fit_glm,
    roc_glm,
)
from .study import LocalStudy, Study, Totals

__version__ = "0.1.0"

__all__ = [
    "BrierScore",
    "CalibrationCurve",
    "CombineError",
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
    "calibration_curve",
    "fit_glm",
    "pooled",
    "roc_glm",
]
