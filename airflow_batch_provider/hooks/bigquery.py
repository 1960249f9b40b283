"""A common-sql hook for BigQuery built on ``google-cloud-bigquery`` (the ``bigquery`` extra).

The build and the merge resolve the warehouse through ``BaseHook.get_connection(...).get_hook()``
and insist on a ``DbApiHook``; this hook is that, for connections of type ``bigquery``, without
the google provider (``apache-airflow-providers-google`` pulls ~120 packages and pins openai and
tenacity below what this provider uses). Its connection:

* ``schema``: the default dataset (results and staging tables without a dataset of their own);
* ``password`` (secret): a service-account key as JSON; without it, Application Default Credentials;
* extras: ``project`` (else the credentials' project), ``location``, ``api_endpoint`` (an emulator
  or a private endpoint, e.g. ``http://127.0.0.1:9050``) and ``anonymous`` (true: no credentials,
  for an emulator such as bqemulator).

``get_conn()`` returns a small DB-API connection (:class:`BigQueryDbApiConnection`) whose
cursor runs each statement as a query job (``jobs.insert``) and reads its result page by page.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from airflow.providers.common.sql.hooks.sql import DbApiHook

from airflow_batch_provider.exceptions import ConfigurationError


class BigQuerySqlHook(DbApiHook):
    """A ``DbApiHook`` for BigQuery through ``google-cloud-bigquery``.

    :param bigquery_conn_id: the connection (type ``bigquery``).
    """

    conn_name_attr = "bigquery_conn_id"
    default_conn_name = "bigquery_default"
    conn_type = "bigquery"
    hook_name = "BigQuery (LLM Batch warehouse)"
    supports_autocommit = False
    placeholder = "%s"
    # BigQuery quotes identifiers with backticks.
    escape_word_format = "`{}`"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["host", "port", "login"],
            "relabeling": {"schema": "Default dataset", "password": "Service account key (JSON)"},
            "placeholders": {
                "extra": '{"project": "my-project", "location": "EU"}',
                "schema": "llm_results",
            },
        }

    def _settings(self) -> tuple[Any, dict[str, Any]]:
        conn = self.get_connection(getattr(self, self.conn_name_attr))
        return conn, dict(conn.extra_dejson or {})

    def get_client(self) -> Any:
        """A ``google.cloud.bigquery.Client`` for the connection (its default dataset set)."""
        try:
            from google.cloud import bigquery
        except ImportError as exc:
            raise ConfigurationError(
                "BigQuery needs google-cloud-bigquery: install airflow-batch-provider[bigquery]"
            ) from exc
        conn, extra = self._settings()
        project = extra.get("project") or None
        options: dict[str, Any] = {}
        if extra.get("api_endpoint"):
            from google.api_core.client_options import ClientOptions

            options["client_options"] = ClientOptions(api_endpoint=str(extra["api_endpoint"]))
        credentials = self._credentials(conn.password, bool(extra.get("anonymous")))
        if credentials is not None:
            options["credentials"] = credentials
            project = project or getattr(credentials, "project_id", None)
        client = bigquery.Client(project=project, location=extra.get("location") or None, **options)
        if conn.schema:
            dataset = conn.schema if "." in conn.schema else f"{client.project}.{conn.schema}"
            client.default_query_job_config = bigquery.QueryJobConfig(default_dataset=dataset)
        return client

    @staticmethod
    def _credentials(key_json: str | None, anonymous: bool) -> Any:
        if anonymous:
            from google.auth.credentials import AnonymousCredentials

            return AnonymousCredentials()
        if not key_json:
            return None  # Application Default Credentials
        import json

        from google.oauth2 import service_account

        try:
            info = json.loads(key_json)
        except ValueError:
            # Never echo the key itself.
            raise ConfigurationError("the connection's password is not a service-account key in JSON")
        return service_account.Credentials.from_service_account_info(info)

    def default_dataset(self) -> str | None:
        """The connection's default dataset (its ``schema``), or None."""
        conn, _ = self._settings()
        return conn.schema or None

    def get_conn(self) -> BigQueryDbApiConnection:
        return BigQueryDbApiConnection(self.get_client(), self.default_dataset())

    def get_uri(self) -> str:
        # No SQLAlchemy URI: DbApiHook's would need a host; nothing here uses SQLAlchemy.
        return "bigquery://"

    def test_connection(self) -> tuple[bool, str]:  # type: ignore[override]  # as every hook's
        try:
            client = self.get_client()
            client.query("SELECT 1", api_method="INSERT").result()
        except Exception as exc:
            return False, f"{type(exc).__name__}: {str(exc)[:300]}"
        return True, "Connection successfully tested"


class BigQueryDbApiConnection:
    """A DB-API 2 connection over a BigQuery client, as much of one as the provider uses.

    Statements run as query jobs; there is no transaction across them: the merge's write is
    one ``MERGE`` statement, atomic on its own. ``rollback`` drops the tables listed in
    ``staging_tables`` (a merge's staging tables, which a transaction would have taken with it).

    :param client: a ``google.cloud.bigquery.Client``.
    :param dataset: the default dataset, or None.
    """

    def __init__(self, client: Any, dataset: str | None = None) -> None:
        import warnings

        from google.cloud.bigquery import dbapi

        self.client = client
        self.dataset = dataset
        self.staging_tables: list[str] = []
        with warnings.catch_warnings():
            # Without google-cloud-bigquery-storage, results are read in REST pages: say nothing.
            warnings.filterwarnings("ignore", message="Cannot create BigQuery Storage client")
            self._dbapi = dbapi.Connection(client)

    def cursor(self) -> Any:
        """A cursor whose statements each run as a query job; results are fetched page by page
        (``arraysize`` rows a page)."""
        return _job_cursor_class()(self._dbapi)

    def commit(self) -> None:
        """Nothing to commit: every job commits on its own."""
        self.staging_tables.clear()

    def rollback(self) -> None:
        """Drop the staging tables (see the class docstring); a table already gone is fine."""
        dataset = (
            self.dataset if self.dataset and "." in self.dataset else f"{self.client.project}.{self.dataset}"
        )
        while self.staging_tables:
            self.client.delete_table(f"{dataset}.{self.staging_tables.pop()}", not_found_ok=True)

    def close(self) -> None:
        self._dbapi.close()
        self.client.close()


@functools.cache
def _job_cursor_class() -> type:
    from google.cloud.bigquery import QueryJobConfig, dbapi

    class JobCursor(dbapi.Cursor):  # type: ignore[misc]
        """google's DB-API cursor, but each statement is a job of its own (``jobs.insert``):
        ``jobs.query``, which the stock cursor uses, is not where every server applies the
        default dataset (bqemulator does not)."""

        def execute(
            self, operation: Any, parameters: Any = None, job_id: Any = None, job_config: Any = None
        ) -> Any:
            return super().execute(
                operation,
                parameters,
                job_id=job_id or f"abp_{uuid.uuid4().hex}",
                job_config=job_config or QueryJobConfig(),
            )

    return JobCursor
