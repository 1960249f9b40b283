"""Bedrock's native (InvokeModel) chat bodies, per model family, for batch jobs without Converse.

A Bedrock batch job whose ``modelInvocationType`` is ``InvokeModel`` (the default) reads each
record's ``modelInput`` as the model's own request body and writes the model's own response as
``modelOutput``. The body differs by family (Bedrock's "Inference request parameters and
response fields for foundation models"); the family is the model id's provider prefix, after an
ARN's last segment and a cross-region inference profile's geography (``us.``, ``eu.``...):

- ``anthropic.`` Claude: the Anthropic Messages body with ``anthropic_version``
  ``bedrock-2023-05-31`` and no ``model`` (encoded and decoded by the Anthropic dialect's own
  code); answer: a Messages response.
- ``meta.`` Llama: ``prompt`` in the Llama 3 chat template, ``max_gen_len``, ``temperature``,
  ``top_p``; answer: ``generation``, ``prompt_token_count``, ``generation_token_count``,
  ``stop_reason`` (stop | length).
- ``mistral.`` Mistral: ``prompt`` as ``<s>[INST] ... [/INST]`` turns, ``max_tokens``,
  ``temperature``, ``top_p``, ``stop``; answer: ``outputs[0].text`` and ``stop_reason``.
- ``amazon.titan-text`` Titan Text: ``inputText`` and ``textGenerationConfig``
  (``maxTokenCount``, ``temperature``, ``topP``, ``stopSequences``); answer:
  ``inputTextTokenCount`` and ``results[0]`` (``outputText``, ``tokenCount``, ``completionReason``).
- ``amazon.nova`` Nova: ``schemaVersion`` messages-v1, ``messages`` of ``[{text}]`` blocks,
  ``system``, ``inferenceConfig`` (``max_new_tokens``, ``temperature``, ``top_p``,
  ``stopSequences``), ``toolConfig``; answer: ``output.message``, ``stopReason``, ``usage``
  (the Converse shape).

What a family's body cannot say (tools for the prompt families, ``response_format``, several
answers...) is refused by name before anything is uploaded. Answers are read by their shape, so
the merge gets one chat-completion body (content, finish reason, usage) whatever the family.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from typing import Any

from airflow_batch_provider.dialects.anthropic import AnthropicDialect
from airflow_batch_provider.dialects.anthropic import chat_completion as messages_completion
from airflow_batch_provider.dialects.chat import text_content

#: The ``anthropic_version`` every Claude body on Bedrock carries.
BEDROCK_ANTHROPIC_VERSION = "bedrock-2023-05-31"
#: Family name -> the model id prefix it is known by (after any geography prefix).
FAMILIES: dict[str, str] = {
    "anthropic": "anthropic.",
    "meta": "meta.",
    "mistral": "mistral.",
    "titan-text": "amazon.titan-text",
    "nova": "amazon.nova",
}
#: The families whose native request is a prompt string: no messages, no tools of their own.
PROMPT_FAMILIES = frozenset({"meta", "mistral", "titan-text"})
# A cross-region inference profile's geography before the model id (us.anthropic.claude-...).
_GEOGRAPHY = re.compile(r"(?:us|eu|apac|us-gov|ca|jp|au|global)\.")
# Canonical chat fields each family's body has a field for (Claude: the Anthropic dialect's).
_PROMPT_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n"}
)
_FIELDS: dict[str, frozenset[str]] = {
    "meta": _PROMPT_FIELDS,
    "mistral": _PROMPT_FIELDS | {"stop"},
    "titan-text": _PROMPT_FIELDS | {"stop"},
    "nova": _PROMPT_FIELDS | {"stop", "tools", "tool_choice"},
}
# Each family's stop reasons as chat-completion finish reasons.
_FINISH = {
    "stop": "stop",
    "length": "length",
    "FINISH": "stop",
    "STOP_CRITERIA_MET": "stop",
    "LENGTH": "length",
    "CONTENT_FILTERED": "content_filter",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "content_filtered": "content_filter",
    "guardrail_intervened": "content_filter",
}
_LABELS = {
    "anthropic": "Anthropic Claude",
    "meta": "Meta Llama",
    "mistral": "Mistral",
    "titan-text": "Amazon Titan Text",
    "nova": "Amazon Nova",
}


def model_family(model: Any) -> str | None:
    """The native family of a Bedrock model id, inference profile or ARN, or None if unknown.

    :param model: ``meta.llama3-8b-instruct-v1:0``, ``us.anthropic.claude-...``, or an ARN whose
        last segment is one of those.
    """
    if not isinstance(model, str) or not model:
        return None
    ident = model.rpartition("/")[2]
    found = _GEOGRAPHY.match(ident)
    if found:
        ident = ident[found.end() :]
    for family, prefix in FAMILIES.items():
        if ident.startswith(prefix):
            return family
    return None


def native_problem(family: str, body: Mapping[str, Any]) -> str | None:
    """Why a canonical chat body cannot be the ``family``'s native body, or None.

    :param family: a key of :data:`FAMILIES`.
    :param body: the canonical (chat completions) body.
    """
    label = f"Bedrock's native {_LABELS[family]} body (invocation_type native)"
    if family == "anthropic":
        return _claude_problem(body, label)
    refused = sorted(k for k, v in body.items() if k not in _FIELDS[family] and v is not None)
    if refused:
        return f"{', '.join(refused)} not supported by {label}"
    if body.get("n") not in (None, 1):
        return f"n={body.get('n')} not supported by {label} (one answer per record)"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list for {label}"
    roles = ("system", "developer", "user", "assistant") + (("tool",) if family == "nova" else ())
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in roles:
            role = message.get("role") if isinstance(message, dict) else None
            return f"messages[{index}] role {role!r} not supported by {label}"
        content = message.get("content")
        if isinstance(content, list) and any(
            not (isinstance(p, dict) and p.get("type") == "text") for p in content
        ):
            return f"messages[{index}] content parts other than text not supported by {label}"
        if message.get("tool_calls") and family != "nova":
            return f"messages[{index}] tool_calls not supported by {label} (a prompt has no tools)"
    if family in PROMPT_FAMILIES and messages[-1].get("role") != "user":
        return f"the last message must be the user's for {label} (the prompt ends with the model's turn)"
    return None


def native_request(family: str, body: Mapping[str, Any], converse: Mapping[str, Any]) -> dict[str, Any]:
    """The ``family``'s native ``modelInput`` for a canonical chat body (checked by ``native_problem``).

    :param family: a key of :data:`FAMILIES`.
    :param body: the canonical (chat completions) body.
    :param converse: the same body as a Converse request (Nova's native body is its sibling).
    """
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    stops = ([stop] if isinstance(stop, str) else list(stop)) if stop else []
    if family == "anthropic":
        params = _claude().encode_line({"custom_id": "record", "body": dict(body)})["params"]
        params.pop("model", None)  # the job names the model
        return {"anthropic_version": BEDROCK_ANTHROPIC_VERSION, **params}
    if family == "nova":
        request: dict[str, Any] = {"schemaVersion": "messages-v1", **converse}
        config = dict(request.pop("inferenceConfig", None) or {})
        # Nova's native inferenceConfig spells two of Converse's names its own way.
        for ours, theirs in (("maxTokens", "max_new_tokens"), ("topP", "top_p")):
            if ours in config:
                config[theirs] = config.pop(ours)
        if config:
            request["inferenceConfig"] = config
        return request
    turns = [(str(m.get("role")), text_content(m.get("content"))) for m in body.get("messages") or []]
    sampling = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    if family == "meta":
        out: dict[str, Any] = {"prompt": llama_prompt(turns), **sampling}
        if most is not None:
            out["max_gen_len"] = most
        return out
    if family == "mistral":
        out = {"prompt": mistral_prompt(turns), **sampling}
        if most is not None:
            out["max_tokens"] = most
        if stops:
            out["stop"] = stops
        return out
    # Titan Text: one text; earlier turns as the "User:"/"Bot:" transcript Titan documents.
    config = {}
    if most is not None:
        config["maxTokenCount"] = most
    if body.get("temperature") is not None:
        config["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        config["topP"] = body["top_p"]
    if stops:
        config["stopSequences"] = stops
    return {"inputText": titan_prompt(turns), **({"textGenerationConfig": config} if config else {})}


def llama_prompt(turns: list[tuple[str, str]]) -> str:
    """Chat turns in the Llama 3 chat template, ending with the assistant's header (its turn)."""
    parts = ["<|begin_of_text|>"]
    for role, text in turns:
        name = "system" if role in ("system", "developer") else role
        parts.append(f"<|start_header_id|>{name}<|end_header_id|>\n\n{text}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def mistral_prompt(turns: list[tuple[str, str]]) -> str:
    """Chat turns as Mistral's ``<s>[INST] ... [/INST]`` prompt (system text opens the first
    instruction, as Mistral's template has no system turn)."""
    system = "\n\n".join(t for r, t in turns if r in ("system", "developer"))
    parts = ["<s>"]
    pending = system
    for role, text in turns:
        if role == "user":
            instruction = f"{pending}\n\n{text}" if pending else text
            pending = ""
            parts.append(f"[INST] {instruction} [/INST]")
        elif role == "assistant":
            parts.append(f" {text}</s>")
    return "".join(parts)


def titan_prompt(turns: list[tuple[str, str]]) -> str:
    """Chat turns as one Titan ``inputText``: a lone user turn as itself, else a transcript."""
    if len(turns) == 1:
        return turns[0][1]
    speaker = {"user": "User: ", "assistant": "Bot: "}
    return "\n".join(f"{speaker.get(role, '')}{text}" for role, text in turns) + "\nBot:"


def is_native_output(output: Mapping[str, Any]) -> bool:
    """Whether a ``modelOutput`` is a native chat answer this module reads (Claude, Llama,
    Mistral, Titan Text; Nova's is Converse-shaped and read as Converse)."""
    return (
        output.get("type") == "message"
        or "generation" in output
        or isinstance(output.get("outputs"), list)
        or isinstance(output.get("results"), list)
    )


def native_completion(output: Mapping[str, Any]) -> dict[str, Any]:
    """A native chat answer (``is_native_output``) as a chat-completion body: content, finish
    reason and usage (when the family reports it)."""
    if output.get("type") == "message":
        return messages_completion(output)
    prompt: Any = None
    completion: Any = None
    if "generation" in output:
        text = output.get("generation")
        stop = output.get("stop_reason")
        prompt, completion = output.get("prompt_token_count"), output.get("generation_token_count")
    elif isinstance(output.get("outputs"), list):
        first = output["outputs"][0] if output["outputs"] and isinstance(output["outputs"][0], dict) else {}
        text, stop = first.get("text"), first.get("stop_reason")
    else:
        first = output["results"][0] if output["results"] and isinstance(output["results"][0], dict) else {}
        text, stop = first.get("outputText"), first.get("completionReason")
        prompt, completion = output.get("inputTextTokenCount"), first.get("tokenCount")
    body: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text if isinstance(text, str) else None},
                "finish_reason": _FINISH.get(stop, stop) if isinstance(stop, str) else None,
            }
        ],
    }
    if type(prompt) is int and type(completion) is int:
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return body


def _claude_problem(body: Mapping[str, Any], label: str) -> str | None:
    """The Anthropic dialect's refusals, and what Bedrock's Claude body lacks besides."""
    if body.get("user") is not None:
        return f"user not supported by {label} (Bedrock's Claude body has no metadata)"
    for index, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            image = part.get("image_url") if isinstance(part, dict) else None
            url = image.get("url") if isinstance(image, dict) else None
            if isinstance(url, str) and not url.startswith("data:"):
                return f"messages[{index}] image_url must be a data: URL for {label} (no remote images)"
    # Checked without its custom_id: Anthropic's own id rule is not Bedrock's recordId rule.
    problem = _claude().unsupported({"url": "/v1/chat/completions", "body": body})
    return f"{label}: {problem}" if problem else None


@cache
def _claude() -> AnthropicDialect:
    """One Anthropic dialect, whose Messages encoding and checks Claude's Bedrock body reuses."""
    return AnthropicDialect()
