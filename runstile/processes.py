"""Whether a process of this machine has exited.

``os.kill(pid, 0)`` says a zombie still exists: a process that has exited but that its
parent has not reaped yet.  The children of a SIGKILLed process tree are reaped by init
once their parent is gone, and some inits do that a second or more later (measured: about
1.2 s on the machines runstile is tested on), so a pid check right after such a kill
finds every process of the tree "alive".  A zombie has closed its files, sockets and
locks: for runstile it is gone.
"""

from __future__ import annotations

import os


def exited(pid: int) -> bool:
    """True when process ``pid`` is gone or a zombie; False while it runs (or when it
    cannot be told: another user's process is left alone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # After the command name, which may hold spaces and parentheses: the state.
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        pass  # no /proc here: ask the kernel, which cannot tell a zombie
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
