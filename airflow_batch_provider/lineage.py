"""OpenLineage for the build, submit and merge operators: what each task read and wrote.

The openlineage provider calls an operator's ``get_openlineage_facets_on_complete`` when its task
ends (on success and on failure); each of the three operators hands what it ran to one function
here. The operators import this module only inside that method, so nothing of OpenLineage is loaded
unless the provider is installed and asks.

What each task reports (dataset names follow OpenLineage's naming conventions):

* build: the table(s) its ``sql`` / ``table`` reads, parsed with the openlineage ``SQLParser`` in the
  warehouse's namespace (the hook's ``get_openlineage_database_info``, e.g. ``postgres://host:5432``,
  name ``database.schema.table``), a ``sql`` job facet, and its shard files as outputs (``file`` or
  ``s3://bucket``...) with their line and byte counts;
* submit: the shard files as inputs and the batches as outputs, named by batch id in a namespace of the
  vendor endpoint, ``<dialect>://<API host[:port]>`` (stable per connection, never a credential);
* merge: the batches as inputs and the target table as output, with a ``schema`` facet of the columns
  the merge writes and the rows written, plus the run facet :data:`MERGE_STATS_FACET` (rows per
  status, tokens, cost).

Lineage never fails a task: each function catches every error, logs it at debug and returns an empty
``OperatorLineage``. It reads what the task already computed and, at most, the connection and one
small query (the parser's table schemas on the build, the default schema for the merge target).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import attrs
from airflow.providers.common.compat.openlineage.facet import (
    Dataset,
    OutputDataset,
    OutputStatisticsOutputDatasetFacet,
    RunFacet,
    SchemaDatasetFacet,
    SchemaDatasetFacetFields,
    SQLJobFacet,
)
from airflow.providers.common.compat.openlineage.utils.sql import get_openlineage_facets_with_sql
from airflow.providers.openlineage.extractors import OperatorLineage
from airflow.providers.openlineage.sqlparser import SQLParser

__all__ = [
    "MERGE_STATS_FACET",
    "MERGE_STATS_SCHEMA",
    "MergeStatsRunFacet",
    "batch_namespace",
    "build_lineage",
    "file_dataset",
    "merge_lineage",
    "submit_lineage",
]

log = logging.getLogger(__name__)

#: The merge's run facet name; custom facets carry a prefix of their producer.
MERGE_STATS_FACET = "airflowBatchProvider_mergeStats"
_SCHEMA_URL = "urn:airflow-batch-provider:openlineage:MergeStatsRunFacet:1-0-0"

#: The JSON schema of :class:`MergeStatsRunFacet` (its ``_schemaURL`` names this schema).
MERGE_STATS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": _SCHEMA_URL,
    "type": "object",
    "required": ["_producer", "_schemaURL", "counts", "rowsWritten", "promptTokens", "completionTokens"],
    "properties": {
        "_producer": {"type": "string"},
        "_schemaURL": {"type": "string", "const": _SCHEMA_URL},
        "counts": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
        "rowsWritten": {"type": "integer", "minimum": 0},
        "resultLines": {"type": "integer", "minimum": 0},
        "promptTokens": {"type": "integer", "minimum": 0},
        "completionTokens": {"type": "integer", "minimum": 0},
        "totalTokens": {"type": "integer", "minimum": 0},
        "cost": {"type": ["number", "null"], "minimum": 0},
    },
}

# DB-API placeholders the SQL parser cannot read: %s, %(name)s, and %% (a literal % beside them).
_PLACEHOLDER = re.compile(r"%%|%\(\w+\)s|%s")


@attrs.define
class MergeStatsRunFacet(RunFacet):  # type: ignore[misc]
    """What a merge landed: rows per status, tokens and cost (OpenLineage has no standard LLM facet).

    :param counts: rows written per status (succeeded, failed, expired, cancelled, missing, rejected...).
    :param rowsWritten: rows upserted into the target table.
    :param resultLines: result lines read from the batches.
    :param promptTokens: prompt (input) tokens of the answers.
    :param completionTokens: completion (output) tokens of the answers.
    :param totalTokens: total tokens.
    :param cost: the run's cost at the merge's prices (USD); None when the price is unknown.
    """

    counts: dict[str, int] = attrs.field(factory=dict)
    rowsWritten: int = 0  # OpenLineage facet fields are camelCase
    resultLines: int = 0
    promptTokens: int = 0
    completionTokens: int = 0
    totalTokens: int = 0
    cost: float | None = None

    @staticmethod
    def _get_schema() -> str:
        return _SCHEMA_URL


def _safely(task: str, make: Callable[[], OperatorLineage]) -> OperatorLineage:
    """``make()``, or an empty ``OperatorLineage`` when it raises: lineage must never fail a task."""
    try:
        return make()
    except Exception:
        log.debug("OpenLineage: could not describe the %s task; reporting no lineage", task, exc_info=True)
        return OperatorLineage()


# ---- naming ------------------------------------------------------------------------------------
def file_dataset(uri: str, **facets: Any) -> Dataset:
    """The dataset of a staged file: ``file`` + its path, or ``<scheme>://<bucket>`` + its key.

    A connection id in the URI (``s3://conn@bucket/key``) is not part of the name.

    :param uri: the file's URI (``file:///...``, ``s3://bucket/key``, ``gs://...``) or a local path.
    :param facets: output facets, for a file the task wrote.
    """
    text = str(uri)
    if "://" not in text:
        text = "file://" + os.path.abspath(os.path.expanduser(text))
    parts = urlsplit(text)
    scheme = parts.scheme
    host = parts.netloc.rpartition("@")[2]
    if scheme in ("file", "local"):
        namespace, name = (f"file://{host}" if host else "file"), parts.path
    else:
        namespace, name = f"{scheme}://{host}", parts.path.lstrip("/")
    if facets:
        return OutputDataset(namespace=namespace, name=name, outputFacets=facets)
    return Dataset(namespace=namespace, name=name)


def batch_namespace(base_url: str, dialect: str) -> str:
    """The namespace of a vendor's batches: ``<dialect>://<host>[:<port>]`` of the API root, no credentials.

    :param base_url: the API root of the connection (``https://api.openai.com/v1``).
    :param dialect: the vendor dialect's name.
    """
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # IPv6
    return f"{dialect}://{host}:{parts.port}" if parts.port else f"{dialect}://{host}"


def _batch_datasets(hook: Any, batch_ids: Iterable[str]) -> list[Dataset]:
    settings = hook.get_settings()
    namespace = batch_namespace(settings.base_url, settings.dialect.name)
    return [Dataset(namespace=namespace, name=str(batch_id)) for batch_id in batch_ids]


# ---- build -------------------------------------------------------------------------------------
def build_lineage(
    *,
    conn_id: str,
    hook: Callable[[], Any],
    query: Callable[[Any], str],
    output: Mapping[str, Any] | None,
) -> OperatorLineage:
    """The build's lineage: the tables its query reads, its SQL, and the shard files it wrote.

    :param conn_id: the source connection id.
    :param hook: returns the source ``DbApiHook``.
    :param query: the query the build ran, from the hook (``table`` mode builds it).
    :param output: the build's XCom (shards with ``uri``, ``lines``, ``bytes``); None when it failed.
    """

    def make() -> OperatorLineage:
        warehouse = hook()
        sql = query(warehouse)
        parsed = None
        try:
            readable = _PLACEHOLDER.sub(lambda m: "%" if m.group() == "%%" else "NULL", sql)
            parsed = get_openlineage_facets_with_sql(
                hook=warehouse, sql=readable, conn_id=conn_id, database=None
            )
        except Exception:
            # Without the tables the shards and the SQL are still worth reporting.
            log.debug("OpenLineage: could not read the build's tables from its SQL", exc_info=True)
        lineage = parsed or OperatorLineage()
        lineage.job_facets["sql"] = SQLJobFacet(query=SQLParser.normalize_sql(sql))
        lineage.outputs = [
            file_dataset(
                shard["uri"],
                outputStatistics=OutputStatisticsOutputDatasetFacet(
                    rowCount=shard.get("lines"), size=shard.get("bytes")
                ),
            )
            for shard in (output or {}).get("shards", [])
        ]
        return lineage

    return _safely("build", make)


# ---- submit ------------------------------------------------------------------------------------
def submit_lineage(
    *, hook: Callable[[], Any], source: Any, submission: Mapping[str, Any] | None
) -> OperatorLineage:
    """The submit's lineage: the shard files it uploaded and the batches it created (or re-attached to).

    :param hook: returns the ``BatchApiHook`` (for the vendor namespace).
    :param source: the operator's rendered ``source``.
    :param submission: the submit's XCom (``batches`` with ``shard`` and ``batch_id``,
        ``manifest_path``); None when it failed before submitting.
    """

    def make() -> OperatorLineage:
        if not submission:
            return OperatorLineage()
        records = [r for r in submission.get("batches", []) if isinstance(r, Mapping)]
        files = _submitted_files(source, submission.get("manifest_path"), [r.get("shard") for r in records])
        return OperatorLineage(
            inputs=[file_dataset(uri) for uri in files],
            outputs=_batch_datasets(hook(), [r["batch_id"] for r in records if r.get("batch_id")]),
        )

    return _safely("submit", make)


def _submitted_files(source: Any, manifest_file: str | None, indexes: Sequence[Any]) -> list[str]:
    """The URIs of the shards a submit read: from its source when it names them, else its manifest."""
    if isinstance(source, Mapping) and "uri" in source:
        return [str(source["uri"])]  # one shard of a build XCom (``.expand()``)
    shards = source.get("shards") if isinstance(source, Mapping) else None
    if isinstance(shards, Sequence) and all(isinstance(s, Mapping) and "uri" in s for s in shards):
        return [str(s["uri"]) for s in shards if s.get("index") in indexes]  # the whole build XCom
    if manifest_file:
        from airflow_batch_provider import staging

        path = staging.manifest_path(manifest_file)
        directory = staging.staging_dir_of(path)
        manifest = staging.read_manifest(path)
        return [str(directory / s.path) for s in manifest.shards if s.index in indexes]
    # A hand-made JSONL file.
    return [str(source)] if isinstance(source, str) and source else []


# ---- merge -------------------------------------------------------------------------------------
def merge_lineage(
    *,
    conn_id: str,
    warehouse_hook: Callable[[], Any],
    batch_hook: Callable[[], Any],
    table: str,
    schema: str | None,
    columns: Sequence[tuple[str, str]],
    summary: Mapping[str, Any] | None,
) -> OperatorLineage:
    """The merge's lineage: the batches it read, the table it wrote (with its columns) and its figures.

    :param conn_id: the warehouse connection id.
    :param warehouse_hook: returns the warehouse ``DbApiHook``.
    :param batch_hook: returns the ``BatchApiHook`` (for the vendor namespace).
    :param table: the target table (as given: never split on dots).
    :param schema: the target schema, or None for the connection's default.
    :param columns: ``(name, portable type)`` of the columns the merge writes, in table order.
    :param summary: the merge's XCom (``batch_ids``, ``counts``, ``rows_written``, tokens, ``cost``);
        None when it failed before writing.
    """

    def make() -> OperatorLineage:
        lineage: OperatorLineage = OperatorLineage()
        if summary:
            lineage.inputs = _batch_datasets(batch_hook(), summary.get("batch_ids", []))
            lineage.run_facets[MERGE_STATS_FACET] = MergeStatsRunFacet(
                counts={str(k): int(v) for k, v in summary.get("counts", {}).items()},
                rowsWritten=int(summary.get("rows_written", 0)),
                resultLines=int(summary.get("result_lines", 0)),
                promptTokens=int(summary.get("prompt_tokens", 0)),
                completionTokens=int(summary.get("completion_tokens", 0)),
                totalTokens=int(summary.get("total_tokens", 0)),
                cost=summary.get("cost"),
            )
        target = _table_dataset(warehouse_hook(), conn_id, table, schema, columns, summary)
        if target is not None:
            lineage.outputs = [target]
        return lineage

    return _safely("merge", make)


def _table_dataset(
    hook: Any,
    conn_id: str,
    table: str,
    schema: str | None,
    columns: Sequence[tuple[str, str]],
    summary: Mapping[str, Any] | None,
) -> Dataset | None:
    """The target table as the SQL parser names tables (``database.schema.table``) in the hook's namespace."""
    connection = hook.get_connection(conn_id)
    info = hook.get_openlineage_database_info(connection)
    if info is None:
        log.debug("OpenLineage: %s gives no database info; the merge reports no target table", hook)
        return None
    # MySQL has no schema below its databases: the connection's database stands in (``db.table``).
    schema = schema or hook.get_openlineage_default_schema() or connection.schema
    name = ".".join(part for part in (info.database, schema, table) if part)
    facets: dict[str, Any] = {
        "schema": SchemaDatasetFacet(
            fields=[SchemaDatasetFacetFields(name=column, type=kind) for column, kind in columns]
        )
    }
    output_facets: dict[str, Any] = (
        {"outputStatistics": OutputStatisticsOutputDatasetFacet(rowCount=int(summary["rows_written"]))}
        if summary and "rows_written" in summary
        else {}
    )
    return OutputDataset(
        namespace=SQLParser.create_namespace(info),
        name=name.upper() if info.is_uppercase_names else name,
        facets=facets,
        outputFacets=output_facets,
    )
