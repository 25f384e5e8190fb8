"""The admission endpoint (runstile/web/admission_endpoint.py): POST /v1/runs answered in
front of Flask must answer exactly as the Flask route does, and leave every other
request to Flask.  In process, on a real ledger: both ways are called with the same
WSGI environ, one through the app a web process serves, one through Flask alone."""

from __future__ import annotations

import json

import pytest
from werkzeug.test import EnvironBuilder

from runstile.config import Settings
from runstile.web import create_app
from runstile.web.admission_endpoint import AdmissionEndpoint


@pytest.fixture
def app(ledger):
    made = create_app(Settings(data_dir=ledger.data_dir, database_url=ledger.url,
                               max_body_bytes=4096))
    assert isinstance(made.wsgi_app, AdmissionEndpoint)
    return made


def call(wsgi, method: str, path: str, *, over_limit: bool = False, **kwargs):
    """(status, headers, body) of one request to a WSGI app.  ``over_limit``: as the web
    process marks a body it did not buffer (web/gthread.py)."""
    environ = EnvironBuilder(method=method, path=path, **kwargs).get_environ()
    environ["runstile.body_over_limit"] = over_limit
    answered = {}

    def start_response(status, headers, exc_info=None):
        answered["status"], answered["headers"] = status, headers

    body = b"".join(wsgi(environ, start_response))
    return answered["status"], dict(answered["headers"]), body


def both(app, method: str, path: str, **kwargs):
    """The same request through the served app (the endpoint first) and through Flask."""
    return (call(app.wsgi_app, method, path, **kwargs),
            call(app.wsgi_app.fallback, method, path, **kwargs))


def bearer(key) -> dict[str, str]:
    return {"Authorization": f"Bearer {key.secret}"}


def test_every_refusal_of_post_v1_runs_is_the_same_byte_for_byte_as_flasks(app, ledger):
    key = ledger.key()
    good = {"task": "echo", "input": {"n": 1}}
    cases = [
        {},                                                     # no key at all
        {"headers": {"Authorization": "Bearer rsk_0000000000000000_" + "x" * 43}},
        {"headers": {"Authorization": "Basic abc"}},
        {"headers": bearer(key), "data": "x" * 5000, "content_type": "application/json"},
        {"headers": bearer(key), "data": json.dumps(good), "content_type": "text/plain"},
        {"headers": bearer(key), "data": "{not json", "content_type": "application/json"},
        {"headers": bearer(key), "data": '{"task": "a", "task": "b"}',
         "content_type": "application/json"},
        {"headers": {**bearer(key), "Idempotency-Key": "has space"}, "json": good},
        {"headers": bearer(key), "json": {"task": "echo", "surprise": 1}},
        {"headers": bearer(key), "json": {"task": "echo", "run_id": "run_NOPE"}},
        {"headers": bearer(key), "json": {"task": "no-such-task"}},
        {"headers": bearer(key), "json": {"task": "echo", "priority": 99}},
        {"headers": bearer(key), "json": {"task": "echo",
                                          "callback_url": "http://127.0.0.1:1/hook"}},
        {"headers": bearer(key), "json": [1, 2]},
    ]
    for case in cases:
        served, flask = both(app, "POST", "/v1/runs", **case)
        assert served == flask, case
        assert served[0][:3] in {"400", "401", "409", "413", "415", "422"}, (case, served)
        assert served[1]["Content-Type"] == "application/json"
        assert json.loads(served[2])["error"]["code"]
    # The body over the cap that the web process did not buffer: a 413 once the key is
    # known, the same 401 before.
    for headers, status in ((bearer(key), "413"), ({}, "401")):
        served, flask = both(app, "POST", "/v1/runs", headers=headers, over_limit=True)
        assert served == flask and served[0].startswith(status)


def test_an_admission_and_its_replay_answer_as_the_flask_route_does(app, ledger):
    key = ledger.key()
    shape = {}
    for way, wsgi in (("served", app.wsgi_app), ("flask", app.wsgi_app.fallback)):
        headers = {**bearer(key), "Idempotency-Key": f"k-{way}"}
        first = call(wsgi, "POST", "/v1/runs", headers=headers, json={"task": "echo"})
        again = call(wsgi, "POST", "/v1/runs", headers=headers, json={"task": "echo"})
        created, replayed = json.loads(first[2]), json.loads(again[2])
        assert first[0] == again[0] and first[0].startswith("202 ")
        assert first[1]["Location"] == f"/v1/runs/{created['id']}"
        assert replayed["id"] == created["id"] and replayed["replayed"] is True
        assert "Idempotency-Replayed" not in first[1]
        assert again[1]["Idempotency-Replayed"] == "true"
        shape[way] = (first[0], sorted(first[1]), list(created), sorted(again[1]),
                      list(replayed))
    assert shape["served"] == shape["flask"]
    assert ledger.query("SELECT COUNT(*) FROM runs") == [(2,)]


def test_every_other_request_goes_on_to_flask(app, ledger):
    key = ledger.key()
    # The URL map still knows POST: another method is a 405 that lists it.
    status, headers, _ = call(app.wsgi_app, "PUT", "/v1/runs", headers=bearer(key))
    assert status.startswith("405") and "POST" in headers["Allow"]
    # Only the exact path: a trailing slash is Flask's 404.
    status, _, body = call(app.wsgi_app, "POST", "/v1/runs/", headers=bearer(key),
                           json={"task": "echo"})
    assert status.startswith("404") and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = call(app.wsgi_app, "GET", "/v1/runs", headers=bearer(key))
    assert status.startswith("200") and json.loads(body)["object"] == "list"
    assert ledger.query("SELECT COUNT(*) FROM runs") == [(0,)]


def test_an_unexpected_error_is_logged_and_answered_500_as_flask_does(app, ledger, monkeypatch,
                                                                      caplog):
    key = ledger.key()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in validation")

    monkeypatch.setattr("runstile.web.admission.build", broken)
    with caplog.at_level("ERROR", logger="runstile.web"):
        served, flask = both(app, "POST", "/v1/runs", headers=bearer(key),
                             json={"task": "echo"})
    assert served == flask and served[0].startswith("500 ")
    assert "a bug in validation" not in served[2].decode()
    logged = [r for r in caplog.records if r.getMessage() == "unexpected error"]
    assert len(logged) == 2 and all(r.exc_info and "a bug in validation" in str(r.exc_info[1])
                                    for r in logged)
    assert ledger.query("SELECT COUNT(*) FROM runs") == [(0,)]
