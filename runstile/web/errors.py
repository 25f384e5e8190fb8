"""The one place errors become HTTP answers: ``{"error": {"code", "message", ...}}``."""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import MethodNotAllowed as HTTPMethodNotAllowed

from ..errors import (
    CapacityExceeded,
    LedgerUnavailable,
    ListQueryTimeout,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
    RunstileError,
    StreamsExhausted,
    StreamsPerKeyExhausted,
    Unauthorized,
)
from .state import state

log = logging.getLogger("runstile.web")

#: Errors that say when to ask again (header ``Retry-After``, RUNSTILE_RETRY_AFTER_S).
_RETRY_AFTER = (LedgerUnavailable, CapacityExceeded, StreamsExhausted, StreamsPerKeyExhausted,
                ListQueryTimeout)

_HTTP = {404: (RouteNotFound, "no route matches this path"),
         405: (MethodNotAllowed, "this route does not accept this method"),
         413: (PayloadTooLarge, "the body is too large")}


def error_response(exc: RunstileError) -> Response:
    body = {"code": exc.code, "message": exc.message}
    if not isinstance(exc, Unauthorized):  # a 401 carries no detail (docs/api.md)
        body.update(exc.details)
    response = jsonify({"error": body})
    response.status_code = exc.status
    if isinstance(exc, Unauthorized):
        response.headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, _RETRY_AFTER):
        response.headers["Retry-After"] = str(state().settings.retry_after_s)
    return response


def install(app: Flask) -> None:
    @app.errorhandler(RunstileError)
    def _runstile(exc: RunstileError) -> Response:
        if isinstance(exc, LedgerUnavailable):
            log.warning("ledger unavailable: %s", exc.message)
            state().pool.discard()  # the connection may be broken; reopen next time
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        known = _HTTP.get(exc.code or 500)
        if known is not None:
            cls, message = known
            response = error_response(cls(message))
        else:
            err = RunstileError(exc.description or exc.name)
            err.code, err.status = (exc.name or "error").lower().replace(" ", "_"), exc.code or 500
            response = error_response(err)
        if exc.code == 405 and isinstance(exc, HTTPMethodNotAllowed) and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unexpected error")
        return error_response(RunstileError("an unexpected error occurred; it has been logged"))
