"""The runner's default batches: every task once, in order, shrinking towards the end of a run."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from secagg_roc.simulation.runner import MAX_BATCH, MIN_BATCH, guided_chunks


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=20_000))
def test_guided_batches_hold_every_task_once_in_order_within_the_size_bounds(n: int) -> None:
    tasks = [(k % 126, k // 126) for k in range(n)]
    batches = guided_chunks(tasks)
    assert [t for b in batches for t in b] == tasks
    sizes = [len(b) for b in batches]
    assert all(MIN_BATCH <= s <= MAX_BATCH for s in sizes[:-1])
    assert all(0 < s <= MAX_BATCH for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # large first, the smallest at the end


def test_a_large_run_goes_out_in_full_batches_and_ends_in_small_ones() -> None:
    sizes = [len(b) for b in guided_chunks([(0, k) for k in range(100_000)])]
    assert sizes[0] == MAX_BATCH and sizes.count(MAX_BATCH) > 0.9 * len(sizes)
    assert sizes[-1] <= MIN_BATCH
    # The paper grid's benchmark subset (126 settings x 12 data sets): its last batches take ~0.1 s each.
    small = [len(b) for b in guided_chunks([(0, k) for k in range(1512)])]
    assert small[0] == 1512 // 8 and max(small[-5:]) <= MIN_BATCH
