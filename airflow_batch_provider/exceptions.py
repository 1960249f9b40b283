"""One exception class per failure mode, all rooted in :class:`BatchProviderError`.

The root is a plain ``Exception``, not ``AirflowException``: Airflow 3 fails a task on any
exception, and importing ``airflow.exceptions`` would load Airflow (and run its settings) in the
CLI, the local server and the data modules, which must start without it.

Exception text never contains secrets: API-facing errors carry the status code,
the vendor request id and a truncated body, never request headers.
"""

from __future__ import annotations

from typing import Any

_BODY_PREVIEW = 2000


class BatchProviderError(Exception):
    """Base class of every error raised by this provider."""


class ConfigurationError(BatchProviderError):
    """A connection, dialect or operator argument is missing or invalid."""


class UnknownDialectError(ConfigurationError):
    """The connection names a dialect that is not registered."""


class InvalidIdError(ConfigurationError, ValueError):
    """A batch or file id is not one a vendor issues (a ``/``, ``..``, ``#``, control character,
    empty, too long...): refused before it is placed in any URL."""


class BatchApiError(BatchProviderError):
    """An HTTP call to the batch API failed.

    :param message: what was being done and what went wrong.
    :param status_code: HTTP status, or None for transport errors.
    :param request_id: the vendor's request id header, when it sent one.
    :param body: the parsed or raw response body (truncated in the text).
    :param retry_after: seconds the server asked the client to wait (``Retry-After``), if any.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        request_id: str | None = None,
        body: Any = None,
        retry_after: float | None = None,
    ) -> None:
        self.retry_after = retry_after
        self.status_code = status_code
        self.request_id = request_id
        self.body = body
        parts = [message]
        if status_code is not None:
            parts.append(f"status={status_code}")
        if request_id:
            parts.append(f"request_id={request_id}")
        if body not in (None, "", b""):
            text = body if isinstance(body, str) else repr(body)
            parts.append(f"body={text[:_BODY_PREVIEW]}")
        super().__init__(" | ".join(parts))


class BatchApiAuthError(BatchApiError):
    """401/403: the API key was rejected or lacks permission."""


class BatchApiNotFoundError(BatchApiError):
    """404: the named file or batch does not exist at the vendor."""


class BatchApiRateLimitError(BatchApiError):
    """429 after every retry was spent."""


class BatchApiQuotaError(BatchApiRateLimitError):
    """429 (or 402) meaning the account is out of quota or credit (``insufficient_quota``).

    Never retried: unlike a rate limit, waiting does not end it.
    """


class BatchApiServerError(BatchApiError):
    """5xx after every retry was spent."""


class BatchApiBadRequestError(BatchApiError):
    """400/422: the vendor refused the request (for example a batch file that fails validation)."""


class BatchApiConnectionError(BatchApiError):
    """The connection failed or timed out after every retry was spent."""


class BatchApiResponseError(BatchApiError):
    """The vendor answered 2xx with a body this provider cannot parse."""


class UnknownBatchStatusError(BatchApiResponseError):
    """The vendor reported a batch status this provider does not know.

    Never treated as success: an unknown state could be a failure mode added by the vendor.
    It is a read error like any unreadable answer: a poll loop judges it within its error
    budget (a vendor's new status is often a brief intermediate state the next poll no longer
    shows), and a status that stays unknown ends the watch as ``error`` once the budget is spent.
    In a shared listing it concerns its own batch only.
    """


class BatchApiRedirectError(BatchApiError):
    """A redirect was not followed: to another origin (credentials stay home), too many of them, or
    (a file's content) to plain http or a private, link-local or instance-metadata address."""


class BatchApiResponseTooLargeError(BatchApiResponseError):
    """An answer was larger than its cap after decompression: a control-plane answer (batch, file,
    list), or a downloaded or streamed file over the connection's ``max_download_bytes``."""


class JsonlValidationError(BatchProviderError):
    """A batch JSONL file breaks the dialect's rules; the message names the line."""


class DuplicateKeyError(BatchProviderError):
    """Two source rows share the same key columns."""


class RejectRatioExceededError(BatchProviderError):
    """More rows were rejected than ``max_reject_ratio`` allows."""


class BudgetExceededError(BatchProviderError):
    """Submit refused a run whose estimate is over ``max_estimated_cost`` or ``max_input_tokens``
    (or cannot be priced under a cost cap); nothing was uploaded."""


class EmptyBatchError(BatchProviderError):
    """No valid rows, and ``allow_empty`` is False."""


class StaleSubmissionStateError(BatchProviderError):
    """A shard changed since an earlier try submitted it and the policy is to fail."""


class AmbiguousOrphanError(BatchProviderError):
    """After a crash between create and recording the id, several batches could be the lost
    one and the vendor's batches carry no tag that tells them apart: nothing is guessed."""


class BatchFailedError(BatchProviderError):
    """A batch ended failed, expired, cancelled, timed out, or polling gave up."""


class BatchQuotaExceededError(BatchFailedError):
    """A batch failed because the vendor's quota refused it (an enqueued token limit, say).

    The batch-level twin of :class:`BatchApiQuotaError`: resubmitting at once fails the same
    way; wait for running batches to finish or raise the quota.
    """


class EnqueuedTokenTimeoutError(BatchQuotaExceededError):
    """A queue-aware submit found no room under ``max_enqueued_tokens`` before its ``queue_timeout``."""


class PartialFailureError(BatchFailedError):
    """A batch completed but some lines failed and ``on_partial_failure='fail'``."""


class WarehouseSchemaError(BatchProviderError):
    """An existing results table lacks a column the merge needs or has an incompatible type."""
