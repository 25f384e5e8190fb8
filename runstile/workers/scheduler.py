"""The scheduler (docs/architecture.md, "The scheduler"): admits each declared schedule's
ticks as ordinary runs, beside every node's scheduled recovery.

Every node runs one, in its supervisor (``runstile up`` and ``runstile worker``), started
once the boot's recovery has opened the barrier.  Several racing for one tick is the
normal case, not a fault: each admits the tick through admission's own reservation under
the key ``schedule:<name>:<tick>`` (ledger/schedules.py), and the key's uniqueness lets one
admission create the run; the others are replays and admit nothing.  No lock is taken
beyond the ledger's write transaction.

Quiet and cheap: the thread sleeps until the next tick of any schedule (at most
``MAX_SLEEP_S``), then reads the schedules table once and admits what is due.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import replace

from .. import dispatch, ticks
from ..config import Settings
from ..errors import ConfigError, RunstileError
from ..fingerprint import FINGERPRINT_VERSION, NotCanonicalisable, fields_for, fingerprint
from ..ledger import schedules as ledger
from ..ledger.admission import AdmissionRequest, Reservation
from ..ledger.keys import Principal, schedule_key_id
from ..tasks import ScheduleSpec, queue_of

log = logging.getLogger("runstile.scheduler")

#: The most ticks of one schedule admitted at once: a catch-up under ``catchup="all"``
#: admits at most this many, the most recent, oldest first (docs/tasks.md, "Catch-up").
MAX_CATCHUP = 100
#: The longest the scheduler sleeps between two looks at the ledger, whatever the ticks.
MAX_SLEEP_S = 60.0
#: Seconds past a tick before the scheduler looks: its wake-up is never early.
WAKE_SLACK_S = 0.005
#: Seconds before a wake-up after a failed pass (ledger busy, profile full).
RETRY_S = 1.0
#: JSON as admission stores it: no spaces, UTF-8 as is.
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def template(spec: ScheduleSpec) -> AdmissionRequest:
    """The admission of ``spec``'s runs, without its tick's key: the body a client would
    send ({"task", "input", "metadata": {"schedule": name}}), fingerprinted as any."""
    metadata = {"schedule": spec.name}
    fields = {"task": spec.task, "input": spec.input, "run_id": None, "session_key": None,
              "trigger_id": None, "callback_url": None, "metadata": metadata}
    try:
        digest = fingerprint(fields, fields_for(fields))
    except NotCanonicalisable as exc:
        raise ConfigError(f"schedule {spec.name!r}: input cannot be canonicalised "
                          f"(RFC 8785): {exc}") from None
    return AdmissionRequest(
        principal=Principal(spec.profile, schedule_key_id(spec.profile), "client"),
        key=None, key_is_derived=False, run_id=None, task=spec.task,
        input_json=compact_json(spec.input), session_key=None, trigger_id=None,
        metadata_json=compact_json(metadata), callback_url=None, fingerprint=digest,
        fingerprint_version=FINGERPRINT_VERSION, queue=queue_of(spec.task))


class Scheduler:
    """One node's scheduler thread over the declared schedules."""

    def __init__(self, settings: Settings, specs: dict[str, ScheduleSpec]) -> None:
        self.settings = settings
        self.specs = specs
        self.templates = {name: template(spec) for name, spec in specs.items()}
        self.dispatcher = dispatch.Dispatcher(settings)
        self.stopped = threading.Event()
        #: Ticks at or before this came due before this scheduler watched: missed ones,
        #: which each schedule's catchup decides (set when the thread starts).
        self.watching_from = 0.0
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.specs:
            return  # nothing declared: no thread, no reads
        self._thread = threading.Thread(target=self._run, name="runstile-scheduler",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                wait = self.run_pass() if self._conn is not None else self._open()
            except RunstileError as exc:  # the ledger was busy or unavailable: again soon
                log.warning("scheduler: pass failed (%s); trying again in %.0fs",
                            exc.message, RETRY_S)
                wait = RETRY_S
            except Exception:  # noqa: BLE001 - reported; the scheduler must not die of it
                log.exception("scheduler: pass failed; trying again in %.0fs", RETRY_S)
                wait = RETRY_S
            self.stopped.wait(wait)

    def _open(self) -> float:
        """Connect and give every schedule its row; then the watch begins."""
        conn = self.dispatcher.pool().get()
        ledger.ensure(conn, [(s.name, s.profile) for s in self.specs.values()])
        self._conn = conn
        self.watching_from = time.time()
        log.info("scheduler up: %d schedules (%s), watching from %.3f; ticks missed "
                 "before then follow each schedule's catchup", len(self.specs),
                 ", ".join(self.specs), self.watching_from)
        return 0.0

    def run_pass(self) -> float:
        """Admit every schedule's due ticks; the seconds until the next one falls due."""
        assert self._conn is not None
        now = time.time()
        states = ledger.states(self._conn)
        retry = False
        for name, spec in self.specs.items():
            state = states.get(name)
            if state is None or state["paused_at"] is not None:
                continue  # paused: the ticks of a pause are never due (docs/tasks.md)
            retry |= not self._admit_due(spec, self._due(spec, state, now))
        upcoming = [t for spec in self.specs.values()
                    if (t := spec.ticks.next_after(now)) is not None]
        wait = min(upcoming, default=now + MAX_SLEEP_S) - time.time() + WAKE_SLACK_S
        return min(max(wait, WAKE_SLACK_S), RETRY_S if retry else MAX_SLEEP_S)

    def _due(self, spec: ScheduleSpec, state: dict, now: float) -> list[float]:
        """The ticks to admit now, oldest first (docs/tasks.md, "Catch-up").  Ticks after
        ``watching_from`` came due while this scheduler watched: all are due.  Earlier
        ones were missed, and the schedule's catchup says which of them are due."""
        after = max(state["settled_through"] or state["first_seen_at"],
                    state["resumed_at"] or 0.0)
        if spec.catchup == "all":
            due = spec.ticks.due(after, now, MAX_CATCHUP)
            if len(due) == MAX_CATCHUP and spec.ticks.due(after, due[0] - 0.5, 1):
                log.warning("schedule %s: more than %d ticks missed; those before %s are "
                            "skipped", spec.name, MAX_CATCHUP, ticks.spell(due[0]))
            return due
        watched = spec.ticks.due(max(after, self.watching_from), now, MAX_CATCHUP)
        if spec.catchup == "none":
            return watched
        return spec.ticks.due(after, min(now, self.watching_from), 1) + watched

    def _admit_due(self, spec: ScheduleSpec, due: list[float]) -> bool:
        """Admit ``due`` in order; False when one could not be (it stays due: the next
        pass, soon, tries again — never a later tick before it)."""
        assert self._conn is not None
        base = self.templates[spec.name]
        for tick in due:
            key = ledger.idempotency_key(spec.name, ticks.spell(tick))
            reserve = Reservation(replace(base, key=key), None, self.settings.max_active_runs,
                                  self.dispatcher.enqueue)
            try:
                admitted = ledger.admit_tick(self._conn, spec.name, tick, reserve)
            except RunstileError as exc:
                log.warning("schedule %s: tick %s not admitted (%s); trying again",
                            spec.name, ticks.spell(tick), exc.message)
                return False
            if admitted is not None and not admitted.replayed:
                log.debug("schedule %s: tick %s admitted as %s", spec.name,
                          ticks.spell(tick), admitted.run["id"])
        return True
