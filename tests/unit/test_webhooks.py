"""Webhook delivery over real loopback sockets (docs/api.md, "Deliveries (webhooks)"):
signatures checked by the independent ``standardwebhooks`` package, the SSRF guard,
redirects, timeouts, caps."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from runstile import netguard, webhooks
from runstile.webhooks import Outcome, deliver, next_delay_s
from tests.receiver import Receiver
from tests.receiver import answer_with as _answer

LOOPBACK = ("127.0.0.0/8",)


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(answer=None, tls=None) -> Receiver:
        made.append(Receiver(answer, tls))
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


def _no_dns(host, *args, **kwargs):
    raise AssertionError(f"the resolver was asked about {host!r}")


def _resolving(mapping: dict[str, list[str]], calls: list | None = None):
    """A getaddrinfo stand-in answering from ``mapping`` (host -> addresses)."""
    def resolver(host, port, family=0, type=0, proto=0, flags=0):
        if calls is not None:
            calls.append(host)
        if host not in mapping:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in mapping[host]]
    return resolver


def _signed(body: bytes, secrets: list[str], msg_id: str = "dlv_0123456789abcdef") -> dict:
    return webhooks.headers(msg_id, int(time.time()), body, secrets)


# --------------------------------------------------------------------------- signing

def test_a_new_secret_is_whsec_and_base64_of_32_random_bytes():
    first, second = webhooks.new_secret(), webhooks.new_secret()
    assert first.startswith("whsec_") and first != second
    assert len(webhooks.secret_key(first)) == 32


def test_a_signature_is_what_the_standard_webhooks_library_computes():
    secret, body = webhooks.new_secret(), b'{"type":"run.completed"}'
    ours = webhooks.sign(secret, "dlv_1", 1_700_000_000, body)
    theirs = Webhook(secret).sign("dlv_1", datetime.fromtimestamp(1_700_000_000, UTC),
                                  body.decode())
    assert ours == theirs and ours.startswith("v1,")


def test_signed_headers_verify_with_the_standard_webhooks_library():
    secret, body = webhooks.new_secret(), json.dumps({"type": "run.completed"}).encode()
    sent = _signed(body, [secret])
    assert Webhook(secret).verify(body, sent) == {"type": "run.completed"}
    assert sent["content-type"] == "application/json"
    assert sent["user-agent"] == "runstile-webhooks/1"
    assert sent["webhook-id"] == "dlv_0123456789abcdef"


def test_during_a_rotation_both_secrets_sign_and_either_one_verifies():
    old, new, stranger = webhooks.new_secret(), webhooks.new_secret(), webhooks.new_secret()
    body = b'{"n":1}'
    sent = _signed(body, [new, old])
    assert len(sent["webhook-signature"].split(" ")) == 2
    Webhook(new).verify(body, sent)
    Webhook(old).verify(body, sent)
    with pytest.raises(WebhookVerificationError):
        Webhook(stranger).verify(body, sent)


def test_a_changed_body_no_longer_verifies():
    secret = webhooks.new_secret()
    sent = _signed(b'{"amount":1}', [secret])
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(b'{"amount":9}', sent)


@pytest.mark.parametrize("secret, complaint", [
    ("c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0", "must start with 'whsec_'"),
    ("whsec_not base64!", "standard base64"),
    ("whsec_" + "QUJD" * 3, "at least 24 bytes"),  # 9 bytes
    ("whsec_", "at least 24 bytes"),
])
def test_a_malformed_secret_is_refused_with_a_clear_message(secret, complaint):
    with pytest.raises(ValueError, match=complaint):
        webhooks.sign(secret, "dlv_1", 1, b"{}")


def test_signing_needs_at_least_one_secret_and_a_header_safe_id():
    with pytest.raises(ValueError, match="at least one"):
        webhooks.headers("dlv_1", 1, b"{}", [])
    with pytest.raises(ValueError, match="printable ASCII"):
        webhooks.headers("dlv_1\r\nx-evil: 1", 1, b"{}", [webhooks.new_secret()])


# --------------------------------------------------------------------------- delivery

def test_an_allowlisted_local_receiver_gets_the_body_and_signed_headers(receivers):
    receiver = receivers()
    secret, body = webhooks.new_secret(), b'{"type":"run.completed","data":{}}'
    outcome = deliver(receiver.url(path="/hook?x=1"), body, _signed(body, [secret]),
                      allowlist=LOOPBACK)
    assert outcome == Outcome(kind="delivered", status=204)
    [got] = receiver.requests
    assert got["path"] == "/hook?x=1" and got["body"] == body
    assert got["headers"]["host"] == f"127.0.0.1:{receiver.port}"
    assert got["headers"]["user-agent"] == "runstile-webhooks/1"
    assert Webhook(secret).verify(got["body"], got["headers"]) == json.loads(body)


@pytest.fixture
def connections(monkeypatch):
    """Every address a socket of this process tries to connect to, recorded at the
    socket layer (below http.client and the deliverer, so nothing can bypass it)."""
    attempted: list = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(sock, address):
        attempted.append(address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        attempted.append(address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    return attempted


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f.1", "[::ffff:127.0.0.1]",
                                  "0.0.0.0", "169.254.169.254", "[::1]", "10.0.0.1",
                                  "localhost"])
def test_a_loopback_private_or_metadata_target_is_refused_without_a_connection(
        receivers, connections, host):
    receiver = receivers()
    outcome = deliver(receiver.url(host), b"{}", _signed(b"{}", [webhooks.new_secret()]),
                      resolver=_no_dns, connect_timeout_s=0.5)
    assert outcome.kind == "refused" and outcome.status is None and outcome.error
    assert connections == [], "no connection may even be attempted"
    assert receiver.requests == []


def test_a_name_that_resolves_to_loopback_is_refused_without_a_connection(receivers,
                                                                          connections):
    receiver = receivers()
    outcome = deliver(receiver.url("evil.example"), b"{}", {},
                      resolver=_resolving({"evil.example": ["10.20.30.40"]}))
    assert outcome.kind == "refused" and "evil.example" in outcome.error
    # The reason is stored and shown to API clients: it must not map the internal
    # network for them.  The operator's log gets the address.
    assert "10.20.30.40" not in outcome.error and "10.20.30.40" in outcome.detail
    assert connections == [], "no connection may even be attempted"
    assert receiver.requests == []


#: Spellings of refused addresses that admission once accepted and delivery refused.
OTHER_SPELLINGS = ["http://１２７.０.０.１/x", "http://127。0。0。1/x", "http://127．0．0．1/x",
                   "http://[::127.0.0.1]/x", "http://[::ffff:127.0.0.1]/x",
                   "http://[::ffff:7f00:1]/x", "http://[::a00:1]/x", "http://192.0.2.1/x",
                   "http://１０.０.０.１/x"]


@pytest.mark.parametrize("url", OTHER_SPELLINGS)
def test_admission_and_delivery_refuse_every_spelling_of_a_refused_address_alike(url,
                                                                                 connections):
    admission = netguard.callback_refusal(url)
    outcome = deliver(url, b"{}", {}, resolver=_no_dns)
    assert admission is not None and "refused address" in admission
    assert outcome.kind == "refused" and outcome.error == admission
    assert connections == []


@pytest.mark.parametrize("host", ["１２７.０.０.１", "127。0。0。1", "[::ffff:127.0.0.1]",
                                  "[::127.0.0.1]", "127.1"])
def test_an_allow_listed_address_is_accepted_and_reached_in_every_spelling(receivers, host):
    receiver = receivers()
    url = receiver.url(host)
    assert netguard.callback_refusal(url, ("127.0.0.1",)) is None
    outcome = deliver(url, b"{}", {}, allowlist=("127.0.0.1",), resolver=_no_dns)
    assert outcome.kind == "delivered" and len(receiver.requests) == 1


def test_a_host_name_is_normalised_once_for_dns_the_host_header_and_the_allowlist():
    target, refusal = netguard.callback_target("https://ＨＯＯＫＳ。Example.COM:8443/a?b=1",
                                               ("hooks.example.com",))
    assert refusal is None
    assert (target.host, target.port, target.target) == ("hooks.example.com", 8443, "/a?b=1")
    assert netguard.callback_target("http://bücher.example/")[0].host == "xn--bcher-kva.example"
    assert netguard.callback_refusal("http://a..b/") == "callback_url has an invalid host name"


def test_a_redirect_to_a_refused_address_is_not_followed(receivers, connections):
    # The receiver itself is allow-listed (by port-less host 127.0.0.1); where it points
    # the deliverer (the metadata address) is never connected to, nor is anything else.
    redirecting = receivers(_answer(302, {"Location": "http://169.254.169.254/latest/"}))
    outcome = deliver(redirecting.url(), b"{}", {}, allowlist=("127.0.0.1",))
    assert outcome.kind == "retry" and outcome.status == 302
    assert connections == [("127.0.0.1", redirecting.port)]
    assert len(redirecting.requests) == 1


def test_a_name_is_refused_when_any_one_of_its_addresses_is_refused(receivers):
    receiver = receivers()
    outcome = deliver(receiver.url("mixed.example"), b"{}", {},
                      resolver=_resolving({"mixed.example": ["93.184.215.14", "127.0.0.1"]}))
    assert outcome.kind == "refused"
    assert receiver.requests == []


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "http:///x",
                                 "http://example.com:99999/"])
def test_a_url_that_is_not_plain_http_or_https_is_refused(url):
    assert deliver(url, b"{}", {}, resolver=_no_dns).kind == "refused"


def test_the_connection_goes_to_the_address_the_name_resolved_to_once(receivers):
    receiver = receivers()
    calls: list[str] = []
    outcome = deliver(receiver.url("hooks.test"), b"{}", {}, allowlist=LOOPBACK,
                      resolver=_resolving({"hooks.test": ["127.0.0.1"]}, calls))
    assert outcome.kind == "delivered"
    assert calls == ["hooks.test"]
    assert receiver.requests[0]["headers"]["host"] == f"hooks.test:{receiver.port}"


def test_an_allowlisted_host_name_may_resolve_to_a_private_address(receivers):
    receiver = receivers()
    outcome = deliver(receiver.url("hooks.internal"), b"{}", {}, allowlist=("hooks.internal",),
                      resolver=_resolving({"hooks.internal": ["127.0.0.1"]}))
    assert outcome.kind == "delivered" and len(receiver.requests) == 1


def test_an_international_host_name_is_resolved_and_sent_in_its_ascii_form(receivers):
    receiver = receivers()
    calls: list[str] = []
    outcome = deliver(receiver.url("bücher.test"), b"{}", {}, allowlist=LOOPBACK,
                      resolver=_resolving({"xn--bcher-kva.test": ["127.0.0.1"]}, calls))
    assert outcome.kind == "delivered" and calls == ["xn--bcher-kva.test"]
    assert receiver.requests[0]["headers"]["host"] == f"xn--bcher-kva.test:{receiver.port}"


def test_an_unresolvable_name_is_retried_not_refused():
    outcome = deliver("https://nowhere.test/", b"{}", {}, resolver=_resolving({}))
    assert outcome.kind == "retry" and "resolve" in outcome.error


def test_a_redirect_is_not_followed_and_is_retried(receivers):
    elsewhere = receivers()
    redirecting = receivers(_answer(302, {"Location": elsewhere.url()}))
    outcome = deliver(redirecting.url(), b"{}", {}, allowlist=LOOPBACK)
    assert outcome.kind == "retry" and outcome.status == 302
    assert "redirect" in outcome.error
    assert len(redirecting.requests) == 1 and elsewhere.requests == []


def test_a_503_with_retry_after_seconds_is_retried_after_that_long(receivers):
    receiver = receivers(_answer(503, {"Retry-After": "7"}, b"busy"))
    outcome = deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK)
    assert outcome == Outcome(kind="retry", status=503, retry_after_s=7.0, error="HTTP 503: busy")


def test_a_429_with_retry_after_as_an_http_date_gives_the_seconds_until_then(receivers):
    when = format_datetime(datetime.fromtimestamp(time.time() + 120, UTC), usegmt=True)
    receiver = receivers(_answer(429, {"Retry-After": when}))
    outcome = deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK)
    assert outcome.kind == "retry" and outcome.status == 429
    assert 100 < outcome.retry_after_s <= 120


def test_a_410_means_the_receiver_is_gone(receivers):
    receiver = receivers(_answer(410))
    assert deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK) == Outcome(
        kind="gone", status=410, error="HTTP 410")


def test_any_other_4xx_is_retried(receivers):
    receiver = receivers(_answer(400, body=b'{"error":"bad"}'))
    outcome = deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK)
    assert outcome.kind == "retry" and outcome.status == 400
    assert outcome.error == 'HTTP 400: {"error":"bad"}'


def test_a_receiver_that_never_answers_is_retried_within_the_read_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts
        started = time.monotonic()
        outcome = deliver(f"http://127.0.0.1:{silent.getsockname()[1]}/", b"{}", {},
                          allowlist=LOOPBACK, read_timeout_s=0.5)
        elapsed = time.monotonic() - started
    assert outcome.kind == "retry" and outcome.status is None
    assert "within 0.5s" in outcome.error
    assert elapsed < 3


def test_a_receiver_that_trickles_its_headers_cannot_outlast_the_read_timeout():
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def trickle():
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.1):
                try:
                    conn.sendall(b"X")  # one byte of an endless header line
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        outcome = deliver(f"http://127.0.0.1:{server.getsockname()[1]}/", b"{}", {},
                          allowlist=LOOPBACK, read_timeout_s=1.0)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        thread.join(5)
        server.close()
    assert outcome.kind == "retry" and "within 1s" in outcome.error
    assert elapsed < 4


def test_a_closed_port_is_retried():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    outcome = deliver(f"http://127.0.0.1:{port}/", b"{}", {}, allowlist=LOOPBACK)
    assert outcome.kind == "retry" and "cannot connect" in outcome.error


def _endless(status: int):
    def answer(handler, record=None):
        handler.send_response(status)
        handler.end_headers()  # no Content-Length: the body runs until the connection ends
        chunk = b"x" * 65536
        try:
            while True:
                handler.wfile.write(chunk)
        except OSError:
            pass
    return answer


def test_an_endless_response_body_is_cut_at_the_cap(receivers):
    receiver = receivers(_endless(200))
    started = time.monotonic()
    outcome = deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK, read_timeout_s=30,
                      max_response_bytes=64 * 1024)
    assert outcome == Outcome(kind="delivered", status=200)
    assert time.monotonic() - started < 5  # stopped at the cap, not at the deadline


def test_a_huge_error_body_is_quoted_only_briefly(receivers):
    receiver = receivers(_endless(500))
    outcome = deliver(receiver.url(), b"{}", {}, allowlist=LOOPBACK, read_timeout_s=30)
    assert outcome.kind == "retry" and outcome.status == 500
    assert outcome.error.startswith("HTTP 500: xxx")
    assert len(outcome.error) < 300


def test_the_callers_host_header_cannot_redirect_the_request(receivers):
    receiver = receivers()
    deliver(receiver.url(), b"{}", {"Host": "metadata.google.internal"}, allowlist=LOOPBACK)
    assert receiver.requests[0]["headers"]["host"] == f"127.0.0.1:{receiver.port}"


# --------------------------------------------------------------------------- https

@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=hooks.test", "-addext", "subjectAltName=DNS:hooks.test",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    return server, client


def test_https_sends_sni_and_verifies_the_certificate_for_the_original_host(
        receivers, certificate):
    server_tls, client_tls = certificate
    receiver = receivers(tls=server_tls)
    outcome = deliver(receiver.url("hooks.test", scheme="https"), b"{}", {},
                      allowlist=LOOPBACK, ssl_context=client_tls,
                      resolver=_resolving({"hooks.test": ["127.0.0.1"]}))
    assert outcome.kind == "delivered"
    assert receiver.server_names == ["hooks.test"]
    assert receiver.requests[0]["headers"]["host"] == f"hooks.test:{receiver.port}"


def test_https_to_a_host_the_certificate_does_not_name_is_retried_unsent(receivers, certificate):
    server_tls, client_tls = certificate
    receiver = receivers(tls=server_tls)
    outcome = deliver(receiver.url("other.test", scheme="https"), b"{}", {},
                      allowlist=LOOPBACK, ssl_context=client_tls,
                      resolver=_resolving({"other.test": ["127.0.0.1"]}))
    assert outcome.kind == "retry" and "TLS" in outcome.error
    assert receiver.requests == []


# --------------------------------------------------------------------------- guard details

@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "100.64.0.1", "169.254.169.254",
                                     "fd00:ec2::254", "::1", "::", "fe80::1", "ff02::1",
                                     "::ffff:10.0.0.1", "::127.0.0.1", "2002:7f00:1::1",
                                     "64:ff9b::7f00:1", "64:ff9b:1::1", "2001:db8::1",
                                     "2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.0.2.1",
                                     "240.0.0.1", "224.0.0.1"])
def test_delivery_refuses_every_non_public_address_form(address):
    assert netguard.target_refused(netguard.ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111",
                                     "2002:5db8:d70e::1"])
def test_delivery_allows_public_addresses(address):
    assert not netguard.target_refused(netguard.ipaddress.ip_address(address))


def test_checked_addresses_are_numeric_and_deduplicated():
    resolver = _resolving({"hooks.example": ["93.184.215.14", "93.184.215.14",
                                             "2606:4700:4700::1111"]})
    targets, refusal = netguard.checked_addresses("hooks.example", 443, (), resolver)
    assert refusal is None
    assert targets == [(socket.AF_INET, ("93.184.215.14", 443)),
                       (socket.AF_INET6, ("2606:4700:4700::1111", 443, 0, 0))]


def test_a_legacy_literal_is_connected_to_as_the_address_it_spells(receivers):
    receiver = receivers()
    outcome = deliver(receiver.url("2130706433"), b"{}", {}, allowlist=LOOPBACK,
                      resolver=_no_dns)
    assert outcome.kind == "delivered" and len(receiver.requests) == 1


# --------------------------------------------------------------------------- backoff

def test_the_delay_doubles_from_the_base_up_to_the_cap_with_equal_jitter():
    low, high = (lambda: 0.0), (lambda: 0.999999)
    assert next_delay_s(1, 1.0, rand=low) == 0.5
    assert next_delay_s(1, 1.0, rand=high) == pytest.approx(1.0, abs=1e-5)
    assert next_delay_s(4, 1.0, rand=low) == 4.0
    assert next_delay_s(20, 1.0, rand=low) == 150.0
    assert next_delay_s(10_000, 1.0, rand=high) == pytest.approx(300.0, abs=1e-3)


def test_retry_after_is_a_floor_capped_at_an_hour():
    assert next_delay_s(1, 1.0, retry_after_s=7, rand=lambda: 0.0) == 7.0
    assert next_delay_s(1, 1.0, retry_after_s=86_400, rand=lambda: 0.0) == 3600.0
    assert next_delay_s(9, 1.0, retry_after_s=2, rand=lambda: 0.0) == 128.0


def test_attempts_count_from_one():
    with pytest.raises(ValueError):
        next_delay_s(0, 1.0)


@pytest.mark.parametrize("value, seconds", [("7", 7.0), (" 0 ", 0.0), ("soon", None), (None, None),
                                            ("-3", None), ("Thu, 01 Jan 1970 00:01:40 GMT", 40.0),
                                            ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0)])
def test_retry_after_is_read_as_seconds_or_an_http_date(value, seconds):
    assert webhooks.parse_retry_after(value, now=60.0) == seconds
