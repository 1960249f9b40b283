"""BigQuery's bulk-load engine: rows as newline-delimited JSON in a temp file, one load job.

The rows are written to a temp file as they arrive (memory stays flat, whatever their number)
and the file goes to BigQuery as one ``NEWLINE_DELIMITED_JSON`` load job appending to the
staging table; load jobs are free, where streaming inserts or DML ``INSERT`` are billed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from airflow_batch_provider.warehouse.rows import Column

#: BigQuery load-schema types of the portable column types (JSON travels as text in staging).
LOAD_TYPES = {
    "integer": "INT64",
    "float": "FLOAT64",
    "text": "STRING",
    "boolean": "BOOL",
    "date": "DATE",
    "timestamp": "TIMESTAMP",
    "json": "STRING",
}


def load_rows(client: Any, table_ref: str, columns: Sequence[Column], rows: Iterable[Sequence[Any]]) -> int:
    """Append ``rows`` to ``table_ref`` (``project.dataset.table``) with one load job; the rows loaded.

    :param client: a ``google.cloud.bigquery.Client``.
    :param columns: the staging table's columns, in the order of each row's values.
    """
    from google.cloud import bigquery

    names = [c.name for c in columns]
    count = 0
    dumps = orjson.dumps
    # On disk as it is written (an anonymous temp file), never whole in memory.
    with tempfile.TemporaryFile(mode="w+b", prefix="abp-bq-") as fh:
        for row in rows:
            fh.write(dumps(dict(zip(names, row, strict=True)), default=str))
            fh.write(b"\n")
            count += 1
        if not count:
            return 0
        fh.seek(0)
        config = bigquery.LoadJobConfig(
            source_format=bigquery.SourceFormat.NEWLINE_DELIMITED_JSON,
            write_disposition=bigquery.WriteDisposition.WRITE_APPEND,
            schema=[bigquery.SchemaField(c.name, LOAD_TYPES[c.type or "text"]) for c in columns],
        )
        client.load_table_from_file(fh, table_ref, job_config=config, rewind=True).result()
    return count
