"""`secagg-roc compare`: one analysis under every threat model, printed side by side and written to files.

Runs in one process on a base install (the figure needs the [plot] extra).
The data: the paper's use case (GBSG2, five validation sites with a model's
scores; the default), pROC's aSAH data split over three sites, or a CSV file
with a label column, a score column in [0, 1] and a site column.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError
from .extras import missing

__all__ = ["add_compare_parser"]

#: The analyses the command's own policies allow, and their histogram grid (coarse: the data sets are small,
#: and cells below the policy's min_cell_count are withheld).
ANALYSES = ("rocglm", "brier", "calibration", "score_histogram", "secure_auc")
HISTOGRAM_BINS = 20


def add_compare_parser(subparsers: Any) -> None:
    """Add the ``compare`` subcommand."""
    p = subparsers.add_parser(
        "compare", help="one analysis under every threat model and privacy model, side by side",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="usecase", metavar="usecase|asah|FILE.csv",
                   help="the data (default: %(default)s)")
    p.add_argument("--label", default="y", help="CSV: the 0/1 label column (default: %(default)s)")
    p.add_argument("--score", default="score", help="CSV: the score column, in [0, 1] (default: %(default)s)")
    p.add_argument("--site", default="site", help="CSV: the column naming each record's site (default: %(default)s)")
    p.add_argument("--schemes", default="plaintext,additive:2,shamir:3:2,replicated,pairwise",
                   help="comma-separated NAME[:AGGREGATORS[:THRESHOLD]] (default: %(default)s)")
    p.add_argument("--privacy", default="exact,dp", help="privacy models: exact, dp (default: %(default)s)")
    p.add_argument("--analyses", default="rocglm,brier,calibration",
                   help="comma-separated: rocglm, brier, calibration, histogram, secure_auc (default: %(default)s)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write compare.json, compare.md and (with the [plot] extra) compare.png here")
    p.add_argument("--seed", type=int, default=0, help="seed of the DP noise and of the use case's split")
    p.set_defaults(func=run_compare_command)


def _load(args: argparse.Namespace) -> tuple[dict[str, dict[str, np.ndarray]], Any]:
    from .policy import DPPolicy, Policy

    paper_dp = DPPolicy(epsilon=0.3, delta=0.4, l2_sensitivity=0.016, budget_epsilon=1.0, budget_delta=0.9)
    if args.data == "usecase":
        from .demo import POLICY, use_case_sites

        sites, *_ = use_case_sites(args.seed)
        policy = dataclasses.replace(POLICY, analyses=ANALYSES, roles={"label": ["y"], "score": ["score"]},
                                     histogram_bins=HISTOGRAM_BINS)
        return {k: {"y": v["y"], "score": v["score"]} for k, v in sites.items()}, policy
    if args.data == "asah":
        from .datasets import load_asah

        a = load_asah()
        y, s = (a["outcome"] == "Poor").astype(np.int64), a["s100b"] / a["s100b"].max()
        parts = np.array_split(np.arange(y.size), 3)
        return ({f"h{i}": {"y": y[p], "score": s[p]} for i, p in enumerate(parts)},
                Policy(roles={"label": ["y"], "score": ["score"]}, dp=paper_dp, analyses=ANALYSES,
                       histogram_bins=HISTOGRAM_BINS))
    path = Path(args.data)
    if not path.is_file():
        raise ConfigError(f"--data {args.data!r}: not 'usecase', 'asah' or an existing CSV file")
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    missing_cols = {args.label, args.score, args.site} - set(rows[0] if rows else ())
    if missing_cols:
        raise ConfigError(f"{path}: no column(s) {sorted(missing_cols)}")
    sites: dict[str, dict[str, list]] = {}
    try:
        for r in rows:
            d = sites.setdefault(r[args.site], {"y": [], "score": []})
            d["y"].append(int(r[args.label]))
            d["score"].append(float(r[args.score]))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    data = {k: {"y": np.asarray(v["y"]), "score": np.asarray(v["score"])} for k, v in sites.items()}
    return data, Policy(roles={"label": ["y"], "score": ["score"]}, dp=paper_dp, analyses=ANALYSES,
                        histogram_bins=HISTOGRAM_BINS)


def run_compare_command(args: argparse.Namespace) -> int:
    """`secagg-roc compare`: one analysis under several schemes, printed or written as a report (exit code)."""
    from .compare import compare_schemes

    data, policy = _load(args)
    try:
        c = compare_schemes(data, policy=policy, schemes=[s for s in args.schemes.split(",") if s.strip()],
                            privacy=[p.strip() for p in args.privacy.split(",") if p.strip()], seed=args.seed,
                            analyses=[a.strip() for a in args.analyses.split(",") if a.strip()])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(c.to_markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(c.to_json())
        (out / "compare.md").write_text(c.to_markdown())
        written = ["compare.json", "compare.md"]
        if missing("plot") is None:
            c.plot(str(out / "compare.png"))
            written.append("compare.png")
        else:
            print("note: the figure needs the [plot] extra: pip install 'secagg-roc[plot]'")
        print("wrote " + ", ".join(str(out / w) for w in written))
    return 0
