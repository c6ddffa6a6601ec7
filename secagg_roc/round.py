"""One aggregation round as one aggregator holds it: the round state machine. Pure: no I/O.

A `Round` accepts one share per registered site, checks every share before it
touches state, and releases once, over the contributor set the analyst agreed
with all aggregators, and only if that set has at least `min_sites` sites and
`privacy_level` records: the sum of its shares for a secure-sum round, or, for
a per-site (DP) round, the shares themselves, forwarded unsummed so that no
aggregator ever holds a site's release. Whether the shares agree with each
other (layout, encoding, record counting) is decided at the close, never by
whichever came first.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from . import prg
from .buffers import BufferPool, RecyclingPool
from .errors import MessageError, PrivacyError, RoundError
from .messages import AggregateShare, ForwardedShares, InputShare, Query, RoundStatus, check_name
from .queries import QUERIES
from .ring import Encoding
from .runbook import rule_params
from .sharing import Payload, SharingScheme
from .wire import NAME_RE

NOT_COUNTED = -1
#: The largest record count a share may state: far beyond any study, and small enough that the counts of
#: every site sum in 64 bits (a count near 2^63 would overflow only when the release is encoded).
MAX_RECORDS = 1 << 40
#: A sum at least this large is accumulated in a buffer from the round's `accumulators` pool (if it has
#: one): a fresh 8 MB accumulator costs its first writes ~15-24 ms of the kernel zeroing its pages.
POOLED_SUM_BYTES = 1 << 20


@dataclass(frozen=True)
class RoundPolicy:
    """The public rules of every round in a study, identical at every aggregator."""

    sites: frozenset[str]
    min_sites: int = 2
    privacy_level: int = 5
    #: Deployed studies set this: a share without a record count is refused.
    require_records: bool = False
    #: Whether a run may start without every site (its join releases over the sites that joined).
    allow_dropouts: bool = False
    max_length: int = 1 << 27

    def __post_init__(self) -> None:
        if self.min_sites < 1:
            raise ValueError("min_sites must be >= 1")
        if self.privacy_level < 0:
            raise ValueError("privacy_level must be >= 0")
        for s in self.sites:
            check_name(s, "site")


class RoundState(enum.Enum):
    OPEN = "open"
    RELEASED = "released"
    ABANDONED = "abandoned"


class Round:
    """One round at one aggregator (run by that Aggregator)."""

    def __init__(
        self, query: Query, index: int, policy: RoundPolicy, scheme: SharingScheme, buffers: BufferPool | None = None,
        *, params: dict | None = None, accumulators: RecyclingPool | None = None,
    ):
        self.query = query
        #: The parameters its run's rules read (`runbook.rule_params`), parsed once (by the aggregator that
        #: opened the round, or here): this aggregator's own copy, which only it reads.
        self.params = rule_params(query.params if params is None else params, policy.sites)
        self.buffers = buffers
        #: Where a large sum is accumulated (`POOLED_SUM_BYTES`): recycled buffers, each handed out only once
        #: nothing references it any more (so never while a held release, or a reply being sent, reads it).
        self.accumulators = accumulators
        self.round_id = query.round_id
        self.index = index
        self.policy = policy
        self.scheme = scheme
        self.state = RoundState.OPEN
        spec = QUERIES.get(query.name)
        #: A per-site (DP) round: shares are forwarded unsummed, each site with its own layout.
        self.per_site = spec is not None and spec.release == "dp"
        #: A round that carries a DP release (per-site, or a sum the sites noise): its shares carry the site's
        #: DP release chain, which the aggregator checks (`dp_chain`).
        self.carries_dp = self.per_site or (spec is not None and spec.charge is not None)
        self.outputs = None if spec is None else spec.outputs
        #: The (name, integer) pairs every share's layout must have: the query's declared outputs.
        self._declared = None if spec is None else sorted((n, k == "int") for n, k in spec.outputs.items())
        #: The last layout found to match `_declared` (held: its id is not reused meanwhile).
        self._layout_seen: object = None
        self.accepted: dict[str, InputShare] = {}
        self.released: AggregateShare | ForwardedShares | None = None
        #: The contributor set of the release; kept after `forget` drops the share itself.
        self.released_over: tuple[str, ...] | None = None

    # -- submissions ---------------------------------------------------------

    def submit(self, share: InputShare) -> bool:
        """Accept `share`; True if new, False for an identical resubmission.

        Raises `RoundError`/`MessageError` without changing state for anything else.
        """
        self._check_share(share)
        previous = self.accepted.get(share.site)
        if previous is not None:
            if _same_payload(previous, share):
                return False
            raise RoundError(f"site {share.site!r} already submitted a different share to {self.round_id}")
        self.accepted[share.site] = share
        return True

    def _check_share(self, share: InputShare) -> None:
        _check_fields(share)
        rid = self.round_id
        if share.round_id is not rid and share.round_id != rid:  # (in process: often the query's own id)
            if (share.round_id.study, share.round_id.number) == (rid.study, rid.number):
                raise RoundError(f"share for {share.round_id} was computed for a different query than {rid}")
            raise RoundError(f"share for {share.round_id} sent to {rid}")
        if share.aggregator != self.index:
            raise RoundError(f"share addressed to aggregator {share.aggregator}, this is aggregator {self.index}")
        if share.site not in self.policy.sites:
            raise RoundError(f"unknown site {share.site!r}: not registered in study {rid.study!r}")
        if self.state is not RoundState.OPEN:
            raise RoundError(f"{rid} is {'closed' if self.state is RoundState.RELEASED else 'abandoned'}; share from {share.site!r} refused")
        length = share.length
        if length == 0 or length > self.policy.max_length:
            raise MessageError(f"share length {length} outside 1..{self.policy.max_length}")
        if share.seed is not None:
            if not self.scheme.accepts_seeds:
                raise MessageError(f"the {self.scheme.name} scheme carries vectors, not seeds")
            if len(share.seed) != prg.SEED_BYTES:
                raise MessageError(f"a seed is {prg.SEED_BYTES} bytes, got {len(share.seed)}")
            if share.expansion is not None:
                _check_expansion(share, self.scheme.payload_length(length))
        else:
            if share.expansion is not None:
                raise MessageError("only a seed comes with its stream")
            v = share.vector
            n = self.scheme.payload_length(length)
            if not isinstance(v, np.ndarray) or v.dtype != np.uint64 or v.shape != (n,):
                raise MessageError(f"share vector must be uint64 of shape ({n},) under the {self.scheme.name} scheme")
            problem = self.scheme.check_payload(v)
            if problem is not None:
                raise MessageError(f"share from {share.site!r}: {problem}")
        if share.records == NOT_COUNTED and self.policy.require_records:
            raise MessageError("this study requires a record count with every share")
        if share.records < NOT_COUNTED:
            raise MessageError(f"record count {share.records} is negative")
        if share.records > MAX_RECORDS:
            raise MessageError(f"record count {share.records} exceeds the largest a share may state (2^40)")
        if share.encoding.raw != self.per_site:
            what = "raw float64 encoding" if self.per_site else "fixed-point encoding"
            raise RoundError(f"share from {share.site!r}: a round of {self.query.name!r} takes a {what}")
        if not (share.encoding.integer or share.encoding.raw) and share.encoding.frac_bits != self.query.frac_bits:
            raise RoundError(
                f"share from {share.site!r} has frac_bits={share.encoding.frac_bits}, the query asked for {self.query.frac_bits}"
            )
        if self._declared is not None and share.layout is not self._layout_seen:
            pairs = [(n, i) for n, _, i in share.layout]  # a site's layout comes sorted by name (`flatten`)
            if pairs != self._declared and sorted(pairs) != self._declared:
                raise RoundError(f"share from {share.site!r}: its layout does not match the outputs {self.query.name!r} declares")
            # The very same layout object again (a plain layout is immutable: `_check_fields` found it so) needs
            # no second look: the sites of one process hand over one layout object per layout (`flatten`).
            self._layout_seen = share.layout
        # Whether the shares agree with each other is decided at the close (`_disagreeing`), never by
        # whichever share came first: one odd share must not make every honest one bounce.

    # -- release ------------------------------------------------------------

    def status(self) -> RoundStatus:
        return RoundStatus(self.round_id, tuple(sorted(self.accepted)), self.released_over is not None)

    def check_close(self, contributors: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
        """Every check that can refuse `close(contributors)`, changing nothing: the agreed set and its records.

        Run by an Aggregator before anything else acts on a close (pairwise masking ends its masked-input
        phase only for a close that will release)."""
        if not isinstance(contributors, (tuple, list)) or not all(isinstance(s, str) for s in contributors):
            raise MessageError("a contributor set is a sequence of site names")
        agreed = tuple(sorted(contributors))
        if len(set(agreed)) != len(agreed):
            raise RoundError("the contributor set lists a site twice")
        if self.released_over is not None:
            if self.released_over != agreed:
                raise PrivacyError(
                    f"{self.round_id} was released over {list(self.released_over)}; a second release "
                    f"over {list(agreed)} would reveal the difference between them"
                )
            if self.released is None:
                raise RoundError(f"{self.round_id} was released long ago; its aggregate share is no longer held")
            return agreed, self.released.records
        if self.state is RoundState.ABANDONED:
            raise RoundError(f"{self.round_id} was abandoned; nothing is released")
        missing = [s for s in agreed if s not in self.accepted]
        if missing:
            raise RoundError(f"cannot close {self.round_id}: no share from {missing} at aggregator {self.index}")
        if len(agreed) < self.policy.min_sites:
            raise PrivacyError(
                f"{self.round_id}: {len(agreed)} contributing site(s), fewer than min_sites={self.policy.min_sites}"
            )
        shares = [self.accepted[s] for s in agreed]
        if not self.per_site:
            odd = _disagreeing(shares)
            if odd:
                raise RoundError(
                    f"cannot close {self.round_id}: the shares of {odd} differ from the other contributors' in "
                    "layout, encoding or record counting (those sites computed something else)"
                )
        counted = shares[0].records != NOT_COUNTED
        records = sum(s.records for s in shares) if counted else NOT_COUNTED
        if counted and records < self.policy.privacy_level:
            raise PrivacyError(  # without the count: a total below q is exactly what q keeps from the analyst
                f"{self.round_id}: the total covers fewer than the privacy level q={self.policy.privacy_level} records"
            )
        return agreed, records

    def close(self, contributors: tuple[str, ...]) -> AggregateShare | ForwardedShares:
        """Release this aggregator's share of the total over `contributors` (once)."""
        return self.release_checked(*self.check_close(contributors))

    def release_checked(self, agreed: tuple[str, ...], records: int) -> AggregateShare | ForwardedShares:
        """The release over `agreed` once `check_close` passed and gave `agreed` and `records` (checks run once)."""
        if self.released is not None:
            return self.released  # the same release again reveals nothing new
        shares = [self.accepted[s] for s in agreed]
        if self.per_site:
            # Forwarded, never summed: this aggregator's share of each site's own release. Without the sites'
            # DP release chains: how many DP releases a site made is for the aggregators alone to know.
            bare = tuple(s if s.dp_chain is None and s.expansion is None else replace(s, dp_chain=None, expansion=None)
                         for s in shares)
            self.released = ForwardedShares(self.round_id, self.index, agreed, records, bare)
            self.released_over = agreed
            self.state = RoundState.RELEASED
            self.accepted = {s: _stub(v) for s, v in self.accepted.items()}
            return self.released
        n = self.scheme.payload_length(shares[0].length)
        payloads = [Payload(seed=s.seed, vector=s.vector, expansion=s.expansion) for s in shares]
        # Where this round hands its payloads' vectors back once summed, the first one becomes the sum instead
        # of being copied into a fresh one (the release then hands it back, at `forget`).
        adopted = None if self.buffers is None else self.scheme.summable(payloads[0])
        if adopted is not None and not (adopted.flags.writeable and adopted.flags.owndata):
            adopted = None  # (a mask drawn whole is read-only bytes; a crafted share may hand in anything)
        acc = self._accumulator(n) if adopted is None else adopted
        if adopted is None:
            self.scheme.materialize(acc, payloads[0])
        for p in payloads[1:]:
            self.scheme.accumulate(acc, p)
        self.released = AggregateShare(
            self.round_id, self.index, agreed, records, shares[0].encoding, shares[0].layout, acc
        )
        self.released_over = agreed
        self.state = RoundState.RELEASED
        if self.buffers is not None:  # the summed payloads are read by nobody any more
            for share in self.accepted.values():
                for vector in (share.vector, None if share.expansion is None else share.expansion.stream):
                    if vector is not adopted:
                        self.buffers.give(vector)
        self.accepted = {s: _stub(v) for s, v in self.accepted.items()}  # free the vectors
        return self.released

    def _accumulator(self, n: int) -> np.ndarray:
        """A uint64 vector of length `n`, arbitrary contents, that no one else reads (the sum overwrites it)."""
        if self.buffers is not None:
            return self.buffers.take(n)
        if self.accumulators is not None and 8 * n >= POOLED_SUM_BYTES:
            return self.accumulators.array(n, np.uint64)
        return np.empty(n, dtype=np.uint64)

    def abandon(self) -> None:
        """Give up an open round (its deadline passed): free its shares; it never releases."""
        if self.state is RoundState.OPEN:
            self.state = RoundState.ABANDONED
            self.accepted = {s: _stub(v) for s, v in self.accepted.items()}

    def forget(self) -> None:
        """Drop the released share's vector; the release itself (and its contributor set) is kept."""
        if self.buffers is not None and isinstance(self.released, AggregateShare):
            self.buffers.give(self.released.vector)
        self.released = None

    def site_records(self, contributors: tuple[str, ...]) -> dict[str, int]:
        """Each contributor's record count, as its share states it (public metadata)."""
        return {s: self.accepted[s].records for s in contributors if s in self.accepted}


def _check_fields(share: InputShare) -> None:
    """The field types the wire decoder guarantees, for messages handed over in process (crafted or not)."""
    if not isinstance(share.site, str) or not isinstance(share.aggregator, int):
        raise MessageError("a share names its site (a string) and aggregator (an index)")
    if not isinstance(share.encoding, Encoding):
        raise MessageError("a share states its encoding")
    if not isinstance(share.records, int) or isinstance(share.records, bool):
        raise MessageError("a share's record count is a whole number")
    if not _plain_layout(share.layout):
        raise MessageError("a share's layout must be a tuple of (name, shape, integer) triples: a valid name, "
                           "a tuple of non-negative ints, a bool")


def _check_expansion(share: InputShare, n: int) -> None:
    """A seed's stream handed over in process is used in place of the seed: it must be that seed's, whole."""
    e = share.expansion
    if (type(e) is not prg.Expansion or e.seed != share.seed or type(e.stream) is not np.ndarray
            or e.stream.dtype != np.uint64 or e.stream.shape != (n,)):
        raise MessageError(f"share from {share.site!r}: a seed's stream must be a prg.Expansion of that seed, "
                           f"uint64 of shape ({n},)")


def _plain_layout(layout: object) -> bool:
    """Whether `layout` has exactly the types `wire.parse_layout` gives (checked without encoding it: every
    share of every round is checked, and a round's own layouts are small). A layout found plain is kept by
    identity: a plain layout holds only immutable values (strings, tuples of ints, bools), so the same
    object is plain for good (the sites of one process hand over the same layout objects, `layout.flatten`)."""
    if type(layout) is not tuple:
        return False
    if _PLAIN.get(id(layout)) is layout:  # the very same object (held below, so its id is not reused)
        return True
    if not _check_plain(layout):
        return False
    _PLAIN[id(layout)] = layout
    if len(_PLAIN) > _PLAIN_KEPT:
        _PLAIN.clear()
    return True


#: Layouts found plain lately: id -> the layout itself.
_PLAIN: dict[int, tuple] = {}
_PLAIN_KEPT = 256


def _check_plain(layout: tuple) -> bool:
    """`_plain_layout`'s check of a tuple's entries."""
    for entry in layout:
        if type(entry) is not tuple or len(entry) != 3:
            return False
        name, shape, integer = entry
        if type(name) is not str or not NAME_RE.match(name) or type(integer) is not bool or type(shape) is not tuple:
            return False
        for d in shape:
            if type(d) is not int or d < 0:
                return False
    return True


def _release_bytes(release: AggregateShare | ForwardedShares | None) -> int:
    if isinstance(release, AggregateShare):
        return int(release.vector.nbytes)
    if isinstance(release, ForwardedShares):
        return sum(int(s.vector.nbytes) for s in release.shares if s.vector is not None)
    return 0


def _disagreeing(shares: list[InputShare]) -> list[str]:
    """The sites whose share differs in layout, encoding or record counting from the most common one
    (every site, if no form is held by more sites than any other)."""
    forms = [(s.layout, s.encoding, s.records == NOT_COUNTED) for s in shares]
    if forms and all(f == forms[0] for f in forms):  # the usual case, without hashing every form
        return []
    counts = Counter(forms)  # one pass: a round may have thousands of sites
    if len(counts) == 1:
        return []
    top = max(counts.values())
    majority = [f for f, c in counts.items() if c == top]
    if len(majority) > 1:
        return sorted(s.site for s in shares)
    return sorted(s.site for s, f in zip(shares, forms) if f != majority[0])


def _stub(share: InputShare) -> InputShare:
    """The share without its payload: kept after release only for status queries."""
    return InputShare(share.round_id, share.site, share.aggregator, share.encoding, share.records, share.layout, seed=b"")


def _same_payload(a: InputShare, b: InputShare) -> bool:
    if (a.encoding, a.records, a.layout) != (b.encoding, b.records, b.layout):
        return False
    if a.seed is not None or b.seed is not None:
        return a.seed == b.seed
    return bool(np.array_equal(a.vector, b.vector))
