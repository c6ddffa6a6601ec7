"""Exceptions raised by secagg-roc.

Every error names what was wrong and, where there is one, how to fix it. The
hierarchy lets a service map errors to responses (a `MessageError` is the
sender's fault, a `RoundError` a protocol-order problem) without string matching.
"""

from __future__ import annotations


class SecAggError(Exception):
    """Base class of every error this library raises on purpose."""


class EncodingError(SecAggError, ValueError):
    """A value cannot be encoded in the ring (NaN, infinity, or it could wrap when summed).

    The message names the offending value, for the party that holds it; `public`
    says the same without the value, for texts that leave a site.
    """

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public or message


class MessageError(SecAggError, ValueError):
    """A message is malformed: bad bytes, version, lengths, dtype, shape or identifiers."""


class RoundError(SecAggError):
    """A message does not fit the state of its round (unknown site, duplicate, closed round...)."""


class PrivacyError(SecAggError):
    """A release would break a privacy rule (fewer than `min_sites` sites or `q` records...)."""


class PolicyError(PrivacyError):
    """A request falls outside the study's privacy policy, a run's plan or a site's ledger.

    Raised by every Site (and the analyst's side, which checks the same rules
    first). The message names the rule and the request, never a record value:
    whether a request is refused depends on the policy and on the requests made
    so far, not on the data.
    """


class CombineError(SecAggError):
    """Aggregate shares that do not belong together (round, contributor set, encoding)."""


class SiteQueryError(SecAggError, ValueError):
    """A site query refused its parameters or its data; the message names the site."""


class ConfigError(SecAggError, ValueError):
    """A study definition, key file or command-line setting is invalid."""


class TamperError(CombineError):
    """Aggregate shares that cannot all be honest: an aggregator altered what it returned.

    Raised by whoever combines (the Analyst, a Site) under a scheme that holds
    redundant shares (replicated sharing; Shamir with more than `threshold`
    aggregators answering) instead of returning a wrong total. `suspects` are
    the aggregator indices consistent with the evidence: one when the culprit
    is identified.
    """

    def __init__(self, message: str, suspects: tuple[int, ...] = ()):
        super().__init__(message)
        self.suspects = tuple(suspects)


class WeakThresholdWarning(UserWarning):
    """A pairwise-masking threshold of at most half the sites: the server, with one colluding site, can
    unmask a site's input by sending two survivor sets (`sharing.PairwiseSharing.threat_model`)."""
