"""The command line: every subcommand has help a newcomer can follow, and the demos run."""

import json
import subprocess
import sys

import pytest

from secagg_roc.cli import build_parser, main

SUBCOMMANDS = ["demo", "sum-demo", "keys", "aggregator", "site", "analyze"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert f"secagg-roc {command}" in text and len(text) > 200


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["frobnicate"])
    assert done.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_sum_demo_prints_every_party(capsys):
    assert main(["sum-demo", "--aggregators", "3"]) == 0
    out = capsys.readouterr().out
    assert "total        [20.5   4.5   1.75]" in out
    for party in ("analyst", "hospital-a", "aggregator-0", "aggregator-2"):
        assert f"  {party}:" in out
    # Three values are split with whole masks from the operating system: every aggregator holds a vector.
    assert "vector [" in out and "PRG seed" not in out


def test_console_script_runs_the_embedded_demo(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "secagg_roc.cli", "demo", "--embedded", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "AUC (ROC-GLM)" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["roc_glm"]["auc"] == pytest.approx(report["pooled"]["roc_glm"]["auc"], abs=0.02)
    assert report["brier"] == pytest.approx(report["pooled"]["brier"], abs=1e-9)
    assert (tmp_path / "roc.png").stat().st_size > 10_000 and (tmp_path / "calibration.png").exists()


@pytest.mark.parametrize("args,shown", [(["--scheme", "shamir", "--aggregators", "4", "--threshold", "2"], "shamir sharing"),
                                        (["--scheme", "replicated"], "replicated sharing"),
                                        (["--scheme", "pairwise", "--threshold", "2"], "AdvertiseKeys")])
def test_sum_demo_under_every_scheme(args, shown, capsys):
    assert main(["sum-demo", *args]) == 0
    out = capsys.readouterr().out
    assert shown in out and "total        [20.5   4.5   1.75]" in out


def test_sum_demo_refuses_a_bad_scheme_or_threshold_in_one_line(capsys):
    assert main(["sum-demo", "--scheme", "magic"]) == 2
    assert "one of additive" in capsys.readouterr().err
    assert main(["sum-demo", "--scheme", "shamir", "--threshold", "9"]) == 2
    assert "threshold must be in 2..3" in capsys.readouterr().err
