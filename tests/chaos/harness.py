"""The chaos harness: retrying clients that record a history, and the checker.

History (Jepsen style): every client operation is an ``invoke`` followed by exactly one
of ``ok`` (a 202 with a run id), ``fail`` (a definite refusal: a 4xx other than 429) or
``info`` (the outcome is unknown: the client gave up while the server kept failing or
vanishing).  Task bodies log ``start``/``step``/``end`` lines to an external file
(tests/chaos/chaos_tasks.py).  ``check`` reads the history, that log and the ledger
after the system has quiesced and one recovery pass ran, and counts, Jepsen
``total-queue`` style:

- lost: acknowledged (``ok``) but not in the ledger;
- unexpected: in the ledger but never invoked by any client;
- duplicated: more body starts than the run's claims allow (1 + its ``run.requeued``,
  ``run.resumed`` and ``approval.resolved`` events), a start without a ``run.started``
  event, or a step function executed more often than the journal started it;
- stranded: ``queued``, ``running`` or ``stopping`` after quiesce and recovery;
- lifecycle: a run whose ``run.*`` events do not walk the lifecycle of
  docs/architecture.md, "Run lifecycle", whose last status differs from the row, or that
  has more than one terminal event;
- undelivered: obligations neither delivered nor parked.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from runstile.ledger import db
from runstile.ledger.states import TERMINAL, can_transition

#: The profile: "short" in CI (minutes), "full" by default (`make chaos`).
PROFILE = os.environ.get("RUNSTILE_CHAOS_PROFILE", "full")


def scaled(short, full):
    return short if PROFILE == "short" else full


class History:
    """An append-only list of operations, shared by client threads."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self._lock = threading.Lock()

    def record(self, **entry) -> None:
        entry["t"] = time.monotonic()
        with self._lock:
            self.entries.append(entry)

    def by_phase(self, phase: str) -> list[dict]:
        with self._lock:
            return [e for e in self.entries if e["phase"] == phase]


@dataclass
class Clients:
    """``threads`` clients submitting runs with their own idempotency keys, retrying
    network errors, 5xx and 429 with the same key until a definite answer or
    ``give_up_s``; every tenth operation repeats an earlier key (an identical retry)."""

    url: str
    secret: str
    history: History
    body_for: callable
    threads: int = 8
    give_up_s: float = 30.0
    pause_s: float = 0.005
    #: Starts every idempotency key: clients of two groups sharing one history (one
    #: group per web host) must not share keys by accident.
    prefix: str = "c"
    #: Called with every answer (None when none came): lets a test inspect each one.
    observe: callable = None
    #: Every answer seen, by HTTP status ("no answer" for a network error or timeout),
    #: retries included: how many 5xx a fault produced.
    answers: collections.Counter = field(default_factory=collections.Counter)
    _answers_lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list = field(default_factory=list)
    _done: list = field(default_factory=list)

    def start(self) -> Clients:
        for n in range(self.threads):
            thread = threading.Thread(target=self._loop, args=(n,), daemon=True)
            thread.start()
            self._workers.append(thread)
        return self

    def stop(self, timeout_s: float = 120) -> None:
        """No new operations; the ones in progress finish (ok, fail or info)."""
        self._stop.set()
        for thread in self._workers:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self._workers), "a client never finished"

    def _loop(self, n: int) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {self.secret}"}
        rng = random.Random(n)
        count = 0
        while not self._stop.is_set():
            count += 1
            if count % 10 == 0 and self._done:
                key, body = rng.choice(self._done)  # the same request again
            else:
                key = f"{self.prefix}{n}-{count}"
                body = self.body_for(key)
            self.submit(session, headers, key, body)
            time.sleep(self.pause_s)

    def submit(self, session, headers, key: str, body: dict) -> None:
        self.history.record(phase="invoke", key=key)
        deadline = time.monotonic() + self.give_up_s
        while True:
            try:
                answer = session.post(f"{self.url}/v1/runs", json=body, timeout=10,
                                      headers={**headers, "Idempotency-Key": key})
            except requests.RequestException:
                answer = None
            with self._answers_lock:
                self.answers[answer.status_code if answer is not None else "no answer"] += 1
            if self.observe is not None:
                self.observe(answer)
            if answer is not None and answer.status_code == 202:
                self.history.record(phase="ok", key=key, run_id=answer.json()["id"])
                self._done.append((key, body))
                return
            if answer is not None and 400 <= answer.status_code < 500 and \
                    answer.status_code != 429:
                self.history.record(phase="fail", key=key, status=answer.status_code,
                                    body=answer.text[:200])
                return
            if time.monotonic() >= deadline:
                self.history.record(phase="info", key=key)
                return
            time.sleep(0.05)


@dataclass
class Report:
    operations: int = 0
    acknowledged: int = 0
    runs: int = 0
    lost: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    duplicated: list = field(default_factory=list)
    stranded: list = field(default_factory=list)
    lifecycle: list = field(default_factory=list)
    undelivered: list = field(default_factory=list)
    failed_ops: list = field(default_factory=list)
    statuses: dict = field(default_factory=dict)

    def problems(self) -> dict:
        return {name: getattr(self, name)[:5] for name in
                ("lost", "unexpected", "duplicated", "stranded", "lifecycle", "undelivered",
                 "failed_ops") if getattr(self, name)}

    def summary(self) -> str:
        return (f"operations={self.operations} acknowledged={self.acknowledged} "
                f"runs={self.runs} lost={len(self.lost)} unexpected={len(self.unexpected)} "
                f"duplicated={len(self.duplicated)} stranded={len(self.stranded)} "
                f"lifecycle={len(self.lifecycle)} undelivered={len(self.undelivered)} "
                f"statuses={self.statuses}")


#: The status each run.* event leaves the run in (the events of
#: docs/api.md, "`GET /v1/runs/{run_id}/events` — the event log", on the edges of
#: docs/architecture.md, "Run lifecycle").
EVENT_STATUS = {"run.queued": "queued", "run.started": "running", "run.requeued": "queued",
                "run.resumed": "queued", "approval.resolved": "queued",
                "approval.requested": "waiting_for_approval", "run.paused": "paused",
                "run.stopping": "stopping", "run.completed": "completed",
                "run.failed": "failed", "run.cancelled": "cancelled",
                "run.interrupted": "interrupted"}
RERUNS = ("run.requeued", "run.resumed", "approval.resolved")


def _snapshot(target: Path | str):
    """A read-only connection to the ledger (an SQLite file or a PostgreSQL URL) inside
    one read transaction: every table read from the same snapshot, even if something
    still runs (a run read as queued must not show its later events).  PostgreSQL's
    default READ COMMITTED takes a snapshot per statement, so it asks for REPEATABLE
    READ."""
    conn = db.connect(target, readonly=True)
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ" if db.is_database_url(target)
                 else "BEGIN")
    return conn


def check(target: Path | str, history: History, execution_log: Path) -> Report:
    """``target``: the ledger file, or the PostgreSQL ledger's URL (``Ledger.target``)."""
    report = Report()
    conn = _snapshot(target)
    try:
        keys = {r["idempotency_key"]: r["run_id"] for r in conn.execute(
            "SELECT idempotency_key, run_id FROM idempotency_keys")}
        runs = {r["id"]: dict(r) for r in conn.execute("SELECT * FROM runs")}
        events = collections.defaultdict(list)
        for r in conn.execute("SELECT run_id, type FROM events ORDER BY run_id, seq"):
            events[r["run_id"]].append(r["type"])
        step_starts = {(r["run_id"], r["name"]): r["starts"] for r in conn.execute(
            "SELECT run_id, name, starts FROM journal WHERE kind = 'step'")}
        undelivered = [r[0] for r in conn.execute(
            "SELECT id FROM obligations WHERE state NOT IN ('delivered', 'parked')")]
    finally:
        conn.close()

    invoked = {e["key"] for e in history.by_phase("invoke")}
    report.operations = len(history.by_phase("invoke"))
    oks = history.by_phase("ok")
    report.acknowledged = len(oks)
    report.failed_ops = [e for e in history.by_phase("fail")]
    report.runs = len(runs)
    for entry in oks:
        if entry["run_id"] not in runs or keys.get(entry["key"]) != entry["run_id"]:
            report.lost.append(entry)
    by_run = {run_id: key for key, run_id in keys.items()}
    report.unexpected = [rid for rid in runs if by_run.get(rid) not in invoked]

    starts, steps = collections.Counter(), collections.Counter()
    lines = execution_log.read_text().splitlines() if execution_log.exists() else []
    for line in lines:
        word, rid, *rest = line.split()
        if word == "start":
            starts[rid] += 1
        elif word == "step":
            steps[(rid, rest[0])] += 1
    for rid, count in starts.items():
        allowed = 1 + sum(events[rid].count(t) for t in RERUNS)
        claims = events[rid].count("run.started")
        if count > allowed or count > claims:
            report.duplicated.append((rid, f"{count} starts, {claims} claims, "
                                           f"{allowed} allowed"))
    for (rid, name), count in steps.items():
        if count > step_starts.get((rid, name), 0):
            report.duplicated.append((rid, f"step {name} executed {count} times, "
                                           f"journal started it {step_starts.get((rid, name))}"))

    terminal = {s.value for s in TERMINAL}
    for rid, run in runs.items():
        if run["status"] in ("queued", "running", "stopping"):
            report.stranded.append((rid, run["status"]))
        path = [EVENT_STATUS[t] for t in events[rid] if t in EVENT_STATUS]
        problem = None
        if not path or path[0] != "queued":
            problem = f"starts with {path[:1]}"
        else:
            for a, b in zip(path, path[1:], strict=False):
                if not can_transition(a, b):
                    problem = f"{a} -> {b}"
                    break
        if problem is None and path[-1] != run["status"]:
            problem = f"events end in {path[-1]}, the row says {run['status']}"
        if problem is None and sum(1 for s in path if s in terminal) > 1:
            problem = "more than one terminal event"
        if problem:
            report.lifecycle.append((rid, problem, events[rid]))
    report.undelivered = undelivered
    report.statuses = dict(collections.Counter(r["status"] for r in runs.values()))
    return report


def quiesce(target: Path | str, timeout_s: float = 120) -> None:
    """Wait until no run is queued, running or stopping (or the timeout passes: the
    checker then reports what is stranded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conn = db.connect(target, readonly=True)
        try:
            busy = conn.execute("SELECT COUNT(*) FROM runs WHERE status IN "
                                "('queued', 'running', 'stopping')").fetchone()[0]
        finally:
            conn.close()
        if busy == 0:
            return
        time.sleep(0.2)


def write_table(request, title: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
    """Print a module's figures as one Markdown table at the end of the session's output
    (docs/guarantees.md quotes the full profile's)."""
    if not rows:
        return
    write = request.config.pluginmanager.get_plugin("terminalreporter").write_line
    write("")
    write(f"{title}, chaos profile: {PROFILE}")
    write("| " + " | ".join(columns) + " |")
    write("|" + "---|" * len(columns))
    for row in rows:
        write("| " + " | ".join(str(x) for x in row) + " |")
