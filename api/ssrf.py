"""The SSRF guard for media fetches: which addresses an image URL may make the server connect to.

It sits in the network backend of the httpx client, so the address checked is the address connected
to: each connect (every hop of a redirect chain) resolves its host once, vets every resolved address,
and connects to a vetted IP (TLS still verifies the URL's hostname). A DNS answer that changes between
a check and the connect (rebinding) has nothing to exploit, and an environment proxy is never used.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpcore
import httpx

from api.errors import APIError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata endpoints; already non-global, named so the refusal says why.
METADATA_ADDRESSES = frozenset(
    map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def norm_host(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def is_public_address(ip: IPAddress) -> bool:
    """True for globally routable unicast addresses, including IPv4 embedded in IPv6 forms."""
    if not ip.is_global or ip.is_multicast or ip in METADATA_ADDRESSES:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(embedded)
    return True


def _legacy_ipv4(host: str) -> str | None:
    """The dotted quad of a legacy numeric IPv4 form ("2130706433", "127.1", "0x7f.1"), which the C resolver
    reads as an address; None for anything else."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(host))  # a parse, not a lookup
    except OSError:
        return None


def refused(message: str) -> APIError:
    return APIError(400, message, param="image_url", code="media_url_forbidden")


class AddressGuard:
    """Resolves a host once and returns the addresses that may be connected to, or refuses.

    ``allowed_domains`` (normalised hostnames) and ``allow_private`` exempt hosts from the refusal of
    non-public addresses: an operator's explicit trust, as vLLM's flags of those names.
    """

    def __init__(self, allowed_domains: frozenset[str] = frozenset(), allow_private: bool = False) -> None:
        self.allowed_domains = frozenset(norm_host(h) for h in allowed_domains)
        self.allow_private = allow_private

    def exempt(self, host: str) -> bool:
        return self.allow_private or norm_host(host) in self.allowed_domains

    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        lookup = _legacy_ipv4(host) or host
        try:
            infos = await loop.getaddrinfo(lookup, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            raise APIError(
                400,
                f"cannot resolve image host {host!r}: {exc}",
                param="image_url",
                code="media_fetch_failed",
            ) from None
        addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addrs:
            raise APIError(
                400, f"image host {host!r} has no address", param="image_url", code="media_fetch_failed"
            )
        if not self.exempt(host):
            for addr in addrs:
                ip = ipaddress.ip_address(addr.split("%", 1)[0])
                if not is_public_address(ip):
                    # NOTE: one bad record refuses the host: the connect must not fall back to it.
                    kind = "a cloud metadata" if ip in METADATA_ADDRESSES else "a non-public"
                    raise refused(
                        f"image host {host!r} resolves to {kind} address ({ip}); refused. Allow it with "
                        "--allowed-media-domains or --allow-private-media"
                    )
        return addrs


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """Connects only to addresses the guard vetted for the host being connected to."""

    def __init__(self, guard: AddressGuard) -> None:
        self.guard = guard
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            async with asyncio.timeout(timeout):
                addrs = await self.guard.resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} timed out") from None
        last: Exception | None = None
        for addr in addrs:
            try:
                return await self.inner.connect_tcp(
                    addr, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise refused("unix sockets are not media sources")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport whose every TCP connect goes through the guard."""

    def __init__(self, guard: AddressGuard) -> None:
        super().__init__(trust_env=False)
        # NOTE: httpx has no option for the network backend; its transport keeps its pool in `_pool`,
        # and everything else (request/response mapping, errors) stays httpx's own.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=64,
            max_keepalive_connections=16,
            network_backend=_GuardedBackend(guard),
        )
