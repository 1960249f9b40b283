"""Paged results endpoints (Doubleword and xAI) read straight from the output/error files.

Both walk the files with byte offsets, so a page costs its own size, never the whole
file; Doubleword's ``skip`` is mapped to offsets through a small cache of where earlier
pages ended.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from airflow_batch_provider.server.store import Store


def _line_no(result: dict[str, Any]) -> int:
    try:
        return int(str(result.get("id", "")).rsplit("_", 1)[-1])
    except ValueError:
        return 0


def result_sources(
    store: Store, rec: dict[str, Any]
) -> tuple[tuple[Path, int] | None, tuple[Path, int] | None]:
    """(path, readable bytes) of the output and error results, published or still being written."""

    def pick(field: str, kind: str, key: str) -> tuple[Path, int] | None:
        file_id = rec.get(field)
        if file_id:
            path = store.file_path(file_id)
            return (path, path.stat().st_size) if path.exists() else None
        path = store.work_path(rec["id"], kind)
        size = int(rec["progress"][key])
        return (path, size) if size > 0 and path.exists() else None

    return pick("output_file_id", "output", "out"), pick("error_file_id", "error", "err")


class _Cursor:
    """Reads JSONL objects from a file between an offset and a size limit."""

    def __init__(self, source: tuple[Path, int] | None, offset: int) -> None:
        self.fh: IO[bytes] | None = open(source[0], "rb") if source else None  # noqa: SIM115 - closed in close()
        self.limit = source[1] if source else 0
        self.offset = offset
        if self.fh:
            self.fh.seek(offset)
        self.head: dict[str, Any] | None = None
        self.head_end = offset
        self._advance()

    def _advance(self) -> None:
        self.head = None
        if self.fh is None:
            return
        while self.offset < self.limit:
            raw = self.fh.readline()
            if not raw:
                break
            self.head_end = self.offset + len(raw)
            if raw.strip():
                self.head = orjson.loads(raw)
                return
            self.offset = self.head_end

    def take(self) -> dict[str, Any]:
        assert self.head is not None
        item = self.head
        self.offset = self.head_end
        self._advance()
        return item

    def close(self) -> None:
        if self.fh:
            self.fh.close()


class DoublewordResults:
    """``GET /v1/batches/{id}/results?skip=&limit=``: JSONL of ``{id, custom_id, model, input_body,
    response_body, error, status}`` in input order (both result files are written in line order)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._positions: OrderedDict[tuple[str, int], tuple[int, int, int, int]] = OrderedDict()

    def page(self, rec: dict[str, Any], skip: int, limit: int) -> bytes:
        out_src, err_src = result_sources(self.store, rec)
        start = self._positions.get((rec["id"], skip))
        if start is None:
            start, to_skip = (0, 0, 0, 0), skip
        else:
            to_skip = 0
        in_off, in_line, out_off, err_off = start
        out = _Cursor(out_src, out_off)
        err = _Cursor(err_src, err_off)
        lines: list[bytes] = []
        try:
            with open(self.store.file_path(rec["input_file_id"]), "rb") as src:
                src.seek(in_off)
                for item in self._merge(src, in_line, out, err):
                    in_off, in_line = item[1], item[2]
                    if to_skip:
                        to_skip -= 1
                        continue
                    lines.append(orjson.dumps(item[0]))
                    if len(lines) >= limit:
                        break
        finally:
            out.close()
            err.close()
        self._positions[(rec["id"], skip + len(lines))] = (in_off, in_line, out.offset, err.offset)
        while len(self._positions) > 512:
            self._positions.popitem(last=False)
        return b"".join(line + b"\n" for line in lines)

    @staticmethod
    def _merge(
        src: IO[bytes], line: int, out: _Cursor, err: _Cursor
    ) -> Iterator[tuple[dict[str, Any], int, int]]:
        offset = src.tell()
        while out.head is not None or err.head is not None:
            raw = src.readline()
            if not raw:
                return
            line += 1
            offset += len(raw)
            for cursor in (out, err):
                if cursor.head is not None and _line_no(cursor.head) == line:
                    yield _doubleword_item(cursor.take(), orjson.loads(raw)), offset, line
                    break


def _doubleword_item(result: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    response = result.get("response") or {}
    body = response.get("body") if isinstance(response, dict) else None
    status_code = response.get("status_code") if isinstance(response, dict) else None
    error = result.get("error")
    ok = error is None and isinstance(status_code, int) and 200 <= status_code < 300
    if not ok and error is None:
        inner = body.get("error") if isinstance(body, dict) else None
        inner = inner if isinstance(inner, dict) else {}
        error = {"code": inner.get("code") or f"http_{status_code}", "message": inner.get("message")}
    input_body = request.get("body") or {}
    model = (body or {}).get("model") if isinstance(body, dict) else None
    return {
        "id": result.get("id"),
        "custom_id": result.get("custom_id"),
        "model": model or input_body.get("model"),
        "input_body": input_body,
        "response_body": body if ok else None,
        "error": error,
        "status": "completed" if ok else "failed",
    }


def xai_page(store: Store, rec: dict[str, Any], token: str | None, limit: int) -> dict[str, Any]:
    """``GET /v1/batches/{id}/results?limit=&pagination_token=``; the token encodes file offsets."""
    out_src, err_src = result_sources(store, rec)
    which, offset = "o", 0
    if token:
        try:
            which, _, number = base64.urlsafe_b64decode(token.encode()).decode().partition(":")
            offset = int(number)
        except ValueError:
            raise ValueError(f"unreadable pagination_token {token!r}") from None
        source = out_src if which == "o" else err_src if which == "e" else None
        if source is None or not 0 <= offset <= source[1]:
            raise ValueError(f"pagination_token {token!r} points outside this batch's results")
    results: list[dict[str, Any]] = []
    next_token: str | None = None
    for kind, source in (("o", out_src), ("e", err_src)):
        if kind == "o" and which == "e":
            continue
        cursor = _Cursor(source, offset if kind == which else 0)
        try:
            while cursor.head is not None and len(results) < limit:
                results.append(_xai_item(cursor.take()))
            if len(results) >= limit:
                # Point at whatever remains: the rest of this file, or the start of the error file.
                if cursor.head is not None:
                    next_token = _token(kind, cursor.offset)
                elif kind == "o" and err_src is not None:
                    next_token = _token("e", 0)
                break
        finally:
            cursor.close()
    return {"results": results, "pagination_token": next_token}


def _token(kind: str, offset: int) -> str:
    return base64.urlsafe_b64encode(f"{kind}:{offset}".encode()).decode()


def _xai_item(result: dict[str, Any]) -> dict[str, Any]:
    response = result.get("response")
    error = result.get("error")
    out_response: Any = None
    if isinstance(response, dict):
        status_code = response.get("status_code")
        body = response.get("body")
        if isinstance(status_code, int) and 200 <= status_code < 300 and error is None:
            if isinstance(body, dict) and body.get("object") == "chat.completion":
                # xAI's REST results name the answer after the RPC that produced it.
                out_response = {"chat_get_completion": body}
            else:
                out_response = {"status_code": status_code, "body": body}
        else:
            inner = body.get("error") if isinstance(body, dict) else None
            inner = inner if isinstance(inner, dict) else {}
            error = {
                "code": inner.get("code") or f"http_{status_code}",
                "message": inner.get("message") or "request failed",
            }
    if isinstance(error, dict) and error.get("code") in _GRPC_STATUS:
        # xAI's per-line error is a gRPC status: the lines a cancel or the expiry stopped carry
        # CANCELLED (1) or DEADLINE_EXCEEDED (4).
        error = {"code": _GRPC_STATUS[error["code"]], "message": error.get("message") or ""}
    return {
        "batch_request_id": result.get("custom_id"),
        # A success carries an empty status, as a proto3 message rendered to JSON does.
        "batch_result": {"response": out_response, "error": error if error is not None else {}},
    }


_GRPC_STATUS = {"batch_cancelled": 1, "batch_expired": 4}
