"""The admission benchmark's ceiling: bench/baseline_app.py without the SQLite insert.

The same Flask app shape under the same gunicorn setup (2 processes, gthread, 8
threads): per POST it parses the JSON body and answers 202 with a small JSON body, and
touches no database.  No durable endpoint on this stack (Flask + gunicorn on this
machine, driven by the same clients) can answer faster, so it is an upper bound for
both runstile and the durable baseline.
"""

from __future__ import annotations

import itertools
import json

from flask import Flask, jsonify, request

app = Flask("bench-flask-noop")
_seq = itertools.count(1)


@app.post("/v1/runs")
def create_run():
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        return jsonify({"error": {"code": "invalid_json"}}), 400
    json.dumps(body, separators=(",", ":"))     # the baseline serialises it for its row
    return jsonify({"id": next(_seq), "status": "queued"}), 202


@app.get("/readyz")
def readyz():
    return jsonify({"status": "ready"})
