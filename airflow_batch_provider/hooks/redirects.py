"""Where a redirect to another origin may lead: https (or loopback http), never a private address.

A result file's content may redirect to an object store (``calls.file_content``), so its target
is chosen by the vendor's answer, not by the user. Unchecked, a hostile or compromised vendor
could point the worker or triggerer at an instance-metadata service or a host inside the
network (server-side request forgery), or move a signed URL onto plain http. Each hop to an
origin other than the connection's own is checked here: its host name and every address the
name resolves to (a name resolving to a private address is refused like the address itself).
The connection extra ``allow_private_redirects`` lifts the address rule for stores that live
inside the network.

:func:`refusal` is the pure decision; :func:`check_hop` (sync) and :func:`acheck_hop` (async,
resolving with ``loop.getaddrinfo`` so the event loop is never blocked) do the lookup.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

import httpx

from airflow_batch_provider.exceptions import BatchApiRedirectError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Instance-metadata services: credentials of the machine itself.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254")
)
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data"})
# Carrier-grade NAT space (RFC 6598): internal to a provider's network, not in ``is_private``.
SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")
ALLOW_EXTRA = "allow_private_redirects"


def address_kind(address: IPAddress) -> str | None:
    """What makes ``address`` a forbidden target (None: a public or loopback address).

    :param address: a resolved address (an IPv4-mapped IPv6 address is judged as its IPv4).
    """
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return None
    if address in METADATA_ADDRESSES:
        return "an instance-metadata address"
    if address.is_link_local:
        return "a link-local address"
    if (
        address.is_private
        or address in SHARED_ADDRESS_SPACE
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
    ):
        return "a private address"
    return None


def _is_loopback(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def refusal(url: httpx.URL, addresses: Iterable[IPAddress], *, allow_private: bool) -> str | None:
    """Why a redirect to ``url`` (whose host resolves to ``addresses``) is refused, or None.

    :param url: the redirect target.
    :param addresses: every address its host resolves to (the literal address for an IP host).
    :param allow_private: the connection allows private, link-local and metadata targets.
    """
    found = list(addresses)
    host = url.host.lower().rstrip(".")
    if not allow_private:
        if host in METADATA_HOSTS:
            return "an instance-metadata host"
        for address in found:
            kind = address_kind(address)
            if kind is not None:
                return kind if address == _literal(host) else f"resolves to {address}, {kind}"
    if url.scheme == "http" and not all(
        _is_loopback(a) or (allow_private and address_kind(a)) for a in found
    ):
        # A signed URL over plain http can be read (and replayed) by anyone on the path.
        return "plain http to a host that is not loopback"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _addresses(infos: Iterable[tuple[Any, ...]]) -> list[IPAddress]:
    # getaddrinfo's sockaddr starts with the address text; an IPv6 one may carry a %scope.
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def _port(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def _raise(url: httpx.URL, reason: str, action: str) -> None:
    # Only scheme, host and port: the path and query of a signed URL carry its credentials.
    hint = (
        "" if reason.startswith("plain http") else f"; set the connection extra {ALLOW_EXTRA!r} to allow it"
    )
    raise BatchApiRedirectError(
        f"{action}: refused a redirect to {url.scheme}://{url.host}:{_port(url)}: {reason}{hint}"
    )


def _unresolved(url: httpx.URL, exc: OSError) -> httpx.ConnectError:
    # A transport error, retried like a failed connect (which it would have become).
    return httpx.ConnectError(f"cannot resolve redirect target {url.host}: {exc.strerror or exc}")


def _known(url: httpx.URL, *, action: str, allow_private: bool) -> list[IPAddress] | None:
    """The addresses of a host that needs no lookup (an IP, or refused by name), else None."""
    literal = _literal(url.host)
    if literal is not None:
        return [literal]
    if not allow_private and url.host.lower().rstrip(".") in METADATA_HOSTS:
        # Refused by name, before any lookup: outside its cloud the name may not even resolve.
        _raise(url, "an instance-metadata host", action)
    return None


def check_hop(url: httpx.URL, *, action: str, allow_private: bool) -> None:
    """Refuse (``BatchApiRedirectError``) a redirect hop to ``url`` that :func:`refusal` refuses.

    :param url: the hop's target.
    :param action: what the call does, for the message.
    :param allow_private: the connection's ``allow_private_redirects``.
    """
    addresses = _known(url, action=action, allow_private=allow_private)
    if addresses is None:
        try:
            addresses = _addresses(
                socket.getaddrinfo(url.raw_host.decode(), _port(url), type=socket.SOCK_STREAM)
            )
        except OSError as exc:
            raise _unresolved(url, exc) from None
    reason = refusal(url, addresses, allow_private=allow_private)
    if reason is not None:
        _raise(url, reason, action)


async def acheck_hop(url: httpx.URL, *, action: str, allow_private: bool) -> None:
    """Async twin of :func:`check_hop`: the name is resolved without blocking the event loop."""
    addresses = _known(url, action=action, allow_private=allow_private)
    if addresses is None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(url.raw_host.decode(), _port(url), type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _unresolved(url, exc) from None
        addresses = _addresses(infos)
    reason = refusal(url, addresses, allow_private=allow_private)
    if reason is not None:
        _raise(url, reason, action)
