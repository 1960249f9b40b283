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
import os
import re
import tempfile
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

import orjson

MANIFEST_NAME = "manifest.json"
KEYS_NAME = "keys.jsonl"
REJECTS_NAME = "rejects.jsonl"
SHARD_PATTERN = "shard-{index:05d}.jsonl"
_SHARD_NAME = re.compile(r"shard-\d{5,}\.jsonl")
_LOCAL_PROTOCOLS = frozenset({"", "file", "local"})
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]+")

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
    bits of the file replaced. Object stores publish an object only when its upload is closed,
    so there the object is written directly and the upload is discarded on error.
    """
    plain = _plain_local(path)
    store = None if plain is not None else resolve_path(path)
    if store is None or is_local(store):
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
        return
    handle = store.open("wb")
    try:
        yield handle
    except BaseException:
        # fsspec buffered files upload on close(); discard() drops the pending upload instead.
        discard = getattr(handle, "discard", None)
        if callable(discard):
            with contextlib.suppress(Exception):
                discard()
        with contextlib.suppress(Exception):
            store.unlink()
        raise
    handle.close()


def open_read(path: ObjectStoragePath | str) -> IO[bytes]:
    """Open a staged file (or a plain local OS path) for binary streaming reads."""
    plain = _plain_local(path)
    if plain is not None:
        return open(plain, "rb", buffering=1 << 20)
    path = resolve_path(path)
    if is_local(path):
        return open(local_path(path), "rb", buffering=1 << 20)
    handle: IO[bytes] = path.open("rb")
    return handle


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


class ShardedJsonlWriter:
    """Write batch lines into shard files so no shard exceeds the line count or byte limit.

    Each shard is written atomically (see :func:`atomic_writer`): it appears complete under
    its final name or not at all. Lines must already be valid; the line size is checked here
    only as a guard. Use as a context manager: leaving with an error discards the open shard.

    :param directory: the staging directory.
    :param limits: the ``Limits`` every shard must meet.
    :param endpoint: the url the lines target, recorded on each ``Shard``.
    """

    _FLUSH_BYTES = 1 << 20

    def __init__(self, directory: ObjectStoragePath, limits: Limits, *, endpoint: str | None = None) -> None:
        self.directory = directory
        self.limits = limits
        self.endpoint = endpoint
        self.shards: list[Shard] = []
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
        self._index += 1
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

    def abort(self) -> None:
        """Discard the shard being written (shards already published stay, but no manifest lists them)."""
        self._buffer.clear()
        self._handle = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(BaseException):
                stack.__exit__(RuntimeError, RuntimeError("build aborted"), None)

    def __enter__(self) -> ShardedJsonlWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
