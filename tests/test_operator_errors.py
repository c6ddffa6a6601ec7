"""What a hospital's IT and an analyst meet before any process runs: one clear line for every mistake
(naming the CSV column and rows, the flag, the file), keys for one party at a time, results labelled
by how they were made, and the tables and plots a statistician opens."""

from __future__ import annotations

import csv
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate
from scipy.special import ndtr

import secagg_roc as sr
from secagg_roc.cli import main
from secagg_roc.deploy.config_read import load_study
from secagg_roc.deploy.config_write import loopback_study
from secagg_roc.deploy.pki import load_certificate
from secagg_roc.deploy.revocation import RevocationList, read_crl
from secagg_roc.deploy.site_check import site_check
from secagg_roc.deploy.site_data import load_site_data
from secagg_roc.errors import ConfigError
from secagg_roc.exports import calibration_rows, roc_rows, write_plots, write_tables
from secagg_roc.stats.bands import roc_band, wilson_interval

ROOT = Path(__file__).resolve().parent.parent


def write_rows(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def hospital_rows(n: int, seed: int) -> list[list[object]]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    p = np.clip(0.3 + 0.4 * y + rng.normal(0, 0.15, n), 0.01, 0.99).round(4)
    return [[int(a), float(b), float(c), float(d)] for a, b, c, d in zip(y, p, rng.normal(55, 9, n).round(1),
                                                                         rng.normal(25, 8, n).round(1))]


def study_with(tmp_path: Path, rows: list[list[object]]) -> Path:
    """A two-hospital study whose hospital-a CSV holds `rows` (columns outcome_2y, model_prob, age, tsize)."""
    header = ["outcome_2y", "model_prob", "age", "tsize"]
    write_rows(tmp_path / "data" / "hospital-a.csv", header, rows)
    write_rows(tmp_path / "data" / "hospital-b.csv", header, hospital_rows(40, 2))
    loopback_study(tmp_path, ["hospital-a", "hospital-b"], 2, [1, 2],
                   columns={"y": "outcome_2y", "score": "model_prob", "X": ["age", "tsize"]},
                   policy={"roles": {"label": ["y"], "score": ["score"], "covariate": ["X"]}})
    return tmp_path / "study.toml"


# --------------------------------------------------------------------------- item 4: CSV errors name column and rows


def test_site_check_names_the_csv_column_and_the_rows_to_fix(tmp_path: Path) -> None:
    rows = hospital_rows(40, 1)
    rows[2][0], rows[6][0] = 2, 2  # labels 0/2
    rows[4][1] = 1.7  # a score out of range
    study = study_with(tmp_path, rows)
    text, clean = site_check(study, "hospital-a", state_path=tmp_path / "none.sqlite")
    assert not clean
    label = next(line for line in text.splitlines() if line.startswith("  label 'y':"))
    assert "CSV column 'outcome_2y'" in label and "data rows 3, 7" in label and "(2 records)" in label
    score = next(line for line in text.splitlines() if line.startswith("  score 'score':"))
    assert "1 score(s) outside" in score and "data rows 5" in score and "CSV column 'model_prob'" in score
    assert "CSV columns 'age', 'tsize'" in text
    assert "a class of label" not in text  # a 0/2 label is a label problem, not a small class
    assert "1.7" not in text  # rows and counts for the operator, never the values


def test_site_check_tells_the_operator_of_a_near_copy_its_runs_would_refuse(tmp_path: Path) -> None:
    # tsize is 0.5 * age + 3 but in one row: a GLM over both would give that row's discrepancy; the operator
    # sees it before any run, with the columns named and no value.
    rows = hospital_rows(40, 1)
    for r in rows:
        r[3] = round(0.5 * r[2] + 3, 2)
    rows[10][3] += 4.0
    text, clean = site_check(study_with(tmp_path, rows), "hospital-a", state_path=tmp_path / "none.sqlite")
    section = text.split("small groups and near copies")[1]
    assert "X[0]" in section and "X[1]" in section and "fewer than 5 records" in section, text
    assert str(rows[10][3]) not in text and str(rows[10][2]) not in text


def test_csv_problems_list_every_bad_row_and_a_header_only_file_is_refused(tmp_path: Path) -> None:
    rows = hospital_rows(12, 1)
    rows[4][1], rows[8][1] = "NaN", ""
    path = write_rows(tmp_path / "a.csv", ["outcome_2y", "model_prob", "age", "tsize"], rows)
    with pytest.raises(ConfigError, match=r"column 'model_prob', 2 cells to fix: data row 5: 'NaN' is not a finite "
                                          r"number; data row 9: '' is not a number"):
        load_site_data(path, {"score": "model_prob"})
    empty = write_rows(tmp_path / "b.csv", ["outcome_2y", "model_prob"], [])
    with pytest.raises(ConfigError, match="has a header row but no data rows"):
        load_site_data(empty, {"y": "outcome_2y"})
    study = study_with(tmp_path / "s", [])
    assert main(["site", "check", "--study", str(study), "--name", "hospital-a"]) == 2


# --------------------------------------------------------------------------- items 2, 9: command-line mistakes


def test_command_line_mistakes_are_one_line_naming_the_flag(tmp_path: Path, capsys) -> None:
    study = study_with(tmp_path, hospital_rows(40, 1))
    (tmp_path / "taken").write_text("a file")
    cases = [
        (["analyze", "--study", str(study), "--out", str(tmp_path / "taken")], "--out", "is a file, not a folder"),
        (["demo", "--embedded", "--out", "/proc/nope"], "--out /proc/nope", "cannot make this folder"),
        (["analyze", "--study", str(study), "--out", str(tmp_path / "o"), "--epsilon", "1"],
         "--epsilon 1 needs --delta too", ""),
        (["analyze", "--study", str(study), "--out", str(tmp_path / "o"), "--epsilon", "none", "--delta", "0.1"],
         "--epsilon none", "leave out --delta"),
        (["analyze", "--study", str(study), "--out", str(tmp_path / "o"), "--delta", "0.1"],
         "--delta needs a numeric --epsilon", ""),
    ]
    for argv, flag, problem in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and flag in err and problem in err, (argv, err)
        assert "Traceback" not in err and "keyword" not in err
    # A refusal names the setting as the study file spells it, not only a Python keyword.
    with pytest.raises(sr.PolicyError, match=r"allow_non_private = true in \[policy\].*--allow-non-private"):
        sr.roc_glm(sr.Study.local({"a": {"y": [0, 1] * 5, "s": [0.5] * 10}, "b": {"y": [0, 1] * 5, "s": [0.5] * 10}}),
                   "y", "s", epsilon=None)
    with pytest.raises(SystemExit) as done:
        main(["sum-demo", "--aggregators", "1"])
    assert done.value.code == 2 and "must be at least 2" in capsys.readouterr().err


def _help_of(script: Path) -> tuple[object, str]:
    """Run a benchmark script with --help in this process: (its exit code, what it printed)."""
    import contextlib
    import io
    import runpy

    out, argv, path = io.StringIO(), sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(script), "--help"], [str(script.parent)]  # as `python script --help` would
    try:
        with contextlib.redirect_stdout(out):
            try:
                runpy.run_path(str(script), run_name="__main__")
                code: object = None
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.argv, sys.path[:] = argv, path
    return code, out.getvalue()


def test_help_texts_promise_what_is_written_and_mention_no_issue(capsys) -> None:
    # In this process: each script's imports are shared, so the 14 scripts take ~1 s, not ~15 s of subprocesses.
    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0 and "report.txt, report.json" in capsys.readouterr().out
    scripts = sorted((ROOT / "benchmarks").glob("[!_]*.py"))
    assert len(scripts) >= 10
    for script in scripts:
        code, text = _help_of(script)
        assert code in (0, None) and "usage:" in text and "issue" not in text.lower(), (script.name, code, text[-300:])


def _every_parser(parser, path=()):
    """(command path, parser) for the CLI's parser and every subcommand's, nested ones included."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _every_parser(child, path + (name,))


def test_every_subcommands_help_mentions_no_issue() -> None:
    from secagg_roc.cli import build_parser

    seen = {" ".join(path): parser.format_help() for path, parser in _every_parser(build_parser())}
    assert {"demo", "keys", "site", "simulate", "analyze", "status"} <= set(seen), sorted(seen)
    bad = [path for path, text in seen.items() if re.search(r"\bissue", text, re.IGNORECASE)]
    assert bad == [], f"help texts using the barred word: {bad}"

# --------------------------------------------------------------------------- item 5: keys for one party


def test_keys_add_one_party_and_revoke_one_certificate(tmp_path: Path, capsys) -> None:
    study = study_with(tmp_path, hospital_rows(40, 1))
    assert main(["keys", "--study", str(study)]) == 0
    config = load_study(study)
    before = {f: f.read_bytes() for f in tmp_path.rglob("*.pem")}
    assert read_crl(config.ca_crl, load_certificate(config.ca_cert.read_bytes())) == {}  # an empty list to start
    # A hospital joins: the study file gets a [[sites]] table, keys are issued for it alone.
    raw = tomllib.loads(study.read_text())
    raw["sites"].append({"name": "hospital-c", "data": "data/hospital-c.csv", "columns": raw["sites"][0]["columns"]})
    from secagg_roc.deploy.config_write import write_study

    write_study(raw, study)
    assert main(["keys", "--study", str(study)]) == 2
    assert "secagg-roc keys add NAME" in capsys.readouterr().err
    assert main(["keys", "add", "hospital-c", "--study", str(study)]) == 0
    assert "issued site 'hospital-c'" in capsys.readouterr().out
    assert (tmp_path / "keys" / "hospital-c" / "key.pem").exists()
    assert all(f.read_bytes() == b for f, b in before.items())  # no other party's file changed
    assert main(["keys", "add", "hospital-a", "--study", str(study)]) == 2
    assert "keys revoke hospital-a" in capsys.readouterr().err
    # Revoke hospital-a: its serial goes on crl.pem; then it gets new keys.
    old = load_certificate((tmp_path / "keys" / "hospital-a" / "cert.pem").read_bytes())
    assert main(["keys", "revoke", "hospital-a", "--study", str(study)]) == 0
    assert f"serial {old.serial_number:x}) revoked" in capsys.readouterr().out
    assert set(read_crl(config.ca_crl, load_certificate(config.ca_cert.read_bytes()))) == {old.serial_number}
    assert main(["keys", "add", "hospital-a", "--study", str(study), "--replace"]) == 0
    new = load_certificate((tmp_path / "keys" / "hospital-a" / "cert.pem").read_bytes())
    assert new.serial_number != old.serial_number and new.issuer == old.issuer


def test_a_revocation_list_that_disappears_or_rolls_back_un_revokes_nobody(tmp_path: Path, capsys) -> None:
    study = study_with(tmp_path, hospital_rows(40, 1))
    assert main(["keys", "--study", str(study)]) == 0
    config = load_study(study)
    older = config.ca_crl.read_bytes()  # the empty list `keys` wrote
    serial = load_certificate((tmp_path / "keys" / "hospital-a" / "cert.pem").read_bytes()).serial_number
    revoked = RevocationList(config.ca_crl, config.ca_cert, check_every=0.0)
    assert revoked.serials == frozenset()
    assert main(["keys", "revoke", "hospital-a", "--study", str(study)]) == 0
    revoked.refresh(force=True)
    assert revoked.serials == {serial}
    config.ca_crl.write_bytes(older)  # an older, validly signed list
    revoked.refresh(force=True)
    assert revoked.serials == {serial}
    config.ca_crl.unlink()  # or none at all
    revoked.refresh(force=True)
    assert revoked.serials == {serial}


# --------------------------------------------------------------------------- item 6: the plaintext baseline


def test_the_plaintext_baseline_is_labelled_non_private_everywhere() -> None:
    rng = np.random.default_rng(0)
    data = {f"s{i}": {"y": rng.integers(0, 2, 60), "score": rng.random(60)} for i in range(3)}
    study = sr.Study.local(data, scheme="plaintext", roles={"label": ["y"], "score": ["score"], "covariate": ["score"]},
                           dp={"epsilon": 0.5, "delta": 0.3, "l2_sensitivity": 0.1049})
    roc = sr.roc_glm(study, "y", "score")
    results = [roc, sr.brier_score(study, "y", "score"), sr.calibration_curve(study, "y", "score"),
               sr.fit_glm(study, "y", "score")]
    for r in results:
        assert r.mode == "trusted-host" and r.private is False and "NON-PRIVATE trusted-host" in r.to_dict()["note"]
    text = repr(roc)
    assert "differentially private" not in text and "NON-PRIVATE trusted-host baseline" in text
    assert "l2-sensitivity = 0.1049," in text  # not 0.10490000000000001
    # The additive scheme is private, as before.
    private = sr.Study.local(data, roles={"label": ["y"], "score": ["score"]},
                             dp={"epsilon": 0.5, "delta": 0.3, "l2_sensitivity": 0.05})
    assert sr.roc_glm(private, "y", "score").private and sr.brier_score(private, "y", "score").private


# --------------------------------------------------------------------------- exports a statistician expects


@pytest.fixture(scope="module")
def validated():
    rng = np.random.default_rng(5)
    data = {}
    for i in range(3):
        y = rng.integers(0, 2, 150)
        data[f"h{i}"] = {"y": y, "score": 1 / (1 + np.exp(-(rng.normal(size=150) + 1.2 * y - 0.6)))}
    study = sr.Study.local(data, allow_non_private=True, seed=1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sr.roc_glm(study, "y", "score", epsilon=None), sr.calibration_curve(study, "y", "score")


def test_the_roc_band_spans_the_auc_interval(validated) -> None:
    roc, _ = validated
    lo, hi = (integrate.quad(lambda t, k=k: float(roc_band(roc, np.array([t]))[k][0]), 0, 1)[0] for k in (0, 1))
    assert (lo, hi) == pytest.approx(roc.ci, abs=1e-6)  # the band's curves have the CI's AUCs
    t = np.linspace(0.01, 0.99, 50)
    band_lo, band_hi = roc_band(roc, t)
    assert np.all(band_lo <= roc.roc(t)) and np.all(roc.roc(t) <= band_hi)


def test_wilson_interval_matches_the_textbook() -> None:
    lo, hi = wilson_interval(np.array([0.2]), np.array([10.0]), 0.05)
    assert (lo[0], hi[0]) == pytest.approx((0.0567, 0.5098), abs=1e-4)  # Wilson 1927; e.g. Agresti & Coull 1998
    assert np.isnan(wilson_interval(np.array([np.nan]), np.array([np.nan]))[0][0])
    # Shares of exactly 0 or 1 (a bin of all positives): the limits hold the share, never a hair past it.
    share = np.array([0.0, 1.0, 1.0, 0.0877])
    lo, hi = wilson_interval(share, np.array([50.0, 229.0, 121.0, 114.0]))
    assert np.all(lo <= share) and np.all(share <= hi) and lo[0] == 0.0 and hi[1] == 1.0
    assert float(ndtr(0)) == 0.5


def test_csv_tables_and_plots_in_every_format(validated, tmp_path: Path) -> None:
    roc, curve = validated
    files = write_tables(tmp_path, roc, curve)
    assert [f.name for f in files] == ["roc.csv", "roc_empirical.csv", "calibration.csv"]
    with open(tmp_path / "roc.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 101 and set(table[0]) == {"fpr", "tpr", "tpr_band_lower", "tpr_band_upper"}
    assert float(table[50]["tpr"]) == pytest.approx(float(roc.roc(0.5)))
    rows = calibration_rows(curve)
    released = [r for r in rows if r["released"] == "yes"]
    assert released and all(r["observed_lower"] <= r["observed"] <= r["observed_upper"] for r in released)
    assert len(roc_rows(roc, 11)) == 11
    plots = write_plots(tmp_path, roc, curve, ("png", "svg", "pdf"))
    assert sorted(p.name for p in plots) == sorted(f"{k}.{x}" for k in ("roc", "calibration") for x in ("png", "svg", "pdf"))
    svg = (tmp_path / "calibration.svg").read_text()
    assert "n=" in svg and (tmp_path / "roc.pdf").read_bytes().startswith(b"%PDF")


# --------------------------------------------------------------------------- item 8: the study file for operators


def test_the_operators_study_file_example_runs_as_written(tmp_path: Path, capsys) -> None:
    doc = (ROOT / "docs" / "study-file.md").read_text()
    toml_text, commands = re.search(r"```toml\n(.*?)```\s*```bash\n(.*?)```", doc, re.S).groups()
    (tmp_path / "study.toml").write_text(toml_text)
    for site, seed in (("hospital-a", 1), ("hospital-b", 2)):
        rows = [[a, b, c, d, round(10 * d) % 7] for a, b, c, d in hospital_rows(60, seed)]
        write_rows(tmp_path / "data" / f"{site}.csv", ["outcome_2y", "model_prob", "age", "tsize", "pnodes"], rows)
    ran = 0
    for line in commands.splitlines():
        argv = line.split("#")[0].split()
        if argv[:2] == ["secagg-roc", "keys"] or argv[:3] == ["secagg-roc", "site", "check"]:
            argv = [a if a != "study.toml" else str(tmp_path / "study.toml") for a in argv[1:]]
            assert main(argv) == 0, capsys.readouterr()
            ran += 1
    assert ran == 2 and "no problems: the site is ready" in capsys.readouterr().out
    documented = set(re.findall(r"^\| `([a-z_]+)`", doc, re.M))
    assert {"bind", "bind_port", "ca_crl", "allowed_queries", "min_cell_count", "round_timeout_s"} <= documented
    readme = (ROOT / "README.md").read_text()
    assert "docs/study-file.md" in readme


def test_roles_read_as_english(tmp_path: Path) -> None:
    from secagg_roc.deploy.tls import AuthError, authorize

    with pytest.raises(AuthError, match="peer 'agg-1' is an aggregator; this endpoint accepts only site"):
        authorize(("s", "aggregator", "agg-1"), "s", {"site"}, {"agg-1"})
    with pytest.raises(ConfigError, match="'agg-1' is an aggregator of study 'loopback', not a site"):
        site_check(loopback_study(tmp_path, ["a", "b"], 2, [1, 2]), "agg-1")
