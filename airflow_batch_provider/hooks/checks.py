"""What ``BatchApiHook.test_connection`` checked, as one message: reachable, authenticated, dialect.

Pure functions over the listing answer or the error it raised, so the connection test reports
each check the same way in the Airflow UI, the REST API (``POST /connections/test``) and the CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_batch_provider.dialects import DIALECTS, Dialect
from airflow_batch_provider.exceptions import (
    BatchApiAuthError,
    BatchApiConnectionError,
    BatchApiError,
    BatchApiRedirectError,
)

CHECKS = ("reachable", "authenticated", "dialect")
# Answers that refuse the listing call itself (wrong path, method or form).
_REFUSED = frozenset({400, 404, 405, 415, 422})


@dataclass
class Check:
    """One line of the report.

    :param name: one of :data:`CHECKS`.
    :param ok: passed, failed, or None when an earlier failure kept it from running.
    :param detail: what was seen (never a secret: the caller redacts).
    """

    name: str
    ok: bool | None
    detail: str

    def __str__(self) -> str:
        verdict = {True: "yes", False: "NO", None: "not checked"}[self.ok]
        return f"{self.name}: {verdict}" + (f" ({self.detail})" if self.detail else "")


def checks_for_error(exc: BatchApiError, api_path: str = "/v1", base_url: str | None = None) -> list[Check]:
    """The checks an error of the listing call settles: transport, then auth, then the dialect.

    The error's own text leads the message (see :func:`report`), so the details stay short.

    :param exc: the listing call's error.
    :param api_path: the dialect's API root path, named in the hint of a 404.
    :param base_url: the API root tried, named when it gave no answer.
    """
    if isinstance(exc, BatchApiAuthError) and exc.status_code is None:
        # No token to send (the identity provider refused one): the API was never asked.
        return [Check("reachable", None, ""), Check("authenticated", False, "no token"), _unchecked()]
    if isinstance(exc, (BatchApiConnectionError, BatchApiRedirectError)) or exc.status_code is None:
        tried = f" at {base_url}" if base_url else ""
        return [
            Check("reachable", False, f"{type(exc).__name__}{tried}"),
            Check("authenticated", None, ""),
            _unchecked(),
        ]
    status = exc.status_code
    answered = Check("reachable", True, f"HTTP {status}")
    if isinstance(exc, BatchApiAuthError) or status in (401, 403):
        return [answered, Check("authenticated", False, f"HTTP {status}"), _unchecked()]
    if status in _REFUSED:
        # The API answered but not at this path or not in this form: a URL or dialect problem.
        hint = (
            f"; check that the base URL ends with the API version (e.g. {api_path})" if status == 404 else ""
        )
        return [answered, Check("authenticated", True, ""), Check("dialect", False, f"HTTP {status}{hint}")]
    # A rate limit, an empty quota or a server error says nothing about the dialect yet.
    return [answered, Check("authenticated", True, ""), _unchecked()]


def _unchecked() -> Check:
    return Check("dialect", None, "")


def dialect_check(dialect: Dialect, answer: Mapping[str, Any], parse_error: Exception | None) -> Check:
    """Whether the listing answer is in ``dialect``'s shape; names the dialects whose shape it has."""
    keys = set(answer)
    fits = dialect.list_keys <= keys and parse_error is None
    if fits:
        return Check("dialect", True, f"{dialect.name}: the batch listing parses")
    others = sorted(name for name, cls in DIALECTS.items() if name != dialect.name and cls.list_keys <= keys)
    seen = ", ".join(sorted(keys)[:8]) or "none"
    why = (
        str(parse_error)
        if parse_error
        else f"its keys are {seen}, not {', '.join(sorted(dialect.list_keys))}"
    )
    hint = f"; it looks like {' or '.join(repr(o) for o in others)}: set extra 'dialect'" if others else ""
    return Check("dialect", False, f"the listing answer is not in {dialect.name}'s shape: {why}{hint}")


def report(target: str, checks: list[Check], error: Exception | None = None) -> tuple[bool, str]:
    """``(every check passed, one line naming each check)``; a listing error's text leads the line."""
    ok = error is None and all(c.ok for c in checks)
    if error is not None:
        head = f"{type(error).__name__}: {error}"
    elif ok:
        head = f"Connected to {target}: listing batches works"
    else:
        head = f"Connection test of {target} failed"
    return ok, head + " | " + " | ".join(str(c) for c in checks)
