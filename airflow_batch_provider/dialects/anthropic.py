"""Anthropic Message Batches: requests inline in the create call, results from one ``results_url``.

Built to Anthropic's public API reference and its official Python SDK (``anthropic``): a batch
is created with ``POST /v1/messages/batches`` and the body ``{"requests": [{custom_id, params}]}``
(no file upload; at most 100,000 requests or 256 MB); ``params`` is a Messages request. A batch
is ``GET /v1/messages/batches/{id}``, cancelled with ``POST .../{id}/cancel`` and listed newest
first with ``limit``/``after_id``/``before_id`` (``{data, has_more, first_id, last_id}``). Its
``processing_status`` is in_progress, canceling or ended; ``request_counts`` {processing,
succeeded, errored, canceled, expired} stay 0 (all "processing") until it ends. Once ended, its
``results_url`` streams JSONL lines ``{custom_id, result: {type, message | error}}``. Requests
carry ``x-api-key`` and ``anthropic-version``. Batches carry no metadata and the listing has no
filter: the submit finds a batch lost in a crash by its creation time and request count.

Staging holds the canonical (OpenAI chat-completions) line; :meth:`AnthropicDialect.encode_line`
turns it into Messages ``params`` and :meth:`AnthropicDialect.parse_result_line` turns each
result back into a chat-completion body, so the merge's columns are those of every vendor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from airflow_batch_provider.dialects.base import Dialect, batch_object, bind_models, str_or_none
from airflow_batch_provider.dialects.chat import call_arguments, forced_tool, text_content
from airflow_batch_provider.exceptions import BatchApiResponseError, UnknownBatchStatusError
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    from airflow_batch_provider.models import (  # noqa: TC004
        Batch,
        BatchState,
        LineError,
        RequestCounts,
        ResultLine,
        ResultSource,
        to_utc,
    )

API_VERSION = "2023-06-01"
CHAT = "/v1/chat/completions"
# Anthropic's rule for a request's custom_id.
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")

# Messages stop reasons in the chat-completions vocabulary the merge reads.
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
# Canonical chat parameters a Messages request has a field for (the rest are refused by name).
_MAPPED = frozenset(
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
        "parallel_tool_calls",
        "user",
        "n",
        "stream",
    }
)
_TOOL_CHOICE = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"}}
_DATA_URL = re.compile(r"data:(image/[a-zA-Z0-9.+-]+);base64,(.*)", re.DOTALL)
# A result type that is not an answer, as the error code the merge maps to a row status.
_NOT_RUN = {"canceled": "batch_cancelled", "expired": "batch_expired"}


class AnthropicDialect(Dialect):
    """Anthropic Message Batches API (``/v1/messages/batches``)."""

    name = "anthropic"
    label = "Anthropic"
    default_base_url = "https://api.anthropic.com/v1"
    # The canonical line is chat completions; Messages has no embeddings or other endpoint.
    endpoints = frozenset({CHAT})
    completion_windows = ("24h",)
    # 100,000 requests or 256 MB per batch (the create body); no per-request limit is documented.
    limits = Limits(max_lines=100_000, max_file_bytes=256 * MB, max_line_bytes=256 * MB)
    # Every request names its own model.
    mixed_models = True
    max_custom_id_chars = 64
    supports_metadata = False
    upload_purpose = None
    submission_mode = "inline"
    # No metadata on a batch and no filter on the listing: a lost create is found by its time
    # and request count.
    orphan_lookup = "time_and_count"
    encodes_lines = True
    results_modes = ("results_url",)
    line_shape = None
    list_keys = frozenset({"data", "has_more", "first_id", "last_id"})
    # The listing pages on with after_id (the base reads data, has_more and last_id).
    list_cursor_param = "after_id"
    # Batch and cancel paths are the base's under this collection, each id one encoded segment.
    batches_path = "messages/batches"
    # A cancel of an ended batch is refused as an invalid request.
    cancel_final_statuses = frozenset({400})
    # Out of credit is a billing error, not a rate limit: waiting does not help.
    quota_error_codes = frozenset({"billing_error"})
    # Claude's tokenizer is not public; it makes more tokens than o200k for the same text.
    token_encoding = None
    token_factor = 1.2
    price_provider = "anthropic"

    def __init__(self) -> None:
        super().__init__()
        bind_models(globals(), "Batch", "BatchState", "LineError", "RequestCounts", "ResultLine", "to_utc")

    # ---- authentication -------------------------------------------------------------
    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """``x-api-key`` and ``anthropic-version`` (extra ``anthropic_version`` overrides it);
        extra ``anthropic_beta`` becomes the ``anthropic-beta`` header."""
        extra = extra or {}
        headers = {"anthropic-version": str(extra.get("anthropic_version") or API_VERSION)}
        if api_key:
            headers["x-api-key"] = api_key
        if extra.get("anthropic_beta"):
            headers["anthropic-beta"] = str(extra["anthropic_beta"])
        return headers

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        custom_id = canonical.get("custom_id")
        if isinstance(custom_id, str) and not CUSTOM_ID.fullmatch(custom_id):
            return (
                f"custom_id {custom_id[:80]!r} does not match Anthropic's pattern ^[a-zA-Z0-9_-]{{1,64}}$ "
                "(letters, digits, _ and - only)"
            )
        url = canonical.get("url")
        if url != CHAT:
            return f"endpoint {url} not supported by Anthropic's Message Batches (chat completions only)"
        body = canonical.get("body")
        if not isinstance(body, Mapping):
            return None
        refused = sorted(k for k, v in body.items() if k not in _MAPPED and v is not None)
        if refused:
            hint = (
                " (Anthropic has no response_format: ask for JSON in the prompt, or force a tool "
                "with tools + tool_choice)"
                if "response_format" in refused
                else ""
            )
            return f"{', '.join(refused)} not supported by Anthropic's Messages API{hint}"
        n = body.get("n")
        if n not in (None, 1):
            return f"n={n} not supported by Anthropic's Messages API (one answer per request)"
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and temperature > 1:
            return f"temperature {temperature} not supported by Anthropic's Messages API (0 to 1)"
        if _max_tokens(body) is None:
            return (
                "max_tokens is required by Anthropic's Messages API: set max_tokens (or "
                "max_completion_tokens) in the build's body, or request_defaults={'max_tokens': N} "
                "on the submit or the connection"
            )
        return _messages_problem(body.get("messages")) or _tools_problem(body)

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """``{custom_id, params}``: the chat body as a Messages request (checked by ``unsupported``)."""
        body = canonical["body"]
        system: list[str] = []
        messages: list[dict[str, Any]] = []
        for message in body.get("messages") or []:
            role = message.get("role")
            if role in ("system", "developer"):
                system.append(text_content(message.get("content")))
            elif role == "tool":
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": message.get("tool_call_id"),
                                "content": text_content(message.get("content")),
                            }
                        ],
                    }
                )
            elif role == "assistant":
                messages.append({"role": "assistant", "content": _assistant_content(message)})
            else:
                messages.append({"role": "user", "content": _user_content(message.get("content"))})
        params: dict[str, Any] = {"model": body["model"], "max_tokens": _max_tokens(body)}
        if system:
            params["system"] = "\n\n".join(system)
        params["messages"] = messages
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                params[key] = body[key]
        stop = body.get("stop")
        if stop:
            params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        if body.get("tools"):
            params["tools"] = [_tool(t["function"]) for t in body["tools"]]
        choice = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
        if choice is not None:
            params["tool_choice"] = choice
        if body.get("user"):
            params["metadata"] = {"user_id": str(body["user"])}
        return {"custom_id": canonical["custom_id"], "params": params}

    def inline_create_body(
        self, *, endpoint: str, completion_window: str, metadata: Mapping[str, str] | None, model: str | None
    ) -> dict[str, Any]:
        # The create body is the requests alone: no endpoint, window, model or metadata field.
        return {}

    # ---- batches --------------------------------------------------------------------
    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """A Message Batch; an ended one is cancelled (every request canceled), expired (every
        request expired) or completed with per-request results."""
        raw = batch_object(raw)
        batch_id = raw.get("id")
        if not batch_id:
            raise BatchApiResponseError("message batch object has no id", body=dict(raw))
        if not isinstance(batch_id, str):
            raise BatchApiResponseError(
                f"message batch object has an id that is not a string ({type(batch_id).__name__})",
                body=dict(raw),
            )
        counts = raw.get("request_counts")
        tally = _tally(counts)
        if tally is None:
            raise BatchApiResponseError(
                f"cannot read batch {batch_id}: request_counts {counts!r:.200} are not five counts",
                body=dict(raw),
            )
        url = raw.get("results_url")
        if url is not None and not isinstance(url, str):
            raise BatchApiResponseError(
                f"cannot read batch {batch_id}: results_url is {type(url).__name__}, not a string",
                body=dict(raw),
            )
        state = _state(raw.get("processing_status"), tally, batch_id)
        total = sum(tally.values())
        ended = raw.get("ended_at")
        try:
            return Batch(
                id=batch_id,
                state=state,
                endpoint=CHAT,
                completion_window="24h",
                request_counts=RequestCounts(
                    total=total,
                    completed=tally["succeeded"],
                    failed=tally["errored"] + tally["canceled"] + tally["expired"],
                ),
                created_at=to_utc(raw.get("created_at")),
                expires_at=to_utc(raw.get("expires_at")),
                cancelling_at=to_utc(raw.get("cancel_initiated_at")),
                completed_at=to_utc(ended) if state is BatchState.COMPLETED else None,
                cancelled_at=to_utc(ended) if state is BatchState.CANCELLED else None,
                expired_at=to_utc(ended) if state is BatchState.EXPIRED else None,
                raw=dict(raw),
            )
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def results_url_of(self, batch: Batch) -> str | None:
        url = batch.raw.get("results_url")
        return url if isinstance(url, str) and url else None

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"limit": limit or self.list_page_size}

    # ---- results --------------------------------------------------------------------
    def parse_result_line(self, raw: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """One line of the results stream, as the chat-completion answer or error the merge reads."""
        custom_id = raw.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchApiResponseError("result line has no custom_id", body=dict(raw))
        result = raw.get("result")
        kind = result.get("type") if isinstance(result, dict) else None
        if kind == "succeeded":
            message = result.get("message")  # type: ignore[union-attr]
            if not isinstance(message, dict):
                raise BatchApiResponseError(
                    f"result of {custom_id!r} succeeded without a message object", body=dict(raw)
                )
            return ResultLine(
                custom_id=custom_id,
                ok=True,
                status_code=200,
                body=chat_completion(message),
                line_id=str_or_none(message.get("id")),
                source="output",
            )
        if kind == "errored":
            wrapper = result.get("error")  # type: ignore[union-attr]
            inner = wrapper.get("error") if isinstance(wrapper, dict) else None
            inner = inner if isinstance(inner, dict) else (wrapper if isinstance(wrapper, dict) else {})
            error_type = str_or_none(inner.get("type")) or "api_error"
            return ResultLine(
                custom_id=custom_id,
                ok=False,
                error=LineError(code=error_type, message=str_or_none(inner.get("message")), type=error_type),
                request_id=str_or_none(wrapper.get("request_id")) if isinstance(wrapper, dict) else None,
                source="error",
            )
        if kind in _NOT_RUN:
            return ResultLine(
                custom_id=custom_id,
                ok=False,
                error=LineError(code=_NOT_RUN[kind], message=f"request {kind} before it ran"),
                source="error",
            )
        raise BatchApiResponseError(
            f"result of {custom_id!r} has unknown type {kind!r} (succeeded, errored, canceled, expired)",
            body=dict(raw),
        )


_COUNT_KEYS = ("processing", "succeeded", "errored", "canceled", "expired")


def _tally(counts: Any) -> dict[str, int] | None:
    """The five request counts (a missing or null one is 0); None when they are not counts."""
    if counts is None:
        counts = {}
    if not isinstance(counts, dict):
        return None
    tally: dict[str, int] = {}
    for key in _COUNT_KEYS:
        value = counts.get(key)
        value = 0 if value is None else value
        if type(value) is not int or value < 0:
            return None
        tally[key] = value
    return tally


def _state(status: Any, tally: Mapping[str, int], batch_id: str) -> BatchState:
    if status == "in_progress":
        return BatchState.IN_PROGRESS
    if status == "canceling":
        return BatchState.CANCELLING
    if status != "ended":
        # An unknown status is an error, never a success (the sensor must not guess).
        raise UnknownBatchStatusError(
            f"batch {batch_id} reported unknown processing_status {status!r}; "
            "known: in_progress, canceling, ended"
        )
    total = sum(tally.values())
    if total and tally["canceled"] == total:
        return BatchState.CANCELLED
    if total and tally["expired"] == total:
        return BatchState.EXPIRED
    return BatchState.COMPLETED


def chat_completion(message: Mapping[str, Any]) -> dict[str, Any]:
    """A Messages answer as a chat-completion body: text, tool calls, finish reason and usage
    (prompt tokens include cache writes and reads, as OpenAI's do; cached reads also in
    ``prompt_tokens_details.cached_tokens``; Anthropic's own counts are kept beside them)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in message.get("content") or []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": orjson.dumps(block.get("input") or {}).decode(),
                    },
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        reply["tool_calls"] = calls
    stop = message.get("stop_reason")
    body: dict[str, Any] = {
        "id": message.get("id"),
        "object": "chat.completion",
        "model": message.get("model"),
        "choices": [
            {"index": 0, "message": reply, "finish_reason": FINISH_REASONS.get(stop, stop) if stop else None}
        ],
    }
    usage = message.get("usage")
    if isinstance(usage, dict):
        counts = {
            k: v
            for k in (
                "input_tokens",
                "output_tokens",
                "cache_creation_input_tokens",
                "cache_read_input_tokens",
            )
            if type(v := usage.get(k)) is int
        }
        prompt = sum(
            counts.get(k, 0)
            for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        completion = counts.get("output_tokens", 0)
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": counts.get("cache_read_input_tokens", 0)},
            **counts,
        }
    return body


# ---- encoding helpers ------------------------------------------------------------------
def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value > 0:
            return value
    return None


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list for Anthropic's Messages API"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] is not an object"
        role = message.get("role")
        content = message.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            return f"messages[{index}] role {role!r} not supported by Anthropic's Messages API"
        if role in ("system", "developer", "tool", "assistant") and isinstance(content, list):
            bad = [p.get("type") for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
            if bad:
                return (
                    f"messages[{index}] ({role}) content part(s) {bad} not supported by Anthropic (text only)"
                )
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                if call_arguments(call) is None:
                    return (
                        f"messages[{index}] tool_calls need a function name and JSON object arguments "
                        "(Anthropic's tool_use input is an object)"
                    )
        if role == "user" and isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":
                    url = (
                        (part.get("image_url") or {}).get("url")
                        if isinstance(part.get("image_url"), dict)
                        else None
                    )
                    if not isinstance(url, str) or not (
                        _DATA_URL.fullmatch(url) or url.startswith(("https://", "http://"))
                    ):
                        return (
                            f"messages[{index}] image_url must be a data:image/...;base64 URL "
                            "or an http(s) URL"
                        )
                elif kind != "text":
                    return (
                        f"messages[{index}] content part {kind!r} not supported by Anthropic's Messages API"
                    )
        elif role == "user" and not isinstance(content, str):
            return f"messages[{index}] (user) content must be text or a list of parts"
    return None


def _tools_problem(body: Mapping[str, Any]) -> str | None:
    for tool in body.get("tools") or []:
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict)
        ):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            return f"tool of type {kind!r} not supported by Anthropic's Messages API (function tools only)"
    choice = body.get("tool_choice")
    if choice is not None and not (
        (isinstance(choice, str) and choice in _TOOL_CHOICE) or forced_tool(choice)
    ):
        return f"tool_choice {choice!r} not supported by Anthropic's Messages API"
    return None


def _tool(function: Mapping[str, Any]) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": function.get("name")}
    if function.get("description"):
        tool["description"] = function["description"]
    tool["input_schema"] = function.get("parameters") or {"type": "object", "properties": {}}
    return tool


def _tool_choice(choice: Any, parallel: Any) -> dict[str, Any] | None:
    if choice is None and parallel is not False:
        return None
    forced = forced_tool(choice)
    result: dict[str, Any] = (
        {"type": "tool", "name": forced} if forced else dict(_TOOL_CHOICE.get(choice, {"type": "auto"}))
    )
    if parallel is False and result["type"] != "none":
        result["disable_parallel_tool_use"] = True
    return result


def _user_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for part in content or []:
        if part.get("type") == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
        else:
            url = part["image_url"]["url"]
            found = _DATA_URL.fullmatch(url)
            source = (
                {"type": "base64", "media_type": found.group(1), "data": found.group(2)}
                if found
                else {"type": "url", "url": url}
            )
            blocks.append({"type": "image", "source": source})
    return blocks


def _assistant_content(message: Mapping[str, Any]) -> Any:
    text = text_content(message.get("content"))
    calls = message.get("tool_calls") or []
    if not calls:
        return text
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in calls:
        function = call.get("function") or {}
        # Checked by ``unsupported``: the arguments are a JSON object.
        arguments = orjson.loads(function.get("arguments") or "{}")
        blocks.append(
            {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments}
        )
    return blocks
