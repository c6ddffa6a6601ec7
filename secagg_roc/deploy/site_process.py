"""The site agent's process: its study file, its data check, one announcement line, then `SiteAgent.run`.

Run by each Site (``secagg-roc site --study S --name N``, and `LocalCluster`
through `party_process`): the lock on its state file keeps a second agent of the
same site from starting, and a data file that would keep the site out of runs
is reported in the operator's log before the agent follows its aggregators, and a
database that forgot DP releases the aggregators saw stops it (`site_ledger_check`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..errors import ConfigError
from .config_read import load_study
from .config_schema import SiteConfig, StudyConfig, with_article
from .party_process import announce, hold_lock, stop_event
from .site_agent import SiteAgent
from .site_check import site_check
from .site_ledger_check import check_dp_ledger
from .site_log import default_state_path

__all__ = ["run_site"]

log = logging.getLogger("secagg_roc.site")


def run_site(
    config: StudyConfig | str,
    name: str,
    *,
    seed: int | None = None,
    state_path: str | None = None,
    allow_non_private: bool = False,
    synchronous: str = "FULL",
    ready: Callable[[str], None] | None = None,
    stop_on_eof: bool = False,
    dp_ledger_lost: bool = False,
) -> None:
    """Run site agent `name` until SIGINT, SIGTERM or (with `stop_on_eof`) EOF on stdin (run by that Site).

    On start the agent asks the aggregators which DP releases they saw from the site and refuses to start
    (ConfigError) if its ledger forgot any, unless `dp_ledger_lost` (``--dp-ledger-lost-on-purpose``): its DP
    budget then counts as spent (`site_ledger_check`)."""
    if not isinstance(config, StudyConfig):
        config = load_study(config)

    if not isinstance(config.party(name), SiteConfig):
        raise ConfigError(f"{name!r} is {with_article(config.party(name).role)} of study {config.study_id!r}, not a site")
    hold_lock(state_path or default_state_path(config, name), "site agent", name)

    async def main() -> None:
        agent = SiteAgent(
            config, name, seed=seed, state_path=state_path, allow_non_private=allow_non_private, synchronous=synchronous
        )
        stop = stop_event(stop_on_eof=stop_on_eof)
        try:  # before any feed is followed: a database that forgot DP releases answers nothing
            await check_dp_ledger(name, agent.ledger, agent.store, agent.clients, lost_on_purpose=dp_ledger_lost)
        except ConfigError:
            for client in agent.clients:
                await client.close()
            agent.store.close()
            raise
        report, clean = site_check(config, name, state_path=state_path)
        if not clean:  # the operator's own log: what keeps this site out of runs, with columns and rows
            log.warning("the site's data would keep it out of runs; fix the data file and restart the agent "
                        "(`secagg-roc site check` prints this report):\n%s", report)
        n = {k: int(v.size if v.ndim == 1 else v.shape[0]) for k, v in agent.data.arrays.items()}
        announce(
            f"site {name!r} of study {config.study_id!r}: {max(n.values(), default=0)} records from "
            f"{agent.party.data}; policy {agent.policy.digest()[:12]} ({agent.policy.describe()}); "
            f"{len(agent.answers)} logged answers replayed; following {len(agent.clients)} aggregators (outbound only)",
            ready,
        )
        await agent.run(stop)

    asyncio.run(main())
