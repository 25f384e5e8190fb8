"""The key that signs the dashboard's session cookies (docs/configuration.md,
"Dashboard sessions").

Every web process of a node must sign with the same key, and the key must survive a
restart (or every restart would sign everyone out): so it is random bytes generated
once into ``<data dir>/ui-session.key`` (``0600``), never derived from an API key's
secret.  Deleting the file signs every dashboard session out at the next start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from ...filemodes import FILE_MODE, private_dir

FILE_NAME = "ui-session.key"
#: 32 random bytes, written as 64 hex characters.
_LENGTH = 64


def session_secret(data_dir: Path) -> str:
    """The node's session-signing key, created on first use."""
    path = Path(data_dir) / FILE_NAME
    existing = _read(path)
    if existing is not None:
        return existing
    private_dir(path.parent)
    # Several web processes start at once: each writes a candidate whole (and synced)
    # under a name of its own, then links it to the shared name.  A link never
    # replaces an existing file, so exactly one candidate wins and every process reads
    # the winner; no process can ever read a half-written key.
    candidate = path.with_name(f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.write(fd, secrets.token_hex(_LENGTH // 2).encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(candidate, path)
    finally:
        candidate.unlink()
    won = _read(path)
    if won is None:
        raise RuntimeError(f"{path} does not hold a session key; delete it and start again")
    return won


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    return text if len(text) >= _LENGTH else None
