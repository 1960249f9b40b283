"""The vendor contract's submit seams: encoded upload copies, the model on the job, unsupported features.

A test dialect (OpenAI's wire, but lines encoded and the model on the job) stands for any vendor
whose request shape differs from the canonical one, so these tests hold whatever vendor comes next.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider import dialects
from airflow_batch_provider.dialects import OpenAIDialect, get_dialect
from airflow_batch_provider.exceptions import ConfigurationError, JsonlValidationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.upload_lines import ShardEncoder, needs_pass
from tests.fixtures.airflow import write_batch_jsonl


class JobModelDialect(OpenAIDialect):
    """OpenAI's wire with a vendor-shaped line ``{custom_id, request}`` and the model on the job."""

    name = "jobmodel-test"
    model_placement = "job"
    encodes_lines = True

    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        body = canonical.get("body") or {}
        return "logprobs is not supported by JobModel" if "logprobs" in body else None

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        body = {k: v for k, v in canonical["body"].items() if k != "model"}
        return {"custom_id": canonical["custom_id"], "request": body}

    def create_batch_body(self, **kwargs: Any) -> dict[str, Any]:
        model = kwargs.pop("model", None)
        return {**super().create_batch_body(**kwargs), "model": model}


@pytest.fixture
def job_dialect(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(dialects.DIALECTS, JobModelDialect.name, JobModelDialect)
    yield


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def test_openai_shape_uploads_the_staged_file_without_a_pass() -> None:
    # Zero cost for today's dialects: no line is read unless a model override asks for it.
    for name in ("openai", "doubleword", "zerogpu", "xai"):
        assert needs_pass(get_dialect(name), None) is False
        assert needs_pass(get_dialect(name), "m") is True
    assert needs_pass(JobModelDialect(), None) is True


def test_encoder_encodes_every_line_and_learns_the_one_model(tmp_path: Path) -> None:
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3, model="m-1")
    encoder = ShardEncoder(JobModelDialect(), where="in.jsonl")
    out = b"".join(encoder.lines(io.BytesIO(source.read_bytes())))
    lines = [orjson.loads(line) for line in out.splitlines()]
    assert [line["custom_id"] for line in lines] == ["c0", "c1", "c2"]
    assert all(set(line) == {"custom_id", "request"} and "model" not in line["request"] for line in lines)
    assert encoder.job_model == "m-1"
    # An override is the one model of the job, whatever the lines said.
    override = ShardEncoder(JobModelDialect(), where="in.jsonl", model="m-2")
    assert override.drain(io.BytesIO(source.read_bytes())) == "m-2"


def test_encoder_refuses_a_second_model_naming_both_lines(tmp_path: Path) -> None:
    source = write_batch_jsonl(tmp_path / "in.jsonl", 3, model="m-1")
    lines = _lines(source)
    lines[2]["body"]["model"] = "m-9"
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    with pytest.raises(
        JsonlValidationError, match=r"in.jsonl line 3: body.model 'm-9' differs from 'm-1' on line 1"
    ):
        ShardEncoder(JobModelDialect(), where="in.jsonl").drain(io.BytesIO(data))


def test_encoder_refuses_a_line_without_a_model() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    with pytest.raises(JsonlValidationError, match=r"line 1: body.model is missing; dialect 'jobmodel-test'"):
        ShardEncoder(JobModelDialect(), where="f").drain(io.BytesIO(orjson.dumps(line) + b"\n"))


def test_hand_made_file_with_an_unsupported_feature_fails_before_any_upload(
    job_dialect: None, batch_server: Any, monkeypatch: pytest.MonkeyPatch, task_context: Any, tmp_path: Path
) -> None:
    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", 4)
    lines = _lines(source)
    lines[1]["body"]["logprobs"] = True
    source.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    op = SubmitBatchOperator(task_id="submit", source=str(source), dialect=JobModelDialect.name)
    with pytest.raises(JsonlValidationError, match=r"line 2: logprobs is not supported by JobModel"):
        op.execute(task_context())
    assert server.stats()["counters"].get("files_uploaded", 0) == 0


def test_submit_uploads_an_encoded_copy_and_sends_the_model_on_the_create(
    job_dialect: None, batch_server: Any, monkeypatch: pytest.MonkeyPatch, task_context: Any, tmp_path: Path
) -> None:
    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", 5, model="m-7")
    staged = source.read_bytes()
    sent: list[dict[str, Any]] = []
    real = BatchApiHook.create_batch

    def spy(self: BatchApiHook, **kwargs: Any) -> Any:
        sent.append(kwargs)
        return real(self, **kwargs)

    monkeypatch.setattr(BatchApiHook, "create_batch", spy)
    result = SubmitBatchOperator(task_id="submit", source=str(source), dialect=JobModelDialect.name).execute(
        task_context()
    )
    record = result["batches"][0]
    assert [call["model"] for call in sent] == ["m-7"]
    uploaded = list(BatchApiHook(dialect=JobModelDialect.name).iter_file_lines(record["input_file_id"]))
    expected = []
    for line in _lines(source):
        del line["body"]["model"]
        expected.append({"custom_id": line["custom_id"], "request": line["body"]})
    assert uploaded == expected
    # Staging keeps the canonical line, and the fingerprint is the canonical file's.
    assert source.read_bytes() == staged
    assert record["fingerprint"] == hashlib.sha256(staged).hexdigest()


def test_a_retry_reusing_the_upload_still_names_the_model(
    job_dialect: None, batch_server: Any, monkeypatch: pytest.MonkeyPatch, task_context: Any, tmp_path: Path
) -> None:
    from airflow_batch_provider.staging import resolve_path
    from airflow_batch_provider.submission import StateStore, SubmitState

    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", 2, model="m-3")
    real_create = BatchApiHook.create_batch
    models: list[Any] = []

    def fail_once(self: BatchApiHook, **kwargs: Any) -> Any:
        models.append(kwargs.get("model"))
        if len(models) == 1:
            raise ConfigurationError("worker died before the create")
        return real_create(self, **kwargs)

    monkeypatch.setattr(BatchApiHook, "create_batch", fail_once)
    op = SubmitBatchOperator(task_id="submit", source=str(source), dialect=JobModelDialect.name)
    with pytest.raises(ConfigurationError):
        op.execute(task_context())
    # The intent recorded the upload and its model; drop the model to take the old-record path too.
    store = StateStore(resolve_path(tmp_path / "submit-state"))
    (state_file,) = (tmp_path / "submit-state").glob("*.json")
    state = SubmitState.model_validate_json(state_file.read_bytes())
    assert state.model == "m-3"
    store.write(state.model_copy(update={"model": None}))
    op.execute(task_context())
    assert models == ["m-3", "m-3"]
    assert server.stats()["counters"]["files_uploaded"] == 1


def test_create_of_a_job_model_dialect_without_a_model_is_refused(
    job_dialect: None, batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="openai")
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    hook = BatchApiHook(dialect=JobModelDialect.name)
    with pytest.raises(ConfigurationError, match="takes the model on the batch"):
        hook.create_batch(input_file_id="file-1", endpoint="/v1/chat/completions")


# ---- inline submission: the create body streamed from the encoded shard -----------------------


class TinyInlineDialect(dialects.AnthropicDialect):
    """Anthropic's inline create with limits small enough to pass in a test."""

    name = "tiny-inline-test"
    limits = dialects.Limits(max_lines=3, max_file_bytes=2000, max_line_bytes=2000)


def chat_lines(count: int, text: str = "hi") -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "m", "messages": [{"role": "user", "content": f"{text} {i}"}]},
            }
        )
        + b"\n"
        for i in range(count)
    )


def test_inline_body_is_the_encoded_requests_as_one_json_object() -> None:
    from airflow_batch_provider.upload_lines import write_inline_body

    dialect = get_dialect("anthropic")
    out = io.BytesIO()
    encoder = ShardEncoder(dialect, where="shard", defaults={"max_tokens": 9})
    size, count = write_inline_body(encoder, io.BytesIO(chat_lines(3)), out, {})
    body = orjson.loads(out.getvalue())
    assert (size, count) == (len(out.getvalue()), 3)
    assert list(body) == ["requests"]
    assert [r["custom_id"] for r in body["requests"]] == ["r0", "r1", "r2"]
    assert body["requests"][1]["params"] == {
        "model": "m",
        "max_tokens": 9,
        "messages": [{"role": "user", "content": "hi 1"}],
    }
    # Other create fields a dialect names go before the requests.
    out = io.BytesIO()
    write_inline_body(
        ShardEncoder(dialect, where="s", defaults={"max_tokens": 9}), io.BytesIO(chat_lines(1)), out, {"a": 1}
    )
    assert list(orjson.loads(out.getvalue())) == ["a", "requests"]


@pytest.mark.parametrize(("lines", "text", "what"), [(4, "hi", "4 requests"), (2, "x" * 1200, "bytes")])
def test_inline_body_past_the_dialects_limit_fails_before_anything_is_sent(
    lines: int, text: str, what: str
) -> None:
    from airflow_batch_provider.upload_lines import write_inline_body

    encoder = ShardEncoder(TinyInlineDialect(), where="shard-7", defaults={"max_tokens": 9})
    with pytest.raises(JsonlValidationError, match=r"shard-7: more than 3 requests or 2,000 bytes"):
        write_inline_body(encoder, io.BytesIO(chat_lines(lines, text)), io.BytesIO(), {})


def test_inline_body_of_a_large_shard_is_written_in_flat_memory(tmp_path: Path) -> None:
    import tracemalloc

    from airflow_batch_provider.upload_lines import write_inline_body

    shard = tmp_path / "shard.jsonl"
    with shard.open("wb") as handle:
        for _ in range(20):
            handle.write(chat_lines(1000, "x" * 1000))  # ~22 MB of canonical lines
    encoder = ShardEncoder(get_dialect("anthropic"), where="shard", defaults={"max_tokens": 9})
    tracemalloc.start()
    try:
        with shard.open("rb") as src, (tmp_path / "body.json").open("wb") as out:
            size, count = write_inline_body(encoder, src, out, {})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 20_000 and size == (tmp_path / "body.json").stat().st_size > 20 << 20
    # One line at a time: the peak is a small fraction of the body, never the body itself.
    assert peak < 4 << 20, f"peak {peak:,} bytes"
