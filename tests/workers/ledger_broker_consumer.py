"""A consumer process for test_sqlite_broker_postgresql.py's concurrent-claims test, run as
a script:

    CONSUMER_LEDGER=<ledger> python -m tests.workers.ledger_broker_consumer READY GO OUT

It opens a consumer of queue 'default' on the embedded broker (prefetch 5), says so in
READY_FILE, waits for GO_FILE, then takes and acks messages until the queue has none
pending, writing each delivered message id to OUT_FILE, one a line.

Test scaffolding reads the environment here; runstile's own code never does.
"""

import os
import sys
import time
from pathlib import Path

from runstile.workers.sqlite_broker import SQLiteBroker


def main(ready_file: str, go_file: str, out_file: str) -> None:
    broker = SQLiteBroker(os.environ["CONSUMER_LEDGER"], consumer_timeout_s=60.0)
    broker.declare_queue("default")
    consumer = broker.consume("default", prefetch=5, timeout=100)
    Path(ready_file).write_text("ready\n")
    while not Path(go_file).exists():
        time.sleep(0.01)
    with open(out_file, "w", encoding="utf-8") as out:
        while True:
            proxy = next(consumer)
            if proxy is None:
                if broker.pending("default") == 0:
                    break
                continue
            out.write(proxy.message_id + "\n")
            consumer.ack(proxy)
    consumer.close()
    broker.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
