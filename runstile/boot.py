"""What a node's supervisor does before its children start (docs/operations.md,
"`runstile up`"): make sure its web port can be bound, and wait for a ledger that is
unavailable for a while instead of exiting."""

from __future__ import annotations

import socket
from collections.abc import Callable

from .errors import ConfigError, LedgerUnavailable

#: Seconds before a boot step that met an unavailable ledger is tried again; doubled
#: after each failure, up to RETRY_MAX_S.
RETRY_S = 0.5
RETRY_MAX_S = 5.0


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError when ``host:port`` cannot be bound (taken, or not an address of
    this machine).  gunicorn binds with SO_REUSEADDR, and so does this probe."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process "
                f"holds the port? choose another with --port or RUNSTILE_PORT)") from None


def until_available(what: str, step: Callable[[], object], wait: Callable[[float], bool],
                    say: Callable[..., None]) -> bool:
    """``step()`` again and again while the ledger is unavailable (busy past the busy
    timeout, its server restarting), with one line through ``say`` each time; False when
    ``wait(seconds)`` says a stop signal came first.  Any other error is raised: a damaged
    ledger, or a second live node of the same name, stops the start as before.

    Every boot step may be repeated: taking the node lock changes nothing until it
    succeeds, a generation that moved twice only grows, and a recovery pass repeated
    equals one pass."""
    pause = RETRY_S
    while True:
        try:
            step()
            return True
        except LedgerUnavailable as exc:
            say(f"runstile: {what}: {exc.message}; trying again in {pause:g}s", err=True,
                level="WARNING")
        if wait(pause):
            return False
        pause = min(2 * pause, RETRY_MAX_S)
