"""A Mistral API that misbehaves: a listing that ignores its metadata filter or never ends, job objects
that cannot be read. The orphan lookup still adopts only its own job, and nothing reads as success."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.hooks.batch import BatchApiHook
from tests.fixtures.hook import FAST
from tests.fixtures.hostile import Exchange, HostileServer, reply

KEY = "abp-0123456789abcdef01234567-s00000"


def job(job_id: str, key: str, input_file: str = "file-ours", status: str = "RUNNING", **fields: Any) -> dict:
    return {
        "id": job_id,
        "object": "batch",
        "input_files": [input_file],
        "metadata": {"airflow_batch_key": key},
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "errors": [],
        "status": status,
        "created_at": 1_736_380_000 + int(job_id.rsplit("-", 1)[-1]),
        "total_requests": 2,
        "completed_requests": 0,
        "succeeded_requests": 0,
        "failed_requests": 0,
        **fields,
    }


@pytest.fixture
def mistral_hook(batch_conn: Callable[..., str]) -> Callable[[HostileServer], BatchApiHook]:
    def make(server: HostileServer) -> BatchApiHook:
        return BatchApiHook(
            batch_conn("hostile_mistral", host=server.base_url, dialect="mistral"), retry_policy=FAST
        )

    return make


def query(ex: Exchange) -> dict[str, list[str]]:
    return parse_qs(urlsplit(ex.request.target).query)


async def test_a_listing_that_ignores_the_metadata_filter_still_adopts_only_our_job(
    hostile_server: Callable[[], HostileServer], mistral_hook: Callable[[HostileServer], BatchApiHook]
) -> None:
    # Newest first: another run's job, our job made from another file, then ours.
    jobs = [job("j-3", "another-run"), job("j-2", KEY, input_file="file-other"), job("j-1", KEY)]
    api = hostile_server()
    api.route("GET /v1/batch/jobs", reply(200, {"object": "list", "data": jobs, "total": 3}))
    hook = mistral_hook(api)
    assert hook.find_created_batch({"airflow_batch_key": KEY}, input_file_id="file-ours").id == "j-1"
    found = await hook.afind_created_batch({"airflow_batch_key": KEY}, input_file_id="file-ours")
    assert found is not None and found.id == "j-1"
    # Both lookups asked the listing for the filter (one query parameter per pair).
    asked = [parse_qs(urlsplit(seen.target).query) for seen in api.seen("/v1/batch/jobs")]
    assert [q["airflow_batch_key"] for q in asked] == [[KEY], [KEY]]
    await hook.aclose()
    hook.close()


def test_a_listing_whose_total_never_comes_stops_at_the_lookup_bound(
    hostile_server: Callable[[], HostileServer], mistral_hook: Callable[[HostileServer], BatchApiHook]
) -> None:
    # Every page is full and the total is a billion: the lookup reads its 1,000 newest, no more.
    def endless(ex: Exchange) -> None:
        page = int(query(ex)["page"][0])
        size = int(query(ex)["page_size"][0])
        data = [job(f"j-{page * size + i}", "another-run") for i in range(size)]
        ex.respond(200, {"object": "list", "data": data, "total": 10**9})

    api = hostile_server()
    api.route("GET /v1/batch/jobs", endless)
    hook = mistral_hook(api)
    assert hook.find_created_batch({"airflow_batch_key": KEY}) is None
    pages = [
        int(query_of["page"][0]) for query_of in (parse_qs(urlsplit(s.target).query) for s in api.requests)
    ]
    # 10 pages of 100 make the bound; the listing cursor asks for one page more before it sees the
    # bound is met (hooks/results.Pages, shared by every dialect): 11 requests, not a billion.
    assert pages == list(range(11))
    hook.close()


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (job("j-1", KEY, status="PAUSED"), UnknownBatchStatusError, "unknown status 'PAUSED'"),
        ({**job("j-1", KEY), "status": None}, UnknownBatchStatusError, "unknown status None"),
        (job("j-1", KEY, total_requests="many"), BatchApiResponseError, "cannot read batch j-1"),
        ({"object": "batch", "status": "SUCCESS"}, BatchApiResponseError, "has no id"),
    ],
)
async def test_an_unreadable_job_is_a_typed_error_never_success(
    hostile_server: Callable[[], HostileServer],
    mistral_hook: Callable[[HostileServer], BatchApiHook],
    answer: dict,
    error: type[Exception],
    match: str,
) -> None:
    api = hostile_server()
    api.route("GET /v1/batch/jobs/j-1", reply(200, answer))
    hook = mistral_hook(api)
    with pytest.raises(error, match=match):
        hook.get_batch("j-1")
    with pytest.raises(error, match=match):
        await hook.aget_batch("j-1")
    await hook.aclose()
    hook.close()
