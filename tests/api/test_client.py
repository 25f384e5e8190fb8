"""runstile.Client and `runstile runs …` against a real `runstile up` on loopback.

No mocks: the retry tests put a tiny HTTP server (or a TCP proxy) of their own on
loopback between the client and the real system, and make it fail the way networks do.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import requests

import runstile
from runstile.cli import main
from runstile.errors import ApiError, RunstileError
from tests.conftest import System, free_port, new_ledger


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """One `runstile up` for the module; each test isolates itself with a key of its own."""
    with new_ledger(tmp_path_factory.mktemp("clients")) as ledger:
        system = System(ledger.data_dir, {}, web_workers=1, workers=2, threads=4).start()
        system.ledger = ledger
        yield system
        system.kill()


@pytest.fixture
def key(system):
    return system.ledger.key("default")


@pytest.fixture
def client(system, key):
    with runstile.Client(system.url, key.secret, timeout_s=10) as c:
        yield c


# ------------------------------------------------------------------ loopback fault makers

@dataclass
class Seen:
    method: str
    path: str
    headers: dict
    at: float


class Interceptor:
    """A tiny HTTP server in front of the real one.  Request n is handled by ``script[n]``
    (then "forward"): "forward" proxies it; "forward_then_drop" proxies it and closes the
    connection without answering; "503"/"429"/"500" answer that status with an error body
    and ``Retry-After: <retry_after>`` (omitted when None)."""

    def __init__(self, upstream_url: str, script: list[str], retry_after: int | None = 1):
        self.upstream = upstream_url.removeprefix("http://")
        self.script, self.retry_after = list(script), retry_after
        self.seen: list[Seen] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer._handle(self)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handle(self, h):
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        self.seen.append(Seen(h.command, h.path, dict(h.headers), time.monotonic()))
        n = len(self.seen) - 1
        action = self.script[n] if n < len(self.script) else "forward"
        if action.isdigit():
            payload = json.dumps({"error": {"code": "test_refusal", "message": "try later"}})
            h.send_response(int(action))
            if self.retry_after is not None:
                h.send_header("Retry-After", str(self.retry_after))
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload.encode())
            return
        upstream = http.client.HTTPConnection(self.upstream, timeout=30)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "connection")}
        upstream.request(h.command, h.path, body=body, headers=headers)
        resp = upstream.getresponse()
        data = resp.read()
        upstream.close()
        if action == "forward_then_drop":
            h.close_connection = True  # the server acted; its answer is lost on the way
            return
        h.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length",
                                    "server", "date"):
                h.send_header(name, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class CuttableProxy:
    """A TCP proxy on loopback whose live connections a test can cut mid-stream."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.live: list[socket.socket] = []
        self.requests = bytearray()  # everything clients sent, for header checks
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self.lock:
                self.live += [down, up]
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while data := src.recv(65536):
                if record:
                    with self.lock:
                        self.requests += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        with self.lock:
            live, self.live = self.live, []
        for s in live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def event_requests(self) -> list[str]:
        """The Last-Event-ID of every event-stream request, in order."""
        text = self.requests.decode("latin-1")
        heads = [h for h in text.split("\r\n\r\n") if re.search(r"GET \S+/events", h)]
        return [re.search(r"(?im)^last-event-id: *(\S*)", h).group(1) for h in heads]

    def close(self):
        self.listener.close()
        self.cut()


@pytest.fixture
def interceptor(system):
    made = []

    def make(script, retry_after=1):
        made.append(Interceptor(system.url, script, retry_after))
        return made[-1]

    yield make
    for i in made:
        i.close()


# ------------------------------------------------------------------ submit and retries

def test_submit_sends_a_fresh_uuid4_key_and_the_same_explicit_key_replays_the_same_run(
        client, system, key):
    first = client.submit("echo", {"n": 1})
    assert first["status"] == "queued" and first["replayed"] is False
    stored = system.ledger.query("SELECT idempotency_key FROM idempotency_keys WHERE run_id = ?",
                                 (first["id"],))
    assert len(stored) == 1 and uuid.UUID(stored[0][0]).version == 4

    once = client.submit("echo", {"n": 2}, idempotency_key="order-42", metadata={"team": "a"})
    again = client.submit("echo", {"n": 2}, idempotency_key="order-42", metadata={"team": "a"})
    assert again["id"] == once["id"] and again["replayed"] is True
    assert [r["id"] for r in client.iter_runs(idempotency_key="order-42")] == [once["id"]]


def test_a_503_with_retry_after_is_retried_after_that_delay_with_the_same_key(
        system, key, interceptor):
    proxy = interceptor(["503"], retry_after=1)
    run = runstile.Client(proxy.url, key.secret).submit("echo", {"n": 3})
    assert [s.method for s in proxy.seen] == ["POST", "POST"]
    sent = [s.headers["Idempotency-Key"] for s in proxy.seen]
    assert sent[0] == sent[1] and uuid.UUID(sent[0]).version == 4
    assert proxy.seen[1].at - proxy.seen[0].at >= 1.0, "Retry-After: 1 was honoured"
    assert run["replayed"] is False and run["task"] == "echo"


def test_a_retry_after_a_dropped_answer_reuses_the_key_and_returns_the_run_already_admitted(
        system, key, interceptor):
    proxy = interceptor(["forward_then_drop"])
    client = runstile.Client(proxy.url, key.secret)
    run = client.submit("echo", {"n": 4})
    sent = [s.headers["Idempotency-Key"] for s in proxy.seen]
    assert len(sent) == 2 and sent[0] == sent[1]
    assert run["replayed"] is True, "the first attempt admitted the run; its 202 was lost"
    direct = runstile.Client(system.url, key.secret)
    assert [r["id"] for r in direct.iter_runs(idempotency_key=sent[0])] == [run["id"]]
    assert sum(r["id"] == run["id"] for r in direct.iter_runs()) == 1


@pytest.mark.parametrize("status", ["429", "500", "503"])
def test_429_and_5xx_are_retried_max_retries_times_then_raised(system, key, interceptor, status):
    proxy = interceptor([status] * 10, retry_after=None if status == "500" else 0)
    client = runstile.Client(proxy.url, key.secret, max_retries=2)
    with pytest.raises(ApiError) as caught:
        client.submit("echo", 1)
    assert caught.value.status == int(status) and caught.value.code == "test_refusal"
    assert len(proxy.seen) == 3
    assert len({s.headers["Idempotency-Key"] for s in proxy.seen}) == 1


def test_other_4xx_answers_are_never_retried(system, key, interceptor):
    proxy = interceptor([])
    with pytest.raises(ApiError) as caught:
        runstile.Client(proxy.url, key.secret).submit("no.such.task", 1)
    assert (caught.value.status, caught.value.code) == (400, "unknown_task")
    assert len(proxy.seen) == 1


def test_resume_is_not_retried_when_its_answer_is_lost(client, system, key, interceptor):
    done = client.wait(client.submit("echo", 5)["id"], timeout_s=30)
    proxy = interceptor(["forward_then_drop"])
    with pytest.raises(ApiError) as caught:
        runstile.Client(proxy.url, key.secret).resume(done["id"])
    assert caught.value.status is None and caught.value.code == "connection_failed"
    assert len(proxy.seen) == 1, "resume is not idempotent: a lost answer is not retried"


def test_a_server_that_cannot_be_reached_raises_connection_failed_after_the_retries():
    client = runstile.Client(f"http://127.0.0.1:{free_port()}", "rsk_x", max_retries=1)
    with pytest.raises(ApiError) as caught:
        client.get("run_" + "0" * 32)
    assert caught.value.status is None and caught.value.code == "connection_failed"
    assert isinstance(caught.value, RunstileError)


def test_a_failed_run_retried_gets_a_new_run_that_names_it_and_completes(client, tmp_path):
    """POST /v1/runs/{run_id}/retry with real workers (docs/api.md): the task runs again, in
    a new run with retry_of and attempt 1, and the original stays as it ended."""
    log, marker = tmp_path / "log", tmp_path / "marker"
    submitted = client.submit("t.fail_once", {"log": str(log), "marker": str(marker)},
                              session_key="retry-s", metadata={"team": "a"})
    failed = client.wait(submitted["id"], timeout_s=30)
    assert failed["status"] == "failed" and failed["error"]["code"] == "task_error"
    assert failed["retry_of"] is None and submitted["retry_of"] is None
    retry = client.retry(failed["id"], idempotency_key="retry-once")
    assert retry["id"] != failed["id"] and retry["retry_of"] == failed["id"]
    assert (retry["status"], retry["attempt"], retry["replayed"]) == ("queued", 1, False)
    assert {k: retry[k] for k in ("task", "input", "session_key", "metadata")} == {
        k: failed[k] for k in ("task", "input", "session_key", "metadata")}
    done = client.wait(retry["id"], timeout_s=30)
    assert (done["status"], done["result"], done["attempt"]) == ("completed", {"ran": "again"}, 1)
    assert done["retry_of"] == failed["id"]
    assert log.read_text().splitlines() == [f"start {failed['id']} 1", f"start {retry['id']} 1"]
    assert client.get(failed["id"])["status"] == "failed"
    again = client.retry(failed["id"], idempotency_key="retry-once")
    assert again["id"] == retry["id"] and again["replayed"] is True
    with pytest.raises(ApiError) as caught:
        client.retry(done["id"])
    assert (caught.value.status, caught.value.code) == (409, "run_not_retryable")
    assert caught.value.details == {"run_status": "completed"}


def test_retry_after_a_dropped_answer_reuses_its_uuid4_key_and_returns_the_run_it_made(
        client, system, key, interceptor):
    failed = client.wait(client.submit("fail", None)["id"], timeout_s=30)
    proxy = interceptor(["forward_then_drop"])
    retry = runstile.Client(proxy.url, key.secret).retry(failed["id"])
    sent = [s.headers["Idempotency-Key"] for s in proxy.seen]
    assert len(sent) == 2 and sent[0] == sent[1] and uuid.UUID(sent[0]).version == 4
    assert retry["replayed"] is True and retry["retry_of"] == failed["id"]
    assert [r["id"] for r in client.iter_runs() if r["retry_of"] == failed["id"]] == [
        retry["id"]], "the lost answer's retry made one run, not two"


# ------------------------------------------------------------------ errors

def test_api_errors_carry_status_code_message_and_details(client, system):
    with pytest.raises(ApiError) as caught:
        client.get("run_" + "0" * 32)
    assert (caught.value.status, caught.value.code) == (404, "run_not_found")
    assert str(caught.value).startswith("run_not_found: ")

    client.submit("echo", 1, idempotency_key="k-conflict")
    with pytest.raises(ApiError) as caught:
        client.submit("echo", 2, idempotency_key="k-conflict")
    assert (caught.value.status, caught.value.code) == (409, "idempotency_key_conflict")

    with pytest.raises(ApiError) as caught:
        client.list(limit=0)
    assert caught.value.code == "invalid_request" and caught.value.details == {"field": "limit"}

    with pytest.raises(ApiError) as caught:
        runstile.Client(system.url, "rsk_not_a_key").get("run_" + "0" * 32)
    assert (caught.value.status, caught.value.code) == (401, "unauthorized")


def test_resume_of_a_run_that_is_not_paused_is_a_409_naming_its_status(client):
    done = client.wait(client.submit("echo", 6)["id"], timeout_s=30)
    with pytest.raises(ApiError) as caught:
        client.resume(done["id"])
    assert (caught.value.status, caught.value.code) == (409, "run_not_paused")
    assert caught.value.details == {"run_status": "completed"}


def test_approve_raises_a_clear_error_when_the_server_has_no_approval_route(client):
    done = client.wait(client.submit("echo", 7)["id"], timeout_s=30)
    with pytest.raises(ApiError) as caught:
        client.approve(done["id"], "apr_1", "approve")
    if caught.value.code == "not_found":  # the route is planned (docs/api.md)
        assert caught.value.status == 404
        assert "/approval is not served by" in caught.value.message
        assert "no such route" in caught.value.message
    else:
        assert caught.value.code == "approval_not_pending"
    with pytest.raises(ValueError):
        client.approve(done["id"], "apr_1", "maybe")


def test_stop_cancels_a_running_run_and_is_harmless_to_repeat(client):
    run = client.submit("slow", {"seconds": 20})
    next(e for e in client.events(run["id"]) if e["type"] == "run.started")
    assert client.stop(run["id"])["status"] in ("stopping", "cancelled")
    assert client.stop(run["id"])["status"] in ("stopping", "cancelled")
    assert client.wait(run["id"], timeout_s=30)["status"] == "cancelled"


# ------------------------------------------------------------------ reading, waiting, events

@pytest.mark.parametrize("task,input_,result", [
    ("echo", {"text": "hi"}, {"echo": {"text": "hi"}}),
    ("chat", {"text": "hi"}, {"reply": "You said: hi"}),
])
def test_wait_returns_the_completed_run_of_a_demo_task(client, task, input_, result):
    run = client.submit(task, input_)
    done = client.wait(run["id"], timeout_s=30)
    assert done["status"] == "completed" and done["result"] == result
    assert client.get(run["id"]) == done


def test_wait_raises_timeout_error_when_the_run_outlives_the_timeout(client):
    run = client.submit("slow", {"seconds": 20})
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.wait(run["id"], timeout_s=0.5)
    assert time.monotonic() - started < 3
    client.stop(run["id"])


def test_events_yield_every_event_in_order_and_end_after_the_terminal_one(client):
    run = client.submit("chat", {"text": "one two"})
    events = list(client.events(run["id"]))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    types = [e["type"] for e in events]
    assert types[:2] == ["run.queued", "run.started"] and types[-1] == "run.completed"
    assert "".join(e["data"]["text"] for e in events if e["type"] == "message.delta") \
        == "You said: one two "
    # after= starts later; past the terminal event the generator ends at once.
    assert [e["seq"] for e in client.events(run["id"], after=2)] == list(range(3, len(events) + 1))
    assert list(client.events(run["id"], after=len(events))) == []


def test_events_resume_with_last_event_id_after_the_connection_is_cut_mid_stream(
        system, key):
    proxy = CuttableProxy(system.port)
    try:
        client = runstile.Client(proxy.url, key.secret)
        run = client.submit("progress", {"steps": 8, "delay_s": 0.15})
        seqs, cut_at = [], None
        for event in client.events(run["id"]):
            seqs.append(event["seq"])
            if event["type"] == "run.progress" and cut_at is None:
                cut_at = event["seq"]
                proxy.cut()
        assert cut_at is not None
        assert seqs == list(range(1, len(seqs) + 1)), "no event lost or repeated"
        assert client.get(run["id"])["status"] == "completed"
        resumed_from = proxy.event_requests()
        assert len(resumed_from) >= 2 and resumed_from[0] == "0"
        assert cut_at <= int(resumed_from[1]) < seqs[-1]
    finally:
        proxy.close()


def test_events_resume_across_the_servers_stream_lifetime_close(make_system, ledger):
    system = make_system(workers=1, RUNSTILE_STREAM_MAX_S="0.5")
    key = ledger.key("default")
    proxy = CuttableProxy(system.port)
    try:
        client = runstile.Client(proxy.url, key.secret)
        run = client.submit("progress", {"steps": 6, "delay_s": 0.3})
        events = list(client.events(run["id"]))
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert sum(e["type"] == "run.progress" for e in events) == 6
        assert events[-1]["type"] == "run.completed"
        assert len(proxy.event_requests()) >= 3, "the 0.5 s streams were resumed"
    finally:
        proxy.close()


def test_iter_runs_follows_next_cursor_through_every_page(client):
    ids = [client.submit("echo", i)["id"] for i in range(5)]
    page = client.list(limit=2)
    assert len(page["data"]) == 2 and page["has_more"] and page["next_cursor"]
    assert [r["id"] for r in client.iter_runs(limit=2)] == ids[::-1]
    assert [r["id"] for r in client.iter_runs(limit=2, task="echo", status=["queued", "running",
                                                                            "completed"])] \
        == ids[::-1]


def test_a_requests_session_can_carry_the_client(system, key):
    with requests.Session() as session:
        client = runstile.Client(system.url, key.secret, session=session)
        run = client.submit("chat", {"text": "via requests"})
        assert client.wait(run["id"], timeout_s=30)["result"] == {"reply": "You said: via requests"}
        assert [e["type"] for e in client.events(run["id"])][-1] == "run.completed"


# ------------------------------------------------------------------ the command line

def cli(argv, capsys, system, key):
    code = main(["runs", *argv, "--url", system.url, "--api-key", key.secret])
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_cli_submit_wait_json_prints_the_completed_run_on_the_last_line(system, key, capsys):
    code, out, _ = cli(["submit", "echo", "--input", '{"text": "cli"}', "--key", "cli-1",
                        "--wait", "--json"], capsys, system, key)
    assert code == 0
    run = last_json(out)
    assert run["status"] == "completed" and run["result"] == {"echo": {"text": "cli"}}

    code, out, _ = cli(["get", run["id"], "--json"], capsys, system, key)
    assert code == 0 and last_json(out)["id"] == run["id"]
    code, out, _ = cli(["get", run["id"]], capsys, system, key)
    assert code == 0 and run["id"] in out and "completed" in out and '"cli"' in out

    code, out, _ = cli(["list", "--status", "completed", "--task", "echo", "--limit", "5",
                        "--json"], capsys, system, key)
    assert code == 0 and [r["id"] for r in last_json(out)["data"]] == [run["id"]]
    code, out, _ = cli(["list"], capsys, system, key)
    assert code == 0 and run["id"] in out


def test_cli_reads_url_and_api_key_from_the_environment(system, key, capsys, monkeypatch):
    monkeypatch.setenv("RUNSTILE_URL", system.url)
    monkeypatch.setenv("RUNSTILE_API_KEY", key.secret)
    assert main(["runs", "submit", "echo", "--json"]) == 0
    run = last_json(capsys.readouterr().out)
    assert run["status"] == "queued" and run["replayed"] is False
    monkeypatch.delenv("RUNSTILE_API_KEY")
    assert main(["runs", "get", run["id"]]) == 2
    assert "RUNSTILE_API_KEY" in capsys.readouterr().err


def test_cli_watch_draws_progress_and_exits_0_when_the_run_completes(system, key, capsys):
    run = runstile.Client(system.url, key.secret).submit("progress", {"steps": 4, "delay_s": 0.05})
    code, out, _ = cli(["watch", run["id"]], capsys, system, key)
    assert code == 0
    assert "run.started" in out and "[##########..........] 50%" in out
    assert "[####################] 100%" in out and f"{run['id']}  completed" in out


def test_cli_watch_joins_message_deltas_into_one_line(system, key, capsys):
    run = runstile.Client(system.url, key.secret).submit("chat", {"text": "hello there"})
    code, out, _ = cli(["watch", run["id"], "--json"], capsys, system, key)
    assert code == 0
    assert "You said: hello there " in out.splitlines()
    assert last_json(out)["result"] == {"reply": "You said: hello there"}


def test_cli_watch_exits_1_when_the_run_fails(system, key, capsys):
    run = runstile.Client(system.url, key.secret).submit("fail", None)
    code, out, _ = cli(["watch", run["id"]], capsys, system, key)
    assert code == 1
    assert "run.failed" in out and "task_error" in out


def test_cli_submit_with_invalid_json_input_is_a_usage_error(system, key, capsys):
    code, _, err = cli(["submit", "echo", "--input", "{not json"], capsys, system, key)
    assert code == 2
    assert "--input" in err and "not valid JSON" in err
    code, _, err = cli(["submit", "echo", "--input", "NaN"], capsys, system, key)
    assert code == 2


def test_cli_api_errors_exit_1_with_code_and_message(system, key, capsys):
    code, _, err = cli(["get", "run_" + "0" * 32], capsys, system, key)
    assert code == 1 and err.strip() == "error: run_not_found: no such run"
    done = runstile.Client(system.url, key.secret).submit("echo", 1)
    code, _, err = cli(["approve", done["id"], "apr_1", "--decision", "deny"], capsys, system, key)
    assert code == 1 and re.match(r"error: (not_found|approval_not_pending): ", err)


def test_cli_stop_and_resume(system, key, capsys):
    run = runstile.Client(system.url, key.secret).submit("slow", {"seconds": 20})
    code, out, _ = cli(["stop", run["id"], "--json"], capsys, system, key)
    assert code == 0 and last_json(out)["status"] in ("stopping", "cancelled")
    assert runstile.Client(system.url, key.secret).wait(run["id"], 30)["status"] == "cancelled"
    code, _, err = cli(["resume", run["id"]], capsys, system, key)
    assert code == 1 and err.startswith("error: run_not_paused: ")


def test_cli_retry_makes_a_new_run_and_the_same_key_replays_it(system, key, capsys):
    failed = runstile.Client(system.url, key.secret).submit("fail", {"n": 1})
    runstile.Client(system.url, key.secret).wait(failed["id"], 30)
    code, out, _ = cli(["retry", failed["id"], "--key", "cli-retry", "--json"], capsys, system,
                       key)
    assert code == 0
    retry = last_json(out)
    assert retry["retry_of"] == failed["id"] and retry["replayed"] is False
    code, out, _ = cli(["retry", failed["id"], "--key", "cli-retry"], capsys, system, key)
    assert code == 0 and f"{retry['id']}  " in out and "(replayed)" in out
    assert f"retry_of:    {failed['id']}" in out
    code, _, err = cli(["retry", "run_" + "0" * 32], capsys, system, key)
    assert code == 1 and err.strip() == "error: run_not_found: no such run"
