"""Flow control (issue 16), measured and not asserted: does priority order hold under load?

  priority-order  ``runstile up --workers 2 --threads 4 --tasks bench.bench_tasks`` on
                  the embedded broker.  Every worker thread is first held by a
                  ``bench.hold`` run (submitted one at a time); then a backlog of BENCH_FLOW_RUNS (400) no-op runs
                  is admitted from 4 concurrent clients, each with a priority from 0 to 9
                  (a seeded random draw, so every run of the bench submits the same
                  sequence); then the holders are released and the backlog drains on the
                  8 threads.  The start order is the runs' ``started_at`` (the claim, on
                  the ledger's clock; ties in arrival order).

Reported: the share of pairs of backlog runs with different priorities that started in
priority order (1.0 = perfect; a random order gives about 0.5), whether every priority-9
run started before every priority-0 run, how many starts came before the first
priority-9 start, and the same share without the runs the workers had already
prefetched when the backlog arrived (a process holds twice its threads unacked, half of
them the held runs; those keep their arrival order, docs/operations.md, "Run priority
and prefetch").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .admission import HOST, clean_env, free_port, temp_dir
from .execution import (
    RUNSTILE,
    WORKER_PROCESSES,
    WORKER_THREADS,
    Group,
    _runstile_key,
    _wait_http_ready,
)

#: The seed of the backlog's priorities (the same sequence on every run of the bench).
SEED = 16
#: Concurrent clients submitting the backlog.
CLIENTS = 4


@dataclass
class FlowResult:
    name: str
    measured: bool = False
    reason: str | None = None
    runs: int = 0
    #: Priorities of the backlog's runs in the order they started.
    started: list[int] = field(default_factory=list)
    #: Runs started before the backlog could be sorted (prefetched by the workers).
    prefetched: int = 0
    config: dict = field(default_factory=dict)

    def row(self) -> dict:
        started, later = self.started, self.started[self.prefetched:]
        first_9 = started.index(9) if 9 in started else None
        return {"target": self.name, "measured": self.measured, "problem": self.reason,
                "runs": self.runs, "started": len(started),
                "pairs_in_order": in_order(started), "pairs_in_order_after_prefetch":
                in_order(later), "all_9s_before_all_0s": nines_first(started),
                "starts_before_first_9": first_9, "prefetched": self.prefetched,
                "config": self.config}


def in_order(priorities: list[int]) -> float | None:
    """The share of pairs with different priorities in which the higher one started
    first (counted per priority, so 400 runs need no 80,000 comparisons)."""
    seen = [0] * 10          # runs of each priority started so far
    good = total = 0
    for p in priorities:
        higher = sum(seen[p + 1:])   # started before this one and rightly so
        lower = sum(seen[:p])        # started before this one although lower
        good, total = good + higher, total + higher + lower
        seen[p] += 1
    return round(good / total, 4) if total else None


def nines_first(priorities: list[int]) -> bool | None:
    if 9 not in priorities or 0 not in priorities:
        return None
    return max(i for i, p in enumerate(priorities) if p == 9) < priorities.index(0)


def _submitter(port: int, secret: str):
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}

    def submit(body: dict) -> str:
        conn.request("POST", "/v1/runs", json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        answer = resp.read()
        if resp.status != 202:
            raise RuntimeError(f"HTTP {resp.status}: {answer[:200]!r}")
        return json.loads(answer)["id"]
    return submit


def _count(ledger: Path, sql: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as c:
        return c.execute(sql).fetchone()[0]


def _wait(what: str, done, group: Group, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        group.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.05)


def _backlog(port: int, secret: str, runs: int) -> list[int]:
    """Admit the backlog from CLIENTS clients; its priorities, in submission order."""
    draw = random.Random(SEED)
    priorities = [draw.randint(0, 9) for _ in range(runs)]
    chunks = [priorities[i::CLIENTS] for i in range(CLIENTS)]

    def client(chunk: list[int]) -> None:
        submit = _submitter(port, secret)
        for priority in chunk:
            submit({"task": "bench.noop", "input": {}, "priority": priority})

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, chunks))
    return priorities


def _hold_every_thread(submit, ledger: Path, release: Path, threads: int,
                       group: Group) -> None:
    """Hold runs, one at a time, until every thread runs one.  One at a time: a consumer
    that wakes to several ready messages takes up to twice its threads, and those beyond
    its threads wait in that process while the other's threads idle."""
    def running() -> int:
        return _count(ledger, "SELECT COUNT(*) FROM runs WHERE status = 'running'")

    for _ in range(3 * threads):
        if running() >= threads:
            return
        before = running()
        submit({"task": "bench.hold", "input": {"release": str(release)}})
        with contextlib.suppress(RuntimeError):
            _wait("a hold run to start", lambda b=before: running() > b, group, timeout_s=3)
    _wait("every thread held", lambda: running() >= threads, group, timeout_s=10)


def _measure(res: FlowResult, work: Path, data: Path, port: int, secret: str,
             group: Group) -> None:
    ledger, release = data / "ledger.db", work / "release"
    threads = WORKER_PROCESSES * WORKER_THREADS
    _hold_every_thread(_submitter(port, secret), ledger, release, threads, group)
    _backlog(port, secret, res.runs)
    release.touch()
    _wait("the backlog to drain", lambda: _count(
        ledger, "SELECT COUNT(*) FROM runs WHERE status = 'completed' AND task = "
                "'bench.noop'") == res.runs, group, timeout_s=300)
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as c:
        # Claim times on the ledger's clock; a tie goes to arrival order (never to the
        # higher priority, which would flatter the share).
        res.started = [p for (p,) in c.execute(
            "SELECT priority FROM runs WHERE task = 'bench.noop' ORDER BY started_at, seq")]
    # Dramatiq's default prefetch: a process's consumer holds twice its threads unacked;
    # half of that are the held runs, so one backlog run per thread was taken early.
    res.prefetched = min(len(res.started), threads)
    res.measured = len(res.started) == res.runs
    if not res.measured:
        res.reason = f"{len(res.started)} of {res.runs} backlog runs started"


def bench_priority_order(runs: int, keep: bool) -> FlowResult:
    res = FlowResult("priority-order", runs=runs, config={
        "command": f"python -m runstile up --workers {WORKER_PROCESSES} --threads "
                   f"{WORKER_THREADS} --tasks bench.bench_tasks",
        "broker": "embedded SQLite (default)", "backlog_clients": CLIENTS,
        "priorities": f"uniform 0-9, random.Random({SEED})"})
    with temp_dir("bench-flow-", keep) as work:
        data, env, port = work / "data", clean_env(), free_port()
        secret = _runstile_key(data, env)
        group = Group("runstile up", work / "up.log")
        try:
            group.start([*RUNSTILE, "up", "--data-dir", str(data), "--port", str(port),
                         "--workers", str(WORKER_PROCESSES), "--threads",
                         str(WORKER_THREADS), "--tasks", "bench.bench_tasks"], env)
            _wait_http_ready(port, group)
            group.wait_log("worker up:", WORKER_PROCESSES)
            _measure(res, work, data, port, secret, group)
        except (RuntimeError, OSError, http.client.HTTPException) as exc:
            res.reason = str(exc)[:500]
        finally:
            group.stop()
    return res
