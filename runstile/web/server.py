"""Running the web tier under gunicorn: several processes, threaded workers.

Threads, not sync workers: an event stream holds its connection for minutes, and a sync
worker would be blocked by one stream and killed at its timeout.  Each process reads
requests whole in its event loop before a thread sees them (web/gthread.py), so a slow
client holds no thread.  The app is built in each worker after fork (no preload), so no
ledger connection crosses a fork (docs/architecture.md, "The web tier").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# gunicorn's C request parser (http_parser = "fast" below).  gunicorn itself looks for it
# only when the first request is parsed, and would then fail every request; imported here,
# a missing one stops `serve` before it listens.
import gunicorn_h1c  # noqa: F401
from gunicorn.app.base import BaseApplication

from .. import logs
from ..config import Settings, metrics_shared_by_children
from ..filemodes import PRIVATE_UMASK
from .gthread import BufferingThreadWorker
from .writer import WriterProcess

if TYPE_CHECKING:
    from flask import Flask
    from gunicorn.arbiter import Arbiter
    from gunicorn.workers.base import Worker


def _bind(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{host}:{settings.port}"


class _Gunicorn(BaseApplication):
    def __init__(self, settings: Settings, writer_socket: str | None, metrics_dir: str) -> None:
        self.settings = settings
        self.writer_socket = writer_socket
        self.metrics_dir = metrics_dir
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        for name, value in {
            "bind": [_bind(s)],
            "workers": s.web_workers,
            # gthread whose event loop reads each request whole before a thread sees
            # it, answers what it refuses as JSON (web/gthread.py), and whose signal
            # handlers only set flags (web/worker_signals.py).
            "worker_class": BufferingThreadWorker,
            "threads": s.web_threads,
            # gunicorn_h1c's C parser, not gunicorn's pure-Python one: the Python parser
            # was a quarter of a web process's instructions per admission
            # (docs/architecture.md, "gunicorn with gthread workers").  "fast", not
            # "auto": never the Python parser quietly, at a quarter more per request.
            "http_parser": "fast",
            # gthread's timeout watches the worker's main loop, not a request, so a
            # long event stream never trips it.
            "timeout": 30,
            "graceful_timeout": 10,
            "keepalive": 5,
            "preload_app": False,
            "accesslog": None,
            "errorlog": "-",
            "loglevel": "warning",
            "proc_name": "runstile-web",
            # gunicorn's own default is 0 (files it creates open to everyone); serve
            # already runs with umask 077 (docs/operations.md, "File modes").
            "umask": PRIVATE_UMASK,
            "child_exit": self._child_exit,
        }.items():
            self.cfg.set(name, value)
        if s.log_format == "json":
            self.cfg.set("logconfig_dict", logs.gunicorn_config(s.node_id))

    def load(self) -> Flask:
        from . import create_app
        # After fork, in each web process: the app's own lines, in RUNSTILE_LOG_FORMAT.
        logs.configure(self.settings.log_format, node=self.settings.node_id,
                       text_format="%(asctime)s %(levelname)s [web %(process)d] %(message)s")
        return create_app(self.settings, writer_socket=self.writer_socket,
                          metrics_dir=self.metrics_dir)

    def _child_exit(self, server: Arbiter, worker: Worker) -> None:
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid, self.metrics_dir)


def run_gunicorn(settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT.  Metrics of all processes meet in one scratch folder.

    The folder is in the system's temporary directory, never beside the ledger:
    prometheus_client writes its files through mmap into sparse pages, and a process
    that touches a new page on a full filesystem dies of SIGBUS — a full ledger disk
    must cost 503s, not web processes killed as fast as gunicorn can fork them.
    """
    # Under ``runstile up`` the supervisor made the folder for the whole node (web and
    # workers); it, or an operator's PROMETHEUS_MULTIPROC_DIR, is used and kept as it is.
    with metrics_shared_by_children() as metrics_dir:
        writer = WriterProcess(settings) if settings.admission_writer == "process" else None
        try:
            if writer is not None:
                # Before the web processes: their first admissions find it listening.
                writer.start()
            _Gunicorn(settings, None if writer is None else writer.path, metrics_dir).run()
        finally:
            if writer is not None:
                # After gunicorn returned: every web process has finished its requests.
                writer.stop()
