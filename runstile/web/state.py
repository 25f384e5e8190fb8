"""Access to the app's WebState from inside a request."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING

from flask import current_app

if TYPE_CHECKING:
    from . import WebState


def state() -> WebState:
    web: WebState = current_app.extensions["runstile"]
    return web


def conn() -> sqlite3.Connection:
    return state().pool.get()
