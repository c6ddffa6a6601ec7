"""A site's chain of DP releases: what each aggregator remembers of it, so a rolled-back site is noticed.

A site's ledger (`ledger.Ledger`) is the only record of the DP releases it made. A site whose database is
put back from an older copy (a backup, a VM snapshot) or replaced by an empty one has forgotten the releases
made since, and would draw them again, charging a budget that was already spent. Nothing on the site alone can
notice (the copy is its whole state); the aggregators, who saw the rounds, can:

* Run by the Site: its ledger keeps a hash chain over its charged DP releases (`link`: each head hashes the
  previous one with the release's key, run, step and charge), and every share of a round that carries a DP
  release (a per-site release, or a summed one the site noises itself) carries the chain's heads
  (`InputShare.dp_chain`, one `HEAD_BYTES` digest per charged release; its length is the count).
* Run by each Aggregator: `ReleaseChains` keeps, per site, the longest chain it accepted (durably: the share
  is in its log, the chains in its snapshot). A share whose chain neither extends it nor is a prefix of it
  is refused (`check`): the site forgot releases (restored copy, fresh database) or made a different release
  after forgetting one (a fork). A prefix is accepted: the share of an older round delivered late, or a
  release replayed from the ledger (no new noise, nothing charged). A DP round's share without a chain is
  refused: the check cannot be skipped by leaving the field out.

The whole chain travels (not only its head) so that an aggregator that missed rounds (it was down, a share to
it was lost) can still check that a longer chain extends the one it holds. Its length is bounded by the
budget (every charged release costs some of it), and capped at `MAX_CHAIN` on the wire.

What an aggregator learns: the number of charged DP releases each site made in the study (and digests that
reveal nothing more). Forwarded per-site shares are stripped of the chain (`Round`), so the analyst and the
other sites do not learn it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

from .errors import PolicyError

__all__ = ["HEAD_BYTES", "MAX_CHAIN", "start", "link", "extend", "ReleaseChains", "rollback_text", "ROLLBACK"]

#: Bytes of one head (SHA-256).
HEAD_BYTES = 32
#: The most charged releases a chain on the wire may list (far more than any budget allows).
MAX_CHAIN = 4096
#: The words every refusal of a rolled-back site's share starts its reason with (tests and operators grep it).
ROLLBACK = "its DP ledger does not extend the DP releases this aggregator saw from it"


#: `json.dumps(value, sort_keys=True, separators=(",", ":"))` with its encoder made once (json.dumps makes one per
#: call when given options): every charged release of every site links its chain.
_LINK_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def start(site: str) -> bytes:
    """The chain's root for `site` (never sent: a chain of no release is empty)."""
    return hashlib.sha256(b"secagg-roc dp chain\0" + site.encode()).digest()


def link(previous: bytes, key: str, run: str, step: int, charge: dict[str, Any]) -> bytes:
    """The head after a charged release: the previous head and the release's identity and charge (not its
    values: a restored snapshot re-encodes them, and the key already binds query, parameters and data)."""
    charge = {k: float(v) for k, v in charge.items()}  # 1 and 1.0 are one charge: one head
    blob = _LINK_JSON([key, run, int(step), charge]).encode()
    return hashlib.sha256(previous + blob).digest()


def extend(site: str, chain: bytes, releases: Iterable[tuple[str, str, int, dict[str, Any]]]) -> bytes:
    """`chain` (concatenated heads) with one head more per (key, run, step, charge) in `releases`."""
    head = chain[-HEAD_BYTES:] if chain else start(site)
    out = bytearray(chain)
    for key, run, step, charge in releases:
        head = link(head, key, run, step, charge)
        out += head
    return bytes(out)


def rollback_text(site: str) -> str:
    """The refusal of a rolled-back site's DP share: it names the problem and what to do, never a count (the
    analyst may see it; how many DP releases a site made is the aggregators' to know)."""
    return (f"site {site!r}: {ROLLBACK} (the site's database was restored from an older copy or replaced, and "
            "it forgot DP releases it made, or released differently after forgetting one); its DP share is "
            "refused, so its budget is not spent twice. The site's operator must restore its latest database, "
            "or start the agent with --dp-ledger-lost-on-purpose (its DP budget then counts as spent)")


class ReleaseChains:
    """Per site, the longest DP release chain this aggregator accepted. Run by each Aggregator."""

    def __init__(self) -> None:
        self.chains: dict[str, bytes] = {}

    def count(self, site: str) -> int:
        """How many charged DP releases of `site` this aggregator saw."""
        return len(self.chains.get(site, b"")) // HEAD_BYTES

    def check(self, site: str, chain: bytes | None, required: bool) -> None:
        """Refuse (PolicyError) a share whose chain is missing where `required`, or neither extends nor is a
        prefix of the one held for `site`. Changes nothing."""
        if chain is None:
            if required:
                raise PolicyError(f"site {site!r}: a share of a DP round carries the site's DP release chain; "
                                  "this one has none (a site agent of an older version?)")
            return
        if len(chain) % HEAD_BYTES or len(chain) > MAX_CHAIN * HEAD_BYTES:
            raise PolicyError(f"site {site!r}: a DP release chain is up to {MAX_CHAIN} digests of {HEAD_BYTES} "
                              f"bytes; this one is {len(chain)} bytes")
        held = self.chains.get(site, b"")
        shorter, longer = (chain, held) if len(chain) <= len(held) else (held, chain)
        if longer[:len(shorter)] != shorter:
            raise PolicyError(rollback_text(site))

    def note(self, site: str, chain: bytes | None) -> bool:
        """After `check` passed and the share was accepted: keep the longer chain. True if it changed."""
        if chain is None or len(chain) <= len(self.chains.get(site, b"")):
            return False
        self.chains[site] = bytes(chain)
        return True

    def state(self) -> dict[str, str]:
        """For a snapshot: site -> its chain in hex."""
        return {s: c.hex() for s, c in sorted(self.chains.items())}

    def load(self, state: dict[str, str]) -> None:
        """From `state`'s dict (a snapshot of an older build has none: an empty dict)."""
        self.chains = {str(s): bytes.fromhex(c) for s, c in state.items()}
