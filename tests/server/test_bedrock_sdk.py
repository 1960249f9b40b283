"""boto3's own ``bedrock`` client drives ``serve --dialect bedrock``: create, get, list, stop, with
the input and the results on a real S3 server (moto).

botocore builds every request from Bedrock's service model (REST paths, JSON shapes, ISO
timestamps, ``x-amzn-ErrorType`` errors) and signs it with SigV4, so these tests hold the server
mode to Amazon's shapes and to a checked signature, not to the provider's dialect.
"""

from __future__ import annotations

import time
from typing import Any

import boto3
import orjson
import pytest
from botocore.exceptions import ClientError

from tests.fixtures.s3 import S3Staging

KEY_ID, SECRET = "abp-test-key", "abp-test-secret"  # the moto connection's keys (moto takes any)
ROLE = "arn:aws:iam::123456789012:role/bedrock-batch"
MODEL = "anthropic.claude-3-haiku-20240307-v1:0"
DONE = {"Completed", "PartiallyCompleted", "Failed", "Stopped", "Expired"}


@pytest.fixture
def bedrock(batch_server: Any, s3_staging: S3Staging, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The server in bedrock mode, its S3 the test's moto server (boto3 reads the keys from env)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    return batch_server(dialect="bedrock", api_key=f"{KEY_ID}:{SECRET}", s3_endpoint_url=s3_staging.endpoint)


def client(server: Any, secret: str = SECRET) -> Any:
    return boto3.client(
        "bedrock",
        endpoint_url=server.root_url,
        region_name="us-east-1",
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=secret,
    )


def records(count: int) -> bytes:
    return b"".join(
        orjson.dumps(
            {
                "recordId": f"rec{i:04d}",
                "modelInput": {
                    "messages": [{"role": "user", "content": [{"text": f"hello number {i}"}]}],
                    "system": [{"text": "Be brief."}],
                    "inferenceConfig": {"maxTokens": 20, "temperature": 0},
                },
            }
        )
        + b"\n"
        for i in range(count)
    )


def create(sdk: Any, s3: S3Staging, name: str, token: str | None = None) -> str:
    kwargs: dict[str, Any] = {"clientRequestToken": token} if token else {}
    answer = sdk.create_model_invocation_job(
        jobName=name,
        roleArn=ROLE,
        modelId=MODEL,
        inputDataConfig={"s3InputDataConfig": {"s3Uri": f"s3://{s3.bucket}/in/{name}/input.jsonl"}},
        outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"s3://{s3.bucket}/out/{name}/"}},
        timeoutDurationInHours=24,
        modelInvocationType="Converse",
        tags=[{"key": "airflow_batch_key", "value": name}],
        **kwargs,
    )
    arn: str = answer["jobArn"]
    return arn


def wait_until(sdk: Any, arn: str, states: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    job: dict[str, Any] = sdk.get_model_invocation_job(jobIdentifier=arn)
    while job["status"] not in states:
        assert time.monotonic() < deadline, f"job stuck in {job['status']}"
        time.sleep(0.05)
        job = sdk.get_model_invocation_job(jobIdentifier=arn)
    return job


def test_a_job_runs_from_s3_to_s3(bedrock: Any, s3_staging: S3Staging) -> None:
    (s3_staging.path("in", "job-a", "input.jsonl")).write_bytes(records(5))
    sdk = client(bedrock)
    arn = create(sdk, s3_staging, "job-a", token="tok-a")
    assert arn.startswith("arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/")
    # The same token is the same job (an idempotent retry), not a second one.
    assert create(sdk, s3_staging, "job-a", token="tok-a") == arn
    job = wait_until(sdk, arn, DONE)
    assert job["status"] == "Completed"
    assert (job["totalRecordCount"], job["successRecordCount"], job["errorRecordCount"]) == (5, 5, 0)
    assert job["jobName"] == "job-a" and job["modelInvocationType"] == "Converse"
    assert job["submitTime"].tzinfo is not None and job["endTime"] >= job["submitTime"]
    job_id = arn.rsplit("/", 1)[1]
    assert sdk.get_model_invocation_job(jobIdentifier=job_id)["jobArn"] == arn
    keys = s3_staging.keys(f"out/job-a/{job_id}")
    assert keys == [f"out/job-a/{job_id}/input.jsonl.out", f"out/job-a/{job_id}/manifest.json.out"]
    lines = [orjson.loads(x) for x in s3_staging.read(keys[0]).splitlines()]
    assert sorted(x["recordId"] for x in lines) == [f"rec{i:04d}" for i in range(5)]
    first = lines[0]["modelOutput"]
    assert first["output"]["message"]["role"] == "assistant" and first["stopReason"] == "end_turn"
    assert first["usage"]["inputTokens"] > 0
    manifest = orjson.loads(s3_staging.read(keys[1]))
    assert manifest["processedRecordCount"] == 5 and manifest["successRecordCount"] == 5


def test_list_filters_by_name_and_pages(bedrock: Any, s3_staging: S3Staging) -> None:
    sdk = client(bedrock)
    arns = []
    for name in ("keep-1", "keep-2", "other-1"):
        s3_staging.path("in", name, "input.jsonl").write_bytes(records(1))
        arns.append(create(sdk, s3_staging, name))
    page = sdk.list_model_invocation_jobs(nameContains="keep", maxResults=1, sortOrder="Descending")
    assert [j["jobArn"] for j in page["invocationJobSummaries"]] == [arns[1]]
    page = sdk.list_model_invocation_jobs(nameContains="keep", maxResults=1, nextToken=page["nextToken"])
    assert [j["jobArn"] for j in page["invocationJobSummaries"]] == [arns[0]]
    assert "nextToken" not in page
    everything = sdk.get_paginator("list_model_invocation_jobs").paginate(PaginationConfig={"PageSize": 2})
    assert {j["jobName"] for p in everything for j in p["invocationJobSummaries"]} == {
        "keep-1",
        "keep-2",
        "other-1",
    }


def test_stop_ends_a_running_job_and_a_second_stop_is_refused(bedrock: Any, s3_staging: S3Staging) -> None:
    bedrock.set_faults(stall_batches=True)
    s3_staging.path("in", "job-s", "input.jsonl").write_bytes(records(3))
    sdk = client(bedrock)
    arn = create(sdk, s3_staging, "job-s")
    sdk.stop_model_invocation_job(jobIdentifier=arn)
    job = wait_until(sdk, arn, DONE)
    assert job["status"] == "Stopped"
    with pytest.raises(ClientError) as refused:
        sdk.stop_model_invocation_job(jobIdentifier=arn)
    assert refused.value.response["Error"]["Code"] == "ValidationException"


def test_a_bad_signature_and_a_missing_job_are_refused_as_aws_does(
    bedrock: Any, s3_staging: S3Staging
) -> None:
    with pytest.raises(ClientError) as refused:
        client(bedrock, secret="not-the-secret").list_model_invocation_jobs()
    assert refused.value.response["Error"]["Code"] == "InvalidSignatureException"
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError) as missing:
        client(bedrock).get_model_invocation_job(jobIdentifier="abcdefabcdef")
    assert missing.value.response["Error"]["Code"] == "ResourceNotFoundException"
    with pytest.raises(ClientError) as no_input:
        create(client(bedrock), s3_staging, "no-input")
    assert no_input.value.response["Error"]["Code"] == "ValidationException"


def test_a_malformed_job_id_is_a_validation_error_and_an_unknown_one_not_found(bedrock: Any) -> None:
    sdk = client(bedrock)
    # jobIdentifier is a 12-character id (or the job's ARN): anything else is a 400, as on AWS.
    for malformed in ("not-a-job-id", "ABCDEFABCDEF", "abc", "arn:aws:bedrock:us-east-1:1:job/x"):
        with pytest.raises(ClientError) as refused:
            sdk.get_model_invocation_job(jobIdentifier=malformed)
        assert refused.value.response["Error"]["Code"] == "ValidationException", malformed
        assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        with pytest.raises(ClientError) as refused:
            sdk.stop_model_invocation_job(jobIdentifier=malformed)
        assert refused.value.response["Error"]["Code"] == "ValidationException", malformed
    for unknown in (
        "abcdefabcdef",
        "arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/0123456789ab",
    ):
        with pytest.raises(ClientError) as missing:
            sdk.get_model_invocation_job(jobIdentifier=unknown)
        assert missing.value.response["Error"]["Code"] == "ResourceNotFoundException"
        assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_a_used_job_name_is_refused_and_a_used_token_answers_its_job(
    bedrock: Any, s3_staging: S3Staging
) -> None:
    sdk = client(bedrock)
    s3_staging.path("in", "named", "input.jsonl").write_bytes(records(1))
    arn = create(sdk, s3_staging, "named", token="first")
    assert create(sdk, s3_staging, "named", token="first") == arn
    # Another token under a name in use: Bedrock's names are unique per account and region.
    with pytest.raises(ClientError) as refused:
        create(sdk, s3_staging, "named", token="second")
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "in use" in refused.value.response["Error"]["Message"]
    assert [j["jobArn"] for j in sdk.list_model_invocation_jobs()["invocationJobSummaries"]] == [arn]


def test_list_filters_by_submit_time_status_and_sorts(bedrock: Any, s3_staging: S3Staging) -> None:
    bedrock.set_faults(stall_batches=True)
    sdk = client(bedrock)
    arns = []
    for name in ("t-1", "t-2", "t-3"):
        s3_staging.path("in", name, "input.jsonl").write_bytes(records(1))
        arns.append(create(sdk, s3_staging, name))
        time.sleep(0.01)  # distinct submit times
    times = [sdk.get_model_invocation_job(jobIdentifier=a)["submitTime"] for a in arns]
    assert times == sorted(times) and len(set(times)) == 3

    def listed(**kwargs: Any) -> list[str]:
        return [j["jobArn"] for j in sdk.list_model_invocation_jobs(**kwargs)["invocationJobSummaries"]]

    # boto3 sends the timestamps as ISO-8601 in the query string.
    assert listed(submitTimeAfter=times[0]) == [arns[2], arns[1]]
    assert listed(submitTimeBefore=times[2]) == [arns[1], arns[0]]
    assert listed(submitTimeAfter=times[0], submitTimeBefore=times[2]) == [arns[1]]
    assert listed(sortBy="CreationTime", sortOrder="Ascending") == arns
    sdk.stop_model_invocation_job(jobIdentifier=arns[1])
    wait_until(sdk, arns[1], {"Stopped"})
    assert listed(statusEquals="Stopped") == [arns[1]]
    for bad in ({"statusEquals": "Done"}, {"sortOrder": "Sideways"}, {"sortBy": "Name"}):
        with pytest.raises(ClientError) as refused:
            listed(**bad)
        assert refused.value.response["Error"]["Code"] == "ValidationException", bad


NATIVE = {
    "meta.llama3-8b-instruct-v1:0": {
        "prompt": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhello llama3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "max_gen_len": 20,
    },
    "us.anthropic.claude-3-5-haiku-20241022-v1:0": {
        "anthropic_version": "bedrock-2023-05-31",
        "max_tokens": 20,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello claude"}]}],
    },
    "mistral.mistral-7b-instruct-v0:2": {"prompt": "<s>[INST] hello mistral [/INST]", "max_tokens": 20},
    "amazon.titan-text-express-v1": {
        "inputText": "hello titan",
        "textGenerationConfig": {"maxTokenCount": 20},
    },
    "amazon.nova-lite-v1:0": {
        "schemaVersion": "messages-v1",
        "messages": [{"role": "user", "content": [{"text": "hello nova"}]}],
        "inferenceConfig": {"max_new_tokens": 20},
    },
}


@pytest.mark.parametrize("model", sorted(NATIVE))
def test_an_invoke_model_job_answers_in_the_model_familys_own_shape(
    bedrock: Any, s3_staging: S3Staging, model: str
) -> None:
    name = "native-" + model.replace(":", "-").replace(".", "-")[:40]
    line = {"recordId": "rec0001", "modelInput": NATIVE[model]}
    s3_staging.path("in", name, "input.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    sdk = client(bedrock)
    arn = sdk.create_model_invocation_job(
        jobName=name,
        roleArn=ROLE,
        modelId=model,
        inputDataConfig={"s3InputDataConfig": {"s3Uri": f"s3://{s3_staging.bucket}/in/{name}/input.jsonl"}},
        outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"s3://{s3_staging.bucket}/out/{name}/"}},
    )["jobArn"]  # no modelInvocationType: InvokeModel, the model's native body
    job = wait_until(sdk, arn, DONE)
    assert job["status"] == "Completed" and job["modelInvocationType"] == "InvokeModel"
    (out,) = [k for k in s3_staging.keys(f"out/{name}") if k.endswith(".jsonl.out")]
    (answer,) = [orjson.loads(x) for x in s3_staging.read(out).splitlines()]
    output = answer["modelOutput"]
    text = ANSWER_TEXT[model](output)
    # The echo model answered the record's user text, read out of the native body.
    assert text == "echo: hello " + model.removeprefix("us.").split(".")[1].split("-")[0], output


def _llama(output: dict[str, Any]) -> str:
    assert set(output) == {"generation", "prompt_token_count", "generation_token_count", "stop_reason"}
    assert output["stop_reason"] == "stop" and output["prompt_token_count"] > 0
    return str(output["generation"])


def _claude(output: dict[str, Any]) -> str:
    assert output["type"] == "message" and output["stop_reason"] == "end_turn"
    assert output["usage"]["input_tokens"] > 0
    return str(output["content"][0]["text"])


def _mistral(output: dict[str, Any]) -> str:
    assert output["outputs"][0]["stop_reason"] == "stop"
    return str(output["outputs"][0]["text"])


def _titan(output: dict[str, Any]) -> str:
    assert output["results"][0]["completionReason"] == "FINISH" and output["inputTextTokenCount"] > 0
    return str(output["results"][0]["outputText"])


def _nova(output: dict[str, Any]) -> str:
    assert output["stopReason"] == "end_turn" and output["usage"]["inputTokens"] > 0
    return str(output["output"]["message"]["content"][0]["text"])


ANSWER_TEXT = {
    "meta.llama3-8b-instruct-v1:0": _llama,
    "us.anthropic.claude-3-5-haiku-20241022-v1:0": _claude,
    "mistral.mistral-7b-instruct-v0:2": _mistral,
    "amazon.titan-text-express-v1": _titan,
    "amazon.nova-lite-v1:0": _nova,
}


def test_a_native_body_that_is_not_the_models_fails_validation(bedrock: Any, s3_staging: S3Staging) -> None:
    # Claude's body without Bedrock's anthropic_version: the job fails validation.
    line = {"recordId": "r1", "modelInput": {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}}
    s3_staging.path("in", "bad-native", "input.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    sdk = client(bedrock)
    arn = sdk.create_model_invocation_job(
        jobName="bad-native",
        roleArn=ROLE,
        modelId="anthropic.claude-3-haiku-20240307-v1:0",
        inputDataConfig={
            "s3InputDataConfig": {"s3Uri": f"s3://{s3_staging.bucket}/in/bad-native/input.jsonl"}
        },
        outputDataConfig={"s3OutputDataConfig": {"s3Uri": f"s3://{s3_staging.bucket}/out/bad-native/"}},
    )["jobArn"]
    job = wait_until(sdk, arn, DONE)
    assert job["status"] == "Failed" and "anthropic_version" in job["message"]
