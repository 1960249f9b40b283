"""AWS Signature Version 4 on every request of the project's own httpx clients, as an ``httpx.Auth``.

botocore's signer (the one boto3 uses) signs each request just before it is sent, over its method,
URL, body hash and a fixed set of headers (``host``, ``content-type``, ``x-amz-*``), so what httpx
adds later cannot break the signature. The async flow asks the credentials for ``aget`` (a thread
only when they are refreshed), so the triggerer's loop never waits on a signature. A request to
another origin (a redirect) is not signed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import Any

import httpx

from airflow_batch_provider.dialects.tokens import url_origin

# Headers signed besides every ``x-amz-*``: the ones no proxy or client rewrites.
_SIGNED = ("host", "content-type")


class SigV4Auth(httpx.Auth):
    """Sign requests to ``origin_url`` with SigV4 for ``service`` in ``region``.

    :param origin_url: the API root; only requests to its scheme, host and port are signed.
    :param credentials: an object with ``get()`` and ``async aget()`` giving botocore
        ``ReadOnlyCredentials`` (``hooks/credentials.AwsCredentials``).
    :param service: the signing name (``bedrock``).
    :param region: the region (None: the credentials' ``region_name``).
    """

    requires_request_body = True

    def __init__(self, origin_url: str, credentials: Any, service: str, region: str | None) -> None:
        self._origin = url_origin(httpx.URL(origin_url))
        self.credentials = credentials
        self.service = service
        self.region = region

    def __repr__(self) -> str:
        return f"SigV4Auth(service={self.service!r}, region={self.region!r})"

    @property
    def secret_values(self) -> tuple[str, ...]:
        """Secrets to redact from vendor text (the credentials' secret key and token)."""
        return tuple(getattr(self.credentials, "secret_values", ()))

    def sign(self, request: httpx.Request, frozen: Any) -> None:
        """Add ``Authorization``, ``X-Amz-Date`` (and ``X-Amz-Security-Token``) to ``request``."""
        from botocore.auth import SigV4Auth as BotoSigner
        from botocore.awsrequest import AWSRequest

        region = self.region or getattr(self.credentials, "region_name", None) or "us-east-1"
        headers = {k: v for k, v in request.headers.items() if k.lower() in _SIGNED}
        for name in [k for k in request.headers if k.lower().startswith("x-amz-")]:
            del request.headers[name]
        aws = AWSRequest(method=request.method, url=str(request.url), data=request.content, headers=headers)
        BotoSigner(frozen, self.service, region).add_auth(aws)
        for name, value in aws.headers.items():
            if name.lower() == "authorization" or name.lower().startswith("x-amz-"):
                request.headers[name] = value

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if url_origin(request.url) == self._origin:
            self.sign(request, self.credentials.get())
        yield request

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        if url_origin(request.url) == self._origin:
            self.sign(request, await self.credentials.aget())
        yield request
