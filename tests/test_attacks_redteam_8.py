"""Red team, round 8: a curious analyst against rank statistics of near copies and of label definitions
(embedded `Study.local`, the library API only; `analyst_spy.Spy` reads every released total).

The near-copy rule for rank statistics (`copies._near_order`, red team 3) counted records out of one score's
order in the other's. Rank statistics compare the records of one class of a label with those of the other
only, so a count is no measure of what they tell. Holes found, each one record's rank (or the number of
records it passed) before the fix:

1. two scores equal but that four pairs of controls trade values (far apart: four records out of the order,
   eight off the identity, so neither the order nor the map rule saw a near copy, yet no case's count of
   controls below it changes) and one case is rescored: two secure AUCs under a policy of rank analyses only
   (no ``glm``/``brier``/``bootstrap``, so no class residuals) gave the number of controls that case passed
   (18 for the true 16, 45 for 49: the AUC's rounding);
2. the same with a monotone map that keeps every score in its bucket of the histogram grid (so the crossing
   rule sees no crossing, and its residual off any affine map is spread over all records) and four adjacent
   case-control pairs trading values as padding (adjacent at h1; pooled, other sites' records lie between
   them): 27.0 released for a true change of 29, the case's 14 passes and the padding's 15 (a case moved by
   0.2: 81.5, 66 and 15), under every policy whose calibration grid does not cross the histogram's;
3. two label definitions equal but for four adjacent case-control pairs flipped both ways (each moves the rank
   sum by one rank) and one control made a case: two secure AUCs gave that record's pooled rank, 318 of the
   true 311 among 600 (so its score, to about 0.01), under the default policy too: nine records differ, so
   the equality rule passed them, and the binned rule of red team 7 (`label_cells`) judges the released bins
   of histograms and calibration curves, not the secure AUC's kept buckets;
4. (found while fixing 1) hole 1 at a site of 11 cases: classes under `copies.MIN_RECORDS` are left out of the
   placement rule (a handful of placements agree by chance), unless the copy equals the score on half of the
   records or more.

Fixed in `queries.rank_copies` (called by `queries.copies` at every join): two scores are near copies when, for
some label the policy names, the shifts of a class's placements (each record's count of the other class's
records below it at the site), taken as a multiset (values traded within a class move none), move in at most
a quarter of the class and those moves are dominated by 1..min_cell-1 records;
two labels are near copies under a score the policy names when all but 1..min_cell-1 of the records where they
differ pair up, flipped both ways, with fewer than min_cell records between them (where they differ in at most
a quarter of the records: unrelated flags, such as sex beside the outcome under a policy without roles, pair
up as neighbours by chance). The refusal names the arrays
and the rule, never a count or a value (asserted: one text whatever the record holds).

Attacks that held (played once, or asserted below):

* a score copy differing in one record only, or in four: the equality rule (red team 3);
* two labels differing in one record: the equality rule; in 8 records all one way, the difference of two
  secure AUCs is a sum of 8 ranks (a mix), which the new rule lets run (asserted below);
* the bucket-keeping map of hole 2 under the default policy: the calibration grid crosses the histogram grid,
  so `crossing.crossing_copies` refused even the exact copy at sites without the moved case (a cost, below);
* DeLong sums and ROC-GLM placement sums over two scores: each score's placements are taken against its own
  DP-noised released sample, so their difference is noisy over all records; and the join rule above refuses
  the pair for every analysis alike;
* repeated DP releases (the ROC-GLM's, the partial AUC's, DistDP and LocalDP histograms) under a budget of one
  Gaussian release: a repeat replays from the ledger (no charge), the same score under another label or another
  score under the same label is a new release and refused over budget, and the DP histograms are charged too;
* the newer analyses the brief named beyond these (three-class ROC surfaces / VUS, cross-validation folds) are
  not in the library: nothing to play.

Residuals, by design (`queries.rank_copies`): padding pairs a few more than min_cell records apart blur the rank
they pad by a few records each; a record moved past records of other sites only shifts no placement at its own.
Left open (a strict xfail below): four controls at the bottom of a site's order made cases beside one in the
middle: the two AUCs' rank sums differ by 363 for its rank of 267 among 600 (the padding's pooled ranks, 8 to 35,
add 100, which the analyst can bound, not know). Counting a lone flipped record within min_cell of an end of the
order as no record in effect closes it, but keeps honest outcome definitions differing in exactly min_cell
records, one of them near an end, out of every analysis (`test_attacks_redteam_api`'s five patients, one with 3
records below it: 79 % of one-way differences of 5 records at sites of 40, 42 % at 100).

Costs: honest noisy refits of a score at small sites, whose records cross records of the other class in a few
places only, are near copies now (they were when no record moved within its class): 100 draws each of uniform
scores with Gaussian noise, labels 40 % cases, at 40 records a site sd 0.01: 17 -> 82 % refused, sd 0.05: 0 -> 6 %;
at 100 records sd 0.002: 1 -> 64 %; none at 400 or more, nor unrelated scores (500 draws each at 20 to 60
records; a class under `MIN_RECORDS` is not judged so). `test_attacks_combined`'s second score over sites of 30
records (p plus noise of sd 0.1 on a 0.05 grid) moved 3 of one site's 15 cases only and is refused now: it takes
sd 0.15 there. Two labels differing in a few records at random (100 draws each, scores uniform, the label
drawn from them) both ways: in 5 records, 43 % refused at 40 records a site, 16 % at 100, 5 % at 400, none at
2,000; in 8, 31 %, 9 %, none. One-way differences (a 30-day beside a 90-day outcome) are never judged so.
The demo and rank analyses of GBSG2 over two scores and two outcomes still run (asserted below). Join checks:
`near_copies` for 6 first joins (2 labels x 3 scores, 5,000 records, no verdict cached) 0.023 s -> 0.087 s
(loaded machine, best of 3); verdicts are cached by digest as before.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import secagg_roc as sr
from secagg_roc import Policy
from secagg_roc.queries.rank_copies import label_rank_shifts, placement_shifts

import analyst_spy

Q = 5  # the default policy's min_cell_count
RANKS_ONLY = ("secure_auc",)


def _text(spy: analyst_spy.Spy) -> str:
    return re.sub(r"run '[0-9a-f]+'", "run R", str(spy.error))


def _pooled(data: dict, key: str) -> np.ndarray:
    return np.concatenate([d[key] for d in data.values()])


def _grid_sites(rng: np.random.Generator, n: int = 200, score=lambda p: p.copy()) -> dict:
    """Three sites of `n` records, distinct scores on the histogram grid (k / 1000) and labels y."""
    data = {}
    for k in range(3):
        p = rng.permutation(np.arange(1, 1000))[:n] / 1000.0
        data[f"h{k}"] = {"y": (rng.random(n) < 0.5).astype(np.int64), "p": p, "p2": score(p)}
    return data


def _neighbour_pairs(y: np.ndarray, p: np.ndarray, count: int = 4) -> list[tuple[int, int]]:
    """`count` disjoint pairs of records adjacent in the order of p, one case and one control each."""
    order, pairs, i = np.argsort(p), [], 0
    while len(pairs) < count:
        a, b = order[i], order[i + 1]
        if y[a] != y[b]:
            pairs.append((int(a), int(b)))
            i += 2
        else:
            i += 1
    return pairs


# -- 1. controls trading values, one case rescored ---------------------------------------------------------------


def _controls_trade(delta: float, traders: int = 0) -> tuple[dict, int]:
    """p2 = p but at h1: four pairs of controls far apart trade values and one case moves up by `delta`; and
    `traders` pairs of the other cases trade values too (their placements move, their sum does not)."""
    data = _grid_sites(np.random.default_rng(1))
    h = data["h1"]
    for cls, pairs in ((0, 4), (1, traders)):
        members = np.flatnonzero(h["y"] == cls)[1:]
        ordered = members[np.argsort(h["p"][members])]
        for i in range(pairs):
            a, b = ordered[i], ordered[-1 - i]
            h["p2"][a], h["p2"][b] = h["p"][b], h["p"][a]
    case = int(np.flatnonzero(h["y"] == 1)[0])
    h["p2"][case] = min(0.999, h["p"][case] + delta)
    return data, case


@pytest.mark.parametrize("policy, traders", [(RANKS_ONLY, 0), (("rocglm", "score_histogram", "secure_auc"), 0),
                                             (RANKS_ONLY, 40)])
def test_records_trading_values_do_not_hide_a_rescored_case_from_two_secure_aucs(policy, traders):
    # Before the fix: (AUC(p2) - AUC(p)) P N = 18.0 for the 16 controls passed (delta 0.05), 45.0 for 49 (0.2).
    # With 40 pairs of cases trading values as well, each case's own placement shift was no measure: most cases'
    # placements moved, their sum by the one case's passes only.
    texts = set()
    for delta in (0.05, 0.2):
        data, case = _controls_trade(delta, traders)
        spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "p2"]},
                                                                 analyses=policy)))
        a, b = spy.attempt(sr.secure_auc, "y", "p"), spy.attempt(sr.secure_auc, "y", "p2")
        y, p = _pooled(data, "y"), _pooled(data, "p")
        passed = int(np.sum((p[y == 0] > data["h1"]["p"][case]) & (p[y == 0] < data["h1"]["p2"][case])))
        if a is not None and b is not None:
            n1 = int(y.sum())
            assert abs((float(b) - float(a)) * n1 * (y.size - n1) - passed) > 10
        assert b is None and spy.released() == [], "the analyst received totals over the copy"
        texts.add(_text(spy))
    (text,) = texts  # one refusal, whatever the case's score
    assert "site 'h1' does not take part" in text and "ranks the records as" in text


def test_a_site_of_eleven_cases_does_not_hide_a_rescored_case_among_controls_trading_values():
    # Classes under MIN_RECORDS are judged where the copy is exact on half of the records or more.
    data, case = _controls_trade(0.2)
    h = data["h1"]
    keep = np.r_[np.flatnonzero(h["y"] == 0), case, np.flatnonzero(h["y"] == 1)[1:11]]
    data["h1"] = {k: v[keep] for k, v in h.items()}
    spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "p2"]},
                                                             analyses=RANKS_ONLY)))
    assert spy.attempt(sr.secure_auc, "y", "p2") is None and spy.released() == []
    assert "site 'h1' does not take part" in _text(spy) and "ranks the records as" in _text(spy)


# -- 2. a monotone map within the buckets, neighbours trading values as padding -----------------------------------


def _in_bucket(p: np.ndarray) -> np.ndarray:
    """Strictly increasing on the grid k / 1000, every value kept in its bucket; 0.00045 off any affine map."""
    return p + 0.0009 * (np.rint(p * 1000) % 2)


def _neighbours_trade(delta: float) -> tuple[dict, int]:
    data = _grid_sites(np.random.default_rng(1), score=_in_bucket)
    h = data["h1"]
    for a, b in _neighbour_pairs(h["y"], h["p"]):
        h["p2"][a], h["p2"][b] = _in_bucket(h["p"][b]), _in_bucket(h["p"][a])
    order = np.argsort(h["p"])
    case = int([j for j in order[order.size // 3:] if h["y"][j] == 1][0])
    h["p2"][case] = _in_bucket(h["p"][case] + delta)
    return data, case


def test_a_monotone_copy_padded_by_neighbours_trading_values_does_not_give_a_cases_passes():
    # Before the fix: 27.0 released for a true change of 29 (the case's 14 passes, the padding's 15).
    texts = set()
    for delta in (0.05, 0.2):
        data, case = _neighbours_trade(delta)
        spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "p2"]},
                                                                 analyses=RANKS_ONLY)))
        assert spy.attempt(sr.secure_auc, "y", "p2") is None and spy.released() == []
        texts.add(_text(spy))
    (text,) = texts
    assert "site 'h1' does not take part" in text and "score p2 ranks the records as p does" in text


# -- 3. two label definitions: neighbours flipped both ways, one record flipped -----------------------------------


def _labels_padded(rng_seed: int = 3, where: float = 0.5) -> tuple[dict, int]:
    """y2 = y but at h1: four adjacent case-control pairs flipped both ways, and one control (at the `where`
    quantile of the site's scores) made a case."""
    data = _grid_sites(np.random.default_rng(rng_seed))
    for d in data.values():
        d["y2"] = d["y"].copy()
    h = data["h1"]
    pairs = _neighbour_pairs(h["y"], h["p"])
    for a, b in pairs:
        h["y2"][a], h["y2"][b] = 1 - h["y"][a], 1 - h["y"][b]
    used = {i for pair in pairs for i in pair}
    order = np.argsort(h["p"])
    r = int([j for j in order[int(order.size * where):] if j not in used and h["y"][j] == 0][0])
    h["y2"][r] = 1
    return data, r


@pytest.mark.parametrize("analyses", [RANKS_ONLY, None])
def test_two_label_definitions_padded_by_neighbours_do_not_give_a_records_rank(analyses):
    # Before the fix: rank sums from the two AUCs differed by 318.4 for the record's true pooled rank 311 (of 600).
    kwargs = {} if analyses is None else {"analyses": analyses}
    texts = set()
    for where in (0.5, 0.8):
        data, r = _labels_padded(where=where)
        spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y", "y2"], "score": ["p"]},
                                                                 **kwargs)))
        a, b = spy.attempt(sr.secure_auc, "y", "p"), spy.attempt(sr.secure_auc, "y2", "p")
        if a is not None and b is not None:
            y, y2, p = _pooled(data, "y"), _pooled(data, "y2"), _pooled(data, "p")
            sums = [float(auc) * y_.sum() * (y_.size - y_.sum()) + y_.sum() * (y_.sum() + 1) / 2
                    for auc, y_ in ((a, y), (b, y2))]
            rank = int(np.sum(p <= data["h1"]["p"][r]))
            assert abs(sums[1] - sums[0] - rank) > 30
        assert b is None and spy.released() == []
        texts.add(_text(spy))
    (text,) = texts
    assert "site 'h1' does not take part" in text and "label y2 differs from y in records whose ranks under score p" in text


@pytest.mark.xfail(strict=True, reason="VULN: lone flipped records at an end of the score's order pad a label copy "
                   "(fix: `rank_copies.label_rank_shifts` counts a flipped record with fewer than min_cell records "
                   "below or above it as no record in effect; cost: honest outcome definitions differing in exactly "
                   "min_cell records, one near an end, are refused, as test_attacks_redteam_api's are)")
def test_two_label_definitions_padded_at_the_bottom_of_the_order_do_not_give_a_records_rank():
    # Four controls at the bottom of h1's scores made cases (each adds a rank of about 1 to 15 of 600) and one in the
    # middle: the two AUCs' rank sums differ by its rank plus a few tens.
    data = _grid_sites(np.random.default_rng(3))
    for d in data.values():
        d["y2"] = d["y"].copy()
    h = data["h1"]
    order = [j for j in np.argsort(h["p"]) if h["y"][j] == 0]
    h["y2"][order[:4]] = 1
    h["y2"][order[len(order) // 2]] = 1
    spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y", "y2"], "score": ["p"]},
                                                             analyses=RANKS_ONLY)))
    assert spy.attempt(sr.secure_auc, "y2", "p") is None and spy.released() == []
    assert "label y2 differs from y in records whose ranks under score p" in _text(spy)


# -- what still runs ----------------------------------------------------------------------------------------------


def test_a_later_outcome_definition_differing_one_way_in_eight_records_still_runs():
    data = _grid_sites(np.random.default_rng(4))
    for d in data.values():
        d["y2"] = d["y"].copy()
    h = data["h1"]
    h["y2"][np.flatnonzero(h["y"] == 0)[:8]] = 1  # eight more events by day 90 than by day 30
    spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y", "y2"], "score": ["p"]},
                                                             analyses=RANKS_ONLY)))
    assert spy.attempt(sr.secure_auc, "y2", "p") is not None, spy.error


def test_a_score_refitted_with_noise_at_sites_of_400_still_runs():
    rng = np.random.default_rng(6)
    data = {f"h{k}": {"y": (rng.random(400) < 0.4).astype(np.int64), "p": rng.random(400)} for k in range(3)}
    for d in data.values():
        d["p2"] = np.clip(d["p"] + rng.normal(0, 0.01, 400), 0, 1)
    spy = analyst_spy.Spy(sr.Study.local(data, policy=Policy(roles={"label": ["y"], "score": ["p", "p2"]},
                                                             analyses=RANKS_ONLY)))
    assert spy.attempt(sr.secure_auc, "y", "p2") is not None, spy.error


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(12, 300), k=st.integers(Q, 40))
def test_labels_differing_one_way_are_never_near_copies_by_rank(seed, n, k):
    rng = np.random.default_rng(seed)
    s, y = rng.random(n), (rng.random(n) < 0.5).astype(np.int64)
    flipped = np.flatnonzero(y == 0)[:k]
    y2 = y.copy()
    y2[flipped] = 1
    assert not label_rank_shifts(y, y2, s, Q) or flipped.size < Q  # (fewer: the equality rule's)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(12, 300), share=st.floats(0.1, 0.9))
def test_unrelated_flags_are_never_near_copies_by_rank(seed, n, share):
    # (Under a policy without roles every 0/1 array is a label: sex beside the outcome, whose differences pair
    # up as neighbours by chance, was refused before labels differing in over a quarter of records were let be.)
    rng = np.random.default_rng(seed)
    s = rng.random(n)
    y, y2 = (rng.random(n) < share).astype(np.int64), (rng.random(n) < 0.5).astype(np.int64)
    assert not label_rank_shifts(y, y2, s, Q) or 4 * np.count_nonzero(y != y2) <= n


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(12, 300), curve=st.sampled_from(["square", "sqrt", "logit"]))
def test_monotone_recalibrations_and_unrelated_scores_shift_no_placement_rule(seed, n, curve):
    rng = np.random.default_rng(seed)
    a, y = rng.uniform(0.01, 0.99, n), (rng.random(n) < 0.5).astype(np.int64)
    b = {"square": a**2, "sqrt": np.sqrt(a), "logit": np.log(a / (1 - a))}[curve]
    assert not placement_shifts(a, b, y, Q, 12)  # one order: no placement moves
    if n >= 100:
        assert not placement_shifts(a, rng.random(n), y, Q, 12)  # unrelated: most placements move


def test_rank_analyses_of_gbsg2_over_two_scores_and_two_outcomes_and_the_demo_still_run(tmp_path):
    from secagg_roc.datasets import load_gbsg2
    from secagg_roc.demo import run_demo

    d = load_gbsg2()
    site = np.random.default_rng(0).integers(0, 3, d["age"].size)
    z = 0.03 * (d["pnodes"] - 5) + 0.02 * (d["tsize"] - 30) + 0.5 * (d["tgrade"] == "III")
    arrays = {"y": (d["cens"] == 1).astype(np.int64), "y2": ((d["cens"] == 1) & (d["time"] <= 1500)).astype(np.int64),
              "p": 1 / (1 + np.exp(-z)), "p2": 1 / (1 + np.exp(-(z + 0.01 * (d["age"] - 50))))}
    study = sr.Study.local({f"s{k}": {a: v[site == k] for a, v in arrays.items()} for k in range(3)},
                           policy=Policy(roles={"label": ["y", "y2"], "score": ["p", "p2"]}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aucs = [sr.secure_auc(study, label, score) for label in ("y", "y2") for score in ("p", "p2")]
        assert all(0.5 < float(a) < 1 for a in aucs) and run_demo(tmp_path) is not None
