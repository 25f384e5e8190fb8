"""RUNSTILE_BROKER_URL -> a Dramatiq broker with runstile's explicit middleware list.

Dramatiq's defaults are left out on purpose (docs/architecture.md): Retries would redeliver a
failed message, TimeLimit raises asynchronously at any point, AgeLimit drops
re-published messages.  runstile retries and limits runs through the ledger, and runs
``async def`` bodies itself, so no middleware is needed at all.
"""

from __future__ import annotations

import dramatiq

from .. import dispatch
from ..config import Settings


def middleware() -> list:
    return []


def make_broker(settings: Settings) -> dramatiq.Broker:
    url = settings.broker_url
    if url == "sqlite":
        from .sqlite_broker import SQLiteBroker
        # The ledger's file or its PostgreSQL URL: the embedded broker lives in either.
        return SQLiteBroker(settings.ledger_target, synchronous=settings.synchronous,
                            busy_timeout_ms=settings.busy_timeout_ms, middleware=middleware())
    # Redis or RabbitMQ: built in dispatch.py, which the web and recovery publish with.
    return dispatch.external_broker(url, middleware=middleware())
