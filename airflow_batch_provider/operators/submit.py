"""SubmitBatchOperator: upload batch input files and create one batch per shard, idempotently.

The input is a build manifest (its XCom, or a path to ``manifest.json`` or its directory),
one shard of it (``shard=``), or any JSONL file a user made by hand (validated with the
dialect's rules first). Each shard is uploaded and turned into a batch whose metadata
carries the run identity, the shard fingerprint and an idempotency key; the submission state
store (Airflow's task state store where there is one, else a state file beside the input)
records the intent before the create and the batch id after it, so a retried task re-attaches
instead of paying twice (see :mod:`airflow_batch_provider.submission`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import IO, TYPE_CHECKING, Any, Literal

import orjson
from airflow.sdk import BaseOperator, Context
from airflow.sdk.configuration import conf

from airflow_batch_provider.budget import check_budget, check_caps, estimate_files
from airflow_batch_provider.constants import DEFAULT_CONN_ID
from airflow_batch_provider.enqueued import (
    check_ledger_dialect,
    check_shard_fits,
    queue_tag,
    read_ledger,
)
from airflow_batch_provider.estimate import TokenCounter, describe_estimate, resolve_counter
from airflow_batch_provider.exceptions import (
    AmbiguousOrphanError,
    BatchApiError,
    BatchApiNotFoundError,
    BatchFailedError,
    ConfigurationError,
    EnqueuedTokenTimeoutError,
    JsonlValidationError,
    StaleSubmissionStateError,
)
from airflow_batch_provider.jsonl import LineValidator, Problem, iter_objects, iter_raw_lines
from airflow_batch_provider.links import batch_page_links, push_batch_ids
from airflow_batch_provider.models import Batch, BatchState, Manifest, to_utc
from airflow_batch_provider.outcome import nothing_sent
from airflow_batch_provider.prices import PriceBook, spend_settings
from airflow_batch_provider.staging import (
    atomic_writer,
    manifest_path,
    open_read,
    read_manifest,
    resolve_path,
    staging_dir_of,
)
from airflow_batch_provider.submission import (
    FINGERPRINT_NAME,
    KEY_NAME,
    STATE_DIR,
    STATE_STORE_CHOICES,
    RunIdentity,
    StateStoreChoice,
    SubmissionStateStore,
    SubmitState,
    batch_metadata,
    choose_state_store,
    effective_fingerprint,
    generation_name,
    now_utc,
)
from airflow_batch_provider.triggers.batch import BatchTrigger
from airflow_batch_provider.triggers.queue import QueueRoomTrigger
from airflow_batch_provider.upload_lines import ShardEncoder, needs_pass, write_inline_body
from airflow_batch_provider.waiting import (
    PartialPolicy,
    apply_outcome_policy,
    cancel_batches,
    check_partial_policy,
    deadline_from,
    terminal_event_now,
    wait_batches,
)

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.dialects.base import Dialect
    from airflow_batch_provider.hooks.batch import BatchApiHook

StalePolicy = Literal["cancel_and_resubmit", "fail"]
STALE_POLICIES = ("cancel_and_resubmit", "fail")
# A batch in these states will not give answers for the shard: a retry replaces it rather than
# re-attaching (cancelling counts: a killed or timed-out task's batch is on its way out).
_BAD_END = frozenset({BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLING, BatchState.CANCELLED})
_PROBLEMS_SHOWN = 20
#: How long a queue-aware submit waits for room when neither ``queue_timeout`` nor ``timeout`` is set.
DEFAULT_QUEUE_TIMEOUT = 86_400.0


@dataclass(frozen=True)
class ShardInput:
    """One file to submit: where it is, what it holds and how to recognise it again."""

    index: int
    path: ObjectStoragePath
    fingerprint: str
    endpoint: str
    lines: int | None = None
    # The build's estimate of the shard's input tokens (the queue-aware submit's ledger entry).
    input_tokens: int | None = None
    # A shard the build wrote as a BigQuery table (``requests_table``): its bq:// URI, the
    # dataset its prediction table goes to, the job's model and the body keys every row holds.
    table: str | None = None
    output_dataset: str | None = None
    model: str | None = None
    body_keys: tuple[str, ...] = ()
    # The build's BigQuery connection and template digest: the table's fingerprint is checked
    # again before a create (another writer may have replaced the table since).
    conn_id: str | None = None
    template: str | None = None


class SubmitBatchOperator(BaseOperator):
    """Upload batch input files and create one batch per shard; optionally wait for them.

    Returns (XCom) ``{"batch_ids", "batches": [{shard, batch_id, input_file_id, fingerprint,
    endpoint}], "submitted_at", "manifest_path"}``; with ``wait_for_completion`` the wait's
    outcome is added under ``"outcome"``.

    :param source: what to submit (templated): a build XCom (a mapping holding
        ``manifest_path`` or ``staging_path``), one shard of it (``{index, uri, fingerprint,
        ...}``, for ``.expand()`` over the build's ``shards``), a path to ``manifest.json`` or
        its staging directory, or a path to any batch JSONL file.
    :param batch_conn_id: the ``batch_api`` connection (templated).
    :param dialect: dialect name overriding the connection's.
    :param shard: submit only this shard index of the manifest (for mapped tasks).
    :param endpoint: the batch endpoint (templated); default: the manifest's, else the file's url.
    :param completion_window: the vendor completion window.
    :param metadata: extra metadata pairs for every batch (templated).
    :param model: replace ``body.model`` on every line while uploading (templated). For a
        dialect whose model_placement is "job", this or the lines' one model is
        named on the create call; a file naming two models, or none, fails before any upload.
    :param request_defaults: body fields given to every line that lacks them, over the
        connection extra ``request_defaults`` (templated); e.g. ``{"max_tokens": 1024}`` for a
        vendor that requires ``max_tokens``. A line that still lacks what its vendor requires
        fails the submit before anything is sent, naming the line.
    :param state_store: where each shard's intent and batch id live between tries: ``auto``
        (Airflow's task state store when the task has one, Airflow 3.3+; else files),
        ``task_state_store`` (fail without one) or ``file`` (``submit-state/`` files, see ``state_path``).
    :param state_path: where ``submit-state/`` lives in file mode (templated); default: beside the input.
    :param on_stale_state: a shard changed since an earlier try submitted it:
        ``cancel_and_resubmit`` (cancel the old batch, submit the new file) or ``fail``.
    :param validate: check files with the dialect's rules before upload; default: hand-made
        JSONL only (build shards were validated when written).
    :param resubmit_failed: an earlier try's batch that ended failed, expired or cancelled is
        replaced by a new one instead of re-attached.
    :param wait_for_completion: also wait until the batches finish.
    :param deferrable: wait in the triggerer; default ``[operators] default_deferrable``.
    :param timeout: seconds after submission to stop waiting with a ``timeout`` outcome.
    :param poll_interval: seconds between status reads while waiting.
    :param max_poll_interval: longest wait between reads once nothing changes.
    :param max_consecutive_errors: transient API errors tolerated in a row while waiting.
    :param on_partial_failure: ``succeed`` or ``fail`` when lines failed in completed batches.
    :param cancel_on_timeout: cancel unfinished batches when the wait times out.
    :param cancel_on_kill: cancel the batches when the task is killed.
    :param max_estimated_cost: refuse, before any upload, a run whose estimated worst-case cost
        (USD) is over this. The estimate is the build manifest's for the whole run (all its
        shards, also when this task submits one shard of a mapped run); a file without one is
        estimated here with the connection's ``prices`` and ``token_counter``. With an unknown
        price the run is refused unless ``max_input_tokens`` is also given.
    :param max_input_tokens: refuse, before any upload, a run whose estimated input tokens are over this.
    :param max_enqueued_tokens: queue-aware submission: the most estimated input tokens this
        connection may have enqueued at the vendor for the run's model at once (OpenAI's and
        Azure's enqueued-token limit); default: the connection extra ``max_enqueued_tokens``, else
        no limit. Shards are created in order while the ledger (the connection's enqueued batches
        tagged ``airflow_enqueued``, see :mod:`airflow_batch_provider.enqueued`) plus the next
        shard stays under it; then the task waits without a worker slot (deferred to
        ``QueueRoomTrigger``, or polling on the worker when not deferrable) until earlier
        batches finish, and goes on where it stopped. It also waits until its new batches have
        left ``validating``: a batch the vendor failed for its queue limit
        (``token_limit_exceeded``), or a create it refused for it, is created again after
        waiting, never reported as failed rows. A shard whose estimate alone passes the cap
        fails before any upload (it could never fit).
    :param queue_timeout: seconds, from the first try of the submit, that a queue-aware submit
        may wait for room before failing with ``EnqueuedTokenTimeoutError``; default ``timeout``,
        else 24 hours.

    **A crash between create and recording the batch id.** The intent (with its time and, for
    a vendor taking requests inline, its request count) is durable before every create, and
    the id after it. A retry that finds an intent without an id looks for the batch before
    creating one. Where batches carry tags it adopts the newest batch tagged with the shard's
    idempotency key and fingerprint. Where they carry none and the listing cannot filter (a
    dialect whose ``orphan_lookup`` is "time_and_count"), it lists the batches created since the intent
    (allowing 60 s of clock skew) with exactly the intent's request count, not taken by another
    shard of this try: one such batch is adopted; none means the create never happened and the
    shard is submitted; several raise ``AmbiguousOrphanError`` naming them, and nothing is
    created or guessed. (A create that fails ambiguously, a 5xx or a dropped answer, is looked
    for the same way at once.) Not guaranteed there: a batch of another task or run with the
    same request count created in that window, while this one's create was lost, is
    indistinguishable and would be adopted. When several are named, find the one holding this
    shard's custom_ids (its results, or the vendor's console), cancel the others, and record
    its id in the shard's state (or delete the state to submit again, accepting a possible
    duplicate).
    """

    template_fields: Sequence[str] = (
        "source",
        "batch_conn_id",
        "endpoint",
        "metadata",
        "model",
        "request_defaults",
        "state_path",
    )
    template_fields_renderers = {"metadata": "json", "request_defaults": "json"}
    ui_color = "#dbe9f6"
    # "Batch 1".. "Batch 4": each batch's page at the vendor or on the local server (see links.py).
    operator_extra_links = batch_page_links()

    def __init__(
        self,
        *,
        source: Any,
        batch_conn_id: str = DEFAULT_CONN_ID,
        dialect: str | None = None,
        shard: int | None = None,
        endpoint: str | None = None,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        model: str | None = None,
        request_defaults: Mapping[str, Any] | None = None,
        state_store: StateStoreChoice = "auto",
        state_path: str | None = None,
        on_stale_state: StalePolicy = "cancel_and_resubmit",
        validate: bool | None = None,
        resubmit_failed: bool = True,
        wait_for_completion: bool = False,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        timeout: float | timedelta | None = None,
        poll_interval: float = 60.0,
        max_poll_interval: float = 600.0,
        max_consecutive_errors: int = 5,
        on_partial_failure: PartialPolicy = "succeed",
        cancel_on_timeout: bool = False,
        cancel_on_kill: bool = True,
        max_estimated_cost: float | None = None,
        max_input_tokens: int | None = None,
        max_enqueued_tokens: int | None = None,
        queue_timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_caps(max_estimated_cost, max_input_tokens)
        self.max_estimated_cost = max_estimated_cost
        self.max_input_tokens = max_input_tokens
        if max_enqueued_tokens is not None and max_enqueued_tokens < 1:
            raise ConfigurationError(f"max_enqueued_tokens must be at least 1, got {max_enqueued_tokens}")
        self.max_enqueued_tokens = max_enqueued_tokens
        self.queue_timeout = (
            queue_timeout.total_seconds() if isinstance(queue_timeout, timedelta) else queue_timeout
        )
        # When this submit began waiting for queue room (ISO-8601), carried across deferrals.
        self._queue_started: str | None = None
        if on_stale_state not in STALE_POLICIES:
            raise ConfigurationError(
                f"on_stale_state must be one of {STALE_POLICIES}, got {on_stale_state!r}"
            )
        if state_store not in STATE_STORE_CHOICES:
            raise ConfigurationError(f"state_store must be one of {STATE_STORE_CHOICES}, got {state_store!r}")
        check_partial_policy(on_partial_failure)
        self.source = source
        self.batch_conn_id = batch_conn_id
        self.dialect = dialect
        self.shard = shard
        self.endpoint = endpoint
        self.completion_window = completion_window
        self.metadata = metadata
        self.model = model
        self.request_defaults = request_defaults
        self.state_store = state_store
        self.state_path = state_path
        self.on_stale_state = on_stale_state
        self.validate = validate
        self.resubmit_failed = resubmit_failed
        self.wait_for_completion = wait_for_completion
        self.deferrable = deferrable
        self.wait_timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        self.max_consecutive_errors = max_consecutive_errors
        self.on_partial_failure = on_partial_failure
        self.cancel_on_timeout = cancel_on_timeout
        self.cancel_on_kill = cancel_on_kill
        self._batch_ids: list[str] = []
        self._line_defaults: dict[str, Any] = {}
        # This try's XCom (with the outcome once waited), for lineage; None until it submitted.
        self.submission: dict[str, Any] | None = None

    def hook(self) -> BatchApiHook:
        from airflow_batch_provider.hooks.batch import BatchApiHook

        return BatchApiHook(self.batch_conn_id, dialect=self.dialect)

    # ---- execution ---------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any]:
        hook = self.hook()
        dialect = hook.dialect
        dialect.check_completion_window(self.completion_window)
        # Checked with each hand-made line as it will be sent (_unsupported).
        self._line_defaults = self._defaults(hook)
        shards, state_dir, manifest_file = self._plan(dialect)
        if not shards:
            return self._nothing_to_send(context, manifest_file)
        for shard in shards:
            if shard.table is not None:
                self._check_table_shard(dialect, shard)
                continue
            # A job that reads object storage reads it beside the shard: refused before any write.
            dialect.check_staging(shard.path)
            # A vendor's per-job bounds (Bedrock's fewest records): refused before any create.
            problem = dialect.job_problem(shard.lines, None)
            if problem is not None:
                raise ConfigurationError(f"shard {shard.index} ({shard.path}): {problem}")
        self._check_tables_unchanged(shards)
        estimate = None
        if self.max_estimated_cost is not None or self.max_input_tokens is not None:
            # Before any upload or create: a refused run costs nothing.
            estimate = self._run_estimate(hook, dialect, shards, manifest_file)
            check_budget(
                estimate, max_estimated_cost=self.max_estimated_cost, max_input_tokens=self.max_input_tokens
            )
            self.log.info("Within budget: %s", describe_estimate(estimate))
        identity = RunIdentity.from_context(context)
        # Chosen once per try; both stores keep the same intent -> batch id protocol.
        store = choose_state_store(context, self.state_store, state_dir)
        self.log.info("Submission state (intent and batch id per shard) is kept in %s", store.where)
        records: list[dict[str, Any]] = []
        submitted: list[datetime] = []
        cap = self._queue_cap(hook)
        if cap is None:
            states = []
            for shard in shards:
                states.append(self.submit_shard(hook, dialect, store, identity, shard))
                # Known before the next shard's create: an ambiguous create never adopts these.
                self._batch_ids.append(str(states[-1].batch_id))
        else:
            states = self._submit_queued(context, hook, dialect, store, identity, shards, manifest_file, cap)
        for shard, state in zip(shards, states, strict=True):
            records.append(
                {
                    "shard": shard.index,
                    "batch_id": state.batch_id,
                    "input_file_id": state.input_file_id,
                    "fingerprint": state.fingerprint,
                    "endpoint": state.endpoint,
                }
            )
            submitted.append(state.created_at or state.intent_at or now_utc())
        submission: dict[str, Any] = {
            "batch_ids": list(self._batch_ids),
            "batches": records,
            # The earliest create: a retry keeps the clock its first try started.
            "submitted_at": min(submitted).isoformat(),
            "manifest_path": str(manifest_file) if manifest_file is not None else None,
        }
        if estimate is not None:
            submission["estimate"] = estimate
        self.log.info("Submitted %d batch(es): %s", len(records), ", ".join(self._batch_ids))
        push_batch_ids(context, self._batch_ids)
        self.submission = submission
        if not self.wait_for_completion:
            return submission
        # The ids reach XCom before the wait, so a killed or deferred task never loses them.
        context["ti"].xcom_push(key="return_value", value=submission)
        done = terminal_event_now(hook, self._batch_ids, log=self.log) if self.deferrable else None
        if done is not None:
            return self.execute_complete(context, done, submission=submission)
        if self.deferrable:
            self.defer(
                trigger=BatchTrigger.for_task(
                    self, self._batch_ids, submitted_at=submission["submitted_at"], timeout=self.wait_timeout
                ),
                method_name="execute_complete",
                kwargs={"submission": submission},
            )
        event = wait_batches(
            hook,
            self._batch_ids,
            deadline=deadline_from(submission["submitted_at"], self.wait_timeout),
            submitted_at=to_utc(submission["submitted_at"]),
            poll_interval=self.poll_interval,
            max_poll_interval=self.max_poll_interval,
            max_consecutive_errors=self.max_consecutive_errors,
            log=self.log,
        )
        return self.execute_complete(context, event, submission=submission)

    def _nothing_to_send(self, context: Context, manifest_file: ObjectStoragePath | None) -> dict[str, Any]:
        """The XCom of a run whose build left no line to send: no upload, no batch, success."""
        manifest = read_manifest(manifest_file) if manifest_file is not None else None
        self.log.info(
            "Nothing to submit: the build wrote no line (%d row(s) unchanged, %d rejected); "
            "no file uploaded, no batch created",
            manifest.rows_unchanged if manifest else 0,
            manifest.rows_rejected if manifest else 0,
        )
        push_batch_ids(context, [])
        self.submission = {
            "batch_ids": [],
            "batches": [],
            "submitted_at": now_utc().isoformat(),
            "manifest_path": str(manifest_file) if manifest_file is not None else None,
        }
        if not self.wait_for_completion:
            return self.submission
        return {**self.submission, "outcome": nothing_sent()}

    def execute_complete(
        self, context: Context, event: Any = None, submission: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Resume after the wait: apply the outcome policy and return the submission with its outcome."""
        if submission is None:
            # ``airflow dags test`` resumes with the event alone (its inline trigger drops the
            # deferral kwargs); the submission is still the XCom pushed before deferring.
            ti = context["ti"]
            pull = getattr(ti, "xcom_pull", None)
            pulled = pull(task_ids=ti.task_id, key="return_value", map_indexes=ti.map_index) if pull else None
            submission = pulled if isinstance(pulled, Mapping) else None
        # Kept before the policy runs: a failed wait still reports the batches it waited for.
        self.submission = dict(submission or {})
        outcome = apply_outcome_policy(
            event,
            on_partial_failure=self.on_partial_failure,
            cancel_on_timeout=self.cancel_on_timeout,
            hook_factory=self.hook,
            log=self.log,
            context=context,
        )
        return {**self.submission, "outcome": outcome}

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the shard files read and the batches made (:mod:`airflow_batch_provider.lineage`)."""
        from airflow_batch_provider.lineage import submit_lineage

        return submit_lineage(hook=self.hook, source=self.source, submission=self.submission)

    def on_kill(self) -> None:
        if self.cancel_on_kill and self._batch_ids:
            cancel_batches(self.hook(), self._batch_ids, log=self.log)

    def _run_estimate(
        self,
        hook: BatchApiHook,
        dialect: Dialect,
        shards: list[ShardInput],
        manifest_file: ObjectStoragePath | None,
    ) -> dict[str, Any]:
        """The whole run's estimate: the manifest's, else made by streaming the run's files."""
        manifest = read_manifest(manifest_file) if manifest_file is not None else None
        known = manifest.estimate if manifest is not None else None
        # A model override or the task's request defaults change what is sent: estimate the
        # lines as sent (the connection's defaults were the build's too, when it named it).
        changed = bool(self.request_defaults) or bool(
            self.model and manifest is not None and self.model != manifest.model
        )
        if changed:
            known = None
        if known and (known.get("cost") is not None or self.max_estimated_cost is None):
            return known
        spend = spend_settings(hook.get_settings().extra, f"connection {self.batch_conn_id!r}")
        book = PriceBook.for_dialect(
            dialect, spend.prices, f"connection {self.batch_conn_id!r} extra prices", spend.price_table
        )
        model = self.model or (manifest.model if manifest is not None else None)
        if known and book.price(model) is None:
            return known  # the connection cannot price it either
        if manifest is not None and manifest_file is not None:
            # Every shard of the build, not only the one this (mapped) task sends.
            root = staging_dir_of(manifest_file)
            files = [(s.index, root / s.path) for s in manifest.shards]
        else:
            files = [(s.index, s.path) for s in shards]
        self.log.info("Estimating %d file(s) of the run for the budget check", len(files))
        # A cap is checked against a count: "none" (no estimate at build) still counts here.
        counter = resolve_counter(spend.token_counter, dialect, model) or resolve_counter(
            "auto", dialect, model
        )
        assert counter is not None
        return estimate_files(
            files,
            endpoint=shards[0].endpoint,
            counter=counter,
            default_max_output=spend.default_max_output_tokens,
            book=book,
            model=model,
            defaults=self._line_defaults,
        )

    # ---- queue-aware submission (max_enqueued_tokens) ------------------------------------
    def _queue_cap(self, hook: BatchApiHook) -> int | None:
        """The enqueued-token cap: the operator's, else the connection extra's, else None."""
        if self.max_enqueued_tokens is not None:
            return self.max_enqueued_tokens
        value = hook.get_settings().extra.get("max_enqueued_tokens")
        if value in (None, ""):
            return None
        try:
            cap = int(value)
        except (TypeError, ValueError):
            cap = 0
        if cap < 1:
            raise ConfigurationError(
                f"connection {self.batch_conn_id!r} extra max_enqueued_tokens must be a positive "
                f"integer, got {value!r}"
            )
        return cap

    def _submit_queued(
        self,
        context: Context,
        hook: BatchApiHook,
        dialect: Dialect,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shards: list[ShardInput],
        manifest_file: ObjectStoragePath | None,
        cap: int,
    ) -> list[SubmitState]:
        """Create the shards while the ledger has room; wait (deferred) for room, or for the new
        batches to leave ``validating``, until every shard has a live batch."""
        check_ledger_dialect(dialect)
        manifest_model = read_manifest(manifest_file).model if manifest_file is not None else None
        model = self.model or manifest_model or self._line_defaults.get("model") or ""
        sizes: dict[int, int] = {}
        counter: TokenCounter | None = None
        for shard in shards:
            built = self._build_estimate(shard)
            if built is None:
                # Resolved once (spend settings, tokenizer), and only when a shard is counted here.
                counter = counter or self._queue_counter(hook, dialect, model)
                built = self._count_shard(shard, counter)
            # Before any upload: a shard over the cap alone can never be created.
            check_shard_fits(shard.index, built, cap)
            sizes[shard.index] = built
        started = self._queue_started or now_utc().isoformat()
        self._queue_started = started
        limit = self.queue_timeout if self.queue_timeout is not None else self.wait_timeout
        deadline = deadline_from(started, limit if limit is not None else DEFAULT_QUEUE_TIMEOUT)
        while True:
            done = self._queue_pass(hook, dialect, store, identity, shards, sizes, model, cap)
            if isinstance(done, list):
                return done
            need, watch, created = done
            # Before any wait: the links show them, and a killed task can cancel them.
            push_batch_ids(context, created)
            if deadline is not None and now_utc() >= deadline:
                raise EnqueuedTokenTimeoutError(self._queue_timeout_message(started, deadline, model, cap))
            if self.deferrable:
                self.defer(
                    trigger=QueueRoomTrigger(
                        batch_conn_id=self.batch_conn_id,
                        dialect=self.dialect,
                        model=model,
                        need=need,
                        cap=cap,
                        watch_ids=watch,
                        started=started,
                        deadline=deadline.isoformat() if deadline is not None else None,
                        poll_interval=self.poll_interval,
                        max_consecutive_errors=self.max_consecutive_errors,
                        created_ids=created,
                        cancel_on_kill=self.cancel_on_kill,
                    ),
                    method_name="resume_queued",
                )
            time.sleep(self.poll_interval)

    def _queue_pass(
        self,
        hook: BatchApiHook,
        dialect: Dialect,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shards: list[ShardInput],
        sizes: Mapping[int, int],
        model: str,
        cap: int,
    ) -> list[SubmitState] | tuple[int, list[str], list[str]]:
        """One pass over the shards in order: every shard's state when all have live batches past
        ``validating``; else what to wait for: (tokens the next shard needs, batches validating,
        every batch created so far)."""
        ledger = read_ledger(hook, model, now_utc())
        held = ledger.tokens
        states: list[SubmitState] = []
        validating: list[str] = []
        # Rebuilt each pass, one id as each shard's batch is known: the next shard's create never
        # adopts an earlier shard's batch, and a kill while waiting cancels what was created.
        self._batch_ids = []

        def waiting(need: int) -> tuple[int, list[str], list[str]]:
            return need, validating, list(self._batch_ids)

        for shard in shards:
            state = store.read(identity.key(shard.index))
            live = self._live_batch(
                hook,
                state,
                effective_fingerprint(shard.fingerprint, self.model, self._line_defaults),
                ledger.batches,
            )
            if live is not None and state is not None:
                if live.state is BatchState.VALIDATING:
                    validating.append(live.id)
                states.append(state)
                self._batch_ids.append(str(state.batch_id))
                continue
            size = sizes[shard.index]
            if held + size > cap:
                self.log.info(
                    "Shard %d (%d estimated token(s)) waits: %d of %d enqueued for %r",
                    shard.index,
                    size,
                    held,
                    cap,
                    model,
                )
                return waiting(size)
            try:
                state = self.submit_shard(hook, dialect, store, identity, shard, queue=queue_tag(size, model))
            except BatchApiError as exc:
                if not dialect.is_queue_full(exc.status_code, exc.body):
                    raise
                self.log.warning(
                    "Shard %d: the vendor's queue is full; creating it again later: %s", shard.index, exc
                )
                return waiting(size)
            held += size
            states.append(state)
            self._batch_ids.append(str(state.batch_id))
            validating.append(str(state.batch_id))
        if validating:
            self.log.info("Waiting for %d new batch(es) to leave validating", len(validating))
            return waiting(0)
        return states

    def _live_batch(
        self,
        hook: BatchApiHook,
        state: SubmitState | None,
        fingerprint: str,
        listed: Mapping[str, Batch],
    ) -> Batch | None:
        """The recorded batch of a shard when it stands (a re-attach, not a new create), else None.

        :param listed: the batches the ledger just listed, read instead of one get per shard.
        """
        if state is None or not state.batch_id or state.fingerprint != fingerprint:
            return None
        batch = listed.get(state.batch_id)
        if batch is None:
            try:
                batch = hook.get_batch(state.batch_id)
            except BatchApiNotFoundError:
                return None
        if _queue_failed(batch) or (batch.state in _BAD_END and self.resubmit_failed):
            return None
        return batch

    def _build_estimate(self, shard: ShardInput) -> int | None:
        """The build's estimate of the shard's input tokens when it stands (lines sent as built)."""
        return None if self.model or self.request_defaults else shard.input_tokens

    def _queue_counter(self, hook: BatchApiHook, dialect: Dialect, model: str) -> TokenCounter:
        """The token counter of the connection's ``token_counter`` (else ``auto``) for ``model``."""
        spend = spend_settings(hook.get_settings().extra, f"connection {self.batch_conn_id!r}")
        counter = resolve_counter(spend.token_counter, dialect, model or None) or resolve_counter(
            "auto", dialect, model or None
        )
        assert counter is not None
        return counter

    def _count_shard(self, shard: ShardInput, counter: TokenCounter) -> int:
        """The shard's input tokens, counted here as its lines will be sent."""
        tokens = 0
        with open_read(shard.path) as handle:
            for _, obj in iter_objects(handle):
                body = obj.get("body") if isinstance(obj, dict) else None
                if isinstance(body, dict):
                    body = {**self._line_defaults, **body, **({"model": self.model} if self.model else {})}
                    tokens += counter(body)
        return tokens

    @staticmethod
    def _queue_timeout_message(started: str, deadline: datetime, model: str, cap: int) -> str:
        return (
            f"the vendor's queue for model {model!r} had no room for the next shard under "
            f"max_enqueued_tokens={cap:,} between {started} and {deadline.isoformat()} "
            "(queue_timeout); the shards created so far keep running. Raise queue_timeout or the "
            "vendor's limit, or wait for other batches of this organisation to finish, then clear the task"
        )

    def resume_queued(self, context: Context, event: Any = None) -> dict[str, Any]:
        """Resume after ``QueueRoomTrigger``: go on submitting where the last pass stopped."""
        payload = event if isinstance(event, Mapping) else {}
        status = payload.get("status")
        if status == "timeout":
            deadline = to_utc(payload.get("deadline")) or now_utc()
            raise EnqueuedTokenTimeoutError(
                self._queue_timeout_message(
                    str(payload.get("started")),
                    deadline,
                    str(payload.get("model") or ""),
                    int(payload.get("cap") or 0),
                )
            )
        if status != "ready":
            raise BatchFailedError(f"waiting for queue room ended {status}: {payload.get('message')}")
        self._queue_started = payload.get("started")
        # The state store makes this idempotent: created shards re-attach, the rest go on.
        return self.execute(context)

    # ---- one shard ---------------------------------------------------------------------
    def submit_shard(
        self,
        hook: BatchApiHook,
        dialect: Dialect,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shard: ShardInput,
        queue: str | None = None,
    ) -> SubmitState:
        """Submit one shard, or re-attach to the batch an earlier try made for it.

        :param queue: the batch's ledger entry (``airflow_enqueued``) in a queue-aware submit.
        """
        key = identity.key(shard.index)
        defaults = self._defaults(hook)
        fingerprint = effective_fingerprint(shard.fingerprint, self.model, defaults)
        state = store.read(key)
        replaced: list[str] = []
        if state is not None and state.fingerprint != fingerprint:
            old_ids = self._handle_stale(hook, state, fingerprint, shard)
            # Every batch the new one replaces: a lost create's too, so a vendor whose create
            # token is the job's name gets a new generation's (``generation_name``).
            replaced = [*state.replaced_batch_ids, *(i for i in old_ids if i not in state.replaced_batch_ids)]
            state = None
        if state is not None and state.batch_id:
            attached = self._reattach(hook, state)
            if attached is not None:
                return attached
            replaced = [*state.replaced_batch_ids, state.batch_id]
            state = None
        if state is not None:
            # Intent without an id: the create may have happened before a crash. Look first.
            dead: list[str] = []
            found = (
                self._find_inline_orphan(hook, state)
                if dialect.orphan_lookup == "time_and_count"
                else self._find_orphan(hook, key, fingerprint, state.input_file_id, state.intent_at, dead)
            )
            if found is not None:
                self.log.info(
                    "Shard %d: found batch %s created by an earlier try; re-attaching", shard.index, found.id
                )
                state.batch_id = found.id
                state.created_at = found.created_at or now_utc()
                store.write(state)
                return state
            # A job the lost create made that has since died is replaced too (its name is used).
            replaced = [*state.replaced_batch_ids, *(d for d in dead if d not in state.replaced_batch_ids)]
        if dialect.submission_mode == "inline":
            return self._create_inline(hook, store, identity, shard, key, fingerprint, replaced, defaults)
        if shard.table is not None:
            return self._create_from_table(hook, store, identity, shard, key, fingerprint, replaced)
        if dialect.submission_mode == "object_store":
            return self._create_in_store(hook, store, identity, shard, key, fingerprint, replaced, defaults)
        file_id = (
            state.input_file_id
            if state is not None and self._file_exists(hook, state.input_file_id)
            else None
        )
        if file_id is None:
            file_id, model = self._upload(hook, shard, defaults)
        else:
            model = self._job_model(dialect, shard, state, defaults)
        state = self._record_intent(
            store, identity, shard, key, fingerprint, replaced, input_file_id=file_id, model=model
        )
        batch = hook.create_batch(
            input_file_id=file_id,
            endpoint=shard.endpoint,
            completion_window=self.completion_window,
            metadata=batch_metadata(
                identity,
                shard=shard.index,
                fingerprint=fingerprint,
                dialect=dialect,
                extra=self.metadata,
                queue=queue,
            ),
            model=model,
        )
        self._record_created(store, state, batch)
        self.log.info("Shard %d: created batch %s from file %s", shard.index, batch.id, file_id)
        return state

    def _create_inline(
        self,
        hook: BatchApiHook,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shard: ShardInput,
        key: str,
        fingerprint: str,
        replaced: list[str],
        defaults: Mapping[str, Any],
    ) -> SubmitState:
        """Create a batch whose requests travel in the create call (``submission_mode`` "inline").

        The body is encoded from the canonical shard into a local temp file, one line at a time,
        and streamed with its exact length; the intent (time and request count) is durable
        before the create, the id after it.
        """
        from airflow_batch_provider.hooks.transport import FileBody

        dialect = hook.dialect
        encoder = ShardEncoder(dialect, where=str(shard.path), model=self.model, defaults=defaults)
        fields = dialect.inline_create_body(
            endpoint=shard.endpoint, completion_window=self.completion_window, metadata=None, model=None
        )
        fd, tmp = tempfile.mkstemp(prefix="abp-create-", suffix=".json")
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20) as out, open_read(shard.path) as src:
                size, count = write_inline_body(encoder, src, out, fields)
            state = self._record_intent(store, identity, shard, key, fingerprint, replaced, requests=count)
            body = FileBody(tmp, filename=f"{shard.path.name} ({count} requests)", size=size, requests=count)
            # The batches of this try's other shards are not this one's, whatever their size.
            batch = hook.create_batch(
                endpoint=shard.endpoint,
                completion_window=self.completion_window,
                inline=body,
                not_these=self._batch_ids,
            )
        finally:
            os.unlink(tmp)
        self._record_created(store, state, batch)
        self.log.info("Shard %d: created batch %s with %d inline request(s)", shard.index, batch.id, count)
        return state

    def _create_in_store(
        self,
        hook: BatchApiHook,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shard: ShardInput,
        key: str,
        fingerprint: str,
        replaced: list[str],
        defaults: Mapping[str, Any],
    ) -> SubmitState:
        """Create a job that reads its input from object storage (``submission_mode`` "object_store").

        The encoded shard is written beside the canonical one, under ``vendor/<key>/input/`` (atomically:
        the job never sees half an object), and the job writes its results under
        ``vendor/<key>/output/``. The same key gives the same names, so a retry overwrites its own
        earlier input; the intent (with the input's URI) is durable before the create, the id after.
        """
        from airflow_batch_provider.hooks.objects import plain_uri

        dialect = hook.dialect
        folder = shard.path.parent / "vendor" / key
        # A folder of its own: a vendor may read every object under the input's folder.
        target = folder / "input" / shard.path.name
        encoder = ShardEncoder(dialect, where=str(shard.path), model=self.model, defaults=defaults)
        size = 0
        with atomic_writer(target) as out, open_read(shard.path) as src:
            for line in encoder.lines(src):
                out.write(line)
                size += len(line)
        # The encoded copy's bytes are known only now (an encoding may grow a line): checked
        # against the vendor's per-job bounds before this shard's job is created.
        problem = dialect.job_problem(None, size)
        if problem is not None:
            raise ConfigurationError(f"shard {shard.index} ({target}): {problem}")
        input_uri = plain_uri(target)
        output_uri = plain_uri(folder / "output") + "/"
        state = self._record_intent(
            store,
            identity,
            shard,
            key,
            fingerprint,
            replaced,
            input_file_id=input_uri,
            model=encoder.job_model,
        )
        batch = hook.create_batch(
            input_file_id=input_uri,
            output_uri=output_uri,
            endpoint=shard.endpoint,
            completion_window=self.completion_window,
            metadata=batch_metadata(
                identity, shard=shard.index, fingerprint=fingerprint, dialect=dialect, extra=self.metadata
            ),
            # A replacement job gets a name (and create token) of its own generation: a vendor
            # whose token is the name would otherwise answer with the dead job.
            name=generation_name(key, len(replaced)),
            model=encoder.job_model,
            not_these=self._batch_ids,
        )
        self._record_created(store, state, batch)
        self.log.info("Shard %d: created batch %s reading %s", shard.index, batch.id, input_uri)
        return state

    @staticmethod
    def _record_intent(
        store: SubmissionStateStore,
        identity: RunIdentity,
        shard: ShardInput,
        key: str,
        fingerprint: str,
        replaced: list[str],
        **fields: Any,
    ) -> SubmitState:
        """The shard's intent, durable before its create (a crash after the create leaves the
        lookup something to find): ``fields`` say what the create will read (file, URI, table)."""
        state = SubmitState(
            key=key,
            shard=shard.index,
            fingerprint=fingerprint,
            dag_id=identity.dag_id,
            task_id=identity.task_id,
            run_id=identity.run_id,
            map_index=identity.map_index,
            endpoint=shard.endpoint,
            intent_at=now_utc(),
            replaced_batch_ids=replaced,
            **fields,
        )
        store.write(state)
        return state

    @staticmethod
    def _record_created(store: SubmissionStateStore, state: SubmitState, batch: Batch) -> None:
        """The created batch's id beside the intent, durable before anything else is done."""
        state.batch_id = batch.id
        state.created_at = batch.created_at or now_utc()
        store.write(state)

    def _find_inline_orphan(self, hook: BatchApiHook, state: SubmitState) -> Batch | None:
        """The batch a lost inline create made: the one batch created since the intent (less
        ``CLOCK_SKEW``) with the intent's request count; None if there is none; several raise."""
        from airflow_batch_provider.hooks.create import CLOCK_SKEW, InlineMatch

        if state.intent_at is None or state.requests is None:
            return None
        match = hook.find_inline_batches(
            InlineMatch(
                since=state.intent_at - CLOCK_SKEW,
                requests=state.requests,
                exclude=frozenset(self._batch_ids),
            )
        )
        found = [b for b in match.found if not (self.resubmit_failed and b.state in _BAD_END)]
        if len(found) > 1:
            raise AmbiguousOrphanError(
                f"shard {state.shard}: an earlier try recorded its intent at {state.intent_at.isoformat()} "
                f"but no batch id, and {len(found)} batches with its {state.requests} request(s) were "
                f"created since: {', '.join(b.id for b in found)}. The vendor's batches carry no tag, so "
                "none is adopted and none is created. Find the one holding this shard's custom_ids "
                "(its results or the vendor's console), cancel the others, and record its id as "
                f"batch_id in the shard's state ({state.key}); or delete that state to submit again "
                "(a duplicate batch is then possible)"
            )
        return found[0] if found else None

    def _defaults(self, hook: BatchApiHook) -> dict[str, Any]:
        """Body defaults for every line: the connection's ``request_defaults``, then the operator's."""
        from airflow_batch_provider.hooks.settings import request_defaults

        extra = hook.get_settings().extra.get("request_defaults")
        return {
            **request_defaults(extra, f"connection {self.batch_conn_id!r}"),
            **request_defaults(self.request_defaults, f"task {self.task_id!r}"),
        }

    def _reattach(self, hook: BatchApiHook, state: SubmitState) -> SubmitState | None:
        assert state.batch_id is not None
        try:
            batch = hook.get_batch(state.batch_id)
        except BatchApiNotFoundError:
            self.log.warning(
                "Shard %d: recorded batch %s no longer exists; submitting again", state.shard, state.batch_id
            )
            return None
        if _queue_failed(batch):
            self.log.warning(
                "Shard %d: recorded batch %s failed for the vendor's queue limit; submitting it again",
                state.shard,
                batch.id,
            )
            return None
        if batch.state in _BAD_END and self.resubmit_failed:
            self.log.warning(
                "Shard %d: recorded batch %s is %s; submitting a new one (resubmit_failed=True)",
                state.shard,
                batch.id,
                batch.state.value,
            )
            return None
        self.log.info("Shard %d: re-attaching to batch %s (%s)", state.shard, batch.id, batch.state.value)
        return state

    def _find_orphan(
        self,
        hook: BatchApiHook,
        key: str,
        fingerprint: str,
        input_file_id: str | None = None,
        since: datetime | None = None,
        dead: list[str] | None = None,
    ) -> Batch | None:
        """The live batch an earlier try created for the shard ``key`` (its intent recorded at
        ``since``: a listing filtered by creation time asks only for those after it).

        :param dead: gets the ids of this shard's batches left out for being dead
            (``resubmit_failed``), so the replacement is named as a new generation.
        """

        def this_shard(batch: Batch) -> bool:
            # A batch with another fingerprint tag (as the dialect stores it) is another shard
            # file's (one without the tag is judged by its input file alone); a dead one is
            # replaced when resubmit_failed.
            same = hook.dialect.tags_agree(batch, {FINGERPRINT_NAME: fingerprint})
            if same and self.resubmit_failed and batch.state in _BAD_END:
                if dead is not None:
                    dead.append(batch.id)
                return False
            return same

        return hook.find_created_batch(
            {KEY_NAME: key}, input_file_id=input_file_id, accept=this_shard, since=since
        )

    def _handle_stale(
        self, hook: BatchApiHook, state: SubmitState, fingerprint: str, shard: ShardInput
    ) -> list[str]:
        """Cancel the batches of a shard whose file changed (or refuse, ``on_stale_state='fail'``);
        their ids (a lost create's found by the key), which the new batch replaces."""
        what = (
            f"shard {shard.index} ({shard.path}) changed since an earlier try submitted it "
            f"(fingerprint {state.fingerprint[:12]}... -> {fingerprint[:12]}...; "
            f"batch {state.batch_id or 'unknown'})"
        )
        if self.on_stale_state == "fail":
            raise StaleSubmissionStateError(f"{what}; on_stale_state='fail'")
        old_ids = (
            [state.batch_id] if state.batch_id else [b.id for b in hook.find_batches({KEY_NAME: state.key})]
        )
        cancelled = cancel_batches(hook, old_ids, log=self.log)
        self.log.warning(
            "%s; cancelled %s and submitting the new file", what, ", ".join(cancelled) or "nothing"
        )
        return old_ids

    @staticmethod
    def _file_exists(hook: BatchApiHook, file_id: str | None) -> bool:
        if not file_id:
            return False
        try:
            hook.get_file(file_id)
        except BatchApiNotFoundError:
            return False
        return True

    def _upload(
        self, hook: BatchApiHook, shard: ShardInput, defaults: Mapping[str, Any] | None = None
    ) -> tuple[str, str | None]:
        """Upload the shard; (file id, the model for the create call of a job-model dialect)."""
        dialect = hook.dialect
        if not needs_pass(dialect, self.model, defaults):
            return hook.upload_file(shard.path, filename=shard.path.name), None
        # The staged shard stays canonical: the vendor's copy (override model, encoded lines) is
        # streamed into a local temp file, then that is streamed up. A line the vendor cannot take
        # fails here, before anything is uploaded.
        encoder = ShardEncoder(dialect, where=str(shard.path), model=self.model, defaults=defaults)
        fd, tmp = tempfile.mkstemp(prefix="abp-submit-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "wb", buffering=1 << 20) as out, open_read(shard.path) as src:
                for line in encoder.lines(src):
                    out.write(line)
            return hook.upload_file(tmp, filename=shard.path.name), encoder.job_model
        finally:
            os.unlink(tmp)

    def _job_model(
        self,
        dialect: Dialect,
        shard: ShardInput,
        state: SubmitState | None,
        defaults: Mapping[str, Any] | None = None,
    ) -> str | None:
        """The create call's model when an earlier try's upload is reused (job-model dialects only)."""
        if dialect.model_placement != "job":
            return None
        if state is not None and state.model:
            return state.model
        with open_read(shard.path) as src:
            return ShardEncoder(dialect, where=str(shard.path), model=self.model, defaults=defaults).drain(
                src
            )

    # ---- input -------------------------------------------------------------------------
    def _check_table_shard(self, dialect: Dialect, shard: ShardInput) -> None:
        """A shard written as a BigQuery table: its rows were encoded by the build, so this
        submit can change nothing in them (refused by name before any create)."""
        if not dialect.bigquery_io:
            raise ConfigurationError(
                f"shard {shard.index} is the BigQuery table {shard.table}; dialect {dialect.name!r} "
                "has no job that reads BigQuery (rebuild without requests_table)"
            )
        if self.model and self.model != shard.model:
            raise ConfigurationError(
                f"shard {shard.index} ({shard.table}) was built for model {shard.model!r}; its rows are "
                f"encoded in BigQuery, so model={self.model!r} cannot replace it: rebuild with that model"
            )
        missing = sorted(k for k in self._line_defaults if k not in shard.body_keys)
        if missing:
            raise ConfigurationError(
                f"shard {shard.index} ({shard.table}): the connection's request_defaults set "
                f"{', '.join(missing)}, which the rows built in BigQuery lack; give the build "
                "batch_conn_id (or body) so they are in the requests"
            )
        problem = dialect.job_problem(shard.lines, None)
        if problem is not None:
            raise ConfigurationError(f"shard {shard.index} ({shard.table}): {problem}")

    def _check_tables_unchanged(self, shards: Sequence[ShardInput]) -> None:
        """Each table shard's fingerprint, recomputed in BigQuery, before any create: a table
        rewritten since the build is refused by name, never sent under the old fingerprint."""
        from airflow.sdk import BaseHook

        from airflow_batch_provider.warehouse.bigquery_requests import check_table

        checked = [s for s in shards if s.table is not None and s.conn_id and s.template]
        if not checked:
            return
        client = BaseHook.get_connection(str(checked[0].conn_id)).get_hook().get_client()
        try:
            for shard in checked:
                assert shard.table is not None and shard.template is not None
                check_table(client, shard.table, shard.template, shard.fingerprint)
        finally:
            client.close()

    def _create_from_table(
        self,
        hook: BatchApiHook,
        store: SubmissionStateStore,
        identity: RunIdentity,
        shard: ShardInput,
        key: str,
        fingerprint: str,
        replaced: list[str],
    ) -> SubmitState:
        """Create a job reading a requests table the build wrote in BigQuery, writing its
        predictions to a new table in the output dataset (nothing is read or written here)."""
        dialect = hook.dialect
        assert shard.table is not None and shard.output_dataset is not None
        state = self._record_intent(
            store, identity, shard, key, fingerprint, replaced, input_file_id=shard.table, model=shard.model
        )
        batch = hook.create_batch(
            input_file_id=shard.table,
            output_uri=shard.output_dataset,
            endpoint=shard.endpoint,
            completion_window=self.completion_window,
            metadata=batch_metadata(
                identity, shard=shard.index, fingerprint=fingerprint, dialect=dialect, extra=self.metadata
            ),
            name=generation_name(key, len(replaced)),
            model=shard.model,
            not_these=self._batch_ids,
        )
        self._record_created(store, state, batch)
        self.log.info("Shard %d: created batch %s reading %s", shard.index, batch.id, shard.table)
        return state

    def _plan(self, dialect: Dialect) -> tuple[list[ShardInput], ObjectStoragePath, ObjectStoragePath | None]:
        """Resolve ``source`` into shards, the state directory and the manifest file (if any)."""
        manifest: Manifest | None = None
        manifest_file: ObjectStoragePath | None = None
        jsonl_file: ObjectStoragePath | None = None
        source = self.source
        if isinstance(source, Manifest):
            raise ConfigurationError(
                "pass the manifest's path (or the build XCom), not a bare Manifest object"
            )
        if isinstance(source, str) and source.lstrip().startswith("{"):
            # A rendered template of an XCom mapping.
            try:
                source = orjson.loads(source)
            except orjson.JSONDecodeError:
                raise ConfigurationError(
                    f"source looks like JSON but does not parse: {source[:200]!r}"
                ) from None
        if isinstance(source, Mapping) and "uri" in source and "fingerprint" in source:
            return self._one_shard(dialect, source)
        if isinstance(source, Mapping):
            where = source.get("manifest_path") or source.get("staging_path")
            if not where:
                raise ConfigurationError(
                    "source mapping must hold 'manifest_path' or 'staging_path' "
                    "(shard paths are relative to it); "
                    f"got keys {sorted(source)}"
                )
            manifest_file = manifest_path(where)
        elif source is None or source == "":
            raise ConfigurationError("source is empty: give a manifest path, a build XCom or a JSONL path")
        else:
            path = resolve_path(source)
            if str(path).endswith((".jsonl", ".jsonl.gz", ".ndjson")) or (
                path.is_file() and path.suffix != ".json"
            ):
                jsonl_file = path
            else:
                manifest_file = manifest_path(path)
        state_root = resolve_path(self.state_path) if self.state_path else None
        if jsonl_file is not None:
            shard = self._hand_made(dialect, jsonl_file)
            return [shard], (state_root or jsonl_file.parent) / STATE_DIR, None
        assert manifest_file is not None
        if not manifest_file.exists():
            raise ConfigurationError(f"manifest {manifest_file} does not exist")
        manifest = read_manifest(manifest_file)
        staging = staging_dir_of(manifest_file)
        if manifest.dialect and manifest.dialect != dialect.name:
            self.log.warning(
                "Manifest was built for dialect %r but the connection speaks %r",
                manifest.dialect,
                dialect.name,
            )
        chosen = manifest.shards
        if self.shard is not None:
            chosen = [s for s in manifest.shards if s.index == int(self.shard)]
            if not chosen:
                raise ConfigurationError(
                    f"manifest {manifest_file} has no shard {self.shard}; "
                    f"shards: {[s.index for s in manifest.shards]}"
                )
        if not chosen and (manifest.rows_unchanged or manifest.rows_written == 0) and self.shard is None:
            # An incremental run where nothing changed (or an allowed empty build): no batch.
            return [], (state_root or staging) / STATE_DIR, manifest_file
        if not chosen:
            raise ConfigurationError(f"manifest {manifest_file} lists no shards (nothing to submit)")
        shards = []
        found = manifest.extra.get("bigquery")
        tables: dict[str, Any] = found if isinstance(found, dict) else {}
        for s in chosen:
            endpoint = self.endpoint or s.endpoint or manifest.endpoint
            dialect.check_endpoint(endpoint)
            path = staging / s.path
            if s.table is not None:
                # Rows encoded in BigQuery by the build: nothing in staging to read or check.
                shards.append(
                    ShardInput(
                        s.index,
                        path,
                        s.fingerprint,
                        endpoint,
                        s.lines,
                        table=s.table,
                        output_dataset=str(tables.get("output_dataset") or ""),
                        model=manifest.model,
                        body_keys=tuple(tables.get("body_keys") or ()),
                        conn_id=str(tables["conn_id"]) if tables.get("conn_id") else None,
                        template=str(tables["template"]) if tables.get("template") else None,
                    )
                )
                continue
            if self.validate:
                checked = self._validated(dialect, path, endpoint)
                if checked.fingerprint != s.fingerprint:
                    raise ConfigurationError(
                        f"shard {s.index} ({path}) does not match the manifest's fingerprint; "
                        "rebuild the staging"
                    )
            shards.append(ShardInput(s.index, path, s.fingerprint, endpoint, s.lines, s.input_tokens))
        return shards, (state_root or staging) / STATE_DIR, manifest_file

    def _one_shard(
        self, dialect: Dialect, shard: Mapping[str, Any]
    ) -> tuple[list[ShardInput], ObjectStoragePath, ObjectStoragePath | None]:
        """One shard of a build XCom (``.expand()`` over its ``shards``): ``{index, uri, fingerprint}``."""
        if shard.get("table"):
            raise ConfigurationError(
                f"shard {shard.get('index')} is the BigQuery table {shard['table']}: pass the build's "
                "XCom (or its manifest_path) as source, not one shard of it"
            )
        path = resolve_path(shard["uri"])
        if not path.exists():
            raise ConfigurationError(f"shard {shard.get('index')} file {path} does not exist")
        staging = path.parent
        manifest_file: ObjectStoragePath | None = staging / "manifest.json"
        endpoint = self.endpoint or shard.get("endpoint")
        if not endpoint and manifest_file is not None and manifest_file.exists():
            endpoint = read_manifest(manifest_file).endpoint
        if not endpoint:
            endpoint = _scan(path)[1]
        if not endpoint:
            raise ConfigurationError(f"shard {path}: no endpoint in the XCom, the manifest or its first line")
        dialect.check_endpoint(endpoint)
        index = int(shard.get("index", 0))
        if self.validate:
            checked = self._validated(dialect, path, endpoint)
            if checked.fingerprint != shard["fingerprint"]:
                raise ConfigurationError(
                    f"shard {index} ({path}) does not match its fingerprint; rebuild the staging"
                )
        if manifest_file is not None and not manifest_file.exists():
            manifest_file = None
        state_root = resolve_path(self.state_path) if self.state_path else staging
        tokens = shard.get("input_tokens")
        item = ShardInput(
            index,
            path,
            str(shard["fingerprint"]),
            endpoint,
            shard.get("lines"),
            int(tokens) if isinstance(tokens, int) else None,
        )
        return [item], state_root / STATE_DIR, manifest_file

    def _hand_made(self, dialect: Dialect, path: ObjectStoragePath) -> ShardInput:
        if not path.exists():
            raise ConfigurationError(f"batch input file {path} does not exist")
        if self.shard not in (None, 0):
            raise ConfigurationError(f"shard={self.shard} given but {path} is a single JSONL file")
        if self.validate is False:
            fingerprint, first_url, lines = _scan(path)
            endpoint = self.endpoint or first_url
            if not endpoint:
                raise ConfigurationError(f"{path}: no endpoint given and the first line has no url")
            dialect.check_endpoint(endpoint)
            return ShardInput(0, path, fingerprint, endpoint, lines)
        checked = self._validated(dialect, path, self.endpoint)
        return checked

    def _unsupported(self, dialect: Dialect, obj: dict[str, Any], number: int) -> list[Problem]:
        """What the vendor cannot express in a hand-made line, as it will be sent (with the
        ``model`` override), as a problem naming the line; [] when nothing."""
        line = obj
        if isinstance(obj.get("body"), dict) and (self.model or self._line_defaults):
            # As it will be sent: the request defaults fill what the line lacks, then the model.
            body = {**self._line_defaults, **obj["body"]}
            line = {**obj, "body": {**body, "model": self.model} if self.model else body}
        reason = dialect.unsupported(line)
        if reason is None:
            return []
        custom_id = obj.get("custom_id")
        return [
            Problem(
                number, "unsupported", reason, custom_id=custom_id if isinstance(custom_id, str) else None
            )
        ]

    def _validated(self, dialect: Dialect, path: ObjectStoragePath, endpoint: str | None) -> ShardInput:
        """Validate a file with the dialect's rules while hashing it; a bad file fails naming its lines."""
        rules = dialect.validation_rules()
        if self.model:
            # Every line is sent with the override model, so the file's own models may differ,
            # and a line may name none.
            rules = replace(rules, mixed_models=True, model_endpoints=frozenset())
        elif self._line_defaults.get("model"):
            # The connection's request defaults give a line without a model one.
            rules = replace(rules, model_endpoints=frozenset())
        validator = LineValidator(rules, endpoint)
        problems: list[Problem] = []
        count = 0
        first_url: str | None = None
        digest = hashlib.sha256()
        with open_read(path) as raw_stream:
            stream = _HashingReader(raw_stream, digest)
            for raw in iter_raw_lines(stream, rules.limits.max_line_bytes):  # type: ignore[arg-type]
                obj, found = validator.check_raw(raw)
                if obj is not None and not found:
                    found = self._unsupported(dialect, obj, raw.number)
                if first_url is None and obj is not None and isinstance(obj.get("url"), str):
                    first_url = obj["url"]
                count += len(found)
                if len(problems) < _PROBLEMS_SHOWN:
                    problems.extend(found[: _PROBLEMS_SHOWN - len(problems)])
        tail = validator.finish()
        count += len(tail)
        problems.extend(tail)
        if count:
            shown = "; ".join(str(p) for p in problems)
            more = f" (+{count - len(problems)} more)" if count > len(problems) else ""
            raise JsonlValidationError(
                f"{path} is not a valid {dialect.name} batch file: {count} problem(s): {shown}{more}"
            )
        chosen = endpoint or first_url
        if not chosen:
            raise ConfigurationError(f"{path}: no endpoint given and the first line has no url")
        dialect.check_endpoint(chosen)
        return ShardInput(0, path, digest.hexdigest(), chosen, validator.lines)


def _queue_failed(batch: Batch) -> bool:
    """Whether the vendor failed the batch for its queue limit (errors its dialect marks ``quota``)."""
    return batch.state is BatchState.FAILED and any(e.quota for e in batch.errors)


class _HashingReader:
    """A binary reader that hashes every byte read through ``readline``/``read``."""

    def __init__(self, stream: IO[bytes], digest: Any) -> None:
        self._stream = stream
        self._digest = digest

    def readline(self, size: int = -1) -> bytes:
        data = self._stream.readline(size)
        self._digest.update(data)
        return data

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._digest.update(data)
        return data


def _scan(path: ObjectStoragePath) -> tuple[str, str | None, int]:
    """Hash a file and read the url of its first line, without validating it."""
    digest = hashlib.sha256()
    first_url: str | None = None
    lines = 0
    with open_read(path) as stream:
        for raw in iter_raw_lines(_HashingReader(stream, digest), 1 << 30):  # type: ignore[arg-type]
            if not raw.data.strip():
                continue
            lines += 1
            if first_url is None:
                try:
                    url = orjson.loads(raw.data).get("url")
                except (orjson.JSONDecodeError, AttributeError):
                    url = None
                first_url = url if isinstance(url, str) else None
    return digest.hexdigest(), first_url, lines
