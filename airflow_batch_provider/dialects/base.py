"""The dialect contract: everything that differs between batch vendors, stated declaratively.

The hook, trigger, operators and the JSONL validator only ever talk to a ``Dialect``;
nothing outside ``dialects/`` knows a vendor's name, header, path or field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson

from airflow_batch_provider.exceptions import BatchApiResponseError
from airflow_batch_provider.ids import id_problem, path_segment
from airflow_batch_provider.limits import MAX_RESULT_LINE_BYTES, MB, Limits, ValidationRules

# The models are imported for type checking only; ``bind_models`` puts them into this module
# when the first dialect is made. Reading a dialect's rules (``airflow-batch validate``) then
# loads no pydantic.
if TYPE_CHECKING:
    import httpx

    from airflow_batch_provider.models import (  # noqa: TC004 (bound at run time by bind_models)
        Batch,
        BatchState,
        LineError,
        ResultLine,
        ResultSource,
    )


def bind_models(namespace: dict[str, Any], *names: str) -> None:
    """Put the named models into a dialect module's globals (called from its dialect's ``__init__``).

    Every parse runs on an instance, so the names are bound by then; an import inside each
    parse method would cost about 1 us per result line.
    """
    from airflow_batch_provider import models

    namespace.update({name: getattr(models, name) for name in names})


# What the hook can read results from. "files": the batch's output and error files;
# "results_endpoint": a paged endpoint on the batch itself (xAI, Doubleword); "results_url": one
# JSONL stream at the URL the ended batch names (``Dialect.results_url_of``; Anthropic);
# "object_store": the objects the batch wrote under its output prefix (``Dialect.results_prefix_of``),
# those ``Dialect.result_object_kind`` names, found by listing the prefix (Bedrock, Vertex AI).
ResultsMode = Literal["files", "results_endpoint", "results_url", "object_store"]
# How a batch is submitted. "file": the encoded shard is uploaded, and the create names the
# file; "inline": the create call's body carries the encoded requests themselves (Anthropic),
# streamed from the shard as ``{..., "requests": [line, line, ...]}``; "object_store": the
# encoded shard is written under the run's staging prefix on the vendor's object store (which the
# run's staging must be, ``Dialect.object_store_schemes``), and the create names its URI and an
# output prefix (``Dialect.object_create_body``); nothing goes to a Files API.
SubmissionMode = Literal["file", "inline", "object_store"]
# What a listed object under a batch's output prefix holds ("object_store" results): result lines
# ("output", or "error" lines), a summary of the batch's totals checked against what was read
# ("summary", ``Dialect.check_summary``), or nothing to read (None).
ResultObjectKind = Literal["output", "error", "summary"]
# How a batch whose create went unrecorded (a crash, a lost answer) is found again. "tags": by the
# metadata (or name) it was created with, which the listing shows (and may filter by);
# "time_and_count": the vendor keeps no tag, so by its creation time and request count (which
# an "inline" submission records with its intent), one match adopted and several refused (the
# submit operator's docstring states the guarantee).
OrphanLookup = Literal["tags", "time_and_count"]
# Where a request's model goes. "line": each line's ``body.model`` (OpenAI); "job": one model
# named on the create call, taken from the shard's lines (which must all name the same one).
ModelPlacement = Literal["line", "job"]
# How a file is uploaded. "multipart": one ``POST files`` with a multipart/form-data body;
# "resumable": the resumable upload protocol (Google's Files API): a start call at
# ``Dialect.upload_url`` opens a session whose URL takes the bytes (``upload, finalize``), and a
# dropped upload is resumed from the offset the session reports.
UploadProtocol = Literal["multipart", "resumable"]


@dataclass(frozen=True)
class ResultsPage:
    """One page of a paged results endpoint: parsed lines and the token for the next page."""

    lines: list[ResultLine]
    next_params: dict[str, Any] | None


@dataclass(frozen=True)
class LineShape:
    """Where each field of one result-file line sits, for a warehouse that reads the lines itself.

    The rules are those of :meth:`Dialect.parse_result_line` (the OpenAI line shape): a line
    is a success with no ``error`` and a 2xx status; an ``error`` object gives code and
    message, a non-empty string is the message of code ``error``; a non-2xx response without
    one takes the code and message of its body's ``error`` (else ``http_<status>``). A warehouse
    SQL dialect renders this as SQL (``SqlDialect.result_line_sql``); a dialect whose lines
    follow other rules declares no shape and its lines are parsed in Python.

    :param custom_id: path of the custom_id.
    :param response: path of the response object.
    :param status_code: key of the HTTP status inside the response (an int or a digit string).
    :param body: key of the response body inside the response.
    :param error: path of the line's error (an object with ``code``/``message``, or text).
    """

    custom_id: tuple[str, ...] = ("custom_id",)
    response: tuple[str, ...] = ("response",)
    status_code: str = "status_code"
    body: str = "body"
    error: tuple[str, ...] = ("error",)


@dataclass(frozen=True)
class Unreadable:
    """A listed item that does not parse: the batch id it names (None: none readable) and why."""

    batch_id: str | None
    error: BatchApiResponseError


@dataclass(frozen=True)
class ListPage:
    """One page of a batch listing.

    :param batches: the items that parse.
    :param next_params: the next page's params (None: the last page).
    :param unreadable: the items that do not parse: each fails only itself (a vendor's new
        status or field on one batch must not hide the page's other batches).
    :param skipped: items left unparsed because the reader wants other batches.
    """

    batches: list[Batch]
    next_params: dict[str, Any] | None
    unreadable: list[Unreadable] = field(default_factory=list)
    skipped: int = 0


class Dialect:
    """Base dialect: the OpenAI Batch API wire format.

    Subclasses override only what their vendor does differently. Paths are relative
    to the API root (the connection's base URL, which ends in the version, e.g. ``/v1``).
    """

    name: ClassVar[str] = "openai"
    label: ClassVar[str] = "OpenAI"
    default_base_url: ClassVar[str] = "https://api.openai.com/v1"

    endpoints: ClassVar[frozenset[str]] = frozenset(
        {"/v1/chat/completions", "/v1/embeddings", "/v1/completions", "/v1/responses", "/v1/moderations"}
    )
    completion_windows: ClassVar[tuple[str, ...]] = ("24h",)
    # OpenAI documents 50,000 requests and 200 MB per file and no per-line limit, so a line may
    # be as large as the file (base64 images, long documents).
    limits: ClassVar[Limits] = Limits(max_line_bytes=200 * MB)
    mixed_endpoints: ClassVar[bool] = False
    # OpenAI fails the whole batch when its lines name more than one model.
    mixed_models: ClassVar[bool] = False
    unique_custom_ids: ClassVar[bool] = True
    max_custom_id_chars: ClassVar[int | None] = 64
    # Connection extras without which the vendor answers 401 (checked when the connection is read).
    required_extras: ClassVar[tuple[str, ...]] = ()
    # Statuses by which a cancel says the batch is already final (answered, not retried).
    cancel_final_statuses: ClassVar[frozenset[int]] = frozenset()
    # Error codes/types by which a 429 (or 402) means the account is out of quota or credit:
    # waiting does not help, so the call fails at once.
    quota_error_codes: ClassVar[frozenset[str]] = frozenset({"insufficient_quota"})
    upload_purpose: ClassVar[str | None] = "batch"
    #: How files are uploaded (see ``UploadProtocol``).
    upload_protocol: ClassVar[UploadProtocol] = "multipart"
    #: The media type a resumable upload declares for a JSONL file.
    upload_media_type: ClassVar[str] = "application/jsonl"
    supports_metadata: ClassVar[bool] = True
    max_metadata_pairs: ClassVar[int] = 16
    results_modes: ClassVar[tuple[ResultsMode, ...]] = ("files",)
    list_page_size: ClassVar[int] = 100
    # Whether ``GET batches`` lists every batch of the key with its current status, newest first:
    # triggers of one connection then read their batches a page at a time instead of one by one.
    lists_batches: ClassVar[bool] = True
    # The key of a listed batch object that holds its id (``listed_batch`` looks batches up by it).
    listed_id_key: ClassVar[str] = "id"
    # The query parameter that asks for the page after a batch id (``last_id`` of this page).
    list_cursor_param: ClassVar[str] = "after"
    results_page_size: ClassVar[int] = 1000
    # The vendor's web page of one batch (``{batch_id}`` filled in), for the tasks' extra links;
    # None where the vendor documents none. Used only when the connection is the vendor's own host.
    console_url_template: ClassVar[str | None] = None
    #: Where the fields of a result-file line sit (see ``parse_result_line``); None when only
    #: Python can read the lines.
    line_shape: ClassVar[LineShape | None] = LineShape()
    #: Where the model goes (see ``ModelPlacement``); "job" dialects get it in ``create_batch_body``.
    model_placement: ClassVar[ModelPlacement] = "line"
    #: Endpoints whose requests the vendor runs without a model (it picks its own default). A
    #: "line" dialect needs ``body.model`` on every line to any other endpoint (see
    #: ``needs_line_model``); a "job" dialect takes the model from the job instead.
    model_optional_endpoints: ClassVar[frozenset[str]] = frozenset({"/v1/moderations"})
    #: What ``body.model`` names for this vendor, in the message of a line without one.
    model_meaning: ClassVar[str] = "the model"
    #: Per endpoint, the body fields a request there cannot go without: a chat body sent to the
    #: embeddings url (``messages``, no ``input``) is refused by the validator, not by the vendor
    #: hours later. Endpoints not listed are not checked.
    required_body_fields: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "/v1/chat/completions": ("messages",),
        "/v1/embeddings": ("input",),
        "/v1/completions": ("prompt",),
        "/v1/moderations": ("input",),
    }
    #: Whether submit passes every staged (canonical) line through ``unsupported`` and
    #: ``encode_line`` into an encoded copy before uploading. False (OpenAI's shape): the staged
    #: file is uploaded as it is, with no pass over its lines. Not a ClassVar: a configured
    #: dialect may encode on some connections only (Azure's classic API).
    encodes_lines: bool = False
    #: How a batch is submitted (see ``SubmissionMode``).
    submission_mode: ClassVar[SubmissionMode] = "file"
    #: The object-store schemes an "object_store" dialect reads input from and writes output to
    #: (``("s3",)``); the run's staging must be on one of them, checked before anything is written.
    object_store_schemes: ClassVar[tuple[str, ...]] = ()
    #: Whether a job can read its requests from a BigQuery table and write its answers to one
    #: (``bq://`` input and output: the build's ``requests_table`` route, see
    #: ``warehouse/bigquery_requests.py``); the dialect then puts ``bq://`` URIs on the job.
    bigquery_io: ClassVar[bool] = False
    #: The Airflow connection through which the provider reads the vendor's output objects (and
    #: writes its input), when the URIs the vendor names carry none; None: the scheme's default
    #: connection (``aws_default``...). Set by ``configure`` from the connection's extras.
    storage_conn_id: str | None = None
    #: Where a connection's credentials come from when the dialect signs requests with a
    #: platform's identity rather than the connection's key: ``"aws"`` (the amazon provider's
    #: connection), ``"google"``...; the hook reads them (``hooks/credentials.py``) and hands them
    #: to ``credentials_auth``. None: the key (``auth_headers``) or ``request_auth`` says it all.
    credentials_kind: ClassVar[str | None] = None
    #: The key of the create body that holds the encoded requests ("inline" dialects).
    inline_requests_key: ClassVar[str] = "requests"
    #: How a batch whose create went unrecorded is found again (see ``OrphanLookup``).
    orphan_lookup: ClassVar[OrphanLookup] = "tags"
    #: Whether the connection must name the host: the vendor has no one public URL (each
    #: account has its own endpoint), so ``default_base_url`` is only a hint.
    requires_host: ClassVar[bool] = False
    #: The API root's path when the connection's URL has none (and no schema).
    default_api_path: ClassVar[str] = "/v1"
    #: Codes of a failed batch's errors by which the vendor says a quota refused it (waiting for
    #: the queue to drain or raising the quota cures it, resubmitting at once does not).
    batch_quota_error_codes: ClassVar[frozenset[str]] = frozenset()
    #: The OpenAI encoding (``o200k_base``) that counts this vendor's input tokens exactly, or
    #: None when its tokenizer is private: the build then uses the script-aware heuristic times
    #: ``token_factor`` and says the count is an estimate (see ``airflow_batch_provider.estimate``).
    token_encoding: ClassVar[str | None] = "o200k_base"  # noqa: S105 (an encoding, no secret)
    #: Tokens this vendor's tokenizer makes per o200k token, for the heuristic (a stated estimate).
    token_factor: ClassVar[float] = 1.0
    #: The provider id under which the optional ``genai-prices`` table lists this vendor's models.
    price_provider: ClassVar[str | None] = "openai"
    #: The share taken off list prices for batch requests (0.5: half price); None when not
    #: known, and then list prices are used (an estimate that errs high).
    batch_discount: ClassVar[float | None] = 0.5
    #: Connection extras only this dialect reads, as connection-form fields (``label``,
    #: ``description``, JSON ``schema``); the form shows every dialect's.
    connection_fields: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __init__(self) -> None:
        bind_models(globals(), "Batch", "BatchState", "LineError", "ResultLine")

    # ---- authentication -------------------------------------------------------------
    def auth_headers(self, api_key: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Headers that authenticate a request; organisation/project come from connection extras."""
        headers: dict[str, str] = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        extra = extra or {}
        if extra.get("organization"):
            headers["OpenAI-Organization"] = str(extra["organization"])
        if extra.get("project"):
            headers["OpenAI-Project"] = str(extra["project"])
        return headers

    def request_auth(
        self, secret: str | None, extra: Mapping[str, Any], base_url: str, conn_id: str
    ) -> httpx.Auth | None:
        """An ``httpx.Auth`` that signs each request (a token fetched and refreshed at run
        time), or None when ``auth_headers`` says it all (a fixed key).

        :param secret: the connection's password.
        :param extra: the connection extra.
        :param base_url: the API root; an auth must sign only requests to its origin.
        :param conn_id: the connection id, for error messages.
        """
        return None

    def credentials_auth(self, credentials: Any, base_url: str, conn_id: str) -> httpx.Auth:
        """The ``httpx.Auth`` that signs each request with a platform identity (SigV4 with AWS
        credentials, a refreshed OAuth token), for a dialect with a ``credentials_kind``.

        :param credentials: what ``hooks/credentials.py`` read for ``credentials_kind`` (a
            provider of fresh credentials, sync and async; never logged).
        :param base_url: the API root; only requests to its origin are signed.
        :param conn_id: the connection id, for error messages.
        """
        raise NotImplementedError(f"dialect {self.name!r} signs no request with platform credentials")

    # ---- connection ---------------------------------------------------------------------
    def configure(self, extra: Mapping[str, Any], conn_id: str) -> Dialect:
        """This dialect as one connection uses it (its API version, file expiry...), its extras
        checked; the default has nothing to set and returns itself.

        :param extra: the connection extra.
        :param conn_id: the connection id, for error messages.
        """
        self.check_connection(extra, conn_id)
        return self

    def check_base_url(self, base_url: str, conn_id: str) -> None:
        """Refuse an API root this dialect, as configured, cannot call (nothing by default).

        :param base_url: the API root built from the connection.
        :param conn_id: the connection id, for error messages.
        """

    @property
    def default_url(self) -> str:
        """The API's URL when the connection names no host (a configured dialect may compute it:
        Vertex AI's depends on the location)."""
        return self.default_base_url

    @property
    def api_path(self) -> str:
        """The API root's path when the connection's URL names none (see ``default_api_path``)."""
        return self.default_api_path

    @property
    def query_params(self) -> dict[str, str]:
        """Query parameters sent on every call of the connection (an API version); none by default."""
        return {}

    # ---- paths ----------------------------------------------------------------------
    files_path: ClassVar[str] = "files"
    batches_path: ClassVar[str] = "batches"
    # Top-level keys every answer of the batch listing carries: how a connection test tells
    # which vendor's shape a server answers in, even when it lists no batch yet.
    list_keys: ClassVar[frozenset[str]] = frozenset({"data", "has_more"})

    # Every path built from an id places it with ``path_segment``: checked, then encoded as one
    # segment, so no id (from a user, a run's conf or a vendor answer) can reach another path.
    def file_path(self, file_id: str) -> str:
        return f"{self.files_path}/{path_segment(file_id, 'file_id')}"

    def file_content_path(self, file_id: str) -> str:
        return f"{self.files_path}/{path_segment(file_id, 'file_id')}/content"

    def batch_path(self, batch_id: str) -> str:
        return f"{self.batches_path}/{path_segment(batch_id, 'batch_id')}"

    def cancel_path(self, batch_id: str) -> str:
        return f"{self.batches_path}/{path_segment(batch_id, 'batch_id')}/cancel"

    @property
    def file_content_params(self) -> dict[str, str]:
        """Query parameters of a file's content download (``alt=media`` at Google); none by default."""
        return {}

    def create_path(self, model: str | None, endpoint: str | None = None) -> str:
        """The path of the create call; the model is the shard's for a "job" dialect whose path
        names it, the endpoint the shard's for a vendor with one create method per endpoint."""
        return self.batches_path

    def upload_url(self, base_url: str) -> str:
        """Where a "resumable" upload starts (an absolute URL on the API's origin).

        :param base_url: the API root.
        """
        raise NotImplementedError(f"dialect {self.name!r} uploads multipart to {self.files_path}")

    def upload_start_body(self, filename: str) -> dict[str, Any]:
        """The JSON body of a "resumable" upload's start call (the file's metadata)."""
        return {}

    def results_path(self, batch_id: str) -> str:
        raise NotImplementedError(f"dialect {self.name!r} has no results endpoint; read the output files")

    # ---- validation -----------------------------------------------------------------
    @classmethod
    def validation_rules(cls, limits: Limits | None = None) -> ValidationRules:
        """The rules a file must meet for this vendor, with optional tighter limits."""
        return ValidationRules(
            endpoints=cls.endpoints,
            limits=limits or cls.limits,
            mixed_endpoints=cls.mixed_endpoints,
            unique_custom_ids=cls.unique_custom_ids,
            mixed_models=cls.mixed_models,
            max_custom_id_chars=cls.max_custom_id_chars,
            model_endpoints=frozenset(e for e in cls.endpoints if cls.needs_line_model(e)),
            required_fields={e: f for e, f in cls.required_body_fields.items() if e in cls.endpoints},
            dialect=cls.name,
            model_meaning=cls.model_meaning,
        )

    @classmethod
    def needs_line_model(cls, endpoint: str) -> bool:
        """Whether every line to ``endpoint`` must name its model (``body.model``).

        A "job" dialect names one model on the job (from the lines or submit's ``model=``), so
        its lines may go without; a "line" dialect's vendor runs each line on its own model.

        :param endpoint: a url of the dialect.
        """
        return cls.model_placement == "line" and endpoint not in cls.model_optional_endpoints

    def check_staging(self, staging: Any) -> None:
        """Refuse, before anything is written, a run whose staging is not on the object store an
        "object_store" dialect's jobs read (the encoded input is written there, beside the shard).

        :param staging: the shard's (or the run's staging) path or URI.
        """
        if self.submission_mode != "object_store":
            return
        text = str(staging)
        scheme = text.split("://", 1)[0].lower() if "://" in text else "file"
        if scheme in self.object_store_schemes:
            return
        from airflow_batch_provider.exceptions import ConfigurationError

        wanted = " or ".join(f"{s}://" for s in self.object_store_schemes)
        raise ConfigurationError(
            f"dialect {self.name!r} runs jobs that read their input from object storage ({wanted}), "
            f"but the run's staging is {text!r}; set the build's staging_path (or the deployment's "
            f"[batch_provider] staging_root, AIRFLOW__BATCH_PROVIDER__STAGING_ROOT) to a {wanted} "
            "URI with its connection, e.g. s3://aws_default@bucket/batch-staging"
        )

    def job_problem(self, lines: int | None, size: int | None) -> str | None:
        """Why one batch of ``lines`` requests and ``size`` bytes cannot be created (a vendor's
        per-job minimum, say), or None; checked for every shard before any batch is created.

        :param lines: the shard's requests (None: unknown).
        :param size: the shard's bytes (None: unknown).
        """
        return None

    def check_connection(self, extra: Mapping[str, Any], conn_id: str) -> None:
        """Refuse a connection that lacks what this vendor requires on every request."""
        missing = [name for name in self.required_extras if not extra.get(name)]
        if missing:
            from airflow_batch_provider.exceptions import ConfigurationError

            raise ConfigurationError(
                f"connection {conn_id!r}: dialect {self.name!r} needs extra "
                f"{', '.join(repr(m) for m in missing)} on every request (the vendor answers 401 without it)"
            )

    def is_quota_error(self, status_code: int, body: Any) -> bool:
        """Whether an error answer means the account is out of quota (never worth retrying)."""
        if status_code not in (402, 429) or not isinstance(body, Mapping):
            return False
        error = body.get("error")
        if isinstance(error, Mapping):
            values = (error.get("code"), error.get("type"))
        else:
            values = (body.get("code"), body.get("type"))
        return any(isinstance(v, str) and v.lower() in self.quota_error_codes for v in values)

    def is_queue_full(self, status_code: int | None, body: Any) -> bool:
        """Whether a refused create says the enqueued-token queue is full (a code of
        ``batch_quota_error_codes``): waiting for earlier batches cures it, unlike an empty quota."""
        if not self.batch_quota_error_codes or not isinstance(body, Mapping):
            return False
        error = body.get("error")
        code = (error if isinstance(error, Mapping) else body).get("code")
        return isinstance(code, str) and code.lower() in self.batch_quota_error_codes

    def is_auth_error(self, status_code: int, body: Any) -> bool:
        """Whether an error answer other than 401/403 means the key was refused (none by default)."""
        return False

    def is_not_found(self, status_code: int, body: Any) -> bool:
        """Whether an error answer other than 404 means the batch named does not exist (a vendor
        refusing an id that cannot be one of its batches as invalid); none by default."""
        return False

    @classmethod
    def check_endpoint(cls, endpoint: str) -> None:
        if endpoint not in cls.endpoints:
            from airflow_batch_provider.exceptions import ConfigurationError

            raise ConfigurationError(
                f"endpoint {endpoint!r} is not supported by dialect {cls.name!r}; "
                f"supported: {', '.join(sorted(cls.endpoints))}"
            )

    @classmethod
    def check_completion_window(cls, window: str) -> None:
        if window not in cls.completion_windows:
            from airflow_batch_provider.exceptions import ConfigurationError

            raise ConfigurationError(
                f"completion_window {window!r} is not supported by dialect {cls.name!r}; "
                f"supported: {', '.join(cls.completion_windows)}"
            )

    # ---- request lines ----------------------------------------------------------------
    def unsupported(self, canonical: Mapping[str, Any]) -> str | None:
        """What this vendor cannot express in one canonical line, named with the vendor; None if
        nothing. Checked at build (the row is rejected with this reason) and at submit (a
        hand-made file fails before any upload), so nothing is dropped silently at the vendor.

        :param canonical: a canonical (OpenAI-shaped) line ``{custom_id, method, url, body}``.
        """
        return None

    def encode_line(self, canonical: dict[str, Any]) -> dict[str, Any] | bytes:
        """The vendor's upload line for one canonical line (a JSON object, or its bytes without
        the newline). Staging keeps the canonical line; only the uploaded copy is encoded, so
        request hashes and shard fingerprints stay vendor-neutral. Called only when
        ``encodes_lines``; the default is the line itself.

        :param canonical: a canonical line; it may be changed in place and returned.
        """
        return canonical

    # ---- files ----------------------------------------------------------------------
    def upload_form(self) -> dict[str, str]:
        """Form fields sent beside the file in ``POST files``."""
        return {"purpose": self.upload_purpose} if self.upload_purpose else {}

    def parse_file_id(self, raw: Mapping[str, Any]) -> str:
        file_id = raw.get("id") or raw.get("file_id")
        if not file_id:
            raise BatchApiResponseError("file upload answer has no id", body=dict(raw))
        # The id goes into later paths (get, delete) with the key: one no vendor issues is refused.
        problem = id_problem(str(file_id))
        if problem is not None:
            raise BatchApiResponseError(f"file upload answer: its id {problem}", body=dict(raw))
        return str(file_id)

    # ---- batches --------------------------------------------------------------------
    def create_batch_body(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None = None,
        name: str | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """The body of the create call.

        :param model: the shard's one model, for a dialect whose ``model_placement`` is "job"
            (ignored by "line" dialects: the model is on every line).
        """
        body: dict[str, Any] = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
        }
        if metadata:
            body["metadata"] = dict(metadata)
        return body

    def create_name(self, body: Mapping[str, Any]) -> str | None:
        """The batch name a create body carries (how a dialect without metadata finds it again)."""
        name = body.get("name")
        return name if isinstance(name, str) else None

    def inline_create_body(
        self, *, endpoint: str, completion_window: str, metadata: Mapping[str, str] | None, model: str | None
    ) -> dict[str, Any]:
        """The fields of an "inline" create body beside its requests (``inline_requests_key``)."""
        raise NotImplementedError(f"dialect {self.name!r} submits a file, not inline requests")

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
        """The create body of an "object_store" dialect: the job reads ``input_uri`` (the encoded
        shard) and writes its results under ``output_uri`` (a prefix ending in ``/``).

        :param input_uri: the encoded shard's plain URI (``s3://bucket/key``, no connection id).
        :param output_uri: the prefix the vendor writes under.
        :param name: the job's name (the shard's idempotency key), for vendors that name jobs.
        """
        raise NotImplementedError(f"dialect {self.name!r} does not submit through object storage")

    def output_table(self, batch: Batch) -> str | None:
        """The ``project.dataset.table`` an ended job wrote its answers to, for a dialect whose jobs
        write BigQuery (``bigquery_io``); None otherwise."""
        return None

    def results_prefix_of(self, batch: Batch) -> str | None:
        """The URI under which an "object_store" batch's result objects lie (None: none yet)."""
        return None

    def result_object_kind(self, relative: str) -> ResultObjectKind | None:
        """What the object at ``relative`` (its key below ``results_prefix_of``) holds, or None
        when it is not read ("object_store" results; found by listing, never by a guessed name).

        :param relative: the object's key relative to the prefix (``<job>/shard-00000.jsonl.out``).
        """
        return None

    def check_summary(self, batch: Batch, summary: Any, read: Mapping[str, int]) -> str | None:
        """Why a "summary" object's totals disagree with the lines read, or None when they agree
        (or it states none).

        :param summary: the summary object, parsed as JSON.
        :param read: result lines read, by source (``output``, ``error``).
        """
        return None

    def results_url_of(self, batch: Batch) -> str | None:
        """The URL of the batch's one results stream ("results_url" dialects), None until it has one."""
        return None

    def parse_batch(self, raw: Mapping[str, Any]) -> Batch:
        """Map the vendor's batch object to the normalised ``Batch``.

        Anything unreadable (not an object, no string id, a field of the wrong type or out of
        range, an unknown status) raises ``BatchApiResponseError`` (``UnknownBatchStatusError``
        for a status), never a TypeError or a pydantic error.
        """
        raw = batch_object(raw)
        batch_id = raw.get("id")
        if not batch_id:
            raise BatchApiResponseError("batch object has no id", body=dict(raw))
        if not isinstance(batch_id, str):
            raise BatchApiResponseError(
                f"batch object has an id that is not a string ({type(batch_id).__name__})", body=dict(raw)
            )
        data = dict(raw)
        data["state"] = BatchState.parse(raw.get("status"), batch_id=batch_id)
        data["raw"] = dict(raw)
        try:
            batch = Batch.model_validate(data)
        except ValueError as exc:
            # pydantic's ValidationError is a ValueError; the validators raise only ValueError.
            raise BatchApiResponseError(f"cannot read batch {batch_id}: {exc}", body=dict(raw)) from None
        return self.mark_quota_errors(batch)

    def mark_quota_errors(self, batch: Batch) -> Batch:
        """Mark the errors of a failed batch whose code says a quota refused it (``quota``)."""
        if self.batch_quota_error_codes and batch.state is BatchState.FAILED:
            for error in batch.errors:
                if isinstance(error.code, str) and error.code.lower() in self.batch_quota_error_codes:
                    error.quota = True
        return batch

    def list_params(self, limit: int | None = None) -> dict[str, Any]:
        return {"limit": limit or self.list_page_size}

    def filter_params(self, metadata: Mapping[str, str], *, since: datetime | None = None) -> dict[str, Any]:
        """Query parameters by which the vendor's listing keeps only batches tagged ``metadata``
        (the orphan lookup); {} where the listing has no such filter. The caller still checks the
        tags of every batch listed, so a server that ignores the filter costs pages, not accuracy.

        :param since: no batch looked for was created before this moment by this machine's clock
            (the shard's recorded intent): a listing that filters by creation time may use it,
            widened by the vendor's clock skew; the others ignore it.
        """
        return {}

    def listed_id(self, item: Any) -> str | None:
        """The batch id a listed item names, when it names one as a non-empty string."""
        batch_id = item.get(self.listed_id_key) if isinstance(item, dict) else None
        return batch_id if isinstance(batch_id, str) and batch_id else None

    def listed_batch(self, item: Mapping[str, Any], known: Mapping[str, Batch] | None) -> Batch:
        """A batch object of a listing page: the ``known`` batch of its id when the vendor's object
        is unchanged (a poller listing the same thousands of batches every cycle then builds no
        new ``Batch`` for them), else a fresh parse (``BatchApiResponseError`` if unreadable).

        :param known: batches parsed before, by id (None: parse every item).
        """
        if known:
            batch_id = self.listed_id(item)
            previous = known.get(batch_id) if batch_id is not None else None
            # ``raw`` is the object as the vendor sent it: equal objects parse to equal batches.
            if previous is not None and previous.raw == item:
                return previous
        return self.parse_batch(item)

    def list_envelope(self, raw: Any, params: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any] | None]:
        """A listing page's items (unparsed) and the params of the next page (None: the last).

        A page whose envelope is unreadable (not an object, ``data`` not a list, ``has_more``
        not a boolean, a cursor that is not a string) raises ``BatchApiResponseError``: nothing
        on it can be trusted. Its items are judged one by one (``parse_list_items``).
        """
        raw = page_object(raw)
        # The end marker is ``has_more``; a page shorter than the limit asked for is not the end
        # (servers clamp ``limit``).
        data = page_items(raw, "data")
        has_more = raw.get("has_more")
        if has_more is not None and not isinstance(has_more, bool):
            raise BatchApiResponseError(f"{LIST_WHAT}: has_more is {type(has_more).__name__}, not a boolean")
        last = raw.get("last_id")
        if last is not None and not isinstance(last, str):
            raise BatchApiResponseError(f"{LIST_WHAT}: last_id is {type(last).__name__}, not a string")
        if not last and data:
            last = self.listed_id(data[-1])
        next_params = {**params, self.list_cursor_param: last} if has_more and last else None
        return data, next_params

    def parse_list_items(
        self, items: Sequence[Any], known: Mapping[str, Batch] | None = None
    ) -> tuple[list[Batch], list[Unreadable]]:
        """Parse listed items one by one: an item that does not parse fails only itself.

        :param known: batches parsed before, by id, reused for unchanged objects (``listed_batch``).
        """
        batches: list[Batch] = []
        unreadable: list[Unreadable] = []
        for item in items:
            try:
                batches.append(self.listed_batch(item, known))
            except BatchApiResponseError as exc:
                unreadable.append(Unreadable(self.listed_id(item), exc))
        return batches, unreadable

    def parse_list_page(
        self, raw: Mapping[str, Any], params: Mapping[str, Any], known: Mapping[str, Batch] | None = None
    ) -> ListPage:
        """One page of the batch listing: its batches, the items that do not parse, and the params
        of the next page (None: the last).

        :param known: batches parsed before, by id, reused for unchanged objects (``listed_batch``).
        """
        items, next_params = self.list_envelope(raw, params)
        batches, unreadable = self.parse_list_items(items, known)
        return ListPage(batches=batches, next_params=next_params, unreadable=unreadable)

    def metadata_of(self, batch: Batch) -> dict[str, str]:
        """The tags the provider set on a batch (used to find orphans by run identity)."""
        return batch.metadata

    def stored_metadata(self, metadata: Mapping[str, str] | None) -> dict[str, str]:
        """The pairs of ``metadata`` as the vendor keeps them on a batch: what a create sends, and
        what ``metadata_of`` reads back, so a lookup compares like with like (Vertex AI cuts and
        drops what a label cannot hold). Default: as given."""
        return dict(metadata or {})

    def tags_agree(self, batch: Batch, metadata: Mapping[str, str]) -> bool:
        """Whether the batch's tags agree with ``metadata`` as this dialect stores it: a pair the
        batch carries with another value disagrees; a pair it does not carry (a vendor that keeps
        no tags, a pair that did not fit) is not compared.

        :param metadata: the pairs to compare (the submit passes the shard's fingerprint).
        """
        tags = self.metadata_of(batch)
        return all(tags.get(k, v) == v for k, v in self.stored_metadata(metadata).items())

    # ---- results --------------------------------------------------------------------
    def parse_result_line(self, raw: Mapping[str, Any], source: ResultSource) -> ResultLine:
        """Normalise one line of an output or error file (OpenAI shape).

        ``{id, custom_id, response: {status_code, request_id, body} | null, error: {...} | null}``;
        a line is a success only with no error and a 2xx response.
        """
        # This runs once per result line (millions per merge), so it checks plain dicts (what a
        # JSON parser yields) rather than going through the Mapping ABC.
        custom_id = raw.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchApiResponseError("result line has no custom_id", body=dict(raw))
        response = raw.get("response")
        status_code: Any = None
        body: Any = None
        request_id: Any = None
        if isinstance(response, dict):
            status_code = response.get("status_code")
            body = response.get("body")
            if isinstance(body, str):
                body = json_text_body(body)
            request_id = response.get("request_id")
            if isinstance(status_code, str) and status_code.isdigit():
                status_code = int(status_code)
            elif not isinstance(status_code, int) or isinstance(status_code, bool):
                status_code = None
        raw_error = raw.get("error")
        error = (
            None
            if raw_error is None and status_code is not None and 200 <= status_code < 300
            else self.parse_line_error(raw_error, status_code=status_code, body=body)
        )
        ok = error is None and status_code is not None and 200 <= status_code < 300
        if not ok and error is None:
            error = LineError(code="unknown_error", message=f"line failed with status {status_code}")
        return ResultLine(
            custom_id=custom_id,
            ok=ok,
            status_code=status_code,
            body=body if isinstance(body, dict) else None,
            error=error,
            request_id=str_or_none(request_id),
            line_id=str_or_none(raw.get("id")),
            source=source,
        )

    def parse_line_error(
        self, raw_error: Any, *, status_code: Any = None, body: Any = None
    ) -> LineError | None:
        """The normalised error of a line, from its ``error`` field or a non-2xx response body."""
        if isinstance(raw_error, Mapping):
            return LineError(
                code=str_or_none(raw_error.get("code")),
                message=str_or_none(raw_error.get("message")),
                param=str_or_none(raw_error.get("param")),
                type=str_or_none(raw_error.get("type")),
            )
        if isinstance(raw_error, str) and raw_error:
            return LineError(code="error", message=raw_error)
        if isinstance(status_code, int) and not 200 <= status_code < 300:
            inner = body.get("error") if isinstance(body, Mapping) else None
            if isinstance(inner, Mapping):
                return LineError(
                    code=str_or_none(inner.get("code")) or f"http_{status_code}",
                    message=str_or_none(inner.get("message")),
                    param=str_or_none(inner.get("param")),
                    type=str_or_none(inner.get("type")),
                )
            return LineError(code=f"http_{status_code}", message=str_or_none(inner) or None)
        return None

    def results_params(self, limit: int | None = None) -> dict[str, Any]:
        raise NotImplementedError(f"dialect {self.name!r} has no results endpoint")

    def parse_results_page(
        self, raw: Any, params: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> ResultsPage:
        """One page of the results endpoint; ``headers`` are the response's (some vendors page there)."""
        raise NotImplementedError(f"dialect {self.name!r} has no results endpoint")

    def __repr__(self) -> str:
        return f"<Dialect {self.name}>"


LIST_WHAT = "listing batches"


def _preview(raw: Any) -> str:
    """A short text of an unreadable answer for the error (the whole of a big page is noise)."""
    return repr(raw)[:500]


def batch_object(raw: Any) -> Mapping[str, Any]:
    """``raw`` if it is a JSON object, else a ``BatchApiResponseError`` (a batch is an object)."""
    if not isinstance(raw, Mapping):
        raise BatchApiResponseError(
            f"batch object is {type(raw).__name__}, not a JSON object", body=_preview(raw)
        )
    return raw


def page_object(raw: Any) -> Mapping[str, Any]:
    """A listing page that is a JSON object, else a ``BatchApiResponseError``."""
    if not isinstance(raw, Mapping):
        raise BatchApiResponseError(f"{LIST_WHAT}: the page is {type(raw).__name__}, not a JSON object")
    return raw


def page_items(raw: Mapping[str, Any], *keys: str) -> list[Any]:
    """The item list of a listing page under the first of ``keys`` present (absent or null: none)."""
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, list):
            raise BatchApiResponseError(f"{LIST_WHAT}: {key} is {type(value).__name__}, not a list")
        if value:
            return value
    return []


def json_text_body(text: str) -> Any:
    """A response body sent as JSON text (some OpenAI-compatible servers write ``"body": "{...}"``)
    as the object it holds; text that is not a JSON object is returned as it is, so the line
    still counts as having no body to read (the merge records ``invalid_output``).

    The text is bounded by the result line it came in (``MAX_RESULT_LINE_BYTES``); longer text
    (possible only in a line built in memory) is not decoded.

    :param text: the ``response.body`` string.
    """
    if len(text) > MAX_RESULT_LINE_BYTES or not text.lstrip().startswith("{"):
        return text
    try:
        decoded = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    return decoded if isinstance(decoded, dict) else text


def str_or_none(value: Any) -> str | None:
    """``value`` as text, None staying None (vendors send ids and codes as numbers or strings)."""
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)
