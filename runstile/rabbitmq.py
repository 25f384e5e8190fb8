"""Dramatiq's RabbitMQ broker with run priority (docs/operations.md, "RabbitMQ and run
priority"): queues declared with ``x-max-priority``, so a run's message, which carries
its priority as ``broker_priority`` (``dispatch.message_for``), is delivered by it.

RabbitMQ cannot add ``x-max-priority`` to a queue that exists without it: it answers the
declaration with PRECONDITION_FAILED (406) and closes the channel.  Such a queue (declared
by a runstile from before priorities) is declared again as it is, with a warning: runs
keep flowing, in arrival order, until an operator deletes the queue once.
"""

from __future__ import annotations

import logging
from typing import Any

import pika
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.common import dq_name

log = logging.getLogger("runstile.rabbitmq")

#: AMQP's PRECONDITION_FAILED: the queue exists with other arguments.
PRECONDITION_FAILED = 406


class PriorityRabbitmqBroker(RabbitmqBroker):
    """RabbitmqBroker(max_priority=...) that survives a queue declared without it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Queues found to exist without x-max-priority: declared without it from then on.
        self.without_priority: set[str] = set()

    def _declare_queue(self, queue_name: str) -> Any:
        return self._declare(queue_name, queue_name)

    def _declare_dq_queue(self, queue_name: str) -> Any:
        return self._declare(dq_name(queue_name), queue_name)

    def _declare(self, name: str, canonical: str) -> Any:
        arguments = self._build_queue_arguments(canonical)
        if name in self.without_priority:
            arguments.pop("x-max-priority", None)
        try:
            return self.channel.queue_declare(queue=name, durable=True, arguments=arguments)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != PRECONDITION_FAILED or "x-max-priority" not in arguments:
                raise
        del self.channel  # the broker closed it; the next use opens another
        self.without_priority.add(name)
        log.warning("RabbitMQ queue %r exists without x-max-priority: run priority is "
                    "ignored on it until it is deleted once (docs/operations.md, "
                    "\"RabbitMQ and run priority\")", name)
        arguments.pop("x-max-priority")
        return self.channel.queue_declare(queue=name, durable=True, arguments=arguments)
