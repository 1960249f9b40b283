"""A bearer token fetched at run time and refreshed before it expires, as an ``httpx.Auth``.

For dialects that authenticate by a short-lived token rather than a fixed key. The dialect
supplies two fetchers, a blocking one for the sync client and a coroutine for the async one, so
the triggerer's event loop never waits on a blocking token call. The token lives only in this
object: never in the settings' repr, the connection, the logs or a trigger's kwargs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

from airflow_batch_provider.exceptions import BatchApiAuthError

# Refreshed this long before the token's expiry, so no request leaves with a token that dies
# on the way (and clock skew between here and the issuer does not matter).
REFRESH_MARGIN = 300.0


@dataclass(frozen=True)
class Token:
    """One bearer token and when it expires (epoch seconds)."""

    value: str
    expires_on: float

    def __repr__(self) -> str:
        return f"Token(value=***, expires_on={self.expires_on})"


SyncFetch = Callable[[], Token]
AsyncFetch = Callable[[], Awaitable[Token]]


def url_origin(url: httpx.URL) -> tuple[str, str, int | None]:
    """``(scheme, host, port)``: what an auth compares to sign only requests to its API's origin."""
    return (url.scheme, url.host, url.port)


class RefreshingBearerAuth(httpx.Auth):
    """``Authorization: Bearer <token>`` on every request to the API's origin.

    The token is fetched on first use and again once it is within ``margin`` seconds of expiry;
    concurrent requests share one fetch. A request to another origin (a result file's redirect
    to object storage) gets no token.

    :param origin_url: the API root; only requests to its scheme, host and port are signed.
    :param fetch: gets a token, blocking (the sync client's flow).
    :param afetch: gets a token without blocking the event loop (the async client's flow).
    :param what: names the token's source in errors (``Microsoft Entra ID``).
    :param margin: seconds before expiry at which the token is refreshed.
    :param clock: the time in epoch seconds (tests pass their own).
    :param close: releases what ``fetch`` holds (a credential's HTTP session); None: nothing.
    :param aclose: releases what ``afetch`` holds, awaited; None: nothing.
    """

    def __init__(
        self,
        origin_url: str,
        fetch: SyncFetch,
        afetch: AsyncFetch,
        *,
        what: str,
        margin: float = REFRESH_MARGIN,
        clock: Callable[[], float] = time.time,
        close: Callable[[], None] | None = None,
        aclose: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._origin = url_origin(httpx.URL(origin_url))
        self._fetch = fetch
        self._afetch = afetch
        self._what = what
        self._margin = margin
        self._clock = clock
        self._token: Token | None = None
        self._lock = threading.Lock()
        self._alock: asyncio.Lock | None = None
        self._close = close
        self._aclose = aclose
        self.fetches = 0

    def close(self) -> None:
        """Release the sync fetcher's resources (the hook's ``close``); a later call fetches anew."""
        if self._close is not None:
            self._close()

    async def aclose(self) -> None:
        """Release the async fetcher's resources (the hook's ``aclose``) without blocking the loop."""
        if self._aclose is not None:
            await self._aclose()

    def __repr__(self) -> str:
        return f"<RefreshingBearerAuth {self._what}>"

    @property
    def secret_values(self) -> tuple[str, ...]:
        """The current token, for redaction from vendor text."""
        return (self._token.value,) if self._token is not None else ()

    def _fresh(self) -> Token | None:
        token = self._token
        if token is not None and token.expires_on - self._margin > self._clock():
            return token
        return None

    def _accept(self, token: Any) -> Token:
        if not isinstance(token, Token) or not token.value:
            raise BatchApiAuthError(f"{self._what} gave no access token")
        self._token = token
        self.fetches += 1
        return token

    def _signed(self, request: httpx.Request, token: Token | None) -> httpx.Request:
        if token is not None:
            request.headers["Authorization"] = f"Bearer {token.value}"
        return request

    def _wants_token(self, request: httpx.Request) -> bool:
        return url_origin(request.url) == self._origin

    def token(self) -> Token:
        """The current token, fetched (blocking) when there is none or it is about to expire."""
        with self._lock:
            return self._fresh() or self._accept(self._fetch())

    async def atoken(self) -> Token:
        """The current token, fetched without blocking the event loop when needed."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            return self._fresh() or self._accept(await self._afetch())

    def _answered(self, token: Token | None, response: httpx.Response) -> None:
        # A token refused before its expiry (revoked, rotated credential) is dropped, so the next
        # call (the retry, the next poll) fetches a new one instead of sending it until it expires.
        if token is not None and response.status_code == 401 and self._token is token:
            self._token = None

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.token() if self._wants_token(request) else None
        response = yield self._signed(request, token)
        self._answered(token, response)

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token = await self.atoken() if self._wants_token(request) else None
        response = yield self._signed(request, token)
        self._answered(token, response)
