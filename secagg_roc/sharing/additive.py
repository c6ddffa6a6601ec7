"""Additive N-of-N secret sharing over Z_2^64, seed-compressed.

A Site draws N-1 fresh seeds from the operating system; aggregator j != holder
receives seed j, which stands for the pseudorandom vector PRG(seed_j); the
holder receives the correction x - sum_j PRG(seed_j). Any N-1 of the N shares
are jointly uniform and independent of x, so N-1 colluding aggregators learn
nothing; all N sum to x. A site therefore sends about one vector plus N-1
seeds instead of N vectors. A short vector (a Fisher round's few totals) takes
its N-1 masks whole from the operating system instead of from seeds. Inside
one process a seed also comes with its stream as the site wrote it
(`prg.Expansion`), so the seed is expanded once rather than twice.
"""

from __future__ import annotations

import secrets
from typing import Any, Mapping

import numpy as np

from .. import prg
from ..ring import FixedPoint
from .base import Payload, SharingScheme
from .threat import ThreatModel


#: Vectors of at most this many elements are split with masks drawn whole from the operating system (a site
#: uploads N short vectors instead of one vector and N-1 seeds): cheaper than setting up a keystream for each.
WHOLE_MASKS = 64


class AdditiveSharing(SharingScheme):
    name = "additive"
    private = True
    accepts_seeds = True

    @property
    def threat_model(self) -> ThreatModel:
        n = self.n_aggregators
        return ThreatModel(
            scheme=self.name, servers=n, max_colluding_servers=n - 1, server_dropouts=0,
            trust=f"any {n - 1} of the {n} aggregators may collude: only all {n} together see a site's input",
            site_dropouts="before its shares arrive at every aggregator (the total is over the sites all accepted)",
            malicious={"aggregator alters its aggregate share": "undetected",
                       "aggregator withholds its aggregate share": "blocked",
                       "site sends a malformed share": "blocked"},
            upload_vectors_per_site=1.0, coalition=f"{n - 1} of {n} aggregators",
            notes=(f"a site uploads one ring vector and {n - 1} 16-byte seeds (a vector of at most {WHOLE_MASKS} "
                   f"elements: {n} vectors, the masks drawn whole from the operating system)",),
        )

    @classmethod
    def check_n(cls, n_aggregators: int) -> int:
        if int(n_aggregators) < 2:
            raise ValueError("additive sharing needs at least 2 non-colluding aggregators")
        return int(n_aggregators)

    def fresh_seeds(self, holder: int = 0) -> dict[int, bytes]:
        """One seed per aggregator but the holder."""
        return {j: prg.new_seed() for j in range(self.n_aggregators) if j != holder}

    def split(self, encoded: np.ndarray, *, holder: int = 0) -> list[Payload]:
        """Run by a Site. `holder` (the aggregator that gets the correction) rotates across sites
        so that no aggregator receives every full-size vector."""
        if not 0 <= holder < self.n_aggregators:
            raise ValueError(f"holder must be in 0..{self.n_aggregators - 1}")
        correction = np.ascontiguousarray(encoded, dtype=np.uint64)
        payloads: list[Payload] = []
        for j in range(self.n_aggregators):
            if j == holder:
                payloads.append(Payload())  # filled below, once every seed is subtracted
                continue
            seed = prg.new_seed()
            prg.add_stream(seed, correction, subtract=True)
            payloads.append(Payload(seed=seed))
        payloads[holder] = Payload(vector=correction)
        return payloads

    def share(
        self,
        x: np.ndarray,
        codec: FixedPoint,
        *,
        holder: int = 0,
        out: np.ndarray | None = None,
        seeds: Mapping[int, bytes] | None = None,
        session: Any = None,
    ) -> list[Payload]:
        """Run by a Site: like `split(codec.encode(x))`, but each block is masked with
        every seed's keystream right after it is encoded, while it is in cache.

        The seeds are fresh from the operating system unless `seeds` (aggregator
        index -> seed, for every index but `holder`) is given. That exists for
        one use only: a restarted site re-creating, bit for bit, the split it
        logged before sending (the same seeds over the same `x` give the same
        shares). Never pass seeds that were used for other data."""
        if not 0 <= holder < self.n_aggregators:
            raise ValueError(f"holder must be in 0..{self.n_aggregators - 1}")
        if seeds is None and np.size(x) <= WHOLE_MASKS:
            return self._share_small(x, codec, holder, out)
        if seeds is None:
            seeds = {j: prg.new_seed() for j in range(self.n_aggregators) if j != holder}
        else:
            want = set(range(self.n_aggregators)) - {holder}
            if set(seeds) != want:
                raise ValueError(f"seeds must be given for aggregators {sorted(want)} exactly, got {sorted(seeds)}")
            seeds = {j: bytes(seeds[j]) for j in sorted(want)}  # Keystream checks each seed's length
        streams = [prg.Keystream(s) for s in seeds.values()]
        # In one process that recycles its buffers (an embedded federation), each stream is also kept whole as
        # it masks, and handed to the seed's aggregator with the seed: the seed is then expanded once, not
        # twice (AES was ~half a round's time; K=10, d=1e6: ~29 -> ~25 ms a round). Bounded by the pool.
        kept = [None if self.buffers is None else self.buffers.lend(np.size(x)) for _ in streams]
        done = 0

        def mask(block: np.ndarray) -> None:
            nonlocal done
            end = done + block.size
            for stream, whole in zip(streams, kept):
                if whole is None:
                    stream.apply(block, subtract=True)
                else:  # written where it is kept, then subtracted while this block is still in cache
                    stream.write(whole[done:end])
                    np.subtract(block, whole[done:end], out=block)
            done = end

        correction = codec.encode(x, out=out, on_chunk=mask)
        correction = correction if correction.ndim == 1 else correction.reshape(-1)
        expansions = {j: None if whole is None else prg.Expansion(seeds[j], whole) for j, whole in zip(seeds, kept)}
        return [Payload(vector=correction) if j == holder else Payload(seed=seeds[j], expansion=expansions[j])
                for j in range(self.n_aggregators)]

    def _share_small(self, x: np.ndarray, codec: FixedPoint, holder: int, out: np.ndarray | None) -> list[Payload]:
        """Run by a Site: a short vector's masks drawn whole from the operating system instead of from seeds.

        The shares are distributed exactly as seeded ones (N-1 uniform vectors, the holder's the correction),
        with true randomness instead of a keystream, and nobody sets up a cipher for a few elements (a
        Fisher round's totals are 7 numbers). A split that must be re-created later passes `seeds`."""
        correction = codec.encode(x, out=out)
        correction = correction if correction.ndim == 1 else correction.reshape(-1)
        n = correction.size
        masks = {}
        for j in range(self.n_aggregators):
            if j != holder:
                masks[j] = np.frombuffer(secrets.token_bytes(8 * n), dtype=np.uint64)
                np.subtract(correction, masks[j], out=correction)
        return [Payload(vector=correction) if j == holder else Payload(vector=masks[j]) for j in range(self.n_aggregators)]

    def materialize(self, out: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator: the keystream is written straight into `out` (or copied, if its site kept it)."""
        if payload.expansion is not None:
            np.copyto(out, payload.expansion.stream)
        elif payload.seed is not None:
            prg.Keystream(payload.seed).write(out)
        else:
            np.copyto(out, payload.vector)

    def summable(self, payload: Payload) -> np.ndarray | None:
        """Run by an Aggregator: a vector payload, or a seed's stream its site kept, is the vector itself."""
        return payload.vector if payload.expansion is None else payload.expansion.stream

    def accumulate(self, acc: np.ndarray, payload: Payload) -> None:
        """Run by an Aggregator."""
        if payload.expansion is not None:
            np.add(acc, payload.expansion.stream, out=acc)
        elif payload.seed is not None:
            prg.add_stream(payload.seed, acc)
        else:
            np.add(acc, payload.vector, out=acc)
