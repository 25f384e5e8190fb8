"""``runstile up``: the whole system as one supervised process tree (docs/operations.md).

The supervisor holds the node lock for its whole life (node_lock_watch.py; taken again
after a lost ledger session), starts a new node generation, prints the URL (and a
bootstrap admin key on first start), then runs its children in its own process group
and shuts them all down on SIGINT/SIGTERM, however many arrive.  The signal handlers
only record the signal (runstile/signals.py); the main thread sees it within 0.1 s in
its watch loop and forwards SIGTERM to the children from there.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import click

from . import boot, filemodes, logs
from . import tasks as registry
from .config import Settings, metrics_shared_by_children, pass_ledger_to_children
from .ledger import db, keys, maintenance, migrations, nodes
from .node_lock_watch import LockWatch
from .recovery import reconcile
from .signals import StopSignals
from .workers.scheduler import Scheduler

#: How a child runs this installation's runstile (up's children, serve's re-exec).
#: ``-P``: ``-m`` would otherwise put the working directory first on sys.path, and a
#: ``runstile/`` folder there (a checkout of another version) would be what the children
#: run; task modules beside it are still found (tasks.load adds the working directory
#: once runstile is imported).
RUNSTILE = [sys.executable, "-P", "-m", "runstile"]

#: Seconds children get after the drain timeout before they are killed
#: (docs/operations.md, "Signals").
KILL_GRACE_S = 5.0
#: Seconds between two looks at the children and the signal pipe.
WATCH_S = 0.1


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None

    def started(self) -> subprocess.Popen:
        """The child's process: ``Supervisor._start`` lists a child once it runs."""
        assert self.proc is not None
        return self.proc


@dataclass
class Supervisor:
    settings: Settings
    web: bool = True
    children: list[Child] = field(default_factory=list)
    #: Set by the main thread alone, once it has forwarded SIGTERM to the children.
    stopping: bool = False
    signals: StopSignals | None = None
    watch: LockWatch | None = None
    #: The node's generation, once booted; moved only by the main thread, after the
    #: workers of the one before are dead (see :meth:`_rejoin`).
    generation: int = 0

    def say(self, message: str, *, err: bool = False, level: str = "INFO") -> None:
        """A line the supervisor prints itself: as it is, or (RUNSTILE_LOG_FORMAT=json)
        as one JSON object shaped as every log line."""
        if self.settings.log_format == "json":
            message = logs.json_line(message, node=self.settings.node_id,
                                     logger="runstile.up", level=level)
        click.echo(message, err=err)

    def _common_args(self) -> list[str]:
        args = ["--data-dir", str(self.settings.data_dir)]
        for module in self.settings.tasks:
            args += ["--tasks", module]
        return args

    def _queue_args(self) -> list[str]:
        """The node's queues, for its worker processes (flags or RUNSTILE_QUEUES alike)."""
        s, args = self.settings, []
        if s.queues:
            args += ["--queues", ",".join(s.queues)]
        if s.queue_threads:
            args += ["--queue-threads", ",".join(f"{q}={n}" for q, n in s.queue_threads)]
        return args

    def plan_web(self) -> list[Child]:
        s, runstile = self.settings, RUNSTILE
        if not self.web:
            return []
        return [Child("web", [
            *runstile, "serve", *self._common_args(), "--host", s.host, "--port",
            str(s.port), "--web-workers", str(s.web_workers), "--threads",
            str(s.web_threads)])]

    def plan_workers(self, generation: int) -> list[Child]:
        s, runstile = self.settings, RUNSTILE
        children = []
        for n in range(s.workers):
            children.append(Child(f"worker-{n + 1}", [
                *runstile, "worker-process", *self._common_args(), "--generation",
                str(generation), "--threads", str(s.threads), *self._queue_args()]))
        return children

    def _start(self, children: list[Child]) -> None:
        for child in children:
            child.proc = subprocess.Popen(child.argv)
            self.children.append(child)

    def bootstrap(self, generation: int) -> None:
        conn = db.connect(self.settings.ledger_target, synchronous=self.settings.synchronous,
                          busy_timeout_ms=self.settings.busy_timeout_ms)
        try:
            first_start = not keys.list_keys(conn)
            secret = keys.create(conn, "default", label="bootstrap", role="admin")[1] \
                if first_start else None
        finally:
            conn.close()
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.say(f"runstile is up: http://{host}:{self.settings.port}  "
                 f"(node {self.settings.node_id}, generation {generation}, "
                 f"data {self.settings.data_dir})")
        if secret:
            self.say("bootstrap admin key for profile 'default' (shown once, keep it):")
            self.say(f"  {secret}")
        if secret and registry.get("chat") is not None:
            # The key is printed once, above: logs and terminal scrollback are read by
            # more people than should hold an admin key (docs/guarantees.md).
            self.say(f"try, with KEY set to that key: curl -s -X POST "
                     f"http://{host}:{self.settings.port}/v1/runs "
                     "-H \"Authorization: Bearer $KEY\" -H 'Content-Type: application/json' "
                     "-d '{\"task\": \"chat\", \"input\": {\"text\": \"hi\"}}'")
        sys.stdout.flush()

    def _stop(self) -> None:
        """Forward SIGTERM to every child, once (main thread only, never a handler)."""
        if not self.stopping:
            self.stopping = True
            self._signal_children(signal.SIGTERM)

    def _signal_children(self, signum: int) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                try:
                    child.proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        logs.configure(self.settings.log_format, node=self.settings.node_id,
                       text_format="%(asctime)s %(levelname)s [supervisor] %(message)s")
        # From the start, a stop signal is seen by the main thread (runstile/signals.py).
        self.signals = StopSignals()
        watch = self.watch = LockWatch(self.settings, self.say)
        if not self._until_done("node lock", watch.acquire):
            return 0  # stopped before the lock was taken: nothing started
        try:
            if self.web:
                # Before a ledger, a key or a line: a port taken is a usage error.
                boot.check_port_free(self.settings.host, self.settings.port)
            with metrics_shared_by_children():
                pass_ledger_to_children(self.settings)
                return self._run_locked()
        finally:
            self.stopping = True
            watch.close()

    def _boot_generation(self) -> None:
        migrations.migrate(self.settings.ledger_target, synchronous=self.settings.synchronous,
                           busy_timeout_ms=self.settings.busy_timeout_ms)
        conn = db.connect(self.settings.ledger_target, synchronous=self.settings.synchronous,
                          busy_timeout_ms=self.settings.busy_timeout_ms)
        try:
            self.generation = nodes.boot(conn, self.settings.node_id)
        finally:
            conn.close()

    def _until_done(self, what: str, step: Callable[[], object]) -> bool:
        """``step()`` until the ledger answers; False when a stop signal came first."""
        assert self.signals is not None
        return boot.until_available(what, step, self.signals.wait, self.say)

    def _run_locked(self) -> int:
        assert self.signals is not None  # run() sets it first
        if not self._until_done("boot", self._boot_generation):
            return 0  # stopped before anything started
        generation = self.generation
        filemodes.warn_loose(self.settings.data_dir)
        registry.load(self.settings.tasks)  # recovery needs each task's on_crash
        # Built now, so a schedule that cannot be admitted stops the start (exit 2).
        scheduler = Scheduler(self.settings, registry.schedules())
        # The web starts first and answers /readyz 503 until the barrier opens; no
        # worker process exists before this boot's recovery has finished.
        self._start(self.plan_web())
        try:
            recovered = self._until_done("boot recovery",
                                         lambda: reconcile.boot(self.settings, generation))
        except Exception as exc:  # noqa: BLE001 - reported, then the node stops
            # No worker may start without this boot's recovery; stop what runs.
            self.say(f"runstile: boot recovery failed: {exc}", err=True, level="ERROR")
            self._stop()
            self._watch()
            return 1
        if not recovered or self.signals.received:
            return self._watch()  # stopped during boot: no worker starts
        return self._serve(generation, scheduler)

    def _web_listening(self) -> bool:
        """Wait until the web child accepts connections on its port (True), or exits
        (False)."""
        web = self.children[0].started()
        # Where to reach a server listening on the host (a wildcard: every address).
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(
            self.settings.host, self.settings.host)
        while web.poll() is None:
            try:
                socket.create_connection((host, self.settings.port), timeout=1).close()
                return True
            except OSError:
                time.sleep(WATCH_S)
            if self.signals is not None and self.signals.received:
                return False
        return False

    def _serve(self, generation: int, scheduler: Scheduler) -> int:
        """After the boot's recovery: the workers, scheduled recovery and the scheduler,
        watched until the node stops."""
        self._start(self.plan_workers(generation))
        threading.Thread(target=self._scheduled_recovery, name="runstile-recovery",
                         daemon=True).start()
        # After the barrier, like every consumer (docs/architecture.md, "The scheduler").
        scheduler.start()
        try:
            if not self.web:
                self.say(f"runstile workers up: node {self.settings.node_id}, generation "
                         f"{generation}, {self.settings.workers} processes x "
                         f"{self.settings.threads} threads")
            elif not self._web_listening():
                # The URL and a key are printed only for a web tier that listens.
                self.say(f"runstile: the web tier could not listen on {self.settings.host}:"
                         f"{self.settings.port}; stopping", err=True, level="ERROR")
                self._stop()
                self._watch()
                return 2
            else:
                self.bootstrap(generation)
            return self._watch()
        finally:
            scheduler.stop()

    def _scheduled_recovery(self) -> None:
        """A recovery pass every RUNSTILE_RECOVERY_INTERVAL_S while up, of the node's
        current generation, and none while the node lock is not held (the pass would
        speak for a generation that may already be over)."""
        while not self.stopping:
            time.sleep(self.settings.recovery_interval_s)
            if self.stopping:
                return
            if self.watch is None or not self.watch.holding():
                continue
            try:
                reconcile.run_pass(self.settings, generation=self.generation,
                                   trigger="scheduled")
            except Exception as exc:  # noqa: BLE001 - reported; the next pass tries again
                # A failed pass must never take the node down.
                self.say(f"runstile: scheduled recovery failed: {exc}", err=True, level="ERROR")

    def _watch(self) -> int:
        signals, watch = self.signals, self.watch
        assert signals is not None and watch is not None  # run() sets both first
        failed = False
        while not self.stopping:
            if signals.wait(WATCH_S):
                self._stop()
                break
            if watch.lost() and not self._rejoin():
                break  # stopped (or the web tier gone) while waiting for the lock
            for child in self.children:
                code = child.started().poll()
                if code is not None:
                    self.say(f"runstile: {child.name} exited with {code}; stopping", err=True,
                             level="ERROR")
                    failed = True
                    self._stop()
                    break
        failed = self._reap() or failed
        self._fold_wal()
        return 1 if failed else 0

    def _rejoin(self) -> bool:
        """After the node lock is lost: kill the workers, keep the web tier (it answers
        503 while the server is down), take the lock again and boot a new generation.
        False when a stop signal (or the web tier's exit) came first.

        At most once holds across the gap: the old generation's workers are SIGKILLed and
        reaped *before* the lock is taken again, so when :func:`nodes.boot` moves the
        generation none of them runs a body; their runs are then a dead generation's, for
        this boot's recovery pass (or a survivor's takeover, which may come first: the
        heartbeat's fencing covers the moment between the lost session and the kill).
        No new worker starts before that pass has run and opened the barrier."""
        assert self.watch is not None
        # Not a drain: the runs may be another node's already, and every moment a body
        # runs on is a moment two executions may overlap.
        self.say("runstile: lost the node lock (its ledger session ended); another node "
                 "may take over this node's runs: killing the workers", err=True,
                 level="ERROR")
        self._kill_workers()
        self.watch.drop()
        while self.watch.retake(self._pause):
            try:
                self._boot_generation()
                self.say(f"runstile: took the node lock again: generation {self.generation}; "
                         "recovering")
                reconcile.boot(self.settings, self.generation)
            except Exception as exc:  # noqa: BLE001 - the server went again: wait again
                self.say(f"runstile: boot after taking the node lock again failed: {exc}",
                         err=True, level="ERROR")
                self.watch.drop()
                continue
            self._start(self.plan_workers(self.generation))
            self.say(f"runstile: recovered; {self.settings.workers} worker processes up "
                     f"(node {self.settings.node_id}, generation {self.generation})")
            return True
        return False

    def _kill_workers(self) -> None:
        """SIGKILL every worker process and wait until each is gone; the web stays."""
        workers = [c for c in self.children if c.name.startswith("worker-")]
        for child in workers:
            with contextlib.suppress(ProcessLookupError):
                child.started().kill()
        for child in workers:
            child.started().wait()
            self.children.remove(child)
        self.say(f"runstile: {len(workers)} worker processes killed; waiting to take the "
                 "node lock again", err=True, level="WARNING")

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``; True to stop instead (a stop signal, or the web tier gone)."""
        assert self.signals is not None
        return self.signals.wait(seconds) or any(c.started().poll() is not None
                                                 for c in self.children)

    def _reap(self) -> bool:
        """SIGTERM (the drain), then SIGKILL what is left; True when the node stopped
        while not holding its lock (it did not stop well)."""
        self._stop()
        deadline = time.monotonic() + self.settings.drain_timeout_s + KILL_GRACE_S
        while time.monotonic() < deadline and any(c.started().poll() is None
                                                  for c in self.children):
            time.sleep(0.05)
        self._signal_children(signal.SIGKILL)
        for child in self.children:
            child.started().wait()
        return self.watch is not None and self.watch.held is None

    def _fold_wal(self) -> None:
        """Fold the WAL into ledger.db once every child is gone, so that the main file
        alone is complete after a clean stop (the WAL is never optional, but operators
        copying files by hand should not be one step from losing acknowledged runs)."""
        try:
            maintenance.fold_wal(self.settings.ledger_target)
        except Exception as exc:  # noqa: BLE001 - reported; the WAL stays valid either way
            self.say(f"runstile: could not fold the WAL into the ledger: {exc}", err=True,
                     level="ERROR")
