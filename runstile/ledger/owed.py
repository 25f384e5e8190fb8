"""What a commit owes the world outside the ledger (docs/architecture.md, "What a commit owes").

Some transitions cannot finish their job inside their transaction: with Redis or
RabbitMQ, a run they made claimable (a re-queue, a session's next run, a run handed a
freed profile slot) has a dispatch record that must be *published* after the commit; and
an event that creates a delivery obligation (a run ending with a ``callback_url``, a
pause, an approval request, ``ctx.deliver``, a person re-arming a delivery) leaves a
deliverer message to send.  Instead of each caller remembering which of these its
transition may have caused, the ledger writes down what the transaction owes, here, as it
writes the rows; the transaction helper (``ledger/db.py``) hands it, after COMMIT, to the
one ``after_commit`` its connection was opened with (``dispatch.Dispatcher``).

A transaction that rolls back owes nothing: what it wrote down goes with it (savepoints
too).  A connection opened without ``after_commit`` (a test, an operator's shell, the
admission writer, whose web process publishes its own record) drops what it owed: the
rows are committed unsent, and recovery sends them (docs/operations.md, "Recovery").
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field


@dataclass
class Owed:
    """What the committed transactions of one connection owe, in the order written."""

    #: ``(dispatch id, run id, delay in seconds, run priority, run queue)`` of dispatch
    #: records written unsent: a publisher sends each after the commit (Redis, RabbitMQ).
    publish: list[tuple[int, str, float, int, str]] = field(default_factory=list)
    #: Runs whose transaction may have created a delivery obligation: a deliverer
    #: message is owed for each pending one (a run listed twice is sent once).
    deliveries: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.publish or self.deliveries)

    def mark(self) -> tuple[int, int]:
        """Where a savepoint starts: what it adds can be taken back (:meth:`undo`)."""
        return len(self.publish), len(self.deliveries)

    def undo(self, mark: tuple[int, int]) -> None:
        del self.publish[mark[0]:]
        del self.deliveries[mark[1]:]

    def take(self) -> Owed:
        """Everything written down so far; this one is left empty."""
        taken = Owed(self.publish, self.deliveries)
        self.publish, self.deliveries = [], []
        return taken


def owe_publish(conn: sqlite3.Connection, dispatch_id: int, run_id: str,
                delay_s: float = 0.0, priority: int = 5, queue: str = "default") -> None:
    """The transaction in progress wrote dispatch record ``dispatch_id`` unsent (of a run
    of ``priority`` on ``queue``, which its message carries and goes to)."""
    owed: Owed | None = getattr(conn, "owed", None)  # a ledger connection, either engine
    if owed is not None:
        owed.publish.append((dispatch_id, run_id, delay_s, priority, queue))


def owe_deliveries(conn: sqlite3.Connection, run_id: str) -> None:
    """The transaction in progress may have created an obligation of ``run_id``."""
    owed: Owed | None = getattr(conn, "owed", None)
    if owed is not None:
        owed.deliveries.append(run_id)
