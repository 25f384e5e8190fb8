"""The HTTP side of webhook delivery (docs/api.md, "Deliveries (webhooks)"): signing, one
guarded attempt, backoff.

Pure functions over the network — no ledger, no Dramatiq.  The deliverer
(``workers/delivery.py``) reads an obligation, calls ``headers`` and ``deliver``, and
records the ``Outcome``; ``next_delay_s`` says when to try again.

Signing follows Standard Webhooks (https://www.standardwebhooks.com/): ``webhook-id``,
``webhook-timestamp`` and ``webhook-signature`` = ``v1,<base64 HMAC-SHA256 of
"id.timestamp.body">`` keyed with the base64-decoded part of a ``whsec_…`` secret; during
a rotation every current secret signs and the signatures are space-separated.

``deliver`` makes one POST and never follows a redirect, in three steps.  ``_resolve``
resolves the host once and refuses (no connection made) when any address is loopback,
private, link-local, CGNAT, cloud metadata, multicast, unspecified/reserved or an IPv6
form carrying one of those (``netguard.checked_addresses``), unless allow-listed;
``_exchange`` connects to a checked address itself (``netguard.PinnedConnection``),
sending the original ``Host`` and, for https, SNI and certificate verification for the
original host name, within the timeouts; ``_classify`` turns the answer into an
``Outcome``.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from .netguard import PinnedConnection, callback_target, checked_addresses

#: Prefix of a signing secret; the rest is standard base64.
SECRET_PREFIX = "whsec_"
#: Fewest key bytes a signing secret may carry (docs/api.md, "Deliveries (webhooks)"); ``new_secret`` makes 32.
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
        when = when.replace(tzinfo=UTC)
    now_dt = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC)
    return max(0.0, (when - now_dt).total_seconds())


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
    target = _resolve(url, allowlist, resolver)
    if isinstance(target, Outcome):
        return target  # refused, or a name that did not resolve
    answer = _exchange(target, body, headers, connect_timeout_s=connect_timeout_s,
                       read_timeout_s=read_timeout_s, max_response_bytes=max_response_bytes,
                       ssl_context=ssl_context)
    if isinstance(answer, Outcome):
        return answer  # no status came back
    return _classify(answer)


@dataclass(frozen=True)
class _Target:
    """Where one attempt goes: the URL's parts and the addresses the guard let through."""

    host: str  # the normalised ASCII (IDNA) host: what DNS, Host and SNI all carry
    port: int
    path: str  # the request target: path and query
    https: bool
    addresses: list[tuple[int, tuple]]  # (family, sockaddr), in the resolver's order


@dataclass(frozen=True)
class _Answer:
    """What the receiver answered: its status, its Retry-After, the start of its body."""

    status: int
    retry_after_s: float | None
    body: bytes


def _resolve(url: str, allowlist: tuple[str, ...], resolver: Callable) -> _Target | Outcome:
    """The step before any connection: the URL as admission read it, its host resolved
    once and every address checked (``netguard``).  ``refused`` when the URL or an
    address is not allowed, ``retry`` when the name does not resolve."""
    parsed, refusal = callback_target(url, allowlist)  # as admission read it
    if parsed is None:
        return Outcome(kind="refused", error=refusal)
    host, port = parsed.host, parsed.port
    try:
        addresses, refused = checked_addresses(host, port, allowlist, resolver)
    except OSError as exc:
        return Outcome(kind="retry", error=f"cannot resolve {host}: {exc}")
    if refused is not None:
        return Outcome(kind="refused", error=refused.reason, detail=refused.detail)
    return _Target(host, port, parsed.target, parsed.scheme == "https", addresses)


def _exchange(target: _Target, body: bytes, headers: dict[str, str], *,
              connect_timeout_s: float, read_timeout_s: float, max_response_bytes: int,
              ssl_context: ssl.SSLContext | None) -> _Answer | Outcome:
    """The POST and its answer, at the checked addresses only; a ``retry`` when the
    connection, TLS, the request or the answer's head fails or runs out of time."""
    tls = None
    if target.https:
        tls = ssl_context if ssl_context is not None else ssl.create_default_context()
    send_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
    conn = PinnedConnection(target.host, target.port, target.addresses,
                             connect_timeout_s=connect_timeout_s,
                             read_timeout_s=read_timeout_s, tls=tls)
    try:
        try:
            conn.connect()
        except ssl.SSLError as exc:
            return Outcome(kind="retry", error=f"TLS with {target.host} failed: {exc}")
        except OSError as exc:
            return Outcome(kind="retry",
                           error=f"cannot connect to {target.host}:{target.port}: {exc}")
        with _deadline(conn.raw_socket, read_timeout_s) as expired:
            return _post(conn, target, bytes(body), send_headers, expired,
                         read_timeout_s, max_response_bytes)
    finally:
        conn.close()


@contextlib.contextmanager
def _deadline(raw: socket.socket | None, seconds: float) -> Iterator[threading.Event]:
    """``seconds`` for everything after the connect, as one deadline: when it passes, a
    timer shuts the TCP socket down, which wakes a blocked send or recv at once (a socket
    timeout restarts with every byte a slow receiver trickles).  Yields the event that
    says it passed."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        if raw is not None:  # always set once connected
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield expired
    finally:
        watchdog.cancel()


def _post(conn: PinnedConnection, target: _Target, body: bytes, headers: dict[str, str],
          expired: threading.Event, read_timeout_s: float,
          max_response_bytes: int) -> _Answer | Outcome:
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()
        if expired.is_set():
            # The deadline cut the headers short; the EOF only looked like their end.
            raise TimeoutError
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            return Outcome(kind="retry", error=f"no answer from {target.host} within "
                                               f"{read_timeout_s:g}s")
        return Outcome(kind="retry", error=f"{type(exc).__name__} from {target.host}: {exc}")
    retry_after_s = parse_retry_after(response.getheader("retry-after"))
    return _Answer(response.status, retry_after_s, _read_capped(response, max_response_bytes))


def _read_capped(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of the answer's body, or what of it came before it broke."""
    data = bytearray()
    try:
        while len(data) < max_bytes:
            chunk = response.read(min(64 * 1024, max_bytes - len(data)))
            if not chunk:
                break
            data += chunk
    except (OSError, http.client.HTTPException, ValueError):
        # The status line decides the outcome; the body is only quoted in errors,
        # so one cut short (deadline, reset, bad chunking) changes nothing.
        pass
    return bytes(data)


def _classify(answer: _Answer) -> Outcome:
    """The outcome of an answered attempt: 2xx ``delivered``, 410 ``gone`` (park now),
    anything else ``retry`` (the deliverer backs off with ``next_delay_s`` and parks
    after the last attempt), with the start of the body quoted in ``error``."""
    status, retry_after_s = answer.status, answer.retry_after_s
    if 200 <= status < 300:
        return Outcome(kind="delivered", status=status, retry_after_s=retry_after_s)
    reason = f"HTTP {status}"
    if 300 <= status < 400:
        reason += " (redirects are not followed)"
    excerpt = _excerpt(answer.body)
    if excerpt:
        reason += f": {excerpt}"
    kind: Literal["gone", "retry"] = "gone" if status == 410 else "retry"
    return Outcome(kind=kind, status=status, retry_after_s=retry_after_s, error=reason)


# --------------------------------------------------------------------------- backoff

def next_delay_s(attempt: int, base_s: float, cap_s: float = 300.0,
                 retry_after_s: float | None = None,
                 rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1 = the first attempt).

    Exponential: ``base_s * 2**(attempt-1)`` capped at ``cap_s`` (docs/api.md, "Deliveries (webhooks)": 1 s doubling
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
