"""A `PairwiseClient` as bytes and back: what a deployed Site logs before anything derived leaves it.

Run by a Site (`deploy.site_pairwise`). A client's secrets (its two X25519
private keys, its self-mask secret b_u, the Shamir shares it holds) and its
progress (phase; the one unmask request it answered and its answer) are
written to the site's SECRET log after each step and before the message that
step made is sent. A restarted site rebuilds the identical client: it re-sends
the same keys and ciphertexts, masks with the same masks (so the same input
gives the same masked vector) and answers only the request it answered before.

The snapshot is JSON with hex strings; messages are their own encoding. This
module reads the client's private fields: it is the engine's persistence, kept
apart only to keep `engine` short.
"""

from __future__ import annotations

import json
from typing import Any

from . import keys as kx
from .engine import PairwiseClient
from .errors import MessageError
from .messages import AdvertiseKeys, UnmaskRequest, UnmaskResponse, decode

#: Format tag of a snapshot.
FORMAT = "pairwise-client-v1"
_PHASES = ("advertised", "shared", "received", "masked", "answered")


def _shares(held: dict[int, int]) -> dict[str, str]:
    return {str(v): format(x, "x") for v, x in sorted(held.items())}


def snapshot(client: PairwiseClient) -> bytes:
    """Run by a Site: its client's whole state (SECRET: private keys and shares), as bytes to log."""
    c: Any = client
    if c._phase not in _PHASES:
        raise ValueError(f"a client is logged once it advertised its keys, not in state {c._phase!r}")
    out: dict[str, Any] = {
        "format": FORMAT, "site": c.site, "round": c.round_id.hex(), "threshold": c.threshold,
        "neighbours": sorted(c.neighbours), "phase": c._phase, "own": c._own.encode().hex(),
        "held_b": _shares(c._held_b), "held_s": _shares(c._held_s),
    }
    for name in ("_c_sk", "_s_sk"):
        if hasattr(c, name):
            out[name[1:]] = kx.private_bytes(getattr(c, name)).hex()
    if hasattr(c, "_b"):
        out["b"] = c._b.hex()
    if hasattr(c, "_peers"):
        out["peers"] = [a.encode().hex() for _, a in sorted(c._peers.items())]
    if hasattr(c, "_mask_peers"):
        out["mask_peers"] = sorted(c._mask_peers)
    if c._request is not None:
        out["request"], out["response"] = c._request.encode().hex(), c._response.encode().hex()
    return json.dumps(out, sort_keys=True).encode()


def _message(raw: str, cls: type) -> Any:
    msg = decode(bytes.fromhex(raw))
    if not isinstance(msg, cls):
        raise MessageError(f"a logged pairwise client holds a {msg.kind} where a {cls.__name__} belongs")
    return msg


def restore(data: bytes, *, masked: bool = False) -> PairwiseClient:
    """Run by a restarted Site: the client `snapshot` wrote, in the same phase with the same secrets.

    `masked`: the site's log records that it masked its input with this client (its answer is logged
    apart, after the snapshot), so the restored client may answer the unmask request and never masks again."""
    try:
        s = json.loads(data)
        if s.get("format") != FORMAT or s.get("phase") not in _PHASES:
            raise MessageError(f"not a logged pairwise client (format {s.get('format')!r})")
        c: Any = PairwiseClient(int(s["site"]), bytes.fromhex(s["round"]), int(s["threshold"]), s["neighbours"])
        c._phase = "masked" if masked and s["phase"] == "received" else s["phase"]
        c._own = _message(s["own"], AdvertiseKeys)
        c._held_b = {int(v): int(x, 16) for v, x in s["held_b"].items()}
        c._held_s = {int(v): int(x, 16) for v, x in s["held_s"].items()}
        if "c_sk" in s:
            c._c_sk = kx.private_from_bytes(bytes.fromhex(s["c_sk"]))
        if "s_sk" in s:
            c._s_sk = kx.private_from_bytes(bytes.fromhex(s["s_sk"]))
        if "b" in s:
            c._b = bytes.fromhex(s["b"])
        if "peers" in s:
            peers = [_message(a, AdvertiseKeys) for a in s["peers"]]
            c._peers = {a.site: a for a in peers}
            if c._phase == "shared":  # the channel keys are derived again from c_sk (never logged themselves)
                c._channel = {v: kx.channel_key(kx.agree(c._c_sk, a.c_public), c.round_id, c.site, v)
                              for v, a in c._peers.items()}
        if "mask_peers" in s:
            c._mask_peers = frozenset(int(v) for v in s["mask_peers"])
        if "request" in s:
            c._request = _message(s["request"], UnmaskRequest)
            c._response = _message(s["response"], UnmaskResponse)
        return c
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # Only the kind of failure: the text of a parse error may quote the secret it failed to read, and a
        # site's error can travel in a refusal.
        raise MessageError(f"a logged pairwise client cannot be read back ({type(exc).__name__}); the site's "
                           "log is damaged") from None
