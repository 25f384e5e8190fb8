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


app = Flask("bench-baseline")
_local = threading.local()


def _conn() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None or _local.pid != os.getpid():
        conn = connect(os.environ["BENCH_BASELINE_DB"])
        _local.conn, _local.pid = conn, os.getpid()
    return conn


@app.post("/v1/runs")
def create_run():
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return jsonify({"error": {"code": "invalid_json"}}), 400
    seq = insert_one(_conn(), request.headers.get("Idempotency-Key"),
                     json.dumps(body, separators=(",", ":")))
    return jsonify({"id": seq, "status": "queued"}), 202


@app.get("/readyz")
def readyz():
    return jsonify({"status": "ready"})
