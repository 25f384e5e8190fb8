"""Bare Dramatiq on RabbitMQ, an execution-benchmark reference (bench/README.md).

Workers: ``dramatiq bench.peers.dramatiq_rabbitmq_peer --processes 2 --threads 4`` with
BENCH_AMQP_URL (the machine's RabbitMQ), BENCH_RABBIT_QUEUE (a queue name unique to
one benchmark run, deleted with its ``.DQ``/``.XQ`` companions afterwards: the server is
shared, so nothing else is touched) and BENCH_DONE_FILE (the completion counter,
:mod:`bench.peers.counter`).  Dramatiq's default middleware, prefetch and RabbitMQ
consumer; as Dramatiq ships it the queue is durable and messages persistent
(``delivery_mode=2``), without publisher confirms.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from .counter import done, mark_start

AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672")
QUEUE = os.environ.get("BENCH_RABBIT_QUEUE", "runstile-bench")
DONE_FILE = os.environ.get("BENCH_DONE_FILE", "/dev/null")

broker = RabbitmqBroker(url=AMQP_URL)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, actor_name="bench_noop", broker=broker)
def bench_noop(mark, tag):
    if mark:
        mark_start(mark, tag)
    done(DONE_FILE)


def delete_queues(url: str, queue: str) -> None:
    """Delete the run's queue and Dramatiq's delay / dead-letter queues for it."""
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel.queue_delete(name)
    finally:
        conn.close()
