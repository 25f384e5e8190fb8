"""The recovery benchmark of issue 5: recovering 1,000 runs whose owner died.

runstile  ``python -m runstile recover --json --data-dir D --tasks bench.bench_tasks``
          (a real subprocess, from the repository root) on a 100,000-run ledger in
          which one node died with 1,000 runs in flight: their leases expired, nobody
          has recovered them yet.  Recovered = classified by docs/tasks.md, "When the worker is gone" and moved by its
          guarded UPDATE, committed (``bench.noop`` declares no ``on_crash``, so the
          default ``interrupt`` applies: running -> interrupted, with its event).
dbos      DBOS on SQLite (as DBOS opens it, and in WAL mode): an application that
          started 1,000 workflows which block is SIGKILLed; the system database also
          holds completed workflows as filler, 100,000 workflows in all.  A new executor
          of the same application then runs DBOS's executor recovery
          (``DBOS._recover_pending_workflows([dead executor])``).  Recovered = the
          workflow moved PENDING -> ENQUEUED by DBOS's committed UPDATE, from which its
          queue starts it again; not waiting for it to run or complete.

Both sides are timed twice: the recovery itself, inside the process (runstile: the
pass's own ``duration_s`` from its JSON report, which also covers the pass's other
steps — migration check, the re-publish scan, retention, the report — but not the WAL
checkpoint the pass runs after recording its report; DBOS: the
``_recover_pending_workflows`` call), and the wall time of the whole process
(interpreter start, imports, DBOS's launch; runstile's checkpoint).  items/s = 1,000 /
recovery seconds.

The runstile ledger is built fast but from real rows: one run of each kind is made
through runstile's own ledger functions (admission with its idempotency record,
dispatch, broker message and ``run.queued`` event; the broker claim; the run claim with
its ``run.started`` event; the finish; the broker ack), then each is copied with a
recursive-CTE ``INSERT ... SELECT`` into the schema ``migrations.migrate`` created, with
fresh ids and times spread over the past days, and the originals are deleted.  The ids
are shaped as runstile's admission makes them (the creation time in milliseconds, then
80 random bits: ledger/admission.py, ``new_run_id``), or with BENCH_RECOVERY_IDS=random
wholly random, as client-supplied run ids may be.  After the
pass, a snapshot taken before it is compared table by table: exactly the 1,000 runs
changed, as docs/tasks.md, "When the worker is gone" says, each with one new ``run.interrupted`` event; nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .admission import REPO, clean_env, temp_dir

RUNSTILE = [sys.executable, "-m", "runstile"]
ALL_TARGETS = ("runstile", "dbos", "dbos-wal")

#: The node that died, and the node id `runstile recover` runs as: the same one, as a
#: cron job on that machine would (the default node id is the host name).  `recover`
#: never bumps the generation, so the runs are found by their expired leases.
DEAD_NODE = "bench-node-a"
#: The dead node's worker processes x threads: 1,000 runs in flight need 1,000 threads.
DEAD_PROCESSES, DEAD_THREADS = 4, 250
#: Seconds between the crash and the recovery (every lease has expired by then).
CRASH_AGO_S = 120.0
#: DBOS executor ids.
DBOS_DEAD_EXECUTOR = "bench-executor-dead"
DBOS_NEW_EXECUTOR = "bench-executor-new"
#: How the bench's fresh run ids are made, per BENCH_RECOVERY_IDS.  "runstile": as
#: ledger/admission.py's new_run_id makes them, the creation time in milliseconds (12 hex
#: digits) then 80 random bits, so ids sort by creation, as in a ledger runstile wrote;
#: "random": 128 random bits, as client-supplied run ids may be (every index keyed by run
#: id then holds a dead node's runs scattered over its leaves, not near its right edge).
RUN_ID_SHAPES = {
    "runstile": "'run_' || printf('%012x', CAST(t * 1000 AS INTEGER) & 281474976710655) "
                "|| lower(hex(randomblob(10)))",
    "random": "'run_' || lower(hex(randomblob(16)))",
}
#: Completed DBOS workflows run for real by the crashing application (copied as filler).
DBOS_TEMPLATES = 5


@dataclass
class RecoverySettings:
    runs: int
    orphans: int
    queued: int
    failed: int
    targets: tuple[str, ...]
    repeats: int
    timeout_s: float
    install: bool
    keep: bool
    #: "runstile": run ids as the server makes them; "random": as clients may choose them.
    ids: str = "runstile"

    @property
    def completed(self) -> int:
        return self.runs - self.orphans - self.queued - self.failed

    @classmethod
    def from_env(cls) -> RecoverySettings:
        env = os.environ.get
        targets = tuple(t.strip() for t in env("BENCH_RECOVERY_TARGETS", ",".join(ALL_TARGETS))
                        .split(",") if t.strip())
        unknown = set(targets) - set(ALL_TARGETS)
        if unknown:
            raise SystemExit(f"BENCH_RECOVERY_TARGETS: unknown {sorted(unknown)}; "
                             f"choose from {', '.join(ALL_TARGETS)}")
        cfg = cls(runs=int(env("BENCH_RECOVERY_RUNS", "100000")),
                  orphans=int(env("BENCH_RECOVERY_ORPHANS", "1000")),
                  queued=int(env("BENCH_RECOVERY_QUEUED", "5000")),
                  failed=int(env("BENCH_RECOVERY_FAILED", "1000")),
                  targets=targets,
                  repeats=max(1, int(env("BENCH_RECOVERY_REPEATS", "3"))),
                  timeout_s=float(env("BENCH_RECOVERY_TIMEOUT", "120")),
                  install=env("BENCH_NO_INSTALL") != "1",
                  keep=env("BENCH_KEEP") == "1",
                  ids=env("BENCH_RECOVERY_IDS", "runstile"))
        if cfg.ids not in RUN_ID_SHAPES:
            raise SystemExit(f"BENCH_RECOVERY_IDS: {cfg.ids!r}; choose from "
                             f"{', '.join(RUN_ID_SHAPES)}")
        if cfg.completed < 1 or cfg.orphans < 1:
            raise SystemExit("BENCH_RECOVERY_RUNS must exceed orphans + queued + failed")
        return cfg


@dataclass
class RecoveryResult:
    name: str
    measured: bool = False
    valid: bool = False
    reason: str | None = None          # why not measured / why invalid
    items: int = 0                     # runs / workflows recovered
    recovery_s: float | None = None    # the recovery inside the process
    wall_s: float | None = None        # the whole process
    build_s: float | None = None       # building the ledger / system database (not timed)
    checks: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @property
    def items_per_s(self) -> float | None:
        return self.items / self.recovery_s if self.measured and self.recovery_s else None

    @property
    def wall_items_per_s(self) -> float | None:
        return self.items / self.wall_s if self.measured and self.wall_s else None


class NotMeasured(Exception):
    """A target that cannot run here (reported, never counted as a pass)."""


def run_process(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[float, int, str, str]:
    """Run ``argv`` from the repository root in its own process group; return
    (wall seconds from spawn to exit, exit code, stdout, stderr).  The whole group is
    killed afterwards, whatever happened."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        wall = time.perf_counter() - t0
        return wall, proc.returncode, out, err
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{argv[2:5]} did not finish within {timeout_s:g}s") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=5)


# =========================================================================== runstile

def _fingerprint(task: str, input_json: str) -> str:
    return hashlib.sha256(json.dumps({"input": json.loads(input_json), "task": task},
                                     sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _templates(path: Path) -> dict[str, str]:
    """One run of each kind, made by runstile's own ledger functions; returns kind -> id.

    completed/failed: admitted, its message claimed by a consumer, claimed by a worker
    (run.started), finished (run.completed / run.failed), message acked.  queued:
    admitted (message ready).  orphan: admitted, message claimed by a consumer of the
    dead node, run claimed by a worker of the dead node; its lease is set later."""
    from runstile import dispatch
    from runstile.config import Settings
    from runstile.ledger import admission, broker_queue, db, execution, keys, migrations, nodes
    from runstile.ledger import recovery as ledger_recovery
    from runstile.ledger.execution import Owner
    from runstile.ledger.keys import Principal

    settings = Settings(data_dir=path.parent, node_id=DEAD_NODE)
    assert settings.ledger_path == path, (settings.ledger_path, path)
    migrations.migrate(path)
    conn = db.connect(path)
    try:
        key_id, _ = keys.create(conn, "bench", label="bench recovery")
        principal = Principal("bench", key_id, "client")
        generation = nodes.boot(conn, DEAD_NODE)
        ledger_recovery.open_barrier(conn, DEAD_NODE, generation)
        enqueue = dispatch.Dispatcher(settings).in_transaction
        assert enqueue is not None, "the bench ledger uses the embedded broker"
        consumers = []
        for k in range(DEAD_PROCESSES):
            info = broker_queue.ConsumerInfo(f"{k:032x}", dispatch.QUEUE, 40000 + k,
                                             DEAD_NODE, 15.0)
            broker_queue.register_consumer(conn, info)
            consumers.append(info.consumer_id)
        input_json = "{}"
        fp = _fingerprint("bench.noop", input_json)
        out = {}
        for kind in ("completed", "failed", "orphan", "queued"):  # queued last: claims take the oldest message
            req = admission.AdmissionRequest(
                principal=principal, key=f"template-{kind}", key_is_derived=False,
                run_id=None, task="bench.noop", input_json=input_json, session_key=None,
                trigger_id=None, metadata_json=None, callback_url=None, fingerprint=fp,
                fingerprint_version=1)
            run = admission.admit(conn, req, refusal=None, max_active_runs=10 ** 9,
                             enqueue=enqueue).run
            out[kind] = run["id"]
            if kind == "queued":
                continue
            (delivery,) = broker_queue.claim(conn, dispatch.QUEUE, consumers[0], 1)
            owner = Owner(DEAD_NODE, generation, 40000, 0)
            claimed = execution.claim(conn, run["id"], owner, lease_s=settings.lease_s,
                                      task_known=lambda t: True)
            assert claimed.run is not None, claimed
            if kind == "orphan":
                continue
            if kind == "completed":
                assert execution.finish(conn, run["id"], owner, status="completed",
                                        result_json="null")
            else:
                assert execution.finish(conn, run["id"], owner, status="failed",
                                        error_code="task_error",
                                        error_message="RuntimeError: upstream said no")
            assert broker_queue.ack(conn, delivery["id"], consumers[0])
        return out
    finally:
        conn.close()


_UUID = ("lower(hex(randomblob(4)) || '-' || hex(randomblob(2)) || '-4' || "
         "substr(hex(randomblob(2)), 2) || '-' || hex(randomblob(2)) || '-' || "
         "hex(randomblob(6)))")


def build_ledger(path: Path, cfg: RecoverySettings) -> dict:
    """The 100,000-run ledger (see the module docstring); returns what it holds."""
    tmpl = _templates(path)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")     # building only; the pass runs at FULL
        now = conn.execute("SELECT (julianday('now') - 2440587.5) * 86400.0").fetchone()[0]
        crash = now - CRASH_AGO_S
        day = 86400.0
        # kind, count, first created_at, last created_at
        plan = [("completed", cfg.completed, now - 6 * day, crash - 700),
                ("failed", cfg.failed, now - 6 * day, crash - 700),
                ("queued", cfg.queued, crash - 600, crash - 1),
                ("orphan", cfg.orphans, crash - 600, crash - 30)]
        conn.execute("BEGIN")
        conn.execute("CREATE TEMP TABLE plan (n INTEGER PRIMARY KEY, kind TEXT, tmpl TEXT, "
                     "id TEXT, t REAL, msg TEXT, pid INTEGER, thread INTEGER, lease REAL)")
        for kind, count, first, last in plan:
            span = (last - first) / max(1, count)
            conn.execute(
                "WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i + 1 < ?) "
                "INSERT INTO plan (kind, tmpl, id, t, msg, pid, thread, lease) "
                "SELECT ?, ?, NULL, "
                "? + i * ? + (abs(random()) % 1000) / 1000.0 * ?, "
                f"{_UUID}, 40000 + i % ?, (i / ?) % ?, "
                "? + (abs(random()) % 15000) / 1000.0 FROM c",
                (count, kind, tmpl[kind], first, span, span, DEAD_PROCESSES, DEAD_PROCESSES,
                 DEAD_THREADS, crash))
        # The ids, once every run has its time (RUN_ID_SHAPES).
        conn.execute(f"UPDATE plan SET id = {RUN_ID_SHAPES[cfg.ids]}")
        # Every table keyed by run: copy each template's rows for each planned run, every
        # column as the ledger functions wrote it except the overrides below; columns named
        # *_at are times, shifted with the run's created_at.  Generic over the columns, so
        # a later schema (new columns) is copied as written too.
        overrides = {
            "runs": {"id": "p.id",
                     "owner_pid": "CASE WHEN p.kind = 'orphan' THEN p.pid ELSE t.owner_pid END",
                     "owner_thread": "CASE WHEN p.kind = 'orphan' THEN p.thread "
                                     "ELSE t.owner_thread END",
                     "lease_expires_at": "CASE WHEN p.kind = 'orphan' THEN p.lease "
                                         "ELSE t.lease_expires_at END"},
            "idempotency_keys": {"run_id": "p.id", "idempotency_key": "'order-' || p.n"},
            "events": {"run_id": "p.id",
                       "data": "CASE WHEN p.kind = 'orphan' AND t.type = 'run.started' THEN "
                               "json_set(t.data, '$.owner.pid', p.pid, '$.owner.thread', "
                               "p.thread) ELSE t.data END"},
            "dispatches": {"run_id": "p.id"},
            # Ready for queued runs; claimed by the dead node's consumers for the runs it
            # was executing; none for finished runs (acked).
            "broker_messages": {"run_id": "p.id", "message_id": "p.msg",
                                "body": "CAST(replace(replace(CAST(t.body AS TEXT), "
                                        "t.message_id, p.msg), p.tmpl, p.id) AS BLOB)",
                                "claimed_by": "CASE WHEN t.claimed_by IS NULL THEN NULL ELSE "
                                              "printf('%032x', p.pid - 40000) END"},
        }
        order = {"runs": "p.t", "events": "p.t, t.seq"}
        for table, over in overrides.items():
            key = "id" if table == "runs" else "run_id"
            cols = [(c[1], c[5]) for c in conn.execute(f"PRAGMA table_info({table})")]
            names, exprs = [], []
            for name, pk in cols:
                if table in ("runs", "dispatches", "broker_messages") and pk and name in (
                        "seq", "id") and name not in over:
                    continue                   # INTEGER PRIMARY KEY: assigned on insert
                names.append(name)
                if name in over:
                    exprs.append(over[name])
                elif name.endswith("_at"):
                    exprs.append(f"t.{name} - r.created_at + p.t")
                else:
                    exprs.append(f"t.{name}")
            conn.execute(f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(exprs)} "
                         f"FROM plan p JOIN runs r ON r.id = p.tmpl JOIN {table} t "
                         f"ON t.{key} = p.tmpl ORDER BY {order.get(table, 'p.t')}")
        # The originals go (their times are now, after the crash); the delete triggers keep
        # profiles.active_runs exact.
        ids = list(tmpl.values())
        marks = ", ".join("?" for _ in ids)
        for table in overrides:
            if table != "runs":
                conn.execute(f"DELETE FROM {table} WHERE run_id IN ({marks})", ids)
        conn.execute(f"DELETE FROM runs WHERE id IN ({marks})", ids)
        conn.execute("UPDATE broker_consumers SET started_at = ?, last_seen_at = ?",
                     (crash - 700, crash - 2))
        conn.execute("UPDATE nodes SET booted_at = ? WHERE id = ?", (crash - 700, DEAD_NODE))
        orphan_ids = [r[0] for r in conn.execute("SELECT id FROM plan WHERE kind = 'orphan'")]
        conn.execute("DROP TABLE plan")
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        counts = {
            "runs_by_status": dict(conn.execute(
                "SELECT status, COUNT(*) FROM runs GROUP BY status ORDER BY status")),
            "events": conn.execute("SELECT COUNT(*) FROM events").fetchone()[0],
            "idempotency_keys": conn.execute("SELECT COUNT(*) FROM idempotency_keys").fetchone()[0],
            "dispatches": conn.execute("SELECT COUNT(*) FROM dispatches").fetchone()[0],
            "broker_messages_by_state": dict(conn.execute(
                "SELECT state, COUNT(*) FROM broker_messages GROUP BY state ORDER BY state")),
            "expired_leases": conn.execute(
                "SELECT COUNT(*) FROM runs WHERE status = 'running' AND lease_expires_at < "
                "(julianday('now') - 2440587.5) * 86400.0").fetchone()[0],
            "active_runs": conn.execute("SELECT active_runs FROM profiles").fetchone()[0],
        }
    finally:
        conn.close()
    counts["file_mb"] = round(path.stat().st_size / 1e6, 1)
    return {"orphan_ids": orphan_ids, "counts": counts}


def durable_copy(src: Path, dst: Path) -> None:
    """Copy a closed, checkpointed database file and fsync the copy, so that no
    writeback of the copy is left to land on (and slow down) the timed recovery."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


#: Tables checked on their own; every other table must be left exactly as it was
#: (sqlite_sequence moves with the new recovery report).
_CHECKED_APART = ("runs", "events", "profiles", "recovery_reports", "sqlite_sequence")


def verify_pass(after: Path, before: Path, orphan_ids: list[str], report: dict) -> list[str]:
    """Compare the ledger after the pass with the snapshot taken before it.  Returns the
    problems found (empty: exactly the orphans changed, as docs/tasks.md, "When the worker is gone" says)."""
    problems = []
    orphans = set(orphan_ids)
    with contextlib.closing(sqlite3.connect(f"file:{after}?mode=ro", uri=True)) as c:
        c.execute("ATTACH DATABASE ? AS b", (f"file:{before}?mode=ro",))
        changed = {r[0] for r in c.execute(
            "SELECT id FROM (SELECT * FROM main.runs EXCEPT SELECT * FROM b.runs)")}
        gone = {r[0] for r in c.execute(
            "SELECT id FROM (SELECT * FROM b.runs EXCEPT SELECT * FROM main.runs)")}
        if changed != orphans or gone != orphans:
            problems.append(f"runs changed: {len(changed)} (of them orphans: "
                            f"{len(changed & orphans)}), runs whose old row is gone: {len(gone)}; "
                            f"expected exactly the {len(orphans)} orphans")
        bad = c.execute(
            "SELECT COUNT(*) FROM main.runs a JOIN b.runs o ON o.id = a.id WHERE o.status = "
            "'running' AND o.lease_expires_at IS NOT NULL AND NOT (a.status = 'interrupted' AND "
            "a.error_code = 'owner_lost' AND a.recovery_reason = 'owner_lost' AND "
            "a.attempt = o.attempt AND a.recovery_attempts = o.recovery_attempts + 1 AND "
            "a.finished_at IS NOT NULL AND a.owner_node IS NULL AND a.owner_generation IS NULL "
            "AND a.owner_pid IS NULL AND a.owner_thread IS NULL AND a.lease_expires_at IS NULL "
            "AND a.result IS o.result AND a.input = o.input AND a.seq = o.seq)").fetchone()[0]
        if bad:
            problems.append(f"{bad} orphans not interrupted/owner_lost with the owner cleared")
        new_events = c.execute(
            "SELECT run_id, seq, type FROM (SELECT * FROM main.events EXCEPT "
            "SELECT * FROM b.events)").fetchall()
        lost_events = c.execute("SELECT COUNT(*) FROM (SELECT * FROM b.events EXCEPT "
                                "SELECT * FROM main.events)").fetchone()[0]
        last_seq = dict(c.execute("SELECT run_id, MAX(seq) FROM b.events GROUP BY run_id"))
        expected_events = {(rid, last_seq[rid] + 1, "run.interrupted") for rid in orphans}
        if set(new_events) != expected_events or len(new_events) != len(orphans) or lost_events:
            problems.append(f"events: {len(new_events)} new ({len(set(new_events) & expected_events)}"
                            f" the expected run.interrupted), {lost_events} changed or removed")
        tables = [t for (t,) in c.execute("SELECT name FROM b.sqlite_master WHERE type = "
                                          "'table' ORDER BY name") if t not in _CHECKED_APART]
        for table in tables:
            diff = c.execute(f"SELECT (SELECT COUNT(*) FROM (SELECT * FROM main.{table} EXCEPT "
                             f"SELECT * FROM b.{table})) + (SELECT COUNT(*) FROM (SELECT * FROM "
                             f"b.{table} EXCEPT SELECT * FROM main.{table}))").fetchone()[0]
            if diff:
                problems.append(f"{table}: {diff} rows differ")
        active_after = c.execute("SELECT active_runs FROM main.profiles").fetchone()[0]
        active_before = c.execute("SELECT active_runs FROM b.profiles").fetchone()[0]
        if active_after != active_before - len(orphans):
            problems.append(f"profiles.active_runs {active_before} -> {active_after}, expected "
                            f"-{len(orphans)}")
        reports = c.execute("SELECT counts FROM main.recovery_reports WHERE id NOT IN "
                            "(SELECT id FROM b.recovery_reports)").fetchall()
        if len(reports) != 1:
            problems.append(f"{len(reports)} recovery reports recorded, expected 1")
    counts = report.get("counts", {})
    if counts != {"interrupted": len(orphans)}:
        problems.append(f"the pass reported {counts}, expected {{'interrupted': {len(orphans)}}}")
    return problems


# ---------------------------------------------------------------- query plans

def query_plans(ledger: Path, node_id: str, generation: int) -> list[dict]:
    """Run one pass in this process on ``ledger`` (a copy) with every ``execute`` and
    ``executemany`` of its connections timed, and return, for each distinct statement,
    how often it ran, the seconds spent in it (statement and its triggers; COMMIT
    includes the fsync and any automatic WAL checkpoint) and its EXPLAIN QUERY PLAN with
    the parameters it ran with."""
    from runstile import tasks as registry
    from runstile.config import Settings
    from runstile.ledger import db
    from runstile.recovery import reconcile

    registry.load(("bench.bench_tasks",))
    seen: dict[str, dict] = {}
    real_connect = db.connect

    def timed(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        execute, executemany = conn.execute, conn.executemany

        def traced_execute(sql, params=()):
            t0 = time.perf_counter()
            try:
                return execute(sql, params)
            finally:
                entry = seen.setdefault(sql, {"params": params, "calls": 0, "s": 0.0})
                entry["calls"] += 1
                entry["s"] += time.perf_counter() - t0

        def traced_executemany(sql, seq_of_params):
            # Counted once per row, timed as a whole; planned with its first row.
            rows = list(seq_of_params)
            t0 = time.perf_counter()
            try:
                return executemany(sql, rows)
            finally:
                entry = seen.setdefault(sql, {"params": rows[0] if rows else (), "calls": 0,
                                              "s": 0.0})
                entry["calls"] += len(rows)
                entry["s"] += time.perf_counter() - t0
        conn.execute = traced_execute       # LedgerConnection instances take attributes
        conn.executemany = traced_executemany
        return conn

    settings = Settings(data_dir=ledger.parent, node_id=node_id)
    db.connect = timed
    try:
        t0 = time.perf_counter()
        report = reconcile.run_pass(settings, generation=generation, trigger="command")
        elapsed = time.perf_counter() - t0
    finally:
        db.connect = real_connect
    plans = []
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as c:
        for sql, entry in seen.items():
            head = sql.lstrip().split(None, 1)[0].upper()
            plan: list[str] = []
            if head in ("SELECT", "UPDATE", "DELETE", "INSERT", "WITH"):
                try:
                    plan = [row[3] for row in c.execute("EXPLAIN QUERY PLAN " + sql,
                                                        entry["params"])]
                except sqlite3.Error as exc:
                    plan = [f"(no plan: {exc})"]
            plans.append({"statement": " ".join(sql.split()), "calls": entry["calls"],
                          "ms": round(1000 * entry["s"], 1), "plan": plan})
    plans.sort(key=lambda p: -p["ms"])
    return [{"in_process_pass_s": round(elapsed, 4), "duration_s": round(report.duration_s, 4),
             "counts": dict(report.counts)}] + plans


def bench_runstile(cfg: RecoverySettings) -> RecoveryResult:
    from runstile.config import Settings

    res = RecoveryResult("runstile", config={
        "command": "python -m runstile recover --json --data-dir D --tasks bench.bench_tasks",
        "RUNSTILE_NODE_ID": f"{DEAD_NODE} (the dead owner's node id; `recover` does not "
                            "bump its generation: the runs are found by expired leases)",
        "dead_owner": f"{DEAD_NODE} generation 1, {DEAD_PROCESSES} processes x "
                      f"{DEAD_THREADS} threads, crashed {CRASH_AGO_S:g}s before the build"})
    with temp_dir("bench-recovery-runstile-", cfg.keep) as work:
        build = work / "build"
        build.mkdir()
        t0 = time.perf_counter()
        built = build_ledger(Settings(data_dir=build, node_id=DEAD_NODE).ledger_path, cfg)
        pristine = work / "pristine.db"
        durable_copy(Settings(data_dir=build, node_id=DEAD_NODE).ledger_path, pristine)
        shutil.rmtree(build)
        res.build_s = time.perf_counter() - t0
        res.config["ledger"] = built["counts"]
        env = clean_env(RUNSTILE_NODE_ID=DEAD_NODE)
        passes = []
        for i in range(cfg.repeats):
            data = work / f"pass-{i}"
            data.mkdir()
            ledger = Settings(data_dir=data, node_id=DEAD_NODE).ledger_path
            durable_copy(pristine, ledger)
            wall, rc, out, err = run_process(
                RUNSTILE + ["recover", "--json", "--data-dir", str(data), "--tasks",
                            "bench.bench_tasks"], env, cfg.timeout_s)
            if rc != 0:
                raise RuntimeError(f"runstile recover exited {rc}: {err.strip()[-800:]}")
            try:
                report = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise RuntimeError(f"runstile recover printed no JSON: {out[-300:]!r} "
                                   f"{err[-300:]!r}") from None
            problems = verify_pass(ledger, pristine, built["orphan_ids"], report)
            passes.append({"duration_s": float(report["duration_s"]), "wall_s": round(wall, 4),
                           "interrupted": report.get("counts", {}).get("interrupted", 0),
                           "report": report, "problems": problems})
            res.checks += [f"pass {i + 1}: {p}" for p in problems]
            if not cfg.keep:
                shutil.rmtree(data)
        res.measured = True
        res.items = min(p["interrupted"] for p in passes)
        res.recovery_s = _median([p["duration_s"] for p in passes])
        res.wall_s = _median([p["wall_s"] for p in passes])
        res.config["passes"] = passes
        if any(p["interrupted"] != cfg.orphans for p in passes) and not res.checks:
            res.checks.append(f"interrupted {[p['interrupted'] for p in passes]}, "
                              f"expected {cfg.orphans} each")
        res.valid = not res.checks
        res.reason = "; ".join(res.checks) or None
        # The plan of every statement a pass runs, on the same ledger (one more pass on
        # the pristine copy, in this process, traced; not a timed one).
        try:
            plans = work / "plans"
            plans.mkdir()
            ledger = Settings(data_dir=plans, node_id=DEAD_NODE).ledger_path
            shutil.move(pristine, ledger)
            res.config["query_plans"] = query_plans(ledger, DEAD_NODE, 1)
        except Exception as exc:  # informational; never decides the floor
            res.config["query_plans"] = [{"error": f"{type(exc).__name__}: {exc}"}]
    return res


# =========================================================================== DBOS

def _dbos_fill(db_file: Path, target_total: int, templates: list[str]) -> int:
    """Copy the completed template workflows (every table keyed by workflow_uuid) until
    the system database holds ``target_total`` workflows; returns how many were added."""
    with contextlib.closing(sqlite3.connect(db_file, isolation_level=None)) as c:
        have = c.execute("SELECT COUNT(*) FROM workflow_status").fetchone()[0]
        add = max(0, target_total - have)
        if add == 0:
            return 0
        now_ms = int(time.time() * 1000)
        tables = [t for (t,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                  if any(col[1] == "workflow_uuid" for col in c.execute(f"PRAGMA table_info({t})"))]
        time_cols = {"created_at", "updated_at", "started_at_epoch_ms", "completed_at",
                     "retention_timestamp", "created_at_epoch_ms", "completed_at_epoch_ms"}
        c.execute("BEGIN")
        c.execute("CREATE TEMP TABLE fill (n INTEGER PRIMARY KEY, tmpl TEXT, id TEXT, shift INTEGER)")
        day_ms = 86400 * 1000
        c.execute(
            "WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i + 1 < ?) "
            "INSERT INTO fill (tmpl, id, shift) SELECT json_extract(?, '$[' || (i % ?) || ']'), "
            f"{_UUID}, -(? - i * ?) FROM k",
            (add, json.dumps(templates), len(templates), 6 * day_ms, (6 * day_ms) // add))
        tmpl_created = dict(c.execute(
            "SELECT workflow_uuid, created_at FROM workflow_status WHERE workflow_uuid IN "
            f"({', '.join('?' for _ in templates)})", templates))
        c.execute("CREATE TEMP TABLE tmpl_created (id TEXT PRIMARY KEY, created_at INTEGER)")
        c.executemany("INSERT INTO tmpl_created VALUES (?, ?)", tmpl_created.items())
        for table in tables:
            cols = [col[1] for col in c.execute(f"PRAGMA table_info({table})")]
            select = []
            for col in cols:
                if col == "workflow_uuid":
                    select.append("f.id")
                elif col in time_cols:
                    select.append(f"t.\"{col}\" - tc.created_at + ? + f.shift")
                else:
                    select.append(f"t.\"{col}\"")
            n_time = sum(1 for col in cols if col in time_cols)
            c.execute(f"INSERT INTO {table} ({', '.join(chr(34) + x + chr(34) for x in cols)}) "
                      f"SELECT {', '.join(select)} FROM fill f JOIN tmpl_created tc ON "
                      f"tc.id = f.tmpl JOIN {table} t ON t.workflow_uuid = f.tmpl ORDER BY f.n",
                      (now_ms,) * n_time)
        c.execute("DROP TABLE fill")
        c.execute("DROP TABLE tmpl_created")
        c.execute("COMMIT")
        return add


def bench_dbos(cfg: RecoverySettings, wal: bool) -> RecoveryResult:
    import dbos

    from .execution import Group, _dist_version
    from .peers import dbos_recovery_peer as peer

    name = "dbos-wal" if wal else "dbos"
    res = RecoveryResult(name, config={
        "dbos": getattr(dbos, "__version__", None) or _dist_version("dbos"),
        "system_database": "SQLite, WAL, synchronous=FULL" if wal
        else "SQLite as DBOS opens it (rollback journal, synchronous=FULL)",
        "crash": f"{cfg.orphans} workflows started with DBOS.start_workflow by executor "
                 f"{DBOS_DEAD_EXECUTOR}, body blocks; process group SIGKILLed",
        "recovery": f"new executor {DBOS_NEW_EXECUTOR}: DBOS.launch(), then "
                    f"DBOS._recover_pending_workflows([{DBOS_DEAD_EXECUTOR!r}])",
        "queue_thread": "running (BENCH_DBOS_QUEUE_THREAD=1): recovered workflows are "
                        "started while the recovery is timed"
        if os.environ.get("BENCH_DBOS_QUEUE_THREAD") == "1" else
        "not started in the recovering process: nothing dequeues the recovered workflows "
        "while the recovery is timed"})
    with temp_dir(f"bench-recovery-{name}-", cfg.keep) as work:
        db_file = work / "dbos.sqlite"
        url = f"sqlite:///{db_file}"
        env = clean_env(BENCH_DBOS_WAL="1" if wal else "0",
                        BENCH_DBOS_QUEUE_THREAD=os.environ.get("BENCH_DBOS_QUEUE_THREAD", "0"))
        t0 = time.perf_counter()
        migrate = subprocess.run([sys.executable, "-c",
                                  "import sys; from dbos import DBOS; DBOS.migrate(sys.argv[1])",
                                  url], env=env, cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
        if migrate.returncode != 0:
            raise RuntimeError(f"DBOS.migrate failed: {migrate.stderr[-500:]}")
        if wal:
            with contextlib.closing(sqlite3.connect(db_file)) as c:
                c.execute("PRAGMA journal_mode=WAL")
        group = Group(f"{name}-crash", work / "crash.log")
        try:
            proc = group.start([sys.executable, "-m", "bench.peers.dbos_recovery_peer", "crash",
                                url, DBOS_DEAD_EXECUTOR, str(cfg.orphans), str(DBOS_TEMPLATES)],
                               env)
            group.wait_log("crash ready", 1, timeout_s=cfg.timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            group.stop()
        with contextlib.closing(sqlite3.connect(db_file)) as c:
            pending = c.execute("SELECT COUNT(*) FROM workflow_status WHERE status = 'PENDING' "
                                "AND executor_id = ?", (DBOS_DEAD_EXECUTOR,)).fetchone()[0]
            templates = [r[0] for r in c.execute(
                "SELECT workflow_uuid FROM workflow_status WHERE status = 'SUCCESS' ORDER BY 1")]
        if pending != cfg.orphans or len(templates) != DBOS_TEMPLATES:
            raise RuntimeError(f"after the crash: {pending} PENDING workflows and "
                               f"{len(templates)} completed, expected {cfg.orphans} and "
                               f"{DBOS_TEMPLATES}")
        added = _dbos_fill(db_file, cfg.runs, templates)
        with contextlib.closing(sqlite3.connect(db_file)) as c:
            if wal:
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            before = dict(c.execute("SELECT status, COUNT(*) FROM workflow_status GROUP BY 1"))
            res.config["journal_mode"] = c.execute("PRAGMA journal_mode").fetchone()[0]
        pristine = work / "pristine.sqlite"
        durable_copy(db_file, pristine)
        db_file.unlink()
        res.build_s = time.perf_counter() - t0
        res.config["system_database"] = {
            "workflows_by_status": before,
            "filler": f"{DBOS_TEMPLATES} no-op workflows run to completion by the crashed "
                      f"application, copied {added} times (every table keyed by workflow_uuid)",
            "file_mb": round(pristine.stat().st_size / 1e6, 1)}
        expected = {f"{peer.BLOCKED_PREFIX}{i}" for i in range(cfg.orphans)}
        runs = []
        for i in range(cfg.repeats):
            rundir = work / f"recovery-{i}"
            rundir.mkdir()
            db_i = rundir / "dbos.sqlite"
            durable_copy(pristine, db_i)
            wall, rc, out, err = run_process(
                [sys.executable, "-m", "bench.peers.dbos_recovery_peer", "recover",
                 f"sqlite:///{db_i}", DBOS_NEW_EXECUTOR, DBOS_DEAD_EXECUTOR], env, cfg.timeout_s)
            if rc != 0:
                raise RuntimeError(f"DBOS recovery exited {rc}: {err.strip()[-800:]}")
            try:
                report = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise RuntimeError(f"DBOS recovery printed no JSON: {out[-300:]!r} "
                                   f"{err[-300:]!r}") from None
            ids = set(report["workflow_ids"])
            problems = []
            if ids != expected:
                problems.append(f"recovered {len(ids)} workflows, {len(ids & expected)} of the "
                                f"{cfg.orphans} left pending")
            with contextlib.closing(sqlite3.connect(f"file:{db_i}?mode=ro", uri=True)) as c:
                after = dict(c.execute(
                    "SELECT status || CASE WHEN status = 'PENDING' THEN ' (' || executor_id || "
                    "')' ELSE '' END, COUNT(*) FROM workflow_status WHERE workflow_uuid LIKE ? "
                    "GROUP BY 1", (peer.BLOCKED_PREFIX + "%",)))
                success = c.execute("SELECT COUNT(*) FROM workflow_status WHERE status = "
                                    "'SUCCESS'").fetchone()[0]
            if after.get(f"PENDING ({DBOS_DEAD_EXECUTOR})"):
                problems.append(f"{after[f'PENDING ({DBOS_DEAD_EXECUTOR})']} still PENDING on "
                                "the dead executor")
            if success != before.get("SUCCESS"):
                problems.append(f"completed workflows {before.get('SUCCESS')} -> {success}")
            runs.append({"duration_s": round(float(report["duration_s"]), 4),
                         "wall_s": round(wall, 4), "launch_s": round(report["launch_s"], 4),
                         "recovered": int(report["recovered"]),
                         "blocked_workflows_after": after, "problems": problems})
            res.checks += [f"recovery {i + 1}: {p}" for p in problems]
            if not cfg.keep:
                shutil.rmtree(rundir)
        res.measured = True
        res.items = min(r["recovered"] for r in runs)
        res.recovery_s = _median([r["duration_s"] for r in runs])
        res.wall_s = _median([r["wall_s"] for r in runs])
        res.config["recoveries"] = runs
        res.valid = not res.checks
        res.reason = "; ".join(res.checks) or None
    return res


# =========================================================================== all

def run_all(cfg: RecoverySettings, log=print) -> list[RecoveryResult]:
    from .execution import ensure_dbos
    results = []
    for name in cfg.targets:
        log(f"  {name} ...")
        try:
            if name == "runstile":
                res = bench_runstile(cfg)
            else:
                why = ensure_dbos(cfg.install)
                if why:
                    raise NotMeasured(why)
                res = bench_dbos(cfg, wal=name == "dbos-wal")
        except NotMeasured as exc:
            res = RecoveryResult(name, reason=str(exc))
        except Exception as exc:  # a target that breaks is reported, not fatal
            res = RecoveryResult(name, reason=f"{type(exc).__name__}: {exc}")
        if res.measured:
            log(f"      {res.items} recovered in {res.recovery_s:.3f} s "
                f"({res.items_per_s:.0f}/s); process wall {res.wall_s:.2f} s; "
                f"setup {res.build_s:.1f} s" + (f"  (INVALID: {res.reason})" if res.reason else ""))
        else:
            log(f"      not measured: {res.reason}")
        results.append(res)
    return results
