"""`RoundOffers`: a site counts distinct aggregators offering the very same query, and a flood of one
aggregator's offers evicts only that aggregator's own (never an honest aggregator's offer of a real round)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from secagg_roc.deploy.site_offers import RoundOffers

from deploy_client import make_query


def q(number: int, x: str = "y"):
    return make_query("study", number, "sum", {"x": x})


def test_a_round_is_ready_only_once_need_distinct_aggregators_offered_the_same_query() -> None:
    book = RoundOffers(need=2, n_aggregators=3)
    assert book.offer(q(5), 2) == 1
    assert book.offer(q(5), 2) == 1  # the same aggregator again counts once
    assert book.offer(q(5, "z"), 0) == 1  # another query under the same number is another round
    assert book.offer(q(5), 1) == 2
    book.forget(q(5))
    assert book.offer(q(5), 0) == 1  # answered and forgotten: counting starts over (the log decides anyway)


@settings(max_examples=50, deadline=None)
@given(flood=st.integers(1, 300), cap=st.integers(1, 40))
def test_a_flooding_aggregator_evicts_only_its_own_offers(flood: int, cap: int) -> None:
    book = RoundOffers(need=2, n_aggregators=3, cap=cap)
    book.offer(q(1), 0)  # an honest aggregator's offer of the real round
    for i in range(flood):
        book.offer(q(10_000 + i), 2)  # the malicious one's own rounds
    assert book.offer(q(1), 1) == 2  # the second honest offer still finds the first
    assert len(book) <= cap + 1  # the flood is bounded by the cap
