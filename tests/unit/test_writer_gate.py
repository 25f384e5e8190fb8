"""The writer gate (runstile/ledger/db_gate.py): between processes, a writer waits for the
flock in the kernel, and a wait past its timeout is a 503 that leaves nothing held.

The other writer is a real process holding ``<ledger>-writer.lock`` until told to let go."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from runstile.errors import LedgerUnavailable
from runstile.ledger.db_gate import WriterGate

from ..conftest import wait_until

#: Holds the flock until a line arrives on stdin, then exits (which would free it too).
_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
fcntl.flock(fd, fcntl.LOCK_UN)
print("released", flush=True)
sys.stdin.readline()
"""


class Holder:
    """Another process holding the gate's flock."""

    def __init__(self, lock_path: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, lock_path], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _can_take(lock_path: str) -> bool:
    """Whether yet another process can take the flock at once (and lets it go)."""
    probe = ("import fcntl, os, sys\n"
             "fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try:\n"
             "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n"
             "    sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", probe, lock_path], timeout=30).returncode == 0


@pytest.fixture
def gate(tmp_path):
    return WriterGate(str(tmp_path / "ledger.db"))


def test_a_writer_waiting_on_another_process_enters_once_it_lets_go(gate):
    holder = Holder(gate.lock_path)
    entered, leave = threading.Event(), threading.Event()

    def writer():
        with gate.held(30):
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=writer)
    try:
        thread.start()
        assert not entered.wait(0.5)  # never while the other process holds it
        holder.release()
        assert entered.wait(30)
        assert not _can_take(gate.lock_path)  # this process holds it now
        leave.set()
        thread.join(30)
        assert _can_take(gate.lock_path)
    finally:
        leave.set()
        holder.close()


def test_waits_past_their_timeout_are_ledger_unavailable_and_leave_nothing_held(gate):
    holder = Holder(gate.lock_path)
    try:
        # Several abandoned waits in a row: each is granted later and let go at once.
        for _ in range(3):
            with pytest.raises(LedgerUnavailable):
                with gate.held(0.1):
                    pytest.fail("entered a gate another process holds")
        holder.release()
        wait_until(lambda: _can_take(gate.lock_path), 30, 0.05,
                   "the flock free again after the abandoned waits")
        with gate.held(5):
            assert not _can_take(gate.lock_path)
        assert _can_take(gate.lock_path)
    finally:
        holder.close()


def test_threads_of_one_process_take_turns_and_each_enters_once(gate):
    holder = Holder(gate.lock_path)
    inside, entries, overlaps = [0], [], []
    guard = threading.Lock()

    def writer(n):
        with gate.held(30):
            with guard:
                inside[0] += 1
                overlaps.append(inside[0] > 1)
            entries.append(n)
            with guard:
                inside[0] -= 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        holder.release()
        for t in threads:
            t.join(30)
        assert sorted(entries) == list(range(8)) and not any(overlaps)
        assert _can_take(gate.lock_path)
    finally:
        holder.close()
