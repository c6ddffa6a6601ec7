"""Summaries of a simulation's results: the paper's Table 1 and Figures 4-5, as tables and plots.

Per setting and per bin of the empirical AUC (`design.auc_bin`, R's ``cut``
into (0.5, 0.525], ..., (0.975, 1]): the mean absolute error of the
distributed AUC (|empirical AUC - distributed ROC-GLM AUC|, the paper's
Figure 4 and, for the baseline, Table 1) and of the CI (the paper's
Delta ci = |lower - lower_emp| + |upper - upper_emp| against the pooled
empirical DeLong interval on the logit scale, Figure 5). Failed tasks
(the ROC-GLM raised) are counted and left out of the means, as the paper's
``na.rm = TRUE``. Data sets with an empirical AUC at or below 0.5 fall
outside the bins (pROC's direction flip, which put them into the paper's
first bin, is not applied).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .design import AUC_BINS, auc_bin, bin_label, paper_grid

__all__ = ["ACCEPTABLE", "bin_summary", "plot_figures", "table_markdown", "write_csv", "write_summary"]

#: The paper's threshold of an acceptable mean absolute error (AUC and Delta ci).
ACCEPTABLE = 0.01
N_BINS = AUC_BINS.size - 1
FIELDS = ("setting", "name", "l2_sensitivity", "epsilon", "delta", "bin", "auc_bin", "count", "failed",
          "mean_diff", "median_diff", "mae_auc", "mae_ci", "mae_ci_lower", "mae_ci_upper")


def bin_summary(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setting, AUC bin) that holds data sets: counts and mean absolute errors."""
    grid = paper_grid()
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r["auc_emp"] is None:
            continue
        b = auc_bin(r["auc_emp"])
        if b >= 0:
            groups.setdefault((r["setting"], b), []).append(r)
    rows = []
    for (si, b), recs in sorted(groups.items()):
        ok = [r for r in recs if r["auc"] is not None and None not in r["ci"]]
        emp = np.array([r["auc_emp"] for r in ok])
        diff = emp - np.array([r["auc"] for r in ok])
        lo = np.abs(np.array([r["ci"][0] - r["ci_emp"][0] for r in ok]))
        hi = np.abs(np.array([r["ci"][1] - r["ci_emp"][1] for r in ok]))
        s = grid[si]
        mean = (lambda a: float(np.mean(a))) if ok else (lambda a: float("nan"))
        rows.append({
            "setting": si, "name": s.name, "l2_sensitivity": s.l2_sensitivity, "epsilon": s.epsilon,
            "delta": s.delta, "bin": b, "auc_bin": bin_label(b), "count": len(recs), "failed": len(recs) - len(ok),
            "mean_diff": mean(diff), "median_diff": float(np.median(diff)) if ok else float("nan"),
            "mae_auc": mean(np.abs(diff)), "mae_ci": mean(lo + hi), "mae_ci_lower": mean(lo), "mae_ci_upper": mean(hi),
        })
    return rows


def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """The summary rows as CSV, one row per (setting, AUC bin)."""
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def _cell(v: float) -> str:
    if not np.isfinite(v):
        return ""
    return f"**{v:.4f}**" if v >= ACCEPTABLE else f"{v:.4f}"


def _wide(rows: list[dict[str, Any]], key: str, title: str) -> list[str]:
    by_setting: dict[int, dict[int, float]] = {}
    for r in rows:
        by_setting.setdefault(r["setting"], {})[r["bin"]] = r[key]
    heads = [f"{AUC_BINS[b + 1]:.3f}" for b in range(N_BINS)]
    out = [f"### {title}", "", "Columns: upper end of the empirical-AUC bin (a, a + 0.025]; bold: >= "
           f"{ACCEPTABLE} (the paper's limit of an acceptable error); empty: no data set in the bin.", "",
           "| setting | " + " | ".join(heads) + " |", "| --- |" + " ---: |" * N_BINS]
    grid = paper_grid()
    for si in sorted(by_setting):
        cells = [_cell(by_setting[si].get(b, float("nan"))) for b in range(N_BINS)]
        out.append(f"| {si}: {grid[si].name} | " + " | ".join(cells) + " |")
    return out + [""]


def table_markdown(rows: list[dict[str, Any]], header: dict[str, Any] | None = None,
                   n_records: int | None = None) -> str:
    """Markdown: the baseline's Table 1 (if run), then the mean absolute AUC and CI errors per bin and setting."""
    out = ["# The ROC-GLM paper's simulation study: results", ""]
    if header:
        out += [f"Master seed {header['master_seed']}, {header['n_sites']} sites, {header['mechanism']} Gaussian "
                f"mechanism, ties {header['ties']!r}, alpha {header['alpha']}"
                + (f"; {n_records} tasks." if n_records is not None else "."), ""]
    base = [r for r in rows if r["setting"] == 0]
    if base:
        out += ["### Table 1: empirical AUC - ROC-GLM AUC without noise (the baseline), by AUC bin", "",
                "| AUC bin | count | failed | mean | median | mean abs |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {r['auc_bin']} | {r['count']} | {r['failed']} | {r['mean_diff']:.4f} | {r['median_diff']:.4f} | "
                f"{r['mae_auc']:.4f} |" for r in base]
        out.append("")
    out += _wide(rows, "mae_auc", "Mean |empirical AUC - distributed AUC| per AUC bin and setting (Table 1, Figure 4)")
    out += _wide(rows, "mae_ci", "Mean Delta ci = |lower - lower_emp| + |upper - upper_emp| per AUC bin and "
                 "setting (Figure 5)")
    return "\n".join(out)


def plot_figures(rows: list[dict[str, Any]], out_dir: str | os.PathLike) -> list[Path]:
    """Figures 4 and 5 as heatmaps: a panel per l2-sensitivity, AUC bins x (epsilon, delta); needs matplotlib."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure  # no pyplot: the caller's backend and figures stay untouched

    grid = paper_grid()
    l2s = sorted({s.l2_sensitivity for s in grid if s.private})
    combos = sorted({(s.epsilon, s.delta) for s in grid if s.private})
    files = []
    for key, fname, what in (("mae_auc", "fig4_auc_error.png", "mean |AUC_emp - AUC_distributed|"),
                             ("mae_ci", "fig5_ci_error.png", "mean Delta ci (sum of both bounds' errors)")):
        fig = Figure(figsize=(3.2 * (len(l2s) + 1), 5.2), layout="constrained")
        axes = fig.subplots(1, len(l2s) + 1, sharey=True, gridspec_kw={"width_ratios": [1.0] * len(l2s) + [0.2]})
        norm = TwoSlopeNorm(vmin=-4.0, vcenter=np.log10(ACCEPTABLE), vmax=0.0)
        image = None
        for ax, l2 in zip(axes, l2s):
            m = np.full((N_BINS, len(combos)), np.nan)
            for r in rows:
                if r["l2_sensitivity"] == l2 and r["epsilon"] > 0 and np.isfinite(r[key]):
                    m[r["bin"], combos.index((r["epsilon"], r["delta"]))] = np.log10(max(r[key], 1e-6))
            image = ax.imshow(m, origin="lower", aspect="auto", cmap="RdYlBu_r", norm=norm,
                              extent=(-0.5, len(combos) - 0.5, 0.5, 1.0))
            ax.set_facecolor("0.85")
            ax.set_title(f"l2-sensitivity {l2:g}", fontsize=9)
            ax.set_xticks(range(len(combos)))
            ax.set_xticklabels([f"e{e:g} d{d:g}" for e, d in combos], rotation=90, fontsize=5)
        axes[0].set_ylabel("empirical AUC (bins of 0.025)")
        base = {r["bin"]: r[key] for r in rows if r["setting"] == 0 and np.isfinite(r[key])}
        bm = np.full((N_BINS, 1), np.nan)
        for b, v in base.items():
            bm[b, 0] = np.log10(max(v, 1e-6))
        axes[-1].imshow(bm, origin="lower", aspect="auto", cmap="RdYlBu_r", norm=norm, extent=(-0.5, 0.5, 0.5, 1.0))
        axes[-1].set_facecolor("0.85")
        axes[-1].set_title("no noise", fontsize=9)
        axes[-1].set_xticks([])
        cbar = fig.colorbar(image, ax=list(axes), shrink=0.8)
        cbar.set_label(f"log10 {what}; red above {ACCEPTABLE}, blue below", fontsize=8)
        fig.suptitle(f"{what} per AUC bin and DP setting (epsilon e, delta d); grey: no data", fontsize=10)
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=120)
        files.append(path)
    return files


def write_summary(results: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Rebuild table (Markdown, CSV) and plots from the results file `results`; returns files and notes."""
    from ..extras import missing
    from .runner import read_results

    header, records, _ = read_results(results)
    out = Path(out_dir or Path(results).parent)
    out.mkdir(parents=True, exist_ok=True)
    rows = bin_summary(records)
    md = table_markdown(rows, header, len(records))
    (out / "summary.md").write_text(md + "\n", encoding="utf-8")
    write_csv(rows, out / "summary.csv")
    files = [out / "summary.md", out / "summary.csv"]
    notes = []
    if missing("plot") is None:
        files += plot_figures(rows, out)
    else:
        notes.append("the figures need the [plot] extra: pip install 'secagg-roc[plot]' (tables written)")
    return {"files": files, "notes": notes, "rows": rows, "records": len(records),
            "failed": sum(r.get("error") is not None for r in records)}
