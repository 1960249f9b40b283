"""Input-token counting at build time: exact where an OpenAI vocabulary is on this machine, else
a script-aware heuristic; and the tally of a run's tokens (and estimated cost) per shard.

A counter is any callable ``body dict -> int`` (the request body of one line). The build calls it
once per line as it writes the line, so counting streams with the build and holds nothing.

* ``exact``: the OpenAI encoding (``o200k_base``, ``cl100k_base``...) from the optional
  ``bpe-openai`` package, which ships the vocabularies inside the wheel. Nothing is ever fetched:
  without the package an exact counter cannot be made, and ``auto`` falls back to the heuristic.
* ``heuristic``: characters per token by script, measured on o200k: English (ASCII) 4.2, other
  Latin text (German, French...) 3.5, Cyrillic 3.4, Chinese / Japanese / Korean 1.7 on average
  but taken as 1.5 (short everyday sentences with full-width punctuation run to 1.4), other
  scripts (Greek, Arabic, Hebrew, Indic, Thai...) 2.0; plus a 10% margin (``HEURISTIC_MARGIN``),
  since a budget check must not be passed by an undercount; times the dialect's
  ``token_factor`` for vendors whose tokenizers are private. Rounded up per string.

Both add the chat framing OpenAI documents for its models: 3 tokens per message and 3 for the
reply's start. Every string in the body is counted except ``model`` (tool and schema text is
billed as input too); numbers and booleans are not.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_batch_provider.dialects.base import Dialect
    from airflow_batch_provider.prices import Price, PriceBook

#: A token counter: the request body of one line -> its input tokens.
TokenCounter = Callable[[Mapping[str, Any]], int]

#: Characters per o200k token, by script (see the module docstring).
CHARS_PER_TOKEN = {"ascii": 4.2, "latin": 3.5, "cyrillic": 3.4, "cjk": 1.5, "other": 2.0}
#: The heuristic's margin over the per-script rates: text whose words are rarer than the
#: measured corpus' (names, codes, numbers) makes more tokens per character.
HEURISTIC_MARGIN = 1.1
MESSAGE_TOKENS = 3
REPLY_TOKENS = 3
#: The body fields naming the most tokens one request may answer with (the worst case billed).
MAX_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")

_CJK = re.compile(r"[\u1100-\u11ff\u2e80-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\uff00-\uffef]")
_CYRILLIC = re.compile(r"[\u0400-\u052f]")
_OTHER = re.compile(r"[\u0370-\u03ff\u0530-\u0fff\u1000-\u109f]")
_NO_OUTPUT_ENDPOINTS = ("/v1/embeddings", "/v1/moderations", "/v1/chat/moderations", "/v1/classifications")


def _heuristic_tokens(text: str) -> float:
    """o200k tokens of ``text`` by the per-script rates, before the margin (not rounded)."""
    if text.isascii():
        return len(text) / 4.2
    cjk = len(_CJK.findall(text))
    cyrillic = len(_CYRILLIC.findall(text))
    other = len(_OTHER.findall(text))
    rest = len(text) - cjk - cyrillic - other
    return cjk / 1.5 + cyrillic / 3.4 + other / 2.0 + rest / 3.5


def _walk(body: Mapping[str, Any], on_text: Callable[[str], Any]) -> int:
    """Call ``on_text`` for every string in ``body`` but ``model``; return the number of messages."""
    messages = body.get("messages")
    stack: list[Any] = [v for k, v in body.items() if k != "model"]
    while stack:
        value = stack.pop()
        if type(value) is str:
            on_text(value)
        elif type(value) is dict:
            stack.extend(value.values())
        elif type(value) is list:
            stack.extend(value)
    return len(messages) if type(messages) is list else 0


def _text_tokens(value: Any) -> float:
    """The heuristic's tokens of every string inside ``value`` (a body's value)."""
    kind = type(value)
    if kind is str:
        return len(value) / 4.2 if value.isascii() else _heuristic_tokens(value)
    if kind is dict:
        return sum(_text_tokens(v) for v in value.values())
    if kind is list:
        return sum(_text_tokens(v) for v in value)
    return 0.0


class HeuristicCounter:
    """The script-aware estimate, times ``factor`` (a vendor's tokens per o200k token).

    Called with a body it reads every string. A build of fixed-shape bodies (only strings
    change between rows) calls :meth:`from_line` with the line as written instead: an ASCII
    line's text is then its length less the structure around the strings, measured once on the
    first ASCII line, which costs a length instead of a walk (JSON escapes in a value count a
    character more, erring high).

    :param factor: multiplies the count (``Dialect.token_factor``).
    """

    exact = False

    def __init__(self, factor: float = 1.0) -> None:
        if not factor > 0:
            raise ConfigurationError(f"token factor must be positive, not {factor!r}")
        self.factor = factor
        self.description = "heuristic" if factor == 1.0 else f"heuristic x{factor:g}"
        self._structure: int | None = None
        self._framing = 0

    def __call__(self, body: Mapping[str, Any]) -> int:
        text = 0.0
        for key, value in body.items():
            if key != "model":
                text += _text_tokens(value)
        messages = body.get("messages")
        count = len(messages) if type(messages) is list else 0
        framing = MESSAGE_TOKENS * count + (REPLY_TOKENS if count else 0)
        return math.ceil((text * HEURISTIC_MARGIN + framing) * self.factor)

    def from_line(self, line: bytes, custom_id: str, body: Mapping[str, Any]) -> int:
        """The count of a fixed-shape build's line: by its length when it is ASCII."""
        if not line.isascii():
            return self(body)
        size = len(line) - len(custom_id)
        if self._structure is None:
            # Calibrated on this line: its length less its strings' characters is the structure.
            chars = 0

            def add(text: str) -> None:
                nonlocal chars
                chars += len(text)

            count = _walk(body, add)  # every string but the model, which is structure here
            self._structure = size - chars
            self._framing = MESSAGE_TOKENS * count + (REPLY_TOKENS if count else 0)
        text = (size - self._structure) / 4.2
        return math.ceil((text * HEURISTIC_MARGIN + self._framing) * self.factor)


def heuristic_counter(factor: float = 1.0) -> HeuristicCounter:
    """The script-aware estimate, times ``factor`` (see :class:`HeuristicCounter`)."""
    return HeuristicCounter(factor)


def exact_counter(encoding: str = "o200k_base") -> TokenCounter:
    """The exact count with an OpenAI encoding shipped by the ``bpe-openai`` package (offline).

    :param encoding: ``o200k_base``, ``cl100k_base``... (``bpe_openai.list_encoding_names()``).
    :raises ConfigurationError: the package is not installed, or does not know the encoding.
    """
    try:
        import bpe_openai
    except ImportError:
        raise ConfigurationError(
            "exact token counts need the optional package bpe-openai (pip install "
            "'airflow-batch-provider[tokens]'), which ships OpenAI's vocabularies; nothing is downloaded"
        ) from None
    try:
        enc = bpe_openai.get_encoding(encoding)
    except Exception as exc:
        raise ConfigurationError(f"encoding {encoding!r} is not available offline: {exc}") from None
    encode = enc.encode_ordinary

    def count(body: Mapping[str, Any]) -> int:
        total = 0

        def add(text: str) -> None:
            nonlocal total
            total += len(encode(text))

        messages = _walk(body, add)
        return total + MESSAGE_TOKENS * messages + (REPLY_TOKENS if messages else 0)

    count.description = f"exact {encoding}"  # type: ignore[attr-defined]
    count.exact = True  # type: ignore[attr-defined]
    return count


def exact_available() -> bool:
    """Whether an exact counter can be made on this machine (the vocabularies are installed)."""
    try:
        importlib.import_module("bpe_openai")
    except ImportError:
        return False
    return True


def resolve_counter(spec: Any, dialect: Dialect, model: str | None = None) -> TokenCounter | None:
    """The counter a build uses.

    :param spec: a callable (used as is); ``"none"`` (no estimate: the caller skips counting,
        this returns None); ``"auto"`` or None (exact for a dialect with a public
        encoding when the vocabularies are installed, else the heuristic with the dialect's
        factor); ``"heuristic"``; ``"exact"`` (the dialect's, else the model's, encoding); an
        encoding name (``"cl100k_base"``); or a dotted path ``"package.module:function"`` to a
        callable (the way a connection extra names one).
    :param dialect: the vendor dialect (its ``token_encoding`` and ``token_factor``).
    :param model: the model, to pick its encoding where the package knows it.
    """
    if callable(spec):
        return spec  # type: ignore[no-any-return]
    if spec == "none":
        return None
    if spec is None or spec == "auto":
        if dialect.token_encoding and exact_available():
            return exact_counter(_encoding_for(dialect, model))
        return heuristic_counter(dialect.token_factor)
    if not isinstance(spec, str):
        raise ConfigurationError(f"token_counter must be a callable or a name, not {type(spec).__name__}")
    if spec == "heuristic":
        return heuristic_counter(dialect.token_factor)
    if spec == "exact":
        if not dialect.token_encoding:
            raise ConfigurationError(
                f"{dialect.label}'s tokenizer is not public: no exact count; use 'heuristic' or a callable"
            )
        return exact_counter(_encoding_for(dialect, model))
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ConfigurationError(f"token_counter {spec!r} cannot be imported: {exc}") from None
        if not callable(found):
            raise ConfigurationError(f"token_counter {spec!r} is not callable")
        return found  # type: ignore[no-any-return]
    return exact_counter(spec)


def _encoding_for(dialect: Dialect, model: str | None) -> str:
    default = dialect.token_encoding or "o200k_base"
    if not model:
        return default
    try:
        import bpe_openai

        return str(bpe_openai.encoding_name_for_model(model))
    except Exception:  # a model the package does not know: the dialect's encoding
        return default


def describe(counter: TokenCounter) -> tuple[str, bool]:
    """``(description, exact)`` of a counter; a user's callable is described by its name."""
    description = getattr(counter, "description", None)
    if description is None:
        description = f"callable {getattr(counter, '__qualname__', type(counter).__name__)}"
    return str(description), bool(getattr(counter, "exact", False))


def max_output_tokens(body: Mapping[str, Any], endpoint: str, default: int | None) -> int | None:
    """The most output tokens one request may be billed for: its own cap, else ``default``
    (None: not known); 0 for an endpoint that answers without generating (embeddings)."""
    if endpoint in _NO_OUTPUT_ENDPOINTS:
        return 0
    for name in MAX_OUTPUT_FIELDS:
        value = body.get(name)
        if type(value) is int and value >= 0:
            return value
    return default


def _bad_count(tokens: Any) -> ConfigurationError:
    return ConfigurationError(
        f"the token counter gave {tokens!r} for a request; it must return a count (an int >= 0)"
    )


@dataclass
class ShardTally:
    """One shard's estimate: requests, input tokens, worst-case output tokens and cost."""

    requests: int = 0
    input_tokens: int = 0
    max_output_tokens: int = 0
    unbounded_output: int = 0
    cost: float = 0.0


@dataclass
class EstimateTally:
    """Adds up one run's estimate line by line, per shard, pricing each request on its own.

    :param counter: the token counter.
    :param endpoint: the lines' endpoint (embeddings generate no output).
    :param default_max_output: the worst-case output of a line that sets no cap (None: unknown).
    :param price: the model's price (None: unknown; then no cost is given, never $0).
    """

    counter: TokenCounter
    endpoint: str
    default_max_output: int | None = None
    price: Price | None = None
    shards: dict[int, ShardTally] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._current: tuple[int, ShardTally] | None = None
        # A price without tiers is two multiplications per request.
        self._flat = None if self.price is None or self.price.tiers else self.price.rates(0)
        self._finishers: list[Callable[[], None]] = []

    def _shard(self, shard: int) -> ShardTally:
        current = self._current
        if current is not None and current[0] == shard:
            return current[1]
        tally = self.shards.get(shard)
        if tally is None:
            tally = self.shards[shard] = ShardTally()
        self._current = (shard, tally)
        return tally

    def add(self, body: Mapping[str, Any], shard: int) -> None:
        """Count one line's body, written to ``shard``."""
        tokens = self.counter(body)
        if type(tokens) is not int or tokens < 0:
            raise _bad_count(tokens)
        self._record(tokens, max_output_tokens(body, self.endpoint, self.default_max_output), shard)

    def fixed_adder(self) -> Callable[[bytes, str, Mapping[str, Any], int], None]:
        """A function counting one line of a fixed-shape build (only strings vary between rows,
        so every line has the same output cap): ``add(line, custom_id, body, shard)``.

        The hot path of a counted build. A heuristic counter counts an ASCII line by its length
        (:meth:`HeuristicCounter.from_line`, calibrated on the first line); the sums stay in the
        closure until the shard changes or :meth:`finish` is called, and a price without tiers
        is applied to the sums (it is linear). Any other counter reads the body.
        """
        counter = self.counter
        heuristic = counter if isinstance(counter, HeuristicCounter) else None
        flat = self._flat
        price = self.price
        tiered = price is not None and flat is None
        endpoint, default_out = self.endpoint, self.default_max_output
        ceil = math.ceil
        current: int | None = None  # the shard the sums below belong to
        out_cap = -2  # every line's output cap (-1: none; -2: not read yet)
        requests = tokens_sum = 0
        cost_sum = 0.0
        # tokens = ceil((len(line) - len(custom_id)) * slope + offset), once calibrated.
        slope: float | None = None
        offset = 0.0

        def flush() -> None:
            nonlocal requests, tokens_sum, cost_sum
            if current is not None and requests:
                tally = self._shard(current)
                tally.requests += requests
                tally.input_tokens += tokens_sum
                out = max(out_cap, 0)
                if out_cap < 0:
                    tally.unbounded_output += requests
                else:
                    tally.max_output_tokens += requests * out
                if flat is not None:
                    tally.cost += tokens_sum * flat[0] + requests * out * flat[2]
                else:
                    tally.cost += cost_sum
            requests = tokens_sum = 0
            cost_sum = 0.0

        def count(line: bytes, custom_id: str, body: Mapping[str, Any]) -> int:
            nonlocal slope, offset, out_cap
            if out_cap == -2:
                found = max_output_tokens(body, endpoint, default_out)
                out_cap = -1 if found is None else found
            if heuristic is None:
                tokens = counter(body)
                if type(tokens) is not int or tokens < 0:
                    raise _bad_count(tokens)
                return tokens
            tokens = heuristic.from_line(line, custom_id, body)
            if slope is None and heuristic._structure is not None:
                rate = HEURISTIC_MARGIN / 4.2
                slope = rate * heuristic.factor
                offset = (heuristic._framing - heuristic._structure * rate) * heuristic.factor
            return tokens

        def add(line: bytes, custom_id: str, body: Mapping[str, Any], shard: int) -> None:
            nonlocal current, requests, tokens_sum, cost_sum
            if shard != current:
                flush()
                current = shard
            if slope is not None and line.isascii():
                tokens = ceil((len(line) - len(custom_id)) * slope + offset)
            else:
                tokens = count(line, custom_id, body)
            requests += 1
            tokens_sum += tokens
            if tiered:
                # Per request: a long-context tier applies to the requests over its threshold only.
                cost_sum += price.cost(tokens, max(out_cap, 0))  # type: ignore[union-attr]

        self._finishers.append(flush)
        return add

    def finish(self) -> None:
        """Move what a :meth:`fixed_adder` still holds into the shard tallies."""
        for flush in self._finishers:
            flush()

    def _record(self, tokens: int, out: int | None, shard: int) -> None:
        tally = self._shard(shard)
        tally.requests += 1
        tally.input_tokens += tokens
        if out is None:
            tally.unbounded_output += 1
            out = 0
        else:
            tally.max_output_tokens += out
        flat = self._flat
        if flat is not None:
            tally.cost += tokens * flat[0] + out * flat[2]
        elif self.price is not None:
            # Per request: a long-context tier applies to the requests over its threshold only.
            tally.cost += self.price.cost(tokens, out)

    def shard_fields(self, shard: int) -> dict[str, Any]:
        """What the manifest's shard records of its estimate."""
        tally = self.shards.get(shard, ShardTally())
        return {
            "input_tokens": tally.input_tokens,
            "max_output_tokens": None if tally.unbounded_output else tally.max_output_tokens,
            "estimated_cost": round(tally.cost, 6)
            if self.price is not None and not tally.unbounded_output
            else None,
        }

    def summary(self, book: PriceBook | None = None, model: str | None = None) -> dict[str, Any]:
        """The run's estimate for the manifest: totals, how tokens were counted, what priced them."""
        tallies = list(self.shards.values())
        unbounded = sum(t.unbounded_output for t in tallies)
        description, exact = describe(self.counter)
        out: dict[str, Any] = {
            "requests": sum(t.requests for t in tallies),
            "input_tokens": sum(t.input_tokens for t in tallies),
            "max_output_tokens": None if unbounded else sum(t.max_output_tokens for t in tallies),
            "requests_without_output_cap": unbounded,
            "counter": description,
            "exact": exact,
            "cost": None,
            "price": None,
        }
        if self.price is not None:
            cost = sum(t.cost for t in tallies)
            out["cost"] = None if unbounded else round(cost, 6)
            if unbounded:
                # A request without an output cap has no worst case: the cost is not bounded.
                out["input_cost"] = round(cost, 6)
            out["price"] = self.price.describe()
        elif book is not None:
            out["price"] = {"source": "unknown", "model": model, "why": book.why_unknown(model)}
        return out


def describe_estimate(estimate: Mapping[str, Any]) -> str:
    """One log line of an estimate: tokens, how they were counted, the cost and its price source."""
    if not estimate:
        return "none"
    out = estimate.get("max_output_tokens")
    price = estimate.get("price") or {}
    cost = estimate.get("cost")
    if cost is not None:
        priced = f"${cost:,.4f} worst case ({price.get('source')}"
        priced += f", {price['version']})" if price.get("version") else ")"
    elif price.get("source") == "unknown":
        priced = f"cost unknown ({price.get('why')})"
    else:
        priced = "cost unbounded (a request sets no output cap)"
    return (
        f"{estimate.get('requests', 0):,} request(s), {estimate.get('input_tokens', 0):,} input tokens "
        f"({estimate.get('counter')}), "
        f"{'unknown' if out is None else f'{out:,}'} max output tokens; {priced}"
    )
