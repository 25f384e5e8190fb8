"""A tiny Dramatiq app for ``dramatiq tests.workers.sqlite_broker_cli_app`` (see
test_sqlite_broker.py): the global broker is the embedded SQLite broker on the ledger
named by $CLI_APP_LEDGER, and one actor appends its argument to a file.

Test scaffolding reads the environment here; runstile's own code never does.
"""

import os

import dramatiq

from runstile.workers.sqlite_broker import SQLiteBroker

broker = SQLiteBroker(os.environ["CLI_APP_LEDGER"], consumer_timeout_s=5.0)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="default", actor_name="append_line")
def append_line(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n")
