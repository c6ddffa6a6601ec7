"""The study file: writing and reading it back, defaults, and every validation error."""

from __future__ import annotations

import copy
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from secagg_roc.deploy import config as cfg
from secagg_roc.deploy.config import (
    ColumnMap,
    StudyConfig,
    is_valid_name,
    load_study,
    loopback_study,
    write_study,
)
from secagg_roc.errors import ConfigError
from secagg_roc.policy import DPPolicy, Policy


def base_study() -> dict[str, Any]:
    """A valid study in its TOML shape, with every optional key left out."""
    return {
        "study": {"id": "s1"},
        "aggregators": [
            {"name": "agg-1", "host": "127.0.0.1", "port": 9001},
            {"name": "agg-2", "host": "agg2.example.org", "port": 9002},
        ],
        "sites": [
            {"name": "site-a", "data": "data/a.csv", "columns": {"y": "label", "score": "pred"}},
            {"name": "site-b", "data": "/srv/b.csv", "columns": {"y": "label", "score": "pred",
                                                                  "X": ["age", "size"]},
             "allowed_queries": ["calibration.brier"]},
        ],
        "analyst": {"name": "analyst"},
    }


# ---------------------------------------------------------------------------
# Round trips and defaults


def test_defaults_and_path_resolution(tmp_path: Path) -> None:
    config = write_study(base_study(), tmp_path / "study.toml")
    assert config == load_study(tmp_path / "study.toml")
    assert (config.privacy_level, config.min_sites, config.frac_bits) == (5, 2, 32)
    assert config.max_body_bytes == 64 * 1024 * 1024
    assert config.round_timeout_s > 0 and config.max_open_rounds >= 1
    assert config.ca_cert == tmp_path / "ca.pem"
    assert config.ca_key == tmp_path / "keys/_ca/key.pem"
    agg1, agg2 = config.aggregators
    assert agg1.cert == tmp_path / "keys/agg-1/cert.pem"
    assert agg1.key == tmp_path / "keys/agg-1/key.pem"
    assert agg1.database == tmp_path / "state/agg-1.sqlite"
    assert agg1.url == "https://127.0.0.1:9001"
    site_a, site_b = config.sites
    assert site_a.data == tmp_path / "data/a.csv"
    assert site_b.data == Path("/srv/b.csv")
    assert site_a.allowed_queries is None and site_b.allowed_queries == ("calibration.brier",)
    assert site_b.columns["X"] == ("age", "size") and site_b.columns["y"] == "label"
    assert config.analyst.key == tmp_path / "keys/analyst/key.pem"
    assert config.known_names() == {"aggregator": {"agg-1", "agg-2"},
                                    "site": {"site-a", "site-b"}, "analyst": {"analyst"}}
    assert config.party("site-b") is site_b
    # No [policy]: the default policy, with q and min_sites from [study].
    assert config.policy == Policy(privacy_level=5, min_sites=2)
    hash(config)  # frozen all the way down, column maps and the policy included


def test_every_key_round_trips(tmp_path: Path) -> None:
    data = base_study()
    data["study"].update(privacy_level=7, min_sites=2, frac_bits=20, round_timeout_s=12.5,
                         max_body_bytes=4096, max_open_rounds=3, ca_cert="pki/ca.pem",
                         ca_key="/offline/ca-key.pem", handshake_timeout_s=2.5, max_handshakes_per_address=4)
    data["aggregators"][0].update(cert="a1.crt", key="a1.key", database="db/a1.sqlite")
    data["aggregators"][1]["host"] = "::1"
    original = write_study(data, tmp_path / "one" / "study.toml")
    assert original.frac_bits == 20 and original.round_timeout_s == 12.5
    assert (original.handshake_timeout_s, original.max_handshakes_per_address) == (2.5, 4)
    assert original.ca_key == Path("/offline/ca-key.pem")
    assert original.aggregators[1].url == "https://[::1]:9002"
    # Written again elsewhere: paths inside the old folder become absolute, and read back equal.
    again = write_study(original, tmp_path / "two" / "study.toml")
    assert again == original == load_study(tmp_path / "two" / "study.toml")
    # Written into its own folder: relative paths, so the folder can be moved as a unit.
    write_study(original, tmp_path / "one" / "study.toml")
    text = (tmp_path / "one" / "study.toml").read_text()
    assert 'cert = "a1.crt"' in text and str(tmp_path) not in text
    moved = tmp_path / "moved"
    (tmp_path / "one").rename(moved)
    assert load_study(moved / "study.toml").aggregators[0].cert == moved / "a1.crt"


FULL_POLICY = {
    "min_cell_count": 3, "allow_dropouts": True, "allow_non_private": True,
    "analyses": ["rocglm", "brier", "calibration", "sensitivity"], "score_range": [-1, 2.5],
    "calibration_bins": 8, "rocglm_thresholds": 25, "rocglm_fit": "released", "sensitivity_resolution": 0.001,
    "histogram_bins": 200, "roles": {"label": ["y"], "score": "pred", "covariate": ["X", "age"]},
    "dp": {"epsilon": 0.5, "delta": 0.3, "l2_sensitivity": 0.05, "mechanism": "classic",
           "budget_epsilon": 1.5, "budget_delta": 0.6, "accounting": "basic"},
}


def test_the_policy_table_round_trips(tmp_path: Path) -> None:
    data = base_study()
    data["study"].update(privacy_level=7, min_sites=2)
    data["policy"] = copy.deepcopy(FULL_POLICY)
    config = write_study(data, tmp_path / "study.toml")
    expected = Policy(privacy_level=7, min_sites=2, min_cell_count=3, allow_dropouts=True, allow_non_private=True,
                      analyses=("rocglm", "brier", "calibration", "sensitivity"), score_range=(-1.0, 2.5),
                      calibration_bins=8, rocglm_thresholds=25, rocglm_fit="released", sensitivity_resolution=0.001,
                      histogram_bins=200,
                      roles={"label": ("y",), "score": ("pred",), "covariate": ("X", "age")},
                      dp=DPPolicy(0.5, 0.3, 0.05, mechanism="classic", budget_epsilon=1.5, budget_delta=0.6,
                                  accounting="basic"))
    assert config.policy == expected and config.policy.digest() == expected.digest()
    again = load_study(tmp_path / "study.toml")
    assert again == config and again.policy.digest() == expected.digest()
    text = (tmp_path / "study.toml").read_text()
    assert "[policy]" in text and "[policy.dp]" in text and "[policy.roles]" in text
    assert "privacy_level" not in text.split("[policy]")[1]  # q is written once, in [study]
    # Every party reading the same file gets the same policy (and so the same digest).
    assert write_study(again, tmp_path / "copy" / "study.toml").policy.digest() == expected.digest()
    # A policy given as a `Policy` to loopback_study: its q and min_sites go to [study].
    loop = loopback_study(tmp_path / "lb", ["h1", "h2"], 2, [7001, 7002], policy=expected)
    assert loop.policy == expected and loop.privacy_level == 7
    with pytest.raises(ConfigError, match="privacy_level = 3 differs from the policy's 7"):
        loopback_study(tmp_path / "lb2", ["h1", "h2"], 2, [7001, 7002], policy=expected, privacy_level=3)


def test_every_policy_field_the_writer_writes_the_reader_takes() -> None:
    # `policy_table` writes whatever `Policy.to_dict` holds; a field the reader did not take made every study
    # file written from such a policy unreadable (histogram_bins, until the eleventh session).
    from secagg_roc.deploy.config_policy import DP_KEYS, POLICY_IN_STUDY, POLICY_KEYS

    policy = Policy(roles={"label": ("y",), "score": ("p",)}, histogram_bins=64, calibration_strategy="quantile",
                    rocglm_fit="released", dp=DPPolicy(0.5, 0.3, 0.05, budget_epsilon=2.0, budget_delta=0.6))
    written = policy.to_dict()
    assert set(written) - set(POLICY_IN_STUDY) <= set(POLICY_KEYS)
    assert set(written["dp"]) <= set(DP_KEYS)


def test_a_study_config_agrees_with_its_policy(tmp_path: Path) -> None:
    import dataclasses

    config = write_study(base_study(), tmp_path / "study.toml")
    with pytest.raises(ConfigError, match="they are one setting, given in \\[study\\]"):
        dataclasses.replace(config, privacy_level=9)


def test_documented_example_is_valid(tmp_path: Path) -> None:
    doc = cfg.__doc__
    assert doc is not None
    example = doc.split("Example (")[1].split("::\n", 1)[1].split("\nUnknown keys")[0]
    (tmp_path / "study.toml").write_text(textwrap.dedent(example))
    config = load_study(tmp_path / "study.toml")
    assert config.study_id == "gbsg2-validation"
    assert [s.name for s in config.sites] == ["hospital-a", "hospital-b"]
    assert config.sites[0].columns == {"y": "cens", "score": "pred", "X": ("age", "tsize")}
    policy = config.policy
    assert policy.roles == {"label": ("y",), "score": ("score",), "covariate": ("X",)}
    assert policy.dp is not None and (policy.dp.epsilon, policy.dp.budget_epsilon) == (0.5, 1.0)
    assert policy.privacy_level == config.privacy_level == 5


def test_loopback_study(tmp_path: Path) -> None:
    config = loopback_study(tmp_path, ["h1", "h2", "h3"], n_aggregators=3,
                            data_files=["x.csv", "y.csv", tmp_path / "z.csv"],
                            columns={"y": "cens", "score": "pred", "X": ["age"]},
                            study_id="demo", privacy_level=3, min_sites=3)
    assert config == load_study(tmp_path / "study.toml")
    assert [a.name for a in config.aggregators] == ["agg-1", "agg-2", "agg-3"]
    assert all(a.host == "127.0.0.1" for a in config.aggregators)
    assert len({a.port for a in config.aggregators}) == 3
    assert config.sites[0].data == tmp_path / "x.csv"
    assert config.sites[2].columns["X"] == ("age",)
    assert (config.study_id, config.privacy_level, config.min_sites) == ("demo", 3, 3)

    explicit = loopback_study(tmp_path / "b", ["h1", "h2"], 2, [7001, 7002])
    assert [a.port for a in explicit.aggregators] == [7001, 7002]
    assert explicit.sites[1].data == tmp_path / "b" / "data/h2.csv"


def test_a_pairwise_threshold_of_half_the_sites_warns_naming_the_file_and_the_safe_minimum(tmp_path: Path) -> None:
    import warnings

    from secagg_roc.errors import WeakThresholdWarning

    sites = ["h1", "h2", "h3", "h4", "h5"]
    with pytest.warns(WeakThresholdWarning, match=r"study\.threshold = 2 is at most half of the 5 sites.*safe "
                                                  r"minimum is 3"):
        loopback_study(tmp_path, sites, 1, scheme="pairwise", threshold=2)
    with pytest.warns(WeakThresholdWarning, match=re.escape(str(tmp_path / "study.toml"))):
        load_study(tmp_path / "study.toml")  # every process that reads the study file says so
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeakThresholdWarning)
        loopback_study(tmp_path / "b", sites, 1, scheme="pairwise", threshold=3)
        loopback_study(tmp_path / "c", sites, 1, scheme="pairwise")


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_aggregators=2, ports=[7001]), "2 aggregators need 2 ports"),
    (dict(data_files=["only-one.csv"]), "2 sites but 1 data files"),
    (dict(data_files={"h1": "a.csv"}), "no data file for site(s) h2"),
    (dict(n_aggregators=1), "at least 2 aggregators"),
])
def test_loopback_study_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        loopback_study(tmp_path, ["h1", "h2"], **kwargs)
    assert not (tmp_path / "study.toml").exists()


# ---------------------------------------------------------------------------
# Validation: every error names the file, the key and the problem


def _set(path: str, value: Any):
    """A mutation setting `a.b[0].c`-style `path` in the study dict (value None deletes)."""
    def mutate(d: dict[str, Any]) -> None:
        parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
        target: Any = d
        for p in parts[:-1]:
            target = target[int(p[1:-1])] if p.startswith("[") else target[p]
        last = parts[-1]
        if value is None:
            del target[last]
        else:
            target[last] = value
    return mutate


def _dup_site_name(d: dict[str, Any]) -> None:
    d["sites"][1]["name"] = "AGG-1"


INVALID = [
    (_set("study.id", None), "study.id: is missing"),
    (_set("study.id", "bad id"), "study.id: 'bad id' is not a valid name"),
    (_set("study.privacy_level", 0), "study.privacy_level: must be at least 1, got 0"),
    (_set("study.privacy_level", True), "study.privacy_level: must be an integer, got a boolean"),
    (_set("study.min_sites", 1), "study.min_sites: must be at least 2, got 1"),
    (_set("study.min_sites", 3), "sites: study.min_sites is 3 but only 2 [[sites]] table(s)"),
    (_set("study.frac_bits", 63), "study.frac_bits: must be between 0 and 62, got 63"),
    (_set("study.round_timeout_s", -1.0), "study.round_timeout_s: must be a finite number > 0"),
    (_set("study.round_timeout_s", float("nan")), "study.round_timeout_s: must be a finite number > 0"),
    (_set("study.round_timeout_s", "10"), "study.round_timeout_s: must be a number, got a string"),
    (_set("study.max_body_bytes", 10), "study.max_body_bytes: must be at least 1024, got 10"),
    (_set("study.max_open_rounds", 0), "study.max_open_rounds: must be at least 1, got 0"),
    (_set("study.privacy_levle", 5), "study: unknown key 'privacy_levle'"),
    (_set("study", None), "study: is missing"),
    (_set("study", "s1"), "study: must be a table, got a string"),
    (_set("extra", {}), "top level: unknown key 'extra'"),
    (_set("aggregators", "agg-1"), "aggregators: must be an array of tables"),
    (lambda d: d["aggregators"].pop(), "aggregators: a study needs at least 2 aggregators"),
    (_set("aggregators[1].name", "../etc"), "aggregators[1].name: '../etc' is not a valid name"),
    (_set("aggregators[1].name", None), "aggregators[1].name: is missing"),
    (_set("aggregators[0].host", "no such host!"), "aggregators[0].host: 'no such host!' is neither"),
    (_set("aggregators[0].port", 0), "aggregators[0].port: must be between 1 and 65535, got 0"),
    (_set("aggregators[0].port", 65536), "aggregators[0].port: must be between 1 and 65535, got 65536"),
    (_set("aggregators[0].port", "9001"), "aggregators[0].port: must be an integer, got a string"),
    (_set("aggregators[0].tls", True), "aggregators[0]: unknown key 'tls'"),
    (lambda d: d["aggregators"][1].update(host="localhost", port=9001),
     "aggregators[1].port: localhost:9001 is also where aggregators[0] listens"),
    (_dup_site_name, "sites[1].name: 'AGG-1' is already the name of aggregators[0]"),
    (_set("analyst.name", "site-a"), "analyst.name: 'site-a' is already the name of sites[0]"),
    (_set("analyst", None), "analyst: is missing"),
    (_set("sites[0].data", None), "sites[0].data: is missing"),
    (_set("sites[0].data", ""), "sites[0].data: must be a non-empty path"),
    (_set("sites[0].columns", {}), "sites[0].columns: must be a non-empty table"),
    (_set("sites[0].columns", {"y": 3}), "sites[0].columns.y: must be a CSV column name"),
    (_set("sites[0].columns", {"y": []}), "sites[0].columns.y: must be a CSV column name"),
    (_set("sites[0].columns", {"X": ["a", "a"]}), "sites[0].columns.X: lists a CSV column twice"),
    (_set("sites[0].columns", {"a b": "c"}), "sites[0].columns: array name 'a b' is not a valid"),
    (_set("sites[0].allowed_queries", ["glm.ssd", "glm.ssd"]), "sites[0].allowed_queries: lists a site query twice"),
    (_set("sites[0].allowed_queries", "q"), "sites[0].allowed_queries: must be an array"),
    (_set("sites[0].key", "keys/agg-1/key.pem"), "sites[0].key: "),
    (_set("study.ca_cert", "keys/analyst/cert.pem"), "analyst.cert: "),
    (_set("sites[0].allowed_queries", ["dump"]), "sites[0].allowed_queries: unknown site query 'dump' (known: "
     "calibration.bins, calibration.brier"),
    # the [policy] table
    (_set("policy", "strict"), "policy: must be a table, got a string"),
    (_set("policy", {"privacy_level": 5}), "policy.privacy_level: is set once, as study.privacy_level"),
    (_set("policy", {"min_sites": 3}), "policy.min_sites: is set once, as study.min_sites"),
    # (the known keys are named whichever optional ones the file sets)
    (_set("policy", {"min_cel_count": 3}), "policy: unknown key 'min_cel_count' (known keys here: allow_dropouts, "
     "allow_non_private, analyses, calibration_bins, calibration_strategy, dp, histogram_bins, min_cell_count, "
     "roc"),
    (_set("policy", {"histogram_bins": 0}), "policy.histogram_bins: must be between 1 and 1048576, got 0"),
    (_set("policy", {"rocglm_fit": "noisy"}), "policy.rocglm_fit: must be one of"),
    (_set("policy", {"min_cell_count": 0}), "policy.min_cell_count: must be at least 1, got 0"),
    (_set("study.handshake_timeout_s", 0), "study.handshake_timeout_s: must be a finite number > 0, got 0.0"),
    (_set("study.handshake_timeout_s", 600), "study.handshake_timeout_s: must be at most 120 s"),
    (_set("study.max_handshakes_per_address", 0), "study.max_handshakes_per_address: must be"),
    (_set("policy", {"allow_dropouts": "yes"}), "policy.allow_dropouts: must be true or false, got a string"),
    # (the known analyses grow with the library: the message is held up to their list)
    (_set("policy", {"analyses": ["glm", "dump"]}), "policy.analyses: unknown analysis 'dump' (known: "),
    (_set("policy", {"analyses": "glm"}), "policy.analyses: must be an array of analysis names"),
    (_set("policy", {"score_range": [1, 0]}), "policy.score_range: must be two finite numbers [lower, upper]"),
    (_set("policy", {"calibration_bins": 0}), "policy.calibration_bins: must be between 1 and 10000, got 0"),
    (_set("policy", {"rocglm_thresholds": 2}), "policy.rocglm_thresholds: must be between 3 and 10000, got 2"),
    (_set("policy", {"sensitivity_resolution": -1.0}), "policy.sensitivity_resolution: must be a finite number > 0"),
    (_set("policy", {"roles": {"lable": ["y"]}}), "policy.roles: unknown role 'lable' (roles: label, score, "
     "covariate, weight)"),
    (_set("policy", {"roles": {"label": [1]}}), "policy.roles.label: must be an array of array names"),
    (_set("policy", {"dp": {"epsilon": 0.5, "delta": 0.3}}), "policy.dp.l2_sensitivity: is missing"),
    (_set("policy", {"dp": {"epsilon": 0.5, "delta": 1.0, "l2_sensitivity": 1.0}}),
     "policy.dp.delta: must lie strictly between 0 and 1, got 1.0"),
    (_set("policy", {"dp": {"epsilon": 0.5, "delta": 0.3, "l2_sensitivity": 1.0, "mechanism": "laplace"}}),
     "policy.dp.mechanism: must be one of 'analytic', 'classic', got 'laplace'"),
    (_set("policy", {"dp": {"epsilon": 0.5, "delta": 0.3, "l2_sensitivity": 1.0, "budget": 2.0}}),
     "policy.dp: unknown key 'budget' (known keys here: accounting, budget_delta, budget_epsilon, delta, epsilon, "
     "l2_sensitivity, mechanism)"),
]


@pytest.mark.parametrize("mutate, message", INVALID, ids=[m for _, m in INVALID])
def test_validation_errors_name_file_key_and_problem(tmp_path: Path, mutate, message: str) -> None:
    data = base_study()
    mutate(data)
    target = tmp_path / "study.toml"
    with pytest.raises(ConfigError) as info:
        write_study(data, target)
    assert str(info.value).startswith(f"{target}: ")
    assert message in str(info.value)
    assert not target.exists()  # nothing invalid is ever written


def test_shared_file_message(tmp_path: Path) -> None:
    data = base_study()
    data["sites"][0]["key"] = "keys/agg-1/key.pem"
    with pytest.raises(ConfigError, match=r"sites\[0\]\.key: .*is also aggregators\[0\]\.key"):
        write_study(data, tmp_path / "study.toml")


@pytest.mark.parametrize("text, message", [
    ("[study\nid = 1", "not valid TOML"),
    ('[study]\nid = "x"\nid = "y"', "not valid TOML"),
    ('[study]\nid = "s"\n[analyst]\nname = "a"\n', "aggregators: a study needs at least 2 aggregators"),
    ('[study]\nid = "s"\n[[aggregators]]\nname = "a"\nhost = "h"\nport = 1.5\n',
     "aggregators[0].port: must be an integer, got a number"),
])
def test_load_errors_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_study(path)
    assert str(info.value).startswith(str(path)) and message in str(info.value)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="study file not found"):
        load_study(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_study(tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8|not valid TOML"):
        load_study(tmp_path / "bin.toml")


# ---------------------------------------------------------------------------
# Names and the TOML writer, property-based

NAME_CHARS = st.sampled_from("abcXYZ019_.-")


@given(st.text(max_size=70))
def test_name_rule_on_any_text(name: str) -> None:
    ok = is_valid_name(name)
    assert ok == bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name))
    if ok:
        # A valid name is always a single, safe path component and a URI path segment.
        assert name not in (".", "..") and "/" not in name and not name.startswith(("-", "_", "."))


@pytest.mark.parametrize("name", [".", "..", "-rf", "_ca", "", "a" * 65, "a b", "a/b", "é", "a\n"])
def test_rejected_names(name: str) -> None:
    assert not is_valid_name(name)


@pytest.mark.parametrize("name", ["a", "A.b-c_d", "0", "a" * 64, "hospital-a.eu"])
def test_accepted_names(name: str) -> None:
    assert is_valid_name(name)


valid_names = st.builds(lambda a, b: a + b, st.sampled_from("aZ7"), st.text(NAME_CHARS, max_size=63))
any_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(sites=st.lists(valid_names, min_size=2, max_size=4, unique_by=str.casefold),
       column=any_text, data_file=any_text, study_id=valid_names)
def test_round_trip_any_names_and_strings(tmp_path: Path, sites: list[str], column: str,
                                          data_file: str, study_id: str) -> None:
    # Column names and paths come from users' files: quotes, backslashes, control
    # characters and non-ASCII text must survive the hand-written TOML emitter.
    names = {n.casefold() for n in sites}
    assume(not {"agg-1", "agg-2", "analyst"} & names)
    assume(data_file.strip() != "" and not data_file.startswith("~"))
    data = {"study": {"id": study_id},
            "aggregators": [{"name": "agg-1", "host": "127.0.0.1", "port": 1},
                            {"name": "agg-2", "host": "127.0.0.1", "port": 2}],
            "sites": [{"name": s, "data": data_file, "columns": {"score": column, "X": [column, "z"]
                                                                  if column != "z" else ["z"]}}
                      for s in sites],
            "analyst": {"name": "analyst"}}
    written = write_study(copy.deepcopy(data), tmp_path / "study.toml")
    loaded = load_study(tmp_path / "study.toml")
    assert loaded == written
    assert loaded.study_id == study_id and [s.name for s in loaded.sites] == sites
    assert loaded.sites[0].columns["score"] == column
    assert loaded.sites[0].data == Path(os.path.normpath(tmp_path / data_file))


def test_column_map_is_a_read_only_mapping() -> None:
    cm = ColumnMap({"y": "label", "X": ["a", "b"]})
    assert cm == {"y": "label", "X": ("a", "b")} and cm == {"y": "label", "X": ["a", "b"]}
    assert dict(cm) == {"y": "label", "X": ("a", "b")} and len(cm) == 2
    assert hash(cm) == hash(ColumnMap({"X": ("a", "b"), "y": "label"}))
    with pytest.raises(TypeError):
        cm["z"] = "c"  # type: ignore[index]


def test_unknown_party(tmp_path: Path) -> None:
    config = write_study(base_study(), tmp_path / "study.toml")
    assert isinstance(config, StudyConfig)
    with pytest.raises(ConfigError, match="has no party 'mallory'"):
        config.party("mallory")
