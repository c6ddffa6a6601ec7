"""The paper's simulation design, now in the library: `secagg_roc.simulation.design`.

Kept so the benchmark scripts' ``from _simulation import ...`` goes on working.
"""

from __future__ import annotations

from secagg_roc.simulation.design import AUC_BINS, auc_bin, generate

__all__ = ["AUC_BINS", "auc_bin", "generate"]
