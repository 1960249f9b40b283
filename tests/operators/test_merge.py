"""MergeBatchResultsOperator end to end: real local batch server, real databases, real staging files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import staging
from airflow_batch_provider.constants import SHARD_TAG
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.models import Manifest, Shard
from airflow_batch_provider.operators.merge import MergeBatchResultsOperator, batches_with_shards

ENDPOINT = "/v1/chat/completions"


def stage(
    directory: Path,
    rows: list[tuple[int, str]],
    *,
    lost: list[int] = (),
    rejects: list[dict[str, Any]] = (),
    json_format: bool = False,
    endpoint: str = ENDPOINT,
) -> Path:
    """A build's staging directory: one shard, keys.jsonl (with keys lost from the shard), rejects.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    shard = directory / "shard-00000.jsonl"
    with open(shard, "wb") as out, open(directory / "keys.jsonl", "wb") as keys:
        for key, text in rows:
            cid = f"t-{key}"
            keys.write(orjson.dumps({"custom_id": cid, "key": [key], "shard": 0}) + b"\n")
            if key in lost:
                continue  # in the manifest but never sent: must come back as missing
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
            if endpoint == "/v1/embeddings":
                body = {"model": "emb", "input": text}
            elif endpoint == "/v1/responses":
                body = {"model": "m", "input": text}
            if json_format:
                body["response_format"] = {"type": "json_object"}
            out.write(
                orjson.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + b"\n"
            )
    with open(directory / "rejects.jsonl", "wb") as rej:
        for r in rejects:
            rej.write(orjson.dumps(r) + b"\n")
    data = shard.read_bytes()
    import hashlib

    manifest = Manifest(
        endpoint=endpoint,
        dialect="openai",
        key_columns=["ticket_id"],
        key_types=["integer"],
        shards=[
            Shard(
                index=0,
                path=shard.name,
                lines=data.count(b"\n"),
                bytes=len(data),
                fingerprint=hashlib.sha256(data).hexdigest(),
                endpoint=endpoint,
            )
        ],
        rows_written=len(rows),
        rows_rejected=len(rejects),
        keys_path="keys.jsonl",
        rejects_path="rejects.jsonl",
    )
    return Path(str(staging.write_manifest(str(directory), manifest).path))


def submit_and_wait(manifest_file: Path) -> dict[str, Any]:
    """Upload each shard, create its batch and wait for a terminal state; the submit XCom shape."""
    manifest = staging.read_manifest(str(manifest_file))
    hook = BatchApiHook()
    batches = []
    for shard in manifest.shards:
        file_id = hook.upload_file(str(manifest_file.parent / shard.path))
        batch = hook.create_batch(input_file_id=file_id, endpoint=manifest.endpoint)
        deadline = time.monotonic() + 60
        while not batch.is_terminal and time.monotonic() < deadline:
            time.sleep(0.1)
            batch = hook.get_batch(batch.id)
        assert batch.is_terminal, f"batch {batch.id} did not finish"
        batches.append({"shard": shard.index, "batch_id": batch.id, "input_file_id": file_id})
    return {
        "batch_ids": [b["batch_id"] for b in batches],
        "batches": batches,
        "manifest_path": str(manifest_file),
    }


@pytest.fixture
def server(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    handle = batch_server(dialect="openai", backend="echo")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", handle.connection_json())
    return handle


def merge(warehouse: Any, xcom: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    op = MergeBatchResultsOperator(
        task_id="merge", target_table="ticket results", conn_id=warehouse.conn_id, batches=xcom, **kwargs
    )
    return op.execute(context={})  # type: ignore[arg-type]


def test_merge_accounts_for_every_key(server: Any, warehouse: Any, tmp_path: Path) -> None:
    rows = [(i, f"ticket number {i}") for i in range(1, 9)]
    rejects = [
        {
            "row": 9,
            "key": [9],
            "custom_id": None,
            "code": "line_too_large",
            "reason": "over 1 MB",
            "column": None,
        }
    ]
    manifest = stage(tmp_path / "stage", rows, lost=[8], rejects=rejects)
    xcom = submit_and_wait(manifest)
    result = merge(warehouse, xcom, input_price_per_1m=1.0, output_price_per_1m=2.0)
    assert (
        result["counts"]["succeeded"] == 7
        and result["counts"]["missing"] == 1
        and result["counts"]["rejected"] == 1
    )
    assert result["rows_written"] == 9 and result["orphan_results"] == 0
    assert result["prompt_tokens"] > 0 and result["cost"] == pytest.approx(
        (result["prompt_tokens"] * 1.0 + result["completion_tokens"] * 2.0) / 1e6
    )
    q = warehouse.quote
    got = warehouse.rows(
        f"SELECT ticket_id, status, content, batch_id FROM {q('ticket results')} ORDER BY ticket_id"
    )
    assert [r[1] for r in got] == ["succeeded"] * 7 + ["missing", "rejected"]
    assert "ticket number 3" in got[2][2] and got[2][3] == xcom["batch_ids"][0]
    # Re-running the merge changes nothing and adds nothing.
    again = merge(warehouse, xcom)
    assert again["counts"] == result["counts"]
    assert warehouse.rows(f"SELECT COUNT(*) FROM {q('ticket results')}") == [(9,)]


def test_failed_lines_are_resubmitted_until_they_succeed(
    server: Any, sqlite_warehouse: Any, tmp_path: Path
) -> None:
    rows = [(i, f"question {i}") for i in range(1, 11)]
    manifest = stage(tmp_path / "stage", rows)
    server.set_faults(line_failure_rate=0.5)
    first = merge(sqlite_warehouse, submit_and_wait(manifest), resubmit_failed=True, max_attempts=2)
    failed = first["counts"]["failed"]
    assert failed > 0 and first["resubmit"] is True and first["resubmit_lines"] == failed
    retry_manifest = Path(first["resubmit_manifest_path"].removeprefix("file://"))
    assert retry_manifest.parent.name == "attempt-2"
    second_manifest = staging.read_manifest(str(retry_manifest))
    assert second_manifest.extra["attempt"] == 2 and second_manifest.shards[0].lines == failed
    lines = [orjson.loads(x) for x in (retry_manifest.parent / "shard-00000.jsonl").read_bytes().splitlines()]
    original = {
        orjson.loads(x)["custom_id"]: orjson.loads(x)
        for x in (tmp_path / "stage/shard-00000.jsonl").read_bytes().splitlines()
    }
    assert all(line == original[line["custom_id"]] for line in lines)  # unchanged lines and custom_ids

    server.set_faults(line_failure_rate=0.0)
    second = merge(sqlite_warehouse, submit_and_wait(retry_manifest), resubmit_failed=True, max_attempts=2)
    assert second["counts"]["succeeded"] == failed and second["resubmit"] is False and second["attempt"] == 2
    statuses = sqlite_warehouse.rows(
        f"SELECT status, COUNT(*) FROM {sqlite_warehouse.quote('ticket results')} GROUP BY status"
    )
    assert statuses == [("succeeded", 10)]


def test_expired_batch_marks_its_keys_expired(server: Any, duckdb_warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "stage", [(1, "a"), (2, "b"), (3, "c")])
    server.set_faults(expire_batches=True)
    result = merge(duckdb_warehouse, submit_and_wait(manifest))
    assert result["counts"]["expired"] == 3 and result["rows_written"] == 3


def test_structured_output_through_the_server(server: Any, pg_warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "stage", [(1, "alpha"), (2, "beta")], json_format=True)
    schema = {"type": "object", "properties": {"echo": {"type": "string"}}, "required": ["echo"]}
    result = merge(pg_warehouse, submit_and_wait(manifest), output_schema=schema)
    assert result["counts"]["succeeded"] == 2
    got = pg_warehouse.rows(f"SELECT ticket_id, echo FROM {pg_warehouse.quote('ticket results')} ORDER BY 1")
    assert got[0][0] == 1 and "alpha" in got[0][1]
    strict = {"type": "object", "properties": {"label": {"type": "integer"}}, "required": ["label"]}
    bad = MergeBatchResultsOperator(
        task_id="m2",
        target_table="strict",
        conn_id=pg_warehouse.conn_id,
        batches=submit_and_wait(manifest),
        output_schema=strict,
    ).execute(context={})  # type: ignore[arg-type]
    assert bad["counts"]["invalid_output"] == 2
    reasons = pg_warehouse.rows("SELECT error_message FROM strict")
    assert all("label" in r[0] for r in reasons)


def test_without_manifest_custom_id_is_the_key(server: Any, sqlite_warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "stage", [(1, "x"), (2, "y")])
    xcom = submit_and_wait(manifest)
    result = merge(sqlite_warehouse, xcom["batch_ids"])
    assert result["counts"]["succeeded"] == 2
    assert sqlite_warehouse.rows(
        f"SELECT custom_id FROM {sqlite_warehouse.quote('ticket results')} ORDER BY 1"
    ) == [("t-1",), ("t-2",)]


def test_batches_with_shards_reads_every_input_shape() -> None:
    assert batches_with_shards("b1") == [("b1", None)]
    assert batches_with_shards(["b1", "b2", "b1"]) == [("b1", None), ("b2", None)]
    assert batches_with_shards({"batches": [{"shard": 0, "batch_id": "b1"}], "batch_ids": ["b1"]}) == [
        ("b1", 0)
    ]
    event = {"status": "success", "batch_ids": ["b1"], "batches": [{"id": "b1", "state": "completed"}]}
    assert batches_with_shards(event) == [("b1", None)]
    assert batches_with_shards([{"batch_ids": ["a"]}, {"batch_ids": ["b"]}]) == [("a", None), ("b", None)]


def test_terminal_event_without_shards_uses_the_batch_metadata(
    server: Any, sqlite_warehouse: Any, tmp_path: Path
) -> None:
    manifest = stage(tmp_path / "stage", [(1, "a"), (2, "b")])
    server.set_faults(expire_batches=True)
    manifest_data = staging.read_manifest(str(manifest))
    hook = BatchApiHook()
    file_id = hook.upload_file(str(manifest.parent / manifest_data.shards[0].path))
    batch = hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT, metadata={SHARD_TAG: "0"})
    while not batch.is_terminal:
        time.sleep(0.1)
        batch = hook.get_batch(batch.id)
    event = {
        "status": "expired",
        "batch_ids": [batch.id],
        "batches": [batch.summary()],
        "message": "",
        "termination_reason": "",
    }
    result = merge(sqlite_warehouse, event, manifest_path=str(manifest))
    assert result["counts"]["expired"] == 2


def test_a_running_batch_is_not_merged(server: Any, sqlite_warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "stage", [(1, "a")])
    server.set_faults(stall_batches=True)
    hook = BatchApiHook()
    file_id = hook.upload_file(str(manifest.parent / "shard-00000.jsonl"))
    batch = hook.create_batch(input_file_id=file_id, endpoint=ENDPOINT)
    with pytest.raises(Exception, match="have not ended yet"):
        merge(sqlite_warehouse, [batch.id], manifest_path=str(manifest))


def test_batches_rendered_as_a_string_are_read() -> None:
    assert batches_with_shards("{'batch_ids': ['b1'], 'batches': [{'shard': 2, 'batch_id': 'b1'}]}") == [
        ("b1", 2)
    ]
    assert batches_with_shards("['b1', 'b2']") == [("b1", None), ("b2", None)]


def test_embeddings_and_responses_through_the_server(server: Any, warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "emb", [(1, "red shoe"), (2, "blue hat")], endpoint="/v1/embeddings")
    result = merge(warehouse, submit_and_wait(manifest))
    assert result["counts"]["succeeded"] == 2
    q = warehouse.quote
    rows = warehouse.rows(f"SELECT ticket_id, embedding, content FROM {q('ticket results')} ORDER BY 1")
    vector = rows[0][1] if isinstance(rows[0][1], list) else orjson.loads(rows[0][1])
    assert len(vector) == 16 and all(isinstance(v, float) for v in vector) and rows[0][2] is None

    manifest = stage(tmp_path / "resp", [(1, "hello there")], endpoint="/v1/responses")
    op = MergeBatchResultsOperator(
        task_id="m", target_table="responses", conn_id=warehouse.conn_id, batches=submit_and_wait(manifest)
    )
    assert op.execute(context={})["counts"]["succeeded"] == 1  # type: ignore[arg-type]
    content, reason, tokens = warehouse.rows(
        f"SELECT content, finish_reason, total_tokens FROM {q('responses')}"
    )[0]
    assert "hello there" in content and reason == "completed" and tokens > 0


def test_no_resubmission_after_the_last_attempt(server: Any, sqlite_warehouse: Any, tmp_path: Path) -> None:
    manifest = stage(tmp_path / "stage", [(i, f"q {i}") for i in range(1, 7)])
    server.set_faults(line_failure_rate=0.5)
    result = merge(sqlite_warehouse, submit_and_wait(manifest), resubmit_failed=True, max_attempts=1)
    assert result["counts"]["failed"] > 0 and result["resubmit"] is False
    assert result["unresubmitted"] == result["counts"]["failed"] and result["resubmit_manifest_path"] is None
    assert not (tmp_path / "stage" / "attempt-2").exists()


def test_batches_with_shards_reads_a_mapped_tasks_lazy_sequence() -> None:
    """A mapped submit's XCom is a lazy Sequence (not a list); every batch in it is read."""
    from collections.abc import Sequence

    from airflow_batch_provider.operators.merge import batches_with_shards

    class LazySequence(Sequence):
        def __init__(self, items: list) -> None:
            self._items = items

        def __getitem__(self, index):  # type: ignore[override]
            return self._items[index]

        def __len__(self) -> int:
            return len(self._items)

    value = LazySequence(
        [
            {"batch_ids": ["b0"], "batches": [{"shard": 0, "batch_id": "b0"}]},
            {"batch_ids": ["b1"], "batches": [{"shard": 1, "batch_id": "b1"}]},
        ]
    )
    assert batches_with_shards(value) == [("b0", 0), ("b1", 1)]


# ---- manifest_path given the build's XCom (issue #13 point 19) --------------------------------


def test_manifest_path_accepts_the_build_xcom(server: Any, sqlite_warehouse: Any, tmp_path: Path) -> None:
    from airflow_batch_provider.operators.build import manifest_xcom

    manifest_file = stage(tmp_path / "stage", [(1, "x"), (2, "y")], lost=[2])
    xcom = submit_and_wait(manifest_file)
    build_xcom = manifest_xcom(
        staging.read_manifest(str(manifest_file)), staging.resolve_path(str(manifest_file.parent))
    )
    # The dict itself, and its repr (a templated XCom rendered without native objects).
    for given in (build_xcom, str(build_xcom)):
        result = merge(sqlite_warehouse, xcom["batch_ids"], manifest_path=given)
        assert result["counts"]["succeeded"] == 1 and result["counts"]["missing"] == 1
    q = sqlite_warehouse.quote
    assert sqlite_warehouse.rows(f"SELECT ticket_id, status FROM {q('ticket results')} ORDER BY 1") == [
        (1, "succeeded"),
        (2, "missing"),
    ]


def test_manifest_path_given_something_else_names_what_to_pass(
    server: Any, sqlite_warehouse: Any, tmp_path: Path
) -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    manifest_file = stage(tmp_path / "stage", [(1, "x")])
    xcom = submit_and_wait(manifest_file)
    with pytest.raises(
        ConfigurationError, match=r"without 'manifest_path' or 'staging_path' .*build task's XCom"
    ):
        merge(sqlite_warehouse, xcom["batch_ids"], manifest_path={"shards": []})
    with pytest.raises(ConfigurationError, match="cannot use a int; pass the build task's XCom"):
        merge(sqlite_warehouse, xcom["batch_ids"], manifest_path=7)


# ---- corrupt result lines and absurd token counts (issue #13 point 20) ------------------------


def corrupt_output(server: Any, xcom: dict[str, Any]) -> str:
    """Damage the server's stored output file the way a vendor glitch would; returns its file id."""
    batch = BatchApiHook().get_batch(xcom["batch_ids"][0])
    assert batch.output_file_id
    path = Path(server.config.data_dir) / "files" / batch.output_file_id
    lines = {orjson.loads(raw)["custom_id"]: raw for raw in path.read_bytes().splitlines() if raw.strip()}
    assert sorted(lines) == [f"t-{i}" for i in range(1, 7)]
    fine = orjson.loads(lines["t-5"])
    fine["response"]["body"]["usage"] = {
        "prompt_tokens": -5,
        "completion_tokens": 10**12,
        "total_tokens": "many",
    }
    damaged = [
        lines["t-1"],
        lines["t-2"][: lines["t-2"].index(b'"response"') + 20],  # cut short; its custom_id is legible
        b"[1, 2]",  # not an object
        orjson.dumps({k: v for k, v in orjson.loads(lines["t-4"]).items() if k != "custom_id"}),
        orjson.dumps(fine),
        lines["t-6"],
        b'{"custom_id": "t-999", "response": {"status_',  # cut short, and no key of the manifest
    ]
    path.write_bytes(b"\n".join(damaged) + b"\n")
    return batch.output_file_id


def test_bad_result_lines_fail_the_merge_by_default(
    server: Any, sqlite_warehouse: Any, tmp_path: Path
) -> None:
    from airflow_batch_provider.exceptions import BatchApiResponseError

    xcom = submit_and_wait(stage(tmp_path / "stage", [(i, f"text {i}") for i in range(1, 7)]))
    file_id = corrupt_output(server, xcom)
    with pytest.raises(BatchApiResponseError, match=f"file '{file_id}' line 2 is not valid JSON"):
        merge(sqlite_warehouse, xcom)


def test_bad_result_lines_are_recorded_and_the_merge_goes_on(
    server: Any, warehouse: Any, tmp_path: Path
) -> None:
    xcom = submit_and_wait(stage(tmp_path / "stage", [(i, f"text {i}") for i in range(1, 7)]))
    file_id = corrupt_output(server, xcom)
    result = merge(warehouse, xcom, on_bad_result_line="record")
    # Every input row is accounted for: the legible bad line lands on its key, the others leave
    # their keys missing and are counted (the unknown custom_id with the orphans).
    assert result["counts"] == {
        "succeeded": 3,
        "failed": 0,
        "expired": 0,
        "cancelled": 0,
        "missing": 2,
        "rejected": 0,
        "invalid_output": 1,
    }
    assert result["rows_written"] == 6 and result["bad_result_lines"] == 4
    assert "t-999" in result["orphan_samples"]
    assert result["bad_token_counts"] == 1
    q = warehouse.quote
    got = {
        r[0]: r[1:]
        for r in warehouse.rows(
            f"SELECT ticket_id, status, error_code, error_message, prompt_tokens, completion_tokens, "
            f"total_tokens FROM {q('ticket results')}"
        )
    }
    assert got[2][:2] == ("invalid_output", "invalid_result_line")
    assert f"file '{file_id}' line 2 is not valid JSON" in got[2][2]
    assert got[3][0] == got[4][0] == "missing"
    assert got[5] == ("succeeded", None, None, None, None, None)
    assert got[1][0] == "succeeded" and got[1][3] > 0
    # The reasons (also logged as warnings) name the file and line.
    assert f"file '{file_id}' line 3 is not a JSON object" in result["bad_result_samples"]
    assert f"file '{file_id}' line 4: result line has no custom_id" in result["bad_result_samples"]
    assert "'prompt_tokens': -5" in result["bad_token_samples"][0]


def test_on_bad_result_line_is_checked() -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="on_bad_result_line must be one of fail, record"):
        MergeBatchResultsOperator(task_id="m", target_table="t", conn_id="c", on_bad_result_line="skip")


def test_a_doubleword_result_without_custom_id_is_counted_not_a_crash(
    sqlite_warehouse: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Doubleword's results endpoint may answer an item with "custom_id": null (a misbehaving
    # vendor, so a MockTransport stands in for it): the merge reports it as an orphan line.
    import httpx

    items = [
        {"id": "r1", "custom_id": "t-1", "response_body": _chat("one"), "error": None, "status": "completed"},
        {"id": "r2", "custom_id": None, "response_body": _chat("who?"), "error": None, "status": "completed"},
        {"id": "r3", "custom_id": "t-2", "response_body": _chat("two"), "error": None, "status": "completed"},
    ]

    def vendor(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/results"):
            skip = int(request.url.params["skip"])
            body = b"".join(orjson.dumps(i) + b"\n" for i in items[skip:])
            return httpx.Response(200, content=body, headers={"X-Incomplete": "false"})
        batch = {
            "id": "dw-1",
            "status": "completed",
            "request_counts": {"total": 3, "completed": 3, "failed": 0},
        }
        return httpx.Response(200, json=batch)

    class Merge(MergeBatchResultsOperator):
        def get_batch_hook(self) -> BatchApiHook:
            transport = httpx.MockTransport(vendor)
            return BatchApiHook(self.batch_conn_id, dialect="doubleword", transport=transport)

    monkeypatch.setenv(
        "AIRFLOW_CONN_BATCH_API_DEFAULT", '{"conn_type": "batch_api", "host": "http://vendor.test/v1"}'
    )
    manifest = stage(tmp_path / "stage", [(1, "a"), (2, "b"), (3, "c")])
    xcom = {"batches": [{"shard": 0, "batch_id": "dw-1"}], "manifest_path": str(manifest)}
    op = Merge(
        task_id="merge",
        target_table="dw results",
        conn_id=sqlite_warehouse.conn_id,
        batches=xcom,
        results_mode="results_endpoint",
    )
    result = op.execute(context={})  # type: ignore[arg-type]
    assert result["counts"]["succeeded"] == 2 and result["counts"]["missing"] == 1
    assert result["orphan_results"] == 1 and result["rows_written"] == 3


def _chat(text: str) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
    }


@pytest.mark.parametrize("kind", ["pg_warehouse", "duckdb_warehouse"])
def test_the_warehouse_parses_the_result_files_as_python_does(
    server: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    warehouse = request.getfixturevalue(kind)
    xcom = submit_and_wait(stage(tmp_path / "stage", [(i, f"text {i} ✓") for i in range(1, 7)]))
    corrupt_output(server, xcom)
    results, tables = [], []
    for parse_in in ("python", "database"):
        op = MergeBatchResultsOperator(
            task_id="m",
            target_table=f"by_{parse_in}",
            conn_id=warehouse.conn_id,
            batches=xcom,
            on_bad_result_line="record",
            parse_in=parse_in,
        )
        result = op.execute(context={})  # type: ignore[arg-type]
        assert result.pop("table") == f"by_{parse_in}"
        results.append(result)
        tables.append(
            warehouse.rows(
                "SELECT ticket_id, custom_id, status, content, finish_reason, model, prompt_tokens, "
                "completion_tokens, total_tokens, error_code, error_message, batch_id "
                f"FROM {warehouse.quote(f'by_{parse_in}')} ORDER BY 1"
            )
        )
    assert tables[0] == tables[1] and len(tables[0]) == 6
    assert results[0] == results[1] and results[0]["bad_result_lines"] == 4


def test_parse_in_is_checked() -> None:
    from airflow_batch_provider.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="parse_in must be one of auto, python, database"):
        MergeBatchResultsOperator(task_id="m", target_table="t", conn_id="c", parse_in="warehouse")


# ---- fallback_conn_id (issue #24 section 3) ---------------------------------------------------


def test_a_fallback_without_the_endpoint_fails_before_any_batch_is_read(
    sqlite_warehouse: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeroGPU runs chat completions only: an embeddings manifest cannot fall back to it; the
    merge says so by endpoint and vendor before reading a batch or writing a row."""
    extra = {"dialect": "zerogpu", "project": "p"}
    conn = {"conn_type": "batch_api", "host": "http://127.0.0.1:9/v1", "password": "k", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_ZERO_API", orjson.dumps(conn).decode())
    manifest = stage(tmp_path / "stage", [(1, "a")], endpoint="/v1/embeddings")
    xcom = {"batch_ids": ["batch_x"], "manifest_path": str(manifest)}
    with pytest.raises(
        ConfigurationError, match="endpoint '/v1/embeddings' is not supported by dialect 'zerogpu'"
    ):
        merge(sqlite_warehouse, xcom, resubmit_failed=True, fallback_conn_id="zero_api")
    assert not sqlite_warehouse.rows("SELECT name FROM sqlite_master WHERE name = 'ticket results'")


def test_fallback_needs_resubmission() -> None:
    with pytest.raises(ConfigurationError, match="fallback_conn_id and fallback_model need resubmit_failed"):
        MergeBatchResultsOperator(
            task_id="m", target_table="t", conn_id="w", batches="b", fallback_conn_id="other"
        ).execute(context={})  # type: ignore[arg-type]


def test_every_later_attempt_stays_on_the_fallback(
    server: Any, sqlite_warehouse: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 2 goes to the fallback, and so does attempt 3 (the first vendor is not tried
    again); without a fallback the next attempt goes to the merge's own connection."""
    manifest = stage(tmp_path / "stage", [(i, f"q {i}") for i in range(1, 9)])
    server.set_faults(line_failure_rate=0.5)
    plain = merge(sqlite_warehouse, submit_and_wait(manifest), resubmit_failed=True)
    assert plain["resubmit"] and plain["resubmit_conn_id"] == "batch_api_default"
    assert plain["resubmit_model"] is None
    # Here the "fallback" is the same server under a second connection id.
    monkeypatch.setenv("AIRFLOW_CONN_SECOND_API", os.environ["AIRFLOW_CONN_BATCH_API_DEFAULT"])
    fallback = {"resubmit_failed": True, "fallback_conn_id": "second_api", "fallback_model": "other-model"}
    second = merge(sqlite_warehouse, submit_and_wait(manifest), **fallback)
    retry = Path(second["resubmit_manifest_path"].removeprefix("file://"))
    third = merge(sqlite_warehouse, submit_and_wait(retry), batch_conn_id="second_api", **fallback)
    assert second["resubmit_conn_id"] == third["resubmit_conn_id"] == "second_api"
    attempt_3 = staging.read_manifest(third["resubmit_manifest_path"])
    assert attempt_3.extra["attempt"] == 3 and attempt_3.extra["batch_conn_id"] == "second_api"
    lines = [orjson.loads(x) for x in retry.parent.joinpath("shard-00000.jsonl").read_bytes().splitlines()]
    assert lines and {line["body"]["model"] for line in lines} == {"other-model"}


def test_a_job_model_fallback_takes_each_lines_model_or_the_fallback_model() -> None:
    """Mistral runs one model per job: resubmitted lines naming two models are taken (the
    attempt writes one shard per model), fallback_model rewrites them all, a line without a
    model is refused by name, and so is a custom_id over the vendor's limit."""
    from airflow_batch_provider.dialects import get_dialect
    from airflow_batch_provider.operators.merge import ResubmitTarget

    def line(custom_id: str, model: str) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT, "body": body}

    mixed = ResubmitTarget("fb", get_dialect("mistral"))
    mixed.take(line("a", "m-1"), "shard-00000.jsonl")
    mixed.take(line("b", "m-2"), "shard-00000.jsonl")
    no_model = line("c", "m")
    del no_model["body"]["model"]
    with pytest.raises(ConfigurationError, match="'c'.*body.model is missing and Mistral needs one model"):
        mixed.take(no_model, "shard-00000.jsonl")
    rewritten = ResubmitTarget("fb", get_dialect("mistral"), model="mistral-small")
    lines = [line("a", "m-1"), line("b", "m-2")]
    for obj in lines:
        rewritten.take(obj, "shard-00000.jsonl")
    assert [obj["body"]["model"] for obj in lines] == ["mistral-small", "mistral-small"]
    with pytest.raises(ConfigurationError, match="custom_id is longer than the 64 characters OpenAI"):
        ResubmitTarget("fb", get_dialect("openai")).take(line("x" * 65, "m"), "shard-00000.jsonl")
