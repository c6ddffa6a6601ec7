"""The garbage collector's pace while a worker runs a batch of simulation tasks: `fewer_collections`.

Run by a simulation worker (serial `run_tasks` or a Dask worker's). A task makes and drops tens of
thousands of small container objects (messages, shares, plan steps); with the interpreter's default
first-generation threshold (700 net allocations) that is ~0.8 young collections per task, each walking
the objects that survived, ~0.8 ms per task of ~18 (4-5% of the CPU, measured with `gc.callbacks`).
A threshold of 10,000 leaves ~0.03 collections per task and ~0.1 ms. Nothing a task computes depends on
when garbage is collected (no weak references or finalizers decide a result; identity checks hold the
objects they compare), so results are the same bytes; cycles are still collected, only in larger
batches, and the thresholds are put back once the last batch running in the process ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["BATCH_GEN0_THRESHOLD", "fewer_collections"]

#: The first generation's threshold while tasks run (the interpreter's default is 700).
BATCH_GEN0_THRESHOLD = 10_000

_LOCK = threading.Lock()
_state: dict[str, object] = {"depth": 0, "saved": None}


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Raise the first generation's threshold (never lower it) for the block's duration.

    Re-entrant and safe for batches running in threads of one process (a Dask worker's): the first
    to enter saves the thresholds, the last to leave restores them."""
    with _LOCK:
        if _state["depth"] == 0:
            saved = gc.get_threshold()
            _state["saved"] = saved
            if saved[0] < BATCH_GEN0_THRESHOLD:
                gc.set_threshold(BATCH_GEN0_THRESHOLD, *saved[1:])
        _state["depth"] = int(_state["depth"]) + 1
    try:
        yield
    finally:
        with _LOCK:
            _state["depth"] = int(_state["depth"]) - 1
            if _state["depth"] == 0:
                gc.set_threshold(*_state["saved"])  # type: ignore[misc]
                _state["saved"] = None
