"""Extra links from the submit and sensor tasks to a page per batch: the vendor's console or the local server.

Which page a connection's batches have, first rule that applies:

1. the connection extra ``console_url_template`` (``{batch_id}`` and ``{origin}`` are filled in;
   ``none`` turns the links off);
2. the connection points at the vendor's own API host (the dialect's ``default_base_url``) and
   the dialect knows a console URL (``Dialect.console_url_template``; OpenAI only: the other
   vendors document no per-batch page, so they get no link rather than a guessed one);
3. the connection extra ``local_server`` is true, or (not set) the server's ``/health`` answers
   the local batch server's identity (``status``, ``dialect`` and ``backend``): the local
   server's page ``{origin}/ui/batches/{batch_id}``;
4. otherwise no link.

Whatever the rule, a link is given only to a web page: ``https://``, or ``http://`` to a loopback
host or to the connection's own API host (the local server in a compose network); a template
that yields ``javascript:``, ``data:``, ``file:`` or any other URL gives no link and a warning
(naming the connection and the scheme, nothing more). The batch id fills one path segment,
percent-encoded; an id no vendor issues (``..``, ``/``...) gets no link.

A task has one link per batch for its first :data:`MAX_BATCH_LINKS` batches ("Batch 1", ...),
the way providers show several runs of one task: Airflow names links per operator class, so
each slot is a class. Further batches are listed in the task's XCom, not linked. The worker
computes the links when the task ends or defers (Airflow stores each in XCom for the UI and the
REST API), from the batch ids the task pushed under :data:`BATCH_IDS_XCOM_KEY`.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from airflow.sdk import BaseOperatorLink

from airflow_batch_provider.exceptions import InvalidIdError
from airflow_batch_provider.ids import path_segment

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

    from airflow_batch_provider.hooks.settings import BatchApiSettings

log = logging.getLogger(__name__)

BATCH_IDS_XCOM_KEY = "batch_ids"
MAX_BATCH_LINKS = 4
LOCAL_PAGE_TEMPLATE = "{origin}/ui/batches/{batch_id}"
TEMPLATE_EXTRA = "console_url_template"
LOCAL_SERVER_EXTRA = "local_server"
_OFF = frozenset({"none", "off", "false", "no", "-"})
_PROBE_TIMEOUT = 3.0


def origin_of(base_url: str) -> str:
    """The server root of an API base URL: ``http://host:port/v1`` -> ``http://host:port``."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if path.rsplit("/", 1)[-1].lower() in ("v1", "v1beta"):
        path = path.rsplit("/", 1)[0]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def is_local_server(origin: str, timeout: float = _PROBE_TIMEOUT) -> bool:
    """True when ``origin/health`` answers like ``airflow-batch serve`` (no credentials are sent)."""
    import httpx

    try:
        response = httpx.get(f"{origin}/health", timeout=timeout, follow_redirects=False)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "ok" and {"dialect", "backend"} <= set(body)


def page_template(settings: BatchApiSettings, *, probe: bool = True) -> str | None:
    """The URL template of a batch's page for this connection, or None (see the module's rules)."""
    extra = settings.extra
    explicit = extra.get(TEMPLATE_EXTRA)
    if explicit is not None:
        text = str(explicit).strip()
        return None if text.lower() in _OFF else text
    dialect = settings.dialect
    if dialect.console_url_template and _same_host(settings.base_url, dialect.default_base_url):
        return dialect.console_url_template
    flag = extra.get(LOCAL_SERVER_EXTRA)
    if flag is not None:
        local = flag if isinstance(flag, bool) else str(flag).strip().lower() in ("true", "1", "yes", "on")
    else:
        local = probe and is_local_server(origin_of(settings.base_url))
    return LOCAL_PAGE_TEMPLATE if local else None


def batch_page_urls(settings: BatchApiSettings, batch_ids: Sequence[str], *, probe: bool = True) -> list[str]:
    """One page URL per batch id (``""`` for an id no vendor issues), or an empty list when the
    connection has no batch page or its template yields no web page (see :func:`web_page`)."""
    template = page_template(settings, probe=probe) if batch_ids else None
    if template is None:
        return []
    origin = origin_of(settings.base_url)
    api_host = (urlsplit(settings.base_url).hostname or "").lower()
    urls: list[str] = []
    for batch_id in batch_ids:
        try:
            segment = path_segment(str(batch_id), "batch_id")
        except InvalidIdError:
            urls.append("")
            continue
        url = template.format(batch_id=segment, origin=origin)
        if not web_page(url, api_host):
            # The template is the connection's (or the dialect's): every id would give the same
            # kind of URL, so no link at all. The scheme only: the URL may carry anything.
            scheme = urlsplit(url).scheme if url.isprintable() else "?"
            log.warning(
                "No batch page links for connection %r: its page template gives a %r URL; links "
                "go only to https://, or http:// on a loopback host or the API's own host",
                settings.conn_id,
                scheme[:20],
            )
            return []
        urls.append(url)
    return urls


def web_page(url: str, api_host: str = "") -> bool:
    """Whether ``url`` is a web page a link may open: ``https://``, or ``http://`` to a loopback
    host or to ``api_host`` (the connection's own API host, which gets the key anyway).

    Anything else is refused: ``javascript:``, ``data:``, ``file:``, no host, credentials before
    the host, or whitespace and control characters (browsers drop some, turning ``java\tscript:``
    into ``javascript:``).

    :param url: the link.
    :param api_host: the connection's API host name, lower-cased.
    """
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        return False
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    if not host or "@" in parts.netloc or "\\" in url:
        return False
    scheme = parts.scheme.lower()
    if scheme == "https":
        return True
    return scheme == "http" and (_is_loopback(host) or host == api_host)


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _same_host(url: str, other: str) -> bool:
    return (urlsplit(url).hostname or "").lower() == (urlsplit(other).hostname or "").lower()


def _links_of(operator: Any, ti_key: TaskInstanceKey) -> list[str]:
    """The task's batch page URLs, computed once per task instance try (every slot asks)."""
    key = (ti_key.dag_id, ti_key.run_id, ti_key.task_id, ti_key.map_index, getattr(ti_key, "try_number", 0))
    cached = getattr(operator, "_batch_page_links", None)
    if cached is not None and cached[0] == key:
        return list(cached[1])
    from airflow.sdk.execution_time.xcom import XCom

    urls: list[str] = []
    try:
        ids = XCom.get_value(ti_key=ti_key, key=BATCH_IDS_XCOM_KEY)
        if ids:
            urls = batch_page_urls(operator.hook().get_settings(), [str(i) for i in ids])
    except Exception as exc:
        # A link is a convenience: never fail or clutter the task for it. The message names no secret.
        log.warning("No batch page links for %s: %s", ti_key.task_id, type(exc).__name__)
    operator._batch_page_links = (key, urls)
    return urls


class BatchPageLink(BaseOperatorLink):
    """Link to the page of the task's batch number ``slot + 1`` (empty when there is none)."""

    slot: ClassVar[int] = 0
    name = "Batch 1"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        urls = _links_of(operator, ti_key)
        return urls[self.slot] if self.slot < len(urls) else ""


class BatchPageLink2(BatchPageLink):
    slot = 1
    name = "Batch 2"


class BatchPageLink3(BatchPageLink):
    slot = 2
    name = "Batch 3"


class BatchPageLink4(BatchPageLink):
    slot = 3
    name = "Batch 4"


BATCH_PAGE_LINK_CLASSES: tuple[type[BatchPageLink], ...] = (
    BatchPageLink,
    BatchPageLink2,
    BatchPageLink3,
    BatchPageLink4,
)
assert len(BATCH_PAGE_LINK_CLASSES) == MAX_BATCH_LINKS


def batch_page_links() -> tuple[BatchPageLink, ...]:
    """The links an operator declares in ``operator_extra_links``."""
    return tuple(cls() for cls in BATCH_PAGE_LINK_CLASSES)


def push_batch_ids(context: Any, batch_ids: Sequence[str]) -> None:
    """Record the task's batch ids for its links (before any wait: a deferred task shows them too)."""
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is not None and hasattr(ti, "xcom_push"):
        ti.xcom_push(key=BATCH_IDS_XCOM_KEY, value=[str(b) for b in batch_ids])
