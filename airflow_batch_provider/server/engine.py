"""The batch lifecycle runner: one asyncio task per live batch, resumable after a restart.

validating -> in_progress -> finalizing -> completed, or failed (validation), expired
(window passed), cancelling -> cancelled. Progress (input offset, output/error bytes,
counts) is checkpointed after every chunk, so a restarted server truncates the work
files to the checkpoint and carries on from the next unanswered line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import IO, Any

import orjson

from airflow_batch_provider.jsonl import LineValidator, Problem, RawLine, iter_raw_lines
from airflow_batch_provider.limits import ValidationRules
from airflow_batch_provider.server.backends import EchoBackend, UpstreamBackend, error_body
from airflow_batch_provider.server.config import ServerConfig
from airflow_batch_provider.server.faults import Faults
from airflow_batch_provider.server.store import Store, now
from airflow_batch_provider.server.wire import Wire

log = logging.getLogger(__name__)

# Messages of injected batch failures with a vendor's code (the X-Batch-Fault "token_limit_failed").
FAIL_MESSAGES = {
    "token_limit_exceeded": "The number of enqueued tokens has surpassed the configured limit for "
    "this deployment (fault injection). Please either increase the limit or try again once the "
    "current jobs have finished.",
}

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
_POLL = 0.05  # real seconds between checks of a stalled batch
# Test hook: a process whose environment names a publishing step here dies (os._exit) right
# after that step, the way a killed server would; tests restart it and check the recovery.
# ``<step>:raise`` instead stops the batch's task there with ``SimulatedCrash`` (in-process tests).
CRASH_ENV = "AIRFLOW_BATCH_SERVER_CRASH_AT"
CRASH_STEPS = (
    *(
        f"publish_{kind}_{step}"
        for kind in ("output", "error")
        for step in ("named", "truncated", "moved", "recorded", "saved")
    ),
    "published",
)


class _StorageFull(Exception):
    """A result line did not fit under ``max_storage_bytes`` (``_process`` fails the batch).

    :param line: the input line whose result did not fit.
    """

    def __init__(self, line: int) -> None:
        super().__init__(f"storage full at input line {line}")
        self.line = line


class SimulatedCrash(BaseException):
    """Raised at a crash point named with ``:raise``; no handler of the engine catches it."""


def _crash_point(step: str) -> None:
    wanted = os.environ.get(CRASH_ENV)
    if wanted == step:
        log.error("crashing at %s (%s is set)", step, CRASH_ENV)
        os._exit(86)
    if wanted == f"{step}:raise":
        raise SimulatedCrash(step)


def validate_file(
    path: Path,
    rules: ValidationRules,
    expected_url: str | None,
    max_errors: int,
    canonical: Callable[[Any], Any] | None = None,
) -> tuple[int, list[dict[str, Any]]]:
    """Run the shared validator over a stored file: (line count, first ``max_errors`` problems).

    :param canonical: for a vendor whose lines have their own shape, turns one parsed line into
        the canonical line the validator checks (raises ``ValueError`` saying what is wrong).
    """
    validator = LineValidator(rules, expected_url)
    problems: list[dict[str, Any]] = []

    def keep(found: list[Problem]) -> None:
        for problem in found:
            if len(problems) < max_errors:
                problems.append(problem.as_error())

    with open(path, "rb") as stream:
        for raw in iter_raw_lines(stream, rules.limits.max_line_bytes):
            if canonical is not None and raw.data.strip() and not raw.oversize:
                try:
                    raw = _canonical_raw(raw, canonical)
                except ValueError as exc:
                    validator.lines += 1
                    keep([Problem(raw.number, "invalid_line", str(exc))])
                    continue
            keep(validator.check_raw(raw)[1])
    keep(validator.finish())
    return validator.lines, problems


def _canonical_raw(raw: RawLine, canonical: Callable[[Any], Any]) -> RawLine:
    """The raw line re-written in canonical form (its size stays the uploaded line's)."""
    try:
        obj = orjson.loads(raw.data)
    except orjson.JSONDecodeError:
        return raw  # the validator says what is wrong with it
    return dataclasses.replace(raw, data=orjson.dumps(canonical(obj)))


def new_batch_record(
    batch_id: str,
    created: dict[str, Any],
    window_seconds: float,
    config: ServerConfig,
    flags: dict[str, bool],
) -> dict[str, Any]:
    t = now()
    return {
        "id": batch_id,
        "endpoint": created["endpoint"],
        "input_file_id": created["input_file_id"],
        "completion_window": created["completion_window"],
        "metadata": created["metadata"],
        "name": created["name"],
        "model": created.get("model"),
        "status": "validating",
        "errors": None,
        "cancel_message": None,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": t,
        "in_progress_at": None,
        "expires_at": t + config.scaled(window_seconds),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "progress": {"offset": 0, "line": 0, "out": 0, "err": 0, "expired": 0, "cancelled": 0, "stop": None},
        "flags": {"fail": False, "stall": False, "expire": False, "complete": False, **flags},
    }


class Engine:
    """Runs every live batch of a server.

    :param store: durable state.
    :param config: server settings (time scale, chunk size, limits).
    :param faults: live fault settings (line failures).
    :param backend: what answers each line.
    :param wire: the vendor's result line shapes.
    """

    def __init__(
        self,
        store: Store,
        config: ServerConfig,
        faults: Faults,
        backend: EchoBackend | UpstreamBackend,
        wire: Wire,
    ) -> None:
        self.store = store
        self.config = config
        self.faults = faults
        self.backend = backend
        self.wire = wire
        # The file rules a vendor checks before it runs anything. Not the client-side body checks
        # (a model on every line, the fields an endpoint needs): an upstream such as vLLM may
        # serve a default model, and a body it cannot take fails that line, as at a vendor.
        self.rules = dataclasses.replace(
            wire.dialect.validation_rules(config.limits()), model_endpoints=frozenset(), required_fields={}
        )
        self.active: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}

    # ---- control ------------------------------------------------------------------
    def resume_all(self) -> int:
        """Restart the task of every batch left live by a previous run.

        Leftovers of a crash go first: partial uploads (``.part``), work files of batches
        that are no longer live, and stored files no record points to (a file published
        by a batch that has not recorded it yet is kept: its batch finishes publishing).
        """
        live = list(self.store.active_batches())
        pending = {fid for rec in live for fid in rec["progress"].get("publish", {}).values()}
        removed = self.store.sweep({rec["id"] for rec in live}, pending)
        if removed:
            log.info("removed %d files left by an earlier run", removed)
        for rec in live:
            self._spawn(rec)
        return len(live)

    async def stop(self) -> None:
        tasks = [task for task in self._tasks.values() if not task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def submit(self, rec: dict[str, Any]) -> None:
        self.store.add_batch(rec)
        self._spawn(rec)

    def get(self, batch_id: str) -> dict[str, Any] | None:
        return self.active.get(batch_id) or self.store.get_batch(batch_id)

    def save(self, rec: dict[str, Any]) -> None:
        self.store.save_batch(rec)

    def cancel(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Cancel a batch still validating or running; a finalizing batch has answered every
        line it will answer and ends as it is (completed, or expired), so it is left alone."""
        if rec["status"] in ("validating", "in_progress"):
            rec["status"] = "cancelling"
            rec["cancelling_at"] = now()
            self.save(rec)
            self._poke(rec["id"])
        return rec

    def force(self, rec: dict[str, Any], action: str) -> dict[str, Any]:
        """Admin override: expire | fail | stall | resume | complete."""
        flags = rec["flags"]
        if action == "expire":
            flags["expire"] = True
        elif action == "fail":
            flags["fail"] = True
        elif action == "stall":
            flags["stall"] = True
        elif action == "resume":
            flags["stall"] = False
        elif action == "complete":
            flags["complete"] = True
            flags["stall"] = False
        else:
            raise ValueError(f"unknown action {action!r}; use expire, fail, stall, resume or complete")
        if action == "fail" and rec["status"] not in TERMINAL and rec["status"] != "validating":
            self._fail(
                rec,
                [
                    {
                        "code": "forced_failure",
                        "line": None,
                        "message": "batch failed (forced by admin)",
                        "param": None,
                    }
                ],
            )
        self.save(rec)
        self._poke(rec["id"])
        return rec

    def _poke(self, batch_id: str) -> None:
        event = self._wake.get(batch_id)
        if event is not None:
            event.set()

    def _spawn(self, rec: dict[str, Any]) -> None:
        self.active[rec["id"]] = rec
        self._wake[rec["id"]] = asyncio.Event()
        self._tasks[rec["id"]] = asyncio.get_running_loop().create_task(
            self._run(rec), name=f"batch-{rec['id']}"
        )

    async def _sleep(self, rec: dict[str, Any], seconds: float) -> None:
        """Wait, but wake early when the batch is cancelled or forced."""
        if seconds <= 0 or rec["flags"]["complete"]:
            await asyncio.sleep(0)
            return
        event = self._wake[rec["id"]]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)
        event.clear()

    # ---- lifecycle ------------------------------------------------------------------
    async def _run(self, rec: dict[str, Any]) -> None:
        batch_id = rec["id"]
        try:
            while rec["status"] not in TERMINAL:
                status = rec["status"]
                if status == "validating":
                    await self._validate(rec)
                elif status in ("in_progress", "cancelling") and rec["progress"]["stop"] is None:
                    await self._process(rec)
                else:
                    await self._finalize(rec)
        except asyncio.CancelledError:
            raise
        except SimulatedCrash:
            self.faults.count("simulated_crashes")  # seen in /admin/stats by the crash tests
            raise
        except Exception as exc:  # a bug must fail the batch visibly, not leave it hanging
            log.exception("batch %s crashed", batch_id)
            self._fail(
                rec,
                [
                    {
                        "code": "server_error",
                        "line": None,
                        "message": f"internal error: {type(exc).__name__}",
                        "param": None,
                    }
                ],
            )
        finally:
            if rec["status"] == "failed":
                # A failed batch publishes nothing: its work files would only hold storage.
                self.store.discard_work(batch_id)
            if rec["status"] in TERMINAL:
                self.active.pop(batch_id, None)
                self._tasks.pop(batch_id, None)
                self._wake.pop(batch_id, None)

    def _fail(self, rec: dict[str, Any], errors: list[dict[str, Any]]) -> None:
        rec["status"] = "failed"
        rec["failed_at"] = now()
        rec["errors"] = errors
        # xAI cancels a batch whose file does not validate, and says why.
        first = errors[0] if errors else {}
        where = f"line {first['line']}: " if first.get("line") else ""
        rec["cancel_message"] = f"{where}{first.get('message', 'invalid input file')}"
        self.save(rec)

    async def _validate(self, rec: dict[str, Any]) -> None:
        await self._sleep(rec, self.config.scaled(self.config.validate_seconds))
        if rec["status"] == "cancelling":
            self._finish(rec, "cancelled")
            return
        if rec["flags"]["fail"]:
            code = rec["flags"].get("fail_code") or "forced_failure"
            message = rec["flags"].get("fail_message") or FAIL_MESSAGES.get(
                code, "validation failed (fault injection)"
            )
            self._fail(rec, [{"code": code, "line": None, "message": message, "param": None}])
            return
        path = self.store.file_path(rec["input_file_id"])
        if not path.exists():
            self._fail(
                rec,
                [
                    {
                        "code": "file_not_found",
                        "line": None,
                        "message": f"input file {rec['input_file_id']} no longer exists",
                        "param": "input_file_id",
                    }
                ],
            )
            return
        canonical = partial(self.wire.canonical_line, rec=rec) if self.wire.vendor_lines else None
        lines, problems = await asyncio.to_thread(
            validate_file, path, self.rules, rec["endpoint"], self.config.max_reported_errors, canonical
        )
        if rec["status"] == "cancelling":
            self._finish(rec, "cancelled")
            return
        if problems:
            self._fail(rec, problems)
            return
        rec["request_counts"]["total"] = lines
        rec["status"] = "in_progress"
        rec["in_progress_at"] = now()
        self.save(rec)

    async def _process(self, rec: dict[str, Any]) -> None:
        progress = rec["progress"]
        try:
            stop = await self._run_lines(rec)
        except _StorageFull as full:
            # As a vendor fails a batch it cannot finish: failed, with the reason in ``errors``.
            # Its partial results are dropped (``_run`` removes the work files), freeing the space.
            self._fail(rec, [self._storage_error(full.line)])
            stop = "failed"
        progress["stop"] = stop
        if stop == "failed":
            self.save(rec)
            return
        if stop == "expired":
            rec["expires_at"] = min(rec["expires_at"], now())
        rec["status"] = "cancelling" if stop == "cancelled" else "finalizing"
        if stop != "cancelled":
            rec["finalizing_at"] = now()
        self.save(rec)

    def _storage_error(self, line: int) -> dict[str, Any]:
        """The ``errors`` entry of a batch whose results did not fit under ``max_storage_bytes``."""
        return {
            "code": "insufficient_storage",
            "line": None,
            "message": (
                "The batch's results would pass the server's storage limit of "
                f"{self.config.max_storage_bytes or 0:,} bytes (reached at input line {line}); its "
                "partial results were discarded. Delete files to make room and submit it again."
            ),
            "param": None,
        }

    async def _run_lines(self, rec: dict[str, Any]) -> str | None:
        """Answer lines from the checkpoint on until done or stopped; returns why it stopped.

        :raises _StorageFull: when a result line does not fit under the storage cap.
        """
        progress = rec["progress"]
        batch_id = rec["id"]
        echo = isinstance(self.backend, EchoBackend)
        with (
            _open_at(self.store, self.store.work_path(batch_id, "output"), progress["out"]) as out,
            _open_at(self.store, self.store.work_path(batch_id, "error"), progress["err"]) as err,
            # Local-disk line reads are short; a thread hop per chunk would cost more.
            open(self.store.file_path(rec["input_file_id"]), "rb") as src,  # noqa: ASYNC230
        ):
            src.seek(progress["offset"])
            stop: str | None = None
            while stop is None:
                stop = self._stop_reason(rec)
                if stop is not None:
                    break
                if rec["flags"]["stall"]:
                    await self._sleep(rec, _POLL)
                    continue
                if echo:
                    # The echo model is CPU work: a whole chunk (read, answer, write) runs in a
                    # worker thread so the event loop keeps serving requests meanwhile.
                    assert isinstance(self.backend, EchoBackend)
                    lines = await self.backend.run(self._echo_chunk, rec, src, out, err)
                else:
                    chunk = _read_chunk(src, progress, self.config.chunk_size)
                    if chunk:
                        self._write_answers(rec, await self._answer(rec, chunk), out, err)
                    lines = len(chunk)
                if not lines:
                    stop = "done"
                    break
                out.flush()
                err.flush()
                progress["out"], progress["err"] = out.tell(), err.tell()
                self.save(rec)
                delay = self.config.scaled(self.config.line_seconds) * lines
                await self._sleep(rec, delay) if delay > 0 else await asyncio.sleep(0)
            if stop in ("expired", "cancelled"):
                await asyncio.to_thread(self._close_remaining, rec, stop, src, err)
                err.flush()
                progress["err"] = err.tell()
        return stop

    def _put(self, fh: IO[bytes], data: bytes, line_no: int) -> None:
        """Write one result line, its bytes reserved under the storage cap first."""
        if not self.store.reserve(len(data)):
            raise _StorageFull(line_no)
        fh.write(data)

    def _echo_chunk(self, rec: dict[str, Any], src: IO[bytes], out: IO[bytes], err: IO[bytes]) -> int:
        """Read, answer and write one chunk with the echo model (runs in a worker thread)."""
        chunk = _read_chunk(src, rec["progress"], self.config.chunk_size)
        answered = []
        for line_no, raw in chunk:
            custom_id, url, body = self._parse_line(raw, rec)
            if self.faults.line_fails(rec["id"], line_no):
                self.faults.count("line_failures")
                answered.append((line_no, custom_id, 500, _injected_line_error()))
                continue
            try:
                assert isinstance(self.backend, EchoBackend)
                status, answer = self.backend.answer(url, body)
            except Exception as exc:  # one line's trouble is that line's error, never the batch's
                log.exception("batch %s line %d: the echo backend failed", rec["id"], line_no)
                status, answer = 500, _line_crash_error(exc)
            answered.append((line_no, custom_id, status, answer))
        self._write_answers(rec, answered, out, err)
        return len(chunk)

    def _write_answers(
        self, rec: dict[str, Any], answered: list[tuple[int, str, int, Any]], out: IO[bytes], err: IO[bytes]
    ) -> None:
        counts = rec["request_counts"]
        tag = _tag(rec["id"])
        for line_no, custom_id, status, body in answered:
            line_id = f"batch_req_{tag}_{line_no:08d}"
            ok, result = self.wire.result_line(
                rec, line_id, custom_id, status, body, f"req_{tag}{line_no:08d}"
            )
            self._put(out if ok or self.wire.one_results_file else err, orjson.dumps(result) + b"\n", line_no)
            if ok:
                counts["completed"] += 1
            else:
                counts["failed"] += 1

    def _close_remaining(self, rec: dict[str, Any], stop: str, src: IO[bytes], err: IO[bytes]) -> None:
        """An error line for every line not answered when the batch expired or was cancelled."""
        progress = rec["progress"]
        code = "batch_expired" if stop == "expired" else "batch_cancelled"
        tag = _tag(rec["id"])
        while chunk := _read_chunk(src, progress, 4096):
            for line_no, raw in chunk:
                line_id = f"batch_req_{tag}_{line_no:08d}"
                line = self.wire.system_line(line_id, _custom_id(raw), code)
                self._put(err, orjson.dumps(line) + b"\n", line_no)
                rec["request_counts"]["failed"] += 1
                progress[stop] += 1

    def _stop_reason(self, rec: dict[str, Any]) -> str | None:
        if rec["status"] == "failed":
            return "failed"
        if rec["status"] == "cancelling":
            return "cancelled"
        if rec["flags"]["expire"] or now() >= rec["expires_at"]:
            return "expired"
        return None

    def _parse_line(self, raw: bytes, rec: dict[str, Any]) -> tuple[str, str, Any]:
        """(custom_id, url, body) of a validated input line, in canonical form."""
        obj = orjson.loads(raw)
        if self.wire.vendor_lines:
            obj = self.wire.canonical_line(obj, rec)
        return obj["custom_id"], obj["url"], obj["body"]

    async def _answer(
        self, rec: dict[str, Any], chunk: list[tuple[int, bytes]]
    ) -> list[tuple[int, str, int, Any]]:
        """Answer a chunk through an asynchronous backend (the upstream), lines concurrently."""
        batch_id = rec["id"]

        async def one(line_no: int, raw: bytes) -> tuple[int, str, int, Any]:
            custom_id, url, body = self._parse_line(raw, rec)
            if self.faults.line_fails(batch_id, line_no):
                self.faults.count("line_failures")
                return line_no, custom_id, 500, _injected_line_error()
            try:
                status, answer = await self.backend.call(url, body)
            except Exception as exc:  # one line's trouble is that line's error, never the batch's
                log.exception("batch %s line %d: the backend failed", batch_id, line_no)
                status, answer = 500, _line_crash_error(exc)
            return line_no, custom_id, status, answer

        return list(await asyncio.gather(*(one(*item) for item in chunk)))

    async def _finalize(self, rec: dict[str, Any]) -> None:
        stop = rec["progress"]["stop"]
        if rec["status"] == "finalizing":
            await self._sleep(rec, self.config.scaled(self.config.finalize_seconds))
        self._publish(rec)
        self._finish(
            rec,
            {"done": "completed", "expired": "expired", "cancelled": "cancelled"}.get(
                stop or "", "completed"
            ),
        )

    def _publish(self, rec: dict[str, Any]) -> None:
        """Turn the work files into output/error files (only the non-empty ones, as OpenAI does).

        Each step can be interrupted by a crash and redone on restart: the new file's id is
        saved before the work file moves (one atomic rename), and the file record and the
        batch's field are written only when missing, so a rerun finishes the job instead of
        failing a batch whose lines were all answered.
        """
        progress = rec["progress"]
        pending: dict[str, str] = progress.setdefault("publish", {})
        for kind, field, key in (("output", "output_file_id", "out"), ("error", "error_file_id", "err")):
            if rec.get(field):
                continue
            path = self.store.work_path(rec["id"], kind)
            size = progress[key]
            if size <= 0:
                path.unlink(missing_ok=True)
                continue
            file_id = pending.get(kind)
            if file_id is None:
                file_id = pending[kind] = self.store.new_id("file-", self.wire.id_style)
                self.save(rec)
                _crash_point(f"publish_{kind}_named")
            dest = self.store.file_path(file_id)
            if path.exists():
                with open(path, "r+b") as fh:
                    self.store.release(os.fstat(fh.fileno()).st_size - size)
                    fh.truncate(size)
                _crash_point(f"publish_{kind}_truncated")
                os.replace(path, dest)
                _crash_point(f"publish_{kind}_moved")
            elif not dest.exists():
                raise FileNotFoundError(f"the {kind} work file of batch {rec['id']} is gone")
            if self.store.get_file(file_id) is None:
                self.store.add_file(
                    {
                        "id": file_id,
                        "bytes": size,
                        "created_at": now(),
                        "filename": f"{rec['id']}_{kind}.jsonl",
                        "purpose": "batch_output",
                    }
                )
                _crash_point(f"publish_{kind}_recorded")
            rec[field] = file_id
            self.save(rec)
            _crash_point(f"publish_{kind}_saved")
        _crash_point("published")

    def _finish(self, rec: dict[str, Any], status: str) -> None:
        rec["status"] = status
        rec[{"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[status]] = (
            now()
        )
        self.save(rec)


def _injected_line_error() -> dict[str, Any]:
    return error_body(
        "Injected line failure from the local batch server.", type_="server_error", code="server_error"
    )


def _line_crash_error(exc: BaseException) -> dict[str, Any]:
    return error_body(
        f"The local batch server could not answer this line ({type(exc).__name__}).",
        type_="server_error",
        code="server_error",
    )


def _tag(batch_id: str) -> str:
    return hashlib.sha256(batch_id.encode()).hexdigest()[:10]


def _custom_id(raw: bytes) -> str:
    try:
        value = orjson.loads(raw).get("custom_id")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def _read_chunk(src: IO[bytes], progress: dict[str, Any], size: int) -> list[tuple[int, bytes]]:
    """Up to ``size`` non-blank lines with their physical line numbers; advances the checkpoint."""
    chunk: list[tuple[int, bytes]] = []
    while len(chunk) < size:
        raw = src.readline()
        if not raw:
            break
        progress["line"] += 1
        progress["offset"] += len(raw)
        if raw.strip():
            chunk.append((progress["line"], raw))
    return chunk


@contextlib.contextmanager
def _open_at(store: Store, path: Path, size: int) -> Any:
    """Open a work file for appending after truncating it to the last checkpoint.

    :param store: gives back the bytes cut off (written after the checkpoint by a crashed run).
    """
    mode = "r+b" if path.exists() else "w+b"
    with open(path, mode) as fh:
        store.release(os.fstat(fh.fileno()).st_size - size)
        fh.truncate(size)
        fh.seek(size)
        yield fh
