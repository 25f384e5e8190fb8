"""gunicorn's threaded worker, with every request read whole before a thread sees it.

gunicorn's ``gthread`` worker hands a connection to a request thread as soon as its first
bytes arrive; the thread then blocks in ``recv`` for the rest of the request with no
deadline.  Sixteen half-sent requests froze a web process that way.  Here the worker's
event loop (the thread that accepts) reads each request into memory with a deadline,
``RUNSTILE_REQUEST_READ_TIMEOUT_S`` from its first byte, and submits it to the thread
pool only when it is whole: a slow client costs a socket and a buffer, never a thread.
Request threads parse only from that buffer (``_BufferOnly``).  The one wait a thread
makes on a client is bounded: after answering a kept-alive connection it waits a few
milliseconds for the client's next request and serves it itself when it arrives whole in
that time (web/next_request.py); otherwise the connection goes back to the event loop.

The same loop closes connections: it half-closes, then reads and discards what the client
is still sending (a body the application refused to read, a 413 answered mid-upload)
until the client stops or a bound is reached, so the client reads its answer instead of
a connection reset.  And requests refused before the application (a timeout, a head too
large, a malformed request gunicorn's parser rejects) are answered in runstile's JSON
error shape, never gunicorn's HTML page.  See docs/operations.md, "The HTTP front".
"""

from __future__ import annotations

import errno
import json
import selectors
import socket
import threading
import time
from concurrent.futures import Future
from functools import partial
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

from gunicorn import http
from gunicorn.http import errors as http_errors
from gunicorn.http.unreader import Unreader
from gunicorn.workers.gthread import TConn, ThreadWorker

from ..errors import (
    ExpectationFailed,
    MalformedRequest,
    RequestHeadersTooLarge,
    RequestLineTooLong,
    RequestTimeout,
    RunstileError,
    UnsupportedTransferCoding,
)
from .next_request import NextRequestWait
from .request_reader import Refusal, RequestReader, Verdict
from .worker_signals import FlagOnlySignals

if TYPE_CHECKING:
    from collections.abc import Iterable

    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from gunicorn.http.message import Request
    from gunicorn.sock import BaseSocket

#: Largest head (request line and headers) the front buffers; runstile's API needs ~2 KiB.
MAX_HEAD_BYTES = 64 * 1024
#: Bytes read per ``recv`` by the event loop (and by a thread waiting for a next request).
RECV_BYTES = 64 * 1024
#: A body over the limit is drained (read and dropped) up to this many times the limit
#: before the connection is cut: enough for the client to finish an upload and read its
#: 413, bounded so a 100 MiB upload is not read whole.
DRAIN_LIMIT_FACTOR = 16
#: Seconds a closing connection waits for a well-behaved client's end of the stream.
CLOSE_LINGER_S = 2.0

#: gunicorn parser errors, as the runstile errors they are answered with (first match).
_PARSER_ERRORS: tuple[tuple[type[BaseException], type[RunstileError]], ...] = (
    (http_errors.LimitRequestLine, RequestLineTooLong),
    (http_errors.LimitRequestHeaders, RequestHeadersTooLarge),
    (http_errors.UnsupportedTransferCoding, UnsupportedTransferCoding),
    (http_errors.ExpectationFailed, ExpectationFailed),
    (http_errors.ParseException, MalformedRequest),
)
#: What gunicorn_h1c before the release that names UnsupportedTransferCoding raises, as
#: its InvalidHeader's text, for a transfer coding other than chunked; gunicorn passes the
#: text on in its own InvalidHeader.  Answered 501 like the newer releases (web/server.py).
_H1C_UNKNOWN_CODING = "Unsupported Transfer-Encoding"

#: Whether the request a request thread serves has a body over the limit (_mark_oversized).
_serving = threading.local()


def error_bytes(error: RunstileError) -> bytes:
    """A whole HTTP/1.1 response in runstile's error shape; the connection then closes."""
    body = json.dumps({"error": {"code": error.code, "message": error.message}}).encode()
    head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n")
    return head.encode("latin-1") + body


class _BufferOnly(Unreader):
    """The parser's source: only what the event loop buffered, never the socket."""

    def chunk(self, size_hint: int | None = None) -> bytes:
        return b""


class _Waiting:
    """A connection the event loop is reading a request from, or draining before close."""

    __slots__ = ("conn", "reader", "deadline", "drain_left", "continued")

    def __init__(self, conn: TConn, reader: RequestReader | None, deadline: float,
                 drain_left: int = 0) -> None:
        self.conn, self.reader, self.deadline = conn, reader, deadline
        self.drain_left, self.continued = drain_left, False


def settle_config(cfg: Any) -> None:
    """Every gunicorn setting's value as a plain attribute of this worker's ``cfg``.

    gunicorn's Config answers ``cfg.name`` through ``__getattr__``: each read misses the
    instance, then runs a Python function.  gunicorn reads its settings dozens of times
    per request (parser limits, header rules, hooks, logging), an eighth of a web
    process's instructions per admission (callgrind, docs/architecture.md "gunicorn
    with gthread workers").  A worker's settings never change (a reload starts new
    workers from the arbiter's new config), so after the fork each value is stored once
    in the instance's ``__dict__``, past Config's ``__setattr__`` (which refuses
    settings), where the ordinary lookup finds it.  Config's properties are data descriptors and still
    win over the instance, as before."""
    for name, setting in cfg.settings.items():
        vars(cfg)[name] = setting.get()


class BufferingThreadWorker(FlagOnlySignals, NextRequestWait, ThreadWorker):
    """gthread, with the event loop reading requests whole and closing connections gently,
    request threads that serve a kept-alive connection's next request when it comes at
    once (web/next_request.py), and signal handlers that only set flags
    (web/worker_signals.py).

    The settings come from the gunicorn application (web/server.py), read once there.
    """

    recv_bytes = RECV_BYTES

    def init_process(self) -> None:
        settings = self.app.settings
        self.read_timeout_s: float = settings.request_read_timeout_s
        self.max_body_bytes: int = settings.max_body_bytes
        self.waiting: dict[int, _Waiting] = {}
        settle_config(self.cfg)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi: WSGIApplication = _mark_oversized(self.wsgi)

    # -- reading requests in the event loop ------------------------------------------

    def accept(self, listener: BaseSocket) -> None:
        try:
            client, addr = listener.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = TConn(self.cfg, client, addr, listener.getsockname())  # non-blocking
        conn.parser = http.get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.unreader = _BufferOnly()
        conn.oversized = False
        self._wait_for_request(conn, b"", time.monotonic() + self.read_timeout_s)

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        """A kept-alive connection has the start of its next request."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._wait_for_request(conn, b"", time.monotonic() + self.read_timeout_s)

    def request_reader(self, data: bytes = b"") -> RequestReader:
        """A reader of one request under this process's limits, fed ``data`` so far."""
        return RequestReader(max_body_bytes=self.max_body_bytes,
                             max_line_bytes=self.cfg.limit_request_line,
                             max_head_bytes=MAX_HEAD_BYTES, data=data)

    def _wait_for_request(self, conn: TConn, data: bytes, deadline: float) -> None:
        reader = self.request_reader(data)
        waiting = _Waiting(conn, reader, deadline)
        if data and self._judge(waiting, reader.feed()):
            return
        self.waiting[conn.sock.fileno()] = waiting
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._readable, waiting))

    def _readable(self, waiting: _Waiting, sock: socket.socket) -> None:
        data = _recv(sock)
        if data is None:
            return  # a spurious wake-up
        reader = waiting.reader
        if reader is None:  # draining before close
            waiting.drain_left -= len(data)
            if not data or waiting.drain_left <= 0:
                self._forget(waiting)
                self._close(waiting.conn)
        elif not data:  # the client went away mid-request
            self._forget(waiting)
            self._close(waiting.conn)
        else:
            verdict = reader.feed(data)
            if verdict is not Verdict.MORE:
                # Out of the poller before acting: a refusal registers the same socket
                # again, to drain it.
                self._forget(waiting)
            self._judge(waiting, verdict)

    def _judge(self, waiting: _Waiting, verdict: Verdict | Refusal) -> bool:
        """Act on a verdict; True when the connection left the event loop's reading."""
        conn, reader = waiting.conn, waiting.reader
        assert reader is not None
        if isinstance(verdict, RunstileError):
            self._refuse(conn, verdict)
            return True
        if verdict is Verdict.MORE:
            if reader.expects_continue and not waiting.continued and not reader.body_started:
                # The client waits for a go-ahead before it sends a body within the limit.
                waiting.continued = True
                _send_quietly(conn.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
            return False
        conn.oversized = verdict is Verdict.OVERSIZED
        conn.parser.unreader.unread(bytes(reader.buffer))
        conn.data_ready = True
        self.enqueue_req(conn)
        return True

    def _refuse(self, conn: TConn, error: RunstileError) -> None:
        self.log.warning("refused a request from %s: %s", conn.client[0], error.message)
        _send_quietly(conn.sock, error_bytes(error))
        self._linger(conn, CLOSE_LINGER_S, RECV_BYTES)

    def murder_pending(self) -> None:
        """Every second: past its deadline, a request still arriving gets a 408, an idle
        connection or a drain is closed; a stopping worker closes idle ones at once."""
        super().murder_pending()  # gunicorn's own pending list, empty: nothing defers
        now = time.monotonic()
        for waiting in list(self.waiting.values()):
            reader = waiting.reader
            started = reader is not None and bool(reader.buffer.strip(b"\r\n"))
            if waiting.deadline > now and (self.alive or started or reader is None):
                continue
            self._forget(waiting)
            if started:
                self._refuse(waiting.conn, RequestTimeout(
                    f"the request did not arrive whole within {self.read_timeout_s:g} s"))
            else:
                self._close(waiting.conn)

    # -- after a request thread is done ----------------------------------------------

    def handle_request(self, req: Request, conn: TConn) -> bool:
        """In a request thread, with the whole request (or the head of an oversized one)."""
        _serving.oversized = conn.oversized
        if conn.oversized:
            # The rest of the body is still arriving: the answer says "Connection: close",
            # so the client does not send its next request on this connection.
            req.force_close()
        return cast(bool, super().handle_request(req, conn))

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        # A body over the limit is still arriving: the connection cannot carry another
        # request, and the rest is drained by the event loop, not by this thread.
        return False if conn.oversized else cast(bool, super()._keepalive_after(conn, keepalive))

    def finish_request(self, conn: TConn, fs: Future[Any]) -> None:
        """In the event loop: keep the connection for its next request, or close it."""
        try:
            keep = bool(fs.result()) if not fs.cancelled() else False
        except Exception:
            # gunicorn's handle() answers every error itself; one escaping it is a bug.
            self.log.exception("a request thread failed; closing its connection")
            keep = False
        if keep:
            pending = conn.parser.unreader.take_buffered()
            if pending:  # the client pipelined its next request, or it is still arriving
                conn.sock.setblocking(False)  # the loop reads only what select reported
                self._wait_for_request(conn, pending, time.monotonic() + self.read_timeout_s)
                return
            conn.oversized = False
            super().finish_request(conn, fs)  # gunicorn's keep-alive bookkeeping
            return
        budget = DRAIN_LIMIT_FACTOR * self.max_body_bytes if conn.oversized else RECV_BYTES
        self._linger(conn, self.read_timeout_s if conn.oversized else CLOSE_LINGER_S, budget)

    # -- closing ---------------------------------------------------------------------

    def _linger(self, conn: TConn, seconds: float, drain_bytes: int) -> None:
        """Half-close, then drop what the client still sends until it closes, ``seconds``
        pass or ``drain_bytes`` were dropped: closing with unread bytes would reset the
        connection and destroy the answer before the client read it."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        waiting = _Waiting(conn, None, time.monotonic() + seconds, max(drain_bytes, 1))
        self.waiting[conn.sock.fileno()] = waiting
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._readable, waiting))

    def _forget(self, waiting: _Waiting) -> None:
        self.waiting.pop(waiting.conn.sock.fileno(), None)
        try:
            self.poller.unregister(waiting.conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, conn: TConn) -> None:
        self.nr_conns -= 1
        conn.close()

    def handle_error(self, req: Request | None, client: socket.socket,
                     addr: tuple[str, int] | str | None, exc: BaseException) -> None:
        """Requests gunicorn's parser refuses, in runstile's error shape (not HTML)."""
        error_cls = _refusal_for(exc)
        if error_cls is None:
            self.log.exception("error handling a request")
            _send_quietly(client, error_bytes(RunstileError(
                "an unexpected error occurred; it has been logged")))
            return
        self.log.warning("refused a request from %s: %s", (addr or ("",))[0], exc)
        _send_quietly(client, error_bytes(error_cls(_describe(exc))))


def _refusal_for(exc: BaseException) -> type[RunstileError] | None:
    """The runstile error a parser refusal is answered with; None if it is no refusal."""
    if (isinstance(exc, http_errors.InvalidHeader)
            and getattr(exc, "hdr", None) == _H1C_UNKNOWN_CODING):
        return UnsupportedTransferCoding
    for cls, error_cls in _PARSER_ERRORS:
        if isinstance(exc, cls):
            return error_cls
    return None


def _describe(exc: BaseException) -> str:
    """A parser error as a client can use it, without echoing raw bytes back at length."""
    text = str(exc) or type(exc).__name__
    return f"the server could not parse the request: {text[:200]}"


def _recv(sock: socket.socket) -> bytes | None:
    """Up to RECV_BYTES, b'' at the end of the stream (or a reset), None if none ready."""
    try:
        return sock.recv(RECV_BYTES)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Best effort: a client that stopped reading forfeits the answer, not a thread."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass


def _mark_oversized(app: WSGIApplication) -> WSGIApplication:
    """Tell the application (web/auth.py) that this request's body was not buffered
    because it is over the limit: it answers 413 once the key is known."""
    def wsgi(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ["runstile.body_over_limit"] = getattr(_serving, "oversized", False)
        return app(environ, start_response)
    return wsgi

