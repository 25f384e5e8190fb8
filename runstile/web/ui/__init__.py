"""The dashboard at ``/ui/`` (docs/dashboard.md): server-rendered pages over the same
ledger reads, scoping and control actions as the API, for people.

A blueprint of the API's own Flask app: sign-in with an API key into a signed,
``HttpOnly``, ``SameSite=Strict`` session cookie holding the key id (never the secret),
a CSRF token on every form, templates and static files shipped in the package, and a
little JavaScript (``static/ui.js``) for live statuses and local times; every page reads
the same without it.
"""

from __future__ import annotations

from flask import Blueprint, Flask, request
from flask.sessions import SecureCookieSessionInterface

from ...config import Settings
from .secret import session_secret

blueprint = Blueprint("ui", __name__, template_folder="templates", static_folder="static",
                      static_url_path="/ui/static")


class _SessionInterface(SecureCookieSessionInterface):
    """Flask's signed cookie session, marked ``Secure`` whenever the request came over
    HTTPS, so a dashboard served over TLS never sends its cookie in the clear."""

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
