"""The ``batch_api`` connection form, declared the Airflow >= 3.2 way.

Kept apart from the hook (no httpx import) because ``get_provider_info`` reads it while
Airflow discovers providers.
"""

from __future__ import annotations

from typing import Any

from airflow_batch_provider.dialects import DIALECTS

# The dialect registry does not load Airflow, so the form reads it while providers are discovered.
DIALECT_NAMES = tuple(sorted(DIALECTS))


def _dialect_hint(name: str) -> str:
    """One dialect's line of the form's hints: its label, base URL and required extras."""
    cls = DIALECTS[name]
    needs = f", needs {', '.join(repr(e) for e in cls.required_extras)}" if cls.required_extras else ""
    return f"{name} = {cls.label} ({cls.default_base_url}{needs})"


# Shown under the fields: the form cannot change with the chosen dialect (no script), so each
# hint names every dialect's base URL and what it requires.
DIALECT_HINTS = "; ".join(_dialect_hint(name) for name in DIALECT_NAMES)
PROJECT_DIALECTS = tuple(n for n in DIALECT_NAMES if "project" in DIALECTS[n].required_extras)

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_RETRIES = 3
# A result file of 50,000 long answers or large embeddings stays well below this; a gzip bomb does not.
DEFAULT_MAX_DOWNLOAD_BYTES = 8 << 30

CONN_FIELDS: dict[str, dict[str, Any]] = {
    "dialect": {
        "label": "Dialect",
        "description": (
            "Which vendor's wire format the API speaks (the connection test says which one a server "
            f"answers in): {DIALECT_HINTS}. A local server: http://127.0.0.1:8000/v1 in its --dialect."
        ),
        "schema": {"type": ["string", "null"], "enum": list(DIALECT_NAMES), "default": "openai"},
    },
    "organization": {
        "label": "Organization",
        "description": "Optional organisation id sent with every request (OpenAI-style).",
        "schema": {"type": ["string", "null"]},
    },
    "project": {
        "label": "Project",
        "description": (
            f"Project id sent with every request; required for {', '.join(PROJECT_DIALECTS) or 'no dialect'} "
            "(sent as x-project-id), optional elsewhere (OpenAI-Project)."
        ),
        "schema": {"type": ["string", "null"]},
    },
    "headers": {
        "label": "Extra headers",
        "description": "Optional JSON object of extra HTTP headers.",
        "schema": {"type": ["object", "null"], "format": "json"},
    },
    "console_url_template": {
        "label": "Batch page URL template",
        "description": (
            "The web page of one batch, for the tasks' extra links: {batch_id} and {origin} are filled "
            "in; 'none' turns the links off. Default: the vendor's console, or the local server's page. "
            "Only https:// (http:// for localhost or the API's own host) is linked."
        ),
        "schema": {"type": ["string", "null"]},
    },
    "local_server": {
        "label": "Local batch server",
        "description": (
            "The base URL is an 'airflow-batch serve' server: link its /ui/batches pages. "
            "Unset: asked from the server's /health."
        ),
        "schema": {"type": ["boolean", "null"]},
    },
    "timeout": {
        "label": "Timeout (seconds)",
        "schema": {"type": ["number", "null"], "default": DEFAULT_TIMEOUT, "minimum": 0},
    },
    "max_retries": {
        "label": "Max retries",
        "schema": {"type": ["integer", "null"], "default": DEFAULT_MAX_RETRIES, "minimum": 0},
    },
    "max_download_bytes": {
        "label": "Max download size (bytes)",
        "description": (
            "The most bytes one downloaded or streamed file (results, errors) may have once decompressed; "
            "a larger one is refused with an error naming the file. Default 8 GiB."
        ),
        "schema": {"type": ["integer", "null"], "default": DEFAULT_MAX_DOWNLOAD_BYTES, "minimum": 1},
    },
    "allow_private_redirects": {
        "label": "Allow private redirects",
        "description": (
            "A result file may redirect to object storage on another host: by default only over https "
            "(or http to loopback) and never to a private, link-local or instance-metadata address "
            "(169.254.169.254, metadata.google.internal, 10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7, "
            "fe80::/10), checked on every hop and for every address the host name resolves to. Set true "
            "when the store lives inside your network (then http to it is allowed too)."
        ),
        "schema": {"type": ["boolean", "null"], "default": False},
    },
}
# The extras a single dialect reads (an API version, an auth mode...), declared by the dialect.
for _cls in DIALECTS.values():
    for _name, _spec in _cls.connection_fields.items():
        CONN_FIELDS.setdefault(_name, dict(_spec))
DIALECT_FIELDS = tuple(name for cls in DIALECTS.values() for name in cls.connection_fields)

UI_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden-fields": ["port", "login", "schema"],
    "relabeling": {"host": "Base URL", "password": "API key"},
    "placeholders": {
        "host": f"{DIALECTS['openai'].default_base_url} (other vendors: see Dialect below)",
        "password": "sk-...",
        "project": "required for " + ", ".join(PROJECT_DIALECTS),
    },
}


def legacy_ui_field_behaviour() -> dict[str, Any]:
    """``UI_FIELD_BEHAVIOUR`` in the spelling of Airflow < 3.2 (``get_ui_field_behaviour``)."""
    return {
        "hidden_fields": list(UI_FIELD_BEHAVIOUR["hidden-fields"]),
        "relabeling": dict(UI_FIELD_BEHAVIOUR["relabeling"]),
        "placeholders": dict(UI_FIELD_BEHAVIOUR["placeholders"]),
    }


def legacy_form_widgets() -> dict[str, Any]:
    """The extra fields as wtforms fields, for Airflow < 3.2 web servers (``get_connection_form_widgets``)."""
    from flask_appbuilder.fieldwidgets import BS3TextFieldWidget
    from wtforms import IntegerField, StringField

    widgets: dict[str, Any] = {
        "dialect": StringField("Dialect (" + " | ".join(DIALECT_NAMES) + ")", widget=BS3TextFieldWidget()),
        "organization": StringField("Organization", widget=BS3TextFieldWidget()),
        "project": StringField("Project", widget=BS3TextFieldWidget()),
        "timeout": IntegerField("Timeout (seconds)", widget=BS3TextFieldWidget()),
        "max_retries": IntegerField("Max retries", widget=BS3TextFieldWidget()),
        "console_url_template": StringField("Batch page URL template", widget=BS3TextFieldWidget()),
    }
    for name in DIALECT_FIELDS:
        spec = CONN_FIELDS[name]
        kind = IntegerField if "integer" in spec["schema"]["type"] else StringField
        widgets.setdefault(name, kind(spec["label"], widget=BS3TextFieldWidget()))
    return widgets
