"""Growth of the deployed parties' logs: disk bytes and restart (replay) time after N and 2N rounds.

    python benchmarks/deployed_growth.py              # K=3 site agents, d=2e5, N=60 runs of the `sum` analysis
    python benchmarks/deployed_growth.py --quick      # N=15

A real cluster on loopback (two aggregator processes, K site agents, mutual
TLS, SQLite with synchronous=FULL). The analyst runs the declared `sum`
analysis N times, then N times more (each run is two rounds: its join and the
sum; d=2e5 makes every share vector 1.6 MB, so each goes to a side file).
After N and after 2N runs, for every party: the bytes of its database, WAL
and side files, and its number of log entries; for each aggregator, the time
to replay its log into a fresh state (`compaction.replay`, on a consistent
copy taken while the cluster is idle), and for each site agent the time to
replay its log as a restart does (`SiteAnswers._replay`, on a copy too). Printed: the figures and their ratios 2N / N (1.0 = flat, 2.0 =
growing with the rounds).
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np

import secagg_roc.stats as sr
from secagg_roc.deploy.aggregator_state import AggregatorState

try:
    from secagg_roc.deploy.compaction import replay
except ImportError:  # a build before compaction (for a before/after comparison with PYTHONPATH)
    from secagg_roc.deploy.aggregator_state import replay  # type: ignore[attr-defined,no-redef]
from secagg_roc.deploy.local_cluster import LocalCluster

try:
    from secagg_roc.deploy.site_compaction import SiteCompactor  # noqa: F401  (a build that compacts site logs)
    from secagg_roc.deploy.site_answers import SiteAnswers
except ImportError:
    SiteAnswers = None  # type: ignore[assignment,misc]
from secagg_roc.deploy.site_log import default_state_path
from secagg_roc.deploy.store import Store


def disk_bytes(path: Path) -> int:
    """Bytes on disk of database `path`, its WAL and its side files."""
    blobs = path.with_name(path.name + ".blobs")
    paths = [path, path.with_name(path.name + "-wal"), *(blobs.iterdir() if blobs.is_dir() else [])]
    return sum(p.stat().st_size for p in paths if p.exists())


def consistent_copy(path: Path, dest: Path) -> Path:
    """A copy of database `path` (SQLite's backup API) and its side files, taken while its party is idle."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / path.name
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as src, sqlite3.connect(out) as dst:
        src.backup(dst)
    blobs = path.with_name(path.name + ".blobs")
    if blobs.is_dir():
        shutil.copytree(blobs, out.with_name(out.name + ".blobs"))
    return out


def measure(cl: LocalCluster, where: Path) -> dict[str, tuple[int, int, float]]:
    """Per party: (disk bytes, log entries, replay or read seconds)."""
    config, out = cl.config, {}
    for agg in config.aggregators:
        copy = consistent_copy(Path(agg.database), where / agg.name)
        disk = disk_bytes(Path(agg.database))
        store = Store(copy, study=config.study_id, party=agg.name)
        t0 = time.perf_counter()
        replay(AggregatorState(config, agg.name), store)
        out[agg.name] = (disk, store.count(), time.perf_counter() - t0)
        store.close()
    for site in cl.site_names:
        path = default_state_path(config, site)
        copy = consistent_copy(path, where / site)
        with Store(copy, study=config.study_id, party=site) as store:
            n = store.count()
        if SiteAnswers is None:  # a build before site compaction: reading its log
            with Store(copy, study=config.study_id, party=site) as store:
                t0 = time.perf_counter()
                sum(1 for _ in store.entries())
                out[site] = (disk_bytes(path), n, time.perf_counter() - t0)
            continue
        answers = SiteAnswers(config, site, state_path=copy)
        t0 = time.perf_counter()
        answers._replay()  # what a restarted site agent does (compacting its log on start included)
        out[site] = (disk_bytes(path), n, time.perf_counter() - t0)
        answers.store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="N = 15 runs")
    parser.add_argument("--runs", type=int, default=None, help="N, the runs before the first measurement (default 60)")
    parser.add_argument("--sites", type=int, default=3, help="K, the site agents (default 3)")
    parser.add_argument("--length", type=int, default=200_000, help="d, the vector length (default 2e5)")
    args = parser.parse_args()
    n_runs = args.runs or (15 if args.quick else 60)
    rng = np.random.default_rng(2)
    data = {f"s{i:02d}": {"x": rng.standard_normal((1, args.length))} for i in range(args.sites)}
    with tempfile.TemporaryDirectory(prefix="secagg-growth-") as workdir:
        work = Path(workdir)
        with LocalCluster(work / "cluster", data, data_format="npz", round_timeout_s=120.0, privacy_level=1,
                          max_body_bytes=max(64 << 20, 16 * args.length + (1 << 20)), log_level="WARNING",
                          policy={"analyses": ["sum"]}) as cl, cl.study() as study:
            figures, times = {}, {}
            for label, upto in (("N", n_runs), ("2N", 2 * n_runs)):
                t0 = time.perf_counter()
                while len(study.history) < 2 * upto:
                    sr.column_sums(study, "x")
                times[label] = time.perf_counter() - t0
                figures[label] = measure(cl, work / f"copy-{label}")
    print(f"{args.sites} site agents, d={args.length:.0e}, 2 aggregator processes; N={n_runs} runs "
          f"({2 * n_runs} rounds; {times['N']:.0f} s), then N more ({times['2N']:.0f} s)")
    print(f"   {'party':<8} {'disk N':>10} {'disk 2N':>10} {'ratio':>6} {'entries':>13} {'ratio':>6} "
          f"{'replay N ms':>12} {'2N ms':>8} {'ratio':>6}")
    for party in figures["N"]:
        (d1, e1, t1), (d2, e2, t2) = figures["N"][party], figures["2N"][party]
        print(f"   {party:<8} {d1 / 1e6:>8.2f}MB {d2 / 1e6:>8.2f}MB {d2 / d1:>6.2f} {e1:>6} -> {e2:<5} {e2 / e1:>6.2f} "
              f"{t1 * 1e3:>12.1f} {t2 * 1e3:>8.1f} {t2 / t1:>6.2f}")
    print("   (replay: restarting on a consistent copy of the database; aggregators into a fresh state, site "
          "agents through their log replay)")


if __name__ == "__main__":
    main()
