"""One broker contract, three brokers: embedded (SQLite), Redis and RabbitMQ
(docs/architecture.md, "The embedded broker" and "Redis and RabbitMQ").

Every case runs a real deployment: ``runstile up`` on the embedded broker; ``runstile
serve`` + ``runstile worker`` with ``RUNSTILE_BROKER_URL`` for Redis and RabbitMQ (one
contract suite, docs/guarantees.md, "Also proven"; after huey's StorageTests).  Executions
are counted in an external log file, never in the ledger.

Brokers: Redis is a ``redis-server`` of the test's own (no persistence), so it can be
stopped and restarted empty without touching the shared one.  RabbitMQ is the machine's
shared server (no vhost of our own) wherever the broker need not go away: the test purges
runstile's queues before and after, and a purge stands in for "restarted empty".  The
failed-publish case stops its broker under a running deployment, so there RabbitMQ is a
node of the test's own (``own_rabbitmq``: ``rabbitmq-server`` on free ports, its files in
the test's folder, killed and booted again with its mnesia directory wiped); the shared
server on 5672 is never stopped.  Broker fixtures skip locally and fail under CI when the
machine's broker (conftest.broker_available) or the server binary a test starts is
missing.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runstile import dispatch, queues
from runstile.config import Settings
from runstile.ledger import broker_queue, db, migrations
from tests import postgres
from tests.conftest import (
    ROOT,
    RUNSTILE,
    Api,
    Ledger,
    Server,
    System,
    Workers,
    broker_available,
    free_port,
    wait_until,
)
from tests.receiver import Receiver
from tests.workers.test_profile_cap import most_at_once

TASKS = "tests.workers.exec_tasks,runstile.demo"
#: Short leases so that recovery's "queued long after dispatch" (2 leases) comes in 4 s.
FAST = {"RUNSTILE_LEASE_S": "2", "RUNSTILE_HEARTBEAT_S": "0.5",
        "RUNSTILE_RECOVERY_INTERVAL_S": "0.5", "RUNSTILE_DRAIN_TIMEOUT_S": "2",
        "RUNSTILE_TASKS": TASKS}
#: Default leases: nothing is re-published while a slow machine works through a batch.
STEADY = {"RUNSTILE_LEASE_S": "15", "RUNSTILE_HEARTBEAT_S": "5"}
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


# -- brokers ----------------------------------------------------------------------------

class EmbeddedBroker:
    kind, url = "embedded", "sqlite"

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def duplicate(self, run_id: str, dispatch_id: int) -> None:
        """One more message for the run, as a broker redelivery or a double publish."""
        message = dispatch.message_for(run_id, dispatch_id)
        conn = self.ledger.connect()
        try:
            with db.transaction(conn):
                broker_queue.insert_message(conn, dispatch.QUEUE, message.message_id,
                                            message.encode(), run_id=run_id)
        finally:
            conn.close()

    def lose_messages(self) -> int:
        conn = self.ledger.connect()
        try:
            with db.transaction(conn):
                return conn.execute("DELETE FROM broker_messages").rowcount
        finally:
            conn.close()

    def close(self) -> None:
        pass


class ExternalBroker:
    """Redis or RabbitMQ: duplicates are published from here, like a second publisher."""

    kind: str
    url: str
    _publisher: dispatch.Publisher | None = None

    def duplicate(self, run_id: str, dispatch_id: int) -> None:
        if self._publisher is None:
            self._publisher = dispatch.Publisher(
                Settings.from_env({"RUNSTILE_BROKER_URL": self.url}))
        assert self._publisher.send(run_id, dispatch_id)


class OwnRedis(ExternalBroker):
    """A redis-server of this test's own, without persistence: a restart empties it."""

    kind = "redis"

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = folder, free_port(), None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        log = open(self.folder / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)], stdout=log, stderr=log)
        log.close()
        import redis
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.RedisError:
                return False
        wait_until(answers, 10, 0.05, f"redis-server on {self.port}")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def lose_messages(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()


class OwnRabbitmq(ExternalBroker):
    """A RabbitMQ node of this test's own on free ports; a restart empties it.

    The node runs as the current user from RabbitMQ's own start script (not a distro
    wrapper that switches to the ``rabbitmq`` user), with every file in ``folder``: its
    config (listener on 127.0.0.1 only: the system config binds 5672), an empty plugin
    list (no management listener), its cookie (``HOME``), logs and mnesia.  It shares
    only epmd with the machine's node.  ``stop`` kills it abruptly, as a crash would;
    ``start`` wipes mnesia first, so nothing durable survives a restart.
    """

    kind = "rabbitmq"
    #: RabbitMQ's start script, behind the wrapper Debian/Ubuntu put on PATH.
    DEBIAN_SCRIPT = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
    SHARED_PORT = 5672

    def __init__(self, folder: Path, script: str) -> None:
        self.folder, self.script = folder, script
        self.port, self.dist_port = free_port(), free_port()
        self.node = f"rs_test_{self.port}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"
        self.proc: subprocess.Popen | None = None
        self.log_path = folder / f"rabbitmq-{self.port}.log"
        (folder / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n")
        (folder / "enabled_plugins").write_text("[].\n")
        (folder / "rabbitmq-env.conf").write_text("")  # not the system's env file

    @classmethod
    def script_or_skip(cls) -> str:
        if cls.DEBIAN_SCRIPT.exists():
            return str(cls.DEBIAN_SCRIPT)
        found = shutil.which("rabbitmq-server")
        if found is None:
            message = "rabbitmq-server is not installed (the test starts a node of its own)"
            if os.environ.get("CI"):
                pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
            pytest.skip(message)
        return found

    def start(self) -> OwnRabbitmq:
        assert self.proc is None, "already running"
        shutil.rmtree(self.folder / "mnesia", ignore_errors=True)  # restarted empty
        self.dist_port = free_port()
        f = self.folder
        env = {**os.environ,
               "HOME": str(f),  # the node's Erlang cookie lives here
               "RABBITMQ_CONF_ENV_FILE": str(f / "rabbitmq-env.conf"),
               "RABBITMQ_NODENAME": self.node,
               "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
               "RABBITMQ_NODE_PORT": str(self.port),
               "RABBITMQ_DIST_PORT": str(self.dist_port),
               "RABBITMQ_CONFIG_FILE": str(f / "rabbitmq.conf"),
               "RABBITMQ_ENABLED_PLUGINS_FILE": str(f / "enabled_plugins"),
               "RABBITMQ_MNESIA_BASE": str(f / "mnesia"),
               "RABBITMQ_LOG_BASE": str(f / "log"),
               "RABBITMQ_LOGS": "-",  # to the log file below
               "RABBITMQ_PID_FILE": str(f / "rabbitmq.pid"),
               "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
                   "-kernel inet_dist_use_interface {127,0,0,1}",
               "ERL_EPMD_ADDRESS": "127.0.0.1"}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.script], env=env, stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     cwd=f)
        log.close()
        try:
            wait_until(self._answers, 60, 0.25, f"rabbitmq node {self.node} to accept AMQP")
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"rabbitmq-server exited with {self.proc.returncode}:\n"
                                 + self.log_path.read_text(errors="replace")[-4000:])
        import pika
        params = pika.URLParameters(self.url)
        params.connection_attempts, params.socket_timeout = 1, 2
        try:
            pika.BlockingConnection(params).close()
            return True
        except pika.exceptions.AMQPError:
            return False

    @staticmethod
    def _table() -> dict[int, tuple[int, str, str]]:
        """Every process: pid -> (parent pid, state, start time)."""
        table = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(stat.parent.name)] = (int(fields[1]), fields[0], fields[19])
        return table

    @staticmethod
    def _command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    @staticmethod
    def _listeners(*ports: int) -> set[int]:
        out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True,
                             timeout=30).stdout
        pids = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[3].rsplit(":", 1)[-1] in {str(p) for p in ports}:
                pids.update(int(pid) for pid in re.findall(r"pid=(\d+)", line))
        return pids

    def stop(self) -> None:
        """Kill the node at once, as a crash would, and wait until all of it is gone.

        Its processes are the start script's descendants (erl_child_setup and its port
        programs start sessions of their own, so killing the process group is not
        enough; once beam dies they are orphans, so they are remembered by pid and start
        time) and any beam.smp listening on this node's ports.  The machine's node
        (listening on 5672) is never signalled.
        """
        if self.proc is None:
            return
        known: dict[int, str] = {}  # pid -> start time, so a reused pid is never hit
        shared = self._listeners(self.SHARED_PORT)
        assert self.proc.pid not in shared

        def alive() -> set[int]:
            # The script is not reaped before the end, so its pid stays ours meanwhile.
            table = self._table()
            roots = [self.proc.pid, *(pid for pid, started in known.items()
                                      if pid in table and table[pid][2] == started)]
            for pid in self._listeners(self.port, self.dist_port) - shared:
                if pid in table and self._command(pid) == "beam.smp":
                    roots.append(pid)
            children = collections.defaultdict(list)
            for pid, (ppid, _, _) in table.items():
                children[ppid].append(pid)
            while roots:
                pid = roots.pop()
                if pid in table and pid not in shared and pid != os.getpid():
                    known.setdefault(pid, table[pid][2])
                    roots.extend(c for c in children[pid] if c not in known)
            return {pid for pid, started in known.items()
                    if pid in table and table[pid][2] == started and table[pid][1] != "Z"}

        def gone() -> bool:
            left = alive()
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return not left
        try:
            wait_until(gone, 30, 0.1, f"rabbitmq node {self.node} to be gone")
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=20)
            self.proc = None
        wait_until(lambda: not self._listeners(self.port, self.dist_port), 20, 0.1,
                   f"ports {self.port} and {self.dist_port} to close")

    def lose_messages(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()


class SharedRabbitmq(ExternalBroker):
    kind, url = "rabbitmq", RABBITMQ_URL

    def purge(self) -> None:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker
        broker = RabbitmqBroker(url=self.url, middleware=[])
        try:
            # The default queue, deliveries' and the queue tests/workers/test_queues.py
            # uses: each with its delay queue and its dead letters.
            for name in (dispatch.QUEUE, queues.DELIVERY_QUEUE, queues.broker_queue("slow")):
                broker.declare_queue(name)
            broker.flush_all()
        finally:
            broker.close()

    def lose_messages(self) -> None:
        self.purge()

    def close(self) -> None:
        self.purge()


@pytest.fixture
def broker(request, ledger, tmp_path):
    kind = request.param
    if kind == "embedded":
        made = EmbeddedBroker(ledger)
    elif kind == "redis":
        broker_available("redis")
        if shutil.which("redis-server") is None:
            message = "redis-server is not installed (the suite starts one of its own)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        made = OwnRedis(tmp_path).start()
    elif kind == "own_rabbitmq":
        made = OwnRabbitmq(tmp_path, OwnRabbitmq.script_or_skip())
        made.start()
    else:
        broker_available("rabbitmq")
        made = SharedRabbitmq()
        made.purge()
    try:
        yield made
    finally:
        made.close()


ALL = [pytest.param("embedded"), pytest.param("redis", marks=pytest.mark.broker),
       pytest.param("rabbitmq", marks=pytest.mark.broker)]
#: Brokers the test may stop and restart empty: servers of its own.
STOPPABLE = [pytest.param("redis", marks=pytest.mark.broker),
             pytest.param("own_rabbitmq", marks=pytest.mark.broker)]


# -- deployments ------------------------------------------------------------------------

@dataclass
class Deployment:
    """Web + workers on one ledger and one broker; the embedded one is ``runstile up``."""

    broker: object
    ledger: Ledger
    env: dict
    web_env: dict = field(default_factory=dict)
    web: Server | None = None
    workers: Workers | None = None
    logs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.env = {**FAST, **self.env, "RUNSTILE_BROKER_URL": self.broker.url}
        self.key = self.ledger.key()

    @property
    def embedded(self) -> bool:
        return self.broker.kind == "embedded"

    def start(self) -> Deployment:
        if self.embedded:
            self.web = System(self.ledger.data_dir, self.env, web_workers=1).start()
            self.logs.append(self.web)
        else:
            self.start_workers()
            self.web = Server(self.ledger.data_dir, {**self.env, **self.web_env},
                              web_workers=1).start()
        return self

    @property
    def api(self) -> Api:
        return Api(self.web, self.key, self.ledger)

    def stop_workers(self) -> None:
        """No worker consumes any more; the web keeps admitting (for ``up``: a plain
        ``serve`` takes its place on the same ledger)."""
        if self.embedded:
            self.web.stop()
            self.web = Server(self.ledger.data_dir, self.env, web_workers=1).start()
        else:
            self.workers.kill(signal.SIGTERM)

    def start_workers(self) -> None:
        if self.embedded:
            self.web.stop()
            self.web = System(self.ledger.data_dir, self.env, web_workers=1).start()
            self.logs.append(self.web)
        else:
            self.workers = Workers(self.ledger.data_dir, self.env).start()
            self.logs.append(self.workers)

    def worker_log(self) -> str:
        return "".join(part.log() for part in self.logs)

    def close(self) -> None:
        for part in (self.web, self.workers):
            if part is not None:
                part.kill()


@pytest.fixture
def deploy(broker, ledger):
    made: list[Deployment] = []

    def make(env: dict | None = None, web_env: dict | None = None) -> Deployment:
        deployment = Deployment(broker, ledger, env or {}, web_env or {})
        made.append(deployment)
        return deployment.start()

    yield make
    for deployment in made:
        deployment.close()


# -- helpers ----------------------------------------------------------------------------

def starts_by_run(path: Path) -> collections.Counter:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    return collections.Counter(line.split()[1] for line in lines if line.startswith("start "))


def submit(api: Api, log: Path, count: int, *, clients: int = 1,
           hold_s: float = 0.0) -> list[str]:
    """``count`` runs of t.log_start (each body holding its thread ``hold_s``), from
    ``clients`` concurrent clients; their ids in submission order."""
    local = threading.local()

    def one(i: int) -> str:
        client = getattr(local, "api", None)
        if client is None:
            client = local.api = Api(api.server, api.key, api.ledger)
        response = client.post_run({"task": "t.log_start",
                                    "input": {"log": str(log), "n": i, "hold_s": hold_s}})
        assert response.status_code == 202, response.text
        assert response.json()["status"] in ("queued", "running", "completed")
        return response.json()["id"]

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(count)))


def statuses(ledger: Ledger) -> dict:
    return dict(ledger.query("SELECT status, COUNT(*) FROM runs GROUP BY status"))


def wait_completed(ledger: Ledger, count: int, timeout_s: float = 90) -> None:
    wait_until(lambda: statuses(ledger) == {"completed": count}, timeout_s, 0.1,
               f"{count} runs to complete")


def assert_one_start_each(log: Path, ids: list[str]) -> None:
    starts = starts_by_run(log)
    assert set(starts) == set(ids)
    assert set(starts.values()) == {1}, {rid: n for rid, n in starts.items() if n != 1}


def unsent(ledger: Ledger) -> int:
    return ledger.query("SELECT COUNT(*) FROM dispatches WHERE sent_at IS NULL")[0][0]


def recover(deployment: Deployment, env: dict) -> dict:
    """``runstile recover --json`` (one pass, as cron would run it); its report."""
    done = subprocess.run(
        [*RUNSTILE, "recover", "--json", "--data-dir", str(deployment.ledger.data_dir)],
        env={**os.environ, **deployment.env, **env}, cwd=ROOT, capture_output=True,
        text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the contract -----------------------------------------------------------------------

@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_500_runs_on_2_worker_processes_complete_with_one_start_each(deploy, ledger, tmp_path):
    deployment = deploy(STEADY)
    log = tmp_path / "executions.log"
    # Eight clients, and bodies of 50 ms, so that work is waiting while a consumer is
    # busy: one client at a time hands each run to whichever consumer polls first, and
    # on Redis the busy one (the other backs off, up to a second, while its queue looks
    # empty) can take all 500 when one process keeps up with no-op bodies (seen once
    # in CI after claims got cheaper).  One process's 4 threads run at most 80 such
    # bodies a second, so the queue fills and the other consumer finds it so.
    ids = submit(deployment.api, log, 500, clients=8, hold_s=0.05)
    wait_completed(ledger, 500, timeout_s=180)
    assert_one_start_each(log, ids)
    # Both worker processes took part.
    owners = {json.loads(d)["owner"]["pid"] for (d,) in ledger.query(
        "SELECT data FROM events WHERE type = 'run.started'")}
    assert len(owners) == 2
    # Every dispatch record reached the broker and was marked sent (for Redis/RabbitMQ by
    # the web, after the commit); one record per run, none re-published.
    assert unsent(ledger) == 0
    assert ledger.query("SELECT COUNT(*), COUNT(DISTINCT run_id) FROM dispatches") == [
        (500, 500)]


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_every_message_published_twice_still_executes_each_run_once(deploy, broker, ledger,
                                                                    tmp_path):
    deployment = deploy()
    log = tmp_path / "executions.log"
    ids = []
    for rid in submit(deployment.api, log, 30):
        # Right behind the original, while the run is still queued: the two race.
        (dispatch_id,) = ledger.query("SELECT id FROM dispatches WHERE run_id = ?", (rid,))[0]
        broker.duplicate(rid, dispatch_id)
        ids.append(rid)
    wait_completed(ledger, 30)
    # Each run's second message is consumed and loses its claim: a logged no-op.
    wait_until(lambda: deployment.worker_log().count("claim lost") >= 30, 30, 0.1,
               "every duplicate to lose its claim")
    assert_one_start_each(log, ids)
    assert ledger.query("SELECT COUNT(*) FROM events WHERE type = 'run.started'") == [(30,)]


@pytest.mark.parametrize("broker", STOPPABLE, indirect=True)
def test_a_failed_publish_still_answers_202_and_recovery_publishes_the_run(deploy, broker,
                                                                         ledger, tmp_path):
    # No scheduled pass: the one-shot `runstile recover` (cron) does the re-publishing.
    quiet = {"RUNSTILE_RECOVERY_INTERVAL_S": "3600"}
    deployment = deploy(quiet)
    broker.stop()  # the broker goes away under a running deployment
    log = tmp_path / "executions.log"
    started = time.monotonic()
    ids = submit(deployment.api, log, 20)
    assert time.monotonic() - started < 15, "a down broker must not hold admissions"
    assert unsent(ledger) == 20, "each record stays unsent, waiting for recovery"
    assert statuses(ledger) == {"queued": 20}
    broker.start()  # back, empty
    report = recover(deployment, quiet)
    assert report["counts"].get("published") == 20
    wait_completed(ledger, 20)
    assert_one_start_each(log, ids)
    assert unsent(ledger) == 0


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_messages_lost_by_the_broker_are_republished_and_run_once(deploy, broker, ledger,
                                                                tmp_path):
    deployment = deploy()
    deployment.stop_workers()
    log = tmp_path / "executions.log"
    ids = submit(deployment.api, log, 20)
    assert unsent(ledger) == 0, "every message reached the broker"
    broker.lose_messages()  # Redis restarted without persistence; RabbitMQ purged
    deployment.start_workers()
    # Nothing is left to consume; the scheduled pass finds the runs queued more than
    # two leases after their dispatch and re-publishes them.
    wait_completed(ledger, 20, timeout_s=60)
    assert_one_start_each(log, ids)
    republished = ledger.query("SELECT COUNT(DISTINCT run_id) FROM dispatches "
                               "WHERE reason = 'republished'")[0][0]
    assert republished == 20


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_a_runs_callback_and_its_task_deliveries_go_out_through_the_broker(deploy, broker,
                                                                          ledger, tmp_path):
    hook = Receiver()
    try:
        deployment = deploy({"RUNSTILE_CALLBACK_ALLOWLIST": "127.0.0.1"})
        rid = deployment.api.post_run({"task": "t.deliver", "callback_url": hook.url(), "input": {
            "log": str(tmp_path / "log"), "url": hook.url(), "count": 2}}).json()["id"]
        wait_until(lambda: len(hook.received()) == 3, 30, 0.05, "two deliveries, one callback")
        types = sorted(json.loads(r["body"])["type"] for r in hook.received())
        assert types == ["run.completed", "task.delivery", "task.delivery"]
        wait_until(lambda: ledger.query("SELECT DISTINCT state FROM obligations WHERE "
                                        "run_id = ?", (rid,)) == [("delivered",)], 10, 0.05,
                   "all three delivered")
    finally:
        hook.close()


@pytest.mark.parametrize("broker", ALL, indirect=True)
def test_a_run_waiting_for_its_profiles_slot_is_published_when_the_slot_frees(deploy, ledger,
                                                                             tmp_path):
    # RUNSTILE_MAX_RUNNING_PER_PROFILE across two worker processes; no scheduled pass, so
    # on Redis/RabbitMQ only the worker's publish after the freeing commit can hand on a
    # slot (tests/workers/test_profile_cap.py has the same on `runstile up` alone).
    deployment = deploy({**STEADY, "RUNSTILE_MAX_RUNNING_PER_PROFILE": "1",
                         "RUNSTILE_RECOVERY_INTERVAL_S": "3600"})
    log = tmp_path / "executions.log"
    tenants = {"a": deployment.api, "b": Api(deployment.web, ledger.key("tenant-b"), ledger)}
    ids = {tag: [api.post_run({"task": "t.tenant_step", "input": {
        "log": str(log), "tag": tag, "hold_s": 0.5}}).json()["id"] for _ in range(3)]
        for tag, api in tenants.items()}
    wait_completed(ledger, 6, timeout_s=60)
    peak, _ = most_at_once([line.split() for line in log.read_text().splitlines()])
    assert peak == {"a": 1, "b": 1}, peak
    refused = set(re.findall(r"run (run_[0-9a-f]{32}): claim lost \(profile_busy\)",
                             deployment.worker_log()))
    assert refused & set(ids["a"]) and refused & set(ids["b"])
    handed = {rid for (rid,) in ledger.query(
        "SELECT run_id FROM dispatches WHERE reason = 'profile_slot'")}
    assert refused <= handed and unsent(ledger) == 0


# -- run priority (docs/api.md, "POST /v1/runs"; docs/operations.md, "RabbitMQ and run
# priority"): Redis has no message priority, so it is no part of this contract.

#: "embedded_postgresql": the embedded broker on a fresh PostgreSQL database of its own
#: (skipped without RUNSTILE_TEST_DATABASE_URL).
PRIORITY_BROKERS = [pytest.param("embedded"), pytest.param("embedded_postgresql"),
                    pytest.param("rabbitmq", marks=pytest.mark.broker)]


def consume_all(made, queue_name: str, count: int) -> list[str]:
    """Every message of ``queue_name`` in the order the broker delivers it, one at a time."""
    consumer = made.consume(queue_name, prefetch=1, timeout=200)
    got: list[str] = []
    try:
        deadline = time.monotonic() + 15
        while len(got) < count and time.monotonic() < deadline:
            message = next(consumer)
            if message is not None:
                got.append(message.args[0])
                consumer.ack(message)
    finally:
        consumer.close()
    return got


def priority_broker(kind: str, ledger: Ledger, stack: contextlib.ExitStack):
    """A fresh queue's broker: the embedded one (on the test's SQLite ledger, or on a
    PostgreSQL database that ``stack`` drops), or RabbitMQ as runstile declares it."""
    from runstile.workers.sqlite_broker import SQLiteBroker
    if kind == "embedded":
        return SQLiteBroker(ledger.path, middleware=[])
    if kind == "embedded_postgresql":
        url = stack.enter_context(postgres.fresh_database())
        migrations.migrate(url)
        return SQLiteBroker(url, middleware=[])
    broker_available("rabbitmq")
    return dispatch.external_broker(RABBITMQ_URL, middleware=[], publishing=True)


def delete_queues(made, queue_name: str) -> None:
    if hasattr(made, "channel"):  # RabbitMQ: the queue was the test's own
        for name in (queue_name, f"{queue_name}.DQ", f"{queue_name}.XQ"):
            made.channel.queue_delete(name)


@pytest.mark.parametrize("kind", PRIORITY_BROKERS)
def test_a_higher_priority_message_is_delivered_first_then_arrival_order(kind, ledger):
    queue_name = f"runstile_priority_{os.getpid()}_{time.monotonic_ns()}"
    with contextlib.ExitStack() as stack:
        made = priority_broker(kind, ledger, stack)
        # Run last in first: the queues go, then the broker, then its database.
        stack.callback(made.close)
        stack.callback(delete_queues, made, queue_name)
        made.declare_queue(queue_name)
        sent = [(0, "a"), (0, "b"), (5, "c"), (9, "d"), (9, "e"), (3, "f")]
        for priority, tag in sent:
            # A run's own message (dispatch.message_for), on the test's fresh queue.
            message = dispatch.message_for(tag, 1, priority).copy(queue_name=queue_name)
            assert message.options["broker_priority"] == priority
            made.enqueue(message)
        assert consume_all(made, queue_name, len(sent)) == ["d", "e", "c", "f", "a", "b"]


@pytest.mark.broker
def test_a_rabbitmq_queue_declared_without_priority_still_takes_runs_in_arrival_order():
    """PRECONDITION_FAILED for x-max-priority on a queue from before priorities: runstile
    declares it as it is (a warning) instead of failing every publish."""
    broker_available("rabbitmq")
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    queue_name = f"runstile_legacy_{os.getpid()}_{time.monotonic_ns()}"
    old = RabbitmqBroker(url=RABBITMQ_URL, middleware=[])
    old.declare_queue(queue_name)
    old.enqueue(dispatch.message_for("before", 1).copy(queue_name=queue_name))
    made = dispatch.external_broker(RABBITMQ_URL, middleware=[], publishing=True)
    try:
        made.declare_queue(queue_name)
        for priority, tag in [(0, "low"), (9, "high")]:
            made.enqueue(dispatch.message_for(tag, 1, priority).copy(queue_name=queue_name))
        assert made.without_priority == {queue_name, f"{queue_name}.DQ"}
        assert consume_all(made, queue_name, 3) == ["before", "low", "high"]
    finally:
        delete_queues(made, queue_name)
        made.close()
        old.close()
