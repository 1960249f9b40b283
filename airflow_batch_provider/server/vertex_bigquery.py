"""``serve --dialect vertex``, BigQuery in and out: a job's input table read into the engine, its
predictions written as a table.

Written from Google's documentation of Gemini batch prediction from BigQuery: the input table
(``inputConfig.bigquerySource.inputUri``, ``bq://project.dataset.table``) has a ``request``
column (JSON, or STRING holding JSON) with a GenerateContentRequest; every input column is
copied to the output row, which adds ``response`` (JSON: the GenerateContentResponse),
``status`` (STRING: empty on success, else the error message) and ``processed_time``
(TIMESTAMP). ``outputConfig.bigqueryDestination.outputUri`` names a dataset
(``bq://project.dataset``: the job creates ``predictions_<timestamp>`` in it) or a table; the
ended job names them in ``outputInfo.bigqueryOutputDataset`` (``bq://project.dataset``) and
``outputInfo.bigqueryOutputTable`` (the table's name).

The server reaches BigQuery through ``google-cloud-bigquery`` with anonymous credentials at the
endpoint it is given (``bigquery_endpoint_url``: the test suite's bqemulator). At create, the
input is read page by page into the engine's input file (lines ``{key, request}``, the key the
row's position) and a side file of the rows' columns; once the job has ended, the engine's
output lines (in input order, a cancelled job's unanswered rows absent) are joined to that side
file as both are read, and written with load jobs of ``CHUNK_ROWS`` rows.

Not emulated: Google checks the input table's schema when the job runs (here: at create); a
``request`` that is not JSON fails its row here, where Google may fail the job; an output
table that exists is refused here (Google's behaviour is not documented).
"""

from __future__ import annotations

import base64
import contextlib
import io
import re
import tempfile
from collections.abc import Iterator, Mapping
from datetime import date, datetime, time, timezone
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import orjson

#: Rows per page read from the input table, and per load job written to the output table.
PAGE_ROWS = 5_000
CHUNK_ROWS = 5_000
#: The side file of a job's input columns: the input file's name plus this.
COLUMNS_SUFFIX = ".columns.jsonl"
#: Columns Vertex AI adds to every output row.
OUTPUT_COLUMNS = (("response", "JSON"), ("status", "STRING"), ("processed_time", "TIMESTAMP"))
_PROJECT = r"(?:[a-z0-9.-]+:)?[a-z0-9][a-z0-9-]{0,62}"
_DATASET = r"[A-Za-z0-9_]{1,1024}"
_TABLE = r"[^.`/\s]{1,1024}"
_BQ_URI = re.compile(rf"bq://({_PROJECT})\.({_DATASET})(?:\.({_TABLE}))?")


def split_bq(uri: str) -> tuple[str, str, str | None]:
    """``(project, dataset, table or None)`` of a ``bq://`` URI (a ``ValueError`` otherwise)."""
    found = _BQ_URI.fullmatch(uri)
    if found is None:
        raise ValueError(f"{uri!r} is not a bq://project.dataset[.table] URI")
    return found.group(1), found.group(2), found.group(3)


def client(endpoint: str, project: str) -> Any:
    """A ``google.cloud.bigquery.Client`` on ``endpoint`` with anonymous credentials."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import bigquery

    return bigquery.Client(
        project=project,
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=endpoint),
    )


def _jsonable(value: Any) -> Any:
    """A BigQuery row value as the NDJSON a load job takes back unchanged."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, (date, time)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def read_input(endpoint: str, uri: str, lines: Path, columns: Path) -> list[dict[str, Any]]:
    """Page through the table ``uri`` into ``lines`` (``{key, request}``) and ``columns`` (each
    row's columns, one JSON object a line); returns the table's schema (``SchemaField`` dicts).

    :raises FileNotFoundError: no such table.
    :raises ValueError: the table has no ``request`` column.
    """
    from google.api_core.exceptions import NotFound

    project, dataset, table = split_bq(uri)
    if table is None:
        raise ValueError(f"{uri} names a dataset, not a table")
    bq = client(endpoint, project)
    try:
        try:
            found = bq.get_table(f"{project}.{dataset}.{table}")
        except NotFound:
            raise FileNotFoundError(uri) from None
        names = [f.name for f in found.schema]
        if "request" not in names:
            raise ValueError(f"{uri} has no request column (its columns: {', '.join(names)})")
        with lines.open("wb") as out, columns.open("wb") as side:
            rows = bq.list_rows(found, page_size=PAGE_ROWS)
            for index, row in enumerate(rows):
                values = {name: _jsonable(row[name]) for name in names}
                request = values["request"]
                if isinstance(request, str):
                    # Not JSON: kept as text, the engine answers the row with an error.
                    with contextlib.suppress(orjson.JSONDecodeError):
                        request = orjson.loads(request)
                out.write(orjson.dumps({"key": str(index), "request": request}) + b"\n")
                side.write(orjson.dumps(values) + b"\n")
        return [f.to_api_repr() for f in found.schema]
    finally:
        bq.close()


def output_table(rec: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(project, dataset, table)`` a job writes: the destination's table, else
    ``predictions_<creation time>`` in the destination's dataset."""
    project, dataset, table = split_bq(rec["vertex"]["output_uri"])
    if table is None:
        stamp = datetime.fromtimestamp(rec["created_at"], tz=timezone.utc).strftime("%Y_%m_%dT%H_%M_%S_%fZ")
        table = f"predictions_{stamp}"
    return project, dataset, table


def _joined(columns: IO[bytes], output: IO[bytes] | None, processed: str) -> Iterator[dict[str, Any]]:
    """The output rows: each answered line's input columns plus response, status and time.

    Both files are in input order (the engine answers lines in order), so they are read together.
    """
    side = enumerate(columns)
    for raw in output or ():
        line = orjson.loads(raw)
        key = int(line["key"])
        for index, values in side:
            if index == key:
                row = orjson.loads(values)
                status = line.get("status") or ""
                row.update(
                    response=line.get("response") if not status else None,
                    status=status,
                    processed_time=processed,
                )
                yield row
                break


def write_output(
    endpoint: str,
    rec: Mapping[str, Any],
    columns: Path,
    output: Path | None,
    processed: str,
) -> tuple[str, str]:
    """Write a job's output table (the answered rows, in load jobs of ``CHUNK_ROWS``); returns
    ``(bigqueryOutputDataset, bigqueryOutputTable)`` as ``outputInfo`` names them.

    :param columns: the side file ``read_input`` wrote.
    :param output: the engine's output file (None: no line was answered).
    :param processed: the rows' ``processed_time`` (ISO 8601).
    """
    from google.cloud import bigquery

    project, dataset, table = output_table(rec)
    schema = [bigquery.SchemaField.from_api_repr(f) for f in rec["vertex"]["schema"]]
    taken = {f.name for f in schema}
    schema += [bigquery.SchemaField(n, t) for n, t in OUTPUT_COLUMNS if n not in taken]
    ref = f"{project}.{dataset}.{table}"
    bq = client(endpoint, project)
    config = bigquery.LoadJobConfig(
        source_format=bigquery.SourceFormat.NEWLINE_DELIMITED_JSON,
        write_disposition=bigquery.WriteDisposition.WRITE_APPEND,
        schema=schema,
    )
    try:
        bq.create_table(bigquery.Table(ref, schema=schema), exists_ok=True)
        with columns.open("rb") as side, output.open("rb") if output else _nothing() as answers:
            rows = _joined(side, answers, processed)
            while True:
                with tempfile.TemporaryFile(prefix="abp-vertex-bq-") as chunk:
                    count = 0
                    for row in rows:
                        chunk.write(orjson.dumps(row) + b"\n")
                        count += 1
                        if count >= CHUNK_ROWS:
                            break
                    if not count:
                        break
                    chunk.seek(0)
                    bq.load_table_from_file(chunk, ref, job_config=config).result()
    finally:
        bq.close()
    return f"bq://{project}.{dataset}", table


def _nothing() -> IO[bytes]:
    return io.BytesIO(b"")
