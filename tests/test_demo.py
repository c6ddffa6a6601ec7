"""The paper's use case end to end: report, plots and JSON; distributed beside pooled."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from secagg_roc.demo import gbsg2_two_year, proportional_sizes, run_demo  # noqa: E402


def test_two_year_label_and_site_sizes():
    X, y, dropped = gbsg2_two_year()
    assert X.shape == (y.size, 8)
    assert y.size + dropped == 686
    assert dropped > 0 and set(y.tolist()) == {0, 1}
    assert proportional_sizes(274) == [56, 49, 60, 49, 60]
    assert sum(proportional_sizes(249)) == 249


def test_run_demo_writes_report_and_plots(tmp_path):
    report = run_demo(tmp_path, seed=0)
    for name in ("report.json", "roc.png", "calibration.png"):
        assert (tmp_path / name).stat().st_size > 500
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["data"]["dropped_censored_before_730"] == report["data"]["dropped_censored_before_730"]
    assert saved["data"]["privacy_level"] == 5 and len(saved["data"]["site_sizes"]) == 5

    roc = report["roc_glm"]
    assert roc["mode"] == "dp"
    # Privacy parameters follow the paper's table for the estimated sensitivity.
    eps, delta = report["privacy"]["epsilon"], report["privacy"]["delta"]
    assert (eps, delta) in {(0.2, 0.1), (0.3, 0.4), (0.5, 0.3), (0.5, 0.5)}
    assert 0 < report["l2_sensitivity"]["value"] < 0.2
    # Distributed results are close to the pooled ones and of the paper's magnitude.
    ref = report["pooled"]["roc_glm"]
    assert abs(roc["auc"] - ref["auc"]) < 0.03
    assert roc["ci"][0] < roc["auc"] < roc["ci"][1]
    assert 0.6 < roc["auc"] < 0.85
    assert report["brier"] == pytest.approx(report["pooled"]["brier"], abs=1e-9)
    assert 0.1 < report["brier"] < 0.25
    assert 0 <= report["test"]["p_value"] <= 1 and report["test"]["a0"] == 0.6
    cal = report["calibration"]
    assert cal["released"] == report["pooled"]["calibration"]["released"]
    text = report["text"]
    for piece in ("l2-sensitivity", "(epsilon, delta)", "Binormal form: pnorm(", "AUC and 0.95 CI", "Brier", "dropped"):
        assert piece in text
    assert "site processes on 127.0.0.1" in report["deployment"]["parties"]


def test_deployed_and_embedded_demo_agree(tmp_path):
    """The same seed gives the same numbers whether the parties are processes or objects."""
    deployed = run_demo(tmp_path / "deployed", seed=3)
    embedded = run_demo(tmp_path / "embedded", seed=3, deployed=False)
    assert embedded["deployment"]["parties"].startswith("embedded")
    for key in ("auc", "params", "ci"):
        assert deployed["roc_glm"][key] == embedded["roc_glm"][key]
    assert deployed["brier"] == embedded["brier"]
    assert deployed["calibration"]["released"] == embedded["calibration"]["released"]
