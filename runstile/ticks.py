"""When a schedule's ticks fall (docs/tasks.md, "Schedules"): pure arithmetic, no I/O.

A tick is a whole Unix second.  ``every_s`` ticks are the multiples of ``every_s`` since
the Unix epoch, so every node computes the same ticks whenever it starts.  A cron
expression (parsed by croniter) matches local wall-clock times in the schedule's zone,
and each matching wall time becomes one instant by the rules of docs/tasks.md,
"Daylight saving time":

* a wall time that occurs twice (the clock goes back) fires once, at its first
  occurrence: the repeated stretch of wall time gets no second tick;
* a wall time that does not exist (the clock goes forward) fires at the instant of the
  jump; several such wall times are one tick, and a tick that also matches that instant
  (``03:00`` after a jump from ``02:00`` to ``03:00``) is the same tick.

These rules keep the instants in the order of the wall times that make them, so one pass
of croniter, forwards or backwards, yields every tick once and in order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import ModuleType
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import ConfigError

#: How far croniter may search for a cron expression's next match before it is taken to
#: have none (croniter raises past its own bound; this names the error we give).
_NEVER = "never matches a date"


@dataclass(frozen=True)
class Ticks:
    """The tick rule of one schedule: ``every_s`` seconds, or a cron expression in a zone."""

    every_s: int | None = None
    cron: str | None = None
    zone: str = "UTC"

    def next_after(self, now: float) -> float | None:
        """The first tick strictly after ``now``; None if the cron expression has none."""
        if self.every_s is not None:
            return float((math.floor(now / self.every_s) + 1) * self.every_s)
        zone = ZoneInfo(self.zone)
        cron = _croniter()
        it = cron.croniter(self.cron, _wall(math.floor(now), zone))
        try:
            while True:  # past a repeated hour's second pass: first occurrences are behind
                tick = instant(it.get_next(datetime), zone)
                if tick > now:
                    return tick
        except cron.CroniterError:
            return None

    def due(self, after: float, now: float, limit: int) -> list[float]:
        """The most recent ``limit`` ticks ``t`` with ``after < t <= now``, oldest first."""
        if limit <= 0 or now <= after:
            return []
        if self.every_s is not None:
            high, low = math.floor(now / self.every_s), math.floor(after / self.every_s) + 1
            return [float(k * self.every_s) for k in range(max(low, high - limit + 1), high + 1)]
        return self._cron_due(after, now, limit)

    def _cron_due(self, after: float, now: float, limit: int) -> list[float]:
        zone = ZoneInfo(self.zone)
        start = _wall(math.floor(now) + 1, zone)  # get_prev is strict: include now
        found: list[float] = []
        cron = _croniter()
        it = cron.croniter(self.cron, start + _second_pass(math.floor(now) + 1, zone))
        try:
            while len(found) < limit:
                tick = instant(it.get_prev(datetime), zone)
                if tick <= after:
                    break  # instants follow wall times: every earlier one is older still
                if tick <= now and (not found or tick != found[-1]):
                    found.append(tick)
        except cron.CroniterError:
            pass  # no earlier match at all
        return found[::-1]


def _croniter() -> ModuleType:
    """croniter, imported when a cron expression is first read: its import runs the
    ``file`` command on the interpreter (platform.architecture), about 50 ms that every
    runstile process paid at start, schedules or not."""
    import croniter
    return croniter


def _wall(t: float, zone: ZoneInfo) -> datetime:
    """The naive local wall time of the instant ``t``."""
    return datetime.fromtimestamp(t, zone).replace(tzinfo=None)


def _second_pass(t: float, zone: ZoneInfo) -> timedelta:
    """During the second pass of a repeated stretch of wall time, how far back the clock
    went: the first occurrences of wall times up to that much later are already past."""
    local = datetime.fromtimestamp(t, zone)
    if not local.fold:
        return timedelta(0)
    naive = local.replace(tzinfo=None)
    first = naive.replace(tzinfo=zone, fold=0).utcoffset()
    second = naive.replace(tzinfo=zone, fold=1).utcoffset()
    assert first is not None and second is not None  # a ZoneInfo always has an offset
    return first - second


def instant(wall: datetime, zone: ZoneInfo) -> float:
    """The Unix second a naive local wall time fires at (the module docstring's rules)."""
    first = wall.replace(tzinfo=zone, fold=0)
    t = first.timestamp()
    if datetime.fromtimestamp(t, zone).replace(tzinfo=None) == wall:
        return t  # exists (its first occurrence, if it occurs twice)
    # In a gap: fold=0 and fold=1 read it with the offsets before and after the jump,
    # which bracket the jump's instant; find that instant to the second.
    low, high = wall.replace(tzinfo=zone, fold=1).timestamp(), t
    low, high = min(low, high), max(low, high)
    before = first.utcoffset()
    while high - low > 1:
        middle = math.floor((low + high) / 2)
        if datetime.fromtimestamp(middle, zone).utcoffset() == before:
            low = middle
        else:
            high = middle
    return float(high)


def spell(tick: float) -> str:
    """A tick as in an idempotency key: ``YYYY-MM-DDTHH:MM:SSZ``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(tick))


def check(name: str, cron: str | None, every_s: object, zone: str) -> Ticks:
    """The tick rule of schedule ``name``, or ConfigError naming it and what is wrong."""
    if (cron is None) == (every_s is None):
        raise ConfigError(f"schedule {name!r}: give exactly one of cron= and every_s=")
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ConfigError(f"schedule {name!r}: unknown time zone {zone!r} (an IANA name "
                          f"such as 'UTC' or 'Europe/Berlin')") from None
    if every_s is not None:
        if type(every_s) is not int or not 1 <= every_s <= 366 * 86400:
            raise ConfigError(f"schedule {name!r}: every_s must be a whole number of seconds "
                              f"from 1 to {366 * 86400} (got {every_s!r})")
        return Ticks(every_s=every_s, zone=zone)
    if not isinstance(cron, str) or not _croniter().croniter.is_valid(cron):
        raise ConfigError(f"schedule {name!r}: invalid cron expression {cron!r}")
    ticks = Ticks(cron=cron, zone=zone)
    if ticks.next_after(time.time()) is None:
        raise ConfigError(f"schedule {name!r}: cron expression {cron!r} {_NEVER}")
    return ticks
