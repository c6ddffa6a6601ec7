"""`secagg-roc aggregator`, `secagg-roc site` (and `site check`) and `secagg-roc analyze`: run a deployed study.

Wired into the main CLI by `add_service_parsers` (when aiohttp, the [deploy]
extra, is installed). Each party runs its own command on its own machine with
the same study file; see ``secagg-roc keys --help`` for making the keys first.
The site's data check is its own module, `site_check`; `analyze` writes the analyst's report.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SecAggError
from .site_check import site_check

__all__ = ["add_service_parsers", "run_aggregator_command", "run_site_command", "run_analyze_command", "site_check",
           "analyze"]

_FORMAT = argparse.RawDescriptionHelpFormatter

_AGGREGATOR_DESCRIPTION = """\
Run one aggregator of a deployed study: an HTTPS service (mutual TLS 1.3 with
the study CA) that receives the sites' secret shares, keeps every accepted
message in its SQLite database (state/<name>.sqlite unless the study file says
otherwise), and releases its share of a total only over the contributor set
the analyst agreed with all aggregators, once per round, and only when that
set has at least min_sites sites and q records. Every round belongs to a run
of a declared analysis: its join fixes the run's contributor set, its later
rounds open in plan order and release over exactly that set, and no exact
release may be differenced against an earlier one. Contributing sites fetch
each release from it to move their own copy of the run on.

It listens on the host and port the study file gives for NAME, and needs:
  ca.pem, keys/NAME/cert.pem, keys/NAME/key.pem (SECRET)   made by `secagg-roc keys`
After a crash, start it again with the same command: it replays its database
and carries on; nothing accepted is lost and no round is released twice.
Stop it with Ctrl-C or SIGTERM.
"""

_SITE_DESCRIPTION = """\
Run the agent of one site: it reads the site's records from the data file the
study file names (columns mapped to array names there), then connects OUT to
every aggregator (it never listens on a port), fetches the analyst's rounds,
and checks each against the study's [policy], the run's plan and the site's
own ledger before it answers with secret shares (one per aggregator). It
refuses anything else and tells the analyst why (naming the rule, never a
value of its data). It takes each round's release from the aggregators
itself, so the analyst cannot steer a run's next round.

  secagg-roc site       --study S --name N   run the agent (until Ctrl-C or SIGTERM)
  secagg-roc site check --study S --name N   check the site's data against the policy and exit:
      for the policy's roles (or, without roles, every column) what would stop a
      run, how many scores lie outside the policy's score range (they are clipped),
      the record count against q, and the budget the site's ledger has spent.
      Exit status 0 when nothing needs fixing, 1 otherwise.

Needs: ca.pem, keys/NAME/cert.pem, keys/NAME/key.pem (SECRET), the data file.
Its answers and ledger are logged in --state before they are sent (for shares:
the split's seeds and digests), so after a restart it re-creates and re-sends
the same shares instead of new ones, replays its DP releases instead of
drawing new noise, and refuses a round whose shares it can no longer
re-create because its data changed.
"""

_ANALYZE_DESCRIPTION = """\
Run the distributed validation of a prediction model against a deployed study,
as its analyst: the ROC-GLM with its AUC and DeLong confidence interval, the
Brier score and the calibration curve. What may be released is the sites'
[policy] in the study file: the DP parameters of the ROC-GLM's per-site
release come from it (--epsilon/--delta/--l2-sensitivity/--mechanism may only
ask for MORE noise), and so do the calibration bins (--bins, if given, must be
the policy's). Every aggregator and every site agent must be running. Writes to --out:
  report.txt    the results as text, with the policy and each result's contributing sites
  results.json  the same, machine-readable
  roc.png, calibration.png   when matplotlib is installed
"""

_EXAMPLES = """\
example, on one machine (each command in its own terminal):
  secagg-roc keys       --study study.toml
  secagg-roc site check --study study.toml --name hospital-a   (each site, before it joins)
  secagg-roc aggregator --study study.toml --name agg-1
  secagg-roc aggregator --study study.toml --name agg-2
  secagg-roc site       --study study.toml --name hospital-a
  secagg-roc site       --study study.toml --name hospital-b
  secagg-roc analyze    --study study.toml --out results/
"""


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _print_ready(msg: str) -> None:
    print(msg, flush=True)


def _common(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--study", required=True, metavar="STUDY.toml", help="the study file (the same for every party)")
    parser.add_argument("--name", required=True, metavar="NAME", help=f"this {role}'s name in the study file")
    parser.add_argument("--sync", choices=("full", "normal"), default="full",
                        help="SQLite durability: full (default) survives power loss, normal only a killed process")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log detail on stderr (default: %(default)s)")
    parser.add_argument("--stop-on-eof", action="store_true",
                        help="also stop when standard input closes (so a supervisor's children never outlive it)")


def add_service_parsers(subparsers: Any) -> None:
    """Add the ``aggregator``, ``site`` and ``analyze`` subcommands."""
    agg = subparsers.add_parser("aggregator", help="run one aggregator of a deployed study (HTTPS service)",
                                description=_AGGREGATOR_DESCRIPTION, epilog=_EXAMPLES, formatter_class=_FORMAT)
    _common(agg, "aggregator")
    agg.set_defaults(func=run_aggregator_command)

    site = subparsers.add_parser("site", help="run one site's agent of a deployed study (outbound only), or check its data",
                                 description=_SITE_DESCRIPTION, epilog=_EXAMPLES, formatter_class=_FORMAT)
    site.add_argument("action", nargs="?", choices=("run", "check"), default="run",
                      help="'run' the agent (default) or 'check' the site's data against the policy and exit")
    _common(site, "site")
    site.add_argument("--seed", type=int, default=None,
                      help="seed of this site's DP noise, for reproducible runs (default: from the operating system)")
    site.add_argument("--state", default=None, metavar="PATH",
                      help="the agent's own database (default: state/NAME.sqlite next to the study file)")
    site.add_argument("--allow-non-private", action="store_true",
                      help="this site's consent to the non-private validation mode (exact scores to the analyst); "
                           "the study's policy must allow it as well")
    site.set_defaults(func=run_site_command)

    ana = subparsers.add_parser("analyze", help="run ROC-GLM, AUC CI, Brier score and calibration on a deployed study",
                                description=_ANALYZE_DESCRIPTION, epilog=_EXAMPLES, formatter_class=_FORMAT)
    ana.add_argument("--study", required=True, metavar="STUDY.toml", help="the study file")
    ana.add_argument("--out", required=True, metavar="DIR", help="folder for report.txt, results.json and plots")
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
    ana.add_argument("--round-timeout", type=float, default=None, metavar="SECONDS",
                     help="how long to wait for the sites in each round (default: the study's round_timeout_s)")
    ana.set_defaults(func=run_analyze_command)


def run_aggregator_command(args: argparse.Namespace) -> int:
    """``secagg-roc aggregator``: serve until stopped; 2 on a configuration error."""
    _logging(args.log_level)
    from .aggregator_service import run_aggregator

    try:
        run_aggregator(args.study, args.name, synchronous=args.sync.upper(), ready=_print_ready,
                       stop_on_eof=args.stop_on_eof)
    except ConfigError as exc:
        print(f"secagg-roc aggregator: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the port is taken
        print(f"secagg-roc aggregator: error: {exc}", file=sys.stderr)
        return 1
    return 0


def run_site_command(args: argparse.Namespace) -> int:
    """``secagg-roc site``: follow the aggregators until stopped; 2 on a configuration error.

    ``secagg-roc site check``: print the site's data check; 0 when clean, 1 with problems, 2 on a configuration error.
    """
    if args.action == "check":
        try:
            text, clean = site_check(args.study, args.name, state_path=args.state)
        except ConfigError as exc:
            print(f"secagg-roc site check: error: {exc}", file=sys.stderr)
            return 2
        print(text)
        return 0 if clean else 1
    _logging(args.log_level)
    from .site_agent import run_site

    try:
        run_site(args.study, args.name, seed=args.seed, state_path=args.state,
                 allow_non_private=args.allow_non_private, synchronous=args.sync.upper(), ready=_print_ready,
                 stop_on_eof=args.stop_on_eof)
    except ConfigError as exc:
        print(f"secagg-roc site: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _epsilon(text: str) -> float | str | None:
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


def analyze(study: Any, out: str | Path, *, label: str = "y", score: str = "score", epsilon: float | str | None = "auto",
            delta: float | None = None, l2_sensitivity: float | None = None, mechanism: str | None = None,
            bins: int | None = None, alpha: float = 0.05) -> dict[str, Any]:
    """Run by the Analyst: ROC-GLM + CI, Brier score and calibration on any `Study`; write the report.

    Privacy comes from the study's policy; `epsilon`, `delta`, `l2_sensitivity`
    and `mechanism` may only ask for more noise, ``epsilon=None`` is the
    non-private mode (the policy must allow it), and `bins` must be the
    policy's calibration bins if given.
    """
    from ..stats import brier_score, calibration_curve, roc_glm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    policy = study.policy
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        roc = roc_glm(study, label=label, score=score, epsilon=epsilon, delta=delta,
                      l2_sensitivity=l2_sensitivity, mechanism=mechanism, alpha=alpha)
        brier = brier_score(study, label, score)
        calibration = calibration_curve(study, label, score, n_bins=bins)
    seconds = time.perf_counter() - started
    notes = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    contributors = {
        "roc_glm": list(roc.contributors or ()),
        "brier_score": list(brier.contributors or ()),
        "calibration": list(calibration.contributors or ()),
    }
    results = {
        "study": getattr(study, "study_id", None),
        "sites": list(study.sites),
        "privacy_level": policy.privacy_level,
        "policy": policy.to_dict(),
        "policy_digest": policy.digest(),
        "contributors": contributors,
        "roc_glm": roc.to_dict(),
        "brier_score": float(brier),
        "calibration": calibration.to_dict(),
        "warnings": notes,
        "seconds": seconds,
    }

    def sites(result: str) -> str:
        return f"contributing sites: {', '.join(contributors[result])}"

    report = "\n".join([
        f"Distributed validation of {score!r} against {label!r}",
        f"study {results['study']!r}: {len(study.sites)} sites ({', '.join(study.sites)})",
        f"policy {policy.digest()[:12]}: {policy.describe()}",
        "",
        repr(roc),
        sites("roc_glm"),
        "",
        f"Brier score: {float(brier):.6f} over {brier.n_records} records",
        sites("brier_score"),
        "",
        repr(calibration),
        sites("calibration"),
        "",
        *(f"warning: {n}" for n in notes),
        f"({seconds:.2f} s)",
    ])
    (out / "report.txt").write_text(report + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default) + "\n", encoding="utf-8")
    try:
        from ..plotting import save

        save(roc.plot(), out / "roc.png")
        save(calibration.plot(), out / "calibration.png")
    except ImportError:
        pass
    results["report"] = report
    return results


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def run_analyze_command(args: argparse.Namespace) -> int:
    """``secagg-roc analyze``: 0 on success, 1 if the analysis failed or was refused, 2 on a configuration error."""
    from .remote_study import RemoteStudy

    try:
        eps = _epsilon(args.epsilon)
        with RemoteStudy(args.study, round_timeout_s=args.round_timeout) as study:
            results = analyze(study, args.out, label=args.label, score=args.score, epsilon=eps, delta=args.delta,
                              l2_sensitivity=args.l2_sensitivity, mechanism=args.mechanism, bins=args.bins,
                              alpha=args.alpha)
    except ConfigError as exc:
        print(f"secagg-roc analyze: error: {exc}", file=sys.stderr)
        return 2
    except (SecAggError, ValueError) as exc:
        print(f"secagg-roc analyze: the analysis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(results["report"])
    print(f"\nwrote {Path(args.out) / 'report.txt'} and {Path(args.out) / 'results.json'}")
    return 0
