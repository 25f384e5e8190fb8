"""``priority`` on POST /v1/runs (docs/api.md, "POST /v1/runs"): 0-9, 5 by default, in the
run object; anything else a 400 naming the field; in the fingerprint only when present."""

from __future__ import annotations

import pytest

#: sha256 of the canonical body below, computed on the code before priorities existed:
#: a request without ``priority`` must keep it, or stored records stop replaying.
OLD_FINGERPRINT = "3c203406daa8b796a61375c654b50e8d6f807dd78f8fb5d8d53db05fe369ef8f"
BODY = {"task": "echo", "input": {"n": 1}, "session_key": "s1", "metadata": {"a": "b"}}


def stored_fingerprint(api, run_id: str) -> str:
    return api.ledger.query("SELECT fingerprint FROM runs WHERE id = ?", (run_id,))[0][0]


def test_a_run_without_priority_has_5_and_one_with_it_keeps_it(api):
    assert api.post_run({"task": "echo"}).json()["priority"] == 5
    for priority in (0, 9):
        run = api.post_run({"task": "echo", "priority": priority}).json()
        assert run["priority"] == priority
        assert api.get(f"/v1/runs/{run['id']}").json()["priority"] == priority
        assert api.ledger.query("SELECT priority FROM runs WHERE id = ?", (run["id"],)) == [
            (priority,)]
        assert api.ledger.query("SELECT priority FROM broker_messages WHERE run_id = ?",
                                (run["id"],)) == [(priority,)]


@pytest.mark.parametrize("bad", [-1, 10, 1000, 5.0, 4.5, "5", True, False, None, [5], {}])
def test_a_priority_out_of_range_or_not_an_integer_is_a_400_naming_the_field(api, bad):
    answer = api.post_run({"task": "echo", "priority": bad})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_request"
    assert answer.json()["error"]["field"] == "priority"


def test_a_request_without_priority_keeps_the_fingerprint_it_had_before_priorities(api):
    run = api.post_run(BODY, idempotency_key="fp-1").json()
    assert stored_fingerprint(api, run["id"]) == OLD_FINGERPRINT


def test_an_explicit_default_priority_is_another_request_than_no_priority(api):
    first = api.post_run(BODY, idempotency_key="fp-2")
    assert api.post_run(BODY, idempotency_key="fp-2").json()["replayed"] is True
    explicit = api.post_run({**BODY, "priority": 5}, idempotency_key="fp-2")
    assert explicit.status_code == 409, explicit.text
    other = api.post_run({**BODY, "priority": 5}, idempotency_key="fp-3").json()
    assert stored_fingerprint(api, other["id"]) != stored_fingerprint(api, first.json()["id"])
    assert api.post_run({**BODY, "priority": 5},
                        idempotency_key="fp-3").json()["replayed"] is True
    assert api.post_run({**BODY, "priority": 6}, idempotency_key="fp-3").status_code == 409


def test_the_client_sends_priority_only_when_given(api):
    from runstile.client import Client
    client = Client(api.server.url, api.key.secret)
    try:
        assert client.submit("echo")["priority"] == 5
        assert client.submit("echo", priority=8)["priority"] == 8
    finally:
        client.close()


def test_a_retry_keeps_its_originals_priority_in_its_run_and_its_message(api):
    from tests.api.test_retry import cancelled, retry
    original = cancelled(api, priority=8)
    again = retry(api, original).json()
    assert (again["retry_of"], again["priority"]) == (original, 8)
    assert api.ledger.query("SELECT priority FROM broker_messages WHERE run_id = ?",
                            (again["id"],)) == [(8,)]
