"""The local server's enqueued-token limit: a real cap per model, as OpenAI and Azure keep one.

OpenAI and Azure OpenAI cap the input tokens of the batches an organisation (or deployment) has
enqueued per model: the batches that are ``validating``, ``in_progress`` or ``finalizing``. The
server keeps the same arithmetic when ``max_enqueued_tokens`` is set: at each create it counts
the new batch's input tokens and sums those of the live batches naming the same model; a batch
that would pass the cap is refused at create (``refuse``, Azure's form in some regions) or
created and then failed in validation with ``errors.data[].code == "token_limit_exceeded"``
(``fail``, OpenAI's form). A refused or failed batch holds no tokens. The highest total ever
admitted per model is kept in ``/admin/stats`` (``counters["enqueued_tokens_peak"]``), so a test
can prove from the server's own records that a client never enqueued more than the cap.

Tokens are counted the way the provider's build counts them by default (``token_counter``
"auto": exact o200k where the vocabularies are installed, else the heuristic), so a client whose
ledger uses the build's estimate and the server agree on every shard's size. A real vendor
counts with its own tokenizer; the provider's ledger documents that margin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import orjson

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.estimate import resolve_counter

#: Statuses whose batches hold enqueued tokens (the vendor's definition).
ENQUEUED_STATUSES = frozenset({"validating", "in_progress", "finalizing"})
#: How a batch over the limit is answered: refused at create, or created and failed in validation.
LimitForm = Literal["refuse", "fail"]
LIMIT_FORMS = ("refuse", "fail")
#: The model bucket of a batch whose lines and create name none.
NO_MODEL = ""


def count_file(path: Path, dialect_name: str, model: str | None, canonical: Any = None) -> tuple[int, str]:
    """The input tokens of a stored batch file and the model it is enqueued under.

    :param path: the stored input file.
    :param dialect_name: the server's mode (its token encoding, or its heuristic factor).
    :param model: the model the create names (job-model vendors), else the first line's.
    :param canonical: turns a vendor-shaped line into the canonical one (``Wire.canonical_line``).
    """
    counter = resolve_counter("auto", get_dialect(dialect_name), model)
    assert counter is not None
    tokens = 0
    with open(path, "rb") as stream:
        for raw in stream:
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
                if canonical is not None:
                    obj = canonical(obj)
            except (orjson.JSONDecodeError, ValueError, KeyError, TypeError):
                continue  # validation reports the line; it holds no tokens of its own here
            body = obj.get("body") if isinstance(obj, dict) else None
            if not isinstance(body, dict):
                continue
            if model is None and isinstance(body.get("model"), str):
                model = body["model"]
            tokens += counter(body)
    return tokens, model or NO_MODEL


def enqueued(live: Iterable[Mapping[str, Any]], model: str) -> int:
    """Input tokens the live batches of ``model`` hold (records carrying ``enqueued_tokens``)."""
    return sum(
        int(rec.get("enqueued_tokens") or 0)
        for rec in live
        if rec.get("status") in ENQUEUED_STATUSES and rec.get("queue_model") == model
    )


def over_limit_message(model: str, limit: int, held: int, tokens: int) -> str:
    """OpenAI's words for a batch over the enqueued-token limit, with the local server's figures."""
    shown = model or "this model"
    return (
        f"Enqueued token limit reached for {shown} in organization org-local. Limit: {limit:,} enqueued "
        f"tokens ({held:,} enqueued, this batch {tokens:,}). Please try submitting fewer tasks or wait "
        "until some in_progress batches have been completed."
    )
