"""`deploy.quorum.gather_quorum` with a grace computed from the answers so far (what a site fetching a join over
fewer than all sites uses, `site_fetch.fetch_release`): the rest are waited for as long as it says, no longer."""

from __future__ import annotations

import asyncio

from secagg_roc.deploy.quorum import gather_quorum


def _calls(delays: dict[int, float]):
    async def answer(j: int) -> int:
        await asyncio.sleep(delays[j])
        return j
    return [(j, lambda j=j: answer(j)) for j in delays]


def _gather(delays: dict[int, float], grace) -> tuple[dict[int, int], set[int], float]:
    async def go():
        loop = asyncio.get_running_loop()
        start = loop.time()
        got, absent = await gather_quorum(_calls(delays), need=2, deadline=start + 30.0, grace=grace, what="test")
        return got, absent, loop.time() - start
    return asyncio.run(go())


def test_a_grace_computed_from_the_answers_waits_for_a_late_third_answer() -> None:
    # The third answer comes 0.6 s after the quorum: a fixed 0.1 s grace leaves it out, a grace of 2 s
    # chosen from the first answers (as for a join over fewer sites) takes it in, and returns as soon as it came.
    delays = {0: 0.0, 1: 0.05, 2: 0.65}
    got, absent, _ = _gather(delays, 0.1)
    assert sorted(got) == [0, 1] and absent == {2}
    seen: list[dict[int, int]] = []

    def grace(results: dict[int, int]) -> float:
        seen.append(dict(results))
        return 2.0 if 0 in results else 0.1
    got, absent, took = _gather(delays, grace)
    assert sorted(got) == [0, 1, 2] and absent == set()
    assert took < 1.5  # not the whole grace: every aggregator answered
    assert {0: 0, 1: 1} in seen  # the grace was asked once the quorum's answers were in


def test_a_grace_computed_from_the_answers_still_ends_at_its_length() -> None:
    got, absent, took = _gather({0: 0.0, 1: 0.0, 2: 5.0}, lambda results: 0.3)
    assert sorted(got) == [0, 1] and absent == {2}
    assert 0.25 <= took < 2.0
