"""The budget guard: refuse a run over its caps before anything is uploaded.

The run's estimate is the build manifest's (every shard of the build, whichever shard a mapped
submit sends), or one made here by streaming the files when the manifest has none (a hand-made
JSONL file, or a build made before estimates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.estimate import EstimateTally, describe_estimate
from airflow_batch_provider.exceptions import BudgetExceededError, ConfigurationError
from airflow_batch_provider.jsonl import iter_objects
from airflow_batch_provider.staging import open_read

if TYPE_CHECKING:
    from airflow.sdk import ObjectStoragePath

    from airflow_batch_provider.estimate import TokenCounter
    from airflow_batch_provider.prices import PriceBook


def check_caps(max_estimated_cost: float | None, max_input_tokens: int | None) -> None:
    """Refuse caps that are not numbers, at the operator's construction."""
    if max_estimated_cost is not None and (
        isinstance(max_estimated_cost, bool)
        or not isinstance(max_estimated_cost, (int, float))
        or not max_estimated_cost >= 0
    ):
        raise ConfigurationError(
            f"max_estimated_cost must be a number >= 0 (USD), not {max_estimated_cost!r}"
        )
    if max_input_tokens is not None and (type(max_input_tokens) is not int or max_input_tokens < 0):
        raise ConfigurationError(f"max_input_tokens must be a token count, not {max_input_tokens!r}")


def estimate_files(
    files: Iterable[tuple[int, ObjectStoragePath]],
    *,
    endpoint: str,
    counter: TokenCounter,
    default_max_output: int | None,
    book: PriceBook,
    model: str | None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The estimate of batch JSONL files, streamed line by line (flat memory), as they will be
    sent.

    :param files: ``(shard index, path)`` of every file of the run.
    :param model: the model to price, and every line's model when given (a submit's override);
        None: the first line's ``body.model``.
    :param defaults: body fields given to every line that lacks them (submit's ``request_defaults``).
    """
    tally: EstimateTally | None = None
    for index, path in files:
        with open_read(path) as handle:
            for number, obj in iter_objects(handle):
                body = obj.get("body") if isinstance(obj, dict) else None
                if not isinstance(body, dict):
                    raise ConfigurationError(f"{path} line {number}: no request body to estimate")
                if defaults:
                    body = {**defaults, **body}
                if tally is None:
                    model = model or (body.get("model") if isinstance(body.get("model"), str) else None)
                    tally = EstimateTally(counter, endpoint, default_max_output, book.price(model))
                tally.add(body, index)
    if tally is None:
        tally = EstimateTally(counter, endpoint, default_max_output, book.price(model))
    return tally.summary(book, model)


def check_budget(
    estimate: Mapping[str, Any], *, max_estimated_cost: float | None, max_input_tokens: int | None
) -> None:
    """Raise :class:`BudgetExceededError` when the run's estimate breaks a cap.

    A cost cap with an unknown price (or an unbounded worst case) refuses the run unless a
    token cap is also given, which then bounds it alone.
    """
    price = estimate.get("price") or {}
    source = price.get("version") or price.get("source") or "unknown"
    summary = describe_estimate(estimate)
    tokens = int(estimate.get("input_tokens") or 0)
    if max_input_tokens is not None and tokens > max_input_tokens:
        raise BudgetExceededError(
            f"refused before any upload: the run's estimate is {tokens:,} input tokens, over "
            f"max_input_tokens={max_input_tokens:,} ({estimate.get('counter')}; {summary})"
        )
    if max_estimated_cost is None:
        return
    cost = estimate.get("cost")
    if cost is None:
        if max_input_tokens is not None:
            return  # the token cap bounds a run that cannot be priced
        why = (
            price.get("why")
            if price.get("source") == "unknown"
            else f"{estimate.get('requests_without_output_cap', 0)} request(s) set no output cap "
            "(set max_tokens, or the build's default_max_output_tokens)"
        )
        raise BudgetExceededError(
            f"refused before any upload: max_estimated_cost=${max_estimated_cost:,.4f} is set but the "
            f"run's cost cannot be estimated ({why}); set prices, or give max_input_tokens as well"
        )
    if cost > max_estimated_cost:
        raise BudgetExceededError(
            f"refused before any upload: the run's estimated cost is ${cost:,.4f} (worst case), over "
            f"max_estimated_cost=${max_estimated_cost:,.4f}; priced by {source}; {summary}"
        )
