"""Token counting at build time: the exact counter, the script-aware heuristic, the tally."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_batch_provider.dialects import DIALECTS, get_dialect
from airflow_batch_provider.estimate import (
    EstimateTally,
    describe,
    exact_counter,
    heuristic_counter,
    max_output_tokens,
    resolve_counter,
)
from airflow_batch_provider.exceptions import ConfigurationError
from airflow_batch_provider.prices import Price

SAMPLES = {
    "english": "Hello, how are you doing today? I would like to cancel my order, it is late. ",
    "german": "Guten Tag, ich möchte meine Bestellung stornieren, weil die Lieferung zu spät kommt. ",
    "russian": "Здравствуйте, я хочу отменить свой заказ, потому что доставка опаздывает. ",
    "chinese": "你好，我想取消我的订单，因为送货太晚了。请尽快给我退款。",
    "japanese": "こんにちは、注文をキャンセルしたいです。配達が遅すぎます。",
}


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}], **extra}


def test_exact_counts_o200k_offline_with_chat_framing() -> None:
    count = exact_counter("o200k_base")
    # "Hello world" is 2 o200k tokens; "user" 1; 3 per message and 3 for the reply.
    assert count(chat("Hello world")) == 2 + 1 + 3 + 3
    assert describe(count) == ("exact o200k_base", True)


@pytest.mark.parametrize("language", sorted(SAMPLES))
def test_heuristic_never_undercounts_a_script_by_much(language: str) -> None:
    exact, guess = exact_counter("o200k_base"), heuristic_counter()
    body = chat(SAMPLES[language] * 30)
    ratio = guess(body) / exact(body)
    # Conservative (errs high), and never the 2.4x undercount of a flat 4 chars per token on CJK.
    assert 0.97 <= ratio <= 1.6, (language, ratio)


def test_a_flat_four_chars_per_token_would_undercount_cjk() -> None:
    body = chat(SAMPLES["chinese"] * 30)
    flat = len(SAMPLES["chinese"] * 30) / 4
    assert exact_counter()(body) > 2 * flat
    assert heuristic_counter()(body) >= exact_counter()(body)


def test_private_tokenizers_use_the_heuristic_with_their_factor() -> None:
    body = chat(SAMPLES["english"] * 10)
    for name in sorted(DIALECTS):
        dialect = get_dialect(name)
        counter = resolve_counter("auto", dialect, "m")
        description, exact = describe(counter)
        if dialect.token_encoding:
            assert exact, name
        else:
            assert not exact and description.startswith("heuristic"), name
            assert counter(body) >= heuristic_counter()(body), name
    with pytest.raises(ConfigurationError, match="not public"):
        resolve_counter("exact", get_dialect("anthropic"))


def test_a_callable_or_a_dotted_path_is_the_counter() -> None:
    assert resolve_counter(lambda body: 7, get_dialect("openai"))(chat("x")) == 7
    counter = resolve_counter("tests.test_estimate:ten", get_dialect("openai"))
    assert counter(chat("x")) == 10
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        resolve_counter("tests.test_estimate:nothing_here", get_dialect("openai"))


def ten(body: Any) -> int:
    return 10


def test_worst_case_output_reads_the_caps_or_the_default() -> None:
    assert max_output_tokens({"max_completion_tokens": 5, "max_tokens": 9}, "/v1/chat/completions", 1) == 5
    assert max_output_tokens({"max_tokens": 9}, "/v1/chat/completions", None) == 9
    assert max_output_tokens({}, "/v1/chat/completions", 100) == 100
    assert max_output_tokens({}, "/v1/chat/completions", None) is None
    assert max_output_tokens({}, "/v1/embeddings", None) == 0


def test_the_tally_prices_each_request_on_its_own() -> None:
    # A long-context tier over 100 input tokens: only the long request pays it.
    price = Price(1.0, 0.5, 2.0, 0.0, (_tier(100, 10.0, 5.0, 20.0),))
    tally = EstimateTally(lambda body: int(body["n"]), "/v1/chat/completions", None, price)
    tally.add({"n": 50, "max_tokens": 10}, 0)
    tally.add({"n": 150, "max_tokens": 10}, 1)
    expected = (50 * 1.0 + 10 * 2.0 + 150 * 10.0 + 10 * 20.0) / 1e6
    summary = tally.summary()
    assert summary["cost"] == pytest.approx(expected)
    # Pricing the total (200 tokens, over the threshold) would charge the short request the tier.
    assert summary["cost"] < price.cost(200, 20)
    assert tally.shard_fields(0) == {"input_tokens": 50, "max_output_tokens": 10, "estimated_cost": 7e-05}
    assert summary["input_tokens"] == 200 and summary["max_output_tokens"] == 20


def test_a_request_without_an_output_cap_leaves_the_worst_case_unknown() -> None:
    tally = EstimateTally(lambda body: 10, "/v1/chat/completions", None, Price(1.0, 1.0, 1.0))
    tally.add({}, 0)
    summary = tally.summary()
    assert summary["max_output_tokens"] is None and summary["cost"] is None
    assert summary["requests_without_output_cap"] == 1


def test_a_counter_returning_nonsense_is_an_error() -> None:
    tally = EstimateTally(lambda body: -1, "/v1/chat/completions")
    with pytest.raises(ConfigurationError, match="must return a count"):
        tally.add({}, 0)


def _tier(threshold: int, i: float, c: float, o: float) -> Any:
    from airflow_batch_provider.prices import Tier

    return Tier(threshold, i, c, o)


def test_the_heuristic_from_a_written_line_matches_the_walk() -> None:
    """A fixed-shape build counts an ASCII line by its length: the same count as reading the body."""
    import orjson

    walk, by_line = heuristic_counter(), heuristic_counter()
    for i, text in enumerate(["short", "a much longer question about an order " * 20, "mid sized text here"]):
        body = {
            "model": "gpt-4o-mini",
            "messages": [
                {"role": "system", "content": "Label it.\nOne word."},
                {"role": "user", "content": text},
            ],
            "max_tokens": 5,
        }
        cid = f"row-{i * 1000}"
        line = orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
        assert by_line.from_line(line, cid, body) == walk(body)
    # A non-ASCII line is read string by string.
    body = chat(SAMPLES["russian"])
    line = orjson.dumps({"custom_id": "x", "body": body})
    assert by_line.from_line(line, "x", body) == walk(body)


@pytest.mark.parametrize(
    "price",
    [None, Price(2.0, 1.0, 8.0, 0.5), Price(2.0, 1.0, 8.0, 0.0, (_tier(40, 4.0, 2.0, 16.0),))],
    ids=["unpriced", "flat", "tiered"],
)
@pytest.mark.parametrize("default_out", [None, 7])
def test_the_fixed_shape_adder_sums_what_add_sums(price: Price | None, default_out: int | None) -> None:
    """The build's hot path (length-counted lines, sums per shard in a closure) gives the same
    shard figures as counting every body on its own."""
    import orjson

    texts = ["hi", "a longer question " * 10, "где мой заказ?", "mid text " * 5, "x" * 300]
    lines = []
    for i, text in enumerate(texts * 3):
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        cid = f"id-{i}"
        line = orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})
        lines.append((line, cid, body, i // 6))  # three shards
    by_body = EstimateTally(heuristic_counter(), "/v1/chat/completions", default_out, price)
    fast = EstimateTally(heuristic_counter(), "/v1/chat/completions", default_out, price)
    add = fast.fixed_adder()
    for line, cid, body, shard in lines:
        by_body.add(body, shard)
        add(line, cid, body, shard)
    fast.finish()
    for shard in range(3):
        assert fast.shard_fields(shard) == pytest.approx(by_body.shard_fields(shard)), shard
    fast_run, body_run = fast.summary(), by_body.summary()
    assert fast_run.pop("price") == body_run.pop("price")
    assert fast_run == pytest.approx(body_run)
