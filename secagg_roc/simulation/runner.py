"""Run the simulation study: one task per (setting, data set), results appended to a JSON-lines file.

The file's first line is a header naming the design (format version, master
seed, grid, sites, mechanism, ties, alpha); every further line is one finished task,
written and flushed as soon as it is done. A later run with the same file
skips the tasks already in it (resume) and refuses a file of another design.
A truncated last line (a killed run) is dropped, and cut off before appending.

Each task goes through the library's real path: an embedded 5-site study
(`Study.local`, two aggregators, additive sharing, ``transcripts=False``)
under a policy with the setting's DP parameters, then `roc_glm`; the
empirical AUC and its DeLong CI (logit scale, the paper's) come from the
pooled records (`pooled`). A data set is split over the sites once, the same
under every setting (`design.split_rng`, as the paper analyses the same records
under every setting); each setting's study is its own, with its own policy,
join and rounds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .design import N_SITES, Setting, dataset, paper_grid, split_rng, split_sites, task_rng
from .gc_pace import fewer_collections

__all__ = ["FORMAT", "ResultsFileError", "design_header", "pending_tasks", "read_results", "run", "run_task",
           "run_tasks"]

#: The results format: 2 since a data set is split over the sites once for every setting (1: anew per setting).
FORMAT = "secagg-roc-simulation/2"
#: What each earlier format's design was, to say why its file is not continued.
EARLIER_FORMATS = {"secagg-roc-simulation/1": "each setting split a data set over the sites anew"}
#: The most tasks a worker runs at a time (by default): ~3 s of work. Each batch costs the client and the scheduler
#: ~6 ms of CPU on the machine the workers share (measured on 2 workers: 0.51, 0.40, 0.30, 0.25 s of the main
#: process's CPU for 1,512 tasks in batches of 32, 64, 128, 189); 256-task batches make that ~0.2% of a run.
MAX_BATCH = 256
#: The fewest tasks of a default batch (its end's batches): ~0.1 s of work.
MIN_BATCH = 8
#: A default batch is at most 1/GUIDE of the tasks still to hand out (guided self-scheduling).
GUIDE = 8
#: A task: (setting index, data-set index).
Task = tuple[int, int]
#: Runs batches of tasks under a design header, yielding each batch's records as it completes.
Executor = Callable[[list[list[Task]], dict[str, Any]], Iterator[list[dict[str, Any]]]]


class ResultsFileError(ValueError):
    """A results file that belongs to another design, or that is damaged before its last line."""


def design_header(master_seed: int, *, n_sites: int = N_SITES, mechanism: str = "classic", ties: str = "strict",
                  alpha: float = 0.05) -> dict[str, Any]:
    """The header line: everything that decides a task's numbers except its (setting, index)."""
    return {"format": FORMAT, "master_seed": int(master_seed), "n_sites": int(n_sites), "mechanism": mechanism,
            "ties": ties, "alpha": float(alpha), "grid": [s.to_dict() for s in paper_grid()]}


def _clean(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


@functools.lru_cache(maxsize=4)
def data_set(master_seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Data set `index` as read-only (labels, scores): the same under every setting, so made once for the
    settings that follow one another (tasks run data set by data set)."""
    y, s = dataset(master_seed, index)
    y.flags.writeable = s.flags.writeable = False
    return y, s


@functools.lru_cache(maxsize=4)
def pooled_reference(master_seed: int, index: int,
                     alpha: float) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Data set `index` (read-only labels and scores) and its empirical (lower, AUC, upper), made once for
    the settings that follow one another."""
    from .. import pooled

    y, s = data_set(master_seed, index)
    return y, s, pooled.delong_ci_logit(y, s, alpha)


@functools.lru_cache(maxsize=4)
def data_set_sites(master_seed: int, index: int, n_sites: int) -> dict[str, dict[str, np.ndarray]]:
    """Data set `index` split over `n_sites` sites (read-only arrays): the same under every setting, made once
    for the settings that follow one another. Each setting's sites hold these very arrays, so a site's join
    checks find their verdicts under the arrays' digests after the first setting (`queries.copies`)."""
    y, s = data_set(master_seed, index)
    sites = split_sites(y, s, split_rng(master_seed, index), n_sites)
    for arrays in sites.values():
        for a in arrays.values():
            a.flags.writeable = False
    return sites


def run_task(master_seed: int, setting: Setting, index: int, *, n_sites: int = N_SITES, mechanism: str = "classic",
             ties: str = "strict", alpha: float = 0.05) -> dict[str, Any]:
    """One data set under one setting: empirical and distributed AUC and CI, as a JSON-ready record."""
    from ..policy import DPPolicy, Policy
    from ..stats.rocglm import roc_glm
    from ..study import Study

    y, s, (lo_e, auc_e, hi_e) = pooled_reference(master_seed, index, alpha)
    sites = data_set_sites(master_seed, index, n_sites)
    noise_seed = int(task_rng(master_seed, setting, index).integers(0, 2**63 - 1))
    rec: dict[str, Any] = {"setting": setting.index, "index": index, "n": int(y.size), "n_pos": int(y.sum()),
                           "auc_emp": auc_e, "ci_emp": [lo_e, hi_e]}
    roles = {"label": ["y"], "score": ["score"]}
    if setting.private:
        # The paper's method: Newton rounds over the sites' exact scores after the DP release (not the library's
        # default fit to the release alone, `Policy.rocglm_fit`), so the study reproduces what the paper measured.
        policy = Policy(roles=roles, rocglm_fit="exact", dp=DPPolicy(
            epsilon=setting.epsilon, delta=setting.delta, l2_sensitivity=setting.l2_sensitivity, mechanism=mechanism))
    else:
        policy = Policy(roles=roles, allow_non_private=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # non-convergence on separated data is kept, as in the paper's code
            study = Study.local(sites, policy=policy, seed=noise_seed, transcripts=False)
            r = roc_glm(study, "y", "score", ties=ties, alpha=alpha,
                        **({} if setting.private else {"epsilon": None}))
        rec.update(auc=r.auc, ci=[r.ci[0], r.ci[1]], gamma=[float(r.params[0]), float(r.params[1])],
                   converged=bool(r.glm.converged), iterations=int(r.glm.iterations), error=None)
    except Exception as exc:  # recorded like the paper's try(): the task is done, its numbers are missing
        rec.update(auc=None, ci=[None, None], gamma=[None, None], converged=False, iterations=0,
                   error=f"{type(exc).__name__}: {exc}")
    for key in ("auc_emp", "auc"):
        rec[key] = _clean(rec[key])
    for key in ("ci_emp", "ci", "gamma"):
        rec[key] = [_clean(v) for v in rec[key]]
    return rec


def run_tasks(tasks: Sequence[Task], header: dict[str, Any]) -> list[dict[str, Any]]:
    """Records of `tasks` under the design `header` (a batch, as a worker runs it); the garbage collector's
    young generation is collected less often meanwhile (`gc_pace`: ~4% of a task's CPU, same results)."""
    grid = paper_grid()
    opts = {k: header[k] for k in ("n_sites", "mechanism", "ties", "alpha")}
    with fewer_collections():
        return [run_task(header["master_seed"], grid[si], i, **opts) for si, i in tasks]


#: `json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)`, its encoder made once (not per line).
_RECORD_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=False).encode


def dumps(record: dict[str, Any]) -> str:
    """One JSON line, keys sorted: the same bytes for the same record wherever it was computed."""
    return _RECORD_JSON(record)


def read_results(path: str | os.PathLike) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
    """(header, records, bytes of complete lines) of a results file; a truncated last line is left out."""
    data = Path(path).read_bytes() if Path(path).exists() else b""
    lines = data.split(b"\n")
    good = len(data) if data.endswith(b"\n") or not data else len(data) - len(lines[-1])
    complete = lines[:-1]  # the part after the last newline is empty or a truncated line
    header, records = None, []
    for n, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise ResultsFileError(f"{path}: line {n + 1} is not JSON (only a truncated last line is dropped)") from None
        if header is None:
            if isinstance(obj, dict) and obj.get("format") in EARLIER_FORMATS:
                raise ResultsFileError(
                    f"{path}: written in results format {obj['format']!r}, whose design differs from this version's "
                    f"{FORMAT!r} ({EARLIER_FORMATS[obj['format']]}; now a data set is split once for every "
                    "setting): its tasks cannot be continued; use another --out")
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise ResultsFileError(f"{path}: not a simulation results file (no {FORMAT} header)")
            header = obj
        else:
            records.append(obj)
    if header is None and data[:good].strip():
        raise ResultsFileError(f"{path}: no header line")
    return header, records, good


def check_header(path: str | os.PathLike, found: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Refuse a results file written under another design, naming what differs."""
    diff = [k for k in sorted(set(found) | set(wanted)) if found.get(k) != wanted.get(k)]
    if diff:
        what = ", ".join(f"{k} {found.get(k)!r} in the file, {wanted.get(k)!r} asked for" if k != "grid" else
                         "grid of settings" for k in diff)
        raise ResultsFileError(f"{path}: written by a run of another design ({what}); "
                               "use another --out or the file's own settings")


def pending_tasks(settings: Iterable[Setting], datasets: int, done: Iterable[dict[str, Any]]) -> list[Task]:
    """The (setting, index) pairs of the selection not yet in `done`: data set by data set, each under every
    setting in grid order (so a part of the grid covers every setting, and a data set is made once)."""
    have = {(r["setting"], r["index"]) for r in done}
    return [(s.index, i) for i in range(datasets) for s in settings if (s.index, i) not in have]


def chunks(tasks: Sequence[Task], size: int) -> list[list[Task]]:
    """`tasks` cut into batches of `size` (the unit a worker runs)."""
    return [list(tasks[k:k + size]) for k in range(0, len(tasks), size)]


def guided_chunks(tasks: Sequence[Task], *, largest: int = MAX_BATCH, smallest: int = MIN_BATCH,
                  guide: int = GUIDE) -> list[list[Task]]:
    """`tasks` cut into batches that shrink towards the end: each is 1/`guide` of the tasks not yet cut, within
    `smallest`..`largest` (guided self-scheduling). Large batches keep the per-batch cost of the scheduler
    and the client small; the small last ones let the workers finish together instead of one waiting on
    the other's last large batch (with 64-task batches, 2 workers of a 1,512-task run were busy ~96% of
    its wall time). The order of the tasks is kept."""
    out, k = [], 0
    while k < len(tasks):
        size = max(smallest, min(largest, -(-(len(tasks) - k) // guide)))
        out.append(list(tasks[k:k + size]))
        k += size
    return out


def run(
    out: str | os.PathLike,
    settings: Sequence[Setting],
    datasets: int,
    *,
    master_seed: int,
    resume: bool = False,
    n_sites: int = N_SITES,
    mechanism: str = "classic",
    ties: str = "strict",
    alpha: float = 0.05,
    executor: Executor | None = None,
    batch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Run every task of `settings` x range(`datasets`) not yet in the results file `out`.

    `resume` continues an existing file of the same design (else an existing
    file with results is refused); `executor` maps batches of tasks to their
    records (default: in this process, in order; `dask_backend.dask_executor`
    spreads them over Dask workers); `batch` tasks go to a worker at a time
    (default: up to 64, fewer in a small run so that every worker gets some);
    `progress(done, total)` is called after each batch. Returns counts:
    total, skipped (already done), run, failed.
    """
    path = Path(out)
    wanted = design_header(master_seed, n_sites=n_sites, mechanism=mechanism, ties=ties, alpha=alpha)
    header, records, good = read_results(path)
    if header is not None:
        check_header(path, header, wanted)
        if records and not resume:
            raise ResultsFileError(f"{path} already holds {len(records)} results: pass --resume (resume=True) "
                                   "to continue it, or choose another output")
    total = len(settings) * datasets
    todo = pending_tasks(settings, datasets, records)
    counts = {"total": total, "skipped": total - len(todo), "run": 0, "failed": 0}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+b" if path.exists() else "wb") as fh:
        fh.truncate(good)  # drops a truncated last line
        fh.seek(good)
        if header is None:
            fh.write((dumps(wanted) + "\n").encode())
            fh.flush()
        if progress:
            progress(counts["skipped"], total)
        run_batches = executor or (lambda bs, h: (run_tasks(b, h) for b in bs))
        batches = guided_chunks(todo) if batch is None else chunks(todo, batch)
        for recs in run_batches(batches, wanted):
            fh.write("".join(dumps(r) + "\n" for r in recs).encode())
            fh.flush()
            counts["run"] += len(recs)
            counts["failed"] += sum(r["error"] is not None for r in recs)
            if progress:
                progress(counts["skipped"] + counts["run"], total)
    if counts["run"] != len(todo):
        raise RuntimeError(f"the executor returned {counts['run']} of {len(todo)} tasks' results; "
                           "run again with resume to finish the rest")
    return counts
