"""Provider metadata read by Airflow's ProvidersManager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_batch_provider import __version__
from airflow_batch_provider.constants import CONN_TYPE
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
        "config": {
            "batch_provider": {
                "description": "Settings of the LLM batch provider.",
                "options": {
                    "staging_root": {
                        "description": (
                            "Where the build operator stages batch files when a task gives no "
                            "staging_path: a local path or any ObjectStoragePath URL. Default: "
                            "$AIRFLOW_HOME/batch-staging."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://my-bucket/batch-staging",
                        "default": None,
                    },
                    "triggerer_gc_freeze": {
                        "description": (
                            "Call gc.freeze() once in the triggerer when the first BatchTrigger "
                            "starts, so full garbage collections no longer walk Airflow's own "
                            "modules and stall every trigger's event loop for 100+ ms. Changes "
                            "the whole triggerer process; off by default."
                        ),
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
                    },
                },
            }
        },
        "connection-types": [
            {
                "hook-class-name": "airflow_batch_provider.hooks.batch.BatchApiHook",
                "connection-type": CONN_TYPE,
                "hook-name": "LLM Batch API",
                "conn-fields": CONN_FIELDS,
                "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
            }
        ],
    }
