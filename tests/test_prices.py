"""Prices: the user's, else the genai-prices table, else unknown (never $0)."""

from __future__ import annotations

import pytest

from airflow_batch_provider.dialects import get_dialect
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.prices import PriceBook, parse_price, spend_settings


def test_user_price_with_cache_batch_discount_and_long_context() -> None:
    price = parse_price(
        {
            "input": 2.0,
            "cached_input": 0.5,
            "output": 8.0,
            "batch_discount": 0.5,
            "long_context": {"threshold": 1000, "input": 4.0, "output": 16.0},
        },
        "prices['m']",
        model="m",
        default_discount=None,
    )
    # 1,000 input tokens of which 400 cached, 100 output, half price.
    assert price.cost(1000, 100, 400) == pytest.approx((600 * 2.0 + 400 * 0.5 + 100 * 8.0) / 2e6)
    # Over the threshold the whole request pays the tier (cached at the tier's input price).
    assert price.cost(1001, 100) == pytest.approx((1001 * 4.0 + 100 * 16.0) / 2e6)


def test_the_dialect_discount_applies_when_the_user_gives_none() -> None:
    book = PriceBook.for_dialect(get_dialect("openai"), {"*": {"input": 1.0, "output": 1.0}}, "prices")
    price = book.price("anything")
    assert price is not None and price.batch_discount == 0.5 and price.source == "user"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"input": 1.0}, "needs both"),
        ({"input": -1.0, "output": 1.0}, "must be a number >= 0"),
        ({"input": 1.0, "output": 1.0, "batch_discount": 2}, "at most 1"),
        ({"input": 1.0, "output": 1.0, "inptu": 3}, "unknown key"),
        (
            {"input": 1.0, "output": 1.0, "long_context": {"threshold": "x", "input": 1, "output": 1}},
            "threshold",
        ),
    ],
)
def test_a_bad_price_fails_naming_the_model_and_key(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        PriceBook({"gpt-x": spec}, "connection 'c' extra prices")
    assert "connection 'c' extra prices['gpt-x']" in str(info.value)


def test_genai_prices_table_prices_a_known_model_offline_with_its_version() -> None:
    book = PriceBook.for_dialect(get_dialect("openai"), {}, "prices", "genai-prices")
    price = book.price("gpt-4o-mini")
    assert price is not None and price.source == "genai-prices"
    assert price.version is not None and price.version.startswith("genai-prices ")
    assert price.input > 0 and price.output > price.input and price.cached_input < price.input
    assert price.batch_discount == 0.5


def test_genai_prices_long_context_tiers_come_through() -> None:
    price = PriceBook.for_dialect(get_dialect("anthropic"), {}, "prices").price("claude-sonnet-4-5")
    assert price is not None and price.tiers and price.tiers[0].threshold == 200_000
    assert price.cost(200_001, 0) > price.cost(200_000, 0) * 1.5


def test_an_unknown_model_is_unknown_never_zero() -> None:
    book = PriceBook.for_dialect(get_dialect("openai"), {}, "prices")
    assert book.price("echo-1") is None
    assert "echo-1" in book.why_unknown("echo-1")
    none = PriceBook.for_dialect(get_dialect("openai"), {}, "prices", "none")
    assert none.price("gpt-4o-mini") is None and "price_table='none'" in none.why_unknown("gpt-4o-mini")


def test_connection_extra_settings_are_checked() -> None:
    settings = spend_settings(
        {"prices": {"m": {"input": 1, "output": 2}}, "price_table": "none"}, "connection 'c'"
    )
    assert settings.price_table == "none" and settings.prices["m"]["input"] == 1
    # A connection form saves the mapping as its JSON text.
    assert spend_settings({"prices": '{"m": {"input": 1, "output": 2}}'}, "c").prices["m"]["output"] == 2
    with pytest.raises(ConfigurationError, match="'prices' is not valid JSON"):
        spend_settings({"prices": "{oops"}, "connection 'c'")
    with pytest.raises(ConfigurationError, match="connection 'c' extra 'price_table'"):
        spend_settings({"price_table": "internet"}, "connection 'c'")
    with pytest.raises(ConfigurationError, match="default_max_output_tokens"):
        spend_settings({"default_max_output_tokens": -3}, "connection 'c'")
