"""The dashboard in a real browser (docs/dashboard.md): headless Chromium against a real
``runstile up`` (two web processes, a worker process), each test with keys of its own.

The same tests leave the screenshots docs/dashboard.md shows in docs/img/.
"""

from __future__ import annotations

import re

import pytest

from runstile.ledger import keys
from tests.conftest import Api, System, new_ledger, wait_for_status, wait_until
from tests.receiver import answer_with
from tests.ui.browser import Browser, cookie_payload, require_chromium, start_driver


@pytest.fixture(scope="module")
def ui_ledger(tmp_path_factory):
    with new_ledger(tmp_path_factory.mktemp("ui")) as made:
        yield made


@pytest.fixture(scope="module")
def system(ui_ledger):
    require_chromium()
    # Two web processes: a cookie signed by one must be good at the other.  A short stop
    # grace, and deliveries to loopback that park after two quick attempts.
    env = {"RUNSTILE_STOP_GRACE_S": "1", "RUNSTILE_CALLBACK_ALLOWLIST": "127.0.0.1",
           "RUNSTILE_DELIVERY_MAX_ATTEMPTS": "2", "RUNSTILE_DELIVERY_BACKOFF_S": "0.05",
           "RUNSTILE_DELIVERY_BACKOFF_MAX_S": "0.1"}
    started = System(ui_ledger.data_dir, env, web_workers=2, workers=1, threads=4).start()
    yield started
    started.kill()


@pytest.fixture(scope="module")
def driver(system):
    started = start_driver()
    yield started
    started.quit()


@pytest.fixture
def browser(driver, system, tmp_path) -> Browser:
    driver.delete_all_cookies()
    return Browser(driver, system.url, tmp_path / "screenshots")


def client(system, ledger, *, admin: bool = False, profile: str = "default") -> Api:
    return Api(system, ledger.key(profile, admin=admin), ledger)


def admit(api: Api, task: str, input_: object = None, **fields) -> str:
    answer = api.post_run({"task": task, "input": input_, **fields})
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def test_signing_in_keeps_only_the_key_id_in_a_strict_http_only_cookie(browser, system,
                                                                       ui_ledger):
    api = client(system, ui_ledger)
    run_id = admit(api, "echo", {"hello": "browser"})
    wait_for_status(api, run_id)
    browser.open("/")
    assert browser.driver.current_url.endswith("/ui/login") and "Sign in" in browser.driver.title
    browser.one("[data-testid='api-key']").send_keys("rsk_0000000000000000_" + "x" * 43)
    browser.one("[data-testid='sign-in']").click()
    assert "not valid" in wait_until(lambda: browser.text("[data-testid='login-error']"), 10,
                                     0.05, "the refusal")
    browser.sign_in(api.key)
    rows = browser.by_testid("run-row")
    assert [r.get_attribute("data-run-id") for r in rows] == [run_id]
    assert browser.status(f"[data-run-id='{run_id}']") == "completed"
    cookie = browser.session_cookie()
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert api.key.secret not in cookie["value"]
    assert cookie_payload(cookie["value"])["key_id"] == api.key.key_id
    # The random part is the last 43 characters; it may itself hold "_", so no split("_").
    assert api.key.secret[-43:] not in str(cookie_payload(cookie["value"]))
    # The page as a client without JavaScript reads it: the same rows and statuses.
    answer = browser.requests_session().get(f"{system.url}/ui/runs", timeout=10)
    assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]
    assert answer.headers["Cache-Control"] == "no-store"
    plain = answer.text
    assert f'data-run-id="{run_id}"' in plain
    assert re.search(r'data-testid="run-status" data-status="completed"[^>]*>completed<', plain)
    # The viewer's zone in the text, UTC on hover.
    stamp = browser.one(f"[data-run-id='{run_id}'] time")
    assert stamp.get_attribute("title").endswith(" UTC") and "UTC" not in stamp.text


def test_a_running_run_turns_completed_on_both_pages_without_a_reload(browser, system,
                                                                      ui_ledger, tmp_path):
    api = client(system, ui_ledger)
    release = {name: tmp_path / f"release-{name}" for name in ("list", "page")}
    runs = {name: admit(api, "t.steps", {"log": str(tmp_path / "log"),
                                         "release": str(path)},
                        metadata={"view": name})
            for name, path in release.items()}
    browser.sign_in(api.key)
    for run_id in runs.values():
        browser.wait_status("running", f"[data-run-id='{run_id}']")
    browser.mark()
    release["list"].touch()
    browser.wait_status("completed", f"[data-run-id='{runs['list']}']")
    assert browser.still_marked(), "the runs page reloaded instead of updating in place"
    assert browser.status(f"[data-run-id='{runs['page']}']") == "running"

    browser.open(f"/ui/runs/{runs['page']}")
    browser.wait_status("running")
    assert browser.by_testid("action-stop") and not browser.by_testid("action-retry")
    browser.mark()
    release["page"].touch()
    browser.wait_status("completed")
    assert browser.still_marked(), "the run page reloaded instead of updating in place"
    wait_until(lambda: "run.completed" in browser.text("[data-testid='timeline']"), 10,
               0.1, "the timeline to show run.completed")
    assert [r.text.split()[1] for r in browser.by_testid("step-row")] == ["first", "second"]
    assert not browser.by_testid("action-stop"), "a completed run offers no stop"
    browser.screenshot("run.png")


def test_stop_on_the_run_page_cancels_a_running_run(browser, system, ui_ledger, tmp_path):
    api = client(system, ui_ledger)
    run_id = admit(api, "t.hold", {"log": str(tmp_path / "log"), "ticks": 600})
    browser.sign_in(api.key)
    browser.open(f"/ui/runs/{run_id}")
    browser.wait_status("running")
    browser.click("action-stop")
    assert "Stop" in browser.notice()
    browser.wait_status("cancelled", timeout_s=20)
    assert api.get(f"/v1/runs/{run_id}").json()["status"] == "cancelled"
    assert browser.by_testid("action-retry"), "a cancelled run can be retried"


def test_approve_on_the_run_page_lets_the_run_finish(browser, system, ui_ledger, tmp_path):
    api = client(system, ui_ledger)
    log = tmp_path / "log"
    run_id = admit(api, "t.approval", {"log": str(log), "n": 7})
    browser.sign_in(api.key)
    browser.open(f"/ui/runs/{run_id}")
    browser.wait_status("waiting_for_approval")
    assert browser.by_testid("action-deny")
    browser.click("action-approve")
    assert "Approved" in browser.notice()
    browser.wait_status("completed")
    assert api.get(f"/v1/runs/{run_id}").json()["result"] == {"published": True}
    assert log.read_text().count(f"call publish {run_id}") == 1


def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(browser, system,
                                                                      ui_ledger, tmp_path):
    api = client(system, ui_ledger)
    run_id = admit(api, "t.hold", {"log": str(tmp_path / "log"), "ticks": 600})
    wait_for_status(api, run_id, ("running",))
    browser.sign_in(api.key)
    browser.open(f"/ui/runs/{run_id}")
    # The browser's own form, its token taken out.
    browser.driver.execute_script(
        "document.querySelectorAll(\"input[name='csrf_token']\").forEach(e => e.remove());")
    browser.click("action-stop")
    browser.wait_title("Request refused")
    assert "nothing was changed" in browser.by_testid("error-message")[0].text
    # The session's cookie with no token, and with a wrong one.
    http = browser.requests_session()
    for form in ({}, {"csrf_token": "not-the-token"}):
        refused = http.post(f"{system.url}/ui/runs/{run_id}/stop", data=form, timeout=10,
                            allow_redirects=False)
        assert refused.status_code == 403
    assert http.get(f"{system.url}/ui/runs/{run_id}", timeout=10).status_code == 200
    events = api.get(f"/v1/runs/{run_id}/events",
                     headers={"Accept": "application/json"}).json()["data"]
    assert [e["type"] for e in events] == ["run.queued", "run.started"]
    assert api.get(f"/v1/runs/{run_id}").json()["status"] == "running"
    api.post(f"/v1/runs/{run_id}/stop")  # free the worker thread for the next tests


def test_a_second_key_sees_none_of_the_first_keys_runs(browser, system, ui_ledger, receiver):
    first = client(system, ui_ledger)
    hook = receiver(answer_with(500))
    theirs = [admit(first, "echo", {"n": n}, callback_url=hook.url()) for n in range(3)]
    for run_id in theirs:
        wait_for_status(first, run_id)
    [parked] = wait_until(lambda: [d for d in first.get(f"/v1/runs/{theirs[0]}/deliveries")
                                   .json()["data"] if d["state"] == "parked"], 30, 0.1,
                          "a parked delivery of the first key's")
    browser.sign_in(first.key)  # what the first key sees, for contrast
    browser.open("/ui/deliveries")
    assert parked["id"] in {r.get_attribute("data-delivery-id")
                            for r in browser.by_testid("delivery-row")}
    for other in (client(system, ui_ledger), client(system, ui_ledger, admin=True,
                                                    profile="elsewhere")):
        browser.sign_in(other.key)
        assert browser.by_testid("run-row") == [] and browser.by_testid("no-runs")
        browser.open(f"/ui/runs/{theirs[0]}")
        assert browser.driver.title.startswith("Not found")
        assert not browser.by_testid("action-stop") and not browser.by_testid("action-retry")
        browser.open("/ui/no-such-page")
        assert browser.driver.title.startswith("Not found")
        http = browser.requests_session()
        ids = "&".join(f"id={run_id}" for run_id in theirs)
        assert http.get(f"{system.url}/ui/live/statuses?{ids}", timeout=10).json() == {"runs": {}}
        assert http.get(f"{system.url}/ui/live/runs/{theirs[0]}", timeout=10).status_code == 404
        every_state = "&".join(f"state={s}" for s in ("pending", "attempting", "parked",
                                                       "delivered", "discarded"))
        browser.open(f"/ui/deliveries?{every_state}")
        assert browser.by_testid("delivery-row") == [] and browser.by_testid("no-deliveries")
        # Its own valid form token, aimed at the first key's delivery: not found, unchanged.
        token = browser.one("input[name='csrf_token']").get_attribute("value")
        refused = http.post(f"{system.url}/ui/deliveries/{parked['id']}/retry",
                            data={"csrf_token": token}, timeout=10, allow_redirects=False)
        assert refused.status_code == 404 and "no such delivery" in refused.text
        assert first.get(f"/v1/runs/{theirs[0]}/deliveries").json()["data"][0] == parked


def test_a_revoked_key_is_signed_out_at_its_next_request(browser, system, ui_ledger):
    api = client(system, ui_ledger)
    browser.sign_in(api.key)
    assert browser.by_testid("signed-in-key")[0].text == api.key.key_id
    http = browser.requests_session()
    conn = ui_ledger.connect()
    try:
        assert keys.revoke(conn, api.key.key_id)
    finally:
        conn.close()
    browser.open("/ui/runs")
    assert browser.driver.title.startswith("Sign in")
    assert "signed out" in browser.notice()
    assert not [c for c in browser.driver.get_cookies() if c["name"] == "runstile_ui"
                and "key_id" in cookie_payload(c["value"])]
    # The old cookie, replayed by hand, opens nothing either.
    replayed = http.get(f"{system.url}/ui/runs", timeout=10, allow_redirects=False)
    assert replayed.status_code == 302 and "/ui/login" in replayed.headers["Location"]
    assert http.get(f"{system.url}/ui/live/statuses", timeout=10).status_code == 401


def test_a_parked_delivery_is_retried_from_the_deliveries_page(browser, system, ui_ledger,
                                                               receiver):
    api = client(system, ui_ledger)
    hook = receiver(answer_with(500))
    run_id = admit(api, "echo", {"deliver": "me"}, callback_url=hook.url())

    def parked():
        rows = api.get(f"/v1/runs/{run_id}/deliveries").json()["data"]
        return rows if rows and rows[0]["state"] == "parked" else None
    [delivery] = wait_until(parked, 30, 0.1, "the callback to park")
    browser.sign_in(api.key)
    browser.open("/ui/deliveries")
    [row] = browser.by_testid("delivery-row")
    assert row.get_attribute("data-delivery-id") == delivery["id"] and "parked" in row.text
    assert "HTTP 500" in row.text
    browser.screenshot("deliveries.png")
    attempts = len(hook.received())
    row.find_element("css selector", "[data-testid='delivery-retry']").click()
    assert "Re-armed" in browser.notice()
    wait_until(lambda: len(hook.received()) > attempts, 15, 0.1, "a fresh attempt")
    rearmed = api.get(f"/v1/runs/{run_id}/deliveries").json()["data"][0]
    assert rearmed["settled_by"] == f"key:{api.key.key_id}"


def test_an_admin_key_sees_every_run_of_its_profile_and_the_recovery_page(browser, system,
                                                                          ui_ledger, tmp_path):
    clients = [client(system, ui_ledger) for _ in range(2)]
    mine = [admit(c, task, {"n": n}, session_key=f"customer-{n}")
            for n, (c, task) in enumerate(zip(clients, ("echo", "fail"), strict=True))]
    for c, run_id in zip(clients, mine, strict=True):
        wait_for_status(c, run_id)
    # Two that are still going, for the screenshot's sake.
    log = str(tmp_path / "log")
    going = [admit(clients[0], "t.approval", {"log": log, "n": 1}, metadata={"team": "ops"}),
             admit(clients[1], "t.hold", {"log": log, "ticks": 600}, session_key="customer-1")]
    wait_for_status(clients[0], going[0], ("waiting_for_approval",))
    wait_for_status(clients[1], going[1], ("running",))
    admin = client(system, ui_ledger, admin=True)
    browser.sign_in(admin.key)
    shown = {r.get_attribute("data-run-id") for r in browser.by_testid("run-row")}
    assert set(mine) <= shown
    browser.open("/ui/runs?status=failed")
    assert {browser.status(f"[data-run-id='{r.get_attribute('data-run-id')}']")
            for r in browser.by_testid("run-row")} == {"failed"}
    browser.open("/ui/recovery")
    assert browser.driver.title.startswith("Recovery")
    assert "boot" in browser.one("[data-testid='recovery-table']").text
    browser.open("/ui/health")
    assert re.fullmatch(r"\d+", browser.by_testid("generation")[0].text)
    assert browser.by_testid("workers-table"), "the worker process's consumers"
    browser.open("/ui/runs")
    browser.screenshot("runs.png")
    for c, run_id in zip(clients, going, strict=True):
        c.post(f"/v1/runs/{run_id}/stop")
    # A client key has no recovery page (404, as GET /v1/recovery).
    browser.sign_in(clients[0].key)
    browser.open("/ui/recovery")
    assert browser.driver.title.startswith("Not found")
    browser.open("/ui/health")
    assert browser.by_testid("generation") and not browser.by_testid("workers-table")


def test_the_dashboard_renders_hostile_text_as_text(browser, system, ui_ledger):
    api = client(system, ui_ledger)
    hostile = "<script>window.__owned = true</script><img src=x onerror='window.__owned=1'>"
    run_id = admit(api, "echo", {"x": hostile}, metadata={"label": hostile},
                   session_key=hostile)
    wait_for_status(api, run_id)
    browser.sign_in(api.key)
    browser.open(f"/ui/runs/{run_id}")
    assert hostile in browser.one("#io-h").find_element("xpath", "..").text
    assert browser.driver.execute_script("return window.__owned === undefined;") is True
