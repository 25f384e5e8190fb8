"""The web process's HTTP front (web/gthread.py) against a real ``runstile serve``.

Slow clients hold a socket, never a request thread; a body over the limit gets its 413,
not a connection reset; what the HTTP server refuses itself is still JSON.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import Api

MIB = 1024 * 1024


def raw_exchange(server, data: bytes, *, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def parse_answer(raw: bytes) -> tuple[int, dict, dict]:
    """Status, lower-cased headers and JSON body of one HTTP/1.1 answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip())
                   for k, _, v in (line.partition(":") for line in lines[1:]))
    length = int(headers.get("content-length", len(body)))
    return int(lines[0].split()[1]), headers, json.loads(body[:length])


@pytest.fixture
def client(make_server, ledger) -> Api:
    return Api(make_server(), ledger.key("default"), ledger)


def test_two_hundred_slow_clients_do_not_stop_healthz_or_admission_answering_within_a_second(
        client):
    url, headers = client.server.url, client.key.headers
    slow = []
    for i in range(200):
        sock = socket.create_connection(("127.0.0.1", client.server.port))
        # Half stop inside the head, half send a short body behind a larger Content-Length.
        sock.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\n" if i % 2 else
                     b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{}")
        slow.append(sock)
    stop = threading.Event()

    def trickle():  # one more byte each now and then: slow, never idle
        while not stop.wait(0.5):
            for sock in slow:
                try:
                    sock.send(b"X")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    try:
        for i in range(20):
            assert requests.get(url + "/healthz", timeout=1).status_code == 200
            admitted = requests.post(url + "/v1/runs", headers=headers, timeout=1,
                                     json={"task": "chat", "input": {"n": i}})
            assert admitted.status_code == 202, admitted.text
            time.sleep(0.1)
    finally:
        stop.set()
        for sock in slow:
            sock.close()


def test_a_request_that_does_not_arrive_whole_within_the_read_timeout_gets_a_408_in_json(
        make_server):
    server = make_server(RUNSTILE_REQUEST_READ_TIMEOUT_S="1")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        status, _, body = parse_answer(read_to_end(sock))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    # Cut off after the timeout (checked each second), not when the client gave up.
    assert time.monotonic() - started < 5


def test_a_body_over_the_limit_gets_its_413_every_time_and_never_a_reset(client):
    url = client.server.url + "/v1/runs"
    headers = {**client.key.headers, "Content-Type": "application/json"}

    def post(size: int) -> tuple[int, str]:
        body = b'{"task": "chat", "input": "' + b"a" * size + b'"}'
        answer = requests.post(url, headers=headers, data=body, timeout=30)
        return answer.status_code, answer.json()["error"]["code"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(post, [2 * MIB] * 200 + [8 * MIB] * 200))
    assert answers == [(413, "payload_too_large")] * 400


def test_a_chunked_body_over_the_limit_gets_its_413_and_never_a_reset(client):
    def pieces():
        yield b'{"task": "chat", "input": "'
        for _ in range(32):
            yield b"a" * (64 * 1024)
        yield b'"}'

    for _ in range(50):
        answer = client.post_run(data=pieces(), headers={"Content-Type": "application/json"})
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "payload_too_large"


def slow_upload(server, head: bytes, body_bytes: int) -> bytes:
    """A client that writes its body in small pieces, then reads the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        piece = b"a" * (64 * 1024)
        for _ in range(body_bytes // len(piece)):
            sock.sendall(piece)
            time.sleep(0.001)
        return read_to_end(sock)


def test_a_slow_raw_upload_over_the_limit_reads_its_413(client):
    head = (f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {client.key.secret}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {2 * MIB}\r\n\r\n").encode()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: slow_upload(client.server, head, 2 * MIB), range(200)))
    for raw in answers:
        status, _, body = parse_answer(raw)
        assert (status, body["error"]["code"]) == (413, "payload_too_large")


def test_early_errors_before_a_body_is_read_reach_a_client_that_sent_one(client):
    url, body = client.server.url + "/v1/runs", b"{" + b" " * (900 * 1024) + b"}"
    for _ in range(20):
        unauthorized = requests.post(url, data=body, timeout=30,
                                     headers={"Content-Type": "application/json"})
        assert unauthorized.status_code == 401
        wrong_type = requests.post(url, data=body, timeout=30,
                                   headers={**client.key.headers, "Content-Type": "text/plain"})
        assert wrong_type.status_code == 415
        # Over the limit and without a key: the 401 comes first.
        over = requests.post(url, data=body * 3, timeout=30,
                             headers={"Content-Type": "application/json"})
        assert over.status_code == 401


def test_a_100_mib_upload_is_cut_off_after_the_drain_bound_while_others_are_served(client):
    head = (f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {client.key.secret}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {100 * MIB}\r\n\r\n").encode()
    sent, piece = 0, b"a" * (256 * 1024)
    with socket.create_connection(("127.0.0.1", client.server.port), timeout=15) as sock:
        sock.sendall(head)
        with pytest.raises(OSError):  # reset, or a send that never completes: cut off
            while sent < 100 * MIB:
                sock.sendall(piece)
                sent += len(piece)
    # Drained up to 16x the 1 MiB limit (plus what the kernel buffers), never the whole.
    assert sent < 40 * MIB
    assert requests.get(client.server.url + "/healthz", timeout=1).status_code == 200


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n", 400, "malformed_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n", 400, "malformed_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Bad\r\n\r\n", 400, "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
     400, "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400,
     "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
     "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\nabcd\r\n0\r\n\r\n", 400, "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: br\r\n\r\n", 501,
     "unsupported_transfer_coding"),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "request_line_too_long"),
    (b"GET /healthz HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431,
     "request_headers_too_large"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\n\r\n", 417, "expectation_failed"),
    (b"NOT-HTTP\r\n\r\n", 400, "malformed_request"),
    # Shapes two parsers in a chain may read differently (request smuggling), refused by
    # whichever parser the web tier runs (docs/architecture.md, "gunicorn with gthread
    # workers").
    (b"POST /v1/runs HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}", 400, "malformed_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n", 400,
     "malformed_request"),
    (b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length : 2\r\n\r\n{}", 400,
     "malformed_request"),
], ids=["nul-in-header", "cr-in-header", "no-colon", "cl-with-te", "two-lengths",
        "negative-length", "bad-chunk-size", "chunk-without-crlf", "unknown-coding",
        "request-line-too-long", "head-too-large", "unknown-expectation", "not-http",
        "bare-lf", "obsolete-folding", "space-before-colon"])
def test_requests_the_http_server_refuses_are_answered_in_json(client, request_bytes, status,
                                                              code):
    answer_status, headers, body = parse_answer(raw_exchange(client.server, request_bytes))
    assert (answer_status, body["error"]["code"]) == (status, code)
    assert headers["content-type"] == "application/json"
    assert body["error"]["message"]


def test_a_client_that_expects_100_continue_gets_the_go_ahead_and_its_run(client):
    body = json.dumps({"task": "chat", "input": {"text": "hi"}}).encode()
    with socket.create_connection(("127.0.0.1", client.server.port), timeout=5) as sock:
        sock.sendall((f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      f"{client.key.secret}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n"
                      f"Connection: close\r\n\r\n").encode())
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        raw = read_to_end(sock)
    final = raw[raw.index(b"HTTP/1.1 202"):]  # past any further interim answer
    status, _, run = parse_answer(final)
    assert status == 202 and run["input"] == {"text": "hi"}


def test_pipelined_requests_on_one_connection_are_each_answered_in_order(client):
    body = json.dumps({"task": "chat", "input": 1}).encode()
    admit = (f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {client.key.secret}"
             f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
             ).encode() + body
    raw = raw_exchange(client.server, admit + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                       + admit + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", raw) == [b"202", b"200", b"202", b"200"]


# -- kept-alive connections: the request thread's wait for the next request ----------------
# A request thread that answered a kept-alive connection waits NEXT_REQUEST_WAIT_S for the
# client's next request and serves it itself when it arrives whole (web/next_request.py); any
# other arrival goes back to the event loop with the bytes read, and must be answered as
# on a fresh connection.

def read_answer(sock: socket.socket) -> bytes:
    """Exactly one answer (head and Content-Length body) from a kept-alive connection,
    interim ``1xx`` answers included in what is returned before it."""
    received = b""
    while True:
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection after {received!r}"
            received += chunk
        head, _, rest = received.partition(b"\r\n\r\n")
        if re.match(rb"HTTP/1\.1 1\d\d ", head):
            return head + b"\r\n\r\n"
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection mid-answer"
            rest += chunk
        return head + b"\r\n\r\n" + rest


def kept_alive(server) -> socket.socket:
    """A connection that has had one request answered and stays open for the next."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
    return sock


def admission_bytes(client: Api, body: bytes, extra: str = "") -> tuple[bytes, bytes]:
    head = (f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {client.key.secret}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode(), body


def test_a_kept_alive_client_sending_its_next_requests_at_once_gets_each_answered_in_order(
        client):
    with kept_alive(client.server) as sock:
        for i in range(50):
            head, body = admission_bytes(client, json.dumps({"task": "chat", "input": i})
                                         .encode())
            sock.sendall(head + body)
            status, _, run = parse_answer(read_answer(sock))
            assert (status, run["input"]) == (202, i)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(sock).startswith(b"HTTP/1.1 200 ")
    assert client.runs_in_scope() == 50


def test_a_kept_alive_request_arriving_in_parts_after_the_thread_stopped_waiting_is_answered(
        client):
    body = json.dumps({"task": "chat", "input": {"text": "late"}}).encode()
    head, body = admission_bytes(client, body)
    with kept_alive(client.server) as sock:
        sock.sendall(head + body[:5])
        time.sleep(0.2)  # forty times the thread's wait: the event loop has the bytes now
        sock.sendall(body[5:])
        status, _, run = parse_answer(read_answer(sock))
        assert status == 202 and run["input"] == {"text": "late"}
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200 ")


def test_kept_alive_clients_stalled_mid_request_hold_no_thread(make_server, ledger):
    server = make_server(web_workers=1, RUNSTILE_WEB_THREADS="2")
    stalled = []
    try:
        for _ in range(6):
            # At once, while the thread that answered may still wait on the connection:
            # the start of a next request, and then nothing.
            stalled.append(sock := kept_alive(server))
            sock.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        for _ in range(10):
            assert requests.get(server.url + "/healthz", timeout=1).status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_request_the_front_refuses_on_a_kept_alive_connection_is_answered_in_json(client):
    with kept_alive(client.server) as sock:
        sock.sendall(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = parse_answer(read_to_end(sock))
    assert (status, body["error"]["code"]) == (414, "request_line_too_long")
    assert headers["content-type"] == "application/json"


def test_a_kept_alive_client_that_expects_100_continue_gets_the_go_ahead_and_its_run(client):
    head, body = admission_bytes(client, json.dumps({"task": "chat", "input": 7}).encode(),
                                 extra="Expect: 100-continue\r\n")
    with kept_alive(client.server) as sock:
        sock.sendall(head)
        assert read_answer(sock) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer = read_answer(sock)
        while answer.startswith(b"HTTP/1.1 100 "):  # gunicorn may repeat the go-ahead
            answer = read_answer(sock)
        status, _, run = parse_answer(answer)
    assert (status, run["input"]) == (202, 7)
