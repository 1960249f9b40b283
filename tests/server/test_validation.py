"""Every validation rule of the shared validator, reported on the failed batch with its line."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.server.helpers import chat_line, create, jsonl, upload, wait_for

GOOD = orjson.dumps(chat_line(0))


def _line(**changes):
    line = chat_line(9)
    line.update(changes)
    return orjson.dumps(line)


CASES = {
    "invalid_json": ([GOOD, b'{"custom_id": "x",'], {}, (2, "invalid_json", None)),
    "invalid_line": ([GOOD, b'["an", "array"]'], {}, (2, "invalid_line", None)),
    "invalid_custom_id_missing": (
        [orjson.dumps({k: v for k, v in chat_line(1).items() if k != "custom_id"})],
        {},
        (1, "invalid_custom_id", "custom_id"),
    ),
    "invalid_custom_id_empty": ([_line(custom_id="")], {}, (1, "invalid_custom_id", "custom_id")),
    "duplicate_custom_id": ([GOOD, b"", GOOD], {}, (3, "duplicate_custom_id", "custom_id")),
    "invalid_method": ([GOOD, _line(method="GET")], {}, (2, "invalid_method", "method")),
    "invalid_url": ([GOOD, _line(url="/v1/images/generations")], {}, (2, "invalid_url", "url")),
    "mismatched_url": ([GOOD, _line(url="/v1/embeddings")], {}, (2, "mismatched_url", "url")),
    "invalid_body_empty": ([_line(body={})], {}, (1, "invalid_body", "body")),
    "invalid_body_type": ([_line(body="text")], {}, (1, "invalid_body", "body")),
    "stream_not_supported": (
        [_line(body={"model": "m", "messages": [], "stream": True})],
        {},
        (1, "stream_not_supported", "body.stream"),
    ),
    "line_too_large": (
        [GOOD, _line(body={"model": "m", "pad": "x" * 600})],
        {"max_line_bytes": 500},
        (2, "line_too_large", None),
    ),
    "byte_order_mark": ([b"\xef\xbb\xbf" + GOOD], {}, (1, "byte_order_mark", None)),
    "invalid_utf8": ([GOOD, b'{"custom_id": "\xff\xfe"}'], {}, (2, "invalid_utf8", None)),
    "empty_file": ([b"", b"   "], {}, (None, "empty_file", None)),
    "too_many_lines": (
        [orjson.dumps(chat_line(i)) for i in range(4)],
        {"max_lines": 3},
        (None, "too_many_lines", None),
    ),
}
# file_too_large: the upload itself is refused now (tests/server/test_hardening.py).


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_fails_the_batch_naming_the_line(batch_server, name):
    lines, config, (line, code, param) = CASES[name]
    server = batch_server(**config)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        done = wait_for(client, create(client, upload(client, b"\n".join(lines) + b"\n"))["id"])
    assert done["status"] == "failed", done
    errors = done["errors"]["data"]
    assert {"code": code, "line": line, "param": param} in [
        {"code": e["code"], "line": e["line"], "param": e["param"]} for e in errors
    ], errors
    assert all(e["message"] for e in errors)


def test_blank_lines_are_skipped_not_counted(batch_server):
    server = batch_server()
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        data = jsonl([chat_line(1)]) + b"\n   \n" + jsonl([chat_line(2)])
        done = wait_for(client, create(client, upload(client, data))["id"])
    assert done["status"] == "completed"
    assert done["request_counts"]["total"] == 2


def test_reported_errors_are_capped(batch_server):
    server = batch_server(max_reported_errors=5)
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        data = jsonl(b"not json" for _ in range(50))
        done = wait_for(client, create(client, upload(client, data))["id"])
    assert [e["line"] for e in done["errors"]["data"]] == [1, 2, 3, 4, 5]
