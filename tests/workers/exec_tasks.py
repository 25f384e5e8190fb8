"""Tasks the execution tests run in real worker processes.

Each writes to an *external* execution log (a file named in its input, not the ledger),
one line per body start or step call, so tests can count executions independently.
"""

from __future__ import annotations

import asyncio
import os
import time

import runstile


def log_line(path: str, line: str) -> None:
    # O_APPEND writes of one short line are atomic across processes.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@runstile.task("t.log_start")
def log_start(ctx, input):
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    time.sleep(input.get("hold_s", 0))  # a body that takes a while, when asked
    return {"n": input.get("n")}


@runstile.task("t.steps")
def steps(ctx, input):
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")

    def side_effect(tag):
        log_line(input["log"], f"call {tag} {ctx.run_id}")
        return {"tag": tag, "pid": os.getpid()}

    first = ctx.step("first", side_effect, "a")
    ctx.emit("run.progress", {"pct": 50})
    second = ctx.step("second", side_effect, "b", idempotent=True)
    wait_for(input.get("release"))
    return {"first": first, "second": second}


def wait_for(path: str | None, timeout_s: float = 60) -> None:
    """Hold the body until the test creates ``path`` (plain sleeps: no journaled calls)."""
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


@runstile.task("t.changing_args")
def changing_args(ctx, input):
    ctx.step("pick", lambda value: value, ctx.attempt)  # differs on every attempt
    wait_for(input.get("release"))
    return "finished"


@runstile.task("t.stream")
def stream(ctx, input):
    for i in range(input.get("count", 20)):
        ctx.emit("message.delta", {"i": i})
        time.sleep(input.get("delay_s", 0.05))
    return {"count": input.get("count", 20)}


@runstile.task("t.big_result")
def big_result(ctx, input):
    return "x" * input["size"]


@runstile.task("t.reserved")
def reserved(ctx, input):
    ctx.emit("run.completed", {})
    return "unreachable"


@runstile.task("t.sleepy", time_limit_s=0.5)
def sleepy(ctx, input):
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    for _ in range(200):
        time.sleep(0.05)
    log_line(input["log"], f"end {ctx.run_id}")
    return "should have been stopped"


@runstile.task("t.async")
async def async_task(ctx, input):
    await asyncio.sleep(0.01)
    ctx.emit("message.delta", {"text": "from async"})
    return {"async": True}


@runstile.task("t.deep")
def deep(ctx, input):
    """Hands runstile a value nested ``input["depth"]`` deep, through ``input["via"]``."""
    value: object = 1
    for _ in range(input["depth"]):
        value = [value]
    via = input["via"]
    if via == "emit":
        ctx.emit("deep", value)
    elif via == "step":
        ctx.step("deep", lambda: value)
    elif via == "deliver":
        ctx.deliver("https://hooks.example/deep", value)
    elif via == "approval":
        ctx.request_approval(value)
    return value


@runstile.task("t.not_json")
def not_json(ctx, input):
    return {1, 2}


@runstile.task("t.long")
def long(ctx, input):
    """Runs for a while in small sleeps, logging each tick, unless it is interrupted."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    for i in range(input.get("ticks", 100)):
        time.sleep(0.05)
        log_line(input["log"], f"tick {ctx.run_id} {i}")
    log_line(input["log"], f"end {ctx.run_id}")
    return "finished"


def _hold(ctx, input):
    """Log a start, then tick until ``ticks`` run out (long enough to be killed)."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    for _ in range(input.get("ticks", 400)):
        time.sleep(0.05)
    log_line(input["log"], f"end {ctx.run_id} {ctx.attempt}")
    return {"attempt": ctx.attempt}


@runstile.task("t.hold")
def hold(ctx, input):
    return _hold(ctx, input)


@runstile.task("t.hold_resume", on_crash="resume")
def hold_resume(ctx, input):
    ticks = input.get("ticks", 400) if ctx.attempt == 1 else 1
    return _hold(ctx, {**input, "ticks": ticks})


@runstile.task("t.hold_pause", on_crash="pause")
def hold_pause(ctx, input):
    return _hold(ctx, input)


@runstile.task("t.side_effect", on_crash="resume")
def side_effect(ctx, input):
    """A non-idempotent step that is still running when the process dies."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")

    def charge_card():
        log_line(input["log"], f"charge {ctx.run_id} {ctx.attempt}")
        if ctx.attempt == 1:
            time.sleep(30)  # killed in here
        return {"charged": True}

    return ctx.step("charge", charge_card)


def _one_side_effect(ctx, input):
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")

    def send_email():
        log_line(input["log"], f"call {ctx.run_id} {ctx.attempt}")
        return "sent"

    sent = ctx.step("send_email", send_email)
    log_line(input["log"], f"end {ctx.run_id} {ctx.attempt}")
    return {"sent": sent}


@runstile.task("t.crash_default")
def crash_default(ctx, input):
    return _one_side_effect(ctx, input)


@runstile.task("t.crash_resume", on_crash="resume")
def crash_resume(ctx, input):
    return _one_side_effect(ctx, input)


@runstile.task("t.exit")
def exits(ctx, input):
    import sys
    sys.exit(3)


@runstile.task("t.checkpointing")
def checkpointing(ctx, input):
    """Ticks, calling ctx.checkpoint() each time: a stop is seen at the next tick."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    for _ in range(input.get("ticks", 400)):
        ctx.checkpoint()
        time.sleep(0.05)
    log_line(input["log"], f"end {ctx.run_id} {ctx.attempt}")
    return "finished"


@runstile.task("t.flaky", retries=2, retry_backoff_s=0.2)
def flaky(ctx, input):
    """Fails on attempts 1 and 2 after a step; succeeds on attempt 3."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    ctx.step("prepare", lambda: log_line(input["log"], f"call {ctx.run_id}") or "ready")
    if ctx.attempt < 3:
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return {"attempt": ctx.attempt}


@runstile.task("t.always_fails", retries=1, retry_backoff_s=0)
def always_fails(ctx, input):
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    raise RuntimeError("no luck")


@runstile.task("t.fail_once")
def fail_once(ctx, input):
    """Fails the first time it runs for ``input["marker"]`` (leaving the marker file), then
    completes: a failed run whose retry (POST /v1/runs/{run_id}/retry) completes."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    if not os.path.exists(input["marker"]):
        log_line(input["marker"], f"failed {ctx.run_id}")
        raise RuntimeError("the first run of t.fail_once fails")
    return {"ran": "again"}


@runstile.task("t.session_step")
def session_step(ctx, input):
    """Logs begin/finish with the session key, holding the session for ``hold_s``."""
    log_line(input["log"], f"begin {ctx.session_key} {input['n']} {ctx.run_id}")
    time.sleep(input.get("hold_s", 0.05))
    log_line(input["log"], f"finish {ctx.session_key} {input['n']} {ctx.run_id}")
    return input["n"]


@runstile.task("t.approval")
def needs_approval(ctx, input):
    """A side effect, then a person decides, then (if approved) another side effect."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    ctx.step("prepare", lambda: log_line(input["log"], f"call prepare {ctx.run_id}") or "ok")
    ctx.emit("run.progress", {"pct": 50})
    if ctx.request_approval({"action": "publish", "n": input.get("n")}):
        ctx.step("publish", lambda: log_line(input["log"], f"call publish {ctx.run_id}") or "ok")
        return {"published": True}
    return {"published": False}


@runstile.task("t.deliver", on_crash="resume")
def delivers(ctx, input):
    """``count`` ctx.deliver calls, then (optionally) an approval: a body that runs again
    (after a crash or the decision) replays the deliveries instead of repeating them."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt}")
    ids = [ctx.deliver(input["url"], {"n": n, "run": ctx.run_id})
           for n in range(input.get("count", 1))]
    if input.get("approval"):
        ctx.request_approval({"deliveries": len(ids)})
    return {"deliveries": ids}


@runstile.task("t.tenant_step")
def tenant_step(ctx, input):
    """Logs begin/end with a tag (the test's name for the run's profile) and the time,
    holding a worker thread for ``hold_s`` in between."""
    log_line(input["log"], f"begin {input['tag']} {ctx.run_id} {time.time():.6f}")
    time.sleep(input.get("hold_s", 0.2))
    log_line(input["log"], f"end {input['tag']} {ctx.run_id} {time.time():.6f}")
    return {"tag": input["tag"]}


@runstile.task("t.spin")
def spin(ctx, input):
    """Keep the interpreter busy (pure Python, no sleeps) for ``seconds``: a body that
    competes for the GIL with the process's main thread, as a CPU-bound task does."""
    deadline = time.monotonic() + float(input.get("seconds", 20))
    while time.monotonic() < deadline:
        sum(range(1000))
    return "spun"


@runstile.task("t.one_at_a_time", concurrency=1)
def one_at_a_time(ctx, input):
    """At most one body of this task runs at once, in the whole deployment.  Logs its
    start and end with the process id and the time, holding a worker thread for
    ``hold_s`` in between."""
    log_line(input["log"], f"start {ctx.run_id} {os.getpid()} {time.time():.6f}")
    time.sleep(input.get("hold_s", 0.1))
    log_line(input["log"], f"end {ctx.run_id} {os.getpid()} {time.time():.6f}")
    return {"pid": os.getpid()}


@runstile.task("t.two_at_a_time", concurrency=2)
def two_at_a_time(ctx, input):
    return _hold(ctx, input)


@runstile.task("t.gate")
def gate(ctx, input):
    """Logs its start, then holds its worker thread until the test creates ``release``."""
    log_line(input["log"], f"start {ctx.run_id} {input.get('tag', '')}")
    wait_for(input.get("release"))
    return input.get("tag")


@runstile.task("t.log_time")
def log_time(ctx, input):
    """Logs the wall-clock time its body started at (delayed runs' tests)."""
    log_line(input["log"], f"start {ctx.run_id} {ctx.attempt} {time.time():.6f}")
    return {"n": input.get("n")}


@runstile.task("t.slow_gate", queue="slow")
def slow_gate(ctx, input):
    """t.gate on the queue ``slow`` (tests/workers/test_queues.py): holds its thread until
    ``release`` exists (at once without one)."""
    log_line(input["log"], f"start {ctx.run_id} {input.get('tag', '')}")
    wait_for(input.get("release"))
    return input.get("tag")
