"""Vertex AI batch prediction of Gemini models (``batchPredictionJobs``), Cloud Storage in and out.

Built to Google's REST reference of ``projects.locations.batchPredictionJobs`` and the
``google-genai`` SDK's Vertex batches (``Client(vertexai=True).batches``). The API root is
``https://{location}-aiplatform.googleapis.com/v1/projects/{project}/locations/{location}``
(``aiplatform.googleapis.com`` for location ``global``); requests carry a Google OAuth token
(``dialects/google_credentials.py``). A job is created with ``POST batchPredictionJobs`` and
``{displayName, model: "publishers/google/models/{model}", inputConfig: {instancesFormat:
"jsonl", gcsSource: {uris}}, outputConfig: {predictionsFormat: "jsonl", gcsDestination:
{outputUriPrefix}}, labels}``; read with ``GET batchPredictionJobs/{id}``; listed with
``pageSize``/``pageToken`` and a server-side ``filter`` on labels (how a job lost in a crash is
found: by the label carrying its shard's idempotency key); cancelled with ``:cancel``. States are
``JOB_STATE_*``; ``PARTIALLY_SUCCEEDED`` is a completed job with failed lines (the rows it
exported are merged, the rest recorded). Counts come from ``completionStats``
(``successfulCount``, ``failedCount``, ``incompleteCount``: int64 as digit strings).

Request lines are ``{"key", "request": GenerateContentRequest}``, encoded by the Gemini API
dialect (one encoding for both Google routes); Google echoes the input line's other fields in
each output line, ``{"key", "request", "response": GenerateContentResponse, "status": ""}``, or
``"status": "<error message>"`` without a response for a failed request. The output sits under
``outputInfo.gcsOutputDirectory`` (``prediction-model-<time>/predictions*.jsonl``).

Labels take keys and values of at most 63 lowercase letters, digits, ``_`` and ``-``
(``stored_metadata``): the shard's fingerprint (64 hex characters) goes on the job as its first 63
(``airflow_fingerprint``; 252 bits, still no collision to fear), the idempotency key as it is, the
other pairs when they fit (a run id with capitals or colons does not, and is not sent). The same
rule makes the lookups: a job found again by its key label is adopted only when its fingerprint
label is the shard's (``tags_agree``, as strict as the other dialects' tags); a lost create is
looked for by the labels it was sent with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from airflow_batch_provider.constants import FINGERPRINT_NAME
from airflow_batch_provider.dialects.base import (
    LIST_WHAT,
    ResultObjectKind,
    ResultsMode,
    batch_object,
    bind_models,
    page_items,
    page_object,
    str_or_none,
)
from airflow_batch_provider.dialects.gemini import CHAT, GeminiDialect, int64_count
from airflow_batch_provider.exceptions import (
    BatchApiResponseError,
    ConfigurationError,
    UnknownBatchStatusError,
)
from airflow_batch_provider.ids import path_segment
from airflow_batch_provider.limits import MB, Limits

if TYPE_CHECKING:  # bound at run time by bind_models (see dialects/base.py)
    import httpx

    from airflow_batch_provider.models import (  # noqa: TC004
        Batch,
        BatchError,
        BatchState,
        LineError,
        RequestCounts,
        ResultLine,
        ResultSource,
        to_utc,
    )

JOBS = "batchPredictionJobs"
# Vertex AI's job states, in the provider's vocabulary. PARTIALLY_SUCCEEDED ended with some
# requests failed: completed, its counts say how many (the merge lands what succeeded).
STATES: dict[str, str] = {
    "JOB_STATE_QUEUED": "validating",
    "JOB_STATE_PENDING": "validating",
    "JOB_STATE_RUNNING": "in_progress",
    "JOB_STATE_UPDATING": "in_progress",
    "JOB_STATE_PAUSED": "in_progress",
    "JOB_STATE_SUCCEEDED": "completed",
    "JOB_STATE_PARTIALLY_SUCCEEDED": "completed",
    "JOB_STATE_FAILED": "failed",
    "JOB_STATE_CANCELLING": "cancelling",
    "JOB_STATE_CANCELLED": "cancelled",
    "JOB_STATE_EXPIRED": "expired",
}
# A label key or value: at most 63 lowercase letters, digits, underscores and dashes (a key
# starts with a letter). Google allows international letters too; these never need them.
_LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
_LOCATION = re.compile(r"[a-z0-9-]{1,40}")
_PROJECT = re.compile(r"[a-z0-9][a-z0-9.:-]{0,99}")
MAX_LABELS = 64
MAX_LABEL_VALUE = 63


def label_pairs(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The metadata pairs a Vertex label can hold as they are (the others are left out)."""
    return {
        k: v for k, v in (metadata or {}).items() if _LABEL_KEY.fullmatch(k) and _LABEL_VALUE.fullmatch(v)
    }


def stored_labels(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The labels a job carries for ``metadata``: the fingerprint cut to a label's 63 characters,
    then the pairs that fit (``label_pairs``)."""
    return label_pairs(
        {k: v[:MAX_LABEL_VALUE] if k == FINGERPRINT_NAME else v for k, v in (metadata or {}).items()}
    )


def publisher_model(model: str) -> str:
    """A model id as the job names it: ``gemini-2.5-flash`` -> ``publishers/google/models/gemini-2.5-flash``;
    a full resource name (``publishers/...``, ``projects/...``) is kept."""
    if model.startswith(("publishers/", "projects/")):
        return model
    return f"publishers/google/models/{model.removeprefix('models/')}"


# An output object of a job, below its output prefix: ``prediction-<model>-<time>/predictions*.jsonl``
# (or ``predictions*.jsonl`` below the directory ``outputInfo`` names).
_PREDICTIONS = re.compile(r"(?:prediction-[^/]+/)?predictions[^/]*\.jsonl")


class VertexDialect(GeminiDialect):
    """Vertex AI batch prediction (``batchPredictionJobs``) of Gemini models.

    :param project: the Google Cloud project (extra ``project``).
    :param location: the region (extra ``location``, e.g. ``us-central1``; ``global``).
    """

    name = "vertex"
    label = "Google Vertex AI"
    default_base_url = "https://us-central1-aiplatform.googleapis.com"
    default_api_path = "/v1"
    endpoints = frozenset({CHAT})
    # Google documents 200,000 requests per job and a 1 GB input file for Gemini batch
    # prediction on Cloud Storage; no per-request size is documented beside the model's context.
    limits = Limits(max_lines=200_000, max_file_bytes=1024 * MB, max_line_bytes=1024 * MB)
    supports_metadata = True
    max_metadata_pairs = MAX_LABELS
    # The encoded shard is written beside the staged one on Cloud Storage and the job names its
    # URI; the output is listed under the prefix the job wrote to (hooks/objects.py).
    submission_mode = "object_store"
    results_modes: ClassVar[tuple[ResultsMode, ...]] = ("object_store",)
    object_store_schemes = ("gs", "gcs")
    # Requests tables on BigQuery (bigquerySource) and prediction tables (bigqueryDestination).
    bigquery_io = True
    list_keys = frozenset({JOBS})
    listed_id_key = "name"
    # A cancel of a job that has ended is refused as FAILED_PRECONDITION (HTTP 400).
    cancel_final_statuses = frozenset({400})
    connection_fields = {
        "project": {
            "label": "Google Cloud project (vertex)",
            "description": "Vertex AI: the project the batch prediction jobs run in.",
            "schema": {"type": ["string", "null"]},
        },
        "location": {
            "label": "Vertex AI location (vertex)",
            "description": "Vertex AI: the region of the jobs, e.g. us-central1 (or global).",
            "schema": {"type": ["string", "null"]},
        },
        "storage_conn_id": {
            "label": "Cloud Storage connection (vertex)",
            "description": (
                "Vertex AI: the Airflow connection that reads the jobs' output on gs:// (the "
                "staging's, gs://<conn_id>@bucket/...); empty: Application Default Credentials."
            ),
            "schema": {"type": ["string", "null"]},
        },
        "key_path": {
            "label": "Service-account key file (vertex)",
            "description": (
                "Vertex AI: a service-account key file on the workers; the password may hold the "
                "key's JSON instead; neither: Application Default Credentials."
            ),
            "schema": {"type": ["string", "null"]},
        },
    }

    def __init__(
        self, *, project: str = "", location: str = "us-central1", storage_conn_id: str | None = None
    ) -> None:
        super().__init__()
        bind_models(
            globals(),
            "Batch",
            "BatchError",
            "BatchState",
            "LineError",
            "RequestCounts",
            "ResultLine",
            "to_utc",
        )
        self.project = project
        self.location = location
        self.storage_conn_id = storage_conn_id

    def __repr__(self) -> str:
        return f"<Dialect vertex {self.project or '?'}/{self.location}>"

    # ---- connection ---------------------------------------------------------------------
    def configure(self, extra: Mapping[str, Any], conn_id: str) -> VertexDialect:
        """The dialect with the connection's project and location, checked."""
        self.check_connection(extra, conn_id)
        where = f"connection {conn_id!r} (dialect vertex)"
        location = str(extra.get("location") or "").strip()
        if not _LOCATION.fullmatch(location):
            raise ConfigurationError(
                f"{where}: extra 'location' is {extra.get('location')!r}; "
                "give the jobs' region, e.g. us-central1"
            )
        project = str(extra.get("project") or "").strip()
        if not _PROJECT.fullmatch(project):
            raise ConfigurationError(
                f"{where}: extra 'project' is {extra.get('project')!r}; give the Google Cloud project id"
            )
        storage = extra.get("storage_conn_id")
        return VertexDialect(
            project=project, location=location, storage_conn_id=str(storage) if storage else None
        )

    @property
    def default_url(self) -> str:
        host = (
            "aiplatform.googleapis.com"
            if self.location == "global"
            else f"{self.location}-aiplatform.googleapis.com"
        )
        return f"https://{host}"

    @property
    def api_path(self) -> str:
        return f"/v1/projects/{self.project}/locations/{self.location}"

    def check_base_url(self, base_url: str, conn_id: str) -> None:
        """The API root must end in the project and location (a host naming another path cannot
        reach the jobs)."""
        if not base_url.rstrip("/").endswith(self.api_path):
            raise ConfigurationError(
                f"connection {conn_id!r} (dialect vertex): the host names the path of {base_url!r}; give "
                f"only the endpoint (e.g. {self.default_url}), the path {self.api_path} follows from "
                "extras project and location"
            )

    # ---- authentication -------------------------------------------------------------
    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Nothing: the bearer token comes from ``request_auth`` (the password is a key, not a header)."""
        return {}

    def request_auth(
        self, secret: str | None, extra: Mapping[str, Any], base_url: str, conn_id: str
    ) -> httpx.Auth | None:
        from airflow_batch_provider.dialects.google_credentials import google_bearer_auth

        return google_bearer_auth(secret, extra, base_url, conn_id)

    def is_auth_error(self, status_code: int, body: Any) -> bool:
        return False

    # ---- paths ----------------------------------------------------------------------
    batches_path = JOBS

    def batch_path(self, batch_id: str) -> str:
        return f"{JOBS}/{path_segment(_job_id(batch_id), 'batch_id')}"

    def cancel_path(self, batch_id: str) -> str:
        return f"{self.batch_path(batch_id)}:cancel"

    def create_path(self, model: str | None, endpoint: str | None = None) -> str:
        return JOBS

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        if canonical.get("url") == "/v1/embeddings":
            return (
                "endpoint /v1/embeddings not supported by Vertex AI batch prediction as this provider "
                "drives it (Gemini models' generateContent only)"
            )
        return super().unsupported(canonical)

    # ---- batches --------------------------------------------------------------------
    def object_create_body(
        self,
        *,
        input_uri: str,
        output_uri: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None,
        name: str | None,
        model: str | None,
    ) -> dict[str, Any]:
        """The job: the encoded shard's ``gs://`` URI, the output prefix, the model and labels."""
        if not model:
            raise ConfigurationError("a Vertex AI batch prediction job names one model: none was given")
        labels = self.stored_metadata(metadata)
        body: dict[str, Any] = {
            "displayName": (metadata or {}).get("airflow_batch_key") or name or "airflow-batch",
            "model": publisher_model(model),
            "inputConfig": {"instancesFormat": "jsonl", "gcsSource": {"uris": [input_uri]}},
            "outputConfig": {
                "predictionsFormat": "jsonl",
                "gcsDestination": {"outputUriPrefix": output_uri.rstrip("/")},
            },
        }
        if input_uri.startswith("bq://"):
            # A requests table the build wrote in BigQuery; the predictions go to a new table
            # (predictions_<time>) in the output dataset, one per job.
            if not output_uri.startswith("bq://"):
                raise ConfigurationError(
                    f"a job reading {input_uri} writes its predictions to BigQuery: the output "
                    f"{output_uri!r} is not a bq:// dataset"
                )
            body["inputConfig"] = {"instancesFormat": "bigquery", "bigquerySource": {"inputUri": input_uri}}
            body["outputConfig"] = {
                "predictionsFormat": "bigquery",
                "bigqueryDestination": {"outputUri": output_uri.rstrip("/")},
            }
        if labels:
            body["labels"] = labels
        return body

    def results_prefix_of(self, batch: Batch) -> str | None:
        """The directory the job wrote (``outputInfo``), else, once it ended, its output prefix
        (a job that ended early may have written completed rows there); None for a job writing
        BigQuery (its table is read inside BigQuery by the merge, see ``output_table``)."""
        config = batch.raw.get("outputConfig")
        if isinstance(config, Mapping) and config.get("predictionsFormat") == "bigquery":
            return None
        found = self.output_directory(batch.raw)
        if found or not batch.state.is_terminal:
            return found
        config = batch.raw.get("outputConfig")
        gcs = config.get("gcsDestination") if isinstance(config, Mapping) else None
        prefix = gcs.get("outputUriPrefix") if isinstance(gcs, Mapping) else None
        return prefix if isinstance(prefix, str) and prefix else None

    def output_table(self, batch: Batch) -> str | None:
        """The ``project.dataset.table`` an ended job wrote its predictions to (BigQuery output:
        ``outputInfo.bigqueryOutputDataset`` ``bq://project.dataset`` and the table's name in
        ``bigqueryOutputTable``), None until then or for a Cloud Storage job."""
        info = batch.raw.get("outputInfo")
        if not isinstance(info, Mapping):
            return None
        dataset, table = info.get("bigqueryOutputDataset"), info.get("bigqueryOutputTable")
        if not isinstance(table, str) or not table:
            return None
        table = table.removeprefix("bq://")
        if table.count(".") >= 2 or not isinstance(dataset, str):
            return table  # already qualified (or nothing to qualify it with)
        return f"{dataset.removeprefix('bq://').rstrip('.')}.{table.rsplit('.', 1)[-1]}"

    def result_object_kind(self, relative: str) -> ResultObjectKind | None:
        """``predictions*.jsonl`` (below a ``prediction-*`` folder) holds the result lines."""
        return "output" if _PREDICTIONS.fullmatch(relative) else None

    def create_name(self, body: Mapping[str, Any]) -> str | None:
        name = body.get("displayName")
        return name if isinstance(name, str) else None

    def listed_id(self, item: Any) -> str | None:
        name = item.get("name") if isinstance(item, dict) else None
        return _job_id(name) if isinstance(name, str) and name else None

    def filter_params(self, metadata: Mapping[str, str], *, since: datetime | None = None) -> dict[str, Any]:
        """``filter=labels.k="v" AND ...`` over the pairs a label holds (AIP-160 syntax)."""
        pairs = self.stored_metadata(metadata)
        if not pairs:
            return {}
        return {"filter": " AND ".join(f'labels.{k}="{v}"' for k, v in sorted(pairs.items()))}

    def metadata_of(self, batch: Batch) -> dict[str, str]:
        return batch.metadata

    def stored_metadata(self, metadata: Mapping[str, str] | None) -> dict[str, str]:
        """The job's labels for ``metadata`` (``stored_labels``): what the create sends, the
        listing filters by and a found job's labels are compared with."""
        return stored_labels(metadata)

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """The job as a ``Batch``; anything unreadable is a ``BatchApiResponseError``."""
        raw = batch_object(raw)
        name = raw.get("name")
        if not name:
            raise BatchApiResponseError("batch prediction job has no name", body=dict(raw))
        if not isinstance(name, str):
            raise BatchApiResponseError(
                f"batch prediction job has a name that is not a string ({type(name).__name__})",
                body=dict(raw),
            )
        batch_id = _job_id(name)
        state = raw.get("state")
        mapped = STATES.get(state) if isinstance(state, str) else None
        if mapped is None:
            raise UnknownBatchStatusError(
                f"batch {batch_id} reported unknown state {state!r}; known: {', '.join(STATES)}"
            )
        try:
            return self._job(batch_id, BatchState(mapped), raw)
        except (ValueError, TypeError, OverflowError) as exc:
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None

    def _job(self, batch_id: str, state: BatchState, raw: Mapping[str, Any]) -> Batch:
        stats = raw.get("completionStats")
        if stats is not None and not isinstance(stats, Mapping):
            raise ValueError(f"completionStats is {type(stats).__name__}, not an object")
        stats = stats or {}
        succeeded, failed = int64_count(stats, "successfulCount"), int64_count(stats, "failedCount")
        incomplete = int64_count(stats, "incompleteCount")
        labels = raw.get("labels") or {}
        if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("labels is not an object of strings")
        # Output and input are gs:// URIs, no file ids: read from ``raw`` (``output_directory``).
        self.output_directory(raw)
        errors: list[BatchError] = []
        error = raw.get("error")
        if isinstance(error, Mapping) and (error.get("code") or error.get("message")):
            errors.append(
                BatchError(code=str_or_none(error.get("code")), message=str_or_none(error.get("message")))
            )
        ended = to_utc(raw.get("endTime"))
        return Batch(
            id=batch_id,
            state=state,
            endpoint=CHAT,
            completion_window="24h",
            request_counts=RequestCounts(
                total=succeeded + failed + incomplete, completed=succeeded, failed=failed
            ),
            created_at=to_utc(raw.get("createTime")),
            in_progress_at=to_utc(raw.get("startTime")),
            completed_at=ended if state is BatchState.COMPLETED else None,
            failed_at=ended if state is BatchState.FAILED else None,
            cancelled_at=ended if state is BatchState.CANCELLED else None,
            expired_at=ended if state is BatchState.EXPIRED else None,
            metadata={str(k): v for k, v in labels.items()},
            errors=errors,
            raw=dict(raw),
        )

    @staticmethod
    def output_directory(raw: Mapping[str, Any]) -> str | None:
        """Where the ended job wrote its output (``outputInfo.gcsOutputDirectory``), None until then.

        :param raw: the job object (a ``Batch``'s ``raw``).
        """
        info = raw.get("outputInfo")
        found = info.get("gcsOutputDirectory") if isinstance(info, Mapping) else None
        if found is not None and not isinstance(found, str):
            raise ValueError(f"outputInfo.gcsOutputDirectory is {type(found).__name__}, not text")
        return found

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"pageSize": limit or self.list_page_size}

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        raw = page_object(raw)
        items = page_items(raw, JOBS)
        token = raw.get("nextPageToken")
        if token is not None and not isinstance(token, str):
            raise BatchApiResponseError(f"{LIST_WHAT}: nextPageToken is {type(token).__name__}, not a string")
        return items, ({**params, "pageToken": token} if token else None)

    # ---- results --------------------------------------------------------------------
    def parse_result_line(self, raw: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """One output line: its ``response`` as a chat completion, or its ``status`` message as the error."""
        key = raw.get("key")
        if not isinstance(key, str) or not key:
            raise BatchApiResponseError("result line has no key", body=dict(raw))
        status = raw.get("status")
        response = raw.get("response")
        if (isinstance(status, str) and status) or not isinstance(response, dict):
            message = (
                status
                if isinstance(status, str) and status
                else "the line has neither a response nor a status"
            )
            return ResultLine(
                custom_id=key,
                ok=False,
                status_code=None,
                error=LineError(code="request_failed", message=message),
                source="error",
            )
        return self.answer_line(key, response, source)


def _job_id(name: str) -> str:
    """A job's id: the last segment of ``projects/p/locations/l/batchPredictionJobs/123``."""
    return name.rsplit("/", 1)[-1] if name.startswith("projects/") else name
