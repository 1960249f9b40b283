"""The BigQuery route's SQL (``warehouse/bigquery_requests.py``) against the file route's Python,
run on the session's bqemulator: the JSON-string escape equals orjson's on hostile text, and the
custom_id and request_hash computed in SQL equal ``keys.custom_id_for`` and ``request_hash``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.keys import custom_id_for
from airflow_batch_provider.request_hash import request_hash
from airflow_batch_provider.warehouse.bigquery_requests import (
    Slots,
    compile_messages,
    custom_id_sql,
    json_escape_sql,
    plan_requests,
    sql_literal,
)
from airflow_batch_provider.warehouse.loaders.bigquery_load import load_rows
from airflow_batch_provider.warehouse.rows import Column
from tests.fixtures.bigquery import BQ_PROJECT

HOSTILE = [
    "",
    'quote " and backslash \\ and both \\"',
    "".join(chr(c) for c in range(1, 0x20)),
    "nul \x00 inside",
    "emoji 😀 and accents é ü 中文",
    "</script><b>&amp;</b> / slash",
    "\u2028 line separators \u2029 and DEL \x7f",
    "trailing backslash \\",
    "new\nline\ttab\rreturn\bbs\fff",
    "'single' quotes",
]


def quote(name: str) -> str:
    return f"`{name}`"


@pytest.fixture
def bq(bqemulator: str) -> Iterator[tuple[Any, str]]:
    from airflow_batch_provider.server.vertex_bigquery import client

    bq = client(bqemulator, BQ_PROJECT)
    dataset = f"abp_req_{uuid.uuid4().hex[:10]}"
    bq.create_dataset(dataset)
    try:
        yield bq, dataset
    finally:
        bq.delete_dataset(dataset, delete_contents=True, not_found_ok=True)
        bq.close()


def run(bq: Any, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(r.values()) for r in bq.query(sql, api_method="INSERT").result()]


def table_of(bq: Any, dataset: str, name: str, columns: list[Column], rows: list[tuple[Any, ...]]) -> str:
    ref = f"{BQ_PROJECT}.{dataset}.{name}"
    load_rows(bq, ref, columns, rows)
    return ref


def test_json_escape_equals_orjson_on_hostile_text(bq: tuple[Any, str]) -> None:
    client, dataset = bq
    texts = [t for t in HOSTILE if "\x00" not in t]
    ref = table_of(
        client, dataset, "texts", [Column("i", "integer"), Column("t", "text")], list(enumerate(texts))
    )
    got = dict(run(client, f"SELECT i, {json_escape_sql('t')} FROM `{ref}`"))
    for i, text in enumerate(texts):
        assert got[i] == orjson.dumps(text).decode()[1:-1], text


def test_json_escape_of_every_control_character_and_nul(bq: tuple[Any, str]) -> None:
    client, _ = bq
    # Built from code points in SQL (a load job would refuse a NUL): every one of 0x00-0x1f.
    for code in range(0x20):
        text = f"CONCAT('a', CODE_POINTS_TO_STRING([{code}]), 'b')"
        (value,) = run(client, f"SELECT {json_escape_sql(text)}")[0]
        assert value == orjson.dumps(f"a{chr(code)}b").decode()[1:-1], code


def test_sql_literal_round_trips(bq: tuple[Any, str]) -> None:
    client, _ = bq
    for text in HOSTILE:
        assert run(client, f"SELECT {sql_literal(text)}")[0][0] == text


@pytest.mark.parametrize("prefix", ["", "run7-"])
def test_custom_id_sql_equals_custom_id_for(bq: tuple[Any, str], prefix: str) -> None:
    client, dataset = bq
    ints = [0, 1, -5, 2**63 - 1, -(2**63)]
    texts = ["abc", "A_b-9", "123", "-7", "k-abc", "has space", "é", 'q"\\', "x" * 64, "x" * 70, ""]
    ref_i = table_of(client, dataset, "ints", [Column("k", "integer")], [(v,) for v in ints])
    ref_t = table_of(client, dataset, "texts", [Column("k", "text")], [(v,) for v in texts])
    for ref, values, kind in ((ref_i, ints, "INT64"), (ref_t, texts, "STRING")):
        canonical, cid = custom_id_sql([("k", kind)], prefix, quote)
        got = dict(run(client, f"SELECT k, {cid} FROM (SELECT *, {canonical} AS abp_kc FROM `{ref}`)"))
        assert got == {v: custom_id_for([v], prefix) for v in values}
    pairs = [(1, "a"), (2, 'b "q"'), (-3, "é😀")]
    ref_p = table_of(client, dataset, "pairs", [Column("a", "integer"), Column("b", "text")], pairs)
    canonical, sql = custom_id_sql([("a", "INT64"), ("b", "STRING")], prefix, quote)
    got = {
        (a, b): cid
        for a, b, cid in run(
            client, f"SELECT a, b, {sql} FROM (SELECT *, {canonical} AS abp_kc FROM `{ref_p}`)"
        )
    }
    assert got == {p: custom_id_for(list(p), prefix) for p in pairs}


def test_a_key_type_that_cannot_be_rendered_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="key column 'd' is DATE"):
        custom_id_sql([("d", "DATE")], "", quote)


@pytest.mark.parametrize(
    "template",
    ["{{ text | upper }}", "{% if text %}x{% endif %}", "{{ row['text'] }}", "{{ text ~ 'x' }}"],
)
def test_templates_beyond_plain_substitution_are_refused(template: str) -> None:
    with pytest.raises(ConfigurationError, match="compute the text in sql"):
        compile_messages([{"role": "user", "content": template}], ["text"], Slots())


def test_request_hash_line_and_request_equal_the_python_path(bq: tuple[Any, str]) -> None:
    from airflow_batch_provider.dialects import get_dialect

    client, dataset = bq
    texts = [t for t in HOSTILE if "\x00" not in t]
    rows = [(i, t, i * 7) for i, t in enumerate(texts)]
    ref = table_of(
        client, dataset, "src", [Column("id", "integer"), Column("t", "text"), Column("n", "integer")], rows
    )
    messages = [
        {"role": "system", "content": "Answer in French. </script>"},
        {"role": "user", "content": 'Text: "{{ t }}" (number {{ n }})\n'},
    ]
    defaults = {"model": "gemini-2.5-flash", "max_tokens": 50, "temperature": 0.2}
    dialect = get_dialect("vertex")

    def body_of(compiled: list[Any]) -> dict[str, Any]:
        return {**defaults, "messages": compiled}

    plan = plan_requests(
        source=f"SELECT * FROM `{ref}`",
        schema={"id": "INTEGER", "t": "STRING", "n": "INTEGER"},
        key_columns=["id"],
        messages=messages,
        canonical_body=body_of,
        endpoint="/v1/chat/completions",
        encode_request=lambda line: dialect.encode_line(line)["request"],
        prefix="",
        on_null="reject",
        max_line=10_000,
        quote=quote,
    )
    got = {
        r[0]: r
        for r in run(client, f"SELECT id, custom_id, request_hash, request FROM ({plan.work_select()})")
    }
    for i, text, n in rows:
        body = body_of([messages[0], {"role": "user", "content": f'Text: "{text}" (number {n})\n'}])
        line = {"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body}
        _, cid, digest, request = got[i]
        assert cid == custom_id_for([i])
        assert digest == request_hash("/v1/chat/completions", body)
        assert request == orjson.dumps(dialect.encode_line(line)["request"]).decode()


def _plan(encode: Any, source: str = "SELECT 1 AS id, 'x' AS t") -> Any:
    return plan_requests(
        source=source,
        schema={"id": "INTEGER", "t": "STRING"},
        key_columns=["id"],
        messages=[{"role": "user", "content": "{{ t }}"}],
        canonical_body=lambda compiled: {"model": "m", "messages": compiled},
        endpoint="/v1/chat/completions",
        encode_request=encode,
        prefix="",
        on_null="reject",
        max_line=10_000,
        quote=quote,
    )


def test_the_fingerprint_covers_the_encoding_but_not_the_request_text(bq: tuple[Any, str]) -> None:
    """The shard fingerprint aggregates ``custom_id:request_hash`` (never the whole request, which
    can pass BigQuery's 100 MB value limit) plus the encoding template's digest: a change in the
    request's non-row parts (the job's generation config) changes it; the random sentinels do not."""
    from airflow_batch_provider.warehouse.bigquery_requests import check_table, fingerprint_sql, run_token

    client, dataset = bq

    def plain(line: Any) -> Any:
        return {"contents": line["body"]["messages"]}

    def tuned(line: Any) -> Any:
        return {**plain(line), "generationConfig": {"temperature": 0}}

    first, again, other = _plan(plain), _plan(plain), _plan(tuned)
    assert first.slots.token != again.slots.token and first.template == again.template
    assert other.template != first.template
    ref = f"{BQ_PROJECT}.{dataset}.shard"
    columns = "custom_id, request_hash, request"
    run(client, f"CREATE TABLE `{ref}` AS SELECT {columns} FROM ({first.work_select()})")
    sql = fingerprint_sql(ref, first.template, quote)
    assert "request)" not in sql.split("STRING_AGG", 1)[1]
    ((lines, _, fingerprint),) = run(client, sql)
    assert lines == 1
    ((_, _, tuned_print),) = run(client, fingerprint_sql(ref, other.template, quote))
    assert tuned_print != fingerprint
    check_table(client, f"bq://{ref}", first.template, fingerprint)
    run(client, f"UPDATE `{ref}` SET request_hash = 'changed' WHERE TRUE")
    with pytest.raises(ConfigurationError, match=f"requests table {ref} changed since the build"):
        check_table(client, f"bq://{ref}", first.template, fingerprint)
    with pytest.raises(ConfigurationError, match="is gone"):
        check_table(client, f"bq://{ref}_missing", first.template, fingerprint)
    assert run_token("/staging/a") != run_token("/staging/b") and len(run_token("x")) == 10


def test_results_seq_follows_the_batch_order() -> None:
    """Of a custom_id's answers in two batches, the writer keeps the higher seq: the later batch's,
    as the Python route keeps the last line it reads."""
    from airflow_batch_provider.warehouse.bigquery_results import results_select

    sql = results_select([("first", "p.d.a"), ("second", "p.d.b")])
    first, second = sql.split(" UNION ALL ")
    assert "1 AS seq" in first and "'first' AS batch_id" in first
    assert "2 AS seq" in second and "'second' AS batch_id" in second
