"""Vendor ids (batches, files) as URL path segments: refused when no vendor issues them, then encoded.

Every path a dialect builds from an id goes through :func:`path_segment`, so an id can never
leave its segment: ``../batches/victim#`` must not turn ``DELETE files/{id}`` into
``DELETE batches/victim`` with the key attached. Encoding alone is not enough: ``quote`` keeps
``.``, and httpx resolves ``files/..`` to the API root, so dot segments are refused outright.
A leaf module (no pydantic, no Airflow), so the models, dialects and operators can all use it.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any
from urllib.parse import quote

from airflow_batch_provider.exceptions import InvalidIdError

#: Vendor ids are tens of characters (``batch_`` + 32 hex, UUIDs); far past that is not an id.
MAX_ID_CHARS = 256
# Characters that end or change a path segment, or that a server or proxy may decode into one.
_FORBIDDEN = frozenset("/\\#?%")
# The ids vendors issue (``batch_...``, ``file-...``, UUIDs): accepted without the per-character
# walk, and unchanged by ``quote`` (unreserved characters). Every poll and listing parse checks ids.
_PLAIN = re.compile(r"[A-Za-z0-9_~-]+(?:\.[A-Za-z0-9_~-]+)*")


def id_problem(value: Any) -> str | None:
    """Why ``value`` is not an id a vendor issues, or None when it is one."""
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS and _PLAIN.fullmatch(value):
        return None
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "is empty"
    if len(value) > MAX_ID_CHARS:
        return f"is {len(value):,} characters long (at most {MAX_ID_CHARS})"
    if ".." in value or value == ".":
        return "contains a dot segment ('..' or '.')"
    for char in value:
        if char in _FORBIDDEN:
            return f"contains {char!r}"
        # Whitespace, control, format (e.g. zero-width, bidi) and unassigned characters:
        # categories Z* and C*. No vendor issues them, and some servers strip or split on them.
        if unicodedata.category(char)[0] in "ZC":
            return f"contains the character U+{ord(char):04X}"
    return None


def check_id(value: Any, what: str) -> str:
    """``value`` when it is an id a vendor issues, else :class:`InvalidIdError` naming ``what``.

    :param value: the id.
    :param what: the parameter it came from, for the message (``batch_id``, ``output_file_id``).
    """
    problem = id_problem(value)
    if problem is not None:
        # The value is shown cut short and with repr: it may be long or hold control characters.
        shown = f" {value[:64]!r}{'...' if len(value) > 64 else ''}" if isinstance(value, str) else ""
        raise InvalidIdError(f"{what}{shown} {problem}; no vendor issues such an id")
    return value


def path_segment(value: Any, what: str) -> str:
    """``value`` checked (:func:`check_id`) and percent-encoded as exactly one URL path segment.

    :param value: the id.
    :param what: the parameter it came from, for the message.
    """
    if isinstance(value, str) and len(value) <= MAX_ID_CHARS and _PLAIN.fullmatch(value):
        return value  # nothing to encode
    return quote(check_id(value, what), safe="")
