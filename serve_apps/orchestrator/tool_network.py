"""Where a server-side tool may send its call: the operator's URL prefixes and blocked networks.

Why: any key that may create a session names the URLs the orchestrator POSTs
to, from inside the cluster. Without a check, a session could aim a "tool" at a
cloud metadata service or an internal endpoint and read the reply back through
the model's transcript. Two rules, from `cluster.config.ToolNetworkConfig`:
- with `allowed_url_prefixes` set, a URL must start with one of them;
- no URL may reach a `blocked_networks` address: its host is checked when the
  session is created (a literal address) and, before every call, each address
  the host resolves to. The call then connects to those addresses, in the
  resolver's order (`Destination`), not to the name: a DNS answer that changes
  after the check (rebinding) cannot move it. Redirects are never followed
  (`tools.run_http_tool`), so a checked address is the one connected to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from cluster.config import ToolNetworkConfig

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


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
        self._prefixes = tuple(config.allowed_url_prefixes)
        self._blocked: tuple[IpNetwork, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in config.blocked_networks)

    def check_url(self, url: str) -> str | None:
        """The refusal of `url` by prefix or by a literal blocked address (no DNS lookup)."""
        return self._check_literal(url, urlsplit(url))

    def _check_literal(self, url: str, parts: SplitResult) -> str | None:
        if self._prefixes and not url.startswith(self._prefixes):
            return f"tool URL {url} is outside the allowed prefixes (tool_network.allowed_url_prefixes)"
        if parts.hostname is None:
            return f"tool URL {url} names no host"
        address = _address(parts.hostname)
        if address is None:
            return None  # a name: checked on what it resolves to, before each call
        return self._blocked_message(url, address)

    async def check_destination(self, url: str) -> Destination | str:
        """`check_url`, then every address the URL's host resolves to now.

        Returns:
            The refusal, or where to connect: the resolved addresses, so the
            connection goes where the check looked.
        """
        parts = urlsplit(url)
        problem = self._check_literal(url, parts)
        if problem is not None:
            return problem
        if not self._blocked or _address(parts.hostname) is not None:
            return Destination(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError as err:
            return f"tool URL {url}: its host does not resolve ({err})"
        addresses = list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))
        for address in addresses:
            problem = self._blocked_message(url, ipaddress.ip_address(address))
            if problem is not None:
                return problem
        if not addresses:
            return f"tool URL {url}: its host resolves to no address"
        return Destination(url, tuple(addresses))

    def _blocked_message(self, url: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:169.254.169.254 is 169.254.169.254
        for candidate in (address, mapped) if mapped is not None else (address,):
            for network in self._blocked:
                if candidate.version == network.version and candidate in network:
                    return f"tool URL {url} reaches {candidate}, in blocked network {network} (tool_network.blocked_networks)"
        return None


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a URL's host spells, or None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


__all__ = ["Destination", "ToolNetworkPolicy"]
