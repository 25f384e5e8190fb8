"""Bearer-key authentication (docs/api.md): every failure is the same bare 401."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flask import g, request

from ..errors import PayloadTooLarge, Unauthorized
from ..ledger import keys
from ..ledger.keys import Principal
from .state import state

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

    from . import WebState


def authenticate() -> Principal:
    """Resolve the request's key, on every request, so a revocation applies at once."""
    principal = principal_for(state(), request.environ)
    g.principal = principal
    return principal


def principal_for(web: WebState, environ: WSGIEnvironment) -> Principal:
    """The key a request presents, resolved against the ledger (no Flask context: the
    admission endpoint calls it directly).  Then the body cap, which waits for the key:
    a 401 comes before a 413."""
    header = environ.get("HTTP_AUTHORIZATION", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret or " " in secret.strip():
        raise Unauthorized("authentication required")
    principal = keys.authenticate(web.pool.get(), secret.strip())
    if principal is None:
        raise Unauthorized("authentication required")
    if environ.get("runstile.body_over_limit"):
        # The web process did not buffer this body: it is over RUNSTILE_MAX_BODY_BYTES
        # (web/gthread.py).
        raise PayloadTooLarge("the body is larger than RUNSTILE_MAX_BODY_BYTES allows")
    return principal


def principal() -> Principal:
    current: Principal = g.principal
    return current
