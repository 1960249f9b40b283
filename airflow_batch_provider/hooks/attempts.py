"""What a call does after an attempt fails: wait and try again, or raise the typed error.

:class:`Retries` holds the decisions of an idempotent call (retry per the policy) and
:class:`SendOnce` those of a non-idempotent one (a batch create, repeated only when it provably
did not reach the server or was refused). None of them does I/O: the hook's sync and async
request loops feed them alike, the way ``waiting.PollLoop`` serves both watch loops.
:class:`Restarts` counts restarts of a streamed body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from airflow_batch_provider.exceptions import BatchApiError, BatchApiQuotaError
from airflow_batch_provider.hooks.retry import NOT_SENT_ERRORS, REFUSED_STATUS, is_retryable_status
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.hooks.transport import status_error, transport_error


class AmbiguousCreate(Exception):
    """A create request failed in a way that does not tell whether the batch exists."""

    def __init__(self, error: BatchApiError, response: httpx.Response | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.response = response


class BodyDropped(Exception):
    """A 2xx answer's body broke off after its status and headers arrived (a dropped connection).

    Kept apart from a failed connection: a results page or listing cut mid-body is restarted
    on a budget of its own, as a streamed file is (``Restarts``), so drops and error answers
    do not spend one another's retries.
    """

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


def message_of(error: BatchApiError) -> str:
    """The error's message without the `` | status=... | body=...`` that ``BatchApiError`` appends."""
    return str(error).split(" | ", 1)[0]


def with_note(error: BatchApiError, note: str) -> BatchApiError:
    """The same typed error with a note appended to its message."""
    return type(error)(
        f"{message_of(error)}; {note}",
        status_code=error.status_code,
        request_id=error.request_id,
        body=error.body,
    )


def error_body(response: httpx.Response) -> Any:
    """The parsed JSON of an error answer (already read), or None."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None


@dataclass
class Retries:
    """The decisions of an idempotent call: after each failed attempt, wait or raise.

    An answer the dialect reads as out of quota raises ``BatchApiQuotaError`` at once:
    waiting does not refill a quota.

    :param settings: the connection's settings (policy, dialect, secrets).
    :param action: what the call does, for messages (``getting batch b1``).
    :param what: the object a 404 is about (``batch 'b1'``).
    :param log: where retries are logged.
    """

    settings: BatchApiSettings
    action: str
    what: str | None
    log: Any
    retry: int = 0
    # 2xx bodies that broke off mid-way (``body_dropped``), counted apart from ``retry``.
    drops: int = 0

    def transport_failed(self, exc: httpx.TransportError) -> float:
        """Seconds to wait before the next attempt after ``exc``; raises once none is left."""
        error = transport_error(
            exc, action=self.action, secret=self.settings.secrets, base_url=self.settings.base_url
        )
        self._judge_transport(exc, error)
        if self.retry >= self.settings.retry.max_retries:
            raise error from exc
        return self._next(self.settings.retry.delay(self.retry), type(exc).__name__)

    def body_dropped(self, exc: httpx.TransportError) -> float:
        """Seconds to wait after a 2xx body broke off; its own budget (``max_retries`` drops)."""
        error = transport_error(exc, action=self.action, secret=self.settings.secrets)
        # A create whose answer broke off may have been acted on (SendOnce raises here).
        self._judge_transport(exc, error)
        policy = self.settings.retry
        if self.drops >= policy.max_retries:
            raise error from exc
        self.drops += 1
        delay = policy.backoff(self.drops - 1)
        self.log.warning(
            "%s: the answer broke off (%s); re-requesting (drop %d/%d) in %.2fs",
            self.action,
            type(exc).__name__,
            self.drops,
            policy.max_retries,
            delay,
        )
        return delay

    def status_failed(self, response: httpx.Response) -> float:
        """Seconds to wait after an error answer (read and closed); raises the typed error instead."""
        self._raise_if_quota(response)
        retryable = is_retryable_status(response.status_code)
        self._judge_status(response, retryable)
        if not retryable or self.retry >= self.settings.retry.max_retries:
            raise self.status_error(response)
        return self._next(self.settings.retry.delay(self.retry, response), f"HTTP {response.status_code}")

    def status_error(self, response: httpx.Response) -> BatchApiError:
        settings = self.settings
        return status_error(
            response,
            action=self.action,
            what=self.what,
            base_url=settings.base_url,
            secret=settings.secrets,
            auth_refused=settings.dialect.is_auth_error(response.status_code, error_body(response)),
            not_found=settings.dialect.is_not_found(response.status_code, error_body(response)),
        )

    def _judge_transport(self, exc: httpx.TransportError, error: BatchApiError) -> None:
        """An idempotent request may always be repeated."""

    def _judge_status(self, response: httpx.Response, retryable: bool) -> None:
        """An idempotent request may always be repeated."""

    def _raise_if_quota(self, response: httpx.Response) -> None:
        settings = self.settings
        if not settings.dialect.is_quota_error(response.status_code, error_body(response)):
            return
        error = self.status_error(response)
        raise BatchApiQuotaError(
            f"{self.action}: the account is out of quota or credit at {settings.base_url} "
            f"(HTTP {response.status_code}); not retried: add credit or raise the quota, then run again",
            status_code=error.status_code,
            request_id=error.request_id,
            body=error.body,
        )

    def _next(self, delay: float, reason: str) -> float:
        # Only the action, the reason and the timing: never a header or a body.
        policy = self.settings.retry
        self.log.warning(
            "%s: %s; retry %d/%d in %.2fs", self.action, reason, self.retry + 1, policy.max_retries, delay
        )
        self.retry += 1
        return delay


class SendOnce(Retries):
    """The decisions of a non-idempotent call: only a provably unsent or refused attempt is repeated.

    Any other failure (read timeout, dropped connection, 5xx, 409) raises ``AmbiguousCreate``:
    the request may have been acted on, and only the caller can find out.
    """

    def _judge_transport(self, exc: httpx.TransportError, error: BatchApiError) -> None:
        if not isinstance(exc, NOT_SENT_ERRORS):
            raise AmbiguousCreate(error) from exc

    def _judge_status(self, response: httpx.Response, retryable: bool) -> None:
        if retryable and response.status_code not in REFUSED_STATUS:
            raise AmbiguousCreate(self.status_error(response), response)


@dataclass
class Restarts:
    """Restarts of a streamed body after its connection dropped, bounded by the retry policy.

    :param settings: the connection's settings (policy, secrets).
    :param action: what the stream is, for messages.
    :param log: where restarts are logged.
    """

    settings: BatchApiSettings
    action: str
    log: Any
    count: int = 0

    def dropped(self, exc: httpx.TransportError) -> float:
        """Seconds to wait before restarting the stream; raises once the budget is spent."""
        policy = self.settings.retry
        if self.count >= policy.max_retries:
            raise transport_error(
                exc, action=self.action, secret=self.settings.secrets, base_url=self.settings.base_url
            ) from exc
        self.log.warning(
            "%s: %s mid-stream; restarting (retry %d/%d)",
            self.action,
            type(exc).__name__,
            self.count + 1,
            policy.max_retries,
        )
        self.count += 1
        return policy.backoff(self.count - 1)
