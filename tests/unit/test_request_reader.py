"""The front's request reader (web/request_reader.py): when a request is whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runstile.errors import MalformedRequest, RequestHeadersTooLarge, RequestLineTooLong
from runstile.web.request_reader import RequestReader, Verdict


def reader(max_body_bytes: int = 1000, data: bytes = b"") -> RequestReader:
    return RequestReader(max_body_bytes=max_body_bytes, max_line_bytes=100,
                         max_head_bytes=1000, data=data)


def chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
             for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


LENGTH = b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world"
CHUNKED = (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + chunked(b"hello world", 3))


@given(st.sampled_from([LENGTH, CHUNKED, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"]),
       st.lists(st.integers(1, 20), max_size=40))
def test_a_request_is_whole_only_once_its_last_byte_arrived(request_bytes, sizes):
    r, at = reader(), 0
    for size in sizes:
        if at + size >= len(request_bytes):
            break
        assert r.feed(request_bytes[at:at + size]) is Verdict.MORE
        at += size
    assert r.feed(request_bytes[at:]) is Verdict.COMPLETE


def test_a_request_without_a_body_is_whole_at_the_end_of_its_head():
    assert reader().feed(b"GET / HTTP/1.1\r\n\r\n") is Verdict.COMPLETE
    assert reader().feed(b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n") is Verdict.COMPLETE


def test_a_declared_length_over_the_limit_is_oversized_as_soon_as_the_head_is_here():
    head = b"POST / HTTP/1.1\r\nContent-Length: 1001\r\n\r\n"
    assert reader().feed(head) is Verdict.OVERSIZED
    assert reader().feed(head.replace(b"1001", b"1000")) is Verdict.MORE


def test_a_chunked_body_is_oversized_once_its_chunks_announce_more_than_the_limit():
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    r = reader()
    assert r.feed(head + b"3e8\r\n" + b"a" * 1000 + b"\r\n") is Verdict.MORE
    assert r.feed(b"1\r\n") is Verdict.OVERSIZED


def test_a_body_of_tiny_chunks_trickling_in_byte_by_byte_is_whole_only_at_its_end():
    body = chunked(b"a" * 20_000, 1)  # 20,000 one-byte chunks, 120 KB on the wire
    r = reader(max_body_bytes=50_000)
    r.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    verdicts = [r.feed(body[i:i + 1]) for i in range(len(body))]
    assert verdicts[-1] is Verdict.COMPLETE and set(verdicts[:-1]) == {Verdict.MORE}


def test_framing_that_gunicorn_refuses_from_the_head_is_handed_on_at_once():
    for framing in (b"Content-Length: 5\r\nTransfer-Encoding: chunked",
                    b"Content-Length: 5\r\nContent-Length: 6", b"Content-Length: x",
                    b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: br"):
        assert reader().feed(b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n") \
            is Verdict.COMPLETE


def test_malformed_chunks_are_refused_by_the_reader_itself():
    head = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    for body in (b"zz\r\n", b"0x3\r\n", b"3\r\nabcd\r\n", b"3;a\rb\r\nabc\r\n",
                 b"1" * 2000):
        assert isinstance(reader().feed(head + body), MalformedRequest), body


def test_a_long_request_line_or_head_is_refused_without_waiting_for_its_end():
    assert isinstance(reader().feed(b"GET /" + b"a" * 200), RequestLineTooLong)
    assert isinstance(reader().feed(b"GET / HTTP/1.1\r\nX: " + b"a" * 2000),
                      RequestHeadersTooLarge)


def test_a_client_expecting_100_continue_is_noticed():
    r = reader()
    assert r.feed(b"POST / HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n") \
        is Verdict.MORE
    assert r.expects_continue and not r.body_started
    assert r.feed(b"abc") is Verdict.COMPLETE
