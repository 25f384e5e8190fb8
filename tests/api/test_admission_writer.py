"""The admission writer (runstile/web/writer/): one process commits the admissions of
every web process, and losing it at any moment loses and duplicates nothing.

Real ``runstile serve`` processes on loopback, a real ledger file; the writer is stopped,
killed and cut off with real signals.
"""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from runstile.web.writer.supervisor import _STOPPED_S
from tests.conftest import Api, Server, wait_for_writer, wait_until, writer_socket


def test_every_web_process_hands_its_admissions_to_the_one_writer_process(make_server, ledger):
    server = make_server(web_workers=3)
    wait_until(lambda: len(server.web_pids()) == 3, 15, 0.05, "3 web workers")
    writer = wait_for_writer(server)
    path = writer_socket(writer)
    # Only this user may reach the socket: it is a write path into the ledger.
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    api = Api(server, ledger.key(), ledger)
    assert api.post_run({"task": "echo"}, idempotency_key="warm").status_code == 202
    os.kill(writer, signal.SIGSTOP)
    answers: list = []
    try:
        posts = [threading.Thread(target=lambda i=i: answers.append(
            Api(server, api.key, ledger).post_run({"task": "echo", "input": i},
                                                  idempotency_key=f"held-{i}")))
                 for i in range(12)]
        for post in posts:
            post.start()
        time.sleep(1.0)
        # Every web process sent its admissions to the stopped writer: none answered.
        assert answers == []
        assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    finally:
        os.kill(writer, signal.SIGCONT)
    for post in posts:
        post.join(30)
    assert sorted(r.status_code for r in answers) == [202] * 12
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 13
    assert server.writer_pid() == writer  # the same process all along


def test_a_writer_killed_after_its_commit_answers_503_and_the_retry_replays_the_run(ledger):
    server = Server(ledger.data_dir, {"RUNSTILE_CRASHPOINT": "writer_after_commit"},
                    web_workers=1).start()
    try:
        wait_for_writer(server)
        api = Api(server, ledger.key(), ledger)
        answer = api.post_run({"task": "echo", "input": "doomed"}, idempotency_key="crash-1")
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "run_storage_unavailable"
        assert int(answer.headers["Retry-After"]) >= 1
        assert "may or may not" in answer.json()["error"]["message"]
    finally:
        server.kill()
    # The writer died after the COMMIT, before answering: the run is in the ledger.
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    server = Server(ledger.data_dir, {}, web_workers=1).start()
    try:
        retry = Api(server, api.key, ledger).post_run({"task": "echo", "input": "doomed"},
                                                      idempotency_key="crash-1")
        assert retry.status_code == 202 and retry.json()["replayed"] is True
        assert ledger.query("SELECT id FROM runs") == [(retry.json()["id"],)]
        assert ledger.query("SELECT COUNT(*) FROM dispatches")[0][0] == 1
    finally:
        server.kill()


def test_admissions_go_on_while_the_writer_is_killed_again_and_again(make_server, ledger):
    """Eight clients admit while the writer is SIGKILLed ten times: serve restarts it,
    the web processes commit themselves meanwhile, a 503 (the writer died holding the
    request) is retried with its key; in the end each key has exactly one run, the one
    its 202 named, with one dispatch."""
    server = make_server(web_workers=2, RUNSTILE_MAX_ACTIVE_RUNS="1000000")
    key = Api(server, ledger.key(), ledger).key
    acknowledged: dict[str, str] = {}
    unavailable = [0]
    stop = threading.Event()

    def client(c: int) -> None:
        api, i = Api(server, key, ledger), 0
        while not stop.is_set():
            i += 1
            idem = f"c{c}-{i}"
            while True:  # a 503 is retried with the same key until it is answered
                answer = api.post_run({"task": "echo", "input": [c, i]}, idempotency_key=idem)
                if answer.status_code == 503:
                    assert answer.json()["error"]["code"] == "run_storage_unavailable"
                    unavailable[0] += 1
                    continue
                assert answer.status_code == 202, answer.text
                acknowledged[idem] = answer.json()["id"]
                break

    def admitted_more(count: int) -> bool:
        for future in futures:
            if future.done():
                future.result()  # a client failed: raise its assertion here
        return len(acknowledged) >= count + 20

    writers = [wait_for_writer(server)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, c) for c in range(8)]
        try:
            for _ in range(10):
                count = len(acknowledged)
                wait_until(lambda count=count: admitted_more(count), 30, 0.01,
                           "admissions between two kills")
                os.kill(writers[-1], signal.SIGKILL)
                writers.append(wait_for_writer(server, previous=writers[-1]))
            count = len(acknowledged)
            wait_until(lambda: admitted_more(count), 30, 0.01,
                       "admissions after the last restart")
        finally:
            stop.set()
        for future in futures:
            future.result(60)
    assert len(set(writers)) == 11 and server.proc.poll() is None
    stored = dict(ledger.query("SELECT idempotency_key, run_id FROM idempotency_keys"))
    assert stored == acknowledged
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == len(acknowledged)
    assert ledger.query("SELECT COUNT(DISTINCT run_id), COUNT(*) FROM dispatches")[0] == (
        len(acknowledged), len(acknowledged))
    assert server.log().count("admission writer (pid") >= 10


def test_a_web_process_commits_its_own_admissions_when_the_writer_cannot_be_reached(
        make_server, ledger):
    server = make_server(web_workers=1)
    writer = wait_for_writer(server)
    api = Api(server, ledger.key(), ledger)
    os.kill(writer, signal.SIGSTOP)
    try:
        os.unlink(writer_socket(writer))  # nothing listens there any more
        answer = api.post_run({"task": "echo"}, idempotency_key="alone")
        # Answered although the writer is frozen: the web process committed it.
        assert answer.status_code == 202 and answer.json()["replayed"] is False
        replay = api.post_run({"task": "echo"}, idempotency_key="alone")
        assert replay.json() == {**answer.json(), "replayed": True}
    finally:
        os.kill(writer, signal.SIGCONT)
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert "runstile_admission_writer_unreachable_total 2.0" in metrics


def test_inline_admission_runs_no_writer_process(make_server, ledger):
    server = make_server(web_workers=2, RUNSTILE_ADMISSION_WRITER="inline")
    wait_until(lambda: len(server.web_pids()) == 2, 15, 0.05, "2 web workers")
    answer = Api(server, ledger.key(), ledger).post_run({"task": "echo"},
                                                        idempotency_key="inline")
    assert answer.status_code == 202
    assert server.writer_pid() is None


def test_stopping_serve_stops_its_writer_and_removes_its_socket(ledger):
    server = Server(ledger.data_dir, {}, web_workers=1).start()
    writer = wait_for_writer(server)
    directory = os.path.dirname(writer_socket(writer))
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(30) == 0
    wait_until(lambda: not os.path.exists(f"/proc/{writer}"), 10, 0.05, "the writer to exit")
    assert not os.path.exists(directory)
    server.kill()


def test_a_writer_whose_serve_was_killed_exits_by_itself(ledger):
    server = Server(ledger.data_dir, {}, web_workers=1).start()
    writer = wait_for_writer(server)
    os.kill(server.proc.pid, signal.SIGKILL)  # serve alone, not its group
    try:
        wait_until(lambda: not os.path.exists(f"/proc/{writer}")
                   or open(f"/proc/{writer}/stat").read().split()[2] == "Z",
                   10, 0.05, "the orphaned writer to exit")
    finally:
        server.kill()


def test_a_stopped_writer_answers_503_after_the_busy_timeout_and_commits_nothing_twice(
        make_server, ledger):
    server = make_server(web_workers=1, RUNSTILE_BUSY_TIMEOUT_MS="500")
    writer = wait_for_writer(server)
    api = Api(server, ledger.key(), ledger)
    os.kill(writer, signal.SIGSTOP)
    try:
        started = time.monotonic()
        answer = api.post_run({"task": "echo"}, idempotency_key="frozen")
        waited = time.monotonic() - started
    finally:
        os.kill(writer, signal.SIGCONT)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "run_storage_unavailable"
    assert waited < 25  # bounded by the busy timeout plus the writer's grace
    # The request waited in the stopped writer's socket; resumed, the writer commits it
    # (nobody hears the answer).  The retry replays that run, never makes a second one.
    retry = wait_until(lambda: (lambda r: r if r.status_code == 202 else None)(
        api.post_run({"task": "echo"}, idempotency_key="frozen")), 30, 0.1, "the retry")
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 1
    assert retry.json()["id"] == ledger.query("SELECT id FROM runs")[0][0]


def test_a_lingering_writer_answers_every_admission_of_its_batches(make_server, ledger):
    server = make_server(web_workers=2, RUNSTILE_ADMISSION_LINGER_MS="5")
    wait_for_writer(server)
    api = Api(server, ledger.key(), ledger)

    def post(i: int):
        answer = api.post_run({"task": "echo", "input": i}, idempotency_key=f"linger-{i}")
        assert answer.status_code == 202, answer.text
        return answer.json()["id"]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(post, range(200)))
    assert len(set(ids)) == 200
    stored = dict(ledger.query("SELECT idempotency_key, run_id FROM idempotency_keys"))
    assert stored == {f"linger-{i}": run_id for i, run_id in enumerate(ids)}
    # A replay is answered from the same batch machinery, lingering or not.
    assert api.post_run({"task": "echo", "input": 7}, idempotency_key="linger-7").json()[
        "replayed"] is True


def test_a_web_process_retired_while_serve_runs_leaves_the_writer_and_metrics_alone(
        make_server, ledger):
    """gunicorn forks its web processes from inside serve's run and they leave by
    sys.exit, so serve's clean-up ran in each one on its way out: the writer was stopped
    and its socket removed, and so was the metrics folder every other process writes to.
    SIGTTOU makes gunicorn retire one web process gracefully while serve goes on."""
    server = make_server(web_workers=2)
    wait_until(lambda: len(server.web_pids()) == 2, 15, 0.05, "2 web workers")
    writer = wait_for_writer(server)
    path = writer_socket(writer)
    with open(f"/proc/{writer}/environ", "rb") as f:  # serve set it before starting it
        metrics = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)[
            b"PROMETHEUS_MULTIPROC_DIR"].decode()
    os.kill(server.proc.pid, signal.SIGTTOU)
    wait_until(lambda: len(server.web_pids()) == 1, 15, 0.05, "one web worker retired")
    time.sleep(_STOPPED_S + 0.5)  # past the supervisor's restart delay after a stop
    assert server.writer_pid() == writer and os.path.exists(path) and os.path.isdir(metrics)
    api = Api(server, ledger.key(), ledger)
    assert api.post_run({"task": "echo"}, idempotency_key="after").status_code == 202
    assert "exited; restarting" not in server.log() and "Traceback" not in server.log()
