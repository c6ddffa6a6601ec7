"""Analyses as verified plans: the analyst drives them, every site checks them (see `plans.base`)."""

from .base import (
    PLANS,
    Plan,
    PlanContext,
    RunInfo,
    Step,
    declared,
    get_plan,
    label_score_uses,
    plan,
    pooled_samples,
    same_step,
)
from .runner import run_analysis
from .site_runs import SiteRuns

__all__ = [
    "PLANS",
    "Plan",
    "PlanContext",
    "RunInfo",
    "SiteRuns",
    "Step",
    "declared",
    "get_plan",
    "label_score_uses",
    "plan",
    "pooled_samples",
    "run_analysis",
    "same_step",
]
