"""HTML pages of the local batch server: ``/ui/batches``, ``/ui/batches/{id}``, ``/ui/files/{id}``.

Plain HTML and CSS, no JavaScript: a developer running the server sees what the pipeline did.
Everything shown comes from API callers (metadata, names, file names, error messages), so every
value is HTML-escaped and every response forbids scripts through its Content-Security-Policy.

Auth rule: a server started without a key shows the pages to whoever reaches its port (as its API);
a server started with a key demands it here too, by HTTP Basic auth (any user name, the key as
password: the browser asks once) or ``Authorization: Bearer``. A key in the query string is refused
on purpose: it would land in browser history, access logs and ``Referer`` headers.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import datetime, timezone
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from airflow_batch_provider.server.engine import TERMINAL
from airflow_batch_provider.server.store import Store

PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
_CHUNK = 1 << 16
_REALM = 'Basic realm="airflow-batch local server", charset="UTF-8"'
# No script, no frame, no form, no outside resource: only this page's own inline <style>.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; base-uri 'none'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_FINISHED = ("completed_at", "failed_at", "expired_at", "cancelled_at")
_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em 2em;color:#1d2330}
h1{font-size:1.4em;margin:0 0 .6em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse}td,th{padding:.3em .7em;border-bottom:1px solid #dde;text-align:left;
vertical-align:top}th{background:#f3f4f8}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,monospace}a{color:#1b5fc1}
.status{display:inline-block;padding:0 .5em;border-radius:.8em;background:#e6e8ef}
.s-completed{background:#d5f2dc}.s-failed,.s-expired{background:#f8d7d7}
.s-in_progress,.s-validating,.s-finalizing{background:#fff1c4}.s-cancelled,.s-cancelling{background:#e0e0e0}
progress{width:7em;height:1em;vertical-align:middle}td.t,td.p{white-space:nowrap}
.nav{margin:1em 0}.muted{color:#6b7280}
"""


def _page_headers() -> dict[str, str]:
    return dict(_HEADERS)


def _e(value: Any) -> str:
    """HTML-escaped text of ``value`` (quotes too, so it is safe inside attributes)."""
    return escape("" if value is None else str(value), quote=True)


def _presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in ``Authorization`` (Basic password or Bearer token) or ``x-api-key``."""
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    token = token.strip()
    if scheme.lower() == "bearer" and token:
        return token
    if scheme.lower() == "basic" and token:
        try:
            decoded = base64.b64decode(token, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return (headers.get("x-api-key") or "").strip() or None


async def _ui_guard(request: Request) -> None:
    """Demand the server's key (when it has one) before showing anything."""
    key: str | None = request.app.state.server.config.api_key
    if key is None:
        return
    presented = _presented_key(request.headers)
    # Constant-time, and the 401 never says how close a guess was.
    if presented is None or not hmac.compare_digest(presented.encode(), key.encode()):
        raise UiError(401, "This server needs its API key: give it as the password (any user name).")


class UiError(Exception):
    """A page that cannot be shown: answered as an HTML error page with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error_page(exc: UiError) -> Response:
    """An HTML error page; a 401 asks the browser for the key."""
    headers = _page_headers()
    if exc.status == 401:
        headers["WWW-Authenticate"] = _REALM
    body = _layout(f"Error {exc.status}", f"<h1>Error {exc.status}</h1><p>{_e(exc.message)}</p>")
    return HTMLResponse(body, status_code=exc.status, headers=headers)


def _layout(title: str, body: str, *, refresh: bool = False) -> str:
    # A live batch's page reloads itself every 5 s: progress without JavaScript.
    meta = '<meta http-equiv="refresh" content="5">' if refresh else ""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title>{meta}<style>{_STYLE}</style></head>"
        f'<body><p class="muted"><a href="/ui/batches">Batches</a> &middot; airflow-batch local server</p>'
        f"{body}</body></html>"
    )


def _when(ts: Any, suffix: str = " UTC") -> str:
    if not isinstance(ts, (int, float)):
        return ""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S") + suffix


def _counts(rec: Mapping[str, Any]) -> tuple[int, int, int]:
    counts = rec.get("request_counts") or {}
    return int(counts.get("total") or 0), int(counts.get("completed") or 0), int(counts.get("failed") or 0)


def _progress(rec: Mapping[str, Any]) -> str:
    """A plain ``<progress>`` bar of answered lines (completed + failed) over all lines."""
    total, completed, failed = _counts(rec)
    done = min(completed + failed, total)
    pct = 100 * done // total if total else 0
    return f'<progress max="{max(total, 1)}" value="{done}"></progress> <span class="pct">{pct}%</span>'


def _status(rec: Mapping[str, Any]) -> str:
    status = str(rec.get("status"))
    return f'<span class="status s-{_e(status)}" data-status="{_e(status)}">{_e(status)}</span>'


def _batch_link(batch_id: str) -> str:
    return f'<a href="/ui/batches/{quote(batch_id, safe="")}"><code>{_e(batch_id)}</code></a>'


def _finished(rec: Mapping[str, Any]) -> Any:
    return next((rec[k] for k in _FINISHED if rec.get(k)), None)


def _list_page(items: Iterable[Mapping[str, Any]], more: bool, limit: int, after: str | None) -> str:
    rows = []
    last = None
    for rec in items:
        last = str(rec["id"])
        total, completed, failed = _counts(rec)
        rows.append(
            f'<tr data-batch="{_e(last)}"><td>{_batch_link(last)}</td><td>{_status(rec)}</td>'
            f"<td>{_e(rec.get('name') or '')}</td>"
            f'<td class="n total">{total}</td><td class="n completed">{completed}</td>'
            f'<td class="n failed">{failed}</td><td class="p">{_progress(rec)}</td>'
            f"<td class='t'>{_when(rec.get('created_at'), '')}</td>"
            f"<td class='t'>{_when(_finished(rec), '')}</td></tr>"
        )
    nav = []
    if after:
        nav.append(f'<a href="/ui/batches?{urlencode({"limit": limit})}">&laquo; newest</a>')
    if more and last is not None:
        nav.append(
            f'<a rel="next" href="/ui/batches?{urlencode({"after": last, "limit": limit})}">older &raquo;</a>'
        )
    table = (
        "<table><tr><th>batch</th><th>status</th><th>name</th><th>total</th>"
        "<th>completed</th><th>failed</th><th>progress</th><th>created (UTC)</th><th>finished (UTC)</th></tr>"
        + "".join(rows)
        + "</table>"
        if rows
        else "<p>No batch yet.</p>"
    )
    return _layout("Batches", f"<h1>Batches</h1>{table}<p class='nav'>{' &middot; '.join(nav)}</p>")


def _file_row(store: Store, label: str, file_id: Any) -> str:
    if not file_id:
        return f"<tr><th>{_e(label)}</th><td class='muted'>none</td></tr>"
    rec = store.get_file(str(file_id))
    if rec is None:
        gone = "<span class='muted'>(deleted)</span>"
        return f"<tr><th>{_e(label)}</th><td><code>{_e(file_id)}</code> {gone}</td></tr>"
    return (
        f"<tr><th>{_e(label)}</th><td><a class='file' href='/ui/files/{quote(str(file_id), safe='')}'>"
        f"<code>{_e(file_id)}</code></a> {_e(rec.get('filename'))} "
        f"<span class='muted'>{int(rec.get('bytes') or 0):,} bytes</span></td></tr>"
    )


def _where(problem: Mapping[str, Any]) -> str:
    return f"line {problem['line']}: " if problem.get("line") else ""


def _batch_page(store: Store, rec: Mapping[str, Any]) -> str:
    batch_id = str(rec["id"])
    total, completed, failed = _counts(rec)
    summary = (
        f"<table><tr><th>status</th><td>{_status(rec)}</td></tr>"
        f"<tr><th>name</th><td>{_e(rec.get('name') or '')}</td></tr>"
        f"<tr><th>endpoint</th><td><code>{_e(rec.get('endpoint'))}</code></td></tr>"
        f"<tr><th>completion window</th><td>{_e(rec.get('completion_window'))}</td></tr>"
        f"<tr><th>progress</th><td>{_progress(rec)}</td></tr></table>"
    )
    counts = (
        "<table><tr><th>total</th><th>completed</th><th>failed</th><th>pending</th></tr>"
        f'<tr><td class="n total">{total}</td><td class="n completed">{completed}</td>'
        f'<td class="n failed">{failed}</td><td class="n pending">{max(total - completed - failed, 0)}</td>'
        "</tr></table>"
    )
    # Every lifecycle timestamp the record has (``*_at``), in the record's own order.
    times = "".join(
        f"<tr><th>{_e(k.removesuffix('_at').replace('_', ' '))}</th><td>{_when(v)}</td></tr>"
        for k, v in rec.items()
        if k.endswith("_at") and v
    )
    files = "".join(
        _file_row(store, label, rec.get(key))
        for label, key in (
            ("input", "input_file_id"),
            ("output", "output_file_id"),
            ("errors", "error_file_id"),
        )
    )
    metadata = rec.get("metadata") or {}
    meta = (
        "<table>"
        + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in dict(metadata).items())
        + "</table>"
        if metadata
        else "<p class='muted'>none</p>"
    )
    problems = ""
    if rec.get("errors") or rec.get("cancel_message"):
        items = "".join(
            f"<li>{_e(_where(p))}{_e(p.get('code'))}: {_e(p.get('message'))}</li>"
            for p in rec.get("errors") or []
            if isinstance(p, Mapping)
        )
        note = f"<p>{_e(rec.get('cancel_message'))}</p>" if rec.get("cancel_message") else ""
        problems = f"<h2>Problems</h2>{note}<ul>{items}</ul>"
    body = (
        f"<h1>Batch <code>{_e(batch_id)}</code></h1>{summary}<h2>Requests</h2>{counts}"
        f"<h2>Files</h2><table>{files}</table><h2>Timestamps</h2><table>{times}</table>"
        f"<h2>Metadata</h2>{meta}{problems}"
    )
    return _layout(f"Batch {batch_id}", body, refresh=rec.get("status") not in TERMINAL)


def ui_router() -> APIRouter:
    """The ``/ui`` pages (read-only; guarded by the server's key when it has one)."""
    r = APIRouter(prefix="/ui", dependencies=[Depends(_ui_guard)], include_in_schema=False)

    @r.get("/batches")
    async def batches(request: Request) -> Response:
        st = request.app.state.server
        q = request.query_params
        try:
            limit = max(1, min(int(q.get("limit") or PAGE_SIZE), MAX_PAGE_SIZE))
        except ValueError:
            raise UiError(400, "limit must be an integer.") from None
        after = q.get("after") or None
        items, more = st.store.list_batches(after=after, limit=limit)
        # A live batch is fresher in memory than in its last checkpoint.
        items = [st.engine.active.get(i["id"], i) for i in items]
        return HTMLResponse(_list_page(items, more, limit, after), headers=_page_headers())

    @r.get("/batches/{batch_id}")
    async def batch(batch_id: str, request: Request) -> Response:
        st = request.app.state.server
        rec = st.engine.get(batch_id)
        if rec is None:
            raise UiError(404, f"No batch {batch_id!r}.")
        return HTMLResponse(_batch_page(st.store, rec), headers=_page_headers())

    @r.get("/files/{file_id}")
    async def file(file_id: str, request: Request) -> Response:
        """A stored file as plain text (never rendered as HTML: ``nosniff`` and a sandbox policy)."""
        st = request.app.state.server
        rec = st.store.get_file(file_id)
        path = st.store.file_path(file_id) if rec is not None else None
        if path is None or not path.exists():
            raise UiError(404, f"No file {file_id!r}.")

        async def body() -> AsyncIterator[bytes]:
            # Local-disk reads of 64 KiB are cheaper than a thread hop per chunk.
            with open(path, "rb") as fh:  # noqa: ASYNC230
                while chunk := fh.read(_CHUNK):
                    yield chunk

        headers = {**_page_headers(), "Content-Security-Policy": "default-src 'none'; sandbox"}
        headers["Content-Length"] = str(path.stat().st_size)
        return StreamingResponse(body(), media_type="text/plain; charset=utf-8", headers=headers)

    return r


def install(app: Any) -> None:
    """Add the ``/ui`` pages and their HTML error answers to ``app``."""
    app.include_router(ui_router())

    @app.exception_handler(UiError)
    async def _ui_error(request: Request, exc: UiError) -> Response:
        return _error_page(exc)
