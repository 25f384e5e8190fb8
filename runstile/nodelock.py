"""The node lock: an flock on ``<data-dir>/node-<node id>.lock`` held for life
(docs/operations.md, "Node lock and generations").

The kernel drops an flock when its holder dies, however it dies, so holding the lock is
proof of life and taking it is proof that every earlier holder is gone.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import NodeLocked
from .filemodes import open_lock, private_dir


class NodeLock:
    #: The kernel keeps an flock for as long as this process lives.
    can_be_lost = False

    def __init__(self, data_dir: Path, node_id: str) -> None:
        self.path = data_dir / f"node-{node_id}.lock"
        self.node_id = node_id
        self._fd: int | None = None

    def acquire(self) -> NodeLock:
        private_dir(self.path.parent)
        fd = open_lock(self.path)  # 0600: nobody else may open it, let alone flock it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise NodeLocked(
                f"node {self.node_id!r} is already running on {self.path.parent} "
                f"(pid {holder}); stop it first or give this one another RUNSTILE_NODE_ID"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        # Opened O_CLOEXEC: children do not inherit this descriptor, so the lock dies
        # with this process alone.
        self._fd = fd
        return self

    def held(self) -> bool:
        """Always True once taken: the kernel holds an flock as long as this process lives."""
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
