"""`secagg-roc`: the command line.

Subcommands register themselves through `add_*_parser(subparsers)` functions
next to the code they run, so this module stays a table of contents.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Sequence


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(Path(args.out), seed=args.seed, deployed=not args.embedded)
    print(result["text"])
    return 0


def _run_sum_demo(args: argparse.Namespace) -> int:
    from .sum_demo import run_sum_demo

    print(run_sum_demo(n_aggregators=args.aggregators))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="secagg-roc",
        description="Validate a prediction model on data no one may pool: secure aggregation "
        "across non-colluding aggregators, and the distributed ROC-GLM on top.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="the paper's use case on GBSG2: distributed ROC-GLM, AUC with CI, Brier, calibration",
        description="Run the distributed validation of the paper's use case (GBSG2, five sites, q=5) "
        "and write a report, a JSON file and two plots to --out. By default the parties are real: two "
        "aggregator services and five site agents start as processes on 127.0.0.1 with fresh keys and "
        "mutual TLS, and stop when the analysis is done.",
    )
    demo.add_argument(
        "--embedded", action="store_true", help="run every party in this process instead (no network, no keys)"
    )
    demo.add_argument("--out", default="secagg-roc-demo", help="output folder (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the data split and DP noise (default: %(default)s)")
    demo.set_defaults(func=_run_demo)

    sum_demo = sub.add_parser(
        "sum-demo",
        help="one secure sum over three sites, printing what every party received",
        description="Secret-share three small vectors across the aggregators and show each party's transcript.",
    )
    sum_demo.add_argument("--aggregators", type=int, default=2, help="number of aggregators (default: %(default)s)")
    sum_demo.set_defaults(func=_run_sum_demo)

    from .deploy.cli_keys import add_keys_parser

    add_keys_parser(sub)
    if importlib.util.find_spec("aiohttp") is not None:  # the [deploy] extra
        from .deploy.cli_services import add_service_parsers

        add_service_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
