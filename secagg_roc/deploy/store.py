"""Durable state of a deployed party: an append-only log in SQLite (WAL).

Used by each Aggregator service and each Site agent. The design is the
simplest one that survives ``kill -9``: every *accepted* state-changing
message is appended, as the exact bytes that were accepted, and committed
before the reply leaves the process. On start the party replays the log, in
order, through a fresh state machine. Because every step is deterministic
(the aggregate of a round is a sum over the accepted shares), replaying a
`CloseRound` reproduces the identical release; a release is therefore never
made twice over different contributor sets, and a round number is never
reused for another query, even across restarts.

The file is SECRET: an aggregator's log holds its shares of every input; a
site's log holds the shares and DP releases it computed. ``meta`` binds the
file to one study and one party, so a database cannot be mixed up between
parties by a wrong path.

Durability: ``synchronous=FULL`` (the default) makes an acknowledged entry
survive power loss as well as a killed process; ``NORMAL`` survives a killed
process but may lose the last entries on power loss. Pages are 64 KiB because
share vectors are large blobs (a 8 MB vector writes about twice as fast as
with 4 KiB pages).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError

__all__ = ["LogEntry", "Store", "SYNC_MODES"]

SCHEMA_VERSION = "1"
SYNC_MODES = ("FULL", "NORMAL")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    kind   TEXT    NOT NULL,
    number INTEGER NOT NULL,
    party  TEXT    NOT NULL DEFAULT '',
    at     REAL    NOT NULL,
    body   BLOB    NOT NULL
);
"""


@dataclass(frozen=True)
class LogEntry:
    """One accepted message: its kind, round number, the party it concerns, when, and its bytes."""

    seq: int
    kind: str
    number: int
    party: str
    at: float
    body: bytes


class Store:
    """An append-only, durable log of accepted messages in one SQLite file.

    Thread-safe (one connection behind a lock), so a service may append from a
    worker thread while its event loop keeps serving.
    """

    def __init__(self, path: str | os.PathLike[str], *, study: str, party: str, synchronous: str = "FULL"):
        self.path = Path(path)
        sync = synchronous.upper()
        if sync not in SYNC_MODES:
            raise ConfigError(f"synchronous must be one of {', '.join(SYNC_MODES)}, got {synchronous!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        new = not self.path.exists()
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a commit is exactly one append.
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            if new:
                os.chmod(self.path, 0o600)  # the log holds shares: owner only
                self._db.execute("PRAGMA page_size=65536")
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise ConfigError(f"{self.path}: SQLite refused WAL mode (got {mode!r})")
            self._db.execute(f"PRAGMA synchronous={sync}")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path}: not a usable secagg-roc database: {exc}") from None
        self._lock = threading.Lock()
        self._bind(study, party)

    def _bind(self, study: str, party: str) -> None:
        """Refuse a database that belongs to another study or party (a mixed-up --name or path)."""
        want = {"schema": SCHEMA_VERSION, "study": study, "party": party}
        have = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not have:
            with self._lock:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", sorted(want.items()))
                self._db.execute("COMMIT")
            return
        for key, value in want.items():
            if have.get(key) != value:
                raise ConfigError(
                    f"{self.path}: this database belongs to {key} {have.get(key)!r}, not {value!r}; "
                    "pass the right --name / database path (never share a database between parties)"
                )

    def append(self, kind: str, number: int, body: bytes | memoryview, *, party: str = "", at: float | None = None) -> int:
        """Durably append one entry and return its sequence number (committed when this returns)."""
        return self.append_many([(kind, number, body)], party=party, at=at)

    def append_many(
        self, entries: list[tuple[str, int, bytes | memoryview]], *, party: str = "", at: float | None = None
    ) -> int:
        """Durably append `entries` (kind, number, body) in one transaction: all or none. Last seq."""
        stamp = time.time() if at is None else at
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                seq = 0
                for kind, number, body in entries:
                    cur = self._db.execute(
                        "INSERT INTO log(kind, number, party, at, body) VALUES (?, ?, ?, ?, ?)",
                        (kind, int(number), party, stamp, body),
                    )
                    seq = int(cur.lastrowid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return seq

    def entries(self, after: int = 0) -> Iterator[LogEntry]:
        """Every entry with ``seq > after``, in order (read in batches, so large logs stream)."""
        last = after
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT seq, kind, number, party, at, body FROM log WHERE seq > ? ORDER BY seq LIMIT 64", (last,)
                ).fetchall()
            if not rows:
                return
            for seq, kind, number, party, at, body in rows:
                last = seq
                yield LogEntry(seq, kind, number, party, at, bytes(body))

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM log").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
