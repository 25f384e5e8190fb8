"""The admission writer: one process per ``serve`` that commits every web process's admissions.

Why a process of its own.  SQLite takes one writer at a time, so every admission
transaction of the node is serialised on the ledger's write lock.  Inside a web process
the thread holding that lock shares the GIL with the request threads parsing, checking
and answering: each of its SQLite calls hands the GIL away, and getting it back waits for
a busy request thread (measured with 2 web processes on 2 CPUs: ~4.4 ms of lock hold for
~1.1 ms of work per batch, the lock busy all the time, the other process polling for it).
Here one single-threaded process owns admission writes: nothing competes for its GIL, the
lock is held only for the work, and one batch gathers the admissions of *every* web
process (bigger batches, fewer fsyncs).  The web processes keep everything else: HTTP,
auth, the SPEC §3.1 checks and the fingerprint; they send the validated reservation and
wait for the committed answer.

Durability is the group commit's (ledger/group_commit.py), unchanged: a reply leaves the
writer only after the COMMIT holding it returned.

Failure handling, at each step of a request (:class:`WriterClient`):

* the writer cannot be reached (not started, restarting, the socket is gone): the web
  process commits the admission itself, as it did before the writer existed (its own
  group-commit thread).  Durable either way; only the speed differs.
* the request could not be sent whole: the writer never saw a complete frame and never
  acts on a partial one, so committing it locally cannot make a second run.
* it was sent but no answer came (the writer died, or stayed silent past the busy
  timeout): the admission may or may not have committed.  The client gets 503 with
  Retry-After, exactly as when a web process dies after a commit: a retry with the same
  Idempotency-Key or run id replays the run if it exists.

Wire format, on a Unix socket in a private (0700) directory: frames of a 4-byte
big-endian length and UTF-8 JSON.  One outstanding request per connection; each web
thread keeps its own connection.  The supervisor (:class:`WriterProcess`, in the
``serve`` process) restarts the writer when it dies; the writer exits when ``serve``
does (it watches a socket pair whose other end ``serve`` holds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import selectors
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from .. import crashpoints, dispatch, errors
from ..config import Settings
from ..errors import LedgerUnavailable, RunstileError
from ..ledger import admission, db, group_commit, runs
from ..ledger.keys import Principal

log = logging.getLogger("runstile.writer")

_LENGTH = struct.Struct(">I")
#: Frames carry one request body's input and its run (two copies of the input at most).
_FRAME_SLACK = 64 * 1024
#: Seconds the writer waits in select() before re-checking its stop flag.
_TICK_S = 0.5
#: Seconds ``serve`` waits for a new writer to listen before going on without it.
_READY_S = 10.0
#: Restart delays after the writer died (seconds), the last one repeated.
_RESTART_S = (0.2, 0.5, 1.0, 2.0, 5.0)
#: The least delay after the writer stopped because it was asked to (SIGTERM).
_STOPPED_S = 2.0


def max_frame(settings: Settings) -> int:
    return 4 * settings.max_body_bytes + _FRAME_SLACK


# ------------------------------------------------------------------ the wire format

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _error_fields(exc: RunstileError) -> list:
    return [type(exc).__name__, exc.message, exc.details]


def _error_from(fields: list) -> RunstileError:
    name, message, details = fields
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RunstileError)):
        cls = RunstileError  # a newer writer's error: still an error, with its message
    return cls(message, **details)


def encode_request(res: admission.Reservation) -> bytes:
    req = res.req
    p = req.principal
    return _dumps([
        p.profile_id, p.key_id, p.role, req.key, req.key_is_derived, req.run_id, req.task,
        req.input_json, req.session_key, req.trigger_id, req.metadata_json,
        req.callback_url, req.fingerprint, req.fingerprint_version,
        None if res.refusal is None else _error_fields(res.refusal),
        res.max_active_runs, res.enqueue is not None,
    ]).encode()


def decode_request(data: bytes, enqueue: runs.Enqueue | None) -> admission.Reservation:
    """The reservation a web process sent.  ``enqueue`` is the writer's own in-transaction
    enqueue (same settings as the web's); a request sent without one gets none."""
    (profile_id, key_id, role, key, derived, run_id, task, input_json, session_key,
     trigger_id, metadata_json, callback_url, fp, fp_version, refusal, max_active,
     wants_enqueue) = json.loads(data)
    req = admission.AdmissionRequest(
        principal=Principal(profile_id, key_id, role), key=key, key_is_derived=derived,
        run_id=run_id, task=task, input_json=input_json, session_key=session_key,
        trigger_id=trigger_id, metadata_json=metadata_json, callback_url=callback_url,
        fingerprint=fp, fingerprint_version=fp_version)
    return admission.Reservation(req, None if refusal is None else _error_from(refusal),
                                 max_active, enqueue if wants_enqueue else None)


def encode_outcome(unit: group_commit.Unit) -> bytes:
    if unit.error is None:
        admitted = unit.result
        return _dumps(["ok", admitted.run, admitted.replayed, admitted.dispatch_id]).encode()
    if isinstance(unit.error, RunstileError):
        return _dumps(["refused", *_error_fields(unit.error)]).encode()
    if isinstance(unit.error, sqlite3.IntegrityError):
        # A uniqueness race: admission.admit re-reads and answers a replay or a 409.
        return _dumps(["race", str(unit.error)]).encode()
    return _dumps(["failed", f"{type(unit.error).__name__}: {unit.error}"]).encode()


def decode_outcome(data: bytes) -> admission.Admitted:
    """The writer's answer as admission.admit would have returned or raised it."""
    outcome = json.loads(data)
    kind = outcome[0]
    if kind == "ok":
        return admission.Admitted(outcome[1], replayed=outcome[2], dispatch_id=outcome[3])
    if kind == "refused":
        raise _error_from(outcome[1:])
    if kind == "race":
        raise sqlite3.IntegrityError(outcome[1])
    raise RuntimeError(f"the admission writer failed: {outcome[1]}")


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the admission writer closed the connection")
        buf += chunk
    return bytes(buf)


# ------------------------------------------------------------------ the web side

class WriterClient:
    """What a web process's admissions call instead of its own group committer.

    ``run(work)`` sends reservations to the writer; anything else (marking a Redis or
    RabbitMQ dispatch sent) and every reservation the writer cannot take runs on
    ``local``, the process's own group committer.
    """

    def __init__(self, path: str, local: group_commit.GroupCommitter, *,
                 timeout_s: float, max_frame: int,
                 on_unreachable: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.local = local
        self.timeout_s = timeout_s
        self.max_frame = max_frame
        #: Called for each admission committed locally because the writer was unreachable.
        self.on_unreachable = on_unreachable
        self._threads = threading.local()

    def run(self, work: Any) -> Any:
        if not isinstance(work, admission.Reservation):
            return self.local.run(work)
        sock = self._socket()
        if sock is None:
            self.on_unreachable()
            return self.local.run(work)
        try:
            sock.sendall(_frame(encode_request(work)), socket.MSG_NOSIGNAL)
        except OSError:
            # Not sent whole, so never acted on (the writer ignores a partial frame).
            self._drop()
            self.on_unreachable()
            return self.local.run(work)
        try:
            (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
            if length > self.max_frame:
                raise ConnectionError(f"an answer of {length} bytes is larger than any "
                                      f"admission")
            reply = _recv_exactly(sock, length)
        except (OSError, ConnectionError) as exc:
            # Sent, unanswered: it may have committed.  Never guess; a retry replays.
            self._drop()
            raise LedgerUnavailable(f"the admission writer did not answer ({exc}); the "
                                    f"run may or may not have been admitted: retry with "
                                    f"the same Idempotency-Key or run_id") from None
        return decode_outcome(reply)

    def _socket(self) -> socket.socket | None:
        threads = self._threads
        sock = getattr(threads, "sock", None)
        if sock is not None and threads.pid == os.getpid():
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        threads.sock, threads.pid = sock, os.getpid()
        return sock

    def _drop(self) -> None:
        sock = getattr(self._threads, "sock", None)
        self._threads.sock = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


# ------------------------------------------------------------------ the writer process

class _Connection:
    __slots__ = ("sock", "buffer")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()


def serve(settings: Settings, path: str, lifeline: socket.socket) -> int:
    """Accept web processes on ``path`` and commit their admissions, a batch per wake-up,
    until SIGTERM or until ``lifeline`` closes (the ``serve`` process is gone)."""
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops serve, which stops us
    limit = max_frame(settings)
    enqueue = dispatch.in_transaction_enqueue(settings)
    batches = group_commit.Batches(lambda: db.connect(
        settings.ledger_path, synchronous=settings.synchronous,
        busy_timeout_ms=settings.busy_timeout_ms))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1024)
    listener.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    selector.register(lifeline, selectors.EVENT_READ, "lifeline")
    lifeline.sendall(b"r")  # listening: serve may start the web processes
    while not stopping:
        batch: list[tuple[_Connection, group_commit.Unit]] = []
        for key, _ in selector.select(_TICK_S):
            if key.data == "listener":
                _accept(listener, selector)
            elif key.data == "lifeline":
                if not lifeline.recv(1):
                    stopping = True
            else:
                _read(key.data, selector, batch, enqueue, limit)
        if not batch:
            continue
        # Everything that arrived since the last commit shares one transaction.
        batches.settle([unit for _, unit in batch if unit.error is None])
        crashpoints.hit(settings, "writer_after_commit")
        for conn, unit in batch:
            try:
                conn.sock.sendall(_frame(encode_outcome(unit)))
            except OSError:
                # The web thread gave up (timeout) or its process died: it answered 503
                # or nothing, and a retry replays what committed here.
                _close(conn, selector)
    batches.close()
    listener.close()
    with contextlib.suppress(OSError):
        lifeline.sendall(b"s")  # a requested stop, not a crash (see WriterProcess._watch)
    return 0


def _accept(listener: socket.socket, selector: selectors.BaseSelector) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        # Blocking sends with a deadline (answers carry a run; a web thread reads at
        # once), reads only when select() says there is something to read.
        sock.settimeout(10.0)
        selector.register(sock, selectors.EVENT_READ, _Connection(sock))


def _read(conn: _Connection, selector, batch: list, enqueue, limit: int) -> None:
    try:
        data = conn.sock.recv(256 * 1024)
    except OSError:
        data = b""
    if not data:
        _close(conn, selector)  # a partial frame left behind is never acted on
        return
    buffer = conn.buffer
    buffer += data
    while len(buffer) >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer)
        if length > limit:
            log.warning("dropping a web connection that announced a %d-byte frame", length)
            _close(conn, selector)
            return
        end = _LENGTH.size + length
        if len(buffer) < end:
            return
        payload = bytes(buffer[_LENGTH.size:end])
        del buffer[:end]
        unit = group_commit.Unit(None)
        try:
            unit.work = decode_request(payload, enqueue)
        except (ValueError, TypeError) as exc:
            # Answered with the batch, never committed (settle skips units with errors).
            unit.error = RuntimeError(f"unreadable admission request: {exc}")
        batch.append((conn, unit))


def _close(conn: _Connection, selector: selectors.BaseSelector) -> None:
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(conn.sock)
    with contextlib.suppress(OSError):
        conn.sock.close()


#: The writer's command line (``-c``, not ``-m``: this module is imported by the web
#: package's ``__init__``, and running it as ``__main__`` would import it twice).
_ENTRY = "import sys; from runstile.web.writer import main; sys.exit(main())"


def main() -> int:
    """``python -c _ENTRY PATH FD``: settings arrive pickled on stdin from
    the ``serve`` process (the same object its web processes use); FD is the lifeline."""
    settings = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s [writer] %(message)s")
    lifeline = socket.socket(fileno=int(sys.argv[2]))
    return serve(settings, sys.argv[1], lifeline)


# ------------------------------------------------------------------ the supervisor

class WriterProcess:
    """Starts the writer beside gunicorn, restarts it when it dies, stops it at the end.

    Lives in the ``serve`` process.  While no writer answers, web processes commit their
    admissions themselves (:class:`WriterClient`), so a restart costs speed, not answers.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # A private directory: only this user may connect (the socket is a write path
        # into the ledger), and the path stays short (sun_path holds ~107 bytes).
        self.directory = tempfile.mkdtemp(prefix="runstile-writer-")
        self.path = os.path.join(self.directory, "admissions.sock")
        self._stopping = threading.Event()
        #: Guards _proc against stop(): a writer is started only while not stopping, and
        #: stop() sees every writer that was started (none outlives serve).
        self._guard = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._lifeline: socket.socket | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="runstile-writer-watch",
                                         daemon=True)
        self._watcher.start()

    def _spawn(self) -> bool:
        ours, theirs = socket.socketpair()
        with self._guard:
            if self._stopping.is_set():
                ours.close()
                theirs.close()
                return False
            proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, self.path, str(theirs.fileno())],
                stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),))
            self._proc, self._lifeline = proc, ours
        theirs.close()
        try:
            proc.stdin.write(pickle.dumps(self.settings))
            proc.stdin.close()
        except OSError:
            pass
        ours.settimeout(_READY_S)
        try:
            ready = ours.recv(1) == b"r"
        except OSError:
            ready = False
        ours.settimeout(None)
        if not ready and not self._stopping.is_set():
            log.warning("the admission writer did not start; web processes commit their "
                        "own admissions until it does")
        return ready

    def _watch(self) -> None:
        restarts = 0
        while not self._stopping.is_set():
            lifeline, said = self._lifeline, b""
            try:
                while chunk := lifeline.recv(1):   # EOF: the writer is gone
                    said = chunk
            except OSError:
                pass
            with contextlib.suppress(OSError):
                lifeline.close()
            with contextlib.suppress(Exception):
                self._proc.wait(5)
            # A writer that was asked to stop (SIGTERM, say from a signal to the whole
            # process group) is most likely stopping with serve: give serve time to say
            # so before starting another.
            delay = _RESTART_S[min(restarts, len(_RESTART_S) - 1)]
            if said == b"s":
                delay = max(delay, _STOPPED_S)
            if self._stopping.wait(delay):
                return
            log.warning("the admission writer (pid %s) exited; restarting it (web "
                        "processes commit their own admissions meanwhile)", self._proc.pid)
            restarts = 0 if self._spawn() else restarts + 1

    def stop(self) -> None:
        with self._guard:
            self._stopping.set()
            proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(5)
            except ChildProcessError:
                pass
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                self._lifeline.close()
        shutil.rmtree(self.directory, ignore_errors=True)

