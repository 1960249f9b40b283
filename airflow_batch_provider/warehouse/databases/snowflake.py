"""Snowflake: rows staged through a temporary internal stage (PUT + COPY INTO), then upserted by key.

Snowflake commits an open transaction at every DDL statement, so the merge's DDL (the results
table, temp tables, the stage) and the staging loads run first, each on its own; the
transaction starts right before the first write to the results table (:meth:`begin_writes`)
and holds every write to it until the merge commits, so a failure leaves the table as it was.

The upsert is ``UPDATE ... FROM`` then ``INSERT ... WHERE NOT EXISTS`` inside that transaction
(``Capabilities.upsert_by_update``) rather than one ``MERGE``: the emulator the suite tests
against (fakesnow) cannot run a ``MERGE`` inside an explicit transaction, and a single-statement
path that no test runs is not shipped. A primary key is declared but never enforced by
Snowflake, so a manifest's keys are checked for repeats before writing
(``Capabilities.enforces_unique_keys``) and repeated custom_ids are ranked before the upsert.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.warehouse.databases.base import Capabilities, SqlDialect
from airflow_batch_provider.warehouse.loaders import snowflake_stage
from airflow_batch_provider.warehouse.rows import Column

# Snowflake connector type codes (``snowflake.connector.constants.FIELD_TYPES``) -> portable types.
_SNOWFLAKE_TYPE_CODES: dict[int, str] = {
    0: "integer",  # FIXED (NUMBER); a scale other than 0 is a float, see column_type
    1: "float",  # REAL
    2: "text",  # TEXT
    3: "date",
    4: "timestamp",
    5: "json",  # VARIANT
    6: "timestamp",  # TIMESTAMP_LTZ
    7: "timestamp",  # TIMESTAMP_TZ
    8: "timestamp",  # TIMESTAMP_NTZ
    9: "json",  # OBJECT
    10: "json",  # ARRAY
    13: "boolean",
}


class SnowflakeSqlDialect(SqlDialect):
    """Snowflake: a temporary stage + ``COPY INTO`` for staging, an update-then-insert upsert."""

    name = "snowflake"
    conn_types = ("snowflake",)
    merges = True
    # No savepoints, no RETURNING; nothing serialises merges into one table, and keys are not
    # enforced (see the module docstring).
    capabilities = Capabilities(enforces_unique_keys=False, upsert_by_update=True)
    max_identifier_bytes = 255
    temp_table = "CREATE TEMPORARY TABLE {} ({})"
    types = {
        **SqlDialect.types,
        "float": "DOUBLE",
        "text": "VARCHAR",
        "timestamp": "TIMESTAMP_NTZ",
        # Structured output, embeddings (an ARRAY inside) and JSON keys: queryable with ':' and '[]'.
        "json": "VARIANT",
    }
    merged_at_type = "TIMESTAMP_TZ"
    #: Uncompressed bytes per chunk file PUT on the stage.
    chunk_bytes = snowflake_stage.CHUNK_BYTES

    def merged_at_value(self, when: datetime) -> Any:
        # Bound as text by the connector's client-side binding; an explicit offset keeps it UTC.
        return when.astimezone(timezone.utc).isoformat(sep=" ")

    def cast(self, expression: str, portable: str) -> str:
        if portable == "json":
            # CAST(text AS VARIANT) would keep a JSON string; PARSE_JSON makes it the value.
            return f"PARSE_JSON({expression})"
        if portable == "timestamp":
            return f"CAST({expression} AS TIMESTAMP_TZ)"
        return super().cast(expression, portable)

    def set_setting(self, name: str, value: Any) -> str:
        # ALTER SESSION is not run here: the emulator the suite tests against has none, and the
        # provider's connection already carries session parameters.
        raise ConfigurationError(
            f"session_settings are not applied on Snowflake ({name!r}); put session parameters in "
            "the connection's 'session_parameters' extra instead"
        )

    def drop_temp_table(self, name: str) -> str | None:
        # A DROP would commit the merge's transaction early; temp tables end with the session.
        return None

    def begin_writes(self, conn: Any) -> None:
        cur = conn.cursor()
        try:
            cur.execute("BEGIN")
        finally:
            cur.close()

    # ---- bulk load ---------------------------------------------------------------------------
    def _load_rows(
        self, conn: Any, table: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]
    ) -> int:
        run = uuid.uuid4().hex[:10]
        stage = f"abp_stage_{run}"
        raw = self.quote(f"{table}_raw")
        extract = ", ".join(self._element(i, c.type) for i, c in enumerate(columns))
        names = ", ".join(self.quote(c.name) for c in columns)
        return snowflake_stage.load(
            conn,
            rows,
            stage=f"@{stage}",
            statements_before=[
                f"CREATE TEMPORARY STAGE IF NOT EXISTS {stage}",
                f"CREATE TEMPORARY TABLE {raw} (j VARIANT)",
            ],
            copy_sql=f"COPY INTO {raw} FROM @{stage} FILE_FORMAT = (TYPE = JSON) PURGE = TRUE",
            statements_after=[
                f"INSERT INTO {self.quote(table)} ({names}) SELECT {extract} FROM {raw}",
                # The stage (emptied by PURGE) ends with the session, like every temp object here.
                f"DROP TABLE {raw}",
            ],
            chunk_bytes=self.chunk_bytes,
        )

    def _element(self, index: int, portable: str) -> str:
        """Element ``index`` of a staged row (``{"r": [values...]}``) as the staging column's type."""
        value = f"j:r[{index}]"
        if portable in ("text", "json"):
            # A JSON string's text without its quotes; JSON columns travel as text (see write.py).
            return f"CAST({value} AS VARCHAR)"
        if portable in ("timestamp", "date"):
            # Through text, and a JSON null stays NULL rather than becoming a zero date.
            text = f"CAST({value} AS VARCHAR)"
            return f"CASE WHEN {text} IS NULL THEN NULL ELSE CAST({text} AS {self.sql_type(portable)}) END"
        return f"CAST({value} AS {self.sql_type(portable)})"

    # ---- reading ------------------------------------------------------------------------------
    def column_type(self, description_row: Sequence[Any]) -> str | None:
        code = description_row[1] if len(description_row) > 1 else None
        if not isinstance(code, int):
            return super().column_type(description_row)
        kind = _SNOWFLAKE_TYPE_CODES.get(code)
        if kind == "integer" and len(description_row) > 5 and description_row[5]:
            return "float"  # NUMBER(p, s) with s > 0
        return kind or "text"
