"""The dashboard at ``/ui/`` (docs/dashboard.md): server-rendered pages over the same
ledger reads, scoping and control actions as the API, for people.

A blueprint of the API's own Flask app: sign-in with an API key into a signed,
``HttpOnly``, ``SameSite=Strict`` session cookie holding the key id (never the secret),
a CSRF token on every form, templates and static files shipped in the package, and a
little JavaScript (``static/ui.js``) for live statuses and local times; every page reads
the same without it.
"""

from __future__ import annotations

from flask import Blueprint, Flask, Request, request
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface

from ...config import Settings
from .secret import session_secret

blueprint = Blueprint("ui", __name__, template_folder="templates", static_folder="static",
                      static_url_path="/ui/static")


class _SessionInterface(SecureCookieSessionInterface):
    """Flask's signed cookie session, marked ``Secure`` whenever the request came over
    HTTPS, so a dashboard served over TLS never sends its cookie in the clear.

    Only the dashboard's paths have a session.  Every other request (the API) gets
    Flask's null session, which cannot be written and is never saved: the cookie is
    scoped to ``/ui`` anyway, and building the signing serializer on every API request
    cost about 6 % of a web process's CPU under load.
    """

    def open_session(self, app: Flask, request: Request) -> SecureCookieSession | None:
        path = request.path
        if path == "/ui" or path.startswith("/ui/"):
            return super().open_session(app, request)
        return self.make_null_session(app)

    def get_cookie_secure(self, app: Flask) -> bool:
        return request.is_secure or super().get_cookie_secure(app)


def install(app: Flask, settings: Settings) -> None:
    """Register the dashboard on ``app`` with the node's session key."""
    from . import actions, live, pages, session  # noqa: F401  (their routes register)

    app.secret_key = session_secret(settings.data_dir)
    app.config.update(
        SESSION_COOKIE_NAME="runstile_ui",
        SESSION_COOKIE_PATH="/ui",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
    )
    app.session_interface = _SessionInterface()
    app.register_blueprint(blueprint)
