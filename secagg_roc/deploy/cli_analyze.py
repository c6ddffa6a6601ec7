"""`secagg-roc analyze`: the analyst's validation of a deployed study, with progress and a report.

Wired into the main CLI by `add_analyze_parser` on every install; it needs the
[deploy] extra (tqdm draws its progress bar) and says so in one line when it
is missing. Before the first round it checks, in seconds, that every
aggregator answers and every site agent follows them (`RemoteStudy.preflight`),
so an unreachable party is named at once instead of after a round timeout.
The report itself is `report.analyze`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from ..errors import ConfigError, SecAggError
from ..extras import require
from .cli_services import EXAMPLES

__all__ = ["add_analyze_parser", "run_analyze_command", "parse_epsilon"]

_DESCRIPTION = """\
Run the distributed validation of a prediction model against a deployed study,
as its analyst: the ROC-GLM with its AUC and DeLong confidence interval, the
Brier score and the calibration curve. What may be released is the sites'
[policy] in the study file: the DP parameters of the ROC-GLM's per-site
release come from it (--epsilon/--delta/--l2-sensitivity/--mechanism may only
ask for MORE noise), and so do the calibration bins (--bins, if given, must be
the policy's). Every aggregator and every site agent must be running; if one
is not, analyze says which within seconds. Writes to --out (a folder, made if missing):
  report.txt        the results as text, each with its contributing sites, and an audit
                    block (software version, study-file SHA-256, start/end, rounds, DP releases)
  results.json      the same, machine-readable
  roc.csv           the fitted ROC-GLM on 101 false positive rates, with its band
  roc_empirical.csv the empirical ROC of the released (DP-noised) scores
  calibration.csv   per bin: count, mean prediction, observed share and its Wilson interval
  roc.png, calibration.png   with the [plot] extra (--plot-format svg,pdf for other formats)
"""


def parse_epsilon(text: str) -> float | str | None:
    """``--epsilon``: 'auto', 'none' (the non-private mode) or a positive number."""
    if text.lower() == "none":
        return None
    if text.lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--epsilon must be a number, 'auto' or 'none', got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--epsilon must be a positive number, got {text!r}")
    return value


def _formats(text: str) -> tuple[str, ...]:
    from ..exports import PLOT_FORMATS

    formats = tuple(f.strip().lower().lstrip(".") for f in text.split(",") if f.strip())
    bad = [f for f in formats if f not in PLOT_FORMATS]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"formats are {', '.join(PLOT_FORMATS)} (comma-separated), got {text!r}")
    return formats


def add_analyze_parser(subparsers: Any) -> None:
    """Add the ``analyze`` subcommand."""
    ana = subparsers.add_parser("analyze", help="run ROC-GLM, AUC CI, Brier score and calibration on a deployed study",
                                description=_DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ana.add_argument("--study", required=True, metavar="STUDY.toml", help="the study file")
    ana.add_argument("--out", required=True, metavar="DIR", help="folder for the report, tables and plots")
    ana.add_argument("--label", default="y", help="array name of the 0/1 outcome at the sites (default: %(default)s)")
    ana.add_argument("--score", default="score", help="array name of the model's predicted probability (default: %(default)s)")
    ana.add_argument("--epsilon", default="auto",
                     help="DP epsilon of the ROC-GLM's per-site release: 'auto' takes the policy's (epsilon, delta); "
                          "a number (with --delta) no larger than the policy's asks for more noise; 'none' is the "
                          "NON-PRIVATE validation mode, which the policy and every site must allow (default: %(default)s)")
    ana.add_argument("--delta", type=float, default=None, help="DP delta, with a numeric --epsilon (at most the policy's)")
    ana.add_argument("--l2-sensitivity", type=float, default=None,
                     help="a larger l2-sensitivity than the policy's (more noise); never a smaller one")
    ana.add_argument("--mechanism", choices=("analytic", "classic"), default=None,
                     help="the Gaussian calibration (default: the policy's); it may only add noise")
    ana.add_argument("--bins", type=int, default=None,
                     help="calibration bins: fixed by the policy (calibration_bins); if given, must equal it")
    ana.add_argument("--alpha", type=float, default=0.05, help="1 - confidence level (default: %(default)s)")
    ana.add_argument("--plot-format", type=_formats, default=("png",), metavar="FMT[,FMT]",
                     help="plot formats: png, svg, pdf (default: png; plots need the [plot] extra)")
    ana.add_argument("--round-timeout", type=float, default=None, metavar="SECONDS",
                     help="how long to wait for the sites in each round (default: the study's round_timeout_s)")
    ana.set_defaults(func=run_analyze_command)


def _check_flags(args: argparse.Namespace, eps: float | str | None) -> None:
    """The DP flags that only make sense together, named as the command line names them."""
    if eps is None and (args.delta is not None or args.l2_sensitivity is not None or args.mechanism is not None):
        raise ConfigError("--epsilon none (the non-private validation mode, exact scores) adds no noise: "
                          "leave out --delta, --l2-sensitivity and --mechanism")
    if isinstance(eps, float) and args.delta is None:
        raise ConfigError(f"--epsilon {args.epsilon} needs --delta too (at most the policy's delta); "
                          "or leave out --epsilon to take the policy's (epsilon, delta)")
    if eps == "auto" and args.delta is not None:
        raise ConfigError("--delta needs a numeric --epsilon (the pair asks for more noise than the policy's)")


class _Progress:
    """Progress on stderr: a tqdm bar on a terminal, one line per analysis otherwise (logs, CI)."""

    def __init__(self, study: Any) -> None:
        self.bar: Any = None
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.rounds = 0
        study.on_round = self.round

    def round(self, query: str, number: int) -> None:
        self.rounds += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"round {number} ({query})", refresh=True)

    def __call__(self, name: str, index: int, total: int, finished: bool) -> None:
        from tqdm import tqdm

        from ..report import ANALYSES

        title = dict(ANALYSES).get(name, name)
        if self.tty:
            if self.bar is None:
                self.bar = tqdm(total=total, desc="analyze", unit="analysis", file=sys.stderr, leave=True)
            self.bar.set_description(title)
            if finished:
                self.bar.update(1)
                if index + 1 == total:
                    self.bar.close()
            return
        if finished:
            print(f"analyze: [{index + 1}/{total}] {title}: done ({self.rounds} rounds so far, "
                  f"{time.monotonic() - self.started:.1f} s)", file=sys.stderr, flush=True)
        else:
            print(f"analyze: [{index + 1}/{total}] {title} ...", file=sys.stderr, flush=True)


def run_analyze_command(args: argparse.Namespace) -> int:
    """``secagg-roc analyze``: 0 on success, 1 if the analysis failed or was refused, 2 for something to fix first."""
    require("deploy", "the analyst's client")
    from ..outputs import output_folder
    from ..report import analyze
    from .remote_study import RemoteStudy

    eps = parse_epsilon(args.epsilon)
    _check_flags(args, eps)
    out = output_folder(args.out)  # before any round: a bad --out costs nothing
    try:
        with RemoteStudy(args.study, round_timeout_s=args.round_timeout) as study:
            for warning in study.preflight():
                print(f"secagg-roc analyze: warning: {warning}", file=sys.stderr)
            results = analyze(study, out, label=args.label, score=args.score, epsilon=eps, delta=args.delta,
                              l2_sensitivity=args.l2_sensitivity, mechanism=args.mechanism, bins=args.bins,
                              alpha=args.alpha, plot_formats=args.plot_format, progress=_Progress(study))
    except ConfigError:
        raise
    except (SecAggError, ValueError) as exc:
        print(f"secagg-roc analyze: the analysis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(results["report"])
    print("\nwrote " + ", ".join(results["files"]))
    return 0
