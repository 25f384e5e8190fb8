"""Bearer-key authentication (SPEC §3): every failure is the same bare 401."""

from __future__ import annotations

from flask import g, request

from ..errors import Unauthorized
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
    return principal


def principal() -> Principal:
    return g.principal
