"""POST /v1/runs against a real server on loopback and a real ledger
(docs/api.md, "`POST /v1/runs` — admit a run")."""

from __future__ import annotations

import json
import re
import secrets
import socket

import pytest

from tests.conftest import Api


def run_id() -> str:
    return "run_" + secrets.token_hex(16)


def dispatch_count(ledger, rid: str) -> int:
    return ledger.query("SELECT COUNT(*) FROM dispatches WHERE run_id = ?", (rid,))[0][0]


def run_count(api) -> int:
    return api.runs_in_scope()


def error_code(response) -> str:
    return response.json()["error"]["code"]


# ---------------------------------------------------------------- the reservation table

def test_a_request_without_key_or_run_id_creates_a_fresh_run_each_time(api):
    first = api.post_run({"task": "echo", "input": 1})
    second = api.post_run({"task": "echo", "input": 1})
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] != second.json()["id"]
    assert re.fullmatch(r"run_[0-9a-f]{32}", first.json()["id"])
    assert api.keys_in_scope() == 0


def test_a_new_key_creates_a_queued_run_with_record_dispatch_and_event(api):
    response = api.post_run({"task": "echo", "input": {"a": 1}}, idempotency_key="k-1")
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["attempt"] == 1 and body["replayed"] is False
    assert response.headers["Location"] == f"/v1/runs/{body['id']}"
    assert "Idempotency-Replayed" not in response.headers
    assert body["input"] == {"a": 1} and body["task"] == "echo"
    assert api.ledger.query("SELECT run_id FROM idempotency_keys WHERE idempotency_key = 'k-1'") == [
        (body["id"],)]
    assert dispatch_count(api.ledger, body["id"]) == 1
    assert api.ledger.query("SELECT seq, type FROM events WHERE run_id = ?", (body["id"],)) == [
        (1, "run.queued")]


def test_an_identical_retry_replays_the_current_run_without_a_second_dispatch(api):
    first = api.post_run({"task": "echo", "input": [1, 2]}, idempotency_key="k-2")
    again = api.post_run({"task": "echo", "input": [1, 2]}, idempotency_key="k-2")
    assert again.status_code == 202
    assert again.headers["Idempotency-Replayed"] == "true"
    assert again.json()["replayed"] is True
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Location"] == f"/v1/runs/{first.json()['id']}"
    assert dispatch_count(api.ledger, first.json()["id"]) == 1
    assert run_count(api) == 1


def test_a_retry_with_reordered_keys_and_whitespace_has_the_same_fingerprint(api):
    first = api.post_run(idempotency_key="k-3", data='{"task":"echo","input":{"b":2,"a":1.0}}',
                         headers={"Content-Type": "application/json"})
    again = api.post_run(idempotency_key="k-3",
                         data='{ "input" : { "a" : 1, "b" : 2 } , "task" : "echo" }',
                         headers={"Content-Type": "application/json"})
    assert again.status_code == 202 and again.json()["replayed"] is True
    assert again.json()["id"] == first.json()["id"]


def test_absent_optional_fields_equal_explicit_nulls(api):
    first = api.post_run({"task": "echo"}, idempotency_key="k-null")
    again = api.post_run({"task": "echo", "input": None, "session_key": None},
                         idempotency_key="k-null")
    assert again.json()["replayed"] is True and again.json()["id"] == first.json()["id"]


def test_the_same_key_with_a_different_request_is_a_409_that_creates_nothing(api):
    api.post_run({"task": "echo", "input": 1}, idempotency_key="k-4")
    clash = api.post_run({"task": "echo", "input": 2}, idempotency_key="k-4")
    assert clash.status_code == 409
    assert error_code(clash) == "idempotency_key_conflict"
    assert run_count(api) == 1


def test_a_replay_answers_even_after_the_task_is_no_longer_known(api):
    # The run was admitted under a task name the server does not register today; the
    # ledger is edited into that state (the task "went away") and a retry still replays.
    first = api.post_run({"task": "echo", "input": 5}, idempotency_key="k-gone")
    conn = api.ledger.connect()
    conn.execute("UPDATE runs SET task = 'vanished' WHERE id = ?", (first.json()["id"],))
    conn.close()
    again = api.post_run({"task": "echo", "input": 5}, idempotency_key="k-gone")
    assert again.status_code == 202 and again.json()["replayed"] is True
    assert api.post_run({"task": "vanished"}).json()["error"]["code"] == "unknown_task"


# ---------------------------------------------------------------- client run ids (legacy keys)

def test_a_client_run_id_is_preserved(api):
    rid = run_id()
    response = api.post_run({"task": "echo", "run_id": rid})
    assert response.status_code == 202 and response.json()["id"] == rid


def test_a_run_id_retry_without_header_replays_without_a_second_dispatch(api):
    rid = run_id()
    first = api.post_run({"task": "echo", "run_id": rid, "input": "x"})
    again = api.post_run({"task": "echo", "run_id": rid, "input": "x"})
    assert first.json()["replayed"] is False
    assert again.status_code == 202 and again.json()["replayed"] is True
    assert again.headers["Idempotency-Replayed"] == "true"
    assert dispatch_count(api.ledger, rid) == 1
    assert api.ledger.query("SELECT idempotency_key, derived FROM idempotency_keys WHERE run_id = ?",
                        (rid,)) == [(f"legacy-run:{rid}", 1)]


def test_the_header_selects_the_key_and_the_body_the_run_id(api):
    rid = run_id()
    response = api.post_run({"task": "echo", "run_id": rid}, idempotency_key="hdr-1")
    assert response.json()["id"] == rid
    assert api.ledger.query("SELECT idempotency_key FROM idempotency_keys WHERE run_id = ?",
                        (rid,)) == [("hdr-1",)]


def test_a_retry_that_drops_the_header_with_the_same_body_replays(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid}, idempotency_key="hdr-2")
    again = api.post_run({"task": "echo", "run_id": rid})
    assert again.status_code == 202 and again.json()["replayed"] is True
    assert again.json()["id"] == rid
    assert dispatch_count(api.ledger, rid) == 1


def test_a_new_header_key_is_bound_to_a_replayed_run_id(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid})
    again = api.post_run({"task": "echo", "run_id": rid}, idempotency_key="late-key")
    assert again.json()["replayed"] is True
    later = api.post_run({"task": "echo", "run_id": rid}, idempotency_key="late-key")
    assert later.json()["replayed"] is True and later.json()["id"] == rid
    assert sorted(api.ledger.query("SELECT idempotency_key FROM idempotency_keys WHERE run_id = ?",
                               (rid,))) == [("late-key",), (f"legacy-run:{rid}",)]
    lookup = api.get("/v1/runs", params={"idempotency_key": "late-key"}).json()["data"]
    assert [r["id"] for r in lookup] == [rid]


def test_a_run_id_with_a_mismatched_body_is_a_run_id_conflict(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid, "input": 1})
    clash = api.post_run({"task": "echo", "run_id": rid, "input": 2})
    assert clash.status_code == 409 and error_code(clash) == "run_id_conflict"
    assert rid not in clash.text
    assert run_count(api) == 1


def test_a_run_id_with_a_different_session_key_is_a_run_id_conflict(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid, "session_key": "s1"})
    clash = api.post_run({"task": "echo", "run_id": rid, "session_key": "s2"})
    assert clash.status_code == 409 and error_code(clash) == "run_id_conflict"


def test_a_run_id_with_a_new_header_and_a_different_body_is_a_run_id_conflict(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid, "input": 1})
    clash = api.post_run({"task": "echo", "run_id": rid, "input": 2}, idempotency_key="fresh")
    assert clash.status_code == 409 and error_code(clash) == "run_id_conflict"


def test_a_run_id_owned_by_another_key_is_a_409_and_stays_invisible(shared_server, shared_ledger):
    server, ledger = shared_server, shared_ledger
    owner = Api(server, ledger.key("default"))
    other = Api(server, ledger.key("default"))
    rid = run_id()
    owner.post_run({"task": "echo", "run_id": rid})
    clash = other.post_run({"task": "echo", "run_id": rid})
    assert clash.status_code == 409 and error_code(clash) == "run_id_conflict"
    assert rid not in clash.text
    _assert_invisible(other, rid)


def test_a_run_id_owned_by_another_profile_is_a_409_and_stays_invisible(shared_server, shared_ledger):
    server, ledger = shared_server, shared_ledger
    owner = Api(server, ledger.key("alpha"))
    stranger = Api(server, ledger.key("beta", admin=True))
    rid = run_id()
    owner.post_run({"task": "echo", "run_id": rid})
    clash = stranger.post_run({"task": "echo", "run_id": rid})
    assert clash.status_code == 409 and error_code(clash) == "run_id_conflict"
    _assert_invisible(stranger, rid)


def _assert_invisible(api: Api, rid: str) -> None:
    assert api.get(f"/v1/runs/{rid}").status_code == 404
    assert error_code(api.get(f"/v1/runs/{rid}")) == "run_not_found"
    events = api.get(f"/v1/runs/{rid}/events", headers={"Accept": "application/json"})
    assert events.status_code == 404 and error_code(events) == "run_not_found"
    assert rid not in api.get("/v1/runs", params={"limit": 200}).text
    # stop (docs/api.md, "`POST /v1/runs/{run_id}/stop` — stop a run") must not reveal the
    # run either.
    assert api.post(f"/v1/runs/{rid}/stop").status_code == 404


def test_the_ledger_stays_usable_after_a_conflict(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid, "input": 1})
    assert api.post_run({"task": "echo", "run_id": rid, "input": 2}).status_code == 409
    nxt = api.post_run({"task": "echo", "input": 3}, idempotency_key="after-conflict")
    assert nxt.status_code == 202 and nxt.json()["replayed"] is False
    assert api.get(f"/v1/runs/{nxt.json()['id']}").status_code == 200
    assert api.get(f"/v1/runs/{rid}").json()["input"] == 1


@pytest.mark.parametrize("bad", [
    "run_" + "A" * 32,                               # uppercase hex
    "run_0123abcd-0123-abcd-0123-0123456789ab",      # hyphenated UUID
    "run_" + "a" * 31, "run_" + "a" * 33,            # wrong length
    "run_" + "a" * 32 + "\n",                        # trailing newline
    "0123456789abcdef0123456789abcdef",              # no prefix
])
def test_a_malformed_run_id_is_a_400_showing_the_shape_and_allocates_nothing(api, bad):
    response = api.post_run({"task": "echo", "run_id": bad})
    assert response.status_code == 400
    assert error_code(response) == "invalid_run_id"
    assert "run_<32 lowercase hex>" in response.json()["error"]["message"]
    assert run_count(api) == 0
    assert api.keys_in_scope() == 0


def test_a_derived_key_conflict_says_run_id_conflict(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid, "input": 1})
    clash = api.post_run({"task": "echo", "run_id": rid, "input": 9})
    assert error_code(clash) == "run_id_conflict"


# ---------------------------------------------------------------- tombstones
# docs/api.md, "Reservation" (the 410 rows), and docs/operations.md, "Retention".

def _purge(ledger, rid: str) -> None:
    """Edit the ledger into "this run ended long ago", then run one retention batch."""
    from runstile.ledger import retention
    conn = ledger.connect()
    conn.execute("UPDATE runs SET status = 'completed', finished_at = 0 WHERE id = ?", (rid,))
    report = retention.purge(conn, run_retention_s=60, key_tombstone_s=3600)
    conn.close()
    assert report.runs == 1


def test_a_key_remembered_only_as_a_tombstone_answers_410(api):
    first = api.post_run({"task": "echo"}, idempotency_key="old-key")
    _purge(api.ledger, first.json()["id"])
    retry = api.post_run({"task": "echo"}, idempotency_key="old-key")
    assert retry.status_code == 410 and error_code(retry) == "idempotency_key_expired"
    assert run_count(api) == 0
    assert api.get(f"/v1/runs/{first.json()['id']}").status_code == 404


def test_a_run_id_remembered_only_as_a_tombstone_answers_410(api):
    rid = run_id()
    api.post_run({"task": "echo", "run_id": rid})
    _purge(api.ledger, rid)
    assert error_code(api.post_run({"task": "echo", "run_id": rid})) == "idempotency_key_expired"
    fresh_header = api.post_run({"task": "echo", "run_id": rid}, idempotency_key="brand-new")
    assert fresh_header.status_code == 410
    assert run_count(api) == 0


def test_expired_tombstones_are_purged_and_the_key_is_free_again(api):
    from runstile.ledger import retention
    first = api.post_run({"task": "echo"}, idempotency_key="short-tomb")
    conn = api.ledger.connect()
    conn.execute("UPDATE runs SET status = 'failed', finished_at = 0 WHERE id = ?",
                 (first.json()["id"],))
    retention.purge(conn, run_retention_s=0, key_tombstone_s=0)
    report = retention.purge(conn, run_retention_s=0, key_tombstone_s=0)
    conn.close()
    assert report.runs == 0
    assert api.ledger.query("SELECT COUNT(*) FROM key_tombstones WHERE key_id = ?",
                            (api.key.key_id,))[0][0] == 0
    assert api.post_run({"task": "echo"}, idempotency_key="short-tomb").status_code == 202


def test_retention_never_purges_a_non_terminal_run(api):
    from runstile.ledger import retention
    rid = api.post_run({"task": "echo"}).json()["id"]
    conn = api.ledger.connect()
    conn.execute("UPDATE runs SET finished_at = 0 WHERE id = ?", (rid,))
    assert retention.purge(conn, run_retention_s=0, key_tombstone_s=0).runs == 0
    conn.close()
    assert api.get(f"/v1/runs/{rid}").status_code == 200


# ---------------------------------------------------------------- checks in order

def test_auth_is_checked_before_anything_else(shared_server):
    server = shared_server
    import requests
    response = requests.post(server.url + "/v1/runs", data="not json",
                             headers={"Content-Type": "text/plain"})
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_a_body_over_the_limit_is_413_even_when_chunked(make_server, ledger):
    server = make_server(RUNSTILE_MAX_BODY_BYTES="1000")
    api = Api(server, ledger.key())
    big = json.dumps({"task": "echo", "input": "x" * 2000})
    assert error_code(api.post_run(data=big, headers={"Content-Type": "application/json"})) \
        == "payload_too_large"
    chunked = api.post_run(data=iter([big[:500].encode(), big[500:].encode()]),
                           headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and error_code(chunked) == "payload_too_large"
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 0
    small = api.post_run(data=iter([b'{"task":', b'"echo"}']),
                         headers={"Content-Type": "application/json"})
    assert small.status_code == 202


def test_size_is_checked_before_content_type(make_server, ledger):
    server = make_server(RUNSTILE_MAX_BODY_BYTES="100")
    api = Api(server, ledger.key())
    response = api.post_run(data="y" * 500, headers={"Content-Type": "text/plain"})
    assert response.status_code == 413


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_a_body_that_is_not_declared_json_is_415(api, content_type):
    response = api.post_run(data='{"task":"echo"}', headers={"Content-Type": content_type})
    assert response.status_code == 415 and error_code(response) == "unsupported_media_type"


def test_a_missing_content_type_is_415(api):
    import requests
    response = requests.post(api.server.url + "/v1/runs", data=b'{"task":"echo"}',
                             headers={**api.key.headers, "Content-Type": ""})
    assert response.status_code == 415


@pytest.mark.parametrize("raw", ['{"task":', "[1,2", '{"task":"echo","input":NaN}',
                                 '{"task":"echo","input":Infinity}',
                                 '{"task":"echo","task":"echo"}', "\xff\xfe"])
def test_malformed_json_is_invalid_json(api, raw):
    response = api.post_run(data=raw.encode("latin-1"),
                            headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and error_code(response) == "invalid_json"


def test_json_is_checked_before_the_key_syntax(api):
    response = api.post_run(data="{", headers={"Content-Type": "application/json",
                                                "Idempotency-Key": "has space"})
    assert error_code(response) == "invalid_json"


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "tab\there", "legacy-run:abc",
                                 "caf\u00e9"])
def test_an_invalid_idempotency_key_is_refused(api, key):
    response = api.post_run(data=b'{"task":"echo"}',
                            headers={"Content-Type": "application/json",
                                     "Idempotency-Key": key.encode("utf-8")})
    assert response.status_code == 400 and error_code(response) == "invalid_idempotency_key"
    assert run_count(api) == 0


def test_the_longest_and_widest_valid_keys_are_accepted(api):
    for key in ["x" * 255, "".join(chr(c) for c in range(33, 127))]:
        assert api.post_run({"task": "echo"}, idempotency_key=key).status_code == 202


def test_the_key_syntax_is_checked_before_the_schema(api):
    response = api.post_run({"bogus": 1}, idempotency_key="")
    assert error_code(response) == "invalid_idempotency_key"


@pytest.mark.parametrize("body,field", [
    ({"task": "echo", "surprise": 1}, "surprise"),
    ({"input": 1}, "task"),
    ({"task": 7}, "task"),
    ({"task": ""}, "task"),
    ({"task": "echo", "session_key": ""}, "session_key"),
    ({"task": "echo", "session_key": "x" * 257}, "session_key"),
    ({"task": "echo", "session_key": "a\nb"}, "session_key"),
    ({"task": "echo", "trigger_id": 5}, "trigger_id"),
    ({"task": "echo", "metadata": []}, "metadata"),
    ({"task": "echo", "metadata": {f"k{i}": "v" for i in range(33)}}, "metadata"),
    ({"task": "echo", "metadata": {"k": 1}}, "metadata.k"),
    ({"task": "echo", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"task": "echo", "callback_url": 3}, "callback_url"),
    ({"task": "echo", "run_id": 12}, "run_id"),
    ({"task": "echo", "input": 2 ** 60}, "input"),
])
def test_a_schema_violation_names_the_field(api, body, field):
    response = api.post_run(body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "invalid_request"
    assert response.json()["error"]["field"] == field
    assert field.split(".")[0] in response.json()["error"]["message"]
    assert run_count(api) == 0


@pytest.mark.parametrize("body,field", [
    ({"task": "echo\ud800"}, "task"),
    ({"task": "echo", "session_key": "s\udfff"}, "session_key"),
    ({"task": "echo", "trigger_id": "\ud800t"}, "trigger_id"),
    ({"task": "echo", "metadata": {"k": "v\ud800"}}, "metadata.k"),
    ({"task": "echo", "metadata": {"k\ud800": "v"}}, "metadata"),
    ({"task": "echo", "callback_url": "https://hooks.example/\ud800"}, "callback_url"),
    ({"task": "echo", "input": {"text": "\ud800"}}, "input"),
])
def test_a_lone_surrogate_is_refused_naming_the_field_it_is_in(api, body, field):
    # json.dumps writes the lone surrogate as the escape "\ud800": valid JSON, not Unicode.
    response = api.post_run(body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "invalid_request"
    assert response.json()["error"]["field"] == field
    assert run_count(api) == 0


def nested(depth: int) -> str:
    """JSON arrays nested ``depth`` deep around a 1."""
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("field,value", [("input", nested(65)), ("input", nested(980)),
                                         ("metadata", '{"k":' + nested(64) + "}"),
                                         ("trigger_id", nested(65))])
def test_a_field_nested_deeper_than_64_levels_is_invalid_json(api, field, value):
    response = api.post_run(data=f'{{"task":"echo","{field}":{value}}}',
                            headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and error["field"] == field
    assert "64 levels" in error["message"]
    assert run_count(api) == 0


def test_a_body_too_deep_for_the_json_parser_is_invalid_json_naming_the_limit(api):
    response = api.post_run(data='{"task":"echo","input":' + nested(100_000) + "}",
                            headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and error_code(response) == "invalid_json"
    assert "64 levels" in response.json()["error"]["message"]


def test_input_nested_64_deep_is_admitted_and_reads_back_in_full(api):
    deep = json.loads(nested(64))
    response = api.post_run({"task": "echo", "input": deep, "metadata": {"k": "v"}})
    assert response.status_code == 202, response.text
    rid = response.json()["id"]
    assert api.get(f"/v1/runs/{rid}").json()["input"] == deep
    listed = api.get("/v1/runs")
    assert listed.status_code == 200 and listed.json()["data"][0]["input"] == deep


def test_a_body_that_is_not_an_object_is_invalid_request(api):
    assert error_code(api.post_run(data="[1]", headers={"Content-Type": "application/json"})) \
        == "invalid_request"


def test_the_schema_is_checked_before_the_run_id_syntax(api):
    response = api.post_run({"task": "echo", "run_id": "bad", "extra": True})
    assert error_code(response) == "invalid_request"


# ---------------------------------------------------------------- new-run-only checks

def test_an_unknown_task_is_refused_for_a_new_run(api):
    response = api.post_run({"task": "no-such-task"}, idempotency_key="unknown-1")
    assert response.status_code == 400 and error_code(response) == "unknown_task"
    assert run_count(api) == 0
    assert api.keys_in_scope() == 0


def test_the_default_task_applies_when_none_is_named(make_server, ledger):
    api = Api(make_server(RUNSTILE_DEFAULT_TASK="echo"), ledger.key())
    response = api.post_run({"input": 1})
    assert response.status_code == 202 and response.json()["task"] == "echo"


@pytest.mark.parametrize("url", ["ftp://example.com/x", "http://127.0.0.1/hook",
                                 "http://127.1/", "http://2130706433/", "http://0x7f.1/",
                                 "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/",
                                 "http://169.254.169.254/latest", "http://localhost:9/",
                                 "http://10.0.0.8/", "not a url"])
def test_a_refused_callback_url_is_invalid_callback_url(api, url):
    response = api.post_run({"task": "echo", "callback_url": url})
    assert response.status_code == 400 and error_code(response) == "invalid_callback_url"
    assert run_count(api) == 0


@pytest.mark.parametrize("url", ["http://１２７.０.０.１/x", "http://127。0。0。1/x",
                                 "http://127．0．0．1/x", "http://[::127.0.0.1]/x",
                                 "http://[::ffff:127.0.0.1]/x", "http://[::ffff:7f00:1]/x",
                                 "http://１６９.２５４.１６９.２５４/latest",
                                 "http://192.0.2.1/x", "http://a..b/x"])
def test_every_spelling_delivery_would_refuse_is_invalid_callback_url_at_admission(api, url):
    response = api.post_run({"task": "echo", "callback_url": url})
    assert response.status_code == 400, response.text
    assert error_code(response) == "invalid_callback_url"
    assert run_count(api) == 0


def test_the_allowlist_exempts_an_address_in_every_spelling(make_server, ledger):
    api = Api(make_server(RUNSTILE_CALLBACK_ALLOWLIST="127.0.0.1"), ledger.key())
    for url in ["http://１２７.０.０.１:9/x", "http://[::ffff:127.0.0.1]:9/x",
                "http://127.1:9/x"]:
        response = api.post_run({"task": "echo", "callback_url": url})
        assert response.status_code == 202, (url, response.text)
    refused = api.post_run({"task": "echo", "callback_url": "http://１２７.０.０.２:9/x"})
    assert error_code(refused) == "invalid_callback_url"


def test_an_allowlisted_loopback_callback_is_accepted(make_server, ledger):
    api = Api(make_server(RUNSTILE_CALLBACK_ALLOWLIST="127.0.0.0/8"), ledger.key())
    response = api.post_run({"task": "echo", "callback_url": "http://127.0.0.1:9/hook"})
    assert response.status_code == 202
    assert response.json()["callback_url"] == "http://127.0.0.1:9/hook"


def test_capacity_is_a_429_with_retry_after_for_new_runs_only(make_server, ledger):
    api = Api(make_server(RUNSTILE_MAX_ACTIVE_RUNS="2"), ledger.key())
    first = api.post_run({"task": "echo", "input": 1}, idempotency_key="cap-1")
    api.post_run({"task": "echo", "input": 2})
    full = api.post_run({"task": "echo", "input": 3}, idempotency_key="cap-3")
    assert full.status_code == 429 and error_code(full) == "capacity_exceeded"
    assert int(full.headers["Retry-After"]) >= 1
    replay = api.post_run({"task": "echo", "input": 1}, idempotency_key="cap-1")
    assert replay.status_code == 202 and replay.json()["id"] == first.json()["id"]
    assert ledger.query("SELECT COUNT(*) FROM runs")[0][0] == 2


def test_capacity_counts_per_profile(make_server, ledger):
    server = make_server(RUNSTILE_MAX_ACTIVE_RUNS="1")
    assert Api(server, ledger.key("p1")).post_run({"task": "echo"}).status_code == 202
    assert Api(server, ledger.key("p2")).post_run({"task": "echo"}).status_code == 202
    assert Api(server, ledger.key("p1")).post_run({"task": "echo"}).status_code == 429


def test_a_key_in_one_scope_does_not_collide_with_the_same_key_in_another(shared_server, shared_ledger):
    server, ledger = shared_server, shared_ledger
    a, b = Api(server, ledger.key("default")), Api(server, ledger.key("default"))
    ra = a.post_run({"task": "echo", "input": "a"}, idempotency_key="shared")
    rb = b.post_run({"task": "echo", "input": "b"}, idempotency_key="shared")
    assert ra.status_code == rb.status_code == 202
    assert ra.json()["id"] != rb.json()["id"]
    assert rb.json()["replayed"] is False


def test_unicode_input_round_trips(api):
    body = {"task": "echo", "input": {"text": "héllo ✓ \U0001f600", "n": [1.5, -0.0, 1e21]}}
    created = api.post_run(body, idempotency_key="uni")
    assert created.json()["input"]["text"] == "héllo ✓ \U0001f600"
    assert api.post_run(body, idempotency_key="uni").json()["replayed"] is True


def test_a_raw_socket_request_with_a_trailing_newline_run_id_is_refused(api):
    # The JSON escape "\n" gives the server a real trailing newline, the case a
    # `$`-anchored regex would wrongly accept.
    payload = json.dumps({"task": "echo", "run_id": "run_" + "b" * 32 + "\n"}).encode()
    request = (f"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
               f"{api.key.secret}\r\nContent-Type: application/json\r\nContent-Length: "
               f"{len(payload)}\r\nConnection: close\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", api.server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"invalid_run_id" in answer
    assert run_count(api) == 0
