"""The aggregators' guard against differencing: the contributor sets of every exact release made.

Run by each Aggregator. Two exact releases over different contributor sets
let the analyst subtract one from the other -- not only for the same quantity:
different analyses share ingredients (a GLM's first score vector holds the
number of positives that the ROC-GLM's counts release too) -- and several
releases can isolate a small group by linear algebra. So before an aggregator
releases anything it forms the *atoms* of all the contributor sets it ever
released over plus the new one -- the sites grouped by exactly which of those
sets they belong to -- and refuses unless every atom holds at least
``min_sites`` sites and ``q`` records. Any total the analyst can compute from
those releases is constant on atoms, so it never covers fewer.

In practice a study runs over one set of sites; a second set is accepted only
when it differs from every earlier one by whole groups of ``min_sites`` sites
and ``q`` records. Sites check the same rule in their ledgers over the runs
they took part in; an aggregator sees every release, including those a site
did not join.
"""

from __future__ import annotations

from typing import Mapping


def atoms_problem(sets: list[Mapping[str, int]], min_sites: int, privacy_level: int,
                  earlier: str = "an earlier release covered another set of sites") -> str | None:
    """Why the atoms of `sets` (each: site -> record count) are too small, or None (`earlier` opens the text)."""
    atoms: dict[tuple[bool, ...], list[str]] = {}
    for site in sorted(set().union(*sets)):
        atoms.setdefault(tuple(site in s for s in sets), []).append(site)
    for sites in atoms.values():
        # A site's count may differ between releases: the smallest one counts.
        count = sum(min(s[site] for s in sets if site in s) for site in sites)
        if len(sites) < min_sites or count < privacy_level:
            # The text reaches the analyst: it names the rule, never the atom's record count (data it was not given).
            return (
                f"{earlier}; together the releases would isolate "
                f"{len(sites)} site(s), fewer than min_sites = {min_sites} sites or q = {privacy_level} records"
            )
    return None


class DisclosureLog:
    """The distinct contributor sets (with each site's record count) of every exact release."""

    def __init__(self, min_sites: int, privacy_level: int):
        self.min_sites = int(min_sites)
        self.privacy_level = int(privacy_level)
        self.released: dict[frozenset[str], dict[str, int]] = {}

    def problem(self, records: Mapping[str, int], pending: Mapping[int, Mapping[str, int]] | None = None) -> str | None:
        """Why releasing over `records` (site -> record count) could be differenced, or None. `pending`: round
        number -> the contributor set of a release already under way (`Aggregator.reserve`), counted as made:
        so no release in between can make that one refuse once its place is held."""
        new = dict(records)
        if frozenset(new) in self.released:
            return None  # the same set again: nothing new to subtract
        if self.released:
            problem = atoms_problem([*self.released.values(), new], self.min_sites, self.privacy_level)
            if problem is not None:
                return problem
        if not pending:
            return None
        rounds = ", ".join(str(n) for n in sorted(pending))
        problem = atoms_problem([*self.released.values(), *pending.values(), new], self.min_sites,
                                self.privacy_level, earlier=f"a release already under way (round {rounds}: held "
                                "while it is made at every aggregator, or while its sites reveal their unmask shares) "
                                "covers another set of sites")
        return None if problem is None else (f"{problem}; that release holds its place until it is made or its "
                                             "round is abandoned")

    def record(self, records: Mapping[str, int]) -> None:
        """Add a release (after `problem` found none)."""
        key = frozenset(records)
        old = self.released.get(key)
        self.released[key] = dict(records) if old is None else {s: min(old[s], records[s]) for s in key}
