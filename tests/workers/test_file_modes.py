"""Only the user running runstile may open its files (docs/operations.md, "File modes").

The ledger holds every tenant's data and the webhook signing secrets; a lock file that
another user can open (read-only is enough) can be flocked by them, and admissions then
answer 503.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, RUNSTILE, Api, Key, System, wait_for_status, wait_until


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def umask_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration):
        return None  # gone meanwhile
    return int(line.split()[1], 8)


def group_members(pgid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def runstile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RUNSTILE, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_up_and_db_backup_create_the_data_dir_0700_and_every_file_0600(tmp_path):
    data_dir = tmp_path / "data"  # runstile up creates it
    # A umask that lets others read (the common default): runstile must not rely on it.
    old_umask = os.umask(0o022)
    try:
        system = System(data_dir, {}, web_workers=1, workers=1, threads=2).start()
    finally:
        os.umask(old_umask)
    try:
        secret = wait_until(lambda: re.search(r"rsk_[0-9a-f]{16}_[A-Za-z0-9_-]{43}",
                                              system.log()), 30, 0.05, "the bootstrap key")[0]
        api = Api(system, Key("bootstrap", secret, "default", "admin"))
        run = api.post_run({"task": "echo", "input": {"card": "4111"}}).json()
        assert wait_for_status(api, run["id"])["status"] == "completed"
        backup = tmp_path / "backups" / "ledger.db"
        assert runstile("db", "backup", "--data-dir", str(data_dir), str(backup)).returncode == 0

        names = sorted(os.listdir(data_dir))
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm", "ledger.db-writer.lock"):
            assert name in names
        assert any(name.startswith("node-") and name.endswith(".lock") for name in names)
        assert {name: oct(mode(data_dir / name)) for name in names} == \
            {name: oct(0o600) for name in names}
        assert oct(mode(data_dir)) == oct(0o700)
        assert oct(mode(backup)) == oct(0o600)
        assert oct(mode(backup.parent)) == oct(0o700)
        # Supervisor, gunicorn master and worker, admission writer, worker process.
        umasks = {pid: umask_of(pid) for pid in group_members(system.proc.pid)}
        assert len(umasks) >= 5
        assert {pid: m for pid, m in umasks.items() if m not in (None, 0o077)} == {}
    finally:
        system.kill()


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, user="nobody", group="nogroup", stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=30)


@pytest.fixture
def world_readable_parent():
    """A directory every user may enter, as a data directory's parent often is (pytest's
    own temporary directories are private, which would hide the data directory's mode)."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    parent = Path(tempfile.mkdtemp(prefix="runstile-modes-"))
    parent.chmod(0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


def test_another_local_user_can_neither_read_the_ledger_nor_take_its_locks(
        world_readable_parent):
    data_dir = world_readable_parent / "data"
    old_umask = os.umask(0o022)
    try:
        system = System(data_dir, {}, web_workers=1, workers=1, threads=2).start()
    finally:
        os.umask(old_umask)
    try:
        wait_until(lambda: "rsk_" in system.log(), 30, 0.05, "the bootstrap key")
        for name in ("ledger.db", "ledger.db-wal"):
            read = as_nobody("cat", str(data_dir / name))
            assert read.returncode != 0 and "Permission denied" in read.stderr, name
        locks = [data_dir / "ledger.db-writer.lock", *data_dir.glob("node-*.lock")]
        assert len(locks) == 2
        for lock in locks:
            # flock(1) opens the file read-only and holds the lock: the attack on
            # admissions (every POST /v1/runs waits for the writer lock, then 503s).
            held = as_nobody("flock", "--nonblock", str(lock), "true")
            assert held.returncode != 0 and "Permission denied" in held.stderr, lock.name
    finally:
        system.kill()


def test_db_check_warns_about_a_data_dir_and_files_other_users_may_open(ledger):
    clean = runstile("db", "check", "--data-dir", str(ledger.data_dir), "--json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout.splitlines()[-1])["warnings"] == []

    os.chmod(ledger.data_dir, 0o755)
    os.chmod(ledger.path, 0o644)
    report = runstile("db", "check", "--data-dir", str(ledger.data_dir), "--json")
    assert report.returncode == 0, "a warning, not a broken ledger"
    warnings = json.loads(report.stdout.splitlines()[-1])["warnings"]
    assert any(str(ledger.data_dir) in w and "0755" in w for w in warnings), warnings
    assert any(str(ledger.path) in w and "0644" in w for w in warnings), warnings

    text = runstile("db", "check", "--data-dir", str(ledger.data_dir))
    assert f"WARNING: {ledger.data_dir} has mode 0755" in text.stdout
