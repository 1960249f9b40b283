"""Assets: warehouse-convention URIs for a results table, and the extra the operators attach to events.

A downstream DAG scheduled on a results table (``schedule=[asset]``) reads what landed from the
asset event's extra (``triggering_asset_events``): rows per status, tokens, cost and batch ids
from the merge; shards, rows, rejects and the staging URI from the build.

The URIs follow the warehouse providers' asset conventions, so the asset is the same one their
own operators (e.g. ``SQLExecuteQueryOperator`` with an outlet) and OpenLineage name:

* PostgreSQL: ``postgres://host:port/database/schema/table`` (the Postgres provider's
  normaliser turns an empty schema into ``default``, so a table given without a schema is
  ``.../database/default/table``);
* MySQL / MariaDB: ``mysql://host:port/database/table``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow_batch_provider.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow.sdk import Asset, Context

# conn_type -> (URI scheme, default port, whether the URI has a schema segment)
_CONVENTIONS: dict[str, tuple[str, int, bool]] = {
    "postgres": ("postgres", 5432, True),
    "postgresql": ("postgres", 5432, True),
    "mysql": ("mysql", 3306, False),
    "mariadb": ("mysql", 3306, False),
}
# What the merge's event extra carries from its summary (small, JSON, no samples of row data).
MERGE_EXTRA_KEYS = (
    "table",
    "batch_ids",
    "counts",
    "rows_written",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cost",
    "attempt",
    "resubmit_lines",
)
BUILD_EXTRA_KEYS = ("dialect", "endpoint", "model", "rows_read", "rows_written", "rows_rejected")


def table_uri(
    conn_type: str,
    *,
    host: str,
    database: str,
    table: str,
    schema: str | None = None,
    port: int | None = None,
) -> str:
    """The warehouse provider's asset URI of one table.

    :param conn_type: the connection type (``postgres``, ``mysql``, ``mariadb``).
    :param host: the database host (no credentials).
    :param database: the database name (the connection's ``schema`` field in Airflow).
    :param table: the table name, as the merge's ``target_table`` (never split on dots).
    :param schema: the schema (PostgreSQL); None is the provider's ``default``.
    :param port: the port; default the database's standard port.
    """
    convention = _CONVENTIONS.get(conn_type.lower())
    if convention is None:
        raise ConfigurationError(
            f"no asset URI convention for connection type {conn_type!r} (known: "
            f"{', '.join(sorted(_CONVENTIONS))}); give the outlet an Asset with a URI of your own"
        )
    scheme, default_port, has_schema = convention
    if not host or not database or not table:
        raise ConfigurationError(f"a {scheme}:// asset URI needs a host, a database and a table")
    parts = [database, *([schema or "default"] if has_schema else []), table]
    # A name may hold characters a URI path cannot (a dot is fine, a slash is not).
    path = "/".join(quote(p, safe="") for p in parts)
    return f"{scheme}://{host}:{port or default_port}/{path}"


def results_table_uri(conn_id: str, table: str, schema: str | None = None) -> str:
    """The asset URI of ``table`` in the warehouse of connection ``conn_id`` (reads the connection).

    For a MySQL connection ``schema`` is the database (as the merge's ``target_schema``).
    """
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    conn_type = conn.conn_type or ""
    has_schema = _CONVENTIONS.get(conn_type.lower(), ("", 0, True))[2]
    return table_uri(
        conn_type,
        host=conn.host or "",
        port=conn.port,
        # MySQL has no schema level: the merge's target_schema is the database there.
        database=schema if schema and not has_schema else conn.schema or "",
        schema=schema if has_schema else None,
        table=table,
    )


def results_table_asset(
    conn_id: str, table: str, schema: str | None = None, *, name: str | None = None, **kwargs: Any
) -> Asset:
    """An ``Asset`` for ``table`` in the warehouse of ``conn_id`` (see :func:`results_table_uri`).

    Reading a connection at DAG-parse time costs a lookup per parse; a DAG may instead build
    the URI once with :func:`table_uri`. ``name`` and ``kwargs`` go to ``Asset``.
    """
    from airflow.sdk import Asset

    uri = results_table_uri(conn_id, table, schema)
    return Asset(name=name or uri, uri=uri, **kwargs)


def attach_outlet_extra(context: Context, outlets: Iterable[Any], extra: Mapping[str, Any]) -> list[str]:
    """Add ``extra`` to the event of every outlet that is an ``Asset``; returns their URIs.

    An outlet that is an alias or a non-asset is left alone: its event is the user's to fill.
    """
    from airflow.sdk import Asset

    events = context.get("outlet_events")
    if events is None:
        return []
    uris = []
    for outlet in outlets or ():
        if isinstance(outlet, Asset):
            events[outlet].extra.update(extra)
            uris.append(outlet.uri)
    return uris


def merge_event_extra(summary: Mapping[str, Any], schema: str | None = None) -> dict[str, Any]:
    """The merge's asset event extra: rows per status, tokens, cost and batch ids."""
    extra = {key: summary.get(key) for key in MERGE_EXTRA_KEYS}
    extra["schema"] = schema
    return extra


def build_event_extra(xcom: Mapping[str, Any]) -> dict[str, Any]:
    """The build's asset event extra: shard count, rows, rejects and where the staging is."""
    extra = {key: xcom.get(key) for key in BUILD_EXTRA_KEYS}
    extra["shards"] = len(xcom.get("shards") or ())
    extra["staging_path"] = xcom.get("staging_path")
    extra["manifest_path"] = xcom.get("manifest_path")
    return extra
