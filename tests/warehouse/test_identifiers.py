"""Identifiers with %, quotes, spaces and mixed case, on every warehouse; names the database cannot keep."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.warehouse.rows import Column, ResultMapper
from airflow_batch_provider.warehouse.write import ResultsWriter
from tests.warehouse.test_write import chat_line, keys_for, with_batch

PCT_TABLE = 'res%s "ults" 100%'
PCT_KEY = "Key %s id"
PCT_EXTRA = "cost %(x)s"


@pytest.fixture(params=["postgres", "duckdb", "sqlite", "mysql", "bigquery"])
def warehouse(request: pytest.FixtureRequest) -> Any:
    kind = request.param
    return request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_warehouse")


def test_merge_with_percent_in_table_key_and_extra_column_names(warehouse: Any) -> None:
    if warehouse.kind == "bigquery":
        pytest.skip("BigQuery refuses quotes in names, before any work (tests/warehouse/test_bigquery.py)")
    mapper = ResultMapper(extra_columns={PCT_EXTRA: "$.usage.total_tokens"})
    writer = ResultsWriter(warehouse.hook, PCT_TABLE, key_columns=[Column(PCT_KEY, "integer")], mapper=mapper)
    keys = keys_for([("c1", 1), ("c2", 2)])
    for _ in range(2):  # the first merge creates the table, the second upserts into it
        report = writer.merge(with_batch([chat_line("c1", "hello"), chat_line("c2", "bye")]), keys=keys)
        assert report.counts["succeeded"] == 2
    q = warehouse.quote
    assert warehouse.rows(f"SELECT {q(PCT_KEY)}, content, {q(PCT_EXTRA)} FROM {q(PCT_TABLE)} ORDER BY 1") == [
        (1, "hello", "15"),
        (2, "bye", "15"),
    ]


@pytest.mark.parametrize(
    ("keys", "extra", "message"),
    [
        (["Id", "id"], {}, "key column 'Id' and key column 'id' differ only by case"),
        (["id"], {"Status": "$.x"}, "results column 'status' and extra column 'Status' differ only by case"),
    ],
)
def test_names_differing_only_by_case_are_refused_before_any_work(
    warehouse: Any, keys: list[str], extra: dict[str, str], message: str
) -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        ResultsWriter(
            warehouse.hook,
            "results",
            key_columns=[Column(k, "integer") for k in keys],
            mapper=ResultMapper(extra_columns=extra),
        )


def test_postgres_names_over_63_bytes_are_refused_before_any_work(pg_warehouse: Any) -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    long_name = "é" * 32  # 64 bytes in UTF-8, 32 characters
    with pytest.raises(
        ConfigurationError, match=r"target_table 'é+' is 64 bytes long; postgres cuts .* at 63"
    ):
        ResultsWriter(pg_warehouse.hook, long_name, key_columns=[Column("id", "integer")])
    with pytest.raises(ConfigurationError, match="key column 'x+' is 64 bytes long"):
        ResultsWriter(pg_warehouse.hook, "results", key_columns=[Column("x" * 64, "integer")])
    # 63 bytes is kept whole and works.
    writer = ResultsWriter(pg_warehouse.hook, "t" * 63, key_columns=[Column("k" * 63, "integer")])
    writer.merge(with_batch([chat_line("c1", "hi")]), keys=keys_for([("c1", 1)]))
    assert pg_warehouse.rows(f"SELECT {'k' * 63}, content FROM {'t' * 63}") == [(1, "hi")]


def test_percent_in_names_through_psycopg2(pg_warehouse: Any) -> None:
    """psycopg2 reads % the same way (older PostgresHook installs)."""
    psycopg2 = pytest.importorskip("psycopg2")
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    class Psycopg2Hook(PostgresHook):
        def get_conn(self) -> Any:
            return psycopg2.connect(
                host="127.0.0.1",
                user="postgres",
                dbname="test",
                options=f"-c search_path={pg_warehouse.schema}",
            )

    hook = Psycopg2Hook(postgres_conn_id=pg_warehouse.conn_id)
    writer = ResultsWriter(hook, PCT_TABLE, key_columns=[Column(PCT_KEY, "integer")])
    for _ in range(2):
        report = writer.merge(with_batch([chat_line("c1", "hello")]), keys=keys_for([("c1", 1)]))
        assert report.counts["succeeded"] == 1
    q = pg_warehouse.quote
    assert pg_warehouse.rows(f"SELECT {q(PCT_KEY)}, content FROM {q(PCT_TABLE)}") == [(1, "hello")]
