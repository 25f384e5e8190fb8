"""Storage faults (issue 7; `make chaos`, CI runs RUNSTILE_CHAOS_PROFILE=short): a full
disk under load, fsync and write errors injected with strace, corrupt and truncated
ledgers handed to recovery, and a storm of SQLITE_BUSY.  Real `runstile serve`,
`runstile worker` and `runstile recover` processes on a real SQLite file; retrying
clients record a history and the checker (tests/chaos/harness.py) must find nothing
lost, duplicated, stranded or out of lifecycle.  A fault may cost a 503
run_storage_unavailable with Retry-After, never a 202 for what did not commit."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import requests

from runstile.ledger import migrations
from runstile.workers.context import args_hash
from tests.chaos.harness import Clients, History, check, quiesce, scaled, write_table
from tests.chaos.test_chaos import CHAOS_TASKS, ENV, body_for, recover
from tests.conftest import (
    ROOT,
    Ledger,
    Server,
    Workers,
    child_pids,
    fill,
    wait_for_writer,
    wait_until,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

#: Figures of each scenario, printed as one table at the end of the module.
FIGURES: list[tuple] = []
COLUMNS = ("scenario", "faults", "operations", "acknowledged", "503", "other 5xx",
           "no answer", "lost", "duplicated", "stranded", "unexpected", "lifecycle", "seconds")


@pytest.fixture(scope="module", autouse=True)
def print_figures(request):
    yield
    write_table(request, "storage faults", COLUMNS, FIGURES)


def padded(make_body):
    """Bodies with 1-6 KB of padding the tasks ignore: every admission grows the WAL."""
    def make(key: str) -> dict:
        body = make_body(key)
        body["input"]["pad"] = "x" * random.Random(key).randint(1000, 6000)
        return body
    return make


class Refusals:
    """Watches every answer (Clients.observe): each 5xx must be a 503
    run_storage_unavailable with a Retry-After of at least one second; counts those
    and remembers when the last 202 came."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bad: list[str] = []
        self.unavailable = 0
        self.last_202 = 0.0

    def __call__(self, answer) -> None:
        if answer is None:
            return
        if answer.status_code == 202:
            self.last_202 = time.monotonic()
        if answer.status_code < 500:
            return
        try:
            code = answer.json()["error"]["code"]
        except ValueError:
            code = None
        with self.lock:
            if answer.status_code == 503 and code == "run_storage_unavailable" and \
                    int(answer.headers.get("Retry-After", "0")) >= 1:
                self.unavailable += 1
            else:
                self.bad.append(f"{answer.status_code} {code} "
                                f"Retry-After={answer.headers.get('Retry-After')} "
                                f"{answer.text[:200]}")


def runstile(ledger: Ledger, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runstile", *args, "--data-dir",
                           str(ledger.data_dir), "--tasks", CHAOS_TASKS], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **ENV})


def db_check(ledger: Ledger) -> subprocess.CompletedProcess:
    return runstile(ledger, "db", "check", "--json")


def half_written(ledger: Ledger) -> dict:
    """Admissions that committed only in part (run, key, dispatch and the run.queued event
    commit together: docs/guarantees.md, "1. Durable admission"): each count must be 0."""
    def count(sql: str) -> int:
        return ledger.query(sql)[0][0]
    return {name: n for name, n in {
        "runs without a key": count(
            "SELECT COUNT(*) FROM runs r WHERE NOT EXISTS "
            "(SELECT 1 FROM idempotency_keys k WHERE k.run_id = r.id)"),
        "runs without a dispatch": count(
            "SELECT COUNT(*) FROM runs r WHERE NOT EXISTS "
            "(SELECT 1 FROM dispatches d WHERE d.run_id = r.id)"),
        "runs without run.queued first": count(
            "SELECT COUNT(*) FROM runs r WHERE NOT EXISTS (SELECT 1 FROM events e "
            "WHERE e.run_id = r.id AND e.seq = 1 AND e.type = 'run.queued')"),
        "keys without a run": count(
            "SELECT COUNT(*) FROM idempotency_keys k WHERE NOT EXISTS "
            "(SELECT 1 FROM runs r WHERE r.id = k.run_id)"),
    }.items() if n}


FAILED_BY_CODE = "SELECT error_code, COUNT(*) FROM runs WHERE status = 'failed' GROUP BY 1"


def settle(ledger, history, log, clients, refusals, scenario: str, faults: int,
           started: float):
    """Quiesce, one `runstile recover`, the checker, `runstile db check`: nothing lost,
    duplicated, stranded, unexpected or out of lifecycle; nothing half-written; the
    ledger passes its integrity and invariant checks; every 5xx was a proper 503."""
    quiesce(ledger.target, timeout_s=180)
    recover(ledger)
    report = check(ledger.target, history, log)
    fivexx = sum(n for status, n in clients.answers.items()
                 if isinstance(status, int) and status >= 500)
    FIGURES.append((scenario, faults, report.operations, report.acknowledged,
                    clients.answers.get(503, 0), fivexx - clients.answers.get(503, 0),
                    clients.answers.get("no answer", 0), len(report.lost),
                    len(report.duplicated), len(report.stranded), len(report.unexpected),
                    len(report.lifecycle), round(time.monotonic() - started)))
    print(f"\n{scenario}: faults={faults} answers={dict(clients.answers)} {report.summary()} "
          f"failed_by_code={dict(ledger.query(FAILED_BY_CODE))}")
    assert report.problems() == {}, report.problems()
    assert report.acknowledged > 0
    assert half_written(ledger) == {}
    assert refusals.bad == [], refusals.bad[:5]
    checked = db_check(ledger)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return report


# ---------------------------------------------------------------- 1. disk full under load

@pytest.mark.parametrize("tiny_disk", ["16m"], indirect=True)
def test_a_full_disk_under_load_answers_503_loses_nothing_and_service_resumes_without_restart(
        tiny_disk, tmp_path):
    """The ledger on a small tmpfs, filled again and again while clients admit and a
    worker executes: every refusal is a 503 run_storage_unavailable with Retry-After,
    nothing acknowledged is lost or half-written, and once a filler file is deleted the
    same processes (no restart) answer 202 again."""
    started = time.monotonic()
    # The tmpfs is the data directory itself, so the processes' logs (kept beside it)
    # never compete with the ledger for the space.
    ledger = Ledger(tiny_disk)
    migrations.migrate(ledger.path)
    log = tmp_path / "executions.log"
    key = ledger.key()
    workers = Workers(ledger.data_dir, ENV, workers=1, threads=4).start()
    web = Server(ledger.data_dir, {**ENV, "RUNSTILE_BUSY_TIMEOUT_MS": "1000"},
                 web_workers=2).start()
    history, refusals = History(), Refusals()
    clients = Clients(web.url, key.secret, history, padded(body_for(log)), threads=8,
                      observe=refusals).start()
    fills = scaled(2, 6)
    processes = wait_until(lambda: sorted(child_pids(web.proc.pid)) if len(
        web.web_pids()) == 2 and web.writer_pid() else None, 15, 0.05,
        "2 web processes and the admission writer")
    processes += sorted(child_pids(workers.proc.pid))
    try:
        for _ in range(fills):
            acknowledged = len(history.by_phase("ok"))
            wait_until(lambda acknowledged=acknowledged:
                       len(history.by_phase("ok")) >= acknowledged + 20, 60, 0.05,
                       "admissions with free space")
            refused_before = refusals.unavailable
            filler = fill(tiny_disk)
            # Keep the disk full until admissions are refused for a while.
            wait_until(lambda refused_before=refused_before:
                       refusals.unavailable >= refused_before + 10, 60, 0.05,
                       "503 answers while the disk is full")
            time.sleep(scaled(1, 3))
            filler.unlink()
            freed = time.monotonic()
            # The same processes answer 202 again: no restart.
            wait_until(lambda freed=freed: refusals.last_202 > freed, 30, 0.05,
                       "a 202 after the space came back")
    finally:
        clients.stop()
    try:
        # No process died or was replaced meanwhile.
        assert sorted(child_pids(web.proc.pid)) + sorted(child_pids(workers.proc.pid)) == processes
        settle(ledger, history, log, clients, refusals, "disk full under load (tmpfs 16 MiB)",
               fills, started)
    finally:
        web.kill()
        workers.kill()


# ---------------------------------------------------------------- 2. fsync and write errors

#: (syscalls, errno) strace injects.  SQLite syncs with fdatasync on Linux (fsync where
#: it lacks it); pwrite64 carries every WAL frame, checkpoint page and -shm extension.
INJECTIONS = {"fsync-EIO": ("fsync,fdatasync", "EIO"), "pwrite-EIO": ("pwrite64", "EIO"),
              "pwrite-ENOSPC": ("pwrite64", "ENOSPC")}


def traced(pid: int) -> bool:
    """True when every thread of ``pid`` has a tracer attached."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
        return all("TracerPid:\t0\n" not in open(f"/proc/{pid}/task/{t}/status").read()
                   for t in threads)
    except OSError:
        return False


def inject(pid: int, syscalls: str, errno: str, nth: str, trace_path) -> subprocess.Popen:
    """Attach strace to every thread of ``pid``; the nth call of ``syscalls`` in a thread
    (``n+``: the nth and every later one) fails with ``errno`` without reaching the
    kernel."""
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", str(trace_path), "-e", f"trace={syscalls}",
         "-e", f"inject={syscalls}:error={errno}:when={nth}", "-p", str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: traced(pid), 10, 0.01, f"strace to attach to {pid}")
    return tracer


def missing_acknowledged(ledger: Ledger, history: History) -> list:
    """Acknowledged runs the ledger does not hold.  The acknowledgements are read first:
    each committed before its 202, so before the ledger is read."""
    acknowledged = history.by_phase("ok")
    keys = dict(ledger.query("SELECT idempotency_key, run_id FROM idempotency_keys"))
    return [e for e in acknowledged if keys.get(e["key"]) != e["run_id"]]


def test_fsync_and_write_errors_injected_with_strace_never_acknowledge_a_failed_commit(
        ledger, tmp_path):
    """strace makes the nth fsync/fdatasync or pwrite64 of the admission writer (the
    process that commits every admission) fail (EIO, ENOSPC; or every call from the nth
    on) while clients admit: every refusal is a 503 with Retry-After, the process answers
    202 again without a restart (a failed commit must not leave its connection broken),
    and after it is SIGKILLed and restarted every acknowledged run is in the ledger."""
    if ledger.url:
        pytest.skip("SQLite only: the faults go into runstile's own writes and fsyncs of the "
                    "ledger file; a PostgreSQL ledger's are its server's "
                    "(tests/chaos/test_postgresql_restart.py covers a server that fails)")
    started = time.monotonic()
    if subprocess.run(["strace", "-V"], capture_output=True).returncode != 0:
        pytest.skip("strace is not installed")
    log = tmp_path / "executions.log"
    key = ledger.key()
    # One web process, whose admissions the writer commits: a 202 after the fault comes
    # from the process that met it.
    # No workers run meanwhile, so runs pile up queued.  The clients pause between
    # requests: unthrottled, the admission writer takes 30,000+ runs over the full
    # profile, more than the default cap of 10,000 (a refused admission commits nothing,
    # so it could never meet the fault waited for) and more than one worker process
    # settles before the checker's deadline.
    web = Server(ledger.data_dir, {**ENV, "RUNSTILE_BUSY_TIMEOUT_MS": "2000"},
                 web_workers=1).start()
    history, refusals = History(), Refusals()
    clients = Clients(web.url, key.secret, history, body_for(log), threads=8, pause_s=0.25,
                      observe=refusals).start()
    # "n": the nth call fails once; "n+": every call from the nth on fails (a disk that
    # keeps failing) until strace detaches a moment later.
    nths = scaled(["1", "2", "3", "5", "9", "17", "2+"],
                  [str(n) for n in range(1, 41)] + ["1+", "5+", "20+"])
    cases = [(name, n) for n in nths for name in INJECTIONS]
    injected = 0
    try:
        pid = wait_for_writer(web)
        for number, (name, nth) in enumerate(cases):
            syscalls, errno = INJECTIONS[name]
            trace = tmp_path / f"strace-{number}-{name}-{nth}.txt"
            tracer = inject(pid, syscalls, errno, nth, trace)
            try:
                wait_until(lambda trace=trace: "INJECTED" in trace.read_text(), 60, 0.02,
                           f"strace to inject {name} at call {nth}")
                if nth.endswith("+"):
                    time.sleep(0.5)
            finally:
                tracer.send_signal(signal.SIGINT)  # detach; the process goes on untraced
                tracer.wait(30)
            injected += trace.read_text().count("INJECTED")
            # The process that met the fault commits again, without a restart.
            detached = time.monotonic()
            wait_until(lambda detached=detached: refusals.last_202 > detached, 30, 0.02,
                       f"a 202 from the web process after {name} at call {nth}")
            # Then restart it (SIGKILL; serve starts a new one): the new process reads
            # the ledger from the files alone, and must find every acknowledged run.
            os.kill(pid, signal.SIGKILL)
            pid = wait_for_writer(web, previous=pid)
            missing = missing_acknowledged(ledger, history)
            assert missing == [], f"after {name} at call {nth}, lost: {missing[:5]}"
    finally:
        clients.stop()
    workers = None
    try:
        web.kill()  # the whole server too, then a fresh one and workers to run everything
        web.start()
        workers = Workers(ledger.data_dir, ENV, workers=1, threads=4).start()
        settle(ledger, history, log, clients, refusals,
               f"strace {'/'.join(INJECTIONS)} at calls {', '.join(nths)}"
               if len(nths) < 10 else f"strace {'/'.join(INJECTIONS)} at calls 1-40, "
               f"{', '.join(n for n in nths if n.endswith('+'))}", injected,
               started)
    finally:
        web.kill()
        if workers is not None:
            workers.kill()


# ---------------------------------------------------------------- 3. damaged ledgers

@dataclass
class Finished:
    """A ledger of finished runs, admitted and executed by real processes, and what
    the clients were told: the good records every damaged copy is compared against."""

    data_dir: Path
    secret: str
    log: Path
    bodies: dict          # idempotency key -> (run id, body)
    runs: dict            # run id -> (status, attempt, result)


def good_records(ledger: Ledger) -> dict:
    """Every row of the tables recovery could touch, by primary key."""
    return {
        "runs": {r[0]: r[1:] for r in ledger.query(
            "SELECT id, status, attempt, result, error_code, finished_at FROM runs")},
        "idempotency_keys": {r[0]: r[1:] for r in ledger.query(
            "SELECT idempotency_key, run_id, fingerprint FROM idempotency_keys")},
        "events": {r[:2]: r[2:] for r in ledger.query(
            "SELECT run_id, seq, type, data FROM events")},
        "journal": {r[:2]: r[2:] for r in ledger.query(
            "SELECT run_id, position, state, result, starts FROM journal")},
        "dispatches": {r[0]: r[1:] for r in ledger.query(
            "SELECT id, run_id, attempt FROM dispatches")},
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Finished:
    folder = tmp_path_factory.mktemp("finished")
    ledger = Ledger(folder / "data")
    migrations.migrate(ledger.path)
    key = ledger.key()
    log = folder / "executions.log"
    web = Server(ledger.data_dir, ENV, web_workers=1).start()
    workers = Workers(ledger.data_dir, ENV, workers=1, threads=4).start()
    history = History()
    clients = Clients(web.url, key.secret, history, body_for(log), threads=4)
    try:
        clients.start()
        wait_until(lambda: len(history.by_phase("ok")) >= scaled(100, 300), 120, 0.1,
                   "runs admitted")
        clients.stop()
        quiesce(ledger.target)
    finally:
        web.kill()
        workers.kill()
    make = body_for(log)
    bodies = {e["key"]: (e["run_id"], make(e["key"])) for e in history.by_phase("ok")}
    runs = {r[0]: r[1:] for r in ledger.query("SELECT id, status, attempt, result FROM runs")}
    assert {status for status, _, _ in runs.values()} == {"completed"}
    return Finished(ledger.data_dir, key.secret, log, bodies, runs)


def copy_of(finished: Finished, folder: Path) -> Ledger:
    """A copy of the finished ledger's files (no process has them open)."""
    shutil.copytree(finished.data_dir, folder / "data")
    return Ledger(folder / "data")


@dataclass
class Serving(Server):
    """A `runstile serve` taken as started once it answers at all, ready or not."""

    ready_path: ClassVar[str] = "/healthz"


def assert_fails_closed(done: subprocess.CompletedProcess, *words: str) -> None:
    """A non-zero exit with one clear line, never a traceback."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert all(word in done.stderr for word in words), done.stderr


def assert_unchanged(before: dict, ledger: Ledger, skip_runs=()) -> None:
    """No good record was dropped or altered."""
    after = good_records(ledger)
    for table, rows in before.items():
        changed = [k for k, row in rows.items() if after[table].get(k) != row and
                   (k if table in ("runs", "dispatches") else
                    k[0] if table in ("events", "journal") else row[0]) not in skip_runs]
        assert changed == [], f"{table}: {len(changed)} good rows dropped or changed: {changed[:3]}"


def test_impossible_journal_and_obligation_rows_are_reported_and_recovery_fails_closed(
        finished, tmp_path):
    """(a) Rows edited into states runstile never writes (the schema's CHECKs allow
    them): `runstile db check` names each, recovery stops with a clear error while
    an obligation names a run that does not exist (no worker starts, /readyz 503), and
    once a person removed it, recovery settles the rest without touching good records
    and without running a step again."""
    started = time.monotonic()
    ledger = copy_of(finished, tmp_path)
    headers = {"Authorization": f"Bearer {finished.secret}"}
    web = Server(ledger.data_dir, ENV, web_workers=1).start()
    try:
        never_started, broken = [requests.post(
            f"{web.url}/v1/runs", headers={**headers, "Idempotency-Key": f"damaged-{n}"},
            json={"task": "chaos.resume", "input": {"log": str(finished.log), "steps": 2}},
            timeout=30).json()["id"] for n in range(2)]
    finally:
        web.kill()
    before = good_records(ledger)
    ghost = "run_" + "f" * 32
    raw = sqlite3.connect(ledger.path, isolation_level=None)  # foreign keys off
    with raw:
        raw.execute("BEGIN")
        # A queued run that never started, with a completed step in its journal.
        raw.execute("INSERT INTO journal VALUES (?, 1, 'step', 's0', 'bogus', 0, "
                    "'completed', '0', 1, 1, 0, 0)", (never_started,))
        # A run whose dead owner completed a step whose recorded result is not JSON.
        raw.execute("UPDATE runs SET status = 'running', owner_node = 'gone', "
                    "owner_generation = 1, owner_pid = 1, owner_thread = 1, "
                    "lease_expires_at = 0, started_at = 0 WHERE id = ?", (broken,))
        raw.execute("INSERT INTO events VALUES (?, 2, 'run.started', '{}', 0)", (broken,))
        raw.execute("INSERT INTO journal VALUES (?, 1, 'step', 's0', ?, 0, 'completed', "
                    "'{not json', 1, 1, 0, 0)",
                    (broken, args_hash("s0", [str(finished.log), broken, 0], {})))
        # An attempt at delivering for a run that does not exist, its deliverer gone.
        raw.execute(
            "INSERT INTO obligations (id, run_id, profile_id, kind, type, url, occurred_at, "
            "state, attempts, fence, next_attempt_at, owner_node, owner_generation, "
            "owner_pid, lease_expires_at, created_at, updated_at) VALUES ('msg_' || "
            "lower(hex(randomblob(16))), ?, 'default', 'callback', 'run.completed', "
            "'http://127.0.0.1:9/', 0, 'attempting', 99, 1, 0, 'gone', 1, 1, 0, 0, 0)",
            (ghost,))
    raw.close()

    checked = runstile(ledger, "db", "check", "--json")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    problems = "\n".join(json.loads(checked.stdout.splitlines()[-1])["problems"])
    assert "foreign key: ('obligations'" in problems, problems
    assert "never started" in problems and never_started in problems, problems
    assert "not JSON" in problems and broken in problems, problems

    assert_fails_closed(runstile(ledger, "recover"), "error:", "runstile db check")
    node = runstile(ledger, "worker", "--workers", "1")
    assert_fails_closed(node, "boot recovery failed", "runstile db check")
    web = Serving(ledger.data_dir, ENV, web_workers=1).start()
    answer = requests.get(f"{web.url}/readyz", timeout=5)  # this node's boot never recovered
    web.kill()
    assert answer.status_code == 503 and answer.json()["checks"]["recovered"] is False
    assert_unchanged(before, ledger, skip_runs=(never_started, broken))

    # A person removes the obligation db check named; recovery goes on.
    ledger.query("DELETE FROM obligations WHERE run_id = ?", (ghost,))
    assert runstile(ledger, "recover").returncode == 0
    # The worker's boot recovery opens this node's barrier; /readyz then answers 200.
    workers = Workers(ledger.data_dir, ENV, workers=1, threads=2).start()
    web = Server(ledger.data_dir, ENV, web_workers=1).start()
    try:
        quiesce(ledger.target, timeout_s=60)
    finally:
        web.kill()
        workers.kill()
    statuses = dict(ledger.query("SELECT id, status FROM runs WHERE id IN (?, ?)",
                                 (never_started, broken)))
    # The never-started run's journal does not match its body: paused for a person.
    assert statuses[never_started] == "paused"
    assert ledger.query("SELECT recovery_reason FROM runs WHERE id = ?",
                        (never_started,)) == [("nondeterministic_replay",)]
    # The unreadable step result is never taken for a reason to run the step again.
    assert statuses[broken] in ("failed", "paused")
    assert f"step {broken} s0" not in finished.log.read_text()
    assert_unchanged(before, ledger, skip_runs=(never_started, broken))
    runs = len(finished.bodies) + 2
    FIGURES.append(("impossible journal/obligation rows: recovery stops, then settles them", 3,
                    runs, runs, 0, 0, 0, 0, 0, 0, 0, 0, round(time.monotonic() - started)))


#: WAL layout (https://sqlite.org/fileformat2.html#walformat): a 32-byte header, then
#: frames of a 24-byte header (page number, database size after commit — non-zero only
#: on a transaction's last frame —, the two salts, two checksums) and one page.
WAL_HEADER, FRAME_HEADER = 32, 24


def commit_ends(wal: bytes) -> list[int]:
    """Byte offsets just past each commit frame of the WAL's current generation."""
    page_size, salts = struct.unpack(">I", wal[8:12])[0], wal[16:24]
    frame, ends, offset = FRAME_HEADER + page_size, [], WAL_HEADER
    while offset + frame <= len(wal) and wal[offset + 8:offset + 16] == salts:
        if struct.unpack(">I", wal[offset + 4:offset + 8])[0]:
            ends.append(offset + frame)
        offset += frame
    return ends


def admitted_keys(data_dir: Path) -> dict:
    """(key id, idempotency key) -> run id, as SQLite reads the files in ``data_dir``
    (on a copy: opening a ledger runs WAL recovery and may checkpoint)."""
    with tempfile.TemporaryDirectory() as scratch:
        for name in os.listdir(data_dir):
            if name.startswith("ledger.db"):
                shutil.copy(data_dir / name, Path(scratch) / name)
        conn = sqlite3.connect(Path(scratch) / "ledger.db")
        try:
            return {(key_id, key): run_id for key_id, key, run_id in conn.execute(
                "SELECT key_id, idempotency_key, run_id FROM idempotency_keys")}
        finally:
            conn.close()


def test_a_wal_with_a_torn_or_garbage_tail_keeps_every_run_committed_before_it(
        ledger, tmp_path):
    """(b) The WAL's tail cut inside a frame, at a frame boundary or anywhere, its last
    frame torn (the page garbage), or garbage appended after the last commit frame:
    SQLite's WAL recovery keeps exactly the transactions committed before the damage
    (what the WAL cut right after the last intact commit frame holds), `runstile db
    check` passes, and a restarted server replays every kept run and admits new ones."""
    started = time.monotonic()
    log = tmp_path / "executions.log"
    make = body_for(log)
    keys, acknowledged = {}, {}
    # Round one ends checkpointed into the ledger file; round two stays in the WAL
    # (fewer frames than the 1,000 that trigger a checkpoint), which no process folds
    # back: the server is SIGKILLed.  A key (scope) each: the clients' keys repeat.
    for round_ in (1, 2):
        key = ledger.key()
        keys[key.key_id] = key
        history = History()
        web = Server(ledger.data_dir, ENV, web_workers=2).start()
        try:
            clients = Clients(web.url, key.secret, history, make, threads=4).start()
            wait_until(lambda history=history, round_=round_:
                       len(history.by_phase("ok")) >= scaled(60, 200) // round_ ** 2,
                       60, 0.02, "admissions")
            clients.stop()
        finally:
            web.kill()
        acknowledged[round_] = {(key.key_id, e["key"]): e["run_id"]
                                for e in history.by_phase("ok")}
        if round_ == 1:
            conn = sqlite3.connect(ledger.path)
            assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
            conn.close()
    everything = admitted_keys(ledger.data_dir)
    for acks in acknowledged.values():
        assert all(everything.get(k) == rid for k, rid in acks.items())
    wal = (ledger.data_dir / "ledger.db-wal").read_bytes()
    page_size = struct.unpack(">I", wal[8:12])[0]
    # Frames a checkpoint already copied into the ledger file (nBackfill, in the -shm
    # the killed server left) are never torn: a checkpoint copies only synced frames.
    backfilled = struct.unpack("=I", (ledger.data_dir / "ledger.db-shm").read_bytes()[96:100])[0]
    ends = [end for end in commit_ends(wal)
            if end > WAL_HEADER + backfilled * (FRAME_HEADER + page_size)]
    assert len(ends) >= 5, f"only {len(ends)} transactions in the WAL"
    rng = random.Random(7)
    damages = {
        "cut inside the last frame": (wal[:ends[-1] - 100], ends[-2]),
        "cut at the frame boundary before the last commit frame":
            (wal[:ends[-1] - FRAME_HEADER - page_size], ends[-2]),
        "last commit frame torn (its page garbage)":
            (wal[:ends[-1] - page_size] + rng.randbytes(page_size) + wal[ends[-1]:], ends[-2]),
        "garbage appended after the last commit frame":
            (wal[:ends[-1]] + rng.randbytes(3 * (FRAME_HEADER + page_size)), ends[-1]),
    }
    for _ in range(scaled(2, 10)):
        cut = rng.randrange(ends[0], ends[-1])
        damages[f"cut at byte {cut} of {ends[-1]}"] = (
            wal[:cut], max(end for end in ends if end <= cut))
    for number, (damage, (damaged_wal, committed_end)) in enumerate(damages.items()):
        # What was committed before the damage: the WAL cut right after that commit.
        intact = tmp_path / f"intact-{number}"
        copy = tmp_path / f"damaged-{number}" / "data"
        for folder, contents in ((intact, wal[:committed_end]), (copy, damaged_wal)):
            shutil.copytree(ledger.data_dir, folder)
            (folder / "ledger.db-wal").write_bytes(contents)
        expected = admitted_keys(intact)
        # Round one was in the ledger file before the damage: all of it stays.
        assert all(expected.get(k) == rid for k, rid in acknowledged[1].items()), damage
        damaged = Ledger(copy)
        checked = db_check(damaged)
        assert checked.returncode == 0, f"{damage}: {checked.stdout}{checked.stderr}"
        assert admitted_keys(copy) == expected, damage
        assert runstile(damaged, "recover").returncode == 0, damage
        web = Server(damaged.data_dir, ENV, web_workers=1).start()
        try:
            session = requests.Session()
            for (key_id, idem), rid in rng.sample(sorted(expected.items()),
                                                  min(40, len(expected))):
                answer = session.post(f"{web.url}/v1/runs", json=make(idem), timeout=30,
                                      headers={**keys[key_id].headers, "Idempotency-Key": idem})
                assert (answer.status_code, answer.json()["id"], answer.json()["replayed"]) \
                    == (202, rid, True), damage
            fresh = session.post(f"{web.url}/v1/runs", json=make("after"), timeout=30,
                                 headers={**keys[key_id].headers, "Idempotency-Key": "after"})
            assert fresh.status_code == 202 and not fresh.json()["replayed"], damage
        finally:
            web.kill()
        assert db_check(damaged).returncode == 0, damage
        print(f"{damage}: {len(expected)} runs kept, "
              f"{len(everything) - len(expected)} committed after the damage lost")
    total = sum(len(acks) for acks in acknowledged.values())
    FIGURES.append(("WAL tail cut / torn / garbage appended", len(damages), total, total,
                    0, 0, 0, 0, 0, 0, 0, 0, round(time.monotonic() - started)))


#: Where a page of garbage lands: the database header and schema, or a leaf of a table
#: or index (the short profile damages the first three).
DAMAGED_PAGES = ("page 1", "runs", "idempotency_keys", "sqlite_autoindex_runs_1", "events",
                 "journal")


@pytest.mark.parametrize("target", DAMAGED_PAGES[:scaled(3, len(DAMAGED_PAGES))])
def test_a_page_of_garbage_is_detected_and_never_answered_as_a_missing_or_new_run(
        finished, tmp_path, target):
    """(c) One page of the ledger file overwritten with random bytes: `runstile db
    check` fails, recovery succeeds or stops with a clear error, and every good run is
    either answered as it was (GET, and a replay of its admission) or refused with 503
    — never a 404, never a second run for its key; a worker refuses to boot on a ledger
    it cannot recover (and /readyz then answers 503)."""
    started = time.monotonic()
    ledger = copy_of(finished, tmp_path)
    conn = sqlite3.connect(ledger.path)
    assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = [1] if target == "page 1" else [r[0] for r in conn.execute(
        "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf'", (target,))]
    conn.close()
    rng = random.Random(target)
    page = rng.choice(pages)
    with open(ledger.path, "r+b") as handle:
        handle.seek((page - 1) * page_size)
        handle.write(rng.randbytes(page_size))

    assert_fails_closed(db_check(ledger), "the ledger is damaged")
    recovered = runstile(ledger, "recover")
    if recovered.returncode != 0:
        assert_fails_closed(recovered, "the ledger is damaged")
    web = Serving(ledger.data_dir, ENV, web_workers=1)
    try:
        web.start()
    except AssertionError as refused:  # serve checks the ledger before it listens
        assert "the ledger is damaged" in str(refused)
        FIGURES.append((f"garbage page ({target}): serve refuses", 1, 0, 0, 0, 0, 0, 0, 0, 0,
                        0, 0, round(time.monotonic() - started)))
        return
    answers = collections.Counter()
    try:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {finished.secret}"}
        for idem, (rid, body) in finished.bodies.items():
            status, attempt, result = finished.runs[rid]
            got = session.get(f"{web.url}/v1/runs/{rid}", headers=headers, timeout=30)
            if got.status_code == 200:
                run = got.json()
                assert (run["status"], run["attempt"], json.dumps(run["result"],
                        separators=(",", ":"))) == (status, attempt, result), rid
            else:
                assert (got.status_code, got.json()["error"]["code"]) == \
                    (503, "ledger_corrupt"), got.text
            replay = session.post(f"{web.url}/v1/runs", json=body, timeout=30,
                                  headers={**headers, "Idempotency-Key": idem})
            if replay.status_code == 202:
                assert (replay.json()["id"], replay.json()["replayed"]) == (rid, True), idem
            else:
                assert replay.status_code == 503, replay.text
            answers[got.status_code] += 1
            answers[replay.status_code] += 1
        node = "worker boots"
        try:
            Workers(ledger.data_dir, ENV, workers=1, threads=2).start().kill()
        except AssertionError as refused:
            assert "boot recovery failed: the ledger is damaged" in str(refused)
            ready = requests.get(f"{web.url}/readyz", timeout=5)
            assert ready.status_code == 503, ready.text
            node = "worker refuses to boot, /readyz 503"
    finally:
        web.kill()
    print(f"garbage page {page} ({target}): answers {dict(answers)}, {node}")
    FIGURES.append((f"garbage page ({target}): {node}", 1, sum(answers.values()),
                    answers.get(200, 0) + answers.get(202, 0), answers.get(503, 0),
                    sum(n for s, n in answers.items() if s >= 500 and s != 503), 0, 0, 0, 0,
                    0, 0, round(time.monotonic() - started)))


# ---------------------------------------------------------------- 4. SQLITE_BUSY storm

#: A process that holds a transaction open for ``hold_s`` seconds, again and again, until
#: ``stop`` exists; prints how many it held.  Plain sqlite3, as any tool would: a read
#: transaction (``BEGIN``, then a read) or the write lock (``BEGIN IMMEDIATE``), which
#: no WriterGate knows about, so runstile's writers wait in SQLite's busy handler.
HOLDER = """
import os, sqlite3, sys, time
path, begin, hold_s, pause_s, stop = sys.argv[1:6]
held = 0
while not os.path.exists(stop):
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute(begin)
    conn.execute("SELECT COUNT(*) FROM events").fetchone()  # the read snapshot starts here
    time.sleep(float(hold_s))
    conn.execute("COMMIT")
    conn.close()
    held += 1
    time.sleep(float(pause_s))
print(held)
"""


def test_a_busy_storm_of_writers_recoveries_and_a_long_reader_never_answers_5xx(
        ledger, tmp_path):
    """Eight web processes admitting for 16 client threads, two worker processes,
    `runstile recover` in a loop in another process, a reader holding a read transaction
    for 3 s at a time and another process taking the write lock for 1 s every 3 s: no
    answer is a 5xx (every busy wait ends inside RUNSTILE_BUSY_TIMEOUT_MS), every
    recovery pass succeeds, and the checker finds nothing wrong."""
    started = time.monotonic()
    log = tmp_path / "executions.log"
    key = ledger.key()
    workers = Workers(ledger.data_dir, ENV, workers=2, threads=8).start()
    web = Server(ledger.data_dir, ENV, web_workers=8).start()
    history, refusals = History(), Refusals()
    clients = Clients(web.url, key.secret, history, body_for(log), threads=16, pause_s=0.02,
                      observe=refusals)
    stop = tmp_path / "stop"
    reader, writer = [subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ledger.path), begin, hold_s, pause_s, str(stop)],
        stdout=subprocess.PIPE, text=True) for begin, hold_s, pause_s in (
            ("BEGIN", "3", "0"), ("BEGIN IMMEDIATE", "1", "2"))]
    passes, failed_passes = [], []

    def recover_in_a_loop():
        while not stop.exists():
            done = runstile(ledger, "recover", "--json")
            (passes if done.returncode == 0 else failed_passes).append(done.stderr[-500:])

    recoverer = threading.Thread(target=recover_in_a_loop, daemon=True)
    try:
        clients.start()
        recoverer.start()
        time.sleep(scaled(10, 60))
    finally:
        clients.stop()
        stop.touch()
        recoverer.join(180)
        read = int(reader.communicate(timeout=60)[0] or 0)
        locked = int(writer.communicate(timeout=60)[0] or 0)
    try:
        print(f"\nBUSY storm: {len(passes)} recovery passes ({len(failed_passes)} failed), "
              f"{read} read transactions of 3 s, write lock held {locked} times for 1 s")
        assert failed_passes == [], failed_passes[:3]
        assert read >= scaled(3, 15) and locked >= scaled(3, 15)
        assert len(passes) >= scaled(5, 30)
        settle(ledger, history, log, clients, refusals,
               f"BUSY storm: 8 web processes, 16 clients, {len(passes)} recover passes, "
               f"{read} reads of 3 s, {locked} write locks of 1 s", locked, started)
        fivexx = {s: n for s, n in clients.answers.items() if isinstance(s, int) and s >= 500}
        assert fivexx == {}, fivexx
    finally:
        web.kill()
        workers.kill()
