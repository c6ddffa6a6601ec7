"""The HTTPS protocol between parties: endpoints, body framing, and errors as HTTP statuses.

Endpoints of an aggregator (all over mutual TLS 1.3; who may call each is
checked from the peer's certificate on every request)::

    POST /v1/message     one encoded message; reply one encoded message
                         analyst: Query -> RoundStatus (a new round numbered at most 2**32
                                  above /v1/info's next_number: RoundError, 409, beyond),
                                  StatusRequest -> RoundStatus,
                                  CloseRound -> AggregateShare (a secure-sum round) or
                                                ForwardedShares (a per-site DP round)
                         site:    InputShare -> RoundStatus (names the submitter only)
    POST /v1/status      analyst; body StatusRequest; ?wait=SECONDS long-polls until every
                         site the round expects (all sites for a run's join, the run's
                         contributors for its later rounds) has answered or refused it;
                         reply frames: RoundStatus, then one ErrorReply per refusing site
    POST /v1/release     site; body StatusRequest; ?wait=SECONDS long-polls until the round is
                         released; reply frames: none (not released, or not opened here, yet)
                         or this aggregator's AggregateShare / ForwardedShares of it. Only a
                         site in the round's contributor set gets it (PolicyError, 403, for
                         any other site; RoundError, 409, once the round was abandoned or its
                         share is no longer held: the last RETAIN_RELEASED releases are)
    POST /v1/refusal     site; body frames: StatusRequest (the round), ErrorReply (why); reply 204
    GET  /v1/feed        site; ?since=SEQ&wait=SECONDS; reply feed: the open rounds after SEQ
                         this site has not answered (a run's join to every site, its later
                         rounds only to the run's contributors); long-polls when there are none
    POST /v1/reserve     analyst, under every scheme but "pairwise": body the round's CloseRound;
                         every check of that close, then its place held (`reservations`);
                         reply RoundStatus over the set held. The analyst reserves at every
                         aggregator in order before it closes anywhere (`close_order`)
    POST /v1/unreserve   analyst; body the CloseRound it reserved with; the place given back; 204
    POST /v1/pairwise    site, under scheme = "pairwise" only: its key agreement's messages and its
    GET  /v1/pairwise    unmask answer; and a long poll for the server's messages to it (`pairwise_routes`)
    GET  /v1/info        any party of the study; JSON: study, aggregator, index, next_number,
                         open_rounds, policy (the digest of the [policy] it enforces)
    GET  /v1/presence    analyst or aggregator; JSON: per site, whether its agent is polling the
                         feed now ("polling") and seconds since it last did ("last_seen_s",
                         null: never since this aggregator started)

Errors are an `ErrorReply` message (binary) with the HTTP status of its class
(`status_for`); `raise_for_reply` turns it back into the same exception class
with the same text on the client. A `PolicyError` (a request outside the
study's policy, a run's plan or a site's ledger, or a release asked by a site
that is not a contributor) is 403: the request is forbidden as such, and
sending it again cannot succeed; other `PrivacyError`s and `RoundError`s are
409 (the round's state forbids it).

Bodies with several messages are frames (`pack_frames`: u32 length, then the
message); a feed reply is a cursor followed by (round number, query) entries
(`pack_feed`). Both sides use this module: the aggregator service
(`aggregator_service`) to answer, the client (`deploy.http.AggregatorClient`,
run by Sites and the Analyst) to ask.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterable, NoReturn, Sequence

from .. import errors
from ..errors import MessageError, SecAggError
from ..messages import ErrorReply, Message, decode
from .tls import AuthError

__all__ = [
    "MESSAGE_TYPE",
    "FRAMES_TYPE",
    "FEED_TYPE",
    "ServiceError",
    "TransportError",
    "RequestTooLarge",
    "ERROR_CLASSES",
    "status_for",
    "error_reply",
    "exception_for",
    "raise_for_reply",
    "pack_frames",
    "unpack_frames",
    "FeedEntry",
    "pack_feed",
    "unpack_feed",
    "Response",
    "int_param",
    "float_param",
]

MESSAGE_TYPE = "application/x-secagg-message"
FRAMES_TYPE = "application/x-secagg-frames"
FEED_TYPE = "application/x-secagg-feed"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")



class ServiceError(SecAggError):
    """A party answered with an error this client does not map to a library class (e.g. 5xx)."""

    def __init__(self, text: str, status: int = 500):
        super().__init__(text)
        self.status = status


class TransportError(SecAggError, ConnectionError):
    """The aggregator could not be reached or the connection broke: worth retrying."""


class RequestTooLarge(MessageError):
    """A request body was larger than the study's ``max_body_bytes``."""


class RequestTimeout(MessageError):
    """A request body did not arrive in time (a stalled or very slow client)."""


# --------------------------------------------------------------------------- errors <-> statuses

#: Error classes a reply may name, by `ErrorReply.code`. Anything else becomes `ServiceError`.
ERROR_CLASSES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        errors.MessageError,
        errors.RoundError,
        errors.PrivacyError,
        errors.PolicyError,
        errors.SiteQueryError,
        errors.EncodingError,
        errors.CombineError,
        errors.ConfigError,
        AuthError,
        RequestTooLarge,
        RequestTimeout,
    )
}

# Order matters: subclasses before their bases.
_STATUSES: tuple[tuple[type[Exception], int], ...] = (
    (RequestTooLarge, 413),
    (RequestTimeout, 408),
    (AuthError, 403),
    (errors.PolicyError, 403),  # outside the policy, the plan or the ledger: forbidden as such
    (errors.PrivacyError, 409),  # the round's state (too few sites/records, released) forbids it
    (errors.RoundError, 409),
    (errors.MessageError, 400),
    (errors.SiteQueryError, 400),
    (errors.EncodingError, 400),
    (errors.ConfigError, 400),
)


def status_for(exc: BaseException) -> int:
    """The HTTP status for an error raised while handling a request."""
    for cls, status in _STATUSES:
        if isinstance(exc, cls):
            return status
    return 500


def error_reply(exc: BaseException) -> ErrorReply:
    """The `ErrorReply` carrying `exc`'s class name and text."""
    # A subclass (e.g. pairwise masking's TooFewSurvivors) travels as its nearest known class.
    code = next((c.__name__ for c in type(exc).__mro__ if ERROR_CLASSES.get(c.__name__) is c), "ServiceError")
    return ErrorReply(code, str(exc) or code)


def exception_for(reply: ErrorReply, status: int = 500) -> Exception:
    """The exception an `ErrorReply` stands for: the same class, with the same text."""
    cls = ERROR_CLASSES.get(reply.code)
    if cls is None:
        return ServiceError(reply.text, status)
    return cls(reply.text)


def raise_for_reply(status: int, body: bytes, who: str) -> NoReturn:
    """Raise the error a non-2xx response carries (`who` names the party for undecodable bodies)."""
    try:
        reply = decode(body)
    except MessageError:
        reply = None
    if isinstance(reply, ErrorReply):
        raise exception_for(reply, status)
    text = bytes(body[:200]).decode("utf-8", "replace")
    raise ServiceError(f"{who} answered HTTP {status} without an error message: {text!r}", status)


# --------------------------------------------------------------------------- framing


def pack_frames(messages: Iterable[Message | bytes]) -> list[Any]:
    """Several messages as buffers: each is u32 length + its encoding."""
    out: list[Any] = []
    for m in messages:
        bufs = m.to_buffers() if isinstance(m, Message) else [m]
        out.append(_U32.pack(sum(len(memoryview(b).cast("B")) for b in bufs)))
        out.extend(bufs)
    return out


def unpack_frames(data: bytes | memoryview, *, limit: int = 1 << 16) -> list[Message]:
    """Inverse of `pack_frames`; `MessageError` for anything malformed."""
    view = memoryview(data).cast("B")
    pos, out = 0, []
    while pos < len(view):
        if len(out) >= limit:
            raise MessageError(f"more than {limit} frames")
        if pos + 4 > len(view):
            raise MessageError("frame length truncated")
        (n,) = _U32.unpack(view[pos : pos + 4])
        pos += 4
        if pos + n > len(view):
            raise MessageError(f"frame of {n} bytes truncated")
        out.append(decode(view[pos : pos + n]))
        pos += n
    return out


@dataclass(frozen=True)
class FeedEntry:
    """One entry of an aggregator's feed to the sites: a `Query` and its round number."""

    number: int
    message: Message


def pack_feed(next_since: int, entries: Sequence[tuple[int, bytes]]) -> list[Any]:
    """A feed reply: u64 cursor to pass as ``since`` next time, then (u64 number, frame) entries."""
    out: list[Any] = [_U64.pack(next_since)]
    for number, body in entries:
        out.append(_U64.pack(number) + _U32.pack(len(body)))
        out.append(body)
    return out


def unpack_feed(data: bytes | memoryview) -> tuple[int, list[FeedEntry]]:
    """Inverse of `pack_feed`; `MessageError` for anything malformed."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise MessageError("feed reply truncated")
    (next_since,) = _U64.unpack(view[:8])
    pos, out = 8, []
    while pos < len(view):
        if pos + 12 > len(view):
            raise MessageError("feed entry header truncated")
        (number,) = _U64.unpack(view[pos : pos + 8])
        (n,) = _U32.unpack(view[pos + 8 : pos + 12])
        pos += 12
        if pos + n > len(view):
            raise MessageError("feed entry truncated")
        out.append(FeedEntry(number, decode(view[pos : pos + n])))
        pos += n
    return next_since, out


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class Response:
    """One HTTP response as the client received it, whatever its status."""

    status: int
    headers: dict[str, str]
    body: bytes | memoryview  # a view of a recycled buffer for a large reply read with `pooled`


# --------------------------------------------------------------------------- query parameters


def int_param(request: Any, key: str, default: int | None = None) -> int:
    """Query parameter `key` of an aggregator's request as a non-negative integer (`MessageError` if not)."""
    raw = request.query.get(key)
    if raw is None:
        if default is None:
            raise MessageError(f"query parameter {key!r} is missing")
        return default
    # ASCII digits only: str.isdigit() is also true of '²' and '١', which int() refuses or reads.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        raise MessageError(f"query parameter {key}={raw[:40]!r} is not a non-negative integer")
    return int(raw)


def float_param(request: Any, key: str, default: float) -> float:
    """Query parameter `key` as seconds in 0..3600 (`MessageError` if not)."""
    raw = request.query.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise MessageError(f"query parameter {key}={raw[:40]!r} is not a number") from None
    if not 0.0 <= value <= 3600.0:
        raise MessageError(f"query parameter {key}={value} outside 0..3600")
    return value
