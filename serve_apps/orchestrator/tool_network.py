"""Where a server-side tool may send its call: the operator's URL prefixes and blocked networks.

Why: any key that may create a session names the URLs the orchestrator POSTs
to, from inside the cluster. Without a check, a session could aim a "tool" at a
cloud metadata service or an internal endpoint and read the reply back through
the model's transcript. Two rules, from `cluster.config.ToolNetworkConfig`:
- with `allowed_url_prefixes` set, a URL must fall under one of them: same
  scheme, host and port, and a path at or below the prefix's (compared parsed,
  so `http://tools.internal@evil/` is evil's, and a `..` segment is refused);
- no URL may reach a `blocked_networks` address: its host is checked when the
  session is created (a literal address) and, before every call, each address
  the host resolves to, with the IPv4 address an IPv6 one embeds, the
  loopback that 0.0.0.0 and :: connect to, and either family's loopback for
  the other's (blocking 127.0.0.0/8 blocks ::1 too). The call then connects to those addresses, in the
  resolver's order (`Destination`), not to the name: a DNS answer that changes
  after the check (rebinding) cannot move it. Redirects are never followed
  (`tools.run_http_tool`), so a checked address is the one connected to.
A URL whose port the HTTP client reads otherwise than the check
(`http://[::1]8265/`) is refused: the check must judge the call that is sent.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpx

from cluster.config import ToolNetworkConfig

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Tool hosts are looked up on threads of their own: a name whose server never answers holds its thread until
# the resolver gives up (a cancelled call does not stop it), and on the loop's default pool (six threads on two
# cores) a session's tool could hold every thread the replica's own lookups (Redis reconnecting) need. A thread
# blocked in a lookup costs little: there are enough that names under a zone whose server never answers hold
# all of them only when as many distinct ones are looked up at once.
_TOOL_LOOKUPS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tool-dns")
# The lookup of each (host, port) now running: calls to a host whose lookup has not ended wait for that one
# (`_resolve`). Without it, four turns aimed at a name whose server never answers held the four threads for the
# resolver's whole timeout, and every other session's tool waited behind them until its own call timed out.
_LOOKUPS_RUNNING: dict[tuple[str, int], Future] = {}
# How many calls wait on each lookup: one that every caller left (their tools timed out) is cancelled while
# still queued, so abandoned lookups of distinct names never queue ahead of other sessions' for long.
_LOOKUP_WAITERS: dict[Future, int] = {}
_LOOKUPS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a checked tool call connects.

    Attributes:
        url: the tool's URL, as the session gave it.
        addresses: the checked addresses the host resolved to, in the
            resolver's order: a call tries the next only when it cannot connect
            to one. Empty when the host is an address itself, or no network is
            blocked (then the URL's host is connected to as is).
    """

    url: str
    addresses: tuple[str, ...] = ()


class ToolNetworkPolicy:
    """Checks HTTP tool URLs: each check returns a refusal message, else None (`check_url`) or a `Destination`."""

    def __init__(self, config: ToolNetworkConfig) -> None:
        # What a key must hold to give a session HTTP tools (None: any key may).
        self.http_tools_permission = config.http_tools_permission
        self._prefixes = tuple(_parse_prefix(prefix) for prefix in config.allowed_url_prefixes)
        self._blocked: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in config.blocked_networks)

    def check_url(self, url: str) -> str | None:
        """The refusal of `url` by prefix or by a literal blocked address (no DNS lookup)."""
        parsed = _parse(url)
        return parsed if isinstance(parsed, str) else self._check_literal(url, parsed)

    def _check_literal(self, url: str, parsed: "_ParsedUrl") -> str | None:
        if self._prefixes and not any(prefix.admits(parsed) for prefix in self._prefixes):
            return f"tool URL {shown_url(url)} is outside the allowed prefixes (tool_network.allowed_url_prefixes)"
        address = _address(parsed.host)
        if address is None:
            return None  # a name: checked on what it resolves to, before each call
        return self._blocked_message(url, address)

    async def check_destination(self, url: str) -> Destination | str:
        """`check_url`, then every address the URL's host resolves to now.

        Returns:
            The refusal, or where to connect: the resolved addresses, so the
            connection goes where the check looked.
        """
        parsed = _parse(url)
        if isinstance(parsed, str):
            return parsed
        problem = self._check_literal(url, parsed)
        if problem is not None:
            return problem
        if not self._blocked or _address(parsed.host) is not None:
            return Destination(url)
        try:
            infos = await _resolve(parsed.host, parsed.port)
        except (OSError, UnicodeError) as err:  # UnicodeError: a name IDNA cannot encode (an empty label)
            return f"tool URL {shown_url(url)}: its host does not resolve ({err})"
        addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
        for address in addresses:
            problem = self._blocked_message(url, ipaddress.ip_address(address))
            if problem is not None:
                return problem
        if not addresses:
            return f"tool URL {shown_url(url)}: its host resolves to no address"
        return Destination(url, tuple(addresses))

    def _blocked_message(self, url: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        for candidate in _reached(address):
            for network in self._blocked:
                if candidate.version == network.version and candidate in network:
                    return f"tool URL {shown_url(url)} reaches {candidate}, in blocked network {network} (tool_network.blocked_networks)"
        return None


@dataclass(frozen=True, slots=True)
class _ParsedUrl:
    """A URL by parts; an allowed prefix is one too, compared by parts: a string prefix would admit
    `http://tools.internal@evil/`."""

    scheme: str
    host: str
    port: int
    path: str

    def admits(self, url: "_ParsedUrl") -> bool:
        """As a prefix: same scheme, host and port; the path is this one or under it (`/api` admits `/api/x`, not `/apix`)."""
        if (url.scheme, url.host, url.port) != (self.scheme, self.host, self.port):
            return False
        if not self.path or self.path.endswith("/"):
            return url.path.startswith(self.path)
        return url.path == self.path or url.path.startswith(self.path + "/")


async def _resolve(host: str, port: int) -> list:
    """`_getaddrinfo` on the lookup threads, shared by every call that asks for `(host, port)` while it runs.

    A caller that leaves (its tool timed out) leaves the lookup running for the others: shielded, so its
    cancellation cannot cancel a lookup still queued that others wait on. The last to leave cancels it,
    if it is still queued (a running one ends as the resolver ends it).
    """
    key = (host, port)
    with _LOOKUPS_LOCK:
        lookup = _LOOKUPS_RUNNING.get(key)
        started = lookup is None
        if started:
            lookup = _TOOL_LOOKUPS.submit(_getaddrinfo, host, port)
            _LOOKUPS_RUNNING[key] = lookup
        _LOOKUP_WAITERS[lookup] = _LOOKUP_WAITERS.get(lookup, 0) + 1
    if started:  # outside the lock: a lookup already done runs its callback here, and the callback takes the lock
        lookup.add_done_callback(lambda done: _forget_lookup(key, done))
    answer = asyncio.wrap_future(lookup)
    answer.add_done_callback(_read)  # its failure, once this caller left, is read here, not logged as unread
    try:
        return await asyncio.shield(answer)
    finally:
        with _LOOKUPS_LOCK:
            _LOOKUP_WAITERS[lookup] -= 1
            is_abandoned = not _LOOKUP_WAITERS[lookup]
            if is_abandoned:
                del _LOOKUP_WAITERS[lookup]
        if is_abandoned:  # outside the lock, as above: cancelling runs the callback here
            lookup.cancel()  # nothing where it ran or ended


def _read(answer: asyncio.Future) -> None:
    if not answer.cancelled():
        answer.exception()


def _forget_lookup(key: tuple[str, int], lookup: Future) -> None:
    with _LOOKUPS_LOCK:
        if _LOOKUPS_RUNNING.get(key) is lookup:
            del _LOOKUPS_RUNNING[key]


def _getaddrinfo(host: str, port: int) -> list:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _parse(url: str) -> _ParsedUrl | str:
    """The URL's scheme, host, port (the scheme's default if none) and path, or the refusal of a URL that has none.

    A path with a `.` or `..` segment is refused: the HTTP client removes them,
    so the path a prefix was checked against would not be the one requested. So
    is one a server may read as such: a dot segment with parameters (`..;`), an
    encoded slash or a backslash in a segment.
    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as err:  # a bracketed host that is no IPv6 address, a port out of range
        return f"tool URL {shown_url(url)} cannot be parsed ({_unquoted(err)})"
    if not host:
        return f"tool URL {shown_url(url)} names no host"
    for segment in map(unquote, parts.path.split("/")):
        if segment.split(";")[0] in (".", ".."):  # `..;/` too: Tomcat and Spring read it as `..`
            return f"tool URL {shown_url(url)} has a '.' or '..' path segment"
        if "/" in segment or "\\" in segment:  # `..%2f`, `..\`: servers that decode or fold them step out of a prefix
            return f"tool URL {shown_url(url)} has an encoded '/' or a '\\' in a path segment"
    port = port or _DEFAULT_PORTS.get(parts.scheme, 80)
    try:
        sent = httpx.URL(url)  # how the call is sent
    except httpx.InvalidURL as err:
        return f"tool URL {shown_url(url)} cannot be parsed ({_unquoted(err)})"
    if (sent.port or _DEFAULT_PORTS.get(sent.scheme, 80)) != port:
        return f"tool URL {shown_url(url)} is ambiguous: its port reads as {port} here and {sent.port} to the HTTP client"
    # The host as the HTTP client sends it (IDNA 2008, `。` as `.`): resolved as `urlsplit` gives it, the socket
    # module's IDNA 2003 looked up `strasse.de` for `straße.de` and the call went to another domain's owner.
    # An empty path is `/`, which the HTTP client requests: a prefix `https://tools.internal/` admits
    # `https://tools.internal`.
    return _ParsedUrl(parts.scheme, sent.raw_host.decode("ascii") or host, port, parts.path or "/")


_DEFAULT_PORTS = {"http": 80, "https": 443}
# A URL's userinfo (`user:password@`), up to its last `@`: a password with a `/`, `?` or `#` in it
# (`http://svc:pa/s?s@host/`, which parsers read as host `svc`, port `pa`) is hidden too, at the cost of a
# path's or query's own `@` (`/users/@me`) hiding the host in a refusal.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://).*@", re.DOTALL)
_AUTHORITY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)")
# What a parse error quotes of the URL (`Invalid port: 'pa'`): may be a piece of a password.
_QUOTED = re.compile(r"'[^']*'")


def _port_is_no_number(authority: str) -> bool:
    _, colon, port = authority[authority.rfind("]") + 1:].partition(":")  # after an IPv6 literal's brackets
    return bool(colon and port) and not port.isdigit()


def _unquoted(err: Exception) -> str:
    return _QUOTED.sub("'…'", str(err))


def shown_url(url: str) -> str:
    """`url` as refusals show it, to the model, the client, logs and traces: without its userinfo or query.

    Why: a tool URL may carry a password or a token (`https://svc:pw@host/x?api_key=...`),
    which the session's creator gave the orchestrator to call with, not to be repeated.
    """
    text, hidden = _USERINFO.subn(r"\1***@", url)
    authority = _AUTHORITY.match(text)
    if not hidden and authority and _port_is_no_number(authority[2]):  # no `@`: `svc:pa` of `http://svc:pa/x`
        text = authority[1] + "***" + text[authority.end():]
    for mark in "?#":
        head, found, _ = text.partition(mark)
        if found:
            text = head + mark + "…"
    return text


def _parse_prefix(prefix: str) -> _ParsedUrl:
    parsed = _parse(prefix)
    if isinstance(parsed, str):
        raise ValueError(f"tool_network.allowed_url_prefixes: {parsed}")
    return parsed


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# RFC 8215's local-use NAT64 prefix: a domain picks its own prefix length in it (48 to 96).
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def _reached(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """`address` and what a connection to it may reach instead: the IPv4 address an IPv6 one
    embeds (mapped, compatible, translated, NAT64 and local-use NAT64, 6to4, Teredo), and this host's loopback for an
    unspecified address, embedded or not (Linux connects 0.0.0.0, ::ffff:0.0.0.0 and :: to it)."""
    reached = [address]
    if isinstance(address, ipaddress.IPv6Address):
        low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.ipv4_mapped is not None:
            reached.append(address.ipv4_mapped)
        elif address in _NAT64 or address in _IPV4_TRANSLATED:
            reached.append(low32)
        elif address in _IPV4_COMPATIBLE and int(address) > 1:
            reached.append(low32)
        elif address in _NAT64_LOCAL:
            reached.extend(_local_nat64_ipv4s(address))
        if address.sixtofour is not None:
            reached.append(address.sixtofour)
        if address.teredo is not None:
            reached.append(address.teredo[1])
        if address.is_unspecified:
            reached.append(ipaddress.IPv6Address("::1"))
    # Also an IPv4 address embedded in an IPv6 one: Linux connects ::ffff:0.0.0.0 to 127.0.0.1 too.
    if any(isinstance(a, ipaddress.IPv4Address) and a in _THIS_NETWORK for a in reached):
        reached.append(ipaddress.IPv4Address("127.0.0.1"))
    # This host's loopback in one family is this host's in the other (a dual-stack service answers both):
    # a list that blocks 127.0.0.0/8 alone still means loopback.
    if any(a.is_loopback for a in reached):
        reached.extend((ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")))
    return reached


def _local_nat64_ipv4s(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an address of the local-use NAT64 prefix may embed: RFC 6052's layout for each
    prefix length a /48 allows (48, 56, 64, 96), the byte 8 ("u") skipped; which one a domain uses is not
    visible from the address, so all are checked."""
    b = address.packed
    return [ipaddress.IPv4Address(bytes(part)) for part in (b[6:8] + b[9:11], b[7:8] + b[9:12], b[9:13], b[12:16])]


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a URL's host spells, or None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


__all__ = ["Destination", "ToolNetworkPolicy"]
