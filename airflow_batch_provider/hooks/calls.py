"""What the hook sends: one :class:`Call` per API operation, built the same for both clients.

Each builder is pure (a dialect and ids in, a :class:`Call` out), so a sync method and its
async twin differ only in how they send it. Which failures a call retries is decided apart,
in ``attempts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from airflow_batch_provider.dialects import Dialect
from airflow_batch_provider.exceptions import ConfigurationError, JsonlValidationError
from airflow_batch_provider.hooks.transport import MAX_CONTROL_BODY, FileBody, MultipartUpload, PathSource
from airflow_batch_provider.limits import MAX_RESULT_LINE_BYTES

LIST_ACTION = "listing batches"


@dataclass(frozen=True)
class Call:
    """What one call sends, and how its answer is read.

    :param method: the HTTP method.
    :param path: the path below the API root.
    :param action: what the call does, for messages (``getting batch 'b1'``).
    :param what: the object a 404 is about (``batch 'b1'``).
    :param params: query parameters.
    :param json: a JSON body.
    :param upload: a body streamed from a file (a multipart upload, or an inline create's JSON).
    :param stream: return a 2xx response open, its body unread.
    :param foreign_redirects: let a redirect reach another origin (without credentials).
    :param max_body: the most bytes of a body read whole.
    :param accept: statuses returned (read and closed) instead of raised or retried.
    :param headers: headers of this call alone (a resumable upload's commands).
    """

    method: str
    path: str
    action: str
    what: str | None = None
    params: Mapping[str, Any] | None = None
    json: Any = None
    upload: FileBody | None = None
    stream: bool = False
    foreign_redirects: bool = False
    max_body: int = MAX_CONTROL_BODY
    accept: frozenset[int] = frozenset()
    headers: Mapping[str, str] | None = None

    def build(self, client: httpx.Client | httpx.AsyncClient, content: Any) -> httpx.Request:
        """The request; ``content`` is the upload's sync or async byte stream, or None."""
        return client.build_request(
            self.method,
            self.path,
            params=dict(self.params) if self.params else None,
            json=self.json,
            content=content,
            headers={**(self.upload.headers if self.upload else {}), **(self.headers or {})} or None,
        )


def upload_body(source: PathSource, filename: str | None, dialect: Dialect) -> MultipartUpload:
    """The multipart body uploading ``source``, refused before sending past the dialect's cap."""
    try:
        upload = MultipartUpload.from_source(source, filename=filename, fields=dialect.upload_form())
    except FileNotFoundError:
        raise ConfigurationError(f"cannot upload {source}: no such file") from None
    limit = dialect.limits.max_shard_bytes
    if upload.size > limit:
        # Refused here, before sending: the vendor would read the whole body and then answer 413.
        raise JsonlValidationError(
            f"cannot upload {upload.filename}: it is {upload.size:,} bytes and dialect "
            f"{dialect.name!r} uploads at most {limit:,} bytes per file; build it again "
            f"(shards are cut at that size) or split it"
        )
    return upload


def upload(dialect: Dialect, body: MultipartUpload) -> Call:
    return Call("POST", dialect.files_path, f"uploading {body.filename}", upload=body)


def get_file(dialect: Dialect, file_id: str) -> Call:
    return Call("GET", dialect.file_path(file_id), f"getting file {file_id}", f"file {file_id!r}")


def delete_file(dialect: Dialect, file_id: str) -> Call:
    return Call("DELETE", dialect.file_path(file_id), f"deleting file {file_id}", f"file {file_id!r}")


def file_content(dialect: Dialect, file_id: str, action: str) -> Call:
    """A file's content, streamed (its redirect may lead to object storage)."""
    path = dialect.file_content_path(file_id)
    return Call(
        "GET",
        path,
        action,
        f"file {file_id!r}",
        params=dialect.file_content_params or None,
        stream=True,
        foreign_redirects=True,
    )


def create_batch(
    dialect: Dialect,
    body: Mapping[str, Any],
    input_file_id: str,
    model: str | None = None,
    endpoint: str | None = None,
) -> Call:
    path = dialect.create_path(model, endpoint)
    return Call("POST", path, f"creating a batch from file {input_file_id}", json=body)


def create_inline(dialect: Dialect, body: FileBody) -> Call:
    """An "inline" create: the body (the encoded requests) is streamed from a local file."""
    return Call("POST", dialect.batches_path, f"creating a batch from {body.filename}", upload=body)


def results_stream(url: str, batch_id: str, action: str) -> Call:
    """A batch's one results stream at ``url`` (the hook checks its origin first). A redirect
    to object storage is followed without credentials, as for a file's content."""
    return Call("GET", url, action, f"results of batch {batch_id!r}", stream=True, foreign_redirects=True)


def get_batch(dialect: Dialect, batch_id: str) -> Call:
    return Call("GET", dialect.batch_path(batch_id), f"getting batch {batch_id}", f"batch {batch_id!r}")


def cancel_batch(dialect: Dialect, batch_id: str) -> Call:
    """A cancel; an answer saying the batch is already final is returned, not raised."""
    return Call(
        "POST",
        dialect.cancel_path(batch_id),
        f"cancelling batch {batch_id}",
        f"batch {batch_id!r}",
        accept=dialect.cancel_final_statuses,
    )


# A listing page asks for ~100 batches (~1 KB each, up to ~10 KB with full metadata): 4 MB is
# ample for that and bounds what a server that ignores ``limit`` makes the triggerer read and
# parse per page (a larger page is refused as too large; the poller then reads by id).
MAX_LIST_BODY = 4 << 20


def list_batches(dialect: Dialect, params: Mapping[str, Any]) -> Call:
    return Call("GET", dialect.batches_path, LIST_ACTION, params=params, max_body=MAX_LIST_BODY)


def results_page(dialect: Dialect, batch_id: str, params: Mapping[str, Any], action: str) -> Call:
    return Call(
        "GET",
        dialect.results_path(batch_id),
        action,
        f"batch {batch_id!r}",
        params=params,
        max_body=MAX_RESULT_LINE_BYTES,
    )
