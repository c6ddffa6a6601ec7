"""`secagg-roc`: the command line.

Subcommands register themselves through `add_*_parser(subparsers)` functions
next to the code they run, so this module stays a table of contents. Every
subcommand is listed on a base install; one that needs an optional extra says
which, in one line, when it runs (`extras`). Errors a user can fix (a study
file, a key, an output folder, a missing extra) end as one line on stderr and
exit status 2; an analysis that failed or was refused as one line and status 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import __version__
from .errors import ConfigError
from .extras import MissingExtra, require


def _run_demo(args: argparse.Namespace) -> int:
    from .outputs import output_folder

    out = output_folder(args.out)
    if not args.embedded:
        require("deploy", "the deployed demo (add --embedded to run every party in this process)")
    from .demo import run_demo

    result = run_demo(out, seed=args.seed, deployed=not args.embedded)
    print(result["text"])
    print("\nwrote " + ", ".join(result["files"].values()))
    for note in result.get("notes", ()):
        print(f"note: {note}")
    return 0


def _run_sum_demo(args: argparse.Namespace) -> int:
    from .sum_demo import run_sum_demo

    from .sharing import SCHEMES

    if args.scheme not in SCHEMES:
        raise ConfigError(f"--scheme {args.scheme!r}: one of {', '.join(SCHEMES)}")
    try:
        print(run_sum_demo(n_aggregators=args.aggregators, scheme=args.scheme, threshold=args.threshold))
    except ValueError as exc:  # the scheme's own check of its parameters, in one line
        raise ConfigError(str(exc)) from None
    return 0


def _aggregators(text: str) -> int:
    """``--aggregators``: additive sharing needs two at least (one would see every input)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (one aggregator would see every input), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `secagg-roc` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="secagg-roc",
        description="Validate a prediction model on data no one may pool: secure aggregation "
        "across non-colluding aggregators, and the distributed ROC-GLM on top.",
    )
    parser.add_argument("--version", action="version", version=f"secagg-roc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="the paper's use case on GBSG2: distributed ROC-GLM, AUC with CI, Brier, calibration",
        description="Run the distributed validation of the paper's use case (GBSG2, five sites, q=5) "
        "and write report.txt, report.json and, with the [plot] extra, roc.png and calibration.png to --out. "
        "By default the parties are real (this needs the [deploy] extra): two aggregator services and five "
        "site agents start as processes on 127.0.0.1 with fresh keys and mutual TLS, and stop when the "
        "analysis is done. --embedded runs on a base install.",
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
    sum_demo.add_argument("--aggregators", type=_aggregators, default=None,
                          help="number of aggregators, at least 2 (default: the scheme's)")
    sum_demo.add_argument("--scheme", default="additive",
                          help="additive, shamir, replicated, pairwise or plaintext (default: %(default)s)")
    sum_demo.add_argument("--threshold", type=int, default=None,
                          help="Shamir's t, or pairwise masking's threshold of sites")
    sum_demo.set_defaults(func=_run_sum_demo)

    # Listed on every install: each command checks its extra when it runs.
    from .deploy.cli_analyze import add_analyze_parser
    from .deploy.cli_keys import add_keys_parser
    from .deploy.cli_services import add_service_parsers
    from .deploy.cli_status import add_status_parser

    from .compare_cli import add_compare_parser
    from .simulation.cli import add_simulate_parser

    add_compare_parser(sub)
    add_simulate_parser(sub)
    add_keys_parser(sub)
    add_service_parsers(sub)
    add_analyze_parser(sub)
    add_status_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``secagg-roc`` with `argv`; the exit status (0 success, 1 failed analysis, 2 something to fix)."""
    args = build_parser().parse_args(argv)
    name = f"secagg-roc {args.command}"
    try:
        return int(args.func(args) or 0)
    except MissingExtra as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. a full disk or a file that vanished: the reason, not a traceback
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"{name}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
