"""How deeply a JSON value nests, measured without recursion (docs/api.md "JSON depth").

Python's json module recurses once per level of nesting, so a value nested a few hundred
levels deep is accepted in one place (a short stack) and raises RecursionError in
another (a deeper one: a Flask view encoding a list of runs).  runstile therefore admits
and stores nothing nested deeper than ``MAX_DEPTH`` and checks it here, with loops, so
the check itself works at any depth.

Depth counts arrays and objects: ``1`` and ``"x"`` are 0 deep, ``[]`` and ``{}`` 1 deep,
``[[1]]`` 2 deep.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from typing import Any

#: The deepest nesting runstile admits or stores (input, metadata, results, event data,
#: step results, delivery payloads, approval details).
MAX_DEPTH = 64
#: The deepest stored value a read shows.  Above MAX_DEPTH: runstile wraps values admitted
#: within the limit a level or two deeper (approval details inside the run's approval
#: and its event), and an answer stays far below Python's recursion limit (about 1,000).
READ_DEPTH = 2 * MAX_DEPTH
#: What a read shows instead of a stored value deeper than READ_DEPTH (only a row written
#: before runstile checked depth can hold one): a string, so the rest still reads.
TOO_DEEP_PLACEHOLDER = f"(not shown: nested deeper than {READ_DEPTH} levels)"

#: A JSON string (its brackets are text, not nesting) and a run of anything but brackets.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
#: Opening brackets to 2, closing ones to 0: a running sum minus the count so far is
#: the depth at each bracket.
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
_CONTAINERS = (dict, list, tuple)


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` (lists, tuples and dicts of JSON scalars, as json.dumps takes
    them) nests deeper than ``limit``."""
    if not isinstance(value, _CONTAINERS):
        return False
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1))
    return False


def text_too_deep(text: str | bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``text`` nests deeper than ``limit`` (valid JSON assumed).

    Linear and in C: a text with at most ``limit`` opening brackets cannot be deeper
    (counting them answers most values); otherwise strings are cut out, the brackets
    left become steps of +1/-1 and the deepest running sum is the depth (measured:
    40 ms for a megabyte of arrays nested 64 deep, which json.loads takes 150 ms for).
    """
    if isinstance(text, str):
        if text.count("[") + text.count("{") <= limit:
            return False
        text = text.encode("utf-8", "surrogatepass")
    elif text.count(b"[") + text.count(b"{") <= limit:
        return False
    steps = _NOT_BRACKET.sub(b"", _STRING.sub(b"", text)).translate(_STEPS)
    deepest = max(map(operator.sub, itertools.accumulate(steps), itertools.count(1)),
                  default=0)
    return deepest > limit


#: The tokens that matter to nesting and to naming a body's fields.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


def deep_field(text: bytes, limit: int = MAX_DEPTH + 1) -> str | None:
    """The top-level member of the JSON object ``text`` under which nesting first goes
    deeper than ``limit`` (the object itself is level 1), or None when it does not or when
    the deep part is not under a member.  Iterative, so it names the field of a body too
    deep for json.loads, whose recursion limit depends on the caller's stack."""
    depth, member, previous = 0, None, b""
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return member
        elif token in (b"]", b"}"):
            depth -= 1
        elif token == b":" and depth == 1 and previous.startswith(b'"'):
            member = json.loads(previous)
        previous = token
    return None


def loads_for_reading(text: str) -> Any:
    """A stored JSON text as the value a read shows.  One nested deeper than READ_DEPTH
    reads as TOO_DEEP_PLACEHOLDER: encoding it again for the answer could exceed Python's
    recursion limit and fail the whole response, other runs on a list page included."""
    return TOO_DEEP_PLACEHOLDER if text_too_deep(text, READ_DEPTH) else json.loads(text)
