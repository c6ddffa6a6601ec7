"""The paper's simulation design: data generation, the grid of DP settings, and every task's seeds.

Data (Schalk et al., section 5; the authors' ``generateROCData``): n uniform
in 100..2500; scores U[0, 1]; labels = score > 0.5; then a random fraction
(uniform in [0, 1]) of the labels is re-drawn at random, repeated until the
share of positives lies in [0.1, 0.9]. This spreads the empirical AUC over (0.5, 1].

Grid (the authors' ``R/setup.R`` and ``R/add-experiments.R`` in
difuture-lmu/simulations-distr-auc): l2-sensitivity ``seq(0.01, 0.09, 0.02)``,
epsilon ``seq(0.1, 0.5, 0.1)``, delta ``seq(0.1, 0.5, 0.1)`` (``expand.grid``
order: l2-sensitivity varies fastest), 10,000 data sets each, base seed 31415,
plus one baseline job without noise (the paper's Table 1). Noise is the classic
Gaussian mechanism ``sigma = sqrt(2 ln(1.25 / delta)) * l2 / epsilon``.

Seeds: a task is one (setting, data-set index). Data set i is drawn from
``SeedSequence(master, spawn_key=(0, i))`` and its split over the sites from
``SeedSequence(master, spawn_key=(2, i))``: the same data and the same five
sites' records under every setting. The paper's data set i is
``generateROCData(i, seed)`` in every job, and its code never splits it: each
job adds the setting's noise to the pooled scores of the same records and fits
the ROC-GLM on them (``R/add-experiments.R`` of the initial commit 3215547 of
difuture-lmu/simulations-distr-auc, lines 15, 28 and 35), so one split per data
set is the closest a 5-site study comes to it: only the noise differs between
settings. The sites' DP noise comes from ``SeedSequence(master, spawn_key=(1,
setting.index, i))``. So any subset of tasks, run anywhere in any order, gives
the same numbers. (Up to results format 1 the split was drawn anew per setting,
from the noise's generator; `runner.FORMAT` 2 marks the change.)
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "AUC_BINS", "DELTAS", "EPSILONS", "L2_SENSITIVITIES", "MASTER_SEED", "N_DATASETS", "N_SITES", "Setting",
    "auc_bin", "dataset", "generate", "paper_grid", "parse_settings", "split_rng", "split_sites", "task_rng",
]

#: The paper's grid (R/setup.R): L2SENS = seq(0.01, 0.09, 0.02), EPSILON = DELTA = seq(0.1, 0.5, 0.1).
L2_SENSITIVITIES = (0.01, 0.03, 0.05, 0.07, 0.09)
EPSILONS = (0.1, 0.2, 0.3, 0.4, 0.5)
DELTAS = (0.1, 0.2, 0.3, 0.4, 0.5)
#: The paper's BASE_SEED, REPETITIONS and number of sites.
MASTER_SEED = 31415
N_DATASETS = 10_000
N_SITES = 5
#: Right-closed AUC bins (a, a + 0.025] over (0.5, 1], as R's ``cut(auc, seq(0.5, 1, length.out = 21))``.
AUC_BINS = np.linspace(0.5, 1.0, 21)


def generate(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One simulated data set of the paper's design: (labels, scores)."""
    n = int(rng.integers(100, 2501))
    scores = rng.uniform(0.0, 1.0, n)
    labels = (scores > 0.5).astype(np.int64)
    share = 1.0  # the authors' loop always re-draws at least once
    while share > 0.9 or share < 0.1:
        k = int(n * rng.uniform())
        idx = rng.choice(n, size=k, replace=False)
        labels[idx] = rng.integers(0, 2, k)
        share = labels.mean()
    return labels, scores


def auc_bin(auc: float) -> int:
    """Index of the right-closed bin (a, a + 0.025] of `auc`, as R's ``cut``; -1 outside (0.5, 1]."""
    i = int(np.searchsorted(AUC_BINS, auc, side="left")) - 1
    return i if 0 <= i < AUC_BINS.size - 1 else -1


def bin_label(b: int) -> str:
    """``(0.500,0.525]`` for bin `b`."""
    return f"({AUC_BINS[b]:.3f},{AUC_BINS[b + 1]:.3f}]"


@dataclass(frozen=True)
class Setting:
    """One cell of the grid: index 0 is the baseline without noise, 1..125 the DP settings."""

    index: int
    l2_sensitivity: float
    epsilon: float
    delta: float

    @property
    def private(self) -> bool:
        """False for the baseline (exact scores, the library's non-private validation mode)."""
        return self.epsilon > 0

    @property
    def name(self) -> str:
        """``base``, or ``l2=0.05,eps=0.3,delta=0.2`` (also accepted by `parse_settings`)."""
        if not self.private:
            return "base"
        return f"l2={self.l2_sensitivity:g},eps={self.epsilon:g},delta={self.delta:g}"

    def sigma(self, mechanism: str = "classic") -> float:
        """Noise standard deviation of the setting's Gaussian mechanism (0 for the baseline)."""
        if not self.private:
            return 0.0
        from ..dp.gaussian import gaussian_sigma

        return float(gaussian_sigma(self.l2_sensitivity, self.epsilon, self.delta, mechanism))

    def to_dict(self) -> dict[str, Any]:
        """The setting as plain values (as in a results file's header)."""
        return asdict(self)


def paper_grid() -> list[Setting]:
    """The paper's 126 jobs: the noise-free baseline (index 0), then expand.grid(l2, epsilon, delta)."""
    grid = [Setting(0, 0.0, 0.0, 0.0)]
    for d in DELTAS:
        for e in EPSILONS:
            for l2 in L2_SENSITIVITIES:
                grid.append(Setting(len(grid), l2, e, d))
    return grid


_RANGE = re.compile(r"^(\d+)-(\d+)$")


def parse_settings(text: str) -> list[Setting]:
    """Settings named by `text`: ``all`` (126), ``dp`` (the 125 DP ones), ``base``, or a comma list of
    indices and ranges (``0,1-5,120``) or names (``l2=0.05,eps=0.3,delta=0.2`` needs ``;`` between names)."""
    grid = paper_grid()
    text = text.strip()
    if text == "all":
        return grid
    if text == "dp":
        return grid[1:]
    by_name = {s.name: s for s in grid}
    if text in by_name:
        return [by_name[text]]
    chosen: list[int] = []
    for part in (p.strip() for p in re.split(r"[;,]" if "=" not in text else ";", text)):
        if not part:
            continue
        m = _RANGE.match(part)
        if part in by_name:
            chosen.append(by_name[part].index)
        elif m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"settings range {part!r} runs backwards")
            chosen.extend(range(lo, hi + 1))
        elif part.isdigit():
            chosen.append(int(part))
        else:
            raise ValueError(f"unknown setting {part!r}: give all, dp, base, indices 0-{len(grid) - 1} or names "
                             f"like {grid[1].name!r}")
    bad = [i for i in chosen if not 0 <= i < len(grid)]
    if bad or not chosen:
        raise ValueError(f"settings must be indices 0-{len(grid) - 1}; got {text!r}")
    return [grid[i] for i in sorted(set(chosen))]


def dataset(master_seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Data set `index` of the study with `master_seed`: (labels, scores); the same under every setting."""
    return generate(np.random.default_rng(np.random.SeedSequence(master_seed, spawn_key=(0, index))))


def task_rng(master_seed: int, setting: Setting, index: int) -> np.random.Generator:
    """The generator of one task's DP-noise seed (its first draw)."""
    return np.random.default_rng(np.random.SeedSequence(master_seed, spawn_key=(1, setting.index, index)))


def split_rng(master_seed: int, index: int) -> np.random.Generator:
    """The generator of data set `index`'s split over the sites: the same under every setting."""
    return np.random.default_rng(np.random.SeedSequence(master_seed, spawn_key=(2, index)))


def split_sites(y: np.ndarray, s: np.ndarray, rng: np.random.Generator, n_sites: int = N_SITES
                ) -> dict[str, dict[str, np.ndarray]]:
    """Records shuffled by `rng` and cut into `n_sites` near-equal sites ``site0``, ``site1``, ..."""
    parts = np.array_split(rng.permutation(y.size), n_sites)
    return {f"site{k}": {"y": y[p], "score": s[p]} for k, p in enumerate(parts)}
