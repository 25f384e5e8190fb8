"""A schedule's ticks, pure (runstile/ticks.py) and its declaration's checks
(docs/tasks.md, "Schedules" and "Daylight saving time")."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

import runstile
from runstile.errors import ConfigError
from runstile.ticks import Ticks, spell


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def spelled(ticks: list[float]) -> list[str]:
    return [spell(t) for t in ticks]


def test_every_s_ticks_are_multiples_of_the_interval_since_the_epoch():
    rule = Ticks(every_s=30)
    assert spelled(rule.due(utc("2026-01-01T00:00:10"), utc("2026-01-01T00:01:30"), 10)) == [
        "2026-01-01T00:00:30Z", "2026-01-01T00:01:00Z", "2026-01-01T00:01:30Z"]
    assert spell(rule.next_after(utc("2026-01-01T00:01:30"))) == "2026-01-01T00:02:00Z"
    assert spelled(rule.due(0, utc("2026-01-01T00:01:30"), 2)) == [
        "2026-01-01T00:01:00Z", "2026-01-01T00:01:30Z"], "the most recent ones, oldest first"


def test_a_daily_cron_in_berlin_fires_once_on_both_dst_days_as_documented():
    rule = Ticks(cron="30 2 * * *", zone="Europe/Berlin")
    # 29 March 2026: 02:00 CET jumps to 03:00 CEST, so 02:30 does not exist: the tick is
    # the instant of the jump (01:00Z, 03:00 local).
    assert spelled(rule.due(utc("2026-03-27T12:00:00"), utc("2026-03-30T12:00:00"), 10)) == [
        "2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"]
    # 25 October 2026: 03:00 CEST goes back to 02:00 CET, so 02:30 happens twice: the tick
    # is its first occurrence (00:30Z, CEST) alone.
    assert spelled(rule.due(utc("2026-10-24T12:00:00"), utc("2026-10-26T12:00:00"), 10)) == [
        "2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"]


def test_a_half_hourly_cron_in_berlin_skips_the_jump_and_the_repeated_hour_as_documented():
    rule = Ticks(cron="*/30 * * * *", zone="Europe/Berlin")
    assert spelled(rule.due(utc("2026-03-29T00:00:00"), utc("2026-03-29T02:00:00"), 100)) == [
        "2026-03-29T00:30:00Z",  # 01:30 CET
        "2026-03-29T01:00:00Z",  # 03:00 CEST: also where 02:00 and 02:30 (skipped) fire
        "2026-03-29T01:30:00Z", "2026-03-29T02:00:00Z"]
    assert spelled(rule.due(utc("2026-10-24T23:00:00"), utc("2026-10-25T03:00:00"), 100)) == [
        "2026-10-24T23:30:00Z", "2026-10-25T00:00:00Z", "2026-10-25T00:30:00Z",  # CEST
        # 01:00Z and 01:30Z are 02:00 and 02:30 again (CET): no second tick
        "2026-10-25T02:00:00Z", "2026-10-25T02:30:00Z", "2026-10-25T03:00:00Z"]


def test_the_next_tick_seen_from_inside_the_repeated_hour_is_after_it():
    rule = Ticks(cron="*/30 * * * *", zone="Europe/Berlin")
    inside = utc("2026-10-25T01:10:00")  # 02:10 CET, the second pass
    assert spell(rule.next_after(inside)) == "2026-10-25T02:00:00Z"
    assert spelled(rule.due(utc("2026-10-25T00:10:00"), inside, 100)) == [
        "2026-10-25T00:30:00Z"], "the first pass's 02:30 is behind, not ahead"


def test_new_york_follows_the_same_rules():
    rule = Ticks(cron="30 2 * * *", zone="America/New_York")
    # 8 March 2026: 02:00 EST jumps to 03:00 EDT (07:00Z).
    assert spelled(rule.due(utc("2026-03-07T12:00:00"), utc("2026-03-09T12:00:00"), 10)) == [
        "2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"]


@pytest.mark.parametrize(("options", "says"), [
    ({"cron": "61 * * * *"}, "invalid cron expression"),
    ({"cron": "0 0 31 2 *"}, "never matches"),
    ({"cron": "0 3 * * *", "timezone": "Mars/Olympus"}, "unknown time zone"),
    ({"cron": "0 3 * * *", "every_s": 60}, "exactly one"),
    ({}, "exactly one"),
    ({"every_s": 0.5}, "every_s"),
    ({"every_s": True}, "every_s"),
    ({"every_s": 60, "catchup": "everything"}, "catchup"),
    ({"every_s": 60, "input": {"x": float("nan")}}, "input"),
    ({"every_s": 60, "profile": "no spaces"}, "profile"),
])
def test_a_bad_declaration_is_refused_naming_the_schedule(options, says):
    with pytest.raises(ConfigError) as caught:
        runstile.schedule("refused-here", task="echo", **options)
    assert "refused-here" in caught.value.message and says in caught.value.message
    assert "refused-here" not in runstile.tasks.schedules()
