"""The dashboard's session-signing key (docs/configuration.md, "Other environment
variables"): one per data directory, whoever creates it first, private, and stable."""

from __future__ import annotations

import stat
import subprocess
import sys

from runstile.web.ui.secret import FILE_NAME, session_secret
from tests.conftest import ROOT


def test_web_processes_starting_at_once_all_sign_with_the_one_key_the_first_wrote(tmp_path):
    data_dir = tmp_path / "data"
    code = ("import sys; from runstile.web.ui.secret import session_secret; "
            "print(session_secret(sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(data_dir)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(keys) == 1 and len(next(iter(keys))) == 64
    assert session_secret(data_dir) in keys, "a restart reads the same key"
    path = data_dir / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in data_dir.iterdir()) == [FILE_NAME], "no candidate left"


def test_another_data_directory_gets_a_key_of_its_own(tmp_path):
    assert session_secret(tmp_path / "a") != session_secret(tmp_path / "b")
