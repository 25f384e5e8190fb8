"""HTTP load generator: N client processes x M threads, one keep-alive connection each.

Processes (not only threads) so that the client's GIL does not cap the numbers.  Every
request carries a fresh, unique ``Idempotency-Key``.  Timeline, shared by all clients:

    start ──warm-up──▶ measure_from ──duration──▶ measure_to

A request counts when it *completes* inside [measure_from, measure_to); requests that
complete during the warm-up are sent but not counted (their errors are).  Throughput is
successful completions in the window / duration.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import signal
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    duration_s: float
    ok: int
    latencies_s: list[float]
    errors: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    client_cpu_s: float = 0.0

    @property
    def accepted(self) -> int:
        """Requests answered with the expected status, warm-up included."""
        return self.sent - sum(self.errors.values())

    @property
    def throughput(self) -> float:
        return self.ok / self.duration_s

    def percentile_ms(self, p: float) -> float | None:
        """Nearest-rank percentile of successful requests' latencies, in ms."""
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        rank = max(1, -(-len(ordered) * p // 100))  # ceil(n * p / 100)
        return ordered[int(rank) - 1] * 1000.0


def quiet_child() -> None:
    """In a forked client: die plainly on SIGTERM and leave Ctrl-C to the parent, which
    kills its children and servers in order."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _thread(host, port, path, headers, expect, tag, t_start, t_from, t_to, out, lock):
    lat = array("d")
    errors: Counter = Counter()
    sent = 0
    conn = http.client.HTTPConnection(host, port, timeout=30)
    while time.monotonic() < t_start:
        time.sleep(0.001)
    i = 0
    while True:
        began = time.monotonic()
        if began >= t_to:
            break
        i += 1
        body = json.dumps({"task": "echo", "input": {"n": i}}, separators=(",", ":")).encode()
        hdrs = dict(headers)
        hdrs["Idempotency-Key"] = f"{tag}-{i}"
        try:
            conn.request("POST", path, body, hdrs)
            resp = conn.getresponse()
            resp.read()
            outcome = resp.status
            if resp.will_close:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            outcome = type(exc).__name__
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
        done = time.monotonic()
        sent += 1
        if outcome != expect:
            errors[str(outcome)] += 1
        elif t_from <= done < t_to:
            lat.append(done - began)
    conn.close()
    with lock:
        out["lat"].extend(lat)
        out["errors"].update(errors)
        out["sent"] += sent


def _process(index, threads, host, port, path, headers, expect, tag, t_start, t_from, t_to,
             pipe):
    quiet_child()
    out = {"lat": array("d"), "errors": Counter(), "sent": 0}
    lock = threading.Lock()
    cpu0 = os.times()
    pool = [threading.Thread(target=_thread,
                             args=(host, port, path, headers, expect, f"{tag}-{index}-{t}",
                                   t_start, t_from, t_to, out, lock))
            for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cpu1 = os.times()
    pipe.send({"lat": out["lat"].tobytes(), "errors": dict(out["errors"]), "sent": out["sent"],
               "cpu": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)})
    pipe.close()


def drive(host: str, port: int, path: str, headers: dict[str, str], *, expect: int = 202,
          processes: int = 4, threads: int = 4, warmup_s: float = 2.0, duration_s: float = 10.0,
          tag: str = "bench", on_window=None) -> LoadResult:
    """Load ``POST path`` and return what was measured.

    ``on_window(event)`` is called in this process with "start" at measure_from and
    "end" at measure_to (used to sample the server's CPU time over the same window).
    """
    ctx = multiprocessing.get_context("fork")
    t_start = time.monotonic() + 0.5          # time to fork and connect
    t_from = t_start + warmup_s
    t_to = t_from + duration_s
    procs, pipes = [], []
    try:
        for index in range(processes):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_process,
                            args=(index, threads, host, port, path, headers, expect, tag,
                                  t_start, t_from, t_to, child), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        if on_window is not None:
            time.sleep(max(0.0, t_from - time.monotonic()))
            on_window("start")
            time.sleep(max(0.0, t_to - time.monotonic()))
            on_window("end")
        lat = array("d")
        errors: Counter = Counter()
        sent, cpu = 0, 0.0
        for pipe in pipes:
            if not pipe.poll(t_to - time.monotonic() + 60):
                raise RuntimeError("a client process did not report back")
            part = pipe.recv()
            lat.frombytes(part["lat"])
            errors.update(part["errors"])
            sent += part["sent"]
            cpu += part["cpu"]
        for p in procs:
            p.join(10)
        return LoadResult(duration_s=duration_s, ok=len(lat), latencies_s=lat.tolist(),
                          errors=dict(errors), sent=sent, client_cpu_s=cpu)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
