"""Whether a process has exited (runstile/processes.py): a zombie has."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from runstile import processes
from tests.conftest import wait_until


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_a_running_process_has_not_exited_and_a_reaped_one_has():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not processes.exited(child.pid)
        assert not processes.exited(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert processes.exited(child.pid)


def test_a_killed_process_its_parent_has_not_reaped_yet_has_exited():
    """What os.kill(pid, 0) gets wrong: a zombie still answers it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: state(child.pid) == "Z", 10, 0.01, "the child to be a zombie")
        os.kill(child.pid, 0)  # no error: the kernel still has the process
        assert processes.exited(child.pid)
    finally:
        child.wait()
