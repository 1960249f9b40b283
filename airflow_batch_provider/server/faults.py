"""Fault injection: deterministic rates, per-request overrides and counters for /admin/stats."""

from __future__ import annotations

import math
import zlib
from collections import Counter
from typing import Any

from airflow_batch_provider.server.config import FaultConfig


class Faults:
    """The live fault settings of a server and what it has injected so far.

    :param config: the settings to start with (changed later through ``update``).
    """

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self.counters: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        """Merge ``changes`` into the settings (validated); rate counters restart."""
        self.config = FaultConfig.model_validate({**self.config.model_dump(), **changes})
        self._calls.clear()
        return self.config

    def fires(self, kind: str, rate: float) -> bool:
        """Whether the next eligible call of ``kind`` gets the fault: ceil(n * rate) of the first n do.

        The first eligible call after a change always fires (for any rate > 0), so a test
        that sets a fault sees it at once.
        """
        if rate <= 0:
            return False
        n = self._calls[kind]
        self._calls[kind] = n + 1
        return math.ceil(round((n + 1) * rate, 9)) > math.ceil(round(n * rate, 9))

    def line_fails(self, batch_id: str, line: int) -> bool:
        """Whether a batch line fails; decided by a hash so a resumed batch decides the same way."""
        rate = self.config.line_failure_rate
        if rate <= 0:
            return False
        if rate >= 1:
            return True
        return zlib.crc32(f"{batch_id}:{line}".encode()) / 0xFFFFFFFF < rate

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def stats(self) -> dict[str, Any]:
        return {"faults": self.config.model_dump(), "counters": dict(self.counters)}
