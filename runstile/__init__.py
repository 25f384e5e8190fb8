"""runstile: durable run admission and at-most-once execution on a SQLite ledger.

The public API is small: ``task`` registers a task, ``Settings`` configures runstile,
``Client`` talks to a runstile server over HTTP, and every error derives from
``RunstileError``.
"""

from .client import Client
from .config import Settings
from .errors import RunstileError
from .workers.context import RunContext, Stopped
from .workers.registry import task

__all__ = ["Client", "RunContext", "RunstileError", "Settings", "Stopped", "task"]
__version__ = "0.1.0"
