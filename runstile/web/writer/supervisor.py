"""The admission writer's supervisor: :class:`WriterProcess`, a thread in the ``serve``
process (``web/server.py`` ``run_gunicorn``) that starts the writer beside gunicorn,
restarts it when it dies and stops it at the end.

A socket pair is the lifeline both ways: ``serve`` sees EOF when the writer dies, and the
writer sees EOF when ``serve`` dies and exits.  On it the writer says ``r`` once it
listens and ``s`` when it stops because it was asked to (SIGTERM) rather than crashed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

from ...config import Settings

log = logging.getLogger("runstile.writer")

#: Seconds ``serve`` waits for a new writer to listen before going on without it.
_READY_S = 10.0
#: Restart delays after the writer died (seconds), the last one repeated.
_RESTART_S = (0.2, 0.5, 1.0, 2.0, 5.0)
#: The least delay after the writer stopped because it was asked to (SIGTERM).
_STOPPED_S = 2.0
#: Seconds to wait for a writer to be reaped once it is gone or killed.
_REAP_S = 5.0
#: Seconds a writer asked to stop (SIGTERM) may take before it is killed.
_STOP_S = 10.0

#: The writer's command line: ``python -P -c ENTRY PATH FD`` (tests read PATH, the word
#: after ENTRY, from /proc/PID/cmdline, and know the writer by the module named here).
#: ``-P``: without it ``-c`` puts the working directory first on sys.path, and a
#: ``runstile/`` folder there (a checkout of another version) would be the writer's
#: runstile while the web processes run the installed one; the two speak one wire
#: format only when they are the same code (codec.py).
ENTRY = "import sys; from runstile.web.writer.server import main; sys.exit(main())"


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
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline: socket.socket | None = None
        self._watcher: threading.Thread | None = None
        #: The ``serve`` process.  gunicorn forks the web processes from inside
        #: run_gunicorn and a web process leaves by sys.exit, so the ``finally`` that
        #: calls stop() runs in every web process that exits too (a graceful restart, a
        #: SIGTERM to the group); only serve may stop the writer and remove its socket.
        self._owner = os.getpid()

    def start(self) -> None:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="runstile-writer-watch",
                                         daemon=True)
        self._watcher.start()

    def _spawn(self) -> bool:
        """Start a writer and wait until it listens; False if it did not (or if serve is
        stopping, when none is started)."""
        ours, theirs = socket.socketpair()
        with self._guard:
            if self._stopping.is_set():
                ours.close()
                theirs.close()
                return False
            proc = subprocess.Popen(
                [sys.executable, "-P", "-c", ENTRY, self.path, str(theirs.fileno())],
                stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),))
            self._proc, self._lifeline = proc, ours
        theirs.close()
        assert proc.stdin is not None  # stdin=PIPE
        try:
            proc.stdin.write(pickle.dumps(self.settings))
            proc.stdin.close()
        except OSError:
            pass  # it died at once: the ready wait below sees EOF, and _watch restarts it
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
            said = self._wait_for_exit()
            # A writer that was asked to stop (SIGTERM, say from a signal to the whole
            # process group) is most likely stopping with serve: give serve time to say
            # so before starting another.
            delay = _RESTART_S[min(restarts, len(_RESTART_S) - 1)]
            if said == b"s":
                delay = max(delay, _STOPPED_S)
            if self._stopping.wait(delay):
                return
            proc = self._proc
            assert proc is not None  # _watch starts after _spawn
            log.warning("the admission writer (pid %s) exited; restarting it (web "
                        "processes commit their own admissions meanwhile)", proc.pid)
            restarts = 0 if self._spawn() else restarts + 1

    def _wait_for_exit(self) -> bytes:
        """Block until the current writer is gone; what it said last on the lifeline."""
        lifeline, proc, said = self._lifeline, self._proc, b""
        assert lifeline is not None and proc is not None  # _watch starts after _spawn
        try:
            while chunk := lifeline.recv(1):   # EOF: the writer is gone
                said = chunk
        except OSError:
            pass  # the lifeline broke: as gone as EOF
        with contextlib.suppress(OSError):
            lifeline.close()
        try:
            proc.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            # The writer keeps its end of the lifeline open until it exits, so EOF means
            # it is exiting (stuck in the kernel, say on a hung disk) and neither listens
            # nor commits any more: a new writer may take over while it finishes dying.
            log.warning("the admission writer (pid %s) closed its lifeline but had not "
                        "exited %g s later; starting another", proc.pid, _REAP_S)
        return said

    def stop(self) -> None:
        if os.getpid() != self._owner:
            return  # a forked web process on its way out: the writer is serve's
        with self._guard:
            self._stopping.set()
            proc = self._proc
        if proc is not None:
            self._end(proc)
        if self._lifeline is not None:
            with contextlib.suppress(OSError):
                self._lifeline.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    @staticmethod
    def _end(proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM, then SIGKILL after ``_STOP_S``; gunicorn has returned, so no web
        process is left to send the writer anything."""
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(_REAP_S)
            except subprocess.TimeoutExpired:
                # Killed but not reaped (stuck in the kernel, say on a hung disk): it
                # runs no more code, and serve's exit leaves it to init to reap.
                log.warning("the admission writer (pid %s) did not exit %g s after "
                            "SIGKILL; leaving it to be reaped", proc.pid, _REAP_S)
        except ChildProcessError:
            pass
