"""What a hostile client cannot do to event streams and list queries (docs/guarantees.md,
"What a hostile client cannot do"): against a real ``runstile serve`` on loopback."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import requests

from runstile.ledger import db, events
from tests.conftest import Api, wait_until


def _queued_run(api: Api) -> str:
    """A run that stays queued (no workers run here), so its stream never ends by itself."""
    response = api.post_run({"task": "echo"})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _open_stream(server, key, run_id: str) -> requests.Response:
    """GET the run's event stream; the answer's headers are in, its body is left unread."""
    return requests.get(f"{server.url}/v1/runs/{run_id}/events", headers=key.headers,
                        stream=True, timeout=10)


@contextlib.contextmanager
def _streams():
    held: list[requests.Response] = []
    try:
        yield held
    finally:
        for response in held:
            response.close()


def test_head_requests_give_their_stream_slot_back(make_server, ledger):
    server = make_server(web_workers=1)
    api = Api(server, ledger.key())
    run_id = _queued_run(api)
    # More HEAD requests than the process has stream slots (8): each one used to keep its
    # slot for ever, since a HEAD body is never iterated and only the body gave it back.
    for _ in range(20):
        head = requests.head(f"{server.url}/v1/runs/{run_id}/events", headers=api.key.headers,
                             timeout=10)
        assert head.status_code == 200, head.headers
    other = Api(server, ledger.key("other"))
    with _streams() as held:
        held.append(_open_stream(server, other.key, _queued_run(other)))
        assert held[-1].status_code == 200, held[-1].text
        assert held[-1].headers["Content-Type"].startswith("text/event-stream")


def test_a_fifth_stream_of_one_key_is_429_while_other_keys_still_get_theirs(make_server,
                                                                             ledger):
    server = make_server(web_workers=1)
    greedy, modest = Api(server, ledger.key()), Api(server, ledger.key())
    run_id = _queued_run(greedy)
    with _streams() as held:
        for _ in range(4):
            held.append(_open_stream(server, greedy.key, run_id))
            assert held[-1].status_code == 200, held[-1].text
        fifth = _open_stream(server, greedy.key, run_id)
        held.append(fifth)
        assert fifth.status_code == 429
        assert fifth.json()["error"]["code"] == "too_many_streams_for_key"
        assert fifth.headers["Retry-After"] == "1"
        # Another key of the same profile still gets its streams...
        modest_run = _queued_run(modest)
        held.append(_open_stream(server, modest.key, modest_run))
        assert held[-1].status_code == 200, held[-1].text
        # ...and the process-wide cap (8 here: half of 16 threads) is still a 503.
        for _ in range(3):
            held.append(_open_stream(server, modest.key, modest_run))
            assert held[-1].status_code == 200, held[-1].text
        third = Api(server, ledger.key())
        ninth = _open_stream(server, third.key, _queued_run(third))
        held.append(ninth)
        assert ninth.status_code == 503
        assert ninth.json()["error"]["code"] == "too_many_streams"
        assert ninth.headers["Retry-After"] == "1"


def test_a_client_that_disconnects_mid_stream_gives_its_slot_back(make_server, ledger):
    # One stream per key, and a keepalive every 0.1 s: the server finds the client gone
    # at its next write.
    server = make_server(web_workers=1, RUNSTILE_MAX_STREAMS_PER_KEY="1",
                         RUNSTILE_STREAM_KEEPALIVE_S="0.1")
    api = Api(server, ledger.key())
    run_id = _queued_run(api)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Bearer {api.key.secret}\r\n\r\n".encode())
    received = b""
    while b"retry: 1000" not in received:
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    refused = _open_stream(server, api.key, run_id)
    refused.close()  # never read a stream's body here: it would wait for its end
    assert refused.status_code == 429, refused.headers
    sock.close()

    def stream_accepted():
        response = _open_stream(server, api.key, run_id)
        response.close()
        return response.status_code == 200
    wait_until(stream_accepted, 15, 0.05, "the disconnected stream's slot to be given back")


def test_a_stream_that_ends_gives_its_slot_back_once(make_server, ledger):
    # A finished stream is closed by both of its ends (the body's own end and the
    # server's close of the response): a slot given back twice would let this key
    # hold two streams.
    server = make_server(web_workers=1, RUNSTILE_MAX_STREAMS_PER_KEY="1")
    api = Api(server, ledger.key())
    finished = _queued_run(api)
    conn = ledger.connect()
    with db.transaction(conn):
        conn.execute("UPDATE runs SET status = 'cancelled', finished_at = 1 WHERE id = ?",
                     (finished,))
        events.append(conn, finished, "run.cancelled", {})
    conn.close()
    for _ in range(3):
        ended = _open_stream(server, api.key, finished)
        assert ended.status_code == 200 and "event: run.cancelled" in ended.text
    with _streams() as held:
        held.append(_open_stream(server, api.key, _queued_run(api)))
        assert held[-1].status_code == 200, held[-1].headers
        held.append(_open_stream(server, api.key, _queued_run(api)))
        assert held[-1].status_code == 429, held[-1].headers


def _seed_runs(ledger, key, count: int) -> None:
    """``count`` completed runs in ``key``'s scope, each with metadata {"env": "prod"},
    written in one batch (admitting them one by one would take minutes)."""
    conn = ledger.connect()
    now = time.time()
    rows = [(f"run_{i:032x}", key.profile, key.key_id, json.dumps({"env": "prod", "n": i}),
             now, now, now) for i in range(1, count + 1)]
    with db.transaction(conn):
        conn.executemany(
            "INSERT INTO runs (id, profile_id, key_id, task, input, metadata, fingerprint, "
            "fingerprint_version, status, created_at, updated_at, finished_at) "
            "VALUES (?, ?, ?, 'echo', 'null', ?, 'f', 1, 'completed', ?, ?, ?)", rows)
    conn.close()


def test_nine_metadata_filters_are_refused_and_eight_are_answered(api):
    run_id = api.post_run({"task": "echo", "metadata": {"env": "prod"}}).json()["id"]
    eight = [("metadata.env", "prod")] * 8
    answered = api.get("/v1/runs", params=eight)
    assert answered.status_code == 200, answered.text
    assert [r["id"] for r in answered.json()["data"]] == [run_id]
    # Repeating one key counts each value: every one is a scan of the run's metadata.
    refused = api.get("/v1/runs", params=[*eight, ("metadata.env", "prod")])
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "invalid_request" and error["field"] == "metadata"
    assert "at most 8" in error["message"]


def test_a_list_query_past_its_time_limit_is_cut_off_and_the_server_keeps_answering(
        make_server, ledger):
    key = ledger.key()
    _seed_runs(ledger, key, 20_000)
    # One thread: every request below runs on the one pooled connection of the query
    # that was cut off.
    server = make_server(web_workers=1, RUNSTILE_LIST_QUERY_TIMEOUT_MS="1",
                         RUNSTILE_WEB_THREADS="1")
    api = Api(server, key, ledger)
    newest_id = f"run_{20_000:032x}"
    # A PostgreSQL session's first statement on runs loads the table's catalog entries
    # (a few ms, which statement_timeout counts): read one run without a limit first, so
    # that what the 1 ms limit cuts off below is the scan, on either engine.
    assert api.get(f"/v1/runs/{newest_id}").json()["status"] == "completed"
    # No run matches, so the ledger reads every row's metadata (SQLite ~40 ms, PostgreSQL
    # ~120 ms for 20,000 runs here).
    slow = api.get("/v1/runs", params=[("metadata.env", "nowhere")] * 8)
    assert slow.status_code == 503, slow.text
    assert slow.json()["error"]["code"] == "list_query_timeout"
    assert slow.headers["Retry-After"] == "1"
    assert requests.get(server.url + "/healthz", timeout=10).status_code == 200
    # A narrow query finishes well inside any limit: seq order on the scope's index.
    newest = api.get("/v1/runs", params={"limit": 1})
    assert newest.status_code == 200, newest.text
    run_id = newest.json()["data"][0]["id"]
    assert run_id == newest_id
    assert api.get(f"/v1/runs/{run_id}").json()["status"] == "completed"
    assert _queued_run(api).startswith("run_")
