"""``gs://`` for ``ObjectStoragePath`` without the google provider: ``gcsfs`` alone.

Airflow resolves a scheme through the filesystems providers register. ``gs://`` is the google
provider's, which pulls ~120 packages; this module registers it only when that provider is not
installed (``schemes`` is empty otherwise, so the two never compete). Staging on ``gs://`` then
needs only the ``gcs`` extra (``gcsfs``).

The connection named in the path (``gs://<conn_id>@bucket/...``) gives the credentials, read as
for dialect vertex (``dialects/google_credentials.py``): a service-account key as JSON in the
password or extra ``keyfile_dict``, a key file in extra ``key_path``, else Application Default
Credentials; extra ``project``; extra ``endpoint_url`` points at an emulator or a private
endpoint, and extra ``anonymous: true`` sends no credentials (an emulator). No connection:
Application Default Credentials.

``gcsfs.core.GCSFileSystem`` is used, not the "extended" class ``gcsfs`` picks by default, which
probes each bucket's type over gRPC (zonal and hierarchical-namespace buckets) before the first
write: staging writes whole objects and needs neither.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: The schemes served here: none when the google provider (which serves them) is installed.
schemes: list[str] = [] if importlib.util.find_spec("airflow.providers.google") is not None else ["gs", "gcs"]


def gcs_options(password: str | None, extra: dict[str, Any], conn_id: str) -> dict[str, Any]:
    """``gcsfs.GCSFileSystem`` keyword arguments for a connection's password and extra.

    :param password: the connection's password (a service-account key as JSON, or empty).
    :param extra: the connection extra.
    :param conn_id: the connection id, for error messages.
    """
    from airflow_batch_provider.dialects.google_credentials import key_info

    options: dict[str, Any] = {}
    if extra.get("project"):
        options["project"] = str(extra["project"])
    if extra.get("endpoint_url"):
        options["endpoint_url"] = str(extra["endpoint_url"]).rstrip("/")
    if str(extra.get("anonymous", "")).strip().lower() in ("true", "1"):
        options["token"] = "anon"  # noqa: S105 (gcsfs's name for no credentials)
        return options
    info = key_info(password, extra, conn_id)
    # gcsfs takes a service-account key as a dict; "google_default" is Application Default Credentials.
    options["token"] = info if info is not None else "google_default"
    return options


def get_fs(conn_id: str | None, storage_options: dict[str, Any] | None = None) -> Any:
    """The ``gcsfs`` filesystem of ``conn_id`` (Airflow's filesystem registry calls this).

    :param conn_id: the connection in the path, or None (Application Default Credentials).
    :param storage_options: options given to the ``ObjectStoragePath``, over the connection's.
    """
    try:
        from gcsfs.core import GCSFileSystem
    except ImportError as exc:
        from airflow_batch_provider.exceptions import ConfigurationError

        raise ConfigurationError(
            "gs:// staging needs gcsfs: install airflow-batch-provider[gcs] (or the google provider)"
        ) from exc
    options: dict[str, Any] = {"token": "google_default"}
    if conn_id:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(conn_id)
        options = gcs_options(conn.password, dict(conn.extra_dejson or {}), conn_id)
    options.update(storage_options or {})
    return GCSFileSystem(**options)
