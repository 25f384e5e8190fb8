"""The execution benchmark of issue 3: end-to-end runs/s and idle start latency.

Targets, measured one after another (never concurrently), each on a fresh temporary
directory and free ports, each in process groups that are killed when it ends:

  runstile        ``runstile up --workers 2 --threads 4 --web-workers 2 --tasks
                  bench.bench_tasks``: HTTP admission, embedded SQLite broker, worker
                  processes; every durability setting at its default.
  dbos            DBOS on a SQLite system database as DBOS configures it (rollback
                  journal, SQLite's default synchronous=FULL); 2 worker processes with
                  ``worker_concurrency=4`` on a durable queue; clients enqueue with
                  DBOSClient.
  dbos-wal        the same with the system database in WAL mode, synchronous=FULL
                  (runstile's own journal settings), to make sure the floor is not won
                  on the journal mode.
  dramatiq-redis  bare Dramatiq, RedisBroker on a private redis-server (no persistence),
                  2 processes x 4 threads, a no-op actor.  No durability guarantee
                  comparable to the others: a reference for the cost of the ledger.
  runstile-redis  ``runstile worker --workers 2 --threads 4`` + ``runstile serve
                  --web-workers 2`` with RUNSTILE_BROKER_URL on a private redis-server
                  (the same one dramatiq-redis gets): the same ledger, Redis transport.
  dramatiq-rabbitmq  bare Dramatiq, RabbitmqBroker on the machine's RabbitMQ (a queue
                  name unique to the run, deleted afterwards), 2 processes x 4 threads.
  huey-sqlite     huey's SqliteHuey as shipped (WAL, synchronous FULL): two
                  ``huey_consumer -w 4 -k thread`` processes on one file (2 x 4).

For each: N runs submitted by 16 closed-loop clients (processes x threads, one
submission in flight per client), runs/s = N / (first submission -> last run
completed); then, with the system idle, sequential runs with a pause between them, and
the delay from the client's submit call to the body's first line (both ``time.time()``
on this machine), p50/p95.  Order per target: start, warm-up, idle latency, throughput.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .admission import BIN, HOST, REPO, clean_env, free_port, group_cpu_s, temp_dir
from .load import quiet_child

#: DBOS release installed on demand (the version listed in the package index we use).
DBOS_VERSION = "3.4.0"
#: Worker shape shared by every target: 2 processes x 4 threads (8 runs at once).
WORKER_PROCESSES = 2
WORKER_THREADS = 4
#: runstile's web tier in `runstile up` (gunicorn processes).
WEB_WORKERS = 2
#: ``python -m runstile`` from the repository root, so that ``bench.bench_tasks`` is
#: importable in every process of ``runstile up`` (the console script's sys.path does
#: not hold the working directory).
RUNSTILE = [sys.executable, "-m", "runstile"]
#: Seconds between two polls of a target's completion count.
POLL_S = 0.02

ALL_TARGETS = ("runstile", "dbos", "dbos-wal", "dramatiq-redis", "runstile-redis",
               "dramatiq-rabbitmq", "huey-sqlite")
#: huey release installed on demand, like DBOS (never a runstile dependency).
HUEY_VERSION = "3.5.4"
#: The machine's shared RabbitMQ (the bench only ever creates and deletes its own queue).
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672"


@dataclass
class ExecSettings:
    runs: int
    latency_runs: int
    latency_gap_s: float
    warmup_runs: int
    processes: int
    threads: int
    timeout_s: float
    dbos_poll_s: float
    dbos_concurrency: str
    huey_delay_s: float
    huey_max_delay_s: float
    amqp_url: str
    targets: tuple[str, ...]
    install: bool
    keep: bool

    @classmethod
    def from_env(cls) -> ExecSettings:
        env = os.environ.get
        targets = tuple(t.strip() for t in env("BENCH_EXEC_TARGETS", ",".join(ALL_TARGETS))
                        .split(",") if t.strip())
        unknown = set(targets) - set(ALL_TARGETS)
        if unknown:
            raise SystemExit(f"BENCH_EXEC_TARGETS: unknown {sorted(unknown)}; "
                             f"choose from {', '.join(ALL_TARGETS)}")
        return cls(runs=int(env("BENCH_E2E_RUNS", "2000")),
                   latency_runs=int(env("BENCH_LATENCY_RUNS", "50")),
                   latency_gap_s=float(env("BENCH_LATENCY_GAP_MS", "100")) / 1000,
                   warmup_runs=int(env("BENCH_E2E_WARMUP_RUNS", "10")),
                   processes=int(env("BENCH_E2E_CLIENT_PROCESSES", "4")),
                   threads=int(env("BENCH_E2E_CLIENT_THREADS", "4")),
                   timeout_s=float(env("BENCH_E2E_TIMEOUT", "180")),
                   dbos_poll_s=float(env("BENCH_DBOS_POLL_S", "0.01")),
                   dbos_concurrency=env("BENCH_DBOS_WORKER_CONCURRENCY", str(WORKER_THREADS)),
                   huey_delay_s=float(env("BENCH_HUEY_DELAY_S", "0.1")),
                   huey_max_delay_s=float(env("BENCH_HUEY_MAX_DELAY_S", "10")),
                   amqp_url=env("BENCH_AMQP_URL", AMQP_URL),
                   targets=targets,
                   install=env("BENCH_NO_INSTALL") != "1",
                   keep=env("BENCH_KEEP") == "1")


@dataclass
class TargetResult:
    name: str
    measured: bool = False
    reason: str | None = None            # why not measured / why invalid
    runs: int = 0                        # runs asked for
    accepted: int = 0                    # submissions acknowledged
    completed: int = 0                   # runs seen completed
    errors: dict[str, int] = field(default_factory=dict)
    total_s: float | None = None         # first submission -> last completion
    submit_s: float | None = None        # first submission -> last acknowledgement
    latencies_ms: list[float] = field(default_factory=list)
    latency_missing: int = 0
    ledger_latency_ms: list[float] = field(default_factory=list)   # runstile only
    server_cpu_s: float | None = None
    config: dict = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return (self.measured and not self.errors and self.completed == self.runs
                and self.latency_missing == 0)

    @property
    def runs_per_s(self) -> float | None:
        return self.completed / self.total_s if self.measured and self.total_s else None

    @property
    def submit_per_s(self) -> float | None:
        return self.accepted / self.submit_s if self.measured and self.submit_s else None


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


# --------------------------------------------------------------------------- processes

class Group:
    """Processes each started as the leader of a new session and process group;
    ``stop`` kills every one of those groups (children of children included)."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self.version: str | None = None      # of the server it runs, when known

    @property
    def pgids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_path, "ab")
        self._logs.append(log)
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.name}: process {proc.pid} exited with "
                                   f"{proc.returncode}; log:\n{self.log_tail()}")

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_log(self, needle: str, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            if self.log_text().count(needle) >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: {count} x {needle!r} not logged within "
                           f"{timeout_s:g}s; log:\n{self.log_tail()}")

    def cpu_s(self) -> float:
        """user+system CPU seconds of every live process in these groups."""
        return sum(group_cpu_s(pgid) for pgid in self.pgids)

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            for pgid in self.pgids:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
            if all(p.poll() is not None for p in self.procs):
                break
        # Children of our children (gunicorn or dramatiq workers) may outlive them.
        for pgid in self.pgids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for log in self._logs:
            log.close()


def _wait_http_ready(port: int, group: Group, timeout_s: float = 60) -> None:
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        group.check_alive()
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(f"http://{HOST}:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"{group.name}: /readyz not 200 within {timeout_s:g}s; "
                       f"log:\n{group.log_tail()}")


# --------------------------------------------------------------------------- clients
#
# A "factory" runs once in each client process (after fork) and returns a function
# that, called once per client thread, returns ``submit(key, mark)``.  ``submit`` raises
# on any failure; the exception's text is the error kind.  ``key`` is unique per
# submission (Idempotency-Key / workflow id / tag); ``mark`` is a file path for the
# latency probe or None.

Factory = Callable[[], Callable[[], Callable[[str, str | None], None]]]


def _loop_child(factory: Factory, index: int, processes: int, threads: int, n: int,
                tag: str, barrier, pipe) -> None:
    quiet_child()
    errors: Counter = Counter()
    out = {"sent": 0, "errors": errors, "last": 0.0, "cpu": 0.0, "init_error": None}
    try:
        per_thread = factory()
        submits = [per_thread() for _ in range(threads)]
    except Exception as exc:  # reported; the parent marks the target not measured
        out["init_error"] = f"{type(exc).__name__}: {exc}"
        barrier.abort()
        pipe.send(out)
        return
    lock = threading.Lock()
    total = processes * threads

    def work(t: int) -> None:
        local: Counter = Counter()
        sent = 0
        last = 0.0
        submit = submits[t]
        for j in range(index * threads + t, n, total):
            try:
                submit(f"{tag}-{j}", None)
            except Exception as exc:
                local[f"{type(exc).__name__}: {exc}"[:120]] += 1
            sent += 1
            last = time.monotonic()
        with lock:
            errors.update(local)
            out["sent"] += sent
            out["last"] = max(out["last"], last)

    try:
        barrier.wait(120)
    except threading.BrokenBarrierError:
        pipe.send(out)
        return
    cpu0 = os.times()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cpu1 = os.times()
    out["cpu"] = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    pipe.send(out)


@dataclass
class Throughput:
    accepted: int
    errors: dict[str, int]
    completed: int
    total_s: float
    submit_s: float
    server_cpu_s: float
    timed_out: bool


def closed_loop(factory: Factory, n: int, cfg: ExecSettings, tag: str,
                count_done: Callable[[], int], groups: list[Group]) -> Throughput:
    """Submit ``n`` runs from processes x threads closed-loop clients; return when
    ``count_done()`` reaches the number of accepted submissions (or on timeout)."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(cfg.processes + 1)
    procs, pipes = [], []
    try:
        for index in range(cfg.processes):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_loop_child, args=(factory, index, cfg.processes,
                                                      cfg.threads, n, tag, barrier, child),
                            daemon=True)
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        try:
            barrier.wait(120)
        except threading.BrokenBarrierError:
            reports = [pipe.recv() for pipe in pipes if pipe.poll(5)]
            failures = [r["init_error"] for r in reports if r.get("init_error")]
            raise RuntimeError("client processes could not start: "
                               + ("; ".join(failures) or "barrier broken")) from None
        t0 = time.monotonic()
        cpu0 = sum(g.cpu_s() for g in groups)
        expected, accepted, last_ack = n, None, None
        errors: Counter = Counter()
        reports: list = [None] * len(pipes)
        done = 0
        deadline = t0 + cfg.timeout_s
        next_check = t0
        while True:
            for i, pipe in enumerate(pipes):
                if reports[i] is None and pipe.poll():
                    reports[i] = pipe.recv()
            if accepted is None and all(r is not None for r in reports):
                errors = Counter()
                for r in reports:
                    errors.update(r["errors"])
                accepted = sum(r["sent"] for r in reports) - sum(errors.values())
                last_ack = max(r["last"] for r in reports)
                expected = accepted
            done = count_done()
            now = time.monotonic()
            if accepted is not None and done >= expected:
                break
            if now >= deadline:
                break
            if now >= next_check:
                next_check = now + 0.5
                for g in groups:
                    g.check_alive()
            time.sleep(POLL_S)
        t_done = time.monotonic()
        cpu1 = sum(g.cpu_s() for g in groups)
        timed_out = accepted is None or done < expected
        if accepted is None:
            accepted = 0
            last_ack = t_done
        for p in procs:
            p.join(10)
        return Throughput(accepted=accepted, errors=dict(errors), completed=done,
                          total_s=t_done - t0, submit_s=max(1e-9, last_ack - t0),
                          server_cpu_s=cpu1 - cpu0, timed_out=timed_out)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _marks(path: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = float(parts[1])
    return out


def _latency_child(factory: Factory, mark_path: str, warmup: int, count: int, gap_s: float,
                   wait_s: float, pipe) -> None:
    quiet_child()
    try:
        submit = factory()()
        sent: dict[str, float] = {}
        path = Path(mark_path)
        previous = None
        for k in range(warmup + count):
            key = f"warm-{k}" if k < warmup else f"lat-{k - warmup}"
            # Idle means idle: the previous run must have started before the next goes in.
            if previous is not None:
                deadline = time.monotonic() + wait_s
                while previous not in _marks(path) and time.monotonic() < deadline:
                    time.sleep(0.005)
            t_send = time.time()
            submit(key, mark_path)
            sent[key] = t_send
            previous = key
            time.sleep(max(0.0, t_send + gap_s - time.time()))
        deadline = time.monotonic() + wait_s
        while previous not in _marks(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        pipe.send({"sent": sent, "error": None})
    except Exception as exc:
        pipe.send({"sent": {}, "error": f"{type(exc).__name__}: {exc}"})


def latency_probe(factory: Factory, cfg: ExecSettings, workdir: Path) -> tuple[list[float], int]:
    """Sequential submissions on an idle system; returns (submit->start ms, missing)."""
    ctx = multiprocessing.get_context("fork")
    mark_path = workdir / "starts.txt"
    parent, child = ctx.Pipe(duplex=False)
    wait_s = 10.0
    p = ctx.Process(target=_latency_child,
                    args=(factory, str(mark_path), cfg.warmup_runs, cfg.latency_runs,
                          cfg.latency_gap_s, wait_s, child), daemon=True)
    p.start()
    child.close()
    try:
        budget = (cfg.warmup_runs + cfg.latency_runs) * (cfg.latency_gap_s + wait_s) + 60
        if not parent.poll(budget):
            raise RuntimeError("the latency probe did not report back")
        out = parent.recv()
        p.join(10)
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)
    if out["error"]:
        raise RuntimeError(f"latency probe: {out['error']}")
    marks = _marks(mark_path)
    lat, missing = [], 0
    for key, t_send in out["sent"].items():
        if not key.startswith("lat-"):
            continue
        if key in marks:
            lat.append((marks[key] - t_send) * 1000.0)
        else:
            missing += 1
    return lat, missing


class _Count:
    """``sql``'s count on the SQLite file ``db_path``, on one read-only connection kept
    open between calls: ``closed_loop`` polls it every POLL_S while the target runs on the
    same cores, and a connection opened per poll cost about 1 ms of CPU each (0.25 ms on
    an open one, measured on a 2,000-run ledger), taken from the target being measured."""

    def __init__(self, db_path: Path, sql: str) -> None:
        self.db_path, self.sql = db_path, sql
        self._conn: sqlite3.Connection | None = None

    def __call__(self) -> int:
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True,
                                             timeout=5)
            return self._conn.execute(self.sql).fetchone()[0]
        except sqlite3.OperationalError:
            self.close()
            return 0  # not created yet, or briefly locked (rollback journal): poll again

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


# --------------------------------------------------------------------------- runstile

def _runstile_factory(port: int, secret: str) -> Factory:
    def per_process():
        def per_thread():
            state = {"conn": http.client.HTTPConnection(HOST, port, timeout=30)}
            base = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}

            def submit(key: str, mark: str | None) -> None:
                payload = {"mark": mark, "tag": key} if mark else {}
                body = json.dumps({"task": "bench.noop", "input": payload},
                                  separators=(",", ":")).encode()
                try:
                    conn = state["conn"]
                    conn.request("POST", "/v1/runs", body, {**base, "Idempotency-Key": key})
                    resp = conn.getresponse()
                    resp.read()
                    if resp.will_close:
                        conn.close()
                except (OSError, http.client.HTTPException):
                    state["conn"].close()
                    state["conn"] = http.client.HTTPConnection(HOST, port, timeout=30)
                    raise
                if resp.status != 202:
                    raise RuntimeError(f"HTTP {resp.status}")
            return submit
        return per_thread
    return per_process


def _runstile_key(data: Path, env: dict[str, str]) -> str:
    created = subprocess.run(
        [*RUNSTILE, "keys", "create", "--profile", "bench", "--json",
         "--data-dir", str(data)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if created.returncode != 0:
        raise RuntimeError(f"keys create failed ({created.returncode}): {created.stderr}")
    return json.loads(created.stdout.strip().splitlines()[-1])["secret"]


def _measure_runstile(res: TargetResult, cfg: ExecSettings, work: Path, data: Path,
                      port: int, secret: str, groups: list[Group]) -> Throughput:
    """Latency probe then closed-loop throughput against a running runstile; the
    ledger's own record says what started and what completed."""
    factory = _runstile_factory(port, secret)
    ledger = data / "ledger.db"
    res.latencies_ms, res.latency_missing = latency_probe(factory, cfg, work)
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as c:
        res.ledger_latency_ms = [
            row[0] * 1000.0 for row in c.execute(
                "SELECT started_at - created_at FROM runs WHERE "
                "json_extract(input, '$.tag') LIKE 'lat-%' AND started_at IS NOT NULL")]
        before = c.execute("SELECT COUNT(*) FROM runs WHERE status = 'completed'"
                           ).fetchone()[0]
    with contextlib.closing(_Count(ledger, "SELECT COUNT(*) FROM runs WHERE "
                                           "status = 'completed'")) as completed:
        tp = closed_loop(factory, cfg.runs, cfg, tag=f"tp-{os.getpid()}-{time.time_ns()}",
                         count_done=lambda: completed() - before, groups=groups)
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as c:
        res.config["statuses_after"] = dict(c.execute(
            "SELECT status, COUNT(*) FROM runs GROUP BY status").fetchall())
    return tp


def bench_runstile(cfg: ExecSettings) -> TargetResult:
    res = TargetResult("runstile", runs=cfg.runs, config={
        "command": f"python -m runstile up --workers {WORKER_PROCESSES} --threads {WORKER_THREADS} "
                   f"--web-workers {WEB_WORKERS} --tasks bench.bench_tasks",
        "broker": "embedded SQLite (default)", "durability": "defaults (WAL, synchronous=FULL)"})
    with temp_dir("bench-exec-runstile-", cfg.keep) as work:
        data = work / "data"
        env = clean_env()
        secret = _runstile_key(data, env)
        port = free_port()
        group = Group("runstile up", work / "up.log")
        try:
            group.start([*RUNSTILE, "up", "--data-dir", str(data), "--port",
                         str(port), "--workers", str(WORKER_PROCESSES), "--threads",
                         str(WORKER_THREADS), "--web-workers", str(WEB_WORKERS),
                         "--tasks", "bench.bench_tasks"], env)
            _wait_http_ready(port, group)
            group.wait_log("worker up:", WORKER_PROCESSES)
            if "bootstrap admin key" in group.log_text():
                raise RuntimeError("runstile up printed a bootstrap key although one existed")
            tp = _measure_runstile(res, cfg, work, data, port, secret, [group])
        finally:
            group.stop()
        _fill(res, tp)
        return res


def bench_runstile_redis(cfg: ExecSettings) -> TargetResult:
    """``runstile worker`` + ``runstile serve`` with RUNSTILE_BROKER_URL on a private
    redis-server: the same ledger and durability, Redis as the transport."""
    res = TargetResult("runstile-redis", runs=cfg.runs, config={
        "command": f"RUNSTILE_BROKER_URL=redis://… python -m runstile worker --workers "
                   f"{WORKER_PROCESSES} --threads {WORKER_THREADS} --tasks bench.bench_tasks; "
                   f"python -m runstile serve --web-workers {WEB_WORKERS} --tasks "
                   "bench.bench_tasks",
        "broker": "Redis (private redis-server --save '' --appendonly no)",
        "durability": "ledger defaults (WAL, synchronous=FULL); Redis only carries messages"})
    with temp_dir("bench-exec-runstile-redis-", cfg.keep) as work:
        data = work / "data"
        rgroup = Group("redis-server", work / "redis.log")
        wgroup = Group("runstile worker", work / "worker.log")
        sgroup = Group("runstile serve", work / "serve.log")
        try:
            url, client = _start_redis(rgroup, work)
            client.close()
            res.config["redis_server"] = rgroup.version
            env = clean_env(RUNSTILE_BROKER_URL=url, RUNSTILE_NODE_ID="bench-redis")
            secret = _runstile_key(data, env)
            # The worker first: serve's /readyz waits for the worker's boot recovery.
            wgroup.start([*RUNSTILE, "worker", "--data-dir", str(data), "--workers",
                          str(WORKER_PROCESSES), "--threads", str(WORKER_THREADS),
                          "--tasks", "bench.bench_tasks"], env)
            wgroup.wait_log("worker up:", WORKER_PROCESSES)
            port = free_port()
            sgroup.start([*RUNSTILE, "serve", "--data-dir", str(data), "--port", str(port),
                          "--web-workers", str(WEB_WORKERS), "--tasks", "bench.bench_tasks"],
                         env)
            _wait_http_ready(port, sgroup)
            if "bootstrap admin key" in sgroup.log_text() + wgroup.log_text():
                raise RuntimeError("runstile printed a bootstrap key although one existed")
            tp = _measure_runstile(res, cfg, work, data, port, secret,
                                   [sgroup, wgroup, rgroup])
        finally:
            sgroup.stop()
            wgroup.stop()
            rgroup.stop()
        _fill(res, tp)
        return res


def _fill(res: TargetResult, tp: Throughput) -> None:
    res.measured = True
    res.accepted, res.errors, res.completed = tp.accepted, tp.errors, tp.completed
    res.total_s, res.submit_s, res.server_cpu_s = tp.total_s, tp.submit_s, tp.server_cpu_s
    problems = []
    if tp.timed_out:
        problems.append(f"timed out: {tp.completed} of {tp.accepted} accepted runs completed")
    if tp.errors:
        problems.append(f"{sum(tp.errors.values())} submissions failed")
    if res.latency_missing:
        problems.append(f"{res.latency_missing} latency runs never started")
    res.reason = "; ".join(problems) or None


# --------------------------------------------------------------------------- DBOS

def ensure_package(module: str, requirement: str, install: bool) -> str | None:
    """Import ``module``, pip-installing ``requirement`` into this venv if needed (a
    benchmark peer, never a runstile dependency).  Returns None when usable, else why not."""
    import importlib
    try:
        importlib.import_module(module)
        return None
    except ImportError:
        pass
    if not install:
        return f"{module} is not installed (BENCH_NO_INSTALL=1)"
    print(f"      installing {requirement} into {sys.prefix} (benchmark only) ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return f"pip install {requirement} failed: {done.stderr.strip()[-300:]}"
    importlib.invalidate_caches()
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{requirement} installed but not importable: {exc}"
    return None


def ensure_dbos(install: bool) -> str | None:
    """Import dbos, installing the pinned release into this venv if needed."""
    return ensure_package("dbos", f"dbos=={DBOS_VERSION}", install)


def _dbos_factory(url: str, wal: bool) -> Factory:
    def per_process():
        from .peers import dbos_peer
        client = dbos_peer.client(url, wal, pool_size=8)

        def per_thread():
            def submit(key: str, mark: str | None) -> None:
                dbos_peer.enqueue(client, key, mark)
            return submit
        return per_thread
    return per_process


def bench_dbos(cfg: ExecSettings, wal: bool) -> TargetResult:
    import dbos
    name = "dbos-wal" if wal else "dbos"
    res = TargetResult(name, runs=cfg.runs, config={
        "dbos": getattr(dbos, "__version__", None) or _dist_version("dbos"),
        "system_database": "SQLite, WAL, synchronous=FULL" if wal
        else "SQLite as DBOS opens it (rollback journal, synchronous=FULL)",
        "workers": f"{WORKER_PROCESSES} processes, queue worker_concurrency="
                   f"{cfg.dbos_concurrency}",
        "queue_polling_interval_s": cfg.dbos_poll_s,
        "command": f"{WORKER_PROCESSES} x python -m bench.peers.dbos_peer sqlite:///… "
                   f"EXECUTOR (register_queue worker_concurrency={cfg.dbos_concurrency}, "
                   f"polling_interval_sec={cfg.dbos_poll_s:g})",
        "enqueue": "DBOSClient.enqueue with a unique workflow_id"})
    from .peers import dbos_peer
    with temp_dir(f"bench-exec-{name}-", cfg.keep) as work:
        db_file = work / "dbos.sqlite"
        url = f"sqlite:///{db_file}"
        env = clean_env(BENCH_DBOS_CONCURRENCY=cfg.dbos_concurrency,
                        BENCH_DBOS_POLL_S=str(cfg.dbos_poll_s),
                        BENCH_DBOS_WAL="1" if wal else "0")
        # Create the schema once, before any worker starts.
        migrate = subprocess.run([sys.executable, "-c",
                                  "import sys; from dbos import DBOS; DBOS.migrate(sys.argv[1])",
                                  url], env=env, cwd=REPO, capture_output=True, text=True,
                                 timeout=120)
        if migrate.returncode != 0:
            raise RuntimeError(f"DBOS.migrate failed: {migrate.stderr[-500:]}")
        if wal:
            with contextlib.closing(sqlite3.connect(db_file)) as c:
                c.execute("PRAGMA journal_mode=WAL")
        group = Group(name, work / "workers.log")
        try:
            for i in range(WORKER_PROCESSES):
                group.start([sys.executable, "-m", "bench.peers.dbos_peer", url,
                             f"bench-executor-{i + 1}"], env)
            group.wait_log("dbos worker", WORKER_PROCESSES)
            with contextlib.closing(sqlite3.connect(db_file)) as c:
                res.config["journal_mode"] = c.execute("PRAGMA journal_mode").fetchone()[0]
            factory = _dbos_factory(url, wal)
            res.latencies_ms, res.latency_missing = latency_probe(factory, cfg, work)
            done_sql = (f"SELECT COUNT(*) FROM workflow_status WHERE status = 'SUCCESS' "
                        f"AND queue_name = '{dbos_peer.QUEUE}'")
            with contextlib.closing(_Count(db_file, done_sql)) as done:
                before = done()
                tp = closed_loop(factory, cfg.runs, cfg,
                                 tag=f"tp-{os.getpid()}-{time.time_ns()}",
                                 count_done=lambda: done() - before, groups=[group])
            with contextlib.closing(sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)) as c:
                res.config["statuses_after"] = dict(c.execute(
                    "SELECT status, COUNT(*) FROM workflow_status GROUP BY status").fetchall())
        finally:
            group.stop()
        _fill(res, tp)
        return res


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(name)
    return None


# --------------------------------------------------------------------------- Dramatiq

def _dramatiq_factory() -> Factory:
    def per_process():
        from .peers import dramatiq_peer

        def per_thread():
            def submit(key: str, mark: str | None) -> None:
                dramatiq_peer.bench_noop.send(mark, key)
            return submit
        return per_thread
    return per_process


def _start_redis(group: Group, work: Path):
    """A private ``redis-server`` without persistence on a free port; (url, client)."""
    import redis
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise NotMeasured("redis-server is not installed")
    port = free_port()
    url = f"redis://{HOST}:{port}/0"
    group.start([redis_server, "--port", str(port), "--bind", HOST, "--save", "",
                 "--appendonly", "no", "--dir", str(work)], clean_env())
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        group.check_alive()
        try:
            client.ping()
            group.version = client.info().get("redis_version")
            return url, client
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not up; log:\n{group.log_tail()}") from None
            time.sleep(0.05)


@contextlib.contextmanager
def _environ(**values: str):
    """Set variables in this process for the forked client processes to read."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_dramatiq(cfg: ExecSettings) -> TargetResult:
    res = TargetResult("dramatiq-redis", runs=cfg.runs, config={
        "dramatiq": _dist_version("dramatiq"),
        "workers": f"dramatiq CLI --processes {WORKER_PROCESSES} --threads {WORKER_THREADS}",
        "command": f"dramatiq bench.peers.dramatiq_peer --processes {WORKER_PROCESSES} "
                   f"--threads {WORKER_THREADS} (redis-server --save '' --appendonly no)",
        "broker": "RedisBroker, private redis-server --save '' --appendonly no",
        "durability": "none comparable (no persistence, no run record)"})
    with temp_dir("bench-exec-dramatiq-", cfg.keep) as work:
        rgroup = Group("redis-server", work / "redis.log")
        wgroup = Group("dramatiq", work / "workers.log")
        try:
            url, client = _start_redis(rgroup, work)
            res.config["redis_server"] = rgroup.version
            with _environ(BENCH_REDIS_URL=url):     # read by the forked client processes
                from .peers.dramatiq_peer import DONE_KEY
                wgroup.start([str(BIN / "dramatiq"), "bench.peers.dramatiq_peer",
                              "--processes", str(WORKER_PROCESSES), "--threads",
                              str(WORKER_THREADS)], clean_env(BENCH_REDIS_URL=url))
                wgroup.wait_log("is ready for action", WORKER_PROCESSES)
                factory = _dramatiq_factory()
                res.latencies_ms, res.latency_missing = latency_probe(factory, cfg, work)
                before = int(client.get(DONE_KEY) or 0)
                tp = closed_loop(factory, cfg.runs, cfg,
                                 tag=f"tp-{os.getpid()}-{time.time_ns()}",
                                 count_done=lambda: int(client.get(DONE_KEY) or 0) - before,
                                 groups=[wgroup, rgroup])
            client.close()
        finally:
            wgroup.stop()
            rgroup.stop()
        _fill(res, tp)
        return res


def _rabbitmq_factory() -> Factory:
    def per_process():
        from .peers import dramatiq_rabbitmq_peer as peer

        def per_thread():
            def submit(key: str, mark: str | None) -> None:
                peer.bench_noop.send(mark, key)
            return submit
        return per_thread
    return per_process


def bench_dramatiq_rabbitmq(cfg: ExecSettings) -> TargetResult:
    """Bare Dramatiq on the machine's RabbitMQ, on a queue of its own (deleted after)."""
    queue = f"runstile-bench-{os.getpid()}-{time.time_ns()}"
    res = TargetResult("dramatiq-rabbitmq", runs=cfg.runs, config={
        "dramatiq": _dist_version("dramatiq"), "pika": _dist_version("pika"),
        "workers": f"dramatiq CLI --processes {WORKER_PROCESSES} --threads {WORKER_THREADS}",
        "command": f"dramatiq bench.peers.dramatiq_rabbitmq_peer --processes "
                   f"{WORKER_PROCESSES} --threads {WORKER_THREADS} (queue runstile-bench-…)",
        "broker": f"RabbitmqBroker, the machine's RabbitMQ, queue {queue} (deleted after)",
        "durability": "durable queue, persistent messages, no publisher confirms; "
                      "no run record"})
    try:
        import pika
        probe = pika.BlockingConnection(pika.URLParameters(cfg.amqp_url))
        with contextlib.suppress(Exception):
            version = probe._impl.server_properties.get("version")
            res.config["rabbitmq_server"] = (version.decode() if isinstance(version, bytes)
                                             else version)
        probe.close()
    except Exception as exc:
        raise NotMeasured(f"RabbitMQ at {cfg.amqp_url} not reachable: "
                          f"{type(exc).__name__}: {exc}") from None
    from .peers.counter import count
    with temp_dir("bench-exec-rabbitmq-", cfg.keep) as work:
        done_file = str(work / "done.count")
        env = {"BENCH_AMQP_URL": cfg.amqp_url, "BENCH_RABBIT_QUEUE": queue,
               "BENCH_DONE_FILE": done_file}
        wgroup = Group("dramatiq-rabbitmq", work / "workers.log")
        try:
            with _environ(**env):
                wgroup.start([str(BIN / "dramatiq"), "bench.peers.dramatiq_rabbitmq_peer",
                              "--processes", str(WORKER_PROCESSES), "--threads",
                              str(WORKER_THREADS)], clean_env(**env))
                wgroup.wait_log("is ready for action", WORKER_PROCESSES)
                factory = _rabbitmq_factory()
                res.latencies_ms, res.latency_missing = latency_probe(factory, cfg, work)
                before = count(done_file)
                tp = closed_loop(factory, cfg.runs, cfg,
                                 tag=f"tp-{os.getpid()}-{time.time_ns()}",
                                 count_done=lambda: count(done_file) - before,
                                 groups=[wgroup])
        finally:
            wgroup.stop()
            with contextlib.suppress(Exception):
                from .peers.dramatiq_rabbitmq_peer import delete_queues
                delete_queues(cfg.amqp_url, queue)
        _fill(res, tp)
        return res


# --------------------------------------------------------------------------- huey

def _huey_factory() -> Factory:
    def per_process():
        from .peers import huey_peer

        def per_thread():
            def submit(key: str, mark: str | None) -> None:
                huey_peer.bench_noop(mark, key)
            return submit
        return per_thread
    return per_process


def bench_huey(cfg: ExecSettings) -> TargetResult:
    """huey's SqliteHuey as shipped: two consumers of 4 worker threads on one file."""
    res = TargetResult("huey-sqlite", runs=cfg.runs, config={
        "huey": _dist_version("huey"),
        "workers": f"{WORKER_PROCESSES} x huey_consumer -w {WORKER_THREADS} -k thread "
                   f"-d {cfg.huey_delay_s:g} -m {cfg.huey_max_delay_s:g}",
        "command": f"{WORKER_PROCESSES} x huey_consumer bench.peers.huey_peer.huey -w "
                   f"{WORKER_THREADS} -k thread -d {cfg.huey_delay_s:g} -m "
                   f"{cfg.huey_max_delay_s:g} (one SQLite file)",
        "storage": "SqliteHuey defaults (WAL, synchronous FULL, busy timeout 5 s)",
        "enqueue": "calling the task from the client process"})
    from .peers.counter import count
    with temp_dir("bench-exec-huey-", cfg.keep) as work:
        db_file = work / "huey.sqlite"
        done_file = str(work / "done.count")
        env = {"BENCH_HUEY_DB": str(db_file), "BENCH_DONE_FILE": done_file}
        group = Group("huey", work / "consumers.log")
        try:
            with _environ(**env):
                # Create the tables once, before two consumers race to.
                subprocess.run([sys.executable, "-c", "from bench.peers import huey_peer; "
                                "huey_peer.huey.storage.queue_size()"],
                               env=clean_env(**env), cwd=REPO, check=True, timeout=60)
                for _ in range(WORKER_PROCESSES):
                    group.start([str(BIN / "huey_consumer"), "bench.peers.huey_peer.huey",
                                 "-w", str(WORKER_THREADS), "-k", "thread",
                                 "-d", str(cfg.huey_delay_s), "-m", str(cfg.huey_max_delay_s)],
                                clean_env(**env))
                group.wait_log("huey worker ready", WORKER_PROCESSES * WORKER_THREADS)
                with contextlib.closing(sqlite3.connect(f"file:{db_file}?mode=ro",
                                                        uri=True)) as c:
                    res.config["journal_mode"] = c.execute("PRAGMA journal_mode").fetchone()[0]
                factory = _huey_factory()
                res.latencies_ms, res.latency_missing = latency_probe(factory, cfg, work)
                before = count(done_file)
                tp = closed_loop(factory, cfg.runs, cfg,
                                 tag=f"tp-{os.getpid()}-{time.time_ns()}",
                                 count_done=lambda: count(done_file) - before,
                                 groups=[group])
        finally:
            group.stop()
        _fill(res, tp)
        return res


# --------------------------------------------------------------------------- all

class NotMeasured(Exception):
    """A peer that cannot run on this machine (reported, never counted as a pass)."""


def run_all(cfg: ExecSettings, log=print) -> list[TargetResult]:
    results = []
    for name in cfg.targets:
        log(f"  {name} ...")
        try:
            if name == "runstile":
                res = bench_runstile(cfg)
            elif name == "runstile-redis":
                res = bench_runstile_redis(cfg)
            elif name in ("dbos", "dbos-wal"):
                why = ensure_dbos(cfg.install)
                if why:
                    raise NotMeasured(why)
                res = bench_dbos(cfg, wal=name == "dbos-wal")
            elif name == "huey-sqlite":
                why = ensure_package("huey", f"huey=={HUEY_VERSION}", cfg.install)
                if why:
                    raise NotMeasured(why)
                res = bench_huey(cfg)
            elif name == "dramatiq-rabbitmq":
                res = bench_dramatiq_rabbitmq(cfg)
            else:
                res = bench_dramatiq(cfg)
        except NotMeasured as exc:
            res = TargetResult(name, runs=cfg.runs, reason=str(exc))
        except Exception as exc:  # a target that breaks is reported, not fatal
            res = TargetResult(name, runs=cfg.runs, reason=f"{type(exc).__name__}: {exc}")
        if res.measured:
            p50 = percentile(res.latencies_ms, 50)
            log(f"      {res.runs_per_s:.1f} runs/s, idle start p50 "
                f"{'-' if p50 is None else f'{p50:.1f}'} ms"
                + (f"  ({res.reason})" if res.reason else ""))
        else:
            log(f"      not measured: {res.reason}")
        results.append(res)
    return results
