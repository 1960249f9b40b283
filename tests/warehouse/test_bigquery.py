"""BigQuery specifics on bqemulator: reads come in pages, names BigQuery cannot keep are refused
before any work while awkward valid ones land. (The merge's behaviour on every status, re-runs,
NULLs, structured output and embeddings is tested for every database in ``test_write.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.exceptions import ConfigurationError, WarehouseSchemaError
from airflow_batch_provider.warehouse.read import stream_rows
from airflow_batch_provider.warehouse.rows import Column, ResultMapper
from airflow_batch_provider.warehouse.write import ResultsWriter
from tests.warehouse.test_write import chat_line, embedding_line, keys_for, with_batch


def test_a_read_fetches_the_result_page_by_page(bigquery_warehouse: Any) -> None:
    wh = bigquery_warehouse
    wh.run(f"CREATE TABLE {wh.quote('t')} AS SELECT x AS id FROM UNNEST(GENERATE_ARRAY(1, 50)) AS x")
    with stream_rows(wh.hook, f"SELECT id FROM {wh.quote('t')} ORDER BY id", batch_size=7) as stream:
        assert stream.driver == "bigquery" and [(c.name, c.type) for c in stream.columns] == [
            ("id", "integer")
        ]
        calls: list[str] = []
        connection = stream._conn.client._connection
        api_request = connection.api_request

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs.get("path", ""))
            return api_request(*args, **kwargs)

        connection.api_request = counting
        batches = stream.batches()
        first = next(batches)
        pages_for_first = len(calls)
        rest = [row for batch in batches for row in batch]
    # One page of 7 rows, then the others one request at a time, never the whole result at once.
    assert [r[0] for r in first] == list(range(1, 8))
    assert [r[0] for r in rest] == list(range(8, 51))
    assert pages_for_first <= 1
    assert len(calls) >= 50 // 7


@pytest.mark.parametrize(
    ("table", "keys", "extra", "message"),
    [
        ('my "results"', ["id"], {}, "target_table 'my \"results\"' is not a valid BigQuery name"),
        ("results", ["we`ird"], {}, "key column 'we`ird' is not a valid BigQuery name"),
        (
            "results",
            ["id"],
            {"cost (usd)": "$.x"},
            r"extra column 'cost \(usd\)' is not a valid BigQuery name",
        ),
        ("results", ["_PARTITIONTIME"], {}, "key column '_PARTITIONTIME' is not a valid BigQuery name"),
        ("results", ["k" * 301], {}, "is not a valid BigQuery name"),
    ],
)
def test_names_bigquery_cannot_keep_are_refused_before_any_work(
    bigquery_warehouse: Any, table: str, keys: list[str], extra: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        writer = ResultsWriter(
            bigquery_warehouse.hook,
            table,
            key_columns=[Column(k, "integer") for k in keys],
            mapper=ResultMapper(extra_columns=extra),
        )
        writer.merge(with_batch([chat_line("c1", "x")]), keys=keys_for([("c1", 1)]))
    client = bigquery_warehouse.hook.get_client()
    assert list(client.list_tables(bigquery_warehouse.schema)) == []


def test_awkward_valid_names_land(bigquery_warehouse: Any) -> None:
    wh = bigquery_warehouse
    # Real BigQuery also takes spaces and letters beyond ASCII in table names; bqemulator does not.
    table, key, extra = "my-results-2024", "select", "cost % of =total+"
    mapper = ResultMapper(extra_columns={extra: "$.usage.total_tokens"})
    writer = ResultsWriter(wh.hook, table, key_columns=[Column(key, "integer")], mapper=mapper)
    for _ in range(2):  # the first merge creates the table, the second merges into it
        report = writer.merge(
            with_batch([chat_line("c1", "hi"), chat_line("c2", "yo")]), keys=keys_for([("c1", 1), ("c2", 2)])
        )
        assert report.counts["succeeded"] == 2
    q = wh.quote
    assert wh.rows(f"SELECT {q(key)}, content, {q(extra)} FROM {q(table)} ORDER BY 1") == [
        (1, "hi", "15"),
        (2, "yo", "15"),
    ]


def test_embeddings_land_as_float_arrays_in_an_array_column(bigquery_warehouse: Any) -> None:
    wh = bigquery_warehouse
    q = wh.quote
    keys = keys_for([("e1", 1), ("e2", 2)])
    ResultsWriter(wh.hook, "emb", key_columns=[Column("id", "integer")]).merge(
        with_batch([embedding_line("e1", [0.5])]), keys=keys
    )
    # A results table of the user's own, with the embedding as ARRAY<FLOAT64>.
    wh.run(
        f"CREATE TABLE {q('vec')} AS "
        f"SELECT * REPLACE (ARRAY<FLOAT64>[] AS embedding) FROM {q('emb')} WHERE FALSE"
    )
    writer = ResultsWriter(wh.hook, "vec", key_columns=[Column("id", "integer")])
    for vector in ([0.25, -1.5, 3.0], [1.0, 2.0]):  # inserted, then updated
        report = writer.merge(with_batch([embedding_line("e1", vector)]), keys=keys)
        assert (report.counts["succeeded"], report.counts["missing"]) == (1, 1)
        assert wh.rows(f"SELECT id, status, embedding FROM {q('vec')} ORDER BY id") == [
            (1, "succeeded", vector),
            (2, "missing", []),  # BigQuery stores no NULL array
        ]
    # bqemulator (DuckDB) would cast the JSON array by itself; BigQuery does not, so the MERGE does.
    merge = writer.dialect.upsert(writer.qtable, ["id", "embedding"], ["id"], "SELECT 1, NULL")
    assert "UNNEST(JSON_QUERY_ARRAY(abp_s.`embedding`))" in merge


def test_a_failed_merge_leaves_the_table_as_it_was_and_no_staging_tables(bigquery_warehouse: Any) -> None:
    wh = bigquery_warehouse
    writer = ResultsWriter(wh.hook, "results", key_columns=[Column("id", "integer")])
    keys = keys_for([(f"c{i}", i) for i in range(5)])
    writer.merge(with_batch([chat_line(f"c{i}", "v1") for i in range(5)]), keys=keys)

    def exploding() -> Any:
        yield chat_line("c1", "v2"), "b2"
        raise RuntimeError("connection to the API dropped mid-stream")

    with pytest.raises(RuntimeError, match="dropped"):
        writer.merge(exploding(), keys=keys)
    assert wh.rows(f"SELECT content, COUNT(*) FROM {wh.quote('results')} GROUP BY content") == [("v1", 5)]
    client = wh.hook.get_client()
    assert [t.table_id for t in client.list_tables(wh.schema)] == ["results"]


def test_two_custom_ids_with_one_key_are_named_before_writing(bigquery_warehouse: Any) -> None:
    """Nothing in BigQuery refuses two rows with one key, so the merge looks before it writes."""
    wh = bigquery_warehouse
    writer = ResultsWriter(wh.hook, "twice", key_columns=[Column("id", "integer")])
    with pytest.raises(WarehouseSchemaError, match="keys.jsonl lines 2 and 3 have the same key"):
        writer.merge(
            with_batch([chat_line("c1", "a"), chat_line("c2", "b")]),
            keys=keys_for([("c0", 0), ("c1", 1), ("c2", 1)]),
        )
    assert wh.rows(f"SELECT COUNT(*) FROM {wh.quote('twice')}") == [(0,)]
