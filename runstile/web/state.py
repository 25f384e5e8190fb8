"""Access to the app's WebState from inside a request."""

from __future__ import annotations

import sqlite3

from flask import current_app


def state():
    return current_app.extensions["runstile"]


def conn() -> sqlite3.Connection:
    return state().pool.get()
