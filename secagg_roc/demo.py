"""The paper's use case on GBSG2: validate a two-year recurrence-free survival model at five sites.

By default the validation runs against a real deployment on this machine:
two aggregator services and five site agents as separate processes on
127.0.0.1, with freshly generated keys and mutual TLS, started and stopped
here; ``deployed=False`` runs the same analysis in one process (`Study.local`).
Either way every site-level computation goes through secure sums or the DP
release; the pooled references are computed beside for comparison.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from . import pooled
from .datasets import load_gbsg2
from .extras import missing
from .dp.sensitivity import l2_sensitivity
from .policy import DPPolicy, Policy
from .stats import brier_score, calibration_curve, fit_glm, roc_glm
from .study import Study

if TYPE_CHECKING:
    from .stats.results import CalibrationCurve
    from .stats.rocglm_result import RocGlmResult

HORIZON_DAYS = 730
PAPER_SITE_SIZES = (56, 49, 60, 49, 60)
#: Tumour grade is one indicator, grade III against I or II: grade I is rare (a training site holds one or
#: two grade-I patients of an outcome), and one-hot columns (II, III) would let the GLM's sums give that small
#: cell by difference, which the sites' cross-table rules refuse (`queries.groups`).
FEATURES = ("horTh=yes", "age", "menostat=Post", "tsize", "tgrade=III", "pnodes", "progrec", "estrec")
#: Columns of the covariate matrix that are categorical indicators (one-hot in the sensitivity's histogram).
CATEGORICAL = (0, 2, 4)
PRIVACY_LEVEL = 5
A0 = 0.6
#: The validation sites' policy, as their study file states it. The l2-sensitivity is the estimate the
#: `sensitivity` analysis gives on these sites (0.0023, see the report); the paper's table recommends
#: (epsilon, delta) = (0.2, 0.1) for it; each site grants two such releases.
POLICY = Policy(
    privacy_level=PRIVACY_LEVEL,
    min_sites=2,
    analyses=("rocglm", "brier", "calibration", "sensitivity"),
    roles={"label": ["y"], "score": ["score"], "covariate": ["X"]},
    calibration_bins=10,
    dp=DPPolicy(epsilon=0.2, delta=0.1, l2_sensitivity=0.0023, mechanism="analytic",
                budget_epsilon=0.4, budget_delta=0.2),
)
PAPER = {
    "l2_sensitivity": 0.016,
    "epsilon_delta": (0.3, 0.4),
    "params": (0.7817, 1.2486),
    "auc": 0.6875,
    "ci": (0.6051, 0.7595),
    "pooled_auc": 0.6919,
    "pooled_ci": (0.6131, 0.7608),
    "brier": 0.1733,
}


def gbsg2_two_year() -> tuple[np.ndarray, np.ndarray, int]:
    """(covariates, label, dropped): label 1 = observed beyond 730 days without event, 0 = event by day 730.

    Patients censored before day 730 have no two-year outcome and are dropped.
    """
    d = load_gbsg2()
    time, cens = d["time"], d["cens"]
    event_by = (cens == 1) & (time <= HORIZON_DAYS)
    beyond = time > HORIZON_DAYS
    keep = event_by | beyond
    X = np.column_stack(
        [
            d["horTh"] == "yes",
            d["age"],
            d["menostat"] == "Post",
            d["tsize"],
            d["tgrade"] == "III",
            d["pnodes"],
            d["progrec"],
            d["estrec"],
        ]
    ).astype(float)
    return X[keep], beyond[keep].astype(np.int64), int((~keep).sum())


def proportional_sizes(total: int, weights: Sequence[float] = PAPER_SITE_SIZES) -> list[int]:
    """Split `total` into parts proportional to `weights` (largest remainders)."""
    w = np.asarray(weights, dtype=float)
    raw = total * w / w.sum()
    sizes = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - sizes))[: total - sizes.sum()]:
        sizes[i] += 1
    return sizes.tolist()


def use_case_sites(seed: int = 0) -> tuple[dict[str, dict[str, np.ndarray]], Any, np.ndarray, np.ndarray,
                                           dict[str, Any]]:
    """The use case's five validation sites (label y, model score, covariates X), the model, the pooled
    validation labels and scores, and the split's details. The model is a logistic regression fitted by the
    distributed GLM on two training sites from 60% of the patients; the rest go to the validation sites."""
    rng = np.random.default_rng(seed)
    X, y, dropped = gbsg2_two_year()
    order = rng.permutation(y.size)
    n_train = int(round(0.6 * y.size))
    train, test = order[:n_train], order[n_train:]

    # The model: a logistic regression fitted by the distributed GLM on two training sites.
    half = n_train // 2
    train_study = Study.local(
        {
            "train-a": {"y": y[train[:half]], "X": X[train[:half]]},
            "train-b": {"y": y[train[half:]], "X": X[train[half:]]},
        },
        policy=Policy(privacy_level=PRIVACY_LEVEL, analyses=("glm",)),
        seed=seed,
    )
    model = fit_glm(train_study, "y", "X", family="logit", names=FEATURES)
    eta = model.coef[0] + X[test] @ np.asarray(model.coef)[1:]
    score = 1.0 / (1.0 + np.exp(-eta))

    # Validation data: five sites of sizes proportional to the paper's.
    sizes = proportional_sizes(test.size)
    bounds = np.cumsum([0, *sizes])
    sites = {
        f"site{k + 1}": {"y": y[test][bounds[k] : bounds[k + 1]], "score": score[bounds[k] : bounds[k + 1]], "X": X[test][bounds[k] : bounds[k + 1]]}
        for k in range(len(sizes))
    }
    info = {"n_train": n_train, "test": test, "sizes": sizes, "y": y, "dropped": dropped}
    return sites, model, y[test], score, info


def run_demo(outdir: Path, seed: int = 0, *, deployed: bool = True) -> dict[str, Any]:
    """Run the use case; write ``report.txt``, ``report.json``, ``roc.png`` and ``calibration.png`` into `outdir`.

    The plots need the [plot] extra (matplotlib); without it the report says so
    in ``notes`` and the rest is written all the same.

    `deployed` runs the validation against aggregator and site processes on
    loopback (their keys, data files and databases in a temporary folder).
    Returns the report as a dict; its ``"text"`` entry is the printable report.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    sites, model, y_test, score, info = use_case_sites(seed)
    n_train, test, sizes, y, dropped = info["n_train"], info["test"], info["sizes"], info["y"], info["dropped"]
    started = time.perf_counter()
    if deployed:
        from .deploy.local_cluster import LocalCluster

        # Fresh keys, data files and databases for every run, removed afterwards.
        with tempfile.TemporaryDirectory(prefix="secagg-roc-demo-") as scratch, LocalCluster(
            scratch, sites, seed=seed, policy=POLICY, log_level="WARNING"
        ) as cluster:
            deployment = f"{len(cluster.aggregator_names)} aggregator and {len(sites)} site processes on 127.0.0.1, mutual TLS 1.3"
            with cluster.study() as study:
                analysis_start = time.perf_counter()
                sens, roc, brier, calib, caught = validate(study)
                analysis_seconds = time.perf_counter() - analysis_start
    else:
        deployment = "embedded: every party in this process"
        analysis_start = time.perf_counter()
        sens, roc, brier, calib, caught = validate(Study.local(sites, policy=POLICY, seed=seed))
        analysis_seconds = time.perf_counter() - analysis_start
    eps, delta = roc.privacy["epsilon"], roc.privacy["delta"]  # what roc_glm chose from the sensitivity
    test_h0 = roc.test(A0)

    ref_roc = pooled.roc_glm(y_test, score)
    ref_lo, ref_auc, ref_hi = pooled.delong_ci(y_test, score)
    ref_logit = pooled.delong_ci_logit(y_test, score)
    ref_brier = pooled.brier_score(y_test, score)
    site_of = np.repeat(np.arange(len(sizes)), sizes)
    ref_calib = pooled.calibration_curve(y_test, score, n_bins=10, min_cell_count=POLICY.min_cell_count, sites=site_of)

    report: dict[str, Any] = {
        "data": {
            "patients": int(y.size + dropped),
            "dropped_censored_before_730": dropped,
            "with_outcome": int(y.size),
            "train": int(n_train),
            "validation": int(test.size),
            "site_sizes": dict(zip(sites, sizes)),
            "positives_validation": int(y_test.sum()),
            "privacy_level": PRIVACY_LEVEL,
            "seed": seed,
        },
        "deployment": {
            "parties": deployment,
            "analysis_seconds": round(analysis_seconds, 3),
            "total_seconds": round(time.perf_counter() - started, 3),
        },
        "policy": POLICY.to_dict(),
        "model": model.to_dict(),
        "l2_sensitivity": sens.to_dict(),
        "privacy": {"epsilon": eps, "delta": delta, "sigma": roc.privacy["sigma"], "mechanism": roc.privacy["mechanism"],
                    "l2_sensitivity": roc.privacy["l2_sensitivity"]},
        "roc_glm": roc.to_dict(),
        "test": test_h0.to_dict(),
        "brier": brier,
        "calibration": calib.to_dict(),
        "pooled": {
            "roc_glm": ref_roc.to_dict(),
            "auc_empirical": ref_auc,
            "delong_ci_raw": [ref_lo, ref_hi],
            "delong_ci_logit": [ref_logit[0], ref_logit[2]],
            "brier": ref_brier,
            "calibration": ref_calib.to_dict(),
        },
        "paper_random_forest": {k: list(v) if isinstance(v, tuple) else v for k, v in PAPER.items()},
        "warnings": caught,
    }

    files = {"text": outdir / "report.txt", "report": outdir / "report.json"}
    notes = []
    if missing("plot") is None:
        from .plotting import plot_calibration, plot_roc, save

        files["roc"] = save(plot_roc(roc, pooled=ref_roc), outdir / "roc.png")
        files["calibration"] = save(plot_calibration(calib, pooled=ref_calib), outdir / "calibration.png")
    else:  # the report and its JSON need nothing beyond a base install
        notes.append("no plots: they need the [plot] extra: pip install 'secagg-roc[plot]'")
    report["files"] = {k: str(v) for k, v in files.items()}
    report["notes"] = notes
    report["text"] = format_report(report, roc, calib)
    files["text"].write_text(report["text"] + "\n", encoding="utf-8")
    files["report"].write_text(json.dumps(report, indent=2, default=float), encoding="utf-8")
    return report


def validate(study: Study) -> tuple[Any, Any, float, Any, list[str]]:
    """Run by the Analyst: sensitivity, DP ROC-GLM with CI, Brier score and calibration on `study`."""
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        sens = l2_sensitivity(study, "X", "score", categorical=CATEGORICAL)
        roc = roc_glm(study, "y", "score", alpha=0.05)  # (epsilon, delta) and sensitivity: the policy's
        caught = sorted({str(w.message) for w in log})
    brier = brier_score(study, "y", "score")
    calib = calibration_curve(study, "y", "score")
    return sens, roc, brier, calib, caught


def format_report(r: dict[str, Any], roc: "RocGlmResult", calib: "CalibrationCurve") -> str:
    """The printable report: distributed results beside the pooled references and the paper's."""
    d, p, paper = r["data"], r["pooled"], r["paper_random_forest"]
    lo, hi = roc.ci
    g1, g2 = roc.params
    pr = p["roc_glm"]
    sens_cell = f"{r['l2_sensitivity']['value']:.4f}; {r['privacy']['l2_sensitivity']:.4f}"
    lines = [
        "Distributed validation of a 2-year recurrence-free survival model on GBSG2 (the paper's use case)",
        "",
        f"Patients: {d['patients']}; dropped (censored before day 730, no 2-year outcome): "
        f"{d['dropped_censored_before_730']}; with outcome: {d['with_outcome']}",
        f"Model: logistic regression fitted by the distributed GLM on {d['train']} patients (60 %) at two training sites",
        f"Validation: {d['validation']} patients ({d['positives_validation']} positives) at 5 sites of sizes "
        + ", ".join(str(v) for v in d["site_sizes"].values())
        + f"; privacy level q = {d['privacy_level']}",
        f"Parties: {r['deployment']['parties']}; the analysis took {r['deployment']['analysis_seconds']:.2f} s "
        f"({r['deployment']['total_seconds']:.1f} s with start-up)",
        f"The sites' policy: {POLICY.describe()}",
        "",
        f"{'':34} {'distributed':>24} {'pooled':>24} {'paper (random forest)':>24}",
        f"{'l2-sensitivity (estimate; policy)':34} {sens_cell:>24} {'':>24} {paper['l2_sensitivity']:>24}",
        f"{'(epsilon, delta)':34} {str((r['privacy']['epsilon'], r['privacy']['delta'])):>24} {'':>24} "
        f"{str(tuple(paper['epsilon_delta'])):>24}",
        f"{'ROC-GLM params (gamma1, gamma2)':34} {f'({g1:.4f}, {g2:.4f})':>24} "
        f"{'({:.4f}, {:.4f})'.format(*pr['params'].values()):>24} {str(tuple(paper['params'])):>24}",
        f"{'AUC (ROC-GLM)':34} {roc.auc:>24.4f} {pr['auc']:>24.4f} {paper['auc']:>24}",
        f"{'  95% CI (logit, DeLong)':34} {f'[{lo:.4f}, {hi:.4f}]':>24} "
        f"{'[{:.4f}, {:.4f}]'.format(*pr['ci']):>24} {str(list(paper['ci'])):>24}",
        f"{'AUC (empirical)':34} {roc.auc_empirical:>24.4f} {p['auc_empirical']:>24.4f} {paper['pooled_auc']:>24}",
        f"{'  95% CI (raw, DeLong as pROC)':34} {'[{:.4f}, {:.4f}]'.format(*roc.ci_empirical):>24} "
        f"{'[{:.4f}, {:.4f}]'.format(*p['delong_ci_raw']):>24} {str(list(paper['pooled_ci'])):>24}",
        f"{'H0: AUC <= 0.6, one-sided p':34} {r['test']['p_value']:>24.4g}",
        f"{'Brier score':34} {r['brier']:>24.4f} {p['brier']:>24.4f} {paper['brier']:>24}",
        f"{'Expected calibration error':34} {calib.ece:>24.4f} {p['calibration']['ece']:>24.4f}",
        "",
        f"DP: {r['privacy']['mechanism']} Gaussian mechanism, sigma = {r['privacy']['sigma']:.4f}; the sensitivity "
        f"estimate was found at l1 distance {r['l2_sensitivity']['l1_distance']} with "
        f"{r['l2_sensitivity']['n_breaks']} histogram breaks",
        "",
        repr(roc),
        "",
        repr(calib),
    ]
    if r["warnings"]:
        lines += ["", "Warnings:"] + [f"  - {w}" for w in r["warnings"]]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(run_demo(Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out"))["text"])
