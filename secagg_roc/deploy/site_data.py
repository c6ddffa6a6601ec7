"""A site's records, read from its data file (CSV or ``.npz``) as named arrays.

Run by each Site: its agent (`site_agent.SiteAgent`) and ``secagg-roc site
check`` load the file the study file names for the site, with the study
file's column mapping (array name -> CSV column, or a list of columns for a
matrix). The records never leave the site.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import ConfigError

__all__ = ["load_site_data"]


def _parse_column(values: list[str], column: str, path: Path) -> np.ndarray:
    """A CSV column as int64 if every cell is an integer literal, else float64; the bad cells named by row."""
    if all(_is_int(v) for v in values):
        return np.array([int(v) for v in values], dtype=np.int64)
    out = np.full(len(values), np.nan)
    bad: list[str] = []
    for i, v in enumerate(values):
        if not _is_number(v):
            bad.append(f"data row {i + 1}: {v[:40]!r} is not a number")
            continue
        out[i] = float(v)
        if not np.isfinite(out[i]):
            bad.append(f"data row {i + 1}: {v[:40]!r} is not a finite number")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        count = f"{len(bad)} cells to fix: " if len(bad) > 1 else ""
        raise ConfigError(f"{path}: column {column!r}, {count}" + "; ".join(bad[:5]) + more)
    return out


def _is_int(v: str) -> bool:
    s = v.strip()
    return bool(s) and (s.lstrip("+-").isdigit())


def _is_number(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def load_site_data(path: str | os.PathLike[str], columns: Mapping[str, str | tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Run by the Site: its records as named arrays, as the study file's `columns` maps them.

    A CSV file (header row, one record per row): a column of integer literals
    becomes int64 (labels), any other numeric column float64 (scores,
    covariates); a tuple of columns becomes an (n, k) float64 matrix. An
    ``.npz`` file maps array names to its arrays by key instead. Empty or
    non-numeric cells are refused with the file, column and row.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: site data file not found")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            out = {}
            for name, key in columns.items():
                keys = (key,) if isinstance(key, str) else key
                missing = [k for k in keys if k not in npz.files]
                if missing:
                    raise ConfigError(f"{path}: no array {missing[0]!r} (it has: {', '.join(npz.files)})")
                arrays = [np.asarray(npz[k]) for k in keys]
                out[name] = arrays[0] if isinstance(key, str) else np.column_stack([a.astype(np.float64) for a in arrays])
            return out
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise ConfigError(f"{path}: empty file, expected a header row") from None
        rows = [row for row in reader if row]
    if not rows:  # a site with no records would join nothing: say so now, not at the first run
        raise ConfigError(f"{path}: has a header row but no data rows; the site's records go one per row below it")
    index = {h: i for i, h in enumerate(header)}
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ConfigError(f"{path}: data row {i + 1} has {len(row)} fields, the header has {len(header)}")

    def column(name: str) -> np.ndarray:
        if name not in index:
            raise ConfigError(f"{path}: no column {name!r} (columns: {', '.join(header)})")
        j = index[name]
        return _parse_column([row[j] for row in rows], name, path)

    out = {}
    for array, col in columns.items():
        if isinstance(col, str):
            out[array] = column(col)
        else:
            out[array] = np.column_stack([column(c).astype(np.float64) for c in col]) if rows else np.zeros((0, len(col)))
    return out
