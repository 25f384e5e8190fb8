"""The admission benchmark of issue 2: three targets, measured one after another.

(a) runstile   the real ``runstile serve`` (gunicorn, 2 processes x 8 gthread threads,
               and the admission writer process it starts beside them: the server CPU
               reported counts every process of the group), POST /v1/runs with a bearer
               key and a fresh Idempotency-Key per request.
(b) baseline   bench/baseline_app.py under the same gunicorn setup: parse the JSON body,
               one durable SQLite insert (WAL, synchronous=FULL, BEGIN IMMEDIATE).
(c) raw        one process committing one row per transaction with the same settings:
               the disk's durable-commit ceiling (rows/s).
(d) flask-noop bench/peers/flask_noop.py under the same gunicorn setup as (b): parse the
               body, answer 202, no SQLite -- the ceiling of any durable endpoint on
               this stack.

Every target gets a fresh temporary data directory and a free port; every server is
started in its own process group and killed (group-wide) when its target ends, even on
error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from . import baseline_app
from .load import LoadResult, drive, quiet_child

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent          # the venv's bin (not resolved: keep the venv)
HOST = "127.0.0.1"
GUNICORN_THREADS = 8
GUNICORN_WORKERS = 2
#: The baselines' gunicorn settings: those runstile's web/server.py sets (processes,
#: threads, timeouts, keep-alive, and gunicorn_h1c's C request parser).
GUNICORN_ARGS = ["-w", str(GUNICORN_WORKERS), "-k", "gthread", "--threads",
                 str(GUNICORN_THREADS), "--timeout", "30", "--graceful-timeout", "10",
                 "--keep-alive", "5", "--http-parser", "fast", "--log-level", "warning"]


@dataclass
class Settings:
    duration_s: float
    warmup_s: float
    processes: int
    threads: int
    keep: bool
    #: RUNSTILE_ADMISSION_LINGER_MS for runstile's server (BENCH_ADMISSION_LINGER_MS; unset:
    #: runstile's default).
    linger_ms: str | None = None

    @classmethod
    def from_env(cls) -> Settings:
        return cls(duration_s=float(os.environ.get("BENCH_SECONDS", "10")),
                   warmup_s=float(os.environ.get("BENCH_WARMUP", "2")),
                   processes=int(os.environ.get("BENCH_CLIENT_PROCESSES", "4")),
                   threads=int(os.environ.get("BENCH_CLIENT_THREADS", "4")),
                   keep=os.environ.get("BENCH_KEEP") == "1",
                   linger_ms=os.environ.get("BENCH_ADMISSION_LINGER_MS"))


@dataclass
class HttpResult:
    load: LoadResult
    server_cpu_s: float
    rows_in_db: int | None = None   # counted after the server stopped

    @property
    def rows_match(self) -> bool:
        """Every 202 left exactly one committed row (nothing acknowledged was lost)."""
        return self.rows_in_db == self.load.accepted


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The parent's environment without anything that would change what is measured."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RUNSTILE_", "BENCH_", "PROMETHEUS_", "GUNICORN_"))}
    env.update(extra)
    return env


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """user+system CPU seconds of every live process in a process group (from /proc)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        # fields[0] is state (field 3); pgrp is field 5, utime 14, stime 15.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _clock_ticks()


class Server:
    """A server started in its own session/process group; stopping kills the group."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, port: int):
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pgid = self.proc.pid               # leader of its own new session

    def wait_ready(self, path: str = "/readyz", timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{HOST}:{self.port}{path}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready; "
                                   f"log:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.1)
        raise RuntimeError(f"{url} not 200 within {timeout_s}s; log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                # The arbiter is gone; make sure no orphaned worker of the group lingers.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pgid, signal.SIGKILL)
                break
        self._log.close()


@contextlib.contextmanager
def temp_dir(prefix: str, keep: bool):
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if keep:
            print(f"  (kept {path})", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _measure(server: Server, headers: dict[str, str], cfg: Settings, tag: str) -> HttpResult:
    cpu: dict[str, float] = {}

    def on_window(event: str) -> None:
        cpu[event] = group_cpu_s(server.pgid)

    load = drive(HOST, server.port, "/v1/runs", headers, processes=cfg.processes,
                 threads=cfg.threads, warmup_s=cfg.warmup_s, duration_s=cfg.duration_s,
                 tag=tag, on_window=on_window)
    if server.proc.poll() is not None:
        raise RuntimeError(f"server died during the run; log:\n{server.log_tail()}")
    return HttpResult(load=load, server_cpu_s=cpu["end"] - cpu["start"])


def count_rows(path: Path, table: str) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def bench_runstile(cfg: Settings) -> HttpResult:
    with temp_dir("bench-runstile-", cfg.keep) as data:
        env = clean_env(RUNSTILE_MAX_ACTIVE_RUNS="100000000")
        if cfg.linger_ms is not None:
            env["RUNSTILE_ADMISSION_LINGER_MS"] = cfg.linger_ms
        created = subprocess.run(
            [str(BIN / "runstile"), "keys", "create", "--profile", "bench", "--json",
             "--data-dir", str(data)],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise RuntimeError(f"keys create failed ({created.returncode}): {created.stderr}")
        secret = json.loads(created.stdout.strip().splitlines()[-1])["secret"]
        port = free_port()
        server = Server([str(BIN / "runstile"), "serve", "--data-dir", str(data),
                         "--port", str(port), "--web-workers", str(GUNICORN_WORKERS),
                         "--threads", str(GUNICORN_THREADS)],
                        env, data / "server.log", port)
        try:
            server.wait_ready()
            headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
            result = _measure(server, headers, cfg, tag=f"rs-{os.getpid()}-{time.time_ns()}")
        finally:
            server.stop()
        result.rows_in_db = count_rows(data / "ledger.db", "runs")
        return result


def gunicorn_argv(app: str, port: int) -> list[str]:
    """gunicorn serving ``app`` on ``port`` with GUNICORN_ARGS."""
    return [str(BIN / "gunicorn"), *GUNICORN_ARGS, "-b", f"{HOST}:{port}", app]


def bench_baseline(cfg: Settings) -> HttpResult:
    with temp_dir("bench-baseline-", cfg.keep) as data:
        db = data / "baseline.db"
        baseline_app.create_schema(str(db))
        port = free_port()
        env = clean_env(BENCH_BASELINE_DB=str(db))
        server = Server(gunicorn_argv("bench.baseline_app:app", port), env,
                        data / "server.log", port)
        try:
            server.wait_ready()
            # Same request bytes as runstile gets (the baseline ignores Authorization).
            headers = {"Authorization": "Bearer rsk_0000000000000000_" + "x" * 43,
                       "Content-Type": "application/json"}
            result = _measure(server, headers, cfg, tag=f"bl-{os.getpid()}-{time.time_ns()}")
        finally:
            server.stop()
        result.rows_in_db = count_rows(db, "runs")
        return result


def bench_flask_noop(cfg: Settings) -> HttpResult:
    """(d) The Flask no-op ceiling: bench/peers/flask_noop.py under the baseline's exact
    gunicorn setup; parses the body and answers 202 without touching SQLite."""
    with temp_dir("bench-flask-noop-", cfg.keep) as data:
        port = free_port()
        server = Server(gunicorn_argv("bench.peers.flask_noop:app", port), clean_env(),
                        data / "server.log", port)
        try:
            server.wait_ready()
            headers = {"Authorization": "Bearer rsk_0000000000000000_" + "x" * 43,
                       "Content-Type": "application/json"}
            result = _measure(server, headers, cfg, tag=f"nf-{os.getpid()}-{time.time_ns()}")
        finally:
            server.stop()
        result.rows_in_db = result.load.accepted     # nothing is stored, by design
        return result


def _raw_child(path: str, warmup_s: float, duration_s: float, pipe) -> None:
    quiet_child()
    conn = baseline_app.connect(path)
    body = json.dumps({"task": "echo", "input": {"n": 0}}, separators=(",", ":"))
    t_from = time.monotonic() + warmup_s
    t_to = t_from + duration_s
    rows = 0
    i = 0
    cpu0 = None
    while True:
        now = time.monotonic()
        if now >= t_to:
            break
        if cpu0 is None and now >= t_from:
            cpu0 = os.times()
        i += 1
        baseline_app.insert_one(conn, f"raw-{i}", body)
        if now >= t_from:
            rows += 1
    cpu1 = os.times()
    conn.close()
    cpu = 0.0 if cpu0 is None else (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    pipe.send({"rows": rows, "cpu": cpu})


def bench_raw(cfg: Settings) -> dict:
    """rows/s of one process committing one row per durable transaction."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    with temp_dir("bench-raw-", cfg.keep) as data:
        db = data / "raw.db"
        baseline_app.create_schema(str(db))
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_raw_child,
                           args=(str(db), cfg.warmup_s, cfg.duration_s, child), daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(cfg.warmup_s + cfg.duration_s + 60):
                raise RuntimeError("the raw SQLite process did not report back")
            out = parent.recv()
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        with contextlib.closing(sqlite3.connect(db)) as check:
            journal = check.execute("PRAGMA journal_mode").fetchone()[0]
        return {"rows": out["rows"], "rows_per_s": out["rows"] / cfg.duration_s,
                "cpu_s": out["cpu"], "journal_mode": journal}
