"""Delivery obligations end to end (docs/api.md, "Deliveries (webhooks)"): real ``runstile up``
processes, a loopback receiver that records what actually arrived, signatures checked by
the independent ``standardwebhooks`` package, and SIGKILLs of the deliverer."""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import json
import socket
import subprocess
import time

import pytest
import requests
from standardwebhooks.webhooks import Webhook

from runstile import netguard
from tests.conftest import ROOT, RUNSTILE, Api, System, wait_for_status, wait_until
from tests.receiver import answer_with

#: The receivers listen on loopback, which the SSRF guard refuses unless allow-listed.
LOOPBACK = {"RUNSTILE_CALLBACK_ALLOWLIST": "127.0.0.1"}
FAST = {**LOOPBACK, "RUNSTILE_LEASE_S": "2", "RUNSTILE_HEARTBEAT_S": "0.5",
        "RUNSTILE_RECOVERY_INTERVAL_S": "0.5", "RUNSTILE_DRAIN_TIMEOUT_S": "1",
        "RUNSTILE_DELIVERY_BACKOFF_S": "0.05", "RUNSTILE_DELIVERY_BACKOFF_MAX_S": "0.5",
        "RUNSTILE_DELIVERY_CONNECT_TIMEOUT_S": "1", "RUNSTILE_DELIVERY_READ_TIMEOUT_S": "0.5"}


def cli(ledger, *args: str) -> str:
    done = subprocess.run([*RUNSTILE, *args, "--data-dir", str(ledger.data_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def signing_secret(ledger, profile: str = "default") -> str:
    return cli(ledger, "webhooks", "secret", "--profile", profile).splitlines()[-1]


def verified(request: dict, secret: str) -> dict:
    """The body of a received request, after the standardwebhooks package verified it."""
    return Webhook(secret).verify(request["body"], request["headers"])


def deliveries(api: Api, run_id: str) -> list[dict]:
    answer = api.get(f"/v1/runs/{run_id}/deliveries")
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def event_types(api: Api, run_id: str) -> list[str]:
    answer = api.get(f"/v1/runs/{run_id}/events", headers={"Accept": "application/json"})
    return [e["type"] for e in answer.json()["data"]]


def test_a_completed_runs_result_reaches_its_callback_once_signed_by_the_profile_secret(
        make_system, ledger, receiver):
    hook = receiver()
    system = make_system(workers=1, threads=2, **LOOPBACK)
    api = Api(system, ledger.key(), ledger)
    secret = signing_secret(ledger)  # the profile exists once it has a key
    rid = api.post_run({"task": "echo", "input": {"x": 1}, "callback_url": hook.url()}
                       ).json()["id"]
    run = wait_for_status(api, rid)
    wait_until(lambda: deliveries(api, rid) and deliveries(api, rid)[0]["state"] == "delivered",
               15, 0.05, "the callback to be delivered")
    [request] = hook.received()
    body = verified(request, secret)
    assert body["type"] == "run.completed" and "recovered" not in body
    assert body["data"] == run  # the run object, exactly as the API shows it
    [delivery] = deliveries(api, rid)
    assert request["headers"]["webhook-id"] == delivery["id"]
    assert delivery["kind"] == "callback" and delivery["attempts"] == 1
    wait_until(lambda: "delivery.delivered" in event_types(api, rid), 10, 0.05,
               "the delivery.delivered event")
    types = event_types(api, rid)
    assert types.index("run.completed") < types.index("delivery.delivered")


def test_a_person_is_notified_when_a_run_waits_for_approval_and_then_gets_its_result(
        make_system, ledger, receiver, tmp_path):
    hook = receiver()
    system = make_system(workers=1, threads=2, **LOOPBACK)
    api = Api(system, ledger.key(), ledger)
    secret = signing_secret(ledger)  # the profile exists once it has a key
    rid = api.post_run({"task": "t.approval", "input": {"log": str(tmp_path / "log")},
                        "callback_url": hook.url()}).json()["id"]
    waiting = wait_for_status(api, rid, statuses=("waiting_for_approval",))
    wait_until(lambda: len(hook.received()) == 1, 15, 0.05, "the approval notice")
    notice = verified(hook.received()[0], secret)
    assert notice["type"] == "approval.requested"
    assert notice["data"]["status"] == "waiting_for_approval"
    assert notice["data"]["approval"]["approval_id"] == waiting["approval"]["approval_id"]
    api.post(f"/v1/runs/{rid}/approval", json={
        "approval_id": waiting["approval"]["approval_id"], "decision": "approve"})
    wait_for_status(api, rid)
    wait_until(lambda: len(hook.received()) == 2, 15, 0.05, "the result")
    result = verified(hook.received()[1], secret)
    assert result["type"] == "run.completed" and result["data"]["result"] == {"published": True}
    # The notice still shows the run as it was when it was written, not as it ended.
    assert [d["type"] for d in deliveries(api, rid)] == ["approval.requested", "run.completed"]


def test_a_stopped_queued_run_sends_its_cancellation_to_its_callback(make_system, ledger,
                                                                    receiver):
    hook = receiver()
    system = make_system(workers=1, threads=1, **LOOPBACK)
    api = Api(system, ledger.key(), ledger)
    # Its session is held by a waiting run, so the second run stays queued.
    first = api.post_run({"task": "t.approval", "input": {"log": "/dev/null"},
                          "session_key": "s"}).json()["id"]
    wait_for_status(api, first, statuses=("waiting_for_approval",))
    rid = api.post_run({"task": "echo", "session_key": "s", "callback_url": hook.url()}
                       ).json()["id"]
    assert api.post(f"/v1/runs/{rid}/stop").status_code == 200
    wait_until(lambda: len(hook.received()) == 1, 15, 0.05, "the cancellation")
    body = json.loads(hook.received()[0]["body"])
    assert body["type"] == "run.cancelled" and body["data"]["status"] == "cancelled"


def test_ctx_deliver_is_durable_and_a_body_that_runs_again_does_not_deliver_twice(
        make_system, ledger, receiver, tmp_path):
    hook = receiver()
    system = make_system(workers=1, threads=2, **LOOPBACK)
    api = Api(system, ledger.key(), ledger)
    secret = signing_secret(ledger)  # the profile exists once it has a key
    log = tmp_path / "log"
    rid = api.post_run({"task": "t.deliver", "input": {
        "log": str(log), "url": hook.url(), "count": 3, "approval": True}}).json()["id"]
    waiting = wait_for_status(api, rid, statuses=("waiting_for_approval",))
    api.post(f"/v1/runs/{rid}/approval", json={
        "approval_id": waiting["approval"]["approval_id"], "decision": "approve"})
    run = wait_for_status(api, rid)
    assert run["status"] == "completed"
    assert len(log.read_text().splitlines()) == 2, "the body ran twice"
    wait_until(lambda: all(d["state"] == "delivered" for d in deliveries(api, rid)), 15, 0.05,
               "the deliveries")
    obligations = deliveries(api, rid)
    assert [d["id"] for d in obligations] == run["result"]["deliveries"]
    received = hook.received()
    assert len(received) == 3
    bodies = [verified(r, secret) for r in received]
    assert sorted(b["data"]["n"] for b in bodies) == [0, 1, 2]
    assert all(b["type"] == "task.delivery" and b["run_id"] == rid for b in bodies)
    assert {r["headers"]["webhook-id"] for r in received} == set(run["result"]["deliveries"])


def test_the_result_reaches_its_callback_after_the_worker_died_between_the_terminal_write_and_the_send(
        ledger, receiver):
    hook = receiver()
    system = System(ledger.data_dir, {**LOOPBACK, "RUNSTILE_CRASHPOINT": "after_finish"},
                    web_workers=1, workers=1, threads=1).start()
    try:
        api = Api(system, ledger.key(), ledger)
        rid = api.post_run({"task": "echo", "input": 7, "callback_url": hook.url()}
                           ).json()["id"]
        # The worker dies right after the terminal write; the supervisor stops the tree.
        assert system.proc.wait(timeout=60) == 1
    finally:
        system.kill()
    assert ledger.query("SELECT status FROM runs WHERE id = ?", (rid,)) == [("completed",)]
    assert ledger.query("SELECT state, attempts FROM obligations WHERE run_id = ?",
                        (rid,)) == [("pending", 0)]
    assert hook.received() == []
    system = System(ledger.data_dir, LOOPBACK, web_workers=1, workers=1, threads=1).start()
    try:
        wait_until(lambda: len(hook.received()) == 1, 20, 0.05, "the callback after restart")
        body = json.loads(hook.received()[0]["body"])
        assert body["type"] == "run.completed" and body["data"]["result"] == {"echo": 7}
        wait_until(lambda: ledger.query("SELECT state FROM obligations WHERE run_id = ?",
                                        (rid,)) == [("delivered",)], 10, 0.05, "delivered")
    finally:
        system.kill()


def test_a_parked_delivery_is_re_armed_or_discarded_by_a_person_and_keeps_its_run_meanwhile(
        make_system, ledger, receiver):
    gone = receiver(answer_with(410))
    system = make_system(workers=1, threads=2, **LOOPBACK, RUNSTILE_RUN_RETENTION_S="2",
                         RUNSTILE_RECOVERY_INTERVAL_S="0.3")
    api = Api(system, ledger.key(), ledger)
    rids = [api.post_run({"task": "echo", "callback_url": gone.url()}).json()["id"]
            for _ in range(2)]
    for rid in rids:
        wait_until(lambda rid=rid: deliveries(api, rid)
                   and deliveries(api, rid)[0]["state"] == "parked",
                   15, 0.05, "a 410 to park the delivery")
    time.sleep(2.5)  # past the 2 s retention, over several retention passes
    for rid in rids:
        assert api.get(f"/v1/runs/{rid}").status_code == 200, "a parked delivery keeps its run"
    [parked] = deliveries(api, rids[0])
    assert parked["last_status"] == 410 and "delivery.parked" in event_types(api, rids[0])
    # Re-armed over HTTP: fresh attempts, sent at once (and parked again by the 410).
    retried = api.post(f"/v1/deliveries/{parked['id']}/retry")
    assert retried.status_code == 200 and retried.json()["state"] in ("pending", "attempting",
                                                                      "parked")
    wait_until(lambda: len(gone.received()) == 3, 15, 0.05, "the re-armed attempt")
    # Discarded through the CLI: settled for good, recorded, and the run may now go.
    [second] = deliveries(api, rids[1])
    out = cli(ledger, "deliveries", "discard", second["id"], "--json")
    assert json.loads(out.splitlines()[-1])["state"] == "discarded"
    assert "delivery.discarded" in event_types(api, rids[1])
    again = api.post(f"/v1/deliveries/{second['id']}/discard")
    assert again.status_code == 200 and again.json()["settled_by"].startswith("cli:")
    assert api.post(f"/v1/deliveries/{second['id']}/retry").json()["error"]["code"] == \
        "delivery_settled"
    wait_until(lambda: api.get(f"/v1/runs/{rids[1]}").status_code == 404, 15, 0.1,
               "retention to purge the run whose delivery was discarded")
    # Another profile's key learns nothing about the delivery.
    stranger = Api(system, ledger.key("other"), ledger)
    assert stranger.post(f"/v1/deliveries/{parked['id']}/discard").json()["error"]["code"] == \
        "delivery_not_found"
    assert stranger.get(f"/v1/runs/{rids[0]}/deliveries").status_code == 404


# ---------------------------------------------------------------- the flaky receiver

def _flaky(handler, record) -> int:
    """Per webhook-id, by its hash and how often it came: 410s, 500s, a 503 with
    Retry-After, an answer slower than the read timeout, and mostly 204."""
    msg_id = record["headers"].get("webhook-id", "")
    kind = int(hashlib.sha256(msg_id.encode()).hexdigest(), 16) % 20
    seen = _flaky.seen[msg_id] = _flaky.seen.get(msg_id, 0) + 1
    if kind == 0:
        return answer_with(410)(handler)
    if kind in (1, 2) and seen <= 2:
        return answer_with(500, body=b"oops")(handler)
    if kind == 3 and seen == 1:
        return answer_with(503, {"Retry-After": "1"})(handler)
    if kind == 4 and seen == 1:
        time.sleep(1.0)  # past RUNSTILE_DELIVERY_READ_TIMEOUT_S: the deliverer gives up
        return answer_with(204)(handler)
    return answer_with(204)(handler)


_flaky.seen = {}


@pytest.mark.chaos  # a soak of a minute and more: `make chaos` (and .ci/run) runs it
def test_1000_obligations_through_a_flaky_receiver_and_20_deliverer_kills_end_delivered_or_parked(
        ledger, receiver, tmp_path):
    """≥ 20 SIGKILLs of the deliverer, each right after a receiver answered and before the
    outcome was recorded (the ambiguous moment), across 1,100 obligations (100 runs x 10
    ctx.deliver + 100 result callbacks): every one ends delivered or parked, every
    redelivery of one obligation has its webhook-id, every request verifies."""
    _flaky.seen = {}
    hook = receiver(_flaky)
    env = {**FAST, "RUNSTILE_DELIVERY_MAX_ATTEMPTS": "6", "RUNSTILE_RECOVERY_BUDGET": "1000"}
    key = ledger.key()
    secret = signing_secret(ledger)  # the profile exists once it has a key
    log = tmp_path / "log"
    kills, submitted = 0, []
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        crashing = kills < 22
        system = System(ledger.data_dir, {
            **env, **({"RUNSTILE_CRASHPOINT": "after_delivery_send:0.03"} if crashing else {})},
            web_workers=1, workers=2, threads=4)
        try:
            try:
                system.start()
            except AssertionError:
                # A deliverer killed itself while the tree was still booting.
                assert "exited with -9" in system.log(), system.log()[-3000:]
                kills += system.log().count("exited with -9")
                continue
            api = Api(system, key, ledger)
            try:
                while len(submitted) < 100:
                    # The same key again after a kill: a lost answer is replayed, not doubled.
                    submitted.append(api.post_run({
                        "task": "t.deliver", "callback_url": hook.url(),
                        "input": {"log": str(log), "url": hook.url(), "count": 10}},
                        idempotency_key=f"flaky-{len(submitted)}").json()["id"])
            except requests.RequestException:
                pass  # the tree is going down under a kill; counted below
            def settled():
                return ledger.query(
                    "SELECT COUNT(*) FROM obligations WHERE state NOT IN ('delivered', 'parked')"
                )[0][0] == 0 and ledger.query("SELECT COUNT(*) FROM runs WHERE status NOT IN "
                                              "('completed', 'failed', 'interrupted')")[0][0] == 0
            while system.proc.poll() is None and not settled():
                time.sleep(0.1)
            if system.proc.poll() is not None:
                # A deliverer killed itself; the supervisor stopped the tree.
                assert "exited with -9" in system.log(), system.log()[-3000:]
                kills += system.log().count("exited with -9")
                continue
            if settled() and (kills >= 20 or not crashing):
                break
        finally:
            system.kill()
    assert kills >= 20, f"only {kills} kills happened"
    states = collections.Counter(r[0] for r in ledger.query("SELECT state FROM obligations"))
    assert sum(states.values()) == 1100 and set(states) <= {"delivered", "parked"}, states
    runs = ledger.query("SELECT status, COUNT(*) FROM runs GROUP BY status")
    assert runs == [("completed", 100)], runs

    by_id = collections.defaultdict(list)
    received = hook.received()
    for request in received:
        if not request["complete"]:
            continue  # its sender died mid-request: no receiver would accept it
        body = verified(request, secret)  # every request, redeliveries included
        by_id[request["headers"]["webhook-id"]].append((request, body))
    rows = {r[0]: r[1:] for r in ledger.query(
        "SELECT id, state, last_status, ambiguous FROM obligations")}
    assert set(by_id) <= set(rows), "a webhook-id that no obligation has"
    recovered = 0
    for msg_id, (state, _last_status, _ambiguous) in rows.items():
        got = by_id.get(msg_id, [])
        if state == "delivered":
            assert any(r.get("status") == 204 for r, _ in got), f"{msg_id} never got a 2xx"
        # Redeliveries carry one payload (the recovered flag aside) under one webhook-id.
        payloads = {json.dumps({k: v for k, v in b.items() if k != "recovered"},
                               sort_keys=True) for _, b in got}
        assert len(payloads) <= 1, f"{msg_id} changed its payload between attempts"
        recovered += sum(1 for _, b in got if b.get("recovered"))
    assert recovered >= 1, "an ambiguous attempt is redelivered with recovered: true"
    incomplete = sum(1 for r in received if not r["complete"])
    print(f"kills={kills} obligations={dict(states)} requests={len(received)} "
          f"recovered={recovered} incomplete={incomplete}")
    assert incomplete <= kills, "only a killed sender leaves a request unfinished"
    # Each run's ten deliveries were made once, whatever the body re-ran after a kill.
    per_run = ledger.query("SELECT COUNT(*) FROM obligations WHERE kind = 'deliver' "
                           "GROUP BY run_id")
    assert per_run == [(10,)] * 100


def internal_name() -> tuple[str, set[str]]:
    """A host name admission accepts (it is not an address, nor localhost) that resolves
    only to addresses delivery refuses: this machine's own name, as /etc/hosts or DNS
    gives it (127.0.1.1 on Debian, the container's private address in Docker)."""
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, 80, 0, socket.SOCK_STREAM)
    except OSError:
        pytest.skip(f"this machine's name {host!r} does not resolve")
    addresses = {info[4][0] for info in infos}
    if netguard.callback_refusal(f"http://{host}/") is not None or not all(
            netguard.target_refused(ipaddress.ip_address(a)) for a in addresses):
        pytest.skip(f"{host!r} ({addresses}) is not a name for an internal address")
    return host, addresses


def test_a_delivery_error_shown_to_api_clients_never_names_an_internal_address(make_system,
                                                                             ledger):
    host, addresses = internal_name()
    fast = {name: value for name, value in FAST.items() if name != "RUNSTILE_CALLBACK_ALLOWLIST"}
    system = make_system(workers=1, threads=2, **fast)
    api = Api(system, ledger.key(), ledger)
    rid = api.post_run({"task": "echo", "callback_url": f"http://{host}:9/hook"}).json()["id"]
    [delivery] = wait_until(lambda: [d for d in deliveries(api, rid) if d["last_error"]],
                            15, 0.05, "the refused delivery attempt")
    assert host in delivery["last_error"] and "non-public" in delivery["last_error"]
    assert not any(address in delivery["last_error"] for address in addresses), delivery
    assert not any(address in json.dumps(deliveries(api, rid)) for address in addresses)
