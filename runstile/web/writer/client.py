"""The web side of the admission writer: what a web process's admissions call instead of
its own group committer.

``web/__init__.py`` (``create_app``) builds one :class:`WriterClient` per web process when
``serve`` runs a writer; ``ledger/admission.py`` ``admit`` calls its ``run`` as it would
call the group committer's.  What happens at each step of a request that fails is in the
package docstring (``web/writer/__init__.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ...errors import LedgerUnavailable
from ...ledger import admission, group_commit
from .codec import decode_outcome, encode_request, frame, kernel_timeouts, recv_frame

#: The buffer an answer is read into at first (grown for a larger one): a new run's
#: answer is a few dozen bytes, any other run's its row.
_ANSWER_BYTES = 16 * 1024


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
            sock.sendall(frame(encode_request(work)), socket.MSG_NOSIGNAL)
        except OSError:
            # Not sent whole, so never acted on (the writer ignores a partial frame).
            self._drop()
            self.on_unreachable()
            return self.local.run(work)
        return decode_outcome(self._answer(sock), work)

    def _answer(self, sock: socket.socket) -> bytes:
        """The writer's answer to the request just sent on ``sock``."""
        try:
            return recv_frame(sock, self._threads.buffer, self.max_frame)
        except (OSError, ConnectionError) as exc:
            # Sent, unanswered: it may have committed.  Never guess; a retry replays.
            self._drop()
            raise LedgerUnavailable(f"the admission writer did not answer ({exc}); the "
                                    f"run may or may not have been admitted: retry with "
                                    f"the same Idempotency-Key or run_id") from None

    def _socket(self) -> socket.socket | None:
        """This thread's connection to the writer (one outstanding request each), opened
        on first use and again in a forked child; None when the writer cannot be reached."""
        threads = self._threads
        sock: socket.socket | None = getattr(threads, "sock", None)
        if sock is not None and threads.pid == os.getpid():
            return sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            kernel_timeouts(sock, self.timeout_s)
        except OSError:
            sock.close()
            return None
        threads.sock, threads.pid = sock, os.getpid()
        threads.buffer = bytearray(_ANSWER_BYTES)
        return sock

    def _drop(self) -> None:
        sock = getattr(self._threads, "sock", None)
        self._threads.sock = None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
