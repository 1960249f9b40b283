"""Apache Airflow provider for LLM batch inference over OpenAI-compatible Batch APIs.

The operators, the sensor, the trigger and the hook are importable from the package itself
(``from airflow_batch_provider import SqlToBatchJsonlOperator``). They are loaded on first use,
not here: importing them pulls in Airflow (seconds), and ``airflow-batch validate`` / ``prepare``
import this package without wanting Airflow at all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from airflow_batch_provider.hooks.batch import BatchApiHook
    from airflow_batch_provider.operators.build import SqlToBatchJsonlOperator
    from airflow_batch_provider.operators.merge import MergeBatchResultsOperator
    from airflow_batch_provider.operators.submit import SubmitBatchOperator
    from airflow_batch_provider.sensors.batch import BatchSensor
    from airflow_batch_provider.triggers.batch import BatchTrigger

# Exported name -> the module defining it, imported when the name is first read.
_LAZY: dict[str, str] = {
    "SqlToBatchJsonlOperator": "airflow_batch_provider.operators.build",
    "SubmitBatchOperator": "airflow_batch_provider.operators.submit",
    "MergeBatchResultsOperator": "airflow_batch_provider.operators.merge",
    "BatchSensor": "airflow_batch_provider.sensors.batch",
    "BatchTrigger": "airflow_batch_provider.triggers.batch",
    "BatchApiHook": "airflow_batch_provider.hooks.batch",
}

__all__ = [
    "BatchApiHook",
    "BatchSensor",
    "BatchTrigger",
    "MergeBatchResultsOperator",
    "SqlToBatchJsonlOperator",
    "SubmitBatchOperator",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """Import an exported class on first access (PEP 562) and cache it on the package.

    :param name: the attribute asked for.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
