"""A site agent's check on start: has its database forgotten DP releases the aggregators saw?

Run by each Site (`site_process.run_site`), before it follows any feed. A site
whose database was put back from an older copy (a backup, a VM snapshot) or
replaced by an empty one has forgotten the DP releases made since; drawn again,
they would spend its budget twice. Each aggregator keeps the chain of DP
releases it saw from the site (`dp_chain`) and tells the site its own on
``/v1/info`` (only its own: TLS says which site asks). If a chain an aggregator
holds is not a prefix of the site's ledger's, the agent refuses to start and
says why, unless its operator passes ``--dp-ledger-lost-on-purpose``: the site
then logs a "lost" ledger entry (durable, in its snapshot too) and refuses every
new DP release of the study from then on (its budget counts as spent), while
it still takes part in exact rounds and replays nothing it no longer holds. The
decision is durable: later starts skip the check.

An aggregator that does not answer within `WAIT_S` is skipped with a warning
(its chain is checked again at every DP share it receives: a rolled-back site's
share is refused there). With the flag, an aggregator that cannot be asked
counts as a mismatch: the ledger cannot be shown complete, so the budget counts
as spent.
"""

from __future__ import annotations

import asyncio
import logging

from ..dp_chain import HEAD_BYTES
from ..errors import ConfigError, SecAggError
from ..ledger import Ledger
from .http import AggregatorClient
from .http_protocol import TransportError
from .tls import AuthError
from .site_fetch import SMALL_REPLY_BYTES
from .site_log import LEDGER_PREFIX
from .store import Store

__all__ = ["check_dp_ledger", "lost_problem", "WAIT_S", "LOST_FLAG"]

log = logging.getLogger("secagg_roc.site")

#: Seconds the agent tries each aggregator's ``/v1/info`` on start before it goes on without it.
WAIT_S = 5.0
#: The operator's flag: the site's DP ledger was lost and it knows.
LOST_FLAG = "--dp-ledger-lost-on-purpose"


def lost_problem(site: str, ledger: Ledger, seen: dict[str, bytes]) -> str | None:
    """Why the ledger has forgotten DP releases the aggregators saw (`seen`: name -> chain), or None."""
    behind = [name for name, chain in seen.items() if ledger.dp_chain[:len(chain)] != chain]
    if not behind:
        return None
    return (f"site {site!r}: its database has forgotten DP releases that aggregator(s) {', '.join(behind)} saw "
            "it make (it was restored from an older copy, or replaced): drawn again, they would spend its DP "
            "budget twice. Put back the site's latest database, or, if the DP ledger is lost for good, start the "
            f"agent with {LOST_FLAG}: its DP budget for this study then counts as spent (no new DP release)")


async def _ask(client: AggregatorClient, wait_s: float) -> bytes | None:
    """The chain `client`'s aggregator holds for this site; None if it cannot be asked within `wait_s`."""
    loop = asyncio.get_running_loop()
    give_up, delay = loop.time() + wait_s, 0.1
    while True:
        try:
            info = await client.info(limit=SMALL_REPLY_BYTES)
            return bytes.fromhex(str(info.get("dp_chain", "")))
        except (TransportError, SecAggError, ValueError) as exc:
            if isinstance(exc, AuthError) or loop.time() + delay > give_up:  # a TLS problem stays: no retrying
                # Why it cannot be reached is the feed's to say (once per aggregator, with the operator's hint):
                # said here too, every misconfigured start would print each hint twice.
                log.warning("could not ask %s which DP releases it saw from this site; going on (it checks every "
                            "DP share of this site itself)", client.name)
                log.debug("asking %s for this site's DP chain: %s", client.name, exc)
                return None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


async def check_dp_ledger(site: str, ledger: Ledger, store: Store, clients: list[AggregatorClient], *,
                          lost_on_purpose: bool = False, wait_s: float = WAIT_S) -> None:
    """Run by a Site's agent on start: refuse to start (ConfigError) if an aggregator saw DP releases its
    ledger forgot; with `lost_on_purpose`, log a "lost" entry instead (every new DP release refused)."""
    if ledger.dp_lost:  # the operator's decision stands (durably): nothing new is drawn, nothing to compare
        log.info("this site's DP ledger was declared lost (%s): its DP budget counts as spent", LOST_FLAG)
        return
    answers = await asyncio.gather(*(_ask(c, wait_s) for c in clients))
    seen = {c.name: chain for c, chain in zip(clients, answers) if chain is not None}
    problem = lost_problem(site, ledger, seen)
    if not lost_on_purpose:
        if problem is not None:
            raise ConfigError(problem)
        return
    if problem is None and len(seen) == len(clients):
        log.warning("%s: every aggregator's record of this site's DP releases is in its ledger: nothing was "
                    "lost, and nothing is changed", LOST_FLAG)
        return
    entry = Ledger.lost_entry({name: len(chain) // HEAD_BYTES for name, chain in seen.items()})
    store.append_many([(LEDGER_PREFIX + entry.kind, 0, entry.body)], power_safe=True)
    ledger.apply(entry)
    log.warning("%s: this site's DP ledger is lost (%s); its DP budget for this study counts as spent: it "
                "refuses every new DP release from now on", LOST_FLAG,
                problem or "an aggregator could not be asked which DP releases it saw")
