"""Settings of the local batch server (one pydantic model, filled from the CLI or from tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from airflow_batch_provider.dialects import DIALECTS, get_dialect
from airflow_batch_provider.limits import Limits

# Fault kinds a request can ask for with the X-Batch-Fault header.
REQUEST_FAULTS = ("429", "500", "503", "slow", "drop", "quota")
# Fault kinds that change a batch when sent on POST /v1/batches.
# "token_limit" refuses the create, "token_limit_failed" fails the new batch with that code (the two
# ways Azure reports a full enqueued token quota).
BATCH_FAULTS = ("fail_validation", "expire", "stall", "token_limit", "token_limit_failed")
# Largest Retry-After (seconds) and slow-call delay an admin may set.
MAX_RETRY_AFTER = 86_400.0
MAX_SLOW_SECONDS = 600.0


class FaultConfig(BaseModel):
    """Faults the server injects; every rate is a fraction in [0, 1] applied deterministically.

    A rate ``r`` fires on exactly ``ceil(n * r)`` of the first ``n`` eligible calls (the
    first one included), so a test asking for 0.5 gets every other call, never a streak.

    :param rate_429: fraction of API calls answering 429 with Retry-After.
    :param rate_500: fraction of API calls answering 500.
    :param rate_503: fraction of API calls answering 503.
    :param retry_after: seconds sent in Retry-After on an injected 429/503 (at most a day).
    :param slow_rate: fraction of API calls delayed by ``slow_seconds``.
    :param slow_seconds: delay of a slow call (real seconds, not scaled; at most 600).
    :param drop_rate: fraction of file downloads whose connection drops half way.
    :param line_failure_rate: fraction of batch lines that fail with a 500 answer.
    :param fail_validation: every new batch fails validation.
    :param expire_batches: every new batch expires as soon as it starts running.
    :param stall_batches: every new batch stalls (stays in progress) until resumed.
    """

    # Finite values only, and bounded waits: an admin call must not be able to make every
    # later request fail (Retry-After of 1e308 overflows) or hang for a day.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rate_429: float = Field(0.0, ge=0, le=1)
    rate_500: float = Field(0.0, ge=0, le=1)
    rate_503: float = Field(0.0, ge=0, le=1)
    retry_after: float = Field(1.0, ge=0, le=MAX_RETRY_AFTER)
    slow_rate: float = Field(0.0, ge=0, le=1)
    slow_seconds: float = Field(0.5, ge=0, le=MAX_SLOW_SECONDS)
    drop_rate: float = Field(0.0, ge=0, le=1)
    line_failure_rate: float = Field(0.0, ge=0, le=1)
    fail_validation: bool = False
    expire_batches: bool = False
    stall_batches: bool = False


class ServerConfig(BaseModel):
    """Everything the local batch server needs to start.

    Durations named ``*_seconds`` are simulated seconds: the server waits
    ``seconds * time_scale`` real seconds, and the completion window (24h) is scaled
    the same way, so ``time_scale=0.001`` runs a day-long window in 86 seconds.

    :param host: interface to bind.
    :param allowed_hosts: names, besides ``localhost``, ``127.0.0.1``, ``[::1]`` and ``host``, that
        requests may carry in their ``Host`` header (any port); ``*`` allows every name. Other
        names are answered 421 on every route (the defence against DNS rebinding).
    :param port: port to bind (0 picks a free one).
    :param data_dir: directory holding the SQLite metadata and the files.
    :param backend: what answers each line: ``echo`` (offline, deterministic) or ``upstream``.
    :param dialect: vendor wire shape to speak (openai, doubleword, zerogpu, xai, mistral, anthropic).
    :param api_key: when set, every /v1 call must present it (in the dialect's auth header).
    :param bearer_token: a token accepted as ``Authorization: Bearer`` beside the key, by modes
        whose vendor also takes an identity provider's token (azure: Microsoft Entra ID).
    :param time_scale: real seconds per simulated second of the lifecycle.
    :param validate_seconds: simulated time a batch spends validating.
    :param finalize_seconds: simulated time a batch spends finalizing.
    :param line_seconds: simulated time each line takes (echo answers instantly otherwise).
    :param chunk_size: lines processed between progress checkpoints.
    :param max_lines: limit on lines per file (default: the dialect's).
    :param max_file_bytes: limit on file size (default: the dialect's).
    :param max_line_bytes: limit on one line (default: the dialect's).
    :param max_storage_bytes: cap on the bytes kept under ``data_dir`` (files and work files),
        reserved as they are written (None: no cap). An upload that would pass it is refused
        with a 507 (concurrent uploads included), as is a new batch when the store is full; a
        running batch whose results would pass it fails with ``errors`` code
        ``insufficient_storage`` and its partial results are discarded.
    :param max_upload_bytes: limit on one upload, answered 413 (default: the dialect's, if any).
    :param max_reported_errors: most validation problems listed on a failed batch.
    :param embedding_dim: dimension of echo embeddings when the request names none.
    :param upstream_url: base URL (with /v1) of the OpenAI-compatible endpoint for ``upstream``.
    :param upstream_api_key_env: environment variable holding the upstream's API key.
    :param upstream_concurrency: most lines in flight to the upstream at once.
    :param upstream_max_retries: retries of one line on 429/5xx/transport errors.
    :param upstream_timeout: timeout of one upstream call in seconds.
    :param upstream_max_backoff: cap on one retry wait in real seconds.
    :param max_enqueued_tokens: the enqueued-token limit per model (None: no limit): the input
        tokens of the live batches (validating, in progress, finalizing) naming one model may not
        pass it (see :mod:`airflow_batch_provider.server.queue`).
    :param enqueued_limit_form: how a batch over that limit is answered: ``refuse`` (the create
        is refused, Azure's form) or ``fail`` (created, then failed with ``token_limit_exceeded``,
        OpenAI's form); default: the mode's vendor's (``refuse`` for azure, else ``fail``).
    :param faults: faults injected from the start.
    :param gcs_endpoint_url: the Cloud Storage JSON API a mode whose jobs read and write gs://
        uses (vertex: the test suite's emulator), without credentials.
    :param bigquery_endpoint_url: the BigQuery REST endpoint a mode whose jobs read and write
        ``bq://`` tables uses (vertex: the test suite's bqemulator), with anonymous credentials.
    :param s3_endpoint_url: the S3 endpoint a mode whose jobs read and write S3 uses (bedrock;
        None: AWS's own), with boto3's default credentials.
    """

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    allowed_hosts: list[str] = Field(default_factory=list)
    port: int = 8000
    data_dir: Path
    backend: Literal["echo", "upstream"] = "echo"
    dialect: str = "openai"
    api_key: str | None = None
    bearer_token: str | None = None
    time_scale: float = Field(1.0, gt=0)
    validate_seconds: float = Field(2.0, ge=0)
    finalize_seconds: float = Field(2.0, ge=0)
    line_seconds: float = Field(0.0, ge=0)
    chunk_size: int = Field(256, ge=1)
    max_lines: int | None = Field(None, ge=1)
    max_file_bytes: int | None = Field(None, ge=1)
    max_line_bytes: int | None = Field(None, ge=1)
    max_storage_bytes: int | None = Field(None, ge=1)
    max_upload_bytes: int | None = Field(None, ge=1)
    max_reported_errors: int = Field(1000, ge=1)
    embedding_dim: int = Field(16, ge=1, le=8192)
    upstream_url: str | None = None
    upstream_api_key_env: str | None = None
    upstream_concurrency: int = Field(8, ge=1)
    upstream_max_retries: int = Field(3, ge=0)
    upstream_timeout: float = Field(60.0, gt=0)
    upstream_max_backoff: float = Field(5.0, ge=0)
    max_enqueued_tokens: int | None = Field(None, ge=1)
    enqueued_limit_form: Literal["refuse", "fail"] | None = None
    faults: FaultConfig = Field(default_factory=FaultConfig)
    gcs_endpoint_url: str | None = None
    bigquery_endpoint_url: str | None = None
    s3_endpoint_url: str | None = None

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        # A port given with a name is dropped (any port is served); junk is refused here, at start.
        from airflow_batch_provider.server.hosts import ANY_HOST, host_of

        cleaned = []
        for name in names:
            host = ANY_HOST if name.strip() == ANY_HOST else host_of(name)
            if not host or any(c.isspace() or c in "/@?#" for c in host):
                raise ValueError(f"allowed host {name!r} is not a host name (use NAME, an IP, or '*')")
            cleaned.append(host)
        return cleaned

    def model_post_init(self, __context: object) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {self.dialect!r}; choose one of {', '.join(sorted(DIALECTS))}")
        if self.backend == "upstream" and not self.upstream_url:
            raise ValueError(
                "backend 'upstream' needs upstream_url (the OpenAI-compatible base URL with /v1)"
            )

    def limits(self) -> Limits:
        """The dialect's limits with this server's overrides (which may be looser or tighter)."""
        base = get_dialect(self.dialect).limits
        return Limits(
            max_lines=self.max_lines or base.max_lines,
            max_file_bytes=self.max_file_bytes or base.max_file_bytes,
            max_line_bytes=self.max_line_bytes or base.max_line_bytes,
            max_upload_bytes=self.max_upload_bytes or base.max_upload_bytes,
        )

    def limit_form(self) -> Literal["refuse", "fail"]:
        """How a batch over the enqueued-token limit is answered (the setting, else the vendor's)."""
        if self.enqueued_limit_form is not None:
            return self.enqueued_limit_form
        return "refuse" if self.dialect == "azure" else "fail"

    def scaled(self, seconds: float) -> float:
        """Real seconds for ``seconds`` of simulated time."""
        return seconds * self.time_scale
