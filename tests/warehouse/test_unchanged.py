"""skip_unchanged's reads of the results table (warehouse/unchanged.py) on every source database
the build reads: the hash of each row's succeeded answer, by a join or by key lookups."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.warehouse import unchanged
from airflow_batch_provider.warehouse.read import stream_rows
from airflow_batch_provider.warehouse.unchanged import (
    PREVIOUS_COLUMN,
    HashLookup,
    UnchangedRows,
    joined_query,
    target_has_hashes,
)


@pytest.fixture(params=["postgres", "duckdb", "sqlite", "mysql"])
def warehouse(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{'pg' if request.param == 'postgres' else request.param}_warehouse")


def _seed(wh: Any) -> None:
    q, p = wh.quote, wh.placeholder
    wh.run(f"CREATE TABLE {q('src')} ({q('region')} VARCHAR(20), {q('n')} INTEGER, {q('text')} VARCHAR(20))")
    wh.run_many(
        f"INSERT INTO {q('src')} VALUES ({p}, {p}, {p})",
        [("eu", 1, "a"), ("eu", 2, "b"), ("us", 1, "c"), ("us", 2, "d"), ("eu", 3, "e")],
    )
    wh.run(
        f"CREATE TABLE {q('answers')} ({q('region')} VARCHAR(20), {q('n')} INTEGER, "
        f"{q('status')} VARCHAR(20), {q('request_hash')} VARCHAR(32))"
    )
    wh.run_many(
        f"INSERT INTO {q('answers')} VALUES ({p}, {p}, {p}, {p})",
        [("eu", 1, "succeeded", "h1"), ("eu", 2, "failed", "h2"), ("us", 2, "succeeded", "h4")],
    )


EXPECTED = {("eu", 1): "h1", ("eu", 2): None, ("us", 1): None, ("us", 2): "h4", ("eu", 3): None}


def test_the_join_and_the_lookup_give_each_row_its_succeeded_hash(
    warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _seed(warehouse)
    hook, q = warehouse.hook, warehouse.quote
    assert target_has_hashes(hook, "answers", None) is not None
    assert target_has_hashes(hook, "src", None) is None  # no request_hash column
    assert target_has_hashes(hook, "nothing_here", None) is None
    keys = ["region", "n"]
    query = f"SELECT * FROM {q('src')};"
    with stream_rows(hook, joined_query(hook, query, "answers", None, keys), batch_size=2) as rows:
        assert rows.column_names[-1] == PREVIOUS_COLUMN
        source = UnchangedRows(rows)
        assert source.column_names == ["region", "n", "text"]
        joined = {(r[0], r[1]): r[3] for batch in source.batches() for r in batch}
    assert joined == EXPECTED
    # Lookups by a two-column key, two keys per statement.
    monkeypatch.setattr(unchanged, "LOOKUP_KEYS", 2)
    lookup = HashLookup(hook, "answers", None, keys, [0, 1])
    with stream_rows(hook, query, batch_size=3) as rows:
        source = UnchangedRows(rows, lookup)
        looked = {(r[0], r[1]): r[3] for batch in source.batches() for r in batch}
    lookup.close()
    assert looked == EXPECTED
    assert lookup.statements == 3  # batches of 3 and 2 source rows: 2 + 1 statements
