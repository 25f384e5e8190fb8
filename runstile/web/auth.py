"""Bearer-key authentication (docs/api.md): every failure is the same bare 401."""

from __future__ import annotations

from flask import g, request

from ..errors import PayloadTooLarge, Unauthorized
from ..ledger import keys
from ..ledger.keys import Principal
from .state import conn


def authenticate() -> Principal:
    """Resolve the request's key, on every request, so a revocation applies at once."""
    header = request.environ.get("HTTP_AUTHORIZATION", "")  # = request.headers, no wrapper
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret or " " in secret.strip():
        raise Unauthorized("authentication required")
    principal = keys.authenticate(conn(), secret.strip())
    if principal is None:
        raise Unauthorized("authentication required")
    g.principal = principal
    if request.environ.get("runstile.body_over_limit"):
        # The web process did not buffer this body: it is over RUNSTILE_MAX_BODY_BYTES
        # (web/gthread.py).  Refused once the key is known: a 401 comes before a 413.
        raise PayloadTooLarge("the body is larger than RUNSTILE_MAX_BODY_BYTES allows")
    return principal


def principal() -> Principal:
    current: Principal = g.principal
    return current
