"""Platform credentials for dialects that sign requests with a cloud identity, not a key.

A dialect with a ``credentials_kind`` (``"aws"``: SigV4 with the amazon provider's ``aws``
connection) gets its credentials here, read through that platform's Airflow hook, and turns them
into an ``httpx.Auth`` (``Dialect.credentials_auth``) for both clients. Nothing is read when the
settings are built: the connection is read and credentials are made on the first signed request
(blocking in the sync client, in a thread in the async one, once per refresh, never per poll),
so building settings in the triggerer's event loop never blocks it. Credentials live only in
these objects: never in the settings' repr, logs, XCom or trigger kwargs.

A new platform adds one source to :data:`CREDENTIAL_SOURCES`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from airflow_batch_provider.exceptions import BatchApiAuthError, ConfigurationError

#: Credentials are made again this long before they expire (assumed roles, SSO, instance roles).
REFRESH_MARGIN = 300.0
#: The amazon provider's default connection.
DEFAULT_AWS_CONN_ID = "aws_default"


class AwsCredentials:
    """Frozen AWS credentials (``botocore`` ``ReadOnlyCredentials``) of an ``aws`` connection,
    read through the amazon provider's ``AwsBaseHook`` (keys, role assumption, profile, web
    identity...), refreshed before they expire.

    :param aws_conn_id: the ``aws`` connection (None: the boto3 default chain).
    :param region_name: the region to sign for (None: the connection's).
    :param clock: epoch seconds (tests pass their own).
    :param keys: an access key id and secret given on the batch connection itself (its login and
        password), used instead of the aws connection's.
    """

    def __init__(
        self,
        aws_conn_id: str | None,
        region_name: str | None = None,
        clock: Callable[[], float] = time.time,
        keys: tuple[str, str] | None = None,
    ) -> None:
        self.aws_conn_id = aws_conn_id
        self._region = region_name
        self._clock = clock
        self._lock = threading.Lock()
        self._session: Any = None
        self._frozen: Any = None
        self._expires: float | None = None
        if keys is not None:
            from botocore.credentials import ReadOnlyCredentials

            # Keys of the connection itself: nothing to read or refresh.
            self._frozen = ReadOnlyCredentials(keys[0], keys[1], None)

    def __repr__(self) -> str:
        return f"AwsCredentials(aws_conn_id={self.aws_conn_id!r}, region_name={self._region!r})"

    def _fresh(self) -> Any:
        if self._frozen is None:
            return None
        if self._expires is not None and self._clock() > self._expires - REFRESH_MARGIN:
            return None
        return self._frozen

    def get(self) -> Any:
        """The current credentials (blocking: reads the connection, may call STS)."""
        with self._lock:
            fresh = self._fresh()
            if fresh is not None:
                return fresh
            try:
                if self._session is None:
                    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

                    hook = AwsBaseHook(aws_conn_id=self.aws_conn_id, client_type="bedrock")
                    self._session = hook.get_session(region_name=self._region)
                    self._region = self._region or self._session.region_name or hook.region_name
                source = self._session.get_credentials()
                if source is None:
                    raise BatchApiAuthError(f"aws connection {self.aws_conn_id!r} gives no AWS credentials")
                frozen = source.get_frozen_credentials()
            except BatchApiAuthError:
                raise
            except Exception as exc:
                # Its type and first line only: a botocore message may quote a profile's values.
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise BatchApiAuthError(
                    f"cannot read AWS credentials of connection {self.aws_conn_id!r}: "
                    f"{type(exc).__name__}: {first}"
                ) from None
            expiry = getattr(source, "_expiry_time", None)
            self._expires = expiry.timestamp() if expiry is not None else None
            self._frozen = frozen
            return frozen

    async def aget(self) -> Any:
        """The current credentials without blocking the event loop (a thread only to refresh)."""
        fresh = self._fresh()
        if fresh is not None:
            return fresh
        return await asyncio.to_thread(self.get)

    @property
    def region_name(self) -> str | None:
        """The region the connection names (known once credentials were read, or given)."""
        return self._region

    @property
    def secret_values(self) -> tuple[str, ...]:
        """The secret parts of the credentials read so far, for redaction."""
        frozen = self._frozen
        if frozen is None:
            return ()
        return tuple(v for v in (frozen.secret_key, frozen.token) if v)


def aws_credentials(
    extra: Mapping[str, Any], conn_id: str, login: str | None, password: str | None
) -> AwsCredentials:
    """The batch connection's own keys (login: access key id, password: secret access key) when
    it has both, else the ``aws`` connection named by extra ``aws_conn_id`` (default
    ``aws_default``), read through the amazon provider's hook."""
    region = extra.get("region_name")
    if login and password:
        return AwsCredentials(None, str(region) if region else None, keys=(login, password))
    name = extra.get("aws_conn_id", DEFAULT_AWS_CONN_ID)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ConfigurationError(f"connection {conn_id!r}: extra 'aws_conn_id' must name an aws connection")
    return AwsCredentials(name.strip() if isinstance(name, str) else None, str(region) if region else None)


def aws_extra(
    extra: Mapping[str, Any], conn_id: str, login: str | None, password: str | None
) -> dict[str, Any]:
    """The aws connection's region (``AwsBaseHook.region_name``: its extra ``region_name``) as
    ``region_name``, when the batch connection signs with that connection (no keys of its own)
    and names no region itself; {} otherwise, or when the aws connection names none either."""
    if extra.get("region_name") or (login and password):
        return {}
    name = extra.get("aws_conn_id", DEFAULT_AWS_CONN_ID)
    if not isinstance(name, str) or not name.strip():
        return {}  # aws_credentials says what is wrong with it
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    try:
        region = AwsBaseHook(aws_conn_id=name.strip(), client_type="bedrock").region_name
    except Exception as exc:
        # The credentials read will name the problem; say only that no region was taken here.
        raise ConfigurationError(
            f"connection {conn_id!r}: cannot read the region of aws connection {name.strip()!r} "
            f"({type(exc).__name__}); set extra 'region_name' on the batch connection"
        ) from None
    return {"region_name": region} if isinstance(region, str) and region.strip() else {}


#: Per ``Dialect.credentials_kind``: extras the batch connection takes from the platform
#: connection it signs with, where it sets none itself (reads that connection: blocking).
PLATFORM_EXTRAS: dict[str, Callable[[Mapping[str, Any], str, str | None, str | None], dict[str, Any]]] = {
    "aws": aws_extra
}


def platform_extra(
    kind: str | None,
    extra: Mapping[str, Any],
    conn_id: str,
    login: str | None = None,
    password: str | None = None,
) -> dict[str, Any]:
    """The extras a connection of credentials ``kind`` inherits from its platform connection
    ({} for a dialect without platform credentials). Blocking: the async hook calls it in a
    thread, once, when it builds its settings.

    :param kind: the dialect's ``credentials_kind`` (None: nothing to inherit).
    :param extra: the batch connection's extra (plain names).
    :param conn_id: the batch connection id, for error messages.
    :param login: the batch connection's login (its own key id: nothing is inherited).
    :param password: the batch connection's password.
    """
    source = PLATFORM_EXTRAS.get(kind) if kind else None
    return source(extra, conn_id, login, password) if source is not None else {}


#: Per ``Dialect.credentials_kind``: reads the connection extra, returns the credentials object
#: the dialect's ``credentials_auth`` signs with (made lazily, see the module docstring).
CREDENTIAL_SOURCES: dict[str, Callable[[Mapping[str, Any], str, str | None, str | None], Any]] = {
    "aws": aws_credentials
}


def platform_credentials(
    kind: str, extra: Mapping[str, Any], conn_id: str, login: str | None = None, password: str | None = None
) -> Any:
    """The credentials of ``kind`` for a connection (nothing is read yet).

    :param kind: the dialect's ``credentials_kind``.
    :param extra: the connection extra.
    :param conn_id: the connection id, for error messages.
    :param login: the connection's login (a key id, for a source that takes keys).
    :param password: the connection's password (a secret).
    """
    try:
        source = CREDENTIAL_SOURCES[kind]
    except KeyError:
        raise ConfigurationError(
            f"connection {conn_id!r}: no credentials source {kind!r}; known: {', '.join(CREDENTIAL_SOURCES)}"
        ) from None
    return source(extra, conn_id, login, password)
