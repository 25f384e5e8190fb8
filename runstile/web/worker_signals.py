"""gunicorn's threaded worker with signal handlers that only set flags.

gthread's own SIGINT/SIGQUIT handler shuts its thread pool down and raises SystemExit
from inside the handler.  A handler runs in the main thread between two bytecodes,
wherever that thread is; when the signal lands while the main thread is inside the
pool's ``submit()`` (holding the pool's lock while it starts a thread), the handler
waits for that lock forever.  Seen under Ctrl-C of ``runstile up`` (SIGINT to the whole
group, then the master's SIGQUIT): a web process hung until it was SIGKILLed.

Here the handlers set flags; gunicorn's wake-up pipe (``signal.set_wakeup_fd``, written
by Python's C-level handler from whichever thread the kernel picked) wakes the event
loop, and the main thread acts from the loop: finishing what is in flight (SIGTERM) or
leaving at once (SIGINT, SIGQUIT), as gthread does.  See docs/operations.md, "Signals".
"""

from __future__ import annotations

import os
import selectors
import sys
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # To the type checker the mixin is a gthread worker, so that what it uses of one
    # (and its super() calls) are known; at run time it derives from object only.
    from gunicorn.workers.gthread import ThreadWorker as _Worker
else:
    _Worker = object


class FlagOnlySignals(_Worker):
    """Mixin for a gthread worker class (put it first among the bases): web/gthread.py's
    ``BufferingThreadWorker`` is the one ``serve`` uses."""

    #: SIGINT or SIGQUIT arrived: leave at once (set by the handler, acted on by the loop).
    quitting = False

    def init_signals(self) -> None:
        super().init_signals()
        # The pipe gunicorn gave to signal.set_wakeup_fd: readable as soon as a signal
        # arrives, so the loop wakes at once instead of at its next timeout.
        self.poller.register(self.PIPE[0], selectors.EVENT_READ, self._woken)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # SIGTERM: finish what is in flight
        self.alive = False

    def handle_quit(self, sig: int, frame: FrameType | None) -> None:
        # SIGINT, SIGQUIT: leave now
        self.alive = False
        self.quitting = True

    def _woken(self, fileobj: int) -> None:
        # Empty the (non-blocking) pipe; the flags say what to do.
        try:
            while os.read(self.PIPE[0], 512):
                pass
        except BlockingIOError:
            pass

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        if not self.quitting:
            super().wait_for_and_dispatch_events(timeout)
        if self.quitting:
            self._quit()

    def _quit(self) -> None:
        # What gthread's handler did, from the main thread, which holds no lock here.
        self.tpool.shutdown(wait=False)
        self.cfg.worker_int(self)
        sys.exit(0)
