"""Site queries of the Poisson bootstrap: replicate totals, weights drawn at each site (run by each Site).

Protocol (the plan is `stats.bootstrap`):

* Every site gives each of its own records a Poisson(1) weight per
  replicate, from a key only it holds (`replicate_key`), so no record and no
  weight leaves the site; only secure sums over all contributing sites of
  weighted sums do. Entry 0 of every output is the unweighted sum (the
  estimate itself); entries 1..n_boot are the replicates.
* ``calibration.brier_bootstrap``: sum_i w_bi (p_i - y_i)^2 and sum_i w_bi
  over all records (predictions clipped to the public probability range).
  A replicate that weights fewer than ``min_weighted`` of the site's
  records is drawn again, so every replicate total covers at least q records.
  Where the round names an ``atom`` (dropouts allowed), a site refuses
  replicates that the least atom holding it would pair into cells of fewer
  than min_cell_count records (`_check_atom`).
* ``roc.bootstrap_auc`` and ``roc.bootstrap_sensitivity`` (the non-private
  validation mode only: under DP the plan computes its replicates from the
  release alone) pair the site's cases with the pooled released controls
  (the ROC-GLM's release, reaching the query as the step's derived value
  `NEGATIVES_KEY`). The released controls get public Poisson weights v_bj
  from ``reference_seed``, which the site recomputes from the release
  digest itself and compares with the round's parameter: the analyst
  cannot choose them (chosen weights could single out one control and turn
  a sum into a count below one value). ``roc.bootstrap_auc`` sums, as
  exact integers, sum_i w_bi sum_j v_bj (2 [c_j < x_i] + [c_j = x_i]) and
  sum_i w_bi over the site's cases; ``roc.bootstrap_sensitivity`` sums
  sum_i w_bi ([x_i > u_b] + lam_b [x_i = u_b]) with (u_b, lam_b) the cut at
  which pROC reads the sensitivity at the declared specificity on
  replicate b's weighted controls.

Keys: a site's key comes from the seed sequence of its noise generator
(OS entropy, or the study's seed in a simulation; a deployed site keeps it in
its database, `deploy.site_log.durable_noise_rng`, so a restart keeps the
key), extended without drawing from it, so DP noise is unchanged. A replicate's weights are a function of
that key and the round's public parameters except ``n_boot`` (none of
which depends on the contributor set, ``min_weighted`` included): the same
request gives the same replicates (a repeat, or a run over other sites, adds
nothing), and a larger ``n_boot`` extends the smaller one's replicates
instead of adding fresh ones.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

import numpy as np

from ..stats.bootstrap_arith import (
    MAX_BOOT,
    MAX_CLOSE_PAIRS,
    MIN_BOOT,
    auc_numerators,
    brier_numerators,
    close_pairs,
    key_words,
    placement_bounds,
    poisson_chunks,
    reference_seed,
    sensitivity_numerators,
    specificity_cuts,
)
from .common import labels_scores, param, reference
from .registry import QueryResult, SiteData, site_query

#: The pooled released controls among a step's derived values.
NEGATIVES_KEY = "bootstrap.negatives"
#: Extends the noise generator's seed sequence: far beyond any count of spawned children.
_KEY_TAG = 0x5ECB0075
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_drawn: weakref.WeakKeyDictionary[np.random.Generator, tuple[int, ...]] = weakref.WeakKeyDictionary()


def site_key(site: SiteData) -> tuple[int, ...]:
    """This site's secret bootstrap key: a child of its noise generator's seed sequence (nothing is drawn)."""
    seq = getattr(site.rng.bit_generator, "seed_seq", None)
    if isinstance(seq, np.random.SeedSequence):
        child = np.random.SeedSequence(seq.entropy, spawn_key=(*seq.spawn_key, _KEY_TAG), pool_size=seq.pool_size)
        return tuple(int(x) for x in child.generate_state(8, np.uint32))
    # A generator without a seed sequence: a key drawn once, kept for the generator's life.
    if site.rng not in _drawn:
        _drawn[site.rng] = tuple(int(x) for x in site.rng.integers(0, 2**32, size=8, dtype=np.uint64))
    return _drawn[site.rng]


def replicate_key(site: SiteData, query: str, params: dict[str, Any]) -> tuple[int, ...]:
    """The key of this site's weights in round `query`: its secret key and the parameters without n_boot."""
    # (min_weighted is a policy value, not the run's site count: other set sizes draw no fresh replicates.)
    # (nor the atom bound, a policy check that draws nothing: the weights stay those of the same request before)
    public = {k: v for k, v in params.items() if k not in ("n_boot", "run", "step", "contributors", "atom")}
    blob = json.dumps([query, public], sort_keys=True, separators=(",", ":"))
    return key_words(*(str(k) for k in site_key(site)), blob)


def n_boot(site: SiteData, params: dict[str, Any]) -> int:
    """The declared number of replicates, within the bounds every site enforces."""
    b = param(site, params, "n_boot", int)
    if not MIN_BOOT <= b <= MAX_BOOT:
        raise site.fail(f"n_boot must be between {MIN_BOOT} and {MAX_BOOT}, got {b}")
    return b


def _with_plain(plain: float, replicates: list[np.ndarray], kind: type) -> np.ndarray:
    return np.concatenate([np.array([plain], dtype=kind), *[np.asarray(r, dtype=kind) for r in replicates]])


@site_query("calibration.brier_bootstrap", outputs={"numerator": "float", "weight": "int"})
def bootstrap_brier(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Weighted sums of squared errors and of weights, unweighted first, then per replicate (run by a Site)."""
    y, p = labels_scores(site, params)
    b = n_boot(site, params)
    least = param(site, params, "min_weighted", int)
    if not 1 <= least <= y.size:
        raise site.fail(f"min_weighted must be between 1 and the site's record count, got {least}")
    _check_atom(site, params, b, y.size)
    key = replicate_key(site, "calibration.brier_bootstrap", params)
    nums, dens = [], []
    for _, w in poisson_chunks(key, y.size, b, min_nonzero=least):
        nums.append(brier_numerators(y, p, w))
        dens.append(w.sum(axis=1))
    return QueryResult({"numerator": _with_plain(float(np.sum((p - y) ** 2)), nums, np.float64),
                        "weight": _with_plain(int(y.size), dens, np.int64)}, records=int(y.size))


def _check_atom(site: SiteData, params: dict[str, Any], b: int, records: int) -> None:
    """Refuse replicates that an atom of contributor sets holding this site would pair up into small cells.

    Where the policy allows dropouts, Brier bootstraps over nested sets difference, replicate by replicate, into
    the replicates of their atom (this site's weights do not depend on the set), which holds this site and at
    least ``others`` records of other sites (min_sites - 1 sites of q records): judged as `stats.bootstrap`
    judges a run (`close_pairs`), from this site's record count (which the aggregators see anyway)."""
    atom = params.get("atom")
    if atom is None:
        return
    if not isinstance(atom, dict) or not all(isinstance(atom.get(k), int) and not isinstance(atom.get(k), bool)
                                             and atom[k] >= 0 for k in ("others", "min_cell")):
        raise site.fail("atom must hold the integers 'others' and 'min_cell'")
    if close_pairs(b, records + atom["others"], atom["min_cell"]) > MAX_CLOSE_PAIRS:
        raise site.fail(f"policy: {b} bootstrap replicates of the Brier score are too many for this site where "
                        "dropouts are allowed: runs over nested contributor sets difference into the replicates of "
                        "an atom holding it and min_sites - 1 sites of q records, whose pairs of replicates would "
                        "differ in fewer than min_cell_count records (ask for fewer replicates)")


def _controls(site: SiteData, params: dict[str, Any]) -> tuple[np.ndarray, tuple[int, ...]]:
    """The pooled released controls and the public key of their weights, checked against the round."""
    seed = param(site, params, "reference_seed", str)
    digest = param(site, params, "reference", str)
    if not _HEX64.match(seed) or seed != reference_seed(digest):
        raise site.fail("reference_seed is not the one the release's digest gives; the controls' weights are "
                        "fixed by the release, not chosen")
    return reference(site, NEGATIVES_KEY), key_words(seed)


@site_query("roc.bootstrap_auc", outputs={"numerator": "int", "weight": "int"})
def bootstrap_auc(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Twice the weighted Mann-Whitney sums of the site's cases against the released controls (run by a Site).

    Exact integers: per replicate b, sum_i w_bi sum_j v_bj (2 [c_j < x_i] +
    [c_j = x_i]) with the site's own weights w and the public weights v of
    the controls; and sum_i w_bi. Entry 0 is unweighted.
    """
    y, s = labels_scores(site, params)
    b = n_boot(site, params)
    controls, ref_key = _controls(site, params)
    cases = s[y == 1]
    below, at_most = placement_bounds(controls, cases)
    key = replicate_key(site, "roc.bootstrap_auc", params)
    nums, dens = [], []
    for (_, v), (_, w) in zip(poisson_chunks(ref_key, controls.size, b), poisson_chunks(key, cases.size, b)):
        nums.append(auc_numerators(v, below, at_most, w))
        dens.append(w.sum(axis=1))
    plain = int(np.sum(below) + np.sum(at_most))
    return QueryResult({"numerator": _with_plain(plain, nums, np.int64),
                        "weight": _with_plain(int(cases.size), dens, np.int64)}, records=int(y.size))


def specificity(site: SiteData, params: dict[str, Any]) -> float:
    """The declared specificity, strictly between 0 and 1."""
    sp = param(site, params, "specificity", float)
    if not 0.0 < sp < 1.0:
        raise site.fail(f"specificity must lie strictly between 0 and 1, got {sp}")
    return sp


@site_query("roc.bootstrap_sensitivity", outputs={"numerator": "float", "weight": "int"})
def bootstrap_sensitivity(site: SiteData, params: dict[str, Any]) -> QueryResult:
    """Weighted counts of the site's cases above each replicate's cut at the declared specificity (run by a Site).

    The cut (u_b, lam_b) is pROC's reading of the sensitivity at that
    specificity on replicate b's weighted released controls
    (`specificity_cuts`); entry 0 uses the unweighted controls and cases.
    """
    y, s = labels_scores(site, params)
    b = n_boot(site, params)
    sp = specificity(site, params)
    controls, ref_key = _controls(site, params)
    cases = s[y == 1]
    key = replicate_key(site, "roc.bootstrap_sensitivity", params)
    u0, lam0 = specificity_cuts(controls, np.ones((1, controls.size), dtype=np.int64), sp)
    plain = float(sensitivity_numerators(cases, np.ones((1, cases.size)), u0, lam0)[0])
    nums, dens = [], []
    for (_, v), (_, w) in zip(poisson_chunks(ref_key, controls.size, b), poisson_chunks(key, cases.size, b)):
        u, lam = specificity_cuts(controls, v, sp)
        nums.append(sensitivity_numerators(cases, w, u, lam))
        dens.append(w.sum(axis=1))
    return QueryResult({"numerator": _with_plain(plain, nums, np.float64),
                        "weight": _with_plain(int(cases.size), dens, np.int64)}, records=int(y.size))
