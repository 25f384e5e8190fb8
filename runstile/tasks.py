"""The task and schedule registry: ``@runstile.task(...)`` records a function and
``runstile.schedule(...)`` a schedule of one (docs/tasks.md, "Schedules"); nothing binds
to a broker, nothing touches the ledger.

Decorating never touches Dramatiq, so the web tier can import task modules to learn
their names (for ``unknown_task`` and capabilities) without creating actors.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError
from .queues import DEFAULT_QUEUE, check_name
from .ticks import Ticks, check

if TYPE_CHECKING:
    import dramatiq  # at run time imported where used: the client loads this module

ON_CRASH = ("interrupt", "resume", "pause")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,127}")


@dataclass(frozen=True)
class TaskSpec:
    name: str
    fn: Callable
    #: Seconds a body may run before runstile fails it with time_limit_exceeded.
    time_limit_s: float | None = None
    #: What recovery does when the owner died mid-body (docs/tasks.md, "When the worker is gone").
    on_crash: str = "interrupt"
    #: How many times a raising body is re-queued before the run fails.
    retries: int = 0
    #: Seconds before a retry is dispatched.
    retry_backoff_s: float = 1.0
    #: The most runs of this task running at once across the deployment; None: no limit
    #: (docs/tasks.md, "Registering a task").  Enforced by the claim (ledger/slots.py).
    concurrency: int | None = None
    #: The queue its runs travel on (docs/tasks.md, "Queues"); a node consumes the
    #: queues ``--queues`` names, each in a thread pool of its own or the shared one.
    queue: str = DEFAULT_QUEUE

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


_lock = threading.Lock()
_tasks: dict[str, TaskSpec] = {}


#: The options ``@runstile.task`` takes; nothing else is honoured (docs/tasks.md).
OPTIONS = ("time_limit_s", "on_crash", "retries", "retry_backoff_s", "concurrency", "queue")


def task(name: str, *, time_limit_s: float | None = None, on_crash: str = "interrupt",
         retries: int = 0, retry_backoff_s: float = 1.0, concurrency: int | None = None,
         queue: str = DEFAULT_QUEUE, **unknown: object) -> Callable[[Callable], Callable]:
    """Register ``fn(ctx, input)`` as the task ``name``.

    A runstile task is not a Dramatiq actor: Dramatiq's actor options (``max_retries``,
    ``time_limit``, ``on_success`` …) are refused here with the options that do exist,
    never accepted and ignored.
    """
    if unknown:
        raise ConfigError(f"task {name!r}: unknown option(s) {', '.join(sorted(unknown))}; "
                          f"@runstile.task takes {', '.join(OPTIONS)} (docs/tasks.md, "
                          f"\"Dramatiq actors and middleware\")")
    _check(name, time_limit_s, on_crash, retries, retry_backoff_s, concurrency)
    check_name(queue, f"task {name!r}: queue")

    def register(fn: Callable) -> Callable:
        spec = TaskSpec(name, fn, time_limit_s, on_crash, retries, float(retry_backoff_s),
                        concurrency, queue)
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


def _check(name: str, time_limit_s: float | None, on_crash: str, retries: int,
           retry_backoff_s: float, concurrency: int | None) -> None:
    """Refuse an invalid declaration with ConfigError naming the task and the option."""
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
    if concurrency is not None and (isinstance(concurrency, bool)
                                    or not isinstance(concurrency, int) or concurrency < 1):
        raise ConfigError(f"task {name!r}: concurrency must be a whole number >= 1, or None "
                          f"for no limit (got {concurrency!r})")


def load(modules: tuple[str, ...]) -> dict[str, TaskSpec]:
    """Import the task modules and return the registry (name -> spec).

    The working directory is importable, as with ``python -m`` and Dramatiq's CLI: a
    console script's sys.path holds only its own folder, so ``runstile up --tasks
    mytasks`` beside ``mytasks.py`` would otherwise fail in the supervisor alone.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    with _dramatiq_actors_refused():
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ConfigError(f"cannot import task module {module!r}: {exc}") from exc
    _check_schedule_tasks()
    return registered()


@contextmanager
def _dramatiq_actors_refused() -> Iterator[None]:
    """While task modules load, Dramatiq's global broker refuses every actor declaration.

    runstile runs ``@runstile.task`` functions through its own actor; a ``@dramatiq.actor``
    in a task module would otherwise bind to Dramatiq's default broker (a RabbitMQ broker
    on localhost with Dramatiq's default middleware), which runstile never consumes: its
    options would silently do nothing.  Imported here, not at the top: the client loads
    this module and must not load Dramatiq.
    """
    import dramatiq
    import dramatiq.broker

    class RefusingBroker(dramatiq.Broker):  # only declare_actor is ever reached
        def declare_actor(self, actor: dramatiq.Actor) -> None:
            raise ConfigError(
                f"task modules may not declare Dramatiq actors ({actor.fn.__module__}."
                f"{actor.fn.__qualname__} as {actor.actor_name!r}): runstile runs "
                f"@runstile.task functions, and honours no Dramatiq actor option or "
                f"middleware (docs/tasks.md, \"Dramatiq actors and middleware\")")

    refusing = RefusingBroker(middleware=[])
    # Every option some Dramatiq middleware knows, so that an actor using them gets this
    # refusal rather than Dramatiq's "did you forget to add a middleware?".
    refusing.actor_options = {option for cls in vars(dramatiq.middleware).values()
                              if isinstance(cls, type) and issubclass(cls, dramatiq.Middleware)
                              for option in _options_of(cls)}
    previous = dramatiq.broker.global_broker
    dramatiq.set_broker(refusing)
    try:
        yield
    finally:
        dramatiq.broker.global_broker = previous


def _options_of(middleware: type[dramatiq.Middleware]) -> set[str]:
    options: Any = middleware.actor_options  # on the class: the property object itself
    if isinstance(options, property):  # declared per instance; read it off the class
        options = options.fget(None) if options.fget else set()
    return set(options)


def registered() -> dict[str, TaskSpec]:
    with _lock:
        return dict(_tasks)


def get(name: str) -> TaskSpec | None:
    with _lock:
        return _tasks.get(name)


def concurrency_of(name: str) -> int | None:
    """The task's ``concurrency`` (None: no limit, or no such task here)."""
    spec = get(name)
    return None if spec is None else spec.concurrency


def queue_of(name: str) -> str:
    """The queue of task ``name`` (the default queue for a task not registered here)."""
    spec = get(name)
    return DEFAULT_QUEUE if spec is None else spec.queue


def queues() -> list[str]:
    """Every queue a registered task uses, and the default queue (which is always
    there: runs admitted before their task moved, or before queues existed), sorted."""
    return sorted({DEFAULT_QUEUE} | {spec.queue for spec in registered().values()})


def concurrencies() -> dict[str, int | None]:
    """Every registered task's ``concurrency``, by name (what recovery hands slots out by)."""
    return {name: spec.concurrency for name, spec in registered().items()}


# ------------------------------------------------------------------ schedules

CATCHUP = ("latest", "all", "none")


@dataclass(frozen=True)
class ScheduleSpec:
    """One ``runstile.schedule(...)`` declaration (docs/tasks.md, "Schedules")."""

    name: str
    task: str
    ticks: Ticks
    input: Any = None
    profile: str = "default"
    #: What happens to ticks missed while no scheduler ran: latest, all or none.
    catchup: str = "latest"


_schedules: dict[str, ScheduleSpec] = {}
_PROFILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def schedule(name: str, *, task: str, cron: str | None = None, every_s: int | None = None,
             input: Any = None, profile: str = "default", timezone: str = "UTC",
             catchup: str = "latest") -> ScheduleSpec:
    """Declare the schedule ``name``: a run of ``task`` with ``input`` at every tick of
    ``cron`` (in ``timezone``) or every ``every_s`` seconds, admitted once per tick under
    ``profile`` by whichever node's scheduler gets there first (docs/tasks.md,
    "Schedules").  A bad declaration raises ConfigError naming the schedule, so the
    process that imports the task module refuses to start."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"schedule name {name!r} must match {_NAME.pattern}")
    if not isinstance(task, str) or not _NAME.fullmatch(task):
        raise ConfigError(f"schedule {name!r}: task must be a task name (got {task!r})")
    if catchup not in CATCHUP:
        raise ConfigError(f"schedule {name!r}: catchup must be one of {', '.join(CATCHUP)} "
                          f"(got {catchup!r})")
    if not isinstance(profile, str) or not _PROFILE.fullmatch(profile):
        raise ConfigError(f"schedule {name!r}: profile {profile!r} is not a profile name")
    try:
        json.dumps(input, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"schedule {name!r}: input must be JSON ({exc})") from None
    spec = ScheduleSpec(name, task, check(name, cron, every_s, timezone), input, profile,
                        catchup)
    with _lock:
        previous = _schedules.get(name)
        if previous is not None and previous != spec:
            raise ConfigError(f"schedule {name!r} is declared twice, differently")
        _schedules[name] = spec
    return spec


def _check_schedule_tasks() -> None:
    """Every schedule names a task these modules register (checked once all are loaded:
    a module may declare a schedule before the task it runs)."""
    with _lock:
        missing = [s for s in _schedules.values() if s.task not in _tasks]
    if missing:
        raise ConfigError(f"schedule {missing[0].name!r}: no task named {missing[0].task!r} "
                          f"is registered")


def schedules() -> dict[str, ScheduleSpec]:
    """Every declared schedule, by name."""
    with _lock:
        return dict(sorted(_schedules.items()))
