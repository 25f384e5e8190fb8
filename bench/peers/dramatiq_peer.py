"""Bare Dramatiq on Redis, the execution benchmark's non-durable reference (bench/README.md).

Workers: ``dramatiq bench.peers.dramatiq_peer --processes 2 --threads 4`` with
BENCH_REDIS_URL pointing at the benchmark's own redis-server.  Dramatiq's default
middleware, default prefetch and the default queue; nothing tuned.  The actor does
nothing but record that it ran: one ``INCR`` of :data:`DONE_KEY` (and, for the idle
latency probe only, one line with its start time in the file named by ``mark``).
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from .counter import mark_start

#: Counter of finished messages (the benchmark runs its own redis-server, so no prefix
#: could collide, but the key is namespaced all the same).
DONE_KEY = "runstile-bench:dramatiq:done"

broker = RedisBroker(url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
                     namespace="runstile-bench")
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="bench", actor_name="bench_noop")
def bench_noop(mark, tag):
    if mark:
        mark_start(mark, tag)
    broker.client.incr(DONE_KEY)
