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
auth, the checks of docs/api.md ("Check order") and the fingerprint; they send the
validated reservation and wait for the committed answer.

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

The modules, along those seams:

* ``codec.py`` — the wire format, on a Unix socket in a private (0700) directory: frames
  of a 4-byte big-endian length and UTF-8 JSON, a request derived from the
  ``admission.Reservation`` dataclass.  One outstanding request per connection; each
  web thread keeps its own connection.
* ``client.py`` — the web side, :class:`WriterClient` (built by ``web/__init__.py``).
* ``server.py`` — the writer process's loop.
* ``supervisor.py`` — :class:`WriterProcess`, in the ``serve`` process (``web/server.py``):
  restarts the writer when it dies; the writer exits when ``serve`` does (it watches a
  socket pair whose other end ``serve`` holds).
"""

from __future__ import annotations

from .client import WriterClient
from .codec import max_frame
from .supervisor import WriterProcess

__all__ = ["WriterClient", "WriterProcess", "max_frame"]
