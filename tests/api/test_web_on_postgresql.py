"""The web tier on a PostgreSQL ledger is stateless (docs/architecture.md, "Two dialects,
one ledger"): two `runstile serve` processes on two ports share one fresh database and no
workers, and whatever one of them committed the other answers — a replay, a 409, a read,
a stop, the rest of an event stream.  Each serve runs its admission writer process too, so
the writer's group commit runs on PostgreSQL here.

Host A gets the URL through RUNSTILE_DATABASE_URL, host B through --database-url; both
URLs carry a password (the test server trusts loopback and ignores it), which must
appear in no child's command line, no answer and no log.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests

from runstile.ledger import db, events
from tests import postgres
from tests.conftest import ROOT, RUNSTILE, Server, child_pids

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

PASSWORD = "not-a-real-secret-4242"


def _with_password(url: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username or 'postgres'}:{PASSWORD}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with postgres.fresh_database(required=True) as bare:
        url = _with_password(bare)
        folder = tmp_path_factory.mktemp("pgweb")
        env = {"RUNSTILE_WEB_THREADS": "4", "RUNSTILE_LOG_FORMAT": "text"}
        a = Server(folder / "a", {**env, "RUNSTILE_DATABASE_URL": url}, web_workers=1)
        b = Server(folder / "b", env, web_workers=1, args=("--database-url", url))
        started = []
        try:
            for server in (a, b):
                started.append(server.start())
            created = cli("keys", "create", "--profile", "pgweb", "--json", url=url,
                          data_dir=folder / "a")
            assert created.returncode == 0, created.stderr
            key = json.loads(created.stdout.strip().splitlines()[-1])
            yield a, b, {"Authorization": f"Bearer {key['secret']}"}, bare
        finally:
            for server in started:
                server.stop()


def cli(*argv: str, url: str, data_dir) -> subprocess.CompletedProcess:
    """A ``runstile`` command on the shared database, as a process of its own."""
    return subprocess.run([*RUNSTILE, *argv, "--data-dir", str(data_dir)],
                          env={**_env(), "RUNSTILE_DATABASE_URL": url}, capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RUNSTILE_DATABASE_URL"}


def post(server: Server, headers: dict, body: dict, key: str) -> requests.Response:
    return requests.post(server.url + "/v1/runs", json=body, timeout=10,
                         headers={**headers, "Idempotency-Key": key})


def test_a_retry_on_the_other_host_is_a_replay_and_another_body_is_a_409(hosts):
    a, b, headers, _ = hosts
    key = f"k-{uuid.uuid4().hex}"
    first = post(a, headers, {"task": "echo", "input": {"n": 1}}, key)
    assert first.status_code == 202 and first.headers.get("Idempotency-Replayed") != "true"
    again = post(b, headers, {"task": "echo", "input": {"n": 1}}, key)
    assert again.status_code == 202, again.text
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    other = post(b, headers, {"task": "echo", "input": {"n": 2}}, key)
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_conflict"


def test_the_same_key_sent_to_both_hosts_at_once_admits_one_run(hosts):
    """Two admission writers race on each key: the ledger's writer lock orders them, and
    the second sees the first's reservation, so it replays it."""
    a, b, headers, _ = hosts
    keys = [f"race-{uuid.uuid4().hex}" for _ in range(12)]
    body = {"task": "echo", "input": {"race": True}}
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda job: post(job[0], headers, body, job[1]),
                                [(server, key) for key in keys for server in (a, b)]))
    for i in range(0, len(answers), 2):
        pair = answers[i:i + 2]
        assert [r.status_code for r in pair] == [202, 202], [r.text for r in pair]
        assert pair[0].json()["id"] == pair[1].json()["id"]
        assert sorted(r.json()["replayed"] for r in pair) == [False, True]


def test_a_run_admitted_on_one_host_is_read_and_listed_on_the_other(hosts):
    a, b, headers, _ = hosts
    rid = post(a, headers, {"task": "echo", "input": {"x": "y"}}, uuid.uuid4().hex).json()["id"]
    read = requests.get(f"{b.url}/v1/runs/{rid}", headers=headers, timeout=10)
    assert read.status_code == 200 and read.json()["input"] == {"x": "y"}
    listed = requests.get(f"{b.url}/v1/runs", headers=headers, timeout=10).json()
    assert rid in [run["id"] for run in listed["data"]]


def test_a_stop_on_one_host_is_seen_on_the_other(hosts):
    a, b, headers, _ = hosts
    rid = post(a, headers, {"task": "echo"}, uuid.uuid4().hex).json()["id"]
    stopped = requests.post(f"{b.url}/v1/runs/{rid}/stop", headers=headers, timeout=10)
    assert stopped.status_code == 200 and stopped.json()["status"] == "cancelled"
    seen = requests.get(f"{a.url}/v1/runs/{rid}", headers=headers, timeout=10).json()
    assert seen["status"] == "cancelled"


def _frames(response: requests.Response, count: int | None = None) -> list[tuple[int, str]]:
    """(id, event) of each frame read from an event stream, ``count`` of them or all."""
    frames: list[tuple[int, str]] = []
    current: dict[str, str] = {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "" and "id" in current:
            frames.append((int(current["id"]), current["event"]))
            current = {}
            if count is not None and len(frames) == count:
                break
        elif line and not line.startswith(":") and ": " in line:
            name, value = line.split(": ", 1)
            current[name] = value
    response.close()
    return frames


def test_an_event_stream_read_on_one_host_resumes_on_the_other_without_gap_or_repeat(hosts):
    a, b, headers, bare = hosts
    rid = post(a, headers, {"task": "echo"}, uuid.uuid4().hex).json()["id"]
    # The events a worker's ctx.emit would write, through the ledger on the same URL.
    conn = db.connect(bare)
    try:
        with db.transaction(conn):
            for n in range(4):
                events.append(conn, rid, "run.progress", {"n": n})
    finally:
        conn.close()
    stream = requests.get(f"{a.url}/v1/runs/{rid}/events", headers=headers, stream=True,
                          timeout=10)
    head = _frames(stream, 3)
    assert head == [(1, "run.queued"), (2, "run.progress"), (3, "run.progress")]
    # Stopped on B: the run ends, so B's resumed stream closes after run.cancelled.
    assert requests.post(f"{b.url}/v1/runs/{rid}/stop", headers=headers,
                         timeout=10).status_code == 200
    resumed = requests.get(f"{b.url}/v1/runs/{rid}/events", stream=True, timeout=10,
                           headers={**headers, "Last-Event-ID": str(head[-1][0])})
    tail = _frames(resumed)
    assert tail == [(4, "run.progress"), (5, "run.progress"), (6, "run.cancelled")]


def test_the_delivery_list_pages_on_one_host_and_goes_on_on_the_other(hosts):
    a, b, headers, _ = hosts
    ids = []
    for _ in range(3):  # each cancelled run owes its callback (no worker sends it)
        rid = post(a, headers, {"task": "echo", "callback_url": "https://hooks.example.com/r"},
                   uuid.uuid4().hex).json()["id"]
        assert requests.post(f"{a.url}/v1/runs/{rid}/stop", headers=headers,
                             timeout=10).status_code == 200
        ids.append(rid)
    first = requests.get(f"{a.url}/v1/deliveries", params={"limit": 2}, headers=headers,
                         timeout=10).json()
    assert first["has_more"] is True
    rest = requests.get(f"{b.url}/v1/deliveries", headers=headers, timeout=10,
                        params={"limit": 200, "cursor": first["next_cursor"]}).json()
    seen = [d["run_id"] for d in first["data"] + rest["data"]]
    assert seen[:3] == list(reversed(ids)) and len(seen) == len(set(seen)), seen
    # The operator's commands settle one on the same database; both hosts see it.
    delivery = first["data"][0]["id"]
    discarded = cli("deliveries", "discard", delivery, "--json", url=hosts[3],
                    data_dir=a.data_dir)
    assert discarded.returncode == 0, discarded.stderr
    assert json.loads(discarded.stdout.splitlines()[-1])["state"] == "discarded"
    again = cli("deliveries", "retry", delivery, url=hosts[3], data_dir=a.data_dir)
    assert again.returncode == 1 and "delivery_settled" in again.stderr
    for server in (a, b):
        run_id = first["data"][0]["run_id"]
        shown = requests.get(f"{server.url}/v1/runs/{run_id}/deliveries", headers=headers,
                             timeout=10).json()
        assert [d["state"] for d in shown["data"]] == ["discarded"]


def test_readiness_and_capabilities_name_postgresql_and_never_the_password(hosts):
    a, b, headers, _ = hosts
    for server in (a, b):
        ready = requests.get(server.url + "/readyz", timeout=10).json()
        assert ready["checks"] == {"ledger": True, "migrated": True, "recovered": True}
        assert ready["ledger"] == {"engine": "postgresql", "synchronous_commit": "on"}
        answer = requests.get(server.url + "/v1/capabilities", headers=headers, timeout=10)
        caps = answer.json()
        assert caps["ledger"] == "postgresql"
        assert caps["synchronous"] == "on" and caps["durable"] is True
        assert PASSWORD not in answer.text + json.dumps(ready)
        assert "postgresql://postgres:***@" in server.log()  # the banner, redacted
        assert PASSWORD not in server.log()
        assert not (server.data_dir / "ledger.db").exists()


def test_no_child_of_serve_carries_the_password_on_its_command_line(hosts):
    a, b, _, _ = hosts
    for server in (a, b):
        children = child_pids(server.proc.pid)
        assert server.writer_pid() is not None and server.web_pids(), children
        for pid in [server.proc.pid, *children]:  # serve itself too: it re-executed
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert PASSWORD.encode() not in f.read(), pid
