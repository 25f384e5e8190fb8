"""The fingerprint's fast path writes exactly what RFC 8785 (rfc8785) writes, or defers to it."""

from __future__ import annotations

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from runstile.fingerprint import (
    FIELDS,
    RETRY_FIELDS,
    NotCanonicalisable,
    canonical,
    fields_for,
    fingerprint,
)

_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=8)
_scalars = (st.none() | st.booleans() | _text
            | st.integers(min_value=-(2**54), max_value=2**54)
            | st.floats(allow_nan=True, allow_infinity=True))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_text, inner, max_size=4), max_leaves=20)


def _reference(body: dict) -> bytes | type:
    try:
        return rfc8785.dumps({name: body.get(name) for name in FIELDS})
    except (rfc8785.CanonicalizationError, ValueError, TypeError):
        return NotCanonicalisable


def assert_agrees_with_rfc8785(body: dict) -> None:
    """runstile's canonical form is rfc8785's byte for byte, or both refuse the body."""
    expected = _reference(body)
    if expected is NotCanonicalisable:
        with pytest.raises(NotCanonicalisable):
            canonical(body)
    else:
        assert canonical(body) == expected


@settings(max_examples=2000, deadline=None)
@given(_json)
def test_any_input_canonicalises_byte_for_byte_as_rfc8785_does_or_is_refused_alike(value):
    body = {"task": "t", "input": value}
    assert_agrees_with_rfc8785(body)


@pytest.mark.parametrize("value", [
    {"é": 1, "z": 2, "\U0001f600": 3, "\ufb01": 4},   # non-ASCII keys: UTF-16 order
    "\ud800",                                          # a lone surrogate
    2**53, -(2**53), 2**53 - 1,                        # the edges of the integer domain
    1.0, 1e21, 1e-7, -0.0, 5e-324,                     # ECMAScript number formatting
    "\x00\x1f\x7f\u2028\"\\\b\f\n\r\t",                # every escape there is, and some that are not
    [[[[[]]]]], {}, [], "",
])
def test_the_edges_of_the_fast_path_agree_with_rfc8785(value):
    body = {"task": "t", "input": value, "metadata": {"k": "v"}}
    assert_agrees_with_rfc8785(body)


def test_a_body_nested_beyond_the_recursion_limit_is_left_to_rfc8785():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    body = {"task": "t", "input": deep}
    with pytest.raises((NotCanonicalisable, RecursionError)):
        canonical(body)


def test_a_retrys_fingerprint_differs_from_a_plain_admission_of_the_same_body():
    """A retry names the run it retries (docs/api.md, "POST /v1/runs/{run_id}/retry"): no
    plain body has retry_of, so one Idempotency-Key cannot replay across the two."""
    body = {"task": "echo", "input": {"a": 1}, "metadata": {"m": "x"}}
    retry = {**body, "retry_of": "run_" + "a" * 32}
    assert fingerprint(body) == fingerprint(retry)  # FIELDS alone ignore retry_of
    assert fingerprint(retry, RETRY_FIELDS) != fingerprint(body)
    assert fingerprint(retry, RETRY_FIELDS) != fingerprint(
        {**retry, "retry_of": "run_" + "b" * 32}, RETRY_FIELDS)
    assert b'"retry_of":"run_' + b"a" * 32 + b'"' in canonical(retry, RETRY_FIELDS)


def test_a_body_without_delay_fields_keeps_the_canonical_form_it_had_before_them():
    """Computed on the code before delayed runs: a request without delay_s or not_before
    must hash as it did, or no stored idempotency record would replay after an upgrade."""
    body = {"task": "echo", "input": {"a": 1}, "run_id": None, "session_key": "s",
            "trigger_id": None, "callback_url": None, "metadata": {"m": "x"},
            "delay_s": None, "not_before": None}
    assert fields_for(body) == FIELDS
    assert fingerprint(body, fields_for(body)) == (
        "6a412d722c45b0f41a95f60c3d42a98786032c61da370850e7e22781b96a2310")
    assert fingerprint({"task": "echo"}, fields_for({"task": "echo"})) == (
        "100758deba75dc23a35c66f25936ed4f5d5273bc8b621e6ead54f5cf8170d6c7")


def test_a_delay_field_takes_part_only_when_present_and_as_sent():
    body = {"task": "echo", "input": {"a": 1}}
    delayed = {**body, "delay_s": 2}
    timed = {**body, "not_before": "2030-01-01T00:00:00.000000Z"}
    assert fields_for(delayed) == (*FIELDS, "delay_s")
    assert fields_for(timed) == (*FIELDS, "not_before")
    assert len({fingerprint(b, fields_for(b)) for b in (body, delayed, timed)}) == 3
    assert b'"delay_s":2' in canonical(delayed, fields_for(delayed))
    assert fingerprint({**body, "delay_s": 2.0}, fields_for(delayed)) == fingerprint(
        delayed, fields_for(delayed))
