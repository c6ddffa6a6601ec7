"""What a Site does with a query: check it, run it, encode and split the output.

Run by each Site, in the embedded study and in the deployed site agent alike.
The only things that leave here are secret shares (with public metadata: the
layout of the output, its encoding and the record count) and, for queries the
protocol declares DP-protected, the noised values.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import EncodingError, MessageError, SiteQueryError
from .messages import DPRelease, InputShare, Layout, PublicValue, Query, check_name
from .aggregator import NOT_COUNTED
from .buffers import BufferPool
from .queries import SiteData, query_digest, run_site_query
from .ring import FixedPoint
from .sharing import SharingScheme


def flatten(values: Mapping[str, np.ndarray]) -> tuple[Layout, np.ndarray]:
    """Named arrays -> (layout, one flat vector); integer arrays stay integer when all are."""
    names = sorted(values)
    arrays = [np.asarray(values[n]) for n in names]
    for n, a in zip(names, arrays):
        check_name(n, "output name")
        if a.dtype.kind not in "iubf":
            raise SiteQueryError(f"output {n!r} has dtype {a.dtype}; outputs are numbers")
    layout = tuple((n, tuple(a.shape), a.dtype.kind in "iub") for n, a in zip(names, arrays))
    dtype = np.int64 if all(i for _, _, i in layout) else np.float64
    if len(arrays) == 1 and arrays[0].dtype == dtype and arrays[0].flags.c_contiguous:
        return layout, arrays[0].reshape(-1)  # the common large case: no copy
    return layout, np.concatenate([a.reshape(-1).astype(dtype, copy=False) for a in arrays])


def unflatten(layout: Layout, vector: np.ndarray) -> dict[str, np.ndarray]:
    """Inverse of `flatten` for decoded totals; integer entries come back as int64."""
    out: dict[str, np.ndarray] = {}
    pos = 0
    for name, shape, integer in layout:
        n = int(np.prod(shape, dtype=np.int64))
        part = vector[pos : pos + n].reshape(shape)
        if integer and part.dtype.kind == "f":
            part = np.rint(part).astype(np.int64)
        out[name] = part
        pos += n
    return out


class Site:
    """A site's side of the protocol: its data, and the shares it sends per query."""

    def __init__(
        self,
        data: SiteData,
        study: str,
        scheme: SharingScheme,
        all_sites: tuple[str, ...],
        buffers: BufferPool | None = None,
    ):
        self.data = data
        self.buffers = buffers
        self.name = data.name
        self.study = study
        self.scheme = scheme
        self.n_sites = len(all_sites)
        # The aggregator that gets the full correction vector rotates over sites.
        self.holder = sorted(all_sites).index(self.name) % scheme.n_aggregators

    def check_query(self, query: Query) -> None:
        """Refuse a query whose digest does not bind its name, parameters and precision."""
        if query.round_id.study != self.study:
            raise MessageError(f"site {self.name!r}: query for study {query.round_id.study!r}, not {self.study!r}")
        if query_digest(self.study, query.name, query.params, query.frac_bits) != query.round_id.query:
            raise MessageError(f"site {self.name!r}: query digest does not match {query.name!r} and its parameters")

    def answer(self, query: Query, *, seeds: Mapping[int, bytes] | None = None) -> list[InputShare]:
        """Run by the Site: one `InputShare` per aggregator for a secure-sum query.

        `seeds` (default: fresh ones) re-creates a split the site made before; see `share`."""
        self.check_query(query)
        spec, result = run_site_query(self.data, query.name, query.params)
        if spec.release != "secure":
            raise SiteQueryError(f"site {self.name!r}: query {query.name!r} is not a secure-sum query")
        return self.share(query, result.values, result.records, seeds=seeds)

    def share(
        self,
        query: Query,
        values: Mapping[str, np.ndarray],
        records: int | None,
        *,
        seeds: Mapping[int, bytes] | None = None,
    ) -> list[InputShare]:
        """Encode and split `values` (the output of `query`) into one share per aggregator.

        The split's seeds come from the operating system unless `seeds` is given
        (aggregator index -> seed, every index but the holder's): a restarted
        deployed site passes the seeds it logged to re-create identical shares."""
        layout, flat = flatten(values)
        codec = FixedPoint(query.frac_bits, max_sites=self.n_sites)
        encoding = codec.encoding_for(flat)
        try:
            out = None if self.buffers is None else self.buffers.take(flat.size)
            payloads = self.scheme.share(flat, codec, holder=self.holder, out=out, seeds=seeds)
        except EncodingError as exc:
            # The text travels to the analyst: it names the problem, never the site's value.
            raise EncodingError(f"site {self.name!r}, query {query.name!r}: {exc.public}") from None
        except ValueError as exc:
            raise type(exc)(f"site {self.name!r}, query {query.name!r}: {exc}") from None
        count = NOT_COUNTED if records is None else int(records)
        return [
            InputShare(query.round_id, self.name, j, encoding, count, layout, seed=p.seed, vector=p.vector)
            for j, p in enumerate(payloads)
        ]

    def answer_dp(self, query: Query) -> DPRelease:
        """Run by the Site: the values of a query the protocol declares DP-protected."""
        self.check_query(query)
        spec, result = run_site_query(self.data, query.name, query.params)
        if spec.release != "dp":
            raise SiteQueryError(f"site {self.name!r}: query {query.name!r} is not declared DP-protected")
        layout, flat = flatten(result.values)
        return DPRelease(query.round_id, self.name, layout, flat.astype(np.float64))

    def receive(self, value: PublicValue) -> None:
        """Store a public value the analyst broadcast."""
        if value.study != self.study:
            raise MessageError(f"site {self.name!r}: public value for study {value.study!r}")
        self.data.public[value.name] = np.asarray(value.value)
