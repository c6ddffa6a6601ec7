"""The paper's simulation study (`secagg_roc.simulation`, `secagg-roc simulate`): tasks are determined by
their seeds, a results file resumes (also after a killed run) and refuses another design, the summary
tables equal a hand computation, Dask gives the same lines as a serial run, and the CLI runs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from secagg_roc import simulation as sim
from secagg_roc.cli import main
from secagg_roc.simulation.runner import dumps

SEED = 7
GRID = sim.paper_grid()


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_grid_is_the_papers() -> None:
    assert len(GRID) == 126 and GRID[0].name == "base" and not GRID[0].private
    assert {s.l2_sensitivity for s in GRID[1:]} == {0.01, 0.03, 0.05, 0.07, 0.09}
    assert {s.epsilon for s in GRID[1:]} == {0.1, 0.2, 0.3, 0.4, 0.5} == {s.delta for s in GRID[1:]}
    # expand.grid order: l2-sensitivity varies fastest, then epsilon, then delta.
    assert [(s.l2_sensitivity, s.epsilon, s.delta) for s in GRID[1:3]] == [(0.01, 0.1, 0.1), (0.03, 0.1, 0.1)]
    assert GRID[6].epsilon == 0.2 and GRID[26].delta == 0.2
    assert [s.index for s in sim.parse_settings("0,3-5,125")] == [0, 3, 4, 5, 125]
    assert sim.parse_settings("l2=0.05,eps=0.3,delta=0.2")[0].name == "l2=0.05,eps=0.3,delta=0.2"
    assert len(sim.parse_settings("dp")) == 125
    with pytest.raises(ValueError, match="indices 0-125"):
        sim.parse_settings("126")
    # The classic Gaussian mechanism, as the paper's code: sqrt(2 ln(1.25 / delta)) * l2 / epsilon.
    assert GRID[1].sigma() == pytest.approx(np.sqrt(2 * np.log(1.25 / 0.1)) * 0.01 / 0.1)


def test_data_generation_follows_the_design_and_is_shared_across_settings() -> None:
    y, s = sim.dataset(SEED, 3)
    assert 100 <= y.size <= 2500 and 0.1 <= y.mean() <= 0.9 and s.min() >= 0 and s.max() <= 1
    y2, s2 = sim.dataset(SEED, 3)
    assert np.array_equal(y, y2) and np.array_equal(s, s2)
    assert not np.array_equal(sim.dataset(SEED, 4)[1][:100], s[:100])
    a, b = sim.task_rng(SEED, GRID[1], 3), sim.task_rng(SEED, GRID[2], 3)
    assert a.integers(2**62) != b.integers(2**62)  # the noise differs by setting (the split does not)
    assert sim.auc_bin(0.5) == -1 and sim.auc_bin(0.5001) == 0 and sim.auc_bin(0.525) == 0 and sim.auc_bin(1.0) == 19


def test_every_setting_analyses_the_same_split_of_a_data_set_with_its_own_noise(monkeypatch) -> None:
    """The paper analyses data set i's records under every setting (it never splits them); here each
    setting's study gets the very same five sites' records, split by a generator of the data set alone."""
    from secagg_roc.study import Study

    seen: list[tuple[dict, int]] = []
    local = Study.local

    def spy(data, **options):
        seen.append(({k: {a: np.array(v) for a, v in arrays.items()} for k, arrays in data.items()}, options["seed"]))
        return local(data, **options)

    monkeypatch.setattr(Study, "local", staticmethod(spy))
    for setting in (GRID[0], GRID[1], GRID[125]):
        sim.run_task(SEED, setting, 3)
    y, s = sim.dataset(SEED, 3)
    expected = sim.split_sites(y, s, sim.split_rng(SEED, 3))
    assert len(seen) == 3 and len({seed for _, seed in seen}) == 3  # each setting's own noise seed
    for sites, _ in seen:
        assert list(sites) == [f"site{k}" for k in range(sim.N_SITES)]
        for name, arrays in expected.items():
            assert np.array_equal(sites[name]["y"], arrays["y"]) and np.array_equal(sites[name]["score"], arrays["score"])
    assert sum(len(a["y"]) for a in expected.values()) == y.size
    # Another data set is split otherwise; the split is a permutation of the data set's records.
    other = sim.split_sites(*sim.dataset(SEED, 3), sim.split_rng(SEED, 4))
    assert not np.array_equal(other["site0"]["score"], expected["site0"]["score"])
    assert np.array_equal(np.sort(np.concatenate([a["score"] for a in expected.values()])), np.sort(s))


def test_a_task_is_determined_by_its_seeds_in_any_order() -> None:
    first = [dumps(sim.run_task(SEED, GRID[i], k)) for i, k in ((1, 0), (0, 1), (77, 2))]
    again = [dumps(sim.run_task(SEED, GRID[i], k)) for i, k in ((77, 2), (0, 1), (1, 0))][::-1]
    assert first == again
    base, noisy = json.loads(first[1]), json.loads(first[0])
    assert base["error"] is None and abs(base["auc"] - base["auc_emp"]) < 0.02
    assert noisy["auc"] != sim.run_task(SEED + 1, GRID[1], 0)["auc"]
    # The same data set under two settings: the same empirical AUC and CI, different noise.
    other = sim.run_task(SEED, GRID[2], 0)
    assert other["auc_emp"] == noisy["auc_emp"] and other["ci_emp"] == noisy["ci_emp"] and other["auc"] != noisy["auc"]


def test_resume_after_a_killed_run_and_refuse_another_design(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    settings = sim.parse_settings("0,1")
    full = tmp_path / "full.jsonl"
    assert sim.run(full, settings, 3, master_seed=SEED)["run"] == 6
    # A killed run: four complete task lines and half of the fifth.
    text = full.read_text()
    cut = [i for i, c in enumerate(text) if c == "\n"][4] + 20
    out.write_text(text[:cut])
    header, records, good = sim.read_results(out)
    assert header == sim.design_header(SEED) and len(records) == 4 and good < cut
    with pytest.raises(sim.ResultsFileError, match="--resume"):
        sim.run(out, settings, 3, master_seed=SEED)
    counts = sim.run(out, settings, 3, master_seed=SEED, resume=True)
    assert counts == {"total": 6, "skipped": 4, "run": 2, "failed": 0}
    assert sorted(lines(out)) == sorted(lines(full)) and lines(out)[0] == lines(full)[0]
    assert sim.run(out, settings, 3, master_seed=SEED, resume=True)["run"] == 0
    # A larger selection of the same design extends the file.
    assert sim.run(out, sim.parse_settings("0-2"), 3, master_seed=SEED, resume=True)["run"] == 3
    # Another master seed, mechanism or number of sites: refused, naming what differs.
    with pytest.raises(sim.ResultsFileError, match="master_seed 7 in the file, 8 asked for"):
        sim.run(out, settings, 3, master_seed=SEED + 1, resume=True)
    with pytest.raises(sim.ResultsFileError, match="mechanism"):
        sim.run(out, settings, 3, master_seed=SEED, resume=True, mechanism="analytic")
    # Damage before the last line is an error, not a silent drop.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines(full)[0] + "\n{oops\n" + lines(full)[1] + "\n")
    with pytest.raises(sim.ResultsFileError, match="line 2"):
        sim.read_results(bad)
    # A file of the earlier design (a split per setting) is refused, naming the change.
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({**sim.design_header(SEED), "format": "secagg-roc-simulation/1"}) + "\n")
    with pytest.raises(sim.ResultsFileError, match="split once for every setting"):
        sim.run(old, settings, 1, master_seed=SEED, resume=True)
    (tmp_path / "other.jsonl").write_text('{"some": "file"}\n')
    with pytest.raises(sim.ResultsFileError, match="not a simulation results file"):
        sim.run(tmp_path / "other.jsonl", settings, 1, master_seed=SEED, resume=True)


def test_summary_tables_match_a_hand_computation() -> None:
    def rec(setting, auc_emp, auc, ci_emp, ci, error=None):
        return {"setting": setting, "index": 0, "auc_emp": auc_emp, "auc": auc, "ci_emp": ci_emp, "ci": ci,
                "error": error}

    records = [
        rec(1, 0.51, 0.52, [0.45, 0.57], [0.46, 0.59]),   # bin 0: |d| 0.01, ci 0.01 + 0.02
        rec(1, 0.52, 0.49, [0.46, 0.58], [0.44, 0.55]),   # bin 0: |d| 0.03, ci 0.02 + 0.03
        rec(1, 0.52, None, [0.46, 0.58], [None, None], "ValueError: x"),  # bin 0, failed
        rec(1, 0.80, 0.80, [0.75, 0.85], [0.75, 0.85]),   # bin 11: (0.775, 0.8], right-closed
        rec(0, 0.90, 0.91, [0.85, 0.94], [0.86, 0.95]),   # bin 15 of the baseline
        rec(1, 0.45, 0.46, [0.4, 0.5], [0.4, 0.5]),        # outside the bins
    ]
    rows = {(r["setting"], r["bin"]): r for r in sim.bin_summary(records)}
    assert set(rows) == {(1, 0), (1, 11), (0, 15)}
    r = rows[(1, 0)]
    assert (r["count"], r["failed"]) == (3, 1)
    assert r["mae_auc"] == pytest.approx(0.02) and r["mean_diff"] == pytest.approx((-0.01 + 0.03) / 2)
    assert r["mae_ci"] == pytest.approx((0.03 + 0.05) / 2)
    assert r["mae_ci_lower"] == pytest.approx(0.015) and r["mae_ci_upper"] == pytest.approx(0.025)
    assert rows[(1, 11)]["mae_auc"] == 0.0 and rows[(0, 15)]["mean_diff"] == pytest.approx(-0.01)
    md = sim.table_markdown(list(rows.values()))
    assert "| (0.875,0.900] | 1 | 0 | -0.0100 | -0.0100 | 0.0100 |" in md
    assert "| 1: l2=0.01,eps=0.1,delta=0.1 | **0.0200** |" in md and "| 0.0000 |" in md


def test_dask_and_serial_give_the_same_lines(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    from secagg_roc.simulation.dask_backend import dask_client, dask_executor

    settings = sim.parse_settings("0,1,125")
    serial = tmp_path / "serial.jsonl"
    sim.run(serial, settings, 2, master_seed=SEED)
    for workers in (1, 2):
        out = tmp_path / f"dask{workers}.jsonl"
        with dask_client(workers=workers) as client:
            counts = sim.run(out, settings, 2, master_seed=SEED, executor=dask_executor(client), batch=1)
        assert counts["run"] == 6
        assert lines(out)[0] == lines(serial)[0]
        assert sorted(lines(out)[1:]) == sorted(lines(serial)[1:])


def test_cli_on_an_existing_scheduler_gives_the_serial_lines(tmp_path: Path, capsys) -> None:
    pytest.importorskip("distributed")
    from secagg_roc.simulation.dask_backend import dask_client

    args = ["simulate", "--datasets", "2", "--settings", "0,1", "--seed", str(SEED), "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "serial")]) == 0
    with dask_client(workers=1) as client:
        assert main([*args, "--out", str(tmp_path / "dask"), "--scheduler", client.scheduler.address]) == 0
    assert "4 tasks run" in capsys.readouterr().out
    serial, dask = (lines(tmp_path / d / "results.jsonl") for d in ("serial", "dask"))
    assert serial[0] == dask[0] and sorted(serial) == sorted(dask)


def test_cli_end_to_end_and_summarize(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim"
    args = ["simulate", "--datasets", "2", "--settings", "0,63", "--out", str(out), "--seed", str(SEED),
            "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "4 tasks run (0 failed), 0 already done" in text and "summary.md" in text
    assert len(lines(out / "results.jsonl")) == 5
    assert "Table 1" in (out / "summary.md").read_text() and (out / "fig4_auc_error.png").stat().st_size > 1000
    assert main(args) == 2 and "--resume" in capsys.readouterr().err
    assert main([*args, "--resume", "--datasets", "3"]) == 0
    assert "2 tasks run (0 failed), 4 already done" in capsys.readouterr().out
    assert main([*args[:-3], "--seed", "8", "--resume"]) == 2
    assert "master_seed 7 in the file, 8 asked for" in capsys.readouterr().err
    (out / "summary.md").unlink()
    assert main(["simulate", "--summarize", str(out)]) == 0
    assert "6 tasks summarized" in capsys.readouterr().out and (out / "summary.md").exists()
    assert main(["simulate", "--settings", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown setting 'nope'" in capsys.readouterr().err


RUNNER = textwrap.dedent("""
    import sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("dask", "distributed", "tqdm", "matplotlib"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    from secagg_roc.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_without_the_extras_workers_names_dask_and_the_rest_runs(tmp_path: Path) -> None:
    def base(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=120)

    done = base("simulate", "--datasets", "1", "--settings", "0", "--out", str(tmp_path / "a"), "--workers", "2")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "[dask] extra" in done.stderr and "pip install 'secagg-roc[dask]'" in done.stderr
    done = base("simulate", "--datasets", "1", "--settings", "0", "--out", str(tmp_path / "b"))
    assert done.returncode == 0, done.stderr
    assert "simulate: 1/1 tasks (100.0%)" in done.stderr  # the plain progress line
    assert "the figures need the [plot] extra" in done.stdout and (tmp_path / "b" / "summary.md").exists()


def test_fast_canonical_params_keep_their_meaning() -> None:
    """The simulation's speed-up in `queries.registry._jsonable`: plain values take a fast path, same results."""
    from secagg_roc.errors import SiteQueryError
    from secagg_roc.queries import canonical_params

    params = {"a": [0.5, 1, True, None], "b": (1.0, 2.0), "c": np.array([1.5, 2.5]), "d": np.float64(0.25),
              "e": {"f": [np.int64(3), 4.0], 5: "x"}, "g": [[1.0, 2.0], [3.0]], "h": np.array([True, False])}
    got = canonical_params(params)
    assert got == {"a": [0.5, 1, True, None], "b": [1.0, 2.0], "c": [1.5, 2.5], "d": 0.25,
                   "e": {"f": [3, 4.0], "5": "x"}, "g": [[1.0, 2.0], [3.0]], "h": [True, False]}
    assert type(got["d"]) is float and type(got["e"]["f"][0]) is int
    for bad in ([1.0, float("nan")], float("inf"), (2, float("-inf")), np.array([1.0, np.inf])):
        with pytest.raises(SiteQueryError, match="must be finite"):
            canonical_params({"x": bad})
    with pytest.raises(SiteQueryError, match="JSON-like"):
        canonical_params({"x": [1.0, object()]})
