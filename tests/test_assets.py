"""Assets: warehouse-convention URIs of a results table; the extra the build and merge give events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from airflow.sdk import Asset, AssetAlias
from airflow.sdk.execution_time.context import OutletEventAccessors

from airflow_batch_provider.assets import results_table_asset, results_table_uri, table_uri
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
from tests.operators.test_build import MESSAGES, seed
from tests.operators.test_merge import stage, submit_and_wait


def test_table_uri_follows_the_warehouse_providers_conventions() -> None:
    assert table_uri("postgres", host="db", database="analytics", schema="s", table="t") == (
        "postgres://db:5432/analytics/s/t"
    )
    # The Postgres provider's normaliser writes an empty schema as "default".
    assert (
        table_uri("postgresql", host="db", port=6543, database="a", table="t")
        == "postgres://db:6543/a/default/t"
    )
    assert table_uri("mariadb", host="db", database="shop", table="t") == "mysql://db:3306/shop/t"
    # A name the merge never splits may hold a slash or a space; the URI keeps it one segment.
    assert table_uri("postgres", host="db", database="a", schema="s", table="x/y z").endswith("/s/x%2Fy%20z")
    with pytest.raises(ConfigurationError, match="no asset URI convention for connection type 'sqlite'"):
        table_uri("sqlite", host="h", database="d", table="t")
    with pytest.raises(ConfigurationError, match="needs a host"):
        table_uri("postgres", host="", database="d", table="t")


@pytest.mark.parametrize(
    ("conn", "schema", "expected"),
    [
        ({"conn_type": "postgres", "host": "pg.internal", "schema": "warehouse", "password": "p"},
         "sales", "postgres://pg.internal:5432/warehouse/sales/triage"),
        ({"conn_type": "mysql", "host": "my.internal", "port": 3307, "schema": "shop"}, None,
         "mysql://my.internal:3307/shop/triage"),
        # MySQL has no schema level: the merge's target_schema names the database.
        ({"conn_type": "mysql", "host": "my.internal", "schema": "shop"}, "other",
         "mysql://my.internal:3306/other/triage"),
    ],
)  # fmt: skip
def test_results_table_uri_reads_the_connection(
    monkeypatch: pytest.MonkeyPatch, conn: dict[str, Any], schema: str | None, expected: str
) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_WH_ASSET", orjson.dumps(conn).decode())
    assert results_table_uri("wh_asset", "triage", schema) == expected
    asset = results_table_asset("wh_asset", "triage", schema, name="triage_results")
    # Already in Airflow's normal form (the provider's normaliser leaves it as is), and no password.
    assert asset.uri == expected and asset.name == "triage_results"
    assert "p@" not in asset.uri


@pytest.fixture
def server(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    handle = batch_server(dialect="openai", backend="echo")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", handle.connection_json())
    return handle


def test_merge_attaches_its_figures_to_every_asset_outlet(
    server: Any, sqlite_warehouse: Any, tmp_path: Path
) -> None:
    manifest = stage(tmp_path / "stage", [(1, "a"), (2, "b"), (3, "c")], lost=[3])
    xcom = submit_and_wait(manifest)
    results = Asset(name="r", uri="postgres://db:5432/a/s/results")
    other = Asset(name="other", uri="x-test://other")
    alias = AssetAlias(name="by-alias")
    events = OutletEventAccessors()
    summary = MergeBatchResultsOperator(
        task_id="merge",
        target_table="results",
        conn_id=sqlite_warehouse.conn_id,
        batches=xcom,
        input_price_per_1m=1.0,
        outlets=[results, other, alias],
    ).execute(context={"outlet_events": events})  # type: ignore[arg-type]
    extra = events[results].extra
    assert extra == events[other].extra
    # Every status is counted, zeros included, so a consumer reads any of them without a default.
    assert extra["counts"] == summary["counts"]
    assert {k: v for k, v in extra["counts"].items() if v} == {"succeeded": 2, "missing": 1}
    assert extra["batch_ids"] == xcom["batch_ids"] and extra["rows_written"] == 3
    assert extra["total_tokens"] == summary["total_tokens"] > 0
    assert extra["cost"] == summary["cost"] is not None and extra["table"] == "results"
    orjson.dumps(extra)  # the event extra must be JSON
    # An alias's event is the user's to fill (it needs an asset named at run time).
    assert events[alias].extra == {}


def test_build_attaches_shards_rows_and_staging_to_its_outlets(sqlite_warehouse: Any, tmp_path: Path) -> None:
    seed(sqlite_warehouse, [(1, "a", "b"), (2, "c", None), (3, "d", "e")])
    staged = Asset(name="staged", uri="file:///staging/tickets")
    events = OutletEventAccessors()
    xcom = SqlToBatchJsonlOperator(
        task_id="build",
        conn_id=sqlite_warehouse.conn_id,
        key_columns="id",
        sql="SELECT * FROM tickets",
        messages=MESSAGES,
        model="m",
        staging_path=str(tmp_path / "stage"),
        max_lines=1,
        outlets=[staged],
    ).execute(context={"outlet_events": events})  # type: ignore[arg-type]
    extra = events[staged].extra
    assert extra["shards"] == len(xcom["shards"]) == 2
    assert (extra["rows_read"], extra["rows_written"], extra["rows_rejected"]) == (3, 2, 1)
    assert extra["staging_path"] == xcom["staging_path"] and extra["manifest_path"] == xcom["manifest_path"]
