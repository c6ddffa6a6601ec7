"""Recycled accumulators at a deployed aggregator (`round.POOLED_SUM_BYTES`, `compaction.MAP_BYTES`).

A large sum is accumulated in a buffer from the core's `RecyclingPool`; once its release is logged and is
no longer the newest, the aggregator holds it as a read-only map of its side file, and the buffer is free
for a later sum once nothing references it. What must hold: a recycled buffer never aliases a release still
held (or one a reply is still being sent from), and every release equals the one an aggregator without
recycling or compaction holds. The thresholds are lowered so that the small releases of these rounds take
the large-sum path (the product uses it from 1 MiB up).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import secagg_roc.deploy.compaction as compaction
import secagg_roc.deploy.store as store
import secagg_roc.round as round_module
from secagg_roc.messages import AggregateShare

from test_deploy_compaction import config, drive, observed, twins  # noqa: F401  (config: the fixture)
from test_deploy_state import make_sites


@pytest.fixture()
def large_path(monkeypatch):
    """Every release takes the large-sum path: pooled accumulator, side file, mapped once older."""
    monkeypatch.setattr(store, "SIDE_BYTES", 1)
    monkeypatch.setattr(compaction, "MAP_BYTES", 0)
    monkeypatch.setattr(round_module, "POOLED_SUM_BYTES", 0)


def _held(agg) -> dict[int, AggregateShare]:
    core = agg.state.core
    return {n: core.rounds[n].released for n in core._release_order if core.rounds[n].released is not None}


def test_a_recycled_accumulator_never_aliases_a_held_release_or_one_being_sent(config, tmp_path: Path,  # noqa: F811
                                                                                 large_path, monkeypatch) -> None:
    compact, full = twins(config, tmp_path)
    sites = make_sites(config)
    pool = compact[0].state.core.accumulators
    handed: list[bool] = []  # per accumulator handed out: whether it was a reused buffer
    find = pool._take_free

    def spy(nbytes: int):
        buf = find(nbytes)
        handed.append(buf is not None)
        return buf

    monkeypatch.setattr(pool, "_take_free", spy)
    sending: list[tuple[np.ndarray, np.ndarray]] = []  # releases a slow reply still reads, with their values
    for n in range(40):
        drive([compact, full], config, sites, n)
        held = _held(compact[0])
        vectors = [r.vector for r in held.values()]
        for i, a in enumerate(vectors):
            for b in vectors[i + 1:]:
                assert not np.shares_memory(a, b), "two held releases share memory"
        if held and n % 3 == 0:
            newest = held[max(held)].vector
            sending.append((newest, newest.copy()))
        for vector, values in sending:
            assert np.array_equal(vector, values), "a buffer still referenced was reused for another sum"
        del sending[:-2]  # a reply ends: its buffer may be reused from now on
        for j in range(2):
            assert observed(compact[j]) == observed(full[j])  # the same releases as without recycling
    # Not vacuous: the older held releases are maps of their side files, and buffers were reused.
    held = _held(compact[0])
    assert any(not r.vector.flags.writeable for r in held.values())
    assert max(held) in held and held[max(held)].vector.flags.writeable  # the newest stays in memory
    assert sum(handed) > len(handed) / 2  # most sums went into a reused buffer


def test_a_mapped_release_survives_a_restart_and_its_side_file_going(config, tmp_path: Path,  # noqa: F811
                                                                      large_path) -> None:
    compact, full = twins(config, tmp_path)
    sites = make_sites(config)
    for n in range(12):
        drive([compact, full], config, sites, n)
    mapped = {n: r for n, r in _held(compact[0]).items() if not r.vector.flags.writeable}
    assert mapped
    values = {n: r.vector.copy() for n, r in mapped.items()}
    for n in range(12, 24):  # compactions drop the old releases' entries and unlink their side files
        drive([compact, full], config, sites, n)
    for n, r in mapped.items():
        assert np.array_equal(r.vector, values[n])  # a reply still being sent from the map reads the same bytes
    compact = [a.restart() for a in compact]
    for j in range(2):
        assert observed(compact[j]) == observed(full[j])
