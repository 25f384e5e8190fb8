"""Signing in and out, the signed-in key on every request, and the CSRF token
(docs/dashboard.md, "Signing in").

The cookie holds the key id and a CSRF token, never the secret.  Every request reads
the key again, so a revoked key's session ends at its next request; every POST must
carry the session's token (a form field), or it is refused before anything changes.
"""

from __future__ import annotations

import hmac
import secrets
from typing import NoReturn

from flask import g, redirect, render_template, request, session, url_for
from werkzeug.wrappers import Response

from ...errors import LedgerUnavailable, RouteNotFound, RunstileError
from ...ledger import dashboard, keys
from ..errors import error_response
from ..state import conn, state
from . import blueprint

#: Pages reachable without a session.
_OPEN_ENDPOINTS = {"ui.login", "ui.login_form", "ui.static", "ui.root"}
#: Polled by ui.js: a signed-out answer is a 401, not a redirect to an HTML page.
_JSON_ENDPOINTS = {"ui.live_statuses", "ui.live_run"}
FIELD = "csrf_token"


def csrf_token() -> str:
    """The session's token, made on first use (a sign-in makes a new one)."""
    token = session.get("csrf")
    if not isinstance(token, str):
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


class CsrfRefused(Exception):
    """A POST without the session's CSRF token (answered 403, nothing changed)."""


@blueprint.context_processor
def _template_globals() -> dict[str, object]:
    return {"csrf_token": csrf_token, "principal": g.get("principal")}


@blueprint.before_request
def _signed_in() -> Response | tuple[dict[str, object], int] | None:
    if request.method == "POST":
        sent = request.form.get(FIELD, "")
        expected = session.get("csrf")
        # Checked first, for every form (sign-in included): a cross-site form cannot
        # know the token, so it changes nothing, whoever's cookie came with it.
        if not isinstance(expected, str) or not hmac.compare_digest(sent, expected):
            raise CsrfRefused()
    if request.endpoint in _OPEN_ENDPOINTS:
        return None
    key_id = session.get("key_id")
    principal = None if not isinstance(key_id, str) else dashboard.live_principal(conn(), key_id)
    if principal is None:
        # Never signed in, or the key was revoked since: the session ends here.
        session.clear()
        if request.endpoint in _JSON_ENDPOINTS:
            return {"error": {"code": "unauthorized", "message": "signed out"}}, 401
        reason = "revoked" if isinstance(key_id, str) else None
        return redirect(url_for("ui.login_form", reason=reason))
    g.principal = principal  # what the API's scoping reads (web/auth.py)
    return None


#: Every dashboard answer: nothing loads from elsewhere or runs inline (so injected markup
#: could not run even if it got past escaping), no page can be framed (a framed button
#: could be clicked by a page that overlays it), and no page is kept in a cache after
#: sign-out.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'; object-src 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


@blueprint.after_request
def _headers(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    if request.endpoint != "ui.static":
        response.headers["Cache-Control"] = "no-store"
    return response


@blueprint.get("/ui/<path:rest>")
def unknown_page(rest: str) -> NoReturn:
    raise RouteNotFound("no such page")


@blueprint.errorhandler(CsrfRefused)
def _csrf_refused(_: CsrfRefused) -> tuple[str, int]:
    return render_template("error.html", title="Request refused", status=403,
                           message="The form's security token was missing or wrong, so "
                                   "nothing was changed. Reload the page and try again."), 403


@blueprint.errorhandler(RunstileError)
def _refused(exc: RunstileError) -> Response | tuple[str, int]:
    """An error raised by a page or button (404 for what the key may not see, 503 when
    the ledger is busy) as a page, not as the API's JSON."""
    if isinstance(exc, LedgerUnavailable):
        state().pool.discard()  # the connection may be broken; reopen next time
    if request.endpoint in _JSON_ENDPOINTS:
        return error_response(exc)
    title = "Not found" if exc.status == 404 else "Something went wrong"
    return render_template("error.html", title=title, status=exc.status,
                           message=exc.message), exc.status


@blueprint.get("/")
def root() -> Response:
    return redirect(url_for("ui.runs_page"))


@blueprint.get("/ui/login")
def login_form() -> str:
    reason = request.args.get("reason")
    notice = ("You were signed out: the key is no longer valid." if reason == "revoked"
              else None)
    return render_template("login.html", title="Sign in", notice=notice, error=None)


@blueprint.post("/ui/login")
def login() -> Response | tuple[str, int]:
    secret = request.form.get("api_key", "").strip()
    principal = keys.authenticate(conn(), secret) if secret else None
    if principal is None:
        return render_template("login.html", title="Sign in", notice=None,
                               error="That key is not valid: unknown, revoked or mistyped."), 401
    # A fresh session (and a fresh token) at every sign-in: nothing from before it,
    # such as a token planted by someone else, carries over.
    session.clear()
    session["key_id"] = principal.key_id
    csrf_token()
    return redirect(url_for("ui.runs_page"))


@blueprint.post("/ui/logout")
def logout() -> Response:
    session.clear()
    return redirect(url_for("ui.login_form"))
