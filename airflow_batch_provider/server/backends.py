"""What answers each batch line: the offline ``echo`` model or an ``upstream`` endpoint.

A backend takes the line's url and body and returns ``(status_code, body)`` exactly as a
synchronous OpenAI-compatible endpoint would answer it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import math
import os
import re
import struct
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import httpx
import orjson

from airflow_batch_provider.server.config import ServerConfig

_T = TypeVar("_T")
_WORD = re.compile(r"\S+")
_RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
_SMALL_TEXT = 1 << 16  # characters below which building a list of the words costs nothing

# What one echo answer may generate (a clear 400, or an error line in a batch, beyond these):
# a small request must not be able to cost seconds of CPU or megabytes of answer.
ECHO_MAX_N = 128  # choices of one chat completion
ECHO_MAX_OUTPUT_CHARS = 4_000_000  # characters of generated text in one answer (all choices)
ECHO_MAX_SCHEMA_VALUES = 10_000  # JSON values (objects, array items, scalars) of one structured answer
ECHO_MAX_INPUTS = 2_048  # items of a list input (embeddings, moderations, completion prompts)
# A chat request whose last user message holds this text is answered with a 400 (code
# ``echo_error``): a deterministic failed row, the same in every dialect mode, for demos and tests.
ECHO_ERROR_MARK = "[[echo:error]]"
ECHO_ERROR_CODE = "echo_error"
ECHO_MAX_EMBEDDING_INPUTS = ECHO_MAX_INPUTS  # inputs of one embeddings request
ECHO_MAX_EMBEDDING_VALUES = 524_288  # inputs x dimensions of one embeddings request
# What one request may carry into the echo model (its "context"), checked on every endpoint before
# any answer is built: the answer echoes the input, so bounding the input bounds the answer and
# the work (a 10-million-item moderation input answered 550 MB before this bound).
ECHO_MAX_INPUT_CHARS = ECHO_MAX_OUTPUT_CHARS  # characters of strings (keys included) in one body
ECHO_MAX_REQUEST_VALUES = 300_000  # JSON values (objects, list items, scalars) in one body


class Backend(Protocol):
    name: str

    async def call(self, url: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error answer body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def count_tokens(text: str) -> int:
    """The echo model's tokenizer: one token per whitespace-separated word (honest and cheap)."""
    if len(text) <= _SMALL_TEXT:
        return len(_WORD.findall(text))  # quickest for the usual short text
    # A long text is counted without a list of its words (one string object per word).
    return sum(1 for _ in _WORD.finditer(text))


def check_request_size(body: Mapping[str, Any]) -> None:
    """Refuse a body carrying more than the echo model reads, whatever the endpoint.

    Walks the body iteratively and stops as soon as a limit is passed, so the check costs at
    most ``ECHO_MAX_REQUEST_VALUES`` steps however large the body is.

    :param body: the request body (one batch line's ``body`` or a synchronous request).
    :raises _BadRequest: naming the top-level field that carries too much (the 400's ``param``).
    """
    values = 1  # every value is counted once, when the container holding it is opened
    chars = 0
    # (value, the top-level field it sits in); the body's own fields name themselves.
    stack: list[tuple[Any, str | None]] = [(dict(body), None)]
    while stack:
        value, param = stack.pop()
        # Bodies come from JSON: dict, list and str (concrete-type checks are much quicker than ABCs).
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, (dict, list)):
            # A container too large for what is left is refused before its items are looked at.
            values += len(value)
            if values <= ECHO_MAX_REQUEST_VALUES:
                if isinstance(value, dict):
                    for key, item in value.items():
                        chars += len(key) if isinstance(key, str) else 0
                        stack.append((item, param if param is not None else str(key)))
                else:
                    stack.extend((item, param) for item in value)
        if values > ECHO_MAX_REQUEST_VALUES or chars > ECHO_MAX_INPUT_CHARS:
            raise _BadRequest(
                f"the request is larger than the echo backend reads: at most {ECHO_MAX_INPUT_CHARS:,} "
                f"characters of text and {ECHO_MAX_REQUEST_VALUES:,} JSON values per request "
                f"(field {param!r} passes the limit)",
                param,
            )


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x1f".join(parts).encode()).digest()


def _text_of(content: Any) -> str:
    """Text of a message content: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text") or part.get("input_text")
                if isinstance(text, str):
                    texts.append(text)
            elif isinstance(part, str):
                texts.append(part)
        return " ".join(texts)
    return ""


class EchoBackend:
    """Deterministic offline model: answers derived from the input, named ``echo:<model>``.

    Chat answers repeat the last user message; structured-output requests get a JSON
    object built from the schema; embeddings are unit vectors seeded by the input text.

    :param embedding_dim: vector size when the request gives no ``dimensions``.
    """

    name = "echo"

    def __init__(self, embedding_dim: int = 16) -> None:
        self.embedding_dim = embedding_dim
        # Two workers: CPU-bound threads compete with the event loop for the GIL, so fewer of
        # them keep its answers quick (a request waits for a free worker, not the loop).
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run CPU work of the echo model (an answer, a batch chunk) off the event loop."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="echo")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def call(self, url: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        # Generating an answer is CPU work (bounded by the ECHO_MAX_* limits).
        return await self.run(self.answer, url, body)

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def answer(self, url: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        """Synchronous core (the batch engine calls it directly, in a loop, for speed)."""
        path = url.split("?", 1)[0].rstrip("/")
        if path.startswith("/v1/"):
            path = path[3:]
        handler = {
            "/chat/completions": self._chat,
            "/embeddings": self._embeddings,
            "/completions": self._completions,
            "/responses": self._responses,
            "/moderations": self._moderations,
        }.get(path)
        if handler is None:
            return 404, error_body(f"the echo backend does not serve {url}", code="unknown_url", param="url")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return 400, error_body("model must be a string", param="model")
        try:
            check_request_size(body)
            return 200, handler(body, f"echo:{model or 'default'}")
        except _AskedForError as exc:
            return 400, error_body(str(exc), code=ECHO_ERROR_CODE)
        except _BadRequest as exc:
            return 400, error_body(str(exc), param=exc.param)
        except (ValueError, TypeError, AttributeError, KeyError, OverflowError, RecursionError) as exc:
            # A request the echo model cannot make sense of (say a schema with "minimum": "abc")
            # is the caller's mistake, answered like any other bad request.
            return 400, error_body(f"the echo backend cannot answer this request: {exc}")

    # ---- endpoints --------------------------------------------------------------------
    def _chat(self, body: Mapping[str, Any], model: str) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list", "messages")
        prompt_parts: list[str] = []
        last_user = ""
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise _BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
            text = _text_of(message.get("content"))
            prompt_parts.append(text)
            if message.get("role") == "user":
                last_user = text
        if ECHO_ERROR_MARK in last_user:
            raise _AskedForError(f"the request asked the echo model for an error ({ECHO_ERROR_MARK})")
        prompt = " ".join(prompt_parts)
        n = body.get("n") or 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= ECHO_MAX_N:
            raise _BadRequest(
                f"n must be an integer between 1 and {ECHO_MAX_N} (the echo backend's limit)", "n"
            )
        content, finish = self._reply(last_user or prompt, body)
        if len(content) * n > ECHO_MAX_OUTPUT_CHARS:
            raise _BadRequest(
                f"n={n} choices of {len(content):,} characters exceed the echo backend's limit "
                f"of {ECHO_MAX_OUTPUT_CHARS:,} generated characters",
                "n",
            )
        completion_tokens = count_tokens(content) * n
        prompt_tokens = count_tokens(prompt)
        return {
            "id": "chatcmpl-echo-" + _digest(model, prompt).hex()[:24],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": "echo",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for i in range(n)
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _completions(self, body: Mapping[str, Any], model: str) -> dict[str, Any]:
        prompt = body.get("prompt")
        _check_inputs(prompt, "prompt")
        text = prompt if isinstance(prompt, str) else " ".join(p for p in prompt or [] if isinstance(p, str))
        content, finish = self._reply(text, body)
        pt, ct = count_tokens(text), count_tokens(content)
        return {
            "id": "cmpl-echo-" + _digest(model, text).hex()[:24],
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
        }

    def _responses(self, body: Mapping[str, Any], model: str) -> dict[str, Any]:
        raw = body.get("input")
        if isinstance(raw, str):
            text = raw
        elif isinstance(raw, list):
            users = [m for m in raw if isinstance(m, Mapping) and m.get("role", "user") == "user"]
            text = _text_of(users[-1].get("content")) if users else ""
        else:
            raise _BadRequest("input must be a string or a list of messages", "input")
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
        content, _ = self._reply(
            text, {"response_format": fmt, **{k: body[k] for k in body if k == "max_output_tokens"}}
        )
        it, ot = count_tokens(text), count_tokens(content)
        rid = _digest(model, text).hex()[:24]
        return {
            "id": "resp_echo" + rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": model,
            "output": [
                {
                    "type": "message",
                    "id": "msg_echo" + rid,
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": content, "annotations": []}],
                }
            ],
            "usage": {"input_tokens": it, "output_tokens": ot, "total_tokens": it + ot},
        }

    def _moderations(self, body: Mapping[str, Any], model: str) -> dict[str, Any]:
        raw = body.get("input")
        _check_inputs(raw, "input")
        inputs = raw if isinstance(raw, list) else [raw]
        return {
            "id": "modr-echo-" + _digest(model, orjson.dumps(raw).decode()).hex()[:24],
            "model": model,
            "results": [{"flagged": False, "categories": {}, "category_scores": {}} for _ in inputs],
        }

    def _embeddings(self, body: Mapping[str, Any], model: str) -> dict[str, Any]:
        raw = body.get("input")
        if isinstance(raw, str):
            inputs: list[str] = [raw]
        elif isinstance(raw, list) and raw and all(isinstance(x, int) for x in raw):
            inputs = [" ".join(map(str, raw))]
        elif isinstance(raw, list) and raw:
            inputs = [x if isinstance(x, str) else orjson.dumps(x).decode() for x in raw]
        else:
            raise _BadRequest("input must be a non-empty string or list", "input")
        dim = body["dimensions"] if body.get("dimensions") is not None else self.embedding_dim
        if not isinstance(dim, int) or not 1 <= dim <= 8192:
            raise _BadRequest("dimensions must be an integer between 1 and 8192", "dimensions")
        _check_inputs(inputs, "input")
        if len(inputs) * dim > ECHO_MAX_EMBEDDING_VALUES:
            raise _BadRequest(
                f"{len(inputs):,} inputs x {dim:,} dimensions exceed the echo backend's limit of "
                f"{ECHO_MAX_EMBEDDING_VALUES:,} values per request",
                "dimensions",
            )
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        tokens = 0
        for index, text in enumerate(inputs):
            vector = embed(text, dim)
            tokens += count_tokens(text)
            value: Any = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode() if as_base64 else vector
            data.append({"object": "embedding", "index": index, "embedding": value})
        return {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    # ---- content ------------------------------------------------------------------
    def _reply(self, text: str, body: Mapping[str, Any]) -> tuple[str, str]:
        fmt = body.get("response_format")
        if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema") if "json_schema" in fmt else fmt
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            value = schema_value(
                schema if isinstance(schema, Mapping) else {}, text, "", schema, budget=_Budget()
            )
            return orjson.dumps(value).decode(), "stop"
        if isinstance(fmt, Mapping) and fmt.get("type") == "json_object":
            return orjson.dumps({"echo": text}).decode(), "stop"
        content = f"echo: {text}"
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
        if isinstance(limit, int) and limit > 0:
            # The first ``limit + 1`` words only: split() made one string per word of the prompt.
            words = [m.group() for m in itertools.islice(_WORD.finditer(content), limit + 1)]
            if len(words) > limit:
                return " ".join(words[:limit]), "length"
        return content, "stop"


def _check_inputs(raw: Any, param: str) -> None:
    """A list input (embeddings, moderations, completion prompts) holds at most ``ECHO_MAX_INPUTS`` items."""
    if isinstance(raw, list) and len(raw) > ECHO_MAX_INPUTS:
        raise _BadRequest(
            f"{len(raw):,} inputs exceed the echo backend's limit of {ECHO_MAX_INPUTS:,}", param
        )


class _BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _AskedForError(_BadRequest):
    """The request carries ``ECHO_ERROR_MARK``: a failed line on purpose."""


class _Budget:
    """What is left to generate for one structured answer (values and characters)."""

    def __init__(self) -> None:
        self.values = ECHO_MAX_SCHEMA_VALUES
        self.chars = ECHO_MAX_OUTPUT_CHARS

    def take(self, values: int, chars: int, path: str) -> None:
        self.values -= values
        self.chars -= chars
        if self.values < 0 or self.chars < 0:
            raise _BadRequest(
                f"the JSON schema asks for more than the echo backend generates (at {path or '/'}): "
                f"at most {ECHO_MAX_SCHEMA_VALUES:,} values and {ECHO_MAX_OUTPUT_CHARS:,} characters",
                "response_format",
            )


def _schema_number(schema: Mapping[str, Any], key: str, default: float, path: str) -> float:
    """A numeric keyword of a schema (``minimum``, ``minItems``...), refused when not a finite number."""
    raw = schema.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise _BadRequest(
            f"JSON schema keyword {key!r} at {path or '/'} must be a finite number, not {raw!r}",
            "response_format",
        )
    return raw


def embed(text: str, dim: int) -> list[float]:
    """A deterministic unit vector for ``text`` (same text, same vector, on every machine)."""
    out: list[float] = []
    counter = 0
    while len(out) < dim:
        block = hashlib.sha256(f"{counter}\x1f{text}".encode()).digest()
        out.extend((b - 127.5) / 127.5 for b in block)
        counter += 1
    out = out[:dim]
    norm = sum(x * x for x in out) ** 0.5 or 1.0
    return [round(x / norm, 6) for x in out]


def schema_value(
    schema: Mapping[str, Any],
    text: str,
    path: str,
    root: Any,
    depth: int = 0,
    *,
    budget: _Budget | None = None,
) -> Any:
    """A deterministic value satisfying the common JSON Schema keywords of ``schema``.

    Objects get their required properties (all of them when none are listed); enums pick a
    member chosen by a hash of the input; strings, numbers and booleans are derived from
    the input text, so the same request always gets the same structured answer. ``budget``
    bounds what is generated (a schema that asks for more is a ``_BadRequest``).
    """
    budget = budget or _Budget()
    if depth > 12:
        return None
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and isinstance(root, Mapping):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, Mapping) else {}
        return schema_value(target, text, path, root, depth + 1, budget=budget)
    seed = int.from_bytes(_digest(text, path)[:4], "big")
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[seed % len(enum)]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            non_null = [o for o in options if isinstance(o, Mapping) and o.get("type") != "null"]
            return schema_value((non_null or options)[0], text, path, root, depth + 1, budget=budget)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        props = schema.get("properties") or {}
        required = schema.get("required")
        names = [n for n in (required if isinstance(required, list) else list(props)) if isinstance(n, str)]
        budget.take(len(names), 0, path)
        return {
            name: schema_value(props.get(name) or {}, text, f"{path}/{name}", root, depth + 1, budget=budget)
            for name in names
        }
    if kind == "array":
        raw_items = schema.get("items")
        items: Mapping[str, Any] = raw_items if isinstance(raw_items, Mapping) else {}
        count = max(int(_schema_number(schema, "minItems", 1, path)), 1)
        budget.take(count, 0, path)
        return [
            schema_value(items, text, f"{path}/{i}", root, depth + 1, budget=budget) for i in range(count)
        ]
    if kind == "integer":
        first = int(_schema_number(schema, "minimum", 0, path))
        last = int(_schema_number(schema, "maximum", first + 100, path))
        return first + seed % (max(last - first, 0) + 1)
    if kind == "number":
        low = float(_schema_number(schema, "minimum", 0.0, path))
        high = float(_schema_number(schema, "maximum", low + 1.0, path))
        return round(low + (seed % 1000) / 999 * (high - low), 3)
    if kind == "boolean":
        return bool(seed % 2)
    if kind == "null":
        return None
    value = f"echo {text}".strip()[:200] if not path else f"echo{path.replace('/', ' ')}: {text}"[:200]
    min_len = int(_schema_number(schema, "minLength", 0, path))
    max_len = schema.get("maxLength")
    budget.take(0, max(min_len, len(value)), path)
    if len(value) < min_len:
        value = value.ljust(min_len, ".")
    if isinstance(max_len, int):
        value = value[:max_len]
    return value


class UpstreamBackend:
    """Forwards each line to an OpenAI-compatible endpoint, retrying 429/5xx per line.

    :param base_url: the upstream API root including ``/v1``.
    :param api_key: sent as a bearer token (read from the environment by the caller).
    :param concurrency: most calls in flight at once.
    :param max_retries: retries of one call on 408/409/429/5xx and transport errors.
    :param timeout: seconds per call.
    :param max_backoff: cap on one wait between retries, in seconds.
    """

    name = "upstream"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        concurrency: int = 8,
        max_retries: int = 3,
        timeout: float = 60.0,
        max_backoff: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            timeout=timeout,
            headers=headers,
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )
        self._semaphore = asyncio.Semaphore(concurrency)
        self.max_retries = max_retries
        self.max_backoff = max_backoff

    @classmethod
    def from_config(cls, config: ServerConfig) -> UpstreamBackend:
        key = os.environ.get(config.upstream_api_key_env) if config.upstream_api_key_env else None
        assert config.upstream_url is not None
        return cls(
            config.upstream_url,
            api_key=key,
            concurrency=config.upstream_concurrency,
            max_retries=config.upstream_max_retries,
            timeout=config.upstream_timeout,
            max_backoff=config.upstream_max_backoff,
        )

    def _target(self, url: str) -> str:
        # Lines name "/v1/chat/completions"; the base URL already ends in the version.
        path = url[3:] if url.startswith("/v1/") and self.base_url.endswith("/v1") else url
        return self.base_url + path

    async def call(self, url: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        target = self._target(url)
        payload = orjson.dumps(body)
        attempt = 0
        async with self._semaphore:
            while True:
                response: httpx.Response | None = None
                try:
                    response = await self._client.post(
                        target, content=payload, headers={"Content-Type": "application/json"}
                    )
                except httpx.TransportError as exc:
                    if attempt >= self.max_retries:
                        return 502, error_body(
                            f"upstream unreachable after {attempt + 1} attempts: {type(exc).__name__}",
                            type_="server_error",
                            code="upstream_unreachable",
                        )
                else:
                    if response.status_code not in _RETRY_STATUSES or attempt >= self.max_retries:
                        return response.status_code, _json_or_error(response)
                await asyncio.sleep(self._backoff(attempt, response))
                attempt += 1

    def _backoff(self, attempt: int, response: httpx.Response | None) -> float:
        if response is not None:
            header = response.headers.get("retry-after-ms")
            if header:
                try:
                    return min(float(header) / 1000, self.max_backoff)
                except ValueError:
                    pass
            header = response.headers.get("retry-after")
            if header:
                try:
                    return min(float(header), self.max_backoff)
                except ValueError:
                    pass
        return min(0.05 * 2**attempt, self.max_backoff)

    async def aclose(self) -> None:
        await self._client.aclose()


def _json_or_error(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return error_body(
            f"upstream answered {response.status_code} with a non-JSON body",
            type_="server_error",
            code="bad_upstream",
        )
    if isinstance(data, dict):
        return data
    return {"data": data}


def make_backend(config: ServerConfig) -> EchoBackend | UpstreamBackend:
    if config.backend == "upstream":
        return UpstreamBackend.from_config(config)
    return EchoBackend(config.embedding_dim)
