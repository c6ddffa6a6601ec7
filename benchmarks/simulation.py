"""The ROC-GLM paper's simulation study: tasks/s serially and on Dask, and the full grid's projected wall time.

Usage:
    python benchmarks/simulation.py                 # 6 settings x 20 data sets, serial, Dask 1 and 2 workers
    python benchmarks/simulation.py --datasets 50 --settings 0-125:25
    python benchmarks/simulation.py --no-dask       # serial only (base install)
    python benchmarks/simulation.py --settings all --datasets 6   # the whole grid's mix of settings

The default settings run fewer Newton rounds than the grid's average (4.4 per task against 4.8) and, since a
data set is split over the sites once for all settings, reuse each site's join verdicts fewer times: their
tasks are ~5-12% cheaper than the grid's; ``--settings all`` projects the grid from its own mix.

A task is one simulated data set under one setting (`secagg_roc.simulation`):
an embedded 5-site study (two aggregators, additive sharing, transcripts off)
runs the distributed ROC-GLM with the setting's DP noise, plus the pooled
empirical AUC and DeLong CI. The subset spreads over the grid (the settings'
noise changes the Fisher iterations) and over data-set sizes (n = 100..2500).
Dask runs use a LocalCluster of 1 and 2 worker processes (one thread each),
timed without the cluster's start, which is printed apart; all three runs
must give the same JSON lines. Printed: tasks/s, speed-ups as ratios, and the
projected wall time of the paper's full grid (125 DP settings x 10,000 data
sets, and with the noise-free baseline 126 x 10,000) at the best rate.
Also: ROC-GLM fits/s of the same tasks with the library's default light
transcripts against ``transcripts=False`` (what the simulation uses).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

from secagg_roc import simulation as sim
from secagg_roc.extras import missing
from secagg_roc.simulation.runner import read_results

FULL_DP = 125 * sim.N_DATASETS
FULL_ALL = 126 * sim.N_DATASETS


def pick_settings(text: str) -> list[sim.Setting]:
    """``A-B:STEP`` (every STEP-th index of A..B) or anything `parse_settings` takes."""
    if ":" in text:
        span, step = text.split(":")
        lo, hi = (int(v) for v in span.split("-"))
        return [sim.paper_grid()[i] for i in range(lo, hi + 1, int(step))]
    return sim.parse_settings(text)


def cpu_seconds() -> float:
    """CPU time of the calling process (run on each Dask worker by `client.run`)."""
    return time.process_time()


def timed_run(path: Path, settings, datasets: int, seed: int, client=None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the processes doing the work: this one, or every Dask worker)."""
    executor = None
    if client is not None:
        from secagg_roc.simulation.dask_backend import dask_executor

        executor = dask_executor(client)
        c0 = client.run(cpu_seconds)
    else:
        c0 = {"self": cpu_seconds()}
    t0 = time.perf_counter()
    counts = sim.run(path, settings, datasets, master_seed=seed, executor=executor)
    took = time.perf_counter() - t0
    c1 = client.run(cpu_seconds) if client is not None else {"self": cpu_seconds()}
    assert counts["run"] == len(settings) * datasets, counts
    return took, sum(c1[k] - c0[k] for k in c0)


def busy(load_before: float) -> str:
    """The 1-minute load average before a run: other processes on the machine skew parallel timings."""
    return f"load before {load_before:.1f}"


def fits_per_second(settings, datasets: int, seed: int, transcripts) -> float:
    """ROC-GLM fits/s (study set-up included) of the subset's tasks with the given transcripts."""
    from secagg_roc.policy import DPPolicy, Policy
    from secagg_roc.stats.rocglm import roc_glm
    from secagg_roc.study import Study

    jobs = []
    for s in settings:
        for i in range(datasets):
            y, sc = sim.dataset(seed, i)
            noise = int(sim.task_rng(seed, s, i).integers(0, 2**63 - 1))
            jobs.append((s, sim.split_sites(y, sc, sim.split_rng(seed, i)), noise))
    roles = {"label": ["y"], "score": ["score"]}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s, sites, noise in jobs:
            if s.private:
                pol = Policy(roles=roles, dp=DPPolicy(epsilon=s.epsilon, delta=s.delta,
                                                      l2_sensitivity=s.l2_sensitivity, mechanism="classic"))
            else:
                pol = Policy(roles=roles, allow_non_private=True)
            study = Study.local(sites, policy=pol, seed=noise, transcripts=transcripts)
            roc_glm(study, "y", "score", ties="strict", **({} if s.private else {"epsilon": None}))
    return len(jobs) / (time.perf_counter() - t0)


def hours(tasks: int, rate: float) -> str:
    return f"{tasks / rate / 3600:.1f} h"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", type=int, default=20, help="data sets per setting (default: %(default)s)")
    ap.add_argument("--settings", default="0-125:25", help="A-B:STEP or a list as `simulate --settings` "
                    "(default: %(default)s: 0, 25, 50, 75, 100, 125)")
    ap.add_argument("--seed", type=int, default=sim.MASTER_SEED)
    ap.add_argument("--no-dask", action="store_true", help="serial only")
    ap.add_argument("--no-fits", action="store_true", help="skip the transcripts comparison")
    args = ap.parse_args(argv)
    settings = pick_settings(args.settings)
    n = len(settings) * args.datasets
    print(f"Simulation study throughput: {len(settings)} settings ({', '.join(str(s.index) for s in settings)}) x "
          f"{args.datasets} data sets = {n} tasks, 5 sites, seed {args.seed}\n")
    sim.run_task(args.seed, settings[0], 0)  # imports and first-call costs out of the timings
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        load = os.getloadavg()[0]
        took, cpu = timed_run(out / "serial.jsonl", settings, args.datasets, args.seed)
        rates["serial"] = n / took
        per_cpu = {"serial": n / cpu}
        print(f"{'serial (this process)':<28} {took:7.1f} s  {rates['serial']:6.1f} tasks/s  "
              f"({n / cpu:.1f} tasks per CPU second; {busy(load)})")
        reference = sorted(read_results(out / "serial.jsonl")[1], key=lambda r: (r["setting"], r["index"]))
        if not args.no_dask and missing("dask") is None:
            from secagg_roc.simulation.dask_backend import dask_client

            for workers in (1, 2):
                t0 = time.perf_counter()
                with dask_client(workers=workers) as client:
                    client.run(sim.run_task, args.seed, settings[0], 0)  # warms up every worker
                    start = time.perf_counter() - t0
                    load = os.getloadavg()[0]
                    took, cpu = timed_run(out / f"dask{workers}.jsonl", settings, args.datasets, args.seed, client)
                rates[f"dask{workers}"] = n / took
                per_cpu[f"dask{workers}"] = n / cpu
                got = sorted(read_results(out / f"dask{workers}.jsonl")[1], key=lambda r: (r["setting"], r["index"]))
                same = "identical to serial" if got == reference else "DIFFERENT FROM SERIAL"
                print(f"{f'Dask, {workers} local worker(s)':<28} {took:7.1f} s  {rates[f'dask{workers}']:6.1f} tasks/s"
                      f"  (cluster start and warm-up {start:.1f} s; results {same})")
                print(f"{'':<28} workers busy {100 * cpu / (took * workers):.0f}% of the wall time, "
                      f"{n / cpu:.1f} tasks per worker CPU second; {busy(load)}")
                if got != reference:
                    return 1
        elif not args.no_dask:
            print("Dask: not installed (pip install 'secagg-roc[dask]'); serial only")
    print()
    if "dask1" in rates:
        print(f"speed-up Dask 1 worker / serial:    {rates['dask1'] / rates['serial']:.2f}x")
        print(f"speed-up Dask 2 workers / serial:   {rates['dask2'] / rates['serial']:.2f}x")
        print(f"speed-up Dask 2 workers / 1 worker: {rates['dask2'] / rates['dask1']:.2f}x")
    best_name = max(rates, key=rates.get)
    best = rates[best_name]
    print(f"\nprojected wall time of the paper's grid at {best:.1f} tasks/s ({best_name}): "
          f"125 x 10,000 DP tasks {hours(FULL_DP, best)}; with the baseline, 126 x 10,000: {hours(FULL_ALL, best)}")
    ideal = 2 * per_cpu.get("dask2", per_cpu["serial"])
    print(f"  with both cores fully busy ({ideal:.1f} tasks/s from the CPU time per task): {hours(FULL_DP, ideal)}")
    print(f"  (serial: {hours(FULL_DP, rates['serial'])}); the target was < 2 h: "
          f"{'met' if FULL_DP / best < 7200 else 'not met'}; 2 h at this rate covers "
          f"{int(best * 7200):,} tasks ({best * 7200 / 125:,.0f} data sets per setting)")
    if not args.no_fits:
        light = fits_per_second(settings, min(args.datasets, 10), args.seed, "light")
        off = fits_per_second(settings, min(args.datasets, 10), args.seed, False)
        print(f"\nROC-GLM fits/s on {len(settings) * min(args.datasets, 10)} of these tasks, one process: "
              f"transcripts='light' (the default) {light:.1f}, transcripts=False {off:.1f} ({off / light:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
