"""Which sites an aggregator hears from, and when: the basis of ``secagg-roc status`` and fail-fast analyses.

Run by each Aggregator (`aggregator_service`): every site agent long-polls
the aggregator's feed, so a site that polled in the last `SITE_STALE_S`
seconds, or is polling now, is connected. Reported in ``/v1/presence`` to the
analyst and the aggregators (never to sites), so ``secagg-roc status`` shows
who is up and ``analyze`` names a site that is down before its first round.
One agent polls once at a time; polls of one site that keep overlapping mean
two agents run for it (each answering from its own data and ledger): the
aggregator's operator is warned.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from .http_protocol import TransportError

__all__ = ["SitePresence", "SITE_STALE_S", "connected", "absent_sites", "aggregators_up"]

#: A site agent polls every aggregator's feed at least every 20 s while it runs: one not heard
#: from for this long is not running, or cannot reach the aggregator.
SITE_STALE_S = 60.0


class SitePresence:
    """When each site last polled, and how many polls it has in flight (run by an Aggregator)."""

    def __init__(self, sites: Iterable[str], log: logging.Logger):
        self.sites = tuple(sites)
        self.log = log
        self.seen: dict[str, float] = {}
        self.polling: dict[str, int] = {}
        self._overlaps: dict[str, list[float]] = {}
        self._warned: dict[str, float] = {}

    def poll_started(self, site: str) -> None:
        """A feed poll of `site` began; warn when its polls keep overlapping (a restart's old poll overlaps once)."""
        now = time.monotonic()
        self.seen[site] = now
        if self.polling.get(site):
            recent = [t for t in self._overlaps.get(site, []) if now - t < 120.0] + [now]
            self._overlaps[site] = recent
            if len(recent) >= 3 and now - self._warned.get(site, -1e9) > 300.0:
                self._warned[site] = now
                self.log.warning("site %s polls this aggregator from two connections at once, again and again: two "
                                 "agents for %s seem to run (each answers from its own data and ledger); stop all "
                                 "but one", site, site)
        self.polling[site] = self.polling.get(site, 0) + 1

    def poll_ended(self, site: str) -> None:
        """A feed poll of `site` ended (answered, timed out or broken)."""
        self.polling[site] = max(0, self.polling.get(site, 0) - 1)
        self.seen[site] = time.monotonic()

    def report(self) -> dict[str, dict[str, Any]]:
        """Per site: a poll in flight, and seconds since it last polled (None: never since this aggregator started)."""
        now = time.monotonic()
        return {s: {"polling": bool(self.polling.get(s)),
                    "last_seen_s": None if s not in self.seen else round(now - self.seen[s], 1)}
                for s in self.sites}


def connected(seen: dict[str, Any] | None) -> bool:
    """True if a `report` entry says the site is connected (polling, or heard from within `SITE_STALE_S`)."""
    if not seen:
        return False
    last = seen.get("last_seen_s")
    return bool(seen.get("polling")) or (last is not None and last <= SITE_STALE_S)


def absent_sites(clients: list[Any], infos: list[dict[str, Any]], sites: tuple[str, ...],
                 study_file: str = "study.toml") -> list[str]:
    """Why each site whose agent some aggregator has not heard from recently is absent (for `preflight`)."""
    out = []
    for site in sites:
        for client, info in zip(clients, infos):
            if "sites_seen" not in info:
                continue  # an aggregator of an older version reports nothing: no claim either way
            seen = info["sites_seen"].get(site) or {}
            if connected(seen):
                continue
            when = ("never since it started" if seen.get("last_seen_s") is None
                    else f"last {seen['last_seen_s']:.0f} s ago")
            out.append(f"site {site!r} is not connected to aggregator {client.name!r} (heard from {when}): its "
                       f"agent must run (secagg-roc site --study {study_file} --name {site}) and reach {client.config.url}")
            break
    return out


def aggregators_up(clients: list[Any], infos: list[Any], need: int,
                   status: str) -> tuple[list[Any], list[dict[str, Any]], list[str]]:
    """Run by the Analyst (`RemoteStudy.preflight`): (the aggregators that answered, their infos, a warning per
    one that did not) from `infos` (an info or the exception of each of `clients`). `TransportError` when one
    did not and the scheme needs all (`need` >= len(clients)), or fewer than `need` answered; another error (a
    certificate or configuration problem) is raised as it is: it says what to fix itself."""
    down = [(c, i) for c, i in zip(clients, infos) if isinstance(i, BaseException)]
    for _, error in down:
        if not isinstance(error, TransportError):
            raise error
    if down and (need >= len(clients) or len(clients) - len(down) < need):
        who = "every aggregator" if need >= len(clients) else f"{need} of the {len(clients)} aggregators"
        raise TransportError(f"{down[0][1]} -- {who} must be running before an analysis ({status})")
    up = [(c, i) for c, i in zip(clients, infos) if not isinstance(i, BaseException)]
    warnings = [f"{error}: the scheme goes on with {need} of the {len(clients)} aggregators ({status})"
                for _, error in down]
    return [c for c, _ in up], [i for _, i in up], warnings
