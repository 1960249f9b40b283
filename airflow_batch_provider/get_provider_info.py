"""Provider metadata read by Airflow's ProvidersManager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_batch_provider import __version__
from airflow_batch_provider.hooks.connection_form import CONN_FIELDS, UI_FIELD_BEHAVIOUR


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-batch-provider",
        "name": "LLM Batch",
        "description": (
            "LLM batch inference over OpenAI-compatible Batch APIs (OpenAI, Doubleword, ZeroGPU, xAI)."
        ),
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "LLM Batch API",
                "external-doc-url": "https://platform.openai.com/docs/guides/batch",
                "tags": ["software"],
            }
        ],
        "hooks": [
            {"integration-name": "LLM Batch API", "python-modules": ["airflow_batch_provider.hooks.batch"]},
        ],
        "operators": [
            {
                "integration-name": "LLM Batch API",
                "python-modules": [
                    "airflow_batch_provider.operators.build",
                    "airflow_batch_provider.operators.submit",
                    "airflow_batch_provider.operators.merge",
                ],
            }
        ],
        "sensors": [
            {"integration-name": "LLM Batch API", "python-modules": ["airflow_batch_provider.sensors.batch"]},
        ],
        "triggers": [
            {
                "integration-name": "LLM Batch API",
                "python-modules": ["airflow_batch_provider.triggers.batch"],
            },
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_batch_provider.hooks.batch.BatchApiHook",
                "connection-type": "batch_api",
                "hook-name": "LLM Batch API",
                "conn-fields": CONN_FIELDS,
                "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
            }
        ],
    }
