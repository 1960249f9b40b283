"""The merge's write plan: decided once, by a pure function of the database's capabilities and
the table's facts; the writer then does what the plan says on every database."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.exceptions import WarehouseSchemaError
from airflow_batch_provider.warehouse.databases import (
    DuckDBSqlDialect,
    MySqlSqlDialect,
    PostgresSqlDialect,
    SnowflakeSqlDialect,
    SqlDialect,
    SqliteSqlDialect,
)
from airflow_batch_provider.warehouse.plan import WriteMode, WritePlan, plan_write
from airflow_batch_provider.warehouse.rows import Column
from airflow_batch_provider.warehouse.write import ResultsWriter
from tests.warehouse.test_write import chat_line, keys_for, with_batch

OURS = ["id", "custom_id", "status", "content", "merged_at"]
KEY = frozenset({"id"})
DATABASES: dict[str, type[SqlDialect]] = {
    "postgres": PostgresSqlDialect,
    "duckdb": DuckDBSqlDialect,
    "sqlite": SqliteSqlDialect,
    "mysql": MySqlSqlDialect,
}


def plan(
    db: str, columns: list[str] | None, unique: list[frozenset[str]] | None, create: bool = True
) -> WritePlan:
    return plan_write(
        DATABASES[db].capabilities,
        table='"t"',
        columns=columns,
        unique_keys=unique,
        target_columns=OURS,
        target_keys=["id"],
        create_table=create,
    )


@pytest.mark.parametrize(
    ("db", "expected"),
    [
        # A table the merge holds alone is empty: plain INSERT. PostgreSQL can undo a failed
        # statement alone, so its key is built once after the load; DuckDB's tables go keyless.
        ("postgres", WritePlan(WriteMode.INSERT, create_table=True, key_after_load=True)),
        ("sqlite", WritePlan(WriteMode.INSERT, create_table=True, key_in_create=True)),
        ("duckdb", WritePlan(WriteMode.INSERT, create_table=True, check_repeated_keys=True)),
        # Merges into one MySQL table are not serialised: a concurrent one may have written.
        ("mysql", WritePlan(WriteMode.UPSERT, create_table=True, key_in_create=True)),
    ],
)
def test_a_new_table(db: str, expected: WritePlan) -> None:
    assert plan(db, None, None) == expected


@pytest.mark.parametrize("db", DATABASES)
def test_an_existing_table_with_the_merges_columns(db: str) -> None:
    got = plan(db, [c.upper() for c in OURS], [KEY])
    if db == "duckdb":
        # Rows are replaced by key (ON CONFLICT DO UPDATE would hold every old row in memory).
        assert got == WritePlan(WriteMode.REPLACE, check_repeated_keys=True)
        assert plan(db, OURS, []) == got  # no key needed
    else:
        assert got == WritePlan(WriteMode.UPSERT)


def test_a_table_with_columns_of_its_own() -> None:
    mine = [*OURS, "reviewer"]
    # DuckDB: a table the merge created (no key) keeps its own columns' values: update, then insert.
    assert plan("duckdb", mine, []) == WritePlan(WriteMode.UPDATE_INSERT, check_repeated_keys=True)
    assert plan("duckdb", mine, None) == WritePlan(WriteMode.UPDATE_INSERT, check_repeated_keys=True)
    assert plan("duckdb", mine, [KEY]) == WritePlan(WriteMode.UPSERT, check_repeated_keys=True)
    assert plan("postgres", mine, [KEY, frozenset({"reviewer"})]) == WritePlan(WriteMode.UPSERT)
    # Not known (a DuckDB unique index lists no columns): ON CONFLICT says it if none matches.
    assert plan("postgres", mine, None) == WritePlan(WriteMode.UPSERT)


def test_snowflake_updates_then_inserts_and_checks_keys_itself() -> None:
    """Snowflake declares keys but never enforces them: every plan updates then inserts by key
    (no unique key needed) and checks the manifest for repeated keys before writing."""
    caps = SnowflakeSqlDialect.capabilities
    common = {"table": '"t"', "target_columns": OURS, "target_keys": ["id"], "create_table": True}
    assert plan_write(caps, columns=None, unique_keys=None, **common) == WritePlan(
        WriteMode.UPDATE_INSERT, create_table=True, key_in_create=True, check_repeated_keys=True
    )
    for columns in (OURS, [*OURS, "reviewer"]):
        got = plan_write(caps, columns=columns, unique_keys=None, **common)
        assert got == WritePlan(WriteMode.UPDATE_INSERT, check_repeated_keys=True)


@pytest.mark.parametrize("db", ["postgres", "sqlite", "mysql"])
def test_an_upsert_needs_a_unique_key_on_exactly_the_keys(db: str) -> None:
    with pytest.raises(
        WarehouseSchemaError, match=r'table "t" has no primary key or unique index on exactly \(id\)'
    ):
        plan(db, OURS, [frozenset({"id", "custom_id"})])


def test_refusals_name_the_table_and_what_is_wrong() -> None:
    with pytest.raises(WarehouseSchemaError, match='table "t" does not exist and create_table is False'):
        plan("postgres", None, None, create=False)
    with pytest.raises(WarehouseSchemaError, match="lacks column\\(s\\) 'content', 'merged_at'"):
        plan("duckdb", ["id", "custom_id", "status"], None)


def test_duckdb_before_1_2_neither_replaces_nor_goes_keyless(
    duckdb_warehouse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duckdb

    monkeypatch.setattr(duckdb, "__version__", "1.1.3")
    caps = DuckDBSqlDialect(duckdb_warehouse.hook).capabilities
    assert not caps.upsert_by_replace and not caps.keyless_tables and caps.exclusive_merge
    assert DuckDBSqlDialect.capabilities.upsert_by_replace  # the class's declaration is untouched


@pytest.mark.parametrize(
    ("kind", "again"),
    [
        ("postgres", WritePlan(WriteMode.UPSERT)),
        ("duckdb", WritePlan(WriteMode.REPLACE, check_repeated_keys=True)),
        ("sqlite", WritePlan(WriteMode.UPSERT)),
        ("mysql", WritePlan(WriteMode.UPSERT)),
    ],
)
def test_the_writer_plans_from_the_real_table(
    kind: str, again: WritePlan, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first merge plans to create the table (and does), a second one plans from what it finds."""
    wh = request.getfixturevalue(f"{'pg' if kind == 'postgres' else kind}_warehouse")
    writer = ResultsWriter(wh.hook, "planned", key_columns=[Column("id", "integer")])
    plans: list[WritePlan] = []
    real = writer._plan

    def spy(conn: Any, report: Any) -> WritePlan:
        plans.append(real(conn, report))
        return plans[-1]

    monkeypatch.setattr(writer, "_plan", spy)
    for answer in ("x", "y"):
        writer.merge(with_batch([chat_line("c1", answer)]), keys=keys_for([("c1", 1)]))
    assert plans[0] == plan(kind, None, None)
    assert plans[1] == again
    assert wh.rows(f"SELECT id, content FROM {wh.quote('planned')}") == [(1, "y")]


def test_columns_of_a_later_release_are_added_others_refused() -> None:
    """A table created by an earlier version lacks the vendor columns: the plan adds them; a
    missing column the merge cannot add is still refused by name."""
    target = [*OURS, "vendor", "batch_conn_id"]
    common = {"table": '"t"', "target_columns": target, "target_keys": ["id"], "create_table": True}
    got = plan_write(
        PostgresSqlDialect.capabilities,
        columns=OURS,
        unique_keys=[KEY],
        addable_columns=["vendor", "batch_conn_id"],
        **common,
    )
    assert got == WritePlan(WriteMode.UPSERT, add_columns=("vendor", "batch_conn_id"))
    # DuckDB replaces rows by key once the added columns make the table exactly the merge's.
    got = plan_write(
        DuckDBSqlDialect.capabilities,
        columns=[*OURS, "batch_conn_id"],
        unique_keys=[],
        addable_columns=["vendor", "batch_conn_id"],
        **common,
    )
    assert got == WritePlan(WriteMode.REPLACE, check_repeated_keys=True, add_columns=("vendor",))
    with pytest.raises(WarehouseSchemaError, match="lacks column\\(s\\) 'batch_conn_id'"):
        plan_write(
            PostgresSqlDialect.capabilities,
            columns=OURS,
            unique_keys=[KEY],
            addable_columns=["vendor"],
            **common,
        )
