"""Token prices: what prices a run, from where, and the cost of one request.

Prices come, in this order, from what the user sets (``prices`` on an operator or in the batch
connection's extra: per model, USD per 1M tokens), else from the optional ``genai-prices``
package's bundled, dated table (its snapshot only: nothing is fetched), else nowhere: the price
is unknown and no cost is given, never $0.

A user price::

    {"gpt-4o-mini": {"input": 0.15, "cached_input": 0.075, "output": 0.6, "batch_discount": 0.5,
                     "long_context": {"threshold": 200000, "input": 0.3, "output": 1.2}}}

``batch_discount`` is the share taken off these (list) prices for batch requests; give 0 when the
figures are already batch prices. Without it the dialect's known discount applies (0.5 for
OpenAI, Azure, Anthropic and Mistral), else none. ``"*"`` prices every model not named. A
long-context tier (``cached_input`` too) applies to a whole request whose input tokens exceed
its threshold, as vendors bill them: each request is priced on its own, never the run's total.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_batch_provider.dialects.base import Dialect

MILLION = 1_000_000
_FIELDS = {"input", "cached_input", "output", "batch_discount", "long_context"}
_TIER_FIELDS = {"threshold", "input", "cached_input", "output"}
PRICE_TABLE_CHOICES = ("auto", "genai-prices", "none")


@dataclass(frozen=True)
class Tier:
    """Prices (USD per 1M tokens) of a request whose input tokens exceed ``threshold``."""

    threshold: int
    input: float
    cached_input: float
    output: float


@dataclass(frozen=True)
class Price:
    """One model's prices in USD per 1M tokens, and what priced it.

    :param input: uncached input tokens.
    :param cached_input: cached input tokens (a cache read).
    :param output: output tokens.
    :param batch_discount: the share off these prices for a batch request (0..1).
    :param tiers: long-context tiers, by rising threshold.
    :param source: ``user`` or ``genai-prices``.
    :param version: the source's version and date (``genai-prices 0.2.3 (2026-11-20)``).
    :param model: the model priced.
    """

    input: float
    cached_input: float
    output: float
    batch_discount: float = 0.0
    tiers: tuple[Tier, ...] = ()
    source: str = "user"
    version: str | None = None
    model: str | None = None

    def rates(self, input_tokens: int) -> tuple[float, float, float]:
        """``(input, cached_input, output)`` per token for a request of ``input_tokens``, discounted."""
        rate_in, rate_cached, rate_out = self.input, self.cached_input, self.output
        for tier in self.tiers:
            if input_tokens > tier.threshold:
                rate_in, rate_cached, rate_out = tier.input, tier.cached_input, tier.output
        keep = (1.0 - self.batch_discount) / MILLION
        return rate_in * keep, rate_cached * keep, rate_out * keep

    def cost(self, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> float:
        """The cost of one request (USD); ``input_tokens`` includes the cached ones."""
        rate_in, rate_cached, rate_out = self.rates(input_tokens)
        cached = min(cached_tokens, input_tokens)
        return (input_tokens - cached) * rate_in + cached * rate_cached + output_tokens * rate_out

    def describe(self) -> dict[str, Any]:
        """For the manifest and the merge report: the figures and where they came from."""
        return {
            "source": self.source,
            "version": self.version,
            "model": self.model,
            "input": self.input,
            "cached_input": self.cached_input,
            "output": self.output,
            "batch_discount": self.batch_discount,
            "tiers": [vars(t) for t in self.tiers],
        }


def _number(value: Any, where: str, *, upper: float | None = None) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{where} must be a number >= 0, not {value!r}")
    if upper is not None and value > upper:
        raise ConfigurationError(f"{where} must be at most {upper}, not {value!r}")
    return float(value)


def parse_price(spec: Any, where: str, *, model: str | None, default_discount: float | None) -> Price:
    """One user price (see the module docstring), checked field by field.

    :param spec: the mapping.
    :param where: names it in errors (``connection 'x' extra prices['gpt-4o']``).
    :param model: the model it prices.
    :param default_discount: the dialect's batch discount, when the spec gives none.
    """
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{where} must be a mapping of input/cached_input/output prices")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ConfigurationError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    if "input" not in spec or "output" not in spec:
        raise ConfigurationError(f"{where} needs both 'input' and 'output' (USD per 1M tokens)")
    price_in = _number(spec["input"], f"{where}['input']")
    price_out = _number(spec["output"], f"{where}['output']")
    # A model without a cache price bills cached tokens as input: the estimate never undercounts.
    cached = _number(spec.get("cached_input", price_in), f"{where}['cached_input']")
    discount = spec.get("batch_discount", default_discount)
    discount = 0.0 if discount is None else _number(discount, f"{where}['batch_discount']", upper=1.0)
    tiers: tuple[Tier, ...] = ()
    long = spec.get("long_context")
    if long is not None:
        t_where = f"{where}['long_context']"
        shaped = isinstance(long, Mapping) and not set(long) - _TIER_FIELDS
        if not shaped or not {"threshold", "input", "output"} <= set(long):
            raise ConfigurationError(f"{t_where} must be {{threshold, input, output[, cached_input]}}")
        threshold = long["threshold"]
        if type(threshold) is not int or threshold < 0:
            raise ConfigurationError(f"{t_where}['threshold'] must be a token count, not {threshold!r}")
        t_in = _number(long["input"], f"{t_where}['input']")
        tiers = (
            Tier(
                threshold,
                t_in,
                _number(long.get("cached_input", t_in), f"{t_where}['cached_input']"),
                _number(long["output"], f"{t_where}['output']"),
            ),
        )
    return Price(price_in, cached, price_out, discount, tiers, "user", None, model)


@dataclass
class PriceBook:
    """Finds a model's price: the user's prices, else the ``genai-prices`` table, else none.

    :param user: ``{model: price spec}`` the user set (``"*"`` for any model).
    :param where: names the user's prices in errors.
    :param table: ``auto`` (the table when the package is installed), ``genai-prices`` (fail
        without it) or ``none``.
    :param provider: the table's provider id for this vendor (``Dialect.price_provider``).
    :param default_discount: the vendor's batch discount (``Dialect.batch_discount``).
    """

    user: Mapping[str, Any] = field(default_factory=dict)
    where: str = "prices"
    table: str = "auto"
    provider: str | None = None
    default_discount: float | None = None
    _misses: dict[str | None, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.user, Mapping):
            raise ConfigurationError(f"{self.where} must be a mapping of model -> prices")
        if self.table not in PRICE_TABLE_CHOICES:
            raise ConfigurationError(
                f"price_table must be one of {', '.join(PRICE_TABLE_CHOICES)}, not {self.table!r}"
            )
        # Checked now, so a typo fails before any work rather than at the first row of its model.
        for model, spec in self.user.items():
            parse_price(spec, f"{self.where}[{model!r}]", model=model, default_discount=self.default_discount)

    @classmethod
    def for_dialect(
        cls, dialect: Dialect, user: Mapping[str, Any] | None, where: str, table: str | None = None
    ) -> PriceBook:
        """A price book with the dialect's provider and batch discount."""
        return cls(
            dict(user or {}),
            where,
            table or "auto",
            dialect.price_provider,
            dialect.batch_discount,
        )

    def price(self, model: str | None) -> Price | None:
        """The model's price, or None (unknown: see :meth:`why_unknown`)."""
        spec = self.user.get(model) if model is not None else None
        name: str | None = model
        if spec is None and "*" in self.user:
            spec, name = self.user["*"], model
        if spec is not None:
            return parse_price(
                spec, f"{self.where}[{model!r}]", model=name, default_discount=self.default_discount
            )
        if self.table == "none":
            self._misses[model] = f"not in {self.where} and price_table='none'"
            return None
        if model is None:
            self._misses[model] = "the run names no model"
            return None
        return self._from_table(model)

    def why_unknown(self, model: str | None) -> str:
        """Why :meth:`price` found no price for ``model``."""
        return self._misses.get(model, f"no price for {model!r}")

    def _from_table(self, model: str) -> Price | None:
        try:
            import genai_prices
            from genai_prices import data_snapshot
        except ImportError:
            if self.table == "genai-prices":
                raise ConfigurationError(
                    "price_table='genai-prices' needs the optional package genai-prices "
                    "(pip install 'airflow-batch-provider[prices]')"
                ) from None
            self._misses[model] = f"not in {self.where}, and genai-prices is not installed"
            return None
        try:
            usage = genai_prices.Usage(input_tokens=0)
            found = genai_prices.calc_price(usage, model, provider_id=self.provider)
        except LookupError as exc:
            self._misses[model] = f"not in {self.where} nor in genai-prices {genai_prices.__version__}: {exc}"
            return None
        mp = found.model_price
        if getattr(mp, "input_mtok", None) is None:
            # A table entry without an input price is no price (never read as $0).
            self._misses[model] = f"genai-prices {genai_prices.__version__} has no input price for {model!r}"
            return None
        base_in, tiers_in = _tiered(mp.input_mtok)
        base_out, tiers_out = _tiered(mp.output_mtok)
        cache = getattr(mp, "cache_read_mtok", None)
        base_cached, tiers_cached = _tiered(cache) if cache is not None else (base_in, tiers_in)
        tiers = tuple(
            Tier(
                start,
                price,
                dict(tiers_cached).get(start, price),
                dict(tiers_out).get(start, base_out),
            )
            for start, price in tiers_in
        )
        snapshot = data_snapshot.get_snapshot()
        stamp = getattr(snapshot, "timestamp", None)
        date = stamp.date().isoformat() if stamp is not None else "bundled"
        return Price(
            base_in,
            base_cached,
            base_out,
            self.default_discount or 0.0,
            tiers,
            "genai-prices",
            f"genai-prices {genai_prices.__version__} ({date})",
            f"{found.provider.id}/{found.model.id}",
        )


def _tiered(value: Any) -> tuple[float, list[tuple[int, float]]]:
    """``(base, [(threshold, price)])`` of a genai-prices price (a number or TieredPrices)."""
    if value is None:
        return 0.0, []
    tiers = getattr(value, "tiers", None)
    if tiers is None:
        return float(value), []
    return float(value.base), [(int(t.start), float(t.price)) for t in tiers]


@dataclass(frozen=True)
class SpendSettings:
    """The spend settings a batch connection's extra may hold (every one optional)."""

    prices: Mapping[str, Any] = field(default_factory=dict)
    price_table: str | None = None
    token_counter: str | None = None
    default_max_output_tokens: int | None = None


def spend_settings(extra: Mapping[str, Any], where: str) -> SpendSettings:
    """Read ``prices``, ``price_table``, ``token_counter`` and ``default_max_output_tokens`` from a
    connection extra, each checked and named in errors with ``where``."""
    prices = extra.get("prices") or {}
    if isinstance(prices, str):
        # A connection form saves a field as text: the JSON of the mapping.
        try:
            prices = json.loads(prices)
        except ValueError:
            raise ConfigurationError(f"{where} extra 'prices' is not valid JSON") from None
    if not isinstance(prices, Mapping):
        raise ConfigurationError(f"{where} extra 'prices' must be a mapping of model -> prices")
    table = extra.get("price_table")
    if table is not None and table not in PRICE_TABLE_CHOICES:
        raise ConfigurationError(
            f"{where} extra 'price_table' must be one of {', '.join(PRICE_TABLE_CHOICES)}, not {table!r}"
        )
    counter = extra.get("token_counter")
    if counter is not None and not isinstance(counter, str):
        raise ConfigurationError(f"{where} extra 'token_counter' must be a name or 'module:function'")
    default_out = extra.get("default_max_output_tokens")
    if default_out is not None and (type(default_out) is not int or default_out < 0):
        raise ConfigurationError(f"{where} extra 'default_max_output_tokens' must be a token count")
    return SpendSettings(dict(prices), table, counter, default_out)
