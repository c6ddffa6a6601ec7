"""`secagg-roc simulate`: the ROC-GLM paper's simulation study, resumable, optionally on Dask.

Every task (one simulated data set under one DP setting) runs the distributed
ROC-GLM through an embedded 5-site study and appends one JSON line to
DIR/results.jsonl; a run with --resume skips what is there. Afterwards (or
with --summarize DIR alone) DIR/summary.md and summary.csv hold the paper's
Table 1 and the errors behind its Figures 4-5 per AUC bin and setting, and,
with the [plot] extra, fig4_auc_error.png and fig5_ci_error.png.

Settings: all (the paper's 126 jobs: index 0 is the noise-free baseline,
1-125 the grid of l2-sensitivity 0.01-0.09 x epsilon 0.1-0.5 x delta 0.1-0.5),
dp (1-125), base, or indices and ranges such as 0,1-5,125.
The progress bar is tqdm's when it is installed (the [deploy] or [test] extra),
else a plain text line.

Design: data set i is split over the sites once, the same five sites' records
under every setting (only the DP noise differs between settings), as the
paper's code analyses the same records of data set i in every job (Schalk et
al.'s R/add-experiments.R, difuture-lmu/simulations-distr-auc). Results
format 2; a results file of format 1 (a split per setting) is not continued.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError

__all__ = ["add_simulate_parser", "run_simulate_command"]

RESULTS = "results.jsonl"


def add_simulate_parser(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand."""
    from .design import MASTER_SEED, N_DATASETS, N_SITES

    p = subparsers.add_parser(
        "simulate", help="the ROC-GLM paper's simulation study (AUC and CI errors under DP), resumable, on Dask",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", type=int, default=N_DATASETS, metavar="N",
                   help="simulated data sets per setting (default: %(default)s, the paper's)")
    p.add_argument("--settings", default="all", metavar="all|dp|base|LIST", help="settings to run (default: all)")
    p.add_argument("--out", default="secagg-roc-simulation", metavar="DIR",
                   help="folder of results.jsonl and the summaries (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue DIR/results.jsonl, skipping finished tasks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N", help="run on a local Dask cluster of N worker processes "
                       "(needs the [dask] extra)")
    where.add_argument("--scheduler", metavar="ADDRESS", help="run on the Dask scheduler at ADDRESS, e.g. "
                       "tcp://127.0.0.1:8786 (needs the [dask] extra)")
    p.add_argument("--seed", type=int, default=MASTER_SEED, help="master seed (default: %(default)s, the paper's)")
    p.add_argument("--sites", type=int, default=N_SITES, help="sites per data set (default: %(default)s)")
    p.add_argument("--mechanism", choices=("classic", "analytic"), default="classic",
                   help="Gaussian mechanism (default: %(default)s, the paper's)")
    p.add_argument("--summarize", metavar="DIR", help="only rebuild the tables and plots from DIR/results.jsonl")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_simulate_command)


def text_progress(stream: Any = None, every: float = 2.0) -> Callable[[int, int], None]:
    """A progress line without tqdm: done/total, rate and time left, at most every `every` seconds."""
    stream = stream or sys.stderr
    state = {"t0": time.monotonic(), "last": 0.0, "first": None}

    def update(done: int, total: int) -> None:
        now = time.monotonic()
        if state["first"] is None:
            state["first"] = done
        if now - state["last"] < every and done < total:
            return
        state["last"] = now
        ran = done - state["first"]
        rate = ran / max(now - state["t0"], 1e-9)
        left = f", {(total - done) / rate / 60:.1f} min left" if rate > 0 and done < total else ""
        end = "\r" if getattr(stream, "isatty", lambda: False)() and done < total else "\n"
        stream.write(f"simulate: {done}/{total} tasks ({100 * done / max(total, 1):.1f}%), {rate:.1f} tasks/s{left}{end}")
        stream.flush()

    return update


def progress_bar(disable: bool) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """(update, close): tqdm's bar when installed, else `text_progress`."""
    if disable:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return text_progress(), lambda: None
    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, initial=done, unit="task", desc="simulate", smoothing=0.05)
        else:
            bar["bar"].update(done - bar["bar"].n)

    return update, lambda: bar["bar"].close() if "bar" in bar else None


def _summarize(results: Path, out: Path) -> int:
    from .results import write_summary

    if not results.is_file():
        raise ConfigError(f"{results}: no results file")
    s = write_summary(results, out)
    print(f"{s['records']} tasks summarized ({s['failed']} failed)")
    print("wrote " + ", ".join(str(f) for f in s["files"]))
    for note in s["notes"]:
        print(f"note: {note}")
    return 0


def run_simulate_command(args: argparse.Namespace) -> int:
    """`secagg-roc simulate`: run (or resume) the paper's simulation, then its tables and plots (exit code)."""
    from .design import parse_settings
    from .runner import ResultsFileError, run

    if args.summarize:
        d = Path(args.summarize)
        return _summarize(d / RESULTS if d.is_dir() else d, d if d.is_dir() else d.parent)
    if args.datasets < 1 or args.sites < 2:
        raise ConfigError("--datasets must be at least 1 and --sites at least 2")
    try:
        settings = parse_settings(args.settings)
    except ValueError as exc:
        raise ConfigError(f"--settings: {exc}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    executor, client_cm = None, None
    if args.workers is not None or args.scheduler is not None:
        if args.workers is not None and args.workers < 1:
            raise ConfigError("--workers must be at least 1")
        from ..extras import require

        require("dask", "--workers/--scheduler")
        from .dask_backend import dask_client, dask_executor

        client_cm = dask_client(workers=args.workers, scheduler=args.scheduler)
    update, close = progress_bar(args.no_progress)
    t0 = time.perf_counter()
    try:
        if client_cm is not None:
            with client_cm as client:
                executor = dask_executor(client)
                counts = run(out / RESULTS, settings, args.datasets, master_seed=args.seed, resume=args.resume,
                             n_sites=args.sites, mechanism=args.mechanism, executor=executor, progress=update)
        else:
            counts = run(out / RESULTS, settings, args.datasets, master_seed=args.seed, resume=args.resume,
                         n_sites=args.sites, mechanism=args.mechanism, progress=update)
    except ResultsFileError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        close()
    took = time.perf_counter() - t0
    rate = counts["run"] / took if took > 0 else 0.0
    print(f"{counts['run']} tasks run ({counts['failed']} failed), {counts['skipped']} already done, "
          f"{took:.1f} s ({rate:.1f} tasks/s)")
    return _summarize(out / RESULTS, out)
