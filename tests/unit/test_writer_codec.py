"""The admission writer's wire format (runstile/web/writer/codec.py): what a web process
sends is the reservation the writer runs, and what the writer answers is what admission.admit
would have returned or raised in the web process itself."""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass, fields

import pytest

from runstile import errors
from runstile.ledger import admission, admission_rows, group_commit
from runstile.ledger.keys import Principal
from runstile.web.writer import codec as writer


def reservation(**changes) -> admission.Reservation:
    fields = dict(
        principal=Principal("acme", "k1", "client"), key="ik-1", key_is_derived=False,
        run_id=None, task="echo", input_json='{"text":"héllo \\u2028","n":[1,2.5,null]}',
        session_key="s", trigger_id=None, metadata_json='{"a":"b"}',
        callback_url="https://example.com/hook", fingerprint="f" * 64,
        fingerprint_version=1)
    fields.update(changes)
    return admission.Reservation(admission.AdmissionRequest(**fields), None, 10_000, None)


def embedded(conn, run, dispatch_id) -> None:  # stands for the writer's own enqueue
    raise AssertionError("not called by the codec")


def test_a_reservation_arrives_with_every_field_it_was_sent_with():
    sent = reservation(key="legacy-run:run_" + "a" * 32, key_is_derived=True,
                       run_id="run_" + "a" * 32)
    sent.refusal = errors.InvalidCallbackUrl("private address", field="callback_url")
    received = writer.decode_request(writer.encode_request(sent), None)
    assert received.req == sent.req
    assert received.max_active_runs == 10_000 and received.enqueue is None
    assert type(received.refusal) is errors.InvalidCallbackUrl
    assert received.refusal.message == "private address"
    assert received.refusal.details == {"field": "callback_url"}


def test_the_wire_keeps_its_order_so_a_web_process_and_a_writer_of_one_install_agree():
    sent = reservation(run_id="run_" + "c" * 32)
    assert writer.encode_request(sent) == writer._dumps([
        "acme", "k1", "client", "ik-1", False, "run_" + "c" * 32, "echo",
        '{"text":"héllo \\u2028","n":[1,2.5,null]}', "s", None, '{"a":"b"}',
        "https://example.com/hook", "f" * 64, 1, None, 5, None, None, "default", None,
        10_000, False]).encode()


def test_a_retrys_request_travels_with_the_run_it_retries():
    """``retry_of`` (POST /v1/runs/{run_id}/retry) is a field of AdmissionRequest like any
    other: it goes over the wire in its place and comes back in the writer's reservation."""
    sent = reservation(retry_of="run_" + "d" * 32)
    wire = writer.encode_request(sent)
    assert f'1,"run_{"d" * 32}",5,null,null,"default",null,10000' in wire.decode()
    assert writer.decode_request(wire, None).req == sent.req
    assert writer.decode_request(writer.encode_request(reservation()), None).req.retry_of is None


def test_a_runs_priority_travels_in_its_place_after_retry_of():
    """``priority`` (docs/api.md, "POST /v1/runs") is derived into the wire like any other
    field of AdmissionRequest: it follows ``retry_of`` and comes back as sent."""
    sent = reservation(priority=9)
    wire = writer.encode_request(sent)
    assert '1,null,9,null,null,"default",null,10000' in wire.decode()
    assert writer.decode_request(wire, None).req == sent.req


def test_a_runs_queue_travels_in_its_place_after_not_before():
    """``queue`` (docs/tasks.md, "Queues"), the task's queue the web process found, goes
    over the wire after not_before and comes back as sent."""
    sent = reservation(queue="email")
    wire = writer.encode_request(sent)
    assert '1,null,5,null,null,"email",null,10000' in wire.decode()
    assert writer.decode_request(wire, None).req == sent.req


def test_a_delayed_runs_request_travels_with_its_delay_or_its_time():
    """``delay_s`` and ``not_before`` (docs/api.md, "Delayed runs") go over the wire in
    their places, after retry_of and priority, and come back in the writer's reservation."""
    for changes, tail in (({"delay_s": 2.5}, 'null,5,2.5,null,"default",null,10000'),
                          ({"not_before": 1_900_000_000.25},
                           'null,5,null,1900000000.25,"default",null,10000')):
        sent = reservation(**changes)
        wire = writer.encode_request(sent)
        assert f"1,{tail}" in wire.decode()
        assert writer.decode_request(wire, None).req == sent.req


@dataclass(frozen=True)
class WiderPrincipal(Principal):
    tenant: str | None = None  # fields this codec has never heard of, at every level


@dataclass(frozen=True)
class WiderRequest(admission.AdmissionRequest):
    principal: WiderPrincipal
    priority: int = 0


@dataclass(slots=True, eq=False)
class WiderReservation(admission.Reservation):
    req: WiderRequest
    deadline_s: float | None = None


def test_a_field_added_to_a_reservation_travels_without_a_change_to_the_codec(monkeypatch):
    """The Wider classes stand for fields added to ledger/admission.py: the codec reads
    the dataclasses' fields, so a new one, at any level, is sent and read back."""
    monkeypatch.setattr(admission, "Reservation", WiderReservation)
    base = reservation().req
    wider = {f.name: getattr(base, f.name) for f in fields(base)}
    wider.update(priority=7, principal=WiderPrincipal("acme", "k1", "client", tenant="t"))
    req = WiderRequest(**wider)
    sent = WiderReservation(req, errors.UnknownTask("no such task", field="task"), 5,
                            embedded, deadline_s=2.5)
    received = writer.decode_request(writer.encode_request(sent), embedded)
    assert type(received) is WiderReservation and received.req == sent.req
    assert received.req.priority == 7 and received.req.principal.tenant == "t"
    assert (received.max_active_runs, received.deadline_s) == (5, 2.5)
    assert received.enqueue is embedded and type(received.refusal) is errors.UnknownTask


def test_the_writer_enqueues_only_what_the_web_process_would_have_enqueued():
    with_enqueue = reservation()
    with_enqueue.enqueue = embedded
    assert writer.decode_request(writer.encode_request(with_enqueue), embedded).enqueue \
        is embedded
    assert writer.decode_request(writer.encode_request(reservation()), embedded).enqueue is None


def unit_with(result=None, error=None, work=None) -> group_commit.Unit:
    unit = group_commit.Unit(work)
    unit.result, unit.error = result, error
    return unit


def test_an_admitted_run_comes_back_as_the_same_admitted_run():
    run = {"seq": 7, "id": "run_" + "b" * 32, "input": '{"x":1}', "created_at": 1764460800.123,
           "result": None, "attempt": 1}
    admitted = admission.Admitted(run, replayed=True, dispatch_id=None)
    assert writer.decode_outcome(writer.encode_outcome(unit_with(admitted)), reservation()) \
        == admitted


def test_a_new_run_comes_back_as_its_id_seq_and_clock_and_the_web_process_rebuilds_its_row():
    sent = reservation(delay_s=2.5, priority=7, retry_of="run_" + "e" * 32)
    received = writer.decode_request(writer.encode_request(sent), None)
    run = admission_rows.run_row(received.req, "run_" + "b" * 32, 41, 1764460800.125)
    encoded = writer.encode_outcome(unit_with(admission.Admitted(run, False, 9), work=received))
    assert json.loads(encoded) == ["new", "run_" + "b" * 32, 41, 1764460800.125, 9]
    assert writer.decode_outcome(encoded, sent) == admission.Admitted(run, False, 9)
    assert run["not_before"] == 1764460800.125 + 2.5 and run["input"] == sent.req.input_json


def test_a_new_run_whose_row_is_not_the_one_its_request_makes_comes_back_whole():
    """The writer checks before it abbreviates: a row written another way (or changed by
    a later version's trigger) reaches the web process as the writer has it."""
    sent = reservation()
    run = {**admission_rows.run_row(sent.req, "run_" + "b" * 32, 41, 1764460800.125),
           "status": "running"}
    encoded = writer.encode_outcome(unit_with(admission.Admitted(run, False, 9), work=sent))
    assert json.loads(encoded)[0] == "ok"
    assert writer.decode_outcome(encoded, sent) == admission.Admitted(run, False, 9)


@pytest.mark.parametrize("error", [
    errors.IdempotencyKeyConflict("this Idempotency-Key was used with a different request"),
    errors.CapacityExceeded("this profile already has 3 unfinished runs (the limit)"),
    errors.UnknownTask("no task named 'x' is registered", field="task"),
    errors.LedgerUnavailable("the ledger is unavailable: disk I/O error"),
])
def test_a_refusal_is_raised_in_the_web_process_as_the_same_error(error):
    with pytest.raises(type(error)) as raised:
        writer.decode_outcome(writer.encode_outcome(unit_with(error=error)), reservation())
    assert (raised.value.code, raised.value.status) == (error.code, error.status)
    assert raised.value.message == error.message and raised.value.details == error.details


def test_a_uniqueness_race_comes_back_as_an_admission_race_for_admit_to_re_read():
    race = sqlite3.IntegrityError("UNIQUE constraint failed: runs.id")
    with pytest.raises(errors.AdmissionRace, match="UNIQUE"):
        writer.decode_outcome(writer.encode_outcome(unit_with(error=race)), reservation())


def test_a_bug_in_the_writer_is_a_server_error_not_a_refusal():
    with pytest.raises(errors.AdmissionWriterFailed, match="KeyError") as raised:
        writer.decode_outcome(writer.encode_outcome(unit_with(error=KeyError("x"))),
                              reservation())
    assert (raised.value.status, raised.value.code) == (500, "internal_error")


def test_an_error_class_this_version_does_not_know_is_still_a_runstile_error():
    encoded = writer._dumps(["refused", "FromTheFuture", "something new", {}]).encode()
    with pytest.raises(errors.RunstileError) as raised:
        writer.decode_outcome(encoded, reservation())
    assert raised.value.message == "something new"


def test_an_unreadable_request_is_refused_by_the_decoder():
    with pytest.raises((ValueError, TypeError)):
        writer.decode_request(b'["too", "short"]', None)
    with pytest.raises(ValueError):
        writer.decode_request(b"\xff not json", None)


def test_an_answer_arrives_whole_however_the_stream_cuts_it_and_a_large_one_grows_the_buffer():
    ours, theirs = socket.socketpair()
    payload = json.dumps(["ok", {"input": "x" * 40_000}, False, 7]).encode()
    data = writer.frame(payload)

    def send_in_pieces() -> None:
        for at in range(0, len(data), 7_001):
            theirs.sendall(data[at:at + 7_001])
            time.sleep(0.002)

    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    buffer = bytearray(16)
    assert writer.recv_frame(ours, buffer, 1 << 20) == payload
    assert len(buffer) >= len(data)
    sender.join()
    theirs.sendall(writer.frame(b'["race","again"]'))
    assert writer.recv_frame(ours, buffer, 1 << 20) == b'["race","again"]'
    ours.close()
    theirs.close()


def test_an_answer_cut_short_or_larger_than_any_admission_is_a_connection_error():
    ours, theirs = socket.socketpair()
    theirs.sendall(writer.LENGTH.pack(10) + b'["ok"')
    theirs.close()
    with pytest.raises(ConnectionError, match="closed"):
        writer.recv_frame(ours, bytearray(64), 100)
    ours.close()
    ours, theirs = socket.socketpair()
    theirs.sendall(writer.LENGTH.pack(101))
    with pytest.raises(ConnectionError, match="larger than any admission"):
        writer.recv_frame(ours, bytearray(64), 100)
    ours.close()
    theirs.close()


def test_a_silent_writer_fails_the_receive_at_the_kernel_timeout_without_a_python_one():
    ours, theirs = socket.socketpair()
    writer.kernel_timeouts(ours, 0.2)
    assert ours.gettimeout() is None  # no poll before each call: the kernel bounds it
    with pytest.raises(OSError):
        writer.recv_frame(ours, bytearray(64), 100)
    ours.close()
    theirs.close()
