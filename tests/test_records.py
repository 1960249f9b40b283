"""keys.jsonl / rejects.jsonl records: one model each, written as plain dicts, read leniently."""

from __future__ import annotations

from typing import Any

import orjson

from airflow_batch_provider.records import KeyRecord, RejectRecord
from airflow_batch_provider.warehouse.rows import Column
from airflow_batch_provider.warehouse.write import ResultsWriter
from tests.warehouse.test_write import chat_line, with_batch


def test_records_round_trip_through_their_json_lines() -> None:
    key = KeyRecord("c1", [1, "a"], 3)
    assert orjson.loads(orjson.dumps(key.as_dict())) == {"custom_id": "c1", "key": [1, "a"], "shard": 3}
    assert KeyRecord.fields_of(orjson.loads(orjson.dumps(key.as_dict()))) == ("c1", [1, "a"], 3)
    reject = RejectRecord(7, [7], None, "too_long", "prompt over limit", "text")
    line = orjson.loads(orjson.dumps(reject.as_dict()))
    assert line == {
        "row": 7,
        "key": [7],
        "custom_id": None,
        "code": "too_long",
        "reason": "prompt over limit",
        "column": "text",
    }
    assert RejectRecord.from_dict(line) == reject
    # The builders for a loop writing millions of lines spell the same objects.
    assert KeyRecord.line("c1", [1, "a"], 3) == key.as_dict()
    # The request's hash, and the custom_id whose answer a deduplicated row shares.
    shared = KeyRecord("c2", [2, "b"], 0, "ab" * 16, "c1")
    line_obj = orjson.loads(orjson.dumps(shared.as_dict()))
    assert line_obj == {
        "custom_id": "c2",
        "key": [2, "b"],
        "shard": 0,
        "request_hash": "ab" * 16,
        "shared_answer": "c1",
    }
    assert KeyRecord.request_fields_of(line_obj) == ("ab" * 16, "c1")
    assert KeyRecord.request_fields_of({"request_hash": 5, "shared_answer": ""}) == (None, None)
    assert RejectRecord.line(7, [7], None, "too_long", "prompt over limit", "text") == reject.as_dict()


def test_malformed_lines_are_read_as_found() -> None:
    """What a line lacks, or holds in the wrong type, reads as None for the reader to report."""
    assert KeyRecord.fields_of({"custom_id": 5, "key": "k", "shard": "0"}) == (None, None, None)
    assert KeyRecord.fields_of({}) == (None, None, None)
    bare = RejectRecord.from_dict({"key": [None, 2]})
    assert bare == RejectRecord(None, [None, 2], None, None, "")
    assert not bare.keyed and not RejectRecord.from_dict({}).keyed
    assert RejectRecord.from_dict({"key": [1], "reason": "r"}).keyed
    assert RejectRecord(1, [1], None, "c", "too long", "text").message == "too long (column text)"
    assert RejectRecord(1, [1], None, "c", "too long").message == "too long"


def test_the_merge_takes_the_models_as_it_takes_their_dicts(sqlite_warehouse: Any) -> None:
    wh = sqlite_warehouse
    lines = [chat_line("c1", "hi")]
    keys = [KeyRecord("c1", [1], 0), KeyRecord("c2", [2], 0)]
    rejects = [
        RejectRecord(3, [3], None, "too_long", "over", "text"),
        RejectRecord(4, [None], None, "null_key", "key is null", "id"),
    ]
    as_models = ResultsWriter(wh.hook, "models", key_columns=[Column("id", "integer")]).merge(
        with_batch(lines), keys=keys, rejects=rejects
    )
    as_dicts = ResultsWriter(wh.hook, "dicts", key_columns=[Column("id", "integer")]).merge(
        with_batch(lines), keys=[k.as_dict() for k in keys], rejects=[r.as_dict() for r in rejects]
    )
    assert as_models.counts == as_dicts.counts
    assert as_models.counts["succeeded"] == as_models.counts["missing"] == as_models.counts["rejected"] == 1
    assert as_models.unkeyed_rejects == 1 and as_models.unkeyed_reject_samples == [rejects[1].as_dict()]
    for table in ("models", "dicts"):
        assert wh.rows(f"SELECT id, status, error_message FROM {table} ORDER BY id") == [
            (1, "succeeded", None),
            (2, "missing", None),
            (3, "rejected", "over (column text)"),
        ]


def test_a_reason_that_names_its_column_does_not_repeat_it() -> None:
    record = RejectRecord(4, [4], None, "null_value", "column 'stars' is NULL", "stars")
    assert record.message == "column 'stars' is NULL"
