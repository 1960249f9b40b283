"""Reading the canonical chat-completions body, for the dialects that re-encode it.

Vendors whose requests are not OpenAI-shaped (Anthropic's Messages, Gemini's
GenerateContentRequest) read the same canonical fields; what they read in common lives here,
what they write stays in each dialect.
"""

from __future__ import annotations

from typing import Any

import orjson


def forced_tool(choice: Any) -> str | None:
    """The function a ``tool_choice`` forces (``{"type": "function", "function": {"name"}}``), or None.

    :param choice: the canonical body's ``tool_choice``.
    """
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        return name if isinstance(name, str) and name else None
    return None


def text_content(content: Any) -> str:
    """A message's text: the string itself, or its ``text`` parts joined (other parts are not text).

    :param content: a canonical message's ``content`` (a string or a list of parts).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def call_arguments(call: Any) -> dict[str, Any] | None:
    """A canonical ``tool_calls`` entry's arguments as an object, or None when the call has no
    function name or its arguments are not a JSON object (vendors that re-encode need both).

    :param call: one entry of an assistant message's ``tool_calls``.
    """
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not function.get("name"):
        return None
    try:
        parsed = orjson.loads(function.get("arguments") or "{}")
    except (orjson.JSONDecodeError, TypeError):
        return None
    return parsed if isinstance(parsed, dict) else None
