"""The one place errors become HTTP answers: ``{"error": {"code", "message", ...}}``."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from flask import Flask, Response
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import MethodNotAllowed as HTTPMethodNotAllowed
from werkzeug.http import HTTP_STATUS_CODES

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

if TYPE_CHECKING:
    from . import WebState

log = logging.getLogger("runstile.web")

#: (status line, headers, body): one HTTP answer, before any framework sees it.
Answer = tuple[str, list[tuple[str, str]], bytes]

#: Flask's compact jsonify: json.dumps(value, separators=(",", ":")), keys as given.
compact = json.JSONEncoder(separators=(",", ":")).encode

#: Errors that say when to ask again (header ``Retry-After``, RUNSTILE_RETRY_AFTER_S).
_RETRY_AFTER = (LedgerUnavailable, CapacityExceeded, StreamsExhausted, StreamsPerKeyExhausted,
                ListQueryTimeout)

_HTTP = {404: (RouteNotFound, "no route matches this path"),
         405: (MethodNotAllowed, "this route does not accept this method"),
         413: (PayloadTooLarge, "the body is too large")}


def error_parts(exc: RunstileError, retry_after_s: float) -> Answer:
    """Status line, headers and body of ``exc``'s answer, as Flask's ``jsonify`` would
    write them (compact JSON, ASCII, a final newline): the one spelling of an error, for
    Flask's handlers and for the admission endpoint, which answers without Flask
    (web/admission_endpoint.py), both through :func:`answer_for`."""
    body = {"code": exc.code, "message": exc.message}
    if not isinstance(exc, Unauthorized):  # a 401 carries no detail (docs/api.md)
        body.update(exc.details)
    payload = (compact({"error": body}) + "\n").encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
    if isinstance(exc, Unauthorized):
        headers.append(("WWW-Authenticate", "Bearer"))
    if isinstance(exc, _RETRY_AFTER):
        headers.append(("Retry-After", str(retry_after_s)))
    return status_line(exc.status), headers, payload


def status_line(code: int) -> str:
    """``code``'s status line as werkzeug spells it for Flask (its reason in capitals)."""
    return f"{code} {HTTP_STATUS_CODES.get(code, 'Unknown').upper()}"


def answer_for(exc: Exception, web: WebState) -> Answer:
    """The answer to whatever a route raised, for Flask's handlers (:func:`install`) and
    the admission endpoint alike: a runstile error as itself (a ledger that failed also
    drops its connection), anything else logged and a bare 500.  Called while ``exc`` is
    being handled, so the log has its traceback."""
    if isinstance(exc, LedgerUnavailable):
        log.warning("ledger unavailable: %s", exc.message)
        web.pool.discard()  # the connection may be broken; reopen next time
    if not isinstance(exc, RunstileError):
        log.exception("unexpected error")
        exc = RunstileError("an unexpected error occurred; it has been logged")
    return error_parts(exc, web.settings.retry_after_s)


def as_response(answer: Answer) -> Response:
    """An :data:`Answer` as Flask's response."""
    status, headers, payload = answer
    return Response(payload, status=status, headers=headers)


def error_response(exc: RunstileError) -> Response:
    return as_response(error_parts(exc, state().settings.retry_after_s))


def install(app: Flask) -> None:
    @app.errorhandler(RunstileError)
    def _runstile(exc: RunstileError) -> Response:
        return as_response(answer_for(exc, state()))

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
        return as_response(answer_for(exc, state()))
