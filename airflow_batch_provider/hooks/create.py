"""Creating a batch, and finding the batch a create may have made (after an ambiguous create, or
an earlier try's crash).

A create is billed, so one that failed ambiguously (read timeout, dropped connection, 5xx,
409) is not simply sent again: the batch is looked for by the tags it was created with.
:func:`newest_created` is the one lookup (the hook's lost-create recovery and the submit
operator's orphan search both use it, through ``BatchApiHook.find_created_batch``) and
:class:`BatchCreate` holds the request and the decisions of the recovery, without I/O, for
both hook loops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_batch_provider.dialects import Dialect
from airflow_batch_provider.exceptions import BatchApiError, ConfigurationError
from airflow_batch_provider.hooks import calls
from airflow_batch_provider.hooks.attempts import AmbiguousCreate, message_of, with_note
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.hooks.transport import FileBody
from airflow_batch_provider.models import Batch

# After an ambiguous create, how many times to look for the batch (each after a settle delay)
# before sending the create again: a vendor still working on a timed-out request, or a
# listing that lags behind creates, gets a second chance to show the batch.
AMBIGUOUS_LOOKUPS = 2
# A vendor's created_at is its own clock: a batch created this much before our clock said the
# create was sent is still looked at when finding a lost inline create.
CLOCK_SKEW = timedelta(seconds=60)
# How many of the newest batches such a lookup reads at most.
INLINE_SCAN = 10_000


@dataclass
class InlineMatch:
    """The batches that may be a lost inline create: created since ``since``, holding exactly
    ``requests`` requests (a vendor without tags, whose listing has no filter). Fed a listing
    newest first, it says when the rest is older than ``since``.

    :param since: when the create may first have been acted on (its intent, less the clock skew).
    :param requests: the create's request count.
    :param exclude: ids known to be other shards' batches.
    """

    since: datetime
    requests: int
    exclude: frozenset[str] = frozenset()
    found: list[Batch] = field(default_factory=list)

    def see(self, batch: Batch) -> bool:
        """Consider one listed batch; False once the listing is past ``since`` (stop reading)."""
        if batch.created_at is not None and batch.created_at < self.since:
            return False
        if batch.id not in self.exclude and batch.request_counts.total == self.requests:
            self.found.append(batch)
        return True


def create_identity(
    dialect: Dialect, body: Mapping[str, Any], metadata: Mapping[str, str] | None, name: str | None
) -> dict[str, str] | None:
    """The tags by which a batch created from ``body`` can be found again, or None if it cannot."""
    if not metadata and not name:
        return None
    if dialect.supports_metadata:
        # As the vendor keeps them: a pair it cuts or drops (a Vertex AI label) is looked for so.
        return dialect.stored_metadata(metadata) or None
    # A dialect without metadata carries the identity in the batch name, when the caller chose one.
    body_name = dialect.create_name(body)
    chosen = {name, *(metadata or {}).values()} - {None}
    if isinstance(body_name, str) and body_name in chosen:
        return {"name": body_name}
    return None


def made_from(batch: Batch, input_file_id: str) -> bool:
    """Whether the batch may come from this input file (a listing that omits the file cannot tell)."""
    return batch.input_file_id in (None, input_file_id)


def newest_created(
    batches: Iterable[Batch],
    *,
    input_file_id: str | None = None,
    accept: Callable[[Batch], bool] | None = None,
) -> Batch | None:
    """The newest of ``batches`` made from ``input_file_id`` (any if None) that ``accept`` takes.

    A batch made from another file is not the one looked for, whatever its tags say (xAI
    carries no fingerprint tag, only the batch's input file). Newest: if an earlier try also
    created one, the latest matches this call.
    """
    found = [
        b
        for b in batches
        if (input_file_id is None or made_from(b, input_file_id)) and (accept is None or accept(b))
    ]
    if not found:
        return None
    return max(found, key=lambda b: (b.created_at is not None, b.created_at))


class BatchCreate:
    """One ``create_batch`` call apart from its I/O: its request, and what follows ambiguous failures.

    After each: look for the batch, send the create again, or give up and say why.

    :param settings: the connection's settings (dialect, retry policy).
    :param log: where the create and its recovery are logged.
    :param input_file_id: the uploaded input file.
    :param endpoint: the url every line targets.
    :param completion_window: the vendor's window.
    :param metadata: tags identifying the run; also how a lost create is found again.
    :param name: a batch name, for dialects that name batches.
    :param model: the file's one model, for dialects whose ``model_placement`` is "job".
    :param inline: the body of an "inline" create (its requests), streamed from a local file;
        ``input_file_id`` is then None.
    :param output_uri: for an "object_store" create, the prefix its results are written under
        (``input_file_id`` is then the encoded shard's URI).
    :param not_these: batch ids that are not this create's, left out when looking for it.
    """

    def __init__(
        self,
        settings: BatchApiSettings,
        log: Any,
        input_file_id: str | None,
        endpoint: str,
        completion_window: str,
        metadata: Mapping[str, str] | None,
        name: str | None,
        *,
        model: str | None = None,
        inline: FileBody | None = None,
        output_uri: str | None = None,
        not_these: Iterable[str] = (),
    ) -> None:
        dialect = settings.dialect
        if dialect.model_placement == "job" and not model:
            raise ConfigurationError(
                f"dialect {dialect.name!r} takes the model on the batch, not on each line: "
                "pass model= (submit takes it from the file's lines)"
            )
        dialect.check_completion_window(completion_window)
        if endpoint:
            dialect.check_endpoint(endpoint)
        if metadata and dialect.supports_metadata and len(metadata) > dialect.max_metadata_pairs:
            raise ConfigurationError(
                f"{len(metadata)} metadata pairs given; "
                f"dialect {dialect.name!r} allows {dialect.max_metadata_pairs}"
            )
        if (dialect.submission_mode == "inline") != (inline is not None) or (
            inline is None and not input_file_id
        ):
            raise ConfigurationError(
                f"dialect {dialect.name!r} submits "
                + (
                    "its requests inline in the create call"
                    if dialect.submission_mode == "inline"
                    else "a file"
                )
                + ": pass "
                + (
                    "inline= (the submit operator builds it)"
                    if dialect.submission_mode == "inline"
                    else "input_file_id="
                )
            )
        if (dialect.submission_mode == "object_store") != (output_uri is not None):
            raise ConfigurationError(
                f"dialect {dialect.name!r} "
                + (
                    "runs jobs on object storage: pass input_file_id= (the input's URI) and output_uri="
                    if dialect.submission_mode == "object_store"
                    else "takes no output_uri (its results are not written to object storage)"
                )
            )
        self.settings = settings
        self.log = log
        self.input_file_id = input_file_id
        # An inline create of a known size can be found again by its time and request count.
        self.inline_requests = (
            inline.requests if inline is not None and dialect.orphan_lookup == "time_and_count" else None
        )
        self.since = datetime.now(timezone.utc) - CLOCK_SKEW
        self.not_these = frozenset(not_these)
        self.source = f"file {input_file_id}" if input_file_id else (inline.filename if inline else "?")
        if inline is not None:
            # Whatever the create body holds beside the requests is the dialect's; the requests
            # are streamed from the file, which the caller framed with these fields.
            self.identity = None
            self.call = calls.create_inline(dialect, inline)
        elif output_uri is not None:
            assert input_file_id is not None
            body = dialect.object_create_body(
                input_uri=input_file_id,
                output_uri=output_uri,
                endpoint=endpoint,
                completion_window=completion_window,
                metadata=metadata,
                name=name,
                model=model,
            )
            self.identity = create_identity(dialect, body, metadata, name)
            self.call = calls.create_batch(dialect, body, input_file_id, model, endpoint)
        else:
            assert input_file_id is not None
            body = dialect.create_batch_body(
                input_file_id=input_file_id,
                endpoint=endpoint,
                completion_window=completion_window,
                metadata=metadata,
                name=name,
                model=model,
            )
            self.identity = create_identity(dialect, body, metadata, name)
            self.call = calls.create_batch(dialect, body, input_file_id, model, endpoint)
        self.action = self.call.action
        self.retry = 0

    def created(self, batch: Batch) -> Batch:
        self.log.info("Created batch %s from %s", batch.id, self.source)
        return batch

    def failed(self, exc: AmbiguousCreate) -> dict[str, str]:
        """Count an ambiguous failure; the tags to look for, or raise when the batch cannot be found."""
        error = exc.error
        if self.identity is None and self.inline_requests is not None:
            if self.retry >= self.settings.retry.max_retries:
                raise error from exc
            self.log.warning(
                "Batch create failed ambiguously (%s); looking for a batch of %d request(s) created "
                "since %s before retrying",
                type(error).__name__,
                self.inline_requests,
                self.since.isoformat(),
            )
            self.retry += 1
            return {}
        if self.identity is None:
            raise with_note(
                error,
                "the batch may have been created, so the request was not repeated "
                "(pass metadata so a lost create can be found and retried safely)",
            ) from exc
        if self.retry >= self.settings.retry.max_retries:
            raise error from exc
        self.log.warning(
            "Batch create failed ambiguously (%s); looking for a batch tagged %s before retrying",
            type(error).__name__,
            sorted(self.identity),
        )
        self.retry += 1
        return self.identity

    def inline_match(self) -> InlineMatch | None:
        """The lookup of this inline create's batch, or None for a create found by its tags."""
        if self.inline_requests is None:
            return None
        return InlineMatch(since=self.since, requests=self.inline_requests, exclude=self.not_these)

    @staticmethod
    def one_inline(exc: AmbiguousCreate, match: InlineMatch) -> Batch | None:
        """The one batch the lookup found; several are not guessed between (raised with their ids)."""
        if len(match.found) > 1:
            raise with_note(
                exc.error,
                f"the batch may have been created and {len(match.found)} batches with its "
                f"{match.requests} request(s) were created since: {', '.join(b.id for b in match.found)}; "
                "not retried and none adopted",
            ) from exc.error
        return match.found[0] if match.found else None

    def settle(self, exc: AmbiguousCreate) -> float:
        """Seconds to let the create settle before the next look for its batch."""
        return self.settings.retry.settle_delay(self.retry - 1, exc.response)

    @staticmethod
    def lookup_failed(exc: AmbiguousCreate, lookup: BatchApiError) -> BatchApiError:
        """Whether the batch exists is unknown, so neither retry nor pretend: say both failures."""
        return with_note(
            exc.error,
            f"the batch may have been created and looking for it failed too ({message_of(lookup)}); "
            "not retried to avoid a duplicate",
        )

    def adopt(self, batch: Batch) -> Batch:
        self.log.warning("%s: the lost create had succeeded; using batch %s", self.action, batch.id)
        return batch
