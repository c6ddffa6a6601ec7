"""`compare_schemes` and `secagg-roc compare`: every threat model on the same analysis, side by side."""

import json

import numpy as np
import pytest

import secagg_roc as sr
from secagg_roc.cli import main
from secagg_roc.compare import SchemeSetup, compare_schemes
from secagg_roc.datasets import load_asah


@pytest.fixture(scope="module")
def asah_sites():
    a = load_asah()
    y, s = (a["outcome"] == "Poor").astype(np.int64), a["s100b"] / a["s100b"].max()
    return {f"h{i}": {"y": y[p], "score": s[p]} for i, p in enumerate(np.array_split(np.arange(y.size), 3))}


@pytest.fixture(scope="module")
def comparison(asah_sites):
    policy = sr.Policy(roles={"label": ["y"], "score": ["score"]},
                       dp=sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=1, budget_delta=0.9))
    return compare_schemes(asah_sites, policy=policy,
                           schemes=["plaintext", "additive:2", "shamir:4:2", "replicated"], seed=5)


def test_every_row_is_a_scheme_under_a_privacy_model(comparison):
    assert [(r.scheme, r.privacy) for r in comparison.rows] == [
        (s, p) for s in ("plaintext", "additive 2-of-2", "shamir 2-of-4", "replicated") for p in ("exact", "dp")]


def test_exact_rows_match_the_pooled_computation_and_dp_rows_agree_across_schemes(comparison):
    exact = [r for r in comparison.rows if r.privacy == "exact"]
    dp = [r for r in comparison.rows if r.privacy == "dp"]
    for r in exact:
        assert max(r.errors.values()) < 1e-9, (r.scheme, r.errors)
    # The same seed gives the same DP noise: the scheme changes who learns what, never the numbers.
    for r in dp[1:]:
        np.testing.assert_allclose(r.results["auc"], dp[0].results["auc"], atol=1e-9)
        np.testing.assert_allclose(r.results["ci"], dp[0].results["ci"], atol=1e-9)
    assert dp[0].errors["auc"] > 1e-6  # the DP release moved the AUC


def test_rows_state_the_threat_model_and_what_each_party_learned(comparison):
    by = {(r.scheme, r.privacy): r for r in comparison.rows}
    plain, additive = by[("plaintext", "exact")], by[("additive 2-of-2", "exact")]
    shamir, replicated = by[("shamir 2-of-4", "dp")], by[("replicated", "dp")]
    assert plain.threat["max_colluding_servers"] == 0 and "in the clear" in plain.learned["aggregator"]["in_clear"]
    assert additive.threat["max_colluding_servers"] == 1 and additive.threat["server_dropouts"] == 0
    assert shamir.threat["server_dropouts"] == 2 and shamir.threat["max_colluding_servers"] == 1
    assert replicated.threat["malicious"]["aggregator alters its aggregate share"] == "detected"
    assert "exact scores" in additive.learned["analyst"]["in_clear"]
    assert "DP-noised" in shamir.learned["analyst"]["in_clear"]
    # From the transcripts: aggregators receive shares, never a release; the analyst receives releases.
    assert "InputShare" in additive.learned["aggregator"]["kinds"]
    assert "AggregateShare" not in additive.learned["aggregator"]["kinds"]
    assert "AggregateShare" in additive.learned["analyst"]["kinds"]
    assert shamir.learned["analyst"]["per_site_releases"] > 0


def test_costs_are_measured_and_follow_the_schemes(comparison):
    by = {(r.scheme, r.privacy): r for r in comparison.rows}
    plain, additive = by[("plaintext", "exact")].costs, by[("additive 2-of-2", "exact")].costs
    shamir, replicated = by[("shamir 2-of-4", "exact")].costs, by[("replicated", "exact")].costs
    assert plain["rounds"] == additive["rounds"] == shamir["rounds"] > 0
    # A site uploads one vector (plaintext), one vector and a seed (additive), 2n field vectors (Shamir),
    # three pairs of vectors (replicated).
    assert plain["bytes_sent"]["site"] < additive["bytes_sent"]["site"] < replicated["bytes_sent"]["site"]
    assert replicated["bytes_sent"]["site"] < shamir["bytes_sent"]["site"]
    assert all(r.costs["seconds"] > 0 for r in (by[k] for k in by))


def test_markdown_json_and_plot(comparison, tmp_path):
    md = comparison.to_markdown()
    assert md.count("\n| ") == len(comparison.rows) + 1 and "shamir 2-of-4" in md
    data = json.loads(comparison.to_json())
    assert len(data["rows"]) == 8 and data["reference"]["records"] == 113
    pytest.importorskip("matplotlib")
    comparison.plot(str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_scheme_setup_parsing():
    assert SchemeSetup.parse("shamir:5:3") == SchemeSetup("shamir", 5, 3)
    assert SchemeSetup.parse("shamir:5:3").label == "shamir 3-of-5"
    with pytest.raises(ValueError, match="threshold must be in 2..5"):
        SchemeSetup.parse("shamir:5:1")
    with pytest.raises(ValueError, match="unknown sharing scheme"):
        SchemeSetup.parse("magic")
    with pytest.raises(ValueError, match="NAME"):
        SchemeSetup.parse("additive:x")


def test_dp_model_needs_dp_settings(asah_sites):
    with pytest.raises(ValueError, match="needs a policy with DP"):
        compare_schemes(asah_sites, policy=sr.Policy(roles={"label": ["y"], "score": ["score"]}))


def test_cli_compare_writes_files_from_a_csv(tmp_path, capsys, asah_sites):
    rows = ["site,y,score"] + [f"{site},{y},{float(s)!r}" for site, d in asah_sites.items()
                               for y, s in zip(d["y"], d["score"])]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    code = main(["compare", "--data", str(tmp_path / "d.csv"), "--schemes", "additive,shamir:3:2",
                 "--privacy", "exact", "--out", str(tmp_path / "out")])
    assert code == 0
    out = capsys.readouterr().out
    assert "shamir 2-of-3" in out and "additive 2-of-2" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"compare.json", "compare.md"}


def test_cli_compare_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["compare", "--schemes", "shamir:9:1", "--data", "asah"]) == 2
    assert "threshold must be in 2..9" in capsys.readouterr().err
    assert main(["compare", "--data", str(tmp_path / "nope.csv")]) == 2
    assert "not 'usecase', 'asah' or an existing CSV file" in capsys.readouterr().err


def test_histogram_and_secure_auc_rows(asah_sites):
    # A grid finer than the closest two distinct scores puts each score in a bucket of its own (2**20
    # buckets proved the same at 15 s per scheme): the histogram's AUC is then the empirical one exactly.
    bins = 2**12
    scores = np.unique(np.concatenate([site["score"] for site in asah_sites.values()]))
    assert 1 / bins < np.diff(scores).min() / 4
    policy = sr.Policy(roles={"label": ["y"], "score": ["score"]}, min_cell_count=1, histogram_bins=bins,
                       dp=sr.DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=5, budget_delta=0.9))
    c = compare_schemes(asah_sites, policy=policy, schemes=["additive", "shamir:3:2"], privacy=["exact"],
                        analyses=["histogram", "secure_auc"])
    additive, shamir = c.rows
    # Scores on a fine grid, no cell withheld: both equal the pooled empirical AUC.
    assert additive.errors["histogram_auc"] < 1e-12 and additive.errors["secure_auc"] < 1e-12
    assert shamir.errors["histogram_auc"] < 1e-12
    assert shamir.results["secure_auc"].startswith("not run") and "secure_auc" not in shamir.errors
    assert "histogram_auc" in c.to_markdown() and "not run" in c.to_markdown()
    with pytest.raises(ValueError, match="unknown privacy model or analysis"):
        compare_schemes(asah_sites, policy=policy, analyses=["magic"])
