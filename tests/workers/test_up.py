"""`runstile up` as a newcomer meets it: one command, a key, a demo run, a clean Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import (
    ROOT,
    free_port,
    is_writer,
    running_in_group,
    wait_until,
    writer_listening,
)


def start_up(tmp_path, port, command=(sys.executable, "-m", "runstile"), cwd=ROOT):
    log = tmp_path / "up.log"
    proc = subprocess.Popen([*command, "up", "--data-dir",
                             str(tmp_path / "data"), "--port", str(port), "--workers", "2",
                             "--threads", "2", "--web-workers", "1"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd)
    key = wait_until(lambda: re.search(r"rsk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}", log.read_text()),
                     30, 0.05, "the bootstrap key")[0]
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(url), 30, 0.05, "readiness")
    return proc, key, url, log


def _ready(url):
    try:
        return requests.get(url + "/readyz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


@pytest.mark.parametrize("how", ["sigint_to_the_group", "sigterm_three_times_to_the_supervisor"])
def test_up_runs_a_demo_task_and_shuts_down_with_no_orphan(tmp_path, how):
    proc, key, url, log = start_up(tmp_path, free_port())
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        run = requests.post(url + "/v1/runs", json={"task": "chat", "input": {"text": "hi"}},
                            headers=headers, timeout=10).json()
        done = wait_until(lambda: (lambda r: r if r["status"] == "completed" else None)(
            requests.get(url + f"/v1/runs/{run['id']}", headers=headers, timeout=10).json()),
            30, 0.05, "the demo run")
        assert done["result"] == {"reply": "You said: hi"}
        members = running_in_group(proc.pid)
        assert len(members) >= 4, "supervisor, web master + worker, 2 worker processes"
        if how == "sigint_to_the_group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            for _ in range(3):
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.05)
        assert proc.wait(timeout=40) == 0
        wait_until(lambda: not running_in_group(proc.pid), 10, 0.05, "every child to exit")
    finally:
        if proc.poll() is None or running_in_group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in log.read_text()


def test_up_started_beside_another_runstile_folder_runs_the_installed_runstile(tmp_path):
    """The working directory is first on a ``python -m``/``-c`` child's sys.path: a
    ``runstile/`` folder there (a checkout of another version) must not become the code of
    the web processes, the admission writer or the workers while the supervisor runs the
    installed one (they speak one wire format only as the same code)."""
    console = Path(sys.executable).with_name("runstile")
    if not console.exists():
        pytest.skip(f"no runstile console script beside {sys.executable}")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "runstile").mkdir(parents=True)
    (elsewhere / "runstile" / "__init__.py").write_text(
        'raise ImportError("the runstile folder of the working directory was imported")\n')
    proc, key, url, log = start_up(tmp_path, free_port(), command=(str(console),),
                                   cwd=elsewhere)
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        run = requests.post(url + "/v1/runs", json={"task": "chat", "input": {"text": "hi"}},
                            headers=headers, timeout=10)
        assert run.status_code == 202, run.text
        done = wait_until(lambda: (lambda r: r if r["status"] == "completed" else None)(
            requests.get(url + f"/v1/runs/{run.json()['id']}", headers=headers,
                         timeout=10).json()), 30, 0.05, "the demo run")
        assert done["result"] == {"reply": "You said: hi"}
        writers = [pid for pid in running_in_group(proc.pid) if is_writer(pid)]
        assert len(writers) == 1 and writer_listening(writers[0]), writers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=40)
    assert "ImportError" not in log.read_text() and "Traceback" not in log.read_text()
    assert "admission writer did not start" not in log.read_text()


def test_the_bootstrap_key_is_printed_once_and_only_on_first_start(tmp_path):
    port = free_port()
    proc, key, url, log = start_up(tmp_path, port)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=40)
    first = log.read_text()
    assert first.count(key) == 1 and first.count("rsk_") == 1, first
    assert 'Authorization: Bearer $KEY' in first  # the demo command names it, not repeats it
    second = subprocess.Popen([sys.executable, "-m", "runstile", "up", "--data-dir",
                               str(tmp_path / "data"), "--port", str(port), "--workers", "1",
                               "--web-workers", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        wait_until(lambda: _ready(url), 30, 0.05, "second start")
        caps = requests.get(url + "/v1/capabilities",
                            headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
        assert caps["node"]["generation"] == 2
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        out = second.communicate(timeout=40)[0].decode()
    assert "rsk_" not in out


def test_up_from_the_console_script_loads_a_task_module_beside_it(tmp_path):
    (tmp_path / "mytasks.py").write_text(
        "import runstile\n\n@runstile.task('mine.hello')\ndef hello(ctx, input):\n"
        "    return {'hello': input}\n")
    port = free_port()
    script = os.path.join(os.path.dirname(sys.executable), "runstile")
    log = tmp_path / "up.log"
    proc = subprocess.Popen([script, "up", "--data-dir", str(tmp_path / "data"), "--port",
                             str(port), "--workers", "1", "--web-workers", "1", "--tasks",
                             "mytasks"], cwd=tmp_path, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        key = wait_until(lambda: re.search(r"rsk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}",
                                           log.read_text()), 30, 0.05, "the key")[0]
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _ready(url), 30, 0.05, "readiness")
        headers = {"Authorization": f"Bearer {key}"}
        run = requests.post(url + "/v1/runs", json={"task": "mine.hello", "input": 1},
                            headers=headers, timeout=10).json()
        done = wait_until(lambda: (lambda r: r if r["status"] == "completed" else None)(
            requests.get(url + f"/v1/runs/{run['id']}", headers=headers, timeout=10).json()),
            30, 0.05, "the run")
        assert done["result"] == {"hello": 1}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=40)
