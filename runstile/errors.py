"""One error tree (docs/architecture.md).  Every error runstile raises derives from RunstileError.

Errors that reach a client carry a stable ``code`` (docs/api.md) and an HTTP ``status``;
``web/errors.py`` is the one place that turns them into responses.
"""

from __future__ import annotations

import urllib.parse
from typing import Any


class RunstileError(Exception):
    """Raised when runstile cannot do what was asked; the base of every runstile error."""

    code = "internal_error"
    status = 500

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.details = details


class ConfigError(RunstileError):
    """Raised when a setting (environment variable or flag) has an invalid value."""

    code = "invalid_config"
    status = 500


class LedgerUnavailable(RunstileError):
    """Raised when the ledger cannot be written: busy past the timeout, I/O error, disk full, read-only."""

    code = "run_storage_unavailable"
    status = 503


class LedgerCorrupt(RunstileError):
    """Raised when the ledger fails an integrity or schema check."""

    code = "ledger_corrupt"
    status = 503


class AdmissionWriterFailed(RunstileError):
    """Raised when the admission writer met an unexpected error on a request (a bug; the
    writer logs it): answered 500 internal_error, and nothing of the request committed."""


class ReplayUndecided(RunstileError):
    """Raised when a body re-runs past a journaled approval request that has no decision
    (a run re-queued while waiting for its approval): the run fails instead of asking
    twice."""


class Unauthorized(RunstileError):
    """Raised when a request has no valid, unrevoked API key."""

    code = "unauthorized"
    status = 401


class InvalidRequest(RunstileError):
    """Raised when a request body or query does not match the schema."""

    code = "invalid_request"
    status = 400


class InvalidJson(InvalidRequest):
    """Raised when a request body is not valid JSON (I-JSON: no NaN, no duplicate keys)."""

    code = "invalid_json"


class InvalidIdempotencyKey(InvalidRequest):
    """Raised when an Idempotency-Key header is empty, too long, not visible ASCII or reserved."""

    code = "invalid_idempotency_key"


class InvalidRunId(InvalidRequest):
    """Raised when a client run id is not ``run_`` followed by 32 lowercase hex digits."""

    code = "invalid_run_id"


class InvalidCallbackUrl(InvalidRequest):
    """Raised when a callback_url is not an http(s) URL runstile may deliver to."""

    code = "invalid_callback_url"


class UnknownTask(InvalidRequest):
    """Raised when a new run names a task that is not registered."""

    code = "unknown_task"


class PayloadTooLarge(RunstileError):
    """Raised when a request body exceeds RUNSTILE_MAX_BODY_BYTES."""

    code = "payload_too_large"
    status = 413


class UnsupportedMediaType(RunstileError):
    """Raised when a request body is not declared as application/json."""

    code = "unsupported_media_type"
    status = 415


class StreamsExhausted(RunstileError):
    """Raised when this web process already serves RUNSTILE_MAX_STREAMS event streams."""

    code = "too_many_streams"
    status = 503


class StreamsPerKeyExhausted(RunstileError):
    """Raised when a key already holds RUNSTILE_MAX_STREAMS_PER_KEY streams in this process."""

    code = "too_many_streams_for_key"
    status = 429


class ListQueryTimeout(RunstileError):
    """Raised when a list query runs past RUNSTILE_LIST_QUERY_TIMEOUT_MS and is cut off."""

    code = "list_query_timeout"
    status = 503


class RunNotFound(RunstileError):
    """Raised when a run does not exist or is outside what the caller's key may see."""

    code = "run_not_found"
    status = 404


class DeliveryNotFound(RunstileError):
    """Raised when a delivery id is unknown or belongs to a run the key may not see."""

    code = "delivery_not_found"
    status = 404


class RouteNotFound(RunstileError):
    """Raised when no route matches the request path."""

    code = "not_found"
    status = 404


class MethodNotAllowed(RunstileError):
    """Raised when a route exists but not for the request's method."""

    code = "method_not_allowed"
    status = 405


class MalformedRequest(RunstileError):
    """Raised when the HTTP server cannot parse a request (bad header bytes, conflicting
    framing headers, a malformed chunked body); answered before any application code."""

    code = "malformed_request"
    status = 400


class RequestTimeout(RunstileError):
    """Raised when a request does not arrive whole within RUNSTILE_REQUEST_READ_TIMEOUT_S."""

    code = "request_timeout"
    status = 408


class RequestLineTooLong(RunstileError):
    """Raised when a request line is longer than the server accepts."""

    code = "request_line_too_long"
    status = 414


class RequestHeadersTooLarge(RunstileError):
    """Raised when a request's head (or a chunked body's trailers) is larger than the server accepts."""

    code = "request_headers_too_large"
    status = 431


class ExpectationFailed(RunstileError):
    """Raised when a request carries an ``Expect`` header other than 100-continue."""

    code = "expectation_failed"
    status = 417


class UnsupportedTransferCoding(RunstileError):
    """Raised when a request's Transfer-Encoding is not one the server implements."""

    code = "unsupported_transfer_coding"
    status = 501


class Conflict(RunstileError):
    """Raised when a request conflicts with what the ledger already holds."""

    code = "conflict"
    status = 409


class IdempotencyKeyConflict(Conflict):
    """Raised when an idempotency key is reused with a different request."""

    code = "idempotency_key_conflict"


class RunIdConflict(Conflict):
    """Raised when a client run id is taken (the answer never says by whom)."""

    code = "run_id_conflict"


class AdmissionRace(Conflict):
    """Raised when another writer bound the same key or run id between an admission's read and its write."""

    # Never answered: admission re-reads, which answers a replay or a 409 (after its
    # last retry a 503, docs/api.md "Reservation").
    code = "admission_race"


class ApprovalAlreadyResolved(Conflict):
    """Raised when an approval already decided one way is asked to be decided the other."""

    code = "approval_already_resolved"


class ApprovalNotPending(Conflict):
    """Raised when an approval id is unknown or the run is not waiting for approval."""

    code = "approval_not_pending"


class RunNotPaused(Conflict):
    """Raised when /resume is asked of a run that is not paused."""

    code = "run_not_paused"


class RunNotRetryable(Conflict):
    """Raised when /retry is asked of a run that is not failed, cancelled or interrupted."""

    code = "run_not_retryable"


class DeliverySettled(Conflict):
    """Raised when a delivered or discarded obligation is asked to be retried or discarded."""

    code = "delivery_settled"


class DeliveryInFlight(Conflict):
    """Raised when an obligation is discarded while an attempt to deliver it is under way."""

    code = "delivery_in_flight"


class IdempotencyKeyExpired(RunstileError):
    """Raised when a key or run id is only remembered as a tombstone after retention."""

    code = "idempotency_key_expired"
    status = 410


class CapacityExceeded(RunstileError):
    """Raised when a profile already holds RUNSTILE_MAX_ACTIVE_RUNS non-terminal runs."""

    code = "capacity_exceeded"
    status = 429


class NodeLocked(RunstileError):
    """Raised when another live process already holds this node's lock (an operator's
    mistake: the CLI exits 2)."""

    code = "node_locked"
    status = 500


class RunStopping(RunstileError):
    """Raised when a worker's journaled call meets a stop request for its run."""

    code = "run_stopping"
    status = 409


class LeaseLost(RunstileError):
    """Raised when a worker no longer holds the lease on the run it is executing."""

    code = "lease_lost"
    status = 409


class ApiError(RunstileError):
    """Raised when a runstile.Client call gets an error answer from the API, or none at all."""

    #: None when the server could not be reached: wider than the int every error the
    #: server raises carries, which is what RunstileError declares.
    status: int | None  # type: ignore[assignment]

    def __init__(self, status: int | None, code: str, message: str,
                 details: dict[str, Any] | None = None) -> None:
        # ``status`` is the HTTP status (None when the server could not be reached) and
        # ``code`` the stable code of the ``{"error": {...}}`` body; they shadow the
        # class defaults, since one class carries every code the server sends.
        super().__init__(message or code)
        self.status, self.code = status, code
        self.details = dict(details or {})

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what an error, a log line or
    a repr may say of a URL that holds a secret (RUNSTILE_DATABASE_URL)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname \
            else parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    except ValueError:
        return "<a URL that does not parse>"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
