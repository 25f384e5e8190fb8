"""Schemathesis against the served OpenAPI document (issue #7): every documented operation
of a real ``runstile serve``, with data that fits the document and data that does not.

Checks (schemathesis' defaults): no 5xx; status codes, content types, headers and bodies
as the document says; data the document forbids is refused with a 4xx.  Data it allows is
accepted, or refused only for a reason JSON Schema cannot state (see SEMANTIC_REFUSALS).
The budget is small and the seed fixed: reproducible, and done in seconds.

The document is loaded in-process, at import: schemathesis' fixture-based loader
(``schemathesis.pytest.from_fixture``) writes ``Node._nodeid``, which pytest 9.2 no longer
has.  The first test proves the document is the one the server serves.
"""

from __future__ import annotations

import base64
import copy

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from runstile.web import openapi
from tests.conftest import Api

#: Fuzzed examples per operation; the coverage phase adds its own cases (boundaries,
#: missing fields, wrong types, other methods) on top.
MAX_EXAMPLES = 50
SEED = 7
#: Registered on a default server (runstile.demo).  The document cannot say which task
#: names exist, so schema-valid admissions name this one and reach the reservation.
KNOWN_TASK = "echo"
JSON = {"Accept": "application/json"}

#: 400 codes schema-valid data may still get: input must be I-JSON (RFC 8785 cannot
#: canonicalise an integer past 2^53), and a callback host must pass the SSRF guard
#: (it must resolve, and to a public address), and a not_before must be a real time at
#: most 30 days ahead (a pattern cannot say "now + 30 days", nor which days February
#: has).  The document says each in words.
SEMANTIC_REFUSALS = {
    ("POST", "/v1/runs"): {"invalid_callback_url", "invalid_request:input",
                           "invalid_request:not_before"},
}

schema = schemathesis.openapi.from_dict(copy.deepcopy(openapi.document()))
schema.config.generation.update(modes=list(GenerationMode), max_examples=MAX_EXAMPLES,
                                deterministic=True, database="none",
                                with_security_parameters=False)
schema.config.seed = SEED


def _past_every_seq(case, code: str) -> bool:
    """The refusal is of a Last-Event-ID or a cursor naming a seq larger than any can be
    (2^63 - 1): both are strings, and the document does not spell that bound.  Or of a
    priority written with a fraction (1.0), which JSON Schema counts as an integer."""
    if code == "invalid_request:priority":
        # JSON Schema's "integer" includes 1.0 (a zero fraction), which admission refuses
        # (docs/api.md, "POST /v1/runs": an integer written as one).
        return isinstance(case.body, dict) and type(case.body.get("priority")) is float
    if code == "invalid_request:after":
        value = (case.headers or {}).get("Last-Event-ID", "")
    elif code == "invalid_request:cursor":
        value = _cursor_seq(str((case.query or {}).get("cursor", "")))
    else:
        return False
    return value.isascii() and value.isdigit() and int(value) > openapi.MAX_SEQ


def _cursor(seq: int | str) -> str:
    """A cursor as GET /v1/runs (and GET /v1/deliveries) makes them."""
    return base64.urlsafe_b64encode(f"v1:{seq}".encode()).decode().rstrip("=")


def _cursor_seq(cursor: str) -> str:
    try:
        return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().partition(
            ":")[2]
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return ""


def _refusal(response) -> str:
    """The error code, with the field for invalid_request: 'invalid_request:cursor'."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "?"
    field = error.get("field") if error.get("code") == "invalid_request" else None
    return error["code"] + (f":{field}" if field else "")


@schemathesis.check
def schema_valid_data_is_refused_only_for_a_reason_json_schema_cannot_state(ctx, response,
                                                                            case):
    """schemathesis' positive_data_acceptance, allowing SEMANTIC_REFUSALS (and 410)."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code < 400 or response.status_code >= 500 or \
            response.status_code in (401, 404, 409, 410, 429):
        return None
    code = _refusal(response)
    allowed = SEMANTIC_REFUSALS.get((case.method, case.path), set())
    if response.status_code == 400 and (code in allowed or _past_every_seq(case, code)):
        return None
    raise AssertionError(f"schema-valid data refused: {response.status_code} {code} "
                         f"(allowed here: {sorted(allowed) or 'none'})")


def with_real_names(case, run_id: str) -> None:
    """Schema-valid cases get what only the server knows: a registered task, a run that
    exists (finished, so an event stream ends), and a cursor of the shape this API returns
    (with any seq the generated text spells, up to 2^72)."""
    if not case.meta.generation.mode.is_positive:
        return
    if (case.method, case.path) == ("POST", "/v1/runs") and isinstance(case.body, dict):
        case.body = {**case.body, "task": KNOWN_TASK}
    if "{run_id}" in case.path:
        case.path_parameters = {**(case.path_parameters or {}), "run_id": run_id}
    if case.method == "GET" and case.path in ("/v1/runs", "/v1/deliveries") and \
            case.query and "cursor" in case.query:
        seq = int.from_bytes(str(case.query["cursor"]).encode()[:9], "big")
        case.query = {**case.query, "cursor": _cursor(seq)}


@pytest.fixture(scope="module")
def target(shared_server, shared_ledger):
    """The module's server, an admin key (so GET /v1/recovery answers 200 too) and a
    cancelled run of its profile."""
    api = Api(shared_server, shared_ledger.key("fuzz", admin=True), shared_ledger)
    run_id = api.post_run({"task": KNOWN_TASK, "input": {"n": 1}}).json()["id"]
    assert api.post(f"/v1/runs/{run_id}/stop").json()["status"] == "cancelled"
    return shared_server, api.key, run_id


def test_the_fuzzed_document_is_the_one_the_server_serves(target):
    server, key, _ = target
    served = requests.get(server.url + "/openapi.json", headers=key.headers, timeout=10)
    assert served.status_code == 200
    assert served.json() == openapi.document()


@schema.parametrize()
@hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_every_documented_operation_answers_as_the_openapi_document_says(case, target):
    server, key, run_id = target
    with_real_names(case, run_id)
    case.call_and_validate(
        base_url=server.url, headers=key.headers, timeout=30,
        excluded_checks=[positive_data_acceptance],
        additional_checks=[
            schema_valid_data_is_refused_only_for_a_reason_json_schema_cannot_state])


def test_a_number_the_ledger_cannot_hold_or_a_non_ascii_digit_is_a_400_not_a_500(target):
    """Found by this fuzzing: after, Last-Event-ID, limit and the cursor's seq went through
    str.isdigit() and int(), so '²' raised, '٣' read as 3, and 2^63 overflowed the query
    (a 500, or an event stream that died after its 200)."""
    server, key, run_id = target
    api = Api(server, key)
    events = f"/v1/runs/{run_id}/events"
    for after in ("²", "٣", str(openapi.MAX_SEQ + 1), "9" * 30, "-1", "1.0"):
        for accept in ("application/json", "text/event-stream"):
            answer = api.get(events, params={"after": after}, headers={"Accept": accept})
            assert answer.status_code == 400, (after, accept, answer.text)
            assert answer.json()["error"]["field"] == "after"
    assert api.get(events, headers={**JSON, "Last-Event-ID": "9" * 30}).status_code == 400
    assert api.get(events, params={"after": openapi.MAX_SEQ}, headers=JSON).json() == {
        "data": [], "next_after": openapi.MAX_SEQ}
    for limit in ("²", "٣", "9" * 30):
        answer = api.get("/v1/runs", params={"limit": limit})
        assert answer.status_code == 400 and answer.json()["error"]["field"] == "limit"
    for seq in ("²", "٣", str(openapi.MAX_SEQ + 1)):
        answer = api.get("/v1/runs", params={"cursor": _cursor(seq)})
        assert answer.status_code == 400 and answer.json()["error"]["field"] == "cursor"
    assert api.get("/v1/runs", params={"cursor": _cursor(openapi.MAX_SEQ)}).status_code == 200
