"""Bearer keys and the service routes.

See docs/api.md, "Authentication", and the service routes' sections of docs/api.md:
"`GET /v1/capabilities`", "`GET /healthz`", "`GET /readyz`", "`GET /metrics`" and
"`GET /openapi.json`".
"""

from __future__ import annotations

import re

import pytest
import requests

from runstile.cli import main as cli_main


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer nope",
                                    "Bearer rsk_0123456789abcdef_" + "A" * 43,
                                    "Token rsk_0123456789abcdef_" + "A" * 43])
def test_missing_malformed_or_unknown_keys_get_a_bare_401(shared_server, header):
    headers = {} if header is None else {"Authorization": header}
    for method, path in [("get", "/v1/runs"), ("post", "/v1/runs"),
                         ("get", "/v1/capabilities"), ("get", "/v1/runs/run_" + "0" * 32)]:
        response = getattr(requests, method)(shared_server.url + path, headers=headers, timeout=10)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "unauthorized"
        assert set(response.json()["error"]) == {"code", "message"}


def test_revocation_takes_effect_on_the_next_request(api):
    assert api.get("/v1/runs").status_code == 200
    assert cli_main(["keys", "revoke", api.key.key_id, "--data-dir",
                     str(api.ledger.data_dir)]) == 0
    assert api.get("/v1/runs").status_code == 401


def test_rotation_keeps_the_key_id_runs_and_records(api, capsys):
    rid = api.post_run({"task": "echo"}, idempotency_key="rot-1").json()["id"]
    assert cli_main(["keys", "rotate", api.key.key_id, "--json", "--data-dir",
                     str(api.ledger.data_dir)]) == 0
    import json
    rotated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rotated["key_id"] == api.key.key_id
    assert api.get("/v1/runs").status_code == 401  # the old secret is dead
    api.key.secret = rotated["secret"]
    assert api.get(f"/v1/runs/{rid}").status_code == 200
    replay = api.post_run({"task": "echo"}, idempotency_key="rot-1")
    assert replay.json()["replayed"] is True and replay.json()["id"] == rid


def test_health_readiness_and_metrics_need_no_key_but_openapi_does(shared_server):
    for path in ["/healthz", "/readyz", "/metrics"]:
        assert requests.get(shared_server.url + path, timeout=10).status_code == 200, path
    assert requests.get(shared_server.url + "/openapi.json", timeout=10).status_code == 401
    ready = requests.get(shared_server.url + "/readyz", timeout=10).json()
    assert ready["checks"] == {"ledger": True, "migrated": True, "recovered": True}


def test_metrics_count_admission_outcomes_across_processes(api):
    for _ in range(6):
        api.post_run({"task": "echo"})
    api.post_run({"task": "nope"})
    text = requests.get(api.server.url + "/metrics", timeout=10).text
    created = float(re.search(r'runstile_admissions_total\{outcome="created"\} (\S+)', text)[1])
    unknown = float(re.search(r'runstile_admissions_total\{outcome="unknown_task"\} (\S+)',
                              text)[1])
    assert created >= 6 and unknown >= 1
    assert "runstile_admission_seconds_bucket" in text


def test_capabilities_describe_the_contract(api):
    caps = api.get("/v1/capabilities").json()
    assert caps["run_id_pattern"] == "run_[0-9a-f]{32}"
    assert caps["durable"] is True
    assert caps["idempotency"]["header"] == "Idempotency-Key"
    assert caps["idempotency"]["replay_header"] == "Idempotency-Replayed"
    assert caps["idempotency"]["fingerprint_version"] == 1
    assert caps["idempotency"]["retention_s"] == 7 * 24 * 3600
    assert caps["idempotency"]["tombstone_s"] == 30 * 24 * 3600
    assert {"echo", "progress", "chat", "steps", "fail", "slow"} <= set(caps["tasks"])
    assert set(caps["terminal_statuses"]) == {"completed", "failed", "cancelled", "interrupted"}
    assert "queued" in caps["statuses"]
    assert caps["events"]["resumable"] is True
    assert isinstance(caps["node"]["generation"], int)
    assert caps["webhooks"]["max_attempts"] == 12 and caps["webhooks"]["follows_redirects"] is False


def test_openapi_covers_every_route_the_app_serves(api):
    from runstile.config import Settings
    from runstile.web import create_app
    shared_server = api.server
    doc = api.get("/openapi.json").json()
    app = create_app(Settings(data_dir=shared_server.data_dir))
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.startswith("ui."):
            continue  # the dashboard's HTML pages are not the API (docs/dashboard.md)
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            served.add((path, method.lower()))
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented


def test_unknown_routes_and_methods_answer_in_the_error_shape(api):
    missing = api.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = requests.delete(api.server.url + "/v1/runs", headers=api.key.headers, timeout=10)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "Raised when" not in wrong.text + missing.text


def test_the_api_never_reads_or_sets_the_dashboard_session_cookie(api):
    # The dashboard's pages have a signed session (its CSRF token, its sign-in); API
    # routes get Flask's null session, so they cannot write one even by mistake.
    login = requests.get(api.server.url + "/ui/login", timeout=10)
    cookie = login.cookies.get("runstile_ui")
    assert login.status_code == 200 and cookie
    sent = {"Cookie": f"runstile_ui={cookie}"}
    run = api.post_run({"task": "echo"}, headers=sent)
    listing = api.get("/v1/runs", headers=sent)
    capabilities = api.get("/v1/capabilities", headers=sent)
    for response in (run, listing, capabilities):
        assert response.status_code in (200, 202), response.text
        assert "Set-Cookie" not in response.headers
    again = requests.get(api.server.url + "/ui/login", headers=sent, timeout=10)
    assert again.status_code == 200 and "Set-Cookie" not in again.headers  # same session
