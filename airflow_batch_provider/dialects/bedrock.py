"""Amazon Bedrock batch inference: model invocation jobs reading JSONL from S3, writing JSONL to S3.

Built to Bedrock's API reference and botocore's service model (``bedrock`` 2023-04-20):

- **Control plane** (REST JSON, SigV4-signed with the signing name ``bedrock``):
  ``POST /model-invocation-job`` (``CreateModelInvocationJob``: ``jobName``, ``clientRequestToken``,
  ``roleArn``, ``modelId``, ``inputDataConfig.s3InputDataConfig.s3Uri``,
  ``outputDataConfig.s3OutputDataConfig.s3Uri``, ``timeoutDurationInHours`` 24-168, ``tags``,
  ``modelInvocationType``) answering ``{jobArn}``; ``GET /model-invocation-job/{id}``;
  ``GET /model-invocation-jobs`` (``nameContains``, ``submitTimeAfter``, ``maxResults``,
  ``nextToken``, ``sortBy``, ``sortOrder``) answering ``{invocationJobSummaries, nextToken}``;
  ``POST /model-invocation-job/{id}/stop``. The batch id is the 12-character job id (the ARN's
  last segment), which every path accepts.
- **Credentials**: the amazon provider's ``aws`` connection named by extra ``aws_conn_id``
  (keys, role assumption, profile, web identity), read through its hook (``credentials_kind``
  "aws"); requests are signed with botocore's SigV4 signer over the provider's own httpx clients.
  **Region** (endpoint and signature): the connection's extra ``region_name``; else the ``aws``
  connection's ``region_name`` (``hooks.credentials.platform_extra``, read once when the settings
  are built); else us-east-1. A malformed job id is a 400 ``ValidationException`` at Bedrock
  (``is_not_found`` reads it as no such batch).
- **Input**: ``{"recordId": <custom_id>, "modelInput": {...}}`` lines in S3 (the run's staging must
  be on S3). Extra ``invocation_type`` chooses the chat body: ``converse`` (default) uses
  ``modelInvocationType: Converse`` (one encoding, every model family): ``messages`` of content
  blocks, ``system``, ``inferenceConfig`` {maxTokens, temperature, topP, stopSequences},
  ``toolConfig``; ``native`` uses the model family's own InvokeModel body (Claude, Llama,
  Mistral, Titan Text, Nova: ``dialects/bedrock_native.py``; another family is refused by name)
  and no ``modelInvocationType``; ``auto`` is native for the prompt-string families (Llama,
  Mistral, Titan Text) and Converse for the rest. Embedding lines use the model's native body
  (Amazon Titan Text Embeddings: ``{inputText, dimensions}``); what cannot be expressed is
  refused by name.
- **Status**: Submitted, Validating, Scheduled, InProgress, Completed, PartiallyCompleted, Failed,
  Stopping, Stopped, Expired, with ``totalRecordCount``, ``processedRecordCount``,
  ``successRecordCount`` and ``errorRecordCount``. PartiallyCompleted is a completed batch with
  failed records; Stopped is cancelled and Expired expired.
- **Results**: one ``<input name>.out`` per input file under ``<output s3Uri>/<job id>/`` (found by
  listing), lines ``{recordId, modelInput, modelOutput | error: {errorCode, errorMessage}}`` in any
  order, and ``manifest.json.out`` with the job's totals (checked against what was read). A
  ``modelOutput`` is read by its shape: Converse (and Nova's native answer), a family's native
  answer, or a Titan embedding.
- **Limits** per job (they differ by model and region; extras override the defaults): at least
  ``min_records_per_job`` (100) and at most ``max_records_per_job`` (50,000) records, at most
  ``max_bytes_per_file`` (1 GB) per input file; one input file per job here, so the per-job byte
  and file limits are the file's.
- **Crash window**: the job name is the shard's idempotency key and ``clientRequestToken`` the same
  key (a retried create returns the same job); the Nth replacement of a failed, expired or
  stopped job is ``<key>-r<N>`` (``submission.generation_name``; names are unique per account and
  region, and the old token would answer with the dead job). A job whose create answer was lost
  is found by listing with ``nameContains`` (the key: every generation) and ``submitTimeAfter``
  (the recorded intent less ``SUBMIT_TIME_MARGIN``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import orjson

from airflow_batch_provider.dialects.base import (
    LIST_WHAT,
    Dialect,
    ResultObjectKind,
    batch_object,
    bind_models,
    page_items,
    page_object,
    str_or_none,
)
from airflow_batch_provider.dialects.bedrock_native import (
    FAMILIES,
    PROMPT_FAMILIES,
    is_native_output,
    model_family,
    native_completion,
    native_problem,
    native_request,
)
from airflow_batch_provider.dialects.chat import call_arguments, text_content
from airflow_batch_provider.exceptions import (
    BatchApiResponseError,
    ConfigurationError,
    UnknownBatchStatusError,
)
from airflow_batch_provider.ids import id_problem, path_segment
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    import httpx

    from airflow_batch_provider.models import (  # noqa: TC004
        Batch,
        BatchError,
        BatchState,
        LineError,
        RequestCounts,
        ResultLine,
        ResultSource,
        to_utc,
    )

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
#: The metadata key whose value is the job's name (how a lost create is found by listing).
NAME_KEY = "airflow_batch_key"
#: How much earlier than the intent the orphan lookup asks for jobs (``submitTimeAfter``): Bedrock
#: stamps ``submitTime`` by its clock, which may be behind this machine's.
SUBMIT_TIME_MARGIN = timedelta(minutes=10)
#: Bedrock's documented default quotas per batch inference job (they vary by model and region).
DEFAULT_MIN_RECORDS = 100
DEFAULT_MAX_RECORDS = 50_000
DEFAULT_MAX_FILE_BYTES = 1024 * MB
# Bedrock's statuses, in the provider's vocabulary.
STATUSES: dict[str, str] = {
    "Submitted": "validating",
    "Validating": "validating",
    "Scheduled": "validating",
    "InProgress": "in_progress",
    "Completed": "completed",
    # Some records failed: a completed batch with failed lines (the merge lands the rest).
    "PartiallyCompleted": "completed",
    "Failed": "failed",
    "Stopping": "cancelling",
    "Stopped": "cancelled",
    "Expired": "expired",
}
# When each kind of end happened: the job's ``endTime``.
_ENDED_AT = {
    "completed": "completed_at",
    "failed": "failed_at",
    "cancelled": "cancelled_at",
    "expired": "expired_at",
}
# Converse stop reasons as chat-completion finish reasons.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "content_filtered": "content_filter",
    "guardrail_intervened": "content_filter",
}
# Canonical chat fields a Converse request carries (the others are refused by name).
_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "tools",
        "tool_choice",
        "n",
    }
)
# The suffix of a replacement job's name (``submission.generation_name``).
_GENERATION = re.compile(r"-r[0-9]+$")
#: The connection extra ``invocation_type``'s values (see the module docstring).
INVOCATION_TYPES = ("converse", "native", "auto")
_LIMIT_EXTRAS = ("min_records_per_job", "max_records_per_job", "max_bytes_per_file")
_ROLE_ARN = re.compile(r"arn:aws(-[^:]+)?:iam::([0-9]{12})?:role/.+")


def job_id_of(arn_or_id: Any) -> str | None:
    """The job id of a job ARN (its last segment; Bedrock issues 12 lower-case letters and
    digits), or of an id; None when it is neither a string nor an id."""
    if not isinstance(arn_or_id, str):
        return None
    ident = arn_or_id.rpartition("model-invocation-job/")[2] if arn_or_id.startswith("arn:") else arn_or_id
    return ident if ident and id_problem(ident) is None else None


class BedrockDialect(Dialect):
    """Amazon Bedrock batch inference (model invocation jobs on S3).

    :param region: the AWS region of the control plane (and the signature).
    :param role_arn: the IAM service role Bedrock assumes to read the input and write the output.
    :param min_records: the fewest records a job takes.
    :param limits: records and bytes per job.
    :param storage_conn_id: the ``aws`` connection that reads the job's output objects.
    :param invocation_type: how chat records are encoded: "converse", "native" or "auto".
    """

    name = "bedrock"
    label = "Amazon Bedrock"
    default_base_url = "https://bedrock.us-east-1.amazonaws.com"
    default_api_path = ""
    endpoints = frozenset({CHAT, EMBEDDINGS})
    # timeoutDurationInHours: 24 to 168.
    completion_windows = tuple(f"{h}h" for h in range(24, 169, 24))
    limits = Limits(
        max_lines=DEFAULT_MAX_RECORDS,
        max_file_bytes=DEFAULT_MAX_FILE_BYTES,
        max_line_bytes=DEFAULT_MAX_FILE_BYTES,
    )
    mixed_models = False
    model_placement = "job"
    model_meaning = "the Bedrock model id or inference profile (modelId)"
    model_optional_endpoints = frozenset()
    encodes_lines = True
    submission_mode = "object_store"
    results_modes = ("object_store",)
    object_store_schemes = ("s3",)
    credentials_kind = "aws"
    # Jobs carry tags, but neither Get nor List shows them: the run identity is the job's name.
    supports_metadata = False
    max_metadata_pairs = 200
    upload_purpose = None
    list_keys = frozenset({"invocationJobSummaries"})
    list_page_size = 100
    list_cursor_param = "nextToken"
    listed_id_key = "jobArn"
    batches_path = "model-invocation-jobs"
    # Stopping an ended job is refused with a ValidationException (400): it is already final.
    cancel_final_statuses = frozenset({400})
    quota_error_codes = frozenset({"servicequotaexceededexception"})
    line_shape = None
    token_encoding = None
    token_factor = 1.1
    price_provider = "aws"
    console_url_template = None
    connection_fields = {
        "aws_conn_id": {
            "label": "AWS connection (bedrock)",
            "description": (
                "Amazon Bedrock: the amazon provider's aws connection whose credentials sign every "
                "call (SigV4) and read the job's output objects; default aws_default."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "storage_conn_id": {
            "label": "S3 connection (bedrock)",
            "description": (
                "Amazon Bedrock: the aws connection that reads the jobs' output objects on S3, when "
                "it is not aws_conn_id (an S3 endpoint of its own)."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "region_name": {
            "label": "AWS region (bedrock)",
            "description": (
                "Amazon Bedrock: the region of the control plane and of the signature, e.g. "
                "eu-west-1; when unset, the aws connection's region_name, else us-east-1."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "role_arn": {
            "label": "Service role ARN (bedrock)",
            "description": (
                "Amazon Bedrock: the IAM role Bedrock assumes to read the input from and write the "
                "output to the staging bucket (roleArn of every job)."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "invocation_type": {
            "label": "Chat body (bedrock)",
            "description": (
                "Amazon Bedrock: how chat records are encoded. converse (default): the Converse "
                "body for every model (modelInvocationType Converse); native: the model family's "
                "own InvokeModel body (Claude, Llama, Mistral, Titan Text, Nova; other models are "
                "refused); auto: native for the prompt-string families (Llama, Mistral, Titan "
                "Text), Converse for the others."
            ),
            "schema": {"type": ["string", "null"], "enum": [None, *INVOCATION_TYPES]},
        },
        "min_records_per_job": {
            "label": "Fewest records per job (bedrock)",
            "description": "Amazon Bedrock: the model's minimum records per batch job (default 100).",
            "schema": {"type": ["integer", "null"], "minimum": 1},
        },
        "max_records_per_job": {
            "label": "Most records per job (bedrock)",
            "description": "Amazon Bedrock: the model's maximum records per batch job (default 50000).",
            "schema": {"type": ["integer", "null"], "minimum": 1},
        },
        "max_bytes_per_file": {
            "label": "Largest input file in bytes (bedrock)",
            "description": "Amazon Bedrock: the largest batch input file (default 1 GB).",
            "schema": {"type": ["integer", "null"], "minimum": 1},
        },
    }

    def __init__(
        self,
        *,
        region: str = "us-east-1",
        role_arn: str | None = None,
        min_records: int = DEFAULT_MIN_RECORDS,
        limits: Limits | None = None,
        storage_conn_id: str | None = None,
        invocation_type: str = "converse",
    ) -> None:
        super().__init__()
        bind_models(
            globals(),
            "Batch",
            "BatchError",
            "BatchState",
            "LineError",
            "RequestCounts",
            "ResultLine",
            "to_utc",
        )
        self.region = region
        # The region's control-plane endpoint, when the connection names no host.
        self.default_base_url = f"https://bedrock.{region}.amazonaws.com"  # type: ignore[misc]
        self.role_arn = role_arn
        self.min_records = min_records
        if limits is not None:
            self.limits = limits  # type: ignore[misc]
        self.storage_conn_id = storage_conn_id
        self.invocation_type = invocation_type

    def __repr__(self) -> str:
        return f"<Dialect bedrock region={self.region}>"

    # ---- connection ---------------------------------------------------------------------
    def configure(self, extra: Mapping[str, Any], conn_id: str) -> BedrockDialect:
        """The dialect with the connection's region, role, limits and aws connection, checked."""
        where = f"connection {conn_id!r} (dialect bedrock)"
        # The batch connection's own region_name wins; else the aws connection's (the hook
        # passes it in as region_name, see hooks.credentials.platform_extra); else us-east-1.
        region = str(extra.get("region_name") or "us-east-1").strip()
        if not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", region):
            raise ConfigurationError(
                f"{where}: region_name {region!r} (the connection's extra, else its aws "
                "connection's) is not an AWS region like us-east-1"
            )
        role = extra.get("role_arn")
        if role is not None and not (isinstance(role, str) and _ROLE_ARN.fullmatch(role)):
            raise ConfigurationError(
                f"{where}: extra 'role_arn' must be an IAM role ARN (arn:aws:iam::<account>:role/<name>)"
            )
        numbers: dict[str, int] = {}
        for name in _LIMIT_EXTRAS:
            raw = extra.get(name)
            if raw is None:
                continue
            if isinstance(raw, str) and raw.strip().isdigit():
                raw = int(raw.strip())
            if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
                raise ConfigurationError(
                    f"{where}: extra {name!r} must be a positive whole number, got {raw!r}"
                )
            numbers[name] = raw
        most = numbers.get("max_records_per_job", DEFAULT_MAX_RECORDS)
        fewest = numbers.get("min_records_per_job", DEFAULT_MIN_RECORDS)
        if fewest > most:
            raise ConfigurationError(
                f"{where}: min_records_per_job {fewest} is above max_records_per_job {most}"
            )
        size = numbers.get("max_bytes_per_file", DEFAULT_MAX_FILE_BYTES)
        kind = str(extra.get("invocation_type") or "converse").strip().lower()
        if kind not in INVOCATION_TYPES:
            raise ConfigurationError(
                f"{where}: extra 'invocation_type' {kind!r} is not one of {', '.join(INVOCATION_TYPES)}"
            )
        # S3 is read through extra storage_conn_id, else the aws connection that signs.
        aws_conn_id = extra.get("storage_conn_id") or extra.get("aws_conn_id", "aws_default")
        return BedrockDialect(
            region=region,
            role_arn=role,
            min_records=fewest,
            limits=Limits(max_lines=most, max_file_bytes=size, max_line_bytes=size),
            storage_conn_id=str(aws_conn_id) if aws_conn_id else None,
            invocation_type=kind,
        )

    @property
    def api_path(self) -> str:
        return ""

    def credentials_auth(self, credentials: Any, base_url: str, conn_id: str) -> httpx.Auth:
        from airflow_batch_provider.dialects.sigv4 import SigV4Auth

        return SigV4Auth(base_url, credentials, "bedrock", self.region)

    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Nothing: every request is signed (``credentials_auth``)."""
        return {}

    def is_quota_error(self, status_code: int, body: Any) -> bool:
        """A ``ServiceQuotaExceededException`` (400): too many jobs or records in flight."""
        return status_code in (400, 429) and _error_type(body) == "servicequotaexceededexception"

    def is_not_found(self, status_code: int, body: Any) -> bool:
        """A ``ValidationException`` (400) on ``jobIdentifier``: the id cannot be a job's, so no
        job has it (Bedrock answers 404 only for a well-formed id of no job)."""
        if status_code != 400 or _error_type(body) != "validationexception":
            return False
        message = body.get("message") or body.get("Message") if isinstance(body, Mapping) else None
        return isinstance(message, str) and "jobidentifier" in message.lower()

    def job_problem(self, lines: int | None, size: int | None) -> str | None:
        """Why one job of ``lines`` records and ``size`` bytes cannot be created, or None."""
        if lines is not None and lines < self.min_records:
            return (
                f"{lines} record(s) but Bedrock runs a batch job of at least {self.min_records} "
                "(the connection extra 'min_records_per_job', the model's quota); add rows or "
                "use the synchronous API"
            )
        if lines is not None and lines > self.limits.max_lines:
            return (
                f"{lines} records but a Bedrock job takes at most {self.limits.max_lines} "
                "('max_records_per_job')"
            )
        if size is not None and size > self.limits.max_file_bytes:
            return (
                f"{size:,} bytes but a Bedrock input file takes at most "
                f"{self.limits.max_file_bytes:,} ('max_bytes_per_file')"
            )
        return None

    # ---- paths ----------------------------------------------------------------------
    def batch_path(self, batch_id: str) -> str:
        return f"model-invocation-job/{path_segment(batch_id, 'batch_id')}"

    def cancel_path(self, batch_id: str) -> str:
        return f"model-invocation-job/{path_segment(batch_id, 'batch_id')}/stop"

    def create_path(self, model: str | None, endpoint: str | None = None) -> str:
        return "model-invocation-job"

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        url = canonical.get("url")
        body = canonical.get("body")
        if not isinstance(body, Mapping):
            return None
        if url == EMBEDDINGS:
            return _embedding_problem(body)
        if self.native(body.get("model")):
            family = model_family(body.get("model"))
            if family is None:
                return (
                    f"model {body.get('model')!r} has no native body in the Bedrock dialect "
                    f"(invocation_type {self.invocation_type}): it encodes "
                    f"{', '.join(sorted(FAMILIES.values()))}; use invocation_type converse"
                )
            return native_problem(family, body)
        refused = sorted(k for k, v in body.items() if k not in _CHAT_FIELDS and v is not None)
        if refused:
            return f"{', '.join(refused)} not supported by Bedrock's Converse API"
        if body.get("n") not in (None, 1):
            return f"n={body.get('n')} not supported by Bedrock's Converse API (one answer per request)"
        return _messages_problem(body.get("messages"))

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """``{recordId, modelInput}``: a Converse request, or the embedding model's native body."""
        body = canonical["body"]
        if canonical.get("url") == EMBEDDINGS:
            text = body["input"]
            model_input: dict[str, Any] = {"inputText": text[0] if isinstance(text, list) else text}
            if body.get("dimensions") is not None:
                model_input["dimensions"] = body["dimensions"]
            return {"recordId": canonical["custom_id"], "modelInput": model_input}
        if self.native(body.get("model")):
            family = model_family(body.get("model"))
            assert family is not None  # checked by ``unsupported``
            native = native_request(family, body, converse_request(body) if family == "nova" else {})
            return {"recordId": canonical["custom_id"], "modelInput": native}
        return {"recordId": canonical["custom_id"], "modelInput": converse_request(body)}

    def native(self, model: Any) -> bool:
        """Whether chat records for ``model`` carry its native body (InvokeModel), not Converse:
        always with invocation_type "native", never with "converse", and with "auto" for the
        prompt-string families (``bedrock_native.PROMPT_FAMILIES``)."""
        if self.invocation_type == "native":
            return True
        return self.invocation_type == "auto" and model_family(model) in PROMPT_FAMILIES

    # ---- batches --------------------------------------------------------------------
    def object_create_body(
        self,
        *,
        input_uri: str,
        output_uri: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None,
        name: str | None,
        model: str | None,
    ) -> dict[str, Any]:
        # The name is the shard's key (the metadata's, else ``name``), or ``name`` when it is a
        # later generation of that key (``<key>-r<N>``, the Nth replacement): job names are unique
        # per account and region and the token is the name, so a replacement needs both new.
        key = (metadata or {}).get(NAME_KEY)
        job_name = name if name and (not key or _GENERATION.sub("", name) == key) else (key or name)
        if not job_name:
            raise ConfigurationError("a Bedrock job needs a name (the shard's idempotency key)")
        if not self.role_arn:
            raise ConfigurationError(
                "dialect 'bedrock' needs the service role Bedrock assumes to read and write S3: set the "
                "connection extra 'role_arn' (arn:aws:iam::<account>:role/<name>)"
            )
        body: dict[str, Any] = {
            "jobName": job_name,
            # The same key: a create sent again (a lost answer) returns the job the first made.
            "clientRequestToken": job_name,
            "roleArn": self.role_arn,
            "modelId": model,
            "inputDataConfig": {"s3InputDataConfig": {"s3Uri": input_uri, "s3InputFormat": "JSONL"}},
            "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": output_uri}},
            "timeoutDurationInHours": int(completion_window.rstrip("h")),
            "tags": [{"key": str(k), "value": str(v)[:256]} for k, v in (metadata or {}).items()],
        }
        if endpoint == CHAT and not self.native(model):
            body["modelInvocationType"] = "Converse"
        return body

    def create_name(self, body: Mapping[str, Any]) -> str | None:
        name = body.get("jobName")
        return name if isinstance(name, str) else None

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """A job (a create's ``{jobArn}`` too) as a ``Batch``; unreadable: ``BatchApiResponseError``."""
        raw = batch_object(raw)
        arn = raw.get("jobArn")
        if not isinstance(arn, str):
            raise BatchApiResponseError(
                f"model invocation job has a jobArn that is not a string ({type(arn).__name__})",
                body=dict(raw),
            )
        batch_id = job_id_of(arn)
        if batch_id is None:
            raise BatchApiResponseError(
                f"model invocation job has an unreadable jobArn {arn[:120]!r}", body=dict(raw)
            )
        status = raw.get("status", "Submitted" if set(raw) == {"jobArn"} else None)
        mapped = STATUSES.get(status) if isinstance(status, str) else None
        if mapped is None:
            raise UnknownBatchStatusError(
                f"batch {batch_id} reported unknown status {status!r}; known: {', '.join(STATUSES)}"
            )
        state = BatchState(mapped)
        name = raw.get("jobName")
        try:
            if name is not None and not isinstance(name, str):
                raise ValueError(f"jobName is {type(name).__name__}, not text")
            for count in ("totalRecordCount", "successRecordCount", "errorRecordCount"):
                value = raw.get(count)
                if value is not None and (type(value) is not int or value < 0):
                    raise ValueError(f"{count} is {value!r}, not a count")
            ended = to_utc(raw.get("endTime"))
            fields: dict[str, Any] = {_ENDED_AT[mapped]: ended} if mapped in _ENDED_AT and ended else {}
            message = raw.get("message")
            return Batch(
                id=batch_id,
                state=state,
                endpoint=CHAT if raw.get("modelInvocationType") == "Converse" else None,
                request_counts=RequestCounts(
                    total=raw.get("totalRecordCount"),
                    completed=raw.get("successRecordCount"),
                    failed=raw.get("errorRecordCount"),
                ),
                created_at=to_utc(raw.get("submitTime")),
                expires_at=to_utc(raw.get("jobExpirationTime")),
                # Every generation of a shard's job (``<key>-r<N>``) carries the shard's key.
                metadata={NAME_KEY: _GENERATION.sub("", name), "name": name}
                if isinstance(name, str) and name
                else {},
                errors=[BatchError(code=status, message=message)]
                if mapped == "failed" and isinstance(message, str)
                else [],
                raw=dict(raw),
                **fields,
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def listed_id(self, item: Any) -> str | None:
        return job_id_of(item.get("jobArn")) if isinstance(item, dict) else None

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {
            "maxResults": min(limit or self.list_page_size, 1000),
            "sortBy": "CreationTime",
            "sortOrder": "Descending",
        }

    def filter_params(self, metadata: Mapping[str, str], *, since: datetime | None = None) -> dict[str, Any]:
        """``nameContains`` (the shard's key, which every generation's name holds) and, given the
        intent's time, ``submitTimeAfter`` that time less ``SUBMIT_TIME_MARGIN``."""
        name = metadata.get(NAME_KEY) or metadata.get("name")
        if not name:
            return {}
        params: dict[str, Any] = {"nameContains": name}
        if since is not None:
            after = (since - SUBMIT_TIME_MARGIN).astimezone(timezone.utc)
            params["submitTimeAfter"] = after.isoformat(timespec="seconds").replace("+00:00", "Z")
        return params

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        raw = page_object(raw)
        data = page_items(raw, "invocationJobSummaries")
        token = raw.get("nextToken")
        if token is not None and not isinstance(token, str):
            raise BatchApiResponseError(f"{LIST_WHAT}: nextToken is {type(token).__name__}, not a string")
        return data, ({**params, "nextToken": token} if token else None)

    # ---- results --------------------------------------------------------------------
    def results_prefix_of(self, batch: Batch) -> str | None:
        """``<output s3Uri>/<job id>/``: where Bedrock writes this job's files (another job of the
        same output prefix, an earlier attempt, writes beside it under its own id)."""
        config = batch.raw.get("outputDataConfig")
        s3 = config.get("s3OutputDataConfig") if isinstance(config, dict) else None
        uri = s3.get("s3Uri") if isinstance(s3, dict) else None
        if not isinstance(uri, str) or not uri.startswith("s3://"):
            return None
        return f"{uri.rstrip('/')}/{batch.id}/"

    def result_object_kind(self, relative: str) -> ResultObjectKind | None:
        if relative == "manifest.json.out":
            return "summary"
        return "output" if relative.endswith(".jsonl.out") else None

    def check_summary(self, batch: Batch, summary: Any, read: Mapping[str, int]) -> str | None:
        """``manifest.json.out``'s processed records against the lines read (one per record)."""
        if not isinstance(summary, dict):
            return "manifest.json.out is not a JSON object"
        processed = summary.get("processedRecordCount")
        lines = sum(read.values())
        if isinstance(processed, int) and processed != lines:
            return (
                f"Bedrock's manifest counts {processed} processed record(s) but {lines} result "
                "line(s) were read"
            )
        return None

    def parse_result_line(self, raw: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """``{recordId, modelInput, modelOutput | error}`` as the chat-completion (or embeddings)
        answer, or the error, the merge reads."""
        custom_id = raw.get("recordId")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchApiResponseError("result line has no recordId", body={"keys": sorted(raw)})
        error = raw.get("error")
        output = raw.get("modelOutput")
        if error is not None or not isinstance(output, dict):
            return ResultLine(custom_id=custom_id, ok=False, error=_line_error(error), source="error")
        if "embedding" in output:
            body = _embeddings(output)
        elif isinstance(output.get("output"), dict):
            # Converse's answer, and Nova's native one (the same shape).
            body = chat_completion(output)
        elif is_native_output(output):
            body = native_completion(output)
        else:
            return ResultLine(
                custom_id=custom_id,
                ok=False,
                error=LineError(
                    code="invalid_output",
                    message="modelOutput is neither a Converse answer, a native chat answer nor an embedding",
                ),
                source="error",
            )
        return ResultLine(custom_id=custom_id, ok=True, status_code=200, body=body, source="output")


def _error_type(body: Any) -> str | None:
    """The exception name of an AWS error body (``__type``, maybe with a namespace), lower case."""
    if not isinstance(body, Mapping):
        return None
    kind = body.get("__type") or body.get("code")
    if not isinstance(kind, str):
        return None
    return kind.rpartition("#")[2].partition(":")[0].lower()


def _line_error(error: Any) -> LineError:
    if isinstance(error, Mapping):
        code = error.get("errorCode")
        text = str_or_none(error.get("errorMessage"))
        if isinstance(code, int) and not isinstance(code, bool):
            return LineError(code=f"http_{code}", message=text)
        return LineError(code=str_or_none(code) or "bedrock_error", message=text)
    if isinstance(error, str) and error:
        return LineError(code="bedrock_error", message=error)
    return LineError(code="invalid_output", message="the record has neither modelOutput nor an error")


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list for Bedrock's Converse API"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] is not an object"
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{index}] role {role!r} not supported by Bedrock's Converse API"
        content = message.get("content")
        if isinstance(content, list):
            bad = [p.get("type") for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
            if bad:
                return (
                    f"messages[{index}] content part(s) {bad} not supported by the Bedrock dialect's "
                    "Converse encoding (text only)"
                )
        for call in message.get("tool_calls") or []:
            if call_arguments(call) is None:
                return (
                    f"messages[{index}] tool_calls need a function name and JSON object arguments "
                    "(Converse toolUse input)"
                )
    return None


def _embedding_problem(body: Mapping[str, Any]) -> str | None:
    model = str(body.get("model") or "")
    if not model.startswith("amazon.titan-embed"):
        return (
            f"embedding model {model!r} not supported by the Bedrock dialect (its native body is "
            "encoded for Amazon Titan Text Embeddings, amazon.titan-embed-*)"
        )
    text = body.get("input")
    if isinstance(text, list):
        if len(text) != 1 or not isinstance(text[0], str):
            return "input must be one text for Bedrock's Titan embeddings (one record per text)"
    elif not isinstance(text, str):
        return "input must be a text for Bedrock's Titan embeddings"
    refused = sorted(
        k
        for k in body
        if k not in ("model", "input", "dimensions", "encoding_format") and body[k] is not None
    )
    if refused:
        return f"{', '.join(refused)} not supported by Bedrock's Titan embeddings"
    if body.get("encoding_format") not in (None, "float"):
        return "encoding_format must be float for Bedrock's Titan embeddings"
    return None


def converse_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A canonical chat body as a Converse request (checked by ``unsupported``)."""
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        # Converse alternates roles: consecutive turns of one role are one message.
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})

    for message in body.get("messages") or []:
        role = message.get("role")
        if role in ("system", "developer"):
            system.append({"text": text_content(message.get("content"))})
        elif role == "tool":
            add(
                "user",
                [
                    {
                        "toolResult": {
                            "toolUseId": message.get("tool_call_id"),
                            "content": [{"text": text_content(message.get("content"))}],
                        }
                    }
                ],
            )
        elif role == "assistant":
            blocks: list[dict[str, Any]] = []
            text = text_content(message.get("content"))
            if text:
                blocks.append({"text": text})
            for call in message.get("tool_calls") or []:
                function = call["function"]
                blocks.append(
                    {
                        "toolUse": {
                            "toolUseId": call.get("id"),
                            "name": function["name"],
                            "input": orjson.loads(function.get("arguments") or "{}"),
                        }
                    }
                )
            add("assistant", blocks)
        else:
            add("user", [{"text": text_content(message.get("content"))}])
    request: dict[str, Any] = {"messages": messages}
    if system:
        request["system"] = system
    config: dict[str, Any] = {}
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    if most is not None:
        config["maxTokens"] = most
    for source, target in (("temperature", "temperature"), ("top_p", "topP")):
        if body.get(source) is not None:
            config[target] = body[source]
    stop = body.get("stop")
    if stop:
        config["stopSequences"] = [stop] if isinstance(stop, str) else list(stop)
    if config:
        request["inferenceConfig"] = config
    if body.get("tools"):
        tools: dict[str, Any] = {
            "tools": [
                {
                    "toolSpec": {
                        "name": t["function"]["name"],
                        **(
                            {"description": t["function"]["description"]}
                            if t["function"].get("description")
                            else {}
                        ),
                        "inputSchema": {"json": t["function"].get("parameters") or {"type": "object"}},
                    }
                }
                for t in body["tools"]
            ]
        }
        choice = body.get("tool_choice")
        if choice == "required":
            tools["toolChoice"] = {"any": {}}
        elif choice == "auto":
            tools["toolChoice"] = {"auto": {}}
        elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
            tools["toolChoice"] = {"tool": {"name": choice["function"].get("name")}}
        request["toolConfig"] = tools
    return request


def chat_completion(output: Mapping[str, Any]) -> dict[str, Any]:
    """A Converse answer as a chat-completion body: text, tool calls, finish reason and usage
    (prompt tokens include cache reads and writes, as OpenAI's do; reads also in
    ``prompt_tokens_details.cached_tokens``)."""
    message = output["output"].get("message") or {}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or []:
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif isinstance(block.get("toolUse"), dict):
            use = block["toolUse"]
            calls.append(
                {
                    "id": use.get("toolUseId"),
                    "type": "function",
                    "function": {
                        "name": use.get("name"),
                        "arguments": orjson.dumps(use.get("input") or {}).decode(),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        reply["tool_calls"] = calls
    stop = output.get("stopReason")
    body: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": reply,
                "finish_reason": FINISH_REASONS.get(stop, stop) if isinstance(stop, str) else None,
            }
        ],
    }
    usage = output.get("usage")
    if isinstance(usage, dict):
        # Nova's native answer names its cache counts ``cache...InputTokenCount``.
        nova = {
            k.replace("TokenCount", "Tokens"): v for k, v in usage.items() if k.endswith("InputTokenCount")
        }
        usage = {**nova, **usage}
        counts = {
            k: v
            for k in ("inputTokens", "outputTokens", "cacheReadInputTokens", "cacheWriteInputTokens")
            if type(v := usage.get(k)) is int
        }
        prompt = sum(
            counts.get(k, 0) for k in ("inputTokens", "cacheReadInputTokens", "cacheWriteInputTokens")
        )
        completion = counts.get("outputTokens", 0)
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            **(
                {"prompt_tokens_details": {"cached_tokens": counts["cacheReadInputTokens"]}}
                if "cacheReadInputTokens" in counts
                else {}
            ),
        }
    return body


def _embeddings(output: Mapping[str, Any]) -> dict[str, Any]:
    """A Titan embedding answer as an embeddings body."""
    tokens = output.get("inputTextTokenCount")
    body: dict[str, Any] = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": output.get("embedding")}],
    }
    if type(tokens) is int:
        body["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
    return body
