"""Run statuses and the transitions between them (docs/architecture.md, "Run lifecycle").
Pure: no I/O."""

from __future__ import annotations

import enum
from collections.abc import Iterable


# Not enum.StrEnum: it would change str() and format() of a member ("queued" instead of
# "RunStatus.QUEUED"), and sql_list sorts by str().
class RunStatus(str, enum.Enum):  # noqa: UP042 - see above
    QUEUED = "queued"
    RUNNING = "running"
    STOPPING = "stopping"
    WAITING_FOR_APPROVAL = "waiting_for_approval"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED,
                      RunStatus.INTERRUPTED})
NON_TERMINAL = frozenset(RunStatus) - TERMINAL
#: The statuses a run may be retried from: it ended without its result (docs/api.md,
#: "POST /v1/runs/{run_id}/retry").  Terminal, so a run read in one of them stays in it.
RETRYABLE = frozenset({RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED})

#: Every edge of the lifecycle diagram (docs/architecture.md, "Run lifecycle").
TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset({RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.RUNNING: frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.QUEUED,
                                  RunStatus.WAITING_FOR_APPROVAL, RunStatus.STOPPING,
                                  RunStatus.PAUSED, RunStatus.INTERRUPTED}),
    RunStatus.WAITING_FOR_APPROVAL: frozenset({RunStatus.QUEUED, RunStatus.CANCELLED}),
    RunStatus.STOPPING: frozenset({RunStatus.CANCELLED}),
    RunStatus.PAUSED: frozenset({RunStatus.QUEUED, RunStatus.CANCELLED}),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
    RunStatus.INTERRUPTED: frozenset(),
}


def can_transition(source: RunStatus | str, target: RunStatus | str) -> bool:
    return RunStatus(target) in TRANSITIONS[RunStatus(source)]


def sql_list(statuses: Iterable[RunStatus | str]) -> str:
    """A literal SQL list of statuses, for queries over fixed sets (no user input)."""
    return "(" + ", ".join(f"'{RunStatus(s).value}'" for s in sorted(statuses, key=str)) + ")"
