"""Size limits and validation rules of a batch input file: plain data, importing nothing of the package.

Dialects declare their limits with these; the JSONL validator, ``airflow-batch validate`` and the
local server read them without loading the pydantic models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MB = 1024 * 1024
#: Longest result line read (and so the longest response body sent as JSON text that is decoded).
#: Result lines are far smaller; the cap only stops a broken server from filling memory.
MAX_RESULT_LINE_BYTES = 256 * MB


@dataclass(frozen=True)
class Limits:
    """Size limits of one batch input file.

    :param max_lines: most lines in one file.
    :param max_file_bytes: largest file in bytes.
    :param max_line_bytes: largest single line in bytes (without its newline).
    :param max_upload_bytes: largest file the vendor's upload endpoint takes, when that is lower
        than ``max_file_bytes`` (None: no separate upload limit).
    """

    max_lines: int = 50_000
    max_file_bytes: int = 200 * MB
    max_line_bytes: int = 1 * MB
    max_upload_bytes: int | None = None

    @property
    def max_shard_bytes(self) -> int:
        """The largest file that can be both uploaded and run as one batch."""
        if self.max_upload_bytes is None:
            return self.max_file_bytes
        return min(self.max_file_bytes, self.max_upload_bytes)

    def tightened(
        self,
        *,
        max_lines: int | None = None,
        max_file_bytes: int | None = None,
        max_line_bytes: int | None = None,
    ) -> Limits:
        """Return limits no looser than these (a user may lower, never raise, a vendor limit)."""

        def pick(own: int, wanted: int | None) -> int:
            return own if wanted is None else min(own, int(wanted))

        return Limits(
            max_lines=pick(self.max_lines, max_lines),
            max_file_bytes=pick(self.max_shard_bytes, max_file_bytes),
            max_line_bytes=pick(self.max_line_bytes, max_line_bytes),
            max_upload_bytes=self.max_upload_bytes,
        )


@dataclass(frozen=True)
class ValidationRules:
    """What a batch input file must satisfy for one dialect (the seed 001 rules are the baseline).

    :param endpoints: urls a line may target.
    :param limits: size limits.
    :param mixed_endpoints: whether lines of one file may target different urls.
    :param unique_custom_ids: whether custom_id must be unique within the file.
    :param mixed_models: whether lines of one file may name different ``body.model`` values.
    :param max_custom_id_chars: longest custom_id the vendor accepts (None: no limit).
    :param model_endpoints: urls whose lines must name ``body.model`` (the vendor runs each
        line on its own model and has no default).
    :param required_fields: per url, the body fields a request there cannot go without.
    :param dialect: the dialect's name, for messages.
    :param model_meaning: what ``body.model`` names for this vendor, for messages.
    """

    endpoints: frozenset[str]
    limits: Limits = field(default_factory=Limits)
    mixed_endpoints: bool = False
    unique_custom_ids: bool = True
    methods: frozenset[str] = frozenset({"POST"})
    mixed_models: bool = False
    max_custom_id_chars: int | None = None
    model_endpoints: frozenset[str] = frozenset()
    required_fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    dialect: str = ""
    model_meaning: str = "the model"
