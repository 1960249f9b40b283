"""Keeping secrets (API keys, tokens) out of text and bytes: the one masking rule of the package.

A secret shorter than :data:`MIN_SECRET_CHARS` is not masked at all: such a value is no real
key, and masking it would garble every message (with the key ``x``, "xAI" and "extra" lose
letters). Airflow's own secrets masker skips values that short for the same reason. A secret
shorter than :data:`ANYWHERE_CHARS` is masked only where it stands alone, not inside a longer
word (a test key ``hello`` leaves "othello" alone); a longer one is machine-made and masked
wherever it occurs, even glued to other characters (``%3Dsk-...`` in an encoded URL).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

REDACTED = "***"
#: Shortest secret that is masked (Airflow's masker skips shorter ones too).
MIN_SECRET_CHARS = 5
#: Shortest secret masked even inside a longer word.
ANYWHERE_CHARS = 16

Secrets = str | Iterable[str] | None


def each_secret(secret: Secrets) -> tuple[str, ...]:
    """The secrets of ``secret`` (one, several or none) that are long enough to mask."""
    found = (secret,) if isinstance(secret, str) or secret is None else tuple(secret)
    return tuple(one for one in found if one and len(one) >= MIN_SECRET_CHARS)


@lru_cache(maxsize=64)
def _pattern(secret: str) -> re.Pattern[str]:
    # Bounded only on a side where the secret itself starts or ends with a word character:
    # a secret starting with "-" next to a letter is still a whole token.
    head = r"(?<!\w)" if re.match(r"\w", secret[0]) else ""
    tail = r"(?!\w)" if re.match(r"\w", secret[-1]) else ""
    return re.compile(head + re.escape(secret) + tail)


@lru_cache(maxsize=64)
def _bytes_pattern(secret: bytes) -> re.Pattern[bytes]:
    text = secret.decode("utf-8", "replace")
    head = rb"(?<!\w)" if re.match(r"\w", text[0]) else b""
    tail = rb"(?!\w)" if re.match(r"\w", text[-1]) else b""
    return re.compile(head + re.escape(secret) + tail)


def redact(text: str, secret: Secrets) -> str:
    """``text`` with each maskable secret replaced by ``***``.

    :param text: any text (a message, a vendor's answer).
    :param secret: one secret, several, or None.
    """
    for one in each_secret(secret):
        if one in text:
            text = (
                text.replace(one, REDACTED)
                if len(one) >= ANYWHERE_CHARS
                else _pattern(one).sub(REDACTED, text)
            )
    return text


def redact_bytes(data: bytes, secrets: Iterable[bytes]) -> bytes:
    """``data`` with each maskable secret (as UTF-8 bytes) replaced by ``***``; fast when none occurs.

    :param data: a line or answer as bytes.
    :param secrets: the secrets' UTF-8 bytes (see :func:`secret_bytes`).
    """
    for one in secrets:
        if one in data:
            data = (
                data.replace(one, REDACTED.encode())
                if len(one) >= ANYWHERE_CHARS
                else _bytes_pattern(one).sub(REDACTED.encode(), data)
            )
    return data


def secret_bytes(secret: Secrets) -> tuple[bytes, ...]:
    """The maskable secrets of ``secret`` as UTF-8 bytes, for :func:`redact_bytes`."""
    return tuple(one.encode() for one in each_secret(secret))


def occurs(raw: bytes, secret: Secrets) -> bool:
    """Whether any maskable secret occurs in ``raw`` (a cheap test before walking parsed JSON)."""
    return any(one.encode() in raw for one in each_secret(secret))
