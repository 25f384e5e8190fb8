"""POST /v1/runs with ``delay_s`` or ``not_before`` against a real server (docs/api.md,
"Delayed runs"): what is refused, what the run object says, and what a retry with the same
Idempotency-Key replays.  The module's server runs no workers: runs stay queued."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from runstile.ledger import execution
from runstile.ledger.execution import Owner
from runstile.objects import parse_rfc3339

#: The fingerprint of this body before delayed runs existed (computed on the code of
#: migration 6): a body without delay_s or not_before must keep it, or every stored
#: idempotency record of an upgraded ledger would stop replaying.
OLD_BODY = {"task": "echo", "input": {"a": 1}, "session_key": "s", "metadata": {"m": "x"}}
OLD_FINGERPRINT = "6a412d722c45b0f41a95f60c3d42a98786032c61da370850e7e22781b96a2310"


def spelled(unix_s: int, utc_offset_h: int = 0) -> str:
    """``unix_s`` as RFC 3339, written in a zone ``utc_offset_h`` hours east of UTC."""
    zone = dt.timezone(dt.timedelta(hours=utc_offset_h))
    return dt.datetime.fromtimestamp(unix_s, tz=zone).isoformat()


def ahead(seconds: float, utc_offset_h: int = 0) -> str:
    """An RFC 3339 time about ``seconds`` from now."""
    return spelled(int(time.time() + seconds), utc_offset_h)


def refusal(response) -> tuple[int, str, str | None]:
    error = response.json()["error"]
    return response.status_code, error["code"], error.get("field")


@pytest.mark.parametrize(("extra", "field"), [
    ({"delay_s": 1, "not_before": "2001-01-01T00:00:00Z"}, "not_before"),
    ({"delay_s": -1}, "delay_s"),
    ({"delay_s": 2_592_000.5}, "delay_s"),
    ({"delay_s": 10**30}, "delay_s"),
    ({"delay_s": "5"}, "delay_s"),
    ({"delay_s": True}, "delay_s"),
    ({"delay_s": [1]}, "delay_s"),
    ({"not_before": "tomorrow"}, "not_before"),
    ({"not_before": "2030-01-01T00:00:00"}, "not_before"),      # no timezone
    ({"not_before": "2030-01-01"}, "not_before"),               # no time
    ({"not_before": "2030-02-30T00:00:00Z"}, "not_before"),     # no such day
    ({"not_before": "2030-01-01T25:00:00Z"}, "not_before"),
    ({"not_before": "9999-01-01T00:00:00Z"}, "not_before"),     # more than 30 days ahead
    ({"not_before": 1893456000}, "not_before"),
    ({"not_before": {"at": "2030-01-01T00:00:00Z"}}, "not_before"),
])
def test_a_bad_delay_or_time_is_refused_naming_its_field(api, extra, field):
    response = api.post_run({"task": "echo", "input": {}, **extra})
    assert refusal(response) == (400, "invalid_request", field)
    assert api.runs_in_scope() == 0


def test_a_delayed_run_is_queued_with_its_not_before_in_utc(api):
    before = time.time()
    run = api.post_run({"task": "echo", "input": {}, "delay_s": 60}).json()
    assert run["status"] == "queued"
    assert before + 60 - 0.01 <= parse_rfc3339(run["not_before"]) <= time.time() + 60
    when = ahead(3600, utc_offset_h=1)
    at = api.post_run({"task": "echo", "input": {}, "not_before": when}).json()
    assert at["status"] == "queued" and at["not_before"].endswith(".000Z")
    assert parse_rfc3339(at["not_before"]) == parse_rfc3339(when)
    plain = api.post_run({"task": "echo", "input": {}}).json()
    assert plain["not_before"] is None
    assert api.get(f"/v1/runs/{run['id']}").json()["not_before"] == run["not_before"]


def test_a_retry_with_the_same_key_replays_the_same_run_and_not_before(api):
    body = {"task": "echo", "input": {"n": 1}, "delay_s": 5}
    first = api.post_run(body, idempotency_key="delayed-1")
    time.sleep(0.05)  # a retry a little later: its not_before is not recomputed
    again = api.post_run(body, idempotency_key="delayed-1")
    assert first.status_code == again.status_code == 202
    assert again.headers.get("Idempotency-Replayed") == "true"
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["not_before"] == first.json()["not_before"]
    other = api.post_run({**body, "delay_s": 6}, idempotency_key="delayed-1")
    assert refusal(other)[:2] == (409, "idempotency_key_conflict")
    undelayed = api.post_run({"task": "echo", "input": {"n": 1}}, idempotency_key="delayed-1")
    assert refusal(undelayed)[:2] == (409, "idempotency_key_conflict")
    when = int(time.time()) + 7200
    at = {"task": "echo", "input": {}, "not_before": spelled(when)}
    same_time = {**at, "not_before": spelled(when, utc_offset_h=1)}  # the same instant
    assert at["not_before"] != same_time["not_before"]
    assert api.post_run(at, idempotency_key="delayed-2").status_code == 202
    assert api.post_run(same_time, idempotency_key="delayed-2").headers.get(
        "Idempotency-Replayed") == "true"


def test_a_body_without_the_new_fields_keeps_its_old_fingerprint(api):
    run = api.post_run(OLD_BODY, idempotency_key="old-body").json()
    assert api.ledger.query("SELECT fingerprint FROM runs WHERE id = ?", (run["id"],)) == [
        (OLD_FINGERPRINT,)]
    assert api.ledger.query("SELECT fingerprint FROM idempotency_keys WHERE run_id = ?",
                            (run["id"],)) == [(OLD_FINGERPRINT,)]


def test_a_claim_before_the_run_is_due_refuses_it_and_leaves_a_message_for_its_time(api):
    run = api.post_run({"task": "echo", "input": {}, "delay_s": 600}).json()
    conn = api.ledger.connect()
    try:
        claim = execution.claim(conn, run["id"], Owner("n", 1, 1, 1), lease_s=30,
                                task_known=lambda name: True)
    finally:
        conn.close()
    assert claim.run is None and claim.outcome == "not_due"
    assert api.get(f"/v1/runs/{run['id']}").json()["status"] == "queued"
    not_before = parse_rfc3339(run["not_before"])
    etas = [eta for (eta,) in api.ledger.query(
        "SELECT eta FROM broker_messages WHERE run_id = ?", (run["id"],))]
    assert etas and all(eta is not None and eta >= not_before for eta in etas)
