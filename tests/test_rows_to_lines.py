"""The build's row loop on its own: a frozen BuildSpec and a real row stream, no operator."""

from __future__ import annotations

import dataclasses
import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import DuplicateKeyError
from airflow_batch_provider.keys import custom_id_for, jsonable_key, stored_key
from airflow_batch_provider.rendering import BodySource
from airflow_batch_provider.request_hash import request_hash
from airflow_batch_provider.rows_to_lines import BuildSpec, build_lines
from airflow_batch_provider.warehouse.read import stream_rows


def _spec(directory: Any, **body: Any) -> BuildSpec:
    limits = get_dialect("openai").limits.tightened(max_lines=2)
    rules = dataclasses.replace(get_dialect("openai").validation_rules(limits), unique_custom_ids=False)
    return BuildSpec(
        directory=directory,
        endpoint="/v1/chat/completions",
        limits=limits,
        rules=rules,
        key_columns=("id",),
        body=BodySource(**body),
        prefix="p-",
    )


def _hook(conn_id: str) -> Any:
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id).get_hook()


def test_build_lines_from_a_spec_writes_lines_keys_and_rejects(sqlite_warehouse: Any, tmp_path: Path) -> None:
    sqlite_warehouse.run("CREATE TABLE t (id INTEGER, text TEXT)")
    sqlite_warehouse.run_many("INSERT INTO t VALUES (?, ?)", [(1, "a"), (2, None), (3, "c"), (None, "d")])
    directory = staging.resolve_path(str(tmp_path))
    spec = _spec(directory, messages=[{"role": "user", "content": "{{ text }}"}], model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.on_null = "empty"  # type: ignore[misc]
    with stream_rows(_hook(sqlite_warehouse.conn_id), "SELECT id, text FROM t ORDER BY id") as rows:
        result = build_lines(spec, rows)
    assert (result.rows_read, result.rows_written, result.rows_rejected) == (4, 2, 2)
    assert dict(result.reject_codes) == {"null_key": 1, "null_value": 1}
    assert [s.lines for s in result.shards] == [2]
    keys = [orjson.loads(x) for x in (tmp_path / staging.KEYS_NAME).read_bytes().splitlines()]
    lines = [orjson.loads(x) for x in (tmp_path / "shard-00000.jsonl").read_bytes().splitlines()]
    # Every key record carries the hash of its canonical request (url + body).
    assert keys == [
        {
            "custom_id": "p-1",
            "key": [1],
            "shard": 0,
            "request_hash": request_hash(spec.endpoint, lines[0]["body"]),
        },
        {
            "custom_id": "p-3",
            "key": [3],
            "shard": 0,
            "request_hash": request_hash(spec.endpoint, lines[1]["body"]),
        },
    ]
    assert lines[1]["body"] == {"model": "m", "messages": [{"role": "user", "content": "c"}]}


def test_build_lines_reports_duplicate_keys(sqlite_warehouse: Any, tmp_path: Path) -> None:
    sqlite_warehouse.run("CREATE TABLE t (id INTEGER, text TEXT)")
    sqlite_warehouse.run_many("INSERT INTO t VALUES (?, ?)", [(1, "a"), (1, "b"), (2, None), (2, "c")])
    spec = _spec(staging.resolve_path(str(tmp_path)), input_column="text")
    with (
        stream_rows(_hook(sqlite_warehouse.conn_id), "SELECT id, text FROM t") as rows,
        pytest.raises(DuplicateKeyError, match=r"2 key\(s\) of \(id\)"),
    ):
        build_lines(spec, rows)


@pytest.mark.parametrize(
    "values",
    [
        [5],
        [-(1 << 63)],
        [(1 << 64) - 1],
        [1 << 64],
        ["text"],
        [True],
        [Decimal("1.50")],
        [dt.date(2024, 1, 2)],
        [b"\xff"],
        ["a", "b"],
        ["a", 1],
        [None],
    ],
)
def test_stored_key_is_jsonable_key(values: list[Any]) -> None:
    assert stored_key(list(values)) == jsonable_key(values)


def test_custom_id_of_an_integer_key_is_one_function() -> None:
    assert custom_id_for([7], "p-") == "p-7"
    long_prefix = "x" * 30
    huge = 10**40
    assert custom_id_for([huge], long_prefix).startswith(long_prefix + "k-")
    assert len(custom_id_for([huge], long_prefix)) <= 64


def test_build_rejects_a_row_the_vendor_cannot_express_naming_feature_and_vendor(
    sqlite_warehouse: Any, tmp_path: Path
) -> None:
    # The dialect's ``unsupported`` runs on every row (a fixed-shape body still varies in values):
    # the row is rejected with the dialect's reason, the others are built.
    sqlite_warehouse.run("CREATE TABLE t (id INTEGER, text TEXT, lp INTEGER)")
    sqlite_warehouse.run_many("INSERT INTO t VALUES (?, ?, ?)", [(1, "a", 0), (2, "b", 3), (3, "c", 0)])

    def unsupported(line: Any) -> str | None:
        top = line["body"].get("top_logprobs")
        return "top_logprobs is not supported by Vendor X" if top else None

    spec = dataclasses.replace(
        _spec(
            staging.resolve_path(str(tmp_path)),
            body_callable=lambda row: {"model": "m", "messages": [], "top_logprobs": row["lp"]},
        ),
        unsupported=unsupported,
    )
    with stream_rows(_hook(sqlite_warehouse.conn_id), "SELECT id, text, lp FROM t ORDER BY id") as rows:
        result = build_lines(spec, rows)
    assert (result.rows_read, result.rows_written, result.rows_rejected) == (3, 2, 1)
    assert dict(result.reject_codes) == {"unsupported": 1}
    (reject,) = [orjson.loads(x) for x in (tmp_path / staging.REJECTS_NAME).read_bytes().splitlines()]
    assert reject["custom_id"] == "p-2" and reject["reason"] == "top_logprobs is not supported by Vendor X"
