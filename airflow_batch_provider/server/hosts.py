"""Which ``Host`` a request may name: the defence of a keyless local server against DNS rebinding.

A web page on ``evil.example`` whose name is re-pointed at 127.0.0.1 reaches this server from
the victim's browser as same-origin, but its requests still say ``Host: evil.example``. The
server therefore answers only the names it serves: the loopback names, the address it is bound
to, and the names given with ``--allowed-host`` (``*`` allows every name).

Starlette's ``TrustedHostMiddleware`` is not used: it cuts the port at the first ``:``, so a
bracketed IPv6 host such as ``[::1]:8000`` never matches, and it answers plain text.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

import orjson

from airflow_batch_provider.server.wire import Wire

# Names every server answers to, whatever it is bound to.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"
# Addresses that bind every interface: they name no host a client could send.
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})  # noqa: S104 - compared, never bound
_MAX_SHOWN = 100  # characters of a refused Host value quoted back


def normalise_host(name: str) -> str:
    """``name`` as compared: lower case, without a trailing dot or IPv6 brackets."""
    name = name.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name


def host_of(header: str) -> str | None:
    """The host part of a ``Host`` header value (port removed, normalised); None when malformed.

    :param header: ``name``, ``name:port``, ``[v6]`` or ``[v6]:port``.
    """
    value = header.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        return normalise_host(host)
    name, sep, port = value.partition(":")
    if sep and not port.isdigit():
        return None  # a bare IPv6 address or junk: not a valid Host
    return normalise_host(name) or None


def allowed_hosts(bound: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a server bound to ``bound`` answers to (``{"*"}`` in the set allows all).

    :param bound: the interface the server listens on (``--host``).
    :param extra: the ``--allowed-host`` names.
    """
    names = {normalise_host(n) for n in (*LOOPBACK_HOSTS, *extra)}
    if normalise_host(bound) not in _WILDCARD_BINDS:
        names.add(normalise_host(bound))
    return frozenset(names)


class HostCheckMiddleware:
    """ASGI middleware refusing, on every route, a request whose ``Host`` the server does not serve.

    The refusal is a 421 Misdirected Request in the vendor's error shape, sent before any
    route, key check or fault runs.

    :param app: the application to protect.
    :param allowed: names from ``allowed_hosts`` (containing ``*``: every name passes).
    :param wire: the vendor wire shape of the error body.
    """

    def __init__(self, app: Any, *, allowed: frozenset[str], wire: Wire) -> None:
        self.app = app
        self.allowed = allowed
        self.allow_all = ANY_HOST in allowed
        self.wire = wire

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.allow_all or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = ""
        for name, value in scope.get("headers") or ():
            if name == b"host":
                header = value.decode("latin-1")
                break
        host = host_of(header)
        if host is not None and host in self.allowed:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        shown = header if len(header) <= _MAX_SHOWN else header[:_MAX_SHOWN] + "..."
        served = ", ".join(sorted(f"[{n}]" if ":" in n else n for n in self.allowed))
        error = self.wire.error(
            421,
            f"This server does not serve the host {shown!r}; it answers to {served}. "
            "Start it with --allowed-host NAME to serve another name (or '*' for any).",
            code="host_not_allowed",
        )
        body = orjson.dumps(error.body)
        await send(
            {
                "type": "http.response.start",
                "status": 421,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
