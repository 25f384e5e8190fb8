"""SIGINT and SIGTERM as a stop request, with handlers that cannot deadlock.

A Python signal handler runs in the main thread between two bytecodes, wherever that
thread is: possibly inside ``threading.Event.wait()``, holding the Event's
non-reentrant lock.  A handler calling ``Event.set()`` there waits for itself forever
(``runstile up`` hung ~35 s on Ctrl-C, until the supervisor SIGKILLed the worker, when
SIGINT and the supervisor's SIGTERM arrived a moment apart).  Worse, the kernel may
deliver the signal to another thread, and then a main thread blocked on a lock never
even runs the handler.

So the handler only stores the signal number (an attribute store takes no lock), and
Python's C-level handler writes the number to a pipe (``signal.set_wakeup_fd``) from
whichever thread received it.  The main thread waits on that pipe with ``select`` and
a timeout, never on a lock.  See docs/operations.md, "Signals".
"""

from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installs the handlers (main thread only) and tells whether a stop was asked."""

    def __init__(self, signums: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signums = frozenset(signums)
        #: The last stop signal received, 0 before any.
        self.received = 0
        self._read, self._write = os.pipe()  # not inherited by children
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        # Nothing else here: see the module docstring.
        self.received = signum

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a stop signal; True once one has arrived."""
        if not self.received:
            select.select([self._read], [], [], timeout_s)
            self._drain()
        return bool(self.received)

    def _drain(self) -> None:
        # The pipe holds the numbers of the signals received; reading them here counts
        # a stop even if the Python-level handler has not run yet.
        try:
            numbers = os.read(self._read, 4096)
        except BlockingIOError:
            return
        for number in numbers:
            if number in self.signums:
                self.received = number
