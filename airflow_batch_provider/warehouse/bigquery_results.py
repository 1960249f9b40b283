"""The merge's BigQuery route: its staging filled by SQL from the request, rejects and prediction
tables, so no row and no answer passes through the worker.

The writer (:class:`~airflow_batch_provider.warehouse.write.ResultsWriter`, given a
:class:`~airflow_batch_provider.warehouse.write.SqlStaging`) then writes the results table with
its one ``MERGE``, as on every route: cost, vendor, batch_conn_id, merged_at, request_hash,
missing/expired/cancelled keys and exactly-once upserts are the same code.

A prediction row (Vertex AI's output table: the request table's columns plus ``response``,
``status``, ``processed_time``) becomes the staged result the Python path makes of the same
Gemini answer (``dialects/vertex.py`` ``parse_result_line``, ``dialects/gemini.py``
``chat_completion``, ``warehouse/rows.py`` ``ResultMapper.row``):

* ``status`` not empty: ``failed``, ``request_failed``, the status as the message; no response
  and no status: the same, "the line has neither a response nor a status";
* a response without candidates: ``failed``, ``prompt_blocked`` ("prompt blocked: <reason>")
  or ``no_candidates``, with the model and usage it carries;
* else ``succeeded``: the text parts of candidate 0 (thought parts left out) joined, its finish
  reason mapped as ``gemini.FINISH_REASONS`` maps it (``tool_calls`` where a function call
  answered with ``STOP``), ``modelVersion``, and usage as ``chat_completion`` computes it
  (prompt; candidates + thoughts; total, else their sum; cached, else 0).

Differences from the Python path, said plainly: an answer with no text part (only function
calls) lands ``content`` NULL here, where Python writes the calls (or the body) as JSON; a
token count given as a digit string is read as a number here and dropped there.
"""

from __future__ import annotations

from collections.abc import Sequence

from airflow_batch_provider.dialects.gemini import FINISH_REASONS
from airflow_batch_provider.warehouse.bigquery_requests import sql_literal
from airflow_batch_provider.warehouse.rows import RESULT_COLUMNS


def table_ref(uri: str) -> str:
    """```project.dataset.table``` of a ``bq://`` URI or a dotted name, quoted."""
    name = uri.removeprefix("bq://")
    if "`" in name or "\\" in name:
        raise ValueError(f"not a BigQuery table name: {uri!r}")
    return f"`{name}`"


def quote_name(name: str) -> str:
    """A column name, quoted."""
    if "`" in name or "\\" in name:
        raise ValueError(f"not a BigQuery column name: {name!r}")
    return f"`{name}`"


def keys_select(
    shards: Sequence[tuple[int, str]], key_columns: Sequence[str], key_types: Sequence[str] = ()
) -> str:
    """The staged keys (``custom_id, shard, seq, klen, rhash, rid, k0..``) of every request table.

    :param shards: ``(shard index, table)`` each; none for a build that rejected every row (an
        empty SELECT of the same columns, so its rejects are still written).
    :param key_types: the manifest's portable key types (``integer``/``text``), for that SELECT.
    """
    keys = ", ".join(f"{quote_name(k)} AS k{i}" for i, k in enumerate(key_columns))
    if not shards:
        types = list(key_types) or ["text"] * len(key_columns)
        typed = "".join(
            f", CAST(NULL AS {'INT64' if t == 'integer' else 'STRING'}) AS k{i}" for i, t in enumerate(types)
        )
        return (
            f"SELECT CAST(NULL AS STRING) AS custom_id, 0 AS shard, 0 AS seq, {len(key_columns)} AS klen, "
            f"CAST(NULL AS STRING) AS rhash, CAST(NULL AS STRING) AS rid{typed} FROM (SELECT 1) WHERE FALSE"
        )
    parts = [
        f"SELECT custom_id, {index} AS shard, 0 AS seq, {len(key_columns)} AS klen, request_hash AS rhash, "
        f"custom_id AS rid, {keys} FROM {table_ref(table)}"
        for index, table in shards
    ]
    return " UNION ALL ".join(parts)


def _keyed(key_columns: Sequence[str]) -> str:
    return " AND ".join(f"{quote_name(k)} IS NOT NULL" for k in key_columns)


def rejects_select(rejects_table: str, key_columns: Sequence[str]) -> str:
    """The staged rejects with a usable key (``custom_id, seq, code, reason, k0..``)."""
    keys = ", ".join(f"{quote_name(k)} AS k{i}" for i, k in enumerate(key_columns))
    return (
        f"SELECT custom_id, `row` AS seq, code, reason, {keys} FROM {table_ref(rejects_table)} "
        f"WHERE {_keyed(key_columns)}"
    )


def unkeyed_rejects_select(rejects_table: str, key_columns: Sequence[str]) -> str:
    """How many rejects have no usable key (counted, never written)."""
    return f"SELECT COUNT(*) FROM {table_ref(rejects_table)} WHERE NOT ({_keyed(key_columns)})"


def _count(path: str) -> str:
    return f"SAFE_CAST(JSON_VALUE(abp_r, '$.usageMetadata.{path}') AS INT64)"


def results_select(outputs: Sequence[tuple[str, str]], extra_nulls: int = 0) -> str:
    """The staged results (``custom_id, seq, status, content, embedding, finish_reason, model,
    prompt_tokens, completion_tokens, total_tokens, cached_tokens, error_code, error_message,
    batch_id``) of every prediction table, ``(batch id, table)`` each, in the order the Python
    route reads the batches (``seq`` is the batch's position, 1 first).

    :param extra_nulls: NULL columns after those (the mapper's other columns, none on this route).
    """
    finish = " ".join(f"WHEN {sql_literal(k)} THEN {sql_literal(v)}" for k, v in FINISH_REASONS.items())
    parts_of = "UNNEST(JSON_QUERY_ARRAY(abp_r, '$.candidates[0].content.parts')) AS p WITH OFFSET o"
    not_thought = "IFNULL(JSON_VALUE(p, '$.thought'), 'false') IN ('false', '0', '')"
    text = f"(SELECT STRING_AGG(JSON_VALUE(p, '$.text'), '' ORDER BY o) FROM {parts_of} WHERE {not_thought})"
    calls = (
        f"EXISTS(SELECT 1 FROM {parts_of} WHERE {not_thought} "
        "AND JSON_QUERY(p, '$.functionCall') IS NOT NULL)"
    )
    usage = "JSON_QUERY(abp_r, '$.usageMetadata') IS NOT NULL"
    prompt = f"IF({usage}, IFNULL({_count('promptTokenCount')}, 0), NULL)"
    candidates, thoughts = _count("candidatesTokenCount"), _count("thoughtsTokenCount")
    completion = f"IF({usage}, IFNULL({candidates}, 0) + IFNULL({thoughts}, 0), NULL)"
    cached = f"IF({usage}, IFNULL({_count('cachedContentTokenCount')}, 0), NULL)"
    nulls = "".join(", NULL" for _ in range(extra_nulls))
    if not outputs:
        # No job wrote a table (each failed before answering): no result row.
        width = len(RESULT_COLUMNS) + 2 + extra_nulls
        return f"SELECT {', '.join(['NULL'] * width)} FROM (SELECT 1) WHERE FALSE"
    selects = []
    for position, (batch_id, table) in enumerate(outputs):
        # Layered (the answer's parts, then the row): some BigQuery-compatible servers cannot
        # translate the whole expression nested in one.
        parsed = (
            f"SELECT custom_id, IFNULL(status, '') AS abp_st, response AS abp_r, "
            f"JSON_QUERY(response, '$.candidates[0]') IS NOT NULL AS abp_has, "
            f"JSON_VALUE(response, '$.promptFeedback.blockReason') AS abp_block, "
            f"JSON_VALUE(response, '$.candidates[0].finishReason') AS abp_finish, "
            f"JSON_VALUE(response, '$.modelVersion') AS abp_model FROM {table_ref(table)}"
        )
        answered = (
            f"SELECT *, {text} AS abp_text, {calls} AS abp_calls, {prompt} AS abp_prompt, "
            f"{completion} AS abp_completion, {_count('totalTokenCount')} AS abp_total, "
            f"{cached} AS abp_cached FROM ({parsed})"
        )
        failed = "abp_st != '' OR abp_r IS NULL"
        mapped = f"CASE abp_finish {finish} ELSE LOWER(abp_finish) END"
        answer = f"NOT ({failed}) AND abp_has"
        body = f"NOT ({failed})"
        selects.append(
            # seq orders the answers as the Python route reads them, batch by batch: of a
            # custom_id's answers in two batches (a replaced batch and its successor) the writer
            # keeps the later batch's. Within one batch a custom_id answers once, so the batch's
            # position is the whole order the tie-break needs.
            f"SELECT custom_id, {position + 1} AS seq, "
            f"IF({answer}, 'succeeded', 'failed') AS status, "
            f"IF({answer}, abp_text, NULL) AS content, "
            "CAST(NULL AS STRING) AS embedding, "
            f"IF({answer}, IF(abp_calls AND {mapped} = 'stop', 'tool_calls', {mapped}), NULL) "
            "AS finish_reason, "
            f"IF({body}, abp_model, NULL) AS model, "
            f"IF({body}, abp_prompt, NULL) AS prompt_tokens, "
            f"IF({body}, abp_completion, NULL) AS completion_tokens, "
            f"IF({body}, IFNULL(abp_total, abp_prompt + abp_completion), NULL) AS total_tokens, "
            f"IF({body}, abp_cached, NULL) AS cached_tokens, "
            f"CASE WHEN {failed} THEN 'request_failed' WHEN NOT abp_has THEN "
            "IF(abp_block IS NOT NULL, 'prompt_blocked', 'no_candidates') END AS error_code, "
            f"CASE WHEN abp_st != '' THEN abp_st WHEN abp_r IS NULL THEN "
            "'the line has neither a response nor a status' WHEN NOT abp_has THEN "
            "IF(abp_block IS NOT NULL, CONCAT('prompt blocked: ', abp_block), "
            "'the response has no candidates') "
            f"END AS error_message, {sql_literal(batch_id)} AS batch_id{nulls} FROM ({answered})"
        )
    return " UNION ALL ".join(selects)
