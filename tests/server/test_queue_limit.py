"""The server's enqueued-token limit per model (``max_enqueued_tokens``), driven by the ``openai`` SDK.

Both of the vendors' forms: OpenAI's (the batch is created, then fails in validation with
``errors.data[].code == "token_limit_exceeded"``) and Azure's refused create (a 400 with that code).
Only live batches of the same model hold tokens; a refused or failed one holds none.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.estimate import resolve_counter
from airflow_batch_provider.server import options
from airflow_batch_provider.server.queue import count_file, enqueued
from tests.server.helpers import TERMINAL, chat_line, jsonl

LINES = 5


def _tokens(model: str = "gpt-test") -> int:
    """The input tokens of a file of LINES chat lines, as the build counts them."""
    counter = resolve_counter("auto", get_dialect("openai"), model)
    assert counter is not None
    return sum(counter(chat_line(i, model=model)["body"]) for i in range(LINES))


def _file(client: openai.OpenAI, tmp_path: Path, model: str = "gpt-test") -> tuple[str, int]:
    """An uploaded file of LINES chat lines and its tokens."""
    path = tmp_path / f"in-{model}.jsonl"
    path.write_bytes(jsonl(chat_line(i, model=model) for i in range(LINES)))
    return client.files.create(file=path.open("rb"), purpose="batch").id, _tokens(model)


def _create(client: openai.OpenAI, file_id: str, stall: bool = False) -> Any:
    return client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers={"X-Batch-Fault": "stall"} if stall else None,
    )


def _settle(client: openai.OpenAI, batch_id: str, until: frozenset[str] | set[str] = TERMINAL) -> Any:
    deadline = time.monotonic() + 30
    batch = client.batches.retrieve(batch_id)
    while batch.status not in until:
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
        batch = client.batches.retrieve(batch_id)
    return batch


def test_openai_form_a_batch_over_the_limit_is_created_then_failed(batch_server: Any, tmp_path: Path) -> None:
    tokens = _tokens()
    server = batch_server(max_enqueued_tokens=tokens * 2 - 1)  # one such batch fits, two do not
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0)
    file_id, _ = _file(client, tmp_path)
    held = _create(client, file_id, stall=True)  # fits: holds its tokens while stalled
    over = _settle(client, _create(client, file_id).id)
    assert over.status == "failed" and over.errors is not None
    error = over.errors.data[0]
    assert error.code == "token_limit_exceeded"
    assert "Enqueued token limit reached for gpt-test" in (error.message or "")
    # Another model has its own queue.
    other_id, _ = _file(client, tmp_path, model="gpt-other")
    assert _settle(client, _create(client, other_id).id).status == "completed"
    # Once the held batch finishes, the same file fits again: a failed batch held nothing.
    server.force(held.id, "complete")
    _settle(client, held.id)
    assert _settle(client, _create(client, file_id).id).status == "completed"
    counters = server.stats()["counters"]
    assert counters["enqueued_limit_failed"] == 1
    assert counters["enqueued_tokens_peak"] == tokens


def test_refuse_form_answers_the_create_with_token_limit_exceeded(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(max_enqueued_tokens=1, enqueued_limit_form="refuse")
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0)
    file_id, tokens = _file(client, tmp_path)
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, file_id)
    assert refused.value.code == "token_limit_exceeded"
    assert f"this batch {tokens:,}" in refused.value.message
    assert client.batches.list().data == []  # nothing created
    assert server.stats()["counters"]["enqueued_limit_refused"] == 1


def test_the_server_counts_a_file_as_the_build_does(tmp_path: Path) -> None:
    lines = [chat_line(i, model="gpt-x") for i in range(LINES)]
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines) + b"\nnot json\n")
    counter = resolve_counter("auto", get_dialect("openai"), "gpt-x")
    assert counter is not None
    assert count_file(path, "openai", None) == (sum(counter(line["body"]) for line in lines), "gpt-x")
    # The create's model (a job-model vendor) wins over the lines'.
    assert count_file(path, "openai", "job-model")[1] == "job-model"


def test_only_live_batches_of_the_model_hold_tokens() -> None:
    live = [
        {"status": "validating", "queue_model": "m", "enqueued_tokens": 5},
        {"status": "in_progress", "queue_model": "m", "enqueued_tokens": 7},
        {"status": "finalizing", "queue_model": "m", "enqueued_tokens": 11},
        {"status": "completed", "queue_model": "m", "enqueued_tokens": 100},
        {"status": "in_progress", "queue_model": "other", "enqueued_tokens": 100},
        {"status": "in_progress", "queue_model": "m"},  # created before the limit was set
    ]
    assert enqueued(live, "m") == 23
    assert enqueued([orjson.loads(orjson.dumps(r)) for r in live], "other") == 100


def test_cli_flags_set_the_limit_and_its_form(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args(
        ["--data-dir", str(tmp_path), "--max-enqueued-tokens", "90000", "--enqueued-limit-form", "refuse"]
    )
    config = options.config_from_args(args)
    assert config.max_enqueued_tokens == 90000 and config.limit_form() == "refuse"
    default = options.config_from_args(parser.parse_args(["--data-dir", str(tmp_path), "--dialect", "azure"]))
    assert default.max_enqueued_tokens is None and default.limit_form() == "refuse"
    assert options.config_from_args(parser.parse_args(["--data-dir", str(tmp_path)])).limit_form() == "fail"


def test_enqueued_tokens_survive_a_restart(batch_server: Any, tmp_path: Path) -> None:
    server = batch_server(max_enqueued_tokens=_tokens() * 2 - 1, enqueued_limit_form="refuse")
    client = openai.OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0)
    file_id, _ = _file(client, tmp_path)
    held = _create(client, file_id, stall=True)
    server.restart()  # the live batch resumes with the tokens it holds
    with pytest.raises(openai.BadRequestError, match="Enqueued token limit reached"):
        _create(client, file_id)
    server.force(held.id, "complete")
    _settle(client, held.id)
    assert _settle(client, _create(client, file_id).id).status == "completed"
