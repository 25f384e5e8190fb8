"""A run's event stream (Server-Sent Events) and the slots that cap open streams.

A stream holds a gthread thread for its whole life, so streams are counted: per web
process (``RUNSTILE_MAX_STREAMS``, never more than half the threads; 503 beyond) and per
API key (``RUNSTILE_MAX_STREAMS_PER_KEY``; 429 beyond), so that one key cannot take every
stream of a process from the other tenants (docs/api.md, "Server-sent events").
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

from flask import Response

from ..config import Settings
from ..errors import StreamsExhausted, StreamsPerKeyExhausted
from ..ledger import events, runs
from ..ledger.db import ConnectionPool
from ..ledger.states import TERMINAL
from ..objects import event_object
from .state import state

#: Event types that end a run's stream (docs/api.md: it closes after the terminal event).
TERMINAL_EVENTS = frozenset(f"run.{status.value}" for status in TERMINAL)
TERMINAL_STATUSES = frozenset(status.value for status in TERMINAL)
#: Seconds between polls of the event log while a stream is idle.
STREAM_POLL_S = 0.05


class Slot:
    """One open stream's place in :class:`StreamSlots`, given back exactly once.

    A response can end in several ways, and each calls :meth:`give_back`: the body
    generator's ``finally`` (it ran, then ended, failed or was closed because the client
    went away) and the response's ``call_on_close`` (the WSGI server closes every response,
    including one whose body is never iterated: a HEAD request, whose generator never
    starts and so never reaches its ``finally``).  Both can run for one response, so the
    first one gives the slot back and the second finds it gone.
    """

    def __init__(self, slots: StreamSlots, key_id: str) -> None:
        self.slots, self.key_id, self.held = slots, key_id, True

    def give_back(self) -> None:
        with self.slots.lock:
            if not self.held:
                return
            self.held = False
            self.slots.release(self.key_id)


class StreamSlots:
    """This process's open streams: all together, and per API key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.by_key: dict[str, int] = {}

    def take(self, key_id: str, *, cap: int, per_key: int) -> Slot:
        """A slot for one more stream of ``key_id``, or the error that refuses it.

        The key's own cap is checked first: a key over its share is told so (429) even
        when the process is full too, since waiting for other tenants would not help it.
        """
        with self.lock:
            held = self.by_key.get(key_id, 0)
            refused = held >= per_key, self.open >= cap
            if not any(refused):
                self.open += 1
                self.by_key[key_id] = held + 1
                return Slot(self, key_id)
        if refused[0]:
            raise StreamsPerKeyExhausted(
                f"this key already holds its maximum of {per_key} open event streams in "
                f"this web process; close one, poll with Accept: application/json, or retry",
                limit=per_key)
        raise StreamsExhausted("this process serves its maximum of event streams; retry")

    def release(self, key_id: str) -> None:
        """Called with ``lock`` held, by :meth:`Slot.give_back` only."""
        self.open -= 1
        left = self.by_key.pop(key_id) - 1
        if left:
            self.by_key[key_id] = left


_slots = StreamSlots()


def open_stream(run_id: str, after: int, key_id: str) -> Response:
    """The run's events after ``after`` as ``text/event-stream``, holding a slot."""
    web = state()  # read here: the body runs after the request's context is gone
    settings = web.settings
    # A stream holds a gthread thread for its whole life: never let streams take more
    # than half of them, or a few watchers would starve every other request.
    slot = _slots.take(key_id, cap=min(settings.max_streams, max(1, settings.web_threads // 2)),
                       per_key=settings.max_streams_per_key)
    try:
        response = Response(_frames(run_id, after, slot, settings, web.pool),
                            mimetype="text/event-stream")
        response.call_on_close(slot.give_back)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
    except BaseException:
        slot.give_back()  # no response will ever be closed for it
        raise
    return response


def _frames(run_id: str, after: int, slot: Slot, settings: Settings,
            pool: ConnectionPool) -> Iterator[str]:
    try:
        last, deadline = after, time.monotonic() + settings.stream_max_s
        quiet_since = time.monotonic()
        yield "retry: 1000\n\n"
        while time.monotonic() < deadline:
            # Status first, then events: the terminal event commits with the terminal
            # status, so a status seen terminal here means the read below has the
            # terminal event (the other order could close before sending it).
            # One short read each; no transaction stays open in between.
            finished = runs.status_of(pool.get(), run_id) in TERMINAL_STATUSES
            batch = events.after(pool.get(), run_id, last, 500)
            for event in batch:
                last = event["seq"]
                yield (f"id: {event['seq']}\nevent: {event['type']}\n"
                       f"data: {json.dumps(event_object(event), separators=(',', ':'))}\n\n")
            if batch:
                quiet_since = time.monotonic()
                if any(e["type"] in TERMINAL_EVENTS for e in batch):
                    return
                continue
            if finished:
                return
            if time.monotonic() - quiet_since >= settings.stream_keepalive_s:
                quiet_since = time.monotonic()
                yield ": keepalive\n\n"
            time.sleep(STREAM_POLL_S)
    finally:
        slot.give_back()
