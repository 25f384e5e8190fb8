"""The admission writer's wire format: length-prefixed JSON frames, and what they carry.

Both ends import it: a web process (``client.py``) encodes a reservation and decodes the
answer; the writer (``server.py``) decodes the reservation and encodes the answer.  Both
ends always run the same code (``serve`` starts the writer from its own installation).

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON.

A request is one ``admission.Reservation`` as a flat JSON list of its fields, in the
dataclass's field order, with a field that is itself a dataclass (``AdmissionRequest``,
its ``Principal``) spelled out in place: ``[profile_id, key_id, role, key, ...,
fingerprint_version, refusal, max_active_runs, enqueue]``.  The list is derived from
``dataclasses.fields``, so a field added to any of the three travels to the writer with
no change here.  Two fields are not JSON values and are named in ``_NOT_JSON``: the
``refusal`` (an error, sent as its class name, message and details) and ``enqueue`` (a
function, sent as whether there is one: the writer puts its own in its place).

An answer is ``["new", run id, seq, clock, dispatch_id]`` for a new run whose row is the
one its request makes (``admission_rows.run_row``; the web process, which holds the
request, rebuilds it), ``["ok", run, replayed, dispatch_id]`` for any other admitted run,
``["refused", class name, message, details]``, ``["race", reason]`` (a uniqueness race:
raised as ``AdmissionRace``, which ``admission.admit`` answers by re-reading) or
``["failed", reason]`` (a bug in the writer).
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, get_type_hints

from ... import errors
from ...config import Settings
from ...errors import AdmissionRace, AdmissionWriterFailed, RunstileError
from ...ledger import admission, admission_rows, db, group_commit, runs

#: The length before each frame's payload.
LENGTH = struct.Struct(">I")
#: Frames carry one request body's input and its run (two copies of the input at most).
_FRAME_SLACK = 64 * 1024

_T = TypeVar("_T")

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def max_frame(settings: Settings) -> int:
    """The largest frame either end accepts: a bigger one is no admission of ``settings``."""
    return 4 * settings.max_body_bytes + _FRAME_SLACK


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


#: struct timeval, as SO_RCVTIMEO and SO_SNDTIMEO take it (two C longs on Linux; the
#: second is read as an int on macOS, which little-endian order makes the same bytes).
_TIMEVAL = struct.Struct("@ll")


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking, each send and receive bounded by the kernel at ``seconds``.

    A Python socket timeout (``settimeout``) polls before every send and receive: one
    more system call, and one more release and retake of the GIL, each way of every
    admission, under contention from the web process's other threads.  The kernel's
    own timeouts bound the same calls without it; one that expires raises an OSError
    (EAGAIN), as a Python timeout raises one (``TimeoutError``)."""
    sock.settimeout(None)
    whole = int(seconds)
    value = _TIMEVAL.pack(whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def recv_frame(sock: socket.socket, buffer: bytearray, limit: int) -> bytes:
    """The payload of the next frame on ``sock``, which carries one frame at a time (a
    request's answer).  Read into ``buffer`` (reused; an answer usually arrives in one
    read, length and payload together); ConnectionError for an end of stream or a
    frame over ``limit`` bytes."""
    view = memoryview(buffer)
    got = 0
    need = LENGTH.size
    while got < need:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the admission writer closed the connection")
        got += n
        if need == LENGTH.size and got >= need:
            (length,) = LENGTH.unpack_from(buffer)
            if length > limit:
                raise ConnectionError(f"an answer of {length} bytes is larger than any "
                                      f"admission")
            need += length
            if need > len(buffer):
                view.release()  # a bytearray with a view on it cannot grow
                buffer.extend(bytes(need - len(buffer)))
                view = memoryview(buffer)
    payload = bytes(view[LENGTH.size:need])
    view.release()
    return payload


# ------------------------------------------------------------------ errors

def _error_fields(exc: RunstileError) -> list[Any]:
    return [type(exc).__name__, exc.message, exc.details]


def _error_from(fields: list[Any]) -> RunstileError:
    name, message, details = fields
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, RunstileError)):
        cls = RunstileError  # a newer writer's error: still an error, with its message
    return cls(message, **details)


# ------------------------------------------------------------------ requests

#: The fields that are not JSON values: (how a web process sends one, how the writer
#: reads it back given its own enqueue).  Every other field is sent as it is.
_NOT_JSON: dict[str, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {
    "refusal": (lambda exc: None if exc is None else _error_fields(exc),
                lambda sent, enqueue: None if sent is None else _error_from(sent)),
    "enqueue": (lambda fn: fn is not None,
                lambda sent, enqueue: enqueue if sent else None),
}


#: ``_layout`` of each class met, computed once (two threads may both compute one: the
#: same answer, so the race is harmless).
_LAYOUTS: dict[type, tuple[tuple[str, type | None], ...]] = {}


def _layout(cls: type) -> tuple[tuple[str, type | None], ...]:
    """``(name, dataclass or None)`` per field of dataclass ``cls``, in order: the
    dataclass when the field holds one (spelled out in place on the wire)."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        hints = get_type_hints(cls)
        layout = _LAYOUTS[cls] = tuple(
            (f.name, hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None)
            for f in dataclasses.fields(cls))
    return layout


def _width(cls: type) -> int:
    """How many wire values one ``cls`` takes."""
    return sum(1 if nested is None else _width(nested) for _, nested in _layout(cls))


def _flatten(obj: object, out: list[Any]) -> list[Any]:
    for name, nested in _layout(type(obj)):
        value = getattr(obj, name)
        if nested is not None:
            _flatten(value, out)
        else:
            out.append(_NOT_JSON[name][0](value) if name in _NOT_JSON else value)
    return out


def _build(cls: type[_T], values: Iterator[Any], enqueue: runs.Enqueue | None) -> _T:
    fields: dict[str, Any] = {}
    for name, nested in _layout(cls):
        if nested is not None:
            fields[name] = _build(nested, values, enqueue)
        elif name in _NOT_JSON:
            fields[name] = _NOT_JSON[name][1](next(values), enqueue)
        else:
            fields[name] = next(values)
    return cls(**fields)


def encode_request(res: admission.Reservation) -> bytes:
    return _dumps(_flatten(res, [])).encode()


def decode_request(data: bytes, enqueue: runs.Enqueue | None) -> admission.Reservation:
    """The reservation a web process sent.  ``enqueue`` is the writer's own in-transaction
    enqueue (same settings as the web's); a request sent without one gets none.  Raises
    ValueError or TypeError for anything but a whole request."""
    values = json.loads(data)
    cls = admission.Reservation  # read at each call: a test may widen it
    if not isinstance(values, list) or len(values) != _width(cls):
        raise ValueError(f"an admission request is a list of {_width(cls)} values")
    return _build(cls, iter(values), enqueue)


# ------------------------------------------------------------------ answers

def encode_outcome(unit: group_commit.Unit) -> bytes:
    if unit.error is None:
        admitted = unit.result
        run = admitted.run
        if not admitted.replayed and _rebuilt(unit.work, run) == run:
            # Most answers: three values instead of the row, whose input the web process
            # sent and would only read back.  Measured on 2 cores: 23 -> 15 us per
            # admission for the answer's encode and decode, and an input's bytes cross
            # the socket once instead of twice.  Checked, not assumed: a row written
            # another way (a reservation decided on its own) goes whole.
            return _dumps(["new", run["id"], run["seq"], run["created_at"],
                           admitted.dispatch_id]).encode()
        return _dumps(["ok", run, admitted.replayed, admitted.dispatch_id]).encode()
    if isinstance(unit.error, RunstileError):
        return _dumps(["refused", *_error_fields(unit.error)]).encode()
    if isinstance(unit.error, db.INTEGRITY_ERRORS):
        # A uniqueness race: admission.admit re-reads and answers a replay or a 409.
        return _dumps(["race", str(unit.error)]).encode()
    return _dumps(["failed", f"{type(unit.error).__name__}: {unit.error}"]).encode()


def _rebuilt(res: object, run: dict[str, Any]) -> dict[str, Any] | None:
    """The row a web process rebuilds for ``run`` from the request it sent (None: the
    unit is not a reservation, so there is no request to rebuild from)."""
    if not isinstance(res, admission.Reservation):
        return None
    return admission_rows.run_row(res.req, run["id"], run["seq"], run["created_at"])


def decode_outcome(data: bytes, sent: admission.Reservation) -> admission.Admitted:
    """The writer's answer to ``sent`` as admission.admit would have returned or raised it."""
    outcome = json.loads(data)
    kind = outcome[0]
    if kind == "new":
        _, run_id, seq, now, dispatch_id = outcome
        return admission.Admitted(admission_rows.run_row(sent.req, run_id, seq, now),
                                  replayed=False, dispatch_id=dispatch_id)
    if kind == "ok":
        return admission.Admitted(outcome[1], replayed=outcome[2], dispatch_id=outcome[3])
    if kind == "refused":
        raise _error_from(outcome[1:])
    if kind == "race":
        raise AdmissionRace(outcome[1])
    raise AdmissionWriterFailed(f"the admission writer failed: {outcome[1]}")
