"""Demo tasks: what ``runstile up`` registers when no ``--tasks`` are given.

Each shows one feature of the task API (docs/tasks.md); the README's tour submits them.
"""

from __future__ import annotations

import time

from .tasks import task


@task("echo")
def echo(ctx, input):
    """Return the input unchanged."""
    return {"echo": input}


@task("progress")
def progress(ctx, input):
    """Emit progress events; ``input`` = {"steps": n, "delay_s": s}."""
    params = input if isinstance(input, dict) else {}
    steps = int(params.get("steps", 5))
    delay_s = float(params.get("delay_s", 0.2))
    for i in range(steps):
        ctx.checkpoint()
        ctx.emit("run.progress", {"pct": round(100 * (i + 1) / steps)})
        time.sleep(delay_s)
    return {"steps": steps}


@task("chat")
def chat(ctx, input):
    """Stream a reply word by word as ``message.delta`` events."""
    text = str((input or {}).get("text", "hello from runstile")) if isinstance(input, dict) \
        else "hello from runstile"
    reply = f"You said: {text}"
    for word in reply.split(" "):
        ctx.emit("message.delta", {"text": word + " "})
        time.sleep(0.05)
    ctx.emit("message.completed", {"text": reply})
    return {"reply": reply}


def _fetch(url):
    return {"url": url, "length": len(url)}


def _record(doc):
    return {"recorded": doc["url"]}


@task("steps")
def steps(ctx, input):
    """Two journaled steps: an idempotent fetch and a side effect."""
    url = (input or {}).get("url", "https://example.com") if isinstance(input, dict) \
        else "https://example.com"
    doc = ctx.step("fetch", _fetch, url, idempotent=True)
    receipt = ctx.step("record", _record, doc)
    return {"doc": doc, "receipt": receipt}


@task("fail")
def fail(ctx, input):
    """Always raise: the run ends failed with an error code and message."""
    raise ValueError("the demo task 'fail' always fails")


#: Longest sleep the demo task ``slow`` accepts, in seconds: a demo must not let one
#: client hold a worker thread for hours (docs/guarantees.md, "What a hostile client
#: cannot do").
SLOW_MAX_SECONDS = 60.0


def _slow_seconds(input) -> float:
    raw = input.get("seconds", 30) if isinstance(input, dict) else 30
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not \
            0 <= raw <= SLOW_MAX_SECONDS:
        raise ValueError(f"the demo task 'slow' takes \"seconds\": a number from 0 to "
                         f"{SLOW_MAX_SECONDS:g}, not {raw!r}"[:300])
    return float(raw)


@task("slow")
def slow(ctx, input):
    """Sleep in small slices, honouring stop requests; ``input`` = {"seconds": s}, at most
    SLOW_MAX_SECONDS (the run fails task_error beyond)."""
    seconds = _slow_seconds(input)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx.checkpoint()
        time.sleep(0.1)
    return {"slept_s": seconds}
