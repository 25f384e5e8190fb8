"""RunContext: what a task body sees (docs/tasks.md, "RunContext"), and the interrupts
that unwind a body (docs/tasks.md, "Interrupts").

Every journaled call (``step``, ``emit``, ``deliver``, ``request_approval``) takes the next call position; when a body runs
again for the same run, a position already in the journal is replayed from it instead
of being repeated.  Interrupts derive from BaseException so that a task's own
``except Exception`` cannot swallow a stop, a lost lease or a time limit.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable
from typing import Any, cast

import rfc8785

from ..errors import (
    InvalidCallbackUrl,
    LeaseLost,
    ReplayUndecided,
    RunstileError,
    RunStopping,
)
from ..jsondepth import MAX_DEPTH, text_too_deep
from ..ledger import approvals, execution, journal
from ..ledger.execution import Owner
from ..ledger.runs import Enqueue
from ..netguard import callback_refusal

#: Largest event payload a task may emit, in bytes of JSON (docs/tasks.md,
#: "ctx.emit(type, data=None)").
MAX_EVENT_DATA_BYTES = 64 * 1024
#: Event type prefixes only runstile writes (``run.progress`` excepted).
RESERVED_PREFIXES = ("run.", "approval.", "delivery.")


class Interrupt(BaseException):
    """Raised inside a task body to unwind it; never catch it in task code."""


class Stopped(Interrupt):
    """Raised by ``checkpoint``/``emit``/``step`` when a stop was requested for the run."""


class LeaseLostInterrupt(Interrupt):
    """Raised when this worker no longer owns the run: it must not touch it again."""


class TimeLimitInterrupt(Interrupt):
    """Raised when the task's time_limit_s passed; the run has already failed."""


class PausedInterrupt(Interrupt):
    """Raised after the run was paused (nondeterministic replay): the body must stop."""


class ApprovalParked(Interrupt):
    """Raised after request_approval parked the run: the body stops; the decision
    re-queues the run and the body runs again, finding the decision in its journal."""


class InvalidEvent(RunstileError):
    """Raised when a task emits a reserved, malformed or oversized event."""

    code = "invalid_event"


class ResultTooDeep(RunstileError):
    """Raised when a task's or a step's result nests deeper than 64 levels (docs/api.md
    "JSON depth"): stored, it would break reading the run."""

    code = "result_too_deep"


def encode_json(value: Any) -> str | None:
    """``value`` as compact JSON, or None when it nests deeper than MAX_DEPTH (json.dumps
    raises RecursionError long before a deep value's size would be refused).  Values
    that are not JSON raise TypeError or ValueError, as json.dumps does."""
    try:
        encoded = json.dumps(value, separators=(",", ":"))
    except RecursionError:
        return None
    return None if text_too_deep(encoded) else encoded


def _payload_json(value: Any, what: str, max_bytes: int) -> str:
    """What a task hands runstile to store (event data, a delivery payload, approval
    details) as compact JSON; InvalidEvent naming ``what`` if it is not JSON, nests
    deeper than MAX_DEPTH or is larger than ``max_bytes``."""
    try:
        encoded = encode_json(value)
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"{what} must be JSON: {exc}") from None
    if encoded is None:
        raise InvalidEvent(f"{what} must nest at most {MAX_DEPTH} levels of arrays and "
                           "objects")
    if len(encoded.encode()) > max_bytes:
        raise InvalidEvent(f"{what} must be at most {max_bytes} bytes of JSON")
    return encoded


def args_hash(*parts: Any) -> str:
    """A stable hash of a journaled call's arguments (JCS when possible, else repr)."""
    try:
        canonical = rfc8785.dumps(list(parts))
    except (rfc8785.CanonicalizationError, ValueError, TypeError):
        canonical = repr(parts).encode("utf-8", "backslashreplace")
    return hashlib.sha256(canonical).hexdigest()


class RunContext:
    """The handle a task body gets: identity of the run plus journaled operations."""

    def __init__(self, run: dict, owner: Owner, conn: sqlite3.Connection, *,
                 stop_requested: Callable[[], bool] = lambda: False,
                 lease_lost: Callable[[], bool] = lambda: False,
                 on_step_started: Callable[[], None] = lambda: None,
                 enqueue: Enqueue | None = None, allowlist: tuple[str, ...] = (),
                 max_payload_bytes: int = 1024 * 1024) -> None:
        self.run_id: str = run["id"]
        self.attempt: int = run["attempt"]
        self.session_key: str | None = run["session_key"]
        self.trigger_id: str | None = run["trigger_id"]
        self.metadata: dict = json.loads(run["metadata"]) if run["metadata"] else {}
        self._owner = owner
        self._conn = conn
        self._stop_requested = stop_requested
        self._lease_lost = lease_lost
        self._on_step_started = on_step_started
        self._enqueue = enqueue
        self._allowlist = allowlist
        self._max_payload_bytes = max_payload_bytes
        #: The run's journal by position, read at the first journaled call (``_journal``):
        #: only this owner writes it while the lease is its, so a later read sees what
        #: a read at the start would have seen, and a body that journals nothing (most
        #: runs of most tasks) costs the ledger no read at all.
        self._entries: dict[int, journal.Entry] | None = None
        self._position = 0

    @property
    def _journal(self) -> dict[int, journal.Entry]:
        if self._entries is None:
            self._entries = journal.entries(self._conn, self.run_id)
        return self._entries

    # ------------------------------------------------------------ state

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested()

    def checkpoint(self) -> None:
        """Raise Stopped if a stop is pending (and unwind if the lease was lost).

        Asks the ledger (one short read), so a stop is seen at once, not at the next
        heartbeat."""
        if self._lease_lost():
            raise LeaseLostInterrupt(self.run_id)
        if self._stop_requested() or execution.is_stopping(self._conn, self.run_id):
            raise Stopped(self.run_id)

    def _next_position(self) -> int:
        self._position += 1
        return self._position

    def _replay_mismatch(self, position: int, entry: journal.Entry, kind: str, name: str) -> None:
        """The body asked for something other than what the journal recorded here: the
        body is not deterministic, so replaying further would be guessing.  Pause."""
        reason = "nondeterministic_replay"
        paused = execution.pause(self._conn, self.run_id, self._owner, reason,
                                 enqueue=self._enqueue)
        if paused is None:
            raise LeaseLostInterrupt(self.run_id)
        raise PausedInterrupt(f"position {position}: journal has {entry.kind} {entry.name!r}, "
                              f"body asked for {kind} {name!r}")

    # ------------------------------------------------------------ emit

    def emit(self, type: str, data: Any = None) -> None:
        """Append a durable event to the run (replayed, not repeated, on a re-run)."""
        if not isinstance(type, str) or not 1 <= len(type) <= 128:
            raise InvalidEvent("an event type is a string of 1-128 characters")
        if type.startswith(RESERVED_PREFIXES) and type != "run.progress":
            raise InvalidEvent(f"event type {type!r} uses a reserved prefix "
                               f"({', '.join(RESERVED_PREFIXES)}; run.progress is allowed)")
        encoded = _payload_json({} if data is None else data, "event data",
                                MAX_EVENT_DATA_BYTES)
        self.checkpoint()
        position = self._next_position()
        digest = args_hash(type, json.loads(encoded))
        entry = self._journal.get(position)
        if entry is not None:
            if (entry.kind, entry.name, entry.args_hash) != ("emit", type, digest):
                self._replay_mismatch(position, entry, "emit", type)
            return  # already recorded by an earlier execution of this body
        try:
            journal.record_emit(self._conn, self.run_id, self._owner, position=position,
                                type_=type, data=json.loads(encoded), args_hash=digest)
        except LeaseLost:
            raise LeaseLostInterrupt(self.run_id) from None
        except RunStopping:
            raise Stopped(self.run_id) from None

    # ------------------------------------------------------------ deliver

    def deliver(self, url: str, payload: Any) -> str:
        """Promise to POST ``payload`` to ``url`` (docs/tasks.md, "Deliveries"): a durable
        obligation, signed and retried until delivered or parked, even if this process
        dies right after.
        Returns its delivery id (the ``webhook-id``).  On a re-run body the call is
        replayed from the journal: the same id, no second obligation."""
        if not isinstance(url, str):
            raise InvalidCallbackUrl("deliver() needs the URL as a string")
        refusal = callback_refusal(url, self._allowlist)
        if refusal is not None:
            raise InvalidCallbackUrl(refusal)
        encoded = _payload_json(payload, "a delivery payload", self._max_payload_bytes)
        self.checkpoint()
        position = self._next_position()
        digest = args_hash("deliver", url, json.loads(encoded))
        entry = self._journal.get(position)
        if entry is not None:
            if (entry.kind, entry.args_hash) != ("deliver", digest):
                self._replay_mismatch(position, entry, "deliver", url)
            return json.loads(cast(str, entry.result))  # recorded with its delivery id
        try:
            delivery_id = journal.record_deliver(self._conn, self.run_id, self._owner,
                                                 position=position, url=url,
                                                 payload_json=encoded, args_hash=digest)
        except LeaseLost:
            raise LeaseLostInterrupt(self.run_id) from None
        except RunStopping:
            raise Stopped(self.run_id) from None
        # Its commit owed a deliverer message, already sent (ledger/owed.py).
        return delivery_id

    # ------------------------------------------------------------ approvals

    def request_approval(self, details: Any = None) -> bool:
        """Ask a person (docs/tasks.md, "RunContext").  The first time, the run parks in
        ``waiting_for_approval`` and the body stops here; after the decision the body
        runs again and this call returns True (approve) or False (deny)."""
        encoded = _payload_json(details, "approval details", MAX_EVENT_DATA_BYTES)
        self.checkpoint()
        position = self._next_position()
        digest = args_hash("request_approval", json.loads(encoded))
        entry = self._journal.get(position)
        if entry is not None:
            if (entry.kind, entry.args_hash) != ("approval", digest):
                self._replay_mismatch(position, entry, "approval", "request_approval")
            decision = json.loads(entry.result or "{}").get("decision")
            if decision is None:
                raise ReplayUndecided("the run was re-queued while its approval is undecided")
            return decision == "approve"
        parked = approvals.request(self._conn, self.run_id, self._owner, position=position,
                                   args_hash=digest, details=json.loads(encoded),
                                   enqueue=self._enqueue)
        if parked is None:
            raise LeaseLostInterrupt(self.run_id)
        raise ApprovalParked(parked["approval_id"])

    # ------------------------------------------------------------ step

    def step(self, name: str, fn: Callable, *args: Any, idempotent: bool = False,
             **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once per run, journaled; return its JSON result.

        Matched by name and call order on a re-run: a completed step returns its
        recorded result without running; different arguments pause the run
        (nondeterministic_replay).
        """
        if not isinstance(name, str) or not 1 <= len(name) <= 128:
            raise ValueError("a step name is a string of 1-128 characters")
        self.checkpoint()
        position = self._next_position()
        digest = args_hash(name, list(args), kwargs)
        entry = self._journal.get(position)
        if entry is not None:
            if (entry.kind, entry.name, entry.args_hash) != ("step", name, digest):
                self._replay_mismatch(position, entry, "step", name)
            if entry.state == "completed":
                return json.loads(cast(str, entry.result))  # completed with its result
        self._start_step(position, name, digest, idempotent=idempotent,
                         restart=entry is not None)
        try:
            result = fn(*args, **kwargs)
            result_json = encode_json(result)
        except Interrupt:
            raise  # the step's outcome is unknown: its row stays 'started'
        except (TypeError, ValueError) as exc:
            if "JSON serializable" in str(exc) or "Circular reference" in str(exc):
                self._settle(position, "failed", {"error": f"step result is not JSON: {exc}"})
                raise TypeError(f"step {name!r} returned a value that is not JSON: {exc}") from None
            self._settle(position, "failed", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        except Exception as exc:
            self._settle(position, "failed", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        if result_json is None:
            too_deep = f"step {name!r} returned a value nested deeper than {MAX_DEPTH} levels"
            self._settle(position, "failed", {"error": too_deep})
            raise ResultTooDeep(too_deep)
        if not journal.settle_step(self._conn, self.run_id, self._owner, position=position,
                                   state="completed", result_json=result_json):
            raise LeaseLostInterrupt(self.run_id)
        return json.loads(result_json)

    def _start_step(self, position: int, name: str, digest: str, *, idempotent: bool,
                    restart: bool) -> None:
        try:
            # Fenced on the lease: a worker that lost the run cannot start a step.
            journal.start_step(self._conn, self.run_id, self._owner, position=position,
                               name=name, args_hash=digest, idempotent=idempotent,
                               restart=restart)
        except LeaseLost:
            raise LeaseLostInterrupt(self.run_id) from None
        except RunStopping:
            raise Stopped(self.run_id) from None
        self._on_step_started()

    def _settle(self, position: int, state: str, detail: dict) -> None:
        journal.settle_step(self._conn, self.run_id, self._owner, position=position,
                            state=state, result_json=json.dumps(detail))
