"""A site's ledger: the exact releases it took part in, its DP releases, and the budget they cost.

Kept by each Site, consulted before anything leaves it, and made durable
before the shares that carry a release are sent (the deployed site agent
writes ledger entries and its answer in one SQLite transaction; see
`deploy.site_agent`). Three rules live here:

* **No differencing across runs.** Two exact releases over different
  contributor sets let the analyst subtract one from the other (different
  analyses share ingredients, so this holds across quantities too). Before
  contributing to a release, the site forms the atoms of every contributor set
  it has released over, plus the new one (sites grouped by which of those sets
  they are in): each atom must hold at least ``min_sites`` sites, and two
  nested sets must differ by at least q records. The aggregators check the
  same over every release they made (they also see releases this site did not
  take part in). A site whose data changed since its earlier releases refuses
  exact releases: before and after could be differenced to reveal the change.
* **DP releases are computed once.** A DP release is keyed by its query, its
  privacy parameters and the site's data (a summed release the site noises
  itself, also by its contributor set); a repeat replays the stored values,
  never draws new noise (averaging repeats would otherwise remove the noise).
* **A budget.** Each new DP release is charged (`dp.accounting.Charge`) and
  refused if the site's total would exceed its policy's budget.
* **A chain the aggregators check.** The charged releases form a hash chain
  (`dp_chain`), sent with every DP share: an aggregator refuses a share whose
  chain does not extend what it saw, so a site restored from an older copy
  of its database cannot spend its budget again. A site whose operator
  declares the ledger lost on purpose (a "lost" entry) refuses every new DP
  release of the study: its budget counts as spent.

Ledger entries (`LedgerEntry`) are plain JSON, so a deployed site can replay
its database into a fresh `Ledger` after a restart: no release exists without
its charge, and no charge is counted twice (a DP release is stored by key).
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from . import dp_chain
from .dp.accounting import Charge, Spent, total
from .errors import PolicyError
from .policy import Policy
from .site_sets import site_set
from .quick_init import quick_init


#: Exact releases a ledger keeps one by one (the latest); older ones are only counted.
KEEP_EXACT = 1024

@quick_init
@dataclass(frozen=True)
class ExactRelease:
    """One exact (secure-sum) release this site took part in."""

    quantity: str  # hex digest of the query and its parameters, without the run
    run: str
    step: int
    contributors: tuple[str, ...]
    records: int  # total records of the contributor set
    data: str  # digest of this site's data when it contributed


@dataclass(frozen=True)
class NoisyRelease:
    """One per-site release: DP-noised values (with their charge) or, in non-private mode, exact ones."""

    key: str
    run: str
    step: int
    values: dict[str, np.ndarray]
    charge: Charge | None  # None: the non-private validation mode (no DP, no budget)


class LedgerEntry:
    """What a site persists before a release leaves it: ``kind`` is "exact" or "noisy", ``body`` JSON.

    An entry the ledger made itself keeps its body as a dict too, and encodes it only when someone reads
    `body` (the deployed site persisting it): an embedded site applies it without a JSON round trip."""

    __slots__ = ("kind", "_body", "_record")

    def __init__(self, kind: str, body: bytes | None = None, *, record: dict[str, Any] | None = None):
        if body is None and record is None:
            raise ValueError("a ledger entry needs its body")
        self.kind = kind
        self._body = body
        self._record = record

    @property
    def body(self) -> bytes:
        if self._body is None:
            self._body = json.dumps(self._record, sort_keys=True).encode()
        return self._body

    def record(self) -> dict[str, Any]:
        """The body as a fresh dict (decoded from JSON unless the ledger made this entry)."""
        return json.loads(self._body) if self._record is None else dict(self._record)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LedgerEntry) and (self.kind, self.body) == (other.kind, other.body)

    def __hash__(self) -> int:
        return hash((self.kind, self.body))

    def __repr__(self) -> str:
        return f"LedgerEntry({self.kind!r}, {self.body!r})"


class Ledger:
    """Site `site`'s ledger under `policy` (see the module docstring). Run by that Site."""

    def __init__(self, policy: Policy, site: str):
        self.policy = policy
        self.site = site
        #: quantity -> (run, step) -> release, for the latest `KEEP_EXACT` releases (an audit trail; the rules
        #: need only `sets`, which is bounded by the distinct contributor sets, and the counts).
        self.exact: dict[str, dict[tuple[str, int], ExactRelease]] = {}
        self._exact_order: deque[tuple[str, tuple[str, int]]] = deque()
        #: quantity -> how many exact releases of it this site took part in (all of them).
        self.exact_counts: dict[str, int] = {}
        self.noisy: dict[str, NoisyRelease] = {}
        #: Every contributor set this site released over, with its total record count.
        self.sets: dict[frozenset[str], int] = {}
        self.data_digests: set[str] = set()
        #: The heads of the hash chain over the charged DP releases, in the order they were made (`dp_chain`).
        self.dp_chain = b""
        #: Set by a "lost" entry: the operator started the site on a database that lost DP releases.
        self.dp_lost = False

    # -- exact releases ----------------------------------------------------------

    def check_data(self, data: str) -> None:
        """Refuse to take part in a new run once the site's data differ from those of its exact releases."""
        if self.data_digests and data not in self.data_digests:
            raise PolicyError(
                f"site {self.site!r}: ledger: its data changed since its earlier releases in this study; releases "
                "before and after the change could be differenced to reveal it (a new study id is needed)"
            )

    def check_exact(self, contributors: Iterable[str], records: int, data: str) -> None:
        """Refuse to contribute over `contributors` if it could be differenced against earlier releases (PolicyError)."""
        new = site_set(contributors).members  # the same object for the same set: O(1) lookups below
        if not self.sets:
            return
        self.check_data(data)
        if new in self.sets:
            return  # the same sites again: nothing new to subtract
        sets = [*self.sets, new]
        atoms: dict[tuple[bool, ...], int] = {}
        for site in frozenset().union(*sets):
            signature = tuple(site in s for s in sets)
            atoms[signature] = atoms.get(signature, 0) + 1
        q, m = self.policy.privacy_level, self.policy.min_sites
        small = min(atoms.values())
        if small < m:
            raise PolicyError(
                f"site {self.site!r}: ledger: an earlier release covered another set of sites; with this "
                f"contributor set the analyst could difference out {small} site(s), fewer than min_sites = {m}"
            )
        for old, old_records in self.sets.items():
            if (old < new or new < old) and abs(int(records) - old_records) < q:
                raise PolicyError(  # the rule, not the difference: that would be a count
                    f"site {self.site!r}: ledger: an earlier release covered a contributor set that differs from "
                    f"this one by fewer than q = {q} records"
                )

    def exact_entry(self, quantity: str, run: str, step: int, contributors: Iterable[str], records: int,
                    data: str) -> LedgerEntry:
        """The entry recording a contribution (persist it, then `apply` it, before sending the shares)."""
        body = {"quantity": quantity, "run": run, "step": int(step), "contributors": site_set(contributors).names,
                "records": int(records), "data": data}
        return LedgerEntry("exact", record=body)

    # -- per-site releases (DP or, in non-private mode, exact) ---------------------

    def lookup(self, key: str) -> NoisyRelease | None:
        """The stored release under `key`, to replay it instead of drawing new noise."""
        return self.noisy.get(key)

    def spent(self, extra: Charge | None = None) -> Spent:
        """The site's total privacy loss so far (plus `extra`) under its policy's rule."""
        dp = self.policy.dp
        charges = [r.charge for r in self.noisy.values() if r.charge is not None]
        if extra is not None:
            charges.append(extra)
        if dp is None:
            return total(charges, "basic", 0.0, 0.0)
        return total(charges, dp.accounting, dp.budget_epsilon, dp.budget_delta)

    def check_charge(self, charge: Charge) -> None:
        """Refuse a new DP release that would take the site over its budget (PolicyError)."""
        if self.dp_lost:
            raise PolicyError(
                f"site {self.site!r}: ledger: a new DP release would exceed this site's privacy budget: its DP "
                "budget counts as spent (its operator started it on a database that lost its DP releases, "
                "--dp-ledger-lost-on-purpose)"
            )
        after = self.spent(charge)
        if not after.within_budget:
            raise PolicyError(
                f"site {self.site!r}: ledger: a new DP release would exceed this site's privacy budget: "
                f"{after.describe()}"
            )

    def noisy_entry(self, key: str, run: str, step: int, values: Mapping[str, np.ndarray],
                    charge: Charge | None) -> LedgerEntry:
        """The entry recording a per-site release and its charge (persist, then `apply`, before sending)."""
        body = {
            "key": key, "run": run, "step": int(step),
            "values": {name: np.asarray(v, dtype=np.float64).tolist() for name, v in values.items()},
            "charge": None if charge is None else charge.to_dict(),
        }
        return LedgerEntry("noisy", record=body)

    def chain_after(self, entries: Iterable[LedgerEntry]) -> bytes:
        """The DP release chain once `entries` are applied (what a DP share carries; `dp_chain`)."""
        new, seen = [], set(self.noisy)
        for entry in entries:
            if entry.kind != "noisy":
                continue
            body = entry.record()
            if body["key"] not in seen and body["charge"] is not None:
                seen.add(body["key"])
                new.append((body["key"], body["run"], int(body["step"]), body["charge"]))
        return dp_chain.extend(self.site, self.dp_chain, new) if new else self.dp_chain

    @staticmethod
    def lost_entry(aggregators: Mapping[str, int]) -> LedgerEntry:
        """The entry an operator's ``--dp-ledger-lost-on-purpose`` logs: how many DP releases each aggregator
        had seen from this site. Once applied, every new DP release of the study is refused."""
        return LedgerEntry("lost", record={"seen": dict(sorted(aggregators.items()))})

    # -- state ----------------------------------------------------------------------

    def apply(self, entry: LedgerEntry) -> None:
        """Add a persisted entry (also used to replay a database after a restart)."""
        body = entry.record()
        if entry.kind == "exact":
            sites = site_set(body["contributors"])
            release = ExactRelease(body["quantity"], body["run"], int(body["step"]), sites.names,
                                   int(body["records"]), body["data"])
            kept = self.exact.setdefault(release.quantity, {})
            if (release.run, release.step) not in kept:
                kept[(release.run, release.step)] = release
                self.exact_counts[release.quantity] = self.exact_counts.get(release.quantity, 0) + 1
                self._exact_order.append((release.quantity, (release.run, release.step)))
                while len(self._exact_order) > KEEP_EXACT:  # a long study's ledger stays bounded
                    quantity, key = self._exact_order.popleft()
                    del self.exact[quantity][key]
                    if not self.exact[quantity]:
                        del self.exact[quantity]
            self.sets[sites.members] = min(self.sets.get(sites.members, release.records), release.records)
            self.data_digests.add(release.data)
        elif entry.kind == "noisy":
            if body["key"] in self.noisy:
                return  # the same release again (a replayed log): charged once
            charge = None if body["charge"] is None else Charge(**body["charge"])
            values = {name: np.asarray(v, dtype=np.float64) for name, v in body["values"].items()}
            self.noisy[body["key"]] = NoisyRelease(body["key"], body["run"], int(body["step"]), values, charge)
            if charge is not None:
                self.dp_chain = dp_chain.extend(self.site, self.dp_chain,
                                                [(body["key"], body["run"], int(body["step"]), body["charge"])])
        elif entry.kind == "lost":
            self.dp_lost = True
        else:
            raise ValueError(f"unknown ledger entry kind {entry.kind!r}")

    def summary(self) -> dict[str, Any]:
        """What this site has released, for its operator (counts and budget; no values)."""
        spent = self.spent()
        return {
            "exact_quantities": len(self.exact_counts),
            "exact_releases": sum(self.exact_counts.values()),
            "dp_releases": sum(1 for r in self.noisy.values() if r.charge is not None),
            "non_private_releases": sum(1 for r in self.noisy.values() if r.charge is None),
            "budget": spent.describe() + (" (counted as spent: the DP ledger was lost)" if self.dp_lost else ""),
        }
