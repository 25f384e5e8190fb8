"""Which callback targets runstile may reach (SPEC §7): the checks that need no DNS.

Admission refuses a ``callback_url`` outright (400 ``invalid_callback_url``) when it is
not http(s) or names a host that is a refused address in any spelling inet_aton accepts
(``127.1``, ``2130706433``, ``0x7f.1``) or an IPv4-mapped IPv6 literal.  Names that need
resolving are checked again at delivery, against the address actually connected to:
``checked_addresses`` resolves a host once and returns the addresses delivery may connect
to (``runstile.webhooks.deliver`` connects to them and never resolves the name again, so a
DNS answer that changes between check and connect cannot steer it elsewhere).
"""

from __future__ import annotations

import ipaddress
import socket
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
#: IPv6 forms that carry or reach an IPv4 address and are refused at delivery whatever
#: that address is: IPv4-compatible (``::a.b.c.d``, deprecated) and local-use NAT64.
#: (IPv4-mapped and well-known NAT64 are refused by ``address_refused``; Teredo is not
#: globally routable; 6to4 is judged by the address it embeds.)
_REFUSED_V6_TRANSLATED = [ipaddress.ip_network(n) for n in ("::/96", "64:ff9b:1::/48")]
MAX_URL_LENGTH = 2048


def parse_host_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host literal denotes, in every spelling a resolver would accept."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        # inet_aton accepts the legacy forms (127.1, 2130706433, 0x7f.1) that
        # ipaddress rejects but C resolvers happily connect to.
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def address_refused(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):
        mapped = addr.ipv4_mapped or addr.sixtofour
        if mapped is not None:
            return True if addr.ipv4_mapped else address_refused(mapped)
        return any(addr in net for net in _REFUSED_V6)
    return any(addr in net for net in _REFUSED_V4)


def allowlisted(host: str, addr, allowlist: tuple[str, ...]) -> bool:
    for entry in allowlist:
        if "/" in entry:
            if addr is not None and addr.version == ipaddress.ip_network(entry, strict=False).version \
                    and addr in ipaddress.ip_network(entry, strict=False):
                return True
        elif entry.lower().strip("[]") == host.lower():
            return True
    return False


def callback_refusal(url: str, allowlist: tuple[str, ...] = ()) -> str | None:
    """Why ``url`` may never be a callback target, or None if it may be (pending DNS)."""
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
    host = (parts.hostname or "").rstrip(".")
    if not host:
        return "callback_url has no host"
    del port
    addr = parse_host_address(host)
    if allowlisted(host, addr, allowlist):
        return None
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return "callback_url points at this machine (localhost)"
    if addr is not None and address_refused(addr):
        return f"callback_url points at a refused address ({addr})"
    return None


def target_refused(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether delivery must not connect to ``addr`` (before the allowlist is consulted).

    Stricter than ``address_refused``: also every address Python does not consider
    globally routable (documentation, benchmarking, Teredo, …), reserved ranges, and the
    IPv6 forms that reach an IPv4 address (``_REFUSED_V6_TRANSLATED``).
    """
    if address_refused(addr) or addr.is_multicast or addr.is_reserved or not addr.is_global:
        return True
    return isinstance(addr, ipaddress.IPv6Address) and any(
        addr in net for net in _REFUSED_V6_TRANSLATED)


def checked_addresses(host: str, port: int, allowlist: tuple[str, ...] = (),
                      resolver=socket.getaddrinfo) -> tuple[list[tuple[int, tuple]], str | None]:
    """Resolve ``host`` once; return ``(targets, None)`` or ``([], why_refused)``.

    ``targets`` are ``(family, sockaddr)`` pairs to pass to ``socket.socket(family)`` and
    ``connect(sockaddr)``; each sockaddr holds a numeric address, so connecting never
    resolves the name again.  A host literal in any legacy spelling (``127.1``) is used
    as is, without calling ``resolver``.  Otherwise ``resolver`` is called as
    ``resolver(host, port, 0, socket.SOCK_STREAM)`` and must answer like
    ``socket.getaddrinfo``.  The host is refused when ANY address it resolves to is
    ``target_refused`` — unless the host name itself or that address is allow-listed
    (exact host name, or CIDR).  Resolution failures raise ``OSError`` (e.g.
    ``socket.gaierror``): that is a reason to retry, not to refuse.
    """
    host = host.strip("[]").rstrip(".")
    literal = parse_host_address(host)
    if literal is not None:
        addrs = [literal]
    else:
        addrs = []
        for info in resolver(host, port, 0, socket.SOCK_STREAM):
            try:
                addrs.append(ipaddress.ip_address(info[4][0]))
            except (ValueError, IndexError, TypeError):
                return [], f"{host} resolved to something that is not an address ({info!r})"
        if not addrs:
            raise OSError(f"{host} resolved to no address")
    host_allowed = allowlisted(host, None, allowlist)
    targets: list[tuple[int, tuple]] = []
    for addr in dict.fromkeys(addrs):  # de-duplicated, in resolver order
        if not host_allowed and not allowlisted(host, addr, allowlist) and target_refused(addr):
            return [], f"{host} resolves to a refused address ({addr})"
        if addr.version == 4:
            targets.append((socket.AF_INET, (str(addr), port)))
        else:
            targets.append((socket.AF_INET6, (str(addr), port, 0, 0)))
    return targets, None
