"""GET /v1/runs, /v1/runs/<id> and the event log, with key isolation.

See docs/api.md, "`GET /v1/runs/{run_id}` — read one run", "`GET /v1/runs` — list runs"
and "`GET /v1/runs/{run_id}/events` — the event log"; docs/guarantees.md, "6. Isolation".
"""

from __future__ import annotations

import datetime as dt
import threading

import requests

from tests.conftest import Api


def admit(api: Api, n: int, **fields) -> list[str]:
    return [api.post_run({"task": "echo", "input": i, **fields}).json()["id"] for i in range(n)]


def test_get_returns_the_full_run_object(api):
    rid = api.post_run({"task": "echo", "input": {"q": 1}, "session_key": "s",
                        "trigger_id": "t-1", "metadata": {"team": "red"}}).json()["id"]
    run = api.get(f"/v1/runs/{rid}").json()
    assert set(run) == {"object", "id", "status", "task", "input", "session_key", "trigger_id",
                        "metadata", "callback_url", "created_at", "updated_at", "started_at",
                        "finished_at", "attempt", "retry_of", "not_before", "priority", "queue",
                        "result", "error", "approval", "recovery"}
    assert run["object"] == "run" and run["id"] == rid and run["status"] == "queued"
    assert run["queue"] == "default"
    assert run["retry_of"] is None and run["not_before"] is None
    assert run["metadata"] == {"team": "red"} and run["trigger_id"] == "t-1"
    assert run["created_at"].endswith("Z")
    dt.datetime.fromisoformat(run["created_at"].replace("Z", "+00:00"))


def test_an_unknown_or_malformed_run_id_is_run_not_found(api):
    for rid in ["run_" + "0" * 32, "nonsense", "run_" + "A" * 32]:
        response = api.get(f"/v1/runs/{rid}")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "run_not_found"


def test_the_list_is_newest_first_and_pages_with_a_cursor(api):
    ids = admit(api, 7)
    seen, cursor = [], None
    while True:
        params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = api.get("/v1/runs", params=params).json()
        assert page["object"] == "list"
        seen += [r["id"] for r in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert seen == list(reversed(ids))


def test_pages_never_repeat_or_skip_under_concurrent_inserts(api):
    before = admit(api, 30)
    stop = threading.Event()

    def insert_more():
        writer = Api(api.server, api.key, api.ledger)
        while not stop.is_set():
            writer.post_run({"task": "echo", "input": "concurrent"})

    threads = [threading.Thread(target=insert_more) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        first = api.get("/v1/runs", params={"limit": 5}).json()
        seen = [r["id"] for r in first["data"]]
        cursor = first["next_cursor"]
        while cursor:
            page = api.get("/v1/runs", params={"limit": 5, "cursor": cursor}).json()
            seen += [r["id"] for r in page["data"]]
            cursor = page["next_cursor"]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(seen) == len(set(seen)), "a run appeared on two pages"
    assert set(before) <= set(seen), "a run that existed before paging began was skipped"
    tail = [rid for rid in seen if rid in set(before)]
    assert tail == list(reversed(before))


def test_filters_by_status_task_session_and_metadata(api):
    a = api.post_run({"task": "echo", "session_key": "sess-a", "metadata": {"env": "prod"}})
    b = api.post_run({"task": "progress", "session_key": "sess-b", "metadata": {"env": "dev"}})
    def ids(params):
        return [r["id"] for r in api.get("/v1/runs", params=params).json()["data"]]
    assert ids({"task": "progress"}) == [b.json()["id"]]
    assert ids({"session_key": "sess-a"}) == [a.json()["id"]]
    assert ids({"metadata.env": "prod"}) == [a.json()["id"]]
    assert ids({"metadata.env": "nope"}) == []
    assert set(ids({"status": ["queued", "running"]})) == {a.json()["id"], b.json()["id"]}
    assert ids({"status": "completed"}) == []


def test_the_idempotency_key_filter_is_an_exact_lookup(api):
    rid = api.post_run({"task": "echo"}, idempotency_key="look-me-up").json()["id"]
    api.post_run({"task": "echo"}, idempotency_key="look-me-up-2")
    found = api.get("/v1/runs", params={"idempotency_key": "look-me-up"}).json()["data"]
    assert [r["id"] for r in found] == [rid]
    assert api.get("/v1/runs", params={"idempotency_key": "look-me"}).json()["data"] == []


def test_created_after_and_before_filter_by_time(api):
    rid = api.post_run({"task": "echo"}).json()["id"]
    created = api.get(f"/v1/runs/{rid}").json()["created_at"]
    moment = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    earlier = (moment - dt.timedelta(seconds=1)).isoformat()
    later = (moment + dt.timedelta(seconds=1)).isoformat()
    def got(params):
        return [r["id"] for r in api.get("/v1/runs", params=params).json()["data"]]
    assert rid in got({"created_after": earlier, "created_before": later})
    assert rid not in got({"created_after": later})
    assert rid not in got({"created_before": earlier})


def test_bad_list_parameters_are_invalid_request(api):
    for params in [{"limit": 0}, {"limit": 201}, {"limit": "x"}, {"status": "bogus"},
                   {"cursor": "garbage!"}, {"created_after": "yesterday"},
                   {"created_after": "2026-01-01T00:00:00"}, {"colour": "red"}]:
        response = api.get("/v1/runs", params=params)
        assert response.status_code == 400, params
        assert response.json()["error"]["code"] == "invalid_request"


def test_a_client_key_lists_only_its_own_runs_and_an_admin_key_its_profile(shared_server,
                                                                          shared_ledger):
    mine = Api(shared_server, shared_ledger.key("iso"), shared_ledger)
    theirs = Api(shared_server, shared_ledger.key("iso"), shared_ledger)
    admin = Api(shared_server, shared_ledger.key("iso", admin=True), shared_ledger)
    outsider = Api(shared_server, shared_ledger.key("iso-other", admin=True), shared_ledger)
    my_id = mine.post_run({"task": "echo"}).json()["id"]
    their_id = theirs.post_run({"task": "echo"}).json()["id"]
    def listed(a):
        return {r["id"] for r in a.get("/v1/runs", params={"limit": 200}).json()["data"]}
    assert listed(mine) == {my_id}
    assert listed(theirs) == {their_id}
    assert {my_id, their_id} <= listed(admin)
    assert listed(outsider) & {my_id, their_id} == set()
    assert mine.get(f"/v1/runs/{their_id}").status_code == 404
    assert admin.get(f"/v1/runs/{their_id}").status_code == 200
    assert outsider.get(f"/v1/runs/{my_id}").status_code == 404


def test_events_poll_as_json_from_after(api):
    rid = api.post_run({"task": "echo"}).json()["id"]
    page = api.get(f"/v1/runs/{rid}/events", headers={"Accept": "application/json"}).json()
    assert [(e["seq"], e["type"]) for e in page["data"]] == [(1, "run.queued")]
    assert page["next_after"] == 1
    later = api.get(f"/v1/runs/{rid}/events", params={"after": 1},
                    headers={"Accept": "application/json"}).json()
    assert later == {"data": [], "next_after": 1}


def test_events_default_to_an_event_stream_with_ids(api, shared_ledger):
    rid = api.post_run({"task": "echo"}).json()["id"]
    # Finish the run through the ledger so the stream closes after its terminal event.
    conn = shared_ledger.connect()
    from runstile.ledger import db, events
    with db.transaction(conn):
        conn.execute("UPDATE runs SET status = 'cancelled', finished_at = 1 WHERE id = ?", (rid,))
        events.append(conn, rid, "run.cancelled", {})
    conn.close()
    response = requests.get(api.server.url + f"/v1/runs/{rid}/events",
                            headers={**api.key.headers, "Accept": "*/*"}, stream=True, timeout=10)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.headers["X-Accel-Buffering"] == "no"
    text = response.content.decode()
    assert "id: 1\nevent: run.queued\n" in text
    assert "id: 2\nevent: run.cancelled\n" in text
    resumed = requests.get(api.server.url + f"/v1/runs/{rid}/events",
                           headers={**api.key.headers, "Last-Event-ID": "1"}, timeout=10).text
    assert "id: 1\n" not in resumed and "id: 2\nevent: run.cancelled" in resumed


def test_a_bad_after_is_invalid_request(api):
    rid = api.post_run({"task": "echo"}).json()["id"]
    response = api.get(f"/v1/runs/{rid}/events", params={"after": "-1"},
                       headers={"Accept": "application/json"})
    assert response.status_code == 400


def test_a_stored_value_nested_too_deep_reads_as_a_placeholder_not_a_500(api):
    """A row written before admission checked depth (simulated by writing the column
    directly) must not break reading it, nor every list page that holds it."""
    others = admit(api, 2)
    rid = admit(api, 1)[0]
    too_deep = "[" * 980 + "]" * 980
    api.ledger.query("UPDATE runs SET input = ?, result = ? WHERE id = ?",
                     (too_deep, '{"ok":' + too_deep + "}", rid))
    api.ledger.query("UPDATE events SET data = ? WHERE run_id = ?", (too_deep, rid))
    run = api.get(f"/v1/runs/{rid}")
    assert run.status_code == 200, run.text
    placeholder = "(not shown: nested deeper than 128 levels)"
    assert run.json()["input"] == run.json()["result"] == placeholder
    page = api.get("/v1/runs")
    assert page.status_code == 200, page.text
    assert [r["id"] for r in page.json()["data"]] == [rid, *reversed(others)]
    events = api.get(f"/v1/runs/{rid}/events", headers={"Accept": "application/json"})
    assert events.status_code == 200, events.text
    assert [e["data"] for e in events.json()["data"]] == [placeholder]
