"""BigQuery: staging tables filled by load jobs (NDJSON), the results written by one ``MERGE``.

Connections of type ``bigquery`` (:class:`~airflow_batch_provider.hooks.bigquery.BigQuerySqlHook`,
the ``bigquery`` extra). Every statement is a query job and there is no transaction across jobs,
so the merge's writes are ``MERGE`` statements, each atomic on its own: staging tables (real
tables in the connection's default dataset, expiring after a day should a merge die before
dropping them) are filled by load jobs, then one ``MERGE`` writes every key of the manifest
(and one more the build's rejects). Embeddings land as a JSON array, or as ``ARRAY<FLOAT64>``
in a table that declares that column so. BigQuery enforces no primary key, so tables are keyless
(``keyless_tables``): keys.jsonl is checked for repeated keys before writing, and an existing
table is merged into by its key columns whatever constraints it declares.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect
from airflow_batch_provider.warehouse.loaders import bigquery_load
from airflow_batch_provider.warehouse.rows import Column

#: Unicode categories BigQuery allows in a table name: letters, marks, numbers, connector and
#: dash punctuation, spaces.
_TABLE_CATEGORIES = ("L", "M", "N", "Pc", "Pd", "Zs")
#: What a (flexible) column name may hold besides those.
_COLUMN_EXTRA = set("&%=+:'<>#|")
_DATASET = re.compile(r"[A-Za-z0-9_]{1,1024}")
_RESERVED_COLUMN_PREFIXES = (
    "_table_",
    "_file_",
    "_partition",
    "_row_timestamp",
    "__root__",
    "_colidentifier",
)


class BigQuerySqlDialect(SqlDialect):
    """BigQuery: NDJSON load jobs into staging tables, then ``MERGE`` (no transaction, no keys)."""

    name = "bigquery"
    conn_types = ("bigquery",)
    merges = True
    # keyless_tables: BigQuery enforces no key (its PRIMARY KEY is NOT ENFORCED, a hint), so
    # repeated keys are looked for before writing and rows are matched by key by the MERGE.
    capabilities = Capabilities(keyless_tables=True)
    max_identifier_bytes: ClassVar[int | None] = 300
    temp_table = (
        "CREATE TABLE {} ({}) "
        "OPTIONS(expiration_timestamp = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL 1 DAY))"
    )
    # The load jobs' types, but JSON is JSON in the results table (it travels as text in staging).
    types = {**bigquery_load.LOAD_TYPES, "json": "JSON"}
    merged_at_type = "TIMESTAMP"

    # ---- identifiers -----------------------------------------------------------------------
    def quote(self, name: str) -> str:
        if not name or "`" in name or "\\" in name or "\x00" in name:
            raise ConfigurationError(f"invalid BigQuery identifier {name!r}")
        return f"`{name}`"

    def check_identifiers(self, names: Sequence[tuple[str, str]], *, distinct: bool = True) -> None:
        """Refuse, before any work, names BigQuery would refuse once results were staged."""
        for what, name in names:
            if what == "target_schema":
                ok = bool(_DATASET.fullmatch(name.rpartition(".")[2]))
                rule = "letters, digits and underscores"
            elif what == "target_table":
                ok = len(name.encode("utf-8")) <= 1024 and all(_table_char(c) for c in name)
                rule = "letters, marks, digits, underscores, dashes and spaces (at most 1024 bytes)"
            else:
                ok = (
                    len(name) <= 300
                    and all(_table_char(c) or c in _COLUMN_EXTRA for c in name)
                    and not name.lower().startswith(_RESERVED_COLUMN_PREFIXES)
                )
                rule = "letters, marks, digits, _ - space & % = + : ' < > # | and no reserved prefix"
            if not ok:
                raise ConfigurationError(f"{what} {name!r} is not a valid BigQuery name ({rule}); rename it")
        # Column names are matched without regard to case, as on DuckDB.
        super().check_identifiers(names, distinct=distinct)

    def cast(self, expression: str, portable: str) -> str:
        if portable == "json":
            # CAST(... AS JSON) does not exist: text becomes JSON by parsing it.
            return f"PARSE_JSON({expression})"
        return super().cast(expression, portable)

    # ---- statements --------------------------------------------------------------------------
    def __init__(self, hook: Any) -> None:
        super().__init__(hook)
        #: Per quoted table, its ``ARRAY<FLOAT64>`` columns (seen by ``probe_columns``).
        self._vector_columns: dict[str, set[str]] = {}
        #: The staging tables of the merge under way (the connection drops them on rollback).
        self._staging: list[str] = []

    def begin(self, conn: Any) -> None:
        # No transaction: what a rollback undoes is the staging tables this merge creates.
        self._staging = conn.staging_tables

    def create_temp_table(self, name: str, columns: Sequence[tuple[str, str]]) -> str:
        self._staging.append(name)
        return super().create_temp_table(name, columns)

    def upsert(self, table: str, columns: Sequence[str], keys: Sequence[str], select: str) -> str:
        """One ``MERGE`` of ``select``'s rows into ``table`` by ``keys`` (update, else insert).

        A JSON array (an embedding) meant for an ``ARRAY<FLOAT64>`` column of an existing table
        becomes that array (a NULL becomes an empty array: BigQuery stores no NULL array).
        """
        q = self.quote
        vectors = self._vector_columns.get(table, set())

        def value(column: str) -> str:
            source = f"abp_s.{q(column)}"
            if column not in vectors:
                return source
            return (
                f"ARRAY(SELECT FLOAT64(abp_x) FROM UNNEST(JSON_QUERY_ARRAY({source})) AS abp_x "
                "WITH OFFSET abp_o ORDER BY abp_o)"
            )

        source = _named(select, [q(c) for c in columns])
        match = " AND ".join(f"abp_t.{q(k)} = abp_s.{q(k)}" for k in keys)
        sets = ", ".join(f"{q(c)} = {value(c)}" for c in columns if c not in keys)
        cols = ", ".join(q(c) for c in columns)
        values = ", ".join(value(c) for c in columns)
        return (
            f"MERGE INTO {table} abp_t USING ({source}) abp_s ON {match} "
            + (f"WHEN MATCHED THEN UPDATE SET {sets} " if sets else "")
            + f"WHEN NOT MATCHED THEN INSERT ({cols}) VALUES ({values})"
        )

    def update_then_insert(
        self, table: str, columns: Sequence[str], keys: Sequence[str], select: str
    ) -> tuple[str | None, str]:
        """No unique key is needed by a ``MERGE``: the update and the insert are one statement."""
        return None, self.upsert(table, columns, keys, select)

    def probe_columns(self, conn: Any, table: str, schema: str | None) -> list[str] | None:
        # A table lookup, not a failing query job.
        from google.api_core.exceptions import NotFound

        try:
            found = conn.client.get_table(self._ref(conn, table, schema))
        except NotFound:
            return None
        self._vector_columns[self.table(table, schema)] = {
            f.name for f in found.schema if f.mode == "REPEATED" and f.field_type in ("FLOAT", "FLOAT64")
        }
        return [field.name for field in found.schema]

    def add_column(self, conn: Any, table: str, schema: str | None, name: str, portable: str) -> None:
        super().add_column(conn, table, schema, name, portable)
        # BigQuery's ALTER TABLE also updates the table's schema, which probe_columns reads; a
        # BigQuery-compatible server whose metadata lags its DDL (the emulator) would then see
        # the column missing on the next merge and add it twice, so the schema is made to list it.
        from google.cloud import bigquery

        found = conn.client.get_table(self._ref(conn, table, schema))
        if name not in {f.name for f in found.schema}:
            found.schema = [
                *found.schema,
                bigquery.SchemaField(name, self.sql_type(portable), mode="NULLABLE"),
            ]
            conn.client.update_table(found, ["schema"])

    def _ref(self, conn: Any, table: str, schema: str | None = None) -> str:
        dataset = schema or conn.dataset
        if not dataset:
            raise ConfigurationError(
                "the BigQuery connection has no default dataset (its schema field) and the merge was "
                "given no schema: staging tables need a dataset"
            )
        return f"{dataset}.{table}" if "." in dataset else f"{conn.client.project}.{dataset}.{table}"

    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        return bigquery_load.load_rows(conn.client, self._ref(conn, table), columns, rows)


def _table_char(char: str) -> bool:
    return unicodedata.category(char).startswith(_TABLE_CATEGORIES) or char == "_"


def _named(select: str, names: Sequence[str]) -> str:
    """``select`` with its columns named ``names`` (BigQuery has no ``AS alias(columns)``).

    The first branch of a ``UNION ALL`` names the columns; it has no row, and its ``NULL``s take
    the other branch's types.
    """
    nulls = ", ".join(f"NULL AS {n}" for n in names)
    return f"SELECT * FROM (SELECT {nulls} FROM (SELECT 1) WHERE FALSE UNION ALL {select})"
