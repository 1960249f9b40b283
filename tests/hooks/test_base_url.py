"""No credentials in the base URL: a host with ``user:password@`` is refused, and never echoed.

Before, such a host sent Basic auth in place of the Bearer key and showed the password in extra
links, ``test_connection`` text, the settings' ``repr`` and 404 messages.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.hooks.batch import BatchApiHook
from airflow_batch_provider.hooks.retry import RetryPolicy
from airflow_batch_provider.hooks.settings import BatchApiSettings, normalize_base_url
from airflow_batch_provider.links import batch_page_urls
from tests.fixtures.hostile import HostileServer, reply

PASSWORD = "url-pass-31337"


def hosts(server: HostileServer) -> list[str]:
    """The forms a host with credentials takes (full URL, no scheme, password only, user only)."""
    where = f"127.0.0.1:{server.port}"
    return [
        f"http://user:{PASSWORD}@{where}/v1",
        f"user:{PASSWORD}@{where}",
        f"http://:{PASSWORD}@{where}/v1",
        f"http://{PASSWORD}@{where}/v1",
        f"http://user:{PASSWORD}@{where}/v1/missing",
    ]


async def test_a_host_with_credentials_is_refused_before_any_call(
    hostile_server: Callable[[], HostileServer], batch_conn: Callable[..., str]
) -> None:
    api = hostile_server()
    api.route("/v1/batches/b1", reply(200, {"id": "b1", "status": "completed"}))
    for number, host in enumerate(hosts(api)):
        conn_id = batch_conn(f"creds{number}", host=host, console_url_template="{origin}/b/{batch_id}")
        hook = BatchApiHook(conn_id, retry_policy=RetryPolicy(max_retries=0), timeout=5.0)
        with pytest.raises(ConfigurationError, match="carries credentials") as sync_error:
            hook.get_batch("b1")
        with pytest.raises(ConfigurationError, match="carries credentials") as async_error:
            await hook.aget_batch("b1")
        for error in (sync_error.value, async_error.value):
            assert PASSWORD not in str(error)
            assert "***@127.0.0.1" in str(error)
        ok, message = hook.test_connection()
        assert not ok
        assert "carries credentials" in message
        assert PASSWORD not in message
    # No request left: the password never went out as Basic auth in place of the key.
    assert api.requests == []


@pytest.mark.parametrize("host", [f"http://u:{PASSWORD}@", f"http://u:{PASSWORD}@/v1", f"u:{PASSWORD}@"])
def test_a_host_that_is_only_credentials_is_refused_without_echoing_them(host: str) -> None:
    with pytest.raises(ConfigurationError, match="carries credentials") as info:
        normalize_base_url(host, default="https://api.openai.com/v1")
    assert PASSWORD not in str(info.value)


def test_settings_built_by_hand_refuse_credentials_so_no_repr_or_link_shows_them() -> None:
    url = f"http://user:{PASSWORD}@127.0.0.1:9/v1"
    with pytest.raises(ConfigurationError, match="base_url 'http://\\*\\*\\*@127.0.0.1:9/v1'") as info:
        BatchApiSettings(conn_id="c", base_url=url, dialect=get_dialect("openai"))
    assert PASSWORD not in str(info.value)
    # The same settings without credentials still link as before.
    settings = BatchApiSettings(
        conn_id="c",
        base_url="http://127.0.0.1:9/v1",
        dialect=get_dialect("openai"),
        extra={"console_url_template": "{origin}/b/{batch_id}"},
    )
    assert batch_page_urls(settings, ["b1"], probe=False) == ["http://127.0.0.1:9/b/b1"]


@pytest.mark.parametrize(
    "host", ["http://127.0.0.1:9/v1?api-version=2024-10-01", "http://127.0.0.1:9/gw/a@b/v1"]
)
def test_an_at_sign_after_the_host_is_not_credentials(host: str) -> None:
    assert normalize_base_url(host, default="https://api.openai.com/v1") == host
