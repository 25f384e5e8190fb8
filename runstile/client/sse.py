"""The client's event stream reader: ``text/event-stream`` frames, and following one run.

:func:`parse_sse` turns a byte stream into frames.  :func:`follow` is what
``Client.events`` and ``Client.wait`` iterate: it reads ``GET /v1/runs/<id>/events`` as
server-sent events and, when a stream drops, times out or reaches the server's lifetime
cap, opens the next one with ``Last-Event-ID`` so that no event is lost or repeated
(docs/api.md, "Server-sent events" and "Clients").  It opens streams through the retry
pieces of :class:`runstile.client.transport.HttpApi`.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import time
from collections.abc import Iterable, Iterator

from .transport import Answer, HttpApi, TransportError, quote, retryable

#: Run statuses that never change again (docs/api.md, "The run object").  Spelled out
#: here because the client imports nothing of the server side; a unit test keeps it equal
#: to the ledger's own list.
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "interrupted"})
#: Event types after which a run's stream has nothing more to say (docs/api.md, events).
TERMINAL_EVENTS = frozenset(f"run.{status}" for status in TERMINAL_STATUSES)

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


class _Cursor:
    """Where :func:`follow` stands: the last ``seq`` it yielded, the events the current
    stream brought, the server's reconnection time, and whether the run's stream is over."""

    __slots__ = ("last", "received", "retry_s", "ended")

    def __init__(self, after: int) -> None:
        self.last, self.received, self.retry_s, self.ended = after, 0, 1.0, False


def follow(api: HttpApi, run_id: str, after: int, deadline: float | None) -> Iterator[dict]:
    """The run's events with ``seq`` above ``after``, across as many streams as it takes.

    Ends after the terminal event, or once the run is terminal with nothing left to send;
    past ``deadline`` (a ``time.monotonic()`` value) raises the built-in ``TimeoutError``.
    """
    path = f"/v1/runs/{quote(run_id)}/events"
    cursor = _Cursor(int(after))
    while True:
        answer = _open(api, run_id, path, cursor.last, deadline)
        yield from _read(answer, cursor, deadline)
        if cursor.ended:
            return
        if deadline is not None and time.monotonic() >= deadline:
            continue  # _open raises TimeoutError
        if cursor.received == 0 and _idle_stream_ended(api, run_id, path, cursor, deadline):
            return


def _open(api: HttpApi, run_id: str, path: str, last: int,
          deadline: float | None) -> Answer:
    """A 200 event stream from after ``last``, retried like a read; raises the last
    failure after ``max_retries`` of them in a row, and ``TimeoutError`` past the deadline."""
    failures = 0
    while True:
        timeout_s = _time_left(api, deadline, f"run {run_id} is not terminal")
        headers = {**api._headers, "Accept": "text/event-stream", "Last-Event-ID": str(last)}
        try:
            answer = api._transport.send(
                "GET", api._prefix + path, headers, None, timeout_s, stream=True,
                read_timeout=None if deadline is None else
                lambda: max(0.001, min(api.timeout_s, deadline - time.monotonic())))
        except TransportError as exc:
            failures += 1
            if failures > api.max_retries:
                raise api._unreachable("GET", path, exc) from exc.cause
            _sleep(api._backoff(failures - 1), deadline)
            continue
        if answer.status == 200:
            return answer
        error = api._api_error(answer, "GET", path)
        failures += 1
        if not retryable(answer.status) or failures > api.max_retries:
            raise error
        _sleep(api._retry_delay(answer, failures - 1), deadline)


def _read(answer: Answer, cursor: _Cursor, deadline: float | None) -> Iterator[dict]:
    """The new events of one stream, until it ends, drops, or brings the terminal event."""
    cursor.received = 0
    try:
        for frame in parse_sse(answer.chunks()):
            if "retry" in frame:
                cursor.retry_s = frame["retry"] / 1000
                continue
            event = json.loads(frame["data"])
            if event["seq"] <= cursor.last:
                continue  # never repeat an event, whatever the server sends
            cursor.last, cursor.received = event["seq"], cursor.received + 1
            yield event
            if event["type"] in TERMINAL_EVENTS:
                cursor.ended = True
                return
            if deadline is not None and time.monotonic() >= deadline:
                break
    except (OSError, http.client.HTTPException):
        pass  # dropped or timed out: follow resumes from ``cursor.last``
    finally:
        answer.close()


def _idle_stream_ended(api: HttpApi, run_id: str, path: str, cursor: _Cursor,
                       deadline: float | None) -> bool:
    """A stream ended with nothing new: either the run is already past its terminal event
    (True: nothing more will come), or the stream lived out its lifetime while idle (wait,
    then False: the next stream follows on)."""
    if api._call("GET", f"/v1/runs/{quote(run_id)}")["status"] in TERMINAL_STATUSES:
        if not _has_events_after(api, path, cursor.last):
            return True
        # Events after ``last`` remain: the next stream sends them.
        _sleep(min(cursor.retry_s, 0.1), deadline)
        return False
    _sleep(cursor.retry_s * random.uniform(0.5, 1.0), deadline)
    return False


def _has_events_after(api: HttpApi, path: str, after: int) -> bool:
    """Whether a terminal run has events past ``after``: a stream can close on seeing
    the terminal status without having sent the terminal event (it reads the events,
    then the status, and the run may end in between)."""
    page = api._call("GET", path, query=[("after", str(after))],
                     headers={"Accept": "application/json"})
    return bool(page["data"])


def _time_left(api: HttpApi, deadline: float | None, what: str) -> float:
    """The timeout of the next connect or read: ``timeout_s``, or less near the deadline."""
    if deadline is None:
        return api.timeout_s
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"{what} after the wait's timeout")
    return min(api.timeout_s, remaining)


def _sleep(seconds: float, deadline: float | None) -> None:
    time.sleep(seconds if deadline is None
               else min(seconds, max(0.0, deadline - time.monotonic())))
