"""A completion counter the peers without a record of their own share (RabbitMQ, huey).

Each finished no-op appends one byte to a file with ``O_APPEND`` (whole and atomic on a
local file system, across processes and threads); the benchmark polls the file's size.
It costs one ``write(2)``, no fsync: the same order as the Redis ``INCR`` of the Dramatiq
Redis peer, and far less than the durable record a runstile or DBOS run leaves.
"""

from __future__ import annotations

import os
import threading
import time

_lock = threading.Lock()
_fds: dict[tuple[int, str], int] = {}


def done(path: str) -> None:
    key = (os.getpid(), path)
    fd = _fds.get(key)
    if fd is None:
        with _lock:
            fd = _fds.get(key)
            if fd is None:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                _fds[key] = fd
    os.write(fd, b".")


def count(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def mark_start(path: str, tag: str) -> None:
    """The latency probe's start line ``"<tag> <time.time()>"``, shared by every target's
    task; O_APPEND keeps lines whole across processes."""
    line = f"{tag} {time.time():.6f}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
