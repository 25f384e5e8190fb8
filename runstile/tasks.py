"""The task registry: ``@runstile.task(...)`` records a function; nothing binds to a broker.

Decorating never touches Dramatiq, so the web tier can import task modules to learn
their names (for ``unknown_task`` and capabilities) without creating actors.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError

ON_CRASH = ("interrupt", "resume", "pause")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,127}")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    fn: Callable
    #: Seconds a body may run before runstile fails it with time_limit_exceeded.
    time_limit_s: float | None = None
    #: What recovery does when the owner died mid-body (SPEC §6.3).
    on_crash: str = "interrupt"
    #: How many times a raising body is re-queued before the run fails.
    retries: int = 0
    #: Seconds before a retry is dispatched.
    retry_backoff_s: float = 1.0

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


_lock = threading.Lock()
_tasks: dict[str, TaskSpec] = {}


def task(name: str, *, time_limit_s: float | None = None, on_crash: str = "interrupt",
         retries: int = 0, retry_backoff_s: float = 1.0) -> Callable[[Callable], Callable]:
    """Register ``fn(ctx, input)`` as the task ``name``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"task name {name!r} must match {_NAME.pattern}")
    if on_crash not in ON_CRASH:
        raise ConfigError(f"task {name!r}: on_crash must be one of {ON_CRASH}")
    if not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"task {name!r}: retries must be a whole number >= 0")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ConfigError(f"task {name!r}: time_limit_s must be > 0")
    if not retry_backoff_s >= 0:
        raise ConfigError(f"task {name!r}: retry_backoff_s must be >= 0")

    def register(fn: Callable) -> Callable:
        spec = TaskSpec(name, fn, time_limit_s, on_crash, retries, float(retry_backoff_s))
        with _lock:
            previous = _tasks.get(name)
            if previous is not None and previous.fn.__qualname__ != fn.__qualname__:
                raise ConfigError(f"task {name!r} is registered twice "
                                  f"({previous.fn.__module__}.{previous.fn.__qualname__} and "
                                  f"{fn.__module__}.{fn.__qualname__})")
            _tasks[name] = spec
        fn.runstile_task = spec  # type: ignore[attr-defined]
        return fn

    return register


def load(modules: tuple[str, ...]) -> dict[str, TaskSpec]:
    """Import the task modules and return the registry (name -> spec).

    The working directory is importable, as with ``python -m`` and Dramatiq's CLI: a
    console script's sys.path holds only its own folder, so ``runstile up --tasks
    mytasks`` beside ``mytasks.py`` would otherwise fail in the supervisor alone.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"cannot import task module {module!r}: {exc}") from exc
    return registered()


def registered() -> dict[str, TaskSpec]:
    with _lock:
        return dict(_tasks)


def get(name: str) -> TaskSpec | None:
    with _lock:
        return _tasks.get(name)
