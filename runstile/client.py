"""A Python client for the runstile HTTP API (SPEC §3), on the standard library alone.

    client = runstile.Client("http://127.0.0.1:8000", "rsk_…")
    run = client.submit("echo", {"text": "hi"})   # safe to retry: one Idempotency-Key
    done = client.wait(run["id"])                 # the terminal run object

Retries are safe by construction.  ``submit`` sends an ``Idempotency-Key`` (a uuid4 when
the caller gives none) and sends the *same* key on every retry of that call, so a retry
after a lost answer returns the run the first attempt admitted instead of a second run.
Connection errors, timeouts, 5xx and 429 are retried with exponential backoff and jitter,
honouring ``Retry-After``; other 4xx never are.  ``resume`` is the one call that is not
idempotent on the server, so it is retried only when the server surely did nothing (the
connection was refused, or a 429/503 answered).

Connections are kept alive in a small pool (one ``Client`` may be shared by threads); an
event stream holds a connection of its own.  Pass ``session=requests.Session()`` to send
through requests instead (proxies, custom TLS).  Every failure the API reports raises
:class:`runstile.errors.ApiError` with its ``status``, ``code``, ``message`` and
``details``; a server that cannot be reached after the retries raises it with
``status=None`` and code ``connection_failed``.
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
import uuid
from typing import Any, Iterable, Iterator

from .errors import ApiError

__all__ = ["Client", "TERMINAL_EVENTS", "TERMINAL_STATUSES"]

#: Run statuses that never change again (docs/api.md, "The run object").  Spelled out
#: here because the client imports nothing of the server side; a unit test keeps it equal
#: to the ledger's own list.
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "interrupted"})
#: Event types after which a run's stream has nothing more to say (docs/api.md, events).
TERMINAL_EVENTS = frozenset(f"run.{status}" for status in TERMINAL_STATUSES)
#: Answers that mean "the server did nothing; try again later" (safe for every call).
_REFUSED_STATUSES = frozenset({429, 503})
#: Errors on a reused keep-alive connection that mean the server had closed it while idle.
_STALE_ERRORS = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError,
                 ConnectionAbortedError)
_USER_AGENT = "runstile-client/0.1.0"


class _TransportError(Exception):
    """A request that got no HTTP answer; ``sent`` is False when nothing left this host."""

    def __init__(self, cause: BaseException, *, sent: bool) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.cause, self.sent = cause, sent


class _Answer:
    """One HTTP answer: status, case-insensitive headers, and the body or a chunk stream."""

    def __init__(self, status: int, reason: str, headers: Any, body: bytes = b"",
                 chunks: Iterator[bytes] | None = None, close=lambda: None) -> None:
        self.status, self.reason, self.headers, self.body = status, reason, headers, body
        self._chunks, self.close = chunks, close

    def chunks(self) -> Iterator[bytes]:
        return self._chunks if self._chunks is not None else iter((self.body,))


class _StdlibTransport:
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
            raise _TransportError(exc, sent=False) from exc
        return conn, False

    def _keep(self, conn) -> None:
        with self._lock:
            self._idle.append((time.monotonic(), conn))

    def send(self, method: str, target: str, headers: dict, body: bytes | None,
             timeout_s: float, *, stream: bool = False, fresh: bool = False,
             read_timeout=None) -> _Answer:
        conn, reused = self._connection(timeout_s, fresh)
        try:
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
        except _STALE_ERRORS as exc:
            conn.close()
            if not reused:
                raise _TransportError(exc, sent=True) from exc
            # The server closed this idle connection before reading the request (the
            # keep-alive race): nothing was processed, so send it once more on a new one.
            return self.send(method, target, headers, body, timeout_s, stream=stream, fresh=True,
                             read_timeout=read_timeout)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _TransportError(exc, sent=True) from exc
        if stream and resp.status == 200:
            def chunks() -> Iterator[bytes]:
                while True:
                    if read_timeout is not None and conn.sock is not None:
                        conn.sock.settimeout(read_timeout())  # e.g. what is left of a wait
                    chunk = resp.read1(65536)
                    if not chunk:
                        return
                    yield chunk
            return _Answer(resp.status, resp.reason, resp.headers, chunks=chunks(),
                           close=conn.close)
        try:
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _TransportError(exc, sent=True) from exc
        if resp.will_close:
            conn.close()
        else:
            self._keep(conn)
        return _Answer(resp.status, resp.reason, resp.headers, data)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()


class _SessionTransport:
    """The same interface through a caller's ``requests.Session`` (or anything like it).

    requests' exceptions derive from ``OSError``, so they are caught as transport errors.
    """

    def __init__(self, session: Any, base: str) -> None:
        self.session, self.base = session, base

    def send(self, method: str, target: str, headers: dict, body: bytes | None,
             timeout_s: float, *, stream: bool = False, fresh: bool = False,
             read_timeout=None) -> _Answer:
        # read_timeout is not applied: requests fixes a stream's read timeout when it opens.
        try:
            resp = self.session.request(method, self.base + target, headers=headers, data=body,
                                        timeout=timeout_s, stream=stream, allow_redirects=False)
        except OSError as exc:
            refused = type(exc).__name__ == "ConnectTimeout" or "NewConnectionError" in repr(exc)
            raise _TransportError(exc, sent=not refused) from exc
        if stream and resp.status_code == 200:
            return _Answer(resp.status_code, resp.reason or "", resp.headers,
                           chunks=resp.iter_content(chunk_size=None), close=resp.close)
        try:
            data = resp.content
        except OSError as exc:
            raise _TransportError(exc, sent=True) from exc
        return _Answer(resp.status_code, resp.reason or "", resp.headers, data)

    def close(self) -> None:
        """The session belongs to the caller; it is not closed here."""


# ------------------------------------------------------------------ server-sent events

_LINE_END = re.compile(rb"\r\n|\r|\n")


def _lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """Split a byte stream into lines on CRLF, LF or CR (the SSE rule)."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        start = 0
        for match in _LINE_END.finditer(buffer):
            if match.group() == b"\r" and match.end() == len(buffer):
                break  # a CR at the very end may be the first half of a CRLF
            yield buffer[start:match.start()].decode("utf-8", "replace")
            start = match.end()
        buffer = buffer[start:]
    # A last line without its end is an incomplete frame: dropped, as the SSE spec says.


def parse_sse(chunks: Iterable[bytes]) -> Iterator[dict]:
    """Frames of a ``text/event-stream``: ``{"id", "event", "data"}`` per dispatched event,
    ``{"retry": ms}`` for a reconnection-time field.  Comments are skipped."""
    data: list[str] = []
    event_id = event = None
    first = True
    for line in _lines(chunks):
        if first:
            line, first = line.removeprefix("\ufeff"), False
        if not line:
            if data:
                yield {"id": event_id, "event": event or "message", "data": "\n".join(data)}
            data, event = [], None
            continue
        if line.startswith(":"):
            continue  # a comment, such as ": keepalive"
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            event_id = value
        elif name == "retry" and value.isascii() and value.isdigit() and len(value) <= 9:
            # ASCII only: str.isdigit() also takes '²', which int() refuses.
            yield {"retry": int(value)}


# ------------------------------------------------------------------ the client

class Client:
    """One runstile server and one API key.

    ``timeout_s`` bounds each connect and each read; ``max_retries`` is how many times a
    call is retried (so a call makes at most ``max_retries + 1`` attempts).
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
            self._transport: Any = _SessionTransport(
                session, f"{parts.scheme}://{parts.netloc}")
        else:
            self._transport = _StdlibTransport(parts.scheme, parts.hostname, parts.port)

    def close(self) -> None:
        """Close the pooled connections (the client stays usable; it reconnects)."""
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    # -------------------------------------------------------------- runs

    def submit(self, task: str | None, input: Any = None, *, idempotency_key: str | None = None,
               run_id: str | None = None, session_key: str | None = None,
               trigger_id: str | None = None, callback_url: str | None = None,
               metadata: dict[str, str] | None = None) -> dict:
        """Admit a run (``POST /v1/runs``); returns the run object with ``replayed``.

        Without ``idempotency_key`` a uuid4 is generated; every retry of this call sends
        the same key, so the server admits at most one run for it.
        """
        body = {"task": task, "input": input, "run_id": run_id, "session_key": session_key,
                "trigger_id": trigger_id, "callback_url": callback_url, "metadata": metadata}
        payload = json.dumps({k: v for k, v in body.items() if v is not None},
                             separators=(",", ":"), allow_nan=False).encode()
        key = idempotency_key if idempotency_key is not None else str(uuid.uuid4())
        return self._call("POST", "/v1/runs", body=payload,
                          headers={"Idempotency-Key": key, "Content-Type": "application/json"})

    def get(self, run_id: str) -> dict:
        """The run object (``GET /v1/runs/<id>``)."""
        return self._call("GET", f"/v1/runs/{_quote(run_id)}")

    def list(self, **filters: Any) -> dict:
        """One page of runs, newest first: ``{"object": "list", "data", "has_more",
        "next_cursor"}``.  Filters: ``status`` (one or several), ``task``, ``session_key``,
        ``idempotency_key``, ``created_after``/``created_before`` (RFC 3339 text or an
        aware datetime), ``metadata`` (a dict, or ``metadata.<k>`` keys), ``limit``,
        ``cursor``."""
        return self._call("GET", "/v1/runs", query=_list_query(filters))

    def iter_runs(self, **filters: Any) -> Iterator[dict]:
        """Every run matching ``filters``, newest first, following ``next_cursor``
        (``limit`` is the page size)."""
        filters = dict(filters)
        while True:
            page = self.list(**filters)
            yield from page["data"]
            if not page.get("has_more") or not page.get("next_cursor"):
                return
            filters["cursor"] = page["next_cursor"]

    def stop(self, run_id: str) -> dict:
        """Ask a run to stop (``POST /v1/runs/<id>/stop``); returns the run object.
        Repeats are harmless, so it is retried like a read."""
        return self._call("POST", f"/v1/runs/{_quote(run_id)}/stop")

    def resume(self, run_id: str) -> dict:
        """Re-queue a ``paused`` run (``POST /v1/runs/<id>/resume``); 409
        ``run_not_paused`` otherwise.  Retried only when the server surely did nothing."""
        return self._call("POST", f"/v1/runs/{_quote(run_id)}/resume", only_if_refused=True)

    def approve(self, run_id: str, approval_id: str, decision: str) -> dict:
        """Decide a pending approval (``POST /v1/runs/<id>/approval``); ``decision`` is
        ``"approve"`` or ``"deny"``.  The same decision again is answered 200, so retries
        are safe."""
        if decision not in ("approve", "deny"):
            raise ValueError(f"decision must be 'approve' or 'deny', not {decision!r}")
        payload = json.dumps({"approval_id": approval_id, "decision": decision}).encode()
        return self._call("POST", f"/v1/runs/{_quote(run_id)}/approval", body=payload,
                          headers={"Content-Type": "application/json"})

    # -------------------------------------------------------------- events

    def events(self, run_id: str, after: int = 0) -> Iterator[dict]:
        """The run's events with ``seq`` above ``after``, as they happen: a generator of
        ``{"seq", "type", "data", "created_at"}`` over the server-sent event stream.

        A dropped connection, a read timeout or the server's stream-lifetime close is
        resumed with ``Last-Event-ID``: no event is lost or repeated.  The generator ends
        after the terminal event (``run.completed|failed|cancelled|interrupted``), or at
        once when ``after`` is already past it.  Close it to stop early.
        """
        return self._events(run_id, after, deadline=None)

    def wait(self, run_id: str, timeout_s: float | None = None) -> dict:
        """Block until the run is terminal and return its run object.

        Follows the event stream; raises the built-in ``TimeoutError`` after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run = self.get(run_id)
        if run["status"] in TERMINAL_STATUSES:
            return run
        for _ in self._events(run_id, 0, deadline=deadline):
            pass
        return self.get(run_id)

    def _events(self, run_id: str, after: int, deadline: float | None) -> Iterator[dict]:
        path = f"/v1/runs/{_quote(run_id)}/events"
        last, failures, retry_s = int(after), 0, 1.0
        while True:
            timeout_s = self._timeout(deadline, f"run {run_id} is not terminal")
            headers = {**self._headers, "Accept": "text/event-stream",
                       "Last-Event-ID": str(last)}
            try:
                answer = self._transport.send(
                    "GET", self._prefix + path, headers, None, timeout_s, stream=True,
                    read_timeout=None if deadline is None else
                    lambda: max(0.001, min(self.timeout_s, deadline - time.monotonic())))
            except _TransportError as exc:
                failures += 1
                if failures > self.max_retries:
                    raise self._unreachable("GET", path, exc) from exc.cause
                self._sleep(self._backoff(failures - 1), deadline)
                continue
            if answer.status != 200:
                error = self._api_error(answer, "GET", path)
                failures += 1
                if not _retryable(answer.status) or failures > self.max_retries:
                    raise error
                self._sleep(self._retry_delay(answer, failures - 1), deadline)
                continue
            failures, received = 0, 0
            try:
                for frame in parse_sse(answer.chunks()):
                    if "retry" in frame:
                        retry_s = frame["retry"] / 1000
                        continue
                    event = json.loads(frame["data"])
                    if event["seq"] <= last:
                        continue  # never repeat an event, whatever the server sends
                    last, received = event["seq"], received + 1
                    yield event
                    if event["type"] in TERMINAL_EVENTS:
                        return
                    if deadline is not None and time.monotonic() >= deadline:
                        break
            except (OSError, http.client.HTTPException):
                pass  # dropped or timed out: resume below from ``last``
            finally:
                answer.close()
            if deadline is not None and time.monotonic() >= deadline:
                continue  # the top of the loop raises TimeoutError
            if received == 0:
                # The stream ended with nothing new: either the run is already past its
                # terminal event, or the stream lived out its lifetime while idle.
                if self.get(run_id)["status"] in TERMINAL_STATUSES:
                    if not self._has_events_after(path, last):
                        return
                    # Events after ``last`` remain: the next stream sends them.
                    self._sleep(min(retry_s, 0.1), deadline)
                    continue
                self._sleep(retry_s * random.uniform(0.5, 1.0), deadline)

    def _has_events_after(self, path: str, after: int) -> bool:
        """Whether a terminal run has events past ``after``: a stream can close on seeing
        the terminal status without having sent the terminal event (it reads the events,
        then the status, and the run may end in between)."""
        page = self._call("GET", path, query=[("after", str(after))],
                          headers={"Accept": "application/json"})
        return bool(page["data"])

    # -------------------------------------------------------------- plumbing

    def _call(self, method: str, path: str, *, query: list | None = None,
              body: bytes | None = None, headers: dict | None = None,
              only_if_refused: bool = False) -> dict:
        """One API call with the retry policy; returns the decoded JSON answer."""
        target = self._prefix + path + ("?" + urllib.parse.urlencode(query) if query else "")
        all_headers = {**self._headers, "Accept": "application/json", **(headers or {})}
        attempt = 0
        while True:
            try:
                answer = self._transport.send(method, target, all_headers, body, self.timeout_s,
                                              fresh=only_if_refused)
            except _TransportError as exc:
                if attempt >= self.max_retries or (only_if_refused and exc.sent):
                    raise self._unreachable(method, path, exc) from exc.cause
                delay = self._backoff(attempt)
            else:
                if answer.status < 400:
                    return json.loads(answer.body) if answer.body else {}
                error = self._api_error(answer, method, path)
                retry = answer.status in _REFUSED_STATUSES if only_if_refused \
                    else _retryable(answer.status)
                if not retry or attempt >= self.max_retries:
                    raise error
                delay = self._retry_delay(answer, attempt)
            attempt += 1
            time.sleep(delay)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: between half and all of base * 2**attempt."""
        ceiling = min(self.backoff_cap_s, self.backoff_base_s * 2 ** attempt)
        return ceiling * random.uniform(0.5, 1.0)

    def _retry_delay(self, answer: _Answer, attempt: int) -> float:
        """``Retry-After`` when the server sent one (seconds or an HTTP date), else backoff."""
        raw = (answer.headers.get("Retry-After") or "").strip()
        seconds: float | None = None
        if raw.isascii() and raw.isdigit():  # not '²': float() would refuse it
            seconds = float(raw[:9])
        elif raw:
            try:
                when = dt.datetime.strptime(raw, "%a, %d %b %Y %H:%M:%S GMT")
                seconds = max(0.0, when.replace(tzinfo=dt.timezone.utc).timestamp() - time.time())
            except ValueError:
                seconds = None
        if seconds is None:
            return self._backoff(attempt)
        return min(self.backoff_cap_s, seconds)

    def _timeout(self, deadline: float | None, what: str) -> float:
        if deadline is None:
            return self.timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} after the wait's timeout")
        return min(self.timeout_s, remaining)

    def _sleep(self, seconds: float, deadline: float | None) -> None:
        if deadline is not None:
            seconds = min(seconds, max(0.0, deadline - time.monotonic()))
        time.sleep(seconds)

    def _api_error(self, answer: _Answer, method: str, path: str) -> ApiError:
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

    def _unreachable(self, method: str, path: str, exc: _TransportError) -> ApiError:
        return ApiError(None, "connection_failed",
                        f"{method} {self.url}{path}: no answer after {self.max_retries + 1} "
                        f"attempt(s) or a failure that is unsafe to retry: {exc}")


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _quote(segment: str) -> str:
    return urllib.parse.quote(str(segment), safe="")


def _list_query(filters: dict[str, Any]) -> list[tuple[str, str]]:
    query: list[tuple[str, str]] = []
    for name, value in filters.items():
        if value is None:
            continue
        if name == "metadata":
            query += [(f"metadata.{k}", str(v)) for k, v in dict(value).items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            query += [(name, _query_value(v)) for v in value]
        else:
            query.append((name, _query_value(value)))
    return query


def _query_value(value: Any) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            raise ValueError("created_after/created_before need a timezone-aware datetime")
        return value.isoformat()
    return str(value)
