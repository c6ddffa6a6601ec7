"""What a TLS failure means for the operator who must fix it: OpenSSL's reasons turned into hints.

Used by every party: clients (`http.AggregatorClient`, `http_bulk`) explain why
a connection to an aggregator failed, `tls` why a key pair does not load, and
each aggregator logs why a client's handshake failed (`log_failed_handshakes`:
asyncio drops those silently, since an `ssl.SSLError` is an `OSError`). The
hints name the file to look at (``ca.pem``, the party's ``cert.pem`` and
``key.pem``) and the command that fixes it; they never quote a peer's data.
"""

from __future__ import annotations

import errno
import logging
import os
import ssl
import threading
import time
from typing import Any

__all__ = ["explain_client", "explain_server", "explain_key_pair", "log_failed_handshakes", "refused"]

# OpenSSL's X509_V_ERR_* codes (x509_vfy.h) that a study's parties meet.
_UNTRUSTED = {2, 18, 19, 20, 21}  # no issuer, self-signed, self-signed in chain, local issuer, unable to verify leaf
_EXPIRED, _NOT_YET_VALID, _REVOKED, _HOSTNAME = 10, 9, 23, 62


def refused(exc: BaseException) -> bool:
    """Whether a failed connection attempt was refused, at every address of the host (Python 3.11's asyncio
    joins the errors of several addresses into one plain `OSError`)."""
    if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
        return True
    text = str(exc)
    return text.startswith("Multiple exceptions:") and text.count("[Errno") == text.count(f"[Errno {errno.ECONNREFUSED}]")


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", "") or "").upper() or str(exc).upper()


def explain_client(exc: BaseException, who: str, ca: Any) -> str | None:
    """Why this party could not talk TLS to `who` (an aggregator), with the fix; None if it is no TLS problem."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = getattr(exc, "verify_code", None)
        if code in _UNTRUSTED:
            return (f"{who}: certificate not accepted: it is not signed by this party's study CA ({ca}): this party's ca.pem "
                    "or the aggregator's certificate belongs to another study (or to keys made before a re-key); "
                    "every party needs the study's ca.pem and a certificate issued by it")
        if code == _EXPIRED:
            return f"{who}: certificate not accepted: it has expired; the coordinator issues a new one (secagg-roc keys add NAME --replace)"
        if code == _NOT_YET_VALID:
            return f"{who}: certificate not accepted: it is not valid yet; check the clocks of both machines"
        if code == _HOSTNAME:
            return (f"{who}: certificate not accepted: it does not name the host this party connects to: the study file's host "
                    "changed after the keys were made (re-issue: secagg-roc keys add NAME --replace), or the "
                    "address reaches another server")
        if code == _REVOKED:
            return f"{who}: certificate not accepted: it was revoked by the study's coordinator"
        return f"{who}: certificate not accepted: {getattr(exc, 'verify_message', None) or exc}"
    if not isinstance(exc, ssl.SSLError):
        return None
    reason = _reason(exc)
    if "REVOKED" in reason:
        return f"{who} refused this party's certificate: it was revoked by the study's coordinator"
    if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "CERTIFICATE_UNKNOWN" in reason:
        return (f"{who} refused this party's certificate: it is not signed by the study CA that aggregator trusts "
                "(a certificate of another study, or from before a re-key); the coordinator issues this party "
                "a new one with `secagg-roc keys add NAME`")
    if "CERTIFICATE_REQUIRED" in reason:
        return f"{who} asked for a client certificate and got none: check this party's cert and key in the study file"
    if "WRONG_VERSION_NUMBER" in reason or "PROTOCOL_VERSION" in reason or "UNSUPPORTED_PROTOCOL" in reason:
        return f"{who} does not speak TLS 1.3 on that port: is the study file's host and port that of the aggregator?"
    if "ALERT" in reason:
        return f"{who} refused this party's TLS connection ({getattr(exc, 'reason', None) or exc})"
    return None


def explain_server(exc: BaseException) -> str:
    """Why a client's TLS handshake with this aggregator failed, for the aggregator's operator."""
    code = getattr(exc, "verify_code", None)
    if code in _UNTRUSTED:
        return ("a client presented a certificate that is not signed by this study's CA (ca.pem): a party with "
                "another study's keys, or keys made before a re-key; it gets no access")
    if code == _REVOKED:
        return "a client presented a revoked certificate (crl.pem); it gets no access"
    if code == _EXPIRED:
        return "a client presented an expired certificate; it gets no access"
    reason = _reason(exc)
    if "PEER DID NOT RETURN A CERTIFICATE" in reason or "PEER_DID_NOT_RETURN_A_CERTIFICATE" in reason:
        return "a client connected without a certificate (not a party of this study); it gets no access"
    if "HTTP_REQUEST" in reason or "WRONG_VERSION_NUMBER" in reason:
        return "a client spoke plain HTTP (or not TLS) to this HTTPS port: parties use https:// URLs"
    if "UNSUPPORTED_PROTOCOL" in reason or "PROTOCOL_VERSION" in reason:
        return "a client offered TLS older than 1.3, which this study refuses"
    if "UNKNOWN_CA" in reason or "BAD_CERTIFICATE" in reason or "CERTIFICATE_UNKNOWN" in reason:
        return ("a client refused this aggregator's certificate: its ca.pem is not this study's, or this "
                "aggregator's certificate is from another study or from before a re-key")
    return f"a client's TLS handshake failed: {getattr(exc, 'reason', None) or exc}"


def explain_key_pair(exc: BaseException, cert: Any, key: Any) -> str:
    """Why a party's certificate and private key do not load, with the fix."""
    reason = _reason(exc)
    if "KEY_VALUES_MISMATCH" in reason:
        why = ("the private key does not belong to the certificate: a party needs the key and certificate that "
               "`secagg-roc keys` issued together for it (check cert and key in the study file)")
    elif isinstance(exc, FileNotFoundError):
        gone = exc.filename or next((f for f in (cert, key) if not os.path.exists(f)), cert)
        why = (f"{gone} does not exist: the coordinator makes it with `secagg-roc keys` (or "
               "`secagg-roc keys add NAME` for a party added later) and hands it to this party")
    elif "PEM" in reason or "NO_START_LINE" in reason:
        why = "not a PEM certificate and private key as `secagg-roc keys` writes them"
    else:
        why = str(getattr(exc, "strerror", None) or exc)
    return f"cannot load certificate {cert} with key {key}: {why}"


class _HandshakeLog:
    """One warning per reason and minute (a misconfigured party retries every few seconds)."""

    def __init__(self, log: logging.Logger, every: float):
        self.log, self.every = log, every
        self.last: dict[str, tuple[float, int]] = {}
        self.lock = threading.Lock()

    def note(self, exc: BaseException) -> None:
        reason = explain_server(exc)
        now = time.monotonic()
        with self.lock:
            at, skipped = self.last.get(reason, (-self.every, 0))
            if now - at < self.every:
                self.last[reason] = (at, skipped + 1)
                return
            self.last[reason] = (now, 0)
        more = f" ({skipped} more since the last such message)" if skipped else ""
        self.log.warning("TLS handshake refused: %s%s", reason, more)


def log_failed_handshakes(ctx: ssl.SSLContext, log: logging.Logger, every: float = 60.0) -> None:
    """Make the server context `ctx` log why a client's handshake failed (run by each Aggregator)."""
    record = _HandshakeLog(log, every)

    class LoggedHandshake(ssl.SSLObject):
        # `SSLContext.sslobject_class` is the documented hook: asyncio wraps every connection with it.
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as exc:
                record.note(exc)
                raise

    ctx.sslobject_class = LoggedHandshake
