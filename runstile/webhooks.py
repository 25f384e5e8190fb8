"""The HTTP side of webhook delivery (SPEC §7): signing, one guarded attempt, backoff.

Pure functions over the network — no ledger, no Dramatiq.  The deliverer
(``workers/delivery.py``) reads an obligation, calls ``headers`` and ``deliver``, and
records the ``Outcome``; ``next_delay_s`` says when to try again.

Signing follows Standard Webhooks (https://www.standardwebhooks.com/): ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature`` = ``v1,<base64 HMAC-SHA256 of
"id.timestamp.body">`` keyed with the base64-decoded part of a ``whsec_…`` secret; during
a rotation every current secret signs and the signatures are space-separated.

``deliver`` makes one POST and never follows a redirect.  Before connecting it resolves
the host once and refuses (no connection made) when any address is loopback, private,
link-local, CGNAT, cloud metadata, multicast, unspecified/reserved or an IPv6 form
carrying one of those (``netguard.checked_addresses``), unless allow-listed; it then
connects to the checked address itself, sending the original ``Host`` and, for https,
SNI and certificate verification for the original host name.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import hmac
import http.client
import random
import re
import secrets as _secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Literal

from .netguard import callback_target, checked_addresses

#: Prefix of a signing secret; the rest is standard base64.
SECRET_PREFIX = "whsec_"
#: Fewest key bytes a signing secret may carry (SPEC §7); ``new_secret`` makes 32.
MIN_SECRET_BYTES = 24
#: User-Agent of every delivery request.
USER_AGENT = "runstile-webhooks/1"
#: Longest wait a receiver's Retry-After can impose, in seconds.
MAX_RETRY_AFTER_S = 3600.0
#: Characters of a failed response's body quoted in ``Outcome.error``.
ERROR_EXCERPT_CHARS = 200

_MSG_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: safe in a header
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


# --------------------------------------------------------------------------- signing

def new_secret() -> str:
    """A fresh signing secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(_secrets.token_bytes(32)).decode("ascii")


def secret_key(secret: str) -> bytes:
    """The HMAC key inside ``secret``; ValueError unless it is ``whsec_<base64 ≥ 24 bytes>``."""
    if not isinstance(secret, str) or not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret must start with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"a webhook secret must be {SECRET_PREFIX!r} followed by standard "
                         "base64 (A-Z a-z 0-9 + /, padded with =)") from None
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"a webhook secret must decode to at least {MIN_SECRET_BYTES} "
                         f"bytes, this one has {len(key)}")
    return key


def _check_message(msg_id: str, timestamp: int, body: bytes) -> None:
    if not isinstance(msg_id, str) or not _MSG_ID.fullmatch(msg_id):
        raise ValueError("webhook id must be 1-256 printable ASCII characters without spaces")
    if not isinstance(timestamp, int) or isinstance(timestamp, bool) or timestamp < 0:
        raise ValueError("webhook timestamp must be a non-negative int (Unix seconds)")
    if not isinstance(body, (bytes, bytearray)):
        raise TypeError("webhook body must be bytes")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of f"{msg_id}.{timestamp}." + body>`` keyed by ``secret``."""
    _check_message(msg_id, timestamp, body)
    signed = f"{msg_id}.{timestamp}.".encode("ascii") + bytes(body)
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def headers(msg_id: str, timestamp: int, body: bytes, secrets: list[str]) -> dict[str, str]:
    """The request headers of one delivery, signed by every secret in ``secrets``.

    During a rotation pass both the new and the old secret: the receiver accepts the
    request if any one signature verifies with the secret it knows.
    """
    if not secrets:
        raise ValueError("at least one webhook secret is needed to sign a delivery")
    signatures = [sign(secret, msg_id, timestamp, body) for secret in dict.fromkeys(secrets)]
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signatures),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }


# --------------------------------------------------------------------------- delivery

@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one delivery attempt came to.

    ``kind``:

    - ``"delivered"`` — the receiver answered 2xx; clear the obligation.
    - ``"gone"`` — the receiver answered 410; park the obligation now.
    - ``"retry"`` — anything else: 3xx (redirects are never followed), 4xx other than
      410, 429, 5xx, timeouts, DNS, connection and TLS errors.  Try again after
      ``next_delay_s(...)``; the obligation parks after
      ``RUNSTILE_DELIVERY_MAX_ATTEMPTS`` attempts, so a receiver that keeps answering
      400 ends parked, not retried forever.
    - ``"refused"`` — the URL is not http(s), is malformed, or its host is or resolves to
      an address the SSRF guard refuses; no connection was made.  A literal target stays
      refused; a name may resolve differently later, so the caller may count it as a
      failed attempt rather than park at once.

    ``status`` is the HTTP status when one was received; ``retry_after_s`` the
    receiver's ``Retry-After`` in seconds (from delay-seconds or an HTTP-date), when
    given; ``error`` a one-line reason for anything but ``delivered``, fit to store and
    show to API clients (it never names the addresses a host resolved to); ``detail``,
    when set, the same with those addresses, for the operator's log only.
    """

    status: int | None = None
    retry_after_s: float | None = None
    kind: Literal["delivered", "retry", "gone", "refused"]
    error: str | None = None
    detail: str | None = None


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait (delay-seconds or HTTP-date), or None.

    A date in the past gives 0.0; an unparseable value gives None.  ``now`` is a Unix
    time for tests (default: the current time).
    """
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]+", value):
        # Longer than 9 digits is beyond any cap anyway (and int() refuses huge strings).
        return float(int(value)) if len(value) <= 9 else 1e9
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now_dt = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return max(0.0, (when - now_dt).total_seconds())


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP to ``host`` at addresses already checked: ``connect`` never resolves a name.

    ``host``/``port`` still make the Host header (and, for https, SNI and the name the
    certificate must match); the socket goes to the first ``targets`` entry that accepts.
    """

    def __init__(self, host: str, port: int, targets: list[tuple[int, tuple]], *,
                 connect_timeout_s: float, read_timeout_s: float,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(host, port, timeout=read_timeout_s)
        if tls is not None:
            self.default_port = http.client.HTTPS_PORT  # Host header omits :443, not :80
        self.auto_open = 0  # never reconnect behind our back
        self._targets = targets
        self._connect_timeout_s = connect_timeout_s
        self._tls = tls
        self.raw_socket: socket.socket | None = None

    def connect(self) -> None:
        error: OSError | None = None
        for family, sockaddr in self._targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._connect_timeout_s)
                sock.connect(sockaddr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # A duplicate of the TCP socket survives the TLS wrap; the deadline
                # watchdog shuts the connection down through it.
                self.raw_socket = sock.dup()
                if self._tls is not None:
                    # The handshake is bounded by the connect timeout too.
                    sock = self._tls.wrap_socket(sock, server_hostname=self.host)
                sock.settimeout(self.timeout)
            except OSError as exc:
                sock.close()
                if self.raw_socket is not None:
                    self.raw_socket.close()
                    self.raw_socket = None
                if isinstance(exc, ssl.SSLError):
                    raise  # the server was reached: another address will not fix TLS
                error = exc
                continue
            self.sock = sock
            return
        raise error or OSError("no address to connect to")

    def close(self) -> None:
        super().close()
        if self.raw_socket is not None:
            self.raw_socket.close()
            self.raw_socket = None


def _excerpt(data: bytes) -> str:
    text = data[:ERROR_EXCERPT_CHARS * 4].decode("utf-8", "replace")[:ERROR_EXCERPT_CHARS]
    return re.sub(r"[\x00-\x1f\x7f]+", " ", text).strip()


def deliver(url: str, body: bytes, headers: dict[str, str], *,
            allowlist: tuple[str, ...] = (),
            connect_timeout_s: float = 5.0,
            read_timeout_s: float = 10.0,
            max_response_bytes: int = 64 * 1024,
            resolver: Callable = socket.getaddrinfo,
            ssl_context: ssl.SSLContext | None = None) -> Outcome:
    """POST ``body`` with ``headers`` to ``url`` once, through the SSRF guard.

    - Only http and https.  The host is resolved once with ``resolver`` (called as
      ``resolver(host, port, 0, socket.SOCK_STREAM)``, answering like
      ``socket.getaddrinfo``); if ANY address is refused (see the module docstring) and
      neither the host name nor that address is in ``allowlist`` (exact host names or
      CIDRs, i.e. ``Settings.callback_allowlist``) the outcome is ``refused`` and no
      connection is made.
    - The connection goes to a checked address (the next one if connecting fails), with
      the URL's host in the ``Host`` header; https verifies the certificate for that host
      name (SNI) with ``ssl_context`` (default: ``ssl.create_default_context()``).
      ``Host``, ``Content-Length``, ``Transfer-Encoding`` and ``Connection`` in
      ``headers`` are ignored.
    - ``connect_timeout_s`` bounds the TCP connect and the TLS handshake;
      ``read_timeout_s`` bounds everything after it — sending, the wait for the answer
      and reading it — as one deadline, so a receiver that trickles bytes cannot hold
      the caller longer.
    - Redirects are never followed (a 3xx is a ``retry``, its Location never requested).
    - At most ``max_response_bytes`` of the response body are read; the rest is dropped
      with the connection.

    Never raises for network trouble: every failure is an ``Outcome``.
    """
    parsed, refusal = callback_target(url, allowlist)  # as admission read it
    if parsed is None:
        return Outcome(kind="refused", error=refusal)
    # The normalised ASCII (IDNA) host is what DNS, the Host header and SNI all carry.
    host, port, target = parsed.host, parsed.port, parsed.target
    try:
        targets, refused = checked_addresses(host, port, allowlist, resolver)
    except OSError as exc:
        return Outcome(kind="retry", error=f"cannot resolve {host}: {exc}")
    if refused is not None:
        return Outcome(kind="refused", error=refused.reason, detail=refused.detail)

    tls = None
    if parsed.scheme == "https":
        tls = ssl_context if ssl_context is not None else ssl.create_default_context()
    send_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
    conn = _PinnedConnection(host, port, targets, connect_timeout_s=connect_timeout_s,
                             read_timeout_s=read_timeout_s, tls=tls)
    watchdog = None
    expired = threading.Event()
    try:
        try:
            conn.connect()
        except ssl.SSLError as exc:
            return Outcome(kind="retry", error=f"TLS with {host} failed: {exc}")
        except OSError as exc:
            return Outcome(kind="retry", error=f"cannot connect to {host}:{port}: {exc}")

        def expire(raw=conn.raw_socket):
            expired.set()
            try:
                raw.shutdown(socket.SHUT_RDWR)  # wakes a blocked send/recv at once
            except OSError:
                pass

        watchdog = threading.Timer(read_timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", target, body=bytes(body), headers=send_headers)
            response = conn.getresponse()
            if expired.is_set():
                # The deadline cut the headers short; the EOF only looked like their end.
                raise TimeoutError
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set() or isinstance(exc, TimeoutError):
                return Outcome(kind="retry",
                               error=f"no answer from {host} within {read_timeout_s:g}s")
            return Outcome(kind="retry", error=f"{type(exc).__name__} from {host}: {exc}")
        status = response.status
        retry_after_s = parse_retry_after(response.getheader("retry-after"))
        data = bytearray()
        try:
            while len(data) < max_response_bytes:
                chunk = response.read(min(64 * 1024, max_response_bytes - len(data)))
                if not chunk:
                    break
                data += chunk
        except (OSError, http.client.HTTPException, ValueError):
            # The status line decides the outcome; the body is only quoted in errors,
            # so one cut short (deadline, reset, bad chunking) changes nothing.
            pass
    finally:
        if watchdog is not None:
            watchdog.cancel()
        conn.close()

    if 200 <= status < 300:
        return Outcome(kind="delivered", status=status, retry_after_s=retry_after_s)
    reason = f"HTTP {status}"
    if 300 <= status < 400:
        reason += " (redirects are not followed)"
    excerpt = _excerpt(bytes(data))
    if excerpt:
        reason += f": {excerpt}"
    kind = "gone" if status == 410 else "retry"
    return Outcome(kind=kind, status=status, retry_after_s=retry_after_s, error=reason)


# --------------------------------------------------------------------------- backoff

def next_delay_s(attempt: int, base_s: float, cap_s: float = 300.0,
                 retry_after_s: float | None = None,
                 rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1 = the first attempt).

    Exponential: ``base_s * 2**(attempt-1)`` capped at ``cap_s`` (SPEC §7: 1 s doubling
    to 5 min), with **equal jitter** — half of that fixed, the other half uniformly
    random (``rand()`` in [0, 1)) — so retries spread out yet never come sooner than
    half the schedule.  A receiver's ``retry_after_s`` is a floor (capped at
    ``MAX_RETRY_AFTER_S``, one hour, so a receiver cannot stall an obligation for days);
    the result may then exceed ``cap_s``.
    """
    if not isinstance(attempt, int) or attempt < 1:
        raise ValueError("attempt counts from 1")
    if base_s <= 0 or cap_s <= 0:
        raise ValueError("base_s and cap_s must be positive")
    # Compare exponents first so a large attempt cannot overflow a float.
    ceiling = cap_s if attempt > 64 else min(cap_s, base_s * 2.0 ** (attempt - 1))
    delay = ceiling / 2 + rand() * ceiling / 2
    if retry_after_s is not None and retry_after_s > 0:
        delay = max(delay, min(float(retry_after_s), MAX_RETRY_AFTER_S))
    return delay
