"""Modules talk to each other through public names only: no private module, name or conftest import.

A private name (``_x``) may change without notice, so nothing outside its own module may import
it; a test helper another file needs lives in a plain module (``tests/fixtures/``), not a conftest.
Third-party private imports (a monkeypatched library internal) are outside this rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Our own top-level packages: an import from these is held to the rule.
OWN = ("airflow_batch_provider", "tests")
SCANNED = ("airflow_batch_provider", "tests", "benchmarks", "dags_examples")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The module an ``ImportFrom`` names, with a relative import resolved against ``path``."""
    if not node.level:
        return node.module or ""
    package = _module_of(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def violations(path: Path, root: Path = ROOT) -> Iterator[str]:
    """Each import in ``path`` of a private module, a private name or a conftest of this project."""
    where = path.relative_to(root)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            modules = [_absolute(node, path, root)]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] not in OWN:
                continue
            if any(_private(part) for part in parts) or parts[-1] == "conftest":
                yield f"{where}:{node.lineno}: imports {module}"
            yield from (f"{where}:{node.lineno}: imports {module}.{n}" for n in names if _private(n))


def test_no_module_imports_a_private_module_or_name() -> None:
    found = [v for top in SCANNED for path in sorted((ROOT / top).rglob("*.py")) for v in violations(path)]
    assert found == []


def test_the_check_sees_each_kind_of_private_import(tmp_path: Path) -> None:
    """The rule catches what it is meant to (so an empty result above means something)."""
    sample = tmp_path / "tests" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import airflow_batch_provider.hooks._x\n"
        "from airflow_batch_provider.hooks._x import y\n"
        "from airflow_batch_provider.dialects.base import _helper\n"
        "from tests.hooks.conftest import SECRET\n"
        "from . import _sibling\n"
        "from psycopg import _copy_base\n"
        "from airflow_batch_provider.dialects.base import str_or_none\n"
    )
    assert [v.split(": ", 1)[1] for v in violations(sample, tmp_path)] == [
        "imports airflow_batch_provider.hooks._x",
        "imports airflow_batch_provider.hooks._x",
        "imports airflow_batch_provider.dialects.base._helper",
        "imports tests.hooks.conftest",
        "imports tests._sibling",
    ]
