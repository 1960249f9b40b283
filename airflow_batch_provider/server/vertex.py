"""``serve --dialect vertex``: Vertex AI batch prediction jobs, reading and writing Cloud Storage.

Written from Google's REST reference of ``projects.locations.batchPredictionJobs`` (create, get,
list with ``filter``/``pageSize``/``pageToken``, ``:cancel``) and the google-genai SDK's Vertex
batches, not from the provider's dialect. Every request carries ``Authorization: Bearer
<token>`` (the server's key stands in for a Google access token); a missing or wrong token is
Google's 401 ``UNAUTHENTICATED``. Errors are ``{"error": {"code", "message", "status"}}``.

A create downloads the input (``inputConfig.gcsSource.uris``, one JSONL object) from the Cloud
Storage endpoint the server is given (``gcs_endpoint_url``: the test suite's emulator, over the
JSON API), runs its ``{key, request}`` lines through the engine (as the Gemini API mode reads
them), and once the job has ended writes ``predictions.jsonl`` under
``<outputUriPrefix>/prediction-model-<time>/``, the directory ``outputInfo.gcsOutputDirectory``
names. Each output line is ``{key, response, status: ""}``, or ``{key, status: <message>}`` for a
failed request; a job that ended with failed requests is ``JOB_STATE_PARTIALLY_SUCCEEDED``.

BigQuery input and output (``instancesFormat``/``predictionsFormat`` ``bigquery``) read and
write through ``server/vertex_bigquery.py``.

Not emulated: the output lines do not echo the ``request`` (Google's do); an unreadable input is
refused at create (Google fails the job later); no tuned-model
(``projects/...``) resource is checked.
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import httpx
import orjson

from airflow_batch_provider.server.vertex_bigquery import split_bq
from airflow_batch_provider.server.wire import SYSTEM_MESSAGES, ApiError, GeminiWire, tallies

JOBS = "batchPredictionJobs"
_GS_URI = re.compile(r"gs://([a-z0-9][-_.a-z0-9]{1,220}[a-z0-9])/(.+)")
_MODEL = re.compile(
    r"publishers/google/models/[a-zA-Z0-9._-]+|projects/[^/]+/locations/[^/]+/(models|endpoints)/.+"
)
_FILTER = re.compile(r'\s*labels\.([a-z][a-z0-9_-]{0,62})\s*=\s*"([a-z0-9_-]{0,63})"\s*')
GCS_TIMEOUT = 60.0


def _iso(value: float | None) -> str | None:
    if value is None:
        return None
    return datetime.fromtimestamp(value, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def vertex_job_id() -> str:
    """A job id: 19 digits, as Vertex AI issues."""
    return str(secrets.randbelow(9 * 10**18) + 10**18)


def split_gs(uri: str) -> tuple[str, str]:
    """``(bucket, object)`` of a ``gs://`` URI (a ``ValueError`` otherwise)."""
    found = _GS_URI.fullmatch(uri)
    if found is None:
        raise ValueError(f"{uri!r} is not a gs://bucket/object URI")
    return found.group(1), found.group(2)


def download(endpoint: str, uri: str, dest: Path) -> None:
    """Stream the object ``uri`` into ``dest`` (``FileNotFoundError`` when there is none)."""
    bucket, name = split_gs(uri)
    url = f"{endpoint}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"
    with httpx.stream("GET", url, params={"alt": "media"}, timeout=GCS_TIMEOUT) as answer:
        if answer.status_code == 404:
            raise FileNotFoundError(uri)
        answer.raise_for_status()
        with dest.open("wb") as out:
            for chunk in answer.iter_bytes(1 << 20):
                out.write(chunk)


def upload(endpoint: str, uri: str, source: Path) -> None:
    """Write ``source`` to the object ``uri`` (one multipart upload: metadata, then the bytes)."""
    bucket, name = split_gs(uri)
    boundary = f"abp-{secrets.token_hex(8)}"
    head = (
        f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode()
        + orjson.dumps({"name": name, "contentType": "application/jsonl"})
        + f"\r\n--{boundary}\r\nContent-Type: application/jsonl\r\n\r\n".encode()
    )
    body = head + source.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    answer = httpx.post(
        f"{endpoint}/upload/storage/v1/b/{bucket}/o",
        params={"uploadType": "multipart"},
        content=body,
        headers={"Content-Type": f"multipart/related; boundary={boundary}"},
        timeout=GCS_TIMEOUT,
    )
    answer.raise_for_status()


class VertexWire(GeminiWire):
    """Vertex AI's control plane for batch prediction (``batchPredictionJobs``)."""

    name = "vertex"
    upload_prefix = None
    colon_download = False
    model_batches = False
    model_methods: ClassVar[Mapping[str, str]] = {}
    batches_route = JOBS
    path_prefixes = ("/v1",)
    cancel_final_status = 400
    MAX_PAGE = 1000
    STATES = {
        "validating": "JOB_STATE_PENDING",
        "in_progress": "JOB_STATE_RUNNING",
        "finalizing": "JOB_STATE_RUNNING",
        "cancelling": "JOB_STATE_CANCELLING",
        "completed": "JOB_STATE_SUCCEEDED",
        "failed": "JOB_STATE_FAILED",
        "expired": "JOB_STATE_EXPIRED",
        "cancelled": "JOB_STATE_CANCELLED",
    }

    # ---- auth -----------------------------------------------------------------------------
    def presented_key(self, headers: Mapping[str, str]) -> str | None:
        auth = headers.get("authorization") or ""
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def check_key(self, headers: Mapping[str, str], api_key: str | None) -> None:
        if api_key is None:
            return
        presented = self.presented_key(headers)
        if presented is None or not hmac.compare_digest(presented.encode(), api_key.encode()):
            # Google's answer to a missing, expired or wrong token; the token is never echoed.
            raise self.error(
                401,
                "Request had invalid authentication credentials. Expected OAuth 2 access token, "
                "login cookie or other valid authentication credential.",
            )

    # ---- jobs -----------------------------------------------------------------------------
    def parse_job(self, body: Any) -> dict[str, Any]:
        """The create body: display name, model, one JSONL input on gs://, a gs:// output prefix."""
        if not isinstance(body, Mapping):
            raise self.error(400, "Invalid JSON payload: the body must be an object.")
        display = body.get("displayName")
        if not isinstance(display, str) or not display or len(display) > 128:
            raise self.error(400, "displayName is required (at most 128 characters).")
        model = body.get("model")
        if not isinstance(model, str) or not _MODEL.fullmatch(model):
            raise self.error(400, f"model {model!r} must be publishers/google/models/{{model}}.")
        job = self._io(body.get("inputConfig"), body.get("outputConfig"))
        labels = body.get("labels") or {}
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and _FILTER.fullmatch(f'labels.{k}="{v}"')
            for k, v in labels.items()
        ):
            raise self.error(
                400, "labels: keys and values are at most 63 lowercase letters, digits, _ and -."
            )
        return {
            "endpoint": "/v1/chat/completions",
            "completion_window": self.WINDOW,
            "metadata": dict(labels),
            "name": display,
            "model": model.rsplit("/", 1)[-1],
            "vertex": {"model": model, **job},
        }

    def _io(self, source: Any, out: Any) -> dict[str, Any]:
        """The job's input and output: one JSONL object on gs:// and a gs:// prefix, or a
        BigQuery table and a BigQuery dataset or table (``server/vertex_bigquery.py``)."""
        if not isinstance(source, Mapping) or not isinstance(out, Mapping):
            raise self.error(400, "inputConfig and outputConfig are required.")
        if source.get("instancesFormat") == "bigquery":
            uri = (source.get("bigquerySource") or {}).get("inputUri")
            dest = out.get("bigqueryDestination")
            target = dest.get("outputUri") if isinstance(dest, Mapping) else None
            if out.get("predictionsFormat") != "bigquery" or not isinstance(target, str):
                raise self.error(
                    400, "outputConfig needs predictionsFormat bigquery and bigqueryDestination.outputUri."
                )
            try:
                if not isinstance(uri, str) or split_bq(uri)[2] is None:
                    raise ValueError(f"inputConfig.bigquerySource.inputUri {uri!r} must name a bq:// table")
                split_bq(target)
            except ValueError as exc:
                raise self.error(400, str(exc)) from None
            return {"input": uri, "output_uri": target, "format": "bigquery"}
        gcs = source.get("gcsSource")
        uris = gcs.get("uris") if isinstance(gcs, Mapping) else None
        if source.get("instancesFormat") != "jsonl":
            raise self.error(400, "inputConfig.instancesFormat must be jsonl or bigquery.")
        if not isinstance(uris, list) or len(uris) != 1 or not isinstance(uris[0], str):
            raise self.error(400, "inputConfig.gcsSource.uris must name one gs:// object.")
        dest = out.get("gcsDestination")
        prefix = dest.get("outputUriPrefix") if isinstance(dest, Mapping) else None
        if out.get("predictionsFormat") != "jsonl" or not isinstance(prefix, str):
            raise self.error(
                400, "outputConfig needs predictionsFormat jsonl and gcsDestination.outputUriPrefix."
            )
        for uri in (uris[0], prefix.rstrip("/") + "/x"):
            try:
                split_gs(uri)
            except ValueError as exc:
                raise self.error(400, str(exc)) from None
        return {"input": uris[0], "output_prefix": prefix.rstrip("/")}

    def parse_filter(self, text: str | None) -> dict[str, str]:
        """``labels.k="v" AND ...`` as the pairs a listed job must carry (what the provider sends)."""
        if not text:
            return {}
        pairs: dict[str, str] = {}
        for term in re.split(r"\s+AND\s+", text.strip()):
            found = _FILTER.fullmatch(term)
            if found is None:
                raise self.error(
                    400, f'Unsupported filter {text!r} (the local server takes labels.k="v" AND ...).'
                )
            pairs[found.group(1)] = found.group(2)
        return pairs

    def status_of(self, rec: Mapping[str, Any]) -> str:
        state = self.STATES[str(rec["status"])]
        if state == "JOB_STATE_SUCCEEDED" and int(rec["request_counts"]["failed"]) > 0:
            return "JOB_STATE_PARTIALLY_SUCCEEDED"
        return state

    def render_batch(self, rec: Mapping[str, Any]) -> dict[str, Any]:
        job = rec.get("vertex") or {}
        project, location = job.get("project", "p"), job.get("location", "l")
        status = str(rec["status"])
        done, total, succeeded, failed, _, ended = tallies(rec)
        raw: dict[str, Any] = {
            "name": f"projects/{project}/locations/{location}/{JOBS}/{rec['id']}",
            "displayName": rec.get("name"),
            "model": job.get("model"),
            **_io_config(job),
            "state": self.status_of(rec),
            "createTime": _iso(rec["created_at"]),
            "updateTime": _iso(ended or rec.get("in_progress_at") or rec["created_at"]),
            "labels": dict(rec.get("metadata") or {}),
            "completionStats": {
                "successfulCount": str(succeeded),
                "failedCount": str(failed),
                "incompleteCount": str(max(total - succeeded - failed, 0)),
            },
        }
        if rec.get("in_progress_at"):
            raw["startTime"] = _iso(rec["in_progress_at"])
        if done:
            raw["endTime"] = _iso(ended)
        if job.get("output_dir"):
            raw["outputInfo"] = {"gcsOutputDirectory": job["output_dir"]}
        if job.get("output_table"):
            raw["outputInfo"] = {
                "bigqueryOutputDataset": job["output_dataset"],
                "bigqueryOutputTable": job["output_table"],
            }
        if status == "failed":
            errors = rec.get("errors") or [{}]
            message = str(errors[0].get("message") or errors[0].get("code") or "the job failed")
            raw["error"] = {"code": 3, "message": message}
        return raw

    def render_job_page(self, items: list[dict[str, Any]], token: str | None) -> dict[str, Any]:
        page: dict[str, Any] = {JOBS: [self.render_batch(r) for r in items]}
        if token:
            page["nextPageToken"] = token
        return page

    # ---- result lines -------------------------------------------------------------------
    def response_line(
        self, line_id: str, custom_id: str, status: int, body: Any, request_id: str
    ) -> tuple[bool, dict[str, Any]]:
        if 200 <= status < 300 and isinstance(body, Mapping):
            return True, {"key": custom_id, "response": self._response(body, request_id), "status": ""}
        inner = body.get("error") if isinstance(body, Mapping) else None
        message = inner.get("message") if isinstance(inner, Mapping) else None
        return False, {"key": custom_id, "status": str(message or f"request failed with HTTP {status}")}

    def system_line(
        self, line_id: str, custom_id: str, code: str, message: str | None = None, param: Any = None
    ) -> dict[str, Any]:
        return {"key": custom_id, "status": message or SYSTEM_MESSAGES.get(code, code)}


def _io_config(job: Mapping[str, Any]) -> dict[str, Any]:
    """``inputConfig`` and ``outputConfig`` of a job as it was created."""
    if job.get("format") == "bigquery":
        return {
            "inputConfig": {"instancesFormat": "bigquery", "bigquerySource": {"inputUri": job.get("input")}},
            "outputConfig": {
                "predictionsFormat": "bigquery",
                "bigqueryDestination": {"outputUri": job.get("output_uri")},
            },
        }
    return {
        "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": [job.get("input")]}},
        "outputConfig": {
            "predictionsFormat": "jsonl",
            "gcsDestination": {"outputUriPrefix": job.get("output_prefix")},
        },
    }


def output_dir(rec: Mapping[str, Any]) -> str:
    """The directory a job's predictions go to: ``<prefix>/prediction-model-<creation time>``."""
    job = rec["vertex"]
    stamp = datetime.fromtimestamp(rec["created_at"], tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"{job['output_prefix']}/prediction-model-{stamp}"


def not_ready(wire: VertexWire, bigquery: bool = False) -> ApiError:
    if bigquery:
        return wire.error(
            400, "The local server was started without --bigquery-endpoint-url: it cannot read bq://."
        )
    return wire.error(400, "The local server was started without --gcs-endpoint-url: it cannot read gs://.")


def job_labels_match(rec: Mapping[str, Any], wanted: Mapping[str, str]) -> bool:
    """Whether a job carries every wanted label."""
    labels = rec.get("metadata") or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def encode_token(batch_id: str) -> str:
    """A page token naming the last job of a page (opaque to the client)."""
    return orjson.dumps({"after": batch_id}).hex()


def decode_token(wire: VertexWire, token: str | None) -> str | None:
    if not token:
        return None
    try:
        after = orjson.loads(bytes.fromhex(token)).get("after")
    except (ValueError, AttributeError):
        raise wire.error(400, "Invalid pageToken.") from None
    return str(after) if after else None
