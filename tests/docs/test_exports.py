"""The package's top level exports the operators, the sensor, the trigger and the hook, lazily."""

from __future__ import annotations

import importlib
import subprocess
import sys

import airflow_batch_provider

EXPECTED = {
    "SqlToBatchJsonlOperator": "airflow_batch_provider.operators.build",
    "SubmitBatchOperator": "airflow_batch_provider.operators.submit",
    "MergeBatchResultsOperator": "airflow_batch_provider.operators.merge",
    "BatchSensor": "airflow_batch_provider.sensors.batch",
    "BatchTrigger": "airflow_batch_provider.triggers.batch",
    "BatchApiHook": "airflow_batch_provider.hooks.batch",
}


def test_every_exported_name_is_the_class_of_its_module() -> None:
    assert set(EXPECTED) | {"__version__"} == set(airflow_batch_provider.__all__)
    for name, module in EXPECTED.items():
        value = getattr(airflow_batch_provider, name)
        assert value is getattr(importlib.import_module(module), name), name
        assert value.__module__ == module
        assert name in dir(airflow_batch_provider)


def test_star_import_gives_every_export() -> None:
    namespace: dict[str, object] = {}
    exec("from airflow_batch_provider import *", namespace)
    assert set(EXPECTED) <= set(namespace)


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        airflow_batch_provider.NoSuchOperator  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchOperator" in str(exc)
    else:
        raise AssertionError("an unknown name was found")


def test_importing_the_package_does_not_import_airflow() -> None:
    """The CLI's file commands import the package and must stay quick: the exports load on use."""
    code = (
        "import sys, airflow_batch_provider\n"
        "loaded = sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))\n"
        "assert not loaded, loaded\n"
        "from airflow_batch_provider import SqlToBatchJsonlOperator\n"
        "assert 'airflow' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
