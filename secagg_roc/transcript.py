"""What each party received: for tests ("what did aggregator-1 see in round 3?") and researchers.

Two depths. A *full* transcript keeps every message as its receiver got it
(``transcripts=True``): share vectors included, so a federation that keeps
one cannot recycle its buffers. A *light* transcript (the default) keeps who
sent which kind of message in which round, never the message body, so it
costs a few hundred nanoseconds per message and no memory for share vectors.
Both keep the last `keep` entries (a long simulation's transcript stays
bounded) and count every message ever received by kind.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Iterator

from .messages import Message

#: Entries a transcript keeps (the oldest are dropped first; counts by kind cover them all).
DEFAULT_KEEP = 20_000


@dataclass(slots=True)
class Received:
    """One message as its receiver got it (``message`` is None in a light transcript)."""

    sender: str
    kind: str
    round_number: int | None
    message: Message | None = field(default=None, repr=False)
    _nbytes: int | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int | None:
        """Encoded size: given by the sender in wire mode, else measured (once) from a kept message."""
        if self._nbytes is None and self.message is not None:
            self._nbytes = self.message.wire_size()
        return self._nbytes


class Transcript:
    """The messages one party received, oldest first (the last `keep` of them)."""

    def __init__(self, party: str, *, messages: bool = True, keep: int = DEFAULT_KEEP):
        self.party = party
        #: Whether message bodies are kept (a full transcript) or only sender, kind and round (light).
        self.messages = messages
        # A light transcript logs plain tuples (sender, kind, round, None, nbytes), made into `Received` entries
        # when read: a federation records every message of every round and reads a transcript rarely. A full
        # one logs `Received` entries, which measure a kept message's size once.
        self._log: deque[Received | tuple] = deque(maxlen=int(keep))
        #: Every message ever received, by kind (dropped entries included).
        self.counts: Counter[str] = Counter()

    def record(self, sender: str, message: Message, nbytes: int | None = None) -> None:
        """Add `message` from `sender`; `nbytes` is its encoded size when the caller already knows it."""
        rid = getattr(message, "round_id", None)
        kind = message.kind
        self.counts[kind] += 1
        number = None if rid is None else rid.number
        if self.messages:
            self._log.append(Received(sender, kind, number, message, nbytes))
        else:
            self._log.append((sender, kind, number, None, nbytes))

    @property
    def entries(self) -> list[Received]:
        """The kept entries, oldest first."""
        return [e if type(e) is Received else Received(*e) for e in self._log]

    def kinds(self) -> set[str]:
        """Every kind of message this party ever received."""
        return set(self.counts)

    def in_round(self, number: int) -> list[Received]:
        return [e for e in self.entries if e.round_number == number]

    def bytes_received(self) -> int | None:
        """Encoded bytes of the kept entries; None where a light transcript was not told the sizes."""
        sizes = [e.nbytes for e in self.entries]
        return None if any(n is None for n in sizes) else sum(sizes)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Received]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self._log)

    def __repr__(self) -> str:
        size = self.bytes_received()
        return (f"Transcript({self.party!r}, {'full' if self.messages else 'light'}, {len(self)} messages"
                + ("" if size is None else f", {size} bytes") + ")")
