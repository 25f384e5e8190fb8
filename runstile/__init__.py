"""runstile: durable run admission and at-most-once execution on a SQLite ledger.

The public API is small: ``task`` registers a task, ``schedule`` declares a
schedule of one, ``Settings`` configures runstile,
``Client`` talks to a runstile server over HTTP, ``RunContext`` is what a task body gets,
and every error derives from ``RunstileError``.

``import runstile`` for the client alone loads nothing of the server side (no Flask, no
Dramatiq, no ledger): ``RunContext`` and ``Stopped`` are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from .config import Settings
from .errors import RunstileError
from .tasks import schedule, task

if TYPE_CHECKING:
    from .client import Client
    from .workers.context import RunContext, Stopped

__all__ = ["Client", "RunContext", "RunstileError", "Settings", "Stopped", "schedule", "task"]
__version__ = "0.1.0"

#: Public names that live on the worker side, loaded when first asked for.
_WORKER_SIDE = {"RunContext", "Stopped"}


def __getattr__(name: str) -> Any:
    if name in _WORKER_SIDE:
        from .workers import context
        return getattr(context, name)
    if name == "Client":
        # On first use too: the HTTP client's modules (http.client, the email parser) are
        # about 45 ms that no server process needs at its start.
        from .client import Client
        return Client
    raise AttributeError(f"module 'runstile' has no attribute {name!r}")
