"""The staging area between tasks: path resolution, atomic writes, and the manifest.

Layout of a staging directory (written by the build operator, read by submit and merge)::

    manifest.json          models.Manifest; shard paths are relative to this directory
    shard-00000.jsonl ...  valid batch input files, one batch each
    keys.jsonl             {"custom_id", "key": [...], "shard"} for every written row
    rejects.jsonl          {"row", "key", "custom_id", "code", "reason", "column"} for every rejected row

The manifest is written last, so a directory without one (or with an older one) never
advertises shards that are half written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, Self

import orjson

from airflow_batch_provider.exceptions import ConfigurationError

MANIFEST_NAME = "manifest.json"
KEYS_NAME = "keys.jsonl"
REJECTS_NAME = "rejects.jsonl"
SHARD_PATTERN = "shard-{index:05d}.jsonl"
_SHARD_NAME = re.compile(r"shard-\d{5,}\.jsonl")
_LOCAL_PROTOCOLS = frozenset({"", "file", "local"})
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]+")
#: Part size of object-store uploads and read-ahead of object-store reads: what one open remote
#: file holds in memory. S3 needs parts of at least 5 MiB, GCS multiples of 256 KiB.
REMOTE_BLOCK_SIZE = 8 << 20
CONFIG_SECTION = "batch_provider"
# Executors that run every task on the scheduler's machine (Sequential and Debug: Airflow 2 names).
_LOCAL_EXECUTORS = frozenset({"LocalExecutor", "SequentialExecutor", "DebugExecutor"})
# Stores whose fsspec files publish an object only when close() completes its upload.
_PUBLISHED_ON_CLOSE = frozenset({"s3", "s3a", "s3n", "gs", "gcs"})

# Imported lazily at run time: the CLI must start without loading Airflow, and
# ``airflow-batch validate`` / ``prepare`` without loading the pydantic models.
if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.limits import Limits
    from airflow_batch_provider.models import Manifest, Shard


def resolve_path(path: Any) -> ObjectStoragePath:
    """An ``ObjectStoragePath`` for a URI, a local path or an existing ``ObjectStoragePath``.

    A plain local path (no scheme) becomes an absolute ``file://`` URI.
    """
    from airflow.sdk import ObjectStoragePath

    if isinstance(path, ObjectStoragePath):
        if path.protocol in _LOCAL_PROTOCOLS and path.protocol != "file":
            return ObjectStoragePath("file://" + os.path.abspath(path.path))
        return path
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if "://" not in text:
        text = "file://" + os.path.abspath(os.path.expanduser(text))
    return ObjectStoragePath(text)


def is_local(path: ObjectStoragePath) -> bool:
    """Whether ``path`` is on the local filesystem (where temp + rename gives atomicity)."""
    return path.protocol in _LOCAL_PROTOCOLS


def local_path(path: ObjectStoragePath) -> str:
    """The OS path of a local ``ObjectStoragePath``."""
    return str(path.path)


def safe_segment(text: str) -> str:
    """``text`` reduced to characters safe in a path segment on every object store (run ids hold ``:+``)."""
    cleaned = _UNSAFE.sub("_", text).strip("._")
    return cleaned or "_"


def mkdirs(path: ObjectStoragePath) -> None:
    """Create a directory (object stores have no directories; there this does nothing harmful)."""
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
    else:
        with contextlib.suppress(Exception):
            path.mkdir(parents=True, exist_ok=True)


def staging_root() -> str:
    """The deployment's staging root, under which every task's default staging directory lies.

    ``[batch_provider] staging_root`` (environment variable ``AIRFLOW__BATCH_PROVIDER__STAGING_ROOT``;
    the older ``AIRFLOW_BATCH_STAGING_ROOT`` is still read), else ``$AIRFLOW_HOME/batch-staging``.
    """
    from airflow.sdk import conf

    root = conf.get(CONFIG_SECTION, "staging_root", fallback=None) or os.environ.get(
        "AIRFLOW_BATCH_STAGING_ROOT"
    )
    if root:
        return str(root)
    home = os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    return "file://" + os.path.join(os.path.abspath(home), "batch-staging")


def remote_executors(setting: str) -> list[str]:
    """The executors of a ``[core] executor`` value that may run a task on another machine.

    The value is a comma-separated list (``alias:module.path.Executor`` entries allowed), optionally
    per team (``LocalExecutor;team1=CeleryExecutor``). Only the local executors run every task
    on the scheduler's machine; Celery, Kubernetes, Edge or any other may not.
    """
    found: list[str] = []
    for team in setting.split(";"):
        for entry in team.rpartition("=")[2].split(","):
            name = entry.strip()
            if name and name.rpartition(":")[2].rpartition(".")[2] not in _LOCAL_EXECUTORS:
                found.append(name)
    return found


def check_shared(path: ObjectStoragePath) -> None:
    """Fail at once when ``path`` is on local disk but other tasks may run on other machines.

    A later task on another worker would otherwise fail with a ``FileNotFoundError``. A local
    path that every worker mounts (NFS, EFS...) is allowed with ``[batch_provider]
    local_staging_is_shared = True``.
    """
    if not is_local(path):
        return
    from airflow.sdk import conf

    if conf.getboolean(CONFIG_SECTION, "local_staging_is_shared", fallback=False):
        return
    remote = remote_executors(conf.get("core", "executor", fallback="") or "")
    if remote:
        raise ConfigurationError(
            f"staging {path} is on this machine's disk, but the executor ({', '.join(remote)}) may run "
            "the next task on another machine, which cannot read it. Set [batch_provider] staging_root "
            "(environment variable AIRFLOW__BATCH_PROVIDER__STAGING_ROOT) to object storage every "
            "worker reaches, e.g. s3://<aws_conn_id>@<bucket>/batch-staging or "
            "gs://<gcp_conn_id>@<bucket>/batch-staging, or give the task such a staging_path; if "
            "this path is a filesystem every worker mounts, set [batch_provider] "
            "local_staging_is_shared = True (AIRFLOW__BATCH_PROVIDER__LOCAL_STAGING_IS_SHARED)."
        )


def _plain_local(path: Any) -> str | None:
    """The absolute OS path when ``path`` is a plain ``str``/``PathLike`` without a scheme, else None.

    Such paths are served without building an ``ObjectStoragePath``, so the CLI never loads Airflow.
    """
    if isinstance(path, str) or (isinstance(path, os.PathLike) and not hasattr(path, "protocol")):
        text = os.fspath(path)
        if isinstance(text, str) and "://" not in text:
            return os.path.abspath(os.path.expanduser(text))
    return None


@contextlib.contextmanager
def atomic_writer(path: ObjectStoragePath | str, buffering: int = 1 << 20) -> Iterator[IO[bytes]]:
    """Open ``path`` for binary writing so readers see the old content or the complete new one.

    Local files (an ``ObjectStoragePath`` or a plain OS path) are written to a temporary file in
    the same directory, flushed to disk and renamed over the target, keeping the permission
    bits of the file replaced. On an object store see :func:`_remote_writer`: the object is
    published only when the block exits without an error.
    """
    plain = _plain_local(path)
    store = None if plain is not None else resolve_path(path)
    if store is not None and not is_local(store):
        with _remote_writer(store) as remote:
            yield remote
        return
    target = plain if store is None else local_path(store)
    assert target is not None
    directory = os.path.dirname(target) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, os.stat(target).st_mode & 0o7777)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _drop(handle: Any) -> None:
    """Abort ``handle``'s upload and mark it closed, so neither ``close()`` nor ``__del__`` publishes it."""
    with contextlib.suppress(Exception):
        handle.discard()  # s3fs: aborts the multipart upload; gcsfs: cancels the resumable one
    with contextlib.suppress(Exception):
        handle.buffer = None  # what close() would still upload
        handle.closed = True


@contextlib.contextmanager
def _remote_writer(store: ObjectStoragePath) -> Iterator[IO[bytes]]:
    """Stream an object store upload that is published only when the block exits cleanly.

    fsspec's files upload on ``close()``, which ``with file:`` calls even when the block raised,
    so a half-written object would appear. On S3 and GCS an upload (in parts, or resumable) is
    invisible until ``close()`` completes it in one request: the object is written in place and
    its upload aborted on error. Any other store gets a temporary sibling key, moved over the
    target once complete and removed on error. Parts are ``REMOTE_BLOCK_SIZE`` bytes, so memory
    stays flat whatever the size.
    """
    fs = store.fs
    if store.protocol in _PUBLISHED_ON_CLOSE:
        handle: Any = fs.open(store.path, "wb", block_size=REMOTE_BLOCK_SIZE)
        try:
            yield handle
            handle.close()  # completes the upload: the object appears whole, at once
        except BaseException:
            _drop(handle)
            raise
        return
    temp = f"{store.parent.path}/.{store.name}.{uuid.uuid4().hex}.tmp"
    handle = fs.open(temp, "wb", block_size=REMOTE_BLOCK_SIZE)
    try:
        with handle:
            yield handle
        fs.mv(temp, store.path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(temp)
        raise


def open_read(path: ObjectStoragePath | str) -> IO[bytes]:
    """Open a staged file (or a plain local OS path) for binary streaming reads.

    Object stores are read ``REMOTE_BLOCK_SIZE`` bytes at a time (fsspec's default read-ahead of
    tens of MB would otherwise be held per open file) through a standard ``io.BufferedReader``.
    """
    plain = _plain_local(path)
    if plain is not None:
        return open(plain, "rb", buffering=1 << 20)
    path = resolve_path(path)
    if is_local(path):
        return open(local_path(path), "rb", buffering=1 << 20)
    remote = path.fs.open(path.path, "rb", block_size=REMOTE_BLOCK_SIZE)
    # fsspec's files lack parts of the io API (readline(size), used to cap a line's length).
    return io.BufferedReader(remote, buffer_size=1 << 20)


def write_bytes_atomic(path: ObjectStoragePath, data: bytes) -> None:
    """Write a small file atomically."""
    with atomic_writer(path) as handle:
        handle.write(data)


def manifest_path(staging: Any) -> ObjectStoragePath:
    """The manifest of a staging directory; a path already ending in ``.json`` is taken as is."""
    path = resolve_path(staging)
    return path if str(path).endswith(".json") else path / MANIFEST_NAME


def write_manifest(staging: Any, manifest: Manifest) -> ObjectStoragePath:
    """Write ``manifest.json`` into ``staging`` atomically and return its path."""
    target = manifest_path(staging)
    write_bytes_atomic(target, orjson.dumps(manifest.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
    return target


def read_manifest(staging: Any) -> Manifest:
    """Read the manifest of a staging directory (or a manifest file path)."""
    from airflow_batch_provider.models import Manifest

    target = manifest_path(staging)
    with open_read(target) as handle:
        return Manifest.model_validate_json(handle.read())


def staging_dir_of(manifest_file: Any) -> ObjectStoragePath:
    """The directory holding a manifest (shard, keys and rejects paths are relative to it)."""
    return manifest_path(manifest_file).parent


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index=index)


def remove_stale_shards(staging: ObjectStoragePath, keep: set[str]) -> list[str]:
    """Delete shard files an earlier try left behind that the current manifest does not list."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for child in staging.iterdir():
            if _SHARD_NAME.fullmatch(child.name) and child.name not in keep:
                with contextlib.suppress(Exception):
                    child.unlink()
                    removed.append(child.name)
    return removed


class _PublishOnExit:
    """``with`` publishes what was written (``close``) or, after an error, discards it (``abort``)."""

    def close(self) -> list[Shard]:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardedJsonlWriter(_PublishOnExit):
    """Write batch lines into shard files so no shard exceeds the line count or byte limit.

    Each shard is written atomically (see :func:`atomic_writer`): it appears complete under
    its final name or not at all. Lines must already be valid; the line size is checked here
    only as a guard. Use as a context manager: leaving with an error discards the open shard.

    :param directory: the staging directory.
    :param limits: the ``Limits`` every shard must meet.
    :param endpoint: the url the lines target, recorded on each ``Shard``.
    """

    _FLUSH_BYTES = 1 << 20

    def __init__(
        self,
        directory: ObjectStoragePath,
        limits: Limits,
        *,
        endpoint: str | None = None,
        allocate: Callable[[], int] | None = None,
        shards: list[Shard] | None = None,
    ) -> None:
        self.directory = directory
        self.limits = limits
        self.endpoint = endpoint
        # Several writers may share one index sequence and shard list (one per model, see
        # ModelShardWriter); alone, a writer numbers its own shards from 0.
        self._allocate = allocate or itertools.count().__next__
        self.shards: list[Shard] = [] if shards is None else shards
        self._stack: contextlib.ExitStack | None = None
        self._handle: IO[bytes] | None = None
        self._index = -1
        self._lines = 0
        self._bytes = 0
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._hasher = hashlib.sha256()
        self._max_lines = limits.max_lines
        self._max_bytes = limits.max_shard_bytes
        self._max_line_size = min(limits.max_line_bytes + 1, limits.max_shard_bytes)

    @property
    def index(self) -> int:
        """Index of the shard the last line went to (-1 before the first line)."""
        return self._index

    def add(self, line: bytes) -> int:
        """Append one serialised line (without its newline); return the index of its shard."""
        size = len(line) + 1
        if size > self._max_line_size:
            raise ValueError(f"a line of {len(line):,} bytes does not fit the limits {self.limits}")
        if self._handle is None or self._lines >= self._max_lines or self._bytes + size > self._max_bytes:
            self._next_shard()
        self._buffer.append(line)
        self._buffered += size
        self._lines += 1
        self._bytes += size
        if self._buffered >= self._FLUSH_BYTES:
            self._flush()
        return self._index

    def _flush(self) -> None:
        if self._buffer and self._handle is not None:
            chunk = b"\n".join(self._buffer) + b"\n"
            self._hasher.update(chunk)
            self._handle.write(chunk)
        self._buffer.clear()
        self._buffered = 0

    def _next_shard(self) -> None:
        self._finish_shard()
        self._index = self._allocate()
        self._stack = contextlib.ExitStack()
        self._handle = self._stack.enter_context(atomic_writer(self.directory / shard_name(self._index)))
        self._hasher = hashlib.sha256()
        self._lines = 0
        self._bytes = 0

    def _finish_shard(self) -> None:
        if self._handle is None or self._stack is None:
            return
        self._flush()
        self._handle = None
        stack, self._stack = self._stack, None
        stack.close()  # publishes the shard (rename, or upload on close)
        from airflow_batch_provider.models import Shard

        self.shards.append(
            Shard(
                index=self._index,
                path=shard_name(self._index),
                lines=self._lines,
                bytes=self._bytes,
                fingerprint=self._hasher.hexdigest(),
                endpoint=self.endpoint,
            )
        )

    def close(self) -> list[Shard]:
        """Publish the last shard and return every ``Shard`` written."""
        self._finish_shard()
        return self.shards

    def finish(self) -> None:
        """Publish the shard being written, if any (the writer stays usable)."""
        self._finish_shard()

    def abort(self) -> None:
        """Discard the shard being written (shards already published stay, but no manifest lists them)."""
        self._buffer.clear()
        self._handle = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(BaseException):
                stack.__exit__(RuntimeError, RuntimeError("build aborted"), None)


class TooManyModelsError(ValueError):
    """A build's lines name more models than :class:`ModelShardWriter` keeps shards open for."""


class ModelShardWriter(_PublishOnExit):
    """Shards that each hold one model's lines: for vendors whose batch runs one model (the
    model goes on the job, or every line must name the same deployment). Lines are routed by
    ``body.model`` into one :class:`ShardedJsonlWriter` per model; all share one shard numbering,
    so the staging layout and the manifest are the same as a single writer's.

    :param directory: the staging directory.
    :param limits: the ``Limits`` every shard must meet.
    :param endpoint: the url the lines target, recorded on each ``Shard``.
    :param max_models: how many models may have a shard open at once (each holds a buffer).
    """

    def __init__(
        self,
        directory: ObjectStoragePath,
        limits: Limits,
        *,
        endpoint: str | None = None,
        max_models: int = 64,
    ) -> None:
        self.directory = directory
        self.limits = limits
        self.endpoint = endpoint
        self.max_models = max_models
        self.shards: list[Shard] = []
        self._allocate = itertools.count().__next__
        self._lanes: dict[str | None, ShardedJsonlWriter] = {}

    def add(self, line: bytes, model: str | None) -> int:
        """Append one serialised line of ``model``; return the index of its shard.

        :raises TooManyModelsError: the line names a model past ``max_models``.
        """
        lane = self._lanes.get(model)
        if lane is None:
            if len(self._lanes) >= self.max_models:
                raise TooManyModelsError(
                    f"the lines name more than {self.max_models} models; this vendor runs one model "
                    "per batch, so each model gets its own shards: split the build by model"
                )
            lane = self._lanes[model] = ShardedJsonlWriter(
                self.directory,
                self.limits,
                endpoint=self.endpoint,
                allocate=self._allocate,
                shards=self.shards,
            )
        return lane.add(line)

    def close(self) -> list[Shard]:
        """Publish every open shard; return all shards in index order."""
        for lane in self._lanes.values():
            lane.finish()
        self.shards.sort(key=lambda shard: shard.index)
        return self.shards

    def abort(self) -> None:
        """Discard every shard being written."""
        for lane in self._lanes.values():
            lane.abort()
