"""One table, any vendor: the same rows through every registered dialect land the same way.

For each dialect the local server speaks that vendor's API (``serve --dialect <name>``), the
connection names the dialect, and the same build (a chat template over one table) goes through
build -> submit -> deferred wait -> merge on PostgreSQL. Two rows ask the echo model for an error
(``ECHO_ERROR_MARK``), one row is NULL (a build reject): every results table has the same columns,
the same per-row statuses and the same answers, and records which vendor answered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS
from airflow_batch_provider.server.backends import ECHO_ERROR_MARK
from tests.fixtures.reliability import MESSAGES, Pipeline, seed_texts

ROWS = 12
FAILING = {3, 8}
NULL_ROW = 5
# max_tokens: some vendors require it on every request (the canonical line carries it).
BUILD = {"table": "tickets", "key_columns": "id", "messages": MESSAGES, "body": {"max_tokens": 64}}


def _texts() -> list[str | None]:
    texts: list[str | None] = []
    for i in range(1, ROWS + 1):
        if i == NULL_ROW:
            texts.append(None)
        elif i in FAILING:
            texts.append(f"question {i} {ECHO_ERROR_MARK}")
        else:
            texts.append(f"question {i}")
    return texts


def _columns(warehouse: Any, table: str) -> list[str]:
    return [
        r[0]
        for r in warehouse.rows(
            "SELECT column_name FROM information_schema.columns "
            f"WHERE table_name = '{table}' AND table_schema = current_schema() ORDER BY ordinal_position"
        )
    ]


async def test_the_same_rows_land_the_same_through_every_dialect(
    batch_server: Any,
    pg_warehouse: Any,
    tmp_path: Path,
    task_context: Any,
    monkeypatch: pytest.MonkeyPatch,
    object_store: Any,
    gcs_staging: Any,
    google_key: Any,
) -> None:
    # The buckets (and the Google key) of the object-store vendors are set up before the loop runs.
    seed_texts(pg_warehouse, "tickets", _texts())  # type: ignore[arg-type]
    q = pg_warehouse.quote
    columns: dict[str, list[str]] = {}
    rows: dict[str, dict[int, tuple[Any, ...]]] = {}
    for dialect in sorted(DIALECTS):
        server = batch_server(dialect=dialect)
        monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
        # A vendor whose jobs read object storage (submission_mode) stages the run there.
        root = server.s3.path("every", dialect) if server.s3 is not None else tmp_path / dialect
        pipeline = Pipeline(pg_warehouse, root, task_context)
        table = f"answers_{dialect}"
        # A failed line is a partial success: land what succeeded and report the rest.
        await pipeline.run(f"every-{dialect}", table, build=BUILD, submit={"on_partial_failure": "succeed"})
        columns[dialect] = _columns(pg_warehouse, table)
        rows[dialect] = {
            r[0]: tuple(r[1:])
            for r in pg_warehouse.rows(
                f"SELECT id, status, content, {q('vendor')}, request_hash FROM {q(table)} ORDER BY id"
            )
        }
    first = sorted(DIALECTS)[0]
    # Spend columns too: every vendor's rows are priced the same way (#27).
    assert {"cached_tokens", "cost"} <= set(columns[first])
    # Incremental runs (#27): each row's request_hash, of the canonical request (never NULL for
    # a row sent; NULL for the reject), is the same whoever carried it.
    hashes = {k: r[3] for k, r in rows[first].items()}
    assert [k for k, h in hashes.items() if h is None] == [NULL_ROW] and len(set(hashes.values())) == ROWS
    for dialect in DIALECTS:
        assert columns[dialect] == columns[first], dialect
        statuses = {key: row[0] for key, row in rows[dialect].items()}
        assert statuses == {
            i: "rejected" if i == NULL_ROW else "failed" if i in FAILING else "succeeded"
            for i in range(1, ROWS + 1)
        }, dialect
        # The echo model's answers depend on the request only: the same text whoever carried it.
        assert {k: r[1] for k, r in rows[dialect].items()} == {k: r[1] for k, r in rows[first].items()}, (
            dialect
        )
        assert {r[2] for k, r in rows[dialect].items() if k != NULL_ROW} == {dialect}
        assert {k: r[3] for k, r in rows[dialect].items()} == hashes, dialect
