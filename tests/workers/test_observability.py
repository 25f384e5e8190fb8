"""What an operator sees of a real ``runstile up`` (docs/operations.md, "Metrics" and
"Logs"; docs/api.md, "`GET /v1/runs/{run_id}/steps` — the step journal" and "Deliveries
(webhooks)"): runs that complete, fail and deliver to a loopback receiver, then the
step journal, the cross-run delivery list, /metrics scraped over HTTP (samples written
by the worker processes and the supervisor's recovery, not only the web's) and every log
line the node printed, as JSON."""

from __future__ import annotations

import json

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Api, wait_for_status, wait_until

TOKEN = "scrape-token-for-tests"
ENV = {"RUNSTILE_CALLBACK_ALLOWLIST": "127.0.0.1", "RUNSTILE_LOG_FORMAT": "json",
       "RUNSTILE_METRICS_TOKEN": TOKEN, "RUNSTILE_RECOVERY_INTERVAL_S": "0.5"}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    answer = requests.get(url + "/metrics", timeout=10,
                          headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(answer.text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def run_node(make_system, ledger, receiver):
    """Two completed runs with steps, one failed run, one run whose callback is delivered."""
    hook = receiver()
    system = make_system(workers=2, threads=2, **ENV)
    api = Api(system, ledger.key("default"), ledger)
    done = [api.post_run({"task": "steps"}).json()["id"] for _ in range(2)]
    failed = api.post_run({"task": "fail"}).json()["id"]
    called = api.post_run({"task": "echo", "input": {"x": 1},
                           "callback_url": hook.url()}).json()["id"]
    for run_id in [*done, failed, called]:
        wait_for_status(api, run_id)
    wait_until(lambda: hook.received(), 20, 0.05, "the callback to arrive")
    wait_until(lambda: api.get("/v1/deliveries", params={"state": "delivered"}).json()["data"],
               20, 0.05, "the delivery to be recorded")
    return system, api, done, failed, called


def test_steps_deliveries_metrics_and_json_logs_of_a_real_node(make_system, ledger, receiver):
    system, api, done, failed, called = run_node(make_system, ledger, receiver)

    steps = api.get(f"/v1/runs/{done[0]}/steps").json()
    assert steps["object"] == "list"
    assert [(s["position"], s["name"], s["state"], s["idempotent"], s["attempt"])
            for s in steps["data"]] == [(1, "fetch", "completed", True, 1),
                                        (2, "record", "completed", False, 1)]
    assert steps["data"][1]["result"] == {"recorded": "https://example.com"}
    assert all(s["started_at"] and s["finished_at"] for s in steps["data"])

    delivered = api.get("/v1/deliveries", params={"state": "delivered"}).json()["data"]
    assert [(d["run_id"], d["state"]) for d in delivered] == [(called, "delivered")]
    assert api.get("/v1/deliveries", params={"state": ["parked", "pending"]}).json()["data"] == []

    # Another client key of the same profile sees neither the steps nor the delivery.
    other = Api(system, ledger.key("default"), ledger)
    assert other.get(f"/v1/runs/{done[0]}/steps").status_code == 404
    assert other.get("/v1/deliveries").json()["data"] == []

    assert_metrics(system.url, done, failed)
    assert_json_logs(system.log(), failed, called)


def assert_metrics(url: str, done: list[str], failed: str) -> None:
    assert requests.get(url + "/metrics", timeout=10).status_code == 401
    wrong = requests.get(url + "/metrics", timeout=10, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    samples = scrape(url)
    assert sample(samples, "runstile_runs_admitted_total", task="steps") == 2
    assert sample(samples, "runstile_runs_admitted_total", task="fail") == 1
    # Written only by the worker processes (the web never finishes a run).
    assert sample(samples, "runstile_runs_finished_total", task="steps", status="completed") == 2
    assert sample(samples, "runstile_runs_finished_total", task="fail", status="failed") == 1
    assert sample(samples, "runstile_runs_finished_total", task="echo", status="completed") == 1
    assert sample(samples, "runstile_queue_wait_seconds_count", task="steps") == 2
    assert sample(samples, "runstile_run_duration_seconds_count", task="fail") == 1
    assert sample(samples, "runstile_deliveries_total", outcome="delivered") == 1
    # The gauges, read from the ledger: nothing is queued or owed any more.
    assert sample(samples, "runstile_runs", status="queued") == 0
    assert sample(samples, "runstile_runs", status="running") == 0
    assert sample(samples, "runstile_deliveries_backlog", state="parked") == 0
    assert ("runstile_deliveries_backlog", (("state", "pending"),)) in samples
    # The supervisor's boot pass (and scheduled ones) are in the same scrape.
    assert sample(samples, "runstile_recovery_pass_seconds_count", trigger="boot") == 1


def assert_json_logs(log: str, failed: str, called: str) -> None:
    lines = [json.loads(line) for line in log.splitlines() if line.strip()]
    assert lines, "the node printed nothing"
    for line in lines:
        assert {"ts", "level", "logger", "message", "node", "pid"} <= set(line), line
    # Every line about the failed run names it; its traceback is in the log line.
    about_failed = [line for line in lines if failed in line["message"]]
    assert about_failed and all(line.get("run_id") == failed for line in about_failed)
    raised = [line for line in about_failed if "traceback" in line]
    assert raised and "ValueError" in raised[0]["traceback"] and raised[0]["task"] == "fail"
    delivery = [line for line in lines if line.get("run_id") == called]
    assert any("delivered" in line["message"] for line in delivery), delivery
    assert any(line["message"].startswith("runstile is up:") for line in lines)


def test_the_step_journal_and_the_delivery_list_refuse_what_they_do_not_know(api):
    rid = api.post_run({"task": "echo"}).json()["id"]
    assert api.get(f"/v1/runs/{rid}/steps").json() == {"object": "list", "data": []}
    missing = api.get(f"/v1/runs/run_{'0' * 32}/steps")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "run_not_found"
    for params, field in [({"state": "lost"}, "state"), ({"limit": "0"}, "limit"),
                          ({"limit": "9" * 3000}, "limit"), ({"run_id": rid}, "run_id"),
                          ({"cursor": "nonsense"}, "cursor")]:
        answer = api.get("/v1/deliveries", params=params)
        assert answer.status_code == 400, (params, answer.text)
        assert answer.json()["error"] == {**answer.json()["error"], "code": "invalid_request",
                                          "field": field}
    page = api.get("/v1/deliveries", params={"state": ["pending", "parked"]}).json()
    assert page == {"object": "list", "data": [], "has_more": False, "next_cursor": None}
