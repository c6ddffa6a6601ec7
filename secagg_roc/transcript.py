"""What each party received: for tests ("what did aggregator-1 see in round 3?") and researchers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .messages import Message


@dataclass(frozen=True)
class Received:
    """One message as its receiver got it."""

    sender: str
    kind: str
    nbytes: int
    message: Message

    @property
    def round_number(self) -> int | None:
        rid = getattr(self.message, "round_id", None)
        return None if rid is None else rid.number


class Transcript:
    """The ordered list of messages one party received."""

    def __init__(self, party: str):
        self.party = party
        self.entries: list[Received] = []

    def record(self, sender: str, message: Message, nbytes: int | None = None) -> None:
        """Add `message` from `sender`; `nbytes` is its encoded size when the caller already knows it."""
        size = message.wire_size() if nbytes is None else nbytes
        self.entries.append(Received(sender, message.kind, size, message))

    def kinds(self) -> set[str]:
        return {e.kind for e in self.entries}

    def in_round(self, number: int) -> list[Received]:
        return [e for e in self.entries if e.round_number == number]

    def bytes_received(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def __iter__(self) -> Iterator[Received]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Transcript({self.party!r}, {len(self)} messages, {self.bytes_received()} bytes)"
