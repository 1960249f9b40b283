"""The names in ``constants.py`` are spelled there only: a hook, an operator and an example cannot drift."""

from __future__ import annotations

import ast
from pathlib import Path

from airflow_batch_provider import constants

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_conn_id_and_the_shard_tag_are_spelled_once() -> None:
    values = {constants.DEFAULT_CONN_ID, constants.SHARD_TAG}
    found = []
    for top in ("airflow_batch_provider", "dags_examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "constants.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in values:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert found == []
