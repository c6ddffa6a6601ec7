"""The client's bulk path: large request bodies over a blocking TLS socket in a worker thread.

Run by Sites and the Analyst, through `deploy.http.AggregatorClient`, for
request bodies of at least `deploy.http.BULK_BYTES` (e.g. a site's share
vector): asyncio's SSL transport costs about three times the CPU of a
blocking socket per byte. Same study CA, same client certificate, same
identity check before any byte of the request, same error classes; the event
loop keeps serving meanwhile.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from typing import Any

from .config_schema import AggregatorConfig
from .http_protocol import Response, TransportError
from .revocation import RevocationList
from .tls import AuthError, authorize, peer_identity
from .tls_errors import explain_client

__all__ = ["BulkConnections", "BlockingConnection", "is_tls_alert"]


def is_tls_alert(exc: BaseException) -> bool:
    """True if `exc` is a TLS alert from the server (e.g. it refused our certificate)."""
    # An auth failure, not a glitch: the caller reports it as `AuthError` rather than retrying.
    return isinstance(exc, ssl.SSLError) and "ALERT" in str(getattr(exc, "reason", "") or exc).upper()


class BlockingConnection(http.client.HTTPSConnection):
    """A blocking HTTPS connection that checks whose it is before it is used (see `AggregatorClient`)."""

    def __init__(self, pool: BulkConnections, timeout: float):
        cfg = pool.config
        super().__init__(cfg.host, cfg.port, timeout=timeout, context=pool.ssl_context)
        self.pool = pool

    def connect(self) -> None:
        # TCP, then the TLS handshake (certificate and host name checked by the context), then the
        # aggregator's study, role and name from its certificate, before a byte of a request.
        sock = socket.create_connection((self.host, self.port), self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        try:
            self.pool.check_peer(self.sock)
        except AuthError:
            self.close()
            raise


class BulkConnections:
    """The blocking connections of one `AggregatorClient`, kept alive and reused (used from worker threads)."""

    def __init__(
        self,
        config: AggregatorConfig,
        study_id: str,
        ssl_context: ssl.SSLContext,
        *,
        max_response_bytes: int,
        connect_timeout: float,
        ca_file: object = "the study's ca.pem",
        revocations: RevocationList | None = None,
    ):
        self.ca_file = ca_file
        self.revocations = revocations
        self.config = config
        self.name = config.name
        self.study_id = study_id
        self.ssl_context = ssl_context
        self.max_response_bytes = max_response_bytes
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._idle: list[BlockingConnection] = []
        self._busy: set[BlockingConnection] = set()

    def check_peer(self, ssl_object) -> None:
        """The aggregator's study, role and name from its certificate, and that it is not revoked
        (run by the client on every new connection, before a byte of a request); `AuthError` if not."""
        try:
            authorize(peer_identity(ssl_object), self.study_id, {"aggregator"}, {self.name})
        except AuthError as exc:
            raise AuthError(f"the server at {self.config.url} is not aggregator {self.name!r}: {exc}") from None
        if self.revocations is not None and self.revocations.is_revoked(ssl_object.getpeercert(binary_form=True)):
            raise AuthError(f"aggregator {self.name!r} at {self.config.url} presents a revoked certificate (on the "
                            f"study's revocation list {self.revocations.path}); its operator needs new keys: "
                            f"secagg-roc keys add {self.name} --replace")

    def connect_error(self, exc: BaseException) -> Exception:
        """The error for a failed connection to the aggregator: `AuthError` with its fix for TLS
        problems (they do not go away by retrying), `TransportError` (retried) for the rest."""
        who = f"aggregator {self.name!r} at {self.config.url}"
        hint = explain_client(exc, who, self.ca_file)
        if hint is not None:
            return AuthError(hint)
        if isinstance(exc, (TimeoutError, socket.timeout)) or type(exc).__name__ == "TimeoutError":
            reason = f"no answer within {self.connect_timeout:g} s"
        else:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return TransportError(f"cannot reach {who}: {reason} (is it running, and are host and port in the "
                              "study file right?)")

    @property
    def idle_count(self) -> int:
        """How many connections are kept alive for the next request."""
        return len(self._idle)

    def request(self, method: str, path: str, bufs: list[Any], content_type: str, timeout: float,
                limit: int | None = None) -> Response:
        """Run in a worker thread: one request on a (kept-alive) blocking connection (a reply over `limit`, or
        `max_response_bytes`, bytes is a transport failure)."""
        cap = self.max_response_bytes if limit is None else min(limit, self.max_response_bytes)
        length = sum(len(memoryview(b).cast("B")) for b in bufs)
        headers = {"Content-Length": str(length), "Content-Type": content_type, "Connection": "keep-alive"}
        for attempt in range(2):
            with self._lock:
                conn = self._idle.pop() if attempt == 0 and self._idle else None
                reused = conn is not None
                if conn is None:
                    conn = BlockingConnection(self, min(timeout, self.connect_timeout))
                self._busy.add(conn)
            try:
                if not reused:
                    conn.connect()  # fails before any byte of the request if it is not the right aggregator
                conn.sock.settimeout(timeout)
                conn.request(method, path, body=bufs, headers=headers)
                resp = conn.getresponse()
                if resp.length is not None and resp.length > cap:
                    raise ConnectionError(f"response of {resp.length} bytes exceeds the limit {cap}")
                data = resp.read(cap + 1)
                if len(data) > cap:
                    raise ConnectionError(f"response exceeds the limit {cap}")
                result = Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
                keep = not resp.will_close
            except ssl.SSLCertVerificationError as exc:
                conn.close()
                raise self.connect_error(exc) from None
            except AuthError:
                conn.close()
                raise
            except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
                conn.close()
                if is_tls_alert(exc):
                    raise self.connect_error(exc) from None
                if reused and attempt == 0 and not isinstance(exc, TimeoutError):
                    continue  # the server closed an idle keep-alive connection: try a fresh one
                what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc or type(exc).__name__}"
                raise TransportError(f"{method} {path} to aggregator {self.name!r} {what}") from None
            except BaseException:
                conn.close()
                raise
            finally:
                with self._lock:
                    self._busy.discard(conn)
            if keep:
                with self._lock:
                    self._idle.append(conn)
            else:
                conn.close()
            return result
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close idle connections, and shut down those in use (their requests fail)."""
        with self._lock:
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for b in idle:
            b.close()
        for b in busy:  # the worker thread that uses it sees an error and closes it
            sock = b.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
