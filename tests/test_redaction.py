"""Secrets are masked where they are keys, never where masking would only garble the text."""

from __future__ import annotations

import json

import pytest

from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.redaction import REDACTED, redact, redact_bytes, secret_bytes
from tests.fixtures.hook import FAST

REAL_KEY = "sk-proj-4f9a8b7c6d5e4f3a2b1c0d9e"
TEXT = "xAI failed: set extra 'dialect' to 'openai' (a data engineer's abcd key)"


@pytest.mark.parametrize("key", ["x", "a", "abcd"])
def test_a_key_shorter_than_five_characters_is_not_masked(key: str) -> None:
    assert redact(TEXT, key) == TEXT
    assert redact_bytes(TEXT.encode(), secret_bytes(key)) == TEXT.encode()


def test_a_real_length_key_is_masked_everywhere() -> None:
    text = f"Bearer {REAL_KEY}; echoed as key%3D{REAL_KEY}&x=1 and {REAL_KEY}tail"
    masked = redact(text, REAL_KEY)
    assert REAL_KEY not in masked and masked.count(REDACTED) == 3
    assert REAL_KEY.encode() not in redact_bytes(text.encode(), secret_bytes(REAL_KEY))


def test_a_short_key_is_masked_only_as_a_whole_word() -> None:
    text = "key hello sent; othello and hellos stay; 'hello' masked"
    assert redact(text, "hello") == "key *** sent; othello and hellos stay; '***' masked"
    assert redact_bytes(text.encode(), secret_bytes("hello")) == redact(text, "hello").encode()


def test_several_secrets_are_each_judged() -> None:
    assert redact(f"a {REAL_KEY} b", ["a", REAL_KEY, None]) == "a *** b"  # type: ignore[list-item]


@pytest.mark.parametrize("key", ["x", "a", "abcd", REAL_KEY])
def test_connection_messages_stay_readable_with_any_key(batch_server, monkeypatch, key: str) -> None:
    """The issue's case: with the key ``x`` the dialect hint read ``***AI ... set e***tra``."""
    server = batch_server(dialect="xai", api_key=key)
    conn = json.loads(server.connection_json())
    conn["extra"]["dialect"] = "openai"
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_REDACT", json.dumps(conn))
    ok, message = BatchApiHook("batch_redact", retry_policy=FAST).test_connection()
    assert not ok
    assert "set extra 'dialect'" in message and "'xai'" in message, message
    assert "authenticated: yes" in message
    if len(key) >= 5:
        assert key not in message
