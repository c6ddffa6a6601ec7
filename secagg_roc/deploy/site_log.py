"""What a site agent logs, and reading it back: split records, ledger entries, where the log is.

Run by each Site. Its agent (`site_answers.SiteAnswers`) logs every answer
before anything is sent, in its own `store.Store` (``state/<site>.sqlite`` by
default, `default_state_path`). Log entry kinds (every body is bytes):
``query`` (the encoded `Query` of an answered round), ``ledger:exact`` /
``ledger:noisy`` (a `LedgerEntry` body), ``answer`` (the split record, JSON),
``rng`` (the noise generator's state after the answer, JSON; only when it
changed), ``refusal`` (frames: StatusRequest, ErrorReply) and ``release``
(frames: every aggregator's AggregateShare or ForwardedShares of the round).

An answer is logged as its split, not its share vectors (`split_record`): a
few hundred bytes of seeds and digests, enough to re-create the identical
shares from the same data after a restart and to check that they are
identical (`split_mismatch`). The share vectors are digested with GMAC under
a fresh random key logged with the seeds (a tenth of SHA-256's CPU on an 8 MB
vector); records written with SHA-256 digests are still checked as such.
The database's ``meta`` also keeps the entropy of the noise generator's seed
sequence (`NOISE_SEED_KEY`, written on the first start: `durable_noise_rng`).
``secagg-roc site check`` reads the site's ledger from the log
(`read_ledger`). The log is compacted as rounds settle (`site_compaction`):
the ledger, the noise state and what else must be kept move into a snapshot;
the live runs' entries stay.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..ledger import Ledger, LedgerEntry
from ..messages import InputShare, RoundId
from ..policy import Policy
from ..study import site_noise_rng
from .config_schema import StudyConfig
from .store import Store

__all__ = [
    "LEDGER_PREFIX",
    "SPLIT_FORMAT",
    "default_state_path",
    "durable_noise_rng",
    "NOISE_SEED_KEY",
    "read_ledger",
    "split_record",
    "split_mismatch",
    "split_round",
]


#: Log kinds of ledger entries: ``ledger:<LedgerEntry.kind>``.
LEDGER_PREFIX = "ledger:"
#: ``meta`` key of a site's noise seed: its generator's seed-sequence entropy (JSON), kept for the database's life.
NOISE_SEED_KEY = "noise_seed"


def durable_noise_rng(store: Store, seed: int | None, site: str) -> np.random.Generator:
    """Run by a Site's agent on start: its noise generator, built from the seed sequence its database keeps
    (drawn from `seed`, or the operating system, on the database's first start; a later `seed` is ignored).

    Only the generator's state is logged with each answer (``rng``), but its seed sequence is a secret too:
    it keys the site's bootstrap weights (`queries.bootstrap.site_key`). Drawn afresh at every start, it gave
    a restarted site a new key: the same bootstrap request then released fresh replicates of the same data
    (unbounded by ``MAX_BOOT`` across restarts), and the shares of a round answered before the restart could
    not be re-created from the log (tests/test_attacks_redteam_budget.py)."""
    entropy = site_noise_rng(seed, site).bit_generator.seed_seq.entropy
    kept = json.loads(store.keep_meta(NOISE_SEED_KEY, json.dumps(entropy)))
    return np.random.default_rng(np.random.SeedSequence(kept))


def default_state_path(config: StudyConfig, site: str) -> Path:
    """Where a site agent keeps its log by default: ``state/<site>.sqlite`` next to the study file."""
    base = config.source.parent if config.source is not None else Path.cwd()
    return base / "state" / f"{site}.sqlite"


def read_ledger(path: str | os.PathLike[str], policy: Policy, site: str) -> Ledger:
    """Site `site`'s ledger as its agent's database records it (read-only; safe while the agent runs)."""
    ledger = Ledger(policy, site)
    path = Path(path)
    if not path.exists():
        return ledger
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        # One read transaction: a compaction commits the snapshot and the deletions together.
        db.execute("BEGIN")
        snap = db.execute("SELECT value FROM meta WHERE key = 'snapshot'").fetchone()
        rows = db.execute("SELECT kind, body FROM log WHERE kind LIKE 'ledger:%' ORDER BY seq").fetchall()
        db.execute("COMMIT")
    if snap is not None:  # a compacted log: the ledger up to the snapshot is in it (`site_compaction`)
        from .site_compaction import restore_ledger

        restore_ledger(ledger, json.loads(snap[0])["ledger"])
    for kind, body in rows:
        ledger.apply(LedgerEntry(kind[len(LEDGER_PREFIX):], bytes(body)))
    return ledger


#: Format tag of a logged answer (its split, not its vectors).
SPLIT_FORMAT = "split-v1"


def _share_meta_digest(shares: list[InputShare]) -> str:
    """SHA-256 of what every share of one split carries besides its payload: round, site,
    encoding, record count and layout (one digest: all shares of a split carry the same)."""
    metas = {
        json.dumps(
            [s.round_id.study, s.round_id.number, s.round_id.query.hex(), s.site, s.encoding.frac_bits,
             bool(s.encoding.integer), int(s.records), [[n, list(shape), bool(i)] for n, shape, i in s.layout]]
            + (["raw"] if s.encoding.raw else []),
            separators=(",", ":"),
        )
        for s in shares
    }
    if len(metas) != 1:
        raise ValueError("the shares of one split disagree on their round, site, encoding, records or layout")
    return hashlib.sha256(metas.pop().encode()).hexdigest()


#: Bytes of the random key of a split record's vector digests (AES-256-GMAC).
MAC_KEY_BYTES = 32
_GMAC_NONCE = bytes(12)  # one key digests one split (and its re-creations, which must be the same vectors)


def _vector_bytes(vector: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(vector, dtype=np.uint64)).cast("B")


def _vector_sha256(vector: np.ndarray) -> str:
    return hashlib.sha256(_vector_bytes(vector)).hexdigest()


def _vector_gmac(key: bytes, vector: np.ndarray) -> str:
    """GMAC (AES-GCM over no plaintext, the vector as associated data) of `vector` under `key`.

    Why it is as good as SHA-256 here: the key is drawn fresh for each split and logged next to
    its seeds, so only who holds the site's log knows it, and that holder has the seeds already
    (which with the holder's share give the site's input away). For any other change of a
    vector (e.g. the site's data file replaced before a restart) two different vectors of L
    16-byte blocks get the same tag with probability at most (L + 1) / 2^128 (under 2^-108 at
    d = 1e6): GHASH is a polynomial in the secret hash key. It costs a tenth of SHA-256 (8 MB:
    well under 1 ms with carry-less multiplication, against 5-10 ms), which was a fifth of a
    site's CPU per round."""
    return AESGCM(key).encrypt(_GMAC_NONCE, b"", _vector_bytes(vector)).hex()


def split_record(shares: list[InputShare], seeds: Mapping[int, bytes] | None = None, *,
                 mac_key: bytes | None = None, sha256: bool = False) -> dict[str, Any]:
    """What a site agent logs for an answer (SECRET: the seeds and the MAC key), as a JSON-able dict.

    Enough to re-create the identical shares from the same data
    (`Site.answer(query, seeds=...)`) and to check that they are identical:
    the round, the seeds of all the split's randomness (`SharingScheme.fresh_seeds`;
    under additive sharing, the seed each aggregator but the holder receives),
    digests of the vector payloads (additive: the holder's correction vector;
    GMAC under `mac_key`, fresh when None, see `_vector_gmac`; SHA-256 with
    `sha256`, as records before the GMAC were) and SHA-256 of the shares' public
    metadata.
    """
    rid = shares[0].round_id
    record: dict[str, Any] = {"format": SPLIT_FORMAT, "round": [rid.study, rid.number, rid.query.hex()],
                              "meta_sha256": _share_meta_digest(shares)}
    vectors = [s for s in shares if s.vector is not None]
    if seeds is None:  # the additive split: its seeds travel in the shares themselves
        if len(vectors) != 1 or any(s.seed is None for s in shares if s.vector is None):
            raise ValueError("a split is one vector share (the holder's) and seed shares for every other aggregator")
        seeds = {s.aggregator: s.seed for s in shares if s.seed is not None}
    if sha256:
        kind, digest = "sha256", _vector_sha256
    else:
        key = secrets.token_bytes(MAC_KEY_BYTES) if mac_key is None else bytes(mac_key)
        if len(key) != MAC_KEY_BYTES:
            raise ValueError(f"a split record's MAC key is {MAC_KEY_BYTES} bytes")
        record["mac_key"] = key.hex()
        kind, digest = "gmac", lambda v: _vector_gmac(key, v)
    if len(vectors) == 1 and all(s.seed is not None for s in shares if s.vector is None):
        record["holder"] = int(vectors[0].aggregator)
        record[f"correction_{kind}"] = digest(vectors[0].vector)
    else:  # every aggregator gets a vector (Shamir, replicated)
        record[f"vectors_{kind}"] = {str(s.aggregator): digest(s.vector) for s in vectors}
    record["seeds"] = {str(k): bytes(v).hex() for k, v in sorted(seeds.items())}
    return record


def split_mismatch(record: Mapping[str, Any], shares: list[InputShare]) -> str | None:
    """Why `shares` are not the split `record` describes, or None when they are identical."""
    try:
        seeds = {int(k): bytes.fromhex(v) for k, v in record.get("seeds", {}).items()}
        additive = "correction_gmac" in record or "correction_sha256" in record
        if "mac_key" in record:
            again = split_record(shares, None if additive else seeds, mac_key=bytes.fromhex(record["mac_key"]))
        else:  # a record written before the GMAC digests
            again = split_record(shares, None if additive else seeds, sha256=True)
    except (ValueError, TypeError, AttributeError) as exc:
        return str(exc)
    for key, what in (
        ("round", "round"),
        ("holder", "holder aggregator (did the study's site list change?)"),
        ("seeds", "seeds"),
        ("meta_sha256", "layout, encoding or record count"),
        ("correction_gmac", "share vector"),
        ("vectors_gmac", "share vectors"),
        ("correction_sha256", "share vector"),
        ("vectors_sha256", "share vectors"),
    ):
        if again.get(key) != record.get(key):
            return f"the shares re-created from its data with the logged seeds differ in their {what}"
    return None


def split_round(record: Mapping[str, Any]) -> RoundId:
    """The round a split record (`split_record`) answers."""
    study, number, query = record["round"]
    return RoundId(str(study), int(number), bytes.fromhex(query))
