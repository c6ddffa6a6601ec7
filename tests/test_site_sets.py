"""Contributor sets are checked once per process, not once per site: no O(K^2) term in an embedded round.

`site_sets` is what every site's plan copy, round check and ledger use to compare contributor sets.
The properties: the canonical set is the sorted set whatever the order or repeats; `same_sites` accepts
exactly the canonical list (the check that a round names its run's set); and an embedded round reads
each distinct set a bounded number of times, however many sites check it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import secagg_roc.stats as sr
from secagg_roc import Policy, Study
from secagg_roc import site_sets
from secagg_roc.errors import PolicyError
from secagg_roc.messages import Query, RoundId
from secagg_roc.plans.runner import join_params
from secagg_roc.site_sets import same_sites, site_set

NAMES = st.lists(st.text(alphabet="abcxyz-_.0123", min_size=1, max_size=4), min_size=1, max_size=12)


@given(NAMES, st.randoms(use_true_random=False))
def test_the_canonical_set_is_the_sorted_set_whatever_the_order_or_repeats(names, rnd):
    shuffled = list(names) + names[: len(names) // 2]
    rnd.shuffle(shuffled)
    a, b = site_set(tuple(names)), site_set(shuffled)
    assert a.names == tuple(sorted(set(names))) and a.members == frozenset(names)
    assert b.names == a.names and b.members == a.members
    assert b is a  # equal sets are one object while cached: the checks that follow are identity checks


@given(NAMES, st.randoms(use_true_random=False))
def test_same_sites_accepts_exactly_the_sorted_list_without_repeats(names, rnd):
    expected = site_set(names)
    canonical = sorted(set(names))
    assert same_sites(canonical, expected) and same_sites(tuple(canonical), expected)
    assert not same_sites(canonical + canonical[:1], expected)  # a name twice
    assert not same_sites(canonical[:-1], expected)  # one missing
    assert not same_sites(canonical + ["zzzzz"], expected)  # one more
    if len(canonical) > 1:
        swapped = list(canonical)
        i = rnd.randrange(len(swapped) - 1)
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
        assert not same_sites(swapped, expected)  # out of order
    assert not same_sites(",".join(canonical), expected) and not same_sites(None, expected)
    assert not same_sites(frozenset(canonical), expected)  # a set has no order to check
    assert not same_sites([*canonical[:-1], 7], expected)  # a name that is not a string


def test_a_list_changed_in_place_is_read_again():
    names = ["a", "b"]
    assert same_sites(names, site_set(("a", "b")))
    names.append("c")  # the same object, other names: lists are never cached by identity
    assert not same_sites(names, site_set(("a", "b")))
    assert same_sites(names, site_set(("a", "b", "c")))


@pytest.mark.parametrize("named", [
    ["s0", "s1", "s2"],  # one site missing
    ["s0", "s1", "s2", "s3", "s3"],  # one site twice
    ["s1", "s0", "s2", "s3"],  # out of order
    "s0,s1,s2,s3",  # not a list
])
def test_every_site_refuses_a_round_naming_another_set_than_its_join(named):
    rng = np.random.default_rng(3)
    sites = {f"s{i}": {"y": rng.integers(0, 2, 40), "x": rng.standard_normal(40)} for i in range(4)}
    policy = Policy(privacy_level=1, min_sites=2, roles={"label": ["y"], "covariate": ["x"]})
    study = Study.local(sites, policy=policy)
    args = {"y": "y", "X": ["x"], "family": "logit", "weights": None, "names": None, "max_iter": 25, "tol": 1e-8}
    study.aggregate("run.join", join_params("g1", "glm", args, study.policy.digest()))
    design = {"kind": "arrays", "y": "y", "X": ["x"], "weights": None}

    def step_one(contributors):  # as an analyst colluding with every aggregator would send it to the sites
        return study.federation._query("glm.means", {"run": "g1", "step": 1, "contributors": contributors,
                                                     "design": design}, 16)

    for name, site in study.site_objects.items():
        with pytest.raises(PolicyError, match=f"site '{name}': round 1 of run 'g1'.*names the contributor set"):
            site.vet(step_one(named))
        site.vet(step_one(sorted(sites)))  # the join's set: the plan's next step
    total = study.aggregate("glm.means", {"run": "g1", "step": 1, "contributors": sorted(sites), "design": design},
                            frac_bits=16)
    assert total.contributors == tuple(sorted(sites))


def test_query_parameters_are_parsed_once_and_every_caller_gets_a_copy():
    q = Query(RoundId("st", 1, bytes(32)), "sum", '{"contributors": ["a", "b"], "run": "r"}', 32)
    first = q.params
    first["run"] = "changed"
    assert q.params["run"] == "r" and q.contributors == ("a", "b") and q.contributors is q.contributors
    assert Query(RoundId("st", 1, bytes(32)), "sum", '{"contributors": "a"}', 32).contributors is None


@pytest.mark.parametrize("k", [40, 320])
def test_an_embedded_round_reads_each_contributor_set_a_bounded_number_of_times(monkeypatch, k):
    sites = {f"s{i:04d}": {"x": np.ones((1, 3))} for i in range(k)}
    study = Study.local(sites, policy=Policy(privacy_level=1, analyses=["sum"]))
    assert float(np.sum(sr.column_sums(study, "x"))) == 3.0 * k
    reads = []
    real = site_sets._read
    monkeypatch.setattr(site_sets, "_read", lambda names: reads.append(len(names)) or real(names))
    total = sr.column_sums(study, "x")  # a join and a sum, every one of the k sites checking the set
    assert float(np.sum(total)) == 3.0 * k
    # Each distinct set object is read once (the join's release, the round's parameters, ...), not once per
    # site: before, every site sorted, hashed and compared the k names itself, k^2 work per round.
    assert 0 < len(reads) <= 8, reads
