"""Headless Chromium for the dashboard's tests: Debian's ``chromium`` and
``chromium-driver``, driven through Selenium with the driver's path given, so nothing
is downloaded at test time (Selenium Manager never runs).

Absent binaries skip the tests with the command that installs them, and fail them
when CI is set (README.md, "Tests").
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, Key, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: Where the tests leave the screenshots docs/dashboard.md shows: docs/img/ when
#: RUNSTILE_SCREENSHOTS=docs (``make screenshots``), so that an ordinary test run never
#: rewrites tracked files; a temporary folder otherwise (the screenshots are still taken,
#: so the code that takes them cannot rot).
SCREENSHOTS_TO_DOCS = os.environ.get("RUNSTILE_SCREENSHOTS") == "docs"
TIME_ZONE = "Europe/Paris"


def require_chromium() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if not missing:
        return
    message = (f"the dashboard's browser tests need {' and '.join(missing)}: "
               "apt-get install -y chromium chromium-driver")
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set, so this is a failure, not a skip)")
    pytest.skip(message)


def start_driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,900", "--hide-scrollbars", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--lang=en-GB"):
        options.add_argument(arg)
    # A viewer whose zone is not UTC: the pages must show times in it.
    service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "TZ": TIME_ZONE})
    return webdriver.Chrome(options=options, service=service)


class Browser:
    """One Chromium window on one dashboard."""

    def __init__(self, driver, base_url: str, scratch: Path) -> None:
        self.driver, self.base_url = driver, base_url
        self.scratch = scratch  # where screenshots go unless they are for docs/

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def by_testid(self, testid: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_elements(By.CSS_SELECTOR, f"[data-testid='{testid}']")

    def one(self, css: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def sign_in(self, key: Key) -> None:
        self.driver.delete_all_cookies()
        self.open("/ui/login")
        self.one("[data-testid='api-key']").send_keys(key.secret)
        self.one("[data-testid='sign-in']").click()
        wait_until(lambda: self.driver.title.startswith("Runs"), 10, 0.05, "the runs page")

    def wait_title(self, prefix: str) -> None:
        wait_until(lambda: self.driver.title.startswith(prefix), 10, 0.05,
                   f"a page titled {prefix!r} (it is {self.driver.title!r})")

    def notice(self) -> str:
        """The notice the page shows after a button's POST (waiting for its page)."""
        return str(wait_until(lambda: self.text("[data-testid='notice']"), 10, 0.05,
                              "a notice"))

    # The run page swaps its main part in place when the run moves (ui.js), so an
    # element found a moment ago may be gone: read and click by selector, in one go.
    def text(self, css: str) -> str | None:
        return self.driver.execute_script(
            "var e = document.querySelector(arguments[0]); return e && e.innerText;", css)

    def click(self, testid: str) -> None:
        from selenium.common.exceptions import StaleElementReferenceException

        def clicked() -> bool:
            try:
                self.by_testid(testid)[0].click()
            except StaleElementReferenceException:
                return False
            return True
        wait_until(clicked, 10, 0.05, f"a click on {testid}")

    def status(self, css: str = "body") -> str | None:
        return self.driver.execute_script(
            "var e = document.querySelector(arguments[0]);"
            "return e && e.getAttribute('data-status');", f"{css} [data-testid='run-status']")

    def wait_status(self, wanted: str, css: str = "body", timeout_s: float = 30) -> None:
        wait_until(lambda: self.status(css) == wanted, timeout_s, 0.1,
                   f"the page to show {wanted} (it shows {self.status(css)})")

    def mark(self) -> None:
        """A marker in the page's JavaScript state: a reload would lose it."""
        self.driver.execute_script("window.__notReloaded = true;")

    def still_marked(self) -> bool:
        return self.driver.execute_script("return window.__notReloaded === true;") is True

    def session_cookie(self) -> dict:
        [cookie] = [c for c in self.driver.get_cookies() if c["name"] == "runstile_ui"]
        return cookie

    def requests_session(self) -> requests.Session:
        """A plain HTTP client holding the browser's session cookie (and nothing else)."""
        session = requests.Session()
        session.cookies.set("runstile_ui", self.session_cookie()["value"], path="/ui")
        return session

    def screenshot(self, name: str) -> Path:
        folder = ROOT / "docs" / "img" if SCREENSHOTS_TO_DOCS else self.scratch
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        height = self.driver.execute_script("return document.documentElement.scrollHeight")
        self.driver.set_window_size(1360, max(700, min(int(height) + 20, 1600)))
        try:
            self.driver.save_screenshot(str(path))
        finally:
            self.driver.set_window_size(1360, 900)
        return path


def cookie_payload(value: str) -> dict:
    """What a Flask session cookie carries: its signed (not encrypted) JSON payload."""
    compressed = value.startswith(".")
    data = value.lstrip(".").split(".")[0]
    raw = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
    return json.loads(zlib.decompress(raw) if compressed else raw)
