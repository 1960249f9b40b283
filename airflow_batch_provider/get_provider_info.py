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
            {
                "integration-name": "LLM Batch API",
                "python-modules": ["airflow_batch_provider.hooks.bigquery"],
            },
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
                "python-modules": [
                    "airflow_batch_provider.triggers.batch",
                    "airflow_batch_provider.triggers.queue",
                ],
            },
        ],
        # Listed by name: importing links.py loads the Task SDK, which discovery must not need.
        "extra-links": [
            "airflow_batch_provider.links.BatchPageLink",
            "airflow_batch_provider.links.BatchPageLink2",
            "airflow_batch_provider.links.BatchPageLink3",
            "airflow_batch_provider.links.BatchPageLink4",
        ],
        "config": {
            "batch_provider": {
                "description": "Settings of the LLM batch provider.",
                "options": {
                    "staging_root": {
                        "description": (
                            "The default staging root of every operator: the build writes shards, keys, "
                            "rejects and the manifest to <staging_root>/<dag_id>/<run_id>/<task_id> when "
                            "it is given no staging_path, and submission state, resubmission shards and "
                            "the merge follow the manifest there. A local path or any ObjectStoragePath "
                            "URL, with the connection before the bucket (s3://aws_conn_id@bucket/prefix, "
                            "gs://gcp_conn_id@bucket/prefix). Default: $AIRFLOW_HOME/batch-staging. On a "
                            "distributed executor (anything but LocalExecutor) local staging fails the "
                            "build at once unless local_staging_is_shared is set."
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "s3://aws_default@my-bucket/batch-staging",
                        "default": None,
                    },
                    "local_staging_is_shared": {
                        "description": (
                            "Set when a local staging path is a filesystem every worker mounts (NFS, "
                            "EFS...): a Celery, Kubernetes or Edge deployment then may stage on it."
                        ),
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "True",
                        "default": "False",
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
                    "shared_polling": {
                        "description": (
                            "BatchTriggers of one connection in one triggerer read their batches "
                            "together: one listing of the vendor's batches (a page per 100) per "
                            "cycle instead of one call per batch per poll interval, and a get per "
                            "batch the listing did not show. False brings back one poll per trigger. "
                            "The connection extra shared_polling wins."
                        ),
                        "version_added": "0.1.0",
                        "type": "boolean",
                        "example": "False",
                        "default": "True",
                    },
                    "poll_calls_per_minute": {
                        "description": (
                            "Ceiling of vendor calls per minute per connection made by shared "
                            "polling in one triggerer (listing pages, gets, retries); 0 turns it "
                            "off. The connection extra poll_calls_per_minute wins."
                        ),
                        "version_added": "0.1.0",
                        "type": "integer",
                        "example": "300",
                        "default": "600",
                    },
                },
            }
        },
        # gs:// staging through gcsfs when the google provider (which serves gs://) is absent.
        "filesystems": ["airflow_batch_provider.fs.gcs"],
        "connection-types": [
            {
                "hook-class-name": "airflow_batch_provider.hooks.batch.BatchApiHook",
                "connection-type": CONN_TYPE,
                "hook-name": "LLM Batch API",
                "conn-fields": CONN_FIELDS,
                "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
            },
            # A warehouse: results tables and build sources on BigQuery (the bigquery extra).
            {
                "hook-class-name": "airflow_batch_provider.hooks.bigquery.BigQuerySqlHook",
                "connection-type": "bigquery",
                "hook-name": "BigQuery (LLM Batch warehouse)",
            },
        ],
    }
