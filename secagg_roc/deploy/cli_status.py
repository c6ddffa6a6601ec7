"""`secagg-roc status`: which parties of a deployed study are up, and which sites each aggregator hears.

Run by any party with its own key (by default the analyst's): it asks every
aggregator for ``/v1/info`` (a few seconds at most each, no retries) and
prints, per aggregator, whether it answers and serves this study file's
policy, and per site when each aggregator last heard from its agent (the
site agents long-poll the aggregators; they never listen, so an aggregator's
view is how anyone can tell a site is up). Sites are not told about other
sites: run by a site, it shows the aggregators only. Sends no round and
changes nothing. Exit status 0 when everything is up, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..extras import require

__all__ = ["add_status_parser", "run_status_command", "gather_status", "format_status"]


def add_status_parser(subparsers: Any) -> None:
    """Add the ``status`` subcommand."""
    p = subparsers.add_parser("status", help="which parties of a deployed study are up; which sites each aggregator hears",
                              description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, metavar="STUDY.toml", help="the study file")
    p.add_argument("--name", default=None, metavar="NAME",
                   help="the party whose key to use (default: the study's analyst)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for each aggregator (default: %(default)s)")
    p.set_defaults(func=run_status_command)


def gather_status(study: Any, name: str | None = None, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Every aggregator's ``/v1/info`` as party `name` sees it, or ``{"error": ...}`` where it does not answer."""
    from .config_read import load_study
    from .config_schema import StudyConfig
    from .http import AggregatorClient
    from .revocation import RevocationList
    from .tls import client_ssl_context

    config = study if isinstance(study, StudyConfig) else load_study(study)
    party = config.analyst if name is None else config.party(name)
    ctx = client_ssl_context(config.ca_cert, party.cert, party.key)
    revoked = RevocationList(config.ca_crl, config.ca_cert)

    async def one(agg: Any) -> dict[str, Any]:
        client = AggregatorClient(agg, config.study_id, ctx, connect_timeout=timeout, ca_file=config.ca_cert,
                                  revocations=revoked)
        try:
            info = await asyncio.wait_for(client.info(), timeout)
            if party.role != "site":  # sites are not told which other sites are connected
                info["sites_seen"] = await asyncio.wait_for(client.presence(), timeout)
            return info
        except asyncio.TimeoutError:
            return {"error": f"no answer within {timeout:g} s"}
        except Exception as exc:  # any failure is what this command reports
            return {"error": str(exc) or type(exc).__name__}
        finally:
            await client.close()

    async def everyone() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(one(a) for a in config.aggregators)))

    return asyncio.run(everyone())


def format_status(config: Any, infos: list[dict[str, Any]]) -> tuple[str, bool]:
    """The printable status and whether everything is up (every aggregator, and every site everywhere)."""
    from .site_presence import connected

    digest = config.policy.digest()
    lines = [f"study {config.study_id!r}, policy {digest[:12]}", "aggregators:"]
    ok = True
    for agg, info in zip(config.aggregators, infos):
        if "error" in info:
            ok = False
            lines.append(f"  {agg.name:<16} {agg.url:<32} DOWN: {info['error']}")
            continue
        policy = "same policy" if info.get("policy") == digest else "ANOTHER POLICY than this study file"
        ok &= info.get("policy") == digest
        lines.append(f"  {agg.name:<16} {agg.url:<32} up; {policy}; {info.get('open_rounds', 0)} open round(s), "
                     f"next round {info.get('next_number')}")
    seen = [(agg, info["sites_seen"]) for agg, info in zip(config.aggregators, infos) if "sites_seen" in info]
    if not seen:
        lines.append("sites: not shown (only the analyst and the aggregators see which sites are connected)"
                     if any("error" not in i for i in infos) else "sites: unknown (no aggregator answered)")
        return "\n".join(lines), ok
    lines.append("sites (when each aggregator last heard from the site's agent):")
    for site in config.sites:
        cells = []
        for agg, report in seen:
            s = report.get(site.name) or {}
            if s.get("polling"):
                cells.append(f"{agg.name}: connected")
            elif s.get("last_seen_s") is None:
                cells.append(f"{agg.name}: never since it started")
            else:
                cells.append(f"{agg.name}: {s['last_seen_s']:.0f} s ago" + ("" if connected(s) else " (gone)"))
            ok &= connected(s)
        lines.append(f"  {site.name:<16} " + "; ".join(cells))
    return "\n".join(lines), ok


def run_status_command(args: argparse.Namespace) -> int:
    """``secagg-roc status``: 0 when every party is up, 1 otherwise (2 for a study file or key to fix)."""
    require("deploy", "the status client")
    from .config_read import load_study

    config = load_study(args.study)
    infos = gather_status(config, args.name, args.timeout)
    text, ok = format_status(config, infos)
    print(text)
    if not ok:
        print("secagg-roc status: not every party is up (see above)", file=sys.stderr)
    return 0 if ok else 1
