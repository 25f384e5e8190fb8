"""Isolation replayed over every object URL (key roles: docs/api.md, "Authentication";
docs/guarantees.md, "6. Isolation"; issue #7).

One client key makes objects of every kind and in every state a run can be left in
without a worker: runs (queued, running, waiting for approval, paused, completed,
cancelled), their events, an approval, and deliveries (pending, parked, a callback).  Then
every URL that names one of them — reads and control routes alike — is replayed with
another profile's keys (client and admin) and with a second client key of the same
profile.  Each answer must be 404 `run_not_found` / `delivery_not_found`: never 403, no
detail, nothing of the object in the body, and nothing changed in the ledger.  The
profile's admin key then reads and controls all of them, and every answer it gets is one
the OpenAPI document describes.

Runs are admitted over HTTP; their later states come from the ledger's own transitions
(claim, request approval, pause, deliver, finish), as a worker would write them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import pytest
import schemathesis

from runstile.ledger import admission, approvals, execution, journal, obligations
from runstile.ledger.execution import Owner
from runstile.ledger.keys import Principal
from runstile.web import openapi
from tests.conftest import Api

#: A worker that does not exist; its leases outlast the test.
OWNER = Owner("isolation-node", 1, 4242, 7)
LEASE_S = 3600.0
#: Written into the owner's inputs, metadata and payloads: no outsider may ever see it.
SECRET = "s3cret-isolation-marker"
JSON = {"Accept": "application/json"}

document = schemathesis.openapi.from_dict(copy.deepcopy(openapi.document()))


@dataclass
class World:
    runs: dict[str, str] = field(default_factory=dict)          # state -> run id
    deliveries: dict[str, str] = field(default_factory=dict)    # state -> delivery id
    approval_id: str = ""
    idempotency_key: str = "iso-key-1"
    session_key: str = "iso-session"


def _transition(ledger, fn):
    conn = ledger.connect()
    try:
        return fn(conn)
    finally:
        conn.close()


def _admit(owner: Api, world: World, state: str, **fields) -> str:
    body = {"task": "echo", "input": {"secret": SECRET, "state": state},
            "metadata": {"marker": SECRET}, **fields}
    response = owner.post_run(body, idempotency_key=f"iso-{state}")
    assert response.status_code == 202, response.text
    world.runs[state] = response.json()["id"]
    return world.runs[state]


def _claimed(owner: Api, world: World, state: str) -> str:
    rid = _admit(owner, world, state)
    assert _transition(owner.ledger, lambda c: execution.claim(
        c, rid, OWNER, lease_s=LEASE_S, task_known=lambda t: True)).run
    return rid


def _callback_run(ledger, key, world: World) -> None:
    """A run with a callback_url (set at the ledger: the SSRF guard refuses every host this
    sandbox can resolve), cancelled over HTTP by its owner: its callback obligation."""
    request = admission.AdmissionRequest(
        principal=Principal(key.profile, key.key_id, key.role), key=None,
        key_is_derived=False, run_id=None, task="echo", input_json=json.dumps({"s": SECRET}),
        session_key=None, trigger_id=None, metadata_json=None,
        callback_url="https://hooks.example/" + SECRET, fingerprint="f" * 64,
        fingerprint_version=1)
    world.runs["cancelled"] = _transition(ledger, lambda c: admission.admit(
        c, request, refusal=None, max_active_runs=10_000).run["id"])


@pytest.fixture(scope="module")
def world(shared_server, shared_ledger):
    """The owner's objects, with the keys: owner, same-profile client and admin, and the
    other profile's client and admin."""
    ledger = shared_ledger
    keys = {"owner": ledger.key("iso-a"), "sibling": ledger.key("iso-a"),
            "admin": ledger.key("iso-a", admin=True), "stranger": ledger.key("iso-b"),
            "stranger_admin": ledger.key("iso-b", admin=True)}
    apis = {name: Api(shared_server, key, ledger) for name, key in keys.items()}
    owner, world = apis["owner"], World()

    _admit(owner, world, "queued", session_key=world.session_key)
    owner.post_run({"task": "echo", "input": {"secret": SECRET, "state": "queued"},
                    "metadata": {"marker": SECRET}, "session_key": world.session_key},
                   idempotency_key=world.idempotency_key)
    _claimed(owner, world, "running")
    waiting = _claimed(owner, world, "waiting_for_approval")
    world.approval_id = _transition(ledger, lambda c: approvals.request(
        c, waiting, OWNER, position=1, args_hash="h", details={"secret": SECRET}))[
        "approval_id"]
    paused = _claimed(owner, world, "paused")
    assert _transition(ledger, lambda c: execution.pause(c, paused, OWNER,
                                                         "uncertain_side_effect"))
    completed = _claimed(owner, world, "completed")
    for position, name in enumerate(("pending", "parked"), start=1):
        def record(c, position=position):
            return journal.record_deliver(
                c, completed, OWNER, position=position, url="https://hooks.example/deliver",
                payload_json=json.dumps({"secret": SECRET}), args_hash=f"d{position}")
        world.deliveries[name] = _transition(ledger, record)
    assert _transition(ledger, lambda c: execution.finish(
        c, completed, OWNER, status="completed", result_json=json.dumps({"secret": SECRET})))

    def park(conn):
        claim = obligations.claim(conn, world.deliveries["parked"], node="isolation-node",
                                  generation=1, pid=1, lease_s=60)
        assert claim.row is not None
        assert obligations.settle_failed(conn, claim.row, status=410, error="gone",
                                         delay_s=0, park=True)
    _transition(ledger, park)
    _callback_run(ledger, keys["owner"], world)
    stopped = owner.post(f"/v1/runs/{world.runs['cancelled']}/stop")
    assert stopped.status_code == 200 and stopped.json()["status"] == "cancelled"
    [callback] = _transition(ledger, lambda c: obligations.for_run(c, world.runs["cancelled"]))
    world.deliveries["callback"] = callback["id"]
    return world, apis


def object_requests(world: World) -> list[tuple[str, str, str, dict]]:
    """Every (method, path template, object id, requests kwargs) naming an owner's object."""
    out = []
    for rid in world.runs.values():
        out += [("GET", "/v1/runs/{run_id}", rid, {}),
                ("GET", "/v1/runs/{run_id}/events", rid, {"headers": JSON}),
                ("GET", "/v1/runs/{run_id}/events", rid, {"params": {"after": 0}}),  # SSE
                ("GET", "/v1/runs/{run_id}/deliveries", rid, {}),
                ("POST", "/v1/runs/{run_id}/stop", rid, {}),
                ("POST", "/v1/runs/{run_id}/resume", rid, {}),
                ("POST", "/v1/runs/{run_id}/retry", rid, {}),
                ("POST", "/v1/runs/{run_id}/retry", rid, {"headers": {"Idempotency-Key": "i"}}),
                ("POST", "/v1/runs/{run_id}/approval", rid,
                 {"json": {"approval_id": world.approval_id, "decision": "approve"}}),
                ("POST", "/v1/runs/{run_id}/approval", rid, {"json": {"decision": "maybe"}})]
    for did in world.deliveries.values():
        out += [("POST", "/v1/deliveries/{delivery_id}/retry", did, {}),
                ("POST", "/v1/deliveries/{delivery_id}/discard", did, {})]
    return out


def ledger_state(ledger) -> list:
    return [ledger.query("SELECT id, status, attempt, updated_at, approval FROM runs "
                         "ORDER BY id"),
            ledger.query("SELECT run_id, seq, type FROM events ORDER BY run_id, seq"),
            ledger.query("SELECT id, state, attempts, updated_at FROM obligations ORDER BY id"),
            ledger.query("SELECT run_id, position, state, result FROM journal "
                         "ORDER BY run_id, position")]


def call(api: Api, method: str, template: str, object_id: str, kwargs: dict):
    path = template.replace("{run_id}", object_id).replace("{delivery_id}", object_id)
    kwargs = {**kwargs, "headers": {**api.key.headers, **kwargs.get("headers", {})}}
    return api.session.request(method, api.server.url + path, timeout=30, **kwargs)


def conforms(method: str, path: str, response) -> None:
    """The answer is one the OpenAPI document describes: status code and body."""
    operation = document.find_operation_by_path(method, path)
    assert operation is not None, (method, path)
    assert str(response.status_code) in operation.definition.raw["responses"], \
        (method, path, response.status_code, response.text)
    operation.validate_response(response)


@pytest.mark.parametrize("who", ["stranger", "stranger_admin", "sibling"])
def test_every_object_url_replayed_with_a_key_that_may_not_see_it_is_a_bare_404(world, who,
                                                                               shared_ledger):
    world, apis = world
    outsider = apis[who]
    before = ledger_state(shared_ledger)
    for method, template, object_id, kwargs in object_requests(world):
        response = call(outsider, method, template, object_id, kwargs)
        expected = "delivery_not_found" if "{delivery_id}" in template else "run_not_found"
        assert response.status_code == 404, (who, method, template, response.status_code,
                                             response.text)
        assert response.headers["Content-Type"].startswith("application/json")
        assert response.json()["error"]["code"] == expected, (method, template, response.text)
        assert set(response.json()["error"]) == {"code", "message"}, response.text
        assert SECRET not in response.text and "Location" not in response.headers
        assert not any(rid in response.text for rid in world.runs.values())
        conforms(method, template, response)
    # Nor do the lookups that name a run by what only its owner knows.
    for params in ({"idempotency_key": world.idempotency_key},
                   {"session_key": world.session_key}, {"metadata.marker": SECRET}):
        assert outsider.get("/v1/runs", params={**params, "limit": 200}).json()["data"] == []
    taken = outsider.post_run({"task": "echo", "run_id": world.runs["queued"]})
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "run_id_conflict"
    assert world.runs["queued"] not in taken.text and SECRET not in taken.text
    assert ledger_state(shared_ledger) == before, "an outsider's request changed the ledger"


def test_the_owner_and_the_profiles_admin_see_every_object(world):
    world, apis = world
    for who in ("owner", "admin"):
        api = apis[who]
        for state, rid in world.runs.items():
            run = api.get(f"/v1/runs/{rid}")
            assert run.status_code == 200 and run.json()["status"] == state, (who, state)
            conforms("GET", "/v1/runs/{run_id}", run)
            page = api.get(f"/v1/runs/{rid}/events", headers=JSON)
            assert page.status_code == 200 and page.json()["data"][0]["type"] == "run.queued"
            conforms("GET", "/v1/runs/{run_id}/events", page)
            listed = api.get(f"/v1/runs/{rid}/deliveries")
            conforms("GET", "/v1/runs/{run_id}/deliveries", listed)
        waiting = api.get(f"/v1/runs/{world.runs['waiting_for_approval']}").json()
        assert waiting["approval"]["approval_id"] == world.approval_id
        shown = {d["id"]: d["state"] for rid in (world.runs["completed"], world.runs["cancelled"])
                 for d in api.get(f"/v1/runs/{rid}/deliveries").json()["data"]}
        assert shown == {world.deliveries["pending"]: "pending",
                         world.deliveries["parked"]: "parked",
                         world.deliveries["callback"]: "pending"}
    listed = {r["id"] for r in apis["admin"].get(
        "/v1/runs", params={"session_key": world.session_key, "limit": 200}).json()["data"]}
    assert world.runs["queued"] in listed


def test_the_profiles_admin_controls_every_object(world):
    world, apis = world
    admin = apis["admin"]
    answers = [
        ("POST", "/v1/runs/{run_id}/approval", world.runs["waiting_for_approval"],
         {"json": {"approval_id": world.approval_id, "decision": "approve"}}, 200, "queued"),
        ("POST", "/v1/runs/{run_id}/resume", world.runs["paused"], {}, 200, "queued"),
        ("POST", "/v1/runs/{run_id}/stop", world.runs["running"], {}, 202, "stopping"),
        ("POST", "/v1/runs/{run_id}/stop", world.runs["queued"], {}, 200, "cancelled"),
        ("POST", "/v1/runs/{run_id}/resume", world.runs["completed"], {}, 409, None),
        ("POST", "/v1/runs/{run_id}/retry", world.runs["cancelled"], {}, 202, "queued"),
        ("POST", "/v1/runs/{run_id}/retry", world.runs["completed"], {}, 409, None),
    ]
    for method, template, rid, kwargs, status, after in answers:
        response = call(admin, method, template, rid, kwargs)
        assert response.status_code == status, (template, response.text)
        conforms(method, template, response)
        if after is not None:
            assert response.json()["status"] == after
    for template, did, state in (("/v1/deliveries/{delivery_id}/retry",
                                  world.deliveries["parked"], "pending"),
                                 ("/v1/deliveries/{delivery_id}/discard",
                                  world.deliveries["pending"], "discarded")):
        response = call(admin, "POST", template, did, {})
        assert response.status_code == 200 and response.json()["state"] == state, response.text
        conforms("POST", template, response)
