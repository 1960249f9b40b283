"""A result file whose lines repeat a key, served by a real misbehaving server
(tests/fixtures/hostile.py): the hook reads such a line as unreadable, through the sync and the
async client, naming the file, the line and the key; with ``on_bad_line="fail"`` it raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.retry import RetryPolicy
from tests.fixtures.hook import openai_batch
from tests.fixtures.hostile import HostileServer, reply

ANSWER = b'{"choices": [{"message": {"content": "yes"}}]}'
OUTPUT = b"\n".join(
    [
        b'{"custom_id": "good", "response": {"status_code": 200, "body": ' + ANSWER + b'}, "error": null}',
        # A server (or anything between) that repeats custom_id: orjson reads the last, DuckDB the first.
        b'{"custom_id": "victim", "custom_id": "other", "response": {"status_code": 200, "body": '
        + ANSWER
        + b"}}",
        # The status repeated inside the response, the second spelled with an escape.
        b'{"custom_id": "status", "response": {"status_code": 500, "status\\u005fcode": 200, "body": '
        + ANSWER
        + b"}}",
        # A quote spelled \u0022 alone is no repeat.
        b'{"custom_id": "quoted", "response": {"status_code": 200, "body": {"choices": [{"message": '
        b'{"content": "\\u0022hi\\u0022"}}]}}}',
    ]
)


@pytest.fixture
def served(hostile_server: Callable[[], HostileServer], batch_conn: Callable[..., str]) -> BatchApiHook:
    api = hostile_server()
    api.route("/v1/files/file-out/content", reply(200, OUTPUT + b"\n"))
    api.route("/v1/batches/b1", reply(200, openai_batch("b1", "completed", output_file_id="file-out")))
    return BatchApiHook(batch_conn("hostile", host=api.base_url), retry_policy=RetryPolicy(max_retries=0))


async def test_a_line_repeating_a_key_is_unreadable_naming_the_line_and_the_key(served: BatchApiHook) -> None:
    sync = list(served.iter_results("b1", on_bad_line="record"))
    lines = [line async for line in served.aiter_results("b1", on_bad_line="record")]
    await served.aclose()
    served.close()
    assert [(r.custom_id, r.ok, r.error and r.error.code, r.error and r.error.message) for r in lines] == [
        (r.custom_id, r.ok, r.error and r.error.code, r.error and r.error.message) for r in sync
    ]
    assert [(line.custom_id, line.ok) for line in lines] == [
        ("good", True),
        ("victim", False),
        ("status", False),
        ("quoted", True),
    ]
    assert lines[1].error is not None and lines[1].error.code == "invalid_result_line"
    assert lines[1].error.message == "file 'file-out' line 2 repeats the key 'custom_id'"
    assert (
        lines[2].error is not None
        and lines[2].error.message == "file 'file-out' line 3 repeats the key 'status_code'"
    )


def test_with_on_bad_line_fail_the_read_stops_at_the_line(served: BatchApiHook) -> None:
    with pytest.raises(BatchApiResponseError, match=r"file 'file-out' line 2 repeats the key 'custom_id'"):
        list(served.iter_results("b1"))
    served.close()
