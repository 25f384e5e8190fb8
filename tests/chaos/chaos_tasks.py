"""Tasks the chaos runs execute.  Every body start, body end and step call is written to
an external log (a file named in the run's input, never the ledger), one line each, so
the checker can count executions independently of what runstile recorded."""

from __future__ import annotations

import os
import time

import runstile
from tests.workers.exec_tasks import log_line


def _body(ctx, input):
    log = input["log"]
    log_line(log, f"start {ctx.run_id} {ctx.attempt} {os.getpid()}")
    for n in range(input.get("steps", 2)):
        ctx.step(f"s{n}", _effect, log, ctx.run_id, n, idempotent=input.get("idempotent", False))
        ctx.emit("run.progress", {"step": n})
        time.sleep(input.get("sleep_s", 0.02))
    log_line(log, f"end {ctx.run_id} {ctx.attempt} {os.getpid()}")
    return {"steps": input.get("steps", 2)}


def _effect(log: str, run_id: str, n: int) -> int:
    log_line(log, f"step {run_id} s{n} {os.getpid()}")
    return n


@runstile.task("chaos.resume", on_crash="resume")
def resume(ctx, input):
    return _body(ctx, input)


@runstile.task("chaos.interrupt")
def interrupt(ctx, input):
    return _body(ctx, input)


@runstile.task("chaos.pause", on_crash="pause")
def pause(ctx, input):
    return _body(ctx, input)


TASKS = ("chaos.resume", "chaos.interrupt", "chaos.pause")
