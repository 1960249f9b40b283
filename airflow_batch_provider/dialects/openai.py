"""OpenAI: the baseline Batch API wire format (see ``base.Dialect``)."""

from __future__ import annotations

from airflow_batch_provider.dialects.base import Dialect


class OpenAIDialect(Dialect):
    """OpenAI's Files + Batches API, and any server that copies it exactly."""

    name = "openai"
    label = "OpenAI (and compatible)"
    console_url_template = "https://platform.openai.com/batches/{batch_id}"
