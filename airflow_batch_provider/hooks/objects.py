"""Results of an "object_store" batch: the objects it wrote under its output prefix, streamed.

A vendor whose jobs read their input from object storage (Bedrock on S3, Vertex AI on GCS)
writes its results there too, under an output prefix with names of its own choosing. The prefix
is listed (never a guessed name), the dialect says which objects hold result lines and which a
summary of the totals (``Dialect.result_object_kind``), and each result object is streamed one
line at a time. A read that drops mid-object is resumed at the byte it reached (object stores
serve ranges), so no line is given twice and memory stays flat. Vendor-neutral: the URIs and
the names come from the dialect.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from airflow_batch_provider.dialects import Dialect
from airflow_batch_provider.exceptions import BatchApiError, BatchApiResponseError
from airflow_batch_provider.hooks.lines import line_object
from airflow_batch_provider.hooks.transport import LineSplitter
from airflow_batch_provider.limits import MAX_RESULT_LINE_BYTES
from airflow_batch_provider.redaction import secret_bytes

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.hooks.settings import BatchApiSettings
    from airflow_batch_provider.models import Batch

#: Bytes read per call while streaming a result object.
CHUNK = 1 << 20
#: A summary object is read whole: more than this is not a summary.
MAX_SUMMARY_BYTES = 1 << 20


def plain_uri(path: ObjectStoragePath) -> str:
    """``scheme://bucket/key`` of a path, without the Airflow connection id it may carry (what a
    vendor is told: it reads the object with its own role, not the provider's connection)."""
    return f"{path.protocol}://{path.path}"


def object_path(uri: str, conn_id: str | None) -> ObjectStoragePath:
    """The ``ObjectStoragePath`` of a vendor-named URI, read through ``conn_id`` (None: the
    scheme's default connection)."""
    from airflow.sdk import ObjectStoragePath

    return ObjectStoragePath(uri, conn_id=conn_id) if conn_id else ObjectStoragePath(uri)


@dataclass(frozen=True)
class ResultObject:
    """One listed object under a batch's output prefix that the dialect reads.

    :param path: the object.
    :param relative: its key below the prefix (for messages, and the dialect's choice).
    :param kind: ``output``, ``error`` or ``summary``.
    """

    path: Any
    relative: str
    kind: str


def list_result_objects(dialect: Dialect, batch: Batch, conn_id: str | None) -> list[ResultObject]:
    """The objects under the batch's output prefix the dialect reads, in key order (none while
    the batch names no prefix)."""
    prefix_uri = dialect.results_prefix_of(batch)
    if not prefix_uri:
        return []
    prefix = object_path(prefix_uri.rstrip("/"), conn_id)
    fs = prefix.fs
    # A listing cached by an earlier read (a poll, the submit's own write) may miss the objects
    # the job wrote since.
    fs.invalidate_cache(prefix.path)
    try:
        keys = sorted(fs.find(prefix.path))
    except FileNotFoundError:
        return []
    found: list[ResultObject] = []
    for key in keys:
        relative = key[len(prefix.path) :].lstrip("/")
        kind = dialect.result_object_kind(relative)
        if kind is not None:
            found.append(ResultObject(object_path(f"{prefix.protocol}://{key}", conn_id), relative, kind))
    return found


def read_summary(obj: ResultObject) -> Any:
    """A summary object, parsed (a ``BatchApiResponseError`` if it is not JSON or too large)."""
    import orjson

    with obj.path.fs.open(obj.path.path, "rb") as handle:
        data = handle.read(MAX_SUMMARY_BYTES + 1)
    if len(data) > MAX_SUMMARY_BYTES:
        raise BatchApiResponseError(
            f"result summary {obj.relative!r} is larger than {MAX_SUMMARY_BYTES:,} bytes"
        )
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise BatchApiResponseError(f"result summary {obj.relative!r} is not JSON: {exc}") from None


@dataclass
class ObjectLines:
    """Stream one result object's lines, resuming at the byte reached after a dropped read.

    :param settings: the connection's settings (retry policy, secrets).
    :param obj: the object.
    :param log: where resumes are logged.
    :param lenient: give a ``BadLine`` for a line that is not a JSON object instead of raising.
    :param opener: opens the object for reading at a byte offset (tests pass one that drops).
    """

    settings: BatchApiSettings
    obj: ResultObject
    log: Any
    lenient: bool = False
    opener: Any = None
    resumes: int = 0
    _offset: int = field(default=0, init=False)

    def open_at(self, offset: int) -> IO[bytes]:
        if self.opener is not None:
            handle: IO[bytes] = self.opener(self.obj, offset)
            return handle
        raw = self.obj.path.fs.open(self.obj.path.path, "rb", block_size=CHUNK)
        if offset:
            raw.seek(offset)
        return io.BufferedReader(raw, buffer_size=CHUNK)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        where = f"object {self.obj.relative!r}"
        splitter = LineSplitter(MAX_RESULT_LINE_BYTES, where)
        hidden = secret_bytes(self.settings.secrets)
        limit = self.settings.max_download_bytes
        while True:
            try:
                with self.open_at(self._offset) as handle:
                    while True:
                        chunk = handle.read(CHUNK)
                        if not chunk:
                            break
                        self._offset += len(chunk)
                        if self._offset > limit:
                            raise BatchApiResponseError(
                                f"{where} is larger than {limit:,} bytes (the connection extra "
                                "'max_download_bytes')"
                            )
                        for number, data in splitter.feed(chunk):
                            item = line_object(data, number, where, hidden, self.lenient)
                            if item is not None:
                                yield number, item
                break
            except (FileNotFoundError, PermissionError):
                raise
            except (OSError, ConnectionError, TimeoutError) as exc:
                # The bytes fed so far stay in the splitter: the next read starts where this ended.
                time.sleep(self._dropped(where, exc))
        for number, data in splitter.close():
            item = line_object(data, number, where, hidden, self.lenient)
            if item is not None:
                yield number, item

    def _dropped(self, where: str, exc: BaseException) -> float:
        policy = self.settings.retry
        if self.resumes >= policy.max_retries:
            raise BatchApiError(
                f"reading {where}: the read dropped {self.resumes + 1} times ({type(exc).__name__}); gave up"
            ) from exc
        self.resumes += 1
        self.log.warning(
            "reading %s: %s at byte %d; resuming there (retry %d/%d)",
            where,
            type(exc).__name__,
            self._offset,
            self.resumes,
            policy.max_retries,
        )
        return policy.backoff(self.resumes - 1)
