"""Shared fixtures: real SQLite files (and PostgreSQL databases, tests/postgres.py), real
servers on loopback, real processes.

Broker fixtures skip locally when the machine's Redis/RabbitMQ are absent and fail
instead when CI is set (after Dramatiq's own conftest).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
import requests

from runstile.ledger import db, keys, migrations
from runstile.web.writer.supervisor import ENTRY
from tests import postgres

ROOT = Path(__file__).resolve().parents[1]
RUNSTILE = [sys.executable, "-m", "runstile"]


def pytest_collection_modifyitems(config, items):
    """With the passes split (``RUNSTILE_TEST_LEDGER=sqlite``, as .ci/run does), the tests
    that need a PostgreSQL server whatever the pass (marked ``postgresql``) are left to the
    PostgreSQL pass, so each runs once."""
    if os.environ.get(postgres.LEDGER_VARIABLE) != "sqlite":
        return
    later = [item for item in items if item.get_closest_marker("postgresql")]
    if later:
        config.hook.pytest_deselected(items=later)
        items[:] = [item for item in items if not item.get_closest_marker("postgresql")]


#: Ports handed out by free_port in this process: never the same one twice.
_handed_out: set[int] = set()


def free_port() -> int:
    """A port of 127.0.0.1 that nothing is bound to, for a server a test starts.

    Taken below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), not from
    ``bind(0)``, which picks from that range: every outgoing connection on the machine
    (a client of Redis, RabbitMQ or PostgreSQL, in this run or beside it) takes its local
    port from there too, and one took a port between this check and the server's bind
    (seen in CI: gunicorn's "Address already in use", then exit 1).
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 20000, min(ephemeral_low, 32768)
    for _ in range(1000 if high - low > 1000 else 0):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # an unusual range: take what the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float = 15.0, interval_s: float = 0.02, what: str = ""):
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}: {last!r}")


@dataclass
class Key:
    key_id: str
    secret: str
    profile: str
    role: str

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.secret}"}


@dataclass
class Ledger:
    """A migrated ledger file in a temporary data directory, or (``url``) a migrated
    PostgreSQL database of its own."""

    data_dir: Path
    url: str | None = None

    @property
    def path(self) -> Path:
        """The ledger file; a test that opens it itself is SQLite's alone, and skips on
        the PostgreSQL pass (tests/postgres.py)."""
        if self.url:
            pytest.skip("SQLite only: the test reads or writes the ledger file itself")
        return self.data_dir / "ledger.db"

    @property
    def target(self) -> Path | str:
        """What db.connect and migrations.migrate are given: the file, or the URL."""
        return self.url or self.path

    @property
    def dialect(self) -> str:
        return "postgresql" if self.url else "sqlite"

    def connect(self):
        return db.connect(self.target)

    def key(self, profile: str = "default", *, admin: bool = False, label: str | None = None) -> Key:
        conn = self.connect()
        try:
            key_id, secret = keys.create(conn, profile, label=label,
                                         role="admin" if admin else "client")
        finally:
            conn.close()
        return Key(key_id, secret, profile, "admin" if admin else "client")

    def query(self, sql: str, args: tuple = ()) -> list:
        conn = self.connect()
        try:
            return [tuple(r) for r in conn.execute(sql, args).fetchall()]
        finally:
            conn.close()


#: The PostgreSQL database of each data directory the fixtures made on the PostgreSQL
#: pass: every Server, System and Workers started on that directory gets it as
#: RUNSTILE_DATABASE_URL, however the test built them.
DATABASE_URLS: dict[Path, str] = {}


def database_env(data_dir: Path) -> dict[str, str]:
    """What a process started on ``data_dir`` needs to find its ledger beyond the
    directory: on the PostgreSQL pass, the database's URL."""
    url = DATABASE_URLS.get(Path(data_dir).resolve())
    return {"RUNSTILE_DATABASE_URL": url} if url else {}


@contextlib.contextmanager
def new_ledger(folder: Path) -> Iterator[Ledger]:
    """A migrated ledger with its data directory in ``folder``: a file, or on the
    PostgreSQL pass a database of its own, dropped on the way out."""
    data_dir = folder / "data"
    if not postgres.on_postgresql():
        migrations.migrate(data_dir / "ledger.db")
        yield Ledger(data_dir)
        return
    with postgres.fresh_database(required=True, migrated=True) as url:
        data_dir.mkdir(parents=True, exist_ok=True)
        DATABASE_URLS[data_dir.resolve()] = url
        # Also this process's environment, while the ledger lives: the commands a test
        # runs itself (``runstile recover``, ``keys``, in-process ``cli.main``) then open
        # this ledger as the processes the fixtures start do.  A test's own ledger comes
        # in over its module's shared one and gives it back afterwards.
        before = os.environ.get("RUNSTILE_DATABASE_URL")
        os.environ["RUNSTILE_DATABASE_URL"] = url
        try:
            yield Ledger(data_dir, url=url)
        finally:
            DATABASE_URLS.pop(data_dir.resolve(), None)
            if before is None:
                os.environ.pop("RUNSTILE_DATABASE_URL", None)
            else:
                os.environ["RUNSTILE_DATABASE_URL"] = before


def bare_ledger(path: Path) -> sqlite3.Connection:
    """A migrated ledger at ``path`` holding profile 'p' and its client key 'key_1' and
    nothing else, for tests that write rows by hand (the caller closes it)."""
    migrations.migrate(path)
    conn = db.connect(path)
    conn.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 0)")
    conn.execute("INSERT INTO api_keys (id, profile_id, role, secret_hash, created_at) "
                 "VALUES ('key_1', 'p', 'client', 'h', 0)")
    return conn


@pytest.fixture
def ledger(tmp_path) -> Iterator[Ledger]:
    """A fresh ledger for this test alone."""
    with new_ledger(tmp_path) as made:
        yield made


@pytest.fixture
def conn(ledger):
    """A connection to this test's ledger, closed after the test."""
    c = ledger.connect()
    yield c
    c.close()


@pytest.fixture(params=postgres.DIALECTS)
def dual_ledger(request, tmp_path):
    """A fresh ledger for this test alone, once on each engine: SQLite, and PostgreSQL
    when RUNSTILE_TEST_DATABASE_URL names a server (skipped, saying so, otherwise).  A
    test module runs on both by defining ``ledger`` as this fixture."""
    if request.param == "sqlite":
        data_dir = tmp_path / "data"
        migrations.migrate(data_dir / "ledger.db")
        yield Ledger(data_dir)
        return
    with postgres.fresh_database(migrated=True) as url:
        yield Ledger(tmp_path / "data", url=url)


@pytest.fixture(params=postgres.DIALECTS)
def ledger_target(request, tmp_path):
    """Where a ledger not yet migrated would be, once on each engine: an SQLite file's
    path, and a fresh PostgreSQL database's URL (skipped when there is no server)."""
    if request.param == "sqlite":
        yield tmp_path / "ledger.db"
        return
    with postgres.fresh_database() as url:
        yield url


@pytest.fixture(scope="module")
def shared_ledger(tmp_path_factory) -> Iterator[Ledger]:
    """One ledger per test module; tests isolate themselves with a key (scope) each."""
    with new_ledger(tmp_path_factory.mktemp("shared")) as made:
        yield made


@pytest.fixture
def tiny_disk(request, tmp_path):
    """A small tmpfs (4 MiB; parametrize ``tiny_disk`` indirectly with another size): a
    real filesystem that really fills up.  Needs root (mount)."""
    size = getattr(request, "param", "4m")
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                             str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs for the disk-full test: {result.stderr}")
        pytest.skip(f"cannot mount a tmpfs (needs root): {result.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(folder: Path) -> Path:
    """Write a filler file into ``folder`` until its filesystem refuses; return it."""
    filler = folder / "filler"
    # Unbuffered: a buffered file would try its refused bytes again when closed, and
    # raise there.
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass
    return filler


@dataclass
class Server:
    """A real ``runstile serve`` (gunicorn) on a loopback port."""

    data_dir: Path
    env: dict
    web_workers: int = 2
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    #: More of serve's flags (say ``--database-url``), after the ones every server gets.
    args: tuple[str, ...] = ()
    #: Started once this answers 200 (a subclass may wait for less than readiness).
    ready_path: ClassVar[str] = "/readyz"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, **extra_env: str) -> Server:
        env = {**os.environ, **database_env(self.data_dir), **self.env, **extra_env}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.log_path = self.data_dir.parent / f"serve-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*RUNSTILE, "serve", "--data-dir", str(self.data_dir), "--port", str(self.port),
             "--web-workers", str(self.web_workers), *self.args],
            env=env, stdout=log, stderr=log, start_new_session=True, cwd=ROOT)
        STARTED.append(self.proc)
        log.close()
        wait_until(self._ready, 30, 0.05, f"runstile serve on {self.url}")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return requests.get(self.url + self.ready_path, timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def web_pids(self) -> list[int]:
        """The gunicorn worker processes (children of serve other than the writer)."""
        return [pid for pid in child_pids(self.proc.pid) if not is_writer(pid)]

    def writer_pid(self) -> int | None:
        """The admission writer process (web/writer/), if one is running."""
        pids = [pid for pid in child_pids(self.proc.pid) if is_writer(pid)]
        return pids[0] if pids else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (master and workers) and reap the master."""
        kill_group(self.proc, sig)
        self.proc = None

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def is_writer(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"runstile.web.writer" in f.read()
    except OSError:
        return False


def writer_socket(pid: int) -> str:
    """Where the admission writer ``pid`` listens (the path on its command line)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        words = f.read().split(b"\0")
    return words[words.index(ENTRY.encode()) + 1].decode()


def writer_listening(pid: int) -> bool:
    """The writer ``pid`` accepts connections (a file left by a dead one refuses them)."""
    try:
        path = writer_socket(pid)
    except (OSError, IndexError):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def wait_for_writer(server: Server, previous: int | None = None) -> int:
    """The pid of ``server``'s admission writer once it listens (a new one when
    ``previous`` is given)."""
    def listening():
        pid = server.writer_pid()
        return pid if pid not in (None, previous) and writer_listening(pid) else None
    return wait_until(listening, 30, 0.02, "the admission writer to listen")


def kill_group(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """Signal a process group led by ``proc`` (SIGKILL if it outlives 20 s) and wait
    until every member is gone: children may outlive a SIGKILLed leader for a moment."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    wait_until(lambda: not _group_alive(proc.pid), 10, 0.05, "process group to exit")


def running_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run.  A zombie has exited (its files,
    sockets and locks are closed) and does not count: once its parent is gone only init
    reaps it, which this machine's init does about a second later, and os.killpg(pgid, 0)
    finds the group until then (that second was in every test's teardown)."""
    running = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                # After the command name, which may hold spaces: state ppid pgrp ...
                state, _, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except OSError:
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != b"Z":
            running.append(int(entry.name))
    return running


def _group_alive(pgid: int) -> bool:
    return bool(running_in_group(pgid))


#: Every process group Server, System and Workers started, in order of starting.
STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Kill what a test started and left running: a test that fails before its own
    cleanup (say, in the middle of a fault-injection loop) must not leave servers, their
    admission writers or workers behind for the rest of the session.  Module-scoped
    servers start before this snapshot, so they are left to their own fixtures."""
    first = len(STARTED)
    yield
    for proc in STARTED[first:]:
        if proc.poll() is None or _group_alive(proc.pid):
            kill_group(proc)
    del STARTED[first:]


@pytest.fixture
def make_server(ledger):
    servers: list[Server] = []

    def make(web_workers: int = 2, **env: str) -> Server:
        server = Server(ledger.data_dir, env, web_workers=web_workers)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def shared_server(shared_ledger):
    """One default-configured server per test module, on the module's ledger."""
    server = Server(shared_ledger.data_dir, {}).start()
    yield server
    server.kill()


class Api:
    """A tiny HTTP client bound to one server and one key."""

    def __init__(self, server: Server, key: Key, ledger: Ledger | None = None) -> None:
        self.server, self.key, self.ledger = server, key, ledger
        self.session = requests.Session()

    def runs_in_scope(self) -> int:
        """How many runs this key's scope holds in the ledger."""
        return self.ledger.query("SELECT COUNT(*) FROM runs WHERE key_id = ?",
                                 (self.key.key_id,))[0][0]

    def keys_in_scope(self) -> int:
        return self.ledger.query("SELECT COUNT(*) FROM idempotency_keys WHERE key_id = ?",
                                 (self.key.key_id,))[0][0]

    def post_run(self, body: dict | None = None, *, idempotency_key: str | None = None,
                 headers: dict | None = None, **kwargs) -> requests.Response:
        h = {**self.key.headers, **(headers or {})}
        if idempotency_key is not None:
            h["Idempotency-Key"] = idempotency_key
        if body is not None and "data" not in kwargs:
            kwargs["data"] = json.dumps(body)
            h.setdefault("Content-Type", "application/json")
        return self.session.post(self.server.url + "/v1/runs", headers=h, timeout=30, **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        headers = {**self.key.headers, **kwargs.pop("headers", {})}
        return self.session.get(self.server.url + path, headers=headers, timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> requests.Response:
        headers = {**self.key.headers, **kwargs.pop("headers", {})}
        return self.session.post(self.server.url + path, headers=headers, timeout=30, **kwargs)


@pytest.fixture
def api(shared_server, shared_ledger) -> Api:
    """A client with a key of its own (its own scope) on the module's shared server."""
    return Api(shared_server, shared_ledger.key("default"), shared_ledger)


def broker_available(kind: str) -> bool:
    """True if the machine's Redis/RabbitMQ answers; skip locally or fail under CI if not."""
    host_port = {"redis": ("127.0.0.1", 6379), "rabbitmq": ("127.0.0.1", 5672)}[kind]
    try:
        with socket.create_connection(host_port, timeout=1):
            return True
    except OSError:
        message = f"{kind} is not reachable at {host_port[0]}:{host_port[1]}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
        pytest.skip(message)


@dataclass
class System(Server):
    """A real ``runstile up``: supervisor, gunicorn web and Dramatiq worker processes."""

    workers: int = 2
    threads: int = 4
    tasks: tuple[str, ...] = ("tests.workers.exec_tasks", "runstile.demo")

    def start(self, **extra_env: str) -> System:
        env = {**os.environ, **database_env(self.data_dir), **self.env, **extra_env}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.log_path = self.data_dir.parent / f"up-{self.port}.log"
        log = open(self.log_path, "ab")
        task_args = [arg for module in self.tasks for arg in ("--tasks", module)]
        self.proc = subprocess.Popen(
            [*RUNSTILE, "up", "--data-dir", str(self.data_dir), "--port", str(self.port),
             "--web-workers", str(self.web_workers), "--workers", str(self.workers),
             "--threads", str(self.threads), *task_args],
            env=env, stdout=log, stderr=log, start_new_session=True, cwd=ROOT)
        STARTED.append(self.proc)
        log.close()
        wait_until(self._ready, 30, 0.05, f"runstile up on {self.url}")
        return self


@dataclass
class Workers:
    """A real ``runstile worker`` (supervisor, boot recovery, worker processes)."""

    data_dir: Path
    env: dict
    workers: int = 2
    threads: int = 4
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self, wait: bool = True) -> Workers:
        """Start it; with ``wait``, return once every worker process consumes."""
        env = {**os.environ, **database_env(self.data_dir), **self.env}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.log_path = self.data_dir.parent / f"worker-{time.monotonic_ns()}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*RUNSTILE, "worker", "--data-dir", str(self.data_dir), "--workers",
             str(self.workers), "--threads", str(self.threads)], env=env, stdout=log,
            stderr=log, start_new_session=True, cwd=ROOT)
        STARTED.append(self.proc)
        log.close()
        if wait:
            wait_until(self._up, 30, 0.05, "runstile worker to boot")
        return self

    def _up(self) -> bool:
        """Every worker process consumes: each logs "worker up" once its Dramatiq worker
        started.  (The supervisor's "runstile workers up" comes as soon as it has
        spawned them, before they consume.)"""
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
        return self.log().count("] worker up: node") >= self.workers

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (supervisor and workers) and reap it."""
        kill_group(self.proc, sig)
        self.proc = None


@pytest.fixture
def receiver():
    """Make loopback webhook receivers (tests/receiver.py); closed after the test."""
    from tests.receiver import Receiver
    made: list = []

    def make(answer=None):
        made.append(Receiver(answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def make_system(ledger):
    systems: list[System] = []

    def make(workers: int = 2, threads: int = 4, web_workers: int = 1, **env: str) -> System:
        system = System(ledger.data_dir, env, web_workers=web_workers, workers=workers,
                        threads=threads)
        systems.append(system)
        return system.start()

    yield make
    for system in systems:
        system.kill()


def wait_for_status(api: Api, run_id: str, statuses=("completed", "failed", "cancelled",
                                                     "interrupted"), timeout_s: float = 30):
    def done():
        run = api.get(f"/v1/runs/{run_id}").json()
        return run if run["status"] in statuses else None
    return wait_until(done, timeout_s, 0.05, f"run {run_id} to reach {statuses}")
