"""Driving one secure AUC among in-process aggregators: every hand-over is a recorded message.

Run by the embedded federation (`federation.LocalFederation.run_mpc`) once
the ``histogram.shares`` round is closed and every aggregator kept its share.
The helper deals, the aggregators exchange their openings (each sends its
share of every opened value to every other aggregator: `MpcOpen`), and
aggregator 0 releases the AUC (`AucRelease`). A deployment would carry the
same messages between its aggregator services; it does not yet.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..layout import unflatten
from ..messages import AggregateShare, Message
from .messages import AucRelease, MpcMaterial, MpcOpen, from_limbs, to_limbs
from .secure_auc import RING, AucParty, Helper, Material, P, auc_from_blinded

#: The helper's party name (a third, non-colluding server).
HELPER = "aggregator-helper"

#: send(sender, receiver, message) -> the message as the receiver got it (recorded in its transcript).
Send = Callable[[str, str, Message], Message]


def _name(j: int) -> str:
    return f"aggregator-{j}"


def _exchange(rid, step: int, outs: list, send: Send, ring: bool) -> list:
    """Every aggregator sends its share of the values opened at `step` to every other; each sums them."""
    n = len(outs)
    opened = []
    for j in range(n):
        total = outs[j]
        for i in range(n):
            if i == j:
                continue
            body = (np.asarray(outs[i], dtype=np.uint64), np.zeros(0, np.uint64)) if ring else \
                (np.zeros(0, np.uint64), to_limbs(outs[i]))
            got = send(_name(i), _name(j), MpcOpen(rid, i, step, *body))
            assert isinstance(got, MpcOpen)
            if ring:
                total = total + got.ring  # uint64: mod 2^64
            else:
                total = [(u + v) % P for u, v in zip(total, from_limbs(got.field_limbs))]
        opened.append(total)
    return opened


def secure_auc_round(kept: list[AggregateShare], send: Send) -> float:
    """Run the secure AUC on the aggregators' kept shares (`kept[j]` is aggregator j's); the AUC."""
    n = len(kept)
    rid = kept[0].round_id
    hist = [unflatten(share.layout, np.asarray(share.vector, dtype=np.uint64)) for share in kept]
    bins = int(np.asarray(hist[0]["negative"]).size)
    parties = []
    for j, material in enumerate(Helper().deal(n, bins)):  # run by the Helper
        ring, fld = material.pack()
        got = send(HELPER, _name(j), MpcMaterial(rid, j, ring, to_limbs(fld)))
        assert isinstance(got, MpcMaterial)
        mat = Material.unpack(got.ring, from_limbs(got.field_limbs), bins)
        parties.append(AucParty(j, n, np.asarray(hist[j]["negative"]).reshape(-1).astype(np.uint64),
                                np.asarray(hist[j]["positive"]).reshape(-1).astype(np.uint64), mat))
    step = 0
    opened = _exchange(rid, step, [p.open_products() for p in parties], send, ring=True)
    for p, o in zip(parties, opened):
        p.products(o)
    step += 1
    opened = _exchange(rid, step, [p.open_masked() for p in parties], send, ring=True)
    outs = [p.start_compare(o) for p, o in zip(parties, opened)]
    for _ in range(63):
        step += 1
        opened = _exchange(rid, step, outs, send, ring=False)
        outs = [p.compare_step(o) for p, o in zip(parties, opened)]
    step += 1
    opened = _exchange(rid, step, outs, send, ring=False)
    blinded = _exchange(rid, step + 1, [p.blinded(o) for p, o in zip(parties, opened)], send, ring=False)
    values = {auc_from_blinded(a, d) for a, d in blinded}
    if len(values) != 1 and not all(v != v for v in values):
        raise ArithmeticError("the aggregators opened different results")
    return values.pop()


__all__ = ["HELPER", "RING", "AucRelease", "secure_auc_round"]
