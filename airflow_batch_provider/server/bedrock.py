"""``serve --dialect bedrock``: Amazon Bedrock's model invocation jobs, reading and writing S3.

Written from Bedrock's API reference (REST paths and JSON shapes of ``CreateModelInvocationJob``,
``GetModelInvocationJob``, ``ListModelInvocationJobs``, ``StopModelInvocationJob``), not from the
provider's dialect. Every request must carry an AWS Signature Version 4 for the service
``bedrock``: with a server key ``<access key id>:<secret access key>`` the signature is
recomputed (botocore's canonical request over the signed headers and the body) and compared, so
an unsigned, re-signed or altered request is refused as AWS refuses it (403
``UnrecognizedClientException`` / ``InvalidSignatureException``). Errors are AWS's REST JSON
errors: ``x-amzn-ErrorType`` and ``{"message"}`` (with ``__type``).

A create downloads the input object (``s3InputDataConfig.s3Uri``, a file or every ``.jsonl``
under a folder) from the S3 endpoint the server is given (``s3_endpoint_url``: the test suite's
moto server; boto3's default credentials), runs its ``{recordId, modelInput}`` lines through the
server's engine, and once the job has ended writes ``<name>.out`` for each input file and
``manifest.json.out`` under ``<output s3Uri>/<job id>/``, as Bedrock does. Records a stop or an
expiry left unrun get no line (Bedrock writes none). ``clientRequestToken`` makes a create
idempotent: the same token answers the job it first made; a job name in use is refused (400
ValidationException), names being unique per account and region. A ``jobIdentifier`` that is
neither a 12-character id nor a job ARN is a 400 ValidationException; a well-formed one of no
job a 404 ResourceNotFoundException. The listing honours ``nameContains``, ``statusEquals``,
``submitTimeAfter``/``submitTimeBefore``, ``sortBy`` and ``sortOrder``, checked as the service
model constrains them.

An ``InvokeModel`` chat job (no ``modelInvocationType``) reads each record as its model family's
native body, chosen by the model id (Anthropic Claude, Meta Llama, Mistral, Amazon Titan Text,
Amazon Nova, after any inference-profile prefix such as ``us.``), and answers in that family's
native response shape; a body that is not the family's fails the job's validation.
"""

from __future__ import annotations

import hmac
import re
import secrets
import string
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Any

import orjson

from airflow_batch_provider.server.wire import SYSTEM_MESSAGES, ApiError, Wire

ACCOUNT = "123456789012"
_JOB_NAME = re.compile(r"[a-zA-Z0-9]{1,63}(-*[a-zA-Z0-9\+\-\.]){0,63}")
_TOKEN = re.compile(r"[a-zA-Z0-9]{1,256}(-*[a-zA-Z0-9]){0,256}")
_ROLE = re.compile(r"arn:aws(-[^:]+)?:iam::([0-9]{12})?:role/.+")
_S3_URI = re.compile(r"s3://([a-z0-9][-.a-z0-9]{1,61}[a-z0-9])(/.*)?")
_CREDENTIAL = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([a-z0-9-]+)/([a-z0-9-]+)/aws4_request,\s*"
    r"SignedHeaders=([a-z0-9;\-]+),\s*Signature=([0-9a-f]{64})"
)
# ``jobIdentifier`` as the service model constrains it: a job id, or the job's ARN.
_JOB_IDENTIFIER = re.compile(
    r"(?:arn:aws(?:-[^:]+)?:bedrock:[a-z0-9-]{1,20}:[0-9]{12}:model-invocation-job/)?([a-z0-9]{12})"
)
_JOB_STATUSES = (
    "Submitted",
    "InProgress",
    "Completed",
    "Failed",
    "Stopping",
    "Stopped",
    "PartiallyCompleted",
    "Expired",
    "Validating",
    "Scheduled",
)
_ID_CHARS = string.ascii_lowercase + string.digits


def submitted(value: float) -> datetime:
    """An epoch time as the instant the API shows (whole microseconds, UTC)."""
    return datetime.fromtimestamp(value, tz=timezone.utc)


def _iso(value: float | None) -> str | None:
    if value is None:
        return None
    return submitted(value).isoformat().replace("+00:00", "Z")


def new_job_id() -> str:
    """A 12-character job id (lower-case letters and digits), as Bedrock issues."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(12))


class BedrockWire(Wire):
    """Amazon Bedrock's control plane for batch inference (model invocation jobs)."""

    name = "bedrock"
    vendor_lines = True
    upload_requires_purpose = False
    # Failed records are lines of the one ``.out`` file, beside the answers.
    one_results_file = True
    signed_requests = True
    path_prefixes = ("",)
    batches_route = "model-invocation-jobs"
    # Stopping an ended job: a ValidationException.
    cancel_final_status = 400
    region = "us-east-1"
    MAX_RESULTS = 1000
    _TYPES = {
        400: "ValidationException",
        401: "UnrecognizedClientException",
        403: "AccessDeniedException",
        404: "ResourceNotFoundException",
        405: "ValidationException",
        409: "ConflictException",
        413: "ValidationException",
        429: "ThrottlingException",
        500: "InternalServerException",
        503: "ServiceUnavailableException",
    }

    # ---- errors and auth ----------------------------------------------------------
    def error(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> ApiError:
        kind = self._TYPES.get(status, "InternalServerException" if status >= 500 else "ValidationException")
        if code in ("ServiceQuotaExceededException", "ConflictException", "InvalidSignatureException"):
            kind = code
        return ApiError(
            status, {"__type": kind, "message": message}, {"x-amzn-ErrorType": kind, **(headers or {})}
        )

    def quota_exceeded(self) -> ApiError:
        return self.error(
            400,
            "The number of jobs in progress exceeds the account's quota.",
            code="ServiceQuotaExceededException",
        )

    def rate_limited(self, retry_after: float) -> ApiError:
        return self.error(429, "Too many requests, please wait before trying again.")

    def server_error(self, status: int, retry_after: float) -> ApiError:
        return self.error(status, "The service is unavailable; try again.")

    def not_found(self, what: str, ident: str) -> ApiError:
        return self.error(404, f"The model invocation job {ident} could not be found.")

    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        found = _CREDENTIAL.match(headers.get("authorization") or "")
        return found.group(1) if found else None

    def check_key(self, headers: Mapping[str, str], api_key: str | None) -> None:
        """The admin endpoints' guard: a bearer of the whole key (``<id>:<secret>``)."""
        if api_key is None:
            return
        auth = headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise self.error(403, "The security token included in the request is invalid.")

    def check_signature(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes, api_key: str | None
    ) -> None:
        """Refuse a request without a valid SigV4 signature for ``bedrock`` by the server's key."""
        found = _CREDENTIAL.match(headers.get("authorization") or "")
        if found is None:
            raise self.error(
                403, "Missing Authentication Token: requests must be signed with AWS Signature Version 4."
            )
        key_id, day, region, service, signed, signature = found.groups()
        if service != "bedrock":
            raise self.error(
                403, f"Credential should be scoped to correct service: 'bedrock', not {service!r}."
            )
        amz_date = headers.get("x-amz-date") or ""
        if not amz_date.startswith(day):
            raise self.error(403, "The credential date does not match X-Amz-Date.")
        if api_key is None:
            return
        expected_id, _, secret = api_key.partition(":")
        if not hmac.compare_digest(key_id.encode(), expected_id.encode()):
            raise self.error(403, "The security token included in the request is invalid.")
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        names = signed.split(";")
        chosen = {name: headers.get(name, "") for name in names}
        request = AWSRequest(method=method, url=url, data=body, headers=chosen)
        request.context["timestamp"] = amz_date
        signer = SigV4Auth(Credentials(key_id, secret), "bedrock", region)
        canonical = signer.canonical_request(request)
        computed = signer.signature(signer.string_to_sign(request, canonical), request)
        if not hmac.compare_digest(computed, signature):
            raise self.error(
                403,
                "The request signature we calculated does not match the signature you provided.",
                code="InvalidSignatureException",
            )

    # ---- create ---------------------------------------------------------------------
    def parse_create(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise self.error(400, "The request body must be a JSON object.")
        name = body.get("jobName")
        if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
            raise self.error(
                400, "1 validation error detected: Value at 'jobName' failed to satisfy constraint."
            )
        token = body.get("clientRequestToken")
        if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
            raise self.error(400, "Value at 'clientRequestToken' failed to satisfy constraint.")
        role = body.get("roleArn")
        if not isinstance(role, str) or not _ROLE.fullmatch(role):
            raise self.error(400, "Value at 'roleArn' failed to satisfy constraint.")
        model = body.get("modelId")
        if not isinstance(model, str) or not model:
            raise self.error(400, "Value at 'modelId' failed to satisfy constraint.")
        source = _uri(body, "inputDataConfig", "s3InputDataConfig")
        target = _uri(body, "outputDataConfig", "s3OutputDataConfig")
        if source is None or target is None:
            raise self.error(
                400,
                "inputDataConfig.s3InputDataConfig.s3Uri and "
                "outputDataConfig.s3OutputDataConfig.s3Uri are required.",
            )
        hours = body.get("timeoutDurationInHours", 24)
        if not isinstance(hours, int) or isinstance(hours, bool) or not 24 <= hours <= 168:
            raise self.error(
                400, "Value at 'timeoutDurationInHours' failed to satisfy constraint: 24 to 168."
            )
        kind = body.get("modelInvocationType", "InvokeModel")
        if kind not in ("InvokeModel", "Converse"):
            raise self.error(400, "Value at 'modelInvocationType' must be InvokeModel or Converse.")
        tags = body.get("tags") or []
        if not isinstance(tags, list) or len(tags) > 200:
            raise self.error(400, "tags must be a list of at most 200 {key, value}.")
        return {
            "input_file_id": None,
            # InvokeModel bodies of an embedding model are embeddings requests; the others chat.
            "endpoint": "/v1/chat/completions"
            if kind == "Converse" or "embed" not in model
            else "/v1/embeddings",
            "completion_window": f"{hours}h",
            "metadata": None,
            "name": name,
            "model": model,
            "bedrock": {
                "token": token,
                "roleArn": role,
                "input": source,
                "output": target,
                "tags": tags,
                "type": kind,
                "hours": hours,
            },
        }

    def canonical_line(self, obj: Any, rec: Mapping[str, Any]) -> Any:
        """``{recordId, modelInput}`` as the canonical line the backend answers."""
        if not isinstance(obj, dict):
            return obj
        extra = sorted(set(obj) - {"recordId", "modelInput"})
        if extra:
            raise ValueError(f"unexpected field(s) {', '.join(extra)}: a record is {{recordId, modelInput}}")
        record = obj.get("recordId")
        model_input = obj.get("modelInput")
        if not isinstance(model_input, dict):
            raise ValueError("a record needs a modelInput object")
        model = str(rec.get("model") or "")
        if rec["endpoint"] == "/v1/embeddings":
            text = model_input.get("inputText")
            if not isinstance(text, str):
                raise ValueError("modelInput.inputText must be a text")
            body: dict[str, Any] = {"model": model, "input": text}
            if model_input.get("dimensions") is not None:
                body["dimensions"] = model_input["dimensions"]
        elif _invocation_type(rec, model_input) == "InvokeModel":
            # The model family's own body (Bedrock's InvokeModel request for that model).
            body = {"model": model, **native_chat(model_family(model), model_input)}
        else:
            body = {"model": model, "messages": _chat_messages(model_input)}
            config = model_input.get("inferenceConfig") or {}
            if not isinstance(config, dict):
                raise ValueError("modelInput.inferenceConfig must be an object")
            for source, target in (
                ("maxTokens", "max_tokens"),
                ("temperature", "temperature"),
                ("topP", "top_p"),
            ):
                if config.get(source) is not None:
                    body[target] = config[source]
            if config.get("stopSequences"):
                body["stop"] = list(config["stopSequences"])
        return {"custom_id": record, "method": "POST", "url": rec["endpoint"], "body": body}

    # ---- jobs ---------------------------------------------------------------------------
    def job_id(self, identifier: str) -> str:
        """The job id a ``jobIdentifier`` names (the 12-character id, or the job's ARN). One that
        fits neither is refused as Bedrock refuses it: a 400 ValidationException naming the
        constraint; a well-formed id of no job is the caller's 404 ResourceNotFoundException."""
        found = _JOB_IDENTIFIER.fullmatch(identifier)
        if found is None:
            raise self.error(
                400,
                f"1 validation error detected: Value '{identifier[:100]}' at 'jobIdentifier' failed "
                "to satisfy constraint: Member must satisfy regular expression pattern: "
                f"{_JOB_IDENTIFIER.pattern}",
            )
        return found.group(1)

    def job_arn(self, job_id: str) -> str:
        return f"arn:aws:bedrock:{self.region}:{ACCOUNT}:model-invocation-job/{job_id}"

    def status_of(self, rec: Mapping[str, Any]) -> str:
        status = str(rec["status"])
        if status == "completed":
            return "PartiallyCompleted" if self._errors(rec) else "Completed"
        return {
            "validating": "Validating" if rec.get("in_progress_at") is None else "InProgress",
            "in_progress": "InProgress",
            "finalizing": "InProgress",
            "failed": "Failed",
            "expired": "Expired",
            "cancelling": "Stopping",
            "cancelled": "Stopped",
        }[status]

    @staticmethod
    def _errors(rec: Mapping[str, Any]) -> int:
        """Records answered with an error (those a stop or expiry left unrun are not processed)."""
        progress = rec.get("progress") or {}
        unrun = int(progress.get("cancelled") or 0) + int(progress.get("expired") or 0)
        return max(int(rec["request_counts"]["failed"]) - unrun, 0)

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        job = rec.get("bedrock") or {}
        counts = rec["request_counts"]
        errors = self._errors(rec)
        ended = (
            rec.get("completed_at")
            or rec.get("failed_at")
            or rec.get("expired_at")
            or rec.get("cancelled_at")
        )
        item: dict[str, Any] = {
            "jobArn": self.job_arn(rec["id"]),
            "jobName": rec.get("name"),
            "modelId": rec.get("model"),
            "roleArn": job.get("roleArn"),
            "status": self.status_of(rec),
            "submitTime": _iso(rec["created_at"]),
            "lastModifiedTime": _iso(ended or rec.get("in_progress_at") or rec["created_at"]),
            "inputDataConfig": {"s3InputDataConfig": {"s3Uri": job.get("input"), "s3InputFormat": "JSONL"}},
            "outputDataConfig": {"s3OutputDataConfig": {"s3Uri": job.get("output")}},
            "timeoutDurationInHours": job.get("hours"),
            "jobExpirationTime": _iso(rec.get("expires_at")),
            "modelInvocationType": job.get("type"),
            "totalRecordCount": int(counts["total"]),
            "processedRecordCount": int(counts["completed"]) + errors,
            "successRecordCount": int(counts["completed"]),
            "errorRecordCount": errors,
        }
        if job.get("token"):
            item["clientRequestToken"] = job["token"]
        if ended:
            item["endTime"] = _iso(ended)
        if rec["status"] == "failed":
            failures = rec.get("errors") or [{}]
            item["message"] = str(failures[0].get("message") or failures[0].get("code") or "The job failed.")
        return item

    def render_cancelled(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def list_page_args(self, params: Mapping[str, str]) -> tuple[str | None, int]:
        raw = params.get("maxResults") or "100"
        if not raw.isdigit() or not 1 <= int(raw) <= self.MAX_RESULTS:
            raise self.error(400, f"maxResults must be 1..{self.MAX_RESULTS}.")
        return params.get("nextToken") or None, int(raw)

    def list_filters(
        self, params: Mapping[str, str]
    ) -> tuple[str | None, datetime | None, datetime | None, bool]:
        """``ListModelInvocationJobs``' filters, checked as Bedrock checks them: ``statusEquals``,
        ``submitTimeAfter`` and ``submitTimeBefore`` (ISO-8601, as aware datetimes), and whether
        ``sortOrder`` is Ascending (``sortBy`` takes only CreationTime)."""
        status = params.get("statusEquals") or None
        if status is not None and status not in _JOB_STATUSES:
            raise self.error(
                400,
                f"Value '{status[:40]}' at 'statusEquals' failed to satisfy constraint: "
                f"Member must satisfy enum value set: [{', '.join(_JOB_STATUSES)}]",
            )
        for name, allowed in (("sortBy", ("CreationTime",)), ("sortOrder", ("Ascending", "Descending"))):
            value = params.get(name)
            if value is not None and value not in allowed:
                raise self.error(
                    400,
                    f"Value '{value[:40]}' at '{name}' failed to satisfy constraint: "
                    f"Member must satisfy enum value set: [{', '.join(allowed)}]",
                )
        bounds: list[datetime | None] = []
        for name in ("submitTimeAfter", "submitTimeBefore"):
            raw = params.get(name)
            if raw is None:
                bounds.append(None)
                continue
            try:
                when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            except ValueError:
                raise self.error(
                    400, f"Value '{raw[:40]}' at '{name}' is not an ISO-8601 timestamp."
                ) from None
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            bounds.append(when)
        return status, bounds[0], bounds[1], params.get("sortOrder") == "Ascending"

    def render_batch_list(self, items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
        page: dict[str, Any] = {"invocationJobSummaries": [self.render_batch(r) for r in items]}
        if has_more and items:
            page["nextToken"] = items[-1]["id"]
        return page

    def is_cancel_path(self, tail: str) -> bool:
        return tail == "stop"

    # ---- result lines -------------------------------------------------------------------
    def response_line(
        self, line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        # ``modelInput`` is echoed back by Bedrock; the server keeps lines small and omits it.
        if 200 <= status < 300 and isinstance(body, Mapping):
            return True, {"recordId": custom_id, "modelOutput": _model_output(body)}
        inner = body.get("error") if isinstance(body, Mapping) else None
        message = inner.get("message") if isinstance(inner, Mapping) else None
        return False, {
            "recordId": custom_id,
            "error": {
                "errorCode": status,
                "errorMessage": str(message or f"request failed with HTTP {status}"),
            },
        }

    def result_line(
        self, rec: Mapping[str, Any], line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        """An answer of an InvokeModel chat job is the model family's own response body."""
        ok, line = self.response_line(line_id, custom_id, status, body, request_id)
        job = rec.get("bedrock") or {}
        if ok and job.get("type") == "InvokeModel" and rec["endpoint"] == "/v1/chat/completions":
            line["modelOutput"] = native_output(model_family(str(rec.get("model") or "")), body)
        return ok, line

    def system_line(
        self, line_id: str, custom_id: str, code: str, message: str | None = None, param: Any = None
    ) -> dict[str, Any]:
        # Kept in the server's own error file only: Bedrock writes no line for an unrun record.
        return {
            "recordId": custom_id,
            "error": {"errorCode": code, "errorMessage": message or SYSTEM_MESSAGES.get(code, code)},
        }


def _uri(body: Mapping[str, Any], outer: str, inner: str) -> str | None:
    config = body.get(outer)
    s3 = config.get(inner) if isinstance(config, dict) else None
    uri = s3.get("s3Uri") if isinstance(s3, dict) else None
    return uri if isinstance(uri, str) and _S3_URI.fullmatch(uri) else None


def _chat_messages(model_input: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A Converse request's ``system`` and ``messages`` as chat messages (text and tool blocks)."""
    messages: list[dict[str, Any]] = []
    system = model_input.get("system") or []
    if not isinstance(system, list):
        raise ValueError("modelInput.system must be a list of blocks")
    if system:
        messages.append({"role": "system", "content": "".join(str(b.get("text") or "") for b in system)})
    turns = model_input.get("messages")
    if not isinstance(turns, list) or not turns:
        raise ValueError("modelInput.messages must be a non-empty list")
    for turn in turns:
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise ValueError("modelInput.messages holds an item that is not a user or assistant turn")
        blocks = turn.get("content")
        if not isinstance(blocks, list) or not blocks:
            raise ValueError("a message's content must be a non-empty list of blocks")
        text = []
        for block in blocks:
            if not isinstance(block, dict):
                raise ValueError("a content block is not an object")
            if "text" in block:
                text.append(str(block["text"]))
            elif "toolResult" in block:
                parts = block["toolResult"].get("content") or []
                text.append("".join(str(p.get("text") or "") for p in parts if isinstance(p, dict)))
            elif "toolUse" in block:
                text.append(orjson.dumps(block["toolUse"].get("input") or {}).decode())
            else:
                raise ValueError(f"content block {sorted(block)} is not supported by this server")
        messages.append({"role": turn["role"], "content": "".join(text)})
    return messages


# ---- native (InvokeModel) chat bodies, per model family ---------------------------------
# From Bedrock's "Inference request parameters and response fields for foundation models".
_FAMILIES = {
    "anthropic.": "anthropic",
    "meta.": "meta",
    "mistral.": "mistral",
    "amazon.titan-text": "titan-text",
    "amazon.nova": "nova",
}
_GEOGRAPHY = re.compile(r"(?:us|eu|apac|us-gov|ca|jp|au|global)\.")
_LLAMA_TURN = re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.DOTALL)
_MISTRAL_TURN = re.compile(r"\[INST\](.*?)\[/INST\]([^\[]*)", re.DOTALL)


def model_family(model: str) -> str | None:
    """The family of a model id, inference profile (``us.meta...``) or ARN; None if unknown."""
    ident = model.rpartition("/")[2]
    found = _GEOGRAPHY.match(ident)
    ident = ident[found.end() :] if found else ident
    return next((f for prefix, f in _FAMILIES.items() if ident.startswith(prefix)), None)


def _invocation_type(rec: Mapping[str, Any], model_input: Mapping[str, Any]) -> str:
    """The job's ``modelInvocationType`` (a record not yet stored: judged by the body's shape)."""
    kind = (rec.get("bedrock") or {}).get("type")
    if kind:
        return str(kind)
    native = ("prompt", "inputText", "anthropic_version", "schemaVersion")
    return "InvokeModel" if any(k in model_input for k in native) else "Converse"


def native_chat(family: str | None, model_input: Mapping[str, Any]) -> dict[str, Any]:
    """A family's native request body as canonical chat fields (``ValueError`` if it is not one)."""
    if family == "anthropic":
        if model_input.get("anthropic_version") != "bedrock-2023-05-31":
            raise ValueError("modelInput.anthropic_version must be bedrock-2023-05-31")
        if "model" in model_input:
            raise ValueError("modelInput.model is not a field of Claude's Bedrock body")
        if type(model_input.get("max_tokens")) is not int:
            raise ValueError("modelInput.max_tokens is required")
        messages: list[dict[str, Any]] = []
        system = model_input.get("system")
        if system:
            text = system if isinstance(system, str) else "".join(str(b.get("text") or "") for b in system)
            messages.append({"role": "system", "content": text})
        for turn in model_input.get("messages") or []:
            content = turn.get("content")
            if isinstance(content, list):
                content = "".join(str(b.get("text") or "") for b in content if isinstance(b, dict))
            messages.append({"role": turn.get("role"), "content": str(content or "")})
        return _sampling(
            {"messages": messages},
            model_input,
            max_tokens="max_tokens",
            top_p="top_p",
            stop="stop_sequences",
        )
    if family == "meta":
        prompt = model_input.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("modelInput.prompt must be a text")
        turns = [{"role": r, "content": t} for r, t in _LLAMA_TURN.findall(prompt)]
        return _sampling(
            {"messages": turns or [{"role": "user", "content": prompt}]},
            model_input,
            max_tokens="max_gen_len",
            top_p="top_p",
        )
    if family == "mistral":
        prompt = model_input.get("prompt")
        if not isinstance(prompt, str) or "[INST]" not in prompt:
            raise ValueError("modelInput.prompt must hold [INST] ... [/INST]")
        turns = []
        for instruction, reply in _MISTRAL_TURN.findall(prompt):
            turns.append({"role": "user", "content": instruction.strip()})
            if reply.replace("</s>", "").strip():
                turns.append({"role": "assistant", "content": reply.replace("</s>", "").strip()})
        return _sampling(
            {"messages": turns}, model_input, max_tokens="max_tokens", top_p="top_p", stop="stop"
        )
    if family == "titan-text":
        input_text = model_input.get("inputText")
        if not isinstance(input_text, str) or not input_text:
            raise ValueError("modelInput.inputText must be a text")
        config = model_input.get("textGenerationConfig") or {}
        if not isinstance(config, dict):
            raise ValueError("modelInput.textGenerationConfig must be an object")
        return _sampling(
            {"messages": [{"role": "user", "content": input_text}]},
            config,
            max_tokens="maxTokenCount",
            top_p="topP",
            stop="stopSequences",
        )
    if family == "nova":
        config = model_input.get("inferenceConfig") or {}
        if not isinstance(config, dict):
            raise ValueError("modelInput.inferenceConfig must be an object")
        return _sampling(
            {"messages": _chat_messages(model_input)},
            config,
            max_tokens="max_new_tokens",
            top_p="top_p",
            stop="stopSequences",
        )
    raise ValueError(
        "this server reads InvokeModel chat bodies of anthropic, meta, mistral, titan-text and nova models"
    )


def _sampling(
    body: dict[str, Any], source: Mapping[str, Any], *, max_tokens: str, top_p: str, stop: str | None = None
) -> dict[str, Any]:
    """``body`` with the sampling fields ``source`` names its own way."""
    for theirs, ours in ((max_tokens, "max_tokens"), ("temperature", "temperature"), (top_p, "top_p")):
        if source.get(theirs) is not None:
            body[ours] = source[theirs]
    if stop and source.get(stop):
        body["stop"] = list(source[stop])
    return body


def native_output(family: str | None, body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completion answer as the family's native response body."""
    choice = (body.get("choices") or [{}])[0]
    text = str((choice.get("message") or {}).get("content") or "")
    usage = body.get("usage") or {}
    prompt, answer = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    finish = choice.get("finish_reason")
    long = finish == "length"
    if family == "anthropic":
        return {
            "id": f"msg_bdrk_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": text}],
            "stop_reason": "max_tokens" if long else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": prompt, "output_tokens": answer},
        }
    if family == "meta":
        return {
            "generation": text,
            "prompt_token_count": prompt,
            "generation_token_count": answer,
            "stop_reason": "length" if long else "stop",
        }
    if family == "mistral":
        return {"outputs": [{"text": text, "stop_reason": "length" if long else "stop"}]}
    if family == "titan-text":
        return {
            "inputTextTokenCount": prompt,
            "results": [
                {"tokenCount": answer, "outputText": text, "completionReason": "LENGTH" if long else "FINISH"}
            ],
        }
    return _model_output(body)  # Nova answers in the Converse shape


_STOP = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "content_filtered",
}


def _model_output(body: Mapping[str, Any]) -> dict[str, Any]:
    """A chat-completion (or embeddings) answer as Bedrock's ``modelOutput``."""
    usage = body.get("usage") or {}
    if body.get("object") == "list":
        data = (body.get("data") or [{}])[0]
        return {
            "embedding": data.get("embedding"),
            "inputTextTokenCount": int(usage.get("prompt_tokens") or 0),
        }
    choice = (body.get("choices") or [{}])[0]
    reply = choice.get("message") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    answer = int(usage.get("completion_tokens") or 0)
    return {
        "output": {"message": {"role": "assistant", "content": [{"text": str(reply.get("content") or "")}]}},
        "stopReason": _STOP.get(choice.get("finish_reason"), "end_turn"),
        "usage": {"inputTokens": prompt, "outputTokens": answer, "totalTokens": prompt + answer},
        "metrics": {"latencyMs": 1},
    }


# ---- S3 ---------------------------------------------------------------------------------
def s3_client(endpoint_url: str | None) -> Any:
    """A boto3 S3 client for the server's S3 endpoint (boto3's default credentials)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def input_keys(client: Any, uri: str) -> list[tuple[str, str]]:
    """``(bucket, key)`` of each input object: the object itself, or every ``.jsonl`` under a folder."""
    bucket, key = split_uri(uri)
    if key and not key.endswith("/"):
        try:
            client.head_object(Bucket=bucket, Key=key)
            return [(bucket, key)]
        except Exception:  # noqa: S110 (not an object: read it as a folder)
            pass
        key += "/"
    found: list[tuple[str, str]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
        found.extend((bucket, o["Key"]) for o in page.get("Contents", []) if o["Key"].endswith(".jsonl"))
    return sorted(found)


def download_input(client: Any, uri: str, dest: Any) -> str:
    """Copy the input object(s) into ``dest`` (one JSONL); the first input's file name."""
    keys = input_keys(client, uri)
    if not keys:
        raise FileNotFoundError(uri)
    with open(dest, "wb") as out:
        for bucket, key in keys:
            body = client.get_object(Bucket=bucket, Key=key)["Body"]
            while chunk := body.read(1 << 20):
                out.write(chunk)
    return PurePosixPath(keys[0][1]).name


def export_results(client: Any, rec: Mapping[str, Any], output: Any, item: Mapping[str, Any]) -> None:
    """Write ``<input name>.out`` and ``manifest.json.out`` under ``<output s3Uri>/<job id>/``."""
    job = rec["bedrock"]
    bucket, prefix = split_uri(str(job["output"]))
    folder = f"{prefix.rstrip('/')}/{rec['id']}/".lstrip("/")
    if output is not None:
        with open(output, "rb") as body:
            client.put_object(Bucket=bucket, Key=f"{folder}{job['input_name']}.out", Body=body.read())
    manifest = {
        "totalRecordCount": item["totalRecordCount"],
        "processedRecordCount": item["processedRecordCount"],
        "successRecordCount": item["successRecordCount"],
        "errorRecordCount": item["errorRecordCount"],
    }
    client.put_object(Bucket=bucket, Key=f"{folder}manifest.json.out", Body=orjson.dumps(manifest))
