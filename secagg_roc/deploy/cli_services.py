"""`secagg-roc aggregator` and `secagg-roc site` (and `site check`): run the parties of a deployed study.

Wired into the main CLI by `add_service_parsers` on every install; the
services need the [deploy] extra and say so in one line when it is missing
(``site check`` is local and runs on a base install). Each party runs its own
command on its own machine with the same study file; see ``secagg-roc keys
--help`` for making the keys first. The site's data check is its own module,
`site_check`; the analyst's command is `cli_analyze`, ``status`` is `cli_status`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ..errors import ConfigError
from ..extras import require
from .site_check import site_check

__all__ = ["add_service_parsers", "run_aggregator_command", "run_site_command", "site_check", "EXAMPLES"]

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

It listens on the host and port the study file gives for NAME (or on its
bind/bind_port, when the advertised address is not the machine's own: NAT,
containers), and needs:
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
      the record count against q, the allowed analyses whose runs would send a
      query missing from the site's allowed_queries (refused at their join), and
      the budget the site's ledger has spent, naming the CSV column and the data
      rows to fix. Sends nothing; needs no
      extra. Exit status 0 when nothing needs fixing, 1 otherwise.

Needs: ca.pem, keys/NAME/cert.pem, keys/NAME/key.pem (SECRET), the data file.
Its answers and ledger are logged in --state before they are sent (for shares:
the split's seeds and digests), so after a restart it re-creates and re-sends
the same shares instead of new ones, replays its DP releases instead of
drawing new noise, and refuses a round whose shares it can no longer
re-create because its data changed.
"""

EXAMPLES = """\
example, on one machine (each command in its own terminal):
  secagg-roc keys       --study study.toml                      (once; later: keys add NAME, keys revoke NAME)
  secagg-roc site check --study study.toml --name hospital-a   (each site, before it joins)
  secagg-roc aggregator --study study.toml --name agg-1
  secagg-roc aggregator --study study.toml --name agg-2
  secagg-roc site       --study study.toml --name hospital-a
  secagg-roc site       --study study.toml --name hospital-b
  secagg-roc status     --study study.toml        (who is up; which sites each aggregator hears)
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
                        help="SQLite durability: full (default) survives power loss, normal only a killed process "
                             "(a site's releases, its ledger, are fsync'd either way)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="log detail on stderr (default: %(default)s)")
    parser.add_argument("--stop-on-eof", action="store_true",
                        help="also stop when standard input closes (so a supervisor's children never outlive it)")


def add_service_parsers(subparsers: Any) -> None:
    """Add the ``aggregator`` and ``site`` subcommands."""
    agg = subparsers.add_parser("aggregator", help="run one aggregator of a deployed study (HTTPS service)",
                                description=_AGGREGATOR_DESCRIPTION, epilog=EXAMPLES, formatter_class=_FORMAT)
    _common(agg, "aggregator")
    agg.set_defaults(func=run_aggregator_command)

    site = subparsers.add_parser("site", help="run one site's agent of a deployed study (outbound only), or check its data",
                                 description=_SITE_DESCRIPTION, epilog=EXAMPLES, formatter_class=_FORMAT)
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
    site.add_argument("--dp-ledger-lost-on-purpose", action="store_true",
                      help="start although the aggregators saw DP releases this site's database no longer holds "
                           "(restored from an older copy, or replaced): the site's DP budget for the study then "
                           "counts as spent, and it refuses every new DP release (without this flag the agent "
                           "refuses to start)")
    site.set_defaults(func=run_site_command)


def run_aggregator_command(args: argparse.Namespace) -> int:
    """``secagg-roc aggregator``: serve until stopped; 2 on a configuration error (a taken port included)."""
    require("deploy", "the aggregator service")
    _logging(args.log_level)
    from .aggregator_service import run_aggregator

    run_aggregator(args.study, args.name, synchronous=args.sync.upper(), ready=_print_ready,
                   stop_on_eof=args.stop_on_eof)
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
    require("deploy", "the site agent")
    _logging(args.log_level)
    from .site_process import run_site

    run_site(args.study, args.name, seed=args.seed, state_path=args.state,
             allow_non_private=args.allow_non_private, synchronous=args.sync.upper(), ready=_print_ready,
             stop_on_eof=args.stop_on_eof, dp_ledger_lost=args.dp_ledger_lost_on_purpose)
    return 0
