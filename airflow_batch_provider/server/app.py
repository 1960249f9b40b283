"""FastAPI application of the local batch server: /v1 files, batches, results, sync inference, /admin."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import httpx
import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from starlette.exceptions import HTTPException

from airflow_batch_provider.server import ui
from airflow_batch_provider.server.backends import make_backend
from airflow_batch_provider.server.bedrock import (
    BedrockWire,
    download_input,
    export_results,
    new_job_id,
    s3_client,
    submitted,
)
from airflow_batch_provider.server.config import BATCH_FAULTS, REQUEST_FAULTS, ServerConfig
from airflow_batch_provider.server.engine import TERMINAL, Engine, new_batch_record, validate_file
from airflow_batch_provider.server.faults import Faults
from airflow_batch_provider.server.hosts import HostCheckMiddleware, allowed_hosts
from airflow_batch_provider.server.queue import count_file, enqueued, over_limit_message
from airflow_batch_provider.server.results import DoublewordResults, xai_page
from airflow_batch_provider.server.store import Store, now
from airflow_batch_provider.server.vertex import (
    VertexWire,
    decode_token,
    download,
    encode_token,
    job_labels_match,
    not_ready,
    output_dir,
    upload,
    vertex_job_id,
)
from airflow_batch_provider.server.vertex_bigquery import COLUMNS_SUFFIX
from airflow_batch_provider.server.vertex_bigquery import read_input as read_input_table
from airflow_batch_provider.server.vertex_bigquery import write_output as write_output_table
from airflow_batch_provider.server.wire import AnthropicWire, ApiError, Wire, get_wire

log = logging.getLogger(__name__)

FAULT_HEADER = "x-batch-fault"
_DOWNLOAD_CHUNK = 1 << 16
_MAX_FORM_FIELD = 1 << 16  # bytes of one form field (the file part aside)
# An upload is a file and a few fields (purpose, expires_after[...]); thousands of fields are refused.
_MAX_FORM_PARTS = 16
# After refusing an oversized body, read (and discard) at most this much more of it so the
# client, still sending, gets the error answer instead of a reset connection.
_MAX_DRAIN = 64 << 20


class ORJSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class ServerState:
    """Everything a request handler needs, created once per app."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.wire: Wire = get_wire(config.dialect)
        self.wire.bearer_token = config.bearer_token
        self.store = Store(config.data_dir, config.max_storage_bytes)
        self.faults = Faults(config.faults.model_copy())
        self.backend = make_backend(config)
        self.engine = Engine(self.store, config, self.faults, self.backend, self.wire)
        self.dw_results = DoublewordResults(self.store)
        # Open resumable upload sessions by id (``Wire.upload_prefix``): in memory, so a restart
        # ends them (the client starts a new one).
        self.uploads: dict[str, dict[str, Any]] = {}
        # Held from a create's enqueued-token sum until its batch is live, so two creates at
        # once cannot both fit under ``max_enqueued_tokens`` by each not seeing the other.
        self.queue_lock = asyncio.Lock()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def _guard(request: Request) -> None:
    """Authentication first, then faults: without the key nobody can trigger or observe a fault."""
    st = _state(request)
    faults = st.faults
    faults.count("requests")
    wire = st.wire
    # A resumable upload's session URL is its own credential (Google's clients send no key to it):
    # the unguessable upload_id, issued only to a caller that presented the key.
    in_session = (
        wire.upload_prefix is not None
        and request.url.path.startswith(wire.upload_prefix)
        and "upload_id" in request.query_params
    )
    if in_session:
        pass
    elif wire.signed_requests:
        body = await request.body()  # kept by the request: the handler reads it again
        # The path as sent (still percent-encoded): the signature covers its encoded form.
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string") or b""
        url = f"{request.url.scheme}://{request.url.netloc}{raw_path.decode('latin-1')}"
        url += f"?{query.decode('latin-1')}" if query else ""
        wire.check_signature(request.method, url, request.headers, body, st.config.api_key)
    else:
        wire.check_auth(request.headers, st.config.api_key)
    st.wire.check_request(request.url.path, request.query_params)
    forced = request.headers.get(FAULT_HEADER, "").strip().lower()
    if forced and forced not in REQUEST_FAULTS and forced not in BATCH_FAULTS:
        raise st.wire.error(
            400, f"unknown {FAULT_HEADER} {forced!r}; use one of {', '.join(REQUEST_FAULTS + BATCH_FAULTS)}"
        )
    cfg = faults.config
    if forced == "slow" or (not forced and faults.fires("slow", cfg.slow_rate)):
        faults.count("slow")
        await asyncio.sleep(cfg.slow_seconds)
    if forced == "quota":
        faults.count("quota")
        raise st.wire.quota_exceeded()
    for status, rate in ((429, cfg.rate_429), (500, cfg.rate_500), (503, cfg.rate_503)):
        if forced == str(status) or (not forced and faults.fires(str(status), rate)):
            faults.count(f"status_{status}")
            if status == 429:
                raise st.wire.rate_limited(cfg.retry_after)
            raise st.wire.server_error(status, cfg.retry_after)
    request.state.fault = forced


def create_app(config: ServerConfig) -> FastAPI:
    """Build the server application for ``config`` (state is opened when the app starts)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = ServerState(config)
        app.state.server = state
        resumed = state.engine.resume_all()
        if resumed:
            log.info("resumed %d live batches", resumed)
        try:
            yield
        finally:
            await state.engine.stop()
            await state.backend.aclose()
            state.store.close()

    app = FastAPI(title="airflow-batch local batch server", lifespan=lifespan, default_response_class=ORJSON)
    # Outermost: a request naming a host this server does not serve reaches no route (DNS rebinding).
    app.add_middleware(
        HostCheckMiddleware,
        allowed=allowed_hosts(config.host, config.allowed_hosts),
        wire=get_wire(config.dialect),
    )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return ORJSON(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown paths and wrong methods answer in the vendor's error shape too.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = _state(request).wire.error(exc.status_code, str(exc.detail), code=code)
        return ORJSON(err.body, status_code=err.status, headers={**err.headers, **(exc.headers or {})})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # A bug still answers JSON in the vendor's shape (the traceback goes to the log only).
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        err = _state(request).wire.error(
            500, f"The local batch server failed ({type(exc).__name__}).", type_="server_error"
        )
        return ORJSON(err.body, status_code=err.status)

    # Each prefix the mode's vendor serves its API under (``/v1``; Azure: ``/openai/v1``, ``/openai``).
    for prefix in get_wire(config.dialect).path_prefixes:
        api = APIRouter(prefix=prefix, dependencies=[Depends(_guard)])
        _files_routes(api)
        _batch_routes(api)
        _message_batch_routes(api)
        _prediction_job_routes(api)
        _invocation_job_routes(api)
        _inference_routes(api)
        app.include_router(api)
    upload_prefix = get_wire(config.dialect).upload_prefix
    if upload_prefix is not None:
        uploads = APIRouter(prefix=upload_prefix, dependencies=[Depends(_guard)])
        _resumable_routes(uploads)
        app.include_router(uploads)
    app.include_router(_admin_router())
    ui.install(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "dialect": config.dialect, "backend": config.backend}

    return app


# ---- files ---------------------------------------------------------------------------
class _UploadSink:
    """Receives a multipart body chunk by chunk, writing the file part straight to disk.

    Every byte of the file is reserved under the storage cap before it is written, and the
    form is bounded (parts, field bytes): the first bound passed sets
    ``refused`` and nothing more is kept; the caller stops reading and answers the refusal.

    :param store: where the file's bytes are reserved (``reserved`` bytes to give back on failure).
    :param dest: the temporary file the file part goes to.
    :param limit: largest file accepted (``max_file_bytes``).
    """

    def __init__(self, store: Store, dest: Any, limit: int) -> None:
        self.store = store
        self.dest = dest
        self.limit = limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.reserved = 0
        self.parts = 0
        # "file_too_large" | "storage_full" | a message about the form (a 400).
        self.refused: str | None = None
        self._fh: Any = None
        self._headers: dict[bytes, bytes] = {}
        self._hname = b""
        self._hvalue = b""
        self._name: str | None = None
        self._buffer = bytearray()

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_part_begin": self._begin,
            # python-multipart bounds header lines (4 KiB) and their count (8) per part itself.
            "on_header_field": lambda d, s, e: setattr(self, "_hname", self._hname + d[s:e]),
            "on_header_value": lambda d, s, e: setattr(self, "_hvalue", self._hvalue + d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > _MAX_FORM_PARTS:
            self._refuse(f"The form has more than {_MAX_FORM_PARTS} parts (a file and a few fields).")
        self._headers = {}
        self._name = None
        self._buffer = bytearray()

    def _header_end(self) -> None:
        self._headers[self._hname.lower()] = self._hvalue
        self._hname = self._hvalue = b""

    def _headers_done(self) -> None:
        if self.refused is not None:
            return
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self._fh is not None:
                self._refuse("Only one file part is allowed.")
                return
            self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
            self._fh = open(self.dest, "wb")  # noqa: SIM115 - closed in _end/close

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.refused is not None:
            return
        size = end - start
        if self._name == "file" and self._fh is not None and not self._fh.closed:
            if self.size + size > self.limit:
                self._refuse("file_too_large")
            elif not self.store.reserve(size):
                # Reserved as it streams: concurrent uploads cannot pass the cap between them.
                self._refuse("storage_full")
            else:
                self.reserved += size
                self._fh.write(data[start:end])
                self.size += size
        elif len(self._buffer) + size > _MAX_FORM_FIELD:
            self._refuse(f"Form field {self._name!r} is larger than {_MAX_FORM_FIELD:,} bytes.")
        else:
            self._buffer += data[start:end]

    def _end(self) -> None:
        if self._name == "file" and self._fh is not None:
            self._fh.close()
        elif self._name and self.refused is None:
            self.fields[self._name] = self._buffer.decode("utf-8", "replace")

    def close(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.close()

    def discard(self) -> None:
        """Remove the partial file and give its reserved bytes back (a refused or broken upload)."""
        self.close()
        self.dest.unlink(missing_ok=True)
        self.store.release(self.reserved)
        self.reserved = 0


def _content_disposition(filename: str) -> str:
    """RFC 6266: a plain-ASCII ``filename`` for old clients, the exact name in ``filename*``."""
    fallback = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename) or "download"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def _storage_room(st: ServerState) -> None:
    """Refuse with a 507 when nothing more can be stored (writers still reserve what they write)."""
    room = st.store.room()
    if room is not None and room <= 0:
        raise _storage_full(st)


def _storage_full(st: ServerState) -> Exception:
    return st.wire.error(
        507,
        f"The server's storage is full (limit {st.config.max_storage_bytes:,} bytes); "
        "delete files to make room.",
        type_="server_error",
        code="insufficient_storage",
    )


async def _read_body(st: ServerState, request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 once it passes ``limit`` bytes (never held whole)."""
    raw = bytearray()
    stream = request.stream()
    async for chunk in stream:
        raw += chunk
        if len(raw) > limit:
            await _drain(stream)
            raise st.wire.error(
                413, f"Request body is larger than the limit of {limit:,} bytes.", code="request_too_large"
            )
    return bytes(raw)


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Read and drop what is left of a refused request body, up to ``_MAX_DRAIN`` bytes."""
    seen = 0
    with contextlib.suppress(Exception):
        async for chunk in stream:
            seen += len(chunk)
            if seen > _MAX_DRAIN:
                break


def _files_routes(r: APIRouter) -> None:
    @r.post("/files")
    async def upload(request: Request) -> dict[str, Any]:
        st = _state(request)
        wire = st.wire
        ctype, params = parse_options_header(request.headers.get("content-type", ""))
        boundary = params.get(b"boundary")
        if ctype != b"multipart/form-data" or not boundary:
            raise wire.error(400, "Upload must be multipart/form-data with a 'file' part.", param="file")
        limit = st.config.limits().max_file_bytes
        _storage_room(st)
        file_id = st.store.new_id("file-", wire.id_style)
        temp = st.store.temp_path(file_id)
        sink = _UploadSink(st.store, temp, limit)
        parser = MultipartParser(boundary, cast(Any, sink.callbacks()))
        stream = request.stream()
        try:
            async for chunk in stream:
                parser.write(chunk)
                if sink.refused is not None:
                    break
            else:
                parser.finalize()
        except asyncio.CancelledError:
            sink.discard()
            raise
        except Exception as exc:
            sink.discard()
            raise wire.error(400, f"Could not read the multipart body: {exc}", param="file") from None
        sink.close()
        if sink.refused is not None:
            sink.discard()
            await _drain(stream)
            if sink.refused == "file_too_large":
                raise wire.error(
                    413,
                    f"File is larger than the limit of {limit:,} bytes.",
                    code="file_too_large",
                    param="file",
                )
            if sink.refused == "storage_full":
                raise _storage_full(st)
            raise wire.error(400, sink.refused, param="file")
        if parser.state != MultipartState.END:
            sink.discard()
            raise wire.error(
                400,
                "The multipart body ends before its closing boundary: the upload is incomplete.",
                param="file",
            )
        if sink.filename is None:
            sink.discard()
            raise wire.error(400, "Missing required parameter: 'file'.", param="file")
        upload_limit = st.config.limits().max_upload_bytes
        if upload_limit is not None and sink.size > upload_limit:
            sink.discard()
            raise wire.upload_too_large(upload_limit)
        purpose = sink.fields.get("purpose")
        if wire.upload_requires_purpose and not purpose:
            sink.discard()
            raise wire.error(400, "Missing required parameter: 'purpose'.", param="purpose")
        os.replace(temp, st.store.file_path(file_id))
        rec = {
            "id": file_id,
            "bytes": sink.size,
            "created_at": now(),
            "filename": sink.filename,
            "purpose": purpose,
        }
        try:
            rec.update(wire.upload_fields(sink.fields))
        except ApiError:
            st.store.file_path(file_id).unlink(missing_ok=True)
            raise
        st.store.add_file(rec)
        st.faults.count("files_uploaded")
        return wire.render_file(rec)

    @r.get("/files")
    async def list_files(request: Request) -> dict[str, Any]:
        st = _state(request)
        q = request.query_params
        try:
            limit = int(q.get("limit") or 10000)
        except ValueError:
            raise st.wire.error(400, "limit must be an integer.", param="limit") from None
        items, more = st.store.list_files(
            after=q.get("after"), limit=max(1, min(limit, 10000)), purpose=q.get("purpose")
        )
        return st.wire.render_file_list(items, more)

    @r.get("/files/{file_id}", response_model=None)
    async def get_file(file_id: str, request: Request) -> dict[str, Any] | Response:
        st = _state(request)
        if st.wire.colon_download and file_id.endswith(":download"):
            # Google's custom method: GET files/{id}:download?alt=media is the file's content.
            if request.query_params.get("alt") != "media":
                raise st.wire.error(400, "files:download needs alt=media.")
            return await content(file_id.removesuffix(":download"), request)
        rec = st.store.get_file(file_id)
        if rec is None:
            raise st.wire.not_found("file", file_id)
        return st.wire.render_file(rec)

    @r.get("/files/{file_id}/content")
    async def content(file_id: str, request: Request) -> Response:
        st = _state(request)
        rec = st.store.get_file(file_id)
        if rec is None or not st.store.file_path(file_id).exists():
            raise st.wire.not_found("file", file_id)
        path = st.store.file_path(file_id)
        size = path.stat().st_size
        return StreamingResponse(
            _results_body([path], size, _drops(request, st)),
            media_type="application/octet-stream",
            headers={
                "Content-Length": str(size),
                "Content-Disposition": _content_disposition(rec["filename"]),
            },
        )

    @r.delete("/files/{file_id}")
    async def delete(file_id: str, request: Request) -> dict[str, Any]:
        st = _state(request)
        if not st.store.delete_file(file_id):
            raise st.wire.not_found("file", file_id)
        return st.wire.render_deleted(file_id)


# ---- resumable uploads (Google's Files API) --------------------------------------------------
_UPLOAD_STATUS = "X-Goog-Upload-Status"


def _resumable_routes(r: APIRouter) -> None:
    """``POST {upload_prefix}/files``: a start opens a session; its URL takes ``upload``,
    ``finalize`` and ``query`` commands (the bytes at the offset the session holds)."""

    @r.post("/files", response_model=None)
    async def upload(request: Request) -> Response:
        st = _state(request)
        session = request.query_params.get("upload_id")
        if session is None:
            return await _upload_start(st, request)
        return await _upload_command(st, request, session)


async def _upload_start(st: ServerState, request: Request) -> Response:
    wire = st.wire
    headers = request.headers
    if (headers.get("x-goog-upload-protocol") or "").lower() != "resumable":
        raise wire.error(
            400, "The local batch server serves resumable uploads only (X-Goog-Upload-Protocol)."
        )
    if (headers.get("x-goog-upload-command") or "").lower() != "start":
        raise wire.error(400, "A resumable upload begins with X-Goog-Upload-Command: start.")
    length = headers.get("x-goog-upload-header-content-length") or ""
    if not length.isdigit():
        raise wire.error(400, "X-Goog-Upload-Header-Content-Length must give the file's size in bytes.")
    size = int(length)
    limit = st.config.limits().max_shard_bytes
    if size > limit:
        raise wire.upload_too_large(limit)
    raw = await _read_body(st, request, _MAX_FORM_FIELD)
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise wire.error(400, "Invalid JSON payload received.") from None
    meta = body.get("file") if isinstance(body, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    display = meta.get("displayName") or meta.get("display_name") or "upload.jsonl"
    _storage_room(st)
    session = os.urandom(16).hex()
    temp = st.store.temp_path(f"upload-{session}")
    temp.touch()
    st.uploads[session] = {
        "temp": temp,
        "size": size,
        "received": 0,
        "filename": str(display),
        "mime_type": headers.get("x-goog-upload-header-content-type") or "application/octet-stream",
        "file_id": None,
    }
    root = str(request.base_url).rstrip("/")
    url = f"{root}{wire.upload_prefix}/files?upload_id={session}&upload_protocol=resumable"
    return Response(b"", headers={"X-Goog-Upload-URL": url, _UPLOAD_STATUS: "active"})


async def _upload_command(st: ServerState, request: Request, session: str) -> Response:
    wire = st.wire
    up = st.uploads.get(session)
    if up is None:
        raise wire.error(404, f"No upload session {session[:12]}... (it ended or the server restarted).")
    commands = {c.strip().lower() for c in (request.headers.get("x-goog-upload-command") or "").split(",")}
    if "query" in commands:
        return _upload_answer(st, up)
    if not commands <= {"upload", "finalize"} or not commands:
        raise wire.error(400, f"Unknown X-Goog-Upload-Command {sorted(commands)}.")
    if up["file_id"] is not None:
        raise wire.error(400, "The upload is already finalized.")
    if "upload" in commands:
        offset = request.headers.get("x-goog-upload-offset") or ""
        if not offset.isdigit() or int(offset) != up["received"]:
            raise wire.error(
                400, f"X-Goog-Upload-Offset {offset!r} is not the {up['received']} bytes the session holds."
            )
        drop = request.state.fault == "drop" or (
            not request.state.fault and st.faults.fires("drop", st.faults.config.drop_rate)
        )
        # A dropped upload keeps the first half of what this command sent, then the connection dies.
        keep = (up["size"] - up["received"]) // 2 if drop else None
        written = 0
        with open(up["temp"], "ab") as out:  # noqa: ASYNC230 - local appends, as the multipart sink does
            async for chunk in request.stream():
                if keep is not None:
                    chunk = chunk[: max(keep - written, 0)]
                if up["received"] + written + len(chunk) > up["size"]:
                    raise wire.error(400, f"The upload sends more than the {up['size']:,} bytes it declared.")
                if not st.store.reserve(len(chunk)):
                    raise _storage_full(st)
                out.write(chunk)
                written += len(chunk)
                if keep is not None and written >= keep:
                    break
        up["received"] += written
        if drop:
            st.faults.count("drop")

            async def dropped() -> AsyncIterator[bytes]:
                raise ConnectionAbortedError("injected dropped connection")
                yield b""  # pragma: no cover - makes this an async generator

            return StreamingResponse(dropped(), headers={_UPLOAD_STATUS: "active"})
    if "finalize" in commands:
        if up["received"] != up["size"]:
            raise wire.error(
                400,
                f"Cannot finalize: {up['received']:,} of the {up['size']:,} declared bytes were received.",
            )
        file_id = st.store.new_id("file-")
        os.replace(up["temp"], st.store.file_path(file_id))
        st.store.add_file(
            {
                "id": file_id,
                "bytes": up["size"],
                "created_at": now(),
                "filename": up["filename"],
                "purpose": "batch",
                "mime_type": up["mime_type"],
            }
        )
        up["file_id"] = file_id
        st.faults.count("files_uploaded")
    return _upload_answer(st, up)


def _upload_answer(st: ServerState, up: dict[str, Any]) -> Response:
    """The session's state: active with the bytes received, or final with the file."""
    if up["file_id"] is not None:
        rec = st.store.get_file(up["file_id"])
        if rec is None:
            raise st.wire.not_found("file", up["file_id"])
        return ORJSON({"file": st.wire.render_file(rec)}, headers={_UPLOAD_STATUS: "final"})
    return Response(
        b"", headers={_UPLOAD_STATUS: "active", "X-Goog-Upload-Size-Received": str(up["received"])}
    )


# ---- batches ---------------------------------------------------------------------------
def _batch_routes(r: APIRouter) -> None:
    @r.post("/batches")
    async def create(request: Request) -> dict[str, Any]:
        return await _create(_own(request, "batches"), request)

    @r.post("/batch/jobs")
    async def create_job(request: Request) -> dict[str, Any]:
        return await _create(_own(request, "batch/jobs"), request)

    @r.post("/models/{model_action}")
    async def create_for_model(model_action: str, request: Request) -> dict[str, Any]:
        # Google's custom methods: POST models/{model}:batchGenerateContent (or
        # :asyncBatchEmbedContent), the model on the path, the endpoint named by the method.
        st = _state(request)
        model, _, action = model_action.rpartition(":")
        endpoint = st.wire.model_methods.get(action)
        if not st.wire.model_batches or endpoint is None or not model:
            raise st.wire.error(404, f"Unknown path {request.url.path}.", code="not_found")
        return await _create(st, request, model=f"models/{model}", endpoint=endpoint)

    async def _create(
        st: ServerState, request: Request, model: str | None = None, endpoint: str | None = None
    ) -> dict[str, Any]:
        wire = st.wire
        try:
            body = orjson.loads(await _read_body(st, request, _MAX_FORM_FIELD))
        except orjson.JSONDecodeError:
            raise wire.error(400, "Request body is not valid JSON.") from None
        created = wire.parse_create(body)
        if model is not None:
            created["model"] = model
        if endpoint is not None:
            created["endpoint"] = endpoint
        _storage_room(st)  # a batch writes output files: refused up front when storage is full
        file_rec = st.store.get_file(created["input_file_id"])
        if file_rec is None:
            raise wire.not_found("file", created["input_file_id"])
        if wire.upload_requires_purpose and file_rec.get("purpose") != "batch":
            raise wire.error(
                400,
                f"File {file_rec['id']} has purpose {file_rec.get('purpose')!r}; "
                "a batch input needs purpose 'batch'.",
                param="input_file_id",
            )
        forced = request.state.fault
        if forced == "token_limit":
            st.faults.count("token_limit")
            raise wire.token_limit_exceeded()
        flags = _fault_flags(st, forced, ("fail_validation", "token_limit_failed"))
        if forced == "token_limit_failed":
            flags["fail_code"] = "token_limit_exceeded"
        if st.config.max_enqueued_tokens is None:
            return await _start_batch(st, created, flags)
        counted = await asyncio.to_thread(_enqueue_size, st, file_rec["id"], created)
        async with st.queue_lock:
            return await _start_batch(st, created, flags, counted)

    @r.get("/batches")
    async def list_batches(request: Request) -> dict[str, Any]:
        st = _own(request, "batches")
        after, limit = st.wire.list_page_args(request.query_params)
        items, more = st.store.list_batches(after=after, limit=limit)
        # Live batches are fresher in memory than in the last checkpoint.
        items = [st.engine.active.get(i["id"], i) for i in items]
        return st.wire.render_batch_list(items, more)

    @r.get("/batch/jobs")
    async def list_jobs(request: Request) -> dict[str, Any]:
        st = _own(request, "batch/jobs")
        query = st.wire.list_query(request.query_params, request.query_params.multi_items())
        return await asyncio.to_thread(_job_page, st, query)

    @r.get("/batch/jobs/{batch_id}")
    async def get_job(batch_id: str, request: Request) -> dict[str, Any]:
        st = _own(request, "batch/jobs")
        return st.wire.render_batch(_batch(st, batch_id))

    @r.post("/batch/jobs/{batch_id}/cancel")
    async def cancel_job(batch_id: str, request: Request) -> dict[str, Any]:
        return _cancel(_own(request, "batch/jobs"), batch_id)

    @r.get("/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        st = _own(request, "batches")
        return st.wire.render_batch(_batch(st, batch_id))

    @r.post("/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict[str, Any]:
        st = _own(request, "batches")
        if not st.wire.is_cancel_path("cancel"):
            raise st.wire.error(
                404, f"Unknown path; cancel with POST /v1/batches/{batch_id}:cancel.", code="not_found"
            )
        return _cancel(st, batch_id)

    @r.post("/batches/{batch_ref}")
    async def colon_action(batch_ref: str, request: Request) -> dict[str, Any]:
        st = _own(request, "batches")
        batch_id, _, action = batch_ref.rpartition(":")
        if action != "cancel" or st.wire.is_cancel_path("cancel") or not batch_id:
            raise st.wire.error(404, f"Unknown path /v1/batches/{batch_ref}.", code="not_found")
        return _cancel(st, batch_id)

    @r.get("/batches/{batch_id}/results")
    async def results(batch_id: str, request: Request) -> Response:
        st = _own(request, "batches")
        wire = st.wire
        if not wire.results_endpoint:
            raise wire.error(
                404, "This API has no results endpoint; download output_file_id.", code="not_found"
            )
        rec = _batch(st, batch_id)
        q = request.query_params
        limit = wire.results_limit(q.get("limit"))
        try:
            skip = int(q.get("skip") or 0)
        except ValueError:
            raise wire.error(400, "skip must be an integer.") from None
        if skip < 0:
            raise wire.error(400, "skip must be >= 0.", param="skip")
        if wire.name == "xai":
            try:
                page = await asyncio.to_thread(xai_page, st.store, rec, q.get("pagination_token"), limit)
            except ValueError as exc:
                raise wire.error(400, str(exc), param="pagination_token") from None
            if _drops(request, st):
                return _dropped_page(orjson.dumps(page), "application/json", {})
            return ORJSON(page)
        try:
            data = await asyncio.to_thread(st.dw_results.page, rec, skip, limit)
        except FileNotFoundError:
            raise wire.error(
                404,
                f"The input file {rec['input_file_id']} of batch {batch_id} was deleted, so its results "
                "cannot be paired with their requests; download output_file_id and error_file_id instead.",
                code="not_found",
                param="input_file_id",
            ) from None
        headers = wire.results_headers(rec, skip, data.count(b"\n"))
        if _drops(request, st):
            return _dropped_page(data, "application/x-ndjson", headers)
        return Response(data, media_type="application/x-ndjson", headers=headers)


def _prediction_job_routes(r: APIRouter) -> None:
    """Vertex AI's batch prediction jobs: the input read from Cloud Storage at create, the
    predictions written there once the job has ended (see ``server/vertex.py``)."""
    jobs = "/projects/{project}/locations/{location}/batchPredictionJobs"

    def own(request: Request) -> tuple[ServerState, VertexWire]:
        st = _own(request, "batchPredictionJobs")
        assert isinstance(st.wire, VertexWire)
        return st, st.wire

    async def exported(st: ServerState, rec: dict[str, Any]) -> dict[str, Any]:
        # An ended job's predictions are written to its output prefix once, when first read.
        job = rec["vertex"]
        if job.get("format") == "bigquery":
            return await exported_table(st, rec)
        if rec["status"] in TERMINAL and not job.get("output_dir") and rec.get("output_file_id"):
            endpoint = st.config.gcs_endpoint_url
            if endpoint is None:
                raise not_ready(st.wire)  # type: ignore[arg-type]
            folder = output_dir(rec)
            source = st.store.file_path(rec["output_file_id"])
            await asyncio.to_thread(upload, endpoint, f"{folder}/predictions.jsonl", source)
            job["output_dir"] = folder
            st.engine.save(rec)
        return rec

    async def exported_table(st: ServerState, rec: dict[str, Any]) -> dict[str, Any]:
        # The output table is written once, when the ended job is first read (a failed job
        # that answered nothing writes none).
        job = rec["vertex"]
        if rec["status"] not in TERMINAL or job.get("output_table") or rec["status"] == "failed":
            return rec
        endpoint = st.config.bigquery_endpoint_url
        if endpoint is None:
            raise not_ready(st.wire, bigquery=True)  # type: ignore[arg-type]
        output = st.store.file_path(rec["output_file_id"]) if rec.get("output_file_id") else None
        source = st.store.file_path(rec["input_file_id"])
        columns = source.with_name(source.name + COLUMNS_SUFFIX)
        processed = _iso_time(rec.get("completed_at") or rec.get("cancelled_at") or rec.get("expired_at"))
        dataset, table = await asyncio.to_thread(
            write_output_table, endpoint, rec, columns, output, processed
        )
        job.update(output_dataset=dataset, output_table=table)
        st.engine.save(rec)
        return rec

    async def read_table(st: ServerState, wire: VertexWire, job: dict[str, Any], path: Path) -> None:
        endpoint = st.config.bigquery_endpoint_url
        if endpoint is None:
            raise not_ready(wire, bigquery=True)
        columns = path.with_name(path.name + COLUMNS_SUFFIX)
        try:
            job["schema"] = await asyncio.to_thread(read_input_table, endpoint, job["input"], path, columns)
        except FileNotFoundError:
            raise wire.error(404, f"Table {job['input']} was not found.") from None
        except ValueError as exc:
            raise wire.error(400, str(exc)) from None

    @r.post(jobs)
    async def create(project: str, location: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        try:
            body = orjson.loads(await _read_body(st, request, _MAX_FORM_FIELD))
        except orjson.JSONDecodeError:
            raise wire.error(400, "Invalid JSON payload received.") from None
        created = wire.parse_job(body)
        job = created.pop("vertex")
        job.update(project=project, location=location)
        _storage_room(st)
        file_id = st.store.new_id("file-")
        path = st.store.file_path(file_id)
        if job.get("format") == "bigquery":
            await read_table(st, wire, job, path)
            rec = _start_job(st, request, created, vertex_job_id(), path, "input.jsonl", vertex=job)
            return wire.render_batch(rec)
        endpoint = st.config.gcs_endpoint_url
        if endpoint is None:
            raise not_ready(wire)
        try:
            await asyncio.to_thread(download, endpoint, job["input"], path)
        except FileNotFoundError:
            raise wire.error(400, f"No object was found at {job['input']}.") from None
        except httpx.HTTPError as exc:
            raise wire.error(400, f"Cannot read {job['input']}: {type(exc).__name__}.") from None
        rec = _start_job(st, request, created, vertex_job_id(), path, "input.jsonl", vertex=job)
        return wire.render_batch(rec)

    @r.get(jobs)
    async def list_jobs(project: str, location: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        query = request.query_params
        wanted = wire.parse_filter(query.get("filter"))
        after, size = decode_token(wire, query.get("pageToken")), wire.list_page_args(query)[1]
        items, _ = await asyncio.to_thread(st.store.list_batches, after=None, limit=1 << 30)
        items = [st.engine.active.get(i["id"], i) for i in items if job_labels_match(i, wanted)]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = [await exported(st, i) for i in items[:size]]
        token = encode_token(page[-1]["id"]) if len(items) > size and page else None
        return wire.render_job_page(page, token)

    @r.get(jobs + "/{job_id}")
    async def get_job(project: str, location: str, job_id: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        return wire.render_batch(await exported(st, _batch(st, job_id)))

    @r.post(jobs + "/{job_action}")
    async def cancel_job(project: str, location: str, job_action: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        job_id, _, action = job_action.rpartition(":")
        if action != "cancel" or not job_id:
            raise wire.error(404, f"Unknown path {request.url.path}.")
        rec = _batch(st, job_id)
        if rec["status"] in TERMINAL:
            raise wire.error(
                400,
                f"The job is in state {wire.status_of(rec)} and cannot be cancelled.",
                code="invalid_state",
            )
        st.engine.cancel(rec)
        return {}


def _iso_time(value: float | None) -> str:
    """An epoch time (else now) as ISO 8601 UTC text."""
    from datetime import datetime, timezone

    return datetime.fromtimestamp(value if value is not None else now(), tz=timezone.utc).isoformat()


def _start_job(
    st: ServerState,
    request: Request,
    created: dict[str, Any],
    job_id: str,
    path: Path,
    filename: str,
    **vendor: Any,
) -> dict[str, Any]:
    """Run a job whose input an object-store mode downloaded to ``path`` (a file of the store):
    its batch record (with the forced faults) and the vendor's own fields under its name."""
    st.store.add_file(
        {
            "id": path.name,
            "bytes": path.stat().st_size,
            "created_at": now(),
            "filename": filename,
            "purpose": "batch",
        }
    )
    created["input_file_id"] = path.name
    flags = _fault_flags(st, request.state.fault, ("fail_validation",))
    rec = new_batch_record(
        job_id, created, st.wire.window_seconds(created["completion_window"]), st.config, flags
    )
    rec.update(vendor)
    st.engine.submit(rec)
    st.faults.count("batches_created")
    return rec


def _drops(request: Request, st: ServerState) -> bool:
    """Whether this results response is cut mid-body (fault ``drop``: header or ``drop_rate``)."""
    drop = request.state.fault == "drop" or (
        not request.state.fault and st.faults.fires("drop", st.faults.config.drop_rate)
    )
    if drop:
        st.faults.count("drop")
    return bool(drop)


async def _results_body(paths: list[Path], size: int, drop: bool) -> AsyncIterator[bytes]:
    """The files' bytes in 64 KiB chunks; with ``drop``, only the first half, then an abort."""
    sent = 0
    for path in paths:
        # Local-disk reads of 64 KiB are cheaper than a thread hop per chunk.
        with open(path, "rb") as fh:  # noqa: ASYNC230
            while chunk := fh.read(_DOWNLOAD_CHUNK):
                if drop and sent + len(chunk) > size // 2:
                    yield chunk[: max(size // 2 - sent, 0)]
                    # Raising mid-body makes uvicorn abort the connection: the client sees a
                    # truncated body, exactly like a dropped connection.
                    raise ConnectionAbortedError("injected dropped connection")
                sent += len(chunk)
                yield chunk


def _dropped_page(data: bytes, media_type: str, headers: Mapping[str, str]) -> StreamingResponse:
    """A results page whose connection drops halfway through its body."""

    async def body() -> AsyncIterator[bytes]:
        yield data[: len(data) // 2]
        raise ConnectionAbortedError("injected dropped connection")

    return StreamingResponse(
        body(), media_type=media_type, headers={**headers, "Content-Length": str(len(data))}
    )


# ---- Anthropic Message Batches ---------------------------------------------------------------
def _message_batch_routes(r: APIRouter) -> None:
    """``/v1/messages/batches``: the requests come inline in the create; one results stream."""

    def own(request: Request) -> tuple[ServerState, AnthropicWire]:
        st = _own(request, "messages/batches")
        assert isinstance(st.wire, AnthropicWire)
        return st, st.wire

    @r.post("/messages/batches")
    async def create(request: Request) -> dict[str, Any]:
        st, wire = own(request)
        limits = st.config.limits()
        raw = await _read_body(st, request, limits.max_file_bytes)
        try:
            body = await asyncio.to_thread(orjson.loads, raw)
        except orjson.JSONDecodeError:
            raise wire.error(400, "Request body is not valid JSON.") from None
        requests = wire.parse_requests(body, limits.max_lines)
        _storage_room(st)
        forced = request.state.fault
        cfg = st.faults.config
        flags = {
            "fail": forced == "fail_validation" or cfg.fail_validation,
            "expire": forced == "expire" or cfg.expire_batches,
            "stall": forced == "stall" or cfg.stall_batches,
        }
        if flags["fail"]:
            # Anthropic checks a batch when it is created: a bad one is a 400, never a batch.
            st.faults.count("batch_fail")
            raise wire.error(400, "requests: validation failed (fault injection)")
        for name in ("expire", "stall"):
            if flags[name]:
                st.faults.count(f"batch_{name}")
        file_id = st.store.new_id("file-")
        path = st.store.file_path(file_id)
        size = await asyncio.to_thread(_write_requests, path, requests)
        del body, requests, raw
        st.store.add_file(
            {
                "id": file_id,
                "bytes": size,
                "created_at": now(),
                "filename": "requests.jsonl",
                "purpose": "batch",
            }
        )
        created = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": None,
            "name": None,
        }
        rec = new_batch_record(
            st.store.new_id("msgbatch_"), created, wire.window_seconds("24h"), st.config, flags
        )
        lines, problems = await asyncio.to_thread(
            validate_file, path, st.engine.rules, rec["endpoint"], 1, partial(wire.canonical_line, rec=rec)
        )
        if problems:
            st.store.delete_file(file_id)
            problem = problems[0]
            where = f"requests.{int(problem['line']) - 1}: " if problem.get("line") else ""
            raise wire.error(400, f"{where}{problem['message']}")
        rec["request_counts"]["total"] = lines
        rec["status"] = "in_progress"
        rec["in_progress_at"] = now()
        st.engine.submit(rec)
        st.faults.count("batches_created")
        return _absolute(request, wire.render_batch(rec))

    @r.get("/messages/batches")
    async def list_batches(request: Request) -> dict[str, Any]:
        st, wire = own(request)
        limit, after, before = wire.list_window(request.query_params)

        def page() -> dict[str, Any]:
            items, _ = st.store.list_batches(after=None, limit=1 << 30)
            ids = [i["id"] for i in items]
            if after is not None or before is not None:
                anchor = after if after is not None else before
                if anchor not in ids:
                    raise wire.not_found("message batch", str(anchor))
                at = ids.index(anchor)
                start, end = (at + 1, at + 1 + limit) if after is not None else (max(at - limit, 0), at)
                more = end < len(items) if after is not None else start > 0
            else:
                start, end, more = 0, limit, len(items) > limit
            chosen = [st.engine.active.get(i["id"], i) for i in items[start:end]]
            listing = wire.render_batch_list(chosen, more)
            listing["data"] = [_absolute(request, b) for b in listing["data"]]
            return listing

        return await asyncio.to_thread(page)

    @r.get("/messages/batches/{batch_id}")
    async def get(batch_id: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        return _absolute(request, wire.render_batch(_batch(st, batch_id)))

    @r.post("/messages/batches/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request) -> dict[str, Any]:
        st, _ = own(request)
        return _absolute(request, _cancel(st, batch_id))

    @r.get("/messages/batches/{batch_id}/results")
    async def results(batch_id: str, request: Request) -> Response:
        st, wire = own(request)
        rec = _batch(st, batch_id)
        if wire.status_of(rec) != "ended":
            raise wire.error(
                400, f"Message Batch {batch_id} has not ended; its results are not available yet."
            )
        paths = [
            st.store.file_path(fid)
            for fid in (rec.get("output_file_id"), rec.get("error_file_id"))
            if fid and st.store.file_path(fid).exists()
        ]
        size = sum(p.stat().st_size for p in paths)
        return StreamingResponse(
            _results_body(paths, size, _drops(request, st)),
            media_type="application/binary",
            headers={"Content-Length": str(size)},
        )


def _invocation_job_routes(r: APIRouter) -> None:
    """Bedrock's model invocation jobs: the input read from S3 at create, the results written to
    S3 once the job has ended (see ``server/bedrock.py``)."""

    def own(request: Request) -> tuple[ServerState, BedrockWire]:
        st = _own(request, "model-invocation-jobs")
        assert isinstance(st.wire, BedrockWire)
        return st, st.wire

    @r.post("/model-invocation-job")
    async def create(request: Request) -> dict[str, Any]:
        st, wire = own(request)
        try:
            body = orjson.loads(await _read_body(st, request, _MAX_FORM_FIELD))
        except orjson.JSONDecodeError:
            raise wire.error(400, "The request body is not valid JSON.") from None
        created = wire.parse_create(body)
        job = created.pop("bedrock")
        if job["token"]:
            # The same clientRequestToken answers the job it first made (an idempotent retry).
            earlier = await asyncio.to_thread(_job_by_token, st, job["token"])
            if earlier is not None:
                return {"jobArn": wire.job_arn(earlier["id"])}
        # Job names are unique per account and region: another create under a used name is
        # refused (as Bedrock refuses a name in use), whatever its token.
        if await asyncio.to_thread(_jobs, st, created["name"], None, exact=True):
            raise wire.error(400, f"The provided job name {created['name']} is currently in use.")
        _storage_room(st)
        file_id = st.store.new_id("file-")
        path = st.store.file_path(file_id)
        try:
            job["input_name"] = await asyncio.to_thread(download_input, _s3(st), job["input"], path)
        except FileNotFoundError:
            raise wire.error(400, f"No JSONL input was found at {job['input']}.") from None
        except Exception as exc:
            # The job's role cannot read the input: Bedrock refuses the create.
            raise wire.error(400, f"Cannot read the input at {job['input']}: {type(exc).__name__}.") from None
        rec = _start_job(st, request, created, new_job_id(), path, job["input_name"], bedrock=job)
        return {"jobArn": wire.job_arn(rec["id"])}

    @r.get("/model-invocation-job/{job_id:path}")
    async def get(job_id: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        return await _job_item(st, wire, _batch(st, wire.job_id(job_id)))

    @r.get("/model-invocation-jobs")
    async def list_jobs(request: Request) -> dict[str, Any]:
        st, wire = own(request)
        token, limit = wire.list_page_args(request.query_params)
        query = request.query_params
        status, after, before, ascending = wire.list_filters(query)
        found = await asyncio.to_thread(
            _jobs, st, query.get("nameContains"), status, after=after, before=before
        )
        if ascending:
            found.reverse()
        ids = [rec["id"] for rec in found]
        start = ids.index(token) + 1 if token in ids else 0
        if token and token not in ids:
            raise wire.error(400, "The nextToken is not valid.")
        chosen = found[start : start + limit]
        page = wire.render_batch_list(chosen, start + limit < len(found))
        page["invocationJobSummaries"] = [await _job_item(st, wire, rec) for rec in chosen]
        return page

    @r.post("/model-invocation-job/{job_id:path}/stop")
    async def stop(job_id: str, request: Request) -> dict[str, Any]:
        st, wire = own(request)
        rec = _batch(st, wire.job_id(job_id))
        if rec["status"] in ("cancelling", "cancelled"):
            raise wire.error(400, f"The job is already {wire.status_of(rec)}; it cannot be stopped.")
        return _cancel(st, rec["id"])


def _fault_flags(st: ServerState, forced: str | None, fail_on: tuple[str, ...]) -> dict[str, Any]:
    """The batch faults a create sets (the request's forced fault, or the server's), counted."""
    cfg = st.faults.config
    flags: dict[str, Any] = {
        "fail": forced in fail_on or cfg.fail_validation,
        "expire": forced == "expire" or cfg.expire_batches,
        "stall": forced == "stall" or cfg.stall_batches,
    }
    for name, on in flags.items():
        if on:
            st.faults.count(f"batch_{name}")
    return flags


def _s3(st: ServerState) -> Any:
    return s3_client(st.config.s3_endpoint_url)


def _job_by_token(st: ServerState, token: str) -> dict[str, Any] | None:
    items, _ = st.store.list_batches(after=None, limit=1 << 30)
    for rec in items:
        if (rec.get("bedrock") or {}).get("token") == token:
            return st.engine.active.get(rec["id"], rec)
    return None


def _jobs(
    st: ServerState,
    name: str | None,
    status: str | None,
    *,
    exact: bool = False,
    after: datetime | None = None,
    before: datetime | None = None,
) -> list[dict[str, Any]]:
    """Jobs, newest first, whose name contains ``name`` (is ``name``, when ``exact``), whose
    status is ``status`` and which were submitted after ``after`` and before ``before`` (the
    instants the API shows), each when given."""
    items, _ = st.store.list_batches(after=None, limit=1 << 30)
    items = [st.engine.active.get(i["id"], i) for i in items]
    return [
        rec
        for rec in items
        if "bedrock" in rec
        and (not name or (name == rec.get("name") if exact else name in str(rec.get("name"))))
        and (not status or st.wire.status_of(rec) == status)
        and (after is None or submitted(rec["created_at"]) > after)
        and (before is None or submitted(rec["created_at"]) < before)
    ]


async def _job_item(st: ServerState, wire: BedrockWire, rec: dict[str, Any]) -> dict[str, Any]:
    """A job as Bedrock shows it; an ended one's results are first written to S3 (once)."""
    item = wire.render_batch(rec)
    job = rec.get("bedrock") or {}
    if rec["status"] in ("completed", "expired", "cancelled") and not job.get("exported"):
        output = st.store.file_path(rec["output_file_id"]) if rec.get("output_file_id") else None
        if output is not None and not output.exists():
            output = None
        await asyncio.to_thread(export_results, _s3(st), rec, output, item)
        job["exported"] = True
        st.store.save_batch(rec)
    return item


def _write_requests(path: Any, requests: list[Any]) -> int:
    """Store an inline create's requests as JSONL (one ``{custom_id, params}`` a line); its size."""
    size = 0
    with open(path, "wb") as out:
        for item in requests:
            data = orjson.dumps(item) + b"\n"
            out.write(data)
            size += len(data)
    return size


def _absolute(request: Request, batch: dict[str, Any]) -> dict[str, Any]:
    """A batch object whose ``results_url`` names the host the client called."""
    url = batch.get("results_url")
    if isinstance(url, str) and url.startswith("/"):
        batch["results_url"] = str(request.base_url).rstrip("/") + url
    return batch


def _own(request: Request, route: str) -> ServerState:
    """The server state, when ``route`` is this vendor's batch collection (else a 404 in its shape)."""
    st = _state(request)
    if st.wire.batches_route != route:
        raise st.wire.error(
            404,
            f"Unknown path {request.url.path}; batches are under /v1/{st.wire.batches_route}.",
            code="not_found",
        )
    return st


def _job_page(st: ServerState, query: dict[str, Any]) -> dict[str, Any]:
    """One page of a filtered listing and the count of every match (``total``), for a wire whose
    listing pages by number (``Wire.list_query``)."""
    wire = st.wire
    items, _ = st.store.list_batches(after=None, limit=1 << 30)
    # Live batches are fresher in memory than in the last checkpoint.
    items = [st.engine.active.get(i["id"], i) for i in items]
    wanted = query["metadata"].items()
    found = [
        rec
        for rec in items
        if wanted <= (rec.get("metadata") or {}).items()
        and (not query["statuses"] or wire.status_of(rec) in query["statuses"])
        and (query["model"] is None or rec.get("model") == query["model"])
    ]
    if query["oldest_first"]:
        found.reverse()
    start = query["page"] * query["page_size"]
    return wire.render_job_list(found[start : start + query["page_size"]], len(found))


def _batch(st: ServerState, batch_id: str) -> dict[str, Any]:
    rec = st.engine.get(batch_id)
    if rec is None:
        raise st.wire.not_found("batch", batch_id)
    return rec


def _cancel(st: ServerState, batch_id: str) -> dict[str, Any]:
    rec = _batch(st, batch_id)
    if rec["status"] in ("completed", "failed", "expired"):
        raise st.wire.error(
            st.wire.cancel_final_status,
            f"Cannot cancel a batch with status {st.wire.status_of(rec)!r}.",
            code="invalid_state",
            param="batch_id",
        )
    # A finalizing batch has every answer it will get and ends as it is: cancel leaves it alone
    # and says so by answering its real status rather than a "cancelling" it would never honour.
    st.engine.cancel(rec)
    return st.wire.render_cancelled(rec)


def _enqueue_size(st: ServerState, file_id: str, created: Mapping[str, Any]) -> tuple[int, str]:
    """The input tokens of a new batch's file and the model it is enqueued under."""
    canonical = partial(st.wire.canonical_line, rec=created) if st.wire.vendor_lines else None
    return count_file(st.store.file_path(file_id), st.config.dialect, created.get("model"), canonical)


def _admit(st: ServerState, flags: dict[str, Any], counted: tuple[int, str]) -> dict[str, Any]:
    """Judge a new batch against ``max_enqueued_tokens``: the record fields it starts with.

    Over the limit it is refused here (form ``refuse``) or flagged to fail in validation with
    ``token_limit_exceeded`` (form ``fail``), holding no tokens either way; within it, the total
    admitted for its model is recorded as the peak when it is the highest yet.
    """
    limit = st.config.max_enqueued_tokens
    assert limit is not None
    tokens, model = counted
    held = enqueued(st.engine.active.values(), model)
    if flags["fail"] or held + tokens <= limit:
        if not flags["fail"]:
            peak = st.faults.counters["enqueued_tokens_peak"]
            st.faults.counters["enqueued_tokens_peak"] = max(peak, held + tokens)
        return {"enqueued_tokens": 0 if flags["fail"] else tokens, "queue_model": model}
    message = over_limit_message(model, limit, held, tokens)
    if st.config.limit_form() == "refuse":
        st.faults.count("enqueued_limit_refused")
        raise st.wire.enqueued_limit_refused(message)
    st.faults.count("enqueued_limit_failed")
    flags.update(fail=True, fail_code="token_limit_exceeded", fail_message=message)
    return {"enqueued_tokens": 0, "queue_model": model}


async def _start_batch(
    st: ServerState,
    created: dict[str, Any],
    flags: dict[str, Any],
    counted: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """Record a new batch (judged against the enqueued-token limit when ``counted``) and run it."""
    wire = st.wire
    queue = _admit(st, flags, counted) if counted is not None else {}
    rec = new_batch_record(
        st.store.new_id("batch_", wire.id_style),
        created,
        wire.window_seconds(created["completion_window"]),
        st.config,
        flags,
    )
    rec.update(queue)
    if wire.sync_validation:
        await _validate_now(st, rec, flags["fail"])
    st.engine.submit(rec)
    st.faults.count("batches_created")
    return wire.render_batch(rec)


async def _validate_now(st: ServerState, rec: dict[str, Any], force_fail: bool) -> None:
    """Synchronous validation at create time (ZeroGPU): a bad file is a 400 naming the line."""
    if force_fail:
        raise st.wire.validation_error(
            {
                "code": "invalid_request_error",
                "line": None,
                "message": "validation failed (fault injection)",
                "param": None,
            }
        )
    lines, problems = await asyncio.to_thread(
        validate_file, st.store.file_path(rec["input_file_id"]), st.engine.rules, rec["endpoint"], 1
    )
    if problems:
        raise st.wire.validation_error(problems[0])
    rec["request_counts"]["total"] = lines
    rec["status"] = "in_progress"
    rec["in_progress_at"] = now()


# ---- synchronous inference -----------------------------------------------------------
def _inference_routes(r: APIRouter) -> None:
    async def serve(request: Request, url: str) -> Response:
        st = _state(request)
        raw = await _read_body(st, request, st.config.limits().max_line_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise st.wire.error(400, "Request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise st.wire.error(400, "Request body must be a JSON object.")
        if body.get("stream") is True:
            raise st.wire.error(
                400, "stream=true is not supported by the local batch server.", param="stream"
            )
        status, answer = await st.backend.call(url, body)
        st.faults.count("inference_calls")
        # An answer can be megabytes of JSON (embeddings): serialised off the event loop too.
        content = await asyncio.to_thread(orjson.dumps, answer)
        return Response(content, status_code=status, media_type="application/json")

    for path in ("/chat/completions", "/embeddings", "/completions", "/responses", "/moderations"):
        r.add_api_route(path, _bind(serve, "/v1" + path), methods=["POST"])


def _bind(serve: Any, url: str) -> Any:
    async def endpoint(request: Request) -> Response:
        response: Response = await serve(request, url)
        return response

    return endpoint


# ---- admin -------------------------------------------------------------------------------
async def _admin_guard(request: Request) -> None:
    """The API key (when one is set) guards /admin too; changes must come as JSON.

    Requiring ``application/json`` on POST keeps a web page from reconfiguring the server
    with a "simple" cross-site request (``text/plain`` or a form needs no CORS preflight).
    """
    st = _state(request)
    st.wire.check_key(request.headers, st.config.api_key)
    if request.method == "POST":
        ctype, _ = parse_options_header(request.headers.get("content-type", ""))
        if ctype != b"application/json":
            raise st.wire.error(
                415,
                f"/admin accepts only Content-Type application/json, not {ctype.decode('latin-1')!r}.",
                code="unsupported_media_type",
            )


def _admin_router() -> APIRouter:
    r = APIRouter(prefix="/admin", dependencies=[Depends(_admin_guard)])

    @r.get("/faults")
    async def get_faults(request: Request) -> dict[str, Any]:
        return _state(request).faults.config.model_dump()

    @r.post("/faults")
    async def set_faults(request: Request) -> Response:
        st = _state(request)
        try:
            changes = orjson.loads(await _read_body(st, request, _MAX_FORM_FIELD) or b"{}")
            if not isinstance(changes, dict):
                raise TypeError("the body must be a JSON object of fault settings")
            config = st.faults.update(changes)
        except (orjson.JSONDecodeError, ValueError, TypeError) as exc:
            return ORJSON({"error": {"message": f"bad fault settings: {exc}"}}, status_code=400)
        return ORJSON(config.model_dump())

    @r.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        st = _state(request)
        out = st.faults.stats()
        out["active_batches"] = len(st.engine.active)
        # Bytes held or reserved under the data dir, the most ever held since start, and the cap.
        out["storage"] = {
            "used_bytes": st.store.used,
            "peak_bytes": st.store.peak_used,
            "max_bytes": st.store.max_bytes,
        }
        return out

    @r.post("/batches/{batch_id}/force")
    async def force(batch_id: str, request: Request) -> Response:
        st = _state(request)
        rec = st.engine.get(batch_id)
        if rec is None:
            return ORJSON({"error": {"message": f"no batch {batch_id}"}}, status_code=404)
        try:
            action = orjson.loads(await _read_body(st, request, _MAX_FORM_FIELD) or b"{}").get("action")
        except (orjson.JSONDecodeError, AttributeError):
            action = None
        if rec["status"] in TERMINAL:
            return ORJSON(
                {"error": {"message": f"batch {batch_id} is already {rec['status']}"}}, status_code=409
            )
        try:
            st.engine.force(rec, str(action))
        except ValueError as exc:
            return ORJSON({"error": {"message": str(exc)}}, status_code=400)
        return ORJSON({"id": batch_id, "status": rec["status"], "flags": rec["flags"]})

    return r
