"""A request thread's short wait for the next request on a kept-alive connection.

In web/gthread.py every request is read whole by the worker's event loop before a thread
sees it.  For a kept-alive connection that costs, per request, a round through that loop:
the thread hands the connection back (a queue and a pipe write that wakes the loop), the
loop registers it with its poller, wakes when the next request's bytes arrive, changes
the poller twice more while it reads them, and wakes a pool thread again.  A client that
sends its next request as soon as it has read an answer (a closed-loop client, a proxy's
kept-alive upstream under load) pays all of that for nothing.

So the thread that answered waits on the connection itself, up to
``NEXT_REQUEST_WAIT_S``, framing what arrives with the same ``RequestReader``, and serves
the next request when it is whole by then.  The guarantee that a slow client costs a
socket, never a thread (docs/guarantees.md, "What a hostile client cannot do"), holds
with that bound: a thread waits at most ``NEXT_REQUEST_WAIT_S``, only while no request is
queued for the pool and another thread of the pool is idle, and never while the
worker stops; and anything but a whole ordinary request within the wait (part of one, a
refusal, a body over the limit, a client waiting for its ``100 Continue``) goes back to
the event loop as the bytes read, which frames it afresh from them.
"""

from __future__ import annotations

import select
import threading
import time
from typing import TYPE_CHECKING, Any

from .request_reader import Refusal, RequestReader, Verdict

if TYPE_CHECKING:
    # To the type checker the mixin is a gthread worker (see web/worker_signals.py).
    from gunicorn.workers.gthread import TConn
    from gunicorn.workers.gthread import ThreadWorker as _Worker
else:
    _Worker = object

#: Seconds a request thread waits on a kept-alive connection for the client's next request
#: before handing the connection back to the event loop.  A client that sends its next
#: request as soon as it has read an answer usually does so well within this, even on a
#: busy machine: under make bench's end-to-end load (two cores, every one busy) a web
#: process's event loop woke 0.07-0.2 times per admission with this wait, 1.3 without.
NEXT_REQUEST_WAIT_S = 0.005


class NextRequestWait(_Worker):
    """Mixin for web/gthread.py's ``BufferingThreadWorker`` (after ``FlagOnlySignals``,
    before gunicorn's ``ThreadWorker``), which provides ``request_reader`` and
    ``recv_bytes`` and hands every connection to the pool through ``enqueue_req``."""

    #: Requests submitted to the pool and not yet picked up by a thread, and threads
    #: inside ``handle`` (serving a request or waiting for a next one): a thread waits
    #: only while no request is queued and another thread of the pool is idle, so a
    #: request the event loop submits meanwhile finds a thread.  Both under
    #: ``pool_counts``.
    queued_requests = 0
    threads_in_handle = 0
    recv_bytes: int

    def init_process(self) -> None:
        self.pool_counts = threading.Lock()
        super().init_process()

    def request_reader(self, data: bytes = b"") -> RequestReader:
        raise NotImplementedError

    def enqueue_req(self, conn: TConn) -> None:
        with self.pool_counts:
            self.queued_requests += 1
        super().enqueue_req(conn)

    def handle(self, conn: TConn) -> Any:
        """gunicorn's handling of one request, then of each next request the client
        sends on the connection within NEXT_REQUEST_WAIT_S."""
        with self.pool_counts:
            self.queued_requests -= 1
            self.threads_in_handle += 1
        try:
            keep = super().handle(conn)
            while keep is True and self._may_wait_for_next(conn):
                arrived = self._next_request(conn)
                if arrived is None:
                    break  # nothing whole in time: the event loop takes the connection back
                if not arrived:
                    return False  # the client closed the connection (or reset it)
                keep = super().handle(conn)
            return keep
        finally:
            with self.pool_counts:
                self.threads_in_handle -= 1

    def _may_wait_for_next(self, conn: TConn) -> bool:
        """Whether this thread may wait on ``conn``: not while stopping, not after a body
        over the limit, not with a next request's bytes already buffered (the event loop
        frames them), and only while no request is queued for the pool and another of its
        threads is idle (outside ``handle``).  Never on an HTTP/2 connection, which
        gunicorn serves whole on one thread anyway (``serve`` speaks HTTP/1.1 only)."""
        if (not self.alive or conn.is_http2 or conn.oversized
                or conn.parser.unreader.buf.getvalue()):
            return False
        with self.pool_counts:
            return not self.queued_requests and self.threads_in_handle < self.cfg.threads

    def _next_request(self, conn: TConn) -> bool | None:
        """Wait up to NEXT_REQUEST_WAIT_S for the client's next request: True once it is
        whole and buffered for the parser, False if the client closed the connection,
        None otherwise, with whatever arrived buffered for the event loop to go on
        framing (web/gthread.py's ``finish_request`` hands it to its reader)."""
        reader = self.request_reader()
        poller = select.poll()
        poller.register(conn.sock, select.POLLIN)
        deadline = time.monotonic() + NEXT_REQUEST_WAIT_S
        verdict: Verdict | Refusal = Verdict.MORE
        while verdict is Verdict.MORE:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not poller.poll(remaining_ms):
                break
            try:
                data = conn.sock.recv(self.recv_bytes)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return False
            if not data:
                return False
            verdict = reader.feed(data)
        if not reader.buffer:
            return None
        conn.parser.unreader.unread(bytes(reader.buffer))
        return True if verdict is Verdict.COMPLETE and not reader.expects_continue else None
