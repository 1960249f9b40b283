"""Submission state: who submitted which shard, and the batch it became.

A retried, cleared or restarted submit task must re-attach to the batch its earlier try
created instead of paying for a second one. Each shard of a run gets an idempotency key
derived from the run identity (dag_id, task_id, run_id, map_index) and the shard index;
the key goes into the batch's metadata (``airflow_batch_key``) and names the shard's record
in a :class:`SubmissionStateStore`. The record holds the intent (with the uploaded file id)
before the batch is created and the batch id right after, so a crash in between is repaired
by looking the batch up by its metadata.

Two stores keep that same protocol: :class:`TaskStateStore`, Airflow's durable task state
(Airflow 3.3+, ``context["task_state_store"]``), which every try of the task instance sees
whatever worker it runs on; and :class:`StateStore`, a small file ``submit-state/<key>.json``
beside the manifest, for Airflow without a task state store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson
from pydantic import BaseModel, ConfigDict, Field

from airflow_batch_provider.constants import FINGERPRINT_NAME, SHARD_TAG
from airflow_batch_provider.enqueued import QUEUE_TAG
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.staging import atomic_writer, open_read

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.dialects.base import Dialect

STATE_DIR = "submit-state"
#: The metadata key carrying the idempotency key (xAI's dialect moves it into the batch name).
KEY_NAME = "airflow_batch_key"
# OpenAI's metadata limits, the strictest documented: keys <= 64 chars, values <= 512 chars.
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: How long a record stays in Airflow's task state store after its last write: far past any
#: completion window (24h), so a retry or a clear within a month re-attaches. Set on every write,
#: so a deployment's shorter ``[state_store] default_retention_days`` cannot cut it.
STATE_RETENTION = timedelta(days=30)
StateStoreChoice = Literal["auto", "task_state_store", "file"]
STATE_STORE_CHOICES = ("auto", "task_state_store", "file")


@dataclass(frozen=True)
class RunIdentity:
    """The task instance a submission belongs to.

    :param dag_id: the DAG.
    :param task_id: the submit task.
    :param run_id: the DAG run.
    :param map_index: the mapped index, -1 when the task is not mapped.
    """

    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1

    @classmethod
    def from_context(cls, context: Mapping[str, Any]) -> RunIdentity:
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        return cls(
            dag_id=str(ti.dag_id),
            task_id=str(ti.task_id),
            run_id=str(ti.run_id),
            map_index=int(map_index if map_index is not None else -1),
        )

    def key(self, shard: int) -> str:
        """The shard's idempotency key: stable for a run, at most 64 characters, safe in a path."""
        digest = hashlib.sha256(
            "\x00".join((self.dag_id, self.task_id, self.run_id, str(self.map_index))).encode()
        ).hexdigest()[:24]
        return f"abp-{digest}-s{shard:05d}"


def generation_name(key: str, generation: int) -> str:
    """The name of a shard's ``generation``-th job: the key for the first (0), ``<key>-r<N>`` for
    the Nth replacement of a failed, expired or stopped one. Vendors whose job names are unique
    and whose create token is the name (Bedrock) need a new one per replacement; the key stays a
    prefix of every generation's name, so a lookup by the key finds them all.

    :param key: the shard's idempotency key (``RunIdentity.key``).
    :param generation: how many jobs of the shard were replaced before this one.
    """
    return key if generation <= 0 else f"{key}-r{generation}"


def effective_fingerprint(
    fingerprint: str, model: str | None, defaults: Mapping[str, Any] | None = None
) -> str:
    """The shard fingerprint, changed by a model override or request defaults (new work)."""
    if not model and not defaults:
        return fingerprint
    text = f"{fingerprint}\x00model={model}" if model else fingerprint
    if defaults:
        text += "\x00defaults=" + orjson.dumps(dict(defaults), option=orjson.OPT_SORT_KEYS).decode()
    return hashlib.sha256(text.encode()).hexdigest()


def batch_metadata(
    identity: RunIdentity,
    *,
    shard: int,
    fingerprint: str,
    dialect: Dialect,
    extra: Mapping[str, Any] | None = None,
    queue: str | None = None,
) -> dict[str, str]:
    """The metadata of a shard's batch: idempotency key, fingerprint, run identity, user pairs.

    Provider pairs come first in priority order; when the dialect allows fewer pairs, the
    least important identity pairs are dropped (the key and fingerprint always stay, and the
    ledger entry ``queue`` of a queue-aware submit, see :mod:`airflow_batch_provider.enqueued`).
    A user pair that does not fit, or breaks the key/value length limits, is an error.
    """
    needed = [(KEY_NAME, identity.key(shard)), (FINGERPRINT_NAME, fingerprint)]
    if queue is not None:
        needed.append((QUEUE_TAG, queue))
    provider = [
        *needed,
        ("airflow_dag_id", identity.dag_id),
        ("airflow_task_id", identity.task_id),
        ("airflow_run_id", identity.run_id),
        ("airflow_map_index", str(identity.map_index)),
        (SHARD_TAG, str(shard)),
    ]
    user: list[tuple[str, str]] = []
    for key, value in (extra or {}).items():
        key_text, value_text = str(key), str(value)
        if key_text in dict(provider):
            raise ConfigurationError(f"metadata key {key_text!r} is reserved by the provider")
        if not key_text or len(key_text) > MAX_METADATA_KEY:
            raise ConfigurationError(f"metadata key {key_text!r} must be 1-{MAX_METADATA_KEY} characters")
        if len(value_text) > MAX_METADATA_VALUE:
            raise ConfigurationError(
                f"metadata value of {key_text!r} is {len(value_text)} characters; "
                f"the limit is {MAX_METADATA_VALUE}"
            )
        user.append((key_text, value_text))
    room = dialect.max_metadata_pairs
    if len(user) > room - len(needed):
        raise ConfigurationError(
            f"{len(user)} metadata pair(s) given but dialect {dialect.name!r} allows {room} per batch "
            f"and the provider needs at least {len(needed)} ({', '.join(k for k, _ in needed)})"
        )
    kept = provider[: max(room - len(user), len(needed))]
    # Long run ids are cut rather than refused: the key, not these values, identifies the batch.
    return {k: v[:MAX_METADATA_VALUE] for k, v in kept + user}


class SubmitState(BaseModel):
    """What the state file of one shard holds."""

    model_config = ConfigDict(extra="ignore")

    key: str
    shard: int
    fingerprint: str
    dag_id: str
    task_id: str
    run_id: str
    map_index: int = -1
    endpoint: str | None = None
    input_file_id: str | None = None
    # The model the create call names, for a dialect that puts it on the job (from the shard).
    model: str | None = None
    # How many requests an "inline" create carries: with ``intent_at``, how the batch of a
    # create lost in a crash is recognised at a vendor whose batches carry no tags.
    requests: int | None = None
    batch_id: str | None = None
    intent_at: datetime | None = None
    created_at: datetime | None = None
    replaced_batch_ids: list[str] = Field(default_factory=list)

    @property
    def status(self) -> str:
        return "created" if self.batch_id else "intent"


class SubmissionStateStore(Protocol):
    """Where each shard's :class:`SubmitState` lives between tries.

    ``write`` returns only once the record is durable: the submit writes the intent before the
    create and the batch id after it, and the crash-window guarantee rests on that order.
    """

    @property
    def where(self) -> str:
        """Where records live, for logs (no secret)."""
        ...

    def read(self, key: str) -> SubmitState | None: ...

    def write(self, state: SubmitState) -> None: ...


class TaskStateAccessor(Protocol):
    """The part of Airflow's ``context["task_state_store"]`` (3.3+) the submit uses."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def set(self, key: str, value: Any, *, retention: timedelta | None = None) -> None: ...


def task_state_accessor(context: Mapping[str, Any]) -> TaskStateAccessor | None:
    """The context's task state store, if this Airflow gives tasks one (by capability, not version)."""
    accessor = context.get("task_state_store")
    if callable(getattr(accessor, "get", None)) and callable(getattr(accessor, "set", None)):
        return accessor  # type: ignore[no-any-return]
    return None


class TaskStateStore:
    """Keeps each shard's record in Airflow's task state store, one key per shard.

    Airflow scopes the store to (dag_id, run_id, task_id, map_index) and every try of that task
    instance shares it, so a retry on another worker finds what the killed try recorded without
    any shared disk. ``set`` returns after the API server committed the value. One small value
    per shard (about 0.5 KB, far under the 64 KB ``[state_store] max_value_storage_bytes``), not
    one document for the run: that would be rewritten twice per shard and pass the limit at about
    130 shards.

    :param accessor: ``context["task_state_store"]``.
    :param retention: how long a record is kept after its last write.
    """

    where = "Airflow's task state store"

    def __init__(self, accessor: TaskStateAccessor, retention: timedelta = STATE_RETENTION) -> None:
        self.accessor = accessor
        self.retention = retention

    def read(self, key: str) -> SubmitState | None:
        value = self.accessor.get(key)
        if value is None:
            return None
        try:
            return SubmitState.model_validate(value)
        except ValueError as exc:
            raise ConfigurationError(f"task state store record {key!r} is unreadable: {exc}") from None

    def write(self, state: SubmitState) -> None:
        self.accessor.set(state.key, state.model_dump(mode="json"), retention=self.retention)


def choose_state_store(
    context: Mapping[str, Any], choice: StateStoreChoice, file_directory: ObjectStoragePath
) -> SubmissionStateStore:
    """The store a submit keeps its records in: ``auto`` takes the task state store when the
    context has one, else the files under ``file_directory``."""
    accessor = task_state_accessor(context)
    if choice == "task_state_store" and accessor is None:
        raise ConfigurationError(
            "state_store='task_state_store' but this Airflow gives the task no task state store "
            "(it needs Airflow 3.3 or later); use 'auto' or 'file'"
        )
    if choice != "file" and accessor is not None:
        return TaskStateStore(accessor)
    return StateStore(file_directory)


class StateStore:
    """Reads and writes ``submit-state/<key>.json`` files atomically (Airflow without a task state store).

    :param directory: the ``submit-state`` directory (usually beside the manifest).
    """

    def __init__(self, directory: ObjectStoragePath) -> None:
        self.directory = directory

    @property
    def where(self) -> str:
        return str(self.directory)

    def path(self, key: str) -> ObjectStoragePath:
        return self.directory / f"{key}.json"

    def read(self, key: str) -> SubmitState | None:
        path = self.path(key)
        if not path.exists():
            return None
        with open_read(path) as handle:
            data = handle.read()
        try:
            return SubmitState.model_validate_json(data)
        except ValueError as exc:
            raise ConfigurationError(f"submission state file {path} is unreadable: {exc}") from None

    def write(self, state: SubmitState) -> None:
        with atomic_writer(self.path(state.key)) as handle:
            handle.write(orjson.dumps(state.model_dump(mode="json"), option=orjson.OPT_INDENT_2))


def now_utc() -> datetime:
    return datetime.now(timezone.utc)
