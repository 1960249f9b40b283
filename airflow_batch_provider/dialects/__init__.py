"""Vendor dialects, picked by name from a registry (the connection's ``dialect`` field)."""

from __future__ import annotations

from airflow_batch_provider.dialects.anthropic import AnthropicDialect
from airflow_batch_provider.dialects.azure import AzureOpenAIDialect
from airflow_batch_provider.dialects.base import Dialect, ListPage, ResultsPage
from airflow_batch_provider.dialects.bedrock import BedrockDialect
from airflow_batch_provider.dialects.doubleword import DoublewordDialect
from airflow_batch_provider.dialects.gemini import GeminiDialect
from airflow_batch_provider.dialects.mistral import MistralDialect
from airflow_batch_provider.dialects.openai import OpenAIDialect
from airflow_batch_provider.dialects.vertex import VertexDialect
from airflow_batch_provider.dialects.xai import XAIDialect
from airflow_batch_provider.dialects.zerogpu import ZeroGPUDialect
from airflow_batch_provider.exceptions import UnknownDialectError
from airflow_batch_provider.limits import Limits, ValidationRules

DIALECTS: dict[str, type[Dialect]] = {
    cls.name: cls
    for cls in (
        OpenAIDialect,
        DoublewordDialect,
        ZeroGPUDialect,
        XAIDialect,
        MistralDialect,
        AnthropicDialect,
        AzureOpenAIDialect,
        GeminiDialect,
        VertexDialect,
        BedrockDialect,
    )
}


def dialect_class(name: str | None) -> type[Dialect]:
    """The dialect class registered under ``name`` (default ``openai``).

    Its rules (endpoints, limits, validation) are class attributes: reading them loads no models.
    """
    key = (name or "openai").strip().lower()
    try:
        return DIALECTS[key]
    except KeyError:
        raise UnknownDialectError(
            f"unknown dialect {name!r}; registered: {', '.join(sorted(DIALECTS))}"
        ) from None


def get_dialect(name: str | Dialect | None) -> Dialect:
    """Return the dialect registered under ``name`` (default ``openai``)."""
    if isinstance(name, Dialect):
        return name
    return dialect_class(name)()


__all__ = [
    "DIALECTS",
    "AnthropicDialect",
    "AzureOpenAIDialect",
    "BedrockDialect",
    "Dialect",
    "DoublewordDialect",
    "GeminiDialect",
    "Limits",
    "ListPage",
    "MistralDialect",
    "OpenAIDialect",
    "ResultsPage",
    "ValidationRules",
    "VertexDialect",
    "XAIDialect",
    "ZeroGPUDialect",
    "dialect_class",
    "get_dialect",
]
