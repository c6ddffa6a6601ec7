"""The deployed study on loopback: real processes, mutual TLS 1.3, SQLite (synchronous=FULL).

    python benchmarks/deployed.py            # K=10, d=1e6; the analysis on 5 sites, n=2500
    python benchmarks/deployed.py --quick    # d=1e5, fewer repeats

1. Secure sum: K site-agent processes each hold one float vector of length d;
   the analyst (this process) runs the declared `sum` analysis (a join, then
   one secure sum, every site checking both against its policy) through two
   aggregator processes. Printed: the median wall time of one round as the
   analyst sees it (query out, sites encode, split, log their split (seeds and
   digests) and push their shares, aggregators log every share durably (large
   ones in fsync'd side files), agree, sum, release; the analyst
   combines and decodes), against the plain numpy sum of the same K vectors
   (``acc += v``) in the same run, and their ratio. Target: ratio <= 30 at
   K=10, d=1e6. Also the CPU of every process: per run (the timed runs and
   the warm-up), and per round, the join and the sum apart (5 more runs, each
   process's CPU read 0.2 s after each round; target <= 0.3 CPU-s per round).
2. The whole distributed analysis (ROC-GLM with DP survivor functions, its
   DeLong CI, Brier score, calibration curve) on 5 site agents with n=2500
   records in total: wall time, the number of rounds, and the same analysis
   on the embedded `Study.local` in the same run. Target: under 2 s.

The machine matters: every party shares the same CPUs here (on a 2-core box
12 processes compete), which a real deployment would not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import numpy as np

import secagg_roc.stats as sr
from secagg_roc import DPPolicy, Policy, Study
from secagg_roc.deploy.local_cluster import LocalCluster
from secagg_roc.deploy.site_data import load_site_data


def plain_sum(vectors: list[np.ndarray]) -> np.ndarray:
    acc = np.zeros_like(vectors[0])
    for v in vectors:
        acc += v
    return acc


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc; 0 elsewhere)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm up: connections, caches, page faults
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def cpu_per_round(cl: LocalCluster, study, run, runs: int, settle: float = 0.2) -> dict[str, list[float]]:
    """CPU of each kind of round (the join, the sum): `runs` more runs of `run`, every process's CPU read
    `settle` seconds after each round ends, so that what a round leaves behind (the sites fetching and
    logging its release, the aggregators' compaction) counts in that round, not in the next.

    Returns round name -> [sites (all), aggregators (all), analyst] CPU seconds per round: means over the
    runs (/proc counts CPU in clock ticks, 10 ms here, per process: a mean, unlike a median, is not held
    to multiples of that).
    """
    def sample() -> tuple[float, float, float]:
        return (sum(cpu_seconds(cl.procs[n].pid) for n in cl.site_names),
                sum(cpu_seconds(cl.procs[n].pid) for n in cl.aggregator_names), time.process_time())

    seen: dict[str, list[tuple[float, float, float]]] = {}
    last = [sample()]

    def on_round(name: str, number: int) -> None:
        time.sleep(settle)  # (in the analyst's client thread, between rounds: no round is timed here)
        now = sample()
        seen.setdefault(name, []).append(tuple(b - a for a, b in zip(last[0], now)))
        last[0] = now

    time.sleep(settle)
    last[0] = sample()
    study.on_round = on_round
    try:
        for _ in range(runs):
            run()
    finally:
        study.on_round = None
    return {name.split(".")[-1]: [statistics.mean(x[i] for x in cpu) for i in range(3)] for name, cpu in seen.items()}


def secure_sum(k: int, d: int, repeats: int, workdir: str) -> None:
    rng = np.random.default_rng(1)
    vectors = [rng.standard_normal(d) for _ in range(k)]
    data = {f"s{i:02d}": {"x": v.reshape(1, d)} for i, v in enumerate(vectors)}
    print(f"\n1. secure sum: K={k} site agents, d={d:.0e}, 2 aggregator processes ({os.cpu_count()} CPUs)")
    t0 = time.perf_counter()
    with LocalCluster(os.path.join(workdir, "sum"), data, data_format="npz", round_timeout_s=120.0,
                      max_body_bytes=max(64 << 20, 16 * d + (1 << 20)), privacy_level=1, log_level="WARNING",
                      policy={"analyses": ["sum"]}) as cl:
        print(f"   cluster up in {time.perf_counter() - t0:.1f} s")
        with cl.study() as study:
            expected = plain_sum(vectors)
            total = sr.column_sums(study, "x")
            assert np.allclose(total, expected, atol=k * 2.0**-31), "wrong total"
            plain, _ = median_time(lambda: plain_sum(vectors), max(repeats, 5))
            before = {n: cpu_seconds(p.pid) for n, p in cl.procs.items()}
            me = time.process_time()
            secure, times = median_time(lambda: sr.column_sums(study, "x"), repeats)
            rounds = repeats + 1
            cpu_sites = sum(cpu_seconds(cl.procs[n].pid) - before[n] for n in cl.site_names) / rounds
            cpu_aggs = sum(cpu_seconds(cl.procs[n].pid) - before[n] for n in cl.aggregator_names) / rounds
            cpu_me = (time.process_time() - me) / rounds
            sums = [t for (name, *_), t in zip(study.history, study.timings) if name == "sum"][-repeats:]
            steps = {k: statistics.median(t[k] for t in sums) for k in sums[-1]}
            by_round = cpu_per_round(cl, study, lambda: sr.column_sums(study, "x"), repeats)
    print(f"   {'plain ms':>10} {'deployed ms':>12} {'ratio':>7}   (deployed rounds: {', '.join(f'{t * 1e3:.0f}' for t in times)} ms)")
    print(f"   {plain * 1e3:>10.2f} {secure * 1e3:>12.1f} {secure / plain:>7.1f}   target <= 30 "
          "(a run: its join round and the sum round)")
    print("   steps (median ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in steps.items())
          + "   (wait: query out -> every share logged at both aggregators; close: sum + release)")
    print(f"   CPU per round: site agents {cpu_sites * 1e3:.0f} ms (all {k}), aggregators {cpu_aggs * 1e3:.0f} ms (both), "
          f"analyst {cpu_me * 1e3:.0f} ms; {os.cpu_count()} CPUs shared by all")
    print("   (that line's 'round' is a run: its join round and its sum round, over the timed runs and the warm-up)")
    for name, (sites, aggs, me) in by_round.items():
        print(f"   CPU per {name} round: site agents {sites * 1e3:.0f} ms, aggregators {aggs * 1e3:.0f} ms, "
              f"analyst {me * 1e3:.0f} ms; all {(sites + aggs + me) * 1e3:.0f} ms   "
              f"(mean of {repeats} more runs, read 0.2 s after each round)")
    total = [sum(v[i] for v in by_round.values()) for i in range(3)]
    print(f"   CPU per run from those rounds: site agents {total[0] * 1e3:.0f} ms, aggregators {total[1] * 1e3:.0f} ms, "
          f"analyst {total[2] * 1e3:.0f} ms; all {sum(total) * 1e3:.0f} ms (target <= 300 ms per round)")


def analysis(repeats: int, workdir: str) -> None:
    rng = np.random.default_rng(3)
    sizes = [400, 450, 500, 550, 600]
    data = {}
    for i, n in enumerate(sizes):
        y = rng.integers(0, 2, n)
        score = 1.0 / (1.0 + np.exp(-(rng.normal(size=n) + 1.4 * y - 0.6)))
        data[f"site-{i + 1}"] = {"y": y, "score": score}
    print(f"\n2. distributed analysis: roc_glm (DP) + CI + brier + calibration, 5 site agents, n={sum(sizes)}")
    t0 = time.perf_counter()
    policy = Policy(dp=DPPolicy(epsilon=0.5, delta=0.3, l2_sensitivity=0.05), roles={"label": ["y"], "score": ["score"]})
    with LocalCluster(os.path.join(workdir, "analysis"), data, seed=5, round_timeout_s=60.0, log_level="WARNING",
                      policy=policy) as cl:
        print(f"   cluster up in {time.perf_counter() - t0:.1f} s")
        loaded = {s.name: load_site_data(s.data, s.columns) for s in cl.config.sites}

        def run(study) -> tuple:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                roc = sr.roc_glm(study, label="y", score="score")  # the policy's (0.5, 0.3) and sensitivity 0.05
                return roc, sr.brier_score(study, "y", "score"), sr.calibration_curve(study, "y", "score")

        # The same DP seed: the embedded sites draw the same noise as the agents, run after run.
        local = Study.local(loaded, policy=policy, seed=5)
        with cl.study() as study:
            times, local_times, same = [], [], True
            for _ in range(repeats):
                t = time.perf_counter()
                remote = run(study)
                times.append(time.perf_counter() - t)
                t = time.perf_counter()
                embedded = run(local)
                local_times.append(time.perf_counter() - t)
                same &= remote[0].auc == embedded[0].auc and remote[0].ci == embedded[0].ci and remote[1] == embedded[1]
            rounds = len(study.history) // repeats
    roc, brier, _ = remote
    print(f"   AUC {roc.auc:.4f} CI [{roc.ci[0]:.4f}, {roc.ci[1]:.4f}], Brier {brier:.4f}; "
          f"identical to the embedded study: {same}")
    print(f"   {'rounds':>6} {'deployed s':>11} {'embedded s':>11}   (deployed runs: {', '.join(f'{t:.2f}' for t in times)} s)")
    print(f"   {rounds:>6} {statistics.median(times):>11.2f} {statistics.median(local_times):>11.2f}   target < 2 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="d = 1e5 and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per figure (default 5, quick 3)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="secagg-deployed-") as workdir:
        secure_sum(10, 10**5 if args.quick else 10**6, repeats, workdir)
        analysis(1 if args.quick else 3, workdir)


if __name__ == "__main__":
    main()
