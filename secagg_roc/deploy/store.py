"""Durable state of a deployed party: a log in SQLite (WAL), appended to and compacted.

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
site's log holds the splits (PRG seeds and digests) of its answers, its ledger
(with the DP releases it computed and their charges), its DP-noise state and
the releases it received. ``meta`` binds the file to one study and one party,
so a database cannot be mixed up between parties by a wrong path.

Durability: ``synchronous=FULL`` (the default) makes an acknowledged entry
survive power loss as well as a killed process; ``NORMAL`` survives a killed
process but may lose the last entries on power loss, except those appended
``power_safe`` (a site's releases, its ledger: fsync'd in any mode). Pages are 64 KiB because
share vectors are large blobs (a 8 MB vector writes about twice as fast as
with 4 KiB pages).

Large bodies (at least `SIDE_BYTES`, i.e. share vectors) are not stored in
SQLite but in side files in ``<database>.blobs/`` (a folder only the owner may
open; each file owner-only, SECRET like the database): the file is written,
fsync'd, renamed into place and its folder fsync'd *before* the row that
names it (with its size) is committed, so an acknowledged entry is as durable
as an inline one, and `entries` returns the same bytes either way. SQLite
would write such a blob twice (WAL, then checkpoint) at about 30 ms per 8 MB
here; a side file takes about 12 ms, and is written with ``O_DIRECT`` where the file
system allows it (`side_file`: no copy into the page cache; the same fsyncs). A file left by a crash before its row
was committed is never referenced and is removed on the next open. Schema 2
adds the ``file`` and ``size`` columns; a schema 1 database is upgraded in
place when opened (an older build then refuses it instead of misreading it).

Compaction (`compact`, used by the aggregators, see `compaction`, and the sites, see `site_compaction`): a party may
replace the past of its log by a *snapshot* of its state, kept in ``meta``,
in ONE transaction that writes the snapshot and deletes the entries it
stands for (those up to its ``upto`` sequence number, except the ones the
party names to keep); side files of deleted entries are unlinked only after
the commit, and the WAL is then checkpointed and truncated (it would keep
its largest size, up to SQLite's 1000-page autocheckpoint: 64 MB). A kill -9
at any point leaves either the old log or the snapshot and its kept entries,
never a mixture; the side files of a crash
between commit and unlink are orphans, removed on the next open. Schema 3
marks a database that may hold a snapshot (schemas 1 and 2 are upgraded in
place), so that a build which would replay the log without it refuses the file.
"""

from __future__ import annotations

import mmap
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from .side_file import SideFileWriter

__all__ = ["LogEntry", "Store", "SYNC_MODES"]

SCHEMA_VERSION = "3"
SYNC_MODES = ("FULL", "NORMAL")
#: Bodies at least this large go to fsync'd side files (see the module docstring).
SIDE_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS log (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    kind   TEXT    NOT NULL,
    number INTEGER NOT NULL,
    party  TEXT    NOT NULL DEFAULT '',
    at     REAL    NOT NULL,
    body   BLOB    NOT NULL,
    file   TEXT    NOT NULL DEFAULT '',
    size   INTEGER NOT NULL DEFAULT 0
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
            self.synchronous = sync
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(log)")}
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"{self.path}: not a usable secagg-roc database: {exc}") from None
        self._lock = threading.Lock()
        self.blobs = self.path.with_name(self.path.name + ".blobs")
        self._side = SideFileWriter()
        self._bind(study, party, columns)
        self._remove_orphans()

    def _bind(self, study: str, party: str, columns: set[str]) -> None:
        """Refuse a database that belongs to another study or party (a mixed-up --name or path)."""
        want = {"schema": SCHEMA_VERSION, "study": study, "party": party}
        have = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        if not have:
            with self._lock:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT INTO meta(key, value) VALUES (?, ?)", sorted(want.items()))
                self._db.execute("COMMIT")
            return
        if have.get("schema") in ("1", "2") and have.get("study") == study and have.get("party") == party:
            with self._lock:  # schema 1 -> 3: side-file columns (every old row stays inline); 2 -> 3: nothing
                self._db.execute("BEGIN IMMEDIATE")
                if "file" not in columns:
                    self._db.execute("ALTER TABLE log ADD COLUMN file TEXT NOT NULL DEFAULT ''")
                if "size" not in columns:
                    self._db.execute("ALTER TABLE log ADD COLUMN size INTEGER NOT NULL DEFAULT 0")
                self._db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (SCHEMA_VERSION,))
                self._db.execute("COMMIT")
            have["schema"] = SCHEMA_VERSION
        for key in ("study", "party", "schema"):
            value = want[key]
            if have.get(key) != value:
                raise ConfigError(
                    f"{self.path}: this database belongs to {key} {have.get(key)!r}, not {value!r}; "
                    "pass the right --name / database path (never share a database between parties)"
                )

    def append(self, kind: str, number: int, body: bytes | memoryview, *, party: str = "", at: float | None = None,
               durable: bool = True) -> int:
        """Append one entry and return its sequence number (committed when this returns).

        ``durable=False`` skips the fsync for an entry that can be fetched again
        if a power loss takes it (a site's copy of a release): it still survives
        a killed process, and the next durable append makes it durable too."""
        if durable or self.synchronous != "FULL":
            return self.append_many([(kind, number, body)], party=party, at=at)
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            return self.append_many([(kind, number, body)], party=party, at=at)
        finally:
            with self._lock:
                self._db.execute("PRAGMA synchronous=FULL")

    def append_many(
        self, entries: list[tuple[str, int, bytes | memoryview]], *, party: str = "", at: float | None = None,
        power_safe: bool = False,
    ) -> int:
        """Durably append `entries` (kind, number, body) in one transaction: all or none. Last seq.

        `power_safe` commits with ``synchronous=FULL`` even in ``NORMAL`` mode (the WAL is fsync'd, so every
        entry before these becomes durable too): for what must never be lost once it left, as a site's
        DP release (a site that forgot it would draw it afresh: `site_answers`)."""
        stamp = time.time() if at is None else at
        with self._lock:
            if not power_safe or self.synchronous == "FULL":
                return self._append_rows(entries, party, stamp)
            self._db.execute("PRAGMA synchronous=FULL")
            try:
                return self._append_rows(entries, party, stamp)
            finally:
                self._db.execute(f"PRAGMA synchronous={self.synchronous}")

    def _append_rows(self, entries: list[tuple[str, int, bytes | memoryview]], party: str, stamp: float) -> int:
        """`append_many`'s transaction (with the lock held)."""
        # Large bodies: durable side files first; a crash before the commit leaves only orphans.
        rows = []
        for kind, number, body in entries:
            size = len(memoryview(body).cast("B")) if isinstance(body, (bytes, bytearray, memoryview)) else -1
            if size >= SIDE_BYTES:
                rows.append((kind, int(number), party, stamp, b"", self._write_side_file(body), size))
            else:
                rows.append((kind, int(number), party, stamp, body, "", 0))
        self._db.execute("BEGIN IMMEDIATE")
        try:
            seq = 0
            for row in rows:
                cur = self._db.execute(
                    "INSERT INTO log(kind, number, party, at, body, file, size) VALUES (?, ?, ?, ?, ?, ?, ?)", row
                )
                seq = int(cur.lastrowid)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            for row in rows:
                if row[5]:
                    (self.blobs / row[5]).unlink(missing_ok=True)
            raise
        return seq

    def _write_side_file(self, body: bytes | bytearray | memoryview) -> str:
        """Write `body` to a new owner-only file, fsync it and its folder; return its name."""
        if not self.blobs.exists():
            self.blobs.mkdir(mode=0o700, exist_ok=True)
            self._fsync_dir(self.blobs.parent)
        name = f"{secrets.token_hex(16)}.blob"
        tmp = self.blobs / (name + ".tmp")
        self._side.write(tmp, body)  # written and fsync'd (O_DIRECT where it works: no page-cache copy)
        os.replace(tmp, self.blobs / name)
        self._fsync_dir(self.blobs)
        return name

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_side_file(self, seq: int, name: str, size: int) -> bytes:
        try:
            with open(self.blobs / name, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ConfigError(f"{self.path}: log entry {seq}: its side file cannot be read: {exc}") from None
        if len(data) != size:
            raise ConfigError(f"{self.path}: log entry {seq}: side file {name} has {len(data)} bytes, not {size}")
        return data

    def _remove_orphans(self) -> None:
        """Delete side files no committed row names (written just before a crash)."""
        if not self.blobs.is_dir():
            return
        with self._lock:
            named = {f for (f,) in self._db.execute("SELECT file FROM log WHERE file != ''")}
        for path in self.blobs.iterdir():
            if path.name not in named:
                path.unlink(missing_ok=True)

    def entries(self, after: int = 0) -> Iterator[LogEntry]:
        """Every entry with ``seq > after``, in order (read in batches, so large logs stream)."""
        last = after
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT seq, kind, number, party, at, body, file, size FROM log WHERE seq > ? ORDER BY seq LIMIT 64",
                    (last,),
                ).fetchall()
            if not rows:
                return
            for seq, kind, number, party, at, body, file, size in rows:
                last = seq
                data = self._read_side_file(seq, file, size) if file else bytes(body)
                yield LogEntry(seq, kind, number, party, at, data)

    def map_body(self, seq: int) -> memoryview | None:
        """Entry `seq`'s body as a read-only memory map of its side file (None: no such entry, or its body is
        inline). Its pages are read from the file when touched; the mapping stays valid after the entry's
        side file is unlinked (side files are never written again once committed)."""
        with self._lock:
            row = self._db.execute("SELECT file, size FROM log WHERE seq = ?", (int(seq),)).fetchone()
        if row is None or not row[0]:
            return None
        name, size = row
        try:
            with open(self.blobs / name, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.path}: log entry {seq}: its side file cannot be mapped: {exc}") from None
        if len(mapped) != size:
            raise ConfigError(f"{self.path}: log entry {seq}: side file {name} has {len(mapped)} bytes, not {size}")
        return memoryview(mapped)

    def keep_meta(self, key: str, value: str) -> str:
        """The value of ``meta`` `key`: `value` if the database has none yet (stored, committed), else the
        stored one, for ever (a party's durable secret, e.g. a site's noise seed: see `site_answers`)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", (key, value))
                row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return str(row[0])

    def snapshot(self) -> str | None:
        """The snapshot the last `compact` wrote (None: the log holds the party's whole history)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'snapshot'").fetchone()
        return None if row is None else str(row[0])

    def last_seq(self) -> int:
        """The sequence number of the newest entry (0 for an empty log)."""
        with self._lock:
            return int(self._db.execute("SELECT coalesce(max(seq), 0) FROM log").fetchone()[0])

    def numbers(self, upto: int) -> set[int]:
        """The round numbers of the entries with ``seq <= upto``."""
        with self._lock:
            return {int(n) for (n,) in self._db.execute("SELECT DISTINCT number FROM log WHERE seq <= ?", (upto,))}

    def compact(self, snapshot: str, upto: int, *, keep_numbers: dict[str, list[int]],
                keep_seqs: list[int], renumber: list[tuple[int, int]] = ()) -> int:
        """Store `snapshot` and delete the entries with ``seq <= upto`` it stands for: all of them but
        those of a kind in `keep_numbers` with a round number listed there, and those in `keep_seqs`.
        One transaction; `renumber` (seq, number) first corrects the round number of old entries.
        Returns how many entries were deleted."""
        keep = " OR ".join(
            [f"(kind = ? AND number IN ({','.join('?' * len(ns))}))" for ns in keep_numbers.values() if ns]
            + ([f"seq IN ({','.join('?' * len(keep_seqs))})"] if keep_seqs else [])
        )
        params: list[object] = [int(upto)]
        for kind, ns in keep_numbers.items():
            if ns:
                params += [kind, *map(int, ns)]
        params += [int(q) for q in keep_seqs]
        where = "seq <= ?" + (f" AND NOT ({keep})" if keep else "")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("UPDATE log SET number = ? WHERE seq = ?", [(n, q) for q, n in renumber])
                files = [f for (f,) in self._db.execute(f"SELECT file FROM log WHERE {where} AND file != ''", params)]
                deleted = self._db.execute(f"DELETE FROM log WHERE {where}", params).rowcount
                self._db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('snapshot', ?)", (snapshot,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        for name in files:  # after the commit: a crash here leaves orphans, removed on the next open
            (self.blobs / name).unlink(missing_ok=True)
        with self._lock:  # the WAL file keeps its largest size (64 KiB pages: ~64 MB) unless truncated
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return int(deleted)

    def disk_bytes(self) -> int:
        """Bytes on disk of the database, its WAL and its side files."""
        paths = [self.path, self.path.with_name(self.path.name + "-wal")]
        if self.blobs.is_dir():
            paths += list(self.blobs.iterdir())
        return sum(p.stat().st_size for p in paths if p.exists())

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
