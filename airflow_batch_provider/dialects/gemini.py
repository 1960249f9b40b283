"""Google's Gemini API Batch Mode: a JSONL file uploaded to the Files API, batches as operations.

Built to Google's public Gemini API reference and its official Python SDK (``google-genai``):
requests carry ``x-goog-api-key``; the input file is uploaded with the Files API's resumable
protocol (``POST /upload/v1beta/files`` starts a session, its ``X-Goog-Upload-URL`` takes the
bytes with ``upload, finalize``; a dropped upload is resumed from the offset the server
reports), its lines ``{"key", "request": GenerateContentRequest}``. A batch is created with
``POST /v1beta/models/{model}:batchGenerateContent`` and ``{"batch": {"displayName",
"inputConfig": {"fileName"}}}`` (one model per batch); it is a long-running operation
``{name: "batches/...", metadata: GenerateContentBatch, done, error}`` whose metadata holds the
state (``BATCH_STATE_*``), ``batchStats`` (int64 counts, sent as strings) and, once done,
``output.responsesFile``. ``GET /v1beta/batches`` pages with ``pageSize``/``pageToken``
(``{operations, nextPageToken}``) and has no filter: a batch lost in a crash is found by the
display name carrying its shard's idempotency key. ``POST batches/{id}:cancel`` answers ``{}``.
The responses file, downloaded with ``GET files/{id}:download?alt=media``, has lines
``{"key", "response": GenerateContentResponse}`` or ``{"key", "error": Status}``, in no order:
they are matched by key only.

Staging holds the canonical (OpenAI chat-completions) line; :meth:`GeminiDialect.encode_line`
turns it into a ``GenerateContentRequest`` and :meth:`GeminiDialect.parse_result_line` turns each
answer back into a chat-completion body, so the merge's columns are those of every vendor. Function
tools become ``functionDeclarations`` (``tool_choice`` the ``functionCallingConfig``), assistant tool
calls ``functionCall`` parts and tool turns ``functionResponse`` parts; a ``functionCall`` answer
comes back as ``tool_calls``. What has no Gemini field (``logit_bias``, ``n`` > 1, embeddings...)
is refused by name before any upload.
Ids are kept without their ``batches/`` and ``files/`` prefixes; paths accept either form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import orjson

from airflow_batch_provider.dialects.base import (
    LIST_WHAT,
    Dialect,
    ResultsMode,
    batch_object,
    bind_models,
    page_items,
    page_object,
    str_or_none,
)
from airflow_batch_provider.dialects.chat import forced_tool, text_content
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.ids import id_problem, path_segment
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
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
# Each endpoint's custom method on ``models/{model}``, and the metadata type of its batches.
CREATE_METHODS = {CHAT: "batchGenerateContent", EMBEDDINGS: "asyncBatchEmbedContent"}
EMBED_BATCH_TYPE = "EmbedContentBatch"
# Canonical embeddings parameters an EmbedContentRequest has a field for.
_EMBED_MAPPED = frozenset({"model", "input", "dimensions", "encoding_format"})
# The metadata key whose value becomes the batch's display name (the shard's idempotency key).
NAME_KEY = "airflow_batch_key"
GB = 1024 * MB

# Gemini's batch states, in the provider's vocabulary.
STATES: dict[str, str] = {
    "BATCH_STATE_PENDING": "validating",
    "BATCH_STATE_RUNNING": "in_progress",
    "BATCH_STATE_SUCCEEDED": "completed",
    "BATCH_STATE_FAILED": "failed",
    "BATCH_STATE_CANCELLED": "cancelled",
    "BATCH_STATE_EXPIRED": "expired",
}
# Candidate finish reasons in the chat-completions vocabulary the merge reads.
FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
}
# Canonical chat parameters a GenerateContentRequest has a field for (the rest are refused by name).
_MAPPED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "response_format",
        "stream",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
_TOOL_MODES = {"auto": "AUTO", "none": "NONE", "required": "ANY"}
# Keywords of Gemini's ``responseSchema`` (an OpenAPI 3.0 schema subset).
_SCHEMA_KEYS = frozenset(
    {
        "type",
        "format",
        "title",
        "description",
        "nullable",
        "enum",
        "maxItems",
        "minItems",
        "properties",
        "required",
        "minProperties",
        "maxProperties",
        "minLength",
        "maxLength",
        "pattern",
        "example",
        "anyOf",
        "propertyOrdering",
        "default",
        "items",
        "minimum",
        "maximum",
    }
)
_DATA_URL = re.compile(r"data:([a-zA-Z0-9.+-]+/[a-zA-Z0-9.+-]+);base64,(.*)", re.DOTALL)


def _short(value: Any, prefix: str) -> Any:
    """An id without its resource prefix (``batches/abc`` -> ``abc``); anything else unchanged."""
    return value[len(prefix) :] if isinstance(value, str) and value.startswith(prefix) else value


class GeminiDialect(Dialect):
    """Google Gemini API Batch Mode (``models/{model}:batchGenerateContent``)."""

    name = "gemini"
    label = "Google Gemini API"
    default_base_url = "https://generativelanguage.googleapis.com/v1beta"
    default_api_path = "/v1beta"
    # Chat completions (batchGenerateContent) and embeddings (asyncBatchEmbedContent).
    endpoints = frozenset({CHAT, EMBEDDINGS})
    # Google targets 24 hours; a batch still pending or running after 48 hours expires.
    completion_windows = ("24h",)
    # The Files API takes files up to 2 GB, the batch input file's documented limit too; no
    # request count or per-request size is documented.
    limits = Limits(max_lines=10_000_000, max_file_bytes=2 * GB, max_line_bytes=2 * GB)
    mixed_models = False
    model_placement = "job"
    encodes_lines = True
    supports_metadata = False
    upload_purpose = None
    upload_protocol = "resumable"
    results_modes: ClassVar[tuple[ResultsMode, ...]] = ("files",)
    line_shape = None
    list_keys = frozenset({"operations"})
    listed_id_key = "name"
    list_cursor_param = "pageToken"
    # The listing's order is not documented: each batch is read by its own id.
    lists_batches = False
    # A cancel of a batch that has ended is refused as a failed precondition (HTTP 400).
    cancel_final_statuses = frozenset({400})
    # RESOURCE_EXHAUSTED (429) is a rate limit that passes: it is retried, never a quota stop.
    quota_error_codes = frozenset()
    console_url_template = None

    def __init__(self) -> None:
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

    # ---- authentication -------------------------------------------------------------
    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """``x-goog-api-key``."""
        return {"x-goog-api-key": api_key} if api_key else {}

    def is_quota_error(self, status_code: int, body: Any) -> bool:
        """A 429 RESOURCE_EXHAUSTED whose QuotaFailure names a per-day quota: waiting minutes does
        not refill it. Per-minute limits (and a 429 without that detail) are retried."""
        if status_code != 429:
            return False
        error = body.get("error") if isinstance(body, Mapping) else None
        details = error.get("details") if isinstance(error, Mapping) else None
        for detail in details if isinstance(details, list) else []:
            violations = detail.get("violations") if isinstance(detail, Mapping) else None
            for violation in violations if isinstance(violations, list) else []:
                quota = violation.get("quotaId") if isinstance(violation, Mapping) else None
                if isinstance(quota, str) and "PerDay" in quota:
                    return True
        return False

    def is_auth_error(self, status_code: int, body: Any) -> bool:
        """Google refuses a wrong key with 400 INVALID_ARGUMENT whose ErrorInfo reason is API_KEY_INVALID."""
        error = body.get("error") if isinstance(body, Mapping) else None
        details = error.get("details") if isinstance(error, Mapping) else None
        return status_code == 400 and any(
            isinstance(d, Mapping) and d.get("reason") == "API_KEY_INVALID"
            for d in (details if isinstance(details, list) else [])
        )

    # ---- paths ----------------------------------------------------------------------
    def file_path(self, file_id: str) -> str:
        return f"files/{path_segment(_short(file_id, 'files/'), 'file_id')}"

    def file_content_path(self, file_id: str) -> str:
        return f"files/{path_segment(_short(file_id, 'files/'), 'file_id')}:download"

    @property
    def file_content_params(self) -> dict[str, str]:
        return {"alt": "media"}

    def batch_path(self, batch_id: str) -> str:
        return f"batches/{path_segment(_short(batch_id, 'batches/'), 'batch_id')}"

    def cancel_path(self, batch_id: str) -> str:
        return f"{self.batch_path(batch_id)}:cancel"

    def create_path(self, model: str | None, endpoint: str | None = None) -> str:
        """``models/{model}:batchGenerateContent``, or ``:asyncBatchEmbedContent`` for embeddings."""
        method = CREATE_METHODS.get(endpoint or CHAT, CREATE_METHODS[CHAT])
        return f"models/{path_segment(_short(model, 'models/'), 'model')}:{method}"

    def upload_url(self, base_url: str) -> str:
        """The Files API's upload root: ``/upload`` before the API root's path, same origin."""
        parts = urlsplit(base_url)
        return urlunsplit((parts.scheme, parts.netloc, "/upload" + parts.path.rstrip("/") + "/files", "", ""))

    def upload_start_body(self, filename: str) -> dict[str, Any]:
        return {"file": {"displayName": filename}}

    def parse_file_id(self, raw: Mapping[str, Any]) -> str:
        """The id of the finalized upload's ``{"file": {"name": "files/..."}}`` (or of a bare file)."""
        inner = raw.get("file")
        found = inner if isinstance(inner, Mapping) else raw
        name = _short(found.get("name"), "files/")
        if not name:
            raise BatchApiResponseError("file upload answer has no file name", body=dict(raw))
        problem = id_problem(name)
        if problem is not None:
            raise BatchApiResponseError(f"file upload answer: its name {problem}", body=dict(raw))
        return str(name)

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        url = canonical.get("url")
        body = canonical.get("body")
        if url == EMBEDDINGS:
            return _embedding_problem(body) if isinstance(body, Mapping) else None
        if url != CHAT:
            return (
                f"endpoint {url} not supported by the Gemini API's Batch Mode "
                "(chat completions and embeddings only)"
            )
        if not isinstance(body, Mapping):
            return None
        refused = sorted(k for k, v in body.items() if k not in _MAPPED and v is not None)
        if refused:
            return f"{', '.join(refused)} not supported by the Gemini API's generateContent (as encoded here)"
        n = body.get("n")
        if n not in (None, 1):
            return f"n={n} not supported by the Gemini API batch encoding (one candidate per request)"
        if body.get("stream"):
            return "stream=true not supported by the Gemini API's Batch Mode"
        if body.get("parallel_tool_calls") is False:
            return "parallel_tool_calls=false not supported by the Gemini API (it may call several functions)"
        return (
            _messages_problem(body.get("messages"))
            or _format_problem(body.get("response_format"))
            or _tools_problem(body)
        )

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """``{key, request}``: the chat body as a ``GenerateContentRequest`` (checked by ``unsupported``)."""
        body = canonical["body"]
        if canonical.get("url") == EMBEDDINGS:
            return {"key": canonical["custom_id"], "request": _embed_request(body)}
        system: list[dict[str, Any]] = []
        contents: list[dict[str, Any]] = []
        # The function each tool call id named, for the tool turn that answers it.
        called: dict[str, str] = {}
        for message in body.get("messages") or []:
            role = message.get("role")
            if role in ("system", "developer"):
                system.extend(_parts(message.get("content")))
            elif role == "tool":
                name = called[message["tool_call_id"]]
                response = {"name": name, "response": _tool_result(message.get("content"))}
                contents.append({"role": "user", "parts": [{"functionResponse": response}]})
            elif role == "assistant":
                parts = _parts(message.get("content")) if message.get("content") else []
                for call in message.get("tool_calls") or []:
                    function = call["function"]
                    called[call.get("id")] = function["name"]
                    args = orjson.loads(function.get("arguments") or "{}")
                    parts.append({"functionCall": {"name": function["name"], "args": args}})
                contents.append({"role": "model", "parts": parts})
            else:
                contents.append({"role": "user", "parts": _parts(message.get("content"))})
        request: dict[str, Any] = {"contents": contents}
        if system:
            request["systemInstruction"] = {"parts": system}
        if body.get("tools"):
            request["tools"] = [
                {"functionDeclarations": [_declaration(t["function"]) for t in body["tools"]]}
            ]
        choice = body.get("tool_choice")
        if choice is not None:
            forced = forced_tool(choice)
            config: dict[str, Any] = {"mode": "ANY" if forced else _TOOL_MODES[choice]}
            if forced:
                config["allowedFunctionNames"] = [forced]
            request["toolConfig"] = {"functionCallingConfig": config}
        generation = _generation_config(body)
        if generation:
            request["generationConfig"] = generation
        return {"key": canonical["custom_id"], "request": request}

    # ---- batches --------------------------------------------------------------------
    def create_batch_body(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        # No endpoint, window or metadata field: the path names the model, the display name the run.
        display = (metadata or {}).get(NAME_KEY) or name or "airflow-batch"
        return {
            "batch": {
                "displayName": display,
                "inputConfig": {"fileName": f"files/{_short(input_file_id, 'files/')}"},
            }
        }

    def create_name(self, body: Mapping[str, Any]) -> str | None:
        batch = body.get("batch")
        name = batch.get("displayName") if isinstance(batch, Mapping) else None
        return name if isinstance(name, str) else None

    def listed_id(self, item: Any) -> str | None:
        name = _short(item.get("name"), "batches/") if isinstance(item, dict) else None
        return name if isinstance(name, str) and name else None

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """The batch operation as a ``Batch``; anything unreadable is a ``BatchApiResponseError``."""
        raw = batch_object(raw)
        name = raw.get("name")
        if not name:
            raise BatchApiResponseError("batch operation has no name", body=dict(raw))
        if not isinstance(name, str):
            raise BatchApiResponseError(
                f"batch operation has a name that is not a string ({type(name).__name__})", body=dict(raw)
            )
        batch_id = _short(name, "batches/")
        meta = raw.get("metadata")
        if not isinstance(meta, Mapping):
            raise BatchApiResponseError(f"batch {batch_id} has no metadata object", body=dict(raw))
        state = meta.get("state")
        mapped = STATES.get(state) if isinstance(state, str) else None
        if mapped is None:
            # An unknown state is an error, never a success (the sensor must not guess).
            raise UnknownBatchStatusError(
                f"batch {batch_id} reported unknown state {state!r}; known: {', '.join(STATES)}"
            )
        try:
            return self._batch(batch_id, BatchState(mapped), raw, meta)
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def _batch(
        self, batch_id: str, state: BatchState, raw: Mapping[str, Any], meta: Mapping[str, Any]
    ) -> Batch:
        stats = meta.get("batchStats")
        if stats is not None and not isinstance(stats, Mapping):
            raise ValueError(f"batchStats is {type(stats).__name__}, not an object")
        stats = stats or {}
        display = meta.get("displayName")
        if display is not None and not isinstance(display, str):
            raise ValueError(f"displayName is {type(display).__name__}, not text")
        source = meta.get("inputConfig")
        input_file = source.get("fileName") if isinstance(source, Mapping) else None
        output = meta.get("output")
        response = raw.get("response")
        responses = (output.get("responsesFile") if isinstance(output, Mapping) else None) or (
            response.get("responsesFile") if isinstance(response, Mapping) else None
        )
        for what, value in (("inputConfig.fileName", input_file), ("responsesFile", responses)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{what} is {type(value).__name__}, not text")
        errors: list[BatchError] = []
        error = raw.get("error")
        if isinstance(error, Mapping):
            errors.append(
                BatchError(
                    code=str_or_none(error.get("status")) or str_or_none(error.get("code")),
                    message=str_or_none(error.get("message")),
                )
            )
        ended = to_utc(meta.get("endTime"))
        kind = meta.get("@type")
        embeds = isinstance(kind, str) and kind.endswith("." + EMBED_BATCH_TYPE)
        return Batch(
            id=batch_id,
            state=state,
            endpoint=EMBEDDINGS if embeds else CHAT,
            completion_window="24h",
            input_file_id=_short(input_file, "files/"),
            output_file_id=_short(responses, "files/"),
            request_counts=RequestCounts(
                total=int64_count(stats, "requestCount"),
                completed=int64_count(stats, "successfulRequestCount"),
                failed=int64_count(stats, "failedRequestCount"),
            ),
            created_at=to_utc(meta.get("createTime")),
            completed_at=ended if state is BatchState.COMPLETED else None,
            failed_at=ended if state is BatchState.FAILED else None,
            cancelled_at=ended if state is BatchState.CANCELLED else None,
            expired_at=ended if state is BatchState.EXPIRED else None,
            metadata={NAME_KEY: display, "name": display} if display else {},
            errors=errors,
            raw=dict(raw),
        )

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"pageSize": limit or self.list_page_size}

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        """One page's operations and, while the answer names one, the next page's token."""
        raw = page_object(raw)
        items = page_items(raw, "operations")
        token = raw.get("nextPageToken")
        if token is not None and not isinstance(token, str):
            raise BatchApiResponseError(f"{LIST_WHAT}: nextPageToken is {type(token).__name__}, not a string")
        return items, ({**params, "pageToken": token} if token else None)

    # ---- results --------------------------------------------------------------------
    def parse_result_line(self, raw: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """One line of the responses file, as the chat-completion answer or error the merge reads."""
        key = raw.get("key")
        if not isinstance(key, str) or not key:
            raise BatchApiResponseError("result line has no key", body=dict(raw))
        error = raw.get("error")
        if isinstance(error, dict):
            status = str_or_none(error.get("status"))
            code = status or (f"http_{error['code']}" if error.get("code") is not None else "error")
            return ResultLine(
                custom_id=key,
                ok=False,
                status_code=error["code"] if type(error.get("code")) is int else None,
                error=LineError(code=code, message=str_or_none(error.get("message")), type=status),
                source="error",
            )
        response = raw.get("response")
        if not isinstance(response, dict):
            raise BatchApiResponseError(
                f"result of {key!r} has neither a response nor an error", body=dict(raw)
            )
        if "embedding" in response:
            return self.embedding_line(key, response, source)
        return self.answer_line(key, response, source)

    def answer_line(self, key: str, response: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """A ``GenerateContentResponse`` as the chat completion the merge reads (a response
        without candidates, a blocked prompt, as a failed line)."""
        blocked = self.blocked_line(key, response)
        if blocked is not None:
            return blocked
        return ResultLine(
            custom_id=key,
            ok=True,
            status_code=200,
            body=chat_completion(response),
            line_id=str_or_none(response.get("responseId")),
            source=source,
        )

    def embedding_line(self, key: str, response: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """An ``EmbedContentResponse`` as the embeddings answer the merge reads (one vector)."""
        embedding = response.get("embedding")
        values = embedding.get("values") if isinstance(embedding, dict) else None
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            return ResultLine(
                custom_id=key,
                ok=False,
                status_code=200,
                error=LineError(code="invalid_output", message="the embedding has no list of numbers"),
                source="output",
            )
        return ResultLine(
            custom_id=key, ok=True, status_code=200, body=embedding_list(response), source=source
        )

    def blocked_line(self, key: str, response: Mapping[str, Any]) -> ResultLine | None:
        """The failed line of a response without candidates (a blocked prompt); None if it has some."""
        candidates = response.get("candidates")
        if isinstance(candidates, list) and candidates:
            return None
        feedback = response.get("promptFeedback")
        reason = feedback.get("blockReason") if isinstance(feedback, dict) else None
        return ResultLine(
            custom_id=key,
            ok=False,
            status_code=200,
            body=chat_completion(response),
            error=LineError(
                code="prompt_blocked" if reason else "no_candidates",
                message=f"prompt blocked: {reason}" if reason else "the response has no candidates",
            ),
            source="output",
        )


def embedding_list(response: Mapping[str, Any]) -> dict[str, Any]:
    """An ``EmbedContentResponse`` as an OpenAI embeddings body: one vector at index 0, and the
    token count where Google sends one (``tokenCount``) as usage."""
    body: dict[str, Any] = {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": response["embedding"]["values"]}],
        "model": response.get("modelVersion"),
    }
    tokens = response.get("tokenCount")
    if type(tokens) is int or (isinstance(tokens, str) and tokens.isdigit()):
        body["usage"] = {"prompt_tokens": int(tokens), "total_tokens": int(tokens)}
    return body


def _embedding_problem(body: Mapping[str, Any]) -> str | None:
    """What an EmbedContentRequest cannot carry: one text per request, float vectors."""
    refused = sorted(k for k, v in body.items() if k not in _EMBED_MAPPED and v is not None)
    if refused:
        return f"{', '.join(refused)} not supported by the Gemini API's embedContent (as encoded here)"
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str) or not text:
        return (
            "input must be one non-empty text for the Gemini API's asyncBatchEmbedContent (each request "
            "embeds one content: give each text its own row)"
        )
    if body.get("encoding_format") not in (None, "float"):
        return (
            f"encoding_format={body['encoding_format']!r} not supported by the Gemini API "
            "(float vectors only)"
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        return f"dimensions={dimensions!r} must be a whole number above 0 (outputDimensionality)"
    return None


def _embed_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The embeddings body as an ``EmbedContentRequest`` (checked by ``_embedding_problem``)."""
    text = body["input"][0] if isinstance(body["input"], list) else body["input"]
    request: dict[str, Any] = {"content": {"parts": [{"text": text}]}}
    if body.get("dimensions") is not None:
        request["outputDimensionality"] = body["dimensions"]
    return request


def int64_count(stats: Mapping[str, Any], key: str) -> int:
    """An int64 count (JSON sends it as a digit string); absent is 0."""
    value = stats.get(key)
    if value is None:
        return 0
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if type(value) is int and value >= 0:
        return value
    raise ValueError(f"batchStats.{key} is {value!r:.40}, not a count")


def chat_completion(response: Mapping[str, Any]) -> dict[str, Any]:
    """A ``GenerateContentResponse`` as a chat-completion body: the first candidate's text (thought
    parts left out), its finish reason, and usage (completion tokens include thoughts, as OpenAI's
    include reasoning; cached and thought tokens also in the details; Gemini's counts kept beside)."""
    candidates = response.get("candidates")
    choices: list[dict[str, Any]] = []
    for index, candidate in enumerate(candidates if isinstance(candidates, list) else []):
        if not isinstance(candidate, dict):
            continue
        content = candidate.get("content")
        parts = content.get("parts") if isinstance(content, dict) else None
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for part in parts if isinstance(parts, list) else []:
            if not isinstance(part, dict) or part.get("thought"):
                continue
            if isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part.get("functionCall"), dict):
                call = part["functionCall"]
                calls.append(
                    {
                        "id": call.get("id") or f"call_{index}_{len(calls)}",
                        "type": "function",
                        "function": {
                            "name": call.get("name"),
                            "arguments": orjson.dumps(call.get("args") or {}).decode(),
                        },
                    }
                )
        reason = candidate.get("finishReason")
        finish = FINISH_REASONS.get(reason, reason.lower()) if isinstance(reason, str) else None
        reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
        if calls:
            reply["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choices.append({"index": candidate.get("index", index), "message": reply, "finish_reason": finish})
    body: dict[str, Any] = {
        "id": response.get("responseId"),
        "object": "chat.completion",
        "model": response.get("modelVersion"),
        "choices": choices,
    }
    usage = response.get("usageMetadata")
    if isinstance(usage, dict):
        counts = {
            k: v
            for k in (
                "promptTokenCount",
                "candidatesTokenCount",
                "cachedContentTokenCount",
                "thoughtsTokenCount",
                "totalTokenCount",
            )
            if type(v := usage.get(k)) is int
        }
        prompt = counts.get("promptTokenCount", 0)
        thoughts = counts.get("thoughtsTokenCount", 0)
        completion = counts.get("candidatesTokenCount", 0) + thoughts
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": counts.get("totalTokenCount", prompt + completion),
            "prompt_tokens_details": {"cached_tokens": counts.get("cachedContentTokenCount", 0)},
            "completion_tokens_details": {"reasoning_tokens": thoughts},
            **counts,
        }
    return body


# ---- encoding helpers ------------------------------------------------------------------
def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list for the Gemini API"
    called: set[Any] = set()
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] is not an object"
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{index}] role {role!r} not supported by the Gemini API"
        if role == "tool" and message.get("tool_call_id") not in called:
            return (
                f"messages[{index}] (tool) answers tool_call_id {message.get('tool_call_id')!r}, which "
                "no earlier assistant message made: the Gemini API needs the function's name"
            )
        for call in message.get("tool_calls") or [] if role == "assistant" else []:
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            try:
                args = orjson.loads(function.get("arguments") or "{}") if isinstance(function, dict) else None
            except (orjson.JSONDecodeError, TypeError):
                args = None
            if not isinstance(name, str) or not name or not isinstance(args, dict):
                return (
                    f"messages[{index}] tool_calls need a function name and JSON object arguments "
                    "(the Gemini API's functionCall args are an object)"
                )
            called.add(call.get("id"))
        content = message.get("content")
        if isinstance(content, str) or (content is None and role == "assistant"):
            continue
        if not isinstance(content, list):
            return f"messages[{index}] ({role}) content must be text or a list of parts"
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):  # type: ignore[union-attr]
                continue
            if kind == "image_url" and role == "user":
                image = part.get("image_url")  # type: ignore[union-attr]
                url = image.get("url") if isinstance(image, dict) else None
                if isinstance(url, str) and _DATA_URL.fullmatch(url):
                    continue
                return (
                    f"messages[{index}] image_url must be a data:<mime>;base64 URL for the Gemini API "
                    "(a web URL has no inline equivalent)"
                )
            return (
                f"messages[{index}] ({role}) content part {kind!r} not supported by the Gemini API encoding"
            )
    return None


def _format_problem(response_format: Any) -> str | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in ("text", "json_object"):
        return None
    if kind != "json_schema":
        return f"response_format {kind!r} not supported by the Gemini API"
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        return "response_format json_schema needs a schema object for the Gemini API's responseSchema"
    return _schema_problem(schema, "schema")


def _schema_problem(schema: Any, where: str) -> str | None:
    """The first JSON-schema keyword Gemini's ``responseSchema`` lacks, named with its place."""
    if not isinstance(schema, dict):
        return f"response_format {where} is not an object"
    for key, value in schema.items():
        if key == "additionalProperties" and value is False:
            continue  # Gemini returns only the declared properties anyway
        if key not in _SCHEMA_KEYS:
            return f"response_format {where}.{key} not supported by the Gemini API's responseSchema"
    for name, sub in (schema.get("properties") or {}).items():
        problem = _schema_problem(sub, f"{where}.properties.{name}")
        if problem:
            return problem
    if "items" in schema:
        problem = _schema_problem(schema["items"], f"{where}.items")
        if problem:
            return problem
    for number, sub in enumerate(schema.get("anyOf") or []):
        problem = _schema_problem(sub, f"{where}.anyOf[{number}]")
        if problem:
            return problem
    return None


def _response_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema as Gemini's ``responseSchema``: types upper-case, ``additionalProperties:
    false`` left out (checked by ``_schema_problem``)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "additionalProperties":
            continue
        if key == "type":
            if isinstance(value, list):
                # ["string", "null"]: one type, nullable.
                named = [v for v in value if v != "null"]
                out["type"] = str(named[0]).upper() if named else "NULL"
                if "null" in value:
                    out["nullable"] = True
            else:
                out["type"] = str(value).upper()
        elif key == "properties":
            out[key] = {name: _response_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out[key] = _response_schema(value)
        elif key == "anyOf":
            out[key] = [_response_schema(sub) for sub in value]
        else:
            out[key] = value
    return out


def _generation_config(body: Mapping[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for source, target in (
        ("temperature", "temperature"),
        ("top_p", "topP"),
        ("seed", "seed"),
        ("presence_penalty", "presencePenalty"),
        ("frequency_penalty", "frequencyPenalty"),
    ):
        if body.get(source) is not None:
            config[target] = body[source]
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            config["maxOutputTokens"] = body[key]
            break
    stop = body.get("stop")
    if stop:
        config["stopSequences"] = [stop] if isinstance(stop, str) else list(stop)
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        config["responseMimeType"] = "application/json"
    elif kind == "json_schema":
        config["responseMimeType"] = "application/json"
        config["responseSchema"] = _response_schema(response_format["json_schema"]["schema"])  # type: ignore[index]
    return config


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    parts: list[dict[str, Any]] = []
    for part in content or []:
        if part.get("type") == "text":
            parts.append({"text": part.get("text", "")})
        else:
            found = _DATA_URL.fullmatch(part["image_url"]["url"])
            assert found is not None  # checked by ``unsupported``
            parts.append({"inlineData": {"mimeType": found.group(1), "data": found.group(2)}})
    return parts


def _tools_problem(body: Mapping[str, Any]) -> str | None:
    for index, tool in enumerate(body.get("tools") or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            return f"tool of type {kind!r} not supported by the Gemini API encoding (function tools only)"
        if not isinstance(function.get("name"), str) or not function["name"]:
            return f"tools[{index}].function.name is required by the Gemini API"
        parameters = function.get("parameters")
        if parameters is not None:
            problem = _schema_problem(parameters, f"tools[{index}].function.parameters")
            if problem:
                return problem.replace("response_format ", "", 1)
    choice = body.get("tool_choice")
    if choice is not None and not (
        (isinstance(choice, str) and choice in _TOOL_MODES) or forced_tool(choice)
    ):
        return f"tool_choice {choice!r} not supported by the Gemini API"
    return None


def _declaration(function: Mapping[str, Any]) -> dict[str, Any]:
    declaration: dict[str, Any] = {"name": function["name"]}
    if function.get("description"):
        declaration["description"] = function["description"]
    if function.get("parameters"):
        declaration["parameters"] = _response_schema(function["parameters"])
    return declaration


def _tool_result(content: Any) -> dict[str, Any]:
    """A tool turn's content as a functionResponse's response (an object): a JSON object as it
    is, anything else under ``content``."""
    text = text_content(content)
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"content": text}
