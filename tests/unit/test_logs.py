"""The JSON log line and the run context (docs/operations.md, "JSON logs")."""

from __future__ import annotations

import json
import logging
import sys

from runstile import logs


def formatted(record: logging.LogRecord) -> dict:
    logs.RunFilter().filter(record)
    return json.loads(logs.JsonFormatter("node-a").format(record))


def record(message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("runstile.workers", logging.WARNING, __file__, 1, message, args,
                             exc_info)


def test_a_line_inside_a_run_context_names_the_run_and_one_outside_does_not():
    with logs.run_context("run_" + "1" * 32):
        logs.set_task("echo")
        inside = formatted(record("run %s: %s", "x", "y"))
    outside = formatted(record("idle"))
    assert inside["run_id"] == "run_" + "1" * 32 and inside["task"] == "echo"
    assert inside["message"] == "run x: y" and inside["level"] == "WARNING"
    assert inside["logger"] == "runstile.workers" and inside["node"] == "node-a"
    assert inside["ts"].endswith("Z") and isinstance(inside["pid"], int)
    assert "run_id" not in outside and "traceback" not in outside


def test_a_traceback_is_one_field_of_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        line = logs.JsonFormatter(None).format(record("failed", exc_info=sys.exc_info()))
    assert "\n" not in line
    parsed = json.loads(line)
    assert "ValueError: boom" in parsed["traceback"] and parsed["message"] == "failed"
