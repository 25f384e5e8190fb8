"""The PostgreSQL ledger's own parts: its migrations give SQLite's schema, its writers
queue on one lock, its errors are the ledger's (docs/architecture.md, "Two dialects,
one ledger").  The tests that need a server use RUNSTILE_TEST_DATABASE_URL
(tests/postgres.py); the schema comparison fails under CI without one."""

from __future__ import annotations

import contextlib
import multiprocessing
import re

import pytest

from runstile.errors import LedgerUnavailable
from runstile.ledger import db, execution, keys, migrations, obligations, runs
from runstile.ledger.db_dialect import ConstraintViolation
from tests import postgres
from tests.unit import ledger_fill

#: Runs once, on the PostgreSQL pass (tests/postgres.py).
pytestmark = pytest.mark.postgresql

#: SQLite's declared type -> PostgreSQL's (information_schema.columns.data_type).
TYPES = {"INTEGER": "bigint", "REAL": "double precision", "TEXT": "text", "BLOB": "bytea"}
#: Triggers only PostgreSQL has: dispatches.id one above the largest, as SQLite's
#: INTEGER PRIMARY KEY gives it; the NOTIFY that wakes the embedded broker's watchers
#: when a broker row becomes ready (SQLite's watcher reads the WAL instead).
POSTGRESQL_ONLY_TRIGGERS = {"dispatches_next_id", "broker_messages_ready_notify"}
#: Columns (and their indexes) only PostgreSQL has: obligations' insertion order, which
#: SQLite's rowid gives for free.
POSTGRESQL_ONLY_COLUMNS = {("obligations", "page_seq")}
POSTGRESQL_ONLY_INDEXES = {"obligations_page"}


@pytest.fixture
def pg_url():
    with postgres.fresh_database(required=True) as url:
        yield url


def _default(value: str | None) -> str | None:
    """A column default, spelled alike: no cast, no quotes' case."""
    return None if value is None else re.sub(r"::[a-z ]+$", "", str(value)).strip("()")


def sqlite_schema(path) -> dict:
    conn = db.connect(path)
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    columns, keys, indexes, unique = {}, {}, {}, set()
    for table in tables:
        info = conn.execute(f"PRAGMA table_info({table})").fetchall()
        pk = [r["name"] for r in sorted((r for r in info if r["pk"]), key=lambda r: r["pk"])]
        keys[table] = pk
        columns[table] = {r["name"]: (TYPES[r["type"]], bool(r["notnull"]) or r["name"] in pk,
                                      _default(r["dflt_value"])) for r in info}
        for idx in conn.execute(f"PRAGMA index_list({table})").fetchall():
            cols = [r["name"] for r in conn.execute(f"PRAGMA index_info({idx['name']})")]
            if idx["origin"] == "c":
                indexes[idx["name"]] = (table, cols, bool(idx["unique"]), bool(idx["partial"]))
            elif idx["origin"] == "u":
                unique.add((table, tuple(cols)))
    triggers = {r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'trigger'")}
    conn.close()
    return {"columns": columns, "keys": keys, "indexes": indexes, "unique": unique,
            "triggers": triggers}


def postgresql_schema(url) -> dict:
    conn = db.connect(url)
    columns: dict = {}
    for r in conn.execute("SELECT table_name, column_name, data_type, is_nullable, "
                          "column_default FROM information_schema.columns "
                          "WHERE table_schema = 'public'"):
        if (r[0], r[1]) not in POSTGRESQL_ONLY_COLUMNS:
            columns.setdefault(r[0], {})[r[1]] = (r[2], r[3] == "NO", _default(r[4]))
    keys: dict = {t: [] for t in columns}
    unique = set()
    for r in conn.execute(
            "SELECT c.conrelid::regclass::text, c.contype, array_agg(a.attname ORDER BY k.n) "
            "FROM pg_constraint c CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY "
            "AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = c.conrelid "
            "AND a.attnum = k.attnum WHERE c.contype IN ('p', 'u') "
            "AND c.connamespace = 'public'::regnamespace GROUP BY c.oid, 1, 2"):
        if r[1] == "p":
            keys[r[0]] = list(r[2])
        else:
            unique.add((r[0], tuple(r[2])))
    indexes = {}
    for r in conn.execute(
            "SELECT i.indexrelid::regclass::text, i.indrelid::regclass::text, "
            "array_agg(a.attname ORDER BY k.n), i.indisunique, i.indpred IS NOT NULL "
            "FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY "
            "AS k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = k.attnum JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relnamespace = 'public'::regnamespace AND NOT EXISTS "
            "(SELECT 1 FROM pg_constraint WHERE conindid = i.indexrelid) "
            "GROUP BY 1, 2, 4, 5"):
        if r[0] not in POSTGRESQL_ONLY_INDEXES:
            indexes[r[0]] = (r[1], list(r[2]), r[3], r[4])
    triggers = {r[0] for r in conn.execute(
        "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")}
    conn.close()
    return {"columns": columns, "keys": keys, "indexes": indexes, "unique": unique,
            "triggers": triggers - POSTGRESQL_ONLY_TRIGGERS}


def test_both_engines_migrate_to_the_same_tables_columns_indexes_and_triggers(
        tmp_path, pg_url):
    migrations.migrate(tmp_path / "ledger.db")
    migrations.migrate(pg_url)
    sqlite, pg = sqlite_schema(tmp_path / "ledger.db"), postgresql_schema(pg_url)
    assert sorted(pg["columns"]) == sorted(sqlite["columns"])
    for table, cols in sqlite["columns"].items():
        assert pg["columns"][table] == cols, table
    assert pg["keys"] == sqlite["keys"]
    assert pg["unique"] == sqlite["unique"]
    assert pg["indexes"] == sqlite["indexes"]
    assert pg["triggers"] == sqlite["triggers"]
    conn = db.connect(pg_url)
    assert conn.execute("SELECT value FROM ledger_meta WHERE name = 'schema_version'"
                        ).fetchone()[0] == str(migrations.LATEST_VERSION)


def test_each_sqlite_migration_has_a_postgresql_twin():
    from runstile.ledger import db_postgresql_migrate
    for version, _ in migrations.MIGRATIONS:
        assert db_postgresql_migrate.script(version).strip()


def _page_seq_exists(url: str) -> bool:
    conn = db.connect(url)
    try:
        return bool(conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
            "AND table_name = 'obligations' AND column_name = 'page_seq'").fetchone())
    finally:
        conn.close()


def _ended_with_callbacks(conn, principal, keys_: list[str]) -> list[str]:
    """Runs (one per idempotency key) ended one after another, each writing its callback
    obligation; their ids in the order the obligations were written."""
    ended = []
    for key in keys_:
        run_id = ledger_fill.admit(conn, principal, key=key,
                                   callback="https://hooks.example.com/p")
        claim = execution.claim(conn, run_id, ledger_fill.OWNER, lease_s=60,
                                task_known=lambda task: True)
        assert claim.run, claim.outcome
        assert execution.finish(conn, run_id, ledger_fill.OWNER, status="completed",
                                result_json="1")
        ended.append(run_id)
    return ended


def _every_page(conn, principal, limit: int) -> list[str]:
    """The run ids of every obligation, newest first, a page of ``limit`` at a time."""
    seen, before = [], None
    while True:
        page, has_more = obligations.list_visible(
            conn, runs.visible_clause(principal), states=(), before=before, limit=limit)
        seen += [row["run_id"] for row in page]
        if not has_more:
            return seen
        before = page[-1]["page_seq"]


def test_a_ledger_migrated_to_12_gets_page_seq_at_13_in_the_order_its_deliveries_came(
        pg_url):
    from runstile.ledger import db_postgresql_migrate
    db_postgresql_migrate.migrate(pg_url, list(range(1, 13)))
    assert not _page_seq_exists(pg_url)  # as a database migrated before 13 is
    conn = db.connect(pg_url)
    try:
        principal = keys.Principal("acme", keys.create(conn, "acme")[0], "client")
        before = _ended_with_callbacks(conn, principal, [f"old-{n}" for n in range(5)])
        # An update writes a row's new version at the heap's end: a numbering in storage
        # order (ADD COLUMN ... AS IDENTITY's) would put the oldest obligation last.
        with db.transaction(conn):
            conn.execute("UPDATE obligations SET last_error = 'touched' WHERE run_id = ?",
                         (before[0],))
        assert migrations.migrate(pg_url) == 12
        assert migrations.current_version(conn) == migrations.LATEST_VERSION >= 13
        after = _ended_with_callbacks(conn, principal, ["new-0", "new-1"])  # the identity's
        assert _every_page(conn, principal, limit=2) == list(reversed(before + after))
        index = conn.execute("SELECT indexdef FROM pg_indexes WHERE indexname = "
                             "'obligations_page'").fetchone()
        assert index is not None and "(page_seq)" in index[0]
    finally:
        conn.close()


def _migrate_together(url: str, barrier, results) -> None:
    barrier.wait()
    try:
        results.put(migrations.migrate(url))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc))


def test_processes_migrating_one_database_at_once_apply_each_migration_once(pg_url):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_migrate_together, args=(pg_url, barrier, results))
             for _ in range(3)]
    for proc in procs:
        proc.start()
    outcomes = sorted(str(results.get(timeout=60)) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    # One found the database empty; the others waited on the writer lock, then found
    # each migration applied (an error would be a string that is not a version).
    assert outcomes.count("0") >= 1 and all(o.isdigit() for o in outcomes), outcomes
    assert migrations.migrate(pg_url) == migrations.LATEST_VERSION


def test_a_writer_waiting_past_the_busy_timeout_becomes_ledger_unavailable(pg_url):
    migrations.migrate(pg_url)
    holder, waiter = db.connect(pg_url), db.connect(pg_url, busy_timeout_ms=50)
    held = db.transaction(holder)
    held.__enter__()
    try:
        with pytest.raises(LedgerUnavailable, match="lock timeout"):
            with db.transaction(waiter):
                pass
        assert not waiter.in_transaction
    finally:
        held.__exit__(None, None, None)
    with db.transaction(waiter):  # the lock is free again
        waiter.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 0)")


def test_a_uniqueness_race_reaches_the_caller_as_an_integrity_error(pg_url):
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    conn.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 0)")
    with pytest.raises(ConstraintViolation):
        with db.transaction(conn):
            conn.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 1)")
    assert isinstance(ConstraintViolation("x"), db.INTEGRITY_ERRORS)
    assert conn.execute("SELECT created_at FROM profiles").fetchall() == [(0.0,)]


def test_a_statement_past_its_time_limit_is_cancelled_and_the_connection_goes_on(pg_url):
    conn = db.connect(pg_url)
    with pytest.raises(TimeoutError):
        with db.time_limit(conn, 0.05, lambda: TimeoutError("too slow")):
            conn.execute("SELECT pg_sleep(5)")
    assert conn.execute("SHOW statement_timeout").fetchone()[0] == "0"
    assert conn.execute("SELECT 1").fetchone()[0] == 1


def test_rows_read_by_position_and_by_name_and_booleans_land_as_integers(pg_url):
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    conn.execute("INSERT INTO profiles (id, created_at) VALUES (?, ?)", ("p", 1.5))
    row = conn.execute("SELECT id, created_at, ? AS yes FROM profiles", (True,)).fetchone()
    assert (row[0], row["created_at"], dict(row)) == ("p", 1.5, {"id": "p", "created_at": 1.5,
                                                                 "yes": "1"})
    assert conn.execute("SELECT CASE WHEN ? THEN 'a' ELSE 'b' END", (False,)).fetchone()[0] == "b"
    cur = conn.execute("INSERT INTO recovery_reports (node_id, generation, trigger, "
                       "started_at, finished_at, counts) VALUES (?, 1, 'boot', 0, 0, '{}')",
                       ("n",))
    assert cur.lastrowid == 1 and cur.fetchone() is None


class RoundTrips:
    """Counts the round trips a PgConnection makes to its server: a statement executed
    alone is one, and so is a pipeline, whatever it carries."""

    def __init__(self, conn) -> None:
        self.count, self._depth, raw = 0, 0, conn._raw
        execute, pipeline = raw.execute, raw.pipeline

        def counted_execute(*args, **kwargs):
            self.count += self._depth == 0
            return execute(*args, **kwargs)

        @contextlib.contextmanager
        def counted_pipeline():
            self.count += self._depth == 0
            self._depth += 1
            try:
                with pipeline() as p:
                    yield p
            finally:
                self._depth -= 1

        raw.execute, raw.pipeline = counted_execute, counted_pipeline


def test_a_batch_pays_one_round_trip_per_statement_and_its_savepoints_ride_along(pg_url):
    """What the writer lock is held for: BEGIN with the lock, each unit's statements, and
    the COMMIT, while the savepoint around each unit (db.transaction nested) travels with
    the statement after it instead of alone."""
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    trips = RoundTrips(conn)
    with db.transaction(conn):
        for name in ("a", "b", "c"):
            with db.transaction(conn):
                conn.execute("INSERT INTO profiles (id, created_at) VALUES (?, 0)", (name,))
    assert trips.count == 1 + 3 + 1
    assert [r[0] for r in conn.execute("SELECT id FROM profiles ORDER BY id")] == ["a", "b", "c"]


def test_a_unit_that_fails_inside_its_deferred_savepoint_rolls_back_alone(pg_url):
    """A group commit's unit that fails after writing (here: a uniqueness violation in
    its second statement) is undone to its own savepoint; the units before and after it
    commit, as they would with every savepoint sent alone."""
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    with db.transaction(conn):
        with db.transaction(conn):
            conn.execute("INSERT INTO profiles (id, created_at) VALUES ('before', 0)")
        with pytest.raises(ConstraintViolation):
            with db.transaction(conn):
                conn.execute("INSERT INTO profiles (id, created_at) VALUES ('failed', 0)")
                conn.execute("INSERT INTO profiles (id, created_at) VALUES ('before', 1)")
        with pytest.raises(ValueError):
            with db.transaction(conn):  # fails before any statement: nothing was sent
                raise ValueError
        with db.transaction(conn):
            conn.execute("INSERT INTO profiles (id, created_at) VALUES ('after', 0)")
    assert not conn.in_transaction
    assert [r[0] for r in conn.execute("SELECT id FROM profiles ORDER BY id")] == [
        "after", "before"]


def test_a_batch_of_admissions_pays_six_round_trips_however_many_it_holds(pg_url):
    """The admission writer's batch (ledger/admission_rows.py): BEGIN with the lock, the
    batch's keys, the profile's capacity, the runs with the next dispatch id, every other
    row (keys, dispatches, events, broker messages) together, and the COMMIT."""
    from runstile import dispatch
    from runstile.config import Settings
    from runstile.ledger import admission, group_commit

    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    principal = keys.authenticate(conn, keys.create(conn, "p")[1])
    enqueue = dispatch.Dispatcher(Settings()).in_transaction
    for size in (1, 5):
        units = [group_commit.Unit(admission.Reservation(
            ledger_fill.request(principal, key=f"k{size}-{i}"), None, 1000, enqueue))
            for i in range(size)]
        trips = RoundTrips(conn)
        group_commit._commit(conn, units)
        assert all(u.error is None and u.result.replayed is False for u in units)
        assert trips.count == 6, size
    assert conn.execute("SELECT COUNT(*) FROM broker_messages").fetchone()[0] == 6


def test_a_plain_claim_with_its_ack_pays_four_round_trips(pg_url):
    """BEGIN with the lock; the message's ack with the plain claim's UPDATE; the
    run.started event; COMMIT (ledger/execution.py, ``claim``)."""
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    principal = keys.authenticate(conn, keys.create(conn, "p")[1])
    run_id = ledger_fill.admit(conn, principal, key="plain")
    trips = RoundTrips(conn)
    claimed = execution.claim(conn, run_id, ledger_fill.OWNER, lease_s=60,
                              task_known=lambda t: True, unlimited_tasks='["t.work"]',
                              delivery=execution.Delivery(1, "no-such-consumer"))
    assert claimed.outcome == "claimed" and trips.count == 4


def test_a_lock_timeout_at_begin_leaves_no_transaction_and_nothing_deferred(pg_url):
    migrations.migrate(pg_url)
    holder, waiter = db.connect(pg_url), db.connect(pg_url, busy_timeout_ms=50)
    with db.transaction(holder):
        with pytest.raises(LedgerUnavailable, match="lock timeout"):
            with db.transaction(waiter):
                pass
    assert not waiter.in_transaction and waiter._deferred == []
    with db.transaction(waiter):
        with db.transaction(waiter):
            waiter.execute("INSERT INTO profiles (id, created_at) VALUES ('p', 0)")
    assert waiter.execute("SELECT COUNT(*) FROM profiles").fetchone()[0] == 1


def test_a_transaction_whose_failed_statement_was_swallowed_commits_nothing(pg_url):
    """PostgreSQL answers the COMMIT of a failed transaction with a silent ROLLBACK: the
    connection refuses to send it, so nobody takes a rollback for a commit."""
    migrations.migrate(pg_url)
    conn = db.connect(pg_url)
    with pytest.raises(LedgerUnavailable, match="nothing of it was committed"):
        with db.transaction(conn):
            conn.execute("INSERT INTO profiles (id, created_at) VALUES ('lost', 0)")
            with contextlib.suppress(ConstraintViolation):  # no savepoint: a bug's shape
                conn.execute("INSERT INTO profiles (id, created_at) VALUES ('lost', 1)")
    assert not conn.in_transaction
    assert conn.execute("SELECT COUNT(*) FROM profiles").fetchone()[0] == 0


def test_statements_are_translated_once_into_postgresqls_spelling():
    from runstile.ledger.db_postgresql_dialect import NOW, translate
    assert translate("SELECT ? WHERE a = 'it''s ?' AND b LIKE '%x'") == (
        "SELECT %s WHERE a = 'it''s ?' AND b LIKE '%%x'", "positional", None)
    assert translate("SELECT ?1, ?2, ?1")[:2] == ("SELECT %(p1)s, %(p2)s, %(p1)s", "numbered")
    assert translate("SELECT :max LIMIT :limit")[:2] == ("SELECT %(max)s LIMIT %(limit)s",
                                                         "named")
    assert translate(f"SELECT {db.NOW}")[0] == f"SELECT {NOW}"
    assert translate("WHERE a IS ? AND b IS NOT ? AND c IS NULL AND d IS NOT NULL")[0] == (
        "WHERE a IS NOT DISTINCT FROM %s AND b IS DISTINCT FROM %s AND c IS NULL "
        "AND d IS NOT NULL")
    assert translate("INSERT INTO dispatches (run_id) VALUES (?)")[2] == "id"
    assert translate("INSERT INTO dispatches (run_id) VALUES (?)", many=True)[2] is None


def test_a_database_url_shows_without_its_password():
    from runstile.errors import redact_url as redact
    assert redact("postgresql://app:s3cret@db.example:5433/runs") == \
        "postgresql://app:***@db.example:5433/runs"
    assert redact("postgresql://app@db/runs") == "postgresql://app@db/runs"
    assert db.is_database_url("postgresql://h/d") and db.is_database_url("postgres://h/d")
    assert not db.is_database_url("/var/lib/runstile/ledger.db")


def test_threads_share_a_pool_of_sessions_and_a_borrower_waiting_too_long_is_told(pg_url):
    import threading

    from runstile.ledger import keys
    from runstile.ledger.db_postgresql import SessionPool
    migrations.migrate(pg_url)
    pool = SessionPool(pg_url, size=2, busy_timeout_ms=2000)
    pool.open()
    made, errors = [], []

    def create(n: int) -> None:
        try:
            with pool.connection() as conn:
                made.append(keys.create(conn, f"p{n}")[0])
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(made)) == 6
    tight = SessionPool(pg_url, size=1, busy_timeout_ms=100)
    tight.open()
    with tight.connection():
        with pytest.raises(LedgerUnavailable):
            with tight.connection():
                pass
    tight.close()
    pool.close()


def test_a_write_outside_a_transaction_waits_for_the_writer_lock_like_any_writer(pg_url):
    """As on SQLite, where such a statement takes the file's write lock: it can never land
    between a writer's read and its write."""
    migrations.migrate(pg_url)
    holder, bare = db.connect(pg_url), db.connect(pg_url, busy_timeout_ms=50)
    held = db.transaction(holder)
    held.__enter__()
    try:
        with pytest.raises(LedgerUnavailable):
            bare.execute("INSERT INTO profiles (id, created_at) VALUES ('bare', 0)")
        assert bare.execute("SELECT COUNT(*) FROM profiles").fetchone()[0] == 0  # reads go on
    finally:
        held.__exit__(None, None, None)
    bare.execute("INSERT INTO profiles (id, created_at) VALUES ('bare', 0)")
    assert not bare.in_transaction
    assert holder.execute("SELECT id FROM profiles").fetchall() == [("bare",)]
