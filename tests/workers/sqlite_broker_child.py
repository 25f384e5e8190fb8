"""A consumer process for test_sqlite_broker.py's crash test, run as a script:

    python -m tests.workers.sqlite_broker_child LEDGER STARTED_FILE

A real ``dramatiq.Worker`` (2 threads) on the embedded broker whose actor records that it
started, then blocks until the process is killed.
"""

import sys
import threading

import dramatiq

from runstile.workers.sqlite_broker import SQLiteBroker


def main(ledger: str, started_file: str) -> None:
    broker = SQLiteBroker(ledger, consumer_timeout_s=1.0, heartbeat_interval_s=0.2)
    forever = threading.Event()

    def block(n: int) -> None:
        with open(started_file, "a", encoding="utf-8") as f:
            f.write(f"{n}\n")
        forever.wait()  # until SIGKILL

    dramatiq.actor(block, broker=broker, actor_name="block", queue_name="default")
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    worker.start()
    print("ready", flush=True)
    forever.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
