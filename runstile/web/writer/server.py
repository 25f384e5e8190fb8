"""The admission writer process's loop: accept web processes, commit their admissions.

Started by the supervisor (``supervisor.py``, in the ``serve`` process) as ``python -c
ENTRY PATH FD``, which calls :func:`main`; nothing else imports this module.  One thread:
it wakes when anything arrived, decodes every complete request from every web process
(``codec.py``), settles them as one batch (``group_commit.Batches``, the same code as a
web process's committer thread, so the same ``reserve_many``, refusals and per-unit
retry), and answers each.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import selectors
import signal
import socket
import sqlite3
import sys

from ... import crashpoints, dispatch, logs
from ...config import Settings
from ...errors import AdmissionWriterFailed
from ...ledger import db, group_commit
from .codec import LENGTH, decode_request, encode_outcome, frame, kernel_timeouts, max_frame

log = logging.getLogger("runstile.writer")

#: Seconds the writer waits in select() before re-checking its stop flag.
_TICK_S = 0.5
#: A batch this small lingers (RUNSTILE_ADMISSION_LINGER_MS); a larger one commits at once.
LINGER_BELOW = 8
#: Seconds a send to a web thread may block (answers carry a run; the thread reads at once).
_SEND_TIMEOUT_S = 10.0
#: Bytes read from a connection per wake-up.
_READ_BYTES = 256 * 1024


def _never_run(conn: sqlite3.Connection) -> None:
    """The work of a unit that failed before it had any: settling skips it."""
    raise AdmissionWriterFailed("an unreadable admission request is never committed")


class _Connection:
    """One web thread's connection, and the bytes of a frame not yet whole."""

    __slots__ = ("sock", "buffer")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()


def main() -> int:
    """``python -c ENTRY PATH FD``: settings arrive pickled on stdin from
    the ``serve`` process (the same object its web processes use); FD is the lifeline."""
    settings = pickle.load(sys.stdin.buffer)
    logs.configure(settings.log_format, node=settings.node_id, level=logging.WARNING,
                   text_format="%(asctime)s %(levelname)s [writer] %(message)s")
    lifeline = socket.socket(fileno=int(sys.argv[2]))
    return serve(settings, sys.argv[1], lifeline)


def serve(settings: Settings, path: str, lifeline: socket.socket) -> int:
    """Accept web processes on ``path`` and commit their admissions, a batch per wake-up,
    until SIGTERM or until ``lifeline`` closes (the ``serve`` process is gone)."""
    writer = _Writer(settings, lifeline)
    # Before anything is opened: from here on a SIGTERM ends the writer cleanly, and it
    # tells serve it was asked to stop (b"s" on the lifeline) rather than dying mute.
    signal.signal(signal.SIGTERM, writer.stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops serve, which stops us
    writer.open(path)
    writer.run()
    return 0


class _Writer:
    """The loop of :func:`serve` and what it holds: the listening socket, the lifeline,
    the selector over both and every web connection, and the batch committer."""

    def __init__(self, settings: Settings, lifeline: socket.socket) -> None:
        self.settings = settings
        self.lifeline = lifeline
        self.stopping = False

    def open(self, path: str) -> None:
        """Everything the loop needs, and the socket web processes connect to."""
        settings = self.settings
        self.limit = max_frame(settings)
        self.scratch = bytearray(_READ_BYTES)  # every read lands here first (_read)
        self.scratch_view = memoryview(self.scratch)
        self.enqueue = dispatch.Dispatcher(settings).in_transaction
        self.batches = group_commit.Batches(lambda: db.connect(
            settings.ledger_target, synchronous=settings.synchronous,
            busy_timeout_ms=settings.busy_timeout_ms))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead writer's socket file: bind() cannot reuse it
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1024)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")
        self.selector.register(self.lifeline, selectors.EVENT_READ, "lifeline")

    def stop(self, signum: int | None = None, _frame: object = None) -> None:
        """SIGTERM: finish the batch in hand, then leave the loop."""
        self.stopping = True

    def run(self) -> None:
        self.lifeline.sendall(b"r")  # listening: serve may start the web processes
        linger_s = self.settings.admission_linger_ms / 1000
        while not self.stopping:
            batch = self._gather(_TICK_S)
            if not batch:
                continue
            if linger_s and len(batch) < LINGER_BELOW:
                # A small batch waits once, briefly, for the requests on their way: fewer
                # commits under load, at most linger_s more latency (RUNSTILE_ADMISSION_LINGER_MS).
                batch += self._gather(linger_s)
            # Everything that arrived since the last commit shares one transaction, and
            # so does what arrives while this one waits for the write lock (_top_up).
            self.batches.settle([unit for _, unit in batch if unit.error is None],
                                functools.partial(self._top_up, batch))
            crashpoints.hit(self.settings, "writer_after_commit")
            self._answer(batch)
        self.batches.close()
        self.listener.close()
        with contextlib.suppress(OSError):
            self.lifeline.sendall(b"s")  # a requested stop, not a crash (supervisor.py)

    def _gather(self, timeout_s: float) -> list[tuple[_Connection, group_commit.Unit]]:
        """The requests that arrived by the next wake-up (at most ``timeout_s`` away)."""
        batch: list[tuple[_Connection, group_commit.Unit]] = []
        for key, _ in self.selector.select(timeout_s):
            if key.data == "listener":
                self._accept()
            elif key.data == "lifeline":
                if not self.lifeline.recv(1):
                    self.stopping = True  # EOF: serve is gone
            else:
                self._read(key.data, batch)
        return batch

    def _top_up(self, batch: list[tuple[_Connection, group_commit.Unit]],
                _room: int) -> list[group_commit.Unit]:
        """The requests already here, added to ``batch`` (so that they are answered with
        it); their units, for the transaction that now holds the write lock.  All of
        them, as a gather takes all (the committer's ``room`` bound is not the writer's):
        a connection has at most one request outstanding, so the web threads bound it."""
        arrived = self._gather(0)
        batch += arrived
        return [unit for _, unit in arrived if unit.error is None]

    def _answer(self, batch: list[tuple[_Connection, group_commit.Unit]]) -> None:
        for conn, unit in batch:
            try:
                conn.sock.sendall(frame(encode_outcome(unit)))
            except OSError:
                # The web thread gave up (timeout) or its process died: it answered 503
                # or nothing, and a retry replays what committed here.
                self._close(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            # Blocking sends with a deadline (answers carry a run; a web thread reads at
            # once), reads only when select() says there is something to read, and
            # then without waiting (_read).
            kernel_timeouts(sock, _SEND_TIMEOUT_S)
            self.selector.register(sock, selectors.EVENT_READ, _Connection(sock))

    def _read(self, conn: _Connection, batch: list[tuple[_Connection, group_commit.Unit]]) -> None:
        """Add every whole request ``conn`` sent to ``batch``; keep a partial one."""
        # Into one reused buffer: recv(n) allocates n bytes per call whatever arrives,
        # and a 256 KiB allocation is an mmap and munmap of its own (a tenth of the
        # writer's CPU under load, profiled).
        try:
            got = conn.sock.recv_into(self.scratch, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return  # a spurious wake-up: select() will say when there is something
        except OSError:
            got = 0
        if not got:
            self._close(conn)  # a partial frame left behind is never acted on
            return
        buffer = conn.buffer
        buffer += self.scratch_view[:got]
        while len(buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(buffer)
            if length > self.limit:
                log.warning("dropping a web connection that announced a %d-byte frame", length)
                self._close(conn)
                return
            end = LENGTH.size + length
            if len(buffer) < end:
                return
            payload = bytes(buffer[LENGTH.size:end])
            del buffer[:end]
            batch.append((conn, self._unit(payload)))

    def _unit(self, payload: bytes) -> group_commit.Unit:
        try:
            return group_commit.Unit(decode_request(payload, self.enqueue))
        except (ValueError, TypeError) as exc:
            # Answered with the batch, never committed (settle skips units with errors).
            unit = group_commit.Unit(_never_run)
            unit.error = RuntimeError(f"unreadable admission request: {exc}")
            return unit

    def _close(self, conn: _Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
