"""Who may open runstile's files: the user running it, and nobody else.

The ledger holds every tenant's inputs and results and the plaintext webhook signing
secrets, and its lock files are taken with ``flock``: another local user who can read
the ledger reads everything, and one who can open a lock file (read-only is enough for
``flock``) can hold it and stop admissions.  So the data directory is created ``0700``,
every file runstile creates ``0600``, and every runstile process runs with umask 077
(what SQLite, gunicorn and the children inherit).  An existing directory or file that
is looser is left as it is, but reported (``runstile db check``, and at start by ``up``,
``worker`` and ``serve``).  See docs/operations.md, "File modes".
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

#: The umask of every runstile process: no bits for group or others.
PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def restrict_umask() -> None:
    """Give this process (and every process it starts from now on) umask 077."""
    os.umask(PRIVATE_UMASK)


def private_dir(path: Path) -> None:
    """Create ``path`` (with missing parents) as ``0700``; an existing one is kept as is."""
    Path(path).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)


def private_file(path: Path | str) -> None:
    """Create ``path`` empty and ``0600`` if it does not exist, whatever the umask.

    Done before SQLite opens a new database: SQLite creates it ``0644`` less the umask
    and gives its WAL, SHM and journal files the database file's mode.  A failure is
    left for the caller's own open to report (say, a missing directory)."""
    if os.path.exists(path):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE))
    except OSError:
        pass


def open_lock(path: Path | str) -> int:
    """Open (creating it ``0600``) a lock file for ``flock``: no other user may open it,
    and so none can hold the lock."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)


def loose(data_dir: Path) -> list[str]:
    """One warning for the data directory if others may enter it, and one for each entry
    in it that others may open (mode bits for group or others)."""
    data_dir = Path(data_dir)
    warnings = []
    for path in [data_dir, *sorted(_entries(data_dir))]:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            continue  # gone meanwhile (a -shm file at a stop)
        if mode & 0o077:
            want = "0700" if path.is_dir() else "0600"
            warnings.append(f"{path} has mode {mode:04o}: other users may open it "
                            f"(runstile creates it {want}; chmod {want[1:]} {path})")
    return warnings


def warn_loose(data_dir: Path) -> None:
    """At start: say on stderr what in the data directory other users may open."""
    for warning in loose(data_dir):
        print(f"runstile: warning: {warning}", file=sys.stderr, flush=True)


def _entries(data_dir: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(data_dir)]
    except OSError:
        return []
