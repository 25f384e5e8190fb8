"""Request fingerprints (docs/api.md, "POST /v1/runs"): SHA-256 of the RFC 8785 (JCS) canonical body.

The version is stored with every fingerprint so that a future change of normalisation
can compare old records with the old rules instead of refusing honest retries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785

#: Bump when normalisation or canonicalisation changes; stored with each record.
FINGERPRINT_VERSION = 1
#: The body fields that take part, each normalised to null when absent.
FIELDS = ("task", "input", "run_id", "session_key", "trigger_id", "callback_url", "metadata")
#: What a retry's fingerprint is over (docs/api.md, "POST /v1/runs/{run_id}/retry"): the
#: original run's fields and its id.  No plain admission's canonical body holds
#: ``retry_of``, so an Idempotency-Key used for one can never replay the other.
RETRY_FIELDS = (*FIELDS, "retry_of")
#: An admission whose body holds ``priority`` (docs/api.md, "POST /v1/runs"): the field
#: takes part only when present, as the integer it is, so a body without it keeps the
#: canonical form it had before priorities existed and every stored record still
#: replays.  ``{"priority": 5}`` and no priority are therefore different requests.
PRIORITY_FIELDS = (*FIELDS, "priority")
#: A delayed run's fields (docs/api.md, "Delayed runs"): ``delay_s`` as sent, or
#: ``not_before`` as a canonical UTC RFC 3339 string.  Each takes part only when present,
#: so a body without them keeps the canonical form, and every idempotency record stored
#: before delayed runs existed still replays.
DELAY_FIELDS = ("delay_s", "not_before")
#: Every field that takes part only when present, in the order they are appended.
OPTIONAL_FIELDS = ("priority", *DELAY_FIELDS)


def fields_for(normalised: dict) -> tuple[str, ...]:
    """The fields an admission's fingerprint is over: FIELDS, plus those of
    OPTIONAL_FIELDS (priority, delay_s, not_before) that ``normalised`` holds (not None).
    A body with none of them hashes exactly as before either feature existed."""
    present = tuple(name for name in OPTIONAL_FIELDS if normalised.get(name) is not None)
    return (*FIELDS, *present) if present else FIELDS


#: The name the priority work gave :func:`fields_for`.
admission_fields = fields_for


class NotCanonicalisable(ValueError):
    """Raised when a body holds a value JCS cannot represent (an integer beyond 2**53)."""


#: JCS's integer domain (what an IEEE 754 double holds exactly), as rfc8785 checks it.
_INT_MIN, _INT_MAX = -(2**53) + 1, 2**53 - 1
#: Sorted keys, no whitespace, UTF-8 as is: JCS's output for the values _json_agrees admits.
_encode_sorted = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                                  allow_nan=False).encode


def _json_agrees(value: Any) -> bool:
    """True when the standard json encoder writes ``value`` exactly as JCS does.

    It does for null, booleans, strings (both escape exactly ``"``, ``\\`` and U+0000-U+001F,
    the same way; lone surrogates fail the UTF-8 encoding below either way), integers in
    JCS's domain, and arrays and objects of those whose keys are ASCII (then code point
    order, which sort_keys uses, is JCS's UTF-16 order).  Floats (ECMAScript number
    formatting) and non-ASCII keys go to rfc8785.
    """
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return _INT_MIN <= value <= _INT_MAX
    if kind is list:
        return all(map(_json_agrees, value))
    if kind is dict:
        return (all(type(key) is str and key.isascii() for key in value)
                and all(map(_json_agrees, value.values())))
    return False


def canonical(normalised: dict, fields: tuple[str, ...] = FIELDS) -> bytes:
    """The RFC 8785 (JCS) form of ``normalised``'s ``fields``, as UTF-8."""
    body = {name: normalised.get(name) for name in fields}
    try:
        if _json_agrees(body):
            # The common case, in C: about 10x cheaper than rfc8785's pure-Python walk,
            # and byte for byte the same (tests/unit/test_fingerprint.py checks both).
            return _encode_sorted(body).encode("utf-8")
    except (RecursionError, UnicodeEncodeError):
        pass  # rfc8785 decides (and names the problem)
    try:
        return rfc8785.dumps(body)
    except (rfc8785.CanonicalizationError, ValueError, TypeError) as exc:
        raise NotCanonicalisable(str(exc)) from None


def fingerprint(normalised: dict, fields: tuple[str, ...] = FIELDS) -> str:
    """Hex SHA-256 of the canonical form of ``normalised``'s ``fields`` (FIELDS for an
    admission, RETRY_FIELDS for a retry)."""
    return hashlib.sha256(canonical(normalised, fields)).hexdigest()
