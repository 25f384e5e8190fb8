"""The PostgreSQL section of ``make bench`` (``BENCH_ONLY=postgresql``; bench/README.md).

Every target runs against the machine's PostgreSQL server (BENCH_PG_URL, default
``postgresql://postgres@127.0.0.1:5432/postgres``) in a database of its own, created
before it starts and dropped (``WITH (FORCE)``) when it ends, one target after another:

  runstile-pg       ``runstile up --workers 2 --threads 4 --web-workers 2`` with
                    RUNSTILE_DATABASE_URL on its database: the ledger and the embedded
                    broker on PostgreSQL.
  dbos-pg           DBOS with its system database on PostgreSQL, 2 worker processes with
                    ``worker_concurrency=4`` (bench/peers/dbos_peer.py), DBOSClient enqueues.
  procrastinate-pg  Procrastinate, 2 worker processes with ``concurrency=4``
                    (bench/peers/procrastinate_peer.py), synchronous defers.
  runstile-pg-1w,   ``runstile up`` on PostgreSQL with 1 and 4 worker processes of 4
  runstile-pg-4w    threads (runstile-pg is the 2-process point): the scaling row.
  serve-pg          admission: ``runstile serve`` on a PostgreSQL ledger, gunicorn 2 x 8.
  baseline-pg       admission: bench/baseline_app.py with BENCH_BASELINE_PG_URL under the
                    same gunicorn setup, one autocommitted INSERT per request.
  raw-pg            one connection committing one row per statement for BENCH_SECONDS:
                    this server's durable-commit rate (a reference).

End-to-end targets are measured exactly as the execution section measures its targets
(bench/execution.py: the same 16 closed-loop clients, the same idle latency probe);
admission targets exactly as the admission section does (bench/admission.py).  A URL
is handed to child processes through their environment, never their argv, and printed
only with its password redacted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from runstile.errors import redact_url

from . import admission, baseline_app
from .admission import BIN, REPO, HttpResult, Server, clean_env, free_port, temp_dir
from .execution import (
    RUNSTILE,
    WEB_WORKERS,
    WORKER_PROCESSES,
    WORKER_THREADS,
    ExecSettings,
    Factory,
    Group,
    NotMeasured,
    TargetResult,
    _dbos_factory,
    _dist_version,
    _fill,
    _runstile_factory,
    _wait_http_ready,
    closed_loop,
    ensure_dbos,
    ensure_package,
    latency_probe,
    percentile,
)
from .load import quiet_child

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
#: Procrastinate release installed on demand (never a runstile dependency).
PROCRASTINATE_VERSION = "3.10.0"
#: Worker processes of each ``runstile up`` target (4 threads each).
RUNSTILE_WORKERS = {"runstile-pg-1w": 1, "runstile-pg": WORKER_PROCESSES, "runstile-pg-4w": 4}
E2E_TARGETS = ("runstile-pg", "dbos-pg", "procrastinate-pg", "runstile-pg-1w",
               "runstile-pg-4w")
ADMISSION_TARGETS = ("serve-pg", "baseline-pg", "raw-pg")
ALL_TARGETS = E2E_TARGETS + ADMISSION_TARGETS
COMPLETED_RUNS = "SELECT COUNT(*) FROM runs WHERE status = 'completed'"


@dataclass
class PgSettings:
    admin_url: str
    targets: tuple[str, ...]
    exec: ExecSettings
    adm: admission.Settings
    install: bool
    keep: bool

    @classmethod
    def from_env(cls) -> PgSettings:
        env = os.environ.get
        targets = tuple(t.strip() for t in env("BENCH_PG_TARGETS", ",".join(ALL_TARGETS))
                        .split(",") if t.strip())
        unknown = set(targets) - set(ALL_TARGETS)
        if unknown:
            raise SystemExit(f"BENCH_PG_TARGETS: unknown {sorted(unknown)}; "
                             f"choose from {', '.join(ALL_TARGETS)}")
        return cls(admin_url=env("BENCH_PG_URL", ADMIN_URL), targets=targets,
                   exec=ExecSettings.from_env(), adm=admission.Settings.from_env(),
                   install=env("BENCH_NO_INSTALL") != "1", keep=env("BENCH_KEEP") == "1")


# --------------------------------------------------------------------------- the server

def server_info(admin_url: str) -> dict:
    """The server's version and commit settings; raises NotMeasured when unreachable."""
    import psycopg
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
            show = {name: conn.execute(f"SHOW {name}").fetchone()[0]
                    for name in ("server_version", "synchronous_commit", "fsync",
                                 "wal_sync_method", "max_connections")}
    except psycopg.Error as exc:
        raise NotMeasured(f"PostgreSQL at {redact_url(admin_url)} not reachable: "
                          f"{type(exc).__name__}: {str(exc).strip()[:200]}") from None
    return {"url": redact_url(admin_url), **show}


@contextlib.contextmanager
def fresh_database(admin_url: str, keep: bool) -> Iterator[str]:
    """The URL of a new, empty database on the server, dropped on the way out (kept,
    and named, with BENCH_KEEP=1)."""
    import psycopg
    name = "runstile_bench_" + secrets.token_hex(6)
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(urlsplit(admin_url)._replace(path="/" + name))
    finally:
        if keep:
            print(f"  (kept database {name})", file=sys.stderr)
        else:
            with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Counter:
    """One autocommit connection of the bench's own for polling a count."""

    def __init__(self, url: str) -> None:
        import psycopg
        self._conn = psycopg.connect(url, autocommit=True, connect_timeout=10)

    def value(self, sql: str) -> int:
        import psycopg
        try:
            return int(self._conn.execute(sql).fetchone()[0])
        except psycopg.errors.UndefinedTable:
            return 0     # not created yet: poll again

    def rows(self, sql: str) -> list[tuple]:
        return list(self._conn.execute(sql).fetchall())

    def close(self) -> None:
        self._conn.close()


def _settle(counter: Counter, unfinished_sql: str, group: Group,
            timeout_s: float = 30) -> None:
    """Wait until the warm-up and latency runs have all finished.  The latency probe only
    waits for its last run to *start*; its finish, landing after the throughput count's
    starting point was read, would count one run too many."""
    deadline = time.monotonic() + timeout_s
    while counter.value(unfinished_sql):
        group.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{group.name}: the latency runs did not finish within "
                               f"{timeout_s:g}s ({unfinished_sql!r})")
        time.sleep(0.02)


def _fill_checked(res: TargetResult, tp) -> None:
    """execution._fill, and a reason whenever the count is not exactly the runs asked for
    (more than asked is as invalid as fewer)."""
    _fill(res, tp)
    if not res.reason and res.completed != res.runs:
        res.reason = f"{res.completed} runs counted completed for {res.runs} submitted"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


# --------------------------------------------------------------------------- runstile

def _cli(args: list[str], env: dict[str, str], console_script: bool = False) -> str:
    """A runstile command to completion; exit 2 (refused, e.g. a PostgreSQL ledger a
    command does not run on yet) is "not measured" with the command's own message."""
    argv = [str(BIN / "runstile"), *args] if console_script else [*RUNSTILE, *args]
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    what = f"runstile {' '.join(a for a in args[:2])}"
    if done.returncode == 2:
        raise NotMeasured(f"{what} refused (exit 2): "
                          f"{_shorter(_last_line(done.stderr or done.stdout), env)}")
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}): {_last_line(done.stderr)}")
    return done.stdout


def _prepare_ledger(data: Path, env: dict[str, str], console_script: bool = False) -> str:
    """Migrate the PostgreSQL ledger, then create a key; returns the key's secret."""
    _cli(["db", "migrate", "--data-dir", str(data)], env, console_script)
    out = _cli(["keys", "create", "--profile", "bench", "--json", "--data-dir", str(data)],
               env, console_script)
    return json.loads(out.strip().splitlines()[-1])["secret"]


def _shorter(message: str, env: dict[str, str]) -> str:
    """``message`` without the per-target database's URL (each one differs)."""
    url = env.get("RUNSTILE_DATABASE_URL")
    for form in (url, redact_url(url)) if url else ():
        message = message.replace(form, "<the bench's database>")
    return message


def _refused(procs, log_text: str, env: dict[str, str]) -> None:
    """A server that exited 2 at start refused its configuration: not measured."""
    for proc in procs:
        if proc.poll() == 2:
            raise NotMeasured(f"runstile refused to start (exit 2): "
                              f"{_shorter(_last_line(log_text), env)}")


def bench_runstile(cfg: PgSettings, name: str) -> TargetResult:
    workers = RUNSTILE_WORKERS[name]
    ex = cfg.exec if name == "runstile-pg" else dataclasses.replace(cfg.exec, latency_runs=0)
    res = TargetResult(name, runs=ex.runs, config={
        "command": f"RUNSTILE_DATABASE_URL=postgresql://…/runstile_bench_… python -m runstile "
                   f"up --workers {workers} --threads {WORKER_THREADS} --web-workers "
                   f"{WEB_WORKERS} --tasks bench.bench_tasks",
        "workers": f"{workers} processes x {WORKER_THREADS} threads",
        "broker": "embedded (the ledger's broker rows, on PostgreSQL)",
        "durability": "PostgreSQL commits, synchronous_commit as the server has it"})
    with fresh_database(cfg.admin_url, cfg.keep) as url, \
            temp_dir(f"bench-pg-{name}-", cfg.keep) as work:
        data = work / "data"
        env = clean_env(RUNSTILE_DATABASE_URL=url)
        secret = _prepare_ledger(data, env)
        port = free_port()
        group = Group(f"runstile up ({name})", work / "up.log")
        counter = None
        try:
            group.start([*RUNSTILE, "up", "--data-dir", str(data), "--port", str(port),
                         "--workers", str(workers), "--threads", str(WORKER_THREADS),
                         "--web-workers", str(WEB_WORKERS), "--tasks", "bench.bench_tasks"],
                        env)
            try:
                _wait_http_ready(port, group)
                group.wait_log("worker up:", workers)
            except RuntimeError:
                _refused(group.procs, group.log_text(), env)
                raise
            counter = Counter(url)
            factory = _runstile_factory(port, secret)
            res.latencies_ms, res.latency_missing = latency_probe(factory, ex, work)
            res.ledger_latency_ms = [1000.0 * row[0] for row in counter.rows(
                "SELECT started_at - created_at FROM runs WHERE (input::jsonb ->> 'tag') "
                "LIKE 'lat-%' AND started_at IS NOT NULL")]
            _settle(counter, "SELECT COUNT(*) FROM runs WHERE status IN ('queued', "
                    "'running')", group)
            before = counter.value(COMPLETED_RUNS)
            tp = closed_loop(factory, ex.runs, ex, tag=f"tp-{os.getpid()}-{time.time_ns()}",
                             count_done=lambda: counter.value(COMPLETED_RUNS) - before,
                             groups=[group])
            res.config["statuses_after"] = dict(counter.rows(
                "SELECT status, COUNT(*) FROM runs GROUP BY status"))
        finally:
            if counter is not None:
                counter.close()
            group.stop()
        _fill_checked(res, tp)
        return res


# --------------------------------------------------------------------------- peers

def bench_dbos(cfg: PgSettings) -> TargetResult:
    import dbos

    from .peers import dbos_peer
    ex = cfg.exec
    res = TargetResult("dbos-pg", runs=ex.runs, config={
        "dbos": getattr(dbos, "__version__", None) or _dist_version("dbos"),
        "system_database": "PostgreSQL, DBOS's own schema (dbos.*) in a fresh database",
        "workers": f"{WORKER_PROCESSES} processes, queue worker_concurrency="
                   f"{ex.dbos_concurrency}",
        "queue_polling_interval_s": ex.dbos_poll_s,
        "command": f"{WORKER_PROCESSES} x BENCH_DBOS_URL=postgresql://… python -m "
                   f"bench.peers.dbos_peer EXECUTOR (register_queue worker_concurrency="
                   f"{ex.dbos_concurrency}, polling_interval_sec={ex.dbos_poll_s:g})",
        "enqueue": "DBOSClient.enqueue with a unique workflow_id"})
    done_sql = ("SELECT COUNT(*) FROM dbos.workflow_status WHERE status = 'SUCCESS' "
                f"AND queue_name = '{dbos_peer.QUEUE}'")
    with fresh_database(cfg.admin_url, cfg.keep) as url, \
            temp_dir("bench-pg-dbos-", cfg.keep) as work:
        env = clean_env(BENCH_DBOS_URL=url, BENCH_DBOS_CONCURRENCY=ex.dbos_concurrency,
                        BENCH_DBOS_POLL_S=str(ex.dbos_poll_s), BENCH_DBOS_WAL="0")
        migrate = subprocess.run(
            [sys.executable, "-c", "import os; from dbos import DBOS; "
             "DBOS.migrate(os.environ['BENCH_DBOS_URL'])"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        if migrate.returncode != 0:
            raise RuntimeError(f"DBOS.migrate failed: {_last_line(migrate.stderr)}")
        group = Group("dbos-pg", work / "workers.log")
        counter = None
        try:
            for i in range(WORKER_PROCESSES):
                group.start([sys.executable, "-m", "bench.peers.dbos_peer",
                             f"bench-executor-{i + 1}"], env)
            group.wait_log("dbos worker", WORKER_PROCESSES)
            counter = Counter(url)
            factory = _dbos_factory(url, wal=False)
            res.latencies_ms, res.latency_missing = latency_probe(factory, ex, work)
            _settle(counter, "SELECT COUNT(*) FROM dbos.workflow_status WHERE status IN "
                    "('ENQUEUED', 'PENDING')", group)
            before = counter.value(done_sql)
            tp = closed_loop(factory, ex.runs, ex, tag=f"tp-{os.getpid()}-{time.time_ns()}",
                             count_done=lambda: counter.value(done_sql) - before,
                             groups=[group])
            res.config["statuses_after"] = dict(counter.rows(
                "SELECT status, COUNT(*) FROM dbos.workflow_status GROUP BY status"))
        finally:
            if counter is not None:
                counter.close()
            group.stop()
        _fill_checked(res, tp)
        return res


def _procrastinate_factory(url: str, pool_size: int) -> Factory:
    def per_process():
        from .peers import procrastinate_peer as peer
        app = peer.client_app(url, pool_size)

        def per_thread():
            def submit(key: str, mark: str | None) -> None:
                peer.defer(app, key, mark)
            return submit
        return per_thread
    return per_process


def _wait_count(counter: Counter, sql: str, want: int, group: Group, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while counter.value(sql) < want:
        group.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{group.name}: {sql!r} did not reach {want} within "
                               f"{timeout_s:g}s; log:\n{group.log_tail()}")
        time.sleep(0.05)


def bench_procrastinate(cfg: PgSettings) -> TargetResult:
    from .peers import procrastinate_peer as peer
    ex = cfg.exec
    res = TargetResult("procrastinate-pg", runs=ex.runs, config={
        "procrastinate": _dist_version("procrastinate"),
        "workers": f"{WORKER_PROCESSES} processes, run_worker(concurrency="
                   f"{WORKER_THREADS}), async no-op task",
        "command": f"{WORKER_PROCESSES} x BENCH_PROCRASTINATE_URL=postgresql://… python -m "
                   f"bench.peers.procrastinate_peer NAME (run_worker concurrency="
                   f"{WORKER_THREADS}, LISTEN/NOTIFY, jobs kept)",
        "enqueue": "task.defer() through a SyncPsycopgConnector (no idempotency key)"})
    done_sql = (f"SELECT COUNT(*) FROM procrastinate_jobs WHERE status = 'succeeded' "
                f"AND queue_name = '{peer.QUEUE}'")
    with fresh_database(cfg.admin_url, cfg.keep) as url, \
            temp_dir("bench-pg-procrastinate-", cfg.keep) as work:
        env = clean_env(BENCH_PROCRASTINATE_URL=url,
                        BENCH_PROCRASTINATE_CONCURRENCY=str(WORKER_THREADS))
        schema = subprocess.run([sys.executable, "-m", "bench.peers.procrastinate_peer",
                                 "schema"], env=env, cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        if schema.returncode != 0:
            raise RuntimeError(f"procrastinate schema failed: {_last_line(schema.stderr)}")
        group = Group("procrastinate-pg", work / "workers.log")
        counter = Counter(url)
        try:
            for i in range(WORKER_PROCESSES):
                group.start([sys.executable, "-m", "bench.peers.procrastinate_peer",
                             f"bench-worker-{i + 1}"], env)
            # Each worker registers itself in procrastinate_workers once it runs.
            _wait_count(counter, "SELECT COUNT(*) FROM procrastinate_workers",
                        WORKER_PROCESSES, group, 60)
            factory = _procrastinate_factory(url, ex.threads)
            res.latencies_ms, res.latency_missing = latency_probe(factory, ex, work)
            _settle(counter, "SELECT COUNT(*) FROM procrastinate_jobs WHERE status IN "
                    "('todo', 'doing')", group)
            before = counter.value(done_sql)
            tp = closed_loop(factory, ex.runs, ex, tag=f"tp-{os.getpid()}-{time.time_ns()}",
                             count_done=lambda: counter.value(done_sql) - before,
                             groups=[group])
            res.config["statuses_after"] = {str(k): v for k, v in counter.rows(
                "SELECT status, COUNT(*) FROM procrastinate_jobs GROUP BY status")}
        finally:
            counter.close()
            group.stop()
        _fill_checked(res, tp)
        return res


# --------------------------------------------------------------------------- admission

def _count_runs(url: str) -> int:
    counter = Counter(url)
    try:
        return counter.value("SELECT COUNT(*) FROM runs")
    finally:
        counter.close()


def bench_serve(cfg: PgSettings) -> HttpResult:
    """``runstile serve`` on a PostgreSQL ledger, as the SQLite admission row starts it."""
    with fresh_database(cfg.admin_url, cfg.keep) as url, \
            temp_dir("bench-pg-serve-", cfg.keep) as data:
        env = clean_env(RUNSTILE_MAX_ACTIVE_RUNS="100000000", RUNSTILE_DATABASE_URL=url)
        secret = _prepare_ledger(data, env, console_script=True)
        port = free_port()
        server = Server([str(BIN / "runstile"), "serve", "--data-dir", str(data),
                         "--port", str(port), "--web-workers", str(admission.GUNICORN_WORKERS),
                         "--threads", str(admission.GUNICORN_THREADS)],
                        env, data / "server.log", port)
        try:
            try:
                server.wait_ready()
            except RuntimeError:
                _refused([server.proc], server.log_tail(), env)
                raise
            headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
            result = admission._measure(server, headers, cfg.adm,
                                        tag=f"rs-pg-{os.getpid()}-{time.time_ns()}")
        finally:
            server.stop()
        result.rows_in_db = _count_runs(url)
        return result


def bench_baseline(cfg: PgSettings) -> HttpResult:
    """bench/baseline_app.py on PostgreSQL under the SQLite baseline's gunicorn setup."""
    with fresh_database(cfg.admin_url, cfg.keep) as url, \
            temp_dir("bench-pg-baseline-", cfg.keep) as data:
        baseline_app.pg_create_schema(url)
        port = free_port()
        server = Server(admission.gunicorn_argv("bench.baseline_app:app", port),
                        clean_env(BENCH_BASELINE_PG_URL=url), data / "server.log", port)
        try:
            server.wait_ready()
            # The same request bytes as runstile gets (the baseline ignores Authorization).
            headers = {"Authorization": "Bearer rsk_0000000000000000_" + "x" * 43,
                       "Content-Type": "application/json"}
            result = admission._measure(server, headers, cfg.adm,
                                        tag=f"bl-pg-{os.getpid()}-{time.time_ns()}")
        finally:
            server.stop()
        result.rows_in_db = _count_runs(url)
        return result


def _raw_child(url: str, warmup_s: float, duration_s: float, pipe) -> None:
    quiet_child()
    conn = baseline_app.pg_connect(url)
    body = json.dumps({"task": "echo", "input": {"n": 0}}, separators=(",", ":"))
    t_from = time.monotonic() + warmup_s
    t_to = t_from + duration_s
    rows, i, cpu0 = 0, 0, None
    while (now := time.monotonic()) < t_to:
        if cpu0 is None and now >= t_from:
            cpu0 = os.times()
        i += 1
        baseline_app.pg_insert_one(conn, f"raw-{i}", body)
        if now >= t_from:
            rows += 1
    cpu1 = os.times()
    conn.close()
    cpu = 0.0 if cpu0 is None else (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    pipe.send({"rows": rows, "cpu": cpu})


def bench_raw(cfg: PgSettings) -> dict:
    """rows/s of one connection committing one row per statement (autocommit)."""
    ctx = multiprocessing.get_context("fork")
    with fresh_database(cfg.admin_url, cfg.keep) as url:
        baseline_app.pg_create_schema(url)
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_raw_child, args=(url, cfg.adm.warmup_s,
                                                    cfg.adm.duration_s, child), daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(cfg.adm.warmup_s + cfg.adm.duration_s + 60):
                raise RuntimeError("the raw PostgreSQL process did not report back")
            out = parent.recv()
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return {"rows": out["rows"], "rows_per_s": out["rows"] / cfg.adm.duration_s,
            "cpu_s": out["cpu"]}


# --------------------------------------------------------------------------- all

def _one(cfg: PgSettings, name: str):
    if name.startswith("runstile-pg"):
        return bench_runstile(cfg, name)
    if name == "dbos-pg":
        why = ensure_dbos(cfg.install)
        if why:
            raise NotMeasured(why)
        return bench_dbos(cfg)
    if name == "procrastinate-pg":
        why = ensure_package("procrastinate", f"procrastinate=={PROCRASTINATE_VERSION}",
                             cfg.install)
        if why:
            raise NotMeasured(why)
        return bench_procrastinate(cfg)
    return {"serve-pg": bench_serve, "baseline-pg": bench_baseline,
            "raw-pg": bench_raw}[name](cfg)


def run_all(cfg: PgSettings, log=print) -> tuple[dict, dict[str, object]]:
    """(the server's settings or {}, {target: TargetResult | HttpResult | raw dict |
    the reason it was not measured})."""
    try:
        info = server_info(cfg.admin_url)
    except NotMeasured as exc:
        return {}, {name: str(exc) for name in cfg.targets}
    log(f"  PostgreSQL {info['server_version']} at {info['url']}, synchronous_commit="
        f"{info['synchronous_commit']}, fsync={info['fsync']}")
    results: dict[str, object] = {}
    for name in cfg.targets:
        log(f"  {name} ...")
        try:
            res = _one(cfg, name)
        except NotMeasured as exc:
            res = str(exc)
        except Exception as exc:  # a target that breaks is reported, not fatal
            res = f"{type(exc).__name__}: {str(exc)[:400]}"
        if isinstance(res, str):
            log(f"      not measured: {res}")
        elif isinstance(res, TargetResult):
            p50 = percentile(res.latencies_ms, 50)
            log(f"      {res.runs_per_s:.1f} runs/s, idle start p50 "
                f"{'-' if p50 is None else f'{p50:.1f}'} ms"
                + (f"  ({res.reason})" if res.reason else ""))
        elif isinstance(res, HttpResult):
            log(f"      {res.load.throughput:.1f} req/s")
        else:
            log(f"      {res['rows_per_s']:.1f} rows/s")
        results[name] = res
    return info, results
