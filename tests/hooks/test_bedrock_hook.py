"""The Bedrock connection's credentials: read through the amazon provider's ``aws`` connection
(``aws_conn_id``), signing both clients' calls with SigV4 that ``serve --dialect bedrock`` checks;
a wrong secret is an auth error that never shows the secret."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest

from airflow_batch_provider.exceptions import BatchApiAuthError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.credentials import AwsCredentials
from airflow_batch_provider.hooks.objects import plain_uri
from airflow_batch_provider.hooks.retry import RetryPolicy
from tests.fixtures.server import AWS_EXTRA, AWS_KEY_ID

SECRET = "bedrock-hook-secret-123456"
FAST = RetryPolicy(max_retries=1, backoff_initial=0.001, backoff_max=0.002)


def connect(server: Any, monkeypatch: pytest.MonkeyPatch, secret: str) -> BatchApiHook:
    """A batch connection with no keys of its own, signing with the aws connection ``abp_signer``."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_ABP_SIGNER",
        json.dumps(
            {
                "conn_type": "aws",
                "login": AWS_KEY_ID,
                "password": secret,
                "extra": {"region_name": "us-east-1"},
            }
        ),
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_BEDROCK_VIA_AWS",
        json.dumps(
            {
                "conn_type": "batch_api",
                "host": server.base_url,
                "extra": {"dialect": "bedrock", "aws_conn_id": "abp_signer", **AWS_EXTRA},
            }
        ),
    )
    return BatchApiHook("bedrock_via_aws", retry_policy=FAST)


def test_the_aws_connection_signs_sync_calls(batch_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = batch_server(dialect="bedrock", api_key=SECRET)
    hook = connect(server, monkeypatch, SECRET)
    credentials = hook.get_settings().auth.credentials  # type: ignore[union-attr]
    assert isinstance(credentials, AwsCredentials) and credentials.aws_conn_id == "abp_signer"
    assert list(hook.list_batches()) == []
    ok, message = hook.test_connection()
    assert ok, message
    # The secret read from the aws connection is redacted like a key.
    assert SECRET in hook.get_settings().secrets


async def test_the_aws_connection_signs_async_calls(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="bedrock", api_key=SECRET)
    hook = connect(server, monkeypatch, SECRET)
    async with hook:
        assert [b async for b in hook.alist_batches()] == []


def test_a_wrong_secret_is_refused_without_showing_it(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="bedrock", api_key=SECRET)
    wrong = "wrong-secret-987654321"
    hook = connect(server, monkeypatch, wrong)
    with pytest.raises(BatchApiAuthError) as refused:
        list(hook.list_batches())
    assert refused.value.status_code == 403 and wrong not in str(refused.value)
    ok, message = hook.test_connection()
    assert not ok and "authenticated: NO" in message and wrong not in message


class SeenScopes(httpx.HTTPTransport):
    """Sends every request; records each signature's credential scope (``<day>/<region>/...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        scope = request.headers["authorization"].split("Credential=", 1)[1].split(",", 1)[0]
        self.regions.append(scope.split("/")[2])
        return super().handle_request(request)


def regional(monkeypatch: pytest.MonkeyPatch, host: str | None, **extra: Any) -> None:
    """A batch connection ``bedrock_regional`` signing with the aws connection ``abp_eu``
    (region eu-west-1), with ``extra`` on top of the usual extras less their region."""
    monkeypatch.setenv(
        "AIRFLOW_CONN_ABP_EU",
        json.dumps(
            {
                "conn_type": "aws",
                "login": AWS_KEY_ID,
                "password": SECRET,
                "extra": {"region_name": "eu-west-1"},
            }
        ),
    )
    base = {k: v for k, v in AWS_EXTRA.items() if k != "region_name"}
    conn: dict[str, Any] = {
        "conn_type": "batch_api",
        "extra": {"dialect": "bedrock", "aws_conn_id": "abp_eu", **base, **extra},
    }
    if host:
        conn["host"] = host
    monkeypatch.setenv("AIRFLOW_CONN_BEDROCK_REGIONAL", json.dumps(conn))


async def test_the_region_is_the_aws_connections_unless_the_batch_connection_names_one(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No region on the batch connection: the aws connection's, for the endpoint and the signature.
    regional(monkeypatch, None)
    for settings in (
        BatchApiHook("bedrock_regional").get_settings(),
        await BatchApiHook("bedrock_regional").aget_settings(),
    ):
        assert settings.dialect.region == "eu-west-1"  # type: ignore[attr-defined]
        assert settings.base_url == "https://bedrock.eu-west-1.amazonaws.com"
    server = batch_server(dialect="bedrock", api_key=SECRET)
    regional(monkeypatch, server.base_url)
    seen = SeenScopes()
    assert list(BatchApiHook("bedrock_regional", retry_policy=FAST, transport=seen).list_batches()) == []
    assert seen.regions == ["eu-west-1"]
    # The batch connection's own region_name wins over the aws connection's.
    regional(monkeypatch, None, region_name="ap-southeast-2")
    settings = BatchApiHook("bedrock_regional").get_settings()
    assert settings.base_url == "https://bedrock.ap-southeast-2.amazonaws.com"
    regional(monkeypatch, server.base_url, region_name="ap-southeast-2")
    seen = SeenScopes()
    assert list(BatchApiHook("bedrock_regional", retry_policy=FAST, transport=seen).list_batches()) == []
    assert seen.regions == ["ap-southeast-2"]


class LoseCreateAnswer(httpx.HTTPTransport):
    """Sends every request; the first create's answer is lost after Bedrock made the job."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.method == "POST" and request.url.path == "/model-invocation-job" and not self.lost:
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_a_create_whose_answer_is_lost_is_found_by_its_name(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = batch_server(dialect="bedrock", api_key=SECRET)
    monkeypatch.setenv("AIRFLOW_CONN_BEDROCK_LOST", server.connection_json())
    transport = LoseCreateAnswer()
    hook = BatchApiHook("bedrock_lost", retry_policy=FAST, transport=transport)
    source = server.s3.path("lost", "input", "shard-00000.jsonl")
    source.write_bytes(
        orjson.dumps(
            {"recordId": "r1", "modelInput": {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}}
        )
        + b"\n"
    )
    key = "abp-0123456789abcdef01234567-s00000"
    job = hook.create_batch(
        input_file_id=plain_uri(source),
        output_uri=plain_uri(server.s3.path("lost", "output")) + "/",
        endpoint="/v1/chat/completions",
        metadata={"airflow_batch_key": key},
        name=key,
        model="echo-1",
    )
    assert transport.lost == 1
    # The lookup by name (nameContains) found the job the lost create made: one job, adopted.
    assert [b.id for b in hook.list_batches()] == [job.id]
    assert hook.get_batch(job.id).raw["clientRequestToken"] == key


class ExpiringSource:
    """A refreshable credentials source (an assumed role) counting its refreshes."""

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.made = clock, 0

    def get_frozen_credentials(self) -> Any:
        from botocore.credentials import ReadOnlyCredentials

        self.made += 1
        return ReadOnlyCredentials(f"ASIA{self.made}", f"secret-{self.made}", f"token-{self.made}")

    @property
    def _expiry_time(self) -> Any:
        from datetime import datetime, timezone

        return datetime.fromtimestamp(self.clock[0] + 900, tz=timezone.utc)


async def test_assumed_role_credentials_are_refreshed_before_they_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    clock = [1_000_000.0]
    source = ExpiringSource(clock)

    class Session:
        region_name = "eu-west-1"

        def get_credentials(self) -> Any:
            return source

    monkeypatch.setattr(AwsBaseHook, "get_session", lambda self, region_name=None: Session())
    credentials = AwsCredentials("abp_role", clock=lambda: clock[0])
    first = credentials.get()
    assert (first.access_key, credentials.region_name) == ("ASIA1", "eu-west-1")
    clock[0] += 500  # 400 s left of 900: still fresh (refreshed 300 s before expiry)
    assert (await credentials.aget()).access_key == "ASIA1" and source.made == 1
    clock[0] += 200  # 200 s left: refreshed, in a thread
    assert (await credentials.aget()).access_key == "ASIA2" and source.made == 2
    assert set(credentials.secret_values) == {"secret-2", "token-2"}
