"""Turning a POST /v1/runs into an AdmissionRequest, check by check in the order of
docs/api.md, "Check order"; and a retry of a finished run into one (:func:`build_retry`).

Order after auth: body size → content type → JSON → Idempotency-Key syntax → schema →
run_id syntax.  The checks that apply only to new runs (callback_url, task known,
capacity) are decided here but *raised* inside the reservation, so replays answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, cast

from .. import tasks as registry
from ..errors import (
    InvalidCallbackUrl,
    InvalidIdempotencyKey,
    InvalidJson,
    InvalidRequest,
    InvalidRunId,
    PayloadTooLarge,
    RunstileError,
    UnknownTask,
    UnsupportedMediaType,
)
from ..fingerprint import (
    FINGERPRINT_VERSION,
    RETRY_FIELDS,
    NotCanonicalisable,
    fields_for,
    fingerprint,
)
from ..jsondepth import MAX_DEPTH, deep_field, text_too_deep
from ..ledger.admission import AdmissionRequest
from ..ledger.broker_queue import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from ..ledger.keys import Principal
from ..netguard import callback_refusal
from . import delay

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment
    from werkzeug.wrappers import Request  # Flask's request is one

    from ..config import Settings

RUN_ID_PATTERN = "run_[0-9a-f]{32}"
_RUN_ID = re.compile(RUN_ID_PATTERN)
#: Idempotency keys: 1-255 visible ASCII characters (code points 33-126, "!" to "~");
#: the OpenAPI document states the same pattern.
IDEMPOTENCY_KEY_PATTERN = "[!-~]{1,255}"
_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)
LEGACY_PREFIX = "legacy-run:"
FIELDS = {"task", "input", "run_id", "session_key", "trigger_id", "callback_url", "metadata",
          "priority", "delay_s", "not_before"}
MAX_METADATA_KEYS = 32
MAX_METADATA_VALUE = 512
MAX_METADATA_KEY = 128
MAX_TEXT = 256
MAX_TASK_NAME = 128


def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw body, refusing more than the cap whether or not Content-Length is sent.

    Read by hand rather than through werkzeug's MAX_CONTENT_LENGTH: for a chunked body
    werkzeug's limit silently truncates instead of refusing, which would turn a 413
    into a misleading invalid_json.
    """
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise PayloadTooLarge(f"the body is larger than {max_body_bytes} bytes")
    stream = request.stream
    chunks: list[bytes] = []
    total = 0
    if length is not None:
        # The common case: one read of the declared length (gunicorn stops at it).
        return stream.read(length) if length else b""
    while True:
        chunk = stream.read(min(65536, max_body_bytes + 1 - total))
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_body_bytes:
            raise PayloadTooLarge(f"the body is larger than {max_body_bytes} bytes")
        chunks.append(chunk)


def require_json_content_type(request: Request) -> None:
    mimetype = (request.mimetype or "").lower()
    if mimetype != "application/json" and not (
            mimetype.startswith("application/") and mimetype.endswith("+json")):
        raise UnsupportedMediaType("send the body as application/json")
    charset = request.mimetype_params.get("charset")
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise UnsupportedMediaType("the body must be UTF-8")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate object key {key!r}")
        seen[key] = value
    return seen


def parse_json(raw: bytes) -> Any:
    """Strict I-JSON: UTF-8, no NaN/Infinity, no duplicate keys, no value in the body
    nested deeper than MAX_DEPTH (docs/api.md "JSON depth")."""
    # The body object is one level itself, so its fields may nest MAX_DEPTH below it.
    # Checked on the text, before parsing: json.loads recurses per level, and how deep it
    # can go depends on the stack of the thread that calls it.  Counting brackets (in C)
    # spares the scan for every body that cannot be too deep.
    if text_too_deep(raw, MAX_DEPTH + 1):
        name = deep_field(raw, MAX_DEPTH + 1)
        raise InvalidJson(_too_deep(name or "the body"),
                          **({"field": name} if name is not None else {}))
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant,
                          object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise InvalidJson(_too_deep("the body")) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidJson(f"the body is not valid JSON: {exc}") from None


def _too_deep(name: str) -> str:
    # Deeper, a value could be stored and then break every read of it.
    return f"{name} nests deeper than the limit of {MAX_DEPTH} levels of arrays and objects"


def parse_idempotency_key(environ: WSGIEnvironment) -> str | None:
    """The header's value, read from the WSGI environ: werkzeug's header view would walk
    the whole environ for it.  (A server folds repeated headers into one environ value,
    "a,b"; as before, that value is then checked as one key.)"""
    key: str | None = environ.get("HTTP_IDEMPOTENCY_KEY")
    if key is None:
        return None
    if not _KEY.fullmatch(key):
        raise InvalidIdempotencyKey(
            "Idempotency-Key must be 1-255 visible ASCII characters (no spaces); "
            "an empty value is invalid")
    if key.startswith(LEGACY_PREFIX):
        raise InvalidIdempotencyKey(f"the prefix {LEGACY_PREFIX!r} is reserved")
    return key


def _unicode(value: str, name: str) -> None:
    """Refuse a string holding a lone surrogate (JSON can spell one, "\\ud800"; UTF-8
    cannot store it), naming the field it is in rather than failing later as input."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name} contains a lone surrogate (\\ud800-\\udfff), which is "
                             "not a Unicode character", field=name) from None


def _text(body: dict[str, Any], name: str, limit: int = MAX_TEXT, *,
          no_control: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= limit:
        raise InvalidRequest(f"{name} must be a string of 1-{limit} characters", field=name)
    _unicode(value, name)
    if no_control and any(ord(c) < 32 or 127 <= ord(c) < 160 for c in value):
        raise InvalidRequest(f"{name} must not contain control characters", field=name)
    return value


def _callback_url(body: dict[str, Any]) -> str | None:
    value = body.get("callback_url")
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest("callback_url must be a string", field="callback_url")
    _unicode(value, "callback_url")
    return value


def _metadata(body: dict[str, Any]) -> dict[str, str] | None:
    value = body.get("metadata")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("metadata must be an object", field="metadata")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"metadata has more than {MAX_METADATA_KEYS} keys", field="metadata")
    for key, item in value.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata keys must be 1-{MAX_METADATA_KEY} characters",
                                 field="metadata")
        _unicode(key, "metadata")  # a key that cannot be spelled cannot name its field
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata.{key} must be a string of at most "
                                 f"{MAX_METADATA_VALUE} characters", field=f"metadata.{key}")
        _unicode(item, f"metadata.{key}")
    return value


def build(request: Request, principal: Principal, *, settings: Settings,
          task_names: Collection[str]) -> tuple[AdmissionRequest, RunstileError | None]:
    """Validate one POST /v1/runs; return the request and the refusal for a new run.

    The checks run in the order docs/api.md ("Check order") states: body size, content
    type, JSON, the key's syntax, the schema, the run id's syntax.  The refusal (a bad
    callback URL, an unknown task) is raised later, only if a new run would be created.
    """
    raw = read_body(request, settings.max_body_bytes)
    require_json_content_type(request)
    body = parse_json(raw)
    header_key = parse_idempotency_key(request.environ)
    fields = _schema(body, settings.default_task)
    try:
        digest = fingerprint(fields, fields_for(fields))
    except NotCanonicalisable as exc:
        raise InvalidRequest(f"input cannot be canonicalised (RFC 8785): {exc}",
                             field="input") from None
    run_id, metadata = fields["run_id"], fields["metadata"]
    key, derived = _key(header_key, run_id)
    # _schema refused a body without a task when there is no default one.
    task = cast(str, fields["task"] or settings.default_task)
    not_before = fields["not_before"]
    return AdmissionRequest(
        principal=principal, key=key, key_is_derived=derived, run_id=run_id, task=task,
        input_json=compact_json(fields["input"]), session_key=fields["session_key"],
        trigger_id=fields["trigger_id"],
        metadata_json=None if metadata is None else compact_json(metadata),
        callback_url=fields["callback_url"], fingerprint=digest,
        fingerprint_version=FINGERPRINT_VERSION,
        priority=DEFAULT_PRIORITY if fields["priority"] is None else fields["priority"],
        delay_s=None if fields["delay_s"] is None else float(fields["delay_s"]),
        not_before=None if not_before is None else delay.unix_seconds(not_before),
        queue=registry.queue_of(task),
    ), _refusal(fields["callback_url"], task, task_names, settings.callback_allowlist)


def build_retry(original: dict[str, Any], caller: Principal, key: str | None, *,
                settings: Settings, task_names: Collection[str]
                ) -> tuple[AdmissionRequest, RunstileError | None]:
    """The admission of a retry of ``original``, a visible failed, cancelled or interrupted
    run's row, under the request's Idempotency-Key ``key``; and the refusal for a new run
    (docs/api.md, "POST /v1/runs/{run_id}/retry").

    Built from the row, never from a body: the original's task, input, session key,
    trigger id, metadata and callback URL, in the original's scope (so an admin key's
    retry of another key's run, and its Idempotency-Key, live in that key's scope).  The
    fingerprint covers ``retry_of`` too (RETRY_FIELDS): never a plain admission's.
    """
    metadata = original["metadata"]
    normalised = {"task": original["task"], "input": json.loads(original["input"]),
                  "run_id": None, "session_key": original["session_key"],
                  "trigger_id": original["trigger_id"],
                  "callback_url": original["callback_url"],
                  "metadata": None if metadata is None else json.loads(metadata),
                  "retry_of": original["id"]}
    return AdmissionRequest(
        # Admission reads a principal's scope, never its role.
        principal=Principal(original["profile_id"], original["key_id"], caller.role),
        key=key, key_is_derived=False, run_id=None, task=original["task"],
        input_json=original["input"], session_key=original["session_key"],
        trigger_id=original["trigger_id"], metadata_json=metadata,
        callback_url=original["callback_url"],
        fingerprint=fingerprint(normalised, RETRY_FIELDS),
        fingerprint_version=FINGERPRINT_VERSION, retry_of=original["id"],
        priority=original["priority"], queue=registry.queue_of(original["task"]),
    ), _refusal(original["callback_url"], original["task"], task_names,
                settings.callback_allowlist)


def _schema(body: Any, default_task: str | None) -> dict[str, Any]:
    """The body's fields, checked and normalised (absent optional fields as None): what
    the fingerprint is computed over."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}", field=unknown[0])
    task = _text(body, "task", MAX_TASK_NAME)
    if task is None and default_task is None:
        raise InvalidRequest("task is required", field="task")
    run_id = body.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise InvalidRequest("run_id must be a string", field="run_id")
    fields = {"task": task, "input": body.get("input"), "run_id": run_id,
              "session_key": _text(body, "session_key", no_control=True),
              "trigger_id": _text(body, "trigger_id"), "callback_url": _callback_url(body),
              "metadata": _metadata(body), "priority": _priority(body), **delay.fields(body)}
    if run_id is not None and not _RUN_ID.fullmatch(run_id):
        raise InvalidRunId(f"run_id must look like run_<32 lowercase hex>, matching "
                           f"{RUN_ID_PATTERN} in full", field="run_id")
    return fields


def _priority(body: dict[str, Any]) -> int | None:
    """``priority``: an integer from MIN_PRIORITY to MAX_PRIORITY, or None when absent
    (docs/api.md, "POST /v1/runs").  A bool is no integer here, nor is 5.0."""
    if "priority" not in body:
        return None
    value = body["priority"]
    if type(value) is not int or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidRequest(f"priority must be an integer from {MIN_PRIORITY} to "
                             f"{MAX_PRIORITY}", field="priority")
    return value


def _key(header_key: str | None, run_id: str | None) -> tuple[str | None, bool]:
    """The idempotency key and whether it is derived from the run id (docs/api.md)."""
    if header_key is not None:
        return header_key, False
    if run_id is not None:
        return LEGACY_PREFIX + run_id, True
    return None, False


#: Task names an unknown_task message lists (GET /v1/capabilities lists every one).
MAX_LISTED_TASKS = 20


def _refusal(callback_url: str | None, task: str, task_names: Collection[str],
             allowlist: tuple[str, ...]) -> RunstileError | None:
    """What refuses a *new* run (a replay still answers): a callback URL delivery would
    refuse, or a task no process here registers."""
    reason = None if callback_url is None else callback_refusal(callback_url, allowlist)
    if reason is not None:
        return InvalidCallbackUrl(reason, field="callback_url")
    if task not in task_names:
        known = ", ".join(sorted(task_names)[:MAX_LISTED_TASKS]) or "none"
        more = f" and {len(task_names) - MAX_LISTED_TASKS} more" \
            if len(task_names) > MAX_LISTED_TASKS else ""
        return UnknownTask(f"no task named {task!r} is registered; registered: "
                           f"{known}{more} (GET /v1/capabilities lists them)"[:1000],
                           field="task")
    return None


#: json.dumps(value, separators=(",", ":"), ensure_ascii=False), without building an
#: encoder per call (json.dumps does that whenever it is given options).
compact_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
