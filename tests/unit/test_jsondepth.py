"""How deep JSON nests (runstile/jsondepth.py), measured without recursion."""

from __future__ import annotations

import json

from runstile.jsondepth import deep_field, text_too_deep, too_deep


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def test_the_text_and_the_value_agree_on_depth_at_and_past_the_limit():
    for depth in (0, 1, 63, 64, 65, 2000):
        text = nested(depth)
        assert text_too_deep(text, 64) is (depth > 64)
        if depth < 900:
            assert too_deep(json.loads(text), 64) is (depth > 64)


def test_brackets_inside_strings_are_text_not_nesting():
    assert not text_too_deep(json.dumps({"a": "[" * 500}), 64)


def test_the_member_a_too_deep_body_goes_deep_under_is_named_without_parsing_it():
    body = '{"task": "echo", "metadata": {"k": "[[["}, "input": ' + nested(5000) + "}"
    assert deep_field(body.encode(), 65) == "input"
    assert deep_field(('{"a": {"b": ' + nested(64) + "}}").encode(), 65) == "a"
    assert deep_field(nested(100).encode(), 65) is None  # not under a member
    assert deep_field(b'{"a": [1], "b": 2}', 65) is None
