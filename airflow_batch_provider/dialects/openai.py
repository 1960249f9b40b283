"""OpenAI: the baseline Batch API wire format (see ``base.Dialect``)."""

from __future__ import annotations

from airflow_batch_provider.dialects.base import Dialect


class OpenAIDialect(Dialect):
    """OpenAI's Files + Batches API, and any server that copies it exactly."""

    name = "openai"
    label = "OpenAI (and compatible)"
    console_url_template = "https://platform.openai.com/batches/{batch_id}"
    # OpenAI fails a batch whose tokens would pass the organisation's enqueued-token limit for
    # its model: errors.data[].code "token_limit_exceeded" ("Enqueued token limit reached for
    # <model> in organization ..."). Waiting for earlier batches cures it (a queue-aware submit
    # creates the shard again), so it is a quota failure, not failed rows.
    batch_quota_error_codes = frozenset({"token_limit_exceeded"})
