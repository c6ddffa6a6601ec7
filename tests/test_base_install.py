"""A base install (numpy, scipy, cryptography only) gives a working CLI; a command that needs an
extra says which, in one line. The extras are made unimportable in a subprocess (a meta-path finder
that refuses them, as a missing package would), so this runs in the test environment itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from secagg_roc.deploy.config_write import loopback_study

#: Runs ``secagg-roc ARGS`` with every optional extra's modules missing.
RUNNER = textwrap.dedent("""
    import sys

    class Missing:
        BLOCKED = ("aiohttp", "matplotlib", "tqdm", "tomli_w")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    from secagg_roc.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def base(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["keys", "--help"], ["site", "--help"],
                                  ["aggregator", "--help"], ["analyze", "--help"], ["status", "--help"]])
def test_help_works_without_any_extra(args: list[str]) -> None:
    done = base(*args)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "usage: secagg-roc" in done.stdout


def test_version_works_without_any_extra() -> None:
    import secagg_roc

    done = base("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"secagg-roc {secagg_roc.__version__}"


def test_the_local_commands_run_and_the_network_ones_name_their_extra(tmp_path: Path) -> None:
    done = base("sum-demo")
    assert done.returncode == 0 and "total        [20.5   4.5   1.75]" in done.stdout, done.stderr
    # keys and site check need nothing beyond a base install (tomli-w is not needed to read a study).
    loopback_study(tmp_path, ["site-a", "site-b"], 2, [1, 2])
    (tmp_path / "data").mkdir()
    for s in ("site-a", "site-b"):
        (tmp_path / "data" / f"{s}.csv").write_text("y,score\n" + "".join(f"{i % 2},0.{i}\n" for i in range(1, 9)))
    study = str(tmp_path / "study.toml")
    done = base("keys", "--study", study)
    assert done.returncode == 0 and "created a CA and 5 party key pairs" in done.stdout, done.stderr
    done = base("site", "check", "--study", study, "--name", "site-a")
    assert "site 'site-a' of study 'loopback': 8 records" in done.stdout and "Traceback" not in done.stderr
    for command in (["aggregator", "--name", "agg-1"], ["site", "--name", "site-a"], ["analyze", "--out", "o"],
                    ["status"], ["demo", "--out", str(tmp_path / "demo")]):
        done = base(*command, "--study", study) if command[0] != "demo" else base(*command)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (command, done.stderr)
        assert "needs the [deploy] extra" in lines[0] and "pip install 'secagg-roc[deploy]'" in lines[0]


def test_the_embedded_demo_writes_its_report_without_matplotlib(tmp_path: Path) -> None:
    done = base("demo", "--embedded", "--out", str(tmp_path))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "AUC (ROC-GLM)" in done.stdout and "note: no plots: they need the [plot] extra" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["notes"] == ["no plots: they need the [plot] extra: pip install 'secagg-roc[plot]'"]
    assert (tmp_path / "report.txt").read_text().startswith("Distributed validation")
    assert not (tmp_path / "roc.png").exists()
