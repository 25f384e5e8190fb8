"""Log lines of every runstile process (docs/operations.md, "Logs").

``configure(log_format, node, text_format)`` is called once at the start of each process
(the ``up``/``worker`` supervisor, every worker process, every web process, the admission
writer, ``runstile recover``).  ``RUNSTILE_LOG_FORMAT=text`` keeps the human line each
process always printed; ``json`` prints one JSON object per line with ``ts``, ``level``,
``logger``, ``message``, ``node``, ``pid`` and, on a line a run caused, ``run_id`` and
``task`` (a traceback goes in ``traceback``, in the same object).

Which run a line belongs to is a context variable that the worker sets around the claim
and body of a run (:func:`run_context`) and a logging filter copies onto every record,
so a task's own ``logging`` calls carry it too; nothing passes a run id to a logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

#: (run_id, task) of the run this thread (or task of an event loop) works for.
_RUN: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "runstile_run", default=None)


@contextlib.contextmanager
def run_context(run_id: str, task: str | None = None) -> Iterator[None]:
    """Every log line inside names ``run_id`` (and ``task``)."""
    token = _RUN.set((run_id, task))
    try:
        yield
    finally:
        _RUN.reset(token)


def set_task(task: str) -> None:
    """The task of the current run, once the claim has read it."""
    current = _RUN.get()
    if current is not None:
        _RUN.set((current[0], task))


class RunFilter(logging.Filter):
    """Copies the current run onto each record (a filter on the handler, so it sees the
    records of every logger, Dramatiq's and a task's own included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _RUN.get()
        if current is not None and not hasattr(record, "run_id"):
            record.run_id, record.task = current
        return True


def _ts(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC).isoformat(
        timespec="milliseconds")[:-6] + "Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, node: str | None = None) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"ts": _ts(record.created), "level": record.levelname,
                                "logger": record.name, "message": record.getMessage(),
                                "node": self.node, "pid": record.process}
        run_id = getattr(record, "run_id", None)
        if run_id is not None:
            line["run_id"] = run_id
            line["task"] = getattr(record, "task", None)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["traceback"] = record.exc_text
        return json.dumps(line, default=str, ensure_ascii=False)


def json_line(message: str, *, node: str | None, logger: str, level: str = "INFO",
              **fields: Any) -> str:
    """A line shaped as :class:`JsonFormatter`'s, for what a command prints itself (the
    ``up`` banner) when the log format is json."""
    return json.dumps({"ts": _ts(time.time()), "level": level, "logger": logger,
                       "message": message, "node": node, "pid": os.getpid(), **fields},
                      ensure_ascii=False)


def configure(log_format: str, *, node: str | None, text_format: str,
              level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one on stderr, in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(node))
    else:
        handler.setFormatter(logging.Formatter(text_format))
    handler.addFilter(RunFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def gunicorn_config(node: str | None) -> dict[str, Any]:
    """gunicorn's ``logconfig_dict`` for the json format: its own loggers (the arbiter's
    and each web process's) hand their records to one JSON handler on the root logger
    instead of printing gunicorn's text lines."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter, "node": node}},
        "filters": {"run": {"()": RunFilter}},
        "handlers": {"json": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                              "formatter": "json", "filters": ["run"]}},
        "root": {"level": "INFO", "handlers": ["json"]},
        "loggers": {"gunicorn.error": {"level": "WARNING", "handlers": [], "propagate": True},
                    "gunicorn.access": {"level": "WARNING", "handlers": [],
                                        "propagate": True}},
    }
