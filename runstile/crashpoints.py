"""Named crash points: the process SIGKILLs itself at a durable boundary, for tests.

``RUNSTILE_CRASHPOINT=name`` (or ``name:probability``) makes ``hit(settings, name)`` kill
the calling process without any cleanup, exactly as a power cut would look to the
ledger.  Unset (the default) it costs one comparison.
"""

from __future__ import annotations

import os
import random
import signal

from .config import Settings


def hit(settings: Settings, name: str) -> None:
    spec = settings.crashpoint
    if spec is None:
        return
    wanted, _, probability = spec.partition(":")
    if wanted == name and (not probability or random.random() < float(probability)):
        os.kill(os.getpid(), signal.SIGKILL)
