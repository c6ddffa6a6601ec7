"""Scale-out of the simulation on Dask (optional extra: ``pip install 'secagg-roc[dask]'``).

`dask_executor` returns an executor for `runner.run`: batches of tasks go to
the workers of a `distributed.LocalCluster` started here (`workers` processes,
one thread each: the work is Python-bound; no profiler, no eager memory
trimming) or of an existing scheduler
(`scheduler`, e.g. ``tcp://10.0.0.5:8786``). At most a few batches per worker
are in flight, so a grid of a million tasks never sits in the scheduler at
once; records come back as batches finish (any order) and the runner appends
them. Every task's numbers depend only on its seeds, so the lines are the same
bytes as a serial run's, in another order.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

from ..extras import require
from .runner import Executor, Task, run_tasks

__all__ = ["dask_client", "dask_executor"]

#: Batches in flight per worker thread.
IN_FLIGHT = 3


@contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None) -> Iterator[Any]:
    """A `distributed.Client` on a new LocalCluster of `workers` processes, or on the scheduler at `scheduler`."""
    require("dask", "secagg-roc simulate --workers/--scheduler")
    from distributed import Client, LocalCluster

    if (workers is None) == (scheduler is None):
        raise ValueError("give either workers (a local cluster) or scheduler (an address), not both")
    if scheduler is not None:
        with Client(scheduler) as client:
            yield client
        return
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    import dask

    # The workers' statistical profiler, their 20 ms event-loop tick and 0.5 s system monitor, and glibc's
    # eager memory trimming cost CPU on these short, allocation-heavy tasks (measured on one batch of 180
    # tasks: 40 tasks per worker CPU second with Dask's defaults, 57 without them, 61 in a plain process);
    # a simulation's workers hold little memory and nobody reads the profile. Their memory is still watched
    # (spill, pause and terminate thresholds), once a second instead of every 100 ms: each look wakes the
    # worker's event loop, which takes the interpreter from the task (the loop's own CPU 0.23 -> 0.14 ms per task).
    quiet = {"distributed.worker.profile.enabled": False,
             "distributed.admin.tick.interval": "1s", "distributed.admin.system-monitor.interval": "5s",
             "distributed.worker.memory.monitor-interval": "1s",
             "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}
    with dask.config.set(quiet), LocalCluster(
            n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
            silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        yield client


def dask_executor(client: Any) -> Executor:
    """An executor for `runner.run` that runs batches of tasks on `client`'s workers."""
    from distributed import as_completed

    def execute(batches: list[list[Task]], header: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
        slots = max(1, IN_FLIGHT * sum(client.nthreads().values()))
        pending = iter(batches)
        # range() first: zip() must not take a batch from `pending` that it then drops.
        first = [client.submit(run_tasks, b, header, pure=False) for _, b in zip(range(slots), pending)]
        done = as_completed(first)
        for future in done:
            records = future.result()
            future.release()
            nxt = next(pending, None)
            if nxt is not None:
                done.add(client.submit(run_tasks, nxt, header, pure=False))
            yield records

    return execute
