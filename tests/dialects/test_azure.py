"""Azure OpenAI dialect: connection settings (v1 / classic paths, auth, file expiry), limits, the
one-deployment rule and token_limit_exceeded as the quota error it is.

Batch payloads are checked against the official ``openai`` SDK's ``Batch`` model, the client
``AzureOpenAI`` itself uses, so the shapes are Azure's published ones.
"""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from openai.types import Batch as SdkBatch

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.dialects.azure import (
    DEFAULT_FILE_EXPIRY,
    MAX_FILE_EXPIRY,
    AzureOpenAIDialect,
)
from airflow_batch_provider.exceptions import (
    BatchFailedError,
    BatchQuotaExceededError,
    ConfigurationError,
)
from airflow_batch_provider.hooks.settings import settings_from_connection
from airflow_batch_provider.jsonl import validate_stream
from airflow_batch_provider.outcome import QUOTA_REASON, decide
from airflow_batch_provider.waiting import apply_outcome_policy

ENDPOINT = "https://contoso-eastus.openai.azure.com"


def conn(host: str | None = ENDPOINT, password: str | None = "azure-key-123") -> Any:
    return SimpleNamespace(host=host, port=None, schema=None, password=password)


def settings(extra: dict[str, Any], **kwargs: Any) -> Any:
    return settings_from_connection(
        "azure_conn", conn(**kwargs), {"dialect": "azure", **extra}, conn_type="x"
    )


def azure_batch(status: str = "failed", **fields: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "id": "batch_6f8e1c2a-0d4b-4c8e-9f51-3a7d2b1c0e99",
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file-2b1f0e0c7d9a4c5e8f7b6a5d4c3b2a10",
        "completion_window": "24h",
        "status": status,
        "created_at": 1_736_000_000,
        "request_counts": {"total": 3, "completed": 0, "failed": 0},
        "errors": None,
        "metadata": None,
        **fields,
    }
    SdkBatch.model_validate(raw)  # the SDK reads it: the fixture is the published shape
    return raw


TOKEN_LIMIT = {
    "object": "list",
    "data": [
        {
            "code": "token_limit_exceeded",
            "message": "The number of enqueued tokens has surpassed the configured limit of 30K "
            "for the deployment 'gpt-4.1-batch'.",
            "line": None,
            "param": None,
        }
    ],
}


def test_v1_path_is_the_default_and_sends_no_api_version() -> None:
    s = settings({})
    assert s.base_url == f"{ENDPOINT}/openai/v1"
    assert "params" not in s.client_kwargs()
    assert s.client_headers()["api-key"] == "azure-key-123"
    assert "Authorization" not in s.client_headers()


def test_classic_path_sends_the_api_version_on_every_call() -> None:
    s = settings({"api_version": "2024-10-21"})
    assert s.base_url == f"{ENDPOINT}/openai"
    assert s.client_kwargs()["params"] == {"api-version": "2024-10-21"}
    assert isinstance(s.dialect, AzureOpenAIDialect) and s.dialect.api_version == "2024-10-21"


@pytest.mark.parametrize(
    ("host", "extra", "expected"),
    [
        (f"{ENDPOINT}/openai/v1", {}, f"{ENDPOINT}/openai/v1"),
        (f"{ENDPOINT}/openai", {"api_version": "2024-10-21"}, f"{ENDPOINT}/openai"),
        (f"{ENDPOINT}/openai/v1", {"api_version": "2024-10-21"}, "v1 path .* takes no api-version"),
        (f"{ENDPOINT}/openai", {}, "classic path .* needs extra 'api_version'"),
    ],
)
def test_a_host_naming_the_path_must_match_the_api_version(
    host: str, extra: dict[str, Any], expected: str
) -> None:
    if expected.startswith("https://"):
        assert settings(extra, host=host).base_url == expected
    else:
        with pytest.raises(ConfigurationError, match=rf"azure_conn.*{expected}"):
            settings(extra, host=host)


def test_a_connection_without_the_resource_endpoint_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"azure_conn.*host.*endpoint"):
        settings({}, host=None)


def test_key_auth_without_a_key_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match=r"azure_conn.*no API key.*entra"):
        settings({}, password=None)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"auth": "oauth"}, "'auth'"),
        ({"api_version": "  "}, "'api_version'"),
        ({"file_expiry_seconds": "two weeks"}, "'file_expiry_seconds'"),
        ({"file_expiry_seconds": 3600}, "1209600 \\(14 days\\) to 2592000"),
        ({"file_expiry_seconds": MAX_FILE_EXPIRY + 1}, "1209600 \\(14 days\\) to 2592000"),
        ({"file_expiry_seconds": True}, "'file_expiry_seconds'"),
    ],
)
def test_bad_extras_are_refused_naming_the_field(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"azure_conn.*{named}"):
        settings(extra)


def test_uploads_carry_a_file_expiry_anchored_at_creation() -> None:
    assert settings({}).dialect.upload_form() == {
        "purpose": "batch",
        "expires_after[anchor]": "created_at",
        "expires_after[seconds]": str(DEFAULT_FILE_EXPIRY),
    }
    assert DEFAULT_FILE_EXPIRY == 14 * 24 * 3600
    form = settings({"file_expiry_seconds": "2592000"}).dialect.upload_form()
    assert form["expires_after[seconds]"] == "2592000"


def test_entra_without_azure_identity_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes the module unimportable, as on an install without the extra.
    monkeypatch.setitem(sys.modules, "azure.identity", None)
    with pytest.raises(ConfigurationError, match=r"azure-identity.*airflow-batch-provider\[azure\]"):
        settings({"auth": "entra"})


def test_limits_and_one_deployment_per_file() -> None:
    d = get_dialect("azure")
    rules = d.validation_rules()
    assert (rules.limits.max_lines, rules.limits.max_file_bytes) == (100_000, 200 * 1024 * 1024)
    assert d.completion_windows == ("24h",)

    def line(cid: str, model: str) -> bytes:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        return orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})

    data = b"\n".join([line("a", "gpt-4o-batch"), line("b", "gpt-4o-mini-batch")]) + b"\n"
    found = [(p.line, p.code) for p in validate_stream(io.BytesIO(data), rules)]
    assert found == [(2, "mismatched_model")]


def test_a_line_without_a_deployment_is_refused_by_name() -> None:
    rules = get_dialect("azure").validation_rules()
    bare = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}
    data = (
        orjson.dumps(bare)
        + b"\n"
        + orjson.dumps({**bare, "custom_id": "b", "body": {"model": "gpt-4o-batch", "messages": []}})
    )
    found = list(validate_stream(io.BytesIO(data), rules))
    assert [(p.line, p.code) for p in found] == [(1, "missing_model")]
    assert "the batch deployment's name" in found[0].message and "'azure'" in found[0].message


def test_token_limit_exceeded_at_create_is_a_quota_error() -> None:
    d = get_dialect("azure")
    body = {"error": {"code": "token_limit_exceeded", "message": "enqueued tokens over the limit"}}
    assert d.is_quota_error(400, body) and d.is_quota_error(429, body)
    assert not d.is_quota_error(400, {"error": {"code": "invalid_request_error"}})
    # The OpenAI dialect knows no such code: only the Azure dialect reads it as quota.
    assert not get_dialect("openai").is_quota_error(400, body)


def test_a_batch_failed_by_token_limit_exceeded_ends_as_a_quota_error() -> None:
    d = get_dialect("azure")
    batch = d.parse_batch(azure_batch("failed", errors=TOKEN_LIMIT))
    assert [e.quota for e in batch.errors] == [True]
    outcome = decide([batch])
    assert (outcome.status, outcome.termination_reason) == ("failed", QUOTA_REASON)
    log = SimpleNamespace(info=print, warning=print)
    with pytest.raises(BatchQuotaExceededError, match="token_limit_exceeded.*quota"):
        apply_outcome_policy(
            outcome.event(),
            on_partial_failure="succeed",
            cancel_on_timeout=False,
            hook_factory=lambda: None,  # type: ignore[arg-type,return-value]
            log=log,
        )
    # Another failure stays a plain failed batch.
    other = d.parse_batch(
        azure_batch("failed", errors={"object": "list", "data": [{"code": "invalid_json_line", "line": 2}]})
    )
    assert decide([other]).termination_reason == "batch_failed"
    with pytest.raises(BatchFailedError) as info:
        apply_outcome_policy(
            decide([other]).event(),
            on_partial_failure="succeed",
            cancel_on_timeout=False,
            hook_factory=lambda: None,  # type: ignore[arg-type,return-value]
            log=log,
        )
    assert not isinstance(info.value, BatchQuotaExceededError)


def test_completed_batch_without_an_error_file_parses() -> None:
    d = get_dialect("azure")
    batch = d.parse_batch(
        azure_batch(
            "completed",
            output_file_id="file-out",
            error_file_id=None,
            request_counts={"total": 3, "completed": 3, "failed": 0},
        )
    )
    assert (batch.output_file_id, batch.error_file_id) == ("file-out", None)
    assert decide([batch]).status == "success"


def test_the_connection_form_documents_the_azure_fields() -> None:
    from airflow_batch_provider.hooks.connection_form import CONN_FIELDS

    for name in ("api_version", "auth", "tenant_id", "client_id", "file_expiry_seconds"):
        assert name in CONN_FIELDS and "(azure)" in CONN_FIELDS[name]["label"]
    expiry = CONN_FIELDS["file_expiry_seconds"]["schema"]
    assert (expiry["minimum"], expiry["maximum"]) == (14 * 24 * 3600, MAX_FILE_EXPIRY)


async def test_make_credential_builds_azure_identitys_own_credentials() -> None:
    # Built offline (no token is asked for): the service principal, else DefaultAzureCredential.
    import azure.identity
    import azure.identity.aio

    from airflow_batch_provider.dialects.azure import make_credential

    principal = {"tenant_id": "00000000-0000-0000-0000-000000000001", "client_id": "app"}
    sync = make_credential(principal, "s3cret", asynchronous=False)
    asynchronous = make_credential(principal, "s3cret", asynchronous=True)
    assert isinstance(sync, azure.identity.ClientSecretCredential)
    assert isinstance(asynchronous, azure.identity.aio.ClientSecretCredential)
    await asynchronous.close()
    default = make_credential({}, None, asynchronous=False)
    assert isinstance(default, azure.identity.DefaultAzureCredential)
    # Without a secret the tenant and client ids name a managed identity, not a service principal.
    assert isinstance(
        make_credential(principal, None, asynchronous=False), azure.identity.DefaultAzureCredential
    )


@pytest.mark.parametrize(
    ("extra", "wire"),
    [({}, "/v1/chat/completions"), ({"api_version": "2024-10-21"}, "/chat/completions")],
    ids=["v1", "classic"],
)
def test_each_api_gets_the_endpoint_as_it_names_it(extra: dict[str, Any], wire: str) -> None:
    # Microsoft's classic samples name the endpoint /chat/completions in every line and in the
    # create; the v1 reference /v1/chat/completions. Staging keeps the canonical form.
    dialect = settings(extra).dialect
    canonical = {"custom_id": "k-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "d"}}
    assert dialect.encodes_lines == bool(extra)
    if dialect.encodes_lines:
        assert dialect.encode_line(dict(canonical))["url"] == wire
    body = dialect.create_batch_body(
        input_file_id="file-1", endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert body["endpoint"] == wire
    assert dialect.wire_endpoint("/v1/embeddings") == wire.replace("chat/completions", "embeddings")
