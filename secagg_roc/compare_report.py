"""`Comparison` as JSON, as a Markdown table, and as a figure (the figure needs the [plot] extra)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .compare import Comparison


def to_json(c: "Comparison") -> str:
    """The comparison as indented JSON (numbers as floats)."""
    return json.dumps(c.to_dict(), indent=2, default=float)


def _num(v: Any, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def to_markdown(c: "Comparison") -> str:
    """The comparison as a Markdown table: each scheme beside the plaintext reference."""
    ref = c.reference
    lines = [
        f"Pooled reference over {ref['records']} records at {ref['sites']} sites: ROC-GLM AUC "
        f"{ref['auc']:.4f} ({ref['ci'][0]:.4f}, {ref['ci'][1]:.4f}), Brier {ref['brier']:.4f}.",
        "",
        "| scheme | privacy | AUC | CI | Brier | \\|ΔAUC\\| | \\|ΔCI\\| | \\|ΔBrier\\| | max \\|Δcal\\| "
        "| coalition that learns nothing | aggregators that may fail | altered sum | KiB sent: sites / aggregators "
        "/ analyst | rounds | seconds |",
        "|" + "---|" * 15,
    ]
    for r in c.rows:
        res, err, t, cost = r.results, r.errors, r.threat, r.costs
        ci = res.get("ci")
        sent = cost["bytes_sent"]
        lines.append(
            f"| {r.scheme} | {r.privacy} | {_num(res.get('auc'))} | "
            f"{'-' if ci is None else f'({ci[0]:.4f}, {ci[1]:.4f})'} | {_num(res.get('brier'))} | "
            f"{_num(err.get('auc'), 2) if err.get('auc', 1) > 1e-4 else _exp(err.get('auc'))} | "
            f"{_exp(err.get('ci'))} | {_exp(err.get('brier'))} | {_exp(err.get('calibration'))} | "
            f"{t['coalition']} | {t['server_dropouts']} | "
            f"{t['malicious'].get('aggregator alters its aggregate share', '-')} | "
            f"{_kib(sent['site'])} / {_kib(sent['aggregator'])} / {_kib(sent['analyst'])} | "
            f"{cost['rounds']} | {cost['seconds']:.2f} |"
        )
    extra = [k for k in ("histogram_auc", "secure_auc") if any(k in r.results for r in c.rows)]
    if extra:
        lines += ["", f"Empirical pooled AUC {ref['auc_empirical']:.6f}:", "",
                  "| scheme | privacy | " + " | ".join(f"{k} | \\|Δ\\|" for k in extra) + " |",
                  "|" + "---|" * (2 + 2 * len(extra))]
        for r in c.rows:
            cells = []
            for k in extra:
                v = r.results.get(k)
                cells += [_num(v, 6) if isinstance(v, float) else str(v or "-"), _exp(r.errors.get(k))]
            lines.append(f"| {r.scheme} | {r.privacy} | " + " | ".join(cells) + " |")
    lines += ["", "What each party learned (from its transcript, and what the scheme promises):", ""]
    seen = set()
    for r in c.rows:
        if (r.scheme, r.privacy) in seen:
            continue
        seen.add((r.scheme, r.privacy))
        parts = [f"{role}: {e['in_clear']} ({e['vectors']} vector messages)" for role, e in sorted(r.learned.items())]
        lines.append(f"- **{r.scheme}, {r.privacy}**: trust: {r.threat['trust']}. " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def _exp(v: float | None) -> str:
    return "-" if v is None else ("0" if v == 0 else f"{v:.1e}")


def plot(c: "Comparison", path: str | None = None) -> Any:
    """Two panels: |error| against the pooled reference per row (log scale), and bytes sent per row."""
    from .plotting import _pyplot

    plt = _pyplot()
    labels = [f"{r.scheme}\n{r.privacy}" for r in c.rows]
    fig, (ax_err, ax_cost) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = [k for k in ("auc", "ci", "brier", "calibration") if any(k in r.errors for r in c.rows)]
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        values = [max(r.errors.get(key, 0.0), 1e-17) for r in c.rows]
        ax_err.bar([x + i * width for x in range(len(c.rows))], values, width, label=key)
    ax_err.set_yscale("log")
    ax_err.set_ylabel("|error| against the pooled computation")
    ax_err.set_xticks([x + 0.4 - width / 2 for x in range(len(c.rows))], labels, fontsize=7)
    ax_err.legend(fontsize=8)
    ax_err.tick_params(axis="x", labelrotation=35)
    for i, role in enumerate(("site", "aggregator", "analyst")):
        ax_cost.bar([x + i * 0.27 for x in range(len(c.rows))],
                    [r.costs["bytes_sent"][role] / 1024 for r in c.rows], 0.27, label=f"sent by {role}s")
    ax_cost.set_ylabel("KiB sent")
    ax_cost.set_xticks([x + 0.27 for x in range(len(c.rows))], labels, fontsize=7)
    ax_cost.legend(fontsize=8)
    ax_cost.tick_params(axis="x", labelrotation=35)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
