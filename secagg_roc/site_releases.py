"""A site's per-site releases and the summed releases it noises itself: replayed, or drawn and charged once.

Run by each Site (a mixin of `site.Site`). A DP release is computed once, recorded
in the site's ledger under a key of its study, query, parameters and data (and, for
a summed release, its contributor set), and replayed on every repeat; a new one is
checked against the policy and charged to the budget first. Every fresh Gaussian
release costs one release at the policy's own parameters (`DPPolicy.release_charge`),
however much noise it carries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from .errors import PolicyError
from .layout import flatten
from .ledger import Ledger, LedgerEntry
from .messages import InputShare, Query
from .plans import RunInfo, Step
from .plans.base import derived
from .policy import Policy
from .queries import SiteData, lookup, run_site_query
from .ring import RawFloat
from .sharing import SharingScheme

__all__ = ["NoisyReleases"]

#: `json.dumps(value, sort_keys=True)`, its encoder made once.
_SORTED_JSON = json.JSONEncoder(sort_keys=True).encode


def release_key_text(study: str, query: str, params_text: str, data_digest: str,
                     contributors: tuple[str, ...] | None = None) -> str:
    """`_SORTED_JSON([study, query, params, data_digest(, sorted(contributors))])` where `params_text` is
    `_SORTED_JSON(params)`: a list's items written one by one and joined as the encoder joins them (", ")."""
    items = [_SORTED_JSON(study), _SORTED_JSON(query), params_text, _SORTED_JSON(data_digest)]
    if contributors is not None:
        items.append(_SORTED_JSON(sorted(contributors)))
    return "[" + ", ".join(items) + "]"


class NoisyReleases:
    """The DP releases of a `site.Site` (which provides the attributes below)."""

    name: str
    study: str
    data: SiteData
    policy: Policy
    ledger: Ledger
    scheme: SharingScheme
    holder: int
    data_digest: str

    def _check_consent(self, args: Mapping[str, Any]) -> None:  # (`site.Site`)
        raise NotImplementedError

    def _release_key(self, step: Step, contributors: tuple[str, ...] | None = None) -> str:
        """The ledger's key of a DP release: this study, the step's query and parameters, this site's data,
        and for a summed release the site noises itself its `contributors`: replayed over another set, a
        site's noise share would recur beside fresh ones and could be isolated by differencing, charged once
        (tests/test_attacks_combined.py); over another set it is drawn and charged afresh."""
        # A step's parameters are canonical (`Step` made them so): the same text as converting them again. The
        # blob is `_SORTED_JSON(parts)` for parts = [study, query, params, data digest(, sorted contributors)],
        # written item by item as the encoder joins a list's items (", "): the parameters' text is a function of
        # the step alone, made once for the sites of this process that share the step (`derived`).
        params_text = derived(step, "sorted json", lambda: _SORTED_JSON(step.params))
        blob = release_key_text(self.study, step.query, params_text, self.data_digest, contributors)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _noised_sum(self, info: RunInfo, number: int, step: Step, replay: bool) -> tuple[Mapping, int, list]:
        """A summed release this site noises itself (distributed DP): replayed from the ledger, or
        checked against the policy, charged, drawn once and recorded (as `_per_site` does)."""
        key = self._release_key(step, info.contributors)
        stored = self.ledger.lookup(key)
        if stored is not None:
            return stored.values, self.data.records(), []  # a repeat: the same noisy values, never new noise
        if replay:
            raise PolicyError(f"site {self.name!r}: round {number} of run {info.run!r}: its release is not in the "
                              "ledger; no new noise is drawn to re-create it")
        spec = lookup(step.query)
        self.policy.check_pure_dp(step.params.get("epsilon"))
        charge = spec.charge(step.params)
        self.ledger.check_charge(charge)
        _, result = run_site_query(self.data.with_context(step.context), step.query, step.params, canonical=True)
        entry = self.ledger.noisy_entry(key, info.run, number, result.values, charge)
        return result.values, result.records, [entry]

    def _per_site(self, query: Query, info: RunInfo, number: int, step: Step, seeds, replay: bool = False
                  ) -> tuple[list, list]:
        """A per-site release: replayed from the ledger, or computed, charged and recorded."""
        if step.params.get("non_private") is True:
            # Whatever analysis asks for it: exact per-site values need the operator's consent too.
            self._check_consent({"mode": "non-private"})
        key = self._release_key(step)
        stored = self.ledger.lookup(key)
        entries: list[LedgerEntry] = []
        if stored is not None:
            values = stored.values  # a repeat: the same values, never new noise
        elif replay:
            raise PolicyError(
                f"site {self.name!r}: round {number} of run {info.run!r}: its release is not in the ledger "
                "(the site's data changed since it answered); no new noise is drawn to re-create it"
            )
        else:
            params = step.params
            if params.get("non_private") is True:
                self.policy.check_non_private()
                charge = None
            else:
                self.policy.check_dp(params.get("epsilon"), params.get("delta"), params.get("l2_sensitivity"),
                                     params.get("mechanism"))
                assert self.policy.dp is not None
                charge = self.policy.dp.release_charge()  # one policy-level release, whatever noise was asked
                self.ledger.check_charge(charge)
            _, result = run_site_query(self.data.with_context(step.context), step.query, params, canonical=True)
            values = result.values
            entries.append(self.ledger.noisy_entry(key, info.run, number, values, charge))
        layout, flat = flatten(values, lookup(step.query).outputs)
        payloads = self.scheme.share(flat, RawFloat(), holder=self.holder, seeds=seeds)
        shares = [
            InputShare(query.round_id, self.name, j, RawFloat().encoding_for(flat), self.data.records(), layout,
                       seed=p.seed, vector=p.vector)
            for j, p in enumerate(payloads)
        ]
        return shares, entries
