"""The object-store seam on a real S3 server (moto): results found by listing a batch's output
prefix, streamed with a resume at the byte a dropped read reached, and a summary checked; a
local staging refused before anything is written.

The dialect here is a minimal "object_store" one declared by the test (the seam is
vendor-neutral); the Bedrock pipeline tests drive the same code with a real vendor shape.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from airflow_batch_provider.dialects.base import Dialect, ResultObjectKind
from airflow_batch_provider.exceptions import BatchApiError, BatchApiResponseError, ConfigurationError
from airflow_batch_provider.hooks.objects import ObjectLines, list_result_objects, plain_uri
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.models import Batch, BatchState, ResultLine
from tests.fixtures.hook import FAST
from tests.fixtures.s3 import S3Staging

LOG = logging.getLogger(__name__)


class StoreDialect(Dialect):
    """A vendor that writes ``<job>/<name>.out`` files and a ``totals.json`` under its prefix."""

    name = "store-test"
    submission_mode = "object_store"
    results_modes = ("object_store",)
    object_store_schemes = ("s3",)

    def results_prefix_of(self, batch: Batch) -> str | None:
        prefix = batch.raw.get("prefix")
        return prefix if isinstance(prefix, str) else None

    def result_object_kind(self, relative: str) -> ResultObjectKind | None:
        if relative.endswith("totals.json"):
            return "summary"
        return "output" if relative.endswith(".out") else None

    def check_summary(self, batch: Batch, summary: Any, read: Mapping[str, int]) -> str | None:
        if summary.get("lines") != read["output"]:
            return f"it counts {summary.get('lines')} lines, {read['output']} were read"
        return None

    def parse_result_line(self, raw: Mapping[str, Any], source: Any) -> ResultLine:
        return ResultLine(custom_id=raw["id"], ok=True, body={"n": raw["n"]}, source=source)


def settings(dialect: Dialect, conn_id: str) -> BatchApiSettings:
    dialect.storage_conn_id = conn_id
    return BatchApiSettings(
        conn_id="store", base_url="http://vendor.test/v1", dialect=dialect, api_key=None, retry=FAST
    )


def lines(start: int, count: int) -> bytes:
    return b"".join(orjson.dumps({"id": f"r{i}", "n": i}) + b"\n" for i in range(start, start + count))


def batch_at(prefix: str) -> Batch:
    return Batch(id="job1", state=BatchState.COMPLETED, raw={"prefix": prefix})


def test_results_are_found_by_listing_and_checked_against_the_summary(s3_staging: S3Staging) -> None:
    from airflow_batch_provider.hooks.batch import BatchApiHook

    out = s3_staging.path("run", "vendor", "k1", "output")
    (out / "job1" / "shard-00000.jsonl.out").write_bytes(lines(0, 3))
    (out / "job1" / "shard-00001.jsonl.out").write_bytes(lines(3, 2))
    (out / "job1" / "notes.txt").write_bytes(b"not results\n")
    (out / "job1" / "totals.json").write_bytes(b'{"lines": 5}')
    dialect = StoreDialect()
    found = list_result_objects(dialect, batch_at(plain_uri(out) + "/"), s3_staging.conn_id)
    assert [(o.relative, o.kind) for o in found] == [
        ("job1/shard-00000.jsonl.out", "output"),
        ("job1/shard-00001.jsonl.out", "output"),
        ("job1/totals.json", "summary"),
    ]
    hook = BatchApiHook("store", dialect=dialect)
    hook._settings = settings(dialect, s3_staging.conn_id)
    read = list(hook.iter_results(batch_at(plain_uri(out))))
    assert [(r.custom_id, r.body) for r in read] == [(f"r{i}", {"n": i}) for i in range(5)]

    (out / "job1" / "totals.json").write_bytes(b'{"lines": 6}')
    with pytest.raises(BatchApiResponseError, match="counts 6 lines, 5 were read"):
        list(hook.iter_results(batch_at(plain_uri(out))))


async def test_the_async_reader_gives_the_same_lines(s3_staging: S3Staging) -> None:
    from airflow_batch_provider.hooks.batch import BatchApiHook

    out = s3_staging.path("run", "output")
    (out / "a.out").write_bytes(lines(0, 600))
    dialect = StoreDialect()
    hook = BatchApiHook("store", dialect=dialect)
    hook._settings = settings(dialect, s3_staging.conn_id)
    got = [r.custom_id async for r in hook.aiter_results(batch_at(plain_uri(out)))]
    assert got == [f"r{i}" for i in range(600)]


def test_a_batch_without_a_prefix_or_objects_has_no_results(s3_staging: S3Staging) -> None:
    dialect = StoreDialect()
    assert list_result_objects(dialect, Batch(id="j", state=BatchState.COMPLETED), None) == []
    missing = plain_uri(s3_staging.path("nothing", "here"))
    assert list_result_objects(dialect, batch_at(missing), s3_staging.conn_id) == []


class Dropping(io.RawIOBase):
    """The object from ``offset``, dropping the connection after ``cut`` bytes (once)."""

    def __init__(self, data: bytes, offset: int, cut: int | None) -> None:
        self.data, self.pos, self.cut = data, offset, cut

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.cut is not None and self.cut <= 0:
            raise ConnectionResetError("peer reset")
        end = len(self.data) if self.cut is None else min(len(self.data), self.pos + self.cut)
        piece = self.data[self.pos : min(end, self.pos + 7)]
        buffer[: len(piece)] = piece
        self.pos += len(piece)
        if self.cut is not None:
            self.cut -= len(piece)
        return len(piece)


def test_a_dropped_read_resumes_at_the_byte_it_reached(
    s3_staging: S3Staging, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow_batch_provider.hooks import objects

    # Reads of 16 bytes: a drop loses only the read it broke, the next starts past the last whole one.
    monkeypatch.setattr(objects, "CHUNK", 16)
    data = lines(0, 20)
    opened: list[int] = []

    def opener(obj: Any, offset: int) -> Any:
        opened.append(offset)
        # Each of the first two reads drops mid-line; the third reads to the end.
        return io.BufferedReader(Dropping(data, offset, 45 if len(opened) < 3 else None), buffer_size=7)

    dialect = StoreDialect()
    reader = ObjectLines(settings(dialect, s3_staging.conn_id), _object(), LOG, opener=opener)
    got = [item["id"] for _, item in reader]
    assert got == [f"r{i}" for i in range(20)]
    assert opened == [0, 32, 64]
    assert reader.resumes == 2


def test_a_read_that_keeps_dropping_gives_up(s3_staging: S3Staging) -> None:
    data = lines(0, 20)
    reader = ObjectLines(
        settings(StoreDialect(), s3_staging.conn_id),
        _object(),
        LOG,
        opener=lambda obj, offset: io.BufferedReader(Dropping(data, offset, 10), buffer_size=7),
    )
    with pytest.raises(BatchApiError, match="dropped 4 times"):
        list(reader)


def _object() -> Any:
    from airflow_batch_provider.hooks.objects import ResultObject

    return ResultObject(path=None, relative="x/a.out", kind="output")


@pytest.mark.parametrize("staging", ["file:///tmp/stage", "/tmp/stage", "gs://b/stage"])
def test_a_staging_off_the_vendors_store_is_refused_naming_what_to_set(staging: str) -> None:
    with pytest.raises(
        ConfigurationError, match=r"s3://.*staging_root.*AIRFLOW__BATCH_PROVIDER__STAGING_ROOT"
    ):
        StoreDialect().check_staging(staging)
    StoreDialect().check_staging("s3://conn@bucket/stage")
    Dialect().check_staging(staging)  # a Files API vendor reads no staging
