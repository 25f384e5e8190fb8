"""Which callback targets runstile may reach (docs/api.md "callback_url").

``callback_target`` is the one reading of a callback URL: admission (400
``invalid_callback_url``), ``ctx.deliver`` and every delivery attempt all call it, so what
a delivery would refuse without DNS is refused at admission already.  It normalises the
host the way a resolver would read it — IDNA with nameprep (full-width digits and letters,
``。`` and ``．`` as dots), every spelling inet_aton accepts (``127.1``, ``2130706433``,
``0x7f.1``), IPv4-mapped (``::ffff:a.b.c.d``) and IPv4-compatible (``::a.b.c.d``) IPv6 as
the IPv4 address they carry — and refuses a literal address delivery would refuse.

Names that need resolving are checked again at delivery, against the address actually
connected to: ``checked_addresses`` resolves a host once and returns the addresses
delivery may connect to, and ``PinnedConnection`` is the HTTP(S) connection that
``runstile.webhooks.deliver`` makes to them: it never resolves the name again, so a DNS
answer that changes between check and connect cannot steer it elsewhere.  A refusal's
``reason`` (stored, and shown to API clients) never names the addresses a name resolved
to; its ``detail`` (for the log) does.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import unicodedata
from dataclasses import dataclass
from urllib.parse import urlsplit

#: Ranges no callback may reach unless allow-listed: loopback, private, link-local,
#: CGNAT, cloud metadata, multicast, unspecified and reserved.
_REFUSED_V4 = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
    "240.0.0.0/4", "255.255.255.255/32")]
_REFUSED_V6 = [ipaddress.ip_network(n) for n in (
    "::/128", "::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "64:ff9b::/96", "100::/64",
    "2001:db8::/32", "fd00:ec2::254/128")]
#: IPv4-compatible IPv6 (``::a.b.c.d``, deprecated): judged as the IPv4 it carries.
_COMPATIBLE = ipaddress.ip_network("::/96")
#: Local-use NAT64, refused at delivery whatever IPv4 it reaches.  (Well-known NAT64 is in
#: _REFUSED_V6; Teredo is not globally routable; 6to4 is judged by the address it embeds.)
_REFUSED_V6_TRANSLATED = [ipaddress.ip_network("64:ff9b:1::/48")]
MAX_URL_LENGTH = 2048
#: What API clients read when a callback host resolves to a refused address: the
#: addresses themselves (this network's internal layout) go to the log only.
RESOLVES_TO_REFUSED = ("resolves to a loopback, private or otherwise non-public address, "
                       "which callbacks may not reach")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class CallbackTarget:
    """A callback URL as delivery reads it."""

    scheme: str
    #: ASCII: a name's IDNA form, or an address literal's text (no brackets); lowercase.
    host: str
    port: int
    #: The path and query to request ("/" at least).
    target: str
    #: The address a literal host denotes (mapped/compatible IPv6 as its IPv4), else None.
    address: Address | None


@dataclass(frozen=True)
class Refusal:
    """Why delivery may not connect: ``reason`` may be stored and shown to API clients,
    ``detail`` (which may name internal addresses) is for the log only."""

    reason: str
    detail: str


def normalise_host(host: str) -> str:
    """The ASCII form of a URL's host that DNS, the Host header and SNI carry.

    An IPv6 literal (urlsplit has taken off its brackets) is NFKC-normalised; a name goes
    through IDNA (Python's ``encodings.idna``: nameprep maps full-width digits and
    letters, and ``。``, ``．`` and ``｡`` separate labels), so ``１２７.０.０.１`` and
    ``127。0。0。1`` become ``127.0.0.1``.  ValueError if it cannot be encoded.
    """
    if ":" in host:
        return unicodedata.normalize("NFKC", host).lower()
    try:
        return host.encode("idna").decode("ascii").rstrip(".").lower()
    except UnicodeError as exc:
        raise ValueError(str(exc)) from None


def as_reached(addr: Address) -> Address:
    """``addr`` as the address checks judge: IPv4-mapped (``::ffff:a.b.c.d``) and
    IPv4-compatible (``::a.b.c.d``) IPv6 as that IPv4 address (``::`` and ``::1`` stay)."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr in _COMPATIBLE and int(addr) > 1:
            return ipaddress.IPv4Address(int(addr))
    return addr


def parse_host_address(host: str) -> Address | None:
    """The address a host literal denotes, in every spelling a resolver would accept
    (IPv4-mapped and -compatible IPv6 as their IPv4)."""
    host = host.strip("[]")
    try:
        return as_reached(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        # inet_aton accepts the legacy forms (127.1, 2130706433, 0x7f.1) that
        # ipaddress rejects but C resolvers happily connect to.
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def address_refused(addr: Address) -> bool:
    """Whether ``addr`` is in one of the named refused ranges (see ``target_refused``)."""
    addr = as_reached(addr)
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.sixtofour is not None:
            return address_refused(addr.sixtofour)
        return any(addr in net for net in _REFUSED_V6)
    return any(addr in net for net in _REFUSED_V4)


def allowlisted(host: str, addr: Address | None, allowlist: tuple[str, ...]) -> bool:
    """Whether ``RUNSTILE_CALLBACK_ALLOWLIST`` exempts ``host`` (normalised) or ``addr``:
    a CIDR holds the address, an address entry is the address in any spelling, a name
    entry is the host after the same normalisation."""
    for entry in allowlist:
        if "/" in entry:
            network = ipaddress.ip_network(entry, strict=False)
            if addr is not None and addr.version == network.version and addr in network:
                return True
            continue
        entry_addr = parse_host_address(entry)
        if entry_addr is not None:
            if addr is not None and entry_addr == addr:
                return True
            continue
        try:
            if normalise_host(entry.strip("[]")) == host:
                return True
        except ValueError:
            continue
    return False


def _parse(url: str) -> CallbackTarget | str:
    """``url`` split and normalised, or why it is not a callback URL at all."""
    if len(url) > MAX_URL_LENGTH:
        return f"callback_url is longer than {MAX_URL_LENGTH} characters"
    if any(ord(c) < 33 or ord(c) == 127 for c in url):
        return "callback_url contains spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a bad port
    except ValueError:
        return "callback_url is not a valid URL"
    if parts.scheme not in ("http", "https"):
        return "callback_url must use http or https"
    try:
        host = normalise_host(parts.hostname or "")
    except ValueError:
        return "callback_url has an invalid host name"
    if not host:
        return "callback_url has no host"
    port = port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return CallbackTarget(scheme=parts.scheme, host=host, port=port, target=target,
                          address=parse_host_address(host))


def callback_target(url: str, allowlist: tuple[str, ...] = ()
                    ) -> tuple[CallbackTarget | None, str | None]:
    """``(target, None)`` for a URL delivery may try (pending DNS for a name), else
    ``(None, why)``: not http(s), malformed, localhost, or a literal address that
    ``target_refused`` refuses and the allowlist does not exempt."""
    parsed = _parse(url)
    if isinstance(parsed, str):
        return None, parsed
    host, addr = parsed.host, parsed.address
    if allowlisted(host, addr, allowlist):
        return parsed, None
    if host == "localhost" or host.endswith(".localhost"):
        return None, ("callback_url points at this machine (localhost); an operator "
                      "allows a host with RUNSTILE_CALLBACK_ALLOWLIST")
    if addr is not None and target_refused(addr):
        # The client's own literal, normalised: naming it reveals nothing.
        return None, (f"callback_url points at a refused address ({addr}): loopback, "
                      "private and other non-public addresses are refused unless "
                      "RUNSTILE_CALLBACK_ALLOWLIST names them")
    return parsed, None


def callback_refusal(url: str, allowlist: tuple[str, ...] = ()) -> str | None:
    """Why ``url`` may never be a callback target, or None if it may be (pending DNS)."""
    return callback_target(url, allowlist)[1]


def target_refused(addr: Address) -> bool:
    """Whether delivery must not connect to ``addr`` (before the allowlist is consulted).

    The named ranges (``address_refused``), and also every address Python does not
    consider globally routable (documentation, benchmarking, Teredo, …), reserved ranges
    and local-use NAT64; an IPv4-mapped or -compatible address is judged as its IPv4.
    """
    addr = as_reached(addr)
    if address_refused(addr) or addr.is_multicast or addr.is_reserved or not addr.is_global:
        return True
    return isinstance(addr, ipaddress.IPv6Address) and any(
        addr in net for net in _REFUSED_V6_TRANSLATED)


def checked_addresses(host: str, port: int, allowlist: tuple[str, ...] = (),
                      resolver=socket.getaddrinfo
                      ) -> tuple[list[tuple[int, tuple]], Refusal | None]:
    """Resolve ``host`` once; return ``(targets, None)`` or ``([], refusal)``.

    ``host`` is normalised (``CallbackTarget.host``).  ``targets`` are ``(family,
    sockaddr)`` pairs to pass to ``socket.socket(family)`` and ``connect(sockaddr)``;
    each sockaddr holds a numeric address, so connecting never resolves the name again.
    A host literal in any spelling (``127.1``) is used as the address it denotes, without
    calling ``resolver``.  Otherwise ``resolver`` is called as ``resolver(host, port, 0,
    socket.SOCK_STREAM)`` and must answer like ``socket.getaddrinfo``.  The host is
    refused when ANY address it resolves to is ``target_refused`` — unless the host name
    itself or that address is allow-listed.  Resolution failures raise ``OSError`` (e.g.
    ``socket.gaierror``): that is a reason to retry, not to refuse.
    """
    literal = parse_host_address(host)
    if literal is not None:
        addrs = [literal]
    else:
        addrs = []
        for info in resolver(host, port, 0, socket.SOCK_STREAM):
            try:
                addrs.append(as_reached(ipaddress.ip_address(info[4][0])))
            except (ValueError, IndexError, TypeError):
                return [], Refusal(f"{host} did not resolve to an address",
                                   f"{host} resolved to {info!r}")
        if not addrs:
            raise OSError(f"{host} resolved to no address")
    host_allowed = allowlisted(host, None, allowlist)
    targets: list[tuple[int, tuple]] = []
    for addr in dict.fromkeys(addrs):  # de-duplicated, in resolver order
        if not host_allowed and not allowlisted(host, addr, allowlist) and target_refused(addr):
            return [], Refusal(f"{host} {RESOLVES_TO_REFUSED}",
                               f"{host} resolves to a refused address ({addr})")
        if addr.version == 4:
            targets.append((socket.AF_INET, (str(addr), port)))
        else:
            targets.append((socket.AF_INET6, (str(addr), port, 0, 0)))
    return targets, None


class PinnedConnection(http.client.HTTPConnection):
    """HTTP to ``host`` at addresses already checked (``checked_addresses``): ``connect``
    never resolves a name.

    ``host``/``port`` still make the Host header (and, for https, SNI and the name the
    certificate must match); the socket goes to the first ``targets`` entry that accepts.
    """

    def __init__(self, host: str, port: int, targets: list[tuple[int, tuple]], *,
                 connect_timeout_s: float, read_timeout_s: float,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(host, port, timeout=read_timeout_s)
        if tls is not None:
            self.default_port = http.client.HTTPS_PORT  # Host header omits :443, not :80
        self.auto_open = 0  # never reconnect behind our back
        self._targets = targets
        self._connect_timeout_s = connect_timeout_s
        self._tls = tls
        self.raw_socket: socket.socket | None = None

    def connect(self) -> None:
        error: OSError | None = None
        for family, sockaddr in self._targets:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._connect_timeout_s)
                sock.connect(sockaddr)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # A duplicate of the TCP socket survives the TLS wrap; the deadline
                # watchdog shuts the connection down through it.
                self.raw_socket = sock.dup()
                if self._tls is not None:
                    # The handshake is bounded by the connect timeout too.
                    sock = self._tls.wrap_socket(sock, server_hostname=self.host)
                sock.settimeout(self.timeout)
            except OSError as exc:
                sock.close()
                if self.raw_socket is not None:
                    self.raw_socket.close()
                    self.raw_socket = None
                if isinstance(exc, ssl.SSLError):
                    raise  # the server was reached: another address will not fix TLS
                error = exc
                continue
            self.sock = sock
            return
        raise error or OSError("no address to connect to")

    def close(self) -> None:
        super().close()
        if self.raw_socket is not None:
            self.raw_socket.close()
            self.raw_socket = None
