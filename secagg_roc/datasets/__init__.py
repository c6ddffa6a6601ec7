"""Real reference data sets shipped with secagg-roc (provenance: README.md beside this file).

Loaders return ``{column name: numpy array}``: numeric columns as int64 or
float64, text columns as arrays of str. No pandas needed.
"""

from __future__ import annotations

import csv
from importlib import resources

import numpy as np

__all__ = ["load_csv", "load_gbsg2", "load_asah"]


def _column(values: list[str]) -> np.ndarray:
    try:
        ints = [int(v) for v in values]
        return np.asarray(ints, dtype=np.int64)
    except ValueError:
        pass
    try:
        return np.asarray([float(v) for v in values], dtype=np.float64)
    except ValueError:
        return np.asarray(values, dtype=str)


def load_csv(name: str) -> dict[str, np.ndarray]:
    """A CSV file of this package as named columns."""
    with resources.files(__name__).joinpath(name).open("r", encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    if any(len(r) != len(header) for r in body):
        raise ValueError(f"{name}: ragged rows")
    return {col: _column([r[j] for r in body]) for j, col in enumerate(header)}


def load_gbsg2() -> dict[str, np.ndarray]:
    """German Breast Cancer Study Group 2: 686 patients (the paper's use case).

    Columns: horTh (yes/no), age, menostat (Pre/Post), tsize, tgrade (I/II/III),
    pnodes, progrec, estrec, time (recurrence-free survival, days), cens (1 = event).
    """
    return load_csv("gbsg2.csv")


def load_asah() -> dict[str, np.ndarray]:
    """aSAH (pROC's reference data): 113 patients; outcome Good/Poor, biomarkers s100b and ndka."""
    return load_csv("aSAH.csv")
