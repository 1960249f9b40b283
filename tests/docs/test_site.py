"""The documentation site: strict offline build, a section and a working connection per vendor and
warehouse, and code snippets that import what they use."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import airflow_batch_provider
from airflow_batch_provider.dialects import DIALECTS, dialect_class
from tests.docs.pages import DOCS, ROOT, blocks, pages

# Not --quiet: it hides the warnings that --strict counts, and the build then passes whatever breaks.
MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict"]
CONNECTIONS = DOCS / "connections.md"
WAREHOUSE_TYPES = {"postgres", "duckdb", "sqlite", "mysql", "bigquery", "snowflake"}


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [*MKDOCS, "--site-dir", str(site)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _copy_site_sources(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    shutil.copytree(DOCS, root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(ROOT / "airflow_batch_provider", root / "airflow_batch_provider")
    return root


@pytest.mark.slow
def test_site_builds_strictly_offline_and_a_broken_link_fails_it(tmp_path: Path) -> None:
    root = _copy_site_sources(tmp_path)
    built = _build(root, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    html = "\n".join(p.read_text(errors="replace") for p in (tmp_path / "site").rglob("*.html"))
    # Offline pages: no web font service, no script or stylesheet from another host.
    assert "fonts.googleapis" not in html and "fonts.gstatic" not in html
    assert not re.findall(r"<(?:script|link)[^>]+(?:src|href)=\"https?://", html)
    assert "SqlToBatchJsonlOperator" in (tmp_path / "site" / "operators" / "build" / "index.html").read_text()

    page = root / "docs" / "staging.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    broken = _build(root, tmp_path / "site2")
    assert broken.returncode != 0
    assert "no-such-page.md" in broken.stdout + broken.stderr


def test_every_nav_entry_and_page_agree() -> None:
    """Each page is in the nav and each nav entry is a page (a new page must be placed)."""
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert nav == on_disk


def _json_blocks(page: Path) -> list[dict[str, object]]:
    found = []
    for block in blocks(page):
        if block.lang == "json":
            try:
                found.append(json.loads(block.body))
            except ValueError as exc:
                raise AssertionError(f"{block.where()}: not JSON: {exc}") from None
    return found


def test_connections_page_has_a_section_and_a_working_connection_per_dialect() -> None:
    from airflow.models.connection import Connection

    from airflow_batch_provider.hooks.settings import settings_from_connection

    text = CONNECTIONS.read_text()
    specs = _json_blocks(CONNECTIONS)
    batch = [s for s in specs if s["conn_type"] == "batch_api"]
    for name in DIALECTS:
        label = dialect_class(name).label
        assert re.search(rf"^### .*\(`{name}`\)\s*$", text, re.M), f"no section for dialect {name} ({label})"
        assert any(s.get("extra", {}).get("dialect") == name for s in batch), f"no JSON connection for {name}"
    for spec in batch:
        conn = Connection.from_json(json.dumps(spec), conn_id="docs")
        settings = settings_from_connection("docs", conn, conn.extra_dejson, conn_type="batch_api")
        assert settings.dialect.name == spec["extra"]["dialect"]  # type: ignore[index]


def test_connections_page_has_a_section_and_json_per_warehouse() -> None:
    text = CONNECTIONS.read_text()
    types = {s["conn_type"] for s in _json_blocks(CONNECTIONS)}
    assert types >= {"postgres", "duckdb", "sqlite", "mysql"}
    for title in ("PostgreSQL", "DuckDB", "SQLite", "MySQL", "BigQuery", "Snowflake"):
        assert re.search(rf"^### {title}", text, re.M), title
    # BigQuery's and Snowflake's connections are shell exports: their JSON must parse too.
    for conn_id in ("BIGQUERY_WAREHOUSE", "SNOWFLAKE_DEFAULT"):
        match = re.search(rf"AIRFLOW_CONN_{conn_id}='(.*?)'", text, re.S)
        assert match, conn_id
        assert json.loads(match[1])["conn_type"] in WAREHOUSE_TYPES


# Names a snippet may use only after importing them: the package's exports and Airflow's DAG API.
_MUST_IMPORT = {*airflow_batch_provider.__all__, "DAG", "Asset", "task", "Param", "datetime", "timedelta"}


def _python_blocks() -> list[tuple[str, str]]:
    return [(b.where(), b.body) for page in pages() for b in blocks(page) if b.lang == "python"]


def test_there_are_python_snippets() -> None:
    assert len(_python_blocks()) >= 6


@pytest.mark.parametrize(("where", "source"), _python_blocks(), ids=[w for w, _ in _python_blocks()])
def test_python_snippet_imports_what_it_uses(where: str, source: str) -> None:
    tree = ast.parse(source, filename=where)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
                imported.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    missing = sorted((used & _MUST_IMPORT) - imported)
    assert not missing, f"{where}: uses {missing} without importing them"


def test_readme_links_into_the_site_resolve() -> None:
    """The front page links into docs/: every relative link names a page that exists."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?!https?://)[^)#\s]+)(?:#[^)]*)?\)", readme)
    assert sum(link.startswith("docs/") for link in links) >= 15
    broken = [link for link in links if not (ROOT / link).exists()]
    assert not broken, broken
    assert len(readme.splitlines()) <= 250


def test_readme_vendor_matrix_has_every_dialect() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| [^|]*\(`(\w+)`\) \|", readme, re.M)
    assert set(rows) - {"dialect"} == set(DIALECTS), rows  # "dialect" is the header
