"""A request thread's wait for the next request on a kept-alive connection
(web/next_request.py, as web/gthread.py's worker uses it), on a real socket pair with
gunicorn's parser."""

from __future__ import annotations

import socket
import threading

import pytest
from gunicorn import http
from gunicorn.config import Config
from gunicorn.workers.gthread import TConn

from runstile.web import gthread
from runstile.web.gthread import BufferingThreadWorker
from runstile.web.next_request import NEXT_REQUEST_WAIT_S

REQUEST = b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


class Front:
    """The parts of a web process's worker that the wait uses, on one connection."""

    def __init__(self, threads: int = 4) -> None:
        cfg = Config()
        cfg.set("threads", threads)
        worker = BufferingThreadWorker.__new__(BufferingThreadWorker)
        worker.cfg, worker.alive, worker.max_body_bytes = cfg, True, 1024 * 1024
        worker.queued_requests = worker.threads_in_handle = 0
        worker.pool_counts = threading.Lock()
        self.worker = worker
        self.client, server = socket.socketpair()
        self.conn = TConn(cfg, server, ("127.0.0.1", 1), ("127.0.0.1", 2))
        self.conn.parser = http.get_parser(cfg, server, self.conn.client)
        self.conn.parser.unreader = gthread._BufferOnly()
        self.conn.oversized = False
        server.setblocking(True)  # as a request thread's socket is

    def buffered(self) -> bytes:
        return self.conn.parser.unreader.buf.getvalue()

    def close(self) -> None:
        self.client.close()
        self.conn.sock.close()


@pytest.fixture
def front():
    f = Front()
    yield f
    f.close()


def test_a_next_request_that_arrives_whole_during_the_wait_is_parsed_by_the_same_thread(front):
    threading.Timer(NEXT_REQUEST_WAIT_S / 5, front.client.sendall, (REQUEST,)).start()
    assert front.worker._next_request(front.conn) is True
    request = next(front.conn.parser)
    assert (request.method, request.path, request.body.read()) == ("POST", "/v1/runs", b"{}")


def test_a_next_request_still_arriving_when_the_wait_ends_goes_back_with_its_bytes(front):
    front.client.sendall(REQUEST[:20])
    assert front.worker._next_request(front.conn) is None
    assert front.buffered() == REQUEST[:20]


def test_a_wait_that_sees_nothing_hands_back_nothing(front):
    assert front.worker._next_request(front.conn) is None
    assert front.buffered() == b""


def test_a_client_that_closes_during_the_wait_ends_the_connection(front):
    front.client.close()
    assert front.worker._next_request(front.conn) is False


@pytest.mark.parametrize("arrival", [
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n",                               # refused
    b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",  # over the limit
    b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Expect: 100-continue\r\n\r\n",                                          # awaits go-ahead
], ids=["refused", "oversized", "expects-continue"])
def test_anything_but_a_whole_ordinary_request_goes_back_to_the_event_loop(front, arrival):
    front.client.sendall(arrival)
    assert front.worker._next_request(front.conn) is None
    assert front.buffered() == arrival


def test_a_thread_waits_only_while_another_is_idle_and_nothing_is_queued():
    front = Front(threads=3)
    try:
        worker, conn = front.worker, front.conn
        worker.threads_in_handle = 2  # this thread and one other: the third is idle
        assert worker._may_wait_for_next(conn)
        worker.threads_in_handle = 3
        assert not worker._may_wait_for_next(conn), "no idle thread would be left"
        worker.threads_in_handle = 1
        worker.queued_requests = 1
        assert not worker._may_wait_for_next(conn), "a queued request needs a thread"
        worker.queued_requests = 0
        conn.parser.unreader.unread(REQUEST)  # pipelined: already buffered for the parser
        assert not worker._may_wait_for_next(conn)
        conn.parser.unreader.take_buffered()
        conn.is_http2 = True
        assert not worker._may_wait_for_next(conn), "never on an HTTP/2 connection"
        conn.is_http2 = False
        worker.alive = False
        assert not worker._may_wait_for_next(conn), "a stopping worker does not wait"
    finally:
        front.close()
