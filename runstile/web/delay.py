"""A delayed run's fields of POST /v1/runs (docs/api.md, "Delayed runs"): ``delay_s`` or
``not_before``, checked and normalised for the fingerprint (``runstile/fingerprint.py``,
DELAY_FIELDS) and for the reservation, which stores ``runs.not_before``."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any

from ..errors import InvalidRequest

#: The longest delay: 30 days, for ``delay_s`` and for a ``not_before`` ahead of now.
MAX_DELAY_S = 30 * 24 * 3600
#: RFC 3339's date-time (section 5.6): seconds required, a fraction optional, and a
#: timezone (Z or ±hh:mm) required.  ``datetime.fromisoformat`` alone accepts more.
RFC3339_PATTERN = (r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?"
                   r"([Zz]|[+-][0-9]{2}:[0-9]{2})")
_RFC3339 = re.compile(RFC3339_PATTERN, re.ASCII)


def fields(body: dict[str, Any]) -> dict[str, Any]:
    """``{"delay_s": ..., "not_before": ...}`` as they take part in the fingerprint: the
    delay as sent (a number), the time as a canonical UTC RFC 3339 string; None when
    absent (or null).  Raises InvalidRequest naming the field."""
    delay_s, not_before = body.get("delay_s"), body.get("not_before")
    if delay_s is not None and not_before is not None:
        raise InvalidRequest("send delay_s or not_before, not both", field="not_before")
    return {"delay_s": None if delay_s is None else _delay(delay_s),
            "not_before": None if not_before is None else _time(not_before)}


def _delay(value: Any) -> float | int:
    if (type(value) not in (int, float)) or not 0 <= value <= MAX_DELAY_S:
        raise InvalidRequest(f"delay_s must be a number of seconds from 0 to {MAX_DELAY_S} "
                             "(30 days)", field="delay_s")
    return value  # type: ignore[no-any-return]


def _time(value: Any) -> str:
    if not isinstance(value, str) or not _RFC3339.fullmatch(value):
        raise InvalidRequest("not_before must be an RFC 3339 time with a timezone, e.g. "
                             "2026-12-01T18:30:00Z", field="not_before")
    try:
        moment = dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"not_before is not a valid time: {value!r}",
                             field="not_before") from None
    if moment.timestamp() > time.time() + MAX_DELAY_S:
        raise InvalidRequest(f"not_before may be at most {MAX_DELAY_S} seconds (30 days) "
                             "ahead", field="not_before")
    return canonical(moment)


def canonical(moment: dt.datetime) -> str:
    """The one spelling of a time in the fingerprint: UTC, microseconds, ``Z``."""
    return moment.astimezone(dt.UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def unix_seconds(text: str) -> float:
    """A canonical not_before (:func:`canonical`) as Unix seconds."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
