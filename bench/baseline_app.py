"""The baseline for the admission benchmark: the least a durable JSON-accepting endpoint does.

A minimal Flask app served by the same gunicorn setup as runstile (2 processes, gthread,
8 threads).  Per POST it parses the JSON body and makes one durable SQLite insert:
WAL journal, ``synchronous=FULL``, ``isolation_level=None`` with an explicit
``BEGIN IMMEDIATE`` ... ``COMMIT``, ``busy_timeout`` 5000 ms, one connection per thread
opened lazily after fork.  It answers 202 with a small JSON body.

It does nothing runstile-specific (no auth lookup, no idempotency record, no events):
that difference is exactly what the benchmark ratio measures.  Do not make it cheaper
than this (e.g. synchronous=NORMAL, batching, skipping the JSON parse): the ratio would
then flatter the baseline, not measure runstile.

The database path comes from ``BENCH_BASELINE_DB``; :func:`create_schema` makes it.

The PostgreSQL twin (the PostgreSQL section's admission baseline) runs when
``BENCH_BASELINE_PG_URL`` is set instead: the same app and route, and per POST one
``INSERT ... RETURNING`` on a psycopg connection in autocommit mode, so the statement is
its own transaction, committed before the answer with the server's
``synchronous_commit`` as it is (the same server and setting runstile's ledger gets).
One connection per thread, opened lazily after fork.  A single autocommitted statement
is one round trip, the cheapest durable insert PostgreSQL offers: an explicit
``BEGIN``/``COMMIT`` pair would only slow the baseline down.  :func:`pg_create_schema`
makes its table.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time

from flask import Flask, jsonify, request

SCHEMA = ("CREATE TABLE IF NOT EXISTS runs (seq INTEGER PRIMARY KEY, idempotency_key TEXT, "
          "body TEXT NOT NULL, created_at REAL NOT NULL)")
INSERT = "INSERT INTO runs (idempotency_key, body, created_at) VALUES (?, ?, ?)"


def connect(path: str) -> sqlite3.Connection:
    """One connection with the durable settings shared by the baseline and the raw rate."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    return conn


def create_schema(path: str) -> None:
    conn = connect(path)
    conn.execute(SCHEMA)
    conn.close()


def insert_one(conn: sqlite3.Connection, key: str | None, body: str) -> int:
    """One row in its own committed transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        row_id = conn.execute(INSERT, (key, body, time.time())).lastrowid
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return row_id


PG_SCHEMA = ("CREATE TABLE IF NOT EXISTS runs (seq bigserial PRIMARY KEY, idempotency_key text, "
             "body text NOT NULL, created_at double precision NOT NULL)")
PG_INSERT = ("INSERT INTO runs (idempotency_key, body, created_at) VALUES (%s, %s, %s) "
             "RETURNING seq")


def pg_connect(url: str):
    import psycopg
    return psycopg.connect(url, autocommit=True)


def pg_create_schema(url: str) -> None:
    with pg_connect(url) as conn:
        conn.execute(PG_SCHEMA)


def pg_insert_one(conn, key: str | None, body: str) -> int:
    """One row in its own committed transaction (autocommit: the statement is one)."""
    return conn.execute(PG_INSERT, (key, body, time.time())).fetchone()[0]


app = Flask("bench-baseline")
_local = threading.local()


_PG_URL = os.environ.get("BENCH_BASELINE_PG_URL")


def _conn():
    conn = getattr(_local, "conn", None)
    if conn is None or _local.pid != os.getpid():
        conn = pg_connect(_PG_URL) if _PG_URL else connect(os.environ["BENCH_BASELINE_DB"])
        _local.conn, _local.pid = conn, os.getpid()
    return conn


@app.post("/v1/runs")
def create_run():
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return jsonify({"error": {"code": "invalid_json"}}), 400
    insert = pg_insert_one if _PG_URL else insert_one
    seq = insert(_conn(), request.headers.get("Idempotency-Key"),
                 json.dumps(body, separators=(",", ":")))
    return jsonify({"id": seq, "status": "queued"}), 202


@app.get("/readyz")
def readyz():
    return jsonify({"status": "ready"})
