"""The client's HTTP side: connections, the retry policy, and API errors.

Two transports send one request each: :class:`StdlibTransport` (``http.client`` with a
small keep-alive pool, and the one resend of the keep-alive race) and
:class:`SessionTransport` (a caller's ``requests.Session``).  :class:`HttpApi` puts the
retry policy of docs/api.md ("Clients", Retries) on top: it is the base of
:class:`runstile.client.Client`, whose route methods call :meth:`HttpApi._call`, and
:func:`runstile.client.sse.follow` opens event streams with its pieces.  Standard library
and ``runstile.errors`` only: the client imports nothing of the server side.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from ..errors import ApiError

#: Answers that mean "the server did nothing; try again later" (safe for every call).
REFUSED_STATUSES = frozenset({429, 503})
#: Errors on a reused keep-alive connection that mean the server had closed it while idle.
_STALE_ERRORS = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                 ConnectionAbortedError)
_USER_AGENT = "runstile-client/0.1.0"


class TransportError(Exception):
    """A request that got no HTTP answer; ``sent`` is False when nothing left this host."""

    def __init__(self, cause: BaseException, *, sent: bool) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.cause, self.sent = cause, sent


class Answer:
    """One HTTP answer: status, case-insensitive headers, and the body or a chunk stream."""

    def __init__(self, status: int, reason: str, headers: Any, body: bytes = b"",
                 chunks: Iterator[bytes] | None = None, close=lambda: None) -> None:
        self.status, self.reason, self.headers, self.body = status, reason, headers, body
        self._chunks, self.close = chunks, close

    def chunks(self) -> Iterator[bytes]:
        return self._chunks if self._chunks is not None else iter((self.body,))


class StdlibTransport:
    """``http.client`` with a small keep-alive pool; streams take a connection of their own."""

    #: Seconds a pooled connection may sit idle before it is closed rather than reused
    #: (gunicorn closes idle keep-alive connections after 5 s).
    max_idle_s = 2.0

    def __init__(self, scheme: str, host: str, port: int | None) -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self._idle: list[tuple[float, http.client.HTTPConnection]] = []
        self._lock = threading.Lock()

    def _connection(self, timeout_s: float, fresh: bool):
        if not fresh:
            with self._lock:
                while self._idle:
                    since, conn = self._idle.pop()
                    if time.monotonic() - since <= self.max_idle_s:
                        conn.timeout = timeout_s
                        if conn.sock is not None:
                            conn.sock.settimeout(timeout_s)
                        return conn, True
                    conn.close()
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=timeout_s)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise TransportError(exc, sent=False) from exc
        return conn, False

    def _keep(self, conn) -> None:
        with self._lock:
            self._idle.append((time.monotonic(), conn))

    def send(self, method: str, target: str, headers: dict, body: bytes | None,
             timeout_s: float, *, stream: bool = False, fresh: bool = False,
             read_timeout=None) -> Answer:
        conn, reused = self._connection(timeout_s, fresh)
        try:
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
        except _STALE_ERRORS as exc:
            conn.close()
            if not reused:
                raise TransportError(exc, sent=True) from exc
            # The server closed this idle connection before reading the request (the
            # keep-alive race): nothing was processed, so send it once more on a new one.
            return self.send(method, target, headers, body, timeout_s, stream=stream, fresh=True,
                             read_timeout=read_timeout)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(exc, sent=True) from exc
        if stream and resp.status == 200:
            def chunks() -> Iterator[bytes]:
                while True:
                    if read_timeout is not None and conn.sock is not None:
                        conn.sock.settimeout(read_timeout())  # e.g. what is left of a wait
                    chunk = resp.read1(65536)
                    if not chunk:
                        return
                    yield chunk
            return Answer(resp.status, resp.reason, resp.headers, chunks=chunks(),
                          close=conn.close)
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise TransportError(exc, sent=True) from exc
        if resp.will_close:
            conn.close()
        else:
            self._keep(conn)
        return Answer(resp.status, resp.reason, resp.headers, data)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()


class SessionTransport:
    """The same interface through a caller's ``requests.Session`` (or anything like it).

    requests' exceptions derive from ``OSError``, so they are caught as transport errors.
    """

    def __init__(self, session: Any, base: str) -> None:
        self.session, self.base = session, base

    def send(self, method: str, target: str, headers: dict, body: bytes | None,
             timeout_s: float, *, stream: bool = False, fresh: bool = False,
             read_timeout=None) -> Answer:
        # read_timeout is not applied: requests fixes a stream's read timeout when it opens.
        try:
            resp = self.session.request(method, self.base + target, headers=headers, data=body,
                                        timeout=timeout_s, stream=stream, allow_redirects=False)
        except OSError as exc:
            refused = type(exc).__name__ == "ConnectTimeout" or "NewConnectionError" in repr(exc)
            raise TransportError(exc, sent=not refused) from exc
        if stream and resp.status_code == 200:
            return Answer(resp.status_code, resp.reason or "", resp.headers,
                          chunks=resp.iter_content(chunk_size=None), close=resp.close)
        try:
            data = resp.content
        except OSError as exc:
            raise TransportError(exc, sent=True) from exc
        return Answer(resp.status_code, resp.reason or "", resp.headers, data)

    def close(self) -> None:
        """The session belongs to the caller; it is not closed here."""


class HttpApi:
    """A :class:`runstile.client.Client` without its routes: the checked arguments
    (documented on ``Client``), the transport, and the retry policy.

    The underscored methods are this package's plumbing (the route methods of ``Client``
    and :func:`runstile.client.sse.follow` use them), not the client's API.
    """

    #: Seconds before the first retry; each further retry waits twice as long (jittered).
    backoff_base_s = 0.25
    #: Longest wait between two attempts, from backoff or from ``Retry-After``.
    backoff_cap_s = 30.0

    def __init__(self, url: str, api_key: str, *, timeout_s: float = 30,
                 max_retries: int = 5, session: Any = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port][/prefix], not {url!r}")
        if not api_key or not re.fullmatch(r"[\x21-\x7e]+", api_key):
            raise ValueError("api_key is required: the rsk_… secret `runstile keys create` "
                             "prints (visible ASCII, no spaces)")
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError("timeout_s must be > 0 and max_retries >= 0")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}", "User-Agent": _USER_AGENT}
        if session is not None:
            self._transport: Any = SessionTransport(
                session, f"{parts.scheme}://{parts.netloc}")
        else:
            self._transport = StdlibTransport(parts.scheme, parts.hostname, parts.port)

    def _call(self, method: str, path: str, *, query: list | None = None,
              body: bytes | None = None, headers: dict | None = None,
              only_if_refused: bool = False) -> dict:
        """One API call with the retry policy; returns the decoded JSON answer.

        ``only_if_refused`` is for calls the server does not make idempotent: retried only
        when it surely did nothing (nothing was sent, or a 429/503 answered), and always
        on a new connection, so the keep-alive race cannot resend it either."""
        target = self._prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        all_headers = {**self._headers, "Accept": "application/json", **(headers or {})}
        attempt = 0
        while True:
            try:
                answer = self._transport.send(method, target, all_headers, body, self.timeout_s,
                                              fresh=only_if_refused)
            except TransportError as exc:
                if attempt >= self.max_retries or (only_if_refused and exc.sent):
                    raise self._unreachable(method, path, exc) from exc.cause
                delay = self._backoff(attempt)
            else:
                if answer.status < 400:
                    return json.loads(answer.body) if answer.body else {}
                error = self._api_error(answer, method, path)
                retry = answer.status in REFUSED_STATUSES if only_if_refused \
                    else retryable(answer.status)
                if not retry or attempt >= self.max_retries:
                    raise error
                delay = self._retry_delay(answer, attempt)
            attempt += 1
            time.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: between half and all of base * 2**attempt."""
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2 ** attempt)
        return ceiling * random.uniform(0.5, 1.0)

    def _retry_delay(self, answer: Answer, attempt: int) -> float:
        """``Retry-After`` when the server sent one (seconds or an HTTP date), else backoff."""
        raw = (answer.headers.get("Retry-After") or "").strip()
        seconds: float | None = None
        if raw.isascii() and raw.isdigit():  # not '²': float() would refuse it
            seconds = float(raw[:9])
        elif raw:
            try:
                when = dt.datetime.strptime(raw, "%a, %d %b %Y %H:%M:%S GMT")
                seconds = max(0.0, when.replace(tzinfo=dt.UTC).timestamp() - time.time())
            except ValueError:
                seconds = None
        if seconds is None:
            return self._backoff(attempt)
        return min(self.backoff_cap_s, seconds)

    def _api_error(self, answer: Answer, method: str, path: str) -> ApiError:
        code, message, details = f"http_{answer.status}", answer.reason or "", {}
        try:
            error = json.loads(answer.body)["error"]
            code, message = str(error["code"]), str(error.get("message", ""))
            details = {k: v for k, v in error.items() if k not in ("code", "message")}
        except (ValueError, KeyError, TypeError):
            text = answer.body[:200].decode("utf-8", "replace").strip()
            message = f"{answer.status} {answer.reason}: {text}" if text else message
        if answer.status == 404 and code == "not_found":
            # No route matched: an unknown path, or a server from before this route.
            message = (f"{method} {self._prefix + path} is not served by {self.url} "
                       f"(404 not_found: no such route; the server may predate it)")
        return ApiError(answer.status, code, message, details)

    def _unreachable(self, method: str, path: str, exc: TransportError) -> ApiError:
        return ApiError(None, "connection_failed",
                        f"{method} {self.url}{path}: no answer after {self.max_retries + 1} "
                        f"attempt(s) or a failure that is unsafe to retry: {exc}")


def retryable(status: int) -> bool:
    """Whether an answer with this status may be retried (by a call that is safe to repeat)."""
    return status == 429 or status >= 500


def quote(segment: str) -> str:
    """One path segment (a run id), percent-encoded whole."""
    return urllib.parse.quote(str(segment), safe="")
