"""Ids are URL path segments: refused when no vendor issues them, encoded as one segment otherwise.

At the wire, through a real socket (tests/fixtures/hostile.py records each raw request target):
an id from a user, a run's conf or a vendor answer never reaches a path outside its own segment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS, get_dialect
from airflow_batch_provider.exceptions import BatchApiResponseError, ConfigurationError, InvalidIdError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.ids import MAX_ID_CHARS, path_segment
from tests.fixtures.hook import SECRET, openai_batch
from tests.fixtures.hostile import HostileServer, reply

NO_RETRY = RetryPolicy(max_retries=0)

# Ids no vendor issues, each a way out of its path segment (or a way to confuse a server about it).
HOSTILE_IDS = [
    "../batches/batch_victim#",
    "../../admin/x",
    "..",
    ".",
    "batch_1/cancel",
    "batch_1?limit=1",
    "batch_1#frag",
    "%2e%2e",
    "batch\\..\\x",
    "batch 1",
    "batch_1\n",
    "batch_1\x00",
    "batch\u200b1",
    "",
    "b" * (MAX_ID_CHARS + 1),
]
PATH_METHODS = ("file_path", "file_content_path", "batch_path", "cancel_path", "results_path")


@pytest.fixture
def hook_for(batch_conn: Callable[..., str]) -> Callable[..., BatchApiHook]:
    def make(server: HostileServer, dialect: str = "openai") -> BatchApiHook:
        return BatchApiHook(
            batch_conn("ids", host=server.base_url, dialect=dialect), retry_policy=NO_RETRY, timeout=5.0
        )

    return make


# ---- one helper, used by every dialect's every path ---------------------------------------------


def _has_path(name: str, method: str) -> bool:
    """Whether a dialect builds this path at all (only some vendors have a results endpoint)."""
    try:
        getattr(get_dialect(name), method)("batch_1")
    except NotImplementedError:
        return False
    return True


# Every (dialect, path) pair the registry builds: a new dialect's paths are checked without a new test.
PATHS_BUILT = [
    (name, method) for name in sorted(DIALECTS) for method in PATH_METHODS if _has_path(name, method)
]


def test_every_dialect_builds_its_core_paths() -> None:
    # The pairs above leave out only results paths, so no dialect slips out of the next test.
    assert {(n, m) for n in DIALECTS for m in PATH_METHODS if m != "results_path"} <= set(PATHS_BUILT)


@pytest.mark.parametrize(("name", "method"), PATHS_BUILT)
def test_every_dialect_path_refuses_hostile_ids_and_encodes_the_rest(name: str, method: str) -> None:
    dialect = get_dialect(name)
    build = getattr(dialect, method)
    plain = build("batch_1")
    assert "batch_1" in plain
    for bad in HOSTILE_IDS:
        with pytest.raises(InvalidIdError, match="_id"):
            build(bad)
    # A legal but odd id stays one segment: every reserved character is percent-encoded.
    odd = build("b:1@x+y=z")
    assert odd == plain.replace("batch_1", "b%3A1%40x%2By%3Dz")


def test_path_segment_message_names_the_parameter_and_cuts_the_value() -> None:
    with pytest.raises(InvalidIdError) as info:
        path_segment("x/" + "y" * 5000, "output_file_id")
    text = str(info.value)
    assert text.startswith("output_file_id 'x/")
    assert "is 5,002 characters long (at most 256)" in text
    assert len(text) < 200
    assert isinstance(info.value, ConfigurationError)
    with pytest.raises(InvalidIdError, match="batch_id must be a string, got int"):
        path_segment(7, "batch_id")


# ---- at the wire ---------------------------------------------------------------------------------


async def test_delete_file_with_a_path_id_sends_nothing(
    hostile_server: Callable[[], HostileServer], hook_for: Callable[..., BatchApiHook]
) -> None:
    # Before: DELETE /v1/batches/batch_victim, with the key.
    api = hostile_server()
    api.route("/v1/batches/batch_victim", reply(200, {"deleted": True}))
    hook = hook_for(api)
    with pytest.raises(InvalidIdError, match="file_id '../batches/batch_victim#'"):
        hook.delete_file("../batches/batch_victim#")
    with pytest.raises(InvalidIdError, match="file_id"):
        await hook.adelete_file("../batches/batch_victim#")
    assert api.requests == []


@pytest.mark.parametrize("bad", ["../../admin/x", "..", "b1?x=1", "b1\r\nX-Injected: 1"])
async def test_no_hook_call_sends_a_hostile_id(
    hostile_server: Callable[[], HostileServer],
    hook_for: Callable[..., BatchApiHook],
    tmp_path: Path,
    bad: str,
) -> None:
    api = hostile_server()
    hook = hook_for(api)
    sync_calls: list[Callable[[], Any]] = [
        lambda: hook.get_batch(bad),
        lambda: hook.cancel_batch(bad),
        lambda: hook.get_file(bad),
        lambda: hook.delete_file(bad),
        lambda: hook.download_file(bad, tmp_path / "out.jsonl"),
        lambda: list(hook.iter_file_lines(bad)),
    ]
    for call in sync_calls:
        with pytest.raises(InvalidIdError):
            call()
    with pytest.raises(InvalidIdError):
        await hook.aget_batch(bad)
    with pytest.raises(InvalidIdError):
        await hook.acancel_batch(bad)
    with pytest.raises(InvalidIdError):
        await hook.aget_file(bad)
    with pytest.raises(InvalidIdError):
        await hook.adownload_file(bad, tmp_path / "out.jsonl")
    with pytest.raises(InvalidIdError):
        [line async for line in hook.aiter_file_lines(bad)]
    assert api.requests == []
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("dialect", ["openai", "xai"])
async def test_an_odd_legal_id_is_one_encoded_segment_on_the_wire(
    hostile_server: Callable[[], HostileServer], hook_for: Callable[..., BatchApiHook], dialect: str
) -> None:
    # ``:`` would end the segment for xAI's ``batches/{id}:cancel``; ``@`` and ``+`` are meaningful
    # to some servers. On the wire each is percent-encoded, inside the one segment.
    api = hostile_server()
    odd = "b:cancel@x+y"
    answer = {"batch_id": odd, "state": {"num_requests": 1}} if dialect == "xai" else openai_batch(odd)
    api.route("/v1/batches/b%3Acancel%40x%2By", reply(200, answer))
    hook = hook_for(api, dialect)
    assert hook.get_batch("b:cancel@x+y").id == odd
    await hook.aget_batch("b:cancel@x+y")
    assert [seen.target for seen in api.requests] == ["/v1/batches/b%3Acancel%40x%2By"] * 2


@pytest.mark.parametrize(
    "field", ["output_file_id", "error_file_id", "input_file_id", "id"], ids=lambda f: f"vendor-{f}"
)
async def test_a_vendor_answer_cannot_steer_the_key(
    hostile_server: Callable[[], HostileServer],
    hook_for: Callable[..., BatchApiHook],
    field: str,
) -> None:
    # A hostile vendor names a file id (or a batch id) that would lead a later call, with the
    # key, to another path: the answer is a typed response error for that batch.
    api = hostile_server()
    answer = openai_batch("b1", status="completed", **{field: "../../admin"})
    api.route("/v1/batches/b1", reply(200, answer))
    hook = hook_for(api)
    expected = rf"(?s)cannot read batch .*{field} '\.\./\.\./admin' contains a dot segment"
    with pytest.raises(BatchApiResponseError, match=expected):
        hook.get_batch("b1")
    with pytest.raises(BatchApiResponseError, match=expected):
        await hook.aget_batch("b1")
    assert [seen.path for seen in api.requests] == ["/v1/batches/b1"] * 2
    assert all(SECRET in seen.headers["authorization"] for seen in api.requests)


async def test_an_xai_answer_with_a_path_id_is_a_response_error(
    hostile_server: Callable[[], HostileServer], hook_for: Callable[..., BatchApiHook]
) -> None:
    api = hostile_server()
    api.route(
        "/v1/batches/b1",
        reply(200, {"batch_id": "b1", "input_file_id": "../../admin", "state": {"num_requests": 1}}),
    )
    with pytest.raises(BatchApiResponseError, match="(?s)cannot read batch b1.*input_file_id"):
        await hook_for(api, "xai").aget_batch("b1")


# ---- task entry: ids from ``dag_run.conf`` fail the task before any call -----------------------


@pytest.mark.parametrize("deferrable", [True, False], ids=["deferrable", "poke"])
@pytest.mark.parametrize("batch_ids", ["b1, ../../admin/x", "['b1', 'b2#']", {"batch_ids": ["b1", "b 2"]}])
def test_sensor_refuses_hostile_batch_ids_before_any_call(
    hostile_server: Callable[[], HostileServer],
    batch_conn: Callable[..., str],
    task_context: Callable[..., dict[str, Any]],
    deferrable: bool,
    batch_ids: Any,
) -> None:
    from airflow_batch_provider.sensors.batch import BatchSensor

    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, openai_batch("b1", status="completed")))
    conn_id = batch_conn("ids", host=api.base_url)
    sensor = BatchSensor(
        task_id="wait", batch_ids=batch_ids, batch_conn_id=conn_id, deferrable=deferrable, timeout=5
    )
    ctx = task_context(task_id="wait")
    with pytest.raises(InvalidIdError, match="batch_ids"):
        sensor.execute(ctx)
    assert api.requests == []
    # Nothing was recorded for the task's links either.
    assert ctx["ti"].xcom == {}


def test_trigger_and_merge_refuse_hostile_batch_ids() -> None:
    from airflow_batch_provider.operators.merge import batches_with_shards
    from airflow_batch_provider.triggers.batch import BatchTrigger

    with pytest.raises(InvalidIdError, match="batch_ids '../../admin/x'"):
        BatchTrigger(batch_ids=["b1", "../../admin/x"])
    for value in ("../../admin/x", ["b1", ".."], {"batch_ids": ["b#1"]}, {"batches": [{"batch_id": "a/b"}]}):
        with pytest.raises(InvalidIdError, match="batches"):
            batches_with_shards(value)
    assert batches_with_shards({"batch_ids": ["b1", "b2"]}) == [("b1", None), ("b2", None)]


async def test_an_upload_answer_with_a_path_file_id_is_a_response_error(
    hostile_server: Callable[[], HostileServer], hook_for: Callable[..., BatchApiHook], tmp_path: Path
) -> None:
    # The uploaded file's id is used later (get, delete after a failed create) with the key.
    api = hostile_server()
    api.route("POST /v1/files", reply(200, {"id": "../batches/batch_victim", "object": "file"}))
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"custom_id": "a"}\n')
    hook = hook_for(api)
    with pytest.raises(BatchApiResponseError, match="file upload answer: its id contains a dot segment"):
        hook.upload_file(source)
    with pytest.raises(BatchApiResponseError, match="file upload answer: its id contains a dot segment"):
        await hook.aupload_file(source)
    assert [seen.path for seen in api.requests] == ["/v1/files"] * 2
