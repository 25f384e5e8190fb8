"""Group commit tops its batch up once it holds the write lock (ledger/group_commit.py):
what was handed over while the committer waited for the lock commits with the batch it
was waiting behind, not one turn of the lock later.  On each engine, with the write lock
really held by another connection of the ledger; the committer and the admission writer
(web/writer/server.py) both."""

from __future__ import annotations

import fcntl
import socket
import termios
import threading

from runstile import dispatch
from runstile.config import Settings
from runstile.ledger import admission, db, group_commit
from runstile.web.writer import codec, server
from runstile.web.writer.client import WriterClient
from tests.conftest import wait_until
from tests.unit.commit_helpers import (
    WriteLockHolder,
    counting_transactions,
    handed_rows,
    insert,
)

#: Units handed over while the committer waits for the lock.
LATE = 5


def test_units_handed_over_while_the_committer_waits_for_the_lock_share_its_commit(handed_ledger):
    target, _ = handed_ledger
    begun: list[int] = []
    committer = group_commit.GroupCommitter(
        counting_transactions(lambda: db.connect(target), begun))
    results: dict[int, object] = {}

    def hand(n: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(n, committer.run(insert(n))))
        thread.start()
        return thread

    with WriteLockHolder(target):
        first = hand(0)
        # The committer took unit 0 and began its transaction: it now waits for the lock.
        wait_until(lambda: len(begun) == 1, 10, what="the committer to wait for the lock")
        late = [hand(n) for n in range(1, LATE + 1)]
        wait_until(lambda: committer._queue.qsize() == LATE, 10, what="the late units")
    for thread in [first, *late]:
        thread.join(10)

    assert results == {n: n for n in range(LATE + 1)}
    # One transaction for all of them: the late units rode along with unit 0.
    assert len(begun) == 1
    assert handed_rows(target) == list(range(LATE + 1))


def test_a_top_up_that_fails_with_its_batch_retries_every_unit_alone(handed_ledger):
    """A unit that breaks the shared transaction (not a refusal) sends the whole batch,
    the units taken at the lock included, to the one-by-one retry: the others commit,
    the bad one alone gets its error."""
    target, _ = handed_ledger
    batch = [group_commit.Unit(insert(0))]

    def bad(conn):
        conn.execute("INSERT INTO handed (n) VALUES (NULL)")  # NOT NULL: an IntegrityError

    late = [group_commit.Unit(insert(1)), group_commit.Unit(bad), group_commit.Unit(insert(2))]
    group_commit.Batches(lambda: db.connect(target)).settle(batch, lambda room: late)

    assert batch[1:] == late  # taken into the batch, so its caller answers them too
    assert [unit.result for unit in batch] == [0, 1, None, 2]
    assert [unit.error is None for unit in batch] == [True, True, False, True]
    assert handed_rows(target) == [0, 1, 2]


def test_admissions_sent_while_the_writer_waits_for_the_lock_share_its_commit(handed_ledger, tmp_path):
    target, principal = handed_ledger
    settings = (Settings(data_dir=tmp_path, database_url=target) if isinstance(target, str)
                else Settings(data_dir=target.parent))
    mine, theirs = socket.socketpair()
    writer = server._Writer(settings, mine)
    path = str(tmp_path / "writer.sock")
    writer.open(path)
    begun: list[int] = []
    writer.batches = group_commit.Batches(counting_transactions(
        lambda: db.connect(target), begun))
    loop = threading.Thread(target=writer.run)
    loop.start()
    assert theirs.recv(1) == b"r"  # listening
    client = WriterClient(path, group_commit.GroupCommitter(lambda: db.connect(target)),
                          timeout_s=30, max_frame=codec.max_frame(settings))
    enqueue = dispatch.Dispatcher(settings).enqueue
    answers: dict[str, object] = {}

    def admit(name: str) -> None:
        request = admission.AdmissionRequest(
            principal=principal, key=name, key_is_derived=False, run_id=None, task="echo",
            input_json="null", session_key=None, trigger_id=None, metadata_json=None,
            callback_url=None, fingerprint="f" * 64, fingerprint_version=1)
        answers[name] = client.run(admission.Reservation(request, None, 1000, enqueue))

    # Each sending thread's connection is accepted by the writer beforehand, as a web
    # thread's is long before a busy moment: a top-up reads the connections it has.
    senders = [f"late-{n}" for n in range(LATE)]
    gate = threading.Barrier(LATE + 1)

    def sender(name: str) -> None:
        admit(name + "-warm")
        gate.wait(10)  # warmed up
        gate.wait(10)  # the writer waits for the lock: send
        admit(name)

    threads = [threading.Thread(target=sender, args=(name,)) for name in senders]
    try:
        for thread in threads:
            thread.start()
        gate.wait(10)
        warm = len(begun)
        with WriteLockHolder(target):
            first = threading.Thread(target=admit, args=("first",))
            first.start()
            wait_until(lambda: len(begun) == warm + 1, 10,
                       what="the writer to wait for the lock")
            gate.wait(10)
            # Every late request is in the writer's sockets before the lock is released.
            wait_until(lambda: _requests_waiting(writer) >= LATE, 10, what="the late requests")
        for thread in [first, *threads]:
            thread.join(30)
    finally:
        writer.stopping = True
        loop.join(10)
        theirs.close()
        mine.close()

    admitted = [answers[name] for name in ["first", *senders]]
    assert [answer.replayed for answer in admitted] == [False] * (LATE + 1)
    assert len({answer.run["id"] for answer in admitted}) == LATE + 1
    # The writer's transaction for "first" took every late admission along.
    assert len(begun) == warm + 1


def _requests_waiting(writer) -> int:
    """How many of the writer's web connections have a request waiting to be read."""
    waiting = 0
    for key in list(writer.selector.get_map().values()):
        if isinstance(key.data, server._Connection):
            pending = fcntl.ioctl(key.fileobj.fileno(), termios.FIONREAD, b"\0\0\0\0")
            waiting += int.from_bytes(pending, "little") > 0
    return waiting
