"""The ``batch_api`` connection form, declared the Airflow >= 3.2 way.

Kept apart from the hook (no httpx import) because ``get_provider_info`` reads it while
Airflow discovers providers.
"""

from __future__ import annotations

from typing import Any

from airflow_batch_provider.dialects import DIALECTS

# The dialect registry does not load Airflow, so the form reads it while providers are discovered.
DIALECT_NAMES = tuple(sorted(DIALECTS))

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 3

CONN_FIELDS: dict[str, dict[str, Any]] = {
    "dialect": {
        "label": "Dialect",
        "description": "Which vendor's wire format the API speaks.",
        "schema": {"type": ["string", "null"], "enum": list(DIALECT_NAMES), "default": "openai"},
    },
    "organization": {
        "label": "Organization",
        "description": "Optional organisation id sent with every request (OpenAI-style).",
        "schema": {"type": ["string", "null"]},
    },
    "project": {
        "label": "Project",
        "description": "Optional project id sent with every request.",
        "schema": {"type": ["string", "null"]},
    },
    "headers": {
        "label": "Extra headers",
        "description": "Optional JSON object of extra HTTP headers.",
        "schema": {"type": ["object", "null"], "format": "json"},
    },
    "timeout": {
        "label": "Timeout (seconds)",
        "schema": {"type": ["number", "null"], "default": DEFAULT_TIMEOUT, "minimum": 0},
    },
    "max_retries": {
        "label": "Max retries",
        "schema": {"type": ["integer", "null"], "default": DEFAULT_MAX_RETRIES, "minimum": 0},
    },
}
UI_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden-fields": ["port", "login", "schema"],
    "relabeling": {"host": "Base URL", "password": "API key"},
    "placeholders": {"host": "https://api.openai.com/v1", "password": "sk-..."},
}
